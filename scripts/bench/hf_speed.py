"""transformers' side of scripts/bench-eval.sh: the same measurements as examples/engine_speed.rs
on the same token sequences, torch with the same number of threads.
    python hf_speed.py MODEL_DIR DOCS CONTEXT_LEN DECODE_STEPS THREADS"""
import json
import sys
import time

import torch
from transformers import AutoModelForCausalLM


def token(i, j, vocab):
    return (i * 7919 + j * 104729 + 13) % vocab


@torch.no_grad()
def main(model_dir, docs, length, steps, threads):
    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    start = time.perf_counter()
    for i in range(docs):
        ids = torch.tensor([[token(i, j, vocab) for j in range(length)]])
        torch.log_softmax(model(ids).logits[0, -1], dim=-1)
    secs = time.perf_counter() - start
    print(json.dumps({"what": "prefill", "tokens_per_s": docs * length / secs}))
    prompt = torch.tensor([[token(docs, j, vocab) for j in range(8)]])
    model.generate(prompt, max_new_tokens=2, min_new_tokens=2, do_sample=False)  # warm-up
    start = time.perf_counter()
    out = model.generate(prompt, max_new_tokens=steps + 1, min_new_tokens=steps + 1,
                         do_sample=False, pad_token_id=0)
    secs = time.perf_counter() - start
    # The first new token comes from the prompt's forward pass: time it out as prefill.
    first = time.perf_counter()
    model(prompt)
    secs -= time.perf_counter() - first
    assert out.shape[1] == 8 + steps + 1
    print(json.dumps({"what": "decode", "tokens_per_s": steps / secs}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
