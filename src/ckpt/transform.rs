//! What a tensor becomes: the canonical (unsharded, Megatron-ordered) tensors of a model,
//! how HF tensors pack into them (GQA-grouped QKV, `[gate; up]`) and how they split over
//! tensor-parallel ranks and back (`docs/checkpoints.md` §3). Only bytes move, so every
//! round trip is bit-exact.

use crate::arch::family::{hf_names as hf, QkvStyle};
use crate::arch::roles::{canonical_shape, moe_ffn, shared_ffn, Canon, Role};
use crate::arch::ModelConfig;
use crate::tensor::host::Tensor;
use anyhow::{bail, Result};
use std::ops::Range;

/// HF tensor names that make up a canonical tensor, with their shapes.
pub fn hf_parts(cfg: &ModelConfig, c: Canon) -> Vec<(String, Vec<usize>)> {
    let parts = decoder_hf_parts(cfg, c);
    match (cfg.paired, c.layer) {
        (true, Some(l)) => (parts.into_iter())
            .map(|(name, shape)| (paired_hf_name(&name, l), shape))
            .collect(),
        _ => parts,
    }
}

/// A paired model's HF name of decoder layer `l`'s tensor `name` (transformers 4.57's
/// `LongcatFlashDecoderLayer`): layer `l / 2`'s sublayer `l % 2`
/// (`input_layernorm.{s}`, `self_attn.{s}`, `post_attention_layernorm.{s}`, the dense MLP
/// `mlps.{s}`), the shortcut experts the layer's own `mlp`.
fn paired_hf_name(name: &str, l: usize) -> String {
    let (prefix, s) = (hf::layer(l, ""), l % 2);
    let Some(rest) = name.strip_prefix(&prefix) else {
        return name.to_string();
    };
    let sublayer = [
        "input_layernorm.",
        "self_attn.",
        "post_attention_layernorm.",
    ]
    .iter()
    .find_map(|m| rest.strip_prefix(m).map(|tail| format!("{m}{s}.{tail}")));
    let dense = ["gate_proj.", "up_proj.", "down_proj."]
        .iter()
        .find_map(|p| {
            rest.strip_prefix("mlp.")
                .and_then(|r| r.strip_prefix(p))
                .map(|t| format!("mlps.{s}.{p}{t}"))
        });
    hf::layer(
        l / 2,
        &sublayer.or(dense).unwrap_or_else(|| rest.to_string()),
    )
}

