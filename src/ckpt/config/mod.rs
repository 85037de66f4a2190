//! The architecture of a LLaMA-family model, read from HF `config.json` (transformers 4.x
//! `rope_theta`/`rope_scaling` and 5.x `rope_parameters` conventions) or from Megatron `args`,
//! and written back to either.

mod longrope;
mod mla;
mod moe;

use super::layout::Parallel;
use super::torch::pickle::Value;
use crate::arch::family::{self, Family, OutBias, QkNorm};
use crate::arch::moe::Moe;
use crate::arch::{Activation, Mla, ModelConfig, Mtp, MtpLayout};
use crate::tensor::DType;
use anyhow::{anyhow, bail, Context, Result};
use serde_json::{json, Value as Json};

/// A configuration field that cannot be used. Fields are named as the source spells them
/// (`rope_theta` in config.json, `args.rotary_base` in a Megatron checkpoint); the caller adds
/// the file.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A required field is absent.
    #[error("missing \"{field}\"")]
    Missing {
        /// The field.
        field: String,
    },
    /// A field of the wrong type (never replaced by a default).
    #[error("\"{field}\" must be {expected}, got {got}")]
    WrongType {
        /// The field.
        field: String,
        /// What it must be.
        expected: &'static str,
        /// What it is.
        got: String,
    },
    /// A number outside the range a model can use.
    #[error("\"{field}\" is {got}; it must be {expected}")]
    OutOfRange {
        /// The field.
        field: String,
        /// Its value.
        got: String,
        /// The range.
        expected: &'static str,
    },
    /// A count beyond any model's, refused before sizes computed from it could overflow or
    /// exhaust memory.
    #[error("\"{field}\" is {got}; mindkit reads at most {max}, more than any model has")]
    TooLarge {
        /// The field.
        field: String,
        /// Its value.
        got: u64,
        /// The bound.
        max: usize,
    },
    /// Query heads that do not split evenly over the key/value heads.
    #[error(
        "num_attention_heads ({heads}) must be a multiple of {groups_field} ({groups}): each \
         key/value head serves an equal group of query heads"
    )]
    UnevenGroups {
        /// Query heads.
        heads: usize,
        /// Key/value heads.
        groups: usize,
        /// Their field (`num_key_value_heads`, `args.num_query_groups`).
        groups_field: &'static str,
    },
}

type FieldResult<T> = std::result::Result<T, ConfigError>;

/// How a JSON value reads in an error: `the string "500000"`, `2.5`, `an array`.
fn describe_json(v: &Json) -> String {
    match v {
        Json::String(s) => format!("the string {s:?}"),
        Json::Array(_) => "an array".into(),
        Json::Object(_) => "an object".into(),
        other => other.to_string(),
    }
}

/// A field of config.json (`None` when absent or null), read by `read` or refused by type.
fn json_field<'a, T>(
    cfg: &'a Json,
    field: &str,
    expected: &'static str,
    read: impl Fn(&'a Json) -> Option<T>,
) -> FieldResult<Option<T>> {
    match cfg.get(field) {
        None | Some(Json::Null) => Ok(None),
        Some(v) => read(v).map(Some).ok_or_else(|| ConfigError::WrongType {
            field: field.into(),
            expected,
            got: describe_json(v),
        }),
    }
}

/// A count (`num_hidden_layers`, …): an integer from 1 to its [`count_limit`].
fn json_count(cfg: &Json, field: &str) -> FieldResult<Option<usize>> {
    let n = json_field(cfg, field, "a positive integer", |v| v.as_u64())?;
    n.map(|n| check_count(field, n)).transpose()
}

fn json_required_count(cfg: &Json, field: &str) -> FieldResult<usize> {
    json_count(cfg, field)?.ok_or_else(|| ConfigError::Missing {
        field: field.into(),
    })
}

fn json_positive(cfg: &Json, field: &str) -> FieldResult<Option<f64>> {
    let x = json_field(cfg, field, "a number", Json::as_f64)?;
    x.map(|x| positive(field, x)).transpose()
}

fn json_bool(cfg: &Json, field: &str) -> FieldResult<Option<bool>> {
    json_field(cfg, field, "true or false", Json::as_bool)
}

fn json_str<'a>(cfg: &'a Json, field: &str) -> FieldResult<Option<&'a str>> {
    json_field(cfg, field, "a string", Json::as_str)
}

/// The largest value a count field may take, by its name in config.json or Megatron args:
/// far above any model's, and low enough that the sizes computed from them (the rows and
/// columns of a fused QKV, a layer list, an embedding) stay far from overflowing.
fn count_limit(field: &str) -> usize {
    match field.strip_prefix("args.").unwrap_or(field) {
        "num_hidden_layers" | "num_layers" => 1 << 16,
        "num_attention_heads" | "num_key_value_heads" | "num_query_groups" => 1 << 16,
        "hidden_size" | "intermediate_size" | "ffn_hidden_size" | "head_dim" | "kv_channels" => {
            1 << 20
        }
        "vocab_size" => 1 << 24,
        _ => 1 << 31,
    }
}

/// A count: at least 1, at most its [`count_limit`].
fn check_count(field: &str, n: u64) -> FieldResult<usize> {
    if n == 0 {
        return Err(ConfigError::OutOfRange {
            field: field.into(),
            got: "0".into(),
            expected: "at least 1",
        });
    }
    let max = count_limit(field);
    if n > max as u64 {
        return Err(ConfigError::TooLarge {
            field: field.into(),
            got: n,
            max,
        });
    }
    Ok(n as usize)
}

/// RoPE bases, norm epsilons, scaling factors, LoRA alphas: finite and above zero (anything
/// else turns every logit into NaN).
pub(crate) fn positive(field: &str, x: f64) -> FieldResult<f64> {
    if !(x.is_finite() && x > 0.0) {
        return Err(ConfigError::OutOfRange {
            field: field.into(),
            got: show_number(x),
            expected: "a finite number above 0",
        });
    }
    Ok(x)
}

/// A float as errors show it: plainly, or in exponent form when very large or small.
pub(crate) fn show_number(x: f64) -> String {
    if x.is_finite() && x != 0.0 && !(1e-4..1e15).contains(&x.abs()) {
        format!("{x:e}")
    } else {
        x.to_string()
    }
}

fn check_groups(heads: usize, groups: usize, groups_field: &'static str) -> FieldResult<()> {
    if !heads.is_multiple_of(groups) {
        return Err(ConfigError::UnevenGroups {
            heads,
            groups,
            groups_field,
        });
    }
    Ok(())
}

/// The numbers of a `rope_scaling` (or 5.x `rope_parameters`) object that the engine and the
/// Megatron args use, checked: `factor` above 0; for llama3 also the frequency factors (high
/// above low, as `_compute_llama3_parameters` divides by their difference) and the original
/// context. Types mindkit does not apply are carried unchecked beyond their `factor`.
fn check_rope_scaling(r: &Json, field: &str) -> FieldResult<()> {
    let name = |key: &str| format!("{field}.{key}");
    let number = |key: &str| json_positive(r, key).map_err(|e| rename(e, &name(key)));
    let kind = match json_str(r, "rope_type").map_err(|e| rename(e, &name("rope_type")))? {
        Some(kind) => Some(kind),
        None => json_str(r, "type").map_err(|e| rename(e, &name("type")))?,
    };
    let factor = number("factor")?;
    match kind {
        Some("linear" | "llama3") if factor.is_none() => {
            return Err(ConfigError::Missing {
                field: name("factor"),
            })
        }
        Some("llama3") => {
            let low = number("low_freq_factor")?.unwrap_or(1.0);
            let high = number("high_freq_factor")?.unwrap_or(4.0);
            number("original_max_position_embeddings")?;
            check_freq_factors(low, high, &name("high_freq_factor"))?;
        }
        _ => {}
    }
    Ok(())
}

/// Llama 3.1's scaling interpolates between the two wavelengths the factors give: `high` must
/// lie above `low`.
fn check_freq_factors(low: f64, high: f64, high_field: &str) -> FieldResult<()> {
    if high <= low {
        return Err(ConfigError::OutOfRange {
            field: high_field.into(),
            got: show_number(high),
            expected: "above low_freq_factor",
        });
    }
    Ok(())
}

