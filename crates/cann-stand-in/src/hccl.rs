//! The stand-in's `libhccl.so`: HCCL's communicators and collectives between ranks on this
//! machine, processes (torchrun's one per rank) or threads of one process (a communicator each),
//! computed on the stand-in's host memory and as strict as the rest of it.
//!
//! `HcclGetRootInfo` starts a [`hub`] in the calling process, serving a Unix-domain socket whose
//! path the root info carries; `HcclCommInitClusterInfo` derives the socket from the rank
//! table's path and rank 0 serves it; `HcclCreateSubCommConfig` derives it from the parent's
//! socket and the sub-communicator's id, and the sub-communicator's rank 0 serves it. Each communicator is one connection to its hub, speaking
//! [`wire`]'s frames: a call checks its arguments here (the runtime initialised and a device
//! bound, a live communicator, a known stream, buffers that are device memory holding `count`
//! elements, a dtype and reduction HCCL has), copies its send bytes out of device memory,
//! then — the runtime's lock released, other ranks of this process need it — gives them to the
//! hub and waits for its part of the result, which it writes to the receive buffer as stream
//! work (read by the host only after a synchronize). Every rank of a call must agree on it (the
//! kind, count, dtype, reduction, root): else all fail, naming the two ranks and what differs.
//! A rank that fails a call here tells the hub, so the others fail at once instead of waiting;
//! a rank that leaves (its communicator destroyed, its process gone) fails whatever waits on it
//! (HCCL_E_REMOTE); ranks that never come fail the others after `HCCL_CONNECT_TIMEOUT` /
//! `HCCL_EXEC_TIMEOUT` seconds. Communicators still alive at `aclFinalize` are leaks.

mod data;
mod hub;
mod rank_table;
mod wire;

use crate::{fail, lock as runtime, recent_message, Runtime, CURRENT_DEVICE};
use ascendcl_sys::aclrtStream;
use hccl_sys::*;
use std::cell::Cell;
use std::collections::{BTreeMap, BTreeSet};
use std::ffi::{c_char, c_void, CStr, OsStr};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};
use wire::{Call, Data, Kind, Reply, Request};

/// The root info's first bytes; the hub's socket path follows, NUL-terminated.
const MAGIC: &[u8; 16] = b"mindkit-hccl-v2\0";

/// Unix-domain socket paths must fit `sun_path` (108 bytes with its NUL on Linux).
const MAX_SOCKET_PATH: usize = 100;

/// What an `HcclComm` handle points at: this rank's connection to its hub.
struct Comm {
    rank: u32,
    size: u32,
    /// Its hub's socket (sub-communicators derive theirs from it).
    socket: PathBuf,
    link: Mutex<Link>,
}

struct Link {
    hub: UnixStream,
    /// The sequence number of this communicator's next collective.
    next_call: u64,
}

/// Live communicators (their handles' addresses).
static LIVE: Mutex<BTreeSet<usize>> = Mutex::new(BTreeSet::new());
/// Per HCCL function: calls and the bytes this process's ranks sent, since the last report.
static COUNTED: Mutex<BTreeMap<&'static str, (u64, u64)>> = Mutex::new(BTreeMap::new());
/// Hubs started by this process, for their sockets' names.
static HUBS: AtomicU64 = AtomicU64::new(0);

fn locked<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Count a call of `name` that sent `bytes`.
fn count(name: &'static str, bytes: usize) {
    let mut counted = locked(&COUNTED);
    let entry = counted.entry(name).or_default();
    *entry = (entry.0 + 1, entry.1 + bytes as u64);
}

/// The counts as JSON members (`"HcclAllReduce": {"calls": n, "bytes": b}, …`), then reset:
/// `aclFinalize`'s report.
pub(crate) fn counted() -> String {
    let mut counted = locked(&COUNTED);
    let members: Vec<String> = counted
        .iter()
        .map(|(name, (calls, bytes))| {
            format!("\"{name}\": {{\"calls\": {calls}, \"bytes\": {bytes}}}")
        })
        .collect();
    counted.clear();
    members.join(", ")
}

