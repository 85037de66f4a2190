//! Datasets: raw records → Megatron indexed datasets, and tools to inspect them.

mod arrow_ipc;
pub mod gpt_dataset;
pub mod handlers;
pub mod indexed;
pub mod inspect;
pub mod mt19937;
mod parquet_footer;
pub mod preprocess;
pub mod sft_dataset;
pub mod source;
pub mod tekken;
pub mod tokenizer;
mod untrusted;
