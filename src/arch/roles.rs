//! The canonical tensors of a model: what each one is (its role), in which layer, and its
//! unsharded shape in Megatron's order. Checkpoint formats map their tensors onto these
//! (`crate::ckpt::transform`); the model and the optimizer iterate them as parameters.

use super::moe::Moe;
use super::ModelConfig;
use crate::tensor::DType;

/// What a canonical tensor is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// Word embedding `[V, h]`.
    Embedding,
    /// Norm before attention `[h]`.
    InputNorm,
    /// Its bias `[h]` (a LayerNorm's β, [`crate::arch::ModelConfig::layer_norm`]).
    InputNormBias,
    /// Fused QKV in GQA-group order `[ng(nh/ng+2)d, h]`.
    Qkv,
    /// Its bias.
    QkvBias,
    /// Attention output `[h, nh·d]`.
    Proj,
    /// Its bias `[h]`.
    ProjBias,
    /// Per-head RMSNorm of the queries `[d]`, shared by every head (Qwen3's `q_norm`,
    /// Megatron's `q_layernorm`).
    QNorm,
    /// Per-head RMSNorm of the keys `[d]`.
    KNorm,
    /// Multi-latent attention's query down projection `[q_lora, h]`.
    QDown,
    /// The RMSNorm of the query latent `[q_lora]` (megatron-core's `q_layernorm`).
    QLatentNorm,
    /// The query up projection `[heads·(d_nope + d_rope), q_lora]`.
    QUp,
    /// [`crate::arch::Mla::split_up`]'s query up projection of the parts without RoPE
    /// `[heads·d_nope, q_lora]` (`linear_qk_nope`).
    QUpNope,
    /// Its up projection of the rotated parts `[heads·d_rope, q_lora]` (`linear_qk_rope`).
    QUpRope,
    /// The query projection of multi-latent attention without a query latent
    /// `[heads·(d_nope + d_rope), h]` (DeepSeek-V2-Lite).
    QProj,
    /// The key-value down projection `[kv_lora + d_rope, h]`: the latent, then the rotated key
    /// part all heads share.
    KvDown,
    /// The RMSNorm of the key-value latent `[kv_lora]` (megatron-core's `kv_layernorm`).
    KvLatentNorm,
    /// MindSpeed-LLM's fused down projections `[q_rank + kv_lora + d_rope, h]`: the query's
    /// down projection (or its direct projection), then the key-value one
    /// ([`crate::arch::Mla::fused_down`]).
    QkvDown,
    /// The key-value up projection `[heads·(d_nope + d_v), kv_lora]`, per head its key part
    /// then its value.
    KvUp,
    /// [`crate::arch::Mla::split_up`]'s key up projection `[heads·d_nope, kv_lora]`
    /// (`linear_kv_nope`).
    KvUpNope,
    /// Its value up projection `[heads·d_v, kv_lora]` (`linear_v`).
    ValueUp,
    /// DeepSeek sparse attention's indexer ([`crate::arch::Dsa`]): its query up projection
    /// `[heads·d, q_lora]` (`dsa_indexer.wq_b`).
    IndexerQUp,
    /// Its key projection `[d, h]` (`dsa_indexer.wk`).
    IndexerKey,
    /// Its key's LayerNorm γ `[d]` (`dsa_indexer.k_norm`).
    IndexerKeyNorm,
    /// Its β `[d]`.
    IndexerKeyNormBias,
    /// Its heads' weights' projection `[heads, h]` (`dsa_indexer.weights_proj`).
    IndexerWeights,
    /// Norm before the MLP `[h]`.
    PostNorm,
    /// Its bias `[h]`.
    PostNormBias,
    /// SwiGLU input `[2F, h]` = `[gate; up]`.
    Fc1,
    /// A non-gated MLP's input projection `[F, h]` (Megatron's `linear_fc1` without
    /// `gated_linear_unit`, [`crate::arch::Activation::gated`]; HF `up_proj`).
    Up,
    /// MLP output `[h, F]`.
    Fc2,
    /// An MoE layer's router `[E, h]`.
    Router,
    /// Its expert bias `[E]` (aux-loss-free balancing): a buffer, f32, not trained.
    ExpertBias,
    /// Routed expert `e`'s SwiGLU input `[2F_e, h]` = `[gate; up]`.
    ExpertFc1(usize),
    /// Routed expert `e`'s output `[h, F_e]`.
    ExpertFc2(usize),
    /// The shared experts' SwiGLU input `[2F_s, h]`.
    SharedFc1,
    /// The shared experts' output `[h, F_s]`.
    SharedFc2,
    /// The sigmoid gate of the shared experts' output `[1, h]`.
    SharedGate,
    /// A multi-token prediction depth's norm of the next token's embedding `[h]` (`enorm`).
    MtpEmbedNorm,
    /// Its norm of the hidden state it is handed `[h]` (`hnorm`).
    MtpHiddenNorm,
    /// Its projection of the normed `[embedding; hidden]` back to the hidden size `[h, 2h]`
    /// (`eh_proj`).
    MtpProj,
    /// Its final norm, before the shared output layer `[h]` (`final_layernorm`, DeepSeek's
    /// `shared_head.norm`).
    MtpNorm,
    /// Final norm `[h]`.
    FinalNorm,
    /// Its bias `[h]`.
    FinalNormBias,
    /// Output layer `[V, h]` (untied models).
    Output,
    /// Its bias `[V]` ([`crate::arch::ModelConfig::output_bias`]).
    OutputBias,
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
    /// Roles of canonical layer `l`, in the order they are written: a decoder layer's, or a
    /// multi-token prediction depth's — its norms and projection, its decoder layer, its final
    /// norm (megatron-core's `MultiTokenPredictionLayer` registration order).
    pub fn layer_roles(cfg: &ModelConfig, l: usize) -> Vec<Role> {
        let mut roles = Role::decoder_roles(cfg, l);
        if cfg.mtp_depth(l).is_some() {
            roles.splice(
                0..0,
                [Role::MtpEmbedNorm, Role::MtpHiddenNorm, Role::MtpProj],
            );
            roles.push(Role::MtpNorm);
        }
        roles
    }

    /// The roles of the decoder layer of canonical layer `l` (a prediction depth's too).
    fn decoder_roles(cfg: &ModelConfig, l: usize) -> Vec<Role> {
        if let Some(mla) = &cfg.mla {
            let mut roles = Role::shortcut_roles(cfg, l);
            roles.extend(Role::norm_roles(cfg, Role::InputNorm));
            roles.extend(Role::mla_roles(cfg, mla));
            if mla.dsa.is_some_and(|d| d.computes(l, cfg.layers)) {
                roles.extend(Role::INDEXER);
            }
            roles.extend(Role::norm_roles(cfg, Role::PostNorm));
            roles.extend(Role::mlp_roles(cfg, l));
            return roles;
        }
        let mut roles = Role::norm_roles(cfg, Role::InputNorm);
        roles.push(Role::Qkv);
        if cfg.qkv_bias {
            roles.push(Role::QkvBias);
        }
        roles.push(Role::Proj);
        if cfg.proj_bias {
            roles.push(Role::ProjBias);
        }
        if cfg.qk_norm {
            roles.extend([Role::QNorm, Role::KNorm]);
        }
        roles.extend(Role::norm_roles(cfg, Role::PostNorm));
        roles.extend(Role::mlp_roles(cfg, l));
        roles
    }

    /// A norm's tensors: its γ, and a LayerNorm's β after it
    /// ([`crate::arch::ModelConfig::layer_norm`]).
    pub fn norm_roles(cfg: &ModelConfig, norm: Role) -> Vec<Role> {
        let mut roles = vec![norm];
        roles.extend(cfg.layer_norm.then_some(norm.norm_bias()));
        roles
    }

    /// The β beside a decoder norm's γ (`InputNorm`, `PostNorm`, `FinalNorm`).
    pub fn norm_bias(self) -> Role {
        match self {
            Role::InputNorm => Role::InputNormBias,
            Role::PostNorm => Role::PostNormBias,
            Role::IndexerKeyNorm => Role::IndexerKeyNormBias,
            _ => Role::FinalNormBias,
        }
    }

    /// The output layer's tensors (none for a tied one): its weight, and its bias
    /// ([`crate::arch::ModelConfig::output_bias`]).
    pub fn output_roles(cfg: &ModelConfig) -> Vec<Role> {
        match cfg.tied {
            true => Vec::new(),
            false if cfg.output_bias => vec![Role::Output, Role::OutputBias],
            false => vec![Role::Output],
        }
    }

    /// Whether its rows are the vocabulary's (padded in Megatron's files, split over the
    /// tensor-parallel ranks by rows).
    pub fn vocab_rows(self) -> bool {
        matches!(self, Role::Embedding | Role::Output | Role::OutputBias)
    }

    /// The roles of multi-latent attention, in the order megatron-core's `MLASelfAttention`
    /// registers them: the output projection (built by its base class first), the query
    /// projections, the key-value ones, then the latents' norms (`--qk-layernorm`). MindSpeed-
    /// LLM's `CustomMLASelfAttention` rebuilds its base class's `linear_qkv` and `q_layernorm`
    /// in their places: the output projection, the fused down projections, the query latent's
    /// norm and up projection, the key-value latent's.
    pub fn mla_roles(cfg: &ModelConfig, mla: &crate::arch::Mla) -> Vec<Role> {
        let q_latent = mla.q_lora_rank.is_some();
        let mut roles = vec![Role::Proj];
        if mla.fused_down {
            roles.push(Role::QkvDown);
            if q_latent {
                roles.extend(cfg.qk_norm.then_some(Role::QLatentNorm));
                roles.extend(Role::up_roles(mla, Role::QUp));
            }
            roles.extend(cfg.qk_norm.then_some(Role::KvLatentNorm));
            roles.extend(Role::up_roles(mla, Role::KvUp));
            return roles;
        }
        match q_latent {
            true => roles.extend([Role::QDown, Role::QUp]),
            false => roles.push(Role::QProj),
        }
        roles.extend([Role::KvDown, Role::KvUp]);
        if cfg.qk_norm {
            if q_latent {
                roles.push(Role::QLatentNorm);
            }
            roles.push(Role::KvLatentNorm);
        }
        roles
    }

    /// DeepSeek sparse attention's indexer's tensors, in the order its `DSAIndexer` registers
    /// them.
    pub const INDEXER: [Role; 5] = [
        Role::IndexerQUp,
        Role::IndexerKey,
        Role::IndexerKeyNorm,
        Role::IndexerKeyNormBias,
        Role::IndexerWeights,
    ];

    /// The tensors of an up projection (`QUp` or `KvUp`): itself, or its two parts under
    /// [`crate::arch::Mla::split_up`].
    pub fn up_roles(mla: &crate::arch::Mla, up: Role) -> Vec<Role> {
        match (mla.split_up, up.up_parts()) {
            (true, Some(parts)) => parts.to_vec(),
            _ => vec![up],
        }
    }

    /// The two parts an up projection splits into ([`crate::arch::Mla::split_up`]), each
    /// head's rows of the first then of the second; `None` for another role.
    pub fn up_parts(self) -> Option<[Role; 2]> {
        match self {
            Role::QUp => Some([Role::QUpNope, Role::QUpRope]),
            Role::KvUp => Some([Role::KvUpNope, Role::ValueUp]),
            _ => None,
        }
    }

    /// The MLP roles of layer `l`: fc1 and fc2 of a dense layer; an MoE layer's router, each
    /// routed expert's fc1 and fc2, then the shared experts' gate, fc1 and fc2 (the order
    /// megatron-core's `MoELayer` registers them: a module's own parameters before its
    /// children's).
    pub fn mlp_roles(cfg: &ModelConfig, l: usize) -> Vec<Role> {
        match cfg
            .moe
            .as_ref()
            .filter(|m| m.is_moe_layer(l) && !cfg.paired)
        {
            Some(moe) => Role::moe_roles(moe),
            None if cfg.activation.gated() => vec![Role::Fc1, Role::Fc2],
            None => vec![Role::Up, Role::Fc2],
        }
    }

    /// The roles of the shortcut mixture of experts layer `l` routes (the first of a
    /// [`ModelConfig::paired`] model's pairs; none elsewhere), which precede the layer's own:
    /// MindSpeed-LLM's `LongCatFlashTransformerLayer` registers its `mlp` in its base class's
    /// constructor, before its sublayers.
    pub fn shortcut_roles(cfg: &ModelConfig, l: usize) -> Vec<Role> {
        match cfg
            .moe
            .as_ref()
            .filter(|m| cfg.opens_pair(l) && m.is_moe_layer(l))
        {
            Some(moe) => Role::moe_roles(moe),
            None => Vec::new(),
        }
    }

    /// An MoE block's roles, in registration order.
    fn moe_roles(moe: &Moe) -> Vec<Role> {
        let mut roles = vec![Role::Router];
        if moe.expert_bias {
            roles.push(Role::ExpertBias);
        }
        for e in 0..moe.experts {
            roles.extend([Role::ExpertFc1(e), Role::ExpertFc2(e)]);
        }
        if moe.shared_ffn.is_some() {
            if moe.shared_gate {
                roles.push(Role::SharedGate);
            }
            roles.extend([Role::SharedFc1, Role::SharedFc2]);
        }
        roles
    }

    /// Megatron's module name of a linear layer's weight (`linear_qkv`, `linear_proj`,
    /// `linear_fc1`, `linear_fc2`; an MoE layer's routed and shared experts are `linear_fc1` /
    /// `linear_fc2` modules too), which LoRA's target modules name.
    pub fn linear_module(self) -> Option<&'static str> {
        Some(match self {
            Role::Qkv | Role::QkvDown => "linear_qkv",
            Role::Proj => "linear_proj",
            Role::QDown => "linear_q_down_proj",
            Role::QUp => "linear_q_up_proj",
            Role::QProj => "linear_q_proj",
            Role::KvDown => "linear_kv_down_proj",
            Role::KvUp => "linear_kv_up_proj",
            Role::QUpNope => "linear_qk_nope",
            Role::QUpRope => "linear_qk_rope",
            Role::KvUpNope => "linear_kv_nope",
            Role::ValueUp => "linear_v",
            Role::Fc1 | Role::Up | Role::ExpertFc1(_) | Role::SharedFc1 => "linear_fc1",
            Role::Fc2 | Role::ExpertFc2(_) | Role::SharedFc2 => "linear_fc2",
            _ => return None,
        })
    }

    /// Whether it is a linear layer's weight (a matrix the decoder multiplies by).
    pub fn is_linear(self) -> bool {
        self.linear_module().is_some()
            || matches!(
                self,
                Role::Output | Role::Router | Role::SharedGate | Role::MtpProj
            )
    }

    /// The dtype a tensor of this role has in `cfg`: the expert bias stays f32 (megatron-core
    /// router.py `_maintain_float32_expert_bias`), so do the norms' weights with
    /// [`ModelConfig::norms_f32`]; the rest is the model's.
    pub fn dtype(self, cfg: &ModelConfig) -> DType {
        match self {
            Role::ExpertBias => DType::F32,
            _ if cfg.norms_f32 && self.is_norm() => DType::F32,
            _ => cfg.dtype,
        }
    }

    /// Whether it is a norm's γ or β.
    pub fn is_norm(self) -> bool {
        matches!(
            self,
            Role::InputNorm
                | Role::InputNormBias
                | Role::PostNorm
                | Role::PostNormBias
                | Role::QNorm
                | Role::KNorm
                | Role::QLatentNorm
                | Role::KvLatentNorm
                | Role::IndexerKeyNorm
                | Role::IndexerKeyNormBias
                | Role::MtpEmbedNorm
                | Role::MtpHiddenNorm
                | Role::MtpNorm
                | Role::FinalNorm
                | Role::FinalNormBias
        )
    }

    /// Whether the optimizer updates it: everything but a buffer (the expert bias, which
    /// the trainer moves itself).
    pub fn trained(self) -> bool {
        self != Role::ExpertBias
    }

    /// The routed expert a role belongs to.
    pub fn expert(self) -> Option<usize> {
        match self {
            Role::ExpertFc1(e) | Role::ExpertFc2(e) => Some(e),
            _ => None,
        }
    }
}

