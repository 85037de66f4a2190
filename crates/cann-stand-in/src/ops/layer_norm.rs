//! LayerNorm and its backward (aclnnLayerNorm, aclnnLayerNormBackward, ops-nn's
//! norm/layer_norm_v4 and layer_norm_grad_v3): over the last dimension only, the only
//! normalised shape the stand-in supports; mean and rstd FLOAT.

use super::{by_rows, Ex, Ws};
use crate::aclnn::{ensure, phase1, Kernel, Plan};
use crate::view::View;
use ascendcl_sys::aclnn::{aclBoolArray, aclIntArray, aclTensor, aclnnStatus};
use ascendcl_sys::ACL_FLOAT;

/// The shared checks: `input` float with `normalizedShape` its last dimension, `weight` (and
/// `bias`) of that width in its dtype or FLOAT, `mean` and `rstd` FLOAT `[rows]` or `[rows, 1]`.
fn args(
    p: &Plan,
    (input, shape): (&View, &[i64]),
    (weight, bias): (&View, Option<&View>),
    (mean, rstd): (&View, &View),
) -> Result<(), aclnnStatus> {
    p.float(input, "input")?;
    ensure!(
        p,
        input.rank() > 0 && shape == [input.last() as i64],
        "normalizedShape {shape:?} must be input's last dimension [{}] (the only one the stand-in supports)",
        input.last()
    );
    for (v, name) in [(Some(weight), "weight"), (bias, "bias")] {
        let Some(v) = v else { continue };
        p.shape(v, name, &[input.last()])?;
        ensure!(
            p,
            v.dtype == input.dtype || v.dtype == ACL_FLOAT,
            "{name} is neither input's dtype nor FLOAT"
        );
    }
    let with_one: Vec<usize> = input.leading().iter().copied().chain([1]).collect();
    for (v, name) in [(mean, "mean"), (rstd, "rstd")] {
        p.dtype(v, name, ACL_FLOAT)?;
        ensure!(
            p,
            v.dims == input.leading() || v.dims == with_one,
            "{name} {:?} should be {:?} or {with_one:?}",
            v.dims,
            input.leading()
        );
    }
    Ok(())
}

#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn aclnnLayerNormGetWorkspaceSize(
    input: *const aclTensor,
    normalized_shape: *const aclIntArray,
    weight_optional: *const aclTensor,
    bias_optional: *const aclTensor,
    eps: f64,
    out: *mut aclTensor,
    mean_out_optional: *mut aclTensor,
    rstd_out_optional: *mut aclTensor,
    workspace_size: Ws,
    executor: Ex,
) -> aclnnStatus {
    phase1("aclnnLayerNorm", workspace_size, executor, |p| {
        let x = p.input(input, "input")?;
        let shape = p.int_array(normalized_shape, "normalizedShape")?;
        let weight = p.input(weight_optional, "weightOptional (required by the stand-in)")?;
        let bias = p.opt_input(bias_optional, "biasOptional")?;
        let y = p.output(out, "out")?;
        let mean = p.output(
            mean_out_optional,
            "meanOutOptional (required by the stand-in)",
        )?;
        let rstd = p.output(
            rstd_out_optional,
            "rstdOutOptional (required by the stand-in)",
        )?;
        args(p, (&x, &shape), (&weight, bias.as_ref()), (&mean, &rstd))?;
        p.like(&y, "out", &x)?;
        let eps = eps as f32;
        let kernel: Kernel = Box::new(move || {
            let (xs, g, h) = (x.read(), weight.read(), x.last());
            let b = bias.as_ref().map_or_else(|| vec![0.0; h], View::read);
            let (mut means, mut rstds) = (Vec::new(), Vec::new());
            let ys = by_rows(&xs, h, h, |_, row, out| {
                let m = row.iter().sum::<f32>() / h as f32;
                let var = row.iter().map(|v| (v - m) * (v - m)).sum::<f32>() / h as f32;
                let r = 1.0 / (var + eps).sqrt();
                means.push(m);
                rstds.push(r);
                for (j, o) in out.iter_mut().enumerate() {
                    *o = (row[j] - m) * r * g[j] + b[j];
                }
            });
            y.write(&ys);
            mean.write(&means);
            rstd.write(&rstds);
            Ok(())
        });
        Ok((0, kernel))
    })
}

#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn aclnnLayerNormBackwardGetWorkspaceSize(
    grad_out: *const aclTensor,
    input: *const aclTensor,
    normalized_shape: *const aclIntArray,
    mean: *const aclTensor,
    rstd: *const aclTensor,
    weight_optional: *const aclTensor,
    bias_optional: *const aclTensor,
    output_mask: *const aclBoolArray,
    grad_input_out: *mut aclTensor,
    grad_weight_out: *mut aclTensor,
    grad_bias_out: *mut aclTensor,
    workspace_size: Ws,
    executor: Ex,
) -> aclnnStatus {
    phase1("aclnnLayerNormBackward", workspace_size, executor, |p| {
        let dy = p.input(grad_out, "gradOut")?;
        let x = p.input(input, "input")?;
        let shape = p.int_array(normalized_shape, "normalizedShape")?;
        let (mean, rstd) = (p.input(mean, "mean")?, p.input(rstd, "rstd")?);
        let weight = p.input(weight_optional, "weightOptional (required by the stand-in)")?;
        let bias = p.opt_input(bias_optional, "biasOptional")?;
        let mask = p.bool_array(output_mask, "outputMask")?;
        ensure!(
            p,
            mask.len() == 3,
            "outputMask has {} values, not 3",
            mask.len()
        );
        args(p, (&x, &shape), (&weight, bias.as_ref()), (&mean, &rstd))?;
        p.like(&dy, "gradOut", &x)?;
        let mut out = |on: bool, t: *mut aclTensor, name: &str, like: &View| {
            if !on {
                return Ok(None);
            }
            let v = p.output(t, name)?;
            p.like(&v, name, like)?;
            Ok::<_, aclnnStatus>(Some(v))
        };
        let dx = out(mask[0], grad_input_out, "gradInputOut", &x)?;
        let dw = out(mask[1], grad_weight_out, "gradWeightOut", &weight)?;
        let db = out(mask[2], grad_bias_out, "gradBiasOut", &weight)?;
        let kernel: Kernel = Box::new(move || {
            let (dys, xs, g, h) = (dy.read(), x.read(), weight.read(), x.last());
            let (ms, rs) = (mean.read(), rstd.read());
            let (mut dg, mut dbias) = (vec![0f32; h], vec![0f32; h]);
            let dxs = by_rows(&xs, h, h, |i, row, o| {
                let (m, r, d) = (ms[i], rs[i], &dys[i * h..][..h]);
                let xhat: Vec<f32> = row.iter().map(|v| (v - m) * r).collect();
                let gd: Vec<f32> = d.iter().zip(&g).map(|(d, g)| d * g).collect();
                let mean_g = gd.iter().sum::<f32>() / h as f32;
                let mean_gx = gd.iter().zip(&xhat).map(|(a, b)| a * b).sum::<f32>() / h as f32;
                for j in 0..h {
                    o[j] = r * (gd[j] - mean_g - xhat[j] * mean_gx);
                    dg[j] += d[j] * xhat[j];
                    dbias[j] += d[j];
                }
            });
            let outs = [(&dx, dxs), (&dw, dg), (&db, dbias)];
            for (v, values) in outs {
                if let Some(v) = v {
                    v.write(&values);
                }
            }
            Ok(())
        });
        Ok((0, kernel))
    })
}
