//! The `mindkit` command line: parse arguments, call the library, print.

use std::path::PathBuf;

// Conversions allocate and free tensor-sized buffers continuously; mimalloc reuses them instead
// of returning each to the kernel and faulting fresh zeroed pages in for the next one.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use mindkit::arch::family;
use mindkit::ckpt::convert::{self, ConvertOptions, Format};
use mindkit::ckpt::info;
use mindkit::ckpt::layout::KeyLayout;
use mindkit::ckpt::lora;
use mindkit::data::{gpt_dataset, indexed, inspect, preprocess};
use mindkit::device::{self, DeviceArgs};
use mindkit::engine::Backend;
use mindkit::eval;
use mindkit::model::generate;

/// Fast, safe tooling for Megatron-LM / MindSpeed-LLM training.
///
/// Exit codes: 0 success, 1 error (the message names the file, line and field at fault),
/// 2 bad command line.
#[derive(Parser)]
#[command(name = "mindkit", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Raw text or instruction data → Megatron .bin/.idx (byte-compatible with Megatron-LM / MindSpeed-LLM).
    Preprocess(Box<PreprocessArgs>),
    /// Inspect indexed datasets.
    #[command(subcommand)]
    Data(DataCommand),
    /// Hugging Face ⇄ Megatron checkpoints, any TP/PP/VPP, streaming.
    Convert(Box<ConvertArgs>),
    /// LoRA adapters (PEFT or Megatron-sharded): merge into base weights, inspect.
    #[command(subcommand)]
    Lora(LoraCommand),
    /// Inspect checkpoints.
    #[command(subcommand)]
    Ckpt(CkptCommand),
    /// Score a checkpoint on a benchmark (lm-evaluation-harness-comparable numbers).
    Eval(Box<EvalArgs>),
    /// Generate text from a prompt with an HF or Megatron checkpoint (streams to stdout).
    Generate(Box<GenerateArgs>),
    /// Ascend NPUs: what CANN's runtime reports.
    #[command(subcommand)]
    Npu(NpuCommand),
    /// Check every operator of a device's backend against the CPU backend (random inputs,
    /// each dtype, forward and backward): the first command to run on a new machine.
    #[command(
        mut_arg("device", |a| a.default_value("npu").help(
            "The device to check: npu (against the CPU backend), or cpu (its backward \
             operators against finite differences of its forward ones)"
        )),
        mut_arg("npu_id", |a| a.help("Which NPU (as `npu info` numbers them; default 0)"))
    )]
    Selftest {
        #[command(flatten)]
        device: DeviceArgs,
    },
    /// Train (pretraining) as Megatron-LM / MindSpeed-LLM would, with their flags: replace
    /// `torchrun … pretrain_gpt.py` by `mindkit train` (`mindkit train --help` lists every flag).
    #[command(disable_help_flag = true)]
    Train {
        /// Megatron-LM / MindSpeed-LLM flags.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true, num_args = 0..)]
        args: Vec<String>,
    },
}

