//! Megatron's parallel layout (which global layers each pipeline stage and virtual chunk holds)
//! and its state-dict key names for the three model layouts: mcore local spec (MindSpeed-LLM),
//! mcore Transformer-Engine spec, and the legacy nested model (`docs/checkpoints.md` §2.2, §2.3,
//! §3.6).

use crate::arch::roles::{Canon, Role};
use crate::arch::{ModelConfig, Mtp, MtpLayout};
use anyhow::{bail, Result};
use std::ops::Range;

/// The key layout of a Megatron model state dict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum KeyLayout {
    /// megatron-core, local spec (`--transformer-impl local`, as MindSpeed-LLM writes).
    Mcore,
    /// megatron-core, Transformer-Engine spec (fused norm names, `_extra_state`).
    McoreTe,
    /// Legacy `megatron/legacy/model` nested dicts.
    Legacy,
}

impl KeyLayout {
    /// The CLI spelling.
    pub fn name(self) -> &'static str {
        match self {
            KeyLayout::Mcore => "mcore",
            KeyLayout::McoreTe => "mcore-te",
            KeyLayout::Legacy => "legacy",
        }
    }
}

/// Why a model whose q/k norms span all heads has no tensor-parallel layout.
pub const PER_LAYER_NORMS_UNDER_TP: &str = "this model's q/k norms span all attention heads \
    (MindSpeed-LLM's MiniMax spec), which tensor parallelism would split; MindSpeed-LLM refuses \
    TP > 1 for it (mindspeed_llm/tasks/models/spec/minimax_spec.py)";

/// Whether `layout` can hold `cfg`: multi-latent attention only in megatron-core's local
/// spec (the Transformer-Engine spec fuses its latents' norms, keeps the down projections
/// whole and its input norm apart; not built yet).
pub fn check_layout(layout: KeyLayout, cfg: &ModelConfig) -> Result<()> {
    let what = match (cfg.mla, cfg.mtp) {
        _ if layout == KeyLayout::Mcore => return Ok(()),
        (Some(_), _) => "multi-latent attention",
        // TE's MTP adds extra states to its norms and projection; the legacy model has none
        (_, Some(_)) => "multi-token prediction",
        (None, None) => return Ok(()),
    };
    bail!(
        "{what} is written in the megatron-core local layout (--layout mcore) only; the {} \
         layout of it is not built",
        layout.name()
    )
}

/// How layers are spread over TP × PP (× virtual chunks).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Parallel {
    /// Tensor-parallel size.
    pub tp: usize,
    /// Pipeline stages.
    pub pp: usize,
    /// Virtual chunks per stage (1 = no virtual pipeline).
    pub vpp: usize,
    /// Layers per stage.
    pub stage_layers: Vec<usize>,
    /// Expert-parallel size: the routed experts of each MoE layer split into this many
    /// consecutive blocks (`mp_rank_TT[_PPP]_EEE` directories), the rest replicated.
    pub ep: usize,
    /// Expert tensor-parallel size: the ranks each routed expert is split over, a divisor of
    /// TP (1: whole experts, `--expert-tensor-parallel-size 1`; shared experts follow TP).
    pub etp: usize,
    /// MindSpeed-LLM's `--moe-tp-extend-ep`: whole experts, `E / (EP·TP)` in every file of
    /// the TP × EP grid, block `e·TP + t` in `mp_rank_tt_eee` (mindspeed_llm/core/transformer/
    /// moe/moe_layer.py `local_expert_indices_offset`).
    pub tp_extend: bool,
    /// MindSpeed's `--schedules-method dualpipev`: two chunks per stage in a V, stage `p`
    /// holding the `p`-th and the `(2·PP − 1 − p)`-th of `2·PP` equal blocks of layers, so the
    /// first stage holds the embedding and also the last block with the final norm, the output
    /// layer and multi-token prediction (mindspeed/core/pipeline_parallel/dualpipev/
    /// dualpipev_chunks.py `get_model`, `get_transformer_layer_offset`).
    pub dualpipev: bool,
}

/// The `(tensor-parallel, expert-parallel)` rank of each file of a pipeline stage, in file
/// order, for TP × EP with the routed experts split over `etp` ranks (`--moe-tp-extend-ep`
/// fills every pair as ETP = TP does). Megatron's torch format saves from expert-data-parallel
/// rank 0 only (megatron/training/checkpointing.py), the ranks `r < ETP × EP` of the expert
/// view `etp-ep-edp` (megatron/core/parallel_state.py `RankGenerator`), each into the file of
/// its dense TP rank `r mod TP` and its expert-parallel rank `(r / ETP) mod EP`, holding
/// expert shard `r mod ETP` (`= r mod TP mod ETP`, ETP dividing TP). Under TP > ETP × EP
/// the ranks up to TP write the dense shards the others leave, as MindSpeed-LLM's converters
/// list them (mindspeed_llm/tasks/checkpoint/convert_mg2hf.py `get_etp_valid_ckpts_list`).
/// With ETP = TP every pair `(r mod TP, r / TP)`; with whole experts `(r mod TP, r mod EP)`.
pub fn rank_grid(tp: usize, ep: usize, etp: usize) -> Vec<(usize, usize)> {
    (0..tp.max(etp * ep))
        .map(|r| (r % tp, r / etp % ep))
        .collect()
}

/// Why TP × EP with the routed experts split over `etp` ranks is no layout of Megatron's
/// torch-format files ([`rank_grid`]); `None` when it is one. Past TP, ETP ranks would write
/// one file twice; TP and ETP × EP not dividing one another leaves shards no rank saves.
pub fn expert_grid_fault(tp: usize, ep: usize, etp: usize) -> Option<String> {
    if etp == 0 || !tp.is_multiple_of(etp) {
        return Some(format!(
            "expert tensor parallelism {etp} does not divide TP {tp}: Megatron's torch-format \
             files are named by TP and EP rank only, so its expert shards would not all have a file"
        ));
    }
    let ranks = etp * ep;
    (!ranks.is_multiple_of(tp) && !tp.is_multiple_of(ranks)).then(|| {
        format!(
            "TP {tp} and ETP {etp} × EP {ep} do not divide one another: Megatron's files of \
             such a layout leave shards no rank saves"
        )
    })
}

