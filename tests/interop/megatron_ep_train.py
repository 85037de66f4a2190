"""Run under torchrun (two processes, gloo): megatron-core's own expert-parallel training of a
Megatron checkpoint saved at EP 2, as the reference `mindkit train --expert-model-parallel-size 2`
is checked against. Each process is data-parallel rank r = expert-parallel rank r of
`parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=2)` (the
expert-data-parallel group has one rank); it builds megatron-core's GPTModel (MoELayer,
SequentialMLP holding its two of the four experts, MoEAllGatherTokenDispatcher gathering the rows
of both ranks over the tp_ep group), loads its mp_rank_00_00{ep} file strictly, wraps it in
megatron-core's DistributedDataParallel (the dense parameters' buffer reduced over the
data-parallel group, the experts' — allreduce=False — over the expert-data-parallel group, both
scaled by 1/dp as average_in_collective=False does) and steps megatron-core's ChainedOptimizer
from get_megatron_optimizer (torch's AdamW under FP32Optimizer, one for the dense parameter
groups and one for the expert-parallel ones; its grad norm √(dense² + experts² over EP)) with
OptimizerParamScheduler stepped by the global batch size. The data are megatron-core's GPTDataset
samples as MegatronPretrainingSampler deals them (rank r takes the r-th mbs-slice of every
mbs·dp chunk); the loss is averaged as Megatron does (schedules.forward_step_calc_loss per
micro-batch, the logged lm loss the global batch's token-weighted mean over both ranks) and the
MoE auxiliary losses are logged by megatron-core's track_moe_metrics (averaged over the
data-parallel group). With --layout whole the two processes are instead tensor-parallel ranks
(TP 2 with sequence parallelism, one data-parallel rank) and expert-parallel ranks of whole
experts (expert_tensor_parallel_size 1), files mp_rank_00_000 and mp_rank_01_001; with --layout
tp-ep four processes, TP 2 with sequence parallelism × DP 2 = EP 2 (the experts split over TP),
every mp_rank_TT_EEE; with --layout etp2 four processes, TP 4 with sequence parallelism, each
expert in halves over a block of two TP ranks (expert_tensor_parallel_size 2), the two blocks the
expert-parallel ranks (files mp_rank_00_000, 01_000, 02_001, 03_001); the logits are gathered
over TP for the loss. --capacity F sets
moe_expert_capacity_factor (token dropping, each sequence-parallel rank's router call apart).

Arguments: the EP 2 start checkpoint's iteration directory, the data prefix, the number of
iterations, an output directory; optionally, an iteration directory of mindkit's EP 2 checkpoint,
which each rank then resumes as Megatron's load_checkpoint would: the model strictly, and the
`optimizer` list into a fresh ChainedOptimizer (load_state_dict), every moment shaped as its
parameter, and the scheduler state. The last rank writes history.json to the output directory; every
rank writes its final weights (model_{rank file}.pt) and its ChainedOptimizer.state_dict()
(optimizer_{rank file}.pt) there.

What a CPU run needs changed (beside megatron_cpu's patches): megatron-core's FP32Optimizer keeps
a loss-scale tensor on 'cuda', and its clip_grads helpers use 'cuda' buffers and assert CUDA
gradients, so FP32Optimizer's constructor is run with its scale on the CPU and the two helpers
ChainedOptimizer.step calls (get_grad_norm_fp32, clip_grad_by_total_norm_fp32) are replaced by
CPU ones doing what their fallback without Transformer Engine / apex does (the norm of the
per-tensor norms, its square summed over the optimizer's grad-stats group; one coefficient
max_norm / (norm + 1e-6) when below 1)."""
import argparse
import contextlib
import json
import os
import pathlib
import sys

import torch
import torch.nn.functional as F

SEQ, MBS, GBS = 48, 2, 8
LR, MIN_LR, WARMUP, WD, CLIP = 1e-3, 1e-4, 3, 0.1, 1.0
MOE_LOSSES = dict(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01,
                  moe_z_loss_coeff=0.001)


