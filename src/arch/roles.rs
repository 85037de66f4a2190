//! The canonical tensors of a model: what each one is (its role), in which layer, and its
//! unsharded shape in Megatron's order. Checkpoint formats map their tensors onto these
//! (`crate::ckpt::transform`); the model and the optimizer iterate them as parameters.

use super::ModelConfig;

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
        if cfg.qk_norm {
            roles.extend([Role::QNorm, Role::KNorm]);
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
        Role::QNorm | Role::KNorm => vec![cfg.head_dim],
        Role::Qkv => vec![qkv_rows, cfg.hidden],
        Role::QkvBias => vec![qkv_rows],
        Role::Proj => vec![cfg.hidden, cfg.heads * cfg.head_dim],
        Role::Fc1 => vec![2 * cfg.ffn, cfg.hidden],
        Role::Fc2 => vec![cfg.hidden, cfg.ffn],
    }
}
