//! An MoE layer's routing on aclnnMoeGatingTopKSoftmax (ops-transformer
//! moe/moe_gating_top_k_softmax: the router's top-k over a softmax, read back as `[rows, k]`
//! experts and probabilities rather than every logit), and its tokens moved as MindSpeed's
//! fused `npu_moe_token_permute` / `npu_moe_token_unpermute` move them and differentiate
//! them: permuted to their experts on aclnnMoeTokenPermute (its backward
//! aclnnMoeTokenPermuteGrad), the experts' outputs summed back on aclnnMoeTokenUnpermute (its
//! backward aclnnMoeTokenUnpermuteGrad) (ops-transformer moe/moe_token_permute,
//! moe_token_permute_grad, moe_token_unpermute, moe_token_unpermute_grad). The
//! unpermutation's probabilities are ones: megatron-core 0.15's experts weigh their
//! activations before fc2 (experts.py), so the sum back is unweighted.
//!
//! The permutation takes every token's choices as `[tokens, topk]` expert indices: a choice
//! this rank does not run (another rank's expert, a zero-computation expert, a dropped token)
//! is given the index one past the local experts, so that it sorts after all of them and
//! `numOutTokens` cuts it off. The sums back take each token's `topk` rows, so they run where
//! every choice is routed (one expert-parallel rank, nothing dropped: every inference, and
//! training without expert parallelism or a capacity); elsewhere the indexed add of
//! aclnnEmbeddingDenseBackward sums the routed rows alone rather than padding them.
//!
//! Where a kernel is missing its neighbour stands in, named once in a warning: the routing
//! operator aclnnMoeInitRoutingV2 (moe/moe_init_routing_v2: the same sort and gather, in its
//! dropless "active" mode) for the permutation, then aclnnIndexSelect; the permutation's
//! gradient for the unpermutation, and the permutation for the unpermutation's gradient.
//!
//! The sorts are documented as `argSort` / `keyValueSort`, deterministic; the order the
//! experts' weights and counts assume is the stable one ([`Dispatch::positions`]), so each
//! sorting operator's first `sortedIndicesOut` / `expandedRowIdxOut` is read back once and
//! compared with it: a CANN that sorted otherwise gets the next stand-in from then on, named
//! in a warning.

use super::{Fused, HostTensor, Npu, NpuTensor};
use crate::engine::dispatch::{self, Dispatch};
use crate::engine::{check, Device, EngineError, Result};
use crate::npu::context::Launch;
use crate::tensor::DType;
use ascendcl_sys::aclnn::{aclOpExecutor, aclTensor, aclnnStatus};
use std::sync::atomic::{AtomicBool, Ordering};

