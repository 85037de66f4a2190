//! A stand-in for CANN's AscendCL runtime (`libascendcl.so`) that computes on host memory, for
//! running mindkit's NPU code path where there is no NPU (CI). It is **strict** about the API
//! contract, the way Vulkan's validation layers are: calls before `aclInit` or without a device
//! bound to the thread, device pointers that are not live allocations, copies outside them or
//! above `destMax`, device memory read by the host while stream work that wrote it is not
//! synchronized, unknown streams, and anything still allocated at `aclFinalize` are errors with
//! the runtime's codes and a message for `aclGetRecentErrMsg`. With `MINDKIT_STAND_IN_REPORT`
//! set, `aclFinalize` writes what it counted (allocations, frees, copies, synchronizations, the
//! most bytes live, memsets, operator launches in all and per operator) there as JSON, so tests
//! can assert the caller's behaviour.
//!
//! The same library stands in for `libnnopbase.so` and `libopapi.so` (tests link those names to
//! it): the aclnn object model in [`aclnn`] and the operators in [`ops`], computed on host
//! memory in f32, as strict about their contracts (descriptors over live memory, executors
//! launched once with the workspace phase 1 asked for; descriptors and executors still alive
//! at `aclFinalize` are leaks too); and for `libhccl.so`: HCCL's communicators and collectives
//! between the ranks (processes or threads) of this machine, in [`hccl`].
//!
//! Test-only: never shipped, never a runtime for real work. The exported functions have the
//! types `ascendcl-sys` declares (checked against CANN's headers).

// The exported functions are C entry points: their pointer arguments follow CANN's contract,
// which `unsafe fn` could not tell a C caller.
#![allow(clippy::not_unsafe_ptr_arg_deref)]

use ascendcl_sys::{
    aclCANNPackageName, aclCANNPackageVersion, aclError, aclrtMemAttr, aclrtMemMallocPolicy,
    aclrtMemcpyKind, aclrtStream, ACL_HBM_MEM, ACL_MEMCPY_DEVICE_TO_DEVICE,
    ACL_MEMCPY_DEVICE_TO_HOST, ACL_MEMCPY_HOST_TO_DEVICE, ACL_PKG_NAME_CANN, ACL_SUCCESS,
};
use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, BTreeSet};
use std::ffi::{c_char, c_void, CString};
use std::sync::{Mutex, MutexGuard};

mod aclnn;
mod hccl;
mod ops;
mod view;

// Error codes of acl_base.h / rt_error_codes.h the stand-in answers with.
const ACL_ERROR_INVALID_PARAM: aclError = 100000;
const ACL_ERROR_UNINITIALIZE: aclError = 100001;
const ACL_ERROR_REPEAT_INITIALIZE: aclError = 100002;
const ACL_ERROR_REPEAT_FINALIZE: aclError = 100037;
const ACL_ERROR_RT_INVALID_DEVICEID: aclError = 107001;
const ACL_ERROR_RT_CONTEXT_NULL: aclError = 107002;
const ACL_ERROR_RT_MEMORY_FREE: aclError = 207002;
const ACL_ERROR_RT_DEV_SETUP_ERROR: aclError = 507033;

/// What a stand-in device reports as its HBM.
const HBM_BYTES: usize = 64 << 30;

/// One device allocation: host bytes standing in for HBM, the 64-byte-aligned address handed
/// out, the size asked for, and whether stream work wrote it since the last synchronize.
struct Allocation {
    _bytes: Vec<u8>,
    size: usize,
    written_async: bool,
}

#[derive(Default)]
struct Counters {
    allocations: u64,
    frees: u64,
    copies: u64,
    synchronizations: u64,
    peak_live_bytes: usize,
    memsets: u64,
    launches: u64,
    ops: BTreeMap<&'static str, u64>,
}

#[derive(Default)]
struct Runtime {
    inits: u32,
    allocations: BTreeMap<usize, Allocation>,
    streams: BTreeSet<usize>,
    next_stream: usize,
    counters: Counters,
    aclnn: aclnn::State,
}

static RUNTIME: Mutex<Option<Runtime>> = Mutex::new(None);

