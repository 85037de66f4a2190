//! Megatron's distributed optimizer (`--use-distributed-optimizer`): where each trained
//! parameter sits in the flat gradient and parameter buffer, and which slice of it each
//! data-parallel rank owns (megatron-core megatron/core/distributed/param_and_grad_buffer.py
//! `_ParamAndGradBuffer.__init__`, megatron/core/optimizer/distrib_optimizer.py
//! `_build_model_gbuf_range`). The buffer holds the parameters in reverse registration order,
//! each starting at a multiple of 64 elements; a bucket closes where it reaches the bucket size
//! (one bucket without one) or after a pipeline's shared embedding, which has a bucket of its
//! own, and is padded to a multiple of lcm(DP, 128), so that each rank owns one contiguous
//! 1/DP of every bucket. With a virtual pipeline each model chunk has its own buffer (its own
//! DistributedDataParallel in megatron-core), and a chunk has one per parameter dtype (f32
//! norms beside bf16 weights, `--init-norm-weight-in-fp32`), laid end to end here. The gradients are
//! reduce-scattered into those slices, Adam updates them, and the parameters are all-gathered
//! back.
//!
//! With `--moe-grouped-gemm` a layer's routed experts are two parameters upstream
//! (`GroupedMLP`'s `weight1`, `weight2`), whose flat elements are each expert's weight
//! transposed, one after the other (`crate::ckpt::grouped`); mindkit keeps one tensor per
//! expert, so the buffer holds [`Unit`]s: a parameter, or a grouped tensor's experts, copied
//! in and out transposed.

use super::checkpoint::{is_grouped_unit, stored_units};
use super::optim::{AdamConfig, Optimizer};
use crate::engine::comm::{Communicator, ReduceOp};
use crate::engine::{Backend, EngineError, Result};
use crate::model::params::{ParamInfo, ParamTable};
use crate::tensor::DType;
use std::ops::Range;

/// One parameter's place in the buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placed {
    /// Its index among the buffer's units ([`Sharded::units`]; in a bare layout, whatever
    /// index its caller gave).
    pub param: usize,
    /// Its elements `[start, start + numel)` in the buffer.
    pub range: Range<usize>,
}

/// One bucket: `[start, end)` of the buffer, `unpadded` of them up to its last parameter's end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bucket {
    /// First element.
    pub start: usize,
    /// One past its padded end (a multiple of lcm(DP, 128)).
    pub end: usize,
    /// Elements up to its last parameter's end (alignment gaps included).
    pub unpadded: usize,
}

/// A rank's buffer layout: one buffer, or with model chunks one per chunk, laid end to end.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BufferLayout {
    /// The parameters in buffer order.
    pub placed: Vec<Placed>,
    /// The buckets in buffer order.
    pub buckets: Vec<Bucket>,
    /// Data-parallel ranks sharing it.
    pub dp: usize,
    /// How many of the buckets each buffer holds, in order.
    pub buffers: Vec<usize>,
}

/// A piece of a parameter that a rank owns: its elements `param_range` of the flattened
/// parameter, at `local` in the rank's shard (its slices of every bucket, concatenated).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Piece {
    /// The parameter's index among the units.
    pub param: usize,
    /// Elements of the flattened parameter.
    pub param_range: Range<usize>,
    /// Where they sit in the rank's shard.
    pub local: Range<usize>,
}

fn pad(x: usize, m: usize) -> usize {
    x.div_ceil(m) * m
}

fn lcm(a: usize, b: usize) -> usize {
    let gcd = |mut a: usize, mut b: usize| {
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    };
    a / gcd(a, b) * b
}

