//! The aclnn operator API: its object model (`libnnopbase.so`: tensor, scalar and array
//! descriptors, executors) and the operators the NPU backend calls (`libopapi.so`), each as its
//! two phases — `…GetWorkspaceSize` (validates, sizes the workspace, builds an executor) and the
//! launch (`(workspace, size, executor, stream)`, which consumes the executor). CANN's aclnn
//! headers are not in any package the tests can fetch; `reference/aclnn-8.1.RC1.h` holds the
//! 8.1.RC1 declarations these follow, and mindkit's `tests/npu_headers.rs` checks them against it.

use crate::{aclrtStream, cann_functions, open, LoadError, Loaded};
use std::ffi::{c_char, c_void};

/// `aclnnStatus` (`int32_t`): 0 is success.
pub type aclnnStatus = i32;
pub use crate::{aclDataType, aclFormat};

/// Declares opaque C structs, only ever handled behind pointers.
macro_rules! opaque {
    ($($(#[$doc:meta])* $name:ident;)*) => {
        $($(#[$doc])* #[repr(C)] pub struct $name { _private: [u8; 0] })*
    };
}

opaque! {
    /// A tensor descriptor: shape, strides and offset in elements, dtype, format, device address.
    aclTensor;
    /// A host scalar, copied at creation.
    aclScalar;
    /// An int64 array.
    aclIntArray;
    /// A bool array.
    aclBoolArray;
    /// A list of tensor descriptors.
    aclTensorList;
    /// What phase 1 of an operator prepares and its launch consumes.
    aclOpExecutor;
}

/// The aclnn object model, `libnnopbase.so`.
pub mod nnopbase {
    use super::*;

    cann_functions! {
        /// A tensor descriptor over device memory `tensor_data` (strides and offset in elements).
        fn aclCreateTensor(view_dims: *const i64, view_dims_num: u64, data_type: aclDataType, stride: *const i64, offset: i64, format: aclFormat, storage_dims: *const i64, storage_dims_num: u64, tensor_data: *mut c_void) -> *mut aclTensor;
        /// A scalar, its value copied from host memory.
        fn aclCreateScalar(value: *mut c_void, data_type: aclDataType) -> *mut aclScalar;
        /// An int64 array, copied.
        fn aclCreateIntArray(value: *const i64, size: u64) -> *mut aclIntArray;
        /// A list of tensor descriptors (the list owns them).
        fn aclCreateTensorList(value: *const *const aclTensor, size: u64) -> *mut aclTensorList;
        /// Destroy a tensor descriptor (not its memory).
        fn aclDestroyTensor(tensor: *const aclTensor) -> aclnnStatus;
        /// Destroy a scalar.
        fn aclDestroyScalar(scalar: *const aclScalar) -> aclnnStatus;
        /// Destroy an int64 array.
        fn aclDestroyIntArray(array: *const aclIntArray) -> aclnnStatus;
        /// Destroy a list and the descriptors in it.
        fn aclDestroyTensorList(array: *const aclTensorList) -> aclnnStatus;
        /// Keep an executor for repeated launches (then destroyed explicitly).
        fn aclSetAclOpExecutorRepeatable(executor: *mut aclOpExecutor) -> aclnnStatus;
        /// Destroy a repeatable executor.
        fn aclDestroyAclOpExecutor(executor: *mut aclOpExecutor) -> aclnnStatus;
        /// Initialise aclnn (`config_path` may be null).
        fn aclnnInit(config_path: *const c_char) -> aclnnStatus;
        /// Release aclnn.
        fn aclnnFinalize() -> aclnnStatus;

        optional:
        /// A bool array, copied (LayerNorm's backward takes its output mask so). Optional:
        /// without it LayerNorm's backward runs on the host.
        fn aclCreateBoolArray(value: *const bool, size: u64) -> *mut aclBoolArray;
        /// Destroy a bool array.
        fn aclDestroyBoolArray(array: *const aclBoolArray) -> aclnnStatus;
    }

    /// Load `libnnopbase.so` (see [`crate::candidates`]).
    pub fn load() -> Result<Loaded<Functions>, LoadError> {
        // SAFETY: the declarations follow CANN 8.1.RC1's acl_meta.h / aclnn_base.h (checked by
        // the header test against reference/aclnn-8.1.RC1.h).
        unsafe { open("libnnopbase.so", Functions::resolve) }
    }
}

/// The operators, `libopapi.so`.
pub mod opapi {
    use super::*;

    cann_functions! {
        /// out = self @ mat2 (1–6-D, broadcast); `cube_math_type` 0 keeps the dtype.
        fn aclnnMatmulGetWorkspaceSize(self_: *const aclTensor, mat2: *const aclTensor, out: *mut aclTensor, cube_math_type: i8, workspace_size: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
        /// Launch of [`Functions::aclnnMatmulGetWorkspaceSize`].
        fn aclnnMatmul(workspace: *mut c_void, workspace_size: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
        /// y = x · rstd · gamma, rstd (fp32) saved for the backward.
        fn aclnnRmsNormGetWorkspaceSize(x: *const aclTensor, gamma: *const aclTensor, epsilon: f64, y_out: *const aclTensor, rstd_out: *const aclTensor, workspace_size: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
        /// Launch of [`Functions::aclnnRmsNormGetWorkspaceSize`].
        fn aclnnRmsNorm(workspace: *mut c_void, workspace_size: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
        /// dx and dgamma (fp32) of RMSNorm from dy, x and the saved rstd.
        fn aclnnRmsNormGradGetWorkspaceSize(dy: *const aclTensor, x: *const aclTensor, rstd: *const aclTensor, gamma: *const aclTensor, dx_out: *const aclTensor, dgamma_out: *const aclTensor, workspace_size: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
        /// Launch of [`Functions::aclnnRmsNormGradGetWorkspaceSize`].
        fn aclnnRmsNormGrad(workspace: *mut c_void, workspace_size: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
        /// out = silu(A) · B, x = [A | B] along `dim`.
        fn aclnnSwiGluGetWorkspaceSize(x: *const aclTensor, dim: i64, out: *const aclTensor, workspace_size: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
        /// Launch of [`Functions::aclnnSwiGluGetWorkspaceSize`].
        fn aclnnSwiGlu(workspace: *mut c_void, workspace_size: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
        /// [dA | dB] of SwiGLU.
        fn aclnnSwiGluGradGetWorkspaceSize(y_grad: *const aclTensor, x: *const aclTensor, dim: i64, out: *const aclTensor, workspace_size: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
        /// Launch of [`Functions::aclnnSwiGluGradGetWorkspaceSize`].
        fn aclnnSwiGluGrad(workspace: *mut c_void, workspace_size: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
        /// Rows of `weight` at `indices`.
        fn aclnnEmbeddingGetWorkspaceSize(weight: *const aclTensor, indices: *const aclTensor, out: *const aclTensor, workspace_size: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
        /// Launch of [`Functions::aclnnEmbeddingGetWorkspaceSize`].
        fn aclnnEmbedding(workspace: *mut c_void, workspace_size: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
        /// The embedding's gradient `[num_weights, H]` (`padding_idx` u64::MAX: none).
        fn aclnnEmbeddingDenseBackwardGetWorkspaceSize(grad: *const aclTensor, indices: *const aclTensor, num_weights: u64, padding_idx: u64, scale_grad_by_freq: bool, out: *const aclTensor, workspace_size: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
        /// Launch of [`Functions::aclnnEmbeddingDenseBackwardGetWorkspaceSize`].
        fn aclnnEmbeddingDenseBackward(workspace: *mut c_void, workspace_size: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
        /// out = self as `dtype`.
        fn aclnnCastGetWorkspaceSize(self_: *const aclTensor, dtype: aclDataType, out: *mut aclTensor, workspace_size: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
        /// Launch of [`Functions::aclnnCastGetWorkspaceSize`].
        fn aclnnCast(workspace: *mut c_void, workspace_size: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
        /// out = self + alpha · other.
        fn aclnnAddGetWorkspaceSize(self_: *const aclTensor, other: *const aclTensor, alpha: *const aclScalar, out: *mut aclTensor, workspace_size: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
        /// Launch of [`Functions::aclnnAddGetWorkspaceSize`].
        fn aclnnAdd(workspace: *mut c_void, workspace_size: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
        /// AdamW in place on var, m, v (decoupled weight decay, bias correction by `step`).
        fn aclnnApplyAdamWV2GetWorkspaceSize(var_ref: *mut aclTensor, m_ref: *mut aclTensor, v_ref: *mut aclTensor, max_grad_norm_optional_ref: *mut aclTensor, grad: *const aclTensor, step: *const aclTensor, lr: f32, beta1: f32, beta2: f32, weight_decay: f32, eps: f32, amsgrad: bool, maximize: bool, workspace_size: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
        /// Launch of [`Functions::aclnnApplyAdamWV2GetWorkspaceSize`].
        fn aclnnApplyAdamWV2(workspace: *mut c_void, workspace_size: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
        /// out = self.index_select(dim, index) (index INT64 or INT32).
        fn aclnnIndexSelectGetWorkspaceSize(self_: *const aclTensor, dim: i64, index: *const aclTensor, out: *mut aclTensor, workspace_size: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
        /// Launch of [`Functions::aclnnIndexSelectGetWorkspaceSize`].
        fn aclnnIndexSelect(workspace: *mut c_void, workspace_size: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
        /// self += alpha · other (other broadcast to self).
        fn aclnnInplaceAddGetWorkspaceSize(self_ref: *const aclTensor, other: *const aclTensor, alpha: *const aclScalar, workspace_size: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
        /// Launch of [`Functions::aclnnInplaceAddGetWorkspaceSize`].
        fn aclnnInplaceAdd(workspace: *mut c_void, workspace_size: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
        /// out = Σ self over `dims`, as `dtype`.
        fn aclnnReduceSumGetWorkspaceSize(self_: *const aclTensor, dims: *const aclIntArray, keep_dims: bool, dtype: aclDataType, out: *mut aclTensor, workspace_size: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
        /// Launch of [`Functions::aclnnReduceSumGetWorkspaceSize`].
        fn aclnnReduceSum(workspace: *mut c_void, workspace_size: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
        /// self = src (strided views, dtype conversion).
        fn aclnnInplaceCopyGetWorkspaceSize(self_ref: *mut aclTensor, src: *const aclTensor, workspace_size: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
        /// Launch of [`Functions::aclnnInplaceCopyGetWorkspaceSize`].
        fn aclnnInplaceCopy(workspace: *mut c_void, workspace_size: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
        /// out = self · other (broadcast).
        fn aclnnMulGetWorkspaceSize(self_: *const aclTensor, other: *const aclTensor, out: *mut aclTensor, workspace_size: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
        /// Launch of [`Functions::aclnnMulGetWorkspaceSize`].
        fn aclnnMul(workspace: *mut c_void, workspace_size: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
        /// `out = max(self, 0)` elementwise.
        fn aclnnReluGetWorkspaceSize(self_: *const aclTensor, out: *const aclTensor, workspace_size: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
        /// Launch of [`Functions::aclnnReluGetWorkspaceSize`].
        fn aclnnRelu(workspace: *mut c_void, workspace_size: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
        /// out = log_softmax(self) along `dim`.
        fn aclnnLogSoftmaxGetWorkspaceSize(self_: *const aclTensor, dim: i64, out: *mut aclTensor, workspace_size: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
        /// Launch of [`Functions::aclnnLogSoftmaxGetWorkspaceSize`].
        fn aclnnLogSoftmax(workspace: *mut c_void, workspace_size: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
        /// Cross entropy of `(N, C)` logits against `(N)` targets; log-probabilities saved.
        fn aclnnCrossEntropyLossGetWorkspaceSize(input: *const aclTensor, target: *const aclTensor, weight_optional: *const aclTensor, reduction_optional: *mut c_char, ignore_index: i64, label_smoothing: f64, lse_square_scale_for_zloss: f64, return_zloss: bool, loss_out: *const aclTensor, log_prob_out: *const aclTensor, zloss_out: *const aclTensor, lse_for_zloss_out: *const aclTensor, workspace_size: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
        /// Launch of [`Functions::aclnnCrossEntropyLossGetWorkspaceSize`].
        fn aclnnCrossEntropyLoss(workspace: *mut c_void, workspace_size: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
        /// The logits' gradient from the saved log-probabilities.
        fn aclnnCrossEntropyLossGradGetWorkspaceSize(grad_loss: *const aclTensor, log_prob: *const aclTensor, target: *const aclTensor, weight_optional: *const aclTensor, grad_zloss_optional: *const aclTensor, lse_for_zloss_optional: *const aclTensor, reduction_optional: *mut c_char, ignore_index: i64, label_smoothing: f64, lse_square_scale_for_zloss: f64, out: *const aclTensor, workspace_size: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
        /// Launch of [`Functions::aclnnCrossEntropyLossGradGetWorkspaceSize`].
        fn aclnnCrossEntropyLossGrad(workspace: *mut c_void, workspace_size: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
        /// out = self − alpha · other (broadcast).
        fn aclnnSubGetWorkspaceSize(self_: *const aclTensor, other: *const aclTensor, alpha: *const aclScalar, out: *mut aclTensor, workspace_size: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
        /// Launch of [`Functions::aclnnSubGetWorkspaceSize`].
        fn aclnnSub(workspace: *mut c_void, workspace_size: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
        /// out = self · other (a scalar).
        fn aclnnMulsGetWorkspaceSize(self_: *const aclTensor, other: *const aclScalar, out: *mut aclTensor, workspace_size: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
        /// Launch of [`Functions::aclnnMulsGetWorkspaceSize`].
        fn aclnnMuls(workspace: *mut c_void, workspace_size: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
        /// self ·= other (a scalar).
        fn aclnnInplaceMulsGetWorkspaceSize(self_ref: *mut aclTensor, other: *const aclScalar, workspace_size: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
        /// Launch of [`Functions::aclnnInplaceMulsGetWorkspaceSize`].
        fn aclnnInplaceMuls(workspace: *mut c_void, workspace_size: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
        /// The p-norm of each tensor of a list, each into a one-element tensor of its dtype.
        fn aclnnForeachNormGetWorkspaceSize(x: *const aclTensorList, scalar: *const aclScalar, out: *const aclTensorList, workspace_size: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
        /// Launch of [`Functions::aclnnForeachNormGetWorkspaceSize`].
        fn aclnnForeachNorm(workspace: *mut c_void, workspace_size: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;

        /// out[b] = self[b] @ mat2[b] (3-D, equal batches); `cube_math_type` 0 keeps the dtype.
        fn aclnnBatchMatMulGetWorkspaceSize(self_: *const aclTensor, mat2: *const aclTensor, out: *mut aclTensor, cube_math_type: i8, workspace_size: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
        /// Launch of [`Functions::aclnnBatchMatMulGetWorkspaceSize`].
        fn aclnnBatchMatMul(workspace: *mut c_void, workspace_size: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
        /// out = softmax(self) along `dim`.
        fn aclnnSoftmaxGetWorkspaceSize(self_: *const aclTensor, dim: i64, out: *mut aclTensor, workspace_size: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
        /// Launch of [`Functions::aclnnSoftmaxGetWorkspaceSize`].
        fn aclnnSoftmax(workspace: *mut c_void, workspace_size: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
        /// The gradient of softmax's input from its output's gradient and its output.
        fn aclnnSoftmaxBackwardGetWorkspaceSize(grad_output: *const aclTensor, output: *const aclTensor, dim: i64, out: *mut aclTensor, workspace_size: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
        /// Launch of [`Functions::aclnnSoftmaxBackwardGetWorkspaceSize`].
        fn aclnnSoftmaxBackward(workspace: *mut c_void, workspace_size: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
        /// self = value where `mask` (BOOL, broadcast to self) is true.
        fn aclnnInplaceMaskedFillScalarGetWorkspaceSize(self_ref: *mut aclTensor, mask: *const aclTensor, value: *const aclScalar, workspace_size: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
        /// Launch of [`Functions::aclnnInplaceMaskedFillScalarGetWorkspaceSize`].
        fn aclnnInplaceMaskedFillScalar(workspace: *mut c_void, workspace_size: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;

        optional:
        /// out = x·cos + rotate(x)·sin (`mode` 0: rotate_half); x 4-D, cos/sin broadcast to it.
        /// Its header is not in 8.1.RC1's (ops-transformer's op_api header), and its symbol is
        /// not certain to be in every libopapi.so: without it RoPE runs as Mul and Add.
        fn aclnnRotaryPositionEmbeddingGetWorkspaceSize(x: *const aclTensor, cos: *const aclTensor, sin: *const aclTensor, mode: i64, out: *mut aclTensor, workspace_size: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
        /// Launch of [`Functions::aclnnRotaryPositionEmbeddingGetWorkspaceSize`].
        fn aclnnRotaryPositionEmbedding(workspace: *mut c_void, workspace_size: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
        /// dx of [`Functions::aclnnRotaryPositionEmbeddingGetWorkspaceSize`] (the transposed
        /// rotation of dy); with `x_optional` the tables' gradients too. Optional like it:
        /// without it the backward is the forward operator with −sin.
        fn aclnnRotaryPositionEmbeddingGradGetWorkspaceSize(dy: *const aclTensor, cos: *const aclTensor, sin: *const aclTensor, x_optional: *const aclTensor, mode: i64, dx_out: *const aclTensor, dcos_out: *const aclTensor, dsin_out: *const aclTensor, workspace_size: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
        /// Launch of [`Functions::aclnnRotaryPositionEmbeddingGradGetWorkspaceSize`].
        fn aclnnRotaryPositionEmbeddingGrad(workspace: *mut c_void, workspace_size: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
        /// Flash attention over packed sequences (layout "TND", cumulative lengths); softmax max
        /// and sum `[T, N, 8]` (fp32) saved for the backward.
        /// Optional: without the symbol, or a kernel for the SoC, attention runs as
        /// BatchMatMul + Softmax.
        fn aclnnFlashAttentionVarLenScoreGetWorkspaceSize(query: *const aclTensor, key: *const aclTensor, value: *const aclTensor, real_shift_optional: *const aclTensor, drop_mask_optional: *const aclTensor, padding_mask_optional: *const aclTensor, atten_mask_optional: *const aclTensor, prefix_optional: *const aclIntArray, actual_seq_q_len_optional: *const aclIntArray, actual_seq_kv_len_optional: *const aclIntArray, scale_value: f64, keep_prob: f64, pre_tokens: i64, next_tokens: i64, head_num: i64, input_layout: *mut c_char, inner_precise: i64, sparse_mode: i64, softmax_max_out: *const aclTensor, softmax_sum_out: *const aclTensor, softmax_out_out: *const aclTensor, attention_out_out: *const aclTensor, workspace_size: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
        /// Launch of [`Functions::aclnnFlashAttentionVarLenScoreGetWorkspaceSize`].
        fn aclnnFlashAttentionVarLenScore(workspace: *mut c_void, workspace_size: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
        /// dq, dk, dv of [`Functions::aclnnFlashAttentionVarLenScoreGetWorkspaceSize`].
        fn aclnnFlashAttentionUnpaddingScoreGradGetWorkspaceSize(query: *const aclTensor, key_in: *const aclTensor, value: *const aclTensor, dy: *const aclTensor, pse_shift_optional: *const aclTensor, drop_mask_optional: *const aclTensor, padding_mask_optional: *const aclTensor, atten_mask_optional: *const aclTensor, softmax_max_optional: *const aclTensor, softmax_sum_optional: *const aclTensor, softmax_in_optional: *const aclTensor, attention_in_optional: *const aclTensor, prefix_optional: *const aclIntArray, actual_seq_q_len_optional: *const aclIntArray, actual_seq_kv_len_optional: *const aclIntArray, scale_value: f64, keep_prob: f64, pre_tokens: i64, next_tokens: i64, head_num: i64, input_layout: *mut c_char, inner_precise: i64, sparse_mode: i64, dq_out: *const aclTensor, dk_out: *const aclTensor, dv_out: *const aclTensor, dpse_out: *const aclTensor, workspace_size: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
        /// Launch of [`Functions::aclnnFlashAttentionUnpaddingScoreGradGetWorkspaceSize`].
        fn aclnnFlashAttentionUnpaddingScoreGrad(workspace: *mut c_void, workspace_size: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
        /// Matrix products of groups (an MoE layer's experts): `x` split along M (`group_type` 0)
        /// or K (2) by `group_list` (`group_list_type` 1: each group's size), each group times
        /// its weight (a list, or one 3-D tensor); `split_item` 2/3: one output tensor. The
        /// quantisation and activation arguments may be null. Optional: without it (or a
        /// kernel for the SoC), one aclnnMatmul per group.
        fn aclnnGroupedMatmulV4GetWorkspaceSize(x: *const aclTensorList, weight: *const aclTensorList, bias_optional: *const aclTensorList, scale_optional: *const aclTensorList, offset_optional: *const aclTensorList, antiquant_scale_optional: *const aclTensorList, antiquant_offset_optional: *const aclTensorList, per_token_scale_optional: *const aclTensorList, group_list_optional: *const aclTensor, activation_input_optional: *const aclTensorList, activation_quant_scale_optional: *const aclTensorList, activation_quant_offset_optional: *const aclTensorList, split_item: i64, group_type: i64, group_list_type: i64, act_type: i64, out: *mut aclTensorList, activation_feature_out_optional: *mut aclTensorList, dyn_quant_scale_out_optional: *mut aclTensorList, workspace_size: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
        /// Launch of [`Functions::aclnnGroupedMatmulV4GetWorkspaceSize`].
        fn aclnnGroupedMatmulV4(workspace: *mut c_void, workspace_size: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
        /// An MoE layer's tokens permuted by their experts: `indices [tokens, topk]` (int32 or
        /// int64) sorted stably, `permute_tokens_out[j]` = the token of the j-th, the first
        /// `num_out_tokens` kept (0: all); `sorted_indices_out [tokens·topk]` (int32) each
        /// choice's place. `padded_mode` must be false. Optional: without it (or a kernel for
        /// the SoC), aclnnIndexSelect.
        fn aclnnMoeTokenPermuteGetWorkspaceSize(tokens: *const aclTensor, indices: *const aclTensor, num_out_tokens: i64, padded_mode: bool, permute_tokens_out: *const aclTensor, sorted_indices_out: *const aclTensor, workspace_size: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
        /// Launch of [`Functions::aclnnMoeTokenPermuteGetWorkspaceSize`].
        fn aclnnMoeTokenPermute(workspace: *mut c_void, workspace_size: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
        /// The backward pass of [`Functions::aclnnMoeTokenPermuteGetWorkspaceSize`]: `out
        /// [tokens, h]`, each token's `num_topk` rows of `permuted_output_grad [tokens·topk, h]`
        /// (at `sorted_indices`) summed. Optional like it: without it, the indexed add of
        /// aclnnEmbeddingDenseBackward.
        fn aclnnMoeTokenPermuteGradGetWorkspaceSize(permuted_output_grad: *const aclTensor, sorted_indices: *const aclTensor, num_topk: i64, padded_mode: bool, out: *const aclTensor, workspace_size: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
        /// Launch of [`Functions::aclnnMoeTokenPermuteGradGetWorkspaceSize`].
        fn aclnnMoeTokenPermuteGrad(workspace: *mut c_void, workspace_size: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
        /// An MoE router's top-k over a softmax: `y_out [rows, k]` (x's dtype) the `k` largest
        /// probabilities of each row of `x [rows, experts]`, `expert_idx_out` (int32) their
        /// experts, `row_idx_out` (int32) `k·rows + row`; `finished_optional` may be null.
        /// Optional: without it (or a kernel for the SoC), the logits are read back and
        /// routed on the host.
        fn aclnnMoeGatingTopKSoftmaxGetWorkspaceSize(x: *const aclTensor, finished_optional: *const aclTensor, k: i64, y_out: *const aclTensor, expert_idx_out: *const aclTensor, row_idx_out: *const aclTensor, workspace_size: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
        /// Launch of [`Functions::aclnnMoeGatingTopKSoftmaxGetWorkspaceSize`].
        fn aclnnMoeGatingTopKSoftmax(workspace: *mut c_void, workspace_size: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
        /// Each token's `topK` rows of `permuted_tokens [tokens·topK, h]` (at `sorted_indices`,
        /// int32) times `probs_optional [tokens, topK]` summed into `out [tokens, h]`; without
        /// probs `topK` is 1 (a gather). `padded_mode` must be false and
        /// `restore_shape_optional` null. Optional: without it, aclnnMoeTokenPermuteGrad.
        fn aclnnMoeTokenUnpermuteGetWorkspaceSize(permuted_tokens: *const aclTensor, sorted_indices: *const aclTensor, probs_optional: *const aclTensor, padded_mode: bool, restore_shape_optional: *const aclIntArray, out: *const aclTensor, workspace_size: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
        /// Launch of [`Functions::aclnnMoeTokenUnpermuteGetWorkspaceSize`].
        fn aclnnMoeTokenUnpermute(workspace: *mut c_void, workspace_size: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
        /// The backward pass of [`Functions::aclnnMoeTokenUnpermuteGetWorkspaceSize`]:
        /// `permuted_tokens_grad_out[sorted_indices[i·topK + j]] = unpermuted_tokens_grad[i] ·
        /// probs[i, j]`, and `probs_grad_out [tokens, topK]` each row's products with
        /// `permute_tokens`. Optional: without it, the permutation.
        fn aclnnMoeTokenUnpermuteGradGetWorkspaceSize(permute_tokens: *const aclTensor, unpermuted_tokens_grad: *const aclTensor, sorted_indices: *const aclTensor, probs_optional: *const aclTensor, padded_mode: bool, restore_shape_optional: *const aclIntArray, permuted_tokens_grad_out: *const aclTensor, probs_grad_out: *const aclTensor, workspace_size: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
        /// Launch of [`Functions::aclnnMoeTokenUnpermuteGradGetWorkspaceSize`].
        fn aclnnMoeTokenUnpermuteGrad(workspace: *mut c_void, workspace_size: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
        /// An MoE layer's routing: `expert_idx [rows, k]` flattened and sorted,
        /// `expanded_x_out[i]` = the row of the i-th (the first `active_num` kept; 0: all),
        /// `expanded_row_idx_out [rows·k]` (int32) each choice's place, and, as
        /// `expert_tokens_count_or_cumsum_flag` asks (1 cumulative, 2 counts, 0 none), each
        /// expert's tokens. `drop_pad_mode` 1 pads each expert to `expert_capacity`. Optional:
        /// without it, aclnnIndexSelect.
        fn aclnnMoeInitRoutingV2GetWorkspaceSize(x: *const aclTensor, expert_idx: *const aclTensor, active_num: i64, expert_capacity: i64, expert_num: i64, drop_pad_mode: i64, expert_tokens_count_or_cumsum_flag: i64, expert_tokens_before_capacity_flag: bool, expanded_x_out: *const aclTensor, expanded_row_idx_out: *const aclTensor, expert_tokens_count_or_cumsum_out: *const aclTensor, expert_tokens_before_capacity_out: *const aclTensor, workspace_size: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
        /// Launch of [`Functions::aclnnMoeInitRoutingV2GetWorkspaceSize`].
        fn aclnnMoeInitRoutingV2(workspace: *mut c_void, workspace_size: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
        /// out = (input − mean)·rstd·weight + bias over the trailing `normalized_shape`, the
        /// rows' mean and rstd saved (`[rows, 1]`, fp32 here). Optional: without it (or a
        /// kernel for the SoC) LayerNorm runs on the host.
        fn aclnnLayerNormGetWorkspaceSize(input: *const aclTensor, normalized_shape: *const aclIntArray, weight_optional: *const aclTensor, bias_optional: *const aclTensor, eps: f64, out: *mut aclTensor, mean_out_optional: *mut aclTensor, rstd_out_optional: *mut aclTensor, workspace_size: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
        /// Launch of [`Functions::aclnnLayerNormGetWorkspaceSize`].
        fn aclnnLayerNorm(workspace: *mut c_void, workspace_size: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
        /// The gradients of [`Functions::aclnnLayerNormGetWorkspaceSize`]'s input, weight and
        /// bias (as `output_mask` asks) from the saved mean and rstd.
        fn aclnnLayerNormBackwardGetWorkspaceSize(grad_out: *const aclTensor, input: *const aclTensor, normalized_shape: *const aclIntArray, mean: *const aclTensor, rstd: *const aclTensor, weight_optional: *const aclTensor, bias_optional: *const aclTensor, output_mask: *const aclBoolArray, grad_input_out: *mut aclTensor, grad_weight_out: *mut aclTensor, grad_bias_out: *mut aclTensor, workspace_size: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
        /// Launch of [`Functions::aclnnLayerNormBackwardGetWorkspaceSize`].
        fn aclnnLayerNormBackward(workspace: *mut c_void, workspace_size: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
    }

    /// Load `libopapi.so` (see [`crate::candidates`]).
    pub fn load() -> Result<Loaded<Functions>, LoadError> {
        // SAFETY: the declarations follow CANN 8.1.RC1's aclnnop headers (checked by the header
        // test against reference/aclnn-8.1.RC1.h).
        unsafe { open("libopapi.so", Functions::resolve) }
    }
}
