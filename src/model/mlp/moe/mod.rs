//! The mixture-of-experts MLP, megatron-core's `MoELayer` with the all-gather token
//! dispatcher (megatron/core/transformer/moe/moe_layer.py, router.py, experts.py
//! `SequentialMLP`, shared_experts.py): the router's logits on this rank's rows, every token
//! routed on the host ([`route`]), each expert a [`Ffn`] (SwiGLU) over its tokens with its
//! activation scaled by their routing weights, the outputs added back into their rows in
//! expert order; the shared experts (with their optional sigmoid gate) added after.
//!
//! Under tensor parallelism every rank runs its columns of every expert on all tokens (the
//! expert-tensor-parallel size is the tensor-parallel size): the rows are gathered under
//! sequence parallelism, the logits gathered with them, and the outputs reduced as the dense
//! MLP's are. Under expert parallelism each rank holds a block of the experts and the
//! expert-parallel ranks' rows are gathered after the tensor-parallel ones (megatron-core's
//! `MoEAllGatherTokenDispatcher` over its `tp_ep_group`, TP fastest): each rank runs its
//! experts on every rank's tokens routed to them, and the outputs are summed back to the rows'
//! own ranks; the shared experts, the router and its losses stay on the rank's own rows.
//!
//! Legend: T = this rank's rows, N = its tensor-parallel group's rows (T without sequence
//! parallelism), M = its expert-parallel group's (EP·N), h = hidden, E = routed experts.

mod experts;
pub(in crate::model) mod losses;
mod spread;

use super::dense::{Ffn, FfnSaved};
use crate::arch::moe::{
    route, route_grad, routes_by_softmax_topk, sigmoid, sinkhorn_choice, sparsemixer, weigh,
    weigh_probabilities, Moe as Experts, Routed,
};
use crate::arch::roles::{Canon, Role};
use crate::arch::Activation;
use crate::engine::dropout::{router_uniforms, RouterDraw};
use crate::engine::{Backend, EngineError, Result};
use crate::model::dropout::rows_here;
use crate::model::parallel::{gathered, reduced};
use crate::model::params::ParamTable;
use crate::model::Pass;
use crate::tensor::DType;
use losses::{aux_losses, RouterStats};
use spread::Spread;
use std::ops::Range;

/// The parameters of one MoE layer.
#[derive(Debug, Clone)]
pub(in crate::model) struct Moe {
    /// Its layer's index in the whole model.
    layer: usize,
    /// The router `[E, h]` and its expert bias `[E]` (f32).
    router: usize,
    bias: Option<usize>,
    /// This rank's routed experts, global experts `first..first + experts.len()`.
    experts: Vec<Ffn>,
    first: usize,
    /// The shared experts and their gate `[1, h]`.
    shared: Option<(Ffn, Option<usize>)>,
}

/// What the backward pass needs of the forward pass.
pub(in crate::model) struct Saved<T> {
    /// The normed input `[T, h]`.
    h: T,
    /// In training with `--moe-input-jitter-eps`, the router's jittered input `[T, h]` and the
    /// jitter's factors (f32, row-major `[T, h]`).
    jitter: Option<(T, Vec<f32>)>,
    /// Each of this rank's rows' summed weights of its zero-computation experts `[T]` (f32).
    zero: Option<T>,
    /// The router's logits of all M rows (f32, row-major `[M, E]`) and every row's route.
    logits: Vec<f32>,
    routes: Vec<Routed>,
    /// How the M rows lie over the expert-parallel ranks.
    spread: Spread,
    experts: experts::Saved<T>,
    shared: Option<SharedSaved<T>>,
    /// In training, what the trainer is told and the auxiliary losses' gradient of this
    /// rank's logits `[T·E]`.
    aux: Option<(RouterStats, Vec<f32>)>,
}

impl<T> Saved<T> {
    /// The forward pass's losses and token counts (training only).
    pub(in crate::model) fn stats(&self) -> Option<&RouterStats> {
        self.aux.as_ref().map(|(s, _)| s)
    }
}

