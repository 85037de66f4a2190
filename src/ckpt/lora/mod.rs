//! `mindkit lora merge` / `lora info`: LoRA adapters folded into base weights
//! (`docs/checkpoints.md` §6). An adapter — PEFT (`peft.rs`) or a Megatron LoRA checkpoint of
//! any TP/PP (`megatron.rs`) — becomes a plan of edits on the converter's canonical tensors:
//! `W += scale · B·A` (row blocks placed as the canonical tensor orders them), or a tensor
//! replaced (PEFT `modules_to_save`). The merge is then a conversion whose tensors pass
//! through the plan, so every output format, TP/PP layout and dtype of `convert` is available.

mod megatron;
mod peft;

use super::config::show_number;
use super::convert::{self, ConvertOptions, ConvertSummary, TensorEdit};
use super::megatron::is_megatron_dir;
use super::torch::pickle::TensorRef;
use super::torch::TorchFile;
use super::transform::{gather_tp, RowBlock};
use crate::arch::roles::{Canon, Role};
use crate::arch::ModelConfig;
use crate::tensor::host::{decode_f32, encode_f32, to_f32, Tensor};
use crate::tensor::matmul::{self, gemm_into, Strided};
use crate::tensor::panel;
use crate::tensor::DType;
use anyhow::{anyhow, bail, Result};
use rayon::prelude::*;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

pub use megatron::MegatronLora;
pub use peft::PeftAdapter;

/// Which factor of a LoRA pair a key holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FactorKind {
    /// `lora_A` (`[r, in]`).
    A,
    /// `lora_B` (`[out, r]`).
    B,
    /// `lora_B.bias` (PEFT `lora_bias`).
    BBias,
    /// `lora_embedding_A` (`[r, vocab]`).
    EmbeddingA,
    /// `lora_embedding_B` (`[hidden, r]`).
    EmbeddingB,
    /// DoRA's `lora_magnitude_vector`.
    Magnitude,
    /// A module's `_extra_state` (Transformer Engine), carries no weights.
    ExtraState,
}

/// A LoRA key split into the wrapped module's path and the factor it holds:
/// `M.lora_A.weight`, `M.lora_A.<adapter>.weight`, `M.lora_a.weight`, `M.lora_B.bias`,
/// `M.lora_embedding_A[.<adapter>]`, `M.lora_magnitude_vector[.<adapter>.weight]`.
/// Returns the adapter name when the key carries one.
fn parse_lora_key(key: &str) -> Option<(String, FactorKind, Option<String>)> {
    let at = key.find(".lora_")?;
    let module = key[..at].to_string();
    let mut parts: Vec<&str> = key[at + 1..].split('.').collect();
    let kind = parts.remove(0);
    let last = parts.last().copied();
    let kind = match (kind, last) {
        (_, Some("_extra_state")) => FactorKind::ExtraState,
        ("lora_A" | "lora_a", Some("weight")) => FactorKind::A,
        ("lora_B" | "lora_b", Some("weight")) => FactorKind::B,
        ("lora_B" | "lora_b", Some("bias")) => FactorKind::BBias,
        ("lora_embedding_A", _) => FactorKind::EmbeddingA,
        ("lora_embedding_B", _) => FactorKind::EmbeddingB,
        ("lora_magnitude_vector", _) => FactorKind::Magnitude,
        _ => return None,
    };
    let adapter = match kind {
        FactorKind::EmbeddingA | FactorKind::EmbeddingB => parts.first(),
        _ if parts.len() >= 2 => parts.first(),
        _ => None,
    };
    Some((module, kind, adapter.map(|s| s.to_string())))
}

/// Where a factor's data comes from.
#[derive(Debug, Clone)]
enum Factor {
    /// A tensor of a PEFT adapter file.
    Peft(String),
    /// Per-TP-rank shards of a Megatron LoRA checkpoint: `(stage, rank, key, tensor)`, gathered
    /// like `role`'s weight when `gather`, else the replicated rank-0 copy; each the
    /// transpose of the factor's shard when `transposed` (a grouped expert's block).
    Shards {
        role: Role,
        gather: bool,
        shards: Vec<(usize, usize, String, TensorRef)>,
        transposed: bool,
    },
    /// The 1×1 matrix `[1]` (turns a bias vector into a rank-1 product).
    One,
}

