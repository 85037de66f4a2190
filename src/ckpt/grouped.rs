//! MindSpeed-LLM's grouped experts (`--moe-grouped-gemm` with the local transformer, megatron-core
//! `GroupedMLP`): each MoE layer's local experts in two tensors, `mlp.experts.weight1
//! [h, E_l·2F/tp]` and `mlp.experts.weight2 [E_l·F/tp, h]`, which are expert `le`'s TP shards
//! of linear_fc1 (`[gate_r; up_r]`) and linear_fc2, each transposed, laid one after the other
//! (mindspeed_llm/tasks/checkpoint/convert_hf2mg.py: `torch.cat(fc1ᵀ…).view(h, -1)`, chunked
//! over EP and TP; megatron-core experts.py `GroupedMLP.forward` views `weight1` as
//! `[E_l, h, 2F/tp]`). mindkit reads each expert as a view of the grouped storage, and writes
//! the grouped tensors from the experts' shards.

use super::torch::pickle::TensorRef;
use crate::tensor::host::Tensor;
use anyhow::{bail, Result};

/// The grouped key holding a per-expert key (`…mlp.experts.local_experts.{le}.linear_fc1.weight`
/// → `…mlp.experts.weight1`; its LoRA factors `….linear_fc1.lora_A.default.weight` →
/// `…mlp.experts.weight1_lora_a`, as MindSpeed-LLM's LoraParallelGroupedMLP names them,
/// mindspeed_llm/tasks/posttrain/lora/moe/experts.py) and the expert's place in it; `None` for
/// other keys.
pub fn grouped_key(key: &str) -> Option<(String, usize)> {
    let (stem, rest) = key.split_once(".mlp.experts.local_experts.")?;
    let (local, fc) = rest.split_once('.')?;
    let (module, factor) = fc.split_once('.')?;
    let n = match module {
        "linear_fc1" => 1,
        "linear_fc2" => 2,
        _ => return None,
    };
    let suffix = match factor {
        "weight" => "",
        f if f.starts_with("lora_A.") || f.starts_with("lora_a.") => "_lora_a",
        f if f.starts_with("lora_B.") || f.starts_with("lora_b.") => "_lora_b",
        _ => return None,
    };
    Some((
        format!("{stem}.mlp.experts.weight{n}{suffix}"),
        local.parse().ok()?,
    ))
}

/// A grouped LoRA factor of MindSpeed-LLM's LoraParallelGroupedMLP (`…mlp.experts.weight1_lora_a`,
/// `weight1_lora_b`, `weight2_lora_a`, `weight2_lora_b`): each local expert's factor of its
/// linear_fc1 (fc2) stored transposed, one after the other, as weight1 (weight2) stores the
/// weights.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupedLora {
    /// The layer's experts module (`…mlp.experts`).
    pub experts: String,
    /// Whose factor: linear_fc1 (else linear_fc2).
    pub fc1: bool,
    /// Which factor: `lora_A` (else `lora_B`).
    pub a: bool,
}

impl GroupedLora {
    /// The factor of key `key`, `None` for other keys.
    pub fn of(key: &str) -> Option<GroupedLora> {
        let (stem, rest) = key.rsplit_once(".mlp.experts.weight")?;
        let (fc, factor) = rest.split_once("_lora_")?;
        let fc1 = match fc {
            "1" => true,
            "2" => false,
            _ => return None,
        };
        let a = match factor {
            "a" => true,
            "b" => false,
            _ => return None,
        };
        let experts = format!("{stem}.mlp.experts");
        Some(GroupedLora { experts, fc1, a })
    }

    /// Local expert `le`'s module (`…mlp.experts.local_experts.{le}.linear_fc1`).
    pub fn module(&self, le: usize) -> String {
        let fc = if self.fc1 { 1 } else { 2 };
        format!("{}.local_experts.{le}.linear_fc{fc}", self.experts)
    }

