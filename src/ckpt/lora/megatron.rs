//! Megatron / MindSpeed-LLM LoRA checkpoints (`docs/checkpoints.md` §6.2, §6.3): the torch-format
//! directory layout, keys `decoder.layers.N.self_attention.linear_qkv.lora_A.default.weight`
//! (`lora_a`/`lora_b` also), LoRA-only (`--lora-ckpt-filter`) or next to the base weights.
//! Column-parallel layers (qkv, fc1) split `lora_B` over TP and replicate `lora_A`;
//! row-parallel ones (proj, fc2) the reverse. Factors are gathered like their weights, so an
//! adapter of any TP/PP merges into a base of any layout.

use super::{lora_scale, parse_lora_key, Edit, Factor, FactorKind, MergePlan, Store, Term};
use crate::arch::roles::{canonical_shape, Canon};
use crate::arch::ModelConfig;
use crate::ckpt::config::{arg, arg_positive, arg_uint, positive};
use crate::ckpt::grouped::{expert_view, GroupedLora};
use crate::ckpt::layout::{self, chunk_entries, expert_block_of, rank_grid, KeyLayout, Parallel};
use crate::ckpt::megatron::{
    chunks, flatten, is_legacy_chunk, is_lora_key, open_rank_files, RankFiles,
};
use crate::ckpt::torch::pickle::{TensorRef, Value};
use crate::ckpt::torch::TorchFile;
use crate::ckpt::transform::{is_row_parallel, is_tp_split, shard_shape};
use anyhow::{anyhow, bail, Context, Result};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;

/// A LoRA factor found in a rank file: an adapted module's, or one expert's block of a grouped
/// factor (`transposed`: the block is the factor's transpose).
struct Found {
    stage: usize,
    /// The rank file: its index in the stage's [`RankFiles`] grid.
    rank: usize,
    chunk: usize,
    key: String,
    module: String,
    kind: FactorKind,
    tensor: TensorRef,
    transposed: bool,
}

/// A Megatron LoRA checkpoint.
pub struct MegatronLora {
    iter_dir: PathBuf,
    files: Vec<Vec<TorchFile>>,
    args: Vec<(String, Value)>,
    alpha: Option<f64>,
    chunks: usize,
    legacy: bool,
    factors: Vec<Found>,
    base_tensors: usize,
    /// The files' tensor-parallel, expert-parallel and expert tensor-parallel sizes, and
    /// `--moe-tp-extend-ep` ([`RankFiles`]).
    ranks: (usize, usize, usize, bool),
}

/// The tensor-parallel ranks a layer's adapter factors are split over: its weight's (TP, or
/// ETP for routed experts), 1 for a replicated layer (both factors whole on every rank).
fn replicas_split(par: &Parallel, role: crate::arch::roles::Role) -> usize {
    match is_tp_split(role) {
        true => par.split_of(role),
        false => 1,
    }
}

/// Module kinds Megatron splits on their input dimension (row-parallel).
fn row_parallel_module(module: &str) -> bool {
    let kind = module.rsplit('.').next().unwrap_or(module);
    matches!(
        kind,
        "linear_proj" | "linear_fc2" | "dense" | "dense_4h_to_h"
    )
}

