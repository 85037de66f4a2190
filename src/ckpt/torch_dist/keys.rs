//! Where each canonical tensor lives in a `torch_dist` checkpoint: megatron-core 0.15's sharded
//! state dict keys (megatron/core/transformer/transformer_block.py and transformer_layer.py
//! `sharded_state_dict`: layers stacked along a leading axis when homogeneous, else keyed
//! `decoder.layers.{l}.`; the local spec's norms under Transformer Engine's names through its
//! `sharded_state_dict_keys_map`; moe/experts.py: a layer's routed experts along an expert axis
//! of `mlp.experts.experts.linear_fc{1,2}.weight`), global over every parallel rank.

use crate::arch::roles::{Canon, Role};
use crate::arch::ModelConfig;
use crate::ckpt::layout::{global_key_of, layer_key, mtp_key, KeyLayout};

/// The word embedding's key.
pub(super) const EMBEDDING: &str = "embedding.word_embeddings.weight";

/// The global tensors and leading indices that may hold canonical tensor `c`, in the order
/// they are tried: megatron-core's names of the layer (stacked, then per layer), then the
/// local spec's own.
pub(super) fn candidates(cfg: &ModelConfig, c: Canon) -> Vec<(String, Vec<usize>)> {
    let layout = KeyLayout::Mcore;
    let Some(l) = c.layer else {
        return vec![(global_key_of(layout, cfg, c.role).concat(), Vec::new())];
    };
    let (role, expert) = match c.role {
        Role::ExpertFc1(e) => (Role::ExpertFc1(0), Some(e)),
        Role::ExpertFc2(e) => (Role::ExpertFc2(0), Some(e)),
        r => (r, None),
    };
    // the key of the layer's tensor with `{j}` for its index
    let (key, prefix) = match (cfg.mtp, cfg.mtp_depth(l)) {
        (Some(m), Some(k)) => (
            mtp_key(layout, m.layout, role, k).concat(),
            format!("mtp.layers.{k}."),
        ),
        _ => (
            layer_key(layout, role, l).concat(),
            format!("decoder.layers.{l}."),
        ),
    };
    let suffix = key.strip_prefix(&prefix).unwrap_or(&key).to_string();
    let mut names = vec![sharded_name(&suffix), suffix];
    names.dedup();
    let lead = |stacked: bool| -> Vec<usize> {
        let mut at = Vec::new();
        if stacked {
            at.push(l);
        }
        at.extend(expert);
        at
    };
    let mut out = Vec::new();
    for name in names {
        // an MTP depth is keyed by its depth, never stacked with the decoder's layers
        if cfg.mtp_depth(l).is_none() {
            out.push((format!("decoder.layers.{name}"), lead(true)));
        }
        let own = match key.starts_with(&prefix) {
            true => format!("{prefix}{name}"),
            false => name.clone(),
        };
        out.push((own, lead(false)));
    }
    out
}

/// megatron-core's sharded name of a layer tensor of the local spec (Transformer Engine's,
/// where the local spec maps its keys to them).
fn sharded_name(suffix: &str) -> String {
    let renamed = match suffix {
        "input_layernorm.weight" => "self_attention.linear_qkv.layer_norm_weight",
        "pre_mlp_layernorm.weight" => "mlp.linear_fc1.layer_norm_weight",
        s => s,
    };
    // SequentialMLP's experts along an expert axis
    match renamed.split_once("mlp.experts.local_experts.0.") {
        Some((head, rest)) => format!("{head}mlp.experts.experts.{rest}"),
        None => renamed.to_string(),
    }
}

/// Whether a global tensor is no model weight: the optimizer's state, RNG state.
pub(super) fn is_not_model(key: &str) -> bool {
    key.starts_with("optimizer.") || key.starts_with("rng_state")
}

/// How the optimizer's state was saved, if it was: `fully_reshardable` model-shaped tensors,
/// or the distributed optimizer's DP-reshardable bucket tensors.
pub(super) fn optimizer_kind<'a>(mut keys: impl Iterator<Item = &'a String>) -> Option<String> {
    let kind = |k: &str| {
        if k.starts_with("optimizer.distributed.") {
            Some("distributed optimizer, dp_reshardable buckets")
        } else if k.starts_with("optimizer.state.") {
            Some("model-shaped (fully reshardable)")
        } else {
            None
        }
    };
    keys.find_map(|k| kind(k)).map(str::to_string)
}
