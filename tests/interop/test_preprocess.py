"""mindkit preprocess outputs checked by megatron-core's IndexedDataset and HF tokenizers."""
import json
import pathlib

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset
from transformers import AutoTokenizer

ROOT = pathlib.Path(__file__).resolve().parents[2]
CORPUS = ROOT / "fixtures/corpus/pretrain.jsonl"


def texts_of(path, key="text"):
    text = pathlib.Path(path).read_text(encoding="utf-8")
    if str(path).endswith(".txt"):  # one document per line, split on "\n" only
        return text.removesuffix("\n").split("\n")
    return [json.loads(l)[key] for l in text.splitlines() if l.strip()]


@pytest.mark.parametrize("name,dtype", [("llama2", np.uint16), ("qwen3", np.int32), ("gpt2", np.uint16)])
@pytest.mark.parametrize("special", [True, False])
def test_pretrain_tokens_match_hf_and_megatron_reads_them(mindkit, assets, tmp_path, name, dtype, special, testdata_or_none):
    real = ["pretrain/c4_demo.jsonl", "pretrain/wiki_demo.txt"]
    inputs = [CORPUS] + ([testdata_or_none / r for r in real] if testdata_or_none else [])
    hf = AutoTokenizer.from_pretrained(str(assets / name))
    expected = []
    for path in inputs:
        for text in texts_of(path):
            ids = hf(text, add_special_tokens=special).input_ids
            expected.append(ids + [hf.eos_token_id] if ids else [])
    args = ["preprocess", "--input", *inputs, "--output-prefix", tmp_path / "out",
            "--tokenizer", assets / name, "--append-eod", "--workers", "2"]
    mindkit(*args, *([] if special else ["--no-special-tokens"]))
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    assert ds.index.dtype == dtype
    assert len(ds.document_indices) == len(expected) + 1
    non_empty = [e for e in expected if e]
    assert len(ds) == len(non_empty)
    for i, ids in enumerate(non_empty):
        assert ds[i].tolist() == ids, f"document {i}"


@pytest.fixture
def testdata_or_none(request):
    import os
    p = os.environ.get("MINDKIT_TESTDATA")
    return pathlib.Path(p) if p else None


def check_instruction(prefix, tokenizer=None):
    ids = IndexedDataset(f"{prefix}_packed_input_ids_document")
    mask = IndexedDataset(f"{prefix}_packed_attention_mask_document")
    labels = IndexedDataset(f"{prefix}_packed_labels_document")
    assert len(ids) == len(mask) == len(labels) > 0
    assert ids.index.dtype == np.int32
    for i in range(len(ids)):
        x, m, y = ids[i], mask[i], labels[i]
        assert len(x) == len(m) == len(y)
        assert (m == 1).all()
        trained = y != -100
        assert trained.any(), f"sequence {i} trains on nothing"
        assert (~trained).any(), f"sequence {i} masks no prompt"
        assert (y[trained] == x[trained]).all(), f"sequence {i}: labels differ from input ids"
        # the prompt comes first: once training starts, no prompt token follows in alpaca-like data
    return len(ids)


CASES = [
    ("alpaca/alpaca_en_demo.json", "alpaca", None, "llama2"),
    ("alpaca/alpaca_zh_demo.json", "alpaca", "qwen", "qwen3"),
    ("alpaca/alpaca_en_demo.json", "alpaca", "llama2", "llama2"),
    ("alpaca/alpaca_en_demo.json", "alpaca", "alpaca", "gpt2"),
    ("alpaca/identity.json", "alpaca", "empty", "llama2"),
    ("belle", "belle", None, "llama2"),
    # the directory also holds its SHA256SUMS.txt manifest: the user names the format to read
    ("moss --input-format json", "moss", None, "qwen3"),
    ("sharegpt", "sharegpt", "qwen", "qwen3"),
    ("kto/kto_en_demo.json", "sharegpt", "chatml", "qwen3"),
]


