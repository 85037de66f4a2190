//! The decoder of every model family mindkit runs, written once against the engine's
//! [`Backend`]: one [`layer`] composed of an attention kind ([`attention`]) and an MLP kind
//! ([`mlp`]), stacked for training ([`decoder`]: forward returning what the backward pass
//! needs, backward consuming it) and for inference ([`Model`]: the same layer over a KV
//! cache), over one parameter representation (the [`params::ParamTable`]'s tensors).
//!
//! Weights are the checkpoint module's canonical tensors (Megatron order: GQA-grouped fused
//! QKV, `[gate; up]`), so an HF directory and a Megatron checkpoint of any TP/PP load the same
//! way and the fused projections map onto single matmuls.

mod attention;
mod columns;
pub mod decoder;
pub mod dropout;
pub mod generate;
mod layer;
mod linear;
mod mlp;
mod mtp;
mod norm;
pub mod parallel;
pub mod params;
mod rope;

use crate::arch::roles::{Canon, Role};
use crate::arch::ModelConfig;
use crate::ckpt::convert::open_checkpoint;
use crate::ckpt::transform;
use crate::engine::{AttentionShape, Backend, Segment};
use anyhow::{anyhow, bail, Result};
use attention::{Absorbed, Attend};
use decoder::Ids;
use parallel::TensorParallel;
use params::ParamTable;
use rayon::prelude::*;
use rope::Rope;
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
    /// Multi-latent attention's latent norms' epsilon
    /// ([`crate::arch::ModelConfig::latent_norm_eps`], else `norm_eps`).
    pub latent_eps: f64,
    /// Multi-latent attention's shape (its attention then has as many key-value heads as
    /// query heads, the values padded to the queries' dimensions; its KV cache holds the
    /// compressed latent instead).
    pub mla: Option<crate::arch::Mla>,
    /// The experts of a mixture-of-experts model (how its tokens are routed).
    pub moe: Option<crate::arch::moe::Moe>,
    /// The router's product in f32 under bf16 weights (`--moe-router-dtype fp32`,
    /// MindSpeed-LLM's `--router-gating-in-fp32`), its logits and routing weights f32.
    pub router_f32: bool,
    /// Token dropping (`--moe-expert-capacity-factor`; none: dropless).
    pub capacity: Option<crate::arch::moe::Capacity>,
    /// Multi-token prediction (training only: inference reads the main model).
    pub mtp: Option<crate::arch::Mtp>,
    /// Rotary embedding.
    rope: Rope,
}

impl ModelSpec {
    /// `cos` and `sin` `[positions, rotary_dim / 2]` of the rotary embedding at `positions`.
    pub fn rope_tables(&self, positions: &[usize]) -> (Vec<f32>, Vec<f32>) {
        self.rope.tables(positions)
    }

    /// The shape `[positions, rotary_dim / 2]` of the tables of `positions` positions.
    pub fn rope_table_shape(&self, positions: usize) -> [usize; 2] {
        [positions, self.rope.frequencies()]
    }

    /// Whether a position's rotation depends on the running length of its forward pass
    /// (LongRoPE's factors switch with it): then a cached prefix is only valid for passes of
    /// its own length.
    pub fn rope_depends_on_length(&self) -> bool {
        self.rope.switches_after().is_some()
    }

    /// From a checkpoint's configuration (HF `config.json` or Megatron args).
    pub fn from_config(cfg: &ModelConfig) -> Result<Self> {
        Self::at_length(cfg, None)
    }

    /// From a checkpoint's configuration, for a model run at `seq_length` positions (training:
    /// it chooses LongRoPE's factors as MindSpeed-LLM does).
    pub fn at_length(cfg: &ModelConfig, seq_length: Option<usize>) -> Result<Self> {
        Ok(ModelSpec {
            layers: cfg.layers,
            hidden: cfg.hidden,
            attention: AttentionShape {
                heads: cfg.heads,
                groups: cfg.groups,
                head_dim: cfg.head_dim,
                scale: match cfg.mla {
                    Some(m) => rope::mla_softmax_scale(cfg, m.q_head_dim()),
                    None => 1.0 / (cfg.head_dim as f32).sqrt(),
                },
            },
            vocab: cfg.vocab,
            max_positions: cfg.max_positions,
            norm_eps: cfg.norm_eps,
            latent_eps: cfg.latent_norm_eps.unwrap_or(cfg.norm_eps),
            mla: cfg.mla,
            moe: cfg.moe.clone(),
            // transformers' router of the family (Glm4MoeTopkRouter) is f32 whatever the weights
            router_f32: cfg.family.moe.as_ref().is_some_and(|m| m.router_f32),
            capacity: None,
            mtp: cfg.mtp,
            rope: Rope::new(cfg, seq_length)?,
        })
    }