/// Communicators never destroyed (for `aclFinalize`'s leak report).
/// Keep this process's hubs until their ranks in other processes are done with them (at most
/// `HCCL_EXEC_TIMEOUT`): called by `aclFinalize`, which a process calls on its way out. Not
/// while a communicator of this process lives: its rank would never leave.
pub(crate) fn await_departures() {
    if locked(&LIVE).is_empty() {
        hub::await_departures(exec_timeout_ms());
    }
}

pub(crate) fn leaks() -> Option<String> {
    let n = locked(&LIVE).len();
    (n > 0).then(|| format!("{n} HCCL communicators never destroyed"))
}

/// An HCCL environment variable's seconds in milliseconds; 0 is "never" (u64::MAX).
fn timeout_ms(var: &str, default_s: u64) -> u64 {
    let seconds = std::env::var(var).ok().and_then(|v| v.trim().parse().ok());
    match seconds.unwrap_or(default_s) {
        0 => u64::MAX,
        s => s.saturating_mul(1000),
    }
}

fn connect_timeout_ms() -> u64 {
    timeout_ms("HCCL_CONNECT_TIMEOUT", 120)
}

fn exec_timeout_ms() -> u64 {
    timeout_ms("HCCL_EXEC_TIMEOUT", 1836)
}

fn result(outcome: Result<(), HcclResult>) -> HcclResult {
    outcome.err().unwrap_or(HCCL_SUCCESS)
}

/// The runtime initialised and a device bound on this thread, as HCCL needs.
fn check_device(call: &str) -> Result<(), HcclResult> {
    let ready = runtime().as_ref().is_some_and(|rt| rt.inits > 0);
    if !ready || CURRENT_DEVICE.with(Cell::get).is_none() {
        let why = format!("{call} before aclInit and aclrtSetDevice on this thread");
        return Err(fail(HCCL_E_RUNTIME, why));
    }
    Ok(())
}

/// The runtime, which an `aclFinalize` on another thread may have ended since [`check_device`].
fn still_initialised<'a>(
    call: &str,
    runtime: &'a mut Option<Runtime>,
) -> Result<&'a mut Runtime, HcclResult> {
    let why = || format!("{call}: aclFinalize on another thread during the call");
    runtime.as_mut().ok_or_else(|| fail(HCCL_E_RUNTIME, why()))
}

/// Write `value` through the caller's out-pointer `out`, which must not be NULL.
fn put<T>(call: &str, out: *mut T, value: T) -> Result<(), HcclResult> {
    if out.is_null() {
        return Err(fail(HCCL_E_PTR, format!("{call}: an out-pointer is NULL")));
    }
    // SAFETY: non-null; the caller's out-pointer of type T, as the API requires.
    unsafe { out.write(value) };
    Ok(())
}

/// The socket path of a hub named `name`: in `$TMPDIR`, else /tmp where that is too long.
fn socket_path(name: &str) -> PathBuf {
    let path = std::env::temp_dir().join(name);
    if path.as_os_str().len() < MAX_SOCKET_PATH {
        return path;
    }
    Path::new("/tmp").join(name)
}

/// A socket path for a new hub of this process.
fn fresh_socket_path() -> PathBuf {
    let n = HUBS.fetch_add(1, Ordering::Relaxed);
    socket_path(&format!("mindkit-hccl-{}-{n}.sock", std::process::id()))
}

#[no_mangle]
pub extern "C" fn HcclGetRootInfo(root_info: *mut HcclRootInfo) -> HcclResult {
    if root_info.is_null() {
        return fail(HCCL_E_PTR, "HcclGetRootInfo: rootInfo is NULL".into());
    }
    let path = fresh_socket_path();
    if let Err(e) = hub::start(&path) {
        let why = format!(
            "HcclGetRootInfo: cannot serve a hub at {}: {e}",
            path.display()
        );
        return fail(HCCL_E_INTERNAL, why);
    }
    let path_bytes = path.as_os_str().as_bytes();
    let mut info = [0u8; HCCL_ROOT_INFO_BYTES];
    info[..MAGIC.len()].copy_from_slice(MAGIC);
    info[MAGIC.len()..][..path_bytes.len()].copy_from_slice(path_bytes);
    // SAFETY: the caller's root info, HCCL_ROOT_INFO_BYTES plain bytes.
    unsafe { std::ptr::copy_nonoverlapping(info.as_ptr(), root_info.cast::<u8>(), info.len()) };
    HCCL_SUCCESS
}

