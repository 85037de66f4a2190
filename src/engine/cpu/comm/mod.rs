//! The CPU backend's [`Communicator`]: one [`Group`] of collectives over a [`Link`] between the
//! ranks — threads of one process ([`threads`], from `mindkit train --world-size N`) or
//! processes joined by TCP sockets ([`sockets`], one per rank under torchrun or Slurm).
//!
//! A collective brings each rank's values, under the call's sequence number, to every rank;
//! each rank computes its result from all of them in rank order, so every rank gets the same
//! bits whatever the link (sums accumulate in f32 in rank order, halves rounded once, as the
//! HCCL stand-in does). Ranks whose calls differ fail together, naming both calls. Host
//! values travel as they are: f32 values as a tensor's do, bytes as bytes.

pub mod sockets;
pub mod threads;

pub use sockets::{socket_group, SocketComm};
pub use threads::{thread_group, ThreadComm};

use super::CpuTensor;
use crate::engine::comm::{
    expect_multiple, expect_rank, Communicator, Layout, Payload, ReduceOp, MAX_HOST_BYTES,
};
use crate::engine::{EngineError, Result};
use crate::tensor::DType;
use std::cell::Cell;
use std::fmt;
use std::sync::Arc;

/// How the ranks of a group reach each other.
pub trait Link {
    /// This rank's place in the group.
    fn rank(&self) -> usize;
    /// The ranks in the group.
    fn size(&self) -> usize;
    /// Bring `part` to collective number `seq`; every rank's part, in rank order, once all
    /// are there (`what` names the call in errors).
    fn exchange(&self, seq: u64, what: &str, part: Part) -> Result<Vec<Part>>;
    /// Leave `part` for rank `to`, without waiting for it to be taken.
    fn post(&self, to: usize, part: Part) -> Result<()>;
    /// The next part rank `from` posted to this rank.
    fn take(&self, from: usize) -> Result<Part>;
}

/// What a rank brings to a call: the call as it sees it, and its values.
#[derive(Clone)]
pub struct Part {
    call: Signature,
    values: Values,
}

/// A part's values: f32 for a tensor's (the CPU backend holds every dtype's values so) and an
/// f32 host all-reduce's, bytes for the host byte collectives ([`Kind::carries_bytes`]). The
/// call's kind says which, and every rank's part agrees on the call before any is read.
#[derive(Clone)]
enum Values {
    Floats(Arc<Vec<f32>>),
    Bytes(Arc<Vec<u8>>),
}

impl Part {
    fn new(call: Signature, values: Values) -> Self {
        Part { call, values }
    }

    /// Its f32 values (none when it carries bytes).
    fn floats(&self) -> &[f32] {
        match &self.values {
            Values::Floats(v) => v,
            Values::Bytes(_) => &[],
        }
    }

    /// Its bytes (none when it carries f32 values).
    fn bytes(&self) -> &[u8] {
        match &self.values {
            Values::Bytes(b) => b,
            Values::Floats(_) => &[],
        }
    }
}

/// A call as one rank makes it: every rank's must be equal.
#[derive(Clone, Copy, PartialEq, Debug)]
struct Signature {
    kind: Kind,
    count: usize,
    dtype: DType,
    op: Option<ReduceOp>,
    root: Option<usize>,
}

/// The collectives, and point-to-point messages (the order is their code on the wire).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    AllReduce,
    AllGather,
    ReduceScatter,
    Broadcast,
    Send,
    GatherBytes,
    BroadcastBytes,
}

impl Kind {
    const ALL: [Kind; 7] = [
        Kind::AllReduce,
        Kind::AllGather,
        Kind::ReduceScatter,
        Kind::Broadcast,
        Kind::Send,
        Kind::GatherBytes,
        Kind::BroadcastBytes,
    ];

    fn name(self) -> &'static str {
        match self {
            Kind::AllReduce => "all_reduce",
            Kind::AllGather => "all_gather",
            Kind::ReduceScatter => "reduce_scatter",
            Kind::Broadcast => "broadcast",
            Kind::Send => "send",
            Kind::GatherBytes => "all_gather_bytes",
            Kind::BroadcastBytes => "broadcast_bytes",
        }
    }

    /// Whether its parts carry bytes (else f32 values).
    fn carries_bytes(self) -> bool {
        matches!(self, Kind::GatherBytes | Kind::BroadcastBytes)
    }
}

