//! What a model is, apart from any file format or engine: its architecture numbers
//! ([`ModelConfig`]), its family as data ([`family`]: tensor names, QKV packing) and its
//! canonical tensors ([`roles`]: roles and shapes). Checkpoint formats (`crate::ckpt`) read
//! and write these; the model (`crate::model`) and the trainer (`crate::train`) compute on them.

pub mod family;
pub mod moe;
pub mod roles;

use crate::tensor::DType;
use family::Family;
use serde_json::Value as Json;

/// Architecture numbers shared by both formats.
#[derive(Debug, Clone)]
pub struct ModelConfig {
    /// The family (tensor naming).
    pub family: &'static Family,
    /// Decoder layers (for a [`ModelConfig::paired`] model twice the layers its files count).
    pub layers: usize,
    /// LongCat-Flash's layer (MindSpeed-LLM's `--spec mindspeed_llm.tasks.models.spec.
    /// longcat_spec layer_spec`, its longcat_transformer_layer.py; transformers 4.57's
    /// `LongcatFlashDecoderLayer`): each layer of its files is two decoder layers here, the
    /// first's and second's attention, norms and dense MLP its `_0` and `_1` sublayers, and
    /// the first also routes its MLP's normed input through a shortcut mixture of experts
    /// whose output the second adds to its own.
    pub paired: bool,
    /// Hidden size.
    pub hidden: usize,
    /// Attention heads.
    pub heads: usize,
    /// KV heads (query groups).
    pub groups: usize,
    /// Per-head dimension.
    pub head_dim: usize,
    /// The leading dimensions of each query and key head that RoPE rotates: `head_dim`, or
    /// fewer (Megatron's `--rotary-percent`, transformers' `partial_rotary_factor`), the rest
    /// passed through.
    pub rotary_dim: usize,
    /// MLP intermediate size.
    pub ffn: usize,
    /// The dense MLP's activation, gated or not (Megatron's `activation_func` and
    /// `gated_linear_unit`); an MoE layer's experts are SwiGLU.
    pub activation: Activation,
    /// True vocabulary rows (without Megatron padding).
    pub vocab: usize,
    /// Max positions.
    pub max_positions: usize,
    /// RoPE base.
    pub rope_theta: f64,
    /// The norms' epsilon.
    pub norm_eps: f64,
    /// The decoder's norms (each layer's two and the final one) are LayerNorms with a bias β,
    /// `y = (x − μ)·rstd·γ + β` (Megatron's `--normalization LayerNorm`, MindSpeed-LLM's
    /// `PTNorm`; Phi-3.5-MoE's `nn.LayerNorm`), not RMSNorms.
    pub layer_norm: bool,
    /// The epsilon of multi-latent attention's latent norms where it is not `norm_eps`:
    /// transformers 4.57 builds DeepSeek's `q_a_layernorm` / `kv_a_layernorm` with its
    /// RMSNorm's default 1e-6 whatever `rms_norm_eps` says (modeling_deepseek_v3.py
    /// `DeepseekV3Attention`), so a model read from `config.json` has it; Megatron takes
    /// `--norm-epsilon` for every norm, so one read from Megatron args, and training, have none.
    pub latent_norm_eps: Option<f64>,
    /// Output layer shares the embedding.
    pub tied: bool,
    /// q/k/v biases.
    pub qkv_bias: bool,
    /// Attention output bias.
    pub proj_bias: bool,
    /// The output layer's bias `[V]` (MindSpeed-LLM's `--add-output-layer-bias`; Phi-3.5-MoE's
    /// `lm_head_bias`).
    pub output_bias: bool,
    /// Per-head RMSNorms of the queries and keys before RoPE (Qwen3; Megatron's
    /// `--qk-layernorm`).
    pub qk_norm: bool,
    /// The q/k norms span all of a token's heads, γ `[heads·head_dim]` and `[groups·head_dim]`,
    /// instead of each head (MindSpeed-LLM's MiniMax spec, mindspeed_llm/tasks/models/
    /// transformer/minimax_attention.py `MinimaxAttention`; MiniMax-M2's `qk_norm_type:
    /// per_layer`). Tensor parallelism would cut these norms' sums: refused, as MindSpeed-LLM
    /// refuses it.
    pub qk_norm_per_layer: bool,
    /// Multi-latent attention (DeepSeek-V2/V3); `None` for grouped-query attention. With it
    /// `groups` equals `heads`, `head_dim` is a query (and key) head's dimensions (the part
    /// without RoPE and the rotated part) and `rotary_dim` the rotated part's.
    pub mla: Option<Mla>,
    /// The experts of a mixture-of-experts model; `None` for a dense one.
    pub moe: Option<moe::Moe>,
    /// Multi-token prediction's depths after the decoder; `None` without them.
    pub mtp: Option<Mtp>,
    /// Element type of the weights.
    pub dtype: DType,
    /// The norms' weights (γ, and a LayerNorm's β) are f32 whatever `dtype` says
    /// (MindSpeed-LLM's `--init-norm-weight-in-fp32`: its dsa_indexer.py
    /// `norm2fp32_fp16module_init_wrapper` casts every RMSNorm and LayerNorm back to f32 after
    /// `Float16Module` made the model bf16; aclnnRmsNorm takes an f32 γ with bf16 rows and
    /// returns bf16).
    pub norms_f32: bool,
    /// RoPE scaling as config.json spells it (`{"rope_type": "llama3", "factor": …}`), from
    /// config.json or translated from Megatron/MindSpeed args; `None` for plain RoPE.
    pub rope_scaling: Option<Json>,
    /// The original `config.json`, carried through Megatron so the way back restores it.
    pub hf_config: Option<Json>,
}

