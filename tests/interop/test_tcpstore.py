"""mindkit's c10d TCPStore (src/train/store.rs, driven through examples/store_probe) against
torch's: the Rust client with torch's servers (libuv and legacy), torch's clients with the Rust
server, and the real launcher — torchrun's elastic agent hosting the store, as `mindkit train`
is launched — plus the launches where rank 0 must host the store itself."""
import datetime
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist
from conftest import ROOT, example

SHORT = datetime.timedelta(seconds=10)
# Every subprocess is killed (with its process group) past this, so nothing can hang CI.
BOUND = 60


@pytest.fixture(scope="session")
def probe():
    return example("store_probe")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd, env=None, **kw):
    """A subprocess in its own process group, so a timeout can end it and its children."""
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **kw)


def finish(proc, timeout=BOUND):
    """(returncode, stdout, stderr), killing the whole group if it overruns."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{proc.args} did not finish within {timeout} s:\n{out}\n{err}")
    return proc.returncode, out, err


def launch_env(**values):
    """This environment without any launcher's variables, plus `values`."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "TORCHELASTIC_")) and k not in
           ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update({k: str(v) for k, v in values.items()})
    return env


@pytest.mark.parametrize("use_libuv", [True, False], ids=["libuv", "legacy"])
def test_rust_client_with_torch_server(probe, use_libuv):
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=SHORT,
                           use_libuv=use_libuv)
    peer = start([probe, "peer", "127.0.0.1", str(server.port)])
    # Set after the client started, so its get has to wait for the key.
    time.sleep(0.2)
    root_info = bytes(i % 251 for i in range(4108))
    server.set("py/to_rust", root_info)
    assert server.get("rust/to_py") == b"rust saw " + root_info
    assert server.add("shared/count", 0) == 1
    server.set("py/done", b"1")
    rc, out, err = finish(peer)
    assert rc == 0 and out.strip() == "count 1", err


def test_rust_wait_timeout_against_torch_server(probe):
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=SHORT)
    rc, _, err = finish(start([probe, "wait", "127.0.0.1", str(server.port), "never", "0.5"]))
    assert rc != 0
    assert f"127.0.0.1:{server.port}" in err and '"never"' in err and "timed out after 0.5 s" in err, err
    # The cancelled wait left the connection in step: the next request went through.
    assert server.get("rust/after_wait") == b"1"


@pytest.fixture
def rust_server(probe):
    server = start([probe, "serve"], stdin=subprocess.PIPE)
    line = server.stdout.readline()
    assert line.startswith("port "), server.stderr.read()
    yield int(line.split()[1])
    # communicate() closes its stdin: the server's signal to stop.
    rc, _, err = finish(server, timeout=10)
    assert rc == 0, err


def test_torch_clients_with_rust_server(rust_server):
    a, b = (dist.TCPStore("127.0.0.1", rust_server, is_master=False, timeout=SHORT) for _ in range(2))
    root_info = bytes(i % 251 for i in range(4108))
    a.set("hccl/root", root_info)
    assert b.get("hccl/root") == root_info
    assert (a.add("count", 2), b.add("count", 3), a.add("count", 0)) == (2, 5, 5)
    assert b.get("count") == b"5"
    assert b.check(["hccl/root"]) and not b.check(["hccl/root", "missing"])
    assert a.num_keys() == 2
    assert (a.compare_set("cs", b"", b"x"), a.compare_set("cs", b"x", b"y"), a.compare_set("cs", b"q", b"z")) \
        == (b"x", b"y", b"y")
    a.append("log", b"1")
    a.append("log", b"2")
    a.multi_set(["m1", "m2"], [b"a", b"b"])
    assert b.multi_get(["log", "m1", "m2"]) == [b"12", b"a", b"b"]
    assert a.delete_key("cs") and not a.delete_key("cs")

    # A wait times out (torch's client cancels it), and the connection still works after it.
    with pytest.raises(dist.DistStoreError, match="timeout"):
        b.wait(["never"], datetime.timedelta(milliseconds=300))
    threading.Timer(0.2, lambda: a.set("late", b"L")).start()
    b.wait(["late"])
    assert b.get("late") == b"L"

    # Clients that count themselves in (world_size given) add to the unprefixed "init/" key.
    for _ in range(2):
        dist.TCPStore("127.0.0.1", rust_server, world_size=2, is_master=False, timeout=SHORT)


