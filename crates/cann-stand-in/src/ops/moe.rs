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
//! aclnnMoeTokenUnpermute and aclnnMoeTokenUnpermuteGrad (moe/moe_token_unpermute/docs/
//! aclnnMoeTokenUnpermute.md, moe/moe_token_unpermute_grad/docs/aclnnMoeTokenUnpermuteGrad.md),
//! without padded mode or a restore shape: each token's `topK` rows at `sortedIndices` times
//! its probabilities summed (without probabilities `topK` is 1); the gradient writes each
//! choice's row of the token's gradient times its probability at its place and each
//! probability's gradient, the product with the permuted token there. The gradient takes
//! probabilities and every input its op_api checks as required (`permuteTokens`,
//! `probsGradOut`), and refuses places that repeat. aclnnMoeInitRoutingV2
//! (moe/moe_init_routing_v2/docs/aclnnMoeInitRoutingV2.md) in its dropless mode (`dropPadMode`
//! 0; the stand-in has no drop/pad mode): the permutation's sort and gather, the first
//! `activeNum` kept (0: all), `expandedRowIdxOut` each choice's place, the experts' token
//! counts or their running sum when asked, which needs every index below `expertNum`.
//!
//! Before them, aclnnMoeGatingTopKSoftmax (ops-transformer moe/moe_gating_top_k_softmax/docs/
//! aclnnMoeGatingTopKSoftmax.md): each row's softmax and its top-k, without `finishedOptional`
//! (which must be null), `k` at most 1024.

use super::{checked_index, Ex, Ws, HEAVY};
use crate::aclnn::{ensure, phase1, Kernel};
use crate::view::View;
use ascendcl_sys::aclnn::{aclIntArray, aclTensor, aclnnStatus};
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

/// The flattened expert indices `values` (each checked to lie in `[0, limit)`, named `what`)
/// sorted: the choices in sorted order, and each choice's place in it.
fn sorted(values: &[i64], limit: i64, what: &str) -> Result<(Vec<usize>, Vec<f64>), String> {
    if let Some((i, v)) = (values.iter().enumerate()).find(|(_, v)| !(0..limit).contains(*v)) {
        return Err(format!("{what}[{i}] = {v} is outside [0, {limit})"));
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
    Ok((order, places))
}

/// The rows of `x` the first `out.dims[0]` sorted choices (`topk` per row) take, into `out`.
fn gather_sorted(x: &View, order: &[usize], topk: usize, out: &View) {
    let mut rows = Vec::with_capacity(out.numel());
    for &i in &order[..out.dims[0]] {
        rows.extend(x.row(i / topk).read());
    }
    out.write(&rows);
}

/// The permutation's kernel.
fn permute(x: View, ids: View, topk: usize, (out, sorted_out): (View, View)) -> Kernel {
    Box::new(move || {
        let (order, places) = sorted(&ids.read_int(), INDEX_LIMIT, "indices")?;
        gather_sorted(&x, &order, topk, &out);
        sorted_out.write_f64(&places);
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
        Ok((HEAVY, unpermute(dy, places, (None, topk), o)))
    })
}

/// The kernel of the gradient and of the unpermutation: each token's rows (times its
/// probabilities, where given) summed in f32, its choices in order.
fn unpermute(rows: View, places: View, (probs, topk): (Option<View>, usize), out: View) -> Kernel {
    Box::new(move || {
        let (all, h) = (rows.dims[0], rows.dims[1]);
        let weights = probs.as_ref().map_or_else(|| vec![1.0; all], View::read);
        let mut sums = vec![0f32; out.numel()];
        for (i, place) in places.read_int().into_iter().enumerate() {
            let row = rows.row(checked_index(place, i, all)?).read();
            let sum = &mut sums[(i / topk) * h..(i / topk + 1) * h];
            let w = weights[i];
            sum.iter_mut().zip(row).for_each(|(s, v)| *s += v * w);
        }
        out.write(&sums);
        Ok(())
    })
}

#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn aclnnMoeTokenUnpermuteGetWorkspaceSize(
    permuted_tokens: *const aclTensor,
    sorted_indices: *const aclTensor,
    probs_optional: *const aclTensor,
    padded_mode: bool,
    restore_shape_optional: *const aclIntArray,
    out: *const aclTensor,
    workspace_size: Ws,
    executor: Ex,
) -> aclnnStatus {
    phase1("aclnnMoeTokenUnpermute", workspace_size, executor, |p| {
        ensure!(p, !padded_mode, "paddedMode true: only false is supported");
        p.absent(restore_shape_optional, "restoreShapeOptional")?;
        let rows = p.input(permuted_tokens, "permutedTokens")?;
        let places = p.input(sorted_indices, "sortedIndices")?;
        let probs = p.opt_input(probs_optional, "probsOptional")?;
        let o = p.output(out, "out")?;
        p.float(&rows, "permutedTokens")?;
        p.dtype(&places, "sortedIndices", ACL_INT32)?;
        ensure!(
            p,
            rows.rank() == 2,
            "permutedTokens {:?} is not 2-D",
            rows.dims
        );
        let (all, h) = (rows.dims[0], rows.dims[1]);
        // without probs each token has one row (topK 1)
        let (tokens, topk) = match &probs {
            Some(pr) => {
                p.float(pr, "probsOptional")?;
                ensure!(p, pr.rank() == 2, "probsOptional {:?} is not 2-D", pr.dims);
                (pr.dims[0], pr.dims[1])
            }
            None => (all, 1),
        };
        ensure!(
            p,
            (1..=MAX_TOPK).contains(&topk) && tokens * topk == all,
            "permutedTokens has {all} rows, not tokens {tokens} × topK {topk} (at most {MAX_TOPK})"
        );
        p.shape(&places, "sortedIndices", &[all])?;
        p.shape(&o, "out", &[tokens, h])?;
        p.dtype(&o, "out", rows.dtype)?;
        Ok((HEAVY, unpermute(rows, places, (probs, topk), o)))
    })
}

