//! aclnnGroupedMatmulV4 (ops-transformer gmm/grouped_matmul/docs/aclnnGroupedMatmulV4.md) in
//! the non-quantised scenarios with one `x` and one output that its documentation allows:
//! groups along M (`x [n, k]` not transposed; the weights a list of `[k, m]` or one
//! `[groups, k, m]`, transposed or not, all alike; `out [n, m]`) and along K (`x` a transposed
//! `[m, n]` view, one `[n, k]` weight not transposed, `out [groups, m, k]`). FLOAT only with
//! a single weight tensor, at most 128 weights, no bias, quantisation or activation, as the
//! documentation says; the group list is checked against the grouped axis at launch.

use super::nn::gemm;
use super::{Ex, Ws, HEAVY};
use crate::aclnn::{ensure, phase1, Kernel, Plan};
use crate::view::View;
use ascendcl_sys::aclnn::{aclTensor, aclTensorList, aclnnStatus};
use ascendcl_sys::{ACL_FLOAT, ACL_INT64};

/// Most weights in a list.
const MAX_WEIGHTS: usize = 128;

/// How a matrix (the last two dimensions of `v`) lies in memory.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Layout {
    RowMajor,
    Transposed,
}

fn layout(v: &View) -> Option<Layout> {
    let r = v.rank();
    let (rows, cols) = (v.dims[r - 2], v.dims[r - 1]);
    let (sr, sc) = (v.strides[r - 2], v.strides[r - 1]);
    match () {
        _ if sc == 1 && (sr == cols || rows <= 1) => Some(Layout::RowMajor),
        _ if sr == 1 && (sc == rows || cols <= 1) => Some(Layout::Transposed),
        _ => None,
    }
}

#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn aclnnGroupedMatmulV4GetWorkspaceSize(
    x: *const aclTensorList,
    weight: *const aclTensorList,
    bias_optional: *const aclTensorList,
    scale_optional: *const aclTensorList,
    offset_optional: *const aclTensorList,
    antiquant_scale_optional: *const aclTensorList,
    antiquant_offset_optional: *const aclTensorList,
    per_token_scale_optional: *const aclTensorList,
    group_list_optional: *const aclTensor,
    activation_input_optional: *const aclTensorList,
    activation_quant_scale_optional: *const aclTensorList,
    activation_quant_offset_optional: *const aclTensorList,
    split_item: i64,
    group_type: i64,
    group_list_type: i64,
    act_type: i64,
    out: *mut aclTensorList,
    activation_feature_out_optional: *mut aclTensorList,
    dyn_quant_scale_out_optional: *mut aclTensorList,
    workspace_size: Ws,
    executor: Ex,
) -> aclnnStatus {
    phase1("aclnnGroupedMatmulV4", workspace_size, executor, |p| {
        for (list, name) in [
            (bias_optional, "biasOptional"),
            (scale_optional, "scaleOptional"),
            (offset_optional, "offsetOptional"),
            (antiquant_scale_optional, "antiquantScaleOptional"),
            (antiquant_offset_optional, "antiquantOffsetOptional"),
            (per_token_scale_optional, "perTokenScaleOptional"),
            (activation_input_optional, "activationInputOptional"),
            (
                activation_quant_scale_optional,
                "activationQuantScaleOptional",
            ),
            (
                activation_quant_offset_optional,
                "activationQuantOffsetOptional",
            ),
            (
                activation_feature_out_optional.cast_const(),
                "activationFeatureOutOptional",
            ),
            (
                dyn_quant_scale_out_optional.cast_const(),
                "dynQuantScaleOutOptional",
            ),
        ] {
            p.absent(list, name)?;
        }
        ensure!(
            p,
            act_type == 0,
            "actType {act_type}: the stand-in runs none (0)"
        );
        ensure!(
            p,
            split_item == 2 || split_item == 3,
            "splitItem {split_item}: the stand-in writes one output tensor (2 or 3)"
        );
        ensure!(
            p,
            group_list_type == 0 || group_list_type == 1,
            "groupListType {group_list_type}: not 0 (cumulative) or 1 (sizes)"
        );
        let (xs, ws) = (p.list(x, "x", false)?, p.list(weight, "weight", false)?);
        let outs = p.list(out.cast_const(), "out", true)?;
        ensure!(
            p,
            xs.len() == 1 && outs.len() == 1,
            "x and out hold {} and {} tensors; splitItem {split_item} with one x asks for one each",
            xs.len(),
            outs.len()
        );
        ensure!(
            p,
            (1..=MAX_WEIGHTS).contains(&ws.len()),
            "weight holds {} tensors (1 to {MAX_WEIGHTS})",
            ws.len()
        );
        let list = p.input(group_list_optional, "groupListOptional")?;
        p.dtype(&list, "groupListOptional", ACL_INT64)?;
        ensure!(
            p,
            list.rank() == 1,
            "groupListOptional {:?} is not 1-D",
            list.dims
        );
        let (x, o) = (xs[0].clone(), outs[0].clone());
        p.float(&x, "x")?;
        p.dtype(&o, "out", x.dtype)?;
        for (i, w) in ws.iter().enumerate() {
            p.dtype(w, &format!("weight[{i}]"), x.dtype)?;
        }
        ensure!(
            p,
            x.dtype != ACL_FLOAT || ws.len() == 1,
            "FLOAT runs only with x, weight and out single tensors ({} weights)",
            ws.len()
        );
        ensure!(p, x.rank() == 2, "x {:?} is not 2-D", x.dims);
        let cumulative = group_list_type == 0;
        let kernel = match group_type {
            0 => split_m(p, (x, ws, o), list, cumulative)?,
            2 => split_k(p, (x, ws, o), list, cumulative)?,
            _ => {
                return Err(p.invalid(format!(
                    "groupType {group_type}: the stand-in groups M (0) or K (2)"
                )))
            }
        };
        Ok((HEAVY, kernel))
    })
}

