//! The CPU backend: the reference every other backend is checked against. rayon over rows,
//! heads and blocks; every operator computes in f32 and stores its output in the dtype of its
//! main input (f32, or bf16/f16 rounded to nearest even). Inference weights are packed as
//! panels for the AVX-512 kernel (`panel.rs`) where the CPU has it; bf16 training products
//! (linear layers and attention) run on AMX tiles, else on AVX512_BF16's `vdpbf16ps`, where the
//! CPU has them (`bf16_gemm.rs`), as does bf16 prefill on AMX; f32 training products of the
//! linear layers run on the same AVX-512 panel kernel, their right operand packed per product,
//! and everything else on the `gemm` crate (`gemm.rs`).
//! Element-wise operators run over blocks of rows, each widened and rounded back by the task
//! that owns it (`rows.rs`). The kernels live one family a file.

mod attention;
mod bf16_gemm;
pub mod comm;
mod gemm;
mod loss;
pub(crate) mod norm;
mod optim;
mod qkv;
mod relu;
mod rope;
mod rows;
mod swiglu;
#[cfg(test)]
mod testing;
mod transpose;

use super::dropout::Mask;
use super::{
    check, ensure, AdamWStep, AttentionShape, Backend, Device, EngineError, HostTensor, Op, Result,
    Segment, Selection, StridedView, NO_ROW,
};
use crate::tensor::dtype::{bf16_bits, bf16_to_f32};
use crate::tensor::host::{decode_f32, encode_f32};
use crate::tensor::matmul::{gemm_into, Store, Strided};
use crate::tensor::panel::{PanelType, Panels};
use crate::tensor::simd::{dot, narrow_bf16, widen};
use crate::tensor::{DType, SharedOut};
use rayon::prelude::*;
use std::borrow::Cow;
use std::ops::Range;

/// The CPU backend (threads: rayon's pool, `RAYON_NUM_THREADS`).
#[derive(Debug, Default, Clone, Copy)]
pub struct Cpu;

/// A tensor in host memory.
#[derive(Debug, Clone)]
pub struct CpuTensor {
    shape: Vec<usize>,
    data: Data,
    /// Every element is known to be +0 (set where the backend made it so, cleared by every
    /// mutable access through [`CpuTensor::data_mut`]): a weight gradient's first product may
    /// then overwrite it instead of reading it to add.
    zero: bool,
}

#[derive(Debug, Clone)]
enum Data {
    F32(Vec<f32>),
    /// F16 or BF16 bits.
    Half(DType, Vec<u16>),
    /// An inference matmul weight `[m, k]` packed for the panel kernel.
    Panels(Panels),
}

impl CpuTensor {
    fn new(shape: Vec<usize>, values: Vec<f32>) -> Self {
        debug_assert_eq!(values.len(), shape.iter().product::<usize>());
        CpuTensor::holding(shape, Data::F32(values))
    }

    /// `data` of `shape`, not known to be zero.
    fn holding(shape: Vec<usize>, data: Data) -> Self {
        CpuTensor {
            shape,
            data,
            zero: false,
        }
    }

    /// f32 values stored in `dtype` (f32, or bf16/f16 rounded to nearest even).
    fn stored(shape: Vec<usize>, values: Vec<f32>, dtype: DType) -> Self {
        let data = match dtype {
            DType::BF16 | DType::F16 => {
                let mut bits = zeroed(values.len());
                narrow_half_parallel(&values, dtype, &mut bits);
                Data::Half(dtype, bits)
            }
            _ => Data::F32(values),
        };
        CpuTensor::holding(shape, data)
    }

    fn dtype(&self) -> DType {
        match &self.data {
            Data::F32(_) => DType::F32,
            Data::Half(d, _) => *d,
            Data::Panels(p) => p.dtype(),
        }
    }

    fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Its values as f32: borrowed, or widened.
    fn values(&self) -> Cow<'_, [f32]> {
        match &self.data {
            Data::F32(v) => Cow::Borrowed(v),
            Data::Half(dtype, bits) => {
                let mut values = zeroed(bits.len());
                values
                    .par_chunks_mut(CONVERT_CHUNK)
                    .zip(bits.par_chunks(CONVERT_CHUNK))
                    .for_each(|(values, bits)| widen(bits, *dtype, values));
                Cow::Owned(values)
            }
            Data::Panels(_) => {
                let mut buf = Vec::new();
                self.row_block(0, self.rows(), &mut buf);
                Cow::Owned(buf)
            }
        }
    }

    /// Its bf16 bits, where it holds bf16 (not packed).
    fn bf16_bits(&self) -> Option<&[u16]> {
        match &self.data {
            Data::Half(DType::BF16, bits) => Some(bits),
            _ => None,
        }
    }

    /// Its storage, to change: it is no longer known to be zero.
    fn data_mut(&mut self) -> &mut Data {
        self.zero = false;
        &mut self.data
    }

    /// Its f32 values to update in place; an error for a half or packed tensor.
    fn f32_mut(&mut self, op: &'static str) -> Result<&mut [f32]> {
        self.zero = false;
        match &mut self.data {
            Data::F32(v) => Ok(v),
            _ => Err(EngineError::Invalid {
                op,
                msg: format!("an f32 tensor is updated in place, got {:?}", self.shape),
            }),
        }
    }

    /// Row length (product of all dimensions but the first).
    fn cols(&self) -> usize {
        self.shape[1..].iter().product()
    }

    fn rows(&self) -> usize {
        self.shape.first().copied().unwrap_or(1)
    }

    /// Row `i` as f32: borrowed for f32 data, widened into `buf` otherwise.
    fn row<'a>(&'a self, i: usize, buf: &'a mut Vec<f32>) -> &'a [f32] {
        self.row_block(i, i + 1, buf)
    }

    /// Rows `from..to` as f32 (borrowed or widened into `buf`).
    fn row_block<'a>(&'a self, from: usize, to: usize, buf: &'a mut Vec<f32>) -> &'a [f32] {
        let c = self.cols();
        match &self.data {
            Data::F32(v) => &v[from * c..to * c],
            // Extended from an exact-size iterator: no zero-fill before the values.
            Data::Half(DType::BF16, bits) => {
                buf.clear();
                let bits = &bits[from * c..to * c];
                buf.extend(bits.iter().copied().map(bf16_to_f32));
                buf
            }
            Data::Half(dtype, bits) => {
                buf.resize((to - from) * c, 0.0);
                widen(&bits[from * c..to * c], *dtype, buf);
                buf
            }
            Data::Panels(panels) => {
                panels.unpack_rows(from, to, buf);
                buf
            }
        }
    }
}

