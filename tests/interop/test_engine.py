"""The engine against transformers on the real SmolLM2-135M-Instruct (fp32 compute): prefill
logits and every KV-cached decoding step within 1e-3, 32 greedy tokens identical, `mindkit
generate` text equal to transformers' `generate`; the same logits from a Megatron conversion."""
import json
import os
import pathlib
import shutil
import subprocess

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = os.environ.get("MINDKIT_BIN", str(ROOT / "target/release/mindkit"))
EXAMPLES = pathlib.Path(os.environ.get("MINDKIT_EXAMPLES", ROOT / "target/release/examples"))
STEPS = 32


def mindkit_logits(model_dir, ids, steps, out):
    subprocess.run([EXAMPLES / "logits", model_dir, ",".join(map(str, ids)), str(steps), out],
                   check=True)
    return load_file(str(out))


@torch.no_grad()
def hf_greedy(model, ids, steps):
    out = model(torch.tensor([ids]), use_cache=True)
    prefill, past = out.logits[0], out.past_key_values
    token, tokens, logits = int(prefill[-1].argmax()), [], []
    for _ in range(steps):
        tokens.append(token)
        out = model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits.append(out.logits[0, -1])
        token = int(logits[-1].argmax())
    return prefill, torch.stack(logits), tokens


@pytest.fixture(scope="module")
def hf_model(smollm2):
    return AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return AutoTokenizer.from_pretrained(smollm2)


def test_smollm2_logits_and_greedy_decoding_match_transformers(smollm2, hf_model, tokenizer,
                                                               tmp_path):
    ids = tokenizer("The history of the Roman Empire begins with").input_ids
    prefill, steps, tokens = hf_greedy(hf_model, ids, STEPS)
    got = mindkit_logits(smollm2, ids, STEPS, tmp_path / "logits.safetensors")
    diff = (got["prefill"] - prefill).abs().max().item()
    assert diff <= 1e-3, f"prefill logits differ by {diff}"
    assert got["generated"].tolist() == tokens
    for i in range(STEPS):
        diff = (got["steps"][i] - steps[i]).abs().max().item()
        assert diff <= 1e-3, f"decoding step {i}: logits differ by {diff}"


def test_smollm2_from_megatron_gives_the_same_logits(mindkit, smollm2, tmp_path):
    # 9 heads, 3 KV groups: TP 3 is the TP a real job would use (TP 2 cannot split them).
    ck = tmp_path / "megatron"
    mindkit("convert", "--to", "megatron", "--input", smollm2, "--output", ck, "--tp", "3",
            "--pp", "2")
    ids = [1, 504, 3575, 282, 4649, 314]
    a = mindkit_logits(smollm2, ids, 4, tmp_path / "hf.safetensors")
    b = mindkit_logits(ck, ids, 4, tmp_path / "mg.safetensors")
    for key in ("prefill", "steps", "generated"):
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe"])
def test_moe_logits_and_greedy_decoding_match_transformers(family, tmp_path):
    """Tiny mixtures of experts (a dense first layer, a gated shared expert, top-k renormalised
    or not; GLM-4.5's sigmoid routing with an expert bias, groups and scaling, a shared expert
    and RoPE on half of each head): prefill logits and KV-cached decoding steps equal
    transformers' (fp32)."""
    model_dir = ROOT / "fixtures/models" / family
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.randint(0, 200, (24,), generator=torch.Generator().manual_seed(2)).tolist()
    prefill, steps, tokens = hf_greedy(model, ids, 8)
    got = mindkit_logits(model_dir, ids, 8, tmp_path / "logits.safetensors")
    assert (got["prefill"] - prefill).abs().max().item() <= 1e-5
    assert got["generated"].tolist() == tokens
    assert (got["steps"] - steps).abs().max().item() <= 1e-5


