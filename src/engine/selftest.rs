//! `mindkit selftest`: every operator of a backend against the CPU backend (the reference) on
//! random inputs, in each dtype the backend supports, on shapes that include odd sizes,
//! forward and backward (the scheme of llama.cpp's `test-backend-ops`). Both backends get the
//! same inputs, rounded to the dtype under test; outputs are compared as f32, the error is
//! the largest absolute difference over the reference's largest magnitude, and each dtype has
//! its tolerance.
//!
//! Values a backend defines for itself are not compared: attention's saved statistics (only
//! its backward reads them, and that is compared).
//!
//! The embedding and cross entropy run twice: on a whole vocabulary's ids and labels, and on
//! a vocabulary shard's, some of them [`NO_ROW`] (tensor parallelism).

use super::cpu::Cpu;
use super::dispatch::Dispatch;
use super::dropout::{Mask, Rate, RowAt, Site};
use super::{AdamWStep, AttentionShape, Backend, Device, Op, Result, Segment, StridedView, NO_ROW};
use crate::tensor::host::{encode_f32, to_f32, Tensor as HostTensor};
use crate::tensor::DType;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::ops::Range;

/// One row of the report.
#[derive(Debug, Clone)]
pub struct Check {
    /// The operator.
    pub op: &'static str,
    /// The dtype of its inputs.
    pub dtype: DType,
    /// The shapes, in words.
    pub shape: String,
    /// The error (see the module doc); `None` when the device does not support it.
    pub error: Option<f32>,
    /// Why it failed when the device returned an error instead of outputs.
    pub failure: Option<String>,
    /// The tolerance.
    pub tolerance: f32,
}

impl Check {
    /// Whether it passed (an unsupported combination is not a failure).
    pub fn passed(&self) -> bool {
        self.error.is_none_or(|e| e <= self.tolerance)
    }
}

/// The tolerance of outputs computed from inputs in `dtype`: a few roundings of the dtype
/// (its outputs are rounded to it too) or, for f32, of differently ordered f32 sums.
fn tolerance(dtype: DType) -> f32 {
    match dtype {
        DType::BF16 => 3e-2,
        DType::F16 => 4e-3,
        _ => 2e-5,
    }
}

/// The error of `got` against `want`, output by output.
fn error(got: &[Vec<f32>], want: &[Vec<f32>]) -> f32 {
    got.iter()
        .zip(want)
        .map(|(g, w)| {
            if g.len() != w.len() {
                return f32::INFINITY;
            }
            let scale = w.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
            let diff = g.iter().zip(w).fold(0f32, |m, (a, b)| {
                let d = (a - b).abs();
                if d.is_nan() {
                    f32::INFINITY
                } else {
                    m.max(d)
                }
            });
            diff / scale
        })
        .fold(0f32, f32::max)
}

/// Random inputs, the same for both backends.
struct Inputs {
    rng: StdRng,
    dtype: DType,
    /// Whether every third id is [`NO_ROW`] (a vocabulary shard's).
    no_row: bool,
}

impl Inputs {
    /// Values in [−1, 1) of `shape`, rounded to the dtype under test.
    fn tensor(&mut self, shape: &[usize]) -> HostTensor {
        self.tensor_in(shape, self.dtype)
    }

    /// Values in [−1, 1) of `shape` in `dtype`.
    fn tensor_in(&mut self, shape: &[usize], dtype: DType) -> HostTensor {
        let n: usize = shape.iter().product();
        let values: Vec<f32> = (0..n).map(|_| self.rng.random_range(-1.0..1.0)).collect();
        let mut bytes = vec![0u8; n * dtype.size()];
        // f32, bf16 and f16 all encode
        encode_f32(&values, dtype, &mut bytes).expect("a float dtype");
        HostTensor::new(dtype, shape.to_vec(), bytes)
    }

    /// `n` ids below `below`, every third [`NO_ROW`] in a shard's check.
    fn ids(&mut self, n: usize, below: usize) -> Vec<u32> {
        (0..n)
            .map(|t| match self.rng.random_range(0..below as u32) {
                _ if self.no_row && t % 3 == 1 => NO_ROW,
                id => id,
            })
            .collect()
    }
}

/// Run `$body` with `$b` bound to each backend in turn; the two results.
macro_rules! on_both {
    ($dut:expr, $cpu:expr, |$b:ident| $body:expr) => {{
        let first = {
            let $b = $dut;
            $body
        };
        let second = {
            let $b = $cpu;
            $body
        };
        (first, second)
    }};
}

/// The shape of the attention checks: 4 query heads in 2 groups of head dim 8.
const ATTENTION: AttentionShape = AttentionShape {
    heads: 4,
    groups: 2,
    head_dim: 8,
    scale: 0.353_553_4,
};

/// Rows of `segments`, each a sample of its own, for a dropout mask.
fn mask_rows(segments: &[Range<usize>]) -> Vec<RowAt> {
    (segments.iter().enumerate())
        .flat_map(|(s, seg)| {
            (0..seg.len() as u32).map(move |position| RowAt {
                sample: s as u64,
                position,
            })
        })
        .collect()
}

/// A dropout mask of probability 0.3 over `rows` at `site`.
fn mask_of(rows: &[RowAt], site: Site) -> Mask<'_> {
    Mask {
        seed: 7,
        rate: Rate::new(0.3).expect("0 < p < 1"),
        layer: 1,
        site,
        rows,
        first_head: 2,
    }
}

/// What a check returns: each backend's outputs, widened to f32.
type Outputs = (Vec<Vec<f32>>, Vec<Vec<f32>>);

/// One check: an operator (or a forward/backward pair) on fixed shapes.
struct Case<B> {
    name: &'static str,
    /// The operator whose support decides whether it runs.
    op: Op,
    shape: &'static str,
    /// Tolerance multiplier (long chains of roundings).
    slack: f32,
    /// Some ids or labels are [`NO_ROW`] ([`Inputs::no_row`]).
    no_row: bool,
    run: fn(&mut Inputs, &B, &Cpu) -> Result<Outputs>,
}

