//! The compute engine's contract: a [`Device`] (memory, transfers, synchronisation, what it
//! supports) and the [`Backend`] operators on it, and the CPU implementation ([`cpu`]) every
//! other backend is checked against.
//!
//! The operators are the fused operators an Ascend NPU offers through aclnn, one method per
//! operator and, for training, its backward twin beside it, the way aclnn pairs them
//! (`aclnnRmsNorm` → `(y, rstd)`, `aclnnRmsNormGrad` takes `rstd` back). Each method's doc names
//! its aclnn operator and says whether it **overwrites** (returns a new tensor, or overwrites an
//! `&mut` output) or **accumulates** into an `&mut` gradient. Every operator returns a
//! [`Result`]: shapes and dtypes are checked, and a device error is an error, never a panic.
//!
//! Activations are f32 or bf16/f16 (an operator's output takes the dtype of its main input);
//! weights keep the dtype they were loaded in. Saved statistics (`rstd`, attention log-sum-exp,
//! cross-entropy log-sum-exp) and gradients of the optimizer's parameters are f32.

pub(crate) mod check;
pub mod comm;
pub mod cpu;
pub mod dispatch;
pub mod dropout;
pub mod grouped;
pub mod layer_norm;
pub mod selftest;

use crate::tensor::host::Tensor as HostTensor;
use crate::tensor::DType;
use dispatch::Dispatch;
use dropout::Mask;
use std::ops::Range;

/// What an engine operation can fail with.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// Inputs whose shapes or dtypes do not fit the operator (a bug in the caller or bad
    /// weights).
    #[error("{op}: {msg}")]
    Invalid {
        /// The operator.
        op: &'static str,
        /// What does not fit.
        msg: String,
    },
    /// The device cannot run the operator on this dtype.
    #[error("{op} does not support {dtype:?} on {device}")]
    Unsupported {
        /// The operator.
        op: &'static str,
        /// The dtype asked for.
        dtype: DType,
        /// The device.
        device: String,
    },
    /// A collective failed: the ranks disagree, or one left or never came.
    #[error("rank {rank}: {msg}")]
    Collective {
        /// The rank that saw the failure.
        rank: usize,
        /// What went wrong.
        msg: String,
    },
    /// The device itself failed (an accelerator runtime error, with its own message).
    #[error("device error: {0}")]
    Device(String),
    /// The device asked for cannot be used in this build or on this machine.
    #[error("--device {0}: {1}")]
    Unavailable(&'static str, String),
}

/// A result of the engine.
pub type Result<T> = std::result::Result<T, EngineError>;

/// A token id or label that no row of this rank's vocabulary shard holds (Megatron's
/// vocabulary-parallel embedding and cross entropy mask them: megatron-core
/// megatron/core/tensor_parallel/layers.py `VocabParallelEmbedding.forward`,
/// cross_entropy.py `VocabParallelCrossEntropy`): [`Backend::embedding`] gives it a zero row,
/// [`Backend::embedding_bwd`] skips it, and [`Backend::cross_entropy`] /
/// [`Backend::cross_entropy_bwd`] count no target logit for it.
pub const NO_ROW: u32 = u32::MAX;

/// Fail with [`EngineError::Invalid`] unless `cond` holds.
pub(crate) fn ensure(cond: bool, op: &'static str, msg: impl FnOnce() -> String) -> Result<()> {
    if cond {
        Ok(())
    } else {
        Err(EngineError::Invalid { op, msg: msg() })
    }
}

/// `Invalid` unless every segment lies inside `0..rows`, in order, without gaps.
pub(crate) fn check_segments(
    op: &'static str,
    segments: &[Range<usize>],
    rows: usize,
) -> Result<()> {
    let mut at = 0;
    for s in segments {
        ensure(s.start == at && s.end > s.start, op, || {
            format!("segment {s:?} does not continue at row {at}")
        })?;
        at = s.end;
    }
    ensure(at == rows, op, || {
        format!("segments cover {at} rows of {rows}")
    })
}

/// DeepSeek sparse attention's choice of keys: query row `r` of a pass attends only to the
/// rows of the same pass named in `keys[r·per_row..][..per_row]` (−1 names none), among
/// those it sees (MindSpeed-LLM's dsa_indexer.py `generate_sparse_mask`).
#[derive(Debug, Clone, PartialEq)]
pub struct Selection {
    keys: Vec<i32>,
    per_row: usize,
}

