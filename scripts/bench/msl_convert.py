"""MindSpeed-LLM's own checkpoint converter (`convert_ckpt_v2.py` of a checkout), run on the CPU
as its users run it, for the benchmarks: the converter is plain torch, but the package's
`__init__` patches Megatron for the NPU (torch_npu); the packages on its import path are made
empty here so that only the converter's modules load, and its coverage decorator is the identity.
Nothing of the checkout is copied. Usage: msl_convert.py MINDSPEED_LLM_DIR CONVERT_CKPT_V2_ARGS..."""
import runpy
import sys
import types


def main(checkout, argv):
    root = f"{checkout}/mindspeed_llm"
    for name, path in [("mindspeed_llm", root), ("mindspeed_llm.tasks", f"{root}/tasks"),
                       ("mindspeed_llm.training", f"{root}/training")]:
        module = types.ModuleType(name)
        module.__path__ = [path]
        sys.modules[name] = module
    utils = types.ModuleType("mindspeed_llm.training.utils")
    utils.auto_coverage = lambda f: f
    sys.modules["mindspeed_llm.training.utils"] = utils
    sys.path.insert(0, checkout)
    sys.argv = [f"{checkout}/convert_ckpt_v2.py", *argv]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
