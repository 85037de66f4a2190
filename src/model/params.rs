//! The parameter table of a LLaMA-family model: every tensor with its canonical role, its
//! Megatron name (mcore local spec, as MindSpeed-LLM trains), its shape (the vocabulary padded
//! as Megatron pads it), whether weight decay applies and whether it is trained. It is the one
//! list that drives allocation, initialisation, gradients, the optimizer and checkpoints, in
//! the order megatron-core registers the parameters (so optimizer state ids match Megatron's).
//! With LoRA (MindSpeed-LLM's, through peft), each adapted linear layer gets its `lora_A` and
//! `lora_B` right after its weight, and only they are trained.

use crate::arch::roles::{canonical_shape, Canon, Role};
use crate::arch::MtpLayout;
use crate::arch::{Activation, ModelConfig};
use crate::ckpt::layout::{global_key, global_key_of, layer_key_of, mtp_key, KeyLayout};
use crate::ckpt::transform::{is_row_parallel, is_tp_split, shard_shape};
use crate::tensor::DType;
use std::ops::Range;

/// Which factor of a LoRA adapter a parameter is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LoraPart {
    /// `A [r, in]`: the input projection.
    A,
    /// `B [out, r]`: the output projection.
    B,
}

/// One tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamInfo {
    /// Its canonical role and layer (for a LoRA factor: those of the layer it adapts).
    pub canon: Canon,
    /// A LoRA factor, or `None` for a base weight.
    pub lora: Option<LoraPart>,
    /// Megatron's state-dict key (`decoder.layers.0.self_attention.linear_qkv.weight`).
    pub name: String,
    /// Shape (embedding and output rows = the padded vocabulary).
    pub shape: Vec<usize>,
    /// Its dtype in the model ([`Role::dtype`]; a LoRA factor's is the model's).
    pub dtype: DType,
    /// Megatron's rule (megatron/core/optimizer/__init__.py `_get_param_groups`): no weight
    /// decay on biases and 1-D parameters.
    pub decay: bool,
    /// Initialised with the output-layer std `σ/√(2L)` (linear_proj, linear_fc2).
    pub scaled_init: bool,
    /// Whether the optimizer updates it (everything, or only the LoRA factors).
    pub trainable: bool,
    /// Whether tensor parallelism splits it; else every tensor-parallel rank holds a copy
    /// (and the gradient norm counts it once).
    pub tp_split: bool,
    /// A pipeline stage's copy of a parameter another stage holds: the tied embedding as the
    /// last stage's output layer (Megatron's `shared` attribute). Trained alike, its gradient
    /// summed with the first stage's, and counted there only.
    pub shared: bool,
    /// The model chunk of its pipeline stage that holds it (0 without a virtual pipeline).
    pub chunk: usize,
}

impl ParamInfo {
    /// Elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// LoRA adapters (`--lora-r --lora-alpha --lora-target-modules`).
#[derive(Debug, Clone, PartialEq)]
pub struct LoraSpec {
    /// Rank.
    pub r: usize,
    /// Alpha (the update is scaled by alpha / r).
    pub alpha: f64,
    /// The adapted layers: Qkv, Proj, Fc1, Fc2.
    pub targets: Vec<Role>,
}

impl LoraSpec {
    /// The scale of the adapter's output.
    pub fn scale(&self) -> f32 {
        (self.alpha / self.r as f64) as f32
    }

    /// MindSpeed-LLM's module name of a target (`linear_qkv`, …; [`Role::linear_module`]).
    pub fn module(role: Role) -> Option<&'static str> {
        role.linear_module()
    }

    /// Whether a layer of `role` gets an adapter: peft wraps every module whose name is a
    /// target's, an MoE layer's experts' included.
    pub fn adapts(&self, role: Role) -> bool {
        Self::module(role).is_some_and(|m| self.targets.iter().any(|&t| Self::module(t) == Some(m)))
    }

    /// The target of a module name.
    pub fn target(module: &str) -> Option<Role> {
        [Role::Qkv, Role::Proj, Role::Fc1, Role::Fc2]
            .into_iter()
            .find(|&r| Self::module(r) == Some(module))
    }
}

