//! bf16 matrix products, summed in f32 (products exact, sums in f32, input and output
//! denormals flushed), as the bf16 GEMMs of GPUs and NPUs compute them: the training matmuls of
//! `--bf16`, the bf16 attention, and on AMX the inference prefill on bf16 weights (read from the
//! inference panels as they are, [`panels_product`]). Two engines, chosen once per process
//! ([`engine`]):
//! - AMX tiles (Intel Advanced Matrix Extensions, `TDPBF16PS`, Sapphire Rapids and later): a
//!   tile product multiplies 16 × 32 bf16 by 32 × 16 bf16;
//! - elsewhere AVX512_BF16's `vdpbf16ps` (Zen 4, Cooper Lake and later): the panel kernel's
//!   bf16-pair tiles (`tensor/panel.rs`) — twice the work per cycle of an f32 FMA on Zen 4
//!   (on Sapphire Rapids, where the tiles are used, half of it).
//!
//! The left operand is read as row-major rows (borrowed where it already is one in whole
//! blocks, else copied zero-padded: rows to 32, the inner dimension to 32); the right one is
//! packed in the pair ("VNNI") layout both instructions read — for each 16 output columns, rows
//! of 16 (k, k + 1) pairs; operands stored transposed are moved in whole 32 × 32 (left) or
//! 16 × 16-pair (right) register transposes. Each task then computes
//! 32 × 32 blocks of the output (on four accumulator tiles, or 6-row register tiles), every
//! output summed over the whole inner dimension in a fixed order, so results do not depend on
//! the number of threads.
//!
//! Linux hands AMX state to a process only once asked (`arch_prctl(ARCH_REQ_XCOMP_PERM)`);
//! [`engine`] asks once. `MINDKIT_NO_AMX=1` leaves the tiles unused (to measure the other
//! engine on an AMX machine). Where neither engine runs, callers fall back to f32 products.

use super::gemm::Layout;
use super::transpose;
use crate::tensor::matmul::Store;
use crate::tensor::panel::{bf16_rows, has_bf16_pairs, rows_times_panel, Panel};
use crate::tensor::simd::narrow_bf16;
use rayon::prelude::*;

/// A bf16 operand of a product: `rows × cols` as the product reads it.
#[derive(Clone, Copy)]
pub struct Operand<'a> {
    pub bits: &'a [u16],
    pub layout: Layout,
    /// Elements from one stored row to the next; `None`: stored rows are contiguous.
    pub pitch: Option<usize>,
}

impl<'a> Operand<'a> {
    /// Stored as the product reads it.
    pub fn rows(bits: &'a [u16]) -> Self {
        Operand {
            bits,
            layout: Layout::Rows,
            pitch: None,
        }
    }

    /// Stored as its transpose.
    pub fn transposed(bits: &'a [u16]) -> Self {
        Operand {
            bits,
            layout: Layout::Transposed,
            pitch: None,
        }
    }

    /// Stored rows and their length for a logical `rows × cols` operand.
    fn stored(&self, (rows, cols): (usize, usize)) -> (usize, usize) {
        match self.layout {
            Layout::Rows => (rows, cols),
            Layout::Transposed => (cols, rows),
        }
    }

    /// Elements from one stored row to the next of a logical `rows × cols` operand.
    fn pitch_of(&self, shape: (usize, usize)) -> usize {
        self.pitch.unwrap_or(self.stored(shape).1)
    }

    /// Whether the bits hold the whole logical `rows × cols` operand.
    fn holds(&self, shape: (usize, usize)) -> bool {
        let (n, len) = self.stored(shape);
        n == 0 || len == 0 || self.bits.len() >= (n - 1) * self.pitch_of(shape) + len
    }
}

/// Where a product lands.
pub enum Dst<'a> {
    /// f32 rows `stride` apart, overwritten or accumulated; `transposed`: the destination holds
    /// the product's transpose (product element (i, j) at `out[j·stride + i]`).
    F32 {
        out: &'a mut [f32],
        stride: usize,
        store: Store,
        transposed: bool,
    },
    /// Contiguous bf16 rows, written with the f32 sums plus `bias` (per column), rounded to
    /// nearest even (every element is written).
    Bf16 {
        out: &'a mut [std::mem::MaybeUninit<u16>],
        bias: Option<&'a [f32]>,
    },
}

/// Output rows and columns of one block (2 × 2 tiles of 16 × 16).
const BLOCK: usize = 32;
/// Inner elements one tile product consumes.
const DEPTH: usize = 32;
/// Output blocks along each axis one task computes.
const TASK_BLOCKS: (usize, usize) = (4, 8);

/// The hardware that multiplies bf16 here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    /// AMX tiles.
    Tiles,
    /// AVX512_BF16's `vdpbf16ps` on AVX-512 registers.
    Pairs,
}

