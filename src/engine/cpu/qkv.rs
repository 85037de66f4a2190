//! Megatron's fused `linear_qkv` rows split into query, key and value rows and merged back, as
//! plain copies of whatever the tensor stores (f32 values or half bits), rows in parallel.
//!
//! Legend: nh = query heads, ng = groups, d = head dim, p = nh/ng. A fused row holds, group
//! after group, the group's p query heads, then its key head, then its value head
//! (`(p + 2)·d` elements each); q rows are `[nh·d]`, k and v rows `[ng·d]`.

use crate::engine::AttentionShape;
use rayon::prelude::*;
use std::ops::Range;

/// Where group `g`'s pieces lie in a fused row and in the q, k and v rows: (fused range,
/// part 0|1|2 for q|k|v, range in that part's row).
fn pieces(s: AttentionShape) -> Vec<(Range<usize>, usize, Range<usize>)> {
    let (d, p) = (s.head_dim, s.heads / s.groups);
    (0..s.groups)
        .flat_map(|g| {
            let at = g * (p + 2) * d;
            [
                (at..at + p * d, 0, g * p * d..(g + 1) * p * d),
                (at + p * d..at + (p + 1) * d, 1, g * d..(g + 1) * d),
                (at + (p + 1) * d..at + (p + 2) * d, 2, g * d..(g + 1) * d),
            ]
        })
        .collect()
}

/// Row widths of the fused tensor and of q, k, v.
fn widths(s: AttentionShape) -> (usize, [usize; 3]) {
    let (q, kv) = (s.heads * s.head_dim, s.groups * s.head_dim);
    (q + 2 * kv, [q, kv, kv])
}

/// `[q, k, v]` of fused rows `qkv` (whole rows; checked by the caller).
pub fn split<T: Copy + Default + Send + Sync>(qkv: &[T], s: AttentionShape) -> [Vec<T>; 3] {
    let (width, part_widths) = widths(s);
    let n = qkv.len() / width;
    let mut parts = part_widths.map(|w| vec![T::default(); n * w]);
    let pieces = pieces(s);
    let [q, k, v] = &mut parts;
    q.par_chunks_mut(part_widths[0])
        .zip(k.par_chunks_mut(part_widths[1]))
        .zip(v.par_chunks_mut(part_widths[2]))
        .zip(qkv.par_chunks(width))
        .for_each(|(((q, k), v), fused)| {
            let rows = [q, k, v];
            for (from, part, to) in &pieces {
                rows[*part][to.clone()].copy_from_slice(&fused[from.clone()]);
            }
        });
    parts
}

/// Fused rows of `[q, k, v]` (whole rows of the same count; checked by the caller).
pub fn merge<T: Copy + Default + Send + Sync>(parts: [&[T]; 3], s: AttentionShape) -> Vec<T> {
    let (width, part_widths) = widths(s);
    let n = parts[0].len() / part_widths[0];
    let mut qkv = vec![T::default(); n * width];
    let pieces = pieces(s);
    let [q, k, v] = parts;
    qkv.par_chunks_mut(width)
        .zip(q.par_chunks(part_widths[0]))
        .zip(k.par_chunks(part_widths[1]))
        .zip(v.par_chunks(part_widths[2]))
        .for_each(|(((fused, q), k), v)| {
            let rows = [q, k, v];
            for (to, part, from) in &pieces {
                fused[to.clone()].copy_from_slice(&rows[*part][from.clone()]);
            }
        });
    qkv
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_takes_each_groups_heads_and_merge_restores_the_rows() {
        let s = AttentionShape {
            heads: 4,
            groups: 2,
            head_dim: 2,
            scale: 1.0,
        };
        // Two rows of 2 groups × (2 q heads + k + v) × 2 = 16 elements.
        let qkv: Vec<u16> = (0..32).collect();
        let [q, k, v] = split(&qkv, s);
        assert_eq!(
            q,
            [0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27]
        );
        assert_eq!(k, [4, 5, 12, 13, 20, 21, 28, 29]);
        assert_eq!(v, [6, 7, 14, 15, 22, 23, 30, 31]);
        assert_eq!(merge([&q, &k, &v], s), qkv);
    }
}
