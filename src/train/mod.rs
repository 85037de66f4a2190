//! `mindkit train`: Megatron-LM core 0.15 pretraining on one rank of this engine — the same
//! samples in the same order ([`crate::data::gpt_dataset`]), the same loss averaging, AdamW,
//! learning-rate schedule and clipping, Megatron's log lines and torch-format checkpoints.
//!
//! The loop (megatron/training/training.py `train` / `train_step`): per iteration, K
//! micro-batches forward and backward (gradients accumulated in f32), the global gradient norm
//! and clip, one AdamW step at `lr((i − 1)·G)`, then logging, validation, saving and the exit
//! conditions. Flags: [`args`]; their resolution: [`config`].
//!
//! Across ranks ([`parallel`]): each rank holds its tensor-parallel shard of its pipeline
//! stage's parameters (one model chunk, or several with a virtual pipeline) and trains its
//! data-parallel slice of the batch; the stages run the micro-batches in Megatron's 1F1B or
//! interleaved order ([`pipeline`]), and the gradients are summed over the data-parallel
//! group (and the tied embedding's over the first and last stage) before one AdamW step.
//!
//! The run, one job per file: `launch` wires the ranks (threads, a launcher's processes,
//! HCCL) and starts a trainer on each; `init` draws or loads the starting weights; `trainer`
//! holds the training state and the loop; `step` runs one step's micro-batches through the
//! pipeline schedule; `finalize` sums and measures the gradients and losses across ranks
//! (Megatron's `finalize_model_grads`); `resume` restores and saves checkpoints; `report`
//! computes what the logs add beyond the iteration line; `datasets` opens the splits.

pub mod args;
pub mod checkpoint;
pub mod config;
pub mod data;
mod datasets;
mod dist_ckpt;
pub mod distrib;
mod dsa;
mod finalize;
mod init;
mod launch;
pub mod log;
mod moe;
mod mtp;
pub mod optim;
pub mod parallel;
pub mod pipeline;
pub mod preference;
mod report;
mod resume;
pub mod schedule;
mod step;
pub mod store;
pub mod tensorboard;
mod trainer;

pub use launch::{run, Groups};

/// How a run ended.
#[derive(Debug, Clone)]
pub struct TrainSummary {
    /// The last completed iteration.
    pub iteration: u64,
    /// Samples consumed.
    pub consumed_samples: u64,
    /// The last logged lm loss.
    pub last_loss: Option<f64>,
    /// Wall time of the loop.
    pub seconds: f64,
    /// Tokens trained on per second.
    pub tokens_per_second: f64,
    /// Why it stopped early, if it did.
    pub stopped: Option<String>,
    /// The last checkpoint written.
    pub saved: Option<std::path::PathBuf>,
    /// The iterations this run made and how many of them skipped their update.
    pub skipped: SkippedIterations,
}

/// The iterations of a run whose update was skipped.
#[derive(Debug, Clone, Copy, Default)]
pub struct SkippedIterations {
    /// Iterations this run made.
    pub run: u64,
    /// Of them, those whose update was skipped.
    pub skipped: u64,
    /// Of those, the ones whose loss or gradient norm was not finite.
    pub not_finite: u64,
}

impl TrainSummary {
    /// Whether the run made iterations and skipped every one's update: nothing was trained.
    pub fn nothing_trained(&self) -> bool {
        self.skipped.run > 0 && self.skipped.skipped == self.skipped.run
    }
}

impl std::fmt::Display for TrainSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "trained to iteration {} ({} samples) in {:.1} s, {:.0} tokens/s",
            self.iteration, self.consumed_samples, self.seconds, self.tokens_per_second
        )?;
        if let Some(l) = self.last_loss {
            write!(f, ", lm loss {l:.4}")?;
        }
        let s = self.skipped;
        if s.skipped > 0 {
            write!(
                f,
                ", {} of {} iterations skipped their update ({} with a loss or gradient norm that \
                 is not finite)",
                s.skipped, s.run, s.not_finite
            )?;
        }
        if let Some(p) = &self.saved {
            write!(f, "; checkpoint {}", p.display())?;
        }
        if let Some(why) = &self.stopped {
            write!(f, " (stopped: {why})")?;
        }
        Ok(())
    }
}