/// `W[rows] += scale · B·A` (or `(B·A)ᵀ` for embeddings), row blocks as the canonical tensor
/// orders the adapted HF part.
#[derive(Debug, Clone)]
struct Term {
    b: Factor,
    a: Factor,
    scale: f32,
    transposed: bool,
    blocks: Vec<RowBlock>,
}

/// A tensor replacing (rows of) a canonical tensor.
#[derive(Debug, Clone)]
struct Replace {
    tensor: Factor,
    blocks: Vec<RowBlock>,
}

/// Everything an adapter does to one canonical tensor.
#[derive(Debug, Clone, Default)]
struct Edit {
    replace: Vec<Replace>,
    terms: Vec<Term>,
}

/// Where adapter tensors are read from.
enum Store {
    Peft(super::hf::HfWeights),
    Megatron(Vec<Vec<TorchFile>>),
}

/// An adapter's plan against one base model.
pub struct MergePlan {
    store: Store,
    edits: HashMap<Canon, Edit>,
}

impl MergePlan {
    /// Canonical tensors the adapter changes.
    pub fn edited_tensors(&self) -> usize {
        self.edits.len()
    }

    fn load(&self, f: &Factor) -> Result<Matrix> {
        let t = match (f, &self.store) {
            (Factor::One, _) => return Ok((vec![1.0], vec![1, 1])),
            (Factor::Peft(name), Store::Peft(w)) => w.read(name)?,
            (
                Factor::Shards {
                    role,
                    gather,
                    shards,
                    transposed,
                },
                Store::Megatron(files),
            ) => {
                let read = |(p, t, key, r): &(usize, usize, String, TensorRef)| {
                    let shard = files[*p][*t].read_tensor(key, r)?;
                    Ok(if *transposed {
                        shard.transposed()
                    } else {
                        shard
                    })
                };
                if *gather {
                    let parts = shards.iter().map(read).collect::<Result<Vec<_>>>()?;
                    gather_tp(*role, &parts, 0)?
                } else {
                    read(&shards[0])?
                }
            }
            _ => bail!("internal: adapter factor {f:?} read from the wrong store"),
        };
        let values = to_f32(&t).map_err(|e| anyhow!("adapter tensor: {e}"))?;
        let mut shape = t.shape;
        if shape.len() == 1 {
            shape.push(1);
        }
        Ok((values, shape))
    }
}

/// `alpha / divisor` (`r`, or `√r` with rsLoRA) as the f32 the merge multiplies by; a scale
/// too large for f32 is refused (every merged weight would be infinite). `module` names the
/// adapted module in the error.
fn lora_scale(alpha: f64, divisor: f64, module: &str) -> Result<f32> {
    let scale = (alpha / divisor) as f32;
    if !scale.is_finite() || scale == 0.0 {
        let of = if module.is_empty() {
            String::new()
        } else {
            format!(" of {module}")
        };
        bail!(
            "the LoRA scale{of}, lora_alpha / r = {} / {}, is {}; pass the lora_alpha the \
             adapter was trained with",
            show_number(alpha),
            show_number(divisor),
            if scale == 0.0 {
                "0 in f32 (the merge would change nothing)"
            } else {
                "too large for f32"
            }
        );
    }
    Ok(scale)
}

/// Largest magnitude that `dtype` stores as a finite number after rounding to nearest
/// (f16: 65504 + half a step; bf16: its largest finite + half a step; f32 and wider: any finite).
fn finite_limit(dtype: DType) -> f32 {
    match dtype {
        DType::F16 => 65520.0,
        DType::BF16 => f32::from_bits(0x7F7F_8000),
        _ => f32::INFINITY,
    }
}

/// The first element of a merged tile that is not finite once stored as `dtype`, as an error
/// naming the tensor and the element (`r0`: the tile's first row; `base`: the tile before the
/// merge, decoded again only here, on the error path).
fn check_merged(
    c: Canon,
    merged: &[f32],
    cols: usize,
    r0: usize,
    dtype: DType,
    base: impl Fn(usize) -> f32,
) -> Result<()> {
    let limit = finite_limit(dtype);
    let fits = |x: &f32| x.is_finite() && x.abs() < limit;
    let Some(i) = merged.iter().position(|x| !fits(x)) else {
        return Ok(());
    };
    let (row, col) = (r0 + i / cols, i % cols);
    let before = base(i);
    let cause = if before.is_finite() {
        "the adapter's scale (lora_alpha / r) or factors are too large"
    } else {
        "the base weight itself is not finite there"
    };
    let tensor = match c.layer {
        Some(layer) => format!("the {:?} tensor of layer {layer}", c.role),
        None => format!("the {:?} tensor", c.role),
    };
    let value = merged[i];
    let stored = if value.is_finite() {
        format!(", which {} cannot hold", dtype.torch_name())
    } else {
        String::new()
    };
    bail!(
        "merging the adapter into {tensor} gives {value} at [{row}, {col}]{stored} (base \
         weight {before}): {cause}"
    )
}