/// Round f32 values to half bits of `dtype` (BF16 or F16), nearest even.
fn narrow_half(values: &[f32], dtype: DType, bits: &mut [u16]) {
    if dtype == DType::BF16 {
        narrow_bf16(values, bits);
    } else {
        for (b, &v) in bits.iter_mut().zip(values) {
            *b = half::f16::from_f32(v).to_bits();
        }
    }
}

/// Elements per task of a whole-tensor conversion between f32 and half.
const CONVERT_CHUNK: usize = 1 << 16;

/// [`narrow_half`] of a whole tensor, chunks in parallel.
fn narrow_half_parallel(values: &[f32], dtype: DType, bits: &mut [u16]) {
    bits.par_chunks_mut(CONVERT_CHUNK)
        .zip(values.par_chunks(CONVERT_CHUNK))
        .for_each(|(bits, values)| narrow_half(values, dtype, bits));
}

/// `n` zeros written by all threads, chunk by chunk (a model's gradients are zeroed every step,
/// and one thread's memset of them leaves the others idle).
fn zeroed<T: Copy + Default + Send + Sync>(n: usize) -> Vec<T> {
    let mut v = Vec::with_capacity(n);
    v.spare_capacity_mut()
        .par_chunks_mut(CONVERT_CHUNK)
        .for_each(|chunk| chunk.fill(std::mem::MaybeUninit::new(T::default())));
    // SAFETY: the chunks covered all n elements of the capacity.
    unsafe { v.set_len(n) };
    v
}

/// The error for an operation on a weight packed for inference matmuls.
fn packed(op: &'static str) -> EngineError {
    EngineError::Invalid {
        op,
        msg: "a weight packed for matmul is read only by matmul".into(),
    }
}

/// Elements `range` of `src` (row-major) as f32.
fn range_f32<'a>(
    op: &'static str,
    src: &'a CpuTensor,
    range: Range<usize>,
) -> Result<Cow<'a, [f32]>> {
    match &src.data {
        Data::F32(v) => Ok(Cow::Borrowed(&v[range])),
        Data::Half(dtype, bits) => {
            let mut buf = vec![0.0; range.len()];
            widen(&bits[range], *dtype, &mut buf);
            Ok(Cow::Owned(buf))
        }
        Data::Panels(_) => Err(packed(op)),
    }
}

/// `values` into `dst`'s elements from `to` on, converted to its dtype.
fn write_range(op: &'static str, dst: &mut CpuTensor, to: usize, values: &[f32]) -> Result<()> {
    let n = values.len();
    match dst.data_mut() {
        Data::F32(v) => v[to..to + n].copy_from_slice(values),
        Data::Half(dtype, bits) => narrow_half(values, *dtype, &mut bits[to..to + n]),
        Data::Panels(_) => return Err(packed(op)),
    }
    Ok(())
}

/// Both operands' bf16 bits, where bf16 products run (`bf16_gemm`).
fn bf16_pair<'a>(a: &'a CpuTensor, b: &'a CpuTensor) -> Option<(&'a [u16], &'a [u16])> {
    Some((a.bf16_bits()?, b.bf16_bits()?)).filter(|_| bf16_gemm::available())
}

/// The bits of bf16 `q`, `k`, `v`, where bf16 products can run their attention.
fn bf16_qkv<'a>(
    q: &'a CpuTensor,
    k: &'a CpuTensor,
    v: &'a CpuTensor,
) -> Option<attention::Bf16Qkv<'a>> {
    let x = attention::Bf16Qkv {
        q: q.bf16_bits()?,
        k: k.bf16_bits()?,
        v: v.bf16_bits()?,
    };
    Some(x).filter(|_| bf16_gemm::available())
}

/// `dw [m, k] = / += dyᵀ · x` (`store`) for bf16 `dy [n, m]`, `x [n, k]` (`bf16_gemm`),
/// transposing the smaller of the two for the left operand (when `m > k`, as `dwᵀ = xᵀ · dy`).
fn bf16_weight_grad(
    dy: &[u16],
    x: &[u16],
    (n, m, k): (usize, usize, usize),
    dw: &mut [f32],
    store: Store,
) {
    let (left, right, shape, transposed) = if m > k {
        (x, dy, (k, n, m), true)
    } else {
        (dy, x, (m, n, k), false)
    };
    let dst = bf16_gemm::Dst::F32 {
        out: dw,
        stride: k,
        store,
        transposed,
    };
    bf16_gemm::matmul(
        bf16_gemm::Operand::transposed(left),
        bf16_gemm::Operand::rows(right),
        shape,
        dst,
    );
}

/// Rows of `x` at or below which a matmul runs as dot products (decoding), above as GEMM.
const SKINNY_ROWS: usize = 4;
/// Weight rows per parallel task.
const ROW_BLOCK: usize = 64;