/// A dense MLP's activation between linear_fc1 and linear_fc2 (megatron-core
/// megatron/core/transformer/mlp.py `MLP.forward`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// `silu(gate)·up` over fc1's `[gate; up]` (Megatron's `--swiglu`: `F.silu`, gated).
    SwiGlu,
    /// `relu(x)²` over fc1's output, not gated (Megatron's `--squared-relu`, megatron-core
    /// megatron/core/activations.py `squared_relu`; PLM's MLP, MindSpeed-LLM's
    /// `--fc-type up_down`).
    SquaredRelu,
}

impl Activation {
    /// Whether fc1 yields a gate and an up projection (`[2F, h]`), not one `[F, h]`.
    pub fn gated(self) -> bool {
        self == Activation::SwiGlu
    }

    /// Megatron's flag for it.
    pub fn flag(self) -> &'static str {
        match self {
            Activation::SwiGlu => "--swiglu",
            Activation::SquaredRelu => "--squared-relu",
        }
    }
}

/// The shape of multi-latent attention (megatron-core megatron/core/transformer/
/// multi_latent_attention.py `MLASelfAttention`; transformers' `DeepseekV3Attention`): queries
/// from a low-rank latent (or straight from the hidden state), keys and values from a shared
/// low-rank latent, each head's key the up-projected part without RoPE and one rotated part
/// shared by all heads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mla {
    /// The query latent's width (`--q-lora-rank`, `q_lora_rank`); `None`: queries projected
    /// from the hidden state (DeepSeek-V2-Lite).
    pub q_lora_rank: Option<usize>,
    /// The key-value latent's width (`--kv-lora-rank`).
    pub kv_lora_rank: usize,
    /// A head's query and key dimensions without RoPE (`--qk-head-dim`, `qk_nope_head_dim`).
    pub qk_head_dim: usize,
    /// The rotated dimensions of a head's query and of the shared key part
    /// (`--qk-pos-emb-head-dim`, `qk_rope_head_dim`).
    pub rope_dim: usize,
    /// A head's value dimensions (`--v-head-dim`).
    pub v_head_dim: usize,
    /// MindSpeed-LLM's layer spec (`--spec mindspeed_llm.tasks.models.spec.deepseek_spec
    /// layer_spec`): the query's down projection (or its direct projection) and the key-value
    /// one are one replicated `linear_qkv` (its multi_latent_attention.py
    /// `CustomMLASelfAttention`), not megatron-core's two column-parallel ones.
    pub fused_down: bool,
    /// MindSpeed-LLM's `--mla-mm-split` (with its DeepSeek layer spec): each up projection is
    /// two, every head's part without RoPE apart from its rotated part (`linear_qk_nope`,
    /// `linear_qk_rope`) and every head's key part apart from its value (`linear_kv_nope`,
    /// `linear_v`), their rows head by head (its multi_latent_attention.py
    /// `MLASelfAttentionWithMMSplitSubmodules`).
    pub split_up: bool,
    /// The normed query latent and key-value latent scaled by `√(hidden / rank)` before their
    /// up projections (MindSpeed-LLM's `--enable-mla-scale-q-lora`, `--enable-mla-scale-kv-lora`,
    /// its multi_latent_attention.py; LongCat-Flash's `mla_scale_q_lora` / `mla_scale_kv_lora`).
    pub scale_latents: [bool; 2],
    /// DeepSeek sparse attention's lightning indexer (MindSpeed-LLM's `--enable-dsa-indexer`).
    pub dsa: Option<Dsa>,
}

