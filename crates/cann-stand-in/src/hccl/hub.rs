//! The hub: where the ranks of one communicator meet. It serves a Unix-domain socket from a
//! thread of the process that made the root info (or of rank table rank 0), a thread per
//! connection (one connection per rank), and does the collectives' work: it waits for every
//! rank's same-numbered call, checks they agree, computes the result once and answers each rank
//! its part; it holds sends until the matching receive. A rank whose connection closes (its
//! communicator destroyed, or its process gone) fails whatever waits on it, so nothing hangs.
//! Once every rank joined (or the join timed out) the socket's path is removed. The process
//! serving hubs waits at `aclFinalize` until their ranks left ([`await_departures`]): were it to
//! exit first, a rank of another process still reading its last result would find the hub gone.

use super::data;
use super::wire::{self, Call, Data, Kind, Reply, Request};
use hccl_sys::*;
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How a rank that left went.
const DESTROYED: &str = "destroyed its communicator";
const CLOSED: &str = "left: its connection closed (did its process exit?)";

struct Hub {
    path: PathBuf,
    group: Mutex<Group>,
    changed: Condvar,
}

#[derive(Default)]
struct Group {
    /// The size the first rank joined with.
    size: Option<u32>,
    joined: BTreeSet<u32>,
    /// Ranks that left, and how.
    gone: BTreeMap<u32, &'static str>,
    /// Collectives by sequence number, until every rank took its result.
    calls: HashMap<u64, Pending>,
    /// Sends not yet received, per (from, to).
    mail: HashMap<(u32, u32), VecDeque<Mail>>,
    /// Failures owed to a rank whose send a receive refused: its next call fails with it.
    owed: HashMap<u32, String>,
    /// Whether the listener stopped taking connections.
    closed: bool,
}

/// One collective: each rank's call and data as they come, then the result.
struct Pending {
    parts: Vec<Option<(Call, Data)>>,
    /// The result every rank shares (a reduce-scatter's whole reduction), or how the calls
    /// disagree.
    result: Option<Result<Arc<Vec<u8>>, String>>,
    /// Ranks that are done with it.
    settled: usize,
}

/// A call's result shared by the ranks, or its failure as `(code, message)`.
type Outcome = Result<Arc<Vec<u8>>, (HcclResult, String)>;

struct Mail {
    count: u64,
    dtype: HcclDataType,
    data: Data,
}

/// The hubs this process serves.
static HOSTED: Mutex<Vec<Arc<Hub>>> = Mutex::new(Vec::new());

/// Bind `path` and serve a hub there from a new thread.
pub(crate) fn start(path: &Path) -> std::io::Result<()> {
    let listener = UnixListener::bind(path)?;
    let hub = Arc::new(Hub {
        path: path.to_path_buf(),
        group: Mutex::new(Group::default()),
        changed: Condvar::new(),
    });
    HOSTED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(Arc::clone(&hub));
    std::thread::Builder::new()
        .name("hccl-stand-in-hub".into())
        .spawn(move || accept(&hub, &listener))?;
    Ok(())
}

fn accept(hub: &Arc<Hub>, listener: &UnixListener) {
    for stream in listener.incoming() {
        if hub.lock().closed {
            return;
        }
        if let Ok(stream) = stream {
            let hub = Arc::clone(hub);
            let _ = std::thread::Builder::new()
                .name("hccl-stand-in-rank".into())
                .spawn(move || serve(&hub, stream));
        }
    }
}

/// Wait until every rank that joined a hub of this process left it (destroyed its communicator
/// or closed its connection), at most `timeout_ms` per hub; the hubs are then forgotten.
pub(crate) fn await_departures(timeout_ms: u64) {
    let hubs = std::mem::take(&mut *HOSTED.lock().unwrap_or_else(|e| e.into_inner()));
    for hub in hubs {
        let g = hub.lock();
        let _ = hub.wait_for(g, timeout_ms, |g| {
            g.joined
                .iter()
                .all(|r| g.gone.contains_key(r))
                .then_some(())
        });
    }
}

