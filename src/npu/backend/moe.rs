//! An MoE layer's routing on aclnnMoeGatingTopKSoftmax (ops-transformer
//! moe/moe_gating_top_k_softmax: the router's top-k over a softmax, read back as `[rows, k]`
//! experts and probabilities rather than every logit), its tokens permuted to its experts on
//! aclnnMoeTokenPermute and their outputs summed back on aclnnMoeTokenPermuteGrad
//! (moe/moe_token_permute, moe/moe_token_permute_grad), the operators MindSpeed's
//! `npu_moe_token_permute` runs.
//!
//! The permutation takes every token's choices as `[tokens, topk]` expert indices: a choice
//! this rank does not run (another rank's expert, a zero-computation expert, a dropped token)
//! is given the index one past the local experts, so that it sorts after all of them and
//! `numOutTokens` cuts it off. The sum back takes each token's `topk` rows, so it runs where
//! every choice is routed (one expert-parallel rank, nothing dropped: every inference, and
//! training without expert parallelism or a capacity); elsewhere the indexed add of
//! aclnnEmbeddingDenseBackward sums the routed rows alone rather than padding them.
//!
//! The operator's sort is documented as `argSort`, deterministic; the order the experts'
//! weights and counts assume is the stable one ([`Dispatch::positions`]), so the first
//! permutation's `sortedIndicesOut` is read back once and compared with it: a CANN that sorted
//! otherwise gets the index gathers from then on, named in a warning.

use super::{Npu, NpuTensor};
use crate::engine::dispatch::{self, Dispatch};
use crate::engine::{check, Device, EngineError, Result};
use crate::tensor::DType;
use std::sync::atomic::Ordering;

/// Little-endian int32 values.
fn int32_values(bytes: &[u8]) -> impl Iterator<Item = i32> + '_ {
    (bytes.chunks_exact(4)).map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

impl Npu {
    /// [`crate::engine::Backend::softmax_topk`].
    pub(super) fn softmax_topk_on(
        &self,
        logits: &NpuTensor,
        k: usize,
    ) -> Result<(Vec<u32>, Vec<f32>)> {
        check::softmax_topk(self, logits, k)?;
        let op = self.ctx.op;
        let (Some(prepare), Some(launch)) = (
            op.aclnnMoeGatingTopKSoftmaxGetWorkspaceSize,
            op.aclnnMoeGatingTopKSoftmax,
        ) else {
            return dispatch::softmax_topk(self, logits, k);
        };
        if self.gating.absent() {
            return dispatch::softmax_topk(self, logits, k);
        }
        let n = logits.rows();
        let y = self.empty(&[n, k], logits.dtype)?;
        let (experts, rows) = (
            self.empty(&[n, k], DType::I32)?,
            self.empty(&[n, k], DType::I32)?,
        );
        let c = &self.ctx;
        let (xs, ys, es, rs) = (
            c.tensor(&logits.view())?,
            c.tensor(&y.view())?,
            c.tensor(&experts.view())?,
            c.tensor(&rows.view())?,
        );
        let none = std::ptr::null();
        let top = k as i64;
        let done = c.run(
            "aclnnMoeGatingTopKSoftmax",
            // SAFETY: the descriptors outlive the launch; ws and ex are valid out-pointers.
            |ws, ex| unsafe { prepare(xs.raw, none, top, ys.raw, es.raw, rs.raw, ws, ex) },
            launch,
        );
        drop((xs, ys, es, rs));
        if !self.gating.outcome("aclnnMoeGatingTopKSoftmax", done)? {
            return dispatch::softmax_topk(self, logits, k);
        }
        let bytes = self.ctx.download(experts.block.ptr, n * k * 4)?;
        let chosen = int32_values(&bytes).map(|e| e as u32).collect();
        Ok((chosen, self.download_f32(&y)?))
    }

    /// `values` as an int32 tensor of `shape`.
    fn int32s(&self, shape: &[usize], values: impl Iterator<Item = usize>) -> Result<NpuTensor> {
        let bytes = values
            .map(|v| {
                i32::try_from(v).map_err(|_| EngineError::Invalid {
                    op: "permute",
                    msg: format!("index {v} does not fit int32"),
                })
            })
            .collect::<Result<Vec<i32>>>()?;
        let bytes = bytes.into_iter().flat_map(i32::to_le_bytes).collect();
        self.upload_bytes(shape, DType::I32, bytes)
    }