def tiny_phimoe(out, **changes):
    """A seeded tiny Phi-3.5-MoE (transformers' PhimoeForCausalLM: LayerNorms, q/k/v, o_proj and
    lm_head biases, 4 experts routed by SparseMixer top-2), every bias and norm β random; its
    config as `changes` says."""
    from transformers import PhimoeConfig, PhimoeForCausalLM
    torch.manual_seed(21)
    settings = dict(vocab_size=256, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                    num_local_experts=4, num_experts_per_tok=2, attention_bias=True,
                    lm_head_bias=True, rope_scaling=None, tie_word_embeddings=False,
                    attention_dropout=0.0, bos_token_id=1, eos_token_id=2)
    cfg = PhimoeConfig(**(settings | changes))
    model = PhimoeForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias") or "layernorm" in name or name.startswith("model.norm"):
                p.normal_(mean=1.0 if name.endswith(".weight") else 0.0, std=0.1)
    model.save_pretrained(out, safe_serialization=True)
    return model.eval()


def test_phimoe_logits_and_decoding_match_transformers(mindkit, tmp_path):
    """A tiny Phi-3.5-MoE (LayerNorms, attention and lm_head biases, SparseMixer top-2 routing
    outside training): prefill logits and KV-cached decoding steps equal transformers' (fp32),
    from the HF directory and from its Megatron conversions over TP 2 × EP 2 (megatron-core's
    SequentialMLP names) and PP 2 with grouped experts; its Megatron checkpoints (TP × EP,
    Transformer Engine's names at TP 2, torch_dist) convert back to the HF tensors."""
    model_dir = tmp_path / "phimoe"
    model = tiny_phimoe(model_dir)
    ids = torch.randint(0, 250, (24,), generator=torch.Generator().manual_seed(3)).tolist()
    prefill, steps, tokens = hf_greedy(model, ids, 8)
    ck, grouped = tmp_path / "megatron", tmp_path / "grouped"
    mindkit("convert", "--to", "megatron", "--input", model_dir, "--output", ck, "--tp", "2",
            "--ep", "2")
    mindkit("convert", "--to", "megatron", "--input", model_dir, "--output", grouped, "--pp", "2",
            "--moe-grouped-gemm")
    for source in (model_dir, ck, grouped):
        got = mindkit_logits(source, ids, 8, tmp_path / "logits.safetensors")
        assert (got["prefill"] - prefill).abs().max().item() <= 1e-5, source
        assert got["generated"].tolist() == tokens, source
        assert (got["steps"] - steps).abs().max().item() <= 1e-5, source
    info = subprocess.run([BIN, "ckpt", "info", ck], capture_output=True, text=True,
                          check=True).stdout
    assert "norms LayerNorm" in info and "SparseMixer top-2" in info, info
    # back to the HF tensors from every layout: TP × EP, Transformer Engine's names (the norms'
    # β as layer_norm_bias), torch_dist
    te, dist = tmp_path / "te", tmp_path / "dist"
    mindkit("convert", "--to", "megatron", "--input", model_dir, "--output", te, "--tp", "2",
            "--layout", "mcore-te")
    mindkit("convert", "--to", "megatron", "--input", model_dir, "--output", dist,
            "--ckpt-format", "torch_dist")
    want = load_file(str(model_dir / "model.safetensors"))
    for source in (ck, te, dist):
        back = tmp_path / f"back_{source.name}"
        mindkit("convert", "--to", "hf", "--input", source, "--output", back)
        got = load_file(str(back / "model.safetensors"))
        assert want.keys() == got.keys(), source
        for k in want:
            assert torch.equal(want[k], got[k]), (source, k)


