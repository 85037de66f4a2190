//! The layers' operators: Matmul and BatchMatMul, RmsNorm(+Grad), SwiGlu(+Grad), the rotary embedding, and the
//! row gathers (Embedding, IndexSelect) with the embedding's gradient.

use super::{by_rows, checked_index, last_dim, Ex, Ws, HEAVY};
use crate::aclnn::{ensure, phase1, Kernel, Plan};
use crate::view::View;
use ascendcl_sys::aclnn::{aclTensor, aclnnStatus};
use ascendcl_sys::ACL_FLOAT;

/// `(batch, rows, cols)` of a 2-D (batch 1) or 3-D matrix.
fn matrix(v: &View) -> (usize, usize, usize) {
    match v.dims[..] {
        [b, r, c] => (b, r, c),
        [r, c] => (1, r, c),
        _ => (0, 0, 0),
    }
}

#[no_mangle]
pub extern "C" fn aclnnMatmulGetWorkspaceSize(
    self_: *const aclTensor,
    mat2: *const aclTensor,
    out: *mut aclTensor,
    cube_math_type: i8,
    workspace_size: Ws,
    executor: Ex,
) -> aclnnStatus {
    let args = (self_, mat2, out.cast_const(), cube_math_type);
    matmul("aclnnMatmul", args, false, workspace_size, executor)
}

#[no_mangle]
pub extern "C" fn aclnnBatchMatMulGetWorkspaceSize(
    self_: *const aclTensor,
    mat2: *const aclTensor,
    out: *mut aclTensor,
    cube_math_type: i8,
    workspace_size: Ws,
    executor: Ex,
) -> aclnnStatus {
    let args = (self_, mat2, out.cast_const(), cube_math_type);
    matmul("aclnnBatchMatMul", args, true, workspace_size, executor)
}

/// `out = self @ mat2`, 2-D or 3-D with a broadcast batch; `batched` (BatchMatMul) asks for
/// two 3-D operands of the same batch.
fn matmul(
    op: &'static str,
    (self_, mat2, out, cube_math_type): (*const aclTensor, *const aclTensor, *const aclTensor, i8),
    batched: bool,
    workspace_size: Ws,
    executor: Ex,
) -> aclnnStatus {
    phase1(op, workspace_size, executor, |p| {
        let a = p.input(self_, "self")?;
        let b = p.input(mat2, "mat2")?;
        let o = p.output(out, "out")?;
        ensure!(
            p,
            (0..=4).contains(&cube_math_type),
            "cubeMathType {cube_math_type} is not 0..=4"
        );
        p.float(&a, "self")?;
        p.dtype(&b, "mat2", a.dtype)?;
        p.dtype(&o, "out", a.dtype)?;
        let two_or_three = |v: &View| (2..=3).contains(&v.rank());
        ensure!(
            p,
            two_or_three(&a) && two_or_three(&b),
            "self {:?} and mat2 {:?} must be 2-D or 3-D",
            a.dims,
            b.dims
        );
        let ((ba, n, k), (bb, k2, m)) = (matrix(&a), matrix(&b));
        ensure!(
            p,
            !batched || (a.rank() == 3 && b.rank() == 3 && ba == bb),
            "self {:?} and mat2 {:?} must be 3-D with the same batch",
            a.dims,
            b.dims
        );
        let batches_fit = ba == bb || ba == 1 || bb == 1;
        ensure!(
            p,
            k == k2 && batches_fit,
            "mat2 {:?} does not fit self {:?}",
            b.dims,
            a.dims
        );
        let batch = ba.max(bb);
        let shape = match a.rank().max(b.rank()) {
            3 => vec![batch, n, m],
            _ => vec![n, m],
        };
        p.shape(&o, "out", &shape)?;
        let kernel: Kernel = Box::new(move || {
            let (x, y) = (a.read(), b.read());
            let mut c = vec![0f32; batch * n * m];
            for (i, cb) in c.chunks_exact_mut((n * m).max(1)).enumerate() {
                let xa = &x[i.min(ba - 1) * n * k..][..n * k];
                let yb = &y[i.min(bb - 1) * k * m..][..k * m];
                gemm(xa, yb, cb, k, m);
            }
            o.write(&c);
            Ok(())
        });
        Ok((HEAVY, kernel))
    })
}