impl BufferLayout {
    /// The layout of `params` (`(table index, elements)` in registration order) over `dp`
    /// ranks with buckets of `bucket_size` elements (`None`: one bucket), each padded to a
    /// multiple of lcm(DP, 128) — and of 65536 with `pad_high` —, `own_bucket` saying which
    /// parameter is a pipeline's shared embedding.
    pub fn new(
        params: &[(usize, usize)],
        dp: usize,
        (bucket_size, pad_high): (Option<usize>, bool),
        own_bucket: impl Fn(usize) -> bool,
    ) -> BufferLayout {
        let multiple = lcm(dp.max(1), 128);
        let multiple = if pad_high {
            lcm(multiple, 65536)
        } else {
            multiple
        };
        let mut layout = BufferLayout {
            placed: Vec::with_capacity(params.len()),
            buckets: Vec::new(),
            dp: dp.max(1),
            buffers: Vec::new(),
        };
        let (mut bucket_start, mut param_start, mut open) = (0, 0, false);
        let close = |buckets: &mut Vec<Bucket>, start: &mut usize, end_unpadded: usize| {
            let end = pad(end_unpadded, multiple);
            buckets.push(Bucket {
                start: *start,
                end,
                unpadded: end_unpadded - *start,
            });
            *start = end;
            end
        };
        for &(param, numel) in params.iter().rev() {
            param_start = pad(param_start, 64);
            let shared = own_bucket(param);
            if shared && open {
                param_start = close(&mut layout.buckets, &mut bucket_start, param_start);
            }
            let end = param_start + numel;
            layout.placed.push(Placed {
                param,
                range: param_start..end,
            });
            open = true;
            let full = bucket_size.is_some_and(|size| end - bucket_start >= size);
            param_start = match full || shared {
                true => {
                    open = false;
                    close(&mut layout.buckets, &mut bucket_start, end)
                }
                false => end,
            };
        }
        if open {
            close(&mut layout.buckets, &mut bucket_start, param_start);
        }
        layout.buffers = vec![layout.buckets.len()];
        layout
    }

    /// The buffers of model chunks (megatron-core wraps each chunk in its own
    /// DistributedDataParallel), one after the other: a rank's shard is its slice of every
    /// bucket of every buffer, in order (the buffers' ends are padded, so the offsets keep
    /// every alignment).
    pub fn chain(layouts: Vec<BufferLayout>) -> BufferLayout {
        let mut out = BufferLayout {
            placed: Vec::new(),
            buckets: Vec::new(),
            dp: layouts.first().map_or(1, |l| l.dp),
            buffers: Vec::new(),
        };
        for l in layouts {
            let offset = out.numel();
            let shift = |r: &Range<usize>| r.start + offset..r.end + offset;
            (out.placed).extend(l.placed.iter().map(|p| Placed {
                param: p.param,
                range: shift(&p.range),
            }));
            (out.buckets).extend(l.buckets.iter().map(|b| Bucket {
                start: b.start + offset,
                end: b.end + offset,
                ..*b
            }));
            out.buffers.extend(l.buffers);
        }
        out
    }

    /// Megatron's `numel_unpadded` of each buffer.
    pub fn buffer_numel_unpadded(&self) -> Vec<usize> {
        let mut at = 0;
        (self.buffers.iter())
            .map(|&n| {
                let sum = self.buckets[at..at + n].iter().map(|b| b.unpadded).sum();
                at += n;
                sum
            })
            .collect()
    }

    /// Elements of the padded buffer.
    pub fn numel(&self) -> usize {
        self.buckets.last().map_or(0, |b| b.end)
    }

    /// Elements up to each bucket's last parameter, summed (Megatron's `numel_unpadded`).
    pub fn numel_unpadded(&self) -> usize {
        self.buckets.iter().map(|b| b.unpadded).sum()
    }

    /// Elements of one rank's shard: 1/DP of every bucket.
    pub fn shard_numel(&self) -> usize {
        self.numel() / self.dp
    }

    /// Rank `rank`'s slice of each bucket, as buffer ranges.
    pub fn slices(&self, rank: usize) -> Vec<Range<usize>> {
        (self.buckets.iter())
            .map(|b| {
                let size = (b.end - b.start) / self.dp;
                b.start + rank * size..b.start + (rank + 1) * size
            })
            .collect()
    }

