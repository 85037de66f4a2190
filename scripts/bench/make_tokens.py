"""Random token documents as a Megatron .bin/.idx (megatron-core's IndexedDatasetBuilder), for
the training benchmark. Usage: make_tokens.py PREFIX VOCAB TOKENS"""
import sys

import numpy as np
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

prefix, vocab, total = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rng = np.random.default_rng(0)
builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
done = 0
while done < total:
    n = int(rng.integers(200, 2000))
    builder.add_document(rng.integers(3, vocab, size=n, dtype=np.uint16), [n])
    done += n
builder.finalize(f"{prefix}.idx")