/// Answer one rank's requests until it leaves; then fail whatever waits on it.
fn serve(hub: &Hub, mut stream: UnixStream) {
    let mut rank = None;
    let mut how = CLOSED;
    while let Ok(request) = wire::read_request(&mut stream) {
        let answered = request.answered();
        let reply = match (request, rank) {
            (Request::Leave, _) => {
                how = DESTROYED;
                break;
            }
            (
                Request::Join {
                    size,
                    rank: r,
                    timeout_ms,
                },
                None,
            ) => {
                let (accepted, reply) = hub.join(size, r, timeout_ms);
                rank = accepted.then_some(r);
                reply
            }
            (Request::Join { .. }, Some(_)) | (_, None) => Reply::Failed(
                HCCL_E_INTERNAL,
                "a call before joining, or a second join".into(),
            ),
            (request, Some(r)) => hub.handle(r, request),
        };
        if answered && wire::write_reply(&mut stream, &reply).is_err() {
            break;
        }
    }
    if let Some(r) = rank {
        hub.lock().gone.insert(r, how);
        hub.changed.notify_all();
    }
}

/// `Some(deadline)`, or `None` for a timeout too long to represent (never).
fn deadline(timeout_ms: u64) -> Option<Instant> {
    Instant::now().checked_add(Duration::from_millis(timeout_ms))
}