/// `e` naming `field` (a key inside a nested object) instead of the key alone.
fn rename(e: ConfigError, field: &str) -> ConfigError {
    match e {
        ConfigError::Missing { .. } => ConfigError::Missing {
            field: field.into(),
        },
        ConfigError::WrongType { expected, got, .. } => ConfigError::WrongType {
            field: field.into(),
            expected,
            got,
        },
        ConfigError::OutOfRange { got, expected, .. } => ConfigError::OutOfRange {
            field: field.into(),
            got,
            expected,
        },
        other => other,
    }
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
    /// Read `config.json`; `family` overrides the `model_type` detection. A field of the
    /// wrong type or out of range is an error naming it (the caller names the file); an absent
    /// or null optional field takes transformers' default.
    pub fn from_hf(cfg: &Json, family: Option<&'static Family>) -> Result<Self> {
        if !cfg.is_object() {
            bail!("not a JSON object");
        }
        let family = match family {
            Some(f) => f,
            None => {
                let mt = json_str(cfg, "model_type")?
                    .ok_or_else(|| anyhow!("no \"model_type\" (pass --family)"))?;
                family::by_model_type(mt)?
            }
        };
        let hidden = json_required_count(cfg, "hidden_size")?;
        let heads = json_required_count(cfg, "num_attention_heads")?;
        let groups = json_count(cfg, "num_key_value_heads")?.unwrap_or(heads);
        check_groups(heads, groups, "num_key_value_heads")?;
        let rope_parameters = json_field(cfg, "rope_parameters", "an object", |v| {
            v.as_object().map(|_| v)
        })?;
        let rope_scaling = json_field(cfg, "rope_scaling", "an object", |v| {
            v.as_object().map(|_| v)
        })?;
        let rope_theta = match json_positive(cfg, "rope_theta")? {
            Some(theta) => Some(theta),
            None => rope_parameters
                .map(|p| json_positive(p, "rope_theta"))
                .transpose()
                .map_err(|e| rename(e, "rope_parameters.rope_theta"))?
                .flatten(),
        };
        let rope_scaling = match (rope_scaling, rope_parameters) {
            (Some(r), _) => Some((r, "rope_scaling")),
            (None, Some(p)) => Some((p, "rope_parameters")),
            (None, None) => None,
        };
        if let Some((r, field)) = rope_scaling {
            check_rope_scaling(r, field)?;
        }
        let bias = match family.bias_key {
            Some(k) => json_bool(cfg, k)?.unwrap_or(family.bias_default),
            None => false,
        };
        let out_bias = match family.out_bias {
            OutBias::Key(k) => json_bool(cfg, k)?.unwrap_or(false),
            OutBias::WithQkv => bias,
            OutBias::Never => false,
        };
        let dtype = match json_str(cfg, "torch_dtype")? {
            Some(d) => Some(d),
            None => json_str(cfg, "dtype")?,
        };
        let dtype = dtype.map(parse_dtype).transpose()?.unwrap_or(DType::F32);
        // a paired family's files count its layers of two decoder layers each
        let layers = match family.paired {
            true => family.sublayers() * json_required_count(cfg, "num_layers")?,
            false => json_required_count(cfg, "num_hidden_layers")?,
        };
        let head_dim = json_count(cfg, "head_dim")?.unwrap_or(hidden / heads);
        let rotary_dim = match json_positive(cfg, "partial_rotary_factor")? {
            Some(f) if f != 1.0 && !family.partial_rotary => {
                return Err(ConfigError::OutOfRange {
                    field: "partial_rotary_factor".into(),
                    got: f.to_string(),
                    expected: "1: the family's attention rotates whole heads",
                }
                .into());
            }
            // transformers' rope init: dim = int(head_dim · partial_rotary_factor)
            Some(f) => (head_dim as f64 * f) as usize,
            None => head_dim,
        };
        let qk_norm = match family.qk_norm {
            QkNorm::No => false,
            QkNorm::Yes => true,
            QkNorm::Key(k) => json_bool(cfg, k)?.unwrap_or(false),
        };
        let mla = mla::mla_from_hf(cfg, family)?;
        if mla.is_some() && bias {
            bail!(
                "attention_bias: multi-latent attention with biases is not supported (no \
                 DeepSeek model has them)"
            );
        }
        // multi-latent attention: every head its own key and value, the rotated part last
        let (groups, head_dim, rotary_dim) = match &mla {
            Some(m) => (heads, m.q_head_dim(), m.rope_dim),
            None => (groups, head_dim, rotary_dim),
        };
        Ok(ModelConfig {
            family,
            layers,
            paired: family.paired,
            hidden,
            heads,
            groups,
            head_dim,
            rotary_dim,
            // every family mindkit reads from config.json has SwiGLU MLPs (`hidden_act: silu`)
            activation: Activation::SwiGlu,
            ffn: json_required_count(
                cfg,
                match family.paired {
                    true => "ffn_hidden_size",
                    false => "intermediate_size",
                },
            )?,
            vocab: json_required_count(cfg, "vocab_size")?,
            max_positions: json_count(cfg, "max_position_embeddings")?.unwrap_or(4096),
            rope_theta: rope_theta.unwrap_or(10000.0),
            norm_eps: json_positive(cfg, "rms_norm_eps")?.unwrap_or(1e-6),
            latent_norm_eps: mla.map(|_| 1e-6),
            tied: json_bool(cfg, "tie_word_embeddings")?.unwrap_or(false),
            qkv_bias: bias || family.always_qkv_bias,
            proj_bias: out_bias,
            layer_norm: family.layer_norm,
            output_bias: match family.lm_head_bias {
                Some(key) => json_bool(cfg, key)?.unwrap_or(false),
                None => false,
            },
            qk_norm,
            qk_norm_per_layer: false,
            mla,
            moe: match moe::moe_from_hf(cfg, family, layers / family.sublayers())? {
                Some(m) if family.paired => Some(m.paired()),
                moe => moe,
            },
            mtp: mtp_of(json_count(cfg, "num_nextn_predict_layers")?),
            dtype,
            // a transformers model's weights share one dtype
            norms_f32: false,
            rope_scaling: rope_scaling.map(|(r, _)| r.clone()),
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
        match (self.family.bias_key, self.family.out_bias) {
            (Some(key), OutBias::Key(out)) => {
                cfg[key] = self.qkv_bias.into();
                cfg[out] = self.proj_bias.into();
            }
            (Some(key), OutBias::WithQkv) => cfg[key] = self.proj_bias.into(),
            (Some(key), OutBias::Never) => cfg[key] = self.qkv_bias.into(),
            _ => {}
        }
        if let QkNorm::Key(key) = self.family.qk_norm {
            cfg[key] = self.qk_norm.into();
        }
        if let Some(key) = self.family.lm_head_bias {
            cfg[key] = self.output_bias.into();
        }
        if self.family.partial_rotary {
            cfg["partial_rotary_factor"] = (self.rotary_dim as f64 / self.head_dim as f64).into();
        }
        if let Some(r) = &self.rope_scaling {
            cfg["rope_scaling"] = r.clone();
        }
        if let Some(m) = &self.moe {
            moe::moe_to_hf(m, self.family, &mut cfg);
        }
        if self.paired {
            // LongcatFlashConfig's names (its num_hidden_layers counts the decoder layers)
            let obj = cfg.as_object_mut().expect("an object");
            obj.remove("intermediate_size");
            obj.insert("ffn_hidden_size".into(), self.ffn.into());
            obj.insert("num_layers".into(), self.stored_layers().into());
            obj.insert("mla_scale_q_lora".into(), true.into());
            obj.insert("mla_scale_kv_lora".into(), true.into());
        }
        mla::mla_to_hf(self, &mut cfg);
        if let Some(m) = &self.mtp {
            cfg["num_nextn_predict_layers"] = m.depths.into();
        }
        cfg
    }

    /// Whether the family's `config.json` and tensor names can hold this model (a mixture of
    /// experts read from Megatron args may route or share experts in a way the family cannot
    /// say).
    pub fn check_hf(&self) -> Result<()> {
        if self.paired != self.family.paired {
            bail!(
                "cannot write this model in Hugging Face format as {}: {}",
                self.family.name,
                match self.paired {
                    true => "its layers are LongCat-Flash's pairs (pass --family longcat_flash)",
                    false => "the family's layers are LongCat-Flash's pairs, this model's not",
                }
            );
        }
        let scaled = self.mla.map(|m| m.latent_scales(self.hidden));
        if self.paired && scaled.is_some_and(|s| s.contains(&None)) {
            bail!(
                "cannot write this model in Hugging Face format as {}: the family's multi-latent \
                 attention has a query latent and scales both latents (--q-lora-rank, \
                 --enable-mla-scale-q-lora, --enable-mla-scale-kv-lora)",
                self.family.name
            );
        }
        if self.layer_norm != self.family.layer_norm {
            bail!(
                "cannot write this model in Hugging Face format as {}: its norms are {}, the \
                 family's {}",
                self.family.name,
                norm_name(self.layer_norm),
                norm_name(self.family.layer_norm)
            );
        }
        if self.activation != Activation::SwiGlu {
            bail!(
                "cannot write this model in Hugging Face format as {}: its MLP is {} (not \
                 gated), which no family of transformers 4.57 mindkit writes builds (PLM's \
                 modeling is remote code); keep it in Megatron format",
                self.family.name,
                self.activation.flag()
            );
        }
        if self.output_bias && self.family.lm_head_bias.is_none() {
            bail!(
                "cannot write this model in Hugging Face format as {}: its output layer has a \
                 bias, which the family's lm_head has not",
                self.family.name
            );
        }
        if self.qk_norm_per_layer {
            bail!(
                "cannot write this model in Hugging Face format as {}: its q/k norms span all \
                 heads (MindSpeed-LLM's MiniMax spec), which no family of transformers 4.57 \
                 builds (MiniMax-M2's minimax_m2 came later); keep it in Megatron format",
                self.family.name
            );
        }
        if self.family.mla != self.mla.is_some() {
            bail!(
                "cannot write this model in Hugging Face format as {}: its attention is {}",
                self.family.name,
                match self.mla {
                    Some(_) => "multi-latent attention, the family's grouped-query",
                    None => "grouped-query attention, the family's multi-latent",
                }
            );
        }
        // MindSpeed-LLM's training LongRoPE records how it divides (`freqs_type`);
        // transformers' (Phi-3.5-MoE's config.json) does not
        let mindspeed_longrope = self
            .rope_scaling
            .as_ref()
            .is_some_and(|r| self.rope_type() == Some("longrope") && r.get("freqs_type").is_some());
        if mindspeed_longrope {
            bail!(
                "cannot write this model in Hugging Face format as {}: its LongRoPE is \
                 MindSpeed-LLM's training one (factors chosen by --seq-length), which no family of \
                 the ones built says the same way; keep it in Megatron format",
                self.family.name
            );
        }
        if self.mla.is_some_and(|m| m.dsa.is_some()) {
            bail!(
                "cannot write this model in Hugging Face format as {}: its DeepSeek sparse \
                 attention's indexer (DeepSeek-V3.2, GLM-5) is not built in Hugging Face format \
                 yet; keep it in Megatron format",
                self.family.name
            );
        }
        if !self.paired && self.mla.is_some_and(|m| m.scale_latents.contains(&true)) {
            bail!(
                "cannot write this model in Hugging Face format as {}: its multi-latent attention \
                 scales the normed latents (--enable-mla-scale-q-lora / --enable-mla-scale-kv-lora), \
                 which the family does not",
                self.family.name
            );
        }
        let rotates_part = self.rotary_dim != self.head_dim && self.mla.is_none();
        if rotates_part && !self.family.partial_rotary {
            bail!(
                "cannot write this model in Hugging Face format as {}: its attention rotates \
                 whole heads; this model rotates {} of {} dimensions (rotary_percent)",
                self.family.name,
                self.rotary_dim,
                self.head_dim
            );
        }
        if let Some(why) = self
            .moe
            .as_ref()
            .and_then(|m| moe::hf_limits(m, self.family))
        {
            bail!(
                "cannot write this model in Hugging Face format as {}: {why}",
                self.family.name
            );
        }
        Ok(())
    }

    /// Layout checks that do not depend on the parallel layout (the numbers were checked
    /// when the configuration was read).
    pub fn validate(&self) -> Result<()> {
        if self.proj_bias && !self.qkv_bias {
            bail!("an attention output bias without q/k/v biases is not a supported layout");
        }

        self.check_hf()
    }
}

/// How a model's norms read in an error.
fn norm_name(layer_norm: bool) -> &'static str {
    match layer_norm {
        true => "LayerNorms",
        false => "RMSNorms",
    }
}

/// Attribute `name` of a Megatron `args` Namespace.
pub(crate) fn arg<'a>(args: &'a [(String, Value)], name: &str) -> Option<&'a Value> {
    args.iter().find(|(k, _)| k == name).map(|(_, v)| v)
}

