//! The operators' contract on shapes, checked once for every backend: each function takes
//! the operator's inputs on any [`Device`] and fails with [`EngineError::Invalid`] naming the
//! operator and what does not fit.

use super::dropout::Mask;
use super::{ensure, AttentionShape, Device, EngineError, Result, Segment};
use std::ops::Range;

fn rows(shape: &[usize]) -> usize {
    shape.first().copied().unwrap_or(1)
}

fn cols(shape: &[usize]) -> usize {
    shape.iter().skip(1).product()
}

fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// `Invalid` unless `t` has `shape`.
pub fn expect_shape<D: Device + ?Sized>(
    d: &D,
    op: &'static str,
    what: &str,
    t: &D::Tensor,
    shape: &[usize],
) -> Result<()> {
    let got = d.shape(t);
    ensure(got == shape, op, || {
        format!("{what} is {got:?}, expected {shape:?}")
    })
}

/// `Invalid` unless `n` elements from `at` lie within `t`.
pub fn expect_range<D: Device>(
    d: &D,
    op: &'static str,
    what: &str,
    (t, at): (&D::Tensor, usize),
    n: usize,
) -> Result<()> {
    let numel: usize = d.shape(t).iter().product();
    ensure(
        at.checked_add(n).is_some_and(|end| end <= numel),
        op,
        || format!("{what}: elements {at}..{} of {numel}", at.saturating_add(n)),
    )
}

/// The elements of a `[rows, cols]` block, which must not overflow.
pub fn block(op: &'static str, (rows, cols): (usize, usize)) -> Result<usize> {
    rows.checked_mul(cols).ok_or_else(|| EngineError::Invalid {
        op,
        msg: format!("a block of {rows} × {cols} elements"),
    })
}

/// Token ids below the `[v, h]` table's rows.
pub fn ids<D: Device>(d: &D, op: &'static str, table: &D::Tensor, ids: &[u32]) -> Result<()> {
    let v = rows(d.shape(table));
    match ids
        .iter()
        .find(|&&id| id as usize >= v && id != super::NO_ROW)
    {
        Some(bad) => Err(EngineError::Invalid {
            op,
            msg: format!("token id {bad} outside the table's {v} rows"),
        }),
        None => Ok(()),
    }
}

/// [`super::Backend::embedding_bwd`].
pub fn embedding_bwd<D: Device>(
    d: &D,
    dy: &D::Tensor,
    token_ids: &[u32],
    dtable: &D::Tensor,
) -> Result<()> {
    expect_shape(
        d,
        "embedding_bwd",
        "dy",
        dy,
        &[token_ids.len(), cols(d.shape(dtable))],
    )?;
    ids(d, "embedding_bwd", dtable, token_ids)
}

/// [`super::Backend::select_rows`].
pub fn select_rows<D: Device>(d: &D, x: &D::Tensor, selected: &[usize]) -> Result<()> {
    let n = rows(d.shape(x));
    ensure(selected.iter().all(|&r| r < n), "select_rows", || {
        format!("rows {selected:?} of {n}")
    })
}

/// [`super::Backend::index_add_rows`].
pub fn index_add_rows<D: Device>(
    d: &D,
    dst: &D::Tensor,
    src: &D::Tensor,
    selected: &[usize],
) -> Result<()> {
    let (n, c) = (rows(d.shape(dst)), cols(d.shape(dst)));
    expect_shape(d, "index_add_rows", "src", src, &[selected.len(), c])?;
    ensure(selected.iter().all(|&r| r < n), "index_add_rows", || {
        format!("rows {selected:?} of {n}")
    })
}

/// [`super::Backend::permute`] and [`super::Backend::unpermute`]: `x` has the rows the
/// dispatch moves (its tokens, or its routed choices).
pub fn dispatched<D: Device + ?Sized>(
    d: &D,
    op: &'static str,
    x: &D::Tensor,
    expected: usize,
) -> Result<()> {
    let n = rows(d.shape(x));
    ensure(n == expected, op, || {
        format!("{n} rows where the dispatch moves {expected}")
    })
}