/// DeepSeek sparse attention (DeepSeek-V3.2; MindSpeed-LLM's dsa_indexer.py `DSAIndexer` in its
/// multi_latent_attention.py): a lightning indexer scores every key a query sees,
/// `I(t, s) = Σ_j w_tj·relu(q_tj·k_s)` over its heads j, and the query attends to its `topk`
/// best keys only. Its queries are up-projected from the query latent (`wq_b`), its one key
/// per row projected from the hidden state (`wk`) and LayerNorm-ed (`k_norm`), its head
/// weights `w` projected from the hidden state (`weights_proj`) times `heads^-½·head_dim^-½`;
/// RoPE acts on the first [`Mla::rope_dim`] dimensions of each. Its inputs are detached: the
/// indexer learns from its own loss only, the KL divergence of its scores' softmax over the
/// selected keys from the main attention's (summed over heads, normalised).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dsa {
    /// The indexer's heads (`--index-n-heads`).
    pub heads: usize,
    /// Its head dimension (`--index-head-dim`).
    pub head_dim: usize,
    /// Keys a query attends to (`--index-topk`).
    pub topk: usize,
    /// Every how many layers one computes its own selection, the rest sharing the last
    /// one's (`--index-topk-freq`; [`Dsa::computes`]).
    pub freq: usize,
    /// The layers up to this one (1-based) compute their own (`--index-skip-topk-offset`).
    pub offset: usize,
    /// RoPE on pairs of neighbouring dimensions `(2i, 2i + 1)` (`--apply-rope-no-in-complex`:
    /// megatron-core's `apply_rotary_pos_emb`), else on the halves `(i, i + d/2)` (MindSpeed-LLM's
    /// `apply_rotary_pos_emb_bshd_in_complex` with `rotary_interleaved=True`).
    pub rope_pairs_adjacent: bool,
    /// The indexer's query input is the normed query latent (MindSpeed-LLM's
    /// `mla_absorb_attention`: `--enable-mla-absorb` with `--use-sparse-flash-attn` and
    /// `--mla-mm-split`), else the latent before its norm (its `mla_naive_attention`).
    pub normed_query: bool,
}

impl Dsa {
    /// Whether canonical layer `l` of a model of `layers` decoder layers has an indexer of its
    /// own (a multi-token prediction depth always: MindSpeed-LLM builds its layer as layer 1),
    /// else shares the selection of the last layer before it that has one (MindSpeed-LLM's
    /// multi_latent_attention.py `_resolve_dsa_source_and_end`: layer L (1-based) computes
    /// when `max(L − offset, 0) mod freq = 0`).
    pub fn computes(&self, l: usize, layers: usize) -> bool {
        let number = if l >= layers { 1 } else { l + 1 };
        number.saturating_sub(self.offset.max(1)) % self.freq.max(1) == 0
    }
}

impl Mla {
    /// The factors of [`Mla::scale_latents`] for a model of `hidden` width: the query latent's
    /// (none without one) and the key-value latent's, in f32 as torch multiplies a tensor by a
    /// Python float.
    pub fn latent_scales(&self, hidden: usize) -> [Option<f32>; 2] {
        let scale = |on: bool, rank: Option<usize>| {
            rank.filter(|_| on)
                .map(|r| (hidden as f64 / r as f64).sqrt() as f32)
        };
        [
            scale(self.scale_latents[0], self.q_lora_rank),
            scale(self.scale_latents[1], Some(self.kv_lora_rank)),
        ]
    }

    /// A query (and key) head's dimensions: without RoPE, then rotated.
    pub fn q_head_dim(&self) -> usize {
        self.qk_head_dim + self.rope_dim
    }

    /// The rows of the queries' first projection out of the hidden state: the latent's, or
    /// every head's query (`q_rank` of MindSpeed-LLM).
    pub fn q_rank(&self, heads: usize) -> usize {
        self.q_lora_rank.unwrap_or(heads * self.q_head_dim())
    }
}

/// Multi-token prediction (DeepSeek-V3's MTP modules; megatron-core megatron/core/transformer/
/// multi_token_prediction.py): `depths` modules after the decoder, depth k predicting the token
/// k + 1 ahead of each position. A depth takes the token k positions ahead (the ids rolled left,
/// zeros past a sequence's end), normalises its embedding (`enorm`) and the previous depth's
/// hidden state (`hnorm`), projects their concatenation `[e; h]` back to the hidden size
/// (`eh_proj`), runs one decoder layer of the last decoder layer's kind and, normed by its own
/// final norm, the shared output layer. Canonical layer `layers + k` is depth k's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mtp {
    /// Prediction depths (`--mtp-num-layers`, `num_nextn_predict_layers`).
    pub depths: usize,
    /// Whose layout and hand-off: MindSpeed-LLM's or megatron-core's.
    pub layout: MtpLayout,
}