@pytest.mark.parametrize("data,handler,prompt_type,tok", CASES)
def test_real_samples_every_handler(mindkit, assets, testdata, tmp_path, data, handler, prompt_type, tok):
    data, *format_args = data.split()
    args = ["preprocess", "--input", testdata / data, "--output-prefix", tmp_path / "x",
            "--tokenizer", assets / tok, "--handler", handler, *format_args]
    if prompt_type:
        args += ["--prompt-type", prompt_type]
    summary = mindkit(*args, quiet=False)
    assert " 0 skipped" in summary, summary
    assert check_instruction(tmp_path / "x") > 0


def test_pack_reads_back(mindkit, assets, testdata, tmp_path):
    mindkit("preprocess", "--input", testdata / "alpaca/alpaca_en_demo.json", "--output-prefix", tmp_path / "p",
            "--tokenizer", assets / "llama2", "--handler", "alpaca", "--prompt-type", "llama2",
            "--seq-length", "2048", "--pack")
    ids = IndexedDataset(str(tmp_path / "p_packed_input_ids_document"))
    assert all(len(ids[i]) == 2048 for i in range(len(ids)))


def test_shards_merge_to_the_whole(mindkit, assets, tmp_path):
    tok = assets / "llama2"
    mindkit("preprocess", "--input", CORPUS, "--output-prefix", tmp_path / "whole", "--tokenizer", tok, "--append-eod")
    parts = []
    for i in range(3):
        mindkit("preprocess", "--input", CORPUS, "--output-prefix", tmp_path / f"s{i}", "--tokenizer", tok,
                "--append-eod", "--shard", f"{i}/3")
        parts.append(tmp_path / f"s{i}_text_document")
    mindkit("preprocess", "merge", *parts, "--output-prefix", tmp_path / "merged")
    for ext in ["bin", "idx"]:
        assert (tmp_path / f"merged.{ext}").read_bytes() == (tmp_path / f"whole_text_document.{ext}").read_bytes()
    assert len(IndexedDataset(str(tmp_path / "merged"))) > 0


def write_columnar(records, path):
    """Writes records as HF `datasets` does (an Arrow IPC stream), as an Arrow IPC file, or parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    table = pa.Table.from_pylist(records)
    if path.suffix == ".parquet":
        pq.write_table(table, path, row_group_size=2)
        return
    new_writer = pa.ipc.new_stream if path.stem.endswith("stream") else pa.ipc.new_file
    with new_writer(path, table.schema) as w:
        for batch in table.to_batches(max_chunksize=2):
            w.write_batch(batch)


@pytest.mark.parametrize("name", ["data-stream.arrow", "data-file.arrow", "data.parquet"])
@pytest.mark.parametrize("fixture,handler", [("alpaca", "alpaca"), ("sharegpt", "sharegpt"), ("pretrain", None)])
def test_columnar_inputs_match_jsonl(mindkit, tmp_path, name, fixture, handler):
    """Arrow (HF datasets' stream format and the file format) and parquet inputs, with nested
    list<struct> columns, give the same bytes as the jsonl they were made from."""
    jsonl = ROOT / f"fixtures/corpus/{fixture}.jsonl"
    columnar = tmp_path / name
    write_columnar([json.loads(l) for l in jsonl.read_text().splitlines() if l.strip()], columnar)
    tok = ROOT / "fixtures/tokenizers/tiny-bpe"
    extra = ["--handler", handler, "--prompt-type", "chatml"] if handler else ["--append-eod"]
    for src, prefix in [(jsonl, "a"), (columnar, "b")]:
        mindkit("preprocess", "--input", src, "--output-prefix", tmp_path / prefix, "--tokenizer", tok, *extra)
    outputs = sorted(p.name[1:] for p in tmp_path.glob("a_*"))
    assert outputs
    for suffix in outputs:
        assert (tmp_path / f"a{suffix}").read_bytes() == (tmp_path / f"b{suffix}").read_bytes(), suffix
