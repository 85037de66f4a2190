//! The model a run trains: the tokenizer and its ids, and the architecture from the flags or
//! from `--load` (every flag given checked against it).

use super::{fraction, positive, positive_float};
use crate::arch::{Activation, Mla, ModelConfig, Mtp, MtpLayout};
use crate::ckpt::config::{DEEPSEEK_SPEC, LONGCAT_SPEC, MINIMAX_SPEC, PLM_SPEC};
use crate::ckpt::convert::{Format, Input};
use crate::ckpt::torch::pickle::Value;
use crate::data::gpt_dataset::MaskConfig;
use crate::data::handlers::template::Template;
use crate::data::tokenizer::Tokenizer;
use crate::engine::dropout::{Rate, MAX_HEADS, MAX_LAYERS, MAX_POSITIONS};
use crate::tensor::DType;
use crate::train::args::Args;
use anyhow::{anyhow, bail, Context, Result};
use std::path::{Path, PathBuf};

/// Where the tokenizer comes from: the flag that names it (or `--load`, which carries one)
/// and its path.
pub(super) fn tokenizer_source(
    a: &Args,
    load: Option<&PathBuf>,
) -> Result<(&'static str, PathBuf)> {
    ["tokenizer-name-or-path", "tokenizer-model"]
        .into_iter()
        .find_map(|flag| a.get(flag).map(|p| (flag, PathBuf::from(p))))
        .or_else(|| load.map(|dir| ("load", dir.clone())))
        .ok_or_else(|| anyhow!("--tokenizer-name-or-path (or --tokenizer-model) is required"))
}

/// The `--tokenizer-type`s train takes.
const SUPPORTED_TYPES: [&str; 4] = [
    "HuggingFaceTokenizer",
    "PretrainedFromHF",
    "Llama2Tokenizer",
    "MagistralTokenizer",
];

/// The tokenizer and its ids, as the named `--tokenizer-type` derives them.
pub(super) fn tokenizer(a: &Args, load: Option<&PathBuf>) -> Result<(Tokenizer, MaskConfig)> {
    let (flag, path) = tokenizer_source(a, load)?;
    let kind = a.get("tokenizer-type").unwrap_or("HuggingFaceTokenizer");
    if !SUPPORTED_TYPES.contains(&kind) {
        bail!(
            "--tokenizer-type {kind} is not supported ({})",
            SUPPORTED_TYPES.join(", ")
        );
    }
    let mut tok = Tokenizer::load_as(&path, kind == "MagistralTokenizer")
        .with_context(|| format!("--{flag} {}", path.display()))?;
    if let Some(name) = a.get("prompt-type") {
        // MindSpeed-LLM's fix_model_tokenizer: the template's stop word becomes eos (the EOD).
        let template = Template::load(name, a.get("prompt-type-path").map(Path::new))
            .map_err(|e| anyhow!("--prompt-type {name}: {e}"))?;
        template
            .fix_tokenizer(&mut tok)
            .map_err(|e| anyhow!("--prompt-type {name}: {e}"))?;
    }
    let eod = tok.eos().ok_or_else(|| {
        anyhow!(
            "the tokenizer {} defines no eos token, Megatron's EOD",
            path.display()
        )
    })?;
    // MindSpeed-LLM's PretrainedFromHF falls back to eos for a missing pad (its training
    // tokenizer.py); Megatron's HuggingFaceTokenizer reports none, which GPTDataset treats as -1.
    // MagistralTokenizer's pad is tekken's `<pad>` (TokenizerAdaptor.pad: pad_token_id).
    let pad = match kind {
        "PretrainedFromHF" | "MagistralTokenizer" => Some(tok.pad().unwrap_or(eod)),
        _ => tok.pad(),
    };
    let masks = MaskConfig {
        eod,
        pad,
        eod_mask_loss: a.has("eod-mask-loss"),
        reset_attention_mask: a.has("reset-attention-mask"),
    };
    Ok((tok, masks))
}

