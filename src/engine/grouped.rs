//! The grouped matmul of an MoE layer's experts ([`super::Backend::grouped_matmul`]) as one
//! [`super::Backend::matmul`] per group on the group's rows: the CPU backend's
//! implementation, and any backend's where its fused operator cannot run.

use super::{check, Backend, Result, StridedView};
use std::ops::Range;

/// Each group's rows, in order.
pub fn ranges(counts: &[usize]) -> impl Iterator<Item = Range<usize>> + '_ {
    counts.iter().scan(0, |at, &c| {
        let rows = *at..*at + c;
        *at += c;
        Some(rows)
    })
}

/// Rows `rows` of a `[n, width]` tensor, as a view.
fn rows_of(rows: &Range<usize>, width: usize) -> StridedView {
    StridedView {
        shape: [1, rows.len(), width],
        strides: [0, width, 1],
        offset: rows.start * width,
    }
}

/// [`super::Backend::grouped_matmul`], group by group.
pub fn grouped_matmul<B: Backend>(
    b: &B,
    x: &B::Tensor,
    w: &[&B::Tensor],
    counts: &[usize],
) -> Result<B::Tensor> {
    let (n, k, m) = check::grouped_matmul(b, x, w, counts)?;
    let mut y = b.zeros(&[n, m], b.dtype(x))?;
    for (rows, wg) in ranges(counts).zip(w).filter(|(r, _)| !r.is_empty()) {
        let xg = b.gather(x, rows_of(&rows, k), &[rows.len(), k])?;
        b.scatter(&b.matmul(&xg, wg, None)?, &mut y, rows_of(&rows, m))?;
    }
    Ok(y)
}

/// [`super::Backend::grouped_matmul_bwd`], group by group.
pub fn grouped_matmul_bwd<B: Backend>(
    b: &B,
    (dy, x): (&B::Tensor, &B::Tensor),
    w: &[&B::Tensor],
    counts: &[usize],
    dw: &mut [Option<&mut B::Tensor>],
) -> Result<B::Tensor> {
    let (n, k, m) = check::grouped_matmul_bwd(b, (dy, x), w, counts, dw)?;
    let mut dx = b.zeros(&[n, k], b.dtype(dy))?;
    let groups = ranges(counts).zip(w).zip(dw.iter_mut());
    for ((rows, wg), dwg) in groups.filter(|((r, _), _)| !r.is_empty()) {
        let dyg = b.gather(dy, rows_of(&rows, m), &[rows.len(), m])?;
        let xg = b.gather(x, rows_of(&rows, k), &[rows.len(), k])?;
        let dxg = b.matmul_bwd(&dyg, &xg, wg, dwg.as_deref_mut(), None)?;
        b.scatter(&dxg, &mut dx, rows_of(&rows, k))?;
    }
    Ok(dx)
}