    /// The pieces of parameters rank `rank` owns, in buffer order.
    pub fn pieces(&self, rank: usize) -> Vec<Piece> {
        let mut out = Vec::new();
        let mut local_start = 0;
        for slice in self.slices(rank) {
            for p in &self.placed {
                let (lo, hi) = (p.range.start.max(slice.start), p.range.end.min(slice.end));
                if lo < hi {
                    out.push(Piece {
                        param: p.param,
                        param_range: lo - p.range.start..hi - p.range.start,
                        local: local_start + lo - slice.start..local_start + hi - slice.start,
                    });
                }
            }
            local_start += slice.len();
        }
        out
    }
}

/// What the buffer holds as one upstream parameter: a parameter of the table, or the grouped
/// tensor of a layer's routed experts (`weight1` or `weight2`: its members in expert order,
/// each stored transposed after the one before).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unit {
    /// Its parameters' indices in the table.
    pub members: Vec<usize>,
    /// For a grouped tensor, each member's shape `(rows, cols)`, stored as `[cols, rows]`.
    pub transposed: Option<(usize, usize)>,
}

impl Unit {
    /// The unit's flat elements, its members' in order (transposed where grouped), from
    /// `tensors` (the table's) into `dst` from `to` on.
    fn pack<B: Backend>(
        &self,
        b: &B,
        tensors: &[B::Tensor],
        (dst, to): (&mut B::Tensor, usize),
    ) -> Result<()> {
        let mut at = to;
        for &m in &self.members {
            let n = b.shape(&tensors[m]).iter().product::<usize>();
            match self.transposed {
                Some(shape) => b.copy_transposed((&tensors[m], 0), shape, (dst, at))?,
                None => b.copy_range((&tensors[m], 0), (dst, at), n)?,
            }
            at += n;
        }
        Ok(())
    }

    /// The reverse of [`Unit::pack`]: the unit's flat elements from `src` at `at` into its
    /// members' `tensors`.
    fn unpack<B: Backend>(
        &self,
        b: &B,
        (src, at): (&B::Tensor, usize),
        tensors: &mut [B::Tensor],
    ) -> Result<()> {
        let mut from = at;
        for &m in &self.members {
            let n = b.shape(&tensors[m]).iter().product::<usize>();
            match self.transposed {
                Some((rows, cols)) => {
                    b.copy_transposed((src, from), (cols, rows), (&mut tensors[m], 0))?
                }
                None => b.copy_range((src, from), (&mut tensors[m], 0), n)?,
            }
            from += n;
        }
        Ok(())
    }
}

/// A trained parameter's place in the world tensors ([`Sharded::world_places`]).
type WorldPlace = (usize, Range<usize>, Option<(usize, usize)>);

/// Row-major `[rows, cols]` values `m` as `[cols, rows]`.
fn transpose(m: &[f32], (rows, cols): (usize, usize)) -> Vec<f32> {
    (0..cols)
        .flat_map(|c| (0..rows).map(move |r| m[r * cols + c]))
        .collect()
}

/// The units of the trained parameters `members` (table order) of `table`: each parameter, or
/// with `grouped` experts each MoE layer's routed experts' linear_fc1 weights as one unit and
/// their linear_fc2 weights as another, at their first member's place (the order
/// `GroupedMLP` registers `weight1`, `weight2`).
fn units_of(table: &ParamTable, members: &[usize], grouped: bool) -> Vec<Unit> {
    (stored_units(table, members, grouped).into_iter())
        .map(|members| {
            let shape = &table.params[members[0]].shape;
            let transposed =
                is_grouped_unit(table, &members, grouped).then(|| (shape[0], shape[1]));
            Unit {
                members,
                transposed,
            }
        })
        .collect()
}

