//! The LLaMA-family decoder for training: one micro-batch's forward pass, keeping what the
//! backward pass needs, and the backward pass in exactly the reverse order (as llm.c writes
//! `gpt2_forward` / `gpt2_backward`), over the engine's [`Backend`] operators.
//!
//! Legend: T = rows (tokens of the micro-batch, sequence after sequence), h = hidden,
//! qw = heads·d, kw = groups·d, F = ffn, Vp = padded vocabulary. Parameters and gradients are
//! indexed by the [`ParamTable`]; gradients are f32 and **accumulate** across micro-batches.
//!
//! Under tensor parallelism each rank holds its shard of the parameters and runs this same
//! code on its heads, groups, FFN columns and vocabulary rows, with Megatron's collectives
//! (megatron-core megatron/core/tensor_parallel/layers.py, mappings.py, cross_entropy.py):
//! the row-parallel outputs (linear_proj, linear_fc2) and the vocabulary-parallel embedding
//! are all-reduced in the forward pass, the column-parallel inputs' gradients (linear_qkv,
//! linear_fc1, the output layer) in the backward pass, and the cross entropy reduces its
//! maximum, target logit and Σexp over the vocabulary shards. With sequence parallelism the
//! residual stream and the norms hold this rank's rows only: the sums become reduce-scatters,
//! and the column-parallel layers' inputs and the row-parallel layers' output gradients are
//! all-gathered (the inputs again in the backward pass, as Megatron re-gathers them for the
//! weight gradients rather than keep them).
//!
//! A pipeline stage runs the same code on its layers: the first from the embedding, the others
//! from the previous stage's output; the last to the loss, the others to their output, whose
//! gradient the backward pass then takes from the next stage.

use super::params::{LoraPart, ParamTable};
use super::ModelSpec;
use crate::arch::roles::{Canon, Role};
use crate::ckpt::transform::is_row_parallel;
use crate::engine::comm::{Communicator, ReduceOp};
use crate::engine::{Backend, EngineError, Result, NO_ROW};
use crate::tensor::DType;
use std::ops::Range;

/// One rank's place in tensor parallelism.
pub struct TensorParallel<'a, T> {
    /// The tensor-parallel group.
    pub group: &'a dyn Communicator<Tensor = T>,
    /// The vocabulary rows this rank's embedding and output shards hold.
    pub vocab: Range<usize>,
    /// Sequence parallelism: the residual stream holds this rank's block of rows.
    pub sequence_parallel: bool,
}

impl<T> TensorParallel<'_, T> {
    /// Ids (tokens or labels) as rows of this rank's vocabulary shard, [`NO_ROW`] for the
    /// others'.
    fn local(&self, ids: &[u32]) -> Vec<u32> {
        let v = &self.vocab;
        ids.iter()
            .map(|&id| {
                let id = id as usize;
                if v.contains(&id) {
                    (id - v.start) as u32
                } else {
                    NO_ROW
                }
            })
            .collect()
    }
}

/// Partial sums over the tensor-parallel ranks (a row-parallel layer's output, the
/// embedding's rows, a column-parallel layer's input gradient), summed: all-reduced, or under
/// sequence parallelism reduce-scattered to this rank's rows (nothing alone).
fn reduced<B: Backend>(
    b: &B,
    tp: Option<&TensorParallel<B::Tensor>>,
    mut x: B::Tensor,
) -> Result<B::Tensor> {
    match tp {
        None => Ok(x),
        Some(tp) if !tp.sequence_parallel => {
            tp.group.all_reduce(&mut x, ReduceOp::Sum)?;
            Ok(x)
        }
        Some(tp) => {
            let mut out = zeros_of_rows(b, &x, b.shape(&x)[0] / tp.group.size())?;
            tp.group.reduce_scatter(&x, &mut out, ReduceOp::Sum)?;
            Ok(out)
        }
    }
}

