//! Turning Megatron / MindSpeed-LLM flags into one resolved training configuration, checked
//! before any work: architecture (from the flags, or from `--load` with the flags checked
//! against it), tokenizer ids, data, batches, schedule, optimizer, checkpoints, logging.
//! Defaults are Megatron-LM core 0.15's (megatron/training/arguments.py).
//!
//! By job: the model and tokenizer (`architecture`), the parallel layout (`parallelism`), the
//! optimizer's schedule and recorded flags (`optimizer`), MindSpeed-LLM's fine-tuning
//! (`finetune`); here the resolved types, the flag helpers they share, and [`resolve`].

mod architecture;
mod finetune;
mod moe;
mod optimizer;
mod parallelism;

pub use parallelism::{BucketSize, Buckets, VirtualPipeline};

use super::args::Args;
use super::data::LossAveraging;
use super::data::{Loader, SftRows};
use super::optim::AdamConfig;
use super::parallel::{Axis, Layout};
use super::schedule::Schedule;
use crate::arch::family::by_name;
use crate::arch::{ModelConfig, MtpLayout};
use crate::ckpt::convert::{detect, open_checkpoint, Format, Input};
use crate::ckpt::layout::KeyLayout;
use crate::data::gpt_dataset::{split_matrix, split_weights, Blend, MaskConfig};
use crate::data::sft_dataset::Order;
use crate::data::tokenizer::Tokenizer;
use crate::engine::dropout::Rate;
use crate::model::params::LoraSpec;
use crate::tensor::DType;
use anyhow::{anyhow, bail, Result};
use architecture::{dropout_rates, family_name, model_config, tokenizer, tokenizer_source};
use finetune::{lora_config, preference_config, sft_config};
use optimizer::{recorded_args, schedule};
use parallelism::{
    buckets, check_tensor_parallel, pipeline_stages, virtual_pipeline, virtual_stages,
};
use std::path::PathBuf;

/// Where the model's weights come from.
#[derive(Clone)]
pub enum Start {
    /// Initialised from a normal distribution (no `--load`).
    Scratch,
    /// `--load`: an HF directory or a Megatron checkpoint.
    Load {
        /// The directory.
        dir: PathBuf,
        /// Its opened weights.
        input: std::sync::Arc<Input>,
        /// Also restore iteration, consumed samples and (unless `no_optim`) the optimizer
        /// and schedule (a Megatron checkpoint without `--finetune`).
        resume: bool,
        /// `--no-load-optim`.
        no_optim: bool,
    },
}

/// How often and where checkpoints go.
#[derive(Debug, Clone)]
pub struct SaveConfig {
    /// `--save`.
    pub dir: PathBuf,
    /// `--save-interval` (`None`: only at the end).
    pub interval: Option<u64>,
    /// `--no-save-optim`.
    pub no_optim: bool,
    /// Key layout from `--transformer-impl`.
    pub layout: KeyLayout,
    /// `--ckpt-format torch_dist` (else torch).
    pub dist: bool,
}