impl MegatronLora {
    /// Index the LoRA tensors of every rank file. `alpha` overrides `args.lora_alpha`.
    pub fn open(dir: &std::path::Path, alpha: Option<f64>) -> Result<Self> {
        let RankFiles {
            iter_dir,
            files,
            tp,
            ep,
            etp,
            tp_extend,
        } = open_rank_files(dir)?;
        let args = match files[0][0].root().get("args") {
            Some(Value::Namespace(a)) => a.clone(),
            _ => Vec::new(),
        };
        let alpha = match alpha {
            Some(a) => Some(positive("--lora-alpha", a)?),
            None => arg_positive(&args, "lora_alpha")
                .with_context(|| files[0][0].path().display().to_string())?,
        };
        let mut lora = MegatronLora {
            iter_dir,
            alpha,
            args,
            chunks: chunks(&files[0][0])?.len(),
            legacy: false,
            factors: Vec::new(),
            base_tensors: 0,
            files: Vec::new(),
            ranks: (tp, ep, etp, tp_extend),
        };
        for (stage, per_rank) in files.iter().enumerate() {
            for (rank, f) in per_rank.iter().enumerate() {
                lora.index_file(stage, rank, f)?;
            }
        }
        if lora.factors.is_empty() {
            bail!(
                "{}: no LoRA tensors (keys with lora_A / lora_B) in any rank file",
                lora.iter_dir.display()
            );
        }
        lora.files = files;
        Ok(lora)
    }

    fn index_file(&mut self, stage: usize, rank: usize, f: &TorchFile) -> Result<()> {
        for (chunk, model) in chunks(f)?.into_iter().enumerate() {
            let legacy = is_legacy_chunk(model);
            self.legacy |= legacy;
            let mut flat = BTreeMap::new();
            flatten(model, legacy, f.path(), &mut flat)?;
            for (key, value) in flat {
                let Value::Tensor(tensor) = value else {
                    continue;
                };
                if !is_lora_key(&key) {
                    self.base_tensors += !key.ends_with("_extra_state") as usize;
                    continue;
                }
                if let Some(g) = GroupedLora::of(&key) {
                    self.index_grouped(stage, rank, chunk, (&key, &g, &tensor), f)?;
                    continue;
                }
                let (module, kind, _) = parse_lora_key(&key).ok_or_else(|| {
                    anyhow!("{}: unrecognised LoRA tensor {key}", f.path().display())
                })?;
                match kind {
                    FactorKind::A | FactorKind::B => {}
                    FactorKind::ExtraState => continue,
                    _ => bail!(
                        "{}: LoRA tensor {key} ({kind:?}) is not supported in Megatron adapters",
                        f.path().display()
                    ),
                }
                self.factors.push(Found {
                    stage,
                    rank,
                    chunk,
                    key,
                    module,
                    kind,
                    tensor: *tensor,
                    transposed: false,
                });
            }
        }
        Ok(())
    }

    /// Each local expert's block of a grouped LoRA factor (MindSpeed-LLM's
    /// LoraParallelGroupedMLP) as that expert's factor, stored transposed.
    fn index_grouped(
        &mut self,
        stage: usize,
        rank: usize,
        chunk: usize,
        (key, g, tensor): (&str, &GroupedLora, &TensorRef),
        f: &TorchFile,
    ) -> Result<()> {
        let experts = arg_uint(&self.args, "num_experts")
            .with_context(|| f.path().display().to_string())?
            .ok_or_else(|| anyhow!("{}: {key} without args.num_experts", f.path().display()))?;
        let local = experts / self.file_ranks(0).1 .1;
        let shard = (local > 0).then(|| g.shard(&tensor.shape, local)).flatten();
        let shard = shard.ok_or_else(|| {
            anyhow!(
                "{}: {key} of shape {:?} does not hold {local} experts' factors",
                f.path().display(),
                tensor.shape
            )
        })?;
        for le in 0..local {
            let block = expert_view((key, tensor), le, (&shard, local))
                .with_context(|| f.path().display().to_string())?;
            self.factors.push(Found {
                stage,
                rank,
                chunk,
                key: key.to_string(),
                module: g.module(le),
                kind: if g.a { FactorKind::A } else { FactorKind::B },
                tensor: block,
                transposed: true,
            });
        }
        Ok(())
    }

    fn path(&self, f: &Found) -> String {
        self.files[f.stage][f.rank].path().display().to_string()
    }

