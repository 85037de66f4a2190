//! `mindkit convert`: HF ⇄ Megatron and Megatron → Megatron, one canonical tensor at a time.
//! The plan (config, layout, shapes) is validated before anything is written; output goes to a
//! temporary sibling directory renamed into place at the end ([`crate::util`]).

use super::config::parse_dtype;
use super::hf::{self, HfWeights, Planned};
use super::layout::{KeyLayout, Parallel};
use super::megatron::{is_megatron_dir, MegatronCkpt, MegatronTarget};
use super::torch_dist::{self, DistTarget, TorchDistCkpt};
use super::transform::{self, from_hf, hf_parts, to_hf};
use crate::arch::family::{self, hf_names, Family, QkvStyle};
use crate::arch::roles::{canonical, canonical_shape, Canon, Role};
use crate::arch::{Mla, MlaLayout, ModelConfig, MtpLayout};
use crate::tensor::host::Tensor;
use crate::tensor::DType;
use crate::util::{self, Allowed, OutputKind, ProgressUnit, TempOutput};
use anyhow::{anyhow, bail, Context, Result};
use rayon::prelude::*;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Checkpoint formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// Hugging Face directory (config.json + safetensors / pytorch_model.bin).
    Hf,
    /// Megatron torch-format directory.
    Megatron,
}

/// Megatron's checkpoint formats (its `--ckpt-format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum CkptFormat {
    /// One `torch.save` file per model-parallel rank (`mp_rank_TT[_PPP]/model_optim_rng.pt`).
    #[default]
    Torch,
    /// megatron-core's distributed checkpoint (`.metadata`, `__R_K.distcp`, `common.pt`),
    /// loadable at any parallel layout.
    #[value(name = "torch_dist")]
    TorchDist,
}

/// Everything `mindkit convert` takes.
#[derive(Debug, Clone)]
pub struct ConvertOptions {
    /// Input directory.
    pub input: PathBuf,
    /// Output directory.
    pub output: PathBuf,
    /// Input format (detected when `None`).
    pub from: Option<Format>,
    /// Output format.
    pub to: Format,
    /// TP size (default: the source's, or 1).
    pub tp: Option<usize>,
    /// PP size (default: the source's, or 1).
    pub pp: Option<usize>,
    /// EP size (default: the source's, or 1).
    pub ep: Option<usize>,
    /// Expert tensor-parallel size, a divisor of TP (default: a source's narrower one where it
    /// divides TP, else TP).
    pub etp: Option<usize>,
    /// MindSpeed-LLM's `--moe-tp-extend-ep`: whole experts over the TP × EP files (default: a
    /// source's, unless `etp` is given).
    pub tp_extend_ep: bool,
    /// Write the routed experts as MindSpeed-LLM's grouped tensors (`--moe-grouped-gemm`).
    pub grouped_experts: bool,
    /// Multi-latent attention's layout in a Megatron output; default the input's.
    pub mla_layout: Option<MlaLayout>,
    /// Multi-token prediction's layout in a Megatron output (MindSpeed-LLM's or megatron-
    /// core's); default the input's.
    pub mtp_layout: Option<MtpLayout>,
    /// Virtual chunks per stage.
    pub vpp: Option<usize>,
    /// Layers per virtual chunk (alternative to `vpp`).
    pub layers_per_virtual_stage: Option<usize>,
    /// MindSpeed's `--schedules-method dualpipev` layout of a Megatron output
    /// ([`Parallel::dualpipev`]); default a source's when no new pipeline is given.
    pub dualpipev: bool,
    /// Uneven first / last stage layer counts (either or both).
    pub first_last: (Option<usize>, Option<usize>),
    /// Key layout of a Megatron output.
    pub layout: KeyLayout,
    /// Format of a Megatron output.
    pub ckpt_format: CkptFormat,
    /// Output dtype (default: the source's).
    pub dtype: Option<String>,
    /// Family override.
    pub family: Option<String>,
    /// `--make-vocab-size-divisible-by`.
    pub divisible_by: usize,
    /// Max bytes per HF safetensors shard.
    pub max_shard_bytes: u64,
    /// Replace an existing output.
    pub force: bool,
    /// Show a progress bar.
    pub progress: bool,
}

/// Where the tensors come from.
enum Source {
    Hf { dir: PathBuf, weights: HfWeights },
    Megatron(Box<MegatronCkpt>),
    TorchDist(Box<TorchDistCkpt>),
}