/// A row-major or transposed view of a matrix: element `(i, j)` at `i·rs + j·cs`.
struct View<'a> {
    data: &'a [f32],
    rs: usize,
    cs: usize,
}

impl View<'_> {
    fn fits(&self, rows: usize, cols: usize) -> bool {
        rows == 0 || cols == 0 || (rows - 1) * self.rs + (cols - 1) * self.cs < self.data.len()
    }

    fn strided(&self) -> Strided {
        Strided::new(self.data, self.rs, self.cs)
    }
}

/// `dst[n × m] += scale · lhs[n × k] · rhs[k × m]` (dst row-major, contiguous).
fn add_product(dst: &mut [f32], n: usize, m: usize, k: usize, lhs: View, rhs: View, scale: f32) {
    assert!(dst.len() >= n * m && lhs.fits(n, k) && rhs.fits(k, m));
    if n == 0 || m == 0 || k == 0 {
        return;
    }
    let (lhs, rhs) = (lhs.strided(), rhs.strided());
    // SAFETY: every index gemm touches lies inside the slices (checked above); dst is
    // exclusively borrowed and does not alias lhs/rhs.
    unsafe {
        gemm_into(
            dst.as_mut_ptr(),
            m,
            (n, m, k),
            lhs,
            rhs,
            scale,
            matmul::Store::Accumulate,
        )
    };
}

/// Elements of the f32 working tile (rows of a tensor merged together, kept in cache).
const TILE_ELEMENTS: usize = 1 << 18;

impl MergePlan {
    /// Merge the rows `r0..r0 + rows` of a `cols`-wide tensor held in `w` (f32, in place).
    fn merge_tile(&self, edit: &Edit, factors: &Factors, w: &mut [f32], r0: usize, cols: usize) {
        let rows = w.len() / cols;
        let overlap = |&(from, to, n): &RowBlock| {
            let lo = to.max(r0);
            let hi = (to + n).min(r0 + rows);
            (lo < hi).then_some((from + lo - to, lo - r0, hi - lo))
        };
        for (r, src) in edit.replace.iter().zip(&factors.replace) {
            for (from, at, n) in r.blocks.iter().filter_map(overlap) {
                w[at * cols..(at + n) * cols].copy_from_slice(&src[from * cols..(from + n) * cols]);
            }
        }
        for (term, ((b, b_shape), (a, a_shape))) in edit.terms.iter().zip(&factors.terms) {
            let rank = a_shape[0];
            for (from, at, n) in term.blocks.iter().filter_map(overlap) {
                let (lhs, rhs) = if term.transposed {
                    // (B·A)ᵀ = Aᵀ·Bᵀ with A [r, rows], B [cols, r].
                    let lhs = View {
                        data: &a[from..],
                        rs: 1,
                        cs: a_shape[1],
                    };
                    (
                        lhs,
                        View {
                            data: b,
                            rs: 1,
                            cs: rank,
                        },
                    )
                } else {
                    let lhs = View {
                        data: &b[from * b_shape[1]..],
                        rs: b_shape[1],
                        cs: 1,
                    };
                    (
                        lhs,
                        View {
                            data: a,
                            rs: cols,
                            cs: 1,
                        },
                    )
                };
                let dst = &mut w[at * cols..(at + n) * cols];
                let fast = !term.transposed
                    && panel::rank_update(dst, (n, cols, rank), (lhs.data, lhs.rs), a, term.scale);
                if !fast {
                    add_product(dst, n, cols, rank, lhs, rhs, term.scale);
                }
            }
        }
    }
}

/// A factor's values (f32, row-major) and its 2-D shape.
type Matrix = (Vec<f32>, Vec<usize>);

/// An edit's factors, read and converted to f32 once per tensor: replacements, then (B, A)
/// of every term.
struct Factors {
    replace: Vec<Vec<f32>>,
    terms: Vec<(Matrix, Matrix)>,
}

