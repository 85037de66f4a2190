//! Hand-written FFI to the AscendCL runtime of Huawei CANN (`libascendcl.so`): the types,
//! constants and functions mindkit calls, declared from CANN's `acl/acl.h`, `acl/acl_base_rt.h` and
//! `acl/acl_rt.h`, and loaded **at run time** with `libloading`, so that a build needs no CANN and
//! runs everywhere; only the commands that use an NPU ask for the library.
//!
//! The declarations are data ([`FUNCTIONS`], [`CONSTANTS`], [`STRUCT_SIZES`]): mindkit's
//! `tests/npu_headers.rs` turns them into a C file checked against CANN's own headers (as the
//! torch-npu wheel ships them; `docs/test-assets.md`): every function's type with
//! `__builtin_types_compatible_p`, every constant's value and every struct's size.
#![allow(non_camel_case_types, non_snake_case)]

pub use libloading;

pub mod aclnn;
use std::ffi::{c_char, c_int, c_void};
use std::path::{Path, PathBuf};

/// `aclError` (`typedef int aclError`): 0 is success.
pub type aclError = c_int;
/// An opaque stream handle.
pub type aclrtStream = *mut c_void;
/// `enum aclrtMemAttr` (int-sized, as every C enum of the API).
pub type aclrtMemAttr = c_int;
/// `enum aclrtMemMallocPolicy`.
pub type aclrtMemMallocPolicy = c_int;
/// `enum aclrtMemcpyKind`.
pub type aclrtMemcpyKind = c_int;
/// `enum aclCANNPackageName`.
pub type aclCANNPackageName = c_int;
/// `enum aclDataType`.
pub type aclDataType = c_int;
/// `enum aclFormat`.
pub type aclFormat = c_int;

/// `ACL_PKG_VERSION_MAX_SIZE`.
pub const ACL_PKG_VERSION_MAX_SIZE: usize = 128;
/// `ACL_PKG_VERSION_PARTS_MAX_SIZE`.
pub const ACL_PKG_VERSION_PARTS_MAX_SIZE: usize = 64;

/// `aclCANNPackageVersion`: a package's version as NUL-terminated strings.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct aclCANNPackageVersion {
    /// The whole version, e.g. "8.1.RC1".
    pub version: [c_char; ACL_PKG_VERSION_MAX_SIZE],
    /// Major part.
    pub major: [c_char; ACL_PKG_VERSION_PARTS_MAX_SIZE],
    /// Minor part.
    pub minor: [c_char; ACL_PKG_VERSION_PARTS_MAX_SIZE],
    /// Release part.
    pub release: [c_char; ACL_PKG_VERSION_PARTS_MAX_SIZE],
    /// Patch part.
    pub patch: [c_char; ACL_PKG_VERSION_PARTS_MAX_SIZE],
    /// Reserved.
    pub reserved: [c_char; ACL_PKG_VERSION_MAX_SIZE],
}

/// The sizes of the structs declared here, as `(C type name, size)`, for the header check.
pub const STRUCT_SIZES: &[(&str, usize)] = &[(
    "aclCANNPackageVersion",
    std::mem::size_of::<aclCANNPackageVersion>(),
)];

