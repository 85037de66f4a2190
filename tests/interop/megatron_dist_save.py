"""Run under torchrun (or alone, one rank), one process per rank of a TP × PP torch-format
checkpoint iteration directory (first argument): megatron-core's parallel state over gloo, each
rank's GPTModel stage loads its mp_rank_TT[_PPP] file strictly, and then all ranks save the
model as Megatron's save_checkpoint does with `--ckpt-format torch_dist` (megatron-core
dist_checkpointing.save of {args, checkpoint_version, iteration, model: sharded_state_dict}) into
the directory given as second argument, with the tracker file beside it. Prints one line per
rank."""
import pathlib
import sys

import torch

import megatron_cpu


def main(iteration_dir, out):
    from megatron.core import dist_checkpointing
    # megatron-core's filesystem writer synchronizes CUDA, which a CPU run has not
    torch.cuda.synchronize = lambda *a, **k: None
    name, model, obj = megatron_cpu.rank_stage(iteration_dir)
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
