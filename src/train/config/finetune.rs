//! MindSpeed-LLM's fine-tuning flags: LoRA adapters, and instruction data
//! (`--is-instruction-dataset`).

use super::{positive, LoraConfig, SftConfig};
use crate::data::gpt_dataset::{Blend, MaskConfig};
use crate::data::sft_dataset::Order;
use crate::data::tokenizer::Tokenizer;
use crate::model::params::LoraSpec;
use crate::train::args::Args;
use crate::train::data::SftRows;
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
