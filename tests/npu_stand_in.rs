//! The CANN stand-in's aclnn side, in this process: the object model's and the two phases'
//! rules (what the stand-in refuses, with the message it gives) and the numerics of a few
//! operators against naive computations here. The stand-in's state is process-global, so each
//! test holds [`SERIAL`] from `aclInit` to `aclFinalize`.

mod common;

use ascendcl_sys::aclnn::{aclOpExecutor, aclTensor, nnopbase, opapi};
use ascendcl_sys::*;
use std::ffi::{c_void, CStr};
use std::ptr::null_mut;
use std::sync::{Mutex, MutexGuard};

static SERIAL: Mutex<()> = Mutex::new(());

type Launch = unsafe extern "C" fn(*mut c_void, u64, *mut aclOpExecutor, aclrtStream) -> i32;

/// The stand-in loaded here, initialised with device 0, aclnn and one stream.
struct Cann {
    acl: ascendcl_sys::Functions,
    nn: nnopbase::Functions,
    op: opapi::Functions,
    stream: aclrtStream,
    _library: libloading::Library,
    _serial: MutexGuard<'static, ()>,
}

impl Cann {
    fn open() -> Cann {
        let serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: the stand-in exports the three libraries' functions with ascendcl-sys's types.
        let library = unsafe { libloading::Library::new(common::stand_in()) }.unwrap();
        let (acl, nn, op) = unsafe {
            (
                ascendcl_sys::Functions::resolve(&library).unwrap(),
                nnopbase::Functions::resolve(&library).unwrap(),
                opapi::Functions::resolve(&library).unwrap(),
            )
        };
        let mut cann = Cann {
            acl,
            nn,
            op,
            stream: null_mut(),
            _library: library,
            _serial: serial,
        };
        let mut stream = null_mut();
        // SAFETY: null config paths are allowed; a valid out-pointer.
        unsafe {
            cann.ok((acl.aclInit)(std::ptr::null()));
            cann.ok((acl.aclrtSetDevice)(0));
            cann.ok((nn.aclnnInit)(std::ptr::null()));
            cann.ok((acl.aclrtCreateStream)(&mut stream));
        }
        cann.stream = stream;
        cann
    }

    /// The runtime's recent error message.
    fn message(&self) -> String {
        // SAFETY: the runtime's own NUL-terminated string.
        unsafe { CStr::from_ptr((self.acl.aclGetRecentErrMsg)()) }
            .to_string_lossy()
            .into_owned()
    }

    fn ok(&self, code: i32) {
        assert_eq!(code, 0, "{}", self.message());
    }

    /// `code` is `want` and the message says `text`.
    fn refused(&self, code: i32, want: i32, text: &str) {
        let message = self.message();
        assert!(
            code == want && message.contains(text),
            "expected {want} '{text}', got {code} '{message}'"
        );
    }

    fn malloc(&self, bytes: usize) -> *mut c_void {
        let mut ptr = null_mut();
        // SAFETY: a valid out-pointer.
        self.ok(unsafe { (self.acl.aclrtMalloc)(&mut ptr, bytes, ACL_MEM_MALLOC_HUGE_FIRST) });
        ptr
    }

    fn free(&self, ptr: *mut c_void) {
        // SAFETY: an allocation of this runtime.
        self.ok(unsafe { (self.acl.aclrtFree)(ptr) });
    }

    /// Device memory holding `bytes`.
    fn upload_bytes(&self, bytes: &[u8]) -> *mut c_void {
        let ptr = self.malloc(bytes.len().max(1));
        let h2d = ACL_MEMCPY_HOST_TO_DEVICE;
        // SAFETY: `bytes` is a host buffer of its length; the allocation is as long.
        self.ok(unsafe {
            (self.acl.aclrtMemcpy)(ptr, bytes.len(), bytes.as_ptr().cast(), bytes.len(), h2d)
        });
        ptr
    }

    fn upload(&self, values: &[f32]) -> *mut c_void {
        self.upload_bytes(
            &values
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect::<Vec<u8>>(),
        )
    }

    fn upload_i64(&self, values: &[i64]) -> *mut c_void {
        self.upload_bytes(
            &values
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect::<Vec<u8>>(),
        )
    }

