#!/usr/bin/env bash
# Benchmark: `mindkit lora merge` of a random r=64 adapter on every linear layer of a random
# TinyLlama-1.1B-shaped bf16 base (the convert benchmark's input) against a plain
# `mindkit convert` of the same base (same output format), and against peft's
# merge_and_unload + save_pretrained (scripts/bench/peft_merge.py), side by side, RUNS rounds
# interleaved, medians (scripts/bench/convert_summary.py).
#   scripts/bench-lora.sh
# Env: RUNS (3); RANK (64); OUT (where outputs go; OUT=/dev/shm takes the disk out).
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-3} RANK=${RANK:-64}
source scripts/bench/setup.sh
adapter="$cache/tinyllama-lora-r$RANK"
[[ -f "$adapter/adapter_config.json" ]] || "$py" scripts/bench/make_random_adapter.py "$hf" "$adapter" "$RANK"
for run in $(seq "$RUNS"); do
  echo "round $run/$RUNS" >&2
  rm -rf "$work"/out-*
  measure "$work/convert-hf2hf.$run.json" -- "$bin" convert --to hf --input "$hf" \
    --output "$work/out-c-hf" --quiet
  measure "$work/merge-hf.$run.json" -- "$bin" lora merge --base "$hf" --adapter "$adapter" \
    --output "$work/out-m-hf" --quiet
  measure "$work/convert-hf2mg.$run.json" -- "$bin" convert --to megatron --input "$hf" \
    --output "$work/out-c-mg" --tp 2 --pp 2 --quiet
  measure "$work/merge-mg.$run.json" -- "$bin" lora merge --base "$hf" --adapter "$adapter" \
    --to megatron --tp 2 --pp 2 --output "$work/out-m-mg" --quiet
  measure "$work/peft-merge.$run.json" -- "$py" scripts/bench/peft_merge.py "$hf" "$adapter" \
    "$work/out-peft"
done
"$py" scripts/bench/convert_summary.py "$work" "$hf"
