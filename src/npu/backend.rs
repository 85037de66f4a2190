//! The engine's [`Device`] and [`Backend`] on an Ascend NPU: every operator is one or a few
//! aclnn operators queued on the device's one stream (see each method's doc in
//! [`crate::engine::Backend`] for its aclnn pair), tensors live in pooled device memory, and
//! the host waits for the device only when it reads a value.
//!
//! Where the trait's contract and an aclnn operator differ, the difference is bridged on the
//! device: a dtype the operator does not take is cast (aclnnCast), a half-width RoPE table is
//! widened to the operator's full width, the cross entropy's log-sum-exp is recovered from
//! its log-probabilities (`lse = logit − log p` of any column), a vocabulary shard's
//! [`NO_ROW`] ids and labels are given an index the operator takes and their rows corrected
//! after it ([`Npu::targets`]). The attention's saved statistics are flash attention's own
//! (softmax max and sum, `[2, n, heads, 8]` f32), which only its backward reads.

use super::context::{Block, Context, Launch};
use super::descriptor::{acl_dtype, View};
use super::NpuError;
use crate::engine::dispatch::Dispatch;
use crate::engine::dropout::Mask;
use crate::engine::{
    check, ensure, AdamWStep, AttentionShape, Backend, Device, EngineError, Op, Result, Segment,
    StridedView, NO_ROW,
};
use crate::tensor::host::{decode_f32, Tensor as HostTensor};
use crate::tensor::DType;
use ascendcl_sys::aclnn::{aclOpExecutor, aclnnStatus};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

impl From<NpuError> for EngineError {
    fn from(e: NpuError) -> Self {
        EngineError::Device(e.to_string())
    }
}

/// Flash attention's compressed causal mask is this square (sparse mode 3, CANN's
/// `sparse_mode` documentation; MindSpeed's `generate_mask.py` builds the same).
const CAUSAL_MASK: usize = 2048;
/// Lanes of flash attention's softmax statistics per row and head.
const STAT_LANES: usize = 8;
/// aclnn's status for an operator without a kernel for the SoC
/// (`ACLNN_ERR_INNER_FIND_KERNEL_ERROR`).
const FIND_KERNEL_ERROR: i32 = 561003;
/// Cross entropy's ignore index (torch's default; no label equals it): the forward's for a
/// [`NO_ROW`] label, whose loss is then set to its log-sum-exp.
const IGNORE_INDEX: i64 = -100;

/// A tensor in device memory (row-major, contiguous).
pub struct NpuTensor {
    block: Block,
    shape: Vec<usize>,
    dtype: DType,
}

impl NpuTensor {
    /// Its device address (for HCCL, which takes raw buffers).
    pub(crate) fn device_ptr(&self) -> usize {
        self.block.ptr
    }

    pub(crate) fn shape(&self) -> &[usize] {
        &self.shape
    }

    pub(crate) fn dtype(&self) -> DType {
        self.dtype
    }

    fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    fn rows(&self) -> usize {
        self.shape.first().copied().unwrap_or(1)
    }

    fn cols(&self) -> usize {
        self.shape[1..].iter().product()
    }

    /// The whole tensor.
    fn view(&self) -> View {
        View::new(self.block.ptr, self.dtype, &self.shape)
    }

    /// The whole tensor as `[rows, cols]`.
    fn matrix(&self) -> View {
        self.view().reshaped(&[self.rows(), self.cols()], 0)
    }
}

/// A fused operator CANN may lack (its functions, or a kernel for the SoC) and the
/// composition of common operators that runs in its place then.
struct Fused {
    op: &'static str,
    instead: &'static str,
    absent: AtomicBool,
}

impl Fused {
    fn new(op: &'static str, instead: &'static str) -> Fused {
        Fused {
            op,
            instead,
            absent: AtomicBool::new(false),
        }
    }

    fn absent(&self) -> bool {
        self.absent.load(Ordering::Relaxed)
    }

    /// Run the composition from now on, saying why once.
    fn give_up(&self, why: &str) {
        if !self.absent.swap(true, Ordering::Relaxed) {
            eprintln!(
                "mindkit: warning: this CANN {why}: {} runs as {} (slower)",
                self.op, self.instead
            );
        }
    }

    /// A launch of the fused operator `op`: `Ok(true)` done, `Ok(false)` when CANN has no
    /// kernel of it for this SoC (the composition from now on).
    fn outcome(&self, op: &str, done: std::result::Result<(), NpuError>) -> Result<bool> {
        match done {
            Err(NpuError::Call {
                code: FIND_KERNEL_ERROR,
                ..
            }) => {
                self.give_up(&format!("has no kernel of {op} for this SoC"));
                Ok(false)
            }
            other => Ok(other.map(|()| true)?),
        }
    }
}

/// One Ascend NPU (one stream).
pub struct Npu {
    ctx: Arc<Context>,
    soc: String,
    /// The causal mask, grown on demand ([`Npu::causal_mask`]).
    causal_mask: Mutex<Option<NpuTensor>>,
    /// aclnnRotaryPositionEmbedding, or aclnnMul and aclnnInplaceAdd.
    rope: Fused,
    /// aclnnRotaryPositionEmbeddingGrad, or the forward rotation by −sin.
    rope_grad: Fused,
    /// Flash attention, or BatchMatMul and Softmax ([`attention`]).
    flash: Fused,
    /// aclnnGroupedMatmulV4, or one aclnnMatmul per group ([`grouped`]).
    gmm: Fused,
    /// An MoE layer's token movements ([`moe`]): aclnnMoeTokenPermute, or
    /// aclnnMoeInitRoutingV2, or aclnnIndexSelect (each sort compared with the stable one on
    /// its first use); aclnnMoeTokenPermuteGrad, or aclnnEmbeddingDenseBackward;
    /// aclnnMoeTokenUnpermute, or aclnnMoeTokenPermuteGrad; aclnnMoeTokenUnpermuteGrad, or the
    /// permutation.
    moe_permute: Fused,
    permute_checked: AtomicBool,
    init_routing: Fused,
    routing_checked: AtomicBool,
    permute_grad: Fused,
    moe_unpermute: Fused,
    unpermute_grad: Fused,
    /// aclnnMoeGatingTopKSoftmax, or the logits read back and routed on the host ([`moe`]).
    gating: Fused,
    /// aclnnLayerNorm and aclnnLayerNormBackward, or the host's LayerNorm ([`norm`]).
    layer_norm: Fused,
    layer_norm_grad: Fused,
}

/// Queue aclnn operator `$launch` (phase 1 `$prepare` with `$args`, then the launch).
macro_rules! aclnn {
    ($npu:expr, $prepare:ident, $launch:ident, $($arg:expr),* $(,)?) => {{
        let op = $npu.ctx.op;
        $npu.run(
            stringify!($launch),
            |ws, ex| {
                // SAFETY: every descriptor passed outlives the launch (the caller drops them
                // after this statement); ws and ex are valid out-pointers.
                unsafe { (op.$prepare)($($arg,)* ws, ex) }
            },
            op.$launch,
        )
    }};
}

mod attention;
mod grouped;
mod moe;
mod norm;

use attention::Sequence;

/// Flash attention's softmax max and sum in `stats [2, rows, heads, 8]`.
fn softmax_stats(stats: &NpuTensor) -> (View, View) {
    let dims = &stats.shape[1..];
    let per: usize = dims.iter().product();
    let part = |i: usize| stats.view().reshaped(dims, i * per);
    (part(0), part(1))
}

/// An empty tensor for flash attention's outputs and inputs it does not use (op-plugin
/// passes `at::empty({0})` there).
/// `view` of `t`'s storage.
fn strided(t: &NpuTensor, view: StridedView) -> View {
    let strides = view.strides.map(|s| s as i64);
    t.view().strided(&view.shape, &strides, view.offset)
}

fn empty_view(t: &NpuTensor) -> View {
    t.view().reshaped(&[0], 0)
}