/// `c [n, m] = x [n, k] · y [k, m]`, accumulated in f32 over k in order.
pub(super) fn gemm(x: &[f32], y: &[f32], c: &mut [f32], k: usize, m: usize) {
    for (xr, cr) in x.chunks_exact(k.max(1)).zip(c.chunks_exact_mut(m.max(1))) {
        for (&xv, yr) in xr.iter().zip(y.chunks_exact(m.max(1))) {
            cr.iter_mut().zip(yr).for_each(|(c, &y)| *c += xv * y);
        }
    }
}

/// RMSNorm's x, gamma and rstd (fp32, x's leading shape, with or without a trailing 1).
fn rms_args(
    p: &Plan,
    x: &View,
    gamma: &View,
    rstd: &View,
    rstd_name: &str,
) -> Result<(), aclnnStatus> {
    p.float(x, "x")?;
    ensure!(p, x.rank() > 0, "x is 0-D");
    p.shape(gamma, "gamma", &[x.last()])?;
    ensure!(
        p,
        gamma.dtype == x.dtype || gamma.dtype == ACL_FLOAT,
        "gamma is neither x's dtype nor FLOAT"
    );
    p.dtype(rstd, rstd_name, ACL_FLOAT)?;
    let with_one: Vec<usize> = x.leading().iter().copied().chain([1]).collect();
    ensure!(
        p,
        rstd.dims == x.leading() || rstd.dims == with_one,
        "{rstd_name} {:?} should be {:?} or {with_one:?}",
        rstd.dims,
        x.leading()
    );
    Ok(())
}

#[no_mangle]
pub extern "C" fn aclnnRmsNormGetWorkspaceSize(
    x: *const aclTensor,
    gamma: *const aclTensor,
    epsilon: f64,
    y_out: *const aclTensor,
    rstd_out: *const aclTensor,
    workspace_size: Ws,
    executor: Ex,
) -> aclnnStatus {
    phase1("aclnnRmsNorm", workspace_size, executor, |p| {
        let x = p.input(x, "x")?;
        let gamma = p.input(gamma, "gamma")?;
        let y = p.output(y_out, "yOut")?;
        let rstd = p.output(rstd_out, "rstdOut")?;
        rms_args(p, &x, &gamma, &rstd, "rstdOut")?;
        p.like(&y, "yOut", &x)?;
        let eps = epsilon as f32;
        let kernel: Kernel = Box::new(move || {
            let (xs, g, h) = (x.read(), gamma.read(), x.last());
            let mut r = Vec::with_capacity(xs.len() / h.max(1));
            let ys = by_rows(&xs, h, h, |_, row, out| {
                let rs = 1.0 / (row.iter().map(|v| v * v).sum::<f32>() / h as f32 + eps).sqrt();
                r.push(rs);
                out.iter_mut()
                    .zip(row.iter().zip(&g))
                    .for_each(|(o, (v, g))| *o = v * rs * g);
            });
            y.write(&ys);
            rstd.write(&r);
            Ok(())
        });
        Ok((0, kernel))
    })
}

#[no_mangle]
pub extern "C" fn aclnnRmsNormGradGetWorkspaceSize(
    dy: *const aclTensor,
    x: *const aclTensor,
    rstd: *const aclTensor,
    gamma: *const aclTensor,
    dx_out: *const aclTensor,
    dgamma_out: *const aclTensor,
    workspace_size: Ws,
    executor: Ex,
) -> aclnnStatus {
    phase1("aclnnRmsNormGrad", workspace_size, executor, |p| {
        let dy = p.input(dy, "dy")?;
        let x = p.input(x, "x")?;
        let rstd = p.input(rstd, "rstd")?;
        let gamma = p.input(gamma, "gamma")?;
        let dx = p.output(dx_out, "dxOut")?;
        let dgamma = p.output(dgamma_out, "dgammaOut")?;
        rms_args(p, &x, &gamma, &rstd, "rstd")?;
        p.like(&dy, "dy", &x)?;
        p.like(&dx, "dxOut", &x)?;
        p.shape(&dgamma, "dgammaOut", &gamma.dims)?;
        p.dtype(&dgamma, "dgammaOut", ACL_FLOAT)?;
        let kernel: Kernel = Box::new(move || {
            let (dys, xs, g, rs, h) = (dy.read(), x.read(), gamma.read(), rstd.read(), x.last());
            let mut dg = vec![0f32; h];
            let dxs = by_rows(&xs, h, h, |i, row, out| {
                let (r, d) = (rs[i], &dys[i * h..][..h]);
                let xhat: Vec<f32> = row.iter().map(|v| v * r).collect();
                let dxhat: Vec<f32> = d.iter().zip(&g).map(|(d, g)| d * g).collect();
                let mean = dxhat.iter().zip(&xhat).map(|(a, b)| a * b).sum::<f32>() / h as f32;
                for j in 0..h {
                    out[j] = r * (dxhat[j] - xhat[j] * mean);
                    dg[j] += d[j] * xhat[j];
                }
            });
            dx.write(&dxs);
            dgamma.write(&dg);
            Ok(())
        });
        Ok((0, kernel))
    })
}

