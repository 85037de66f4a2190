//! Flash attention over packed sequences (layout TND) and its gradient, computed naively per
//! query row: full attention within each sequence (sparse mode 0) or right-down causal
//! (sparse mode 3, with the 2048×2048 optimisation mask checked at launch).

use super::{Ex, Ws, HEAVY};
use crate::aclnn::{ensure, phase1, Kernel, Plan};
use crate::view::View;
use ascendcl_sys::aclnn::{aclIntArray, aclTensor, aclnnStatus};
use ascendcl_sys::{ACL_BOOL, ACL_FLOAT, ACL_UINT8};
use std::ffi::c_char;
use std::sync::OnceLock;

/// The side of the compressed causal mask sparse mode 3 takes.
const MASK: usize = 2048;

/// The attributes shared by the forward and the gradient.
struct Args {
    atten_mask: *const aclTensor,
    prefix: *const aclIntArray,
    q_lens: *const aclIntArray,
    kv_lens: *const aclIntArray,
    scale: f64,
    keep_prob: f64,
    pre_tokens: i64,
    next_tokens: i64,
    head_num: i64,
    layout: *const c_char,
    inner_precise: i64,
    sparse_mode: i64,
}

/// One packed sequence: where its queries and keys start and how many there are.
#[derive(Clone, Copy)]
struct Seq {
    q0: usize,
    k0: usize,
    sq: usize,
    skv: usize,
}

/// What the kernels need: heads, head size, sequences, causality, the scale.
struct Spec {
    n: usize,
    group: usize,
    d: usize,
    seqs: Vec<Seq>,
    causal: bool,
    scale: f32,
    mask: Option<View>,
}

impl Spec {
    /// How many keys (from the sequence's first) query row `i` of `s` sees.
    fn visible(&self, s: Seq, i: usize) -> usize {
        match self.causal {
            true => (i + 1 + s.skv - s.sq).min(s.skv),
            false => s.skv,
        }
    }

    /// The `[T, N, D]` row of token `t`, head `h` in `x`.
    fn row<'a>(&self, x: &'a [f32], heads: usize, t: usize, h: usize) -> &'a [f32] {
        &x[(t * heads + h) * self.d..][..self.d]
    }
}

/// Cumulative sequence ends: non-decreasing from ≥ 0, the last `total`.
fn cumulative(p: &Plan, ends: &[i64], name: &str, total: usize) -> Result<Vec<usize>, aclnnStatus> {
    let ok = ends.windows(2).all(|w| w[0] <= w[1]) && ends.first().is_some_and(|&e| e >= 0);
    ensure!(
        p,
        ok && ends.last() == Some(&(total as i64)),
        "{name} {ends:?} are not cumulative lengths ending at {total}"
    );
    Ok(ends.iter().map(|&e| e as usize).collect())
}

/// The sequences of the cumulative `q_ends`/`kv_ends`.
fn sequences(q_ends: &[usize], kv_ends: &[usize]) -> Vec<Seq> {
    let starts = |e: &[usize]| {
        std::iter::once(0)
            .chain(e.iter().copied())
            .collect::<Vec<_>>()
    };
    let (qs, ks) = (starts(q_ends), starts(kv_ends));
    (0..q_ends.len())
        .map(|b| Seq {
            q0: qs[b],
            k0: ks[b],
            sq: qs[b + 1] - qs[b],
            skv: ks[b + 1] - ks[b],
        })
        .collect()
}

/// Check the shapes and attributes shared by the forward and the gradient.
fn spec(p: &mut Plan, q: &View, k: &View, v: &View, a: &Args) -> Result<Spec, aclnnStatus> {
    let layout = p.string(a.layout, "");
    ensure!(
        p,
        layout == "TND",
        "inputLayout \"{layout}\": the stand-in implements TND only"
    );
    p.float(q, "query")?;
    ensure!(
        p,
        q.rank() == 3 && k.rank() == 3,
        "query {:?} and key {:?} are not [T, N, D]",
        q.dims,
        k.dims
    );
    p.dtype(k, "key", q.dtype)?;
    p.like(v, "value", k)?;
    let (t, n, d, tk, nkv) = (q.dims[0], q.dims[1], q.dims[2], k.dims[0], k.dims[1]);
    ensure!(
        p,
        k.dims[2] == d && nkv > 0 && n % nkv == 0,
        "key {:?} does not fit query {:?}",
        k.dims,
        q.dims
    );
    ensure!(
        p,
        a.head_num == n as i64,
        "headNum {} is not query's {n} heads",
        a.head_num
    );
    p.absent(a.prefix, "prefixOptional")?;
    ensure!(
        p,
        a.keep_prob == 1.0,
        "keepProb {} (dropout) is not supported by the stand-in",
        a.keep_prob
    );
    ensure!(
        p,
        matches!(a.inner_precise, 0 | 2),
        "innerPrecise {} is not 0 or 2",
        a.inner_precise
    );
    let q_ends = cumulative(
        p,
        &p.int_array(a.q_lens, "actualSeqQLen")?,
        "actualSeqQLen",
        t,
    )?;
    let kv_ends = cumulative(
        p,
        &p.int_array(a.kv_lens, "actualSeqKvLen")?,
        "actualSeqKvLen",
        tk,
    )?;
    ensure!(
        p,
        q_ends.len() == kv_ends.len(),
        "actualSeqQLen has {} sequences, actualSeqKvLen {}",
        q_ends.len(),
        kv_ends.len()
    );
    let seqs = sequences(&q_ends, &kv_ends);
    let mask = sparsity(p, a, &seqs)?;
    let spec = Spec {
        n,
        group: n / nkv,
        d,
        seqs,
        causal: mask.is_some(),
        scale: a.scale as f32,
        mask,
    };
    Ok(spec)
}

