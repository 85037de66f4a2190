//! The operators of `libopapi.so`, each a phase 1 (`aclnnXxxGetWorkspaceSize`: the contract
//! checked, the views captured in a kernel) and a launch (`aclnnXxx`, all alike, see
//! [`launches!`]). Elementwise operators need no workspace; the heavy ones ask for [`HEAVY`]
//! bytes so that the caller's workspace handling runs.

mod attention;
mod elementwise;
mod grouped;
mod layer_norm;
mod loss;
mod moe;
mod nn;

use crate::aclnn::{launch, Kernel, Plan};
use crate::view::View;
use ascendcl_sys::aclnn::{aclOpExecutor, aclnnStatus};
use ascendcl_sys::aclrtStream;
use std::ffi::c_void;

/// Phase 1's out-parameters: the workspace size and the executor.
type Ws = *mut u64;
type Ex = *mut *mut aclOpExecutor;

/// The workspace the heavy operators ask for (a real kernel's tiling buffers).
const HEAVY: u64 = 64 << 10;

/// A kernel that computes `f` of each value of `x` into `out` (`x` broadcast to `out`).
fn unary(x: View, out: View, f: impl Fn(f32) -> f32 + Send + 'static) -> Kernel {
    Box::new(move || {
        let values: Vec<f32> = x.read().into_iter().map(&f).collect();
        out.write(&values);
        Ok(())
    })
}

/// The rows of a `[rows, width]` buffer as `f` maps each input row (with its index) to an
/// output row of `out_width`.
fn by_rows(
    x: &[f32],
    width: usize,
    out_width: usize,
    mut f: impl FnMut(usize, &[f32], &mut [f32]),
) -> Vec<f32> {
    let rows = x.len().checked_div(width).unwrap_or(0);
    let mut out = vec![0.0; rows * out_width];
    let pairs = x
        .chunks_exact(width.max(1))
        .zip(out.chunks_exact_mut(out_width.max(1)));
    for (i, (row, o)) in pairs.enumerate() {
        f(i, row, o);
    }
    out
}

/// `dim` names the last dimension of a tensor of `rank` (the only one the stand-in supports).
fn last_dim(p: &Plan, dim: i64, rank: usize, name: &str) -> Result<(), aclnnStatus> {
    let rank = rank as i64;
    crate::aclnn::ensure!(
        p,
        rank > 0 && (dim == -1 || dim == rank - 1),
        "{name} {dim} is not the last dimension of a {rank}-D tensor (the only one the stand-in supports)"
    );
    Ok(())
}

/// Index `id` (element `i` of its tensor) as a row of `rows`, a launch error outside them.
fn checked_index(id: i64, i: usize, rows: usize) -> Result<usize, String> {
    usize::try_from(id)
        .ok()
        .filter(|&r| r < rows)
        .ok_or_else(|| format!("index {id} (element {i}) is outside [0, {rows})"))
}

/// Defines the launch of each operator: every one takes `(workspace, size, executor, stream)`.
macro_rules! launches {
    ($($name:ident),* $(,)?) => {$(
        #[no_mangle]
        pub extern "C" fn $name(
            workspace: *mut c_void,
            workspace_size: u64,
            executor: *mut aclOpExecutor,
            stream: aclrtStream,
        ) -> aclnnStatus {
            launch(stringify!($name), workspace, workspace_size, executor, stream)
        }
    )*};
}