def test_torchrun_agent_store(probe):
    """torchrun's agent hosts the store (TORCHELASTIC_USE_AGENT_STORE=True): both ranks are
    clients, exactly as `torchrun --no-python … mindkit train` runs."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--no-python", "--nproc-per-node", "2",
           "--master-port", str(free_port()), probe]
    rc, out, err = finish(start(cmd, env=launch_env(OMP_NUM_THREADS=1)))
    assert rc == 0, out + err
    assert sorted(out.split("\n")[:-1]) == ["rank 0 of 2: ok", "rank 1 of 2: ok"], out + err


@pytest.mark.parametrize("launcher", ["env", "slurm"])
def test_rank0_hosts_the_store_without_an_agent(probe, launcher):
    port = free_port()

    def env(rank):
        if launcher == "slurm":
            return launch_env(SLURM_PROCID=rank, SLURM_NTASKS=2, SLURM_LOCALID=rank, MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=port)
        return launch_env(RANK=rank, WORLD_SIZE=2, LOCAL_RANK=rank, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)

    # Rank 1 first: its client retries until rank 0's server is up.
    ranks = [start([probe], env=env(1)), start([probe], env=env(0))]
    results = [finish(p) for p in ranks]
    for rank, (rc, out, err) in zip([1, 0], results):
        assert rc == 0 and out.strip() == f"rank {rank} of 2: ok", err


def test_slurm_without_master_addr_says_what_to_set(probe):
    rc, _, err = finish(start([probe], env=launch_env(SLURM_PROCID=0, SLURM_NTASKS=2)))
    assert rc != 0 and "MASTER_ADDR and MASTER_PORT" in err, err


def stand_in_toolkit(at):
    """A CANN toolkit directory on the project's stand-in (built by `cargo test`)."""
    library = ROOT / "target/stand-in/debug/libascendcl.so"
    if not library.exists():
        pytest.skip(f"{library} not built (cargo test builds it)")
    (at / "lib64").mkdir(parents=True)
    for name in ["libascendcl.so", "libnnopbase.so", "libopapi.so", "libhccl.so"]:
        (at / "lib64" / name).symlink_to(library)
    return at


@pytest.mark.parametrize("layout", ["dp2", "dp2+do", "tp2+sp", "pp2", "pp2+vpp2"])
@pytest.mark.parametrize("device", ["cpu", "npu"])
def test_torchrun_launches_mindkit_train(tmp_path, device, layout):
    """`torchrun --no-python --nproc-per-node 2 mindkit train …` (the agent's store; ranks as
    processes over sockets on the CPU, over the stand-in's HCCL on NPUs), data-, tensor- or
    pipeline-parallel (with two model chunks per stage too), or data-parallel with the distributed
    optimizer, logs what `mindkit train --world-size 2` (ranks as threads) does, bit for
    bit."""
    binary = os.environ.get("MINDKIT_BIN", str(ROOT / "target/release/mindkit"))
    fixtures = ROOT / "fixtures"
    subprocess.run([binary, "preprocess", "--input", fixtures / "corpus/pretrain.jsonl", "--output-prefix",
                    tmp_path / "corpus", "--tokenizer", fixtures / "models/demo", "--append-eod", "--quiet"],
                   check=True)
    args = ["train", "--load", fixtures / "models/demo", "--data-path", tmp_path / "corpus_text_document",
            "--split", "1", "--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "4",
            "--train-iters", "6", "--lr", "1e-3", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
            "--log-interval", "1", "--eval-iters", "0", "--quiet", "--device", device]
    if layout == "dp2+do":
        args += ["--use-distributed-optimizer"]
    if layout == "tp2+sp":
        args += ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    if layout.startswith("pp2"):
        args += ["--pipeline-model-parallel-size", "2"]
    if layout == "pp2+vpp2":
        # four layers from scratch (the demo model has two), in two chunks per stage
        load = args.index("--load")
        del args[load:load + 2]
        args += ["--num-virtual-stages-per-pipeline-rank", "2", "--num-layers", "4", "--hidden-size", "64",
                 "--num-attention-heads", "4", "--ffn-hidden-size", "96", "--swiglu", "--disable-bias-linear",
                 "--max-position-embeddings", "64", "--tokenizer-name-or-path", fixtures / "models/demo"]
    args = [str(a) for a in args]
    extra = {}
    if device == "npu":
        extra = dict(ASCEND_TOOLKIT_HOME=stand_in_toolkit(tmp_path / "toolkit"), MINDKIT_STAND_IN_DEVICES=2,
                     LD_LIBRARY_PATH="")
    rc, threads, err = finish(start([binary, *args, "--world-size", "2"], env=launch_env(**extra)))
    assert rc == 0, err
    cmd = [sys.executable, "-m", "torch.distributed.run", "--no-python", "--nproc-per-node", "2",
           "--master-port", str(free_port()), binary, *args]
    rc, processes, err = finish(start(cmd, env=launch_env(OMP_NUM_THREADS=1, **extra)))
    assert rc == 0, processes + err

    def losses(log):
        return [(f.split("lm loss:")[1].split("|")[0].strip(), f.split("grad norm:")[1].split("|")[0].strip())
                for f in log.splitlines() if "lm loss:" in f]

    assert len(losses(threads)) == 6, threads
    assert losses(processes) == losses(threads), processes + err