/// Under sequence parallelism, every rank's rows of `x` (all-gather): a column-parallel
/// layer's input, a row-parallel layer's output gradient; `None` where `x` holds every row.
fn gathered<B: Backend>(
    b: &B,
    tp: Option<&TensorParallel<B::Tensor>>,
    x: &B::Tensor,
) -> Result<Option<B::Tensor>> {
    let Some(tp) = tp.filter(|tp| tp.sequence_parallel) else {
        return Ok(None);
    };
    let mut out = zeros_of_rows(b, x, b.shape(x)[0] * tp.group.size())?;
    tp.group.all_gather(x, &mut out)?;
    Ok(Some(out))
}

/// Zeros of `x`'s dtype and row width, `rows` rows.
fn zeros_of_rows<B: Backend>(b: &B, x: &B::Tensor, rows: usize) -> Result<B::Tensor> {
    let mut shape = b.shape(x).to_vec();
    shape[0] = rows;
    b.zeros(&shape, b.dtype(x))
}

/// A linear layer: its weight, bias and LoRA factors in the table.
#[derive(Debug, Clone, Copy)]
struct Linear {
    w: usize,
    bias: Option<usize>,
    /// `(A, B)` of its adapter.
    lora: Option<(usize, usize)>,
    /// Row-parallel (split on its input: linear_proj, linear_fc2), else column-parallel.
    row: bool,
}

/// Where each parameter of a layer sits in the table.
#[derive(Debug, Clone, Copy)]
struct LayerIds {
    input_norm: usize,
    qkv: Linear,
    proj: Linear,
    post_norm: usize,
    fc1: Linear,
    fc2: Linear,
}

/// Where every parameter of a model or pipeline stage sits in the table, and which are
/// trained.
#[derive(Debug, Clone)]
pub struct Ids {
    /// The input embedding (the first pipeline stage).
    embedding: Option<usize>,
    layers: Vec<LayerIds>,
    /// The final norm and output layer (the last stage; the output layer may be the
    /// embedding, or on a later stage than the first its copy).
    head: Option<(usize, usize)>,
    trainable: Vec<bool>,
    /// LoRA's alpha / r.
    lora_scale: f32,
}

