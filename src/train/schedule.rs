//! Megatron's learning-rate and weight-decay schedule (megatron-core 0.15
//! `megatron/core/optimizer_param_scheduler.py`, `OptimizerParamScheduler`), built as
//! `megatron/training/training.py` `get_optimizer_param_scheduler` builds it: every length is
//! counted in **samples**, the scheduler is stepped by the global batch size after each
//! successful update, so the update of iteration i (from 1) uses `lr((i − 1)·G)` and the lr
//! Megatron prints on that iteration's line is `lr(i·G)`.

use serde_json::{json, Value};

/// How the learning rate decays after warmup (`--lr-decay-style`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecayStyle {
    /// `max_lr` for ever.
    Constant,
    /// Linearly to `min_lr` at the end of decay.
    Linear,
    /// Half a cosine to `min_lr`.
    Cosine,
    /// `max_lr · √warmup / √step`, floored at `min_lr`.
    InverseSquareRoot,
    /// Warmup-stable-decay: `max_lr` until the last `wsd_decay_steps`, then annealed.
    Wsd(WsdStyle),
}

/// The anneal of the WSD style's last phase (`--lr-wsd-decay-style`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WsdStyle {
    /// `2·0.5^r − 1`.
    Exponential,
    /// `1 − r`.
    Linear,
    /// `½(cos(πr) + 1)`.
    Cosine,
    /// `1 − √r`.
    MinusSqrt,
}

impl DecayStyle {
    /// Megatron's name (`--lr-decay-style` value).
    pub fn name(self) -> &'static str {
        match self {
            DecayStyle::Constant => "constant",
            DecayStyle::Linear => "linear",
            DecayStyle::Cosine => "cosine",
            DecayStyle::InverseSquareRoot => "inverse-square-root",
            DecayStyle::Wsd(_) => "WSD",
        }
    }

    /// From `--lr-decay-style` and `--lr-wsd-decay-style`.
    pub fn parse(style: &str, wsd: &str) -> Option<DecayStyle> {
        Some(match style {
            "constant" => DecayStyle::Constant,
            "linear" => DecayStyle::Linear,
            "cosine" => DecayStyle::Cosine,
            "inverse-square-root" => DecayStyle::InverseSquareRoot,
            "WSD" => DecayStyle::Wsd(match wsd {
                "exponential" => WsdStyle::Exponential,
                "linear" => WsdStyle::Linear,
                "cosine" => WsdStyle::Cosine,
                "minus_sqrt" => WsdStyle::MinusSqrt,
                _ => return None,
            }),
            _ => return None,
        })
    }
}

/// How weight decay moves from `start_wd` to `end_wd` (`--weight-decay-incr-style`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WdStyle {
    /// Always `end_wd` (= `start_wd`).
    Constant,
    /// Linearly.
    Linear,
    /// Along half a cosine.
    Cosine,
}

impl WdStyle {
    /// Megatron's name.
    pub fn name(self) -> &'static str {
        match self {
            WdStyle::Constant => "constant",
            WdStyle::Linear => "linear",
            WdStyle::Cosine => "cosine",
        }
    }
}

/// An invalid schedule (Megatron's constructor asserts).
#[derive(Debug, thiserror::Error)]
#[error("learning-rate schedule: {0}")]
pub struct ScheduleError(pub String);

/// The schedule's settings, all lengths in samples.
#[derive(Debug, Clone, PartialEq)]
pub struct Schedule {
    /// `--lr-warmup-init`.
    pub init_lr: f64,
    /// `--lr`.
    pub max_lr: f64,
    /// `--min-lr`.
    pub min_lr: f64,
    /// Warmup length (a float when given as `--lr-warmup-fraction`).
    pub warmup_steps: f64,
    /// Decay length.
    pub decay_steps: u64,
    /// Decay style.
    pub decay_style: DecayStyle,
    /// WSD: length of the final anneal.
    pub wsd_decay_steps: Option<u64>,
    /// Weight decay at the start / end.
    pub start_wd: f64,
    /// Weight decay at the end.
    pub end_wd: f64,
    /// Length of the weight-decay change.
    pub wd_incr_steps: u64,
    /// Its style.
    pub wd_style: WdStyle,
}

impl Schedule {
    /// Check it as Megatron's constructor does.
    pub fn validate(&self) -> Result<(), ScheduleError> {
        let fail = |m: String| Err(ScheduleError(m));
        if self.min_lr < 0.0 || self.max_lr < self.min_lr || self.init_lr > self.max_lr {
            return fail(format!(
                "need 0 ≤ --min-lr ({}) ≤ --lr ({}) and --lr-warmup-init ({}) ≤ --lr",
                self.min_lr, self.max_lr, self.init_lr
            ));
        }
        if self.decay_steps == 0 || self.warmup_steps >= self.decay_steps as f64 {
            return fail(format!(
                "warmup ({} samples) must be shorter than decay ({} samples)",
                self.warmup_steps, self.decay_steps
            ));
        }
        if matches!(self.decay_style, DecayStyle::Wsd(_)) && self.wsd_decay_steps.is_none() {
            return fail("WSD needs --lr-wsd-decay-iters or --lr-wsd-decay-samples".into());
        }
        if self.start_wd < 0.0 || self.end_wd < self.start_wd {
            return fail(format!(
                "need 0 ≤ start weight decay ({}) ≤ end ({})",
                self.start_wd, self.end_wd
            ));
        }
        Ok(())
    }

