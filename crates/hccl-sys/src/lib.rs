//! Hand-written FFI to HCCL, CANN's collective communication library (`libhccl.so`): the types,
//! constants and functions multi-device training calls, declared from CANN's `hccl/hccl.h` and
//! `hccl/hccl_types.h` and loaded at run time like the AscendCL runtime (`ascendcl-sys`, whose
//! loader and declaration macros this crate shares). mindkit's `tests/npu_headers.rs` checks every
//! declaration against the headers.
#![allow(non_camel_case_types, non_snake_case)]

use ascendcl_sys::{aclrtStream, cann_constants, cann_functions, open, LoadError, Loaded};
use std::ffi::{c_char, c_int, c_void};

/// `HcclResult` (a C enum): 0 is success.
pub type HcclResult = c_int;
/// `HcclDataType` (a C enum).
pub type HcclDataType = c_int;
/// `HcclReduceOp` (a C enum).
pub type HcclReduceOp = c_int;
/// An opaque communicator handle.
pub type HcclComm = *mut c_void;

/// `HCCL_ROOT_INFO_BYTES`.
pub const HCCL_ROOT_INFO_BYTES: usize = 4108;

/// `HcclRootInfo`: what rank 0 hands every other rank (through any side channel) to build a
/// communicator.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct HcclRootInfo {
    /// Opaque bytes.
    pub internal: [c_char; HCCL_ROOT_INFO_BYTES],
}

impl HcclRootInfo {
    /// The bytes, to hand to the other ranks.
    pub fn to_bytes(&self) -> Vec<u8> {
        self.internal.iter().map(|&c| c as u8).collect()
    }

    /// The root info another rank handed over, if `bytes` has a root info's size.
    pub fn from_bytes(bytes: &[u8]) -> Option<HcclRootInfo> {
        let mut info = HcclRootInfo {
            internal: [0; HCCL_ROOT_INFO_BYTES],
        };
        if bytes.len() != info.internal.len() {
            return None;
        }
        for (c, &b) in info.internal.iter_mut().zip(bytes) {
            *c = b as c_char;
        }
        Some(info)
    }
}

/// A `*_CONFIG_NOT_SET` value: HCCL's default.
pub const HCCL_COMM_CONFIG_NOT_SET: u32 = HCCL_COMM_BUFFSIZE_CONFIG_NOT_SET;

/// `HcclCommConfig` (version 10 of CANN's hccl_types.h): a communicator's settings, opening
/// with a header (`size`, `magicWord`, `version`, reserved) by which HCCL reads older and newer
/// layouts alike. Made by [`HcclCommConfig::new`], as the header's inline
/// `HcclCommConfigInit` makes it: every setting left to HCCL.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct HcclCommConfig {
    /// `size_t size; uint32_t magicWord; uint32_t version; uint64_t reserved`.
    pub reserved: [c_char; HCCL_COMM_CONFIG_INFO_BYTES as usize],
    pub hcclBufferSize: u32,
    pub hcclDeterministic: u32,
    pub hcclCommName: [c_char; 128],
    pub hcclUdi: [c_char; 128],
    pub hcclOpExpansionMode: u32,
    pub hcclRdmaTrafficClass: u32,
    pub hcclRdmaServiceLevel: u32,
    pub hcclWorldRankID: u32,
    pub hcclJobID: u64,
    pub aclGraphZeroCopyEnable: u8,
    pub hcclExecTimeOut: i32,
    pub hcclAlgo: [c_char; 1600],
    pub hcclRetryEnable: [c_char; 50],
    pub hcclRetryParams: [c_char; 128],
    pub hcclBufferName: [c_char; 128],
    pub hcclQos: u32,
    pub hcclSymWinMaxMemSizePerRank: u64,
}

