//! Megatron's parallel layout (which global layers each pipeline stage and virtual chunk holds)
//! and its state-dict key names for the three model layouts: mcore local spec (MindSpeed-LLM),
//! mcore Transformer-Engine spec, and the legacy nested model (`reference/ckpt.md` §2.2, §2.3, §3.6).

use super::config::ModelConfig;
use super::transform::{Canon, Role};
use anyhow::{bail, Result};

/// The key layout of a Megatron model state dict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum KeyLayout {
    /// megatron-core, local spec (`--transformer-impl local`, as MindSpeed-LLM writes).
    Mcore,
    /// megatron-core, Transformer-Engine spec (fused norm names, `_extra_state`).
    McoreTe,
    /// Legacy `megatron/legacy/model` nested dicts.
    Legacy,
}

impl KeyLayout {
    /// The CLI spelling.
    pub fn name(self) -> &'static str {
        match self {
            KeyLayout::Mcore => "mcore",
            KeyLayout::McoreTe => "mcore-te",
            KeyLayout::Legacy => "legacy",
        }
    }
}

/// How layers are spread over TP × PP (× virtual chunks).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Parallel {
    /// Tensor-parallel size.
    pub tp: usize,
    /// Pipeline stages.
    pub pp: usize,
    /// Virtual chunks per stage (1 = no virtual pipeline).
    pub vpp: usize,
    /// Layers per stage.
    pub stage_layers: Vec<usize>,
}

