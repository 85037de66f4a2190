#!/usr/bin/env bash
# Benchmark: mindkit's engine against transformers on CPU, side by side, same threads, on the
# real SmolLM2-135M (fp32 weights; and mindkit with bf16 weights): loglikelihood-style prefill
# throughput (DOCS contexts of LEN tokens at batch 1), greedy KV-cached decode speed, and the
# decode bound (weight bytes per token ÷ the copy bandwidth measured in the same run).
# RUNS rounds interleaved, medians (scripts/bench/eval_summary.py).
#   scripts/bench-eval.sh
# Env: RUNS (3), THREADS (2), DOCS (10), LEN (300), STEPS (64).
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-3} THREADS=${THREADS:-2} DOCS=${DOCS:-10} LEN=${LEN:-300} STEPS=${STEPS:-64}
venv="$(bash scripts/setup-interop-venv.sh)"
py="$venv/bin/python"
assets="$(bash scripts/fetch-test-assets.sh)"
cargo build --release --bin mindkit --example engine_speed >&2
smol="$(cd tests/interop && "$py" -c 'import smollm2, sys; print(smollm2.build(sys.argv[1], sys.argv[2]))' \
  "$assets/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" "$assets/smollm2/hf")"
cache="${MINDKIT_CACHE:-$HOME/.cache/mindkit}/bench"
mkdir -p "$cache"
for dtype in fp32 bf16; do
  [[ -f "$cache/smollm2-$dtype/config.json" ]] || target/release/mindkit convert --to hf \
    --input "$smol" --output "$cache/smollm2-$dtype" --dtype "$dtype" --quiet
done
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
for run in $(seq "$RUNS"); do
  echo "round $run/$RUNS" >&2
  for dtype in fp32 bf16; do
    RAYON_NUM_THREADS=$THREADS target/release/examples/engine_speed "$cache/smollm2-$dtype" \
      "$DOCS" "$LEN" "$STEPS" > "$work/mindkit-$dtype.$run.jsonl"
  done
  OMP_NUM_THREADS=$THREADS "$py" scripts/bench/hf_speed.py "$cache/smollm2-fp32" "$DOCS" "$LEN" \
    "$STEPS" "$THREADS" > "$work/transformers-fp32.$run.jsonl" 2>/dev/null
done
"$py" scripts/bench/eval_summary.py "$work" "$cache"