/// [`hf_parts`] of a decoder whose every layer is one HF layer.
fn decoder_hf_parts(cfg: &ModelConfig, c: Canon) -> Vec<(String, Vec<usize>)> {
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
        Role::InputNormBias => one(hf::layer(l, &bias_of(hf::INPUT_NORM))),
        Role::PostNormBias => one(hf::layer(l, &bias_of(hf::POST_NORM))),
        Role::FinalNormBias => one(bias_of(hf::FINAL_NORM)),
        Role::OutputBias => one(bias_of(hf::LM_HEAD)),
        Role::Qkv => qkv("weight", qkv_rows, &[h]),
        Role::QkvBias => qkv("bias", qkv_rows, &[]),
        Role::Proj => one(hf::layer(l, &format!("{}.weight", hf::O_PROJ))),
        Role::ProjBias => one(hf::layer(l, &format!("{}.bias", hf::O_PROJ))),
        Role::Fc1 => hf::GATE_UP
            .iter()
            .map(|p| (hf::layer(l, p), vec![cfg.ffn, h]))
            .collect(),
        Role::Up => one(hf::layer(l, hf::GATE_UP[1])),
        Role::Fc2 => one(hf::layer(l, hf::DOWN)),
        Role::QNorm => one(hf::layer(l, hf::QK_NORM[0])),
        Role::KNorm => one(hf::layer(l, hf::QK_NORM[1])),
        Role::QDown => one(hf::layer(l, hf::MLA_Q[0])),
        Role::QLatentNorm => one(hf::layer(l, hf::MLA_Q[1])),
        Role::QUp => one(hf::layer(l, hf::MLA_Q[2])),
        Role::QProj => one(hf::layer(l, hf::MLA_Q[3])),
        Role::KvDown => one(hf::layer(l, hf::MLA_KV[0])),
        Role::KvLatentNorm => one(hf::layer(l, hf::MLA_KV[1])),
        Role::KvUp => one(hf::layer(l, hf::MLA_KV[2])),
        Role::MtpEmbedNorm => one(hf::layer(l, hf::MTP[0])),
        Role::MtpHiddenNorm => one(hf::layer(l, hf::MTP[1])),
        Role::MtpProj => one(hf::layer(l, hf::MTP[2])),
        Role::MtpNorm => one(hf::layer(l, hf::MTP[3])),
        // DeepSeek-V3.2's and GLM-5's (MindSpeed-LLM configs/checkpoint/model_cfg.json)
        Role::IndexerQUp => one(hf::layer(l, "self_attn.indexer.wq_b.weight")),
        Role::IndexerKey => one(hf::layer(l, "self_attn.indexer.wk.weight")),
        Role::IndexerKeyNorm => one(hf::layer(l, "self_attn.indexer.k_norm.weight")),
        Role::IndexerKeyNormBias => one(hf::layer(l, "self_attn.indexer.k_norm.bias")),
        Role::IndexerWeights => one(hf::layer(l, "self_attn.indexer.weights_proj.weight")),
        Role::QkvDown => {
            let m = cfg
                .mla
                .expect("fused down projections are multi-latent attention's");
            let q = match m.q_lora_rank {
                Some(_) => hf::MLA_Q[0],
                None => hf::MLA_Q[3],
            };
            let kv = m.kv_lora_rank + m.rope_dim;
            vec![
                (hf::layer(l, q), vec![m.q_rank(cfg.heads), h]),
                (hf::layer(l, hf::MLA_KV[0]), vec![kv, h]),
            ]
        }
        role => moe_parts(cfg, l, role),
    }
}

/// The bias beside HF weight `name` (`….weight` → `….bias`).
fn bias_of(name: &str) -> String {
    format!("{}.bias", name.trim_end_matches(".weight"))
}

/// The HF tensors of an MoE block's role in layer `l` (`{block}.gate`, `{block}.experts.{e}.*`,
/// the shared expert and its gate), with their shapes.
fn moe_parts(cfg: &ModelConfig, l: usize, role: Role) -> Vec<(String, Vec<usize>)> {
    let names = cfg.family.moe.as_ref();
    let block = names.map_or("mlp", |n| n.block);
    let expert = names.map_or(["gate_proj", "up_proj", "down_proj"], |n| n.expert);
    let shared = names
        .and_then(|n| n.shared.as_ref())
        .map_or("shared_expert", |s| s.module);
    let name = |suffix: String| hf::layer(l, &format!("{block}.{suffix}.weight"));
    let h = cfg.hidden;
    let swiglu = |stem: String, ffn: usize, names: [&str; 3], fc1: bool| {
        if fc1 {
            (names[..2].iter())
                .map(|p| (name(format!("{stem}.{p}")), vec![ffn, h]))
                .collect()
        } else {
            vec![(name(format!("{stem}.{}", names[2])), vec![h, ffn])]
        }
    };
    let plain = ["gate_proj", "up_proj", "down_proj"];
    match role {
        Role::Router => {
            let router = names.map_or("gate", |n| n.router);
            vec![(name(router.into()), canonical_shape(cfg, role))]
        }
        Role::ExpertBias => (names.and_then(|n| n.expert_bias))
            .map(|key| {
                (
                    hf::layer(l, &format!("{block}.{key}")),
                    canonical_shape(cfg, role),
                )
            })
            .into_iter()
            .collect(),
        Role::SharedGate => vec![(name(format!("{shared}_gate")), vec![1, h])],
        Role::ExpertFc1(e) => swiglu(format!("experts.{e}"), moe_ffn(cfg), expert, true),
        Role::ExpertFc2(e) => swiglu(format!("experts.{e}"), moe_ffn(cfg), expert, false),
        Role::SharedFc1 => swiglu(shared.into(), shared_ffn(cfg), plain, true),
        Role::SharedFc2 => swiglu(shared.into(), shared_ffn(cfg), plain, false),
        other => unreachable!("{other:?} is not an MoE role"),
    }
}

