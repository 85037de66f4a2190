#!/usr/bin/env bash
# Benchmark: time per training iteration of `mindkit train` (fp32, and --bf16) against PyTorch
# eager (transformers LlamaForCausalLM, fp32, torch.optim.AdamW; --bf16 products run on AMX tiles where
# the CPU has them) on the same random-token data,
# same threads, micro batch = global batch, side by side; RUNS rounds, medians of the per-run
# medians (warm-up iterations dropped), peak RSS of each process tree (scripts/bench/measure.py).
# Shapes: tiny (hidden 256, 4 layers, vocab 32000) and smollm2 (SmolLM2-135M: hidden 576,
# 30 layers, 9 heads / 3 KV, ffn 1536, vocab 49152, tied).
#   scripts/bench-train.sh
# Env: RUNS (3), THREADS (2), ITERS (6), SEQ (256), MBS (4), SHAPES ("tiny smollm2").
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-3} THREADS=${THREADS:-2} ITERS=${ITERS:-6} SEQ=${SEQ:-256} MBS=${MBS:-4}
SHAPES=${SHAPES:-"tiny smollm2"}
venv="$(bash scripts/setup-interop-venv.sh)"
py="$venv/bin/python"
assets="$(bash scripts/fetch-test-assets.sh)"
cargo build --release --bin mindkit >&2
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$py" scripts/bench/make_tokens.py "$work/data" 32000 $(( (ITERS + 1) * MBS * (SEQ + 1) * 2 )) 2>/dev/null
declare -A ARCH=(
  [tiny]="--num-layers 4 --hidden-size 256 --ffn-hidden-size 640 --num-attention-heads 4 --untie-embeddings-and-output-weights --padded-vocab-size 32000"
  [smollm2]="--num-layers 30 --hidden-size 576 --ffn-hidden-size 1536 --num-attention-heads 9 --group-query-attention --num-query-groups 3 --padded-vocab-size 49152"
)
for run in $(seq "$RUNS"); do
  for shape in $SHAPES; do
    echo "round $run/$RUNS: $shape" >&2
    for mode in fp32 bf16; do
      flags=""; [[ $mode == bf16 ]] && flags="--bf16"
      RAYON_NUM_THREADS=$THREADS "$py" scripts/bench/measure.py "$work/mindkit-$shape-$mode.$run.json" \
        --stdout "$work/mindkit-$shape-$mode.$run.log" -- \
        target/release/mindkit train ${ARCH[$shape]} --swiglu --disable-bias-linear \
        --normalization RMSNorm --position-embedding-type rope --max-position-embeddings 2048 \
        --seq-length "$SEQ" --micro-batch-size "$MBS" --global-batch-size "$MBS" \
        --train-iters "$ITERS" --lr 1e-4 --attention-dropout 0.0 --hidden-dropout 0.0 \
        --tokenizer-name-or-path "$assets/llama2" --data-path "$work/data" --split 1 \
        --eval-iters 0 --log-interval 1 --quiet $flags
    done
    OMP_NUM_THREADS=$THREADS "$py" scripts/bench/measure.py "$work/torch-$shape.$run.json" \
      --stdout "$work/torch-$shape.$run.jsonl" -- \
      "$py" scripts/bench/train_torch.py "$shape" "$work/data" "$ITERS" "$MBS" "$SEQ" "$THREADS"
  done
done
"$py" scripts/bench/train_summary.py "$work" "$SHAPES"