/// The sparse mode: 0 (no mask, no band) gives None, 3 (right-down causal) its mask.
fn sparsity(p: &mut Plan, a: &Args, seqs: &[Seq]) -> Result<Option<View>, aclnnStatus> {
    let longest = seqs.iter().map(|s| s.sq.max(s.skv)).max().unwrap_or(0) as i64;
    match a.sparse_mode {
        0 => {
            p.absent(a.atten_mask, "attenMask with sparseMode 0")?;
            let no_band = a.pre_tokens >= longest && a.next_tokens >= longest;
            ensure!(
                p,
                no_band,
                "preTokens {} / nextTokens {} make a band, which the stand-in does not implement",
                a.pre_tokens,
                a.next_tokens
            );
            Ok(None)
        }
        3 => {
            let mask = p.input(a.atten_mask, "attenMask")?;
            ensure!(
                p,
                matches!(mask.dtype, ACL_BOOL | ACL_UINT8),
                "attenMask is not BOOL or UINT8"
            );
            p.shape(&mask, "attenMask", &[MASK, MASK])?;
            ensure!(
                p,
                seqs.iter().all(|s| s.skv >= s.sq),
                "sparseMode 3 needs every sequence's kv length ≥ its query length"
            );
            Ok(Some(mask))
        }
        m => Err(p.invalid(format!(
            "sparseMode {m} is not supported by the stand-in (0 or 3)"
        ))),
    }
}

/// The 2048×2048 mask sparse mode 3 expects: 1 above the diagonal.
fn causal_mask() -> &'static [u8] {
    static MASK_BYTES: OnceLock<Vec<u8>> = OnceLock::new();
    MASK_BYTES.get_or_init(|| {
        (0..MASK * MASK)
            .map(|e| u8::from(e % MASK > e / MASK))
            .collect()
    })
}

/// Whether `mask` holds the causal optimisation mask (compared as bytes when contiguous).
fn is_causal_mask(mask: &View) -> bool {
    if mask.strides == [MASK, 1] {
        // SAFETY: the launch checked the storage is live; the view (one byte per element) lies
        // inside it.
        let bytes = unsafe {
            std::slice::from_raw_parts((mask.data + mask.offset) as *const u8, MASK * MASK)
        };
        return bytes == causal_mask();
    }
    let values = mask.read_int();
    values
        .iter()
        .zip(causal_mask())
        .all(|(&v, &m)| v == i64::from(m))
}

/// The forward: attention `[T, N, D]` and each row's max and exp-sum `[T, N]`.
fn forward(s: &Spec, q: &[f32], k: &[f32], v: &[f32]) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (n, d) = (s.n, s.d);
    let nkv = n / s.group;
    let rows = q.len() / d.max(1);
    let (mut out, mut max, mut sum) = (vec![0f32; rows * d], vec![0f32; rows], vec![0f32; rows]);
    for &seq in &s.seqs {
        for h in 0..n {
            for i in 0..seq.sq {
                let r = (seq.q0 + i) * n + h;
                let scores = scores(s, seq, i, s.row(q, n, seq.q0 + i, h), k, h / s.group);
                let m = scores.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
                let e: Vec<f32> = scores.iter().map(|x| (x - m).exp()).collect();
                let total: f32 = e.iter().sum();
                for (j, w) in e.iter().enumerate() {
                    let vj = s.row(v, nkv, seq.k0 + j, h / s.group);
                    out[r * d..][..d]
                        .iter_mut()
                        .zip(vj)
                        .for_each(|(o, x)| *o += w / total * x);
                }
                (max[r], sum[r]) = if scores.is_empty() {
                    (0.0, 0.0)
                } else {
                    (m, total)
                };
            }
        }
    }
    (out, max, sum)
}

