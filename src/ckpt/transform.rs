//! What a tensor becomes: the canonical (unsharded, Megatron-ordered) tensors of a model,
//! how HF tensors pack into them (GQA-grouped QKV, `[gate; up]`) and how they split over
//! tensor-parallel ranks and back (`reference/ckpt.md` §3). Only bytes move, so every
//! round trip is bit-exact.

use super::config::ModelConfig;
use super::family::{hf_names as hf, QkvStyle};
use super::tensor::Tensor;
use anyhow::{bail, Result};

/// What a canonical tensor is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// Word embedding `[V, h]`.
    Embedding,
    /// Norm before attention `[h]`.
    InputNorm,
    /// Fused QKV in GQA-group order `[ng(nh/ng+2)d, h]`.
    Qkv,
    /// Its bias.
    QkvBias,
    /// Attention output `[h, nh·d]`.
    Proj,
    /// Its bias `[h]`.
    ProjBias,
    /// Norm before the MLP `[h]`.
    PostNorm,
    /// SwiGLU input `[2F, h]` = `[gate; up]`.
    Fc1,
    /// MLP output `[h, F]`.
    Fc2,
    /// Final norm `[h]`.
    FinalNorm,
    /// Output layer `[V, h]` (untied models).
    Output,
}

/// A canonical tensor: a role, in a (global) layer for layer roles.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Canon {
    /// What it is.
    pub role: Role,
    /// Global layer index for layer roles.
    pub layer: Option<usize>,
}

impl Role {
    /// Roles that repeat per layer, in the order they are written.
    pub fn layer_roles(cfg: &ModelConfig) -> Vec<Role> {
        let mut roles = vec![Role::InputNorm, Role::Qkv];
        if cfg.qkv_bias {
            roles.push(Role::QkvBias);
        }
        roles.push(Role::Proj);
        if cfg.proj_bias {
            roles.push(Role::ProjBias);
        }
        roles.extend([Role::PostNorm, Role::Fc1, Role::Fc2]);
        roles
    }
}

/// Every canonical tensor of the model, in file order.
pub fn canonical(cfg: &ModelConfig) -> Vec<Canon> {
    let global = |role| Canon { role, layer: None };
    let mut out = vec![global(Role::Embedding)];
    let roles = Role::layer_roles(cfg);
    for l in 0..cfg.layers {
        out.extend(roles.iter().map(|&role| Canon {
            role,
            layer: Some(l),
        }));
    }
    out.push(global(Role::FinalNorm));
    if !cfg.tied {
        out.push(global(Role::Output));
    }
    out
}

/// Shape of a canonical tensor (vocab unpadded).
pub fn canonical_shape(cfg: &ModelConfig, role: Role) -> Vec<usize> {
    let qkv_rows = (cfg.heads + 2 * cfg.groups) * cfg.head_dim;
    match role {
        Role::Embedding | Role::Output => vec![cfg.vocab, cfg.hidden],
        Role::InputNorm | Role::PostNorm | Role::FinalNorm | Role::ProjBias => vec![cfg.hidden],
        Role::Qkv => vec![qkv_rows, cfg.hidden],
        Role::QkvBias => vec![qkv_rows],
        Role::Proj => vec![cfg.hidden, cfg.heads * cfg.head_dim],
        Role::Fc1 => vec![2 * cfg.ffn, cfg.hidden],
        Role::Fc2 => vec![cfg.hidden, cfg.ffn],
    }
}