impl Ids {
    /// Look up in `table` every parameter of a model or pipeline stage holding `layers`
    /// (`lora_scale`: the adapters' alpha / r, if any): the embedding unless a shared copy,
    /// the final norm with the output layer if there.
    pub fn new(table: &ParamTable, layers: Range<usize>, lora_scale: f32) -> Option<Ids> {
        let at = |role, layer| table.index(Canon { role, layer });
        let linear = |role, bias: Option<Role>, layer| {
            let canon = Canon { role, layer };
            Some(Linear {
                w: table.index(canon)?,
                bias: bias.and_then(|b| at(b, layer)),
                lora: table
                    .lora_index(canon, LoraPart::A)
                    .zip(table.lora_index(canon, LoraPart::B)),
                row: is_row_parallel(role),
            })
        };
        let mut ids = Vec::with_capacity(layers.len());
        for l in layers {
            let layer = Some(l);
            ids.push(LayerIds {
                input_norm: at(Role::InputNorm, layer)?,
                qkv: linear(Role::Qkv, Some(Role::QkvBias), layer)?,
                proj: linear(Role::Proj, Some(Role::ProjBias), layer)?,
                post_norm: at(Role::PostNorm, layer)?,
                fc1: linear(Role::Fc1, None, layer)?,
                fc2: linear(Role::Fc2, None, layer)?,
            });
        }
        let embedding = at(Role::Embedding, None);
        let head = match at(Role::FinalNorm, None) {
            Some(norm) => Some((norm, at(Role::Output, None).or(embedding)?)),
            None => None,
        };
        Some(Ids {
            embedding: embedding.filter(|&e| !table.params[e].shared),
            layers: ids,
            head,
            trainable: table.params.iter().map(|p| p.trainable).collect(),
            lora_scale,
        })
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
    /// `x·Aᵀ` `[T, r]` of each adapter (qkv, proj, fc1, fc2).
    lora: [Option<T>; 4],
}

/// What the final norm and output layer's backward pass needs.
struct HeadSaved<T> {
    /// Final norm input `[T, h]`, its normed form and rstd.
    x: T,
    hf: T,
    rstdf: T,
    /// Logits `[T, Vp]` and their log-sum-exp `[T]`.
    logits: T,
    lse: T,
}

/// A micro-batch's forward pass through a model or pipeline stage: what it hands on and what
/// the backward pass needs.
pub struct Forward<T> {
    /// With the output layer, the `[T]` per-row losses (f32), left on the device until the
    /// step reads them (with the gradient norm: one wait for the device per step); on an
    /// earlier pipeline stage its output `[T, h]` (this rank's rows under sequence
    /// parallelism) for the next stage.
    pub out: T,
    layers: Vec<LayerSaved<T>>,
    head: Option<HeadSaved<T>>,
    /// RoPE tables of the micro-batch.
    cos: T,
    sin: T,
}

/// Run one micro-batch forward through the model, or through a pipeline stage given the
/// previous stage's output as `input`, keeping what [`backward`] needs.
pub fn forward<B: Backend>(
    b: &B,
    spec: &ModelSpec,
    (ids, params): (&Ids, &[B::Tensor]),
    (batch, input): (&MicroBatch, Option<B::Tensor>),
    activations: DType,
    tp: Option<&TensorParallel<B::Tensor>>,
) -> Result<Forward<B::Tensor>> {
    let t = batch.tokens.len();
    let shape = spec.attention;
    let (cos, sin) = spec.rope_tables(&batch.positions);
    let half = [t, shape.head_dim / 2];
    let (cos, sin) = (b.upload_f32(&half, &cos)?, b.upload_f32(&half, &sin)?);
    let eps = spec.norm_eps;
    let mut x = match (input, ids.embedding) {
        (Some(x), _) => x,
        (None, Some(e)) => {
            let tokens = match tp {
                Some(tp) => tp.local(&batch.tokens),
                None => batch.tokens.clone(),
            };
            let mut x = b.embedding(&params[e], &tokens)?;
            if activations != DType::F32 {
                x = b.cast(&x, activations)?;
            }
            reduced(b, tp, x)?
        }
        (None, None) => {
            return Err(EngineError::Invalid {
                op: "forward",
                msg: "a pipeline stage without the embedding needs the previous stage's output"
                    .into(),
            })
        }
    };
    let mut layers = Vec::with_capacity(ids.layers.len());
    for l in &ids.layers {
        let (h1, rstd1) = b.rms_norm(&x, &params[l.input_norm], eps)?;
        let all = gathered(b, tp, &h1)?;
        let (qkv, u_qkv) = linear_fwd(
            b,
            all.as_ref().unwrap_or(&h1),
            l.qkv,
            (params, ids.lora_scale),
            tp,
        )?;
        let (mut q, mut k, v) = b.split_qkv(&qkv, shape)?;
        b.rope(&mut q, &cos, &sin, false)?;
        b.rope(&mut k, &cos, &sin, false)?;
        let (o, lse) = b.attention(&q, &k, &v, &batch.segments, shape)?;
        let (x_mid, u_proj) = linear_fwd(b, &o, l.proj, (params, ids.lora_scale), tp)?;
        let mut x_mid = reduced(b, tp, x_mid)?;
        b.add_assign(&mut x_mid, &x)?;
        let (h2, rstd2) = b.rms_norm(&x_mid, &params[l.post_norm], eps)?;
        let all = gathered(b, tp, &h2)?;
        let (up, u_fc1) = linear_fwd(
            b,
            all.as_ref().unwrap_or(&h2),
            l.fc1,
            (params, ids.lora_scale),
            tp,
        )?;
        let act = b.swiglu(&up)?;
        let (out, u_fc2) = linear_fwd(b, &act, l.fc2, (params, ids.lora_scale), tp)?;
        let mut out = reduced(b, tp, out)?;
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
            lora: [u_qkv, u_proj, u_fc1, u_fc2],
        });
    }
    let Some((final_norm, output)) = ids.head else {
        return Ok(Forward {
            out: x,
            layers,
            head: None,
            cos,
            sin,
        });
    };
    let (hf, rstdf) = b.rms_norm(&x, &params[final_norm], eps)?;
    let all = gathered(b, tp, &hf)?;
    let logits = b.matmul(all.as_ref().unwrap_or(&hf), &params[output], None)?;
    let (loss, lse) = match tp {
        Some(tp) => vocab_parallel_cross_entropy(b, tp, &logits, &tp.local(&batch.labels))?,
        None => b.cross_entropy(&logits, &batch.labels)?,
    };
    Ok(Forward {
        out: loss,
        layers,
        head: Some(HeadSaved {
            x,
            hf,
            rstdf,
            logits,
            lse,
        }),
        cos,
        sin,
    })
}

