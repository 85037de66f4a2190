//! The compute engine: the [`Backend`] trait and its CPU implementation.
//!
//! The trait's operations are the fused operators an Ascend NPU offers through aclnn
//! (`reference/npu.md` §3.3–3.4), one method per operator, so an NPU backend implements it op
//! for op and the training issue adds each op's backward twin beside it. Activations are f32;
//! weights stay in the dtype they were loaded in (bf16 / f16 / f32) and are widened per tile
//! inside the matmul.

pub mod cpu;
pub(crate) mod panel;
pub(crate) mod simd;

use crate::ckpt::tensor::Tensor as HostTensor;
use anyhow::Result;

/// One sequence's rows in a ragged batch: the KV-cache slot it owns, how many positions that
/// slot already holds, and how many new rows (tokens) it contributes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// KV-cache slot.
    pub slot: usize,
    /// Positions already in the cache (the first new row sits at this position).
    pub past: usize,
    /// New rows.
    pub len: usize,
}

/// The shape of grouped-query attention.
#[derive(Debug, Clone, Copy)]
pub struct AttentionShape {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (query groups).
    pub groups: usize,
    /// Per-head dimension.
    pub head_dim: usize,
    /// Score scale (1/√head_dim).
    pub scale: f32,
}

/// A compute device. Every op allocates its output on the device; `&mut` arguments are updated
/// in place (the aclnn `Inplace` variants).
pub trait Backend: Sync {
    /// A tensor in the device's memory.
    type Tensor: Send + Sync;

    /// The device, in words.
    fn describe(&self) -> String;
    /// Copy host weights to the device, keeping their dtype.
    fn upload(&self, t: &HostTensor) -> Result<Self::Tensor>;
    /// Copy a weight used only as the right operand of [`Backend::matmul`], in the layout the
    /// device multiplies fastest (on Ascend the NZ format of aclnnTransMatmulWeight).
    fn upload_matrix(&self, t: &HostTensor) -> Result<Self::Tensor> {
        self.upload(t)
    }
    /// Copy f32 values of `shape` to the device.
    fn upload_f32(&self, shape: &[usize], values: &[f32]) -> Self::Tensor;
    /// The values of a tensor, widened to f32, row-major.
    fn to_host(&self, t: &Self::Tensor) -> Vec<f32>;
    /// Its shape.
    fn shape<'a>(&self, t: &'a Self::Tensor) -> &'a [usize];

    /// Rows `ids` of `table` (aclnnEmbedding), as f32.
    fn embedding(&self, table: &Self::Tensor, ids: &[u32]) -> Self::Tensor;
    /// Rows `rows` of `x` (aclnnIndexSelect).
    fn select_rows(&self, x: &Self::Tensor, rows: &[usize]) -> Self::Tensor;
    /// `x · rsqrt(mean(x²) + eps) · gamma` over the last dimension (aclnnRmsNorm).
    fn rms_norm(&self, x: &Self::Tensor, gamma: &Self::Tensor, eps: f64) -> Self::Tensor;
    /// `x · wᵀ (+ bias)` for `x [n, k]`, `w [m, k]` (aclnnMatmul with `wᵀ` as a view, aclnnAdd).
    fn matmul(
        &self,
        x: &Self::Tensor,
        w: &Self::Tensor,
        bias: Option<&Self::Tensor>,
    ) -> Self::Tensor;
    /// Split a fused QKV activation `[n, groups·(heads/groups + 2)·d]` (Megatron's GQA-grouped
    /// order) into `q [n, heads·d]`, `k [n, groups·d]`, `v [n, groups·d]` (aclnnSplitWithSize).
    fn split_qkv(
        &self,
        qkv: &Self::Tensor,
        shape: AttentionShape,
    ) -> (Self::Tensor, Self::Tensor, Self::Tensor);
    /// Rotary embedding in place, half-rotation (`rotate_half`) mode, on every head of
    /// `x [n, heads·d]`; `cos`, `sin` are `[n, d/2]` (aclnnRotaryPositionEmbedding mode 0).
    fn rope(&self, x: &mut Self::Tensor, cos: &Self::Tensor, sin: &Self::Tensor);
    /// An empty KV cache of `slots × capacity` rows of `width` (f32).
    fn kv_cache(&self, slots: usize, capacity: usize, width: usize) -> Self::Tensor;
    /// Store the rows of `x` (segment after segment) at each segment's slot and positions
    /// `past..past + len` (aclnnScatterUpdate).
    fn kv_store(&self, cache: &mut Self::Tensor, x: &Self::Tensor, segments: &[Segment]);
    /// Causal grouped-query attention of `q [n, heads·d]` (segment after segment) over each
    /// segment's cached keys and values, positions `0..=past + i` for its row `i`
    /// (aclnnFusedInferAttentionScore with actual sequence lengths).
    fn attention(
        &self,
        q: &Self::Tensor,
        k_cache: &Self::Tensor,
        v_cache: &Self::Tensor,
        segments: &[Segment],
        shape: AttentionShape,
    ) -> Self::Tensor;
    /// `silu(a) · b` for `x = [a | b]` split along the last dimension (aclnnSwiGlu).
    fn swiglu(&self, x: &Self::Tensor) -> Self::Tensor;
    /// `x += y` (aclnnInplaceAdd).
    fn add_assign(&self, x: &mut Self::Tensor, y: &Self::Tensor);
    /// Log-softmax over the last dimension (aclnnLogSoftmax).
    fn log_softmax(&self, x: &Self::Tensor) -> Self::Tensor;
}

/// A raw pointer to disjoint parts of one output, shared by the tasks that write them.
#[derive(Clone, Copy)]
pub(crate) struct SharedOut(pub(crate) *mut f32);
// SAFETY: every task writes a region no other task touches (stated where it is used).
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}

impl SharedOut {
    /// The element `i` places in.
    ///
    /// # Safety
    /// `i` must lie inside the output.
    pub(crate) unsafe fn at(self, i: usize) -> *mut f32 {
        self.0.add(i)
    }
}