impl Hub {
    fn lock(&self) -> MutexGuard<'_, Group> {
        self.group.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Wait until `ready` gives a value, or `None` at the timeout.
    fn wait_for<'a, T>(
        &'a self,
        mut g: MutexGuard<'a, Group>,
        timeout_ms: u64,
        mut ready: impl FnMut(&mut Group) -> Option<T>,
    ) -> (MutexGuard<'a, Group>, Option<T>) {
        let deadline = deadline(timeout_ms);
        loop {
            if let Some(value) = ready(&mut g) {
                return (g, Some(value));
            }
            g = match deadline.map(|d| d.saturating_duration_since(Instant::now())) {
                Some(Duration::ZERO) => return (g, None),
                Some(left) => {
                    let waited = self.changed.wait_timeout(g, left);
                    waited.unwrap_or_else(|e| e.into_inner()).0
                }
                None => self.changed.wait(g).unwrap_or_else(|e| e.into_inner()),
            };
        }
    }

    /// Join as `rank` of `size` and wait for the others; whether the rank was taken, and the
    /// reply.
    fn join(&self, size: u32, rank: u32, timeout_ms: u64) -> (bool, Reply) {
        let mut g = self.lock();
        let expected = *g.size.get_or_insert(size);
        if size != expected || rank >= size {
            let why = format!(
                "rank {rank} joins as one of {size} ranks, the communicator has {expected}"
            );
            return (false, Reply::Failed(HCCL_E_PARA, why));
        }
        if !g.joined.insert(rank) {
            return (
                false,
                Reply::Failed(HCCL_E_PARA, format!("rank {rank} joined twice")),
            );
        }
        self.changed.notify_all();
        let (mut g, outcome) = self.wait_for(g, timeout_ms, |g| {
            if g.joined.len() == size as usize {
                return Some(Reply::Done(Vec::new()));
            }
            let (r, how) = g.gone.iter().next()?;
            let why = format!("rank {r} {how} before every rank joined");
            Some(Reply::Failed(HCCL_E_REMOTE, why))
        });
        self.close(&mut g);
        let reply = outcome.unwrap_or_else(|| {
            let missing: Vec<u32> = (0..size).filter(|r| !g.joined.contains(r)).collect();
            Reply::Failed(
                HCCL_E_TIMEOUT,
                format!("ranks {missing:?} never joined (HCCL_CONNECT_TIMEOUT)"),
            )
        });
        (true, reply)
    }

    /// Stop taking connections: every rank came, or never will.
    fn close(&self, g: &mut Group) {
        if !std::mem::replace(&mut g.closed, true) {
            // wake the accepting thread so that it sees `closed` and ends
            let _ = UnixStream::connect(&self.path);
            let _ = std::fs::remove_file(&self.path);
        }
    }

    /// A joined rank's call; a failure owed to it replaces its data.
    fn handle(&self, rank: u32, request: Request) -> Reply {
        let owed = self.lock().owed.remove(&rank);
        if let (Some(why), Request::Recv { .. }) = (&owed, &request) {
            return Reply::Failed(HCCL_E_PARA, why.clone());
        }
        let data_or_owed = |data: Data| owed.clone().map_or(data, Err);
        match request {
            Request::Collective {
                call,
                timeout_ms,
                data,
            } => self.collective(rank, call, timeout_ms, data_or_owed(data)),
            Request::Send {
                to,
                count,
                dtype,
                data,
            } => self.send(
                (rank, to),
                Mail {
                    count,
                    dtype,
                    data: data_or_owed(data),
                },
            ),
            Request::Recv {
                from,
                count,
                dtype,
                timeout_ms,
            } => self.recv((from, rank), (count, dtype), timeout_ms),
            Request::Join { .. } | Request::Leave => unreachable!("serve answers joins and leaves"),
        }
    }

    fn collective(&self, rank: u32, call: Call, timeout_ms: u64, data: Data) -> Reply {
        let mut g = self.lock();
        let size = g.size.unwrap_or_default() as usize;
        let failed = data.as_ref().err().cloned();
        let pending = g.calls.entry(call.seq).or_insert_with(|| Pending {
            parts: vec![None; size],
            result: None,
            settled: 0,
        });
        pending.parts[rank as usize] = Some((call, data));
        self.changed.notify_all();
        let (mut g, outcome) = match failed {
            Some(why) => (g, Some(Err((HCCL_E_PARA, why)))),
            None => self.wait_for(g, timeout_ms, |g| g.outcome(&call)),
        };
        g.settle(call.seq, size);
        match outcome {
            Some(Ok(result)) => Reply::Done(share(&call, rank, size, &result)),
            Some(Err((code, why))) => Reply::Failed(code, why),
            None => {
                let missing = g
                    .calls
                    .get(&call.seq)
                    .map_or_else(Vec::new, Pending::missing);
                let why = format!(
                    "{} #{}: ranks {missing:?} never came (HCCL_EXEC_TIMEOUT)",
                    call.kind.name(),
                    call.seq
                );
                Reply::Failed(HCCL_E_TIMEOUT, why)
            }
        }
    }

    fn send(&self, (from, to): (u32, u32), mail: Mail) -> Reply {
        let failed = mail.data.as_ref().err().cloned();
        self.lock()
            .mail
            .entry((from, to))
            .or_default()
            .push_back(mail);
        self.changed.notify_all();
        match failed {
            Some(why) => Reply::Failed(HCCL_E_PARA, why),
            None => Reply::Done(Vec::new()),
        }
    }

    fn recv(
        &self,
        (from, to): (u32, u32),
        (count, dtype): (u64, HcclDataType),
        timeout_ms: u64,
    ) -> Reply {
        let g = self.lock();
        let (mut g, mail) = self.wait_for(g, timeout_ms, |g| {
            let mail = g.mail.get_mut(&(from, to)).and_then(VecDeque::pop_front);
            match (mail, g.gone.get(&from)) {
                (Some(mail), _) => Some(Ok(mail)),
                (None, Some(how)) => Some(Err(format!("HcclRecv: rank {from} {how}"))),
                (None, None) => None,
            }
        });
        let mail = match mail {
            None => {
                let why = format!("HcclRecv: rank {from} sent nothing (HCCL_EXEC_TIMEOUT)");
                return Reply::Failed(HCCL_E_TIMEOUT, why);
            }
            Some(Err(why)) => return Reply::Failed(HCCL_E_REMOTE, why),
            Some(Ok(mail)) => mail,
        };
        match mail.data {
            Err(why) => Reply::Failed(
                HCCL_E_REMOTE,
                format!("HcclRecv: rank {from}'s HcclSend failed: {why}"),
            ),
            Ok(_) if (mail.count, mail.dtype) != (count, dtype) => {
                let why = format!(
                    "HcclRecv by rank {to} from rank {from}: rank {from} sent count: {} dtype: {}, rank {to} receives count: {count} dtype: {dtype}",
                    mail.count, mail.dtype
                );
                g.owed.insert(from, why.clone());
                Reply::Failed(HCCL_E_PARA, why)
            }
            Ok(bytes) => Reply::Done(bytes),
        }
    }
}