def test_phimoe_longrope_switches_factors_as_transformers(mindkit, tmp_path):
    """Phi-3.5-MoE's LongRoPE (`rope_scaling` longrope, scaled down: the original context 8 of 64
    positions, random short and long factors, its long and short mscales): prefill logits of a prompt within the original
    context and of one beyond it, and KV-cached decoding across the switch (the cached keys kept,
    as a forward pass keeps them), equal transformers' (fp32); `mindkit generate` decodes what
    transformers' `generate` decodes across it (the cache computed again at the switch, as its
    `prepare_inputs_for_generation` drops it); HF → Megatron → HF keeps the config and tensors."""
    gen = torch.Generator().manual_seed(3)
    scaling = {"type": "longrope", "original_max_position_embeddings": 8,
               "short_factor": (1 + torch.rand(8, generator=gen)).tolist(),
               "long_factor": (1 + 4 * torch.rand(8, generator=gen)).tolist(),
               "short_mscale": 1.1, "long_mscale": 1.3}
    model_dir = tmp_path / "phimoe"
    model = tiny_phimoe(model_dir, vocab_size=400, max_position_embeddings=64,
                        original_max_position_embeddings=8, rope_scaling=scaling)
    for n, steps in ((6, 8), (12, 4)):
        ids = torch.randint(3, 400, (n,), generator=gen).tolist()
        prefill, logits, tokens = hf_greedy(model, ids, steps)
        got = mindkit_logits(model_dir, ids, steps, tmp_path / "logits.safetensors")
        assert (got["prefill"] - prefill).abs().max().item() <= 1e-5, n
        assert got["generated"].tolist() == tokens, n
        assert (got["steps"] - logits).abs().max().item() <= 1e-5, n
    # generation across the switch, from the HF directory and its Megatron conversion
    demo = ROOT / "fixtures/models/demo"
    tok = AutoTokenizer.from_pretrained(demo)
    prompt = "the cat sat"
    ids = tok(prompt, return_tensors="pt").input_ids
    assert ids.shape[1] <= 8, ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    # the recomputed cache decides tokens here: keeping the short-factor keys would not
    assert out[0, ids.shape[1]:].tolist() != hf_greedy(model, ids[0].tolist(), 12)[2]
    want = tok.decode(out[0, ids.shape[1]:])
    ck, back = tmp_path / "megatron", tmp_path / "back"
    mindkit("convert", "--to", "megatron", "--input", model_dir, "--output", ck)
    for source in (model_dir, ck):
        text = subprocess.run([BIN, "generate", "--model", source, "--tokenizer", demo,
                               "--prompt", prompt, "--max-new-tokens", "12", "--quiet"],
                              capture_output=True, text=True, check=True).stdout
        assert text.strip() == want.strip(), (source, text, want)
    mindkit("convert", "--to", "hf", "--input", ck, "--output", back)
    assert json.loads((back / "config.json").read_text())["rope_scaling"] == model.config.rope_scaling
    want_tensors, got_tensors = (load_file(str(d / "model.safetensors")) for d in (model_dir, back))
    assert all(torch.equal(want_tensors[k], got_tensors[k]) for k in want_tensors)


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v3_direct", "deepseek_v2"])
def test_multi_latent_attention_logits_and_decoding_match_transformers(mindkit, family, tmp_path):
    """Tiny DeepSeek-V3s (multi-latent attention with a query latent and YaRN RoPE, or queries
    projected straight as DeepSeek-V2-Lite's, values narrower than the query heads; sigmoid
    routing with an expert bias, groups, a shared expert and a dense first layer): prefill
    logits and KV-cached decoding steps equal transformers' (fp32), from the HF directory and
    from its Megatron conversions over TP 2 × EP 2: megatron-core's local spec, and MindSpeed-
    LLM's deepseek_spec (the down projections in one linear_qkv on every rank; V2-Lite's on one
    TP rank, as MindSpeed-LLM runs it), and that with --mla-mm-split's up projections. deepseek_v2 is transformers' own DeepseekV2 (V2-Lite's
    routing: softmax over all experts, the top-k scaled, not renormalised)."""
    model_dir = ROOT / "fixtures/models" / family
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.randint(0, 200, (24,), generator=torch.Generator().manual_seed(2)).tolist()
    prefill, steps, tokens = hf_greedy(model, ids, 8)
    ck, fused = tmp_path / "megatron", tmp_path / "mindspeed"
    mindkit("convert", "--to", "megatron", "--input", model_dir, "--output", ck, "--tp", "2",
            "--ep", "2")
    tp = "2" if family == "deepseek_v3" else "1"
    mindkit("convert", "--to", "megatron", "--input", model_dir, "--output", fused, "--tp", tp,
            "--ep", "2", "--mla-layout", "mindspeed")
    split = tmp_path / "mm-split"
    mindkit("convert", "--to", "megatron", "--input", model_dir, "--output", split, "--tp", tp,
            "--ep", "2", "--mla-layout", "mindspeed-mm-split")
    for source in (model_dir, ck, fused, split):
        got = mindkit_logits(source, ids, 8, tmp_path / "logits.safetensors")
        assert (got["prefill"] - prefill).abs().max().item() <= 1e-5, source
        assert got["generated"].tolist() == tokens, source
        assert (got["steps"] - steps).abs().max().item() <= 1e-5, source