/// [`super::Backend::softmax_topk`]: `k` of the logits' `[n, E]` columns; their width.
pub fn softmax_topk<D: Device + ?Sized>(d: &D, logits: &D::Tensor, k: usize) -> Result<usize> {
    let shape = d.shape(logits);
    let width = cols(shape);
    ensure(shape.len() == 2 && k <= width, "softmax_topk", || {
        format!("top-{k} of logits {shape:?}")
    })?;
    Ok(width)
}

/// [`super::Backend::scale_rows`].
pub fn scale_rows<D: Device>(d: &D, x: &D::Tensor, w: &D::Tensor) -> Result<()> {
    expect_shape(d, "scale_rows", "w", w, &[rows(d.shape(x))])?;
    ensure(
        d.dtype(w) == crate::tensor::DType::F32,
        "scale_rows",
        || format!("weights of {:?}, expected F32", d.dtype(w)),
    )
}

/// [`super::Backend::row_dots`].
pub fn row_dots<D: Device>(d: &D, x: &D::Tensor, y: &D::Tensor) -> Result<()> {
    expect_shape(d, "row_dots", "y", y, d.shape(x))
}

/// [`super::Backend::rms_norm`].
/// Returns the groups per row: the row's width over γ's.
pub fn rms_norm<D: Device>(d: &D, x: &D::Tensor, gamma: &D::Tensor) -> Result<usize> {
    let (h, g) = (cols(d.shape(x)), numel(d.shape(gamma)));
    ensure(g > 0 && h % g == 0, "rms_norm", || {
        format!("γ of {g} for rows of {h}")
    })?;
    Ok(h / g)
}

/// [`super::Backend::rms_norm_bwd`].
pub fn rms_norm_bwd<D: Device>(
    d: &D,
    (dy, x, rstd): (&D::Tensor, &D::Tensor, &D::Tensor),
    gamma: &D::Tensor,
    dgamma: Option<&D::Tensor>,
) -> Result<()> {
    let groups = rms_norm(d, x, gamma)?;
    expect_shape(d, "rms_norm_bwd", "dy", dy, d.shape(x))?;
    expect_shape(
        d,
        "rms_norm_bwd",
        "rstd",
        rstd,
        &[rows(d.shape(x)) * groups],
    )?;
    let g = numel(d.shape(gamma));
    ensure(
        dgamma.is_none_or(|dg| numel(d.shape(dg)) == g),
        "rms_norm_bwd",
        || "γ / dγ length".into(),
    )
}

/// [`super::Backend::layer_norm`]: the rows, γ and β each one row wide.
pub fn layer_norm<D: Device + ?Sized>(
    d: &D,
    x: &D::Tensor,
    gamma: &D::Tensor,
    beta: &D::Tensor,
) -> Result<usize> {
    let h = cols(d.shape(x));
    let (g, b) = (numel(d.shape(gamma)), numel(d.shape(beta)));
    ensure(g == h && b == h, "layer_norm", || {
        format!("γ of {g} and β of {b} for rows of {h}")
    })?;
    Ok(rows(d.shape(x)))
}

/// [`super::Backend::layer_norm_bwd`]: the rows.
pub fn layer_norm_bwd<D: Device + ?Sized>(
    d: &D,
    (dy, x, stats): (&D::Tensor, &D::Tensor, &D::Tensor),
    gamma: &D::Tensor,
) -> Result<usize> {
    let n = layer_norm(d, x, gamma, gamma)?;
    expect_shape(d, "layer_norm_bwd", "dy", dy, d.shape(x))?;
    expect_shape(d, "layer_norm_bwd", "mean and rstd", stats, &[2 * n])?;
    Ok(n)
}

/// [`super::Backend::matmul`]: `(n, k, m)`.
pub fn matmul<D: Device>(
    d: &D,
    x: &D::Tensor,
    w: &D::Tensor,
    bias: Option<&D::Tensor>,
) -> Result<(usize, usize, usize)> {
    let (n, k, m) = (rows(d.shape(x)), cols(d.shape(x)), rows(d.shape(w)));
    ensure(cols(d.shape(w)) == k, "matmul", || {
        format!("[{n}, {k}] by {:?}ᵀ", d.shape(w))
    })?;
    if let Some(b) = bias {
        let len = numel(d.shape(b));
        ensure(len == m, "matmul", || {
            format!("bias of {len} for {m} outputs")
        })?;
    }
    Ok((n, k, m))
}

