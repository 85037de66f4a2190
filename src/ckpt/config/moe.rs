//! The experts of a mixture-of-experts configuration, as `config.json` (transformers 4.57's
//! `Qwen3MoeConfig`, `Qwen2MoeConfig`, `MixtralConfig`, `Glm4MoeConfig`) and Megatron args (megatron-core
//! 0.15's `--num-experts`, `--moe-*`; MindSpeed-LLM's `--first-k-dense-replace`,
//! `--n-shared-experts`, `--shared-expert-gate`) spell them.

use super::{
    arg, arg_bool, arg_count, arg_field, arg_float, check_count, json_bool, json_count, json_field,
    json_positive, json_required_count, ConfigError, FieldResult,
};
use crate::arch::family::{Family, MoeLayers, MoeNames, SharedSize, TopkNorm};
use crate::arch::moe::{sparsemixer, LayerFreq, Moe, ScoreFunction};
use crate::ckpt::torch::pickle::Value;
use serde_json::{json, Value as Json};

/// The experts `config.json` gives a family that has them (`None` for a dense family, or zero
/// experts), as its [`MoeNames`] say where they are: which layers are MoE layers
/// ([`MoeLayers`]), the shared experts' size, the router's scaling and groups.
pub(super) fn moe_from_hf(cfg: &Json, family: &Family, layers: usize) -> FieldResult<Option<Moe>> {
    let Some(names) = &family.moe else {
        return Ok(None);
    };
    let experts = match json_field(cfg, names.experts_key, "an integer", Json::as_u64)? {
        None | Some(0) => return Ok(None),
        Some(n) => check_count(names.experts_key, n)?,
    };
    let topk = json_required_count(cfg, names.topk_key)?;
    check_topk(topk, experts, names.topk_key)?;
    if names.sparsemixer {
        check_sparsemixer(cfg, topk, names.topk_key)?;
    }
    let normalised = match names.norm_topk {
        TopkNorm::Key(key) => json_bool(cfg, key)?.unwrap_or(false),
        TopkNorm::Always => true,
        TopkNorm::Never => false,
    };
    if names.score == ScoreFunction::Sigmoid && !normalised && topk > 1 {
        // megatron-core normalises the chosen sigmoid scores (topk_routing_with_score_function)
        return Err(ConfigError::OutOfRange {
            field: match names.norm_topk {
                TopkNorm::Key(key) => key.into(),
                _ => "norm_topk_prob".into(),
            },
            got: "false".into(),
            expected: "true: Megatron's sigmoid routing normalises the chosen scores",
        });
    }
    let (group_limit, group_by_best) = hf_groups(cfg, names, (experts, topk))?;
    let ffn = json_required_count(cfg, names.ffn_key)?;
    let shared_ffn = match names.shared.as_ref().map(|s| s.size) {
        None => None,
        Some(SharedSize::Key(key)) => Some(json_required_count(cfg, key)?),
        Some(SharedSize::Experts(key)) => json_count(cfg, key)?.map(|n| n * ffn),
    }
    .filter(|&f| f > 0);
    // none is a valid count of them (transformers reads `zero_expert_num or 0`)
    let zero_experts = match names.zero_key {
        Some(key) => match json_field(cfg, key, "an integer", Json::as_u64)? {
            None | Some(0) => 0,
            Some(n) => check_count(key, n)?,
        },
        None => 0,
    };
    Ok(Some(Moe {
        experts,
        zero_experts,
        topk,
        ffn,
        shared_ffn,
        shared_gate: shared_ffn.is_some() && names.shared.as_ref().is_some_and(|s| s.gated),
        score: names.score,
        pre_softmax: names.score == ScoreFunction::Softmax && !normalised && !names.sparsemixer,
        topk_scale: match names.scaling_key {
            Some(key) => json_positive(cfg, key)?.filter(|&s| s != 1.0),
            None => None,
        },
        group_limit,
        group_by_best,
        layers: hf_layers(cfg, names.layers, layers)?,
        expert_bias: names.expert_bias.is_some(),
        // a softmax router's bias takes part in the choice (LongcatFlashTopkRouter)
        softmax_bias: names.expert_bias.is_some() && names.score == ScoreFunction::Softmax,
        sinkhorn: false,
        sparsemixer: names.sparsemixer,
    }))
}

