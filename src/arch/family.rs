//! Model families as data: how each names its tensors in Hugging Face format and which
//! `config.json` conventions it uses. The converter has one code path; a family only
//! changes names (`docs/checkpoints.md` §2.1, §3.7).

use super::moe::ScoreFunction;

/// How a family stores the attention input projection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QkvStyle {
    /// `q_proj`, `k_proj`, `v_proj` (llama, mistral, qwen2, internlm, aquila, qwen3, seed_oss).
    Separate,
    /// One `W_pack` tensor with rows `[q; k; v]` (baichuan).
    Packed,
}

/// Whether a family's attention output projection has a bias.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutBias {
    /// When the q/k/v biases are there (`bias_key` switches both).
    WithQkv,
    /// As its own `config.json` key says (seed_oss's `attention_out_bias`).
    Key(&'static str),
    /// Never (glm4_moe: `o_proj` has none whatever `attention_bias` says).
    Never,
}

/// Whether a family normalises each query and key head before RoPE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QkNorm {
    /// Never.
    No,
    /// Always (qwen3's `q_norm`, `k_norm`).
    Yes,
    /// As its `config.json` key says (glm4_moe's `use_qk_norm`, default false).
    Key(&'static str),
}

impl QkNorm {
    /// Whether the family can hold a model with (`true`) or without q/k norms.
    pub fn allows(self, qk_norm: bool) -> bool {
        match self {
            QkNorm::No => !qk_norm,
            QkNorm::Yes => qk_norm,
            QkNorm::Key(_) => true,
        }
    }
}

/// A LLaMA-architecture family.
#[derive(Debug)]
pub struct Family {
    /// Canonical name (`--family`).
    pub name: &'static str,
    /// Other names accepted for `--family`.
    pub aliases: &'static [&'static str],
    /// `config.json` `model_type` values that select it.
    pub model_types: &'static [&'static str],
    /// `architectures[0]` written to `config.json`.
    pub architecture: &'static str,
    /// Attention projection storage.
    pub qkv: QkvStyle,
    /// The `config.json` key that switches attention biases on, when the family has one: the
    /// q/k/v biases, and the output projection's too where [`OutBias::WithQkv`].
    pub bias_key: Option<&'static str>,
    /// What `bias_key` means when `config.json` leaves it out (transformers' default).
    pub bias_default: bool,
    /// The output projection's bias.
    pub out_bias: OutBias,
    /// Whether the family always has q/k/v biases (qwen2).
    pub always_qkv_bias: bool,
    /// Whether the family normalises each query and key head before RoPE.
    pub qk_norm: QkNorm,
    /// Whether `config.json`'s `partial_rotary_factor` may rotate part of each head
    /// (glm4_moe); elsewhere it must be 1.
    pub partial_rotary: bool,
    /// Whether its attention is multi-latent attention (`q_a_proj`, `kv_a_proj_with_mqa`, …;
    /// [`crate::arch::Mla`]) rather than grouped-query attention.
    pub mla: bool,
    /// Its norms are LayerNorms with a bias (`input_layernorm.bias`, …; Phi-3.5-MoE's
    /// `nn.LayerNorm`), not RMSNorms.
    pub layer_norm: bool,
    /// The `config.json` key giving `lm_head` a bias (Phi-3.5-MoE's `lm_head_bias`), when the
    /// family has one.
    pub lm_head_bias: Option<&'static str>,
    /// How a mixture-of-experts family names its experts; `None` for dense families.
    pub moe: Option<MoeNames>,
    /// LongCat-Flash's layer ([`crate::arch::ModelConfig::paired`]): `config.json` counts
    /// its `num_layers` and sizes the dense MLPs by `ffn_hidden_size`; a layer's sublayers
    /// are `input_layernorm.{s}`, `self_attn.{s}`, `post_attention_layernorm.{s}`,
    /// `mlps.{s}`, its shortcut experts the layer's `mlp`, whose routing's softmax takes the
    /// expert bias for the choice and whose multi-latent attention scales its latents.
    pub paired: bool,
}

/// Which layers of a mixture-of-experts family are MoE layers, as its `config.json` says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MoeLayers {
    /// Every layer (Mixtral).
    All,
    /// Those `decoder_sparse_step` places and `mlp_only_layers` does not list (the Qwen MoE
    /// families, transformers' `Qwen3MoeDecoderLayer`).
    SparseStep,
    /// All but the first `first_k_dense_replace` (glm4_moe, DeepSeek).
    FirstDense,
}