    /// Whether a multi-token prediction depth is handed the hidden state normed
    /// (megatron-core's layout) rather than as it leaves the decoder or depth before.
    pub fn mtp_normed_handoff(&self) -> bool {
        self.mtp
            .is_some_and(|m| m.layout == crate::arch::MtpLayout::Mcore)
    }

    /// One tensor-parallel rank's part of the model over `tp` ranks: its heads and query
    /// groups (Megatron splits both; every rank keeps the whole hidden size).
    pub fn tensor_parallel(mut self, tp: usize) -> Self {
        self.attention.heads /= tp;
        self.attention.groups /= tp;
        self
    }
}

pub use mlp::moe::losses::{AuxLosses, Balancing, LossValues, RouterStats};

/// DeepSeek sparse attention's indexer loss in training ([`crate::arch::Dsa`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct IndexerLoss {
    /// `--indexer-loss-coeff`.
    pub coeff: f32,
    /// The main loss's backward scale, which its gradient takes (MindSpeed-LLM's
    /// dsa_indexer.py `forward_step_dsa_wrapper`: 1 / the micro-batches of a step, 1 with
    /// `--calculate-per-token-loss`).
    pub scale: f32,
}

/// What every layer of one pass reads: the backend, the model's shape, the parameters (as
/// the [`ParamTable`] indexes them) and which are trained, LoRA's scale, the tensor-parallel
/// group, the rotary tables `cos`, `sin` `[T, d/2]` of the pass's rows, and training's
/// dropout and MoE auxiliary losses.
struct Pass<'a, B: Backend> {
    b: &'a B,
    spec: &'a ModelSpec,
    params: &'a [B::Tensor],
    trainable: &'a [bool],
    lora_scale: f32,
    tp: Option<&'a TensorParallel<'a, B::Tensor>>,
    ep: parallel::ExpertGroup<'a, B::Tensor>,
    /// The ranks each routed expert is split over ([`parallel::ExpertGroups`]).
    etp: Option<&'a TensorParallel<'a, B::Tensor>>,
    rope: (&'a B::Tensor, &'a B::Tensor),
    dropout: Option<&'a dropout::Dropout>,
    aux: Option<&'a AuxLosses>,
    /// DeepSeek sparse attention's indexer loss (training).
    indexer: Option<&'a IndexerLoss>,
    /// The sequences of the pass's rows, whole ones one after the other (the router calls of
    /// Megatron's sequence-parallel ranks take blocks of their positions).
    sequences: usize,
    /// Inference: no backward pass follows (an MoE router's logits may stay on the device).
    inference: bool,
}

impl<B: Backend> Pass<'_, B> {
    /// The pass the routed experts' own layers run in: their tensor parallelism is the expert
    /// tensor-parallel ranks' (none for whole experts).
    fn of_experts(&self) -> Self {
        Pass {
            tp: self.etp,
            ..*self
        }
    }

    /// Whether the routed experts are split over the tensor-parallel group itself (ETP = TP):
    /// the rows they see are the group's.
    fn experts_split_as_tp(&self) -> bool {
        matches!((self.tp, self.etp), (Some(t), Some(e)) if t.group.size() == e.group.size())
    }
}

