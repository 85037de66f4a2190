//! Mixture of experts in training: the architecture flags (megatron-core 0.15's
//! `--num-experts`, `--moe-*`; MindSpeed-LLM's `--moe-intermediate-size`,
//! `--first-k-dense-replace`, `--n-shared-experts`, `--shared-expert-gate`, `--norm-topk-prob`)
//! as Megatron args for the one args reader, the auxiliary losses, and what of MoE training
//! mindkit does not build yet, refused by name.

use super::{positive, positive_float};
use crate::arch::moe::{Capacity, DropPolicy, Moe};
use crate::arch::ModelConfig;
use crate::ckpt::torch::pickle::Value;
use crate::model::{AuxLosses, Balancing};
use crate::train::args::Args;
use anyhow::{anyhow, bail, Result};

/// Megatron `args` of the MoE flags (none without `--num-experts`).
pub(super) fn moe_args(a: &Args) -> Result<Vec<(String, Value)>> {
    if !a.has("num-experts") {
        return Ok(Vec::new());
    }
    if a.get("moe-router-load-balancing-type") == Some("group_limited_greedy") {
        if a.get("moe-router-group-topk").is_none() {
            // as MindSpeed-LLM's moe_router.py `_validate_group_limited_greedy` asserts
            bail!("--moe-router-load-balancing-type group_limited_greedy needs --moe-router-group-topk (the groups it keeps)");
        }
        if a.get("moe-router-num-groups").is_none() {
            // MindSpeed-LLM would take the expert-parallel size, a routing that changes with
            // the layout; the checkpoint's args then record no groups
            bail!("--moe-router-load-balancing-type group_limited_greedy needs --moe-router-num-groups (MindSpeed-LLM defaults it to --expert-model-parallel-size: pass that number)");
        }
    }
    let mut out: Vec<(String, Value)> = Vec::new();
    let mut int = |key: &str, v: Option<usize>| {
        if let Some(v) = v {
            out.push((key.into(), Value::Int(v as i64)));
        }
    };
    int("num_experts", positive(a, "num-experts")?);
    int("num_zero_experts", positive(a, "num-zero-experts")?);
    int("moe_router_topk", positive(a, "moe-router-topk")?);
    int("moe_ffn_hidden_size", positive(a, "moe-ffn-hidden-size")?);
    int(
        "moe_intermediate_size",
        positive(a, "moe-intermediate-size")?,
    );
    int(
        "moe_shared_expert_intermediate_size",
        positive(a, "moe-shared-expert-intermediate-size")?,
    );
    int("n_shared_experts", positive(a, "n-shared-experts")?);
    int(
        "moe_router_num_groups",
        positive(a, "moe-router-num-groups")?,
    );
    int(
        "moe_router_group_topk",
        positive(a, "moe-router-group-topk")?,
    );
    for (flag, key) in [
        ("shared-expert-gate", "shared_expert_gate"),
        ("moe-router-pre-softmax", "moe_router_pre_softmax"),
        ("norm-topk-prob", "norm_topk_prob"),
        (
            "moe-router-enable-expert-bias",
            "moe_router_enable_expert_bias",
        ),
    ] {
        out.push((key.into(), Value::Bool(a.has(flag))));
    }
    if let Some(s) = positive_float(a, "moe-router-topk-scaling-factor")? {
        out.push(("moe_router_topk_scaling_factor".into(), Value::Float(s)));
    }
    for (flag, key) in [
        ("moe-router-score-function", "moe_router_score_function"),
        (
            "moe-router-load-balancing-type",
            "moe_router_load_balancing_type",
        ),
    ] {
        if let Some(v) = a.get(flag) {
            out.push((key.into(), Value::Str(v.into())));
        }
    }
    if let Some(k) = a.parse_value::<i64>("first-k-dense-replace")? {
        out.push(("first_k_dense_replace".into(), Value::Int(k)));
    }
    if let Some(f) = a.get("moe-layer-freq") {
        out.push(("moe_layer_freq".into(), layer_freq(f)?));
    }
    Ok(out)
}