/// [`super::Backend::matmul_bwd`]: `(n, k, m)`.
pub fn matmul_bwd<D: Device>(
    d: &D,
    (dy, x, w): (&D::Tensor, &D::Tensor, &D::Tensor),
    dw: Option<&D::Tensor>,
    dbias: Option<&D::Tensor>,
) -> Result<(usize, usize, usize)> {
    let (n, k, m) = (rows(d.shape(x)), cols(d.shape(x)), rows(d.shape(w)));
    expect_shape(d, "matmul_bwd", "dy", dy, &[n, m])?;
    if let Some(dw) = dw {
        expect_shape(d, "matmul_bwd", "dw", dw, &[m, k])?;
    }
    ensure(
        dbias.is_none_or(|b| numel(d.shape(b)) == m),
        "matmul_bwd",
        || "dbias length".into(),
    )?;
    Ok((n, k, m))
}

/// [`super::Backend::grouped_matmul`]: `(n, k, m)`.
pub fn grouped_matmul<D: Device>(
    d: &D,
    x: &D::Tensor,
    w: &[&D::Tensor],
    counts: &[usize],
) -> Result<(usize, usize, usize)> {
    let op = "grouped_matmul";
    let (n, k) = (rows(d.shape(x)), cols(d.shape(x)));
    let first = w.first().ok_or_else(|| EngineError::Invalid {
        op,
        msg: "no groups".into(),
    })?;
    let m = rows(d.shape(first));
    for (g, wg) in w.iter().enumerate() {
        expect_shape(d, op, &format!("w[{g}]"), wg, &[m, k])?;
        same_dtype(d, op, wg, first)?;
    }
    ensure(counts.len() == w.len(), op, || {
        format!("{} group sizes for {} weights", counts.len(), w.len())
    })?;
    ensure(counts.iter().sum::<usize>() == n, op, || {
        format!("group sizes {counts:?} do not add up to the {n} rows")
    })?;
    Ok((n, k, m))
}

/// [`super::Backend::grouped_matmul_bwd`]: `(n, k, m)`.
pub fn grouped_matmul_bwd<D: Device>(
    d: &D,
    (dy, x): (&D::Tensor, &D::Tensor),
    w: &[&D::Tensor],
    counts: &[usize],
    dw: &[Option<&mut D::Tensor>],
) -> Result<(usize, usize, usize)> {
    let op = "grouped_matmul_bwd";
    let (n, k, m) = grouped_matmul(d, x, w, counts)?;
    expect_shape(d, op, "dy", dy, &[n, m])?;
    ensure(dw.len() == w.len(), op, || {
        format!("{} weight gradients for {} weights", dw.len(), w.len())
    })?;
    for (g, dwg) in dw.iter().enumerate() {
        if let Some(dwg) = dwg {
            expect_shape(d, op, &format!("dw[{g}]"), dwg, &[m, k])?;
        }
    }
    Ok((n, k, m))
}

/// [`super::Backend::split_qkv`].
pub fn split_qkv<D: Device>(d: &D, qkv: &D::Tensor, s: AttentionShape) -> Result<()> {
    let width = s.groups * (s.heads / s.groups + 2) * s.head_dim;
    ensure(cols(d.shape(qkv)) == width, "split_qkv", || {
        format!("{:?} for {s:?}", d.shape(qkv))
    })
}

/// [`super::Backend::merge_qkv`] (and the `q`, `k`, `v` of attention): each `[n, heads·d]`
/// or `[n, groups·d]`.
pub fn heads<D: Device>(
    d: &D,
    op: &'static str,
    (q, k, v): (&D::Tensor, &D::Tensor, &D::Tensor),
    s: AttentionShape,
) -> Result<usize> {
    let n = rows(d.shape(q));
    expect_shape(d, op, "q", q, &[n, s.heads * s.head_dim])?;
    expect_shape(d, op, "k", k, &[n, s.groups * s.head_dim])?;
    expect_shape(d, op, "v", v, &[n, s.groups * s.head_dim])?;
    Ok(n)
}

