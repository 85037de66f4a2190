//! The experts of a mixture-of-experts configuration, as `config.json` (transformers 4.57's
//! `Qwen3MoeConfig`, `Qwen2MoeConfig`, `MixtralConfig`) and Megatron args (megatron-core
//! 0.15's `--num-experts`, `--moe-*`; MindSpeed-LLM's `--first-k-dense-replace`,
//! `--n-shared-experts`, `--shared-expert-gate`) spell them.

use super::{
    arg, arg_bool, arg_count, arg_field, arg_float, check_count, json_bool, json_count, json_field,
    json_required_count, ConfigError, FieldResult,
};
use crate::arch::family::Family;
use crate::arch::moe::{LayerFreq, Moe, ScoreFunction};
use crate::ckpt::torch::pickle::Value;
use serde_json::{json, Value as Json};

/// The experts `config.json` gives a family that has them (`None` for a dense family, or zero
/// experts). A Qwen MoE layer `l` is sparse unless listed in `mlp_only_layers` or skipped by
/// `decoder_sparse_step` (transformers' `Qwen3MoeDecoderLayer`); Mixtral's every layer is.
pub(super) fn moe_from_hf(cfg: &Json, family: &Family, layers: usize) -> FieldResult<Option<Moe>> {
    let Some(names) = &family.moe else {
        return Ok(None);
    };
    let experts = match json_field(cfg, names.experts_key, "an integer", Json::as_u64)? {
        None | Some(0) => return Ok(None),
        Some(n) => check_count(names.experts_key, n)?,
    };
    let topk = json_required_count(cfg, "num_experts_per_tok")?;
    check_topk(topk, experts, "num_experts_per_tok")?;
    let normalised = match names.norm_topk_key {
        Some(key) => json_bool(cfg, key)?.unwrap_or(false),
        None => true,
    };
    let shared_ffn = (names.shared)
        .map(|_| json_required_count(cfg, "shared_expert_intermediate_size"))
        .transpose()?;
    let layers = if names.sparse_step {
        let step = json_count(cfg, "decoder_sparse_step")?.unwrap_or(1);
        let dense = json_field(cfg, "mlp_only_layers", "a list of layer indices", |v| {
            v.as_array()?
                .iter()
                .map(Json::as_u64)
                .collect::<Option<Vec<u64>>>()
        })?
        .unwrap_or_default();
        (0..layers)
            .map(|l| !dense.contains(&(l as u64)) && (l + 1) % step == 0)
            .collect()
    } else {
        vec![true; layers]
    };
    Ok(Some(Moe {
        experts,
        topk,
        ffn: json_required_count(cfg, names.ffn_key)?,
        shared_ffn,
        shared_gate: shared_ffn.is_some(),
        score: ScoreFunction::Softmax,
        pre_softmax: !normalised,
        topk_scale: None,
        group_limit: None,
        layers,
        expert_bias: names.expert_bias.is_some(),
    }))
}

fn check_topk(topk: usize, experts: usize, field: &str) -> FieldResult<()> {
    if topk > experts {
        return Err(ConfigError::OutOfRange {
            field: field.into(),
            got: topk.to_string(),
            expected: "at most the number of experts",
        });
    }
    Ok(())
}

/// Why `family`'s `config.json` cannot hold `moe`, if it cannot.
pub(super) fn hf_limits(moe: &Moe, family: &Family) -> Option<String> {
    let Some(names) = &family.moe else {
        return Some(format!("the {} family has no experts", family.name));
    };
    let routing = moe.score != ScoreFunction::Softmax
        || moe.topk_scale.is_some()
        || moe.group_limit.is_some()
        || (names.norm_topk_key.is_none() && moe.pre_softmax);
    if routing {
        return Some(format!(
            "{}'s router is a softmax over all experts then the top-k{}; this model routes \
             otherwise (score function {}, pre-softmax {}, scaling {:?}, groups {:?})",
            family.name,
            if names.norm_topk_key.is_some() {
                " (optionally renormalised)"
            } else {
                ", renormalised"
            },
            moe.score.name(),
            moe.pre_softmax,
            moe.topk_scale,
            moe.group_limit
        ));
    }
    if names.shared.is_some() != moe.shared_ffn.is_some()
        || moe.shared_gate != moe.shared_ffn.is_some()
    {
        return Some(format!(
            "the {} family {} gated shared expert; this model {}",
            family.name,
            if names.shared.is_some() {
                "has a"
            } else {
                "has no"
            },
            match (moe.shared_ffn, moe.shared_gate) {
                (None, _) => "has none",
                (Some(_), true) => "has a gated one",
                (Some(_), false) => "has one without a gate",
            }
        ));
    }
    if moe.expert_bias != names.expert_bias.is_some() {
        return Some(format!(
            "the {} family's router {} an expert bias; this model's {}",
            family.name,
            if names.expert_bias.is_some() {
                "has"
            } else {
                "has no"
            },
            if moe.expert_bias {
                "has one (--moe-router-enable-expert-bias)"
            } else {
                "has none"
            }
        ));
    }
    if !names.sparse_step && moe.layers.iter().any(|&m| !m) {
        return Some(format!(
            "every {} layer is an MoE layer; this model has dense layers",
            family.name
        ));
    }
    None
}