/// The scaled scores of query row `qi` (row `i` of `seq`) against the keys it sees.
fn scores(s: &Spec, seq: Seq, i: usize, qi: &[f32], k: &[f32], hk: usize) -> Vec<f32> {
    let nkv = s.n / s.group;
    (0..s.visible(seq, i))
        .map(|j| s.scale * dot(qi, s.row(k, nkv, seq.k0 + j, hk)))
        .collect()
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// `y += a·x`.
fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    y.iter_mut().zip(x).for_each(|(y, x)| *y += a * x);
}

/// The inputs of the gradient, read.
struct Saved {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    dy: Vec<f32>,
    out: Vec<f32>,
    max: Vec<f32>,
    sum: Vec<f32>,
}

/// dq `[T, N, D]`, dk and dv `[Tk, Nkv, D]` (kv heads summed over their query heads).
fn backward(s: &Spec, x: &Saved) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (n, d, g) = (s.n, s.d, s.group);
    let (mut dq, mut dk, mut dv) = (
        vec![0f32; x.q.len()],
        vec![0f32; x.k.len()],
        vec![0f32; x.v.len()],
    );
    for &seq in &s.seqs {
        for h in 0..n {
            let hk = h / g;
            for i in 0..seq.sq {
                let (t, r) = (seq.q0 + i, (seq.q0 + i) * n + h);
                let (qi, doi) = (s.row(&x.q, n, t, h), s.row(&x.dy, n, t, h));
                let di = dot(doi, s.row(&x.out, n, t, h));
                for (j, sc) in scores(s, seq, i, qi, &x.k, hk).into_iter().enumerate() {
                    let p = (sc - x.max[r * 8]).exp() / x.sum[r * 8];
                    let kr = ((seq.k0 + j) * (n / g) + hk) * d;
                    let dp = dot(doi, &x.v[kr..][..d]);
                    let ds = p * (dp - di);
                    axpy(&mut dv[kr..][..d], p, doi);
                    axpy(&mut dq[r * d..][..d], s.scale * ds, &x.k[kr..][..d]);
                    axpy(&mut dk[kr..][..d], s.scale * ds, qi);
                }
            }
        }
    }
    (dq, dk, dv)
}

/// Softmax statistics `[T, N, 8]`, fp32.
fn stats(p: &Plan, v: &View, name: &str, q: &View) -> Result<(), aclnnStatus> {
    p.dtype(v, name, ACL_FLOAT)?;
    p.shape(v, name, &[q.dims[0], q.dims[1], 8])
}

/// Each value 8 times, the lanes of the softmax statistics.
fn lanes(x: &[f32]) -> Vec<f32> {
    x.iter().flat_map(|&v| [v; 8]).collect()
}

/// Fail the launch when sparse mode 3's mask is not the causal one.
fn check_mask(s: &Spec) -> Result<(), String> {
    match &s.mask {
        Some(m) if !is_causal_mask(m) => {
            Err("attenMask is not the 2048×2048 causal optimisation mask".into())
        }
        _ => Ok(()),
    }
}

#[no_mangle]
pub extern "C" fn aclnnFlashAttentionVarLenScoreGetWorkspaceSize(
    query: *const aclTensor,
    key: *const aclTensor,
    value: *const aclTensor,
    real_shift_optional: *const aclTensor,
    drop_mask_optional: *const aclTensor,
    padding_mask_optional: *const aclTensor,
    atten_mask_optional: *const aclTensor,
    prefix_optional: *const aclIntArray,
    actual_seq_q_len_optional: *const aclIntArray,
    actual_seq_kv_len_optional: *const aclIntArray,
    scale_value: f64,
    keep_prob: f64,
    pre_tokens: i64,
    next_tokens: i64,
    head_num: i64,
    input_layout: *mut c_char,
    inner_precise: i64,
    sparse_mode: i64,
    softmax_max_out: *const aclTensor,
    softmax_sum_out: *const aclTensor,
    softmax_out_out: *const aclTensor,
    attention_out_out: *const aclTensor,
    workspace_size: Ws,
    executor: Ex,
) -> aclnnStatus {
    let args = Args {
        atten_mask: atten_mask_optional,
        prefix: prefix_optional,
        q_lens: actual_seq_q_len_optional,
        kv_lens: actual_seq_kv_len_optional,
        scale: scale_value,
        keep_prob,
        pre_tokens,
        next_tokens,
        head_num,
        layout: input_layout,
        inner_precise,
        sparse_mode,
    };
    phase1(
        "aclnnFlashAttentionVarLenScore",
        workspace_size,
        executor,
        |p| {
            let (q, k, v) = (
                p.input(query, "query")?,
                p.input(key, "key")?,
                p.input(value, "value")?,
            );
            for (t, name) in [
                (real_shift_optional, "realShift"),
                (drop_mask_optional, "dropMask"),
                (padding_mask_optional, "paddingMask"),
            ] {
                p.absent(t, name)?;
            }
            let spec = spec(p, &q, &k, &v, &args)?;
            let max = p.output(softmax_max_out, "softmaxMaxOut")?;
            let sum = p.output(softmax_sum_out, "softmaxSumOut")?;
            p.unused(softmax_out_out, "softmaxOutOut")?;
            let out = p.output(attention_out_out, "attentionOutOut")?;
            stats(p, &max, "softmaxMaxOut", &q)?;
            stats(p, &sum, "softmaxSumOut", &q)?;
            p.like(&out, "attentionOutOut", &q)?;
            let kernel: Kernel = Box::new(move || {
                check_mask(&spec)?;
                let (o, m, s) = forward(&spec, &q.read(), &k.read(), &v.read());
                out.write(&o);
                max.write(&lanes(&m));
                sum.write(&lanes(&s));
                Ok(())
            });
            Ok((HEAVY, kernel))
        },
    )
}