impl TensorEdit for MergePlan {
    /// Tiles of rows are widened to f32, merged and narrowed to the output dtype in parallel,
    /// so the f32 copy of the tensor never exists (memory traffic stays at the tensor's bytes).
    fn apply(&self, c: Canon, t: Tensor, dtype: DType) -> Result<Tensor> {
        let Some(edit) = self.edits.get(&c) else {
            return Ok(t);
        };
        let factors = Factors {
            replace: (edit.replace.iter())
                .map(|r| Ok(self.load(&r.tensor)?.0))
                .collect::<Result<_>>()?,
            terms: (edit.terms.iter())
                .map(|t| Ok((self.load(&t.b)?, self.load(&t.a)?)))
                .collect::<Result<_>>()?,
        };
        let cols = t.shape.get(1).copied().unwrap_or(1);
        let tile = (TILE_ELEMENTS / cols).max(1) * cols;
        let from = t.dtype;
        // Rows `i·tile..` of `src` widened into the thread's f32 buffer `w`, merged, and
        // checked to be finite in the output dtype while the tile is in cache.
        let merged = |i: usize, w: &mut Vec<f32>, src: &[u8]| -> Result<()> {
            w.resize(src.len() / from.size(), 0.0);
            decode_f32(src, from, w).map_err(|e| anyhow!("{c:?}: {e}"))?;
            self.merge_tile(edit, &factors, w, i * tile / cols, cols);
            check_merged(c, w, cols, i * tile / cols, dtype, |at| {
                let size = from.size();
                let mut one = [0.0f32];
                match decode_f32(&src[at * size..(at + 1) * size], from, &mut one) {
                    Ok(()) => one[0],
                    Err(_) => f32::NAN,
                }
            })
        };
        let narrow = |w: &[f32], dst: &mut [u8]| {
            encode_f32(w, dtype, dst).map_err(|e| anyhow!("{c:?}: {e}"))
        };
        if from == dtype {
            // In place: no second buffer of the tensor's size to allocate and fault in.
            let mut t = t;
            (t.data.par_chunks_mut(tile * from.size()).enumerate()).try_for_each_init(
                Vec::new,
                |w, (i, bytes)| {
                    merged(i, w, bytes)?;
                    narrow(w, bytes)
                },
            )?;
            return Ok(t);
        }
        let mut out = vec![0u8; t.data.len() / from.size() * dtype.size()];
        (out.par_chunks_mut(tile * dtype.size())
            .zip(t.data.par_chunks(tile * from.size())))
        .enumerate()
        .try_for_each_init(Vec::new, |w, (i, (dst, src))| {
            merged(i, w, src)?;
            narrow(w, dst)
        })?;
        Ok(Tensor::new(dtype, t.shape, out))
    }
}

/// An adapter directory, either kind.
pub enum Adapter {
    /// PEFT `adapter_config.json` + `adapter_model.safetensors|bin`.
    Peft(PeftAdapter),
    /// Megatron / MindSpeed-LLM LoRA checkpoint.
    Megatron(MegatronLora),
}

impl Adapter {
    /// Open an adapter directory (kind detected). `alpha` overrides a Megatron checkpoint's
    /// `lora_alpha` (MindSpeed's converters take it from the command line).
    pub fn open(dir: &Path, alpha: Option<f64>) -> Result<Adapter> {
        if dir.join(peft::CONFIG).is_file() {
            Ok(Adapter::Peft(PeftAdapter::open(dir)?))
        } else if is_megatron_dir(dir) {
            Ok(Adapter::Megatron(MegatronLora::open(dir, alpha)?))
        } else {
            bail!(
                "{}: not a LoRA adapter (no {} for PEFT, no mp_rank_* / {} for Megatron)",
                dir.display(),
                peft::CONFIG,
                super::megatron::TRACKER
            )
        }
    }

    /// Match the adapter to a base model: every factor mapped to a canonical tensor and its
    /// shape checked, before anything is written.
    pub fn plan(self, cfg: &ModelConfig) -> Result<MergePlan> {
        match self {
            Adapter::Peft(a) => a.plan(cfg),
            Adapter::Megatron(a) => a.plan(cfg),
        }
    }

    /// Human-readable description (`mindkit lora info`).
    pub fn describe(&self) -> String {
        match self {
            Adapter::Peft(a) => a.describe(),
            Adapter::Megatron(a) => a.describe(),
        }
    }
}