/// The `f` of SwiGLU's `x [.., 2f]` split on its last dimension `dim`.
fn glu_half(p: &Plan, x: &View, dim: i64) -> Result<usize, aclnnStatus> {
    p.float(x, "x")?;
    last_dim(p, dim, x.rank(), "dim")?;
    ensure!(
        p,
        x.last().is_multiple_of(2),
        "x {:?} has an odd last dimension",
        x.dims
    );
    Ok(x.last() / 2)
}

/// `x`'s shape with the last dimension `last`.
fn with_last(x: &View, last: usize) -> Vec<usize> {
    x.leading().iter().copied().chain([last]).collect()
}

fn sigmoid(a: f32) -> f32 {
    1.0 / (1.0 + (-a).exp())
}

#[no_mangle]
pub extern "C" fn aclnnSwiGluGetWorkspaceSize(
    x: *const aclTensor,
    dim: i64,
    out: *const aclTensor,
    workspace_size: Ws,
    executor: Ex,
) -> aclnnStatus {
    phase1("aclnnSwiGlu", workspace_size, executor, |p| {
        let x = p.input(x, "x")?;
        let o = p.output(out, "out")?;
        let f = glu_half(p, &x, dim)?;
        p.shape(&o, "out", &with_last(&x, f))?;
        p.dtype(&o, "out", x.dtype)?;
        let kernel: Kernel = Box::new(move || {
            let ys = by_rows(&x.read(), 2 * f, f, |_, row, out| {
                let (a, b) = row.split_at(f);
                for j in 0..f {
                    out[j] = a[j] * sigmoid(a[j]) * b[j];
                }
            });
            o.write(&ys);
            Ok(())
        });
        Ok((0, kernel))
    })
}

#[no_mangle]
pub extern "C" fn aclnnSwiGluGradGetWorkspaceSize(
    y_grad: *const aclTensor,
    x: *const aclTensor,
    dim: i64,
    out: *const aclTensor,
    workspace_size: Ws,
    executor: Ex,
) -> aclnnStatus {
    phase1("aclnnSwiGluGrad", workspace_size, executor, |p| {
        let dy = p.input(y_grad, "yGrad")?;
        let x = p.input(x, "x")?;
        let o = p.output(out, "out")?;
        let f = glu_half(p, &x, dim)?;
        p.shape(&dy, "yGrad", &with_last(&x, f))?;
        p.dtype(&dy, "yGrad", x.dtype)?;
        p.like(&o, "out", &x)?;
        let kernel: Kernel = Box::new(move || {
            let g = dy.read();
            let dx = by_rows(&x.read(), 2 * f, 2 * f, |i, row, out| {
                let ((a, b), g) = (row.split_at(f), &g[i * f..][..f]);
                for j in 0..f {
                    let s = sigmoid(a[j]);
                    out[j] = g[j] * b[j] * s * (1.0 + a[j] * (1.0 - s));
                    out[f + j] = g[j] * a[j] * s;
                }
            });
            o.write(&dx);
            Ok(())
        });
        Ok((0, kernel))
    })
}

/// The element rotation pairs element `j` of a row of `d` with, and the sign it takes in
/// the rotated row: mode 0 `rotate_half` (`[-x2, x1]`), mode 1 interleaved (`[-x1, x0, …]`).
fn rotation_partner(mode: i64, d: usize, j: usize) -> (usize, f32) {
    match (mode, j) {
        (0, j) if j < d / 2 => (j + d / 2, -1.0),
        (0, j) => (j - d / 2, 1.0),
        (_, j) if j % 2 == 0 => (j + 1, -1.0),
        (_, j) => (j - 1, 1.0),
    }
}

