//! Where each rank sits in a parallel layout, as megatron-core numbers the ranks: the global
//! rank is a mixed-radix number over the parallel dimensions in the order `tp-cp-ep-dp-pp`
//! (`initialize_model_parallel`'s default `order`), tensor-parallel fastest; a group of some
//! dimensions holds the ranks that differ only in those (megatron-core
//! megatron/core/parallel_state.py `RankGenerator`, `generate_masked_orthogonal_rank_groups`).
//! Expert parallelism has its own generator there, over `tp-ep-dp-pp` with the expert
//! tensor-parallel size as its `tp`: with ETP = TP its expert-parallel and expert-data-parallel
//! ranks are the data-parallel rank's two digits, expert-parallel fastest (`dp = ep + EP·edp`);
//! with ETP = 1 the expert-parallel ranks take the tensor-parallel ranks first.

use anyhow::{bail, Result};
use std::ops::Range;

/// One parallel dimension.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Axis {
    /// Tensor parallelism.
    Tp,
    /// Context parallelism.
    Cp,
    /// Data parallelism (of the dense parameters).
    Dp,
    /// Pipeline parallelism.
    Pp,
    /// Expert parallelism: the ranks holding one MoE layer's experts between them.
    Ep,
    /// Expert data parallelism: the ranks holding the same experts.
    Edp,
    /// Expert tensor parallelism: the ranks each routed expert is split over.
    Etp,
}

impl Axis {
    /// The view its dimension belongs to ([`Layout`]: expert or not) and its place there.
    fn place(self) -> (bool, usize) {
        match self {
            Axis::Tp => (false, 0),
            Axis::Cp => (false, 1),
            Axis::Dp => (false, 2),
            Axis::Pp => (false, 3),
            Axis::Ep => (true, 1),
            Axis::Edp => (true, 2),
            Axis::Etp => (true, 0),
        }
    }

    /// Megatron's token for it (`"tp"`, …).
    pub fn token(self) -> &'static str {
        match self {
            Axis::Tp => "tp",
            Axis::Cp => "cp",
            Axis::Dp => "dp",
            Axis::Pp => "pp",
            Axis::Ep => "ep",
            Axis::Edp => "edp",
            Axis::Etp => "etp",
        }
    }
}

/// The sizes of the parallel dimensions; their product is the world size. The same ranks seen
/// twice, as megatron-core's two rank generators see them: the dense layers' `tp-cp-dp-pp`,
/// and the experts' `etp-ep-edp-pp` (expert tensor parallelism fastest, no context
/// parallelism).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// Tensor-, context-, data-parallel and pipeline sizes.
    dense: [usize; 4],
    /// Expert tensor-, expert-, expert-data-parallel and pipeline sizes.
    experts: [usize; 4],
}

impl Layout {
    /// The layout of `world` ranks with these tensor-, pipeline- and context-parallel sizes;
    /// data parallelism takes the rest (`world / (tp·pp·cp)`, as Megatron derives it).
    pub fn new(world: usize, tp: usize, pp: usize, cp: usize) -> Result<Layout> {
        if tp == 0 || pp == 0 || cp == 0 {
            bail!("parallel sizes must be at least 1 (TP {tp}, PP {pp}, CP {cp})");
        }
        let model = tp * pp * cp;
        if world == 0 || !world.is_multiple_of(model) {
            bail!("world size {world} is not a multiple of TP {tp} × PP {pp} × CP {cp} = {model}");
        }
        let dp = world / model;
        Ok(Layout {
            dense: [tp, cp, dp, pp],
            experts: [tp, 1, cp * dp, pp],
        })
    }

    /// This layout with each pipeline stage's ranks also split into `etp` expert
    /// tensor-parallel × `ep` expert-parallel × the rest expert-data-parallel ranks
    /// (megatron-core's `expert_data_parallel_size`).
    pub fn with_expert_parallel(self, ep: usize, etp: usize) -> Result<Layout> {
        let [tp, cp, dp, pp] = self.dense;
        let stage = tp * cp * dp;
        if ep == 0 || etp == 0 || !stage.is_multiple_of(ep * etp) {
            bail!(
                "--expert-model-parallel-size {ep} × --expert-tensor-parallel-size {etp} does not divide the {stage} ranks of a pipeline stage"
            );
        }
        Ok(Layout {
            dense: self.dense,
            experts: [etp, ep, stage / (ep * etp), pp],
        })
    }