/// Find the format of `dir`.
pub fn detect(dir: &Path) -> Result<Format> {
    if is_megatron_dir(dir) || torch_dist::is_torch_dist(dir) {
        Ok(Format::Megatron)
    } else if dir.join("config.json").is_file() {
        Ok(Format::Hf)
    } else {
        bail!(
            "{}: neither a Hugging Face model directory (config.json) nor a Megatron checkpoint \
             (latest_checkpointed_iteration.txt or mp_rank_* directories)",
            dir.display()
        )
    }
}

/// transformers' LongRoPE as Phi-3.5-MoE's model applies it (modeling_phimoe.py
/// `PhimoeRotaryEmbedding`: the long or short factors and mscale by the running length at every
/// call; other families' `dynamic_rope_update` keeps one attention factor, not built). It takes
/// the original context from `config.json` twice: the factors switch past its own
/// `original_max_position_embeddings` (modeling_rope_utils.py `_compute_longrope_parameters`),
/// the mscale past rope_scaling's. mindkit switches both at one place: they must agree.
fn check_longrope_context(json: &serde_json::Value) -> Result<()> {
    if let Some(other) = json["model_type"].as_str().filter(|t| *t != "phimoe") {
        bail!(
            "rope_scaling longrope in a {other} model: transformers' LongRoPE is built as \
             Phi-3.5-MoE's (phimoe) applies it"
        );
    }
    let scaling = &json["rope_scaling"];
    for mscale in ["short_mscale", "long_mscale"] {
        if scaling
            .get(mscale)
            .and_then(serde_json::Value::as_f64)
            .is_none()
        {
            bail!(
                "rope_scaling longrope: {mscale} must be a number (as transformers' \
                 PhimoeConfig requires)"
            );
        }
    }
    let key = "original_max_position_embeddings";
    let top = json.get(key).and_then(serde_json::Value::as_f64);
    let inner = scaling.get(key).and_then(serde_json::Value::as_f64);
    if top.is_none() || top != inner {
        bail!(
            "rope_scaling longrope: {key} is {top:?} at the top and {inner:?} in rope_scaling; \
             transformers switches the factors at the first and the mscale at the second, \
             mindkit both at one: they must be the same number"
        );
    }
    Ok(())
}

/// Open an HF directory: config.json checked against the tensors actually present.
pub fn open_hf(dir: &Path, family: Option<&'static Family>) -> Result<(ModelConfig, HfWeights)> {
    let cfg_path = dir.join("config.json");
    let text = std::fs::read_to_string(&cfg_path)
        .with_context(|| format!("reading {}", cfg_path.display()))?;
    let json: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{}: not valid JSON", cfg_path.display()))?;
    let mut cfg =
        ModelConfig::from_hf(&json, family).with_context(|| format!("{}", cfg_path.display()))?;
    if cfg.rope_type() == Some("longrope") {
        check_longrope_context(&json).with_context(|| format!("{}", cfg_path.display()))?;
    }
    let mut weights = HfWeights::open(dir)?;
    match fp8_blocks(&json).with_context(|| format!("{}", cfg_path.display()))? {
        Some(block) => {
            weights.dequantize_fp8(block)?;
            // what mindkit writes of it is dequantized
            if let Some(obj) = cfg.hf_config.as_mut().and_then(|c| c.as_object_mut()) {
                obj.remove("quantization_config");
            }
        }
        None => {
            let fp8 = weights
                .entries()
                .iter()
                .find(|(_, e)| e.dtype == DType::F8E4M3);
            if let Some((name, _)) = fp8 {
                bail!(
                    "{}: tensor {name} is float8_e4m3fn but config.json has no fp8 \
                     quantization_config (its weight_block_size says how to dequantize it)",
                    weights
                        .file_of(name)
                        .map_or("".into(), |p| p.display().to_string())
                );
            }
        }
    }
    let has = |n: &str| weights.entries().contains_key(n);
    let has_head = has(hf_names::LM_HEAD);
    match json.get("tie_word_embeddings").and_then(|v| v.as_bool()) {
        Some(false) if !has_head => bail!(
            "{}: tie_word_embeddings is false but {} is missing from the weights",
            cfg_path.display(),
            hf_names::LM_HEAD
        ),
        Some(tied) => cfg.tied = tied,
        None => cfg.tied = !has_head,
    }
    let qkv_prefix = match cfg.family.qkv {
        QkvStyle::Separate => hf_names::QKV[0],
        QkvStyle::Packed => hf_names::W_PACK,
    };
    cfg.qkv_bias = has(&hf_names::layer(0, &format!("{qkv_prefix}.bias")));
    cfg.proj_bias = has(&hf_names::layer(0, &format!("{}.bias", hf_names::O_PROJ)));
    cfg.validate()?;
    check_hf_tensors(&cfg, &weights)?;
    // The tensors' own dtype wins over config.json's torch_dtype.
    cfg.dtype = weights.entries()[hf_names::EMBED].dtype;
    Ok((cfg, weights))
}