    /// `n` f32 values at `ptr`, after the stream's work.
    fn download(&self, ptr: *mut c_void, n: usize) -> Vec<f32> {
        let mut bytes = vec![0u8; n * 4];
        let d2h = ACL_MEMCPY_DEVICE_TO_HOST;
        // SAFETY: a live stream; `bytes` is a host buffer of `n · 4` bytes.
        unsafe {
            self.ok((self.acl.aclrtSynchronizeStream)(self.stream));
            self.ok((self.acl.aclrtMemcpy)(
                bytes.as_mut_ptr().cast(),
                n * 4,
                ptr,
                n * 4,
                d2h,
            ));
        }
        bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect()
    }

    /// A descriptor (NULL when refused).
    fn view(
        &self,
        ptr: *mut c_void,
        dims: &[i64],
        strides: &[i64],
        offset: i64,
        dtype: i32,
        storage: i64,
    ) -> *mut aclTensor {
        // SAFETY: the arrays outlive the call, which copies them.
        unsafe {
            (self.nn.aclCreateTensor)(
                dims.as_ptr(),
                dims.len() as u64,
                dtype,
                strides.as_ptr(),
                offset,
                ACL_FORMAT_ND,
                [storage].as_ptr(),
                1,
                ptr,
            )
        }
    }

    /// A row-major descriptor of `dims` over `ptr`.
    fn tensor(&self, ptr: *mut c_void, dims: &[i64], dtype: i32) -> *mut aclTensor {
        let mut strides = vec![1i64; dims.len()];
        for d in (0..dims.len().saturating_sub(1)).rev() {
            strides[d] = strides[d + 1] * dims[d + 1];
        }
        let t = self.view(ptr, dims, &strides, 0, dtype, dims.iter().product());
        assert!(!t.is_null(), "{}", self.message());
        t
    }

    fn destroy(&self, tensors: &[*mut aclTensor]) {
        for &t in tensors {
            // SAFETY: descriptors of this runtime.
            self.ok(unsafe { (self.nn.aclDestroyTensor)(t) });
        }
    }

    /// Launch `executor` with a workspace of `size` bytes, as phase 1 asked.
    fn launch(&self, launch: Launch, size: u64, executor: *mut aclOpExecutor) {
        let workspace = if size > 0 {
            self.malloc(size as usize)
        } else {
            null_mut()
        };
        // SAFETY: the executor of phase 1, a workspace of its size, a live stream.
        self.ok(unsafe { launch(workspace, size, executor, self.stream) });
        if size > 0 {
            self.free(workspace);
        }
    }

    /// Release the stream and finalize; the result of aclFinalize.
    fn finalize(&self) -> i32 {
        // SAFETY: the stream of `open`; aclnnInit and aclInit were called there.
        unsafe {
            self.ok((self.acl.aclrtDestroyStream)(self.stream));
            self.ok((self.nn.aclnnFinalize)());
            (self.acl.aclFinalize)()
        }
    }
}

/// Row-major `[n, k] · [k, m]`.
fn matmul(a: &[f32], b: &[f32], n: usize, k: usize, m: usize) -> Vec<f32> {
    let mut c = vec![0f32; n * m];
    for i in 0..n {
        for j in 0..m {
            c[i * m + j] = (0..k).map(|l| a[i * k + l] * b[l * m + j]).sum();
        }
    }
    c
}

fn close(got: &[f32], want: &[f32], tol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * (1.0 + w.abs()),
            "{what}[{i}]: {g} vs {w}\n{got:?}\n{want:?}"
        );
    }
}

/// Deterministic values in [-1, 1).
fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let x = (i as u32)
                .wrapping_mul(2654435761)
                .wrapping_add(seed.wrapping_mul(40503));
            (x % 2000) as f32 / 1000.0 - 1.0
        })
        .collect()
}