impl Npu {
    /// Open device `id` (CANN is loaded from its usual places, `ascendcl_sys::candidates`).
    pub fn open(id: i32) -> std::result::Result<Npu, NpuError> {
        let ctx = Context::open(id)?;
        let op = &ctx.op;
        let rope = op.aclnnRotaryPositionEmbeddingGetWorkspaceSize.is_some()
            && op.aclnnRotaryPositionEmbedding.is_some();
        let rope_grad = op
            .aclnnRotaryPositionEmbeddingGradGetWorkspaceSize
            .is_some()
            && op.aclnnRotaryPositionEmbeddingGrad.is_some();
        let flash = op.aclnnFlashAttentionVarLenScoreGetWorkspaceSize.is_some()
            && op.aclnnFlashAttentionVarLenScore.is_some()
            && op
                .aclnnFlashAttentionUnpaddingScoreGradGetWorkspaceSize
                .is_some()
            && op.aclnnFlashAttentionUnpaddingScoreGrad.is_some();
        let gmm =
            op.aclnnGroupedMatmulV4GetWorkspaceSize.is_some() && op.aclnnGroupedMatmulV4.is_some();
        let moe_permute =
            op.aclnnMoeTokenPermuteGetWorkspaceSize.is_some() && op.aclnnMoeTokenPermute.is_some();
        let init_routing = op.aclnnMoeInitRoutingV2GetWorkspaceSize.is_some()
            && op.aclnnMoeInitRoutingV2.is_some();
        let permute_grad = op.aclnnMoeTokenPermuteGradGetWorkspaceSize.is_some()
            && op.aclnnMoeTokenPermuteGrad.is_some();
        let moe_unpermute = op.aclnnMoeTokenUnpermuteGetWorkspaceSize.is_some()
            && op.aclnnMoeTokenUnpermute.is_some();
        let unpermute_grad = op.aclnnMoeTokenUnpermuteGradGetWorkspaceSize.is_some()
            && op.aclnnMoeTokenUnpermuteGrad.is_some();
        let gating = op.aclnnMoeGatingTopKSoftmaxGetWorkspaceSize.is_some()
            && op.aclnnMoeGatingTopKSoftmax.is_some();
        let layer_norm = op.aclnnLayerNormGetWorkspaceSize.is_some() && op.aclnnLayerNorm.is_some();
        let layer_norm_grad = op.aclnnLayerNormBackwardGetWorkspaceSize.is_some()
            && op.aclnnLayerNormBackward.is_some()
            && ctx.nn.aclCreateBoolArray.is_some()
            && ctx.nn.aclDestroyBoolArray.is_some();
        // SAFETY: the runtime's own NUL-terminated string.
        let soc = unsafe { super::c_string((ctx.acl.aclrtGetSocName)()) };
        let npu = Npu {
            ctx,
            soc,
            causal_mask: Mutex::new(None),
            rope: Fused::new("rotary embedding", "aclnnMul + aclnnInplaceAdd"),
            rope_grad: Fused::new("rotary embedding's backward", "its forward with −sin"),
            flash: Fused::new(
                "attention",
                "aclnnBatchMatMul + aclnnSoftmax(+Backward), one sequence at a time",
            ),
            gmm: Fused::new("grouped matmul", "one aclnnMatmul per group"),
            moe_permute: Fused::new("MoE token permutation", "aclnnMoeInitRoutingV2"),
            permute_checked: AtomicBool::new(false),
            init_routing: Fused::new("MoE routing", "aclnnIndexSelect"),
            routing_checked: AtomicBool::new(false),
            permute_grad: Fused::new(
                "MoE token permutation's backward",
                "aclnnEmbeddingDenseBackward",
            ),
            moe_unpermute: Fused::new("MoE token unpermutation", "aclnnMoeTokenPermuteGrad"),
            unpermute_grad: Fused::new("MoE token unpermutation's backward", "the permutation"),
            gating: Fused::new(
                "MoE top-k gating",
                "the logits read back and routed on the host",
            ),
            layer_norm: Fused::new("LayerNorm", "the rows read back and normed on the host"),
            layer_norm_grad: Fused::new(
                "LayerNorm's backward",
                "the rows read back and differentiated on the host",
            ),
        };
        if !rope {
            npu.rope
                .give_up("has no function aclnnRotaryPositionEmbedding");
        }
        if !rope_grad {
            npu.rope_grad
                .give_up("has no function aclnnRotaryPositionEmbeddingGrad");
        }
        if !flash {
            npu.flash.give_up(
                "has no function aclnnFlashAttentionVarLenScore or aclnnFlashAttentionUnpaddingScoreGrad",
            );
        }
        if !gmm {
            npu.gmm.give_up("has no function aclnnGroupedMatmulV4");
        }
        let moe = [
            (moe_permute, &npu.moe_permute, "aclnnMoeTokenPermute"),
            (init_routing, &npu.init_routing, "aclnnMoeInitRoutingV2"),
            (permute_grad, &npu.permute_grad, "aclnnMoeTokenPermuteGrad"),
            (moe_unpermute, &npu.moe_unpermute, "aclnnMoeTokenUnpermute"),
            (
                unpermute_grad,
                &npu.unpermute_grad,
                "aclnnMoeTokenUnpermuteGrad",
            ),
        ];
        for (_, fused, op) in moe.into_iter().filter(|(there, ..)| !there) {
            fused.give_up(&format!("has no function {op}"));
        }
        if !gating {
            npu.gating
                .give_up("has no function aclnnMoeGatingTopKSoftmax");
        }
        if !layer_norm {
            npu.layer_norm.give_up("has no function aclnnLayerNorm");
        }
        if !layer_norm_grad {
            npu.layer_norm_grad
                .give_up("has no function aclnnLayerNormBackward or aclCreateBoolArray");
        }
        Ok(npu)
    }

    /// `out = x·cos + rotate_half(x)·sin` by the fused operator; `Ok(false)` when CANN has no
    /// kernel for it.
    fn rope_fused(&self, x: &View, cos: &View, sin: &View, out: &View) -> Result<bool> {
        let (Some(prepare), Some(launch)) = (
            self.ctx.op.aclnnRotaryPositionEmbeddingGetWorkspaceSize,
            self.ctx.op.aclnnRotaryPositionEmbedding,
        ) else {
            return Ok(false);
        };
        let c = &self.ctx;
        let (xd, cd, sd, od) = (c.tensor(x)?, c.tensor(cos)?, c.tensor(sin)?, c.tensor(out)?);
        let done = c.run(
            "aclnnRotaryPositionEmbedding",
            // SAFETY: the descriptors outlive the launch; ws and ex are valid out-pointers.
            |ws, ex| unsafe { prepare(xd.raw, cd.raw, sd.raw, 0, od.raw, ws, ex) },
            launch,
        );
        self.rope.outcome("aclnnRotaryPositionEmbedding", done)
    }

    /// `dx` of rotary embedding (the transposed rotation of `dy`) by its fused backward;
    /// `Ok(false)` when CANN has no kernel for it. The tables' gradients are not asked for
    /// (no x), but their outputs are passed, as op-plugin does.
    fn rope_grad_fused(
        &self,
        dy: &View,
        (cos, sin): (View, View),
        dx: &View,
        (table, dtype): (&[usize], DType),
    ) -> Result<bool> {
        let op = self.ctx.op;
        let (Some(prepare), Some(launch)) = (
            op.aclnnRotaryPositionEmbeddingGradGetWorkspaceSize,
            op.aclnnRotaryPositionEmbeddingGrad,
        ) else {
            return Ok(false);
        };
        let (dcos, dsin) = (self.empty(table, dtype)?, self.empty(table, dtype)?);
        let c = &self.ctx;
        let (g, cd, sd, o) = (
            c.tensor(dy)?,
            c.tensor(&cos)?,
            c.tensor(&sin)?,
            c.tensor(dx)?,
        );
        let (dc, ds) = (c.tensor(&dcos.view())?, c.tensor(&dsin.view())?);
        let null = std::ptr::null();
        let done = c.run(
            "aclnnRotaryPositionEmbeddingGrad",
            // SAFETY: the descriptors outlive the launch; ws and ex are valid out-pointers.
            |ws, ex| unsafe {
                prepare(
                    g.raw, cd.raw, sd.raw, null, 0, o.raw, dc.raw, ds.raw, ws, ex,
                )
            },
            launch,
        );
        self.rope_grad
            .outcome("aclnnRotaryPositionEmbeddingGrad", done)
    }

