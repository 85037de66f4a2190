//! The stand-in's `libhccl.so`: HCCL's communicators and collectives between the ranks of
//! this process (threads, each with its device bound), computed on the stand-in's host memory
//! and as strict as the rest: the runtime initialised and a device bound, a communicator that
//! is live, a known stream, buffers that are device memory holding `count` elements of the
//! dtype, and every rank of a call agreeing on it (the kind, count, dtype, reduction, root —
//! a rank that disagrees fails the call on all of them, naming both). A rank that never joins
//! or never comes to a call fails the others after `HCCL_CONNECT_TIMEOUT` / `HCCL_EXEC_TIMEOUT`
//! seconds; a rank whose communicator is destroyed while the others wait on it fails them
//! (HCCL_E_REMOTE). Communicators still alive at `aclFinalize` are leaks. Reductions run in
//! f32 (integers in i64) in rank order and round once. Ranks in other processes (torchrun)
//! are not joined: their root info is refused, naming the process it came from.

use crate::{fail, lock as runtime, Runtime, CURRENT_DEVICE};
use ascendcl_sys::aclrtStream;
use half::{bf16, f16};
use hccl_sys::*;
use std::cell::Cell;
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::ffi::{c_char, c_void};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The root info's first bytes.
const MAGIC: &[u8; 16] = b"mindkit-hccl-v1\0";

/// Every group of the process: its ranks, calls in flight and mail.
#[derive(Default)]
struct Groups {
    next_id: u64,
    groups: HashMap<u64, Group>,
    /// Live communicators (their handles' addresses).
    live: BTreeSet<usize>,
}

#[derive(Default)]
struct Group {
    size: u32,
    joined: BTreeSet<u32>,
    left: BTreeSet<u32>,
    calls: HashMap<u64, Call>,
    mail: HashMap<(u32, u32), VecDeque<Part>>,
}

struct Call {
    parts: Vec<Option<Part>>,
    taken: usize,
}

/// A rank's side of a call: the call as it sees it, and its bytes.
#[derive(Clone)]
struct Part {
    call: Signature,
    bytes: Vec<u8>,
}

#[derive(Clone, Copy, PartialEq, Debug)]
struct Signature {
    kind: &'static str,
    count: u64,
    dtype: HcclDataType,
    op: Option<HcclReduceOp>,
    root: Option<u32>,
}

/// What an `HcclComm` handle points at.
struct Comm {
    group: u64,
    rank: u32,
    size: u32,
    next: Cell<u64>,
}

static GROUPS: Mutex<Option<Groups>> = Mutex::new(None);
/// Per HCCL function: calls and the bytes this process's ranks sent, since the last report.
static COUNTED: Mutex<BTreeMap<&'static str, (u64, u64)>> = Mutex::new(BTreeMap::new());

/// Count a call of `kind` that sent `bytes`.
fn count(kind: &'static str, bytes: usize) {
    let mut c = COUNTED.lock().unwrap_or_else(|e| e.into_inner());
    let entry = c.entry(kind).or_default();
    *entry = (entry.0 + 1, entry.1 + bytes as u64);
}

/// The counts as JSON members (`"HcclAllReduce": {"calls": n, "bytes": b}, …`), then reset:
/// `aclFinalize`'s report.
pub(crate) fn counted() -> String {
    let mut c = COUNTED.lock().unwrap_or_else(|e| e.into_inner());
    let members: Vec<String> = c
        .iter()
        .map(|(kind, (calls, bytes))| {
            format!("\"{kind}\": {{\"calls\": {calls}, \"bytes\": {bytes}}}")
        })
        .collect();
    c.clear();
    members.join(", ")
}
static CHANGED: Condvar = Condvar::new();

fn groups() -> MutexGuard<'static, Option<Groups>> {
    GROUPS.lock().unwrap_or_else(|e| e.into_inner())
}

fn failed(code: HcclResult, message: String) -> HcclResult {
    fail(code, message);
    code
}