impl Parallel {
    /// A layout for `cfg`, checked: heads, groups, ffn divisible by TP; layers by PP × VPP, or
    /// `first`/`last` stage layer counts with the rest spread evenly (Megatron's
    /// `--decoder-first/last-pipeline-num-layers`).
    pub fn new(
        cfg: &ModelConfig,
        tp: usize,
        pp: usize,
        vpp: usize,
        first_last: Option<(usize, usize)>,
    ) -> Result<Self> {
        if tp == 0 || pp == 0 || vpp == 0 {
            bail!("--tp, --pp and --vpp must be at least 1");
        }
        let divisors = |n: usize| {
            (1..=n)
                .filter(|d| n.is_multiple_of(*d))
                .map(|d| d.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        };
        for (what, n) in [
            ("num_attention_heads", cfg.heads),
            ("num_key_value_heads (query groups)", cfg.groups),
            ("intermediate_size", cfg.ffn),
        ] {
            if n % tp != 0 {
                let ok: Vec<String> = (1..=cfg.groups)
                    .filter(|d| {
                        cfg.heads.is_multiple_of(*d)
                            && cfg.groups.is_multiple_of(*d)
                            && cfg.ffn.is_multiple_of(*d)
                    })
                    .map(|d| d.to_string())
                    .collect();
                bail!(
                    "--tp {tp} does not divide {what} = {n}; TP sizes that work: {}",
                    ok.join(", ")
                );
            }
        }
        let l = cfg.layers;
        let stage_layers = match first_last {
            Some((first, last)) => {
                if vpp > 1 {
                    bail!("uneven first/last stage layers cannot be combined with --vpp");
                }
                if pp < 2 {
                    bail!("uneven first/last stage layers need --pp of at least 2");
                }
                let middle = l.checked_sub(first + last).filter(|&m| {
                    if pp == 2 {
                        m == 0
                    } else {
                        m % (pp - 2) == 0
                    }
                });
                let Some(middle) = middle else {
                    bail!(
                        "{l} layers cannot be split as first {first} + last {last} with the rest \
                         evenly over {} middle stages",
                        pp - 2
                    );
                };
                let mut s = vec![first];
                s.extend(std::iter::repeat_n(middle / (pp - 2).max(1), pp - 2));
                s.push(last);
                s
            }
            None => {
                if !l.is_multiple_of(pp * vpp) {
                    bail!(
                        "num_layers {l} is not divisible by --pp {pp} × --vpp {vpp}; \
                         pp × vpp must divide {l} (one of: {})",
                        divisors(l)
                    );
                }
                vec![l / pp; pp]
            }
        };
        Ok(Parallel {
            tp,
            pp,
            vpp,
            stage_layers,
        })
    }

    /// Global layers of virtual chunk `v` on stage `p`.
    pub fn chunk_layers(&self, p: usize, v: usize) -> Vec<usize> {
        if self.vpp > 1 {
            let total: usize = self.stage_layers.iter().sum();
            let c = total / (self.pp * self.vpp);
            let start = v * (total / self.vpp) + p * c;
            (start..start + c).collect()
        } else {
            let start: usize = self.stage_layers[..p].iter().sum();
            (start..start + self.stage_layers[p]).collect()
        }
    }

    /// `(first, last)` stage sizes when the split is uneven.
    pub fn first_last(&self) -> Option<(usize, usize)> {
        let (first, last) = (self.stage_layers[0], self.stage_layers[self.pp - 1]);
        let even = self.stage_layers.iter().all(|&s| s == first);
        (!even).then_some((first, last))
    }

    /// Padded vocabulary: `ceil(vocab / (m·tp)) · m·tp` (Megatron `_vocab_size_with_padding`).
    pub fn padded_vocab(&self, vocab: usize, divisible_by: usize) -> usize {
        let m = divisible_by.max(1) * self.tp;
        vocab.div_ceil(m) * m
    }
}

/// One entry of a model chunk's state dict: its key path (nested dict keys) and the canonical
/// tensor it holds, or `None` for a Transformer-Engine `_extra_state` (written as `None`).
pub type ChunkEntry = (Vec<String>, Option<Canon>);

fn layer_key(layout: KeyLayout, role: Role, j: usize) -> Vec<String> {
    let mcore = |s: &str| vec![format!("decoder.layers.{j}.{s}")];
    let legacy = |s: &str| {
        vec![
            "language_model".to_string(),
            "encoder".to_string(),
            format!("layers.{j}.{s}"),
        ]
    };
    match (layout, role) {
        (KeyLayout::Legacy, r) => legacy(match r {
            Role::InputNorm => "input_norm.weight",
            Role::Qkv => "self_attention.query_key_value.weight",
            Role::QkvBias => "self_attention.query_key_value.bias",
            Role::Proj => "self_attention.dense.weight",
            Role::ProjBias => "self_attention.dense.bias",
            Role::PostNorm => "post_attention_norm.weight",
            Role::Fc1 => "mlp.dense_h_to_4h.weight",
            _ => "mlp.dense_4h_to_h.weight",
        }),
        (KeyLayout::McoreTe, Role::InputNorm) => {
            mcore("self_attention.linear_qkv.layer_norm_weight")
        }
        (KeyLayout::McoreTe, Role::PostNorm) => mcore("mlp.linear_fc1.layer_norm_weight"),
        (_, r) => mcore(match r {
            Role::InputNorm => "input_layernorm.weight",
            Role::Qkv => "self_attention.linear_qkv.weight",
            Role::QkvBias => "self_attention.linear_qkv.bias",
            Role::Proj => "self_attention.linear_proj.weight",
            Role::ProjBias => "self_attention.linear_proj.bias",
            Role::PostNorm => "pre_mlp_layernorm.weight",
            Role::Fc1 => "mlp.linear_fc1.weight",
            _ => "mlp.linear_fc2.weight",
        }),
    }
}

/// Key path of a non-layer tensor (embedding, final norm, output layer).
pub fn global_key(layout: KeyLayout, role: Role, tied: bool) -> Vec<String> {
    let path = |p: &[&str]| p.iter().map(|s| s.to_string()).collect();
    match (layout, role) {
        (KeyLayout::Legacy, Role::Embedding) => {
            path(&["language_model", "embedding", "word_embeddings", "weight"])
        }
        (KeyLayout::Legacy, Role::FinalNorm) => {
            path(&["language_model", "encoder", "final_norm.weight"])
        }
        (KeyLayout::Legacy, _) if tied => path(&["word_embeddings_for_head", "weight"]),
        (KeyLayout::Legacy, _) => path(&["language_model", "output_layer", "weight"]),
        (_, Role::Embedding) => path(&["embedding.word_embeddings.weight"]),
        (_, Role::FinalNorm) => path(&["decoder.final_layernorm.weight"]),
        _ => path(&["output_layer.weight"]),
    }
}

/// TE modules whose `_extra_state` follows a layer role's tensors.
fn te_extra_states(role: Role, cfg: &ModelConfig) -> &'static [&'static str] {
    let last_qkv = if cfg.qkv_bias {
        Role::QkvBias
    } else {
        Role::Qkv
    };
    let last_proj = if cfg.proj_bias {
        Role::ProjBias
    } else {
        Role::Proj
    };
    match role {
        r if r == last_qkv => &["self_attention.linear_qkv._extra_state"],
        r if r == last_proj => &[
            "self_attention.core_attention._extra_state",
            "self_attention.linear_proj._extra_state",
        ],
        Role::Fc1 => &["mlp.linear_fc1._extra_state"],
        Role::Fc2 => &["mlp.linear_fc2._extra_state"],
        _ => &[],
    }
}

