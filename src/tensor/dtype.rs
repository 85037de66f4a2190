//! The element types of tensors everywhere in mindkit: checkpoint storages, the engine's
//! buffers, casts. How each format names them lives with the format (torch: `ckpt::torch::pickle`).
//! Also the one bf16 rounding and widening of single values, which every loop over bf16 bits
//! (the casts in `host.rs`, the SIMD kernels in `simd.rs`, the CPU engine) calls.

/// Element types of tensors (those torch storages hold).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// float64
    F64,
    /// float32
    F32,
    /// float16
    F16,
    /// bfloat16
    BF16,
    /// int64
    I64,
    /// int32
    I32,
    /// int16
    I16,
    /// int8
    I8,
    /// uint8
    U8,
    /// bool
    Bool,
    /// float8 e4m3fn (1 sign, 4 exponent bits biased by 7, 3 mantissa bits; no infinity, NaN
    /// for all-ones): DeepSeek-V3's block-scaled weights.
    F8E4M3,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 | DType::I16 => 2,
            DType::I8 | DType::U8 | DType::Bool | DType::F8E4M3 => 1,
        }
    }

    /// `x` rounded to this floating dtype (itself for f32 and the others).
    pub fn round(self, x: f32) -> f32 {
        match self {
            DType::BF16 => bf16_to_f32(bf16_bits(x)),
            DType::F16 => half::f16::from_f32(x).to_f32(),
            _ => x,
        }
    }
}

/// `x` rounded to the nearest bfloat16, ties to even (NaN stays a quiet NaN): what
/// `half::bf16::from_f32` and torch compute, written branch-free so the loops over it vectorize.
#[inline]
pub fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    let rounded = (b.wrapping_add(0x7FFF + ((b >> 16) & 1)) >> 16) as u16;
    let nan = ((b >> 16) as u16) | 0x0040;
    if b & 0x7FFF_FFFF > 0x7F80_0000 {
        nan
    } else {
        rounded
    }
}

/// The value of the float8 e4m3fn `bits` (exact in f32): `(1 + m/8)·2^(e−7)`, subnormals
/// `m/8·2^−6`, NaN for exponent and mantissa all ones (torch's `float8_e4m3fn`).
#[inline]
pub fn f8e4m3_to_f32(bits: u8) -> f32 {
    let sign = if bits & 0x80 != 0 { -1.0 } else { 1.0 };
    let (e, m) = (i32::from((bits >> 3) & 0xF), f32::from(bits & 0x7));
    sign * match (e, bits & 0x7F) {
        (_, 0x7F) => f32::NAN,
        (0, _) => m / 8.0 * 2f32.powi(-6),
        _ => (1.0 + m / 8.0) * 2f32.powi(e - 7),
    }
}

/// The f32 that bfloat16 `bits` hold (exact: the bits become the top half, every NaN payload
/// kept as it is, unlike `half::bf16::to_f32`, which sets the quiet bit of a signalling NaN).
#[inline]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float8_e4m3fn_decodes_as_torch_does() {
        // torch.tensor([...], dtype=torch.uint8).view(torch.float8_e4m3fn).float() (torch 2.9)
        for (bits, value) in [
            (0x00, 0.0),
            (0x01, 0.001_953_125),
            (0x07, 0.013_671_875),
            (0x08, 0.015_625),
            (0x38, 1.0),
            (0x3C, 1.5),
            (0x7E, 448.0),
            (0xC0, -2.0),
            (0xFE, -448.0),
        ] {
            assert_eq!(f8e4m3_to_f32(bits), value, "{bits:#x}");
        }
        assert!(f8e4m3_to_f32(0x7F).is_nan() && f8e4m3_to_f32(0xFF).is_nan());
        assert_eq!(f8e4m3_to_f32(0x80).to_bits(), (-0.0f32).to_bits());
    }

    #[test]
    fn bf16_rounding_matches_half() {
        // A stride coprime with 2³² walks bit patterns of every class: normals, subnormals,
        // ties, infinities, NaNs.
        let mut bits = 0u32;
        for _ in 0..(1 << 22) {
            let x = f32::from_bits(bits);
            assert_eq!(bf16_bits(x), half::bf16::from_f32(x).to_bits(), "{bits:#x}");
            bits = bits.wrapping_add(0x9E37_79B1 >> 10 | 1);
        }
        for x in [
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::MAX,
            -0.0,
            0.0,
            1.003_906_3,
            1.011_718_8,
        ] {
            assert_eq!(bf16_bits(x), half::bf16::from_f32(x).to_bits(), "{x}");
        }
    }

    #[test]
    fn bf16_widening_matches_half_and_keeps_signalling_nans() {
        for bits in 0..=u16::MAX {
            let want = half::bf16::from_bits(bits).to_f32();
            if !want.is_nan() {
                assert_eq!(bf16_to_f32(bits).to_bits(), want.to_bits(), "{bits:#x}");
            }
        }
        // half quiets a signalling NaN (0x7FC1_0000); the bits are kept here.
        assert_eq!(bf16_to_f32(0x7F81).to_bits(), 0x7F81_0000);
        assert_eq!(bf16_to_f32(0xFFC0).to_bits(), 0xFFC0_0000);
    }
}
