//! What the loop reports beside Megatron's iteration line: when it reports, the FLOPs model,
//! the validation loss's TensorBoard scalars, and `--log-comm-stats`' line with Megatron's
//! traffic for the layout.

use super::config::TrainConfig;
use super::log;
use super::trainer::Trainer;
use crate::arch::roles::Role;
use crate::engine::comm::{Communicator, Counted};
use crate::engine::Backend;
use anyhow::Result;

/// Megatron's `num_floating_point_operations` inputs of this model.
pub(super) fn flops_model(cfg: &TrainConfig) -> log::FlopsModel {
    let m = &cfg.model;
    log::FlopsModel {
        layers: m.layers,
        hidden: m.hidden,
        heads: m.heads,
        groups: m.groups,
        head_dim: m.head_dim,
        ffn: mlp_width(m),
        vocab_padded: cfg.vocab_padded,
        seq_length: cfg.seq_length,
    }
}

/// The mean MLP width over the layers, as Megatron's FLOPs count weighs dense and MoE layers.
fn mlp_width(m: &crate::arch::ModelConfig) -> f64 {
    let Some(moe) = &m.moe else {
        return m.ffn as f64;
    };
    let moe_width = (moe.ffn * moe.topk + moe.shared_ffn.unwrap_or(0)) as f64;
    let total: f64 = (0..m.layers)
        .map(|l| match moe.is_moe_layer(l) {
            true => moe_width,
            false => m.ffn as f64,
        })
        .sum();
    total / m.layers.max(1) as f64
}

impl<B: Backend> Trainer<B> {
    /// Whether iteration `iteration` is logged or written to TensorBoard.
    pub(super) fn reports(&self, iteration: u64) -> bool {
        iteration.is_multiple_of(self.cfg.log_interval) || self.tensorboard_now(iteration)
    }

    /// Whether iteration `iteration` writes TensorBoard scalars.
    pub(super) fn tensorboard_now(&self, iteration: u64) -> bool {
        (self.cfg.tensorboard.as_ref()).is_some_and(|t| iteration.is_multiple_of(t.1))
    }

    pub(super) fn write_validation(&mut self, loss: f64) -> Result<()> {
        let ppl = self.cfg.tensorboard_ppl;
        if let Some(tb) = &mut self.tensorboard {
            let mut scalars = vec![("lm loss validation", loss)];
            if ppl {
                scalars.push(("lm loss validation ppl", loss.min(20.0).exp()));
            }
            tb.scalars(self.iteration, self.consumed_train, &scalars)?;
        }
        Ok(())
    }

