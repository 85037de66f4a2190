//! The LLaMA-family decoder for training: one micro-batch's forward pass, keeping what the
//! backward pass needs, and the backward pass in exactly the reverse order (as llm.c writes
//! `gpt2_forward` / `gpt2_backward`), over the engine's [`Backend`] operators.
//!
//! Legend: T = rows (tokens of the micro-batch, sequence after sequence), h = hidden,
//! qw = heads·d, kw = groups·d, F = ffn, Vp = padded vocabulary. Parameters and gradients are
//! indexed by the [`ParamTable`]; gradients are f32 and **accumulate** across micro-batches.

use super::params::ParamTable;
use super::ModelSpec;
use crate::ckpt::torch::pickle::DType;
use crate::ckpt::transform::{Canon, Role};
use crate::engine::{Backend, Result};
use std::ops::Range;

/// Where each parameter of a layer sits in the table.
#[derive(Debug, Clone, Copy)]
struct LayerIds {
    input_norm: usize,
    qkv: usize,
    qkv_bias: Option<usize>,
    proj: usize,
    proj_bias: Option<usize>,
    post_norm: usize,
    fc1: usize,
    fc2: usize,
}

/// Where every parameter sits in the table.
#[derive(Debug, Clone)]
pub struct Ids {
    embedding: usize,
    layers: Vec<LayerIds>,
    final_norm: usize,
    /// `None` when the output layer is the embedding.
    output: Option<usize>,
}

impl Ids {
    /// Look every parameter of a model of `layers` layers up in `table`.
    pub fn new(table: &ParamTable, layers: usize) -> Option<Ids> {
        let at = |role, layer| table.index(Canon { role, layer });
        let mut ids = Vec::with_capacity(layers);
        for l in 0..layers {
            let layer = Some(l);
            ids.push(LayerIds {
                input_norm: at(Role::InputNorm, layer)?,
                qkv: at(Role::Qkv, layer)?,
                qkv_bias: at(Role::QkvBias, layer),
                proj: at(Role::Proj, layer)?,
                proj_bias: at(Role::ProjBias, layer),
                post_norm: at(Role::PostNorm, layer)?,
                fc1: at(Role::Fc1, layer)?,
                fc2: at(Role::Fc2, layer)?,
            });
        }
        Some(Ids {
            embedding: at(Role::Embedding, None)?,
            layers: ids,
            final_norm: at(Role::FinalNorm, None)?,
            output: at(Role::Output, None),
        })
    }

    fn output(&self) -> usize {
        self.output.unwrap_or(self.embedding)
    }
}

/// One micro-batch.
#[derive(Debug, Clone)]
pub struct MicroBatch {
    /// `[T]` input ids.
    pub tokens: Vec<u32>,
    /// `[T]` target ids.
    pub labels: Vec<u32>,
    /// `[T]` the gradient of the objective with respect to each row's loss (Megatron's
    /// `mask / max(n, 1) / K`, or the mask itself with per-token loss).
    pub dloss: Vec<f32>,
    /// Attention segments (row ranges covering `0..T`): each sequence, or each document of it
    /// with `--reset-attention-mask`.
    pub segments: Vec<Range<usize>>,
    /// `[T]` RoPE position of each row (0..S per sequence: Megatron's RoPE does not read
    /// `position_ids`).
    pub positions: Vec<usize>,
}

/// What one layer's backward pass needs of its forward pass.
struct LayerSaved<T> {
    /// Layer input (residual) `[T, h]`, and its normed form `[T, h]` with `rstd [T]`.
    x: T,
    h1: T,
    rstd1: T,
    /// Rotated queries and keys, values.
    q: T,
    k: T,
    v: T,
    /// Attention output `[T, qw]` and log-sum-exp `[T, heads]`.
    o: T,
    lse: T,
    /// Residual after attention `[T, h]`, its normed form, rstd.
    x_mid: T,
    h2: T,
    rstd2: T,
    /// fc1 output `[T, 2F]` and the SwiGLU `[T, F]`.
    up: T,
    act: T,
}

/// A micro-batch's forward pass: its per-row losses and what the backward pass needs.
pub struct Forward<T> {
    /// `[T]` per-row losses (f32, on the host).
    pub losses: Vec<f32>,
    layers: Vec<LayerSaved<T>>,
    /// Final norm input `[T, h]`, its normed form and rstd.
    x: T,
    hf: T,
    rstdf: T,
    /// Logits `[T, Vp]` and their log-sum-exp `[T]`.
    logits: T,
    lse: T,
    /// RoPE tables of the micro-batch.
    cos: T,
    sin: T,
}

