//! The grouped matmul of an MoE layer's experts on aclnnGroupedMatmulV4 (ops-transformer
//! gmm/grouped_matmul/docs/aclnnGroupedMatmulV4.md): the forward pass and the input's gradient
//! split along M (one `x`, the experts' weights a list, one output; the forward's weights
//! transposed views), the weights' gradients split along K (`dyᵀ` as a transposed view times
//! `x`, one `[groups, m, k]` output added into each gradient). At most 128 weights go in one
//! call (the operator's limit), so more experts run in chunks of groups. f32, and operands of
//! two dtypes, run one aclnnMatmul per group (the operator's f32 kernel takes only a stacked
//! weight tensor), as everything does where CANN lacks the operator or its kernel.

use super::{Npu, NpuTensor};
use crate::engine::{check, grouped, EngineError, Result};
use crate::npu::descriptor::View;
use crate::tensor::DType;
use std::ops::Range;

/// Most weights in one call's list.
const MAX_GROUPS: usize = 128;
/// `splitItem`: the output is one tensor.
const ONE_OUTPUT: i64 = 3;
/// `groupType`: the groups split M (rows of `x`) or K (its columns).
const SPLIT_M: i64 = 0;
const SPLIT_K: i64 = 2;
/// `groupListType`: the group list holds each group's size.
const GROUP_SIZES: i64 = 1;
/// `actType`: no activation.
const NO_ACTIVATION: i64 = 0;

/// Chunks of at most [`MAX_GROUPS`] groups: their groups and their rows.
fn chunks(counts: &[usize]) -> Vec<(Range<usize>, Range<usize>)> {
    let mut out = Vec::new();
    let (mut group, mut row) = (0, 0);
    for chunk in counts.chunks(MAX_GROUPS) {
        let rows: usize = chunk.iter().sum();
        out.push((group..group + chunk.len(), row..row + rows));
        (group, row) = (group + chunk.len(), row + rows);
    }
    out
}

/// Rows `rows` of a `[n, width]` tensor.
fn rows_of(t: &NpuTensor, rows: &Range<usize>, width: usize) -> View {
    t.view().reshaped(&[rows.len(), width], rows.start * width)
}

impl Npu {
    /// Whether the fused operator takes these operands.
    fn grouped_fused(&self, x: &NpuTensor, w: &[&NpuTensor]) -> bool {
        !self.gmm.absent()
            && matches!(x.dtype, DType::BF16 | DType::F16)
            && w.iter().all(|wg| wg.dtype == x.dtype)
    }

    /// `out = x` grouped by `counts` along `group_type`'s axis, times `weights`: one
    /// aclnnGroupedMatmulV4; `Ok(false)` when CANN has no kernel of it for the SoC.
    fn grouped_launch(
        &self,
        (x, weights, out): (&View, &[View], &View),
        counts: &[usize],
        group_type: i64,
    ) -> Result<bool> {
        let op = self.ctx.op;
        let (Some(prepare), Some(launch)) = (
            op.aclnnGroupedMatmulV4GetWorkspaceSize,
            op.aclnnGroupedMatmulV4,
        ) else {
            return Ok(false);
        };
        let list = self.indices(counts.iter().map(|&c| c as i64))?;
        let c = &self.ctx;
        let (xl, wl, ol) = (
            c.list(std::slice::from_ref(x))?,
            c.list(weights)?,
            c.list(std::slice::from_ref(out))?,
        );
        let gl = c.tensor(&list.view())?;
        let (none, no_out) = (std::ptr::null(), std::ptr::null_mut());
        let done = c.run(
            "aclnnGroupedMatmulV4",
            // SAFETY: the descriptors outlive the launch; ws and ex are valid out-pointers.
            |ws, ex| unsafe {
                prepare(
                    xl.raw,
                    wl.raw,
                    none,
                    none,
                    none,
                    none,
                    none,
                    none,
                    gl.raw,
                    none,
                    none,
                    none,
                    ONE_OUTPUT,
                    group_type,
                    GROUP_SIZES,
                    NO_ACTIVATION,
                    ol.raw,
                    no_out,
                    no_out,
                    ws,
                    ex,
                )
            },
            launch,
        );
        self.gmm.outcome("aclnnGroupedMatmulV4", done)
    }

