//! Causal grouped-query attention over packed sequences. Where CANN has flash attention
//! (aclnnFlashAttentionVarLenScore and aclnnFlashAttentionUnpaddingScoreGrad: layout TND,
//! right-down causal sparse mode 3) it runs fused. Where CANN lacks either function, or a
//! kernel of them for the SoC (aclnn's 561003: flash attention is an Atlas A2/A3 training-part
//! operator), the same computation runs one sequence at a time as aclnnBatchMatMul (per head of
//! each query group against the group's keys) + aclnnInplaceMuls + aclnnInplaceMaskedFillScalar
//! (the causal mask) + aclnnSoftmax, its backward as aclnnSoftmaxBackward and BatchMatMuls; the
//! probabilities `[heads, len, kv_len]` are materialised (the memory flash attention saves) and
//! recomputed by the backward, so flash attention's saved statistics are then left unwritten.

use super::{empty_view, softmax_stats, Npu, NpuTensor, CAUSAL_MASK};
use crate::engine::dropout::Mask;
use crate::engine::{AttentionShape, Backend, Device, Result};
use crate::npu::descriptor::View;
use crate::tensor::DType;

/// Flash attention's band (ignored in the causal sparse modes; MindSpeed's values).
const PRE_TOKENS: i64 = 65536;
/// See [`PRE_TOKENS`].
const NEXT_TOKENS: i64 = 0;
/// Flash attention's right-down causal sparse mode.
const RIGHT_DOWN_CAUSAL: i64 = 3;

/// One sequence of an attention call: its `len` query rows start at element `q_at` of the
/// query-side tensors (rows of heads·d), its `kv_len` key rows at element `kv_at` of the
/// key-side ones (rows of groups·d); query `i` sees keys `0..=kv_len − len + i`.
#[derive(Clone, Copy)]
pub(super) struct Sequence {
    pub q_at: usize,
    pub kv_at: usize,
    pub len: usize,
    pub kv_len: usize,
}

/// Flash attention's inputs: the query, key, value views (TND) and the cumulative sequence
/// lengths of the queries and of the keys.
pub(super) type FlashInputs<'a> = ((&'a View, &'a View, &'a View), (&'a [i64], &'a [i64]));

/// The views the fallback computes through, for one sequence.
struct Heads {
    s: AttentionShape,
    len: usize,
    kv_len: usize,
}

impl Heads {
    fn per_group(&self) -> usize {
        self.s.heads / self.s.groups
    }

    /// Head `j` of each group of the query-side rows at `at`, as `[groups, len, d]`.
    fn query(&self, base: &View, at: usize, j: usize) -> View {
        let d = self.s.head_dim;
        let strides = [(self.per_group() * d) as i64, (self.s.heads * d) as i64, 1];
        base.strided(&[self.s.groups, self.len, d], &strides, at + j * d)
    }

    /// The key-side rows at `at`, as `[groups, kv_len, d]` or, transposed, `[groups, d, kv_len]`.
    fn keys(&self, base: &View, at: usize, transposed: bool) -> View {
        let (g, d) = (self.s.groups, self.s.head_dim);
        let width = (g * d) as i64;
        if transposed {
            base.strided(&[g, d, self.kv_len], &[d as i64, 1, width], at)
        } else {
            base.strided(&[g, self.kv_len, d], &[d as i64, width, 1], at)
        }
    }

    /// Head `j` of each group of a `[heads, len, kv_len]` tensor, as `[groups, len, kv_len]`
    /// or, transposed, `[groups, kv_len, len]`.
    fn scores(&self, t: &NpuTensor, j: usize, transposed: bool) -> View {
        let (g, l, lk) = (self.s.groups, self.len, self.kv_len);
        let group = (self.per_group() * l * lk) as i64;
        if transposed {
            t.view()
                .strided(&[g, lk, l], &[group, 1, lk as i64], j * l * lk)
        } else {
            t.view()
                .strided(&[g, l, lk], &[group, lk as i64, 1], j * l * lk)
        }
    }

    fn score_shape(&self) -> [usize; 3] {
        [self.s.heads, self.len, self.kv_len]
    }
}

impl Npu {
    /// The causal mask (BOOL, 1 above the diagonal) of a side of at least `kv_len` and of
    /// 2048 (flash attention's compressed mask), and its side.
    pub(super) fn causal_mask(&self, kv_len: usize) -> Result<(View, usize)> {
        let mut mask = self.causal_mask.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(m) = mask.as_ref().filter(|m| m.shape[0] >= kv_len) {
            return Ok((m.view(), m.shape[0]));
        }
        let side = kv_len.max(1).next_multiple_of(CAUSAL_MASK);
        let bytes = (0..side * side)
            .map(|i| u8::from(i % side > i / side))
            .collect();
        let m = mask.insert(self.upload_bytes(&[side, side], DType::Bool, bytes)?);
        Ok((m.view(), side))
    }

