//! The aclnn object model (`libnnopbase.so`): tensor, scalar, int-array and tensor-list
//! descriptors, executors, and the two phases every operator goes through — phase 1 checks its
//! arguments and copies what it needs into an executor ([`phase1`], [`Plan`]), the launch
//! checks the executor, workspace and stream and runs the operator on host memory
//! ([`launch`]). Descriptors and executors live in the runtime's state, so that `aclFinalize`
//! reports those never destroyed.

use crate::view::{dtype_name, element_size, View, ACL_DOUBLE};
use crate::{fail, lock, with_device, Runtime};
use ascendcl_sys::aclnn::{
    aclBoolArray, aclIntArray, aclOpExecutor, aclScalar, aclTensor, aclTensorList, aclnnStatus,
};
use ascendcl_sys::{
    aclDataType, aclFormat, aclrtStream, ACL_BF16, ACL_BOOL, ACL_FLOAT, ACL_FLOAT16, ACL_FORMAT_ND,
    ACL_INT32, ACL_INT64,
};
use std::collections::{BTreeMap, BTreeSet};
use std::ffi::{c_char, c_void, CStr};
use std::fmt::Display;

pub(crate) const ACLNN_SUCCESS: aclnnStatus = 0;
pub(crate) const ACLNN_ERR_PARAM_NULLPTR: aclnnStatus = 161001;
pub(crate) const ACLNN_ERR_PARAM_INVALID: aclnnStatus = 161002;
pub(crate) const ACLNN_ERR_RUNTIME_ERROR: aclnnStatus = 361001;

/// A descriptor, its heap address the handle the caller holds.
pub(crate) enum Object {
    /// `owner`: the list that took it over, if any.
    Tensor {
        view: View,
        owner: Option<usize>,
    },
    Scalar(f64),
    IntArray(Vec<i64>),
    BoolArray(Vec<bool>),
    TensorList(Vec<usize>),
}

impl Object {
    fn kind(&self) -> &'static str {
        match self {
            Object::Tensor { .. } => "aclTensor",
            Object::Scalar(_) => "aclScalar",
            Object::IntArray(_) => "aclIntArray",
            Object::BoolArray(_) => "aclBoolArray",
            Object::TensorList(_) => "aclTensorList",
        }
    }
}

/// What an operator does at launch, on the views it captured; an error is a runtime failure.
pub(crate) type Kernel = Box<dyn Fn() -> Result<(), String> + Send>;

/// What phase 1 prepared for one launch (or many, once repeatable).
pub(crate) struct Executor {
    op: &'static str,
    workspace: u64,
    inputs: Vec<View>,
    outputs: Vec<View>,
    kernel: Kernel,
    repeatable: bool,
}

/// aclnn's part of the runtime's state.
#[derive(Default)]
pub(crate) struct State {
    inits: u32,
    objects: BTreeMap<usize, Box<Object>>,
    executors: BTreeMap<usize, Box<Executor>>,
    /// Executors consumed by their launch, to tell a second launch from a stray pointer.
    consumed: BTreeSet<usize>,
}

impl State {
    /// What is still alive at `aclFinalize`, or None.
    pub(crate) fn leaks(&self) -> Option<String> {
        let mut kinds: BTreeMap<&str, usize> = BTreeMap::new();
        // a list's tensors go with the list
        let loose = self
            .objects
            .values()
            .filter(|o| !matches!(o.as_ref(), Object::Tensor { owner: Some(_), .. }));
        loose.for_each(|o| *kinds.entry(o.kind()).or_default() += 1);
        let ops: Vec<&str> = self.executors.values().map(|e| e.op).collect();
        let mut parts = Vec::new();
        if !kinds.is_empty() {
            let counts: Vec<String> = kinds.iter().map(|(k, n)| format!("{n} {k}")).collect();
            parts.push(format!(
                "descriptors never destroyed: {}",
                counts.join(", ")
            ));
        }
        if !ops.is_empty() {
            parts.push(format!(
                "{} executors never launched or destroyed: {}",
                ops.len(),
                ops.join(", ")
            ));
        }
        (!parts.is_empty()).then(|| parts.join("; "))
    }