/// Whether a family renormalises the probabilities of the experts it chooses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TopkNorm {
    /// Always (Mixtral).
    Always,
    /// As this `config.json` key says (`norm_topk_prob`, transformers' default false).
    Key(&'static str),
    /// Never, whatever `config.json` says (transformers 4.57's `DeepseekV2MoEGate` reads
    /// `norm_topk_prob` but does not use it).
    Never,
}

/// How a family sizes its shared experts in `config.json`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SharedSize {
    /// Their intermediate size under this key (Qwen2-MoE's `shared_expert_intermediate_size`).
    Key(&'static str),
    /// This key's count of routed experts' sizes (glm4_moe's `n_shared_experts`).
    Experts(&'static str),
}

/// A family's shared experts.
#[derive(Debug)]
pub struct SharedNames {
    /// Their module in the block (`shared_expert`, `shared_experts`).
    pub module: &'static str,
    /// Whether a sigmoid gate `{module}_gate` scales their output (Qwen2-MoE).
    pub gated: bool,
    /// How `config.json` sizes them.
    pub size: SharedSize,
}

/// How a mixture-of-experts family names its MoE block in `config.json` and its tensors
/// (transformers 4.57's modeling files), and how its router routes.
#[derive(Debug)]
pub struct MoeNames {
    /// The block's module in a layer (`mlp`; Mixtral's `block_sparse_moe`); its router is
    /// `{block}.gate`, expert `e` is `{block}.experts.{e}`.
    pub block: &'static str,
    /// An expert's gate, up and down projections (Mixtral's `w1`, `w3`, `w2`).
    pub expert: [&'static str; 3],
    /// The `config.json` key of the routed expert count.
    pub experts_key: &'static str,
    /// The `config.json` key of one routed expert's intermediate size.
    pub ffn_key: &'static str,
    /// Whether the chosen experts' probabilities are renormalised.
    pub norm_topk: TopkNorm,
    /// Which layers are MoE layers.
    pub layers: MoeLayers,
    /// The shared experts, when the family has them.
    pub shared: Option<SharedNames>,
    /// The router's expert bias in the block (`gate.e_score_correction_bias`), when the
    /// family's routing has one.
    pub expert_bias: Option<&'static str>,
    /// The router's score function.
    pub score: ScoreFunction,
    /// The `config.json` key scaling the routing weights (`routed_scaling_factor`).
    pub scaling_key: Option<&'static str>,
    /// The `config.json` keys of group-limited routing: groups, groups kept (`n_group`,
    /// `topk_group`; transformers scores a group by its best two experts).
    pub group_keys: Option<(&'static str, &'static str)>,
    /// The `config.json` key that turns those groups on, scoring each by its best expert
    /// (DeepSeek-V2's `topk_method`: `greedy` or `group_limited_greedy`); without it the
    /// groups always limit the routing.
    pub greedy_key: Option<&'static str>,
    /// Whether transformers takes the router's product in f32 whatever the weights' dtype
    /// (glm4_moe's `Glm4MoeTopkRouter`).
    pub router_f32: bool,
    /// The router's module in the block (`gate`; LongCat-Flash's `router.classifier`).
    pub router: &'static str,
    /// The `config.json` key of the experts a token goes to (`num_experts_per_tok`).
    pub topk_key: &'static str,
    /// The `config.json` key of the zero-computation experts' count, when the family has them
    /// (LongCat-Flash's `zero_expert_num`: they return a token's input times its weight).
    pub zero_key: Option<&'static str>,
    /// Its router routes by SparseMixer's top-2 ([`crate::arch::moe::sparsemixer`];
    /// Phi-3.5-MoE's `sparsemixer`), its score function and normalisation aside.
    pub sparsemixer: bool,
}

/// Qwen2-MoE and Qwen3-MoE name their experts alike.
const QWEN_MOE: MoeNames = MoeNames {
    block: "mlp",
    expert: ["gate_proj", "up_proj", "down_proj"],
    experts_key: "num_experts",
    ffn_key: "moe_intermediate_size",
    norm_topk: TopkNorm::Key("norm_topk_prob"),
    layers: MoeLayers::SparseStep,
    shared: None,
    expert_bias: None,
    score: ScoreFunction::Softmax,
    scaling_key: None,
    group_keys: None,
    greedy_key: None,
    router_f32: false,
    router: "gate",
    topk_key: "num_experts_per_tok",
    zero_key: None,
    sparsemixer: false,
};

/// Every supported family.
pub const FAMILIES: &[Family] = &[
    Family {
        name: "llama",
        aliases: &["llama2", "llama3", "llama-2", "llama-3"],
        model_types: &["llama"],
        architecture: "LlamaForCausalLM",
        qkv: QkvStyle::Separate,
        bias_key: Some("attention_bias"),
        bias_default: false,
        out_bias: OutBias::WithQkv,
        always_qkv_bias: false,
        qk_norm: QkNorm::No,
        partial_rotary: false,
        mla: false,
        layer_norm: false,
        lm_head_bias: None,
        paired: false,
        moe: None,
    },
    Family {
        name: "mistral",
        aliases: &[],
        model_types: &["mistral"],
        architecture: "MistralForCausalLM",
        qkv: QkvStyle::Separate,
        bias_key: None,
        bias_default: false,
        out_bias: OutBias::WithQkv,
        always_qkv_bias: false,
        qk_norm: QkNorm::No,
        partial_rotary: false,
        mla: false,
        layer_norm: false,
        lm_head_bias: None,
        paired: false,
        moe: None,
    },
    Family {
        name: "qwen2",
        aliases: &["qwen2.5", "qwen25"],
        model_types: &["qwen2"],
        architecture: "Qwen2ForCausalLM",
        qkv: QkvStyle::Separate,
        bias_key: None,
        bias_default: false,
        out_bias: OutBias::WithQkv,
        always_qkv_bias: true,
        qk_norm: QkNorm::No,
        partial_rotary: false,
        mla: false,
        layer_norm: false,
        lm_head_bias: None,
        paired: false,
        moe: None,
    },
    Family {
        name: "internlm",
        aliases: &[],
        model_types: &["internlm"],
        architecture: "InternLMForCausalLM",
        qkv: QkvStyle::Separate,
        bias_key: Some("bias"),
        bias_default: false,
        out_bias: OutBias::WithQkv,
        always_qkv_bias: false,
        qk_norm: QkNorm::No,
        partial_rotary: false,
        mla: false,
        layer_norm: false,
        lm_head_bias: None,
        paired: false,
        moe: None,
    },
    Family {
        name: "baichuan",
        aliases: &["baichuan-7b", "baichuan7b"],
        model_types: &["baichuan"],
        architecture: "BaichuanForCausalLM",
        qkv: QkvStyle::Packed,
        bias_key: None,
        bias_default: false,
        out_bias: OutBias::WithQkv,
        always_qkv_bias: false,
        qk_norm: QkNorm::No,
        partial_rotary: false,
        mla: false,
        layer_norm: false,
        lm_head_bias: None,
        paired: false,
        moe: None,
    },
    Family {
        name: "aquila",
        aliases: &[],
        model_types: &["aquila"],
        architecture: "AquilaForCausalLM",
        qkv: QkvStyle::Separate,
        bias_key: None,
        bias_default: false,
        out_bias: OutBias::WithQkv,
        always_qkv_bias: false,
        qk_norm: QkNorm::No,
        partial_rotary: false,
        mla: false,
        layer_norm: false,
        lm_head_bias: None,
        paired: false,
        moe: None,
    },
    Family {
        name: "qwen3",
        aliases: &[],
        model_types: &["qwen3"],
        architecture: "Qwen3ForCausalLM",
        qkv: QkvStyle::Separate,
        bias_key: Some("attention_bias"),
        bias_default: false,
        out_bias: OutBias::WithQkv,
        always_qkv_bias: false,
        qk_norm: QkNorm::Yes,
        partial_rotary: false,
        mla: false,
        layer_norm: false,
        lm_head_bias: None,
        paired: false,
        moe: None,
    },
    Family {
        name: "seed_oss",
        aliases: &["seed-oss"],
        model_types: &["seed_oss"],
        architecture: "SeedOssForCausalLM",
        qkv: QkvStyle::Separate,
        // transformers' SeedOssConfig: attention_bias (q/k/v) on by default, attention_out_bias off
        bias_key: Some("attention_bias"),
        bias_default: true,
        out_bias: OutBias::Key("attention_out_bias"),
        always_qkv_bias: false,
        qk_norm: QkNorm::No,
        partial_rotary: false,
        mla: false,
        layer_norm: false,
        lm_head_bias: None,
        paired: false,
        moe: None,
    },
    Family {
        name: "qwen3_moe",
        aliases: &["qwen3-moe"],
        model_types: &["qwen3_moe"],
        architecture: "Qwen3MoeForCausalLM",
        qkv: QkvStyle::Separate,
        bias_key: Some("attention_bias"),
        bias_default: false,
        out_bias: OutBias::WithQkv,
        always_qkv_bias: false,
        qk_norm: QkNorm::Yes,
        partial_rotary: false,
        mla: false,
        layer_norm: false,
        lm_head_bias: None,
        paired: false,
        moe: Some(QWEN_MOE),
    },
    Family {
        name: "qwen2_moe",
        aliases: &["qwen2-moe", "qwen1.5-moe"],
        model_types: &["qwen2_moe"],
        architecture: "Qwen2MoeForCausalLM",
        qkv: QkvStyle::Separate,
        bias_key: None,
        bias_default: false,
        out_bias: OutBias::WithQkv,
        always_qkv_bias: true,
        qk_norm: QkNorm::No,
        partial_rotary: false,
        mla: false,
        layer_norm: false,
        lm_head_bias: None,
        paired: false,
        moe: Some(MoeNames {
            shared: Some(SharedNames {
                module: "shared_expert",
                gated: true,
                size: SharedSize::Key("shared_expert_intermediate_size"),
            }),
            ..QWEN_MOE
        }),
    },
    Family {
        name: "mixtral",
        aliases: &[],
        model_types: &["mixtral"],
        architecture: "MixtralForCausalLM",
        qkv: QkvStyle::Separate,
        bias_key: None,
        bias_default: false,
        out_bias: OutBias::WithQkv,
        always_qkv_bias: false,
        qk_norm: QkNorm::No,
        partial_rotary: false,
        mla: false,
        layer_norm: false,
        lm_head_bias: None,
        paired: false,
        moe: Some(MoeNames {
            block: "block_sparse_moe",
            expert: ["w1", "w3", "w2"],
            experts_key: "num_local_experts",
            ffn_key: "intermediate_size",
            norm_topk: TopkNorm::Always,
            layers: MoeLayers::All,
            shared: None,
            ..QWEN_MOE
        }),
    },
    Family {
        name: "phimoe",
        aliases: &["phi35_moe", "phi3.5-moe", "phi-3.5-moe"],
        model_types: &["phimoe"],
        architecture: "PhimoeForCausalLM",
        qkv: QkvStyle::Separate,
        // transformers' PhimoeConfig: attention_bias (q/k/v and o_proj) off by default
        bias_key: Some("attention_bias"),
        bias_default: false,
        out_bias: OutBias::WithQkv,
        always_qkv_bias: false,
        qk_norm: QkNorm::No,
        partial_rotary: false,
        mla: false,
        layer_norm: true,
        lm_head_bias: Some("lm_head_bias"),
        paired: false,
        moe: Some(MoeNames {
            block: "block_sparse_moe",
            expert: ["w1", "w3", "w2"],
            experts_key: "num_local_experts",
            ffn_key: "intermediate_size",
            norm_topk: TopkNorm::Never,
            layers: MoeLayers::All,
            shared: None,
            sparsemixer: true,
            ..QWEN_MOE
        }),
    },
    Family {
        name: "glm4_moe",
        aliases: &["glm45", "glm4.5", "glm45-air"],
        model_types: &["glm4_moe"],
        architecture: "Glm4MoeForCausalLM",
        qkv: QkvStyle::Separate,
        bias_key: Some("attention_bias"),
        bias_default: false,
        out_bias: OutBias::Never,
        always_qkv_bias: false,
        qk_norm: QkNorm::Key("use_qk_norm"),
        partial_rotary: true,
        mla: false,
        layer_norm: false,
        lm_head_bias: None,
        paired: false,
        moe: Some(DEEPSEEK_MOE),
    },
    Family {
        name: "deepseek_v2",
        aliases: &[
            "deepseek2",
            "deepseek-v2",
            "deepseek2-lite",
            "deepseek2_lite",
        ],
        model_types: &["deepseek_v2"],
        architecture: "DeepseekV2ForCausalLM",
        moe: Some(DEEPSEEK_V2_MOE),
        // DeepSeek-V3's attention (V2-Lite's queries without a latent read from config.json)
        ..DEEPSEEK_V3
    },
    DEEPSEEK_V3,
    Family {
        name: "longcat_flash",
        aliases: &["longcat", "longcat-flash"],
        model_types: &["longcat_flash"],
        architecture: "LongcatFlashForCausalLM",
        paired: true,
        moe: Some(LONGCAT_MOE),
        // DeepSeek-V3's attention, its latents' norms as q/k norms
        ..DEEPSEEK_V3
    },
];

/// DeepSeek-V3 (and Kimi-K2, which transformers reads as it).
const DEEPSEEK_V3: Family = Family {
    name: "deepseek_v3",
    aliases: &["deepseek3", "deepseek-v3", "kimi2", "kimi-k2"],
    model_types: &["deepseek_v3", "kimi_k2"],
    architecture: "DeepseekV3ForCausalLM",
    qkv: QkvStyle::Separate,
    bias_key: Some("attention_bias"),
    bias_default: false,
    out_bias: OutBias::Never,
    always_qkv_bias: false,
    // the query and key-value latents' norms (q_a_layernorm, kv_a_layernorm)
    qk_norm: QkNorm::Yes,
    partial_rotary: false,
    mla: true,
    layer_norm: false,
    lm_head_bias: None,
    paired: false,
    moe: Some(DEEPSEEK_MOE),
};

/// LongCat-Flash (transformers 4.57's `LongcatFlashMoE`, `LongcatFlashTopkRouter`): a softmax
/// over the routed and zero-computation experts in f32, the expert bias added for the choice,
/// the top-k as they are, scaled; every layer's shortcut experts.
const LONGCAT_MOE: MoeNames = MoeNames {
    experts_key: "n_routed_experts",
    ffn_key: "expert_ffn_hidden_size",
    norm_topk: TopkNorm::Never,
    layers: MoeLayers::All,
    expert_bias: Some("router.e_score_correction_bias"),
    scaling_key: Some("routed_scaling_factor"),
    router_f32: true,
    router: "router.classifier",
    topk_key: "moe_topk",
    zero_key: Some("zero_expert_num"),
    ..QWEN_MOE
};

/// DeepSeek-V2 (transformers 4.57's `DeepseekV2MoEGate`): softmax scores over all experts in
/// f32, the top-k as they are (never renormalised), scaled, shared experts, the first layers
/// dense; with `topk_method` `group_limited_greedy` (DeepSeek-V2, V2-Chat) within the best
/// `topk_group` of `n_group` groups, each scored by its best expert.
const DEEPSEEK_V2_MOE: MoeNames = MoeNames {
    experts_key: "n_routed_experts",
    norm_topk: TopkNorm::Never,
    layers: MoeLayers::FirstDense,
    shared: Some(SharedNames {
        module: "shared_experts",
        gated: false,
        size: SharedSize::Experts("n_shared_experts"),
    }),
    scaling_key: Some("routed_scaling_factor"),
    group_keys: Some(("n_group", "topk_group")),
    greedy_key: Some("topk_method"),
    router_f32: true,
    ..QWEN_MOE
};

/// GLM-4.5 and DeepSeek-V3 route alike (transformers' `Glm4MoeTopkRouter`,
/// `DeepseekV3TopkRouter`): sigmoid scores in f32, an expert bias, groups, shared experts.
const DEEPSEEK_MOE: MoeNames = MoeNames {
    experts_key: "n_routed_experts",
    layers: MoeLayers::FirstDense,
    shared: Some(SharedNames {
        module: "shared_experts",
        gated: false,
        size: SharedSize::Experts("n_shared_experts"),
    }),
    expert_bias: Some("gate.e_score_correction_bias"),
    score: ScoreFunction::Sigmoid,
    scaling_key: Some("routed_scaling_factor"),
    group_keys: Some(("n_group", "topk_group")),
    router_f32: true,
    ..QWEN_MOE
};

fn supported() -> String {
    FAMILIES
        .iter()
        .map(|f| f.name)
        .collect::<Vec<_>>()
        .join(", ")
}

/// A model family mindkit does not know.
#[derive(Debug, thiserror::Error)]
pub enum UnknownFamily {
    /// `--family NAME` names none of the families.
    #[error("unsupported model family {0:?}; supported: {supported}", supported = supported())]
    Name(String),
    /// `config.json`'s `model_type` belongs to none of the families.
    #[error(
        "unsupported model_type {0:?} in config.json; supported families: {supported} \
         (--family overrides the detection for LLaMA-architecture models)",
        supported = supported()
    )]
    ModelType(String),
}