/// The MoE training flags Megatron's `args` carries into a checkpoint besides the
/// architecture (how the router computes and drops, how the expert bias moves).
pub(super) fn recorded_moe_args(a: &Args) -> Result<Vec<(&'static str, serde_json::Value)>> {
    use serde_json::json;
    if !a.has("num-experts") {
        return Ok(Vec::new());
    }
    let float = |f| -> Result<Option<f64>> { Ok(a.parse_value::<f64>(f)?) };
    Ok(vec![
        ("moe_router_dtype", json!(a.get("moe-router-dtype"))),
        (
            "router_gating_in_fp32",
            json!(a.has("router-gating-in-fp32")),
        ),
        (
            "moe_router_bias_update_rate",
            json!(float("moe-router-bias-update-rate")?.unwrap_or(1e-3)),
        ),
        (
            "moe_expert_capacity_factor",
            json!(float("moe-expert-capacity-factor")?),
        ),
        (
            "moe_token_drop_policy",
            json!(a.get("moe-token-drop-policy").unwrap_or("probs")),
        ),
        (
            "moe_pad_expert_input_to_capacity",
            json!(a.has("moe-pad-expert-input-to-capacity")),
        ),
    ])
}

/// `--moe-layer-freq`: an int, or a pattern Megatron evaluates (`[0]*3+[1]*29`, `[1,0,1]`).
fn layer_freq(text: &str) -> Result<Value> {
    if let Ok(k) = text.trim().parse::<i64>() {
        return Ok(Value::Int(k));
    }
    let bad =
        || anyhow!("--moe-layer-freq {text}: not an integer or a list pattern like [0]*3+[1]*29");
    let mut pattern = Vec::new();
    for term in text
        .trim()
        .trim_matches(|c| c == '(' || c == ')')
        .split('+')
    {
        let (list, times) = match term.split_once('*') {
            Some((l, n)) => (l.trim(), n.trim().parse::<usize>().map_err(|_| bad())?),
            None => (term.trim(), 1),
        };
        let inner = list
            .strip_prefix('[')
            .and_then(|l| l.strip_suffix(']'))
            .ok_or_else(bad)?;
        let items = (inner.split(',').filter(|s| !s.trim().is_empty()))
            .map(|x| x.trim().parse::<i64>().map_err(|_| bad()))
            .collect::<Result<Vec<i64>>>()?;
        for _ in 0..times.min(1 << 16) {
            pattern.extend(items.iter().map(|&x| Value::Int(x)));
        }
    }
    Ok(Value::List(pattern))
}

/// The MoE flags against the `--load` checkpoint's experts: Megatron builds the model from the
/// flags, so a disagreement is refused rather than trained as the checkpoint says.
pub(super) fn check_load(flags: Option<&Moe>, loaded: Option<&Moe>, described: bool) -> Result<()> {
    match (flags, loaded) {
        (None, None) => Ok(()),
        (None, Some(_)) if !described => Ok(()),
        (None, Some(m)) => bail!(
            "the --load checkpoint is a mixture of experts ({} experts); pass its --num-experts and --moe-* flags",
            m.experts
        ),
        (Some(_), None) => bail!("--num-experts is given, but the --load checkpoint is dense"),
        (Some(f), Some(m)) if f != m => bail!(
            "the MoE flags describe {f:?}, but the --load checkpoint's experts are {m:?}"
        ),
        _ => Ok(()),
    }
}