/// The engine bf16 products run on in this process, if any (CPU, kernel, permission and
/// `MINDKIT_NO_AMX`).
pub fn engine() -> Option<Engine> {
    static ENGINE: std::sync::OnceLock<Option<Engine>> = std::sync::OnceLock::new();
    *ENGINE.get_or_init(|| {
        let tiles_unwanted = std::env::var_os("MINDKIT_NO_AMX").is_some_and(|v| v == "1");
        if !tiles_unwanted && detect() {
            return Some(Engine::Tiles);
        }
        pairs_run().then_some(Engine::Pairs)
    })
}

/// Whether the [`Engine::Pairs`] kernels run here: AVX512_BF16, and AVX-512BW for the packing
/// transposes (`super::transpose`).
fn pairs_run() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512bw") && has_bf16_pairs()
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Whether bf16 products can run here (on either engine).
pub fn available() -> bool {
    engine().is_some()
}

/// Whether AMX bf16 tiles can be used in this process (CPU, kernel and permission).
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn detect() -> bool {
    use std::arch::x86_64::{__cpuid, __cpuid_count};
    // cpuid leaf 7 exists where the highest leaf (leaf 0's eax) is at least 7.
    let leaf7 = (__cpuid(0).eax >= 7).then(|| __cpuid_count(7, 0));
    let Some(leaf7) = leaf7 else { return false };
    const AMX_BF16: u32 = 1 << 22;
    const AMX_TILE: u32 = 1 << 24;
    // The packing transposes (`super::transpose`) use AVX-512BW, which every AMX CPU has.
    let avx512 = std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw");
    if leaf7.edx & (AMX_BF16 | AMX_TILE) != AMX_BF16 | AMX_TILE || !avx512 {
        return false;
    }
    // Linux's arch/x86/include/uapi/asm/prctl.h: ARCH_REQ_XCOMP_PERM; XFEATURE_XTILEDATA = 18.
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: arch_prctl with this request only changes which state the kernel saves for us.
    unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        ) == 0
    }
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn detect() -> bool {
    false
}

/// The left operand as tiles read it: row-major, `depth_p` (a multiple of [`DEPTH`]) apart,
/// at least `rows` rounded up to [`BLOCK`] rows. Borrowed where the operand already is one.
fn left_rows<'a>(
    a: Operand<'a>,
    (rows, depth): (usize, usize),
) -> (std::borrow::Cow<'a, [u16]>, usize) {
    let pitch = a.pitch_of((rows, depth));
    if a.layout == Layout::Rows
        && rows % BLOCK == 0
        && depth % DEPTH == 0
        && depth > 0
        && pitch == depth
    {
        return (std::borrow::Cow::Borrowed(&a.bits[..rows * depth]), depth);
    }
    let depth_p = depth.div_ceil(DEPTH).max(1) * DEPTH;
    let mut out = vec![0u16; rows.div_ceil(BLOCK) * BLOCK * depth_p];
    out.par_chunks_mut(BLOCK * depth_p)
        .enumerate()
        .for_each(|(b, block)| {
            let r0 = b * BLOCK;
            let live = (rows - r0).min(BLOCK);
            match a.layout {
                Layout::Rows => {
                    for (r, row) in block.chunks_exact_mut(depth_p).take(live).enumerate() {
                        row[..depth].copy_from_slice(&a.bits[(r0 + r) * pitch..][..depth]);
                    }
                }
                // Source row k holds column k of the operand: gather 32 of them at a time so
                // that their cache lines stay hot while each output row fills.
                Layout::Transposed => {
                    for k0 in (0..depth).step_by(DEPTH) {
                        let width = (depth - k0).min(DEPTH);
                        if (width, live) == (DEPTH, BLOCK) {
                            let src = &a.bits[k0 * pitch + r0..];
                            transpose::columns(src, pitch, &mut block[k0..], depth_p);
                            continue;
                        }
                        for (r, row) in block.chunks_exact_mut(depth_p).take(live).enumerate() {
                            for (q, d) in row[k0..k0 + width].iter_mut().enumerate() {
                                *d = a.bits[(k0 + q) * pitch + r0 + r];
                            }
                        }
                    }
                }
            }
        });
    (std::borrow::Cow::Owned(out), depth_p)
}