/// How a Megatron checkpoint lays out multi-latent attention's projections.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum MlaLayout {
    /// megatron-core's local spec: linear_q_down_proj and linear_kv_down_proj, split over TP.
    Mcore,
    /// MindSpeed-LLM's deepseek_spec (its --spec mindspeed_llm.tasks.models.spec.deepseek_spec
    /// layer_spec, recorded in args.spec): both in one linear_qkv on every TP rank, as its
    /// converters write DeepSeek ([`Mla::fused_down`]).
    Mindspeed,
    /// MindSpeed-LLM's deepseek_spec with --mla-mm-split: the up projections split too,
    /// linear_qk_nope / linear_qk_rope and linear_kv_nope / linear_v ([`Mla::split_up`]).
    MindspeedMmSplit,
}

impl MlaLayout {
    /// The CLI spelling.
    pub fn name(self) -> &'static str {
        match self {
            MlaLayout::Mcore => "mcore",
            MlaLayout::Mindspeed => "mindspeed",
            MlaLayout::MindspeedMmSplit => "mindspeed-mm-split",
        }
    }

    /// `m` laid out so.
    pub fn apply(self, m: Mla) -> Mla {
        Mla {
            fused_down: self != MlaLayout::Mcore,
            split_up: self == MlaLayout::MindspeedMmSplit,
            ..m
        }
    }
}

/// Where multi-token prediction's norms sit, which decides what each depth is handed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum MtpLayout {
    /// MindSpeed-LLM's (mindspeed_llm/core/transformer/multi_token_prediction.py, its
    /// gpt_model.py and transformer_block.py): the decoder's final norm moved after the MTP
    /// block (`final_layernorm`), each depth's final norm into the block
    /// (`mtp.final_layernorms.{k}`), so depth 1 takes the decoder's un-normed output and depth
    /// k + 1 depth k's — DeepSeek-V3's own hand-off.
    Mindspeed,
    /// megatron-core 0.15's: the decoder's norm inside it (`decoder.final_layernorm`), each
    /// depth's in its layer (`mtp.layers.{k}.final_layernorm`), and the normed states handed on.
    Mcore,
}

impl MtpLayout {
    /// The CLI spelling.
    pub fn name(self) -> &'static str {
        match self {
            MtpLayout::Mindspeed => "mindspeed",
            MtpLayout::Mcore => "mcore",
        }
    }
}

impl ModelConfig {
    /// Whether its norms are f32 beside bf16 / f16 weights ([`ModelConfig::norms_f32`]).
    pub fn f32_norms_in_half(&self) -> bool {
        self.norms_f32 && self.dtype != DType::F32
    }

    /// Decoder layers per layer of its files: 2 for a [`ModelConfig::paired`] model, else 1.
    pub fn sublayers(&self) -> usize {
        if self.paired {
            2
        } else {
            1
        }
    }

    /// The layers its files count (Megatron's `num_layers`, `config.json`'s).
    pub fn stored_layers(&self) -> usize {
        self.layers / self.sublayers()
    }

    /// Whether decoder layer `l` opens a pair of a [`ModelConfig::paired`] model: it routes
    /// the shortcut mixture of experts the next layer adds.
    pub fn opens_pair(&self, l: usize) -> bool {
        self.paired && l.is_multiple_of(2) && l < self.layers
    }

    /// The RoPE scaling's kind (`rope_type`, transformers 4.x's older `type`), `None` for plain
    /// RoPE.
    pub fn rope_type(&self) -> Option<&str> {
        let r = self.rope_scaling.as_ref()?;
        r.get("rope_type").or_else(|| r.get("type"))?.as_str()
    }

    /// Multi-token prediction's depths (0 without it).
    pub fn mtp_depths(&self) -> usize {
        self.mtp.map_or(0, |m| m.depths)
    }

    /// The decoder's layers and multi-token prediction's: canonical layers `0..all_layers()`.
    pub fn all_layers(&self) -> usize {
        self.layers + self.mtp_depths()
    }

    /// The prediction depth of canonical layer `l`, `None` for a decoder layer.
    pub fn mtp_depth(&self, l: usize) -> Option<usize> {
        l.checked_sub(self.layers)
            .filter(|&k| k < self.mtp_depths())
    }
}