    /// The adapter's pipeline layout for the base architecture (uneven stages from its args).
    fn parallel(&self, cfg: &ModelConfig) -> Result<Parallel> {
        let arg = |name| {
            arg_uint(&self.args, name)
                .with_context(|| self.files[0][0].path().display().to_string())
        };
        let first_last = (
            arg("decoder_first_pipeline_num_layers")?,
            arg("decoder_last_pipeline_num_layers")?,
        );
        let (pp, (tp, ep, etp, tp_extend)) = (self.files.len(), self.ranks);
        let par = Parallel::new(cfg, tp, pp, self.chunks, first_last)
            .and_then(|p| p.with_experts(cfg, (ep, etp)))
            .and_then(|p| match tp_extend {
                true => p.with_tp_extend(cfg),
                false => Ok(p),
            });
        par.with_context(|| {
            format!(
                "{}: the adapter's layout (TP {tp}, PP {pp}, VPP {}, EP {ep}) does not fit the base model",
                self.iter_dir.display(),
                self.chunks
            )
        })
    }

    /// The file's `(tp, ep)` ranks, and its expert block and how many there are
    /// ([`Parallel::expert_block`]).
    fn file_ranks(&self, rank: usize) -> ((usize, usize), (usize, usize)) {
        let (tp, ep, etp, tp_extend) = self.ranks;
        let file = rank_grid(tp, ep, if tp_extend { tp } else { etp })[rank];
        (file, expert_block_of((tp, ep, tp_extend), file))
    }

    /// The module a factor adapts, named as in one whole model: a routed expert's by its
    /// global index of `experts` (a rank file holds its expert block, `local_experts.N` in it).
    fn global_module(&self, f: &Found, experts: usize) -> String {
        let marker = ".mlp.experts.local_experts.";
        let Some((stem, rest)) = f.module.split_once(marker) else {
            return f.module.clone();
        };
        let (local, tail) = rest.split_once('.').unwrap_or((rest, ""));
        let Ok(local) = local.parse::<usize>() else {
            return f.module.clone();
        };
        let (_, (block, blocks)) = self.file_ranks(f.rank);
        let global = block * (experts / blocks.max(1)) + local;
        format!("{stem}{marker}{global}.{tail}")
    }