/// The rotary embedding's common checks: `x` (or `dy`) 4-D float of an even last dimension,
/// the mode, `out` like it, and the cos and sin tables broadcast to it.
fn rotary_args(
    p: &Plan,
    (x, name): (&View, &str),
    (cos, sin): (View, View),
    mode: i64,
    out: &View,
) -> Result<(View, View), aclnnStatus> {
    p.float(x, name)?;
    ensure!(p, x.rank() == 4, "{name} {:?} is not 4-D", x.dims);
    ensure!(
        p,
        mode == 0 || mode == 1,
        "mode {mode} is not 0 (half) or 1 (interleave)"
    );
    let d = x.last();
    ensure!(p, d.is_multiple_of(2), "{name}'s last dimension {d} is odd");
    p.like(out, "out", x)?;
    let mut tables = Vec::new();
    for (t, table) in [(cos, "cos"), (sin, "sin")] {
        p.dtype(&t, table, x.dtype)?;
        let b = t.broadcast_to(&x.dims).filter(|_| t.last() == d);
        let Some(b) = b else {
            return Err(p.invalid(format!(
                "{table} {:?} does not broadcast to {name} {:?}",
                t.dims, x.dims
            )));
        };
        tables.push(b);
    }
    let sin = tables.pop().expect("two tables");
    Ok((tables.pop().expect("two tables"), sin))
}

