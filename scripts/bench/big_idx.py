"""A Megatron .idx of DOCS documents (lengths drawn uniformly in [MIN, MAX] tokens, uint16) beside a
sparse .bin of the size the index declares: what GPTDataset's index building reads of a large
dataset, without writing its tokens. Usage: big_idx.py PREFIX DOCS MIN MAX"""
import struct
import sys

import numpy as np

prefix, docs, low, high = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
lengths = np.random.default_rng(0).integers(low, high + 1, size=docs, dtype=np.int32)
pointers = np.zeros(docs, dtype=np.int64)
np.cumsum(lengths[:-1].astype(np.int64) * 2, out=pointers[1:])
with open(f"{prefix}.idx", "wb") as f:
    # megatron/core/datasets/indexed_dataset.py _IndexWriter: magic, version 1, dtype code 8 (uint16)
    f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, docs, docs + 1))
    f.write(lengths.tobytes())
    f.write(pointers.tobytes())
    f.write(np.arange(docs + 1, dtype=np.int64).tobytes())
with open(f"{prefix}.bin", "wb") as f:
    f.truncate(int(lengths.astype(np.int64).sum()) * 2)
print(f"{docs} documents, {int(lengths.astype(np.int64).sum())} tokens", file=sys.stderr)
