//! Mixture of experts as data: how many experts, how a token picks them (the router's score
//! function and top-k rule, megatron-core megatron/core/transformer/moe/moe_utils.py
//! `topk_routing_with_score_function`), which layers hold them, shared experts. The routing
//! itself, on the host, is [`route`]; SparseMixer's ([`sparsemixer`]) apart.

pub mod sparsemixer;

/// How the router turns logits into scores.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScoreFunction {
    /// Softmax over the experts (Qwen-MoE, Mixtral).
    Softmax,
    /// A sigmoid per expert, the chosen ones normalised (DeepSeek-V3).
    Sigmoid,
}

impl ScoreFunction {
    /// Megatron's `--moe-router-score-function` spelling.
    pub fn name(self) -> &'static str {
        match self {
            ScoreFunction::Softmax => "softmax",
            ScoreFunction::Sigmoid => "sigmoid",
        }
    }
}

/// The experts of a model's MoE layers.
#[derive(Debug, Clone, PartialEq)]
pub struct Moe {
    /// Routed experts per MoE layer (`--num-experts`).
    pub experts: usize,
    /// Zero-computation experts beside the routed ones (MindSpeed-LLM's `--num-zero-experts`,
    /// LongCat-Flash's `zero_expert_num`): router outputs `experts..experts + zero_experts`,
    /// each giving back its token's input times the routing weight
    /// (mindspeed_llm/tasks/models/transformer/zero_experts_moe_layer.py; transformers'
    /// `LongcatFlashMoE`'s identity experts).
    pub zero_experts: usize,
    /// Experts each token goes to (`--moe-router-topk`).
    pub topk: usize,
    /// One routed expert's intermediate size (`--moe-ffn-hidden-size`).
    pub ffn: usize,
    /// The shared experts' intermediate size, all of them together
    /// (`--moe-shared-expert-intermediate-size`); `None` without shared experts.
    pub shared_ffn: Option<usize>,
    /// A sigmoid gate `[1, h]` scales the shared experts' output (Qwen2-MoE's
    /// `shared_expert_gate`, MindSpeed-LLM's `--shared-expert-gate`).
    pub shared_gate: bool,
    /// The score function.
    pub score: ScoreFunction,
    /// Softmax over all experts before the top-k, the chosen scores used as they are
    /// (`--moe-router-pre-softmax`; Qwen-MoE's `norm_topk_prob: false`); else a softmax over the
    /// chosen logits, i.e. the chosen probabilities renormalised.
    pub pre_softmax: bool,
    /// Scale of the routing weights (`--moe-router-topk-scaling-factor`).
    pub topk_scale: Option<f64>,
    /// Group-limited routing: `(groups, groups kept)` (`--moe-router-num-groups`,
    /// `--moe-router-group-topk`).
    pub group_limit: Option<(usize, usize)>,
    /// Those groups are scored by their best expert alone (DeepSeek-V2's `topk_method`
    /// `group_limited_greedy`, MindSpeed-LLM's load-balancing type of that name), not by
    /// megatron-core's best `topk / groups kept`.
    pub group_by_best: bool,
    /// Which layers are MoE layers (the others dense), one entry per layer.
    pub layers: Vec<bool>,
    /// The router holds an expert bias `[E]` (f32), added to sigmoid scores for the choice of
    /// experts only and moved after each step towards balance (aux-loss-free balancing,
    /// `--moe-router-enable-expert-bias`).
    pub expert_bias: bool,
    /// A softmax router's expert bias is added to the softmax over all experts for the choice
    /// (MindSpeed-LLM's `softmax_topk`, LongCat-Flash). Otherwise such a bias is kept and moved
    /// but routes nothing, as MindSpeed-LLM's `topk_softmax_with_capacity` leaves it under
    /// megatron-core's own balancing types (MiniMax-M2.7's script; megatron-core itself refuses
    /// the pair, MindSpeed-LLM's `TransformerConfig` patch allows it).
    pub softmax_bias: bool,
    /// Sinkhorn balancing (`--moe-router-load-balancing-type sinkhorn`): in training each
    /// router call chooses its tokens' experts by the top-k of its Sinkhorn-normalised
    /// logits ([`sinkhorn_choice`]); the weights, and the choice outside training, are those
    /// of the score function above, which is then its activation (a softmax over all experts,
    /// a sigmoid at top-1).
    pub sinkhorn: bool,
    /// SparseMixer-v2's top-2 routing ([`sparsemixer`]; MindSpeed-LLM's `sparsemixer_topk`,
    /// Phi-3.5-MoE): the score function, pre-softmax, scaling and groups do not apply.
    pub sparsemixer: bool,
}