    /// Flash attention's compressed causal mask, `[2048, 2048]`.
    fn flash_mask(&self) -> Result<View> {
        let (mask, side) = self.causal_mask(CAUSAL_MASK)?;
        let side = side as i64;
        Ok(mask.strided(&[CAUSAL_MASK, CAUSAL_MASK], &[side, 1], 0))
    }

    /// Causal flash attention over packed sequences (TND): query rows `q [tq, heads, d]`
    /// against `k`, `v [tk, groups, d]`; writes `out` and the softmax statistics
    /// `stats [2, tq, heads, 8]`. `Ok(false)` when CANN has no flash attention.
    pub(super) fn flash_attention(
        &self,
        ((q, k, v), (cum_q, cum_kv)): FlashInputs,
        s: AttentionShape,
        stats: &NpuTensor,
        out: &View,
    ) -> Result<bool> {
        let op = self.ctx.op;
        let (Some(prepare), Some(launch)) = (
            op.aclnnFlashAttentionVarLenScoreGetWorkspaceSize,
            op.aclnnFlashAttentionVarLenScore,
        ) else {
            return Ok(false);
        };
        let c = &self.ctx;
        let (max, sum) = softmax_stats(stats);
        let (qd, kd, vd) = (c.tensor(q)?, c.tensor(k)?, c.tensor(v)?);
        let mask = c.tensor(&self.flash_mask()?)?;
        let (sq, skv) = (c.int_array(cum_q)?, c.int_array(cum_kv)?);
        let (max, sum, o) = (c.tensor(&max)?, c.tensor(&sum)?, c.tensor(out)?);
        let unused = c.tensor(&empty_view(stats))?;
        let mut layout = *b"TND\0";
        let null = std::ptr::null();
        let done = c.run(
            "aclnnFlashAttentionVarLenScore",
            // SAFETY: every descriptor outlives the launch; ws and ex are valid out-pointers.
            |ws, ex| unsafe {
                prepare(
                    qd.raw,
                    kd.raw,
                    vd.raw,
                    null,
                    null,
                    null,
                    mask.raw,
                    std::ptr::null(),
                    sq.raw,
                    skv.raw,
                    f64::from(s.scale),
                    1.0,
                    PRE_TOKENS,
                    NEXT_TOKENS,
                    s.heads as i64,
                    layout.as_mut_ptr().cast(),
                    0,
                    RIGHT_DOWN_CAUSAL,
                    max.raw,
                    sum.raw,
                    unused.raw,
                    o.raw,
                    ws,
                    ex,
                )
            },
            launch,
        );
        self.flash.outcome("aclnnFlashAttentionVarLenScore", done)
    }

    /// `(dq, dk, dv)` of [`Npu::flash_attention`] from `d_o` and its saved `o` and `stats`
    /// (every view `[t, heads or groups, d]`). `Ok(false)` when CANN has no flash attention.
    pub(super) fn flash_attention_grad(
        &self,
        ((q, k, v), cum): FlashInputs,
        (d_o, o, stats): (&View, &View, &NpuTensor),
        (dq, dk, dv): (&View, &View, &View),
        s: AttentionShape,
    ) -> Result<bool> {
        let op = self.ctx.op;
        let (Some(prepare), Some(launch)) = (
            op.aclnnFlashAttentionUnpaddingScoreGradGetWorkspaceSize,
            op.aclnnFlashAttentionUnpaddingScoreGrad,
        ) else {
            return Ok(false);
        };
        let c = &self.ctx;
        let (max, sum) = softmax_stats(stats);
        let (qd, kd, vd) = (c.tensor(q)?, c.tensor(k)?, c.tensor(v)?);
        let (dyd, od) = (c.tensor(d_o)?, c.tensor(o)?);
        let (max, sum) = (c.tensor(&max)?, c.tensor(&sum)?);
        let mask = c.tensor(&self.flash_mask()?)?;
        let (sq, skv) = (c.int_array(cum.0)?, c.int_array(cum.1)?);
        let (dqd, dkd, dvd) = (c.tensor(dq)?, c.tensor(dk)?, c.tensor(dv)?);
        let (softmax_in, dpse) = (c.tensor(&empty_view(stats))?, c.tensor(&empty_view(stats))?);
        let mut layout = *b"TND\0";
        let null = std::ptr::null();
        let done = c.run(
            "aclnnFlashAttentionUnpaddingScoreGrad",
            // SAFETY: every descriptor outlives the launch; ws and ex are valid out-pointers.
            |ws, ex| unsafe {
                prepare(
                    qd.raw,
                    kd.raw,
                    vd.raw,
                    dyd.raw,
                    null,
                    null,
                    null,
                    mask.raw,
                    max.raw,
                    sum.raw,
                    softmax_in.raw,
                    od.raw,
                    std::ptr::null(),
                    sq.raw,
                    skv.raw,
                    f64::from(s.scale),
                    1.0,
                    PRE_TOKENS,
                    NEXT_TOKENS,
                    s.heads as i64,
                    layout.as_mut_ptr().cast(),
                    0,
                    RIGHT_DOWN_CAUSAL,
                    dqd.raw,
                    dkd.raw,
                    dvd.raw,
                    dpse.raw,
                    ws,
                    ex,
                )
            },
            launch,
        );
        self.flash
            .outcome("aclnnFlashAttentionUnpaddingScoreGrad", done)
    }

