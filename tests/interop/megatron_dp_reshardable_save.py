"""Run under torchrun, a process per data-parallel rank (or alone, one rank): megatron-core
0.15's default torch_dist save of the distributed optimizer, made by its own
DistributedOptimizer from the torch-format checkpoint iteration directory given first (TP 1 ×
PP 1, any EP, saved with --use-distributed-optimizer, with or without --bf16): each rank's GPTModel loaded
strictly, DistributedDataParallel and get_megatron_optimizer as Megatron builds them (under expert
parallelism two chained DistributedOptimizers, the routed experts' of their own), the
buffers' state loaded from distrib_optim.pt by load_parameter_state_from_dp_zero and the step
set, then save_checkpoint's dist_checkpointing.save of {args, checkpoint_version, iteration,
opt_param_scheduler, model, optimizer} with the optimizer in its default `dp_reshardable` form,
into the directory given second, the tracker beside it (another sharding type, e.g. the
deprecated `fully_sharded_model_space` that older Megatron-LM versions saved by default, given third).

Beyond megatron_cpu's patches: tensors megatron-core asks on 'cuda' are made on the CPU, and
parameters' type() is named as CUDA's, which the DistributedOptimizer requires; torch's AdamW
keeps a per-parameter `step` that the FusedAdam of Apex or Transformer Engine (which GPU runs
use) does not, so it stays out of the per-bucket states, as with those optimizers."""
import pathlib
import sys

import torch

import megatron_cpu


def cpu_patches():
    make = torch.tensor

    def on_cpu(*a, **k):
        if str(k.get("device", "")).startswith("cuda"):
            k["device"] = "cpu"
        return make(*a, **k)

    torch.tensor = on_cpu
    kind = torch.Tensor.type
    torch.Tensor.type = lambda self, *a, **k: (
        kind(self, *a, **k) if a or k else kind(self).replace("torch.", "torch.cuda.", 1))
    torch.cuda.synchronize = lambda *a, **k: None


def without_step(dist):
    """`dist`'s per-bucket states without torch AdamW's per-parameter step, as FusedAdam's."""
    states = dist._get_main_param_and_optimizer_states

    def fused_adam_states(param):
        tensors = states(param)
        tensors.pop("step", None)
        return tensors

    dist._get_main_param_and_optimizer_states = fused_adam_states


def main(iteration_dir, out, sharding):
    cpu_patches()
    from megatron.core import dist_checkpointing
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    name, model, obj = megatron_cpu.rank_stage(iteration_dir)
    a = obj["args"]
    bf16 = bool(getattr(a, "bf16", False))
    if bf16:
        model.to(torch.bfloat16)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=True), model)
    opt = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=a.lr, min_lr=a.min_lr, weight_decay=a.weight_decay,
        adam_beta1=a.adam_beta1, adam_beta2=a.adam_beta2, adam_eps=a.adam_eps,
        clip_grad=a.clip_grad, use_distributed_optimizer=True, bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32), [ddp])
    # one optimizer, or (routed experts under expert parallelism) the dense parameters' and
    # the experts', whose states distrib_optim.pt holds as a list (ChainedOptimizer
    # load_parameter_state: each read on its data-parallel group's rank 0)
    chained = opt.chained_optimizers
    saved = None
    for i, dist in enumerate(chained):
        dist._init_optimizer_states_with_dummy_values()
        for state in dist.optimizer.state.values():
            del state["step"]  # (not in distrib_optim.pt's buckets either)
        if dist.data_parallel_group.rank() == 0 and saved is None:
            saved = megatron_cpu.load_pt(iteration_dir / name / "distrib_optim.pt")
        mine = saved if len(chained) == 1 else (saved[i] if saved else None)
        with torch.no_grad():
            dist.load_parameter_state_from_dp_zero(mine)
        for state in dist.optimizer.state.values():
            state["step"] = torch.tensor(float(obj["iteration"]))
        without_step(dist)
    model_state = model.sharded_state_dict()
    state = {"args": a, "checkpoint_version": 3.0, "iteration": obj["iteration"],
             "opt_param_scheduler": obj["opt_param_scheduler"], "model": model_state,
             "optimizer": opt.sharded_state_dict(
                 model_state, metadata={"distrib_optim_sharding_type": sharding})}
    it = out / f"iter_{obj['iteration']:07d}"
    rank = torch.distributed.get_rank()
    if rank == 0:
        it.mkdir(parents=True, exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save(state, str(it))
    if rank == 0:
        (out / "latest_checkpointed_iteration.txt").write_text(str(obj["iteration"]))
    print(f"rank {rank}: {name} saved", flush=True)


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]),
         sys.argv[3] if len(sys.argv) > 3 else "dp_reshardable")
