//! MindSpeed-LLM's direct preference optimisation (`--stage dpo`,
//! mindspeed_llm/tasks/posttrain/dpo/dpo_trainer.py): a micro-batch of M pairs is 2M rows, the
//! chosen answers then the rejected ones; the policy (the model trained) and a frozen
//! reference (the weights it started from) each score every row, and the loss of a pair is a
//! function of how much more the policy prefers the chosen answer than the reference does.
//!
//! The model already computes each row's cross entropy, `-log p(label)`; a sequence's log
//! probability is minus their sum over its scored rows (`compute_log_probs`), so the pair loss's
//! gradient reaches the model as a gradient with respect to each row's loss ([`Dpo::score`]).

use anyhow::{bail, Result};

/// `--dpo-loss-type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DpoLoss {
    /// `-log σ(β z)` (label-smoothed by `--dpo-label-smoothing`).
    Sigmoid,
    /// `relu(1 - β z)`.
    Hinge,
    /// `(z - 1 / 2β)²` over the sequences' mean log probabilities.
    Ipo,
}

impl DpoLoss {
    /// MindSpeed-LLM's name.
    pub fn parse(name: &str) -> Result<DpoLoss> {
        Ok(match name {
            "sigmoid" => DpoLoss::Sigmoid,
            "hinge" => DpoLoss::Hinge,
            "ipo" => DpoLoss::Ipo,
            other => bail!("--dpo-loss-type {other}: expected sigmoid, hinge or ipo"),
        })
    }
}

/// The DPO objective's settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Dpo {
    /// `--dpo-loss-type`.
    pub loss: DpoLoss,
    /// `--dpo-beta`.
    pub beta: f64,
    /// `--dpo-label-smoothing` (sigmoid only).
    pub label_smoothing: f64,
    /// `--pref-ftx`: the weight of the chosen answers' mean negative log likelihood.
    pub ftx: f64,
}

/// One micro-batch's DPO loss, reward accuracy, and the gradient of the step's objective with
/// respect to each row's cross entropy.
#[derive(Debug, Clone)]
pub struct Scored {
    /// The mean pair loss (`losses.mean()`, the logged `lm loss`).
    pub loss: f64,
    /// The share of pairs whose chosen reward exceeds the rejected one
    /// (`rewards/accuracies`).
    pub accuracy: f64,
    /// `[T]` the objective's gradient with respect to each row's loss.
    pub dloss: Vec<f32>,
}

/// `log σ(x)`, without overflow.
fn log_sigmoid(x: f64) -> f64 {
    match x >= 0.0 {
        true => -(-x).exp().ln_1p(),
        false => x - x.exp().ln_1p(),
    }
}

fn sigmoid(x: f64) -> f64 {
    log_sigmoid(x).exp()
}

impl Dpo {
    /// A micro-batch of `pairs` pairs (`2·pairs` sequences of equal length, the chosen first)
    /// from each row's cross entropy under the policy and under the reference and its loss mask;
    /// the step has `micro_batches` micro-batches in all (each weighs 1/K, as Megatron divides
    /// a micro-batch's loss by their number).
    pub fn score(
        &self,
        (policy, reference): (&[f32], &[f32]),
        mask: &[f32],
        pairs: usize,
        micro_batches: usize,
    ) -> Scored {
        let len = mask.len() / (2 * pairs).max(1);
        let rows = |s: usize| s * len..(s + 1) * len;
        // a sequence's log probability: its scored rows' -loss summed (averaged for IPO)
        let counts: Vec<f64> = (0..2 * pairs)
            .map(|s| mask[rows(s)].iter().map(|&m| f64::from(m)).sum())
            .collect();
        let per_row = |s: usize| match self.loss {
            DpoLoss::Ipo => 1.0 / counts[s].max(1.0),
            _ => 1.0,
        };
        let log_prob = |loss: &[f32], s: usize| {
            let sum: f64 = rows(s).map(|r| f64::from(mask[r] * loss[r])).sum();
            -sum * per_row(s)
        };
        let scale = 1.0 / (pairs * micro_batches.max(1)) as f64;
        let mut dloss = vec![0f32; mask.len()];
        let (mut total, mut right) = (0.0, 0usize);
        for i in 0..pairs {
            let (c, r) = (i, pairs + i);
            let (pc, pr) = (log_prob(policy, c), log_prob(policy, r));
            let (rc, rr) = (log_prob(reference, c), log_prob(reference, r));
            let z = (pc - pr) - (rc - rr);
            let (loss, dz) = self.pair_loss(z);
            // the supervised term: the chosen answer's mean negative log likelihood
            let n = counts[c].max(1.0);
            total += loss - self.ftx * pc / n;
            right += usize::from(self.beta * (pc - rc) > self.beta * (pr - rr));
            // d objective / d log p of each sequence, then / d row loss = -mask · per_row
            let d_chosen = (dz - self.ftx / n) * scale;
            let d_rejected = -dz * scale;
            for (s, d) in [(c, d_chosen), (r, d_rejected)] {
                for row in rows(s) {
                    dloss[row] = (-d * per_row(s) * f64::from(mask[row])) as f32;
                }
            }
        }
        Scored {
            loss: total / pairs.max(1) as f64,
            accuracy: right as f64 / pairs.max(1) as f64,
            dloss,
        }
    }