/// [`super::Backend::rope`].
pub fn rope<D: Device>(
    d: &D,
    x: &D::Tensor,
    (cos, sin): (&D::Tensor, &D::Tensor),
    head_dim: usize,
) -> Result<()> {
    let (xs, cs) = (d.shape(x), d.shape(cos));
    ensure(
        cs == d.shape(sin)
            && rows(cs) == rows(xs)
            && cols(cs) > 0
            && head_dim >= 2 * cols(cs)
            && cols(xs).is_multiple_of(head_dim),
        "rope",
        || format!("x {xs:?} of heads {head_dim} with cos/sin {cs:?}"),
    )
}

/// [`super::Backend::attention`]: the rows.
pub fn attention<D: Device>(
    d: &D,
    qkv: (&D::Tensor, &D::Tensor, &D::Tensor),
    segments: &[Range<usize>],
    s: AttentionShape,
) -> Result<usize> {
    let n = heads(d, "attention", qkv, s)?;
    super::check_segments("attention", segments, n)?;
    Ok(n)
}

/// [`super::Backend::attention_bwd`] (the saved statistics are the backend's own).
pub fn attention_bwd<D: Device>(
    d: &D,
    d_o: &D::Tensor,
    qkv: (&D::Tensor, &D::Tensor, &D::Tensor),
    o: &D::Tensor,
    segments: &[Range<usize>],
    s: AttentionShape,
) -> Result<usize> {
    let n = heads(d, "attention_bwd", qkv, s)?;
    for (what, t) in [("dO", d_o), ("o", o)] {
        expect_shape(d, "attention_bwd", what, t, d.shape(qkv.0))?;
    }
    super::check_segments("attention_bwd", segments, n)?;
    Ok(n)
}

/// A dropout mask (if any) with one row per row of the tensor it masks, `n`.
pub fn mask(op: &'static str, mask: Option<&Mask>, n: usize) -> Result<()> {
    let Some(m) = mask else { return Ok(()) };
    ensure(m.rows.len() == n, op, || {
        format!("a dropout mask of {} rows for {n} rows", m.rows.len())
    })
}

/// A key selection's rows are the pass's (none without one).
pub fn selection(op: &'static str, selection: Option<&super::Selection>, n: usize) -> Result<()> {
    let Some(sel) = selection else { return Ok(()) };
    ensure(sel.rows() == n, op, || {
        format!("a key selection of {} rows for {n} rows", sel.rows())
    })
}

/// [`super::Backend::dropout`]: a matrix, one mask row per row.
pub fn dropout<D: Device>(d: &D, x: &D::Tensor, m: &Mask) -> Result<()> {
    let shape = d.shape(x);
    ensure(shape.len() == 2, "dropout", || {
        format!("x is {shape:?}, not a matrix")
    })?;
    mask("dropout", Some(m), rows(shape))
}

/// [`super::Backend::kv_store`]: each segment inside a `[slots, capacity, width]` cache.
pub fn kv_store<D: Device>(
    d: &D,
    cache: &D::Tensor,
    x: &D::Tensor,
    segments: &[Segment],
) -> Result<()> {
    let width = d.shape(cache)[2];
    ensure(
        numel(d.shape(x)) == segments.iter().map(|s| s.len).sum::<usize>() * width,
        "kv_store",
        || "rows and segments disagree".into(),
    )?;
    in_cache(d, "kv_store", cache, segments)
}

/// Every segment inside the cache's slots and capacity.
fn in_cache<D: Device>(
    d: &D,
    op: &'static str,
    cache: &D::Tensor,
    segments: &[Segment],
) -> Result<()> {
    let (slots, capacity) = (d.shape(cache)[0], d.shape(cache)[1]);
    match segments
        .iter()
        .find(|s| s.slot >= slots || s.past + s.len > capacity)
    {
        Some(s) => Err(EngineError::Invalid {
            op,
            msg: format!("segment {s:?} outside the KV cache of {slots} × {capacity}"),
        }),
        None => Ok(()),
    }
}