    /// The experts' tensor-parallel size.
    pub fn expert_tensor_parallel(&self) -> usize {
        self.experts[0]
    }

    /// The shard of a split parameter that tensor-parallel rank `tp.0` of `tp.1` holds, and
    /// how many there are: a routed expert's (`expert`) is its expert tensor-parallel rank's
    /// of ETP — the TP rank modulo ETP, ETP dividing TP (`etp-ep-edp` numbers the ranks with
    /// ETP fastest as `tp-…` does with TP) —, another's its TP rank's.
    pub fn shard(&self, expert: bool, tp: (usize, usize)) -> (usize, usize) {
        match expert {
            true => (tp.0 % self.experts[0], self.experts[0]),
            false => tp,
        }
    }

    fn view(&self, experts: bool) -> &[usize; 4] {
        match experts {
            true => &self.experts,
            false => &self.dense,
        }
    }

    /// The size of `axis`.
    pub fn size(&self, axis: Axis) -> usize {
        let (experts, i) = axis.place();
        self.view(experts)[i]
    }

    /// The number of ranks.
    pub fn world(&self) -> usize {
        self.dense.iter().product()
    }

    /// `rank`'s index along `axis`.
    pub fn coordinate(&self, rank: usize, axis: Axis) -> usize {
        let (experts, i) = axis.place();
        let sizes = self.view(experts);
        rank / sizes[..i].iter().product::<usize>() % sizes[i]
    }

    /// Every group over `axes` (megatron-core's `RankGenerator.get_ranks("tp-dp")` for
    /// `[Tp, Dp]`): the ranks that differ only along `axes`, each group in increasing order of
    /// the masked mixed-radix index, the groups in increasing order of the others'.
    pub fn groups(&self, axes: &[Axis]) -> Vec<Vec<usize>> {
        let experts = axes.first().is_some_and(|a| a.place().0);
        assert!(
            axes.iter().all(|a| a.place().0 == experts),
            "a group's axes are of one view"
        );
        let sizes = self.view(experts);
        let mask: Vec<bool> = (0..4)
            .map(|i| axes.iter().any(|a| a.place().1 == i))
            .collect();
        let strides: Vec<usize> = (0..4).map(|i| sizes[..i].iter().product()).collect();
        let pick = |want: bool| -> (Vec<usize>, Vec<usize>) {
            (0..4)
                .filter(|&i| mask[i] == want)
                .map(|i| (sizes[i], strides[i]))
                .unzip()
        };
        let (in_shape, in_stride) = pick(true);
        let (out_shape, out_stride) = pick(false);
        let size: usize = in_shape.iter().product();
        (0..self.world() / size)
            .map(|group| {
                let base = place(group, &out_shape, &out_stride);
                (0..size)
                    .map(|r| base + place(r, &in_shape, &in_stride))
                    .collect()
            })
            .collect()
    }

    /// The group over `axes` that holds `rank`.
    pub fn group_of(&self, rank: usize, axes: &[Axis]) -> Vec<usize> {
        self.groups(axes)
            .into_iter()
            .find(|g| g.contains(&rank))
            .expect("every rank is in one group of each kind")
    }
}

/// One pipeline stage: its index among the stages and the global layers of each of its
/// model chunks (one, or several with a virtual pipeline).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stage {
    /// Its pipeline-parallel rank.
    pub index: usize,
    /// Pipeline stages.
    pub count: usize,
    /// The layers of each model chunk.
    pub chunks: Vec<Range<usize>>,
    /// Its two chunks in DualPipeV's V ([`crate::ckpt::layout::Parallel::dualpipev`]).
    pub dualpipev: bool,
}

impl Stage {
    /// Stage `index` of the stages holding `stages[p]` layers each, in `vpp` model chunks:
    /// chunk `v` of each stage holds its share of the `v`-th `1/vpp` of the layers
    /// (megatron-core `get_transformer_layer_offset`, [`crate::ckpt::layout::Parallel::
    /// chunk_layers`]).
    /// Under DualPipeV (`dualpipev`, two chunks) the chunks sit in its V.
    pub fn of(stages: &[usize], vpp: usize, index: usize, dualpipev: bool) -> Stage {
        let parallel = crate::ckpt::layout::Parallel {
            tp: 1,
            pp: stages.len(),
            vpp,
            stage_layers: stages.to_vec(),
            ep: 1,
            etp: 1,
            tp_extend: false,
            dualpipev,
        };
        let chunks = (0..vpp)
            .map(|v| {
                let layers = parallel.chunk_layers(index, v);
                let start = layers.first().copied().unwrap_or(0);
                start..start + layers.len()
            })
            .collect();
        Stage {
            index,
            count: stages.len(),
            chunks,
            dualpipev,
        }
    }

