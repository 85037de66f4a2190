//! Turning Megatron / MindSpeed-LLM flags into one resolved training configuration, checked
//! before any work: architecture (from the flags, or from `--load` with the flags checked
//! against it), tokenizer ids, data, batches, schedule, optimizer, checkpoints, logging.
//! Defaults are Megatron-LM core 0.15's (megatron/training/arguments.py).

use super::args::Args;
use super::data::LossAveraging;
use super::data::SftRows;
use super::optim::AdamConfig;
use super::parallel::{Axis, Layout};
use super::schedule::{DecayStyle, Schedule, WdStyle};
use crate::arch::ModelConfig;
use crate::ckpt::convert::{detect, open_checkpoint, Format, Input};
use crate::ckpt::layout::KeyLayout;
use crate::ckpt::torch::pickle::Value;
use crate::data::gpt_dataset::{Blend, MaskConfig};
use crate::data::handlers::template::Template;
use crate::data::sft_dataset::Order;
use crate::data::tokenizer::HfTokenizer;
use crate::model::params::LoraSpec;
use crate::tensor::DType;
use anyhow::{anyhow, bail, Context, Result};
use std::path::{Path, PathBuf};

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
    pub tokenizer: HfTokenizer,
    /// `--data-path`.
    pub blend: Blend,
    /// `--split`.
    pub split: String,
    /// `--seed`.
    pub seed: u32,
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
    /// Where the ranks sit (TP, DP, PP).
    pub layout: Layout,
    /// Layers of each pipeline stage (one entry without pipeline parallelism).
    pub stages: Vec<usize>,
    /// The virtual pipeline: model chunks per stage and the micro-batches each chunk runs in
    /// a row (`None`: one chunk per stage, the 1F1B schedule).
    pub virtual_pipeline: Option<VirtualPipeline>,
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
    /// `--init-method-std` and `--embedding-init-method-std`.
    pub init_std: (f64, Option<f64>),
    /// Checkpoints.
    pub save: Option<SaveConfig>,
    /// `--eval-interval`, `--eval-iters`.
    pub eval: Option<(u64, u64)>,
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

/// A non-negative finite float flag.
fn non_negative(a: &Args, flag: &str) -> Result<Option<f64>> {
    match a.parse_value::<f64>(flag)? {
        Some(v) if !(v.is_finite() && v >= 0.0) => {
            Err(flag_error(flag, format!("{v} is not a finite number ≥ 0")))
        }
        v => Ok(v),
    }
}

/// The tokenizer and its ids, as the named `--tokenizer-type` derives them.
fn tokenizer(a: &Args, load: Option<&PathBuf>) -> Result<(HfTokenizer, MaskConfig)> {
    let path = a
        .get("tokenizer-name-or-path")
        .or_else(|| a.get("tokenizer-model"))
        .map(PathBuf::from)
        .or_else(|| load.cloned())
        .ok_or_else(|| anyhow!("--tokenizer-name-or-path (or --tokenizer-model) is required"))?;
    let mut tok = HfTokenizer::load(&path)
        .with_context(|| format!("--tokenizer-name-or-path {}", path.display()))?;
    if let Some(name) = a.get("prompt-type") {
        // MindSpeed-LLM's fix_model_tokenizer: the template's stop word becomes eos (the EOD).
        let template = Template::load(name, a.get("prompt-type-path").map(Path::new))
            .map_err(|e| anyhow!("--prompt-type {name}: {e}"))?;
        template
            .fix_tokenizer(&mut tok)
            .map_err(|e| anyhow!("--prompt-type {name}: {e}"))?;
    }
    let eod = tok.eos().ok_or_else(|| {
        anyhow!(
            "the tokenizer {} defines no eos token, Megatron's EOD",
            path.display()
        )
    })?;
    let kind = a.get("tokenizer-type").unwrap_or("HuggingFaceTokenizer");
    // MindSpeed-LLM's PretrainedFromHF falls back to eos for a missing pad (its training
    // tokenizer.py); Megatron's HuggingFaceTokenizer reports none, which GPTDataset treats as -1.
    let pad = match kind {
        "PretrainedFromHF" => Some(tok.pad().unwrap_or(eod)),
        "HuggingFaceTokenizer" | "Llama2Tokenizer" => tok.pad(),
        other => bail!(
            "--tokenizer-type {other} is not supported (HuggingFaceTokenizer, PretrainedFromHF, \
             Llama2Tokenizer)"
        ),
    };
    let masks = MaskConfig {
        eod,
        pad,
        eod_mask_loss: a.has("eod-mask-loss"),
        reset_attention_mask: a.has("reset-attention-mask"),
    };
    Ok((tok, masks))
}