    /// Rotary embedding of every head of `x [n, heads·r]`, whole, by the tables `[n, r/2]`
    /// (aclnnRotaryPositionEmbedding or its grad; products where CANN has neither).
    fn rope_heads(
        &self,
        x: &mut NpuTensor,
        (cos, sin): (&NpuTensor, &NpuTensor),
        inverse: bool,
    ) -> Result<()> {
        let (n, width, half) = (x.rows(), x.cols(), cos.cols());
        let d = 2 * half;
        // The operator takes the full-width table of rotate_half: [cos | cos], [sin | sin].
        let full = |t: &NpuTensor| -> Result<NpuTensor> {
            let f = self.empty(&[n, d], x.dtype)?;
            for at in [0, half] {
                let dst = f.view().strided(&[n, half], &[d as i64, 1], at);
                self.copy_view(&dst, &t.view())?;
            }
            Ok(f)
        };
        let (c, mut s) = (full(cos)?, full(sin)?);
        let out = self.empty(&x.shape, x.dtype)?;
        let (table, rows) = ([1, n, 1, d], [1, n, width / d, d]);
        let four = |t: &NpuTensor, dims: &[usize]| t.view().reshaped(dims, 0);
        if inverse
            && !self.rope_grad.absent()
            && self.rope_grad_fused(
                &four(x, &rows),
                (four(&c, &table), four(&s, &table)),
                &four(&out, &rows),
                (&table, x.dtype),
            )?
        {
            *x = out;
            return Ok(());
        }
        // The inverse rotation is the rotation by −sin.
        if inverse {
            self.scale(&mut s, -1.0)?;
        }
        let fused = !self.rope.absent()
            && self.rope_fused(
                &four(x, &rows),
                &four(&c, &table),
                &four(&s, &table),
                &four(&out, &rows),
            )?;
        if !fused {
            let (ct, st) = (
                c.view().reshaped(&[n, 1, d], 0),
                s.view().reshaped(&[n, 1, d], 0),
            );
            self.rope_by_mul(x, (&ct, &st), &out, d)?;
        }
        *x = out;
        Ok(())
    }

    /// `out = x·cos + rotate_half(x)·sin` by aclnnMul and aclnnInplaceAdd, for `x`, `out`
    /// `[n, heads, d]` and the tables `[n, 1, d]`.
    fn rope_by_mul(
        &self,
        x: &NpuTensor,
        (cos, sin): (&View, &View),
        out: &NpuTensor,
        d: usize,
    ) -> Result<()> {
        let (n, width, half) = (x.rows(), x.cols(), d / 2);
        let heads = [n, width / d, d];
        let halves = |t: &NpuTensor, at: usize| {
            t.view()
                .strided(&[n, width / d, half], &[width as i64, d as i64, 1], at)
        };
        let rotated = self.empty(&x.shape, x.dtype)?;
        {
            let c = &self.ctx;
            let (src, dst, minus) = (
                c.tensor(&halves(x, half))?,
                c.tensor(&halves(&rotated, 0))?,
                c.scalar(-1.0)?,
            );
            aclnn!(
                self,
                aclnnMulsGetWorkspaceSize,
                aclnnMuls,
                src.raw,
                minus.raw,
                dst.raw
            )?;
        }
        self.copy_view(&halves(&rotated, half), &halves(x, 0))?;
        self.mul_view(
            &x.view().reshaped(&heads, 0),
            cos,
            &out.view().reshaped(&heads, 0),
        )?;
        // A separate product: no operator writes over its own input.
        let sin_term = self.empty(&x.shape, x.dtype)?;
        self.mul_view(
            &rotated.view().reshaped(&heads, 0),
            sin,
            &sin_term.view().reshaped(&heads, 0),
        )?;
        self.add_view(&out.view(), &sin_term.view())
    }

    /// `out` (f32) = the sum of `x` over dimension `dim` (aclnnReduceSum).
    fn sum_f32(&self, x: &View, dim: i64, out: &View) -> Result<()> {
        let c = &self.ctx;
        let (s, dims, o) = (c.tensor(x)?, c.int_array(&[dim])?, c.tensor(out)?);
        aclnn!(
            self,
            aclnnReduceSumGetWorkspaceSize,
            aclnnReduceSum,
            s.raw,
            dims.raw,
            false,
            acl_dtype(DType::F32),
            o.raw,
        )
    }

    /// `max(x, 0)` in x's dtype (aclnnRelu).
    fn relu(&self, x: &NpuTensor) -> Result<NpuTensor> {
        let r = self.empty(&x.shape, x.dtype)?;
        let (xd, rd) = (self.ctx.tensor(&x.view())?, self.ctx.tensor(&r.view())?);
        aclnn!(self, aclnnReluGetWorkspaceSize, aclnnRelu, xd.raw, rd.raw)?;
        drop((xd, rd));
        Ok(r)
    }

    /// `out = a · b` through views, `b` broadcast to `a` (aclnnMul).
    fn mul_view(&self, a: &View, b: &View, out: &View) -> Result<()> {
        let (x, y, o) = (
            self.ctx.tensor(a)?,
            self.ctx.tensor(b)?,
            self.ctx.tensor(out)?,
        );
        aclnn!(
            self,
            aclnnMulGetWorkspaceSize,
            aclnnMul,
            x.raw,
            y.raw,
            o.raw
        )
    }

    /// The device context (its stream), for the collectives queued beside the operators.
    pub(crate) fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// Device memory handed out, cached, and the peak handed out, in bytes.
    pub fn memory(&self) -> (usize, usize, usize) {
        self.ctx.memory()
    }

    fn run(
        &self,
        name: &'static str,
        prepare: impl FnOnce(*mut u64, *mut *mut aclOpExecutor) -> aclnnStatus,
        launch: Launch,
    ) -> Result<()> {
        Ok(self.ctx.run(name, prepare, launch)?)
    }

    /// An uninitialised tensor.
    fn empty(&self, shape: &[usize], dtype: DType) -> Result<NpuTensor> {
        let bytes = shape.iter().product::<usize>() * dtype.size();
        Ok(NpuTensor {
            block: self.ctx.alloc(bytes)?,
            shape: shape.to_vec(),
            dtype,
        })
    }

    /// A tensor of `bytes` queued for upload.
    fn upload_bytes(&self, shape: &[usize], dtype: DType, bytes: Vec<u8>) -> Result<NpuTensor> {
        let t = self.empty(shape, dtype)?;
        self.ctx.upload(t.block.ptr, bytes)?;
        Ok(t)
    }

    /// Indices as an int64 tensor.
    fn indices(&self, ids: impl ExactSizeIterator<Item = i64>) -> Result<NpuTensor> {
        let n = ids.len();
        let bytes = ids.flat_map(i64::to_le_bytes).collect();
        self.upload_bytes(&[n], DType::I64, bytes)
    }

    /// Token ids or labels as int64 indices, [`NO_ROW`] as `no_row`: an index the operator
    /// takes, its effect on those rows undone after it ([`Npu::no_row_mask`]).
    fn targets(&self, ids: &[u32], no_row: i64) -> Result<NpuTensor> {
        self.indices(
            ids.iter()
                .map(|&i| if i == NO_ROW { no_row } else { i64::from(i) }),
        )
    }

    /// Where `ids` are [`NO_ROW`], an `[n]` mask in `dtype`, each element `mark(is NO_ROW)`;
    /// None when no id is, so a whole vocabulary's ids cost no correction.
    fn no_row_mask<const W: usize>(
        &self,
        ids: &[u32],
        dtype: DType,
        mark: fn(bool) -> [u8; W],
    ) -> Result<Option<NpuTensor>> {
        if !ids.contains(&NO_ROW) {
            return Ok(None);
        }
        let bytes = ids.iter().flat_map(|&i| mark(i == NO_ROW)).collect();
        Ok(Some(self.upload_bytes(&[ids.len()], dtype, bytes)?))
    }

    /// The f32 mask of [`Npu::no_row_mask`]: 1 at a [`NO_ROW`] row, for [`Npu::add_masked`].
    fn no_row_ones(&self, labels: &[u32]) -> Result<Option<NpuTensor>> {
        self.no_row_mask(labels, DType::F32, |hit| {
            f32::from(u8::from(hit)).to_le_bytes()
        })
    }

    /// `y += mask · x` for views `[n]` (aclnnMul, aclnnInplaceAdd): the cross entropy's
    /// share of the [`NO_ROW`] rows that its aclnn operator, given another label, left out.
    fn add_masked(&self, y: &View, mask: &NpuTensor, x: &View) -> Result<()> {
        let masked = self.empty(&mask.shape, DType::F32)?;
        self.mul_view(&mask.view(), x, &masked.view())?;
        self.add_view(y, &masked.view())
    }