/// How a pickled value reads in an error.
fn describe_value(v: &Value) -> String {
    match v {
        Value::Str(s) => format!("the string {s:?}"),
        Value::Int(i) => i.to_string(),
        Value::Float(f) => show_number(*f),
        Value::Bool(b) => if *b { "True" } else { "False" }.into(),
        Value::List(_) => "a list".into(),
        Value::Tuple(_) => "a tuple".into(),
        Value::Dict(_) => "a dict".into(),
        other => format!("a {}", value_kind(other)),
    }
}

fn value_kind(v: &Value) -> &'static str {
    match v {
        Value::Bytes(_) => "bytes object",
        Value::Namespace(_) => "Namespace",
        Value::TorchDType(_) => "torch dtype",
        Value::Tensor(_) => "tensor",
        _ => "Python object",
    }
}

/// Attribute `name` of `args` (`None` when absent or `None`), read by `read` or refused by type.
fn arg_field<'a, T>(
    args: &'a [(String, Value)],
    name: &str,
    expected: &'static str,
    read: impl Fn(&'a Value) -> Option<T>,
) -> FieldResult<Option<T>> {
    match arg(args, name) {
        None | Some(Value::None) => Ok(None),
        Some(v) => read(v).map(Some).ok_or_else(|| ConfigError::WrongType {
            field: format!("args.{name}"),
            expected,
            got: describe_value(v),
        }),
    }
}

pub(crate) fn arg_uint(args: &[(String, Value)], name: &str) -> FieldResult<Option<usize>> {
    arg_field(args, name, "a non-negative integer", |v| match v {
        Value::Int(i) => usize::try_from(*i).ok(),
        _ => None,
    })
}

/// A count (`num_layers`, …): an integer from 1 to its [`count_limit`].
fn arg_count(args: &[(String, Value)], name: &str) -> FieldResult<Option<usize>> {
    let n = arg_uint(args, name)?;
    n.map(|n| check_count(&format!("args.{name}"), n as u64))
        .transpose()
}

/// The `config.json` MindSpeed-LLM's convert_ckpt_v2.py copies into the args it saves
/// (its Hf2MgConvert puts every field of the HF config on its args Namespace beside its own
/// `model_type_hf`), when `args.model_type` names a family: every scalar and list of strings.
fn converter_config(args: &[(String, Value)]) -> Option<Json> {
    let is_str = |name| matches!(arg(args, name), Some(Value::Str(_)));
    let Some(Value::Str(model_type)) = arg(args, "model_type") else {
        return None;
    };
    if !is_str("model_type_hf") || family::by_model_type(model_type).is_err() {
        return None;
    }
    let json = |v: &Value| match v {
        Value::None => Some(Json::Null),
        Value::Bool(b) => Some((*b).into()),
        Value::Int(i) => Some((*i).into()),
        Value::Float(f) => serde_json::Number::from_f64(*f).map(Json::Number),
        Value::Str(s) => Some(s.as_str().into()),
        Value::List(l) => (l.iter())
            .map(|v| match v {
                Value::Str(s) => Some(Json::from(s.as_str())),
                _ => None,
            })
            .collect::<Option<Vec<_>>>()
            .map(Json::Array),
        _ => None,
    };
    let fields = args.iter().filter_map(|(k, v)| Some((k.clone(), json(v)?)));
    Some(Json::Object(fields.collect()))
}

