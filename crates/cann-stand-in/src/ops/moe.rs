//! aclnnMoeTokenPermute and aclnnMoeTokenPermuteGrad (ops-transformer
//! moe/moe_token_permute/docs/aclnnMoeTokenPermute.md, moe/moe_token_permute_grad/docs/
//! aclnnMoeTokenPermuteGrad.md) without padded mode, the only mode they support: the flattened
//! expert indices sorted stably (`sortedIndicesFirst = argSort(indices)`), each sorted choice's
//! token copied out up to `numOutTokens`, and each choice's place in the sorted order
//! (`sortedIndicesOut = argSort(sortedIndicesFirst)`); the gradient sums each token's `topK`
//! rows at those places. Indices must lie in [0, 16777215) and be fewer than 16777215, `topK`
//! at most 512, as the documentation says; the indices are checked at launch. The sort is
//! stable unless `MINDKIT_STAND_IN_UNSTABLE_SORT` is set.
//!
//! Before them, aclnnMoeGatingTopKSoftmax (ops-transformer moe/moe_gating_top_k_softmax/docs/
//! aclnnMoeGatingTopKSoftmax.md): each row's softmax and its top-k, without `finishedOptional`
//! (which must be null), `k` at most 1024.

use super::{checked_index, Ex, Ws, HEAVY};
use crate::aclnn::{ensure, phase1, Kernel};
use crate::view::View;
use ascendcl_sys::aclnn::{aclTensor, aclnnStatus};
use ascendcl_sys::ACL_INT32;

/// The indices' bound (exclusive), on their values and on their count.
const INDEX_LIMIT: i64 = 16_777_215;
/// Most choices per token.
const MAX_TOPK: usize = 512;

/// How many sorted choices of `all` `num_out_tokens` keeps: 0 all, a negative count from the
/// end (a negative slice index), at most all.
fn kept(num_out_tokens: i64, all: usize) -> usize {
    match num_out_tokens {
        0 => all,
        n if n < 0 => all.saturating_sub(n.unsigned_abs() as usize),
        n => all.min(n as usize),
    }
}

#[no_mangle]
pub extern "C" fn aclnnMoeTokenPermuteGetWorkspaceSize(
    tokens: *const aclTensor,
    indices: *const aclTensor,
    num_out_tokens: i64,
    padded_mode: bool,
    permute_tokens_out: *const aclTensor,
    sorted_indices_out: *const aclTensor,
    workspace_size: Ws,
    executor: Ex,
) -> aclnnStatus {
    phase1("aclnnMoeTokenPermute", workspace_size, executor, |p| {
        ensure!(p, !padded_mode, "paddedMode true: only false is supported");
        let x = p.input(tokens, "tokens")?;
        let ids = p.input(indices, "indices")?;
        let out = p.output(permute_tokens_out, "permuteTokensOut")?;
        let sorted = p.output(sorted_indices_out, "sortedIndicesOut")?;
        p.float(&x, "tokens")?;
        p.index(&ids, "indices")?;
        ensure!(
            p,
            x.rank() == 2,
            "tokens {:?}: the stand-in takes 2-D",
            x.dims
        );
        let (n, h) = (x.dims[0], x.dims[1]);
        let topk = match ids.dims[..] {
            [rows, k] if rows == n => k,
            [rows] if rows == n => 1,
            _ => {
                return Err(p.invalid(format!(
                    "indices {:?} are not [{n}, topK] or [{n}]",
                    ids.dims
                )))
            }
        };
        ensure!(
            p,
            topk <= MAX_TOPK && (ids.numel() as i64) < INDEX_LIMIT,
            "indices {:?}: topK at most {MAX_TOPK}, fewer than {INDEX_LIMIT} elements",
            ids.dims
        );
        let all = n * topk;
        p.shape(&out, "permuteTokensOut", &[kept(num_out_tokens, all), h])?;
        p.dtype(&out, "permuteTokensOut", x.dtype)?;
        p.shape(&sorted, "sortedIndicesOut", &[all])?;
        p.dtype(&sorted, "sortedIndicesOut", ACL_INT32)?;
        Ok((HEAVY, permute(x, ids, topk, (out, sorted))))
    })
}

/// Whether `MINDKIT_STAND_IN_UNSTABLE_SORT` is set, to play a CANN whose sort puts equal
/// indices in reverse order (the documentation says `argSort`, not which one).
fn unstable() -> bool {
    std::env::var_os("MINDKIT_STAND_IN_UNSTABLE_SORT").is_some()
}