def from_scratch(binary, data, save, arch):
    """One iteration of a 2-layer h 64 SwiGLU model with `arch`'s flags from scratch, saved at `save`."""
    subprocess.run([binary, "train", "--data-path", data, "--split", "1", "--micro-batch-size", "1",
                    "--train-iters", "1", "--lr", "0", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
                    "--eval-iters", "0", "--quiet", "--save", save, "--num-layers", "2", "--hidden-size", "64",
                    "--ffn-hidden-size", "176", "--num-attention-heads", "4", "--swiglu", "--disable-bias-linear",
                    *arch], check=True, env=launch_env())


def test_mindspeed_script_under_torchrun(tmp_path):
    """examples/mindspeed/pretrain_llama2_tiny.sh (MindSpeed-LLM's pretrain_llama2_13b_ptd.sh,
    shrunk, TP 2 with sequence parallelism × PP 2) under the real torchrun: four processes train,
    and each tensor-parallel rank of each stage saves its file."""
    binary = os.environ.get("MINDKIT_BIN", str(ROOT / "target/release/mindkit"))
    tokenizer = ROOT / "fixtures/models/demo"
    # 512 documents, so that --split 949,50,1 leaves the test split one.
    lines = (ROOT / "fixtures/corpus/pretrain.jsonl").read_text()
    (tmp_path / "big.jsonl").write_text(lines * 32)
    subprocess.run([binary, "preprocess", "--input", tmp_path / "big.jsonl", "--output-prefix",
                    tmp_path / "corpus", "--tokenizer", tokenizer, "--append-eod", "--quiet"], check=True)
    data = tmp_path / "corpus_text_document"
    # The script's architecture (LLaMA-2: no GQA) from scratch, as an HF directory.
    from_scratch(binary, data, tmp_path / "scratch", ["--seq-length", "32", "--untie-embeddings-and-output-weights",
                                                       "--tokenizer-name-or-path", tokenizer])
    subprocess.run([binary, "convert", "--to", "hf", "--input", tmp_path / "scratch", "--output", tmp_path / "hf",
                    "--quiet"], check=True)
    (tmp_path / "logs").mkdir()
    torchrun = pathlib.Path(sys.executable).parent
    env = launch_env(OMP_NUM_THREADS=1, PATH=f"{torchrun}:{pathlib.Path(binary).parent}:{os.environ['PATH']}",
                     CKPT_LOAD_DIR=tmp_path / "hf", CKPT_SAVE_DIR=tmp_path / "saved", DATA_PATH=data,
                     TOKENIZER_MODEL=tokenizer,
                     MASTER_PORT=free_port())
    script = ROOT / "examples/mindspeed/pretrain_llama2_tiny.sh"
    rc, out, err = finish(start(["bash", str(script)], env=env, cwd=tmp_path), timeout=300)
    assert "iteration       10/      10" in out, out + err
    assert "validation loss at iteration 5 |" in out, out + err
    for rank in ["mp_rank_00_000", "mp_rank_01_000", "mp_rank_00_001", "mp_rank_01_001"]:
        assert (tmp_path / "saved/iter_0000010" / rank / "model_optim_rng.pt").is_file(), out + err