#[test]
fn the_stand_in_refuses_what_aclnn_forbids() {
    let c = Cann::open();
    let (nn, op) = (c.nn, c.op);
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("report.json");
    std::env::set_var("MINDKIT_STAND_IN_REPORT", &report);
    let buf = c.upload(&values(16, 1));
    let (mut ws, mut ex) = (0u64, null_mut());
    // SAFETY (whole test): every pointer is a valid out-pointer, a host array of the length
    // given or a descriptor of the stand-in; the stand-in checks the device side.
    unsafe {
        // descriptors: a view outside its storage, a format other than ND, freed memory
        assert!(c.view(buf, &[4], &[1], 13, ACL_FLOAT, 16).is_null());
        c.refused(161002, 161002, "is outside its storage");
        let nz = (nn.aclCreateTensor)(
            [4i64].as_ptr(),
            1,
            ACL_FLOAT,
            [1i64].as_ptr(),
            0,
            29,
            [16i64].as_ptr(),
            1,
            buf,
        );
        assert!(nz.is_null());
        c.refused(161002, 161002, "is not ACL_FORMAT_ND");
        let freed = c.upload(&[1.0; 8]);
        c.free(freed);
        assert!(c.view(freed, &[8], &[1], 0, ACL_FLOAT, 8).is_null());
        c.refused(161002, 161002, "is not device memory");
        // destroying twice, and a destroyed tensor in phase 1
        let x = c.tensor(buf, &[4, 4], ACL_FLOAT);
        let y = c.tensor(buf, &[4, 4], ACL_FLOAT);
        c.destroy(&[y]);
        c.refused((nn.aclDestroyTensor)(y), 161002, "is not a live aclTensor");
        let two = 2.0f32;
        let s = (nn.aclCreateScalar)(&two as *const f32 as *mut c_void, ACL_FLOAT);
        c.refused(
            (op.aclnnMulsGetWorkspaceSize)(x, s, y, &mut ws, &mut ex),
            161002,
            "aclnnMuls: out",
        );
        c.refused(
            (op.aclnnMulsGetWorkspaceSize)(x, s, null_mut(), &mut ws, &mut ex),
            161001,
            "out is NULL",
        );
        // an executor launched twice
        c.ok((op.aclnnMulsGetWorkspaceSize)(x, s, x, &mut ws, &mut ex));
        assert_eq!(ws, 0, "elementwise operators need no workspace");
        c.launch(op.aclnnMuls, ws, ex);
        c.refused(
            (op.aclnnMuls)(null_mut(), 0, ex, c.stream),
            161002,
            "already launched",
        );
        // a repeatable executor launches until destroyed
        c.ok((op.aclnnMulsGetWorkspaceSize)(x, s, x, &mut ws, &mut ex));
        c.ok((nn.aclSetAclOpExecutorRepeatable)(ex));
        c.launch(op.aclnnMuls, ws, ex);
        c.launch(op.aclnnMuls, ws, ex);
        c.ok((nn.aclDestroyAclOpExecutor)(ex));
        // Matmul's workspace: a smaller size, host memory, another operator's launch
        let m = c.tensor(buf, &[4, 4], ACL_FLOAT);
        c.ok((op.aclnnMatmulGetWorkspaceSize)(
            x, m, m, 0, &mut ws, &mut ex,
        ));
        assert!(ws > 0, "Matmul asks for a workspace");
        let workspace = c.malloc(ws as usize);
        c.refused(
            (op.aclnnMatmul)(workspace, ws / 2, ex, c.stream),
            161002,
            "is not the",
        );
        let mut host = vec![0u8; ws as usize];
        c.refused(
            (op.aclnnMatmul)(host.as_mut_ptr().cast(), ws, ex, c.stream),
            161002,
            "is not device memory",
        );
        c.refused(
            (op.aclnnAdd)(workspace, ws, ex, c.stream),
            161002,
            "executor of aclnnMatmul launched with aclnnAdd",
        );
        c.ok((op.aclnnMatmul)(workspace, ws, ex, c.stream));
        c.free(workspace);
        // memory freed between the phases
        let gone = c.upload(&[1.0; 4]);
        let g = c.tensor(gone, &[4], ACL_FLOAT);
        c.ok((op.aclnnMulsGetWorkspaceSize)(g, s, g, &mut ws, &mut ex));
        c.free(gone);
        c.refused(
            (op.aclnnMuls)(null_mut(), 0, ex, c.stream),
            361001,
            "no longer allocated",
        );
        // a tensor owned by a list is destroyed with it
        let owned = c.tensor(buf, &[2], ACL_FLOAT);
        let list = (nn.aclCreateTensorList)([owned as *const aclTensor].as_ptr(), 1);
        assert!(!list.is_null(), "{}", c.message());
        c.refused(
            (nn.aclDestroyTensor)(owned),
            161002,
            "belongs to the aclTensorList",
        );
        c.ok((nn.aclDestroyTensorList)(list));
        // leaks: `x` and an executor never launched
        c.destroy(&[m, g]);
        c.ok((nn.aclDestroyScalar)(s));
        let s = (nn.aclCreateScalar)(&two as *const f32 as *mut c_void, ACL_FLOAT);
        c.ok((op.aclnnMulsGetWorkspaceSize)(x, s, x, &mut ws, &mut ex));
        c.ok((nn.aclDestroyScalar)(s));
        c.free(buf);
        let code = c.finalize();
        c.refused(code, 100000, "descriptors never destroyed: 1 aclTensor");
        c.refused(
            code,
            100000,
            "1 executors never launched or destroyed: aclnnMuls",
        );
    }
    std::env::remove_var("MINDKIT_STAND_IN_REPORT");
    let report = std::fs::read_to_string(&report).unwrap();
    assert!(report.contains("\"launches\": 4"), "{report}");
    assert!(
        report.contains("\"ops\": {\"aclnnMatmul\": 1, \"aclnnMuls\": 3}"),
        "{report}"
    );
}

