//! Rotary position embedding: the inverse frequencies (with `linear`, `llama3` or `yarn`
//! scaling) and the cos/sin rows of given positions, computed in f32 in the order
//! transformers computes them (`LlamaRotaryEmbedding`, `_compute_llama3_parameters`,
//! `_compute_yarn_parameters`), so the tables agree to the ulp. YaRN's attention factor
//! scales the tables, as transformers and megatron-core (`YarnRotaryEmbedding`'s mscale) do.

use crate::arch::ModelConfig;
use anyhow::{bail, Result};
use serde_json::Value as Json;

/// Inverse frequencies of a model's rotary embedding.
#[derive(Debug, Clone)]
pub(super) struct Rope {
    inv_freq: Vec<f32>,
    /// The factor of every cos and sin (YaRN's attention factor; 1 otherwise).
    attention_factor: f32,
}

fn number(r: &Json, key: &str, default: Option<f64>) -> Result<f64> {
    match (r.get(key).and_then(Json::as_f64), default) {
        (Some(v), _) | (None, Some(v)) => Ok(v),
        (None, None) => bail!("config.json: rope scaling has no numeric \"{key}\""),
    }
}

impl Rope {
    pub(super) fn new(cfg: &ModelConfig) -> Result<Self> {
        let d = cfg.rotary_dim;
        let base = cfg.rope_theta as f32;
        let mut inv_freq: Vec<f32> = (0..d)
            .step_by(2)
            .map(|i| 1.0 / base.powf(i as f32 / d as f32))
            .collect();
        let mut attention_factor = 1.0;
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
                other => bail!(
                    "config.json: rope scaling \"{other}\" is not supported (supported: default, \
                     linear, llama3, yarn)"
                ),
            }
        }
        Ok(Rope {
            inv_freq,
            attention_factor,
        })
    }

    /// The frequencies: half the rotated dimensions of a head.
    pub(super) fn frequencies(&self) -> usize {
        self.inv_freq.len()
    }

    /// `cos` and `sin` of `position · inv_freq`, `[positions, rotary_dim / 2]` each.
    pub(super) fn tables(&self, positions: &[usize]) -> (Vec<f32>, Vec<f32>) {
        let n = positions.len() * self.inv_freq.len();
        let (mut cos, mut sin) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for &p in positions {
            for &f in &self.inv_freq {
                let angle = p as f32 * f;
                cos.push(angle.cos() * self.attention_factor);
                sin.push(angle.sin() * self.attention_factor);
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