impl Family {
    /// Decoder layers per layer of its files: 2 for a [`Family::paired`] family, else 1.
    pub fn sublayers(&self) -> usize {
        if self.paired {
            2
        } else {
            1
        }
    }
}

/// The family called `name` (`--family`), or an error listing the supported ones.
pub fn by_name(name: &str) -> Result<&'static Family, UnknownFamily> {
    let lower = name.to_ascii_lowercase();
    FAMILIES
        .iter()
        .find(|f| f.name == lower || f.aliases.contains(&lower.as_str()))
        .ok_or_else(|| UnknownFamily::Name(name.to_string()))
}

/// The family whose `config.json` says `model_type`.
pub fn by_model_type(model_type: &str) -> Result<&'static Family, UnknownFamily> {
    FAMILIES
        .iter()
        .find(|f| f.model_types.contains(&model_type))
        .ok_or_else(|| UnknownFamily::ModelType(model_type.to_string()))
}

/// HF tensor names (`docs/checkpoints.md` §2.1). Layer tensors take the layer index.
pub mod hf_names {
    /// Token embedding.
    pub const EMBED: &str = "model.embed_tokens.weight";
    /// Final norm.
    pub const FINAL_NORM: &str = "model.norm.weight";
    /// Output projection (absent when tied).
    pub const LM_HEAD: &str = "lm_head.weight";

