"""The Python path from a Megatron torch_dist checkpoint of a LLaMA-architecture model to Hugging
Face on a CPU, as torch offers it: torch's `dcp_to_torch_save`
(torch.distributed.checkpoint.format_utils) turns the checkpoint into one torch.save file; torch
loads that (mmap) and converts megatron-core's tensors to HF's (stacked layers taken apart, each
query group's q / k / v rows split, fc1 split into gate and up, the padded vocabulary cut), saved
as 2 GB safetensors shards with an index.
Usage: dcp_to_hf.py ITER_DIR TMP_PT OUT_DIR HF_CONFIG_JSON"""
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save


def hf_tensors(sd, c):
    h, heads, groups = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    d, f, vocab = h // heads, c["intermediate_size"], c["vocab_size"]
    per = heads // groups
    yield "model.embed_tokens.weight", sd["embedding.word_embeddings.weight"][:vocab]
    stacked = lambda name: sd[f"decoder.layers.{name}"]
    for l in range(c["num_hidden_layers"]):
        p = f"model.layers.{l}."
        yield p + "input_layernorm.weight", stacked("self_attention.linear_qkv.layer_norm_weight")[l]
        qkv = stacked("self_attention.linear_qkv.weight")[l].view(groups, (per + 2) * d, h)
        yield p + "self_attn.q_proj.weight", qkv[:, :per * d].reshape(heads * d, h)
        yield p + "self_attn.k_proj.weight", qkv[:, per * d:(per + 1) * d].reshape(groups * d, h)
        yield p + "self_attn.v_proj.weight", qkv[:, (per + 1) * d:].reshape(groups * d, h)
        yield p + "self_attn.o_proj.weight", stacked("self_attention.linear_proj.weight")[l]
        yield p + "post_attention_layernorm.weight", stacked("mlp.linear_fc1.layer_norm_weight")[l]
        fc1 = stacked("mlp.linear_fc1.weight")[l]
        yield p + "mlp.gate_proj.weight", fc1[:f]
        yield p + "mlp.up_proj.weight", fc1[f:]
        yield p + "mlp.down_proj.weight", stacked("mlp.linear_fc2.weight")[l]
    yield "model.norm.weight", sd["decoder.final_layernorm.weight"]
    yield "lm_head.weight", sd["output_layer.weight"][:vocab]


def main(iter_dir, tmp_pt, out, config):
    dcp_to_torch_save(iter_dir, tmp_pt)
    sd = torch.load(tmp_pt, mmap=True, weights_only=False)
    sd = sd.get("model", sd)
    c = json.loads(Path(config).read_text())
    out = Path(out)
    out.mkdir(parents=True)
    shards, cur, size = [], {}, 0
    for name, t in hf_tensors(sd, c):
        cur[name] = t.contiguous()
        size += t.numel() * t.element_size()
        if size >= 2e9:
            shards.append(cur)
            cur, size = {}, 0
    shards.append(cur)
    weight_map = {}
    for i, s in enumerate(shards):
        fname = f"model-{i + 1:05}-of-{len(shards):05}.safetensors"
        save_file(s, str(out / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in s})
        s.clear()
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    shutil.copy(config, out / "config.json")


if __name__ == "__main__":
    main(*sys.argv[1:5])
