//! Ranks as threads of one process: the CPU backend's [`Communicator`]. [`thread_group`] hands
//! out one [`ThreadComm`] per rank, each moved to its rank's thread. A collective leaves each
//! rank's values under the call's sequence number; once every rank's are there, each rank
//! computes its result from all of them in rank order, so every rank gets the same bits
//! (sums accumulate in f32 in rank order, halves rounded once, as the HCCL stand-in does).
//! Sends wait in a mailbox per (sender, receiver) until received.

use super::CpuTensor;
use crate::engine::comm::{expect_multiple, expect_rank, Communicator, Layout, ReduceOp};
use crate::engine::{EngineError, Result};
use crate::tensor::DType;
use std::cell::Cell;
use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// One communicator per rank of a group of `size` threads; a call waits at most `timeout`
/// for the other ranks.
pub fn thread_group(size: usize, timeout: Duration) -> Vec<ThreadComm> {
    let shared = Arc::new(Shared {
        size,
        timeout,
        state: Mutex::new(State::default()),
        changed: Condvar::new(),
    });
    (0..size)
        .map(|rank| ThreadComm {
            rank,
            shared: shared.clone(),
            next: Cell::new(0),
        })
        .collect()
}

/// One rank of a [`thread_group`]. Dropping it leaves the group: the other ranks' calls that
/// wait for it fail.
pub struct ThreadComm {
    rank: usize,
    shared: Arc<Shared>,
    /// The sequence number of this rank's next collective.
    next: Cell<u64>,
}

struct Shared {
    size: usize,
    timeout: Duration,
    state: Mutex<State>,
    changed: Condvar,
}

#[derive(Default)]
struct State {
    /// Collectives in flight by sequence number.
    calls: HashMap<u64, Call>,
    /// Sent and not yet received, by (sender, receiver).
    mail: HashMap<(usize, usize), VecDeque<Part>>,
    /// Ranks that left the group.
    left: Vec<usize>,
}

/// One collective: each rank's part, and how many ranks took the result.
struct Call {
    parts: Vec<Option<Part>>,
    taken: usize,
}

/// What a rank brings to a call: the call as it sees it, and its values.
#[derive(Clone)]
struct Part {
    call: Signature,
    values: Arc<Vec<f32>>,
}

/// A call as one rank makes it: every rank's must be equal.
#[derive(Clone, Copy, PartialEq)]
struct Signature {
    kind: &'static str,
    count: usize,
    dtype: DType,
    op: Option<ReduceOp>,
    root: Option<usize>,
}

impl fmt::Display for Signature {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} of {} {:?}", self.kind, self.count, self.dtype)?;
        if let Some(op) = self.op {
            write!(f, " ({op:?})")?;
        }
        if let Some(root) = self.root {
            write!(f, " from rank {root}")?;
        }
        Ok(())
    }
}