/// The gradient of the objective `Σ dloss · loss` with respect to the last layer's output:
/// through the cross entropy, the output layer and the final norm, whose gradients it adds.
fn head_backward<B: Backend>(
    b: &B,
    (ids, params, grads): (&Ids, &[B::Tensor], &mut [B::Tensor]),
    batch: &MicroBatch,
    head: HeadSaved<B::Tensor>,
    (final_norm, output): (usize, usize),
    tp: Option<&TensorParallel<B::Tensor>>,
) -> Result<B::Tensor> {
    let HeadSaved {
        x,
        hf,
        rstdf,
        logits,
        lse,
    } = head;
    let dloss = b.upload_f32(&[batch.tokens.len()], &batch.dloss)?;
    let labels = match tp {
        Some(tp) => tp.local(&batch.labels),
        None => batch.labels.clone(),
    };
    let dlogits = b.cross_entropy_bwd(logits, &labels, &lse, &dloss)?;
    let output = Linear {
        w: output,
        bias: None,
        lora: None,
        row: false,
    };
    let all = gathered(b, tp, &hf)?;
    let whole = all.as_ref().unwrap_or(&hf);
    let dhf = linear_bwd(
        b,
        &dlogits,
        (whole, None),
        output,
        (params, &mut *grads, ids),
        tp,
    )?;
    drop(dlogits);
    let dhf = reduced(b, tp, dhf)?;
    rms_grad(b, &dhf, &x, params, grads, ids, final_norm, &rstdf)
}

/// The backward pass of [`forward`] in reverse order, for the objective `Σ dloss · loss`, from
/// the loss (with the output layer) or from `dout`, the next pipeline stage's gradient of this
/// stage's output: adds every parameter's gradient into `grads`. Hands back the forward's
/// losses (which it does not read; on an earlier stage, its output) and, without the
/// embedding, the gradient of the stage's input for the previous stage.
pub fn backward<B: Backend>(
    b: &B,
    spec: &ModelSpec,
    (ids, params, grads): (&Ids, &[B::Tensor], &mut [B::Tensor]),
    (batch, dout): (&MicroBatch, Option<B::Tensor>),
    fwd: Forward<B::Tensor>,
    tp: Option<&TensorParallel<B::Tensor>>,
) -> Result<(B::Tensor, Option<B::Tensor>)> {
    let shape = spec.attention;
    let Forward {
        out,
        layers,
        head,
        cos,
        sin,
    } = fwd;
    let mut dx = match (head, ids.head, dout) {
        (Some(head), Some(at), _) => {
            head_backward(b, (ids, params, &mut *grads), batch, head, at, tp)?
        }
        (_, _, Some(dout)) => dout,
        _ => {
            return Err(EngineError::Invalid {
                op: "backward",
                msg: "a pipeline stage without the output layer needs the gradient of its output"
                    .into(),
            })
        }
    };
    for (l, s) in ids.layers.iter().zip(layers).rev() {
        let [u_qkv, u_proj, u_fc1, u_fc2] = &s.lora;
        // out = x_mid + fc2(swiglu(fc1(norm(x_mid)))): dx flows to both.
        let all = gathered(b, tp, &dx)?;
        let dy = all.as_ref().unwrap_or(&dx);
        let dact = linear_bwd(
            b,
            dy,
            (&s.act, u_fc2.as_ref()),
            l.fc2,
            (params, &mut *grads, ids),
            tp,
        )?;
        let dup = b.swiglu_bwd(&dact, &s.up)?;
        let all = gathered(b, tp, &s.h2)?;
        let h2 = all.as_ref().unwrap_or(&s.h2);
        let dh2 = linear_bwd(
            b,
            &dup,
            (h2, u_fc1.as_ref()),
            l.fc1,
            (params, &mut *grads, ids),
            tp,
        )?;
        let dh2 = reduced(b, tp, dh2)?;
        let mut dx_mid = rms_grad(b, &dh2, &s.x_mid, params, grads, ids, l.post_norm, &s.rstd2)?;
        b.add_assign(&mut dx_mid, &dx)?;
        // x_mid = x + proj(attention(rope(q), rope(k), v)), (q, k, v) = split(qkv(norm(x))).
        let all = gathered(b, tp, &dx_mid)?;
        let d_o = linear_bwd(
            b,
            all.as_ref().unwrap_or(&dx_mid),
            (&s.o, u_proj.as_ref()),
            l.proj,
            (params, &mut *grads, ids),
            tp,
        )?;
        let (mut dq, mut dk, dv) =
            b.attention_bwd(&d_o, &s.q, &s.k, &s.v, &s.o, &s.lse, &batch.segments, shape)?;
        b.rope(&mut dq, &cos, &sin, true)?;
        b.rope(&mut dk, &cos, &sin, true)?;
        let dqkv = b.merge_qkv(&dq, &dk, &dv, shape)?;
        let all = gathered(b, tp, &s.h1)?;
        let h1 = all.as_ref().unwrap_or(&s.h1);
        let dh1 = linear_bwd(
            b,
            &dqkv,
            (h1, u_qkv.as_ref()),
            l.qkv,
            (params, &mut *grads, ids),
            tp,
        )?;
        let dh1 = reduced(b, tp, dh1)?;
        dx = rms_grad(b, &dh1, &s.x, params, grads, ids, l.input_norm, &s.rstd1)?;
        b.add_assign(&mut dx, &dx_mid)?;
    }
    let Some(e) = ids.embedding else {
        return Ok((out, Some(dx)));
    };
    if ids.trainable[e] {
        let tokens = match tp {
            Some(tp) => tp.local(&batch.tokens),
            None => batch.tokens.clone(),
        };
        let all = gathered(b, tp, &dx)?;
        b.embedding_bwd(all.as_ref().unwrap_or(&dx), &tokens, &mut grads[e])?;
    }
    Ok((out, None))
}