def test_mindspeed_distributed_optimizer_script_under_torchrun(tmp_path):
    """examples/mindspeed/pretrain_qwen25_tiny.sh (MindSpeed-LLM's pretrain_qwen25_0point5_32k_ptd.sh,
    shrunk: TP 2 with sequence parallelism × PP 2 × DP 2 with the distributed optimizer) under the
    real torchrun: eight processes resume the iteration of a one-rank checkpoint (its weights
    resharded, --no-load-optim), train as the same flags on eight ranks as threads do, bit for bit,
    and each tensor-parallel rank of each stage saves its model and distributed optimizer files."""
    binary = os.environ.get("MINDKIT_BIN", str(ROOT / "target/release/mindkit"))
    tokenizer = ROOT / "fixtures/models/demo"
    subprocess.run([binary, "preprocess", "--input", ROOT / "fixtures/corpus/pretrain.jsonl", "--output-prefix",
                    tmp_path / "corpus", "--tokenizer", tokenizer, "--append-eod", "--quiet"], check=True)
    data = tmp_path / "corpus_text_document"
    # The script's architecture (Qwen2.5: GQA, q/k/v biases, tied) from scratch, one rank, one iteration.
    from_scratch(binary, data, tmp_path / "scratch",
                 ["--seq-length", "64", "--group-query-attention", "--num-query-groups", "2", "--add-qkv-bias",
                  "--padded-vocab-size", "512", "--make-vocab-size-divisible-by", "1", "--rotary-base", "1000000",
                  "--norm-epsilon", "1e-6", "--max-position-embeddings", "64", "--tokenizer-name-or-path", tokenizer])
    (tmp_path / "logs").mkdir()
    # `torchrun` as a shim that runs what follows --no-python as eight ranks as threads
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "torchrun").write_text('#!/bin/bash\nwhile [ "$1" != --no-python ]; do shift; done\nshift\n'
                                   'exec "$@" --world-size 8 --save "$CKPT_SAVE_DIR-threads"\n')
    (shim / "torchrun").chmod(0o755)
    torchrun = pathlib.Path(sys.executable).parent
    script = ROOT / "examples/mindspeed/pretrain_qwen25_tiny.sh"
    logs = {}
    for name, first in [("threads", shim), ("processes", torchrun)]:
        env = launch_env(OMP_NUM_THREADS=1, PATH=f"{first}:{pathlib.Path(binary).parent}:{os.environ['PATH']}",
                         CKPT_LOAD_DIR=tmp_path / "scratch", CKPT_SAVE_DIR=tmp_path / "saved",
                         DATA_PATH=data, TOKENIZER_PATH=tokenizer, MASTER_PORT=free_port())
        rc, out, err = finish(start(["bash", str(script)], env=env, cwd=tmp_path), timeout=300)
        assert "iteration       10/      10 | consumed samples:           73" in out, out + err
        logs[name] = [line.split("| lm loss:")[1].split("| number")[0] for line in out.splitlines()
                      if "| lm loss:" in line]
    assert len(logs["processes"]) == 9 and logs["processes"] == logs["threads"], logs
    for saved in ["saved", "saved-threads"]:
        for rank in ["mp_rank_00_000", "mp_rank_01_000", "mp_rank_00_001", "mp_rank_01_001"]:
            for file in ["model_optim_rng.pt", "distrib_optim.pt"]:
                assert (tmp_path / saved / "iter_0000010" / rank / file).is_file(), (saved, rank, file)