/// The right operand (`depth × cols`) in pair layout: for each 16 columns, `depth_p / 2` rows
/// of 16 `(k, k + 1)` pairs (as u32, k in the low half); columns padded to [`BLOCK`], depth to
/// [`DEPTH`] with zeros.
fn pack_right(b: Operand, (depth, cols): (usize, usize), depth_p: usize) -> Vec<u32> {
    // A task fills PAIR_ROWS pair rows of PANELS panels: the source rows it reads and the panel
    // rows it writes stay within few pages and cache sets (panels are a power of two apart).
    const PAIR_ROWS: usize = 32;
    // Each task's pair rows start at a multiple of 16 (see `whole_panel`).
    const _: () = assert!(PAIR_ROWS.is_multiple_of(TILE));
    const PANELS: usize = 16;
    let (pairs, panels) = (depth_p / 2, cols.div_ceil(BLOCK) * 2);
    let len = pairs * panels * TILE;
    let mut out: Vec<u32> = Vec::with_capacity(len);
    let dst = SharedU32(out.as_mut_ptr());
    let tasks = (pairs.div_ceil(PAIR_ROWS), panels.div_ceil(PANELS));
    (0..tasks.0 * tasks.1).into_par_iter().for_each(|task| {
        let (pi, ti) = (task / tasks.1, task % tasks.1);
        let p_range = pi * PAIR_ROWS..((pi + 1) * PAIR_ROWS).min(pairs);
        for t in ti * PANELS..((ti + 1) * PANELS).min(panels) {
            if let Some(pitch) = whole_panel(b, (depth, cols), (p_range.clone(), t)) {
                match b.layout {
                    Layout::Rows => {
                        for p in p_range.clone() {
                            let row = &b.bits[2 * p * pitch + t * TILE..];
                            // SAFETY: as below.
                            unsafe {
                                let dst = dst.at((t * pairs + p) * TILE);
                                transpose::interleave(row, &row[pitch..], dst)
                            };
                        }
                    }
                    Layout::Transposed => {
                        for p in p_range.clone().step_by(TILE) {
                            let mut block = [0u32; TILE * TILE];
                            let src = &b.bits[t * TILE * pitch + 2 * p..];
                            transpose::pairs(src, pitch, &mut block);
                            // SAFETY: as below, for the 16 consecutive pair rows from p.
                            unsafe {
                                std::ptr::copy_nonoverlapping(
                                    block.as_ptr(),
                                    dst.at((t * pairs + p) * TILE),
                                    TILE * TILE,
                                )
                            };
                        }
                    }
                }
                continue;
            }
            for p in p_range.clone() {
                let mut row = [0u32; TILE];
                pair_row(b, (depth, cols), (2 * p, t * TILE), &mut row);
                // SAFETY: (t, p) < (panels, pairs) addresses 16 elements inside the capacity
                // (written, never read while uninitialized); every (t, p) belongs to exactly
                // one task.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        row.as_ptr(),
                        dst.at((t * pairs + p) * TILE),
                        TILE,
                    )
                };
            }
        }
    });
    // SAFETY: the tasks wrote all (panels, pairs) rows of 16 elements.
    unsafe { out.set_len(len) };
    out
}

/// The stored row pitch of a right operand whose panel `t` is whole over the pair rows
/// `p_range` (its columns and both rows of each pair inside the operand; stored transposed, a
/// whole number of 16-row blocks): its pair rows are then built from whole registers — two
/// stored rows interleaved, or 16 × 16 pairs transposed. `p_range` starts at a multiple of 16.
fn whole_panel(
    b: Operand,
    (depth, cols): (usize, usize),
    (p_range, t): (std::ops::Range<usize>, usize),
) -> Option<usize> {
    let blocks = b.layout == Layout::Rows || p_range.len() % TILE == 0;
    let whole = (t + 1) * TILE <= cols && 2 * p_range.end <= depth && blocks;
    whole.then(|| b.pitch_of((depth, cols)))
}

/// Columns of a pair-layout panel (one tile's width).
const TILE: usize = BLOCK / 2;

/// A raw output the packing tasks write disjoint rows of.
#[derive(Clone, Copy)]
struct SharedU32(*mut u32);
// SAFETY: tasks write disjoint rows (see `pack_right`).
unsafe impl Send for SharedU32 {}
unsafe impl Sync for SharedU32 {}

impl SharedU32 {
    /// Element `i`'s place.
    ///
    /// # Safety
    /// `i` lies inside the allocation.
    unsafe fn at(self, i: usize) -> *mut u32 {
        // SAFETY: forwarded.
        unsafe { self.0.add(i) }
    }
}

/// Pair row `k / 2` of the panel from column `c0`: `(b[k][c], b[k + 1][c])` for 16 columns,
/// zero past the operand.
#[inline]
fn pair_row(b: Operand, (depth, cols): (usize, usize), (k, c0): (usize, usize), row: &mut [u32]) {
    let pitch = b.pitch_of((depth, cols));
    let at = |k: usize, c: usize| match b.layout {
        _ if k >= depth || c >= cols => 0,
        Layout::Rows => b.bits[k * pitch + c] as u32,
        Layout::Transposed => b.bits[c * pitch + k] as u32,
    };
    for (c, d) in row.iter_mut().enumerate() {
        *d = at(k, c0 + c) | at(k + 1, c0 + c) << 16;
    }
}

