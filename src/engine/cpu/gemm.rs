//! f32 matrix products: the forms a forward and a backward pass need — `x·wᵀ`, `dy·w`,
//! `dw += dyᵀ·x` — on the AVX-512 panel kernel where the CPU has it (the `gemm` crate's
//! stable builds stop at AVX2), else on the `gemm` crate through [`gemm_into`] (the blocked
//! attention products on strided views call it directly).

use super::transpose;
use crate::tensor::matmul::{gemm_into, Store, Strided};
use crate::tensor::panel::{has_panel_kernel, rows_times_panel, Panel, PANEL};
use crate::tensor::SharedOut;

/// How an operand is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// Row-major as the product reads it.
    Rows,
    /// The product reads its transpose: a logical `r × c` operand stored as `c × r` row-major.
    Transposed,
}

/// A contiguous f32 operand of [`product`].
#[derive(Clone, Copy)]
pub struct Matrix<'a> {
    pub values: &'a [f32],
    pub layout: Layout,
}

impl<'a> Matrix<'a> {
    /// Stored as the product reads it.
    pub fn rows(values: &'a [f32]) -> Self {
        Matrix {
            values,
            layout: Layout::Rows,
        }
    }

    /// Stored as its transpose.
    pub fn transposed(values: &'a [f32]) -> Self {
        Matrix {
            values,
            layout: Layout::Transposed,
        }
    }

    /// The logical `rows × cols` operand from row `r0` on, as a strided view.
    fn strided(&self, (rows, cols): (usize, usize), r0: usize) -> Strided {
        match self.layout {
            Layout::Rows => Strided::rows(self.values, r0 * cols, cols),
            Layout::Transposed => Strided::columns(self.values, r0, rows),
        }
    }
}

/// `out (m × n, contiguous) = / += lhs (m × k) · rhs (k × n)`, blocks of the output in
/// parallel. Where the CPU has AVX-512 the AVX-512 panel kernel computes it (`rhs` packed as
/// 32-column panels once, each output summed over the inner dimension in slices of
/// [`PANEL_DEPTH`], in order); elsewhere the `gemm` crate's kernels do. Either way every
/// output is summed in an order that does not depend on the number of threads.
///
/// # Panics
/// If an operand or `out` is smaller than its shape says.
pub fn product(
    lhs: Matrix,
    rhs: Matrix,
    (m, k, n): (usize, usize, usize),
    out: &mut [f32],
    store: Store,
) {
    assert!(
        lhs.values.len() >= m * k && rhs.values.len() >= k * n && out.len() >= m * n,
        "internal: product shapes"
    );
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if store == Store::Overwrite {
            out[..m * n].fill(0.0);
        }
        return;
    }
    if has_panel_kernel() {
        panel_product(lhs, rhs, (m, k, n), out, store);
    } else {
        crate_product(lhs, rhs, (m, k, n), out, store);
    }
}

/// Output rows of one parallel task of [`crate_product`].
const TASK_ROWS: usize = 64;

/// [`product`] on the `gemm` crate: row blocks of the output in parallel.
fn crate_product(
    lhs: Matrix,
    rhs: Matrix,
    (m, k, n): (usize, usize, usize),
    out: &mut [f32],
    store: Store,
) {
    use rayon::prelude::*;
    let right = rhs.strided((k, n), 0);
    out[..m * n]
        .par_chunks_mut(TASK_ROWS * n)
        .enumerate()
        .for_each(|(t, block)| {
            let rows = block.len() / n;
            let left = lhs.strided((m, k), t * TASK_ROWS);
            // SAFETY: the task writes its own `rows × n` block; left addresses rows
            // t·64.. of lhs inside its m × k, right the k × n of rhs (asserted by `product`).
            unsafe { gemm_into(block.as_mut_ptr(), n, (rows, n, k), left, right, 1.0, store) };
        });
}

/// Inner elements one pass of the panel kernel sums before it adds to the output: a
/// 256 × 32 panel slice (32 KiB) stays in L1 while every row of a task reads it.
const PANEL_DEPTH: usize = 256;
/// Output rows of one panel-kernel task.
const PANEL_TASK_ROWS: usize = 96;
/// Panels (of [`PANEL`] output columns) one panel-kernel task covers at most.
const TASK_PANELS: usize = 8;