    fn insert(&mut self, object: Object) -> usize {
        let boxed = Box::new(object);
        let handle = &*boxed as *const Object as usize;
        let owned = match &*boxed {
            Object::TensorList(tensors) => tensors.clone(),
            _ => Vec::new(),
        };
        self.objects.insert(handle, boxed);
        // a list owns its tensors from now on
        for t in owned {
            if let Some(Object::Tensor { owner, .. }) = self.objects.get_mut(&t).map(|b| &mut **b) {
                *owner = Some(handle);
            }
        }
        handle
    }

    /// The live object `handle` of `kind`, or an error naming what it is instead.
    fn get(&self, handle: usize, kind: &str, what: &str) -> Result<&Object, aclnnStatus> {
        match self.objects.get(&handle) {
            Some(o) if o.kind() == kind => Ok(&**o),
            Some(o) => Err(format!(
                "{what} {handle:#x} is an {}, not an {kind}",
                o.kind()
            )),
            None => Err(format!("{what} {handle:#x} is not a live {kind}")),
        }
        .map_err(|m| fail(ACLNN_ERR_PARAM_INVALID, m))
    }
}

/// A copy of `n` C elements at `p` (which may be NULL only when `n` is 0).
fn c_array<T: Copy>(p: *const T, n: u64, what: &str) -> Result<Vec<T>, aclnnStatus> {
    if n == 0 {
        return Ok(Vec::new());
    }
    if p.is_null() {
        return Err(fail(ACLNN_ERR_PARAM_NULLPTR, format!("{what} is NULL")));
    }
    // SAFETY: the caller's array of `n` elements, as the API requires.
    Ok(unsafe { std::slice::from_raw_parts(p, n as usize) }.to_vec())
}

/// Run `f` on the initialised runtime; `call` names it in the error otherwise.
fn initialised<T>(
    call: &str,
    f: impl FnOnce(&mut Runtime) -> Result<T, aclnnStatus>,
) -> Result<T, aclnnStatus> {
    let mut guard = lock();
    match guard.as_mut().filter(|rt| rt.inits > 0) {
        Some(rt) => f(rt),
        None => Err(fail(
            ACLNN_ERR_RUNTIME_ERROR,
            format!("{call} before aclInit"),
        )),
    }
}

/// Create a descriptor with what `make` returns (NULL and a message on failure).
fn create<T>(call: &str, make: impl FnOnce(&mut Runtime) -> Result<Object, aclnnStatus>) -> *mut T {
    let made = initialised(call, |rt| {
        let object = make(rt)?;
        Ok(rt.aclnn.insert(object))
    });
    made.map_or(std::ptr::null_mut(), |h| h as *mut T)
}

/// The product of `dims`, None on overflow.
fn numel(dims: &[usize]) -> Option<usize> {
    dims.iter().try_fold(1usize, |n, &d| n.checked_mul(d))
}

fn non_negative(values: &[i64], what: &str) -> Result<Vec<usize>, String> {
    values
        .iter()
        .map(|&v| usize::try_from(v).map_err(|_| format!("{what} {values:?} has a negative value")))
        .collect()
}

/// The view `aclCreateTensor` describes, checked against the contract.
#[allow(clippy::too_many_arguments)]
fn tensor_view(
    rt: &mut Runtime,
    dims: &[i64],
    dtype: aclDataType,
    strides: &[i64],
    offset: i64,
    format: aclFormat,
    storage: &[i64],
    data: usize,
) -> Result<View, String> {
    let Some(size) = element_size(dtype) else {
        return Err(format!(
            "{} is not a dtype the stand-in supports",
            dtype_name(dtype)
        ));
    };
    if format != ACL_FORMAT_ND {
        return Err(format!(
            "format {format} is not ACL_FORMAT_ND (2), the only one supported"
        ));
    }
    let dims = non_negative(dims, "viewDims")?;
    let strides = non_negative(strides, "strides")?;
    let storage = non_negative(storage, "storageDims")?;
    let offset = usize::try_from(offset).map_err(|_| format!("offset {offset} is negative"))?;
    let too_big = || "the sizes overflow".to_string();
    let view_numel = numel(&dims).ok_or_else(too_big)?;
    let storage_numel = numel(&storage).ok_or_else(too_big)?;
    let storage_bytes = storage_numel.checked_mul(size).ok_or_else(too_big)?;
    if view_numel > 0 {
        let last = dims.iter().zip(&strides).try_fold(offset, |at, (&d, &s)| {
            (d - 1).checked_mul(s).and_then(|x| x.checked_add(at))
        });
        if last.is_none_or(|l| l >= storage_numel) {
            return Err(format!(
                "view {dims:?} strides {strides:?} offset {offset} is outside its storage of {storage_numel} elements"
            ));
        }
    }
    if data == 0 && (view_numel > 0 || storage_numel > 0) {
        return Err("tensorData is NULL for a tensor that is not empty".into());
    }
    if !data.is_multiple_of(32) {
        return Err(format!("tensorData {data:#x} is not 32-byte aligned"));
    }
    if data != 0 {
        rt.region(data, storage_bytes, "tensorData")
            .map_err(|_| crate::recent_message())?;
    }
    Ok(View {
        dims,
        strides,
        offset,
        dtype,
        data,
        storage_bytes,
    })
}