/// The copies of the embedding and of the output layer that each multi-token prediction depth
/// carries in DeepSeek-V3's HF checkpoints (`model.layers.{l}.embed_tokens.weight`,
/// `model.layers.{l}.shared_head.head.weight`: the model's own, as DeepSeek ships them and
/// MindSpeed-LLM's mcore2hf writes them), with the canonical tensor each copies.
pub fn hf_copies(cfg: &ModelConfig) -> Vec<(String, Canon)> {
    let global = |role| Canon { role, layer: None };
    let head = match cfg.tied {
        true => Role::Embedding,
        false => Role::Output,
    };
    (cfg.layers..cfg.all_layers())
        .flat_map(|l| {
            [
                (hf::layer(l, hf::MTP_COPIES[0]), global(Role::Embedding)),
                (hf::layer(l, hf::MTP_COPIES[1]), global(head)),
            ]
        })
        .collect()
}

/// Where the rows of one HF part go in the canonical tensor: `(part row, canonical row, rows)`.
pub type RowBlock = (usize, usize, usize);

/// For each HF part (in [`hf_parts`] order), the blocks of rows it contributes to the canonical
/// tensor. QKV is grouped per KV group as `[q_g; k_g; v_g]` (docs/checkpoints.md §3.1), from
/// separate q/k/v tensors or from Baichuan's `W_pack` rows `[q; k; v]`; `[gate; up]` is a
/// concatenation; everything else is the identity.
pub fn hf_row_blocks(cfg: &ModelConfig, c: Canon) -> Vec<Vec<RowBlock>> {
    let d = cfg.head_dim;
    let qg = cfg.heads / cfg.groups * d;
    let per = qg + 2 * d;
    // (rows per group, offset inside a canonical group) for q, k, v.
    let qkv = [(qg, 0), (d, qg), (d, qg + d)];
    let grouped = |(n, within): (usize, usize), part_base: usize| -> Vec<RowBlock> {
        (0..cfg.groups)
            .map(|g| (part_base + g * n, g * per + within, n))
            .collect()
    };
    match (c.role, cfg.family.qkv) {
        (Role::Qkv | Role::QkvBias, QkvStyle::Separate) => {
            qkv.iter().map(|&q| grouped(q, 0)).collect()
        }
        (Role::Qkv | Role::QkvBias, QkvStyle::Packed) => {
            let bases = [0, cfg.heads * d, (cfg.heads + cfg.groups) * d];
            vec![qkv
                .iter()
                .zip(bases)
                .flat_map(|(&q, b)| grouped(q, b))
                .collect()]
        }
        (Role::Fc1 | Role::ExpertFc1(_) | Role::SharedFc1, _) => {
            let f = canonical_shape(cfg, c.role)[0] / 2;
            vec![vec![(0, 0, f)], vec![(0, f, f)]]
        }
        (Role::QkvDown, _) => {
            let parts = hf_parts(cfg, c);
            let (q, kv) = (parts[0].1[0], parts[1].1[0]);
            vec![vec![(0, 0, q)], vec![(0, q, kv)]]
        }
        (role, _) => vec![vec![(0, 0, canonical_shape(cfg, role)[0])]],
    }
}

/// HF tensors (as [`hf_parts`] lists them) → the canonical tensor.
pub fn from_hf(cfg: &ModelConfig, c: Canon, parts: Vec<Tensor>) -> Tensor {
    let blocks = hf_row_blocks(cfg, c);
    if blocks.len() == 1 && blocks[0].len() == 1 {
        return parts.into_iter().next().expect("one part");
    }
    let first = &parts[0];
    let row_bytes = first.data.len() / first.shape[0].max(1);
    let shape = canonical_shape(cfg, c.role);
    let mut data = vec![0u8; shape[0] * row_bytes];
    for (part, blocks) in parts.iter().zip(&blocks) {
        for &(src, dst, n) in blocks {
            data[dst * row_bytes..(dst + n) * row_bytes]
                .copy_from_slice(&part.data[src * row_bytes..(src + n) * row_bytes]);
        }
    }
    Tensor::new(first.dtype, shape, data)
}