/// The expert block file `(t, e)` holds of TP × EP files, and how many there are: block `e` of
/// EP, or with MindSpeed-LLM's `--moe-tp-extend-ep` block `e·TP + t` of TP·EP
/// ([`Parallel::expert_block`]).
pub fn expert_block_of(
    (tp, ep, tp_extend): (usize, usize, bool),
    (t, e): (usize, usize),
) -> (usize, usize) {
    match tp_extend {
        true => (e * tp + t, ep * tp),
        false => (e, ep),
    }
}

impl Parallel {
    /// A layout for `cfg`, checked: heads, groups, ffn divisible by TP; layers by PP × VPP, or
    /// `first`/`last` stage layer counts with the rest spread evenly (Megatron's
    /// `--decoder-first/last-pipeline-num-layers`, either or both, counting layers as files
    /// count them: a [`ModelConfig::paired`] model's pairs).
    pub fn new(
        cfg: &ModelConfig,
        tp: usize,
        pp: usize,
        vpp: usize,
        (first, last): (Option<usize>, Option<usize>),
    ) -> Result<Self> {
        let (first, last) = (
            first.map(|f| f * cfg.sublayers()),
            last.map(|l| l * cfg.sublayers()),
        );
        if tp == 0 || pp == 0 || vpp == 0 {
            bail!("--tp, --pp and --vpp must be at least 1");
        }
        if cfg.qk_norm_per_layer && tp > 1 {
            bail!("--tp {tp}: {PER_LAYER_NORMS_UNDER_TP}");
        }
        let mut split = vec![
            ("num_attention_heads", cfg.heads),
            ("num_key_value_heads (query groups)", cfg.groups),
            ("intermediate_size", cfg.ffn),
        ];
        if let Some(m) = &cfg.moe {
            split.extend(
                m.shared_ffn
                    .map(|f| ("the shared experts' intermediate size", f)),
            );
        }
        if let Some(m) = cfg.mla.filter(|m| m.fused_down) {
            if m.q_lora_rank.is_none() && tp > 1 {
                // its linear_qkv holds every head's query, which its attention would take as
                // this rank's heads (multi_latent_attention.py `mla_naive_attention`)
                bail!("--tp {tp}: MindSpeed-LLM's deepseek_spec without a query latent (no q_lora_rank) runs on one tensor-parallel rank only");
            }
        } else if let Some(m) = &cfg.mla {
            // megatron-core's local spec splits the down projections' rows too
            split.push((
                "the key-value latent and rotated key part (kv_lora_rank + qk_rope_head_dim)",
                m.kv_lora_rank + m.rope_dim,
            ));
            split.extend(m.q_lora_rank.map(|r| ("q_lora_rank", r)));
        }
        for &(what, n) in &split {
            if n % tp != 0 {
                let ok: Vec<String> = (1..=cfg.groups)
                    .filter(|&d| split.iter().all(|(_, n)| n.is_multiple_of(d)))
                    .map(|d| d.to_string())
                    .collect();
                bail!(
                    "--tp {tp} does not divide {what} = {n}; TP sizes that work: {}",
                    ok.join(", ")
                );
            }
        }
        if cfg.mtp.is_some() && cfg.tied && pp > 1 {
            // megatron-core keeps the shared weight in the last stage's embedding copy then,
            // its output layer without one (language_module.py): not built
            bail!(
                "--pp {pp}: multi-token prediction with tied embeddings over several pipeline \
                 stages is not built (untie them, or use one stage)"
            );
        }
        let l = cfg.layers;
        let stage_layers = if first.is_none() && last.is_none() {
            if !l.is_multiple_of(pp * vpp) {
                let divisors: Vec<String> = (1..=l)
                    .filter(|d| l.is_multiple_of(*d))
                    .map(|d| d.to_string())
                    .collect();
                bail!(
                    "num_layers {l} is not divisible by --pp {pp} × --vpp {vpp}; \
                     pp × vpp must divide {l} (one of: {})",
                    divisors.join(", ")
                );
            }
            vec![l / pp; pp]
        } else {
            uneven_stages(l, pp, vpp, first, last)?
        };
        Ok(Parallel {
            tp,
            pp,
            vpp,
            stage_layers,
            ep: 1,
            etp: tp,
            tp_extend: false,
            dualpipev: false,
        })
    }

    /// The layout in DualPipeV's V of chunks ([`Parallel::dualpipev`]), checked as MindSpeed's
    /// dualpipev_feature.py checks it: several even stages and no virtual pipeline of its own,
    /// every stage's layers two equal chunks, the output layer untied.
    pub fn with_dualpipev(mut self, cfg: &ModelConfig) -> Result<Self> {
        let (pp, l) = (self.pp, cfg.layers);
        if pp < 2 {
            bail!("--schedules-method dualpipev: needs a pipeline of 2 or more stages (MindSpeed refuses it on one)");
        }
        if self.vpp > 1 || self.first_last().is_some() {
            bail!("--schedules-method dualpipev lays out its own two chunks per stage: not with a virtual pipeline or uneven stages");
        }
        if !l.is_multiple_of(2 * pp) {
            bail!("--schedules-method dualpipev: num_layers {l} does not split into 2 × {pp} equal chunks");
        }
        if cfg.tied {
            bail!("--schedules-method dualpipev needs the output layer untied from the embedding (MindSpeed refuses tied ones)");
        }
        self.vpp = 2;
        self.dualpipev = true;
        Ok(self)
    }