/// The shared experts' state, with their gate's: their summed output `[T, h]` and `σ [T]`
/// (f32).
type SharedSaved<T> = (FfnSaved<T>, Option<(T, T)>);

/// The routing configuration of the pass's model.
fn experts_of<'a, B: Backend>(p: &Pass<'a, B>) -> Result<&'a Experts> {
    p.spec.moe.as_ref().ok_or_else(|| EngineError::Invalid {
        op: "moe",
        msg: "an MoE layer in a model without experts".into(),
    })
}

impl Moe {
    /// Layer `layer`'s MoE block in `table` (whose routed experts may be an expert-parallel
    /// rank's block of them), `None` if the table lacks its router or experts.
    pub(in crate::model) fn of(table: &ParamTable, layer: usize) -> Option<Moe> {
        let at = |role| {
            table.index(Canon {
                role,
                layer: Some(layer),
            })
        };
        let router = at(Role::Router)?;
        let bias = at(Role::ExpertBias);
        let expert = |e| {
            Ffn::of(
                table,
                (Role::ExpertFc1(e), Role::ExpertFc2(e)),
                layer,
                Activation::SwiGlu,
            )
        };
        let all = table.params[router].shape[0];
        let first = (0..all).find(|&e| expert(e).is_some())?;
        let experts: Vec<Ffn> = (first..all).map_while(expert).collect();
        let shared = Ffn::of(
            table,
            (Role::SharedFc1, Role::SharedFc2),
            layer,
            Activation::SwiGlu,
        )
        .map(|s| (s, at(Role::SharedGate)));
        Some(Moe {
            layer,
            router,
            bias,
            experts,
            first,
            shared,
        })
    }