/// Every check, in report order.
fn cases<B: Backend>() -> Vec<Case<B>> {
    macro_rules! case {
        ($name:literal, $op:ident, $shape:literal, $slack:literal, $f:ident) => {
            case!($name, $op, $shape, $slack, $f, false)
        };
        ($name:literal, $op:ident, $shape:literal, $slack:literal, $f:ident, $no_row:literal) => {
            Case {
                name: $name,
                op: Op::$op,
                shape: $shape,
                slack: $slack,
                no_row: $no_row,
                run: $f::<B>,
            }
        };
    }
    // A vocabulary shard's check: `case!` with some ids or labels NO_ROW.
    macro_rules! shard {
        ($name:literal, $op:ident, $shape:literal, $f:ident) => {
            case!($name, $op, $shape, 1.0, $f, true)
        };
    }
    vec![
        case!("embedding", Embedding, "[37,24] × 13 ids", 1.0, embedding),
        shard!(
            "embedding",
            Embedding,
            "[37,24] × 13 ids, 4 NO_ROW",
            embedding
        ),
        case!(
            "embedding_bwd",
            EmbeddingBwd,
            "[13,24] → [37,24]",
            1.0,
            embedding_bwd
        ),
        shard!(
            "embedding_bwd",
            EmbeddingBwd,
            "[13,24] → [37,24], 4 NO_ROW",
            embedding_bwd
        ),
        case!("select_rows", Embedding, "[11,6] rows 3", 1.0, select_rows),
        case!(
            "index_add_rows",
            EmbeddingBwd,
            "[3,6] → [11,6] rows 3",
            1.0,
            index_add_rows
        ),
        case!(
            "softmax_topk",
            MoeRouting,
            "[9,6] top-3, a tie",
            1.0,
            softmax_topk
        ),
        case!(
            "permute",
            MoeRouting,
            "[5,24] top-2 of 3 experts, all routed",
            1.0,
            permute_all
        ),
        case!(
            "permute",
            MoeRouting,
            "[5,24] top-2 of 3 experts, 3 not routed",
            1.0,
            permute_some
        ),
        case!(
            "unpermute",
            MoeRouting,
            "[10,24] → [5,24] top-2, all routed",
            1.0,
            unpermute_all
        ),
        case!(
            "unpermute",
            MoeRouting,
            "[7,24] → [5,24] top-2, 3 not routed",
            1.0,
            unpermute_some
        ),
        case!(
            "permute_bwd",
            MoeRouting,
            "[10,24] → [5,24] top-2, all routed",
            1.0,
            permute_bwd_all
        ),
        case!(
            "permute_bwd",
            MoeRouting,
            "[7,24] → [5,24] top-2, 3 not routed",
            1.0,
            permute_bwd_some
        ),
        case!(
            "unpermute_bwd",
            MoeRouting,
            "[5,24] top-2 of 3 experts, all routed",
            1.0,
            unpermute_bwd_all
        ),
        case!(
            "unpermute_bwd",
            MoeRouting,
            "[5,24] top-2 of 3 experts, 3 not routed",
            1.0,
            unpermute_bwd_some
        ),
        case!("scale_rows", Add, "[7,24] · [7]", 1.0, scale_rows),
        case!("row_dots", Norm, "[7,24] · [7,24]", 1.0, row_dots),
        case!("rms_norm", RmsNorm, "[7,48]", 1.0, rms_norm),
        case!("rms_norm_bwd", RmsNormBwd, "[7,48]", 2.0, rms_norm_bwd),
        case!("rms_norm", RmsNorm, "[7,48] per head of 16", 1.0, head_norm),
        case!(
            "rms_norm_bwd",
            RmsNormBwd,
            "[7,48] per head of 16",
            2.0,
            head_norm_bwd
        ),
        case!("layer_norm", LayerNorm, "[7,48] with β", 1.0, layer_norm),
        case!(
            "layer_norm_bwd",
            LayerNormBwd,
            "[7,48] → dx, dγ, dβ",
            2.0,
            layer_norm_bwd
        ),
        case!("matmul", Matmul, "[9,40]·[24,40]ᵀ + bias", 1.0, matmul),
        case!("matmul n=1", Matmul, "[1,40]·[24,40]ᵀ", 1.0, matmul_row),
        case!(
            "matmul_bwd",
            MatmulBwd,
            "[9,24] → dx, dw, dbias",
            1.0,
            matmul_bwd
        ),
        case!(
            "grouped_matmul",
            GroupedMatmul,
            "[10,24] in groups 4,0,6 · 3×[16,24]ᵀ",
            1.0,
            grouped_matmul
        ),
        case!(
            "grouped_matmul_bwd",
            GroupedMatmul,
            "[10,16] → dx, dw of groups 1 and 3 of 3",
            1.0,
            grouped_matmul_bwd
        ),
        case!(
            "split_qkv",
            SplitQkv,
            "[5,64] 4 heads / 2 groups",
            1.0,
            split_qkv
        ),
        case!(
            "merge_qkv",
            SplitQkv,
            "[5,32] [5,16] [5,16]",
            1.0,
            merge_qkv
        ),
        case!(
            "gather / scatter",
            Gather,
            "[5,24] heads' parts, broadcast, back",
            1.0,
            gather_scatter
        ),
        case!("rope", Rope, "[6,32] d 8; d 16 rotating 8", 2.0, rope),
        case!("attention", Attention, "[10,32] 2 segments", 2.0, attention),
        case!(
            "attention_bwd",
            AttentionBwd,
            "[10,32] 2 segments",
            4.0,
            attention_bwd
        ),
        case!(
            "attention dropout",
            AttentionDropout,
            "[10,32] 2 segments, p 0.3",
            4.0,
            attention_dropout
        ),
        case!("dropout", Dropout, "[10,13] p 0.3", 1.0, dropout),
        case!(
            "cached_attention",
            CachedAttention,
            "2 slots, prefill 5+3, decode 1+1",
            2.0,
            cached_attention
        ),
        case!("swiglu", SwiGlu, "[7,40]", 1.0, swiglu),
        case!("swiglu_bwd", SwiGluBwd, "[7,20]", 1.0, swiglu_bwd),
        case!("squared_relu", SquaredRelu, "[7,20]", 1.0, squared_relu),
        case!(
            "squared_relu_bwd",
            SquaredRelu,
            "[7,20]",
            1.0,
            squared_relu_bwd
        ),
        case!("add_assign", Add, "[7,13]", 1.0, add_assign),
        case!("log_softmax", LogSoftmax, "[5,33]", 1.0, log_softmax),
        case!("cross_entropy", CrossEntropy, "[6,50]", 1.0, cross_entropy),
        shard!(
            "cross_entropy",
            CrossEntropy,
            "[6,50], 2 labels NO_ROW",
            cross_entropy
        ),
        case!(
            "cross_entropy_bwd",
            CrossEntropyBwd,
            "[6,50]",
            1.0,
            cross_entropy_bwd
        ),
        shard!(
            "cross_entropy_bwd",
            CrossEntropyBwd,
            "[6,50], 2 labels NO_ROW",
            cross_entropy_bwd
        ),
        case!("cast", Cast, "[7,11] → f32, bf16, f16", 1.0, cast),
        case!("copy_into", Cast, "[4,9] → f32", 1.0, copy_into),
        case!("round_to", Cast, "[7,11] f32 to bf16", 1.0, round_to),
        case!(
            "add_rounded",
            Add,
            "[7,11] += bf16 of [7,11]",
            1.0,
            add_rounded
        ),
        case!(
            "copy_range",
            Cast,
            "[4,9][7..30] → [40][3..26] f32, bf16",
            1.0,
            copy_range
        ),
        case!(
            "copy_transposed",
            Cast,
            "[4,9][2..26] as [4,6]ᵀ → [40][5..29] f32, bf16",
            1.0,
            copy_transposed
        ),
        case!("scaled", Add, "[5,7] · 0.37", 1.0, scaled),
        case!("scale", AdamW, "[5,7] ·= 0.37", 1.0, scale),
        case!("adamw", AdamW, "[33,7] step 3", 1.0, adamw),
        case!("sum_squares", Norm, "[7,5] [13] [3,3,3]", 1.0, sum_squares),
    ]
}