impl Selection {
    /// `keys [rows, per_row]`, −1 for none.
    pub fn new(keys: Vec<i32>, per_row: usize) -> Selection {
        assert!(
            per_row > 0 && keys.len().is_multiple_of(per_row),
            "internal: key selection shape"
        );
        Selection { keys, per_row }
    }

    /// The query rows it covers.
    pub fn rows(&self) -> usize {
        self.keys.len() / self.per_row
    }

    /// The keys query row `row` attends to.
    pub fn keys_of(&self, row: usize) -> impl Iterator<Item = usize> + '_ {
        let row = &self.keys[row * self.per_row..][..self.per_row];
        row.iter().filter_map(|&k| usize::try_from(k).ok())
    }

    /// Every row's keys `[rows, per_row]`, −1 for none.
    pub fn keys(&self) -> &[i32] {
        &self.keys
    }

    /// Keys per row.
    pub fn per_row(&self) -> usize {
        self.per_row
    }
}

/// The error of a device without DeepSeek sparse attention.
fn sparse_attention_unbuilt(op: &'static str) -> EngineError {
    EngineError::Invalid {
        op,
        msg: "DeepSeek sparse attention (--enable-dsa-indexer) is built on the CPU only".into(),
    }
}

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
#[derive(Debug, Clone, Copy, PartialEq)]
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

/// A strided view of a tensor's elements in row-major order: element `(i, j, k)` of `shape`
/// is element `offset + i·strides[0] + j·strides[1] + k·strides[2]` of the tensor (a view
/// torch's `as_strided` would make).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StridedView {
    /// The view's extent.
    pub shape: [usize; 3],
    /// Elements between neighbours of each dimension.
    pub strides: [usize; 3],
    /// The first element.
    pub offset: usize,
}

impl StridedView {
    /// Columns `at..at + width` of each of `blocks` blocks of `block` columns in rows of
    /// `row` elements, `rows` rows: a part of every head (`blocks` heads of `block`).
    pub fn columns(
        rows: usize,
        row: usize,
        (blocks, block): (usize, usize),
        at: usize,
        width: usize,
    ) -> Self {
        StridedView {
            shape: [rows, blocks, width],
            strides: [row, block, 1],
            offset: at,
        }
    }

    /// Its elements.
    pub fn count(&self) -> usize {
        self.shape.iter().product()
    }

    /// The index of each of its elements, in order.
    pub fn indices(&self) -> impl Iterator<Item = usize> + '_ {
        let [a, b, c] = self.shape;
        let [sa, sb, sc] = self.strides;
        (0..a).flat_map(move |i| {
            (0..b).flat_map(move |j| (0..c).map(move |k| self.offset + i * sa + j * sb + k * sc))
        })
    }

    /// One past its last element's index (0 when empty); `None` on overflow.
    pub fn end(&self) -> Option<usize> {
        if self.count() == 0 {
            return Some(0);
        }
        let mut last = self.offset;
        for (n, s) in self.shape.iter().zip(self.strides) {
            last = last.checked_add((n - 1).checked_mul(s)?)?;
        }
        last.checked_add(1)
    }
}

/// AdamW's scalars for one step (torch's `AdamW` semantics: decoupled decay, ε added after the
/// bias-corrected square root).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWStep {
    /// Learning rate.
    pub lr: f64,
    /// β₁, β₂.
    pub betas: (f64, f64),
    /// ε.
    pub eps: f64,
    /// Weight decay (0 for the no-decay group).
    pub weight_decay: f64,
    /// Step number, from 1.
    pub step: u64,
    /// The gradient is multiplied by it first, in place: Megatron's clipping coefficient
    /// (`--clip-grad` over the global norm), 1 when the norm is within the bound.
    pub grad_scale: f32,
}