impl Cpu {
    /// `out[n, m] = x[n, k] · w[m, k]ᵀ` as dot products, blocks of weight rows in parallel.
    fn matmul_skinny(
        &self,
        x: &[f32],
        w: &CpuTensor,
        (n, k, m): (usize, usize, usize),
    ) -> Vec<f32> {
        let blocks: Vec<Vec<f32>> = (0..m.div_ceil(ROW_BLOCK))
            .into_par_iter()
            .map_init(Vec::new, |buf, b| {
                let (j0, j1) = (b * ROW_BLOCK, ((b + 1) * ROW_BLOCK).min(m));
                let rows = w.row_block(j0, j1, buf);
                let mut out = vec![0f32; n * (j1 - j0)];
                for (j, wrow) in rows.chunks_exact(k).enumerate() {
                    for i in 0..n {
                        out[i * (j1 - j0) + j] = dot(&x[i * k..(i + 1) * k], wrow);
                    }
                }
                out
            })
            .collect();
        let mut out = vec![0f32; n * m];
        for (b, block) in blocks.iter().enumerate() {
            let (j0, width) = (b * ROW_BLOCK, block.len() / n);
            for i in 0..n {
                out[i * m + j0..i * m + j0 + width]
                    .copy_from_slice(&block[i * width..(i + 1) * width]);
            }
        }
        out
    }

    /// The same product on f32 GEMM kernels: f32 weights whole (`gemm::product`), weights
    /// stored in half precision widened a block of rows at a time (never a whole f32 copy) and
    /// multiplied as column blocks of the output in parallel.
    fn matmul_gemm(&self, x: &[f32], w: &CpuTensor, (n, k, m): (usize, usize, usize)) -> Vec<f32> {
        let mut out = vec![0f32; n * m];
        if let Data::F32(ws) = &w.data {
            let (lhs, rhs) = (gemm::Matrix::rows(x), gemm::Matrix::transposed(ws));
            gemm::product(lhs, rhs, (n, k, m), &mut out, Store::Overwrite);
            return out;
        }
        let shared = SharedOut(out.as_mut_ptr());
        (0..m.div_ceil(ROW_BLOCK))
            .into_par_iter()
            .for_each_init(Vec::new, |buf, b| {
                let (j0, j1) = (b * ROW_BLOCK, ((b + 1) * ROW_BLOCK).min(m));
                let rows = w.row_block(j0, j1, buf);
                // SAFETY: the task writes columns j0..j1 of the n × m output only (row stride
                // m); blocks are disjoint. x is n × k row-major; rows is (j1 - j0) × k, read
                // as its transpose (k × (j1 - j0)). All indices lie inside the buffers.
                unsafe {
                    gemm_into(
                        shared.at(j0),
                        m,
                        (n, j1 - j0, k),
                        Strided::rows(x, 0, k),
                        Strided::columns(rows, 0, k),
                        1.0,
                        Store::Overwrite,
                    );
                }
            });
        out
    }

    fn attend(
        &self,
        (q, k, v): (&CpuTensor, &CpuTensor, &CpuTensor),
        segments: &[Range<usize>],
        s: AttentionShape,
        (dropout, selection): (Option<&Mask>, Option<&Selection>),
    ) -> Result<(CpuTensor, CpuTensor)> {
        let n = check::attention(self, (q, k, v), segments, s)?;
        check::mask("attention", dropout, n)?;
        check::selection("attention", selection, n)?;
        let (mut o, mut lse) = (
            vec![0f32; n * s.heads * s.head_dim],
            vec![0f32; n * s.heads],
        );
        let at = attention::Layout {
            shape: s,
            segments,
            dropout,
            selection,
        };
        match bf16_qkv(q, k, v) {
            Some(x) => attention::attention_fwd_bf16(x, at, &mut o, &mut lse),
            None => attention::attention_fwd(
                &q.values(),
                &k.values(),
                &v.values(),
                at,
                &mut o,
                &mut lse,
            ),
        }
        Ok((
            CpuTensor::stored(q.shape.clone(), o, q.dtype()),
            CpuTensor::new(vec![n, s.heads], lse),
        ))
    }

    fn attend_bwd(
        &self,
        d_o: &CpuTensor,
        (q, k, v): (&CpuTensor, &CpuTensor, &CpuTensor),
        (o, lse): (&CpuTensor, &CpuTensor),
        (segments, s): (&[Range<usize>], AttentionShape),
        (dropout, selection): (Option<&Mask>, Option<&Selection>),
    ) -> Result<(CpuTensor, CpuTensor, CpuTensor)> {
        let n = check::attention_bwd(self, d_o, (q, k, v), o, segments, s)?;
        check::mask("attention_bwd", dropout, n)?;
        check::selection("attention_bwd", selection, n)?;
        check::expect_shape(self, "attention_bwd", "lse", lse, &[n, s.heads])?;
        let (mut dq, mut dk, mut dv) = (
            vec![0f32; q.numel()],
            vec![0f32; k.numel()],
            vec![0f32; v.numel()],
        );
        let at = attention::Layout {
            shape: s,
            segments,
            dropout,
            selection,
        };
        let grads = (&mut dq[..], &mut dk[..], &mut dv[..]);
        match (bf16_qkv(q, k, v), d_o.bf16_bits(), o.bf16_bits()) {
            (Some(x), Some(d_o), Some(o)) => {
                attention::attention_bwd_bf16((d_o, o), x, &lse.values(), at, grads)
            }
            _ => attention::attention_bwd(
                &d_o.values(),
                &q.values(),
                &k.values(),
                &v.values(),
                &o.values(),
                &lse.values(),
                at,
                grads,
            ),
        }
        let dt = d_o.dtype();
        Ok((
            CpuTensor::stored(q.shape.clone(), dq, dt),
            CpuTensor::stored(k.shape.clone(), dk, dt),
            CpuTensor::stored(v.shape.clone(), dv, dt),
        ))
    }
}

impl Device for Cpu {
    type Tensor = CpuTensor;

    fn describe(&self) -> String {
        format!("cpu ({} threads)", rayon::current_num_threads())
    }

    fn supports(&self, op: Op, dtype: DType) -> bool {
        let float = matches!(dtype, DType::F32 | DType::BF16 | DType::F16);
        match op {
            // Updated in place as f32: gradients, main parameters, moments.
            Op::AdamW | Op::EmbeddingBwd => dtype == DType::F32,
            _ => float,
        }
    }

