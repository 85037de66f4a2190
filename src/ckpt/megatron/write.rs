//! Writing a Megatron torch-format checkpoint: every rank file of a TP × PP (× VPP) × EP
//! layout, streamed tensor by tensor from the canonical tensors.

use super::{expert_rank_dir, RANK_FILE, TRACKER};
use crate::arch::roles::Canon;
use crate::arch::ModelConfig;
use crate::ckpt::config::{megatron_args, ParallelArgs};
use crate::ckpt::grouped::{grouped_key, grouped_shape, pack};
use crate::ckpt::layout::{self, chunk_entries, KeyLayout, Parallel};
use crate::ckpt::torch::pickle::Value;
use crate::ckpt::torch::save::{contiguous, PtWriter};
use crate::ckpt::transform::{shard_row_parts, shard_shape, tp_shard};
use crate::tensor::host::Tensor;
use anyhow::{bail, Context, Result};
use rayon::prelude::*;
use std::collections::HashMap;
use std::path::Path;

/// What to write.
pub struct MegatronTarget<'a> {
    /// Architecture (dtype = target dtype).
    pub cfg: &'a ModelConfig,
    /// Parallel layout.
    pub par: &'a Parallel,
    /// Key layout.
    pub layout: KeyLayout,
    /// `--make-vocab-size-divisible-by`.
    pub divisible_by: usize,
    /// Source args to keep (Megatron → Megatron), else empty.
    pub base_args: &'a [(String, Value)],
    /// Routed experts grouped instead of megatron-core's `local_experts.N`: in the mcore
    /// layout as MindSpeed-LLM's grouped tensors (`mlp.experts.weight1`/`weight2`,
    /// [`crate::ckpt::grouped`]), in the TE layout as `TEGroupedMLP`'s `linear_fc1.weight{i}`
    /// ([`layout::te_grouped_entries`]).
    pub grouped: bool,
}

/// The rank files of a stage holding one expert block: the same tensors, each its TP rank's
/// shards.
struct FileGroup {
    stage: usize,
    block: usize,
    /// `(tp, ep)` of each file.
    files: Vec<(usize, usize)>,
}

/// One storage of a rank file: a canonical tensor's shard, or a grouped tensor packing the
/// shards of a layer's local experts.
struct Stored {
    canons: Vec<Canon>,
    grouped: bool,
}

/// Insert `v` at a nested key path of a dict.
fn insert_path(dict: &mut Vec<(Value, Value)>, path: &[String], v: Value) {
    let key = Value::Str(path[0].clone());
    if path.len() == 1 {
        dict.push((key, v));
        return;
    }
    let pos = match dict.iter().position(|(k, _)| *k == key) {
        Some(i) => i,
        None => {
            dict.push((key, Value::Dict(Vec::new())));
            dict.len() - 1
        }
    };
    if let Value::Dict(inner) = &mut dict[pos].1 {
        insert_path(inner, &path[1..], v);
    }
}

