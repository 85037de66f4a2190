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

/// A layer tensor's local key: the layer's prefix (`decoder.layers.{l}.`, or an MTP depth's
/// `mtp.layers.{k}.`), the name under it, and the expert it is of.
struct LayerTensor {
    prefix: String,
    name: String,
    /// Whether the local key starts with the prefix (else the name is the whole key).
    prefixed: bool,
    expert: Option<usize>,
}

fn layer_tensor(cfg: &ModelConfig, role: Role, l: usize) -> LayerTensor {
    let layout = KeyLayout::Mcore;
    let (role, expert) = match role {
        Role::ExpertFc1(e) => (Role::ExpertFc1(0), Some(e)),
        Role::ExpertFc2(e) => (Role::ExpertFc2(0), Some(e)),
        r => (r, None),
    };
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
    let (name, prefixed) = match key.strip_prefix(&prefix) {
        Some(name) => (name.to_string(), true),
        None => (key.clone(), false),
    };
    LayerTensor {
        prefix,
        name,
        prefixed,
        expert,
    }
}

/// The global tensors and leading indices that may hold canonical tensor `c`, in the order
/// they are tried: megatron-core's names of the layer (stacked, then per layer), then the
/// local spec's own.
pub(super) fn candidates(cfg: &ModelConfig, c: Canon) -> Vec<(String, Vec<usize>)> {
    let Some(l) = c.layer else {
        return vec![(
            global_key_of(KeyLayout::Mcore, cfg, c.role).concat(),
            Vec::new(),
        )];
    };
    let t = layer_tensor(cfg, c.role, l);
    let mut names = vec![sharded_name(&t.name, true), t.name.clone()];
    names.dedup();
    let lead = |stacked: bool| -> Vec<usize> {
        let mut at = Vec::new();
        if stacked {
            at.push(l);
        }
        at.extend(t.expert);
        at
    };
    let mut out = Vec::new();
    for name in names {
        // an MTP depth is keyed by its depth, never stacked with the decoder's layers
        if cfg.mtp_depth(l).is_none() {
            out.push((format!("decoder.layers.{name}"), lead(true)));
        }
        let own = match t.prefixed {
            true => format!("{}{name}", t.prefix),
            false => name.clone(),
        };
        out.push((own, lead(false)));
    }
    out
}

/// Where canonical tensor `c` goes in a checkpoint megatron-core's local spec loads: the
/// global tensor, the leading indices that select it and the sizes of those leading axes.
pub struct Placement {
    /// The global tensor's key.
    pub key: String,
    /// The leading indices that select it.
    pub at: Vec<usize>,
    /// Those axes' sizes.
    pub lead: Vec<usize>,
}

/// Where megatron-core 0.15's `sharded_state_dict` of the local spec puts `c`
/// (transformer_block.py: the layers stacked unless `moe_layer_freq` makes them differ;
/// gpt_layer_specs.py `get_gpt_layer_local_spec`: the norms under Transformer Engine's
/// names except with multi-latent attention; moe/experts.py: the experts along an axis).
pub fn placement(cfg: &ModelConfig, c: Canon) -> Placement {
    let Some(l) = c.layer else {
        let key = global_key_of(KeyLayout::Mcore, cfg, c.role).concat();
        return Placement {
            key,
            at: Vec::new(),
            lead: Vec::new(),
        };
    };
    let t = layer_tensor(cfg, c.role, l);
    let name = sharded_name(&t.name, cfg.mla.is_none());
    let homogeneous = cfg.moe.as_ref().is_none_or(|m| m.layers.iter().all(|&x| x));
    let stacked = homogeneous && cfg.mtp_depth(l).is_none();
    let (mut at, mut lead) = match stacked {
        true => (vec![l], vec![cfg.layers]),
        false => (Vec::new(), Vec::new()),
    };
    if let (Some(e), Some(m)) = (t.expert, &cfg.moe) {
        at.push(e);
        lead.push(m.experts);
    }
    let key = match stacked {
        true => format!("decoder.layers.{name}"),
        false => format!("{}{name}", t.prefix),
    };
    Placement { key, at, lead }
}

/// megatron-core's sharded name of a layer tensor of the local spec: its norms under
/// Transformer Engine's names where the spec maps them (`te_norms`; inside an MTP depth's
/// `transformer_layer.` too), SequentialMLP's experts along an expert axis.
fn sharded_name(name: &str, te_norms: bool) -> String {
    let (head, local) = match name.strip_prefix("transformer_layer.") {
        Some(rest) => ("transformer_layer.", rest),
        None => ("", name),
    };
    let renamed = match local {
        "input_layernorm.weight" if te_norms => "self_attention.linear_qkv.layer_norm_weight",
        "pre_mlp_layernorm.weight" if te_norms => "mlp.linear_fc1.layer_norm_weight",
        "input_layernorm.bias" if te_norms => "self_attention.linear_qkv.layer_norm_bias",
        "pre_mlp_layernorm.bias" if te_norms => "mlp.linear_fc1.layer_norm_bias",
        s => s,
    };
    match renamed.split_once("mlp.experts.local_experts.0.") {
        Some((h, rest)) => format!("{head}{h}mlp.experts.experts.{rest}"),
        None => format!("{head}{renamed}"),
    }
}

/// The prefix of the model-shaped optimizer state's keys (megatron-core
/// dist_checkpointing/optimizer.py `optim_state_to_sharding_state`).
pub const OPTIMIZER_STATE: &str = "optimizer.state.";