/// The weight block of a block-scaled float8 checkpoint (`quantization_config` with
/// `quant_method: fp8` and `weight_block_size`, DeepSeek-V3's and Kimi-K2's), `None` for one
/// that is not quantized; other quantizations are refused by name.
fn fp8_blocks(cfg: &serde_json::Value) -> Result<Option<[usize; 2]>> {
    let Some(q) = cfg.get("quantization_config").filter(|q| !q.is_null()) else {
        return Ok(None);
    };
    let field = |k: &str| q.get(k).and_then(|v| v.as_str());
    match field("quant_method") {
        Some("fp8") => {}
        other => bail!(
            "quantization_config.quant_method {other:?}: only DeepSeek-V3's block-scaled fp8 \
             weights are read (dequantized to bf16)"
        ),
    }
    if let Some(fmt) = field("fmt").filter(|f| *f != "e4m3") {
        bail!("quantization_config.fmt {fmt:?}: only e4m3 is read");
    }
    let block: Option<Vec<usize>> =
        (q.get("weight_block_size").and_then(|b| b.as_array())).map(|b| {
            b.iter()
                .filter_map(|n| n.as_u64().map(|n| n as usize))
                .collect()
        });
    match block.as_deref() {
        Some(&[rows, cols]) if rows > 0 && cols > 0 => Ok(Some([rows, cols])),
        _ => bail!(
            "quantization_config.weight_block_size {}: two positive block sizes are needed \
             (per-tensor fp8 scales are not read)",
            q.get("weight_block_size")
                .map_or("missing".into(), |b| b.to_string())
        ),
    }
}

/// Every tensor the config implies exists with the implied shape, and nothing else is there.
fn check_hf_tensors(cfg: &ModelConfig, w: &HfWeights) -> Result<()> {
    let mut expected = std::collections::HashSet::new();
    for c in canonical(cfg) {
        for (name, shape) in hf_parts(cfg, c) {
            let e = w.entries().get(&name).ok_or_else(|| {
                anyhow!("tensor {name} is missing from the weights (config.json implies it)")
            })?;
            if e.shape != shape {
                bail!(
                    "{}: tensor {name} has shape {:?}, config.json implies {shape:?} \
                     (hidden {}, heads {}, kv heads {}, head_dim {}, ffn {}, vocab {})",
                    w.file_of(&name)
                        .map_or("".into(), |p| p.display().to_string()),
                    e.shape,
                    cfg.hidden,
                    cfg.heads,
                    cfg.groups,
                    cfg.head_dim,
                    cfg.ffn,
                    cfg.vocab
                );
            }
            expected.insert(name);
        }
    }
    // The depths' copies of the embedding and output layer: shapes checked, the model's own
    // read (DeepSeek's checkpoints hold the same tensors twice).
    for (name, c) in transform::hf_copies(cfg) {
        let shape = canonical_shape(cfg, c.role);
        match w.entries().get(&name) {
            Some(e) if e.shape == shape => _ = expected.insert(name),
            Some(e) => bail!(
                "{}: tensor {name} has shape {:?}; as a copy of the model's {c:?} it should have {shape:?}",
                w.file_of(&name).map_or("".into(), |p| p.display().to_string()),
                e.shape
            ),
            None => {}
        }
    }
    // LongCat-Flash's multi-token prediction module, which transformers skips too
    let ignorable = |n: &str| {
        n.ends_with("rotary_emb.inv_freq")
            || (cfg.tied && n == hf_names::LM_HEAD)
            || (cfg.paired && n.starts_with("model.mtp."))
    };
    if let Some(extra) = w
        .entries()
        .keys()
        .find(|n| !expected.contains(*n) && !ignorable(n))
    {
        bail!(
            "{}: tensor {extra} is not part of a {} model as mindkit converts it",
            w.file_of(extra)
                .map_or("".into(), |p| p.display().to_string()),
            cfg.family.name
        );
    }
    Ok(())
}