/// A sorting operator that permutes: its name, its fallback state, whether its sort was
/// compared with the stable one yet, and its launch.
struct Sorting<'a> {
    name: &'static str,
    fused: &'a Fused,
    checked: &'a AtomicBool,
    launch: Launch,
}

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

    /// The dispatch's choices as `[tokens, topk]` int32 expert indices, a choice this rank does
    /// not run given the index one past the local experts.
    fn choice_ids(&self, d: &Dispatch) -> Result<NpuTensor> {
        let unrouted = d.experts();
        let experts = d
            .choices()
            .iter()
            .map(|c| c.map_or(unrouted, |e| e as usize));
        self.int32s(&[d.tokens(), d.topk()], experts)
    }

    /// Each choice's place in the permuted order, int32 (the operators' `sortedIndices`).
    fn places(&self, d: &Dispatch) -> Result<NpuTensor> {
        self.int32s(&[d.choices().len()], d.positions().into_iter())
    }

    /// Ones `[tokens, topk]` in `dtype`: the unpermutation's probabilities, which
    /// megatron-core 0.15 has applied before the experts' fc2.
    fn unit_probs(&self, d: &Dispatch, dtype: DType) -> Result<NpuTensor> {
        let shape = vec![d.tokens(), d.topk()];
        let ones = vec![1.0; d.choices().len()];
        let host = HostTensor::from_f32(dtype, shape, &ones).map_err(|e| EngineError::Invalid {
            op: "unpermute",
            msg: e.to_string(),
        })?;
        self.upload(&host)
    }

    /// [`crate::engine::Backend::permute`].
    pub(super) fn permute_on(&self, x: &NpuTensor, d: &Dispatch) -> Result<NpuTensor> {
        check::dispatched(self, "permute", x, d.tokens())?;
        if d.is_empty() {
            return dispatch::permute(self, x, d);
        }
        if let Some(out) = self.token_permute(x, d)? {
            return Ok(out);
        }
        match self.init_routing(x, d)? {
            Some(out) => Ok(out),
            None => dispatch::permute(self, x, d),
        }
    }

    /// The permutation on aclnnMoeTokenPermute; `None` where it does not run.
    fn token_permute(&self, x: &NpuTensor, d: &Dispatch) -> Result<Option<NpuTensor>> {
        let op = self.ctx.op;
        let (Some(prepare), Some(launch)) = (
            op.aclnnMoeTokenPermuteGetWorkspaceSize,
            op.aclnnMoeTokenPermute,
        ) else {
            return Ok(None);
        };
        let kept = d.len() as i64;
        let sorting = Sorting {
            name: "aclnnMoeTokenPermute",
            fused: &self.moe_permute,
            checked: &self.permute_checked,
            launch,
        };
        self.sorted_permute(x, d, sorting, |[xs, ids, out, places], ws, ex| {
            // SAFETY: the caller's descriptors outlive the launch; ws and ex are valid
            // out-pointers.
            unsafe { prepare(xs, ids, kept, false, out, places, ws, ex) }
        })
    }

    /// The permutation on aclnnMoeInitRoutingV2 (dropless, its first `d.len()` sorted
    /// choices kept: the routed ones, a choice not run sorting after every expert; the
    /// experts' token counts are the host's); `None` where it does not run.
    fn init_routing(&self, x: &NpuTensor, d: &Dispatch) -> Result<Option<NpuTensor>> {
        let op = self.ctx.op;
        let (Some(prepare), Some(launch)) = (
            op.aclnnMoeInitRoutingV2GetWorkspaceSize,
            op.aclnnMoeInitRoutingV2,
        ) else {
            return Ok(None);
        };
        // the experts and, last, the index of the choices not run
        let (active, experts) = (d.len() as i64, d.experts() as i64 + 1);
        let (dropless, no_counts, none) = (0, 0, std::ptr::null());
        let sorting = Sorting {
            name: "aclnnMoeInitRoutingV2",
            fused: &self.init_routing,
            checked: &self.routing_checked,
            launch,
        };
        self.sorted_permute(x, d, sorting, |[xs, ids, out, places], ws, ex| {
            // SAFETY: the caller's descriptors outlive the launch; ws and ex are valid
            // out-pointers.
            unsafe {
                prepare(
                    xs, ids, active, 0, experts, dropless, no_counts, false, out, places, none,
                    none, ws, ex,
                )
            }
        })
    }

    /// The permutation on a sorting operator, prepared by `prepare` with the descriptors of
    /// `x`, the `[tokens, topk]` expert indices, the `[d.len(), h]` output and the places;
    /// `None` where it does not run.
    fn sorted_permute(
        &self,
        x: &NpuTensor,
        d: &Dispatch,
        sorting: Sorting,
        prepare: impl FnOnce([*mut aclTensor; 4], *mut u64, *mut *mut aclOpExecutor) -> aclnnStatus,
    ) -> Result<Option<NpuTensor>> {
        if sorting.fused.absent() {
            return Ok(None);
        }
        let ids = self.choice_ids(d)?;
        let out = self.empty(&[d.len(), x.cols()], x.dtype)?;
        let places = self.empty(&[d.choices().len()], DType::I32)?;
        let c = &self.ctx;
        let (xs, is, os, ps) = (
            c.tensor(&x.matrix())?,
            c.tensor(&ids.view())?,
            c.tensor(&out.view())?,
            c.tensor(&places.view())?,
        );
        let raw = [xs.raw, is.raw, os.raw, ps.raw];
        let done = c.run(sorting.name, |ws, ex| prepare(raw, ws, ex), sorting.launch);
        drop((xs, is, os, ps));
        let ran = sorting.fused.outcome(sorting.name, done)?
            && self.sorted_stably(sorting.fused, sorting.checked, &places, d)?;
        Ok(ran.then_some(out))
    }

    /// Whether `places`, the sort of `fused`, is the stable one: compared on its first use
    /// (`checked`), and `fused` given up if not.
    fn sorted_stably(
        &self,
        fused: &Fused,
        checked: &AtomicBool,
        places: &NpuTensor,
        d: &Dispatch,
    ) -> Result<bool> {
        if checked.swap(true, Ordering::Relaxed) {
            return Ok(true);
        }
        let bytes = self.ctx.download(places.block.ptr, places.numel() * 4)?;
        let got = int32_values(&bytes).map(i64::from);
        let stable = got.eq(d.positions().into_iter().map(|p| p as i64));
        if !stable {
            fused.give_up("sorts equal expert indices out of their tokens' order");
        }
        Ok(stable)
    }

    /// [`crate::engine::Backend::unpermute`].
    pub(super) fn unpermute_on(&self, y: &NpuTensor, d: &Dispatch) -> Result<NpuTensor> {
        check::dispatched(self, "unpermute", y, d.len())?;
        let summed = match d.is_full() && !d.is_empty() {
            true => match self.token_unpermute(y, d)? {
                Some(out) => Some(out),
                None => self.permute_grad(y, d)?,
            },
            false => None,
        };
        summed.map_or_else(|| dispatch::unpermute(self, y, d), Ok)
    }

    /// [`crate::engine::Backend::permute_bwd`].
    pub(super) fn permute_bwd_on(&self, dy: &NpuTensor, d: &Dispatch) -> Result<NpuTensor> {
        check::dispatched(self, "permute_bwd", dy, d.len())?;
        let summed = match d.is_full() && !d.is_empty() {
            true => self.permute_grad(dy, d)?,
            false => None,
        };
        summed.map_or_else(|| dispatch::unpermute(self, dy, d), Ok)
    }

    /// [`crate::engine::Backend::unpermute_bwd`].
    pub(super) fn unpermute_bwd_on(&self, dy: &NpuTensor, d: &Dispatch) -> Result<NpuTensor> {
        check::dispatched(self, "unpermute_bwd", dy, d.tokens())?;
        if d.is_full() && !d.is_empty() {
            if let Some(out) = self.token_unpermute_grad(dy, d)? {
                return Ok(out);
            }
        }
        self.permute_on(dy, d)
    }

    /// Each token's `topk` rows summed on aclnnMoeTokenUnpermute, its probabilities ones;
    /// `None` where it does not run.
    fn token_unpermute(&self, y: &NpuTensor, d: &Dispatch) -> Result<Option<NpuTensor>> {
        let op = self.ctx.op;
        let (Some(prepare), Some(launch)) = (
            op.aclnnMoeTokenUnpermuteGetWorkspaceSize,
            op.aclnnMoeTokenUnpermute,
        ) else {
            return Ok(None);
        };
        if self.moe_unpermute.absent() {
            return Ok(None);
        }
        let (places, probs) = (self.places(d)?, self.unit_probs(d, y.dtype)?);
        let out = self.empty(&[d.tokens(), y.cols()], y.dtype)?;
        let c = &self.ctx;
        let (ys, ps, ws_, os) = (
            c.tensor(&y.matrix())?,
            c.tensor(&places.view())?,
            c.tensor(&probs.view())?,
            c.tensor(&out.view())?,
        );
        let none = std::ptr::null();
        let done = c.run(
            "aclnnMoeTokenUnpermute",
            // SAFETY: the descriptors outlive the launch; ws and ex are valid out-pointers.
            |ws, ex| unsafe { prepare(ys.raw, ps.raw, ws_.raw, false, none, os.raw, ws, ex) },
            launch,
        );
        drop((ys, ps, ws_, os));
        let ran = self.moe_unpermute.outcome("aclnnMoeTokenUnpermute", done)?;
        Ok(ran.then_some(out))
    }

    /// Each token's `topk` rows summed on aclnnMoeTokenPermuteGrad; `None` where it does not
    /// run.
    fn permute_grad(&self, y: &NpuTensor, d: &Dispatch) -> Result<Option<NpuTensor>> {
        let op = self.ctx.op;
        let (Some(prepare), Some(launch)) = (
            op.aclnnMoeTokenPermuteGradGetWorkspaceSize,
            op.aclnnMoeTokenPermuteGrad,
        ) else {
            return Ok(None);
        };
        if self.permute_grad.absent() {
            return Ok(None);
        }
        let places = self.places(d)?;
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
        let ran = self
            .permute_grad
            .outcome("aclnnMoeTokenPermuteGrad", done)?;
        Ok(ran.then_some(out))
    }

    /// The token gradients' rows at their choices' places on aclnnMoeTokenUnpermuteGrad, its
    /// probabilities ones; `None` where it does not run. The operator also multiplies the
    /// permuted tokens it is given with the gradient for the probabilities' gradient, which
    /// has no use here (megatron-core 0.15 weighs before fc2 and differentiates the weights
    /// there), so it is given zeros and its probabilities' gradient is dropped.
    fn token_unpermute_grad(&self, dy: &NpuTensor, d: &Dispatch) -> Result<Option<NpuTensor>> {
        let op = self.ctx.op;
        let (Some(prepare), Some(launch)) = (
            op.aclnnMoeTokenUnpermuteGradGetWorkspaceSize,
            op.aclnnMoeTokenUnpermuteGrad,
        ) else {
            return Ok(None);
        };
        if self.unpermute_grad.absent() {
            return Ok(None);
        }
        let (places, probs) = (self.places(d)?, self.unit_probs(d, dy.dtype)?);
        let rows = self.zeros(&[d.len(), dy.cols()], dy.dtype)?;
        let out = self.empty(&[d.len(), dy.cols()], dy.dtype)?;
        let dprobs = self.empty(&[d.tokens(), d.topk()], dy.dtype)?;
        let c = &self.ctx;
        let (rs, ds, ps, ws_, os, dps) = (
            c.tensor(&rows.view())?,
            c.tensor(&dy.matrix())?,
            c.tensor(&places.view())?,
            c.tensor(&probs.view())?,
            c.tensor(&out.view())?,
            c.tensor(&dprobs.view())?,
        );
        let none = std::ptr::null();
        let done = c.run(
            "aclnnMoeTokenUnpermuteGrad",
            // SAFETY: the descriptors outlive the launch; ws and ex are valid out-pointers.
            |ws, ex| unsafe {
                prepare(
                    rs.raw, ds.raw, ps.raw, ws_.raw, false, none, os.raw, dps.raw, ws, ex,
                )
            },
            launch,
        );
        drop((rs, ds, ps, ws_, os, dps));
        let ran = self
            .unpermute_grad
            .outcome("aclnnMoeTokenUnpermuteGrad", done)?;
        Ok(ran.then_some(out))
    }
}