    /// `model.layers.{i}.{suffix}`
    pub fn layer(i: usize, suffix: &str) -> String {
        format!("model.layers.{i}.{suffix}")
    }

    /// Layer-tensor suffixes.
    pub const INPUT_NORM: &str = "input_layernorm.weight";
    /// q, k, v projection suffixes (weights; biases replace `weight` with `bias`).
    pub const QKV: [&str; 3] = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"];
    /// Baichuan's packed projection.
    pub const W_PACK: &str = "self_attn.W_pack";
    /// Attention output.
    pub const O_PROJ: &str = "self_attn.o_proj";
    /// Norm before the MLP.
    pub const POST_NORM: &str = "post_attention_layernorm.weight";
    /// SwiGLU gate and up projections.
    pub const GATE_UP: [&str; 2] = ["mlp.gate_proj.weight", "mlp.up_proj.weight"];
    /// MLP output.
    pub const DOWN: &str = "mlp.down_proj.weight";
    /// Per-head query and key norms (qwen3).
    pub const QK_NORM: [&str; 2] = ["self_attn.q_norm.weight", "self_attn.k_norm.weight"];
    /// Multi-latent attention's tensors (transformers' `DeepseekV3Attention`): the query
    /// down projection, its latent's norm, the up projection, the query projection without a
    /// latent; the key-value down projection, its latent's norm, the up projection.
    pub const MLA_Q: [&str; 4] = [
        "self_attn.q_a_proj.weight",
        "self_attn.q_a_layernorm.weight",
        "self_attn.q_b_proj.weight",
        "self_attn.q_proj.weight",
    ];
    /// A multi-token prediction depth's tensors (DeepSeek-V3's checkpoints, layer index
    /// `num_hidden_layers + k`): the embedding's norm, the hidden state's norm, the projection,
    /// the final norm.
    pub const MTP: [&str; 4] = [
        "enorm.weight",
        "hnorm.weight",
        "eh_proj.weight",
        "shared_head.norm.weight",
    ];
    /// A depth's copies of the embedding and the output layer.
    pub const MTP_COPIES: [&str; 2] = ["embed_tokens.weight", "shared_head.head.weight"];
    /// The key-value half of [`MLA_Q`].
    pub const MLA_KV: [&str; 3] = [
        "self_attn.kv_a_proj_with_mqa.weight",
        "self_attn.kv_a_layernorm.weight",
        "self_attn.kv_b_proj.weight",
    ];
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_types_resolve() {
        assert_eq!(by_name("LLaMA3").unwrap().name, "llama");
        assert_eq!(by_model_type("qwen2").unwrap().name, "qwen2");
        let err = by_name("gpt-neox").unwrap_err().to_string();
        assert!(err.contains("supported: llama, mistral, qwen2"), "{err}");
    }
}
