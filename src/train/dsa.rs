//! MindSpeed-LLM's tracker of DeepSeek sparse attention's indexer loss (dsa_indexer.py
//! `DSAIndexerLossLoggingHelper`, mindspeed_llm/training/training.py `training_log`): each
//! layer's loss (its coefficient included) summed over a step's micro-batches — a
//! multi-token prediction depth's into the first layer's slot, its layer being built as
//! layer 1 —, summed over the pipeline stages, averaged over the tensor- and data-parallel
//! ranks, scaled by 1 / the rank's micro-batches and averaged over every decoder layer
//! (those sharing another's selection count as zero), logged as `dsa_indexer_loss`.

use crate::engine::comm::ReduceOp;
use crate::engine::Result;

/// The step's sums per decoder layer.
pub(super) struct IndexerTracker {
    sums: Vec<f64>,
}

impl IndexerTracker {
    /// The tracker of a model of `layers` decoder layers with an indexer (`None` without).
    pub(super) fn new(model: &crate::arch::ModelConfig) -> Option<IndexerTracker> {
        model.mla.and_then(|m| m.dsa).map(|_| IndexerTracker {
            sums: vec![0.0; model.layers],
        })
    }

    /// Add one micro-batch's losses, by canonical layer.
    pub(super) fn add(&mut self, losses: &[(usize, f32)]) {
        let layers = self.sums.len();
        for &(layer, loss) in losses {
            let slot = if layer >= layers { 0 } else { layer };
            self.sums[slot] += f64::from(loss);
        }
    }

    /// The step's logged value, reduced over the groups given, and the sums reset.
    pub(super) fn take<T>(
        &mut self,
        (pp, tp, dp): super::moe::Groups<'_, T>,
        micro_batches: usize,
    ) -> Result<(String, f64)> {
        let mut values = vec![0.0; self.sums.len()];
        std::mem::swap(&mut values, &mut self.sums);
        if let Some(g) = pp {
            g.all_reduce_f64(&mut values, ReduceOp::Sum)?;
        }
        for g in [tp, dp].into_iter().flatten() {
            g.all_reduce_f64(&mut values, ReduceOp::Sum)?;
            values.iter_mut().for_each(|v| *v /= g.size() as f64);
        }
        let total: f64 = values.iter().sum::<f64>() / micro_batches as f64;
        Ok((
            "dsa_indexer_loss".into(),
            total / values.len().max(1) as f64,
        ))
    }
}
