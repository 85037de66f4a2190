"""A random LLaMA-architecture HF checkpoint (bf16 safetensors, 2 GB shards + index) of a given
shape, for the convert benchmarks. Usage: make_random_hf.py tinyllama|llama7b|qwen3moe OUT_DIR
[LAYERS]: qwen3moe is Qwen3-30B-A3B's shape (128 experts of 768, q/k norms), its 48 layers cut
to LAYERS (default 8: 11 GB) to fit the disk."""
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
    # Qwen3-30B-A3B (61 GB in bf16 with its 48 layers).
    "qwen3moe": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                     num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768),
}


def tensors(c):
    h, f = c["hidden_size"], c["intermediate_size"]
    d = c.get("head_dim", h // c["num_attention_heads"])
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    yield "model.embed_tokens.weight", (c["vocab_size"], h)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (h,)
        yield p + "self_attn.q_proj.weight", (q, h)
        yield p + "self_attn.k_proj.weight", (kv, h)
        yield p + "self_attn.v_proj.weight", (kv, h)
        yield p + "self_attn.o_proj.weight", (h, q)
        if "num_experts" in c:
            yield p + "self_attn.q_norm.weight", (d,)
            yield p + "self_attn.k_norm.weight", (d,)
        yield p + "post_attention_layernorm.weight", (h,)
        if "num_experts" not in c:
            yield p + "mlp.gate_proj.weight", (f, h)
            yield p + "mlp.up_proj.weight", (f, h)
            yield p + "mlp.down_proj.weight", (h, f)
            continue
        e, g = c["num_experts"], c["moe_intermediate_size"]
        yield p + "mlp.gate.weight", (e, h)
        for x in range(e):
            yield p + f"mlp.experts.{x}.gate_proj.weight", (g, h)
            yield p + f"mlp.experts.{x}.up_proj.weight", (g, h)
            yield p + f"mlp.experts.{x}.down_proj.weight", (h, g)
    yield "model.norm.weight", (h,)
    yield "lm_head.weight", (c["vocab_size"], h)


def main(shape, out, layers=None):
    c = dict(SHAPES[shape])
    if layers is not None:
        c["num_hidden_layers"] = int(layers)
    elif shape == "qwen3moe":
        c["num_hidden_layers"] = 8
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
    family = (dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                   norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
              if "num_experts" in c else dict(architectures=["LlamaForCausalLM"], model_type="llama"))
    config = dict(c, **family, hidden_act="silu", max_position_embeddings=4096, rms_norm_eps=1e-5,
                  rope_theta=10000.0, tie_word_embeddings=False, torch_dtype="bfloat16")
    (out / "config.json").write_text(json.dumps(config, indent=2))


if __name__ == "__main__":
    main(*sys.argv[1:4])