/// The canonical tensor → HF tensors, in [`hf_parts`] order.
pub fn to_hf(cfg: &ModelConfig, c: Canon, t: Tensor) -> Vec<Tensor> {
    let blocks = hf_row_blocks(cfg, c);
    if blocks.len() == 1 && blocks[0].len() == 1 {
        return vec![t];
    }
    let row_bytes = t.data.len() / t.shape[0].max(1);
    hf_parts(cfg, c)
        .into_iter()
        .zip(&blocks)
        .map(|((_, shape), blocks)| {
            let mut data = vec![0u8; shape[0] * row_bytes];
            for &(src, dst, n) in blocks {
                data[src * row_bytes..(src + n) * row_bytes]
                    .copy_from_slice(&t.data[dst * row_bytes..(dst + n) * row_bytes]);
            }
            Tensor::new(t.dtype, shape, data)
        })
        .collect()
}

/// Where canonical tensor `c` of a model comes from in `source`, the same model with its
/// multi-latent attention's projections laid out the other way: the down projections fused
/// into MindSpeed-LLM's one `linear_qkv` or apart as megatron-core's, the up projections whole
/// or split by `--mla-mm-split`. The source's tensors and their rows, stacked in order; `None`
/// where `c` is the source's own.
pub fn regrouped_from(source: &ModelConfig, c: Canon) -> Option<Vec<(Canon, Range<usize>)>> {
    let m = source.mla?;
    let (q, kv) = (m.q_rank(source.heads), m.kv_lora_rank + m.rope_dim);
    let at = |role| Canon { role, ..c };
    let q_role = match m.q_lora_rank {
        Some(_) => Role::QDown,
        None => Role::QProj,
    };
    match (m.fused_down, c.role) {
        (true, Role::QDown | Role::QProj) => return Some(vec![(at(Role::QkvDown), 0..q)]),
        (true, Role::KvDown) => return Some(vec![(at(Role::QkvDown), q..q + kv)]),
        (false, Role::QkvDown) => return Some(vec![(at(q_role), 0..q), (at(Role::KvDown), 0..kv)]),
        _ => {}
    }
    // each head's rows of the whole up projection: its first part's, then its second's
    let (up, widths) = match c.role {
        Role::QUp | Role::QUpNope | Role::QUpRope => (Role::QUp, [m.qk_head_dim, m.rope_dim]),
        Role::KvUp | Role::KvUpNope | Role::ValueUp => (Role::KvUp, [m.qk_head_dim, m.v_head_dim]),
        _ => return None,
    };
    let parts = up.up_parts()?;
    let whole = widths[0] + widths[1];
    let heads = 0..source.heads;
    match (m.split_up, c.role == up) {
        (true, true) => Some(
            heads
                .flat_map(|h| (0..2).map(move |i| (i, h)))
                .map(|(i, h)| (at(parts[i]), h * widths[i]..(h + 1) * widths[i]))
                .collect(),
        ),
        (false, false) => {
            let (i, start) = match c.role == parts[0] {
                true => (0, 0),
                false => (1, widths[0]),
            };
            let rows = |h: usize| h * whole + start..h * whole + start + widths[i];
            Some(heads.map(|h| (at(up), rows(h))).collect())
        }
        _ => None,
    }
}

/// Canonical tensor `c` of a model read from `source`, the same model laid out as
/// [`regrouped_from`] allows, by `read` (which reads one of the source's own, each once).
pub fn read_regrouped(
    source: &ModelConfig,
    c: Canon,
    read: &dyn Fn(Canon) -> Result<Tensor>,
) -> Result<Tensor> {
    let Some(parts) = regrouped_from(source, c) else {
        return read(c);
    };
    let mut read_once: Vec<(Canon, Tensor)> = Vec::new();
    let mut rows = Vec::with_capacity(parts.len());
    for (from, r) in parts {
        let at = match read_once.iter().position(|(c, _)| *c == from) {
            Some(at) => at,
            None => {
                read_once.push((from, read(from)?));
                read_once.len() - 1
            }
        };
        rows.push(read_once[at].1.rows(r.start, r.end));
    }
    Ok(Tensor::cat_rows(&rows))
}

