//! Rotary position embedding: the inverse frequencies (with `linear` or `llama3` scaling) and
//! the cos/sin rows of given positions, computed in f32 in the order transformers computes
//! them (`LlamaRotaryEmbedding`, `_compute_llama3_parameters`), so the tables agree to the ulp.

use crate::arch::ModelConfig;
use anyhow::{bail, Result};
use serde_json::Value as Json;

/// Inverse frequencies of a model's rotary embedding.
#[derive(Debug, Clone)]
pub(super) struct Rope {
    inv_freq: Vec<f32>,
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
                other => bail!(
                    "config.json: rope scaling \"{other}\" is not supported (supported: default, \
                     linear, llama3)"
                ),
            }
        }
        Ok(Rope { inv_freq })
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
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
        (cos, sin)
    }
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
