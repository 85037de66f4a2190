//! Ranks as processes (torchrun's or Slurm's, one per rank), joined by TCP: [`socket_group`]
//! connects each rank to every other (rank r connects to the ranks below it and accepts the
//! ones above), after the launcher's store told every rank the others' addresses. Subgroups
//! (a tensor-parallel pair, a data-parallel set: [`SocketComm::subgroup`]) run over the same
//! connections, their frames told apart by the group's id.
//!
//! Each connection carries frames one way per direction: a collective's part (its sequence
//! number, the call, the values) or a point-to-point message. A rank writes its part to every
//! peer through a writer thread per peer — so two ranks sending each other megabytes never
//! block on each other's full socket buffers — and reads every peer's part on the caller's
//! thread; a frame read ahead of its turn (a message while waiting for a collective, or the
//! reverse) waits in a queue. A peer whose connection closes (its process gone, or its
//! communicator dropped) fails whatever waits on it; one that sends nothing fails it after
//! the group's timeout.

use super::{collective_error, Group, Kind, Link, Part, Signature, Values};
use crate::engine::comm::ReduceOp;
use crate::engine::Result;
use crate::tensor::DType;
use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::io::{BufReader, ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::rc::Rc;
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// One rank of a [`socket_group`].
pub type SocketComm = Group<Sockets>;

/// A connection's first bytes, then the group's token, the size and the connecting rank.
const HELLO: &[u8; 16] = b"mindkit-cpu-grp1";

/// Join the group of `peers.len()` ranks as `rank`. `listener` is this rank's, already bound
/// at `peers[rank]`; `token` is the same on every rank of this group and no other (a launch
/// attempt's), so a stray connection is refused. Connecting waits at most `timeout`, as does
/// every later call for the other ranks.
pub fn socket_group(
    rank: usize,
    listener: TcpListener,
    peers: &[SocketAddr],
    token: u64,
    timeout: Duration,
) -> Result<SocketComm> {
    let size = peers.len();
    if rank >= size {
        return Err(collective_error(
            rank,
            format!("not a rank of a group of {size}"),
        ));
    }
    let mut streams: Vec<Option<TcpStream>> = (0..size).map(|_| None).collect();
    for (r, addr) in peers.iter().enumerate().take(rank) {
        let mut s = TcpStream::connect_timeout(addr, timeout).map_err(|e| {
            collective_error(rank, format!("connecting to rank {r} at {addr}: {e}"))
        })?;
        let words = [token, size as u64, rank as u64].map(u64::to_le_bytes);
        s.write_all(&[&HELLO[..], &words[0], &words[1], &words[2]].concat())
            .map_err(|e| collective_error(rank, format!("greeting rank {r} at {addr}: {e}")))?;
        streams[r] = Some(s);
    }
    accept_higher(rank, &listener, (token, size), timeout, &mut streams)?;
    let peers = streams
        .into_iter()
        .enumerate()
        .map(|(r, s)| s.map(|s| Peer::start(s, r, timeout)).transpose())
        .collect::<std::io::Result<Vec<_>>>()
        .map_err(|e| collective_error(rank, format!("setting up the connections: {e}")))?;
    Ok(Group::new(Sockets {
        mesh: Rc::new(Mesh {
            rank,
            timeout,
            peers,
        }),
        id: 0,
        members: (0..size).collect(),
        me: rank,
    }))
}

/// Accept the connections of ranks `rank + 1..size`, each greeting with this group's token.
fn accept_higher(
    rank: usize,
    listener: &TcpListener,
    (token, size): (u64, usize),
    timeout: Duration,
    streams: &mut [Option<TcpStream>],
) -> Result<()> {
    let fail = |msg: String| collective_error(rank, msg);
    let deadline = Instant::now() + timeout;
    listener
        .set_nonblocking(true)
        .map_err(|e| fail(format!("listening: {e}")))?;
    while streams[rank + 1..].iter().any(Option::is_none) {
        let (mut s, from) = match listener.accept() {
            Ok(conn) => conn,
            Err(e) if e.kind() == ErrorKind::WouldBlock && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(5));
                continue;
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                let missing: Vec<usize> =
                    (rank + 1..size).filter(|&r| streams[r].is_none()).collect();
                return Err(fail(format!(
                    "rank(s) {missing:?} did not connect within {} s",
                    timeout.as_secs_f64()
                )));
            }
            Err(e) => return Err(fail(format!("accepting: {e}"))),
        };
        s.set_nonblocking(false)
            .and_then(|()| s.set_read_timeout(Some(timeout)))
            .map_err(|e| fail(format!("accepting {from}: {e}")))?;
        let mut hello = [0u8; 40];
        // A connection that is not a rank of this group is closed and ignored.
        if s.read_exact(&mut hello).is_err() || hello[..16] != HELLO[..] {
            continue;
        }
        let word = |i: usize| u64::from_le_bytes(hello[16 + 8 * i..][..8].try_into().unwrap());
        let peer = usize::try_from(word(2)).unwrap_or(usize::MAX);
        if word(0) != token || word(1) != size as u64 || peer <= rank || peer >= size {
            continue;
        }
        if streams[peer].is_some() {
            return Err(fail(format!("rank {peer} connected twice (from {from})")));
        }
        streams[peer] = Some(s);
    }
    Ok(())
}

