"""mindkit lora merge checked by the real tools: peft's merge_and_unload on transformers models
(fresh random adapters, safetensors and .bin), and on megatron-core's GPTModel wrapped by peft's
Megatron LoRA layers (LoraParallelLinear, as MindSpeed-LLM trains) — a LoRA-only checkpoint and a
"unified" one (base_layer weights + LoRA in one file) saved from that model."""
import copy
import pathlib

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from megatron_cpu import gpt_model, load_pt, logits

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODELS = ROOT / "fixtures/models"
LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def hf_state(d):
    out = {}
    for f in pathlib.Path(d).glob("*.safetensors"):
        out.update(load_file(str(f)))
    return out


def max_diff(a, b):
    assert a.keys() == b.keys(), set(a) ^ set(b)
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.parametrize("family,kw,safe", [
    ("qwen2", dict(r=8, lora_alpha=16, target_modules=LINEAR, lora_bias=False), True),
    ("llama", dict(r=6, lora_alpha=3, use_rslora=True, target_modules=LINEAR,
                   rank_pattern={"o_proj": 2}, alpha_pattern={"up_proj": 7}), False),
    ("mistral", dict(r=4, lora_alpha=8, target_modules=r".*\.(q_proj|down_proj)"), True),
    ("qwen3", dict(r=4, lora_alpha=8, target_modules=LINEAR), True),
    # mixtures of experts: every expert's linears, the router (`gate`), the shared expert and
    # its gate
    ("qwen3_moe", dict(r=4, lora_alpha=8, target_modules=LINEAR + ["gate"]), True),
    ("mixtral", dict(r=2, lora_alpha=4, target_modules=["q_proj", "w1", "w2", "w3", "gate"]), True),
    ("qwen2_moe", dict(r=4, lora_alpha=8, target_modules=LINEAR + ["gate", "shared_expert_gate"]),
     True),
    ("glm4_moe", dict(r=4, lora_alpha=8, target_modules=LINEAR), True),
    # multi-latent attention: the latents' down and up projections, the experts and the dense
    # first layer
    ("deepseek_v3", dict(r=4, lora_alpha=8, target_modules=[
        "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj",
        "up_proj", "down_proj"]), True),
    ("deepseek_v2", dict(r=4, lora_alpha=8, target_modules=[
        "q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "down_proj"]), True),
    # LongCat-Flash: both sublayers' attention and dense MLPs, the shortcut experts, the router
    ("longcat_flash", dict(r=4, lora_alpha=8, target_modules=[
        "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj",
        "up_proj", "down_proj", "classifier"]), True),
    # Phi-3.5-MoE: biased attention, SparseMixer's router and the experts' w1/w2/w3
    ("phimoe", dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "w1", "w2",
                                                       "w3", "gate"]), True),
])
def test_merge_equals_peft(mindkit, tmp_path, family, kw, safe):
    if family == "phimoe":
        from test_engine import tiny_phimoe
        model_dir = tmp_path / "phimoe"
        tiny_phimoe(model_dir)
    else:
        model_dir = MODELS / family
    torch.manual_seed(7)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(init_lora_weights=False, **kw))
    model.save_pretrained(tmp_path / "adapter", safe_serialization=safe)
    fresh = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    merged = PeftModel.from_pretrained(fresh, tmp_path / "adapter").merge_and_unload()
    want = {k: v for k, v in merged.state_dict().items()
            if not (merged.config.tie_word_embeddings and k == "lm_head.weight")}
    mindkit("lora", "merge", "--base", model_dir, "--adapter", tmp_path / "adapter",
            "--output", tmp_path / "out")
    assert max_diff(hf_state(tmp_path / "out"), want) <= 1e-6
    if getattr(merged.config, "num_local_experts", None) or "moe" in family \
            or family.startswith(("deepseek", "longcat")):
        # merged straight into an expert-parallel Megatron checkpoint, grouped experts
        mindkit("lora", "merge", "--base", model_dir, "--adapter", tmp_path / "adapter",
                "--output", tmp_path / "meg", "--to", "megatron", "--tp", 2, "--ep", 2,
                "--moe-grouped-gemm")
        mindkit("convert", "--to", "hf", "--input", tmp_path / "meg", "--output", tmp_path / "back")
        assert max_diff(hf_state(tmp_path / "back"), want) <= 1e-6


