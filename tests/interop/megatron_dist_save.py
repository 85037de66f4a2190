"""Run under torchrun (or alone, one rank), one process per rank of a TP × PP torch-format
checkpoint iteration directory (first argument): megatron-core's parallel state over gloo, each
rank's GPTModel stage loads its mp_rank_TT[_PPP] file strictly, and then all ranks save the
model as Megatron's save_checkpoint does with `--ckpt-format torch_dist` (megatron-core
dist_checkpointing.save of {args, checkpoint_version, iteration, model: sharded_state_dict}) into
the directory given as second argument, with the tracker file beside it. Prints one line per
rank."""
import contextlib
import os
import pathlib
import sys

import torch

import megatron_cpu


def main(iteration_dir, out):
    from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
    # megatron-core's filesystem writer synchronizes CUDA, which a CPU run has not
    torch.cuda.synchronize = lambda *a, **k: None
    if not torch.distributed.is_initialized():
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
    torch.distributed.init_process_group("gloo")
    names = sorted(p.name for p in iteration_dir.glob("mp_rank_*"))
    a = megatron_cpu.load_pt(iteration_dir / names[0] / "model_optim_rng.pt")["args"]
    parallel_state.initialize_model_parallel(a.tensor_model_parallel_size,
                                             a.pipeline_model_parallel_size)
    tensor_parallel.random.get_cuda_rng_tracker().fork = lambda *x, **k: contextlib.nullcontext()
    tp = parallel_state.get_tensor_model_parallel_rank()
    pp = parallel_state.get_pipeline_model_parallel_rank()
    name = f"mp_rank_{tp:02d}_{pp:03d}" if a.pipeline_model_parallel_size > 1 else f"mp_rank_{tp:02d}"
    obj = megatron_cpu.load_pt(iteration_dir / name / "model_optim_rng.pt")
    model = megatron_cpu.gpt_model(obj["args"], parallel_state.is_pipeline_first_stage(),
                                   parallel_state.is_pipeline_last_stage())
    model.load_state_dict(obj["model"], strict=True)
    args = obj["args"]
    args.ckpt_format = "torch_dist"
    state = {"args": args, "checkpoint_version": 3.0, "iteration": 7,
             "model": model.sharded_state_dict()}
    it = out / "iter_0000007"
    if torch.distributed.get_rank() == 0:
        it.mkdir(parents=True, exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save(state, str(it))
    if torch.distributed.get_rank() == 0:
        (out / "latest_checkpointed_iteration.txt").write_text("7")
    print(f"rank {torch.distributed.get_rank()}: {name} saved", flush=True)


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]))
