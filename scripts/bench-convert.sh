#!/usr/bin/env bash
# Benchmark: mindkit convert vs the way the Python converters work (scripts/bench/torch_convert.py:
# torch loads the HF weights, splits them with torch ops, torch.saves each rank) vs `cp -r` of the
# same bytes, side by side, RUNS rounds interleaved (sync + pause before each command), medians.
# Input: a random TinyLlama-1.1B-shaped HF checkpoint (bf16, 2.2 GB) built by
# scripts/bench/make_random_hf.py and cached under ~/.cache/mindkit/bench. Rows: HF → Megatron
# TP2 PP2 (mindkit and torch), Megatron → HF (mindkit), cp -r.
#   scripts/bench-convert.sh
# Env: RUNS (3); OUT (where outputs go; default the cache dir's disk; OUT=/dev/shm takes the
#   disk's write speed out and compares the converters themselves); BIG=1 also converts a LLaMA-2-7B-shaped model (13.5 GB; needs ~30 GB of disk)
#   with mindkit once, to show that peak memory does not grow with the model.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-3} BIG=${BIG:-0}
source scripts/bench/setup.sh
for run in $(seq "$RUNS"); do
  echo "round $run/$RUNS" >&2
  rm -rf "$work"/out-*
  measure "$work/torch-hf2mg.$run.json" -- "$py" scripts/bench/torch_convert.py "$hf" "$work/out-torch" 2 2
  measure "$work/mindkit-hf2mg.$run.json" -- "$bin" convert --to megatron --input "$hf" \
    --output "$work/out-mg" --tp 2 --pp 2 --quiet
  measure "$work/mindkit-mg2hf.$run.json" -- "$bin" convert --to hf --input "$work/out-mg" \
    --output "$work/out-hf" --quiet
  measure "$work/cp.$run.json" -- cp -r "$hf" "$work/out-cp"
done
"$py" scripts/bench/convert_summary.py "$work" "$hf"

if (( BIG )); then
  big="$cache/llama7b-hf"
  [[ -f "$big/config.json" ]] || "$py" scripts/bench/make_random_hf.py llama7b "$big"
  rm -rf "$work"/out-*
  measure "$work/big-hf2mg.json" -- "$bin" convert --to megatron --input "$big" \
    --output "$work/out-big" --tp 2 --pp 2 --quiet
  "$py" scripts/bench/convert_summary.py "$work" "$big" big-hf2mg
fi
