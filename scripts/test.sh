#!/usr/bin/env bash
# The full test suite: Rust unit + integration tests, then the interop checks against the
# real tools (megatron-core, transformers, tokenizers) in a cached venv.
# Set MINDKIT_TESTDATA to ../shared/data (CI does) to run the tests on real public data samples.
set -euo pipefail
cd "$(dirname "$0")/.."
export MINDKIT_ASSETS="$(bash scripts/fetch-test-assets.sh)"
cargo test --release
cargo build --release --bin mindkit --examples
venv="$(bash scripts/setup-interop-venv.sh)"
export MINDKIT_BIN="$PWD/target/release/mindkit" MINDKIT_EXAMPLES="$PWD/target/release/examples"
"$venv/bin/python" -m pytest -q -rs -p no:cacheprovider tests/interop