/// All parameters of a model, in megatron-core's registration order.
#[derive(Debug, Clone)]
pub struct ParamTable {
    /// The parameters.
    pub params: Vec<ParamInfo>,
    /// Vocabulary rows of the embedding and output (padded).
    pub vocab_padded: usize,
    /// The decoder's layers: canonical layers from here are multi-token prediction depths',
    /// which the last pipeline stage holds.
    pub decoder_layers: usize,
    /// The dense MLPs' activation ([`ModelConfig::activation`]).
    pub activation: Activation,
}

/// Megatron's mcore key of a parameter (the layout megatron-core's GPTModel state dict uses,
/// or MindSpeed-LLM's for its multi-token prediction).
fn mcore_name(cfg: &ModelConfig, canon: Canon) -> String {
    let layout = KeyLayout::Mcore;
    match (canon.layer, cfg.mtp) {
        (Some(l), Some(mtp)) if l >= cfg.layers => {
            mtp_key(layout, mtp.layout, canon.role, l - cfg.layers)
        }
        (Some(l), _) => layer_key_of(layout, cfg, canon.role, l),
        (None, _) => global_key_of(layout, cfg, canon.role),
    }
    .concat()
}

impl ParamTable {
    /// The table of `cfg` with its vocabulary padded to `vocab_padded` rows and, with `lora`,
    /// its adapters (then the only trained parameters).
    pub fn new(cfg: &ModelConfig, vocab_padded: usize, lora: Option<&LoraSpec>) -> ParamTable {
        let mut params = Vec::new();
        let base_trained = lora.is_none();
        let mut push = |canon: Canon, name: String| {
            let mut shape = canonical_shape(cfg, canon.role);
            if canon.role.vocab_rows() {
                shape[0] = vocab_padded;
            }
            let lora_of = lora.filter(|l| l.adapts(canon.role));
            let (out, inp) = (shape[0], shape.get(1).copied().unwrap_or(1));
            params.push(ParamInfo {
                canon,
                lora: None,
                decay: !(name.ends_with(".bias") || shape.len() == 1),
                scaled_init: matches!(
                    canon.role,
                    Role::Proj | Role::Fc2 | Role::ExpertFc2(_) | Role::SharedFc2
                ),
                trainable: base_trained && canon.role.trained(),
                tp_split: is_tp_split(canon.role),
                shared: false,
                chunk: 0,
                name: name.clone(),
                shape,
                dtype: canon.role.dtype(cfg),
            });
            if let Some(l) = lora_of {
                // peft's names: `<module>.lora_A.default.weight`.
                let stem = name.trim_end_matches(".weight");
                for (part, tag, shape) in [
                    (LoraPart::A, "A", vec![l.r, inp]),
                    (LoraPart::B, "B", vec![out, l.r]),
                ] {
                    params.push(ParamInfo {
                        canon,
                        lora: Some(part),
                        name: format!("{stem}.lora_{tag}.default.weight"),
                        shape,
                        dtype: cfg.dtype,
                        decay: true,
                        scaled_init: false,
                        trainable: true,
                        // peft's megatron LoRA layer: a row-parallel layer's A is split like
                        // it, a column-parallel layer's B; the other factor is whole. A
                        // replicated layer (MindSpeed-LLM's `LinearNoTP`, a torch Linear to
                        // peft) keeps both whole.
                        tp_split: is_tp_split(canon.role)
                            && (part == LoraPart::A) == is_row_parallel(canon.role),
                        shared: false,
                        chunk: 0,
                    });
                }
            }
        };
        let global = |role| Canon { role, layer: None };
        let mut push_canon = |canon: Canon| push(canon, mcore_name(cfg, canon));
        push_canon(global(Role::Embedding));
        // megatron-core builds an attention block's linear_proj before its linear_qkv, and its
        // q_layernorm and k_layernorm after them (megatron/core/transformer/attention.py:
        // Attention.__init__, then SelfAttention.__init__).
        let mut roles = Role::norm_roles(cfg, Role::InputNorm);
        match &cfg.mla {
            Some(mla) => roles.extend(Role::mla_roles(cfg, mla)),
            None => {
                roles.push(Role::Proj);
                if cfg.proj_bias {
                    roles.push(Role::ProjBias);
                }
                roles.push(Role::Qkv);
                if cfg.qkv_bias {
                    roles.push(Role::QkvBias);
                }
                if cfg.qk_norm {
                    roles.extend([Role::QNorm, Role::KNorm]);
                }
            }
        }
        let post_norm = Role::norm_roles(cfg, Role::PostNorm);
        let layer = |l: usize| {
            let dsa = cfg.mla.and_then(|m| m.dsa);
            let indexer = dsa
                .filter(|d| d.computes(l, cfg.layers))
                .map(|_| Role::INDEXER);
            let own = (roles.iter().copied())
                .chain(indexer.into_iter().flatten())
                .chain(post_norm.iter().copied())
                .chain(Role::mlp_roles(cfg, l));
            let roles = Role::shortcut_roles(cfg, l).into_iter().chain(own);
            roles.map(move |role| Canon {
                role,
                layer: Some(l),
            })
        };
        (0..cfg.layers).flat_map(layer).for_each(&mut push_canon);
        // megatron-core's GPTModel registers its decoder (and final norm) before the
        // multi-token prediction block; MindSpeed-LLM's registers the block, its depths'
        // final norms last in it, then its own final norm.
        let mindspeed = cfg.mtp.is_some_and(|m| m.layout == MtpLayout::Mindspeed);
        let depths = cfg.layers..cfg.all_layers();
        let depth = |role| {
            move |l| Canon {
                role,
                layer: Some(l),
            }
        };
        if !mindspeed {
            (Role::norm_roles(cfg, Role::FinalNorm).into_iter())
                .for_each(|r| push_canon(global(r)));
        }
        for l in depths.clone() {
            let own = [Role::MtpEmbedNorm, Role::MtpHiddenNorm, Role::MtpProj].map(|r| depth(r)(l));
            own.into_iter().chain(layer(l)).for_each(&mut push_canon);
            if !mindspeed {
                push_canon(depth(Role::MtpNorm)(l));
            }
        }
        if mindspeed {
            depths.map(depth(Role::MtpNorm)).for_each(&mut push_canon);
            (Role::norm_roles(cfg, Role::FinalNorm).into_iter())
                .for_each(|r| push_canon(global(r)));
        }
        (Role::output_roles(cfg).into_iter()).for_each(|r| push_canon(global(r)));
        ParamTable {
            params,
            vocab_padded,
            decoder_layers: cfg.layers,
            activation: cfg.activation,
        }
    }