#[derive(Subcommand)]
enum NpuCommand {
    /// CANN's version and each device's SoC and memory (loads libascendcl.so from
    /// $ASCEND_TOOLKIT_HOME/lib64, $ASCEND_HOME_PATH/lib64 or CANN's default install).
    Info,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum SchedulesMethod {
    /// DualPipeV (MindSpeed's mindspeed/core/pipeline_parallel/dualpipev).
    Dualpipev,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum EvalTask {
    /// BoolQ dev, 0-shot, acc.
    Boolq,
    /// MMLU, 57 subjects, 5-shot (dev rows) by default, micro and macro averages.
    Mmlu,
    /// GSM8K test, 5 shots drawn from the train split as the harness draws them, greedy,
    /// exact match.
    Gsm8k,
    /// GSM8K test, the 8 fixed chain-of-thought exemplars, greedy, exact match.
    Gsm8kCot,
}

#[derive(Args)]
struct EvalArgs {
    /// Checkpoint directory (HF, or Megatron of any TP/PP).
    #[arg(long)]
    model: PathBuf,
    /// The task.
    #[arg(long, value_enum)]
    task: EvalTask,
    /// The task's data: a file or directory of jsonl, json or parquet (BoolQ, GSM8K); for MMLU
    /// the csv tree of the original release (`dev/`, `val/`, `test/` holding
    /// `<subject>_<split>.csv`) or the Hugging Face `cais/mmlu` files (`dev*`, `validation*`,
    /// `test*` parquet/jsonl with a `subject` column).
    #[arg(long)]
    data: PathBuf,
    /// Tokenizer file or directory (default: the model directory).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Few-shot examples (the task's default when omitted).
    #[arg(long)]
    num_fewshot: Option<usize>,
    /// gsm8k: the train split its shots are drawn from (default: train.jsonl beside --data).
    #[arg(long)]
    fewshot_data: Option<PathBuf>,
    /// gsm8k: the few-shot sampler's seed (the harness's --seed; it draws with 1234 by default).
    #[arg(long, default_value_t = mindkit::eval::gsm8k::FEWSHOT_SEED)]
    seed: u64,
    /// Evaluate the first N documents only (for MMLU: the first N of each subject, as the
    /// harness's --limit).
    #[arg(long)]
    limit: Option<usize>,
    /// Documents per forward pass (GSM8K: questions decoded together, a KV cache each).
    #[arg(long, default_value_t = 8)]
    batch_size: usize,
    /// Write the results JSON (lm-evaluation-harness shape) here.
    #[arg(long)]
    output: Option<PathBuf>,
    /// Write one JSON line per document (prompt, choices, logprobs, prediction) here.
    #[arg(long)]
    log_samples: Option<PathBuf>,
    /// Keep each document's result in this file as it is computed; a rerun (after an
    /// interruption, or with other reporting options) computes only what is missing.
    #[arg(long)]
    cache: Option<PathBuf>,
    #[command(flatten)]
    device: DeviceArgs,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
}

#[derive(Args)]
struct GenerateArgs {
    /// Checkpoint directory (HF, or Megatron of any TP/PP).
    #[arg(long)]
    model: PathBuf,
    /// Tokenizer file or directory (default: the model directory).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// The prompt.
    #[arg(long)]
    prompt: String,
    /// Wrap the prompt in the tokenizer's chat template (tokenizer_config.json) as a user turn.
    #[arg(long)]
    chat: bool,
    /// System message for --chat.
    #[arg(long, requires = "chat")]
    system: Option<String>,
    /// For --chat: `enable_thinking` passed to the chat template (Qwen3: false starts the reply
    /// with an empty <think></think> block); left to the template's default when omitted.
    #[arg(long, requires = "chat", value_name = "true|false")]
    enable_thinking: Option<bool>,
    /// New tokens at most.
    #[arg(long, default_value_t = 256)]
    max_new_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Sample from the K most likely tokens only (0: all).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Sample from the smallest set of tokens holding this probability (1: all).
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Random seed for sampling.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Stop before this string (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    #[command(flatten)]
    device: DeviceArgs,
    /// No summary line on stderr.
    #[arg(long)]
    quiet: bool,
}

#[derive(Args)]
struct ConvertArgs {
    /// Input format (detected when omitted).
    #[arg(long, value_enum)]
    from: Option<Format>,
    /// Output format.
    #[arg(long, value_enum)]
    to: Format,
    /// Input directory (HF model directory, or Megatron checkpoint root / iteration directory).
    #[arg(long)]
    input: PathBuf,
    #[command(flatten)]
    out: OutputArgs,
}

#[derive(Args)]
struct LoraMergeArgs {
    /// Base model: HF directory or Megatron checkpoint (any TP/PP).
    #[arg(long)]
    base: PathBuf,
    /// Adapter: PEFT directory (adapter_config.json) or Megatron LoRA checkpoint (any TP/PP).
    #[arg(long)]
    adapter: PathBuf,
    /// Output format (default: the base's).
    #[arg(long, value_enum)]
    to: Option<Format>,
    /// lora_alpha of a Megatron adapter whose args do not record it.
    #[arg(long)]
    lora_alpha: Option<f64>,
    #[command(flatten)]
    out: OutputArgs,
}

#[derive(Subcommand)]
enum LoraCommand {
    /// Fold a LoRA adapter into the base weights: W += alpha/r · B·A (f32), then write any format/TP/PP.
    Merge(Box<LoraMergeArgs>),
    /// Kind, rank, alpha, targets, adapted modules, parameter count.
    Info {
        /// PEFT adapter directory or Megatron LoRA checkpoint.
        path: PathBuf,
    },
}

/// Where and how a checkpoint is written (shared by convert and lora merge).
#[derive(Args)]
struct OutputArgs {
    /// Output directory (written under a temporary name, renamed when complete).
    #[arg(long)]
    output: PathBuf,
    /// Tensor-parallel size of a Megatron output (default: the input's, or 1).
    #[arg(long)]
    tp: Option<usize>,
    /// Pipeline-parallel size of a Megatron output (default: the input's, or 1).
    #[arg(long)]
    pp: Option<usize>,
    /// Expert-parallel size of a Megatron output: each MoE layer's routed experts split over
    /// this many mp_rank_TT[_PPP]_EEE directories (default: the input's, or 1).
    #[arg(long, alias = "target-expert-parallel-size")]
    ep: Option<usize>,
    /// Expert tensor-parallel size of a Megatron output, a divisor of TP: TP (each routed
    /// expert split as the dense layers are), fewer (split over that many ranks), or 1 (whole
    /// experts); files only for the TP × EP pairs Megatron saves, e.g. mp_rank_00_000 and
    /// mp_rank_01_001 at TP 2 × EP 2 × ETP 1. Default: the input's where it divides TP, else TP.
    #[arg(long, alias = "expert-tensor-parallel-size")]
    etp: Option<usize>,
    /// MindSpeed-LLM's --moe-tp-extend-ep: the routed experts whole, spread over the TP × EP
    /// rank files (file mp_rank_tt_eee holding block e·TP + t). Default: the input's.
    #[arg(long)]
    moe_tp_extend_ep: bool,
    /// Write the routed experts as MindSpeed-LLM's grouped GEMM tensors (mlp.experts.weight1 /
    /// weight2, as its --moe-grouped-gemm trains them) instead of megatron-core's local_experts.N.
    #[arg(long)]
    moe_grouped_gemm: bool,
    /// Virtual pipeline chunks per stage (Megatron's --num-virtual-stages-per-pipeline-rank).
    #[arg(
        long,
        alias = "num-virtual-stages-per-pipeline-rank",
        conflicts_with = "num_layers_per_virtual_stage"
    )]
    vpp: Option<usize>,
    /// Layers per virtual pipeline chunk (Megatron's --num-layers-per-virtual-pipeline-stage).
    #[arg(long, alias = "num-layers-per-virtual-pipeline-stage")]
    num_layers_per_virtual_stage: Option<usize>,
    /// MindSpeed's pipeline schedule of the Megatron output: dualpipev lays each stage's
    /// layers out in two chunks in a V (stage p holds the p-th and the (2·PP − 1 − p)-th of
    /// 2·PP blocks; the first stage also the final norm, output layer and multi-token
    /// prediction), as its converters write them. Default: the source's, unless --tp, --pp
    /// or --vpp is given.
    #[arg(long, value_enum, conflicts_with_all = ["vpp", "num_layers_per_virtual_stage"])]
    schedules_method: Option<SchedulesMethod>,
    /// Layers on the first pipeline stage (uneven split: the other stages share the rest evenly).
    #[arg(long, alias = "decoder-first-pipeline-num-layers")]
    first_stage_layers: Option<usize>,
    /// Layers on the last pipeline stage (uneven split: the other stages share the rest evenly).
    #[arg(long, alias = "decoder-last-pipeline-num-layers")]
    last_stage_layers: Option<usize>,
    /// Megatron key layout: mcore (local spec, as MindSpeed-LLM), mcore-te, legacy.
    #[arg(long, value_enum, default_value = "mcore")]
    layout: KeyLayout,
    /// Megatron checkpoint format: torch (one file per model-parallel rank) or torch_dist
    /// (megatron-core's distributed checkpoint, its default since core 0.15; the args record
    /// the layout given, and megatron-core loads it at any layout).
    #[arg(long, value_enum, default_value = "torch")]
    ckpt_format: convert::CkptFormat,
    /// Multi-latent attention's projections in a Megatron output. Default: the input's,
    /// else megatron-core's.
    #[arg(long, value_enum)]
    mla_layout: Option<mindkit::arch::MlaLayout>,
    /// Multi-token prediction in a Megatron output: mindspeed (MindSpeed-LLM's: final_layernorm
    /// after the depths, mtp.final_layernorms.N) or mcore (megatron-core's:
    /// decoder.final_layernorm, mtp.layers.N.final_layernorm). Default: the input's, else
    /// MindSpeed-LLM's.
    #[arg(long, value_enum)]
    mtp_layout: Option<mindkit::arch::MtpLayout>,
    /// Output dtype: bf16, fp16, fp32 (default: the input's).
    #[arg(long)]
    dtype: Option<String>,
    /// Model family (default: from config.json / args). Supported: llama (llama2, llama3), mistral, qwen2, qwen3, seed_oss (seed-oss), internlm, baichuan, aquila, qwen3_moe, qwen2_moe, mixtral, glm4_moe (glm45), deepseek_v2 (deepseek2-lite), deepseek_v3 (kimi2).
    #[arg(long)]
    family: Option<String>,
    /// Pad the vocabulary to a multiple of this × TP (Megatron's default 128).
    #[arg(long, default_value_t = 128)]
    make_vocab_size_divisible_by: usize,
    /// Largest safetensors shard of an HF output (e.g. 5GB, 500MB).
    #[arg(long, default_value = "5GB")]
    max_shard_size: String,
    /// Replace an existing output directory.
    #[arg(long)]
    force: bool,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
}

#[derive(Subcommand)]
enum CkptCommand {
    /// Format, layout, family, TP/PP/VPP, dtype, parameters, per-rank sizes.
    Info {
        /// HF model directory or Megatron checkpoint.
        path: PathBuf,
        /// List every tensor with dtype and shape.
        #[arg(long)]
        keys: bool,
        /// Model family override.
        #[arg(long)]
        family: Option<String>,
    },
}

#[derive(Args)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
struct PreprocessArgs {
    #[command(subcommand)]
    merge: Option<PreprocessSub>,