/// Everything a training run needs, resolved.
#[derive(Clone)]
pub struct TrainConfig {
    /// Architecture (dtype: the model parameters').
    pub model: ModelConfig,
    /// Rows of the embedding and output (the padded vocabulary).
    pub vocab_padded: usize,
    /// `--make-vocab-size-divisible-by`.
    pub divisible_by: usize,
    /// Where the weights come from.
    pub start: Start,
    /// The tokenizer (its vocabulary size and special tokens matter).
    pub tokenizer: Tokenizer,
    /// `--data-path`.
    pub blend: Blend,
    /// `--split`.
    pub split: String,
    /// `--seed`.
    pub seed: u32,
    /// `--hidden-dropout`, `--attention-dropout` (`None`: 0).
    pub dropout: (Option<Rate>, Option<Rate>),
    /// The MoE routers' draws in training: `--moe-input-jitter-eps`, and whether a router
    /// samples its experts (SparseMixer, `--moe-router-load-balancing-type sparsemixer_topk`).
    pub router_noise: (Option<f32>, bool),
    /// A mixture of experts' auxiliary losses (`None` for a dense model).
    pub aux_losses: Option<crate::model::AuxLosses>,
    /// DeepSeek sparse attention's indexer loss (`None` without an indexer).
    pub indexer_loss: Option<crate::model::IndexerLoss>,
    /// `--mtp-loss-scaling-factor` (megatron-core's default 0.1): the multi-token prediction
    /// depths' share of the loss.
    pub mtp_loss_scale: f64,
    /// The router's product in f32 under `--bf16` (`--moe-router-dtype fp32`,
    /// MindSpeed-LLM's `--router-gating-in-fp32`).
    pub router_f32: bool,
    /// Token dropping (`--moe-expert-capacity-factor`); `None`: dropless.
    pub capacity: Option<crate::arch::moe::Capacity>,
    /// `--moe-router-bias-update-rate` (megatron-core's default 1e-3): how far an expert bias
    /// moves after each step.
    pub expert_bias_rate: f64,
    /// `--moe-grouped-gemm`: the routed experts saved as MindSpeed-LLM's grouped tensors
    /// (`mlp.experts.weight1`/`weight2`, one optimizer parameter each), as its GroupedMLP
    /// holds them; the math is the experts' own either way.
    pub grouped_experts: bool,
    /// `--moe-grouped-gemm` with `--transformer-impl transformer_engine`: the routed experts
    /// saved as megatron-core's TEGroupedMLP holds them (`mlp.experts.linear_fc1.weight{i}`,
    /// a parameter per expert, `crate::ckpt::layout::te_grouped_entries`).
    pub te_grouped_experts: bool,
    /// MindSpeed's `--gemm-gradient-accumulation-fusion`: grouped experts' weight gradients add
    /// into the f32 main gradients unrounded (as `gradient_accumulation_fusion` does for the
    /// linear layers).
    pub gemm_gradient_accumulation_fusion: bool,
    /// EOD, pad and masking.
    pub masks: MaskConfig,
    /// S.
    pub seq_length: usize,
    /// M and G.
    pub micro_batch: usize,
    /// G.
    pub global_batch: usize,
    /// Data-parallel ranks (the world size over TP × PP): each takes its slice of every global
    /// batch, as Megatron's sampler gives it.
    pub data_parallel: usize,
    /// `--dataloader-type`: which sampler draws the samples.
    pub loader: Loader,
    /// Where the ranks sit (TP, DP, PP).
    pub layout: Layout,
    /// MindSpeed-LLM's `--moe-tp-extend-ep` under TP > 1: the layout's expert-parallel group
    /// is TP × the flag's EP ranks with whole experts; checkpoint files keep the flag's EP.
    pub tp_extend_ep: bool,
    /// Layers of each pipeline stage (one entry without pipeline parallelism).
    pub stages: Vec<usize>,
    /// The virtual pipeline: model chunks per stage and the micro-batches each chunk runs in
    /// a row (`None`: one chunk per stage, the 1F1B schedule).
    pub virtual_pipeline: Option<VirtualPipeline>,
    /// MindSpeed's `--schedules-method dualpipev`: the two chunks of each stage in a V
    /// ([`crate::ckpt::layout::Parallel::dualpipev`]).
    pub dualpipev: bool,
    /// `--sequence-parallel` at TP > 1.
    pub sequence_parallel: bool,
    /// `--use-distributed-optimizer` and how its buffer is bucketed.
    pub distributed_optimizer: Option<Buckets>,
    /// Iterations to reach.
    pub train_iters: u64,
    /// Samples the train split is built for: `--train-samples`, else iterations × global batch.
    pub train_samples: u64,
    /// The learning-rate schedule.
    pub schedule: Schedule,
    /// Resume the schedule from the checkpoint's values (`--use-checkpoint-opt-param-scheduler`)
    /// or keep the command line's (`--override-opt-param-scheduler`); else they must agree.
    pub schedule_source: ScheduleSource,
    /// Adam.
    pub adam: AdamConfig,
    /// Loss averaging.
    pub averaging: LossAveraging,
    /// `--bf16`.
    pub bf16: bool,
    /// Megatron's `gradient_accumulation_fusion` (off with `--no-gradient-accumulation-fusion`):
    /// the linear layers' weight gradients add into the f32 main gradients unrounded. Every
    /// other gradient of a bf16 model is a bf16 tensor per backward pass, rounded before it is
    /// added (`step.rs`, `rounds_per_pass`).
    pub gradient_accumulation_fusion: bool,
    /// `--init-method-std` and `--embedding-init-method-std`.
    pub init_std: (f64, Option<f64>),
    /// Checkpoints.
    pub save: Option<SaveConfig>,
    /// `--eval-interval`, `--eval-iters`.
    pub eval: Option<(u64, u64)>,
    /// The samples the validation and test splits are built for, with `eval`.
    pub eval_samples: Option<(u64, u64)>,
    /// `--log-interval`.
    pub log_interval: u64,
    /// `--log-throughput`.
    pub log_throughput: bool,
    /// `--distributed-timeout-minutes` (10 by default, as Megatron's): how long a rank waits
    /// for the others, at the launcher's store and at a collective on the CPU backend.
    pub rank_timeout: std::time::Duration,
    /// `--log-comm-stats` (mindkit's): the collectives' calls and bytes after each log line.
    pub log_comm_stats: bool,
    /// `--log-params-norm`, `--log-num-zeros-in-grad`.
    pub log_norms: (bool, bool),
    /// `--tensorboard-dir` and its interval.
    pub tensorboard: Option<(PathBuf, u64)>,
    /// `--log-validation-ppl-to-tensorboard`.
    pub tensorboard_ppl: bool,
    /// `--exit-interval`, `--exit-duration-in-mins`, `--exit-signal-handler`.
    pub exit: ExitConfig,
    /// Skip an update whose gradient norm is not finite (default), or apply it.
    pub skip_non_finite: bool,
    /// `--mid-level-dataset-surplus`.
    pub surplus: f64,
    /// The optimizer and schedule flags as Megatron's `args` holds them after `validate_args`
    /// (checkpoints record them).
    pub recorded: Vec<(&'static str, serde_json::Value)>,
    /// Flags given that have no effect here.
    pub inert: Vec<(&'static str, &'static str)>,
    /// Fine-tuning data (`--is-instruction-dataset`), instead of GPT pretraining samples.
    pub sft: Option<SftConfig>,
    /// LoRA adapters (`--lora-r`, `--lora-target-modules`): only they are trained.
    pub lora: Option<LoraConfig>,
    /// `--stage dpo`: direct preference optimisation against the starting weights.
    pub preference: Option<crate::train::preference::Dpo>,
}

/// MindSpeed-LLM's LoRA settings.
#[derive(Debug, Clone)]
pub struct LoraConfig {
    /// Rank, alpha, targets.
    pub spec: LoraSpec,
    /// `--lora-ckpt-filter`: checkpoints hold only the adapters.
    pub ckpt_filter: bool,
    /// `--lora-load`: adapters (and, unless `--finetune`, the training state) to resume from.
    pub load: Option<PathBuf>,
}

/// MindSpeed-LLM fine-tuning data.
#[derive(Debug, Clone)]
pub struct SftConfig {
    /// The one prefix MindSpeed-LLM reads (the first of `--data-path`).
    pub prefix: PathBuf,
    /// Row layout.
    pub rows: SftRows,
    /// Shuffling and padding of epochs.
    pub order: Order,
    /// `--is-pairwise-dataset`: preference pairs (chosen, rejected), not instruction samples.
    pub pairwise: bool,
}

/// Where the schedule's settings come from on resume.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScheduleSource {
    /// They must equal the checkpoint's (Megatron's default).
    Check,
    /// The checkpoint's (`--use-checkpoint-opt-param-scheduler`).
    Checkpoint,
    /// The command line's (`--override-opt-param-scheduler`).
    CommandLine,
}