/// [`super::Backend::cached_attention`]: the rows.
pub fn cached_attention<D: Device>(
    d: &D,
    q: &D::Tensor,
    cache: &D::Tensor,
    segments: &[Segment],
    s: AttentionShape,
) -> Result<usize> {
    let rows: usize = segments.iter().map(|seg| seg.len).sum();
    expect_shape(d, "cached_attention", "q", q, &[rows, s.heads * s.head_dim])?;
    let width = d.shape(cache)[2];
    ensure(width == s.groups * s.head_dim, "cached_attention", || {
        format!("cache rows of {width} for {s:?}")
    })?;
    in_cache(d, "cached_attention", cache, segments)?;
    Ok(rows)
}

/// [`super::Backend::swiglu`] and its backward (`dy`).
pub fn swiglu<D: Device>(d: &D, x: &D::Tensor, dy: Option<&D::Tensor>) -> Result<()> {
    let (n, w) = (rows(d.shape(x)), cols(d.shape(x)));
    ensure(w.is_multiple_of(2), "swiglu", || format!("odd width {w}"))?;
    match dy {
        Some(dy) => expect_shape(d, "swiglu_bwd", "dy", dy, &[n, w / 2]),
        None => Ok(()),
    }
}

/// [`super::Backend::squared_relu_bwd`]: `dy` shaped as `x`.
pub fn squared_relu_bwd<D: Device>(d: &D, dy: &D::Tensor, x: &D::Tensor) -> Result<()> {
    expect_shape(d, "squared_relu_bwd", "dy", dy, d.shape(x))
}

/// [`super::Backend::cross_entropy`].
pub fn cross_entropy<D: Device>(d: &D, logits: &D::Tensor, labels: &[u32]) -> Result<()> {
    let (n, v) = (rows(d.shape(logits)), cols(d.shape(logits)));
    ensure(
        labels.len() == n
            && labels
                .iter()
                .all(|&l| (l as usize) < v || l == super::NO_ROW),
        "cross_entropy",
        || format!("{} labels below {v} for {n} rows", labels.len()),
    )
}

/// [`super::Backend::cross_entropy_bwd`].
pub fn cross_entropy_bwd<D: Device>(
    d: &D,
    logits: &D::Tensor,
    labels: &[u32],
    lse: &D::Tensor,
    dloss: &D::Tensor,
) -> Result<()> {
    let n = rows(d.shape(logits));
    expect_shape(d, "cross_entropy_bwd", "lse", lse, &[n])?;
    expect_shape(d, "cross_entropy_bwd", "dloss", dloss, &[n])?;
    ensure(labels.len() == n, "cross_entropy_bwd", || "labels".into())
}

/// [`super::Backend::adamw`].
pub fn adamw<D: Device>(
    d: &D,
    param: &D::Tensor,
    rest: [(&str, &D::Tensor); 3],
    model: Option<&D::Tensor>,
) -> Result<()> {
    let model = model.map(|t| ("model", t));
    rest.iter()
        .chain(model.as_ref())
        .try_for_each(|(what, t)| expect_shape(d, "adamw", what, t, d.shape(param)))
}

/// [`super::Backend::gather`] and [`super::Backend::scatter`]: the view lies within `x`, and
/// `other` (the new tensor's shape, or `y`'s) has as many elements.
pub fn strided<D: Device>(
    d: &D,
    op: &'static str,
    x: &D::Tensor,
    view: super::StridedView,
    other: &[usize],
) -> Result<()> {
    let numel: usize = d.shape(x).iter().product();
    ensure(view.end().is_some_and(|end| end <= numel), op, || {
        format!(
            "{view:?} reaches past the {numel} elements of {:?}",
            d.shape(x)
        )
    })?;
    let n: usize = other.iter().product();
    ensure(n == view.count(), op, || {
        format!("{view:?} has {} elements, {other:?} {n}", view.count())
    })
}

/// `a` and `b` of one dtype.
pub fn same_dtype<D: Device>(d: &D, op: &'static str, a: &D::Tensor, b: &D::Tensor) -> Result<()> {
    ensure(d.dtype(a) == d.dtype(b), op, || {
        format!("{:?} into {:?}", d.dtype(a), d.dtype(b))
    })
}