#[no_mangle]
pub extern "C" fn aclCreateTensor(
    view_dims: *const i64,
    view_dims_num: u64,
    data_type: aclDataType,
    stride: *const i64,
    offset: i64,
    format: aclFormat,
    storage_dims: *const i64,
    storage_dims_num: u64,
    tensor_data: *mut c_void,
) -> *mut aclTensor {
    create("aclCreateTensor", |rt| {
        let invalid = |m: String| fail(ACLNN_ERR_PARAM_INVALID, format!("aclCreateTensor: {m}"));
        if view_dims_num > 8 || storage_dims_num > 8 {
            return Err(invalid(format!(
                "{view_dims_num} view or {storage_dims_num} storage dimensions (at most 8)"
            )));
        }
        let dims = c_array(view_dims, view_dims_num, "aclCreateTensor: viewDims")?;
        let strides = c_array(stride, view_dims_num, "aclCreateTensor: strides")?;
        let storage = c_array(
            storage_dims,
            storage_dims_num,
            "aclCreateTensor: storageDims",
        )?;
        let data = tensor_data as usize;
        let view = tensor_view(
            rt, &dims, data_type, &strides, offset, format, &storage, data,
        )
        .map_err(invalid)?;
        Ok(Object::Tensor { view, owner: None })
    })
}

#[no_mangle]
pub extern "C" fn aclCreateScalar(value: *mut c_void, data_type: aclDataType) -> *mut aclScalar {
    create("aclCreateScalar", |_| {
        if value.is_null() {
            return Err(fail(
                ACLNN_ERR_PARAM_NULLPTR,
                "aclCreateScalar: value is NULL".into(),
            ));
        }
        use std::ptr::read_unaligned as rd;
        // SAFETY: the caller's host value of `data_type`.
        let v = unsafe {
            match data_type {
                ACL_FLOAT => f64::from(rd(value as *const f32)),
                ACL_DOUBLE => rd(value as *const f64),
                ACL_FLOAT16 => f64::from(rd(value as *const half::f16)),
                ACL_BF16 => f64::from(rd(value as *const half::bf16)),
                ACL_INT32 => f64::from(rd(value as *const i32)),
                ACL_INT64 => rd(value as *const i64) as f64,
                ACL_BOOL => f64::from(u8::from(rd(value as *const u8) != 0)),
                other => {
                    return Err(fail(
                        ACLNN_ERR_PARAM_INVALID,
                        format!(
                            "aclCreateScalar: {} is not a scalar dtype",
                            dtype_name(other)
                        ),
                    ))
                }
            }
        };
        Ok(Object::Scalar(v))
    })
}

#[no_mangle]
pub extern "C" fn aclCreateIntArray(value: *const i64, size: u64) -> *mut aclIntArray {
    create("aclCreateIntArray", |_| {
        Ok(Object::IntArray(c_array(
            value,
            size,
            "aclCreateIntArray: value",
        )?))
    })
}

#[no_mangle]
pub extern "C" fn aclCreateBoolArray(value: *const bool, size: u64) -> *mut aclBoolArray {
    create("aclCreateBoolArray", |_| {
        Ok(Object::BoolArray(c_array(
            value,
            size,
            "aclCreateBoolArray: value",
        )?))
    })
}