def cpu_patches():
    from megatron.core.optimizer import optimizer as mcore_optimizer

    def fp32_init(self, optimizer, config, init_state_fn):
        mcore_optimizer.MegatronOptimizer.__init__(self, optimizer, config, init_state_fn)
        self._scale = torch.tensor([1.0], dtype=torch.float)
        self.is_stub_optimizer = optimizer is None

    mcore_optimizer.FP32Optimizer.__init__ = fp32_init

    def grad_norm_fp32(grads_for_norm, norm_type=2, grad_stats_parallel_group=None):
        # megatron-core optimizer/clip_grads.py get_grad_norm_fp32 with utils.py's
        # local_multi_tensor_l2_norm: ‖(‖g‖ for g)‖, squared, summed over the group.
        assert norm_type == 2
        if isinstance(grads_for_norm, torch.Tensor):
            grads_for_norm = [grads_for_norm]
        norms = [torch.norm(g) for g in grads_for_norm]
        total = torch.norm(torch.stack(norms)) if norms else torch.zeros(())
        total = (total.float() ** 2).reshape(1)
        torch.distributed.all_reduce(total, group=grad_stats_parallel_group)
        return total.item() ** 0.5

    def clip_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
        # clip_grads.py clip_grad_by_total_norm_fp32 (local_multi_tensor_scale: g ← g · coeff).
        assert not use_decoupled_grad
        coeff = max_norm / (total_norm + 1.0e-6)
        if coeff < 1.0:
            for p in parameters:
                if p.grad is not None:
                    p.grad.detach().copy_(p.grad.detach() * coeff)

    mcore_optimizer.get_grad_norm_fp32 = grad_norm_fp32
    mcore_optimizer.clip_grad_by_total_norm_fp32 = clip_by_total_norm_fp32


def build(start_args):
    """GPTModel (MoE losses on) in DistributedDataParallel, megatron-core's ChainedOptimizer over
    it and the scheduler, in the current parallel state."""
    import megatron_cpu
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    gpt = megatron_cpu.gpt_model(start_args, moe_losses=MOE_LOSSES)
    # Megatron-LM training.get_model: DDP with the defaults of its flags (no overlap, fp32,
    # average_in_collective False).
    model = DistributedDataParallel(gpt.config, DistributedDataParallelConfig(), gpt)
    opt = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=LR, min_lr=MIN_LR, weight_decay=WD, adam_beta1=0.9, adam_beta2=0.999,
        adam_eps=1e-8, clip_grad=CLIP, bf16=False, fp16=False, use_distributed_optimizer=False),
        [model])
    sched = OptimizerParamScheduler(
        opt, init_lr=0.0, max_lr=LR, min_lr=MIN_LR, lr_warmup_steps=WARMUP * GBS,
        lr_decay_steps=ITERS * GBS, lr_decay_style="cosine", start_wd=WD, end_wd=WD,
        wd_incr_steps=ITERS * GBS, wd_incr_style="constant")
    return gpt, model, opt, sched


# --layout: tensor-parallel size, expert tensor-parallel size, processes
LAYOUTS = {"ep2": (1, None, 2), "whole": (2, 1, 2), "tp-ep": (2, None, 4), "etp2": (4, 2, 4)}