    /// `x = value` where `mask` (BOOL, broadcast to `x`) is true, in place
    /// (aclnnInplaceMaskedFillScalar).
    fn masked_fill(&self, x: &View, mask: &View, value: f32) -> Result<()> {
        let c = &self.ctx;
        let (xd, m, v) = (c.tensor(x)?, c.tensor(mask)?, c.scalar(value)?);
        aclnn!(
            self,
            aclnnInplaceMaskedFillScalarGetWorkspaceSize,
            aclnnInplaceMaskedFillScalar,
            xd.raw,
            m.raw,
            v.raw
        )
    }

    /// `x` in `dtype`: itself, or a cast copy.
    fn as_dtype<'a>(&self, x: &'a NpuTensor, dtype: DType) -> Result<InDtype<'a>> {
        if x.dtype == dtype {
            Ok(InDtype::Same(x))
        } else {
            Ok(InDtype::Cast(self.cast(x, dtype)?))
        }
    }

    /// `x` converted to `dtype` (itself when it has it).
    fn converted(&self, x: NpuTensor, dtype: DType) -> Result<NpuTensor> {
        if x.dtype == dtype {
            Ok(x)
        } else {
            self.cast(&x, dtype)
        }
    }

    /// `dst = src` through views (aclnnInplaceCopy; converts dtypes).
    fn copy_view(&self, dst: &View, src: &View) -> Result<()> {
        let (d, s) = (self.ctx.tensor(dst)?, self.ctx.tensor(src)?);
        aclnn!(
            self,
            aclnnInplaceCopyGetWorkspaceSize,
            aclnnInplaceCopy,
            d.raw,
            s.raw
        )
    }

    /// `x += y` through views, `y` broadcast to `x` (aclnnInplaceAdd).
    fn add_view(&self, x: &View, y: &View) -> Result<()> {
        let (a, b, one) = (
            self.ctx.tensor(x)?,
            self.ctx.tensor(y)?,
            self.ctx.scalar(1.0)?,
        );
        aclnn!(
            self,
            aclnnInplaceAddGetWorkspaceSize,
            aclnnInplaceAdd,
            a.raw,
            b.raw,
            one.raw
        )
    }

    /// `out = x − y` through views, `y` broadcast to `x` (aclnnSub).
    fn sub_view(&self, x: &View, y: &View, out: &View) -> Result<()> {
        let (a, b) = (self.ctx.tensor(x)?, self.ctx.tensor(y)?);
        let (o, one) = (self.ctx.tensor(out)?, self.ctx.scalar(1.0)?);
        aclnn!(
            self,
            aclnnSubGetWorkspaceSize,
            aclnnSub,
            a.raw,
            b.raw,
            one.raw,
            o.raw
        )
    }

    /// `out = a · b` for views `a [.., n, k]`, `b [.., k, m]` (aclnnMatmul, dtype kept).
    fn matmul_view(&self, a: &View, b: &View, out: &View) -> Result<()> {
        let (x, w, o) = (
            self.ctx.tensor(a)?,
            self.ctx.tensor(b)?,
            self.ctx.tensor(out)?,
        );
        aclnn!(
            self,
            aclnnMatmulGetWorkspaceSize,
            aclnnMatmul,
            x.raw,
            w.raw,
            o.raw,
            0
        )
    }

    /// Cumulative row counts of `segments` (flash attention's actual sequence lengths).
    fn cumulative(segments: &[Range<usize>]) -> Vec<i64> {
        segments.iter().map(|r| r.end as i64).collect()
    }
}

impl Device for Npu {
    type Tensor = NpuTensor;

    fn describe(&self) -> String {
        format!("npu {} ({})", self.ctx.device, self.soc)
    }

    fn supports(&self, op: Op, dtype: DType) -> bool {
        let float = matches!(dtype, DType::F32 | DType::BF16 | DType::F16);
        match op {
            // Updated in place as f32, as on the CPU: gradients, main parameters, moments.
            Op::AdamW | Op::EmbeddingBwd => dtype == DType::F32,
            _ => float,
        }
    }

    fn upload(&self, t: &HostTensor) -> Result<NpuTensor> {
        if !matches!(t.dtype, DType::F32 | DType::BF16 | DType::F16) {
            return Err(EngineError::Unsupported {
                op: "upload",
                dtype: t.dtype,
                device: self.describe(),
            });
        }
        self.upload_bytes(&t.shape, t.dtype, t.data.clone())
    }

    fn upload_f32(&self, shape: &[usize], values: &[f32]) -> Result<NpuTensor> {
        ensure(
            values.len() == shape.iter().product::<usize>(),
            "upload_f32",
            || format!("{} values for {shape:?}", values.len()),
        )?;
        let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.upload_bytes(shape, DType::F32, bytes)
    }

    fn zeros(&self, shape: &[usize], dtype: DType) -> Result<NpuTensor> {
        let t = self.empty(shape, dtype)?;
        self.ctx.zero(t.block.ptr, t.numel() * dtype.size())?;
        Ok(t)
    }

    fn download_f32(&self, t: &NpuTensor) -> Result<Vec<f32>> {
        let bytes = self.ctx.download(t.block.ptr, t.numel() * t.dtype.size())?;
        let mut out = vec![0f32; t.numel()];
        decode_f32(&bytes, t.dtype, &mut out).map_err(|e| EngineError::Invalid {
            op: "download_f32",
            msg: e.to_string(),
        })?;
        Ok(out)
    }

    fn download(&self, t: &NpuTensor) -> Result<HostTensor> {
        let bytes = self.ctx.download(t.block.ptr, t.numel() * t.dtype.size())?;
        Ok(HostTensor::new(t.dtype, t.shape.clone(), bytes))
    }

    fn synchronize(&self) -> Result<()> {
        Ok(self.ctx.synchronize()?)
    }

    fn shape<'a>(&self, t: &'a NpuTensor) -> &'a [usize] {
        &t.shape
    }

    fn dtype(&self, t: &NpuTensor) -> DType {
        t.dtype
    }
}

impl Backend for Npu {
    fn embedding(&self, table: &NpuTensor, ids: &[u32]) -> Result<NpuTensor> {
        check::ids(self, "embedding", table, ids)?;
        let (n, h) = (ids.len(), table.cols());
        // A NO_ROW id gathers row 0, then its row is zeroed (Megatron's masked fill).
        let index = self.targets(ids, 0)?;
        let out = self.empty(&[n, h], table.dtype)?;
        {
            let c = &self.ctx;
            let (w, i, o) = (
                c.tensor(&table.matrix())?,
                c.tensor(&index.view())?,
                c.tensor(&out.view())?,
            );
            aclnn!(
                self,
                aclnnEmbeddingGetWorkspaceSize,
                aclnnEmbedding,
                w.raw,
                i.raw,
                o.raw
            )?;
        }
        if let Some(mask) = self.no_row_mask(ids, DType::Bool, |hit| [u8::from(hit)])? {
            self.masked_fill(&out.view(), &mask.view().reshaped(&[n, 1], 0), 0.0)?;
        }
        self.converted(out, DType::F32)
    }

    fn embedding_bwd(&self, dy: &NpuTensor, ids: &[u32], dtable: &mut NpuTensor) -> Result<()> {
        check::embedding_bwd(self, dy, ids, dtable)?;
        let (v, h) = (dtable.rows(), dtable.cols());
        // NO_ROW ids accumulate into a spare row v of the gradient, which is not added.
        let rows = v + usize::from(ids.contains(&NO_ROW));
        let index = self.targets(ids, v as i64)?;
        let grad = self.empty(&[rows, h], dy.dtype)?;
        {
            let c = &self.ctx;
            let (g, i, o) = (
                c.tensor(&dy.matrix())?,
                c.tensor(&index.view())?,
                c.tensor(&grad.view())?,
            );
            aclnn!(
                self,
                aclnnEmbeddingDenseBackwardGetWorkspaceSize,
                aclnnEmbeddingDenseBackward,
                g.raw,
                i.raw,
                rows as u64,
                u64::MAX,
                false,
                o.raw,
            )?;
        }
        self.add_view(&dtable.matrix(), &grad.view().reshaped(&[v, h], 0))
    }