/// The state dict of one model chunk, in the order Megatron's modules emit it. `layers` are the
/// chunk's global layers; `first`/`last` say whether it holds the embedding / final norm and
/// output; `pp` decides whether a tied output layer is stored (only when PP > 1).
pub fn chunk_entries(
    layout: KeyLayout,
    cfg: &ModelConfig,
    layers: &[usize],
    first: bool,
    last: bool,
    pp: usize,
) -> Vec<ChunkEntry> {
    let mut out: Vec<ChunkEntry> = Vec::new();
    let global = |role| Canon { role, layer: None };
    if first {
        out.push((
            global_key(layout, Role::Embedding, cfg.tied),
            Some(global(Role::Embedding)),
        ));
    }
    for (j, &l) in layers.iter().enumerate() {
        for role in Role::layer_roles(cfg) {
            let canon = Canon {
                role,
                layer: Some(l),
            };
            out.push((layer_key(layout, role, j), Some(canon)));
            if layout == KeyLayout::McoreTe {
                for s in te_extra_states(role, cfg) {
                    out.push((vec![format!("decoder.layers.{j}.{s}")], None));
                }
            }
        }
    }
    if last {
        out.push((
            global_key(layout, Role::FinalNorm, cfg.tied),
            Some(global(Role::FinalNorm)),
        ));
        // A tied output layer is only stored on the last stage of a pipeline (it is the
        // embedding, kept in sync by an all-reduce); with one stage it does not exist.
        if !cfg.tied || pp > 1 {
            let source = if cfg.tied {
                Role::Embedding
            } else {
                Role::Output
            };
            out.push((
                global_key(layout, Role::Output, cfg.tied),
                Some(global(source)),
            ));
            if layout == KeyLayout::McoreTe {
                out.push((vec!["output_layer._extra_state".into()], None));
            }
        }
    }
    out
}

/// Flattened key (`.`-joined path), as keys read back from a file are matched.
pub fn flat_key(path: &[String]) -> String {
    path.join(".")
}

/// Normalise a legacy key read from a file to the current names (`*layernorm` names written
/// before 2023-09 are read as `*norm`).
pub fn normalise_legacy(key: &str) -> String {
    key.replace("layernorm", "norm")
        .replace(".attention.", ".self_attention.")
        .replace("language_model.transformer.", "language_model.encoder.")
}

/// Layer index in a key (`…layers.{j}.…`).
pub fn layer_index(key: &str) -> Option<usize> {
    let rest = &key[key.find("layers.")? + 7..];
    rest.split('.').next()?.parse().ok()
}