/// What of MoE training mindkit does not build yet: refused, naming the flag.
pub(super) fn check_supported(a: &Args, model: &ModelConfig) -> Result<()> {
    if model.moe.is_none() {
        return Ok(());
    }
    let tp = positive(a, "tensor-model-parallel-size")?.unwrap_or(1);
    let (ep, etp) = (
        expert_parallel(a, model)?,
        expert_tensor_parallel(a, model)?,
    );
    if !tp.is_multiple_of(etp) {
        // the files of Megatron's torch format are named by TP and EP rank only
        bail!("--expert-tensor-parallel-size {etp}: a divisor of --tensor-model-parallel-size {tp} is built (the torch-format files hold no other split)");
    }
    if etp != tp && !(etp * ep).is_multiple_of(tp) {
        // Megatron's torch format saves from expert-data-parallel rank 0 only: with fewer
        // expert ranks (ETP × EP) than tensor-parallel ones, some TP shards would be saved by none.
        bail!("--expert-tensor-parallel-size {etp} under --tensor-model-parallel-size {tp} needs --expert-model-parallel-size × {etp} to be a multiple of {tp} (EP is {ep})");
    }
    if etp < tp && capacity(a)?.is_some() {
        // Megatron routes (and drops) each sequence-parallel rank's block of positions of
        // every sequence; experts split over fewer ranks than TP take their ranks' own rows,
        // not those blocks.
        bail!("--moe-expert-capacity-factor: token dropping with --expert-tensor-parallel-size {etp} under --tensor-model-parallel-size {tp} is not built (no shipped script drops tokens)");
    }
    if tp > 1 && !a.has("sequence-parallel") {
        // megatron-core moe_layer.py `MoELayer.forward` raises the same in training.
        bail!("a mixture of experts with tensor parallelism trains with --sequence-parallel (megatron-core refuses it without)");
    }
    check_balancing(a, model, (tp, etp))?;
    check_zero_experts(a, model, ep)?;
    if let Some(d) = a.get("moe-router-dtype").filter(|d| *d != "fp32") {
        bail!("--moe-router-dtype {d}: fp32 is built");
    }

    if let Some(d) = a.get("moe-token-dispatcher-type") {
        if !["allgather", "alltoall", "alltoall_seq"].contains(&d) {
            bail!("--moe-token-dispatcher-type {d}: allgather, alltoall or alltoall_seq");
        }
    }
    Ok(())
}

/// Zero-computation experts as MindSpeed-LLM's zero_experts_moe_layer.py runs them: `Z / EP` on
/// each expert-parallel rank (a remainder would be routed to and computed by none), and, as not
/// built (no shipped script asks), not with token dropping, Sinkhorn or group-limited routing.
fn check_zero_experts(a: &Args, model: &ModelConfig, ep: usize) -> Result<()> {
    let Some(m) = model.moe.as_ref().filter(|m| m.zero_experts > 0) else {
        return Ok(());
    };
    let z = m.zero_experts;
    let refused = if !z.is_multiple_of(ep) {
        Some(format!(
            "they do not divide over --expert-model-parallel-size {ep}"
        ))
    } else if capacity(a)?.is_some() {
        Some("token dropping (--moe-expert-capacity-factor) is not built with them".into())
    } else if m.sinkhorn || m.group_limit.is_some() {
        Some("Sinkhorn and group-limited routing are not built with them".into())
    } else {
        None
    };
    match refused {
        Some(why) => bail!("--num-zero-experts {z}: {why}"),
        None => Ok(()),
    }
}

/// The load-balancing types against what else the flags ask: Sinkhorn balancing without token
/// dropping or an auxiliary loss (megatron-core's `TransformerConfig` and
/// `sinkhorn_load_balancing` refuse both), and, as not built, with an expert bias (which it
/// would count but not route by) or whole experts under TP (a router call balances Megatron's
/// sequence-parallel block). An expert bias with a softmax router is MindSpeed-LLM's: added to
/// the softmax by its `softmax_topk`, routing nothing under megatron-core's types
/// ([`crate::arch::moe::Moe::softmax_bias`]).
fn check_balancing(a: &Args, model: &ModelConfig, (tp, etp): (usize, usize)) -> Result<()> {
    let Some(m) = &model.moe else { return Ok(()) };
    let balancing = a
        .get("moe-router-load-balancing-type")
        .unwrap_or("aux_loss");
    let refused = match balancing {
        "sinkhorn" if capacity(a)?.is_some() => {
            Some("token dropping (--moe-expert-capacity-factor): megatron-core refuses it")
        }
        "sinkhorn"
            if a.parse_value::<f64>("moe-aux-loss-coeff")?
                .is_some_and(|c| c != 0.0) =>
        {
            Some("--moe-aux-loss-coeff above 0: megatron-core refuses it")
        }
        "sinkhorn" if etp < tp => Some(
            "experts split over fewer ranks than tensor parallelism (--expert-tensor-parallel-size): not built",
        ),
        "sinkhorn" if m.expert_bias => Some("--moe-router-enable-expert-bias: not built"),
        // MindSpeed-LLM's sparsemixer_topk routes without dropping, whatever the capacity
        "sparsemixer_topk" if capacity(a)?.is_some() => Some(
            "token dropping (--moe-expert-capacity-factor): MindSpeed-LLM's SparseMixer drops none",
        ),
        "sparsemixer_topk" if m.expert_bias => {
            Some("--moe-router-enable-expert-bias: SparseMixer routes by no bias")
        }
        _ => None,
    };
    match refused {
        Some(what) => bail!("--moe-router-load-balancing-type {balancing} with {what}"),
        None => Ok(()),
    }
}

