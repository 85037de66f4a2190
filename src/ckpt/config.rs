//! The architecture of a LLaMA-family model, read from HF `config.json` (transformers 4.x
//! `rope_theta`/`rope_scaling` and 5.x `rope_parameters` conventions) or from Megatron `args`,
//! and written back to either.

use super::family::{self, Family};
use super::torch::pickle::{DType, Value};
use anyhow::{anyhow, bail, Result};
use serde_json::{json, Value as Json};

/// Architecture numbers shared by both formats.
#[derive(Debug, Clone)]
pub struct ModelConfig {
    /// The family (tensor naming).
    pub family: &'static Family,
    /// Transformer layers.
    pub layers: usize,
    /// Hidden size.
    pub hidden: usize,
    /// Attention heads.
    pub heads: usize,
    /// KV heads (query groups).
    pub groups: usize,
    /// Per-head dimension.
    pub head_dim: usize,
    /// MLP intermediate size.
    pub ffn: usize,
    /// True vocabulary rows (without Megatron padding).
    pub vocab: usize,
    /// Max positions.
    pub max_positions: usize,
    /// RoPE base.
    pub rope_theta: f64,
    /// RMSNorm epsilon.
    pub norm_eps: f64,
    /// Output layer shares the embedding.
    pub tied: bool,
    /// q/k/v biases.
    pub qkv_bias: bool,
    /// Attention output bias.
    pub proj_bias: bool,
    /// Element type of the weights.
    pub dtype: DType,
    /// RoPE scaling as config.json spells it (`{"rope_type": "llama3", "factor": …}`), from
    /// config.json or translated from Megatron/MindSpeed args; `None` for plain RoPE.
    pub rope_scaling: Option<Json>,
    /// The original `config.json`, carried through Megatron so the way back restores it.
    pub hf_config: Option<Json>,
}

fn uint(cfg: &Json, key: &str) -> Option<usize> {
    cfg.get(key).and_then(Json::as_u64).map(|v| v as usize)
}

fn need(cfg: &Json, key: &str) -> Result<usize> {
    uint(cfg, key).ok_or_else(|| anyhow!("config.json: missing or non-integer \"{key}\""))
}

/// `float32`/`bfloat16`/`float16` (as HF and `--dtype` spell them) → dtype.
pub fn parse_dtype(s: &str) -> Result<DType> {
    Ok(match s {
        "float32" | "fp32" | "f32" => DType::F32,
        "bfloat16" | "bf16" => DType::BF16,
        "float16" | "fp16" | "f16" | "half" => DType::F16,
        other => bail!("unsupported dtype {other:?} (use bf16, fp16 or fp32)"),
    })
}

impl ModelConfig {
    /// Read `config.json`; `family` overrides the `model_type` detection.
    pub fn from_hf(cfg: &Json, family: Option<&'static Family>) -> Result<Self> {
        let family = match family {
            Some(f) => f,
            None => {
                let mt = cfg
                    .get("model_type")
                    .and_then(Json::as_str)
                    .ok_or_else(|| anyhow!("config.json: no \"model_type\" (pass --family)"))?;
                family::by_model_type(mt).map_err(|e| anyhow!(e))?
            }
        };
        let hidden = need(cfg, "hidden_size")?;
        let heads = need(cfg, "num_attention_heads")?;
        let rope_theta = cfg
            .get("rope_theta")
            .or_else(|| cfg.pointer("/rope_parameters/rope_theta"))
            .and_then(Json::as_f64)
            .unwrap_or(10000.0);
        let bias = family
            .bias_key
            .and_then(|k| cfg.get(k))
            .and_then(Json::as_bool)
            .unwrap_or(false);
        let dtype = cfg
            .get("torch_dtype")
            .or_else(|| cfg.get("dtype"))
            .and_then(Json::as_str)
            .map(parse_dtype)
            .transpose()?
            .unwrap_or(DType::F32);
        Ok(ModelConfig {
            family,
            layers: need(cfg, "num_hidden_layers")?,
            hidden,
            heads,
            groups: uint(cfg, "num_key_value_heads").unwrap_or(heads),
            head_dim: uint(cfg, "head_dim").unwrap_or(hidden / heads.max(1)),
            ffn: need(cfg, "intermediate_size")?,
            vocab: need(cfg, "vocab_size")?,
            max_positions: uint(cfg, "max_position_embeddings").unwrap_or(4096),
            rope_theta,
            norm_eps: cfg
                .get("rms_norm_eps")
                .and_then(Json::as_f64)
                .unwrap_or(1e-6),
            tied: cfg
                .get("tie_word_embeddings")
                .and_then(Json::as_bool)
                .unwrap_or(false),
            qkv_bias: bias || family.always_qkv_bias,
            proj_bias: bias,
            dtype,
            rope_scaling: cfg
                .get("rope_scaling")
                .or_else(|| cfg.get("rope_parameters"))
                .filter(|r| r.is_object())
                .cloned(),
            hf_config: Some(cfg.clone()),
        })
    }