impl Moe {
    /// The router's outputs: the routed experts, then the zero-computation ones.
    pub fn router_width(&self) -> usize {
        self.experts + self.zero_experts
    }

    /// Whether layer `l` is an MoE layer; past the decoder (a multi-token prediction depth's
    /// layer) as the last decoder layer is (megatron-core gpt_layer_specs.py
    /// `get_gpt_mtp_block_spec_for_backend` builds it from `layer_specs[-1]`).
    pub fn is_moe_layer(&self, l: usize) -> bool {
        self.layers
            .get(l)
            .or(self.layers.last())
            .copied()
            .unwrap_or(false)
    }

    /// These experts as a [`crate::arch::ModelConfig::paired`] model's shortcut experts: the
    /// pattern over its files' layers becomes one over its decoder layers, each pair's first
    /// routing as its layer did.
    pub fn paired(mut self) -> Moe {
        self.layers = self.layers.iter().flat_map(|&m| [m, false]).collect();
        self
    }

    /// The layer pattern over the layers of its files, of `sublayers` decoder layers each (the
    /// inverse of [`Moe::paired`] at 2).
    pub fn stored_layers(&self, sublayers: usize) -> Vec<bool> {
        self.layers.iter().copied().step_by(sublayers).collect()
    }

    /// The layer pattern of Megatron's `--moe-layer-freq` (an int `k`: layers `l` with
    /// `l % k == 0`, as Python computes it, so `-1` is every layer; or the list itself) after
    /// MindSpeed-LLM's `--first-k-dense-replace` (layers below it dense; `-1` or less: none,
    /// mindspeed_llm/core/transformer/transformer_block.py `build_layer`).
    pub fn pattern(layers: usize, freq: &LayerFreq, first_dense: i64) -> Vec<bool> {
        (0..layers)
            .map(|l| {
                l as i64 >= first_dense
                    && match freq {
                        LayerFreq::Every(k) => *k != 0 && (l as i64) % k == 0,
                        LayerFreq::List(list) => list.get(l).is_some_and(|&x| x != 0),
                    }
            })
            .collect()
    }
}

/// Megatron's `--moe-layer-freq`.
#[derive(Debug, Clone, PartialEq)]
pub enum LayerFreq {
    /// Every `k`-th layer, from layer 0 (`k` negative as Python's modulo reads it).
    Every(i64),
    /// One entry per layer (1 = MoE).
    List(Vec<i64>),
}

/// The experts one token goes to and their weights, from its router logits (megatron-core
/// `topk_routing_with_score_function`, unfused, in f32; ties go to the lower expert index as
/// `torch.topk` returns them on the CPU).
#[derive(Debug, Clone, PartialEq)]
pub struct Routed {
    /// Expert indices, best first.
    pub experts: Vec<usize>,
    /// Their weights (probabilities after normalisation and scaling).
    pub weights: Vec<f32>,
}