impl Source {
    fn read(&self, cfg: &ModelConfig, c: Canon) -> Result<Tensor> {
        match self {
            Source::Hf { weights, .. } if c.role == Role::Fc1 => {
                // [gate; up] is a plain concatenation: read both into one buffer.
                let parts = hf_parts(cfg, c);
                let bytes = parts
                    .iter()
                    .map(|(n, _)| weights.entries()[n].nbytes())
                    .sum();
                let mut data = Vec::with_capacity(bytes);
                for (name, _) in parts {
                    weights.read_append(&name, &mut data)?;
                }
                let dtype = weights.entries()[&hf_parts(cfg, c)[0].0].dtype;
                Ok(Tensor::new(dtype, canonical_shape(cfg, c.role), data))
            }
            Source::Hf { weights, .. } => {
                let parts = hf_parts(cfg, c)
                    .iter()
                    .map(|(n, _)| weights.read(n))
                    .collect::<Result<Vec<_>>>()?;
                Ok(from_hf(cfg, c, parts))
            }
            Source::Megatron(ck) => ck.read(c),
            Source::TorchDist(ck) => ck.read(c),
        }
    }

    fn side_files_dir(&self) -> &Path {
        match self {
            Source::Hf { dir, .. } => dir,
            Source::Megatron(ck) => ck.iter_dir.parent().unwrap_or(&ck.iter_dir),
            Source::TorchDist(ck) => ck.iter_dir.parent().unwrap_or(&ck.iter_dir),
        }
    }
}

/// Summary of a finished conversion.
pub struct ConvertSummary {
    /// Canonical tensors converted.
    pub tensors: usize,
    /// Bytes of tensor data written.
    pub bytes: u64,
    /// Wall time.
    pub seconds: f64,
}

impl std::fmt::Display for ConvertSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let rate = self.bytes as f64 / 1e9 / self.seconds.max(1e-9);
        let size = if self.bytes >= 1_000_000_000 {
            format!("{:.2} GB", self.bytes as f64 / 1e9)
        } else {
            format!("{:.1} MB", self.bytes as f64 / 1e6)
        };
        write!(
            f,
            "{} tensors, {size} written in {:.2} s ({rate:.2} GB/s)",
            self.tensors, self.seconds
        )
    }
}

/// What a Megatron checkpoint written by mindkit (or Megatron) holds: the tracker, iteration
/// directories of rank directories of `.pt` files, and the tokenizer files copied beside them.
pub static MEGATRON_OUTPUT: OutputKind = OutputKind {
    tag: "megatron",
    what: "Megatron checkpoint",
    dir: Some(&[
        Allowed::Files(&[super::megatron::TRACKER]),
        Allowed::Files(hf::SIDE_FILES),
        Allowed::Dirs("iter_*", RANK_DIRS),
        Allowed::Dirs("release", RANK_DIRS),
    ]),
};

const RANK_DIRS: &[Allowed] = &[Allowed::Dirs("mp_rank_*", &[Allowed::Files(&["*.pt"])])];

/// What a Hugging Face model directory written by mindkit (or transformers) holds: weights
/// (safetensors, or `pytorch_model*.bin`) with their index, the configs, the tokenizer files.
pub static HF_OUTPUT: OutputKind = OutputKind {
    tag: "hf",
    what: "Hugging Face model directory",
    dir: Some(&[
        Allowed::Files(&[
            "*.safetensors",
            "model.safetensors.index.json",
            "pytorch_model*.bin",
            "pytorch_model.bin.index.json",
            "config.json",
        ]),
        Allowed::Files(hf::SIDE_FILES),
    ]),
};

fn output_kind(format: Format) -> &'static OutputKind {
    match format {
        Format::Megatron => &MEGATRON_OUTPUT,
        Format::Hf => &HF_OUTPUT,
    }
}

/// A change applied to canonical tensors on their way to the output (a LoRA merge).
pub trait TensorEdit: Sync {
    /// `t` as it should be written, preferably already in `dtype` (the output dtype; anything
    /// else is cast to it after).
    fn apply(&self, c: Canon, t: Tensor, dtype: DType) -> Result<Tensor>;
}

/// An opened, validated input checkpoint.
pub struct Input {
    /// Its architecture (dtype: the dtype of its tensors).
    pub cfg: ModelConfig,
    /// Its format.
    pub format: Format,
    source: Source,
}

impl Input {
    /// A canonical tensor (unsharded, in the checkpoint's dtype).
    pub fn read(&self, c: Canon) -> Result<Tensor> {
        self.source.read(&self.cfg, c)
    }

