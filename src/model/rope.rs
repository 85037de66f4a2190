//! Rotary position embedding: the inverse frequencies (with `linear`, `llama3`, `yarn` or
//! `longrope` scaling) and the cos/sin rows of given positions, computed in f32 in the order
//! transformers computes them (`LlamaRotaryEmbedding`, `_compute_llama3_parameters`,
//! `_compute_yarn_parameters`, `_compute_longrope_parameters` with Phi-3.5-MoE's
//! `PhimoeRotaryEmbedding`) or MindSpeed-LLM does (its rotary_pos_embedding.py for LongRoPE in
//! training), so the tables agree to the ulp. YaRN's and LongRoPE's attention factors scale the tables, as
//! transformers, megatron-core (`YarnRotaryEmbedding`'s mscale) and MindSpeed-LLM do.

use crate::arch::ModelConfig;
use anyhow::{bail, Result};
use serde_json::Value as Json;

/// Inverse frequencies of a model's rotary embedding.
#[derive(Debug, Clone)]
pub(super) struct Rope {
    inv_freq: Vec<f32>,
    /// MindSpeed-LLM's `mul` LongRoPE: each angle is `(p · dᵢ) · inv_freqᵢ` with `dᵢ` the
    /// reciprocal of frequency i's factor (`torch.mul(torch.outer(seq, 1 / ext), inv_freq)`);
    /// `None`: `p · inv_freqᵢ`.
    divisors: Option<Vec<f32>>,
    /// The factor of every cos and sin (YaRN's or LongRoPE's attention factor; 1 otherwise).
    attention_factor: f32,
    /// transformers' LongRoPE (Phi-3.5-MoE's `config.json` outside training): the frequencies
    /// and factor above are the short ones, these the long ones, taken by a forward pass whose
    /// running length passes the original context.
    long: Option<LongFactors>,
}

/// The long half of transformers' LongRoPE ([`Rope::long`]).
#[derive(Debug, Clone)]
struct LongFactors {
    /// The original context (`original_max_position_embeddings`): longer passes take these.
    original: usize,
    inv_freq: Vec<f32>,
    attention_factor: f32,
}

fn number(r: &Json, key: &str, default: Option<f64>) -> Result<f64> {
    match (r.get(key).and_then(Json::as_f64), default) {
        (Some(v), _) | (None, Some(v)) => Ok(v),
        (None, None) => bail!("config.json: rope scaling has no numeric \"{key}\""),
    }
}

impl Rope {
    /// The rotary embedding of `cfg` for a model run at `seq_length` positions, which chooses
    /// LongRoPE's factors as MindSpeed-LLM's training does (`None`: no such length, where
    /// LongRoPE is refused).
    pub(super) fn new(cfg: &ModelConfig, seq_length: Option<usize>) -> Result<Self> {
        let d = cfg.rotary_dim;
        let base = cfg.rope_theta as f32;
        let mut inv_freq: Vec<f32> = (0..d)
            .step_by(2)
            .map(|i| 1.0 / base.powf(i as f32 / d as f32))
            .collect();
        let mut attention_factor = 1.0;
        let mut divisors = None;
        let mut long = None;
        if let Some(r) = &cfg.rope_scaling {
            let kind = (r.get("rope_type").or_else(|| r.get("type")))
                .and_then(Json::as_str)
                .unwrap_or("default");
            match kind {
                "default" => {}
                "linear" => {
                    let factor = number(r, "factor", None)? as f32;
                    inv_freq.iter_mut().for_each(|f| *f /= factor);
                }
                "llama3" => llama3(&mut inv_freq, r)?,
                "yarn" => attention_factor = yarn(&mut inv_freq, r, (d, base, cfg))?,
                "longrope" => match (seq_length, r.get("freqs_type")) {
                    (Some(s), freqs) => {
                        let outer = freqs.and_then(Json::as_str) == Some("outer");
                        (divisors, attention_factor) =
                            longrope(&mut inv_freq, r, (d, base, cfg, s), outer)?;
                    }
                    (None, None) => {
                        // transformers' `_compute_longrope_parameters`: each frequency divided
                        let mut long_freq = inv_freq.clone();
                        let (_, short_factor) =
                            longrope(&mut inv_freq, r, (d, base, cfg, 0), true)?;
                        let original = number(r, "original_max_position_embeddings", None)?;
                        let beyond = original as usize + 1;
                        let (_, long_factor) =
                            longrope(&mut long_freq, r, (d, base, cfg, beyond), true)?;
                        attention_factor = short_factor;
                        long = Some(LongFactors {
                            original: original as usize,
                            inv_freq: long_freq,
                            attention_factor: long_factor,
                        });
                    }
                    (None, Some(_)) => bail!(
                        "MindSpeed-LLM's LongRoPE (--rope-scaling-type longrope) outside training \
                         is not built: its evaluation takes the short factors unscaled, \
                         transformers switches them by the running length; keep such a model \
                         to `mindkit train`"
                    ),
                },
                other => bail!(
                    "config.json: rope scaling \"{other}\" is not supported (supported: default, \
                     linear, llama3, yarn, longrope)"
                ),
            }
        }
        Ok(Rope {
            inv_freq,
            divisors,
            attention_factor,
            long,
        })
    }