impl Group {
    /// What the call `call` comes to, once it can be told: a failed or departed rank fails it
    /// (HCCL_E_REMOTE), ranks that disagree fail it (HCCL_E_PARA), else the result computed once.
    fn outcome(&mut self, call: &Call) -> Option<Outcome> {
        let name = format!("{} #{}", call.kind.name(), call.seq);
        let pending = self.calls.get_mut(&call.seq)?;
        let failed = pending
            .parts
            .iter()
            .enumerate()
            .find_map(|(r, part)| match part {
                Some((_, Err(why))) => Some((r, why)),
                _ => None,
            });
        if let Some((r, why)) = failed {
            return Some(Err((
                HCCL_E_REMOTE,
                format!("{name}: rank {r} failed: {why}"),
            )));
        }
        if let Some((r, how)) = pending
            .missing()
            .iter()
            .find_map(|r| Some((r, self.gone.get(r)?)))
        {
            return Some(Err((HCCL_E_REMOTE, format!("{name}: rank {r} {how}"))));
        }
        if !pending.missing().is_empty() {
            return None;
        }
        let result = pending
            .result
            .get_or_insert_with(|| combine(&pending.parts).map(Arc::new));
        Some(match result {
            Ok(bytes) => Ok(Arc::clone(bytes)),
            Err(why) => Err((HCCL_E_PARA, format!("{name}: {why}"))),
        })
    }

    /// A rank is done with call `seq`; the last one drops it.
    fn settle(&mut self, seq: u64, size: usize) {
        if let Some(pending) = self.calls.get_mut(&seq) {
            pending.settled += 1;
            if pending.settled == size {
                self.calls.remove(&seq);
            }
        }
    }
}

impl Pending {
    fn missing(&self) -> Vec<u32> {
        (0..self.parts.len() as u32)
            .filter(|&r| self.parts[r as usize].is_none())
            .collect()
    }
}

/// Every rank's call, in rank order, all there and with data: the result every rank shares,
/// or how the calls disagree.
fn combine(parts: &[Option<(Call, Data)>]) -> Result<Vec<u8>, String> {
    let parts: Vec<(&Call, &[u8])> = parts
        .iter()
        .flatten()
        .map(|(call, data)| (call, data.as_deref().unwrap_or_default()))
        .collect();
    let first = parts[0].0;
    if let Some(r) = parts.iter().position(|(call, _)| *call != first) {
        return Err(disagreement((0, first), (r, parts[r].0)));
    }
    let bytes: Vec<&[u8]> = parts.iter().map(|&(_, data)| data).collect();
    Ok(match first.kind {
        Kind::AllReduce | Kind::ReduceScatter => data::reduce(&bytes, first.dtype, first.op),
        Kind::AllGather => bytes.concat(),
        Kind::Broadcast => bytes[first.root as usize].to_vec(),
    })
}

/// "ranks disagree: rank 0 has count: 2, rank 1 has count: 3", naming only what differs.
fn disagreement((r0, a): (usize, &Call), (r1, b): (usize, &Call)) -> String {
    let fields = |c: &Call| {
        [
            ("kind", c.kind.name().to_string()),
            ("count", c.count.to_string()),
            ("dtype", c.dtype.to_string()),
            ("op", c.op.to_string()),
            ("root", c.root.to_string()),
        ]
    };
    let (fa, fb) = (fields(a), fields(b));
    let differing = |mine: &[(&str, String)], theirs: &[(&str, String)]| {
        let pairs = mine.iter().zip(theirs).filter(|(m, t)| m.1 != t.1);
        let named: Vec<String> = pairs.map(|(m, _)| format!("{}: {}", m.0, m.1)).collect();
        named.join(" ")
    };
    format!(
        "ranks disagree: rank {r0} has {}, rank {r1} has {}",
        differing(&fa, &fb),
        differing(&fb, &fa)
    )
}

/// Rank `rank`'s part of a call's result: its block of a reduce-scatter, else all of it.
fn share(call: &Call, rank: u32, size: usize, all: &[u8]) -> Vec<u8> {
    match call.kind {
        Kind::ReduceScatter => {
            let block = all.len() / size;
            all[rank as usize * block..][..block].to_vec()
        }
        _ => all.to_vec(),
    }
}
