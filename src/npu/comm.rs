//! HCCL across NPUs: the NPU backend's [`Communicator`]. Rank 0 makes the root info
//! ([`root_info`]) that every rank, one per device, joins with ([`Hccl::join`]); how the root
//! info travels between processes is the launcher's business (`mindkit train` hands it over
//! through torchrun's store: [`HcclRootInfo::to_bytes`] / [`HcclRootInfo::from_bytes`]); ranks
//! may also join by a rank table file ([`Hccl::join_table`]). Collectives are queued on the
//! device's one stream, like its operators, in place where HCCL allows it (all-reduce,
//! broadcast). HCCL moves device memory only: host values ride one small device block per
//! call ([`Hccl::through_device`]), their lengths sent ahead of them.

use super::backend::{Npu, NpuTensor};
use super::context::Context;
use super::NpuError;
use crate::engine::comm::{
    expect_multiple, expect_rank, Communicator, Layout, Payload, ReduceOp, MAX_HOST_BYTES,
};
use crate::engine::{EngineError, Result};
use crate::tensor::DType;
pub use hccl_sys::HcclRootInfo;
use hccl_sys::{
    HcclDataType, HcclResult, HCCL_DATA_TYPE_BFP16, HCCL_DATA_TYPE_FP16, HCCL_DATA_TYPE_FP32,
    HCCL_DATA_TYPE_INT32, HCCL_DATA_TYPE_INT64, HCCL_DATA_TYPE_UINT8, HCCL_REDUCE_MAX,
    HCCL_REDUCE_SUM, HCCL_SUCCESS,
};
use std::ffi::{c_void, CString};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::Arc;

/// The root info a group's ranks join with, made on rank 0.
pub fn root_info() -> std::result::Result<HcclRootInfo, NpuError> {
    let hccl = hccl_sys::load()?;
    let mut info = HcclRootInfo {
        internal: [0; hccl_sys::HCCL_ROOT_INFO_BYTES],
    };
    // SAFETY: a valid out-pointer to a root info.
    let code = unsafe { (hccl.api.HcclGetRootInfo)(&mut info) };
    check(&hccl, "HcclGetRootInfo", code).map_err(|msg| NpuError::Call {
        call: "HcclGetRootInfo",
        code,
        message: msg,
    })?;
    Ok(info)
}

/// One rank of an HCCL communicator, on its NPU's stream; destroyed when dropped.
pub struct Hccl {
    lib: hccl_sys::Hccl,
    comm: hccl_sys::HcclComm,
    ctx: Arc<Context>,
    rank: usize,
    size: usize,
    /// The communicator a sub-communicator was made from, kept alive until it is destroyed.
    parent: Option<std::rc::Rc<Hccl>>,
}

/// `""` on success, else the call, the code's name and the runtime's message.
fn check(lib: &hccl_sys::Hccl, call: &str, code: HcclResult) -> std::result::Result<(), String> {
    if code == HCCL_SUCCESS {
        return Ok(());
    }
    // SAFETY: HCCL returns a static NUL-terminated string (or null).
    let name = unsafe { super::c_string((lib.api.HcclGetErrorString)(code)) };
    Err(format!("{call} failed with {name} ({code})"))
}

/// HCCL's code of a dtype it reduces.
fn hccl_dtype(dtype: DType) -> Option<HcclDataType> {
    Some(match dtype {
        DType::F32 => HCCL_DATA_TYPE_FP32,
        DType::F16 => HCCL_DATA_TYPE_FP16,
        DType::BF16 => HCCL_DATA_TYPE_BFP16,
        DType::I32 => HCCL_DATA_TYPE_INT32,
        DType::I64 => HCCL_DATA_TYPE_INT64,
        _ => return None,
    })
}

impl Hccl {
    /// Join the group of `size` as `rank` on `npu`, with rank 0's `root` info (blocks until
    /// every rank joined, or HCCL's connect timeout).
    pub fn join(npu: &Npu, size: usize, rank: usize, root: &HcclRootInfo) -> Result<Hccl> {
        Self::init(npu, (rank, size), "HcclCommInitRootInfo", |lib, comm| {
            // SAFETY: the root info is HcclRootInfo's 4108 bytes; a valid out-pointer.
            unsafe { (lib.api.HcclCommInitRootInfo)(size as u32, root, rank as u32, comm) }
        })
    }