    fn select_rows(&self, x: &NpuTensor, rows: &[usize]) -> Result<NpuTensor> {
        check::select_rows(self, x, rows)?;
        let index = self.indices(rows.iter().map(|&r| r as i64))?;
        let out = self.empty(&[rows.len(), x.cols()], x.dtype)?;
        let c = &self.ctx;
        let (s, i, o) = (
            c.tensor(&x.matrix())?,
            c.tensor(&index.view())?,
            c.tensor(&out.view())?,
        );
        aclnn!(
            self,
            aclnnIndexSelectGetWorkspaceSize,
            aclnnIndexSelect,
            s.raw,
            0,
            i.raw,
            o.raw
        )?;
        drop((s, i, o));
        Ok(out)
    }

    fn index_add_rows(&self, dst: &mut NpuTensor, src: &NpuTensor, rows: &[usize]) -> Result<()> {
        check::index_add_rows(self, dst, src, rows)?;
        // A one-hot product of the rows is the indexed sum (aclnnEmbeddingDenseBackward, a
        // repeated row's terms summed together), then one rounding add into `dst`.
        let ids: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
        self.embedding_bwd(src, &ids, dst)
    }

    fn softmax_topk(&self, logits: &NpuTensor, k: usize) -> Result<(Vec<u32>, Vec<f32>)> {
        self.softmax_topk_on(logits, k)
    }

    fn permute(&self, x: &NpuTensor, d: &Dispatch) -> Result<NpuTensor> {
        self.permute_on(x, d)
    }

    fn permute_bwd(&self, dy: &NpuTensor, d: &Dispatch) -> Result<NpuTensor> {
        self.permute_bwd_on(dy, d)
    }

    fn unpermute(&self, y: &NpuTensor, d: &Dispatch) -> Result<NpuTensor> {
        self.unpermute_on(y, d)
    }

    fn unpermute_bwd(&self, dy: &NpuTensor, d: &Dispatch) -> Result<NpuTensor> {
        self.unpermute_bwd_on(dy, d)
    }

    fn scale_rows(&self, x: &NpuTensor, w: &NpuTensor) -> Result<NpuTensor> {
        check::scale_rows(self, x, w)?;
        let n = x.rows();
        let wide = self.as_dtype(x, DType::F32)?;
        let out = self.empty(&x.shape, DType::F32)?;
        self.mul_view(
            &wide.matrix(),
            &w.view().reshaped(&[n, 1], 0),
            &out.matrix(),
        )?;
        self.converted(out, x.dtype)
    }

    fn row_dots(&self, x: &NpuTensor, y: &NpuTensor) -> Result<Vec<f32>> {
        check::row_dots(self, x, y)?;
        let (xf, yf) = (self.as_dtype(x, DType::F32)?, self.as_dtype(y, DType::F32)?);
        let product = self.empty(&x.shape, DType::F32)?;
        self.mul_view(&xf.matrix(), &yf.matrix(), &product.matrix())?;
        let sums = self.empty(&[x.rows()], DType::F32)?;
        self.sum_f32(&product.matrix(), 1, &sums.view())?;
        self.download_f32(&sums)
    }

    fn rms_norm(
        &self,
        x: &NpuTensor,
        gamma: &NpuTensor,
        eps: f64,
    ) -> Result<(NpuTensor, NpuTensor)> {
        let groups = check::rms_norm(self, x, gamma)?;
        let (n, h) = (x.rows() * groups, x.cols() / groups);
        let (y, rstd) = (
            self.empty(&x.shape, x.dtype)?,
            self.empty(&[n], DType::F32)?,
        );
        {
            let c = &self.ctx;
            let (xd, g) = (
                c.tensor(&x.view().reshaped(&[n, h], 0))?,
                c.tensor(&gamma.view().reshaped(&[h], 0))?,
            );
            let rows = y.view().reshaped(&[n, h], 0);
            let (yd, r) = (c.tensor(&rows)?, c.tensor(&rstd.view())?);
            aclnn!(
                self,
                aclnnRmsNormGetWorkspaceSize,
                aclnnRmsNorm,
                xd.raw,
                g.raw,
                eps,
                yd.raw,
                r.raw
            )?;
        }
        Ok((y, rstd))
    }

    fn rms_norm_bwd(
        &self,
        dy: &NpuTensor,
        x: &NpuTensor,
        gamma: &NpuTensor,
        rstd: &NpuTensor,
        dgamma: Option<&mut NpuTensor>,
    ) -> Result<NpuTensor> {
        check::rms_norm_bwd(self, (dy, x, rstd), gamma, dgamma.as_deref())?;
        let n = rstd.shape.iter().product::<usize>();
        let h = x.rows() * x.cols() / n;
        let rows = |t: &NpuTensor| t.view().reshaped(&[n, h], 0);
        let (dx, dg) = (
            self.empty(&x.shape, dy.dtype)?,
            self.empty(&[h], DType::F32)?,
        );
        {
            let c = &self.ctx;
            let (dyd, xd, r) = (
                c.tensor(&rows(dy))?,
                c.tensor(&rows(x))?,
                c.tensor(&rstd.view())?,
            );
            let g = c.tensor(&gamma.view().reshaped(&[h], 0))?;
            let (dxd, dgd) = (c.tensor(&rows(&dx))?, c.tensor(&dg.view())?);
            aclnn!(
                self,
                aclnnRmsNormGradGetWorkspaceSize,
                aclnnRmsNormGrad,
                dyd.raw,
                xd.raw,
                r.raw,
                g.raw,
                dxd.raw,
                dgd.raw,
            )?;
        }
        if let Some(d) = dgamma {
            self.add_view(&d.view().reshaped(&[h], 0), &dg.view())?;
        }
        Ok(dx)
    }

    fn layer_norm(
        &self,
        x: &NpuTensor,
        affine: (&NpuTensor, &NpuTensor),
        eps: f64,
    ) -> Result<(NpuTensor, NpuTensor)> {
        self.layer_norm_on(x, affine, eps)
    }

    fn layer_norm_bwd(
        &self,
        at: (&NpuTensor, &NpuTensor),
        gamma: &NpuTensor,
        stats: &NpuTensor,
        grads: (Option<&mut NpuTensor>, Option<&mut NpuTensor>),
    ) -> Result<NpuTensor> {
        self.layer_norm_bwd_on(at, gamma, stats, grads)
    }

    fn matmul(&self, x: &NpuTensor, w: &NpuTensor, bias: Option<&NpuTensor>) -> Result<NpuTensor> {
        let (n, k, m) = check::matmul(self, x, w, bias)?;
        let xw = self.as_dtype(x, w.dtype)?;
        let out = self.empty(&[n, m], w.dtype)?;
        // wᵀ as a view: [k, m] with strides [1, k]
        let wt = w.view().strided(&[k, m], &[1, k as i64], 0);
        self.matmul_view(&xw.matrix(), &wt, &out.view())?;
        if let Some(b) = bias {
            self.add_view(&out.view(), &b.view().reshaped(&[m], 0))?;
        }
        self.converted(out, x.dtype)
    }

    fn grouped_matmul(
        &self,
        x: &NpuTensor,
        w: &[&NpuTensor],
        counts: &[usize],
    ) -> Result<NpuTensor> {
        self.grouped_matmul_on(x, w, counts)
    }

    fn grouped_matmul_bwd(
        &self,
        dy: &NpuTensor,
        x: &NpuTensor,
        w: &[&NpuTensor],
        counts: &[usize],
        dw: &mut [Option<&mut NpuTensor>],
    ) -> Result<NpuTensor> {
        self.grouped_matmul_bwd_on((dy, x), w, counts, dw)
    }