    fn upload(&self, t: &HostTensor) -> Result<CpuTensor> {
        let data = match t.dtype {
            DType::F32 => {
                let mut v = vec![0f32; t.data.len() / 4];
                decode_f32(&t.data, DType::F32, &mut v).map_err(|e| EngineError::Invalid {
                    op: "upload",
                    msg: e.to_string(),
                })?;
                Data::F32(v)
            }
            DType::F16 | DType::BF16 => Data::Half(
                t.dtype,
                t.data
                    .chunks_exact(2)
                    .map(|c| u16::from_le_bytes([c[0], c[1]]))
                    .collect(),
            ),
            other => {
                return Err(EngineError::Unsupported {
                    op: "upload",
                    dtype: other,
                    device: self.describe(),
                })
            }
        };
        Ok(CpuTensor::holding(t.shape.clone(), data))
    }

    /// Packed as panels where the AVX-512 kernel runs, so that no matmul packs or widens
    /// weights again; as [`Device::upload`] elsewhere.
    fn upload_matrix(&self, t: &HostTensor) -> Result<CpuTensor> {
        match PanelType::for_weights(t.dtype) {
            Some(ty) if t.shape.len() == 2 => {
                let panels = Panels::pack(ty, &t.data, (t.shape[0], t.shape[1])).map_err(|e| {
                    EngineError::Invalid {
                        op: "upload_matrix",
                        msg: e.to_string(),
                    }
                })?;
                Ok(CpuTensor::holding(t.shape.clone(), Data::Panels(panels)))
            }
            _ => self.upload(t),
        }
    }

    fn upload_f32(&self, shape: &[usize], values: &[f32]) -> Result<CpuTensor> {
        ensure(
            values.len() == shape.iter().product::<usize>(),
            "upload_f32",
            || format!("{} values for {shape:?}", values.len()),
        )?;
        Ok(CpuTensor::new(shape.to_vec(), values.to_vec()))
    }

    fn zeros(&self, shape: &[usize], dtype: DType) -> Result<CpuTensor> {
        let n = shape.iter().product();
        let data = match dtype {
            DType::BF16 | DType::F16 => Data::Half(dtype, zeroed(n)),
            _ => Data::F32(zeroed(n)),
        };
        Ok(CpuTensor {
            zero: true,
            shape: shape.to_vec(),
            data,
        })
    }

    fn download_f32(&self, t: &CpuTensor) -> Result<Vec<f32>> {
        Ok(t.values().into_owned())
    }

    fn download(&self, t: &CpuTensor) -> Result<HostTensor> {
        let dtype = match t.dtype() {
            d @ (DType::BF16 | DType::F16) if matches!(t.data, Data::Half(..)) => d,
            _ => DType::F32,
        };
        let values = t.values();
        let mut bytes = vec![0u8; values.len() * dtype.size()];
        encode_f32(&values, dtype, &mut bytes).map_err(|e| EngineError::Invalid {
            op: "download",
            msg: e.to_string(),
        })?;
        Ok(HostTensor::new(dtype, t.shape.clone(), bytes))
    }

    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    fn shape<'a>(&self, t: &'a CpuTensor) -> &'a [usize] {
        &t.shape
    }

    fn dtype(&self, t: &CpuTensor) -> DType {
        t.dtype()
    }
}

impl Backend for Cpu {
    fn embedding(&self, table: &CpuTensor, ids: &[u32]) -> Result<CpuTensor> {
        check::ids(self, "embedding", table, ids)?;
        let h = table.cols();
        let mut out = vec![0f32; ids.len() * h];
        out.par_chunks_mut(h)
            .zip(ids)
            .filter(|(_, id)| **id != NO_ROW)
            .for_each_init(Vec::new, |buf, (o, &id)| {
                o.copy_from_slice(table.row(id as usize, buf));
            });
        Ok(CpuTensor::new(vec![ids.len(), h], out))
    }

    fn embedding_bwd(&self, dy: &CpuTensor, ids: &[u32], dtable: &mut CpuTensor) -> Result<()> {
        check::embedding_bwd(self, dy, ids, dtable)?;
        let h = dtable.cols();
        optim::embedding_bwd(&dy.values(), ids, h, dtable.f32_mut("embedding_bwd")?);
        Ok(())
    }

    fn select_rows(&self, x: &CpuTensor, rows: &[usize]) -> Result<CpuTensor> {
        check::select_rows(self, x, rows)?;
        let c = x.cols();
        let v = x.values();
        let out = rows
            .iter()
            .flat_map(|&r| &v[r * c..(r + 1) * c])
            .copied()
            .collect();
        Ok(CpuTensor::stored(vec![rows.len(), c], out, x.dtype()))
    }

    fn index_add_rows(&self, dst: &mut CpuTensor, src: &CpuTensor, rows: &[usize]) -> Result<()> {
        check::index_add_rows(self, dst, src, rows)?;
        let c = dst.cols();
        let src = src.values();
        let add = |row: &mut [f32], i: usize| {
            (row.iter_mut().zip(&src[i * c..(i + 1) * c])).for_each(|(a, b)| *a += b)
        };
        match dst.data_mut() {
            Data::F32(values) => {
                for (i, &r) in rows.iter().enumerate() {
                    add(&mut values[r * c..(r + 1) * c], i);
                }
            }
            Data::Half(dtype, bits) => {
                let mut row = vec![0f32; c];
                for (i, &r) in rows.iter().enumerate() {
                    let stored = &mut bits[r * c..(r + 1) * c];
                    crate::tensor::simd::widen(stored, *dtype, &mut row);
                    add(&mut row, i);
                    narrow_half(&row, *dtype, stored);
                }
            }
            Data::Panels(_) => return Err(packed("index_add_rows")),
        }
        Ok(())
    }

    fn scale_rows(&self, x: &CpuTensor, w: &CpuTensor) -> Result<CpuTensor> {
        check::scale_rows(self, x, w)?;
        let (c, w) = (x.cols(), w.values());
        let mut v = x.values().into_owned();
        v.par_chunks_mut(c.max(1))
            .zip(w.par_iter())
            .for_each(|(row, &s)| row.iter_mut().for_each(|a| *a *= s));
        Ok(CpuTensor::stored(x.shape.clone(), v, x.dtype()))
    }