thread_local! {
    static CURRENT_DEVICE: Cell<Option<i32>> = const { Cell::new(None) };
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn lock() -> MutexGuard<'static, Option<Runtime>> {
    RUNTIME.lock().unwrap_or_else(|e| e.into_inner())
}

/// Record `message` for `aclGetRecentErrMsg` and return `code`.
fn fail(code: aclError, message: String) -> aclError {
    let text = format!("EE9999: [mindkit CANN stand-in] {message}");
    LAST_ERROR.with(|e| *e.borrow_mut() = CString::new(text).unwrap_or_default());
    code
}

/// The message of the calling thread's most recent failure, without its prefix.
fn recent_message() -> String {
    let text = LAST_ERROR.with(|e| e.borrow().to_string_lossy().into_owned());
    let prefix = "EE9999: [mindkit CANN stand-in] ";
    text.strip_prefix(prefix).unwrap_or(&text).to_string()
}

/// Devices the stand-in has (`MINDKIT_STAND_IN_DEVICES`, default 1).
fn device_count() -> u32 {
    std::env::var("MINDKIT_STAND_IN_DEVICES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(1)
}

/// Run `f` on the initialised runtime of a thread with a device bound.
fn with_device(call: &str, f: impl FnOnce(&mut Runtime) -> aclError) -> aclError {
    let mut guard = lock();
    let Some(rt) = guard.as_mut().filter(|rt| rt.inits > 0) else {
        return fail(ACL_ERROR_UNINITIALIZE, format!("{call} before aclInit"));
    };
    if CURRENT_DEVICE.with(Cell::get).is_none() {
        return fail(
            ACL_ERROR_RT_CONTEXT_NULL,
            format!("{call} on a thread with no device set (aclrtSetDevice)"),
        );
    }
    f(rt)
}

impl Runtime {
    /// The allocation holding `[addr, addr + len)`, or an error naming `what`.
    fn region(&mut self, addr: usize, len: usize, what: &str) -> Result<&mut Allocation, aclError> {
        let found = self.allocations.range_mut(..=addr).next_back();
        match found {
            Some((&base, a)) if addr + len <= base + a.size => Ok(a),
            Some((&base, a)) if addr < base + a.size => Err(fail(
                ACL_ERROR_INVALID_PARAM,
                format!(
                    "{what}: {len} bytes at offset {} overrun the {}-byte allocation",
                    addr - base,
                    a.size
                ),
            )),
            _ => Err(fail(
                ACL_ERROR_INVALID_PARAM,
                format!("{what} {addr:#x} is not device memory from aclrtMalloc"),
            )),
        }
    }

    fn live_bytes(&self) -> usize {
        self.allocations.values().map(|a| a.size).sum()
    }

    /// Check and perform a copy; `async_stream` marks its device destination as written by
    /// stream work until the stream is synchronized.
    fn copy(
        &mut self,
        dst: *mut c_void,
        dest_max: usize,
        src: *const c_void,
        count: usize,
        kind: aclrtMemcpyKind,
        async_stream: bool,
    ) -> aclError {
        if count > dest_max {
            return fail(
                ACL_ERROR_INVALID_PARAM,
                format!("count {count} exceeds destMax {dest_max}"),
            );
        }
        let (d, s) = (dst as usize, src as usize);
        let device_dst = kind == ACL_MEMCPY_HOST_TO_DEVICE || kind == ACL_MEMCPY_DEVICE_TO_DEVICE;
        let device_src = kind == ACL_MEMCPY_DEVICE_TO_HOST || kind == ACL_MEMCPY_DEVICE_TO_DEVICE;
        if !device_dst && !device_src {
            return fail(
                ACL_ERROR_INVALID_PARAM,
                format!("memcpy kind {kind} is not H2D, D2H or D2D"),
            );
        }
        if device_src {
            match self.region(s, count, "source") {
                Ok(a) if a.written_async && kind == ACL_MEMCPY_DEVICE_TO_HOST => {
                    return fail(ACL_ERROR_INVALID_PARAM, "device memory read by the host before aclrtSynchronizeStream of the work that wrote it".into())
                }
                Ok(_) => {}
                Err(code) => return code,
            }
        }
        if device_dst {
            match self.region(d, count, "destination") {
                Ok(a) => a.written_async |= async_stream,
                Err(code) => return code,
            }
        }
        // SAFETY: both ranges were checked (device sides) or are the caller's host buffers of
        // `count` bytes, as the API requires; allocations never overlap host buffers.
        unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, count) };
        self.counters.copies += 1;
        ACL_SUCCESS
    }

    /// The JSON report of what was counted.
    fn report(&self) -> String {
        let c = &self.counters;
        let ops: Vec<String> = c
            .ops
            .iter()
            .map(|(op, n)| format!("\"{op}\": {n}"))
            .collect();
        format!(
            "{{\"allocations\": {}, \"frees\": {}, \"copies\": {}, \"synchronizations\": {}, \"peak_live_bytes\": {}, \"memsets\": {}, \"launches\": {}, \"ops\": {{{}}}, \"hccl\": {{{}}}}}\n",
            c.allocations, c.frees, c.copies, c.synchronizations, c.peak_live_bytes, c.memsets, c.launches, ops.join(", "), hccl::counted()
        )
    }
}