/// Megatron `args` synthesised from the architecture flags, for the one args reader.
fn architecture_args(a: &Args) -> Result<Vec<(String, Value)>> {
    let mut out = Vec::new();
    for (flag, key) in [
        ("num-layers", "num_layers"),
        ("hidden-size", "hidden_size"),
        ("ffn-hidden-size", "ffn_hidden_size"),
        ("num-attention-heads", "num_attention_heads"),
        ("num-query-groups", "num_query_groups"),
        ("kv-channels", "kv_channels"),
        ("max-position-embeddings", "max_position_embeddings"),
    ] {
        if let Some(v) = positive(a, flag)? {
            out.push((key.to_string(), Value::Int(v as i64)));
        }
    }
    for (flag, key) in [
        ("rotary-base", "rotary_base"),
        ("norm-epsilon", "norm_epsilon"),
        ("rope-scaling-factor", "rope_scaling_factor"),
        ("low-freq-factor", "low_freq_factor"),
        ("high-freq-factor", "high_freq_factor"),
        (
            "original-max-position-embeddings",
            "original_max_position_embeddings",
        ),
    ] {
        if let Some(v) = a.parse_value::<f64>(flag)? {
            out.push((key.to_string(), Value::Float(v)));
        }
    }
    for (flag, key) in [
        ("group-query-attention", "group_query_attention"),
        ("add-qkv-bias", "add_qkv_bias"),
        (
            "untie-embeddings-and-output-weights",
            "untie_embeddings_and_output_weights",
        ),
        ("use-rope-scaling", "use_rope_scaling"),
    ] {
        out.push((key.to_string(), Value::Bool(a.has(flag))));
    }
    if let Some(t) = a.get("rope-scaling-type") {
        out.push(("rope_scaling_type".into(), Value::Str(t.to_string())));
    }
    Ok(out)
}

/// Refuse architecture flags outside the LLaMA family.
fn check_family_flags(a: &Args) -> Result<()> {
    if let Some(n) = a.get("normalization").filter(|n| *n != "RMSNorm") {
        bail!("--normalization {n}: only RMSNorm (the LLaMA family) is implemented");
    }
    if let Some(p) = a.get("position-embedding-type").filter(|p| *p != "rope") {
        bail!("--position-embedding-type {p}: only rope is implemented");
    }
    if let Some(p) = a
        .parse_value::<f64>("rotary-percent")?
        .filter(|p| *p != 1.0)
    {
        bail!("--rotary-percent {p}: only 1.0 (the whole head rotated) is implemented");
    }
    for flag in ["attention-dropout", "hidden-dropout"] {
        match a.parse_value::<f64>(flag)? {
            Some(0.0) => {}
            Some(p) => bail!("--{flag} {p}: dropout is not implemented; pass --{flag} 0.0"),
            None => bail!(
                "--{flag} is not given, and Megatron's default is 0.1: dropout is not implemented \
                 here, so pass --{flag} 0.0 (as LLaMA recipes do)"
            ),
        }
    }
    Ok(())
}

/// The architecture: from the flags, or from `--load` with every given flag checked.
fn model_config(a: &Args, input: Option<&Input>, tokenizer_vocab: usize) -> Result<ModelConfig> {
    check_family_flags(a)?;
    let flags = architecture_args(a)?;
    let Some(input) = input else {
        if !a.has("swiglu") {
            bail!("--swiglu is required: the LLaMA family's MLP is SwiGLU");
        }
        if !a.has("disable-bias-linear") {
            bail!(
                "--disable-bias-linear is required: Megatron adds biases to every linear layer \
                 by default, which no LLaMA-family model has (--add-qkv-bias adds Qwen2's)"
            );
        }
        let mut args = flags;
        if !args.iter().any(|(k, _)| k == "ffn_hidden_size") {
            // Megatron's SwiGLU default (validate_args).
            let h = positive(a, "hidden-size")?
                .ok_or_else(|| anyhow!("--hidden-size is required without --load"))?;
            let ffn = ((4 * h * 2) as f64 / 3.0 / 64.0) as usize * 64;
            args.push(("ffn_hidden_size".into(), Value::Int(ffn as i64)));
        }
        args.push(("vocab_size".into(), Value::Int(tokenizer_vocab as i64)));
        return ModelConfig::from_megatron_args(&args, None, DType::F32, tokenizer_vocab)
            .context("the architecture flags (without --load every one of --num-layers --hidden-size --num-attention-heads is needed)");
    };
    let cfg = input.cfg.clone();
    let checks: [(&str, usize); 6] = [
        ("num-layers", cfg.layers),
        ("hidden-size", cfg.hidden),
        ("ffn-hidden-size", cfg.ffn),
        ("num-attention-heads", cfg.heads),
        ("kv-channels", cfg.head_dim),
        ("max-position-embeddings", cfg.max_positions),
    ];
    for (flag, have) in checks {
        if let Some(v) = positive(a, flag)? {
            if v != have && flag != "max-position-embeddings" {
                bail!("--{flag} {v} does not match the --load checkpoint's {have}");
            }
        }
    }
    if a.has("group-query-attention") {
        if let Some(g) = positive(a, "num-query-groups")?.filter(|&g| g != cfg.groups) {
            bail!(
                "--num-query-groups {g} does not match the --load checkpoint's {}",
                cfg.groups
            );
        }
    }
    if a.has("untie-embeddings-and-output-weights") == cfg.tied && has_any_architecture(a) {
        bail!(
            "--untie-embeddings-and-output-weights is {}given, but the --load checkpoint's output layer is {}",
            if cfg.tied { "" } else { "not " },
            if cfg.tied { "tied to the embedding" } else { "separate" }
        );
    }
    if a.has("add-qkv-bias") && !cfg.qkv_bias {
        bail!("--add-qkv-bias is given, but the --load checkpoint has no q/k/v biases");
    }
    Ok(cfg)
}