/// Run one micro-batch forward, keeping what [`backward`] needs.
pub fn forward<B: Backend>(
    b: &B,
    spec: &ModelSpec,
    ids: &Ids,
    params: &[B::Tensor],
    batch: &MicroBatch,
    activations: DType,
) -> Result<Forward<B::Tensor>> {
    let t = batch.tokens.len();
    let shape = spec.attention;
    let (cos, sin) = spec.rope_tables(&batch.positions);
    let half = [t, shape.head_dim / 2];
    let (cos, sin) = (b.upload_f32(&half, &cos)?, b.upload_f32(&half, &sin)?);
    let eps = spec.norm_eps;
    let mut x = b.embedding(&params[ids.embedding], &batch.tokens)?;
    if activations != DType::F32 {
        x = b.cast(&x, activations)?;
    }
    let mut layers = Vec::with_capacity(ids.layers.len());
    for l in &ids.layers {
        let (h1, rstd1) = b.rms_norm(&x, &params[l.input_norm], eps)?;
        let qkv = b.matmul(&h1, &params[l.qkv], l.qkv_bias.map(|i| &params[i]))?;
        let (mut q, mut k, v) = b.split_qkv(&qkv, shape)?;
        b.rope(&mut q, &cos, &sin, false)?;
        b.rope(&mut k, &cos, &sin, false)?;
        let (o, lse) = b.attention(&q, &k, &v, &batch.segments, shape)?;
        let mut x_mid = b.matmul(&o, &params[l.proj], l.proj_bias.map(|i| &params[i]))?;
        b.add_assign(&mut x_mid, &x)?;
        let (h2, rstd2) = b.rms_norm(&x_mid, &params[l.post_norm], eps)?;
        let up = b.matmul(&h2, &params[l.fc1], None)?;
        let act = b.swiglu(&up)?;
        let mut out = b.matmul(&act, &params[l.fc2], None)?;
        b.add_assign(&mut out, &x_mid)?;
        layers.push(LayerSaved {
            x: std::mem::replace(&mut x, out),
            h1,
            rstd1,
            q,
            k,
            v,
            o,
            lse,
            x_mid,
            h2,
            rstd2,
            up,
            act,
        });
    }
    let (hf, rstdf) = b.rms_norm(&x, &params[ids.final_norm], eps)?;
    let logits = b.matmul(&hf, &params[ids.output()], None)?;
    let (loss, lse) = b.cross_entropy(&logits, &batch.labels)?;
    Ok(Forward {
        losses: b.download_f32(&loss)?,
        layers,
        x,
        hf,
        rstdf,
        logits,
        lse,
        cos,
        sin,
    })
}

/// The backward pass of [`forward`] in reverse order, for the objective `Σ dloss · loss`:
/// adds every parameter's gradient into `grads`.
pub fn backward<B: Backend>(
    b: &B,
    spec: &ModelSpec,
    ids: &Ids,
    params: &[B::Tensor],
    grads: &mut [B::Tensor],
    batch: &MicroBatch,
    fwd: Forward<B::Tensor>,
) -> Result<()> {
    let shape = spec.attention;
    let Forward {
        layers,
        x,
        hf,
        rstdf,
        logits,
        lse,
        cos,
        sin,
        ..
    } = fwd;
    let dloss = b.upload_f32(&[batch.tokens.len()], &batch.dloss)?;
    let dlogits = b.cross_entropy_bwd(logits, &batch.labels, &lse, &dloss)?;
    let dhf = matmul_grad(b, &dlogits, &hf, params, grads, ids.output(), None)?;
    drop(dlogits);
    let mut dx = rms_grad(b, &dhf, &x, params, grads, ids.final_norm, &rstdf)?;
    for (l, s) in ids.layers.iter().zip(layers).rev() {
        // out = x_mid + fc2(swiglu(fc1(norm(x_mid)))): dx flows to both.
        let dact = matmul_grad(b, &dx, &s.act, params, grads, l.fc2, None)?;
        let dup = b.swiglu_bwd(&dact, &s.up)?;
        let dh2 = matmul_grad(b, &dup, &s.h2, params, grads, l.fc1, None)?;
        let mut dx_mid = rms_grad(b, &dh2, &s.x_mid, params, grads, l.post_norm, &s.rstd2)?;
        b.add_assign(&mut dx_mid, &dx)?;
        // x_mid = x + proj(attention(rope(q), rope(k), v)), (q, k, v) = split(qkv(norm(x))).
        let d_o = matmul_grad(b, &dx_mid, &s.o, params, grads, l.proj, l.proj_bias)?;
        let (mut dq, mut dk, dv) =
            b.attention_bwd(&d_o, &s.q, &s.k, &s.v, &s.o, &s.lse, &batch.segments, shape)?;
        b.rope(&mut dq, &cos, &sin, true)?;
        b.rope(&mut dk, &cos, &sin, true)?;
        let dqkv = b.merge_qkv(&dq, &dk, &dv, shape)?;
        let dh1 = matmul_grad(b, &dqkv, &s.h1, params, grads, l.qkv, l.qkv_bias)?;
        dx = rms_grad(b, &dh1, &s.x, params, grads, l.input_norm, &s.rstd1)?;
        b.add_assign(&mut dx, &dx_mid)?;
    }
    b.embedding_bwd(&dx, &batch.tokens, &mut grads[ids.embedding])
}

/// `dx` of `y = x·W[w]ᵀ (+ bias)`, accumulating the weight's (and bias's) gradient.
fn matmul_grad<B: Backend>(
    b: &B,
    dy: &B::Tensor,
    x: &B::Tensor,
    params: &[B::Tensor],
    grads: &mut [B::Tensor],
    w: usize,
    bias: Option<usize>,
) -> Result<B::Tensor> {
    match bias {
        None => b.matmul_bwd(dy, x, &params[w], &mut grads[w], None),
        Some(bi) => {
            let (dw, db) = two_mut(grads, w, bi);
            b.matmul_bwd(dy, x, &params[w], dw, Some(db))
        }
    }
}

/// `dx` of `y = rms_norm(x)·γ[g]`, accumulating γ's gradient.
fn rms_grad<B: Backend>(
    b: &B,
    dy: &B::Tensor,
    x: &B::Tensor,
    params: &[B::Tensor],
    grads: &mut [B::Tensor],
    g: usize,
    rstd: &B::Tensor,
) -> Result<B::Tensor> {
    b.rms_norm_bwd(dy, x, &params[g], rstd, &mut grads[g])
}

/// Two distinct elements of a slice, mutably.
fn two_mut<T>(v: &mut [T], i: usize, j: usize) -> (&mut T, &mut T) {
    assert_ne!(i, j, "internal: one gradient taken twice");
    if i < j {
        let (a, b) = v.split_at_mut(j);
        (&mut a[i], &mut b[0])
    } else {
        let (a, b) = v.split_at_mut(i);
        (&mut b[0], &mut a[j])
    }
}
