//! The CPU backend: rayon over rows and heads, f32 activations. Matmul weights keep their dtype:
//! packed as panels for the AVX-512 kernel (`panel.rs`) where the CPU has it, else row-major
//! and widened a block at a time for the `gemm` crate; no f32 copy of the model exists.

use super::panel::{PanelType, Panels};
use super::simd::{dot, silu_mul, softmax, widen};
use super::{AttentionShape, Backend, HostTensor, Segment, SharedOut};
use crate::ckpt::tensor::decode_f32;
use crate::ckpt::torch::pickle::DType;
use anyhow::{bail, Result};
use rayon::prelude::*;

/// The CPU backend (threads: rayon's pool, `RAYON_NUM_THREADS`).
#[derive(Debug, Default, Clone, Copy)]
pub struct Cpu;

/// A tensor in host memory.
#[derive(Debug, Clone)]
pub struct CpuTensor {
    shape: Vec<usize>,
    data: Data,
}

#[derive(Debug, Clone)]
enum Data {
    F32(Vec<f32>),
    /// F16 or BF16 bits.
    Half(DType, Vec<u16>),
    /// A matmul weight `[m, k]` packed for the panel kernel.
    Panels(Panels),
}

impl CpuTensor {
    fn new(shape: Vec<usize>, values: Vec<f32>) -> Self {
        debug_assert_eq!(values.len(), shape.iter().product::<usize>());
        CpuTensor {
            shape,
            data: Data::F32(values),
        }
    }

    /// Activations are always f32; a half tensor here is a weight passed where an activation
    /// belongs, a bug in the model code.
    fn f32(&self) -> &[f32] {
        match &self.data {
            Data::F32(v) => v,
            Data::Half(..) | Data::Panels(..) => panic!(
                "internal: activation expected, got a {:?} weight",
                self.shape
            ),
        }
    }

    fn f32_mut(&mut self) -> &mut [f32] {
        match &mut self.data {
            Data::F32(v) => v,
            Data::Half(..) | Data::Panels(..) => panic!(
                "internal: activation expected, got a {:?} weight",
                self.shape
            ),
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

/// Rows of `x` at or below which a matmul runs as dot products (decoding), above as GEMM.
const SKINNY_ROWS: usize = 4;
/// Weight rows per parallel task.
const ROW_BLOCK: usize = 64;
/// Query rows per attention task: their scores (rows × keys) stay in L2.
const QUERY_BLOCK: usize = 64;

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

    /// The same product as GEMM calls on column blocks of the output, in parallel.
    fn matmul_gemm(&self, x: &[f32], w: &CpuTensor, (n, k, m): (usize, usize, usize)) -> Vec<f32> {
        let mut out = vec![0f32; n * m];
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
                        Strided::rows(x, k),
                        Strided::columns(rows, k),
                    );
                }
            });
        out
    }
}

/// A matrix in a buffer: element (i, j) at `ptr + i·row_stride + j·col_stride`.
#[derive(Clone, Copy)]
struct Strided {
    ptr: *const f32,
    row_stride: isize,
    col_stride: isize,
}

impl Strided {
    /// Rows `row_stride` apart, columns contiguous.
    fn rows(data: &[f32], row_stride: usize) -> Self {
        Strided {
            ptr: data.as_ptr(),
            row_stride: row_stride as isize,
            col_stride: 1,
        }
    }

    /// The transpose of [`Strided::rows`]: columns `col_stride` apart, rows contiguous.
    fn columns(data: &[f32], col_stride: usize) -> Self {
        Strided {
            ptr: data.as_ptr(),
            row_stride: 1,
            col_stride: col_stride as isize,
        }
    }
}