#[no_mangle]
pub extern "C" fn aclInit(_config_path: *const c_char) -> aclError {
    let mut guard = lock();
    let rt = guard.get_or_insert_with(Runtime::default);
    rt.inits += 1;
    if rt.inits > 1 {
        return ACL_ERROR_REPEAT_INITIALIZE;
    }
    ACL_SUCCESS
}

#[no_mangle]
pub extern "C" fn aclFinalize() -> aclError {
    let mut guard = lock();
    let Some(rt) = guard.as_mut().filter(|rt| rt.inits > 0) else {
        return fail(
            ACL_ERROR_REPEAT_FINALIZE,
            "aclFinalize without aclInit".into(),
        );
    };
    rt.inits -= 1;
    if rt.inits > 0 {
        return ACL_SUCCESS;
    }
    if let Some(path) = std::env::var_os("MINDKIT_STAND_IN_REPORT") {
        let _ = std::fs::write(path, rt.report());
    }
    let (bytes, streams) = (rt.live_bytes(), rt.streams.len());
    let leaked = rt.allocations.len();
    let mut problems = Vec::new();
    if leaked > 0 || streams > 0 {
        problems.push(format!(
            "{leaked} allocations ({bytes} bytes) and {streams} streams never freed"
        ));
    }
    problems.extend(rt.aclnn.leaks());
    problems.extend(hccl::leaks());
    // the state goes whatever leaked, so that a later aclInit starts afresh
    *guard = None;
    drop(guard);
    hccl::await_departures();
    if problems.is_empty() {
        return ACL_SUCCESS;
    }
    fail(
        ACL_ERROR_INVALID_PARAM,
        format!("aclFinalize with {}", problems.join("; ")),
    )
}

#[no_mangle]
pub extern "C" fn aclGetRecentErrMsg() -> *const c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}

#[no_mangle]
pub extern "C" fn aclrtGetSocName() -> *const c_char {
    c"Ascend910B4".as_ptr()
}

#[no_mangle]
pub extern "C" fn aclsysGetCANNVersion(
    name: aclCANNPackageName,
    version: *mut aclCANNPackageVersion,
) -> aclError {
    if name != ACL_PKG_NAME_CANN || version.is_null() {
        return fail(
            ACL_ERROR_INVALID_PARAM,
            "aclsysGetCANNVersion: unknown package or null version".into(),
        );
    }
    // SAFETY: the caller passes a valid aclCANNPackageVersion; the text fits its 128 bytes.
    unsafe {
        std::ptr::write_bytes(version, 0, 1);
        for (i, b) in b"8.1.RC1".iter().enumerate() {
            (*version).version[i] = *b as c_char;
        }
    }
    ACL_SUCCESS
}