    /// The learning rate after `steps` samples (`get_lr` with the group's max/min lr).
    pub fn lr(&self, steps: u64) -> f64 {
        let (max_lr, min_lr, warmup) = (self.max_lr, self.min_lr, self.warmup_steps);
        let n = steps as f64;
        if warmup > 0.0 && n <= warmup {
            return self.init_lr + (max_lr - self.init_lr) * n / warmup;
        }
        if self.decay_style == DecayStyle::Constant {
            return max_lr;
        }
        if steps > self.decay_steps {
            return min_lr;
        }
        if self.decay_style == DecayStyle::InverseSquareRoot {
            let lr = max_lr * warmup.max(1.0).sqrt() / n.max(1.0).sqrt();
            return min_lr.max(lr);
        }
        let ratio = (n - warmup) / (self.decay_steps as f64 - warmup);
        let coeff = match self.decay_style {
            DecayStyle::Linear => 1.0 - ratio,
            DecayStyle::Cosine => 0.5 * ((std::f64::consts::PI * ratio).cos() + 1.0),
            DecayStyle::Wsd(style) => {
                let anneal = self.wsd_decay_steps.unwrap_or(0);
                let start = self.decay_steps.saturating_sub(anneal);
                if steps <= start {
                    1.0
                } else {
                    let r = (steps - start) as f64 / anneal as f64;
                    match style {
                        WsdStyle::Linear => 1.0 - r,
                        WsdStyle::Cosine => 0.5 * ((std::f64::consts::PI * r).cos() + 1.0),
                        WsdStyle::Exponential => 2.0 * 0.5f64.powf(r) - 1.0,
                        WsdStyle::MinusSqrt => 1.0 - r.sqrt(),
                    }
                }
            }
            DecayStyle::Constant | DecayStyle::InverseSquareRoot => unreachable!("returned above"),
        };
        min_lr + coeff * (max_lr - min_lr)
    }

    /// The weight decay after `steps` samples (`get_wd`).
    pub fn wd(&self, steps: u64) -> f64 {
        if steps > self.wd_incr_steps || self.wd_style == WdStyle::Constant {
            return self.end_wd;
        }
        let ratio = steps as f64 / self.wd_incr_steps as f64;
        let coeff = match self.wd_style {
            WdStyle::Linear => ratio,
            WdStyle::Cosine => 0.5 * ((std::f64::consts::PI * (1.0 - ratio)).cos() + 1.0),
            WdStyle::Constant => unreachable!("returned above"),
        };
        self.start_wd + coeff * (self.end_wd - self.start_wd)
    }

    /// The `opt_param_scheduler` entry of a Megatron checkpoint after `num_steps` samples
    /// (`state_dict`, keys in Megatron's order; warmup is an int unless it came from a
    /// fraction).
    pub fn state_dict(&self, num_steps: u64) -> Value {
        let warmup = if self.warmup_steps.fract() == 0.0 {
            json!(self.warmup_steps as u64)
        } else {
            json!(self.warmup_steps)
        };
        json!({
            "max_lr": self.max_lr,
            "lr_warmup_steps": warmup,
            "num_steps": num_steps,
            "lr_decay_style": self.decay_style.name(),
            "lr_decay_steps": self.decay_steps,
            "min_lr": self.min_lr,
            "start_wd": self.start_wd,
            "end_wd": self.end_wd,
            "wd_incr_style": self.wd_style.name(),
            "wd_incr_steps": self.wd_incr_steps,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schedule(style: DecayStyle) -> Schedule {
        Schedule {
            init_lr: 0.0,
            max_lr: 1e-3,
            min_lr: 1e-5,
            warmup_steps: 40.0,
            decay_steps: 200,
            decay_style: style,
            wsd_decay_steps: Some(80),
            start_wd: 0.1,
            end_wd: 0.1,
            wd_incr_steps: 200,
            wd_style: WdStyle::Constant,
        }
    }

    #[test]
    fn warmup_then_each_decay_style() {
        let s = schedule(DecayStyle::Cosine);
        assert_eq!(s.lr(0), 0.0);
        assert!((s.lr(20) - 5e-4).abs() < 1e-15);
        assert_eq!(s.lr(40), 1e-3);
        assert!((s.lr(120) - (1e-5 + 0.5 * (1e-3 - 1e-5))).abs() < 1e-15);
        assert_eq!(s.lr(200), 1e-5);
        assert_eq!(s.lr(201), 1e-5);
        let l = schedule(DecayStyle::Linear);
        assert!((l.lr(120) - (1e-5 + 0.5 * (1e-3 - 1e-5))).abs() < 1e-15);
        assert_eq!(schedule(DecayStyle::Constant).lr(1000), 1e-3);
        let isr = schedule(DecayStyle::InverseSquareRoot);
        assert!((isr.lr(160) - 1e-3 * 0.5).abs() < 1e-15);
        let w = schedule(DecayStyle::Wsd(WsdStyle::Linear));
        assert_eq!(w.lr(120), 1e-3);
        assert!((w.lr(160) - (1e-5 + 0.5 * (1e-3 - 1e-5))).abs() < 1e-15);
        assert!(schedule(DecayStyle::Linear).validate().is_ok());
        let mut bad = schedule(DecayStyle::Linear);
        bad.warmup_steps = 200.0;
        assert!(bad.validate().is_err());
    }
}
