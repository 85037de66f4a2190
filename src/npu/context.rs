//! One device opened for the backend: the three CANN libraries (runtime, aclnn object model,
//! operators), the device bound to each calling thread, one compute stream, the memory pool,
//! the host buffers of queued uploads, and the two-phase launch of an aclnn operator.

use super::memory::{size_class, Pool};
use super::{c_string, NpuError};
use ascendcl_sys::aclnn::{aclOpExecutor, aclnnStatus, nnopbase, opapi};
use ascendcl_sys::{
    aclError, aclrtStream, Loaded, ACL_ERROR_REPEAT_INITIALIZE, ACL_MEMCPY_DEVICE_TO_HOST,
    ACL_MEMCPY_HOST_TO_DEVICE, ACL_MEM_MALLOC_HUGE_FIRST, ACL_SUCCESS,
};
use std::cell::Cell;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// Queued uploads' host bytes above which the host waits for the stream (and frees them).
const STAGED_LIMIT: usize = 64 << 20;

/// The phase-2 (launch) function every aclnn operator has.
pub type Launch =
    unsafe extern "C" fn(*mut c_void, u64, *mut aclOpExecutor, aclrtStream) -> aclnnStatus;

thread_local! {
    /// The device this thread has bound (aclrtSetDevice is per thread).
    static BOUND: Cell<Option<i32>> = const { Cell::new(None) };
}

/// An opened device; closed (memory freed, stream destroyed, runtime finalised) when the last
/// tensor and the backend are gone.
pub struct Context {
    /// Runtime functions.
    pub acl: ascendcl_sys::Functions,
    /// aclnn object model functions.
    pub nn: nnopbase::Functions,
    /// aclnn operators.
    pub op: opapi::Functions,
    /// The device.
    pub device: i32,
    stream: usize,
    /// Whether work was queued since the last synchronisation (a read after none needs no
    /// wait).
    queued: AtomicBool,
    pool: Mutex<Pool>,
    staged: Mutex<(Vec<Vec<u8>>, usize)>,
    _libraries: (
        ascendcl_sys::Acl,
        Loaded<nnopbase::Functions>,
        Loaded<opapi::Functions>,
    ),
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The name of an aclnn status code (CANN's `aclnn/opdev/op_errno.h`).
fn aclnn_status_name(code: aclnnStatus) -> &'static str {
    match code {
        161001 => "ACLNN_ERR_PARAM_NULLPTR",
        161002 => "ACLNN_ERR_PARAM_INVALID",
        361001 => "ACLNN_ERR_RUNTIME_ERROR",
        561000 => "ACLNN_ERR_INNER",
        561001 => "ACLNN_ERR_INNER_INFERSHAPE_ERROR",
        561002 => "ACLNN_ERR_INNER_TILING_ERROR",
        561003 => "ACLNN_ERR_INNER_FIND_KERNEL_ERROR",
        561101 => "ACLNN_ERR_INNER_CREATE_EXECUTOR",
        561103 => "ACLNN_ERR_INNER_NULLPTR",
        561107 => "ACLNN_ERR_INNER_OPP_PATH_NOT_FOUND",
        561112 => "ACLNN_ERR_INNER_OPP_KERNEL_PKG_NOT_FOUND",
        _ => "unknown aclnn status",
    }
}

impl Context {
    /// Load CANN, initialise it and open `device` with one stream.
    pub fn open(device: i32) -> Result<Arc<Context>, NpuError> {
        let acl = ascendcl_sys::load()?;
        let nn = nnopbase::load()?;
        let op = opapi::load()?;
        let (api, nn_api, op_api) = (acl.api, nn.api, op.api);
        // SAFETY: a null config path is allowed (acl.h); a repeated init is counted.
        let code = unsafe { (api.aclInit)(std::ptr::null()) };
        if code != ACL_ERROR_REPEAT_INITIALIZE {
            check_acl(&api, "aclInit", code)?;
        }
        let mut ctx = Context {
            acl: api,
            nn: nn_api,
            op: op_api,
            device,
            stream: 0,
            queued: AtomicBool::new(false),
            pool: Mutex::default(),
            staged: Mutex::default(),
            _libraries: (acl, nn, op),
        };
        ctx.bind()?;
        // SAFETY: a null config path is allowed (aclnn_base.h).
        let status = unsafe { (nn_api.aclnnInit)(std::ptr::null()) };
        ctx.check_nn("aclnnInit", status)?;
        let mut stream: aclrtStream = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; the thread has the device bound.
        ctx.check("aclrtCreateStream", unsafe {
            (api.aclrtCreateStream)(&mut stream)
        })?;
        ctx.stream = stream as usize;
        Ok(Arc::new(ctx))
    }