/// `a (rows × depth) · b (depth × cols) + bias` as new bf16 rows (see [`Dst::Bf16`]).
pub fn product_bf16(
    a: Operand,
    b: Operand,
    (rows, depth, cols): (usize, usize, usize),
    bias: Option<&[f32]>,
) -> Vec<u16> {
    let mut out = Vec::with_capacity(rows * cols);
    let dst = Dst::Bf16 {
        out: &mut out.spare_capacity_mut()[..rows * cols],
        bias,
    };
    matmul(a, b, (rows, depth, cols), dst);
    // SAFETY: the product wrote every one of the rows × cols elements.
    unsafe { out.set_len(rows * cols) };
    out
}

/// `dst = / += a (rows × depth) · b (depth × cols)` on this process's [`engine`], blocks of the
/// output in parallel. Call only where [`available`] is true.
///
/// # Panics
/// If an operand or the destination is smaller than its shape says.
pub fn matmul(a: Operand, b: Operand, shape: (usize, usize, usize), dst: Dst) {
    let engine = engine().expect("internal: bf16 product without a bf16 engine");
    matmul_on(engine, a, b, shape, dst);
}

/// [`matmul`] on `engine`, which must run here.
fn matmul_on(
    engine: Engine,
    a: Operand,
    b: Operand,
    (rows, depth, cols): (usize, usize, usize),
    dst: Dst,
) {
    assert!(
        a.holds((rows, depth)) && b.holds((depth, cols)) && dst_fits(&dst, (rows, cols)),
        "internal: bf16 product shapes"
    );
    if rows == 0 || cols == 0 {
        return;
    }
    let (left, depth_p) = left_rows(a, (rows, depth));
    let right = Right::Split(pack_right(b, (depth, cols), depth_p));
    multiply(engine, (&left, depth_p), &right, (rows, cols), dst);
}

/// Whether [`panels_product`] multiplies `n` rows by weights of inner dimension `k` on AMX
/// tiles here: prefill-sized products (decoding is faster on the pair kernel's one-row tiles),
/// whole tile steps.
pub fn tiles_read_panels(n: usize, k: usize) -> bool {
    engine() == Some(Engine::Tiles) && n >= BLOCK && k > 0 && k.is_multiple_of(DEPTH)
}

/// `x [n, k] · wᵀ [k, m]` for weights packed as `tensor::panel::Panels` of bf16 pairs (their
/// bytes, [`Panels::bf16_pairs`](crate::tensor::panel::Panels::bf16_pairs)): the rows of `x`
/// rounded to bf16, products summed in f32. `k` is a multiple of 32.
///
/// # Panics
/// If a buffer is smaller than its shape says, or `k` is not a multiple of 32.
pub fn panels_product(x: &[f32], panels: &[u8], (n, k, m): (usize, usize, usize)) -> Vec<f32> {
    let engine = engine().expect("internal: bf16 product without a bf16 engine");
    panels_product_on(engine, x, panels, (n, k, m))
}

/// [`panels_product`] on `engine`, which must run here.
fn panels_product_on(
    engine: Engine,
    x: &[f32],
    panels: &[u8],
    (n, k, m): (usize, usize, usize),
) -> Vec<f32> {
    assert!(
        k.is_multiple_of(DEPTH) && x.len() >= n * k && panels.len() >= m.div_ceil(BLOCK) * k * 64,
        "internal: bf16 panel product shapes"
    );
    let mut out = vec![0f32; n * m];
    if n == 0 || m == 0 || k == 0 {
        return out;
    }
    // Rows padded to whole blocks with zeros.
    let left = bf16_rows(x, (n, k), (n.div_ceil(BLOCK) * BLOCK, k));
    let dst = Dst::F32 {
        out: &mut out,
        stride: m,
        store: Store::Overwrite,
        transposed: false,
    };
    multiply(engine, (&left, k), &Right::SideBySide(panels), (n, m), dst);
    out
}

/// Whether `dst` holds a `rows × cols` product.
fn dst_fits(dst: &Dst, (rows, cols): (usize, usize)) -> bool {
    match dst {
        Dst::F32 {
            out,
            stride,
            transposed,
            ..
        } => {
            let (r, c) = if *transposed {
                (cols, rows)
            } else {
                (rows, cols)
            };
            *stride >= c && (r == 0 || out.len() >= (r - 1) * stride + c)
        }
        Dst::Bf16 { out, bias } => out.len() >= rows * cols && bias.is_none_or(|b| b.len() >= cols),
    }
}

/// The right operand in a pair layout the kernels read.
enum Right<'a> {
    /// [`pack_right`]'s: panels of 16 columns, `depth_p / 2` rows of 16 pairs each.
    Split(Vec<u32>),
    /// `Panels`' bf16 pairs: panels of 32 columns, each pair row the 16 pairs of columns 0..16,
    /// then those of columns 16..32.
    SideBySide(&'a [u8]),
}

