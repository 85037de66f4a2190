//! The auxiliary losses of an MoE layer in training, on the host, as megatron-core 0.15
//! computes them (megatron/core/transformer/moe/router.py `TopKRouter.routing`, moe_utils.py
//! `switch_load_balancing_loss_func`, `z_loss_func`, `compute_routing_scores_for_aux_loss`):
//! their values (as its tracker records them, the loss over its coefficient) and the gradient
//! they add to the router's logits (`MoEAuxLossAutoScaler`: the loss's gradient is the main
//! loss's backward scale).
//!
//! Legend: N = all ranks' rows of the micro-batch, T = this rank's (N / TP under sequence
//! parallelism), E = experts, k = top-k.

use crate::arch::moe::{route, sigmoid, softmax, Moe, ScoreFunction};

/// Megatron's `--moe-router-load-balancing-type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Balancing {
    /// `none`: no load-balancing loss.
    None,
    /// `aux_loss`: the Switch Transformer's, over the micro-batch.
    Aux,
    /// `seq_aux_loss`: the same per sequence, averaged over the sequences.
    SeqAux,
    /// MindSpeed-LLM's `--seq-aux` with `none` (mindspeed_llm/core/transformer/moe/router.py
    /// `apply_seq_aux_loss`): DeepSeek-V3's complementary sequence-wise loss, counted on the
    /// experts the routing chose (expert bias and groups included) and scored by the scores
    /// plus the expert bias, normalised; not logged (its tracker names only `aux_loss` types).
    SeqComplementary,
}

impl Balancing {
    /// The tracker's name of its loss.
    pub fn name(self) -> Option<&'static str> {
        match self {
            Balancing::None | Balancing::SeqComplementary => None,
            Balancing::Aux => Some("load_balancing_loss"),
            Balancing::SeqAux => Some("seq_load_balancing_loss"),
        }
    }
}

/// The MoE layers' auxiliary losses in training.
#[derive(Debug, Clone, PartialEq)]
pub struct AuxLosses {
    /// The load-balancing loss.
    pub balancing: Balancing,
    /// `--moe-aux-loss-coeff`.
    pub aux_coeff: f32,
    /// `--moe-z-loss-coeff`.
    pub z_coeff: Option<f32>,
    /// The main loss's backward scale, which the auxiliary losses' gradients take: 1 / the
    /// micro-batches of a step, or with `--calculate-per-token-loss` 1 with each loss
    /// multiplied by the layer's rows (megatron-core schedules.py `forward_step_calc_loss`,
    /// router.py `attach_and_log_load_balancing_loss`).
    pub per_token: bool,
    /// Micro-batches per step.
    pub micro_batches: usize,
    /// Sequences in a micro-batch, each of `N / sequences` rows in order (`seq_aux_loss`).
    pub sequences: usize,
}

/// `log Σ exp(l)`, from the largest term.
fn logsumexp(l: &[f32]) -> f32 {
    let max = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    max + l.iter().map(|&x| (x - max).exp()).sum::<f32>().ln()
}

/// One MoE layer's auxiliary loss values of a forward pass, as the tracker records them (the
/// loss over its coefficient; this rank's part under sequence parallelism).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LossValues {
    /// The load-balancing loss (of [`AuxLosses::balancing`]).
    pub balancing: Option<f32>,
    /// The z-loss.
    pub z: Option<f32>,
}

/// What a training forward pass of one MoE layer tells the trainer.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RouterStats {
    /// The auxiliary losses' values.
    pub losses: LossValues,
    /// With an expert bias, the tokens this rank's rows sent to each expert `[E]` (megatron-core
    /// router.py `local_tokens_per_expert`), from which the bias moves after the step.
    pub tokens: Option<Vec<f32>>,
}