/// Whether the command line describes the architecture at all (then it must agree with
/// `--load`; a bare `--load` takes everything from the checkpoint).
fn has_any_architecture(a: &Args) -> bool {
    ["num-layers", "hidden-size", "num-attention-heads"]
        .iter()
        .any(|f| a.has(f))
}

fn decay_style(a: &Args) -> Result<DecayStyle> {
    let style = a.get("lr-decay-style").unwrap_or("linear");
    let wsd = a.get("lr-wsd-decay-style").unwrap_or("exponential");
    DecayStyle::parse(style, wsd).ok_or_else(|| {
        anyhow!(
            "--lr-decay-style {style} / --lr-wsd-decay-style {wsd}: expected constant, linear, \
             cosine, inverse-square-root or WSD (exponential, linear, cosine, minus_sqrt)"
        )
    })
}

/// Megatron's `get_optimizer_param_scheduler`: lengths in samples.
fn schedule(a: &Args, iters: u64, samples: Option<u64>, g: u64) -> Result<Schedule> {
    let lr = non_negative(a, "lr")?.ok_or_else(|| anyhow!("--lr is required"))?;
    let min_lr = non_negative(a, "min-lr")?.unwrap_or(0.0);
    let (decay_steps, wd_steps, wsd, warmup_fixed) = match samples {
        None => {
            let decay_iters = a.parse_value::<u64>("lr-decay-iters")?.unwrap_or(iters);
            let wsd = a.parse_value::<u64>("lr-wsd-decay-iters")?.map(|n| n * g);
            let warmup = a.parse_value::<u64>("lr-warmup-iters")?.unwrap_or(0) * g;
            (decay_iters * g, iters * g, wsd, warmup)
        }
        Some(s) => (
            a.parse_value::<u64>("lr-decay-samples")?.unwrap_or(s),
            s,
            a.parse_value::<u64>("lr-wsd-decay-samples")?,
            a.parse_value::<u64>("lr-warmup-samples")?.unwrap_or(0),
        ),
    };
    let warmup = match a.parse_value::<f64>("lr-warmup-fraction")? {
        Some(f) if a.has("lr-warmup-iters") || a.has("lr-warmup-samples") => {
            bail!("--lr-warmup-fraction {f} and --lr-warmup-iters/--lr-warmup-samples exclude each other")
        }
        Some(f) => f * decay_steps as f64,
        None => warmup_fixed as f64,
    };
    let wd_style = match a.get("weight-decay-incr-style").unwrap_or("constant") {
        "constant" => WdStyle::Constant,
        "linear" => WdStyle::Linear,
        "cosine" => WdStyle::Cosine,
        other => bail!("--weight-decay-incr-style {other}: expected constant, linear, cosine"),
    };
    let (start_wd, end_wd) = if wd_style == WdStyle::Constant {
        if a.has("start-weight-decay") || a.has("end-weight-decay") {
            bail!("--start/--end-weight-decay need --weight-decay-incr-style linear or cosine");
        }
        let wd = non_negative(a, "weight-decay")?.unwrap_or(0.01);
        (wd, wd)
    } else {
        let get = |f| {
            non_negative(a, f)?.ok_or_else(|| flag_error(f, "is required with an increment style"))
        };
        (get("start-weight-decay")?, get("end-weight-decay")?)
    };
    let s = Schedule {
        init_lr: non_negative(a, "lr-warmup-init")?.unwrap_or(0.0),
        max_lr: lr,
        min_lr,
        warmup_steps: warmup,
        decay_steps,
        decay_style: decay_style(a)?,
        wsd_decay_steps: wsd,
        start_wd,
        end_wd,
        wd_incr_steps: wd_steps,
        wd_style,
    };
    s.validate()?;
    Ok(s)
}

