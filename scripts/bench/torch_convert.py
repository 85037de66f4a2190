"""The peer of `mindkit convert` in the benchmark: HF → Megatron (mcore local layout) the way the
Python converters do it (MindSpeed-LLM convert_hf2mg, Megatron's loader/saver): load the HF
weights with torch, build every rank's state dict with torch ops (GQA-grouped QKV, per-rank
[gate; up], vocab padding), torch.save each rank file.
Usage: torch_convert.py HF_DIR OUT_DIR TP PP"""
import argparse
import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file


def main(hf, out, tp, pp):
    hf, out = Path(hf), Path(out)
    c = json.loads((hf / "config.json").read_text())
    sd = {}
    for f in sorted(hf.glob("*.safetensors")):
        sd.update(load_file(str(f)))
    h, nh, ng, L = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["num_hidden_layers"]
    d = h // nh
    m = 128 * tp
    padded = (c["vocab_size"] + m - 1) // m * m

    def pad(w):
        return torch.cat([w, w[-1:].expand(padded - w.shape[0], -1)]) if padded > w.shape[0] else w

    emb, head = pad(sd["model.embed_tokens.weight"]).chunk(tp), pad(sd["lm_head.weight"]).chunk(tp)
    per = L // pp
    args = argparse.Namespace(num_layers=L, hidden_size=h, num_attention_heads=nh,
                              tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                              padded_vocab_size=padded)
    for p in range(pp):
        ranks = [{} for _ in range(tp)]
        for j in range(per):
            i = p * per + j
            pre = f"model.layers.{i}."
            q = sd[pre + "self_attn.q_proj.weight"].view(ng, nh // ng * d, h)
            k = sd[pre + "self_attn.k_proj.weight"].view(ng, d, h)
            v = sd[pre + "self_attn.v_proj.weight"].view(ng, d, h)
            qkv = torch.cat([q, k, v], dim=1).reshape(-1, h).chunk(tp)
            proj = sd[pre + "self_attn.o_proj.weight"].chunk(tp, dim=1)
            gate = sd[pre + "mlp.gate_proj.weight"].chunk(tp)
            up = sd[pre + "mlp.up_proj.weight"].chunk(tp)
            down = sd[pre + "mlp.down_proj.weight"].chunk(tp, dim=1)
            for t in range(tp):
                k2 = f"decoder.layers.{j}."
                r = ranks[t]
                r[k2 + "input_layernorm.weight"] = sd[pre + "input_layernorm.weight"].clone()
                r[k2 + "self_attention.linear_qkv.weight"] = qkv[t].clone()
                r[k2 + "self_attention.linear_proj.weight"] = proj[t].clone()
                r[k2 + "pre_mlp_layernorm.weight"] = sd[pre + "post_attention_layernorm.weight"].clone()
                r[k2 + "mlp.linear_fc1.weight"] = torch.cat([gate[t], up[t]])
                r[k2 + "mlp.linear_fc2.weight"] = down[t].clone()
        for t in range(tp):
            if p == 0:
                ranks[t]["embedding.word_embeddings.weight"] = emb[t].clone()
            if p == pp - 1:
                ranks[t]["decoder.final_layernorm.weight"] = sd["model.norm.weight"].clone()
                ranks[t]["output_layer.weight"] = head[t].clone()
            name = f"mp_rank_{t:02}_{p:03}" if pp > 1 else f"mp_rank_{t:02}"
            path = out / "iter_0000001" / name
            os.makedirs(path, exist_ok=True)
            torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 1, "model": ranks[t]},
                       path / "model_optim_rng.pt")
    (out / "latest_checkpointed_iteration.txt").write_text("1")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