    /// The stage and chunk holding the final norm and the output layer (and multi-token
    /// prediction): the last stage's last chunk, or DualPipeV's first stage's second.
    pub fn last_chunk(&self) -> (usize, usize) {
        match self.dualpipev {
            true => (0, 1),
            false => (self.pp - 1, self.vpp - 1),
        }
    }

    /// Whether chunk `v` of stage `p` is the model's first (it holds the embedding) and its
    /// last ([`Parallel::last_chunk`]).
    pub fn chunk_ends(&self, p: usize, v: usize) -> (bool, bool) {
        ((p, v) == (0, 0), (p, v) == self.last_chunk())
    }

    /// The layout with the routed experts split over `ep` expert-parallel ranks and each over
    /// `etp` tensor-parallel ranks (checked: the experts divide evenly, their intermediate
    /// size by ETP, and the files make a layout Megatron writes, [`expert_grid_fault`]; a
    /// dense model takes only ETP = TP).
    pub fn with_experts(mut self, cfg: &ModelConfig, (ep, etp): (usize, usize)) -> Result<Self> {
        let experts = cfg.moe.as_ref().map_or(1, |m| m.experts);
        if ep == 0 || !experts.is_multiple_of(ep) {
            bail!(
                "--ep {ep} does not divide the {experts} routed experts{}",
                if cfg.moe.is_none() {
                    " (a dense model has no experts to split)"
                } else {
                    ""
                }
            );
        }
        let tp = self.tp;
        if etp != tp && cfg.moe.is_none() {
            bail!("expert tensor parallelism {etp} under TP {tp}: a dense model has no experts");
        }
        if let Some(fault) = expert_grid_fault(tp, ep, etp) {
            bail!("{fault}");
        }
        if let Some(m) = &cfg.moe {
            if !m.ffn.is_multiple_of(etp) {
                bail!(
                    "expert tensor parallelism {etp} does not divide the experts' intermediate \
                     size {}",
                    m.ffn
                );
            }
        }
        self.ep = ep;
        self.etp = etp;
        Ok(self)
    }

    /// The layout with MindSpeed-LLM's `--moe-tp-extend-ep` (no change at TP 1): the experts
    /// whole and spread over the TP × EP ranks (checked: they divide evenly).
    pub fn with_tp_extend(mut self, cfg: &ModelConfig) -> Result<Self> {
        let Some(m) = cfg.moe.as_ref().filter(|_| self.tp > 1) else {
            return Ok(self);
        };
        let ranks = self.ep * self.tp;
        if self.etp != self.tp || !m.experts.is_multiple_of(ranks) {
            bail!(
                "--moe-tp-extend-ep spreads the {} routed experts whole over TP {} × EP {} ranks{}",
                m.experts,
                self.tp,
                self.ep,
                match self.etp != self.tp {
                    true => ": not with expert tensor parallelism 1 (MindSpeed-LLM refuses both)",
                    false => ", which do not divide them",
                }
            );
        }
        self.etp = 1;
        self.tp_extend = true;
        Ok(self)
    }

    /// The expert block a file of TP rank `t` and expert-parallel rank `e` holds, and how many
    /// blocks the experts make.
    pub fn expert_block(&self, rank: (usize, usize)) -> (usize, usize) {
        expert_block_of((self.tp, self.ep, self.tp_extend), rank)
    }

    /// How many expert blocks the files hold ([`Parallel::expert_block`]).
    pub fn expert_blocks(&self) -> usize {
        self.expert_block((0, 0)).1
    }

    /// The ranks a tensor of `role` is split over: ETP for the routed experts, TP otherwise.
    pub fn split_of(&self, role: Role) -> usize {
        match role.expert() {
            Some(_) => self.etp,
            None => self.tp,
        }
    }

    /// The `(tp, ep)` ranks of a stage's files ([`rank_grid`]; every pair with
    /// `--moe-tp-extend-ep`).
    pub fn rank_files(&self) -> Vec<(usize, usize)> {
        let etp = if self.tp_extend { self.tp } else { self.etp };
        rank_grid(self.tp, self.ep, etp)
    }

    /// Global layers of virtual chunk `v` on stage `p`. Virtual stage `v` holds the `v`-th
    /// `1/vpp` of the layers, and each stage a `1/vpp` of its own layers in each (Megatron's
    /// `get_transformer_layer_offset`, even or uneven).
    /// Under DualPipeV chunk 0 counts up from the first layer and chunk 1 down from the last.
    pub fn chunk_layers(&self, p: usize, v: usize) -> Vec<usize> {
        let per_chunk = |q: usize| self.stage_layers[q] / self.vpp;
        let total: usize = self.stage_layers.iter().sum();
        if self.dualpipev {
            let k = per_chunk(p);
            let start = match v {
                0 => p * k,
                _ => total - (p + 1) * k,
            };
            return (start..start + k).collect();
        }
        let start = v * (total / self.vpp) + (0..p).map(per_chunk).sum::<usize>();
        (start..start + per_chunk(p)).collect()
    }

    /// `(first, last)` stage sizes when the split is uneven, in decoder layers (a paired
    /// model's files count half as many).
    pub fn first_last(&self) -> Option<(usize, usize)> {
        let (first, last) = (self.stage_layers[0], self.stage_layers[self.pp - 1]);
        let even = self.stage_layers.iter().all(|&s| s == first);
        (!even).then_some((first, last))
    }

    /// Padded vocabulary: `ceil(vocab / (m·tp)) · m·tp` (Megatron `_vocab_size_with_padding`).
    pub fn padded_vocab(&self, vocab: usize, divisible_by: usize) -> usize {
        let m = divisible_by.max(1) * self.tp;
        vocab.div_ceil(m) * m
    }
}