    /// One sequence's attention without flash attention: `out` (query-side rows) from `q`
    /// (query-side), `k` and `v` (key-side), all views of whole tensors.
    pub(super) fn attention_by_matmul(
        &self,
        (q, k, v): (&View, &View, &View),
        seq: Sequence,
        (s, dtype, dropout): (AttentionShape, DType, Option<&Mask>),
        out: &View,
    ) -> Result<()> {
        let h = Heads {
            s,
            len: seq.len,
            kv_len: seq.kv_len,
        };
        let mut p = self.probabilities(&h, (q, k), seq, dtype)?;
        if let Some(factors) = self.dropout_factors(&h, seq, dropout)? {
            p = self.times(&p, &factors)?;
        }
        let p = self.converted(p, dtype)?;
        for j in 0..h.per_group() {
            let o = h.query(out, seq.q_at, j);
            self.bmm(&h.scores(&p, j, false), &h.keys(v, seq.kv_at, false), &o)?;
        }
        Ok(())
    }

    /// `(dq, dk, dv)` of one sequence of [`Npu::attention_by_matmul`] from `d_o`, written into
    /// the sequence's rows of `grads` (views of whole tensors).
    pub(super) fn attention_bwd_by_matmul(
        &self,
        (d_o, q, k, v): (&View, &View, &View, &View),
        seq: Sequence,
        (s, dtype, dropout): (AttentionShape, DType, Option<&Mask>),
        (dq, dk, dv): (&View, &View, &View),
    ) -> Result<()> {
        let h = Heads {
            s,
            len: seq.len,
            kv_len: seq.kv_len,
        };
        let p32 = self.probabilities(&h, (q, k), seq, dtype)?;
        let dp = self.empty(&h.score_shape(), dtype)?;
        for j in 0..h.per_group() {
            let dy = h.query(d_o, seq.q_at, j);
            self.bmm(&dy, &h.keys(v, seq.kv_at, true), &h.scores(&dp, j, false))?;
        }
        let mut ds = self.empty(&h.score_shape(), DType::F32)?;
        let mut dp = self.converted(dp, DType::F32)?;
        // Under dropout `O = (P ∘ M)·V`: `dP = (dO·Vᵀ) ∘ M`, the softmax's backward from the
        // undropped `P`, and `dV = (P ∘ M)ᵀ·dO`.
        let factors = self.dropout_factors(&h, seq, dropout)?;
        if let Some(f) = &factors {
            dp = self.times(&dp, f)?;
        }
        self.softmax_bwd(&dp.view(), &p32.view(), &ds.view())?;
        self.scale(&mut ds, s.scale)?;
        let p = match &factors {
            Some(f) => self.times(&p32, f)?,
            None => p32,
        };
        let (ds, p) = (self.converted(ds, dtype)?, self.converted(p, dtype)?);
        // dk and dv sum over the heads of a group: the first head writes, the others add.
        let part = self.empty(&[s.groups, seq.kv_len, s.head_dim], dtype)?;
        for j in 0..h.per_group() {
            let (qj, dyj) = (h.query(q, seq.q_at, j), h.query(d_o, seq.q_at, j));
            let dqj = h.query(dq, seq.q_at, j);
            self.bmm(&h.scores(&ds, j, false), &h.keys(k, seq.kv_at, false), &dqj)?;
            let (dkg, dvg) = (h.keys(dk, seq.kv_at, false), h.keys(dv, seq.kv_at, false));
            let target = |g: &View| if j == 0 { g.clone() } else { part.view() };
            self.bmm(&h.scores(&ds, j, true), &qj, &target(&dkg))?;
            if j > 0 {
                self.add_view(&dkg, &part.view())?;
            }
            self.bmm(&h.scores(&p, j, true), &dyj, &target(&dvg))?;
            if j > 0 {
                self.add_view(&dvg, &part.view())?;
            }
        }
        Ok(())
    }

