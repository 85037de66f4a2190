#!/usr/bin/env bash
# Benchmark: mindkit convert of a mixture of experts against MindSpeed-LLM's own converter
# (convert_ckpt_v2.py of a checkout, run on the CPU through scripts/bench/msl_convert.py), side by
# side, RUNS rounds interleaved (sync + pause before each command), medians; then every tensor
# of the two outputs compared. Input: a random Qwen3-30B-A3B-shaped HF checkpoint (bf16; 128
# experts of 768, q/k norms) with its 48 layers cut to LAYERS (default 8, 11 GB; 48 is 61 GB and
# needs ~190 GB of disk for input and both outputs), built by scripts/bench/make_random_hf.py and
# cached under ~/.cache/mindkit/bench. Both write TP 2 × EP 4 with grouped experts
# (--moe-grouped-gemm) and the unpadded vocabulary MindSpeed-LLM's converter writes.
#   scripts/bench-convert-moe.sh MINDSPEED_LLM_DIR
# Env: RUNS (3), LAYERS (8), OUT (where outputs go; default the cache dir's disk).
set -euo pipefail
[[ $# -eq 1 ]] || { sed -n '2,11p' "$0" >&2; exit 2; }
msllm="$(cd "$1" && pwd)"
cd "$(dirname "$0")/.."
RUNS=${RUNS:-3} LAYERS=${LAYERS:-8}
source scripts/bench/setup.sh
moe="$cache/qwen3moe-$LAYERS-hf"
[[ -f "$moe/config.json" ]] || "$py" scripts/bench/make_random_hf.py qwen3moe "$moe" "$LAYERS"
for run in $(seq "$RUNS"); do
  echo "round $run/$RUNS" >&2
  rm -rf "$work"/out-*
  measure "$work/msl-moe.$run.json" -- "$py" scripts/bench/msl_convert.py "$msllm" \
    --load-model-type hf --save-model-type mg --target-tensor-parallel-size 2 \
    --target-pipeline-parallel-size 1 --target-expert-parallel-size 4 --moe-grouped-gemm \
    --model-type-hf qwen3-moe --load-dir "$moe" --save-dir "$work/out-msl"
  measure "$work/mindkit-moe.$run.json" -- "$bin" convert --to megatron --input "$moe" \
    --output "$work/out-mk" --tp 2 --ep 4 --moe-grouped-gemm --make-vocab-size-divisible-by 1 --quiet
done
"$py" scripts/bench/convert_summary.py "$work" "$moe"
"$py" scripts/bench/same_megatron.py "$work/out-msl" "$work/out-mk"
