#!/bin/bash
# MindSpeed-LLM's examples/mcore/llama2/pretrain_llama2_13b_ptd.sh with its sizes shrunk to a
# model that trains in seconds on a CPU (4 ranks: TP 2 with sequence parallelism × PP 2, where
# the original has TP 8, PP 1)
# and the launcher line `python -m torch.distributed.launch $DISTRIBUTED_ARGS pretrain_gpt.py`
# replaced by `torchrun $DISTRIBUTED_ARGS --no-python mindkit train`. Every other flag is the
# original's: the NPU kernel and overlap flags are accepted and have no effect on the CPU
# (`mindkit train --help` lists them).
export HCCL_CONNECT_TIMEOUT=3600
export HCCL_EXEC_TIMEOUT=3600
export CUDA_DEVICE_MAX_CONNECTIONS=1
export PYTORCH_NPU_ALLOC_CONF=expandable_segments:True

NPUS_PER_NODE=4
MASTER_ADDR=localhost
MASTER_PORT=${MASTER_PORT:-6000}
NNODES=1
NODE_RANK=0
WORLD_SIZE=$(($NPUS_PER_NODE*$NNODES))

CKPT_SAVE_DIR="${CKPT_SAVE_DIR:-your model save ckpt path}"
DATA_PATH="${DATA_PATH:-your data path}"
TOKENIZER_MODEL="${TOKENIZER_MODEL:-your tokenizer path}"
CKPT_LOAD_DIR="${CKPT_LOAD_DIR:-your model ckpt path}"
TP=2
PP=2

DISTRIBUTED_ARGS="
    --nproc_per_node $NPUS_PER_NODE \
    --nnodes $NNODES \
    --node_rank $NODE_RANK \
    --master_addr $MASTER_ADDR \
    --master_port $MASTER_PORT
"

GPT_ARGS="
    --use-mcore-models \
    --tensor-model-parallel-size ${TP} \
    --pipeline-model-parallel-size ${PP} \
    --sequence-parallel \
    --num-layers 2 \
    --hidden-size 64 \
    --ffn-hidden-size 176 \
    --num-attention-heads 4 \
    --tokenizer-type PretrainedFromHF \
    --tokenizer-name-or-path ${TOKENIZER_MODEL} \
    --seq-length 64 \
    --max-position-embeddings 512 \
    --micro-batch-size 2 \
    --global-batch-size 8 \
    --make-vocab-size-divisible-by 1 \
    --lr 1e-3 \
    --train-iters 10 \
    --lr-decay-style cosine \
    --untie-embeddings-and-output-weights \
    --disable-bias-linear \
    --attention-dropout 0.0 \
    --init-method-std 0.01 \
    --hidden-dropout 0.0 \
    --position-embedding-type rope \
    --normalization RMSNorm \
    --use-fused-rmsnorm \
    --swiglu \
    --use-flash-attn \
    --no-masked-softmax-fusion \
    --attention-softmax-in-fp32 \
    --min-lr 1e-5 \
    --weight-decay 1e-1 \
    --lr-warmup-fraction 0.1 \
    --clip-grad 1.0 \
    --adam-beta1 0.9 \
    --initial-loss-scale 4096 \
    --adam-beta2 0.95 \
    --no-gradient-accumulation-fusion \
    --load ${CKPT_LOAD_DIR}  \
    --no-load-optim \
    --no-load-rng \
    --use-fused-swiglu \
    --use-fused-rotary-pos-emb \
    --bf16 \
    --ckpt-format torch
"

DATA_ARGS="
    --data-path $DATA_PATH \
    --handler-name GeneralPretrainHandler \
    --split 949,50,1
"

CKPT_ARGS="
    --enable-hf2mg-convert \
    --model-type-hf llama2
"

OUTPUT_ARGS="
    --log-interval 1 \
    --save-interval 10000 \
    --eval-interval 5 \
    --eval-iters 2 \
"

torchrun $DISTRIBUTED_ARGS --no-python mindkit train \
    $GPT_ARGS \
    $DATA_ARGS \
    $OUTPUT_ARGS \
    $CKPT_ARGS \
    --distributed-backend nccl \
    --save $CKPT_SAVE_DIR \
    --transformer-impl local \
    | tee logs/train_llama2_tiny.log