    /// The softmax probabilities `[heads, len, kv_len]` (f32) of one sequence's scaled,
    /// causally masked scores: the scores come from BatchMatMul in the inputs' dtype, the
    /// softmax runs in f32 (as flash attention's does, and Megatron's unfused softmax with
    /// `--attention-softmax-in-fp32`).
    fn probabilities(
        &self,
        h: &Heads,
        (q, k): (&View, &View),
        seq: Sequence,
        dtype: DType,
    ) -> Result<NpuTensor> {
        let scores = self.empty(&h.score_shape(), dtype)?;
        let kt = h.keys(k, seq.kv_at, true);
        for j in 0..h.per_group() {
            let qj = h.query(q, seq.q_at, j);
            self.bmm(&qj, &kt, &h.scores(&scores, j, false))?;
        }
        let mut scores = self.converted(scores, DType::F32)?;
        self.scale(&mut scores, h.s.scale)?;
        self.mask_future(&scores, seq)?;
        let p = self.empty(&h.score_shape(), DType::F32)?;
        self.softmax(&scores.view(), &p.view())?;
        Ok(p)
    }

    /// One sequence's attention-dropout factors `[heads, len, kv_len]` (f32), drawn on the host
    /// from mindkit's generator as the CPU draws them (`None` without dropout).
    fn dropout_factors(
        &self,
        h: &Heads,
        seq: Sequence,
        dropout: Option<&Mask>,
    ) -> Result<Option<NpuTensor>> {
        let Some(mask) = dropout else {
            return Ok(None);
        };
        let first = seq.q_at / (h.s.heads * h.s.head_dim);
        let factors = mask.attention_factors(h.s.heads, first, (h.len, h.kv_len));
        Ok(Some(self.upload_f32(&h.score_shape(), &factors)?))
    }

    /// `x ∘ factors` (f32, aclnnMul) as a new tensor.
    fn times(&self, x: &NpuTensor, factors: &NpuTensor) -> Result<NpuTensor> {
        let out = self.empty(&x.shape, DType::F32)?;
        self.mul_view(&x.view(), &factors.view(), &out.view())?;
        Ok(out)
    }

    /// Scores of keys after each query's position set to −∞ (right-down causal: query `i`
    /// sees keys up to `kv_len − len + i`), the mask a view into [`Npu::causal_mask`].
    fn mask_future(&self, scores: &NpuTensor, seq: Sequence) -> Result<()> {
        let (mask, side) = self.causal_mask(seq.kv_len)?;
        let past = seq.kv_len - seq.len;
        let visible = mask.strided(&[seq.len, seq.kv_len], &[side as i64, 1], past * side);
        self.masked_fill(&scores.view(), &visible, f32::NEG_INFINITY)
    }

    /// `out[b] = a[b] @ b[b]` (aclnnBatchMatMul, the dtype kept).
    fn bmm(&self, a: &View, b: &View, out: &View) -> Result<()> {
        let c = &self.ctx;
        let (x, y, o) = (c.tensor(a)?, c.tensor(b)?, c.tensor(out)?);
        aclnn!(
            self,
            aclnnBatchMatMulGetWorkspaceSize,
            aclnnBatchMatMul,
            x.raw,
            y.raw,
            o.raw,
            0
        )
    }

    /// `out = softmax(x)` along the last dimension.
    fn softmax(&self, x: &View, out: &View) -> Result<()> {
        let (xd, o) = (self.ctx.tensor(x)?, self.ctx.tensor(out)?);
        aclnn!(
            self,
            aclnnSoftmaxGetWorkspaceSize,
            aclnnSoftmax,
            xd.raw,
            -1,
            o.raw
        )
    }

    /// `dx` of softmax from `dy` and its output `y`, along the last dimension.
    fn softmax_bwd(&self, dy: &View, y: &View, dx: &View) -> Result<()> {
        let c = &self.ctx;
        let (g, yd, o) = (c.tensor(dy)?, c.tensor(y)?, c.tensor(dx)?);
        aclnn!(
            self,
            aclnnSoftmaxBackwardGetWorkspaceSize,
            aclnnSoftmaxBackward,
            g.raw,
            yd.raw,
            -1,
            o.raw
        )
    }
}