/// MindSpeed-LLM's `--moe-tp-extend-ep` under TP > 1 (at TP 1 it is the usual layer): its MoE
/// layer keeps the experts whole, `E / (EP·TP)` on each rank, rank (t, e) holding block
/// `e·TP + t` (mindspeed_llm/core/transformer/moe/moe_layer.py `lora_moe_layer_init`), and
/// dispatches over the TP × EP group — megatron-core's whole experts over TP × EP
/// expert-parallel ranks, which is how it trains here. Checked as MindSpeed(-LLM) checks it:
/// the experts divide over TP × EP, not with `--expert-tensor-parallel-size 1` or LoRA, no
/// token dropping (MindSpeed's docs/features/megatron_moe/megatron-moe-tp-extend-ep.md); EP
/// above 1, as every shipped script runs it (at EP 1 Megatron's optimizer would hold the
/// experts with the dense parameters).
pub(super) fn tp_extend_ep(a: &Args, model: &ModelConfig) -> Result<bool> {
    let tp = positive(a, "tensor-model-parallel-size")?.unwrap_or(1);
    let Some(m) = model
        .moe
        .as_ref()
        .filter(|_| tp > 1 && a.has("moe-tp-extend-ep"))
    else {
        return Ok(false);
    };
    let ep = expert_parallel(a, model)?;
    let refused = if !m.experts.is_multiple_of(ep * tp) {
        Some(format!(
            "the {} routed experts do not divide over TP {tp} × EP {ep} ranks",
            m.experts
        ))
    } else if a.get("expert-tensor-parallel-size").is_some() {
        Some("not with --expert-tensor-parallel-size (MindSpeed-LLM refuses both)".into())
    } else if a.has("lora-target-modules") {
        Some("not with LoRA (MindSpeed-LLM refuses both)".into())
    } else if capacity(a)?.is_some() {
        Some(
            "not with token dropping (--moe-expert-capacity-factor: MindSpeed has none with it)"
                .into(),
        )
    } else if ep == 1 {
        Some(
            "needs an --expert-model-parallel-size above 1 (as every shipped script runs it)"
                .into(),
        )
    } else {
        None
    };
    match refused {
        Some(what) => bail!("--moe-tp-extend-ep under --tensor-model-parallel-size {tp}: {what}"),
        None => Ok(true),
    }
}

/// `--expert-model-parallel-size`: 1 for a dense model (Megatron ignores it there), else a
/// divisor of the routed experts (megatron-core `TransformerConfig` checks
/// `num_moe_experts % expert_model_parallel_size`).
pub(super) fn expert_parallel(a: &Args, model: &ModelConfig) -> Result<usize> {
    let ep = positive(a, "expert-model-parallel-size")?.unwrap_or(1);
    match &model.moe {
        Some(m) if !m.experts.is_multiple_of(ep) => bail!(
            "--expert-model-parallel-size {ep} does not divide the {} routed experts",
            m.experts
        ),
        Some(_) => Ok(ep),
        None => Ok(1),
    }
}