    fn row_dots(&self, x: &CpuTensor, y: &CpuTensor) -> Result<Vec<f32>> {
        check::row_dots(self, x, y)?;
        let c = x.cols().max(1);
        let (x, y) = (x.values(), y.values());
        Ok(x.par_chunks(c)
            .zip(y.par_chunks(c))
            .map(|(a, b)| a.iter().zip(b).map(|(p, q)| p * q).sum())
            .collect())
    }

    fn rms_norm(
        &self,
        x: &CpuTensor,
        gamma: &CpuTensor,
        eps: f64,
    ) -> Result<(CpuTensor, CpuTensor)> {
        let groups = check::rms_norm(self, x, gamma)?;
        let (n, gamma) = (x.rows(), gamma.values());
        let (y, rstd) = rows::map_rows(
            [x],
            (x.shape.clone(), x.dtype()),
            rows::block_rows(x.cols()),
            |rows, [x], y| {
                let mut rstd = vec![0f32; rows.len() * groups];
                norm::rms_norm_fwd(x, &gamma, eps as f32, y, &mut rstd);
                rstd
            },
        );
        Ok((y, CpuTensor::new(vec![n * groups], rstd.concat())))
    }

    fn rms_norm_bwd(
        &self,
        dy: &CpuTensor,
        x: &CpuTensor,
        gamma: &CpuTensor,
        rstd: &CpuTensor,
        dgamma: Option<&mut CpuTensor>,
    ) -> Result<CpuTensor> {
        check::rms_norm_bwd(self, (dy, x, rstd), gamma, dgamma.as_deref())?;
        let dgamma = match dgamma {
            Some(d) => Some(d.f32_mut("rms_norm_bwd")?),
            None => None,
        };
        let groups = x.cols() / gamma.shape.iter().product::<usize>();
        let (h, gamma, rstd) = (x.cols(), gamma.values(), rstd.values());
        let learns = dgamma.is_some();
        let width = gamma.len();
        // Each block's part of dγ, added in block order below.
        let (dx, parts) = rows::map_rows(
            [dy, x],
            (x.shape.clone(), dy.dtype()),
            rows::block_rows(h),
            |rows, [dy, x], dx| {
                let mut part = vec![0f32; if learns { width } else { 0 }];
                let part_out = learns.then_some(&mut part[..]);
                let rstd = &rstd[rows.start * groups..rows.end * groups];
                norm::rms_norm_bwd(dy, x, &gamma, rstd, dx, part_out);
                part
            },
        );
        if let Some(dgamma) = dgamma {
            for part in parts {
                dgamma.iter_mut().zip(part).for_each(|(g, p)| *g += p);
            }
        }
        Ok(dx)
    }

    fn matmul(&self, x: &CpuTensor, w: &CpuTensor, bias: Option<&CpuTensor>) -> Result<CpuTensor> {
        let (n, k, m) = check::matmul(self, x, w, bias)?;
        if let (Some((xb, wb)), true) = (bf16_pair(x, w), n > SKINNY_ROWS) {
            let bias = bias.map(|b| b.values());
            let (x, w) = (
                bf16_gemm::Operand::rows(xb),
                bf16_gemm::Operand::transposed(wb),
            );
            let out = bf16_gemm::product_bf16(x, w, (n, k, m), bias.as_deref());
            return Ok(CpuTensor::holding(vec![n, m], Data::Half(DType::BF16, out)));
        }
        let mut out = if let Data::Panels(panels) = &w.data {
            let pairs = panels.bf16_pairs();
            match pairs.filter(|_| bf16_gemm::tiles_read_panels(n, k)) {
                // bf16 prefill on AMX tiles, straight from the inference panels.
                Some(bytes) => bf16_gemm::panels_product(&x.values(), bytes, (n, k, m)),
                None => panels.matmul(&x.values(), n),
            }
        } else if n <= SKINNY_ROWS {
            self.matmul_skinny(&x.values(), w, (n, k, m))
        } else {
            self.matmul_gemm(&x.values(), w, (n, k, m))
        };
        if let Some(b) = bias {
            let b = b.values();
            out.par_chunks_mut(m)
                .for_each(|row| row.iter_mut().zip(b.iter()).for_each(|(v, b)| *v += b));
        }
        Ok(CpuTensor::stored(vec![n, m], out, x.dtype()))
    }

    fn grouped_matmul(
        &self,
        x: &CpuTensor,
        w: &[&CpuTensor],
        counts: &[usize],
    ) -> Result<CpuTensor> {
        super::grouped::grouped_matmul(self, x, w, counts)
    }

    fn grouped_matmul_bwd(
        &self,
        dy: &CpuTensor,
        x: &CpuTensor,
        w: &[&CpuTensor],
        counts: &[usize],
        dw: &mut [Option<&mut CpuTensor>],
    ) -> Result<CpuTensor> {
        super::grouped::grouped_matmul_bwd(self, (dy, x), w, counts, dw)
    }