/// Every check of `dut` against the CPU backend (an operator's error is its check's failure).
pub fn run<B: Backend>(dut: &B) -> Result<Vec<Check>> {
    let cpu = Cpu;
    let mut checks = Vec::new();
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        for (i, case) in cases::<B>().into_iter().enumerate() {
            let mut inputs = Inputs {
                rng: StdRng::seed_from_u64(0x5e1f_7e57 + i as u64),
                dtype,
                no_row: case.no_row,
            };
            let supported = dut.supports(case.op, dtype) && cpu.supports(case.op, dtype);
            let (error, failure) = match supported.then(|| (case.run)(&mut inputs, dut, &cpu)) {
                None => (None, None),
                Some(Ok((got, want))) => (Some(error(&got, &want)), None),
                Some(Err(e)) => (Some(f32::INFINITY), Some(e.to_string())),
            };
            checks.push(Check {
                op: case.name,
                dtype,
                shape: case.shape.into(),
                error,
                failure,
                tolerance: tolerance(dtype) * case.slack,
            });
        }
    }
    Ok(checks)
}

fn embedding<B: Backend>(i: &mut Inputs, dut: &B, cpu: &Cpu) -> Result<Outputs> {
    let (table, ids) = (i.tensor(&[37, 24]), i.ids(13, 37));
    Ok(on_both!(dut, cpu, |b| {
        vec![b.download_f32(&b.embedding(&b.upload(&table)?, &ids)?)?]
    }))
}

fn embedding_bwd<B: Backend>(i: &mut Inputs, dut: &B, cpu: &Cpu) -> Result<Outputs> {
    let (dy, ids, start) = (i.tensor(&[13, 24]), i.ids(13, 37), i.tensor(&[37, 24]));
    Ok(on_both!(dut, cpu, |b| {
        let mut dtable = b.upload(&start)?;
        b.embedding_bwd(&b.upload(&dy)?, &ids, &mut dtable)?;
        vec![b.download_f32(&dtable)?]
    }))
}

fn select_rows<B: Backend>(i: &mut Inputs, dut: &B, cpu: &Cpu) -> Result<Outputs> {
    let x = i.tensor(&[11, 6]);
    Ok(on_both!(dut, cpu, |b| {
        vec![b.download_f32(&b.select_rows(&b.upload(&x)?, &[10, 0, 4])?)?]
    }))
}

fn index_add_rows<B: Backend>(i: &mut Inputs, dut: &B, cpu: &Cpu) -> Result<Outputs> {
    let (dst, src) = (i.tensor(&[11, 6]), i.tensor(&[3, 6]));
    Ok(on_both!(dut, cpu, |b| {
        let mut out = b.upload(&dst)?;
        b.index_add_rows(&mut out, &b.upload(&src)?, &[10, 0, 4])?;
        vec![b.download_f32(&out)?]
    }))
}

fn scale_rows<B: Backend>(i: &mut Inputs, dut: &B, cpu: &Cpu) -> Result<Outputs> {
    let x = i.tensor(&[7, 24]);
    let w = crate::tensor::host::to_f32(&i.tensor_in(&[7], DType::F32)).expect("f32");
    Ok(on_both!(dut, cpu, |b| {
        let w = b.upload_f32(&[7], &w)?;
        vec![b.download_f32(&b.scale_rows(&b.upload(&x)?, &w)?)?]
    }))
}

fn row_dots<B: Backend>(i: &mut Inputs, dut: &B, cpu: &Cpu) -> Result<Outputs> {
    let (x, y) = (i.tensor(&[7, 24]), i.tensor(&[7, 24]));
    Ok(on_both!(dut, cpu, |b| {
        vec![b.row_dots(&b.upload(&x)?, &b.upload(&y)?)?]
    }))
}

fn rms_norm<B: Backend>(i: &mut Inputs, dut: &B, cpu: &Cpu) -> Result<Outputs> {
    rms_norm_of(i, dut, cpu, 48)
}

/// Qwen3's q/k norm: each 16-wide head of a 48-wide row normed alone.
fn head_norm<B: Backend>(i: &mut Inputs, dut: &B, cpu: &Cpu) -> Result<Outputs> {
    rms_norm_of(i, dut, cpu, 16)
}

/// [`Backend::rms_norm`] of `[7, 48]` rows in groups of `width`.
fn rms_norm_of<B: Backend>(i: &mut Inputs, dut: &B, cpu: &Cpu, width: usize) -> Result<Outputs> {
    let (x, gamma) = (i.tensor(&[7, 48]), i.tensor(&[width]));
    Ok(on_both!(dut, cpu, |b| {
        let (y, rstd) = b.rms_norm(&b.upload(&x)?, &b.upload(&gamma)?, 1e-5)?;
        vec![b.download_f32(&y)?, b.download_f32(&rstd)?]
    }))
}

fn rms_norm_bwd<B: Backend>(i: &mut Inputs, dut: &B, cpu: &Cpu) -> Result<Outputs> {
    rms_norm_bwd_of(i, dut, cpu, 48)
}

/// The backward of [`head_norm`].
fn head_norm_bwd<B: Backend>(i: &mut Inputs, dut: &B, cpu: &Cpu) -> Result<Outputs> {
    rms_norm_bwd_of(i, dut, cpu, 16)
}

/// [`Backend::rms_norm_bwd`] of `[7, 48]` rows in groups of `width`.
fn rms_norm_bwd_of<B: Backend>(
    i: &mut Inputs,
    dut: &B,
    cpu: &Cpu,
    width: usize,
) -> Result<Outputs> {
    let (x, gamma, dy) = (i.tensor(&[7, 48]), i.tensor(&[width]), i.tensor(&[7, 48]));
    let dgamma = i.tensor_in(&[width], DType::F32);
    Ok(on_both!(dut, cpu, |b| {
        let (x, gamma) = (b.upload(&x)?, b.upload(&gamma)?);
        let (_, rstd) = b.rms_norm(&x, &gamma, 1e-5)?;
        let mut dg = b.upload(&dgamma)?;
        let dx = b.rms_norm_bwd(&b.upload(&dy)?, &x, &gamma, &rstd, Some(&mut dg))?;
        vec![b.download_f32(&dx)?, b.download_f32(&dg)?]
    }))
}

fn layer_norm<B: Backend>(i: &mut Inputs, dut: &B, cpu: &Cpu) -> Result<Outputs> {
    let (x, gamma, beta) = (i.tensor(&[7, 48]), i.tensor(&[48]), i.tensor(&[48]));
    Ok(on_both!(dut, cpu, |b| {
        let affine = (&b.upload(&gamma)?, &b.upload(&beta)?);
        let (y, stats) = b.layer_norm(&b.upload(&x)?, affine, 1e-5)?;
        vec![b.download_f32(&y)?, b.download_f32(&stats)?]
    }))
}

fn layer_norm_bwd<B: Backend>(i: &mut Inputs, dut: &B, cpu: &Cpu) -> Result<Outputs> {
    let (x, gamma, beta, dy) = (
        i.tensor(&[7, 48]),
        i.tensor(&[48]),
        i.tensor(&[48]),
        i.tensor(&[7, 48]),
    );
    let (dgamma, dbeta) = (
        i.tensor_in(&[48], DType::F32),
        i.tensor_in(&[48], DType::F32),
    );
    Ok(on_both!(dut, cpu, |b| {
        let (x, gamma) = (b.upload(&x)?, b.upload(&gamma)?);
        let (_, stats) = b.layer_norm(&x, (&gamma, &b.upload(&beta)?), 1e-5)?;
        let (mut dg, mut db) = (b.upload(&dgamma)?, b.upload(&dbeta)?);
        let grads = (Some(&mut dg), Some(&mut db));
        let dx = b.layer_norm_bwd((&b.upload(&dy)?, &x), &gamma, &stats, grads)?;
        vec![
            b.download_f32(&dx)?,
            b.download_f32(&dg)?,
            b.download_f32(&db)?,
        ]
    }))
}