    /// Input files, directories or globs (.json, .jsonl, .txt, optionally .gz; .parquet; .arrow).
    /// A directory or glob must hold files of one format, or --input-format chooses one.
    #[arg(long, num_args = 1.., value_name = "PATH", required = true)]
    input: Vec<PathBuf>,
    /// Read only files of this format from the --input directories and globs (the others are
    /// skipped and counted in the summary); needed when they hold files of several formats.
    #[arg(long, value_enum, value_name = "FORMAT")]
    input_format: Option<mindkit::data::source::Format>,
    /// Refuse a record (line, array element, row) larger than this many bytes: a record takes
    /// many times its size in memory while tokenized. A refused line is a bad record.
    #[arg(
        long,
        value_name = "BYTES",
        default_value_t = mindkit::data::source::DEFAULT_MAX_RECORD_BYTES,
        value_parser = clap::value_parser!(u64).range(1..)
    )]
    max_record_bytes: u64,
    /// Output prefix: writes {prefix}_{key}_document.{bin,idx} ({prefix}_packed_… for instruction data).
    #[arg(long, required = true)]
    output_prefix: Option<PathBuf>,
    /// tokenizer.json, or a Hugging Face model directory (tokenizer.json or vocab.json+merges.txt, tokenizer_config.json).
    #[arg(
        long,
        required = true,
        visible_aliases = ["tokenizer-model", "tokenizer-name-or-path"]
    )]
    tokenizer: Option<PathBuf>,
    /// Fields to tokenize in pretrain mode, one output each.
    #[arg(long, num_args = 1.., default_value = "text")]
    json_keys: Vec<String>,
    /// Append the eos token to every document.
    #[arg(long)]
    append_eod: bool,
    /// Do not add the tokenizer's special tokens (BOS) in pretrain mode: Megatron core ≤ 0.15 behaviour.
    #[arg(long, visible_alias = "tokenizer-hf-no-include-special-tokens")]
    no_special_tokens: bool,
    /// Instruction handler: alpaca, belle, moss, sharegpt, or the preference-pair handlers alpaca-pairwise and sharegpt-pairwise (MindSpeed-LLM class names accepted).
    #[arg(long, visible_alias = "handler-name")]
    handler: Option<String>,
    /// Chat template for alpaca/sharegpt: any of MindSpeed-LLM's templates.json (qwen, qwen3, llama2, chatml, glm4_moe, ...).
    #[arg(long)]
    prompt_type: Option<String>,
    /// A MindSpeed-LLM templates.json holding the --prompt-type template.
    #[arg(long)]
    prompt_type_path: Option<PathBuf>,
    /// Reasoning templates (qwen3, glm4_moe, magistral, gpt_oss): true trains on an empty thought added to answers without one; false removes all thoughts; none (default) keeps them.
    #[arg(long, value_name = "true|false|none", default_value = "none")]
    enable_thinking: String,
    /// deepseek4 template, with --enable-thinking true: max puts the maximum-effort instruction before the first message; high changes nothing (MindSpeed-LLM's "reserved").
    #[arg(long, value_name = "max|high")]
    reasoning_effort: Option<String>,
    /// deepseek4 template, with --enable-thinking true: true (default) strips the thoughts of answers before the last user message; false keeps and trains them all.
    #[arg(long, value_name = "true|false", default_value = "true")]
    drop_thinking: String,
    /// JSON object renaming columns/tags, as MindSpeed-LLM's --map-keys.
    #[arg(long)]
    map_keys: Option<String>,
    /// Drop sequences of this many tokens or more (MindSpeed-LLM); also the template's cutoff and the pack size.
    #[arg(long)]
    seq_length: Option<usize>,
    /// Greedily pack instruction samples into --seq-length items (MindSpeed-LLM --pack).
    #[arg(long)]
    pack: bool,
    /// Tokenizer threads (default: all cores).
    #[arg(long)]
    workers: Option<usize>,
    /// Token dtype: auto (Megatron: uint16 below 65500 tokens, else int32; int32 for instruction data), uint16, int32.
    #[arg(long, default_value = "auto")]
    dtype: String,
    /// Skip records that cannot be read or processed; count them by reason in the summary.
    #[arg(long)]
    skip_bad_records: bool,
    /// Overwrite existing outputs.
    #[arg(long)]
    force: bool,
    /// Process only slice I of N of the input records (0 ≤ I < N, contiguous), e.g. 0/4.
    #[arg(long, value_name = "I/N")]
    shard: Option<preprocess::Shard>,
    /// No progress bar and no summary on success (errors and warnings are still printed).
    #[arg(long)]
    quiet: bool,
    /// MagistralTokenizer: the tokenizer is a tekken.json, encoded as MindSpeed-LLM's
    /// MagistralTokenizer does (no bos/eos added). Other Megatron/MindSpeed types are accepted
    /// and read from the files.
    #[arg(long)]
    tokenizer_type: Option<String>,
    /// Accepted for Megatron scripts and ignored.
    #[arg(long, hide = true)]
    log_interval: Option<usize>,
    /// Accepted for Megatron scripts and ignored (mmap is the only format).
    #[arg(long, hide = true)]
    dataset_impl: Option<String>,
}

