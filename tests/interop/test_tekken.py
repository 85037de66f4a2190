"""`--tokenizer-type MagistralTokenizer`: mindkit's tekken ids against mistral-common 1.13.1's
Tekkenizer, reached as MindSpeed-LLM's `_MagistralTokenizer.tokenize` reaches it
(`MistralTokenizer.from_file(path).instruct_tokenizer.tokenizer.encode(text, bos=False, eos=False)`),
on both tekken files mistral-common ships, every line of the real data samples and hard cases."""
import json
import pathlib

import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

mistral = pytest.importorskip("mistral_common.tokens.tokenizers.mistral")

FILES = ["tekken_240718.json", "tekken_240911.json"]

HARD = [
    "Hello, world!", " leading space", "trailing space ", "   three spaces then word",
    "tabs\tand\t\tmore\t", "a" * 3000, " " * 1000, " " * 999 + "x", "\n" * 50, "\r\n" * 40 + "end",
    "line\r\nbreaks\rand\nmore\r\n\r\n  \r\n", "1234567890 3.14159 -42 1e10 0x1F 12,345,678",
    "日本語のテキストと中文文本，还有한국어 텍스트。", "混合 English 和中文 mixed",
    "emoji 😀🎉👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵", "combining e\u0301 a\u0308 and ﬁ ligature",
    "Ελληνικά Русский текст עברית العربية हिन्दी ไทย",
    "[INST]question[/INST]answer</s>", "<s>[INST] [THINK]thought[/THINK] [/INST]",
    "<unk><pad>[SYSTEM_PROMPT]sys[/SYSTEM_PROMPT][TOOL_CALLS][IMG]<SPECIAL_20>",
    "def f(x):\n    return x ** 2  # comment\n\n\n\tpass", "https://example.com/path?q=1&r=2#frag",
    "!!!???...,,,;;;:::---___===+++***", "MiXeD CaSe WORDS and ALLCAPS wordsLikeThis",
    "\u00a0non-breaking\u2003em-space\u3000ideographic space\u200bzero-width",
    "\x00\x01\x1f control \x7f", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕞𝕒𝕥𝕙 and 𐍈 gothic", "x\u0300\u0301\u0302\u0303 stacked marks",
]


@pytest.fixture(scope="module")
def tekken_dir(assets):
    path = assets / "tekken"
    if not (path / FILES[0]).is_file():
        pytest.skip(f"{path} not found: run scripts/fetch-test-assets.sh")
    return path


def real_lines(testdata):
    """Every non-empty line of every text file of the shipped data samples."""
    lines = []
    for path in sorted(testdata.rglob("*")):
        if path.is_file() and path.suffix in (".json", ".jsonl", ".txt", ".md", ".csv"):
            lines += [l for l in path.read_text(encoding="utf-8").split("\n") if l]
    return lines


def texts(testdata_or_none):
    out = list(HARD)
    if testdata_or_none is None:
        print("MINDKIT_TESTDATA is unset: hard cases only, no real data samples")
    else:
        out += real_lines(testdata_or_none)
    return out


@pytest.fixture
def testdata_or_none():
    import os
    p = os.environ.get("MINDKIT_TESTDATA")
    return pathlib.Path(p) if p else None


@pytest.mark.parametrize("name", FILES)
def test_preprocess_ids_equal_mistral_common(mindkit, tekken_dir, tmp_path, testdata_or_none, name):
    path = tekken_dir / name
    tekken = mistral.MistralTokenizer.from_file(str(path)).instruct_tokenizer.tokenizer
    docs = texts(testdata_or_none)
    corpus = tmp_path / "in.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs), encoding="utf-8")
    mindkit("preprocess", "--input", corpus, "--output-prefix", tmp_path / "out", "--tokenizer-model", path,
            "--tokenizer-type", "MagistralTokenizer", "--workers", "2")
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    assert len(ds) == len(docs)
    bad = [i for i, t in enumerate(docs) if ds[i].tolist() != tekken.encode(t, bos=False, eos=False)]
    assert not bad, f"{len(bad)} of {len(docs)} differ, first: {docs[bad[0]]!r}"
    print(f"{name}: {len(docs)} texts, {sum(len(ds[i]) for i in range(len(ds)))} tokens equal")


def test_append_eod_is_the_eos_and_data_show_decodes(mindkit, tekken_dir, tmp_path):
    path = tekken_dir / "tekken.json"
    tekken = mistral.MistralTokenizer.from_file(str(path)).instruct_tokenizer.tokenizer
    text = "Bonjour 世界 [INST] 😀"
    corpus = tmp_path / "in.jsonl"
    corpus.write_text(json.dumps({"text": text}) + "\n", encoding="utf-8")
    mindkit("preprocess", "--input", corpus, "--output-prefix", tmp_path / "out", "--tokenizer-model", path,
            "--tokenizer-type", "MagistralTokenizer", "--append-eod")
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    assert ds[0].tolist() == tekken.encode(text, bos=False, eos=True)
    import subprocess, os
    binary = os.environ.get("MINDKIT_BIN")
    if binary:
        shown = subprocess.run([binary, "data", "show", tmp_path / "out", "--tokenizer", path],
                               capture_output=True, text=True, check=True).stdout
        from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy
        assert tekken.decode(ds[0].tolist(), special_token_policy=SpecialTokenPolicy.KEEP) in shown, shown


def test_a_path_that_is_no_tekken_file_is_refused(mindkit, assets, tekken_dir, tmp_path):
    corpus = tmp_path / "in.jsonl"
    corpus.write_text('{"text": "x"}\n')
    err = mindkit("preprocess", "--input", corpus, "--output-prefix", tmp_path / "a", "--tokenizer-model",
                  assets / "qwen3", "--tokenizer-type", "MagistralTokenizer", ok=False)
    assert "needs a tekken file" in err, err
    err = mindkit("preprocess", "--input", corpus, "--output-prefix", tmp_path / "b", "--tokenizer-model",
                  tekken_dir / "tekken.json", "--tokenizer-type", "PretrainedFromHF", ok=False)
    assert "give --tokenizer-type MagistralTokenizer" in err, err
