//! The optimizer's flags: the learning-rate and weight-decay schedule (Megatron's
//! `get_optimizer_param_scheduler`), and the training flags a checkpoint's `args` records.

use super::{flag_error, fraction, non_negative, times_batch};
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

/// Megatron's validate_args (Megatron-LM megatron/training/arguments.py): a run counted in
/// iterations (`--train-iters`) takes no schedule length in samples, and one counted in samples
/// no length in iterations; a nonzero warmup of the other kind is refused too. (Megatron
/// ignores the other kind's WSD length; it is refused here rather than dropped.)
fn check_schedule_units(a: &Args, by_samples: bool) -> Result<()> {
    let (given, mode, other, own) = match by_samples {
        false => ("--train-iters", "iteration", "samples", "iters"),
        true => ("--train-samples", "sample", "iters", "samples"),
    };
    for (what, stem, zero_ok) in [
        ("learning rate decay", "lr-decay", false),
        ("learning rate warmup", "lr-warmup", true),
        ("WSD decay", "lr-wsd-decay", false),
    ] {
        let flag = format!("{stem}-{other}");
        match a.parse_value::<u64>(&flag)? {
            Some(0) if zero_ok => {}
            Some(n) => {
                bail!("--{flag} {n} with {given}: expected {mode}-based {what} (--{stem}-{own})")
            }
            None => {}
        }
    }
    Ok(())
}

/// Megatron's `get_optimizer_param_scheduler`: lengths in samples.
pub(super) fn schedule(a: &Args, iters: u64, samples: Option<u64>, g: u64) -> Result<Schedule> {
    check_schedule_units(a, samples.is_some())?;
    let lr = non_negative(a, "lr")?.ok_or_else(|| anyhow!("--lr is required"))?;
    let min_lr = non_negative(a, "min-lr")?.unwrap_or(0.0);
    let in_samples = |flag: &str| -> Result<Option<u64>> {
        a.parse_value::<u64>(flag)?
            .map(|n| times_batch(n, flag, g))
            .transpose()
    };
    let (decay_steps, wd_steps, wsd, warmup_fixed, warmup_flag) = match samples {
        None => {
            let train = times_batch(iters, "train-iters", g)?;
            (
                in_samples("lr-decay-iters")?.unwrap_or(train),
                train,
                in_samples("lr-wsd-decay-iters")?,
                in_samples("lr-warmup-iters")?.unwrap_or(0),
                "lr-warmup-iters",
            )
        }
        Some(s) => (
            a.parse_value::<u64>("lr-decay-samples")?.unwrap_or(s),
            s,
            a.parse_value::<u64>("lr-wsd-decay-samples")?,
            a.parse_value::<u64>("lr-warmup-samples")?.unwrap_or(0),
            "lr-warmup-samples",
        ),
    };
    // Megatron asserts only a nonzero warmup length given with the fraction.
    let warmup = match fraction(a, "lr-warmup-fraction")? {
        Some(f) if warmup_fixed > 0 => {
            bail!("--lr-warmup-fraction {f} and --{warmup_flag}: only one of them can be given")
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
        (
            "hidden_dropout",
            json!(a.parse_value::<f64>("hidden-dropout")?.unwrap_or(0.1)),
        ),
        (
            "attention_dropout",
            json!(a.parse_value::<f64>("attention-dropout")?.unwrap_or(0.1)),
        ),
        (
            "gradient_accumulation_fusion",
            json!(!a.has("no-gradient-accumulation-fusion")),
        ),
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
