//! The LLaMA-family decoder (llama 1/2/3, mistral, qwen2, internlm, baichuan, aquila): its
//! configuration and its forward pass, written once against the engine's [`Backend`].
//!
//! Weights are the checkpoint module's canonical tensors (Megatron order: GQA-grouped fused
//! QKV, `[gate; up]`), so an HF directory and a Megatron checkpoint of any TP/PP load the same
//! way and the fused projections map onto single matmuls.

pub mod generate;
pub mod llama;
pub mod params;
mod rope;

use crate::arch::roles::{canonical, Canon, Role};
use crate::arch::ModelConfig;
use crate::ckpt::convert::open_checkpoint;
use crate::engine::{AttentionShape, Backend, Segment};
use anyhow::{anyhow, bail, Result};
use rayon::prelude::*;
use rope::Rope;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// What the forward pass needs to know of a model.
#[derive(Debug, Clone)]
pub struct ModelSpec {
    /// Decoder layers.
    pub layers: usize,
    /// Hidden size.
    pub hidden: usize,
    /// Attention heads / key-value heads / per-head dimension.
    pub attention: AttentionShape,
    /// Vocabulary rows.
    pub vocab: usize,
    /// Positions the model was trained for.
    pub max_positions: usize,
    /// RMSNorm epsilon.
    pub norm_eps: f64,
    /// Rotary embedding.
    rope: Rope,
}

impl ModelSpec {
    /// `cos` and `sin` `[positions, head_dim / 2]` of the rotary embedding at `positions`.
    pub fn rope_tables(&self, positions: &[usize]) -> (Vec<f32>, Vec<f32>) {
        self.rope.tables(positions)
    }

    /// From a checkpoint's configuration (HF `config.json` or Megatron args).
    pub fn from_config(cfg: &ModelConfig) -> Result<Self> {
        Ok(ModelSpec {
            layers: cfg.layers,
            hidden: cfg.hidden,
            attention: AttentionShape {
                heads: cfg.heads,
                groups: cfg.groups,
                head_dim: cfg.head_dim,
                scale: 1.0 / (cfg.head_dim as f32).sqrt(),
            },
            vocab: cfg.vocab,
            max_positions: cfg.max_positions,
            norm_eps: cfg.norm_eps,
            rope: Rope::new(cfg)?,
        })
    }

    /// One tensor-parallel rank's part of the model over `tp` ranks: its heads and query
    /// groups (Megatron splits both; every rank keeps the whole hidden size).
    pub fn tensor_parallel(mut self, tp: usize) -> Self {
        self.attention.heads /= tp;
        self.attention.groups /= tp;
        self
    }
}

/// One decoder layer's weights.
struct Layer<T> {
    input_norm: T,
    qkv: T,
    qkv_bias: Option<T>,
    proj: T,
    proj_bias: Option<T>,
    post_norm: T,
    fc1: T,
    fc2: T,
}

/// A loaded model on a backend.
pub struct Model<'b, B: Backend> {
    backend: &'b B,
    /// Its configuration.
    pub spec: ModelSpec,
    embedding: B::Tensor,
    layers: Vec<Layer<B::Tensor>>,
    final_norm: B::Tensor,
    /// `None` when tied to the embedding.
    output: Option<B::Tensor>,
    /// The files it was loaded from.
    source_files: Vec<PathBuf>,
}

/// The keys and values of every layer for `slots` sequences of up to `capacity` positions.
pub struct KvCache<T> {
    keys: Vec<T>,
    values: Vec<T>,
    capacity: usize,
}

impl<T> KvCache<T> {
    /// Positions a slot holds at most.
    pub fn capacity(&self) -> usize {
        self.capacity
    }
}

/// New tokens of one sequence: its cache slot, the positions already cached, the tokens.
#[derive(Debug, Clone, Copy)]
pub struct Step<'a> {
    /// KV-cache slot.
    pub slot: usize,
    /// Tokens of this sequence already in the cache.
    pub past: usize,
    /// The new tokens.
    pub tokens: &'a [u32],
}