def peft_megatron(tmp_path, mindkit, family):
    """GPTModel (tp1) from mindkit's conversion of a fixture, wrapped by peft's Megatron LoRA
    with random factors."""
    mindkit("convert", "--to", "megatron", "--input", MODELS / family, "--output", tmp_path / "base")
    obj = load_pt(tmp_path / "base/iter_0000001/mp_rank_00/model_optim_rng.pt")
    a = obj["args"]
    model = gpt_model(a).eval()
    model.load_state_dict(obj["model"], strict=True)

    class Wrap(torch.nn.Module):  # peft reads model.config as a dict; GPTModel's is not one
        def __init__(self, m):
            super().__init__()
            self.m = m

    torch.manual_seed(3)
    cfg = LoraConfig(r=4, lora_alpha=12, init_lora_weights=False, megatron_config=model.config,
                     megatron_core="megatron.core",
                     target_modules=["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])
    wrapped = get_peft_model(Wrap(model), cfg).base_model.model.m
    kind = type(wrapped.decoder.layers[0].self_attention.linear_qkv).__name__
    assert kind == "LoraParallelLinear", kind
    return a, wrapped


def save_megatron(path, args, model):
    d = path / "iter_0000001/mp_rank_00"
    d.mkdir(parents=True)
    args = copy.copy(args)
    args.lora_r, args.lora_alpha = 4, 12
    args.lora_target_modules = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 1, "model": model},
               d / "model_optim_rng.pt")
    (path / "latest_checkpointed_iteration.txt").write_text("1")


@pytest.mark.parametrize("family,unified", [("llama", False), ("llama", True), ("qwen3", False)])
def test_megatron_lora_equals_peft_megatron_merge(mindkit, tmp_path, family, unified):
    a, model = peft_megatron(tmp_path, mindkit, family)
    sd = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    if unified:  # MindSpeed without --lora-ckpt-filter: base_layer weights next to the LoRA
        save_megatron(tmp_path / "lora", a, sd)
        base = tmp_path / "lora"
        err = mindkit("convert", "--to", "hf", "--input", base, "--output", tmp_path / "x", ok=False)
        assert "LoRA tensors" in err and "lora merge" in err
    else:
        save_megatron(tmp_path / "lora", a, {k: v for k, v in sd.items() if "lora_" in k})
        base = tmp_path / "base"
    ids = torch.randint(0, a.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    # peft's own merge of its Megatron LoRA layers (W += B·A·scale on each parallel linear).
    for m in model.modules():
        if type(m).__name__ == "LoraParallelLinear":
            m.merge()
    want_sd = {k.replace(".base_layer", ""): v for k, v in model.state_dict().items()
               if "lora_" not in k and not k.endswith("_extra_state")}
    mindkit("lora", "merge", "--base", base, "--adapter", tmp_path / "lora",
            "--output", tmp_path / "merged")
    got = load_pt(tmp_path / "merged/iter_0000001/mp_rank_00/model_optim_rng.pt")
    assert not hasattr(got["args"], "lora_r")
    assert max_diff(got["model"], want_sd) <= 1e-6
    fresh = gpt_model(got["args"]).eval()
    fresh.load_state_dict(got["model"], strict=True)
    merged_logits = logits(fresh, ids, a.vocab_size)
    # The same merge written as HF: transformers agrees with megatron-core on the merged model.
    mindkit("lora", "merge", "--base", base, "--adapter", tmp_path / "lora", "--to", "hf",
            "--output", tmp_path / "hf")
    ref = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        assert (ref(ids).logits - merged_logits).abs().max().item() <= 1e-4
