//! Column blocks of row-major `[n, w]` tensors: assembled from parts, and a column-parallel
//! layer's output gathered over the tensor-parallel ranks (megatron-core
//! megatron/core/tensor_parallel/mappings.py `gather_from_tensor_model_parallel_region`) with
//! the backward passes of both, each a strided copy ([`Backend::gather`], [`Backend::scatter`]).

use super::parallel::TensorParallel;
use crate::engine::{Backend, Result, StridedView};

/// Columns `at..at + w` of each of `blocks` blocks of `block` columns in rows of `row`
/// elements, `n` rows.
pub(super) fn cols(
    n: usize,
    row: usize,
    (blocks, block): (usize, usize),
    at: usize,
    w: usize,
) -> StridedView {
    StridedView::columns(n, row, (blocks, block), at, w)
}

/// Rows of `blocks` blocks of `width` columns, zeros but for `parts`: `(part [n, blocks·w],
/// w, at)` in columns `at..at + w` of every block.
pub(super) fn assemble<B: Backend>(
    b: &B,
    n: usize,
    blocks: usize,
    width: usize,
    parts: &[(&B::Tensor, usize, usize)],
) -> Result<B::Tensor> {
    let dtype = b.dtype(parts[0].0);
    let mut out = b.zeros(&[n, blocks * width], dtype)?;
    for &(part, w, at) in parts {
        b.scatter(
            part,
            &mut out,
            cols(n, blocks * width, (blocks, width), at, w),
        )?;
    }
    Ok(out)
}

/// Columns `at..at + w` of `x [n, row]`.
pub(super) fn columns<B: Backend>(b: &B, x: &B::Tensor, at: usize, w: usize) -> Result<B::Tensor> {
    let (n, row) = (b.shape(x)[0], b.shape(x)[1]);
    b.gather(x, cols(n, row, (1, row), at, w), &[n, w])
}

/// A column-parallel layer's output `[n, w / tp]` gathered whole `[n, w]` (columns in rank
/// order).
pub(super) fn columns_gathered<B: Backend>(
    b: &B,
    tp: Option<&TensorParallel<B::Tensor>>,
    x: B::Tensor,
) -> Result<B::Tensor> {
    let Some(tp) = tp else {
        return Ok(x);
    };
    let ranks = tp.group.size();
    let (n, w) = (b.shape(&x)[0], b.shape(&x)[1]);
    let mut all = b.zeros(&[n * ranks, w], b.dtype(&x))?;
    tp.group.all_gather(&x, &mut all)?;
    let view = StridedView {
        shape: [n, ranks, w],
        strides: [w, n * w, 1],
        offset: 0,
    };
    b.gather(&all, view, &[n, ranks * w])
}

/// This rank's columns of the gradient `[n, w]` of [`columns_gathered`]'s output.
pub(super) fn own_columns<B: Backend>(
    b: &B,
    tp: Option<&TensorParallel<B::Tensor>>,
    x: B::Tensor,
) -> Result<B::Tensor> {
    let Some(tp) = tp else {
        return Ok(x);
    };
    let w = b.shape(&x)[1] / tp.group.size();
    columns(b, &x, tp.group.rank() * w, w)
}

/// This rank's rows of `x` under sequence parallelism (all of them otherwise).
pub(super) fn own_rows<B: Backend>(
    b: &B,
    tp: Option<&TensorParallel<B::Tensor>>,
    x: B::Tensor,
) -> Result<B::Tensor> {
    let Some(tp) = tp.filter(|tp| tp.sequence_parallel) else {
        return Ok(x);
    };
    let (n, w) = (b.shape(&x)[0] / tp.group.size(), b.shape(&x)[1]);
    let view = StridedView {
        shape: [1, 1, n * w],
        strides: [0, 0, 1],
        offset: tp.group.rank() * n * w,
    };
    b.gather(&x, view, &[n, w])
}