fn matmul<B: Backend>(i: &mut Inputs, dut: &B, cpu: &Cpu) -> Result<Outputs> {
    let (x, w, bias) = (i.tensor(&[9, 40]), i.tensor(&[24, 40]), i.tensor(&[24]));
    Ok(on_both!(dut, cpu, |b| {
        let y = b.matmul(&b.upload(&x)?, &b.upload(&w)?, Some(&b.upload(&bias)?))?;
        vec![b.download_f32(&y)?]
    }))
}

fn matmul_row<B: Backend>(i: &mut Inputs, dut: &B, cpu: &Cpu) -> Result<Outputs> {
    let (x, w) = (i.tensor(&[1, 40]), i.tensor(&[24, 40]));
    Ok(on_both!(dut, cpu, |b| {
        let y = b.matmul(&b.upload(&x)?, &b.upload_matrix(&w)?, None)?;
        vec![b.download_f32(&y)?]
    }))
}

fn matmul_bwd<B: Backend>(i: &mut Inputs, dut: &B, cpu: &Cpu) -> Result<Outputs> {
    let (dy, x, w) = (i.tensor(&[9, 24]), i.tensor(&[9, 40]), i.tensor(&[24, 40]));
    let (dw, dbias) = (
        i.tensor_in(&[24, 40], DType::F32),
        i.tensor_in(&[24], DType::F32),
    );
    Ok(on_both!(dut, cpu, |b| {
        let (mut dw, mut db) = (b.upload(&dw)?, b.upload(&dbias)?);
        let dx = b.matmul_bwd(
            &b.upload(&dy)?,
            &b.upload(&x)?,
            &b.upload(&w)?,
            Some(&mut dw),
            Some(&mut db),
        )?;
        vec![
            b.download_f32(&dx)?,
            b.download_f32(&dw)?,
            b.download_f32(&db)?,
        ]
    }))
}

fn softmax_topk<B: Backend>(i: &mut Inputs, dut: &B, cpu: &Cpu) -> Result<Outputs> {
    let random = i.tensor(&[9, 6]);
    // row 4's two largest, columns 1 and 3, equal: the lower first
    let mut values = to_f32(&random).expect("a float dtype");
    (values[4 * 6 + 1], values[4 * 6 + 3]) = (2.0, 2.0);
    let logits = HostTensor::from_f32(i.dtype, vec![9, 6], &values).expect("a float dtype");
    Ok(on_both!(dut, cpu, |b| {
        let (experts, probs) = b.softmax_topk(&b.upload(&logits)?, 3)?;
        vec![experts.iter().map(|&e| e as f32).collect(), probs]
    }))
}

/// Five tokens' top-2 choices of three experts, in an order the sort must change; with
/// `routed` false three of them go nowhere (another rank's experts, dropped).
fn dispatch(routed: bool) -> Dispatch {
    let all = [2, 0, 1, 2, 0, 1, 2, 1, 0, 2];
    let choices = (all.iter().enumerate())
        .map(|(i, &e)| (routed || ![1, 4, 9].contains(&i)).then_some(e))
        .collect();
    Dispatch::new(choices, 2, 3).expect("whole tokens of three experts")
}

/// One of an MoE layer's token movements.
#[derive(Clone, Copy)]
enum Move {
    Permute,
    PermuteBwd,
    Unpermute,
    UnpermuteBwd,
}

/// `how` over [`dispatch`]`(routed)`: on a row per token where it takes tokens (the
/// permutation, the unpermutation's gradient), on a row per routed choice otherwise.
fn moved<B: Backend>(
    i: &mut Inputs,
    dut: &B,
    cpu: &Cpu,
    (how, routed): (Move, bool),
) -> Result<Outputs> {
    let d = dispatch(routed);
    let rows = match how {
        Move::Permute | Move::UnpermuteBwd => d.tokens(),
        Move::PermuteBwd | Move::Unpermute => d.len(),
    };
    let x = i.tensor(&[rows, 24]);
    Ok(on_both!(dut, cpu, |b| {
        let x = b.upload(&x)?;
        let y = match how {
            Move::Permute => b.permute(&x, &d)?,
            Move::PermuteBwd => b.permute_bwd(&x, &d)?,
            Move::Unpermute => b.unpermute(&x, &d)?,
            Move::UnpermuteBwd => b.unpermute_bwd(&x, &d)?,
        };
        vec![b.download_f32(&y)?]
    }))
}

fn permute_all<B: Backend>(i: &mut Inputs, dut: &B, cpu: &Cpu) -> Result<Outputs> {
    moved(i, dut, cpu, (Move::Permute, true))
}

fn permute_some<B: Backend>(i: &mut Inputs, dut: &B, cpu: &Cpu) -> Result<Outputs> {
    moved(i, dut, cpu, (Move::Permute, false))
}

fn permute_bwd_all<B: Backend>(i: &mut Inputs, dut: &B, cpu: &Cpu) -> Result<Outputs> {
    moved(i, dut, cpu, (Move::PermuteBwd, true))
}

fn permute_bwd_some<B: Backend>(i: &mut Inputs, dut: &B, cpu: &Cpu) -> Result<Outputs> {
    moved(i, dut, cpu, (Move::PermuteBwd, false))
}

fn unpermute_all<B: Backend>(i: &mut Inputs, dut: &B, cpu: &Cpu) -> Result<Outputs> {
    moved(i, dut, cpu, (Move::Unpermute, true))
}

fn unpermute_some<B: Backend>(i: &mut Inputs, dut: &B, cpu: &Cpu) -> Result<Outputs> {
    moved(i, dut, cpu, (Move::Unpermute, false))
}

fn unpermute_bwd_all<B: Backend>(i: &mut Inputs, dut: &B, cpu: &Cpu) -> Result<Outputs> {
    moved(i, dut, cpu, (Move::UnpermuteBwd, true))
}

fn unpermute_bwd_some<B: Backend>(i: &mut Inputs, dut: &B, cpu: &Cpu) -> Result<Outputs> {
    moved(i, dut, cpu, (Move::UnpermuteBwd, false))
}

/// The groups of the grouped matmul checks: one empty, as an expert no token chose.
const GROUPS: [usize; 3] = [4, 0, 6];

fn grouped_matmul<B: Backend>(i: &mut Inputs, dut: &B, cpu: &Cpu) -> Result<Outputs> {
    let x = i.tensor(&[10, 24]);
    let w: Vec<HostTensor> = (0..3).map(|_| i.tensor(&[16, 24])).collect();
    Ok(on_both!(dut, cpu, |b| {
        let w = w.iter().map(|w| b.upload(w)).collect::<Result<Vec<_>>>()?;
        let w: Vec<_> = w.iter().collect();
        vec![b.download_f32(&b.grouped_matmul(&b.upload(&x)?, &w, &GROUPS)?)?]
    }))
}