/// When to stop early.
#[derive(Debug, Clone, Copy, Default)]
pub struct ExitConfig {
    /// Save and exit every N iterations.
    pub interval: Option<u64>,
    /// Save and exit after this many minutes.
    pub minutes: Option<f64>,
    /// Save and exit on SIGTERM / SIGINT.
    pub on_signal: bool,
}

fn flag_error(flag: &str, why: impl std::fmt::Display) -> anyhow::Error {
    anyhow!("--{flag}: {why}")
}

/// A flag that must be a positive integer if given.
fn positive(a: &Args, flag: &str) -> Result<Option<usize>> {
    match a.parse_value::<usize>(flag)? {
        Some(0) => Err(flag_error(flag, "must be at least 1")),
        v => Ok(v),
    }
}

/// A float flag that must be finite and pass `ok` (described by `range`): argparse's
/// `type=float` takes "nan" and "inf", which would poison every step without a word.
fn float_in(a: &Args, flag: &str, ok: fn(f64) -> bool, range: &str) -> Result<Option<f64>> {
    match a.parse_value::<f64>(flag)? {
        Some(v) if !(v.is_finite() && ok(v)) => Err(flag_error(
            flag,
            format!("{v} is out of range: expected a finite number {range}"),
        )),
        v => Ok(v),
    }
}

/// A non-negative finite float flag.
fn non_negative(a: &Args, flag: &str) -> Result<Option<f64>> {
    float_in(a, flag, |v| v >= 0.0, "≥ 0")
}

/// A positive finite float flag.
fn positive_float(a: &Args, flag: &str) -> Result<Option<f64>> {
    float_in(a, flag, |v| v > 0.0, "> 0")
}

/// A finite float flag in [0, 1].
fn fraction(a: &Args, flag: &str) -> Result<Option<f64>> {
    float_in(a, flag, |v| (0.0..=1.0).contains(&v), "in [0, 1]")
}

/// `n` (the value of `--flag`) global batches in samples, or an error naming both flags.
fn times_batch(n: u64, flag: &str, g: u64) -> Result<u64> {
    n.checked_mul(g).ok_or_else(|| {
        anyhow!("--{flag} {n} × --global-batch-size {g} samples overflows a 64-bit count")
    })
}

/// The samples of the validation split (Megatron's `build_train_valid_test_datasets`: an
/// evaluation every `interval` iterations and one at the end) and of the test split (one
/// evaluation) for `--eval-interval`, `--eval-iters`.
fn eval_samples((interval, iters): (u64, u64), train_iters: u64, g: u64) -> Result<(u64, u64)> {
    let test = times_batch(iters, "eval-iters", g)?;
    let evaluations = train_iters / interval + 1;
    let valid = evaluations.checked_mul(test).ok_or_else(|| {
        anyhow!(
            "--eval-iters {iters} × --global-batch-size {g} × {evaluations} evaluations \
             (--train-iters / --eval-interval + 1) samples overflows a 64-bit count"
        )
    })?;
    Ok((valid, test))
}

/// `--split` read as megatron-core reads it (numbers only), before any work: a warning names
/// the characters it skips, and a split that gives training no data is refused.
fn check_split(split: &str) -> Result<()> {
    let (w, skipped) = split_weights(split)?;
    if !skipped.is_empty() {
        let quoted: Vec<String> = skipped.iter().map(|s| format!("{s:?}")).collect();
        eprintln!(
            "mindkit: warning: --split {split:?} is read as {}, {}, {}: megatron-core keeps only \
             the numbers (runs of digits and dots), skipping {}",
            w[0],
            w[1],
            w[2],
            quoted.join(", ")
        );
    }
    if split_matrix(split)?[0].is_none() {
        bail!("--split {split:?} gives the train split no data");
    }
    Ok(())
}

