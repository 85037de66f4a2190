"""`mindkit train` against a PyTorch reference built from megatron-core 0.15.3's own pieces
(train_reference.py): per-iteration lm loss, grad norm and learning rate to 1e-5 relative over
20 iterations, and the final weights to 1e-4, on three tiny families (GQA + untied head; q/k/v
biases + tied head; tied head with per-token loss and --eod-mask-loss), with gradient
accumulation (global batch = 4 × micro batch) and warmup + cosine decay; megatron-core resumes
from the checkpoint mindkit saved; validation loss, params norm and zero-gradient counts; bf16
within 1% of fp32 over 50 iterations; MindSpeed-LLM fine-tuning against a port of its SFT; LoRA
against peft. The values are read back from mindkit's TensorBoard event files with TensorBoard's
own reader."""
import json
import math
import os
import pathlib
import shutil
import subprocess

import numpy as np
import pytest
import torch

from conftest import ROOT
import megatron_cpu
import sft_reference
import train_reference

TOKENIZER = ROOT / "fixtures/tokenizers/tiny-bpe"
VOCAB = 400            # tiny-bpe's vocabulary
EOD = 2                # its </s>
ITERS = 20


def make_model(out, family, layers=2):
    """A seeded tiny HF model of `family` whose vocabulary is the shipped tokenizer's."""
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                              Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM,
                              SeedOssConfig, SeedOssForCausalLM)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=EOD)
    torch.manual_seed({"llama": 1, "qwen2": 2, "mistral": 3, "qwen3": 4, "seed_oss": 5}[family])
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=False))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=True,
                                             use_sliding_window=False))
        with torch.no_grad():
            for layer in model.model.layers:
                for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    p.bias.normal_(std=0.02)
    elif family == "qwen3":
        # q/k layernorms, head_dim 32 ≠ hidden / heads = 16 (as Qwen3-0.6B/4B/32B), tied
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=32, tie_word_embeddings=True,
                                             use_sliding_window=False))
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    elif family == "seed_oss":
        # q/k/v biases without an output bias, head_dim 32 ≠ hidden / heads, untied; no dropout
        model = SeedOssForCausalLM(SeedOssConfig(**common, head_dim=32, tie_word_embeddings=False,
                                                 attention_dropout=0.0, residual_dropout=0.0))
        with torch.no_grad():
            for layer in model.model.layers:
                for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    p.bias.normal_(std=0.02)
    else:
        model = MistralForCausalLM(MistralConfig(**common, tie_word_embeddings=True,
                                                 sliding_window=None))
    model.save_pretrained(out, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / f, out / f)
    return out