/// Every canonical tensor of the model, in file order: the decoder's, the final norm, the
/// multi-token prediction depths', the output layer.
pub fn canonical(cfg: &ModelConfig) -> Vec<Canon> {
    let global = |role| Canon { role, layer: None };
    let mut out = vec![global(Role::Embedding)];
    let layer = |l: usize| {
        (Role::layer_roles(cfg, l).into_iter()).map(move |role| Canon {
            role,
            layer: Some(l),
        })
    };
    out.extend((0..cfg.layers).flat_map(layer));
    out.extend(
        Role::norm_roles(cfg, Role::FinalNorm)
            .into_iter()
            .map(global),
    );
    out.extend((cfg.layers..cfg.all_layers()).flat_map(layer));
    out.extend(Role::output_roles(cfg).into_iter().map(global));
    out
}

/// Shape of a canonical tensor (vocab unpadded).
pub fn canonical_shape(cfg: &ModelConfig, role: Role) -> Vec<usize> {
    let qkv_rows = (cfg.heads + 2 * cfg.groups) * cfg.head_dim;
    match role {
        Role::Embedding | Role::Output => vec![cfg.vocab, cfg.hidden],
        Role::OutputBias => vec![cfg.vocab],
        Role::InputNorm
        | Role::PostNorm
        | Role::FinalNorm
        | Role::InputNormBias
        | Role::PostNormBias
        | Role::FinalNormBias
        | Role::ProjBias
        | Role::MtpEmbedNorm
        | Role::MtpHiddenNorm
        | Role::MtpNorm => vec![cfg.hidden],
        Role::MtpProj => vec![cfg.hidden, 2 * cfg.hidden],
        Role::QNorm if cfg.qk_norm_per_layer => vec![cfg.heads * cfg.head_dim],
        Role::KNorm if cfg.qk_norm_per_layer => vec![cfg.groups * cfg.head_dim],
        Role::QNorm | Role::KNorm => vec![cfg.head_dim],
        Role::Qkv => vec![qkv_rows, cfg.hidden],
        Role::QkvBias => vec![qkv_rows],
        Role::Proj => match &cfg.mla {
            Some(m) => vec![cfg.hidden, cfg.heads * m.v_head_dim],
            None => vec![cfg.hidden, cfg.heads * cfg.head_dim],
        },
        Role::QDown | Role::QLatentNorm | Role::QUp | Role::QProj => mla_q_shape(cfg, role),
        Role::QUpNope | Role::QUpRope => mla_q_shape(cfg, role),
        Role::KvDown | Role::KvLatentNorm | Role::KvUp | Role::QkvDown => mla_kv_shape(cfg, role),
        Role::KvUpNope | Role::ValueUp => mla_kv_shape(cfg, role),
        Role::IndexerQUp
        | Role::IndexerKey
        | Role::IndexerKeyNorm
        | Role::IndexerKeyNormBias
        | Role::IndexerWeights => indexer_shape(cfg, role),
        Role::Fc1 => vec![2 * cfg.ffn, cfg.hidden],
        Role::Up => vec![cfg.ffn, cfg.hidden],
        Role::Fc2 => vec![cfg.hidden, cfg.ffn],
        Role::Router => vec![cfg.moe.as_ref().map_or(0, Moe::router_width), cfg.hidden],
        Role::ExpertBias => vec![cfg.moe.as_ref().map_or(0, Moe::router_width)],
        Role::ExpertFc1(_) => vec![2 * moe_ffn(cfg), cfg.hidden],
        Role::ExpertFc2(_) => vec![cfg.hidden, moe_ffn(cfg)],
        Role::SharedFc1 => vec![2 * shared_ffn(cfg), cfg.hidden],
        Role::SharedFc2 => vec![cfg.hidden, shared_ffn(cfg)],
        Role::SharedGate => vec![1, cfg.hidden],
    }
}