impl Right<'_> {
    /// Where column block `cb`'s pairs lie: its first pair row, and in bytes the offset of
    /// columns 16..32 from columns 0..16 and that from one pair row to the next.
    fn block(&self, cb: usize, depth_p: usize) -> (*const u8, usize, usize) {
        const PAIR: usize = 4;
        match self {
            Right::Split(bits) => (
                bits[cb * BLOCK * depth_p / 2..].as_ptr() as *const u8,
                depth_p / 2 * TILE * PAIR,
                TILE * PAIR,
            ),
            Right::SideBySide(bytes) => (
                bytes[cb * depth_p / 2 * BLOCK * PAIR..].as_ptr(),
                TILE * PAIR,
                BLOCK * PAIR,
            ),
        }
    }
}

/// `dst = / += left · right`: `left` zero-padded rows (whole blocks of rows, `depth_p`
/// elements each), `right` packed for the same `depth_p`; blocks of the output in parallel.
fn multiply(
    engine: Engine,
    (left, depth_p): (&[u16], usize),
    right: &Right,
    (rows, cols): (usize, usize),
    dst: Dst,
) {
    let (row_blocks, col_blocks) = (rows.div_ceil(BLOCK), cols.div_ceil(BLOCK));
    let (row_tasks, col_tasks) = (
        row_blocks.div_ceil(TASK_BLOCKS.0),
        col_blocks.div_ceil(TASK_BLOCKS.1),
    );
    let sink = Sink::new(dst, cols);
    (0..row_tasks * col_tasks).into_par_iter().for_each(|task| {
        let (rt, ct) = (task % row_tasks, task / row_tasks);
        let rbs = rt * TASK_BLOCKS.0..((rt + 1) * TASK_BLOCKS.0).min(row_blocks);
        let cbs = ct * TASK_BLOCKS.1..((ct + 1) * TASK_BLOCKS.1).min(col_blocks);
        let mut acc = [0f32; BLOCK * BLOCK];
        // SAFETY: `engine` said AMX runs here.
        let _tiles = (engine == Engine::Tiles).then(|| unsafe { Tiles::configure() });
        for cb in cbs {
            for rb in rbs.clone() {
                let (r0, c0) = (rb * BLOCK, cb * BLOCK);
                let (a, b) = (left[r0 * depth_p..].as_ptr(), right.block(cb, depth_p));
                // SAFETY: the engine runs here (tiles configured for AMX); the left block's 32
                // rows of depth_p and the right block's depth_p / 2 pair rows of 32 columns
                // lie inside the buffers (whole blocks).
                unsafe {
                    match engine {
                        Engine::Tiles => block_product(a, b, depth_p, &mut acc),
                        Engine::Pairs => pair_block(a, b, depth_p, &mut acc),
                    }
                };
                let live = ((rows - r0).min(BLOCK), (cols - c0).min(BLOCK));
                // SAFETY: the block lies inside the product's rows × cols; tasks' blocks are
                // disjoint.
                unsafe { sink.put(&acc, (r0, c0), live) };
            }
        }
    });
}

/// A [`Dst`] that parallel tasks write disjoint blocks of.
struct Sink {
    out: *mut u8,
    stride: usize,
    kind: SinkKind,
}

// SAFETY: tasks write disjoint blocks (see `Sink::put`).
unsafe impl Send for Sink {}
unsafe impl Sync for Sink {}

enum SinkKind {
    F32 { store: Store, transposed: bool },
    Bf16 { bias: Option<*const f32> },
}

impl Sink {
    fn new(dst: Dst, cols: usize) -> Self {
        match dst {
            Dst::F32 {
                out,
                stride,
                store,
                transposed,
            } => Sink {
                out: out.as_mut_ptr() as *mut u8,
                stride,
                kind: SinkKind::F32 { store, transposed },
            },
            Dst::Bf16 { out, bias } => Sink {
                out: out.as_mut_ptr() as *mut u8,
                stride: cols,
                kind: SinkKind::Bf16 {
                    bias: bias.map(|b| b.as_ptr()),
                },
            },
        }
    }