    /// This rank's routed experts, each token choosing `topk`.
    fn local(&self, topk: usize) -> experts::Local<'_> {
        experts::Local {
            experts: &self.experts,
            first: self.first,
            topk,
        }
    }

    /// The dtype of the router's product for input `h`: f32 with `router_f32`
    /// (`--moe-router-dtype fp32`: megatron-core router.py `gating` casts input and weight),
    /// else the input's.
    fn router_dtype<B: Backend>(p: &Pass<B>, h: &B::Tensor) -> DType {
        match p.spec.router_f32 {
            true => DType::F32,
            false => p.b.dtype(h),
        }
    }

    /// `h` and the router's weight in the router's dtype.
    fn router_operands<B: Backend>(
        &self,
        p: &Pass<B>,
        h: &B::Tensor,
    ) -> Result<(B::Tensor, B::Tensor)> {
        let (b, dtype) = (p.b, Self::router_dtype(p, h));
        Ok((b.cast(h, dtype)?, b.cast(&p.params[self.router], dtype)?))
    }

    /// The router's logits `[T, E]` of this rank's rows `h`, on the device, in the router's
    /// dtype.
    fn router_logits<B: Backend>(&self, p: &Pass<B>, h: &B::Tensor) -> Result<B::Tensor> {
        let b = p.b;
        match p.spec.router_f32 && b.dtype(h) != DType::F32 {
            true => {
                let (h32, w32) = self.router_operands(p, h)?;
                b.matmul(&h32, &w32, None)
            }
            false => b.matmul(h, &p.params[self.router], None),
        }
    }

    /// The router's logits (f32, on the host) of all M rows (spread as `spread` says) and of
    /// its tensor-parallel group's N rows, from this rank's rows `h`.
    fn logits<B: Backend>(
        &self,
        p: &Pass<B>,
        h: &B::Tensor,
        spread: &Spread,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let b = p.b;
        let local = b.download_f32(&self.router_logits(p, h)?)?;
        let width = b.shape(&p.params[self.router])[0];
        spread_rows(p, local, width, spread)
    }

    /// The router's input in training with `--moe-input-jitter-eps ε`: this rank's rows `h`
    /// times factors drawn from U(1 − ε, 1 + ε) in `h`'s dtype (megatron-core router.py
    /// `apply_input_jitter`), and the factors; `None` otherwise.
    fn jittered<B: Backend>(
        &self,
        p: &Pass<B>,
        h: &B::Tensor,
    ) -> Result<Option<(B::Tensor, Vec<f32>)>> {
        let (Some(d), Some(rows)) = (p.dropout, rows_here(p)) else {
            return Ok(None);
        };
        let Some(eps) = d.jitter else { return Ok(None) };
        let (b, dtype) = (p.b, p.b.dtype(h));
        let width = b.shape(h)[1..].iter().product();
        let (low, high) = (dtype.round(1.0 - eps), dtype.round(1.0 + eps));
        let factors: Vec<f32> = (rows.iter())
            .flat_map(|&at| router_uniforms(d.seed, self.layer, RouterDraw::Jitter, at, width))
            .map(|u| dtype.round(low + dtype.round(u) * (high - low)))
            .collect();
        let x = b.download_f32(h)?;
        let product: Vec<f32> = x.iter().zip(&factors).map(|(x, f)| x * f).collect();
        let jittered = b.cast(&b.upload_f32(b.shape(h), &product)?, dtype)?;
        Ok(Some((jittered, factors)))
    }

    /// SparseMixer's draws in training for all M rows (spread as `spread` says), each row's
    /// [`sparsemixer::draws`]: this rank's rows' drawn where they sit, gathered as the logits.
    fn sparse_draws<B: Backend>(
        &self,
        p: &Pass<B>,
        spread: &Spread,
        width: usize,
    ) -> Result<Vec<f32>> {
        let (Some(d), Some(rows)) = (p.dropout, rows_here(p)) else {
            return Err(EngineError::Invalid {
                op: "moe",
                msg: "SparseMixer trains without its rows' places".into(),
            });
        };
        let n = sparsemixer::draws(width);
        let local: Vec<f32> = (rows.iter())
            .flat_map(|&at| router_uniforms(d.seed, self.layer, RouterDraw::SparseMixer, at, n))
            .collect();
        Ok(spread_rows(p, local, n, spread)?.0)
    }

    /// The routes of the rows `h` by the backend's top-k of the router's softmax
    /// ([`Backend::softmax_topk`]: the logits stay on the device), where the routing is one
    /// and the pass is inference on one rank (no auxiliary losses or backward pass need the
    /// logits, no other rank's rows come); `None` elsewhere.
    fn gated<B: Backend>(
        &self,
        p: &Pass<B>,
        cfg: &Experts,
        h: &B::Tensor,
    ) -> Result<Option<Vec<Routed>>> {
        let one_rank = p.tp.is_none() && p.ep.is_none();
        if !(routes_by_softmax_topk(cfg) && one_rank && p.inference) {
            return Ok(None);
        }
        let (experts, probs) = (p.b).softmax_topk(&self.router_logits(p, h)?, cfg.topk)?;
        let k = cfg.topk.max(1);
        let routes = (experts.chunks(k).zip(probs.chunks(k)))
            .map(|(e, y)| weigh_probabilities(cfg, e.iter().map(|&e| e as usize).collect(), y))
            .collect();
        Ok(Some(routes))
    }

    /// The MoE block's output `[T, h]` for the normed input `h`, and what the backward pass
    /// needs.
    pub(in crate::model) fn forward<B: Backend>(
        &self,
        p: &Pass<B>,
        h: B::Tensor,
    ) -> Result<(B::Tensor, Saved<B::Tensor>)> {
        let (b, cfg) = (p.b, experts_of(p)?);
        let group = gathered(b, p.tp, &h)?;
        let x_tp = group.as_ref().unwrap_or(&h);
        // the rows this rank sends to the experts: its expert tensor-parallel group's (the
        // tensor-parallel group's at ETP = TP), or with whole experts its own
        let etp_group = etp_gathered(p, &h)?;
        let sent = match p.experts_split_as_tp() {
            true => x_tp,
            false => etp_group.as_ref().unwrap_or(&h),
        };
        let spread = Spread::of(p.ep, b.shape(sent)[0])?;
        let everyone = spread.gather(b, p.ep, sent)?;
        let x = everyone.as_ref().unwrap_or(sent);
        let e_count = cfg.router_width();
        let bias = (self.bias.map(|i| b.download_f32(&p.params[i]))).transpose()?;
        // The routing weights take the logits' dtype (megatron-core `.type_as(logits)`).
        let dtype = Self::router_dtype(p, &h);
        let rounded = |mut r: Routed| {
            r.weights.iter_mut().for_each(|w| *w = dtype.round(*w));
            r
        };
        let jitter = self.jittered(p, &h)?;
        let router_in = jitter.as_ref().map_or(&h, |(j, _)| j);
        let (logits, group_logits, routes) = match self.gated(p, cfg, &h)? {
            Some(routes) => (Vec::new(), Vec::new(), routes),
            None => {
                let (logits, group_logits) = self.logits(p, router_in, &spread)?;
                let routes = (logits.chunks(e_count))
                    .map(|l| route(cfg, l, bias.as_deref()))
                    .collect();
                (logits, group_logits, routes)
            }
        };
        let mut routes: Vec<Routed> = routes.into_iter().map(rounded).collect();
        let at = rows_of(p, b.shape(&h)[0], &spread);
        let (local, mine) = (at.local.clone(), at.mine.clone());
        let calls = router_calls(&spread, p.sequences, at.calls);
        if cfg.sinkhorn && p.aux.is_some() {
            // training's choice: each router call's tokens balanced together
            for call in &calls {
                let row = |r: usize| &logits[r * e_count..(r + 1) * e_count];
                let of_call: Vec<f32> = call.iter().flat_map(|&r| row(r).iter().copied()).collect();
                for (&r, experts) in call
                    .iter()
                    .zip(sinkhorn_choice(&of_call, e_count, cfg.topk))
                {
                    routes[r] = rounded(weigh(cfg, row(r), experts));
                }
            }
        }
        if cfg.sparsemixer && p.aux.is_some() {
            // training's choice: sampled
            let (draws, n) = (
                self.sparse_draws(p, &spread, e_count)?,
                sparsemixer::draws(e_count),
            );
            let rows = logits.chunks(e_count).zip(draws.chunks(n));
            for (route, (row, u)) in routes.iter_mut().zip(rows) {
                *route = rounded(sparsemixer::route(row, Some(u)));
            }
        }
        let kept = kept(p, cfg, &routes, &calls);
        let aux = p.aux.map(|aux| {
            let (losses, grad) = aux_losses(
                cfg,
                aux,
                &group_logits,
                (local.clone(), bias.as_deref()),
                at.tp,
            );
            let tokens = bias.as_ref().map(|_| {
                let mut counts = vec![0f32; e_count];
                for (r, k) in routes[mine.clone()].iter().zip(&kept[mine.clone()]) {
                    (r.experts.iter().zip(k).filter(|(_, &k)| k))
                        .for_each(|(&e, _)| counts[e] += 1.0);
                }
                // padded to capacity, the router counts the padding too
                if let Some(c) = p.spec.capacity.filter(|c| c.pad) {
                    counts.fill(c.of(local.len(), cfg.topk, e_count) as f32);
                }
                counts
            });
            (RouterStats { losses, tokens }, grad)
        });
        let (out, experts) =
            (self.local(cfg.topk)).forward(&p.of_experts(), x, (&routes, &kept))?;
        let out = spread.reduce(b, p.ep, out)?;
        let mut out = reduced(b, p.etp, out)?;
        // The zero-computation experts' part, `z·h` for this rank's rows, after the routed
        // experts' (zero_experts_moe_layer.py adds the two before the shared experts).
        let zero = zero_weights(cfg, &routes[mine.clone()], &kept[mine.clone()])
            .map(|z| b.upload_f32(&[z.len()], &z))
            .transpose()?;
        if let Some(z) = &zero {
            b.add_assign(&mut out, &b.scale_rows(&h, z)?)?;
        }
        let shared = match &self.shared {
            None => None,
            Some((swiglu, gate)) => {
                let (y, saved) = swiglu.forward(p, x_tp, None)?;
                let y = reduced(b, p.tp, y)?;
                let gated = gate.map(|g| self.gate(p, &h, g)).transpose()?;
                match &gated {
                    Some(sigma) => b.add_assign(&mut out, &b.scale_rows(&y, sigma)?)?,
                    None => b.add_assign(&mut out, &y)?,
                }
                Some((saved, gated.map(|sigma| (y, sigma))))
            }
        };
        let saved = Saved {
            h,
            jitter,
            zero,
            logits,
            routes,
            spread,
            experts,
            shared,
            aux,
        };
        Ok((out, saved))
    }

    /// `σ(h·gᵀ) [T]` (f32) of the shared experts' gate `g [1, h]`.
    fn gate<B: Backend>(&self, p: &Pass<B>, h: &B::Tensor, g: usize) -> Result<B::Tensor> {
        let b = p.b;
        let logits = b.download_f32(&b.matmul(h, &p.params[g], None)?)?;
        let sigma: Vec<f32> = logits.iter().map(|&x| sigmoid(x)).collect();
        b.upload_f32(&[sigma.len()], &sigma)
    }

    /// The gradient of the normed input given `dy [T, h]`, the gradient of the output;
    /// accumulates the parameters' gradients (the router's through the routing weights).
    pub(in crate::model) fn backward<B: Backend>(
        &self,
        p: &Pass<B>,
        grads: &mut [B::Tensor],
        s: Saved<B::Tensor>,
        dy: &B::Tensor,
    ) -> Result<B::Tensor> {
        let (b, cfg) = (p.b, experts_of(p)?);
        if s.logits.is_empty() {
            return Err(EngineError::Invalid {
                op: "moe",
                msg: "the backward pass of an MoE layer routed for inference".into(),
            });
        }
        let as_tp = p.experts_split_as_tp();
        let dy_group = gathered(b, p.etp, dy)?;
        let dy_sent = dy_group.as_ref().unwrap_or(dy);
        let dy_everyone = s.spread.gather(b, p.ep, dy_sent)?;
        let dy_all = dy_everyone.as_ref().unwrap_or(dy_sent);
        let h_group = gathered(b, p.tp, &s.h)?;
        let x_tp = h_group.as_ref().unwrap_or(&s.h);
        let etp_group = etp_gathered(p, &s.h)?;
        let sent = match as_tp {
            true => x_tp,
            false => etp_group.as_ref().unwrap_or(&s.h),
        };
        let h_everyone = s.spread.gather(b, p.ep, sent)?;
        let x = h_everyone.as_ref().unwrap_or(sent);
        let mut dweights = vec![vec![0f32; cfg.topk]; s.routes.len()];
        let experts = p.of_experts();
        let dx = (self.local(cfg.topk)).backward(
            &experts,
            grads,
            s.experts,
            (x, dy_all),
            &mut dweights,
        )?;
        // Every expert-parallel rank's experts' part of the rows this rank sent.
        let mut dx = s.spread.reduce(b, p.ep, dx)?;
        let mut shared_dx = None;
        // The shared experts' output y gated by σ = σ(h·gᵀ): dy flows to y as σ·dy and to
        // the gate's logits as (dy·y)·σ(1−σ).
        let mut dgate = None;
        if let (Some((swiglu, gate)), Some((saved, gated))) = (&self.shared, s.shared) {
            let dys = match (gate, &gated) {
                (Some(g), Some((y, sigma))) => {
                    let mut dlogit = b.row_dots(dy, y)?;
                    let sigma_host = b.download_f32(sigma)?;
                    (dlogit.iter_mut().zip(sigma_host)).for_each(|(d, s)| *d *= s * (1.0 - s));
                    dgate = Some((*g, dlogit));
                    Some(b.scale_rows(dy, sigma)?)
                }
                _ => None,
            };
            let dys = dys.as_ref().unwrap_or(dy);
            let dys_all = gathered(b, p.tp, dys)?;
            let dys_all = dys_all.as_ref().unwrap_or(dys);
            let (dxs, _) = swiglu.backward(p, grads, saved, (x_tp, dys_all, None))?;
            shared_dx = Some(dxs);
        }
        // Summed over the ranks (this rank's rows under sequence parallelism): the routed
        // experts' over the expert tensor-parallel ones, the shared experts' over the
        // tensor-parallel ones (at ETP = TP both at once); the router's and the gate's terms
        // come from this rank's rows of `h` and are added after.
        let mut dx = match (as_tp, shared_dx) {
            (true, Some(dxs)) => {
                b.add_assign(&mut dx, &dxs)?;
                reduced(b, p.tp, dx)?
            }
            (_, None) => reduced(b, p.etp, dx)?,
            (false, Some(dxs)) => {
                let mut dx = reduced(b, p.etp, dx)?;
                b.add_assign(&mut dx, &reduced(b, p.tp, dxs)?)?;
                dx
            }
        };
        // Each rank's experts' (and expert columns') share of every row's routing-weight
        // gradients, summed.
        let groups = [p.etp.map(|etp| etp.group), p.ep];
        if groups.iter().any(Option::is_some) {
            let mut flat: Vec<f32> = dweights.concat();
            for g in groups.into_iter().flatten() {
                g.all_reduce_f32(&mut flat, crate::engine::comm::ReduceOp::Sum)?;
            }
            dweights = flat.chunks(cfg.topk.max(1)).map(<[f32]>::to_vec).collect();
        }
        if let Some(z) = &s.zero {
            // y += z·h: dh += z·dy, and each chosen zero expert's weight gets dy·h
            b.add_assign(&mut dx, &b.scale_rows(dy, z)?)?;
            let dots = b.row_dots(dy, &s.h)?;
            let mine = rows_of(p, b.shape(&s.h)[0], &s.spread).mine;
            for (row, d) in mine.zip(dots) {
                let slots = s.routes[row].experts.iter().enumerate();
                for (slot, _) in slots.filter(|(_, &e)| e >= cfg.experts) {
                    dweights[row][slot] = d;
                }
            }
        }
        let mut dlogits = logits_grad(p, cfg, (&s.h, &s.logits, &s.routes, &s.spread), &dweights);
        if let Some((_, grad)) = &s.aux {
            dlogits.iter_mut().zip(grad).for_each(|(d, g)| *d += g);
        }
        let router = self.router;
        let router_in = s.jitter.as_ref().map_or(&s.h, |(j, _)| j);
        let (h, w) = match p.spec.router_f32 && b.dtype(&s.h) != DType::F32 {
            true => self
                .router_operands(p, router_in)
                .map(|(h, w)| (Some(h), Some(w)))?,
            false => (None, None),
        };
        let (h32, w32) = (
            h.as_ref().unwrap_or(router_in),
            w.as_ref().unwrap_or(&p.params[router]),
        );
        let mut dh = b.cast(
            &linear_grad(p, grads, (&dlogits, h32), (router, w32))?,
            b.dtype(&s.h),
        )?;
        if let Some((_, factors)) = &s.jitter {
            // through the jitter: times its factors, in the input's dtype
            let scaled: Vec<f32> = (b.download_f32(&dh)?.iter().zip(factors))
                .map(|(d, f)| d * f)
                .collect();
            dh = b.cast(&b.upload_f32(b.shape(&dh), &scaled)?, b.dtype(&s.h))?;
        }
        b.add_assign(&mut dx, &dh)?;
        if let Some((g, dsig)) = dgate {
            let dh = linear_grad(p, grads, (&dsig, &s.h), (g, &p.params[g]))?;
            b.add_assign(&mut dx, &dh)?;
        }
        Ok(dx)
    }
}