    /// [`crate::engine::Backend::permute`].
    pub(super) fn permute_on(&self, x: &NpuTensor, d: &Dispatch) -> Result<NpuTensor> {
        check::dispatched(self, "permute", x, d.tokens())?;
        let op = self.ctx.op;
        let (Some(prepare), Some(launch)) = (
            op.aclnnMoeTokenPermuteGetWorkspaceSize,
            op.aclnnMoeTokenPermute,
        ) else {
            return dispatch::permute(self, x, d);
        };
        if self.moe_permute.absent() || d.is_empty() {
            return dispatch::permute(self, x, d);
        }
        let unrouted = d.experts();
        let experts = d
            .choices()
            .iter()
            .map(|c| c.map_or(unrouted, |e| e as usize));
        let ids = self.int32s(&[d.tokens(), d.topk()], experts)?;
        let out = self.empty(&[d.len(), x.cols()], x.dtype)?;
        let places = self.empty(&[d.choices().len()], DType::I32)?;
        let c = &self.ctx;
        let (xs, is, os, ps) = (
            c.tensor(&x.matrix())?,
            c.tensor(&ids.view())?,
            c.tensor(&out.view())?,
            c.tensor(&places.view())?,
        );
        let kept = d.len() as i64;
        let done = c.run(
            "aclnnMoeTokenPermute",
            // SAFETY: the descriptors outlive the launch; ws and ex are valid out-pointers.
            |ws, ex| unsafe { prepare(xs.raw, is.raw, kept, false, os.raw, ps.raw, ws, ex) },
            launch,
        );
        drop((xs, is, os, ps));
        if !self.moe_permute.outcome("aclnnMoeTokenPermute", done)? {
            return dispatch::permute(self, x, d);
        }
        if !self.permute_checked.swap(true, Ordering::Relaxed) && !self.sorts_stably(&places, d)? {
            self.moe_permute
                .give_up("sorts equal expert indices out of their tokens' order");
            return dispatch::permute(self, x, d);
        }
        Ok(out)
    }

    /// Whether the operator's `sortedIndicesOut` is the stable sort's.
    fn sorts_stably(&self, places: &NpuTensor, d: &Dispatch) -> Result<bool> {
        let bytes = self.ctx.download(places.block.ptr, places.numel() * 4)?;
        let got = int32_values(&bytes).map(i64::from);
        Ok(got.eq(d.positions().into_iter().map(|p| p as i64)))
    }

    /// [`crate::engine::Backend::unpermute`].
    pub(super) fn unpermute_on(&self, y: &NpuTensor, d: &Dispatch) -> Result<NpuTensor> {
        check::dispatched(self, "unpermute", y, d.len())?;
        let op = self.ctx.op;
        let (Some(prepare), Some(launch)) = (
            op.aclnnMoeTokenPermuteGradGetWorkspaceSize,
            op.aclnnMoeTokenPermuteGrad,
        ) else {
            return dispatch::unpermute(self, y, d);
        };
        if self.moe_permute.absent() || d.is_empty() || !d.is_full() {
            return dispatch::unpermute(self, y, d);
        }
        let places = self.int32s(&[d.choices().len()], d.positions().into_iter())?;
        let out = self.empty(&[d.tokens(), y.cols()], y.dtype)?;
        let c = &self.ctx;
        let (ys, ps, os) = (
            c.tensor(&y.matrix())?,
            c.tensor(&places.view())?,
            c.tensor(&out.view())?,
        );
        let topk = d.topk() as i64;
        let done = c.run(
            "aclnnMoeTokenPermuteGrad",
            // SAFETY: the descriptors outlive the launch; ws and ex are valid out-pointers.
            |ws, ex| unsafe { prepare(ys.raw, ps.raw, topk, false, os.raw, ws, ex) },
            launch,
        );
        drop((ys, ps, os));
        match self.moe_permute.outcome("aclnnMoeTokenPermuteGrad", done)? {
            true => Ok(out),
            false => dispatch::unpermute(self, y, d),
        }
    }
}
