#!/usr/bin/env bash
# Benchmark: two builds of mindkit side by side (a refactor that must not slow anything down),
# interleaved on the same machine, same threads: training time per iteration (scripts/bench-train.sh's
# shapes and flags, fp32 and --bf16) and the engine's prefill / decode speed on SmolLM2-135M
# (scripts/bench-eval.sh's examples/engine_speed, fp32 and bf16 weights). Medians over RUNS rounds
# of each run's median (warm-up iteration dropped); B / A ratios (> 1: B faster).
#   scripts/bench-ab.sh A_DIR B_DIR      (each holding mindkit and examples/engine_speed, or
#                                         mindkit and engine_speed side by side)
# Env: RUNS (3), THREADS (2), ITERS (6), SEQ (256), MBS (4), GBS (MBS: one micro-batch a step),
#      SHAPES ("tiny smollm2"), MODES ("fp32 bf16"; also "unfused": --bf16
#      --no-gradient-accumulation-fusion, "dropout": --bf16 with Megatron's default dropout),
#      DOCS (10), LEN (300), STEPS (64).
set -euo pipefail
[[ $# -eq 2 ]] || { sed -n '2,9p' "$0" >&2; exit 2; }
cd "$(dirname "$0")/.."
RUNS=${RUNS:-3} THREADS=${THREADS:-2} ITERS=${ITERS:-6} SEQ=${SEQ:-256} MBS=${MBS:-4}
GBS=${GBS:-$MBS} SHAPES=${SHAPES:-"tiny smollm2"} MODES=${MODES:-"fp32 bf16"} DOCS=${DOCS:-10} LEN=${LEN:-300} STEPS=${STEPS:-64}
venv="$(bash scripts/setup-interop-venv.sh)"
py="$venv/bin/python"
assets="$(bash scripts/fetch-test-assets.sh)"
bin() { [[ -x "$1/$2" ]] && echo "$1/$2" || echo "$1/examples/$2"; }
declare -A DIR=([a]="$(cd "$1" && pwd)" [b]="$(cd "$2" && pwd)")
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$py" scripts/bench/make_tokens.py "$work/data" 32000 $(( (ITERS + 1) * GBS * (SEQ + 1) * 2 )) 2>/dev/null
smol="$(cd tests/interop && "$py" -c 'import smollm2, sys; print(smollm2.build(sys.argv[1], sys.argv[2]))' \
  "$assets/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" "$assets/smollm2/hf")"
cache="${MINDKIT_CACHE:-$HOME/.cache/mindkit}/bench"
mkdir -p "$cache"
for dtype in fp32 bf16; do
  [[ -f "$cache/smollm2-$dtype/config.json" ]] || "$(bin "${DIR[b]}" mindkit)" convert --to hf \
    --input "$smol" --output "$cache/smollm2-$dtype" --dtype "$dtype" --quiet
done
declare -A ARCH=(
  [tiny]="--num-layers 4 --hidden-size 256 --ffn-hidden-size 640 --num-attention-heads 4 --untie-embeddings-and-output-weights --padded-vocab-size 32000"
  [smollm2]="--num-layers 30 --hidden-size 576 --ffn-hidden-size 1536 --num-attention-heads 9 --group-query-attention --num-query-groups 3 --padded-vocab-size 49152"
)
for run in $(seq "$RUNS"); do
  echo "round $run/$RUNS" >&2
  for build in a b; do
    for shape in $SHAPES; do
      for mode in $MODES; do
        nodrop="--attention-dropout 0.0 --hidden-dropout 0.0"
        case $mode in
          fp32) flags="$nodrop" ;;
          bf16) flags="--bf16 $nodrop" ;;
          unfused) flags="--bf16 --no-gradient-accumulation-fusion $nodrop" ;;
          dropout) flags="--bf16" ;;
          *) echo "unknown mode $mode" >&2; exit 2 ;;
        esac
        RAYON_NUM_THREADS=$THREADS "$(bin "${DIR[$build]}" mindkit)" train ${ARCH[$shape]} --swiglu \
          --disable-bias-linear --normalization RMSNorm --position-embedding-type rope \
          --max-position-embeddings 2048 --seq-length "$SEQ" --micro-batch-size "$MBS" \
          --global-batch-size "$GBS" --train-iters "$ITERS" --lr 1e-4 \
          --tokenizer-name-or-path "$assets/llama2" --data-path "$work/data" --split 1 \
          --eval-iters 0 --log-interval 1 --quiet $flags > "$work/train-$build-$shape-$mode.$run.log" \
          2>&1 || true
      done
    done
    for dtype in fp32 bf16; do
      RAYON_NUM_THREADS=$THREADS "$(bin "${DIR[$build]}" engine_speed)" "$cache/smollm2-$dtype" \
        "$DOCS" "$LEN" "$STEPS" > "$work/engine-$build-$dtype.$run.jsonl"
    done
  done
done
"$py" scripts/bench/ab_summary.py "$work" "$SHAPES" "$MODES"