fn grouped_matmul_bwd<B: Backend>(i: &mut Inputs, dut: &B, cpu: &Cpu) -> Result<Outputs> {
    let (dy, x) = (i.tensor(&[10, 16]), i.tensor(&[10, 24]));
    let w: Vec<HostTensor> = (0..3).map(|_| i.tensor(&[16, 24])).collect();
    let dw: Vec<HostTensor> = (0..2).map(|_| i.tensor_in(&[16, 24], DType::F32)).collect();
    Ok(on_both!(dut, cpu, |b| {
        let w = w.iter().map(|w| b.upload(w)).collect::<Result<Vec<_>>>()?;
        let w: Vec<_> = w.iter().collect();
        let (mut dw0, mut dw2) = (b.upload(&dw[0])?, b.upload(&dw[1])?);
        let mut grads = [Some(&mut dw0), None, Some(&mut dw2)];
        let dx = b.grouped_matmul_bwd(&b.upload(&dy)?, &b.upload(&x)?, &w, &GROUPS, &mut grads)?;
        vec![
            b.download_f32(&dx)?,
            b.download_f32(&dw0)?,
            b.download_f32(&dw2)?,
        ]
    }))
}

fn split_qkv<B: Backend>(i: &mut Inputs, dut: &B, cpu: &Cpu) -> Result<Outputs> {
    let qkv = i.tensor(&[5, 64]);
    Ok(on_both!(dut, cpu, |b| {
        let (q, k, v) = b.split_qkv(&b.upload(&qkv)?, ATTENTION)?;
        vec![
            b.download_f32(&q)?,
            b.download_f32(&k)?,
            b.download_f32(&v)?,
        ]
    }))
}

fn merge_qkv<B: Backend>(i: &mut Inputs, dut: &B, cpu: &Cpu) -> Result<Outputs> {
    let (dq, dk, dv) = (i.tensor(&[5, 32]), i.tensor(&[5, 16]), i.tensor(&[5, 16]));
    Ok(on_both!(dut, cpu, |b| {
        let out = b.merge_qkv(&b.upload(&dq)?, &b.upload(&dk)?, &b.upload(&dv)?, ATTENTION)?;
        vec![b.download_f32(&out)?]
    }))
}

fn gather_scatter<B: Backend>(i: &mut Inputs, dut: &B, cpu: &Cpu) -> Result<Outputs> {
    let x = i.tensor(&[5, 24]);
    Ok(on_both!(dut, cpu, |b| {
        let x = b.upload(&x)?;
        // columns 2..5 of each of 4 heads of 6, then one 3-wide row part repeated over 4 heads
        let part = b.gather(&x, StridedView::columns(5, 24, (4, 6), 2, 3), &[5, 12])?;
        let repeated = StridedView {
            shape: [5, 4, 3],
            strides: [24, 0, 1],
            offset: 1,
        };
        let broadcast = b.gather(&x, repeated, &[5, 12])?;
        let mut back = b.zeros(&[5, 24], b.dtype(&x))?;
        b.scatter(&part, &mut back, StridedView::columns(5, 24, (4, 6), 1, 3))?;
        vec![
            b.download_f32(&part)?,
            b.download_f32(&broadcast)?,
            b.download_f32(&back)?,
        ]
    }))
}

fn rope<B: Backend>(i: &mut Inputs, dut: &B, cpu: &Cpu) -> Result<Outputs> {
    let (x, cos, sin) = (
        i.tensor(&[6, 32]),
        i.tensor_in(&[6, 4], DType::F32),
        i.tensor_in(&[6, 4], DType::F32),
    );
    Ok(on_both!(dut, cpu, |b| {
        let (cos, sin) = (b.upload(&cos)?, b.upload(&sin)?);
        let mut outs = Vec::new();
        // heads of 8 rotated whole, heads of 16 in their first 8 dimensions
        for head_dim in [8, 16] {
            let (mut fwd, mut inv) = (b.upload(&x)?, b.upload(&x)?);
            b.rope(&mut fwd, &cos, &sin, head_dim, false)?;
            b.rope(&mut inv, &cos, &sin, head_dim, true)?;
            outs.extend([b.download_f32(&fwd)?, b.download_f32(&inv)?]);
        }
        outs
    }))
}

/// Two sequences of 4 and 6 rows.
const SEGMENTS: [Range<usize>; 2] = [0..4, 4..10];

fn attention<B: Backend>(i: &mut Inputs, dut: &B, cpu: &Cpu) -> Result<Outputs> {
    let (q, k, v) = (
        i.tensor(&[10, 32]),
        i.tensor(&[10, 16]),
        i.tensor(&[10, 16]),
    );
    Ok(on_both!(dut, cpu, |b| {
        let (o, _) = b.attention(
            &b.upload(&q)?,
            &b.upload(&k)?,
            &b.upload(&v)?,
            &SEGMENTS,
            ATTENTION,
            None,
        )?;
        vec![b.download_f32(&o)?]
    }))
}

fn attention_bwd<B: Backend>(i: &mut Inputs, dut: &B, cpu: &Cpu) -> Result<Outputs> {
    attention_pass(i, (dut, cpu), None)
}

/// Attention with a dropout mask, forward and backward.
fn attention_dropout<B: Backend>(i: &mut Inputs, dut: &B, cpu: &Cpu) -> Result<Outputs> {
    let rows = mask_rows(&SEGMENTS);
    let mask = mask_of(&rows, Site::AttentionProbs);
    attention_pass(i, (dut, cpu), Some(&mask))
}

/// `o` of attention and its backward's `dq`, `dk`, `dv` through `dropout`'s mask.
fn attention_pass<B: Backend>(
    i: &mut Inputs,
    (dut, cpu): (&B, &Cpu),
    dropout: Option<&Mask>,
) -> Result<Outputs> {
    let (q, k, v) = (
        i.tensor(&[10, 32]),
        i.tensor(&[10, 16]),
        i.tensor(&[10, 16]),
    );
    let d_o = i.tensor(&[10, 32]);
    Ok(on_both!(dut, cpu, |b| {
        let (q, k, v) = (b.upload(&q)?, b.upload(&k)?, b.upload(&v)?);
        let (o, saved) = b.attention(&q, &k, &v, &SEGMENTS, ATTENTION, dropout)?;
        let (dq, dk, dv) = b.attention_bwd(
            &b.upload(&d_o)?,
            &q,
            &k,
            &v,
            &o,
            &saved,
            &SEGMENTS,
            ATTENTION,
            dropout,
        )?;
        vec![
            b.download_f32(&o)?,
            b.download_f32(&dq)?,
            b.download_f32(&dk)?,
            b.download_f32(&dv)?,
        ]
    }))
}

/// Hidden dropout of a `[10, 13]` tensor.
fn dropout<B: Backend>(i: &mut Inputs, dut: &B, cpu: &Cpu) -> Result<Outputs> {
    let x = i.tensor(&[10, 13]);
    let rows = mask_rows(&SEGMENTS);
    let mask = mask_of(&rows, Site::MlpOutput);
    Ok(on_both!(dut, cpu, |b| {
        vec![b.download_f32(&b.dropout(&b.upload(&x)?, &mask)?)?]
    }))
}