    fn matmul_bwd(
        &self,
        dy: &CpuTensor,
        x: &CpuTensor,
        w: &CpuTensor,
        dw: Option<&mut CpuTensor>,
        dbias: Option<&mut CpuTensor>,
    ) -> Result<CpuTensor> {
        let (n, k, m) = check::matmul_bwd(self, (dy, x, w), dw.as_deref(), dbias.as_deref())?;
        // dy widened to f32 at most once, by the first product or sum that reads it so.
        let dy_f32 = std::cell::OnceCell::new();
        let dys = || dy_f32.get_or_init(|| dy.values());
        let dx = if let Some((dyb, wb)) = bf16_pair(dy, w) {
            let (dy, w) = (bf16_gemm::Operand::rows(dyb), bf16_gemm::Operand::rows(wb));
            CpuTensor::holding(
                x.shape.clone(),
                Data::Half(DType::BF16, bf16_gemm::product_bf16(dy, w, (n, m, k), None)),
            )
        } else {
            let mut dx = vec![0f32; n * k];
            let (dys, ws) = (gemm::Matrix::rows(dys()), w.values());
            gemm::product(
                dys,
                gemm::Matrix::rows(&ws),
                (n, m, k),
                &mut dx,
                Store::Overwrite,
            );
            CpuTensor::stored(x.shape.clone(), dx, dy.dtype())
        };
        if let Some(dw) = dw {
            // A gradient known to be zero (the step's first contribution) is overwritten, not
            // read and added to: the same values, without reading it.
            let store = match dw.zero {
                true => Store::Overwrite,
                false => Store::Accumulate,
            };
            let dw = dw.f32_mut("matmul_bwd")?;
            if let Some((dyb, xb)) = bf16_pair(dy, x) {
                bf16_weight_grad(dyb, xb, (n, m, k), dw, store);
            } else {
                let (dys, xs) = (gemm::Matrix::transposed(dys()), x.values());
                gemm::product(dys, gemm::Matrix::rows(&xs), (m, n, k), dw, store);
            }
        }
        if let Some(db) = dbias {
            let db = db.f32_mut("matmul_bwd")?;
            for row in dys().chunks_exact(m) {
                db.iter_mut().zip(row).for_each(|(d, g)| *d += g);
            }
        }
        Ok(dx)
    }

    fn split_qkv(
        &self,
        qkv: &CpuTensor,
        s: AttentionShape,
    ) -> Result<(CpuTensor, CpuTensor, CpuTensor)> {
        check::split_qkv(self, qkv, s)?;
        let n = qkv.rows();
        let parts = match &qkv.data {
            Data::F32(v) => qkv::split(v, s).map(Data::F32),
            Data::Half(dtype, bits) => qkv::split(bits, s).map(|p| Data::Half(*dtype, p)),
            Data::Panels(_) => return Err(packed("split_qkv")),
        };
        let [q, k, v] = parts;
        let tensor = |data, heads: usize| CpuTensor::holding(vec![n, heads * s.head_dim], data);
        Ok((tensor(q, s.heads), tensor(k, s.groups), tensor(v, s.groups)))
    }

    fn merge_qkv(
        &self,
        dq: &CpuTensor,
        dk: &CpuTensor,
        dv: &CpuTensor,
        s: AttentionShape,
    ) -> Result<CpuTensor> {
        let n = check::heads(self, "merge_qkv", (dq, dk, dv), s)?;
        let width = (s.heads + 2 * s.groups) * s.head_dim;
        let data = match (&dq.data, &dk.data, &dv.data) {
            (Data::F32(q), Data::F32(k), Data::F32(v)) => Data::F32(qkv::merge([q, k, v], s)),
            (Data::Half(dt, q), Data::Half(dk_t, k), Data::Half(dv_t, v))
                if dt == dk_t && dt == dv_t =>
            {
                Data::Half(*dt, qkv::merge([q, k, v], s))
            }
            // Mixed storage: through f32, stored as dq.
            _ => {
                let (q, k, v) = (dq.values(), dk.values(), dv.values());
                let merged = qkv::merge([&q[..], &k[..], &v[..]], s);
                return Ok(CpuTensor::stored(vec![n, width], merged, dq.dtype()));
            }
        };
        Ok(CpuTensor::holding(vec![n, width], data))
    }

    fn rope(
        &self,
        x: &mut CpuTensor,
        cos: &CpuTensor,
        sin: &CpuTensor,
        head_dim: usize,
        inverse: bool,
    ) -> Result<()> {
        check::rope(self, x, (cos, sin), head_dim)?;
        let width = x.cols();
        let half = cos.cols();
        let (cos, sin) = (cos.values(), sin.values());
        rows::update_rows("rope", x, [], rows::block_rows(width), |rows, x, []| {
            let at = rows.start * half..rows.end * half;
            let tables = (&cos[at.clone()], &sin[at]);
            rope::rope(x, (width, head_dim), tables, inverse);
        })
    }

    fn attention(
        &self,
        q: &CpuTensor,
        k: &CpuTensor,
        v: &CpuTensor,
        segments: &[Range<usize>],
        s: AttentionShape,
        dropout: Option<&Mask>,
    ) -> Result<(CpuTensor, CpuTensor)> {
        self.attend((q, k, v), segments, s, (dropout, None))
    }

    fn sparse_attention(
        &self,
        q: &CpuTensor,
        k: &CpuTensor,
        v: &CpuTensor,
        segments: &[Range<usize>],
        s: AttentionShape,
        dropout: Option<&Mask>,
        selection: &Selection,
    ) -> Result<(CpuTensor, CpuTensor)> {
        self.attend((q, k, v), segments, s, (dropout, Some(selection)))
    }

    fn attention_bwd(
        &self,
        d_o: &CpuTensor,
        q: &CpuTensor,
        k: &CpuTensor,
        v: &CpuTensor,
        o: &CpuTensor,
        lse: &CpuTensor,
        segments: &[Range<usize>],
        s: AttentionShape,
        dropout: Option<&Mask>,
    ) -> Result<(CpuTensor, CpuTensor, CpuTensor)> {
        self.attend_bwd(d_o, (q, k, v), (o, lse), (segments, s), (dropout, None))
    }

    fn sparse_attention_bwd(
        &self,
        d_o: &CpuTensor,
        qkv: (&CpuTensor, &CpuTensor, &CpuTensor),
        saved: (&CpuTensor, &CpuTensor),
        segments: &[Range<usize>],
        s: AttentionShape,
        dropout: Option<&Mask>,
        selection: &Selection,
    ) -> Result<(CpuTensor, CpuTensor, CpuTensor)> {
        self.attend_bwd(d_o, qkv, saved, (segments, s), (dropout, Some(selection)))
    }
    fn kv_cache(&self, slots: usize, capacity: usize, width: usize) -> Result<CpuTensor> {
        Ok(CpuTensor::new(
            vec![slots, capacity, width],
            vec![0f32; slots * capacity * width],
        ))
    }

