"""Whether two Megatron torch-format checkpoints hold the same model: the same rank files, and in
each the same keys with tensors equal in shape, dtype and every element (`_extra_state` keys
skipped). Rank files are memory-mapped one pair at a time. Exits 1 on any difference.
Usage: same_megatron.py DIR_A DIR_B"""
import argparse
import sys
from pathlib import Path

import torch


def rank_files(d):
    latest = sorted(Path(d).glob("iter_*"))[-1]
    return {p.parent.name: p for p in latest.glob("mp_rank_*/model_optim_rng.pt")}


def model(path):
    # MindSpeed-LLM's converter pickles with protocol 4, which torch's weights-only loader
    # refuses; both inputs are this benchmark's own outputs, so the full unpickler is used.
    with torch.serialization.safe_globals([argparse.Namespace]):
        state = torch.load(path, mmap=True, weights_only=False)["model"]
    return {k: v for k, v in state.items() if not k.endswith("_extra_state")}


def main(a, b):
    fa, fb = rank_files(a), rank_files(b)
    if fa.keys() != fb.keys():
        sys.exit(f"rank files differ: {sorted(fa)} vs {sorted(fb)}")
    tensors, bad = 0, []
    for rank in sorted(fa):
        x, y = model(fa[rank]), model(fb[rank])
        if x.keys() != y.keys():
            bad.append(f"{rank}: keys {sorted(set(x) ^ set(y))[:4]}")
            continue
        for k in x:
            tensors += 1
            same = x[k].shape == y[k].shape and x[k].dtype == y[k].dtype and torch.equal(x[k], y[k])
            if not same:
                bad.append(f"{rank} {k}: {tuple(x[k].shape)} {x[k].dtype} vs {tuple(y[k].shape)} {y[k].dtype}")
    print(f"outputs compared: {len(fa)} rank files, {tensors} tensors, {len(bad)} different")
    for line in bad[:10]:
        print("  " + line)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main(*sys.argv[1:3])
