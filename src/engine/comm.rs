//! The collectives parallel training runs over (Megatron's process groups: one group per
//! tensor-, pipeline- and data-parallel set of ranks), on a backend's tensors: all-reduce,
//! all-gather, reduce-scatter, broadcast, send and receive, as NCCL and HCCL define them. Two
//! implementations: ranks as threads of one process on the CPU backend
//! ([`crate::engine::cpu::comm`]) and HCCL across NPUs (`crate::npu::comm`).
//!
//! Every rank of a group calls the same collectives in the same order with the same sizes;
//! a call whose ranks disagree fails on all of them, naming the ranks and the values, and a
//! rank that left the group, or does not arrive within the group's timeout, fails the call on
//! the others — a job never hangs on a dead rank.
//!
//! Host values — a scalar sum, a flag, the loss sums of a batch, a directory's name — have
//! collectives of their own ([`Communicator::all_reduce_f32`], [`Communicator::all_gather_bytes`],
//! [`Communicator::broadcast_bytes`] and those built on them), so that callers never stage them
//! in tensors; where a communicator moves device memory only (HCCL), its implementation stages
//! them in one small device buffer.

use super::{EngineError, Result};
use crate::tensor::DType;
use std::cell::RefCell;
use std::collections::BTreeMap;

/// The reduction of [`Communicator::all_reduce`] and [`Communicator::reduce_scatter`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    /// Σ over the ranks (gradients, loss sums).
    Sum,
    /// The largest (found-inf flags, the max norm).
    Max,
}

/// The most bytes a host-value collective carries from one rank: host values are scalars,
/// flags, names and a batch's loss sums, never tensors. A call over it fails on every rank.
pub const MAX_HOST_BYTES: usize = 1 << 20;

/// Collectives among the ranks of one group.
pub trait Communicator {
    /// The backend's tensor.
    type Tensor;

    /// This rank's place in the group, `0..size`.
    fn rank(&self) -> usize;

    /// The ranks in the group.
    fn size(&self) -> usize;

    /// `x = op` over every rank's `x` (each rank gets the same result).
    fn all_reduce(&self, x: &mut Self::Tensor, op: ReduceOp) -> Result<()>;

    /// `out` = every rank's `x` in rank order, concatenated along the first dimension
    /// (`out` holds `size` times `x`'s elements).
    fn all_gather(&self, x: &Self::Tensor, out: &mut Self::Tensor) -> Result<()>;

    /// `out` = this rank's block (`x`'s elements split `size` ways, in rank order) of `op`
    /// over every rank's `x`.
    fn reduce_scatter(&self, x: &Self::Tensor, out: &mut Self::Tensor, op: ReduceOp) -> Result<()>;

    /// `x` = rank `root`'s `x`.
    fn broadcast(&self, x: &mut Self::Tensor, root: usize) -> Result<()>;

    /// Send `x` to rank `to` (its matching [`Communicator::recv`] takes it).
    fn send(&self, x: &Self::Tensor, to: usize) -> Result<()>;

    /// `x` = what rank `from` sends next (the same number of elements and dtype).
    fn recv(&self, x: &mut Self::Tensor, from: usize) -> Result<()>;

    /// `values = op` over every rank's host `values` (as many on each), in f32 with the bits
    /// an all-reduce of an f32 tensor of them gives on this communicator: summed in rank
    /// order on the CPU, in HCCL's order on NPUs (where Megatron's f32 all-reduces of its
    /// norms, counts and flags run too).
    fn all_reduce_f32(&self, values: &mut [f32], op: ReduceOp) -> Result<()>;

    /// Every rank's host `bytes` in rank order, concatenated. Every rank hands in as many, at
    /// most [`MAX_HOST_BYTES`]; ranks whose lengths disagree fail together, naming them.
    fn all_gather_bytes(&self, bytes: &[u8]) -> Result<Vec<u8>>;

