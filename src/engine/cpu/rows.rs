//! Row-parallel drivers for the element-wise operators: each task takes a block of rows, widens
//! every input's block into its own buffer (borrowed where the input is f32), runs the f32
//! kernel on it and narrows the block it computed straight into the result's storage. A bf16
//! operator so makes no whole-tensor f32 copies, and all of it runs on every thread.

use super::{narrow_half, packed, zeroed, CpuTensor, Data};
use crate::engine::Result;
use crate::tensor::DType;
use rayon::prelude::*;
use std::ops::Range;

/// Elements in one task's block of rows (its f32 buffers stay in L2).
const BLOCK_ELEMENTS: usize = 1 << 14;

/// Rows per task for rows of `cols` elements: fixed by the shape alone, so that per-block
/// partial sums, and so results, do not depend on the number of threads.
pub fn block_rows(cols: usize) -> usize {
    (BLOCK_ELEMENTS / cols.max(1)).max(1)
}

/// Per-task buffers: one per input, one for the output block.
type Buffers<const N: usize> = ([Vec<f32>; N], Vec<f32>);

fn buffers<const N: usize>() -> Buffers<N> {
    (std::array::from_fn(|_| Vec::new()), Vec::new())
}

/// Rows `rows` of each input as f32, borrowed or widened into that input's buffer.
fn widened<'a, const N: usize>(
    inputs: &[&'a CpuTensor; N],
    rows: &Range<usize>,
    bufs: &'a mut [Vec<f32>; N],
) -> [&'a [f32]; N] {
    let mut bufs = bufs.iter_mut();
    std::array::from_fn(|i| {
        let buf = bufs.next().expect("one buffer per input");
        inputs[i].row_block(rows.start, rows.end, buf)
    })
}

/// A new tensor of `shape` stored in `dtype`, `kernel(rows, inputs' rows, its rows)` writing
/// every element of each block of `block` rows (all inputs have the output's row count); the
/// kernel's per-block results come back in block order.
pub fn map_rows<R: Send, const N: usize>(
    inputs: [&CpuTensor; N],
    (shape, dtype): (Vec<usize>, DType),
    block: usize,
    kernel: impl Fn(Range<usize>, [&[f32]; N], &mut [f32]) -> R + Sync,
) -> (CpuTensor, Vec<R>) {
    let n = shape.first().copied().unwrap_or(1);
    let cols: usize = shape[1..].iter().product();
    let chunk = (block * cols).max(1);
    let rows_of = |b: usize| b * block..((b + 1) * block).min(n);
    let (data, results) = match dtype {
        DType::BF16 | DType::F16 => {
            let mut bits = zeroed(n * cols);
            let results = bits
                .par_chunks_mut(chunk)
                .enumerate()
                .map_init(buffers::<N>, |(ins, out), (b, bits)| {
                    let rows = rows_of(b);
                    out.resize(bits.len(), 0.0);
                    let r = kernel(rows.clone(), widened(&inputs, &rows, ins), out);
                    narrow_half(out, dtype, bits);
                    r
                })
                .collect();
            (Data::Half(dtype, bits), results)
        }
        _ => {
            let mut values = zeroed(n * cols);
            let results = values
                .par_chunks_mut(chunk)
                .enumerate()
                .map_init(buffers::<N>, |(ins, _), (b, out)| {
                    let rows = rows_of(b);
                    kernel(rows.clone(), widened(&inputs, &rows, ins), out)
                })
                .collect();
            (Data::F32(values), results)
        }
    };
    (CpuTensor::holding(shape, data), results)
}

/// `kernel(rows, x's rows, inputs' rows)` updating `x` in place, blocks of `block` rows in
/// parallel (a half tensor's block widened, updated and rounded back).
pub fn update_rows<const N: usize>(
    op: &'static str,
    x: &mut CpuTensor,
    inputs: [&CpuTensor; N],
    block: usize,
    kernel: impl Fn(Range<usize>, &mut [f32], [&[f32]; N]) + Sync,
) -> Result<()> {
    let (n, cols) = (x.rows(), x.cols());
    let chunk = (block * cols).max(1);
    let rows_of = |b: usize| b * block..((b + 1) * block).min(n);
    match x.data_mut() {
        Data::F32(values) => values.par_chunks_mut(chunk).enumerate().for_each_init(
            buffers::<N>,
            |(ins, _), (b, out)| {
                let rows = rows_of(b);
                kernel(rows.clone(), out, widened(&inputs, &rows, ins));
            },
        ),
        Data::Half(dtype, bits) => {
            let dtype = *dtype;
            bits.par_chunks_mut(chunk).enumerate().for_each_init(
                buffers::<N>,
                |(ins, out), (b, bits)| {
                    let rows = rows_of(b);
                    out.resize(bits.len(), 0.0);
                    crate::tensor::simd::widen(bits, dtype, out);
                    kernel(rows.clone(), out, widened(&inputs, &rows, ins));
                    narrow_half(out, dtype, bits);
                },
            )
        }
        Data::Panels(_) => return Err(packed(op)),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::cpu::testing::seeded;

    /// 37 rows of 1000: blocks of 16, 16 and 5 rows.
    fn inputs(dtype: DType) -> (CpuTensor, CpuTensor) {
        let shape = vec![37, 1000];
        let (a, b) = (seeded(37_000, 1), seeded(37_000, 2));
        (
            CpuTensor::stored(shape.clone(), a, dtype),
            CpuTensor::stored(shape, b, dtype),
        )
    }

    #[test]
    fn blocks_cover_every_row_once_in_order_in_either_storage() {
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let (a, b) = inputs(dtype);
            let block = block_rows(a.cols());
            assert_eq!(block, 16);
            let (sum, ranges) =
                map_rows([&a, &b], (a.shape.clone(), dtype), block, |r, [a, b], o| {
                    assert_eq!(
                        (a.len(), b.len(), o.len()),
                        (r.len() * 1000, r.len() * 1000, r.len() * 1000)
                    );
                    o.iter_mut()
                        .zip(a.iter().zip(b))
                        .for_each(|(o, (a, b))| *o = a + b);
                    r
                });
            assert_eq!(ranges, [0..16, 16..32, 32..37]);
            let whole: Vec<f32> = a
                .values()
                .iter()
                .zip(b.values().iter())
                .map(|(a, b)| a + b)
                .collect();
            let want = CpuTensor::stored(a.shape.clone(), whole, dtype);
            assert_eq!(sum.dtype(), dtype);
            assert_eq!(sum.values(), want.values(), "{dtype:?}");

            let mut x = a.clone();
            update_rows("test", &mut x, [&b], block, |_, x, [b]| {
                x.iter_mut().zip(b).for_each(|(x, b)| *x += b)
            })
            .unwrap();
            assert_eq!(x.dtype(), dtype);
            assert_eq!(x.values(), want.values(), "{dtype:?} in place");
        }
    }
}