fn seconds(var: &str, default: u64) -> Duration {
    let s = std::env::var(var).ok().and_then(|v| v.parse().ok());
    Duration::from_secs(s.unwrap_or(default))
}

/// The element size of an HCCL dtype the stand-in handles.
fn element_size(dtype: HcclDataType) -> Option<usize> {
    match dtype {
        HCCL_DATA_TYPE_FP32 | HCCL_DATA_TYPE_INT32 => Some(4),
        HCCL_DATA_TYPE_FP16 | HCCL_DATA_TYPE_BFP16 => Some(2),
        HCCL_DATA_TYPE_INT64 => Some(8),
        _ => None,
    }
}

/// The runtime initialised and a device bound on this thread, as HCCL needs.
fn check_device(call: &str) -> Result<(), HcclResult> {
    let ready = runtime().as_ref().is_some_and(|rt| rt.inits > 0);
    if !ready || CURRENT_DEVICE.with(Cell::get).is_none() {
        return Err(failed(
            HCCL_E_RUNTIME,
            format!("{call} before aclInit and aclrtSetDevice on this thread"),
        ));
    }
    Ok(())
}

#[no_mangle]
pub extern "C" fn HcclGetRootInfo(root_info: *mut HcclRootInfo) -> HcclResult {
    if root_info.is_null() {
        return failed(HCCL_E_PARA, "HcclGetRootInfo: rootInfo is NULL".into());
    }
    let mut g = groups();
    let all = g.get_or_insert_with(Groups::default);
    all.next_id += 1;
    let mut bytes = [0u8; HCCL_ROOT_INFO_BYTES];
    bytes[..16].copy_from_slice(MAGIC);
    bytes[16..24].copy_from_slice(&all.next_id.to_le_bytes());
    bytes[24..28].copy_from_slice(&std::process::id().to_le_bytes());
    // SAFETY: the caller's root info of HCCL_ROOT_INFO_BYTES bytes.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), root_info.cast::<u8>(), bytes.len()) };
    HCCL_SUCCESS
}

/// The group a root info names, if it is one of this process's.
fn group_of(root: &HcclRootInfo) -> Result<u64, HcclResult> {
    // SAFETY: HcclRootInfo is plain bytes.
    let bytes: &[u8; HCCL_ROOT_INFO_BYTES] = unsafe { &*(root as *const HcclRootInfo).cast() };
    if &bytes[..16] != MAGIC {
        return Err(failed(
            HCCL_E_PARA,
            "HcclCommInitRootInfo: the root info is not from HcclGetRootInfo".into(),
        ));
    }
    let pid = u32::from_le_bytes(bytes[24..28].try_into().expect("4 bytes"));
    if pid != std::process::id() {
        return Err(failed(
            HCCL_E_NOT_SUPPORT,
            format!("HcclCommInitRootInfo: the root info comes from process {pid}; the stand-in joins the ranks of one process (threads)"),
        ));
    }
    Ok(u64::from_le_bytes(
        bytes[16..24].try_into().expect("8 bytes"),
    ))
}

#[no_mangle]
pub extern "C" fn HcclCommInitRootInfo(
    n_ranks: u32,
    root_info: *const HcclRootInfo,
    rank: u32,
    comm: *mut HcclComm,
) -> HcclResult {
    if let Err(code) = check_device("HcclCommInitRootInfo") {
        return code;
    }
    if root_info.is_null() || comm.is_null() || n_ranks == 0 || rank >= n_ranks {
        return failed(
            HCCL_E_PARA,
            format!("HcclCommInitRootInfo: rank {rank} of {n_ranks}, or a NULL pointer"),
        );
    }
    // SAFETY: checked non-null; the caller's root info.
    let id = match group_of(unsafe { &*root_info }) {
        Ok(id) => id,
        Err(code) => return code,
    };
    match join(id, n_ranks, rank) {
        Ok(handle) => {
            // SAFETY: the caller's out-pointer.
            unsafe { *comm = handle };
            HCCL_SUCCESS
        }
        Err(code) => code,
    }
}