fn layout(x: &CpuTensor) -> Layout<'_> {
    (&x.shape, x.dtype())
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl ThreadComm {
    fn error(&self, msg: String) -> EngineError {
        EngineError::Collective {
            rank: self.rank,
            msg,
        }
    }

    /// Wait on the group's state until `ready` gives a value, the rank `waiting_on` names
    /// has left, or the timeout passes; `what` names the wait in errors.
    fn wait_for<T>(
        &self,
        what: &str,
        mut ready: impl FnMut(&mut State) -> Option<T>,
        waiting_on: impl Fn(&State) -> Vec<usize>,
    ) -> Result<T> {
        let sh = &self.shared;
        let deadline = Instant::now() + sh.timeout;
        let mut st = lock(&sh.state);
        loop {
            if let Some(done) = ready(&mut st) {
                return Ok(done);
            }
            let missing = waiting_on(&st);
            if let Some(gone) = missing.iter().find(|r| st.left.contains(r)) {
                return Err(self.error(format!("{what}: rank {gone} left the group")));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(self.error(format!(
                    "{what}: rank(s) {missing:?} did not arrive within {} s",
                    sh.timeout.as_secs_f64()
                )));
            }
            st = sh
                .changed
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Bring `values` to the next collective, described by `call`; every rank's part, in rank
    /// order, once all are there and agree.
    fn exchange(&self, call: Signature, values: Vec<f32>) -> Result<Vec<Part>> {
        let seq = self.next.replace(self.next.get() + 1);
        let (size, rank) = (self.shared.size, self.rank);
        let part = Part {
            call,
            values: Arc::new(values),
        };
        lock(&self.shared.state)
            .calls
            .entry(seq)
            .or_insert_with(|| Call {
                parts: vec![None; size],
                taken: 0,
            })
            .parts[rank] = Some(part);
        self.shared.changed.notify_all();
        let what = format!("{} #{seq}", call.kind);
        let parts = self.wait_for(
            &what,
            |st| {
                let c = st.calls.get_mut(&seq)?;
                let parts: Vec<Part> = c.parts.iter().flatten().cloned().collect();
                if parts.len() < size {
                    return None;
                }
                c.taken += 1;
                if c.taken == size {
                    st.calls.remove(&seq);
                }
                Some(parts)
            },
            |st| {
                st.calls.get(&seq).map_or(Vec::new(), |c| {
                    (0..size).filter(|&r| c.parts[r].is_none()).collect()
                })
            },
        )?;
        match parts.iter().position(|p| p.call != call) {
            Some(r) => Err(self.error(format!(
                "{what}: ranks disagree: rank {rank} calls {call}, rank {r} calls {}",
                parts[r].call
            ))),
            None => Ok(parts),
        }
    }

    /// `op` over every part's values, in rank order.
    fn reduce(parts: &[Part], op: ReduceOp) -> Vec<f32> {
        let mut acc = parts[0].values.to_vec();
        for p in &parts[1..] {
            for (a, &v) in acc.iter_mut().zip(p.values.iter()) {
                *a = match op {
                    ReduceOp::Sum => *a + v,
                    ReduceOp::Max => a.max(v),
                };
            }
        }
        acc
    }

    fn call(&self, kind: &'static str, x: &CpuTensor) -> Signature {
        Signature {
            kind,
            count: x.numel(),
            dtype: x.dtype(),
            op: None,
            root: None,
        }
    }
}

impl Communicator for ThreadComm {
    type Tensor = CpuTensor;

    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.shared.size
    }

    fn all_reduce(&self, x: &mut CpuTensor, op: ReduceOp) -> Result<()> {
        let call = Signature {
            op: Some(op),
            ..self.call("all_reduce", x)
        };
        let parts = self.exchange(call, x.values().into_owned())?;
        *x = CpuTensor::stored(x.shape.clone(), Self::reduce(&parts, op), x.dtype());
        Ok(())
    }

    fn all_gather(&self, x: &CpuTensor, out: &mut CpuTensor) -> Result<()> {
        expect_multiple("all_gather", (layout(out), layout(x)), self.size())?;
        let parts = self.exchange(self.call("all_gather", x), x.values().into_owned())?;
        let values = parts
            .iter()
            .flat_map(|p| p.values.iter().copied())
            .collect();
        *out = CpuTensor::stored(out.shape.clone(), values, out.dtype());
        Ok(())
    }

    fn reduce_scatter(&self, x: &CpuTensor, out: &mut CpuTensor, op: ReduceOp) -> Result<()> {
        expect_multiple("reduce_scatter", (layout(x), layout(out)), self.size())?;
        let call = Signature {
            op: Some(op),
            ..self.call("reduce_scatter", x)
        };
        let parts = self.exchange(call, x.values().into_owned())?;
        let n = out.numel();
        let block = Self::reduce(&parts, op)[self.rank * n..][..n].to_vec();
        *out = CpuTensor::stored(out.shape.clone(), block, out.dtype());
        Ok(())
    }

    fn broadcast(&self, x: &mut CpuTensor, root: usize) -> Result<()> {
        expect_rank("broadcast", root, (self.rank, self.size()), true)?;
        let call = Signature {
            root: Some(root),
            ..self.call("broadcast", x)
        };
        // Only the root's values are read.
        let mine = if self.rank == root {
            x.values().into_owned()
        } else {
            Vec::new()
        };
        let parts = self.exchange(call, mine)?;
        *x = CpuTensor::stored(x.shape.clone(), parts[root].values.to_vec(), x.dtype());
        Ok(())
    }

    fn send(&self, x: &CpuTensor, to: usize) -> Result<()> {
        expect_rank("send", to, (self.rank, self.size()), false)?;
        let part = Part {
            call: self.call("send", x),
            values: Arc::new(x.values().into_owned()),
        };
        lock(&self.shared.state)
            .mail
            .entry((self.rank, to))
            .or_default()
            .push_back(part);
        self.shared.changed.notify_all();
        Ok(())
    }

    fn recv(&self, x: &mut CpuTensor, from: usize) -> Result<()> {
        expect_rank("recv", from, (self.rank, self.size()), false)?;
        let what = format!("recv from rank {from}");
        let key = (from, self.rank);
        let got = self.wait_for(
            &what,
            |st| st.mail.get_mut(&key).and_then(VecDeque::pop_front),
            |_| vec![from],
        )?;
        let want = self.call("send", x);
        if got.call != want {
            return Err(self.error(format!(
                "{what}: rank {from} sent {}, rank {} receives {want}",
                got.call, self.rank
            )));
        }
        *x = CpuTensor::stored(x.shape.clone(), got.values.to_vec(), x.dtype());
        Ok(())
    }
}

impl Drop for ThreadComm {
    fn drop(&mut self) {
        lock(&self.shared.state).left.push(self.rank);
        self.shared.changed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Run `f` on each rank of a group of `size` in its own thread; each rank's result.
    fn on_ranks<T: Send>(
        size: usize,
        timeout: Duration,
        f: impl Fn(ThreadComm) -> T + Sync,
    ) -> Vec<T> {
        let comms = thread_group(size, timeout);
        std::thread::scope(|s| {
            let handles: Vec<_> = comms.into_iter().map(|c| s.spawn(|| f(c))).collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    fn t(values: &[f32], dtype: DType) -> CpuTensor {
        CpuTensor::stored(vec![values.len()], values.to_vec(), dtype)
    }

    const SECOND: Duration = Duration::from_secs(1);

    #[test]
    fn collectives_give_every_rank_the_same_results() {
        let results = on_ranks(3, SECOND * 10, |c| {
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
            let mut root = t(&[r; 2], DType::F16);
            c.broadcast(&mut root, 2).unwrap();
            // a ring: each rank sends to the next and receives from the previous
            let size = c.size();
            c.send(&t(&[r * 7.0], DType::F32), (c.rank() + 1) % size)
                .unwrap();
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

    #[test]
    fn ranks_that_disagree_fail_together_naming_both() {
        let errors = on_ranks(2, SECOND * 10, |c| {
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

    #[test]
    fn a_rank_that_leaves_or_never_comes_fails_the_others_without_a_hang() {
        let errors = on_ranks(3, SECOND * 30, |c| {
            if c.rank() == 1 {
                return String::new(); // leaves: its communicator is dropped
            }
            let mut x = t(&[1.0], DType::F32);
            c.all_reduce(&mut x, ReduceOp::Sum).unwrap_err().to_string()
        });
        assert!(errors[0].contains("rank 1 left the group"), "{errors:?}");
        let comms = thread_group(2, Duration::from_millis(50));
        let mut x = t(&[1.0], DType::F32);
        let late = comms[0].recv(&mut x, 1).unwrap_err().to_string();
        assert!(
            late.contains("rank(s) [1] did not arrive within 0.05 s"),
            "{late}"
        );
        let mismatch = on_ranks(2, SECOND * 10, |c| {
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