/// `members` (table indices) split by dtype, in the order each dtype first appears: the
/// parameters of each of a model chunk's buffers (megatron-core's
/// `DistributedDataParallel.__init__` keys its buffers by parameter and gradient dtype, in
/// the order it meets them among the registered parameters).
fn by_dtype(table: &ParamTable, members: &[usize]) -> Vec<Vec<usize>> {
    let mut groups: Vec<(DType, Vec<usize>)> = Vec::new();
    for &i in members {
        let dtype = table.params[i].dtype;
        match groups.iter_mut().find(|(d, _)| *d == dtype) {
            Some((_, group)) => group.push(i),
            None => groups.push((dtype, vec![i])),
        }
    }
    groups.into_iter().map(|(_, group)| group).collect()
}

/// A data-parallel rank's part of the distributed optimizer: its pieces of the trained
/// parameters with their f32 main copies, gradients and Adam state.
pub struct Sharded<T> {
    /// The buffer layout (the same on every data-parallel rank), over [`Sharded::units`].
    pub layout: BufferLayout,
    /// What the buffer holds, each an upstream parameter.
    pub units: Vec<Unit>,
    /// Each buffer's parameter dtype.
    pub dtypes: Vec<DType>,
    /// This rank's data-parallel rank.
    pub rank: usize,
    /// The pieces it owns.
    pub pieces: Vec<Piece>,
    /// Their f32 main parameters (Megatron's `shard_fp32_from_float16_groups` / `shard_fp32_groups`).
    pub main: Vec<T>,
    /// Their gradients, summed over the data-parallel ranks.
    pub grads: Vec<T>,
    /// Adam over the pieces.
    pub opt: Optimizer<T>,
}

/// A bucket with what this rank has of it (see [`Sharded::buckets`]).
struct BucketParts {
    bucket: Bucket,
    placed: Range<usize>,
    pieces: Range<usize>,
    slice_start: usize,
}

impl BucketParts {
    /// This rank's pieces of the bucket: each one's index, where it starts in the rank's part
    /// of the bucket, and its length.
    fn offsets<'a>(
        &'a self,
        pieces: &'a [Piece],
    ) -> impl Iterator<Item = (usize, usize, usize)> + 'a {
        (self.pieces.clone()).map(move |k| {
            let local = &pieces[k].local;
            (k, local.start - self.slice_start, local.len())
        })
    }
}

/// A group's collectives on a backend's tensors.
type Group<'a, T> = Option<&'a dyn Communicator<Tensor = T>>;