/// A SparseMixer router's `config.json` (transformers' `PhimoeConfig`): top-2, and its
/// threshold `router_jitter_noise` the ε MindSpeed-LLM routes by
/// ([`crate::arch::moe::sparsemixer::EPS`]).
fn check_sparsemixer(cfg: &Json, topk: usize, topk_key: &str) -> FieldResult<()> {
    if topk != 2 {
        return Err(ConfigError::OutOfRange {
            field: topk_key.into(),
            got: topk.to_string(),
            expected: "2 (SparseMixer routes two experts)",
        });
    }
    let eps = json_field(cfg, "router_jitter_noise", "a number", Json::as_f64)?;
    match eps {
        Some(e) if (e as f32 - sparsemixer::EPS).abs() > 1e-9 => Err(ConfigError::OutOfRange {
            field: "router_jitter_noise".into(),
            got: e.to_string(),
            expected: "0.01: SparseMixer's threshold as MindSpeed-LLM routes by it",
        }),
        _ => Ok(()),
    }
}

/// Group-limited routing from `config.json` (`None` for one group), and whether a group is
/// scored by its best expert. transformers scores a group by its best two experts
/// (`Glm4MoeTopkRouter.get_topk_indices`), megatron-core by its best `topk / groups kept`: a
/// configuration where they differ is refused. DeepSeek-V2's `topk_method` chooses: `greedy`
/// limits nothing, `group_limited_greedy` scores each group by its best expert
/// (`DeepseekV2MoEGate`).
fn hf_groups(
    cfg: &Json,
    names: &MoeNames,
    (experts, topk): (usize, usize),
) -> FieldResult<(Option<(usize, usize)>, bool)> {
    let Some((groups_key, kept_key)) = names.group_keys else {
        return Ok((None, false));
    };
    let by_best = match names.greedy_key {
        None => false,
        Some(key) => match super::json_str(cfg, key)? {
            None | Some("greedy") => return Ok((None, false)),
            Some("group_limited_greedy") => true,
            Some(other) => {
                return Err(ConfigError::OutOfRange {
                    field: key.into(),
                    got: format!("{other:?}"),
                    expected: "greedy or group_limited_greedy",
                })
            }
        },
    };
    let groups = json_count(cfg, groups_key)?.unwrap_or(1);
    let kept = json_count(cfg, kept_key)?.unwrap_or(1);
    if groups <= 1 || by_best && kept >= groups {
        return Ok((None, false));
    }
    if !by_best && (kept == 0 || topk / kept != 2) {
        return Err(ConfigError::OutOfRange {
            field: kept_key.into(),
            got: kept.to_string(),
            expected: "num_experts_per_tok / 2: transformers scores a group by two experts",
        });
    }
    check_groups(kept_key, (experts, topk), (groups, kept))?;
    Ok((Some((groups, kept)), by_best))
}

/// Groups of `experts` of which `kept` hold a token's `topk` experts: the experts split evenly
/// into the groups, and the kept groups hold at least `topk` of them (else transformers and
/// MindSpeed-LLM would pick masked experts at score 0).
fn check_groups(
    field: &str,
    (experts, topk): (usize, usize),
    (groups, kept): (usize, usize),
) -> FieldResult<()> {
    if !experts.is_multiple_of(groups) || kept == 0 || kept * (experts / groups) < topk {
        return Err(ConfigError::OutOfRange {
            field: field.into(),
            got: format!("{kept} of {groups} groups"),
            expected: "groups that split the experts evenly, the kept ones holding the top-k",
        });
    }
    Ok(())
}

