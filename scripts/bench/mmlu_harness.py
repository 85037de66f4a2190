"""The harness's side of scripts/bench-mmlu.sh: 5-shot MMLU on the val split of every subject in
DATA/mmlu (first LIMIT questions each), HF backend, fp32, batch 1, THREADS torch threads. Builds
mindkit's csv tree beside it (tests/interop/mmlu_local.py) and prints one JSON line: documents,
wall seconds (model load included), accuracy.
    python mmlu_harness.py SMOLLM2_DIR DATA WORK LIMIT THREADS"""
import json
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tests/interop"))
import mmlu_local  # noqa: E402


def main(model, data, work, limit, threads):
    import torch
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    torch.set_num_threads(threads)
    subjects = sorted(p.name[: -len("_val.csv")] for p in (data / "mmlu/val").glob("*_val.csv"))
    _, tasks, names = mmlu_local.build(data, work, subjects)
    os.environ["HF_HUB_OFFLINE"] = "1"
    start = time.perf_counter()
    out = simple_evaluate(model="hf", model_args=f"pretrained={model},dtype=float32", tasks=names,
                          num_fewshot=5, limit=limit, batch_size=1, device="cpu",
                          task_manager=TaskManager(include_path=str(tasks)))
    secs = time.perf_counter() - start
    docs = sum(out["n-samples"][n]["effective"] for n in names)
    hits = sum(out["results"][n]["acc,none"] * out["n-samples"][n]["effective"] for n in names)
    print(json.dumps({"docs": docs, "seconds": secs, "acc": hits / docs}))


if __name__ == "__main__":
    main(sys.argv[1], pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3]), int(sys.argv[4]),
         int(sys.argv[5]))