def test_deepseek_v2_group_limited_greedy_routing_matches_transformers(mindkit, tmp_path):
    """DeepSeek-V2's (and V2-Chat's) `topk_method: group_limited_greedy`: the routed experts
    chosen within the best 2 of 4 groups, each group scored by its best expert — not by its best
    two, as megatron-core (top-k / groups kept) and DeepSeek-V3 score them, which the test
    model's routing tells apart. A tiny transformers DeepseekV2 (16 experts, top-4, routers
    scaled up so that routing is
    decisive): prefill logits and KV-cached decoding equal transformers' from the HF directory
    and from its Megatron conversion over TP 2 × EP 2 (MindSpeed-LLM's
    `group_limited_greedy` args), which converts back to the same config and tensors."""
    from transformers import AutoConfig
    cfg = AutoConfig.from_pretrained(ROOT / "fixtures/models/deepseek_v2")
    cfg.update(dict(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                    topk_method="group_limited_greedy", routed_scaling_factor=2.0))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 1.0)
    model_dir = tmp_path / "hf"
    model.save_pretrained(model_dir)
    ids = torch.randint(0, 200, (24,), generator=torch.Generator().manual_seed(2)).tolist()
    prefill, steps, tokens = hf_greedy(model, ids, 8)
    # scored by their best two experts, the groups would route otherwise
    gate = model.model.layers[1].mlp.gate
    h = torch.randn(64, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    scores = torch.nn.functional.linear(h, gate.weight).softmax(-1).view(64, 4, 4)
    assert not torch.equal(scores.max(-1).values.topk(2).indices.sort().values,
                           scores.topk(2).values.sum(-1).topk(2).indices.sort().values)
    ck = tmp_path / "megatron"
    mindkit("convert", "--to", "megatron", "--input", model_dir, "--output", ck, "--tp", "2",
            "--ep", "2")
    for source in (model_dir, ck):
        got = mindkit_logits(source, ids, 8, tmp_path / "logits.safetensors")
        assert (got["prefill"] - prefill).abs().max().item() <= 1e-5, source
        assert got["generated"].tolist() == tokens, source
        assert (got["steps"] - steps).abs().max().item() <= 1e-5, source
    back = tmp_path / "back"
    mindkit("convert", "--to", "hf", "--input", ck, "--output", back)
    written = json.loads((back / "config.json").read_text())
    for key in ("topk_method", "n_group", "topk_group", "routed_scaling_factor",
                "num_experts_per_tok", "n_routed_experts"):
        assert written[key] == getattr(cfg, key), key
    want, got = (load_file(str(d / "model.safetensors")) for d in (model_dir, back))
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


@pytest.mark.parametrize("chat", [True, False])
def test_generate_text_equals_transformers(smollm2, hf_model, tokenizer, chat):
    prompt = "What is the capital of France? Answer in one sentence." if chat else "Once upon a time"
    if chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    else:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = hf_model.generate(ids, max_new_tokens=STEPS, do_sample=False, temperature=None,
                                top_p=None, top_k=None, eos_token_id=tokenizer.eos_token_id,
                                pad_token_id=tokenizer.eos_token_id)
    want = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    args = [BIN, "generate", "--model", smollm2, "--prompt", prompt, "--max-new-tokens",
            str(STEPS), "--quiet"] + (["--chat"] if chat else [])
    r = subprocess.run(args, capture_output=True, text=True, check=True)
    assert r.stdout == want + "\n"


@pytest.mark.parametrize("thinking", [None, "false", "true"])
def test_qwen3_chat_generation_equals_transformers(assets, tmp_path, thinking):
    """A tiny random Qwen3 (q/k norms, head_dim ≠ hidden / heads) with the real Qwen3 tokenizer:
    `mindkit generate --chat [--enable-thinking …]` renders the tokenizer's own chat template as
    transformers does (enable_thinking passed through, or left undefined) and generates the same
    greedy text as transformers' generate."""
    import tiny_qwen3
    model, tokenizer = tiny_qwen3.build(tmp_path, assets / "qwen3")
    prompt = "Name three prime numbers."
    extra = {} if thinking is None else {"enable_thinking": thinking == "true"}
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True, **extra)
    if thinking == "false":
        assert text.endswith("<think>\n\n</think>\n\n")
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False, temperature=None, top_p=None,
                             top_k=None, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.eos_token_id)
    want = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    args = [BIN, "generate", "--model", tmp_path, "--prompt", prompt, "--max-new-tokens", "12",
            "--chat", "--quiet"] + ([] if thinking is None else ["--enable-thinking", thinking])
    r = subprocess.run([str(a) for a in args], capture_output=True, text=True, check=True)
    assert r.stdout == want + "\n"