def main(start_dir, prefix, out, mindkit_dir=None, layout="ep2", capacity=None):
    import megatron_cpu
    import train_reference
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.utils import get_blend_from_list
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.router import MoEAuxLossAutoScaler
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
    torch.distributed.init_process_group("gloo")
    # whole experts: TP 2 with sequence parallelism and expert tensor parallelism 1, the
    # expert-parallel group spanning the two tensor-parallel ranks
    tp_size, etp_size, world = LAYOUTS[layout]
    assert torch.distributed.get_world_size() == world
    parallel_state.initialize_model_parallel(tp_size, 1, expert_model_parallel_size=2,
                                             expert_tensor_parallel_size=etp_size)
    tensor_parallel.random.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    cpu_patches()
    megatron_cpu.sequence_parallel_norms()
    dp = parallel_state.get_data_parallel_world_size()
    rank = parallel_state.get_data_parallel_rank()
    ep = parallel_state.get_expert_model_parallel_rank()
    tp = parallel_state.get_tensor_model_parallel_rank()
    assert dp == world // tp_size and parallel_state.get_expert_model_parallel_world_size() == 2
    # the expert view numbers ETP fastest: with experts split over fewer ranks than TP, the
    # expert-parallel rank is the TP rank's block of ETP; otherwise the data-parallel rank
    assert ep == (tp // etp_size if etp_size and etp_size < tp_size else rank)
    assert parallel_state.get_expert_data_parallel_world_size() == 1
    name = f"mp_rank_{tp:02d}_{ep:03d}"
    start = megatron_cpu.load_pt(start_dir / name / "model_optim_rng.pt")
    a = start["args"]
    a.sequence_parallel = tp_size > 1
    a.moe_expert_capacity_factor = capacity
    gpt, model, opt, sched = build(a)
    result = gpt.load_state_dict(start["model"], strict=True)
    assert not result.missing_keys and not result.unexpected_keys, result
    moe_layers = sum(a.moe_layer_freq) if isinstance(a.moe_layer_freq, list) else None
    experts = [n for n, p in gpt.named_parameters() if not getattr(p, "allreduce", True)]
    assert experts and all(".local_experts." in n for n in experts), experts
    # What runs: the all-gather dispatcher over both ranks, the experts in their own DDP buffer,
    # and two optimizers whose grad-stats groups differ (so the norm is √(dense² + experts²)).
    dispatchers = [m.token_dispatcher for m in gpt.modules() if hasattr(m, "token_dispatcher")]
    assert len(dispatchers) == moe_layers and all(
        type(d).__name__ == "MoEAllGatherTokenDispatcher" and d.ep_size == 2
        and d.tp_ep_group.size() == (etp_size or tp_size) * 2
        for d in dispatchers)
    assert len(model.buffers) == 1 and len(model.expert_parallel_buffers) == 1
    assert len(opt.chained_optimizers) == 2 and not opt.grads_states_parallel_group_is_shared()

    config = GPTDatasetConfig(
        random_seed=1234, sequence_length=SEQ, blend=get_blend_from_list([prefix]), split="1",
        path_to_cache=None, reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False, tokenizer=train_reference.Tokenizer(2))
    dataset, _, _ = BlendedMegatronDatasetBuilder(
        GPTDataset, [ITERS * GBS, None, None], lambda: True, config).build()
    k_micro = GBS // (MBS * dp)  # get_num_microbatches()
    # schedules.forward_step_calc_loss: the auxiliary losses' backward scale (no loss scaler).
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0 / k_micro))
    history = []
    model.train()
    for it in range(ITERS):
        model.zero_grad_buffer()
        opt.zero_grad()
        sums = torch.zeros(2)
        for j in range(k_micro):
            # MegatronPretrainingSampler: rank r's j-th micro-batch is the r-th MBS-slice of the
            # j-th MBS·dp chunk of the global batch.
            first = it * GBS + j * MBS * dp + rank * MBS
            batch = [dataset[i] for i in range(first, first + MBS)]
            tokens = torch.stack([b["tokens"] for b in batch])
            labels = torch.stack([b["labels"] for b in batch])
            mask = torch.stack([b["loss_mask"] for b in batch]).view(-1).float()
            b, s = tokens.shape
            pos = torch.arange(s).unsqueeze(0).expand(b, -1)
            causal = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None].expand(b, 1, s, s)
            logits = model(tokens, pos, causal).float()
            if tp_size > 1:
                logits = gather_from_tensor_model_parallel_region(logits)
            losses = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1),
                                     reduction="none")
            loss, n = torch.sum(losses * mask), mask.sum()
            sums += torch.stack([loss.detach(), n])
            (loss / torch.clamp(n, min=1) / k_micro).backward()
        finalize_model_grads([model])
        ok, grad_norm, _ = opt.step()
        assert ok
        sched.step(increment=GBS)
        # training.train_step: each key's (sum, tokens) summed over the micro-batches and the
        # data-parallel group, then divided.
        torch.distributed.all_reduce(sums, group=parallel_state.get_data_parallel_group())
        moe = {}
        moe_utils.track_moe_metrics(loss_scale=1.0 / k_micro, iteration=it + 1, writer=None,
                                    total_loss_dict=moe, num_layers=a.num_layers,
                                    moe_layer_freq=a.moe_layer_freq)
        lr = float(torch.tensor(opt.param_groups[0]["lr"], dtype=torch.float32))
        history.append({"lm loss": (sums[0] / sums[1]).item(), "grad-norm": grad_norm,
                        "learning-rate": lr, **{k: float(v) for k, v in moe.items()}})
    out.mkdir(parents=True, exist_ok=True)
    torch.save(gpt.state_dict(), out / f"model_{name}.pt")
    torch.save(opt.state_dict(), out / f"optimizer_{name}.pt")
    # Megatron-LM's training_log prints on the last rank (print_rank_last): under sequence
    # parallelism its z_loss is that rank's rows' (tracked with no reduce group).
    if torch.distributed.get_rank() == torch.distributed.get_world_size() - 1:
        (out / "history.json").write_text(json.dumps({"moe_layers": moe_layers, "history": history}))
    line = f"rank {torch.distributed.get_rank()}: ep {ep}: trained {ITERS} iterations"
    if mindkit_dir is not None:
        line += "; " + resume(mindkit_dir / name / "model_optim_rng.pt", a)
    print(line, flush=True)
    torch.distributed.destroy_process_group()