    /// `bytes` = rank `root`'s host bytes, at most [`MAX_HOST_BYTES`] (more fails on every
    /// rank). The root's length travels first: the other ranks' `bytes`, of any length, are
    /// replaced.
    fn broadcast_bytes(&self, bytes: &mut Vec<u8>, root: usize) -> Result<()>;

    /// `values = op` over every rank's host `values` (as many on each), in f64, in rank
    /// order: the same bits on every communicator (gathered with
    /// [`Communicator::all_gather_bytes`], then reduced here — HCCL reduces no f64).
    fn all_reduce_f64(&self, values: &mut [f64], op: ReduceOp) -> Result<()> {
        let mine: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let all: Vec<f64> = (self.all_gather_bytes(&mine)?.chunks_exact(8))
            .map(|b| f64::from_le_bytes(b.try_into().expect("8 bytes")))
            .collect();
        let n = values.len().max(1);
        for (i, v) in values.iter_mut().enumerate() {
            // rank r's i-th value is at r·n + i
            let mut by_rank = all.iter().skip(i).step_by(n).copied();
            *v = by_rank.next().unwrap_or(*v);
            for x in by_rank {
                *v = match op {
                    ReduceOp::Sum => *v + x,
                    ReduceOp::Max => v.max(x),
                };
            }
        }
        Ok(())
    }

    /// Every rank's host `values` in rank order, concatenated (as many on each: an
    /// [`Communicator::all_gather_bytes`] of them).
    fn all_gather_f32(&self, values: &[f32]) -> Result<Vec<f32>> {
        Ok(floats(&self.all_gather_bytes(&float_bytes(values))?))
    }

    /// `values` = rank `root`'s host `values` (a [`Communicator::broadcast_bytes`] of them); a
    /// rank expecting another number of them than the root sends fails, naming both.
    fn broadcast_f32(&self, values: &mut [f32], root: usize) -> Result<()> {
        let mut bytes = float_bytes(values);
        self.broadcast_bytes(&mut bytes, root)?;
        if bytes.len() != 4 * values.len() {
            return Err(EngineError::Collective {
                rank: self.rank(),
                msg: format!(
                    "broadcast_f32: rank {root} sends {} bytes, rank {} expects {} values",
                    bytes.len(),
                    self.rank(),
                    values.len()
                ),
            });
        }
        values.copy_from_slice(&floats(&bytes));
        Ok(())
    }
}

/// f32 values as little-endian bytes.
fn float_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Little-endian bytes as f32 values (a trailing partial value is dropped).
fn floats(bytes: &[u8]) -> Vec<f32> {
    (bytes.chunks_exact(4))
        .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
        .collect()
}

/// What a tensor weighs when handed to a collective: its elements × its dtype's bytes.
pub trait Payload {
    /// The bytes.
    fn payload_bytes(&self) -> u64;
}

/// Calls and bytes of one collective.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Count {
    /// How many calls.
    pub calls: u64,
    /// The bytes this rank handed in: the tensor of an all-reduce, a broadcast or a send, this
    /// rank's part of an all-gather, the whole input of a reduce-scatter (NCCL's and HCCL's
    /// buffer sizes; a ring moves about 2(n−1)/n of an all-reduce's over each link).
    pub bytes: u64,
}

/// A communicator that counts what each of its collectives moves (`--log-comm-stats`).
pub struct Counted<T> {
    inner: Box<dyn Communicator<Tensor = T>>,
    counts: RefCell<BTreeMap<&'static str, Count>>,
}

impl<T: Payload> Counted<T> {
    /// Count the calls of `inner`.
    pub fn new(inner: Box<dyn Communicator<Tensor = T>>) -> Self {
        Counted {
            inner,
            counts: RefCell::new(BTreeMap::new()),
        }
    }

    /// The communicator itself, for calls that are not the training's (a checkpoint's
    /// handshake), left out of the counts.
    pub fn uncounted(&self) -> &dyn Communicator<Tensor = T> {
        &*self.inner
    }