    /// The compute stream.
    pub fn stream(&self) -> aclrtStream {
        self.stream as aclrtStream
    }

    /// Bind the device to the calling thread if it is not yet.
    pub fn bind(&self) -> Result<(), NpuError> {
        if BOUND.with(Cell::get) == Some(self.device) {
            return Ok(());
        }
        // SAFETY: plain call; a bad id is reported by the runtime.
        self.check("aclrtSetDevice", unsafe {
            (self.acl.aclrtSetDevice)(self.device)
        })?;
        BOUND.with(|b| b.set(Some(self.device)));
        Ok(())
    }

    /// `Ok` for success, else the call, its code and the runtime's message.
    pub fn check(&self, call: &'static str, code: aclError) -> Result<(), NpuError> {
        check_acl(&self.acl, call, code)
    }

    /// As [`Context::check`] for an aclnn status, naming it.
    pub fn check_nn(&self, call: &'static str, status: aclnnStatus) -> Result<(), NpuError> {
        if status == 0 {
            return Ok(());
        }
        Err(NpuError::Call {
            call,
            code: status,
            message: format!("{} — {}", aclnn_status_name(status), self.recent_error()),
        })
    }

    /// `aclGetRecentErrMsg()`.
    pub fn recent_error(&self) -> String {
        // SAFETY: the runtime returns a NUL-terminated string it owns, or null.
        unsafe { c_string((self.acl.aclGetRecentErrMsg)()) }
    }

    /// A device block of at least `bytes` bytes, from the pool or newly allocated.
    pub fn alloc(self: &Arc<Self>, bytes: usize) -> Result<Block, NpuError> {
        let class = size_class(bytes);
        if let Some(ptr) = lock(&self.pool).take(class) {
            return Ok(self.block(ptr, class));
        }
        self.bind()?;
        let ptr = match self.malloc(class) {
            Ok(ptr) => ptr,
            // Out of memory with blocks cached: give them back and try once more.
            Err(_) if lock(&self.pool).cached > 0 => {
                self.free_cached()?;
                self.malloc(class)?
            }
            Err(e) => return Err(e),
        };
        lock(&self.pool).handed_out(class);
        Ok(self.block(ptr, class))
    }

    fn block(self: &Arc<Self>, ptr: usize, class: usize) -> Block {
        Block {
            ptr,
            class,
            ctx: Arc::clone(self),
        }
    }

    fn malloc(&self, bytes: usize) -> Result<usize, NpuError> {
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; the thread has the device bound.
        self.check("aclrtMalloc", unsafe {
            (self.acl.aclrtMalloc)(&mut ptr, bytes, ACL_MEM_MALLOC_HUGE_FIRST)
        })?;
        Ok(ptr as usize)
    }

    /// Free every cached block (after the stream has finished with them).
    fn free_cached(&self) -> Result<(), NpuError> {
        self.synchronize()?;
        let blocks = lock(&self.pool).drain();
        for ptr in blocks {
            // SAFETY: each was allocated by aclrtMalloc and is no longer handed out.
            self.check("aclrtFree", unsafe {
                (self.acl.aclrtFree)(ptr as *mut c_void)
            })?;
        }
        Ok(())
    }

    /// Pool statistics: (live, cached, peak) bytes.
    pub fn memory(&self) -> (usize, usize, usize) {
        let p = lock(&self.pool);
        (p.live, p.cached, p.peak)
    }

    /// Queue a copy of `bytes` to device address `dst` on the stream; the host bytes are kept
    /// until the stream has run it.
    pub fn upload(&self, dst: usize, bytes: Vec<u8>) -> Result<(), NpuError> {
        if bytes.is_empty() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: `dst` is a block of at least `bytes.len()` bytes; the host buffer stays
        // alive in `staged` until the next synchronisation.
        self.check("aclrtMemcpyAsync", unsafe {
            (self.acl.aclrtMemcpyAsync)(
                dst as *mut c_void,
                bytes.len(),
                bytes.as_ptr().cast(),
                bytes.len(),
                ACL_MEMCPY_HOST_TO_DEVICE,
                self.stream(),
            )
        })?;
        self.queued.store(true, Ordering::Release);
        let full = {
            let mut staged = lock(&self.staged);
            staged.1 += bytes.len();
            staged.0.push(bytes);
            staged.1 > STAGED_LIMIT
        };
        if full {
            self.synchronize()?;
        }
        Ok(())
    }