impl fmt::Display for Signature {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.kind.name())?;
        // a byte broadcast's length is the root's alone to know
        if self.kind != Kind::BroadcastBytes {
            write!(f, " of {} {:?}", self.count, self.dtype)?;
        }
        if let Some(op) = self.op {
            write!(f, " ({op:?})")?;
        }
        if let Some(root) = self.root {
            write!(f, " from rank {root}")?;
        }
        Ok(())
    }
}

impl Payload for CpuTensor {
    fn payload_bytes(&self) -> u64 {
        (self.numel() * self.dtype().size()) as u64
    }
}

/// The error of a collective on `rank`.
fn collective_error(rank: usize, msg: String) -> EngineError {
    EngineError::Collective { rank, msg }
}

/// Collectives among the ranks of one group, over link `L`. Dropping it leaves the group: the
/// other ranks' calls that wait for it fail.
pub struct Group<L: Link> {
    link: L,
    /// The sequence number of this rank's next collective.
    next: Cell<u64>,
}

impl<L: Link> Group<L> {
    fn new(link: L) -> Self {
        Group {
            link,
            next: Cell::new(0),
        }
    }

    /// Bring `values` to the next collective, described by `call`; every rank's part, in rank
    /// order, once all are there and agree.
    fn exchange(&self, call: Signature, values: Values) -> Result<Vec<Part>> {
        let seq = self.next.replace(self.next.get() + 1);
        let what = format!("{} #{seq}", call.kind.name());
        let parts = self.link.exchange(seq, &what, Part::new(call, values))?;
        match parts.iter().position(|p| p.call != call) {
            Some(r) => Err(collective_error(
                self.link.rank(),
                format!(
                    "{what}: ranks disagree: rank {} calls {call}, rank {r} calls {}",
                    self.link.rank(),
                    parts[r].call
                ),
            )),
            None => Ok(parts),
        }
    }

    /// `op` over every part's values, in rank order.
    fn reduce(parts: &[Part], op: ReduceOp) -> Vec<f32> {
        let mut acc = parts[0].floats().to_vec();
        for p in &parts[1..] {
            for (a, &v) in acc.iter_mut().zip(p.floats()) {
                *a = match op {
                    ReduceOp::Sum => *a + v,
                    ReduceOp::Max => a.max(v),
                };
            }
        }
        acc
    }

    fn call(&self, kind: Kind, x: &CpuTensor) -> Signature {
        Self::call_of(kind, x.numel(), x.dtype())
    }

    fn call_of(kind: Kind, count: usize, dtype: DType) -> Signature {
        Signature {
            kind,
            count,
            dtype,
            op: None,
            root: None,
        }
    }

    /// `op` over every rank's f32 `values` (an all-reduce of `count` elements of `dtype`).
    fn all_reduce_values(
        &self,
        (count, dtype): (usize, DType),
        values: Vec<f32>,
        op: ReduceOp,
    ) -> Result<Vec<f32>> {
        let call = Signature {
            op: Some(op),
            ..Self::call_of(Kind::AllReduce, count, dtype)
        };
        let parts = self.exchange(call, floats(values))?;
        Ok(Self::reduce(&parts, op))
    }

    /// A host collective's `bytes` from `whom` within [`MAX_HOST_BYTES`], or the error every
    /// rank of the call gives alike (checked once the call's parts are in: no rank fails alone).
    fn within_bound(&self, kind: Kind, bytes: usize, whom: &str) -> Result<()> {
        if bytes <= MAX_HOST_BYTES {
            return Ok(());
        }
        Err(collective_error(
            self.rank(),
            format!(
                "{}: {bytes} bytes from {whom}, more than the {MAX_HOST_BYTES} a host-value collective carries",
                kind.name()
            ),
        ))
    }
}

fn floats(values: Vec<f32>) -> Values {
    Values::Floats(Arc::new(values))
}

fn layout(x: &CpuTensor) -> Layout<'_> {
    (&x.shape, x.dtype())
}

impl<L: Link> Communicator for Group<L> {
    type Tensor = CpuTensor;

    fn rank(&self) -> usize {
        self.link.rank()
    }

    fn size(&self) -> usize {
        self.link.size()
    }