/// Stage sizes for Megatron's `--decoder-first/last-pipeline-num-layers`: the given counts on
/// the first and/or last stage, the other layers spread evenly over the remaining stages; with
/// virtual chunks every stage's count must split evenly into them (as Megatron requires).
fn uneven_stages(
    layers: usize,
    pp: usize,
    vpp: usize,
    first: Option<usize>,
    last: Option<usize>,
) -> Result<Vec<usize>> {
    if pp < 2 {
        bail!("uneven first/last stage layers need --pp of at least 2");
    }
    let fixed = first.unwrap_or(0) + last.unwrap_or(0);
    let others = pp - usize::from(first.is_some()) - usize::from(last.is_some());
    let each = match (layers.checked_sub(fixed), others) {
        (Some(0), 0) => 0,
        (Some(rest), n) if n > 0 && rest.is_multiple_of(n) => rest / n,
        _ => {
            let given: Vec<String> = [("first", first), ("last", last)]
                .iter()
                .filter_map(|(name, n)| n.map(|n| format!("{name} {n}")))
                .collect();
            bail!(
                "{layers} layers cannot be split as {} with the rest evenly over {others} other \
                 stage(s)",
                given.join(" + ")
            )
        }
    };
    let mut stages = vec![each; pp];
    if let Some(f) = first {
        stages[0] = f;
    }
    if let Some(l) = last {
        stages[pp - 1] = l;
    }
    if let Some((p, n)) = stages
        .iter()
        .enumerate()
        .find(|(_, n)| !n.is_multiple_of(vpp))
    {
        bail!(
            "pipeline stage {p} would hold {n} layers, which --vpp {vpp} does not divide \
             (stages: {stages:?}); with virtual chunks every stage's layer count must be a \
             multiple of --vpp"
        );
    }
    Ok(stages)
}

/// One entry of a model chunk's state dict: its key path (nested dict keys) and the canonical
/// tensor it holds, or `None` for a Transformer-Engine `_extra_state` (written as `None`).
pub type ChunkEntry = (Vec<String>, Option<Canon>);

/// Key path of a layer tensor, `j` the layer's index in its model chunk.
pub fn layer_key(layout: KeyLayout, role: Role, j: usize) -> Vec<String> {
    let mcore = |s: &str| vec![format!("decoder.layers.{j}.{s}")];
    let legacy = |s: &str| {
        vec![
            "language_model".to_string(),
            "encoder".to_string(),
            format!("layers.{j}.{s}"),
        ]
    };
    match (layout, role) {
        (KeyLayout::Legacy, r) => legacy(match r {
            Role::InputNorm => "input_norm.weight",
            Role::InputNormBias => "input_norm.bias",
            Role::Qkv => "self_attention.query_key_value.weight",
            Role::QkvBias => "self_attention.query_key_value.bias",
            Role::Proj => "self_attention.dense.weight",
            Role::ProjBias => "self_attention.dense.bias",
            Role::PostNorm => "post_attention_norm.weight",
            Role::PostNormBias => "post_attention_norm.bias",
            Role::Fc1 | Role::Up => "mlp.dense_h_to_4h.weight",
            _ => "mlp.dense_4h_to_h.weight",
        }),
        (KeyLayout::McoreTe, Role::InputNorm) => {
            mcore("self_attention.linear_qkv.layer_norm_weight")
        }
        (KeyLayout::McoreTe, Role::PostNorm) => mcore("mlp.linear_fc1.layer_norm_weight"),
        (KeyLayout::McoreTe, Role::InputNormBias) => {
            mcore("self_attention.linear_qkv.layer_norm_bias")
        }
        (KeyLayout::McoreTe, Role::PostNormBias) => mcore("mlp.linear_fc1.layer_norm_bias"),
        (_, Role::ExpertFc1(e)) => {
            mcore(&format!("mlp.experts.local_experts.{e}.linear_fc1.weight"))
        }
        (_, Role::ExpertFc2(e)) => {
            mcore(&format!("mlp.experts.local_experts.{e}.linear_fc2.weight"))
        }
        (_, r) => mcore(match r {
            Role::InputNorm => "input_layernorm.weight",
            Role::InputNormBias => "input_layernorm.bias",
            Role::Qkv | Role::QkvDown => "self_attention.linear_qkv.weight",
            Role::QkvBias => "self_attention.linear_qkv.bias",
            Role::Proj => "self_attention.linear_proj.weight",
            Role::ProjBias => "self_attention.linear_proj.bias",
            Role::PostNorm => "pre_mlp_layernorm.weight",
            Role::PostNormBias => "pre_mlp_layernorm.bias",
            Role::QNorm | Role::QLatentNorm => "self_attention.q_layernorm.weight",
            Role::KNorm => "self_attention.k_layernorm.weight",
            Role::KvLatentNorm => "self_attention.kv_layernorm.weight",
            Role::QDown => "self_attention.linear_q_down_proj.weight",
            Role::QUp => "self_attention.linear_q_up_proj.weight",
            Role::QProj => "self_attention.linear_q_proj.weight",
            Role::KvDown => "self_attention.linear_kv_down_proj.weight",
            Role::KvUp => "self_attention.linear_kv_up_proj.weight",
            Role::QUpNope => "self_attention.linear_qk_nope.weight",
            Role::QUpRope => "self_attention.linear_qk_rope.weight",
            Role::KvUpNope => "self_attention.linear_kv_nope.weight",
            Role::ValueUp => "self_attention.linear_v.weight",
            Role::IndexerQUp => "self_attention.dsa_indexer.wq_b.weight",
            Role::IndexerKey => "self_attention.dsa_indexer.wk.weight",
            Role::IndexerKeyNorm => "self_attention.dsa_indexer.k_norm.weight",
            Role::IndexerKeyNormBias => "self_attention.dsa_indexer.k_norm.bias",
            Role::IndexerWeights => "self_attention.dsa_indexer.weights_proj.weight",
            Role::Fc1 | Role::Up => "mlp.linear_fc1.weight",
            Role::Router => "mlp.router.weight",
            Role::ExpertBias => "mlp.router.expert_bias",
            Role::SharedFc1 => "mlp.shared_experts.linear_fc1.weight",
            Role::SharedFc2 => "mlp.shared_experts.linear_fc2.weight",
            Role::SharedGate => "mlp.shared_experts.gate_weight",
            _ => "mlp.linear_fc2.weight",
        }),
    }
}