/// Megatron `args` synthesised from the architecture flags, for the one args reader.
fn architecture_args(a: &Args) -> Result<Vec<(String, Value)>> {
    let mut out = Vec::new();
    for (flag, key) in [
        ("num-layers", "num_layers"),
        ("hidden-size", "hidden_size"),
        ("ffn-hidden-size", "ffn_hidden_size"),
        ("num-attention-heads", "num_attention_heads"),
        ("num-query-groups", "num_query_groups"),
        ("kv-channels", "kv_channels"),
        ("max-position-embeddings", "max_position_embeddings"),
        ("q-lora-rank", "q_lora_rank"),
        ("kv-lora-rank", "kv_lora_rank"),
        ("qk-head-dim", "qk_head_dim"),
        ("qk-pos-emb-head-dim", "qk_pos_emb_head_dim"),
        ("v-head-dim", "v_head_dim"),
        ("mtp-num-layers", "mtp_num_layers"),
        ("index-n-heads", "index_n_heads"),
        ("index-head-dim", "index_head_dim"),
        ("index-topk", "index_topk"),
        ("index-topk-freq", "index_topk_freq"),
        ("index-skip-topk-offset", "index_skip_topk_offset"),
    ] {
        if let Some(v) = positive(a, flag)? {
            out.push((key.to_string(), Value::Int(v as i64)));
        }
    }
    for (flag, key) in [
        ("rotary-base", "rotary_base"),
        ("rotary-percent", "rotary_percent"),
        ("norm-epsilon", "norm_epsilon"),
        ("rope-scaling-factor", "rope_scaling_factor"),
        ("low-freq-factor", "low_freq_factor"),
        ("high-freq-factor", "high_freq_factor"),
        (
            "original-max-position-embeddings",
            "original_max_position_embeddings",
        ),
        ("rope-scaling-mscale", "rope_scaling_mscale"),
        ("rope-scaling-mscale-all-dim", "rope_scaling_mscale_all_dim"),
        (
            "rope-scaling-original-max-position-embeddings",
            "rope_scaling_original_max_position_embeddings",
        ),
        ("beta-fast", "beta_fast"),
        ("beta-slow", "beta_slow"),
        ("long-mscale", "long_mscale"),
        ("short-mscale", "short_mscale"),
    ] {
        if let Some(v) = positive_float(a, flag)? {
            out.push((key.to_string(), Value::Float(v)));
        }
    }
    for (flag, key) in [
        ("group-query-attention", "group_query_attention"),
        ("add-qkv-bias", "add_qkv_bias"),
        ("add-dense-bias", "add_dense_bias"),
        ("add-output-layer-bias", "add_output_layer_bias"),
        (
            "untie-embeddings-and-output-weights",
            "untie_embeddings_and_output_weights",
        ),
        ("use-rope-scaling", "use_rope_scaling"),
        ("qk-layernorm", "qk_layernorm"),
        ("multi-latent-attention", "multi_latent_attention"),
        ("enable-mla-scale-q-lora", "enable_mla_scale_q_lora"),
        ("enable-mla-scale-kv-lora", "enable_mla_scale_kv_lora"),
        ("mla-mm-split", "mla_mm_split"),
        ("enable-dsa-indexer", "enable_dsa_indexer"),
        ("apply-rope-no-in-complex", "apply_rope_no_in_complex"),
        ("enable-mla-absorb", "enable_mla_absorb"),
        ("use-sparse-flash-attn", "use_sparse_flash_attn"),
    ] {
        out.push((key.to_string(), Value::Bool(a.has(flag))));
    }
    // the MLP's activation only as given: a --load checkpoint's stands otherwise
    for (flag, key) in [("swiglu", "swiglu"), ("squared-relu", "squared_relu")] {
        if a.has(flag) {
            out.push((key.to_string(), Value::Bool(true)));
        }
    }
    if let Some(t) = a.get("fc-type") {
        out.push(("fc_type".into(), Value::Str(t.to_string())));
    }
    if let Some(n) = a.get("normalization") {
        out.push(("normalization".into(), Value::Str(n.to_string())));
    }
    if let Some(t) = a.get("rope-scaling-type") {
        out.push(("rope_scaling_type".into(), Value::Str(t.to_string())));
    }
    if let Some(t) = a.get("longrope-freqs-type") {
        out.push(("longrope_freqs_type".into(), Value::Str(t.to_string())));
    }
    for (flag, key) in [
        ("long-factor", "long_factor"),
        ("short-factor", "short_factor"),
    ] {
        if let Some(list) = a.get(flag) {
            out.push((key.into(), comma_floats(flag, list)?));
        }
    }
    if let Some(spec) = a.list("spec") {
        let spec = spec.iter().map(|s| Value::Str(s.clone())).collect();
        out.push(("spec".into(), Value::List(spec)));
    }
    out.extend(super::moe::moe_args(a)?);
    Ok(out)
}

