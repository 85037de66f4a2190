import os
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def mindkit():
    binary = os.environ.get("MINDKIT_BIN", str(ROOT / "target/release/mindkit"))

    def run(*args, ok=True, quiet=True):
        """Runs mindkit; returns its stderr (the summary line, unless `quiet`)."""
        r = subprocess.run([binary, *map(str, args), *(["--quiet"] if quiet else [])], capture_output=True, text=True)
        assert (r.returncode == 0) == ok, r.stderr
        return r.stderr

    return run


def example(name):
    """The path of the built example `name` (examples/NAME.rs); skips the test when not built."""
    examples = pathlib.Path(os.environ.get("MINDKIT_EXAMPLES", ROOT / "target/release/examples"))
    binary = examples / name
    if not binary.exists():
        pytest.skip(f"{binary} not built (cargo build --release --examples)")
    return str(binary)


@pytest.fixture(scope="session")
def assets():
    path = pathlib.Path(os.environ.get("MINDKIT_ASSETS", pathlib.Path.home() / ".cache/mindkit/assets"))
    if not (path / "llama2").is_dir():
        pytest.skip(f"real tokenizers not found in {path}: run scripts/fetch-test-assets.sh")
    return path


@pytest.fixture(scope="session")
def testdata():
    path = os.environ.get("MINDKIT_TESTDATA")
    if not path:
        pytest.skip("MINDKIT_TESTDATA is unset: real data samples not available")
    return pathlib.Path(path)


@pytest.fixture(scope="session")
def smollm2(assets):
    """The real SmolLM2-135M-Instruct as an HF directory (f16 weights, tokenizer, chat template)."""
    gguf = assets / "smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    if not gguf.exists():
        pytest.skip(f"{gguf} not found: run scripts/fetch-test-assets.sh")
    import smollm2 as builder
    return builder.build(gguf, assets / "smollm2/hf")
