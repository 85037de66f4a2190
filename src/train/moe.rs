//! Megatron's tracker of the MoE layers' auxiliary losses (megatron-core moe_utils.py
//! `save_to_aux_losses_tracker`, `reduce_aux_losses_tracker_across_ranks`,
//! `track_moe_metrics`; megatron/training/training.py `training_log`): each layer's values
//! summed over a step's micro-batches, summed over the pipeline stages (each holds its layers)
//! and over the tensor-parallel ranks for the load-balancing losses (each holds its rows' part;
//! the z-loss is the last tensor-parallel rank's, which Megatron's last rank prints), averaged
//! over the data-parallel ranks, then scaled by 1 / the rank's micro-batches and averaged over
//! the MoE layers. With an expert bias it also counts the tokens each expert got over the step
//! (megatron-core router.py `local_tokens_per_expert`).

use crate::arch::ModelConfig;
use crate::engine::comm::{Communicator, ReduceOp};
use crate::engine::Result;
use crate::model::{AuxLosses, Balancing, RouterStats};

/// The step's sums per tracked loss and layer.
pub(super) struct MoeTracker {
    /// Megatron's track names in its order (`"aux_loss" in` the type names
    /// load_balancing_loss for seq_aux_loss too, left at zero).
    names: Vec<&'static str>,
    sums: Vec<Vec<f64>>,
    /// MoE layers of the whole model.
    moe_layers: usize,
    /// The step's tokens per expert of each MoE layer with an expert bias that this rank's
    /// forward passes went through, by global layer.
    tokens: std::collections::BTreeMap<usize, Vec<f32>>,
}

impl MoeTracker {
    /// The tracker of a run with `aux` losses on `model`, `None` for a dense model.
    pub(super) fn new(model: &ModelConfig, aux: Option<&AuxLosses>) -> Option<MoeTracker> {
        let (moe, aux) = (model.moe.as_ref()?, aux?);
        let mut names = Vec::new();
        if matches!(aux.balancing, Balancing::Aux | Balancing::SeqAux) {
            names.push("load_balancing_loss");
        }
        if aux.balancing == Balancing::SeqAux {
            names.push("seq_load_balancing_loss");
        }
        if aux.z_coeff.is_some() {
            names.push("z_loss");
        }
        // megatron-core 0.15's track_moe_metrics counts every multi-token prediction depth
        // as an MoE layer (its `mtp_num_layers`); MindSpeed-LLM's (core 0.12) counts none,
        // though the depths' MoE layers add their losses to the sums in both.
        let depths = match model.mtp {
            Some(m) if m.layout == crate::arch::MtpLayout::Mcore => m.depths,
            _ => 0,
        };
        Some(MoeTracker {
            sums: vec![vec![0.0; model.all_layers()]; names.len()],
            names,
            moe_layers: (0..model.layers).filter(|&l| moe.is_moe_layer(l)).count() + depths,
            tokens: Default::default(),
        })
    }

    /// Add one micro-batch's values, by global layer.
    pub(super) fn add(&mut self, stats: &[(usize, &RouterStats)], balancing: Balancing) {
        let balancing = balancing.name();
        for &(layer, s) in stats {
            let v = s.losses;
            for (name, value) in [(balancing, v.balancing), (Some("z_loss"), v.z)] {
                let slot = self.names.iter().position(|&n| Some(n) == name);
                if let (Some(i), Some(x)) = (slot, value) {
                    self.sums[i][layer] += f64::from(x);
                }
            }
            if let Some(tokens) = &s.tokens {
                let sum = (self.tokens.entry(layer)).or_insert_with(|| vec![0.0; tokens.len()]);
                sum.iter_mut().zip(tokens).for_each(|(a, t)| *a += t);
            }
        }
    }

    /// The step's tokens per expert, by global layer in order, and the counts reset.
    pub(super) fn take_tokens(&mut self) -> Vec<(usize, Vec<f32>)> {
        std::mem::take(&mut self.tokens).into_iter().collect()
    }

    /// The step's logged values, reduced over the groups given, and the sums reset.
    pub(super) fn take<T>(
        &mut self,
        (pp, tp, dp): Groups<'_, T>,
        micro_batches: usize,
    ) -> Result<Vec<(&'static str, f64)>> {
        let mut out = Vec::with_capacity(self.names.len());
        for (name, sums) in self.names.iter().zip(&mut self.sums) {
            let mut values = std::mem::replace(sums, vec![0.0; sums.len()]);
            if let Some(g) = pp {
                g.all_reduce_f64(&mut values, ReduceOp::Sum)?;
            }
            match (tp, *name == "z_loss") {
                (Some(g), false) => g.all_reduce_f64(&mut values, ReduceOp::Sum)?,
                // The z-loss is tracked without a reduce group: each rank keeps its rows' mean,
                // and Megatron prints the last rank's.
                (Some(g), true) => values = last_rank(g, &values)?,
                (None, _) => {}
            }
            if let Some(g) = dp {
                g.all_reduce_f64(&mut values, ReduceOp::Sum)?;
                values.iter_mut().for_each(|v| *v /= g.size() as f64);
            }
            let total: f64 = values.iter().sum::<f64>() / micro_batches as f64;
            out.push((*name, total / self.moe_layers.max(1) as f64));
        }
        Ok(out)
    }
}

/// The last rank of `group`'s `values` (as many on every rank).
fn last_rank<T>(group: &dyn Communicator<Tensor = T>, values: &[f64]) -> Result<Vec<f64>> {
    let mine: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let all = group.all_gather_bytes(&mine)?;
    Ok((all[all.len() - mine.len()..].chunks_exact(8))
        .map(|b| f64::from_le_bytes(b.try_into().expect("8 bytes")))
        .collect())
}

/// The pipeline, tensor- and data-parallel groups (`None`: one rank).
pub(super) type Groups<'a, T> = (
    Option<&'a dyn Communicator<Tensor = T>>,
    Option<&'a dyn Communicator<Tensor = T>>,
    Option<&'a dyn Communicator<Tensor = T>>,
);
