"""Whether two HF safetensors directories hold the same tensors (names, dtypes, shapes, values),
read one tensor at a time. Usage: hf_equal.py A B; exits 1 on the first difference."""
import sys
from pathlib import Path

import torch
from safetensors import safe_open


def tensors(d):
    for f in sorted(Path(d).glob("*.safetensors")):
        with safe_open(str(f), "pt") as s:
            for k in s.keys():
                yield k, f, s


def main(a, b):
    where_a = {k: f for k, f, _ in tensors(a)}
    where_b = {k: f for k, f, _ in tensors(b)}
    if where_a.keys() != where_b.keys():
        sys.exit(f"different names: {sorted(where_a.keys() ^ where_b.keys())[:5]}")
    for k in sorted(where_a):
        with safe_open(str(where_a[k]), "pt") as sa, safe_open(str(where_b[k]), "pt") as sb:
            ta, tb = sa.get_tensor(k), sb.get_tensor(k)
        if ta.dtype != tb.dtype or not torch.equal(ta, tb):
            sys.exit(f"{k} differs")
    print(f"{a} = {b}: {len(where_a)} tensors equal")


if __name__ == "__main__":
    main(*sys.argv[1:3])