launches!(
    aclnnMatmul,
    aclnnRmsNorm,
    aclnnRmsNormGrad,
    aclnnLayerNorm,
    aclnnLayerNormBackward,
    aclnnSwiGlu,
    aclnnSwiGluGrad,
    aclnnEmbedding,
    aclnnEmbeddingDenseBackward,
    aclnnCast,
    aclnnAdd,
    aclnnApplyAdamWV2,
    aclnnIndexSelect,
    aclnnInplaceAdd,
    aclnnReduceSum,
    aclnnInplaceCopy,
    aclnnRotaryPositionEmbedding,
    aclnnRotaryPositionEmbeddingGrad,
    aclnnFlashAttentionVarLenScore,
    aclnnFlashAttentionUnpaddingScoreGrad,
    aclnnLogSoftmax,
    aclnnCrossEntropyLoss,
    aclnnCrossEntropyLossGrad,
    aclnnSub,
    aclnnMul,
    aclnnRelu,
    aclnnMuls,
    aclnnInplaceMuls,
    aclnnForeachNorm,
    aclnnBatchMatMul,
    aclnnSoftmax,
    aclnnSoftmaxBackward,
    aclnnInplaceMaskedFillScalar,
    aclnnGroupedMatmulV4,
    aclnnMoeTokenPermute,
    aclnnMoeTokenPermuteGrad,
    aclnnMoeGatingTopKSoftmax,
    aclnnMoeTokenUnpermute,
    aclnnMoeTokenUnpermuteGrad,
    aclnnMoeInitRoutingV2,
);

