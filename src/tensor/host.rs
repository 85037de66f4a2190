//! An in-memory tensor (little-endian bytes + dtype + shape) and the few layout moves a
//! checkpoint conversion needs: row/column slicing and concatenation, row padding, casts.
//! Every move copies bytes, so a round trip through them is bit-exact.

use super::dtype::{bf16_bits, bf16_to_f32, f8e4m3_to_f32};
use super::simd::narrow_bf16;
use super::DType;
use half::f16;
use rayon::prelude::*;

/// A conversion asked of a dtype that is not floating point (bool, integers).
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
pub enum CastError {
    /// Values cannot be written as this dtype.
    #[error("cannot cast to {}", .0.torch_name())]
    To(DType),
    /// Values of this dtype cannot be read as floats.
    #[error("cannot cast from {}", .0.torch_name())]
    From(DType),
}

/// A dense row-major tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    /// Element type.
    pub dtype: DType,
    /// Shape (1-D or 2-D in practice).
    pub shape: Vec<usize>,
    /// `numel × dtype.size()` little-endian bytes.
    pub data: Vec<u8>,
}

impl Tensor {
    /// Wrap bytes; the caller guarantees `data.len()` matches.
    pub fn new(dtype: DType, shape: Vec<usize>, data: Vec<u8>) -> Self {
        debug_assert_eq!(data.len(), shape.iter().product::<usize>() * dtype.size());
        Tensor { dtype, shape, data }
    }

    /// Bytes of one row (all dims but the first); a 1-D tensor's row is one element.
    pub fn row_bytes(&self) -> usize {
        self.shape[1..].iter().product::<usize>() * self.dtype.size()
    }

    /// Rows `from..to` along dim 0.
    pub fn rows(&self, from: usize, to: usize) -> Tensor {
        let rb = self.row_bytes();
        let mut shape = self.shape.clone();
        shape[0] = to - from;
        Tensor::new(self.dtype, shape, self.data[from * rb..to * rb].to_vec())
    }

    /// Concatenate along dim 0 (all parts share dtype and trailing dims).
    pub fn cat_rows(parts: &[Tensor]) -> Tensor {
        let first = &parts[0];
        let mut shape = first.shape.clone();
        shape[0] = parts.iter().map(|p| p.shape[0]).sum();
        let mut data = Vec::with_capacity(parts.iter().map(|p| p.data.len()).sum());
        parts.iter().for_each(|p| data.extend_from_slice(&p.data));
        Tensor::new(first.dtype, shape, data)
    }

    /// Columns `from..to` of a 2-D tensor.
    pub fn cols(&self, from: usize, to: usize) -> Tensor {
        let (rows, cols) = (self.shape[0], self.shape[1]);
        let es = self.dtype.size();
        let width = (to - from) * es;
        let mut data = Vec::with_capacity(rows * width);
        for r in 0..rows {
            let start = (r * cols + from) * es;
            data.extend_from_slice(&self.data[start..start + width]);
        }
        Tensor::new(self.dtype, vec![rows, to - from], data)
    }

    /// The transpose of a 2-D tensor (bytes moved, element by element, in blocks that stay in
    /// cache).
    pub fn transposed(&self) -> Tensor {
        const BLOCK: usize = 64;
        let (rows, cols, es) = (self.shape[0], self.shape[1], self.dtype.size());
        let mut data = vec![0u8; self.data.len()];
        for r0 in (0..rows).step_by(BLOCK) {
            for c0 in (0..cols).step_by(BLOCK) {
                for r in r0..(r0 + BLOCK).min(rows) {
                    for c in c0..(c0 + BLOCK).min(cols) {
                        let (from, to) = ((r * cols + c) * es, (c * rows + r) * es);
                        data[to..to + es].copy_from_slice(&self.data[from..from + es]);
                    }
                }
            }
        }
        Tensor::new(self.dtype, vec![cols, rows], data)
    }

    /// Concatenate 2-D tensors along dim 1.
    pub fn cat_cols(parts: &[Tensor]) -> Tensor {
        let rows = parts[0].shape[0];
        let es = parts[0].dtype.size();
        let cols: usize = parts.iter().map(|p| p.shape[1]).sum();
        let mut data = Vec::with_capacity(rows * cols * es);
        for r in 0..rows {
            for p in parts {
                let w = p.shape[1] * es;
                data.extend_from_slice(&p.data[r * w..(r + 1) * w]);
            }
        }
        Tensor::new(parts[0].dtype, vec![rows, cols], data)
    }

    /// Rows `from..to` of this tensor extended with copies of its last row (rows past the end
    /// are padding), without building the whole padded tensor.
    pub fn rows_padded(&self, from: usize, to: usize) -> Tensor {
        let have = self.shape[0];
        let rb = self.row_bytes();
        let mut data = Vec::with_capacity((to - from) * rb);
        data.extend_from_slice(&self.data[from.min(have) * rb..to.min(have) * rb]);
        let last = &self.data[(have - 1) * rb..have * rb];
        (from.max(have)..to).for_each(|_| data.extend_from_slice(last));
        let mut shape = self.shape.clone();
        shape[0] = to - from;
        Tensor::new(self.dtype, shape, data)
    }

