"""Run under torchrun, one process per rank of a TP × EP checkpoint iteration directory (the
first argument; one pipeline stage): megatron-core's parallel state over gloo with
expert_model_parallel_size and expert_tensor_parallel_size (whole experts at 1), then that rank's GPTModel (MoELayer, SequentialMLP with its
num_experts / EP local experts, all-gather dispatcher over the TP × EP group) loads its
mp_rank_TT_EEE file strictly, and the ranks run one forward pass together. Rank 0 compares the
gathered logits with transformers' model of the HF directory (second argument) and prints the
largest difference; every rank prints one line."""
import contextlib
import os
import pathlib
import sys

import torch


def main(iteration_dir, hf_dir):
    import megatron_cpu
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
    from megatron.core.transformer.moe import moe_utils
    torch.distributed.init_process_group("gloo")
    rank0 = sorted(iteration_dir.glob("mp_rank_*"))[0]
    a = megatron_cpu.load_pt(rank0 / "model_optim_rng.pt")["args"]
    tp_size, ep_size = a.tensor_model_parallel_size, a.expert_model_parallel_size
    etp_size = getattr(a, "expert_tensor_parallel_size", None)
    parallel_state.initialize_model_parallel(tp_size, 1, expert_model_parallel_size=ep_size,
                                             expert_tensor_parallel_size=etp_size)
    tensor_parallel.random.get_cuda_rng_tracker().fork = lambda *x, **k: contextlib.nullcontext()
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    tp = parallel_state.get_tensor_model_parallel_rank()
    ep = parallel_state.get_expert_model_parallel_rank()
    name = f"mp_rank_{tp:02d}_{ep:03d}" if ep_size > 1 else f"mp_rank_{tp:02d}"
    obj = megatron_cpu.load_pt(iteration_dir / name / "model_optim_rng.pt")
    model = megatron_cpu.gpt_model(obj["args"]).eval()
    result = model.load_state_dict(obj["model"], strict=True)
    assert not result.missing_keys and not result.unexpected_keys, result
    ids = torch.randint(0, a.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    b, s = ids.shape
    pos = torch.arange(s).unsqueeze(0).expand(b, -1)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None].expand(b, 1, s, s)
    with torch.no_grad():
        got = gather_from_tensor_model_parallel_region(model(ids, pos, mask))[..., :a.vocab_size]
    line = f"rank {torch.distributed.get_rank()}: tp {tp} ep {ep}: {len(obj['model'])} tensors loaded"
    if torch.distributed.get_rank() == 0:
        from transformers import AutoModelForCausalLM
        ref = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            want = ref(ids).logits
        line += f"; logits differ by {(got - want).abs().max().item():.3e}"
    print(line, flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(__file__))
    main(*map(pathlib.Path, sys.argv[1:]))