/// Refuse what is not built yet (context and expert parallelism, other data loaders, optimizers and checkpoint formats).
fn check_single_rank(a: &Args) -> Result<()> {
    for flag in ["context-parallel-size", "expert-model-parallel-size"] {
        if let Some(n) = positive(a, flag)?.filter(|&n| n > 1) {
            bail!("--{flag} {n}: this build trains with tensor, pipeline and data parallelism only (use 1)");
        }
    }
    if let Some(t) = a.get("dataloader-type").filter(|t| *t != "single") {
        bail!("--dataloader-type {t}: only single (Megatron's default sequential sampler) is implemented");
    }
    if let Some(o) = a.get("optimizer").filter(|o| *o != "adam") {
        bail!("--optimizer {o}: only adam (AdamW) is implemented");
    }
    if let Some(f) = a.get("ckpt-format").filter(|f| *f != "torch") {
        bail!("--ckpt-format {f}: only torch (one model_optim_rng.pt per rank) is written; pass --ckpt-format torch");
    }
    if let Some(stage) = a.get("stage").filter(|s| *s != "sft") {
        bail!("--stage {stage}: only sft (supervised fine-tuning) is implemented");
    }

    Ok(())
}

/// The layers of each of `pp` pipeline stages: `--num-layers` split evenly, or the first and/or
/// last stage's given counts and the rest evenly (Megatron's `--decoder-first/last-pipeline-
/// num-layers`, megatron-core megatron/core/transformer/transformer_layer.py
/// `get_transformer_layer_offset`), as `mindkit convert` lays a checkpoint out.
fn pipeline_stages(a: &Args, model: &ModelConfig, (pp, vpp): (usize, usize)) -> Result<Vec<usize>> {
    let first = a.parse_value::<usize>("decoder-first-pipeline-num-layers")?;
    let last = a.parse_value::<usize>("decoder-last-pipeline-num-layers")?;
    if pp == 1 {
        if first.is_some() || last.is_some() {
            bail!("--decoder-first/last-pipeline-num-layers need --pipeline-model-parallel-size of at least 2");
        }
        return Ok(vec![model.layers]);
    }
    let l = model.layers;
    if first.is_none() && last.is_none() && !l.is_multiple_of(pp) {
        bail!("--pipeline-model-parallel-size {pp} does not divide --num-layers {l}: give --decoder-first/last-pipeline-num-layers for uneven stages");
    }
    if first.is_none() && last.is_none() && !l.is_multiple_of(pp * vpp) {
        bail!("--num-layers {l} does not split into {pp} pipeline stages × {vpp} model chunks");
    }
    let parallel = crate::ckpt::layout::Parallel::new(model, 1, pp, vpp, (first, last))
        .context("--decoder-first/last-pipeline-num-layers")?;
    if let Some(p) = parallel.stage_layers.iter().position(|&n| n == 0) {
        bail!(
            "--pipeline-model-parallel-size {pp}: stage {p} would hold no layers ({:?})",
            parallel.stage_layers
        );
    }
    Ok(parallel.stage_layers)
}

/// A virtual pipeline (Megatron's interleaved schedule).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VirtualPipeline {
    /// Model chunks per pipeline stage (V ≥ 2).
    pub chunks: usize,
    /// Micro-batches a chunk runs in a row (`--microbatch-group-size-per-virtual-pipeline-
    /// stage`, default PP).
    pub group: usize,
}