/// A count where 0 means none (MindSpeed-LLM's converters write `mtp_num_layers = 0`).
fn arg_count_or_none(args: &[(String, Value)], name: &str) -> FieldResult<Option<usize>> {
    match arg_uint(args, name)? {
        None | Some(0) => Ok(None),
        Some(n) => check_count(&format!("args.{name}"), n as u64).map(Some),
    }
}

/// MindSpeed-LLM's MiniMax layer spec (`--spec MODULE FUNCTION`, saved as `args.spec`): its
/// attention's q/k norms span all heads ([`ModelConfig::qk_norm_per_layer`]).
pub const MINIMAX_SPEC: [&str; 2] = ["mindspeed_llm.tasks.models.spec.minimax_spec", "layer_spec"];

/// MindSpeed-LLM's DeepSeek layer spec: multi-latent attention with its down projections in
/// one replicated `linear_qkv` ([`crate::arch::Mla::fused_down`]).
pub const DEEPSEEK_SPEC: [&str; 2] = [
    "mindspeed_llm.tasks.models.spec.deepseek_spec",
    "layer_spec",
];

/// MindSpeed-LLM's PLM layer spec (mindspeed_llm/tasks/models/spec/plm_spec.py): the DeepSeek
/// spec's multi-latent attention ([`DEEPSEEK_SPEC`], down projections fused) with its
/// key-value latent always normed (`kv_layernorm` a PTNorm whatever `--qk-layernorm` says), no
/// query latent, and a dense MLP. Written back as the DeepSeek spec with `qk_layernorm`: the
/// same tensors.
pub const PLM_SPEC: [&str; 2] = ["mindspeed_llm.tasks.models.spec.plm_spec", "layer_spec"];

/// MindSpeed-LLM's LongCat-Flash layer spec: each layer two sublayers of multi-latent
/// attention (its down projections fused as [`DEEPSEEK_SPEC`]'s) and a dense MLP, with a
/// shortcut mixture of experts ([`ModelConfig::paired`]).
pub const LONGCAT_SPEC: [&str; 2] = ["mindspeed_llm.tasks.models.spec.longcat_spec", "layer_spec"];

/// Whether Megatron args describe MindSpeed-LLM's LongCat-Flash layer: its spec (as training
/// saves it), or its converter's `transformerlayer_type` (configs/checkpoint/model_cfg.json
/// `longcat`, as convert_ckpt_v2.py saves it).
pub(super) fn longcat_of(args: &[(String, Value)]) -> FieldResult<bool> {
    Ok(spec_is(args, LONGCAT_SPEC) || arg_str(args, "transformerlayer_type")? == Some("longcat"))
}

/// Whether `args.spec` is `spec`.
fn spec_is(args: &[(String, Value)], spec: [&str; 2]) -> bool {
    matches!(arg(args, "spec"), Some(Value::List(s))
        if s.len() == 2 && s.iter().zip(spec).all(|(v, m)| matches!(v, Value::Str(v) if v == m)))
}

/// `args.spec` for a model whose layer spec it records (MindSpeed-LLM's MiniMax and DeepSeek
/// specs), else `None`.
pub fn spec_arg(cfg: &ModelConfig) -> Option<Value> {
    let spec = match cfg.mla {
        _ if cfg.paired => LONGCAT_SPEC,
        Some(m) if m.fused_down => DEEPSEEK_SPEC,
        _ if cfg.qk_norm_per_layer => MINIMAX_SPEC,
        _ => return None,
    };
    Some(Value::List(spec.map(|s| Value::Str(s.into())).into()))
}

/// Whether Megatron args record MindSpeed's DualPipeV schedule (`schedules_method`
/// `dualpipev`, its only one), which lays the chunks out in a V
/// ([`crate::ckpt::layout::Parallel::dualpipev`]).
pub fn dualpipev_of(args: &[(String, Value)]) -> FieldResult<bool> {
    match arg_str(args, "schedules_method")? {
        None => Ok(false),
        Some("dualpipev") => Ok(true),
        Some(other) => Err(ConfigError::OutOfRange {
            field: "args.schedules_method".into(),
            got: other.into(),
            expected: "dualpipev or None",
        }),
    }
}

fn arg_str<'a>(args: &'a [(String, Value)], name: &str) -> FieldResult<Option<&'a str>> {
    arg_field(args, name, "a string", |v| match v {
        Value::Str(s) => Some(s.as_str()),
        _ => None,
    })
}

fn arg_bool(args: &[(String, Value)], name: &str) -> FieldResult<Option<bool>> {
    arg_field(args, name, "True or False", |v| match v {
        Value::Bool(b) => Some(*b),
        _ => None,
    })
}

pub(crate) fn arg_float(args: &[(String, Value)], name: &str) -> FieldResult<Option<f64>> {
    arg_field(args, name, "a number", |v| match v {
        Value::Float(f) => Some(*f),
        Value::Int(i) => Some(*i as f64),
        _ => None,
    })
}

/// A number that must be finite and above 0 (`args.rotary_base`, `args.lora_alpha`, …).
pub(crate) fn arg_positive(args: &[(String, Value)], name: &str) -> FieldResult<Option<f64>> {
    let x = arg_float(args, name)?;
    x.map(|x| positive(&format!("args.{name}"), x)).transpose()
}

/// RoPE scaling recorded in Megatron args, as config.json's `rope_scaling`: MindSpeed-LLM's
/// `--rope-scaling-type llama3` with `--rope-scaling-factor`, `--low-freq-factor`,
/// `--high-freq-factor`, `--original-max-position-embeddings`; Megatron-LM's
/// `--use-rope-scaling` (Llama 3.1's scaling, only the factor configurable: default 8, low 1,
/// high 4, original 8192, as megatron-core's `RotaryEmbedding._apply_scaling`).
pub fn rope_scaling_from_args(args: &[(String, Value)]) -> Result<Option<Json>> {
    let kind = arg_str(args, "rope_scaling_type")?;
    let llama3 = |factor: f64, low: f64, high: f64, original: f64| {
        json!({
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": low,
            "high_freq_factor": high,
            "original_max_position_embeddings": original,
        })
    };
    let float_or =
        |name, default| Ok::<_, ConfigError>(arg_positive(args, name)?.unwrap_or(default));
    match kind {
        Some("llama3") => {
            let (low, high) = (
                float_or("low_freq_factor", 1.0)?,
                float_or("high_freq_factor", 4.0)?,
            );
            check_freq_factors(low, high, "args.high_freq_factor")?;
            Ok(Some(llama3(
                float_or("rope_scaling_factor", 8.0)?,
                low,
                high,
                float_or("original_max_position_embeddings", 8192.0)?,
            )))
        }
        Some("yarn") => Ok(mla::yarn_from_args(args)?),
        Some("longrope") => Ok(Some(longrope::longrope_from_args(args)?)),
        Some("plm") => {
            check_plm_rope(args)?;
            Ok(None)
        }
        Some(other) => {
            bail!(
                "args: --rope-scaling-type {other} is not supported (supported: llama3, yarn, \
                 longrope, plm, or none)"
            )
        }
        None if arg_str(args, "rope_type")? == Some("yarn")
            && arg_bool(args, "multi_latent_attention")?.unwrap_or(false) =>
        {
            Ok(mla::yarn_from_args(args)?)
        }
        None if arg_bool(args, "use_rope_scaling")?.unwrap_or(false) => Ok(Some(llama3(
            float_or("rope_scaling_factor", 8.0)?,
            1.0,
            4.0,
            8192.0,
        ))),
        None => Ok(None),
    }
}