    /// One tensor-parallel rank's table of `cfg`'s model over `tp` ranks, its routed experts
    /// over `etp` (megatron-core's expert tensor parallelism; whole at 1): the split
    /// parameters' shards' shapes (the padded vocabulary split by rows; a split LoRA factor
    /// as its layer's input or output).
    pub fn tensor_parallel(&self, cfg: &ModelConfig, (tp, etp): (usize, usize)) -> ParamTable {
        let mut t = self.clone();
        for p in t.params.iter_mut() {
            let ranks = match p.canon.role.expert() {
                Some(_) => {
                    p.tp_split &= etp > 1;
                    etp
                }
                None => tp,
            };
            let shard = shard_shape(cfg, p.canon.role, ranks, self.vocab_padded);
            match p.lora {
                None => p.shape = shard,
                Some(LoraPart::A) if p.tp_split => p.shape[1] = shard[1],
                Some(LoraPart::B) if p.tp_split => p.shape[0] = shard[0],
                Some(_) => {}
            }
        }
        t
    }

    /// One expert-parallel rank's table, `(rank, ranks)`: of each MoE layer's routed experts
    /// only its block of `E / ranks` (and their LoRA factors), keeping their global roles and
    /// named by their index in the block (`local_experts.{e − first}`, as megatron-core's
    /// `SequentialMLP` on that rank names them).
    pub fn expert_parallel(&self, cfg: &ModelConfig, (rank, ranks): (usize, usize)) -> ParamTable {
        let local = cfg.moe.as_ref().map_or(0, |m| m.experts / ranks.max(1));
        let first = rank * local;
        let mut t = self.clone();
        t.params.retain(|p| {
            (p.canon.role.expert()).is_none_or(|e| (first..first + local).contains(&e))
        });
        for p in t.params.iter_mut() {
            if let Some(e) = p.canon.role.expert() {
                let (global, local) = (
                    format!(".local_experts.{e}."),
                    format!(".local_experts.{}.", e - first),
                );
                p.name = p.name.replacen(&global, &local, 1);
            }
        }
        t
    }