impl MegatronTarget<'_> {
    /// Padded vocabulary rows.
    pub fn padded_vocab(&self) -> usize {
        self.par.padded_vocab(self.cfg.vocab, self.divisible_by)
    }

    /// Bytes of tensor data the checkpoint will hold.
    pub fn total_bytes(&self) -> u64 {
        let padded = self.padded_vocab();
        let mut n = 0u64;
        for g in self.rank_groups() {
            for (_, canon) in self.stage_entries(g.stage, g.block).into_iter().flatten() {
                if let Some(c) = canon {
                    n += g.files.len() as u64 * self.shard_bytes(c, padded);
                }
            }
        }
        n
    }

    /// Bytes of one rank's shard of `c`.
    fn shard_bytes(&self, c: Canon, padded: usize) -> u64 {
        let shape = shard_shape(self.cfg, c.role, self.par.split_of(c.role), padded);
        (shape.iter().product::<usize>() * c.role.dtype(self.cfg).size()) as u64
    }

    /// Every (stage, expert block) pair with the `(tp, ep)` ranks of its files
    /// ([`Parallel::rank_files`], [`Parallel::expert_block`]): each holds the same tensors,
    /// its TP rank's shards.
    fn rank_groups(&self) -> Vec<FileGroup> {
        let blocks = self.par.expert_blocks();
        let files = self.par.rank_files();
        (0..self.par.pp * blocks)
            .map(|i| {
                let (p, block) = (i / blocks, i % blocks);
                let of_block = (files.iter().copied())
                    .filter(|&f| self.par.expert_block(f).0 == block)
                    .collect();
                FileGroup {
                    stage: p,
                    block,
                    files: of_block,
                }
            })
            .collect()
    }

    fn stage_entries(&self, p: usize, block: usize) -> Vec<Vec<layout::ChunkEntry>> {
        let (pp, vpp) = (self.par.pp, self.par.vpp);
        let blocks = self.par.expert_blocks();
        (0..vpp)
            .map(|v| {
                let entries = chunk_entries(
                    self.layout,
                    self.cfg,
                    &self.par.chunk_layers(p, v),
                    self.par.chunk_ends(p, v),
                    pp,
                    (block, blocks),
                );
                match self.grouped && self.layout == KeyLayout::McoreTe {
                    true => layout::te_grouped_entries(entries),
                    false => entries,
                }
            })
            .collect()
    }

    /// The pickled object of one rank file (args, version, iteration and the model chunks,
    /// tensors pointing at storages "0", "1", … in entry order) and what each storage holds.
    fn rank_object(
        &self,
        entries: &[Vec<layout::ChunkEntry>],
        args: &Value,
    ) -> (Value, Vec<Stored>) {
        let padded = self.padded_vocab();
        let blocks = self.par.expert_blocks();
        let local = self.cfg.moe.as_ref().map_or(0, |m| m.experts / blocks);
        let mut stored: Vec<Stored> = Vec::new();
        let mut root = vec![
            (Value::Str("args".into()), args.clone()),
            (Value::Str("checkpoint_version".into()), Value::Float(3.0)),
            (Value::Str("iteration".into()), Value::Int(1)),
        ];
        for (v, chunk) in entries.iter().enumerate() {
            let mut model = Vec::new();
            let mut grouped_at: HashMap<String, usize> = HashMap::new();
            for (path, canon) in chunk {
                let Some(c) = canon else {
                    insert_path(&mut model, path, Value::None);
                    continue;
                };
                let shard = shard_shape(self.cfg, c.role, self.par.split_of(c.role), padded);
                let group = (self.grouped)
                    .then(|| grouped_key(&layout::flat_key(path)))
                    .flatten();
                let is_grouped = group.is_some();
                let (path, shape) = match group {
                    Some((g, _)) => {
                        if let Some(&at) = grouped_at.get(&g) {
                            stored[at].canons.push(*c);
                            continue;
                        }
                        grouped_at.insert(g.clone(), stored.len());
                        let shape = grouped_shape(&g, &shard, local);
                        (vec![g], shape)
                    }
                    None => (path.clone(), shard.iter().map(|&n| n as u64).collect()),
                };
                let tensor = contiguous(&stored.len().to_string(), c.role.dtype(self.cfg), &shape);
                stored.push(Stored {
                    canons: vec![*c],
                    grouped: is_grouped,
                });
                insert_path(&mut model, &path, tensor);
            }
            let name = if entries.len() > 1 {
                format!("model{v}")
            } else {
                "model".into()
            };
            root.push((Value::Str(name), Value::Dict(model)));
        }
        (Value::Dict(root), stored)
    }

    /// Write the checkpoint into `dir` (normally a temporary directory): tracker, iteration
    /// directory and every rank file, stages in parallel, TP ranks of a tensor in parallel.
    /// `read` yields canonical tensors in the target dtype; `progress` gets bytes written.
    pub fn write(
        &self,
        dir: &Path,
        read: &(dyn Fn(Canon) -> Result<Tensor> + Sync),
        progress: &(dyn Fn(u64) + Sync),
    ) -> Result<()> {
        if self.grouped && self.cfg.moe.is_none() {
            bail!(
                "--moe-grouped-gemm writes the routed experts of a mixture of experts grouped; \
                 this model has no experts"
            );
        }
        if self.layout == KeyLayout::Legacy && (self.cfg.qk_norm || self.cfg.moe.is_some()) {
            bail!(
                "the legacy layout has no q/k layernorms or experts (megatron/legacy/model \
                 builds neither); write this model with --layout mcore or mcore-te"
            );
        }
        layout::check_layout(self.layout, self.cfg)?;
        let par = self.par;
        let padded = self.padded_vocab();
        let args = Value::Namespace(megatron_args(
            self.cfg,
            &ParallelArgs::of(par, padded, self.divisible_by, self.grouped),
            self.base_args,
        ));
        let iter_dir = dir.join("iter_0000001");
        self.rank_groups().into_par_iter().try_for_each(|g| {
            let (p, files) = (g.stage, g.files);
            let entries = self.stage_entries(p, g.block);
            let (object, stored) = self.rank_object(&entries, &args);
            let mut writers = (files.into_iter())
                .map(|(t, e)| {
                    let rank = iter_dir.join(expert_rank_dir(t, (p, par.pp), (e, par.ep)));
                    std::fs::create_dir_all(&rank)
                        .with_context(|| format!("creating {}", rank.display()))?;
                    Ok((t, PtWriter::create(&rank.join(RANK_FILE), &object, false)?))
                })
                .collect::<Result<Vec<_>>>()?;
            for (key, s) in stored.iter().enumerate() {
                let storage = key.to_string();
                if s.grouped {
                    let bytes = s.canons.len() as u64 * self.shard_bytes(s.canons[0], padded);
                    for (_, w) in &mut writers {
                        w.begin_storage(&storage, bytes)?;
                    }
                }
                // A grouped tensor's experts go one after the other (one canonical expert in
                // memory, and a shard of it per thread); another tensor whole, each rank's
                // shard cut when its writer is ready.
                for &c in &s.canons {
                    let canonical = read(c)?;
                    let ranks = par.split_of(c.role);
                    writers
                        .par_iter_mut()
                        .try_for_each(|(t, w)| -> Result<()> {
                            let r = *t % ranks;
                            if !s.grouped {
                                if let Some(parts) =
                                    shard_row_parts(c.role, &canonical, r, ranks, padded)
                                {
                                    let bytes = parts.iter().map(|p| p.len()).sum::<usize>();
                                    w.begin_storage(&storage, bytes as u64)?;
                                    parts.iter().try_for_each(|p| w.write_part(p))?;
                                    progress(bytes as u64);
                                    return Ok(());
                                }
                            }
                            let shard = tp_shard(c.role, &canonical, r, ranks, padded);
                            match s.grouped {
                                true => w.write_part(&pack(std::slice::from_ref(&shard)))?,
                                false => w.write_storage(&storage, &shard.data)?,
                            }
                            progress(shard.data.len() as u64);
                            Ok(())
                        })?;
                }
            }
            writers
                .into_iter()
                .try_for_each(|(_, w)| -> Result<()> { Ok(w.finish()?) })
        })?;
        std::fs::write(dir.join(TRACKER), "1")?;
        Ok(())
    }
}
