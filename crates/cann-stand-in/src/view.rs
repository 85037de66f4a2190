//! Strided views of device memory as an aclTensor describes them, and their elements read and
//! written as numbers: every operator of the stand-in computes on `Vec<f32>` (or `f64`, `i64`)
//! in the view's logical row-major order, whatever its dtype and strides.

use ascendcl_sys::{
    aclDataType, ACL_BF16, ACL_BOOL, ACL_FLOAT, ACL_FLOAT16, ACL_INT32, ACL_INT64, ACL_UINT8,
};
use half::{bf16, f16};

/// `ACL_DOUBLE`, accepted for scalars only (ascendcl-sys declares what mindkit's tensors use).
pub(crate) const ACL_DOUBLE: aclDataType = 11;

/// Bytes per element of a dtype a tensor may have, None for the others.
pub(crate) fn element_size(dtype: aclDataType) -> Option<usize> {
    match dtype {
        ACL_FLOAT | ACL_INT32 => Some(4),
        ACL_FLOAT16 | ACL_BF16 => Some(2),
        ACL_UINT8 | ACL_BOOL => Some(1),
        ACL_INT64 => Some(8),
        _ => None,
    }
}

/// The dtype's name in messages.
pub(crate) fn dtype_name(dtype: aclDataType) -> String {
    match dtype {
        ACL_FLOAT => "FLOAT".into(),
        ACL_FLOAT16 => "FLOAT16".into(),
        ACL_BF16 => "BF16".into(),
        ACL_INT32 => "INT32".into(),
        ACL_INT64 => "INT64".into(),
        ACL_UINT8 => "UINT8".into(),
        ACL_BOOL => "BOOL".into(),
        ACL_DOUBLE => "DOUBLE".into(),
        other => format!("dtype {other}"),
    }
}

/// A tensor's view: logical shape, strides and offset in elements over the storage at `data`
/// (`storage_bytes` long, which the launch re-checks is still allocated).
#[derive(Clone, Debug)]
pub(crate) struct View {
    pub dims: Vec<usize>,
    pub strides: Vec<usize>,
    pub offset: usize,
    pub dtype: aclDataType,
    pub data: usize,
    pub storage_bytes: usize,
}

impl View {
    pub fn numel(&self) -> usize {
        self.dims.iter().product()
    }

    pub fn rank(&self) -> usize {
        self.dims.len()
    }

    /// The last dimension (1 for a 0-D tensor).
    pub fn last(&self) -> usize {
        self.dims.last().copied().unwrap_or(1)
    }

    /// All dimensions but the last.
    pub fn leading(&self) -> &[usize] {
        &self.dims[..self.rank().saturating_sub(1)]
    }

    pub fn is_float(&self) -> bool {
        matches!(self.dtype, ACL_FLOAT | ACL_FLOAT16 | ACL_BF16)
    }

    pub fn is_index(&self) -> bool {
        matches!(self.dtype, ACL_INT64 | ACL_INT32)
    }

    /// The same storage seen with `shape`, numpy's broadcasting rules (right-aligned; a
    /// dimension of 1 repeats with stride 0), or None when it does not broadcast.
    pub fn broadcast_to(&self, shape: &[usize]) -> Option<View> {
        let lead = shape.len().checked_sub(self.rank())?;
        let mut strides = vec![0; shape.len()];
        for (d, (&n, &s)) in self.dims.iter().zip(&self.strides).enumerate() {
            match n {
                _ if n == shape[lead + d] => strides[lead + d] = s,
                1 => {}
                _ => return None,
            }
        }
        Some(View {
            dims: shape.to_vec(),
            strides,
            ..self.clone()
        })
    }

    /// The sub-view at index `i` of the first dimension.
    pub fn row(&self, i: usize) -> View {
        View {
            dims: self.dims[1..].to_vec(),
            strides: self.strides[1..].to_vec(),
            offset: self.offset + i * self.strides[0],
            ..self.clone()
        }
    }