/// A group of ranks over the connections of the whole mesh: the world group that
/// [`socket_group`] returns, or one of its subgroups ([`SocketComm::subgroup`]).
pub struct Sockets {
    mesh: Rc<Mesh>,
    /// The group's id on the wire: 0 for the world, the caller's for a subgroup.
    id: u32,
    /// The global ranks of the group, in its rank order.
    members: Vec<usize>,
    /// This rank's place among them.
    me: usize,
}

/// This rank's connections to every other rank.
struct Mesh {
    rank: usize,
    timeout: Duration,
    /// By global rank; `None` at this rank's own place.
    peers: Vec<Option<Peer>>,
}

/// One connection: frames out through a writer thread, frames in on the caller's thread.
struct Peer {
    rank: usize,
    reader: RefCell<BufReader<TcpStream>>,
    stream: TcpStream,
    out: Option<mpsc::Sender<Arc<Vec<u8>>>>,
    writer: Option<JoinHandle<()>>,
    /// Frames read ahead of their turn.
    early: RefCell<HashMap<FrameKey, VecDeque<(u64, Part)>>>,
}

/// A frame's group id and kind.
type FrameKey = (u32, u8);

/// What a frame carries.
const COLLECTIVE: u8 = 0;
const POST: u8 = 1;

impl Peer {
    fn start(stream: TcpStream, rank: usize, timeout: Duration) -> std::io::Result<Peer> {
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(timeout))?;
        let (out, frames) = mpsc::channel::<Arc<Vec<u8>>>();
        let mut w = stream.try_clone()?;
        // A write that fails means the peer is gone; its reads then fail and say so.
        let writer = std::thread::Builder::new()
            .name(format!("mindkit-comm-to-{rank}"))
            .spawn(move || {
                for frame in frames {
                    if w.write_all(&frame).is_err() {
                        break;
                    }
                }
            })?;
        Ok(Peer {
            rank,
            reader: RefCell::new(BufReader::with_capacity(1 << 20, stream.try_clone()?)),
            stream,
            out: Some(out),
            writer: Some(writer),
            early: RefCell::new(HashMap::new()),
        })
    }

    fn write(&self, frame: Arc<Vec<u8>>) -> std::result::Result<(), String> {
        let out = self.out.as_ref().expect("a live peer has its writer");
        out.send(frame)
            .map_err(|_| format!("rank {} left the group", self.rank))
    }

    /// Read frames until one of the kind `want` for group `group` comes; others wait for
    /// their turn.
    fn read_until(&self, group: u32, want: u8) -> std::result::Result<(u64, Part), String> {
        let key = (group, want);
        if let Some(early) = self
            .early
            .borrow_mut()
            .get_mut(&key)
            .and_then(VecDeque::pop_front)
        {
            return Ok(early);
        }
        loop {
            let (got, seq, part) = read_frame(&mut *self.reader.borrow_mut(), self.rank)?;
            if got == key {
                return Ok((seq, part));
            }
            self.early
                .borrow_mut()
                .entry(got)
                .or_default()
                .push_back((seq, part));
        }
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        // Let the writer send what is queued, then tell the peer this rank is gone.
        self.out = None;
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
        let _ = self.stream.shutdown(Shutdown::Both);
    }
}