    /// Whether it holds the embedding.
    pub fn first(&self) -> bool {
        self.index == 0
    }

    /// Whether it holds the final norm, the output layer and the loss (in its last chunk).
    pub fn last(&self) -> bool {
        self.index == self.head()
    }

    /// The stage holding the final norm, the output layer and the loss: the last, or
    /// DualPipeV's first.
    pub fn head(&self) -> usize {
        match self.dualpipev {
            true => 0,
            false => self.count - 1,
        }
    }

    /// `(index, count)`.
    pub fn rank(&self) -> (usize, usize) {
        (self.index, self.count)
    }
}

/// The global rank of mixed-radix `index` over `shape` (fastest first), each digit weighted
/// by its dimension's global `stride`.
fn place(index: usize, shape: &[usize], stride: &[usize]) -> usize {
    let mut rest = index;
    shape
        .iter()
        .zip(stride)
        .map(|(&s, &d)| {
            let digit = rest % s;
            rest /= s;
            digit * d
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn megatrons_documented_example() {
        // parallel_state.py's docstring: 16 ranks, TP 2, PP 4 → DP 2.
        let l = Layout::new(16, 2, 4, 1).unwrap();
        assert_eq!(
            l.groups(&[Axis::Tp]),
            [
                [0, 1],
                [2, 3],
                [4, 5],
                [6, 7],
                [8, 9],
                [10, 11],
                [12, 13],
                [14, 15]
            ]
        );
        assert_eq!(
            l.groups(&[Axis::Dp]),
            [
                [0, 2],
                [1, 3],
                [4, 6],
                [5, 7],
                [8, 10],
                [9, 11],
                [12, 14],
                [13, 15]
            ]
        );
        assert_eq!(
            l.groups(&[Axis::Pp]),
            [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
        );
        // rank 13: TP rank 1, DP rank 0, PP rank 3; its model-parallel group is DP rank 0's.
        assert_eq!(
            [Axis::Tp, Axis::Dp, Axis::Pp].map(|a| l.coordinate(13, a)),
            [1, 0, 3]
        );
        assert_eq!(
            l.group_of(13, &[Axis::Tp, Axis::Pp]),
            [0, 1, 4, 5, 8, 9, 12, 13]
        );
        assert!(Layout::new(6, 4, 1, 1).is_err());
    }

    #[test]
    fn expert_groups_split_the_data_parallel_rank_as_megatrons_expert_generator() {
        // 16 ranks, TP 2, PP 2 → DP 4 = EP 2 × EDP 2; megatron-core's expert RankGenerator
        // (tp-ep-dp-pp) gives EP groups [0, 2], [1, 3], … and EDP groups [0, 4], [1, 5], ….
        let l = Layout::new(16, 2, 2, 1)
            .unwrap()
            .with_expert_parallel(2, 2)
            .unwrap();
        assert_eq!(l.groups(&[Axis::Ep])[..3], [[0, 2], [1, 3], [4, 6]]);
        assert_eq!(l.groups(&[Axis::Edp])[..3], [[0, 4], [1, 5], [2, 6]]);
        assert_eq!(l.groups(&[Axis::Dp])[0], [0, 2, 4, 6]);
        assert_eq!(
            [Axis::Dp, Axis::Ep, Axis::Edp, Axis::Pp].map(|a| l.coordinate(14, a)),
            [3, 1, 1, 1]
        );
        assert!(Layout::new(6, 1, 1, 1)
            .unwrap()
            .with_expert_parallel(4, 1)
            .is_err());
        // ETP 1 under TP 2 (8 ranks, DP 4, EP 4): the expert-parallel ranks are the TP ranks
        // of two data-parallel ranks, EDP the remaining digit.
        let l = Layout::new(8, 2, 1, 1)
            .unwrap()
            .with_expert_parallel(4, 1)
            .unwrap();
        assert_eq!(l.groups(&[Axis::Ep]), [[0, 1, 2, 3], [4, 5, 6, 7]]);
        assert_eq!(l.groups(&[Axis::Edp]), [[0, 4], [1, 5], [2, 6], [3, 7]]);
        assert_eq!(l.groups(&[Axis::Tp])[1], [2, 3]);
    }
}