/// Key path of a non-layer tensor (embedding, final norm, output layer).
pub fn global_key(layout: KeyLayout, role: Role, tied: bool) -> Vec<String> {
    let path = |p: &[&str]| p.iter().map(|s| s.to_string()).collect();
    match (layout, role) {
        (KeyLayout::Legacy, Role::Embedding) => {
            path(&["language_model", "embedding", "word_embeddings", "weight"])
        }
        (KeyLayout::Legacy, Role::FinalNorm) => {
            path(&["language_model", "encoder", "final_norm.weight"])
        }
        (KeyLayout::Legacy, Role::FinalNormBias) => {
            path(&["language_model", "encoder", "final_norm.bias"])
        }
        (KeyLayout::Legacy, Role::OutputBias) => path(&["language_model", "output_layer", "bias"]),
        (KeyLayout::Legacy, _) if tied => path(&["word_embeddings_for_head", "weight"]),
        (KeyLayout::Legacy, _) => path(&["language_model", "output_layer", "weight"]),
        (_, Role::Embedding) => path(&["embedding.word_embeddings.weight"]),
        (_, Role::FinalNorm) => path(&["decoder.final_layernorm.weight"]),
        (_, Role::FinalNormBias) => path(&["decoder.final_layernorm.bias"]),
        (_, Role::OutputBias) => path(&["output_layer.bias"]),
        _ => path(&["output_layer.weight"]),
    }
}

/// Key path of canonical tensor `role` of multi-token prediction depth `k`, in megatron-core's
/// `MultiTokenPredictionBlock` (`mtp.layers.{k}.`, its decoder layer `transformer_layer`) or
/// MindSpeed-LLM's (the depth's final norm in the block's `final_layernorms`).
pub fn mtp_key(layout: KeyLayout, mtp: MtpLayout, role: Role, k: usize) -> Vec<String> {
    let own = |s: &str| vec![format!("mtp.layers.{k}.{s}")];
    match (role, mtp) {
        (Role::MtpEmbedNorm, _) => own("enorm.weight"),
        (Role::MtpHiddenNorm, _) => own("hnorm.weight"),
        (Role::MtpProj, _) => own("eh_proj.weight"),
        (Role::MtpNorm, MtpLayout::Mcore) => own("final_layernorm.weight"),
        (Role::MtpNorm, MtpLayout::Mindspeed) => vec![format!("mtp.final_layernorms.{k}.weight")],
        (r, _) => {
            let (decoder, depth) = (
                format!("decoder.layers.{k}."),
                format!("mtp.layers.{k}.transformer_layer."),
            );
            let keys = layer_key(layout, r, k).into_iter();
            keys.map(|p| p.replacen(&decoder, &depth, 1)).collect()
        }
    }
}

/// Key path of a non-layer tensor of `cfg`'s model: [`global_key`]'s, but the final norm of a
/// model with MindSpeed-LLM's multi-token prediction is GPTModel's own `final_layernorm`
/// (mindspeed_llm/core/models/gpt/gpt_model.py moves it out of the decoder).
pub fn global_key_of(layout: KeyLayout, cfg: &ModelConfig, role: Role) -> Vec<String> {
    match (role, cfg.mtp) {
        (
            Role::FinalNorm,
            Some(Mtp {
                layout: MtpLayout::Mindspeed,
                ..
            }),
        ) => vec!["final_layernorm.weight".into()],
        _ => global_key(layout, role, cfg.tied),
    }
}

/// Key path of a layer tensor of `cfg`'s model, `j` the decoder layer's index in its model
/// chunk: [`layer_key`]'s, but a [`ModelConfig::paired`] model's decoder layers `2i` and
/// `2i + 1` are the sublayers of layer `i` (MindSpeed-LLM's longcat_transformer_layer.py
/// `LongCatFlashTransformerLayer`: `input_layernorm_{s}`, `self_attention_{s}`,
/// `pre_mlp_layernorm_{s}`, `mlps_{s}`; the shortcut experts are the layer's `mlp`).
pub fn layer_key_of(layout: KeyLayout, cfg: &ModelConfig, role: Role, j: usize) -> Vec<String> {
    let key = layer_key(layout, role, j);
    if !cfg.paired {
        return key;
    }
    let (layer, s) = (format!("decoder.layers.{j}."), j % 2);
    let sublayer = |rest: &str| {
        for module in ["input_layernorm", "self_attention", "pre_mlp_layernorm"] {
            if let Some(tail) = rest.strip_prefix(module) {
                return format!("{module}_{s}{tail}");
            }
        }
        match rest.strip_prefix("mlp.linear_fc") {
            Some(tail) => format!("mlps_{s}.linear_fc{tail}"),
            None => rest.to_string(),
        }
    };
    key.into_iter()
        .map(|k| match k.strip_prefix(&layer) {
            Some(rest) => format!("decoder.layers.{}.{}", j / 2, sublayer(rest)),
            None => k,
        })
        .collect()
}