/// The hub socket a root info names.
fn hub_of(root: &HcclRootInfo) -> Result<PathBuf, HcclResult> {
    // SAFETY: HcclRootInfo is plain bytes.
    let bytes: &[u8; HCCL_ROOT_INFO_BYTES] = unsafe { &*(root as *const HcclRootInfo).cast() };
    let (magic, rest) = bytes.split_at(MAGIC.len());
    if magic != MAGIC {
        let why = "HcclCommInitRootInfo: root info not from HcclGetRootInfo";
        return Err(fail(HCCL_E_PARA, why.into()));
    }
    let path = rest.split(|&b| b == 0).next().unwrap_or_default();
    Ok(PathBuf::from(OsStr::from_bytes(path)))
}

#[no_mangle]
pub extern "C" fn HcclCommInitRootInfo(
    n_ranks: u32,
    root_info: *const HcclRootInfo,
    rank: u32,
    comm: *mut HcclComm,
) -> HcclResult {
    const CALL: &str = "HcclCommInitRootInfo";
    let init = || {
        check_device(CALL)?;
        // SAFETY: the caller's root info, when not NULL.
        let root = unsafe { root_info.as_ref() }
            .ok_or_else(|| fail(HCCL_E_PTR, format!("{CALL}: rootInfo is NULL")))?;
        check_rank(CALL, rank, n_ranks)?;
        let path = hub_of(root)?;
        let hub = UnixStream::connect(&path).map_err(|e| {
            let why = format!("{CALL}: cannot reach the root info's hub at {} ({e}): did the process of HcclGetRootInfo exit, or did every rank join already?", path.display());
            fail(HCCL_E_TCP_CONNECT, why)
        })?;
        put(CALL, comm, join(CALL, (hub, path), n_ranks, rank)?)
    };
    result(init())
}

fn check_rank(call: &str, rank: u32, size: u32) -> Result<(), HcclResult> {
    if rank < size {
        return Ok(());
    }
    Err(fail(
        HCCL_E_PARA,
        format!("{call}: rank {rank} is not a rank of {size}"),
    ))
}

/// Join the communicator of `size` served at the end of `hub` as `rank`, waiting for the
/// others; the new communicator's handle.
fn join(
    call: &str,
    (hub, socket): (UnixStream, PathBuf),
    size: u32,
    rank: u32,
) -> Result<HcclComm, HcclResult> {
    let comm = Comm {
        rank,
        size,
        socket,
        link: Mutex::new(Link { hub, next_call: 0 }),
    };
    let timeout_ms = connect_timeout_ms();
    let joined = comm.request(
        call,
        &Request::Join {
            size,
            rank,
            timeout_ms,
        },
    );
    // the hub's messages about joining do not name the function
    joined.map_err(|code| fail(code, format!("{call}: {}", recent_message())))?;
    let handle = Box::into_raw(Box::new(comm));
    locked(&LIVE).insert(handle as usize);
    Ok(handle.cast())
}

#[no_mangle]
pub extern "C" fn HcclCommInitClusterInfo(
    cluster_info: *const c_char,
    rank: u32,
    comm: *mut HcclComm,
) -> HcclResult {
    const CALL: &str = "HcclCommInitClusterInfo";
    let init = || {
        check_device(CALL)?;
        if cluster_info.is_null() {
            return Err(fail(HCCL_E_PTR, format!("{CALL}: clusterInfo is NULL")));
        }
        // SAFETY: the caller's NUL-terminated path.
        let file = Path::new(OsStr::from_bytes(
            unsafe { CStr::from_ptr(cluster_info) }.to_bytes(),
        ));
        let table =
            rank_table::read(file).map_err(|(code, why)| fail(code, format!("{CALL}: {why}")))?;
        check_rank(CALL, rank, table.size)?;
        let socket = rank_table_socket(&table.canonical);
        if rank == 0 {
            serve(CALL, &socket)?;
        }
        let hub = connect_until_timeout(CALL, &socket)?;
        put(CALL, comm, join(CALL, (hub, socket), table.size, rank)?)
    };
    result(init())
}

