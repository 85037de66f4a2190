"""`mindkit train --expert-model-parallel-size 2` (two data-parallel ranks = two expert-parallel
ranks, as threads) against megatron-core's own expert-parallel training under torchrun
(megatron_ep_train.py: two gloo processes, megatron-core's MoEAllGatherTokenDispatcher moving the
tokens between them, its DistributedDataParallel reducing the dense and the expert gradients over
their own groups, its ChainedOptimizer stepping the dense and the expert optimizers on one grad
norm) from the same EP 2 checkpoint of a tiny Qwen3-MoE: lm loss, grad norm, learning rate,
load_balancing_loss and z_loss per iteration to 1e-5 relative, each rank's final weights (its two
experts as local_experts.0/1) and Adam moments to 1e-4; mindkit's `optimizer` entry is
ChainedOptimizer.state_dict()'s list (the same keys in the same order, the same parameter
ids), and megatron-core resumes it: ChainedOptimizer.load_state_dict on each rank, every moment
shaped as its parameter."""
import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest
import torch

from test_train import ITERS, MOE_FLAGS, make_qwen3_moe, mindkit_train, scalars, write_data

TAGS = ("lm loss", "grad-norm", "learning-rate", "load_balancing_loss", "z_loss")


def relative(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12)).item()


TP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
LAYOUTS = {
    # EP 2 over two data-parallel ranks
    "ep2": (["--world-size", "2"], [], ["00_000", "00_001"]),
    # TP 2 + SP with whole experts: the two tensor-parallel ranks are the expert-parallel ones
    "whole": (TP + ["--expert-tensor-parallel-size", "1", "--world-size", "2"],
              ["--tp", 2, "--etp", 1], ["00_000", "01_001"]),
    # TP 2 + SP × DP 2 = EP 2, token dropping: each sequence-parallel rank's rows (a block of
    # positions of every sequence) a router call of their own
    "tp-ep": (TP + ["--world-size", "4", "--moe-expert-capacity-factor", "0.5"], ["--tp", 2],
              ["00_000", "00_001", "01_000", "01_001"]),
    # TP 4 + SP, each expert in halves over a block of two TP ranks (ETP 2), the blocks the
    # expert-parallel ranks: rank r writes (r mod 4, r / 2 mod 2)
    "etp2": (["--tensor-model-parallel-size", "4", "--sequence-parallel",
              "--expert-tensor-parallel-size", "2", "--world-size", "4"], ["--tp", 4, "--etp", 2],
             ["00_000", "01_000", "02_001", "03_001"]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_expert_parallel_training_matches_megatron_core(tmp_path, mindkit, layout):
    from megatron_cpu import load_pt
    # four key-value heads for TP 4
    model_dir = make_qwen3_moe(tmp_path / "model", kv_heads=4 if layout == "etp2" else 2)
    data = write_data(tmp_path / "data")
    # megatron-core's all-to-all dispatcher needs CUDA streams; mindkit runs every dispatcher
    # type as the all-gather one, which megatron-core runs on the CPU.
    flags = list(MOE_FLAGS)
    flags[flags.index("--moe-token-dispatcher-type") + 1] = "allgather"
    train_flags, convert_flags, ranks = LAYOUTS[layout]
    log = mindkit_train(model_dir, data, tmp_path,
                        flags + ["--expert-model-parallel-size", "2"] + train_flags)
    assert "load_balancing_loss:" in log and "z_loss:" in log, log
    got = scalars(tmp_path / "tb", TAGS)
    mindkit("convert", "--to", "megatron", "--input", model_dir, "--output", tmp_path / "start",
            "--ep", 2, *convert_flags)
    (start,) = (tmp_path / "start").glob("iter_*")
    trained = tmp_path / f"ckpt/iter_{ITERS:07d}"
    files = [f"mp_rank_{r}" for r in ranks]
    assert sorted(p.name for p in trained.iterdir()) == files

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    script = pathlib.Path(__file__).parent / "megatron_ep_train.py"
    reference = tmp_path / "reference"
    flag = "--moe-expert-capacity-factor"
    capacity = [train_flags[train_flags.index(flag) + 1]] if flag in train_flags else []
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                        str(len(files)), "--master-port", str(port), str(script), str(start), data,
                        str(ITERS), str(reference), str(trained), "--layout", layout,
                        *(["--capacity", *capacity] if capacity else [])],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    # (gloo's own lines may interleave with the ranks')
    assert r.stdout.count("resumed mindkit's checkpoint") == len(files), r.stdout + r.stderr
    result = json.loads((reference / "history.json").read_text())
    assert result["moe_layers"] == 2

    worst = {}
    for key in TAGS:
        want = [h[key] for h in result["history"]]
        assert len(got[key]) == len(want) == ITERS, key
        for i, (g, w) in enumerate(zip(got[key], want)):
            assert abs(g - w) <= 1e-5 * abs(w) + 1e-12, f"{key} at iteration {i + 1}: {g} vs {w}"
        worst[key] = max(abs(g - w) / abs(w) for g, w in zip(got[key], want))

    worst["weights"] = worst["moments"] = 0.0
    for file in files:
        obj = load_pt(trained / file / "model_optim_rng.pt")
        assert obj["args"].expert_model_parallel_size == 2
        ref = {k: v for k, v in torch.load(reference / f"model_{file}.pt", weights_only=True).items()
               if not k.endswith("_extra_state")}
        weights = obj["model"]
        assert sorted(weights) == sorted(ref), (ep, sorted(set(weights) ^ set(ref)))
        assert sum(".local_experts." in k for k in ref) == 8  # 2 MoE layers × 2 experts × fc1/fc2
        for name, want in ref.items():
            diff = relative(weights[name], want)
            assert diff <= 1e-4, f"{file}: {name}: relative difference {diff}"
            worst["weights"] = max(worst["weights"], diff)
        # ChainedOptimizer.state_dict(): [dense optimizer's state dict, expert optimizer's]
        chained = torch.load(reference / f"optimizer_{file}.pt", weights_only=True)
        saved = obj["optimizer"]
        assert isinstance(saved, list) and len(saved) == len(chained) == 2
        for index, (mine, theirs) in enumerate(zip(saved, chained)):
            assert list(mine) == list(theirs) == ["state", "param_groups"]
            assert len(mine["param_groups"]) == len(theirs["param_groups"])
            for g, w in zip(mine["param_groups"], theirs["param_groups"]):
                assert list(g) == list(w), (ep, index, list(g), list(w))
                assert w["is_expert_parallel"] == (index == 1)
                for k, v in w.items():
                    if k == "lr":
                        assert abs(g[k] - v) <= 1e-6 * v, (ep, index, k, g[k], v)
                    else:
                        assert g[k] == v, (ep, index, k, g[k], v)
            assert list(mine["state"]) == list(theirs["state"]), (ep, index)
            for pid, want in theirs["state"].items():
                have = mine["state"][pid]
                assert list(have) == list(want), (ep, index, pid)
                assert have["step"].dtype == want["step"].dtype and have["step"] == want["step"]
                for k in ("exp_avg", "exp_avg_sq"):
                    assert have[k].shape == want[k].shape and have[k].dtype == want[k].dtype
                    diff = relative(have[k], want[k])
                    assert diff <= 1e-4, f"{file}: optimizer {index} param {pid} {k}: {diff}"
                    worst["moments"] = max(worst["moments"], diff)
    print("expert parallel: worst relative differences " +
          ", ".join(f"{k} {v:.2e}" for k, v in worst.items()))
