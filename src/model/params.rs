//! The parameter table of a LLaMA-family model: every trainable tensor with its canonical role,
//! its Megatron name (mcore local spec, as MindSpeed-LLM trains), its shape (the vocabulary
//! padded as Megatron pads it) and whether weight decay applies. It is the one list that
//! drives allocation, initialisation, gradients, the optimizer and checkpoints, in the order
//! megatron-core registers the parameters (so optimizer state ids match Megatron's).

use crate::ckpt::config::ModelConfig;
use crate::ckpt::transform::{canonical_shape, Canon, Role};

/// One trainable tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamInfo {
    /// Its canonical role and layer.
    pub canon: Canon,
    /// Megatron's state-dict key (`decoder.layers.0.self_attention.linear_qkv.weight`).
    pub name: String,
    /// Shape (embedding and output rows = the padded vocabulary).
    pub shape: Vec<usize>,
    /// Megatron's rule (megatron/core/optimizer/__init__.py `_get_param_groups`): no weight
    /// decay on biases and 1-D parameters.
    pub decay: bool,
    /// Initialised with the output-layer std `σ/√(2L)` (linear_proj, linear_fc2).
    pub scaled_init: bool,
}

impl ParamInfo {
    /// Elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// All parameters of a model, in megatron-core's registration order.
#[derive(Debug, Clone)]
pub struct ParamTable {
    /// The parameters.
    pub params: Vec<ParamInfo>,
    /// Vocabulary rows of the embedding and output (padded).
    pub vocab_padded: usize,
}

/// Megatron's mcore key of a layer parameter.
fn layer_name(role: Role, l: usize) -> String {
    let suffix = match role {
        Role::InputNorm => "input_layernorm.weight",
        Role::Qkv => "self_attention.linear_qkv.weight",
        Role::QkvBias => "self_attention.linear_qkv.bias",
        Role::Proj => "self_attention.linear_proj.weight",
        Role::ProjBias => "self_attention.linear_proj.bias",
        Role::PostNorm => "pre_mlp_layernorm.weight",
        Role::Fc1 => "mlp.linear_fc1.weight",
        Role::Fc2 => "mlp.linear_fc2.weight",
        Role::Embedding | Role::FinalNorm | Role::Output => unreachable!("not a layer role"),
    };
    format!("decoder.layers.{l}.{suffix}")
}

impl ParamTable {
    /// The table of `cfg` with its vocabulary padded to `vocab_padded` rows.
    pub fn new(cfg: &ModelConfig, vocab_padded: usize) -> ParamTable {
        let mut params = Vec::new();
        let mut push = |canon: Canon, name: String| {
            let mut shape = canonical_shape(cfg, canon.role);
            if matches!(canon.role, Role::Embedding | Role::Output) {
                shape[0] = vocab_padded;
            }
            let decay = !(name.ends_with(".bias") || shape.len() == 1);
            let scaled_init = matches!(canon.role, Role::Proj | Role::Fc2);
            params.push(ParamInfo {
                canon,
                name,
                shape,
                decay,
                scaled_init,
            });
        };
        let global = |role| Canon { role, layer: None };
        push(
            global(Role::Embedding),
            "embedding.word_embeddings.weight".into(),
        );
        // megatron-core builds an attention block's linear_proj before its linear_qkv
        // (megatron/core/transformer/attention.py: Attention.__init__, then SelfAttention).
        let mut roles = vec![Role::InputNorm, Role::Proj];
        if cfg.proj_bias {
            roles.push(Role::ProjBias);
        }
        roles.push(Role::Qkv);
        if cfg.qkv_bias {
            roles.push(Role::QkvBias);
        }
        roles.extend([Role::PostNorm, Role::Fc1, Role::Fc2]);
        for l in 0..cfg.layers {
            for &role in &roles {
                push(
                    Canon {
                        role,
                        layer: Some(l),
                    },
                    layer_name(role, l),
                );
            }
        }
        push(
            global(Role::FinalNorm),
            "decoder.final_layernorm.weight".into(),
        );
        if !cfg.tied {
            push(global(Role::Output), "output_layer.weight".into());
        }
        ParamTable {
            params,
            vocab_padded,
        }
    }

    /// The index of a canonical tensor.
    pub fn index(&self, canon: Canon) -> Option<usize> {
        self.params.iter().position(|p| p.canon == canon)
    }

    /// Elements in all parameters.
    pub fn numel(&self) -> usize {
        self.params.iter().map(ParamInfo::numel).sum()
    }
}
