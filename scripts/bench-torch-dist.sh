#!/usr/bin/env bash
# Benchmark: a Megatron torch_dist checkpoint → Hugging Face, mindkit vs the Python path that runs
# on a CPU (scripts/bench/dcp_to_hf.py: torch's dcp_to_torch_save, then a torch conversion to HF
# safetensors), and `cp -r` of the same bytes, RUNS rounds interleaved (sync + pause before each
# command), medians of wall time and peak RSS of the process tree.
# Input: a random LLaMA-2-7B-shaped HF model (bf16; every layer of 7B's shapes, the 32 layers cut
# to LAYERS, default 16, 6.7 GB, to leave disk for the five copies a round holds), written as
# torch_dist by mindkit (megatron-core loads it strictly: tests/interop/test_convert.py); both
# outputs are checked equal to the input, tensor for tensor.
#   scripts/bench-torch-dist.sh
# Env: RUNS (3), LAYERS (16), OUT (where outputs go; default the cache dir's disk).
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-3} LAYERS=${LAYERS:-16}
source scripts/bench/setup.sh
src="$cache/llama7b-${LAYERS}l-hf"
[[ -f "$src/config.json" ]] || "$py" scripts/bench/make_random_hf.py llama7b "$src" "$LAYERS"
dist="$cache/llama7b-${LAYERS}l-dist"
[[ -f "$dist/latest_checkpointed_iteration.txt" ]] ||
  "$bin" convert --to megatron --ckpt-format torch_dist --input "$src" --output "$dist" --quiet
for run in $(seq "$RUNS"); do
  echo "round $run/$RUNS" >&2
  rm -rf "$work"/out-*
  measure "$work/torch-dist2hf.$run.json" -- "$py" scripts/bench/dcp_to_hf.py \
    "$dist/iter_0000001" "$work/out-torch.pt" "$work/out-torch-hf" "$src/config.json"
  [[ $run == 1 ]] && "$py" scripts/bench/hf_equal.py "$src" "$work/out-torch-hf"
  rm -rf "$work"/out-*
  measure "$work/mindkit-dist2hf.$run.json" -- "$bin" convert --to hf --input "$dist" \
    --output "$work/out-hf" --quiet
  [[ $run == 1 ]] && "$py" scripts/bench/hf_equal.py "$src" "$work/out-hf"
  rm -rf "$work"/out-*
  measure "$work/cp.$run.json" -- cp -r "$dist" "$work/out-cp"
done
"$py" scripts/bench/convert_summary.py "$work" "$src"