    /// Map every factor onto the base's canonical tensors; check completeness and shapes.
    pub(super) fn plan(self, cfg: &ModelConfig) -> Result<MergePlan> {
        let par = self.parallel(cfg)?;
        let (pp, vpp) = (par.pp, par.vpp);
        let experts = cfg.moe.as_ref().map_or(0, |m| m.experts);
        let alpha = self.alpha.ok_or_else(|| {
            anyhow!(
                "{}: the checkpoint args record no lora_alpha; pass --lora-alpha (the value \
                 training used, MindSpeed's default is 32)",
                self.iter_dir.display()
            )
        })?;
        let layout = if self.legacy {
            KeyLayout::Legacy
        } else {
            KeyLayout::Mcore
        };
        // (stage, chunk, weight key) → canonical tensor.
        let mut weights: HashMap<(usize, usize, String), Canon> = HashMap::new();
        for p in 0..pp {
            for v in 0..vpp {
                let entries = chunk_entries(
                    layout,
                    cfg,
                    &par.chunk_layers(p, v),
                    par.chunk_ends(p, v),
                    pp,
                    (0, 1),
                );
                for (path, canon) in entries {
                    if let Some(c) = canon {
                        weights.insert((p, v, layout::flat_key(&path)), c);
                    }
                }
            }
        }
        // canonical tensor → [A shards, B shards] by TP rank.
        type Shards = Vec<Option<(usize, usize, String, TensorRef)>>;
        type Slot = (Canon, [Shards; 2], [bool; 2]);
        let mut found: BTreeMap<(Option<usize>, String), Slot> = BTreeMap::new();
        for f in &self.factors {
            let weight = format!("{}.weight", self.global_module(f, experts));
            let canon = weights
                .get(&(f.stage, f.chunk, weight.clone()))
                .copied()
                .filter(|c| c.role.linear_module().is_some())
                .ok_or_else(|| {
                    anyhow!(
                        "{}: {} adapts {weight}, which is not a linear layer weight of this {} \
                         model (unknown target module)",
                        self.path(f),
                        f.key,
                        cfg.family.name
                    )
                })?;
            // each shard from the first file holding it (dense shards are on every
            // expert-parallel rank, whole experts on several tensor-parallel ones, a replicated
            // layer's whole factors on every rank)
            let split = replicas_split(&par, canon.role);
            let slot = found
                .entry((canon.layer, format!("{:?}", canon.role)))
                .or_insert_with(|| (canon, [vec![None; split], vec![None; split]], [false; 2]));
            let which = (f.kind == FactorKind::B) as usize;
            let shard = &mut slot.1[which][self.file_ranks(f.rank).0 .0 % split];
            if shard.is_none() {
                *shard = Some((f.stage, f.rank, f.key.clone(), f.tensor.clone()));
            }
            slot.2[which] = f.transposed;
        }
        let rank_arg = arg_uint(&self.args, "lora_r")
            .with_context(|| self.files[0][0].path().display().to_string())?;
        let mut edits = HashMap::new();
        for (canon, [a, b], [a_t, b_t]) in found.into_values() {
            let a = self.complete(a, canon, "lora_A")?;
            let b = self.complete(b, canon, "lora_B")?;
            // a factor stored transposed (a grouped expert's) has its shape reversed
            let logical = |t: &TensorRef, transposed: bool| match transposed {
                true => t.shape.iter().rev().copied().collect::<Vec<u64>>(),
                false => t.shape.clone(),
            };
            let r = logical(&a[0].3, a_t)[0] as usize;
            if r == 0 {
                bail!("{}: {} has rank 0", self.iter_dir.display(), a[0].2);
            }
            if let Some(want) = rank_arg.filter(|&n| n != r) {
                bail!(
                    "{}: {} has rank {r}, but the checkpoint args say lora_r = {want}",
                    self.iter_dir.display(),
                    a[0].2
                );
            }
            let tp = replicas_split(&par, canon.role);
            let shard = shard_shape(cfg, canon.role, tp, 0);
            for (shards, want, t_) in [(&a, [r, shard[1]], a_t), (&b, [shard[0], r], b_t)] {
                for (p, t, key, tensor) in shards {
                    let shape = logical(tensor, t_);
                    if shape != [want[0] as u64, want[1] as u64] {
                        bail!(
                            "{}: {key} has {}shape {shape:?}; the base layer's TP-{tp} shard \
                             {shard:?} with rank {r} implies {want:?}",
                            self.files[*p][*t].path().display(),
                            if t_ { "an expert's factor of " } else { "" }
                        );
                    }
                }
            }
            let scale = lora_scale(alpha, r as f64, &a[0].2)?;
            let row = is_row_parallel(canon.role);
            let split = tp > 1;
            let rows = canonical_shape(cfg, canon.role)[0];
            let term = Term {
                b: Factor::Shards {
                    role: canon.role,
                    gather: split && !row,
                    shards: b,
                    transposed: b_t,
                },
                a: Factor::Shards {
                    role: canon.role,
                    gather: split && row,
                    shards: a,
                    transposed: a_t,
                },
                scale,
                transposed: false,
                blocks: vec![(0, 0, rows)],
            };
            edits.insert(
                canon,
                Edit {
                    replace: Vec::new(),
                    terms: vec![term],
                },
            );
        }
        Ok(MergePlan {
            store: Store::Megatron(self.files),
            edits,
        })
    }

    fn complete(
        &self,
        shards: Vec<Option<(usize, usize, String, TensorRef)>>,
        canon: Canon,
        what: &str,
    ) -> Result<Vec<(usize, usize, String, TensorRef)>> {
        let missing: Vec<usize> = (0..shards.len()).filter(|&t| shards[t].is_none()).collect();
        if !missing.is_empty() {
            bail!(
                "{}: {what} of {:?} (layer {:?}) is missing on TP rank(s) {missing:?}",
                self.iter_dir.display(),
                canon.role,
                canon.layer
            );
        }
        Ok(shards.into_iter().flatten().collect())
    }