/// The operators, for [`Device::supports`] and `mindkit selftest`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[allow(missing_docs)]
pub enum Op {
    Embedding,
    EmbeddingBwd,
    RmsNorm,
    RmsNormBwd,
    LayerNorm,
    LayerNormBwd,
    Matmul,
    MatmulBwd,
    /// Grouped matmul and its backward (an MoE layer's experts).
    GroupedMatmul,
    /// An MoE layer's routing: the router's top-k ([`Backend::softmax_topk`]), the tokens'
    /// permutation and its sum back ([`Backend::permute`], [`Backend::unpermute`]).
    MoeRouting,
    SplitQkv,
    /// StridedView copies (gather and scatter).
    Gather,
    Rope,
    Attention,
    AttentionBwd,
    /// Attention (and its backward) with a dropout mask.
    AttentionDropout,
    Dropout,
    CachedAttention,
    SwiGlu,
    SwiGluBwd,
    /// [`Backend::squared_relu`] and its backward.
    SquaredRelu,
    CrossEntropy,
    CrossEntropyBwd,
    LogSoftmax,
    Add,
    Cast,
    AdamW,
    Norm,
}

/// Memory, transfers and synchronisation of a compute device.
pub trait Device: Sync {
    /// A tensor in the device's memory.
    type Tensor: Send + Sync + comm::Payload;

    /// The device, in words.
    fn describe(&self) -> String;
    /// Whether it runs `op` on `dtype`.
    fn supports(&self, op: Op, dtype: DType) -> bool;
    /// Copy a host tensor to the device, keeping its dtype.
    fn upload(&self, t: &HostTensor) -> Result<Self::Tensor>;
    /// Copy a weight used only as the right operand of [`Backend::matmul`] (inference), in the
    /// layout the device multiplies fastest (on Ascend the NZ format of
    /// aclnnTransMatmulWeight).
    fn upload_matrix(&self, t: &HostTensor) -> Result<Self::Tensor> {
        self.upload(t)
    }
    /// Copy f32 values of `shape` to the device.
    fn upload_f32(&self, shape: &[usize], values: &[f32]) -> Result<Self::Tensor>;
    /// A zero tensor.
    fn zeros(&self, shape: &[usize], dtype: DType) -> Result<Self::Tensor>;
    /// The values of a tensor, widened to f32, row-major (waits for the device).
    fn download_f32(&self, t: &Self::Tensor) -> Result<Vec<f32>>;
    /// A tensor as a host tensor in its own dtype (waits for the device).
    fn download(&self, t: &Self::Tensor) -> Result<HostTensor>;
    /// Wait until every queued operation has finished.
    fn synchronize(&self) -> Result<()>;
    /// Its shape.
    fn shape<'a>(&self, t: &'a Self::Tensor) -> &'a [usize];
    /// Its dtype.
    fn dtype(&self, t: &Self::Tensor) -> DType;
}