    /// `--log-comm-stats`: what this rank's collectives moved per iteration over the last
    /// `iterations`, group by group, beside Megatron's for the layout: the data-parallel
    /// gradient all-reduce (every trained parameter's gradient in f32: Megatron reduces
    /// gradients in f32 under --bf16 too), and per micro-batch the tensor-parallel
    /// all-reduces of `[T, h]` activations (the embedding's and each layer's two row-parallel
    /// outputs forward, the output layer's and each layer's two column-parallel inputs'
    /// gradients backward) and the cross entropy's three of `[T]` f32.
    pub(super) fn comm_line(&self, iterations: u64) -> Option<String> {
        let per = |x: u64| x as f64 / iterations.max(1) as f64;
        let counted = |g: &Counted<B::Tensor>| -> String {
            (g.take().iter())
                .map(|(name, c)| format!("{name} {} calls {} bytes", per(c.calls), per(c.bytes)))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let mut parts = Vec::new();
        if let Some(dp) = &self.dp {
            // the routed experts' under expert parallelism are reduced over their own group
            let trained: usize = (self.table.params.iter().enumerate())
                .filter(|&(i, p)| p.trainable && !self.expert_parallel(i))
                .map(|(_, p)| p.numel())
                .sum();
            let megatron = match self.sharded.first() {
                // the padded buffer's gradients reduce-scattered in f32, this rank's part of its
                // parameters all-gathered in their dtype
                Some(sharded) => {
                    let (numel, dtype) = (sharded.layout.numel(), self.cfg.model.dtype);
                    format!(
                        "distributed optimizer's reduce-scatter: {numel} buffer elements × 4 bytes = {} bytes; all-gather: {numel} / {} × {} bytes = {} bytes",
                        4 * numel,
                        dp.size(),
                        dtype.size(),
                        numel / dp.size() * dtype.size()
                    )
                }
                None => format!(
                    "gradient all-reduce: {trained} parameters × 4 bytes = {} bytes",
                    4 * trained
                ),
            };
            parts.push(format!(
                "data-parallel rank {} of {}: {} | Megatron's {megatron}",
                dp.rank(),
                dp.size(),
                counted(dp),
            ));
        }
        if let Some(tp) = &self.tp {
            parts.push(format!(
                "tensor-parallel rank {} of {}: {} | Megatron's {}",
                tp.rank(),
                tp.size(),
                counted(tp),
                self.tp_formula(tp.size())
            ));
        }
        if let Some(pp) = &self.pp {
            parts.push(format!(
                "pipeline stage {} of {}: {} | Megatron's {}",
                pp.rank(),
                pp.size(),
                counted(pp),
                self.pp_formula()
            ));
        }
        for (name, group) in [
            ("expert-parallel", &self.ep),
            ("expert-data-parallel", &self.edp),
        ] {
            if let Some(g) = group {
                parts.push(format!(
                    "{name} rank {} of {}: {}",
                    g.rank(),
                    g.size(),
                    counted(g)
                ));
            }
        }
        (!parts.is_empty()).then(|| format!(" [comm] per iteration, {}", parts.join("; ")))
    }

    /// Megatron's tensor-parallel traffic per iteration over `tp` ranks, in the counts' terms
    /// (an all-gather counts this rank's part, a reduce-scatter its whole input). Per
    /// micro-batch of T rows: the cross entropy's three all-reduces of `[T]` f32, and of
    /// `[T, h]` activations either 4L + 2 all-reduces (the embedding's and each layer's two
    /// row-parallel outputs forward, the output layer's and each layer's two column-parallel
    /// inputs' gradients backward) or, under sequence parallelism, 4L + 2 reduce-scatters in
    /// their place and 6L + 3 all-gathers (the column-parallel inputs forward and again
    /// backward, the row-parallel output gradients and the embedding's); then per iteration
    /// the norm weights' gradient all-reduce under sequence parallelism, and the q/k
    /// layernorms' with them.
    fn tp_formula(&self, tp: usize) -> String {
        let c = &self.cfg;
        let norms: usize = (self.trained_norms().into_iter())
            .map(|i| self.table.params[i].numel())
            .sum();
        let (rows, layers, hidden) = (c.micro_batch * c.seq_length, c.model.layers, c.model.hidden);
        let k = c.global_batch / (c.micro_batch * c.data_parallel);
        let a = self.activations();
        let block = rows * hidden * a.size();
        let entropy = 3 * rows * 4;
        if !c.sequence_parallel {
            // With LoRA, each adapter's x·Aᵀ (row-parallel layers, forward) or its gradient
            // (column-parallel layers, backward) too.
            let (adapters, r) = c
                .lora
                .as_ref()
                .map_or((0, 0), |l| (l.spec.targets.len() * layers, l.spec.r));
            let bytes = k * ((4 * layers + 2) * block + adapters * rows * r * a.size() + entropy)
                + 4 * norms;
            let norms = match norms {
                0 => String::new(),
                n => format!(" + {n} q/k layernorm gradients × 4"),
            };
            return format!(
                "all-reduces: ({} × [{rows}, {hidden}] {a:?} + {adapters} × [{rows}, {r}] {a:?} + 3 × [{rows}] f32) × {k} micro-batches{norms} = {bytes} bytes",
                4 * layers + 2
            );
        }
        format!(
            "all-gathers: {} × [{}, {hidden}] {a:?} × {k} micro-batches = {} bytes; reduce-scatters: {} × [{rows}, {hidden}] {a:?} × {k} = {} bytes; all-reduces: 3 × [{rows}] f32 × {k} + {norms} norm gradients × 4 = {} bytes",
            6 * layers + 3,
            rows / tp,
            k * (6 * layers + 3) * block / tp,
            4 * layers + 2,
            k * (4 * layers + 2) * block,
            k * entropy + 4 * norms
        )
    }

    /// Megatron's point-to-point traffic per iteration of this pipeline stage: per
    /// micro-batch of T rows and model chunk, the chunk's output `[T', h]` sent to the next
    /// stage (but from the model's last chunk) and its input's gradient sent to the previous
    /// (but from the model's first) (T' = T / TP under sequence parallelism), the same
    /// received; the tied embedding's gradient `[Vp / TP, h]` f32 sent and received between the
    /// first and last stage; and the schedule's bubble, (PP − 1) / (V·K + PP − 1) of the
    /// iteration with K micro-batches and V model chunks per stage (each stage idles for
    /// PP − 1 forward and backward slots of one chunk; V = 1 is 1F1B's (PP − 1) / (K + PP − 1)).
    fn pp_formula(&self) -> String {
        let c = &self.cfg;
        let tp = self.tp().1;
        let rows = c.micro_batch * c.seq_length / if c.sequence_parallel { tp } else { 1 };
        let a = self.activations();
        let k = c.global_batch / (c.micro_batch * c.data_parallel);
        let block = rows * c.model.hidden * a.size();
        let (first, last) = (self.stage.first(), self.stage.last());
        let v = self.chunks.len();
        // DualPipeV's turn (its last stage) hands chunk 0's output and chunk 1's input
        // gradient over in place
        let turn = 2 * usize::from(self.cfg.dualpipev && self.stage.index + 1 == self.stage.count);
        let sends = k * (2 * v - usize::from(last) - usize::from(first) - turn);
        let tied = self.cfg.model.tied
            && (first || last)
            && self
                .table
                .params
                .iter()
                .any(|p| p.canon.role == Role::Embedding && p.trainable);
        let embedding = match tied {
            true => c.vocab_padded / tp * c.model.hidden * 4,
            false => 0,
        };
        let p = self.stage.count;
        let (bubble, vk) = match v {
            1 => ("(PP − 1) / (K + PP − 1)".to_string(), k),
            _ => (format!("(PP − 1) / ({v}·K + PP − 1)"), v * k),
        };
        let bubble = match self.cfg.dualpipev {
            true => "of DualPipeV's V run forward, then backward: not modelled".to_string(),
            false => format!(
                "{bubble} = {}/{} = {:.3}",
                p - 1,
                vk + p - 1,
                (p - 1) as f64 / (vk + p - 1) as f64
            ),
        };
        format!(
            "sends and receives, each: {sends} × [{rows}, {}] {a:?} + {} × [{}, {}] f32 = {} bytes; bubble {bubble}",
            c.model.hidden,
            usize::from(tied),
            c.vocab_padded / tp,
            c.model.hidden,
            sends * block + embedding,
        )
    }
}

/// Local time as Megatron prints it (`%Y-%m-%d %H:%M:%S`).
pub(super) fn chrono_now() -> String {
    chrono::Local::now().format("%Y-%m-%d %H:%M:%S").to_string()
}
