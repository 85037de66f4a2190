#!/usr/bin/env bash
# Benchmark: data-parallel training, 2 ranks on this machine's cores (1 thread each), side by side:
# mindkit's ranks as processes under torchrun (TCPStore + sockets) and as threads of one process
# (--world-size 2), against PyTorch DDP over gloo under torchrun (scripts/bench/train_torch.py),
# the tiny shape of scripts/bench-train.sh, fp32, micro batch MBS per rank. RUNS rounds; medians of
# the per-run medians (first iteration dropped), the ratio to PyTorch, peak RSS of each tree.
#   scripts/bench-train-dp.sh
# Env: RUNS (3), ITERS (6), SEQ (256), MBS (4).
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-3} ITERS=${ITERS:-6} SEQ=${SEQ:-256} MBS=${MBS:-4}
venv="$(bash scripts/setup-interop-venv.sh)"
py="$venv/bin/python"
assets="$(bash scripts/fetch-test-assets.sh)"
cargo build --release --bin mindkit >&2
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$py" scripts/bench/make_tokens.py "$work/data" 32000 $(( (ITERS + 1) * 2 * MBS * (SEQ + 1) * 2 )) 2>/dev/null
torchrun=("$py" -m torch.distributed.run --nproc-per-node 2 --master-port 29511)
train=(train --num-layers 4 --hidden-size 256 --ffn-hidden-size 640 --num-attention-heads 4
  --untie-embeddings-and-output-weights --padded-vocab-size 32000 --swiglu --disable-bias-linear
  --normalization RMSNorm --position-embedding-type rope --max-position-embeddings 2048
  --seq-length "$SEQ" --micro-batch-size "$MBS" --global-batch-size $(( 2 * MBS ))
  --train-iters "$ITERS" --lr 1e-4 --attention-dropout 0.0 --hidden-dropout 0.0
  --tokenizer-name-or-path "$assets/llama2" --data-path "$work/data" --split 1
  --eval-iters 0 --log-interval 1 --quiet)
for run in $(seq "$RUNS"); do
  echo "round $run/$RUNS" >&2
  RAYON_NUM_THREADS=1 OMP_NUM_THREADS=1 "$py" scripts/bench/measure.py "$work/mindkit-dp-processes.$run.json" \
    --stdout "$work/mindkit-dp-processes.$run.log" -- \
    "${torchrun[@]}" --no-python target/release/mindkit "${train[@]}"
  RAYON_NUM_THREADS=2 "$py" scripts/bench/measure.py "$work/mindkit-dp-threads.$run.json" \
    --stdout "$work/mindkit-dp-threads.$run.log" -- target/release/mindkit "${train[@]}" --world-size 2
  OMP_NUM_THREADS=1 "$py" scripts/bench/measure.py "$work/torch-dp.$run.json" \
    --stdout "$work/torch-dp.$run.jsonl" -- \
    "${torchrun[@]}" scripts/bench/train_torch.py tiny "$work/data" "$ITERS" "$MBS" "$SEQ" 1
done
"$py" scripts/bench/train_summary.py "$work" dp "processes threads"