#[no_mangle]
pub extern "C" fn HcclCreateSubCommConfig(
    comm: *mut HcclComm,
    rank_num: u32,
    rank_ids: *mut u32,
    sub_comm_id: u64,
    sub_comm_rank_id: u32,
    config: *mut HcclCommConfig,
    sub_comm: *mut HcclComm,
) -> HcclResult {
    const CALL: &str = "HcclCreateSubCommConfig";
    let init = || {
        check_device(CALL)?;
        let null = |what: &str| fail(HCCL_E_PTR, format!("{CALL}: {what} is NULL"));
        // SAFETY: the caller's pointers, when not NULL.
        let parent = *unsafe { comm.as_ref() }.ok_or_else(|| null("comm"))?;
        let parent = comm_of(CALL, parent)?;
        // SAFETY: the caller's configuration, when not NULL.
        let config = unsafe { config.as_ref() }.ok_or_else(|| null("config"))?;
        let (size, magic, version) = config.header();
        if magic != HCCL_COMM_CONFIG_MAGIC_WORD || size == 0 || version == 0 {
            let why = format!("{CALL}: config not made by HcclCommConfigInit (size {size}, magic {magic:#x}, version {version})");
            return Err(fail(HCCL_E_PARA, why));
        }
        if rank_ids.is_null() {
            return Err(null("rankIds"));
        }
        // SAFETY: the caller's array of rank_num ranks.
        let ids = unsafe { std::slice::from_raw_parts(rank_ids, rank_num as usize) };
        let distinct: BTreeSet<u32> = ids.iter().copied().collect();
        if ids.is_empty() || distinct.len() != ids.len() || ids.iter().any(|&r| r >= parent.size) {
            let why = format!(
                "{CALL}: rankIds {ids:?} are not distinct ranks of the {} of comm",
                parent.size
            );
            return Err(fail(HCCL_E_PARA, why));
        }
        check_rank(CALL, sub_comm_rank_id, rank_num)?;
        if ids[sub_comm_rank_id as usize] != parent.rank {
            let why = format!("{CALL}: subCommRankId {sub_comm_rank_id} is rank {} of comm, the caller is rank {}", ids[sub_comm_rank_id as usize], parent.rank);
            return Err(fail(HCCL_E_PARA, why));
        }
        let socket = sub_socket(&parent.socket, sub_comm_id);
        if sub_comm_rank_id == 0 {
            serve(CALL, &socket)?;
        }
        let hub = connect_until_timeout(CALL, &socket)?;
        put(
            CALL,
            sub_comm,
            join(CALL, (hub, socket), rank_num, sub_comm_rank_id)?,
        )
    };
    result(init())
}

/// The hub socket of sub-communicator `id` of the communicator served at `parent`.
fn sub_socket(parent: &Path, id: u64) -> PathBuf {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    (parent, id).hash(&mut hasher);
    socket_path(&format!("mindkit-hccl-sub-{:016x}.sock", hasher.finish()))
}

/// The hub socket of the rank table at `canonical`: the same for every rank of the job.
fn rank_table_socket(canonical: &Path) -> PathBuf {
    use std::hash::{Hash, Hasher};
    // DefaultHasher::new() has fixed keys: every process of the job derives the same name
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    canonical.hash(&mut hasher);
    socket_path(&format!("mindkit-hccl-table-{:016x}.sock", hasher.finish()))
}

/// Rank 0 (of a rank table, or of a sub-communicator): serve the hub, replacing a socket a
/// dead job left.
fn serve(call: &str, socket: &Path) -> Result<(), HcclResult> {
    let busy = socket.exists() && UnixStream::connect(socket).is_ok();
    if busy {
        let why = format!(
            "{call}: another rank 0 serves this communicator at {}",
            socket.display()
        );
        return Err(fail(HCCL_E_PARA, why));
    }
    let _ = std::fs::remove_file(socket);
    hub::start(socket).map_err(|e| {
        let why = format!("{call}: cannot serve a hub at {}: {e}", socket.display());
        fail(HCCL_E_INTERNAL, why)
    })
}