/// The `config.json` keys of `moe` for `family` (a configuration built from Megatron args).
pub(super) fn moe_to_hf(moe: &Moe, family: &Family, cfg: &mut Json) {
    let Some(names) = &family.moe else { return };
    cfg[names.experts_key] = moe.experts.into();
    cfg["num_experts_per_tok"] = moe.topk.into();
    cfg[names.ffn_key] = moe.ffn.into();
    if let Some(key) = names.norm_topk_key {
        cfg[key] = (!moe.pre_softmax).into();
    }
    if names.sparse_step {
        let dense: Vec<usize> = (0..moe.layers.len()).filter(|&l| !moe.layers[l]).collect();
        cfg["decoder_sparse_step"] = 1.into();
        cfg["mlp_only_layers"] = json!(dense);
    }
    if let Some(f) = moe.shared_ffn {
        cfg["shared_expert_intermediate_size"] = f.into();
    }
}

/// `args.moe_layer_freq`: an int, or the per-layer list Megatron parses a pattern string into.
fn layer_freq(args: &[(String, Value)]) -> FieldResult<LayerFreq> {
    let freq = arg_field(
        args,
        "moe_layer_freq",
        "an integer or a list of 0/1",
        |v| match v {
            Value::Int(k) if *k != 0 => Some(LayerFreq::Every(*k)),
            Value::List(items) => items
                .iter()
                .map(|x| match x {
                    Value::Int(i) => Some(*i),
                    _ => None,
                })
                .collect::<Option<Vec<i64>>>()
                .map(LayerFreq::List),
            _ => None,
        },
    )?;
    Ok(freq.unwrap_or(LayerFreq::Every(1)))
}

/// The experts Megatron args record (`None` without `num_experts`). `ffn` is
/// `ffn_hidden_size`, the default of `moe_ffn_hidden_size`.
pub(super) fn moe_from_args(
    args: &[(String, Value)],
    layers: usize,
    ffn: usize,
) -> FieldResult<Option<Moe>> {
    let Some(experts) = arg_count(args, "num_experts")? else {
        return Ok(None);
    };
    let topk = arg_count(args, "moe_router_topk")?.unwrap_or(2);
    check_topk(topk, experts, "args.moe_router_topk")?;
    let expert_ffn = match arg_count(args, "moe_ffn_hidden_size")? {
        Some(f) => f,
        None => arg_count(args, "moe_intermediate_size")?.unwrap_or(ffn),
    };
    let shared_ffn = match arg_count(args, "moe_shared_expert_intermediate_size")? {
        Some(f) => Some(f),
        None => arg_count(args, "n_shared_experts")?.map(|n| n * expert_ffn),
    };
    let score = match arg_field(args, "moe_router_score_function", "a string", |v| match v {
        Value::Str(s) => Some(s.as_str()),
        _ => None,
    })? {
        None | Some("softmax") => ScoreFunction::Softmax,
        Some("sigmoid") => ScoreFunction::Sigmoid,
        Some(other) => {
            return Err(ConfigError::OutOfRange {
                field: "args.moe_router_score_function".into(),
                got: format!("{other:?}"),
                expected: "softmax or sigmoid",
            })
        }
    };
    let group_limit = match (
        arg_count(args, "moe_router_num_groups")?,
        arg_count(args, "moe_router_group_topk")?,
    ) {
        (Some(g), Some(k)) => Some((g, k)),
        _ => None,
    };
    let first_dense = match arg(args, "first_k_dense_replace") {
        Some(Value::Int(k)) => *k,
        _ => 0,
    };
    Ok(Some(Moe {
        experts,
        topk,
        ffn: expert_ffn,
        shared_ffn,
        shared_gate: shared_ffn.is_some() && arg_bool(args, "shared_expert_gate")?.unwrap_or(false),
        score,
        // MindSpeed-LLM's norm_topk_prob renormalises the chosen probabilities, after a softmax
        // over all experts too: the softmax of the chosen logits.
        pre_softmax: arg_bool(args, "moe_router_pre_softmax")?.unwrap_or(false)
            && !arg_bool(args, "norm_topk_prob")?.unwrap_or(false),
        topk_scale: arg_float(args, "moe_router_topk_scaling_factor")?,
        group_limit,
        layers: Moe::pattern(layers, &layer_freq(args)?, first_dense),
        expert_bias: arg_bool(args, "moe_router_enable_expert_bias")?.unwrap_or(false),
    }))
}

/// What `moe` contributes to `args` (the keys megatron-core's `TransformerConfig` and
/// MindSpeed-LLM's MoE layer read); without experts, `num_experts` None.
pub(super) fn moe_args(moe: Option<&Moe>) -> Vec<(&'static str, Value)> {
    let int = |v: usize| Value::Int(v as i64);
    let Some(m) = moe else {
        return vec![("num_experts", Value::None)];
    };
    let opt = |v: Option<usize>| v.map_or(Value::None, int);
    let all = m.layers.iter().all(|&x| x);
    vec![
        ("num_experts", int(m.experts)),
        ("moe_router_topk", int(m.topk)),
        ("moe_ffn_hidden_size", int(m.ffn)),
        ("moe_shared_expert_intermediate_size", opt(m.shared_ffn)),
        ("shared_expert_gate", Value::Bool(m.shared_gate)),
        (
            "moe_router_score_function",
            Value::Str(m.score.name().into()),
        ),
        ("moe_router_pre_softmax", Value::Bool(m.pre_softmax)),
        ("moe_router_enable_expert_bias", Value::Bool(m.expert_bias)),
        (
            "moe_router_topk_scaling_factor",
            m.topk_scale.map_or(Value::None, Value::Float),
        ),
        ("moe_router_num_groups", opt(m.group_limit.map(|g| g.0))),
        ("moe_router_group_topk", opt(m.group_limit.map(|g| g.1))),
        (
            "moe_layer_freq",
            if all {
                int(1)
            } else {
                Value::List(m.layers.iter().map(|&x| Value::Int(x as i64)).collect())
            },
        ),
        ("first_k_dense_replace", Value::None),
        ("n_shared_experts", Value::None),
    ]
}