fn cached_attention<B: Backend>(i: &mut Inputs, dut: &B, cpu: &Cpu) -> Result<Outputs> {
    let prefill = [
        Segment {
            slot: 1,
            past: 0,
            len: 5,
        },
        Segment {
            slot: 0,
            past: 0,
            len: 3,
        },
    ];
    let decode = [
        Segment {
            slot: 1,
            past: 5,
            len: 1,
        },
        Segment {
            slot: 0,
            past: 3,
            len: 1,
        },
    ];
    let steps = [
        (
            prefill,
            i.tensor(&[8, 32]),
            i.tensor(&[8, 16]),
            i.tensor(&[8, 16]),
        ),
        (
            decode,
            i.tensor(&[2, 32]),
            i.tensor(&[2, 16]),
            i.tensor(&[2, 16]),
        ),
    ];
    Ok(on_both!(dut, cpu, |b| {
        let (mut kc, mut vc) = (b.kv_cache(2, 16, 16)?, b.kv_cache(2, 16, 16)?);
        let mut outs = Vec::new();
        for (segments, q, k, v) in &steps {
            b.kv_store(&mut kc, &b.upload(k)?, segments)?;
            b.kv_store(&mut vc, &b.upload(v)?, segments)?;
            let o = b.cached_attention(&b.upload(q)?, &kc, &vc, segments, ATTENTION)?;
            outs.push(b.download_f32(&o)?);
        }
        outs
    }))
}

fn swiglu<B: Backend>(i: &mut Inputs, dut: &B, cpu: &Cpu) -> Result<Outputs> {
    let x = i.tensor(&[7, 40]);
    Ok(on_both!(dut, cpu, |b| vec![
        b.download_f32(&b.swiglu(&b.upload(&x)?)?)?
    ]))
}

fn swiglu_bwd<B: Backend>(i: &mut Inputs, dut: &B, cpu: &Cpu) -> Result<Outputs> {
    let (dy, x) = (i.tensor(&[7, 20]), i.tensor(&[7, 40]));
    Ok(on_both!(dut, cpu, |b| {
        vec![b.download_f32(&b.swiglu_bwd(&b.upload(&dy)?, &b.upload(&x)?)?)?]
    }))
}

fn squared_relu<B: Backend>(i: &mut Inputs, dut: &B, cpu: &Cpu) -> Result<Outputs> {
    let x = i.tensor(&[7, 20]);
    Ok(on_both!(dut, cpu, |b| vec![
        b.download_f32(&b.squared_relu(&b.upload(&x)?)?)?
    ]))
}

fn squared_relu_bwd<B: Backend>(i: &mut Inputs, dut: &B, cpu: &Cpu) -> Result<Outputs> {
    let (dy, x) = (i.tensor(&[7, 20]), i.tensor(&[7, 20]));
    Ok(on_both!(dut, cpu, |b| {
        vec![b.download_f32(&b.squared_relu_bwd(&b.upload(&dy)?, &b.upload(&x)?)?)?]
    }))
}

fn add_assign<B: Backend>(i: &mut Inputs, dut: &B, cpu: &Cpu) -> Result<Outputs> {
    let (x, y) = (i.tensor(&[7, 13]), i.tensor(&[7, 13]));
    Ok(on_both!(dut, cpu, |b| {
        let mut x = b.upload(&x)?;
        b.add_assign(&mut x, &b.upload(&y)?)?;
        vec![b.download_f32(&x)?]
    }))
}

fn log_softmax<B: Backend>(i: &mut Inputs, dut: &B, cpu: &Cpu) -> Result<Outputs> {
    let x = i.tensor(&[5, 33]);
    Ok(on_both!(dut, cpu, |b| vec![
        b.download_f32(&b.log_softmax(&b.upload(&x)?)?)?
    ]))
}

fn cross_entropy<B: Backend>(i: &mut Inputs, dut: &B, cpu: &Cpu) -> Result<Outputs> {
    let (logits, labels) = (i.tensor(&[6, 50]), i.ids(6, 50));
    Ok(on_both!(dut, cpu, |b| {
        let (loss, lse) = b.cross_entropy(&b.upload(&logits)?, &labels)?;
        vec![b.download_f32(&loss)?, b.download_f32(&lse)?]
    }))
}

fn cross_entropy_bwd<B: Backend>(i: &mut Inputs, dut: &B, cpu: &Cpu) -> Result<Outputs> {
    let (logits, labels) = (i.tensor(&[6, 50]), i.ids(6, 50));
    let dloss = i.tensor_in(&[6], DType::F32);
    Ok(on_both!(dut, cpu, |b| {
        let logits = b.upload(&logits)?;
        let (_, lse) = b.cross_entropy(&logits, &labels)?;
        let d = b.cross_entropy_bwd(logits, &labels, &lse, &b.upload(&dloss)?)?;
        vec![b.download_f32(&d)?]
    }))
}

fn cast<B: Backend>(i: &mut Inputs, dut: &B, cpu: &Cpu) -> Result<Outputs> {
    let x = i.tensor(&[7, 11]);
    Ok(on_both!(dut, cpu, |b| {
        let x = b.upload(&x)?;
        let mut outs = Vec::new();
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            outs.push(b.download_f32(&b.cast(&x, dtype)?)?);
        }
        outs
    }))
}

fn copy_into<B: Backend>(i: &mut Inputs, dut: &B, cpu: &Cpu) -> Result<Outputs> {
    let src = i.tensor(&[4, 9]);
    Ok(on_both!(dut, cpu, |b| {
        let mut dst = b.zeros(&[4, 9], DType::F32)?;
        b.copy_into(&b.upload(&src)?, &mut dst)?;
        vec![b.download_f32(&dst)?]
    }))
}

fn round_to<B: Backend>(i: &mut Inputs, dut: &B, cpu: &Cpu) -> Result<Outputs> {
    let x = i.tensor_in(&[7, 11], DType::F32);
    Ok(on_both!(dut, cpu, |b| {
        let mut x = b.upload(&x)?;
        b.round_to(&mut x, DType::BF16)?;
        vec![b.download_f32(&x)?]
    }))
}

fn add_rounded<B: Backend>(i: &mut Inputs, dut: &B, cpu: &Cpu) -> Result<Outputs> {
    let (sum, x) = (
        i.tensor_in(&[7, 11], DType::F32),
        i.tensor_in(&[7, 11], DType::F32),
    );
    Ok(on_both!(dut, cpu, |b| {
        let mut sum = b.upload(&sum)?;
        b.add_rounded(&mut sum, &b.upload(&x)?, DType::BF16)?;
        vec![b.download_f32(&sum)?]
    }))
}

fn copy_range<B: Backend>(i: &mut Inputs, dut: &B, cpu: &Cpu) -> Result<Outputs> {
    copies(i, dut, cpu, false)
}

fn copy_transposed<B: Backend>(i: &mut Inputs, dut: &B, cpu: &Cpu) -> Result<Outputs> {
    copies(i, dut, cpu, true)
}

/// Elements of a `[4, 9]` tensor copied into an f32 and a bf16 one: `[7..30]` to `[3..26]`, or
/// `[2..26]` read as `[4, 6]` and transposed to `[5..29]`.
fn copies<B: Backend>(i: &mut Inputs, dut: &B, cpu: &Cpu, transposed: bool) -> Result<Outputs> {
    let src = i.tensor(&[4, 9]);
    Ok(on_both!(dut, cpu, |b| {
        let src = b.upload(&src)?;
        let mut outs = Vec::new();
        for dtype in [DType::F32, DType::BF16] {
            let mut dst = b.upload_f32(&[40], &[0.5; 40])?;
            dst = b.cast(&dst, dtype)?;
            match transposed {
                false => b.copy_range((&src, 7), (&mut dst, 3), 23)?,
                true => b.copy_transposed((&src, 2), (4, 6), (&mut dst, 5))?,
            }
            outs.push(b.download_f32(&dst)?);
        }
        outs
    }))
}

