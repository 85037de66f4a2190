#!/bin/bash
# MindSpeed-LLM's examples/mcore/llama2/tune_llama2_7b_lora_ptd.sh with its sizes shrunk to a
# model that trains in seconds on a CPU and the launcher line `torchrun $DISTRIBUTED_ARGS
# posttrain_gpt.py` replaced by `mindkit train`. Every other flag is the original's: the NPU
# kernel and overlap flags are accepted and have no effect on the CPU (`mindkit train --help`
# lists them). It fine-tunes as one rank from the pretraining script's TP 2 × PP 2 checkpoint,
# resharded on load.
export CUDA_DEVICE_MAX_CONNECTIONS=1
export PYTORCH_NPU_ALLOC_CONF=expandable_segments:True
export HCCL_CONNECT_TIMEOUT=1200
export HCCL_EXEC_TIMEOUT=1200

NPUS_PER_NODE=1
MASTER_ADDR=localhost
MASTER_PORT=6080
NNODES=1
NODE_RANK=0
WORLD_SIZE=$(($NPUS_PER_NODE*$NNODES))

CKPT_SAVE_DIR="${CKPT_SAVE_DIR:-your model save ckpt path}"
DATA_PATH="${DATA_PATH:-your data path}"
TOKENIZER_MODEL="${TOKENIZER_MODEL:-your tokenizer path}"
CKPT_LOAD_DIR="${CKPT_LOAD_DIR:-your model ckpt path}"

TP=1
PP=1

DIST_ALGO="
    --tensor-model-parallel-size ${TP} \
    --pipeline-model-parallel-size ${PP} \
    --sequence-parallel \
"

MODEL_ARGS="
    --num-layers 2 \
    --hidden-size 64 \
    --ffn-hidden-size 176 \
    --num-attention-heads 4 \
    --seq-length 64 \
    --max-position-embeddings 512 \
"

TRAINING_ARGS="
    --use-mcore-models \
    --prompt-type llama2 \
    --tokenizer-type PretrainedFromHF \
    --tokenizer-name-or-path ${TOKENIZER_MODEL} \
    --micro-batch-size 2 \
    --global-batch-size 4 \
    --make-vocab-size-divisible-by 1 \
    --train-iters 10 \
    --lr 5e-3 \
    --lr-decay-style cosine \
    --lr-warmup-fraction 0.1 \
    --min-lr 1.25e-4 \
    --weight-decay 1e-1 \
    --clip-grad 1.0 \
    --swiglu \
    --position-embedding-type rope \
    --untie-embeddings-and-output-weights \
    --disable-bias-linear \
    --attention-dropout 0.0 \
    --hidden-dropout 0.0 \
    --normalization RMSNorm \
    --use-fused-rmsnorm \
    --use-flash-attn \
    --no-masked-softmax-fusion \
    --attention-softmax-in-fp32 \
    --init-method-std 0.01 \
    --initial-loss-scale 65536 \
    --adam-beta1 0.9 \
    --adam-beta2 0.98 \
    --no-gradient-accumulation-fusion \
    --no-load-optim \
    --no-load-rng \
    --no-pad-to-seq-lengths \
    --rotary-base 10000 \
    --norm-epsilon 1e-05 \
    --vocab-size 400 \
    --log-throughput \
    --bf16 \
"

FINETUNE_ARGS="
    --finetune \
    --stage sft \
    --is-instruction-dataset \
    --lora-r 16 \
    --lora-alpha 32 \
    --lora-fusion \
    --lora-target-modules linear_qkv linear_proj linear_fc1 linear_fc2 \
"

DATA_ARGS="
    --data-path $DATA_PATH \
    --split 949,50,1 \
"

OUTPUT_ARGS="
    --log-interval 1 \
    --save-interval 500 \
    --eval-interval 10000 \
    --eval-iters 0 \
"

mindkit train \
    $DIST_ALGO \
    $MODEL_ARGS \
    $TRAINING_ARGS \
    $FINETUNE_ARGS \
    $DATA_ARGS \
    $OUTPUT_ARGS \
    --load $CKPT_LOAD_DIR \
    --save $CKPT_SAVE_DIR \
    --log-throughput \
    --distributed-backend nccl \
    --transformer-impl local \
    | tee logs/tune_llama2_tiny_lora.log