    /// `mindkit lora info` text.
    pub(super) fn describe(&self) -> String {
        let (pp, (tp, ep, etp, _)) = (self.files.len(), self.ranks);
        let mut out = format!(
            "format: Megatron LoRA checkpoint ({})\nparallel: TP {tp}, PP {pp}{}{}\n",
            self.iter_dir.display(),
            if self.chunks > 1 {
                format!(", VPP {}", self.chunks)
            } else {
                String::new()
            },
            match (ep, etp) {
                (1, _) => String::new(),
                (_, e) if e == tp => format!(", EP {ep}"),
                (_, 1) => format!(", EP {ep} (whole experts)"),
                (_, e) => format!(", EP {ep} (experts split over ETP {e})"),
            }
        );
        let experts = arg_uint(&self.args, "num_experts")
            .ok()
            .flatten()
            .unwrap_or(0);
        let mut counted = BTreeSet::new();
        let ranks: BTreeSet<u64> = self
            .factors
            .iter()
            .filter(|f| f.kind == FactorKind::A)
            .map(|f| f.tensor.shape[0])
            .collect();
        let ranks: Vec<String> = ranks.iter().map(u64::to_string).collect();
        let alpha = self
            .alpha
            .map_or("not recorded (pass --lora-alpha to merge)".into(), |a| {
                a.to_string()
            });
        out += &format!("r: {}, lora_alpha: {alpha}\n", ranks.join(", "));
        if let Some(Value::List(t)) = arg(&self.args, "lora_target_modules") {
            let names: Vec<&str> = t
                .iter()
                .filter_map(|v| match v {
                    Value::Str(s) => Some(s.as_str()),
                    _ => None,
                })
                .collect();
            out += &format!("lora_target_modules (args): {}\n", names.join(", "));
        }
        let mut kinds: BTreeMap<&str, BTreeSet<(usize, usize, String)>> = BTreeMap::new();
        let mut layers = BTreeSet::new();
        let mut params = 0u64;
        for f in &self.factors {
            let kind = f.module.rsplit('.').next().unwrap_or(&f.module);
            let module = self.global_module(f, experts);
            kinds
                .entry(kind)
                .or_default()
                .insert((f.stage, f.chunk, module.clone()));
            layers.extend(layout::layer_index(&f.module).map(|l| (f.stage, f.chunk, l)));
            // Each factor's shard is counted once: a replicated factor's once, an expert's
            // once per ETP shard, a dense factor once over the expert-parallel files.
            let split_over = match f.module.contains(".local_experts.") {
                true => etp,
                false => tp,
            };
            let split = (f.kind == FactorKind::A) == row_parallel_module(&f.module);
            let t = match split {
                true => self.file_ranks(f.rank).0 .0 % split_over,
                false => 0,
            };
            let key = (f.stage, f.chunk, module, f.kind == FactorKind::A);
            if counted.insert((key, t)) {
                params += f.tensor.shape.iter().product::<u64>();
            }
        }
        let modules: usize = kinds.values().map(BTreeSet::len).sum();
        let kinds: Vec<String> = kinds
            .iter()
            .map(|(k, m)| format!("{k} ×{}", m.len()))
            .collect();
        out += &format!(
            "adapted modules: {modules} ({}) in {} layers\n",
            kinds.join(", "),
            layers.len()
        );
        out += &format!("parameters: {params}\n");
        out += &if self.base_tensors > 0 {
            format!(
                "base weights: {} tensors stored alongside (pass this directory as --base too)\n",
                self.base_tensors
            )
        } else {
            "base weights: none (LoRA-only checkpoint)\n".into()
        };
        out
    }
}
