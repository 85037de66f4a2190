//! Megatron's tracker of the multi-token prediction losses (megatron-core
//! multi_token_prediction.py `MTPLossLoggingHelper`; megatron/training/training.py
//! `training_log`): each depth's `Σ loss·mask / Σ mask` per micro-batch, summed over a step's
//! micro-batches (on the last pipeline stage, which holds the depths), averaged over the
//! data-parallel ranks, scaled by 1 / the rank's micro-batches, logged as `mtp_{k+1} loss`.

use crate::engine::comm::{Communicator, ReduceOp};
use crate::engine::Result;

/// The step's sums per depth.
pub(super) struct MtpTracker {
    sums: Vec<f64>,
}

impl MtpTracker {
    /// The tracker of `depths` depths (`None` for none).
    pub(super) fn new(depths: usize) -> Option<MtpTracker> {
        (depths > 0).then(|| MtpTracker {
            sums: vec![0.0; depths],
        })
    }

    /// Add one micro-batch's `(Σ loss·mask, Σ mask)` of each depth.
    pub(super) fn add(&mut self, losses: &[(f32, f32)]) {
        for (sum, &(s, n)) in self.sums.iter_mut().zip(losses) {
            *sum += f64::from(s / n);
        }
    }

    /// The step's logged values, reduced over the pipeline stages (only the last holds them)
    /// and averaged over the data-parallel ranks, and the sums reset.
    pub(super) fn take<T>(
        &mut self,
        (pp, dp): (
            Option<&dyn Communicator<Tensor = T>>,
            Option<&dyn Communicator<Tensor = T>>,
        ),
        micro_batches: usize,
    ) -> Result<Vec<(String, f64)>> {
        let mut values = vec![0.0; self.sums.len()];
        std::mem::swap(&mut values, &mut self.sums);
        if let Some(g) = pp {
            g.all_reduce_f64(&mut values, ReduceOp::Sum)?;
        }
        if let Some(g) = dp {
            g.all_reduce_f64(&mut values, ReduceOp::Sum)?;
            values.iter_mut().for_each(|v| *v /= g.size() as f64);
        }
        Ok((values.iter().enumerate())
            .map(|(k, v)| (format!("mtp_{} loss", k + 1), v / micro_batches as f64))
            .collect())
    }
}
