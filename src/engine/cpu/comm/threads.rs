//! Ranks as threads of one process: [`thread_group`] hands out one [`ThreadComm`] per rank,
//! each moved to its rank's thread. A collective leaves each rank's part in shared memory under
//! the call's sequence number; sends wait in a mailbox per (sender, receiver) until received.

use super::{collective_error, Group, Link, Part};
use crate::engine::Result;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// One rank of a [`thread_group`].
pub type ThreadComm = Group<Threads>;

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
        .map(|rank| {
            Group::new(Threads {
                rank,
                shared: shared.clone(),
            })
        })
        .collect()
}

/// A rank's end of the memory its group's threads share.
pub struct Threads {
    rank: usize,
    shared: Arc<Shared>,
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

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Threads {
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
                return Err(collective_error(
                    self.rank,
                    format!("{what}: rank {gone} left the group"),
                ));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(collective_error(
                    self.rank,
                    format!(
                        "{what}: rank(s) {missing:?} did not arrive within {} s",
                        sh.timeout.as_secs_f64()
                    ),
                ));
            }
            st = sh
                .changed
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

impl Link for Threads {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.shared.size
    }

    fn exchange(&self, seq: u64, what: &str, part: Part) -> Result<Vec<Part>> {
        let (size, rank) = (self.shared.size, self.rank);
        lock(&self.shared.state)
            .calls
            .entry(seq)
            .or_insert_with(|| Call {
                parts: vec![None; size],
                taken: 0,
            })
            .parts[rank] = Some(part);
        self.shared.changed.notify_all();
        self.wait_for(
            what,
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
        )
    }

    fn post(&self, to: usize, part: Part) -> Result<()> {
        lock(&self.shared.state)
            .mail
            .entry((self.rank, to))
            .or_default()
            .push_back(part);
        self.shared.changed.notify_all();
        Ok(())
    }

    fn take(&self, from: usize) -> Result<Part> {
        let key = (from, self.rank);
        self.wait_for(
            &format!("recv from rank {from}"),
            |st| st.mail.get_mut(&key).and_then(VecDeque::pop_front),
            |_| vec![from],
        )
    }
}

impl Drop for Threads {
    fn drop(&mut self) {
        lock(&self.shared.state).left.push(self.rank);
        self.shared.changed.notify_all();
    }
}