    /// Writes the `live` rows and columns of a block's sums at `(r0, c0)` of the product.
    ///
    /// # Safety
    /// The block lies inside the product the destination was checked for; no other thread
    /// writes it meanwhile.
    unsafe fn put(
        &self,
        acc: &[f32; BLOCK * BLOCK],
        (r0, c0): (usize, usize),
        (live_r, live_c): (usize, usize),
    ) {
        let rows = acc.chunks_exact(BLOCK).take(live_r);
        // SAFETY (all arms): forwarded from the caller; offsets stay inside the destination.
        unsafe {
            match self.kind {
                SinkKind::F32 {
                    store,
                    transposed: false,
                } => {
                    for (r, sums) in rows.enumerate() {
                        let d = (self.out as *mut f32).add((r0 + r) * self.stride + c0);
                        if live_c == BLOCK {
                            // Whole rows as arrays: vector moves, not a memcpy call per row.
                            let (d, sums) = (&mut *(d as *mut [f32; BLOCK]), sums_array(sums));
                            match store {
                                Store::Overwrite => *d = *sums,
                                Store::Accumulate => add_row(d, sums),
                            }
                            continue;
                        }
                        let d = std::slice::from_raw_parts_mut(d, live_c);
                        match store {
                            Store::Overwrite => d.copy_from_slice(&sums[..live_c]),
                            Store::Accumulate => d.iter_mut().zip(sums).for_each(|(d, s)| *d += s),
                        }
                    }
                }
                SinkKind::F32 {
                    store,
                    transposed: true,
                } => {
                    for (r, sums) in rows.enumerate() {
                        for (c, &s) in sums[..live_c].iter().enumerate() {
                            let d = (self.out as *mut f32).add((c0 + c) * self.stride + r0 + r);
                            *d = if store == Store::Accumulate {
                                *d + s
                            } else {
                                s
                            };
                        }
                    }
                }
                SinkKind::Bf16 { bias } => {
                    let mut block = *acc;
                    if let Some(bias) = bias {
                        let bias = std::slice::from_raw_parts(bias.add(c0), live_c);
                        for row in block.chunks_exact_mut(BLOCK).take(live_r) {
                            row.iter_mut().zip(bias).for_each(|(v, b)| *v += b);
                        }
                    }
                    let mut bits = [0u16; BLOCK * BLOCK];
                    narrow_bf16(&block[..live_r * BLOCK], &mut bits[..live_r * BLOCK]);
                    for (r, row) in bits.chunks_exact(BLOCK).take(live_r).enumerate() {
                        // The destination may be uninitialized: written, never read.
                        let d = (self.out as *mut u16).add((r0 + r) * self.stride + c0);
                        if live_c == BLOCK {
                            (d as *mut [u16; BLOCK]).write_unaligned(*bits_array(row));
                        } else {
                            std::ptr::copy_nonoverlapping(row.as_ptr(), d, live_c);
                        }
                    }
                }
            }
        }
    }
}

/// A block row as an array (its length is [`BLOCK`]).
fn sums_array(row: &[f32]) -> &[f32; BLOCK] {
    row.try_into().expect("a block row")
}

/// A block row of bits as an array.
fn bits_array(row: &[u16]) -> &[u16; BLOCK] {
    row.try_into().expect("a block row")
}

/// `d += sums` over a whole block row.
#[inline]
fn add_row(d: &mut [f32; BLOCK], sums: &[f32; BLOCK]) {
    for (d, s) in d.iter_mut().zip(sums) {
        *d += s;
    }
}

/// The tile configuration `ldtilecfg` reads (palette 1): eight tiles of 16 rows × 64 bytes —
/// tmm0–3 the f32 accumulators, tmm4–5 left tiles, tmm6–7 right tiles.
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    bytes_per_row: [u16; 16],
    rows: [u8; 16],
    tail: [u8; 16],
}

const TILE_CONFIG: TileConfig = TileConfig {
    palette: 1,
    start_row: 0,
    reserved: [0; 14],
    bytes_per_row: [64, 64, 64, 64, 64, 64, 64, 64, 0, 0, 0, 0, 0, 0, 0, 0],
    rows: [16, 16, 16, 16, 16, 16, 16, 16, 0, 0, 0, 0, 0, 0, 0, 0],
    tail: [0; 16],
};

/// This thread's tiles configured as [`TILE_CONFIG`] while it lives; released on drop.
struct Tiles;

impl Tiles {
    /// # Safety
    /// The engine is [`Engine::Tiles`].
    unsafe fn configure() -> Self {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: forwarded; ldtilecfg reads the 64-byte configuration only.
        unsafe {
            std::arch::asm!("ldtilecfg [{}]", in(reg) &TILE_CONFIG, options(nostack, readonly))
        };
        Tiles
    }
}

impl Drop for Tiles {
    fn drop(&mut self) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: a configured thread releases its tile state.
        unsafe {
            std::arch::asm!("tilerelease", options(nostack, nomem))
        };
    }
}

/// [`block_product`] on `vdpbf16ps`.
///
/// # Safety
/// The engine is [`Engine::Pairs`]; the operands as for [`block_product`].
unsafe fn pair_block(
    left: *const u16,
    (right, hi, step): (*const u8, usize, usize),
    depth_p: usize,
    acc: &mut [f32; BLOCK * BLOCK],
) {
    const BF16: usize = 2;
    // SAFETY: forwarded.
    unsafe {
        let bits = right as *const u16;
        rows_times_panel(
            (acc.as_mut_ptr(), BLOCK),
            (left as *const u8, depth_p),
            Panel::Bf16Pairs {
                bits,
                step: step / BF16,
                hi: hi / BF16,
            },
            (BLOCK, depth_p, BLOCK),
            false,
        )
    }
}