/// The cross entropy of logits over this rank's vocabulary shard against `labels` (rows of
/// the shard, or [`NO_ROW`]), as the whole vocabulary's: the shards' log-sum-exps and target
/// logits reduced over the group (Megatron's three all-reduces of `[T]` f32: the maximum,
/// the target logit, Σexp). Returns the per-row loss and the whole vocabulary's log-sum-exp,
/// which the backward pass's softmax takes.
fn vocab_parallel_cross_entropy<B: Backend>(
    b: &B,
    tp: &TensorParallel<B::Tensor>,
    logits: &B::Tensor,
    labels: &[u32],
) -> Result<(B::Tensor, B::Tensor)> {
    let (loss, lse) = b.cross_entropy(logits, labels)?;
    let (loss, lse) = (b.download_f32(&loss)?, b.download_f32(&lse)?);
    let n = [lse.len()];
    let reduced = |values: Vec<f32>, op| -> Result<Vec<f32>> {
        let mut t = b.upload_f32(&n, &values)?;
        tp.group.all_reduce(&mut t, op)?;
        b.download_f32(&t)
    };
    let max = reduced(lse.clone(), ReduceOp::Max)?;
    // A shard's loss is its log-sum-exp less the target logit if it holds the label.
    let target = reduced(
        lse.iter().zip(&loss).map(|(l, x)| l - x).collect(),
        ReduceOp::Sum,
    )?;
    let shifted = lse.iter().zip(&max).map(|(l, m)| (l - m).exp()).collect();
    let sum_exp = reduced(shifted, ReduceOp::Sum)?;
    let whole: Vec<f32> = (max.iter().zip(&sum_exp))
        .map(|(m, s)| (f64::from(*m) + f64::from(*s).ln()) as f32)
        .collect();
    let loss: Vec<f32> = whole.iter().zip(&target).map(|(l, t)| l - t).collect();
    Ok((b.upload_f32(&n, &loss)?, b.upload_f32(&n, &whole)?))
}