/// The shape of a query role of multi-latent attention (zero-sized without it).
fn mla_q_shape(cfg: &ModelConfig, role: Role) -> Vec<usize> {
    let m = cfg.mla.unwrap_or(ZERO_MLA);
    let (q_rows, rank) = (cfg.heads * m.q_head_dim(), m.q_lora_rank.unwrap_or(0));
    match role {
        Role::QDown => vec![rank, cfg.hidden],
        Role::QLatentNorm => vec![rank],
        Role::QUp => vec![q_rows, rank],
        Role::QUpNope => vec![cfg.heads * m.qk_head_dim, rank],
        Role::QUpRope => vec![cfg.heads * m.rope_dim, rank],
        _ => vec![q_rows, cfg.hidden],
    }
}

/// The shape of a role of DeepSeek sparse attention's indexer (zero-sized without one).
fn indexer_shape(cfg: &ModelConfig, role: Role) -> Vec<usize> {
    let m = cfg.mla.unwrap_or(ZERO_MLA);
    let (heads, d) = m.dsa.map_or((0, 0), |x| (x.heads, x.head_dim));
    match role {
        Role::IndexerQUp => vec![heads * d, m.q_lora_rank.unwrap_or(0)],
        Role::IndexerKey => vec![d, cfg.hidden],
        Role::IndexerWeights => vec![heads, cfg.hidden],
        _ => vec![d],
    }
}

