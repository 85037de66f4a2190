//! An MoE layer's tokens as this rank's experts take them ([`Dispatch`]), and the two row
//! movements between the tokens and the experts' permuted rows, [`super::Backend::permute`]
//! and [`super::Backend::unpermute`] (megatron-core megatron/core/transformer/moe/moe_utils.py
//! `permute` / `unpermute`): here as row gathers and indexed adds, the CPU backend's
//! implementation and any backend's where its fused operators cannot run.
//!
//! The permuted order is a stable sort of the flattened choices by expert: expert after
//! expert, and within an expert token after token — what megatron-core's `permute` and
//! aclnnMoeTokenPermute (ops-transformer moe/moe_token_permute, `argSort` of the indices) give.
//!
//! Before them, the router's top-k of a softmax ([`super::Backend::softmax_topk`]; on the NPU
//! aclnnMoeGatingTopKSoftmax), here read back and computed on the host.

use super::{check, Backend, Result};

/// Each of `tokens` tokens' `k` choices of this rank's `experts` experts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dispatch {
    /// Token after token, each token's `k` choices: the local expert it goes to, or `None`
    /// (another rank's expert, a zero-computation expert, a dropped token).
    choices: Vec<Option<u32>>,
    k: usize,
    experts: usize,
    /// The flattened choices in the permuted order, and how many of them are routed.
    order: Vec<usize>,
    routed: usize,
}

impl Dispatch {
    /// The dispatch of `choices` (token after token, `k` each) over `experts` local experts;
    /// `None` when they are not whole tokens' or name an expert outside them.
    pub fn new(choices: Vec<Option<u32>>, k: usize, experts: usize) -> Option<Dispatch> {
        let whole = k > 0 && choices.len().is_multiple_of(k);
        let inside = choices.iter().flatten().all(|&e| (e as usize) < experts);
        if !(whole && inside) {
            return None;
        }
        let mut order: Vec<usize> = (0..choices.len()).collect();
        // a stable sort: ties keep their flattened order
        order.sort_by_key(|&i| choices[i].map_or(experts, |e| e as usize));
        let routed = choices.iter().flatten().count();
        Some(Dispatch {
            choices,
            k,
            experts,
            order,
            routed,
        })
    }

    /// The tokens.
    pub fn tokens(&self) -> usize {
        self.choices.len() / self.k
    }

    /// Each token's choices.
    pub fn topk(&self) -> usize {
        self.k
    }

    /// The local experts.
    pub fn experts(&self) -> usize {
        self.experts
    }

    /// Every choice, token after token.
    pub fn choices(&self) -> &[Option<u32>] {
        &self.choices
    }

    /// The flattened choices (`token · k + slot`) in the permuted order: the routed ones,
    /// then the others in their order.
    pub fn order(&self) -> &[usize] {
        &self.order
    }

    /// How many choices are routed (the permuted rows).
    pub fn len(&self) -> usize {
        self.routed
    }

    /// Whether no choice is routed.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether every choice is routed (one expert-parallel rank, nothing dropped).
    pub fn is_full(&self) -> bool {
        self.routed == self.choices.len()
    }

    /// Each permuted row's token.
    pub fn rows(&self) -> Vec<usize> {
        (self.order[..self.routed].iter())
            .map(|&i| i / self.k)
            .collect()
    }

    /// Each local expert's permuted rows.
    pub fn counts(&self) -> Vec<usize> {
        let mut counts = vec![0; self.experts];
        self.choices
            .iter()
            .flatten()
            .for_each(|&e| counts[e as usize] += 1);
        counts
    }

    /// Each flattened choice's place in the permuted order (the inverse of [`Self::order`]):
    /// aclnnMoeTokenPermute's `sortedIndicesOut`.
    pub fn positions(&self) -> Vec<usize> {
        let mut positions = vec![0; self.choices.len()];
        for (at, &i) in self.order.iter().enumerate() {
            positions[i] = at;
        }
        positions
    }
}

/// [`super::Backend::permute`], one row gather.
pub fn permute<B: Backend + ?Sized>(b: &B, x: &B::Tensor, d: &Dispatch) -> Result<B::Tensor> {
    check::dispatched(b, "permute", x, d.tokens())?;
    b.select_rows(x, &d.rows())
}

/// [`super::Backend::unpermute`], one indexed add into zeros.
pub fn unpermute<B: Backend + ?Sized>(b: &B, y: &B::Tensor, d: &Dispatch) -> Result<B::Tensor> {
    check::dispatched(b, "unpermute", y, d.len())?;
    let width = b.shape(y)[1..].iter().product();
    let mut out = b.zeros(&[d.tokens(), width], b.dtype(y))?;
    b.index_add_rows(&mut out, y, &d.rows())?;
    Ok(out)
}

/// [`super::Backend::softmax_topk`] on the host: the logits read back, each row's softmax in
/// f32, its `k` largest (the lower column first among equals), rounded to the logits' dtype.
pub fn softmax_topk<B: Backend + ?Sized>(
    b: &B,
    logits: &B::Tensor,
    k: usize,
) -> Result<(Vec<u32>, Vec<f32>)> {
    let width = check::softmax_topk(b, logits, k)?;
    let dtype = b.dtype(logits);
    let (mut experts, mut probs) = (Vec::new(), Vec::new());
    for row in b.download_f32(logits)?.chunks(width) {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let exps: Vec<f32> = row.iter().map(|&x| (x - max).exp()).collect();
        let sum: f32 = exps.iter().sum();
        let mut order: Vec<usize> = (0..width).collect();
        order.sort_by(|&a, &b| exps[b].total_cmp(&exps[a]).then(a.cmp(&b)));
        for &e in &order[..k] {
            experts.push(e as u32);
            probs.push(dtype.round(exps[e] / sum));
        }
    }
    Ok((experts, probs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_permuted_order_is_a_stable_sort_by_expert_with_the_unrouted_last() {
        // three tokens, two choices each, over experts 0..3; token 1's second choice is
        // another rank's
        let d = Dispatch::new(
            vec![Some(2), Some(0), Some(0), None, Some(2), Some(1)],
            2,
            3,
        )
        .expect("whole tokens, experts inside");
        assert_eq!(d.order(), [1, 2, 5, 0, 4, 3]);
        assert_eq!(d.rows(), [0, 1, 2, 0, 2]);
        assert_eq!(d.counts(), [2, 1, 2]);
        assert_eq!(d.positions(), [3, 0, 1, 5, 4, 2]);
        assert_eq!((d.len(), d.is_full(), d.tokens()), (5, false, 3));
    }

    #[test]
    fn a_dispatch_of_partial_tokens_or_foreign_experts_is_refused() {
        assert!(Dispatch::new(vec![Some(0); 3], 2, 1).is_none());
        assert!(Dispatch::new(vec![Some(1), Some(0)], 2, 1).is_none());
        assert!(Dispatch::new(vec![], 0, 1).is_none());
    }
}