/// [`product`] on the AVX-512 panel kernel (call only where [`has_panel_kernel`]).
fn panel_product(
    lhs: Matrix,
    rhs: Matrix,
    (m, k, n): (usize, usize, usize),
    out: &mut [f32],
    store: Store,
) {
    use rayon::prelude::*;
    let mut run = |panels: &mut Vec<f32>| {
        pack_panels(rhs, (k, n), panels);
        let count = n.div_ceil(PANEL);
        // A left operand stored transposed is moved into rows once per task: let one task
        // cover every panel then.
        let per_task = match lhs.layout {
            Layout::Rows => count.div_ceil(count.div_ceil(TASK_PANELS)),
            Layout::Transposed => count,
        };
        let (row_tasks, col_tasks) = (m.div_ceil(PANEL_TASK_ROWS), count.div_ceil(per_task));
        let dst = SharedOut(out.as_mut_ptr());
        let panels = &panels[..count * k * PANEL];
        (0..row_tasks * col_tasks)
            .into_par_iter()
            .for_each_init(Vec::new, |buf, task| {
                let (rt, ct) = (task % row_tasks, task / row_tasks);
                let rows = rt * PANEL_TASK_ROWS..((rt + 1) * PANEL_TASK_ROWS).min(m);
                let (left, pitch) = left_rows(lhs, (m, k), rows.clone(), buf);
                for k0 in (0..k).step_by(PANEL_DEPTH) {
                    let depth = (k - k0).min(PANEL_DEPTH);
                    let accumulate = k0 > 0 || store == Store::Accumulate;
                    for p in ct * per_task..((ct + 1) * per_task).min(count) {
                        let width = (n - p * PANEL).min(PANEL);
                        // SAFETY: the kernel runs here; the task's rows × width outputs at
                        // column p·32 lie inside out (m × n, asserted by `product`) and no
                        // other task writes them; `left` holds rows.len() rows of k elements
                        // `pitch` apart; panel p holds k × 32 elements, of which rows
                        // k0..k0 + depth are read.
                        unsafe {
                            rows_times_panel(
                                (dst.at(rows.start * n + p * PANEL), n),
                                (left[k0..].as_ptr() as *const u8, pitch),
                                Panel::F32(panels[(p * k + k0) * PANEL..].as_ptr()),
                                (rows.len(), depth, width),
                                accumulate,
                            )
                        };
                    }
                }
            });
    };
    // A product nested in another on this thread (a rayon worker that took on other work while
    // waiting) packs into a buffer of its own.
    PACKED.with(|packed| match packed.try_borrow_mut() {
        Ok(mut panels) => run(&mut panels),
        Err(_) => run(&mut Vec::new()),
    });
}

thread_local! {
    /// The packed right operand of the calling thread's last product, kept so that the next
    /// one reuses its pages (the largest, an output layer's weight, is as big as the weight).
    static PACKED: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Rows `rows` of the `m × k` operand as row-major rows (`.1` elements apart): borrowed where
/// it is stored so, else transposed into `buf`.
fn left_rows<'a>(
    lhs: Matrix<'a>,
    (m, k): (usize, usize),
    rows: std::ops::Range<usize>,
    buf: &'a mut Vec<f32>,
) -> (&'a [f32], usize) {
    match lhs.layout {
        Layout::Rows => (&lhs.values[rows.start * k..rows.end * k], k),
        Layout::Transposed => {
            // Rows a multiple of 4 KiB apart would share L1 sets: the kernel reads six at once.
            let pitch = k + 16;
            buf.clear();
            buf.resize(rows.len() * pitch, 0.0);
            let stored = &lhs.values[rows.start..];
            transpose::f32_matrix(stored, m, (k, rows.len()), buf, pitch);
            (buf, pitch)
        }
    }
}

