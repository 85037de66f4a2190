//! `mindkit ckpt info`: what a checkpoint directory holds.

use super::convert::{detect, open_hf, Format};
use super::layout::KeyLayout;
use super::megatron::MegatronCkpt;
use super::torch_dist::{is_torch_dist, TorchDistCkpt};
use crate::arch::family::Family;
use crate::arch::moe::Moe;
use crate::arch::roles::{canonical, canonical_shape};
use crate::arch::{Activation, ModelConfig, MtpLayout};
use anyhow::Result;
use std::fmt::Write;
use std::path::Path;

fn architecture(cfg: &ModelConfig, out: &mut String) {
    let params: usize = canonical(cfg)
        .iter()
        .map(|c| canonical_shape(cfg, c.role).iter().product::<usize>())
        .sum();
    let _ = writeln!(out, "family:      {}", cfg.family.name);
    let _ = writeln!(
        out,
        "architecture: {} layers{}, hidden {}, heads {} (kv {}), head_dim {}{}, ffn {}{}, vocab {}",
        cfg.stored_layers(),
        match cfg.paired {
            true => " (LongCat-Flash's: two sublayers each, shortcut experts)",
            false => "",
        },
        cfg.hidden,
        cfg.heads,
        cfg.groups,
        cfg.head_dim,
        match cfg.rotary_dim == cfg.head_dim {
            true => String::new(),
            false => format!(" (RoPE on {})", cfg.rotary_dim),
        },
        cfg.ffn,
        match cfg.activation {
            Activation::SwiGlu => "",
            Activation::SquaredRelu => " (squared ReLU, not gated)",
        },
        cfg.vocab
    );
    let _ = writeln!(
        out,
        "embeddings:  {}{}; norms {}; qkv bias {}; output bias {}; q/k layernorm {}{}",
        if cfg.tied { "tied" } else { "untied" },
        if cfg.output_bias {
            " (output layer bias)"
        } else {
            ""
        },
        if cfg.layer_norm {
            "LayerNorm"
        } else {
            "RMSNorm"
        },
        cfg.qkv_bias,
        cfg.proj_bias,
        cfg.qk_norm,
        if cfg.qk_norm_per_layer {
            " (over all heads: MindSpeed-LLM's MiniMax spec)"
        } else {
            ""
        }
    );
    if let Some(m) = &cfg.mla {
        let spec = match cfg.paired {
            true => "longcat_spec",
            false => "deepseek_spec",
        };
        let _ = writeln!(
            out,
            "attention:   multi-latent: query latent {}, key-value latent {}, heads of {} + {} \
             rotated, values of {}{}{}",
            m.q_lora_rank.map_or("none".into(), |r| r.to_string()),
            m.kv_lora_rank,
            m.qk_head_dim,
            m.rope_dim,
            m.v_head_dim,
            match &cfg.rope_scaling {
                Some(r) => format!("; RoPE scaling {r}"),
                None => String::new(),
            },
            match (m.fused_down, m.split_up) {
                (true, false) => format!("; down projections in one linear_qkv (MindSpeed-LLM's {spec})"),
                (true, true) => format!("; down projections in one linear_qkv, up projections split (MindSpeed-LLM's {spec}, --mla-mm-split)"),
                _ => String::new(),
            }
        );
    }
    if let Some(m) = &cfg.moe {
        experts(cfg, m, out);
    }
    if let Some(m) = &cfg.mtp {
        let _ = writeln!(
            out,
            "prediction:  {} multi-token prediction depth(s) (layers {:?}), {}",
            m.depths,
            cfg.layers..cfg.all_layers(),
            match m.layout {
                MtpLayout::Mindspeed => "MindSpeed-LLM's layout (final_layernorm after the depths, each handed the un-normed states)",
                MtpLayout::Mcore => "megatron-core's layout (decoder.final_layernorm before the depths, each handed the normed states)",
            }
        );
    }
    let norms = match cfg.f32_norms_in_half() {
        true => ", norms float32 (--init-norm-weight-in-fp32)",
        false => "",
    };
    let _ = writeln!(out, "dtype:       {}{norms}", cfg.dtype.torch_name());
    let _ = writeln!(out, "parameters:  {params} ({:.3} B)", params as f64 / 1e9);
}

