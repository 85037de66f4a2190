//! A rank's starting weights: read from `--load` or drawn as megatron-core initialises them.

use super::config::{Start, TrainConfig};
use crate::arch::roles::{Canon, Role};
use crate::ckpt::transform::{read_regrouped, tp_shard};
use crate::model::params::{LoraPart, ParamInfo, ParamTable};
use crate::tensor::host::Tensor as HostTensor;
use anyhow::{anyhow, bail, Context, Result};
use rand::SeedableRng;
use rand_distr::Distribution;

/// The starting weights of this rank's parameters `mine` (a tensor-parallel shard of a
/// pipeline stage of the model `whole`): base weights from `--load` (padded to the run's
/// vocabulary, cast to its dtype) or initialised as megatron-core does — normal(0, σ) for
/// matrices (σ/√(2L) for linear_proj and linear_fc2; the embedding's own σ if given), ones for
/// norms, zeros for biases —, and LoRA factors as peft initialises them: A uniform in ±1/√in
/// (kaiming uniform with a = √5), B zeros. Seeded by `--seed`; no generator can reproduce
/// torch's draws, so the statistics match, not the values. Every tensor of the model is drawn
/// in turn, as one rank would (a stage reads only its own), and cut to tensor-parallel rank
/// `tp.0`'s shard of `tp.1`.
pub(super) fn initial_params(
    cfg: &TrainConfig,
    (whole, mine): (&ParamTable, &ParamTable),
    tp: (usize, usize),
) -> Result<Vec<HostTensor>> {
    let (std, embedding_std) = cfg.init_std;
    let scaled = std / (2.0 * cfg.model.layers as f64).sqrt();
    let mut rng = rand::rngs::StdRng::seed_from_u64(u64::from(cfg.seed));
    let mut draw = |p: &ParamInfo| -> Result<Vec<f32>> {
        let n = p.numel();
        Ok(match (p.lora, p.canon.role) {
            (Some(LoraPart::A), _) => uniform(&mut rng, 1.0 / (p.shape[1] as f32).sqrt(), n)?,
            (Some(LoraPart::B), _)
            | (
                None,
                Role::QkvBias
                | Role::ProjBias
                | Role::ExpertBias
                | Role::InputNormBias
                | Role::PostNormBias
                | Role::FinalNormBias
                | Role::IndexerKeyNormBias
                | Role::OutputBias,
            ) => vec![0.0; n],
            (
                None,
                Role::InputNorm
                | Role::PostNorm
                | Role::FinalNorm
                | Role::QNorm
                | Role::KNorm
                | Role::QLatentNorm
                | Role::KvLatentNorm
                | Role::IndexerKeyNorm
                | Role::MtpEmbedNorm
                | Role::MtpHiddenNorm
                | Role::MtpNorm,
            ) => {
                vec![1.0; n]
            }
            // MindSpeed-LLM's `LinearNoTP` (its core/tensor_parallel/layers.py): Xavier-uniform
            // whatever --init-method-std says
            (None, Role::IndexerQUp | Role::IndexerKey | Role::IndexerWeights) => {
                uniform(&mut rng, (6.0 / (p.shape[0] + p.shape[1]) as f32).sqrt(), n)?
            }
            (None, role) => {
                let sigma = match role {
                    Role::Embedding => embedding_std.unwrap_or(std),
                    _ if p.scaled_init => scaled,
                    _ => std,
                };
                let normal = rand_distr::Normal::new(0.0f32, sigma as f32)
                    .map_err(|e| anyhow!("--init-method-std {sigma}: {e}"))?;
                (0..n).map(|_| normal.sample(&mut rng)).collect()
            }
        })
    };
    let mut out: Vec<Option<HostTensor>> = vec![None; mine.params.len()];
    for p in &whole.params {
        let slots: Vec<usize> = (mine.params.iter().enumerate())
            .filter(|(_, q)| q.canon == p.canon && q.lora == p.lora)
            .map(|(i, _)| i)
            .collect();
        let t = match (&cfg.start, p.lora) {
            (Start::Load { .. }, None) if slots.is_empty() => continue,
            (Start::Load { input, .. }, None) => {
                // the flags may lay multi-latent attention out otherwise than the checkpoint
                let read = |c: Canon| input.read_padded(c, whole.vocab_padded);
                let t = read_regrouped(&input.cfg, p.canon, &read)
                    .with_context(|| format!("--load: {}", p.name))?;
                if t.shape != p.shape {
                    bail!(
                        "--load: {} has shape {:?}, the flags imply {:?}",
                        p.name,
                        t.shape,
                        p.shape
                    );
                }
                t.cast(p.dtype).map_err(|e| anyhow!(e))?
            }
            // drawn whether kept or not: every stage's generator goes through the whole model
            _ => {
                HostTensor::from_f32(p.dtype, p.shape.clone(), &draw(p)?).map_err(|e| anyhow!(e))?
            }
        };
        // this rank's table says whether it is split (routed experts may be whole)
        let split = slots.first().is_some_and(|&i| mine.params[i].tp_split);
        let (r, ranks) = (cfg.layout).shard(p.canon.role.expert().is_some(), tp);
        let t = match ranks > 1 && split {
            true => tp_shard(p.canon.role, &t, r, ranks, whole.vocab_padded),
            false => t,
        };
        for i in slots {
            out[i] = Some(t.clone());
        }
    }
    out.into_iter()
        .zip(&mine.params)
        .map(|(t, p)| t.ok_or_else(|| anyhow!("internal: no initial value for {}", p.name)))
        .collect()
}

/// `n` draws of U(−bound, bound).
fn uniform(rng: &mut rand::rngs::StdRng, bound: f32, n: usize) -> Result<Vec<f32>> {
    let uniform =
        rand_distr::Uniform::new(-bound, bound).map_err(|e| anyhow!("uniform init: {e}"))?;
    Ok((0..n).map(|_| uniform.sample(&mut *rng)).collect())
}