/// Per-row values `local` (f32, `width` each) of this rank's rows gathered as the router's
/// logits are: all M rows (spread as `spread` says), and its tensor-parallel group's N rows.
fn spread_rows<B: Backend>(
    p: &Pass<B>,
    local: Vec<f32>,
    width: usize,
    spread: &Spread,
) -> Result<(Vec<f32>, Vec<f32>)> {
    let group = match p.tp.filter(|tp| tp.sequence_parallel) {
        Some(tp) => tp.group.all_gather_f32(&local)?,
        None => local.clone(),
    };
    let routed = match (
        p.experts_split_as_tp(),
        p.etp.filter(|e| e.sequence_parallel),
    ) {
        (true, _) => group.clone(),
        (false, Some(etp)) => etp.group.all_gather_f32(&local)?,
        (false, None) => local,
    };
    Ok((spread.gather_f32(p.ep, routed, width)?, group))
}

/// The rows of `x` this rank's expert tensor-parallel group holds, gathered, where that
/// group is not the tensor-parallel one (whose rows the caller has); `None` otherwise or
/// with whole experts.
fn etp_gathered<B: Backend>(p: &Pass<B>, x: &B::Tensor) -> Result<Option<B::Tensor>> {
    match p.experts_split_as_tp() {
        true => Ok(None),
        false => gathered(p.b, p.etp, x),
    }
}