/// TE modules whose `_extra_state` follows a layer role's tensors.
fn te_extra_states(role: Role, cfg: &ModelConfig) -> Vec<String> {
    let last_qkv = if cfg.qkv_bias {
        Role::QkvBias
    } else {
        Role::Qkv
    };
    let last_proj = if cfg.proj_bias {
        Role::ProjBias
    } else {
        Role::Proj
    };
    let names: &[&str] = match role {
        r if r == last_qkv => &["self_attention.linear_qkv._extra_state"],
        r if r == last_proj => &[
            "self_attention.core_attention._extra_state",
            "self_attention.linear_proj._extra_state",
        ],
        // TENorm is Transformer Engine's RMSNorm, a fusible operation with extra state
        // (transformer_engine/pytorch/ops/op.py `get_extra_state`).
        Role::QNorm => &["self_attention.q_layernorm._extra_state"],
        Role::KNorm => &["self_attention.k_layernorm._extra_state"],
        Role::Fc1 | Role::Up => &["mlp.linear_fc1._extra_state"],
        Role::Fc2 => &["mlp.linear_fc2._extra_state"],
        Role::SharedFc1 => &["mlp.shared_experts.linear_fc1._extra_state"],
        Role::SharedFc2 => &["mlp.shared_experts.linear_fc2._extra_state"],
        Role::ExpertFc1(e) | Role::ExpertFc2(e) => {
            let fc = if matches!(role, Role::ExpertFc1(_)) {
                1
            } else {
                2
            };
            return vec![format!(
                "mlp.experts.local_experts.{e}.linear_fc{fc}._extra_state"
            )];
        }
        _ => &[],
    };
    names.iter().map(|s| s.to_string()).collect()
}

/// The state dict of one model chunk, in the order Megatron's modules emit it. `layers` are the
/// chunk's global layers; `first`/`last` say whether it holds the embedding / final norm and
/// output; `pp` decides whether a tied output layer is stored (only when PP > 1); `ep` is the
/// expert block and how many there are ([`Parallel::expert_block`]): the rank holds its block
/// of each MoE layer's routed experts, keyed by their index in the block (`local_experts.N`).
pub fn chunk_entries(
    layout: KeyLayout,
    cfg: &ModelConfig,
    layers: &[usize],
    (first, last): (bool, bool),
    pp: usize,
    (ep_rank, ep): (usize, usize),
) -> Vec<ChunkEntry> {
    let local_experts = cfg.moe.as_ref().map_or(0, |m| m.experts / ep.max(1));
    let experts = ep_rank * local_experts..(ep_rank + 1) * local_experts;
    let mut out: Vec<ChunkEntry> = Vec::new();
    let global = |role| Canon { role, layer: None };
    // the multi-token prediction depths' embedding: a copy on a later stage than the first
    // (megatron-core GPTModel builds one wherever `pre_process or mtp_process`)
    if first || (last && cfg.mtp.is_some()) {
        out.push((
            global_key(layout, Role::Embedding, cfg.tied),
            Some(global(Role::Embedding)),
        ));
    }
    for (j, &l) in layers.iter().enumerate() {
        // An MoE layer's norm is a module of its own even in the TE spec (megatron-core
        // gpt_layer_specs.py: `pre_mlp_layernorm=TENorm` when the MLP is an MoELayer).
        let moe_layer = cfg.moe.as_ref().is_some_and(|m| m.is_moe_layer(l));
        for role in Role::layer_roles(cfg, l) {
            if role.expert().is_some_and(|e| !experts.contains(&e)) {
                continue;
            }
            let canon = Canon {
                role,
                layer: Some(l),
            };
            let key_layout = match (layout, role) {
                (KeyLayout::McoreTe, Role::PostNorm | Role::PostNormBias) if moe_layer => {
                    KeyLayout::Mcore
                }
                _ => layout,
            };
            let key_role = match role {
                Role::ExpertFc1(e) => Role::ExpertFc1(e - experts.start),
                Role::ExpertFc2(e) => Role::ExpertFc2(e - experts.start),
                r => r,
            };
            out.push((layer_key_of(key_layout, cfg, key_role, j), Some(canon)));
            if layout == KeyLayout::McoreTe {
                let mut extra = te_extra_states(key_role, cfg);
                if role == *Role::norm_roles(cfg, Role::PostNorm).last().unwrap() && moe_layer {
                    extra.push("pre_mlp_layernorm._extra_state".into());
                }
                for s in extra {
                    out.push((vec![format!("decoder.layers.{j}.{s}")], None));
                }
            }
        }
    }
    if last {
        let final_norm: Vec<ChunkEntry> = (Role::norm_roles(cfg, Role::FinalNorm).into_iter())
            .map(|r| (global_key_of(layout, cfg, r), Some(global(r))))
            .collect();
        match cfg.mtp {
            Some(mtp) => {
                let (depths, norms) = mtp_entries(cfg, mtp, (layout, experts.clone()));
                if mtp.layout == MtpLayout::Mcore {
                    out.extend(final_norm.clone());
                }
                out.extend(depths);
                out.extend(norms);
                if mtp.layout == MtpLayout::Mindspeed {
                    out.extend(final_norm);
                }
            }
            None => out.extend(final_norm),
        }
        // A tied output layer is only stored on the last stage of a pipeline (it is the
        // embedding, kept in sync by an all-reduce); with one stage it does not exist.
        if !cfg.tied || pp > 1 {
            let source = if cfg.tied {
                Role::Embedding
            } else {
                Role::Output
            };
            out.push((
                global_key(layout, Role::Output, cfg.tied),
                Some(global(source)),
            ));
            if cfg.output_bias {
                let bias = Role::OutputBias;
                out.push((global_key(layout, bias, cfg.tied), Some(global(bias))));
            }
            if layout == KeyLayout::McoreTe {
                out.push((vec!["output_layer._extra_state".into()], None));
            }
        }
    }
    out
}