    fn matmul_bwd(
        &self,
        dy: &NpuTensor,
        x: &NpuTensor,
        w: &NpuTensor,
        dw: Option<&mut NpuTensor>,
        dbias: Option<&mut NpuTensor>,
    ) -> Result<NpuTensor> {
        let (n, k, m) = check::matmul_bwd(self, (dy, x, w), dw.as_deref(), dbias.as_deref())?;
        let dx = self.empty(&x.shape, dy.dtype)?;
        let wd = self.as_dtype(w, dy.dtype)?;
        self.matmul_view(&dy.view(), &wd.matrix(), &dx.matrix())?;
        if let Some(dw) = dw {
            let xd = self.as_dtype(x, dy.dtype)?;
            let product = self.empty(&[m, k], dy.dtype)?;
            // dyᵀ as a view: [m, n] with strides [1, m]
            let dyt = dy.view().strided(&[m, n], &[1, m as i64], 0);
            self.matmul_view(&dyt, &xd.matrix(), &product.view())?;
            self.add_view(&dw.view(), &product.view())?;
        }
        if let Some(db) = dbias {
            let sum = self.empty(&[m], DType::F32)?;
            self.sum_f32(&dy.view(), 0, &sum.view())?;
            self.add_view(&db.view().reshaped(&[m], 0), &sum.view())?;
        }
        Ok(dx)
    }

    fn split_qkv(
        &self,
        qkv: &NpuTensor,
        s: AttentionShape,
    ) -> Result<(NpuTensor, NpuTensor, NpuTensor)> {
        let (n, d, g) = (qkv.rows(), s.head_dim, s.groups);
        let per_group = s.heads / g;
        check::split_qkv(self, qkv, s)?;
        let width = g * (per_group + 2) * d;
        let strides = [width as i64, ((per_group + 2) * d) as i64, 1];
        let part = |cols: usize, at: usize| -> Result<NpuTensor> {
            let t = self.empty(&[n, g * cols], qkv.dtype)?;
            let src = qkv.view().strided(&[n, g, cols], &strides, at);
            self.copy_view(&t.view().reshaped(&[n, g, cols], 0), &src)?;
            Ok(t)
        };
        Ok((
            part(per_group * d, 0)?,
            part(d, per_group * d)?,
            part(d, (per_group + 1) * d)?,
        ))
    }

    fn merge_qkv(
        &self,
        dq: &NpuTensor,
        dk: &NpuTensor,
        dv: &NpuTensor,
        s: AttentionShape,
    ) -> Result<NpuTensor> {
        let n = check::heads(self, "merge_qkv", (dq, dk, dv), s)?;
        let (d, g) = (s.head_dim, s.groups);
        let per_group = s.heads / g;
        let width = g * (per_group + 2) * d;
        let out = self.empty(&[n, width], dq.dtype)?;
        let strides = [width as i64, ((per_group + 2) * d) as i64, 1];
        for (part, cols, at) in [
            (dq, per_group * d, 0),
            (dk, d, per_group * d),
            (dv, d, (per_group + 1) * d),
        ] {
            let dst = out.view().strided(&[n, g, cols], &strides, at);
            self.copy_view(&dst, &part.view().reshaped(&[n, g, cols], 0))?;
        }
        Ok(out)
    }

    fn rope(
        &self,
        x: &mut NpuTensor,
        cos: &NpuTensor,
        sin: &NpuTensor,
        head_dim: usize,
        inverse: bool,
    ) -> Result<()> {
        check::rope(self, x, (cos, sin), head_dim)?;
        let (n, width, r) = (x.rows(), x.cols(), 2 * cos.cols());
        if r == head_dim {
            return self.rope_heads(x, (cos, sin), inverse);
        }
        // A partial rotation: the rotated dimensions of every head gathered into a tensor of
        // heads of r, rotated whole, and put back.
        let heads = width / head_dim;
        let rotated = |t: &NpuTensor| {
            t.view()
                .strided(&[n, heads, r], &[width as i64, head_dim as i64, 1], 0)
        };
        let mut part = self.empty(&[n, heads * r], x.dtype)?;
        self.copy_view(&part.view().reshaped(&[n, heads, r], 0), &rotated(x))?;
        self.rope_heads(&mut part, (cos, sin), inverse)?;
        self.copy_view(&rotated(x), &part.view().reshaped(&[n, heads, r], 0))
    }

    fn attention(
        &self,
        q: &NpuTensor,
        k: &NpuTensor,
        v: &NpuTensor,
        segments: &[Range<usize>],
        s: AttentionShape,
        dropout: Option<&Mask>,
    ) -> Result<(NpuTensor, NpuTensor)> {
        let n = check::attention(self, (q, k, v), segments, s)?;
        let cum = Self::cumulative(segments);
        let o = self.empty(&q.shape, q.dtype)?;
        let stats = self.empty(&[2, n, s.heads, STAT_LANES], DType::F32)?;
        let (qv, kv, vv) = heads_views(q, k, v, s);
        let out = o.view().reshaped(&[n, s.heads, s.head_dim], 0);
        // Attention dropout runs unfused (`Npu::attention_by_matmul`), so that its mask is
        // mindkit's: flash attention's dropMask layout for TND is not documented by CANN.
        let fused = dropout.is_none()
            && !self.flash.absent()
            && self.flash_attention(((&qv, &kv, &vv), (&cum, &cum)), s, &stats, &out)?;
        if !fused {
            for seq in sequences(segments, s) {
                let qkv = (&q.view(), &k.view(), &v.view());
                self.attention_by_matmul(qkv, seq, (s, q.dtype, dropout), &o.view())?;
            }
        }
        Ok((o, stats))
    }

    fn attention_bwd(
        &self,
        d_o: &NpuTensor,
        q: &NpuTensor,
        k: &NpuTensor,
        v: &NpuTensor,
        o: &NpuTensor,
        stats: &NpuTensor,
        segments: &[Range<usize>],
        s: AttentionShape,
        dropout: Option<&Mask>,
    ) -> Result<(NpuTensor, NpuTensor, NpuTensor)> {
        let n = check::attention_bwd(self, d_o, (q, k, v), o, segments, s)?;
        let statistics = [2, n, s.heads, STAT_LANES];
        check::expect_shape(
            self,
            "attention_bwd",
            "softmax statistics",
            stats,
            &statistics,
        )?;
        let cum = Self::cumulative(segments);
        let (dq, dk, dv) = (
            self.empty(&q.shape, d_o.dtype)?,
            self.empty(&k.shape, d_o.dtype)?,
            self.empty(&v.shape, d_o.dtype)?,
        );
        let fused = dropout.is_none() && !self.flash.absent() && {
            let rows = [n, s.heads, s.head_dim];
            let (dy, ov) = (d_o.view().reshaped(&rows, 0), o.view().reshaped(&rows, 0));
            let (qv, kv, vv) = heads_views(q, k, v, s);
            let (dqv, dkv, dvv) = heads_views(&dq, &dk, &dv, s);
            self.flash_attention_grad(
                ((&qv, &kv, &vv), (&cum, &cum)),
                (&dy, &ov, stats),
                (&dqv, &dkv, &dvv),
                s,
            )?
        };
        if !fused {
            for seq in sequences(segments, s) {
                self.attention_bwd_by_matmul(
                    (&d_o.view(), &q.view(), &k.view(), &v.view()),
                    seq,
                    (s, d_o.dtype, dropout),
                    (&dq.view(), &dk.view(), &dv.view()),
                )?;
            }
        }
        Ok((dq, dk, dv))
    }

    fn kv_cache(&self, slots: usize, capacity: usize, width: usize) -> Result<NpuTensor> {
        self.zeros(&[slots, capacity, width], DType::F32)
    }

    fn kv_store(&self, cache: &mut NpuTensor, x: &NpuTensor, segments: &[Segment]) -> Result<()> {
        check::kv_store(self, cache, x, segments)?;
        let (capacity, width) = (cache.shape[1], cache.shape[2]);
        let mut r = 0;
        for s in segments {
            let dst = cache
                .view()
                .reshaped(&[s.len, width], (s.slot * capacity + s.past) * width);
            self.copy_view(&dst, &x.view().reshaped(&[s.len, width], r * width))?;
            r += s.len;
        }
        Ok(())
    }

