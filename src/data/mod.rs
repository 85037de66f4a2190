//! Datasets: raw records → Megatron indexed datasets, and tools to inspect them.

mod arrow_ipc;
pub mod handlers;
pub mod indexed;
pub mod inspect;
mod parquet_footer;
pub mod preprocess;
pub mod source;
pub mod tokenizer;
mod untrusted;