    /// A canonical tensor whose vocabulary rows (embedding, output) are padded to `rows`: a
    /// Megatron checkpoint's own rows when it holds exactly `rows`, else the real rows and
    /// copies of the last one, as Megatron's converters pad.
    pub fn read_padded(&self, c: Canon, rows: usize) -> Result<Tensor> {
        if !c.role.vocab_rows() {
            return self.read(c);
        }
        let own = match &self.source {
            Source::Megatron(ck) => Some(ck.read_padded(c)?),
            Source::TorchDist(ck) => Some(ck.read_padded(c)?),
            Source::Hf { .. } => None,
        };
        if let Some(t) = own.filter(|t| t.shape[0] == rows) {
            return Ok(t);
        }
        let t = self.read(c)?;
        if t.shape[0] > rows {
            bail!(
                "the checkpoint's vocabulary has {} rows, more than the {rows} this run pads to \
                 (set --padded-vocab-size or --make-vocab-size-divisible-by to match)",
                t.shape[0]
            );
        }
        Ok(t.rows_padded(0, rows))
    }

    /// The files its configuration and tensors are read from, in a fixed order.
    pub fn files(&self) -> Vec<PathBuf> {
        match &self.source {
            Source::Hf { dir, weights } => std::iter::once(dir.join("config.json"))
                .chain(weights.paths().map(Path::to_path_buf))
                .collect(),
            Source::Megatron(ck) => ck.paths().map(Path::to_path_buf).collect(),
            Source::TorchDist(ck) => ck.paths().map(Path::to_path_buf).collect(),
        }
    }

    /// Whether it is a Megatron `torch_dist` checkpoint (one index of global tensors).
    pub fn is_torch_dist(&self) -> bool {
        self.torch_dist().is_some()
    }

    /// The `torch_dist` checkpoint it is, if it is one.
    pub fn torch_dist(&self) -> Option<&TorchDistCkpt> {
        match &self.source {
            Source::TorchDist(ck) => Some(ck),
            _ => None,
        }
    }

    /// LoRA tensors stored next to the weights (Megatron checkpoints saved without
    /// `--lora-ckpt-filter`).
    pub fn lora_tensors(&self) -> usize {
        match &self.source {
            Source::Megatron(ck) => ck.lora_tensors,
            Source::Hf { .. } | Source::TorchDist(_) => 0,
        }
    }
}

/// Open the input of `o` (format detected unless given), after checking the output against it
/// and `other_inputs` (see [`util::check_output`]) before anything is read.
pub fn open_input(o: &ConvertOptions, other_inputs: &[&Path]) -> Result<Input> {
    let inputs: Vec<&Path> = std::iter::once(o.input.as_path())
        .chain(other_inputs.iter().copied())
        .collect();
    util::check_output(&o.output, output_kind(o.to), &inputs, o.force)?;
    open_checkpoint(&o.input, o.from, o.family.as_deref())
}

/// Open a checkpoint directory of either format (detected unless given) for reading.
pub fn open_checkpoint(dir: &Path, format: Option<Format>, family: Option<&str>) -> Result<Input> {
    let family = family.map(family::by_name).transpose()?;
    let format = match format {
        Some(f) => f,
        None => detect(dir)?,
    };
    Ok(match format {
        Format::Hf => {
            let (cfg, weights) = open_hf(dir, family)?;
            Input {
                cfg,
                format,
                source: Source::Hf {
                    dir: dir.to_path_buf(),
                    weights,
                },
            }
        }
        Format::Megatron if torch_dist::is_torch_dist(dir) => {
            let ck = TorchDistCkpt::open(dir, family)?;
            Input {
                cfg: ck.cfg.clone(),
                format,
                source: Source::TorchDist(Box::new(ck)),
            }
        }
        Format::Megatron => {
            let ck = MegatronCkpt::open(dir, family)?;
            Input {
                cfg: ck.cfg.clone(),
                format,
                source: Source::Megatron(Box::new(ck)),
            }
        }
    })
}

/// Run a conversion.
pub fn convert(o: &ConvertOptions) -> Result<ConvertSummary> {
    let start = Instant::now();
    let input = open_input(o, &[])?;
    if input.lora_tensors() > 0 {
        bail!(
            "{} holds {} LoRA tensors besides the weights; converting would drop them. Merge them \
             with `mindkit lora merge --base {dir} --adapter {dir}`",
            o.input.display(),
            input.lora_tensors(),
            dir = o.input.display()
        );
    }
    write_output(o, &input, None, start)
}