    /// One pipeline stage's table: the embedding on the first stage, the stage's `layers`
    /// (named by their index in the stage, as its checkpoint file names them), the final norm
    /// and output layer on the last stage. A tied embedding is also the last stage's output
    /// layer there (megatron-core's `LanguageModule.setup_embeddings_and_output_layer`): a
    /// [`ParamInfo::shared`] copy named `output_layer.weight`, registered last as
    /// `GPTModel` registers its output layer.
    pub fn pipeline_stage(&self, layers: &Range<usize>, (first, last): (bool, bool)) -> ParamTable {
        let mut params = Vec::new();
        let depths = self.decoder_layers..;
        for p in &self.params {
            let keep = match (p.canon.layer, p.canon.role) {
                (Some(l), _) if depths.contains(&l) => last,
                (Some(l), _) => layers.contains(&l),
                (None, Role::Embedding) => first,
                (None, _) => last,
            };
            if !keep {
                continue;
            }
            let mut p = p.clone();
            if let Some(l) = p.canon.layer.filter(|l| !depths.contains(l)) {
                let (global, local) = (
                    format!("layers.{l}."),
                    format!("layers.{}.", l - layers.start),
                );
                p.name = p.name.replacen(&global, &local, 1);
            }
            params.push(p);
        }
        let tied = self
            .index(Canon {
                role: Role::Output,
                layer: None,
            })
            .is_none();
        let predicts = params
            .iter()
            .any(|p| p.canon.layer.is_some_and(|l| depths.contains(&l)));
        if let Some(e) = self.index(Canon {
            role: Role::Embedding,
            layer: None,
        }) {
            if last && !first && predicts {
                // the multi-token prediction depths' copy of the embedding, registered first
                // (megatron-core `LanguageModule.setup_embeddings_and_output_layer`)
                let copy = ParamInfo {
                    shared: true,
                    ..self.params[e].clone()
                };
                params.insert(0, copy);
            }
        }
        if last && !first && tied {
            if let Some(e) = self.index(Canon {
                role: Role::Embedding,
                layer: None,
            }) {
                params.push(ParamInfo {
                    name: global_key(KeyLayout::Mcore, Role::Output, true).concat(),
                    shared: true,
                    ..self.params[e].clone()
                });
            }
        }
        ParamTable {
            params,
            vocab_padded: self.vocab_padded,
            decoder_layers: self.decoder_layers,
            activation: self.activation,
        }
    }

    /// One pipeline stage's tables of its model chunks (`chunks[v]`: the layers of chunk `v`;
    /// `first`/`last`: whether the stage is the pipeline's first or last): chunk 0 of the
    /// first stage holds the embedding and the last chunk of the last stage the head, as
    /// [`ParamTable::pipeline_stage`] lays each out, its parameters marked with the chunk.
    pub fn pipeline_chunks(
        &self,
        chunks: &[Range<usize>],
        (first, last): (bool, bool),
    ) -> Vec<ParamTable> {
        let n = chunks.len();
        (chunks.iter().enumerate())
            .map(|(v, layers)| {
                let mut t = self.pipeline_stage(layers, (first && v == 0, last && v + 1 == n));
                for p in &mut t.params {
                    p.chunk = v;
                }
                t
            })
            .collect()
    }

    /// The tables of model chunks as one, in order (megatron-core's optimizer takes the
    /// chunks' parameters in turn).
    pub fn concat(tables: &[ParamTable]) -> ParamTable {
        ParamTable {
            params: tables.iter().flat_map(|t| t.params.clone()).collect(),
            vocab_padded: tables.first().map_or(0, |t| t.vocab_padded),
            decoder_layers: tables.first().map_or(0, |t| t.decoder_layers),
            activation: tables.first().map_or(Activation::SwiGlu, |t| t.activation),
        }
    }

    /// The index of a base tensor.
    pub fn index(&self, canon: Canon) -> Option<usize> {
        self.params
            .iter()
            .position(|p| p.canon == canon && p.lora.is_none())
    }

    /// The index of a LoRA factor of a layer.
    pub fn lora_index(&self, canon: Canon, part: LoraPart) -> Option<usize> {
        self.params
            .iter()
            .position(|p| p.canon == canon && p.lora == Some(part))
    }

    /// Elements in all parameters.
    pub fn numel(&self) -> usize {
        self.params.iter().map(ParamInfo::numel).sum()
    }

    /// Elements in the trained parameters.
    pub fn trained_numel(&self) -> usize {
        self.params
            .iter()
            .filter(|p| p.trainable)
            .map(ParamInfo::numel)
            .sum()
    }
}