    fn all_reduce(&self, x: &mut CpuTensor, op: ReduceOp) -> Result<()> {
        let reduced =
            self.all_reduce_values((x.numel(), x.dtype()), x.values().into_owned(), op)?;
        *x = CpuTensor::stored(x.shape.clone(), reduced, x.dtype());
        Ok(())
    }

    fn all_gather(&self, x: &CpuTensor, out: &mut CpuTensor) -> Result<()> {
        expect_multiple("all_gather", (layout(out), layout(x)), self.size())?;
        let parts = self.exchange(
            self.call(Kind::AllGather, x),
            floats(x.values().into_owned()),
        )?;
        let values = parts
            .iter()
            .flat_map(|p| p.floats().iter().copied())
            .collect();
        *out = CpuTensor::stored(out.shape.clone(), values, out.dtype());
        Ok(())
    }

    fn reduce_scatter(&self, x: &CpuTensor, out: &mut CpuTensor, op: ReduceOp) -> Result<()> {
        expect_multiple("reduce_scatter", (layout(x), layout(out)), self.size())?;
        let call = Signature {
            op: Some(op),
            ..self.call(Kind::ReduceScatter, x)
        };
        let parts = self.exchange(call, floats(x.values().into_owned()))?;
        let n = out.numel();
        let block = Self::reduce(&parts, op)[self.rank() * n..][..n].to_vec();
        *out = CpuTensor::stored(out.shape.clone(), block, out.dtype());
        Ok(())
    }

    fn broadcast(&self, x: &mut CpuTensor, root: usize) -> Result<()> {
        expect_rank("broadcast", root, (self.rank(), self.size()), true)?;
        let call = Signature {
            root: Some(root),
            ..self.call(Kind::Broadcast, x)
        };
        // Only the root's values are read.
        let mine = if self.rank() == root {
            x.values().into_owned()
        } else {
            Vec::new()
        };
        let parts = self.exchange(call, floats(mine))?;
        *x = CpuTensor::stored(x.shape.clone(), parts[root].floats().to_vec(), x.dtype());
        Ok(())
    }

    fn send(&self, x: &CpuTensor, to: usize) -> Result<()> {
        expect_rank("send", to, (self.rank(), self.size()), false)?;
        let part = Part::new(self.call(Kind::Send, x), floats(x.values().into_owned()));
        self.link.post(to, part)
    }

    fn recv(&self, x: &mut CpuTensor, from: usize) -> Result<()> {
        expect_rank("recv", from, (self.rank(), self.size()), false)?;
        let got = self.link.take(from)?;
        let want = self.call(Kind::Send, x);
        if got.call != want {
            return Err(collective_error(
                self.rank(),
                format!(
                    "recv from rank {from}: rank {from} sent {}, rank {} receives {want}",
                    got.call,
                    self.rank()
                ),
            ));
        }
        *x = CpuTensor::stored(x.shape.clone(), got.floats().to_vec(), x.dtype());
        Ok(())
    }

    fn all_reduce_f32(&self, values: &mut [f32], op: ReduceOp) -> Result<()> {
        // an all-reduce of an f32 tensor of them, on the wire and in its sums
        let reduced = self.all_reduce_values((values.len(), DType::F32), values.to_vec(), op)?;
        values.copy_from_slice(&reduced);
        Ok(())
    }

    fn all_gather_bytes(&self, bytes: &[u8]) -> Result<Vec<u8>> {
        let call = Self::call_of(Kind::GatherBytes, bytes.len(), DType::U8);
        let parts = self.exchange(call, Values::Bytes(Arc::new(bytes.to_vec())))?;
        // the ranks agree on the length: one rank's bound is every rank's
        self.within_bound(Kind::GatherBytes, bytes.len(), "each rank")?;
        Ok(parts
            .iter()
            .flat_map(|p| p.bytes().iter().copied())
            .collect())
    }