/// How a role is laid out over TP ranks (docs/checkpoints.md §3.4).
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
        // The q/k norms act on one head's dimension: every rank holds them whole for its heads
        // (MindSpeed-LLM's convert_hf2mg.py copies them to every rank).
        Role::InputNorm
        | Role::PostNorm
        | Role::FinalNorm
        | Role::InputNormBias
        | Role::PostNormBias
        | Role::FinalNormBias
        | Role::ProjBias
        | Role::QNorm
        | Role::KNorm
        | Role::Router
        | Role::ExpertBias
        | Role::SharedGate
        | Role::QLatentNorm
        | Role::KvLatentNorm
        | Role::MtpEmbedNorm
        | Role::MtpHiddenNorm
        | Role::MtpNorm
        // MindSpeed-LLM's `LinearNoTP` (multi_latent_attention.py `get_mla_self_attn_submodules`,
        // dsa_indexer.py `get_dsa_indexer_spec`)
        | Role::QkvDown
        | Role::IndexerQUp
        | Role::IndexerKey
        | Role::IndexerKeyNorm
        | Role::IndexerKeyNormBias
        | Role::IndexerWeights => Split::Replicated,
        // Multi-latent attention's projections are column-parallel, the down projections too
        // (megatron-core gpt_layer_specs.py, local spec: `ColumnParallelLinear`, their outputs
        // gathered), the up projections' rows whole heads.
        Role::QDown | Role::KvDown | Role::QUp | Role::QProj | Role::KvUp => Split::Rows,
        // MindSpeed-LLM's split up projections: column-parallel too, each rank its heads' rows
        Role::QUpNope | Role::QUpRope | Role::KvUpNope | Role::ValueUp => Split::Rows,
        Role::Qkv | Role::QkvBias => Split::Rows,
        // a non-gated fc1's rows are one projection's: plain column-parallel chunks
        Role::Up => Split::Rows,
        // megatron-core's MTP `eh_proj` is a column-parallel linear layer
        Role::MtpProj => Split::Rows,
        Role::Proj | Role::Fc2 | Role::ExpertFc2(_) | Role::SharedFc2 => Split::Cols,
        Role::Embedding | Role::Output | Role::OutputBias => Split::Vocab,
        Role::Fc1 | Role::ExpertFc1(_) | Role::SharedFc1 => Split::GateUp,
    }
}

/// Whether tensor parallelism splits a role (Megatron's `tensor_model_parallel` attribute);
/// every TP rank holds a copy of the others.
pub fn is_tp_split(role: Role) -> bool {
    split_of(role) != Split::Replicated
}

