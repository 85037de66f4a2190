//! Multi-latent attention and YaRN RoPE as `config.json` (transformers 4.57's
//! `DeepseekV3Config`: `q_lora_rank`, `kv_lora_rank`, `qk_nope_head_dim`, `qk_rope_head_dim`,
//! `v_head_dim`; `rope_scaling` of type `yarn`) and Megatron args spell them (megatron-core
//! 0.15's `--multi-latent-attention`, `--q-lora-rank`, `--kv-lora-rank`, `--qk-head-dim`,
//! `--qk-pos-emb-head-dim`, `--v-head-dim`; MindSpeed-LLM's `--rope-scaling-type yarn` with
//! `--rope-scaling-factor`, `--rope-scaling-mscale`, `--rope-scaling-mscale-all-dim`,
//! `--rope-scaling-original-max-position-embeddings`, `--beta-fast`, `--beta-slow`).

use super::{arg_bool, arg_count, arg_float, json_count, json_required_count, ConfigError};
use super::{FieldResult, Value};
use crate::arch::family::Family;
use crate::arch::{Dsa, Mla, ModelConfig};
use serde_json::{json, Value as Json};

/// The multi-latent attention `config.json` gives a family that has it.
pub(super) fn mla_from_hf(cfg: &Json, family: &Family) -> FieldResult<Option<Mla>> {
    if !family.mla {
        return Ok(None);
    }
    // LongCat-Flash's attention always has a query latent and scales both latents
    let q_lora_rank = match family.paired {
        true => Some(json_required_count(cfg, "q_lora_rank")?),
        false => json_count(cfg, "q_lora_rank")?,
    };
    Ok(Some(Mla {
        q_lora_rank,
        kv_lora_rank: json_required_count(cfg, "kv_lora_rank")?,
        qk_head_dim: json_required_count(cfg, "qk_nope_head_dim")?,
        rope_dim: even_rope_dim(
            json_required_count(cfg, "qk_rope_head_dim")?,
            "qk_rope_head_dim",
        )?,
        v_head_dim: json_required_count(cfg, "v_head_dim")?,
        // and MindSpeed-LLM's longcat_spec fuses the down projections
        fused_down: family.paired,
        split_up: false,
        scale_latents: [family.paired; 2],
        dsa: None,
    }))
}

/// RoPE rotates pairs of dimensions: an odd count is refused.
fn even_rope_dim(d: usize, field: &str) -> FieldResult<usize> {
    if d % 2 == 1 {
        return Err(ConfigError::OutOfRange {
            field: field.into(),
            got: d.to_string(),
            expected: "even: RoPE rotates pairs of dimensions",
        });
    }
    Ok(d)
}

/// The multi-latent attention of Megatron args (`None` without `multi_latent_attention`).
pub(super) fn mla_from_args(args: &[(String, Value)]) -> FieldResult<Option<Mla>> {
    if !arg_bool(args, "multi_latent_attention")?.unwrap_or(false) {
        return Ok(None);
    }
    // megatron-core MLATransformerConfig's defaults
    let count = |name: &str, default: usize| Ok(arg_count(args, name)?.unwrap_or(default));
    let (fused_down, split_up) = mla_layout_of(args)?;
    Ok(Some(Mla {
        q_lora_rank: arg_count(args, "q_lora_rank")?,
        kv_lora_rank: count("kv_lora_rank", 32)?,
        qk_head_dim: count("qk_head_dim", 128)?,
        rope_dim: even_rope_dim(
            count("qk_pos_emb_head_dim", 64)?,
            "args.qk_pos_emb_head_dim",
        )?,
        v_head_dim: count("v_head_dim", 128)?,
        fused_down,
        split_up,
        scale_latents: [
            arg_bool(args, "enable_mla_scale_q_lora")?.unwrap_or(false),
            arg_bool(args, "enable_mla_scale_kv_lora")?.unwrap_or(false),
        ],
        dsa: dsa_from_args(args)?,
    }))
}

