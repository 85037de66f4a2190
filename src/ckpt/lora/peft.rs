//! PEFT adapters on disk (`docs/checkpoints.md` §6.1): `adapter_config.json` and
//! `adapter_model.safetensors` (or `adapter_model.bin`, through the safe reader), keys
//! `base_model.model.<module>.lora_A.weight` etc. with the adapter name removed.

use super::{
    lora_scale, parse_lora_key, Edit, Factor, FactorKind, MergePlan, Replace, Store, Term,
};
use crate::arch::roles::{canonical, Canon, Role};
use crate::arch::ModelConfig;
use crate::ckpt::config::positive;
use crate::ckpt::hf::HfWeights;
use crate::ckpt::transform::{hf_parts, hf_row_blocks};
use anyhow::{anyhow, bail, Context, Result};
use regex::Regex;
use serde_json::Value as Json;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

/// The adapter's configuration file.
pub const CONFIG: &str = "adapter_config.json";
/// Prefix of every key PEFT saves for a causal LM.
const PREFIX: &str = "base_model.model.";
const WEIGHT_FILES: [&str; 2] = ["adapter_model.safetensors", "adapter_model.bin"];

/// The LoRA factors saved for one wrapped module (full adapter keys).
#[derive(Default, Debug)]
struct Module {
    a: Option<String>,
    b: Option<String>,
    b_bias: Option<String>,
    embedding: bool,
}

/// A PEFT LoRA adapter.
pub struct PeftAdapter {
    config_path: PathBuf,
    weights_path: PathBuf,
    config: Json,
    r: usize,
    alpha: f64,
    rslora: bool,
    rank_pattern: Vec<(Regex, String, usize)>,
    alpha_pattern: Vec<(Regex, String, f64)>,
    weights: HfWeights,
    /// Module path (prefix removed) → its factors.
    modules: BTreeMap<String, Module>,
    /// HF tensor name → adapter key of a tensor saved whole (`modules_to_save`, trained biases).
    replaced: BTreeMap<String, String>,
}

/// PEFT's pattern match (`utils/other.py: get_pattern_key`): `(.*\.)?(PATTERN)$` from the start.
fn pattern<T>(
    config: &Json,
    field: &str,
    value: impl Fn(&Json) -> Option<T>,
) -> Result<Vec<(Regex, String, T)>> {
    let Some(map) = config.get(field).and_then(Json::as_object) else {
        return Ok(Vec::new());
    };
    map.iter()
        .map(|(k, v)| {
            let re = Regex::new(&format!(r"^(.*\.)?({k})$"))
                .map_err(|e| anyhow!("{field}: pattern {k:?} is not a valid regex: {e}"))?;
            let v = value(v).ok_or_else(|| {
                anyhow!("{field}: {k:?} is {v}; it must be a number above 0 (an integer for ranks)")
            })?;
            Ok((re, k.clone(), v))
        })
        .collect()
}

fn refuse_unsupported(config: &Json) -> Result<()> {
    let truthy = |k: &str| match config.get(k) {
        None | Some(Json::Null) | Some(Json::Bool(false)) => false,
        Some(Json::Array(a)) => !a.is_empty(),
        Some(Json::Object(o)) => !o.is_empty(),
        Some(_) => true,
    };
    match config.get("peft_type").and_then(Json::as_str) {
        Some("LORA") => {}
        Some(other) => bail!("peft_type is {other:?}; only LORA adapters can be merged"),
        None => bail!("missing \"peft_type\" (expected \"LORA\")"),
    }
    if truthy("use_dora") {
        bail!(
            "DoRA adapters (use_dora: true) are not supported: their merge rescales every row \
             by a learned magnitude, which mindkit does not implement"
        );
    }
    for (field, what) in [
        ("trainable_token_indices", "trainable token deltas"),
        ("layer_replication", "layer replication"),
        ("target_parameters", "LoRA on raw parameters"),
    ] {
        if truthy(field) {
            bail!("{field} is set: adapters with {what} are not supported");
        }
    }
    Ok(())
}

