//! SparseMixer-v2's top-2 routing (Phi-3.5-MoE; MindSpeed-LLM's `--moe-router-load-balancing-type
//! sparsemixer_topk`, mindspeed_llm/core/transformer/moe/router.py `sparsemixer_top2` and
//! `custom_multiplier`; transformers' models/phimoe/modeling_phimoe.py `sparsemixer`).
//!
//! Each of two slots takes a softmax over the experts whose logit lies within a relative 2ε of
//! the best one left (the first slot's expert out of the second's running): outside training
//! it chooses that best expert, in training it samples one from the softmax (Gumbel-max) and
//! keeps its weight whole when it is the best or a coin lands above 0.75, a third of it
//! otherwise (Heun's third-order midpoint). The weight's gradient flows to the logits through
//! the slot's softmax at the chosen expert, never through the coin's factor.
//!
//! The random draws are the caller's: mindkit's own, keyed by the token's place
//! ([`crate::engine::dropout::router_uniforms`]), not torch's generator.

use super::{softmax, topk, Routed};

/// SparseMixer's ε (MindSpeed-LLM calls `sparsemixer_top2` with its default 0.01; transformers
/// passes `router_jitter_noise`, 0.01 in Phi-3.5-MoE's config).
pub const EPS: f32 = 0.01;

/// The uniform draws one token's routing takes in training: for each slot one per expert
/// (Gumbel noise) and the coin.
pub fn draws(experts: usize) -> usize {
    2 * (experts + 1)
}

/// A slot's softmax over the experts within `2ε` (relative) of the best logit left: `logits`
/// with `excluded` (the first slot's choice) and every expert below the threshold masked out
/// (router.py: `(max − s) / max(|s|, max) > 2ε`, the threshold from the logits left, the
/// comparison against every logit).
fn gates(logits: &[f32], excluded: Option<usize>) -> (Vec<f32>, Vec<f32>) {
    let out = |e: usize| Some(e) == excluded;
    let best = (logits.iter().enumerate())
        .filter(|(e, _)| !out(*e))
        .map(|(_, &s)| s)
        .fold(f32::NEG_INFINITY, f32::max);
    let masked: Vec<f32> = (logits.iter().enumerate())
        .map(|(e, &s)| {
            let far = (best - s) / s.abs().max(best) > 2.0 * EPS;
            if out(e) || far {
                f32::NEG_INFINITY
            } else {
                s
            }
        })
        .collect();
    (softmax(&masked), masked)
}

/// The route of one token with router `logits` (f32): outside training (`draws` None) each
/// slot's best expert, its softmax weight; in training each slot's expert sampled with its
/// `E` uniform draws in (0, 1) and weighed by its coin (the slot's `E + 1`-th draw).
pub fn route(logits: &[f32], draws: Option<&[f32]>) -> Routed {
    let n = logits.len();
    let mut routed = Routed {
        experts: Vec::with_capacity(2),
        weights: Vec::with_capacity(2),
    };
    for slot in 0..2 {
        let (gates, masked) = gates(logits, routed.experts.first().copied());
        let best = topk(&gates, 1)[0];
        let (chosen, factor) = match draws {
            None => (best, 1.0),
            Some(u) => {
                let u = &u[slot * (n + 1)..(slot + 1) * (n + 1)];
                // Gumbel-max: argmax of the masked logits minus the log of Exp(1) draws
                let keys: Vec<f32> = (masked.iter().zip(u))
                    .map(|(&s, &u)| s - (-u.ln()).ln())
                    .collect();
                let chosen = topk(&keys, 1)[0];
                let whole = chosen == best || u[n] > 0.75;
                // torch.add(0.3333, mask, alpha=0.6667)
                (chosen, 0.3333f32 + f32::from(u8::from(whole)) * 0.6667f32)
            }
        };
        routed.experts.push(chosen);
        routed.weights.push(gates[chosen] * factor);
    }
    routed
}

/// The gradient of one token's router `logits` given the gradient `dweights` of its weights
/// ([`route`]'s): each slot's softmax derivative at its expert, scaled by the softmax value
/// there (`custom_multiplier.backward`: `g·p_e·(1[e] − p)`), whatever the coin gave.
pub fn route_grad(logits: &[f32], routed: &Routed, dweights: &[f32]) -> Vec<f32> {
    let mut dlogits = vec![0f32; logits.len()];
    for (slot, (&e, &dw)) in routed.experts.iter().zip(dweights).enumerate() {
        let excluded = (slot == 1).then(|| routed.experts[0]);
        let (gates, _) = gates(logits, excluded);
        let g = dw * gates[e];
        for (i, (d, &p)) in dlogits.iter_mut().zip(&gates).enumerate() {
            *d += g * (f32::from(u8::from(i == e)) - p);
        }
    }
    dlogits
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOGITS: [f32; 5] = [1.0, 1.015, -0.3, 0.9999, 0.2];

    #[test]
    fn outside_training_each_slot_takes_the_best_expert_of_its_thresholded_softmax() {
        let r = route(&LOGITS, None);
        assert_eq!(r.experts, vec![1, 0]);
        // slot 1: experts 0 and 3 lie within 2% of 1.015 (0.0148 and 0.0149 relative), the
        // rest beyond; slot 2 (expert 1 out): 0 and 3 within 2% of 1.0
        let e = |x: f32| x.exp();
        let first = e(1.015) / (e(1.0) + e(1.015) + e(0.9999));
        let second = e(1.0) / (e(1.0) + e(0.9999));
        assert!((r.weights[0] - first).abs() < 1e-6, "{r:?}");
        assert!((r.weights[1] - second).abs() < 1e-6, "{r:?}");
    }

    #[test]
    fn training_samples_by_gumbel_and_weighs_by_the_coin() {
        // draws that favour expert 3 in slot 1 (not its best: a third of its weight unless the
        // coin says whole) and expert 0 in slot 2 (its best)
        let mut u = vec![0.5f32; draws(5)];
        u[3] = 0.999;
        u[5] = 0.5;
        u[6] = 0.999;
        u[11] = 0.9;
        let r = route(&LOGITS, Some(&u));
        assert_eq!(r.experts, vec![3, 0]);
        let plain = route(&LOGITS, None);
        let (g1, _) = gates(&LOGITS, None);
        assert!((r.weights[0] - g1[3] * 0.3333).abs() < 1e-7, "{r:?}");
        assert_eq!(r.weights[1], gates(&LOGITS, Some(3)).0[0]);
        assert_ne!(plain.experts, r.experts);
    }

    #[test]
    fn the_gradient_is_the_slot_softmax_derivative_at_the_choice() {
        // without the coin, weight = softmax at the chosen expert of the masked logits: its
        // finite difference within the mask (masks do not move for small steps here)
        let logits = [0.50f32, 0.505, 0.499, -1.0];
        let r = route(&logits, None);
        let dw = [0.7f32, -0.4];
        let grad = route_grad(&logits, &r, &dw);
        let f = |l: &[f32]| -> f64 {
            let w = [
                gates(l, None).0[r.experts[0]],
                gates(l, Some(r.experts[0])).0[r.experts[1]],
            ];
            (w[0] * dw[0] + w[1] * dw[1]) as f64
        };
        for i in 0..logits.len() {
            let (mut up, mut down) = (logits, logits);
            up[i] += 1e-4;
            down[i] -= 1e-4;
            let fd = (f(&up) - f(&down)) / 2e-4;
            assert!(
                (fd - grad[i] as f64).abs() < 2e-3,
                "{i}: {fd} vs {}",
                grad[i]
            );
        }
    }
}