impl HcclCommConfig {
    /// `HcclCommConfigInit`'s configuration: the header filled in, every setting not set.
    pub fn new() -> HcclCommConfig {
        let mut reserved = [0 as c_char; HCCL_COMM_CONFIG_INFO_BYTES as usize];
        let header = [
            &(std::mem::size_of::<HcclCommConfig>() as u64).to_ne_bytes()[..],
            &HCCL_COMM_CONFIG_MAGIC_WORD.to_ne_bytes(),
            &HCCL_COMM_CONFIG_VERSION.to_ne_bytes(),
        ]
        .concat();
        for (r, &b) in reserved.iter_mut().zip(&header) {
            *r = b as c_char;
        }
        HcclCommConfig {
            reserved,
            hcclBufferSize: HCCL_COMM_CONFIG_NOT_SET,
            hcclDeterministic: HCCL_COMM_CONFIG_NOT_SET,
            hcclCommName: [0; 128],
            hcclUdi: [0; 128],
            hcclOpExpansionMode: 0,
            hcclRdmaTrafficClass: HCCL_COMM_CONFIG_NOT_SET,
            hcclRdmaServiceLevel: HCCL_COMM_CONFIG_NOT_SET,
            hcclWorldRankID: 0,
            hcclJobID: 0,
            aclGraphZeroCopyEnable: 0,
            hcclExecTimeOut: -1,
            hcclAlgo: [0; 1600],
            hcclRetryEnable: [0; 50],
            hcclRetryParams: [0; 128],
            hcclBufferName: [0; 128],
            hcclQos: HCCL_COMM_CONFIG_NOT_SET,
            hcclSymWinMaxMemSizePerRank: 16,
        }
    }

    /// The header's `(size, magicWord, version)`.
    pub fn header(&self) -> (u64, u32, u32) {
        let b: Vec<u8> = self.reserved.iter().map(|&c| c as u8).collect();
        let word = |at: usize| u32::from_ne_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
        let size = u64::from_ne_bytes(b[..8].try_into().unwrap_or_default());
        (size, word(8), word(12))
    }
}

impl Default for HcclCommConfig {
    fn default() -> Self {
        Self::new()
    }
}

/// The sizes of the structs declared here, as `(C type name, size)`, for the header check.
pub const STRUCT_SIZES: &[(&str, usize)] = &[
    ("HcclRootInfo", std::mem::size_of::<HcclRootInfo>()),
    ("HcclCommConfig", std::mem::size_of::<HcclCommConfig>()),
];

cann_constants! {
    /// Success.
    HCCL_SUCCESS: HcclResult = 0;
    /// A parameter error.
    HCCL_E_PARA: HcclResult = 1;
    /// A NULL pointer.
    HCCL_E_PTR: HcclResult = 2;
    /// An internal error.
    HCCL_E_INTERNAL: HcclResult = 4;
    /// Not supported.
    HCCL_E_NOT_SUPPORT: HcclResult = 5;
    /// A call into the runtime failed.
    HCCL_E_RUNTIME: HcclResult = 15;
    /// A remote rank failed (or left).
    HCCL_E_REMOTE: HcclResult = 21;
    /// A timeout.
    HCCL_E_TIMEOUT: HcclResult = 9;
    /// A file (the rank table) could not be opened or read.
    HCCL_E_OPEN_FILE_FAILURE: HcclResult = 10;
    /// A connection to another rank (or the root) could not be made.
    HCCL_E_TCP_CONNECT: HcclResult = 11;
    /// Sum.
    HCCL_REDUCE_SUM: HcclReduceOp = 0;
    /// Product.
    HCCL_REDUCE_PROD: HcclReduceOp = 1;
    /// Maximum.
    HCCL_REDUCE_MAX: HcclReduceOp = 2;
    /// Minimum.
    HCCL_REDUCE_MIN: HcclReduceOp = 3;
    /// int8.
    HCCL_DATA_TYPE_INT8: HcclDataType = 0;
    /// int16.
    HCCL_DATA_TYPE_INT16: HcclDataType = 1;
    /// int32.
    HCCL_DATA_TYPE_INT32: HcclDataType = 2;
    /// float16.
    HCCL_DATA_TYPE_FP16: HcclDataType = 3;
    /// float32.
    HCCL_DATA_TYPE_FP32: HcclDataType = 4;
    /// int64.
    HCCL_DATA_TYPE_INT64: HcclDataType = 5;
    /// uint64.
    HCCL_DATA_TYPE_UINT64: HcclDataType = 6;
    /// uint8.
    HCCL_DATA_TYPE_UINT8: HcclDataType = 7;
    /// uint16.
    HCCL_DATA_TYPE_UINT16: HcclDataType = 8;
    /// uint32.
    HCCL_DATA_TYPE_UINT32: HcclDataType = 9;
    /// float64.
    HCCL_DATA_TYPE_FP64: HcclDataType = 10;
    /// bfloat16.
    HCCL_DATA_TYPE_BFP16: HcclDataType = 11;
    /// The bytes of the versioned header at the start of [`HcclCommConfig`].
    HCCL_COMM_CONFIG_INFO_BYTES: u32 = 24;
    /// The header's magic word.
    HCCL_COMM_CONFIG_MAGIC_WORD: u32 = 0xf0f0_f0f0;
    /// The header's version of the layout [`HcclCommConfig`] follows.
    HCCL_COMM_CONFIG_VERSION: u32 = 10;
    /// `hcclBufferSize` left to HCCL.
    HCCL_COMM_BUFFSIZE_CONFIG_NOT_SET: u32 = 0xffff_ffff;
}