/// The scores the load-balancing loss reads (softmax, or sigmoids plus `offset` normalised to
/// sum 1).
fn loss_scores(score: ScoreFunction, logits: &[f32], offset: Option<&[f32]>) -> Vec<f32> {
    match score {
        ScoreFunction::Softmax => softmax(logits),
        ScoreFunction::Sigmoid => {
            let s: Vec<f32> = (logits.iter().enumerate())
                .map(|(e, &x)| sigmoid(x) + offset.map_or(0.0, |o| o[e]))
                .collect();
            let sum = s.iter().sum::<f32>() + 1e-20;
            s.iter().map(|&x| x / sum).collect()
        }
    }
}

/// The [`loss_scores`] of megatron-core's losses and the experts an unbiased top-k picks from
/// them (`compute_routing_scores_for_aux_loss`).
fn aux_scores(score: ScoreFunction, logits: &[f32], topk: usize) -> (Vec<f32>, Vec<usize>) {
    let scores = loss_scores(score, logits, None);
    let mut idx: Vec<usize> = (0..scores.len()).collect();
    idx.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    idx.truncate(topk);
    (scores, idx)
}

/// `dlogits` of a row given the gradient `ds` of its [`loss_scores`] with `offset`.
fn scores_grad(
    score: ScoreFunction,
    logits: &[f32],
    (scores, offset): (&[f32], Option<&[f32]>),
    ds: &[f32],
) -> Vec<f32> {
    match score {
        ScoreFunction::Softmax => {
            let dot: f32 = scores.iter().zip(ds).map(|(s, d)| s * d).sum();
            scores.iter().zip(ds).map(|(s, d)| s * (d - dot)).collect()
        }
        ScoreFunction::Sigmoid => {
            // scores = (σ + o) / (Σ(σ + o) + ε): dσ_e = (ds_e − Σ_j ds_j·scores_j) / (Σ(σ + o) + ε).
            let sig: Vec<f32> = logits.iter().map(|&x| sigmoid(x)).collect();
            let sum = sig.iter().sum::<f32>() + offset.map_or(0.0, |o| o.iter().sum()) + 1e-20;
            let dot: f32 = scores.iter().zip(ds).map(|(s, d)| s * d).sum();
            (sig.iter().zip(ds))
                .map(|(&s, &d)| (d - dot) / sum * s * (1.0 - s))
                .collect()
        }
    }
}