def write_data(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    rng = np.random.default_rng(11)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for n in rng.integers(8, 70, size=300):
        doc = rng.integers(3, VOCAB, size=n, dtype=np.uint16)
        doc[-1] = EOD
        builder.add_document(doc, [n])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def scalars(tb_dir, tags=("lm loss", "grad-norm", "learning-rate")):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    ea = EventAccumulator(str(tb_dir))
    ea.Reload()
    present = ea.Tags()["scalars"]
    return {tag: [e.value for e in ea.Scalars(tag)] for tag in tags if tag in present}


def mindkit_train(model_dir, data, out, extra):
    r = subprocess.run(train_command(model_dir, data, out, extra), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r.stdout


def train_command(model_dir, data, out, extra):
    """The `mindkit train` command line of [`mindkit_train`]."""
    binary = os.environ.get("MINDKIT_BIN", str(ROOT / "target/release/mindkit"))
    args = [binary, "train", "--load", model_dir, "--data-path", data, "--split", "1",
            "--seq-length", "48", "--micro-batch-size", "2", "--global-batch-size", "8",
            "--train-iters", str(ITERS), "--lr", "1e-3", "--min-lr", "1e-4",
            "--lr-decay-style", "cosine", "--lr-warmup-iters", "3", "--weight-decay", "0.1",
            "--clip-grad", "1.0", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
            "--eval-iters", "0", "--log-interval", "5", "--tensorboard-dir", out / "tb",
            "--save", out / "ckpt", "--quiet", *extra]
    return [str(a) for a in args]


CASES = {
    "llama-gqa-untied": ("llama", [], {}),
    "qwen2-bias-tied": ("qwen2", [], {}),
    "mistral-tied-per-token": ("mistral", ["--calculate-per-token-loss", "--eod-mask-loss"],
                               {"per_token": True, "eod_mask_loss": True}),
    "qwen3-qk-norm-head-dim-tied": ("qwen3", ["--spec", "mindspeed_llm.tasks.models.spec.qwen3_spec",
                                              "layer_spec", "--qk-layernorm"], {}),
    "llama-o2-optimizer-bf16-moments": ("llama", ["--o2-optimizer"], {"o2_optimizer": True}),
    "seed_oss-qkv-bias-head-dim-untied": ("seed_oss", ["--add-qkv-bias", "--kv-channels", "32"], {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_training_matches_the_megatron_reference(tmp_path, mindkit, case):
    family, flags, options = CASES[case]
    model_dir = make_model(tmp_path / "model", family)
    data = write_data(tmp_path / "data")
    log = mindkit_train(model_dir, data, tmp_path, flags)
    assert "iteration        5/      20" in log and "lm loss:" in log, log
    reference = same_as_the_reference(mindkit, model_dir, data, tmp_path, options)
    assert_megatron_core_resumes(tmp_path / "ckpt", reference, iterations=ITERS, gbs=8)


def same_as_the_reference(mindkit, model_dir, data, tmp_path, options):
    """mindkit's run in `tmp_path` (its TensorBoard scalars and checkpoint) against the PyTorch
    reference trained from `model_dir` on `data` with `options`: lm loss, grad norm and lr per
    iteration to 1e-5 relative; the final weights, mindkit's checkpoint converted back to HF,
    to 1e-4 (relative Frobenius distance per tensor; buffers such as an expert bias bit for
    bit). Returns the reference model."""
    got = scalars(tmp_path / "tb")
    history, reference, _ = train_reference.train(
        str(model_dir), data, vocab_padded=512, eod=EOD, seq=48, mbs=2, gbs=8, iters=ITERS,
        lr=1e-3, min_lr=1e-4, warmup_iters=3, decay_style="cosine", weight_decay=0.1,
        clip_grad=1.0, **options)
    for key, column in (("lm loss", 0), ("grad-norm", 1), ("learning-rate", 2)):
        want = [h[column] for h in history]
        assert len(got[key]) == ITERS
        for i, (g, w) in enumerate(zip(got[key], want)):
            assert abs(g - w) <= 1e-5 * abs(w) + 1e-12, f"{key} at iteration {i + 1}: {g} vs {w}"
    hf = tmp_path / "hf"
    mindkit("convert", "--to", "hf", "--input", tmp_path / "ckpt", "--output", hf)
    from safetensors.torch import load_file
    trained, state = load_file(str(hf / "model.safetensors")), reference.state_dict()
    trained_names = {n for n, _ in reference.named_parameters()}
    assert not trained_names - trained.keys(), trained_names - trained.keys()
    worst = 0.0
    for name, t in trained.items():
        ref = state[name][: t.shape[0]] if name.endswith(("embed_tokens.weight", "lm_head.weight")) else state[name]
        if name not in trained_names:
            assert torch.equal(t, ref), name
            continue
        diff = ((t.float() - ref).norm() / ref.norm().clamp(min=1e-12)).item()
        worst = max(worst, diff)
        assert diff <= 1e-4, f"{name}: relative difference {diff}"
    print(f"worst final-weight difference {worst:.2e}")
    return reference


def assert_megatron_core_resumes(ckpt, reference, iterations, gbs):
    """What Megatron's load_checkpoint does with the checkpoint, done by megatron-core's own
    classes: GPTModel.load_state_dict (strict) gives the reference model's logits; the
    optimizer state loads into torch's AdamW over megatron-core's parameter groups (every
    moment shaped as its parameter); OptimizerParamScheduler.load_state_dict accepts the
    scheduler state for the same flags."""
    from megatron.core.optimizer import _get_param_groups
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron_cpu import gpt_model, load_pt, logits
    obj = load_pt(ckpt / f"iter_{iterations:07d}/mp_rank_00/model_optim_rng.pt")
    assert obj["iteration"] == iterations and obj["args"].consumed_train_samples == iterations * gbs
    a = obj["args"]
    model = gpt_model(a).eval()
    result = model.load_state_dict(obj["model"], strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    ids = torch.randint(3, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    reference.eval()
    with torch.no_grad():
        want = reference(input_ids=ids).logits[..., :VOCAB]
    assert (logits(model, ids, VOCAB) - want).abs().max().item() <= 1e-4
    groups = _get_param_groups([model], None, None, 1.0, a.lr, a.min_lr, None, None)
    opt = torch.optim.AdamW(groups, lr=a.lr, weight_decay=a.weight_decay)
    opt.load_state_dict(obj["optimizer"])
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state[p]
            assert state["exp_avg"].shape == p.shape and state["exp_avg_sq"].shape == p.shape
            assert int(state["step"]) == iterations
    sched = OptimizerParamScheduler(
        opt, init_lr=a.lr_warmup_init, max_lr=a.lr, min_lr=a.min_lr,
        lr_warmup_steps=a.lr_warmup_iters * gbs, lr_decay_steps=iterations * gbs,
        lr_decay_style=a.lr_decay_style, start_wd=a.weight_decay, end_wd=a.weight_decay,
        wd_incr_steps=iterations * gbs, wd_incr_style="constant")
    sched.load_state_dict(obj["opt_param_scheduler"])
    assert sched.num_steps == iterations * gbs


MOE_FLAGS = ["--qk-layernorm", "--num-experts", "4", "--moe-router-topk", "2",
             "--moe-ffn-hidden-size", "32", "--norm-topk-prob", "--moe-layer-freq", "[0]*1+[1]*2",
             "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "0.01",
             "--moe-z-loss-coeff", "0.001", "--moe-token-dispatcher-type", "alltoall",
             "--moe-permutation-async-comm"]


def make_qwen3_moe(out, kv_heads=2):
    """A seeded tiny Qwen3-MoE (layer 0 dense, 4 experts of ffn 32, top-2 renormalised, q/k
    norms, head_dim 32, `kv_heads` key-value heads of 4, untied) with the shipped tokenizer."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    torch.manual_seed(6)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=32, max_position_embeddings=256,
        rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=EOD, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[0],
        tie_word_embeddings=False, use_sliding_window=False))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    model.save_pretrained(out, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / f, out / f)
    return out


def same_as_megatron_core(got, history, reference, tmp_path):
    """The TensorBoard scalars `got` of mindkit's run equal the reference's per iteration to
    1e-5 relative (lm loss, grad norm, learning rate, with MoE layers the auxiliary
    losses, with multi-token prediction each depth's `mtp_{k} loss`), and its saved weights the reference model's to 1e-4 (the expert biases exactly).
    Returns the saved weights."""
    from megatron_cpu import load_pt
    want = {"lm loss": [h[0] for h in history], "grad-norm": [h[1] for h in history],
            "learning-rate": [h[2] for h in history]}
    for name in reference.moe_losses[0] if reference.moe_losses else ():
        want[name] = [m[name] for m in reference.moe_losses]
    for name in reference.mtp_losses[0] if getattr(reference, "mtp_losses", None) else ():
        want[name] = [m[name] for m in reference.mtp_losses]
    for key, values in want.items():
        assert len(got[key]) == ITERS, key
        for i, (g, w) in enumerate(zip(got[key], values)):
            assert abs(g - w) <= 1e-5 * abs(w) + 1e-12, f"{key} at iteration {i + 1}: {g} vs {w}"
    trained = load_pt(tmp_path / f"ckpt/iter_{ITERS:07d}/mp_rank_00/model_optim_rng.pt")["model"]
    for name, ref in reference.module.state_dict().items():
        if name.endswith("_extra_state"):
            continue
        diff = ((trained[name].float() - ref).norm() / ref.norm().clamp(min=1e-12)).item()
        assert diff <= 1e-4, f"{name}: relative difference {diff}"
    return trained


@pytest.mark.parametrize("per_token,capacity", [(False, None), (True, None), (False, 0.75)],
                         ids=["per-micro-batch", "per-token", "token-dropping"])
def test_moe_training_matches_megatron_core(tmp_path, mindkit, per_token, capacity):
    """A tiny Qwen3-MoE trained by `mindkit train` and by megatron-core's own GPTModel (MoELayer:
    TopKRouter with the aux loss and the z-loss, SequentialMLP experts) from the same weights:
    lm loss, grad norm, learning rate, load_balancing_loss and z_loss per iteration to 1e-5
    relative over 20 iterations (gradient accumulation, warmup + cosine), final weights to 1e-4;
    and with token dropping (capacity factor 0.75: each expert takes at most 36 of a
    micro-batch's 96 tokens, apply_router_token_dropping's `probs` policy)."""
    from megatron_cpu import gpt_model, load_pt
    model_dir = make_qwen3_moe(tmp_path / "model")
    data = write_data(tmp_path / "data")
    extra = ["--calculate-per-token-loss"] if per_token else []
    if capacity:
        extra += ["--moe-expert-capacity-factor", str(capacity)]
    log = mindkit_train(model_dir, data, tmp_path, MOE_FLAGS + extra)
    assert "load_balancing_loss:" in log and "z_loss:" in log, log
    got = scalars(tmp_path / "tb", ("lm loss", "grad-norm", "learning-rate", "load_balancing_loss",
                                    "z_loss"))
    mindkit("convert", "--to", "megatron", "--input", model_dir, "--output", tmp_path / "start")
    start = load_pt(next((tmp_path / "start").glob("iter_*/mp_rank_00/model_optim_rng.pt")))
    gpt = gpt_model(start["args"], moe_losses=dict(
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001,
        calculate_per_token_loss=per_token, moe_expert_capacity_factor=capacity))
    gpt.load_state_dict(start["model"], strict=True)
    history, reference, _ = train_reference.train(
        str(model_dir), data, vocab_padded=512, eod=EOD, seq=48, mbs=2, gbs=8, iters=ITERS,
        lr=1e-3, min_lr=1e-4, warmup_iters=3, decay_style="cosine", weight_decay=0.1,
        clip_grad=1.0, per_token=per_token, model=train_reference.Mcore(gpt), moe_layers=2)
    same_as_megatron_core(got, history, reference, tmp_path)
    assert_megatron_core_resumes(tmp_path / "ckpt", reference, iterations=ITERS, gbs=8)


def test_qk_norms_over_all_heads_train_as_mindspeeds_minimax_attention(tmp_path, mindkit):
    """MindSpeed-LLM's MiniMax spec (`--spec ...minimax_spec layer_spec --qk-layernorm`): the
    tiny Qwen3-MoE with its q/k norms widened to all heads (γ [heads · head_dim], seeded) trains
    as megatron-core's GPTModel with a port of MindSpeed-LLM's MinimaxAttention: lm loss, grad
    norm, lr and the MoE losses to 1e-5 over 20 iterations, weights to 1e-4; megatron-core loads
    the saved checkpoint (args.spec recorded)."""
    from megatron_cpu import MINIMAX_SPEC, gpt_model, load_pt
    model_dir = make_qwen3_moe(tmp_path / "model")
    data = write_data(tmp_path / "data")
    mindkit("convert", "--to", "megatron", "--input", model_dir, "--output", tmp_path / "start")
    path = next((tmp_path / "start").glob("iter_*/mp_rank_00/model_optim_rng.pt"))
    start = load_pt(path)
    a = start["args"]
    a.spec = MINIMAX_SPEC
    torch.manual_seed(9)
    for k in list(start["model"]):
        for norm, n in (("q_layernorm", a.num_attention_heads), ("k_layernorm", a.num_query_groups)):
            if k.endswith(f"self_attention.{norm}.weight"):
                start["model"][k] = torch.empty(n * a.kv_channels).uniform_(0.5, 1.5)
    torch.save(start, path)
    flags = ["--spec", *MINIMAX_SPEC, "--finetune", "--tokenizer-name-or-path", model_dir]
    mindkit_train(tmp_path / "start", data, tmp_path, MOE_FLAGS + flags)
    got = scalars(tmp_path / "tb", ("lm loss", "grad-norm", "learning-rate", "load_balancing_loss",
                                    "z_loss"))
    gpt = gpt_model(a, moe_losses=dict(
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001))
    gpt.load_state_dict(start["model"], strict=True)
    history, reference, _ = train_reference.train(
        str(model_dir), data, vocab_padded=512, eod=EOD, seq=48, mbs=2, gbs=8, iters=ITERS,
        lr=1e-3, min_lr=1e-4, warmup_iters=3, decay_style="cosine", weight_decay=0.1,
        clip_grad=1.0, per_token=False, model=train_reference.Mcore(gpt), moe_layers=2)
    same_as_megatron_core(got, history, reference, tmp_path)
    saved = load_pt(tmp_path / f"ckpt/iter_{ITERS:07d}/mp_rank_00/model_optim_rng.pt")
    assert list(saved["args"].spec) == MINIMAX_SPEC
    assert gpt_model(saved["args"]).load_state_dict(saved["model"], strict=True) is not None


def same_as_dense_megatron_core(start, data, tmp_path):
    """mindkit_train's run in `tmp_path` equals megatron-core's GPTModel of the Megatron
    checkpoint `start` (a dense model) trained by the PyTorch reference with the same settings
    (`same_as_megatron_core`)."""
    from megatron_cpu import gpt_model
    gpt = gpt_model(start["args"])
    gpt.load_state_dict(start["model"], strict=True)
    history, reference, _ = train_reference.train(
        None, data, vocab_padded=512, eod=EOD, seq=48, mbs=2, gbs=8, iters=ITERS, lr=1e-3,
        min_lr=1e-4, warmup_iters=3, decay_style="cosine", weight_decay=0.1, clip_grad=1.0,
        model=train_reference.Mcore(gpt))
    same_as_megatron_core(scalars(tmp_path / "tb"), history, reference, tmp_path)


def test_layer_norm_and_biases_train_as_mindspeed_llms_phi35_layer(tmp_path, mindkit):
    """--normalization LayerNorm with q/k/v, attention-output (--add-dense-bias) and output-layer
    (--add-output-layer-bias) biases, as MindSpeed-LLM's Phi-3.5 spec builds them (its PTNorm is
    torch's LayerNorm): `mindkit train` and megatron-core's GPTModel with those modules, from the
    same Megatron checkpoint (every bias and LayerNorm β seeded), lm loss, grad norm and
    learning rate per iteration to 1e-5 relative over 20 iterations, the final weights to 1e-4;
    megatron-core loads the saved checkpoint strictly."""
    from megatron_cpu import gpt_model, load_pt
    model_dir = make_model(tmp_path / "model", "llama")
    data = write_data(tmp_path / "data")
    gen = torch.Generator().manual_seed(12)
    biases = {"input_layernorm.weight": "input_layernorm.bias",
              "pre_mlp_layernorm.weight": "pre_mlp_layernorm.bias",
              "final_layernorm.weight": "final_layernorm.bias",
              "linear_qkv.weight": "linear_qkv.bias", "linear_proj.weight": "linear_proj.bias",
              "output_layer.weight": "output_layer.bias"}

    def added(key, weight):
        for w, b in biases.items():
            if key.endswith(w):
                return {key.replace(w, b): torch.randn(weight.shape[0], generator=gen) * 0.05}
        return {}

    flags = {"normalization": "LayerNorm", "add_qkv_bias": True, "add_dense_bias": True,
             "add_output_layer_bias": True}
    start = megatron_start(mindkit, model_dir, tmp_path / "start", flags, added)
    mindkit_train(tmp_path / "start", data, tmp_path, [
        "--normalization", "LayerNorm", "--add-qkv-bias", "--add-dense-bias",
        "--add-output-layer-bias", "--finetune", "--tokenizer-name-or-path", model_dir])
    same_as_dense_megatron_core(start, data, tmp_path)
    saved = load_pt(tmp_path / f"ckpt/iter_{ITERS:07d}/mp_rank_00/model_optim_rng.pt")
    assert saved["args"].normalization == "LayerNorm" and saved["args"].add_output_layer_bias
    assert gpt_model(saved["args"]).load_state_dict(saved["model"], strict=True) is not None


def test_squared_relu_mlp_trains_as_megatron_core(tmp_path, mindkit):
    """--squared-relu --fc-type up_down (PLM's non-gated MLP, as MindSpeed-LLM's scripts pass
    it): `mindkit train` and megatron-core's GPTModel with `squared_relu` and no gated linear
    unit, from the same Megatron checkpoint (linear_fc1 one projection [F, h]), lm loss, grad norm
    and learning rate per iteration to 1e-5 relative over 20 iterations, the final weights to
    1e-4; megatron-core loads the saved checkpoint strictly, its args saying squared_relu."""
    from megatron_cpu import gpt_model, load_pt
    model_dir = make_model(tmp_path / "model", "llama")
    data = write_data(tmp_path / "data")

    def up_only(key, weight):
        # the gated checkpoint's fc1 [gate; up] cut to one projection
        return ({key: weight[: weight.shape[0] // 2].clone()}
                if key.endswith("linear_fc1.weight") else {})

    start = megatron_start(mindkit, model_dir, tmp_path / "start",
                           {"swiglu": False, "squared_relu": True}, up_only)
    mindkit_train(tmp_path / "start", data, tmp_path, [
        "--squared-relu", "--fc-type", "up_down", "--finetune",
        "--tokenizer-name-or-path", model_dir])
    same_as_dense_megatron_core(start, data, tmp_path)
    saved = load_pt(tmp_path / f"ckpt/iter_{ITERS:07d}/mp_rank_00/model_optim_rng.pt")
    assert saved["args"].squared_relu and not saved["args"].swiglu
    assert gpt_model(saved["args"]).load_state_dict(saved["model"], strict=True) is not None


def test_partial_rotary_embedding_trains_as_megatron_core(tmp_path, mindkit):
    """--rotary-percent 0.5 (Ling-V2's and GLM-4.5's RoPE on half of each head's dimensions,
    the rest passed through): `mindkit train` and megatron-core's own GPTModel with
    rotary_percent 0.5 from the same Megatron checkpoint, lm loss, grad norm and learning rate
    per iteration to 1e-5 relative over 20 iterations, the final weights to 1e-4."""
    model_dir = make_model(tmp_path / "model", "llama")
    data = write_data(tmp_path / "data")
    start = megatron_start(mindkit, model_dir, tmp_path / "start", {"rotary_percent": 0.5})
    mindkit_train(tmp_path / "start", data, tmp_path, [
        "--rotary-percent", "0.5", "--finetune", "--tokenizer-name-or-path", model_dir])
    same_as_dense_megatron_core(start, data, tmp_path)


def test_grouped_experts_in_the_distributed_optimizer_are_laid_out_as_grouped_mlps_buffer(tmp_path):
    """--moe-grouped-gemm with --use-distributed-optimizer on two data-parallel ranks: the model
    loads strictly into megatron-core's GPTModel with GroupedMLP experts (weight1, weight2), and
    distrib_optim.pt's buffer is the one megatron-core's DistributedDataParallel gives that
    model — each grouped tensor's main copy, its experts' weights transposed one after the
    other, at the offsets of the parameter megatron-core registers, and every moment there."""
    from megatron_cpu import gpt_model, load_pt, same_buffer
    model_dir = make_qwen3_moe(tmp_path / "model")
    data = write_data(tmp_path / "data")
    mindkit_train(model_dir, data, tmp_path, MOE_FLAGS + [
        "--moe-grouped-gemm", "--use-distributed-optimizer", "--world-size", "2"])
    rank_dir = tmp_path / f"ckpt/iter_{ITERS:07d}/mp_rank_00"
    obj = load_pt(rank_dir / "model_optim_rng.pt")
    assert obj["args"].moe_grouped_gemm
    model = gpt_model(obj["args"])
    result = model.load_state_dict(obj["model"], strict=True)
    assert not result.missing_keys and not result.unexpected_keys, result
    grouped = [n for n, _ in model.named_parameters() if n.endswith(("experts.weight1", "experts.weight2"))]
    assert len(grouped) == 4, grouped
    state = torch.load(rank_dir / "distrib_optim.pt", weights_only=True)
    (saved,) = state[0].values()
    same_buffer(model, obj["model"], saved)


def megatron_start(mindkit, model_dir, out, args, added=lambda key, tensor: {}):
    """The HF model converted to a Megatron checkpoint in `out` and then made another one, as
    Megatron would have saved it: `args` set (without the config.json the conversion carries),
    the tensors `added(key, tensor)` gives inserted after each key. Returns its contents."""
    import collections
    from megatron_cpu import load_pt
    mindkit("convert", "--to", "megatron", "--input", model_dir, "--output", out)
    path = next(out.glob("iter_*/mp_rank_00/model_optim_rng.pt"))
    start = load_pt(path)
    for k, v in args.items():
        setattr(start["args"], k, v)
    delattr(start["args"], "mindkit_hf_config")
    model = collections.OrderedDict()
    for k, v in start["model"].items():
        model[k] = v
        model.update(added(k, v))
    start["model"] = model
    torch.save(start, path)
    return start


def zero_expert_bias(extra=0):
    """megatron_start's `added`: a zero expert bias after each router weight, over its rows and
    `extra` more (zero-computation experts)."""
    def added(key, weight):
        return ({key.replace("weight", "expert_bias"): torch.zeros(weight.shape[0] + extra)}
                if key.endswith("router.weight") else {})
    return added


def biased_training_as_megatron_core(got, gpt, data, tmp_path):
    """`gpt` (an MoE GPTModel whose two routers hold expert biases) trained by the reference as
    `mindkit train` trained: the logged values and final weights compared, and the final expert
    biases f32 and bit for bit, moved from zero. Returns mindkit's trained tensors."""
    history, reference, _ = train_reference.train(
        None, data, vocab_padded=512, eod=EOD, seq=48, mbs=2, gbs=8, iters=ITERS,
        lr=1e-3, min_lr=1e-4, warmup_iters=3, decay_style="cosine", weight_decay=0.1,
        clip_grad=1.0, model=train_reference.Mcore(gpt), moe_layers=2, expert_bias=True)
    trained = same_as_megatron_core(got, history, reference, tmp_path)
    biases = [k for k in trained if k.endswith("expert_bias")]
    for name in biases:
        ref = reference.module.state_dict()[name]
        assert trained[name].dtype == torch.float32 and torch.equal(trained[name], ref), name
    assert len(biases) == 2 and all(trained[k].abs().sum() > 0 for k in biases)
    return trained


def test_aux_loss_free_balancing_matches_megatron_core(tmp_path, mindkit):
    """DeepSeek-style routing — sigmoid scores, group-limited top-k, scaled weights and an expert
    bias moved after every step (aux-loss-free balancing), beside the aux and z losses — trained
    by `mindkit train` and by megatron-core's own GPTModel (TopKRouter with the expert bias,
    finalize_model_grads' _update_router_expert_bias) from the same Megatron checkpoint: lm loss,
    grad norm, learning rate, load_balancing_loss and z_loss per iteration to 1e-5 relative
    over 20 iterations, the final weights to 1e-4, and the final expert biases bit for bit."""
    from megatron_cpu import gpt_model, load_pt
    model_dir = make_qwen3_moe(tmp_path / "model")
    data = write_data(tmp_path / "data")
    # The converted Qwen3-MoE made a DeepSeek-routed one, as Megatron would have saved it.
    routing = dict(moe_router_score_function="sigmoid", moe_router_num_groups=2,
                   moe_router_group_topk=1, moe_router_topk_scaling_factor=2.5,
                   moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.002)
    start = megatron_start(mindkit, model_dir, tmp_path / "start", routing, zero_expert_bias())
    flags = ["--moe-router-score-function", "sigmoid", "--moe-router-num-groups", "2",
             "--moe-router-group-topk", "1", "--moe-router-topk-scaling-factor", "2.5",
             "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.002",
             "--finetune", "--tokenizer-name-or-path", model_dir]
    mindkit_train(tmp_path / "start", data, tmp_path, MOE_FLAGS + flags)
    got = scalars(tmp_path / "tb", ("lm loss", "grad-norm", "learning-rate", "load_balancing_loss",
                                    "z_loss"))
    gpt = gpt_model(start["args"], moe_losses=dict(
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001))
    gpt.load_state_dict(start["model"], strict=True)
    biased_training_as_megatron_core(got, gpt, data, tmp_path)


def mindspeed_softmax_topk(router):
    """`router` (megatron-core's TopKRouter, built with an expert bias) routing as MindSpeed-LLM's
    softmax_topk does with one, ported from mindspeed_llm/core/transformer/moe/router.py
    `topk_router_routing`: the z-loss, a softmax over all experts, the top-k of it plus the
    expert bias, the chosen softmax scores (no norm_topk_prob) times the scaling factor, and the
    chosen experts counted for the bias update."""
    def routing(logits):
        logits = router.apply_z_loss(logits.view(-1, router.weight.shape[0]))
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
        _, indices = torch.topk(scores + router.expert_bias, k=router.topk, dim=1)
        chosen = torch.gather(scores, 1, indices) * router.config.moe_router_topk_scaling_factor
        probs = torch.zeros_like(scores).scatter(1, indices, chosen)
        routing_map = torch.zeros_like(scores).int().scatter(1, indices, 1).bool()
        if torch.is_grad_enabled():
            with torch.no_grad():
                router.local_tokens_per_expert += routing_map.sum(dim=0)
        return probs, routing_map
    router.routing = routing


# LongCat-Flash's routing, as checkpoint args and as `mindkit train` flags on MOE_FLAGS: softmax_topk
# (no norm_topk_prob) with an expert bias moved at rate 0.002, the weights scaled by 6, no aux loss.
LONGCAT_ROUTING = dict(moe_router_load_balancing_type="softmax_topk", norm_topk_prob=False,
                       moe_router_pre_softmax=True, moe_router_topk_scaling_factor=6.0,
                       moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.002)


def longcat_routing_flags(model_dir, extra=()):
    flags = [f for f in MOE_FLAGS if f != "--norm-topk-prob"]
    flags[flags.index("aux_loss")] = "softmax_topk"
    flags[flags.index("--moe-aux-loss-coeff") + 1] = "0"
    return flags + [*extra, "--moe-router-topk-scaling-factor", "6",
                    "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.002",
                    "--finetune", "--tokenizer-name-or-path", model_dir]


def test_softmax_topk_with_an_expert_bias_trains_as_mindspeed_llms_router(tmp_path, mindkit):
    """MindSpeed-LLM's softmax_topk routing with an expert bias (LongCat-Flash's script: the bias
    added to the softmax over all experts for the choice, the softmax scores scaled by 6 as the
    weights, the bias moved after every step, a z-loss): `mindkit train` against megatron-core's
    GPTModel whose routers run MindSpeed-LLM's routing (ported above) and whose biases
    finalize_model_grads' _update_router_expert_bias moves: lm loss, grad norm, learning rate and
    z_loss per iteration to 1e-5 relative over 20 iterations, the final weights to 1e-4, the
    final expert biases bit for bit."""
    import argparse
    from megatron_cpu import gpt_model
    model_dir = make_qwen3_moe(tmp_path / "model")
    data = write_data(tmp_path / "data")
    start = megatron_start(mindkit, model_dir, tmp_path / "start", LONGCAT_ROUTING,
                           zero_expert_bias())
    mindkit_train(tmp_path / "start", data, tmp_path, longcat_routing_flags(model_dir))
    got = scalars(tmp_path / "tb", ("lm loss", "grad-norm", "learning-rate", "load_balancing_loss",
                                    "z_loss"))
    assert "load_balancing_loss" not in got, got.keys()
    # megatron-core's TransformerConfig takes an expert bias with sigmoid scores only; the
    # routing is replaced anyway
    built = argparse.Namespace(**{**vars(start["args"]), "moe_router_score_function": "sigmoid"})
    gpt = gpt_model(built, moe_losses=dict(moe_z_loss_coeff=0.001))
    gpt.load_state_dict(start["model"], strict=True)
    routers = [m for m in gpt.modules() if hasattr(m, "expert_bias")]
    assert len(routers) == 2
    for router in routers:
        mindspeed_softmax_topk(router)
    biased_training_as_megatron_core(got, gpt, data, tmp_path)


def mindspeed_zero_experts(layer, zero):
    """megatron-core's MoELayer `layer` (E routed experts, one rank, the all-gather dispatcher) run
    as MindSpeed-LLM's zero_experts_moe_forward (mindspeed_llm/tasks/models/transformer/
    zero_experts_moe_layer.py), ported: its router scores E + `zero` experts (its weight, expert
    bias and token counts widened: topk_router_init_wrapper), the probabilities and routing map
    split into the routed experts' part, dispatched to the layer's experts as usual, and the
    zero-computation experts' part, whose tokens come back times their probabilities through a
    dispatcher of their own; the two outputs added, then the shared experts'."""
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher
    experts, router, groups = layer.config.num_moe_experts, layer.router, get_default_pg_collection()
    width = experts + zero
    router.weight = torch.nn.Parameter(torch.zeros(width, router.weight.shape[1]))
    router.register_buffer("expert_bias", torch.zeros(width))
    router.register_buffer("local_tokens_per_expert", torch.zeros(width), persistent=False)
    routed = MoEAllGatherTokenDispatcher(experts, list(range(experts)), config=layer.config,
                                         pg_collection=groups)
    zeros = MoEAllGatherTokenDispatcher(zero, list(range(zero)), config=layer.config,
                                        pg_collection=groups)

    def through(dispatcher, hidden_states, probs, routing_map, compute):
        h, p = dispatcher.dispatch_preprocess(hidden_states, routing_map, probs)
        h, p = dispatcher.token_dispatch(h, p)
        x, tokens, permuted_probs = dispatcher.dispatch_postprocess(h, p)
        out = dispatcher.combine_preprocess(compute(x, tokens, permuted_probs))
        return dispatcher.combine_postprocess(dispatcher.token_combine(out))

    def forward(hidden_states):
        shared = layer.shared_experts_compute(hidden_states)
        probs, routing_map = router(hidden_states)
        probs, zero_probs = torch.split(probs, [experts, zero], dim=-1)
        routing_map, zero_map = torch.split(routing_map, [experts, zero], dim=-1)
        out = through(routed, hidden_states, probs, routing_map,
                      lambda x, tokens, p: layer.experts(x, tokens, p)[0])
        out = out + through(zeros, hidden_states, zero_probs, zero_map,
                            lambda x, tokens, p: x * p.unsqueeze(-1).to(x.dtype))
        return (out if shared is None else out + shared), None
    layer.forward = forward


def test_zero_computation_experts_train_as_mindspeed_llms_moe_layer(tmp_path, mindkit):
    """--num-zero-experts 2 beside 4 routed experts, routed as LongCat-Flash's script routes them
    (softmax_topk with an expert bias over all 6, the weights scaled by 6, a z-loss): `mindkit
    train` against megatron-core's GPTModel whose MoE layers run MindSpeed-LLM's zero-expert
    forward and routing (ported above) from the same checkpoint (its router widened to 6 rows):
    lm loss, grad norm, learning rate and z_loss per iteration to 1e-5 relative over 20
    iterations, the final weights (the router's 6 rows) to 1e-4, the expert biases bit for bit."""
    import argparse
    from megatron_cpu import gpt_model
    model_dir = make_qwen3_moe(tmp_path / "model")
    data = write_data(tmp_path / "data")
    torch.manual_seed(11)
    # the expert bias over all six; the router's rows of the zero experts added below
    start = megatron_start(mindkit, model_dir, tmp_path / "start",
                           {**LONGCAT_ROUTING, "num_zero_experts": 2}, zero_expert_bias(2))
    for key in [k for k in start["model"] if k.endswith("router.weight")]:
        w = start["model"][key]
        start["model"][key] = torch.cat([w, 0.5 * torch.randn(2, w.shape[1])])
    torch.save(start, next((tmp_path / "start").glob("iter_*/mp_rank_00/model_optim_rng.pt")))
    mindkit_train(tmp_path / "start", data, tmp_path,
                  longcat_routing_flags(model_dir, ["--num-zero-experts", "2"]))
    got = scalars(tmp_path / "tb", ("lm loss", "grad-norm", "learning-rate", "z_loss"))
    built = argparse.Namespace(**{**vars(start["args"]), "moe_router_score_function": "sigmoid"})
    gpt = gpt_model(built, moe_losses=dict(moe_z_loss_coeff=0.001))
    layers = [m for m in gpt.modules() if hasattr(m, "router")]
    assert len(layers) == 2
    for layer in layers:
        mindspeed_zero_experts(layer, 2)
        mindspeed_softmax_topk(layer.router)
    gpt.load_state_dict(start["model"], strict=True)
    trained = biased_training_as_megatron_core(got, gpt, data, tmp_path)
    routers = [k for k in trained if k.endswith("router.weight")]
    assert len(routers) == 2 and all(trained[k].shape[0] == 6 for k in routers)
    for name in [k for k in trained if k.endswith("expert_bias")]:
        assert trained[name][4:].abs().sum() > 0, name


def make_deepseek_v3(out, mtp=0):
    """A seeded tiny DeepSeek-V3 with the shipped tokenizer: multi-latent attention (a query
    latent of 32 and a key-value latent of 16, their norms random, heads of 16 + 8 rotated
    dimensions, values of 12), YaRN RoPE with an attention factor and a softmax mscale; layer 0
    dense, then 4 sigmoid-routed experts of ffn 32 (top-2 renormalised, two groups one kept,
    scaled by 2.5, a random expert bias) and a shared expert; untied. With `mtp`, that many
    multi-token prediction depths stored as DeepSeek-V3 ships them (as fixtures/models/
    deepseek_v3_mtp: model.layers.{3 + k} past num_hidden_layers 3, num_nextn_predict_layers)
    and the final norm random."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    torch.manual_seed(7)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3 + mtp,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
        rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=EOD, q_lora_rank=32, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
        first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, tie_word_embeddings=False,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.5}))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_a_layernorm.weight.uniform_(0.5, 1.5)
            layer.self_attn.kv_a_layernorm.weight.uniform_(0.5, 1.5)
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.normal_(std=0.01)
    if mtp:
        add_mtp_layers(model, out, 3, mtp)
    else:
        model.save_pretrained(out, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / f, out / f)
    return out


@torch.no_grad()
def add_mtp_layers(model, out, layers, depths):
    """Saves `model` (built with `layers` + `depths` decoder layers) as an HF DeepSeek-V3 of
    `layers` layers whose last `depths` are multi-token prediction layers as DeepSeek-V3 ships
    them: beside each decoder layer enorm, hnorm and shared_head.norm (random), eh_proj
    [hidden, 2 · hidden], copies of the embedding (embed_tokens) and of the head
    (shared_head.head); the final norm made random too."""
    from safetensors.torch import save_file
    h = model.config.hidden_size
    model.model.norm.weight.uniform_(0.5, 1.5)
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    for k in range(layers, layers + depths):
        p = f"model.layers.{k}."
        sd[p + "enorm.weight"] = torch.empty(h).uniform_(0.5, 1.5)
        sd[p + "hnorm.weight"] = torch.empty(h).uniform_(0.5, 1.5)
        sd[p + "eh_proj.weight"] = torch.empty(h, 2 * h).normal_(std=0.02)
        sd[p + "shared_head.norm.weight"] = torch.empty(h).uniform_(0.5, 1.5)
        sd[p + "embed_tokens.weight"] = sd["model.embed_tokens.weight"].clone()
        sd[p + "shared_head.head.weight"] = sd["lm_head.weight"].clone()
    out.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    model.config.num_hidden_layers = layers
    model.config.num_nextn_predict_layers = depths
    model.config.save_pretrained(out)


def mla_flags(model_dir):
    """`mindkit train`'s flags for make_deepseek_v3's model, from its Megatron checkpoint."""
    return ["--multi-latent-attention", "--q-lora-rank", "32", "--kv-lora-rank", "16",
            "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "12",
            "--rope-scaling-type", "yarn", "--rope-scaling-factor", "4",
            "--rope-scaling-original-max-position-embeddings", "64",
            "--rope-scaling-mscale-all-dim", "0.5", "--qk-layernorm",
            "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "0.01",
            "--moe-z-loss-coeff", "0.001", "--moe-router-bias-update-rate", "0.002",
            "--finetune", "--tokenizer-name-or-path", model_dir]


def test_multi_latent_attention_trains_as_megatron_core(tmp_path, mindkit):
    """A tiny DeepSeek-V3 (multi-latent attention with YaRN RoPE, sigmoid routing with an
    expert bias moved after every step, a shared expert, a dense first layer) converted to
    Megatron and trained by `mindkit train --multi-latent-attention ...` and by megatron-core's
    own GPTModel (MLASelfAttention, local spec; the core attention of Transformer Engine's
    stood in for): lm loss, grad norm, learning rate and the MoE losses per iteration to 1e-5
    relative over 20 iterations, the final weights to 1e-4."""
    from megatron_cpu import gpt_model, load_pt
    model_dir = make_deepseek_v3(tmp_path / "model")
    data = write_data(tmp_path / "data")
    mindkit("convert", "--to", "megatron", "--input", model_dir, "--output", tmp_path / "start")
    start = load_pt(next((tmp_path / "start").glob("iter_*/mp_rank_00/model_optim_rng.pt")))
    mindkit_train(tmp_path / "start", data, tmp_path, mla_flags(model_dir))
    got = scalars(tmp_path / "tb", ("lm loss", "grad-norm", "learning-rate", "load_balancing_loss",
                                    "z_loss"))
    a = start["args"]
    a.moe_router_bias_update_rate = 0.002
    gpt = gpt_model(a, moe_losses=dict(
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001))
    gpt.load_state_dict(start["model"], strict=True)
    history, reference, _ = train_reference.train(
        None, data, vocab_padded=512, eod=EOD, seq=48, mbs=2, gbs=8, iters=ITERS,
        lr=1e-3, min_lr=1e-4, warmup_iters=3, decay_style="cosine", weight_decay=0.1,
        clip_grad=1.0, model=train_reference.Mcore(gpt), moe_layers=2, expert_bias=True)
    same_as_megatron_core(got, history, reference, tmp_path)


DSA_FLAGS = ["--enable-dsa-indexer", "--index-n-heads", "2", "--index-head-dim", "16",
             "--index-topk", "8", "--index-topk-freq", "2", "--index-skip-topk-offset", "1",
             "--indexer-loss-coeff", "0.5", "--apply-rope-no-in-complex"]


def test_deepseek_sparse_attention_trains_as_mindspeed_llm(tmp_path, mindkit):
    """DeepSeek sparse attention (--enable-dsa-indexer) on the tiny DeepSeek-V3: its converted
    checkpoint given random indexers in layers 0 and 2 (layer 1 shares layer 0's selection:
    --index-topk-freq 2 --index-skip-topk-offset 1), each query attending to its 8 best keys of
    48, trained by `mindkit train` and by megatron-core's GPTModel with MindSpeed-LLM's indexer,
    top-k sparse mask and indexer loss written out in torch (dsa_reference.py): lm loss, grad
    norm, learning rate, the MoE losses and the logged dsa_indexer_loss per iteration to 1e-5
    relative over 20 iterations, the final weights (the indexers' too) to 1e-4."""
    import dsa_reference
    from megatron_cpu import gpt_model, load_pt
    model_dir = make_deepseek_v3(tmp_path / "model")
    data = write_data(tmp_path / "data")
    mindkit("convert", "--to", "megatron", "--input", model_dir, "--output", tmp_path / "start")
    path = next((tmp_path / "start").glob("iter_*/mp_rank_00/model_optim_rng.pt"))
    start = load_pt(path)
    torch.manual_seed(11)
    for l in (0, 2):
        p = f"decoder.layers.{l}.self_attention.dsa_indexer."
        start["model"][p + "wq_b.weight"] = torch.randn(2 * 16, 32) * 0.3
        start["model"][p + "wk.weight"] = torch.randn(16, 64) * 0.3
        start["model"][p + "k_norm.weight"] = torch.empty(16).uniform_(0.5, 1.5)
        start["model"][p + "k_norm.bias"] = torch.randn(16) * 0.1
        start["model"][p + "weights_proj.weight"] = torch.randn(2, 64) * 0.3
    # as MindSpeed-LLM's args namespace of such a checkpoint carries them
    for name, value in dict(enable_dsa_indexer=True, index_n_heads=2, index_head_dim=16,
                            index_topk=8, index_topk_freq=2, index_skip_topk_offset=1,
                            apply_rope_no_in_complex=True).items():
        setattr(start["args"], name, value)
    torch.save(start, path)
    mindkit_train(tmp_path / "start", data, tmp_path, mla_flags(model_dir) + DSA_FLAGS)
    got = scalars(tmp_path / "tb", ("lm loss", "grad-norm", "learning-rate", "load_balancing_loss",
                                    "z_loss", "dsa_indexer_loss"))
    a = start["args"]
    a.moe_router_bias_update_rate = 0.002
    gpt = gpt_model(a, moe_losses=dict(
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001))
    dsa = dsa_reference.Dsa(gpt, a, [True, False, True], heads=2, dim=16, topk=8, coeff=0.5)
    gpt.load_state_dict(start["model"], strict=True)
    dsa_reference.AutoScaler.scale = 1 / 4
    history, reference, _ = train_reference.train(
        None, data, vocab_padded=512, eod=EOD, seq=48, mbs=2, gbs=8, iters=ITERS,
        lr=1e-3, min_lr=1e-4, warmup_iters=3, decay_style="cosine", weight_decay=0.1,
        clip_grad=1.0, model=train_reference.Mcore(gpt), moe_layers=2, expert_bias=True)
    want = [dsa.step_losses(4) for _ in range(ITERS)]
    assert len(got["dsa_indexer_loss"]) == ITERS
    same_as_megatron_core(got, history, reference, tmp_path)
    for i, (g, w) in enumerate(zip(got["dsa_indexer_loss"], want)):
        assert abs(g - w) <= 1e-5 * abs(w), f"dsa_indexer_loss at iteration {i + 1}: {g} vs {w}"


def test_scaled_latents_train_as_mindspeed_llms_multi_latent_attention(tmp_path, mindkit):
    """--enable-mla-scale-q-lora / --enable-mla-scale-kv-lora (LongCat-Flash's script): the
    tiny DeepSeek-V3 trained by `mindkit train` and by megatron-core's GPTModel whose latent norms'
    outputs are scaled by √(hidden / rank) before the up projections, as MindSpeed-LLM's
    multi_latent_attention.py scales them (ported): lm loss, grad norm, learning rate and the MoE
    losses per iteration to 1e-5 relative over 20 iterations, the final weights to 1e-4."""
    import math
    from megatron_cpu import gpt_model
    model_dir = make_deepseek_v3(tmp_path / "model")
    data = write_data(tmp_path / "data")
    scaled = dict(enable_mla_scale_q_lora=True, enable_mla_scale_kv_lora=True)
    start = megatron_start(mindkit, model_dir, tmp_path / "start", scaled)
    flags = ["--enable-mla-scale-q-lora", "--enable-mla-scale-kv-lora"]
    mindkit_train(tmp_path / "start", data, tmp_path, mla_flags(model_dir) + flags)
    got = scalars(tmp_path / "tb", ("lm loss", "grad-norm", "learning-rate", "load_balancing_loss",
                                    "z_loss"))
    a = start["args"]
    a.moe_router_bias_update_rate = 0.002
    gpt = gpt_model(a, moe_losses=dict(
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001))
    gpt.load_state_dict(start["model"], strict=True)
    norms = 0
    for attention in [m for m in gpt.modules() if hasattr(m, "kv_layernorm")]:
        for name, rank in (("q_layernorm", a.q_lora_rank), ("kv_layernorm", a.kv_lora_rank)):
            norm, factor = getattr(attention, name), math.sqrt(a.hidden_size / rank)
            norm.forward = (lambda f, s: lambda x: f(x) * s)(norm.forward, factor)
            norms += 1
    assert norms == 6
    history, reference, _ = train_reference.train(
        None, data, vocab_padded=512, eod=EOD, seq=48, mbs=2, gbs=8, iters=ITERS,
        lr=1e-3, min_lr=1e-4, warmup_iters=3, decay_style="cosine", weight_decay=0.1,
        clip_grad=1.0, model=train_reference.Mcore(gpt), moe_layers=2, expert_bias=True)
    same_as_megatron_core(got, history, reference, tmp_path)


# The layers the logged load_balancing_loss / z_loss are averaged over (each layer's tracked
# loss summed, the MTP layer's included): megatron-core 0.15's training_log passes
# mtp_num_layers to track_moe_metrics, which adds it to the MoE layers (moe_utils.py);
# MindSpeed-LLM's own training_log (mindspeed_llm/training/training.py, on core 0.12.1's
# track_moe_metrics) does not: the two MoE decoder layers only.
MTP_MOE_LAYERS = {"mcore": 2 + 1, "mindspeed": 2}


@pytest.mark.parametrize("layout", ["mcore", "mindspeed"])
def test_multi_token_prediction_trains_as_megatron_core(tmp_path, mindkit, layout):
    """Multi-token prediction (one depth, loss scale 0.3) on the tiny DeepSeek-V3: the HF model
    with an MTP layer as DeepSeek-V3 ships it (an MoE layer past the decoder's) converted by
    `mindkit convert --mtp-layout {mcore,mindspeed}` and trained by `mindkit train
    --mtp-num-layers 1 --mtp-loss-scaling-factor 0.3 --mtp-layout ...` and by megatron-core's
    own GPTModel with its MultiTokenPredictionBlock (get_gpt_mtp_block_spec of the last layer's
    spec; the loss in GPTModel._postprocess, MTPLossAutoScaler scaled 1 / micro-batches) — or,
    for `mindspeed`, that model arranged as MindSpeed-LLM arranges it (the decoder's final norm
    after the MTP block, so MTP sees un-normed states; each depth's norm in the block;
    megatron_cpu.mindspeed_mtp_gpt_model) — from the same converted checkpoint, loaded strictly:
    lm loss, grad norm, learning rate, the MoE losses and the logged `mtp_1 loss` per iteration
    to 1e-5 relative over 20 iterations, the final weights (the MTP layer's too) to 1e-4; the
    saved checkpoint loads strictly again."""
    from megatron_cpu import gpt_model, load_pt
    model_dir = make_deepseek_v3(tmp_path / "model", mtp=1)
    data = write_data(tmp_path / "data")
    mindkit("convert", "--to", "megatron", "--input", model_dir, "--output", tmp_path / "start",
            "--mtp-layout", layout)
    start = load_pt(next((tmp_path / "start").glob("iter_*/mp_rank_00/model_optim_rng.pt")))
    mtp = ["--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0.3", "--mtp-layout", layout]
    mindkit_train(tmp_path / "start", data, tmp_path, mla_flags(model_dir) + mtp)
    got = scalars(tmp_path / "tb", ("lm loss", "grad-norm", "learning-rate", "load_balancing_loss",
                                    "z_loss", "mtp_1 loss"))
    a = start["args"]
    a.moe_router_bias_update_rate = 0.002
    a.mtp_num_layers, a.mtp_loss_scaling_factor = 1, 0.3
    losses = dict(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01,
                  moe_z_loss_coeff=0.001)
    gpt = gpt_model(a, moe_losses=losses, mtp_layout=layout)
    gpt.load_state_dict(start["model"], strict=True)
    history, reference, _ = train_reference.train(
        None, data, vocab_padded=512, eod=EOD, seq=48, mbs=2, gbs=8, iters=ITERS,
        lr=1e-3, min_lr=1e-4, warmup_iters=3, decay_style="cosine", weight_decay=0.1,
        clip_grad=1.0, model=train_reference.Mcore(gpt), moe_layers=MTP_MOE_LAYERS[layout],
        expert_bias=True)
    assert len(reference.mtp_losses) == ITERS
    trained = same_as_megatron_core(got, history, reference, tmp_path)
    assert any(k.startswith("mtp.layers.0.transformer_layer.mlp.experts") for k in trained)
    saved = load_pt(tmp_path / f"ckpt/iter_{ITERS:07d}/mp_rank_00/model_optim_rng.pt")
    assert saved["args"].mtp_num_layers == 1
    again = gpt_model(saved["args"], mtp_layout=layout)
    result = again.load_state_dict(saved["model"], strict=True)
    assert not result.missing_keys and not result.unexpected_keys


# Each load-balancing type (mindkit's flags) and the megatron-core router that trains the same:
# its own sinkhorn (no aux loss allowed); MindSpeed-LLM's pai_megatron_aux_loss is the Switch
# loss of a softmax over all experts with the top-k of it (its pai_megatron.py) and softmax_topk
# without norm_topk_prob that top-k without a loss (router.py topk_router_routing): megatron-
# core's aux_loss / none with moe_router_pre_softmax. MindSpeed-LLM's `none --seq-aux` with a
# softmax router and no expert bias (router.py apply_seq_aux_loss, its top-k the routing's) is
# megatron-core's seq_aux_loss, which MindSpeed-LLM leaves out of its log.
BALANCING = {
    "sinkhorn": (["sinkhorn"], "0", dict(moe_router_load_balancing_type="sinkhorn",
                                         moe_aux_loss_coeff=0.0)),
    "pai_megatron_aux_loss": (["pai_megatron_aux_loss"], "0.01", dict(
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01,
        moe_router_pre_softmax=True)),
    "softmax_topk": (["softmax_topk"], "0", dict(moe_router_load_balancing_type="none",
                                                 moe_router_pre_softmax=True)),
    "seq_aux": (["none", "--seq-aux"], "0.01", dict(moe_router_load_balancing_type="seq_aux_loss",
                                                    moe_aux_loss_coeff=0.01)),
}


@pytest.mark.parametrize("balancing", BALANCING)
def test_load_balancing_types_train_as_megatron_core(tmp_path, mindkit, balancing):
    """--moe-router-load-balancing-type sinkhorn (training routes each micro-batch's tokens by
    the top-2 of their Sinkhorn-balanced logits, weighted by the softmax over all experts),
    pai_megatron_aux_loss, softmax_topk and none with MindSpeed-LLM's --seq-aux, with the
    z-loss, trained by `mindkit train` and by megatron-core's own GPTModel (TopKRouter) from the
    same Megatron checkpoint: lm loss, grad norm, learning rate and the tracked losses per
    iteration to 1e-5 relative over 20 iterations, the final weights to 1e-4."""
    from megatron_cpu import gpt_model
    model_dir = make_qwen3_moe(tmp_path / "model")
    data = write_data(tmp_path / "data")
    mindkit_flags, coeff, reference_router = BALANCING[balancing]
    start = megatron_start(mindkit, model_dir, tmp_path / "start",
                           {"moe_router_load_balancing_type": mindkit_flags[0]})
    flags = [f for f in MOE_FLAGS if f != "--norm-topk-prob"]
    at = flags.index("aux_loss")
    flags[at:at + 1] = mindkit_flags
    flags[flags.index("--moe-aux-loss-coeff") + 1] = coeff
    mindkit_train(tmp_path / "start", data, tmp_path,
                  flags + ["--finetune", "--tokenizer-name-or-path", model_dir])
    got = scalars(tmp_path / "tb", ("lm loss", "grad-norm", "learning-rate", "load_balancing_loss",
                                    "seq_load_balancing_loss", "z_loss"))
    assert ("load_balancing_loss" in got) == (balancing == "pai_megatron_aux_loss"), got.keys()
    assert "seq_load_balancing_loss" not in got, got.keys()
    gpt = gpt_model(start["args"], moe_losses=dict(moe_z_loss_coeff=0.001, **reference_router))
    gpt.load_state_dict(start["model"], strict=True)
    history, reference, _ = train_reference.train(
        None, data, vocab_padded=512, eod=EOD, seq=48, mbs=2, gbs=8, iters=ITERS,
        lr=1e-3, min_lr=1e-4, warmup_iters=3, decay_style="cosine", weight_decay=0.1,
        clip_grad=1.0, model=train_reference.Mcore(gpt), moe_layers=2)
    if balancing == "seq_aux":
        assert any("seq_load_balancing_loss" in m for m in reference.moe_losses)
        reference.moe_losses = [{k: v for k, v in m.items() if k == "z_loss"}
                                for m in reference.moe_losses]
    same_as_megatron_core(got, history, reference, tmp_path)


def mindspeed_longrope(gpt, r, seq_length, max_positions):
    """megatron-core's GPTModel `gpt` with MindSpeed-LLM's LongRoPE (ported from
    mindspeed_llm/core/models/common/embeddings/rotary_pos_embedding.py
    `rotary_embedding_forward` and `apply_rotary_pos_emb_bshd`): the long factors when the
    training sequence length is beyond the original context, else the short ones; `outer`
    divides the inverse frequencies by them, `mul` the positions; the cos and sin scaled by the
    long or short mscale, or without them by √(1 + ln(max / original) / ln original)."""
    from megatron.core.models.common.embeddings import rope_utils
    rotary = gpt.rotary_pos_emb
    original = r["rope_scaling_original_max_position_embeddings"]
    long = seq_length > original
    ext = torch.tensor(r["long_factor"] if long else r["short_factor"], dtype=torch.float32)
    dim = 2 * rotary.inv_freq.shape[0]
    def freqs(max_seq_len, offset=0):
        seq = torch.arange(max_seq_len, dtype=torch.float32) + offset
        if r["longrope_freqs_type"] == "outer":
            shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
            return torch.outer(seq, 1.0 / (ext * r["rotary_base"] ** shape))
        return torch.mul(torch.outer(seq, 1.0 / ext), rotary.inv_freq)
    rotary.get_freqs_non_repeated = freqs
    if r.get("long_mscale") and r.get("short_mscale"):
        mscale = r["long_mscale"] if long else r["short_mscale"]
    else:
        scale = max_positions / original
        mscale = 1.0 if scale <= 1.0 else math.sqrt(1 + math.log(scale) / math.log(original))
    plain = rope_utils._apply_rotary_pos_emb_bshd
    rope_utils._apply_rotary_pos_emb_bshd = (
        lambda t, f, rotary_interleaved=False, multi_latent_attention=False, **_:
        plain(t, f, rotary_interleaved, multi_latent_attention, mscale))
    return plain


# LongRoPE cases: the angles' computation, the original context (the training length 48 beyond
# it or not) and the mscales (none: computed from max_position_embeddings 256)
LONGROPE = {
    "outer-long-mscales": dict(longrope_freqs_type="outer",
                               rope_scaling_original_max_position_embeddings=32,
                               long_mscale=1.2, short_mscale=1.1),
    "mul-short-computed-mscale": dict(longrope_freqs_type="mul",
                                      rope_scaling_original_max_position_embeddings=64,
                                      long_mscale=None, short_mscale=None),
}


@pytest.mark.parametrize("case", LONGROPE)
def test_longrope_trains_as_mindspeed_llms_rotary_embedding(tmp_path, mindkit, case):
    """--rope-scaling-type longrope (Phi-3.5's; MindSpeed-LLM's --long-factor, --short-factor,
    --longrope-freqs-type, --long/short-mscale) on the tiny llama: `mindkit train` against
    megatron-core's GPTModel with MindSpeed-LLM's LongRoPE (ported above) from the same
    checkpoint: lm loss, grad norm and learning rate per iteration to 1e-5 relative over 20
    iterations, the final weights to 1e-4."""
    from megatron_cpu import gpt_model
    from megatron.core.models.common.embeddings import rope_utils
    model_dir = make_model(tmp_path / "model", "llama")
    data = write_data(tmp_path / "data")
    longrope = dict(rope_scaling_type="longrope",
                    long_factor=[1.0, 1.5, 2.0, 3.0, 4.5, 6.0, 9.0, 12.0],
                    short_factor=[1.0, 1.02, 1.05, 1.1, 1.2, 1.3, 1.5, 1.7], **LONGROPE[case])
    start = megatron_start(mindkit, model_dir, tmp_path / "start", longrope)
    flags = ["--rope-scaling-type", "longrope",
             "--longrope-freqs-type", longrope["longrope_freqs_type"],
             "--long-factor", ",".join(map(str, longrope["long_factor"])),
             "--short-factor", ",".join(map(str, longrope["short_factor"])),
             "--rope-scaling-original-max-position-embeddings",
             str(longrope["rope_scaling_original_max_position_embeddings"])]
    if longrope["long_mscale"]:
        flags += ["--long-mscale", str(longrope["long_mscale"]),
                  "--short-mscale", str(longrope["short_mscale"])]
    mindkit_train(tmp_path / "start", data, tmp_path,
                  flags + ["--finetune", "--tokenizer-name-or-path", model_dir])
    got = scalars(tmp_path / "tb", ("lm loss", "grad-norm", "learning-rate"))
    gpt = gpt_model(start["args"])
    gpt.load_state_dict(start["model"], strict=True)
    plain = mindspeed_longrope(gpt, {**longrope, "rotary_base": start["args"].rotary_base}, 48,
                               start["args"].max_position_embeddings)
    try:
        history, reference, _ = train_reference.train(
            None, data, vocab_padded=512, eod=EOD, seq=48, mbs=2, gbs=8, iters=ITERS,
            lr=1e-3, min_lr=1e-4, warmup_iters=3, decay_style="cosine", weight_decay=0.1,
            clip_grad=1.0, model=train_reference.Mcore(gpt))
    finally:
        rope_utils._apply_rotary_pos_emb_bshd = plain
    same_as_megatron_core(got, history, reference, tmp_path)



def make_longcat_flash(out):
    """A seeded tiny LongCat-Flash (transformers' own LongcatFlash) with the shipped tokenizer:
    two layers, each two sublayers of multi-latent attention (a query latent of 32, a key-value
    latent of 16, their norms random, heads of 16 + 8 rotated dimensions, values of 12; the
    latents scaled by sqrt(hidden / rank)) and a dense MLP of 128, and shortcut experts on the
    first sublayer's normed input: 4 routed of ffn 32 and 2 zero-computation ones, a softmax
    over all six in f32 with a random expert bias for the choice, top-2 scaled by 6; untied.
    rms_norm_eps is 1e-6, the eps transformers' DeepSeek attention gives its latents' norms
    whatever the config says (Megatron and mindkit take --norm-epsilon for every norm)."""
    from transformers import LongcatFlashConfig, LongcatFlashForCausalLM
    torch.manual_seed(7)
    model = LongcatFlashForCausalLM(LongcatFlashConfig(
        vocab_size=VOCAB, hidden_size=64, ffn_hidden_size=128, num_layers=2, num_hidden_layers=4,
        num_attention_heads=4, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1,
        eos_token_id=EOD, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, head_dim=8, v_head_dim=12, n_routed_experts=4, zero_expert_num=2,
        moe_topk=2, expert_ffn_hidden_size=32, routed_scaling_factor=6.0, rope_theta=10000.0,
        tie_word_embeddings=False))
    with torch.no_grad():
        for layer in model.model.layers:
            for attention in layer.self_attn:
                attention.q_a_layernorm.weight.uniform_(0.5, 1.5)
                attention.kv_a_layernorm.weight.uniform_(0.5, 1.5)
            layer.mlp.router.e_score_correction_bias.normal_(std=0.01)
    model.save_pretrained(out, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / f, out / f)
    return out


def test_longcat_flash_trains_as_transformers_longcat_flash(tmp_path, mindkit):
    """MindSpeed-LLM's LongCat-Flash layer (--spec ...longcat_spec layer_spec, as its pretrain
    script runs it but for the expert bias's update rate 0: transformers does not train it)
    loaded from a tiny HF LongCat-Flash and trained by `mindkit train`, and transformers' own
    LongcatFlashForCausalLM trained by the PyTorch reference on the same samples: lm loss, grad
    norm and learning rate per iteration to 1e-5 relative over 20 iterations; mindkit's final
    checkpoint converted back to HF equals the reference's weights to 1e-4, its expert biases
    untouched."""
    model_dir = make_longcat_flash(tmp_path / "model")
    data = write_data(tmp_path / "data")
    flags = ["--spec", "mindspeed_llm.tasks.models.spec.longcat_spec", "layer_spec",
             "--multi-latent-attention", "--q-lora-rank", "32", "--kv-lora-rank", "16",
             "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "12",
             "--qk-layernorm", "--enable-mla-scale-q-lora", "--enable-mla-scale-kv-lora",
             "--num-experts", "4", "--num-zero-experts", "2", "--moe-router-topk", "2",
             "--moe-ffn-hidden-size", "32", "--moe-router-load-balancing-type", "softmax_topk",
             "--moe-router-topk-scaling-factor", "6", "--moe-router-enable-expert-bias",
             "--moe-router-bias-update-rate", "0", "--moe-aux-loss-coeff", "0",
             "--moe-router-dtype", "fp32", "--moe-grouped-gemm", "--untie-embeddings-and-output-weights",
             "--finetune", "--tokenizer-name-or-path", model_dir]
    mindkit_train(model_dir, data, tmp_path, flags)
    same_as_the_reference(mindkit, model_dir, data, tmp_path, {})


def test_validation_matches_the_megatron_reference(tmp_path, mindkit):
    """--eval-interval / --eval-iters on the validation split of --split 9,1,0: the lm loss
    evaluate() reports every 5 iterations and after the last one, as the reference computes it
    on megatron-core's validation GPTDataset; --log-params-norm and --log-num-zeros-in-grad."""
    model_dir = make_model(tmp_path / "model", "llama")
    data = write_data(tmp_path / "data")
    mindkit_train(model_dir, data, tmp_path, ["--split", "9,1,0", "--eval-interval", "5",
                                              "--eval-iters", "2", "--log-params-norm",
                                              "--log-num-zeros-in-grad"])
    got = scalars(tmp_path / "tb", ("lm loss", "lm loss validation", "params-norm", "num-zeros"))
    history, reference, _ = train_reference.train(
        str(model_dir), data, vocab_padded=512, eod=EOD, seq=48, mbs=2, gbs=8, iters=ITERS,
        lr=1e-3, min_lr=1e-4, warmup_iters=3, decay_style="cosine", weight_decay=0.1,
        clip_grad=1.0, split="9,1,0", evaluation=(5, 2))
    for i, (g, w) in enumerate(zip(got["lm loss"], [h[0] for h in history])):
        assert abs(g - w) <= 1e-5 * abs(w), f"lm loss at iteration {i + 1}: {g} vs {w}"
    for i, (g, w) in enumerate(zip(got["params-norm"], [h[3] for h in history])):
        assert abs(g - w) <= 1e-5 * abs(w), f"params norm at iteration {i + 1}: {g} vs {w}"
    assert got["num-zeros"] == [h[4] for h in history]
    assert len(got["lm loss validation"]) == len(reference.validation) == ITERS // 5 + 1
    for i, (g, w) in enumerate(zip(got["lm loss validation"], reference.validation)):
        assert abs(g - w) <= 1e-5 * abs(w), f"validation {i + 1}: {g} vs {w}"


def test_bf16_follows_the_fp32_curve(tmp_path, mindkit):
    """--bf16 (bf16 weights and activations, f32 main parameters and gradients): the loss
    curve stays within 1% of the fp32 run over 50 iterations."""
    model_dir = make_model(tmp_path / "model", "llama")
    data = write_data(tmp_path / "data")
    curves = {}
    for name, extra in (("fp32", []), ("bf16", ["--bf16"])):
        out = tmp_path / name
        mindkit_train(model_dir, data, out, ["--train-iters", "50", *extra])
        curves[name] = scalars(out / "tb")["lm loss"]
    for i, (a, b) in enumerate(zip(curves["fp32"], curves["bf16"])):
        assert abs(a - b) <= 0.01 * a, f"iteration {i + 1}: bf16 {b} vs fp32 {a}"


def write_alpaca(path, n=40):
    """Synthetic instruction records (the words are what the tiny tokenizer was trained on)."""
    rng = np.random.default_rng(5)
    words = "the of and a to in is was he for it with as his on be at by had are but from not".split()
    with open(path, "w") as f:
        for _ in range(n):
            text = lambda k: " ".join(rng.choice(words, size=k))
            f.write(json.dumps({"instruction": text(int(rng.integers(2, 8))),
                                "input": text(int(rng.integers(0, 4))),
                                "output": text(int(rng.integers(2, 12)))}) + "\n")


@pytest.mark.parametrize("flags,options", [
    ([], {}),
    (["--padded-samples", "--no-pad-to-seq-lengths"], {"padded": True, "multiple_of": 8}),
])
def test_fine_tuning_matches_mindspeed(tmp_path, mindkit, flags, options):
    """--is-instruction-dataset against a port of MindSpeed-LLM's SFT (sft_reference.py)."""
    model_dir = make_model(tmp_path / "model", "llama")
    write_alpaca(tmp_path / "alpaca.jsonl")
    prefix = tmp_path / "sft"
    mindkit("preprocess", "--input", tmp_path / "alpaca.jsonl", "--output-prefix", prefix,
            "--tokenizer", model_dir, "--handler", "alpaca", "--prompt-type", "alpaca",
            "--seq-length", "128")
    sft = ["--is-instruction-dataset", "--stage", "sft", "--finetune", "--prompt-type", "alpaca",
           "--seq-length", "128", *flags]
    mindkit_train(model_dir, str(prefix), tmp_path, sft)
    got = scalars(tmp_path / "tb")
    history, _, _ = sft_reference.train(
        str(model_dir), str(prefix), seq=128, mbs=2, gbs=8, iters=ITERS, lr=1e-3, min_lr=1e-4,
        warmup_iters=3, decay_style="cosine", weight_decay=0.1, clip_grad=1.0, vocab_padded=512,
        **options)
    for key, column in (("lm loss", 0), ("grad-norm", 1), ("learning-rate", 2)):
        for i, (g, w) in enumerate(zip(got[key], [h[column] for h in history])):
            assert abs(g - w) <= 1e-5 * abs(w) + 1e-12, f"{key} at iteration {i + 1}: {g} vs {w}"


def write_pairs(prefix, n=24, seed=3):
    """Preference pairs as MindSpeed-LLM's pairwise handlers write them: a prompt (labels
    ignored) then the chosen or the rejected answer, int32; some pairs longer than the
    sequence, which the dataset cuts."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    rng = np.random.default_rng(seed)
    builders = {key: IndexedDatasetBuilder(f"{prefix}_packed_{key}_document.bin", dtype=np.int32)
                for key in ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels")}
    for i in range(n):
        prompt = rng.integers(3, VOCAB, size=int(rng.integers(2, 30 if i % 5 == 0 else 12)))
        for side in ("chosen", "rejected"):
            answer = rng.integers(3, VOCAB, size=int(rng.integers(1, 40 if i % 7 == 0 else 10)))
            ids = np.concatenate([prompt, answer])
            labels = np.concatenate([np.full(len(prompt), -100), answer])
            for key, values in ((f"{side}_input_ids", ids), (f"{side}_labels", labels)):
                builders[key].add_item(torch.tensor(values, dtype=torch.int32))
                builders[key].end_document()
    for key, b in builders.items():
        b.finalize(f"{prefix}_packed_{key}_document.idx")


@pytest.mark.parametrize("loss_type,flags", [
    ("sigmoid", ["--dpo-label-smoothing", "0.1", "--pref-ftx", "0.5"]),
    ("hinge", []),
    ("ipo", ["--dpo-beta", "0.5"]),
])
def test_dpo_matches_mindspeed(tmp_path, mindkit, loss_type, flags):
    """--stage dpo against a port of MindSpeed-LLM's DPO trainer (sft_reference.dpo_train): the
    policy and a frozen copy of the starting weights score the chosen and rejected answers;
    loss, grad norm, lr and rewards/accuracies per iteration."""
    model_dir = make_model(tmp_path / "model", "llama")
    megatron_cpu.init()
    write_pairs(tmp_path / "pairs")
    options = {"beta": 0.1, "label_smoothing": 0.0, "ftx": 0.0}
    for name, value in zip(flags[::2], flags[1::2]):
        options[{"--dpo-label-smoothing": "label_smoothing", "--pref-ftx": "ftx",
                 "--dpo-beta": "beta"}[name]] = float(value)
    dpo = ["--stage", "dpo", "--is-pairwise-dataset", "--finetune", "--dpo-loss-type", loss_type, *flags]
    mindkit_train(model_dir, str(tmp_path / "pairs"), tmp_path, dpo)
    got = scalars(tmp_path / "tb", tags=("lm loss", "grad-norm", "learning-rate", "rewards/accuracies"))
    history = sft_reference.dpo_train(
        str(model_dir), str(tmp_path / "pairs"), seq=48, mbs=2, gbs=8, iters=ITERS, lr=1e-3,
        min_lr=1e-4, warmup_iters=3, decay_style="cosine", weight_decay=0.1, clip_grad=1.0,
        loss_type=loss_type, vocab_padded=512, **options)
    for key, column in (("lm loss", 0), ("grad-norm", 1), ("learning-rate", 2), ("rewards/accuracies", 3)):
        for i, (g, w) in enumerate(zip(got[key], [h[column] for h in history])):
            assert abs(g - w) <= 1e-5 * abs(w) + 1e-6, f"{key} at iteration {i + 1}: {g} vs {w}"
    assert all(len(got[key]) == ITERS for key in ("lm loss", "rewards/accuracies")), got.keys()
    assert 0 < history[-1][3] and history[-1][0] < history[0][0]  # it learns to prefer


def lora_pair(tmp_path, r, alpha):
    """The llama model for mindkit, the same weights as a Phi-3 (fused qkv_proj and
    gate_up_proj, so that one peft adapter covers Megatron's fused linear_qkv / linear_fc1)
    with peft adapters for the reference, and the initial adapters as a Megatron LoRA
    checkpoint both start from (A random, B zero, as peft initialises them)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM, Phi3Config, Phi3ForCausalLM
    llama_dir = make_model(tmp_path / "llama", "llama")
    llama = LlamaForCausalLM.from_pretrained(llama_dir, torch_dtype=torch.float32)
    lc = llama.config
    phi3 = Phi3ForCausalLM(Phi3Config(
        vocab_size=VOCAB, hidden_size=lc.hidden_size, intermediate_size=lc.intermediate_size,
        num_hidden_layers=lc.num_hidden_layers, num_attention_heads=lc.num_attention_heads,
        num_key_value_heads=lc.num_key_value_heads, max_position_embeddings=256,
        rms_norm_eps=lc.rms_norm_eps, rope_theta=lc.rope_theta, tie_word_embeddings=False,
        pad_token_id=0, bos_token_id=1, eos_token_id=EOD))
    sd = llama.state_dict()
    fused = {}
    for name, t in sd.items():
        if ".self_attn.q_proj" in name:
            stem = name.replace(".q_proj.weight", "")
            fused[stem + ".qkv_proj.weight"] = torch.cat([sd[stem + f".{x}_proj.weight"] for x in "qkv"])
        elif ".mlp.gate_proj" in name:
            stem = name.replace(".gate_proj.weight", "")
            fused[stem + ".gate_up_proj.weight"] = torch.cat([sd[stem + ".gate_proj.weight"], sd[stem + ".up_proj.weight"]])
        elif not any(f".{x}_proj" in name for x in ("k", "v", "up")):
            fused[name] = t
    phi3.load_state_dict(fused, strict=True)
    phi3_dir = tmp_path / "phi3"
    phi3.save_pretrained(phi3_dir)
    reference = train_reference.padded_model(str(phi3_dir), 512)
    targets = {"qkv_proj": "self_attention.linear_qkv", "o_proj": "self_attention.linear_proj",
               "gate_up_proj": "mlp.linear_fc1", "down_proj": "mlp.linear_fc2"}
    reference = get_peft_model(reference, LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0,
                                                     target_modules=list(targets)))
    adapters = {}
    torch.manual_seed(7)
    for name, module in reference.named_modules():
        short = name.rsplit(".", 1)[-1]
        if short in targets and hasattr(module, "lora_A"):
            a = module.lora_A["default"].weight
            with torch.no_grad():
                a.uniform_(-0.1, 0.1)
            layer = int(name.split(".layers.")[1].split(".")[0])
            key = f"decoder.layers.{layer}.{targets[short]}"
            adapters[f"{key}.lora_A.default.weight"] = a.detach().clone()
            adapters[f"{key}.lora_B.default.weight"] = module.lora_B["default"].weight.detach().clone()
    import argparse
    ckpt = tmp_path / "lora0"
    (ckpt / "iter_0000000/mp_rank_00").mkdir(parents=True)
    torch.save({"args": argparse.Namespace(lora_r=r, lora_alpha=alpha), "checkpoint_version": 3.0,
                "iteration": 0, "model": adapters},
               ckpt / "iter_0000000/mp_rank_00/model_optim_rng.pt")
    (ckpt / "latest_checkpointed_iteration.txt").write_text("0")
    return llama_dir, reference, ckpt


def test_lora_matches_peft(tmp_path, mindkit):
    """LoRA on linear_qkv, linear_proj, linear_fc1, linear_fc2 (base frozen) against peft on the
    same model: loss, grad norm (of the adapters) and lr per iteration; the LoRA-only
    checkpoint folds back with `mindkit lora merge`."""
    llama_dir, reference, lora0 = lora_pair(tmp_path, r=4, alpha=8)
    data = write_data(tmp_path / "data")
    mindkit_train(llama_dir, data, tmp_path, [
        "--finetune", "--lora-r", "4", "--lora-alpha", "8", "--lora-load", lora0,
        "--lora-target-modules", "linear_qkv", "linear_proj", "linear_fc1", "linear_fc2",
        "--lora-ckpt-filter"])
    got = scalars(tmp_path / "tb")
    history, _, _ = train_reference.train(
        None, data, vocab_padded=512, eod=EOD, seq=48, mbs=2, gbs=8, iters=ITERS, lr=1e-3,
        min_lr=1e-4, warmup_iters=3, decay_style="cosine", weight_decay=0.1, clip_grad=1.0,
        model=reference)
    for key, column in (("lm loss", 0), ("grad-norm", 1), ("learning-rate", 2)):
        for i, (g, w) in enumerate(zip(got[key], [h[column] for h in history])):
            assert abs(g - w) <= 1e-5 * abs(w) + 1e-12, f"{key} at iteration {i + 1}: {g} vs {w}"
    merged = tmp_path / "merged"
    mindkit("lora", "merge", "--base", llama_dir, "--adapter", tmp_path / "ckpt", "--output", merged,
            "--to", "hf")
    assert (merged / "model.safetensors").exists()


@pytest.mark.parametrize("family,chunks,distributed", [("llama", 1, False), ("qwen2", 1, False),
                                                      ("qwen2", 2, False), ("llama", 2, True),
                                                      ("qwen3", 1, False)],
                         ids=["llama", "qwen2", "qwen2-vpp2", "llama-vpp2-distributed-optimizer",
                              "qwen3"])
def test_megatron_core_loads_every_tensor_and_pipeline_shard(tmp_path, family, chunks, distributed):
    """A TP 2 × PP 2 checkpoint (untied GQA; tied with q/k/v biases: the last stage's copy of
    the embedding as its output layer; and tied over four layers in two model chunks per stage)
    as Megatron's get_model and load_checkpoint read it, under the real torchrun: each of the
    four ranks builds its GPTModel stage — or each model chunk, with megatron-core's layer offsets
    for it — in megatron-core's parallel state (gloo) and loads its mp_rank_TT_PPP file strictly,
    and its optimizer state into AdamW over megatron-core's parameter groups of the stage's
    chunks (a stage's groups in the order of their first parameters) — or, with the distributed
    optimizer (two data-parallel ranks), each chunk's buffer in distrib_optim.pt is laid out as
    megatron-core's DDP of the chunk lays it —; each chunk's layers, as
    megatron-core numbers them, hold what mindkit's own HF conversion puts at those layers; the
    tied embedding's copies are equal."""
    import socket
    import sys
    model_dir = make_model(tmp_path / "model", family, layers=2 * chunks)
    data = write_data(tmp_path / "data")
    virtual = ["--num-virtual-stages-per-pipeline-rank", str(chunks)] if chunks > 1 else []
    # the distributed optimizer over two data-parallel ranks, the first chunk in buckets
    sharded = ["--use-distributed-optimizer", "--world-size", "8", "--overlap-grad-reduce",
               "--ddp-bucket-size", "20000"] if distributed else []
    mindkit_train(model_dir, data, tmp_path, ["--tensor-model-parallel-size", "2",
                                              "--pipeline-model-parallel-size", "2", *virtual, *sharded])
    # mindkit's own reading of the checkpoint, against which megatron-core's layer numbering is checked
    hf = tmp_path / "hf"
    binary = os.environ.get("MINDKIT_BIN", str(ROOT / "target/release/mindkit"))
    subprocess.run([binary, "convert", "--to", "hf", "--input", tmp_path / "ckpt", "--output", hf, "--quiet"],
                   check=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    script = pathlib.Path(__file__).parent / "megatron_stages.py"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                        "--master-port", str(port), str(script), str(tmp_path / f"ckpt/iter_{ITERS:07d}"),
                        str(hf)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    # (gloo's own lines may interleave with the ranks')
    assert r.stdout.count("tensors loaded") == 4, r.stdout + r.stderr
    assert r.stdout.count("buffer(s) as megatron-core's") == (4 if distributed else 0), r.stdout + r.stderr
    # every layer on exactly one rank of each tensor-parallel pair
    import re
    held = [int(n) for found in re.findall(r"layers \[([0-9, ]*)\]", r.stdout) for n in found.split(", ")]
    assert sorted(held) == sorted(list(range(1, 2 * chunks + 1)) * 2), r.stdout
    if family == "qwen2":
        # the tied embedding's two copies stayed equal, shard by shard
        from megatron_cpu import load_pt
        for tp in range(2):
            first, last = (load_pt(tmp_path / f"ckpt/iter_{ITERS:07d}/mp_rank_{tp:02d}_{pp:03d}/model_optim_rng.pt")
                           for pp in range(2))
            (first, last) = (first["model0"], last[f"model{chunks - 1}"]) if chunks > 1 else (first["model"],
                                                                                           last["model"])
            assert torch.equal(first["embedding.word_embeddings.weight"], last["output_layer.weight"])


@pytest.mark.parametrize("family,precision,bucket", [
    ("llama", "fp32", None), ("qwen2", "bf16", None), ("llama", "fp32", 20000),
    ("qwen3", "bf16-f32-norms", 20000)])
def test_distributed_optimizer_state_is_laid_out_as_megatron_cores_buffer(tmp_path, family, precision,
                                                                          bucket):
    """--use-distributed-optimizer on two data-parallel ranks: distrib_optim.pt holds the
    buffers megatron-core's own DistributedDataParallel gives the model — one keyed by (param
    dtype, float32), or with --init-norm-weight-in-fp32 under --bf16 the bf16 weights' then the
    f32 norms' — with their numel_unpadded and every parameter's offsets (reverse order,
    64-element alignment; one bucket, or buckets of --ddp-bucket-size with
    --overlap-grad-reduce), each parameter's main copy there equal to the saved weights (in
    bf16, as bf16), and model_optim_rng.pt's optimizer the groups without ids, each with its
    step."""
    from megatron_cpu import gpt_model, keep_norms_f32, load_pt, same_buffers
    model_dir = make_model(tmp_path / "model", family)
    data = write_data(tmp_path / "data")
    buckets = ["--overlap-grad-reduce", "--ddp-bucket-size", str(bucket)] if bucket else []
    flags = {"fp32": [], "bf16": ["--bf16"], "bf16-f32-norms": ["--bf16", "--init-norm-weight-in-fp32"]}
    mindkit_train(model_dir, data, tmp_path, ["--use-distributed-optimizer", "--world-size", "2",
                                              *flags[precision], *buckets])
    rank_dir = tmp_path / f"ckpt/iter_{ITERS:07d}/mp_rank_00"
    obj = load_pt(rank_dir / "model_optim_rng.pt")
    groups = obj["optimizer"]["optimizer"]["param_groups"]
    assert [g["wd_mult"] for g in groups] == [1.0, 0.0] and all(g["step"] == ITERS for g in groups)
    assert all("params" not in g for g in groups) and "state" not in obj["optimizer"]["optimizer"]
    model = gpt_model(obj["args"])
    model.load_state_dict({k: v.float() for k, v in obj["model"].items()}, strict=True)
    if precision == "bf16":
        model.to(torch.bfloat16)
    if precision == "bf16-f32-norms":
        keep_norms_f32(model)
    state = torch.load(rank_dir / "distrib_optim.pt", weights_only=True)
    assert state["buckets_coalesced"] is True
    entries = [state[i] for i in range(len(state) - 1)]
    assert len(entries) == (2 if precision == "bf16-f32-norms" else 1)
    buckets = same_buffers(model, obj["model"], entries, bucket)
    assert (len(buckets) > len(entries)) == (bucket is not None)


def test_f32_norms_beside_bf16_weights_load_into_megatron_cores_float16_optimizer(tmp_path):
    """--bf16 --init-norm-weight-in-fp32 without the distributed optimizer: the checkpoint's
    norms (Qwen3's q/k norms too) are f32 and every other weight bf16, the model loads into
    megatron-core's GPTModel as MindSpeed-LLM keeps it, and its optimizer state into
    megatron-core's Float16OptimizerWithFloat16Params over it — f32 main copies of the bf16
    weights only (the norms are its fp32_from_fp32 parameters), each equal to its weight."""
    from megatron_cpu import gpt_model, keep_norms_f32, load_pt
    model_dir = make_model(tmp_path / "model", "qwen3")
    data = write_data(tmp_path / "data")
    mindkit_train(model_dir, data, tmp_path, ["--bf16", "--init-norm-weight-in-fp32"])
    obj = load_pt(tmp_path / f"ckpt/iter_{ITERS:07d}/mp_rank_00/model_optim_rng.pt")
    model = keep_norms_f32(gpt_model(obj["args"]))
    weights = {k: v for k, v in obj["model"].items() if not k.endswith("_extra_state")}
    theirs = {k: v.dtype for k, v in model.state_dict().items() if k in weights}
    assert {k: v.dtype for k, v in weights.items()} == theirs
    assert {torch.float32, torch.bfloat16} == set(theirs.values())
    model.load_state_dict(obj["model"], strict=True)
    opt = megatron_core_optimizer(model, obj["args"], bf16=True)
    opt.load_state_dict(obj["optimizer"])
    # the lists megatron-core's own state_dict would save
    assert ([len(g) for g in obj["optimizer"]["fp32_from_fp16_params"]]
            == [len(g) for g in opt.state_dict()["fp32_from_fp16_params"]])
    norms = [p for g in opt.fp32_from_fp32_groups for p in g]
    assert len(norms) == sum(v == torch.float32 for v in theirs.values())
    for halves, mains in zip(opt.float16_groups, opt.fp32_from_float16_groups):
        for half, main in zip(halves, mains):
            assert main.shape == half.shape and torch.equal(main.to(half.dtype), half)
    for group in opt.optimizer.param_groups:
        for p in group["params"]:
            assert opt.optimizer.state[p]["exp_avg_sq"].shape == p.shape


def megatron_core_optimizer(model, a, bf16):
    """megatron-core's own optimizer over `model` as get_megatron_optimizer makes it for the args
    `a` without the distributed optimizer — FP32Optimizer, or with bf16 parameters
    Float16OptimizerWithFloat16Params holding f32 main copies of the bf16 ones (an f32 one is
    its own) — over `_get_param_groups`' groups
    of torch's AdamW. Their constructors ask for CUDA, so the objects are made as they make
    themselves, on the CPU."""
    from megatron.core import tensor_parallel
    from megatron.core.optimizer import OptimizerConfig, _get_param_groups
    from megatron.core.optimizer.optimizer import (FP32Optimizer,
                                                   Float16OptimizerWithFloat16Params)
    groups = _get_param_groups([model], None, None, 1.0, a.lr, a.min_lr, None, None)
    inner = torch.optim.AdamW(groups, lr=a.lr, weight_decay=a.weight_decay)

    def init_state_fn(opt, config=None):
        for group in opt.param_groups:
            for p in group["params"]:
                if not opt.state[p]:
                    opt.state[p]["exp_avg"] = torch.zeros_like(p.data)
                    opt.state[p]["exp_avg_sq"] = torch.zeros_like(p.data)

    cls = Float16OptimizerWithFloat16Params if bf16 else FP32Optimizer
    opt = cls.__new__(cls)
    opt.optimizer, opt.init_state_fn, opt.is_stub_optimizer = inner, init_state_fn, False
    opt.config = OptimizerConfig(optimizer="adam", lr=a.lr, bf16=bf16)
    if bf16:
        opt.grad_scaler = None
        opt.float16_groups, opt.fp32_from_float16_groups, opt.fp32_from_fp32_groups = [], [], []
        for group in inner.param_groups:
            halves, mains, fp32s = [], [], []
            for i, p in enumerate(group["params"]):
                if p.dtype == torch.float32:
                    fp32s.append(p)
                    continue
                main = p.detach().clone().float()
                tensor_parallel.copy_tensor_model_parallel_attributes(main, p)
                group["params"][i], p.main_param = main, main
                halves.append(p)
                mains.append(main)
            opt.float16_groups.append(halves)
            opt.fp32_from_float16_groups.append(mains)
            opt.fp32_from_fp32_groups.append(fp32s)
    return opt


@pytest.mark.parametrize("precision,grouped", [("fp32", False), ("bf16", False), ("fp32", True)])
def test_megatron_core_resumes_mindkits_torch_dist_checkpoint(tmp_path, mindkit, precision, grouped):
    """`mindkit train --ckpt-format torch_dist` loaded as Megatron's load_checkpoint loads a
    torch_dist checkpoint: dist_checkpointing.load of the model's and megatron-core's own
    optimizer's sharded state dicts with every missing or unexpected key an error, then their
    load_state_dict. The weights equal those of the same run saved in the torch format, and so
    do every parameter's moments (and, in bf16, its f32 main copy) and the step; common.pt
    loads with the weights_only unpickler, records no RNG state to load, and its scheduler
    loads into OptimizerParamScheduler. With grouped experts (GroupedMLP's weight1 and
    weight2), their state saved per expert as SequentialMLP's is what megatron-core's
    GroupedMLP reads back into its own parameters."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron_cpu import gpt_model, load_pt
    bf16 = precision == "bf16"
    model_dir = tmp_path / "model"
    model_dir = make_qwen3_moe(model_dir) if grouped else make_model(model_dir, "llama")
    data = write_data(tmp_path / "data")
    flags = ["--bf16"] if bf16 else []
    flags += MOE_FLAGS + ["--moe-grouped-gemm"] if grouped else []
    mindkit_train(model_dir, data, tmp_path / "dist", flags + ["--ckpt-format", "torch_dist"])
    mindkit_train(model_dir, data, tmp_path / "torch", flags)
    ref = load_pt(tmp_path / f"torch/ckpt/iter_{ITERS:07d}/mp_rank_00/model_optim_rng.pt")
    a = ref["args"]
    dist_dir = tmp_path / f"dist/ckpt/iter_{ITERS:07d}"
    common = load_pt(dist_dir / "common.pt")
    assert common["iteration"] == ITERS and common["args"].ckpt_format == "torch_dist"
    assert common["args"].no_save_rng and common["args"].consumed_train_samples == ITERS * 8

    def built():
        model = gpt_model(a)
        return model.to(torch.bfloat16) if bf16 else model

    model = built()
    opt = megatron_core_optimizer(model, a, bf16)
    request = {"model": model.sharded_state_dict()}
    request["optimizer"] = opt.sharded_state_dict(request, is_loading=True)
    loaded = dist_checkpointing.load(request, str(dist_dir), strict=StrictHandling.RAISE_ALL)
    model.load_state_dict(loaded["model"], strict=True)
    opt.load_state_dict(loaded["optimizer"])
    assert grouped == any(n.endswith("experts.weight1") for n, _ in model.named_parameters())
    reference = built()
    reference.load_state_dict(ref["model"], strict=True)
    for (name, got), want in zip(model.state_dict().items(), reference.state_dict().values()):
        if isinstance(got, torch.Tensor):
            assert torch.equal(got, want), name
    # the torch format's optimizer state, by parameter id (groups in the same order)
    saved = ref["optimizer"]["optimizer"] if bf16 else ref["optimizer"]
    params = [p for g in opt.optimizer.param_groups for p in g["params"]]
    assert len(params) == len(saved["state"]) > 0
    for i, p in enumerate(params):
        state = opt.optimizer.state[p]
        assert int(state["step"]) == ITERS
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[k], saved["state"][i][k]), (i, k)
    if bf16:
        mains = [m for g in ref["optimizer"]["fp32_from_fp16_params"] for m in g]
        got = [m for g in opt.fp32_from_float16_groups for m in g]
        assert len(got) == len(mains) and all(torch.equal(x, y) for x, y in zip(got, mains))
    gbs = 8
    sched = OptimizerParamScheduler(
        opt.optimizer, init_lr=a.lr_warmup_init, max_lr=a.lr, min_lr=a.min_lr,
        lr_warmup_steps=a.lr_warmup_iters * gbs, lr_decay_steps=ITERS * gbs,
        lr_decay_style=a.lr_decay_style, start_wd=a.weight_decay, end_wd=a.weight_decay,
        wd_incr_steps=ITERS * gbs, wd_incr_style="constant")
    sched.load_state_dict(common["opt_param_scheduler"])
    assert sched.num_steps == ITERS * gbs


@pytest.mark.parametrize("ranks,precision,experts,sharding", [
    (1, "bf16", False, "dp_reshardable"), (4, "fp32", True, "dp_reshardable"),
    (4, "bf16", True, "fully_sharded_model_space")])
def test_mindkit_resumes_megatron_cores_distributed_optimizer_state(
        tmp_path, mindkit, ranks, precision, experts, sharding):
    """megatron-core's default torch_dist save of the distributed optimizer — `dp_reshardable`
    bucket tensors, the parameter groups in a ShardedObject — made by megatron-core's own
    DistributedOptimizer on `ranks` data-parallel ranks from a mindkit run's torch-format
    checkpoint (megatron_dp_reshardable_save.py; in bf16 its f32 main copies in the buckets;
    with routed experts over two expert-parallel ranks, the chained optimizers' states under
    `chained_0.` and `chained_1.`), or in the deprecated `fully_sharded_model_space` form
    older Megatron-LM saved by default (each rank's pieces of every parameter's state as
    N-D flattened tensors): `mindkit train` resumes it and trains on as from the
    torch-format checkpoint, loss for loss and gradient norm for gradient norm, and not as a
    run that resets the optimizer does; the buckets on half the ranks as well (resharded
    over data-parallel ranks). The flattened state is saved over TP 2 × EP 2 × DP 2: its local
    chunks are TP shards (and single experts), each chunk's row cut into data-parallel
    ranks' pieces."""
    from test_convert import run_ranks
    model_dir = tmp_path / "model"
    model_dir = make_qwen3_moe(model_dir) if experts else make_model(model_dir, "llama")
    data = write_data(tmp_path / "data")
    flags = ["--use-distributed-optimizer", "--world-size", str(ranks)]
    flags += ["--bf16"] if precision == "bf16" else []
    flags += MOE_FLAGS + ["--expert-model-parallel-size", "2"] if experts else []
    flags += ["--tensor-model-parallel-size", "2", "--sequence-parallel"] if sharding != "dp_reshardable" else []
    mindkit_train(model_dir, data, tmp_path / "torch", flags)
    r = run_ranks("megatron_dp_reshardable_save.py", ranks,
                  tmp_path / f"torch/ckpt/iter_{ITERS:07d}", tmp_path / "megatron", sharding)
    assert r.stdout.count("saved") == ranks, r.stdout + r.stderr
    binary = train_command(model_dir, data, tmp_path, [])[0]
    info = subprocess.run([binary, "ckpt", "info", str(tmp_path / "megatron")],
                          capture_output=True, text=True, check=True).stdout
    kind = {"dp_reshardable": "distributed optimizer, dp_reshardable buckets",
            "fully_sharded_model_space": "model-shaped, flattened (fully_sharded_model_space)"}
    chained = ', 2 chained optimizers' if experts else ''
    assert f"optimizer:   {kind[sharding]}{chained}\n" in info, info
    # its weights, beside the optimizer's keys, convert as the torch-format checkpoint's do
    from safetensors.torch import load_file
    for source in ("megatron", "torch/ckpt"):
        mindkit("convert", "--to", "hf", "--input", tmp_path / source, "--output",
                tmp_path / f"hf_{source[:5]}")
    got, want = (load_file(str(tmp_path / f"hf_{s}/model.safetensors")) for s in ("megat", "torch"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    on = flags + ["--train-iters", str(ITERS + 6), "--log-interval", "1",
                  "--tokenizer-name-or-path", model_dir, "--use-checkpoint-opt-param-scheduler"]
    mindkit_train(tmp_path / "torch/ckpt", data, tmp_path / "from_torch", on)
    mindkit_train(tmp_path / "megatron", data, tmp_path / "from_megatron", on)
    mindkit_train(tmp_path / "megatron", data, tmp_path / "reset", on + ["--no-load-optim"])
    want = scalars(tmp_path / "from_torch/tb", ("lm loss", "grad-norm"))
    assert len(want["lm loss"]) == 6
    assert scalars(tmp_path / "from_megatron/tb", ("lm loss", "grad-norm")) == want
    assert scalars(tmp_path / "reset/tb", ("lm loss",))["lm loss"] != want["lm loss"]
    if ranks > 2 and sharding == "dp_reshardable":
        # resharded over data-parallel ranks, as megatron-core reshards it: on half the ranks
        half = on + ["--world-size", str(ranks // 2)]
        mindkit_train(tmp_path / "torch/ckpt", data, tmp_path / "torch_on_half", half)
        mindkit_train(tmp_path / "megatron", data, tmp_path / "megatron_on_half", half)
        tags = ("lm loss", "grad-norm")
        assert (scalars(tmp_path / "megatron_on_half/tb", tags)
                == scalars(tmp_path / "torch_on_half/tb", tags))
    # buckets of another layout, of another chain, and no distributed optimizer to read them
    # into, are refused
    if sharding != "dp_reshardable":
        return
    plain = [a for a in on if a != "--use-distributed-optimizer"]
    refused = [(plain, "which only the distributed optimizer reads")]
    if experts:
        refused += [(on + ["--expert-model-parallel-size", "1"], "chained distributed optimizer")]
    else:
        tp2 = on + ["--tensor-model-parallel-size", "2", "--world-size", "2"]
        refused += [(tp2, "saved in buckets of")]
    for args, why in refused:
        cmd = train_command(tmp_path / "megatron", data, tmp_path / "refused", args)
        r = subprocess.run(cmd, capture_output=True, text=True)
        assert r.returncode != 0 and why in r.stderr, r.stderr


@pytest.mark.parametrize("ranks,layout", [(4, ("--tp", 2, "--pp", 2)), (1, ("--tp", 1, "--pp", 1))])
def test_megatron_core_loads_a_torch_dist_save_of_tensor_and_pipeline_parallel_ranks(
        mindkit, tmp_path, ranks, layout):
    """`mindkit train --ckpt-format torch_dist` over TP 2 + SP × PP 2 (four ranks, each writing
    its shards of the global tensors, SwiGLU's gate and up rows apart): megatron-core's
    `dist_checkpointing.load` of each rank's GPTModel stage, every missing or unexpected key an
    error, at TP 2 × PP 2 and at TP 1, gives the tensors of the same run saved in the torch format
    (resharded by `mindkit convert` for TP 1) — megatron_dist_load.py."""
    from test_convert import run_ranks
    model_dir = make_model(tmp_path / "model", "qwen3")
    data = write_data(tmp_path / "data")
    flags = ["--tensor-model-parallel-size", "2", "--sequence-parallel",
             "--pipeline-model-parallel-size", "2", "--world-size", "4", "--no-save-optim",
             "--spec", "mindspeed_llm.tasks.models.spec.qwen3_spec", "layer_spec",
             "--qk-layernorm"]
    mindkit_train(model_dir, data, tmp_path / "dist", flags + ["--ckpt-format", "torch_dist"])
    mindkit_train(model_dir, data, tmp_path / "torch", flags)
    mindkit("convert", "--to", "megatron", "--input", tmp_path / "torch/ckpt", "--output",
            tmp_path / "ref", *layout)
    ref = next((tmp_path / "ref").glob("iter_*"))
    r = run_ranks("megatron_dist_load.py", ranks, ref, tmp_path / "dist/ckpt")
    assert r.stdout.count("tensors equal") == ranks, r.stdout + r.stderr
