//! AdamW over the parameter table, as Megatron runs it on one rank: two parameter groups
//! (weight decay, and none for biases and 1-D parameters), the global gradient norm and
//! Megatron's clip coefficient (megatron/core/optimizer/clip_grads.py), and with `--bf16` f32
//! main parameters that the bf16 model parameters are copied from after every step
//! (`Float16OptimizerWithFloat16Params`). With `--o2-optimizer` the moments are stored in bf16,
//! as MindSpeed-LLM's `O2AdamW` keeps them (MindSpeed-LLM
//! `mindspeed_llm/tasks/models/common/adamw.py`).

use crate::engine::{AdamWStep, Backend, Result};
use crate::model::params::ParamTable;
use crate::tensor::DType;

/// Adam's settings that do not change during training.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamConfig {
    /// β₁, β₂.
    pub betas: (f64, f64),
    /// ε.
    pub eps: f64,
    /// Global gradient-norm clip (0: none).
    pub clip_grad: f64,
    /// The dtype the moments are stored in: f32, or bf16 (`--o2-optimizer`).
    pub moments: DType,
}

impl AdamConfig {
    /// Megatron's clip coefficient for the global gradient norm `grad_norm`, 1 within the
    /// bound: each gradient is multiplied by it as its update reads it.
    pub fn clip_scale(&self, grad_norm: f64) -> f32 {
        let clip = self.clip_grad;
        let coeff = clip / (grad_norm + 1e-6);
        if clip > 0.0 && coeff < 1.0 {
            coeff as f32
        } else {
            1.0
        }
    }
}

/// The optimizer's state.
pub struct Optimizer<T> {
    /// f32 main parameters when the model's are bf16 (`--bf16`).
    pub main: Option<Vec<T>>,
    /// First moments, one per parameter.
    pub exp_avg: Vec<T>,
    /// Second moments.
    pub exp_avg_sq: Vec<T>,
    /// Steps taken (torch's per-parameter `step`; the same for every parameter).
    pub steps: u64,
    /// Which parameters are decayed.
    decay: Vec<bool>,
    /// Which parameters are trained (LoRA freezes the base).
    trainable: Vec<bool>,
    config: AdamConfig,
}

/// What one step did.
#[derive(Debug, Clone, Copy)]
pub struct StepReport {
    /// The gradient norm before clipping.
    pub grad_norm: f64,
    /// Whether the update was applied (a non-finite norm skips it).
    pub applied: bool,
}

impl<T> Optimizer<T> {
    /// A fresh optimizer for `params` (whose dtype decides whether main copies are kept).
    pub fn new<B: Backend<Tensor = T>>(
        b: &B,
        table: &ParamTable,
        params: &[T],
        trainable: Vec<bool>,
        config: AdamConfig,
    ) -> Result<Self> {
        // Frozen parameters (LoRA's base) keep no state: empty placeholders.
        let zeros =
            |(p, &t): (&T, &bool)| b.zeros(if t { b.shape(p) } else { &[0] }, config.moments);
        let main = match params.first().map(|p| b.dtype(p)) {
            Some(DType::F32) | None => None,
            Some(_) => Some(
                params
                    .iter()
                    .zip(&trainable)
                    .map(|(p, &t)| {
                        if t {
                            b.cast(p, DType::F32)
                        } else {
                            b.zeros(&[0], DType::F32)
                        }
                    })
                    .collect::<Result<_>>()?,
            ),
        };
        Ok(Optimizer {
            main,
            exp_avg: params
                .iter()
                .zip(&trainable)
                .map(zeros)
                .collect::<Result<_>>()?,
            exp_avg_sq: params
                .iter()
                .zip(&trainable)
                .map(zeros)
                .collect::<Result<_>>()?,
            steps: 0,
            decay: table.params.iter().map(|p| p.decay).collect(),
            trainable,
            config,
        })
    }

    /// Whether parameter `i` is trained.
    pub fn trains(&self, i: usize) -> bool {
        self.trainable[i]
    }

    /// Whether parameter `i` is weight-decayed.
    pub fn decays(&self, i: usize) -> bool {
        self.decay[i]
    }

    /// Its settings.
    pub fn config(&self) -> AdamConfig {
        self.config
    }

    /// Clip by `grad_norm` (the global gradient norm) and apply one AdamW step with
    /// learning rate `lr` and weight decay `wd` (the decay group's; the other group has none),
    /// leaving the trained parameters' `grads` zeroed.
    /// A non-finite gradient norm skips the update, as a Megatron grad scaler would.
    pub fn apply<B: Backend<Tensor = T>>(
        &mut self,
        b: &B,
        params: &mut [T],
        grads: &mut [T],
        grad_norm: f64,
        (lr, wd): (f64, f64),
        skip_non_finite: bool,
    ) -> Result<StepReport> {
        if !grad_norm.is_finite() && skip_non_finite {
            return Ok(StepReport {
                grad_norm,
                applied: false,
            });
        }
        let grad_scale = self.config.clip_scale(grad_norm);
        self.steps += 1;
        for i in 0..params.len() {
            if !self.trainable[i] {
                continue;
            }
            let step = AdamWStep {
                lr,
                betas: self.config.betas,
                eps: self.config.eps,
                weight_decay: if self.decay[i] { wd } else { 0.0 },
                step: self.steps,
                grad_scale,
            };
            let (m, v) = (&mut self.exp_avg[i], &mut self.exp_avg_sq[i]);
            // Moments stored in bf16 (O2AdamW's) step in f32 and are stored back rounded to
            // nearest even: `exp_avg.float()`, the f32 step, `exp_avgs[i].copy_(exp_avg)`.
            let mut wide = match b.dtype(m) {
                DType::F32 => None,
                _ => Some((b.cast(m, DType::F32)?, b.cast(v, DType::F32)?)),
            };
            let moments = match wide.as_mut() {
                Some((m, v)) => (m, v),
                None => (&mut *m, &mut *v),
            };
            match &mut self.main {
                None => b.adamw(&mut params[i], &mut grads[i], moments, step, None)?,
                Some(main) => b.adamw(
                    &mut main[i],
                    &mut grads[i],
                    moments,
                    step,
                    Some(&mut params[i]),
                )?,
            }
            if let Some((wide_m, wide_v)) = wide {
                b.copy_into(&wide_m, m)?;
                b.copy_into(&wide_v, v)?;
            }
        }
        Ok(StepReport {
            grad_norm,
            applied: true,
        })
    }
}