impl<T> Sharded<T> {
    /// Rank `rank` of `dp`'s part of the trained parameters of `table` that are in `part`
    /// (`params`, their values; with `grouped` experts, in [`Unit`]s): a buffer per model chunk, the first one's
    /// in buckets of `bucket_size` elements (megatron-core's DDP disables bucketing after the
    /// first chunk), `own_bucket` marking a pipeline's shared embedding; a chunk with nothing to
    /// train has no buffer.
    pub fn new<B: Backend<Tensor = T>>(
        b: &B,
        (table, params, grouped, part): (&ParamTable, &[T], bool, impl Fn(usize) -> bool),
        (rank, dp): (usize, usize),
        (bucket_size, pad_high, own_bucket): (Option<usize>, bool, impl Fn(usize) -> bool),
        config: AdamConfig,
    ) -> Result<Self> {
        let chunks = table.params.last().map_or(0, |p| p.chunk + 1);
        let mut units: Vec<Unit> = Vec::new();
        let mut layouts = Vec::with_capacity(chunks);
        let mut dtypes = Vec::with_capacity(chunks);
        for v in 0..chunks {
            let members: Vec<usize> = (table.params.iter().enumerate())
                .filter(|&(i, p)| p.trainable && p.chunk == v && part(i))
                .map(|(i, _)| i)
                .collect();
            for members in by_dtype(table, &members) {
                dtypes.push(table.params[members[0]].dtype);
                let first = units.len();
                units.extend(units_of(table, &members, grouped));
                let trained: Vec<(usize, usize)> = (first..units.len())
                    .map(|u| {
                        let numel = units[u].members.iter().map(|&m| table.params[m].numel());
                        (u, numel.sum())
                    })
                    .collect();
                let size = bucket_size.filter(|_| v == 0);
                let own = |u: usize| own_bucket(units[u].members[0]);
                layouts.push(BufferLayout::new(&trained, dp, (size, pad_high), own));
            }
        }
        let layout = BufferLayout::chain(layouts);
        let pieces = layout.pieces(rank);
        let mut main = Vec::with_capacity(pieces.len());
        for piece in &pieces {
            // its range of the unit's elements, widened to f32 on the device
            let unit = &units[piece.param];
            let n = piece.param_range.len();
            let mut m = b.zeros(&[n], DType::F32)?;
            match (unit.members.as_slice(), unit.transposed) {
                (&[one], None) => {
                    b.copy_range((&params[one], piece.param_range.start), (&mut m, 0), n)?
                }
                (members, _) => {
                    let numel = members.iter().map(|&p| table.params[p].numel()).sum();
                    let mut flat = b.zeros(&[numel], DType::F32)?;
                    unit.pack(b, params, (&mut flat, 0))?;
                    b.copy_range((&flat, piece.param_range.start), (&mut m, 0), n)?;
                }
            }
            main.push(m);
        }
        let grads = (main.iter())
            .map(|m| b.zeros(b.shape(m), DType::F32))
            .collect::<Result<Vec<_>>>()?;
        let piece_table = ParamTable {
            params: (pieces.iter())
                .map(|piece| ParamInfo {
                    shape: vec![piece.param_range.len()],
                    ..table.params[units[piece.param].members[0]].clone()
                })
                .collect(),
            vocab_padded: table.vocab_padded,
            decoder_layers: table.decoder_layers,
            activation: table.activation,
        };
        let opt = Optimizer::new(b, &piece_table, &main, vec![true; pieces.len()], config)?;
        Ok(Sharded {
            layout,
            units,
            dtypes,
            rank,
            pieces,
            main,
            grads,
            opt,
        })
    }

    /// The table index of a piece's parameter (a grouped unit's first expert: its members
    /// share every setting).
    pub fn table_param(&self, piece: &Piece) -> usize {
        self.units[piece.param].members[0]
    }

    /// Sum the trained parameters' gradients `grads` over the data-parallel group `dp` into
    /// this rank's pieces: each bucket of the flat buffer assembled on the device and
    /// reduce-scattered (Megatron's `start_grad_sync`), the pieces cut from this rank's part.
    pub fn reduce_scatter<B: Backend<Tensor = T>>(
        &mut self,
        b: &B,
        grads: &[T],
        dp: Group<'_, T>,
    ) -> Result<()> {
        for parts in self.buckets().collect::<Vec<_>>() {
            let bucket = parts.bucket;
            let mut whole = b.zeros(&[bucket.end - bucket.start], DType::F32)?;
            for p in &self.layout.placed[parts.placed.clone()] {
                let at = p.range.start - bucket.start;
                self.units[p.param].pack(b, grads, (&mut whole, at))?;
            }
            let part = match dp {
                Some(dp) => {
                    let mut part =
                        b.zeros(&[(bucket.end - bucket.start) / dp.size()], DType::F32)?;
                    dp.reduce_scatter(&whole, &mut part, ReduceOp::Sum)?;
                    part
                }
                None => whole,
            };
            for (k, at, n) in parts.offsets(&self.pieces) {
                b.copy_range((&part, at), (&mut self.grads[k], 0), n)?;
            }
        }
        Ok(())
    }