/// Join group `id` as `rank` of `size`; wait for the others.
fn join(id: u64, size: u32, rank: u32) -> Result<HcclComm, HcclResult> {
    let mut g = groups();
    let all = g.get_or_insert_with(Groups::default);
    let group = all.groups.entry(id).or_default();
    if group.joined.is_empty() {
        group.size = size;
    }
    if group.size != size || !group.joined.insert(rank) {
        return Err(failed(
            HCCL_E_PARA,
            format!("HcclCommInitRootInfo: rank {rank} of {size} does not fit the group of {} that has ranks {:?}", group.size, group.joined),
        ));
    }
    CHANGED.notify_all();
    let deadline = Instant::now() + seconds("HCCL_CONNECT_TIMEOUT", 120);
    loop {
        let group = &g.as_ref().expect("set above").groups[&id];
        if group.joined.len() == size as usize {
            break;
        }
        let now = Instant::now();
        if now >= deadline {
            let missing: Vec<u32> = (0..size).filter(|r| !group.joined.contains(r)).collect();
            return Err(failed(
                HCCL_E_TIMEOUT,
                format!(
                    "HcclCommInitRootInfo: ranks {missing:?} never joined (HCCL_CONNECT_TIMEOUT)"
                ),
            ));
        }
        g = CHANGED
            .wait_timeout(g, deadline - now)
            .unwrap_or_else(|e| e.into_inner())
            .0;
    }
    let handle = Box::into_raw(Box::new(Comm {
        group: id,
        rank,
        size,
        next: Cell::new(0),
    }));
    g.as_mut().expect("set above").live.insert(handle as usize);
    Ok(handle.cast())
}

/// The live communicator `comm` points at.
fn comm_of<'a>(call: &str, comm: HcclComm) -> Result<&'a Comm, HcclResult> {
    let live = groups()
        .as_ref()
        .is_some_and(|g| g.live.contains(&(comm as usize)));
    if !live {
        return Err(failed(
            HCCL_E_PARA,
            format!("{call}: {comm:?} is not a live communicator"),
        ));
    }
    // SAFETY: a live handle made by `join` (freed only by HcclCommDestroy, which removes it).
    Ok(unsafe { &*(comm as *const Comm) })
}

/// A buffer of `count` elements of `dtype`: `what` checked against the runtime's live
/// allocations; with `read`, its bytes.
fn buffer(
    rt: &mut Runtime,
    what: &str,
    (ptr, count, dtype): (*mut c_void, u64, HcclDataType),
    read: bool,
) -> Result<Vec<u8>, HcclResult> {
    let size = element_size(dtype).ok_or_else(|| {
        failed(
            HCCL_E_NOT_SUPPORT,
            format!("{what}: dtype {dtype} is not one the stand-in reduces"),
        )
    })?;
    let len = count as usize * size;
    rt.region(ptr as usize, len, what)
        .map_err(|_| HCCL_E_PARA)?;
    // SAFETY: the region was checked to lie in a live allocation.
    Ok(if read {
        unsafe { std::slice::from_raw_parts(ptr as *const u8, len).to_vec() }
    } else {
        Vec::new()
    })
}

/// Write `bytes` to `ptr` as stream work (re-checked: the memory may have gone meanwhile).
fn deliver(what: &str, ptr: *mut c_void, bytes: &[u8]) -> Result<(), HcclResult> {
    let mut guard = runtime();
    let rt = guard.as_mut().ok_or(HCCL_E_RUNTIME)?;
    let a = rt
        .region(ptr as usize, bytes.len(), what)
        .map_err(|_| HCCL_E_PARA)?;
    a.written_async = true;
    // SAFETY: the region was checked to lie in a live allocation.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), ptr as *mut u8, bytes.len()) };
    Ok(())
}

