//! The one door to the `gemm` crate: an f32 product on strided views, single-threaded, that
//! the CPU engine's products (`engine/cpu/gemm.rs`, its attention blocks) and the LoRA merge's
//! general case (`ckpt/lora`) all call, so they compute with the same kernel parameters.

/// A matrix in a buffer: element (i, j) at `ptr + i·row_stride + j·col_stride`. Only the
/// pointer is kept: callers of [`gemm_into`] address only elements inside the slice a view was
/// made from.
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
    /// Element (i, j) at `data[i·row_stride + j·col_stride]`.
    pub fn new(data: &[f32], row_stride: usize, col_stride: usize) -> Self {
        Strided {
            ptr: data.as_ptr(),
            row_stride: row_stride as isize,
            col_stride: col_stride as isize,
        }
    }

    /// Rows `row_stride` apart, columns contiguous, starting at `data[offset]`.
    pub fn rows(data: &[f32], offset: usize, row_stride: usize) -> Self {
        Strided::new(&data[offset..], row_stride, 1)
    }

    /// The transpose of [`Strided::rows`]: element (i, j) is `data[offset + j·stride + i]`.
    pub fn columns(data: &[f32], offset: usize, stride: usize) -> Self {
        Strided::new(&data[offset..], 1, stride)
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