    /// Join as `rank` on `npu` the group that the rank table file `table` describes (CANN's
    /// `RANK_TABLE_FILE` JSON), which must hold `size` ranks.
    pub fn join_table(npu: &Npu, table: &Path, size: usize, rank: usize) -> Result<Hccl> {
        let path =
            CString::new(table.as_os_str().as_bytes()).map_err(|_| EngineError::Invalid {
                op: "HcclCommInitClusterInfo",
                msg: format!("{}: a path with a NUL byte", table.display()),
            })?;
        let hccl = Self::init(npu, (rank, size), "HcclCommInitClusterInfo", |lib, comm| {
            // SAFETY: a NUL-terminated path; a valid out-pointer.
            unsafe { (lib.api.HcclCommInitClusterInfo)(path.as_ptr(), rank as u32, comm) }
        })?;
        let mut ranks = 0u32;
        // SAFETY: a live communicator; a valid out-pointer.
        let code = unsafe { (hccl.lib.api.HcclGetRankSize)(hccl.comm, &mut ranks) };
        hccl.done("HcclGetRankSize", code)?;
        if ranks as usize != size {
            return Err(EngineError::Collective {
                rank,
                msg: format!(
                    "rank table {} holds {ranks} ranks, the launcher started {size}",
                    table.display()
                ),
            });
        }
        Ok(hccl)
    }

    /// Join on `npu` the sub-communicator `id` of `parent` over its ranks `ranks` (this rank
    /// among them): `HcclCreateSubCommConfig` with HCCL's default settings, as torch_npu makes a
    /// process group's communicator from a rank table's global one.
    pub fn sub(parent: &std::rc::Rc<Hccl>, npu: &Npu, ranks: &[usize], id: u64) -> Result<Hccl> {
        let me = ranks.iter().position(|&r| r == parent.rank);
        let me = me.ok_or_else(|| EngineError::Collective {
            rank: parent.rank,
            msg: format!("sub-communicator {id} of ranks {ranks:?} leaves this rank out"),
        })?;
        let mut ids: Vec<u32> = ranks.iter().map(|&r| r as u32).collect();
        let mut config = hccl_sys::HcclCommConfig::new();
        let mut whole = parent.comm;
        let call = "HcclCreateSubCommConfig";
        let mut sub = Self::init(npu, (me, ranks.len()), call, |lib, comm| {
            // SAFETY: a live communicator, `ids.len()` ranks, an initialised configuration and
            // a valid out-pointer, each outliving the call.
            unsafe {
                (lib.api.HcclCreateSubCommConfig)(
                    &mut whole,
                    ids.len() as u32,
                    ids.as_mut_ptr(),
                    id,
                    me as u32,
                    &mut config,
                    comm,
                )
            }
        })?;
        sub.parent = Some(parent.clone());
        Ok(sub)
    }

    /// Make this rank's communicator on `npu` with `make` (HCCL's `call`).
    fn init(
        npu: &Npu,
        (rank, size): (usize, usize),
        call: &str,
        make: impl FnOnce(&hccl_sys::Hccl, *mut hccl_sys::HcclComm) -> HcclResult,
    ) -> Result<Hccl> {
        let lib = hccl_sys::load().map_err(|e| EngineError::Device(e.to_string()))?;
        let ctx = npu.context().clone();
        ctx.bind()?;
        let mut comm = std::ptr::null_mut();
        let code = make(&lib, &mut comm);
        let hccl = Hccl {
            lib,
            comm,
            ctx,
            rank,
            size,
            parent: None,
        };
        hccl.done(call, code)?;
        Ok(hccl)
    }

    /// A collective's result code as the engine's error, with the runtime's message.
    fn done(&self, call: &str, code: HcclResult) -> Result<()> {
        check(&self.lib, call, code).map_err(|msg| EngineError::Collective {
            rank: self.rank,
            msg: format!("{msg}: {}", self.ctx.recent_error()),
        })
    }

    /// A tensor's device address, element count and HCCL dtype.
    fn buffer(&self, op: &'static str, x: &NpuTensor) -> Result<(*mut c_void, u64, HcclDataType)> {
        let dtype = x.dtype();
        let code = hccl_dtype(dtype).ok_or_else(|| EngineError::Unsupported {
            op,
            dtype,
            device: "HCCL".into(),
        })?;
        Ok((
            x.device_ptr() as *mut c_void,
            x.shape().iter().product::<usize>() as u64,
            code,
        ))
    }

    fn me(&self) -> (usize, usize) {
        (self.rank, self.size)
    }

    /// Queue `call` on the device's stream and check its result.
    fn queue(&self, name: &str, call: impl FnOnce(*mut c_void) -> HcclResult) -> Result<()> {
        let code = self.ctx.on_stream(call)?;
        self.done(name, code)
    }