#[derive(Subcommand)]
enum PreprocessSub {
    /// Concatenate datasets in the given order (Megatron's tools/merge_datasets.py).
    Merge {
        /// Dataset prefixes (without .bin/.idx).
        #[arg(required = true)]
        inputs: Vec<PathBuf>,
        /// Output prefix.
        #[arg(long)]
        output_prefix: PathBuf,
        /// Overwrite existing outputs.
        #[arg(long)]
        force: bool,
        /// No summary on success (errors are still printed).
        #[arg(long)]
        quiet: bool,
    },
}

#[derive(Subcommand)]
enum DataCommand {
    /// Documents, sequences, tokens, dtype and a length histogram.
    Info {
        /// Dataset prefix, or the prefix given to preprocess.
        prefix: PathBuf,
    },
    /// Decoded text of one document; instruction data shows prompt and answer apart.
    Show {
        /// Dataset prefix, or the prefix given to preprocess.
        prefix: PathBuf,
        /// Document index.
        #[arg(long, default_value_t = 0)]
        index: usize,
        /// Tokenizer to decode with.
        #[arg(long)]
        tokenizer: PathBuf,
    },
    /// The training samples Megatron's GPTDataset would draw (same order, same tokens), one
    /// JSON line each: split, index, dataset of the blend, the S+1 tokens.
    Samples(Box<SamplesArgs>),
}

