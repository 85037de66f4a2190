//! HCCL's element types and reductions as the stand-in computes them: floats accumulate in f32
//! in rank order and round once to the dtype; integers wrap as the dtype's width does.

use half::{bf16, f16};
use hccl_sys::*;

/// The bytes of one element of `dtype`, for the dtypes HCCL moves (INT128 and the fp8 kinds
/// are not among them).
pub(crate) fn element_size(dtype: HcclDataType) -> Option<usize> {
    match dtype {
        HCCL_DATA_TYPE_INT8 | HCCL_DATA_TYPE_UINT8 => Some(1),
        HCCL_DATA_TYPE_INT16 | HCCL_DATA_TYPE_UINT16 => Some(2),
        HCCL_DATA_TYPE_FP16 | HCCL_DATA_TYPE_BFP16 => Some(2),
        HCCL_DATA_TYPE_INT32 | HCCL_DATA_TYPE_UINT32 | HCCL_DATA_TYPE_FP32 => Some(4),
        HCCL_DATA_TYPE_INT64 | HCCL_DATA_TYPE_UINT64 | HCCL_DATA_TYPE_FP64 => Some(8),
        _ => None,
    }
}

/// Why HCCL refuses to reduce `dtype` with `op` (as on Atlas A2: int8/16/32/64, fp16, fp32 and
/// bf16; no product for int16 and bf16), as `(code, message)`; `None` when it reduces it.
pub(crate) fn reduction_refused(
    dtype: HcclDataType,
    op: HcclReduceOp,
) -> Option<(HcclResult, String)> {
    if !matches!(
        op,
        HCCL_REDUCE_SUM | HCCL_REDUCE_PROD | HCCL_REDUCE_MAX | HCCL_REDUCE_MIN
    ) {
        return Some((
            HCCL_E_PARA,
            format!("reduce op {op} is not SUM, PROD, MAX or MIN"),
        ));
    }
    let reducible = is_float(dtype) || is_int(dtype);
    let product_refused =
        op == HCCL_REDUCE_PROD && matches!(dtype, HCCL_DATA_TYPE_INT16 | HCCL_DATA_TYPE_BFP16);
    if !reducible || product_refused {
        return Some((
            HCCL_E_NOT_SUPPORT,
            format!("HCCL does not reduce dtype {dtype} with op {op}"),
        ));
    }
    None
}

fn is_float(dtype: HcclDataType) -> bool {
    matches!(
        dtype,
        HCCL_DATA_TYPE_FP32 | HCCL_DATA_TYPE_FP16 | HCCL_DATA_TYPE_BFP16
    )
}

fn is_int(dtype: HcclDataType) -> bool {
    matches!(
        dtype,
        HCCL_DATA_TYPE_INT8 | HCCL_DATA_TYPE_INT16 | HCCL_DATA_TYPE_INT32 | HCCL_DATA_TYPE_INT64
    )
}

fn floats(bytes: &[u8], dtype: HcclDataType) -> Vec<f32> {
    match dtype {
        HCCL_DATA_TYPE_FP16 => bytes
            .chunks_exact(2)
            .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        HCCL_DATA_TYPE_BFP16 => bytes
            .chunks_exact(2)
            .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        _ => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
            .collect(),
    }
}

fn float_bytes(values: &[f32], dtype: HcclDataType) -> Vec<u8> {
    values
        .iter()
        .flat_map(|&v| match dtype {
            HCCL_DATA_TYPE_FP16 => f16::from_f32(v).to_le_bytes().to_vec(),
            HCCL_DATA_TYPE_BFP16 => bf16::from_f32(v).to_le_bytes().to_vec(),
            _ => v.to_le_bytes().to_vec(),
        })
        .collect()
}

/// Integers of `size` bytes, sign-extended to i64.
fn ints(bytes: &[u8], size: usize) -> Vec<i64> {
    bytes
        .chunks_exact(size)
        .map(|b| {
            let mut wide = [0u8; 8];
            wide[..size].copy_from_slice(b);
            let shift = 64 - 8 * size as u32;
            (i64::from_le_bytes(wide) << shift) >> shift
        })
        .collect()
}

/// The low `size` bytes of each value: the dtype's wrap-around.
fn int_bytes(values: &[i64], size: usize) -> Vec<u8> {
    values
        .iter()
        .flat_map(|v| v.to_le_bytes()[..size].to_vec())
        .collect()
}

/// `op` over `parts` (each rank's elements of `dtype`, in rank order), element-wise. The
/// caller has checked [`reduction_refused`].
pub(crate) fn reduce(parts: &[&[u8]], dtype: HcclDataType, op: HcclReduceOp) -> Vec<u8> {
    if is_float(dtype) {
        let mut acc = floats(parts[0], dtype);
        for part in &parts[1..] {
            for (a, v) in acc.iter_mut().zip(floats(part, dtype)) {
                *a = match op {
                    HCCL_REDUCE_SUM => *a + v,
                    HCCL_REDUCE_PROD => *a * v,
                    HCCL_REDUCE_MAX => a.max(v),
                    _ => a.min(v),
                };
            }
        }
        return float_bytes(&acc, dtype);
    }
    let size = element_size(dtype).expect("a reducible dtype");
    let mut acc = ints(parts[0], size);
    for part in &parts[1..] {
        for (a, v) in acc.iter_mut().zip(ints(part, size)) {
            *a = match op {
                HCCL_REDUCE_SUM => a.wrapping_add(v),
                HCCL_REDUCE_PROD => a.wrapping_mul(v),
                HCCL_REDUCE_MAX => (*a).max(v),
                _ => (*a).min(v),
            };
        }
    }
    int_bytes(&acc, size)
}