#[test]
fn matmul_with_a_transposed_view_and_rms_norm_compute_what_they_should() {
    let c = Cann::open();
    let op = c.op;
    let (n, k, m) = (3usize, 5usize, 4usize);
    let (a, w) = (values(n * k, 2), values(m * k, 3));
    let (pa, pw, po) = (c.upload(&a), c.upload(&w), c.malloc(n * m * 4));
    let ta = c.tensor(pa, &[n as i64, k as i64], ACL_FLOAT);
    // mat2 = wᵀ: w [m, k] seen as [k, m] with strides (1, k)
    let tw = c.view(
        pw,
        &[k as i64, m as i64],
        &[1, k as i64],
        0,
        ACL_FLOAT,
        (m * k) as i64,
    );
    let to = c.tensor(po, &[n as i64, m as i64], ACL_FLOAT);
    let (mut ws, mut ex) = (0u64, null_mut());
    // SAFETY (whole test): descriptors of the stand-in and valid out-pointers.
    unsafe {
        c.ok((op.aclnnMatmulGetWorkspaceSize)(
            ta, tw, to, 0, &mut ws, &mut ex,
        ));
        c.launch(op.aclnnMatmul, ws, ex);
    }
    let wt: Vec<f32> = (0..k * m).map(|i| w[(i % m) * k + i / m]).collect();
    close(
        &c.download(po, n * m),
        &matmul(&a, &wt, n, k, m),
        1e-6,
        "matmul",
    );
    // RmsNorm of a [3, 5] (rstd [3, 1]) with gamma
    let gamma = values(k, 4);
    let (pg, py, pr) = (c.upload(&gamma), c.malloc(n * k * 4), c.malloc(n * 4));
    let (tg, ty, tr) = (
        c.tensor(pg, &[k as i64], ACL_FLOAT),
        c.tensor(py, &[n as i64, k as i64], ACL_FLOAT),
        c.tensor(pr, &[n as i64, 1], ACL_FLOAT),
    );
    unsafe {
        c.ok((op.aclnnRmsNormGetWorkspaceSize)(
            ta, tg, 1e-6, ty, tr, &mut ws, &mut ex,
        ));
        c.launch(op.aclnnRmsNorm, ws, ex);
    }
    let rstd: Vec<f32> = a
        .chunks(k)
        .map(|r| 1.0 / (r.iter().map(|v| v * v).sum::<f32>() / k as f32 + 1e-6).sqrt())
        .collect();
    let y: Vec<f32> = (0..n * k)
        .map(|i| a[i] * rstd[i / k] * gamma[i % k])
        .collect();
    close(&c.download(pr, n), &rstd, 1e-6, "rstd");
    close(&c.download(py, n * k), &y, 1e-6, "rms norm");
    c.destroy(&[ta, tw, to, tg, ty, tr]);
    for p in [pa, pw, po, pg, py, pr] {
        c.free(p);
    }
    c.ok(c.finalize());
}