    /// Host `bytes` through the device, the one place host values ride it: copied into a
    /// block with `room` bytes after them, HCCL's `call` (`name`) queued over it (given the
    /// bytes' address, the room's and the stream), then the `room` bytes read back — or, with
    /// no room, the bytes' own (in place).
    fn through_device(
        &self,
        name: &str,
        bytes: Vec<u8>,
        room: usize,
        call: impl FnOnce(*mut c_void, *mut c_void, *mut c_void) -> HcclResult,
    ) -> Result<Vec<u8>> {
        let len = bytes.len();
        let block = self.ctx.alloc(len + room)?;
        let (at, after) = (block.ptr, block.ptr + len);
        self.ctx.upload(at, bytes)?;
        self.queue(name, |s| call(at as *mut c_void, after as *mut c_void, s))?;
        let out = match room {
            0 => self.ctx.download(at, len)?,
            _ => self.ctx.download(after, room)?,
        };
        Ok(out)
    }

    /// `bytes` (`count` of them on every rank) from rank `root` to the others, in place.
    fn broadcast_host(&self, bytes: Vec<u8>, root: usize) -> Result<Vec<u8>> {
        let f = self.lib.api.HcclBroadcast;
        let count = bytes.len() as u64;
        // SAFETY: the block holds `count` bytes.
        self.through_device("HcclBroadcast", bytes, 0, |at, _, s| unsafe {
            f(at, count, HCCL_DATA_TYPE_UINT8, root as u32, self.comm, s)
        })
    }

    /// Every rank's `bytes` (as many on every rank), in rank order.
    fn all_gather_host(&self, bytes: Vec<u8>) -> Result<Vec<u8>> {
        let f = self.lib.api.HcclAllGather;
        let count = bytes.len() as u64;
        // SAFETY: the block holds `count` bytes, then room for `size` × `count`.
        self.through_device(
            "HcclAllGather",
            bytes,
            self.size * count as usize,
            |at, room, s| unsafe { f(at, room, count, HCCL_DATA_TYPE_UINT8, self.comm, s) },
        )
    }

    /// A host collective's failure, alike on every rank.
    fn host_error(&self, msg: String) -> EngineError {
        EngineError::Collective {
            rank: self.rank,
            msg,
        }
    }
}

/// A length sent ahead of host bytes, as HCCL moves it.
fn length_bytes(n: usize) -> Vec<u8> {
    (n as u64).to_le_bytes().to_vec()
}

/// The lengths in `bytes` (a [`length_bytes`] per rank), beyond [`MAX_HOST_BYTES`] as
/// `usize::MAX`.
fn lengths(bytes: &[u8]) -> Vec<usize> {
    (bytes.chunks_exact(8))
        .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
        .map(|n| usize::try_from(n).unwrap_or(usize::MAX))
        .collect()
}

fn reduce_op(op: ReduceOp) -> hccl_sys::HcclReduceOp {
    match op {
        ReduceOp::Sum => HCCL_REDUCE_SUM,
        ReduceOp::Max => HCCL_REDUCE_MAX,
    }
}

impl Payload for NpuTensor {
    fn payload_bytes(&self) -> u64 {
        (self.shape().iter().product::<usize>() * self.dtype().size()) as u64
    }
}

fn layout(x: &NpuTensor) -> Layout<'_> {
    (x.shape(), x.dtype())
}

impl Communicator for Hccl {
    type Tensor = NpuTensor;

    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn all_reduce(&self, x: &mut NpuTensor, op: ReduceOp) -> Result<()> {
        let (ptr, count, dtype) = self.buffer("all_reduce", x)?;
        let f = self.lib.api.HcclAllReduce;
        // SAFETY: `ptr` holds `count` elements of `dtype` (in place is allowed).
        self.queue("HcclAllReduce", |s| unsafe {
            f(ptr, ptr, count, dtype, reduce_op(op), self.comm, s)
        })
    }

    fn all_gather(&self, x: &NpuTensor, out: &mut NpuTensor) -> Result<()> {
        expect_multiple("all_gather", (layout(out), layout(x)), self.size)?;
        let (send, count, dtype) = self.buffer("all_gather", x)?;
        let recv = out.device_ptr() as *mut c_void;
        let f = self.lib.api.HcclAllGather;
        // SAFETY: `recv` holds `size` × `count` elements of `dtype`.
        self.queue("HcclAllGather", |s| unsafe {
            f(send, recv, count, dtype, self.comm, s)
        })
    }

