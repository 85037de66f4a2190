"""A random PEFT LoRA adapter (f32, every linear layer) for an HF model directory, for the lora
benchmark. Usage: make_random_adapter.py HF_DIR OUT_DIR RANK"""
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def main(hf, out, r):
    c = json.loads((Path(hf) / "config.json").read_text())
    r = int(r)
    h, f = c["hidden_size"], c["intermediate_size"]
    kv = c["num_key_value_heads"] * h // c["num_attention_heads"]
    shapes = {"q_proj": (h, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, h),
              "gate_proj": (f, h), "up_proj": (f, h), "down_proj": (h, f)}
    torch.manual_seed(0)
    tensors = {}
    for i in range(c["num_hidden_layers"]):
        for m in LINEAR:
            part = "self_attn" if m in LINEAR[:4] else "mlp"
            key = f"base_model.model.model.layers.{i}.{part}.{m}"
            rows, cols = shapes[m]
            tensors[key + ".lora_A.weight"] = torch.randn(r, cols) * 0.01
            tensors[key + ".lora_B.weight"] = torch.randn(rows, r) * 0.01
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps(dict(
        peft_type="LORA", task_type="CAUSAL_LM", r=r, lora_alpha=2 * r, target_modules=LINEAR,
        lora_dropout=0.0, bias="none", fan_in_fan_out=False, use_rslora=False, use_dora=False,
        base_model_name_or_path=str(hf)), indent=2))


if __name__ == "__main__":
    main(*sys.argv[1:])