    /// The `config.json` to write: the carried original (dtype updated) or one built from the numbers.
    pub fn to_hf(&self) -> Json {
        let dtype = self.dtype.torch_name();
        if let Some(orig) = &self.hf_config {
            let mut cfg = orig.clone();
            if let Some(obj) = cfg.as_object_mut() {
                // transformers 5.x writes "dtype", 4.x "torch_dtype": keep the input's key.
                let key = if obj.contains_key("dtype") {
                    "dtype"
                } else {
                    "torch_dtype"
                };
                obj.insert(key.into(), dtype.into());
            }
            return cfg;
        }
        let mut cfg = json!({
            "architectures": [self.family.architecture],
            "model_type": self.family.model_types[0],
            "hidden_size": self.hidden,
            "intermediate_size": self.ffn,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.groups,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_positions,
            "rms_norm_eps": self.norm_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tied,
            "vocab_size": self.vocab,
            "torch_dtype": dtype,
        });
        if let Some(key) = self.family.bias_key {
            cfg[key] = self.proj_bias.into();
        }
        if let Some(r) = &self.rope_scaling {
            cfg["rope_scaling"] = r.clone();
        }
        cfg
    }

    /// Shape checks that do not depend on the parallel layout.
    pub fn validate(&self) -> Result<()> {
        if self.heads == 0 || self.groups == 0 || !self.heads.is_multiple_of(self.groups) {
            bail!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                self.heads,
                self.groups
            );
        }
        if self.proj_bias && !self.qkv_bias {
            bail!("an attention output bias without q/k/v biases is not a supported layout");
        }
        Ok(())
    }
}

/// Attribute `name` of a Megatron `args` Namespace.
pub(crate) fn arg<'a>(args: &'a [(String, Value)], name: &str) -> Option<&'a Value> {
    args.iter().find(|(k, _)| k == name).map(|(_, v)| v)
}

pub(crate) fn arg_uint(args: &[(String, Value)], name: &str) -> Option<usize> {
    match arg(args, name) {
        Some(Value::Int(i)) if *i >= 0 => Some(*i as usize),
        _ => None,
    }
}

fn arg_bool(args: &[(String, Value)], name: &str) -> Option<bool> {
    match arg(args, name) {
        Some(Value::Bool(b)) => Some(*b),
        _ => None,
    }
}

pub(crate) fn arg_float(args: &[(String, Value)], name: &str) -> Option<f64> {
    match arg(args, name) {
        Some(Value::Float(f)) => Some(*f),
        Some(Value::Int(i)) => Some(*i as f64),
        _ => None,
    }
}