/// What `mindkit lora merge` takes besides the conversion options (whose `input` is the base).
pub struct MergeOptions {
    /// Output, format, layout and dtype, as `mindkit convert` takes them.
    pub convert: ConvertOptions,
    /// The adapter directory.
    pub adapter: PathBuf,
    /// `lora_alpha` for Megatron adapters whose args do not record it.
    pub alpha: Option<f64>,
}

/// Merge an adapter into a base and write the result. `warn` receives what deserves the
/// user's attention but does not stop the merge (an adapter trained on another base), before
/// anything is written.
pub fn merge(o: &MergeOptions, warn: &mut dyn FnMut(String)) -> Result<(ConvertSummary, usize)> {
    let start = Instant::now();
    let input = convert::open_input(&o.convert, &[&o.adapter])?;
    if input.lora_tensors() > 0 && !same_dir(&o.convert.input, &o.adapter) {
        bail!(
            "the base {} holds {} LoRA tensors of its own; pass it as --adapter too to merge them",
            o.convert.input.display(),
            input.lora_tensors()
        );
    }
    let adapter = Adapter::open(&o.adapter, o.alpha)?;
    if let Some(w) = base_mismatch(&adapter, &o.convert.input, &input.cfg) {
        warn(w);
    }
    let plan = adapter.plan(&input.cfg)?;
    let edited = plan.edited_tensors();
    let summary = convert::write_output(&o.convert, &input, Some(&plan), start)?;
    Ok((summary, edited))
}

/// The model a path or hub id names: its last component, lowercased
/// (`meta-llama/Llama-2-7b-hf` and `/data/Llama-2-7b-hf/` both name `llama-2-7b-hf`).
fn model_name(s: &str) -> Option<String> {
    let last = s.trim_end_matches(['/', '\\']).rsplit(['/', '\\']).next()?;
    (!last.is_empty()).then(|| last.to_lowercase())
}

/// The names a base directory goes by: its own; its parent's for a Megatron iteration
/// directory (`iter_0000100`, `release`); the model of a Hugging Face cache snapshot
/// (`models--meta-llama--Llama-2-7b-hf/snapshots/<hash>`); and its config.json's
/// `_name_or_path` (also carried in the args of a Megatron checkpoint mindkit wrote).
fn base_names(dir: &Path, cfg: &ModelConfig) -> Vec<String> {
    let dir = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    let file_name = |p: &Path| p.file_name().map(|n| n.to_string_lossy().into_owned());
    let mut names: Vec<String> = Vec::new();
    let mut at = Some(dir.as_path());
    while let Some(p) = at {
        let Some(name) = file_name(p) else { break };
        if let Some(model) = name.strip_prefix("models--") {
            names.extend(model.rsplit("--").next().and_then(model_name));
            break;
        }
        names.extend(model_name(&name));
        let iteration = name == "release" || name.starts_with("iter_");
        let snapshot = p.parent().and_then(file_name).as_deref() == Some("snapshots");
        at = (iteration || snapshot).then(|| p.parent()).flatten();
    }
    let recorded = (cfg.hf_config.as_ref())
        .and_then(|c| c.get("_name_or_path"))
        .and_then(|v| v.as_str());
    names.extend(recorded.and_then(model_name));
    names
}

/// A warning when a PEFT adapter's `base_model_name_or_path` names a model that the base
/// directory does not go by. Only the model's name can be compared (the adapter records a
/// hub id or a path on the training machine): its last component, ignoring case, against
/// [`base_names`]. Megatron adapters record no base.
fn base_mismatch(adapter: &Adapter, base_dir: &Path, cfg: &ModelConfig) -> Option<String> {
    let Adapter::Peft(peft) = adapter else {
        return None;
    };
    let trained_on = peft.base_model()?;
    let wanted = model_name(trained_on)?;
    let names = base_names(base_dir, cfg);
    if names.contains(&wanted) {
        return None;
    }
    Some(format!(
        "the adapter was trained on {trained_on:?} ({} base_model_name_or_path), but the base \
         {} goes by {}; its shapes fit, so the merge goes on: check that this is the base the \
         adapter belongs to",
        peft::CONFIG,
        base_dir.display(),
        if names.is_empty() {
            "no name".to_string()
        } else {
            names
                .iter()
                .map(|n| format!("{n:?}"))
                .collect::<Vec<_>>()
                .join(" / ")
        }
    ))
}

fn same_dir(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    }
}