impl Sockets {
    /// The connection to the group's rank `r`.
    fn peer(&self, r: usize) -> &Peer {
        self.mesh.peers[self.members[r]]
            .as_ref()
            .expect("callers name other ranks only")
    }

    fn others(&self) -> impl Iterator<Item = &Peer> {
        (0..self.members.len())
            .filter(|&r| r != self.me)
            .map(|r| self.peer(r))
    }

    /// A read error as the group reports it: a timeout names the rank and the time.
    fn timed_out(&self, e: String, r: usize) -> String {
        if e == TIMED_OUT {
            format!(
                "rank(s) [{r}] did not arrive within {} s",
                self.mesh.timeout.as_secs_f64()
            )
        } else {
            e
        }
    }
}

impl Group<Sockets> {
    /// The subgroup of the global ranks `members` (in its rank order; this rank among them),
    /// over the same connections. `id` names it on the wire: every member passes the same,
    /// and no other group this rank belongs to has it (0 is the world's).
    pub fn subgroup(&self, id: u32, members: Vec<usize>) -> Result<SocketComm> {
        let world = &self.link.mesh;
        let fail = |msg: String| collective_error(world.rank, msg);
        if id == 0 {
            return Err(fail("subgroup id 0 is the world's".into()));
        }
        let me = members
            .iter()
            .position(|&r| r == world.rank)
            .ok_or_else(|| {
                fail(format!(
                    "rank {} is not in the subgroup {members:?}",
                    world.rank
                ))
            })?;
        let unique: std::collections::BTreeSet<_> = members.iter().collect();
        if unique.len() != members.len() || members.iter().any(|&r| r >= world.peers.len()) {
            return Err(fail(format!(
                "{members:?} are not distinct ranks of a group of {}",
                world.peers.len()
            )));
        }
        Ok(Group::new(Sockets {
            mesh: world.clone(),
            id,
            members,
            me,
        }))
    }
}

impl Link for Sockets {
    fn rank(&self) -> usize {
        self.me
    }

    fn size(&self) -> usize {
        self.members.len()
    }

    fn exchange(&self, seq: u64, what: &str, part: Part) -> Result<Vec<Part>> {
        let fail = |msg: String| collective_error(self.me, format!("{what}: {msg}"));
        let frame = Arc::new(encode((self.id, COLLECTIVE), seq, &part));
        for peer in self.others() {
            peer.write(frame.clone()).map_err(fail)?;
        }
        let mut parts = Vec::with_capacity(self.members.len());
        for r in 0..self.members.len() {
            if r == self.me {
                parts.push(part.clone());
                continue;
            }
            let (got, p) = self
                .peer(r)
                .read_until(self.id, COLLECTIVE)
                .map_err(|e| fail(self.timed_out(e, r)))?;
            if got != seq {
                return Err(fail(format!("rank {r} is at collective #{got}")));
            }
            parts.push(p);
        }
        Ok(parts)
    }

    fn post(&self, to: usize, part: Part) -> Result<()> {
        self.peer(to)
            .write(Arc::new(encode((self.id, POST), 0, &part)))
            .map_err(|e| collective_error(self.me, format!("send to rank {to}: {e}")))
    }

    fn take(&self, from: usize) -> Result<Part> {
        let (_, part) = self.peer(from).read_until(self.id, POST).map_err(|e| {
            collective_error(
                self.me,
                format!("recv from rank {from}: {}", self.timed_out(e, from)),
            )
        })?;
        Ok(part)
    }
}

const TIMED_OUT: &str = "timed out";

/// A frame's fixed part: group (4), kind (1), sequence number (8), collective (1), count (8),
/// dtype (1), reduction (1), root (8), values (8).
const HEAD: usize = 40;