impl<'b, B: Backend> Model<'b, B> {
    /// Load a checkpoint directory (HF, or Megatron of any TP/PP/layout) onto `backend`,
    /// tensors read in parallel and kept in their stored dtype.
    pub fn load(backend: &'b B, dir: &Path) -> Result<Self> {
        let input = open_checkpoint(dir, None, None)?;
        if input.lora_tensors() > 0 {
            bail!(
                "{} holds LoRA tensors; merge them first (`mindkit lora merge`)",
                dir.display()
            );
        }
        let spec = ModelSpec::from_config(&input.cfg)?;
        let canon = canonical(&input.cfg);
        let loaded: Vec<B::Tensor> = canon
            .par_iter()
            .map(|&c| {
                let t = input.read(c)?;
                let matrix = matches!(
                    c.role,
                    Role::Qkv | Role::Proj | Role::Fc1 | Role::Fc2 | Role::Output
                );
                if matrix {
                    backend.upload_matrix(&t)
                } else {
                    backend.upload(&t)
                }
                .map_err(|e| anyhow!("{}: {c:?}: {e}", dir.display()))
            })
            .collect::<Result<_>>()?;
        let mut by_canon: HashMap<Canon, B::Tensor> = canon.into_iter().zip(loaded).collect();
        let mut take = |role, layer| {
            by_canon
                .remove(&Canon { role, layer })
                .ok_or_else(|| anyhow!("internal: {role:?} of layer {layer:?} was not loaded"))
        };
        let mut layers = Vec::with_capacity(spec.layers);
        for l in 0..spec.layers {
            let at = Some(l);
            layers.push(Layer {
                input_norm: take(Role::InputNorm, at)?,
                qkv: take(Role::Qkv, at)?,
                qkv_bias: input
                    .cfg
                    .qkv_bias
                    .then(|| take(Role::QkvBias, at))
                    .transpose()?,
                proj: take(Role::Proj, at)?,
                proj_bias: input
                    .cfg
                    .proj_bias
                    .then(|| take(Role::ProjBias, at))
                    .transpose()?,
                post_norm: take(Role::PostNorm, at)?,
                fc1: take(Role::Fc1, at)?,
                fc2: take(Role::Fc2, at)?,
            });
        }
        Ok(Model {
            backend,
            embedding: take(Role::Embedding, None)?,
            final_norm: take(Role::FinalNorm, None)?,
            output: (!input.cfg.tied)
                .then(|| take(Role::Output, None))
                .transpose()?,
            layers,
            spec,
            source_files: input.files(),
        })
    }

    /// The files (configuration and weights) it was loaded from.
    pub fn source_files(&self) -> &[PathBuf] {
        &self.source_files
    }

    /// An empty cache for `slots` sequences of up to `capacity` positions.
    pub fn cache(&self, slots: usize, capacity: usize) -> Result<KvCache<B::Tensor>> {
        let a = self.spec.attention;
        let width = a.groups * a.head_dim;
        let make = || -> Result<Vec<B::Tensor>> {
            (0..self.spec.layers)
                .map(|_| Ok(self.backend.kv_cache(slots, capacity, width)?))
                .collect()
        };
        Ok(KvCache {
            keys: make()?,
            values: make()?,
            capacity,
        })
    }

    /// Run the new tokens of `steps` (a ragged batch) through the model, extending `cache`;
    /// returns the logits `[rows.len(), vocab]` of the given rows of the batch (rows count
    /// through the steps' tokens in order).
    pub fn forward(
        &self,
        cache: &mut KvCache<B::Tensor>,
        steps: &[Step],
        rows: &[usize],
    ) -> Result<B::Tensor> {
        let b = self.backend;
        let spec = &self.spec;
        let mut ids = Vec::new();
        let mut positions = Vec::new();
        let mut segments = Vec::with_capacity(steps.len());
        for s in steps {
            if s.past + s.tokens.len() > cache.capacity {
                bail!(
                    "{} positions do not fit the KV cache of {} (context too long)",
                    s.past + s.tokens.len(),
                    cache.capacity
                );
            }
            if let Some(&t) = s.tokens.iter().find(|&&t| t as usize >= spec.vocab) {
                bail!(
                    "token id {t} is outside the model's vocabulary of {}",
                    spec.vocab
                );
            }
            ids.extend_from_slice(s.tokens);
            positions.extend(s.past..s.past + s.tokens.len());
            segments.push(Segment {
                slot: s.slot,
                past: s.past,
                len: s.tokens.len(),
            });
        }
        if let Some(&r) = rows.iter().find(|&&r| r >= ids.len()) {
            bail!(
                "internal: logits of row {r} asked of a batch of {}",
                ids.len()
            );
        }
        let (cos, sin) = spec.rope.tables(&positions);
        let half = [positions.len(), spec.attention.head_dim / 2];
        let (cos, sin) = (b.upload_f32(&half, &cos)?, b.upload_f32(&half, &sin)?);
        let shape = spec.attention;
        let mut x = b.embedding(&self.embedding, &ids)?;
        for (l, layer) in self.layers.iter().enumerate() {
            let (h, _) = b.rms_norm(&x, &layer.input_norm, spec.norm_eps)?;
            let qkv = b.matmul(&h, &layer.qkv, layer.qkv_bias.as_ref())?;
            let (mut q, mut k, v) = b.split_qkv(&qkv, shape)?;
            b.rope(&mut q, &cos, &sin, false)?;
            b.rope(&mut k, &cos, &sin, false)?;
            b.kv_store(&mut cache.keys[l], &k, &segments)?;
            b.kv_store(&mut cache.values[l], &v, &segments)?;
            let a = b.cached_attention(&q, &cache.keys[l], &cache.values[l], &segments, shape)?;
            b.add_assign(
                &mut x,
                &b.matmul(&a, &layer.proj, layer.proj_bias.as_ref())?,
            )?;
            let (h, _) = b.rms_norm(&x, &layer.post_norm, spec.norm_eps)?;
            let up = b.swiglu(&b.matmul(&h, &layer.fc1, None)?)?;
            b.add_assign(&mut x, &b.matmul(&up, &layer.fc2, None)?)?;
        }
        let (x, _) = b.rms_norm(&b.select_rows(&x, rows)?, &self.final_norm, spec.norm_eps)?;
        Ok(b.matmul(&x, self.output.as_ref().unwrap_or(&self.embedding), None)?)
    }

    /// The backend it runs on.
    pub fn backend(&self) -> &'b B {
        self.backend
    }
}