/// The distributed optimizer's `dp_reshardable` bucket tensors of one data-parallel group
/// (megatron-core distrib_optimizer.py `sharded_param_state_dp_reshardable`):
/// `{chain}optimizer.distributed.dp_group_idx_{group}.gbuf_idx_{b}.dtype_{(param, grad)}.bucket_idx_{k}.{state}`,
/// `chain` the prefix of one of chained optimizers ([`chained_prefix`]) or empty.
pub(super) fn dp_bucket_prefix(chain: &str, group: usize) -> String {
    format!("{chain}optimizer.distributed.dp_group_idx_{group}.gbuf_idx_")
}

/// The prefix of the keys of optimizer `i` of megatron-core's chained optimizers — the dense
/// parameters' and the routed experts' under expert parallelism — in a `dp_reshardable`
/// save (optimizer.py `ChainedOptimizer.sharded_state_dict`, `add_prefix_for_sharding`).
pub fn chained_prefix(i: usize) -> String {
    format!("chained_{i}.")
}

/// Key `key` without a chained optimizer's prefix, and that optimizer's index if it has one.
pub(super) fn unchained(key: &str) -> (Option<usize>, &str) {
    let split = (key.strip_prefix("chained_"))
        .and_then(|rest| rest.split_once('.'))
        .and_then(|(i, rest)| Some((i.parse().ok()?, rest)))
        .filter(|(_, rest)| rest.starts_with("optimizer."));
    match split {
        Some((i, rest)) => (Some(i), rest),
        None => (None, key),
    }
}

/// The buffer and bucket indices of bucket tensor `key` of `state`, if it is one
/// (`rest` the key after [`dp_bucket_prefix`]: `{b}.dtype_(…).bucket_idx_{k}.{state}`; the
/// dtype names hold dots, so the bucket is read from the end).
pub(super) fn dp_bucket_of(rest: &str, state: &str) -> Option<(usize, usize)> {
    let (buffer, _) = rest.split_once('.')?;
    let (_, tail) = rest.rsplit_once(".bucket_idx_")?;
    let (bucket, name) = tail.split_once('.')?;
    (name == state).then_some(())?;
    Some((buffer.parse().ok()?, bucket.parse().ok()?))
}

/// Whether a global tensor is no model weight: the optimizer's state, RNG state.
pub(super) fn is_not_model(key: &str) -> bool {
    unchained(key).1.starts_with("optimizer.") || key.starts_with("rng_state")
}

/// How the optimizer's state was saved, if it was, from the global tensors' keys and whether
/// each is N-D flattened: model-shaped tensors (`fully_reshardable`, or the deprecated
/// `fully_sharded_model_space`'s flattened ones), or the distributed optimizer's
/// DP-reshardable bucket tensors; and by how many chained optimizers (0: not chained).
pub(super) fn optimizer_kind<'a>(
    keys: impl Iterator<Item = (&'a str, bool)>,
) -> (Option<String>, usize) {
    let kind = |k: &str, flattened: bool| {
        if k.starts_with("optimizer.distributed.") {
            Some("distributed optimizer, dp_reshardable buckets")
        } else if !k.starts_with("optimizer.state.") {
            None
        } else if flattened {
            Some("model-shaped, flattened (fully_sharded_model_space)")
        } else {
            Some("model-shaped (fully reshardable)")
        }
    };
    let (mut found, mut chained) = (None, 0);
    for (k, flattened) in keys {
        let (chain, key) = unchained(k);
        found = found.or(kind(key, flattened));
        chained = chained.max(chain.map_or(0, |i| i + 1));
    }
    let kind = found.map(|found| match chained {
        0 => found.to_string(),
        n => format!("{found}, {n} chained optimizers"),
    });
    (kind, chained)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chained_optimizers_keys_are_optimizer_state_and_counted() {
        let bucket = "optimizer.distributed.dp_group_idx_3.gbuf_idx_0.dtype_(x).bucket_idx_0.param";
        let keys: Vec<String> = [
            "decoder.final_layernorm.weight",
            "chained_0.",
            "chained_x.optimizer.a",
        ]
        .into_iter()
        .map(str::to_string)
        .chain([format!("chained_0.{bucket}"), format!("chained_1.{bucket}")])
        .collect();
        assert_eq!(unchained(&keys[3]), (Some(0), bucket));
        assert_eq!(unchained(&keys[4]), (Some(1), bucket));
        // a model tensor's key that only looks like one stays whole
        assert_eq!(unchained(&keys[2]), (None, keys[2].as_str()));
        assert!(is_not_model(&keys[4]) && !is_not_model(&keys[0]));
        let (kind, chained) = optimizer_kind(keys.iter().map(|k| (k.as_str(), false)));
        assert_eq!(chained, 2);
        let kind = kind.unwrap();
        assert_eq!(
            kind,
            "distributed optimizer, dp_reshardable buckets, 2 chained optimizers"
        );
        let model = keys[..3].iter().map(|k| (k.as_str(), false));
        assert_eq!(optimizer_kind(model), (None, 0));
        let flat = "chained_0.optimizer.state.exp_avg.output_layer.weight";
        let (kind, _) = optimizer_kind([(flat, true)].into_iter());
        assert_eq!(
            kind.unwrap(),
            "model-shaped, flattened (fully_sharded_model_space), 1 chained optimizers"
        );
        assert!(bucket.starts_with(&dp_bucket_prefix("", 3)));
    }
}