def resume(path, start_args):
    """Megatron's load_checkpoint of mindkit's rank file: the model strictly into a fresh
    GPTModel, the `optimizer` entry through ChainedOptimizer.load_state_dict, the scheduler's
    through OptimizerParamScheduler.load_state_dict."""
    import megatron_cpu
    obj = megatron_cpu.load_pt(path)
    assert obj["iteration"] == ITERS and obj["args"].consumed_train_samples == ITERS * GBS
    assert obj["args"].expert_model_parallel_size == 2
    gpt, model, opt, sched = build(start_args)
    result = gpt.load_state_dict(obj["model"], strict=True)
    assert not result.missing_keys and not result.unexpected_keys, result
    saved = obj["optimizer"]
    assert isinstance(saved, list) and len(saved) == len(opt.chained_optimizers) == 2, type(saved)
    opt.load_state_dict(saved)
    moments = 0
    for index, part in enumerate(opt.chained_optimizers):
        for group in part.optimizer.param_groups:
            assert group["is_expert_parallel"] == (index == 1)
            for p in group["params"]:
                assert getattr(p, "allreduce", True) == (index == 0)
                state = part.optimizer.state[p]
                assert state["exp_avg"].shape == p.shape and state["exp_avg_sq"].shape == p.shape
                assert int(state["step"]) == ITERS
                moments += 1
    sched.load_state_dict(obj["opt_param_scheduler"])
    assert sched.num_steps == ITERS * GBS
    return f"resumed mindkit's checkpoint: {moments} parameters' moments"


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    parser = argparse.ArgumentParser()
    parser.add_argument("start", type=pathlib.Path)
    parser.add_argument("data")
    parser.add_argument("iters", type=int)
    parser.add_argument("out", type=pathlib.Path)
    parser.add_argument("mindkit", type=pathlib.Path, nargs="?")
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="ep2")
    parser.add_argument("--capacity", type=float)
    cli = parser.parse_args()
    ITERS = cli.iters
    main(cli.start, cli.data, cli.out, cli.mindkit, cli.layout, cli.capacity)
