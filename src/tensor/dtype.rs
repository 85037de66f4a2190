//! The element types of tensors everywhere in mindkit: checkpoint storages, the engine's
//! buffers, casts. How each format names them lives with the format (torch: `ckpt::torch::pickle`).

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
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 | DType::I16 => 2,
            DType::I8 | DType::U8 | DType::Bool => 1,
        }
    }
}