/// A loaded model on a backend, for inference: the same parameters and [`Layer`] code as
/// training, whole (one rank), with a KV cache.
///
/// A multi-latent attention model caches, per layer and position, only the normed key-value
/// latent and the rotated shared key part (`kv_lora_rank + qk_rope_head_dim` values, as
/// DeepSeek-V3's inference/model.py `kv_cache` and `pe_cache`), and attends over them with
/// the key-value up projection absorbed into the queries and the output (its `attn_impl =
/// "absorb"`; MindSpeed-LLM's `--enable-mla-absorb`): no per-step up projection of the
/// context, and the same scores and outputs up to the sums' order.
pub struct Model<'b, B: Backend> {
    backend: &'b B,
    /// Its configuration.
    pub spec: ModelSpec,
    /// Where each parameter sits in `params`.
    ids: Ids,
    /// The parameters, in the [`ParamTable`]'s order, in their stored dtype.
    params: Vec<B::Tensor>,
    /// Each layer's key-value up projection split by head, for attention over the latent
    /// cache (multi-latent attention's layers; `None` for the others).
    absorbed: Vec<Option<Absorbed<B::Tensor>>>,
    /// The files it was loaded from.
    source_files: Vec<PathBuf>,
}

/// What every layer attends to for `slots` sequences of up to `capacity` positions: each
/// position's keys and values, or under multi-latent attention its compressed latent.
pub struct KvCache<T> {
    layers: Vec<LayerCache<T>>,
    width: usize,
    capacity: usize,
}

/// One layer's part of a [`KvCache`], `[slots, capacity, width]` tensors (f32, as the
/// engine's caches are).
enum LayerCache<T> {
    /// Grouped-query attention's keys and values, each `groups·head_dim` wide.
    Full {
        /// Keys.
        keys: T,
        /// Values.
        values: T,
    },
    /// Multi-latent attention's normed key-value latent, then its rotated shared key part:
    /// `kv_lora_rank + qk_rope_head_dim` wide.
    Latent(T),
}

impl<T> KvCache<T> {
    /// Positions a slot holds at most.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The values one layer keeps for each cached position: its keys' and values' widths
    /// (`2·groups·head_dim`), or under multi-latent attention the latent's and the rotated
    /// key part's (`kv_lora_rank + qk_rope_head_dim`).
    pub fn width(&self) -> usize {
        self.width
    }

    /// The layers it holds.
    pub fn layers(&self) -> usize {
        self.layers.len()
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
        // inference reads the main model: multi-token prediction's depths are left unread
        let mut cfg = input.cfg.clone();
        cfg.mtp = None;
        let spec = ModelSpec::from_config(&cfg)?;
        let table = ParamTable::new(&cfg, cfg.vocab, None);
        let params = (table.params.par_iter())
            .map(|p| {
                let t = input.read(p.canon)?;
                if p.canon.role.is_linear() {
                    backend.upload_matrix(&t)
                } else {
                    backend.upload(&t)
                }
                .map_err(|e| anyhow!("{}: {:?}: {e}", dir.display(), p.canon))
            })
            .collect::<Result<_>>()?;
        let ids = Ids::new(&table, 0..spec.layers, 1.0)
            .ok_or_else(|| anyhow!("internal: the parameter table misses a tensor"))?;
        // multi-latent attention's up projections, read once more and split by head
        let absorbed = (ids.layers.par_iter())
            .map(|layer| {
                let (true, Some(m)) = (layer.absorbs(), &spec.mla) else {
                    return Ok(None);
                };
                let canon = Canon {
                    role: Role::KvUp,
                    layer: Some(layer.index()),
                };
                let w = transform::read_regrouped(&cfg, canon, &|c| input.read(c))?;
                Absorbed::new(backend, &w, spec.attention.heads, m)
                    .map(Some)
                    .map_err(|e| anyhow!("{}: {canon:?}: {e}", dir.display()))
            })
            .collect::<Result<_>>()?;
        Ok(Model {
            backend,
            spec,
            ids,
            params,
            absorbed,
            source_files: input.files(),
        })
    }

    /// The files (configuration and weights) it was loaded from.
    pub fn source_files(&self) -> &[PathBuf] {
        &self.source_files
    }