/// MindSpeed-LLM's `--rope-scaling-type plm` (mindspeed_llm/core/models/common/embeddings/
/// rotary_pos_embedding.py `apply_plm_scaling`): the inverse frequencies `base^(−2i/d)` over
/// `d` = multi-latent attention's rotated part (`qk_pos_emb_head_dim`), or hidden / heads —
/// plain RoPE wherever that `d` is the part RoPE rotates, refused elsewhere.
fn check_plm_rope(args: &[(String, Value)]) -> Result<()> {
    if arg_bool(args, "multi_latent_attention")?.unwrap_or(false) {
        return Ok(());
    }
    let whole = match (
        arg_count(args, "hidden_size")?,
        arg_count(args, "num_attention_heads")?,
    ) {
        (Some(h), Some(n)) => h / n,
        _ => return Ok(()),
    };
    let head_dim = arg_count(args, "kv_channels")?.unwrap_or(whole);
    let rotated = rotary_dim(args, head_dim)?;
    if rotated != whole {
        bail!(
            "args.rope_scaling_type plm: MindSpeed-LLM's plm frequencies span hidden / heads = \
             {whole} dimensions, but RoPE rotates {rotated}: not built"
        );
    }
    Ok(())
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
        let carried = arg_field(args, HF_CONFIG_ARG, "a string (JSON)", |v| match v {
            Value::Str(s) => Some(s),
            _ => None,
        })?;
        let qk_norm = arg_bool(args, "qk_layernorm")?.unwrap_or(false) || mla::plm_spec_of(args)?;
        let qk_norm_per_layer = qk_norm && spec_is(args, MINIMAX_SPEC);
        let layer_norm = layer_norm_of(args)?;
        let activation = activation_of(args)?;
        let output_bias = arg_bool(args, "add_output_layer_bias")?.unwrap_or(false);
        let carried = match carried {
            Some(text) => {
                let what = format!("args.{HF_CONFIG_ARG} (the original config.json)");
                let hf: Json = serde_json::from_str(text)
                    .with_context(|| format!("{what}: not valid JSON"))?;
                Some((hf, what, true))
            }
            None => converter_config(args).map(|hf| {
                let what = "the config.json fields MindSpeed-LLM's converter saved in args";
                (hf, what.to_string(), false)
            }),
        };
        if let Some((hf, what, keep)) = carried {
            let mut cfg = ModelConfig::from_hf(&hf, family).with_context(|| what)?;
            if !keep {
                // the args hold much besides the config: the config written is built anew
                cfg.hf_config = None;
            }
            // Megatron's latent norms take its one epsilon
            cfg.latent_norm_eps = None;
            check_qk_norm(cfg.family, qk_norm)?;
            cfg.dtype = dtype;
            cfg.qk_norm_per_layer = qk_norm_per_layer;
            (cfg.layer_norm, cfg.output_bias) = (layer_norm, output_bias);
            cfg.activation = activation;
            let (fused_down, split_up) = mla::mla_layout_of(args)?;
            let dsa = mla::dsa_from_args(args)?;
            cfg.mla = cfg.mla.map(|m| Mla {
                fused_down,
                split_up,
                dsa,
                ..m
            });
            cfg.mtp = mtp_of(arg_count_or_none(args, "mtp_num_layers")?);
            check_norms(&cfg)?;
            check_activation(&cfg)?;
            return Ok(cfg);
        }
        let need = |n: &str| {
            arg_count(args, n)?.ok_or_else(|| ConfigError::Missing {
                field: format!("args.{n}"),
            })
        };
        let flag = |n: &str| Ok::<_, ConfigError>(arg_bool(args, n)?.unwrap_or(false));
        let hidden = need("hidden_size")?;
        let heads = need("num_attention_heads")?;
        let groups = if flag("group_query_attention")? {
            need("num_query_groups")?
        } else {
            heads
        };
        check_groups(heads, groups, "args.num_query_groups")?;
        // MindSpeed-LLM's --add-dense-bias gives the attention output a bias alone (InternLM).
        // Megatron's add_bias_linear gives every linear layer one; the MLP biases that implies
        // are then reported as tensors no supported family has.
        let add_bias = flag("add_dense_bias")? || flag("add_bias_linear")?;
        let qkv_bias = flag("add_qkv_bias")? || add_bias;
        let paired = longcat_of(args)?;
        let stored_layers = need("num_layers")?;
        let ffn = need("ffn_hidden_size")?;
        let mut moe = moe::moe_from_args(args, stored_layers, ffn)?;
        let mla = mla::mla_from_args(args)?;
        let layers = match paired {
            true => {
                moe = Some(paired_moe(moe, mla.is_some())?);
                2 * stored_layers
            }
            false => stored_layers,
        };
        let family = match (family, &moe) {
            (Some(f), _) => f,
            (None, _) if mla.is_some() => family::by_name("deepseek_v3")?,
            (None, None) if qk_norm => family::by_name("qwen3")?,
            (None, None) if qkv_bias && !add_bias => family::by_name("qwen2")?,
            (None, None) => family::by_name("llama")?,
            (None, Some(m)) if m.sparsemixer => family::by_name("phimoe")?,
            (None, Some(_)) if qk_norm => family::by_name("qwen3_moe")?,
            (None, Some(_)) if qkv_bias && !add_bias => family::by_name("qwen2_moe")?,
            (None, Some(_)) => family::by_name("mixtral")?,
        };
        check_qk_norm(family, qk_norm)?;
        if family.mla != mla.is_some() {
            bail!(
                "args.multi_latent_attention is {} but the {} family's attention is {}",
                if mla.is_some() { "True" } else { "False" },
                family.name,
                if family.mla {
                    "multi-latent"
                } else {
                    "grouped-query"
                }
            );
        }
        let (groups, head_dim, rotary_dim) = match &mla {
            Some(m) => (heads, m.q_head_dim(), m.rope_dim),
            None => {
                let head_dim = arg_count(args, "kv_channels")?.unwrap_or(hidden / heads);
                (groups, head_dim, rotary_dim(args, head_dim)?)
            }
        };
        let cfg = ModelConfig {
            family,
            layers,
            paired,
            hidden,
            heads,
            groups,
            head_dim,
            rotary_dim,
            ffn,
            activation,
            vocab: arg_count(args, "vocab_size")?.unwrap_or(padded_rows),
            max_positions: arg_count(args, "max_position_embeddings")?.unwrap_or(4096),
            rope_theta: arg_positive(args, "rotary_base")?.unwrap_or(10000.0),
            norm_eps: arg_positive(args, "norm_epsilon")?.unwrap_or(1e-5),
            latent_norm_eps: None,
            tied: !flag("untie_embeddings_and_output_weights")?,
            qkv_bias,
            proj_bias: add_bias,
            layer_norm,
            output_bias,
            qk_norm,
            qk_norm_per_layer,
            mla,
            moe,
            mtp: match mtp_of(arg_count_or_none(args, "mtp_num_layers")?) {
                Some(_) if paired => bail!(
                    "args.mtp_num_layers with MindSpeed-LLM's longcat_spec: multi-token \
                     prediction over LongCat-Flash's layer is not built"
                ),
                mtp => mtp,
            },
            dtype,
            norms_f32: flag("init_norm_weight_in_fp32")?,
            rope_scaling: rope_scaling_from_args(args)?,
            hf_config: None,
        };
        check_norms(&cfg)?;
        check_activation(&cfg)?;
        Ok(cfg)
    }
}

/// A non-gated MLP only in dense models: an MoE layer's experts are SwiGLU here.
fn check_activation(cfg: &ModelConfig) -> Result<()> {
    if cfg.moe.is_some() && !cfg.activation.gated() {
        bail!(
            "args.squared_relu with mixture of experts: experts (and dense layers beside them) \
             with a non-gated MLP are not built"
        );
    }
    Ok(())
}

/// The experts of a model in MindSpeed-LLM's LongCat-Flash layer spec ([`LONGCAT_SPEC`]),
/// `moe` as its args read over its stored layers: every stored layer routes its shortcut
/// experts, from the first of its two decoder layers.
fn paired_moe(moe: Option<Moe>, mla: bool) -> FieldResult<Moe> {
    let refuse = |field: &str, expected| ConfigError::OutOfRange {
        field: field.into(),
        got: "otherwise".into(),
        expected,
    };
    if !mla {
        return Err(refuse(
            "args.multi_latent_attention",
            "true under MindSpeed-LLM's longcat_spec (its sublayers' attention is multi-latent)",
        ));
    }
    let Some(moe) = moe else {
        return Err(refuse(
            "args.num_experts",
            "set under MindSpeed-LLM's longcat_spec (every layer routes shortcut experts)",
        ));
    };
    if !moe.layers.iter().all(|&m| m) {
        return Err(refuse(
            "args.moe_layer_freq / args.first_k_dense_replace",
            "every layer an MoE layer under MindSpeed-LLM's longcat_spec (its layer always \
             builds the shortcut experts)",
        ));
    }
    Ok(moe.paired())
}