    fn kv_store(&self, cache: &mut CpuTensor, x: &CpuTensor, segments: &[Segment]) -> Result<()> {
        check::kv_store(self, cache, x, segments)?;
        let (capacity, width) = (cache.shape[1], cache.shape[2]);
        let rows = x.values();
        let dst = cache.f32_mut("kv_store")?;
        let mut r = 0;
        for s in segments {
            let at = (s.slot * capacity + s.past) * width;
            dst[at..at + s.len * width].copy_from_slice(&rows[r * width..(r + s.len) * width]);
            r += s.len;
        }
        Ok(())
    }

    fn cached_attention(
        &self,
        q: &CpuTensor,
        k_cache: &CpuTensor,
        v_cache: &CpuTensor,
        segments: &[Segment],
        s: AttentionShape,
    ) -> Result<CpuTensor> {
        check::cached_attention(self, q, k_cache, segments, s)?;
        let (capacity, width) = (k_cache.shape[1], k_cache.shape[2]);
        let out = attention::cached_attention_fwd(
            &q.values(),
            &k_cache.values(),
            &v_cache.values(),
            (capacity, width),
            segments,
            s,
        );
        Ok(CpuTensor::stored(q.shape.clone(), out, q.dtype()))
    }

    fn swiglu(&self, x: &CpuTensor) -> Result<CpuTensor> {
        check::swiglu(self, x, None)?;
        let f = x.cols() / 2;
        let shape = (vec![x.rows(), f], x.dtype());
        let block = rows::block_rows(2 * f);
        let (y, _) = rows::map_rows([x], shape, block, |_, [x], y| swiglu::swiglu_fwd(x, f, y));
        Ok(y)
    }

    fn swiglu_bwd(&self, dy: &CpuTensor, x: &CpuTensor) -> Result<CpuTensor> {
        check::swiglu(self, x, Some(dy))?;
        let f = x.cols() / 2;
        let shape = (x.shape.clone(), dy.dtype());
        let block = rows::block_rows(2 * f);
        let (dx, _) = rows::map_rows([dy, x], shape, block, |_, [dy, x], dx| {
            swiglu::swiglu_bwd(dy, x, f, dx)
        });
        Ok(dx)
    }

    fn squared_relu(&self, x: &CpuTensor) -> Result<CpuTensor> {
        let shape = (x.shape.clone(), x.dtype());
        let block = rows::block_rows(x.cols());
        let (y, _) = rows::map_rows([x], shape, block, |_, [x], y| relu::squared_relu_fwd(x, y));
        Ok(y)
    }

    fn squared_relu_bwd(&self, dy: &CpuTensor, x: &CpuTensor) -> Result<CpuTensor> {
        check::squared_relu_bwd(self, dy, x)?;
        let shape = (x.shape.clone(), dy.dtype());
        let block = rows::block_rows(x.cols());
        let (dx, _) = rows::map_rows([dy, x], shape, block, |_, [dy, x], dx| {
            relu::squared_relu_bwd(dy, x, dx)
        });
        Ok(dx)
    }

    fn add_assign(&self, x: &mut CpuTensor, y: &CpuTensor) -> Result<()> {
        check::expect_shape(self, "add_assign", "y", y, &x.shape)?;
        let block = rows::block_rows(x.cols());
        rows::update_rows("add_assign", x, [y], block, |_, x, [y]| {
            x.iter_mut().zip(y).for_each(|(a, b)| *a += b)
        })
    }

    fn log_softmax(&self, x: &CpuTensor) -> Result<CpuTensor> {
        let c = x.cols();
        let mut out = x.values().into_owned();
        out.par_chunks_mut(c).for_each(|row| {
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let sum: f64 = row.iter().map(|&v| ((v - max) as f64).exp()).sum();
            let log_sum = sum.ln() as f32 + max;
            row.iter_mut().for_each(|v| *v -= log_sum);
        });
        Ok(CpuTensor::new(x.shape.clone(), out))
    }

    fn cross_entropy(&self, logits: &CpuTensor, labels: &[u32]) -> Result<(CpuTensor, CpuTensor)> {
        check::cross_entropy(self, logits, labels)?;
        if matches!(logits.data, Data::Panels(_)) {
            return Err(packed("cross_entropy"));
        }
        let n = logits.rows();
        let (mut loss, mut lse) = (vec![0f32; n], vec![0f32; n]);
        loss::cross_entropy_fwd(logits, labels, &mut loss, &mut lse);
        Ok((CpuTensor::new(vec![n], loss), CpuTensor::new(vec![n], lse)))
    }

    fn cross_entropy_bwd(
        &self,
        logits: CpuTensor,
        labels: &[u32],
        lse: &CpuTensor,
        dloss: &CpuTensor,
    ) -> Result<CpuTensor> {
        check::cross_entropy_bwd(self, &logits, labels, lse, dloss)?;
        if matches!(logits.data, Data::Panels(_)) {
            return Err(packed("cross_entropy_bwd"));
        }
        Ok(loss::cross_entropy_bwd(
            logits,
            labels,
            &lse.values(),
            &dloss.values(),
        ))
    }

    fn cast(&self, x: &CpuTensor, dtype: DType) -> Result<CpuTensor> {
        ensure(self.supports(Op::Cast, dtype), "cast", || {
            format!("to {dtype:?}")
        })?;
        Ok(CpuTensor::stored(
            x.shape.clone(),
            x.values().into_owned(),
            dtype,
        ))
    }

    fn copy_into(&self, src: &CpuTensor, dst: &mut CpuTensor) -> Result<()> {
        check::expect_shape(self, "copy_into", "src", src, &dst.shape)?;
        match dst.data_mut() {
            Data::F32(out) => out.copy_from_slice(&src.values()),
            Data::Half(dtype, bits) => narrow_half_parallel(&src.values(), *dtype, bits),
            Data::Panels(_) => {
                *dst = CpuTensor::stored(dst.shape.clone(), src.values().into_owned(), dst.dtype())
            }
        }
        Ok(())
    }

