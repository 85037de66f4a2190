//! LogSoftmax, Softmax(+Backward) and the cross-entropy loss with its gradient (from the saved log-probabilities).

use super::{by_rows, checked_index, last_dim, Ex, Ws, HEAVY};
use crate::aclnn::{ensure, phase1, Kernel, Plan};
use crate::view::View;
use ascendcl_sys::aclnn::{aclTensor, aclnnStatus};
use ascendcl_sys::ACL_FLOAT;
use std::ffi::c_char;

/// `out = row − log Σ exp(row)`, stable.
fn log_softmax(row: &[f32], out: &mut [f32]) {
    let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let lse = max + row.iter().map(|v| (v - max).exp()).sum::<f32>().ln();
    out.iter_mut().zip(row).for_each(|(o, v)| *o = v - lse);
}

/// `out = softmax(row)`, stable (fully masked rows, all −∞, give NaN as on the device).
fn softmax(row: &[f32], out: &mut [f32]) {
    log_softmax(row, out);
    out.iter_mut().for_each(|v| *v = v.exp());
}

/// `dx = y · (dy − Σ dy·y)` of a softmax row `y`.
fn softmax_backward(dy: &[f32], y: &[f32], dx: &mut [f32]) {
    let dot: f32 = dy.iter().zip(y).map(|(a, b)| a * b).sum();
    for ((d, &g), &y) in dx.iter_mut().zip(dy).zip(y) {
        *d = y * (g - dot);
    }
}

/// `out = f(row)` for each row of `self` along its last dimension (`dim`).
fn along_rows(
    op: &'static str,
    (self_, dim, out): (*const aclTensor, i64, *const aclTensor),
    f: fn(&[f32], &mut [f32]),
    workspace_size: Ws,
    executor: Ex,
) -> aclnnStatus {
    phase1(op, workspace_size, executor, |p| {
        let x = p.input(self_, "self")?;
        let o = p.output(out, "out")?;
        p.float(&x, "self")?;
        last_dim(p, dim, x.rank(), "dim")?;
        p.shape(&o, "out", &x.dims)?;
        p.float(&o, "out")?;
        let kernel: Kernel = Box::new(move || {
            let c = x.last();
            o.write(&by_rows(&x.read(), c, c, |_, row, out| f(row, out)));
            Ok(())
        });
        Ok((0, kernel))
    })
}

#[no_mangle]
pub extern "C" fn aclnnLogSoftmaxGetWorkspaceSize(
    self_: *const aclTensor,
    dim: i64,
    out: *mut aclTensor,
    workspace_size: Ws,
    executor: Ex,
) -> aclnnStatus {
    let args = (self_, dim, out.cast_const());
    along_rows(
        "aclnnLogSoftmax",
        args,
        log_softmax,
        workspace_size,
        executor,
    )
}

#[no_mangle]
pub extern "C" fn aclnnSoftmaxGetWorkspaceSize(
    self_: *const aclTensor,
    dim: i64,
    out: *mut aclTensor,
    workspace_size: Ws,
    executor: Ex,
) -> aclnnStatus {
    let args = (self_, dim, out.cast_const());
    along_rows("aclnnSoftmax", args, softmax, workspace_size, executor)
}

#[no_mangle]
pub extern "C" fn aclnnSoftmaxBackwardGetWorkspaceSize(
    grad_output: *const aclTensor,
    output: *const aclTensor,
    dim: i64,
    out: *mut aclTensor,
    workspace_size: Ws,
    executor: Ex,
) -> aclnnStatus {
    phase1("aclnnSoftmaxBackward", workspace_size, executor, |p| {
        let dy = p.input(grad_output, "gradOutput")?;
        let y = p.input(output, "output")?;
        let dx = p.output(out, "out")?;
        p.float(&dy, "gradOutput")?;
        last_dim(p, dim, dy.rank(), "dim")?;
        for (v, name) in [(&y, "output"), (&dx, "out")] {
            p.like(v, name, &dy)?;
        }
        let kernel: Kernel = Box::new(move || {
            let (c, y) = (dy.last(), y.read());
            dx.write(&by_rows(&dy.read(), c, c, |i, row, out| {
                softmax_backward(row, &y[i * c..][..c], out)
            }));
            Ok(())
        });
        Ok((0, kernel))
    })
}

#[derive(Clone, Copy, PartialEq)]
enum Reduction {
    None,
    Mean,
    Sum,
}

/// The cross entropy's common arguments: its reduction, and the `(N, C)` of `x [N, C]` with
/// targets `[N]`; the features the stand-in lacks must be off.
fn loss_args(
    p: &Plan,
    reduction: *const c_char,
    (x, target): (&View, &View),
    (label_smoothing, lse_square_scale): (f64, f64),
) -> Result<(Reduction, usize, usize), aclnnStatus> {
    let reduction = match p.string(reduction, "mean").as_str() {
        "none" => Reduction::None,
        "mean" => Reduction::Mean,
        "sum" => Reduction::Sum,
        other => return Err(p.invalid(format!("reduction \"{other}\" is not none, mean or sum"))),
    };
    ensure!(
        p,
        label_smoothing == 0.0,
        "labelSmoothing {label_smoothing} is not supported by the stand-in"
    );
    ensure!(
        p,
        lse_square_scale == 0.0,
        "lseSquareScaleForZloss {lse_square_scale} is not supported by the stand-in"
    );
    p.float(x, "the logits")?;
    ensure!(p, x.rank() == 2, "input {:?} is not [N, C]", x.dims);
    let (n, c) = (x.dims[0], x.dims[1]);
    p.index(target, "target")?;
    p.shape(target, "target", &[n])?;
    Ok((reduction, n, c))
}

