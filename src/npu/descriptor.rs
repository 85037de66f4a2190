//! aclnn descriptors of device memory and host values, each destroyed when dropped: a tensor
//! view (shape, strides and offset in elements over its storage, as `aclCreateTensor` takes
//! them), a scalar, an int64 array, a tensor list.

use super::context::Context;
use super::NpuError;
use crate::tensor::DType;
use ascendcl_sys::aclnn::{aclBoolArray, aclIntArray, aclScalar, aclTensor, aclTensorList};
use ascendcl_sys::{
    aclDataType, ACL_BF16, ACL_BOOL, ACL_DOUBLE, ACL_DT_UNDEFINED, ACL_FLOAT, ACL_FLOAT16,
    ACL_FORMAT_ND, ACL_INT16, ACL_INT32, ACL_INT64, ACL_INT8, ACL_UINT8,
};
use std::ffi::c_void;
use std::marker::PhantomData;

/// CANN's code of a dtype.
pub fn acl_dtype(dtype: DType) -> aclDataType {
    match dtype {
        DType::F32 => ACL_FLOAT,
        DType::F16 => ACL_FLOAT16,
        DType::BF16 => ACL_BF16,
        DType::I64 => ACL_INT64,
        DType::I32 => ACL_INT32,
        DType::U8 => ACL_UINT8,
        DType::Bool => ACL_BOOL,
        DType::F64 => ACL_DOUBLE,
        DType::I16 => ACL_INT16,
        DType::I8 => ACL_INT8,
        // CANN's ACL_FLOAT8_E4M3FN exists on 910C only; mindkit computes on no float8 tensor
        DType::F8E4M3 => ACL_DT_UNDEFINED,
    }
}

/// A view of device memory: `dims` with `strides` (elements) from `offset` elements after
/// `ptr`, inside a storage of `storage` elements of `dtype`.
#[derive(Debug, Clone)]
pub struct View {
    ptr: usize,
    dtype: DType,
    dims: Vec<i64>,
    strides: Vec<i64>,
    offset: i64,
    storage: i64,
}

/// Row-major strides of `dims`.
fn contiguous(dims: &[usize]) -> Vec<i64> {
    let mut strides = vec![1i64; dims.len()];
    for i in (0..dims.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * dims[i + 1] as i64;
    }
    strides
}

impl View {
    /// The whole of a `shape` tensor of `dtype` at `ptr`, row-major.
    pub fn new(ptr: usize, dtype: DType, shape: &[usize]) -> View {
        View {
            ptr,
            dtype,
            dims: shape.iter().map(|&d| d as i64).collect(),
            strides: contiguous(shape),
            offset: 0,
            storage: shape.iter().product::<usize>() as i64,
        }
    }

    /// The same storage seen as `dims` (row-major from `offset` elements).
    pub fn reshaped(&self, dims: &[usize], offset: usize) -> View {
        self.strided(dims, &contiguous(dims), offset)
    }

    /// The same storage seen as `dims` with `strides`, from `offset` elements.
    pub fn strided(&self, dims: &[usize], strides: &[i64], offset: usize) -> View {
        View {
            dims: dims.iter().map(|&d| d as i64).collect(),
            strides: strides.to_vec(),
            offset: offset as i64,
            ..self.clone()
        }
    }
}

/// An `aclTensor`, destroyed on drop.
pub struct TensorDesc<'c> {
    /// The descriptor.
    pub raw: *mut aclTensor,
    ctx: &'c Context,
}

impl Drop for TensorDesc<'_> {
    fn drop(&mut self) {
        // SAFETY: created by aclCreateTensor and not owned by a list (see `list`).
        unsafe { (self.ctx.nn.aclDestroyTensor)(self.raw) };
    }
}

/// A host value or array given to an operator, destroyed on drop.
pub struct HostDesc<'c, T> {
    /// The descriptor.
    pub raw: *mut T,
    destroy: unsafe extern "C" fn(*const T) -> i32,
    /// The descriptor lives no longer than the loaded library its `destroy` belongs to.
    _ctx: PhantomData<&'c Context>,
}