    fn round_to(&self, x: &mut CpuTensor, dtype: DType) -> Result<()> {
        ensure(dtype == DType::BF16, "round_to", || format!("to {dtype:?}"))?;
        let values = x.f32_mut("round_to")?;
        values.par_chunks_mut(1 << 14).for_each(|chunk| {
            for v in chunk {
                *v = bf16_to_f32(bf16_bits(*v));
            }
        });
        Ok(())
    }

    fn add_rounded(&self, sum: &mut CpuTensor, x: &CpuTensor, dtype: DType) -> Result<()> {
        ensure(dtype == DType::BF16, "add_rounded", || {
            format!("to {dtype:?}")
        })?;
        check::expect_shape(self, "add_rounded", "x", x, &sum.shape)?;
        let block = rows::block_rows(sum.cols());
        rows::update_rows("add_rounded", sum, [x], block, |_, sum, [x]| {
            for (s, v) in sum.iter_mut().zip(x) {
                *s += bf16_to_f32(bf16_bits(*v));
            }
        })
    }

    fn copy_range(
        &self,
        (src, at): (&CpuTensor, usize),
        (dst, to): (&mut CpuTensor, usize),
        n: usize,
    ) -> Result<()> {
        check::expect_range(self, "copy_range", "src", (src, at), n)?;
        check::expect_range(self, "copy_range", "dst", (dst, to), n)?;
        let values = range_f32("copy_range", src, at..at + n)?;
        write_range("copy_range", dst, to, &values)
    }

    fn gather(&self, x: &CpuTensor, view: StridedView, shape: &[usize]) -> Result<CpuTensor> {
        check::strided(self, "gather", x, view, shape)?;
        let take = |v: &[_]| view.indices().map(|i| v[i]).collect();
        let data = match &x.data {
            Data::F32(v) => Data::F32(take(v)),
            Data::Half(dtype, bits) => {
                Data::Half(*dtype, view.indices().map(|i| bits[i]).collect())
            }
            Data::Panels(_) => return Err(packed("gather")),
        };
        Ok(CpuTensor::holding(shape.to_vec(), data))
    }

    fn scatter(&self, y: &CpuTensor, x: &mut CpuTensor, view: StridedView) -> Result<()> {
        let shape = y.shape.clone();
        check::strided(self, "scatter", x, view, &shape)?;
        check::same_dtype(self, "scatter", y, x)?;
        match (&y.data, x.data_mut()) {
            (Data::F32(src), Data::F32(dst)) => {
                view.indices().zip(src).for_each(|(i, &v)| dst[i] = v)
            }
            (Data::Half(_, src), Data::Half(_, dst)) => {
                view.indices().zip(src).for_each(|(i, &v)| dst[i] = v)
            }
            _ => return Err(packed("scatter")),
        }
        Ok(())
    }

    fn copy_transposed(
        &self,
        (src, at): (&CpuTensor, usize),
        (rows, cols): (usize, usize),
        (dst, to): (&mut CpuTensor, usize),
    ) -> Result<()> {
        let op = "copy_transposed";
        let n = check::block(op, (rows, cols))?;
        check::expect_range(self, op, "src", (src, at), n)?;
        check::expect_range(self, op, "dst", (dst, to), n)?;
        let values = range_f32(op, src, at..at + n)?;
        let mut transposed = vec![0.0; n];
        for (r, row) in values.chunks_exact(cols.max(1)).enumerate() {
            for (c, &v) in row.iter().enumerate() {
                transposed[c * rows + r] = v;
            }
        }
        write_range(op, dst, to, &transposed)
    }

    fn dropout(&self, x: &CpuTensor, mask: &Mask) -> Result<CpuTensor> {
        check::dropout(self, x, mask)?;
        let w = x.cols();
        let shape = (x.shape.clone(), x.dtype());
        let block = rows::block_rows(w);
        let (y, _) = rows::map_rows([x], shape, block, |rows, [x], y| {
            y.copy_from_slice(x);
            for (r, values) in rows.zip(y.chunks_exact_mut(w)) {
                mask.scale_row(r, values);
            }
        });
        Ok(y)
    }

    fn scaled(&self, x: &CpuTensor, s: f32) -> Result<CpuTensor> {
        let mut v = x.values().into_owned();
        optim::scale(&mut v, s);
        Ok(CpuTensor::stored(x.shape.clone(), v, x.dtype()))
    }

    fn scale(&self, x: &mut CpuTensor, s: f32) -> Result<()> {
        optim::scale(x.f32_mut("scale")?, s);
        Ok(())
    }

    fn sum_squares(&self, xs: &[&CpuTensor]) -> Result<f64> {
        Ok(xs.iter().map(|x| optim::sum_squares(&x.values())).sum())
    }

    fn adamw(
        &self,
        param: &mut CpuTensor,
        grad: &mut CpuTensor,
        (m, v): (&mut CpuTensor, &mut CpuTensor),
        step: AdamWStep,
        model: Option<&mut CpuTensor>,
    ) -> Result<()> {
        let rest = [("grad", &*grad), ("m", &*m), ("v", &*v)];
        check::adamw(self, param, rest, model.as_deref())?;
        // The bf16 weights below are written through a pattern, not `data_mut`.
        let mut model = model;
        if let Some(model) = model.as_deref_mut() {
            model.zero = false;
        }
        let state = (
            grad.f32_mut("adamw")?,
            m.f32_mut("adamw")?,
            v.f32_mut("adamw")?,
        );
        match model {
            // bf16 weights rounded from each block while it is in cache.
            Some(CpuTensor {
                data: Data::Half(dtype, bits),
                ..
            }) => optim::adamw(param.f32_mut("adamw")?, state, step, Some((*dtype, bits))),
            model => {
                optim::adamw(param.f32_mut("adamw")?, state, step, None);
                if let Some(model) = model {
                    self.copy_into(param, model)?;
                }
            }
        }
        // optim::adamw left the gradient zeroed.
        grad.zero = true;
        Ok(())
    }
}