#[derive(Args)]
struct SamplesArgs {
    /// Megatron's --data-path: PREFIX, PREFIX1 PREFIX2 …, or W1 PREFIX1 W2 PREFIX2 ….
    #[arg(long, num_args = 1.., required = true)]
    data_path: Vec<String>,
    /// Megatron's --split (train, valid, test weights).
    #[arg(long, default_value = "969, 30, 1")]
    split: String,
    /// Tokens per sample (Megatron's --seq-length).
    #[arg(long)]
    seq_length: usize,
    /// Megatron's --seed.
    #[arg(long, default_value_t = 1234)]
    seed: u32,
    /// Megatron's --mid-level-dataset-surplus (blends only).
    #[arg(long, default_value_t = mindkit::data::gpt_dataset::MID_LEVEL_SURPLUS)]
    mid_level_dataset_surplus: f64,
    /// Samples asked of the split (train: --train-iters × --global-batch-size); one epoch when omitted.
    #[arg(long)]
    samples: Option<u64>,
    /// Which split: train, valid or test.
    #[arg(long, default_value = "train", value_parser = ["train", "valid", "test"])]
    which: String,
    /// Print only the first N samples.
    #[arg(long)]
    first: Option<usize>,
}

fn preprocess_options(a: PreprocessArgs) -> Result<preprocess::PreprocessOptions> {
    let output_prefix = a.output_prefix.context("--output-prefix is required")?;
    let tokenizer = a.tokenizer.context("--tokenizer is required")?;
    if let Some(t) = a
        .tokenizer_type
        .as_ref()
        .filter(|t| *t != "MagistralTokenizer")
    {
        eprintln!(
            "mindkit: note: --tokenizer-type {t} ignored; the tokenizer is read from {}",
            tokenizer.display()
        );
    }
    let handler = match a.handler.as_deref() {
        None | Some("" | "GeneralPretrainHandler") => None,
        Some(h) => Some(preprocess::HandlerKind::parse(h).with_context(|| {
            format!("unknown --handler {h:?}; choose alpaca, belle, moss, sharegpt, alpaca-pairwise or sharegpt-pairwise")
        })?),
    };
    let dtype = match a.dtype.as_str() {
        "auto" => preprocess::DTypeChoice::Auto,
        "uint16" => preprocess::DTypeChoice::U16,
        "int32" => preprocess::DTypeChoice::I32,
        other => bail!("--dtype {other}: choose auto, uint16 or int32"),
    };
    let map_keys = match &a.map_keys {
        None => None,
        Some(s) => match serde_json::from_str(s).context("--map-keys is not valid JSON")? {
            serde_json::Value::Object(m) => Some(m),
            _ => bail!("--map-keys must be a JSON object"),
        },
    };
    Ok(preprocess::PreprocessOptions {
        inputs: a.input,
        output_prefix,
        tokenizer,
        tokenizer_type: a.tokenizer_type,
        json_keys: a.json_keys,
        append_eod: a.append_eod,
        handler,
        prompt_type: a.prompt_type,
        prompt_type_path: a.prompt_type_path,
        enable_thinking: preprocess::parse_enable_thinking(&a.enable_thinking)?,
        reasoning_effort: a
            .reasoning_effort
            .as_deref()
            .map(preprocess::parse_reasoning_effort)
            .transpose()?,
        drop_thinking: preprocess::parse_drop_thinking(&a.drop_thinking)?,
        map_keys,
        seq_length: a.seq_length,
        pack: a.pack,
        workers: a
            .workers
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())),
        dtype,
        add_special_tokens: !a.no_special_tokens,
        skip_bad_records: a.skip_bad_records,
        force: a.force,
        shard: a.shard,
        progress: !a.quiet,
        input_format: a.input_format,
        max_record_bytes: a.max_record_bytes,
    })
}