/// A kernel writing, row by row of `x` (last dimension `d`), `f(row, cos, sin, out)`.
fn rotary_kernel(
    x: View,
    (cos, sin): (View, View),
    out: View,
    f: impl Fn(&[f32], &[f32], &[f32], &mut [f32]) + Send + 'static,
) -> Kernel {
    Box::new(move || {
        let (c, s, d) = (cos.read(), sin.read(), x.last());
        let ys = by_rows(&x.read(), d, d, |i, row, o| {
            f(row, &c[i * d..][..d], &s[i * d..][..d], o)
        });
        out.write(&ys);
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn aclnnRotaryPositionEmbeddingGetWorkspaceSize(
    x: *const aclTensor,
    cos: *const aclTensor,
    sin: *const aclTensor,
    mode: i64,
    out: *mut aclTensor,
    workspace_size: Ws,
    executor: Ex,
) -> aclnnStatus {
    let op = "aclnnRotaryPositionEmbedding";
    phase1(op, workspace_size, executor, |p| {
        let x = p.input(x, "x")?;
        let tables = (p.input(cos, "cos")?, p.input(sin, "sin")?);
        let o = p.output(out, "out")?;
        let tables = rotary_args(p, (&x, "x"), tables, mode, &o)?;
        let d = x.last();
        // y = x·cos + rotate(x)·sin
        let kernel = rotary_kernel(x, tables, o, move |row, c, s, y| {
            for j in 0..d {
                let (partner, sign) = rotation_partner(mode, d, j);
                y[j] = row[j] * c[j] + sign * row[partner] * s[j];
            }
        });
        Ok((0, kernel))
    })
}

#[no_mangle]
pub extern "C" fn aclnnRotaryPositionEmbeddingGradGetWorkspaceSize(
    dy: *const aclTensor,
    cos: *const aclTensor,
    sin: *const aclTensor,
    x_optional: *const aclTensor,
    mode: i64,
    dx_out: *const aclTensor,
    dcos_out: *const aclTensor,
    dsin_out: *const aclTensor,
    workspace_size: Ws,
    executor: Ex,
) -> aclnnStatus {
    let op = "aclnnRotaryPositionEmbeddingGrad";
    phase1(op, workspace_size, executor, |p| {
        let dy = p.input(dy, "dy")?;
        let (cos, sin) = (p.input(cos, "cos")?, p.input(sin, "sin")?);
        // Without x the tables' gradients are not computed (op-plugin still passes outputs
        // of the tables' shapes); the stand-in computes dx only.
        p.absent(x_optional, "xOptional")?;
        for (t, like, name) in [(dcos_out, &cos, "dcosOut"), (dsin_out, &sin, "dsinOut")] {
            if let Some(v) = p.opt_output(t, name)? {
                p.like(&v, name, like)?;
            }
        }
        let dx = p.output(dx_out, "dxOut")?;
        let tables = rotary_args(p, (&dy, "dy"), (cos, sin), mode, &dx)?;
        let d = dy.last();
        // dx_j = cos_j·dy_j − sign_j·sin_k·dy_k for j's partner k (the transposed rotation)
        let kernel = rotary_kernel(dy, tables, dx, move |g, c, s, dx| {
            for j in 0..d {
                let (partner, sign) = rotation_partner(mode, d, j);
                dx[j] = c[j] * g[j] - sign * s[partner] * g[partner];
            }
        });
        Ok((0, kernel))
    })
}

/// The indices' rows of `table [V, H]` into `out`, an index outside `[0, V)` a launch error.
fn gather(table: View, index: View, out: View) -> Kernel {
    Box::new(move || {
        let rows = table.dims[0];
        let mut values = Vec::with_capacity(out.numel());
        for (i, id) in index.read_int().into_iter().enumerate() {
            values.extend(table.row(checked_index(id, i, rows)?).read());
        }
        out.write(&values);
        Ok(())
    })
}

/// Checks shared by the gathers: a 2-D table and integer indices.
fn gather_args(
    p: &Plan,
    table: &View,
    name: &str,
    index: &View,
    index_name: &str,
) -> Result<(), aclnnStatus> {
    ensure!(p, table.rank() == 2, "{name} {:?} is not 2-D", table.dims);
    p.index(index, index_name)
}

#[no_mangle]
pub extern "C" fn aclnnEmbeddingGetWorkspaceSize(
    weight: *const aclTensor,
    indices: *const aclTensor,
    out: *const aclTensor,
    workspace_size: Ws,
    executor: Ex,
) -> aclnnStatus {
    phase1("aclnnEmbedding", workspace_size, executor, |p| {
        let w = p.input(weight, "weight")?;
        let ids = p.input(indices, "indices")?;
        let o = p.output(out, "out")?;
        gather_args(p, &w, "weight", &ids, "indices")?;
        p.float(&w, "weight")?;
        p.dtype(&o, "out", w.dtype)?;
        let h = w.dims[1];
        let full: Vec<usize> = ids.dims.iter().copied().chain([h]).collect();
        ensure!(
            p,
            o.dims == full || o.dims == [ids.numel(), h],
            "out {:?} should be {full:?} or {:?}",
            o.dims,
            [ids.numel(), h]
        );
        Ok((0, gather(w, ids, o)))
    })
}

#[no_mangle]
pub extern "C" fn aclnnIndexSelectGetWorkspaceSize(
    self_: *const aclTensor,
    dim: i64,
    index: *const aclTensor,
    out: *mut aclTensor,
    workspace_size: Ws,
    executor: Ex,
) -> aclnnStatus {
    phase1("aclnnIndexSelect", workspace_size, executor, |p| {
        let x = p.input(self_, "self")?;
        let ids = p.input(index, "index")?;
        let o = p.output(out, "out")?;
        gather_args(p, &x, "self", &ids, "index")?;
        ensure!(
            p,
            dim == 0 || dim == -2,
            "dim {dim}: the stand-in selects rows (dim 0) only"
        );
        ensure!(p, ids.rank() == 1, "index {:?} is not 1-D", ids.dims);
        p.shape(&o, "out", &[ids.numel(), x.dims[1]])?;
        p.dtype(&o, "out", x.dtype)?;
        Ok((0, gather(x, ids, o)))
    })
}

#[no_mangle]
pub extern "C" fn aclnnEmbeddingDenseBackwardGetWorkspaceSize(
    grad: *const aclTensor,
    indices: *const aclTensor,
    num_weights: u64,
    padding_idx: u64,
    scale_grad_by_freq: bool,
    out: *const aclTensor,
    workspace_size: Ws,
    executor: Ex,
) -> aclnnStatus {
    phase1(
        "aclnnEmbeddingDenseBackward",
        workspace_size,
        executor,
        |p| {
            let g = p.input(grad, "grad")?;
            let ids = p.input(indices, "indices")?;
            let o = p.output(out, "out")?;
            ensure!(
                p,
                !scale_grad_by_freq,
                "scaleGradByFreq is not supported by the stand-in"
            );
            p.float(&g, "grad")?;
            p.index(&ids, "indices")?;
            let h = g.last();
            ensure!(
                p,
                g.rank() == 2 && g.dims[0] == ids.numel(),
                "grad {:?} is not [{}, H] for indices {:?}",
                g.dims,
                ids.numel(),
                ids.dims
            );
            p.shape(&o, "out", &[num_weights as usize, h])?;
            p.dtype(&o, "out", g.dtype)?;
            let kernel: Kernel = Box::new(move || {
                let (gs, rows) = (g.read(), o.dims[0]);
                let mut table = vec![0f32; rows * h];
                for (i, id) in ids.read_int().into_iter().enumerate() {
                    let row = checked_index(id, i, rows)?;
                    if row as u64 == padding_idx {
                        continue;
                    }
                    let dst = &mut table[row * h..][..h];
                    dst.iter_mut()
                        .zip(&gs[i * h..][..h])
                        .for_each(|(t, g)| *t += g);
                }
                o.write(&table);
                Ok(())
            });
            Ok((HEAVY, kernel))
        },
    )
}
