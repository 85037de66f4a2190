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
/// → `…mlp.experts.weight1`) and the expert's place in it; `None` for other keys.
pub fn grouped_key(key: &str) -> Option<(String, usize)> {
    let (stem, rest) = key.split_once(".mlp.experts.local_experts.")?;
    let (local, fc) = rest.split_once('.')?;
    let n = match fc {
        "linear_fc1.weight" => 1,
        "linear_fc2.weight" => 2,
        _ => return None,
    };
    Some((format!("{stem}.mlp.experts.weight{n}"), local.parse().ok()?))
}

/// The grouped tensor's shape for `local` experts whose shards are `[m, k]`: `[k, local·m]`
/// for weight1 (`[h, E_l·2F/tp]`), `[local·k, m]` for weight2 (`[E_l·F/tp, h]`).
pub fn grouped_shape(grouped: &str, shard: &[usize], local: usize) -> Vec<u64> {
    let (m, k) = (shard[0] as u64, shard[1] as u64);
    if grouped.ends_with("weight1") {
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
    }
}