    /// Every rank's updated main pieces into the trained `params`: this rank's slice of each
    /// bucket cast to its parameters' dtype on the device and all-gathered over `dp`
    /// (Megatron's `_copy_main_params_to_model_params`, then `start_param_sync`), each
    /// parameter copied out of its bucket.
    pub fn gather_params<B: Backend<Tensor = T>>(
        &self,
        b: &B,
        params: &mut [T],
        dp: Group<'_, T>,
    ) -> Result<()> {
        for parts in self.buckets() {
            let bucket = parts.bucket;
            // a buffer's parameters share one dtype
            let first = &self.layout.placed[parts.placed.start];
            let dtype = b.dtype(&params[self.units[first.param].members[0]]);
            let mut mine = b.zeros(&[(bucket.end - bucket.start) / self.layout.dp], dtype)?;
            for (k, at, n) in parts.offsets(&self.pieces) {
                b.copy_range((&self.main[k], 0), (&mut mine, at), n)?;
            }
            let whole = match dp {
                Some(dp) => {
                    let mut whole = b.zeros(&[bucket.end - bucket.start], dtype)?;
                    dp.all_gather(&mine, &mut whole)?;
                    whole
                }
                None => mine,
            };
            for p in &self.layout.placed[parts.placed.clone()] {
                let at = p.range.start - bucket.start;
                self.units[p.param].unpack(b, (&whole, at), params)?;
            }
        }
        Ok(())
    }