    /// Each chunk's launch in turn: `Ok(false)` when the first finds no kernel (nothing
    /// written yet); a later one cannot, having found it once.
    fn grouped_chunks(
        &self,
        counts: &[usize],
        mut launch: impl FnMut(Range<usize>, Range<usize>) -> Result<bool>,
    ) -> Result<bool> {
        for (i, (groups, rows)) in chunks(counts).into_iter().enumerate() {
            if rows.is_empty() {
                continue;
            }
            if !launch(groups, rows)? {
                return match i {
                    0 => Ok(false),
                    _ => Err(EngineError::Device(
                        "aclnnGroupedMatmulV4 lost its kernel between two launches".into(),
                    )),
                };
            }
        }
        Ok(true)
    }

    /// [`crate::engine::Backend::grouped_matmul`].
    pub(super) fn grouped_matmul_on(
        &self,
        x: &NpuTensor,
        w: &[&NpuTensor],
        counts: &[usize],
    ) -> Result<NpuTensor> {
        let (n, k, m) = check::grouped_matmul(self, x, w, counts)?;
        if !self.grouped_fused(x, w) {
            return grouped::grouped_matmul(self, x, w, counts);
        }
        let out = self.empty(&[n, m], x.dtype)?;
        // each wᵀ as a view: [k, m] with strides [1, k]
        let transposed = |wg: &&NpuTensor| wg.view().strided(&[k, m], &[1, k as i64], 0);
        let fused = self.grouped_chunks(counts, |groups, rows| {
            let weights: Vec<View> = w[groups.clone()].iter().map(transposed).collect();
            let (xs, ys) = (rows_of(x, &rows, k), rows_of(&out, &rows, m));
            self.grouped_launch((&xs, &weights, &ys), &counts[groups], SPLIT_M)
        })?;
        match fused {
            true => Ok(out),
            false => grouped::grouped_matmul(self, x, w, counts),
        }
    }

    /// [`crate::engine::Backend::grouped_matmul_bwd`].
    pub(super) fn grouped_matmul_bwd_on(
        &self,
        (dy, x): (&NpuTensor, &NpuTensor),
        w: &[&NpuTensor],
        counts: &[usize],
        dw: &mut [Option<&mut NpuTensor>],
    ) -> Result<NpuTensor> {
        let (n, k, m) = check::grouped_matmul_bwd(self, (dy, x), w, counts, dw)?;
        if !self.grouped_fused(dy, w) || x.dtype != dy.dtype {
            return grouped::grouped_matmul_bwd(self, (dy, x), w, counts, dw);
        }
        let dx = self.empty(&[n, k], dy.dtype)?;
        let fused = self.grouped_chunks(counts, |groups, rows| {
            let weights: Vec<View> = w[groups.clone()].iter().map(|wg| wg.view()).collect();
            let (dys, dxs) = (rows_of(dy, &rows, m), rows_of(&dx, &rows, k));
            self.grouped_launch((&dys, &weights, &dxs), &counts[groups], SPLIT_M)
        })?;
        if !fused {
            return grouped::grouped_matmul_bwd(self, (dy, x), w, counts, dw);
        }
        let fused = self.grouped_chunks(counts, |groups, rows| {
            if dw[groups.clone()].iter().all(Option::is_none) {
                return Ok(true);
            }
            let product = self.empty(&[groups.len(), m, k], dy.dtype)?;
            // dyᵀ as a view: [m, rows] with strides [1, m]
            let dyt = dy
                .view()
                .strided(&[m, rows.len()], &[1, m as i64], rows.start * m);
            let xs = [rows_of(x, &rows, k)];
            if !self.grouped_launch(
                (&dyt, &xs, &product.view()),
                &counts[groups.clone()],
                SPLIT_K,
            )? {
                return Ok(false);
            }
            for (i, g) in groups.enumerate() {
                if let (Some(dwg), true) = (dw[g].as_deref(), counts[g] > 0) {
                    self.add_view(&dwg.view(), &product.view().reshaped(&[m, k], i * m * k))?;
                }
            }
            Ok(true)
        })?;
        match fused {
            true => Ok(dx),
            // the kernel ran for dx, so it is there: not reached
            false => Err(EngineError::Device(
                "aclnnGroupedMatmulV4 lost its kernel between two launches".into(),
            )),
        }
    }
}
