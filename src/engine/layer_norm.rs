//! LayerNorm (`--normalization LayerNorm`; Phi-3.5-MoE's `nn.LayerNorm`) on the host: the
//! default [`super::Backend::layer_norm`] and [`super::Backend::layer_norm_bwd`] (the CPU's,
//! and the NPU's where CANN lacks aclnnLayerNorm or its backward): the rows read back,
//! normalised in f32 ([`super::cpu::norm`], as `torch.nn.LayerNorm` computes a bf16 input)
//! and written back in the input's dtype. A model normalises `[T, h]` once before each
//! attention and MLP, small beside their products.

use super::cpu::norm;
use super::{check, Backend, Result};

/// [`super::Backend::layer_norm`] on the host.
pub fn forward<B: Backend + ?Sized>(
    b: &B,
    x: &B::Tensor,
    (gamma, beta): (&B::Tensor, &B::Tensor),
    eps: f64,
) -> Result<(B::Tensor, B::Tensor)> {
    let n = check::layer_norm(b, x, gamma, beta)?;
    let (g, bt) = (b.download_f32(gamma)?, b.download_f32(beta)?);
    let mut y = vec![0f32; n * g.len()];
    let mut stats = vec![0f32; 2 * n];
    let (mean, rstd) = stats.split_at_mut(n);
    let xs = b.download_f32(x)?;
    norm::layer_norm_fwd(&xs, (&g, &bt), eps as f32, &mut y, (mean, rstd));
    let y = b.cast(&b.upload_f32(b.shape(x), &y)?, b.dtype(x))?;
    Ok((y, b.upload_f32(&[2 * n], &stats)?))
}

/// [`super::Backend::layer_norm_bwd`] on the host.
pub fn backward<B: Backend + ?Sized>(
    b: &B,
    (dy, x): (&B::Tensor, &B::Tensor),
    gamma: &B::Tensor,
    stats: &B::Tensor,
    (dgamma, dbeta): (Option<&mut B::Tensor>, Option<&mut B::Tensor>),
) -> Result<B::Tensor> {
    let n = check::layer_norm_bwd(b, (dy, x, stats), gamma)?;
    let g = b.download_f32(gamma)?;
    let (xs, dys, stats) = (
        b.download_f32(x)?,
        b.download_f32(dy)?,
        b.download_f32(stats)?,
    );
    let (mean, rstd) = stats.split_at(n);
    let mut dx = vec![0f32; xs.len()];
    let (mut dg, mut db) = (vec![0f32; g.len()], vec![0f32; g.len()]);
    let parts = (
        dgamma.is_some().then_some(&mut dg[..]),
        dbeta.is_some().then_some(&mut db[..]),
    );
    norm::layer_norm_bwd((&dys, &xs), &g, (mean, rstd), &mut dx, parts);
    for (grad, part) in [(dgamma, dg), (dbeta, db)] {
        if let Some(grad) = grad {
            let part = b.cast(&b.upload_f32(b.shape(grad), &part)?, b.dtype(grad))?;
            b.add_assign(grad, &part)?;
        }
    }
    b.cast(&b.upload_f32(b.shape(x), &dx)?, b.dtype(dy))
}