/// The experts line: routed experts and their routing, shared experts, which layers.
fn experts(cfg: &ModelConfig, m: &Moe, out: &mut String) {
    // as the files count layers (a paired model's first sublayers route)
    let s = cfg.sublayers();
    let moe_layers: Vec<usize> = (0..cfg.layers)
        .filter(|&l| m.is_moe_layer(l))
        .map(|l| l / s)
        .collect();
    let mut routing = if m.sparsemixer {
        format!(
            "SparseMixer top-{} (ε {}, sampled in training)",
            m.topk,
            crate::arch::moe::sparsemixer::EPS
        )
    } else if m.pre_softmax {
        format!("{} over all, top-{}", m.score.name(), m.topk)
    } else {
        format!("top-{} renormalised ({})", m.topk, m.score.name())
    };
    if let Some((groups, kept)) = m.group_limit {
        routing += &format!(" in {kept} of {groups} groups");
        if m.group_by_best {
            routing += " (each scored by its best expert)";
        }
    }
    if let Some(s) = m.topk_scale {
        routing += &format!(", scaled by {s}");
    }
    if m.expert_bias {
        routing += ", expert bias";
    }
    if m.sinkhorn {
        routing += ", Sinkhorn-balanced in training";
    }
    let shared = match (m.shared_ffn, m.shared_gate) {
        (None, _) => "none".to_string(),
        (Some(f), gated) => format!("ffn {f}{}", if gated { ", gated" } else { "" }),
    };
    let zero = match m.zero_experts {
        0 => String::new(),
        z => format!(" + {z} zero-computation"),
    };
    let _ = writeln!(
        out,
        "experts:     {} routed (ffn {}){zero}, {routing}; shared {shared}; MoE layers {}",
        m.experts,
        m.ffn,
        if moe_layers.len() == cfg.stored_layers() {
            "all".to_string()
        } else {
            format!("{moe_layers:?}")
        }
    );
}

/// `ckpt info` of a `torch_dist` checkpoint: its layout as saved, the model, the optimizer state
/// it holds, its files; with `keys`, every global tensor and its chunks.
fn torch_dist_info(
    path: &Path,
    family: Option<&'static Family>,
    keys: bool,
    out: &mut String,
) -> Result<()> {
    let ck = TorchDistCkpt::open(path, family)?;
    let _ = writeln!(
        out,
        "format:      Megatron torch_dist ({})",
        ck.iter_dir.display()
    );
    let p = &ck.par;
    // the virtual pipeline a training run saved with (its layers are global: read at any)
    let vpp = super::config::arg_uint(&ck.args, "virtual_pipeline_model_parallel_size")?;
    let _ = writeln!(
        out,
        "saved with:  TP {} × PP {}{}{} (global tensors: read at any layout), padded vocab {}",
        p.tp,
        p.pp,
        match vpp.filter(|&v| v > 1) {
            Some(v) => format!(" × VPP {v}"),
            None => String::new(),
        },
        if p.ep > 1 {
            format!(" × EP {}", p.ep)
        } else {
            String::new()
        },
        ck.padded_vocab
    );
    architecture(&ck.cfg, out);
    let _ = writeln!(
        out,
        "optimizer:   {}",
        ck.optimizer.as_deref().unwrap_or("not saved")
    );
    for f in ck.paths() {
        let size = std::fs::metadata(f).map_or(0, |m| m.len());
        let _ = writeln!(out, "file:        {} ({size} bytes)", f.display());
    }
    if keys {
        for (name, t) in ck.tensors() {
            let _ = writeln!(
                out,
                "  {name}  {}  {:?}  ({} chunks)",
                t.dtype.torch_name(),
                t.shape,
                t.chunks()
            );
        }
    }
    Ok(())
}