/// Which of the `layers` are MoE layers, as `config.json` places them.
fn hf_layers(cfg: &Json, rule: MoeLayers, layers: usize) -> FieldResult<Vec<bool>> {
    Ok(match rule {
        MoeLayers::All => vec![true; layers],
        MoeLayers::SparseStep => {
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
        }
        MoeLayers::FirstDense => {
            let first = json_count(cfg, "first_k_dense_replace")?.unwrap_or(0);
            (0..layers).map(|l| l >= first).collect()
        }
    })
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
    let groups_fit = match (moe.group_limit, names.group_keys) {
        (None, _) => true,
        (Some(_), Some(_)) if names.greedy_key.is_some() => moe.group_by_best,
        (Some((_, kept)), Some(_)) => !moe.group_by_best && kept > 0 && moe.topk / kept == 2,
        (Some(_), None) => false,
    };
    if moe.sparsemixer != names.sparsemixer {
        return Some(format!(
            "{}'s router {} SparseMixer; this model's {}",
            family.name,
            if names.sparsemixer { "is" } else { "is not" },
            if moe.sparsemixer { "is" } else { "is not" },
        ));
    }
    let routing = !names.sparsemixer && moe.score != names.score
        || moe.softmax_bias
            != (names.expert_bias.is_some() && names.score == ScoreFunction::Softmax)
        || (moe.topk_scale.is_some() && names.scaling_key.is_none())
        || !groups_fit
        || !names.sparsemixer
            && match names.norm_topk {
                TopkNorm::Key(_) => false,
                TopkNorm::Always => moe.pre_softmax,
                TopkNorm::Never => !moe.pre_softmax,
            };
    if routing {
        return Some(format!(
            "{}'s router takes {} scores{}{}{}; this model routes otherwise (score function {}, \
             pre-softmax {}, scaling {:?}, groups and by-best {:?})",
            family.name,
            names.score.name(),
            match names.norm_topk {
                TopkNorm::Key(_) => ", the chosen optionally renormalised",
                TopkNorm::Always => ", the chosen renormalised",
                TopkNorm::Never => ", the chosen as they are",
            },
            if names.scaling_key.is_some() {
                ", scaled"
            } else {
                ""
            },
            match (names.group_keys, names.greedy_key) {
                (Some(_), Some(_)) => " in groups scored by their best expert",
                (Some(_), None) => " in groups scored by two experts",
                (None, _) => "",
            },
            moe.score.name(),
            moe.pre_softmax,
            moe.topk_scale,
            (moe.group_limit, moe.group_by_best)
        ));
    }
    let shared = names.shared.as_ref();
    let shared_fits = match (shared, moe.shared_ffn) {
        (None, None) => true,
        (Some(s), Some(f)) => {
            s.gated == moe.shared_gate
                && match s.size {
                    SharedSize::Key(_) => true,
                    SharedSize::Experts(_) => f.is_multiple_of(moe.ffn.max(1)),
                }
        }
        (Some(s), None) => !s.gated && matches!(s.size, SharedSize::Experts(_)),
        (None, Some(_)) => false,
    };
    if !shared_fits {
        return Some(format!(
            "the {} family's shared experts are {}; this model's are {}",
            family.name,
            match shared {
                None => "none".to_string(),
                Some(s) => format!(
                    "{}{}",
                    if s.gated { "gated" } else { "ungated" },
                    match s.size {
                        SharedSize::Key(_) => "",
                        SharedSize::Experts(_) => ", a multiple of a routed expert's size",
                    }
                ),
            },
            match (moe.shared_ffn, moe.shared_gate) {
                (None, _) => "none".to_string(),
                (Some(f), gated) => format!("of {f}{}", if gated { ", gated" } else { "" }),
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
    if moe.zero_experts > 0 && names.zero_key.is_none() {
        return Some(format!(
            "the {} family has no zero-computation experts; this model has {} (--num-zero-experts)",
            family.name, moe.zero_experts
        ));
    }
    // as the family's files count layers (a paired family's first sublayers route)
    let stored = moe.stored_layers(family.sublayers());
    let first_dense = stored.iter().take_while(|&&m| !m).count();
    let layers_fit = match names.layers {
        MoeLayers::All => stored.iter().all(|&m| m),
        MoeLayers::SparseStep => true,
        MoeLayers::FirstDense => stored[first_dense..].iter().all(|&m| m),
    };
    if !layers_fit {
        return Some(format!(
            "the {} family's MoE layers are {}; this model's are {:?}",
            family.name,
            match names.layers {
                MoeLayers::All => "every layer",
                _ => "every layer after the first dense ones",
            },
            stored
        ));
    }
    None
}

/// The `config.json` keys of `moe` for `family` (a configuration built from Megatron args).
pub(super) fn moe_to_hf(moe: &Moe, family: &Family, cfg: &mut Json) {
    let Some(names) = &family.moe else { return };
    cfg[names.experts_key] = moe.experts.into();
    cfg[names.topk_key] = moe.topk.into();
    if let Some(key) = names.zero_key {
        cfg[key] = moe.zero_experts.into();
    }
    cfg[names.ffn_key] = moe.ffn.into();
    if let TopkNorm::Key(key) = names.norm_topk {
        cfg[key] = (!moe.pre_softmax).into();
    }
    match names.layers {
        MoeLayers::All => {}
        MoeLayers::SparseStep => {
            let dense: Vec<usize> = (0..moe.layers.len()).filter(|&l| !moe.layers[l]).collect();
            cfg["decoder_sparse_step"] = 1.into();
            cfg["mlp_only_layers"] = json!(dense);
        }
        MoeLayers::FirstDense => {
            cfg["first_k_dense_replace"] = moe.layers.iter().take_while(|&&m| !m).count().into();
        }
    }
    match names.shared.as_ref().map(|s| s.size) {
        Some(SharedSize::Key(key)) => {
            if let Some(f) = moe.shared_ffn {
                cfg[key] = f.into();
            }
        }
        Some(SharedSize::Experts(key)) => {
            // none is null (transformers builds shared experts unless `n_shared_experts` is
            // None), never 0, which is no count of them
            cfg[key] = moe.shared_ffn.map(|f| f / moe.ffn.max(1)).into();
        }
        None => {}
    }
    if let Some(key) = names.scaling_key {
        cfg[key] = moe.topk_scale.unwrap_or(1.0).into();
    }
    if names.sparsemixer {
        cfg["router_jitter_noise"] = f64::from(sparsemixer::EPS).into();
        cfg["input_jitter_noise"] = 0.0.into();
    }
    if let Some((groups, kept)) = names.group_keys {
        let (g, k) = moe.group_limit.unwrap_or((1, 1));
        cfg[groups] = g.into();
        cfg[kept] = k.into();
    }
    if let Some(key) = names.greedy_key {
        cfg[key] = match moe.group_limit.is_some() && moe.group_by_best {
            true => "group_limited_greedy",
            false => "greedy",
        }
        .into();
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
    let types = balancing_types(args)?;
    let greedy = types.first().is_some_and(|t| t == "group_limited_greedy");
    let group_limit = match (
        arg_count(args, "moe_router_num_groups")?,
        arg_count(args, "moe_router_group_topk")?,
    ) {
        (Some(g), Some(k)) => Some((g, k)),
        // MindSpeed-LLM's group_limited_greedy takes the expert-parallel ranks for groups
        // (router.py `topk_router_init`) and asserts the groups kept are given
        (None, Some(k)) if greedy => Some((
            arg_count(args, "expert_model_parallel_size")?.unwrap_or(1),
            k,
        )),
        (_, None) if greedy => {
            return Err(ConfigError::OutOfRange {
                field: "args.moe_router_group_topk".into(),
                got: "None".into(),
                expected: "the groups group_limited_greedy keeps",
            })
        }
        _ => None,
    };
    let first_dense = match arg(args, "first_k_dense_replace") {
        Some(Value::Int(k)) => *k,
        _ => 0,
    };
    let moe = Moe {
        experts,
        zero_experts: arg_count(args, "num_zero_experts")?.unwrap_or(0),
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
        group_by_best: false,
        layers: Moe::pattern(layers, &layer_freq(args)?, first_dense),
        expert_bias: arg_bool(args, "moe_router_enable_expert_bias")?.unwrap_or(false),
        softmax_bias: false,
        sinkhorn: false,
        sparsemixer: false,
    };
    let normalised = arg_bool(args, "norm_topk_prob")?.unwrap_or(false);
    let moe = routed_as_balanced(moe, types, normalised)?;
    if let Some(g) = moe.group_limit.filter(|&(g, k)| g > 1 && k < g) {
        check_groups("args.moe_router_group_topk", (experts, topk), g)?;
    }
    Ok(Some(moe))
}

/// `args.moe_router_load_balancing_type`: a name, or megatron-core's list of them.
fn balancing_types(args: &[(String, Value)]) -> FieldResult<Vec<String>> {
    let bad = |got: String| ConfigError::OutOfRange {
        field: "args.moe_router_load_balancing_type".into(),
        got,
        expected: "a name or a list of names",
    };
    match arg(args, "moe_router_load_balancing_type") {
        None | Some(Value::None) => Ok(Vec::new()),
        Some(Value::Str(s)) => Ok(vec![s.clone()]),
        Some(Value::List(items) | Value::Tuple(items)) => (items.iter())
            .map(|v| match v {
                Value::Str(s) => Ok(s.clone()),
                other => Err(bad(format!("{other:?}"))),
            })
            .collect(),
        Some(other) => Err(bad(format!("{other:?}"))),
    }
}

/// The routing of experts trained with load-balancing `types` (`normalised`: MindSpeed-LLM's
/// `norm_topk_prob`): megatron-core's own types route by the score function; its `sinkhorn`
/// (router.py `sinkhorn_load_balancing`) weighs by its activation — a softmax over all experts,
/// a sigmoid at top-1 — unscaled and ungrouped; MindSpeed-LLM's `softmax_topk` takes the top-k
/// of a softmax over all experts, renormalised with `norm_topk_prob`, scaled, ungrouped, and
/// its `pai_megatron_aux_loss` the same never renormalised or scaled
/// (mindspeed_llm/core/transformer/moe/router.py `topk_router_routing`,
/// mindspeed_llm/tasks/models/common/pai_megatron.py).
fn routed_as_balanced(mut moe: Moe, types: Vec<String>, normalised: bool) -> FieldResult<Moe> {
    let mut types = types.iter().map(String::as_str);
    let ungrouped = |m: &mut Moe, pre_softmax: bool| {
        m.score = ScoreFunction::Softmax;
        m.pre_softmax = pre_softmax;
        m.group_limit = None;
    };
    match types.next() {
        Some("sinkhorn") => {
            moe.sinkhorn = true;
            ungrouped(&mut moe, true);
            moe.topk_scale = None;
            if moe.topk == 1 {
                moe.score = ScoreFunction::Sigmoid;
            }
        }
        Some("softmax_topk") => {
            ungrouped(&mut moe, !normalised);
            moe.softmax_bias = true;
        }
        Some("group_limited_greedy") => {
            // router.py `group_limited_greedy_topKgating`: a softmax over all experts, each
            // group scored by its best expert, the chosen renormalised (norm_topk_prob at
            // top-k > 1) or else scaled
            let renormalised = normalised && moe.topk > 1;
            moe.score = ScoreFunction::Softmax;
            moe.pre_softmax = !renormalised;
            if renormalised {
                moe.topk_scale = None;
            } else if moe.topk_scale.is_none() {
                return Err(ConfigError::OutOfRange {
                    field: "args.moe_router_topk_scaling_factor".into(),
                    got: "None".into(),
                    expected: "a number: group_limited_greedy scales the chosen by it",
                });
            }
            moe.group_limit = moe.group_limit.filter(|&(g, k)| g > 1 && k < g);
            moe.group_by_best = moe.group_limit.is_some();
        }
        Some("pai_megatron_aux_loss") => {
            ungrouped(&mut moe, true);
            moe.topk_scale = None;
        }
        Some("sparsemixer_topk") if moe.topk != 2 => {
            // router.py `sparsemixer_top2` raises the same
            return Err(ConfigError::OutOfRange {
                field: "args.moe_router_topk".into(),
                got: moe.topk.to_string(),
                expected: "2 with sparsemixer_topk (SparseMixer routes two experts)",
            });
        }
        Some("sparsemixer_topk") => {
            moe.sparsemixer = true;
            ungrouped(&mut moe, false);
            moe.topk_scale = None;
        }
        Some(t) if !["aux_loss", "seq_aux_loss", "global_aux_loss", "none"].contains(&t) => {
            return Err(ConfigError::OutOfRange {
                field: "args.moe_router_load_balancing_type".into(),
                got: format!("{t:?}"),
                expected: "aux_loss, seq_aux_loss, global_aux_loss, none, sinkhorn, softmax_topk, sparsemixer_topk, pai_megatron_aux_loss or group_limited_greedy (the routings built)",
            })
        }
        _ => {}
    }
    Ok(moe)
}

/// What `moe` contributes to `args` (the keys megatron-core's `TransformerConfig` and
/// MindSpeed-LLM's MoE layer read); without experts, `num_experts` None.
/// `sublayers`: decoder layers per stored layer (a paired model's MoE layers are the first of
/// each pair's).
pub(super) fn moe_args(moe: Option<&Moe>, sublayers: usize) -> Vec<(&'static str, Value)> {
    let int = |v: usize| Value::Int(v as i64);
    let Some(m) = moe else {
        return vec![("num_experts", Value::None)];
    };
    let opt = |v: Option<usize>| v.map_or(Value::None, int);
    let stored = m.stored_layers(sublayers);
    let all = stored.iter().all(|&x| x);
    let greedy = m.group_by_best && m.group_limit.is_some();
    vec![
        ("num_experts", int(m.experts)),
        (
            "num_zero_experts",
            opt(Some(m.zero_experts).filter(|&z| z > 0)),
        ),
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
            // group_limited_greedy asserts a factor when it does not renormalise
            (m.topk_scale.or((greedy && m.pre_softmax).then_some(1.0)))
                .map_or(Value::None, Value::Float),
        ),
        ("moe_router_num_groups", opt(m.group_limit.map(|g| g.0))),
        ("moe_router_group_topk", opt(m.group_limit.map(|g| g.1))),
        (
            "moe_layer_freq",
            if all {
                int(1)
            } else {
                Value::List(stored.iter().map(|&x| Value::Int(x as i64)).collect())
            },
        ),
        ("first_k_dense_replace", Value::None),
        ("n_shared_experts", Value::None),
    ]
    .into_iter()
    .chain(m.sinkhorn.then(|| {
        (
            "moe_router_load_balancing_type",
            Value::Str("sinkhorn".into()),
        )
    }))
    .chain(m.sparsemixer.then(|| {
        (
            "moe_router_load_balancing_type",
            Value::Str("sparsemixer_topk".into()),
        )
    }))
    // MindSpeed-LLM's routing by groups scored by their best expert, renormalised or not
    .chain(
        greedy
            .then(|| {
                [
                    (
                        "moe_router_load_balancing_type",
                        Value::Str("group_limited_greedy".into()),
                    ),
                    ("norm_topk_prob", Value::Bool(!m.pre_softmax)),
                ]
            })
            .into_iter()
            .flatten(),
    )
    // the routing a softmax router's bias takes part in, renormalised or not
    .chain(
        (m.softmax_bias && m.expert_bias)
            .then(|| {
                [
                    (
                        "moe_router_load_balancing_type",
                        Value::Str("softmax_topk".into()),
                    ),
                    ("norm_topk_prob", Value::Bool(!m.pre_softmax)),
                ]
            })
            .into_iter()
            .flatten(),
    )
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The experts of args with top-`k` of 4 scaled, grouped, renormalised routing and the
    /// load-balancing type `balancing`.
    fn routed(k: i64, balancing: &str) -> FieldResult<Option<Moe>> {
        let args: Vec<(String, Value)> = [
            ("num_experts", Value::Int(4)),
            ("moe_router_topk", Value::Int(k)),
            ("moe_router_topk_scaling_factor", Value::Float(2.5)),
            ("moe_router_num_groups", Value::Int(2)),
            ("moe_router_group_topk", Value::Int(1)),
            ("norm_topk_prob", Value::Bool(true)),
            (
                "moe_router_load_balancing_type",
                Value::Str(balancing.into()),
            ),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        moe_from_args(&args, 2, 64)
    }

    #[test]
    fn deepseek_v2s_groups_scored_by_their_best_expert_are_written_as_its_topk_method() {
        let family = crate::arch::family::by_name("deepseek_v2").unwrap();
        let mut m = crate::arch::moe::example(ScoreFunction::Softmax, true);
        (m.topk_scale, m.layers) = (Some(2.5), vec![false, true]);
        for (groups, method) in [(Some((2, 1)), "group_limited_greedy"), (None, "greedy")] {
            (m.group_limit, m.group_by_best) = (groups, groups.is_some());
            assert_eq!(hf_limits(&m, family), None);
            let mut cfg = json!({"num_experts_per_tok": 2, "moe_intermediate_size": 8});
            moe_to_hf(&m, family, &mut cfg);
            assert_eq!(cfg["topk_method"], method);
            assert_eq!(moe_from_hf(&cfg, family, 2).unwrap().as_ref(), Some(&m));
        }
        // megatron-core's groups (scored by their best top-k / kept) it cannot hold
        m.group_by_best = false;
        m.group_limit = Some((2, 1));
        assert!(hf_limits(&m, family).is_some());
    }

    #[test]
    fn load_balancing_types_that_route_otherwise_are_read_as_they_route() {
        let rule = |m: Moe| {
            (
                m.score,
                m.pre_softmax,
                m.topk_scale,
                m.group_limit,
                m.sinkhorn,
            )
        };
        let aux = routed(2, "aux_loss").unwrap().unwrap();
        let grouped = (
            ScoreFunction::Softmax,
            false,
            Some(2.5),
            Some((2, 1)),
            false,
        );
        assert_eq!(rule(aux), grouped);
        // Sinkhorn's activation: a softmax over all experts, at top-1 a sigmoid
        let sinkhorn = (ScoreFunction::Softmax, true, None, None, true);
        assert_eq!(rule(routed(2, "sinkhorn").unwrap().unwrap()), sinkhorn);
        let top1 = rule(routed(1, "sinkhorn").unwrap().unwrap());
        assert_eq!(top1, (ScoreFunction::Sigmoid, true, None, None, true));
        // MindSpeed-LLM's: renormalised with norm_topk_prob and scaled, or neither
        let softmax_topk = (ScoreFunction::Softmax, false, Some(2.5), None, false);
        assert_eq!(
            rule(routed(2, "softmax_topk").unwrap().unwrap()),
            softmax_topk
        );
        let pai = (ScoreFunction::Softmax, true, None, None, false);
        assert_eq!(
            rule(routed(2, "pai_megatron_aux_loss").unwrap().unwrap()),
            pai
        );
        // MindSpeed-LLM's group_limited_greedy: groups scored by their best expert, the
        // chosen renormalised (norm_topk_prob) and then not scaled, or scaled at top-1
        let greedy = routed(2, "group_limited_greedy").unwrap().unwrap();
        assert!(greedy.group_by_best);
        let renormalised = (ScoreFunction::Softmax, false, None, Some((2, 1)), false);
        assert_eq!(rule(greedy.clone()), renormalised);
        let top1 = rule(routed(1, "group_limited_greedy").unwrap().unwrap());
        assert_eq!(
            top1,
            (ScoreFunction::Softmax, true, Some(2.5), Some((2, 1)), false)
        );
        let args: Vec<(String, Value)> = (moe_args(Some(&greedy), 1).into_iter())
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        assert_eq!(moe_from_args(&args, 2, 64).unwrap().unwrap(), greedy);
        // SparseMixer: its own top-2 of softmaxes, unscaled and ungrouped
        let sparse = routed(2, "sparsemixer_topk").unwrap().unwrap();
        assert!(sparse.sparsemixer);
        assert_eq!(
            rule(sparse),
            (ScoreFunction::Softmax, false, None, None, false)
        );
        let err = routed(3, "sparsemixer_topk").unwrap_err().to_string();
        assert!(err.contains("args.moe_router_topk"), "{err}");
        let err = routed(2, "switch").unwrap_err().to_string();
        assert!(err.contains("args.moe_router_load_balancing_type"), "{err}");
        // written back, a Sinkhorn-balanced (or SparseMixer) model stays one
        for (balancing, is) in [("sinkhorn", 0), ("sparsemixer_topk", 1)] {
            let args: Vec<(String, Value)> = (moe_args(routed(2, balancing).unwrap().as_ref(), 1))
                .into_iter()
                .map(|(k, v)| (k.to_string(), v))
                .collect();
            let m = moe_from_args(&args, 2, 64).unwrap().unwrap();
            assert!([m.sinkhorn, m.sparsemixer][is], "{balancing}");
        }
    }
}
