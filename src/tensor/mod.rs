//! The floor everything else stands on: the one [`DType`] with the one bf16 rounding and
//! widening of a value (`dtype.rs`), host tensors (bytes + dtype + shape, slicing, casts) and
//! the SIMD kernels both the checkpoint formats and the CPU engine use (widen/narrow, dot,
//! exp-based loops, packed-panel matmul, the LoRA merge's low-rank update) and the one wrapper
//! over the `gemm` crate (`matmul.rs`). Imports nothing else of mindkit's; inside, no two files
//! import each other (`dtype` and `matmul` import nothing, `simd` only `dtype`).

pub mod dtype;
pub mod host;
pub(crate) mod matmul;
pub(crate) mod panel;
pub(crate) mod simd;

pub use dtype::DType;
pub use host::Tensor;

/// A raw pointer to disjoint parts of one output, shared by the tasks that write them.
#[derive(Clone, Copy)]
pub(crate) struct SharedOut(pub(crate) *mut f32);
// SAFETY: every task writes a region no other task touches (stated where it is used).
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}

impl SharedOut {
    /// The element `i` places in.
    ///
    /// # Safety
    /// `i` must lie inside the output.
    pub(crate) unsafe fn at(self, i: usize) -> *mut f32 {
        // SAFETY: forwarded from the caller.
        unsafe { self.0.add(i) }
    }

    /// The `n` elements from `i` as a slice.
    ///
    /// # Safety
    /// `i..i + n` must lie inside the output, and nothing else may touch it while the slice
    /// lives.
    pub(crate) unsafe fn slice<'a>(self, i: usize, n: usize) -> &'a mut [f32] {
        // SAFETY: forwarded from the caller.
        unsafe { std::slice::from_raw_parts_mut(self.0.add(i), n) }
    }
}