/// `acc (32 × 32, row-major) = left (32 rows, depth_p apart) · right` (a column block's
/// `depth_p / 2` pair rows, `step` bytes apart, columns 16..32 `hi` bytes after 0..16).
///
/// # Safety
/// The thread's [`Tiles`] are configured; `left` holds 32 rows of `depth_p` elements, `right`
/// the block's pair rows; `depth_p` is a positive multiple of [`DEPTH`].
#[cfg(target_arch = "x86_64")]
unsafe fn block_product(
    left: *const u16,
    (right, hi, step): (*const u8, usize, usize),
    depth_p: usize,
    acc: &mut [f32; BLOCK * BLOCK],
) {
    use std::arch::asm;
    let left_stride = depth_p * 2;
    // SAFETY: per the contract above; the loop reads 64 bytes of each of the 16 rows of both
    // left tiles and of 16 pair rows of both right halves per step, depth_p / 32 steps; the
    // sums go to the four 16 × 16 quarters of acc (rows 128 bytes apart).
    unsafe {
        asm!(
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tilezero tmm3",
            "2:",
            "tileloadd tmm4, [{a0} + {sa}]",
            "tileloadd tmm5, [{a1} + {sa}]",
            "tileloadd tmm6, [{b0} + {sb}]",
            "tileloadd tmm7, [{b1} + {sb}]",
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tdpbf16ps tmm1, tmm4, tmm7",
            "tdpbf16ps tmm2, tmm5, tmm6",
            "tdpbf16ps tmm3, tmm5, tmm7",
            "add {a0}, 64",
            "add {a1}, 64",
            "add {b0}, {advance}",
            "add {b1}, {advance}",
            "dec {steps}",
            "jnz 2b",
            "tilestored [{c} + {sc}], tmm0",
            "lea {a0}, [{c} + {right_half}]",
            "tilestored [{a0} + {sc}], tmm1",
            "lea {a0}, [{c} + {lower_half}]",
            "tilestored [{a0} + {sc}], tmm2",
            "lea {a0}, [{c} + {lower_half} + {right_half}]",
            "tilestored [{a0} + {sc}], tmm3",
            a0 = inout(reg) left => _,
            a1 = inout(reg) left.add(16 * depth_p) => _,
            b0 = inout(reg) right => _,
            b1 = inout(reg) right.add(hi) => _,
            sa = in(reg) left_stride,
            sb = in(reg) step,
            advance = in(reg) 16 * step,
            steps = inout(reg) depth_p / DEPTH => _,
            c = in(reg) acc.as_mut_ptr(),
            sc = in(reg) BLOCK * 4,
            right_half = const 16 * 4,
            lower_half = const 16 * BLOCK * 4,
            options(nostack),
        );
    }
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn block_product(
    _: *const u16,
    _: (*const u8, usize, usize),
    _: usize,
    _: &mut [f32; BLOCK * BLOCK],
) {
    unreachable!("AMX exists on x86-64 only")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::cpu::testing::seeded;
    use crate::tensor::dtype::bf16_to_f32;

    fn bf16_of(v: &[f32]) -> Vec<u16> {
        let mut bits = vec![0u16; v.len()];
        narrow_bf16(v, &mut bits);
        bits
    }

    fn value(bits: &[u16], i: usize) -> f64 {
        bf16_to_f32(bits[i]) as f64
    }

    /// The product's element (i, j) in f64, from operands stored in `layouts`.
    fn want(
        (a, b): (&[u16], &[u16]),
        layouts: (Layout, Layout),
        (rows, depth, cols): (usize, usize, usize),
        (i, j): (usize, usize),
    ) -> f64 {
        (0..depth)
            .map(|k| {
                let ai = if layouts.0 == Layout::Rows {
                    i * depth + k
                } else {
                    k * rows + i
                };
                let bi = if layouts.1 == Layout::Rows {
                    k * cols + j
                } else {
                    j * depth + k
                };
                value(a, ai) * value(b, bi)
            })
            .sum()
    }

    /// The engines that run on this CPU (whatever `MINDKIT_NO_AMX` says).
    fn engines() -> Vec<Engine> {
        let tiles = detect().then_some(Engine::Tiles);
        tiles
            .into_iter()
            .chain(pairs_run().then_some(Engine::Pairs))
            .collect()
    }

    #[test]
    fn bf16_products_match_the_definition_in_every_layout_and_destination() {
        if engines().is_empty() {
            eprintln!("skipped: neither AMX nor AVX512_BF16 on this CPU");
        }
        for engine in engines() {
            products_match_the_definition(engine);
        }
    }

    fn products_match_the_definition(engine: Engine) {
        let layouts = [Layout::Rows, Layout::Transposed];
        for shape @ (rows, depth, cols) in [(70, 45, 66), (64, 64, 32), (1, 3, 1), (33, 96, 100)] {
            let a = bf16_of(&seeded(rows * depth, 1));
            let b = bf16_of(&seeded(depth * cols, 2));
            let bias = seeded(cols, 3);
            for (la, lb) in layouts.iter().flat_map(|&la| layouts.map(|lb| (la, lb))) {
                let operands = (
                    Operand {
                        bits: &a,
                        layout: la,
                        pitch: None,
                    },
                    Operand {
                        bits: &b,
                        layout: lb,
                        pitch: None,
                    },
                );
                let expect = |i, j| want((&a, &b), (la, lb), shape, (i, j));
                let stride = cols + 3;
                let mut out = vec![0.5f32; rows * stride];
                let dst = Dst::F32 {
                    out: &mut out,
                    stride,
                    store: Store::Accumulate,
                    transposed: false,
                };
                matmul_on(engine, operands.0, operands.1, shape, dst);
                let t_stride = rows + 2;
                let mut out_t = vec![0.25f32; cols * t_stride];
                let dst = Dst::F32 {
                    out: &mut out_t,
                    stride: t_stride,
                    store: Store::Overwrite,
                    transposed: true,
                };
                matmul_on(engine, operands.0, operands.1, shape, dst);
                let mut out_bf16 = vec![std::mem::MaybeUninit::new(0u16); rows * cols];
                let dst = Dst::Bf16 {
                    out: &mut out_bf16,
                    bias: Some(&bias),
                };
                matmul_on(engine, operands.0, operands.1, shape, dst);
                // SAFETY: initialized above.
                let out_bf16: Vec<u16> = out_bf16
                    .iter()
                    .map(|b| unsafe { b.assume_init() })
                    .collect();
                let tol = 1e-5 * depth as f64;
                for i in 0..rows {
                    for j in 0..cols {
                        let e = expect(i, j);
                        let got = out[i * stride + j] as f64 - 0.5;
                        assert!(
                            (got - e).abs() < tol,
                            "{engine:?} {la:?} {lb:?} ({i}, {j}): {got} vs {e}"
                        );
                        assert!((out_t[j * t_stride + i] as f64 - e).abs() < tol);
                        let e_bf16 = e + bias[j] as f64;
                        let got = value(&out_bf16, i * cols + j);
                        assert!(
                            (got - e_bf16).abs() < tol + e_bf16.abs() / 128.0,
                            "bf16 ({i}, {j})"
                        );
                    }
                    assert!(out[i * stride + cols..(i + 1) * stride]
                        .iter()
                        .all(|&v| v == 0.5));
                }
                assert!(out_t
                    .chunks_exact(t_stride)
                    .all(|r| r[rows..].iter().all(|&v| v == 0.25)));
                // Column blocks of wider matrices: the same sums.
                let (a_wide, b_wide) = (
                    pitched(operands.0, (rows, depth)),
                    pitched(operands.1, (depth, cols)),
                );
                let mut out_p = vec![0.5f32; rows * stride];
                let dst = Dst::F32 {
                    out: &mut out_p,
                    stride,
                    store: Store::Accumulate,
                    transposed: false,
                };
                matmul_on(engine, a_wide.as_operand(), b_wide.as_operand(), shape, dst);
                assert_eq!(out_p, out, "{engine:?} {la:?} {lb:?} pitched");
            }
        }
    }

    #[test]
    fn inference_panels_multiply_as_the_definition_on_every_engine() {
        use crate::tensor::panel::{PanelType, Panels};
        for engine in engines() {
            for (n, k, m) in [(70, 64, 66), (33, 96, 100), (32, 32, 5)] {
                let x = seeded(n * k, 4);
                let w = bf16_of(&seeded(m * k, 5));
                let bytes: Vec<u8> = w.iter().flat_map(|b| b.to_le_bytes()).collect();
                let panels = Panels::pack(PanelType::Bf16Pairs, &bytes, (m, k)).unwrap();
                let pairs = panels.bf16_pairs().unwrap();
                let got = panels_product_on(engine, &x, pairs, (n, k, m));
                let xb = bf16_of(&x);
                for (i, j) in (0..n).flat_map(|i| (0..m).map(move |j| (i, j))) {
                    let e: f64 = (0..k)
                        .map(|q| value(&xb, i * k + q) * value(&w, j * k + q))
                        .sum();
                    let got = got[i * m + j] as f64;
                    assert!((got - e).abs() < 1e-5 * k as f64, "{engine:?} ({i}, {j})");
                }
            }
        }
    }

    /// An operand's stored rows 5 elements apart, NaN between them.
    struct Pitched {
        bits: Vec<u16>,
        layout: Layout,
        pitch: usize,
    }

    impl Pitched {
        fn as_operand(&self) -> Operand<'_> {
            Operand {
                bits: &self.bits,
                layout: self.layout,
                pitch: Some(self.pitch),
            }
        }
    }

    fn pitched(op: Operand, shape: (usize, usize)) -> Pitched {
        let (n, len) = op.stored(shape);
        let pitch = len + 5;
        let mut bits = vec![0x7FC0u16; n * pitch];
        for (r, row) in bits.chunks_exact_mut(pitch).enumerate() {
            row[..len].copy_from_slice(&op.bits[r * len..(r + 1) * len]);
        }
        Pitched {
            bits,
            layout: op.layout,
            pitch,
        }
    }
}