/// The entries of the multi-token prediction depths, holding the routed `experts` of their
/// MoE layers: each depth's own tensors and decoder layer's, and apart the depths' final norms
/// where MindSpeed-LLM keeps them in the block after every depth (`mtp.final_layernorms`).
fn mtp_entries(
    cfg: &ModelConfig,
    mtp: Mtp,
    (layout, experts): (KeyLayout, Range<usize>),
) -> (Vec<ChunkEntry>, Vec<ChunkEntry>) {
    let (mut depths, mut norms) = (Vec::new(), Vec::new());
    for (k, l) in (cfg.layers..cfg.all_layers()).enumerate() {
        for role in Role::layer_roles(cfg, l) {
            if role.expert().is_some_and(|e| !experts.contains(&e)) {
                continue;
            }
            let key_role = match role {
                Role::ExpertFc1(e) => Role::ExpertFc1(e - experts.start),
                Role::ExpertFc2(e) => Role::ExpertFc2(e - experts.start),
                r => r,
            };
            let entry = (
                mtp_key(layout, mtp.layout, key_role, k),
                Some(Canon {
                    role,
                    layer: Some(l),
                }),
            );
            match role == Role::MtpNorm && mtp.layout == MtpLayout::Mindspeed {
                true => norms.push(entry),
                false => depths.push(entry),
            }
        }
    }
    (depths, norms)
}

/// A routed expert's per-expert key (`…mlp.experts.local_experts.{le}.linear_fc{n}.{rest}`)
/// as `(the layer's experts module, n, le, rest)`; `None` for other keys.
fn expert_key(key: &str) -> Option<(&str, u8, usize, &str)> {
    let (stem, rest) = key.split_once(".mlp.experts.local_experts.")?;
    let (le, rest) = rest.split_once(".linear_fc")?;
    let (n, rest) = rest.split_once('.')?;
    Some((stem, n.parse().ok()?, le.parse().ok()?, rest))
}

/// Whether `key` is a Transformer-Engine grouped expert weight (`…mlp.experts.linear_fc1.weight0`).
pub fn is_te_grouped_key(key: &str) -> bool {
    key.split_once(".mlp.experts.linear_fc")
        .and_then(|(_, rest)| rest.split_once(".weight"))
        .is_some_and(|(_, le)| !le.is_empty() && le.bytes().all(|b| b.is_ascii_digit()))
}

/// A chunk's entries ([`chunk_entries`], Transformer-Engine layout) with the routed experts
/// as megatron-core's `TEGroupedMLP` stores them (`--moe-grouped-gemm` with the TE spec,
/// megatron/core/transformer/moe/experts.py): each layer's experts' linear_fc1 then linear_fc2,
/// one `TEGroupedLinear` each whose weights are `weight{le}` (the local expert's shard, as
/// `local_experts.{le}` holds it) followed by one `_extra_state`
/// (megatron/core/extensions/transformer_engine.py `TEGroupedLinear`: a torch checkpoint keeps
/// one, merged over the GEMMs).
pub fn te_grouped_entries(entries: Vec<ChunkEntry>) -> Vec<ChunkEntry> {
    let mut out: Vec<ChunkEntry> = Vec::with_capacity(entries.len());
    // the current layer's experts: (module, its fc1 weights, its fc2 weights)
    let mut pending: Option<(String, [Vec<ChunkEntry>; 2])> = None;
    let flush = |pending: &mut Option<(String, [Vec<ChunkEntry>; 2])>, out: &mut Vec<_>| {
        if let Some((stem, fcs)) = pending.take() {
            for (n, weights) in (1..).zip(fcs) {
                out.extend(weights);
                let extra = format!("{stem}.mlp.experts.linear_fc{n}._extra_state");
                out.push((vec![extra], None));
            }
        }
    };
    for (path, canon) in entries {
        let key = flat_key(&path);
        let Some((stem, n, le, rest)) = expert_key(&key).filter(|&(_, n, ..)| n == 1 || n == 2)
        else {
            flush(&mut pending, &mut out);
            out.push((path, canon));
            continue;
        };
        if pending.as_ref().is_some_and(|(s, _)| s != stem) {
            flush(&mut pending, &mut out);
        }
        let (_, fcs) = pending.get_or_insert_with(|| (stem.to_string(), Default::default()));
        if let Some(suffix) = rest.strip_prefix("weight") {
            let te = format!("{stem}.mlp.experts.linear_fc{n}.weight{le}{suffix}");
            fcs[usize::from(n) - 1].push((vec![te], canon));
        }
    }
    flush(&mut pending, &mut out);
    out
}

/// Flattened key (`.`-joined path), as keys read back from a file are matched.
pub fn flat_key(path: &[String]) -> String {
    path.join(".")
}

/// Normalise a legacy key read from a file to the current names (`*layernorm` names written
/// before 2023-09 are read as `*norm`).
pub fn normalise_legacy(key: &str) -> String {
    key.replace("layernorm", "norm")
        .replace(".attention.", ".self_attention.")
        .replace("language_model.transformer.", "language_model.encoder.")
}