/// Write `input` as `o` asks, each canonical tensor passed through `edit` (if any) and cast to
/// the output dtype, into a temporary sibling of the output renamed into place at the end.
pub fn write_output(
    o: &ConvertOptions,
    input: &Input,
    edit: Option<&dyn TensorEdit>,
    start: Instant,
) -> Result<ConvertSummary> {
    let source = &input.source;
    let mut cfg = input.cfg.clone();
    if let Some(d) = &o.dtype {
        cfg.dtype = parse_dtype(d)?;
    }
    if let Some(layout) = o.mla_layout {
        match (&mut cfg.mla, o.to) {
            // its spec's attention is MindSpeed-LLM's, whose down projections are fused
            (Some(_), Format::Megatron) if cfg.paired && layout == MlaLayout::Mcore => bail!(
                "--mla-layout mcore: {} is LongCat-Flash's (MindSpeed-LLM's longcat_spec), whose \
                 attention has MindSpeed-LLM's fused down projections",
                o.input.display()
            ),
            (Some(m), Format::Megatron) => *m = layout.apply(*m),
            (None, _) => bail!(
                "--mla-layout: {} has no multi-latent attention",
                o.input.display()
            ),
            (_, Format::Hf) => bail!("--mla-layout: a Megatron output's; HF has one layout"),
        }
    }
    if o.to == Format::Hf {
        // a transformers model's weights share one dtype (config.json's torch_dtype)
        cfg.norms_f32 = false;
        // HF holds each up projection whole (DeepSeek's q_b_proj, kv_b_proj)
        cfg.mla = cfg.mla.map(|m| Mla {
            split_up: false,
            ..m
        });
    }
    if let Some(layout) = o.mtp_layout {
        match (&mut cfg.mtp, o.to) {
            (Some(m), Format::Megatron) => m.layout = layout,
            (None, _) => bail!(
                "--mtp-layout: {} has no multi-token prediction depths",
                o.input.display()
            ),
            (_, Format::Hf) => bail!("--mtp-layout: a Megatron output's; HF has one layout"),
        }
    }
    if o.ckpt_format == CkptFormat::TorchDist {
        torch_dist_layouts(o, &mut cfg)?;
    }
    let read = |c: Canon| -> Result<Tensor> {
        let own = |c: Canon| source.read(&input.cfg, c);
        let mut t = transform::read_regrouped(&input.cfg, c, &own)?;
        let want = canonical_shape(&cfg, c.role);
        if t.shape != want {
            bail!("internal: {c:?} read as {:?}, expected {want:?}", t.shape);
        }
        if let Some(e) = edit {
            t = e.apply(c, t, cfg.dtype)?;
        }
        t.cast(c.role.dtype(&cfg))
            .map_err(|e| anyhow!("{c:?}: {e}"))
    };
    // The vocabulary rows padded to a Megatron output's size: a Megatron source's own padding
    // rows kept when its padded size is the output's (they are trained, and their logits enter
    // Megatron's loss), else copies of the last real row; an edited tensor is padded as that.
    let read_padded = |c: Canon, rows: usize| -> Result<Tensor> {
        match edit.is_none() && c.role.vocab_rows() {
            true => (input.read_padded(c, rows)?.cast(c.role.dtype(&cfg)))
                .map_err(|e| anyhow!("{c:?}: {e}")),
            false => read(c),
        }
    };
    let tmp = TempOutput::dir(&o.output, output_kind(o.to), o.force)?;
    let (tensors, bytes) = match o.to {
        Format::Megatron => write_megatron(o, &cfg, source, &read_padded, tmp.path())?,
        Format::Hf => write_hf(o, &cfg, &read, tmp.path())?,
    };
    hf::copy_side_files(source.side_files_dir(), tmp.path())?;
    tmp.commit()?;
    Ok(ConvertSummary {
        tensors,
        bytes,
        seconds: start.elapsed().as_secs_f64(),
    })
}