    fn cached_attention(
        &self,
        q: &NpuTensor,
        k_cache: &NpuTensor,
        v_cache: &NpuTensor,
        segments: &[Segment],
        s: AttentionShape,
    ) -> Result<NpuTensor> {
        let rows = check::cached_attention(self, q, k_cache, segments, s)?;
        let (capacity, width) = (k_cache.shape[1], k_cache.shape[2]);
        let hd = s.heads * s.head_dim;
        // The cache is f32; flash attention takes one dtype.
        let qf = self.as_dtype(q, DType::F32)?;
        let out = self.empty(&[rows, hd], DType::F32)?;
        let mut r = 0;
        for seg in segments {
            let seq = Sequence {
                q_at: r * hd,
                kv_at: seg.slot * capacity * width,
                len: seg.len,
                kv_len: seg.past + seg.len,
            };
            let kv = |t: &NpuTensor| {
                t.view()
                    .reshaped(&[seq.kv_len, s.groups, s.head_dim], seq.kv_at)
            };
            let qv = qf
                .view()
                .reshaped(&[seg.len, s.heads, s.head_dim], seq.q_at);
            let ov = out
                .view()
                .reshaped(&[seg.len, s.heads, s.head_dim], seq.q_at);
            let stats = self.empty(&[2, seg.len, s.heads, STAT_LANES], DType::F32)?;
            let cum = ([seg.len as i64], [seq.kv_len as i64]);
            let fused = !self.flash.absent()
                && self.flash_attention(
                    ((&qv, &kv(k_cache), &kv(v_cache)), (&cum.0, &cum.1)),
                    s,
                    &stats,
                    &ov,
                )?;
            if !fused {
                let qkv = (&qf.view(), &k_cache.view(), &v_cache.view());
                self.attention_by_matmul(qkv, seq, (s, DType::F32, None), &out.view())?;
            }
            r += seg.len;
        }
        self.converted(out, q.dtype)
    }

    fn swiglu(&self, x: &NpuTensor) -> Result<NpuTensor> {
        check::swiglu(self, x, None)?;
        let (n, f) = (x.rows(), x.cols() / 2);
        let out = self.empty(&[n, f], x.dtype)?;
        {
            let (xd, o) = (self.ctx.tensor(&x.matrix())?, self.ctx.tensor(&out.view())?);
            aclnn!(
                self,
                aclnnSwiGluGetWorkspaceSize,
                aclnnSwiGlu,
                xd.raw,
                -1,
                o.raw
            )?;
        }
        Ok(out)
    }

    fn swiglu_bwd(&self, dy: &NpuTensor, x: &NpuTensor) -> Result<NpuTensor> {
        check::swiglu(self, x, Some(dy))?;
        let dx = self.empty(&x.shape, dy.dtype)?;
        {
            let c = &self.ctx;
            let (g, xd, o) = (
                c.tensor(&dy.view())?,
                c.tensor(&x.matrix())?,
                c.tensor(&dx.matrix())?,
            );
            aclnn!(
                self,
                aclnnSwiGluGradGetWorkspaceSize,
                aclnnSwiGluGrad,
                g.raw,
                xd.raw,
                -1,
                o.raw
            )?;
        }
        Ok(dx)
    }

    fn squared_relu(&self, x: &NpuTensor) -> Result<NpuTensor> {
        let r = self.relu(x)?;
        let y = self.empty(&x.shape, x.dtype)?;
        self.mul_view(&r.view(), &r.view(), &y.view())?;
        Ok(y)
    }

    fn squared_relu_bwd(&self, dy: &NpuTensor, x: &NpuTensor) -> Result<NpuTensor> {
        check::squared_relu_bwd(self, dy, x)?;
        let r = self.relu(x)?;
        let mut dx = self.empty(&x.shape, dy.dtype)?;
        self.mul_view(&r.view(), &dy.view(), &dx.view())?;
        // ×2 is exact: one rounding, as autograd's `dy·(2·r)`
        self.scale(&mut dx, 2.0)?;
        Ok(dx)
    }

    fn add_assign(&self, x: &mut NpuTensor, y: &NpuTensor) -> Result<()> {
        check::expect_shape(self, "add_assign", "y", y, &x.shape)?;
        self.add_view(&x.view(), &y.view())
    }

    fn log_softmax(&self, x: &NpuTensor) -> Result<NpuTensor> {
        let xf = self.as_dtype(x, DType::F32)?;
        let out = self.empty(&x.shape, DType::F32)?;
        {
            let (xd, o) = (
                self.ctx.tensor(&xf.matrix())?,
                self.ctx.tensor(&out.matrix())?,
            );
            aclnn!(
                self,
                aclnnLogSoftmaxGetWorkspaceSize,
                aclnnLogSoftmax,
                xd.raw,
                -1,
                o.raw
            )?;
        }
        Ok(out)
    }

    fn cross_entropy(&self, logits: &NpuTensor, labels: &[u32]) -> Result<(NpuTensor, NpuTensor)> {
        check::cross_entropy(self, logits, labels)?;
        let (n, v) = (logits.rows(), logits.cols());
        let lf = self.as_dtype(logits, DType::F32)?;
        // A NO_ROW label is ignored (loss 0), then its loss is set to the lse below.
        let target = self.targets(labels, IGNORE_INDEX)?;
        let loss = self.empty(&[n], DType::F32)?;
        let log_prob = self.empty(&[n, v], DType::F32)?;
        let zloss = self.empty(&[2, n], DType::F32)?;
        {
            let c = &self.ctx;
            let (x, t, w) = (
                c.tensor(&lf.matrix())?,
                c.tensor(&target.view())?,
                std::ptr::null(),
            );
            let (l, p) = (c.tensor(&loss.view())?, c.tensor(&log_prob.view())?);
            let (z, zl) = (
                c.tensor(&zloss.view().reshaped(&[n], 0))?,
                c.tensor(&zloss.view().reshaped(&[n], n))?,
            );
            let mut reduction = *b"none\0";
            aclnn!(
                self,
                aclnnCrossEntropyLossGetWorkspaceSize,
                aclnnCrossEntropyLoss,
                x.raw,
                t.raw,
                w,
                reduction.as_mut_ptr().cast(),
                IGNORE_INDEX,
                0.0,
                0.0,
                false,
                l.raw,
                p.raw,
                z.raw,
                zl.raw,
            )?;
        }
        // log p = logit − lse in every column, so lse = logit − log p of column 0.
        let lse = self.empty(&[n], DType::F32)?;
        let column = |t: &NpuTensor| t.view().strided(&[n], &[v as i64], 0);
        self.sub_view(&column(&lf), &column(&log_prob), &lse.view())?;
        if let Some(mask) = self.no_row_ones(labels)? {
            self.add_masked(&loss.view(), &mask, &lse.view())?;
        }
        Ok((loss, lse))
    }

    fn cross_entropy_bwd(
        &self,
        logits: NpuTensor,
        labels: &[u32],
        lse: &NpuTensor,
        dloss: &NpuTensor,
    ) -> Result<NpuTensor> {
        check::cross_entropy_bwd(self, &logits, labels, lse, dloss)?;
        let (n, v) = (logits.rows(), logits.cols());
        let dtype = logits.dtype;
        let log_prob = self.empty(&[n, v], DType::F32)?;
        self.sub_view(
            &self.as_dtype(&logits, DType::F32)?.matrix(),
            &lse.view().reshaped(&[n, 1], 0),
            &log_prob.view(),
        )?;
        // A NO_ROW label takes class 0, whose −dloss is added back below.
        let target = self.targets(labels, 0)?;
        // The gradient takes log p's dtype (f32): it overwrites f32 logits' memory (the
        // operator reads only log p), else it is cast back to the logits' dtype.
        let grad = match logits.dtype {
            DType::F32 => logits,
            _ => self.empty(&[n, v], DType::F32)?,
        };
        {
            let c = &self.ctx;
            let (g, p, t) = (
                c.tensor(&dloss.view())?,
                c.tensor(&log_prob.view())?,
                c.tensor(&target.view())?,
            );
            let out = c.tensor(&grad.matrix())?;
            let null = std::ptr::null();
            let mut reduction = *b"none\0";
            aclnn!(
                self,
                aclnnCrossEntropyLossGradGetWorkspaceSize,
                aclnnCrossEntropyLossGrad,
                g.raw,
                p.raw,
                t.raw,
                null,
                null,
                null,
                reduction.as_mut_ptr().cast(),
                IGNORE_INDEX,
                0.0,
                0.0,
                out.raw,
            )?;
        }
        if let Some(mask) = self.no_row_ones(labels)? {
            let class0 = grad.view().strided(&[n], &[v as i64], 0);
            self.add_masked(&class0, &mask, &dloss.view())?;
        }
        self.converted(grad, dtype)
    }

