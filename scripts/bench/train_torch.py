"""PyTorch eager training speed, the peer `scripts/bench-train.sh` compares mindkit with: a
LLaMA model (transformers, fp32, eager attention) trained on the same .bin/.idx samples with
torch.optim.AdamW, one forward + backward + step per iteration (micro batch = global batch). Under torchrun, data
parallelism as Megatron's peers run it: DistributedDataParallel over gloo, each rank training on its
micro-batch of every global batch (micro batch × WORLD_SIZE), gradients all-reduced in backward.
Prints one JSON line (rank 0): {"ms_per_iteration": [...], "losses": [...]}.
Usage: train_torch.py SHAPE DATA_PREFIX ITERS MICRO_BATCH SEQ THREADS"""
import json
import sys
import time

import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

SHAPES = {
    # hidden, layers, heads, kv heads, ffn, vocab, tied
    "tiny": (256, 4, 4, 4, 640, 32000, False),
    "smollm2": (576, 30, 9, 3, 1536, 49152, True),
}


def main():
    shape, prefix, iters, mbs, seq, threads = sys.argv[1:7]
    iters, mbs, seq, threads = int(iters), int(mbs), int(seq), int(threads)
    torch.set_num_threads(threads)
    h, layers, heads, kv, ffn, vocab, tied = SHAPES[shape]
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=h, intermediate_size=ffn,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv, max_position_embeddings=2048,
                      tie_word_embeddings=tied, attn_implementation="eager")
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    rank, world = 0, 1
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    tokens = np.fromfile(f"{prefix}.bin", dtype=np.uint16).astype(np.int64)
    times, losses = [], []
    for it in range(iters):
        start = (it * world + rank) * mbs * (seq + 1)
        batch = torch.from_numpy(tokens[start:start + mbs * (seq + 1)].reshape(mbs, seq + 1))
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        logits = model(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, vocab), batch[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        times.append((time.perf_counter() - t0) * 1000)
        losses.append(loss.item())
    if rank == 0:
        print(json.dumps({"ms_per_iteration": times, "losses": losses}))
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