fn write_megatron(
    o: &ConvertOptions,
    cfg: &ModelConfig,
    source: &Source,
    read_padded: &(dyn Fn(Canon, usize) -> Result<Tensor> + Sync),
    dir: &Path,
) -> Result<(usize, u64)> {
    let (src_par, base_args) = match source {
        Source::Megatron(ck) => (Some(&ck.par), ck.args.as_slice()),
        Source::TorchDist(ck) => (Some(&ck.par), ck.args.as_slice()),
        Source::Hf { .. } => (None, &[][..]),
    };
    let tp = o.tp.or(src_par.map(|p| p.tp)).unwrap_or(1);
    let pp = o.pp.or(src_par.map(|p| p.pp)).unwrap_or(1);
    let vpp = match (o.vpp, o.layers_per_virtual_stage) {
        (Some(v), _) => v,
        (None, Some(_)) if o.first_last != (None, None) => bail!(
            "uneven first/last stages take --vpp (Megatron's --num-virtual-stages-per-pipeline-rank), \
             not --num-layers-per-virtual-stage"
        ),
        (None, Some(n)) => {
            let layers = cfg.stored_layers();
            if n == 0 || !layers.is_multiple_of(pp * n) {
                bail!(
                    "--num-layers-per-virtual-stage {n} does not divide {layers} layers over {pp} stages"
                );
            }
            layers / pp / n
        }
        (None, None) if o.tp.is_none() && o.pp.is_none() => src_par.map_or(1, |p| p.vpp),
        (None, None) => 1,
    };
    // Without a new layout, a Megatron source's uneven stages are kept, as its VPP is.
    let first_last = match (o.first_last, src_par) {
        ((None, None), Some(p)) if o.tp.is_none() && o.pp.is_none() => {
            let stored = |n: usize| Some(n / cfg.sublayers());
            p.first_last()
                .map_or((None, None), |(f, l)| (stored(f), stored(l)))
        }
        _ => o.first_last,
    };
    let ep = o.ep.or(src_par.map(|p| p.ep)).unwrap_or(1);
    // A source's experts split over fewer ranks than its TP stay so where the new TP allows.
    let narrow = src_par.filter(|p| p.etp < p.tp && !p.tp_extend && tp.is_multiple_of(p.etp));
    let etp = o.etp.unwrap_or(narrow.map_or(tp, |p| p.etp));
    let extend = o.tp_extend_ep || (src_par.is_some_and(|p| p.tp_extend) && o.etp.is_none());
    let kept = o.tp.is_none() && o.pp.is_none() && o.vpp.is_none();
    let dualpipev = o.dualpipev || (kept && src_par.is_some_and(|p| p.dualpipev));
    let par = match dualpipev {
        true => Parallel::new(cfg, tp, pp, 1, first_last)?.with_dualpipev(cfg)?,
        false => Parallel::new(cfg, tp, pp, vpp, first_last)?,
    };
    let par = par.with_experts(cfg, (ep, etp))?;
    let par = match extend {
        true => par.with_tp_extend(cfg)?,
        false => par,
    };
    let progress = |total| util::progress_bar(total, ProgressUnit::Bytes, o.progress);
    let padded = par.padded_vocab(cfg.vocab, o.divisible_by);
    let read = &|c: Canon| read_padded(c, padded);
    if o.ckpt_format == CkptFormat::TorchDist {
        let target = DistTarget {
            cfg,
            par: &par,
            divisible_by: o.divisible_by,
            base_args,
            final_dir: &o.output,
            grouped: o.grouped_experts,
        };
        let total = target.total_bytes();
        let pb = progress(total);
        target.write(dir, read, &|n| pb.inc(n))?;
        pb.finish_and_clear();
        return Ok((canonical(cfg).len(), total));
    }
    let target = MegatronTarget {
        cfg,
        par: &par,
        layout: o.layout,
        divisible_by: o.divisible_by,
        base_args,
        grouped: o.grouped_experts,
    };
    let total = target.total_bytes();
    let pb = progress(total);
    target.write(dir, read, &|n| pb.inc(n))?;
    pb.finish_and_clear();
    Ok((canonical(cfg).len(), total))
}