#[test]
fn cross_entropy_and_its_gradient_skip_ignored_rows() {
    let c = Cann::open();
    let op = c.op;
    let (n, cl) = (3usize, 5usize);
    let logits = values(n * cl, 5);
    let target = [2i64, -100, 4];
    let (px, pt) = (c.upload(&logits), c.upload_i64(&target));
    let (pl, plp, pz, pg, pd) = (
        c.malloc(4),
        c.malloc(n * cl * 4),
        c.malloc(n * 4),
        c.upload(&[2.0]),
        c.malloc(n * cl * 4),
    );
    let (ni, ci) = (n as i64, cl as i64);
    let tx = c.tensor(px, &[ni, ci], ACL_FLOAT);
    let tt = c.tensor(pt, &[ni], ACL_INT64);
    let (tl, tlp) = (
        c.tensor(pl, &[], ACL_FLOAT),
        c.tensor(plp, &[ni, ci], ACL_FLOAT),
    );
    let (tz, tlse) = (
        c.tensor(pz, &[ni], ACL_FLOAT),
        c.tensor(pz, &[ni], ACL_FLOAT),
    );
    let (tg, td) = (
        c.tensor(pg, &[], ACL_FLOAT),
        c.tensor(pd, &[ni, ci], ACL_FLOAT),
    );
    let mean = c"mean".as_ptr() as *mut std::ffi::c_char;
    let (mut ws, mut ex) = (0u64, null_mut());
    // SAFETY (whole test): descriptors of the stand-in and valid out-pointers.
    unsafe {
        c.ok((op.aclnnCrossEntropyLossGetWorkspaceSize)(
            tx,
            tt,
            null_mut(),
            mean,
            -100,
            0.0,
            0.0,
            false,
            tl,
            tlp,
            tz,
            tlse,
            &mut ws,
            &mut ex,
        ));
        c.launch(op.aclnnCrossEntropyLoss, ws, ex);
        c.ok((op.aclnnCrossEntropyLossGradGetWorkspaceSize)(
            tg,
            tlp,
            tt,
            null_mut(),
            null_mut(),
            null_mut(),
            mean,
            -100,
            0.0,
            0.0,
            td,
            &mut ws,
            &mut ex,
        ));
        c.launch(op.aclnnCrossEntropyLossGrad, ws, ex);
    }
    let log_prob: Vec<f32> = logits
        .chunks(cl)
        .flat_map(|r| {
            let lse = r.iter().map(|v| v.exp()).sum::<f32>().ln();
            r.iter().map(move |v| v - lse).collect::<Vec<_>>()
        })
        .collect();
    let loss = -(log_prob[2] + log_prob[2 * cl + 4]) / 2.0;
    close(&c.download(pl, 1), &[loss], 1e-6, "loss");
    close(&c.download(plp, n * cl), &log_prob, 1e-6, "log prob");
    let grad: Vec<f32> = (0..n * cl)
        .map(|i| {
            let (r, j) = (i / cl, i % cl);
            match target[r] {
                -100 => 0.0,
                t => 2.0 / 2.0 * (log_prob[i].exp() - f32::from(u8::from(t == j as i64))),
            }
        })
        .collect();
    close(&c.download(pd, n * cl), &grad, 1e-6, "gradient");
    c.destroy(&[tx, tt, tl, tlp, tz, tlse, tg, td]);
    for p in [px, pt, pl, plp, pz, pg, pd] {
        c.free(p);
    }
    c.ok(c.finalize());
}

/// Naive causal attention of packed sequences `(sq, skv)` (TND, GQA by `n / nkv`): the output
/// and each row's max and exp-sum of the scaled scores.
fn attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    seqs: &[(usize, usize)],
    (n, nkv, d): (usize, usize, usize),
    scale: f32,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (mut out, mut max, mut sum) = (
        vec![0f32; q.len()],
        vec![0f32; q.len() / d],
        vec![0f32; q.len() / d],
    );
    let (mut q0, mut k0) = (0, 0);
    for &(sq, skv) in seqs {
        for h in 0..n {
            let hk = h / (n / nkv);
            for i in 0..sq {
                let r = (q0 + i) * n + h;
                let qi = &q[r * d..][..d];
                let sees = (0..skv).filter(|&j| j <= i + skv - sq);
                let s: Vec<f32> = sees
                    .map(|j| {
                        scale
                            * (0..d)
                                .map(|e| qi[e] * k[((k0 + j) * nkv + hk) * d + e])
                                .sum::<f32>()
                    })
                    .collect();
                let mx = s.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                let total: f32 = s.iter().map(|x| (x - mx).exp()).sum();
                for (j, x) in s.iter().enumerate() {
                    for e in 0..d {
                        out[r * d + e] += (x - mx).exp() / total * v[((k0 + j) * nkv + hk) * d + e];
                    }
                }
                (max[r], sum[r]) = (mx, total);
            }
        }
        (q0, k0) = (q0 + sq, k0 + skv);
    }
    (out, max, sum)
}