/// The common checks of a call on `stream` and its send buffer's bytes.
fn prepare(
    call: &str,
    stream: aclrtStream,
    send: Option<(*mut c_void, u64, HcclDataType)>,
) -> Result<Vec<u8>, HcclResult> {
    check_device(call)?;
    let mut guard = runtime();
    let rt = guard.as_mut().ok_or(HCCL_E_RUNTIME)?;
    if !rt.streams.contains(&(stream as usize)) {
        return Err(failed(
            HCCL_E_PARA,
            format!("{call}: {stream:?} is not a live stream"),
        ));
    }
    match send {
        Some(b) => buffer(rt, &format!("{call} sendBuf"), b, true),
        None => Ok(Vec::new()),
    }
}

/// Check `recv` can take `count` elements of `dtype` (before waiting on the others).
fn check_recv(call: &str, recv: (*mut c_void, u64, HcclDataType)) -> Result<(), HcclResult> {
    let mut guard = runtime();
    let rt = guard.as_mut().ok_or(HCCL_E_RUNTIME)?;
    buffer(rt, &format!("{call} recvBuf"), recv, false).map(|_| ())
}

impl Comm {
    /// Bring `part` to this rank's next call; every rank's part in rank order once all came
    /// and agree.
    fn exchange(&self, part: Part) -> Result<Vec<Part>, HcclResult> {
        let seq = self.next.replace(self.next.get() + 1);
        let (size, kind) = (self.size as usize, part.call.kind);
        let mut g = groups();
        let group = g
            .as_mut()
            .and_then(|a| a.groups.get_mut(&self.group))
            .ok_or(HCCL_E_INTERNAL)?;
        let call = group.calls.entry(seq).or_insert_with(|| Call {
            parts: vec![None; size],
            taken: 0,
        });
        call.parts[self.rank as usize] = Some(part);
        CHANGED.notify_all();
        let deadline = Instant::now() + seconds("HCCL_EXEC_TIMEOUT", 1836);
        loop {
            let group = g
                .as_mut()
                .and_then(|a| a.groups.get_mut(&self.group))
                .ok_or(HCCL_E_INTERNAL)?;
            let call = group.calls.get_mut(&seq).ok_or(HCCL_E_INTERNAL)?;
            let missing: Vec<u32> = (0..self.size)
                .filter(|&r| call.parts[r as usize].is_none())
                .collect();
            if missing.is_empty() {
                let parts: Vec<Part> = call.parts.iter().flatten().cloned().collect();
                call.taken += 1;
                if call.taken == size {
                    group.calls.remove(&seq);
                }
                drop(g);
                return self.agreed(kind, seq, parts);
            }
            if let Some(gone) = missing.iter().find(|r| group.left.contains(r)) {
                return Err(failed(
                    HCCL_E_REMOTE,
                    format!("{kind} #{seq}: rank {gone} destroyed its communicator"),
                ));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(failed(
                    HCCL_E_TIMEOUT,
                    format!("{kind} #{seq}: ranks {missing:?} never came (HCCL_EXEC_TIMEOUT)"),
                ));
            }
            g = CHANGED
                .wait_timeout(g, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// `parts` when every rank made the same call, else HCCL_E_PARA naming two that differ.
    fn agreed(&self, kind: &str, seq: u64, parts: Vec<Part>) -> Result<Vec<Part>, HcclResult> {
        let mine = parts[self.rank as usize].call;
        match parts.iter().position(|p| p.call != mine) {
            None => Ok(parts),
            Some(r) => Err(failed(
                HCCL_E_PARA,
                format!(
                    "{kind} #{seq}: ranks disagree: rank {} calls {mine:?}, rank {r} calls {:?}",
                    self.rank, parts[r].call
                ),
            )),
        }
    }
}

/// Decode `bytes` of `dtype` to f64 (floats through f32, as the reduction runs).
fn decode(bytes: &[u8], dtype: HcclDataType) -> Vec<f64> {
    let size = element_size(dtype).unwrap_or(1);
    bytes
        .chunks_exact(size)
        .map(|b| match dtype {
            HCCL_DATA_TYPE_FP32 => f64::from(f32::from_le_bytes(b.try_into().expect("4"))),
            HCCL_DATA_TYPE_FP16 => f64::from(f16::from_le_bytes(b.try_into().expect("2"))),
            HCCL_DATA_TYPE_BFP16 => f64::from(bf16::from_le_bytes(b.try_into().expect("2"))),
            HCCL_DATA_TYPE_INT32 => f64::from(i32::from_le_bytes(b.try_into().expect("4"))),
            _ => i64::from_le_bytes(b.try_into().expect("8")) as f64,
        })
        .collect()
}

fn encode(values: &[f64], dtype: HcclDataType) -> Vec<u8> {
    values
        .iter()
        .flat_map(|&v| match dtype {
            HCCL_DATA_TYPE_FP32 => (v as f32).to_le_bytes().to_vec(),
            HCCL_DATA_TYPE_FP16 => f16::from_f32(v as f32).to_le_bytes().to_vec(),
            HCCL_DATA_TYPE_BFP16 => bf16::from_f32(v as f32).to_le_bytes().to_vec(),
            HCCL_DATA_TYPE_INT32 => (v as i32).to_le_bytes().to_vec(),
            _ => (v as i64).to_le_bytes().to_vec(),
        })
        .collect()
}

/// `op` over the parts' values in rank order: floats accumulate in f32.
fn reduce(parts: &[Part], dtype: HcclDataType, op: HcclReduceOp) -> Result<Vec<u8>, HcclResult> {
    let float = matches!(
        dtype,
        HCCL_DATA_TYPE_FP32 | HCCL_DATA_TYPE_FP16 | HCCL_DATA_TYPE_BFP16
    );
    let mut acc = decode(&parts[0].bytes, dtype);
    for p in &parts[1..] {
        for (a, v) in acc.iter_mut().zip(decode(&p.bytes, dtype)) {
            *a = match op {
                HCCL_REDUCE_SUM if float => f64::from(*a as f32 + v as f32),
                HCCL_REDUCE_SUM => *a + v,
                HCCL_REDUCE_MAX => a.max(v),
                _ => {
                    return Err(failed(
                        HCCL_E_NOT_SUPPORT,
                        format!("reduce op {op} (the stand-in has SUM and MAX)"),
                    ))
                }
            };
        }
    }
    Ok(encode(&acc, dtype))
}

/// Run a collective: checks, this rank's part, the exchange, and `result` of all parts
/// written to `recv`.
fn collective(
    call: Signature,
    (comm, stream): (HcclComm, aclrtStream),
    (send, recv): (Option<*mut c_void>, (*mut c_void, u64)),
    result: impl FnOnce(&Comm, &[Part]) -> Result<Vec<u8>, HcclResult>,
) -> HcclResult {
    let run = || {
        let c = comm_of(call.kind, comm)?;
        let bytes = prepare(call.kind, stream, send.map(|p| (p, call.count, call.dtype)))?;
        check_recv(call.kind, (recv.0, recv.1, call.dtype))?;
        count(call.kind, bytes.len());
        let parts = c.exchange(Part { call, bytes })?;
        let out = result(c, &parts)?;
        deliver(&format!("{} recvBuf", call.kind), recv.0, &out)
    };
    match run() {
        Ok(()) => HCCL_SUCCESS,
        Err(code) => code,
    }
}

fn signature(kind: &'static str, count: u64, dtype: HcclDataType) -> Signature {
    Signature {
        kind,
        count,
        dtype,
        op: None,
        root: None,
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
    let call = Signature {
        op: Some(op),
        ..signature("HcclAllReduce", count, data_type)
    };
    collective(
        call,
        (comm, stream),
        (Some(send_buf), (recv_buf, count)),
        |_, parts| reduce(parts, data_type, op),
    )
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
    let call = signature("HcclAllGather", send_count, data_type);
    let ranks = comm_of("HcclAllGather", comm).map_or(0, |c| u64::from(c.size));
    collective(
        call,
        (comm, stream),
        (Some(send_buf), (recv_buf, send_count * ranks)),
        |_, parts| Ok(parts.iter().flat_map(|p| p.bytes.iter().copied()).collect()),
    )
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
    let ranks = comm_of("HcclReduceScatter", comm).map_or(0, |c| u64::from(c.size));
    let call = Signature {
        op: Some(op),
        ..signature("HcclReduceScatter", recv_count * ranks, data_type)
    };
    collective(
        call,
        (comm, stream),
        (Some(send_buf), (recv_buf, recv_count)),
        |c, parts| {
            let all = reduce(parts, data_type, op)?;
            let block = all.len() / c.size as usize;
            Ok(all[c.rank as usize * block..][..block].to_vec())
        },
    )
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
    let call = Signature {
        root: Some(root),
        ..signature("HcclBroadcast", count, data_type)
    };
    let is_root = comm_of("HcclBroadcast", comm).is_ok_and(|c| c.rank == root);
    let send = is_root.then_some(buf);
    collective(call, (comm, stream), (send, (buf, count)), |c, parts| {
        let from = parts.get(root as usize).filter(|_| root < c.size);
        from.map(|p| p.bytes.clone()).ok_or_else(|| {
            failed(
                HCCL_E_PARA,
                format!("HcclBroadcast: root {root} is not a rank of {}", c.size),
            )
        })
    })
}

/// A point-to-point peer: another rank of the communicator.
fn peer(call: &str, c: &Comm, peer: u32) -> Result<(), HcclResult> {
    if peer < c.size && peer != c.rank {
        return Ok(());
    }
    Err(failed(
        HCCL_E_PARA,
        format!("{call}: rank {peer} is not another rank of {}", c.size),
    ))
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
    let run = || {
        let c = comm_of("HcclSend", comm)?;
        peer("HcclSend", c, dest_rank)?;
        let bytes = prepare("HcclSend", stream, Some((send_buf, count, data_type)))?;
        let mut g = groups();
        let group = g
            .as_mut()
            .and_then(|a| a.groups.get_mut(&c.group))
            .ok_or(HCCL_E_INTERNAL)?;
        let call = signature("HcclSend", count, data_type);
        self::count("HcclSend", bytes.len());
        group
            .mail
            .entry((c.rank, dest_rank))
            .or_default()
            .push_back(Part { call, bytes });
        CHANGED.notify_all();
        Ok(())
    };
    run().map_or_else(|code| code, |()| HCCL_SUCCESS)
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
    let run = || {
        let c = comm_of("HcclRecv", comm)?;
        peer("HcclRecv", c, src_rank)?;
        prepare("HcclRecv", stream, None)?;
        check_recv("HcclRecv", (recv_buf, count, data_type))?;
        let part = take_mail(c, src_rank)?;
        let want = signature("HcclSend", count, data_type);
        if part.call != want {
            return Err(failed(
                HCCL_E_PARA,
                format!(
                    "HcclRecv from rank {src_rank}: it sent {:?}, rank {} receives {want:?}",
                    part.call, c.rank
                ),
            ));
        }
        deliver("HcclRecv recvBuf", recv_buf, &part.bytes)
    };
    run().map_or_else(|code| code, |()| HCCL_SUCCESS)
}

/// The next part `from` sent to `c`'s rank, waiting for it.
fn take_mail(c: &Comm, from: u32) -> Result<Part, HcclResult> {
    let deadline = Instant::now() + seconds("HCCL_EXEC_TIMEOUT", 1836);
    let mut g = groups();
    loop {
        let group = g
            .as_mut()
            .and_then(|a| a.groups.get_mut(&c.group))
            .ok_or(HCCL_E_INTERNAL)?;
        if let Some(p) = group
            .mail
            .get_mut(&(from, c.rank))
            .and_then(VecDeque::pop_front)
        {
            return Ok(p);
        }
        if group.left.contains(&from) {
            return Err(failed(
                HCCL_E_REMOTE,
                format!("HcclRecv: rank {from} destroyed its communicator"),
            ));
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(failed(
                HCCL_E_TIMEOUT,
                format!("HcclRecv: rank {from} sent nothing (HCCL_EXEC_TIMEOUT)"),
            ));
        }
        g = CHANGED
            .wait_timeout(g, deadline - now)
            .unwrap_or_else(|e| e.into_inner())
            .0;
    }
}

#[no_mangle]
pub extern "C" fn HcclCommInitClusterInfo(
    _cluster_info: *const c_char,
    _rank: u32,
    _comm: *mut HcclComm,
) -> HcclResult {
    failed(
        HCCL_E_NOT_SUPPORT,
        "HcclCommInitClusterInfo: the stand-in joins ranks by root info only (no rank table)"
            .into(),
    )
}

#[no_mangle]
pub extern "C" fn HcclGetRankSize(comm: HcclComm, rank_size: *mut u32) -> HcclResult {
    match comm_of("HcclGetRankSize", comm) {
        // SAFETY: the caller's out-pointer.
        Ok(c) if !rank_size.is_null() => unsafe {
            *rank_size = c.size;
            HCCL_SUCCESS
        },
        Ok(_) => failed(HCCL_E_PARA, "HcclGetRankSize: rankSize is NULL".into()),
        Err(code) => code,
    }
}

#[no_mangle]
pub extern "C" fn HcclGetRankId(comm: HcclComm, rank: *mut u32) -> HcclResult {
    match comm_of("HcclGetRankId", comm) {
        // SAFETY: the caller's out-pointer.
        Ok(c) if !rank.is_null() => unsafe {
            *rank = c.rank;
            HCCL_SUCCESS
        },
        Ok(_) => failed(HCCL_E_PARA, "HcclGetRankId: rank is NULL".into()),
        Err(code) => code,
    }
}

#[no_mangle]
pub extern "C" fn HcclCommDestroy(comm: HcclComm) -> HcclResult {
    let mut g = groups();
    let Some(all) = g.as_mut() else {
        return failed(
            HCCL_E_PARA,
            "HcclCommDestroy before any communicator".into(),
        );
    };
    if !all.live.remove(&(comm as usize)) {
        return failed(
            HCCL_E_PARA,
            format!("HcclCommDestroy: {comm:?} is not a live communicator"),
        );
    }
    // SAFETY: a live handle from `join`, now removed from the live set: freed once.
    let c = unsafe { Box::from_raw(comm as *mut Comm) };
    if let Some(group) = all.groups.get_mut(&c.group) {
        group.left.insert(c.rank);
        if group.left.len() == group.size as usize {
            all.groups.remove(&c.group);
        }
    }
    CHANGED.notify_all();
    HCCL_SUCCESS
}

#[no_mangle]
pub extern "C" fn HcclGetErrorString(code: HcclResult) -> *const c_char {
    let name: &'static std::ffi::CStr = match code {
        HCCL_SUCCESS => c"HCCL_SUCCESS",
        HCCL_E_PARA => c"HCCL_E_PARA",
        HCCL_E_INTERNAL => c"HCCL_E_INTERNAL",
        HCCL_E_NOT_SUPPORT => c"HCCL_E_NOT_SUPPORT",
        HCCL_E_TIMEOUT => c"HCCL_E_TIMEOUT",
        HCCL_E_RUNTIME => c"HCCL_E_RUNTIME",
        HCCL_E_REMOTE => c"HCCL_E_REMOTE",
        _ => c"HCCL_E_RESERVED",
    };
    name.as_ptr()
}

/// Communicators never destroyed (for `aclFinalize`'s leak report).
pub(crate) fn leaks() -> Option<String> {
    let n = groups().as_ref().map_or(0, |g| g.live.len());
    (n > 0).then(|| format!("{n} HCCL communicators never destroyed"))
}

/// Every function hccl-sys declares is exported here with its declared type.
#[allow(dead_code)]
fn exports_have_the_declared_types() {
    let _ = hccl_sys::Functions {
        HcclGetRootInfo,
        HcclCommInitRootInfo,
        HcclCommInitClusterInfo,
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
}