impl PeftAdapter {
    /// Read `adapter_config.json` and index the adapter's tensors.
    pub fn open(dir: &Path) -> Result<Self> {
        let config_path = dir.join(CONFIG);
        let text = std::fs::read_to_string(&config_path)
            .with_context(|| format!("reading {}", config_path.display()))?;
        let config: Json = serde_json::from_str(&text)
            .with_context(|| format!("{}: not valid JSON", config_path.display()))?;
        let at_config = |e: anyhow::Error| anyhow!("{}: {e}", config_path.display());
        refuse_unsupported(&config).map_err(at_config)?;
        // `fan_in_fan_out` is not read: it concerns GPT-2's Conv1D weights, and for the
        // nn.Linear layers of every supported family peft resets it to false itself
        // (`dispatch_default` warns "Setting fan_in_fan_out to False").
        let need = |k: &str| {
            config
                .get(k)
                .and_then(Json::as_f64)
                .ok_or_else(|| anyhow!("{}: missing or non-numeric {k:?}", config_path.display()))
        };
        let r = need("r")?;
        let alpha = positive("lora_alpha", need("lora_alpha")?).map_err(|e| at_config(e.into()))?;
        if !(r >= 1.0 && r.fract() == 0.0 && r <= u32::MAX as f64) {
            bail!(
                "{}: \"r\" is {r}; it must be a positive integer",
                config_path.display()
            );
        }
        if config.get("target_modules").is_none_or(Json::is_null) {
            bail!("{}: missing \"target_modules\"", config_path.display());
        }
        let rank_pattern = pattern(&config, "rank_pattern", |v| {
            v.as_u64().filter(|&n| n >= 1).map(|n| n as usize)
        })
        .map_err(at_config)?;
        let alpha_pattern = pattern(&config, "alpha_pattern", |v| {
            v.as_f64().filter(|a| positive("", *a).is_ok())
        })
        .map_err(at_config)?;
        let weights_path = WEIGHT_FILES
            .iter()
            .map(|f| dir.join(f))
            .find(|p| p.is_file())
            .ok_or_else(|| {
                anyhow!(
                    "{}: no {} (the adapter weights)",
                    dir.display(),
                    WEIGHT_FILES.join(" or ")
                )
            })?;
        let weights = HfWeights::open_files(vec![weights_path.clone()])?;
        let mut a = PeftAdapter {
            rslora: config.get("use_rslora").and_then(Json::as_bool) == Some(true),
            config_path,
            weights_path,
            config,
            r: r as usize,
            alpha,
            rank_pattern,
            alpha_pattern,
            weights,
            modules: BTreeMap::new(),
            replaced: BTreeMap::new(),
        };
        a.index_keys()?;
        Ok(a)
    }

    fn index_keys(&mut self) -> Result<()> {
        let file = self.weights_path.display().to_string();
        let mut adapter_names = BTreeSet::new();
        for key in self.weights.entries().keys() {
            let Some(name) = key.strip_prefix(PREFIX) else {
                bail!("{file}: tensor {key} does not start with {PREFIX:?} as PEFT saves them");
            };
            let Some((module, kind, adapter)) = parse_lora_key(name) else {
                // A whole tensor: `modules_to_save`, a trained bias, or the embedding PEFT saves
                // (as `….base_layer.weight`) when embeddings are adapted.
                let name = name.replace(".base_layer.", ".");
                self.replaced.insert(name, key.clone());
                continue;
            };
            adapter_names.extend(adapter);
            let m = self.modules.entry(module).or_default();
            let slot = match kind {
                FactorKind::A => &mut m.a,
                FactorKind::B => &mut m.b,
                FactorKind::BBias => &mut m.b_bias,
                FactorKind::EmbeddingA => {
                    m.embedding = true;
                    &mut m.a
                }
                FactorKind::EmbeddingB => {
                    m.embedding = true;
                    &mut m.b
                }
                FactorKind::Magnitude => bail!(
                    "{file}: tensor {key} is a DoRA magnitude vector; DoRA adapters are not supported"
                ),
                FactorKind::ExtraState => continue,
            };
            *slot = Some(key.clone());
        }
        if adapter_names.len() > 1 {
            bail!("{file}: tensors of several adapters ({adapter_names:?}); save one adapter per directory");
        }
        for (name, m) in &self.modules {
            if m.a.is_none() || m.b.is_none() {
                let (has, lacks) = if m.a.is_none() {
                    ("lora_B", "lora_A")
                } else {
                    ("lora_A", "lora_B")
                };
                bail!("{file}: module {name} has {has} but no {lacks}");
            }
        }
        Ok(())
    }