    fn cast(&self, x: &NpuTensor, dtype: DType) -> Result<NpuTensor> {
        ensure(self.supports(Op::Cast, dtype), "cast", || {
            format!("to {dtype:?}")
        })?;
        let out = self.empty(&x.shape, dtype)?;
        {
            let (xd, o) = (self.ctx.tensor(&x.view())?, self.ctx.tensor(&out.view())?);
            aclnn!(
                self,
                aclnnCastGetWorkspaceSize,
                aclnnCast,
                xd.raw,
                acl_dtype(dtype),
                o.raw
            )?;
        }
        Ok(out)
    }

    fn copy_into(&self, src: &NpuTensor, dst: &mut NpuTensor) -> Result<()> {
        check::expect_shape(self, "copy_into", "src", src, &dst.shape)?;
        self.copy_view(&dst.view(), &src.view())
    }

    fn copy_range(
        &self,
        (src, at): (&NpuTensor, usize),
        (dst, to): (&mut NpuTensor, usize),
        n: usize,
    ) -> Result<()> {
        check::expect_range(self, "copy_range", "src", (src, at), n)?;
        check::expect_range(self, "copy_range", "dst", (dst, to), n)?;
        self.copy_view(
            &dst.view().reshaped(&[n], to),
            &src.view().reshaped(&[n], at),
        )
    }

    fn copy_transposed(
        &self,
        (src, at): (&NpuTensor, usize),
        (rows, cols): (usize, usize),
        (dst, to): (&mut NpuTensor, usize),
    ) -> Result<()> {
        let n = check::block("copy_transposed", (rows, cols))?;
        check::expect_range(self, "copy_transposed", "src", (src, at), n)?;
        check::expect_range(self, "copy_transposed", "dst", (dst, to), n)?;
        // the source read column by column: a [cols, rows] view with strides [1, cols]
        self.copy_view(
            &dst.view().reshaped(&[cols, rows], to),
            &src.view().strided(&[cols, rows], &[1, cols as i64], at),
        )
    }

    fn gather(&self, x: &NpuTensor, view: StridedView, shape: &[usize]) -> Result<NpuTensor> {
        check::strided(self, "gather", x, view, shape)?;
        let out = self.empty(shape, x.dtype)?;
        self.copy_view(&out.view().reshaped(&view.shape, 0), &strided(x, view))?;
        Ok(out)
    }

    fn scatter(&self, y: &NpuTensor, x: &mut NpuTensor, view: StridedView) -> Result<()> {
        check::strided(self, "scatter", x, view, &y.shape)?;
        check::same_dtype(self, "scatter", y, x)?;
        self.copy_view(&strided(x, view), &y.view().reshaped(&view.shape, 0))
    }

    fn dropout(&self, x: &NpuTensor, mask: &Mask) -> Result<NpuTensor> {
        check::dropout(self, x, mask)?;
        // The factors are drawn on the host from the same generator as the CPU's and
        // uploaded as f32, so that a bf16 element is rounded once, after its f32 product.
        let factors = self.upload_f32(&x.shape, &mask.factors(x.cols()))?;
        let out = self.empty(&x.shape, x.dtype)?;
        self.mul_view(&x.view(), &factors.view(), &out.view())?;
        Ok(out)
    }

    fn scaled(&self, x: &NpuTensor, s: f32) -> Result<NpuTensor> {
        let out = self.empty(&x.shape, x.dtype)?;
        {
            let c = &self.ctx;
            let (xd, k, o) = (c.tensor(&x.view())?, c.scalar(s)?, c.tensor(&out.view())?);
            aclnn!(
                self,
                aclnnMulsGetWorkspaceSize,
                aclnnMuls,
                xd.raw,
                k.raw,
                o.raw
            )?;
        }
        Ok(out)
    }

    fn scale(&self, x: &mut NpuTensor, s: f32) -> Result<()> {
        let (xd, k) = (self.ctx.tensor(&x.view())?, self.ctx.scalar(s)?);
        aclnn!(
            self,
            aclnnInplaceMulsGetWorkspaceSize,
            aclnnInplaceMuls,
            xd.raw,
            k.raw
        )
    }

    fn sum_squares(&self, xs: &[&NpuTensor]) -> Result<f64> {
        if xs.is_empty() {
            return Ok(0.0);
        }
        // The operator's norms take their input's dtype: norms of f32 copies.
        let wide = xs
            .iter()
            .map(|x| self.as_dtype(x, DType::F32))
            .collect::<Result<Vec<_>>>()?;
        let norms = self.empty(&[xs.len()], DType::F32)?;
        {
            let c = &self.ctx;
            let inputs: Vec<View> = wide.iter().map(|x| x.view()).collect();
            let outputs: Vec<View> = (0..xs.len())
                .map(|i| norms.view().reshaped(&[1], i))
                .collect();
            let (x, p, o) = (c.list(&inputs)?, c.scalar(2.0)?, c.list(&outputs)?);
            aclnn!(
                self,
                aclnnForeachNormGetWorkspaceSize,
                aclnnForeachNorm,
                x.raw,
                p.raw,
                o.raw
            )?;
        }
        let norms = self.download_f32(&norms)?;
        Ok(norms.iter().map(|&n| f64::from(n) * f64::from(n)).sum())
    }

    fn adamw(
        &self,
        param: &mut NpuTensor,
        grad: &mut NpuTensor,
        (m, v): (&mut NpuTensor, &mut NpuTensor),
        a: AdamWStep,
        model: Option<&mut NpuTensor>,
    ) -> Result<()> {
        let rest = [("grad", &*grad), ("m", &*m), ("v", &*v)];
        check::adamw(self, param, rest, model.as_deref())?;
        if a.grad_scale != 1.0 {
            self.scale(grad, a.grad_scale)?;
        }
        self.apply_adamw(param, grad, (m, v), a)?;
        if let Some(model) = model {
            self.copy_into(param, model)?;
        }
        self.ctx
            .zero(grad.block.ptr, grad.numel() * grad.dtype.size())?;
        Ok(())
    }
}

impl Npu {
    /// aclnnApplyAdamWV2 on `param`, `m`, `v` in place.
    fn apply_adamw(
        &self,
        param: &mut NpuTensor,
        grad: &NpuTensor,
        (m, v): (&mut NpuTensor, &mut NpuTensor),
        a: AdamWStep,
    ) -> Result<()> {
        let step = self.indices(std::iter::once(a.step as i64))?;
        let c = &self.ctx;
        let (p, md, vd) = (
            c.tensor(&param.view())?,
            c.tensor(&m.view())?,
            c.tensor(&v.view())?,
        );
        let (g, st) = (c.tensor(&grad.view())?, c.tensor(&step.view())?);
        let (b1, b2) = (a.betas.0 as f32, a.betas.1 as f32);
        aclnn!(
            self,
            aclnnApplyAdamWV2GetWorkspaceSize,
            aclnnApplyAdamWV2,
            p.raw,
            md.raw,
            vd.raw,
            std::ptr::null_mut(),
            g.raw,
            st.raw,
            a.lr as f32,
            b1,
            b2,
            a.weight_decay as f32,
            a.eps as f32,
            false,
            false,
        )
    }
}

/// The sequences of packed activations (`segments` of rows, keys the same rows).
fn sequences(segments: &[Range<usize>], s: AttentionShape) -> impl Iterator<Item = Sequence> + '_ {
    let (hd, gw) = (s.heads * s.head_dim, s.groups * s.head_dim);
    segments.iter().map(move |r| Sequence {
        q_at: r.start * hd,
        kv_at: r.start * gw,
        len: r.len(),
        kv_len: r.len(),
    })
}

/// `q [n, heads, d]`, `k`, `v [n, groups, d]` views of row-major activations.
fn heads_views(
    q: &NpuTensor,
    k: &NpuTensor,
    v: &NpuTensor,
    s: AttentionShape,
) -> (View, View, View) {
    let n = q.rows();
    (
        q.view().reshaped(&[n, s.heads, s.head_dim], 0),
        k.view().reshaped(&[n, s.groups, s.head_dim], 0),
        v.view().reshaped(&[n, s.groups, s.head_dim], 0),
    )
}

/// A tensor in the dtype an operator needs: the tensor itself, or a cast copy.
enum InDtype<'a> {
    Same(&'a NpuTensor),
    Cast(NpuTensor),
}

impl std::ops::Deref for InDtype<'_> {
    type Target = NpuTensor;
    fn deref(&self) -> &NpuTensor {
        match self {
            InDtype::Same(t) => t,
            InDtype::Cast(t) => t,
        }
    }
}