/// RoPE scaling recorded in Megatron args, as config.json's `rope_scaling`: MindSpeed-LLM's
/// `--rope-scaling-type llama3` with `--rope-scaling-factor`, `--low-freq-factor`,
/// `--high-freq-factor`, `--original-max-position-embeddings`; Megatron-LM's
/// `--use-rope-scaling` (Llama 3.1's scaling, only the factor configurable: default 8, low 1,
/// high 4, original 8192, as megatron-core's `RotaryEmbedding._apply_scaling`).
fn rope_scaling_from_args(args: &[(String, Value)]) -> Result<Option<Json>> {
    let kind = match arg(args, "rope_scaling_type") {
        Some(Value::Str(s)) => Some(s.as_str()),
        _ => None,
    };
    let llama3 = |factor: f64, low: f64, high: f64, original: f64| {
        json!({
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": low,
            "high_freq_factor": high,
            "original_max_position_embeddings": original,
        })
    };
    let float_or = |name, default| arg_float(args, name).unwrap_or(default);
    match kind {
        Some("llama3") => Ok(Some(llama3(
            float_or("rope_scaling_factor", 8.0),
            float_or("low_freq_factor", 1.0),
            float_or("high_freq_factor", 4.0),
            float_or("original_max_position_embeddings", 8192.0),
        ))),
        Some(other) => {
            bail!("args: --rope-scaling-type {other} is not supported (supported: llama3, or none)")
        }
        None if arg_bool(args, "use_rope_scaling").unwrap_or(false) => Ok(Some(llama3(
            float_or("rope_scaling_factor", 8.0),
            1.0,
            4.0,
            8192.0,
        ))),
        None => Ok(None),
    }
}

/// The args attribute mindkit stores the original `config.json` in (a JSON string).
pub const HF_CONFIG_ARG: &str = "mindkit_hf_config";

impl ModelConfig {
    /// Read Megatron `args` (as Megatron and MindSpeed write them). `padded_rows` is the
    /// embedding's total rows, used when args do not record the true vocabulary.
    pub fn from_megatron_args(
        args: &[(String, Value)],
        family: Option<&'static Family>,
        dtype: DType,
        padded_rows: usize,
    ) -> Result<Self> {
        let carried = match arg(args, HF_CONFIG_ARG) {
            Some(Value::Str(s)) => Some(serde_json::from_str::<Json>(s)?),
            _ => None,
        };
        if let Some(hf) = &carried {
            let mut cfg = ModelConfig::from_hf(hf, family)?;
            cfg.dtype = dtype;
            return Ok(cfg);
        }
        let need = |n: &str| {
            arg_uint(args, n).ok_or_else(|| anyhow!("checkpoint args: missing or non-integer {n}"))
        };
        let hidden = need("hidden_size")?;
        let heads = need("num_attention_heads")?;
        let gqa = arg_bool(args, "group_query_attention").unwrap_or(false);
        let groups = if gqa {
            need("num_query_groups")?
        } else {
            heads
        };
        // MindSpeed-LLM's --add-dense-bias gives the attention output a bias alone (InternLM).
        // Megatron's add_bias_linear gives every linear layer one; the MLP biases that implies
        // are then reported as tensors no supported family has.
        let add_bias = arg_bool(args, "add_dense_bias").unwrap_or(false)
            || arg_bool(args, "add_bias_linear").unwrap_or(false);
        let qkv_bias = arg_bool(args, "add_qkv_bias").unwrap_or(false) || add_bias;
        let family = match family {
            Some(f) => f,
            None if qkv_bias && !add_bias => family::by_name("qwen2").map_err(|e| anyhow!(e))?,
            None => family::by_name("llama").map_err(|e| anyhow!(e))?,
        };
        Ok(ModelConfig {
            family,
            layers: need("num_layers")?,
            hidden,
            heads,
            groups,
            head_dim: arg_uint(args, "kv_channels").unwrap_or(hidden / heads.max(1)),
            ffn: need("ffn_hidden_size")?,
            vocab: arg_uint(args, "vocab_size").unwrap_or(padded_rows),
            max_positions: arg_uint(args, "max_position_embeddings").unwrap_or(4096),
            rope_theta: arg_float(args, "rotary_base").unwrap_or(10000.0),
            norm_eps: arg_float(args, "norm_epsilon").unwrap_or(1e-5),
            tied: !arg_bool(args, "untie_embeddings_and_output_weights").unwrap_or(false),
            qkv_bias,
            proj_bias: add_bias,
            dtype,
            rope_scaling: rope_scaling_from_args(args)?,
            hf_config: None,
        })
    }
}