fn convert_options(
    input: PathBuf,
    from: Option<Format>,
    to: Format,
    a: &OutputArgs,
) -> Result<ConvertOptions> {
    Ok(ConvertOptions {
        input,
        output: a.output.clone(),
        from,
        to,
        tp: a.tp,
        pp: a.pp,
        ep: a.ep,
        etp: a.etp,
        tp_extend_ep: a.moe_tp_extend_ep,
        grouped_experts: a.moe_grouped_gemm,
        mla_layout: a.mla_layout,
        mtp_layout: a.mtp_layout,
        vpp: a.vpp,
        layers_per_virtual_stage: a.num_layers_per_virtual_stage,
        dualpipev: a.schedules_method == Some(SchedulesMethod::Dualpipev),
        first_last: (a.first_stage_layers, a.last_stage_layers),
        layout: a.layout,
        ckpt_format: a.ckpt_format,
        dtype: a.dtype.clone(),
        family: a.family.clone(),
        divisible_by: a.make_vocab_size_divisible_by,
        max_shard_bytes: convert::parse_size(&a.max_shard_size)?,
        force: a.force,
        progress: !a.quiet,
    })
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Preprocess(mut a) => {
            if let Some(PreprocessSub::Merge {
                inputs,
                output_prefix,
                force,
                quiet,
            }) = a.merge.take()
            {
                let start = std::time::Instant::now();
                let (docs, seqs, tokens, bytes) = indexed::merge(&inputs, &output_prefix, force)?;
                if quiet {
                    return Ok(());
                }
                eprintln!(
                    "merged {} datasets → {}: {docs} documents, {seqs} sequences, {tokens} tokens, {:.1} MB in {:.2}s",
                    inputs.len(),
                    output_prefix.display(),
                    bytes as f64 / 1e6,
                    start.elapsed().as_secs_f64()
                );
                return Ok(());
            }
            let quiet = a.quiet;
            let opts = preprocess_options(*a)?;
            let summary = preprocess::preprocess(&opts)?;
            if quiet {
                return Ok(());
            }
            for p in &summary.outputs {
                eprintln!("wrote {}.{{bin,idx}}", p.display());
            }
            eprintln!("{summary}");
        }
        Command::Convert(a) => {
            let opts = convert_options(a.input, a.from, a.to, &a.out)?;
            let summary = convert::convert(&opts)?;
            if !a.out.quiet {
                eprintln!("wrote {}: {summary}", opts.output.display());
            }
        }
        Command::Lora(LoraCommand::Merge(a)) => {
            let to = match a.to {
                Some(f) => f,
                None => convert::detect(&a.base)?,
            };
            let opts = lora::MergeOptions {
                convert: convert_options(a.base, None, to, &a.out)?,
                adapter: a.adapter,
                alpha: a.lora_alpha,
            };
            let (summary, edited) = lora::merge(&opts, &mut |w| eprintln!("warning: {w}"))?;
            if !a.out.quiet {
                eprintln!(
                    "wrote {}: {edited} tensors merged with the adapter; {summary}",
                    opts.convert.output.display()
                );
            }
        }
        Command::Lora(LoraCommand::Info { path }) => {
            print!("{}", lora::Adapter::open(&path, None)?.describe())
        }
        Command::Npu(NpuCommand::Info) => {
            let info = mindkit::npu::info()?;
            print!("{}", info.report);
            if !info.unavailable.is_empty() {
                bail!(
                    "npu info: device(s) {:?} could not be opened (their lines above say why)",
                    info.unavailable
                );
            }
        }
        Command::Selftest { device } => {
            let (text, passed) = mindkit::device::selftest(device.kind()?)?;
            print!("{text}");
            if !passed {
                std::process::exit(1);
            }
        }
        Command::Ckpt(CkptCommand::Info { path, keys, family }) => {
            let family = family.as_deref().map(family::by_name).transpose()?;
            print!("{}", info::info(&path, family, keys)?)
        }
        Command::Generate(a) => generate_command(*a)?,
        Command::Eval(a) => {
            let opts = eval::EvalOptions {
                model: a.model,
                tokenizer: a.tokenizer,
                task: match a.task {
                    EvalTask::Boolq => eval::Task::Boolq,
                    EvalTask::Mmlu => eval::Task::Mmlu,
                    EvalTask::Gsm8k => eval::Task::Gsm8k,
                    EvalTask::Gsm8kCot => eval::Task::Gsm8kCot,
                },
                data: a.data,
                num_fewshot: a.num_fewshot,
                fewshot_data: a.fewshot_data,
                seed: a.seed,
                limit: a.limit,
                batch_size: a.batch_size,
                log_samples: a.log_samples,
                output: a.output,
                cache: a.cache,
                progress: !a.quiet,
            };
            let report = device::run(a.device.kind()?, opts.prepare()?)?;
            // The table first: a results file that cannot be written loses nothing shown.
            print!("{}", report.table);
            if let Some(path) = &opts.output {
                eval::write_results(path, &report)?;
            }
        }
        Command::Data(DataCommand::Info { prefix }) => print!("{}", inspect::info(&prefix)?),
        Command::Data(DataCommand::Show {
            prefix,
            index,
            tokenizer,
        }) => {
            print!("{}", inspect::show(&prefix, index, &tokenizer)?)
        }
        Command::Data(DataCommand::Samples(a)) => samples_command(*a)?,
        Command::Train { args } => {
            if args.iter().any(|a| a == "--help" || a == "-h") {
                print!("{}", mindkit::train::args::help());
                return Ok(());
            }
            let summary = mindkit::train::run(&args)?;
            eprintln!("mindkit train: {summary}");
        }
    }
    Ok(())
}

