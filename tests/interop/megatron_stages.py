"""Run under torchrun, one process per rank of a TP × PP checkpoint iteration directory (the
only argument): megatron-core's parallel state over gloo, then, as Megatron's get_model and
load_checkpoint do on each rank, that rank's GPTModel stage — or, with a virtual pipeline, each of
its model chunks (pre/post process and vp_stage as Megatron sets them) — loads its
mp_rank_TT_PPP file (`model`, or `model0`, `model1`, …) strictly, and torch's AdamW over
megatron-core's parameter groups of the stage's chunks loads its optimizer state, every moment
shaped as its parameter; with the distributed optimizer, each chunk's buffer in distrib_optim.pt
is laid out as megatron-core's DistributedDataParallel of the chunk lays it (bucketing disabled
after the first chunk, as Megatron's get_model wraps them). With an HF directory of the same checkpoint as the second argument,
every layer of every chunk (megatron-core's own layer numbering of the chunk) holds that HF
layer's down projection (this rank's shard). Prints one line per rank."""
import contextlib
import os
import pathlib
import sys

import torch

import megatron_cpu


def same_layers(chunks, hf_dir, tp, tp_size):
    """Each chunk's layers, by megatron-core's global layer_number, hold the HF model's."""
    from safetensors.torch import load_file
    hf = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        hf.update(load_file(f))
    seen = []
    for model in chunks:
        for j, layer in enumerate(model.decoder.layers):
            down = hf[f"model.layers.{layer.layer_number - 1}.mlp.down_proj.weight"]
            mine = model.state_dict()[f"decoder.layers.{j}.mlp.linear_fc2.weight"]
            assert torch.equal(down.chunk(tp_size, dim=1)[tp].to(mine.dtype), mine), layer.layer_number
            seen.append(layer.layer_number)
    return seen


def check_optimizer(chunks, obj, groups):
    """torch's AdamW over megatron-core's parameter groups of the chunks loads the state."""
    opt = torch.optim.AdamW(groups, lr=obj["args"].lr, weight_decay=obj["args"].weight_decay)
    mine = [len(g["params"]) for g in obj["optimizer"]["param_groups"]]
    theirs = [len(g["params"]) for g in opt.param_groups]
    assert mine == theirs, (mine, theirs, [[n for n, p in m.named_parameters()] for m in chunks])
    opt.load_state_dict(obj["optimizer"])
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state[p]
            assert state["exp_avg"].shape == p.shape and state["exp_avg_sq"].shape == p.shape
    return f"{sum(len(g['params']) for g in opt.param_groups)} optimizer states"


def check_buffers(chunks, obj, state):
    """Each chunk's buffer in distrib_optim.pt is megatron-core's DDP's of the chunk."""
    a = obj["args"]
    assert sorted(k for k in state if k != "buckets_coalesced") == list(range(len(chunks)))
    bucket_size = a.ddp_bucket_size if a.overlap_grad_reduce else None
    for v, model in enumerate(chunks):
        (saved,) = state[v].values()
        weights = obj[f"model{v}" if len(chunks) > 1 else "model"]
        megatron_cpu.same_buffer(model, weights, saved, bucket_size, disable_bucketing=v > 0)
    return f"{len(chunks)} buffer(s) as megatron-core's"


def main(iteration_dir, hf_dir=None):
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.optimizer import _get_param_groups
    torch.distributed.init_process_group("gloo")
    a = megatron_cpu.load_pt(iteration_dir / "mp_rank_00_000/model_optim_rng.pt")["args"]
    vpp = getattr(a, "virtual_pipeline_model_parallel_size", None)
    parallel_state.initialize_model_parallel(a.tensor_model_parallel_size, a.pipeline_model_parallel_size, vpp)
    tensor_parallel.random.get_cuda_rng_tracker().fork = lambda *x, **k: contextlib.nullcontext()
    tp = parallel_state.get_tensor_model_parallel_rank()
    pp = parallel_state.get_pipeline_model_parallel_rank()
    obj = megatron_cpu.load_pt(iteration_dir / f"mp_rank_{tp:02d}_{pp:03d}/model_optim_rng.pt")
    chunks = []
    for v in range(vpp or 1):
        stage = dict(ignore_virtual=vpp is None, vp_stage=v if vpp else None)
        model = megatron_cpu.gpt_model(obj["args"], parallel_state.is_pipeline_first_stage(**stage),
                                       parallel_state.is_pipeline_last_stage(**stage), stage["vp_stage"])
        result = model.load_state_dict(obj[f"model{v}" if vpp else "model"], strict=True)
        assert not result.missing_keys and not result.unexpected_keys, (v, result)
        chunks.append(model)
    layers = same_layers(chunks, hf_dir, tp, a.tensor_model_parallel_size) if hf_dir else []
    groups = _get_param_groups(chunks, None, None, 1.0, a.lr, a.min_lr, None, None)
    distributed = iteration_dir / f"mp_rank_{tp:02d}_{pp:03d}/distrib_optim.pt"
    if distributed.exists():
        states = check_buffers(chunks, obj, torch.load(distributed, weights_only=True))
        # beside the model, the optimizer's groups without ids
        assert len(obj["optimizer"]["optimizer"]["param_groups"]) == len(groups)
    else:
        states = check_optimizer(chunks, obj, groups)
    tensors = sum(len(m.state_dict()) for m in chunks)
    print(f"rank {torch.distributed.get_rank()}: tp {tp} pp {pp}: {len(chunks)} chunk(s), layers {layers}, "
          f"{tensors} tensors loaded, {states}", flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(__file__))
    main(*map(pathlib.Path, sys.argv[1:]))
