//! Elementwise operators (casts and copies, add and subtract with broadcasting, scaling, the
//! masked fill, the AdamW step) and reductions (ReduceSum, ForeachNorm).

use super::{unary, Ex, Ws, HEAVY};
use crate::aclnn::{ensure, phase1, Kernel, Plan};
use crate::view::{broadcast_shape, View};
use ascendcl_sys::aclnn::{aclIntArray, aclScalar, aclTensor, aclTensorList, aclnnStatus};
use ascendcl_sys::{aclDataType, ACL_BOOL, ACL_FLOAT, ACL_INT64};

/// `dst = src` converted to `dst`'s dtype (f64 in between, so integers stay exact).
fn copy(src: View, dst: View) -> Kernel {
    Box::new(move || {
        dst.write_f64(&src.read_f64());
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn aclnnCastGetWorkspaceSize(
    self_: *const aclTensor,
    dtype: aclDataType,
    out: *mut aclTensor,
    workspace_size: Ws,
    executor: Ex,
) -> aclnnStatus {
    phase1("aclnnCast", workspace_size, executor, |p| {
        let x = p.input(self_, "self")?;
        let out = p.output(out, "out")?;
        p.shape(&out, "out", &x.dims)?;
        p.dtype(&out, "out", dtype)?;
        Ok((0, copy(x, out)))
    })
}

#[no_mangle]
pub extern "C" fn aclnnInplaceCopyGetWorkspaceSize(
    self_ref: *mut aclTensor,
    src: *const aclTensor,
    workspace_size: Ws,
    executor: Ex,
) -> aclnnStatus {
    phase1("aclnnInplaceCopy", workspace_size, executor, |p| {
        let dst = p.output(self_ref, "selfRef")?;
        let src = p.input(src, "src")?;
        let Some(src) = src.broadcast_to(&dst.dims) else {
            return Err(p.invalid(format!(
                "src {:?} does not broadcast to selfRef {:?}",
                src.dims, dst.dims
            )));
        };
        Ok((0, copy(src, dst)))
    })
}

/// `out = self + sign·alpha·other`, other broadcast (`out` may be `self`: the in-place add).
fn add(
    op: &'static str,
    (a, b, alpha, out): (
        *const aclTensor,
        *const aclTensor,
        *const aclScalar,
        *const aclTensor,
    ),
    sign: f64,
    workspace_size: Ws,
    executor: Ex,
) -> aclnnStatus {
    phase1(op, workspace_size, executor, |p| {
        let alpha = (sign * p.scalar(alpha, "alpha")?) as f32;
        binary(p, (a, b, out), move |x, y| x + alpha * y)
    })
}

/// `out = f(self, other)` elementwise, other broadcast to self (`out` may be `self`).
fn binary(
    p: &mut Plan,
    (a, b, out): (*const aclTensor, *const aclTensor, *const aclTensor),
    f: impl Fn(f32, f32) -> f32 + Send + 'static,
) -> Result<(u64, Kernel), aclnnStatus> {
    let in_place = a == out;
    let (self_name, out_name) = if in_place {
        ("selfRef", "selfRef")
    } else {
        ("self", "out")
    };
    let x = p.input(a, self_name)?;
    let y = p.input(b, "other")?;
    let o = p.output(out, out_name)?;
    let shape = broadcast_shape(&x.dims, &y.dims);
    ensure!(
        p,
        shape.as_deref() == Some(&o.dims[..]),
        "other {:?} and {self_name} {:?} do not broadcast to {out_name} {:?}",
        y.dims,
        x.dims,
        o.dims
    );
    let (x, y) = (x.broadcast_to(&o.dims), y.broadcast_to(&o.dims));
    let (x, y) = (x.expect("broadcast checked"), y.expect("broadcast checked"));
    let kernel: Kernel = Box::new(move || {
        let values: Vec<f32> = x
            .read()
            .iter()
            .zip(y.read())
            .map(|(a, b)| f(*a, b))
            .collect();
        o.write(&values);
        Ok(())
    });
    Ok((0, kernel))
}

#[no_mangle]
pub extern "C" fn aclnnMulGetWorkspaceSize(
    self_: *const aclTensor,
    other: *const aclTensor,
    out: *mut aclTensor,
    workspace_size: Ws,
    executor: Ex,
) -> aclnnStatus {
    phase1("aclnnMul", workspace_size, executor, |p| {
        binary(p, (self_, other, out as *const aclTensor), |x, y| x * y)
    })
}

#[no_mangle]
pub extern "C" fn aclnnReluGetWorkspaceSize(
    self_: *const aclTensor,
    out: *const aclTensor,
    workspace_size: Ws,
    executor: Ex,
) -> aclnnStatus {
    phase1("aclnnRelu", workspace_size, executor, |p| {
        let x = p.input(self_, "self")?;
        let o = p.output(out, "out")?;
        p.shape(&o, "out", &x.dims)?;
        Ok((0, unary(x, o, |v| v.max(0.0))))
    })
}

#[no_mangle]
pub extern "C" fn aclnnAddGetWorkspaceSize(
    self_: *const aclTensor,
    other: *const aclTensor,
    alpha: *const aclScalar,
    out: *mut aclTensor,
    workspace_size: Ws,
    executor: Ex,
) -> aclnnStatus {
    let args = (self_, other, alpha, out as *const aclTensor);
    add("aclnnAdd", args, 1.0, workspace_size, executor)
}

#[no_mangle]
pub extern "C" fn aclnnSubGetWorkspaceSize(
    self_: *const aclTensor,
    other: *const aclTensor,
    alpha: *const aclScalar,
    out: *mut aclTensor,
    workspace_size: Ws,
    executor: Ex,
) -> aclnnStatus {
    let args = (self_, other, alpha, out as *const aclTensor);
    add("aclnnSub", args, -1.0, workspace_size, executor)
}

#[no_mangle]
pub extern "C" fn aclnnInplaceAddGetWorkspaceSize(
    self_ref: *const aclTensor,
    other: *const aclTensor,
    alpha: *const aclScalar,
    workspace_size: Ws,
    executor: Ex,
) -> aclnnStatus {
    let args = (self_ref, other, alpha, self_ref);
    add("aclnnInplaceAdd", args, 1.0, workspace_size, executor)
}

/// `out = self · scalar` (`out` may be `self`).
fn muls(
    op: &'static str,
    a: *const aclTensor,
    s: *const aclScalar,
    out: *const aclTensor,
    workspace_size: Ws,
    executor: Ex,
) -> aclnnStatus {
    phase1(op, workspace_size, executor, |p| {
        let x = p.input(a, "self")?;
        let s = p.scalar(s, "other")? as f32;
        let o = p.output(out, "out")?;
        p.shape(&o, "out", &x.dims)?;
        Ok((0, unary(x, o, move |v| v * s)))
    })
}

#[no_mangle]
pub extern "C" fn aclnnMulsGetWorkspaceSize(
    self_: *const aclTensor,
    other: *const aclScalar,
    out: *mut aclTensor,
    workspace_size: Ws,
    executor: Ex,
) -> aclnnStatus {
    muls("aclnnMuls", self_, other, out, workspace_size, executor)
}

#[no_mangle]
pub extern "C" fn aclnnInplaceMulsGetWorkspaceSize(
    self_ref: *mut aclTensor,
    other: *const aclScalar,
    workspace_size: Ws,
    executor: Ex,
) -> aclnnStatus {
    muls(
        "aclnnInplaceMuls",
        self_ref,
        other,
        self_ref,
        workspace_size,
        executor,
    )
}

#[no_mangle]
pub extern "C" fn aclnnInplaceMaskedFillScalarGetWorkspaceSize(
    self_ref: *mut aclTensor,
    mask: *const aclTensor,
    value: *const aclScalar,
    workspace_size: Ws,
    executor: Ex,
) -> aclnnStatus {
    phase1(
        "aclnnInplaceMaskedFillScalar",
        workspace_size,
        executor,
        |p| {
            let x = p.output(self_ref, "selfRef")?;
            let m = p.input(mask, "mask")?;
            let value = p.scalar(value, "value")? as f32;
            p.dtype(&m, "mask", ACL_BOOL)?;
            let Some(m) = m.broadcast_to(&x.dims) else {
                return Err(p.invalid(format_args!(
                    "mask {:?} does not broadcast to selfRef {:?}",
                    m.dims, x.dims
                )));
            };
            let kernel: Kernel = Box::new(move || {
                let filled: Vec<f32> = x
                    .read()
                    .into_iter()
                    .zip(m.read_int())
                    .map(|(v, masked)| if masked != 0 { value } else { v })
                    .collect();
                x.write(&filled);
                Ok(())
            });
            Ok((0, kernel))
        },
    )
}

/// Which dimensions of a `rank`-D tensor `dims` names (empty: all).
fn reduced(p: &Plan, dims: &[i64], rank: usize) -> Result<Vec<bool>, aclnnStatus> {
    let mut mask = vec![dims.is_empty(); rank];
    let r = rank.max(1) as i64;
    for &d in dims {
        ensure!(
            p,
            (-r..r).contains(&d),
            "dim {d} is outside [{}, {r}) of a {rank}-D self",
            -r
        );
        let d = d.rem_euclid(r) as usize;
        ensure!(p, rank == 0 || !mask[d], "dim {d} is named twice");
        if rank > 0 {
            mask[d] = true;
        }
    }
    Ok(mask)
}

/// The output element each input element of `dims` sums into.
fn reduce_targets(dims: &[usize], mask: &[bool]) -> Vec<usize> {
    let n: usize = dims.iter().product();
    (0..n)
        .map(|i| {
            let (mut rest, mut at, mut scale) = (i, 0, 1);
            for (&d, &m) in dims.iter().zip(mask).rev() {
                if !m {
                    at += (rest % d) * scale;
                    scale *= d;
                }
                rest /= d;
            }
            at
        })
        .collect()
}

#[no_mangle]
pub extern "C" fn aclnnReduceSumGetWorkspaceSize(
    self_: *const aclTensor,
    dims: *const aclIntArray,
    keep_dims: bool,
    dtype: aclDataType,
    out: *mut aclTensor,
    workspace_size: Ws,
    executor: Ex,
) -> aclnnStatus {
    phase1("aclnnReduceSum", workspace_size, executor, |p| {
        let x = p.input(self_, "self")?;
        let mask = reduced(p, &p.int_array(dims, "dims")?, x.rank())?;
        let o = p.output(out, "out")?;
        p.dtype(&o, "out", dtype)?;
        let kept = x.dims.iter().zip(&mask);
        let shape: Vec<usize> = match keep_dims {
            true => kept.map(|(&d, &m)| if m { 1 } else { d }).collect(),
            false => kept.filter(|(_, &m)| !m).map(|(&d, _)| d).collect(),
        };
        p.shape(&o, "out", &shape)?;
        let kernel: Kernel = Box::new(move || {
            let mut sums = vec![0f32; o.numel()];
            for (v, at) in x.read().into_iter().zip(reduce_targets(&x.dims, &mask)) {
                sums[at] += v;
            }
            o.write(&sums);
            Ok(())
        });
        Ok((HEAVY, kernel))
    })
}

/// `‖x‖_p` (p ≥ 1, ∞ the largest magnitude), in f64.
fn norm(x: &[f64], p: f64) -> f64 {
    match p {
        _ if p.is_infinite() => x.iter().fold(0.0, |m, v| m.max(v.abs())),
        2.0 => x.iter().map(|v| v * v).sum::<f64>().sqrt(),
        _ => x.iter().map(|v| v.abs().powf(p)).sum::<f64>().powf(1.0 / p),
    }
}

#[no_mangle]
pub extern "C" fn aclnnForeachNormGetWorkspaceSize(
    x: *const aclTensorList,
    scalar: *const aclScalar,
    out: *const aclTensorList,
    workspace_size: Ws,
    executor: Ex,
) -> aclnnStatus {
    phase1("aclnnForeachNorm", workspace_size, executor, |p| {
        let xs = p.list(x, "x", false)?;
        let pv = p.scalar(scalar, "scalar")?;
        let outs = p.list(out, "out", true)?;
        ensure!(
            p,
            (1.0..).contains(&pv),
            "p {pv} < 1 is not supported by the stand-in"
        );
        ensure!(
            p,
            xs.len() == outs.len(),
            "out has {} tensors, x {}",
            outs.len(),
            xs.len()
        );
        for (i, (x, o)) in xs.iter().zip(&outs).enumerate() {
            p.float(x, &format!("x[{i}]"))?;
            p.dtype(x, &format!("x[{i}]"), xs[0].dtype)?;
            p.dtype(o, &format!("out[{i}]"), x.dtype)?;
            ensure!(
                p,
                o.numel() == 1,
                "out[{i}] {:?} is not one element",
                o.dims
            );
        }
        let kernel: Kernel = Box::new(move || {
            for (x, o) in xs.iter().zip(&outs) {
                o.write_f64(&[norm(&x.read_f64(), pv)]);
            }
            Ok(())
        });
        Ok((HEAVY, kernel))
    })
}

/// AdamW's hyper-parameters as the launch uses them.
#[derive(Clone, Copy)]
struct AdamW {
    lr: f32,
    beta1: f32,
    beta2: f32,
    weight_decay: f32,
    eps: f32,
}

impl AdamW {
    /// One step at `t` on `p`, `m`, `v` with `g`, in the order and precision of mindkit's CPU
    /// kernel (`src/engine/cpu/optim.rs::adamw`: its f64 hyper-parameters are these f32 ones
    /// widened), so that fp32 training on the stand-in matches the CPU's.
    fn step(self, t: f64, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
        let (lr, wd) = (f64::from(self.lr), f64::from(self.weight_decay));
        let (b1, b2) = (f64::from(self.beta1), f64::from(self.beta2));
        let decay = (1.0 - lr * wd) as f32;
        let w1 = (1.0 - b1) as f32;
        let (b2f, w2) = (b2 as f32, (1.0 - b2) as f32);
        let bc1 = 1.0 - b1.powf(t);
        let bc2_sqrt = ((1.0 - b2.powf(t)).sqrt()) as f32;
        let step_size = (lr / bc1) as f32;
        for i in 0..p.len() {
            p[i] *= decay;
            m[i] += w1 * (g[i] - m[i]);
            v[i] = v[i] * b2f + w2 * (g[i] * g[i]);
            let denom = v[i].sqrt() / bc2_sqrt + self.eps;
            p[i] += -step_size * (m[i] / denom);
        }
    }
}

#[no_mangle]
pub extern "C" fn aclnnApplyAdamWV2GetWorkspaceSize(
    var_ref: *mut aclTensor,
    m_ref: *mut aclTensor,
    v_ref: *mut aclTensor,
    max_grad_norm_optional_ref: *mut aclTensor,
    grad: *const aclTensor,
    step: *const aclTensor,
    lr: f32,
    beta1: f32,
    beta2: f32,
    weight_decay: f32,
    eps: f32,
    amsgrad: bool,
    maximize: bool,
    workspace_size: Ws,
    executor: Ex,
) -> aclnnStatus {
    phase1("aclnnApplyAdamWV2", workspace_size, executor, |p| {
        let var = p.output(var_ref, "varRef")?;
        let m = p.output(m_ref, "mRef")?;
        let v = p.output(v_ref, "vRef")?;
        p.absent(max_grad_norm_optional_ref, "maxGradNormOptionalRef")?;
        ensure!(
            p,
            !amsgrad && !maximize,
            "amsgrad and maximize are not supported by the stand-in"
        );
        let g = p.input(grad, "grad")?;
        let t = p.input(step, "step")?;
        p.dtype(&var, "varRef", ACL_FLOAT)?;
        p.like(&m, "mRef", &var)?;
        p.like(&v, "vRef", &var)?;
        p.shape(&g, "grad", &var.dims)?;
        p.float(&g, "grad")?;
        ensure!(
            p,
            t.numel() == 1 && matches!(t.dtype, ACL_INT64 | ACL_FLOAT),
            "step must be one INT64 or FLOAT element"
        );
        let hyper = AdamW {
            lr,
            beta1,
            beta2,
            weight_decay,
            eps,
        };
        let kernel: Kernel = Box::new(move || {
            let step = t.read_f64()[0];
            if step < 1.0 {
                return Err(format!("step {step} is not a step number (from 1)"));
            }
            let (mut pv, mut mv, mut vv) = (var.read(), m.read(), v.read());
            hyper.step(step, &mut pv, &g.read(), &mut mv, &mut vv);
            var.write(&pv);
            m.write(&mv);
            v.write(&vv);
            Ok(())
        });
        Ok((0, kernel))
    })
}