/// `dh [T, h]` of `y = h·Wᵀ` given `dy` (f32 values on the host, `[T, rows of W]`, taken in
/// `h`'s dtype), accumulating the gradient of parameter `w` (whose value, perhaps cast, is
/// `weight`) when trained.
fn linear_grad<B: Backend>(
    p: &Pass<B>,
    grads: &mut [B::Tensor],
    (dy, h): (&[f32], &B::Tensor),
    (w, weight): (usize, &B::Tensor),
) -> Result<B::Tensor> {
    let b = p.b;
    let rows = b.shape(h)[0];
    let dy = b.upload_f32(&[rows, dy.len() / rows.max(1)], dy)?;
    let dy = b.cast(&dy, b.dtype(h))?;
    let dw = p.trainable[w].then(|| &mut grads[w]);
    b.matmul_bwd(&dy, h, weight, dw, None)
}

/// This rank's rows of the router logits' gradient `[T·E]` from every row's routing weights'
/// (`h`: this rank's rows; `logits`, `routes`: all M rows').
fn logits_grad<B: Backend>(
    p: &Pass<B>,
    cfg: &Experts,
    (h, logits, routes, spread): (&B::Tensor, &[f32], &[Routed], &Spread),
    dweights: &[Vec<f32>],
) -> Vec<f32> {
    let e = cfg.router_width();
    (rows_of(p, p.b.shape(h)[0], spread).mine)
        .flat_map(|t| route_grad(cfg, &logits[t * e..(t + 1) * e], &routes[t], &dweights[t]))
        .collect()
}