    /// An empty cache for `slots` sequences of up to `capacity` positions: each layer's
    /// keys and values, or under multi-latent attention its latent ([`KvCache`]).
    pub fn cache(&self, slots: usize, capacity: usize) -> Result<KvCache<B::Tensor>> {
        let b = self.backend;
        let a = self.spec.attention;
        let make = |width| b.kv_cache(slots, capacity, width);
        let (layers, width) = match self.spec.mla {
            Some(m) => {
                let width = m.kv_lora_rank + m.rope_dim;
                let layers = (0..self.spec.layers)
                    .map(|_| Ok(LayerCache::Latent(make(width)?)))
                    .collect::<Result<_>>()?;
                (layers, width)
            }
            None => {
                let width = a.groups * a.head_dim;
                let layers = (0..self.spec.layers)
                    .map(|_| {
                        Ok(LayerCache::Full {
                            keys: make(width)?,
                            values: make(width)?,
                        })
                    })
                    .collect::<Result<_>>()?;
                (layers, 2 * width)
            }
        };
        Ok(KvCache {
            layers,
            width,
            capacity,
        })
    }

    /// Copy the first `n` cached positions of slot `from` of `src` into slot `to` of `dst`,
    /// every layer: a prefix computed once, for sequences that start with the same tokens.
    pub fn copy_positions(
        &self,
        (src, from): (&KvCache<B::Tensor>, usize),
        (dst, to): (&mut KvCache<B::Tensor>, usize),
        n: usize,
    ) -> Result<()> {
        if n > src.capacity.min(dst.capacity) || src.width != dst.width {
            bail!(
                "internal: {n} positions copied between KV caches of {} and {} positions",
                src.capacity,
                dst.capacity
            );
        }
        let b = self.backend;
        let copy = |s: &B::Tensor, d: &mut B::Tensor, width: usize| {
            let at = |slot: usize, capacity: usize| slot * capacity * width;
            b.copy_range(
                (s, at(from, src.capacity)),
                (d, at(to, dst.capacity)),
                n * width,
            )
        };
        for (s, d) in src.layers.iter().zip(&mut dst.layers) {
            match (s, d) {
                (
                    LayerCache::Full { keys, values },
                    LayerCache::Full {
                        keys: to_keys,
                        values: to_values,
                    },
                ) => {
                    copy(keys, to_keys, src.width / 2)?;
                    copy(values, to_values, src.width / 2)?;
                }
                (LayerCache::Latent(s), LayerCache::Latent(d)) => copy(s, d, src.width)?,
                _ => bail!("internal: KV caches of two attention kinds"),
            }
        }
        Ok(())
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
        let half = spec.rope_table_shape(positions.len());
        let (cos, sin) = (b.upload_f32(&half, &cos)?, b.upload_f32(&half, &sin)?);
        let p = Pass {
            inference: true,
            ..self.ids.pass(
                (b, spec),
                &self.params,
                (None, (None, None)),
                (&cos, &sin),
                ((None, None, None), 1),
            )
        };
        let (embedding, head) = (self.ids.whole_model())
            .ok_or_else(|| anyhow!("internal: an inference model without its embedding or head"))?;
        if cache.layers.len() != self.ids.layers.len() {
            bail!(
                "a KV cache of {} layers for a model of {}",
                cache.layers.len(),
                self.ids.layers.len()
            );
        }
        let mut x = b.embedding(&self.params[embedding], &ids)?;
        let layers = self.ids.layers.iter().zip(&self.absorbed);
        let mut carry = None;
        for ((layer, absorbed), cache) in layers.zip(&mut cache.layers) {
            let segments = &segments;
            let attend = match (cache, absorbed) {
                (LayerCache::Full { keys, values }, _) => Attend::Cached {
                    keys,
                    values,
                    segments,
                },
                (LayerCache::Latent(cache), Some(absorbed)) => Attend::Latent {
                    cache,
                    absorbed,
                    segments,
                },
                (LayerCache::Latent(_), None) => {
                    bail!("internal: a latent KV cache for layer {}", layer.index())
                }
            };
            x = layer.forward(&p, (x, &mut carry), attend)?.0;
        }
        let x = head.norm.apply(&p, b.select_rows(&x, rows)?)?;
        Ok(head.output.forward(&p, &x)?.0)
    }

    /// The backend it runs on.
    pub fn backend(&self) -> &'b B {
        self.backend
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::cpu::Cpu;
    use crate::engine::Device;

    fn fixture(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("fixtures/models")
            .join(name)
    }

