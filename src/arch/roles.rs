//! The canonical tensors of a model: what each one is (its role), in which layer, and its
//! unsharded shape in Megatron's order. Checkpoint formats map their tensors onto these
//! (`crate::ckpt::transform`); the model and the optimizer iterate them as parameters.

use super::ModelConfig;
use crate::tensor::DType;

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
    /// Per-head RMSNorm of the queries `[d]`, shared by every head (Qwen3's `q_norm`,
    /// Megatron's `q_layernorm`).
    QNorm,
    /// Per-head RMSNorm of the keys `[d]`.
    KNorm,
    /// Norm before the MLP `[h]`.
    PostNorm,
    /// SwiGLU input `[2F, h]` = `[gate; up]`.
    Fc1,
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
    /// Roles of layer `l`, in the order they are written.
    pub fn layer_roles(cfg: &ModelConfig, l: usize) -> Vec<Role> {
        let mut roles = vec![Role::InputNorm, Role::Qkv];
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
        roles.push(Role::PostNorm);
        roles.extend(Role::mlp_roles(cfg, l));
        roles
    }

    /// The MLP roles of layer `l`: fc1 and fc2 of a dense layer; an MoE layer's router, each
    /// routed expert's fc1 and fc2, then the shared experts' gate, fc1 and fc2 (the order
    /// megatron-core's `MoELayer` registers them: a module's own parameters before its
    /// children's).
    pub fn mlp_roles(cfg: &ModelConfig, l: usize) -> Vec<Role> {
        let Some(moe) = cfg.moe.as_ref().filter(|m| m.is_moe_layer(l)) else {
            return vec![Role::Fc1, Role::Fc2];
        };
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
            Role::Qkv => "linear_qkv",
            Role::Proj => "linear_proj",
            Role::Fc1 | Role::ExpertFc1(_) | Role::SharedFc1 => "linear_fc1",
            Role::Fc2 | Role::ExpertFc2(_) | Role::SharedFc2 => "linear_fc2",
            _ => return None,
        })
    }

    /// The dtype a tensor of this role has in a model of `model` dtype: the expert bias stays
    /// f32 (megatron-core router.py `_maintain_float32_expert_bias`), the rest is the model's.
    pub fn dtype(self, model: DType) -> DType {
        match self {
            Role::ExpertBias => DType::F32,
            _ => model,
        }
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

/// Every canonical tensor of the model, in file order.
pub fn canonical(cfg: &ModelConfig) -> Vec<Canon> {
    let global = |role| Canon { role, layer: None };
    let mut out = vec![global(Role::Embedding)];
    for l in 0..cfg.layers {
        out.extend(Role::layer_roles(cfg, l).into_iter().map(|role| Canon {
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
        Role::QNorm if cfg.qk_norm_per_layer => vec![cfg.heads * cfg.head_dim],
        Role::KNorm if cfg.qk_norm_per_layer => vec![cfg.groups * cfg.head_dim],
        Role::QNorm | Role::KNorm => vec![cfg.head_dim],
        Role::Qkv => vec![qkv_rows, cfg.hidden],
        Role::QkvBias => vec![qkv_rows],
        Role::Proj => vec![cfg.hidden, cfg.heads * cfg.head_dim],
        Role::Fc1 => vec![2 * cfg.ffn, cfg.hidden],
        Role::Fc2 => vec![cfg.hidden, cfg.ffn],
        Role::Router => vec![cfg.moe.as_ref().map_or(0, |m| m.experts), cfg.hidden],
        Role::ExpertBias => vec![cfg.moe.as_ref().map_or(0, |m| m.experts)],
        Role::ExpertFc1(_) => vec![2 * moe_ffn(cfg), cfg.hidden],
        Role::ExpertFc2(_) => vec![cfg.hidden, moe_ffn(cfg)],
        Role::SharedFc1 => vec![2 * shared_ffn(cfg), cfg.hidden],
        Role::SharedFc2 => vec![cfg.hidden, shared_ffn(cfg)],
        Role::SharedGate => vec![1, cfg.hidden],
    }
}

/// One routed expert's intermediate size (0 for a dense model).
pub fn moe_ffn(cfg: &ModelConfig) -> usize {
    cfg.moe.as_ref().map_or(0, |m| m.ffn)
}

/// The shared experts' intermediate size (0 without them).
pub fn shared_ffn(cfg: &ModelConfig) -> usize {
    cfg.moe.as_ref().and_then(|m| m.shared_ffn).unwrap_or(0)
}