def test_longcat_flash_logits_and_decoding_match_transformers(mindkit, tmp_path):
    """A tiny LongCat-Flash (transformers' own LongcatFlash: each layer two sublayers of multi-
    latent attention with scaled latents and a dense MLP, shortcut experts on the first
    sublayer's normed input — 4 routed and 2 zero-computation ones, a softmax over all with an
    expert bias for the choice, top-2 scaled): prefill logits and KV-cached decoding steps equal
    transformers' (fp32), from the HF directory and from its Megatron conversions in MindSpeed-
    LLM's longcat_spec layout over TP 2 × PP 2 × EP 2 (grouped experts) and with --mla-mm-split;
    the Megatron checkpoint converts back to the HF bytes. With rms_norm_eps 1e-5 the latent
    norms still take transformers' 1e-6 when read from HF."""
    model_dir = ROOT / "fixtures/models/longcat_flash"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.randint(0, 200, (24,), generator=torch.Generator().manual_seed(2)).tolist()
    prefill, steps, tokens = hf_greedy(model, ids, 8)
    ck, split = tmp_path / "megatron", tmp_path / "mm-split"
    mindkit("convert", "--to", "megatron", "--input", model_dir, "--output", ck, "--tp", "2",
            "--pp", "2", "--ep", "2", "--moe-grouped-gemm")
    mindkit("convert", "--to", "megatron", "--input", model_dir, "--output", split, "--ep", "2",
            "--mla-layout", "mindspeed-mm-split")
    for source in (model_dir, ck, split):
        got = mindkit_logits(source, ids, 8, tmp_path / "logits.safetensors")
        assert (got["prefill"] - prefill).abs().max().item() <= 1e-5, source
        assert got["generated"].tolist() == tokens, source
        assert (got["steps"] - steps).abs().max().item() <= 1e-5, source
    # transformers' latent norms take eps 1e-6 whatever rms_norm_eps says; read from HF, so do mindkit's
    eps = tmp_path / "eps"
    shutil.copytree(model_dir, eps)
    cfg = json.loads((eps / "config.json").read_text())
    (eps / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": 1e-5}))
    model = AutoModelForCausalLM.from_pretrained(eps, dtype=torch.float32).eval()
    prefill, _, tokens = hf_greedy(model, ids, 1)
    got = mindkit_logits(eps, ids, 1, tmp_path / "eps.safetensors")
    assert (got["prefill"] - prefill).abs().max().item() <= 1e-5
    back = tmp_path / "back"
    mindkit("convert", "--to", "hf", "--input", ck, "--output", back)
    want, got = load_file(str(model_dir / "model.safetensors")), load_file(str(back / "model.safetensors"))
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k