impl<T> Drop for HostDesc<'_, T> {
    fn drop(&mut self) {
        // SAFETY: created by the matching aclCreate* function.
        unsafe { (self.destroy)(self.raw) };
    }
}

impl Context {
    /// The descriptor of `view`.
    pub fn tensor(&self, view: &View) -> Result<TensorDesc<'_>, NpuError> {
        let storage = [view.storage];
        // SAFETY: the arrays outlive the call (aclCreateTensor copies them); `ptr` is device
        // memory of at least `storage` elements.
        let raw = unsafe {
            (self.nn.aclCreateTensor)(
                view.dims.as_ptr(),
                view.dims.len() as u64,
                acl_dtype(view.dtype),
                view.strides.as_ptr(),
                view.offset,
                ACL_FORMAT_ND,
                storage.as_ptr(),
                1,
                view.ptr as *mut c_void,
            )
        };
        self.created("aclCreateTensor", raw)?;
        Ok(TensorDesc { raw, ctx: self })
    }

    /// A float scalar (fp32).
    pub fn scalar(&self, value: f32) -> Result<HostDesc<'_, aclScalar>, NpuError> {
        let mut v = value;
        // SAFETY: the value is copied at creation.
        let raw = unsafe { (self.nn.aclCreateScalar)((&mut v as *mut f32).cast(), ACL_FLOAT) };
        self.created("aclCreateScalar", raw)?;
        Ok(HostDesc {
            raw,
            destroy: self.nn.aclDestroyScalar,
            _ctx: PhantomData,
        })
    }

    /// An int64 array.
    pub fn int_array(&self, values: &[i64]) -> Result<HostDesc<'_, aclIntArray>, NpuError> {
        // SAFETY: the values are copied at creation.
        let raw = unsafe { (self.nn.aclCreateIntArray)(values.as_ptr(), values.len() as u64) };
        self.created("aclCreateIntArray", raw)?;
        Ok(HostDesc {
            raw,
            destroy: self.nn.aclDestroyIntArray,
            _ctx: PhantomData,
        })
    }

    /// A bool array, by the optional functions `create` and `destroy` (resolved by the
    /// caller).
    pub fn bool_array(
        &self,
        values: &[bool],
        create: unsafe extern "C" fn(*const bool, u64) -> *mut aclBoolArray,
        destroy: unsafe extern "C" fn(*const aclBoolArray) -> i32,
    ) -> Result<HostDesc<'_, aclBoolArray>, NpuError> {
        // SAFETY: the values are copied at creation.
        let raw = unsafe { create(values.as_ptr(), values.len() as u64) };
        self.created("aclCreateBoolArray", raw)?;
        Ok(HostDesc {
            raw,
            destroy,
            _ctx: PhantomData,
        })
    }

    /// A list owning the descriptors of `views`.
    pub fn list(&self, views: &[View]) -> Result<HostDesc<'_, aclTensorList>, NpuError> {
        let descs = views
            .iter()
            .map(|v| self.tensor(v))
            .collect::<Result<Vec<_>, _>>()?;
        let raws: Vec<*const aclTensor> = descs.iter().map(|d| d.raw.cast_const()).collect();
        // SAFETY: every descriptor is live; the list takes ownership of them.
        let raw = unsafe { (self.nn.aclCreateTensorList)(raws.as_ptr(), raws.len() as u64) };
        self.created("aclCreateTensorList", raw)?;
        // The list destroys them now.
        descs.into_iter().for_each(std::mem::forget);
        Ok(HostDesc {
            raw,
            destroy: self.nn.aclDestroyTensorList,
            _ctx: PhantomData,
        })
    }

    /// An error with the runtime's message when a creation returned null.
    fn created<T>(&self, call: &'static str, raw: *mut T) -> Result<(), NpuError> {
        if !raw.is_null() {
            return Ok(());
        }
        Err(NpuError::Call {
            call,
            code: 161002,
            message: self.recent_error(),
        })
    }
}