/// Every function ascendcl-sys declares for libnnopbase and libopapi is exported here with its
/// declared type: building these tables fails to compile otherwise.
#[allow(dead_code)]
fn exports_have_the_declared_types() {
    use crate::aclnn::*;
    use attention::*;
    use elementwise::*;
    use grouped::*;
    use layer_norm::*;
    use loss::*;
    use moe::*;
    use nn::*;
    let _ = ascendcl_sys::aclnn::nnopbase::Functions {
        aclCreateTensor,
        aclCreateScalar,
        aclCreateIntArray,
        aclCreateTensorList,
        aclDestroyTensor,
        aclDestroyScalar,
        aclDestroyIntArray,
        aclDestroyTensorList,
        aclSetAclOpExecutorRepeatable,
        aclDestroyAclOpExecutor,
        aclnnInit,
        aclnnFinalize,
        aclCreateBoolArray: Some(aclCreateBoolArray),
        aclDestroyBoolArray: Some(aclDestroyBoolArray),
    };
    let _ = ascendcl_sys::aclnn::opapi::Functions {
        aclnnMatmulGetWorkspaceSize,
        aclnnMatmul,
        aclnnRmsNormGetWorkspaceSize,
        aclnnRmsNorm,
        aclnnRmsNormGradGetWorkspaceSize,
        aclnnRmsNormGrad,
        aclnnSwiGluGetWorkspaceSize,
        aclnnSwiGlu,
        aclnnSwiGluGradGetWorkspaceSize,
        aclnnSwiGluGrad,
        aclnnEmbeddingGetWorkspaceSize,
        aclnnEmbedding,
        aclnnEmbeddingDenseBackwardGetWorkspaceSize,
        aclnnEmbeddingDenseBackward,
        aclnnCastGetWorkspaceSize,
        aclnnCast,
        aclnnAddGetWorkspaceSize,
        aclnnAdd,
        aclnnApplyAdamWV2GetWorkspaceSize,
        aclnnApplyAdamWV2,
        aclnnIndexSelectGetWorkspaceSize,
        aclnnIndexSelect,
        aclnnInplaceAddGetWorkspaceSize,
        aclnnInplaceAdd,
        aclnnReduceSumGetWorkspaceSize,
        aclnnReduceSum,
        aclnnInplaceCopyGetWorkspaceSize,
        aclnnInplaceCopy,
        aclnnRotaryPositionEmbeddingGetWorkspaceSize: Some(
            aclnnRotaryPositionEmbeddingGetWorkspaceSize,
        ),
        aclnnRotaryPositionEmbedding: Some(aclnnRotaryPositionEmbedding),
        aclnnRotaryPositionEmbeddingGradGetWorkspaceSize: Some(
            aclnnRotaryPositionEmbeddingGradGetWorkspaceSize,
        ),
        aclnnRotaryPositionEmbeddingGrad: Some(aclnnRotaryPositionEmbeddingGrad),
        aclnnFlashAttentionVarLenScoreGetWorkspaceSize: Some(
            aclnnFlashAttentionVarLenScoreGetWorkspaceSize,
        ),
        aclnnFlashAttentionVarLenScore: Some(aclnnFlashAttentionVarLenScore),
        aclnnFlashAttentionUnpaddingScoreGradGetWorkspaceSize: Some(
            aclnnFlashAttentionUnpaddingScoreGradGetWorkspaceSize,
        ),
        aclnnFlashAttentionUnpaddingScoreGrad: Some(aclnnFlashAttentionUnpaddingScoreGrad),
        aclnnGroupedMatmulV4GetWorkspaceSize: Some(aclnnGroupedMatmulV4GetWorkspaceSize),
        aclnnGroupedMatmulV4: Some(aclnnGroupedMatmulV4),
        aclnnMoeTokenPermuteGetWorkspaceSize: Some(aclnnMoeTokenPermuteGetWorkspaceSize),
        aclnnMoeTokenPermute: Some(aclnnMoeTokenPermute),
        aclnnMoeTokenPermuteGradGetWorkspaceSize: Some(aclnnMoeTokenPermuteGradGetWorkspaceSize),
        aclnnMoeTokenPermuteGrad: Some(aclnnMoeTokenPermuteGrad),
        aclnnMoeGatingTopKSoftmaxGetWorkspaceSize: Some(aclnnMoeGatingTopKSoftmaxGetWorkspaceSize),
        aclnnMoeGatingTopKSoftmax: Some(aclnnMoeGatingTopKSoftmax),
        aclnnMoeTokenUnpermuteGetWorkspaceSize: Some(aclnnMoeTokenUnpermuteGetWorkspaceSize),
        aclnnMoeTokenUnpermute: Some(aclnnMoeTokenUnpermute),
        aclnnMoeTokenUnpermuteGradGetWorkspaceSize: Some(
            aclnnMoeTokenUnpermuteGradGetWorkspaceSize,
        ),
        aclnnMoeTokenUnpermuteGrad: Some(aclnnMoeTokenUnpermuteGrad),
        aclnnMoeInitRoutingV2GetWorkspaceSize: Some(aclnnMoeInitRoutingV2GetWorkspaceSize),
        aclnnMoeInitRoutingV2: Some(aclnnMoeInitRoutingV2),
        aclnnLayerNormGetWorkspaceSize: Some(aclnnLayerNormGetWorkspaceSize),
        aclnnLayerNorm: Some(aclnnLayerNorm),
        aclnnLayerNormBackwardGetWorkspaceSize: Some(aclnnLayerNormBackwardGetWorkspaceSize),
        aclnnLayerNormBackward: Some(aclnnLayerNormBackward),
        aclnnLogSoftmaxGetWorkspaceSize,
        aclnnLogSoftmax,
        aclnnCrossEntropyLossGetWorkspaceSize,
        aclnnCrossEntropyLoss,
        aclnnCrossEntropyLossGradGetWorkspaceSize,
        aclnnCrossEntropyLossGrad,
        aclnnSubGetWorkspaceSize,
        aclnnSub,
        aclnnMulGetWorkspaceSize,
        aclnnMul,
        aclnnReluGetWorkspaceSize,
        aclnnRelu,
        aclnnMulsGetWorkspaceSize,
        aclnnMuls,
        aclnnInplaceMulsGetWorkspaceSize,
        aclnnInplaceMuls,
        aclnnForeachNormGetWorkspaceSize,
        aclnnForeachNorm,
        aclnnBatchMatMulGetWorkspaceSize,
        aclnnBatchMatMul,
        aclnnSoftmaxGetWorkspaceSize,
        aclnnSoftmax,
        aclnnSoftmaxBackwardGetWorkspaceSize,
        aclnnSoftmaxBackward,
        aclnnInplaceMaskedFillScalarGetWorkspaceSize,
        aclnnInplaceMaskedFillScalar,
    };
}
