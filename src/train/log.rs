//! The lines Megatron-LM prints while training, character for character
//! (megatron/training/training.py `training_log`, `evaluate_and_print_results`), so that the
//! log parsers and dashboards people already use read mindkit's output.

/// Python's `'{:.{prec}E}'.format(x)`: mantissa, `E`, a signed exponent of at least two
/// digits (`1.098765E+01`); `INF`, `NAN` for non-finite values.
pub fn py_e(x: f64, prec: usize) -> String {
    if x.is_nan() {
        return "NAN".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "INF".into() } else { "-INF".into() };
    }
    let s = format!("{x:.prec$E}");
    let (mantissa, exp) = s.split_once('E').unwrap_or((&s, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let sign = if exp < 0 { '-' } else { '+' };
    format!("{mantissa}E{sign}{:02}", exp.abs())
}

/// Python's `'{:.{prec}f}'.format(x)` (`nan`, `inf` for non-finite values).
pub fn py_f(x: f64, prec: usize) -> String {
    if x.is_nan() {
        return "nan".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "inf".into() } else { "-inf".into() };
    }
    format!("{x:.prec$}")
}

/// What one iteration line reports.
#[derive(Debug, Clone)]
pub struct IterationLine {
    /// Wall clock, `%Y-%m-%d %H:%M:%S`.
    pub time: String,
    /// This iteration and the last.
    pub iteration: u64,
    /// `--train-iters`.
    pub train_iters: u64,
    /// Samples consumed so far.
    pub consumed_samples: u64,
    /// Mean seconds per iteration over the log interval.
    pub seconds_per_iteration: f64,
    /// TFLOP/s, with `--log-throughput`.
    pub tflops: Option<f64>,
    /// The learning rate Megatron prints (the schedule one step ahead, rounded to f32).
    pub lr: f32,
    /// Global batch size.
    pub global_batch: u64,
    /// Mean lm loss over the interval's advanced iterations.
    pub loss: f64,
    /// The MoE auxiliary losses' and the multi-token prediction losses' means over the
    /// interval (`track_moe_metrics`' and `track_mtp_metrics`' names).
    pub tracked: Vec<(String, f64)>,
    /// The grad norm before clipping (rounded to f32).
    pub grad_norm: Option<f32>,
    /// Zeros in the gradient (`--log-num-zeros-in-grad`).
    pub num_zeros: Option<f64>,
    /// Parameters' L2 norm (`--log-params-norm`).
    pub params_norm: Option<f64>,
    /// Skipped and NaN iterations in the interval.
    pub skipped: u64,
    /// NaN iterations in the interval.
    pub nan: u64,
    /// Tokens per second (mindkit's addition, after Megatron's fields).
    pub tokens_per_second: f64,
}

impl std::fmt::Display for IterationLine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            " [{}] iteration {:>8}/{:>8} | consumed samples: {:>12} | elapsed time per iteration (ms): {:.1} |",
            self.time,
            self.iteration,
            self.train_iters,
            self.consumed_samples,
            self.seconds_per_iteration * 1000.0
        )?;
        if let Some(t) = self.tflops {
            write!(f, " throughput per GPU (TFLOP/s/GPU): {t:.1} |")?;
        }
        write!(
            f,
            " learning rate: {} | global batch size: {:>5} |",
            py_e(f64::from(self.lr), 6),
            self.global_batch
        )?;
        // Megatron leaves the loss out when its average is not positive (NaN included).
        if self.loss > 0.0 {
            write!(f, " lm loss: {} |", py_e(self.loss, 6))?;
        }
        for (name, v) in self.tracked.iter().filter(|(_, v)| *v > 0.0) {
            write!(f, " {name}: {} |", py_e(*v, 6))?;
        }
        write!(f, " loss scale: 1.0 |")?;
        if let Some(g) = self.grad_norm {
            write!(f, " grad norm: {} |", py_f(f64::from(g), 3))?;
        }
        if let Some(z) = self.num_zeros {
            write!(f, " num zeros: {z:.1} |")?;
        }
        if let Some(p) = self.params_norm {
            write!(f, " params norm: {} |", py_f(p, 3))?;
        }
        write!(
            f,
            " number of skipped iterations: {:>3} | number of nan iterations: {:>3} | tokens per second: {:.1} |",
            self.skipped, self.nan, self.tokens_per_second
        )
    }
}

/// The boxed validation line (`evaluate_and_print_results`): `prefix` is e.g.
/// `iteration 100` or `iteration 100 on test set`.
pub fn validation_box(prefix: &str, loss: f64) -> String {
    let ppl = loss.min(20.0).exp();
    let line = format!(
        " validation loss at {prefix} | lm loss value: {} | lm loss PPL: {} | ",
        py_e(loss, 6),
        py_e(ppl, 6)
    );
    let dashes = "-".repeat(line.chars().count() + 1);
    format!("{dashes}\n{line}\n{dashes}")
}

/// Megatron's `num_floating_point_operations` for a dense GPT with GQA and SwiGLU
/// (training.py): forward + backward FLOPs of one step of `batch` samples.
pub fn flops_per_step(m: &FlopsModel, batch: u64) -> f64 {
    let (h, l, s) = (m.hidden as f64, m.layers as f64, m.seq_length as f64);
    let expansion = 12.0;
    let query_ratio = (m.head_dim * m.heads) as f64 / h;
    let attention = expansion
        * l
        * h
        * h
        * ((1.0 + m.groups as f64 / m.heads as f64 + s / h / 2.0) * query_ratio);
    let mlp = expansion * l * h * (m.ffn * 1.5);
    let logits = 6.0 * h * m.vocab_padded as f64;
    batch as f64 * s * (mlp + attention + logits)
}

/// What the FLOP count needs of a model.
#[derive(Debug, Clone, Copy)]
pub struct FlopsModel {
    /// Layers, hidden, heads, groups, head dim, ffn, padded vocabulary, sequence length.
    pub layers: usize,
    /// Hidden size.
    pub hidden: usize,
    /// Attention heads.
    pub heads: usize,
    /// Query groups.
    pub groups: usize,
    /// Per-head dimension.
    pub head_dim: usize,
    /// MLP width, the mean over the layers: an MoE layer's is its routed experts' width × the
    /// experts a token goes to plus the shared experts' (Megatron's `transformer_flops`).
    pub ffn: f64,
    /// Padded vocabulary.
    pub vocab_padded: usize,
    /// Sequence length.
    pub seq_length: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_print_as_python_does() {
        assert_eq!(py_e(10.98765, 6), "1.098765E+01");
        assert_eq!(py_e(3e-4, 6), "3.000000E-04");
        assert_eq!(py_e(1e100, 6), "1.000000E+100");
        assert_eq!(py_e(0.0, 6), "0.000000E+00");
        assert_eq!(py_e(f64::NAN, 6), "NAN");
        assert_eq!(py_f(12.3456, 3), "12.346");
        assert_eq!(py_f(f64::INFINITY, 3), "inf");
        let b = validation_box("iteration 100", 5.123456);
        let lines: Vec<&str> = b.lines().collect();
        assert_eq!(lines[1], " validation loss at iteration 100 | lm loss value: 5.123456E+00 | lm loss PPL: 1.679147E+02 | ");
        assert_eq!(lines[0].len(), lines[1].len() + 1);
    }
}
