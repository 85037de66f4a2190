//! The aclnn operator API: its object model (`libnnopbase.so`: tensor, scalar and array
//! descriptors, executors) and the operators the NPU backend calls (`libopapi.so`), each as its
//! two phases — `…GetWorkspaceSize` (validates, sizes the workspace, builds an executor) and the
//! launch (`(workspace, size, executor, stream)`, which consumes the executor). CANN's aclnn
//! headers are not in any package the tests can fetch; `reference/aclnn-8.1.RC1.h` holds the
//! 8.1.RC1 declarations these follow, and mindkit's `tests/npu_headers.rs` checks them against it.

use crate::{aclrtStream, cann_functions, open, LoadError, Loaded};
use std::ffi::{c_char, c_int, c_void};

/// `aclnnStatus` (`int32_t`): 0 is success.
pub type aclnnStatus = i32;
/// `enum aclDataType`.
pub type aclDataType = c_int;
/// `enum aclFormat`.
pub type aclFormat = c_int;

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
    }

    /// Load `libopapi.so` (see [`crate::candidates`]).
    pub fn load() -> Result<Loaded<Functions>, LoadError> {
        // SAFETY: the declarations follow CANN 8.1.RC1's aclnnop headers (checked by the header
        // test against reference/aclnn-8.1.RC1.h).
        unsafe { open("libopapi.so", Functions::resolve) }
    }
}