    /// Each bucket with the parameters it holds (a range of `layout.placed`), this rank's
    /// pieces of it (a range of `pieces`) and where its slice starts in the rank's shard.
    fn buckets(&self) -> impl Iterator<Item = BucketParts> + '_ {
        let (mut placed, mut pieces, mut local) = (0, 0, 0);
        (self.layout.buckets.iter()).map(move |&bucket| {
            let (first_placed, first_piece, slice_start) = (placed, pieces, local);
            while (self.layout.placed.get(placed)).is_some_and(|p| p.range.end <= bucket.end) {
                placed += 1;
            }
            local += (bucket.end - bucket.start) / self.layout.dp;
            while (self.pieces.get(pieces)).is_some_and(|p| p.local.start < local) {
                pieces += 1;
            }
            BucketParts {
                bucket,
                placed: first_placed..placed,
                pieces: first_piece..pieces,
                slice_start,
            }
        })
    }

    /// The state of every rank's pieces on data-parallel rank 0, as Megatron's
    /// `get_parameter_state_dp_zero` writes it: main parameters, first and second moments,
    /// each the buffer's buckets up to their last parameter (alignment gaps zero); `None` on
    /// the other ranks, which send theirs.
    pub fn gathered_state<B: Backend<Tensor = T>>(
        &self,
        b: &B,
        dp: Group<'_, T>,
    ) -> Result<Option<[Vec<f32>; 3]>> {
        let mut out: [Vec<f32>; 3] = Default::default();
        for (k, pieces) in [&self.main, &self.opt.exp_avg, &self.opt.exp_avg_sq]
            .into_iter()
            .enumerate()
        {
            let shard = self.shard_of(b, pieces)?;
            let all = match dp {
                Some(dp) => {
                    let mut all = b.zeros(&[b.shape(&shard)[0] * dp.size()], DType::F32)?;
                    dp.all_gather(&shard, &mut all)?;
                    all
                }
                None => shard,
            };
            out[k] = self.world(&b.download_f32(&all)?);
        }
        Ok((self.rank == 0).then_some(out))
    }

    /// This rank's shard holding `tensors`, one per piece, each at its place (assembled on
    /// the device, the gaps zero).
    fn shard_of<B: Backend<Tensor = T>>(&self, b: &B, tensors: &[T]) -> Result<T> {
        let mut shard = b.zeros(&[self.layout.shard_numel()], DType::F32)?;
        for (piece, t) in self.pieces.iter().zip(tensors) {
            let n = piece.local.len();
            b.copy_range((t, 0), (&mut shard, piece.local.start), n)?;
        }
        Ok(shard)
    }

    /// Every rank's shard concatenated (rank order) as the world tensor: each bucket's
    /// elements up to its last parameter (with several buffers, theirs one after the other).
    fn world(&self, shards: &[f32]) -> Vec<f32> {
        let per_rank = self.layout.shard_numel();
        let mut world = Vec::with_capacity(self.layout.numel_unpadded());
        let mut at = 0;
        for bucket in &self.layout.buckets {
            let size = (bucket.end - bucket.start) / self.layout.dp;
            let whole: Vec<f32> = (0..self.layout.dp)
                .flat_map(|r| {
                    shards[r * per_rank + at..r * per_rank + at + size]
                        .iter()
                        .copied()
                })
                .collect();
            world.extend_from_slice(&whole[..bucket.unpadded]);
            at += size;
        }
        world
    }

    /// Where buffer element `at` sits in the world tensors ([`Sharded::world`]: each bucket
    /// up to its last parameter, one after the other).
    fn world_at(&self, at: usize) -> Result<usize> {
        let mut before = 0;
        for bucket in &self.layout.buckets {
            if (bucket.start..bucket.end).contains(&at) {
                return Ok(before + at - bucket.start);
            }
            before += bucket.unpadded;
        }
        Err(EngineError::Invalid {
            op: "distributed optimizer",
            msg: "internal: an element outside the buffer".into(),
        })
    }

    /// Each trained parameter's place in the world tensors: its index in the table, its
    /// elements there, and for a member of a grouped unit its shape `(rows, cols)`, stored
    /// transposed after the member before it.
    fn world_places(&self) -> Result<Vec<WorldPlace>> {
        let mut places = Vec::new();
        for p in &self.layout.placed {
            let unit = &self.units[p.param];
            let from = self.world_at(p.range.start)?;
            let each = p.range.len() / unit.members.len();
            for (k, &param) in unit.members.iter().enumerate() {
                let at = from + k * each;
                places.push((param, at..at + each, unit.transposed));
            }
        }
        Ok(places)
    }

    /// The trained parameters' main copies, first and second moments (f32, flat, in their
    /// own shapes) cut from world tensors of [`Sharded::gathered_state`], by table index.
    pub fn param_states(&self, world: &[Vec<f32>; 3]) -> Result<Vec<(usize, [Vec<f32>; 3])>> {
        let places = self.world_places()?;
        let state = |(param, r, transposed): WorldPlace| {
            let cut = |w: &Vec<f32>| match transposed {
                // stored [cols, rows]
                Some((rows, cols)) => transpose(&w[r.clone()], (cols, rows)),
                None => w[r.clone()].to_vec(),
            };
            (param, [cut(&world[0]), cut(&world[1]), cut(&world[2])])
        };
        Ok(places.into_iter().map(state).collect())
    }

    /// The world tensors ([`Sharded::gathered_state`]'s form) holding the trained parameters'
    /// main copies and moments given by table index (`states`), for [`Sharded::load`].
    pub fn world_of(
        &self,
        states: &dyn Fn(usize) -> Option<[Vec<f32>; 3]>,
    ) -> Result<[Vec<f32>; 3]> {
        let mut world: [Vec<f32>; 3] = Default::default();
        world
            .iter_mut()
            .for_each(|w| w.resize(self.layout.numel_unpadded(), 0.0));
        for (param, r, transposed) in self.world_places()? {
            let got = states(param).ok_or_else(|| EngineError::Invalid {
                op: "distributed optimizer",
                msg: format!("internal: no state for parameter {param}"),
            })?;
            for (w, s) in world.iter_mut().zip(&got) {
                match transposed {
                    Some(shape) => w[r.clone()].copy_from_slice(&transpose(s, shape)),
                    None => w[r.clone()].copy_from_slice(s),
                }
            }
        }
        Ok(world)
    }

    /// Load this rank's pieces of main parameters and moments from the world tensors of a
    /// `distrib_optim.pt` ([`Sharded::gathered_state`]'s form), after `steps` steps.
    pub fn load<B: Backend<Tensor = T>>(
        &mut self,
        b: &B,
        world: [&[f32]; 3],
        steps: u64,
    ) -> Result<()> {
        let placed: std::collections::HashMap<usize, usize> = (self.layout.placed.iter())
            .map(|p| (p.param, p.range.start))
            .collect();
        for (i, piece) in self.pieces.iter().enumerate() {
            let from = self.world_at(placed[&piece.param] + piece.param_range.start)?;
            let slice = from..from + piece.param_range.len();
            let n = [piece.param_range.len()];
            self.main[i] = b.upload_f32(&n, &world[0][slice.clone()])?;
            self.opt.exp_avg[i] = b.upload_f32(&n, &world[1][slice.clone()])?;
            self.opt.exp_avg_sq[i] = b.upload_f32(&n, &world[2][slice])?;
        }
        self.opt.steps = steps;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameters_are_laid_out_in_reverse_at_multiples_of_64() {
        // named_parameters A (100), B (30), C (10) over 4 ranks: C [0, 10), B [64, 94),
        // A [128, 228); one bucket padded to 256; 64 elements a rank.
        let layout = BufferLayout::new(&[(0, 100), (1, 30), (2, 10)], 4, (None, false), |_| false);
        let ranges: Vec<_> = layout.placed.iter().map(|p| p.range.clone()).collect();
        assert_eq!(ranges, [0..10, 64..94, 128..228]);
        assert_eq!((layout.numel(), layout.numel_unpadded()), (256, 228));
        assert_eq!(layout.shard_numel(), 64);
        // rank 2 owns [128, 192): A's first 64 elements
        assert_eq!(
            layout.pieces(2),
            [Piece {
                param: 0,
                param_range: 0..64,
                local: 0..64
            }]
        );
        // rank 1 owns [64, 128): B whole
        assert_eq!(layout.pieces(1)[0].param_range, 0..30);
    }

    #[test]
    fn model_chunks_buffers_lie_end_to_end() {
        // chunk 0: A (100) in a bucket padded to 128; chunk 1: B (30), C (10) from 128 on
        let first = BufferLayout::new(&[(0, 100)], 2, (None, false), |_| false);
        let second = BufferLayout::new(&[(1, 30), (2, 10)], 2, (None, false), |_| false);
        let chained = BufferLayout::chain(vec![first, second]);
        let ranges: Vec<_> = chained.placed.iter().map(|p| p.range.clone()).collect();
        assert_eq!(ranges, [0..100, 128..138, 192..222]);
        assert_eq!(chained.buffers, [1, 1]);
        assert_eq!(chained.buffer_numel_unpadded(), [100, 94]);
        // rank 1's shard: [64, 128) of the first buffer, [192, 256) of the second
        let pieces = chained.pieces(1);
        assert_eq!(
            (pieces[0].param, pieces[0].param_range.clone()),
            (0, 64..100)
        );
        assert_eq!((pieces[1].param, pieces[1].local.clone()), (1, 64..94));
    }

    #[test]
    fn buckets_close_at_their_size_and_around_a_shared_embedding() {
        // embedding (0) shared: a bucket of its own, after the others' bucket closes
        let params = [(0, 300), (1, 50), (2, 70)];
        let layout = BufferLayout::new(&params, 2, (None, false), |p| p == 0);
        assert_eq!(
            layout.buckets,
            [
                Bucket {
                    start: 0,
                    end: 256,
                    unpadded: 192
                },
                Bucket {
                    start: 256,
                    end: 640,
                    unpadded: 300
                }
            ]
        );
        // bucket size 60: parameter 2 (70) fills the first bucket, 1 and 0 the next
        let sized = BufferLayout::new(&params, 2, (Some(60), false), |_| false);
        assert_eq!(sized.buckets.len(), 2);
        assert_eq!(sized.buckets[1].start, 128);
        assert_eq!(sized.placed[1].range, 128..178);
        // padded for NCCL's bus bandwidth: one bucket of 65536
        let high = BufferLayout::new(&params, 2, (None, true), |_| false);
        assert_eq!((high.numel(), high.numel_unpadded()), (65536, 492));
        // every element of every parameter is owned by exactly one rank
        for layout in [&layout, &sized, &high] {
            let mut owned = [0usize; 3];
            for r in 0..2 {
                for piece in layout.pieces(r) {
                    owned[piece.param] += piece.param_range.len();
                }
            }
            assert_eq!(owned, [300, 50, 70]);
        }
    }
}
