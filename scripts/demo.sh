#!/usr/bin/env bash
# The whole pipeline on the shipped fixtures, each command printed before it runs:
# preprocess a corpus → convert an HF model to Megatron → train it (8 ranks as threads: tensor
# parallelism 2 with sequence parallelism × 2 pipeline stages × data parallelism 2) → convert
# back → generate.
# Outputs go to a new directory under /tmp (printed); nothing else is written.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --quiet --bin mindkit
out="$(mktemp -d /tmp/mindkit-demo.XXXXXX)"
run() {
  printf '\n$ mindkit %s\n' "$*"
  target/release/mindkit "$@"
}
run preprocess --input fixtures/corpus/pretrain.jsonl --output-prefix "$out/corpus" \
  --tokenizer fixtures/models/demo --append-eod
run data info "$out/corpus_text_document"
run convert --to megatron --input fixtures/models/demo --output "$out/megatron"
run train --load "$out/megatron" --data-path "$out/corpus_text_document" --split 1 \
  --seq-length 64 --micro-batch-size 2 --global-batch-size 8 --train-iters 60 \
  --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 5 --weight-decay 0.1 \
  --clip-grad 1.0 --attention-dropout 0.0 --hidden-dropout 0.0 --eval-iters 0 \
  --log-interval 10 --finetune --save "$out/trained" \
  --tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2 \
  --world-size 8
run convert --to hf --input "$out/trained" --output "$out/hf"
run generate --model "$out/hf" --prompt "The" --max-new-tokens 24
printf '\nmindkit demo: everything it wrote is in %s\n' "$out"