#[no_mangle]
pub extern "C" fn aclnnFlashAttentionUnpaddingScoreGradGetWorkspaceSize(
    query: *const aclTensor,
    key_in: *const aclTensor,
    value: *const aclTensor,
    dy: *const aclTensor,
    pse_shift_optional: *const aclTensor,
    drop_mask_optional: *const aclTensor,
    padding_mask_optional: *const aclTensor,
    atten_mask_optional: *const aclTensor,
    softmax_max_optional: *const aclTensor,
    softmax_sum_optional: *const aclTensor,
    softmax_in_optional: *const aclTensor,
    attention_in_optional: *const aclTensor,
    prefix_optional: *const aclIntArray,
    actual_seq_q_len_optional: *const aclIntArray,
    actual_seq_kv_len_optional: *const aclIntArray,
    scale_value: f64,
    keep_prob: f64,
    pre_tokens: i64,
    next_tokens: i64,
    head_num: i64,
    input_layout: *mut c_char,
    inner_precise: i64,
    sparse_mode: i64,
    dq_out: *const aclTensor,
    dk_out: *const aclTensor,
    dv_out: *const aclTensor,
    dpse_out: *const aclTensor,
    workspace_size: Ws,
    executor: Ex,
) -> aclnnStatus {
    let args = Args {
        atten_mask: atten_mask_optional,
        prefix: prefix_optional,
        q_lens: actual_seq_q_len_optional,
        kv_lens: actual_seq_kv_len_optional,
        scale: scale_value,
        keep_prob,
        pre_tokens,
        next_tokens,
        head_num,
        layout: input_layout,
        inner_precise,
        sparse_mode,
    };
    phase1(
        "aclnnFlashAttentionUnpaddingScoreGrad",
        workspace_size,
        executor,
        |p| {
            let (q, k, v) = (
                p.input(query, "query")?,
                p.input(key_in, "keyIn")?,
                p.input(value, "value")?,
            );
            let dy = p.input(dy, "dy")?;
            for (t, name) in [
                (pse_shift_optional, "pseShift"),
                (drop_mask_optional, "dropMask"),
                (padding_mask_optional, "paddingMask"),
            ] {
                p.absent(t, name)?;
            }
            let spec = spec(p, &q, &k, &v, &args)?;
            let max = p.input(softmax_max_optional, "softmaxMax")?;
            let sum = p.input(softmax_sum_optional, "softmaxSum")?;
            p.unused(softmax_in_optional, "softmaxIn")?;
            let out = p.input(attention_in_optional, "attentionIn")?;
            let (dq, dk, dv) = (
                p.output(dq_out, "dqOut")?,
                p.output(dk_out, "dkOut")?,
                p.output(dv_out, "dvOut")?,
            );
            p.unused(dpse_out, "dpseOut")?;
            stats(p, &max, "softmaxMax", &q)?;
            stats(p, &sum, "softmaxSum", &q)?;
            for (t, name, like) in [
                (&dy, "dy", &q),
                (&out, "attentionIn", &q),
                (&dq, "dqOut", &q),
                (&dk, "dkOut", &k),
                (&dv, "dvOut", &k),
            ] {
                p.like(t, name, like)?;
            }
            let kernel: Kernel = Box::new(move || {
                check_mask(&spec)?;
                let saved = Saved {
                    q: q.read(),
                    k: k.read(),
                    v: v.read(),
                    dy: dy.read(),
                    out: out.read(),
                    max: max.read(),
                    sum: sum.read(),
                };
                let (gq, gk, gv) = backward(&spec, &saved);
                dq.write(&gq);
                dk.write(&gk);
                dv.write(&gv);
                Ok(())
            });
            Ok((HEAVY, kernel))
        },
    )
}