/// The values and this rank's rows' logit gradient `[T·E]` of the auxiliary losses of one MoE
/// layer, given the logits of all N rows (row-major), which rows are this rank's and the
/// router's expert bias.
pub(super) fn aux_losses(
    moe: &Moe,
    aux: &AuxLosses,
    logits: &[f32],
    (local, bias): (std::ops::Range<usize>, Option<&[f32]>),
    tp: usize,
) -> (LossValues, Vec<f32>) {
    let (e, k) = (moe.router_width(), moe.topk);
    let n = logits.len() / e;
    let t = local.len();
    let scale = if aux.per_token {
        t as f32
    } else {
        1.0 / aux.micro_batches as f32
    };
    let mut grad = vec![0f32; t * e];
    let mut values = LossValues::default();
    if let Some(coeff) = aux.z_coeff {
        // z = coeff / TP · mean over this rank's rows of logsumexp²: summed over the ranks,
        // the mean over all rows, whichever rows each holds.
        let c = coeff / tp as f32;
        for (i, row) in local.clone().enumerate() {
            let l = &logits[row * e..(row + 1) * e];
            let lse = logsumexp(l);
            let p = softmax(l);
            for (g, p) in grad[i * e..(i + 1) * e].iter_mut().zip(p) {
                *g += scale * c * 2.0 * lse * p / t as f32;
            }
        }
        // The tracker holds z over that coefficient, and megatron-core tracks it with no
        // reduce group: each rank's value is over its own sequence-parallel rows, which are
        // a block of positions of every sequence (Megatron's [S, B] activations split along
        // S), not this rank's rows here (whole sequences one after the other).
        let rows = super::megatron_block(n, aux.sequences, (local.start / t.max(1), tp));
        let sum: f32 = (rows.iter())
            .map(|&r| logsumexp(&logits[r * e..(r + 1) * e]).powi(2))
            .sum();
        values.z = Some(sum / rows.len().max(1) as f32);
    }
    if aux.balancing == Balancing::None || aux.aux_coeff == 0.0 {
        return (values, grad);
    }
    // Tokens per expert (per sequence for the sequence-wise losses) over all N rows.
    let groups = match aux.balancing {
        Balancing::SeqAux | Balancing::SeqComplementary => aux.sequences.max(1),
        _ => 1,
    };
    let rows_per_group = n / groups;
    let mut per_expert = vec![0f32; groups * e];
    let offset = bias.filter(|_| aux.balancing == Balancing::SeqComplementary);
    let scored: Vec<(Vec<f32>, Vec<usize>)> = (0..n)
        .map(|r| {
            let l = &logits[r * e..(r + 1) * e];
            match aux.balancing {
                Balancing::SeqComplementary => (
                    loss_scores(moe.score, l, offset),
                    route(moe, l, bias).experts,
                ),
                _ => aux_scores(moe.score, l, k),
            }
        })
        .collect();
    for (r, (_, chosen)) in scored.iter().enumerate() {
        for &x in chosen {
            per_expert[(r / rows_per_group) * e + x] += 1.0;
        }
    }
    // switch_load_balancing_loss_func: Σ_e P_e·f_e · E·coeff / (k·N_g²), / sequences.
    let c = e as f32 * aux.aux_coeff
        / (k as f32 * (rows_per_group * rows_per_group) as f32)
        / groups as f32;
    let mut loss = 0f32;
    for (i, row) in local.enumerate() {
        let (scores, _) = &scored[row];
        let f = &per_expert[(row / rows_per_group) * e..][..e];
        loss += scores.iter().zip(f).map(|(s, f)| s * f).sum::<f32>() * c;
        let ds: Vec<f32> = f.iter().map(|&f| f * c * scale).collect();
        let d = scores_grad(
            moe.score,
            &logits[row * e..(row + 1) * e],
            (scores, offset),
            &ds,
        );
        grad[i * e..(i + 1) * e]
            .iter_mut()
            .zip(d)
            .for_each(|(g, d)| *g += d);
    }
    values.balancing = Some(loss / aux.aux_coeff);
    (values, grad)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn moe(score: ScoreFunction) -> Moe {
        crate::arch::moe::example(score, false)
    }

    /// Each loss's logit gradient against central differences of its value.
    #[test]
    fn auxiliary_loss_gradients_match_finite_differences() {
        let logits: Vec<f32> = (0..24).map(|i| ((i * 7 % 11) as f32 - 5.0) * 0.3).collect();
        let bias = [0.05, -0.02, 0.1, 0.0];
        for score in [ScoreFunction::Softmax, ScoreFunction::Sigmoid] {
            for (balancing, z) in [
                (Balancing::Aux, None),
                (Balancing::SeqAux, None),
                (Balancing::SeqComplementary, None),
                (Balancing::None, Some(0.1)),
            ] {
                let m = moe(score);
                let aux = AuxLosses {
                    balancing,
                    aux_coeff: 0.01,
                    z_coeff: z,
                    per_token: false,
                    micro_batches: 1,
                    sequences: 2,
                };
                let total = |l: &[f32]| -> f64 {
                    let (v, _) = aux_losses(&m, &aux, l, (0..6, Some(&bias)), 1);
                    f64::from(v.balancing.unwrap_or(0.0) * aux.aux_coeff)
                        + f64::from(v.z.unwrap_or(0.0) * z.unwrap_or(0.0))
                };
                let (_, g) = aux_losses(&m, &aux, &logits, (0..6, Some(&bias)), 1);
                for i in 0..logits.len() {
                    let (mut up, mut down) = (logits.clone(), logits.clone());
                    up[i] += 1e-2;
                    down[i] -= 1e-2;
                    // The routing map is held fixed by the loss (tiny steps keep the choice).
                    let numeric = (total(&up) - total(&down)) / 2e-2;
                    assert!(
                        (numeric - f64::from(g[i])).abs() < 1e-4,
                        "{score:?} {balancing:?}: logit {i}: {numeric} vs {}",
                        g[i]
                    );
                }
            }
        }
    }
}
