"""Run under torchrun (or alone, one rank), one process per rank of a TP × PP (× EP) layout: megatron-core's
parallel state over gloo; each rank builds its GPTModel stage twice from the args of a torch-format
checkpoint iteration directory at that layout (first argument). The first loads its
mp_rank_TT[_PPP][_EEE] file strictly (the reference); the second loads the torch_dist checkpoint (second
argument, a root with a tracker) as Megatron's load_checkpoint does with `--ckpt-format
torch_dist`: `dist_checkpointing.load` of {model: sharded_state_dict} — here with every missing or
unexpected key an error (StrictHandling.RAISE_ALL) — then `load_state_dict(strict=True)`. Every
tensor of the two must be equal, and common.pt must load with torch's weights_only unpickler.
Prints one line per rank."""
import pathlib
import sys

import torch

import megatron_cpu


def main(iteration_dir, dist_root):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling
    name, reference, obj = megatron_cpu.rank_stage(iteration_dir)
    iteration = (dist_root / "latest_checkpointed_iteration.txt").read_text().strip()
    dist_dir = dist_root / f"iter_{int(iteration):07d}"
    common = megatron_cpu.load_pt(dist_dir / "common.pt")
    assert common["args"].ckpt_format == "torch_dist", common["args"].ckpt_format
    assert common["content_metadata"]["singleton_local_shards"] is False, common
    model = megatron_cpu.stage_model(obj["args"])
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(dist_dir),
                                     strict=StrictHandling.RAISE_ALL)
    model.load_state_dict(loaded["model"], strict=True)
    want, got = reference.state_dict(), model.state_dict()
    assert want.keys() == got.keys(), (want.keys() ^ got.keys())
    tensors = 0
    for k, t in want.items():
        if isinstance(t, torch.Tensor):
            assert torch.equal(t, got[k]), k
            tensors += 1
    print(f"rank {torch.distributed.get_rank()}: {name} loaded {tensors} tensors equal", flush=True)


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]))
