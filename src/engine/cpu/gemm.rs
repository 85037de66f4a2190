//! f32 matrix products on strided views, through the `gemm` crate (its kernels pick AVX-512,
//! AVX2 or scalar code at run time): the forms a forward and a backward pass need —
//! `x·wᵀ`, `dy·w`, `dw += dyᵀ·x` — and the blocked attention products.

/// A matrix in a buffer: element (i, j) at `ptr + i·row_stride + j·col_stride`.
#[derive(Clone, Copy)]
pub struct Strided {
    ptr: *const f32,
    row_stride: isize,
    col_stride: isize,
}

// SAFETY: a Strided is a read-only view; the functions that take one state what they read.
unsafe impl Send for Strided {}
unsafe impl Sync for Strided {}

impl Strided {
    /// Rows `row_stride` apart, columns contiguous, starting at `data[offset]`.
    pub fn rows(data: &[f32], offset: usize, row_stride: usize) -> Self {
        Strided {
            // SAFETY: callers address only elements inside `data` (see gemm_into).
            ptr: data[offset..].as_ptr(),
            row_stride: row_stride as isize,
            col_stride: 1,
        }
    }

    /// The transpose of [`Strided::rows`]: element (i, j) is `data[offset + j·stride + i]`.
    pub fn columns(data: &[f32], offset: usize, stride: usize) -> Self {
        Strided {
            ptr: data[offset..].as_ptr(),
            row_stride: 1,
            col_stride: stride as isize,
        }
    }
}

/// How the product lands in the destination.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Store {
    /// `dst = scale · lhs·rhs`.
    Overwrite,
    /// `dst += scale · lhs·rhs`.
    Accumulate,
}

/// `dst (m × n, rows dst_stride apart) = / += scale · lhs (m × k) · rhs (k × n)`,
/// single-threaded (callers parallelize over blocks).
///
/// # Safety
/// Every element the shapes and strides address lies inside live buffers, and no other
/// thread touches the m × n elements of `dst` meanwhile.
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm_into(
    dst: *mut f32,
    dst_stride: usize,
    (m, n, k): (usize, usize, usize),
    lhs: Strided,
    rhs: Strided,
    scale: f32,
    store: Store,
) {
    if m == 0 || n == 0 {
        return;
    }
    // SAFETY: forwarded from the caller.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            1,
            dst_stride as isize,
            store == Store::Accumulate,
            lhs.ptr,
            lhs.col_stride,
            lhs.row_stride,
            rhs.ptr,
            rhs.col_stride,
            rhs.row_stride,
            1.0,
            scale,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

/// Rows of the output each parallel task computes.
const TASK_ROWS: usize = 64;

/// `out [n, m] = / += a [n, k] · b`, where `b` is `[k, m]` row-major (`b_t` false) or the
/// transpose of a row-major `[m, k]` (`b_t` true); row blocks of the output in parallel.
pub fn matmul(
    a: &[f32],
    b: &[f32],
    b_t: bool,
    (n, k, m): (usize, usize, usize),
    out: &mut [f32],
    store: Store,
) {
    use rayon::prelude::*;
    assert!(
        a.len() >= n * k && b.len() >= k * m && out.len() >= n * m,
        "internal: matmul shapes"
    );
    let rhs = if b_t {
        Strided::columns(b, 0, k)
    } else {
        Strided::rows(b, 0, m)
    };
    out[..n * m]
        .par_chunks_mut(TASK_ROWS * m)
        .enumerate()
        .for_each(|(t, block)| {
            let rows = block.len() / m;
            let lhs = Strided::rows(a, t * TASK_ROWS * k, k);
            // SAFETY: the task writes its own `rows × m` block; lhs addresses rows of `a`
            // inside its `n × k`, rhs the `k × m` of `b` (asserted above).
            unsafe { gemm_into(block.as_mut_ptr(), m, (rows, m, k), lhs, rhs, 1.0, store) };
        });
}

/// `dw [m, k] += dyᵀ · x` for `dy [n, m]`, `x [n, k]` (the weight gradient of `y = x·wᵀ`):
/// row blocks of `dw` in parallel, each summing over all n rows in order.
pub fn matmul_tn_acc(dy: &[f32], x: &[f32], (n, m, k): (usize, usize, usize), dw: &mut [f32]) {
    use rayon::prelude::*;
    assert!(
        dy.len() >= n * m && x.len() >= n * k && dw.len() >= m * k,
        "internal: matmul shapes"
    );
    dw[..m * k]
        .par_chunks_mut(TASK_ROWS * k)
        .enumerate()
        .for_each(|(t, block)| {
            let rows = block.len() / k;
            let lhs = Strided::columns(dy, t * TASK_ROWS, m);
            let rhs = Strided::rows(x, 0, k);
            // SAFETY: the task writes its own `rows × k` block of dw; lhs reads columns
            // t·64.. of dy (n × m), rhs all of x (n × k), both inside (asserted above).
            unsafe {
                gemm_into(
                    block.as_mut_ptr(),
                    k,
                    (rows, k, n),
                    lhs,
                    rhs,
                    1.0,
                    Store::Accumulate,
                )
            };
        });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::cpu::testing::seeded;

    fn naive(
        a: &[f32],
        b: &[f32],
        (n, k, m): (usize, usize, usize),
        at: impl Fn(usize, usize) -> usize,
    ) -> Vec<f32> {
        let mut out = vec![0f32; n * m];
        for i in 0..n {
            for j in 0..m {
                out[i * m + j] = (0..k).map(|l| a[i * k + l] * b[at(l, j)]).sum();
            }
        }
        out
    }

    #[test]
    fn products_match_the_definition() {
        let (n, k, m) = (70, 9, 66);
        let a = seeded(n * k, 1);
        let b = seeded(k * m, 2);
        let mut out = vec![0f32; n * m];
        matmul(&a, &b, false, (n, k, m), &mut out, Store::Overwrite);
        let want = naive(&a, &b, (n, k, m), |l, j| l * m + j);
        assert!(out.iter().zip(&want).all(|(x, y)| (x - y).abs() < 1e-5));
        matmul(&a, &b, true, (n, k, m), &mut out, Store::Accumulate);
        let want_t = naive(&a, &b, (n, k, m), |l, j| j * k + l);
        assert!(out
            .iter()
            .zip(want.iter().zip(&want_t))
            .all(|(x, (y, z))| (x - y - z).abs() < 1e-5));
        let dy = seeded(n * m, 3);
        let mut dw = vec![1f32; m * k];
        matmul_tn_acc(&dy, &a, (n, m, k), &mut dw);
        for j in 0..m {
            for l in 0..k {
                let want: f32 = 1.0 + (0..n).map(|i| dy[i * m + j] * a[i * k + l]).sum::<f32>();
                assert!((dw[j * k + l] - want).abs() < 1e-4, "{j},{l}");
            }
        }
    }
}