/// Declares C constants and lists them in `CONSTANTS` (`(C name, value)`) for the header
/// check. Shared with `hccl-sys`.
#[macro_export]
macro_rules! cann_constants {
    ($($(#[$doc:meta])* $name:ident: $ty:ty = $value:expr;)*) => {
        $($(#[$doc])* pub const $name: $ty = $value;)*
        /// Every constant declared here, as `(C name, value)`, for the header check.
        pub const CONSTANTS: &[(&str, i64)] = &[$((stringify!($name), $value as i64)),*];
    };
}

cann_constants! {
    /// Success.
    ACL_SUCCESS: aclError = 0;
    /// `aclInit` called twice (harmless: the runtime counts references).
    ACL_ERROR_REPEAT_INITIALIZE: aclError = 100002;
    /// Host DDR memory, for `aclrtGetMemInfo`.
    ACL_DDR_MEM: aclrtMemAttr = 0;
    /// The device's HBM, for `aclrtGetMemInfo` (what a 910B reports its memory as).
    ACL_HBM_MEM: aclrtMemAttr = 1;
    /// Huge pages first, normal pages for requests of at most 1 MiB.
    ACL_MEM_MALLOC_HUGE_FIRST: aclrtMemMallocPolicy = 0;
    /// Host to device copy.
    ACL_MEMCPY_HOST_TO_DEVICE: aclrtMemcpyKind = 1;
    /// Device to host copy.
    ACL_MEMCPY_DEVICE_TO_HOST: aclrtMemcpyKind = 2;
    /// Device to device copy.
    ACL_MEMCPY_DEVICE_TO_DEVICE: aclrtMemcpyKind = 3;
    /// The CANN package, for `aclsysGetCANNVersion`.
    ACL_PKG_NAME_CANN: aclCANNPackageName = 0;
    /// fp32.
    ACL_FLOAT: aclDataType = 0;
    /// fp16.
    ACL_FLOAT16: aclDataType = 1;
    /// int8.
    ACL_INT8: aclDataType = 2;
    /// int32.
    ACL_INT32: aclDataType = 3;
    /// int16.
    ACL_INT16: aclDataType = 6;
    /// uint8.
    ACL_UINT8: aclDataType = 4;
    /// int64.
    ACL_INT64: aclDataType = 9;
    /// fp64.
    ACL_DOUBLE: aclDataType = 11;
    /// bool (one byte).
    ACL_BOOL: aclDataType = 12;
    /// bf16.
    ACL_BF16: aclDataType = 27;
    /// No type CANN computes on (mindkit's float8 weights are dequantized on the host).
    ACL_DT_UNDEFINED: aclDataType = -1;
    /// The plain row-major format every tensor mindkit makes uses.
    ACL_FORMAT_ND: aclFormat = 2;
}

/// Declares a library's C functions as a `Functions` struct of function pointers, resolved
/// together when the library is loaded, and lists them in `FUNCTIONS` for the header check.
/// Functions after `optional:` may be missing from an installed CANN (the caller has a
/// fallback): their fields are `Option`s. Shared with `hccl-sys`.
#[macro_export]
macro_rules! cann_functions {
    ($($(#[$doc:meta])* fn $name:ident($($arg:ident: $ty:ty),*) -> $ret:ty;)*
     $(optional: $($(#[$odoc:meta])* fn $oname:ident($($oarg:ident: $oty:ty),*) -> $oret:ty;)*)?) => {
        /// The library's functions, resolved once when it is loaded.
        #[derive(Clone, Copy)]
        pub struct Functions {
            $($(#[$doc])* pub $name: unsafe extern "C" fn($($arg: $ty),*) -> $ret,)*
            $($($(#[$odoc])* pub $oname: Option<unsafe extern "C" fn($($oarg: $oty),*) -> $oret>,)*)?
        }

        impl Functions {
            /// Resolve every function; the required ones that are missing are named, all of
            /// them.
            ///
            /// # Safety
            /// `lib` must be the CANN library these declarations follow (the symbols must have
            /// the declared types).
            pub unsafe fn resolve(lib: &$crate::libloading::Library) -> Result<Self, Vec<String>> {
                let mut missing = Vec::new();
                $(let $name = lib
                    .get(concat!(stringify!($name), "\0").as_bytes())
                    .map(|f| *f)
                    .map_err(|_| missing.push(stringify!($name).to_string()));)*
                if !missing.is_empty() {
                    return Err(missing);
                }
                Ok(Functions {
                    $($name: $name.expect("resolved above"),)*
                    $($($oname: lib
                        .get(concat!(stringify!($oname), "\0").as_bytes())
                        .map(|f| *f)
                        .ok(),)*)?
                })
            }
        }

        /// Every function declared here (optional ones too), as `(name, return type,
        /// parameter types)` in Rust syntax, for the header check.
        pub const FUNCTIONS: &[(&str, &str, &[&str])] = &[
            $((stringify!($name), stringify!($ret), &[$(stringify!($ty)),*]),)*
            $($((stringify!($oname), stringify!($oret), &[$(stringify!($oty)),*]),)*)?
        ];
    };
}

cann_functions! {
    /// Initialise the runtime (`config_path` may be null).
    fn aclInit(config_path: *const c_char) -> aclError;
    /// Release the runtime.
    fn aclFinalize() -> aclError;
    /// The calling thread's most recent error message.
    fn aclGetRecentErrMsg() -> *const c_char;
    /// The SoC's name, e.g. "Ascend910B1".
    fn aclrtGetSocName() -> *const c_char;
    /// The version of an installed CANN package.
    fn aclsysGetCANNVersion(name: aclCANNPackageName, version: *mut aclCANNPackageVersion) -> aclError;
    /// The number of devices.
    fn aclrtGetDeviceCount(count: *mut u32) -> aclError;
    /// Bind a device to the calling thread (creating its default context).
    fn aclrtSetDevice(device_id: i32) -> aclError;
    /// Release the calling thread's binding of a device.
    fn aclrtResetDevice(device_id: i32) -> aclError;
    /// Free and total memory of a kind on the current device.
    fn aclrtGetMemInfo(attr: aclrtMemAttr, free: *mut usize, total: *mut usize) -> aclError;
    /// Create a stream on the current device.
    fn aclrtCreateStream(stream: *mut aclrtStream) -> aclError;
    /// Destroy a stream.
    fn aclrtDestroyStream(stream: aclrtStream) -> aclError;
    /// Wait until a stream's work is done.
    fn aclrtSynchronizeStream(stream: aclrtStream) -> aclError;
    /// Allocate device memory (not zeroed).
    fn aclrtMalloc(dev_ptr: *mut *mut c_void, size: usize, policy: aclrtMemMallocPolicy) -> aclError;
    /// Free device memory.
    fn aclrtFree(dev_ptr: *mut c_void) -> aclError;
    /// Copy synchronously (no implicit stream synchronisation).
    fn aclrtMemcpy(dst: *mut c_void, dest_max: usize, src: *const c_void, count: usize, kind: aclrtMemcpyKind) -> aclError;
    /// Set `count` bytes to `value` in stream order.
    fn aclrtMemsetAsync(dev_ptr: *mut c_void, max_count: usize, value: i32, count: usize, stream: aclrtStream) -> aclError;
    /// Copy in stream order.
    fn aclrtMemcpyAsync(dst: *mut c_void, dest_max: usize, src: *const c_void, count: usize, kind: aclrtMemcpyKind, stream: aclrtStream) -> aclError;
}

/// Where `libascendcl.so` is looked for, in order: CANN's environment (`set_env.sh` sets
/// `ASCEND_TOOLKIT_HOME` and `ASCEND_HOME_PATH`), its default install directories, then the
/// plain soname (the dynamic loader's own search, `LD_LIBRARY_PATH` included).
pub fn candidates(library: &str) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = ["ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH"]
        .iter()
        .filter_map(std::env::var_os)
        .map(|home| Path::new(&home).join("lib64"))
        .collect();
    dirs.push("/usr/local/Ascend/ascend-toolkit/latest/lib64".into());
    dirs.push("/usr/local/Ascend/cann/lib64".into());
    let mut paths: Vec<PathBuf> = dirs.iter().map(|d| d.join(library)).collect();
    paths.push(library.into());
    paths
}

/// Why the runtime could not be loaded.
#[derive(Debug)]
pub enum LoadError {
    /// No candidate could be opened: each path with the loader's reason.
    NotFound {
        /// The library's file name.
        library: String,
        /// `(path, why it failed)` in search order.
        tried: Vec<(PathBuf, String)>,
    },
    /// The library opened but lacks functions mindkit needs.
    MissingSymbol {
        /// The file opened.
        path: PathBuf,
        /// The functions.
        symbols: Vec<String>,
    },
}

impl std::fmt::Display for LoadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LoadError::NotFound { library, tried } => {
                writeln!(f, "CANN's {library} was not found; looked in:")?;
                for (path, why) in tried {
                    let path = path.display().to_string();
                    // dlopen's message usually names the path already
                    if why.contains(&path) {
                        writeln!(f, "  {why}")?;
                    } else {
                        writeln!(f, "  {path}: {why}")?;
                    }
                }
                write!(
                    f,
                    "install CANN (ascend-toolkit) and run `source /usr/local/Ascend/ascend-toolkit/set_env.sh`, \
                     or set ASCEND_TOOLKIT_HOME to the toolkit's directory"
                )
            }
            LoadError::MissingSymbol { path, symbols } => write!(
                f,
                "{} has no function {}: this CANN is older than mindkit needs (8.1.RC1 or newer)",
                path.display(),
                symbols.join(", ")
            ),
        }
    }
}

impl std::error::Error for LoadError {}

/// A CANN library opened and its functions resolved.
pub struct Loaded<F> {
    /// The file that was loaded.
    pub path: PathBuf,
    /// Its functions.
    pub api: F,
    _library: libloading::Library,
}

/// Open `library` from the first of [`candidates`] that opens and resolve its functions.
///
/// # Safety
/// `resolve` must only declare functions the CANN library `library` exports, with their types.
pub unsafe fn open<F>(
    library: &str,
    resolve: unsafe fn(&libloading::Library) -> Result<F, Vec<String>>,
) -> Result<Loaded<F>, LoadError> {
    let mut tried = Vec::new();
    for path in candidates(library) {
        // SAFETY: loading a CANN library runs its initialisers, which is what using it means.
        match unsafe { libloading::Library::new(&path) } {
            Ok(lib) => {
                // SAFETY: the caller's declarations follow this library's headers.
                let api = unsafe { resolve(&lib) }.map_err(|symbols| LoadError::MissingSymbol {
                    path: path.clone(),
                    symbols,
                })?;
                return Ok(Loaded {
                    path,
                    api,
                    _library: lib,
                });
            }
            Err(e) => tried.push((path, loader_reason(&e))),
        }
    }
    Err(LoadError::NotFound {
        library: library.into(),
        tried,
    })
}

/// The loaded AscendCL runtime.
pub type Acl = Loaded<Functions>;

/// Load `libascendcl.so` (see [`candidates`]).
pub fn load() -> Result<Acl, LoadError> {
    // SAFETY: the declarations above follow CANN's acl/*.h (checked by the header test).
    unsafe { open("libascendcl.so", Functions::resolve) }
}

/// The dynamic loader's message without libloading's prefix.
fn loader_reason(e: &libloading::Error) -> String {
    use std::error::Error;
    e.source().map_or_else(|| e.to_string(), |s| s.to_string())
}
