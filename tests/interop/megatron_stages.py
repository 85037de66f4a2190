"""Run under torchrun, one process per rank of a TP × PP checkpoint iteration directory (the
only argument): megatron-core's parallel state over gloo, then, as Megatron's load_checkpoint
does on each rank, that rank's GPTModel stage (pre/post process as Megatron sets them) loads its
mp_rank_TT_PPP file strictly and torch's AdamW over megatron-core's parameter groups of the
stage loads its optimizer state, every moment shaped as its parameter. Prints one line per rank."""
import contextlib
import os
import pathlib
import sys

import torch

import megatron_cpu


def main(iteration_dir):
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.optimizer import _get_param_groups
    torch.distributed.init_process_group("gloo")
    a = megatron_cpu.load_pt(iteration_dir / "mp_rank_00_000/model_optim_rng.pt")["args"]
    parallel_state.initialize_model_parallel(a.tensor_model_parallel_size, a.pipeline_model_parallel_size)
    tensor_parallel.random.get_cuda_rng_tracker().fork = lambda *x, **k: contextlib.nullcontext()
    tp = parallel_state.get_tensor_model_parallel_rank()
    pp = parallel_state.get_pipeline_model_parallel_rank()
    obj = megatron_cpu.load_pt(iteration_dir / f"mp_rank_{tp:02d}_{pp:03d}/model_optim_rng.pt")
    model = megatron_cpu.gpt_model(obj["args"], parallel_state.is_pipeline_first_stage(),
                                   parallel_state.is_pipeline_last_stage())
    result = model.load_state_dict(obj["model"], strict=True)
    assert not result.missing_keys and not result.unexpected_keys, result
    groups = _get_param_groups([model], None, None, 1.0, a.lr, a.min_lr, None, None)
    opt = torch.optim.AdamW(groups, lr=a.lr, weight_decay=a.weight_decay)
    mine = [len(g["params"]) for g in obj["optimizer"]["param_groups"]]
    theirs = [len(g["params"]) for g in opt.param_groups]
    assert mine == theirs, (mine, theirs, [[n for n, p in model.named_parameters()]])
    opt.load_state_dict(obj["optimizer"])
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state[p]
            assert state["exp_avg"].shape == p.shape and state["exp_avg_sq"].shape == p.shape
    print(f"rank {torch.distributed.get_rank()}: tp {tp} pp {pp}: {len(obj['model'])} tensors loaded, "
          f"{sum(len(g['params']) for g in opt.param_groups)} optimizer states", flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(__file__))
    main(pathlib.Path(sys.argv[1]))