/// Decoder layer index in a key (`…layers.{j}.…`; `None` for a multi-token prediction depth's
/// `mtp.layers.{k}.…`).
pub fn layer_index(key: &str) -> Option<usize> {
    if key.starts_with("mtp.") {
        return None;
    }
    let rest = &key[key.find("layers.")? + 7..];
    rest.split('.').next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunks(stage_layers: Vec<usize>, vpp: usize) -> Vec<Vec<Vec<usize>>> {
        let pp = stage_layers.len();
        let par = Parallel {
            tp: 1,
            pp,
            vpp,
            stage_layers,
            ep: 1,
            etp: 1,
            tp_extend: false,
            dualpipev: false,
        };
        (0..pp)
            .map(|p| (0..vpp).map(|v| par.chunk_layers(p, v)).collect())
            .collect()
    }

    #[test]
    fn dualpipev_chunks_sit_in_a_v_as_mindspeed_llms_converter_lists_them() {
        // mindspeed_llm/tasks/checkpoint/convert_hf2mg.py's examples: PP 2 → [0 1 6 7 | 2 3 4 5],
        // PP 4 → [0 7 | 1 6 | 2 5 | 3 4]
        let cfg = |layers: usize| {
            use crate::ckpt::torch::pickle::Value;
            let args: Vec<(String, Value)> = [
                ("num_layers", layers),
                ("hidden_size", 64),
                ("num_attention_heads", 4),
                ("ffn_hidden_size", 128),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), Value::Int(v as i64)))
            .chain([(
                "untie_embeddings_and_output_weights".to_string(),
                Value::Bool(true),
            )])
            .collect();
            ModelConfig::from_megatron_args(&args, None, crate::tensor::DType::F32, 256).unwrap()
        };
        let v = |pp: usize| {
            let c = cfg(8);
            let par = Parallel::new(&c, 1, pp, 1, (None, None))
                .and_then(|p| p.with_dualpipev(&c))
                .unwrap();
            let placed: Vec<Vec<usize>> = (0..pp)
                .flat_map(|p| (0..2).map(move |v| (p, v)))
                .map(|(p, v)| par.chunk_layers(p, v))
                .collect();
            (placed, par.last_chunk())
        };
        let flat = |c: Vec<Vec<usize>>| c.concat();
        assert_eq!(flat(v(2).0), [0, 1, 6, 7, 2, 3, 4, 5]);
        assert_eq!(flat(v(4).0), [0, 7, 1, 6, 2, 5, 3, 4]);
        assert_eq!(v(4).1, (0, 1));
        let refused = |layers: usize, pp: usize, tied: bool| {
            let mut c = cfg(layers);
            c.tied = tied;
            Parallel::new(&c, 1, pp, 1, (None, None))
                .and_then(|p| p.with_dualpipev(&c))
                .unwrap_err()
                .to_string()
        };
        assert!(refused(8, 1, false).contains("2 or more stages"));
        assert!(refused(6, 2, false).contains("2 × 2 equal chunks"));
        assert!(refused(8, 2, true).contains("untied"));
    }

    #[test]
    fn te_grouped_keys_are_told_from_their_neighbours() {
        let key = |s: &str| format!("decoder.layers.3.mlp.experts.{s}");
        for (k, te) in [
            ("linear_fc1.weight0", true),
            ("linear_fc2.weight12", true),
            ("linear_fc1.weight", false),
            ("linear_fc1._extra_state", false),
            ("weight1", false),
            ("local_experts.1.linear_fc1.weight", false),
            ("linear_fc1.weight1_lora_a", false),
        ] {
            assert_eq!(is_te_grouped_key(&key(k)), te, "{k}");
        }
    }

    #[test]
    fn chunks_follow_megatrons_layer_offsets() {
        // Even, interleaved: 8 layers, PP 2, VPP 2 (the example in megatron-core).
        assert_eq!(
            chunks(vec![4, 4], 2),
            [[vec![0, 1], vec![4, 5]], [vec![2, 3], vec![6, 7]]]
        );
        // Uneven, not interleaved.
        assert_eq!(chunks(vec![1, 3], 1), [[vec![0]], [vec![1, 2, 3]]]);
        // Uneven and interleaved: 12 layers as 2 + 8 + 2 over PP 3, VPP 2.
        assert_eq!(
            chunks(vec![2, 8, 2], 2),
            [
                [vec![0], vec![6]],
                [vec![1, 2, 3, 4], vec![7, 8, 9, 10]],
                [vec![5], vec![11]],
            ]
        );
    }

    #[test]
    fn uneven_stages_take_first_last_or_both() {
        assert_eq!(
            uneven_stages(12, 3, 2, Some(2), Some(2)).unwrap(),
            [2, 8, 2]
        );
        assert_eq!(uneven_stages(10, 3, 1, Some(2), None).unwrap(), [2, 4, 4]);
        assert_eq!(uneven_stages(10, 3, 1, None, Some(4)).unwrap(), [3, 3, 4]);
        assert_eq!(uneven_stages(4, 2, 1, Some(1), Some(3)).unwrap(), [1, 3]);
        let err = |r: Result<Vec<usize>>| r.unwrap_err().to_string();
        assert!(
            err(uneven_stages(12, 3, 2, Some(3), Some(3))).contains("stage 0 would hold 3 layers"),
            "{}",
            err(uneven_stages(12, 3, 2, Some(3), Some(3)))
        );
        assert!(err(uneven_stages(11, 4, 1, Some(2), Some(2)))
            .contains("11 layers cannot be split as first 2 + last 2 with the rest evenly over 2"));
        assert!(err(uneven_stages(4, 2, 1, Some(1), Some(2))).contains("over 0 other"));
        assert!(err(uneven_stages(4, 1, 1, Some(1), None)).contains("--pp of at least 2"));
    }

    #[test]
    fn expert_files_are_those_the_expert_views_first_ranks_save() {
        // ETP = TP: every pair; ETP 1: (r mod TP, r mod EP); between: (r mod TP, r / ETP mod EP)
        assert_eq!(rank_grid(2, 2, 2), [(0, 0), (1, 0), (0, 1), (1, 1)]);
        assert_eq!(rank_grid(2, 4, 1), [(0, 0), (1, 1), (0, 2), (1, 3)]);
        assert_eq!(rank_grid(4, 2, 2), [(0, 0), (1, 0), (2, 1), (3, 1)]);
        assert_eq!(rank_grid(4, 1, 2), [(0, 0), (1, 0), (2, 0), (3, 0)]);
        assert_eq!(expert_grid_fault(4, 2, 2), None);
        assert_eq!(expert_grid_fault(4, 4, 2), None);
        let fault = |l: (usize, usize, usize)| expert_grid_fault(l.0, l.1, l.2).unwrap();
        assert!(fault((2, 1, 4)).contains("4 does not divide TP 2"));
        assert!(fault((4, 2, 3)).contains("3 does not divide TP 4"));
        assert!(fault((4, 3, 2)).contains("TP 4 and ETP 2 × EP 3 do not divide one another"));
        assert!(fault((2, 3, 1)).contains("TP 2 and ETP 1 × EP 3"));
    }
}