fn scaled<B: Backend>(i: &mut Inputs, dut: &B, cpu: &Cpu) -> Result<Outputs> {
    let x = i.tensor(&[5, 7]);
    Ok(on_both!(dut, cpu, |b| vec![
        b.download_f32(&b.scaled(&b.upload(&x)?, 0.37)?)?
    ]))
}

fn scale<B: Backend>(i: &mut Inputs, dut: &B, cpu: &Cpu) -> Result<Outputs> {
    let x = i.tensor(&[5, 7]);
    Ok(on_both!(dut, cpu, |b| {
        let mut x = b.upload(&x)?;
        b.scale(&mut x, 0.37)?;
        vec![b.download_f32(&x)?]
    }))
}

fn adamw<B: Backend>(i: &mut Inputs, dut: &B, cpu: &Cpu) -> Result<Outputs> {
    let (p, g, m) = (i.tensor(&[33, 7]), i.tensor(&[33, 7]), i.tensor(&[33, 7]));
    let v_values: Vec<f32> = (0..33 * 7).map(|_| i.rng.random_range(0.0..0.01)).collect();
    let step = AdamWStep {
        lr: 1e-3,
        betas: (0.9, 0.95),
        eps: 1e-8,
        weight_decay: 0.1,
        step: 3,
        grad_scale: 0.5,
    };
    Ok(on_both!(dut, cpu, |b| {
        let (mut p, mut g, mut m) = (b.upload(&p)?, b.upload(&g)?, b.upload(&m)?);
        let mut v = b.upload_f32(&[33, 7], &v_values)?;
        let mut model = b.zeros(&[33, 7], DType::BF16)?;
        b.adamw(&mut p, &mut g, (&mut m, &mut v), step, Some(&mut model))?;
        vec![
            b.download_f32(&p)?,
            b.download_f32(&g)?,
            b.download_f32(&m)?,
            b.download_f32(&v)?,
            b.download_f32(&model)?,
        ]
    }))
}

fn sum_squares<B: Backend>(i: &mut Inputs, dut: &B, cpu: &Cpu) -> Result<Outputs> {
    let xs = [i.tensor(&[7, 5]), i.tensor(&[13]), i.tensor(&[3, 3, 3])];
    Ok(on_both!(dut, cpu, |b| {
        let ts = xs.iter().map(|x| b.upload(x)).collect::<Result<Vec<_>>>()?;
        vec![vec![b.sum_squares(&ts.iter().collect::<Vec<_>>())? as f32]]
    }))
}

/// The table `mindkit selftest` prints under `title`, and its last line: how many passed and
/// failed.
pub fn report(title: &str, device: &str, checks: &[Check]) -> String {
    let mut out = format!(
        "{title}\n{:<20} {:<5} {:<40} {:>10} {:>9}  result\n",
        "op", "dtype", "shape", "error", "tolerance"
    );
    for c in checks {
        let (error, result) = match c.error {
            None => ("-".to_string(), "not supported"),
            Some(e) => (format!("{e:.2e}"), if c.passed() { "ok" } else { "FAIL" }),
        };
        let dtype = format!("{:?}", c.dtype).to_lowercase();
        out += &format!(
            "{:<20} {:<5} {:<40} {:>10} {:>9.1e}  {result}\n",
            c.op, dtype, c.shape, error, c.tolerance
        );
        if let Some(why) = &c.failure {
            out += &format!("    {why}\n");
        }
    }
    let ran = checks.iter().filter(|c| c.error.is_some()).count();
    let failed = checks.iter().filter(|c| !c.passed()).count();
    out += &format!(
        "selftest: {} of {ran} checks passed, {failed} failed, {} not supported by {device}\n",
        ran - failed,
        checks.len() - ran
    );
    out
}

/// Finite-difference step of [`gradients`].
const STEP: f32 = 1e-3;
/// Tolerance of an analytic gradient against central differences of an f32 computation.
const GRADIENT_TOLERANCE: f32 = 5e-3;