    /// The logits `[n, vocab]` of every row of one sequence `tokens` from position 0, without
    /// a cache: the layers' training pass (keys and values up-projected from the latent).
    fn uncached(model: &Model<Cpu>, tokens: &[u32]) -> Vec<f32> {
        let (b, spec) = (&Cpu, &model.spec);
        let positions: Vec<usize> = (0..tokens.len()).collect();
        let (cos, sin) = spec.rope_tables(&positions);
        let half = spec.rope_table_shape(tokens.len());
        let (cos, sin) = (b.upload_f32(&half, &cos), b.upload_f32(&half, &sin));
        let (cos, sin) = (cos.unwrap(), sin.unwrap());
        let p = (model.ids).pass(
            (b, spec),
            &model.params,
            (None, (None, None)),
            (&cos, &sin),
            ((None, None, None), 1),
        );
        let (embedding, head) = model.ids.whole_model().unwrap();
        let mut x = b.embedding(&model.params[embedding], tokens).unwrap();
        let whole = 0..tokens.len();
        let mut carry = None;
        let shared = Default::default();
        for layer in &model.ids.layers {
            let attend = Attend::Segments(std::slice::from_ref(&whole), &shared);
            x = layer.forward(&p, (x, &mut carry), attend).unwrap().0;
        }
        let x = head.norm.apply(&p, x).unwrap();
        let logits = head.output.forward(&p, &x).unwrap().0;
        b.download_f32(&logits).unwrap()
    }

    #[test]
    fn the_latent_cache_decodes_ragged_batches_as_the_uncached_pass_computes() {
        let seqs: [&[u32]; 3] = [
            &[5, 17, 3, 99, 42, 8, 150, 7, 61],
            &[1, 2, 3, 4, 5, 6],
            &[190, 11, 23, 9, 77, 45, 30],
        ];
        let slots = [2, 0, 1];
        // (sequence, new tokens) of each call: prefills beside decoding steps and chunks
        let calls: [&[(usize, usize)]; 4] = [
            &[(0, 5), (1, 3)],
            &[(1, 1), (2, 4), (0, 1)],
            &[(2, 2), (0, 1), (1, 2)],
            &[(0, 2), (2, 1)],
        ];
        for family in ["deepseek_v3", "deepseek_v3_direct", "deepseek_v2"] {
            let model = Model::load(&Cpu, &fixture(family)).unwrap();
            let (m, vocab) = (model.spec.mla.unwrap(), model.spec.vocab);
            let width = m.kv_lora_rank + m.rope_dim;
            let mut cache = model.cache(3, 16).unwrap();
            assert_eq!((cache.width(), cache.layers()), (width, model.spec.layers));
            for layer in &cache.layers {
                let LayerCache::Latent(t) = layer else {
                    panic!("{family}: a cache of keys and values")
                };
                assert_eq!(Cpu.shape(t), [3, 16, width], "{family}");
            }
            let mut past = [0; 3];
            for (i, call) in calls.iter().enumerate() {
                let steps: Vec<Step> = (call.iter())
                    .map(|&(s, len)| Step {
                        slot: slots[s],
                        past: past[s],
                        tokens: &seqs[s][past[s]..past[s] + len],
                    })
                    .collect();
                let rows: Vec<usize> = (0..call.iter().map(|c| c.1).sum()).collect();
                let got = model.forward(&mut cache, &steps, &rows).unwrap();
                let got = Cpu.download_f32(&got).unwrap();
                let mut at = 0;
                for &(s, len) in call.iter() {
                    let want = uncached(&model, &seqs[s][..past[s] + len]);
                    let got = &got[at * vocab..(at + len) * vocab];
                    let d = (got.iter().zip(&want[past[s] * vocab..]))
                        .map(|(a, b)| (a - b).abs())
                        .fold(0f32, f32::max);
                    assert!(
                        d <= 1e-5,
                        "{family}: call {i}, sequence {s}: logits differ by {d}"
                    );
                    (past[s], at) = (past[s] + len, at + len);
                }
            }
            assert_eq!(past, [9, 6, 7]);
        }
        let llama = Model::load(&Cpu, &fixture("llama")).unwrap();
        let a = llama.spec.attention;
        let cache = llama.cache(1, 4).unwrap();
        assert_eq!(cache.width(), 2 * a.groups * a.head_dim);
        assert!(matches!(cache.layers[0], LayerCache::Full { .. }));
    }
}
