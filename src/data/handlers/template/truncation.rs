//! How a template class's `_make_pairs` cuts (source, target) pairs to `cutoff_len`:
//! `Template` (LLaMA-Factory 0.8.2's `infer_max_len`) and `LFDefaultTemplate` /
//! `ReasoningTemplate` (`_infer_seqlen` of MindSpeed-LLM
//! `mindspeed_llm/tasks/preprocess/decoder_packed_mtf_dataset.py`, over cutoff − reserved).

use super::TurnIds;

/// `infer_max_len` of LLaMA-Factory 0.8.2 (`Template._make_pairs`).
fn infer_max_len(
    source_len: usize,
    target_len: usize,
    max_len: usize,
    reserved: usize,
) -> (usize, usize) {
    let max_target = if source_len + target_len == 0 {
        0
    } else {
        (max_len as f64 * (target_len as f64 / (source_len + target_len) as f64)) as usize
    };
    let max_target = max_target.max(reserved);
    let max_source = max_len.saturating_sub(max_target.min(target_len));
    (max_source, max_target)
}

/// `_infer_seqlen` (`decoder_packed_mtf_dataset.py`, LLaMA-Factory 0.9): the (source, target)
/// lengths kept within `cutoff_len`.
fn infer_seqlen(source_len: i64, target_len: i64, cutoff_len: i64) -> (i64, i64) {
    let max_target = if target_len * 2 < cutoff_len {
        cutoff_len
    } else if source_len * 2 < cutoff_len {
        cutoff_len - source_len
    } else {
        (cutoff_len as f64 * (target_len as f64 / (source_len + target_len) as f64)) as i64
    };
    let new_target = max_target.min(target_len);
    let max_source = (cutoff_len - new_target).max(0);
    (max_source.min(source_len), new_target)
}

/// How a class's `_make_pairs` cuts each (source, target) pair to the budget left.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Truncation {
    /// `Template`: `infer_max_len` over the whole cutoff.
    InferMaxLen,
    /// `LFDefaultTemplate` (and `ReasoningTemplate`): `_infer_seqlen` over cutoff − reserved.
    InferSeqlen,
}

/// `_make_pairs`: pairs until the cutoff, each cut by the class's rule.
pub(super) fn make_pairs(
    encoded: Vec<Vec<i64>>,
    cutoff_len: usize,
    reserved: usize,
    rule: Truncation,
) -> Vec<TurnIds> {
    let cutoff = match rule {
        Truncation::InferMaxLen => cutoff_len as i64,
        Truncation::InferSeqlen => cutoff_len as i64 - reserved as i64,
    };
    let mut pairs = Vec::new();
    let mut total = 0i64;
    let mut it = encoded.into_iter();
    while let (Some(mut source), Some(mut target)) = (it.next(), it.next()) {
        if total >= cutoff {
            break;
        }
        let (max_source, max_target) = match rule {
            Truncation::InferMaxLen => {
                let budget = (cutoff - total) as usize;
                let (s, t) = infer_max_len(source.len(), target.len(), budget, reserved);
                (s as i64, t as i64)
            }
            Truncation::InferSeqlen => {
                infer_seqlen(source.len() as i64, target.len() as i64, cutoff - total)
            }
        };
        source.truncate(max_source as usize);
        target.truncate(max_target as usize);
        total += (source.len() + target.len()) as i64;
        pairs.push((source, target));
    }
    pairs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn truncation_like_llamafactory() {
        assert_eq!(infer_max_len(10, 10, 10, 1), (5, 5));
        assert_eq!(infer_max_len(0, 0, 10, 1), (10, 1));
        let turns = || vec![vec![1; 6], vec![2; 6], vec![3; 4], vec![4; 4]];
        let pairs = make_pairs(turns(), 10, 1, Truncation::InferMaxLen);
        assert_eq!(pairs.len(), 1);
        assert_eq!((pairs[0].0.len(), pairs[0].1.len()), (5, 5));
    }

    #[test]
    fn lf_truncation_keeps_cutoff_minus_one() {
        assert_eq!(infer_seqlen(3, 100, 10), (3, 7));
        assert_eq!(infer_seqlen(100, 3, 10), (7, 3));
        assert_eq!(infer_seqlen(10, 30, 10), (3, 7));
        let turns = vec![vec![1; 6], vec![2; 6], vec![3; 4], vec![4; 4]];
        let pairs = make_pairs(turns, 10, 1, Truncation::InferSeqlen);
        assert_eq!(pairs.len(), 1);
        assert_eq!((pairs[0].0.len(), pairs[0].1.len()), (5, 4));
    }
}