/// What the parallel layout contributes to `args`.
pub struct ParallelArgs {
    /// TP size.
    pub tp: usize,
    /// PP size.
    pub pp: usize,
    /// Virtual chunks per stage (1 = none).
    pub vpp: usize,
    /// Layers of the first / last stage when uneven.
    pub first_last: Option<(usize, usize)>,
    /// Padded vocabulary rows.
    pub padded_vocab: usize,
    /// `--make-vocab-size-divisible-by`.
    pub divisible_by: usize,
}

/// The `args` Namespace Megatron's loaders and `check_checkpoint_args` read (ckpt.md §1.4, §8),
/// starting from `base` (a source checkpoint's args) when converting Megatron → Megatron.
pub fn megatron_args(
    cfg: &ModelConfig,
    par: &ParallelArgs,
    base: &[(String, Value)],
) -> Vec<(String, Value)> {
    let int = |v: usize| Value::Int(v as i64);
    let gqa = cfg.groups != cfg.heads;
    let rope_scaling = cfg.rope_scaling.as_ref();
    let scaling_type = rope_scaling
        .and_then(|r| r.get("rope_type").or_else(|| r.get("type")))
        .and_then(Json::as_str);
    let scaling_factor = rope_scaling
        .and_then(|r| r.get("factor"))
        .and_then(Json::as_f64);
    let mut set: Vec<(&str, Value)> = vec![
        ("num_layers", int(cfg.layers)),
        ("hidden_size", int(cfg.hidden)),
        ("ffn_hidden_size", int(cfg.ffn)),
        ("num_attention_heads", int(cfg.heads)),
        ("group_query_attention", Value::Bool(gqa)),
        ("num_query_groups", int(cfg.groups)),
        ("kv_channels", int(cfg.head_dim)),
        ("seq_length", int(cfg.max_positions)),
        ("max_position_embeddings", int(cfg.max_positions)),
        ("position_embedding_type", Value::Str("rope".into())),
        ("add_position_embedding", Value::Bool(false)),
        ("use_rotary_position_embeddings", Value::Bool(true)),
        ("rotary_base", Value::Float(cfg.rope_theta)),
        ("rotary_percent", Value::Float(1.0)),
        ("rotary_interleaved", Value::Bool(false)),
        (
            "use_rope_scaling",
            Value::Bool(matches!(scaling_type, Some("llama3"))),
        ),
        (
            "rope_scaling_factor",
            scaling_factor.map_or(Value::None, Value::Float),
        ),
        ("normalization", Value::Str("RMSNorm".into())),
        ("norm_epsilon", Value::Float(cfg.norm_eps)),
        ("swiglu", Value::Bool(true)),
        ("add_bias_linear", Value::Bool(false)),
        ("add_dense_bias", Value::Bool(cfg.proj_bias)),
        ("add_qkv_bias", Value::Bool(cfg.qkv_bias)),
        (
            "untie_embeddings_and_output_weights",
            Value::Bool(!cfg.tied),
        ),
        ("tensor_model_parallel_size", int(par.tp)),
        ("pipeline_model_parallel_size", int(par.pp)),
        (
            "virtual_pipeline_model_parallel_size",
            if par.vpp > 1 {
                int(par.vpp)
            } else {
                Value::None
            },
        ),
        // Megatron takes the chunk size for even stages and the chunk count for uneven ones
        // (it refuses both set at once).
        (
            "num_layers_per_virtual_pipeline_stage",
            if par.vpp > 1 && par.first_last.is_none() {
                int(cfg.layers / par.pp / par.vpp)
            } else {
                Value::None
            },
        ),
        (
            "num_virtual_stages_per_pipeline_rank",
            if par.vpp > 1 && par.first_last.is_some() {
                int(par.vpp)
            } else {
                Value::None
            },
        ),
        (
            "decoder_first_pipeline_num_layers",
            par.first_last.map_or(Value::None, |(f, _)| int(f)),
        ),
        (
            "decoder_last_pipeline_num_layers",
            par.first_last.map_or(Value::None, |(_, l)| int(l)),
        ),
        ("expert_model_parallel_size", int(1)),
        ("make_vocab_size_divisible_by", int(par.divisible_by)),
        ("padded_vocab_size", int(par.padded_vocab)),
        ("vocab_size", int(cfg.vocab)),
        ("fp16", Value::Bool(cfg.dtype == DType::F16)),
        ("bf16", Value::Bool(cfg.dtype == DType::BF16)),
        ("params_dtype", Value::TorchDType(cfg.dtype)),
        ("iteration", int(1)),
        ("consumed_train_samples", int(0)),
        ("consumed_valid_samples", int(0)),
        ("sequence_parallel", Value::Bool(false)),
        ("apply_query_key_layer_scaling", Value::Bool(false)),
        ("bert_binary_head", Value::Bool(false)),
        ("ckpt_format", Value::Str("torch".into())),
        ("model_type", Value::Str("GPT".into())),
    ];
    if base.is_empty() {
        set.push(("tokenizer_type", Value::Str("HuggingFaceTokenizer".into())));
        set.push(("tokenizer_model", Value::None));
    }
    if let Some(hf) = &cfg.hf_config {
        set.push((HF_CONFIG_ARG, Value::Str(hf.to_string())));
    }
    // What mindkit writes never holds LoRA modules: a source's lora_* settings would be stale.
    let mut out: Vec<(String, Value)> = base
        .iter()
        .filter(|(k, _)| !k.starts_with("lora_"))
        .cloned()
        .collect();
    for (k, v) in set {
        match out.iter_mut().find(|(name, _)| name == k) {
            Some(slot) => slot.1 = v,
            None => out.push((k.to_string(), v)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(extra: &[(&str, Value)]) -> Vec<(String, Value)> {
        let mut a: Vec<(String, Value)> = [
            ("num_layers", Value::Int(2)),
            ("hidden_size", Value::Int(64)),
            ("num_attention_heads", Value::Int(4)),
            ("ffn_hidden_size", Value::Int(128)),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        a.extend(extra.iter().map(|(k, v)| (k.to_string(), v.clone())));
        a
    }

    fn scaling(extra: &[(&str, Value)]) -> Result<Option<Json>> {
        ModelConfig::from_megatron_args(&args(extra), None, DType::F32, 256).map(|c| c.rope_scaling)
    }

    #[test]
    fn rope_scaling_is_read_from_megatron_and_mindspeed_args() {
        assert_eq!(scaling(&[]).unwrap(), None);
        assert_eq!(
            scaling(&[("rope_scaling_factor", Value::Float(8.0))]).unwrap(),
            None,
            "Megatron-LM records a factor even when scaling is off"
        );
        let megatron = scaling(&[
            ("use_rope_scaling", Value::Bool(true)),
            ("rope_scaling_factor", Value::Float(32.0)),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(
            megatron,
            json!({"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192.0})
        );
        let mindspeed = scaling(&[
            ("rope_scaling_type", Value::Str("llama3".into())),
            ("rope_scaling_factor", Value::Float(8.0)),
            ("low_freq_factor", Value::Float(2.0)),
            ("high_freq_factor", Value::Float(4.0)),
            ("original_max_position_embeddings", Value::Float(4096.0)),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(mindspeed["low_freq_factor"], json!(2.0));
        assert_eq!(mindspeed["original_max_position_embeddings"], json!(4096.0));
        let err = scaling(&[("rope_scaling_type", Value::Str("yarn".into()))]).unwrap_err();
        assert!(err.to_string().contains("yarn"), "{err}");
    }

    #[test]
    fn a_config_built_from_args_writes_its_rope_scaling() {
        let cfg = ModelConfig::from_megatron_args(
            &args(&[("use_rope_scaling", Value::Bool(true))]),
            None,
            DType::F32,
            256,
        )
        .unwrap();
        assert_eq!(cfg.to_hf()["rope_scaling"]["rope_type"], json!("llama3"));
    }
}