/// The permutation's kernel.
fn permute(x: View, ids: View, topk: usize, (out, sorted): (View, View)) -> Kernel {
    Box::new(move || {
        let values = ids.read_int();
        if let Some((i, v)) =
            (values.iter().enumerate()).find(|(_, v)| !(0..INDEX_LIMIT).contains(*v))
        {
            return Err(format!("indices[{i}] = {v} is outside [0, {INDEX_LIMIT})"));
        }
        let mut order: Vec<usize> = (0..values.len()).collect();
        match unstable() {
            false => order.sort_by_key(|&i| values[i]),
            true => order.sort_by_key(|&i| (values[i], std::cmp::Reverse(i))),
        }
        let mut places = vec![0f64; order.len()];
        for (at, &i) in order.iter().enumerate() {
            places[i] = at as f64;
        }
        let mut rows = Vec::with_capacity(out.numel());
        for &i in &order[..out.dims[0]] {
            rows.extend(x.row(i / topk).read());
        }
        out.write(&rows);
        sorted.write_f64(&places);
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn aclnnMoeTokenPermuteGradGetWorkspaceSize(
    permuted_output_grad: *const aclTensor,
    sorted_indices: *const aclTensor,
    num_topk: i64,
    padded_mode: bool,
    out: *const aclTensor,
    workspace_size: Ws,
    executor: Ex,
) -> aclnnStatus {
    phase1("aclnnMoeTokenPermuteGrad", workspace_size, executor, |p| {
        ensure!(p, !padded_mode, "paddedMode true: only false is supported");
        let dy = p.input(permuted_output_grad, "permutedOutputGrad")?;
        let places = p.input(sorted_indices, "sortedIndices")?;
        let o = p.output(out, "out")?;
        p.float(&dy, "permutedOutputGrad")?;
        p.dtype(&places, "sortedIndices", ACL_INT32)?;
        ensure!(
            p,
            (1..=MAX_TOPK as i64).contains(&num_topk),
            "numTopk {num_topk} is not in [1, {MAX_TOPK}]"
        );
        ensure!(
            p,
            dy.rank() == 2,
            "permutedOutputGrad {:?} is not 2-D",
            dy.dims
        );
        let (all, h, topk) = (dy.dims[0], dy.dims[1], num_topk as usize);
        ensure!(
            p,
            all % topk == 0,
            "permutedOutputGrad has {all} rows, not tokens × numTopk {topk}"
        );
        p.shape(&places, "sortedIndices", &[all])?;
        p.shape(&o, "out", &[all / topk, h])?;
        p.dtype(&o, "out", dy.dtype)?;
        Ok((HEAVY, permute_grad(dy, places, topk, o)))
    })
}

/// The gradient's kernel: each token's rows summed in f32, its choices in order.
fn permute_grad(dy: View, places: View, topk: usize, out: View) -> Kernel {
    Box::new(move || {
        let (rows, h) = (dy.dims[0], dy.dims[1]);
        let mut sums = vec![0f32; out.numel()];
        for (i, place) in places.read_int().into_iter().enumerate() {
            let row = dy.row(checked_index(place, i, rows)?).read();
            let sum = &mut sums[(i / topk) * h..(i / topk + 1) * h];
            sum.iter_mut().zip(row).for_each(|(s, v)| *s += v);
        }
        out.write(&sums);
        Ok(())
    })
}

/// Most experts chosen per row.
const MAX_GATING_K: i64 = 1024;

#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn aclnnMoeGatingTopKSoftmaxGetWorkspaceSize(
    x: *const aclTensor,
    finished_optional: *const aclTensor,
    k: i64,
    y_out: *const aclTensor,
    expert_idx_out: *const aclTensor,
    row_idx_out: *const aclTensor,
    workspace_size: Ws,
    executor: Ex,
) -> aclnnStatus {
    phase1("aclnnMoeGatingTopKSoftmax", workspace_size, executor, |p| {
        p.absent(finished_optional, "finishedOptional")?;
        let logits = p.input(x, "x")?;
        let y = p.output(y_out, "yOut")?;
        let experts = p.output(expert_idx_out, "expertIdxOut")?;
        let rows = p.output(row_idx_out, "rowIdxOut")?;
        p.float(&logits, "x")?;
        ensure!(
            p,
            logits.rank() == 2,
            "x {:?}: the stand-in takes 2-D",
            logits.dims
        );
        let (n, width) = (logits.dims[0], logits.dims[1]);
        ensure!(
            p,
            (0..=MAX_GATING_K.min(width as i64)).contains(&k),
            "k {k} is not in [0, min({MAX_GATING_K}, {width})]"
        );
        let k = k as usize;
        p.shape(&y, "yOut", &[n, k])?;
        p.dtype(&y, "yOut", logits.dtype)?;
        for (v, name) in [(&experts, "expertIdxOut"), (&rows, "rowIdxOut")] {
            p.shape(v, name, &[n, k])?;
            p.dtype(v, name, ACL_INT32)?;
        }
        Ok((HEAVY, gating(logits, k, (y, experts, rows))))
    })
}

/// The gating's kernel: each row's softmax in f32, its `k` largest (the lower expert first
/// among equals), `rowIdxOut[row][j] = j·rows + row`.
fn gating(logits: View, k: usize, (y, experts, rows): (View, View, View)) -> Kernel {
    Box::new(move || {
        let (n, width) = (logits.dims[0], logits.dims[1]);
        let (mut probs, mut chosen, mut places) = (Vec::new(), Vec::new(), Vec::new());
        for (r, row) in logits.read().chunks(width.max(1)).enumerate().take(n) {
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let exps: Vec<f32> = row.iter().map(|&v| (v - max).exp()).collect();
            let sum: f32 = exps.iter().sum();
            let mut order: Vec<usize> = (0..width).collect();
            order.sort_by(|&a, &b| exps[b].total_cmp(&exps[a]).then(a.cmp(&b)));
            for (j, &e) in order[..k].iter().enumerate() {
                probs.push(exps[e] / sum);
                chosen.push(e as f64);
                places.push((j * n + r) as f64);
            }
        }
        y.write(&probs);
        experts.write_f64(&chosen);
        rows.write_f64(&places);
        Ok(())
    })
}