/// DeepSeek sparse attention in Megatron args (MindSpeed-LLM's dsa_indexer_feature.py flags and
/// defaults), `None` without `enable_dsa_indexer`.
pub(super) fn dsa_from_args(args: &[(String, Value)]) -> FieldResult<Option<Dsa>> {
    let on = |name: &str| Ok::<_, ConfigError>(arg_bool(args, name)?.unwrap_or(false));
    if !on("enable_dsa_indexer")? {
        return Ok(None);
    }
    let refused = [
        (
            "kv_compress",
            "False: DeepSeek-V4's compressed indexer is not built",
        ),
        (
            "index_topk_pattern",
            "absent: the layers' pattern is not built (--index-topk-freq is)",
        ),
    ];
    for (field, expected) in refused {
        if !matches!(
            super::arg(args, field),
            None | Some(Value::None) | Some(Value::Bool(false))
        ) {
            return Err(ConfigError::OutOfRange {
                field: format!("args.{field}"),
                got: "set".into(),
                expected,
            });
        }
    }
    let count = |name: &str, default: usize| {
        Ok::<_, ConfigError>(arg_count(args, name)?.unwrap_or(default))
    };
    Ok(Some(Dsa {
        heads: count("index_n_heads", 64)?,
        head_dim: count("index_head_dim", 128)?,
        topk: count("index_topk", 2048)?,
        freq: count("index_topk_freq", 1)?,
        offset: count("index_skip_topk_offset", 2)?,
        rope_pairs_adjacent: on("apply_rope_no_in_complex")?,
        normed_query: on("enable_mla_absorb")?
            && on("use_sparse_flash_attn")?
            && on("mla_mm_split")?,
    }))
}

/// Whether `args.spec` is MindSpeed-LLM's PLM spec ([`super::PLM_SPEC`]), with what that spec
/// builds: multi-latent attention without a query latent or split up projections, and no
/// experts (its MLP spec is dense).
pub(super) fn plm_spec_of(args: &[(String, Value)]) -> FieldResult<bool> {
    if !super::spec_is(args, super::PLM_SPEC) {
        return Ok(false);
    }
    let refuse = |field: &str, expected| ConfigError::OutOfRange {
        field: format!("args.{field}"),
        got: "otherwise".into(),
        expected,
    };
    let multi_latent = arg_bool(args, "multi_latent_attention")?.unwrap_or(false);
    if !multi_latent {
        return Err(refuse(
            "multi_latent_attention",
            "True under MindSpeed-LLM's plm_spec (its attention is multi-latent)",
        ));
    }
    let absent = [
        (
            "q_lora_rank",
            "absent under plm_spec (its attention has no query latent)",
        ),
        ("num_experts", "absent under plm_spec (its MLP is dense)"),
    ];
    for (field, expected) in absent {
        if !matches!(super::arg(args, field), None | Some(Value::None)) {
            return Err(refuse(field, expected));
        }
    }
    if arg_bool(args, "mla_mm_split")?.unwrap_or(false) {
        return Err(refuse(
            "mla_mm_split",
            "False under plm_spec (its attention's up projections are whole)",
        ));
    }
    Ok(true)
}

/// The layout of MindSpeed-LLM's multi-latent attention in Megatron args: whether the down
/// projections are fused ([`Mla::fused_down`]: its DeepSeek spec) and the up projections split
/// ([`Mla::split_up`]: `mla_mm_split`, which only that spec's attention knows).
pub(super) fn mla_layout_of(args: &[(String, Value)]) -> FieldResult<(bool, bool)> {
    let fused_down = super::spec_is(args, super::DEEPSEEK_SPEC)
        || super::longcat_of(args)?
        || plm_spec_of(args)?;
    let split_up = arg_bool(args, "mla_mm_split")?.unwrap_or(false);
    if split_up && !fused_down {
        return Err(ConfigError::OutOfRange {
            field: "args.mla_mm_split".into(),
            got: "true".into(),
            expected: "false unless args.spec is MindSpeed-LLM's deepseek_spec or \
                       longcat_spec (only their multi-latent attention splits the up \
                       projections)",
        });
    }
    Ok((fused_down, split_up))
}

/// The args of `cfg`'s multi-latent attention (none without it).
pub(super) fn mla_args(cfg: &ModelConfig) -> Vec<(&'static str, Value)> {
    let Some(m) = &cfg.mla else {
        return vec![];
    };
    let int = |v: usize| Value::Int(v as i64);
    let mut args = vec![
        ("multi_latent_attention", Value::Bool(true)),
        // megatron-core's MLA defaults to YaRN: plain RoPE is said (yarn_args overrides it)
        ("rope_type", Value::Str("rope".into())),
        ("q_lora_rank", m.q_lora_rank.map_or(Value::None, int)),
        ("kv_lora_rank", int(m.kv_lora_rank)),
        ("qk_head_dim", int(m.qk_head_dim)),
        ("qk_pos_emb_head_dim", int(m.rope_dim)),
        ("v_head_dim", int(m.v_head_dim)),
        ("enable_mla_scale_q_lora", Value::Bool(m.scale_latents[0])),
        ("enable_mla_scale_kv_lora", Value::Bool(m.scale_latents[1])),
        ("mla_mm_split", Value::Bool(m.split_up)),
    ];
    if let Some(d) = &m.dsa {
        args.extend([
            ("enable_dsa_indexer", Value::Bool(true)),
            ("index_n_heads", int(d.heads)),
            ("index_head_dim", int(d.head_dim)),
            ("index_topk", int(d.topk)),
            ("index_topk_freq", int(d.freq)),
            ("index_skip_topk_offset", int(d.offset)),
            (
                "apply_rope_no_in_complex",
                Value::Bool(d.rope_pairs_adjacent),
            ),
            // the indexer's query input: MindSpeed-LLM's absorbed path normed it
            ("enable_mla_absorb", Value::Bool(d.normed_query)),
            ("use_sparse_flash_attn", Value::Bool(d.normed_query)),
        ]);
    }
    args
}

