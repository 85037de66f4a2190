//! Checkpoints: PyTorch `.pt` files (and, as they are built, HF and Megatron directories).

pub mod torch;