/// Whether this rank adds a term every tensor-parallel rank computes alike to a sum the
/// group reduces afterwards: rank 0 alone does, so that the sum counts it once.
fn counts_once<T>(tp: Option<&TensorParallel<T>>) -> bool {
    tp.is_none_or(|tp| tp.group.rank() == 0)
}

/// `y = x·Wᵀ (+ bias) + s·(x·Aᵀ)·Bᵀ`; returns `y` and, with an adapter, `x·Aᵀ` for the
/// backward pass. Under tensor parallelism a row-parallel layer's `y` is a partial sum the
/// caller reduces: its bias and adapter term are added by one rank, and its adapter's `A`
/// being row-parallel too (peft's megatron LoRA layer, peft/tuners/lora/tp_layer.py), `x·Aᵀ`
/// is summed over the ranks here.
fn linear_fwd<B: Backend>(
    b: &B,
    x: &B::Tensor,
    lin: Linear,
    (params, scale): (&[B::Tensor], f32),
    tp: Option<&TensorParallel<B::Tensor>>,
) -> Result<(B::Tensor, Option<B::Tensor>)> {
    let once = !lin.row || counts_once(tp);
    let bias = lin.bias.filter(|_| once).map(|i| &params[i]);
    let mut y = b.matmul(x, &params[lin.w], bias)?;
    let Some((a, bb)) = lin.lora else {
        return Ok((y, None));
    };
    let mut u = b.matmul(x, &params[a], None)?;
    if lin.row {
        u = reduced(b, tp, u)?;
    }
    if once {
        b.add_assign(&mut y, &b.scaled(&b.matmul(&u, &params[bb], None)?, scale)?)?;
    }
    Ok((y, Some(u)))
}

/// `dx` of [`linear_fwd`], accumulating the gradients of whatever of W, bias, A, B is trained.
/// Under tensor parallelism a column-parallel layer's `dx` is a partial sum the caller
/// reduces; its adapter's `B` being column-parallel too, `x·Aᵀ`'s gradient is summed over
/// the ranks here and the adapter's part of `dx`, alike on every rank, added by one.
fn linear_bwd<B: Backend>(
    b: &B,
    dy: &B::Tensor,
    (x, u): (&B::Tensor, Option<&B::Tensor>),
    lin: Linear,
    (params, grads, ids): (&[B::Tensor], &mut [B::Tensor], &Ids),
    tp: Option<&TensorParallel<B::Tensor>>,
) -> Result<B::Tensor> {
    let trained = |i: usize| ids.trainable[i];
    let mut dx = match lin.bias.filter(|&bi| trained(lin.w) && trained(bi)) {
        Some(bi) => {
            let (dw, db) = two_mut(grads, lin.w, bi);
            b.matmul_bwd(dy, x, &params[lin.w], Some(dw), Some(db))?
        }
        None => {
            let dw = trained(lin.w).then(|| &mut grads[lin.w]);
            b.matmul_bwd(dy, x, &params[lin.w], dw, None)?
        }
    };
    if let (Some((a, bb)), Some(u)) = (lin.lora, u) {
        // y += s·u·Bᵀ with u = x·Aᵀ.
        let dys = b.scaled(dy, ids.lora_scale)?;
        let mut du = b.matmul_bwd(&dys, u, &params[bb], Some(&mut grads[bb]), None)?;
        if !lin.row {
            du = reduced(b, tp, du)?;
        }
        let dx_a = b.matmul_bwd(&du, x, &params[a], Some(&mut grads[a]), None)?;
        if lin.row || counts_once(tp) {
            b.add_assign(&mut dx, &dx_a)?;
        }
    }
    Ok(dx)
}

/// `dx` of `y = rms_norm(x)·γ[g]`, accumulating γ's gradient when it is trained.
#[allow(clippy::too_many_arguments)]
fn rms_grad<B: Backend>(
    b: &B,
    dy: &B::Tensor,
    x: &B::Tensor,
    params: &[B::Tensor],
    grads: &mut [B::Tensor],
    ids: &Ids,
    g: usize,
    rstd: &B::Tensor,
) -> Result<B::Tensor> {
    let dgamma = ids.trainable[g].then(|| &mut grads[g]);
    b.rms_norm_bwd(dy, x, &params[g], rstd, dgamma)
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