/// Whether `--load` names something to load: a checkpoint or HF directory, or anything that
/// looks like weights (opened, so a damaged one is an error rather than a fresh start). A
/// missing directory, or one holding only a tokenizer or nothing, holds no checkpoint.
fn holds_a_checkpoint(dir: &std::path::Path) -> bool {
    if detect(dir).is_ok() || dir.is_file() {
        return true;
    }
    let Ok(entries) = std::fs::read_dir(dir) else {
        return false;
    };
    entries.flatten().any(|e| {
        let name = e.file_name().to_string_lossy().into_owned();
        let weights = [".safetensors", ".bin", ".pt", ".pth", ".index.json"];
        let megatron = ["iter_", "mp_rank_", "release"];
        weights.iter().any(|w| name.ends_with(w)) || megatron.iter().any(|m| name.starts_with(m))
    })
}

/// Bytes Megatron's GPTDataset indices take per sample here: a (document, offset) pair of the
/// sample index and a shuffle-index entry, 8 bytes each (the document index adds its own).
const INDEX_BYTES_PER_SAMPLE: u64 = 24;

/// This host's memory in bytes (`MemTotal` of /proc/meminfo), if known.
fn host_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Refuse a run whose sample indices alone (every split, on each rank this process runs as a
/// thread) outgrow the host's memory: the allocation would abort the process instead.
fn check_index_memory(
    a: &Args,
    samples: u64,
    ranks_here: usize,
    memory: Option<u64>,
) -> Result<()> {
    let Some(memory) = memory else {
        return Ok(());
    };
    let per_rank = samples.saturating_mul(INDEX_BYTES_PER_SAMPLE);
    let needed = per_rank.saturating_mul(ranks_here as u64);
    if needed <= memory {
        return Ok(());
    }
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let length = match a.get("train-samples") {
        Some(n) => format!("--train-samples {n}"),
        None => format!(
            "--train-iters {} × --global-batch-size {}",
            a.get("train-iters").unwrap_or("?"),
            a.get("global-batch-size")
                .or(a.get("micro-batch-size"))
                .unwrap_or("?")
        ),
    };
    let ranks = match ranks_here {
        1 => String::new(),
        n => format!(" on each of --world-size {n} ranks (threads of this process)"),
    };
    bail!(
        "{length} (with validation and test, {samples} samples): their indices need {:.1} GiB{ranks}, \
         {:.1} GiB in all, more than this host's {:.1} GiB of memory",
        gib(per_rank),
        gib(needed),
        gib(memory)
    )
}

/// Refuse what is not built yet (context and expert parallelism, other data loaders, optimizers and checkpoint formats).
fn check_single_rank(a: &Args) -> Result<()> {
    if let Some(n) = positive(a, "context-parallel-size")?.filter(|&n| n > 1) {
        bail!("--context-parallel-size {n}: this build trains with tensor, pipeline, data and expert parallelism only (use 1)");
    }
    if let Some(o) = a.get("optimizer").filter(|o| *o != "adam") {
        bail!("--optimizer {o}: only adam (AdamW) is implemented");
    }
    if let Some(stage) = a.get("stage").filter(|s| !["sft", "dpo"].contains(s)) {
        bail!("--stage {stage}: sft (supervised fine-tuning) and dpo (direct preference optimisation) are implemented");
    }

    Ok(())
}

/// `--dataloader-type` (Megatron's default `single`); Megatron's `external` (a loader of the
/// user's own) has no meaning here.
fn loader(a: &Args) -> Result<Loader> {
    match a.get("dataloader-type").unwrap_or("single") {
        "single" => Ok(Loader::Single),
        // Megatron's sampler without sharding (one permutation, every DP-th sample to a rank);
        // MindSpeed-LLM ignores the flag, so the result would depend on whose script it is
        "cyclic" if a.has("no-data-sharding") => Err(flag_error(
            "no-data-sharding",
            "with --dataloader-type cyclic is not implemented (MindSpeed-LLM ignores the flag and \
             shards; leave it out to train as MindSpeed-LLM does)",
        )),
        "cyclic" => Ok(Loader::Cyclic),
        other => Err(flag_error(
            "dataloader-type",
            format!("{other}: expected single (Megatron's sequential sampler) or cyclic (its random sampler)"),
        )),
    }
}

/// The ranks of this run: the launcher's (torchrun's WORLD_SIZE, Slurm's SLURM_NTASKS) for a
/// process it started, else `--world-size` (ranks as threads of this process; TP × PP × CP by
/// default).
/// A `--world-size` that differs from the launcher's is an error.
pub fn world_size(a: &Args) -> Result<usize> {
    let flag = positive(a, "world-size")?;
    let Some(launch) = super::store::from_launcher()? else {
        // One data-parallel rank per expert-parallel rank by default: TP × PP × CP × EP ranks.
        let mut model = 1;
        for size in [
            "tensor-model-parallel-size",
            "pipeline-model-parallel-size",
            "context-parallel-size",
            "expert-model-parallel-size",
        ] {
            model *= positive(a, size)?.unwrap_or(1);
        }
        return Ok(flag.unwrap_or(model));
    };
    match flag {
        Some(n) if n != launch.world_size => bail!(
            "--world-size {n}: the launcher ({:?}) started {} ranks",
            launch.launcher,
            launch.world_size
        ),
        _ => Ok(launch.world_size),
    }
}

/// Resolve the command line.
pub fn resolve(a: &Args) -> Result<TrainConfig> {
    check_single_rank(a)?;
    let loader = loader(a)?;
    let load = a.get("load").map(PathBuf::from);
    // Megatron's load_checkpoint: no checkpoint under --load (no tracker file) means "will
    // start from random"; only --exit-on-missing-checkpoint makes it an error.
    let input = match &load {
        Some(dir) if holds_a_checkpoint(dir) => {
            // MindSpeed-LLM reads --model-type-hf only to convert an HF --load; a Megatron
            // checkpoint is read as its args say, whatever family name the script gives.
            let family = (a.get("model-type-hf").map(family_name))
                .filter(|f| detect(dir).is_ok_and(|d| d == Format::Hf) || by_name(f).is_ok());
            Some(open_checkpoint(dir, None, family)?)
        }
        Some(dir) if a.has("exit-on-missing-checkpoint") => {
            bail!("--load {}: no checkpoint there", dir.display())
        }
        Some(dir) => {
            eprintln!(
                "mindkit: warning: --load {} {}; starting from random weights",
                dir.display(),
                match dir.exists() {
                    true => "holds no checkpoint",
                    false => "does not exist",
                }
            );
            None
        }
        None => None,
    };
    let hf_load = match (&load, &input) {
        (Some(dir), Some(_)) if detect(dir)? == Format::Hf => Some(dir.clone()),
        _ => None,
    };
    // The tokenizer defaults to the one a checkpoint carries (HF directories, and the
    // tokenizer files mindkit copies next to the checkpoints it writes).
    let carried = load
        .as_ref()
        .filter(|d| d.join("tokenizer.json").is_file() || d.join("vocab.json").is_file());
    let (tokenizer, masks) = tokenizer(a, carried)?;
    // The model's vocabulary and the checks count the ids the tokenizer can give (id_limit);
    // the padding counts its vocab_size, as MindSpeed-LLM does (they differ for tekken:
    // MagistralTokenizer's vocab_size counts entries encoding never gives, 132072 for
    // Magistral's 131072 ids, whose scripts pass --padded-vocab-size 131072).
    let mut model = model_config(a, input.as_ref(), tokenizer.id_limit())?;
    if input.is_some() && tokenizer.id_limit() > model.vocab {
        // Megatron sizes the embedding from the tokenizer and fails to load a checkpoint of
        // another size (load_state_dict's size mismatch); growing it would train untrained rows.
        let (flag, path) = tokenizer_source(a, carried)?;
        bail!(
            "--{flag} {}: the tokenizer has {} tokens, more than the {} of the --load \
             checkpoint's vocabulary; it was trained with another tokenizer",
            path.display(),
            tokenizer.id_limit(),
            model.vocab
        );
    }
    let divisible_by = positive(a, "make-vocab-size-divisible-by")?.unwrap_or(128);
    let tp = positive(a, "tensor-model-parallel-size")?.unwrap_or(1);
    // Megatron pads to a multiple of the divisor × TP (training.py `_vocab_size_with_padding`).
    let vocab_padded = match positive(a, "padded-vocab-size")? {
        Some(v) => v,
        None => tokenizer.vocab_size().div_ceil(divisible_by * tp) * divisible_by * tp,
    };
    if tokenizer.id_limit() > vocab_padded || model.vocab > vocab_padded {
        bail!(
            "the padded vocabulary ({vocab_padded}) is smaller than the tokenizer's {} / the \
             model's {} tokens: raise --padded-vocab-size",
            tokenizer.id_limit(),
            model.vocab
        );
    }
    let bf16 = a.has("bf16");
    model.dtype = if bf16 { DType::BF16 } else { DType::F32 };
    model.norms_f32 = a.has("init-norm-weight-in-fp32");
    let seq_length =
        positive(a, "seq-length")?.ok_or_else(|| anyhow!("--seq-length is required"))?;
    if seq_length > model.max_positions {
        bail!(
            "--seq-length {seq_length} is above the model's {} positions (max_position_embeddings)",
            model.max_positions
        );
    }
    let router_noise = moe::router_noise(a, &model)?;
    let dropout = dropout_rates(a, &model, seq_length, router_noise)?;
    moe::check_supported(a, &model)?;
    let micro_batch = positive(a, "micro-batch-size")?
        .ok_or_else(|| anyhow!("--micro-batch-size is required"))?;
    let global_batch = positive(a, "global-batch-size")?.unwrap_or(micro_batch);
    if !global_batch.is_multiple_of(micro_batch) {
        bail!("--global-batch-size {global_batch} is not a multiple of --micro-batch-size {micro_batch}");
    }
    let size = |flag| positive(a, flag).map(|n| n.unwrap_or(1));
    let (tp, pp, cp) = (
        size("tensor-model-parallel-size")?,
        size("pipeline-model-parallel-size")?,
        size("context-parallel-size")?,
    );
    let tp_extend_ep = moe::tp_extend_ep(a, &model)?;
    let (ep, etp) = match tp_extend_ep {
        true => (moe::expert_parallel(a, &model)? * tp, 1),
        false => (
            moe::expert_parallel(a, &model)?,
            moe::expert_tensor_parallel(a, &model)?,
        ),
    };
    let layout = Layout::new(world_size(a)?, tp, pp, cp)?.with_expert_parallel(ep, etp)?;
    let data_parallel = layout.size(Axis::Dp);
    check_tensor_parallel(a, &model, vocab_padded, tp)?;
    let chunks = virtual_stages(a, &model, pp)?;
    if !global_batch.is_multiple_of(micro_batch * data_parallel) {
        bail!(
            "--global-batch-size {global_batch} is not a multiple of --micro-batch-size {micro_batch} × {data_parallel} data-parallel ranks (--world-size)"
        );
    }
    let micro = global_batch / micro_batch / data_parallel;
    let dualpipev = parallelism::dualpipev(a, &model, (pp, chunks), micro)?;
    let stages = pipeline_stages(a, &model, (pp, if dualpipev { 2 } else { chunks }))?;
    let virtual_pipeline = match (chunks, dualpipev) {
        (_, true) => Some(VirtualPipeline {
            chunks: 2,
            group: pp,
        }),
        (1, false) => None,
        _ => Some(virtual_pipeline(
            a,
            (pp, chunks),
            global_batch / micro_batch / data_parallel,
        )?),
    };
    let g = global_batch as u64;
    let train_samples = a.parse_value::<u64>("train-samples")?;
    let train_iters = match (a.parse_value::<u64>("train-iters")?, train_samples) {
        (Some(_), Some(_)) => bail!("--train-iters and --train-samples exclude each other"),
        (Some(i), None) => i,
        (None, Some(s)) => s / g,
        (None, None) => bail!("either --train-iters or --train-samples is required"),
    };
    let schedule = schedule(a, train_iters, train_samples, g)?;
    let schedule_source = match (a.has("use-checkpoint-opt-param-scheduler"), a.has("override-opt-param-scheduler")) {
        (true, true) => bail!("--use-checkpoint-opt-param-scheduler and --override-opt-param-scheduler exclude each other"),
        (true, false) => ScheduleSource::Checkpoint,
        (false, true) => ScheduleSource::CommandLine,
        (false, false) => ScheduleSource::Check,
    };
    let eval_iters = a.parse_value::<u64>("eval-iters")?.unwrap_or(100);
    let eval_interval = positive(a, "eval-interval")?.unwrap_or(1000) as u64;
    let eval = (eval_iters > 0).then_some((eval_interval, eval_iters));
    let eval_samples = eval.map(|e| eval_samples(e, train_iters, g)).transpose()?;
    // Threads of this process unless a launcher started it as one rank.
    let ranks_here = match super::store::from_launcher()? {
        Some(_) => 1,
        None => layout.world(),
    };
    let all_samples = match (train_samples, eval_samples) {
        (Some(s), e) => s.saturating_add(e.map_or(0, |(v, t)| v.saturating_add(t))),
        (None, e) => train_iters
            .saturating_mul(g)
            .saturating_add(e.map_or(0, |(v, t)| v.saturating_add(t))),
    };
    check_index_memory(a, all_samples, ranks_here, host_memory())?;
    let blend = Blend::parse(
        a.list("data-path")
            .ok_or_else(|| anyhow!("--data-path is required"))?,
    )?;
    let sft = sft_config(a, &blend, &tokenizer, &masks, seq_length, global_batch)?;
    let split = a.get("split").unwrap_or("969, 30, 1").to_string();
    if sft.is_none() {
        check_split(&split)?;
    }
    let start = match (load, input) {
        (Some(dir), Some(input)) => {
            let resume = hf_load.is_none() && !a.has("finetune");
            Start::Load {
                dir,
                input: std::sync::Arc::new(input),
                resume,
                no_optim: a.has("no-load-optim"),
            }
        }
        _ => Start::Scratch,
    };
    let resuming = matches!(start, Start::Load { resume: true, .. });
    let preference = preference_config(a, sft.as_ref(), resuming)?;
    let key_layout = match a.get("transformer-impl").unwrap_or("local") {
        "local" => KeyLayout::Mcore,
        "transformer_engine" if architecture::spec_is_local_only(a) => KeyLayout::Mcore,
        "transformer_engine" => KeyLayout::McoreTe,
        other => bail!("--transformer-impl {other}: expected local or transformer_engine"),
    };
    anyhow::Context::context(
        crate::ckpt::layout::check_layout(key_layout, &model),
        "--transformer-impl",
    )?;
    // checked with or without --save, as Megatron's argparse choices check it
    let dist = match a.get("ckpt-format").unwrap_or("torch") {
        "torch" => false,
        "torch_dist" => true,
        f => bail!(
            "--ckpt-format {f}: train writes torch (one model_optim_rng.pt per rank) or \
             torch_dist (megatron-core's distributed checkpoint)"
        ),
    };
    let save = match a.get("save") {
        None => None,
        Some(dir) => Some(SaveConfig {
            dir: PathBuf::from(dir),
            interval: positive(a, "save-interval")?.map(|n| n as u64),
            no_optim: a.has("no-save-optim"),
            layout: key_layout,
            dist,
        }),
    };
    let clip_grad = non_negative(a, "clip-grad")?.unwrap_or(1.0);
    let betas = (
        non_negative(a, "adam-beta1")?.unwrap_or(0.9),
        non_negative(a, "adam-beta2")?.unwrap_or(0.999),
    );
    if betas.0 >= 1.0 || betas.1 >= 1.0 {
        bail!("--adam-beta1/--adam-beta2 must be below 1, got {betas:?}");
    }
    let eps = positive_float(a, "adam-eps")?.unwrap_or(1e-8);
    let adam = AdamConfig {
        betas,
        eps,
        clip_grad,
        moments: match a.has("o2-optimizer") {
            true => DType::BF16,
            false => DType::F32,
        },
    };
    let mut recorded = recorded_args(a, &schedule, &adam, bf16)?;
    recorded.extend(moe::recorded_moe_args(a)?);
    recorded.push(("dataloader_type", serde_json::json!(loader.name())));
    let averaging = if a.has("calculate-per-token-loss") {
        LossAveraging::PerToken
    } else {
        LossAveraging::PerMicroBatch
    };
    // --moe-grouped-gemm: MindSpeed-LLM's GroupedMLP with the local spec, megatron-core's
    // TEGroupedMLP with Transformer Engine's (gpt_layer_specs.py `get_moe_module_spec`)
    let grouped_gemm = model.moe.is_some() && a.has("moe-grouped-gemm");
    let te_grouped_experts = grouped_gemm && key_layout == KeyLayout::McoreTe;
    let grouped_experts = grouped_gemm && !te_grouped_experts;
    let router_f32 = moe::router_f32(a, &model, bf16)?;
    let capacity = moe::capacity(a)?.filter(|_| model.moe.is_some());
    let aux_losses = moe::aux_losses(
        a,
        &model,
        (global_batch / micro_batch, micro_batch),
        averaging == LossAveraging::PerToken,
    )?;
    let indexer_loss = indexer_loss(
        a,
        &model,
        (
            global_batch / micro_batch,
            averaging == LossAveraging::PerToken,
        ),
    )?;
    let lora = lora_built(lora_config(a)?, &model)?;
    if save.as_ref().is_some_and(|s| s.dist) {
        check_torch_dist_save(&model, key_layout, (dualpipev, lora.is_some()))?;
    }
    if save.as_ref().is_some_and(|s| s.dist && !s.no_optim) && model.f32_norms_in_half() {
        bail!("--ckpt-format torch_dist with the optimizer's state of f32 norms beside bf16 weights (--init-norm-weight-in-fp32 --bf16) is not built: save with --ckpt-format torch, or pass --no-save-optim");
    }
    Ok(TrainConfig {
        model,
        vocab_padded,
        divisible_by,
        start,
        tokenizer,
        blend,
        split,
        seed: a.parse_value::<u32>("seed")?.unwrap_or(1234),
        dropout,
        router_noise,
        aux_losses,
        indexer_loss,
        mtp_loss_scale: non_negative(a, "mtp-loss-scaling-factor")?.unwrap_or(0.1),
        grouped_experts,
        te_grouped_experts,
        router_f32,
        capacity,
        expert_bias_rate: moe::bias_update_rate(a)?,
        gemm_gradient_accumulation_fusion: a.has("gemm-gradient-accumulation-fusion"),
        surplus: non_negative(a, "mid-level-dataset-surplus")?
            .unwrap_or(crate::data::gpt_dataset::MID_LEVEL_SURPLUS),
        masks,
        seq_length,
        micro_batch,
        global_batch,
        data_parallel,
        loader,
        layout,
        tp_extend_ep,
        stages,
        virtual_pipeline,
        dualpipev,
        sequence_parallel: tp > 1 && a.has("sequence-parallel"),
        distributed_optimizer: match a.has("use-distributed-optimizer") {
            false => None,
            true => Some(buckets(a, data_parallel)?),
        },
        train_iters,
        train_samples: match train_samples {
            Some(s) => s,
            None => times_batch(train_iters, "train-iters", g)?,
        },
        schedule,
        schedule_source,
        adam,
        averaging,
        bf16,
        gradient_accumulation_fusion: !a.has("no-gradient-accumulation-fusion"),
        init_std: (
            non_negative(a, "init-method-std")?.unwrap_or(0.02),
            non_negative(a, "embedding-init-method-std")?,
        ),
        save,
        eval,
        eval_samples,
        log_interval: positive(a, "log-interval")?.unwrap_or(100) as u64,
        log_throughput: a.has("log-throughput"),
        log_comm_stats: a.has("log-comm-stats"),
        rank_timeout: std::time::Duration::from_secs(
            60 * positive(a, "distributed-timeout-minutes")?.unwrap_or(10) as u64,
        ),
        log_norms: (a.has("log-params-norm"), a.has("log-num-zeros-in-grad")),
        tensorboard: a
            .get("tensorboard-dir")
            .map(|d| {
                Ok::<_, anyhow::Error>((
                    PathBuf::from(d),
                    positive(a, "tensorboard-log-interval")?.unwrap_or(1) as u64,
                ))
            })
            .transpose()?,
        tensorboard_ppl: a.has("log-validation-ppl-to-tensorboard"),
        exit: ExitConfig {
            interval: positive(a, "exit-interval")?.map(|n| n as u64),
            minutes: non_negative(a, "exit-duration-in-mins")?,
            on_signal: a.has("exit-signal-handler"),
        },
        skip_non_finite: !a.has("no-check-for-nan-in-loss-and-grad"),
        recorded,
        inert: a.inert(),
        sft,
        lora,
        preference,
    })
}

/// `--ckpt-format torch_dist` saves what megatron-core's local spec loads: the layouts it
/// does not have are refused by name, as `mindkit convert` refuses them.
fn check_torch_dist_save(
    model: &ModelConfig,
    layout: KeyLayout,
    (dualpipev, lora): (bool, bool),
) -> Result<()> {
    let mla_split = model.mla.is_some_and(|m| m.fused_down || m.split_up);
    let mindspeed_mtp = model.mtp.is_some_and(|m| m.layout == MtpLayout::Mindspeed);
    let refused = [
        (
            layout == KeyLayout::McoreTe,
            "--transformer-impl transformer_engine's layout",
        ),
        (dualpipev, "--schedules-method dualpipev's layer order"),
        (
            model.paired,
            "LongCat-Flash's layer (MindSpeed-LLM's longcat_spec)",
        ),
        (
            mla_split,
            "MindSpeed-LLM's layout of multi-latent attention (its deepseek_spec)",
        ),
        (
            mindspeed_mtp,
            "MindSpeed-LLM's multi-token prediction (--mtp-layout mcore is megatron-core's)",
        ),
        (lora, "a LoRA adapter"),
    ];
    match refused.iter().find(|(refused, _)| *refused) {
        Some((_, what)) => bail!(
            "--ckpt-format torch_dist is saved as megatron-core's local spec loads it; {what} \
             is not (save with --ckpt-format torch)"
        ),
        None => Ok(()),
    }
}

/// DeepSeek sparse attention's indexer loss of a model with an indexer, for steps of
/// `micro_batches` micro-batches (its gradient scaled as the MoE auxiliary losses' are), and
/// what of it is not built refused by name.
fn indexer_loss(
    a: &Args,
    model: &ModelConfig,
    (micro_batches, per_token): (usize, bool),
) -> Result<Option<crate::model::IndexerLoss>> {
    let Some(mla) = model.mla.filter(|m| m.dsa.is_some()) else {
        return Ok(None);
    };
    if mla.q_lora_rank.is_none() {
        bail!("--enable-dsa-indexer: the indexer's queries come from the query latent: pass --q-lora-rank");
    }
    if mla.scale_latents.iter().any(|&s| s) {
        bail!("--enable-dsa-indexer with --enable-mla-scale-q-lora / --enable-mla-scale-kv-lora is not built");
    }
    if a.parse_value::<usize>("tensor-model-parallel-size")?
        .unwrap_or(1)
        > 1
    {
        bail!("--enable-dsa-indexer under tensor parallelism is not built yet (--tensor-model-parallel-size 1)");
    }
    let halves = mla.dsa.is_some_and(|d| !d.rope_pairs_adjacent);
    if halves && yarn_scales_rope(model) {
        // MindSpeed-LLM's complex RoPE of the indexer takes YaRN's frequencies without the
        // attention factor the rotary tables carry here
        bail!("--enable-dsa-indexer without --apply-rope-no-in-complex under YaRN with an attention factor (--rope-scaling-mscale ≠ --rope-scaling-mscale-all-dim) is not built");
    }
    let coeff = match a.parse_value::<f64>("indexer-loss-coeff")? {
        Some(c) if !(c.is_finite() && c >= 0.0) => bail!("--indexer-loss-coeff {c}: must be ≥ 0"),
        c => c.unwrap_or(1.0) as f32,
    };
    Ok(Some(crate::model::IndexerLoss {
        coeff,
        scale: if per_token {
            1.0
        } else {
            1.0 / micro_batches as f32
        },
    }))
}

/// Whether the model's YaRN RoPE scales its rotations by an attention factor other than 1.
fn yarn_scales_rope(model: &ModelConfig) -> bool {
    let Some(r) = &model.rope_scaling else {
        return false;
    };
    let kind = r.get("rope_type").or_else(|| r.get("type"));
    if kind.and_then(|k| k.as_str()) != Some("yarn") {
        return false;
    }
    let number = |k: &str| r.get(k).and_then(|v| v.as_f64()).filter(|&v| v != 0.0);
    match (
        number("attention_factor"),
        number("mscale"),
        number("mscale_all_dim"),
    ) {
        (Some(f), ..) => f != 1.0,
        (None, Some(m), Some(all)) => m != all,
        _ => number("factor").is_some_and(|f| f > 1.0),
    }
}

/// LoRA's config, refused with multi-token prediction.
fn lora_built(lora: Option<LoraConfig>, model: &ModelConfig) -> Result<Option<LoraConfig>> {
    if lora.is_some() && model.mtp.is_some() {
        // peft would wrap the depths' decoder layers too; their merge is not built
        bail!("LoRA with multi-token prediction (--mtp-num-layers) is not built; fine-tune fully, or without the depths");
    }
    Ok(lora)
}
