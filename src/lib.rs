//! mindkit: fast, safe tooling for Megatron-LM / MindSpeed-LLM training.
//!
//! The binary (`src/bin/mindkit.rs`) only parses arguments; everything lives here.
#![deny(missing_docs)]

pub mod ckpt;
pub mod data;
pub mod engine;
pub mod eval;
pub mod fuzzing;
pub mod model;
pub mod train;
pub mod util;