#[no_mangle]
pub extern "C" fn aclrtGetDeviceCount(count: *mut u32) -> aclError {
    if lock().as_ref().is_none_or(|rt| rt.inits == 0) {
        return fail(
            ACL_ERROR_UNINITIALIZE,
            "aclrtGetDeviceCount before aclInit".into(),
        );
    }
    // SAFETY: the caller's out-pointer.
    unsafe { *count = device_count() };
    ACL_SUCCESS
}

#[no_mangle]
pub extern "C" fn aclrtSetDevice(device_id: i32) -> aclError {
    if lock().as_ref().is_none_or(|rt| rt.inits == 0) {
        return fail(
            ACL_ERROR_UNINITIALIZE,
            "aclrtSetDevice before aclInit".into(),
        );
    }
    if device_id < 0 || device_id as u32 >= device_count() {
        return fail(
            ACL_ERROR_RT_INVALID_DEVICEID,
            format!(
                "device {device_id} does not exist ({} devices)",
                device_count()
            ),
        );
    }
    if busy_devices().contains(&device_id) {
        return fail(
            ACL_ERROR_RT_DEV_SETUP_ERROR,
            format!("device {device_id} could not be set up: it is in use by another process (MINDKIT_STAND_IN_BUSY)"),
        );
    }
    CURRENT_DEVICE.with(|d| d.set(Some(device_id)));
    ACL_SUCCESS
}

/// Devices `aclrtSetDevice` refuses as a busy device does (`MINDKIT_STAND_IN_BUSY`, ids
/// comma-separated).
fn busy_devices() -> Vec<i32> {
    std::env::var("MINDKIT_STAND_IN_BUSY")
        .unwrap_or_default()
        .split(',')
        .filter_map(|id| id.trim().parse().ok())
        .collect()
}

#[no_mangle]
pub extern "C" fn aclrtResetDevice(device_id: i32) -> aclError {
    if CURRENT_DEVICE.with(Cell::get) != Some(device_id) {
        return fail(
            ACL_ERROR_RT_INVALID_DEVICEID,
            format!("aclrtResetDevice({device_id}) on a thread that did not set it"),
        );
    }
    CURRENT_DEVICE.with(|d| d.set(None));
    ACL_SUCCESS
}

#[no_mangle]
pub extern "C" fn aclrtGetMemInfo(
    attr: aclrtMemAttr,
    free: *mut usize,
    total: *mut usize,
) -> aclError {
    with_device("aclrtGetMemInfo", |rt| {
        if attr != ACL_HBM_MEM {
            return fail(
                ACL_ERROR_INVALID_PARAM,
                format!("aclrtGetMemInfo: attribute {attr} (a 910B reports ACL_HBM_MEM)"),
            );
        }
        // SAFETY: the caller's out-pointers.
        unsafe {
            *total = HBM_BYTES;
            *free = HBM_BYTES - rt.live_bytes();
        }
        ACL_SUCCESS
    })
}

#[no_mangle]
pub extern "C" fn aclrtCreateStream(stream: *mut aclrtStream) -> aclError {
    with_device("aclrtCreateStream", |rt| {
        rt.next_stream += 1;
        let handle = 0x5_0000 + rt.next_stream;
        rt.streams.insert(handle);
        // SAFETY: the caller's out-pointer.
        unsafe { *stream = handle as aclrtStream };
        ACL_SUCCESS
    })
}

#[no_mangle]
pub extern "C" fn aclrtDestroyStream(stream: aclrtStream) -> aclError {
    with_device("aclrtDestroyStream", |rt| {
        if !rt.streams.remove(&(stream as usize)) {
            return fail(
                ACL_ERROR_INVALID_PARAM,
                format!("aclrtDestroyStream: {stream:?} is not a live stream"),
            );
        }
        ACL_SUCCESS
    })
}

#[no_mangle]
pub extern "C" fn aclrtSynchronizeStream(stream: aclrtStream) -> aclError {
    with_device("aclrtSynchronizeStream", |rt| {
        if !rt.streams.contains(&(stream as usize)) {
            return fail(
                ACL_ERROR_INVALID_PARAM,
                format!("aclrtSynchronizeStream: {stream:?} is not a live stream"),
            );
        }
        rt.allocations
            .values_mut()
            .for_each(|a| a.written_async = false);
        rt.counters.synchronizations += 1;
        ACL_SUCCESS
    })
}