cann_functions! {
    /// Rank 0: create the root info the other ranks join with.
    fn HcclGetRootInfo(root_info: *mut HcclRootInfo) -> HcclResult;
    /// Join the communicator of `n_ranks` as `rank`.
    fn HcclCommInitRootInfo(n_ranks: u32, root_info: *const HcclRootInfo, rank: u32, comm: *mut HcclComm) -> HcclResult;
    /// Join the communicator a rank table file describes.
    fn HcclCommInitClusterInfo(cluster_info: *const c_char, rank: u32, comm: *mut HcclComm) -> HcclResult;
    /// Join a communicator of `rank_num` ranks of `comm` (their ranks there in `rank_ids`, this
    /// rank's index among them `sub_comm_rank_id`), identified by `sub_comm_id` among `comm`'s.
    fn HcclCreateSubCommConfig(comm: *mut HcclComm, rank_num: u32, rank_ids: *mut u32, sub_comm_id: u64, sub_comm_rank_id: u32, config: *mut HcclCommConfig, sub_comm: *mut HcclComm) -> HcclResult;
    /// All-reduce `count` elements.
    fn HcclAllReduce(send_buf: *mut c_void, recv_buf: *mut c_void, count: u64, data_type: HcclDataType, op: HcclReduceOp, comm: HcclComm, stream: aclrtStream) -> HcclResult;
    /// All-gather `send_count` elements from every rank.
    fn HcclAllGather(send_buf: *mut c_void, recv_buf: *mut c_void, send_count: u64, data_type: HcclDataType, comm: HcclComm, stream: aclrtStream) -> HcclResult;
    /// Reduce, then scatter `recv_count` elements to each rank.
    fn HcclReduceScatter(send_buf: *mut c_void, recv_buf: *mut c_void, recv_count: u64, data_type: HcclDataType, op: HcclReduceOp, comm: HcclComm, stream: aclrtStream) -> HcclResult;
    /// Broadcast from `root`.
    fn HcclBroadcast(buf: *mut c_void, count: u64, data_type: HcclDataType, root: u32, comm: HcclComm, stream: aclrtStream) -> HcclResult;
    /// Send to one rank.
    fn HcclSend(send_buf: *mut c_void, count: u64, data_type: HcclDataType, dest_rank: u32, comm: HcclComm, stream: aclrtStream) -> HcclResult;
    /// Receive from one rank.
    fn HcclRecv(recv_buf: *mut c_void, count: u64, data_type: HcclDataType, src_rank: u32, comm: HcclComm, stream: aclrtStream) -> HcclResult;
    /// The number of ranks.
    fn HcclGetRankSize(comm: HcclComm, rank_size: *mut u32) -> HcclResult;
    /// This process's rank.
    fn HcclGetRankId(comm: HcclComm, rank: *mut u32) -> HcclResult;
    /// Destroy a communicator.
    fn HcclCommDestroy(comm: HcclComm) -> HcclResult;
    /// A result code's text.
    fn HcclGetErrorString(code: HcclResult) -> *const c_char;
}

/// The loaded HCCL library.
pub type Hccl = Loaded<Functions>;

/// Load `libhccl.so` from where CANN installs it (`ascendcl_sys::candidates`).
pub fn load() -> Result<Hccl, LoadError> {
    // SAFETY: the declarations above follow CANN's hccl/*.h (checked by the header test).
    unsafe { open("libhccl.so", Functions::resolve) }
}