/// `dst = lhs · rhs` for an (m × k) by (k × n) product, `dst` rows `dst_stride` apart,
/// single-threaded (callers parallelize over blocks).
///
/// # Safety
/// Every element the shapes and strides address lies inside live buffers, and no other
/// thread touches the m × n elements of `dst` meanwhile.
unsafe fn gemm_into(
    dst: *mut f32,
    dst_stride: usize,
    (m, n, k): (usize, usize, usize),
    lhs: Strided,
    rhs: Strided,
) {
    gemm::gemm(
        m,
        n,
        k,
        dst,
        1,
        dst_stride as isize,
        false,
        lhs.ptr,
        lhs.col_stride,
        lhs.row_stride,
        rhs.ptr,
        rhs.col_stride,
        rhs.row_stride,
        0.0,
        1.0,
        false,
        false,
        false,
        gemm::Parallelism::None,
    );
}

/// Turns `scale · scores[..visible]` into softmax probabilities in place and zeroes the
/// masked rest.
fn causal_softmax(scores: &mut [f32], visible: usize, scale: f32) {
    let (seen, masked) = scores.split_at_mut(visible);
    softmax(seen, scale);
    masked.fill(0.0);
}

impl Backend for Cpu {
    type Tensor = CpuTensor;

    fn describe(&self) -> String {
        format!("cpu ({} threads)", rayon::current_num_threads())
    }

    fn upload(&self, t: &HostTensor) -> Result<CpuTensor> {
        let data = match t.dtype {
            DType::F32 => {
                let mut v = vec![0f32; t.data.len() / 4];
                decode_f32(&t.data, DType::F32, &mut v).map_err(anyhow::Error::msg)?;
                Data::F32(v)
            }
            DType::F16 | DType::BF16 => Data::Half(
                t.dtype,
                t.data
                    .chunks_exact(2)
                    .map(|c| u16::from_le_bytes([c[0], c[1]]))
                    .collect(),
            ),
            other => bail!("weights of dtype {} are not supported", other.torch_name()),
        };
        Ok(CpuTensor {
            shape: t.shape.clone(),
            data,
        })
    }

    /// Packed as panels where the AVX-512 kernel runs, so that no matmul packs or widens
    /// weights again; as [`Cpu::upload`] elsewhere.
    fn upload_matrix(&self, t: &HostTensor) -> Result<CpuTensor> {
        match PanelType::for_weights(t.dtype) {
            Some(ty) if t.shape.len() == 2 => Ok(CpuTensor {
                shape: t.shape.clone(),
                data: Data::Panels(Panels::pack(ty, &t.data, (t.shape[0], t.shape[1]))?),
            }),
            _ => self.upload(t),
        }
    }

    fn upload_f32(&self, shape: &[usize], values: &[f32]) -> CpuTensor {
        CpuTensor::new(shape.to_vec(), values.to_vec())
    }

    fn to_host(&self, t: &CpuTensor) -> Vec<f32> {
        let mut buf = Vec::new();
        t.row_block(0, t.rows(), &mut buf).to_vec()
    }