fn samples_command(a: SamplesArgs) -> Result<()> {
    use gpt_dataset::{Blend, SampleConfig, Split};
    use std::io::Write;
    let which = Split::ALL
        .into_iter()
        .find(|s| s.name() == a.which)
        .context("--which")?;
    let mut sizes = [None; 3];
    sizes[which as usize] = a.samples;
    let mut wanted = [false; 3];
    wanted[which as usize] = true;
    let cfg = SampleConfig {
        seq_length: a.seq_length,
        seed: a.seed,
        surplus: a.mid_level_dataset_surplus,
    };
    let splits =
        gpt_dataset::build_splits(&Blend::parse(&a.data_path)?, &a.split, sizes, wanted, &cfg)?;
    let Some(samples) = &splits[which as usize] else {
        bail!("--split {:?} gives the {} split no data", a.split, a.which);
    };
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    for k in 0..samples.len().min(a.first.unwrap_or(usize::MAX)) {
        let (dataset, tokens) = samples.text(k, -1);
        let line =
            serde_json::json!({"split": a.which, "index": k, "dataset": dataset, "tokens": tokens});
        writeln!(out, "{line}")?;
    }
    Ok(())
}

/// `generate` on the backend `--device` names: the request prepared, and where the text goes.
/// (A job of the binary's: the model, where generation lives, sits below the device choice.)
struct Generate<'a, F> {
    prepared: generate::Prepared<'a>,
    on_text: F,
}