#[no_mangle]
pub extern "C" fn aclCreateTensorList(
    value: *const *const aclTensor,
    size: u64,
) -> *mut aclTensorList {
    create("aclCreateTensorList", |rt| {
        let handles = c_array(value, size, "aclCreateTensorList: value")?;
        let handles: Vec<usize> = handles.into_iter().map(|p| p as usize).collect();
        for (i, &h) in handles.iter().enumerate() {
            let what = format!("aclCreateTensorList: tensor {i}");
            let owned = matches!(
                rt.aclnn.get(h, "aclTensor", &what)?,
                Object::Tensor { owner: Some(_), .. }
            );
            if owned || handles[..i].contains(&h) {
                return Err(fail(
                    ACLNN_ERR_PARAM_INVALID,
                    format!("{what} already belongs to a list"),
                ));
            }
        }
        Ok(Object::TensorList(handles))
    })
}

/// Destroy the descriptor `handle` of `kind` (a list with its tensors).
fn destroy(kind: &'static str, handle: usize) -> aclnnStatus {
    let call = format!("aclDestroy{}", &kind[3..]);
    let done = initialised(&call, |rt| {
        let state = &mut rt.aclnn;
        match state.get(handle, kind, &call)? {
            Object::Tensor {
                owner: Some(list), ..
            } => {
                return Err(fail(
                    ACLNN_ERR_PARAM_INVALID,
                    format!(
                    "{call}: {handle:#x} belongs to the aclTensorList {list:#x}, which destroys it"
                ),
                ))
            }
            Object::TensorList(tensors) => {
                for t in tensors.clone() {
                    state.objects.remove(&t);
                }
            }
            _ => {}
        }
        state.objects.remove(&handle);
        Ok(())
    });
    done.err().unwrap_or(ACLNN_SUCCESS)
}

#[no_mangle]
pub extern "C" fn aclDestroyTensor(tensor: *const aclTensor) -> aclnnStatus {
    destroy("aclTensor", tensor as usize)
}

#[no_mangle]
pub extern "C" fn aclDestroyScalar(scalar: *const aclScalar) -> aclnnStatus {
    destroy("aclScalar", scalar as usize)
}

#[no_mangle]
pub extern "C" fn aclDestroyIntArray(array: *const aclIntArray) -> aclnnStatus {
    destroy("aclIntArray", array as usize)
}

#[no_mangle]
pub extern "C" fn aclDestroyBoolArray(array: *const aclBoolArray) -> aclnnStatus {
    destroy("aclBoolArray", array as usize)
}

#[no_mangle]
pub extern "C" fn aclDestroyTensorList(array: *const aclTensorList) -> aclnnStatus {
    destroy("aclTensorList", array as usize)
}

/// Run `f` on the live executor `executor`.
fn with_executor(
    call: &str,
    executor: *mut aclOpExecutor,
    f: impl FnOnce(&mut State, usize) -> Result<(), aclnnStatus>,
) -> aclnnStatus {
    let h = executor as usize;
    let done = initialised(call, |rt| {
        if !rt.aclnn.executors.contains_key(&h) {
            let why = if rt.aclnn.consumed.contains(&h) {
                "was consumed by its launch"
            } else {
                "is not a live aclOpExecutor"
            };
            return Err(fail(
                ACLNN_ERR_PARAM_INVALID,
                format!("{call}: {executor:?} {why}"),
            ));
        }
        f(&mut rt.aclnn, h)
    });
    done.err().unwrap_or(ACLNN_SUCCESS)
}