/// The shape of a key-value role of multi-latent attention (zero-sized without it).
fn mla_kv_shape(cfg: &ModelConfig, role: Role) -> Vec<usize> {
    let m = cfg.mla.unwrap_or(ZERO_MLA);
    match role {
        Role::KvDown => vec![m.kv_lora_rank + m.rope_dim, cfg.hidden],
        Role::KvLatentNorm => vec![m.kv_lora_rank],
        Role::QkvDown => vec![
            m.q_rank(cfg.heads) + m.kv_lora_rank + m.rope_dim,
            cfg.hidden,
        ],
        Role::KvUpNope => vec![cfg.heads * m.qk_head_dim, m.kv_lora_rank],
        Role::ValueUp => vec![cfg.heads * m.v_head_dim, m.kv_lora_rank],
        _ => vec![cfg.heads * (m.qk_head_dim + m.v_head_dim), m.kv_lora_rank],
    }
}

/// The shape of no multi-latent attention.
const ZERO_MLA: crate::arch::Mla = crate::arch::Mla {
    q_lora_rank: None,
    kv_lora_rank: 0,
    qk_head_dim: 0,
    rope_dim: 0,
    v_head_dim: 0,
    fused_down: false,
    split_up: false,
    scale_latents: [false; 2],
    dsa: None,
};

/// One routed expert's intermediate size (0 for a dense model).
pub fn moe_ffn(cfg: &ModelConfig) -> usize {
    cfg.moe.as_ref().map_or(0, |m| m.ffn)
}

/// The shared experts' intermediate size (0 without them).
pub fn shared_ffn(cfg: &ModelConfig) -> usize {
    cfg.moe.as_ref().and_then(|m| m.shared_ffn).unwrap_or(0)
}