impl<F: FnMut(&str)> device::Job for Generate<'_, F> {
    type Output = (generate::Generation, generate::GenerateStats);

    fn run<B: Backend>(self, backend: B) -> Result<Self::Output> {
        self.prepared.run(&backend, self.on_text)
    }
}

fn generate_command(a: GenerateArgs) -> Result<()> {
    use std::io::Write;
    let request = generate::GenerateRequest {
        model: a.model,
        tokenizer: a.tokenizer,
        prompt: a.prompt,
        chat: a.chat,
        system: a.system,
        enable_thinking: a.enable_thinking,
        options: generate::GenerateOptions {
            max_new_tokens: a.max_new_tokens,
            sampling: generate::Sampling {
                temperature: a.temperature,
                top_k: a.top_k,
                top_p: a.top_p,
                seed: a.seed,
            },
            stop: a.stop,
            eos: Vec::new(),
        },
    };
    let device = a.device.kind()?;
    let mut out = std::io::stdout().lock();
    let job = Generate {
        prepared: request.prepare()?,
        on_text: |piece: &str| {
            // A closed stdout (a pipe to `head`) ends the output, not the run.
            let _ = out.write_all(piece.as_bytes()).and_then(|()| out.flush());
        },
    };
    let (g, stats) = device::run(device, job)?;
    let _ = writeln!(out);
    if !a.quiet {
        eprintln!(
            "{} prompt + {} new tokens ({:?}) in {:.2} s ({:.1} tokens/s; model loaded in {:.2} s)",
            stats.prompt_tokens,
            g.tokens.len(),
            g.finish,
            stats.seconds,
            g.tokens.len() as f64 / stats.seconds.max(1e-9),
            stats.load_seconds
        );
    }
    Ok(())
}

fn main() -> ExitCode {
    // Training frees and allocates the same large buffers (logits, activations) every step:
    // mimalloc keeps the pages it got from the OS instead of returning them, which would cost
    // a page fault and a kernel zeroing of every page each step. (mimalloc.h `mi_option_e`:
    // 15 is mi_option_purge_delay; -1 means never purge.)
    const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;
    // SAFETY: sets a process-wide option before any thread is started.
    unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1) };
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("mindkit: {e:#}");
            // `mindkit train` parses its own (Megatron's) flags: a bad one is a bad command
            // line too, as clap's own errors are (exit 2).
            let bad_command_line = e.chain().any(|c| c.is::<mindkit::train::args::ArgsError>());
            ExitCode::from(if bad_command_line { 2 } else { 1 })
        }
    }
}