/// The loss's shape for `reduction`: `[N]`, or one element as `[]` or `[1]`.
fn loss_shape(
    p: &Plan,
    v: &View,
    name: &str,
    reduction: Reduction,
    n: usize,
) -> Result<(), aclnnStatus> {
    let fits = match reduction {
        Reduction::None => v.dims == [n],
        _ => v.dims.is_empty() || v.dims == [1],
    };
    ensure!(
        p,
        fits,
        "{name} {:?} does not fit reduction with {n} rows",
        v.dims
    );
    p.float(v, name)
}

/// Each row's target class, None for an ignored row; a target outside `[0, C)` is an error.
fn classes(target: &View, c: usize, ignore_index: i64) -> Result<Vec<Option<usize>>, String> {
    let ids = target.read_int().into_iter().enumerate();
    ids.map(|(i, t)| match t == ignore_index {
        true => Ok(None),
        false => checked_index(t, i, c).map(Some),
    })
    .collect()
}

/// What a row's loss or gradient is divided by: the rows counted, for the mean.
fn divisor(reduction: Reduction, classes: &[Option<usize>]) -> f32 {
    match reduction {
        Reduction::Mean => classes.iter().flatten().count() as f32,
        _ => 1.0,
    }
}

#[no_mangle]
pub extern "C" fn aclnnCrossEntropyLossGetWorkspaceSize(
    input: *const aclTensor,
    target: *const aclTensor,
    weight_optional: *const aclTensor,
    reduction_optional: *mut c_char,
    ignore_index: i64,
    label_smoothing: f64,
    lse_square_scale_for_zloss: f64,
    return_zloss: bool,
    loss_out: *const aclTensor,
    log_prob_out: *const aclTensor,
    zloss_out: *const aclTensor,
    lse_for_zloss_out: *const aclTensor,
    workspace_size: Ws,
    executor: Ex,
) -> aclnnStatus {
    phase1("aclnnCrossEntropyLoss", workspace_size, executor, |p| {
        let x = p.input(input, "input")?;
        let t = p.input(target, "target")?;
        p.absent(weight_optional, "weightOptional")?;
        ensure!(
            p,
            !return_zloss,
            "returnZloss is not supported by the stand-in"
        );
        let smoothing = (label_smoothing, lse_square_scale_for_zloss);
        let (reduction, n, c) = loss_args(p, reduction_optional, (&x, &t), smoothing)?;
        let loss = p.output(loss_out, "lossOut")?;
        let log_prob = p.output(log_prob_out, "logProbOut")?;
        let zeros = [
            p.output(zloss_out, "zlossOut")?,
            p.output(lse_for_zloss_out, "lseForZlossOut")?,
        ];
        loss_shape(p, &loss, "lossOut", reduction, n)?;
        ensure!(
            p,
            loss.dtype == ACL_FLOAT || loss.dtype == x.dtype,
            "lossOut is neither FLOAT nor input's dtype"
        );
        p.like(&log_prob, "logProbOut", &x)?;
        let kernel: Kernel = Box::new(move || {
            let classes = classes(&t, c, ignore_index)?;
            let lp = by_rows(&x.read(), c, c, |_, row, out| log_softmax(row, out));
            let losses: Vec<f32> = classes
                .iter()
                .enumerate()
                .map(|(i, k)| k.map_or(0.0, |k| -lp[i * c + k]))
                .collect();
            let total = losses.iter().sum::<f32>() / divisor(reduction, &classes);
            loss.write(if reduction == Reduction::None {
                &losses
            } else {
                std::slice::from_ref(&total)
            });
            log_prob.write(&lp);
            zeros.iter().for_each(|z| z.write(&vec![0.0; z.numel()]));
            Ok(())
        });
        Ok((HEAVY, kernel))
    })
}

#[no_mangle]
pub extern "C" fn aclnnCrossEntropyLossGradGetWorkspaceSize(
    grad_loss: *const aclTensor,
    log_prob: *const aclTensor,
    target: *const aclTensor,
    weight_optional: *const aclTensor,
    grad_zloss_optional: *const aclTensor,
    lse_for_zloss_optional: *const aclTensor,
    reduction_optional: *mut c_char,
    ignore_index: i64,
    label_smoothing: f64,
    lse_square_scale_for_zloss: f64,
    out: *const aclTensor,
    workspace_size: Ws,
    executor: Ex,
) -> aclnnStatus {
    phase1("aclnnCrossEntropyLossGrad", workspace_size, executor, |p| {
        let g = p.input(grad_loss, "gradLoss")?;
        let lp = p.input(log_prob, "logProb")?;
        let t = p.input(target, "target")?;
        p.absent(weight_optional, "weightOptional")?;
        p.absent(grad_zloss_optional, "gradZlossOptional")?;
        // unused without z-loss, but a tensor given must be a live one
        p.opt_input(lse_for_zloss_optional, "lseForZlossOptional")?;
        let smoothing = (label_smoothing, lse_square_scale_for_zloss);
        let (reduction, n, c) = loss_args(p, reduction_optional, (&lp, &t), smoothing)?;
        loss_shape(p, &g, "gradLoss", reduction, n)?;
        let o = p.output(out, "out")?;
        p.like(&o, "out", &lp)?;
        let kernel: Kernel = Box::new(move || {
            let classes = classes(&t, c, ignore_index)?;
            let (gs, scale) = (g.read(), divisor(reduction, &classes));
            let dx = by_rows(&lp.read(), c, c, |i, row, out| {
                let Some(k) = classes[i] else { return };
                let gi = gs[if reduction == Reduction::None { i } else { 0 }] / scale;
                out.iter_mut().zip(row).for_each(|(o, l)| *o = gi * l.exp());
                out[k] -= gi;
            });
            o.write(&dx);
            Ok(())
        });
        Ok((HEAVY, kernel))
    })
}