/// Each group's size from the group list's values, which must cover `len` exactly.
fn sizes(values: &[i64], cumulative: bool, len: usize) -> Result<Vec<usize>, String> {
    let mut out = Vec::with_capacity(values.len());
    let mut before = 0i64;
    for (i, &v) in values.iter().enumerate() {
        let size = if cumulative { v - before } else { v };
        if size < 0 {
            return Err(format!(
                "groupListOptional[{i}] = {v} makes a negative group"
            ));
        }
        before = if cumulative { v } else { before + v };
        out.push(size as usize);
    }
    match usize::try_from(before) == Ok(len) {
        true => Ok(out),
        false => Err(format!(
            "the groups cover {before} of the {len} along the grouped axis"
        )),
    }
}

/// Groups of rows of `x [n, k]`, each times its weight `[k, m]`.
fn split_m(
    p: &Plan,
    (x, ws, o): (View, Vec<View>, View),
    list: View,
    cumulative: bool,
) -> Result<Kernel, aclnnStatus> {
    let (n, k) = (x.dims[0], x.dims[1]);
    ensure!(
        p,
        layout(&x) == Some(Layout::RowMajor),
        "x cannot be transposed (groupType 0)"
    );
    let stacked = ws.len() == 1 && ws[0].rank() == 3;
    let groups = if stacked { ws[0].dims[0] } else { ws.len() };
    ensure!(
        p,
        stacked || ws.iter().all(|w| w.rank() == 2),
        "weight: one 3-D tensor or 2-D tensors"
    );
    let m = ws[0].last();
    let layouts: Vec<Option<Layout>> = ws.iter().map(layout).collect();
    ensure!(
        p,
        layouts[0].is_some() && layouts.iter().all(|l| *l == layouts[0]),
        "the weights' transposition must be one and the same ({layouts:?})"
    );
    for (i, w) in ws.iter().enumerate() {
        let r = w.rank();
        ensure!(
            p,
            w.dims[r - 2..] == [k, m],
            "weight[{i}] {:?} does not take x {:?} to {m} columns",
            w.dims,
            x.dims
        );
    }
    ensure!(
        p,
        list.numel() == groups,
        "groupListOptional has {} values for {groups} groups",
        list.numel()
    );
    p.shape(&o, "out", &[n, m])?;
    Ok(Box::new(move || {
        let counts = sizes(&list.read_int(), cumulative, n)?;
        let (xv, weights) = (x.read(), ws.iter().map(View::read).collect::<Vec<_>>());
        let mut y = vec![0f32; n * m];
        let mut at = 0;
        for (g, &c) in counts.iter().enumerate() {
            let w = match stacked {
                true => &weights[0][g * k * m..(g + 1) * k * m],
                false => &weights[g][..],
            };
            gemm(
                &xv[at * k..(at + c) * k],
                w,
                &mut y[at * m..(at + c) * m],
                k,
                m,
            );
            at += c;
        }
        o.write(&y);
        Ok(())
    }))
}

/// Groups of columns of `x` (a transposed `[m, n]` view) times the same groups of rows of the
/// one weight `[n, k]`: `out [groups, m, k]`.
fn split_k(
    p: &Plan,
    (x, ws, o): (View, Vec<View>, View),
    list: View,
    cumulative: bool,
) -> Result<Kernel, aclnnStatus> {
    let (m, n) = (x.dims[0], x.dims[1]);
    ensure!(
        p,
        layout(&x) == Some(Layout::Transposed),
        "x must be transposed (groupType 2)"
    );
    ensure!(
        p,
        ws.len() == 1 && ws[0].rank() == 2,
        "weight: one 2-D tensor (groupType 2)"
    );
    let w = ws[0].clone();
    ensure!(
        p,
        layout(&w) == Some(Layout::RowMajor),
        "weight cannot be transposed (groupType 2)"
    );
    ensure!(
        p,
        w.dims[0] == n,
        "weight {:?} does not take x {:?}",
        w.dims,
        x.dims
    );
    let (k, groups) = (w.dims[1], list.numel());
    p.shape(&o, "out", &[groups, m, k])?;
    Ok(Box::new(move || {
        let counts = sizes(&list.read_int(), cumulative, n)?;
        let (xv, wv) = (x.read(), w.read());
        let mut y = vec![0f32; groups * m * k];
        let mut at = 0;
        for (g, &c) in counts.iter().enumerate() {
            // this group's columns of x, as rows [m, c]
            let xg: Vec<f32> = (0..m)
                .flat_map(|r| &xv[r * n + at..r * n + at + c])
                .copied()
                .collect();
            gemm(
                &xg,
                &wv[at * k..(at + c) * k],
                &mut y[g * m * k..(g + 1) * m * k],
                c,
                k,
            );
            at += c;
        }
        o.write(&y);
        Ok(())
    }))
}
