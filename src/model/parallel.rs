//! Megatron's tensor-parallel collectives as the decoder uses them (megatron-core
//! megatron/core/tensor_parallel/layers.py, mappings.py): a rank's place in its group, the
//! sums of row-parallel outputs and column-parallel input gradients, and sequence
//! parallelism's gathers.
//!
//! Legend: T = rows of the micro-batch (this rank's block of them under sequence
//! parallelism), w = a row's width.

use crate::engine::comm::{Communicator, ReduceOp};
use crate::engine::{Backend, Result, NO_ROW};
use std::ops::Range;

/// One rank's place in tensor parallelism.
pub struct TensorParallel<'a, T> {
    /// The tensor-parallel group.
    pub group: &'a dyn Communicator<Tensor = T>,
    /// The vocabulary rows this rank's embedding and output shards hold.
    pub vocab: Range<usize>,
    /// Sequence parallelism: the residual stream holds this rank's block of rows.
    pub sequence_parallel: bool,
}

/// The expert-parallel group of a pass (`None`: every expert on this rank): the ranks that hold
/// each MoE layer's routed experts between them, each with its own rows (data-parallel ranks).
pub type ExpertGroup<'a, T> = Option<&'a dyn Communicator<Tensor = T>>;

/// The expert groups of a pass: the expert-parallel group, and the expert tensor-parallel
/// ranks each routed expert is split over (`None`: whole on this rank; the tensor-parallel
/// group itself where ETP = TP, a block of its ranks where ETP divides TP).
pub type ExpertGroups<'a, T> = (ExpertGroup<'a, T>, Option<&'a TensorParallel<'a, T>>);

impl<T> TensorParallel<'_, T> {
    /// Ids (tokens or labels) as rows of this rank's vocabulary shard, [`NO_ROW`] for the
    /// others'.
    pub(super) fn local(&self, ids: &[u32]) -> Vec<u32> {
        let v = &self.vocab;
        ids.iter()
            .map(|&id| {
                let id = id as usize;
                if v.contains(&id) {
                    (id - v.start) as u32
                } else {
                    NO_ROW
                }
            })
            .collect()
    }
}

/// Ids as rows of this rank's vocabulary shard (all of them without tensor parallelism).
pub(super) fn local_ids<T>(tp: Option<&TensorParallel<T>>, ids: &[u32]) -> Vec<u32> {
    match tp {
        Some(tp) => tp.local(ids),
        None => ids.to_vec(),
    }
}

/// Partial sums `[T·tp, w]` (or `[T, w]`) over the tensor-parallel ranks (a row-parallel
/// layer's output, the embedding's rows, a column-parallel layer's input gradient), summed:
/// all-reduced, or under sequence parallelism reduce-scattered to this rank's rows (nothing
/// alone).
pub(super) fn reduced<B: Backend>(
    b: &B,
    tp: Option<&TensorParallel<B::Tensor>>,
    mut x: B::Tensor,
) -> Result<B::Tensor> {
    match tp {
        None => Ok(x),
        Some(tp) if !tp.sequence_parallel => {
            tp.group.all_reduce(&mut x, ReduceOp::Sum)?;
            Ok(x)
        }
        Some(tp) => {
            let mut out = zeros_of_rows(b, &x, b.shape(&x)[0] / tp.group.size())?;
            tp.group.reduce_scatter(&x, &mut out, ReduceOp::Sum)?;
            Ok(out)
        }
    }
}

/// Partial sums over the tensor-parallel ranks of rows every rank holds (a LoRA adapter's
/// `x·Aᵀ` and its gradient), all-reduced whether or not the sequence is split.
pub(super) fn all_reduced<T>(tp: Option<&TensorParallel<T>>, mut x: T) -> Result<T> {
    if let Some(tp) = tp {
        tp.group.all_reduce(&mut x, ReduceOp::Sum)?;
    }
    Ok(x)
}

/// Under sequence parallelism, every rank's rows of `x` (all-gather): a column-parallel
/// layer's input, a row-parallel layer's output gradient; `None` where `x` holds every row.
pub(super) fn gathered<B: Backend>(
    b: &B,
    tp: Option<&TensorParallel<B::Tensor>>,
    x: &B::Tensor,
) -> Result<Option<B::Tensor>> {
    let Some(tp) = tp.filter(|tp| tp.sequence_parallel) else {
        return Ok(None);
    };
    let mut out = zeros_of_rows(b, x, b.shape(x)[0] * tp.group.size())?;
    tp.group.all_gather(x, &mut out)?;
    Ok(Some(out))
}

/// Under expert parallelism, every expert-parallel rank's rows of `x` in rank order
/// (all-gather): the rows every rank's experts see; `None` alone.
pub(super) fn expert_gathered<B: Backend>(
    b: &B,
    ep: ExpertGroup<B::Tensor>,
    x: &B::Tensor,
) -> Result<Option<B::Tensor>> {
    let Some(ep) = ep else {
        return Ok(None);
    };
    let mut out = zeros_of_rows(b, x, b.shape(x)[0] * ep.size())?;
    ep.all_gather(x, &mut out)?;
    Ok(Some(out))
}

/// Under expert parallelism, this rank's block of the rows of `x` (every expert-parallel
/// rank's rows, as [`expert_gathered`] gave them) summed over the ranks (reduce-scatter): each
/// row's experts' outputs, or their input gradients, back on its own rank.
pub(super) fn expert_reduced<B: Backend>(
    b: &B,
    ep: ExpertGroup<B::Tensor>,
    x: B::Tensor,
) -> Result<B::Tensor> {
    let Some(ep) = ep else {
        return Ok(x);
    };
    let mut out = zeros_of_rows(b, &x, b.shape(&x)[0] / ep.size())?;
    ep.reduce_scatter(&x, &mut out, ReduceOp::Sum)?;
    Ok(out)
}

/// Zeros of `x`'s dtype and row width, `rows` rows.
fn zeros_of_rows<B: Backend>(b: &B, x: &B::Tensor, rows: usize) -> Result<B::Tensor> {
    let mut shape = b.shape(x).to_vec();
    shape[0] = rows;
    b.zeros(&shape, b.dtype(x))
}

/// Whether this rank adds a term every tensor-parallel rank computes alike to a sum the
/// group reduces afterwards: rank 0 alone does, so that the sum counts it once.
pub(super) fn counts_once<T>(tp: Option<&TensorParallel<T>>) -> bool {
    tp.is_none_or(|tp| tp.group.rank() == 0)
}