/// Each row's summed routing weights of the zero-computation experts among its kept experts,
/// `None` for a model without them.
fn zero_weights(cfg: &Experts, routes: &[Routed], kept: &[Vec<bool>]) -> Option<Vec<f32>> {
    (cfg.zero_experts > 0).then(|| {
        (routes.iter().zip(kept))
            .map(|(r, k)| {
                (r.experts.iter().zip(&r.weights).zip(k))
                    .filter(|((&e, _), &k)| k && e >= cfg.experts)
                    .map(|((_, &w), _)| w)
                    .sum()
            })
            .collect()
    })
}

/// Where this rank's rows sit among the M.
struct RowsAt {
    /// The tensor-parallel ranks its group's N rows are spread over (1 without sequence
    /// parallelism).
    tp: usize,
    /// Its rows among its group's N (its block under sequence parallelism, all otherwise).
    local: Range<usize>,
    /// Its rows among the M.
    mine: Range<usize>,
    /// The router calls among each expert-parallel rank's rows ([`Spread`]): its expert
    /// tensor-parallel ranks' (its own alone with whole experts).
    calls: usize,
}

/// Where this rank's `rows` rows sit among the M, spread as `spread` says.
fn rows_of<B: Backend>(p: &Pass<B>, rows: usize, spread: &Spread) -> RowsAt {
    let (tp, local) = match p.tp.filter(|tp| tp.sequence_parallel) {
        Some(tp) => {
            let first = tp.group.rank() * rows;
            (tp.group.size(), first..first + rows)
        }
        None => (1, 0..rows),
    };
    // its rows among its expert tensor-parallel group's, which it sent to the experts
    let (calls, first) = match p.etp.filter(|etp| etp.sequence_parallel) {
        Some(etp) => (etp.group.size(), etp.group.rank() * rows),
        None => (1, 0),
    };
    let group = spread.mine();
    let mine = group.start + first..group.start + first + rows;
    RowsAt {
        tp,
        local,
        mine,
        calls,
    }
}