/// MindSpeed-LLM's comma-separated list of numbers (`--long-factor 1.08,1.11,…`), as the list
/// of floats its `pre_validate_args` makes of it.
fn comma_floats(flag: &str, list: &str) -> Result<Value> {
    let parsed = (list.split(','))
        .map(|x| match x.trim().parse::<f64>() {
            Ok(v) if v.is_finite() && v > 0.0 => Ok(Value::Float(v)),
            _ => Err(anyhow!("--{flag}: {x:?} is not a positive number")),
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Value::List(parsed))
}

/// Refuse architecture flags outside the LLaMA family.
fn check_family_flags(a: &Args) -> Result<()> {
    check_spec(a)?;
    if let Some(n) = a
        .get("normalization")
        .filter(|n| !["RMSNorm", "LayerNorm"].contains(n))
    {
        bail!("--normalization {n}: RMSNorm and LayerNorm are implemented");
    }
    if let Some(p) = a.get("position-embedding-type").filter(|p| *p != "rope") {
        bail!("--position-embedding-type {p}: only rope is implemented");
    }
    if let Some(p) = fraction(a, "rotary-percent")?.filter(|p| *p <= 0.0) {
        bail!("--rotary-percent {p}: must be above 0");
    }
    Ok(())
}

/// `--hidden-dropout` and `--attention-dropout` (Megatron's defaults: 0.1 each), `None` for
/// 0, for a model of `model`'s layers and heads trained on `seq_length` positions (the
/// bounds of the masks' keys, [`crate::engine::dropout`], which the routers' draws
/// `router_noise` share).
pub(super) fn dropout_rates(
    a: &Args,
    model: &ModelConfig,
    seq_length: usize,
    router_noise: (Option<f32>, bool),
) -> Result<(Option<Rate>, Option<Rate>)> {
    let mut rates = [None; 2];
    for (rate, flag) in rates
        .iter_mut()
        .zip(["hidden-dropout", "attention-dropout"])
    {
        let p = fraction(a, flag)?.unwrap_or(0.1);
        if p == 1.0 {
            bail!("--{flag} 1: dropout would drop every element (1/(1 − p) is infinite)");
        }
        *rate = Rate::new(p);
    }
    let [hidden, attention] = rates;
    let over = [
        (seq_length, MAX_POSITIONS, "--seq-length"),
        (model.heads, MAX_HEADS, "attention heads"),
        (model.layers, MAX_LAYERS, "layers"),
    ]
    .into_iter()
    .find(|(n, max, _)| n > max);
    if let (Some((n, max, what)), true) = (over, hidden.or(attention).is_some()) {
        bail!("dropout's masks key at most {max} {what}, not {n}: pass --hidden-dropout 0 --attention-dropout 0");
    }
    let routed = router_noise.0.is_some() || router_noise.1;
    if let (Some((n, max, what)), true) = (over, routed) {
        bail!("the MoE routers' random draws key at most {max} {what}, not {n}");
    }
    Ok((hidden, attention))
}

/// The layer specs whose architecture mindkit builds: `(module, function)`.
const SPECS: &[(&str, &str)] = &[
    ("mindspeed_llm.tasks.models.spec.qwen3_spec", "layer_spec"),
    BAILING_SPEC,
    PHI35_MOE_SPEC,
    (MINIMAX_SPEC[0], MINIMAX_SPEC[1]),
    (DEEPSEEK_SPEC[0], DEEPSEEK_SPEC[1]),
    (LONGCAT_SPEC[0], LONGCAT_SPEC[1]),
    (PLM_SPEC[0], PLM_SPEC[1]),
];

/// MindSpeed-LLM's Ling (Bailing) spec: the local spec whatever `--transformer-impl` says.
const BAILING_SPEC: (&str, &str) = ("mindspeed_llm.tasks.models.spec.bailing_spec", "layer_spec");

/// MindSpeed-LLM's Phi-3.5-MoE spec: megatron-core's local modules, its norms `PTNorm` (torch's
/// LayerNorm or RMSNorm as `--normalization` says), its attention `SelfAttentionWithDenseBias`
/// (linear_proj's bias as `--add-dense-bias` says), whatever `--transformer-impl` says
/// (mindspeed_llm/tasks/models/spec/phi35_moe_spec.py).
const PHI35_MOE_SPEC: (&str, &str) = (
    "mindspeed_llm.tasks.models.spec.phi35_moe_spec",
    "layer_spec",
);

/// Whether `--spec` names a spec that builds megatron-core's local modules (and so local
/// checkpoint names) even with `--transformer-impl transformer_engine`.
pub(super) fn spec_is_local_only(a: &Args) -> bool {
    a.list("spec").is_some_and(|s| {
        [
            BAILING_SPEC,
            PHI35_MOE_SPEC,
            (MINIMAX_SPEC[0], MINIMAX_SPEC[1]),
            (PLM_SPEC[0], PLM_SPEC[1]),
        ]
        .iter()
        .any(|(m, f)| s == [m.to_string(), f.to_string()])
    })
}

/// `--spec MODULE FUNCTION` (Megatron's custom layer spec): accepted where it builds what
/// mindkit builds — MindSpeed-LLM's qwen3, bailing, phi35_moe and minimax specs: the local spec (TE's with
/// qwen3's under `--transformer-impl transformer_engine`), with q/k norms as `--qk-layernorm`
/// says (minimax's over all heads, `MinimaxAttention`) and the MoE layer of `--num-experts`
/// (mindspeed_llm/tasks/models/spec/qwen3_spec.py, bailing_spec.py, minimax_spec.py) —, its
/// deepseek and longcat specs (multi-latent attention's down projections fused; longcat's
/// layers paired, `crate::arch::ModelConfig::paired`) with the local implementation, its plm
/// spec (the deepseek spec's attention, the key-value latent always normed, a dense MLP), refused
/// otherwise.
fn check_spec(a: &Args) -> Result<()> {
    let Some(spec) = a.list("spec") else {
        return Ok(());
    };
    let known = |(m, f): &(&str, &str)| spec == [m.to_string(), f.to_string()];
    let multi_latent = [DEEPSEEK_SPEC, LONGCAT_SPEC, PLM_SPEC]
        .iter()
        .any(|s| spec == s);
    if multi_latent && !a.has("multi-latent-attention") {
        bail!(
            "--spec {}: its attention is multi-latent: pass --multi-latent-attention and its shape",
            spec.join(" ")
        );
    }
    let local_only = spec == DEEPSEEK_SPEC || spec == LONGCAT_SPEC;
    if local_only && a.get("transformer-impl").is_some_and(|t| t != "local") {
        bail!(
            "--spec {}: built with --transformer-impl local (as every shipped script runs it)",
            spec.join(" ")
        );
    }
    if !SPECS.iter().any(known) {
        let names: Vec<String> = SPECS.iter().map(|(m, f)| format!("{m} {f}")).collect();
        bail!(
            "--spec {}: a layer spec mindkit does not build (known: {})",
            spec.join(" "),
            names.join("; ")
        );
    }
    Ok(())
}

/// The architecture: from the flags, or from `--load` with every given flag checked.
pub(super) fn model_config(
    a: &Args,
    input: Option<&Input>,
    tokenizer_vocab: usize,
) -> Result<ModelConfig> {
    check_family_flags(a)?;
    let flags = architecture_args(a)?;
    let Some(input) = input else {
        if !a.has("swiglu") && !a.has("squared-relu") {
            bail!(
                "--swiglu is required (or --squared-relu): Megatron's default GeLU MLP is not \
                 built"
            );
        }
        if !a.has("disable-bias-linear") {
            bail!(
                "--disable-bias-linear is required: Megatron adds biases to every linear layer \
                 by default, which no LLaMA-family model has (--add-qkv-bias adds Qwen2's)"
            );
        }
        let mut args = flags;
        if !args.iter().any(|(k, _)| k == "ffn_hidden_size") {
            // Megatron's defaults (validate_args): 4h, SwiGLU's shrunk to keep its size.
            let h = positive(a, "hidden-size")?
                .ok_or_else(|| anyhow!("--hidden-size is required without --load"))?;
            let ffn = match a.has("swiglu") {
                true => ((4 * h * 2) as f64 / 3.0 / 64.0) as usize * 64,
                false => 4 * h,
            };
            args.push(("ffn_hidden_size".into(), Value::Int(ffn as i64)));
        }
        args.push(("vocab_size".into(), Value::Int(tokenizer_vocab as i64)));
        let mut cfg = ModelConfig::from_megatron_args(&args, None, DType::F32, tokenizer_vocab)
            .context("the architecture flags (without --load every one of --num-layers --hidden-size --num-attention-heads is needed)")?;
        cfg.mtp = mtp(a, None)?;
        return Ok(cfg);
    };
    let mut cfg = input.cfg.clone();
    cfg.mtp = mtp(a, Some(input))?;
    // training is Megatron's: every norm takes --norm-epsilon, an HF model's latent norms too
    cfg.latent_norm_eps = None;
    let checks: [(&str, usize); 6] = [
        ("num-layers", cfg.stored_layers()),
        ("hidden-size", cfg.hidden),
        ("ffn-hidden-size", cfg.ffn),
        ("num-attention-heads", cfg.heads),
        ("kv-channels", cfg.head_dim),
        ("max-position-embeddings", cfg.max_positions),
    ];
    for (flag, have) in checks {
        // multi-latent attention's heads are shaped by its own flags (as megatron-core's MLA)
        let shapes_nothing = flag == "kv-channels" && cfg.mla.is_some();
        if let Some(v) = positive(a, flag)?.filter(|_| !shapes_nothing) {
            if v != have && flag != "max-position-embeddings" {
                bail!("--{flag} {v} does not match the --load checkpoint's {have}");
            }
        }
    }
    if a.has("group-query-attention") && cfg.mla.is_none() {
        if let Some(g) = positive(a, "num-query-groups")?.filter(|&g| g != cfg.groups) {
            bail!(
                "--num-query-groups {g} does not match the --load checkpoint's {}",
                cfg.groups
            );
        }
    }
    if a.has("untie-embeddings-and-output-weights") == cfg.tied && has_any_architecture(a) {
        bail!(
            "--untie-embeddings-and-output-weights is {}given, but the --load checkpoint's output layer is {}",
            if cfg.tied { "" } else { "not " },
            if cfg.tied { "tied to the embedding" } else { "separate" }
        );
    }
    check_rope_and_norm(a, &flags, &cfg)?;
    let flagged_act = [Activation::SwiGlu, Activation::SquaredRelu]
        .into_iter()
        .find(|act| a.has(&act.flag()[2..]));
    if let Some(act) = flagged_act.filter(|&act| act != cfg.activation) {
        bail!(
            "{} is given, but the --load checkpoint's MLP is {}'s",
            act.flag(),
            cfg.activation.flag()
        );
    }
    if a.has("add-qkv-bias") && !cfg.qkv_bias {
        bail!("--add-qkv-bias is given, but the --load checkpoint has no q/k/v biases");
    }
    let flagged = ModelConfig::from_megatron_args(
        &flags_with_defaults(&flags, &cfg),
        None,
        cfg.dtype,
        cfg.vocab,
    );
    // why the flags make no model, for the mismatches below
    let unmade = match &flagged {
        Err(e) => format!(" ({e:#})"),
        Ok(_) => String::new(),
    };
    let flagged = flagged.ok();
    let flagged_moe = flagged.as_ref().and_then(|c| c.moe.clone());
    super::moe::check_load(
        flagged_moe.as_ref(),
        cfg.moe.as_ref(),
        has_any_architecture(a),
    )?;
    let flagged_mla = flagged.as_ref().and_then(|c| c.mla);
    if let (Format::Hf, Some(f), Some(m)) = (input.format, flagged_mla, &mut cfg.mla) {
        // an HF --load takes the layout the flags name, as MindSpeed-LLM's conversion of it
        // writes it (--enable-hf2mg-convert)
        *m = Mla {
            fused_down: f.fused_down,
            split_up: f.split_up,
            ..*m
        };
    }
    if (a.has("multi-latent-attention") || has_any_architecture(a)) && flagged_mla != cfg.mla {
        bail!(
            "the multi-latent attention flags give {flagged_mla:?}{unmade}, the --load checkpoint has {:?}",
            cfg.mla
        );
    }
    // MindSpeed-LLM's plm spec norms the key-value latent whatever --qk-layernorm says
    let qk_norm = a.has("qk-layernorm") || a.list("spec").is_some_and(|s| s == PLM_SPEC);
    if qk_norm != cfg.qk_norm && (qk_norm || has_any_architecture(a)) {
        bail!(
            "--qk-layernorm is {}given, but the --load checkpoint {} q/k layernorms",
            if cfg.qk_norm { "not " } else { "" },
            if cfg.qk_norm { "has" } else { "has no" }
        );
    }
    let paired = (cfg.paired, a.has("spec") || has_any_architecture(a));
    same_spec(
        a,
        LONGCAT_SPEC,
        paired,
        (
            "layers",
            "LongCat-Flash's pairs (MindSpeed-LLM's longcat_spec)",
            "not LongCat-Flash's pairs (pass no longcat_spec)",
        ),
    )?;
    let per_layer = (cfg.qk_norm_per_layer, a.has("qk-layernorm"));
    same_spec(
        a,
        MINIMAX_SPEC,
        per_layer,
        (
            "q/k layernorms",
            "MindSpeed-LLM's MiniMax spec's, over all heads (its args.spec)",
            "per head (no MiniMax args.spec)",
        ),
    )?;
    Ok(cfg)
}

/// Whether `--spec` names `spec` exactly when the `--load` checkpoint `has` what it builds
/// (checked when `asked`), else an error saying what the checkpoint's `what.0` are: `what.1`
/// or `what.2`.
fn same_spec(
    a: &Args,
    spec: [&str; 2],
    (has, asked): (bool, bool),
    what: (&str, &str, &str),
) -> Result<()> {
    let named = a.list("spec").is_some_and(|s| s == spec);
    if asked && named != has {
        bail!(
            "--spec {}: the --load checkpoint's {} are {}",
            a.list("spec").map_or("(none)".into(), |s| s.join(" ")),
            what.0,
            if has { what.1 } else { what.2 }
        );
    }
    Ok(())
}

/// Multi-token prediction from `--mtp-num-layers` and mindkit's `--mtp-layout` (default
/// MindSpeed-LLM's), checked against a `--load` checkpoint: a Megatron checkpoint's depths and
/// layout are what Megatron's strict load of it needs; of an HF directory's depths as many as
/// the flag asks are trained (MindSpeed-LLM's converters convert `--mtp-num-layers` depths).
fn mtp(a: &Args, input: Option<&Input>) -> Result<Option<Mtp>> {
    let depths = positive(a, "mtp-num-layers")?.unwrap_or(0);
    let layout = match a.get("mtp-layout") {
        None => None,
        Some("mindspeed") => Some(MtpLayout::Mindspeed),
        Some("mcore") => Some(MtpLayout::Mcore),
        Some(other) => bail!("--mtp-layout {other}: mindspeed or mcore"),
    };
    let have = input.and_then(|i| i.cfg.mtp);
    let hf = input.is_some_and(|i| i.format == Format::Hf);
    let from_checkpoint = have.filter(|_| !hf);
    if let Some(input) = input.filter(|_| !hf || depths > 0) {
        let (held, layout_held) = (input.cfg.mtp_depths(), have.map(|m| m.layout));
        let enough = if hf { held >= depths } else { held == depths };
        if !enough {
            bail!(
                "--mtp-num-layers {depths}: the --load checkpoint has {held} multi-token \
                 prediction depth(s){}",
                if hf { "" } else { " (pass as many)" }
            );
        }
        if let (Some(want), Some(held), false) = (layout, layout_held, hf) {
            if want != held {
                bail!(
                    "--mtp-layout {}: the --load checkpoint's multi-token prediction is in \
                     the {} layout (convert it with `mindkit convert --mtp-layout {}`)",
                    want.name(),
                    held.name(),
                    want.name()
                );
            }
        }
    }
    if depths == 0 {
        if layout.is_some() {
            bail!("--mtp-layout needs --mtp-num-layers");
        }
        return Ok(None);
    }
    let layout = layout
        .or(from_checkpoint.map(|m| m.layout))
        .unwrap_or(MtpLayout::Mindspeed);
    Ok(Some(Mtp { depths, layout }))
}

/// The flags that shape RoPE and the norms, checked against the `--load` checkpoint's values:
/// Megatron builds its model from the command line and would train with them, where mindkit
/// takes the checkpoint's, so a disagreement is refused rather than ignored.
fn check_rope_and_norm(a: &Args, flags: &[(String, Value)], cfg: &ModelConfig) -> Result<()> {
    // Equal up to the rounding of a value stored as f32 or printed in decimal.
    let same = |x: f64, y: f64| (x - y).abs() <= 1e-6 * x.abs().max(y.abs());
    for (flag, have) in [
        ("norm-epsilon", cfg.norm_eps),
        ("rotary-base", cfg.rope_theta),
        (
            "rotary-percent",
            cfg.rotary_dim as f64 / cfg.head_dim as f64,
        ),
    ] {
        if let Some(v) = a.parse_value::<f64>(flag)?.filter(|&v| !same(v, have)) {
            bail!("--{flag} {v} does not match the --load checkpoint's {have}");
        }
    }
    let scaling_flags = [
        "use-rope-scaling",
        "rope-scaling-type",
        "rope-scaling-factor",
        "low-freq-factor",
        "high-freq-factor",
        "original-max-position-embeddings",
        "rope-scaling-mscale",
        "rope-scaling-mscale-all-dim",
        "rope-scaling-original-max-position-embeddings",
        "beta-fast",
        "beta-slow",
        "longrope-freqs-type",
        "long-factor",
        "short-factor",
        "long-mscale",
        "short-mscale",
    ];
    if !scaling_flags.iter().any(|f| a.has(f)) {
        return Ok(());
    }
    let wanted = crate::ckpt::config::rope_scaling_from_args(flags)?;
    let numbers = |r: &Option<serde_json::Value>| -> Option<(String, Vec<f64>)> {
        let r = r.as_ref()?;
        let kind = r.get("rope_type").or_else(|| r.get("type"))?.as_str()?;
        let keys = [
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "original_max_position_embeddings",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
        ];
        let values = keys.iter().map(|k| r.get(k).and_then(|v| v.as_f64()));
        Some((
            kind.to_string(),
            values.map(|v| v.unwrap_or(f64::NAN)).collect(),
        ))
    };
    let (w, h) = (numbers(&wanted), numbers(&cfg.rope_scaling));
    let longrope = |r: &Option<serde_json::Value>| {
        r.as_ref().and_then(|r| r.get("rope_type")) == Some(&serde_json::json!("longrope"))
    };
    let agree = match (&w, &h) {
        // LongRoPE's factor lists: all of it alike
        _ if longrope(&wanted) || longrope(&cfg.rope_scaling) => wanted == cfg.rope_scaling,
        (None, None) => true,
        (Some((wk, wv)), Some((hk, hv))) => {
            wk == hk
                && wv
                    .iter()
                    .zip(hv)
                    .all(|(&x, &y)| same(x, y) || (x.is_nan() && y.is_nan()))
        }
        _ => false,
    };
    if !agree {
        let describe = |r: &Option<serde_json::Value>| match r {
            Some(r) => r.to_string(),
            None => "none".into(),
        };
        bail!(
            "RoPE scaling: the flags ({}) give {}, the --load checkpoint has {}",
            scaling_flags
                .iter()
                .filter(|f| a.has(f))
                .map(|f| format!("--{f}"))
                .collect::<Vec<_>>()
                .join(" "),
            describe(&wanted),
            describe(&cfg.rope_scaling)
        );
    }
    Ok(())
}

/// The flags' args completed with the `--load` checkpoint's numbers the MoE reader needs
/// (layers, the dense FFN), so that the flags' experts can be built and compared.
fn flags_with_defaults(flags: &[(String, Value)], cfg: &ModelConfig) -> Vec<(String, Value)> {
    let mut args = flags.to_vec();
    for (key, v) in [
        ("num_layers", cfg.stored_layers()),
        ("hidden_size", cfg.hidden),
        ("num_attention_heads", cfg.heads),
        ("ffn_hidden_size", cfg.ffn),
    ] {
        if !args.iter().any(|(k, _)| k == key) {
            args.push((key.into(), Value::Int(v as i64)));
        }
    }
    args
}

/// Whether the command line describes the architecture at all (then it must agree with
/// `--load`; a bare `--load` takes everything from the checkpoint).
fn has_any_architecture(a: &Args) -> bool {
    ["num-layers", "hidden-size", "num-attention-heads"]
        .iter()
        .any(|f| a.has(f))
}

/// MindSpeed-LLM's `--model-type-hf` names (llama2, qwen25, …) as mindkit's family names.
pub(super) fn family_name(model_type: &str) -> &str {
    match model_type {
        t if t.starts_with("llama") => "llama",
        "qwen3" => "qwen3",
        // qwen3-moe, qwen3-next: families of their own.
        t if t.starts_with("qwen3") => t,
        t if t.starts_with("qwen") => "qwen2",
        // Magistral is a Mistral model (HF model_type "mistral").
        t if t.starts_with("mistral") || t == "magistral" => "mistral",
        t if t.starts_with("internlm") => "internlm",
        t if t.starts_with("baichuan") => "baichuan",
        t if t.starts_with("aquila") => "aquila",
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::family_name;

    #[test]
    fn mindspeed_model_types_name_mindkit_families() {
        for (model_type, family) in [
            ("llama2", "llama"),
            ("qwen25", "qwen2"),
            ("qwen3", "qwen3"),
            ("qwen3-moe", "qwen3-moe"),
            ("magistral", "mistral"),
            ("seed-oss", "seed-oss"),
        ] {
            assert_eq!(family_name(model_type), family, "{model_type}");
        }
    }
}