/// YaRN scaling in Megatron args, as config.json's `rope_scaling` (`None` unless
/// `--rope-scaling-type yarn`, MindSpeed-LLM's, or megatron-core's `rope_type` is yarn).
pub(super) fn yarn_from_args(args: &[(String, Value)]) -> FieldResult<Option<Json>> {
    let number = |names: [&str; 2]| -> FieldResult<Option<f64>> {
        for name in names {
            if let Some(v) = arg_float(args, name)? {
                return Ok(Some(v));
            }
        }
        Ok(None)
    };
    let factor = number(["rope_scaling_factor", "rotary_scaling_factor"])?.unwrap_or(1.0);
    let original = number([
        "rope_scaling_original_max_position_embeddings",
        "original_max_position_embeddings",
    ])?;
    Ok(Some(json!({
        "type": "yarn",
        "factor": factor,
        "original_max_position_embeddings": original.unwrap_or(4096.0),
        "beta_fast": number(["beta_fast", "yarn_beta_fast"])?.unwrap_or(32.0),
        "beta_slow": number(["beta_slow", "yarn_beta_slow"])?.unwrap_or(1.0),
        "mscale": number(["rope_scaling_mscale", "mscale"])?.unwrap_or(1.0),
        "mscale_all_dim": number(["rope_scaling_mscale_all_dim", "mscale_all_dim"])?.unwrap_or(0.0),
    })))
}

/// The args of a YaRN `rope_scaling` (none for another), under MindSpeed-LLM's names and
/// megatron-core's.
pub(super) fn yarn_args(r: Option<&Json>) -> Vec<(&'static str, Value)> {
    let Some(r) = r.filter(|r| {
        (r.get("rope_type").or_else(|| r.get("type"))).and_then(Json::as_str) == Some("yarn")
    }) else {
        return vec![];
    };
    let get = |key: &str, default: f64| {
        Value::Float(r.get(key).and_then(Json::as_f64).unwrap_or(default))
    };
    let original = get("original_max_position_embeddings", 4096.0);
    let original_int = Value::Int(match original {
        Value::Float(f) => f as i64,
        _ => 4096,
    });
    vec![
        ("rope_scaling_type", Value::Str("yarn".into())),
        ("rope_type", Value::Str("yarn".into())),
        ("rope_scaling_factor", get("factor", 1.0)),
        ("rotary_scaling_factor", get("factor", 1.0)),
        (
            "rope_scaling_original_max_position_embeddings",
            original_int.clone(),
        ),
        ("original_max_position_embeddings", original_int),
        ("beta_fast", get("beta_fast", 32.0)),
        ("beta_slow", get("beta_slow", 1.0)),
        ("rope_scaling_mscale", get("mscale", 1.0)),
        ("mscale", get("mscale", 1.0)),
        ("rope_scaling_mscale_all_dim", get("mscale_all_dim", 0.0)),
        ("mscale_all_dim", get("mscale_all_dim", 0.0)),
    ]
}

/// `cfg`'s multi-latent attention written into a `config.json` built from the numbers
/// (DeepseekV3Config's keys; its `head_dim` is the rotated part's).
pub(super) fn mla_to_hf(cfg: &ModelConfig, out: &mut Json) {
    let Some(m) = &cfg.mla else {
        return;
    };
    out["q_lora_rank"] = m.q_lora_rank.map_or(Json::Null, |r| r.into());
    out["kv_lora_rank"] = m.kv_lora_rank.into();
    out["qk_nope_head_dim"] = m.qk_head_dim.into();
    out["qk_rope_head_dim"] = m.rope_dim.into();
    out["v_head_dim"] = m.v_head_dim.into();
    out["head_dim"] = m.rope_dim.into();
    out["rope_interleave"] = true.into();
    if cfg.moe.is_none() {
        // DeepseekV3Config's defaults make layers from the fourth on MoE layers
        out["first_k_dense_replace"] = cfg.layers.into();
    }
}