/// Indices of the `k` largest values, largest first, the lower index first among equals.
pub(crate) fn topk(values: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..values.len()).collect();
    idx.sort_by(|&a, &b| values[b].total_cmp(&values[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

/// The logistic function.
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// A 4-expert top-2 configuration for tests.
#[cfg(test)]
pub(crate) fn example(score: ScoreFunction, pre_softmax: bool) -> Moe {
    Moe {
        experts: 4,
        zero_experts: 0,
        topk: 2,
        ffn: 8,
        shared_ffn: None,
        shared_gate: false,
        score,
        pre_softmax,
        topk_scale: None,
        group_limit: None,
        group_by_best: false,
        layers: vec![true],
        expert_bias: false,
        softmax_bias: false,
        sinkhorn: false,
        sparsemixer: false,
    }
}

/// `torch.softmax` of a row in f32.
pub fn softmax(x: &[f32]) -> Vec<f32> {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f32> = x.iter().map(|&v| (v - max).exp()).collect();
    let sum: f32 = e.iter().sum();
    e.iter().map(|&v| v / sum).collect()
}

/// The top-k of `scores` within the best groups (megatron-core `group_limited_topk`: a
/// group's score is the sum of its best `k / groups kept` experts' scores, or with `by_best`
/// its best expert's, transformers' `DeepseekV2MoEGate`; experts outside the chosen groups are
/// out of the running).
fn group_limited_topk(
    scores: &[f32],
    k: usize,
    (groups, keep): (usize, usize),
    by_best: bool,
) -> Vec<usize> {
    let per = scores.len() / groups;
    let scored = if by_best { 1 } else { k / keep };
    let group_scores: Vec<f32> = scores
        .chunks(per)
        .map(|g| topk(g, scored).iter().map(|&i| g[i]).sum())
        .collect();
    let chosen = topk(&group_scores, keep);
    let masked: Vec<f32> = (scores.iter().enumerate())
        .map(|(e, &s)| {
            if chosen.contains(&(e / per)) {
                s
            } else {
                f32::NEG_INFINITY
            }
        })
        .collect();
    topk(&masked, k)
}

/// Route one token given its router `logits [experts]` and, with an expert bias (aux-loss-free
/// balancing), the bias added to the scores for the choice only: to the sigmoid scores
/// (megatron-core), or to the softmax over all experts where [`Moe::softmax_bias`] says
/// (MindSpeed-LLM's `softmax_topk`, mindspeed_llm/core/transformer/moe/router.py
/// `topk_router_routing`; LongCat-Flash's router, transformers' `LongcatFlashTopkRouter`).
pub fn route(moe: &Moe, logits: &[f32], expert_bias: Option<&[f32]>) -> Routed {
    if moe.sparsemixer {
        return sparsemixer::route(logits, None);
    }
    let choose = |scores: &[f32]| match moe.group_limit {
        Some(g) => group_limited_topk(scores, moe.topk, g, moe.group_by_best),
        None => topk(scores, moe.topk),
    };
    let bias = match moe.score {
        ScoreFunction::Softmax => expert_bias.filter(|_| moe.softmax_bias),
        ScoreFunction::Sigmoid => expert_bias,
    };
    let biased = |scores: Vec<f32>| match bias {
        Some(bias) => scores.iter().zip(bias).map(|(s, b)| s + b).collect(),
        None => scores,
    };
    let experts = match moe.score {
        ScoreFunction::Softmax if moe.pre_softmax || bias.is_some() => {
            choose(&biased(softmax(logits)))
        }
        ScoreFunction::Softmax => choose(logits),
        ScoreFunction::Sigmoid => choose(&biased(logits.iter().map(|&x| sigmoid(x)).collect())),
    };
    weigh(moe, logits, experts)
}

/// The route of a token with router `logits` to the chosen `experts` (best first): their
/// weights as the score function gives them.
pub fn weigh(moe: &Moe, logits: &[f32], experts: Vec<usize>) -> Routed {
    let weights = match moe.score {
        ScoreFunction::Softmax if moe.pre_softmax => {
            let scores = softmax(logits);
            experts.iter().map(|&e| scores[e]).collect()
        }
        ScoreFunction::Softmax => {
            let chosen: Vec<f32> = experts.iter().map(|&e| logits[e]).collect();
            softmax(&chosen)
        }
        ScoreFunction::Sigmoid => {
            let chosen: Vec<f32> = experts.iter().map(|&e| sigmoid(logits[e])).collect();
            if moe.topk > 1 {
                let sum: f32 = chosen.iter().sum::<f32>() + 1e-20;
                chosen.iter().map(|&s| s / sum).collect()
            } else {
                chosen
            }
        }
    };
    scaled(moe, Routed { experts, weights })
}

/// The route to the chosen `experts` (best first) of a softmax router given their softmax
/// probabilities over all experts `probs`: those (`--moe-router-pre-softmax`), or renormalised
/// over the chosen — the softmax of the chosen logits.
pub fn weigh_probabilities(moe: &Moe, experts: Vec<usize>, probs: &[f32]) -> Routed {
    let weights = match moe.pre_softmax {
        true => probs.to_vec(),
        false => {
            let sum: f32 = probs.iter().sum();
            probs.iter().map(|p| p / sum).collect()
        }
    };
    scaled(moe, Routed { experts, weights })
}

/// `route` with its weights scaled by `--moe-router-topk-scaling-factor`.
fn scaled(moe: &Moe, mut route: Routed) -> Routed {
    if let Some(s) = moe.topk_scale {
        route.weights.iter_mut().for_each(|w| *w *= s as f32);
    }
    route
}

/// Whether a token's route is the top-k of its router's softmax probabilities (logits) with
/// weights from them alone: a softmax router without groups or an expert bias in its choice.
pub fn routes_by_softmax_topk(moe: &Moe) -> bool {
    moe.score == ScoreFunction::Softmax
        && !moe.sparsemixer
        && moe.group_limit.is_none()
        && !(moe.expert_bias && moe.softmax_bias)
}

/// Each token's `topk` experts by Sinkhorn balancing of one router call's `logits`
/// (`[tokens, experts]` row-major): megatron-core moe_utils.py `sinkhorn` in f32 (exp of the
/// logits scaled by row and column factors until the column factors move by less than 1e-4
/// on average), then the top-k of each row (router.py `sinkhorn_load_balancing`).
pub fn sinkhorn_choice(logits: &[f32], experts: usize, k: usize) -> Vec<Vec<usize>> {
    let cost: Vec<f32> = logits.iter().map(|&x| x.exp()).collect();
    let tokens = cost.len() / experts.max(1);
    let (eps, tol) = (1e-8f32, 1e-4f32);
    let (mut d0, mut d1) = (vec![1f32; tokens], vec![1f32; experts]);
    let (row_scale, column_scale) = (1.0 / tokens as f32, 1.0 / experts as f32);
    // bounded: a matrix of positive costs converges long before
    for _ in 0..100_000 {
        for (t, d) in d0.iter_mut().enumerate() {
            let row = &cost[t * experts..(t + 1) * experts];
            let sum: f32 = row.iter().zip(&d1).map(|(c, d)| d * c).sum();
            *d = row_scale / (sum + eps);
        }
        let mut error = 0f32;
        for (e, d) in d1.iter_mut().enumerate() {
            let sum: f32 = (0..tokens).map(|t| d0[t] * cost[t * experts + e]).sum();
            let new = column_scale / (sum + eps);
            error += (*d - new).abs();
            *d = new;
        }
        // torch loops `while error > tol`: a NaN error ends it too
        let mean = error / experts as f32;
        if mean.is_nan() || mean <= tol {
            break;
        }
    }
    (0..tokens)
        .map(|t| {
            let row: Vec<f32> = (0..experts)
                .map(|e| d1[e] * cost[t * experts + e] * d0[t])
                .collect();
            topk(&row, k)
        })
        .collect()
}

/// Which tokens an expert takes when it has more than its capacity (`--moe-token-drop-policy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DropPolicy {
    /// Those of the highest routing weights (Megatron's default `probs`).
    Probs,
    /// The first ones (`position`: "tokens at the end of each batch will be dropped").
    Position,
}

/// Megatron's token dropping (`--moe-expert-capacity-factor`, megatron-core moe_utils.py
/// `apply_router_token_dropping`, `get_capacity`): each expert takes at most
/// `ceil(T·k / E · factor)` of the T tokens a router call routes, the rest of its tokens are
/// dropped (their weight for it becomes 0, its output not added to them).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Capacity {
    /// `--moe-expert-capacity-factor`.
    pub factor: f64,
    /// `--moe-token-drop-policy`.
    pub policy: DropPolicy,
    /// `--moe-pad-expert-input-to-capacity`: every expert computes `capacity` tokens, the
    /// missing ones with weight 0 (the same output; the router counts `capacity` for each).
    pub pad: bool,
}

impl Capacity {
    /// Tokens an expert takes of a router call's `tokens`, each going to `topk` of `experts`.
    pub fn of(&self, tokens: usize, topk: usize, experts: usize) -> usize {
        ((tokens * topk) as f64 / experts as f64 * self.factor).ceil() as usize
    }

    /// Which of each route's experts keep the token, for the routes of one router call: an
    /// expert over its capacity keeps its tokens of the highest weight (ties to the earlier
    /// token; torch.topk leaves them open) or its first tokens.
    pub fn kept(&self, routes: &[Routed], topk: usize, experts: usize) -> Vec<Vec<bool>> {
        let capacity = self.of(routes.len(), topk, experts);
        let mut kept: Vec<Vec<bool>> = routes.iter().map(|r| vec![true; r.experts.len()]).collect();
        let mut takers: Vec<Vec<(usize, usize)>> = vec![Vec::new(); experts];
        for (t, r) in routes.iter().enumerate() {
            for (slot, &e) in r.experts.iter().enumerate() {
                takers[e].push((t, slot));
            }
        }
        for mut tokens in takers.into_iter().filter(|t| t.len() > capacity) {
            if self.policy == DropPolicy::Probs {
                let weight = |&(t, slot): &(usize, usize)| routes[t].weights[slot];
                tokens.sort_by(|a, b| weight(b).total_cmp(&weight(a)).then(a.0.cmp(&b.0)));
            }
            for &(t, slot) in &tokens[capacity..] {
                kept[t][slot] = false;
            }
        }
        kept
    }
}

/// The gradient of one token's router logits given the gradient `dweights` of its routing
/// weights ([`route`]'s, same order): the derivative of the score function through the chosen
/// experts (the choice itself is constant), as autograd takes it in megatron-core.
pub fn route_grad(moe: &Moe, logits: &[f32], routed: &Routed, dweights: &[f32]) -> Vec<f32> {
    if moe.sparsemixer {
        return sparsemixer::route_grad(logits, routed, dweights);
    }
    let scale = moe.topk_scale.unwrap_or(1.0) as f32;
    let dw: Vec<f32> = dweights.iter().map(|&d| d * scale).collect();
    let mut dlogits = vec![0f32; logits.len()];
    match moe.score {
        ScoreFunction::Softmax if moe.pre_softmax => {
            // w_j = p[e_j] with p = softmax(logits): dl = p ⊙ (dp − Σ p·dp).
            let p = softmax(logits);
            let mut dp = vec![0f32; logits.len()];
            routed
                .experts
                .iter()
                .zip(&dw)
                .for_each(|(&e, &d)| dp[e] = d);
            let dot: f32 = p.iter().zip(&dp).map(|(a, b)| a * b).sum();
            dlogits
                .iter_mut()
                .enumerate()
                .for_each(|(e, g)| *g = p[e] * (dp[e] - dot));
        }
        ScoreFunction::Softmax => {
            // w = softmax(chosen logits).
            let w = &routed.weights;
            let unscaled: Vec<f32> = w.iter().map(|&x| x / scale).collect();
            let dot: f32 = unscaled.iter().zip(&dw).map(|(a, b)| a * b).sum();
            for (j, &e) in routed.experts.iter().enumerate() {
                dlogits[e] = unscaled[j] * (dw[j] - dot);
            }
        }
        ScoreFunction::Sigmoid => {
            // w_j = s_j / (Σ s + ε) for top-k > 1, s = σ(logit).
            let s: Vec<f32> = (routed.experts.iter())
                .map(|&e| sigmoid(logits[e]))
                .collect();
            let ds: Vec<f32> = if moe.topk > 1 {
                let sum: f32 = s.iter().sum::<f32>() + 1e-20;
                let dot: f32 = s.iter().zip(&dw).map(|(a, b)| a * b).sum();
                dw.iter().map(|&d| (d - dot / sum) / sum).collect()
            } else {
                dw
            };
            for (j, &e) in routed.experts.iter().enumerate() {
                dlogits[e] = ds[j] * s[j] * (1.0 - s[j]);
            }
        }
    }
    dlogits
}

#[cfg(test)]
mod tests {
    use super::*;

    use super::example as moe;

    #[test]
    fn routes_from_the_top_k_probabilities_equal_the_routes_from_the_logits() {
        let logits = [0.3, -1.2, 2.5, 0.9, 2.1, -0.4];
        for pre_softmax in [false, true] {
            let mut cfg = moe(ScoreFunction::Softmax, pre_softmax);
            cfg.topk_scale = Some(2.5);
            assert!(routes_by_softmax_topk(&cfg));
            let want = route(&cfg, &logits, None);
            let all = softmax(&logits);
            let probs: Vec<f32> = want.experts.iter().map(|&e| all[e]).collect();
            let got = weigh_probabilities(&cfg, want.experts.clone(), &probs);
            let off = (got.weights.iter().zip(&want.weights)).map(|(a, b)| (a - b).abs());
            assert!(off.fold(0f32, f32::max) < 1e-6, "{got:?} {want:?}");
        }
        let mut biased = moe(ScoreFunction::Softmax, false);
        (biased.expert_bias, biased.softmax_bias) = (true, true);
        assert!(!routes_by_softmax_topk(&biased));
        assert!(!routes_by_softmax_topk(&moe(ScoreFunction::Sigmoid, false)));
    }

    #[test]
    fn softmax_routing_renormalises_the_chosen_experts_unless_pre_softmax() {
        let logits = [1.0, 3.0, 2.0, 3.0];
        let r = route(&moe(ScoreFunction::Softmax, false), &logits, None);
        // Equal logits: the lower index first, as torch.topk on the CPU.
        assert_eq!(r.experts, [1, 3]);
        assert!((r.weights[0] - 0.5).abs() < 1e-7 && (r.weights[1] - 0.5).abs() < 1e-7);
        let r = route(&moe(ScoreFunction::Softmax, true), &logits, None);
        let all = softmax(&logits);
        assert_eq!(r.weights, [all[1], all[3]]);
    }

    #[test]
    fn sigmoid_routing_chooses_with_the_bias_and_weighs_without_it() {
        let logits = [0.0, 1.0, 2.0, -1.0];
        let bias = [10.0, 0.0, 0.0, 10.0];
        let r = route(&moe(ScoreFunction::Sigmoid, false), &logits, Some(&bias));
        assert_eq!(r.experts, [0, 3]);
        let s = sigmoid;
        let sum = s(0.0) + s(-1.0);
        assert!((r.weights[0] - s(0.0) / sum).abs() < 1e-7);
    }

    #[test]
    fn an_expert_bias_moves_softmax_choices_but_not_their_weights() {
        // MindSpeed-LLM's softmax_topk: the bias added to the softmax over all experts chooses,
        // the softmax weighs (renormalised unless pre-softmax), then the scale
        let logits = [2.0, 1.0, 0.5, 0.0];
        let bias = [0.0, 0.0, 0.5, 0.0];
        let p = softmax(&logits);
        let mut m = moe(ScoreFunction::Softmax, true);
        m.topk_scale = Some(6.0);
        // megatron-core's types under MindSpeed-LLM: the bias routes nothing
        assert_eq!(route(&m, &logits, Some(&bias)).experts, [0, 1]);
        m.softmax_bias = true;
        let r = route(&m, &logits, Some(&bias));
        assert_eq!(r.experts, [2, 0]);
        assert_eq!(r.weights, [p[2] * 6.0, p[0] * 6.0]);
        // without the bias, the two best logits
        assert_eq!(route(&m, &logits, None).experts, [0, 1]);
        let renormalised = route(
            &Moe {
                softmax_bias: true,
                ..moe(ScoreFunction::Softmax, false)
            },
            &logits,
            Some(&bias),
        );
        assert_eq!(renormalised.experts, [2, 0]);
        let sum = p[2] + p[0];
        let close = |a: f32, b: f32| (a - b).abs() < 1e-6;
        assert!(
            close(renormalised.weights[0], p[2] / sum),
            "{renormalised:?}"
        );
        assert!(
            close(renormalised.weights[1], p[0] / sum),
            "{renormalised:?}"
        );
    }

    #[test]
    fn group_limited_routing_keeps_to_the_best_groups() {
        let mut m = moe(ScoreFunction::Softmax, true);
        m.group_limit = Some((2, 1));
        // k / kept = 2: group 0 = experts 0, 1 scores 0.1 + 0.2, group 1 = experts 2, 3 0.5 + 0.0.
        let logits = [0.1f32, 0.2, 0.5, 0.0].map(|p| p.ln());
        let r = route(&m, &logits, None);
        assert_eq!(r.experts, [2, 3]);
        // scored by their best expert (DeepSeek-V2's group_limited_greedy): 0.35 beats 0.3,
        // where the best two's sums, 0.4 and 0.6, choose the other group
        m.group_by_best = true;
        m.topk_scale = Some(2.0);
        let logits = [0.35f32, 0.05, 0.3, 0.3].map(|p| p.ln());
        let r = route(&m, &logits, None);
        assert_eq!(r.experts, [0, 1]);
        assert!((r.weights[0] - 0.7).abs() < 1e-6, "{r:?}");
        m.group_by_best = false;
        assert_eq!(route(&m, &logits, None).experts, [2, 3]);
    }

    /// The analytic gradient of `Σ c_j·w_j` against central differences of the logits.
    #[test]
    fn routing_gradients_match_finite_differences() {
        let logits = [0.3f32, -0.2, 0.9, 0.1];
        let c = [0.7f32, -1.3];
        for (score, pre) in [
            (ScoreFunction::Softmax, false),
            (ScoreFunction::Softmax, true),
            (ScoreFunction::Sigmoid, false),
        ] {
            let mut m = moe(score, pre);
            m.topk_scale = Some(2.5);
            let objective = |l: &[f32]| -> f64 {
                let r = route(&m, l, None);
                r.weights
                    .iter()
                    .zip(&c)
                    .map(|(w, c)| f64::from(w * c))
                    .sum()
            };
            let routed = route(&m, &logits, None);
            let g = route_grad(&m, &logits, &routed, &c);
            for e in 0..4 {
                let (mut up, mut down) = (logits, logits);
                up[e] += 1e-3;
                down[e] -= 1e-3;
                let numeric = (objective(&up) - objective(&down)) / 2e-3;
                assert!(
                    (numeric - f64::from(g[e])).abs() < 2e-3,
                    "{score:?} pre {pre} expert {e}: {numeric} vs {}",
                    g[e]
                );
            }
        }
    }

    #[test]
    fn sinkhorn_balancing_spreads_the_tokens_that_all_prefer_one_expert() {
        // every token's logits prefer expert 0; balanced, the two keenest keep it
        let logits = [3.0, 0.0, 2.0, 0.0, 1.0, 0.0, 0.5, 0.0];
        assert_eq!(
            sinkhorn_choice(&logits, 2, 1),
            [vec![0], vec![0], vec![1], vec![1]]
        );
        // top-2 of three experts (the normalised costs of megatron-core's `sinkhorn`)
        let logits = [
            3.0, 1.0, 0.0, 2.0, 1.0, 0.0, 1.0, 2.0, 0.0, 0.0, 1.0, 2.0, 0.5, 0.2, 0.1, 3.0, 0.0,
            0.0,
        ];
        let want = [[0, 1], [1, 0], [1, 2], [2, 1], [2, 1], [0, 2]];
        assert_eq!(sinkhorn_choice(&logits, 3, 2), want.map(Vec::from));
        // the weights of a chosen route are the score function's
        let m = moe(ScoreFunction::Softmax, true);
        let r = weigh(&m, &[1.0, 2.0, 3.0, 4.0], vec![0, 2]);
        let p = softmax(&[1.0, 2.0, 3.0, 4.0]);
        assert_eq!(r.weights, [p[0], p[2]]);
    }

    #[test]
    fn experts_over_capacity_drop_their_lowest_weights_or_last_tokens() {
        // 4 tokens to top-1 of 2 experts, factor 1: capacity ceil(4·1/2) = 2; expert 0 gets
        // three tokens
        let route = |e: usize, w: f32| Routed {
            experts: vec![e],
            weights: vec![w],
        };
        let routes = [route(0, 0.6), route(0, 0.9), route(1, 0.7), route(0, 0.8)];
        let mut cap = Capacity {
            factor: 1.0,
            policy: DropPolicy::Probs,
            pad: false,
        };
        assert_eq!(cap.of(4, 1, 2), 2);
        let kept = |c: &Capacity| {
            c.kept(&routes, 1, 2)
                .into_iter()
                .map(|k| k[0])
                .collect::<Vec<_>>()
        };
        assert_eq!(kept(&cap), [false, true, true, true]);
        cap.policy = DropPolicy::Position;
        assert_eq!(kept(&cap), [true, true, true, false]);
        cap.factor = 2.0;
        assert_eq!(kept(&cap), [true; 4]);
    }

    #[test]
    fn layer_patterns_follow_moe_layer_freq_and_first_dense_layers() {
        assert_eq!(
            Moe::pattern(4, &LayerFreq::Every(1), 1),
            [false, true, true, true]
        );
        assert_eq!(
            Moe::pattern(4, &LayerFreq::Every(2), 0),
            [true, false, true, false]
        );
        assert_eq!(
            Moe::pattern(3, &LayerFreq::List(vec![0, 1, 1]), 0),
            [false, true, true]
        );
        // MindSpeed-LLM's scripts: --moe-layer-freq -1 --first-k-dense-replace -1, every layer.
        assert_eq!(Moe::pattern(3, &LayerFreq::Every(-1), -1), [true; 3]);
    }
}