/// A `torch_dist` output is what megatron-core loads: its own layout of multi-latent
/// attention (the default here), the local spec's keys, experts one by one (as GroupedMLP
/// shards its weights too, megatron/core/transformer/moe/experts.py `sharded_state_dict`:
/// `--moe-grouped-gemm` only sets the args' flag); MindSpeed-LLM's and Transformer Engine's
/// layouts are refused by name.
fn torch_dist_layouts(o: &ConvertOptions, cfg: &mut ModelConfig) -> Result<()> {
    if o.to != Format::Megatron {
        bail!("--ckpt-format torch_dist: a Megatron output's format; HF has one");
    }
    let refuse = |what: &str| {
        anyhow!(
            "--ckpt-format torch_dist is written as megatron-core's local spec loads it; {what} \
             is not (write it with --ckpt-format torch)"
        )
    };
    match o.layout {
        KeyLayout::Mcore => {}
        KeyLayout::McoreTe => return Err(refuse("--layout mcore-te (Transformer Engine's)")),
        KeyLayout::Legacy => return Err(refuse("--layout legacy")),
    }
    if o.dualpipev {
        return Err(refuse("--schedules-method dualpipev"));
    }
    if cfg.paired {
        return Err(refuse(
            "LongCat-Flash's layer (MindSpeed-LLM's longcat_spec)",
        ));
    }
    if let Some(l) = o.mla_layout.filter(|&l| l != MlaLayout::Mcore) {
        return Err(refuse(&format!("--mla-layout {}", l.name())));
    }
    if cfg.mtp.is_some_and(|m| m.layout == MtpLayout::Mindspeed) {
        // megatron-core's depths hand on normed states: another model, so never chosen silently
        return Err(refuse(
            "MindSpeed-LLM's multi-token prediction (pass --mtp-layout mcore for megatron-core's)",
        ));
    }
    cfg.mla = cfg.mla.map(|m| MlaLayout::Mcore.apply(m));
    Ok(())
}

fn write_hf(
    o: &ConvertOptions,
    cfg: &ModelConfig,
    read: &(dyn Fn(Canon) -> Result<Tensor> + Sync),
    dir: &Path,
) -> Result<(usize, u64)> {
    cfg.check_hf()?;
    // Each canonical tensor, then each copy the depths of multi-token prediction carry.
    let planned = |c: Canon, parts: Vec<(String, Vec<usize>)>| -> Vec<Planned> {
        (parts.into_iter())
            .map(|(name, shape)| Planned {
                name,
                dtype: c.role.dtype(cfg),
                shape,
            })
            .collect()
    };
    let mut canon = canonical(cfg);
    let mut groups: Vec<Vec<Planned>> = (canon.iter())
        .map(|&c| planned(c, hf_parts(cfg, c)))
        .collect();
    let copies_from = canon.len();
    for (name, c) in transform::hf_copies(cfg) {
        groups.push(planned(c, vec![(name, canonical_shape(cfg, c.role))]));
        canon.push(c);
    }
    let shards = hf::plan_shards(&groups, o.max_shard_bytes);
    let total: u64 = groups
        .iter()
        .flatten()
        .map(|p| (p.shape.iter().product::<usize>() * p.dtype.size()) as u64)
        .sum();
    let pb = util::progress_bar(total, ProgressUnit::Bytes, o.progress);
    let n = shards.len();
    let written: Vec<(String, Vec<String>)> = shards
        .par_iter()
        .enumerate()
        .map(|(i, members)| {
            let name = hf::shard_name(i, n);
            let planned: Vec<&Vec<Planned>> = members.iter().map(|&g| &groups[g]).collect();
            hf::write_safetensors(&dir.join(&name), &planned, |g| {
                let c = canon[members[g]];
                let parts = match members[g] < copies_from {
                    true => to_hf(cfg, c, read(c)?),
                    false => vec![read(c)?],
                };
                pb.inc(parts.iter().map(|t| t.data.len() as u64).sum());
                Ok(parts)
            })?;
            let names = planned
                .iter()
                .flat_map(|g| g.iter().map(|p| p.name.clone()));
            Ok((name, names.collect()))
        })
        .collect::<Result<_>>()?;
    pb.finish_and_clear();
    if n > 1 {
        let index = hf::index_json(&written, total);
        std::fs::write(
            dir.join("model.safetensors.index.json"),
            serde_json::to_string_pretty(&index)? + "\n",
        )?;
    }
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&cfg.to_hf())? + "\n",
    )?;
    Ok((canon.len(), total))
}

/// Parse a size like `5GB`, `500MB`, `2GiB` or a plain byte count.
pub fn parse_size(s: &str) -> Result<u64> {
    let s = s.trim();
    let split = s
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| anyhow!("bad size {s:?} (use e.g. 5GB, 500MB)"))?;
    let mult = match unit.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 1.0,
        "KB" => 1e3,
        "MB" => 1e6,
        "GB" => 1e9,
        "KIB" => 1024.0,
        "MIB" => 1024.0 * 1024.0,
        "GIB" => 1024.0 * 1024.0 * 1024.0,
        other => bail!("bad size unit {other:?} in {s:?}"),
    };
    Ok((n * mult) as u64)
}