    /// Where transformers' LongRoPE switches to its long factors: a generation whose cache
    /// holds at most this many positions and that passes it is computed again from its first
    /// token (transformers' `PhimoeForCausalLM.prepare_inputs_for_generation`); `None` without.
    pub(super) fn switches_after(&self) -> Option<usize> {
        self.long.as_ref().map(|l| l.original)
    }

    /// The frequencies: half the rotated dimensions of a head.
    pub(super) fn frequencies(&self) -> usize {
        self.inv_freq.len()
    }

    /// `cos` and `sin` of `position · inv_freq`, `[positions, rotary_dim / 2]` each: for one
    /// forward pass, whose running length (the last position + 1, transformers' `seq_len`)
    /// chooses LongRoPE's factors where they switch.
    pub(super) fn tables(&self, positions: &[usize]) -> (Vec<f32>, Vec<f32>) {
        let running = positions.iter().max().map_or(0, |p| p + 1);
        let (inv_freq, factor) = match &self.long {
            Some(l) if running > l.original => (&l.inv_freq, l.attention_factor),
            _ => (&self.inv_freq, self.attention_factor),
        };
        let n = positions.len() * inv_freq.len();
        let (mut cos, mut sin) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for &p in positions {
            for (i, &f) in inv_freq.iter().enumerate() {
                let angle = match &self.divisors {
                    Some(d) => (p as f32 * d[i]) * f,
                    None => p as f32 * f,
                };
                cos.push(angle.cos() * factor);
                sin.push(angle.sin() * factor);
            }
        }
        (cos, sin)
    }
}

/// YaRN's `mscale` of a context `scale`-times longer (transformers' `get_mscale`, megatron-core
/// `_yarn_get_mscale`).
pub(super) fn yarn_mscale(scale: f64, mscale: f64) -> f64 {
    match scale <= 1.0 {
        true => 1.0,
        false => 0.1 * mscale * scale.ln() + 1.0,
    }
}

/// The softmax scale of multi-latent attention over `q_head_dim` dimensions:
/// `mscale(factor, mscale_all_dim)² / √q_head_dim` under YaRN (transformers'
/// `DeepseekV3Attention.scaling`, megatron-core `MultiLatentAttention.softmax_scale`).
pub(super) fn mla_softmax_scale(cfg: &ModelConfig, q_head_dim: usize) -> f32 {
    let plain = 1.0 / (q_head_dim as f64).sqrt();
    let Some(r) = cfg.rope_scaling.as_ref().filter(|r| kind(r) == "yarn") else {
        return plain as f32;
    };
    let all_dim = r
        .get("mscale_all_dim")
        .and_then(Json::as_f64)
        .unwrap_or(0.0);
    let factor = r.get("factor").and_then(Json::as_f64).unwrap_or(1.0);
    let m = if all_dim != 0.0 {
        yarn_mscale(factor, all_dim)
    } else {
        1.0
    };
    (plain * m * m) as f32
}

/// A rope scaling's type (`rope_type`, or the older `type`).
fn kind(r: &Json) -> &str {
    (r.get("rope_type").or_else(|| r.get("type")))
        .and_then(Json::as_str)
        .unwrap_or("default")
}

