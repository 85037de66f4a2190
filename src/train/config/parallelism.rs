//! How the ranks split the model: pipeline stages and a virtual pipeline's model chunks, what
//! tensor parallelism needs, and the distributed optimizer's buckets.

use super::positive;
use crate::arch::ModelConfig;
use crate::ckpt::layout::PER_LAYER_NORMS_UNDER_TP;
use crate::train::args::Args;
use anyhow::{bail, Context, Result};

/// The layers of each of `pp` pipeline stages: `--num-layers` split evenly, or the first and/or
/// last stage's given counts and the rest evenly (Megatron's `--decoder-first/last-pipeline-
/// num-layers`, megatron-core megatron/core/transformer/transformer_layer.py
/// `get_transformer_layer_offset`), as `mindkit convert` lays a checkpoint out.
pub(super) fn pipeline_stages(
    a: &Args,
    model: &ModelConfig,
    (pp, vpp): (usize, usize),
) -> Result<Vec<usize>> {
    let first = a.parse_value::<usize>("decoder-first-pipeline-num-layers")?;
    let last = a.parse_value::<usize>("decoder-last-pipeline-num-layers")?;
    if pp == 1 {
        if first.is_some() || last.is_some() {
            bail!("--decoder-first/last-pipeline-num-layers need --pipeline-model-parallel-size of at least 2");
        }
        return Ok(vec![model.layers]);
    }
    // layers as the flags count them (a paired model's pairs, which no stage splits)
    let l = model.stored_layers();
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

/// Whether `--schedules-method dualpipev` asks for MindSpeed's DualPipeV, checked as its
/// dualpipev_feature.py `validate_args` checks it: several pipeline stages, no virtual pipeline
/// of its own (`chunks` 1), even stages of two equal chunks, an untied output layer, enough
/// micro-batches (`micro` per data-parallel rank: at least 2·PP − 1), no context parallelism
/// or overlapped gradient reduction.
pub(super) fn dualpipev(
    a: &Args,
    model: &ModelConfig,
    (pp, chunks): (usize, usize),
    micro: usize,
) -> Result<bool> {
    match a.get("schedules-method") {
        None => return Ok(false),
        Some("dualpipev") => {}
        Some(other) => bail!("--schedules-method {other}: MindSpeed's only schedule is dualpipev"),
    }
    let why = if pp < 2 {
        "pipeline_model_parallel_size should be larger than 1".to_string()
    } else if chunks > 1 {
        "it is incompatible with a virtual pipeline".into()
    } else if a.has("decoder-first-pipeline-num-layers")
        || a.has("decoder-last-pipeline-num-layers")
    {
        "its chunks split even stages".into()
    } else if !model.stored_layers().is_multiple_of(2 * pp) {
        format!(
            "--num-layers {} does not split into 2 × {pp} equal chunks",
            model.stored_layers()
        )
    } else if model.tied {
        "it requires --untie-embeddings-and-output-weights".into()
    } else if micro < 2 * pp - 1 {
        format!(
            "{micro} micro-batches per data-parallel rank: it needs at least 2 × PP − 1 = {}",
            2 * pp - 1
        )
    } else if a.has("overlap-grad-reduce") {
        "it is incompatible with --overlap-grad-reduce".into()
    } else if model.mtp.is_some() {
        bail!(
            "--schedules-method dualpipev with --mtp-num-layers: MindSpeed gives the depths on the \
             first stage an embedding of their own, trained apart from the model's; not built"
        );
    } else {
        return Ok(true);
    };
    bail!("--schedules-method dualpipev: {why} (as MindSpeed checks it)")
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
pub(super) fn virtual_stages(a: &Args, model: &ModelConfig, pp: usize) -> Result<usize> {
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
            let l = model.stored_layers();
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
pub(super) fn virtual_pipeline(
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
pub(super) fn check_tensor_parallel(
    a: &Args,
    model: &ModelConfig,
    vocab_padded: usize,
    tp: usize,
) -> Result<()> {
    if tp == 1 {
        return Ok(());
    }
    let flag = "--tensor-model-parallel-size";
    if model.qk_norm_per_layer {
        bail!("{flag} {tp}: {PER_LAYER_NORMS_UNDER_TP}");
    }
    if model
        .mla
        .is_some_and(|m| m.fused_down && m.q_lora_rank.is_none())
    {
        // its attention views the replicated linear_qkv's queries of every head as this
        // rank's heads (multi_latent_attention.py `CustomMLASelfAttention`): no split to match
        bail!(
            "{flag} {tp}: multi-latent attention without a query latent in MindSpeed-LLM's \
             fused layout (--spec deepseek_spec / plm_spec: one replicated linear_qkv) is not \
             built over tensor parallelism, as MindSpeed-LLM's attention does not split those \
             queries by head either; train it at TP 1 (as the PLM and DeepSeek-V2-Lite scripts \
             do), or without --spec in megatron-core's layout"
        );
    }
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
pub(super) fn buckets(a: &Args, data_parallel: usize) -> Result<Buckets> {
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
