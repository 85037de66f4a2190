//! Ascend NPUs through CANN, loaded at run time (`ascendcl-sys`): `mindkit npu info`, and the
//! engine's backend on aclnn operators ([`Npu`]): a device context with one stream and a
//! caching memory pool (`context.rs`, `memory.rs`), aclnn descriptors (`descriptor.rs`), the
//! operators (`backend.rs`), and HCCL's collectives between NPUs (`comm.rs`).

mod backend;
pub mod comm;
mod context;
mod descriptor;
mod memory;

pub use backend::{Npu, NpuTensor};

use ascendcl_sys::{
    aclError, Acl, ACL_ERROR_REPEAT_INITIALIZE, ACL_HBM_MEM, ACL_PKG_NAME_CANN, ACL_SUCCESS,
};
use std::ffi::{c_char, CStr};
use std::fmt::Write;

/// What CANN and the runtime can fail with.
#[derive(Debug, thiserror::Error)]
pub enum NpuError {
    /// `libascendcl.so` could not be loaded (where it was looked for, and the usual fix).
    #[error(transparent)]
    Load(#[from] ascendcl_sys::LoadError),
    /// A runtime call failed: the call, its error code and the runtime's own message.
    #[error("{call} failed with ACL error {code}: {message}")]
    Call {
        /// The function.
        call: &'static str,
        /// Its `aclError`.
        code: aclError,
        /// `aclGetRecentErrMsg()`.
        message: String,
    },
}

/// A loaded, initialised runtime; finalised when dropped.
struct Runtime {
    acl: Acl,
}

impl Runtime {
    fn start() -> Result<Runtime, NpuError> {
        let runtime = Runtime {
            acl: ascendcl_sys::load()?,
        };
        // SAFETY: a null config path is allowed (acl.h).
        let code = unsafe { (runtime.acl.api.aclInit)(std::ptr::null()) };
        if code != ACL_ERROR_REPEAT_INITIALIZE {
            runtime.check("aclInit", code)?;
        }
        Ok(runtime)
    }

    fn check(&self, call: &'static str, code: aclError) -> Result<(), NpuError> {
        if code == ACL_SUCCESS {
            return Ok(());
        }
        // SAFETY: the runtime returns a NUL-terminated string it owns, or null.
        let message = unsafe { c_string((self.acl.api.aclGetRecentErrMsg)()) };
        Err(NpuError::Call {
            call,
            code,
            message,
        })
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        // SAFETY: paired with the successful aclInit of `start`.
        unsafe { (self.acl.api.aclFinalize)() };
    }
}

/// A C string the runtime owns, copied ("" for null).
///
/// # Safety
/// `s` is null or points to a NUL-terminated string alive for the call.
pub(crate) unsafe fn c_string(s: *const c_char) -> String {
    if s.is_null() {
        return String::new();
    }
    CStr::from_ptr(s).to_string_lossy().into_owned()
}

/// What `mindkit npu info` read: its report, and the devices that could not be opened.
pub struct Info {
    /// The library loaded, CANN's version, HCCL, and a line per device.
    pub report: String,
    /// The devices whose line says why they could not be read.
    pub unavailable: Vec<i32>,
}

/// `mindkit npu info`: the library loaded, CANN's version, and per device its SoC and HBM. A
/// device that cannot be opened (busy, broken) gets a line naming the call, its code and CANN's
/// message, and the others are read all the same.
pub fn info() -> Result<Info, NpuError> {
    let rt = Runtime::start()?;
    let api = rt.acl.api;
    let mut out = format!("runtime  {}\n", rt.acl.path.display());
    // SAFETY: zeroed bytes are a valid aclCANNPackageVersion; the call fills NUL-terminated strings.
    let mut version: ascendcl_sys::aclCANNPackageVersion = unsafe { std::mem::zeroed() };
    rt.check("aclsysGetCANNVersion", unsafe {
        (api.aclsysGetCANNVersion)(ACL_PKG_NAME_CANN, &mut version)
    })?;
    // SAFETY: the buffer is NUL-terminated (zeroed, and the runtime writes a C string).
    let _ = writeln!(out, "CANN     {}", unsafe {
        c_string(version.version.as_ptr())
    });
    let mut count = 0u32;
    // SAFETY: `count` is a valid out-pointer.
    rt.check("aclrtGetDeviceCount", unsafe {
        (api.aclrtGetDeviceCount)(&mut count)
    })?;
    let hccl = match hccl_sys::load() {
        Ok(hccl) => hccl.path.display().to_string(),
        Err(_) => "libhccl.so not found (needed for more than one device)".into(),
    };
    let _ = writeln!(out, "HCCL     {hccl}");
    let _ = writeln!(out, "devices  {count}");
    let mut unavailable = Vec::new();
    for id in 0..count as i32 {
        match device_line(&rt, id) {
            Ok(line) => out.push_str(&line),
            Err(e) => {
                let _ = writeln!(out, "npu {id}    unavailable: {e}");
                unavailable.push(id);
            }
        }
    }
    Ok(Info {
        report: out,
        unavailable,
    })
}

/// Device `id`'s line of `npu info`: its SoC and HBM, read with the device bound.
fn device_line(rt: &Runtime, id: i32) -> Result<String, NpuError> {
    let api = rt.acl.api;
    // SAFETY: `id` is below the device count; the binding is released below.
    rt.check("aclrtSetDevice", unsafe { (api.aclrtSetDevice)(id) })?;
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: valid out-pointers; the thread has a current device.
    let mem = rt.check("aclrtGetMemInfo", unsafe {
        (api.aclrtGetMemInfo)(ACL_HBM_MEM, &mut free, &mut total)
    });
    // SAFETY: the runtime's own string.
    let soc = unsafe { c_string((api.aclrtGetSocName)()) };
    // SAFETY: paired with the aclrtSetDevice above.
    rt.check("aclrtResetDevice", unsafe { (api.aclrtResetDevice)(id) })?;
    mem?;
    let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
    Ok(format!(
        "npu {id}    {soc}, HBM {:.1} GiB free of {:.1} GiB\n",
        gib(free),
        gib(total)
    ))
}