    fn broadcast_bytes(&self, bytes: &mut Vec<u8>, root: usize) -> Result<()> {
        expect_rank("broadcast_bytes", root, (self.rank(), self.size()), true)?;
        let call = Signature {
            root: Some(root),
            ..Self::call_of(Kind::BroadcastBytes, 0, DType::U8)
        };
        // Only the root's bytes are read.
        let mine = match self.rank() == root {
            true => bytes.clone(),
            false => Vec::new(),
        };
        let parts = self.exchange(call, Values::Bytes(Arc::new(mine)))?;
        let theirs = parts[root].bytes();
        self.within_bound(Kind::BroadcastBytes, theirs.len(), &format!("rank {root}"))?;
        *bytes = theirs.to_vec();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;
    use std::time::Duration;

    type Comm = Box<dyn Communicator<Tensor = CpuTensor>>;

    /// Run `f` on each rank of a group of `size` in its own thread, the ranks linked by
    /// shared memory or by sockets; each rank's result.
    fn on_ranks<T: Send>(
        sockets: bool,
        size: usize,
        timeout: Duration,
        f: impl Fn(Comm) -> T + Sync,
    ) -> Vec<T> {
        if sockets {
            return on_socket_ranks(size, timeout, |c| f(Box::new(c)));
        }
        std::thread::scope(|s| {
            let f = &f;
            let handles: Vec<_> = (thread_group(size, timeout).into_iter())
                .map(|c| s.spawn(move || f(Box::new(c))))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// Run `f` on each rank of a socket group of `size` on this machine, each in its own
    /// thread; each rank's result.
    fn on_socket_ranks<T: Send>(
        size: usize,
        timeout: Duration,
        f: impl Fn(SocketComm) -> T + Sync,
    ) -> Vec<T> {
        let listeners: Vec<TcpListener> = (0..size)
            .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
            .collect();
        let addrs: Vec<_> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
        std::thread::scope(|s| {
            let (f, addrs) = (&f, &addrs);
            let handles: Vec<_> = (listeners.into_iter().enumerate())
                .map(|(rank, l)| {
                    s.spawn(move || f(socket_group(rank, l, addrs, 7, timeout).unwrap()))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    fn t(values: &[f32], dtype: DType) -> CpuTensor {
        CpuTensor::stored(vec![values.len()], values.to_vec(), dtype)
    }

    const SECOND: Duration = Duration::from_secs(1);

    #[test]
    fn collectives_give_every_rank_the_same_results() {
        for sockets in [false, true] {
            let results = on_ranks(sockets, 3, SECOND * 10, |c| {
                let r = c.rank() as f32;
                let mut sum = t(&[r, 10.0 * r], DType::F32);
                c.all_reduce(&mut sum, ReduceOp::Sum).unwrap();
                let mut max = t(&[r, -r], DType::BF16);
                c.all_reduce(&mut max, ReduceOp::Max).unwrap();
                let mut gathered = t(&[0.0; 6], DType::F32);
                c.all_gather(&t(&[r, r + 0.5], DType::F32), &mut gathered)
                    .unwrap();
                let mut block = t(&[0.0; 2], DType::F32);
                let x: Vec<f32> = (0..6).map(|i| i as f32 * (r + 1.0)).collect();
                c.reduce_scatter(&t(&x, DType::F32), &mut block, ReduceOp::Sum)
                    .unwrap();
                // a ring, in both directions around a collective: each rank sends to the
                // next and receives from the previous
                let size = c.size();
                c.send(&t(&[r * 7.0], DType::F32), (c.rank() + 1) % size)
                    .unwrap();
                let mut root = t(&[r; 2], DType::F16);
                c.broadcast(&mut root, 2).unwrap();
                let mut got = t(&[0.0], DType::F32);
                c.recv(&mut got, (c.rank() + size - 1) % size).unwrap();
                let v = |x: &CpuTensor| x.values().into_owned();
                [v(&sum), v(&max), v(&gathered), v(&block), v(&root), v(&got)]
            });
            for (rank, [sum, max, gathered, block, root, got]) in results.into_iter().enumerate() {
                assert_eq!(sum, [3.0, 30.0]);
                assert_eq!(max, [2.0, 0.0]);
                assert_eq!(gathered, [0.0, 0.5, 1.0, 1.5, 2.0, 2.5]);
                // Σ over ranks of i·(r + 1) = 6i; rank r's block is i = 2r, 2r + 1
                let i = 2.0 * rank as f32;
                assert_eq!(block, [6.0 * i, 6.0 * (i + 1.0)]);
                assert_eq!(root, [2.0, 2.0]);
                assert_eq!(got, [((rank + 2) % 3) as f32 * 7.0]);
            }
        }
    }

    /// Non-ASCII, not UTF-8: a directory name as the file system holds it.
    const PATH: &[u8] = b"/save/iter_0000010.tmp-\xc3\xa9t\xc3\xa9-\xff\xfe";

    #[test]
    fn host_values_reach_every_rank_with_a_tensors_bits() {
        for sockets in [false, true] {
            let results = on_ranks(sockets, 3, SECOND * 10, |c| {
                let (rank, r) = (c.rank(), c.rank() as f32);
                // f32 sums that depend on their order (rank order: (1e8 + 1) − 1e8 = 0), the
                // same as a tensor's
                let mine = [[1e8, 1.0, -1e8][rank], 0.1 * (r + 1.0), r / 3.0];
                let mut host = mine;
                c.all_reduce_f32(&mut host, ReduceOp::Sum).unwrap();
                let mut tensor = t(&mine, DType::F32);
                c.all_reduce(&mut tensor, ReduceOp::Sum).unwrap();
                let mut max = [r, -r];
                c.all_reduce_f32(&mut max, ReduceOp::Max).unwrap();
                // f64 sums in rank order ((2⁵³ + 1) − 2⁵³ = 0), and beyond f32's precision
                let two53 = 2f64.powi(53);
                let tiny = 2f64.powi(-30);
                let mut wide = [[two53, 1.0, -two53][rank], [1.0, tiny, tiny][rank]];
                c.all_reduce_f64(&mut wide, ReduceOp::Sum).unwrap();
                let mut wide_max = [-f64::from(r)];
                c.all_reduce_f64(&mut wide_max, ReduceOp::Max).unwrap();
                let gathered = c.all_gather_f32(&[r, r + 0.5]).unwrap();
                let bytes = c.all_gather_bytes(&[c.rank() as u8; 2]).unwrap();
                // the others' bytes, of another length, are replaced by the root's
                let mut path = match rank {
                    1 => PATH.to_vec(),
                    _ => vec![7; 40],
                };
                c.broadcast_bytes(&mut path, 1).unwrap();
                let mut nothing = match rank {
                    0 => Vec::new(),
                    _ => vec![1, 2],
                };
                c.broadcast_bytes(&mut nothing, 0).unwrap();
                let mut losses = [r; 4];
                c.broadcast_f32(&mut losses, 2).unwrap();
                let tensor = tensor.values().into_owned();
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                let same = bits(&host) == bits(&tensor);
                (
                    host, same, max, wide, wide_max, gathered, bytes, path, nothing, losses,
                )
            });
            for (host, same, max, wide, wide_max, gathered, bytes, path, nothing, losses) in results
            {
                assert!(same, "{host:?}");
                assert_eq!(host[0], 0.0);
                assert_eq!(max, [2.0, 0.0]);
                assert_eq!(wide, [0.0, 1.0 + 2f64.powi(-29)]);
                assert_eq!(wide_max, [0.0]);
                assert_eq!(gathered, [0.0, 0.5, 1.0, 1.5, 2.0, 2.5]);
                assert_eq!(bytes, [0, 0, 1, 1, 2, 2]);
                assert_eq!(path, PATH);
                assert!(nothing.is_empty(), "{nothing:?}");
                assert_eq!(losses, [2.0; 4]);
            }
        }
    }

    #[test]
    fn host_values_whose_lengths_disagree_fail_naming_them() {
        for sockets in [false, true] {
            let errors = on_ranks(sockets, 2, SECOND * 10, |c| {
                let gathered = c.all_gather_bytes(&vec![0; 3 + c.rank()]);
                let mut values = vec![1.0; 1 + c.rank()];
                let reduced = c.all_reduce_f32(&mut values, ReduceOp::Sum);
                // the root sends 2 values, rank 1 expects 3
                let mut losses = vec![0.5; 2 + c.rank()];
                let broadcast = c.broadcast_f32(&mut losses, 0);
                let mut huge = vec![0; MAX_HOST_BYTES + 1 - c.rank()];
                let over = c.broadcast_bytes(&mut huge, 0);
                [gathered.map(drop), reduced, broadcast, over].map(|r| match r {
                    Ok(()) => String::new(),
                    Err(e) => e.to_string(),
                })
            });
            for [gathered, reduced, _, over] in &errors {
                assert!(
                    gathered.contains("all_gather_bytes #0: ranks disagree")
                        && gathered.contains("calls all_gather_bytes of 3 U8")
                        && gathered.contains("calls all_gather_bytes of 4 U8"),
                    "{gathered}"
                );
                assert!(
                    reduced.contains("all_reduce of 1 F32 (Sum)")
                        && reduced.contains("all_reduce of 2 F32 (Sum)"),
                    "{reduced}"
                );
                assert!(
                    over.contains(
                        "broadcast_bytes: 1048577 bytes from rank 0, more than the 1048576"
                    ),
                    "{over}"
                );
            }
            let [_, _, root, _] = &errors[0];
            let [_, _, other, _] = &errors[1];
            assert_eq!(root, "", "the root cannot know");
            assert!(
                other.contains("broadcast_f32: rank 0 sends 8 bytes, rank 1 expects 3 values"),
                "{other}"
            );
        }
    }

    #[test]
    fn counted_host_values_weigh_what_their_tensors_did() {
        let results = on_ranks(false, 2, SECOND * 10, |c| {
            let counted = crate::engine::comm::Counted::new(c);
            counted
                .all_reduce_f32(&mut [1.0, 2.0], ReduceOp::Sum)
                .unwrap();
            counted
                .all_reduce(&mut t(&[1.0], DType::F32), ReduceOp::Max)
                .unwrap();
            counted.all_reduce_f64(&mut [1.0], ReduceOp::Sum).unwrap();
            counted.all_gather_f32(&[1.0, 2.0, 3.0]).unwrap();
            let mut name = match counted.rank() {
                0 => PATH.to_vec(),
                _ => Vec::new(),
            };
            counted.broadcast_bytes(&mut name, 0).unwrap();
            counted.broadcast_f32(&mut [0.0; 2], 1).unwrap();
            counted.take()
        });
        for counts in results {
            let c = |name: &str| counts.get(name).map(|c| (c.calls, c.bytes));
            assert_eq!(c("all_reduce"), Some((3, 8 + 4 + 8)));
            assert_eq!(c("all_gather"), Some((1, 12)));
            assert_eq!(c("broadcast"), Some((2, PATH.len() as u64 + 8)));
        }
    }

    #[test]
    fn ranks_sending_each_other_megabytes_do_not_block() {
        let n = 3 << 20;
        let results = on_ranks(true, 2, SECOND * 30, |c| {
            let other = 1 - c.rank();
            c.send(&t(&vec![c.rank() as f32; n], DType::F32), other)
                .unwrap();
            let mut x = t(&vec![1.0; n], DType::F32);
            c.all_reduce(&mut x, ReduceOp::Sum).unwrap();
            let mut got = t(&vec![0.0; n], DType::F32);
            c.recv(&mut got, other).unwrap();
            (x.values()[n - 1], got.values()[n - 1])
        });
        assert_eq!(results, [(2.0, 1.0), (2.0, 0.0)]);
    }

    #[test]
    fn ranks_that_disagree_fail_together_naming_both() {
        for sockets in [false, true] {
            let errors = on_ranks(sockets, 2, SECOND * 10, |c| {
                let mut x = t(&vec![1.0; 2 + c.rank()], DType::F32);
                c.all_reduce(&mut x, ReduceOp::Sum).unwrap_err().to_string()
            });
            for e in errors {
                assert!(
                    e.contains("all_reduce #0: ranks disagree")
                        && e.contains("all_reduce of 2 F32 (Sum)")
                        && e.contains("all_reduce of 3 F32 (Sum)"),
                    "{e}"
                );
            }
        }
    }

    #[test]
    fn a_rank_that_leaves_or_never_comes_fails_the_others_without_a_hang() {
        for sockets in [false, true] {
            let errors = on_ranks(sockets, 3, SECOND * 30, |c| {
                if c.rank() == 1 {
                    return String::new(); // leaves: its communicator is dropped
                }
                let mut x = t(&[1.0], DType::F32);
                c.all_reduce(&mut x, ReduceOp::Sum).unwrap_err().to_string()
            });
            assert!(errors[0].contains("rank 1 left the group"), "{errors:?}");
            let late = on_ranks(sockets, 2, Duration::from_millis(50), |c| {
                let mut x = t(&[1.0], DType::F32);
                match c.rank() {
                    0 => c.recv(&mut x, 1).unwrap_err().to_string(),
                    _ => {
                        std::thread::sleep(Duration::from_millis(500));
                        String::new()
                    }
                }
            });
            assert!(
                late[0].contains("rank(s) [1] did not arrive within 0.05 s"),
                "{late:?}"
            );
            let mismatch = on_ranks(sockets, 2, SECOND * 10, |c| {
                if c.rank() == 0 {
                    c.send(&t(&[1.0, 2.0], DType::F32), 1)
                        .map(|_| String::new())
                } else {
                    let mut one = t(&[0.0], DType::F32);
                    c.recv(&mut one, 0).map(|_| String::new())
                }
            });
            let e = mismatch[1].as_ref().unwrap_err().to_string();
            assert!(
                e.contains("rank 0 sent send of 2 F32, rank 1 receives send of 1 F32"),
                "{e}"
            );
        }
    }

    #[test]
    fn subgroups_share_the_mesh_without_mixing_their_frames() {
        // Four ranks as TP 2 × DP 2: TP groups [0, 1], [2, 3]; DP groups [0, 2], [1, 3]. Each
        // rank interleaves collectives and messages on both and on the world group.
        let results = on_socket_ranks(4, SECOND * 10, |world| {
            let rank = world.rank();
            let tp = world
                .subgroup(1, vec![rank / 2 * 2, rank / 2 * 2 + 1])
                .unwrap();
            let dp = world.subgroup(2, vec![rank % 2, rank % 2 + 2]).unwrap();
            let r = rank as f32;
            let other_tp = 1 - tp.rank();
            tp.send(&t(&[r], DType::F32), other_tp).unwrap();
            let mut in_dp = t(&[r, 1.0], DType::F32);
            dp.all_reduce(&mut in_dp, ReduceOp::Sum).unwrap();
            let mut in_tp = t(&[r], DType::F32);
            tp.all_reduce(&mut in_tp, ReduceOp::Max).unwrap();
            let mut all = t(&[0.0; 4], DType::F32);
            world.all_gather(&t(&[r], DType::F32), &mut all).unwrap();
            let mut got = t(&[0.0], DType::F32);
            tp.recv(&mut got, other_tp).unwrap();
            let v = |x: &CpuTensor| x.values().into_owned();
            [v(&in_dp), v(&in_tp), v(&all), v(&got)]
        });
        for (rank, [in_dp, in_tp, all, got]) in results.into_iter().enumerate() {
            let r = rank as f32;
            assert_eq!(in_dp, [2.0 * (rank % 2) as f32 + 2.0, 2.0]);
            assert_eq!(in_tp, [(rank / 2 * 2 + 1) as f32]);
            assert_eq!(all, [0.0, 1.0, 2.0, 3.0]);
            assert_eq!(got, [if rank % 2 == 0 { r + 1.0 } else { r - 1.0 }]);
        }
        let errors = on_socket_ranks(2, SECOND * 10, |world| {
            let not_mine = vec![1 - world.rank()];
            [world.subgroup(0, vec![0, 1]), world.subgroup(3, not_mine)]
                .map(|g| g.err().unwrap().to_string())
        });
        assert!(
            errors[0][0].contains("id 0 is the world's"),
            "{:?}",
            errors[0]
        );
        assert!(
            errors[0][1].contains("rank 0 is not in the subgroup [1]"),
            "{:?}",
            errors[0]
        );
    }

    #[test]
    fn a_connection_from_another_group_is_ignored() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let me = listener.local_addr().unwrap();
        let stray = std::thread::spawn(move || {
            let mut s = std::net::TcpStream::connect(me).unwrap();
            let hello = [
                &b"mindkit-cpu-grp1"[..],
                &8u64.to_le_bytes(),
                &2u64.to_le_bytes(),
            ];
            std::io::Write::write_all(&mut s, &[&hello.concat()[..], &1u64.to_le_bytes()].concat())
                .unwrap();
            s
        });
        let e = socket_group(0, listener, &[me, me], 7, Duration::from_millis(300))
            .err()
            .unwrap()
            .to_string();
        drop(stray.join());
        assert!(
            e.contains("rank(s) [1] did not connect within 0.3 s"),
            "{e}"
        );
    }
}