    fn shape<'a>(&self, t: &'a CpuTensor) -> &'a [usize] {
        &t.shape
    }

    fn embedding(&self, table: &CpuTensor, ids: &[u32]) -> CpuTensor {
        let h = table.cols();
        let mut out = vec![0f32; ids.len() * h];
        out.par_chunks_mut(h)
            .zip(ids)
            .for_each_init(Vec::new, |buf, (o, &id)| {
                o.copy_from_slice(table.row(id as usize, buf));
            });
        CpuTensor::new(vec![ids.len(), h], out)
    }

    fn select_rows(&self, x: &CpuTensor, rows: &[usize]) -> CpuTensor {
        let c = x.cols();
        let v = x.f32();
        let out = rows
            .iter()
            .flat_map(|&r| &v[r * c..(r + 1) * c])
            .copied()
            .collect();
        CpuTensor::new(vec![rows.len(), c], out)
    }

    fn rms_norm(&self, x: &CpuTensor, gamma: &CpuTensor, eps: f64) -> CpuTensor {
        let h = x.cols();
        let mut buf = Vec::new();
        let g = gamma.row_block(0, gamma.rows(), &mut buf);
        let mut out = x.f32().to_vec();
        out.par_chunks_mut(h).for_each(|row| {
            let mean = dot(row, row) / h as f32;
            let r = 1.0 / (mean + eps as f32).sqrt();
            for (v, &g) in row.iter_mut().zip(g) {
                *v = g * (*v * r);
            }
        });
        CpuTensor::new(x.shape.clone(), out)
    }

    fn matmul(&self, x: &CpuTensor, w: &CpuTensor, bias: Option<&CpuTensor>) -> CpuTensor {
        let (n, k, m) = (x.rows(), x.cols(), w.rows());
        assert_eq!(
            w.cols(),
            k,
            "internal: matmul of [{n}, {k}] by {:?}ᵀ",
            w.shape
        );
        let mut out = if let Data::Panels(panels) = &w.data {
            panels.matmul(x.f32(), n)
        } else if n <= SKINNY_ROWS {
            self.matmul_skinny(x.f32(), w, (n, k, m))
        } else {
            self.matmul_gemm(x.f32(), w, (n, k, m))
        };
        if let Some(b) = bias {
            let mut buf = Vec::new();
            let b = b.row_block(0, b.rows(), &mut buf);
            out.par_chunks_mut(m).for_each(|row| {
                row.iter_mut().zip(b).for_each(|(v, b)| *v += b);
            });
        }
        CpuTensor::new(vec![n, m], out)
    }

    fn split_qkv(&self, qkv: &CpuTensor, s: AttentionShape) -> (CpuTensor, CpuTensor, CpuTensor) {
        let (n, d) = (qkv.rows(), s.head_dim);
        let per_group = s.heads / s.groups;
        let mut q = Vec::with_capacity(n * s.heads * d);
        let mut k = Vec::with_capacity(n * s.groups * d);
        let mut v = Vec::with_capacity(n * s.groups * d);
        for row in qkv.f32().chunks_exact(qkv.cols()) {
            for group in row.chunks_exact((per_group + 2) * d) {
                q.extend_from_slice(&group[..per_group * d]);
                k.extend_from_slice(&group[per_group * d..(per_group + 1) * d]);
                v.extend_from_slice(&group[(per_group + 1) * d..]);
            }
        }
        (
            CpuTensor::new(vec![n, s.heads * d], q),
            CpuTensor::new(vec![n, s.groups * d], k),
            CpuTensor::new(vec![n, s.groups * d], v),
        )
    }

    fn rope(&self, x: &mut CpuTensor, cos: &CpuTensor, sin: &CpuTensor) {
        let half = cos.cols();
        let width = x.cols();
        let (cos, sin) = (cos.f32(), sin.f32());
        x.f32_mut()
            .par_chunks_mut(width)
            .enumerate()
            .for_each(|(r, row)| {
                let (c, s) = (
                    &cos[r * half..(r + 1) * half],
                    &sin[r * half..(r + 1) * half],
                );
                for head in row.chunks_exact_mut(2 * half) {
                    let (a, b) = head.split_at_mut(half);
                    for i in 0..half {
                        // As transformers' `q·cos + rotate_half(q)·sin`, rounding for rounding.
                        let (x1, x2) = (a[i], b[i]);
                        a[i] = x1 * c[i] + -x2 * s[i];
                        b[i] = x2 * c[i] + x1 * s[i];
                    }
                }
            });
    }

    fn kv_cache(&self, slots: usize, capacity: usize, width: usize) -> CpuTensor {
        CpuTensor::new(
            vec![slots, capacity, width],
            vec![0f32; slots * capacity * width],
        )
    }

    fn kv_store(&self, cache: &mut CpuTensor, x: &CpuTensor, segments: &[Segment]) {
        let (capacity, width) = (cache.shape[1], cache.shape[2]);
        let rows = x.f32();
        let dst = cache.f32_mut();
        let mut r = 0;
        for s in segments {
            assert!(
                s.past + s.len <= capacity,
                "internal: KV cache of {capacity} overflows"
            );
            let at = (s.slot * capacity + s.past) * width;
            dst[at..at + s.len * width].copy_from_slice(&rows[r * width..(r + s.len) * width]);
            r += s.len;
        }
    }

    fn attention(
        &self,
        q: &CpuTensor,
        k_cache: &CpuTensor,
        v_cache: &CpuTensor,
        segments: &[Segment],
        s: AttentionShape,
    ) -> CpuTensor {
        let (capacity, width) = (k_cache.shape[1], k_cache.shape[2]);
        let (d, qw) = (s.head_dim, s.heads * s.head_dim);
        let per_group = s.heads / s.groups;
        let (keys, values, queries) = (k_cache.f32(), v_cache.f32(), q.f32());
        let mut starts = Vec::with_capacity(segments.len());
        let mut row = 0;
        for seg in segments {
            assert!(
                seg.slot < k_cache.shape[0] && seg.past + seg.len <= capacity,
                "internal: attention segment outside the KV cache"
            );
            starts.push(row);
            row += seg.len;
        }
        assert_eq!(
            queries.len(),
            row * qw,
            "internal: queries and segments disagree"
        );
        let mut out = vec![0f32; row * qw];
        let shared = SharedOut(out.as_mut_ptr());
        let tasks: Vec<(usize, usize, usize)> = segments
            .iter()
            .enumerate()
            .flat_map(|(i, seg)| {
                (0..s.heads).flat_map(move |h| {
                    (0..seg.len.div_ceil(QUERY_BLOCK)).map(move |b| (i, h, b * QUERY_BLOCK))
                })
            })
            .collect();
        tasks
            .par_iter()
            .for_each_init(Vec::new, |scores, &(i, h, t0)| {
                let seg = segments[i];
                let rows = (seg.len - t0).min(QUERY_BLOCK);
                // Keys the block's last query sees; earlier queries mask the tail off.
                let seen = seg.past + t0 + rows;
                let kv = seg.slot * capacity * width + (h / per_group) * d;
                let at = (starts[i] + t0) * qw + h * d;
                scores.clear();
                scores.resize(rows * seen, 0f32);
                // SAFETY: queries rows at..at + rows·qw hold the block's d-wide head slices; the
                // cache holds `seen` ≤ capacity rows of this slot (asserted above), the group's d
                // columns each; scores is rows × seen. The output block (rows r of this segment,
                // columns h·d..(h+1)·d) belongs to this (segment, head, block) task only.
                unsafe {
                    gemm_into(
                        scores.as_mut_ptr(),
                        seen,
                        (rows, seen, d),
                        Strided::rows(&queries[at..], qw),
                        Strided::columns(&keys[kv..], width),
                    );
                    for (r, row) in scores.chunks_exact_mut(seen).enumerate() {
                        causal_softmax(row, seg.past + t0 + r + 1, s.scale);
                    }
                    gemm_into(
                        shared.at(at),
                        qw,
                        (rows, d, seen),
                        Strided::rows(scores, seen),
                        Strided::rows(&values[kv..], width),
                    );
                }
            });
        CpuTensor::new(vec![row, qw], out)
    }

    fn swiglu(&self, x: &CpuTensor) -> CpuTensor {
        let f = x.cols() / 2;
        let mut out = vec![0f32; x.rows() * f];
        out.par_chunks_mut(f)
            .zip(x.f32().par_chunks(2 * f))
            .for_each(|(o, row)| {
                let (gate, up) = row.split_at(f);
                silu_mul(gate, up, o);
            });
        CpuTensor::new(vec![x.rows(), f], out)
    }

    fn add_assign(&self, x: &mut CpuTensor, y: &CpuTensor) {
        x.f32_mut()
            .par_iter_mut()
            .zip(y.f32().par_iter())
            .for_each(|(a, b)| *a += b);
    }

    fn log_softmax(&self, x: &CpuTensor) -> CpuTensor {
        let c = x.cols();
        let mut out = x.f32().to_vec();
        out.par_chunks_mut(c).for_each(|row| {
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let sum: f64 = row.iter().map(|&v| ((v - max) as f64).exp()).sum();
            let log_sum = sum.ln() as f32 + max;
            row.iter_mut().for_each(|v| *v -= log_sum);
        });
        CpuTensor::new(x.shape.clone(), out)
    }
}
