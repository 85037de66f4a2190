//! The optimizer's flags: the learning-rate and weight-decay schedule (Megatron's
//! `get_optimizer_param_scheduler`), and the training flags a checkpoint's `args` records.

use super::{flag_error, non_negative};
use crate::tensor::DType;
use crate::train::args::Args;
use crate::train::optim::AdamConfig;
use crate::train::schedule::{DecayStyle, Schedule, WdStyle};
use anyhow::{anyhow, bail, Result};

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
pub(super) fn schedule(a: &Args, iters: u64, samples: Option<u64>, g: u64) -> Result<Schedule> {
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

/// The training flags Megatron's `args` carries into a checkpoint, with its defaults and the
/// values `validate_args` fills in (start/end weight decay), and the tokenizer flags.
pub(super) fn recorded_args(
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
        // MindSpeed-LLM's (mindspeed_llm/features_manager/megatron_basic/requirements_basic.py)
        ("o2_optimizer", json!(adam.moments == DType::BF16)),
        ("o2_gradient", json!(a.has("o2-gradient"))),
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