/// Model chunks per pipeline stage: `--num-virtual-stages-per-pipeline-rank`, or the stage's
/// layers over `--num-layers-per-virtual-pipeline-stage` (Megatron's `validate_args`: one of
/// the two, the latter only with even stages; 1 without either).
fn virtual_stages(a: &Args, model: &ModelConfig, pp: usize) -> Result<usize> {
    let per_chunk = positive(a, "num-layers-per-virtual-pipeline-stage")?;
    let chunks = positive(a, "num-virtual-stages-per-pipeline-rank")?;
    let v = match (per_chunk, chunks) {
        (Some(_), Some(_)) => bail!("--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank exclude each other"),
        (None, None) => return Ok(1),
        (None, Some(v)) => v,
        (Some(n), None) => {
            let uneven = ["decoder-first-pipeline-num-layers", "decoder-last-pipeline-num-layers"];
            if uneven.iter().any(|f| a.has(f)) {
                bail!("--num-layers-per-virtual-pipeline-stage: with uneven stages give --num-virtual-stages-per-pipeline-rank instead (as Megatron asks)");
            }
            let l = model.layers;
            if !l.is_multiple_of(pp) || !(l / pp).is_multiple_of(n) {
                bail!("--num-layers-per-virtual-pipeline-stage {n}: the {l} layers over {pp} pipeline stages do not split into chunks of {n}");
            }
            l / pp / n
        }
    };
    if v > 1 && pp < 2 {
        bail!("a virtual pipeline ({v} model chunks per stage) needs --pipeline-model-parallel-size of at least 2");
    }
    if v > 1 && pp < 3 && a.has("no-overlap-p2p-communication") {
        bail!("--no-overlap-p2p-communication with a virtual pipeline needs --pipeline-model-parallel-size above 2 (Megatron's check: no two sends and receives between the same two ranks in one batch)");
    }
    Ok(v)
}

/// The interleaved schedule's micro-batch groups, checked as megatron-core's
/// `forward_backward_pipelining_with_interleaving` checks them against the `micro` micro-
/// batches of a data-parallel rank: PP ≤ group ≤ micro, and the last group empty or of at
/// least PP.
fn virtual_pipeline(
    a: &Args,
    (pp, chunks): (usize, usize),
    micro: usize,
) -> Result<VirtualPipeline> {
    let flag = "microbatch-group-size-per-virtual-pipeline-stage";
    let group = positive(a, flag)?.unwrap_or(pp);
    if group < pp || group > micro {
        bail!("--{flag} {group}: the micro-batches a model chunk runs in a row must be from --pipeline-model-parallel-size {pp} to the {micro} micro-batches of a data-parallel rank per iteration (--global-batch-size / (--micro-batch-size × data-parallel ranks))");
    }
    let rest = micro % group;
    if rest > 0 && rest < pp {
        bail!("the interleaved schedule: {micro} micro-batches per data-parallel rank leave a last group of {rest} (of --{flag} {group}), fewer than --pipeline-model-parallel-size {pp}; Megatron refuses it (it stalls the pipeline)");
    }
    Ok(VirtualPipeline { chunks, group })
}

/// What tensor parallelism over `tp` ranks needs: heads, query groups, FFN and the padded
/// vocabulary split evenly (Megatron's `validate_args` and layer constructors), and the parts
/// not built for it yet refused by name.
fn check_tensor_parallel(
    a: &Args,
    model: &ModelConfig,
    vocab_padded: usize,
    tp: usize,
) -> Result<()> {
    if tp == 1 {
        return Ok(());
    }
    let flag = "--tensor-model-parallel-size";
    for (what, n) in [
        ("--num-attention-heads", model.heads),
        ("--num-query-groups", model.groups),
        ("--ffn-hidden-size", model.ffn),
        ("the padded vocabulary (--padded-vocab-size)", vocab_padded),
    ] {
        if !n.is_multiple_of(tp) {
            bail!("{flag} {tp}: {what} {n} is not a multiple of it");
        }
    }
    let seq = positive(a, "seq-length")?.unwrap_or(0);
    if a.has("sequence-parallel") && !seq.is_multiple_of(tp) {
        bail!("--sequence-parallel: --seq-length {seq} is not a multiple of {flag} {tp}");
    }
    if a.has("lora-target-modules") && a.has("sequence-parallel") {
        bail!("--sequence-parallel: LoRA with sequence parallelism is not built yet (peft's column-parallel adapters leave lora_A's gradient on each rank's rows)");
    }
    Ok(())
}

/// How the distributed optimizer buckets its buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Buckets {
    /// Elements per bucket (`None`: one bucket).
    pub size: Option<BucketSize>,
    /// `--ddp-pad-buckets-for-high-nccl-busbw`: buckets padded to lcm(DP, 128, 65536).
    pub pad_high: bool,
}

/// A bucket size, given or derived from the rank's parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BucketSize {
    /// This many elements.
    Elements(usize),
    /// The rank's parameters (all of them, frozen too) over this many buckets.
    Split(usize),
}

impl BucketSize {
    /// Elements per bucket for a rank of `parameters` elements.
    pub fn elements(self, parameters: usize) -> usize {
        match self {
            BucketSize::Elements(n) => n,
            BucketSize::Split(n) => parameters / n,
        }
    }
}