/// Whether a role is a row-parallel linear layer (split on its input dimension: attention
/// output, fc2). Its LoRA `A` is split like it and `B` replicated; column-parallel layers
/// (qkv, fc1) split `B` and replicate `A` (docs/checkpoints.md §6.2).
pub fn is_row_parallel(role: Role) -> bool {
    split_of(role) == Split::Cols
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

/// Where tensor-parallel rank `r`'s shard (of shape `shard`, one of `tp`) lies in the
/// canonical tensor (its vocabulary padded): each block of the shard's rows with the offsets
/// it starts at there — one block, or SwiGLU's gate and up halves, which lie apart.
pub fn shard_places(
    role: Role,
    shard: &[usize],
    r: usize,
    tp: usize,
) -> Vec<(Range<usize>, Vec<usize>)> {
    let rows = shard.first().copied().unwrap_or(1);
    let at = |axis: usize, offset: usize| {
        let mut o = vec![0; shard.len()];
        o[axis] = offset;
        o
    };
    match split_of(role) {
        Split::Replicated => vec![(0..rows, vec![0; shard.len()])],
        Split::Rows | Split::Vocab => vec![(0..rows, at(0, r * rows))],
        Split::Cols => vec![(0..rows, at(1, r * shard[1]))],
        Split::GateUp => {
            let n = rows / 2;
            vec![(0..n, at(0, r * n)), (n..rows, at(0, n * tp + r * n))]
        }
    }
}

/// Rank `r`'s shard of the canonical tensor `t` ([`tp_shard`]'s bytes) as parts to write one
/// after the other, borrowed from `t` where the shard is made of its rows (every split but the
/// column split, for which `None`): the writer then holds no copy of a large tensor's shard.
pub fn shard_row_parts<'a>(
    role: Role,
    t: &'a Tensor,
    r: usize,
    tp: usize,
    padded_vocab: usize,
) -> Option<Vec<std::borrow::Cow<'a, [u8]>>> {
    use std::borrow::Cow;
    let rb = t.data.len() / t.shape.first().copied().unwrap_or(1).max(1);
    let rows = |from: usize, to: usize| Cow::Borrowed(&t.data[from * rb..to * rb]);
    Some(match split_of(role) {
        Split::Replicated => vec![Cow::Borrowed(&t.data[..])],
        Split::Rows => {
            let n = t.shape[0] / tp;
            vec![rows(r * n, (r + 1) * n)]
        }
        Split::Cols => return None,
        Split::Vocab => {
            // rows past the real ones are copies of the last (Tensor::rows_padded)
            let (n, have) = (padded_vocab / tp, t.shape[0]);
            let (from, to) = (r * n, (r + 1) * n);
            let mut parts = vec![rows(from.min(have), to.min(have))];
            let pad = to.saturating_sub(from.max(have));
            if pad > 0 && have > 0 {
                parts.push(Cow::Owned(rows(have - 1, have).repeat(pad)));
            }
            parts
        }
        Split::GateUp => {
            let f = t.shape[0] / 2;
            let n = f / tp;
            vec![rows(r * n, (r + 1) * n), rows(f + r * n, f + (r + 1) * n)]
        }
    })
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::DType;

    /// A role of each tensor-parallel split: replicated, rows, columns, vocabulary, gate/up.
    const ONE_OF_EACH_SPLIT: [Role; 5] = [
        Role::InputNorm,
        Role::Qkv,
        Role::Proj,
        Role::Embedding,
        Role::Fc1,
    ];

    #[test]
    fn shard_places_put_every_shard_back_where_it_came_from() {
        // 8 rows × 4 f32 columns (SwiGLU: 4 gate rows, 4 up rows); 12 padded vocabulary rows
        let t = Tensor::new(DType::F32, vec![8, 4], (0..128).map(|b| b as u8).collect());
        let (tp, padded) = (2, 12);
        for role in ONE_OF_EACH_SPLIT {
            let whole = match role {
                Role::Embedding => t.rows_padded(0, padded),
                _ => t.clone(),
            };
            let mut rebuilt = vec![0u8; whole.data.len()];
            for r in 0..tp {
                let shard = tp_shard(role, &t, r, tp, padded);
                let row_bytes = shard.data.len() / shard.shape[0];
                for (rows, at) in shard_places(role, &shard.shape, r, tp) {
                    for (i, row) in rows.enumerate() {
                        let from = (at[0] + i) * whole.row_bytes() + at[1] * 4;
                        let src = &shard.data[row * row_bytes..(row + 1) * row_bytes];
                        rebuilt[from..from + row_bytes].copy_from_slice(src);
                    }
                }
            }
            assert_eq!(rebuilt, whole.data, "{role:?}");
        }
    }

    #[test]
    fn row_parts_are_the_shards_bytes() {
        // a 10-row canonical tensor of 3 columns, 16 padded vocabulary rows over TP 4
        let t = Tensor::new(DType::F32, vec![10, 3], (0..120).map(|b| b as u8).collect());
        for role in ONE_OF_EACH_SPLIT {
            for r in 0..2 {
                let tp = if role == Role::Embedding { 4 } else { 2 };
                let shard = tp_shard(role, &t, r + 2 * (tp == 4) as usize, tp, 16);
                let parts = shard_row_parts(role, &t, r + 2 * (tp == 4) as usize, tp, 16);
                match parts {
                    Some(p) => assert_eq!(p.concat(), shard.data, "{role:?} rank {r}"),
                    None => assert_eq!(role, Role::Proj),
                }
            }
        }
    }
}