    /// Element offsets in logical row-major order.
    fn offsets(&self) -> Vec<usize> {
        let mut out = Vec::with_capacity(self.numel());
        if self.numel() == 0 {
            return out;
        }
        let mut index = vec![0; self.rank()];
        let mut at = self.offset;
        loop {
            out.push(at);
            // an odometer over the dimensions, the last one fastest
            let mut d = self.rank();
            loop {
                if d == 0 {
                    return out;
                }
                d -= 1;
                index[d] += 1;
                at += self.strides[d];
                if index[d] < self.dims[d] {
                    break;
                }
                at -= self.strides[d] * self.dims[d];
                index[d] = 0;
            }
        }
    }

    /// Addresses of the elements in logical order.
    fn addresses(&self) -> impl Iterator<Item = usize> + '_ {
        let size = element_size(self.dtype).unwrap_or(1);
        self.offsets()
            .into_iter()
            .map(move |o| self.data + o * size)
    }

    pub fn read_f64(&self) -> Vec<f64> {
        // SAFETY (here and in the writes): the launch checked the storage is a live allocation
        // and tensor creation that every element of the view lies inside the storage.
        self.addresses()
            .map(|a| unsafe { load(a, self.dtype) })
            .collect()
    }

    pub fn read(&self) -> Vec<f32> {
        self.read_f64().into_iter().map(|v| v as f32).collect()
    }

    /// Integer elements exactly (INT64 beyond 2⁵³ included).
    pub fn read_int(&self) -> Vec<i64> {
        self.addresses()
            .map(|a| unsafe {
                match self.dtype {
                    ACL_INT64 => std::ptr::read_unaligned(a as *const i64),
                    ACL_INT32 => i64::from(std::ptr::read_unaligned(a as *const i32)),
                    _ => load(a, self.dtype) as i64,
                }
            })
            .collect()
    }

    /// Store `values` (logical order) into the view's dtype; halves round to nearest even.
    pub fn write_f64(&self, values: &[f64]) {
        for (a, &v) in self.addresses().zip(values) {
            unsafe { store(a, self.dtype, v) };
        }
    }

    pub fn write(&self, values: &[f32]) {
        let wide: Vec<f64> = values.iter().map(|&v| f64::from(v)).collect();
        self.write_f64(&wide);
    }
}

/// The element at `addr` as f64.
///
/// # Safety
/// `addr` must hold an element of `dtype`.
unsafe fn load(addr: usize, dtype: aclDataType) -> f64 {
    use std::ptr::read_unaligned as rd;
    match dtype {
        ACL_FLOAT => f64::from(rd(addr as *const f32)),
        ACL_FLOAT16 => f64::from(rd(addr as *const f16)),
        ACL_BF16 => f64::from(rd(addr as *const bf16)),
        ACL_INT32 => f64::from(rd(addr as *const i32)),
        ACL_INT64 => rd(addr as *const i64) as f64,
        ACL_UINT8 => f64::from(rd(addr as *const u8)),
        _ => f64::from(u8::from(rd(addr as *const u8) != 0)),
    }
}

/// Store `v` at `addr` as `dtype` (floats through f32, as the stand-in computes in f32;
/// integers truncate like a cast).
///
/// # Safety
/// `addr` must hold an element of `dtype`.
unsafe fn store(addr: usize, dtype: aclDataType, v: f64) {
    use std::ptr::write_unaligned as wr;
    match dtype {
        ACL_FLOAT => wr(addr as *mut f32, v as f32),
        ACL_FLOAT16 => wr(addr as *mut f16, f16::from_f32(v as f32)),
        ACL_BF16 => wr(addr as *mut bf16, bf16::from_f32(v as f32)),
        ACL_INT32 => wr(addr as *mut i32, v as i32),
        ACL_INT64 => wr(addr as *mut i64, v as i64),
        ACL_UINT8 => wr(addr as *mut u8, v as u8),
        _ => wr(addr as *mut u8, u8::from(v != 0.0)),
    }
}

/// The numpy broadcast of two shapes, None when they do not broadcast.
pub(crate) fn broadcast_shape(a: &[usize], b: &[usize]) -> Option<Vec<usize>> {
    let rank = a.len().max(b.len());
    let dim = |s: &[usize], d: usize| (d + s.len()).checked_sub(rank).map_or(1, |i| s[i]);
    (0..rank)
        .map(|d| match (dim(a, d), dim(b, d)) {
            (x, y) if x == y || y == 1 => Some(x),
            (1, y) => Some(y),
            _ => None,
        })
        .collect()
}