/// HF tensor names that make up a canonical tensor, with their shapes.
pub fn hf_parts(cfg: &ModelConfig, c: Canon) -> Vec<(String, Vec<usize>)> {
    let (h, d) = (cfg.hidden, cfg.head_dim);
    let l = c.layer.unwrap_or(0);
    let one = |name: String| vec![(name, canonical_shape(cfg, c.role))];
    let qkv = |kind: &str, rows: [usize; 3], trailing: &[usize]| -> Vec<(String, Vec<usize>)> {
        let shape = |r: usize| [&[r][..], trailing].concat();
        match cfg.family.qkv {
            QkvStyle::Separate => hf::QKV
                .iter()
                .zip(rows)
                .map(|(p, r)| (hf::layer(l, &format!("{p}.{kind}")), shape(r)))
                .collect(),
            QkvStyle::Packed => vec![(
                hf::layer(l, &format!("{}.{kind}", hf::W_PACK)),
                shape(rows.iter().sum()),
            )],
        }
    };
    let qkv_rows = [cfg.heads * d, cfg.groups * d, cfg.groups * d];
    match c.role {
        Role::Embedding => one(hf::EMBED.into()),
        Role::FinalNorm => one(hf::FINAL_NORM.into()),
        Role::Output => one(hf::LM_HEAD.into()),
        Role::InputNorm => one(hf::layer(l, hf::INPUT_NORM)),
        Role::PostNorm => one(hf::layer(l, hf::POST_NORM)),
        Role::Qkv => qkv("weight", qkv_rows, &[h]),
        Role::QkvBias => qkv("bias", qkv_rows, &[]),
        Role::Proj => one(hf::layer(l, &format!("{}.weight", hf::O_PROJ))),
        Role::ProjBias => one(hf::layer(l, &format!("{}.bias", hf::O_PROJ))),
        Role::Fc1 => hf::GATE_UP
            .iter()
            .map(|p| (hf::layer(l, p), vec![cfg.ffn, h]))
            .collect(),
        Role::Fc2 => one(hf::layer(l, hf::DOWN)),
    }
}

/// q `[nh·d, …]`, k, v `[ng·d, …]` → rows grouped per KV group: `[q_g; k_g; v_g]` for each g.
fn pack_qkv(cfg: &ModelConfig, q: &Tensor, k: &Tensor, v: &Tensor) -> Tensor {
    let d = cfg.head_dim;
    let qg = cfg.heads / cfg.groups * d;
    let mut parts = Vec::with_capacity(3 * cfg.groups);
    for g in 0..cfg.groups {
        parts.push(q.rows(g * qg, (g + 1) * qg));
        parts.push(k.rows(g * d, (g + 1) * d));
        parts.push(v.rows(g * d, (g + 1) * d));
    }
    Tensor::cat_rows(&parts)
}

/// Inverse of [`pack_qkv`].
fn unpack_qkv(cfg: &ModelConfig, qkv: &Tensor) -> [Tensor; 3] {
    let d = cfg.head_dim;
    let qg = cfg.heads / cfg.groups * d;
    let per = qg + 2 * d;
    let (mut q, mut k, mut v) = (vec![], vec![], vec![]);
    for g in 0..cfg.groups {
        let base = g * per;
        q.push(qkv.rows(base, base + qg));
        k.push(qkv.rows(base + qg, base + qg + d));
        v.push(qkv.rows(base + qg + d, base + per));
    }
    [
        Tensor::cat_rows(&q),
        Tensor::cat_rows(&k),
        Tensor::cat_rows(&v),
    ]
}

/// HF tensors (as [`hf_parts`] lists them) → the canonical tensor.
pub fn from_hf(cfg: &ModelConfig, c: Canon, parts: Vec<Tensor>) -> Tensor {
    match (c.role, cfg.family.qkv) {
        (Role::Qkv | Role::QkvBias, QkvStyle::Separate) => {
            pack_qkv(cfg, &parts[0], &parts[1], &parts[2])
        }
        (Role::Qkv | Role::QkvBias, QkvStyle::Packed) => {
            let d = cfg.head_dim;
            let (nq, nk) = (cfg.heads * d, cfg.groups * d);
            let w = &parts[0];
            pack_qkv(
                cfg,
                &w.rows(0, nq),
                &w.rows(nq, nq + nk),
                &w.rows(nq + nk, nq + 2 * nk),
            )
        }
        (Role::Fc1, _) => Tensor::cat_rows(&parts),
        _ => parts.into_iter().next().expect("one part"),
    }
}

/// The canonical tensor → HF tensors, in [`hf_parts`] order.
pub fn to_hf(cfg: &ModelConfig, c: Canon, t: Tensor) -> Vec<Tensor> {
    match (c.role, cfg.family.qkv) {
        (Role::Qkv | Role::QkvBias, QkvStyle::Separate) => unpack_qkv(cfg, &t).into(),
        (Role::Qkv | Role::QkvBias, QkvStyle::Packed) => {
            vec![Tensor::cat_rows(&unpack_qkv(cfg, &t))]
        }
        (Role::Fc1, _) => vec![t.rows(0, cfg.ffn), t.rows(cfg.ffn, 2 * cfg.ffn)],
        _ => vec![t],
    }
}