/// Megatron's bucketing of the distributed optimizer's buffer (megatron/training/training.py
/// `get_model`): buckets only with `--overlap-grad-reduce`, of `--ddp-bucket-size` elements,
/// or the rank's parameters over `--ddp-num-buckets`, or max(40M, 1M × DP).
fn buckets(a: &Args, data_parallel: usize) -> Result<Buckets> {
    let (size, count) = (
        positive(a, "ddp-bucket-size")?,
        positive(a, "ddp-num-buckets")?,
    );
    let size = match (size, count) {
        (Some(_), Some(_)) => bail!("--ddp-bucket-size and --ddp-num-buckets exclude each other"),
        _ if !a.has("overlap-grad-reduce") => None,
        (Some(n), None) => Some(BucketSize::Elements(n)),
        (None, Some(n)) => Some(BucketSize::Split(n)),
        (None, None) => Some(BucketSize::Elements(
            (1_000_000 * data_parallel).max(40_000_000),
        )),
    };
    Ok(Buckets {
        size,
        pad_high: a.has("ddp-pad-buckets-for-high-nccl-busbw"),
    })
}

/// The ranks of this run: the launcher's (torchrun's WORLD_SIZE, Slurm's SLURM_NTASKS) for a
/// process it started, else `--world-size` (ranks as threads of this process; TP × PP × CP by
/// default).
/// A `--world-size` that differs from the launcher's is an error.
pub fn world_size(a: &Args) -> Result<usize> {
    let flag = positive(a, "world-size")?;
    let Some(launch) = super::store::from_launcher()? else {
        // One data-parallel rank by default: TP × PP × CP ranks.
        let mut model = 1;
        for size in [
            "tensor-model-parallel-size",
            "pipeline-model-parallel-size",
            "context-parallel-size",
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
    let load = a.get("load").map(PathBuf::from);
    let input = match &load {
        Some(dir) if dir.exists() => Some(open_checkpoint(
            dir,
            None,
            a.get("model-type-hf").map(family_name),
        )?),
        Some(dir) if a.has("exit-on-missing-checkpoint") => {
            bail!("--load {}: no checkpoint there", dir.display())
        }
        Some(dir) => {
            eprintln!(
                "mindkit: warning: --load {} does not exist; starting from random weights",
                dir.display()
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
    let mut model = model_config(a, input.as_ref(), tokenizer.vocab_size())?;
    let divisible_by = positive(a, "make-vocab-size-divisible-by")?.unwrap_or(128);
    let tp = positive(a, "tensor-model-parallel-size")?.unwrap_or(1);
    // Megatron pads to a multiple of the divisor × TP (training.py `_vocab_size_with_padding`).
    let vocab_padded = match positive(a, "padded-vocab-size")? {
        Some(v) => v,
        None => tokenizer.vocab_size().div_ceil(divisible_by * tp) * divisible_by * tp,
    };
    if tokenizer.vocab_size() > vocab_padded || model.vocab > vocab_padded {
        bail!(
            "the padded vocabulary ({vocab_padded}) is smaller than the tokenizer's {} / the \
             model's {} tokens: raise --padded-vocab-size",
            tokenizer.vocab_size(),
            model.vocab
        );
    }
    let bf16 = a.has("bf16");
    model.dtype = if bf16 { DType::BF16 } else { DType::F32 };
    let seq_length =
        positive(a, "seq-length")?.ok_or_else(|| anyhow!("--seq-length is required"))?;
    if seq_length > model.max_positions {
        bail!(
            "--seq-length {seq_length} is above the model's {} positions (max_position_embeddings)",
            model.max_positions
        );
    }
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
    let layout = Layout::new(world_size(a)?, tp, pp, cp)?;
    let data_parallel = layout.size(Axis::Dp);
    check_tensor_parallel(a, &model, vocab_padded, tp)?;
    let chunks = virtual_stages(a, &model, pp)?;
    let stages = pipeline_stages(a, &model, (pp, chunks))?;
    if !global_batch.is_multiple_of(micro_batch * data_parallel) {
        bail!(
            "--global-batch-size {global_batch} is not a multiple of --micro-batch-size {micro_batch} × {data_parallel} data-parallel ranks (--world-size)"
        );
    }
    let virtual_pipeline = match chunks {
        1 => None,
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
    let blend = Blend::parse(
        a.list("data-path")
            .ok_or_else(|| anyhow!("--data-path is required"))?,
    )?;
    let sft = sft_config(a, &blend, &tokenizer, &masks, seq_length, global_batch)?;
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
    let save = match a.get("save") {
        None => None,
        Some(dir) => Some(SaveConfig {
            dir: PathBuf::from(dir),
            interval: positive(a, "save-interval")?.map(|n| n as u64),
            no_optim: a.has("no-save-optim"),
            layout: match a.get("transformer-impl").unwrap_or("local") {
                "local" => KeyLayout::Mcore,
                "transformer_engine" => KeyLayout::McoreTe,
                other => bail!("--transformer-impl {other}: expected local or transformer_engine"),
            },
        }),
    };
    let eval_iters = a.parse_value::<u64>("eval-iters")?.unwrap_or(100);
    let eval_interval = positive(a, "eval-interval")?.unwrap_or(1000) as u64;
    let clip_grad = non_negative(a, "clip-grad")?.unwrap_or(1.0);
    let betas = (
        non_negative(a, "adam-beta1")?.unwrap_or(0.9),
        non_negative(a, "adam-beta2")?.unwrap_or(0.999),
    );
    if betas.0 >= 1.0 || betas.1 >= 1.0 {
        bail!("--adam-beta1/--adam-beta2 must be below 1, got {betas:?}");
    }
    let eps = a.parse_value::<f64>("adam-eps")?.unwrap_or(1e-8);
    if !(eps > 0.0 && eps.is_finite()) {
        bail!("--adam-eps must be a positive number, got {eps}");
    }
    let adam = AdamConfig {
        betas,
        eps,
        clip_grad,
    };
    let recorded = recorded_args(a, &schedule, &adam, bf16)?;
    Ok(TrainConfig {
        model,
        vocab_padded,
        divisible_by,
        start,
        tokenizer,
        blend,
        split: a.get("split").unwrap_or("969, 30, 1").to_string(),
        seed: a.parse_value::<u32>("seed")?.unwrap_or(1234),
        surplus: non_negative(a, "mid-level-dataset-surplus")?
            .unwrap_or(crate::data::gpt_dataset::MID_LEVEL_SURPLUS),
        masks,
        seq_length,
        micro_batch,
        global_batch,
        data_parallel,
        layout,
        stages,
        virtual_pipeline,
        sequence_parallel: tp > 1 && a.has("sequence-parallel"),
        distributed_optimizer: match a.has("use-distributed-optimizer") {
            false => None,
            true => Some(buckets(a, data_parallel)?),
        },
        train_iters,
        train_samples: train_samples.unwrap_or(train_iters * g),
        schedule,
        schedule_source,
        adam,
        averaging: if a.has("calculate-per-token-loss") {
            LossAveraging::PerToken
        } else {
            LossAveraging::PerMicroBatch
        },
        bf16,
        init_std: (
            non_negative(a, "init-method-std")?.unwrap_or(0.02),
            non_negative(a, "embedding-init-method-std")?,
        ),
        save,
        eval: (eval_iters > 0).then_some((eval_interval, eval_iters)),
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
        lora: lora_config(a)?,
    })
}

/// The training flags Megatron's `args` carries into a checkpoint, with its defaults and the
/// values `validate_args` fills in (start/end weight decay), and the tokenizer flags.
fn recorded_args(
    a: &Args,
    s: &Schedule,
    adam: &AdamConfig,
    bf16: bool,
) -> Result<Vec<(&'static str, serde_json::Value)>> {
    use serde_json::json;
    let int = |f| -> Result<Option<u64>> { Ok(a.parse_value::<u64>(f)?) };
    // Megatron's checkpoint tools need the tokenizer's type; its files are what was given
    // (else the copy beside the checkpoints is the tokenizer).
    Ok(vec![
        (
            "tokenizer_type",
            json!(a.get("tokenizer-type").unwrap_or("HuggingFaceTokenizer")),
        ),
        ("tokenizer_model", json!(a.get("tokenizer-model"))),
        (
            "tokenizer_name_or_path",
            json!(a.get("tokenizer-name-or-path")),
        ),
        (
            "lr_warmup_iters",
            json!(int("lr-warmup-iters")?.unwrap_or(0)),
        ),
        (
            "lr_warmup_samples",
            json!(int("lr-warmup-samples")?.unwrap_or(0)),
        ),
        (
            "lr_warmup_fraction",
            json!(a.parse_value::<f64>("lr-warmup-fraction")?),
        ),
        ("lr_warmup_init", json!(s.init_lr)),
        ("lr_decay_iters", json!(int("lr-decay-iters")?)),
        ("lr_decay_samples", json!(int("lr-decay-samples")?)),
        ("train_samples", json!(int("train-samples")?)),
        (
            "weight_decay",
            json!(non_negative(a, "weight-decay")?.unwrap_or(0.01)),
        ),
        ("start_weight_decay", json!(s.start_wd)),
        ("end_weight_decay", json!(s.end_wd)),
        ("weight_decay_incr_style", json!(s.wd_style.name())),
        ("adam_beta1", json!(adam.betas.0)),
        ("adam_beta2", json!(adam.betas.1)),
        ("adam_eps", json!(adam.eps)),
        ("clip_grad", json!(adam.clip_grad)),
        ("optimizer", json!("adam")),
        ("bf16", json!(bf16)),
        ("fp16", json!(false)),
        // what shaped distrib_optim.pt's buffers, and the interleaved schedule's groups
        (
            "use_distributed_optimizer",
            json!(a.has("use-distributed-optimizer")),
        ),
        ("overlap_grad_reduce", json!(a.has("overlap-grad-reduce"))),
        ("ddp_bucket_size", json!(int("ddp-bucket-size")?)),
        ("ddp_num_buckets", json!(int("ddp-num-buckets")?)),
        (
            "ddp_pad_buckets_for_high_nccl_busbw",
            json!(a.has("ddp-pad-buckets-for-high-nccl-busbw")),
        ),
        (
            "microbatch_group_size_per_vp_stage",
            json!(int("microbatch-group-size-per-virtual-pipeline-stage")?),
        ),
    ])
}

/// LoRA from MindSpeed-LLM's flags (its defaults: r 16, alpha 32).
fn lora_config(a: &Args) -> Result<Option<LoraConfig>> {
    let Some(modules) = a.list("lora-target-modules") else {
        for flag in ["lora-r", "lora-alpha", "lora-ckpt-filter", "lora-load"] {
            if a.has(flag) {
                bail!("--{flag} needs --lora-target-modules (e.g. linear_qkv linear_proj linear_fc1 linear_fc2)");
            }
        }
        return Ok(None);
    };
    let targets = modules
        .iter()
        .map(|m| {
            LoraSpec::target(m).ok_or_else(|| {
                anyhow!("--lora-target-modules {m}: expected linear_qkv, linear_proj, linear_fc1 or linear_fc2")
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let alpha = a.parse_value::<f64>("lora-alpha")?.unwrap_or(32.0);
    if !(alpha.is_finite() && alpha > 0.0) {
        bail!("--lora-alpha must be a positive number, got {alpha}");
    }
    Ok(Some(LoraConfig {
        spec: LoraSpec {
            r: positive(a, "lora-r")?.unwrap_or(16),
            alpha,
            targets,
        },
        ckpt_filter: a.has("lora-ckpt-filter"),
        load: a.get("lora-load").map(PathBuf::from),
    }))
}

/// MindSpeed-LLM's `--model-type-hf` names (llama2, qwen25, …) as mindkit's family names.
fn family_name(model_type: &str) -> &str {
    match model_type {
        t if t.starts_with("llama") => "llama",
        t if t.starts_with("qwen") => "qwen2",
        t if t.starts_with("mistral") => "mistral",
        t if t.starts_with("internlm") => "internlm",
        t if t.starts_with("baichuan") => "baichuan",
        t if t.starts_with("aquila") => "aquila",
        other => other,
    }
}

/// The fine-tuning data settings (`--is-instruction-dataset`), MindSpeed-LLM's defaults.
fn sft_config(
    a: &Args,
    blend: &Blend,
    tokenizer: &HfTokenizer,
    masks: &MaskConfig,
    seq_length: usize,
    global_batch: usize,
) -> Result<Option<SftConfig>> {
    if !a.has("is-instruction-dataset") {
        for flag in [
            "padded-samples",
            "no-pad-to-seq-lengths",
            "no-shuffle",
            "neat-pack",
        ] {
            if a.has(flag) {
                bail!("--{flag} applies to fine-tuning data: add --is-instruction-dataset");
            }
        }
        return Ok(None);
    }
    if blend.prefixes.len() > 1 || blend.weights.is_some() {
        bail!(
            "--data-path: fine-tuning reads one dataset prefix (MindSpeed-LLM uses only the \
             first); merge them with `mindkit preprocess merge`"
        );
    }
    if a.has("neat-pack") && !a.has("reset-attention-mask") {
        bail!("--neat-pack needs --reset-attention-mask (as MindSpeed-LLM requires)");
    }
    let multiple_of = if a.has("no-pad-to-seq-lengths") {
        positive(a, "pad-to-multiple-of")?.unwrap_or(8)
    } else {
        seq_length
    };
    Ok(Some(SftConfig {
        prefix: blend.prefixes[0].clone(),
        rows: SftRows {
            seq_length,
            pad: tokenizer.pad().unwrap_or(masks.eod),
            multiple_of,
            reset: a
                .has("reset-attention-mask")
                .then_some((masks.eod, a.has("neat-pack"))),
        },
        order: Order {
            seed: a.parse_value::<u32>("seed")?.unwrap_or(1234),
            shuffle: !a.has("no-shuffle"),
            padded_to: a.has("padded-samples").then_some(global_batch),
        },
    }))
}