#[no_mangle]
pub extern "C" fn aclrtMalloc(
    dev_ptr: *mut *mut c_void,
    size: usize,
    policy: aclrtMemMallocPolicy,
) -> aclError {
    with_device("aclrtMalloc", |rt| {
        if size == 0 || !(0..=7).contains(&policy) {
            return fail(
                ACL_ERROR_INVALID_PARAM,
                format!("aclrtMalloc of {size} bytes with policy {policy}"),
            );
        }
        if rt.live_bytes() + size > HBM_BYTES {
            return fail(
                207001,
                format!("aclrtMalloc of {size} bytes: out of device memory"),
            );
        }
        // Garbage, not zeros: aclrtMalloc does not clear memory, and callers must not rely on it.
        let bytes = vec![0xA5u8; size + 64];
        let base = (bytes.as_ptr() as usize).next_multiple_of(64);
        rt.allocations.insert(
            base,
            Allocation {
                _bytes: bytes,
                size,
                written_async: false,
            },
        );
        rt.counters.allocations += 1;
        rt.counters.peak_live_bytes = rt.counters.peak_live_bytes.max(rt.live_bytes());
        // SAFETY: the caller's out-pointer.
        unsafe { *dev_ptr = base as *mut c_void };
        ACL_SUCCESS
    })
}

#[no_mangle]
pub extern "C" fn aclrtFree(dev_ptr: *mut c_void) -> aclError {
    with_device("aclrtFree", |rt| {
        match rt.allocations.remove(&(dev_ptr as usize)) {
            Some(_) => {
                rt.counters.frees += 1;
                ACL_SUCCESS
            }
            None => fail(
                ACL_ERROR_RT_MEMORY_FREE,
                format!("aclrtFree({dev_ptr:?}): not the start of a live allocation"),
            ),
        }
    })
}

#[no_mangle]
pub extern "C" fn aclrtMemcpy(
    dst: *mut c_void,
    dest_max: usize,
    src: *const c_void,
    count: usize,
    kind: aclrtMemcpyKind,
) -> aclError {
    with_device("aclrtMemcpy", |rt| {
        rt.copy(dst, dest_max, src, count, kind, false)
    })
}

#[no_mangle]
pub extern "C" fn aclrtMemcpyAsync(
    dst: *mut c_void,
    dest_max: usize,
    src: *const c_void,
    count: usize,
    kind: aclrtMemcpyKind,
    stream: aclrtStream,
) -> aclError {
    with_device("aclrtMemcpyAsync", |rt| {
        if !rt.streams.contains(&(stream as usize)) {
            return fail(
                ACL_ERROR_INVALID_PARAM,
                format!("aclrtMemcpyAsync: {stream:?} is not a live stream"),
            );
        }
        rt.copy(dst, dest_max, src, count, kind, true)
    })
}

#[no_mangle]
pub extern "C" fn aclrtMemsetAsync(
    dev_ptr: *mut c_void,
    max_count: usize,
    value: i32,
    count: usize,
    stream: aclrtStream,
) -> aclError {
    with_device("aclrtMemsetAsync", |rt| {
        if !rt.streams.contains(&(stream as usize)) {
            return fail(
                ACL_ERROR_INVALID_PARAM,
                format!("aclrtMemsetAsync: {stream:?} is not a live stream"),
            );
        }
        if count > max_count {
            return fail(
                ACL_ERROR_INVALID_PARAM,
                format!("aclrtMemsetAsync: count {count} exceeds maxCount {max_count}"),
            );
        }
        match rt.region(dev_ptr as usize, count, "aclrtMemsetAsync destination") {
            Ok(a) => a.written_async = true,
            Err(code) => return code,
        }
        // SAFETY: the range was checked to lie inside a live allocation.
        unsafe { std::ptr::write_bytes(dev_ptr as *mut u8, value as u8, count) };
        rt.counters.memsets += 1;
        ACL_SUCCESS
    })
}