#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn aclnnMoeTokenUnpermuteGradGetWorkspaceSize(
    permute_tokens: *const aclTensor,
    unpermuted_tokens_grad: *const aclTensor,
    sorted_indices: *const aclTensor,
    probs_optional: *const aclTensor,
    padded_mode: bool,
    restore_shape_optional: *const aclIntArray,
    permuted_tokens_grad_out: *const aclTensor,
    probs_grad_out: *const aclTensor,
    workspace_size: Ws,
    executor: Ex,
) -> aclnnStatus {
    phase1(
        "aclnnMoeTokenUnpermuteGrad",
        workspace_size,
        executor,
        |p| {
            ensure!(p, !padded_mode, "paddedMode true: only false is supported");
            p.absent(restore_shape_optional, "restoreShapeOptional")?;
            ensure!(
                p,
                !probs_optional.is_null(),
                "probsOptional is null: the stand-in takes probs"
            );
            let rows = p.input(permute_tokens, "permuteTokens")?;
            let dy = p.input(unpermuted_tokens_grad, "unpermutedTokensGrad")?;
            let places = p.input(sorted_indices, "sortedIndices")?;
            let probs = p.input(probs_optional, "probsOptional")?;
            let drows = p.output(permuted_tokens_grad_out, "permutedTokensGradOut")?;
            let dprobs = p.output(probs_grad_out, "probsGradOut")?;
            p.float(&rows, "permuteTokens")?;
            p.float(&probs, "probsOptional")?;
            p.dtype(&places, "sortedIndices", ACL_INT32)?;
            ensure!(
                p,
                rows.rank() == 2 && probs.rank() == 2,
                "permuteTokens {:?} and probsOptional {:?} must be 2-D",
                rows.dims,
                probs.dims
            );
            let (all, h) = (rows.dims[0], rows.dims[1]);
            let (tokens, topk) = (probs.dims[0], probs.dims[1]);
            ensure!(
            p,
            (1..=MAX_TOPK).contains(&topk) && tokens * topk == all,
            "permuteTokens has {all} rows, not tokens {tokens} × topK {topk} (at most {MAX_TOPK})"
        );
            p.shape(&dy, "unpermutedTokensGrad", &[tokens, h])?;
            p.dtype(&dy, "unpermutedTokensGrad", rows.dtype)?;
            p.shape(&places, "sortedIndices", &[all])?;
            p.shape(&drows, "permutedTokensGradOut", &[all, h])?;
            p.dtype(&drows, "permutedTokensGradOut", rows.dtype)?;
            p.shape(&dprobs, "probsGradOut", &[tokens, topk])?;
            p.dtype(&dprobs, "probsGradOut", probs.dtype)?;
            let kernel = unpermute_grad((rows, dy, places, probs), topk, (drows, dprobs));
            Ok((HEAVY, kernel))
        },
    )
}

/// The unpermutation's gradient's kernel: each choice's row of the token's gradient times its
/// probability, at its place (the places a permutation: no place twice), and each
/// probability's gradient, that row's product with the permuted token there, in f32.
fn unpermute_grad(
    (rows, dy, places, probs): (View, View, View, View),
    topk: usize,
    (drows, dprobs): (View, View),
) -> Kernel {
    Box::new(move || {
        let (all, h) = (rows.dims[0], rows.dims[1]);
        let (dy, probs) = (dy.read(), probs.read());
        let mut grad = vec![0f32; all * h];
        let mut seen = vec![false; all];
        let mut dprob = Vec::with_capacity(all);
        for (i, place) in places.read_int().into_iter().enumerate() {
            let at = checked_index(place, i, all)?;
            if std::mem::replace(&mut seen[at], true) {
                return Err(format!("sortedIndices repeats {at} (element {i})"));
            }
            let g = &dy[(i / topk) * h..(i / topk + 1) * h];
            let out = &mut grad[at * h..(at + 1) * h];
            out.iter_mut().zip(g).for_each(|(o, &v)| *o = v * probs[i]);
            dprob.push(g.iter().zip(rows.row(at).read()).map(|(a, b)| a * b).sum());
        }
        drows.write(&grad);
        dprobs.write(&dprob);
        Ok(())
    })
}

