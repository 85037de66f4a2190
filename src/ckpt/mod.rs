//! Checkpoints: PyTorch `.pt` files, Hugging Face and Megatron directories, and the conversion
//! between them. Format code (`torch`, `hf`, `megatron`) is kept apart from what tensors become
//! (`transform`, `tensor`); model families are data (`family`).

pub mod config;
pub mod convert;
pub mod family;
pub mod hf;
pub mod info;
pub mod layout;
pub mod lora;
pub mod megatron;
pub mod torch;
pub mod transform;

pub use config::ModelConfig;