/// YaRN's frequencies, step for step as transformers' `_compute_yarn_parameters` computes
/// them (the correction range truncated unless `truncate` is false), over `d` rotated
/// dimensions of RoPE base `base`; returns the attention factor.
fn yarn(inv_freq: &mut [f32], r: &Json, (d, base, cfg): (usize, f32, &ModelConfig)) -> Result<f32> {
    let factor = number(r, "factor", None)?;
    let mscale = r.get("mscale").and_then(Json::as_f64).filter(|&m| m != 0.0);
    let all_dim = r
        .get("mscale_all_dim")
        .and_then(Json::as_f64)
        .filter(|&m| m != 0.0);
    let attention_factor = match (
        r.get("attention_factor").and_then(Json::as_f64),
        mscale,
        all_dim,
    ) {
        (Some(a), ..) => a,
        (None, Some(m), Some(a)) => yarn_mscale(factor, m) / yarn_mscale(factor, a),
        _ => yarn_mscale(factor, 1.0),
    };
    let fast = r
        .get("beta_fast")
        .and_then(Json::as_f64)
        .filter(|&b| b != 0.0)
        .unwrap_or(32.0);
    let slow = r
        .get("beta_slow")
        .and_then(Json::as_f64)
        .filter(|&b| b != 0.0)
        .unwrap_or(1.0);
    let original = match r
        .get("original_max_position_embeddings")
        .and_then(Json::as_f64)
    {
        Some(o) if o != 0.0 => o,
        _ => cfg.max_positions as f64,
    };
    let truncate = r.get("truncate").and_then(Json::as_bool).unwrap_or(true);
    let dim = d as f64;
    let correction = |rotations: f64| {
        dim * (original / (rotations * 2.0 * std::f64::consts::PI)).ln()
            / (2.0 * (base as f64).ln())
    };
    let (mut low, mut high) = (correction(fast), correction(slow));
    if truncate {
        (low, high) = (low.floor(), high.ceil());
    }
    let (low, mut high) = (low.max(0.0), high.min(dim - 1.0));
    if low == high {
        high += 0.001;
    }
    let (factor, span) = (factor as f32, (high - low) as f32);
    for (i, f) in inv_freq.iter_mut().enumerate() {
        // `*f` is `1 / base^(2i/d)`, extrapolation; interpolation is `1 / (factor·base^(2i/d))`
        let pos_freq = base.powf((2 * i) as f32 / d as f32);
        let interpolation = 1.0 / (factor * pos_freq);
        let ramp = ((i as f32 - low as f32) / span).clamp(0.0, 1.0);
        let extrapolation_factor = 1.0 - ramp;
        *f = interpolation * (1.0 - extrapolation_factor) + *f * extrapolation_factor;
    }
    Ok(attention_factor as f32)
}

/// LongRoPE as MindSpeed-LLM trains with it (mindspeed_llm/core/models/common/embeddings/
/// rotary_pos_embedding.py `rotary_embedding_forward`, `apply_rotary_pos_emb_bshd`) over `d`
/// rotated dimensions of RoPE base `base` at sequence length `s`: the long factors when `s` is
/// beyond the original context, else the short ones; `outer` divides each inverse frequency by
/// its factor (transformers' `_compute_longrope_parameters` too; `outer`), `mul` divides the positions
/// ([`Rope::divisors`]). The attention factor: the long or short mscale as `s` is beyond the
/// original context or not, or without them `√(1 + ln(max / original) / ln original)` when the
/// model's positions exceed the original context. Returns the divisors and the factor.
fn longrope(
    inv_freq: &mut [f32],
    r: &Json,
    (d, base, cfg, s): (usize, f32, &ModelConfig, usize),
    outer: bool,
) -> Result<(Option<Vec<f32>>, f32)> {
    let original = number(r, "original_max_position_embeddings", None)?;
    let long = s as f64 > original;
    let key = if long { "long_factor" } else { "short_factor" };
    let ext: Vec<f32> = (r.get(key).and_then(Json::as_array).into_iter().flatten())
        .filter_map(Json::as_f64)
        .map(|f| f as f32)
        .collect();
    if ext.len() != inv_freq.len() {
        bail!(
            "LongRoPE's {key} has {} factors; the {d} rotated dimensions have {} frequencies",
            ext.len(),
            inv_freq.len()
        );
    }
    let mscale = |k: &str| r.get(k).and_then(Json::as_f64);
    let attention_factor = match (mscale("long_mscale"), mscale("short_mscale")) {
        (Some(l), Some(_)) if long => l,
        (Some(_), Some(short)) => short,
        _ => {
            let scale = cfg.max_positions as f64 / original;
            match scale <= 1.0 {
                true => 1.0,
                false => (1.0 + scale.ln() / original.ln()).sqrt(),
            }
        }
    };
    if outer {
        for (i, f) in inv_freq.iter_mut().enumerate() {
            *f = 1.0 / (ext[i] * base.powf((2 * i) as f32 / d as f32));
        }
        return Ok((None, attention_factor as f32));
    }
    let divisors = ext.iter().map(|&e| 1.0 / e).collect();
    Ok((Some(divisors), attention_factor as f32))
}

/// Llama 3.1's frequency-dependent scaling, step for step as transformers does it.
fn llama3(inv_freq: &mut [f32], r: &Json) -> Result<()> {
    let factor = number(r, "factor", None)? as f32;
    let low = number(r, "low_freq_factor", Some(1.0))? as f32;
    let high = number(r, "high_freq_factor", Some(4.0))? as f32;
    let old = number(r, "original_max_position_embeddings", Some(8192.0))? as f32;
    let (low_wavelen, high_wavelen) = (old / low, old / high);
    for f in inv_freq {
        let wavelen = 2.0 * std::f32::consts::PI / *f;
        let scaled = if wavelen > low_wavelen {
            *f / factor
        } else {
            *f
        };
        let smooth = (old / wavelen - low) / (high - low);
        let smoothed = (1.0 - smooth) * scaled / factor + smooth * scaled;
        // Finite frequencies only, so "not below, not above" is "within".
        let medium = wavelen >= high_wavelen && wavelen <= low_wavelen;
        *f = if medium { smoothed } else { scaled };
    }
    Ok(())
}