/// A human-readable description of the checkpoint at `path`; with `keys`, every tensor.
pub fn info(path: &Path, family: Option<&'static Family>, keys: bool) -> Result<String> {
    let mut out = String::new();
    match detect(path)? {
        Format::Hf => {
            let (mut cfg, weights) = open_hf(path, family)?;
            let _ = writeln!(out, "format:      Hugging Face ({})", path.display());
            // HF has one layout of the attention; Megatron's are its converters' choice
            cfg.mla = cfg.mla.map(|m| crate::arch::MlaLayout::Mcore.apply(m));
            architecture(&cfg, &mut out);
            if let Some(([rows, cols], n)) = weights.fp8() {
                let _ = writeln!(
                    out,
                    "stored:      {n} weights as float8_e4m3fn in {rows}×{cols} blocks with \
                     float32 scales (weight_scale_inv), read dequantized to bfloat16"
                );
            }
            let files = super::hf::weight_files(path)?;
            for f in &files {
                let size = std::fs::metadata(f).map_or(0, |m| m.len());
                let _ = writeln!(out, "file:        {} ({size} bytes)", f.display());
            }
            if keys {
                for (name, e) in weights.entries() {
                    let _ = writeln!(out, "  {name}  {}  {:?}", e.dtype.torch_name(), e.shape);
                }
            }
        }
        Format::Megatron if is_torch_dist(path) => torch_dist_info(path, family, keys, &mut out)?,
        Format::Megatron => {
            let ck = MegatronCkpt::open(path, family)?;
            let _ = writeln!(
                out,
                "format:      Megatron torch ({})",
                ck.iter_dir.display()
            );
            let experts = match (ck.grouped, ck.layout) {
                (false, _) => "",
                (true, KeyLayout::McoreTe) => {
                    ", grouped experts (TEGroupedMLP linear_fc1.weight{i})"
                }
                (true, _) => ", grouped experts (GroupedMLP weight1 / weight2)",
            };
            let _ = writeln!(out, "layout:      {}{experts}", ck.layout.name());
            let p = &ck.par;
            let _ = writeln!(
                out,
                "parallel:    TP {} × PP {}{}{}{}, layers per stage {:?}, padded vocab {}",
                p.tp,
                p.pp,
                match (p.dualpipev, p.vpp > 1) {
                    (true, _) => " (DualPipeV: 2 chunks per stage in a V)".to_string(),
                    (false, true) => format!(" × VPP {}", p.vpp),
                    (false, false) => String::new(),
                },
                if p.ep > 1 {
                    format!(" × EP {}", p.ep)
                } else {
                    String::new()
                },
                match (p.tp_extend, p.etp) {
                    (true, _) => " (moe_tp_extend_ep: whole experts over TP × EP)".to_string(),
                    (false, e) if e == p.tp => String::new(),
                    (false, 1) => " (ETP 1: whole experts)".to_string(),
                    (false, e) => format!(" (ETP {e}: experts split {e} ways)"),
                },
                (p.stage_layers.iter())
                    .map(|n| n / ck.cfg.sublayers())
                    .collect::<Vec<_>>(),
                ck.padded_vocab
            );
            architecture(&ck.cfg, &mut out);
            for r in ck.rank_files()? {
                let _ = writeln!(
                    out,
                    "rank file:   {} ({} bytes, {} tensors)",
                    r.path.display(),
                    r.bytes,
                    r.tensors.len()
                );
                if keys {
                    for (k, d, s) in &r.tensors {
                        let _ = writeln!(out, "  {k}  {}  {s:?}", d.torch_name());
                    }
                }
            }
        }
    }
    Ok(out)
}
