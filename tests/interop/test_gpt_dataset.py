"""mindkit's GPT pretraining samples against megatron-core 0.15.3's own GPTDataset /
BlendedDataset (built by BlendedMegatronDatasetBuilder on CPU over the same .bin/.idx files):
the same samples, in the same order, token for token — single prefixes, several epochs with and
without a separately shuffled final epoch, weighted and unweighted blends, every split."""
import json
import os
import subprocess

import numpy as np
import pytest

from conftest import ROOT


class Tokenizer:
    """What GPTDataset reads of a tokenizer: eod, pad and the identifiers of its cache hash."""
    eod = 0
    pad = -1
    unique_identifiers = {"class": "MindkitInteropTokenizer"}


def write_dataset(prefix, lengths, seed):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32)
    for n in lengths:
        doc = rng.integers(1, 30000, size=n, dtype=np.int32)
        doc[-1] = Tokenizer.eod
        builder.add_document(doc, [n])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpt")
    rng = np.random.default_rng(7)
    return {
        "a": write_dataset(d / "a", rng.integers(1, 90, size=400), 1),
        "b": write_dataset(d / "b", rng.integers(20, 300, size=150), 2),
        "tiny": write_dataset(d / "tiny", rng.integers(5, 40, size=60), 3),
    }


def megatron_samples(blend_list, split, seq_length, seed, sizes, which, cache):
    import megatron_cpu
    megatron_cpu.init()  # BlendedDataset asks torch.distributed for its rank when caching
    from megatron.core.datasets.blended_dataset import BlendedDataset
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.utils import get_blend_from_list
    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length, blend=get_blend_from_list(blend_list),
        split=split, path_to_cache=str(cache), reset_position_ids=False,
        reset_attention_mask=False, eod_mask_loss=False, tokenizer=Tokenizer())
    built = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
    ds = built[which]
    out = []
    for k in range(len(ds)):
        if isinstance(ds, BlendedDataset):
            d, j = int(ds.dataset_index[k]), int(ds.dataset_sample_index[k])
            text = ds.datasets[d]._query_document_sample_shuffle_indices(j)[0]
        else:
            d, text = 0, ds._query_document_sample_shuffle_indices(k)[0]
        out.append((d, [int(t) for t in text]))
    return out


def mindkit_samples(blend_list, split, seq_length, seed, samples, which):
    binary = os.environ.get("MINDKIT_BIN", str(ROOT / "target/release/mindkit"))
    args = [binary, "data", "samples", "--data-path", *blend_list, "--split", split,
            "--seq-length", str(seq_length), "--seed", str(seed),
            "--which", ["train", "valid", "test"][which]]
    if samples is not None:
        args += ["--samples", str(samples)]
    r = subprocess.run(args, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return [(j["dataset"], j["tokens"]) for j in map(json.loads, r.stdout.splitlines())]


CASES = [
    # (blend, split, seq, seed, samples asked, which split)
    (["a"], "969, 30, 1", 64, 1234, 900, 0),     # several epochs, final epoch mixed in
    (["a"], "969, 30, 1", 64, 1234, 320, 0),     # final epoch shuffled on its own
    (["a"], "90,5,5", 32, 7, 40, 1),             # validation split
    (["a"], "90,5,5", 32, 7, None, 2),           # test split, one epoch
    (["tiny"], "1", 16, 99, 500, 0),             # many epochs of a small dataset
    (["0.3", "a", "0.7", "b"], "98,2,0", 48, 1234, 700, 0),   # weighted blend
    (["a", "b"], "98,2,0", 48, 5, 400, 0),       # unweighted blend, size capped
    (["a", "b", "tiny"], "1", 48, 5, None, 0),   # unweighted blend, exhaustive
    (["1.0", "b"], "90,10", 128, 1234, 200, 0),  # one prefix with a weight: a blend of one
]


@pytest.mark.parametrize("blend,split,seq,seed,samples,which", CASES)
def test_samples_equal_megatron_core(datasets, tmp_path, blend, split, seq, seed, samples, which):
    blend_list = [datasets.get(x, x) for x in blend]
    # Megatron requires a size for every split of a weighted blend.
    weighted = len(blend) % 2 == 0 and blend[0].replace(".", "").isdigit()
    sizes = [8, 8, 8] if weighted else [None, None, None]
    sizes[which] = samples
    want = megatron_samples(blend_list, split, seq, seed, sizes, which, tmp_path / "cache")
    got = mindkit_samples(blend_list, split, seq, seed, samples, which)
    assert len(got) == len(want)
    for k, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"sample {k} differs: dataset {g[0]} vs {w[0]}"