/// The operators. Shapes in the docs: n = rows (tokens), h = hidden, k/m = matmul inner/outer.
pub trait Backend: Device {
    /// Rows `ids` of `table [v, h]` → `[n, h]`, as f32 whatever the table's dtype (a bf16
    /// model casts them with [`Backend::cast`]); a zero row for [`NO_ROW`] (aclnnEmbedding).
    /// Overwrites.
    fn embedding(&self, table: &Self::Tensor, ids: &[u32]) -> Result<Self::Tensor>;
    /// `dtable += onehot(ids)ᵀ · dy`, [`NO_ROW`] ids skipped (aclnnEmbeddingDenseBackward +
    /// aclnnInplaceAdd). Accumulates.
    fn embedding_bwd(
        &self,
        dy: &Self::Tensor,
        ids: &[u32],
        dtable: &mut Self::Tensor,
    ) -> Result<()>;
    /// Rows `rows` of `x` (aclnnIndexSelect). Overwrites.
    fn select_rows(&self, x: &Self::Tensor, rows: &[usize]) -> Result<Self::Tensor>;
    /// `dst[rows[i]] += src[i]` for each row `i` of `src` in order, each sum rounded to `dst`'s
    /// dtype (megatron-core's `scatter_add_`); a row may repeat, an MoE layer's token routed to
    /// several experts (the backward pass of [`Backend::select_rows`], an MoE layer's
    /// combination of its experts' outputs). On the NPU a repeated row's terms are summed
    /// together before their one rounding (aclnnEmbeddingDenseBackward, then
    /// aclnnInplaceAdd). Accumulates.
    fn index_add_rows(
        &self,
        dst: &mut Self::Tensor,
        src: &Self::Tensor,
        rows: &[usize],
    ) -> Result<()>;
    /// Each row's `k` largest softmax probabilities of `logits [n, E]` and their columns, best
    /// first (the lower column first among equals), `[n, k]` each on the host, the
    /// probabilities rounded to the logits' dtype (an MoE router's top-k over a softmax,
    /// aclnnMoeGatingTopKSoftmax on the NPU).
    fn softmax_topk(&self, logits: &Self::Tensor, k: usize) -> Result<(Vec<u32>, Vec<f32>)> {
        dispatch::softmax_topk(self, logits, k)
    }
    /// The rows of `x [tokens, h]` the dispatch routes, in its permuted order (expert after
    /// expert, [`Dispatch::rows`]): `[d.len(), h]` (megatron-core moe_utils.py `permute`;
    /// aclnnMoeTokenPermute on the NPU, or aclnnMoeInitRoutingV2). Overwrites.
    fn permute(&self, x: &Self::Tensor, d: &Dispatch) -> Result<Self::Tensor> {
        dispatch::permute(self, x, d)
    }
    /// The backward pass of [`Backend::permute`]: [`Backend::unpermute`]'s sum
    /// (aclnnMoeTokenPermuteGrad on the NPU where every choice is routed, the operator
    /// MindSpeed's fused permutation differentiates by). Overwrites.
    fn permute_bwd(&self, dy: &Self::Tensor, d: &Dispatch) -> Result<Self::Tensor> {
        dispatch::unpermute(self, dy, d)
    }
    /// `[tokens, h]`: each token's permuted rows of `y [d.len(), h]` summed, as
    /// [`Backend::index_add_rows`] adds them into zeros (`unpermute` with the routing weights
    /// applied before it, as megatron-core 0.15's experts apply them; on the NPU where every
    /// choice is routed aclnnMoeTokenUnpermute, its probabilities ones). Overwrites.
    fn unpermute(&self, y: &Self::Tensor, d: &Dispatch) -> Result<Self::Tensor> {
        dispatch::unpermute(self, y, d)
    }
    /// The backward pass of [`Backend::unpermute`]: [`Backend::permute`]'s gather
    /// (aclnnMoeTokenUnpermuteGrad on the NPU where every choice is routed). Overwrites.
    fn unpermute_bwd(&self, dy: &Self::Tensor, d: &Dispatch) -> Result<Self::Tensor> {
        dispatch::permute(self, dy, d)
    }
    /// `y[i] = x[i] · w[i]` for rows `x [n, c]` and f32 weights `w [n]`, the product in f32
    /// and stored in `x`'s dtype (aclnnMul, `w` broadcast as `[n, 1]`; an MoE expert's routing
    /// weights). Overwrites.
    fn scale_rows(&self, x: &Self::Tensor, w: &Self::Tensor) -> Result<Self::Tensor>;
    /// `Σ_c x[i, c] · y[i, c]` of each row, as f32 on the host (aclnnMul + aclnnReduceSum, read
    /// back; the gradient of [`Backend::scale_rows`]'s weights).
    fn row_dots(&self, x: &Self::Tensor, y: &Self::Tensor) -> Result<Vec<f32>>;
    /// `y = x · rstd · γ` over each γ-wide group of a row (the whole last dimension, or each
    /// head of `[n, heads·d]` for a `[d]` γ: Qwen3's q/k norms), `rstd = 1/√(mean(x²) + eps)`
    /// `[n·groups]` f32 (aclnnRmsNorm on `x` seen as `[n·groups, |γ|]`). Overwrites.
    fn rms_norm(
        &self,
        x: &Self::Tensor,
        gamma: &Self::Tensor,
        eps: f64,
    ) -> Result<(Self::Tensor, Self::Tensor)>;
    /// `dx` of [`Backend::rms_norm`], and `dγ += Σ dy∘x·rstd` (aclnnRmsNormGrad). Returns dx
    /// (overwrites); accumulates into `dgamma` (`None`: γ is frozen).
    fn rms_norm_bwd(
        &self,
        dy: &Self::Tensor,
        x: &Self::Tensor,
        gamma: &Self::Tensor,
        rstd: &Self::Tensor,
        dgamma: Option<&mut Self::Tensor>,
    ) -> Result<Self::Tensor>;
    /// `y = (x − μ)·rstd·γ + β` over each row of `x [n, |γ|]`, μ the row's mean and
    /// `rstd = 1/√(var + eps)` (the biased variance), in f32 and stored in `x`'s dtype; with
    /// the rows' means then rstds `[2n]` (f32) for the backward pass (torch.nn.LayerNorm;
    /// aclnnLayerNorm's meanOut and rstdOut). By default on the host ([`layer_norm`]).
    /// Overwrites.
    fn layer_norm(
        &self,
        x: &Self::Tensor,
        (gamma, beta): (&Self::Tensor, &Self::Tensor),
        eps: f64,
    ) -> Result<(Self::Tensor, Self::Tensor)> {
        layer_norm::forward(self, x, (gamma, beta), eps)
    }
    /// `dx` of [`Backend::layer_norm`] given `dy` and its `stats`, and `dγ += Σ dy∘x̂`,
    /// `dβ += Σ dy` into whichever is trained (aclnnLayerNormBackward). Returns dx
    /// (overwrites).
    fn layer_norm_bwd(
        &self,
        (dy, x): (&Self::Tensor, &Self::Tensor),
        gamma: &Self::Tensor,
        stats: &Self::Tensor,
        grads: (Option<&mut Self::Tensor>, Option<&mut Self::Tensor>),
    ) -> Result<Self::Tensor> {
        layer_norm::backward(self, (dy, x), gamma, stats, grads)
    }
    /// `y [n, m] = x [n, k] · wᵀ (+ bias)` for `w [m, k]` (aclnnMatmul with `wᵀ` as a view,
    /// aclnnAdd). Overwrites.
    fn matmul(
        &self,
        x: &Self::Tensor,
        w: &Self::Tensor,
        bias: Option<&Self::Tensor>,
    ) -> Result<Self::Tensor>;
    /// The backward of [`Backend::matmul`]: returns `dx [n, k] = dy · w` (aclnnMatmul,
    /// overwrites); `dw [m, k] += dyᵀ · x` (aclnnMatmul with `dyᵀ` as a view +
    /// aclnnInplaceAdd, or aclnnInplaceAddmm) and `dbias [m] += Σ_rows dy`
    /// (aclnnReduceSum + add) accumulate; `None` skips a frozen parameter's gradient.
    fn matmul_bwd(
        &self,
        dy: &Self::Tensor,
        x: &Self::Tensor,
        w: &Self::Tensor,
        dw: Option<&mut Self::Tensor>,
        dbias: Option<&mut Self::Tensor>,
    ) -> Result<Self::Tensor>;
    /// `y [n, m]`: each group of `counts[g]` consecutive rows of `x [n, k]` times `w[g]ᵀ`
    /// (`w[g] [m, k]`; `Σ counts = n`): an MoE layer's experts on their tokens, permuted expert
    /// after expert (aclnnGroupedMatmulV4: `x` split along M by a list of group sizes, the
    /// weights a list of transposed views). Each group's rows as [`Backend::matmul`] gives
    /// them. Overwrites.
    fn grouped_matmul(
        &self,
        x: &Self::Tensor,
        w: &[&Self::Tensor],
        counts: &[usize],
    ) -> Result<Self::Tensor>;
    /// The backward of [`Backend::grouped_matmul`]: returns `dx [n, k]`, each group's
    /// `dy_g · w[g]` (aclnnGroupedMatmulV4 split along M; overwrites), and accumulates
    /// `dw[g] += dy_gᵀ · x_g` where `dw[g]` is given (aclnnGroupedMatmulV4 split along K, then
    /// aclnnInplaceAdd), each as [`Backend::matmul_bwd`] would for the group alone.
    fn grouped_matmul_bwd(
        &self,
        dy: &Self::Tensor,
        x: &Self::Tensor,
        w: &[&Self::Tensor],
        counts: &[usize],
        dw: &mut [Option<&mut Self::Tensor>],
    ) -> Result<Self::Tensor>;
    /// Split a fused QKV activation `[n, groups·(heads/groups + 2)·d]` (Megatron's GQA-grouped
    /// order) into `q [n, heads·d]`, `k [n, groups·d]`, `v [n, groups·d]`
    /// (aclnnSplitWithSize). Overwrites.
    fn split_qkv(
        &self,
        qkv: &Self::Tensor,
        shape: AttentionShape,
    ) -> Result<(Self::Tensor, Self::Tensor, Self::Tensor)>;
    /// The backward of [`Backend::split_qkv`]: `dq, dk, dv` interleaved back into the fused
    /// layout (aclnnCat). Overwrites.
    fn merge_qkv(
        &self,
        dq: &Self::Tensor,
        dk: &Self::Tensor,
        dv: &Self::Tensor,
        shape: AttentionShape,
    ) -> Result<Self::Tensor>;
    /// Rotary embedding in place, half-rotation (`rotate_half`) mode, on the first `r` of the
    /// `head_dim` dimensions of every head of `x [n, heads·head_dim]` (all of them, or fewer:
    /// Megatron's `--rotary-percent`, the rest passed through); `cos`, `sin` are `[n, r/2]`;
    /// `inverse` rotates by −θ, which is the operator's backward (aclnnRotaryPositionEmbedding
    /// mode 0 / its grad; a partial rotation on a gathered copy of the rotated dimensions).
    /// Overwrites `x`.
    fn rope(
        &self,
        x: &mut Self::Tensor,
        cos: &Self::Tensor,
        sin: &Self::Tensor,
        head_dim: usize,
        inverse: bool,
    ) -> Result<()>;
    /// Causal grouped-query attention of `q [n, heads·d]` over `k`, `v [n, groups·d]` within
    /// each of `segments` (row ranges covering `0..n`; no row sees another segment). Returns
    /// `o [n, heads·d]` and the log-sum-exp of every query row's scores `[n, heads]` f32, saved
    /// for the backward (aclnnFlashAttentionScore, causal, with actual sequence lengths). With
    /// `dropout`, the probabilities are multiplied by its mask (keys of `rows`, this call's
    /// heads from `first_head`) after the softmax and before the product with `v`; the
    /// log-sum-exp is the softmax's (aclnnFlashAttentionScore's keepProb and dropMask).
    /// Overwrites.
    fn attention(
        &self,
        q: &Self::Tensor,
        k: &Self::Tensor,
        v: &Self::Tensor,
        segments: &[Range<usize>],
        shape: AttentionShape,
        dropout: Option<&Mask>,
    ) -> Result<(Self::Tensor, Self::Tensor)>;
    /// `(dq, dk, dv)` of [`Backend::attention`] with the same `dropout`, whose mask it draws
    /// again (aclnnFlashAttentionScoreGrad). Overwrites.
    #[allow(clippy::too_many_arguments)]
    fn attention_bwd(
        &self,
        d_o: &Self::Tensor,
        q: &Self::Tensor,
        k: &Self::Tensor,
        v: &Self::Tensor,
        o: &Self::Tensor,
        lse: &Self::Tensor,
        segments: &[Range<usize>],
        shape: AttentionShape,
        dropout: Option<&Mask>,
    ) -> Result<(Self::Tensor, Self::Tensor, Self::Tensor)>;
    /// [`Backend::attention`] where each query row attends only to the keys `selection`
    /// names among those it sees (DeepSeek sparse attention). Not built on every device.
    #[allow(clippy::too_many_arguments)]
    fn sparse_attention(
        &self,
        q: &Self::Tensor,
        k: &Self::Tensor,
        v: &Self::Tensor,
        segments: &[Range<usize>],
        shape: AttentionShape,
        dropout: Option<&Mask>,
        selection: &Selection,
    ) -> Result<(Self::Tensor, Self::Tensor)> {
        let _ = (q, k, v, segments, shape, dropout, selection);
        Err(sparse_attention_unbuilt("sparse_attention"))
    }
    /// `(dq, dk, dv)` of [`Backend::sparse_attention`] with the same `dropout` and
    /// `selection`. Overwrites.
    #[allow(clippy::too_many_arguments)]
    fn sparse_attention_bwd(
        &self,
        d_o: &Self::Tensor,
        (q, k, v): (&Self::Tensor, &Self::Tensor, &Self::Tensor),
        (o, lse): (&Self::Tensor, &Self::Tensor),
        segments: &[Range<usize>],
        shape: AttentionShape,
        dropout: Option<&Mask>,
        selection: &Selection,
    ) -> Result<(Self::Tensor, Self::Tensor, Self::Tensor)> {
        let _ = (d_o, q, k, v, o, lse, segments, shape, dropout, selection);
        Err(sparse_attention_unbuilt("sparse_attention_bwd"))
    }
    /// `x [n, w]` times the factors of dropout `mask` (0 or `1/(1 − p)` in f32, one row of the
    /// mask per row of `x`), rounded to `x`'s dtype: hidden dropout's forward pass and, on the
    /// gradient of its output, its backward pass (aclnnMul by the mask's factors). Overwrites.
    fn dropout(&self, x: &Self::Tensor, mask: &Mask) -> Result<Self::Tensor>;
    /// An empty KV cache of `slots × capacity` rows of `width` (f32).
    fn kv_cache(&self, slots: usize, capacity: usize, width: usize) -> Result<Self::Tensor>;
    /// Store the rows of `x` (segment after segment) at each segment's slot and positions
    /// `past..past + len` (aclnnScatterUpdate). Overwrites those cache rows.
    fn kv_store(
        &self,
        cache: &mut Self::Tensor,
        x: &Self::Tensor,
        segments: &[Segment],
    ) -> Result<()>;
    /// Causal grouped-query attention of `q [n, heads·d]` (segment after segment) over each
    /// segment's cached keys and values, positions `0..=past + i` for its row `i`
    /// (aclnnFusedInferAttentionScore with actual sequence lengths). Overwrites.
    fn cached_attention(
        &self,
        q: &Self::Tensor,
        k_cache: &Self::Tensor,
        v_cache: &Self::Tensor,
        segments: &[Segment],
        shape: AttentionShape,
    ) -> Result<Self::Tensor>;
    /// `silu(a) · b` for `x = [a | b]` split along the last dimension (aclnnSwiGlu).
    /// Overwrites.
    fn swiglu(&self, x: &Self::Tensor) -> Result<Self::Tensor>;
    /// `dx` of [`Backend::swiglu`] (aclnnSwiGluGrad). Overwrites.
    fn swiglu_bwd(&self, dy: &Self::Tensor, x: &Self::Tensor) -> Result<Self::Tensor>;
    /// `relu(x)²` elementwise, rounded once to x's dtype (megatron-core
    /// megatron/core/activations.py `squared_relu`, `torch.pow(F.relu(x), 2)`; aclnnRelu, then
    /// aclnnMul of it by itself).
    fn squared_relu(&self, x: &Self::Tensor) -> Result<Self::Tensor>;
    /// `dx = 2·relu(x)·dy` of [`Backend::squared_relu`] in dy's dtype, rounded once (autograd's
    /// `pow` backward `dy·(2·r)`, `2·r` exact; aclnnRelu, aclnnMul, aclnnMuls by 2).
    fn squared_relu_bwd(&self, dy: &Self::Tensor, x: &Self::Tensor) -> Result<Self::Tensor>;
    /// `x += y` (aclnnInplaceAdd).
    fn add_assign(&self, x: &mut Self::Tensor, y: &Self::Tensor) -> Result<()>;
    /// Log-softmax over the last dimension (aclnnLogSoftmax). Overwrites.
    fn log_softmax(&self, x: &Self::Tensor) -> Result<Self::Tensor>;
    /// Per-row cross entropy of `logits [n, v]` against `labels`: returns `loss [n]` and the
    /// rows' log-sum-exp `[n]`, both f32, computed in f32 whatever the logits' dtype; a
    /// [`NO_ROW`] label's loss is the log-sum-exp itself (no target logit in this shard)
    /// (aclnnCrossEntropyLoss, reduction none). Overwrites.
    fn cross_entropy(
        &self,
        logits: &Self::Tensor,
        labels: &[u32],
    ) -> Result<(Self::Tensor, Self::Tensor)>;
    /// The gradient of `Σ dloss · loss` with respect to the logits, which it consumes (their
    /// memory may hold the result): `dloss · (exp(logits − lse) − onehot(label))`, no onehot
    /// for a [`NO_ROW`] label; `lse` may be the whole vocabulary's when the logits are a
    /// shard of it (aclnnCrossEntropyLossGrad). Overwrites.
    fn cross_entropy_bwd(
        &self,
        logits: Self::Tensor,
        labels: &[u32],
        lse: &Self::Tensor,
        dloss: &Self::Tensor,
    ) -> Result<Self::Tensor>;
    /// `x` in `dtype` (round to nearest even) (aclnnCast). Overwrites.
    fn cast(&self, x: &Self::Tensor, dtype: DType) -> Result<Self::Tensor>;
    /// `dst = src` converted to `dst`'s dtype (the main f32 parameter copied into a bf16 model
    /// parameter) (aclnnInplaceCopy). Overwrites `dst`.
    fn copy_into(&self, src: &Self::Tensor, dst: &mut Self::Tensor) -> Result<()>;
    /// The f32 values of `x` rounded to `dtype`'s precision (to nearest even), in place: a
    /// gradient upstream holds as a bf16 tensor (aclnnCast, then aclnnInplaceCopy back).
    fn round_to(&self, x: &mut Self::Tensor, dtype: DType) -> Result<()> {
        let rounded = self.cast(x, dtype)?;
        self.copy_into(&rounded, x)
    }
    /// `sum += x` with `x`'s f32 values rounded to `dtype`'s precision first (to nearest even):
    /// a backward pass's bf16 gradient added into its f32 main gradient (aclnnCast,
    /// aclnnInplaceAdd).
    fn add_rounded(&self, sum: &mut Self::Tensor, x: &Self::Tensor, dtype: DType) -> Result<()> {
        self.add_assign(sum, &self.cast(x, dtype)?)
    }
    /// `dst[to..to + n] = src[at..at + n]` over the two tensors' elements in row-major order,
    /// converted to `dst`'s dtype (aclnnInplaceCopy over views of the two storages): a
    /// parameter into its place in a flat buffer and back. Overwrites that range of `dst` only.
    fn copy_range(
        &self,
        src: (&Self::Tensor, usize),
        dst: (&mut Self::Tensor, usize),
        n: usize,
    ) -> Result<()>;
    /// `dst[to..to + rows·cols]` = the transpose `[cols, rows]` of the matrix of `shape`
    /// `(rows, cols)` whose row-major elements are `src[at..at + rows·cols]`, converted to `dst`'s dtype
    /// (aclnnInplaceCopy from a strided view of `src`): an expert's weight into its place in
    /// MindSpeed-LLM's grouped (transposed) layout of a flat buffer, and back. Overwrites that
    /// range of `dst` only.
    fn copy_transposed(
        &self,
        src: (&Self::Tensor, usize),
        shape: (usize, usize),
        dst: (&mut Self::Tensor, usize),
    ) -> Result<()>;
    /// A new tensor of `shape` and `x`'s dtype holding the elements of `view` of `x` in order
    /// (aclnnInplaceCopy from a strided view): a part of every head, heads rearranged. The
    /// view may repeat elements (a zero stride). Overwrites.
    fn gather(&self, x: &Self::Tensor, view: StridedView, shape: &[usize]) -> Result<Self::Tensor>;
    /// `view` of `x` = the elements of `y` in order, of one dtype (aclnnInplaceCopy into a
    /// strided view): the backward of [`Backend::gather`] into a zeroed tensor where the view
    /// repeats no element. Overwrites that view of `x` only.
    fn scatter(&self, y: &Self::Tensor, x: &mut Self::Tensor, view: StridedView) -> Result<()>;
    /// `s · x` as a new tensor of `x`'s dtype (aclnnMuls). Overwrites.
    fn scaled(&self, x: &Self::Tensor, s: f32) -> Result<Self::Tensor>;
    /// `x ·= s` (aclnnInplaceMuls).
    fn scale(&self, x: &mut Self::Tensor, s: f32) -> Result<()>;
    /// `Σ x²` of each tensor, summed in f64 on the host (aclnnForeachNorm, read back: one host
    /// synchronisation).
    fn sum_squares(&self, xs: &[&Self::Tensor]) -> Result<f64>;
    /// One AdamW step of `param` (f32) with `grad` scaled by `step.grad_scale`
    /// (aclnnInplaceMuls), moments `m`, `v` updated in place (aclnnApplyAdamWV2), then `param`
    /// copied into `model` where given, as [`Backend::copy_into`] does (the bf16 weights of
    /// mixed precision), and `grad` zeroed, ready for the next step's accumulation
    /// (aclrtMemsetAsync). Overwrites all of them; one pass over memory where the backend can.
    fn adamw(
        &self,
        param: &mut Self::Tensor,
        grad: &mut Self::Tensor,
        moments: (&mut Self::Tensor, &mut Self::Tensor),
        step: AdamWStep,
        model: Option<&mut Self::Tensor>,
    ) -> Result<()>;
}