/// How a role is laid out over TP ranks (ckpt.md §3.4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Split {
    /// Same tensor on every rank.
    Replicated,
    /// Dim-0 chunks.
    Rows,
    /// Dim-1 chunks.
    Cols,
    /// Dim-0 chunks of the vocab-padded tensor.
    Vocab,
    /// Rank r holds `[gate_r; up_r]`.
    GateUp,
}

fn split_of(role: Role) -> Split {
    match role {
        Role::InputNorm | Role::PostNorm | Role::FinalNorm | Role::ProjBias => Split::Replicated,
        Role::Qkv | Role::QkvBias => Split::Rows,
        Role::Proj | Role::Fc2 => Split::Cols,
        Role::Embedding | Role::Output => Split::Vocab,
        Role::Fc1 => Split::GateUp,
    }
}

/// Shape of rank-local shards of a role, given the padded vocabulary.
pub fn shard_shape(cfg: &ModelConfig, role: Role, tp: usize, padded_vocab: usize) -> Vec<usize> {
    let mut shape = canonical_shape(cfg, role);
    match split_of(role) {
        Split::Replicated => {}
        Split::Rows | Split::GateUp => shape[0] /= tp,
        Split::Cols => shape[1] /= tp,
        Split::Vocab => shape[0] = padded_vocab / tp,
    }
    shape
}

/// Rank `r`'s shard of the canonical tensor, built directly (no intermediate padded or
/// re-ordered copy of the whole tensor).
pub fn tp_shard(role: Role, t: &Tensor, r: usize, tp: usize, padded_vocab: usize) -> Tensor {
    match split_of(role) {
        Split::Replicated => t.clone(),
        Split::Rows => {
            let n = t.shape[0] / tp;
            t.rows(r * n, (r + 1) * n)
        }
        Split::Cols => {
            let n = t.shape[1] / tp;
            t.cols(r * n, (r + 1) * n)
        }
        Split::Vocab => {
            let n = padded_vocab / tp;
            t.rows_padded(r * n, (r + 1) * n)
        }
        Split::GateUp => {
            let f = t.shape[0] / 2;
            let n = f / tp;
            Tensor::cat_rows(&[
                t.rows(r * n, (r + 1) * n),
                t.rows(f + r * n, f + (r + 1) * n),
            ])
        }
    }
}

/// Rank shards → the canonical tensor (vocab padding removed: `vocab` rows kept).
pub fn gather_tp(role: Role, shards: &[Tensor], vocab: usize) -> Result<Tensor> {
    Ok(match split_of(role) {
        Split::Replicated => shards[0].clone(),
        Split::Rows => Tensor::cat_rows(shards),
        Split::Cols => Tensor::cat_cols(shards),
        Split::Vocab => {
            let rows: usize = shards.iter().map(|s| s.shape[0]).sum();
            if rows < vocab {
                bail!(
                    "the embedding has {rows} rows over all TP ranks, fewer than the vocabulary {vocab}"
                );
            }
            // Concatenate only the real rows; the padding is dropped without being copied.
            let row_bytes = shards[0].data.len() / shards[0].shape[0].max(1);
            let mut data = Vec::with_capacity(vocab * row_bytes);
            for s in shards {
                let take = (vocab * row_bytes - data.len()).min(s.data.len());
                data.extend_from_slice(&s.data[..take]);
            }
            let mut shape = shards[0].shape.clone();
            shape[0] = vocab;
            Tensor::new(shards[0].dtype, shape, data)
        }
        Split::GateUp => {
            // Rank r holds [gate_r; up_r]: all gate halves first, then all up halves.
            let mut data = Vec::with_capacity(shards.iter().map(|s| s.data.len()).sum());
            for half in 0..2 {
                for s in shards {
                    let h = s.data.len() / 2;
                    data.extend_from_slice(&s.data[half * h..(half + 1) * h]);
                }
            }
            let mut shape = shards[0].shape.clone();
            shape[0] = shards.iter().map(|s| s.shape[0]).sum();
            Tensor::new(shards[0].dtype, shape, data)
        }
    })
}
