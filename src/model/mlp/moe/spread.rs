//! How an MoE layer's rows lie over the expert-parallel ranks: each rank's tensor-parallel
//! group's rows (its N) one after the other, the M rows every rank's experts see. The counts
//! may differ between the ranks (fine-tuning pads each micro-batch to its own longest
//! sample): the rows then travel padded to the largest count and are compacted after
//! (megatron-core's all-to-all dispatcher sends each rank's rows with their own split sizes).

use crate::engine::{Backend, Result};
use crate::model::parallel::{expert_gathered, expert_reduced, ExpertGroup};
use std::ops::Range;

/// The row counts of the expert-parallel ranks' groups, in rank order (one entry alone).
#[derive(Debug, Clone)]
pub(super) struct Spread {
    counts: Vec<usize>,
    /// This rank's expert-parallel rank.
    rank: usize,
}

impl Spread {
    /// The spread of `rows` rows on this rank (its tensor-parallel group's N) over `ep`.
    pub(super) fn of<T>(ep: ExpertGroup<T>, rows: usize) -> Result<Spread> {
        let Some(ep) = ep else {
            return Ok(Spread {
                counts: vec![rows],
                rank: 0,
            });
        };
        let counts = ep.all_gather_f32(&[rows as f32])?;
        Ok(Spread {
            counts: counts.iter().map(|&n| n as usize).collect(),
            rank: ep.rank(),
        })
    }

    /// This rank's group's rows among the M.
    pub(super) fn mine(&self) -> Range<usize> {
        let start = self.counts[..self.rank].iter().sum();
        start..start + self.counts[self.rank]
    }

    /// Each expert-parallel rank's group's rows among the M.
    pub(super) fn groups(&self) -> impl Iterator<Item = Range<usize>> + '_ {
        (self.counts.iter()).scan(0, |start, &n| {
            *start += n;
            Some(*start - n..*start)
        })
    }

    fn uneven(&self) -> bool {
        self.counts.iter().any(|&n| n != self.counts[0])
    }

    fn max(&self) -> usize {
        self.counts.iter().copied().max().unwrap_or(0)
    }

    /// The M rows' places among the padded ones (each rank's block of `max` rows).
    fn padded_rows(&self) -> Vec<usize> {
        let max = self.max();
        (self.counts.iter().enumerate())
            .flat_map(|(e, &n)| e * max..e * max + n)
            .collect()
    }

    /// Every expert-parallel rank's rows of `x` (this rank's N rows) as the M rows; `None`
    /// alone.
    pub(super) fn gather<B: Backend>(
        &self,
        b: &B,
        ep: ExpertGroup<B::Tensor>,
        x: &B::Tensor,
    ) -> Result<Option<B::Tensor>> {
        if ep.is_none() || !self.uneven() {
            return expert_gathered(b, ep, x);
        }
        let own: Vec<usize> = (0..b.shape(x)[0]).collect();
        let padded = placed(b, x, self.max(), &own)?;
        let all = expert_gathered(b, ep, &padded)?.expect("an expert-parallel group");
        Ok(Some(b.select_rows(&all, &self.padded_rows())?))
    }

    /// [`Spread::gather`] of host values, `width` per row.
    pub(super) fn gather_f32<T>(
        &self,
        ep: ExpertGroup<T>,
        x: Vec<f32>,
        width: usize,
    ) -> Result<Vec<f32>> {
        let Some(ep) = ep else {
            return Ok(x);
        };
        if !self.uneven() {
            return ep.all_gather_f32(&x);
        }
        let mut padded = x;
        padded.resize(self.max() * width, 0.0);
        let all = ep.all_gather_f32(&padded)?;
        let max = self.max();
        Ok((self.counts.iter().enumerate())
            .flat_map(|(e, &n)| all[e * max * width..(e * max + n) * width].iter().copied())
            .collect())
    }

    /// The sum over the expert-parallel ranks of their M rows `x`, this rank's N of them.
    pub(super) fn reduce<B: Backend>(
        &self,
        b: &B,
        ep: ExpertGroup<B::Tensor>,
        x: B::Tensor,
    ) -> Result<B::Tensor> {
        if ep.is_none() || !self.uneven() {
            return expert_reduced(b, ep, x);
        }
        let padded = placed(b, &x, self.max() * self.counts.len(), &self.padded_rows())?;
        let mine = expert_reduced(b, ep, padded)?;
        let rows: Vec<usize> = (0..self.counts[self.rank]).collect();
        b.select_rows(&mine, &rows)
    }
}

/// `rows` rows of zeros with `x`'s rows added at rows `at` (`x`'s dtype and width).
fn placed<B: Backend>(b: &B, x: &B::Tensor, rows: usize, at: &[usize]) -> Result<B::Tensor> {
    let mut shape = b.shape(x).to_vec();
    shape[0] = rows;
    let mut out = b.zeros(&shape, b.dtype(x))?;
    b.index_add_rows(&mut out, x, at)?;
    Ok(out)
}