/// `--expert-tensor-parallel-size` (default: the tensor-parallel size, as Megatron's); the
/// tensor-parallel size for a dense model.
pub(super) fn expert_tensor_parallel(a: &Args, model: &ModelConfig) -> Result<usize> {
    let tp = positive(a, "tensor-model-parallel-size")?.unwrap_or(1);
    match model.moe {
        Some(_) => Ok(positive(a, "expert-tensor-parallel-size")?.unwrap_or(tp)),
        None => Ok(tp),
    }
}

/// Whether the router's product is taken in f32 under bf16 weights: megatron-core's
/// `--moe-router-dtype fp32` (router.py `gating`) or MindSpeed-LLM's `--router-gating-in-fp32`
/// (its `topk_router_gating_func`: input and weight cast to f32, the same product).
pub(super) fn router_f32(a: &Args, model: &ModelConfig, bf16: bool) -> Result<bool> {
    Ok(model.moe.is_some()
        && bf16
        && (a.get("moe-router-dtype") == Some("fp32") || a.has("router-gating-in-fp32")))
}

/// Token dropping (`--moe-expert-capacity-factor`, `--moe-token-drop-policy`,
/// `--moe-pad-expert-input-to-capacity`), checked as megatron-core's `TransformerConfig`
/// checks them (a negative factor is dropless; padding needs a factor).
pub(super) fn capacity(a: &Args) -> Result<Option<Capacity>> {
    let factor = a.parse_value::<f64>("moe-expert-capacity-factor")?;
    if factor.is_some_and(|f| !f.is_finite()) {
        bail!(
            "--moe-expert-capacity-factor {}: not a number",
            factor.unwrap_or(0.0)
        );
    }
    let factor = factor.filter(|&f| f >= 0.0);
    let pad = a.has("moe-pad-expert-input-to-capacity");
    let policy = match a.get("moe-token-drop-policy").unwrap_or("probs") {
        "probs" => DropPolicy::Probs,
        "position" => DropPolicy::Position,
        other => bail!("--moe-token-drop-policy {other}: probs or position"),
    };
    match factor {
        None if pad => bail!(
            "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor (megatron-core refuses it without)"
        ),
        None => Ok(None),
        Some(factor) => Ok(Some(Capacity {
            factor,
            policy,
            pad,
        })),
    }
}

/// MindSpeed-LLM's `group_limited_greedy` (DeepSeek-V2's routing, mindspeed_llm/core/
/// transformer/moe/router.py `group_limited_greedy_topKgating`) trains without a loss here: its
/// expert-, device- and communication-level balance losses (computed on a micro-batch of one
/// sequence only: it views a router call's rows as `micro_batch_size` sequences of all of them)
/// are not built, so their coefficients must be 0.
fn greedy_losses(a: &Args) -> Result<Balancing> {
    for flag in [
        "moe-aux-loss-coeff",
        "moe-device-level-aux-loss-coeff",
        "moe-comm-aux-loss-coeff",
    ] {
        if let Some(c) = a.parse_value::<f64>(flag)?.filter(|&c| c != 0.0) {
            bail!("--{flag} {c} with --moe-router-load-balancing-type group_limited_greedy: its balance losses are not built (0 trains its routing without them)");
        }
    }
    Ok(Balancing::None)
}

/// The routers' draws in training: `--moe-input-jitter-eps` (megatron-core router.py
/// `apply_input_jitter`: the router's input times U(1 − ε, 1 + ε), its experts' input as it
/// was), and whether the routers sample their experts (SparseMixer).
pub(super) fn router_noise(a: &Args, model: &ModelConfig) -> Result<(Option<f32>, bool)> {
    let eps = a.parse_value::<f64>("moe-input-jitter-eps")?;
    let Some(m) = &model.moe else {
        if let Some(e) = eps {
            bail!("--moe-input-jitter-eps {e} without --num-experts: there is no router to jitter");
        }
        return Ok((None, false));
    };
    let jitter = match eps {
        Some(e) if !(e.is_finite() && (0.0..1.0).contains(&e)) => {
            bail!("--moe-input-jitter-eps {e}: must lie in [0, 1)")
        }
        e => e.map(|e| e as f32),
    };
    Ok((jitter, m.sparsemixer))
}