    /// (rank, alpha) of a module after `rank_pattern` / `alpha_pattern`.
    fn rank_alpha(&self, module: &str) -> (usize, f64) {
        let r = self
            .rank_pattern
            .iter()
            .find(|(re, _, _)| re.is_match(module))
            .map_or(self.r, |p| p.2);
        let alpha = self
            .alpha_pattern
            .iter()
            .find(|(re, _, _)| re.is_match(module))
            .map_or(self.alpha, |p| p.2);
        (r, alpha)
    }

    /// `lora_alpha / r`, or `lora_alpha / √r` with rsLoRA.
    fn scale(&self, module: &str) -> Result<f32> {
        let (r, alpha) = self.rank_alpha(module);
        let r = r as f64;
        let divisor = if self.rslora { r.sqrt() } else { r };
        lora_scale(alpha, divisor, module).with_context(|| self.config_path.display().to_string())
    }

    /// The base model the adapter was trained on (`base_model_name_or_path`), if recorded.
    pub fn base_model(&self) -> Option<&str> {
        (self.config.get("base_model_name_or_path"))
            .and_then(Json::as_str)
            .filter(|s| !s.is_empty())
    }

    fn shape(&self, key: &str) -> &[usize] {
        &self.weights.entries()[key].shape
    }

    /// Map every adapter tensor onto the base model's canonical tensors, checking shapes.
    pub(super) fn plan(self, cfg: &ModelConfig) -> Result<MergePlan> {
        let file = self.weights_path.display().to_string();
        // HF tensor name → (canonical tensor, part index, shape).
        let mut names: HashMap<String, (Canon, usize, Vec<usize>)> = HashMap::new();
        for c in canonical(cfg) {
            for (i, (name, shape)) in hf_parts(cfg, c).into_iter().enumerate() {
                names.insert(name, (c, i, shape));
            }
        }
        if cfg.tied {
            // lm_head is the embedding in a tied model: adapting one adapts both.
            let emb = names["model.embed_tokens.weight"].clone();
            names.insert("lm_head.weight".into(), emb);
        }
        let target = |key: &str, tensor: &str| {
            names.get(tensor).cloned().ok_or_else(|| {
                anyhow!(
                    "{file}: tensor {key} targets {tensor}, which is not a tensor of this {} \
                     model (unknown target module)",
                    cfg.family.name
                )
            })
        };
        let mut edits: HashMap<Canon, Edit> = HashMap::new();
        for (module, m) in &self.modules {
            let (a_key, b_key) = (m.a.clone().expect("checked"), m.b.clone().expect("checked"));
            let (c, part, shape) = target(&b_key, &format!("{module}.weight"))?;
            let (r, _) = self.rank_alpha(module);
            let (a_shape, b_shape) = (self.shape(&a_key), self.shape(&b_key));
            // Linear: A [r, in], B [out, r]. Embedding: A [r, vocab], B [hidden, r] (transposed).
            let (rows, cols) = if m.embedding {
                (shape[1], shape[0])
            } else {
                (shape[0], shape[1])
            };
            if a_shape != [r, cols] || b_shape != [rows, r] {
                bail!(
                    "{file}: {a_key} {a_shape:?} and {b_key} {b_shape:?} do not fit the base \
                     tensor {module}.weight {shape:?} with rank {r} (adapter_config.json r, \
                     rank_pattern); expected [{r}, {cols}] and [{rows}, {r}]",
                );
            }
            let scale = self.scale(module)?;
            let blocks = hf_row_blocks(cfg, c)[part].clone();
            let edit = edits.entry(c).or_default();
            edit.terms.push(Term {
                b: Factor::Peft(b_key.clone()),
                a: Factor::Peft(a_key),
                scale,
                transposed: m.embedding,
                blocks,
            });
            if let Some(bias_key) = &m.b_bias {
                let (c, part, shape) = target(bias_key, &format!("{module}.bias"))?;
                if self.shape(bias_key) != shape.as_slice() {
                    bail!(
                        "{file}: {bias_key} has shape {:?}, the base bias {module}.bias {shape:?}",
                        self.shape(bias_key)
                    );
                }
                edits.entry(c).or_default().terms.push(Term {
                    b: Factor::Peft(bias_key.clone()),
                    a: Factor::One,
                    scale,
                    transposed: false,
                    blocks: hf_row_blocks(cfg, c)[part].clone(),
                });
            }
        }
        for (name, key) in &self.replaced {
            let (c, part, shape) = target(key, name)?;
            if self.shape(key) != shape.as_slice() {
                bail!(
                    "{file}: {key} has shape {:?}, the base tensor {name} {shape:?}",
                    self.shape(key)
                );
            }
            edits.entry(c).or_default().replace.push(Replace {
                tensor: Factor::Peft(key.clone()),
                blocks: hf_row_blocks(cfg, c)[part].clone(),
            });
        }
        if cfg.tied
            && edits.contains_key(&Canon {
                role: Role::Output,
                layer: None,
            })
        {
            bail!("internal: an edit of the output layer of a tied model");
        }
        Ok(MergePlan {
            store: Store::Peft(self.weights),
            edits,
        })
    }