/// Each router call's rows among the M, in Megatron's token order: each expert-parallel
/// rank's group's rows (`spread`), split among its `tp` ranks under sequence parallelism
/// (every rank routes its own block, [`megatron_block`]).
fn router_calls(spread: &Spread, sequences: usize, tp: usize) -> Vec<Vec<usize>> {
    let mut calls = Vec::new();
    for group in spread.groups() {
        for r in 0..tp {
            let rows = megatron_block(group.len(), sequences, (r, tp));
            calls.push(rows.into_iter().map(|i| group.start + i).collect());
        }
    }
    calls
}

/// Which of each route's experts take the token: all of them, or with token dropping those
/// within their capacity, each router call's rows (`calls`) apart.
fn kept<B: Backend>(
    p: &Pass<B>,
    cfg: &Experts,
    routes: &[Routed],
    calls: &[Vec<usize>],
) -> Vec<Vec<bool>> {
    let Some(c) = p.spec.capacity else {
        return routes.iter().map(|r| vec![true; r.experts.len()]).collect();
    };
    let mut out = vec![Vec::new(); routes.len()];
    for rows in calls {
        let call: Vec<Routed> = rows.iter().map(|&i| routes[i].clone()).collect();
        for (&i, k) in rows.iter().zip(c.kept(&call, cfg.topk, cfg.router_width())) {
            out[i] = k;
        }
    }
    out
}