    /// Queue zeroing `len` bytes at `dst`.
    pub fn zero(&self, dst: usize, len: usize) -> Result<(), NpuError> {
        self.bind()?;
        // SAFETY: `dst` is a block of at least `len` bytes.
        self.check("aclrtMemsetAsync", unsafe {
            (self.acl.aclrtMemsetAsync)(dst as *mut c_void, len, 0, len, self.stream())
        })?;
        self.queued.store(true, Ordering::Release);
        Ok(())
    }

    /// Wait for the stream (unless nothing was queued since the last wait), then copy `len`
    /// bytes from device address `src` to the host.
    pub fn download(&self, src: usize, len: usize) -> Result<Vec<u8>, NpuError> {
        if self.queued.load(Ordering::Acquire) {
            self.synchronize()?;
        } else {
            self.bind()?;
        }
        let mut out = vec![0u8; len];
        if len > 0 {
            // SAFETY: `src` is a block of at least `len` bytes, `out` has `len` bytes.
            self.check("aclrtMemcpy", unsafe {
                (self.acl.aclrtMemcpy)(
                    out.as_mut_ptr().cast(),
                    len,
                    src as *const c_void,
                    len,
                    ACL_MEMCPY_DEVICE_TO_HOST,
                )
            })?;
        }
        Ok(out)
    }

    /// Wait until the stream's work is done; queued uploads' host buffers are released.
    pub fn synchronize(&self) -> Result<(), NpuError> {
        self.bind()?;
        // SAFETY: the stream is live until drop.
        self.check("aclrtSynchronizeStream", unsafe {
            (self.acl.aclrtSynchronizeStream)(self.stream())
        })?;
        *lock(&self.staged) = Default::default();
        self.queued.store(false, Ordering::Release);
        Ok(())
    }

    /// Queue work that is not an aclnn operator (a collective) on the stream: `f` is given
    /// the stream on this thread's bound device.
    pub fn on_stream<T>(&self, f: impl FnOnce(aclrtStream) -> T) -> Result<T, NpuError> {
        self.bind()?;
        let out = f(self.stream());
        self.queued.store(true, Ordering::Release);
        Ok(out)
    }

    /// Run an aclnn operator: phase 1 (`prepare`, given the workspace-size and executor
    /// out-pointers), a workspace from the pool, then `launch` on the stream, which consumes
    /// the executor. The workspace block returns to the pool at once: later work on the one
    /// stream runs after this operator.
    pub fn run(
        self: &Arc<Self>,
        name: &'static str,
        prepare: impl FnOnce(*mut u64, *mut *mut aclOpExecutor) -> aclnnStatus,
        launch: Launch,
    ) -> Result<(), NpuError> {
        self.bind()?;
        let (mut size, mut executor) = (0u64, std::ptr::null_mut());
        let status = prepare(&mut size, &mut executor);
        self.check_nn(name, status)?;
        let workspace = match size {
            0 => None,
            n => Some(self.alloc(n as usize)?),
        };
        let ptr = workspace.as_ref().map_or(0, |b| b.ptr) as *mut c_void;
        // SAFETY: the executor comes from phase 1 with this workspace size; the workspace
        // block is at least `size` bytes.
        let status = unsafe { launch(ptr, size, executor, self.stream()) };
        self.queued.store(true, Ordering::Release);
        self.check_nn(name, status)
    }
}

fn check_acl(
    api: &ascendcl_sys::Functions,
    call: &'static str,
    code: aclError,
) -> Result<(), NpuError> {
    if code == ACL_SUCCESS {
        return Ok(());
    }
    // SAFETY: the runtime returns a NUL-terminated string it owns, or null.
    let message = unsafe { c_string((api.aclGetRecentErrMsg)()) };
    Err(NpuError::Call {
        call,
        code,
        message,
    })
}

impl Drop for Context {
    fn drop(&mut self) {
        // Errors here have nowhere to go; the runtime reports leaks itself.
        let _ = self.free_cached();
        // SAFETY: the stream was created by open; pairs with aclnnInit / aclInit there.
        unsafe {
            (self.acl.aclrtDestroyStream)(self.stream());
            (self.nn.aclnnFinalize)();
            (self.acl.aclrtResetDevice)(self.device);
            (self.acl.aclFinalize)();
        }
        BOUND.with(|b| b.set(None));
    }
}

/// A block of device memory from the pool, returned to it when dropped.
pub struct Block {
    /// Its device address.
    pub ptr: usize,
    class: usize,
    ctx: Arc<Context>,
}

impl Drop for Block {
    fn drop(&mut self) {
        lock(&self.ctx.pool).put(self.ptr, self.class);
    }
}
