//! mindkit: fast, safe tooling for Megatron-LM / MindSpeed-LLM training.
//!
//! The binary (`src/bin/mindkit.rs`) only parses arguments; everything lives here.
//!
//! # Code map
//!
//! Floors, lowest first; a module uses only those below it (tests may reach for [`fuzzing`]'s
//! fixtures builders):
//!
//! | floor | module | concern |
//! |---|---|---|
//! | 0 | [`tensor`] | the one [`tensor::DType`], host tensors, bf16/f16 rounding, SIMD kernels (dot, exp, packed-panel matmul) |
//! | 0 | [`util`] | atomic outputs (temporary name, rename when complete, clean-up on interrupt), `--force` rules, the progress bar |
//! | 1 | [`arch`] | what a model is, apart from files and engines: `ModelConfig`, families as data (tensor names, QKV packing), canonical tensors (roles, shapes) |
//! | 1 | [`data`] | records → Megatron `.bin/.idx` (`preprocess`, handlers, tokenizer), `IndexedDataset`, `GPTDataset` / `BlendedDataset` samples, the fine-tuning dataset, `data info/show` |
//! | 1 | [`engine`] | the compute contract: `Device` (memory, transfers, capabilities) and `Backend` ops as forward/backward pairs with their shape contract (`check`), the collectives' contract (`comm::Communicator`; on the CPU, ranks as threads or as processes joined by sockets: `cpu::comm`), an MoE layer's token dispatch (`dispatch`: megatron-core's permuted order), LayerNorm's host default (`layer_norm`), the CPU backend every other backend is checked against, and `selftest` (a backend against the CPU; the CPU's gradients against finite differences) |
//! | 2 | [`ckpt`] | checkpoint formats (`torch` pickle reader/writer, `hf` safetensors, `megatron` directories; `config` reads and writes `ModelConfig`), what a tensor becomes across TP/PP (`transform`, `layout`), `convert`, `ckpt info`, `lora` |
//! | 2 | [`npu`] | Ascend NPUs through CANN, loaded at run time (`crates/ascendcl-sys`): `npu info`, the engine's backend on aclnn operators (one stream, caching pool), HCCL's collectives (`comm`) |
//! | 3 | [`model`] | the decoder of every family on any `Backend`, written once: one layer (`layer`) composed of a norm kind (`norm`: RMSNorm, or LayerNorm with β), an attention kind (`attention`: GQA, with optional q/k head norms) and an MLP kind (`mlp`: dense SwiGLU, or mixture of experts; LongCat-Flash's pairs: the layer twice, the first also routing shortcut experts the second adds), stacked for training (`decoder`: forward returns what backward consumes) and inference (`Model`, with a KV cache); the parameter table, tensor parallelism's collectives (`parallel`), KV-cached generation |
//! | 4 | [`device`] | the one place `--device` / `--npu-id` become a backend (`DeviceKind`, clap's `DeviceArgs`): `run` runs a `Job` (work written once over any `Backend`) on the CPU or the NPU named; `selftest`'s dispatch |
//! | 5 | [`eval`] | `mindkit eval`: BoolQ / MMLU / GSM8K as lm-evaluation-harness scores them |
//! | 5 | [`train`] | `mindkit train`: Megatron-LM flags, samples, loss, AdamW, schedule, logging, checkpoints; tensor-, pipeline- (1F1B, or interleaved over model chunks) and data-parallel ranks as threads or as a launcher's processes (`store`: torch's TCPStore, torchrun / Slurm environments; `parallel`: megatron-core's rank layout, groups and pipeline stages; `pipeline`: the schedules); by job: `launch` (ranks as threads, processes or HCCL groups; the only file of `train` that imports `npu`), `trainer` (the state and the loop), `step` (one step through the pipeline schedule), `finalize` (gradient and loss sums, norms: `finalize_model_grads`), `resume` (checkpoints restored and saved; formats in `checkpoint`), `init`, `datasets`, `report`, `preference` (MindSpeed-LLM's DPO objective) |
//! | – | [`fuzzing`] | entry points for the cargo-fuzz targets in `fuzz/` and their seed inputs |
//!
//! # Errors
//!
//! Floors 0 and 1 (`tensor`, `util`, `arch`, `data`, `engine`) return typed errors: a `thiserror`
//! enum per module (`CastError`, `OutputError`, `IndexedError`, `EngineError`, …), one variant per
//! failure, naming the file, tensor or field involved. `anyhow` starts at floor 2, where formats
//! become commands: `ckpt` (HF and Megatron directories, `transform`, `convert`, `lora`, `info`),
//! `npu`'s commands, [`model`], [`eval`], [`train`] and the binary return `anyhow::Result` and add
//! `.context()` saying what was being read or done. The parts of those modules that fail in one
//! precise way stay typed beneath the context: `ckpt::torch` (`TorchError`, `PickleError`),
//! `ckpt::config`'s field checks (`ConfigError`), `npu`'s `NpuError`, `train`'s `ArgsError`. The
//! binary prints the chain once (`mindkit: {:#}`). One exception below floor 2: the panel packing
//! in `tensor` returns `anyhow`, which the engine turns into an `EngineError`.
//!
//! Project documents the code relies on (formats, Megatron semantics, test assets) are in `docs/`.
#![deny(missing_docs)]

pub mod arch;
pub mod ckpt;
pub mod data;
pub mod device;
pub mod engine;
pub mod eval;
pub mod fuzzing;
pub mod model;
pub mod npu;
pub mod tensor;
pub mod train;
pub mod util;