#[test]
fn causal_flash_attention_over_two_sequences_matches_a_naive_one() {
    let c = Cann::open();
    let op = c.op;
    let seqs = [(2usize, 3usize), (3, 4)];
    let (t, tk, n, nkv, d) = (5usize, 7usize, 4usize, 2usize, 8usize);
    let (q, k, v) = (
        values(t * n * d, 6),
        values(tk * nkv * d, 7),
        values(tk * nkv * d, 8),
    );
    let (pq, pk, pv, po) = (
        c.upload(&q),
        c.upload(&k),
        c.upload(&v),
        c.malloc(t * n * d * 4),
    );
    let (pmax, psum) = (c.malloc(t * n * 8 * 4), c.malloc(t * n * 8 * 4));
    let mask: Vec<u8> = (0..2048 * 2048)
        .map(|e| u8::from(e % 2048 > e / 2048))
        .collect();
    let pm = c.upload_bytes(&mask);
    let dims = |a: usize, b: usize, e: usize| [a as i64, b as i64, e as i64];
    let (tq, tkk, tv) = (
        c.tensor(pq, &dims(t, n, d), ACL_FLOAT),
        c.tensor(pk, &dims(tk, nkv, d), ACL_FLOAT),
        c.tensor(pv, &dims(tk, nkv, d), ACL_FLOAT),
    );
    let (to, tmax, tsum) = (
        c.tensor(po, &dims(t, n, d), ACL_FLOAT),
        c.tensor(pmax, &dims(t, n, 8), ACL_FLOAT),
        c.tensor(psum, &dims(t, n, 8), ACL_FLOAT),
    );
    let tm = c.tensor(pm, &[2048, 2048], ACL_UINT8);
    let empty = c.view(null_mut(), &[0], &[1], 0, ACL_FLOAT, 0);
    assert!(!empty.is_null(), "{}", c.message());
    let scale = 1.0 / (d as f32).sqrt();
    let tnd = c"TND".as_ptr() as *mut std::ffi::c_char;
    let (mut ws, mut ex) = (0u64, null_mut());
    // SAFETY (whole test): descriptors of the stand-in and valid out-pointers.
    unsafe {
        let (lq, lk) = ([2i64, 5], [3i64, 7]);
        let (aq, ak) = (
            (c.nn.aclCreateIntArray)(lq.as_ptr(), 2),
            (c.nn.aclCreateIntArray)(lk.as_ptr(), 2),
        );
        c.ok(
            (op.aclnnFlashAttentionVarLenScoreGetWorkspaceSize.unwrap())(
                tq,
                tkk,
                tv,
                null_mut(),
                null_mut(),
                null_mut(),
                tm,
                null_mut(),
                aq,
                ak,
                f64::from(scale),
                1.0,
                65536,
                0,
                n as i64,
                tnd,
                0,
                3,
                tmax,
                tsum,
                empty,
                to,
                &mut ws,
                &mut ex,
            ),
        );
        c.launch(op.aclnnFlashAttentionVarLenScore.unwrap(), ws, ex);
        c.ok((c.nn.aclDestroyIntArray)(aq));
        c.ok((c.nn.aclDestroyIntArray)(ak));
    }
    let (out, max, sum) = attention(&q, &k, &v, &seqs, (n, nkv, d), scale);
    let lanes = |x: &[f32]| x.iter().flat_map(|&v| [v; 8]).collect::<Vec<f32>>();
    close(&c.download(po, t * n * d), &out, 1e-5, "attention");
    close(
        &c.download(pmax, t * n * 8),
        &lanes(&max),
        1e-6,
        "softmax max",
    );
    close(
        &c.download(psum, t * n * 8),
        &lanes(&sum),
        1e-5,
        "softmax sum",
    );
    c.destroy(&[tq, tkk, tv, to, tmax, tsum, tm, empty]);
    for p in [pq, pk, pv, po, pmax, psum, pm] {
        c.free(p);
    }
    c.ok(c.finalize());
}

