#!/usr/bin/env bash
# Seed the fuzz corpora from the repository's fixtures/: fuzz/corpus/<target>/ for the targets
# pickle, safetensors_config, idx and records (see mindkit::fuzzing::seeds for what each gets).
# Run from anywhere; existing corpus files are kept (libFuzzer adds its finds beside them).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
cargo run --quiet --example fuzz_seeds -- fixtures fuzz/corpus
