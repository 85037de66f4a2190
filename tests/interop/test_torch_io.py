"""mindkit's .pt reader and writer checked by torch itself: torch.save → mindkit (read, re-save)
→ torch.load(weights_only=True) gives back the same tensors, and the archive is what torch writes."""
import argparse
import os
import struct
import subprocess
import zipfile
from collections import OrderedDict

import pytest
import torch
from conftest import example



@pytest.fixture(scope="session")
def pt_copy():
    binary = example("pt_copy")

    def run(src, dst):
        r = subprocess.run([binary, src, dst], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    return run


def tensors():
    torch.manual_seed(1)
    big = torch.randn(64, 48)
    sd = OrderedDict()
    for dtype in [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
                  torch.int16, torch.int8, torch.uint8, torch.bool]:
        sd[f"t_{str(dtype)[6:]}"] = (torch.randn(5, 3) * 100).to(dtype)
    sd["scalar"] = torch.tensor(-3.25)
    sd["empty"] = torch.zeros(0, 7)
    sd["big"] = big
    sd["rows_of_big"] = big[10:20]
    sd["transposed"] = big.t()
    sd["strided"] = big[:, ::2]
    sd["large_ints"] = torch.tensor([2**40, -(2**40), 2**31, -1], dtype=torch.int64)
    return sd


def assert_same(a, b):
    assert list(a) == list(b)
    for k in a:
        x, y = a[k], b[k]
        assert (x.dtype, x.shape, x.stride(), x.storage_offset()) == (y.dtype, y.shape, y.stride(), y.storage_offset()), k
        assert torch.equal(x, y), k


@pytest.mark.parametrize("protocol", [2, 4])
def test_state_dict_round_trip_loads_with_weights_only(pt_copy, tmp_path, protocol):
    sd = tensors()
    torch.save(sd, tmp_path / "in.pt", pickle_protocol=protocol)
    pt_copy(tmp_path / "in.pt", tmp_path / "out.pt")
    back = torch.load(tmp_path / "out.pt", weights_only=True)
    assert_same(sd, back)
    assert back["big"].untyped_storage().data_ptr() == back["rows_of_big"].untyped_storage().data_ptr()


def test_archive_is_aligned_and_crc_checked(pt_copy, tmp_path):
    torch.save(tensors(), tmp_path / "in.pt")
    pt_copy(tmp_path / "in.pt", tmp_path / "model.pt")
    raw = (tmp_path / "model.pt").read_bytes()
    z = zipfile.ZipFile(tmp_path / "model.pt")
    assert z.testzip() is None  # every CRC is right (torch does not check them; other tools do)
    names = [i.filename for i in z.infolist()]
    assert names[0] == "model/data.pkl" and "model/version" in names
    for info in z.infolist():
        assert info.compress_type == zipfile.ZIP_STORED
        name_len, extra_len = struct.unpack("<HH", raw[info.header_offset + 26:info.header_offset + 30])
        start = info.header_offset + 30 + name_len + extra_len
        if "/data/" in info.filename:
            assert start % 64 == 0, info.filename
    assert raw[:4] == b"PK\x03\x04"
    assert torch.load(tmp_path / "model.pt", mmap=True, weights_only=True)["big"].sum() == tensors()["big"].sum()


def test_megatron_style_checkpoint_round_trip(pt_copy, tmp_path):
    args = argparse.Namespace(num_layers=4, hidden_size=64, params_dtype=torch.bfloat16, rotary_base=10000.0,
                              ffn_hidden_size=None, tokenizer_type="HuggingFaceTokenizer", padded_vocab_size=32000)
    ckpt = {"args": args, "checkpoint_version": 3.0, "iteration": 1000,
            "model": OrderedDict(w=torch.randn(8, 8).to(torch.bfloat16)), "tag": b"\x00\xffbytes"}
    torch.save(ckpt, tmp_path / "model_optim_rng.pt")
    pt_copy(tmp_path / "model_optim_rng.pt", tmp_path / "copy.pt")
    with torch.serialization.safe_globals([argparse.Namespace]):
        back = torch.load(tmp_path / "copy.pt", weights_only=True)
    assert vars(back["args"]) == vars(args)
    assert (back["checkpoint_version"], back["iteration"], back["tag"]) == (3.0, 1000, b"\x00\xffbytes")
    assert_same(ckpt["model"], back["model"])


def test_pickled_code_is_refused(pt_copy, tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo should-not-run",))

    torch.save({"x": Evil()}, tmp_path / "evil.pt")
    r = subprocess.run([example("pt_copy"), tmp_path / "evil.pt", tmp_path / "out.pt"], capture_output=True, text=True)
    assert r.returncode != 0 and "forbidden global" in r.stderr and "system" in r.stderr, r.stderr
    assert "should-not-run" not in r.stdout
    assert not (tmp_path / "out.pt").exists()