    /// Convert between floating dtypes (f32 ⇄ bf16 ⇄ f16, round to nearest even).
    pub fn cast(self, to: DType) -> Result<Tensor, CastError> {
        if self.dtype == to {
            return Ok(self);
        }
        Tensor::from_f32(to, self.shape.clone(), &to_f32(&self)?)
    }

    /// A tensor of dtype `to` holding `values` (rounded to nearest even).
    pub fn from_f32(to: DType, shape: Vec<usize>, values: &[f32]) -> Result<Tensor, CastError> {
        let size = to.size();
        let mut data = vec![0u8; values.len() * size];
        data.par_chunks_mut(CHUNK * size)
            .zip(values.par_chunks(CHUNK))
            .try_for_each(|(out, v)| encode_f32(v, to, out))?;
        Ok(Tensor::new(to, shape, data))
    }
}

/// Elements per parallel work item of a cast.
const CHUNK: usize = 1 << 16;

/// Write `values` as little-endian `to` elements into `out` (`values.len() × size` bytes).
pub fn encode_f32(values: &[f32], to: DType, out: &mut [u8]) -> Result<(), CastError> {
    match to {
        DType::F32 => (out.chunks_exact_mut(4).zip(values))
            .for_each(|(o, x)| o.copy_from_slice(&x.to_le_bytes())),
        DType::BF16 => {
            // SAFETY: any two bytes are a valid u16.
            let (head, bits, tail) = unsafe { out.align_to_mut::<u16>() };
            if head.is_empty() && tail.is_empty() && cfg!(target_endian = "little") {
                narrow_bf16(values, bits);
            } else {
                (out.chunks_exact_mut(2).zip(values))
                    .for_each(|(o, &x)| o.copy_from_slice(&bf16_bits(x).to_le_bytes()));
            }
        }
        DType::F16 => (out.chunks_exact_mut(2).zip(values))
            .for_each(|(o, &x)| o.copy_from_slice(&f16::from_f32(x).to_le_bytes())),
        other => return Err(CastError::To(other)),
    }
    Ok(())
}

/// Decode the little-endian `dtype` elements of `bytes` into `out` (one f32 per element).
pub fn decode_f32(bytes: &[u8], dtype: DType, out: &mut [f32]) -> Result<(), CastError> {
    match dtype {
        DType::F32 => (out.iter_mut().zip(bytes.chunks_exact(4)))
            .for_each(|(v, c)| *v = f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        DType::BF16 => (out.iter_mut().zip(bytes.chunks_exact(2)))
            .for_each(|(v, c)| *v = bf16_to_f32(u16::from_le_bytes([c[0], c[1]]))),
        DType::F16 => (out.iter_mut().zip(bytes.chunks_exact(2)))
            .for_each(|(v, c)| *v = f16::from_le_bytes([c[0], c[1]]).to_f32()),
        DType::F8E4M3 => (out.iter_mut().zip(bytes)).for_each(|(v, &b)| *v = f8e4m3_to_f32(b)),
        other => return Err(CastError::From(other)),
    }
    Ok(())
}

/// The values of a floating tensor as f32.
pub fn to_f32(t: &Tensor) -> Result<Vec<f32>, CastError> {
    let size = t.dtype.size();
    let mut out = vec![0f32; t.data.len() / size];
    out.par_chunks_mut(CHUNK)
        .zip(t.data.par_chunks(CHUNK * size))
        .try_for_each(|(o, bytes)| decode_f32(bytes, t.dtype, o))?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(shape: Vec<usize>) -> Tensor {
        let n: usize = shape.iter().product();
        let data = (0..n as u32)
            .flat_map(|v| (v as f32).to_le_bytes())
            .collect();
        Tensor::new(DType::F32, shape, data)
    }

    #[test]
    fn chunks_round_trip() {
        let x = t(vec![6, 4]);
        let thirds: Vec<Tensor> = (0..3).map(|i| x.rows(2 * i, 2 * i + 2)).collect();
        assert_eq!(Tensor::cat_rows(&thirds), x);
        let halves = [x.cols(0, 2), x.cols(2, 4)];
        assert_eq!(Tensor::cat_cols(&halves), x);
        assert_eq!(halves[1].data[..4], 2f32.to_le_bytes());
    }

    #[test]
    fn resize_pads_with_last_row_and_truncates() {
        let x = t(vec![3, 2]);
        let p = x.rows_padded(0, 5);
        assert_eq!(p.shape, vec![5, 2]);
        assert_eq!(p.rows(4, 5).data, x.rows(2, 3).data);
        assert_eq!(p.rows_padded(0, 3), x);
    }

    #[test]
    fn casts_round_trip_through_f32() {
        let x = t(vec![2, 3]).cast(DType::BF16).unwrap();
        let back = x
            .clone()
            .cast(DType::F32)
            .unwrap()
            .cast(DType::BF16)
            .unwrap();
        assert_eq!(x, back);
    }
}