    /// The counts since the last take, by collective, then zero.
    pub fn take(&self) -> BTreeMap<&'static str, Count> {
        std::mem::take(&mut *self.counts.borrow_mut())
    }

    fn count(&self, name: &'static str, x: &T) {
        self.tally(name, x.payload_bytes());
    }

    fn tally(&self, name: &'static str, bytes: u64) {
        let mut counts = self.counts.borrow_mut();
        let c = counts.entry(name).or_default();
        c.calls += 1;
        c.bytes += bytes;
    }
}

impl<T: Payload> Communicator for Counted<T> {
    type Tensor = T;

    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn size(&self) -> usize {
        self.inner.size()
    }

    fn all_reduce(&self, x: &mut T, op: ReduceOp) -> Result<()> {
        self.count("all_reduce", x);
        self.inner.all_reduce(x, op)
    }

    fn all_gather(&self, x: &T, out: &mut T) -> Result<()> {
        self.count("all_gather", x);
        self.inner.all_gather(x, out)
    }

    fn reduce_scatter(&self, x: &T, out: &mut T, op: ReduceOp) -> Result<()> {
        self.count("reduce_scatter", x);
        self.inner.reduce_scatter(x, out, op)
    }

    fn broadcast(&self, x: &mut T, root: usize) -> Result<()> {
        self.count("broadcast", x);
        self.inner.broadcast(x, root)
    }

    fn send(&self, x: &T, to: usize) -> Result<()> {
        self.count("send", x);
        self.inner.send(x, to)
    }

    fn recv(&self, x: &mut T, from: usize) -> Result<()> {
        self.count("recv", x);
        self.inner.recv(x, from)
    }

    // Host values count as the collective they are, by the bytes they weigh (an f32 as 4, as
    // the tensor that carried it before counted it).

    fn all_reduce_f32(&self, values: &mut [f32], op: ReduceOp) -> Result<()> {
        self.tally("all_reduce", 4 * values.len() as u64);
        self.inner.all_reduce_f32(values, op)
    }

    fn all_gather_bytes(&self, bytes: &[u8]) -> Result<Vec<u8>> {
        self.tally("all_gather", bytes.len() as u64);
        self.inner.all_gather_bytes(bytes)
    }

    fn broadcast_bytes(&self, bytes: &mut Vec<u8>, root: usize) -> Result<()> {
        // only the root knows the length before the call
        let done = self.inner.broadcast_bytes(bytes, root);
        self.tally("broadcast", bytes.len() as u64);
        done
    }

    fn all_reduce_f64(&self, values: &mut [f64], op: ReduceOp) -> Result<()> {
        self.tally("all_reduce", 8 * values.len() as u64);
        self.inner.all_reduce_f64(values, op)
    }
}

/// A tensor's shape and dtype, as the checks below see it.
pub(crate) type Layout<'a> = (&'a [usize], DType);

/// `x` holds `times` × `y`'s elements of the same dtype (all-gather's output, reduce-scatter's
/// input, over a group of `times`), or an error naming the collective.
pub(crate) fn expect_multiple(
    op: &'static str,
    (x, y): (Layout, Layout),
    times: usize,
) -> Result<()> {
    let numel = |l: Layout| l.0.iter().product::<usize>();
    if numel(x) == times * numel(y) && x.1 == y.1 {
        return Ok(());
    }
    Err(EngineError::Invalid {
        op,
        msg: format!(
            "{:?} {:?} is not {times} × {:?} {:?} ({times} ranks)",
            x.0, x.1, y.0, y.1
        ),
    })
}

/// `peer` is a rank of the group of `size` other than `rank` (send/recv), or `rank` itself
/// may be (`may_be_self`: a broadcast's root).
pub(crate) fn expect_rank(
    op: &'static str,
    peer: usize,
    (rank, size): (usize, usize),
    may_be_self: bool,
) -> Result<()> {
    if peer < size && (may_be_self || peer != rank) {
        return Ok(());
    }
    Err(EngineError::Invalid {
        op,
        msg: format!(
            "rank {peer} is not {} rank of this group of {size}",
            if may_be_self { "a" } else { "another" }
        ),
    })
}
