//! MindSpeed-LLM's fine-tuning flags: LoRA adapters, and instruction data
//! (`--is-instruction-dataset`).

use super::{positive, LoraConfig, SftConfig};
use crate::data::gpt_dataset::{Blend, MaskConfig};
use crate::data::sft_dataset::Order;
use crate::data::tokenizer::Tokenizer;
use crate::model::params::LoraSpec;
use crate::train::args::Args;
use crate::train::data::SftRows;
use crate::train::preference::{Dpo, DpoLoss};
use anyhow::{anyhow, bail, Result};
use std::path::PathBuf;

/// LoRA from MindSpeed-LLM's flags (its defaults: r 16, alpha 32).
pub(super) fn lora_config(a: &Args) -> Result<Option<LoraConfig>> {
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

/// The fine-tuning data settings (`--is-instruction-dataset`), MindSpeed-LLM's defaults.
pub(super) fn sft_config(
    a: &Args,
    blend: &Blend,
    tokenizer: &Tokenizer,
    masks: &MaskConfig,
    seq_length: usize,
    global_batch: usize,
) -> Result<Option<SftConfig>> {
    let pairwise = a.has("is-pairwise-dataset");
    if !a.has("is-instruction-dataset") && !pairwise {
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
    if pairwise {
        // MindSpeed-LLM's pairwise samples carry no position ids or document lengths, which its
        // DPO get_batch reads under --reset-attention-mask.
        for flag in ["reset-attention-mask", "neat-pack"] {
            if a.has(flag) {
                bail!("--{flag} does not apply to preference pairs (--is-pairwise-dataset)");
            }
        }
    }
    if a.has("neat-pack") && !a.has("reset-attention-mask") {
        // MindSpeed-LLM's dataset reads the documents' numbering only under
        // --reset-attention-mask (decoder_packed_mtf_dataset.py); otherwise a pack is one sample
        eprintln!(
            "mindkit train: note: --neat-pack without --reset-attention-mask has no effect \
             (as in MindSpeed-LLM): each pack is one causal sequence"
        );
    }
    if blend.prefixes.len() > 1 || blend.weights.is_some() {
        bail!(
            "--data-path: fine-tuning reads one dataset prefix (MindSpeed-LLM uses only the \
             first); merge them with `mindkit preprocess merge`"
        );
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
        pairwise,
    }))
}

/// `--stage dpo`'s settings (MindSpeed-LLM's defaults: sigmoid, beta 0.1), refused where the
/// run would not be MindSpeed-LLM's DPO.
pub(super) fn preference_config(
    a: &Args,
    sft: Option<&SftConfig>,
    resuming: bool,
) -> Result<Option<Dpo>> {
    const FLAGS: [&str; 5] = [
        "dpo-loss-type",
        "dpo-beta",
        "dpo-label-smoothing",
        "pref-ftx",
        "ref-model",
    ];
    let pairwise = sft.is_some_and(|s| s.pairwise);
    if a.get("stage") != Some("dpo") {
        if pairwise {
            bail!("--is-pairwise-dataset: preference pairs train with --stage dpo");
        }
        if let Some(flag) = FLAGS.iter().find(|f| a.has(f)) {
            bail!("--{flag} applies to --stage dpo");
        }
        return Ok(None);
    }
    if !pairwise {
        bail!("--stage dpo trains on preference pairs: add --is-pairwise-dataset (data made by a pairwise handler)");
    }
    if resuming {
        bail!(
            "--stage dpo resuming a checkpoint (--load without --finetune) is not built: \
             MindSpeed-LLM then reads its reference model from iteration --refer-model-iter of \
             --load; start from the weights with --finetune"
        );
    }
    if let Some(r) = a.get("ref-model").filter(|&r| Some(r) != a.get("load")) {
        bail!("--ref-model {r}: a reference model other than --load is not built (the reference is the weights training starts from)");
    }
    for flag in ["mtp-num-layers", "calculate-per-token-loss"] {
        if a.has(flag) {
            bail!("--stage dpo with --{flag} is not built");
        }
    }
    let number = |flag: &str, default: f64| -> Result<f64> {
        Ok(a.parse_value::<f64>(flag)?.unwrap_or(default))
    };
    let dpo = Dpo {
        loss: DpoLoss::parse(a.get("dpo-loss-type").unwrap_or("sigmoid"))?,
        beta: number("dpo-beta", 0.1)?,
        label_smoothing: number("dpo-label-smoothing", 0.0)?,
        ftx: number("pref-ftx", 0.0)?,
    };
    if !(dpo.beta.is_finite() && dpo.beta > 0.0) {
        bail!("--dpo-beta must be a positive number, got {}", dpo.beta);
    }
    if !(0.0..=0.5).contains(&dpo.label_smoothing) {
        bail!(
            "--dpo-label-smoothing must be between 0 and 0.5, got {}",
            dpo.label_smoothing
        );
    }
    if !(dpo.ftx.is_finite() && dpo.ftx >= 0.0) {
        bail!("--pref-ftx must be a number ≥ 0, got {}", dpo.ftx);
    }
    Ok(Some(dpo))
}