#[no_mangle]
pub extern "C" fn aclSetAclOpExecutorRepeatable(executor: *mut aclOpExecutor) -> aclnnStatus {
    with_executor("aclSetAclOpExecutorRepeatable", executor, |s, h| {
        if let Some(e) = s.executors.get_mut(&h) {
            e.repeatable = true;
        }
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn aclDestroyAclOpExecutor(executor: *mut aclOpExecutor) -> aclnnStatus {
    with_executor("aclDestroyAclOpExecutor", executor, |s, h| {
        s.executors.remove(&h);
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn aclnnInit(_config_path: *const c_char) -> aclnnStatus {
    let done = initialised("aclnnInit", |rt| {
        rt.aclnn.inits += 1;
        Ok(())
    });
    done.err().unwrap_or(ACLNN_SUCCESS)
}

#[no_mangle]
pub extern "C" fn aclnnFinalize() -> aclnnStatus {
    let done = initialised("aclnnFinalize", |rt| match rt.aclnn.inits {
        0 => Err(fail(
            ACLNN_ERR_RUNTIME_ERROR,
            "aclnnFinalize without aclnnInit".into(),
        )),
        _ => {
            rt.aclnn.inits -= 1;
            Ok(())
        }
    });
    done.err().unwrap_or(ACLNN_SUCCESS)
}

/// Phase 1 of operator `op`: the descriptors it was given, checked, and the views it captured.
pub(crate) struct Plan<'a> {
    pub op: &'static str,
    state: &'a State,
    inputs: Vec<View>,
    outputs: Vec<View>,
}

/// `return Err(plan.invalid(…))` unless `cond`.
macro_rules! ensure {
    ($plan:expr, $cond:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err($plan.invalid(format!($($fmt)+)));
        }
    };
}
pub(crate) use ensure;

impl Plan<'_> {
    /// ACLNN_ERR_PARAM_INVALID with `message` about this operator.
    pub fn invalid(&self, message: impl Display) -> aclnnStatus {
        fail(ACLNN_ERR_PARAM_INVALID, format!("{}: {message}", self.op))
    }

    /// The live object at `p` of `kind`, None for NULL.
    fn object(&self, p: usize, kind: &str, name: &str) -> Result<Option<&Object>, aclnnStatus> {
        if p == 0 {
            return Ok(None);
        }
        self.state
            .get(p, kind, &format!("{}: {name}", self.op))
            .map(Some)
    }

    fn required<T>(&self, found: Option<T>, name: &str) -> Result<T, aclnnStatus> {
        found.ok_or_else(|| {
            fail(
                ACLNN_ERR_PARAM_NULLPTR,
                format!("{}: {name} is NULL", self.op),
            )
        })
    }

    fn view(&self, p: *const aclTensor, name: &str) -> Result<Option<View>, aclnnStatus> {
        Ok(match self.object(p as usize, "aclTensor", name)? {
            Some(Object::Tensor { view, .. }) => Some(view.clone()),
            _ => None,
        })
    }

    pub fn opt_input(
        &mut self,
        p: *const aclTensor,
        name: &str,
    ) -> Result<Option<View>, aclnnStatus> {
        let view = self.view(p, name)?;
        self.inputs.extend(view.clone());
        Ok(view)
    }

    pub fn input(&mut self, p: *const aclTensor, name: &str) -> Result<View, aclnnStatus> {
        let view = self.opt_input(p, name)?;
        self.required(view, name)
    }

    pub fn opt_output(
        &mut self,
        p: *const aclTensor,
        name: &str,
    ) -> Result<Option<View>, aclnnStatus> {
        let view = self.view(p, name)?;
        self.outputs.extend(view.clone());
        Ok(view)
    }

    pub fn output(&mut self, p: *const aclTensor, name: &str) -> Result<View, aclnnStatus> {
        let view = self.opt_output(p, name)?;
        self.required(view, name)
    }

    /// A tensor the stand-in does not implement: it must be NULL.
    pub fn absent<T>(&self, p: *const T, name: &str) -> Result<(), aclnnStatus> {
        ensure!(
            self,
            p.is_null(),
            "{name} is not supported by the stand-in (pass NULL)"
        );
        Ok(())
    }

    /// An unused tensor: NULL or empty.
    pub fn unused(&self, p: *const aclTensor, name: &str) -> Result<(), aclnnStatus> {
        let n = self.view(p, name)?.map_or(0, |v| v.numel());
        ensure!(
            self,
            n == 0,
            "{name} is unused and must be NULL or an empty tensor"
        );
        Ok(())
    }

    pub fn scalar(&self, p: *const aclScalar, name: &str) -> Result<f64, aclnnStatus> {
        match self.object(p as usize, "aclScalar", name)? {
            Some(Object::Scalar(v)) => Ok(*v),
            _ => self.required(None, name),
        }
    }

    pub fn int_array(&self, p: *const aclIntArray, name: &str) -> Result<Vec<i64>, aclnnStatus> {
        match self.object(p as usize, "aclIntArray", name)? {
            Some(Object::IntArray(v)) => Ok(v.clone()),
            _ => self.required(None, name),
        }
    }

    /// A bool array's values.
    pub fn bool_array(&self, p: *const aclBoolArray, name: &str) -> Result<Vec<bool>, aclnnStatus> {
        match self.object(p as usize, "aclBoolArray", name)? {
            Some(Object::BoolArray(v)) => Ok(v.clone()),
            _ => self.required(None, name),
        }
    }

    /// The views of a tensor list, as inputs or outputs.
    pub fn list(
        &mut self,
        p: *const aclTensorList,
        name: &str,
        output: bool,
    ) -> Result<Vec<View>, aclnnStatus> {
        let Some(Object::TensorList(handles)) = self.object(p as usize, "aclTensorList", name)?
        else {
            return self.required(None, name);
        };
        let views: Vec<View> = handles
            .iter()
            .filter_map(|h| match self.state.objects.get(h).map(|b| &**b) {
                Some(Object::Tensor { view, .. }) => Some(view.clone()),
                _ => None,
            })
            .collect();
        let side = if output {
            &mut self.outputs
        } else {
            &mut self.inputs
        };
        side.extend(views.iter().cloned());
        Ok(views)
    }

    /// A C string argument (`default` when NULL).
    pub fn string(&self, p: *const c_char, default: &str) -> String {
        if p.is_null() {
            return default.into();
        }
        // SAFETY: the caller's NUL-terminated string.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    pub fn float(&self, v: &View, name: &str) -> Result<(), aclnnStatus> {
        ensure!(
            self,
            v.is_float(),
            "{name} is {}, not FLOAT, FLOAT16 or BF16",
            dtype_name(v.dtype)
        );
        Ok(())
    }

    pub fn index(&self, v: &View, name: &str) -> Result<(), aclnnStatus> {
        ensure!(
            self,
            v.is_index(),
            "{name} is {}, not INT64 or INT32",
            dtype_name(v.dtype)
        );
        Ok(())
    }

    /// `v` has `dtype`.
    pub fn dtype(&self, v: &View, name: &str, dtype: aclDataType) -> Result<(), aclnnStatus> {
        ensure!(
            self,
            v.dtype == dtype,
            "{name} is {}, not {}",
            dtype_name(v.dtype),
            dtype_name(dtype)
        );
        Ok(())
    }

    /// `v` has `dims`.
    pub fn shape(&self, v: &View, name: &str, dims: &[usize]) -> Result<(), aclnnStatus> {
        ensure!(
            self,
            v.dims == dims,
            "{name} {:?} should be {dims:?}",
            v.dims
        );
        Ok(())
    }

    /// `v` has `like`'s shape and dtype.
    pub fn like(&self, v: &View, name: &str, like: &View) -> Result<(), aclnnStatus> {
        self.shape(v, name, &like.dims)?;
        self.dtype(v, name, like.dtype)
    }
}

/// aclnn's status when an operator has no kernel for the SoC (as a CANN whose op package lacks
/// it answers).
const ACLNN_ERR_INNER_FIND_KERNEL_ERROR: aclnnStatus = 561003;

/// Whether `MINDKIT_STAND_IN_NO_KERNEL` (operator names, comma-separated) lists `op`, to play a
/// CANN that lacks it.
fn without_kernel(op: &str) -> bool {
    std::env::var("MINDKIT_STAND_IN_NO_KERNEL")
        .is_ok_and(|ops| ops.split(',').any(|o| o.trim() == op))
}

/// Phase 1 of `op`: `build` checks the arguments and returns the workspace size and kernel;
/// the executor is written to `executor_out`.
pub(crate) fn phase1(
    op: &'static str,
    workspace_out: *mut u64,
    executor_out: *mut *mut aclOpExecutor,
    build: impl FnOnce(&mut Plan) -> Result<(u64, Kernel), aclnnStatus>,
) -> aclnnStatus {
    let call = format!("{op}GetWorkspaceSize");
    let done = initialised(&call, |rt| {
        if rt.aclnn.inits == 0 {
            return Err(fail(
                ACLNN_ERR_RUNTIME_ERROR,
                format!("{call} before aclnnInit"),
            ));
        }
        if workspace_out.is_null() || executor_out.is_null() {
            return Err(fail(
                ACLNN_ERR_PARAM_NULLPTR,
                format!("{call}: workspaceSize or executor is NULL"),
            ));
        }
        if without_kernel(op) {
            return Err(fail(
                ACLNN_ERR_INNER_FIND_KERNEL_ERROR,
                format!("{call}: no kernel of {op} for this SoC (MINDKIT_STAND_IN_NO_KERNEL)"),
            ));
        }
        let mut plan = Plan {
            op,
            state: &rt.aclnn,
            inputs: Vec::new(),
            outputs: Vec::new(),
        };
        let (workspace, kernel) = build(&mut plan)?;
        let Plan {
            inputs, outputs, ..
        } = plan;
        let executor = Box::new(Executor {
            op,
            workspace,
            inputs,
            outputs,
            kernel,
            repeatable: false,
        });
        let handle = &*executor as *const Executor as usize;
        rt.aclnn.consumed.remove(&handle);
        rt.aclnn.executors.insert(handle, executor);
        // SAFETY: the caller's out-pointers, checked non-null.
        unsafe {
            *workspace_out = workspace;
            *executor_out = handle as *mut aclOpExecutor;
        }
        Ok(())
    });
    done.err().unwrap_or(ACLNN_SUCCESS)
}

/// The launch (phase 2) of `op`.
pub(crate) fn launch(
    op: &'static str,
    workspace: *mut c_void,
    workspace_size: u64,
    executor: *mut aclOpExecutor,
    stream: aclrtStream,
) -> aclnnStatus {
    with_device(op, |rt| {
        run(
            rt,
            op,
            workspace as usize,
            workspace_size,
            executor as usize,
            stream as usize,
        )
        .err()
        .unwrap_or(ACLNN_SUCCESS)
    })
}

fn run(
    rt: &mut Runtime,
    op: &'static str,
    ws: usize,
    ws_size: u64,
    h: usize,
    stream: usize,
) -> Result<(), aclnnStatus> {
    let invalid = |m: String| fail(ACLNN_ERR_PARAM_INVALID, format!("{op}: {m}"));
    let Some(e) = rt.aclnn.executors.get(&h) else {
        return Err(invalid(match rt.aclnn.consumed.contains(&h) {
            true => format!("executor {h:#x} already launched"),
            false => format!("executor {h:#x} is not a live aclOpExecutor"),
        }));
    };
    if e.op != op {
        return Err(invalid(format!("executor of {} launched with {op}", e.op)));
    }
    if ws_size != e.workspace {
        return Err(invalid(format!(
            "workspaceSize {ws_size} is not the {} phase 1 returned",
            e.workspace
        )));
    }
    if ws_size > 0 && rt.region(ws, ws_size as usize, "workspace").is_err() {
        return Err(invalid(crate::recent_message()));
    }
    if !rt.streams.contains(&stream) {
        return Err(invalid(format!("stream {stream:#x} is not a live stream")));
    }
    let e = rt.aclnn.executors.remove(&h).expect("checked above");
    let result = execute(rt, &e);
    if result.is_ok() {
        rt.counters.launches += 1;
        *rt.counters.ops.entry(op).or_default() += 1;
    }
    if e.repeatable {
        rt.aclnn.executors.insert(h, e);
    } else {
        rt.aclnn.consumed.insert(h);
    }
    result
}

/// Check the executor's memory is still allocated, run its kernel, mark what it wrote.
fn execute(rt: &mut Runtime, e: &Executor) -> Result<(), aclnnStatus> {
    let runtime_error = |m: String| fail(ACLNN_ERR_RUNTIME_ERROR, format!("{}: {m}", e.op));
    for v in e
        .inputs
        .iter()
        .chain(&e.outputs)
        .filter(|v| v.storage_bytes > 0)
    {
        if rt.region(v.data, v.storage_bytes, "tensor").is_err() {
            return Err(runtime_error(format!(
                "a tensor's memory at {:#x} is no longer allocated (freed between the phases?)",
                v.data
            )));
        }
    }
    (e.kernel)().map_err(runtime_error)?;
    for v in e.outputs.iter().filter(|v| v.storage_bytes > 0) {
        if let Ok(a) = rt.region(v.data, v.storage_bytes, "output") {
            a.written_async = true;
        }
    }
    Ok(())
}