#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn aclnnMoeInitRoutingV2GetWorkspaceSize(
    x: *const aclTensor,
    expert_idx: *const aclTensor,
    active_num: i64,
    expert_capacity: i64,
    expert_num: i64,
    drop_pad_mode: i64,
    expert_tokens_count_or_cumsum_flag: i64,
    expert_tokens_before_capacity_flag: bool,
    expanded_x_out: *const aclTensor,
    expanded_row_idx_out: *const aclTensor,
    expert_tokens_count_or_cumsum_out: *const aclTensor,
    expert_tokens_before_capacity_out: *const aclTensor,
    workspace_size: Ws,
    executor: Ex,
) -> aclnnStatus {
    phase1("aclnnMoeInitRoutingV2", workspace_size, executor, |p| {
        let counting = expert_tokens_count_or_cumsum_flag;
        ensure!(
            p,
            drop_pad_mode == 0 && !expert_tokens_before_capacity_flag,
            "dropPadMode {drop_pad_mode}: the stand-in takes 0 (dropless), without \
             expertTokensBeforeCapacityOut"
        );
        p.absent(
            expert_tokens_before_capacity_out,
            "expertTokensBeforeCapacityOut",
        )?;
        ensure!(
            p,
            active_num >= 0 && expert_capacity >= 0 && expert_num >= 0,
            "activeNum {active_num}, expertCapacity {expert_capacity} and expertNum \
             {expert_num} must not be negative"
        );
        ensure!(
            p,
            (0..=2).contains(&counting) && (counting == 0 || expert_num > 0),
            "expertTokensCountOrCumsumFlag {counting} is not 0, 1 or 2 (and 1, 2 need expertNum)"
        );
        let tokens = p.input(x, "x")?;
        let ids = p.input(expert_idx, "expertIdx")?;
        let expanded = p.output(expanded_x_out, "expandedXOut")?;
        let places = p.output(expanded_row_idx_out, "expandedRowIdxOut")?;
        let counts = match counting {
            0 => None,
            _ => Some(p.output(
                expert_tokens_count_or_cumsum_out,
                "expertTokensCountOrCumsumOut",
            )?),
        };
        if counting == 0 {
            p.absent(
                expert_tokens_count_or_cumsum_out,
                "expertTokensCountOrCumsumOut",
            )?;
        }
        p.float(&tokens, "x")?;
        p.dtype(&ids, "expertIdx", ACL_INT32)?;
        ensure!(p, tokens.rank() == 2, "x {:?} is not 2-D", tokens.dims);
        let (n, h) = (tokens.dims[0], tokens.dims[1]);
        let k = match ids.dims[..] {
            [rows, k] if rows == n => k,
            [rows] if rows == n => 1,
            _ => {
                return Err(p.invalid(format!("expertIdx {:?} is not [{n}, k] or [{n}]", ids.dims)))
            }
        };
        let all = n * k;
        let kept = match active_num {
            0 => all,
            active => all.min(active as usize),
        };
        p.shape(&expanded, "expandedXOut", &[kept, h])?;
        p.dtype(&expanded, "expandedXOut", tokens.dtype)?;
        p.shape(&places, "expandedRowIdxOut", &[all])?;
        p.dtype(&places, "expandedRowIdxOut", ACL_INT32)?;
        if let Some(c) = &counts {
            p.shape(c, "expertTokensCountOrCumsumOut", &[expert_num as usize])?;
            p.dtype(c, "expertTokensCountOrCumsumOut", ACL_INT32)?;
        }
        // counting needs each index to be an expert; otherwise any index ≥ 0 sorts
        let limit = if counting == 0 { i64::MAX } else { expert_num };
        let kernel = init_routing(
            (tokens, ids),
            (k, limit, counting),
            (expanded, places, counts),
        );
        Ok((HEAVY, kernel))
    })
}

/// The routing's kernel: the permutation's sort and gather, and each expert's tokens
/// (`counting` 2) or their running sum (1).
fn init_routing(
    (x, ids): (View, View),
    (k, limit, counting): (usize, i64, i64),
    (expanded, places, counts): (View, View, Option<View>),
) -> Kernel {
    Box::new(move || {
        let values = ids.read_int();
        let (order, place) = sorted(&values, limit, "expertIdx")?;
        gather_sorted(&x, &order, k, &expanded);
        places.write_f64(&place);
        if let Some(c) = &counts {
            let mut per = vec![0f64; c.numel()];
            values.iter().for_each(|&e| per[e as usize] += 1.0);
            if counting == 1 {
                per.iter_mut().fold(0.0, |sum, v| {
                    *v += sum;
                    *v
                });
            }
            c.write_f64(&per);
        }
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
