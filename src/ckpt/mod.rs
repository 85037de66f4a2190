//! Checkpoints: PyTorch `.pt` files, Hugging Face and Megatron directories, and the conversion
//! between them. Format code (`torch`, `hf`, `megatron`) is kept apart from what tensors become
//! (`transform`, `layout`); what a model is (config, family, canonical tensors) lives below, in
//! `crate::arch`.

pub mod config;
pub mod convert;
pub mod grouped;
pub mod hf;
pub mod info;
pub mod layout;
pub mod lora;
pub mod megatron;
pub mod torch;
pub mod torch_dist;
pub mod transform;
