"""A random LLaMA-architecture HF checkpoint (bf16 safetensors, 2 GB shards + index) of a given
shape, for the convert benchmark. Usage: make_random_hf.py tinyllama|llama7b OUT_DIR"""
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

SHAPES = {
    # TinyLlama-1.1B: 2.2 GB in bf16.
    "tinyllama": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                      num_attention_heads=32, num_key_value_heads=4, vocab_size=32000),
    # LLaMA-2-7B: 13.5 GB in bf16.
    "llama7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=32, vocab_size=32000),
}


def tensors(c):
    h, f, d = c["hidden_size"], c["intermediate_size"], c["hidden_size"] // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * d
    yield "model.embed_tokens.weight", (c["vocab_size"], h)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (h,)
        yield p + "self_attn.q_proj.weight", (h, h)
        yield p + "self_attn.k_proj.weight", (kv, h)
        yield p + "self_attn.v_proj.weight", (kv, h)
        yield p + "self_attn.o_proj.weight", (h, h)
        yield p + "post_attention_layernorm.weight", (h,)
        yield p + "mlp.gate_proj.weight", (f, h)
        yield p + "mlp.up_proj.weight", (f, h)
        yield p + "mlp.down_proj.weight", (h, f)
    yield "model.norm.weight", (h,)
    yield "lm_head.weight", (c["vocab_size"], h)


def main(shape, out):
    c = SHAPES[shape]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    shards, cur, size = [], {}, 0
    for name, shp in tensors(c):
        cur[name] = (torch.randn(shp, dtype=torch.float32) * 0.02).to(torch.bfloat16)
        size += cur[name].numel() * 2
        if size >= 2e9:
            shards.append(cur)
            cur, size = {}, 0
    if cur:
        shards.append(cur)
    weight_map, total = {}, 0
    for i, s in enumerate(shards):
        fname = f"model-{i + 1:05}-of-{len(shards):05}.safetensors"
        save_file(s, str(out / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in s})
        total += sum(v.numel() * 2 for v in s.values())
        s.clear()
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    config = dict(c, architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
                  max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0,
                  tie_word_embeddings=False, torch_dtype="bfloat16")
    (out / "config.json").write_text(json.dumps(config, indent=2))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