    /// A pair's loss at margin `z` and its derivative in `z`.
    fn pair_loss(&self, z: f64) -> (f64, f64) {
        let b = self.beta;
        match self.loss {
            DpoLoss::Sigmoid => {
                let e = self.label_smoothing;
                let loss = -log_sigmoid(b * z) * (1.0 - e) - log_sigmoid(-b * z) * e;
                (
                    loss,
                    -b * (1.0 - e) * sigmoid(-b * z) + b * e * sigmoid(b * z),
                )
            }
            // torch's relu passes no gradient at 0
            DpoLoss::Hinge => match 1.0 - b * z {
                m if m > 0.0 => (m, -b),
                _ => (0.0, 0.0),
            },
            DpoLoss::Ipo => {
                let d = z - 1.0 / (2.0 * b);
                (d * d, 2.0 * d)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The objective of `score` recomputed from the rows' losses alone.
    fn objective(dpo: &Dpo, policy: &[f32], reference: &[f32], mask: &[f32], pairs: usize) -> f64 {
        dpo.score((policy, reference), mask, pairs, 3).loss / 3.0
    }

    #[test]
    fn the_row_gradient_is_the_derivative_of_the_pair_losses() {
        let pairs = 2;
        let mask = [0., 1., 1., 0., 1., 1., 1., 0., 0., 1., 1., 1.];
        let policy: Vec<f32> = (0..12).map(|i| 0.3 + 0.17 * i as f32).collect();
        let reference: Vec<f32> = (0..12).map(|i| 0.9 - 0.05 * i as f32).collect();
        for loss in [DpoLoss::Sigmoid, DpoLoss::Hinge, DpoLoss::Ipo] {
            let dpo = Dpo {
                loss,
                beta: 0.5,
                label_smoothing: if loss == DpoLoss::Sigmoid { 0.1 } else { 0.0 },
                ftx: 0.2,
            };
            let scored = dpo.score((&policy, &reference), &mask, pairs, 3);
            for r in 0..mask.len() {
                let at = |d: f32| {
                    let mut p = policy.clone();
                    p[r] += d;
                    objective(&dpo, &p, &reference, &mask, pairs)
                };
                let numeric = (at(1e-2) - at(-1e-2)) / 2e-2;
                let analytic = f64::from(scored.dloss[r]);
                assert!(
                    (numeric - analytic).abs() < 1e-4,
                    "{loss:?} row {r}: {analytic} vs finite difference {numeric}"
                );
            }
        }
    }

    #[test]
    fn a_pair_the_policy_prefers_more_than_the_reference_lowers_the_sigmoid_loss() {
        let dpo = Dpo {
            loss: DpoLoss::Sigmoid,
            beta: 0.1,
            label_smoothing: 0.0,
            ftx: 0.0,
        };
        let mask = [1.0f32; 2];
        // equal preference: log 2, no accuracy
        let even = dpo.score((&[1.0, 1.0], &[1.0, 1.0]), &mask, 1, 1);
        assert!((even.loss - std::f64::consts::LN_2).abs() < 1e-12);
        assert_eq!(even.accuracy, 0.0);
        // the policy makes the chosen answer likelier (lower loss) than the reference does
        let better = dpo.score((&[0.5, 1.0], &[1.0, 1.0]), &mask, 1, 1);
        assert!(better.loss < even.loss);
        assert_eq!(better.accuracy, 1.0);
        assert!((better.loss - (-log_sigmoid(0.05))).abs() < 1e-12);
    }
}