/// Connect to a hub rank 0 serves, retrying until it does or the connect timeout.
fn connect_until_timeout(call: &str, socket: &Path) -> Result<UnixStream, HcclResult> {
    let deadline = Instant::now().checked_add(Duration::from_millis(connect_timeout_ms()));
    loop {
        match UnixStream::connect(socket) {
            Ok(hub) => return Ok(hub),
            Err(e) if deadline.is_some_and(|d| Instant::now() >= d) => {
                let why = format!("{call}: rank 0 never served the communicator at {} ({e}; HCCL_CONNECT_TIMEOUT)", socket.display());
                return Err(fail(HCCL_E_TIMEOUT, why));
            }
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// The live communicator `comm` points at.
fn comm_of<'a>(call: &str, comm: HcclComm) -> Result<&'a Comm, HcclResult> {
    if !locked(&LIVE).contains(&(comm as usize)) {
        let why = format!("{call}: {comm:?} is not a live communicator");
        return Err(fail(HCCL_E_PARA, why));
    }
    // SAFETY: a live handle made by `join` (freed only by HcclCommDestroy, which removes it).
    Ok(unsafe { &*(comm as *const Comm) })
}

impl Comm {
    fn link(&self) -> MutexGuard<'_, Link> {
        locked(&self.link)
    }

    /// Make `request` of the hub and wait for the bytes of its reply; a failure's message is
    /// recorded for `aclGetRecentErrMsg` as the hub gave it.
    fn request(&self, call: &str, request: &Request) -> Result<Vec<u8>, HcclResult> {
        let mut link = self.link();
        let gone = |e: std::io::Error| {
            let why = format!("{call}: the hub is gone ({e}): did the process of HcclGetRootInfo (or rank table rank 0) exit?");
            fail(HCCL_E_REMOTE, why)
        };
        wire::write_request(&mut link.hub, request).map_err(gone)?;
        match wire::read_reply(&mut link.hub).map_err(gone)? {
            Reply::Done(bytes) => Ok(bytes),
            Reply::Failed(code, why) => Err(fail(code, why)),
        }
    }

    /// Tell the hub `request`, which it does not answer: this rank failed a call (so that the
    /// others do not wait for it), or leaves. A hub already gone has no one to tell.
    fn tell(&self, request: &Request) {
        debug_assert!(!request.answered());
        let _ = wire::write_request(&mut self.link().hub, request);
    }

    /// The sequence number of this communicator's next collective.
    fn next_call(&self) -> u64 {
        let mut link = self.link();
        link.next_call += 1;
        link.next_call - 1
    }

    /// A point-to-point peer: another rank of the communicator.
    fn check_peer(&self, call: &str, peer: u32) -> Result<(), HcclResult> {
        if peer < self.size && peer != self.rank {
            return Ok(());
        }
        let why = format!(
            "{call}: rank {peer} is not another rank of {} (this is rank {})",
            self.size, self.rank
        );
        Err(fail(HCCL_E_PARA, why))
    }
}

/// A device buffer: its address and length in bytes.
#[derive(Clone, Copy)]
struct Buffer {
    at: usize,
    len: usize,
}

/// The bytes of `count` elements of `dtype`.
fn byte_len(call: &str, count: u64, dtype: HcclDataType) -> Result<usize, HcclResult> {
    let size = data::element_size(dtype).ok_or_else(|| {
        fail(
            HCCL_E_NOT_SUPPORT,
            format!("{call}: dtype {dtype} is not one HCCL moves"),
        )
    })?;
    usize::try_from(count)
        .ok()
        .and_then(|n| n.checked_mul(size))
        .ok_or_else(|| fail(HCCL_E_PARA, format!("{call}: count {count} is too large")))
}

/// A device buffer of `count` elements of `dtype` at `ptr`.
fn buffer(
    call: &str,
    ptr: *mut c_void,
    count: u64,
    dtype: HcclDataType,
) -> Result<Buffer, HcclResult> {
    Ok(Buffer {
        at: ptr as usize,
        len: byte_len(call, count, dtype)?,
    })
}

/// The checks every call on `stream` makes under the runtime's lock (after [`check_device`]):
/// the stream is live, each of `buffers` (named) is device memory from aclrtMalloc; the bytes
/// of the one to send.
fn check_stream_and_buffers(
    call: &str,
    stream: aclrtStream,
    buffers: &[(&str, Buffer)],
    send: Option<Buffer>,
) -> Result<Vec<u8>, HcclResult> {
    let mut guard = runtime();
    let rt = still_initialised(call, &mut guard)?;
    if !rt.streams.contains(&(stream as usize)) {
        return Err(fail(
            HCCL_E_PARA,
            format!("{call}: {stream:?} is not a live stream"),
        ));
    }
    for (what, b) in buffers {
        rt.region(b.at, b.len, &format!("{call} {what}"))
            .map_err(|_| HCCL_E_PARA)?;
    }
    // SAFETY: the send buffer was checked above to lie in a live allocation.
    Ok(send.map_or_else(Vec::new, |b| unsafe {
        std::slice::from_raw_parts(b.at as *const u8, b.len).to_vec()
    }))
}

/// Write `bytes`, the hub's answer, to the device buffer `to` as stream work; re-checked, the
/// memory may have gone while the call waited.
fn write_device(what: &str, to: Buffer, bytes: &[u8]) -> Result<(), HcclResult> {
    if bytes.len() != to.len {
        let why = format!(
            "{what}: the hub answered {} bytes for {}",
            bytes.len(),
            to.len
        );
        return Err(fail(HCCL_E_INTERNAL, why));
    }
    let mut guard = runtime();
    let rt = still_initialised(what, &mut guard)?;
    let allocation = rt.region(to.at, to.len, what).map_err(|_| HCCL_E_PARA)?;
    allocation.written_async = true;
    // SAFETY: the range was checked to lie in a live allocation.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), to.at as *mut u8, to.len) };
    Ok(())
}

fn overlap(a: Buffer, b: Buffer) -> bool {
    a.at < b.at + b.len && b.at < a.at + a.len
}

/// A collective's buffers: what it sends (a broadcast's non-root ranks send nothing) and where
/// its result goes.
struct Buffers {
    send: Option<Buffer>,
    recv: Buffer,
}

/// Run collective `call` of `comm` on `stream`: check it here (the buffers by `layout`, given
/// the communicator), then exchange through the hub and write this rank's result.
fn collective(
    call: Call,
    (comm, stream): (HcclComm, aclrtStream),
    layout: impl FnOnce(&Comm) -> Result<Buffers, HcclResult>,
) -> HcclResult {
    let name = call.kind.name();
    let run = || {
        let c = comm_of(name, comm)?;
        let call = Call {
            seq: c.next_call(),
            ..call
        };
        let timeout_ms = exec_timeout_ms();
        let request = |data: Data| Request::Collective {
            call,
            timeout_ms,
            data,
        };
        match check_collective(c, &call, stream, layout) {
            Err(code) => {
                c.tell(&request(Err(recent_message())));
                Err(code)
            }
            Ok((bytes, recv)) => {
                count(name, bytes.len());
                let result = c.request(name, &request(Ok(bytes)))?;
                write_device(&format!("{name} recvBuf"), recv, &result)
            }
        }
    };
    result(run())
}

/// This rank's checks of collective `call`: its send bytes and receive buffer.
fn check_collective(
    c: &Comm,
    call: &Call,
    stream: aclrtStream,
    layout: impl FnOnce(&Comm) -> Result<Buffers, HcclResult>,
) -> Result<(Vec<u8>, Buffer), HcclResult> {
    let name = call.kind.name();
    check_device(name)?;
    if matches!(call.kind, Kind::AllReduce | Kind::ReduceScatter) {
        if let Some((code, why)) = data::reduction_refused(call.dtype, call.op) {
            return Err(fail(code, format!("{name}: {why}")));
        }
    }
    if call.kind == Kind::Broadcast {
        check_rank(name, call.root, c.size)?;
    }
    let b = layout(c)?;
    // an all-reduce may run in place (torch_npu's do), a broadcast has one buffer
    let overlapping = |s: Buffer| match call.kind {
        Kind::AllGather | Kind::ReduceScatter => overlap(s, b.recv),
        Kind::AllReduce => overlap(s, b.recv) && s.at != b.recv.at,
        Kind::Broadcast => false,
    };
    if b.send.is_some_and(overlapping) {
        return Err(fail(
            HCCL_E_PARA,
            format!("{name}: sendBuf and recvBuf overlap"),
        ));
    }
    let sent = b.send.map(|s| ("sendBuf", s));
    let named: Vec<(&str, Buffer)> = sent.into_iter().chain([("recvBuf", b.recv)]).collect();
    let bytes = check_stream_and_buffers(name, stream, &named, b.send)?;
    Ok((bytes, b.recv))
}

fn call(kind: Kind, count: u64, dtype: HcclDataType) -> Call {
    Call {
        kind,
        seq: 0,
        count,
        dtype,
        op: 0,
        root: 0,
    }
}

#[no_mangle]
pub extern "C" fn HcclAllReduce(
    send_buf: *mut c_void,
    recv_buf: *mut c_void,
    count: u64,
    data_type: HcclDataType,
    op: HcclReduceOp,
    comm: HcclComm,
    stream: aclrtStream,
) -> HcclResult {
    let call = Call {
        op,
        ..call(Kind::AllReduce, count, data_type)
    };
    collective(call, (comm, stream), |_| {
        let name = Kind::AllReduce.name();
        Ok(Buffers {
            send: Some(buffer(name, send_buf, count, data_type)?),
            recv: buffer(name, recv_buf, count, data_type)?,
        })
    })
}

#[no_mangle]
pub extern "C" fn HcclAllGather(
    send_buf: *mut c_void,
    recv_buf: *mut c_void,
    send_count: u64,
    data_type: HcclDataType,
    comm: HcclComm,
    stream: aclrtStream,
) -> HcclResult {
    let call = call(Kind::AllGather, send_count, data_type);
    spread(call, (send_buf, recv_buf), (comm, stream))
}

#[no_mangle]
pub extern "C" fn HcclReduceScatter(
    send_buf: *mut c_void,
    recv_buf: *mut c_void,
    recv_count: u64,
    data_type: HcclDataType,
    op: HcclReduceOp,
    comm: HcclComm,
    stream: aclrtStream,
) -> HcclResult {
    let call = Call {
        op,
        ..call(Kind::ReduceScatter, recv_count, data_type)
    };
    spread(call, (send_buf, recv_buf), (comm, stream))
}

/// An all-gather (each rank's `count` into `size` × `count`) or a reduce-scatter (`size` ×
/// `count` into each rank's `count`).
fn spread(
    call: Call,
    (send_buf, recv_buf): (*mut c_void, *mut c_void),
    (comm, stream): (HcclComm, aclrtStream),
) -> HcclResult {
    collective(call, (comm, stream), |c| {
        let (name, one) = (call.kind.name(), call.count);
        let all = one.saturating_mul(u64::from(c.size));
        let (send, recv) = if call.kind == Kind::AllGather {
            (one, all)
        } else {
            (all, one)
        };
        Ok(Buffers {
            send: Some(buffer(name, send_buf, send, call.dtype)?),
            recv: buffer(name, recv_buf, recv, call.dtype)?,
        })
    })
}

#[no_mangle]
pub extern "C" fn HcclBroadcast(
    buf: *mut c_void,
    count: u64,
    data_type: HcclDataType,
    root: u32,
    comm: HcclComm,
    stream: aclrtStream,
) -> HcclResult {
    let call = Call {
        root,
        ..call(Kind::Broadcast, count, data_type)
    };
    collective(call, (comm, stream), |c| {
        let whole = buffer(Kind::Broadcast.name(), buf, count, data_type)?;
        Ok(Buffers {
            send: (c.rank == root).then_some(whole),
            recv: whole,
        })
    })
}

#[no_mangle]
pub extern "C" fn HcclSend(
    send_buf: *mut c_void,
    count: u64,
    data_type: HcclDataType,
    dest_rank: u32,
    comm: HcclComm,
    stream: aclrtStream,
) -> HcclResult {
    const CALL: &str = "HcclSend";
    let run = || {
        let c = comm_of(CALL, comm)?;
        c.check_peer(CALL, dest_rank)?;
        let request = |data: Data| Request::Send {
            to: dest_rank,
            count,
            dtype: data_type,
            data,
        };
        let local = check_device(CALL)
            .and_then(|()| buffer(CALL, send_buf, count, data_type))
            .and_then(|b| check_stream_and_buffers(CALL, stream, &[("sendBuf", b)], Some(b)));
        match local {
            Err(code) => {
                c.tell(&request(Err(recent_message())));
                Err(code)
            }
            Ok(bytes) => {
                self::count(CALL, bytes.len());
                c.request(CALL, &request(Ok(bytes))).map(drop)
            }
        }
    };
    result(run())
}

#[no_mangle]
pub extern "C" fn HcclRecv(
    recv_buf: *mut c_void,
    count: u64,
    data_type: HcclDataType,
    src_rank: u32,
    comm: HcclComm,
    stream: aclrtStream,
) -> HcclResult {
    const CALL: &str = "HcclRecv";
    let run = || {
        let c = comm_of(CALL, comm)?;
        c.check_peer(CALL, src_rank)?;
        check_device(CALL)?;
        let recv = buffer(CALL, recv_buf, count, data_type)?;
        check_stream_and_buffers(CALL, stream, &[("recvBuf", recv)], None)?;
        let timeout_ms = exec_timeout_ms();
        let request = Request::Recv {
            from: src_rank,
            count,
            dtype: data_type,
            timeout_ms,
        };
        let bytes = c.request(CALL, &request)?;
        write_device("HcclRecv recvBuf", recv, &bytes)
    };
    result(run())
}

#[no_mangle]
pub extern "C" fn HcclGetRankSize(comm: HcclComm, rank_size: *mut u32) -> HcclResult {
    result(comm_of("HcclGetRankSize", comm).and_then(|c| put("HcclGetRankSize", rank_size, c.size)))
}

#[no_mangle]
pub extern "C" fn HcclGetRankId(comm: HcclComm, rank: *mut u32) -> HcclResult {
    result(comm_of("HcclGetRankId", comm).and_then(|c| put("HcclGetRankId", rank, c.rank)))
}

#[no_mangle]
pub extern "C" fn HcclCommDestroy(comm: HcclComm) -> HcclResult {
    if !locked(&LIVE).remove(&(comm as usize)) {
        let why = format!("HcclCommDestroy: {comm:?} is not a live communicator");
        return fail(HCCL_E_PARA, why);
    }
    // SAFETY: a live handle from `join`, now out of the live set: freed once.
    let c = unsafe { Box::from_raw(comm as *mut Comm) };
    // the hub tells the others that this rank left
    c.tell(&Request::Leave);
    HCCL_SUCCESS
}

/// HcclResult's names, by value (hccl_types.h).
const ERROR_NAMES: [&CStr; 23] = [
    c"HCCL_SUCCESS",
    c"HCCL_E_PARA",
    c"HCCL_E_PTR",
    c"HCCL_E_MEMORY",
    c"HCCL_E_INTERNAL",
    c"HCCL_E_NOT_SUPPORT",
    c"HCCL_E_NOT_FOUND",
    c"HCCL_E_UNAVAIL",
    c"HCCL_E_SYSCALL",
    c"HCCL_E_TIMEOUT",
    c"HCCL_E_OPEN_FILE_FAILURE",
    c"HCCL_E_TCP_CONNECT",
    c"HCCL_E_ROCE_CONNECT",
    c"HCCL_E_TCP_TRANSFER",
    c"HCCL_E_ROCE_TRANSFER",
    c"HCCL_E_RUNTIME",
    c"HCCL_E_DRV",
    c"HCCL_E_PROFILING",
    c"HCCL_E_CCE",
    c"HCCL_E_NETWORK",
    c"HCCL_E_AGAIN",
    c"HCCL_E_REMOTE",
    c"HCCL_E_SUSPENDING",
];

#[no_mangle]
pub extern "C" fn HcclGetErrorString(code: HcclResult) -> *const c_char {
    let name = usize::try_from(code)
        .ok()
        .and_then(|i| ERROR_NAMES.get(i))
        .copied()
        .unwrap_or(c"HCCL_E_RESERVED");
    name.as_ptr()
}

/// Every function hccl-sys declares is exported here with its declared type.
const _: hccl_sys::Functions = hccl_sys::Functions {
    HcclGetRootInfo,
    HcclCommInitRootInfo,
    HcclCommInitClusterInfo,
    HcclCreateSubCommConfig,
    HcclAllReduce,
    HcclAllGather,
    HcclReduceScatter,
    HcclBroadcast,
    HcclSend,
    HcclRecv,
    HcclGetRankSize,
    HcclGetRankId,
    HcclCommDestroy,
    HcclGetErrorString,
};