/// LayerNorm and the output layer's bias where they are built: LayerNorm only in grouped-query
/// attention's plain decoder layers (the q/k norms, latent norms and prediction depths' norms
/// are RMSNorms here), the bias only on an untied output layer.
fn check_norms(cfg: &ModelConfig) -> Result<()> {
    if cfg.output_bias && cfg.tied {
        bail!(
            "args.add_output_layer_bias with the output layer tied to the embedding is not \
             built (pass --untie-embeddings-and-output-weights)"
        );
    }
    let with = [
        (cfg.qk_norm, "q/k norms"),
        (cfg.mla.is_some(), "multi-latent attention"),
        (cfg.mtp.is_some(), "multi-token prediction"),
        (cfg.paired, "LongCat-Flash's paired layers"),
    ];
    match with.iter().find(|(on, _)| *on && cfg.layer_norm) {
        Some((_, what)) => bail!("args.normalization LayerNorm with {what} is not built"),
        None => Ok(()),
    }
}

/// Whether `args.normalization` makes the decoder's norms LayerNorms (RMSNorms otherwise).
fn layer_norm_of(args: &[(String, Value)]) -> FieldResult<bool> {
    match arg_str(args, "normalization")? {
        None | Some("RMSNorm") => Ok(false),
        Some("LayerNorm") => Ok(true),
        Some(other) => Err(ConfigError::OutOfRange {
            field: "args.normalization".into(),
            got: format!("{other:?}"),
            expected: "\"RMSNorm\" or \"LayerNorm\"",
        }),
    }
}

/// The dense MLP's activation of `args`: `swiglu` (gated SiLU), or `squared_relu` (not gated;
/// MindSpeed-LLM's `fc_type: up_down` says the same). Args without `swiglu` predate its record
/// and are SwiGLU; Megatron's default GeLU MLP (`swiglu` False alone) and a non-gated SiLU
/// (`swiglu` with `fc_type: up_down`) are not built.
fn activation_of(args: &[(String, Value)]) -> FieldResult<Activation> {
    let swiglu = arg_bool(args, "swiglu")?;
    let squared_relu = arg_bool(args, "squared_relu")?.unwrap_or(false);
    let fc_type = arg_str(args, "fc_type")?;
    let refuse = |field: &str, got: &str, expected| {
        Err(ConfigError::OutOfRange {
            field: format!("args.{field}"),
            got: got.into(),
            expected,
        })
    };
    if let Some(other) = fc_type.filter(|t| !["up_down", "gate_up"].contains(t)) {
        return refuse(
            "fc_type",
            other,
            "\"up_down\" or \"gate_up\" (MindSpeed-LLM's)",
        );
    }
    match (swiglu, squared_relu) {
        (Some(true), true) => refuse(
            "squared_relu",
            "True",
            "False beside args.swiglu (Megatron asserts one activation)",
        ),
        (Some(true), false) if fc_type == Some("up_down") => refuse(
            "fc_type",
            "\"up_down\"",
            "not \"up_down\" beside args.swiglu: a non-gated SiLU MLP is not built",
        ),
        (_, true) if fc_type == Some("gate_up") => refuse(
            "fc_type",
            "\"gate_up\"",
            "not \"gate_up\" beside args.squared_relu: a gated squared ReLU is not built",
        ),
        (_, true) => Ok(Activation::SquaredRelu),
        (Some(true) | None, false) => Ok(Activation::SwiGlu),
        (Some(false), false) => refuse(
            "swiglu",
            "False",
            "True, or args.squared_relu: Megatron's default GeLU MLP is not built",
        ),
    }
}

/// Multi-token prediction of `depths` (none for 0), in MindSpeed-LLM's layout until a Megatron
/// checkpoint's keys or a flag say otherwise.
fn mtp_of(depths: Option<usize>) -> Option<Mtp> {
    depths.filter(|&d| d > 0).map(|depths| Mtp {
        depths,
        layout: MtpLayout::Mindspeed,
    })
}

/// The dimensions of a head RoPE rotates: megatron-core rotary_pos_embedding.py
/// `RotaryEmbedding` takes `int(kv_channels · rotary_percent)`, an even number of at least 2.
fn rotary_dim(args: &[(String, Value)], head_dim: usize) -> FieldResult<usize> {
    let percent = arg_positive(args, "rotary_percent")?.unwrap_or(1.0);
    let dim = (head_dim as f64 * percent) as usize;
    if percent > 1.0 || dim < 2 || dim % 2 == 1 {
        return Err(ConfigError::OutOfRange {
            field: "args.rotary_percent".into(),
            got: percent.to_string(),
            expected: "at most 1, rotating an even number of at least 2 of a head's dimensions",
        });
    }
    Ok(dim)
}

/// `args.qk_layernorm` against the family the checkpoint is read as.
fn check_qk_norm(family: &Family, qk_norm: bool) -> Result<()> {
    if !family.qk_norm.allows(qk_norm) {
        bail!(
            "args.qk_layernorm is {} but the {} family {} q/k layernorms",
            if qk_norm { "True" } else { "False" },
            family.name,
            if qk_norm { "has no" } else { "has" }
        );
    }
    Ok(())
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
    /// Expert-parallel size.
    pub ep: usize,
    /// Expert tensor-parallel size (TP, or 1 for whole experts).
    pub etp: usize,
    /// MindSpeed-LLM's `--moe-tp-extend-ep` (whole experts over TP × EP).
    pub tp_extend: bool,
    /// The routed experts stored as MindSpeed-LLM's grouped tensors.
    pub grouped: bool,
    /// MindSpeed's DualPipeV chunks ([`Parallel::dualpipev`]).
    pub dualpipev: bool,
}

impl ParallelArgs {
    /// The args of layout `par`.
    pub fn of(par: &Parallel, padded_vocab: usize, divisible_by: usize, grouped: bool) -> Self {
        ParallelArgs {
            tp: par.tp,
            pp: par.pp,
            vpp: par.vpp,
            first_last: par.first_last(),
            padded_vocab,
            divisible_by,
            ep: par.ep,
            etp: par.etp,
            tp_extend: par.tp_extend,
            grouped,
            dualpipev: par.dualpipev,
        }
    }
}