    fn reduce_scatter(&self, x: &NpuTensor, out: &mut NpuTensor, op: ReduceOp) -> Result<()> {
        expect_multiple("reduce_scatter", (layout(x), layout(out)), self.size)?;
        let (recv, count, dtype) = self.buffer("reduce_scatter", out)?;
        let send = x.device_ptr() as *mut c_void;
        let f = self.lib.api.HcclReduceScatter;
        // SAFETY: `send` holds `size` × `count` elements of `dtype`, `recv` `count`.
        self.queue("HcclReduceScatter", |s| unsafe {
            f(send, recv, count, dtype, reduce_op(op), self.comm, s)
        })
    }

    fn broadcast(&self, x: &mut NpuTensor, root: usize) -> Result<()> {
        expect_rank("broadcast", root, self.me(), true)?;
        let (ptr, count, dtype) = self.buffer("broadcast", x)?;
        let f = self.lib.api.HcclBroadcast;
        // SAFETY: `ptr` holds `count` elements of `dtype`.
        self.queue("HcclBroadcast", |s| unsafe {
            f(ptr, count, dtype, root as u32, self.comm, s)
        })
    }

    fn send(&self, x: &NpuTensor, to: usize) -> Result<()> {
        expect_rank("send", to, self.me(), false)?;
        let (ptr, count, dtype) = self.buffer("send", x)?;
        let f = self.lib.api.HcclSend;
        // SAFETY: `ptr` holds `count` elements of `dtype`.
        self.queue("HcclSend", |s| unsafe {
            f(ptr, count, dtype, to as u32, self.comm, s)
        })
    }

    fn recv(&self, x: &mut NpuTensor, from: usize) -> Result<()> {
        expect_rank("recv", from, self.me(), false)?;
        let (ptr, count, dtype) = self.buffer("recv", x)?;
        let f = self.lib.api.HcclRecv;
        // SAFETY: `ptr` holds `count` elements of `dtype`.
        self.queue("HcclRecv", |s| unsafe {
            f(ptr, count, dtype, from as u32, self.comm, s)
        })
    }

    fn all_reduce_f32(&self, values: &mut [f32], op: ReduceOp) -> Result<()> {
        if values.is_empty() {
            return Ok(());
        }
        let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let count = values.len() as u64;
        let f = self.lib.api.HcclAllReduce;
        // SAFETY: the block holds `count` f32 values (in place, as a tensor's all-reduce).
        let reduced = self.through_device("HcclAllReduce", bytes, 0, |at, _, s| unsafe {
            f(
                at,
                at,
                count,
                HCCL_DATA_TYPE_FP32,
                reduce_op(op),
                self.comm,
                s,
            )
        })?;
        for (v, b) in values.iter_mut().zip(reduced.chunks_exact(4)) {
            *v = f32::from_le_bytes(b.try_into().expect("4 bytes"));
        }
        Ok(())
    }

    fn all_gather_bytes(&self, bytes: &[u8]) -> Result<Vec<u8>> {
        let all = lengths(&self.all_gather_host(length_bytes(bytes.len()))?);
        if all.iter().any(|&n| n != bytes.len()) {
            return Err(self.host_error(format!(
                "all_gather_bytes: ranks disagree on the length: {all:?} bytes by rank"
            )));
        }
        if bytes.len() > MAX_HOST_BYTES {
            return Err(self.host_error(format!(
                "all_gather_bytes: {} bytes from each rank, more than the {MAX_HOST_BYTES} a host-value collective carries",
                bytes.len()
            )));
        }
        match bytes.is_empty() {
            true => Ok(Vec::new()),
            false => self.all_gather_host(bytes.to_vec()),
        }
    }

    fn broadcast_bytes(&self, bytes: &mut Vec<u8>, root: usize) -> Result<()> {
        expect_rank("broadcast_bytes", root, self.me(), true)?;
        let len = lengths(&self.broadcast_host(length_bytes(bytes.len()), root)?)[0];
        if len > MAX_HOST_BYTES {
            return Err(self.host_error(format!(
                "broadcast_bytes: {len} bytes from rank {root}, more than the {MAX_HOST_BYTES} a host-value collective carries"
            )));
        }
        let out = match self.rank == root {
            true => bytes.clone(),
            false => vec![0; len],
        };
        *bytes = match len {
            0 => out,
            _ => self.broadcast_host(out, root)?,
        };
        Ok(())
    }
}

impl Drop for Hccl {
    fn drop(&mut self) {
        if !self.comm.is_null() {
            // SAFETY: a communicator of this library, destroyed once.
            unsafe { (self.lib.api.HcclCommDestroy)(self.comm) };
        }
    }
}