/// The rows, among `n` rows of `sequences` whole sequences one after the other, that
/// tensor-parallel rank `r` of `tp` holds in Megatron under sequence parallelism, in its
/// order: Megatron's activations are `[S, B]`, split along S, so the r-th block of positions
/// of every sequence, position by position (without TP, all rows so; this rank's own block of
/// rows when the sequences do not split evenly).
pub(super) fn megatron_block(n: usize, sequences: usize, (r, tp): (usize, usize)) -> Vec<usize> {
    let s = n / sequences.max(1);
    if sequences == 0 || !n.is_multiple_of(sequences) || !s.is_multiple_of(tp) {
        let t = n / tp;
        return (r * t..(r + 1) * t).collect();
    }
    let block = s / tp;
    (r * block..(r + 1) * block)
        .flat_map(|position| (0..sequences).map(move |b| b * s + position))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequence_parallel_rows_are_megatrons_blocks_of_positions() {
        // two sequences of four positions over two ranks: the first half of each, position
        // by position
        assert_eq!(megatron_block(8, 2, (0, 2)), [0, 4, 1, 5]);
        assert_eq!(megatron_block(8, 2, (1, 2)), [2, 6, 3, 7]);
        assert_eq!(megatron_block(8, 2, (0, 1)), [0, 4, 1, 5, 2, 6, 3, 7]);
        // positions that do not split evenly: the rank's own rows
        assert_eq!(megatron_block(6, 2, (1, 2)), [3, 4, 5]);
    }
}