/// The frame of `part`: its group and kind, sequence number, the call, then the values as
/// f32 LE, or the bytes of a host byte collective.
fn encode((group, tag): FrameKey, seq: u64, part: &Part) -> Vec<u8> {
    let c = &part.call;
    let (floats, bytes) = (part.floats(), part.bytes());
    let mut f = Vec::with_capacity(HEAD + 4 * floats.len() + bytes.len());
    f.extend_from_slice(&group.to_le_bytes());
    f.push(tag);
    f.extend_from_slice(&seq.to_le_bytes());
    f.push(c.kind as u8);
    f.extend_from_slice(&(c.count as u64).to_le_bytes());
    f.push(dtype_code(c.dtype));
    f.push(match c.op {
        None => 0,
        Some(ReduceOp::Sum) => 1,
        Some(ReduceOp::Max) => 2,
    });
    f.extend_from_slice(&c.root.map_or(u64::MAX, |r| r as u64).to_le_bytes());
    f.extend_from_slice(&((floats.len() + bytes.len()) as u64).to_le_bytes());
    for v in floats {
        f.extend_from_slice(&v.to_le_bytes());
    }
    f.extend_from_slice(bytes);
    f
}

/// Read one frame from rank `from`; the values' length is trusted only as far as bytes arrive.
fn read_frame(
    r: &mut impl Read,
    from: usize,
) -> std::result::Result<(FrameKey, u64, Part), String> {
    let mut frame = [0u8; HEAD];
    r.read_exact(&mut frame).map_err(|e| read_error(&e, from))?;
    let group = u32::from_le_bytes(frame[..4].try_into().unwrap());
    let head = &frame[4..];
    let word = |at: usize| u64::from_le_bytes(head[at..at + 8].try_into().unwrap());
    let bad = |what: &str| format!("rank {from} sent a frame with {what}");
    let tag = head[0];
    if tag != COLLECTIVE && tag != POST {
        return Err(bad("an unknown tag"));
    }
    let kind = *Kind::ALL
        .get(head[9] as usize)
        .ok_or_else(|| bad("an unknown collective"))?;
    let op = match head[19] {
        0 => None,
        1 => Some(ReduceOp::Sum),
        2 => Some(ReduceOp::Max),
        _ => return Err(bad("an unknown reduction")),
    };
    let call = Signature {
        kind,
        count: usize::try_from(word(10)).map_err(|_| bad("a count too large"))?,
        dtype: dtype_of(head[18]).ok_or_else(|| bad("an unknown dtype"))?,
        op,
        root: Some(word(20))
            .filter(|&r| r != u64::MAX)
            .map(|r| usize::try_from(r).unwrap_or(usize::MAX)),
    };
    let width = if kind.carries_bytes() { 1 } else { 4 };
    let n = word(28).saturating_mul(width);
    let mut bytes = Vec::new();
    r.take(n)
        .read_to_end(&mut bytes)
        .map_err(|e| read_error(&e, from))?;
    if bytes.len() as u64 != n {
        return Err(format!("rank {from} left the group"));
    }
    let values = match kind.carries_bytes() {
        true => Values::Bytes(Arc::new(bytes)),
        false => Values::Floats(Arc::new(
            (bytes.chunks_exact(4))
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect(),
        )),
    };
    Ok(((group, tag), word(1), Part::new(call, values)))
}

fn read_error(e: &std::io::Error, from: usize) -> String {
    match e.kind() {
        ErrorKind::WouldBlock | ErrorKind::TimedOut => TIMED_OUT.to_string(),
        _ => format!("rank {from} left the group"),
    }
}

fn dtype_code(d: DType) -> u8 {
    match d {
        DType::F64 => 0,
        DType::F32 => 1,
        DType::F16 => 2,
        DType::BF16 => 3,
        DType::I64 => 4,
        DType::I32 => 5,
        DType::I16 => 6,
        DType::I8 => 7,
        DType::U8 => 8,
        DType::Bool => 9,
        DType::F8E4M3 => 10,
    }
}

fn dtype_of(code: u8) -> Option<DType> {
    [
        DType::F64,
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::I64,
        DType::I32,
        DType::I16,
        DType::I8,
        DType::U8,
        DType::Bool,
        DType::F8E4M3,
    ]
    .into_iter()
    .find(|&d| dtype_code(d) == code)
}
