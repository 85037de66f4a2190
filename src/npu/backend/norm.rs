//! LayerNorm on aclnnLayerNorm and aclnnLayerNormBackward (ops-nn norm/layer_norm_v4,
//! layer_norm_grad_v3), γ and β taken in f32 (the operators take FLOAT weights beside any
//! input dtype), the rows' means and rstds in one `[2n]` f32 tensor as the host's
//! ([`crate::engine::layer_norm`]), which runs instead where CANN lacks either operator or its
//! kernel (named once in a warning).

use super::{check, DType, Npu, NpuTensor, Result};
use crate::engine::layer_norm;

impl Npu {
    /// [`crate::engine::Backend::layer_norm`].
    pub(super) fn layer_norm_on(
        &self,
        x: &NpuTensor,
        (gamma, beta): (&NpuTensor, &NpuTensor),
        eps: f64,
    ) -> Result<(NpuTensor, NpuTensor)> {
        let n = check::layer_norm(self, x, gamma, beta)?;
        let op = self.ctx.op;
        let (Some(prepare), Some(launch)) = (op.aclnnLayerNormGetWorkspaceSize, op.aclnnLayerNorm)
        else {
            return layer_norm::forward(self, x, (gamma, beta), eps);
        };
        if self.layer_norm.absent() {
            return layer_norm::forward(self, x, (gamma, beta), eps);
        }
        let h = x.cols();
        let (g, b) = (
            self.as_dtype(gamma, DType::F32)?,
            self.as_dtype(beta, DType::F32)?,
        );
        let (y, stats) = (
            self.empty(&x.shape, x.dtype)?,
            self.empty(&[2 * n], DType::F32)?,
        );
        let c = &self.ctx;
        let shape = c.int_array(&[h as i64])?;
        let (xd, yd) = (
            c.tensor(&x.view().reshaped(&[n, h], 0))?,
            c.tensor(&y.view().reshaped(&[n, h], 0))?,
        );
        let (gd, bd) = (c.tensor(&g.view())?, c.tensor(&b.view())?);
        let (md, rd) = (
            c.tensor(&stats.view().reshaped(&[n, 1], 0))?,
            c.tensor(&stats.view().reshaped(&[n, 1], n))?,
        );
        let done = c.run(
            "aclnnLayerNorm",
            // SAFETY: the descriptors outlive the launch; ws and ex are valid out-pointers.
            |ws, ex| unsafe {
                prepare(
                    xd.raw, shape.raw, gd.raw, bd.raw, eps, yd.raw, md.raw, rd.raw, ws, ex,
                )
            },
            launch,
        );
        drop((xd, yd, gd, bd, md, rd, shape));
        if !self.layer_norm.outcome("aclnnLayerNorm", done)? {
            return layer_norm::forward(self, x, (gamma, beta), eps);
        }
        Ok((y, stats))
    }

    /// [`crate::engine::Backend::layer_norm_bwd`]: dx, and the f32 dγ, dβ added into whichever
    /// is trained.
    pub(super) fn layer_norm_bwd_on(
        &self,
        (dy, x): (&NpuTensor, &NpuTensor),
        gamma: &NpuTensor,
        stats: &NpuTensor,
        (dgamma, dbeta): (Option<&mut NpuTensor>, Option<&mut NpuTensor>),
    ) -> Result<NpuTensor> {
        let n = check::layer_norm_bwd(self, (dy, x, stats), gamma)?;
        let (op, nn) = (self.ctx.op, self.ctx.nn);
        let fns = (
            op.aclnnLayerNormBackwardGetWorkspaceSize,
            op.aclnnLayerNormBackward,
            nn.aclCreateBoolArray,
            nn.aclDestroyBoolArray,
        );
        let (Some(prepare), Some(launch), Some(create), Some(destroy)) = fns else {
            return layer_norm::backward(self, (dy, x), gamma, stats, (dgamma, dbeta));
        };
        if self.layer_norm_grad.absent() {
            return layer_norm::backward(self, (dy, x), gamma, stats, (dgamma, dbeta));
        }
        let h = x.cols();
        let (g, d) = (
            self.as_dtype(gamma, DType::F32)?,
            self.as_dtype(dy, x.dtype)?,
        );
        let dx = self.empty(&x.shape, x.dtype)?;
        let (dg, db) = (self.empty(&[h], DType::F32)?, self.empty(&[h], DType::F32)?);
        let mask = [true, dgamma.is_some(), dbeta.is_some()];
        let c = &self.ctx;
        let (shape, masks) = (
            c.int_array(&[h as i64])?,
            c.bool_array(&mask, create, destroy)?,
        );
        let rows = |t: &NpuTensor| t.view().reshaped(&[n, h], 0);
        let (dyd, xd, dxd) = (
            c.tensor(&rows(&d))?,
            c.tensor(&rows(x))?,
            c.tensor(&rows(&dx))?,
        );
        let (md, rd) = (
            c.tensor(&stats.view().reshaped(&[n, 1], 0))?,
            c.tensor(&stats.view().reshaped(&[n, 1], n))?,
        );
        let (gd, dgd, dbd) = (
            c.tensor(&g.view())?,
            c.tensor(&dg.view())?,
            c.tensor(&db.view())?,
        );
        let or_null = |on: bool, raw| if on { raw } else { std::ptr::null_mut() };
        let (dg_out, db_out) = (or_null(mask[1], dgd.raw), or_null(mask[2], dbd.raw));
        let none = std::ptr::null();
        let done = c.run(
            "aclnnLayerNormBackward",
            // SAFETY: the descriptors outlive the launch; ws and ex are valid out-pointers.
            |ws, ex| unsafe {
                prepare(
                    dyd.raw, xd.raw, shape.raw, md.raw, rd.raw, gd.raw, none, masks.raw, dxd.raw,
                    dg_out, db_out, ws, ex,
                )
            },
            launch,
        );
        drop((dyd, xd, dxd, md, rd, gd, dgd, dbd, shape, masks));
        if !self
            .layer_norm_grad
            .outcome("aclnnLayerNormBackward", done)?
        {
            return layer_norm::backward(self, (dy, x), gamma, stats, (dgamma, dbeta));
        }
        for (grad, part) in [(dgamma, &dg), (dbeta, &db)] {
            if let Some(grad) = grad {
                self.add_view(&grad.view().reshaped(&[h], 0), &part.view())?;
            }
        }
        Ok(dx)
    }
}