/// `rhs (k × n)` into `panels` as ⌈n / 32⌉ panels of `k × 32` (row q of panel p holds columns
/// `32p .. 32p + 32` of row q, zero past n), panels in parallel. `panels` only grows.
fn pack_panels(rhs: Matrix, (k, n): (usize, usize), panels: &mut Vec<f32>) {
    use rayon::prelude::*;
    let len = n.div_ceil(PANEL) * k * PANEL;
    if panels.len() < len {
        panels.resize(len, 0.0);
    }
    panels[..len]
        .par_chunks_mut(k * PANEL)
        .enumerate()
        .for_each(|(p, panel)| {
            let (j0, width) = (p * PANEL, (n - p * PANEL).min(PANEL));
            match rhs.layout {
                Layout::Rows => {
                    for (q, row) in panel.chunks_exact_mut(PANEL).enumerate() {
                        row[..width].copy_from_slice(&rhs.values[q * n + j0..][..width]);
                        row[width..].fill(0.0);
                    }
                }
                Layout::Transposed => {
                    transpose::f32_matrix(&rhs.values[j0 * k..], k, (width, k), panel, PANEL);
                    if width < PANEL {
                        for row in panel.chunks_exact_mut(PANEL) {
                            row[width..].fill(0.0);
                        }
                    }
                }
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::cpu::testing::seeded;

    /// `lhs (m × k) · rhs (k × n)` summed in f64, operands stored in the layouts given.
    fn naive(lhs: Matrix, rhs: Matrix, (m, k, n): (usize, usize, usize)) -> Vec<f64> {
        let at = |x: &Matrix, (rows, cols): (usize, usize), i: usize, j: usize| match x.layout {
            Layout::Rows => x.values[i * cols + j] as f64,
            Layout::Transposed => x.values[j * rows + i] as f64,
        };
        let mut out = vec![0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                out[i * n + j] = (0..k)
                    .map(|l| at(&lhs, (m, k), i, l) * at(&rhs, (k, n), l, j))
                    .sum();
            }
        }
        out
    }

    type Kernel = fn(Matrix, Matrix, (usize, usize, usize), &mut [f32], Store);

    /// Every layout pair, both stores, shapes with partial blocks, panels and depth slices.
    fn check_products(kernel: Kernel) {
        let layouts = [Layout::Rows, Layout::Transposed];
        for (m, k, n) in [(70, 9, 66), (100, 300, 33), (5, 600, 64)] {
            let (a, b) = (seeded(m * k, 1), seeded(k * n, 2));
            for (la, lb) in layouts.iter().flat_map(|&la| layouts.map(|lb| (la, lb))) {
                let lhs = Matrix {
                    values: &a,
                    layout: la,
                };
                let rhs = Matrix {
                    values: &b,
                    layout: lb,
                };
                let want = naive(lhs, rhs, (m, k, n));
                let tolerance = 1e-5 * k as f64;
                let mut out = vec![f32::NAN; m * n];
                kernel(lhs, rhs, (m, k, n), &mut out, Store::Overwrite);
                let close = |o: &[f32], add: f64| {
                    o.iter()
                        .zip(&want)
                        .all(|(o, w)| (*o as f64 - w - add).abs() < tolerance)
                };
                assert!(close(&out, 0.0), "{la:?} {lb:?} {m}x{k}x{n}");
                out.fill(1.0);
                kernel(lhs, rhs, (m, k, n), &mut out, Store::Accumulate);
                assert!(close(&out, 1.0), "{la:?} {lb:?} {m}x{k}x{n} accumulated");
            }
        }
    }

    #[test]
    fn products_match_the_definition() {
        check_products(product);
        check_products(crate_product);
        if has_panel_kernel() {
            check_products(panel_product);
        }
    }

    #[test]
    fn a_product_nested_in_another_on_its_thread_packs_on_its_own() {
        let (m, k, n) = (50, 70, 90);
        let (a, b) = (seeded(m * k, 4), seeded(k * n, 5));
        let (lhs, rhs) = (Matrix::rows(&a), Matrix::transposed(&b));
        let mut want = vec![0f32; m * n];
        product(lhs, rhs, (m, k, n), &mut want, Store::Overwrite);
        // What a rayon worker that takes on another product while it waits inside one sees:
        // this thread's packing buffer already borrowed.
        let nested = PACKED.with_borrow_mut(|_outer| {
            let mut out = vec![0f32; m * n];
            product(lhs, rhs, (m, k, n), &mut out, Store::Overwrite);
            out
        });
        assert!(nested == want);
    }

    #[test]
    fn an_empty_inner_dimension_overwrites_with_zeros() {
        let mut out = vec![f32::NAN; 6];
        product(
            Matrix::rows(&[]),
            Matrix::rows(&[]),
            (2, 0, 3),
            &mut out,
            Store::Overwrite,
        );
        assert_eq!(out, vec![0.0; 6]);
        product(
            Matrix::rows(&[]),
            Matrix::rows(&[]),
            (2, 0, 3),
            &mut out,
            Store::Accumulate,
        );
        assert_eq!(out, vec![0.0; 6]);
    }
}