/// The `args` Namespace Megatron's loaders and `check_checkpoint_args` read
/// (docs/checkpoints.md §1.4, §8), starting from `base` (a source checkpoint's args) when
/// converting Megatron → Megatron.
pub fn megatron_args(
    cfg: &ModelConfig,
    par: &ParallelArgs,
    base: &[(String, Value)],
) -> Vec<(String, Value)> {
    let int = |v: usize| Value::Int(v as i64);
    let gqa = cfg.groups != cfg.heads;
    let rope_scaling = cfg.rope_scaling.as_ref();
    let scaling_type = cfg.rope_type();
    let scaling_factor = rope_scaling
        .and_then(|r| r.get("factor"))
        .and_then(Json::as_f64);
    let mut set: Vec<(&str, Value)> = vec![
        ("num_layers", int(cfg.stored_layers())),
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
        (
            "rotary_percent",
            // multi-latent attention rotates a part of its own (qk_pos_emb_head_dim) whole
            Value::Float(match cfg.mla {
                Some(_) => 1.0,
                None => cfg.rotary_dim as f64 / cfg.head_dim as f64,
            }),
        ),
        ("rotary_interleaved", Value::Bool(false)),
        (
            "use_rope_scaling",
            Value::Bool(matches!(scaling_type, Some("llama3"))),
        ),
        (
            "rope_scaling_factor",
            scaling_factor.map_or(Value::None, Value::Float),
        ),
        (
            "normalization",
            Value::Str(match cfg.layer_norm {
                true => "LayerNorm".into(),
                false => "RMSNorm".into(),
            }),
        ),
        ("norm_epsilon", Value::Float(cfg.norm_eps)),
        ("swiglu", Value::Bool(cfg.activation == Activation::SwiGlu)),
        (
            "squared_relu",
            Value::Bool(cfg.activation == Activation::SquaredRelu),
        ),
        ("add_bias_linear", Value::Bool(false)),
        ("add_dense_bias", Value::Bool(cfg.proj_bias)),
        ("add_qkv_bias", Value::Bool(cfg.qkv_bias)),
        ("add_output_layer_bias", Value::Bool(cfg.output_bias)),
        ("qk_layernorm", Value::Bool(cfg.qk_norm)),
        (
            "untie_embeddings_and_output_weights",
            Value::Bool(!cfg.tied),
        ),
        ("tensor_model_parallel_size", int(par.tp)),
        ("pipeline_model_parallel_size", int(par.pp)),
        // DualPipeV's two chunks are its own, no virtual pipeline (MindSpeed refuses both)
        (
            "schedules_method",
            match par.dualpipev {
                true => Value::Str("dualpipev".into()),
                false => Value::None,
            },
        ),
        (
            "virtual_pipeline_model_parallel_size",
            if par.vpp > 1 && !par.dualpipev {
                int(par.vpp)
            } else {
                Value::None
            },
        ),
        // Megatron takes the chunk size for even stages and the chunk count for uneven ones
        // (it refuses both set at once).
        (
            "num_layers_per_virtual_pipeline_stage",
            if par.vpp > 1 && par.first_last.is_none() && !par.dualpipev {
                int(cfg.stored_layers() / par.pp / par.vpp)
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
            par.first_last
                .map_or(Value::None, |(f, _)| int(f / cfg.sublayers())),
        ),
        (
            "decoder_last_pipeline_num_layers",
            par.first_last
                .map_or(Value::None, |(_, l)| int(l / cfg.sublayers())),
        ),
        ("expert_model_parallel_size", int(par.ep)),
        ("moe_grouped_gemm", Value::Bool(par.grouped)),
        ("make_vocab_size_divisible_by", int(par.divisible_by)),
        ("padded_vocab_size", int(par.padded_vocab)),
        ("vocab_size", int(cfg.vocab)),
        ("fp16", Value::Bool(cfg.dtype == DType::F16)),
        ("bf16", Value::Bool(cfg.dtype == DType::BF16)),
        ("params_dtype", Value::TorchDType(cfg.dtype)),
        ("init_norm_weight_in_fp32", Value::Bool(cfg.norms_f32)),
        ("iteration", int(1)),
        ("consumed_train_samples", int(0)),
        ("consumed_valid_samples", int(0)),
        ("sequence_parallel", Value::Bool(false)),
        ("apply_query_key_layer_scaling", Value::Bool(false)),
        ("bert_binary_head", Value::Bool(false)),
        ("ckpt_format", Value::Str("torch".into())),
        ("model_type", Value::Str("GPT".into())),
    ];
    set.extend(moe::moe_args(cfg.moe.as_ref(), cfg.sublayers()));
    set.extend(mla::mla_args(cfg));
    set.extend(mla::yarn_args(cfg.rope_scaling.as_ref()));
    set.extend(longrope::longrope_args(cfg.rope_scaling.as_ref()));
    set.push((
        "mtp_num_layers",
        cfg.mtp.map_or(Value::None, |m| int(m.depths)),
    ));
    if cfg.moe.is_some() {
        // MindSpeed-LLM's --moe-tp-extend-ep leaves Megatron's groups (and args) at TP
        let etp = if par.tp_extend { par.tp } else { par.etp };
        set.push(("expert_tensor_parallel_size", int(etp)));
        set.push(("moe_tp_extend_ep", Value::Bool(par.tp_extend)));
    }
    if base.is_empty() {
        set.push(("tokenizer_type", Value::Str("HuggingFaceTokenizer".into())));
        set.push(("tokenizer_model", Value::None));
    }
    if let Some(hf) = &cfg.hf_config {
        set.push((HF_CONFIG_ARG, Value::Str(hf.to_string())));
    }
    match spec_arg(cfg) {
        Some(spec) => set.push(("spec", spec)),
        // a source's spec that said what this model no longer is
        None if [MINIMAX_SPEC, DEEPSEEK_SPEC, LONGCAT_SPEC]
            .iter()
            .any(|&s| spec_is(base, s)) =>
        {
            set.push(("spec", Value::None))
        }
        None => {}
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
        let yarn = scaling(&[
            ("rope_scaling_type", Value::Str("yarn".into())),
            ("rope_scaling_factor", Value::Float(40.0)),
            ("rope_scaling_mscale_all_dim", Value::Float(0.707)),
            ("beta_fast", Value::Int(32)),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(
            yarn,
            json!({"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096.0,
                   "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.707})
        );
        let err = scaling(&[("rope_scaling_type", Value::Str("longrope".into()))]).unwrap_err();
        assert!(
            err.to_string()
                .contains("rope_scaling_original_max_position_embeddings"),
            "{err}"
        );
        let err = scaling(&[("rope_scaling_type", Value::Str("ntk".into()))]).unwrap_err();
        assert!(err.to_string().contains("--rope-scaling-type ntk"), "{err}");
    }

    /// A small llama config.json with `edit` applied, read.
    fn hf(edit: impl Fn(&mut Json)) -> Result<ModelConfig> {
        let mut cfg = json!({
            "model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
            "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 128,
            "vocab_size": 256, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        });
        edit(&mut cfg);
        ModelConfig::from_hf(&cfg, None)
    }

    /// Each `(field, value, message)`: the config (built by `read` with the field set) is refused
    /// with `message`.
    fn refused<T: Clone>(read: impl Fn(&str, T) -> Result<ModelConfig>, cases: &[(&str, T, &str)]) {
        for (field, value, message) in cases {
            let e = match read(field, value.clone()) {
                Ok(_) => panic!("{field} accepted"),
                Err(e) => format!("{e:#}"),
            };
            assert!(e.contains(message), "{field}: {e}");
        }
    }

    fn set_hf(pointer: &str, value: Json) -> Result<ModelConfig> {
        hf(|c| *c.pointer_mut(pointer).expect("field exists") = value.clone())
    }

    fn add_hf(field: &str, value: Json) -> Result<ModelConfig> {
        hf(|c| c[field] = value.clone())
    }

    #[test]
    fn config_json_fields_of_the_wrong_type_are_errors() {
        let c = hf(|_| {}).unwrap();
        assert_eq!((c.rope_theta, c.norm_eps, c.head_dim), (500000.0, 1e-5, 16));
        refused(
            set_hf,
            &[
                (
                    "/rope_theta",
                    json!("500000"),
                    "\"rope_theta\" must be a number, got the string \"500000\"",
                ),
                (
                    "/rope_theta",
                    json!("abc"),
                    "\"rope_theta\" must be a number, got the string \"abc\"",
                ),
                (
                    "/num_hidden_layers",
                    json!("2"),
                    "\"num_hidden_layers\" must be a positive integer, got the string \"2\"",
                ),
                (
                    "/hidden_size",
                    json!(64.0),
                    "\"hidden_size\" must be a positive integer, got 64.0",
                ),
                (
                    "/num_key_value_heads",
                    json!(-2),
                    "\"num_key_value_heads\" must be a positive integer, got -2",
                ),
                (
                    "/model_type",
                    json!(7),
                    "\"model_type\" must be a string, got 7",
                ),
                (
                    "/rms_norm_eps",
                    json!(true),
                    "\"rms_norm_eps\" must be a number, got true",
                ),
                (
                    "/rope_scaling",
                    json!("llama3"),
                    "\"rope_scaling\" must be an object, got the string",
                ),
                (
                    "/rope_scaling/factor",
                    json!("8"),
                    "\"rope_scaling.factor\" must be a number",
                ),
                (
                    "/rope_scaling/rope_type",
                    json!(3),
                    "\"rope_scaling.rope_type\" must be a string",
                ),
            ],
        );
        refused(
            add_hf,
            &[
                (
                    "torch_dtype",
                    json!(16),
                    "\"torch_dtype\" must be a string, got 16",
                ),
                (
                    "tie_word_embeddings",
                    json!(0),
                    "\"tie_word_embeddings\" must be true or false, got 0",
                ),
                (
                    "head_dim",
                    json!("16"),
                    "\"head_dim\" must be a positive integer",
                ),
                (
                    "max_position_embeddings",
                    json!([4096]),
                    "must be a positive integer, got an array",
                ),
            ],
        );
        // transformers 5.x keeps rope_theta in rope_parameters.
        let v5 = hf(|c| {
            let obj = c.as_object_mut().unwrap();
            obj.remove("rope_theta");
            obj.remove("rope_scaling");
            obj.insert(
                "rope_parameters".into(),
                json!({"rope_type": "default", "rope_theta": "1e4"}),
            );
        });
        let e = format!("{:#}", v5.unwrap_err());
        assert!(
            e.contains("\"rope_parameters.rope_theta\" must be a number"),
            "{e}"
        );
        // Null means absent: the default applies.
        assert_eq!(add_hf("head_dim", Json::Null).unwrap().head_dim, 16);
    }

    #[test]
    fn config_json_numbers_out_of_range_are_errors() {
        let positive = "it must be a finite number above 0";
        refused(
            set_hf,
            &[
                ("/rms_norm_eps", json!(0), positive),
                (
                    "/rms_norm_eps",
                    json!(-1e-6),
                    "\"rms_norm_eps\" is -1e-6; it must be",
                ),
                ("/rope_theta", json!(0.0), "\"rope_theta\" is 0;"),
                (
                    "/rope_scaling/factor",
                    json!(0),
                    "\"rope_scaling.factor\" is 0;",
                ),
                (
                    "/rope_scaling/low_freq_factor",
                    json!(-1),
                    "\"rope_scaling.low_freq_factor\" is -1;",
                ),
                (
                    "/rope_scaling/high_freq_factor",
                    json!(1.0),
                    "\"rope_scaling.high_freq_factor\" is 1; it must be above low_freq_factor",
                ),
                (
                    "/rope_scaling/original_max_position_embeddings",
                    json!(0),
                    "original_max_position_embeddings\" is 0",
                ),
                (
                    "/num_hidden_layers",
                    json!(0),
                    "\"num_hidden_layers\" is 0; it must be at least 1",
                ),
                (
                    "/hidden_size",
                    json!(0),
                    "\"hidden_size\" is 0; it must be at least 1",
                ),
                (
                    "/num_attention_heads",
                    json!(0),
                    "\"num_attention_heads\" is 0; it must be at least 1",
                ),
                (
                    "/num_key_value_heads",
                    json!(0),
                    "\"num_key_value_heads\" is 0; it must be at least 1",
                ),
                (
                    "/num_key_value_heads",
                    json!(3),
                    "num_attention_heads (4) must be a multiple of num_key_value_heads (3)",
                ),
            ],
        );
        // Counts beyond any model's, before the sizes computed from them could overflow.
        refused(
            set_hf,
            &[
                (
                    "/num_hidden_layers",
                    json!(1u64 << 40),
                    "\"num_hidden_layers\" is 1099511627776; mindkit reads at most 65536",
                ),
                (
                    "/num_attention_heads",
                    json!(u64::MAX),
                    "\"num_attention_heads\" is 18446744073709551615; mindkit reads at most 65536",
                ),
                (
                    "/hidden_size",
                    json!(1u64 << 21),
                    "\"hidden_size\" is 2097152; mindkit reads at most 1048576",
                ),
                (
                    "/vocab_size",
                    json!(1u64 << 25),
                    "mindkit reads at most 16777216",
                ),
            ],
        );
        let linear =
            |factor: Json| hf(|c| c["rope_scaling"] = json!({"type": "linear", "factor": factor}));
        assert!(linear(json!(2.0)).is_ok());
        assert!(format!("{:#}", linear(json!(-2.0)).unwrap_err())
            .contains("\"rope_scaling.factor\" is -2"));
        let no_factor = hf(|c| c["rope_scaling"] = json!({"rope_type": "llama3"})).unwrap_err();
        assert!(format!("{no_factor:#}").contains("missing \"rope_scaling.factor\""));
    }

    /// GQA args (4 heads, 2 groups) with `name` set to `value` (first, so that it is the one
    /// read).
    fn set_arg(name: &str, value: Value) -> Result<ModelConfig> {
        let mut args = args(&[
            ("group_query_attention", Value::Bool(true)),
            ("num_query_groups", Value::Int(2)),
        ]);
        args.insert(0, (name.to_string(), value));
        ModelConfig::from_megatron_args(&args, None, DType::F32, 256)
    }

    #[test]
    fn megatron_args_of_the_wrong_type_are_errors() {
        assert_eq!(
            set_arg("rotary_base", Value::Int(500000))
                .unwrap()
                .rope_theta,
            500000.0
        );
        refused(
            set_arg,
            &[
                (
                    "rotary_base",
                    Value::Str("500000".into()),
                    "\"args.rotary_base\" must be a number, got the string \"500000\"",
                ),
                (
                    "num_layers",
                    Value::Float(2.0),
                    "\"args.num_layers\" must be a non-negative integer, got 2",
                ),
                (
                    "num_layers",
                    Value::Str("2".into()),
                    "\"args.num_layers\" must be a non-negative integer, got the string \"2\"",
                ),
                (
                    "hidden_size",
                    Value::Bool(true),
                    "\"args.hidden_size\" must be a non-negative integer, got True",
                ),
                (
                    "norm_epsilon",
                    Value::List(vec![]),
                    "\"args.norm_epsilon\" must be a number, got a list",
                ),
                (
                    "group_query_attention",
                    Value::Int(1),
                    "\"args.group_query_attention\" must be True or False, got 1",
                ),
                (
                    "untie_embeddings_and_output_weights",
                    Value::Str("yes".into()),
                    "must be True or False",
                ),
                (
                    "rope_scaling_type",
                    Value::Int(3),
                    "\"args.rope_scaling_type\" must be a string, got 3",
                ),
                (
                    "kv_channels",
                    Value::Int(-1),
                    "\"args.kv_channels\" must be a non-negative integer, got -1",
                ),
                (
                    HF_CONFIG_ARG,
                    Value::Str(
                        r#"{"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
                            "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 256,
                            "rope_theta": "abc"}"#
                            .into(),
                    ),
                    "args.mindkit_hf_config (the original config.json): \"rope_theta\" must be",
                ),
            ],
        );
    }

    #[test]
    fn megatron_args_out_of_range_are_errors() {
        refused(
            set_arg,
            &[
                (
                    "rotary_base",
                    Value::Float(0.0),
                    "\"args.rotary_base\" is 0; it must be a finite number above 0",
                ),
                (
                    "rotary_base",
                    Value::Float(f64::NAN),
                    "\"args.rotary_base\" is NaN",
                ),
                (
                    "norm_epsilon",
                    Value::Float(-1e-5),
                    "\"args.norm_epsilon\" is -1e-5",
                ),
                (
                    "norm_epsilon",
                    Value::Float(f64::INFINITY),
                    "\"args.norm_epsilon\" is inf",
                ),
                (
                    "num_layers",
                    Value::Int(0),
                    "\"args.num_layers\" is 0; it must be at least 1",
                ),
                (
                    "num_attention_heads",
                    Value::Int(0),
                    "\"args.num_attention_heads\" is 0; it must be at least 1",
                ),
                (
                    "num_query_groups",
                    Value::Int(3),
                    "num_attention_heads (4) must be a multiple of args.num_query_groups (3)",
                ),
                (
                    "num_layers",
                    Value::Int(1 << 40),
                    "\"args.num_layers\" is 1099511627776; mindkit reads at most 65536",
                ),
            ],
        );
        let llama3 = |extra: &[(&str, Value)]| {
            let mut a = vec![("rope_scaling_type", Value::Str("llama3".into()))];
            a.extend(extra.iter().cloned());
            format!("{:#}", scaling(&a).unwrap_err())
        };
        assert!(llama3(&[("rope_scaling_factor", Value::Float(0.0))])
            .contains("\"args.rope_scaling_factor\" is 0"));
        assert!(llama3(&[("high_freq_factor", Value::Float(1.0))])
            .contains("\"args.high_freq_factor\" is 1; it must be above low_freq_factor"));
        let megatron = [
            ("use_rope_scaling", Value::Bool(true)),
            ("rope_scaling_factor", Value::Float(-8.0)),
        ];
        assert!(format!("{:#}", scaling(&megatron).unwrap_err())
            .contains("\"args.rope_scaling_factor\" is -8"));
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