/// `--moe-router-bias-update-rate` (default 1e-3, megatron/training/arguments.py).
pub(super) fn bias_update_rate(a: &Args) -> Result<f64> {
    match a.parse_value::<f64>("moe-router-bias-update-rate")? {
        Some(r) if !(r.is_finite() && r >= 0.0) => {
            bail!("--moe-router-bias-update-rate {r}: must be ≥ 0")
        }
        r => Ok(r.unwrap_or(1e-3)),
    }
}

/// The auxiliary losses of `--moe-router-load-balancing-type` (Megatron's default `aux_loss`),
/// `--moe-aux-loss-coeff` and `--moe-z-loss-coeff`, for steps of `micro_batches` micro-batches
/// of `sequences` sequences.
pub(super) fn aux_losses(
    a: &Args,
    model: &ModelConfig,
    (micro_batches, sequences): (usize, usize),
    per_token: bool,
) -> Result<Option<AuxLosses>> {
    if model.moe.is_none() {
        return Ok(None);
    }
    let named = a
        .get("moe-router-load-balancing-type")
        .unwrap_or("aux_loss");
    let balancing = match named {
        // MindSpeed-LLM's pai_megatron_aux_loss: the Switch loss of a softmax over all experts
        "aux_loss" | "pai_megatron_aux_loss" => Balancing::Aux,
        "seq_aux_loss" => Balancing::SeqAux,
        // MindSpeed-LLM's --seq-aux adds a loss to `none` only (router.py `topk_router_routing`)
        "none" if a.has("seq-aux") => Balancing::SeqComplementary,
        // Sinkhorn balances in the routing itself;
        // MindSpeed-LLM's softmax_topk and sparsemixer_topk have no loss
        "none" | "sinkhorn" | "softmax_topk" | "sparsemixer_topk" => Balancing::None,
        "group_limited_greedy" => greedy_losses(a)?,
        other => bail!(
            "--moe-router-load-balancing-type {other}: aux_loss, seq_aux_loss, sinkhorn, none and MindSpeed-LLM's softmax_topk, sparsemixer_topk, pai_megatron_aux_loss and group_limited_greedy are built"
        ),
    };
    if named != "group_limited_greedy" {
        for flag in ["moe-device-level-aux-loss-coeff", "moe-comm-aux-loss-coeff"] {
            if let Some(c) = a.parse_value::<f64>(flag)?.filter(|&c| c != 0.0) {
                bail!("--{flag} {c}: only MindSpeed-LLM's group_limited_greedy reads it");
            }
        }
    }
    if balancing == Balancing::SeqComplementary && capacity(a)?.is_some() {
        // MindSpeed-LLM counts the tokens kept, which no shipped script with --seq-aux drops
        bail!("--seq-aux with token dropping (--moe-expert-capacity-factor) is not built");
    }
    let coeff = |flag| -> Result<Option<f32>> {
        match a.parse_value::<f64>(flag)? {
            Some(c) if !(c.is_finite() && c >= 0.0) => bail!("--{flag} {c}: must be ≥ 0"),
            c => Ok(c.map(|c| c as f32)),
        }
    };
    Ok(Some(AuxLosses {
        balancing,
        aux_coeff: coeff("moe-aux-loss-coeff")?.unwrap_or(0.0),
        z_coeff: coeff("moe-z-loss-coeff")?,
        per_token,
        micro_batches,
        sequences,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_freq_patterns_read_as_megatron_evaluates_them() {
        let ints = |v: Value| match v {
            Value::List(items) => items
                .into_iter()
                .map(|x| match x {
                    Value::Int(i) => i,
                    _ => panic!(),
                })
                .collect::<Vec<_>>(),
            _ => panic!("not a list"),
        };
        assert_eq!(ints(layer_freq("[0]*2+[1]*3").unwrap()), [0, 0, 1, 1, 1]);
        assert_eq!(ints(layer_freq("([1,0]*2)").unwrap()), [1, 0, 1, 0]);
        assert!(matches!(layer_freq("-1").unwrap(), Value::Int(-1)));
        assert!(layer_freq("every other").is_err());
    }
}