/// The CPU backend's backward operators against central differences of its forward
/// operators, f32 (`mindkit selftest --device cpu`): for each pair, the gradient of
/// `Σ dy ∘ forward(inputs)` with respect to every input.
pub fn gradients() -> Result<Vec<Check>> {
    let b = Cpu;
    let mut i = Inputs {
        rng: StdRng::seed_from_u64(0x9_7ad),
        dtype: DType::F32,
        no_row: false,
    };
    let mut values =
        |n: usize| -> Vec<f32> { (0..n).map(|_| i.rng.random_range(-1.0..1.0)).collect() };
    let dot = |a: &[f32], b: &[f32]| {
        a.iter()
            .zip(b)
            .map(|(x, y)| f64::from(*x) * f64::from(*y))
            .sum::<f64>()
    };
    let up = |shape: &[usize], v: &[f32]| b.upload_f32(shape, v);
    let mut checks = Vec::new();

    // rms_norm: x [3, 8], γ [8]
    let (x, g, dy, eps) = (values(24), values(8), values(24), 1e-5);
    let fwd = |v: &[Vec<f32>]| -> Result<f64> {
        let (y, _) = b.rms_norm(&up(&[3, 8], &v[0])?, &up(&[8], &v[1])?, eps)?;
        Ok(dot(&b.download_f32(&y)?, &dy))
    };
    let (xt, gt) = (up(&[3, 8], &x)?, up(&[8], &g)?);
    let (_, rstd) = b.rms_norm(&xt, &gt, eps)?;
    let mut dg = b.zeros(&[8], DType::F32)?;
    let dx = b.rms_norm_bwd(&up(&[3, 8], &dy)?, &xt, &gt, &rstd, Some(&mut dg))?;
    let analytic = vec![b.download_f32(&dx)?, b.download_f32(&dg)?];
    checks.push(gradient_check(
        "rms_norm_bwd",
        "[3,8]",
        &[x, g],
        fwd,
        &analytic,
    )?);

    // matmul: x [3, 5], w [4, 5], bias [4]
    let (x, w, bias, dy) = (values(15), values(20), values(4), values(12));
    let fwd = |v: &[Vec<f32>]| -> Result<f64> {
        let y = b.matmul(
            &up(&[3, 5], &v[0])?,
            &up(&[4, 5], &v[1])?,
            Some(&up(&[4], &v[2])?),
        )?;
        Ok(dot(&b.download_f32(&y)?, &dy))
    };
    let (mut dw, mut db) = (b.zeros(&[4, 5], DType::F32)?, b.zeros(&[4], DType::F32)?);
    let dx = b.matmul_bwd(
        &up(&[3, 4], &dy)?,
        &up(&[3, 5], &x)?,
        &up(&[4, 5], &w)?,
        Some(&mut dw),
        Some(&mut db),
    )?;
    let analytic = vec![
        b.download_f32(&dx)?,
        b.download_f32(&dw)?,
        b.download_f32(&db)?,
    ];
    checks.push(gradient_check(
        "matmul_bwd",
        "[3,5]·[4,5]ᵀ + bias",
        &[x, w, bias],
        fwd,
        &analytic,
    )?);

    // rope: x [2, 8] (two heads of 4), cos/sin [2, 2]
    let (x, angles, dy) = (values(16), values(4), values(16));
    let cos: Vec<f32> = angles.iter().map(|a| (a * 3.0).cos()).collect();
    let sin: Vec<f32> = angles.iter().map(|a| (a * 3.0).sin()).collect();
    let (ct, st) = (up(&[2, 2], &cos)?, up(&[2, 2], &sin)?);
    let fwd = |v: &[Vec<f32>]| -> Result<f64> {
        let mut y = up(&[2, 8], &v[0])?;
        b.rope(&mut y, &ct, &st, 4, false)?;
        Ok(dot(&b.download_f32(&y)?, &dy))
    };
    let mut dx = up(&[2, 8], &dy)?;
    b.rope(&mut dx, &ct, &st, 4, true)?;
    checks.push(gradient_check(
        "rope (inverse)",
        "[2,8] d 4",
        &[x],
        fwd,
        &[b.download_f32(&dx)?],
    )?);

    // attention: 4 heads in 2 groups of 8, two sequences of 2 and 3 rows
    let segments = [0..2, 2..5];
    let (q, k, v, dy) = (
        values(5 * 32),
        values(5 * 16),
        values(5 * 16),
        values(5 * 32),
    );
    // and again through a fixed dropout mask (p 0.3).
    let rows = mask_rows(&segments);
    let mask = mask_of(&rows, Site::AttentionProbs);
    for (dropout, shape) in [
        (None, "[5,32] 2 segments"),
        (Some(&mask), "[5,32] 2 segments, dropout 0.3"),
    ] {
        let fwd = |t: &[Vec<f32>]| -> Result<f64> {
            let (o, _) = b.attention(
                &up(&[5, 32], &t[0])?,
                &up(&[5, 16], &t[1])?,
                &up(&[5, 16], &t[2])?,
                &segments,
                ATTENTION,
                dropout,
            )?;
            Ok(dot(&b.download_f32(&o)?, &dy))
        };
        let (qt, kt, vt) = (up(&[5, 32], &q)?, up(&[5, 16], &k)?, up(&[5, 16], &v)?);
        let (o, lse) = b.attention(&qt, &kt, &vt, &segments, ATTENTION, dropout)?;
        let (dq, dk, dv) = b.attention_bwd(
            &up(&[5, 32], &dy)?,
            &qt,
            &kt,
            &vt,
            &o,
            &lse,
            &segments,
            ATTENTION,
            dropout,
        )?;
        let analytic = vec![
            b.download_f32(&dq)?,
            b.download_f32(&dk)?,
            b.download_f32(&dv)?,
        ];
        checks.push(gradient_check(
            "attention_bwd",
            shape,
            &[q.clone(), k.clone(), v.clone()],
            fwd,
            &analytic,
        )?);
    }

    // hidden dropout: its own backward, the same product, through a fixed mask
    let (x, dy) = (values(5 * 6), values(5 * 6));
    let mask = mask_of(&rows, Site::AttentionOutput);
    let fwd = |v: &[Vec<f32>]| -> Result<f64> {
        Ok(dot(
            &b.download_f32(&b.dropout(&up(&[5, 6], &v[0])?, &mask)?)?,
            &dy,
        ))
    };
    let dx = b.dropout(&up(&[5, 6], &dy)?, &mask)?;
    checks.push(gradient_check(
        "dropout",
        "[5,6] p 0.3",
        &[x],
        fwd,
        &[b.download_f32(&dx)?],
    )?);

    // swiglu: x [3, 8]
    let (x, dy) = (values(24), values(12));
    let fwd = |v: &[Vec<f32>]| -> Result<f64> {
        Ok(dot(&b.download_f32(&b.swiglu(&up(&[3, 8], &v[0])?)?)?, &dy))
    };
    let dx = b.swiglu_bwd(&up(&[3, 4], &dy)?, &up(&[3, 8], &x)?)?;
    checks.push(gradient_check(
        "swiglu_bwd",
        "[3,8]",
        &[x],
        fwd,
        &[b.download_f32(&dx)?],
    )?);

    // squared relu: x [3, 8]
    let (x, dy) = (values(24), values(24));
    let fwd = |v: &[Vec<f32>]| -> Result<f64> {
        Ok(dot(
            &b.download_f32(&b.squared_relu(&up(&[3, 8], &v[0])?)?)?,
            &dy,
        ))
    };
    let dx = b.squared_relu_bwd(&up(&[3, 8], &dy)?, &up(&[3, 8], &x)?)?;
    checks.push(gradient_check(
        "squared_relu_bwd",
        "[3,8]",
        &[x],
        fwd,
        &[b.download_f32(&dx)?],
    )?);

    // cross entropy: logits [3, 7]
    let (logits, dloss) = (values(21), values(3));
    let labels = [6, 0, 3];
    let fwd = |v: &[Vec<f32>]| -> Result<f64> {
        let (loss, _) = b.cross_entropy(&up(&[3, 7], &v[0])?, &labels)?;
        Ok(dot(&b.download_f32(&loss)?, &dloss))
    };
    let lt = up(&[3, 7], &logits)?;
    let (_, lse) = b.cross_entropy(&lt, &labels)?;
    let d = b.cross_entropy_bwd(lt, &labels, &lse, &up(&[3], &dloss)?)?;
    checks.push(gradient_check(
        "cross_entropy_bwd",
        "[3,7]",
        &[logits],
        fwd,
        &[b.download_f32(&d)?],
    )?);

    // embedding: table [5, 4], 6 ids (repeats)
    let (table, dy) = (values(20), values(24));
    let ids = [4, 1, 4, 0, 2, 4];
    let fwd = |v: &[Vec<f32>]| -> Result<f64> {
        Ok(dot(
            &b.download_f32(&b.embedding(&up(&[5, 4], &v[0])?, &ids)?)?,
            &dy,
        ))
    };
    let mut dt = b.zeros(&[5, 4], DType::F32)?;
    b.embedding_bwd(&up(&[6, 4], &dy)?, &ids, &mut dt)?;
    checks.push(gradient_check(
        "embedding_bwd",
        "[5,4] × 6 ids",
        &[table],
        fwd,
        &[b.download_f32(&dt)?],
    )?);
    Ok(checks)
}

/// One gradient check: `analytic[j]` against central differences of `loss` in `inputs[j]`.
fn gradient_check(
    op: &'static str,
    shape: &str,
    inputs: &[Vec<f32>],
    loss: impl Fn(&[Vec<f32>]) -> Result<f64>,
    analytic: &[Vec<f32>],
) -> Result<Check> {
    let mut numeric = Vec::new();
    let mut probe = inputs.to_vec();
    for (j, input) in inputs.iter().enumerate() {
        let mut grad = Vec::with_capacity(input.len());
        for (e, &value) in input.iter().enumerate() {
            probe[j][e] = value + STEP;
            let up = loss(&probe)?;
            probe[j][e] = value - STEP;
            let down = loss(&probe)?;
            probe[j][e] = value;
            grad.push(((up - down) / (2.0 * f64::from(STEP))) as f32);
        }
        numeric.push(grad);
    }
    Ok(Check {
        op,
        dtype: DType::F32,
        shape: shape.into(),
        error: Some(error(analytic, &numeric)),
        failure: None,
        tolerance: GRADIENT_TOLERANCE,
    })
}