    /// `mindkit lora info` text.
    pub(super) fn describe(&self) -> String {
        let mut out = format!(
            "format: PEFT LoRA adapter ({})\nconfig: {}\n",
            self.weights_path.display(),
            self.config_path.display()
        );
        if let Some(base) = self.base_model() {
            out += &format!("base model: {base}\n");
        }
        let rule = if self.rslora {
            "lora_alpha/√r (rsLoRA)"
        } else {
            "lora_alpha/r"
        };
        let scale = match self.scale("") {
            Ok(s) => s.to_string(),
            Err(e) => format!("unusable ({e:#})"),
        };
        out += &format!(
            "r: {}, lora_alpha: {}, scale {rule} = {scale}\n",
            self.r, self.alpha
        );
        let ranks: Vec<String> = (self.rank_pattern.iter())
            .map(|p| format!("{}: {}", p.1, p.2))
            .collect();
        let alphas: Vec<String> = (self.alpha_pattern.iter())
            .map(|p| format!("{}: {}", p.1, p.2))
            .collect();
        for (name, p) in [("rank_pattern", ranks), ("alpha_pattern", alphas)] {
            if !p.is_empty() {
                out += &format!("{name}: {}\n", p.join(", "));
            }
        }
        let targets = match self.config.get("target_modules") {
            Some(Json::Array(list)) => list
                .iter()
                .filter_map(Json::as_str)
                .collect::<Vec<_>>()
                .join(", "),
            Some(Json::String(re)) => format!("regex {re:?}"),
            _ => "?".into(),
        };
        out += &format!("target_modules: {targets}\n");
        let mut kinds: BTreeMap<String, usize> = BTreeMap::new();
        let mut layers = BTreeSet::new();
        for m in self.modules.keys() {
            let kind = m.rsplit('.').next().unwrap_or(m);
            *kinds.entry(kind.to_string()).or_default() += 1;
            layers.extend(crate::ckpt::layout::layer_index(m));
        }
        let kinds: Vec<String> = kinds.iter().map(|(k, n)| format!("{k} ×{n}")).collect();
        out += &format!(
            "adapted modules: {} ({}) in {} layers\n",
            self.modules.len(),
            kinds.join(", "),
            layers.len()
        );
        if !self.replaced.is_empty() {
            let names: Vec<&str> = self.replaced.keys().map(String::as_str).collect();
            out += &format!(
                "tensors saved whole (replace the base's): {}\n",
                names.join(", ")
            );
        }
        let numel = |k: &String| self.weights.entries()[k].shape.iter().product::<usize>();
        let whole: usize = self.replaced.values().map(numel).sum();
        let total: usize = self.weights.entries().keys().map(numel).sum();
        let dtypes: BTreeSet<&str> = (self.weights.entries().values())
            .map(|e| e.dtype.torch_name())
            .collect();
        out += &format!(
            "parameters: {} LoRA + {whole} in whole tensors ({})\n",
            total - whole,
            dtypes.into_iter().collect::<Vec<_>>().join(", ")
        );
        out
    }
}