    /// One expert's factor shape `[m, k]` within a grouped tensor of `shape` over `local`
    /// experts (the inverse of [`grouped_shape`]), `None` when they do not divide it.
    pub fn shard(&self, shape: &[u64], local: usize) -> Option<[usize; 2]> {
        let (rows, cols, local) = (*shape.first()? as usize, *shape.get(1)? as usize, local);
        match self.fc1 {
            true => (cols % local == 0).then(|| [cols / local, rows]),
            false => (rows % local == 0).then(|| [cols, rows / local]),
        }
    }
}

/// The grouped tensor's shape for `local` experts whose shards are `[m, k]`: `[k, local·m]`
/// for weight1 (`[h, E_l·2F/tp]`) and its LoRA factors (`weight1_lora_a [h, E_l·r]`,
/// `weight1_lora_b [r, E_l·2F/tp]`), `[local·k, m]` for weight2 (`[E_l·F/tp, h]`) and its
/// (`weight2_lora_a [E_l·F/tp, r]`, `weight2_lora_b [E_l·r, h]`).
pub fn grouped_shape(grouped: &str, shard: &[usize], local: usize) -> Vec<u64> {
    let (m, k) = (shard[0] as u64, shard[1] as u64);
    if grouped.contains("experts.weight1") {
        vec![k, local as u64 * m]
    } else {
        vec![local as u64 * k, m]
    }
}

/// Expert `le`'s block of a grouped tensor: its shard `[m, k]` stored transposed, `[k, m]`,
/// after the `le` blocks before it. The grouped tensor's shape is checked against `local`
/// experts of that shard shape.
pub fn expert_view(
    (grouped_key, grouped): (&str, &TensorRef),
    le: usize,
    (shard, local): (&[usize], usize),
) -> Result<TensorRef> {
    let want = grouped_shape(grouped_key, shard, local);
    if grouped.shape != want || !grouped.is_contiguous() {
        bail!(
            "grouped experts {grouped_key} has shape {:?} (stride {:?}), but {local} local experts \
             of [{}, {}] make {want:?}",
            grouped.shape,
            grouped.stride,
            shard[0],
            shard[1]
        );
    }
    let (m, k) = (shard[0] as u64, shard[1] as u64);
    Ok(TensorRef {
        storage: grouped.storage.clone(),
        offset: grouped.offset + le as u64 * m * k,
        shape: vec![k, m],
        stride: vec![m, 1],
    })
}

/// The grouped tensor's bytes from its experts' shards, in expert order.
pub fn pack(shards: &[Tensor]) -> Vec<u8> {
    let mut data = Vec::with_capacity(shards.iter().map(|s| s.data.len()).sum());
    for s in shards {
        data.extend_from_slice(&s.transposed().data);
    }
    data
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_expert_keys_name_their_grouped_tensor() {
        assert_eq!(
            grouped_key("decoder.layers.3.mlp.experts.local_experts.7.linear_fc1.weight"),
            Some(("decoder.layers.3.mlp.experts.weight1".into(), 7))
        );
        assert_eq!(
            grouped_key("decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"),
            Some(("decoder.layers.0.mlp.experts.weight2".into(), 0))
        );
        assert_eq!(grouped_key("decoder.layers.0.mlp.linear_fc1.weight"), None);
        assert_eq!(
            grouped_key(
                "decoder.layers.2.mlp.experts.local_experts.1.linear_fc2.lora_B.default.weight"
            ),
            Some(("decoder.layers.2.mlp.experts.weight2_lora_b".into(), 1))
        );
        assert_eq!(
            grouped_shape("decoder.layers.2.mlp.experts.weight1_lora_a", &[8, 64], 4),
            [64, 32]
        );
        let g = GroupedLora::of("decoder.layers.2.mlp.experts.weight2_lora_b").unwrap();
        assert!(!g.fc1 && !g.a);
        assert_eq!(
            g.module(3),
            "decoder.layers.2.mlp.experts.local_experts.3.linear_fc2"
        );
        // weight2_lora_b [E·r, h] of 4 experts of rank 8: each lora_B [h, r] = [64, 8]
        assert_eq!(g.shard(&[32, 64], 4), Some([64, 8]));
        assert_eq!(
            GroupedLora::of("decoder.layers.2.mlp.experts.weight2"),
            None
        );
    }
}