#[test]
fn the_attention_fallback_operators_compute_and_refuse_what_they_should() {
    let c = Cann::open();
    let (nn, op) = (c.nn, c.op);
    let (mut ws, mut ex) = (0u64, null_mut());
    // two rows of three scores; the mask hides the last column of the first row
    let scores = c.upload(&[1.0, 2.0, 3.0, 0.5, -1.0, 2.0]);
    let mask = c.upload_bytes(&[0, 0, 1, 0, 0, 0]);
    let (x, m) = (
        c.tensor(scores, &[2, 3], ACL_FLOAT),
        c.tensor(mask, &[2, 3], ACL_BOOL),
    );
    let as_float = c.tensor(scores, &[2, 3], ACL_FLOAT);
    let narrow = c.tensor(mask, &[2, 2], ACL_BOOL);
    let p_buf = c.upload(&[0.0; 6]);
    let p = c.tensor(p_buf, &[2, 3], ACL_FLOAT);
    let dy_buf = c.upload(&[0.3, -0.2, 0.9, 1.0, 0.0, -1.0]);
    let dy = c.tensor(dy_buf, &[2, 3], ACL_FLOAT);
    let dx_buf = c.upload(&[0.0; 6]);
    let dx = c.tensor(dx_buf, &[2, 3], ACL_FLOAT);
    let minus_inf = f32::NEG_INFINITY;
    // SAFETY: valid out-pointers, descriptors of the stand-in, a host scalar.
    unsafe {
        let fill = (nn.aclCreateScalar)(&minus_inf as *const f32 as *mut c_void, ACL_FLOAT);
        let masked_fill = op.aclnnInplaceMaskedFillScalarGetWorkspaceSize;
        c.refused(
            masked_fill(x, as_float, fill, &mut ws, &mut ex),
            161002,
            "mask",
        );
        c.refused(
            masked_fill(x, narrow, fill, &mut ws, &mut ex),
            161002,
            "does not broadcast",
        );
        c.ok(masked_fill(x, m, fill, &mut ws, &mut ex));
        c.launch(op.aclnnInplaceMaskedFillScalar, ws, ex);
        c.ok((op.aclnnSoftmaxGetWorkspaceSize)(
            x, -1, p, &mut ws, &mut ex,
        ));
        c.launch(op.aclnnSoftmax, ws, ex);
        c.ok((op.aclnnSoftmaxBackwardGetWorkspaceSize)(
            dy, p, -1, dx, &mut ws, &mut ex,
        ));
        c.launch(op.aclnnSoftmaxBackward, ws, ex);
        c.refused(
            (op.aclnnBatchMatMulGetWorkspaceSize)(x, x, p, 0, &mut ws, &mut ex),
            161002,
            "must be 3-D with the same batch",
        );
        c.ok((nn.aclDestroyScalar)(fill));
    }
    let (rows, grads) = (c.download(p_buf, 6), c.download(dx_buf, 6));
    let want: [[f64; 3]; 2] = [[1.0, 2.0, f64::NEG_INFINITY], [0.5, -1.0, 2.0]];
    let upstream = [[0.3, -0.2, 0.9], [1.0, 0.0, -1.0]];
    for (r, (scores, dys)) in want.iter().zip(upstream).enumerate() {
        let total: f64 = scores.iter().map(|s| s.exp()).sum();
        let y: Vec<f64> = scores.iter().map(|s| s.exp() / total).collect();
        let dot: f64 = y.iter().zip(dys).map(|(y, d)| y * d).sum();
        for i in 0..3 {
            let dx = y[i] * (dys[i] - dot);
            assert!((f64::from(rows[r * 3 + i]) - y[i]).abs() < 1e-6, "{rows:?}");
            assert!((f64::from(grads[r * 3 + i]) - dx).abs() < 1e-6, "{grads:?}");
        }
    }
    c.destroy(&[x, m, as_float, narrow, p, dy, dx]);
    for buf in [scores, mask, p_buf, dy_buf, dx_buf] {
        c.free(buf);
    }
    c.ok(c.finalize());
}
