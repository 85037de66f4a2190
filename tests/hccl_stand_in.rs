//! The CANN stand-in's HCCL side, loaded here as `libhccl.so` would be: collectives between ranks
//! that are processes (this test binary re-run as each rank, [`child_rank`]) or threads of this
//! process, with exact results on device memory, and the contract it is strict about: ranks that
//! disagree, buffers too small, a rank that never joins or that dies, rank table files. The
//! stand-in's runtime state is process-global, so the tests whose ranks are threads here hold
//! [`SERIAL`] from `aclInit` to `aclFinalize`; the others only start hubs here.

mod common;

use half::bf16;
use hccl_sys::*;
use std::ffi::{c_void, CStr, CString};
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::ptr::null_mut;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

static SERIAL: Mutex<()> = Mutex::new(());

/// The scenario, rank and size a child rank process runs (`scenario:rank:size`).
const CHILD_ENV: &str = "MINDKIT_HCCL_TEST_CHILD";
/// The root info a child rank joins with, as hex.
const ROOT_ENV: &str = "MINDKIT_HCCL_TEST_ROOT";
/// The stand-in library a child rank loads (built once, by the parent).
const LIBRARY_ENV: &str = "MINDKIT_HCCL_TEST_LIBRARY";

/// The stand-in's runtime and HCCL functions.
struct Cann {
    acl: ascendcl_sys::Functions,
    hccl: hccl_sys::Functions,
    _library: ascendcl_sys::libloading::Library,
}

fn cann() -> &'static Cann {
    static LOADED: OnceLock<Cann> = OnceLock::new();
    LOADED.get_or_init(|| {
        // SAFETY: the stand-in exports the runtime's and HCCL's functions with the sys crates'
        // types.
        unsafe {
            let path = std::env::var_os(LIBRARY_ENV);
            let path = path.as_deref().map_or(common::stand_in(), Path::new);
            let library = ascendcl_sys::libloading::Library::new(path).unwrap();
            Cann {
                acl: ascendcl_sys::Functions::resolve(&library).unwrap(),
                hccl: hccl_sys::Functions::resolve(&library).unwrap(),
                _library: library,
            }
        }
    })
}

/// The calling thread's most recent failure message.
fn message() -> String {
    // SAFETY: the runtime's own NUL-terminated string.
    unsafe { CStr::from_ptr((cann().acl.aclGetRecentErrMsg)()) }
        .to_string_lossy()
        .into_owned()
}

fn ok(code: i32) {
    assert_eq!(code, 0, "{}", message());
}

/// `code` is `want`, and the message says each of `texts`.
fn refused(code: HcclResult, want: HcclResult, texts: &[&str]) {
    let m = message();
    assert!(
        code == want && texts.iter().all(|t| m.contains(t)),
        "expected {want} {texts:?}, got {code} '{m}'"
    );
}

fn root_info() -> HcclRootInfo {
    let mut root = HcclRootInfo {
        internal: [0; HCCL_ROOT_INFO_BYTES],
    };
    // SAFETY: a valid out-pointer.
    ok(unsafe { (cann().hccl.HcclGetRootInfo)(&mut root) });
    root
}

/// The process's runtime, initialised while the test holds [`SERIAL`]; `aclFinalize` (which
/// finds any leak) when done.
fn with_runtime(f: impl FnOnce()) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // SAFETY: a null config path is allowed.
    ok(unsafe { (cann().acl.aclInit)(std::ptr::null()) });
    f();
    // SAFETY: no arguments.
    ok(unsafe { (cann().acl.aclFinalize)() });
}

/// This thread's device and a stream on it.
fn bind_device() -> ascendcl_sys::aclrtStream {
    let acl = &cann().acl;
    let mut stream = null_mut();
    // SAFETY: device 0 exists; a valid out-pointer.
    unsafe {
        ok((acl.aclrtSetDevice)(0));
        ok((acl.aclrtCreateStream)(&mut stream));
    }
    stream
}

/// One rank on this thread: its communicator, stream and device buffers, all freed on drop (a
/// rank that panics leaves, so the others fail instead of waiting).
struct Rank {
    rank: u32,
    size: u32,
    comm: HcclComm,
    stream: ascendcl_sys::aclrtStream,
    buffers: Vec<*mut c_void>,
}

impl Rank {
    /// Bind a device and join by `root` as `rank` of `size`.
    fn join(root: &HcclRootInfo, size: u32, rank: u32) -> Rank {
        let stream = bind_device();
        let mut comm = null_mut();
        // SAFETY: a root info and a valid out-pointer.
        ok(unsafe { (cann().hccl.HcclCommInitRootInfo)(size, root, rank, &mut comm) });
        Rank::of(comm, stream)
    }

    /// The rank `comm` is, on `stream`.
    fn of(comm: HcclComm, stream: ascendcl_sys::aclrtStream) -> Rank {
        let (mut rank, mut size) = (0, 0);
        // SAFETY: a live communicator, valid out-pointers.
        unsafe {
            ok((cann().hccl.HcclGetRankId)(comm, &mut rank));
            ok((cann().hccl.HcclGetRankSize)(comm, &mut size));
        }
        Rank {
            rank,
            size,
            comm,
            stream,
            buffers: Vec::new(),
        }
    }

    /// `len` bytes of device memory.
    fn alloc(&mut self, len: usize) -> *mut c_void {
        let mut ptr = null_mut();
        // SAFETY: a valid out-pointer.
        ok(unsafe { (cann().acl.aclrtMalloc)(&mut ptr, len, 0) });
        self.buffers.push(ptr);
        ptr
    }

    /// `bytes` on the device.
    fn upload(&mut self, bytes: &[u8]) -> *mut c_void {
        let ptr = self.alloc(bytes.len());
        // SAFETY: a device buffer of bytes.len() bytes and a host source of as many.
        ok(unsafe {
            (cann().acl.aclrtMemcpy)(ptr, bytes.len(), bytes.as_ptr().cast(), bytes.len(), 1)
        });
        ptr
    }

    /// `len` bytes at `ptr`, after the stream's work.
    fn download(&self, ptr: *mut c_void, len: usize) -> Vec<u8> {
        let mut bytes = vec![0u8; len];
        // SAFETY: a live stream; a device source and host destination of `len` bytes.
        unsafe {
            ok((cann().acl.aclrtSynchronizeStream)(self.stream));
            ok((cann().acl.aclrtMemcpy)(
                bytes.as_mut_ptr().cast(),
                len,
                ptr,
                len,
                2,
            ));
        }
        bytes
    }

    fn f32s(&self, ptr: *mut c_void, n: usize) -> Vec<f32> {
        let bytes = self.download(ptr, 4 * n);
        let words = bytes.chunks_exact(4);
        words
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect()
    }
}

impl Drop for Rank {
    fn drop(&mut self) {
        let acl = &cann().acl;
        // SAFETY: this rank's own handles, released once.
        unsafe {
            (cann().hccl.HcclCommDestroy)(self.comm);
            for &b in &self.buffers {
                (acl.aclrtFree)(b);
            }
            (acl.aclrtDestroyStream)(self.stream);
            (acl.aclrtResetDevice)(0);
        }
    }
}

fn bytes_of_f32(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn bytes_of_bf16(values: &[f32]) -> Vec<u8> {
    let halves = values.iter().map(|&v| bf16::from_f32(v));
    halves.flat_map(|v| v.to_le_bytes()).collect()
}

/// `f` over every rank's values, in rank order.
fn over_ranks(
    size: u32,
    values: impl Fn(f32) -> Vec<f32>,
    f: impl Fn(f32, f32) -> f32,
) -> Vec<f32> {
    let all: Vec<Vec<f32>> = (0..size).map(|r| values(r as f32)).collect();
    let mut acc = all[0].clone();
    for v in &all[1..] {
        acc.iter_mut().zip(v).for_each(|(a, &b)| *a = f(*a, b));
    }
    acc
}

/// Every collective once, with exact results, on rank `r`.
fn exercise(r: &mut Rank) {
    let hccl = &cann().hccl;
    let (me, n) = (r.rank as f32, r.size);
    let (comm, stream) = (r.comm, r.stream);

    let sum_values = |x: f32| vec![x + 0.25, -3.0 * x, 0.1 * x + 1e-3];
    let sum = r.upload(&bytes_of_f32(&sum_values(me)));
    // in place, as torch_npu does
    // SAFETY (every call below): device buffers of the counts given, a live comm and stream.
    ok(unsafe {
        (hccl.HcclAllReduce)(
            sum,
            sum,
            3,
            HCCL_DATA_TYPE_FP32,
            HCCL_REDUCE_SUM,
            comm,
            stream,
        )
    });
    assert_eq!(r.f32s(sum, 3), over_ranks(n, sum_values, |a, b| a + b));

    let max_values = |x: f32| vec![x / 3.0, 1.0 - x];
    let max_in = r.upload(&bytes_of_bf16(&max_values(me)));
    let max_out = r.alloc(4);
    ok(unsafe {
        (hccl.HcclAllReduce)(
            max_in,
            max_out,
            2,
            HCCL_DATA_TYPE_BFP16,
            HCCL_REDUCE_MAX,
            comm,
            stream,
        )
    });
    let rounded = |x: f32| {
        max_values(x)
            .iter()
            .map(|&v| bf16::from_f32(v).to_f32())
            .collect()
    };
    let want = over_ranks(n, rounded, f32::max);
    assert_eq!(r.download(max_out, 4), bytes_of_bf16(&want));

    let gather_in = r.upload(&bytes_of_f32(&[me, me + 0.5]));
    let gathered = r.alloc(8 * n as usize);
    ok(unsafe { (hccl.HcclAllGather)(gather_in, gathered, 2, HCCL_DATA_TYPE_FP32, comm, stream) });
    let want: Vec<f32> = (0..n).flat_map(|k| [k as f32, k as f32 + 0.5]).collect();
    assert_eq!(r.f32s(gathered, 2 * n as usize), want);

    let spread = |x: f32| (0..2 * n).map(|i| i as f32 * (x + 1.0)).collect::<Vec<_>>();
    let scatter_in = r.upload(&bytes_of_f32(&spread(me)));
    let block = r.alloc(8);
    ok(unsafe {
        (hccl.HcclReduceScatter)(
            scatter_in,
            block,
            2,
            HCCL_DATA_TYPE_FP32,
            HCCL_REDUCE_SUM,
            comm,
            stream,
        )
    });
    let whole = over_ranks(n, spread, |a, b| a + b);
    assert_eq!(r.f32s(block, 2), whole[2 * r.rank as usize..][..2]);

    let cast = r.upload(&bytes_of_f32(&[me + 7.0; 3]));
    ok(unsafe { (hccl.HcclBroadcast)(cast, 3, HCCL_DATA_TYPE_FP32, n - 1, comm, stream) });
    assert_eq!(r.f32s(cast, 3), [(n - 1) as f32 + 7.0; 3]);

    // a ring: each rank sends to the next and receives from the previous
    let (next, previous) = ((r.rank + 1) % n, (r.rank + n - 1) % n);
    let sent = r.upload(&bytes_of_f32(&[me * 11.0]));
    let got = r.alloc(4);
    ok(unsafe { (hccl.HcclSend)(sent, 1, HCCL_DATA_TYPE_FP32, next, comm, stream) });
    ok(unsafe { (hccl.HcclRecv)(got, 1, HCCL_DATA_TYPE_FP32, previous, comm, stream) });
    assert_eq!(r.f32s(got, 1), [previous as f32 * 11.0]);
}

/// Ranks that call with different counts all fail, naming both counts.
fn disagree(r: &mut Rank) {
    let count = 2 + u64::from(r.rank);
    let x = r.alloc(4 * count as usize);
    // SAFETY: a device buffer of `count` f32, a live comm and stream.
    let code = unsafe {
        (cann().hccl.HcclAllReduce)(
            x,
            x,
            count,
            HCCL_DATA_TYPE_FP32,
            HCCL_REDUCE_SUM,
            r.comm,
            r.stream,
        )
    };
    refused(
        code,
        HCCL_E_PARA,
        &[
            "HcclAllReduce #0: ranks disagree",
            "rank 0 has count: 2",
            "rank 1 has count: 3",
        ],
    );
}

/// Rank 2 exits without a word; the others' collective and receive from it fail.
fn exits(r: &mut Rank) {
    if r.rank == 2 {
        std::process::exit(0);
    }
    let x = r.alloc(4);
    let hccl = &cann().hccl;
    // SAFETY: a device buffer of 1 f32, a live comm and stream.
    let code = unsafe {
        (hccl.HcclAllReduce)(
            x,
            x,
            1,
            HCCL_DATA_TYPE_FP32,
            HCCL_REDUCE_SUM,
            r.comm,
            r.stream,
        )
    };
    refused(code, HCCL_E_REMOTE, &["HcclAllReduce #0: rank 2 left"]);
    // SAFETY: as above.
    let code = unsafe { (hccl.HcclRecv)(x, 1, HCCL_DATA_TYPE_FP32, 2, r.comm, r.stream) };
    refused(code, HCCL_E_REMOTE, &["HcclRecv: rank 2 left"]);
}

/// What the child rank processes run: the scenario, rank and size in [`CHILD_ENV`].
#[test]
fn child_rank() {
    let Ok(child) = std::env::var(CHILD_ENV) else {
        return; // not a child: nothing to do
    };
    let [scenario, rank, size] = child.split(':').collect::<Vec<_>>()[..] else {
        panic!("{CHILD_ENV}={child}");
    };
    let (rank, size): (u32, u32) = (rank.parse().unwrap(), size.parse().unwrap());
    let hex = std::env::var(ROOT_ENV).unwrap();
    let mut root = HcclRootInfo {
        internal: [0; HCCL_ROOT_INFO_BYTES],
    };
    for (i, byte) in root.internal.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&hex[2 * i..][..2], 16).unwrap() as _;
    }
    with_runtime(|| match scenario {
        "alone" => {
            let started = Instant::now();
            let stream = bind_device();
            let mut comm = null_mut();
            // SAFETY: a root info and a valid out-pointer.
            let code = unsafe { (cann().hccl.HcclCommInitRootInfo)(size, &root, rank, &mut comm) };
            refused(code, HCCL_E_TIMEOUT, &["ranks [1] never joined"]);
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "{:?}",
                started.elapsed()
            );
            // SAFETY: the stream made above.
            unsafe { (cann().acl.aclrtDestroyStream)(stream) };
        }
        _ => {
            let mut r = Rank::join(&root, size, rank);
            match scenario {
                "collectives" => exercise(&mut r),
                "disagree" => disagree(&mut r),
                "exits" => exits(&mut r),
                _ => panic!("no scenario {scenario}"),
            }
        }
    });
}

/// Run `ranks` of `size` as child processes of scenario `scenario`, joined by a root info from
/// this process, each with `env`; their outputs once all exited.
fn run_ranks(scenario: &str, ranks: &[u32], size: u32, env: &[(&str, String)]) -> Vec<Output> {
    let root = root_info();
    let hex: String = root
        .internal
        .iter()
        .map(|&b| format!("{:02x}", b as u8))
        .collect();
    let children: Vec<_> = ranks
        .iter()
        .map(|rank| {
            let mut child = Command::new(std::env::current_exe().unwrap());
            child
                .args(["--exact", "child_rank", "--nocapture", "--test-threads=1"])
                .env(CHILD_ENV, format!("{scenario}:{rank}:{size}"))
                .env(ROOT_ENV, &hex)
                .env(LIBRARY_ENV, common::stand_in())
                // nothing waits for ever if a rank goes wrong
                .env("HCCL_CONNECT_TIMEOUT", "30")
                .env("HCCL_EXEC_TIMEOUT", "30")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            for (key, value) in env {
                child.env(key, value.replace("{rank}", &rank.to_string()));
            }
            child.spawn().unwrap()
        })
        .collect();
    children
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
        .collect()
}

fn succeeded(outputs: &[Output]) {
    for (rank, out) in outputs.iter().enumerate() {
        assert!(
            out.status.success(),
            "rank {rank}: {}\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn ranks_as_processes_compute_every_collective_and_count_it() {
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("report-{rank}.json");
    let env = [("MINDKIT_STAND_IN_REPORT", report.display().to_string())];
    succeeded(&run_ranks("collectives", &[0, 1, 2], 3, &env));
    let text = std::fs::read_to_string(dir.path().join("report-1.json")).unwrap();
    let report: serde_json::Value = serde_json::from_str(&text).unwrap();
    let hccl = &report["hccl"];
    let counted = |name: &str| (hccl[name]["calls"].as_u64(), hccl[name]["bytes"].as_u64());
    assert_eq!(counted("HcclAllReduce"), (Some(2), Some(12 + 4)), "{text}");
    assert_eq!(counted("HcclAllGather"), (Some(1), Some(8)), "{text}");
    assert_eq!(counted("HcclReduceScatter"), (Some(1), Some(24)), "{text}");
    // rank 1 is not the broadcast's root: it sends nothing
    assert_eq!(counted("HcclBroadcast"), (Some(1), Some(0)), "{text}");
    assert_eq!(counted("HcclSend"), (Some(1), Some(4)), "{text}");
}

#[test]
fn rank_processes_that_disagree_all_fail_naming_both_counts() {
    succeeded(&run_ranks("disagree", &[0, 1, 2], 3, &[]));
}

#[test]
fn a_rank_process_that_exits_fails_the_others_without_a_hang() {
    cann(); // built and loaded before the clock starts
    let started = Instant::now();
    let outputs = run_ranks("exits", &[0, 1, 2], 3, &[]);
    succeeded(&outputs);
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn a_rank_that_never_joins_times_the_others_out() {
    let env = [("HCCL_CONNECT_TIMEOUT", "2".to_string())];
    succeeded(&run_ranks("alone", &[0], 2, &env));
}

/// Join `size` ranks as threads of this process with `join` (given the rank) and run `f` on
/// each; their results in rank order.
fn thread_ranks<T: Send>(
    size: u32,
    join: impl Fn(u32) -> Rank + Sync,
    f: impl Fn(&mut Rank) -> T + Sync,
) -> Vec<T> {
    std::thread::scope(|s| {
        let ranks: Vec<_> = (0..size)
            .map(|rank| {
                let (join, f) = (&join, &f);
                s.spawn(move || f(&mut join(rank)))
            })
            .collect();
        ranks.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn ranks_as_threads_compute_every_collective() {
    with_runtime(|| {
        let root = root_info();
        thread_ranks(3, |rank| Rank::join(&root, 3, rank), exercise);
    });
}

/// The all-reduce of `bytes`, `count` elements of `dtype`, with `op`, on rank `r`.
fn all_reduce(
    r: &mut Rank,
    bytes: &[u8],
    count: u64,
    dtype: HcclDataType,
    op: HcclReduceOp,
) -> Vec<u8> {
    let x = r.upload(bytes);
    // SAFETY: a device buffer of `count` elements, a live comm and stream.
    ok(unsafe { (cann().hccl.HcclAllReduce)(x, x, count, dtype, op, r.comm, r.stream) });
    r.download(x, bytes.len())
}

#[test]
fn reductions_run_in_f32_rounding_once_and_integers_wrap() {
    with_runtime(|| {
        let root = root_info();
        thread_ranks(
            3,
            |rank| Rank::join(&root, 3, rank),
            |r| {
                let me = r.rank as i8;
                // 100 * 3 wraps to 44 in int8
                let int8 = all_reduce(
                    r,
                    &[100, (-me) as u8],
                    2,
                    HCCL_DATA_TYPE_INT8,
                    HCCL_REDUCE_SUM,
                );
                assert_eq!(int8, [44, (-3i8) as u8]);
                let int32 = all_reduce(
                    r,
                    &(i32::from(me) - 1).to_le_bytes(),
                    1,
                    HCCL_DATA_TYPE_INT32,
                    HCCL_REDUCE_MIN,
                );
                assert_eq!(int32, (-1i32).to_le_bytes());
                let int64 = all_reduce(
                    r,
                    &(i64::from(me) + 2).to_le_bytes(),
                    1,
                    HCCL_DATA_TYPE_INT64,
                    HCCL_REDUCE_PROD,
                );
                assert_eq!(int64, 24i64.to_le_bytes());
                // 1 + 2^-11 + 2^-11: one rounding keeps 1 + 2^-10, rounding each step loses both
                let tiny = if me == 0 { 1.0 } else { 2f32.powi(-11) };
                let fp16 = all_reduce(
                    r,
                    &half::f16::from_f32(tiny).to_le_bytes(),
                    1,
                    HCCL_DATA_TYPE_FP16,
                    HCCL_REDUCE_SUM,
                );
                assert_eq!(
                    fp16,
                    half::f16::from_f32(1.0 + 2f32.powi(-10)).to_le_bytes()
                );
            },
        );
    });
}

#[test]
fn a_buffer_too_small_fails_its_rank_and_at_once_the_others() {
    with_runtime(|| {
        let root = root_info();
        let started = Instant::now();
        let codes = thread_ranks(
            2,
            |rank| Rank::join(&root, 2, rank),
            |r| {
                let x = r.alloc(if r.rank == 1 { 4 } else { 8 });
                // SAFETY: a live comm and stream; rank 1's buffer is too small, as meant.
                let code = unsafe {
                    (cann().hccl.HcclAllReduce)(
                        x,
                        x,
                        2,
                        HCCL_DATA_TYPE_FP32,
                        HCCL_REDUCE_SUM,
                        r.comm,
                        r.stream,
                    )
                };
                (code, message())
            },
        );
        let overrun = "HcclAllReduce sendBuf: 8 bytes at offset 0 overrun the 4-byte allocation";
        assert!(
            codes[1].0 == HCCL_E_PARA && codes[1].1.contains(overrun),
            "{codes:?}"
        );
        assert!(
            codes[0].0 == HCCL_E_REMOTE
                && codes[0].1.contains("rank 1 failed: ")
                && codes[0].1.contains(overrun),
            "{codes:?}"
        );
        assert!(started.elapsed() < Duration::from_secs(5));
    });
}

#[test]
fn a_send_and_receive_that_disagree_fail_both() {
    with_runtime(|| {
        let root = root_info();
        let received = std::sync::Barrier::new(2);
        let outcomes = thread_ranks(
            2,
            |rank| Rank::join(&root, 2, rank),
            |r| {
                let hccl = &cann().hccl;
                let x = r.alloc(8);
                // SAFETY: a device buffer of 2 f32, a live comm and stream.
                let first = unsafe {
                    match r.rank {
                        0 => (hccl.HcclSend)(x, 1, HCCL_DATA_TYPE_FP32, 1, r.comm, r.stream),
                        _ => (hccl.HcclRecv)(x, 2, HCCL_DATA_TYPE_FP32, 0, r.comm, r.stream),
                    }
                };
                let first = (first, message());
                // the receive refused the send before the sender's next call
                received.wait();
                // SAFETY: as above.
                let next = unsafe {
                    (hccl.HcclAllReduce)(
                        x,
                        x,
                        1,
                        HCCL_DATA_TYPE_FP32,
                        HCCL_REDUCE_SUM,
                        r.comm,
                        r.stream,
                    )
                };
                [first, (next, message())]
            },
        );
        let why = "HcclRecv by rank 1 from rank 0: rank 0 sent count: 1 dtype: 4, rank 1 receives count: 2 dtype: 4";
        let [(sent, _), (sender_next, sender_said)] = &outcomes[0];
        let [(recv, recv_said), (receiver_next, receiver_said)] = &outcomes[1];
        assert_eq!(*sent, 0, "{outcomes:?}");
        assert!(
            *recv == HCCL_E_PARA && recv_said.contains(why),
            "{outcomes:?}"
        );
        assert!(
            *sender_next == HCCL_E_PARA && sender_said.contains(why),
            "{outcomes:?}"
        );
        let remote = format!("HcclAllReduce #0: rank 0 failed: {why}");
        assert!(
            *receiver_next == HCCL_E_REMOTE && receiver_said.contains(&remote),
            "{outcomes:?}"
        );
    });
}

#[test]
fn misuse_of_one_rank_is_refused() {
    with_runtime(|| {
        let hccl = &cann().hccl;
        let mut r = Rank::join(&root_info(), 1, 0);
        let x = r.alloc(16);
        // SAFETY: each call is refused before touching memory beyond `x`'s 16 bytes.
        unsafe {
            let code = (hccl.HcclAllGather)(x, x, 2, HCCL_DATA_TYPE_FP32, r.comm, r.stream);
            refused(
                code,
                HCCL_E_PARA,
                &["HcclAllGather: sendBuf and recvBuf overlap"],
            );
            let code = (hccl.HcclAllReduce)(
                x,
                x,
                2,
                HCCL_DATA_TYPE_BFP16,
                HCCL_REDUCE_PROD,
                r.comm,
                r.stream,
            );
            refused(
                code,
                HCCL_E_NOT_SUPPORT,
                &["HcclAllReduce: HCCL does not reduce dtype 11 with op 1"],
            );
            let code = (hccl.HcclAllReduce)(x, x, 2, HCCL_DATA_TYPE_FP32, 7, r.comm, r.stream);
            refused(code, HCCL_E_PARA, &["reduce op 7"]);
            let code = (hccl.HcclSend)(x, 1, HCCL_DATA_TYPE_FP32, 0, r.comm, r.stream);
            refused(
                code,
                HCCL_E_PARA,
                &["HcclSend: rank 0 is not another rank of 1"],
            );
            let code = (hccl.HcclBroadcast)(x, 1, HCCL_DATA_TYPE_FP32, 0, r.comm, 0x1234 as _);
            refused(code, HCCL_E_PARA, &["is not a live stream"]);
            let mut comm = null_mut();
            let foreign = HcclRootInfo {
                internal: [1; HCCL_ROOT_INFO_BYTES],
            };
            let code = (hccl.HcclCommInitRootInfo)(2, &foreign, 1, &mut comm);
            refused(code, HCCL_E_PARA, &["root info not from HcclGetRootInfo"]);
            let code = (hccl.HcclAllReduce)(
                x,
                x,
                1,
                HCCL_DATA_TYPE_FP32,
                HCCL_REDUCE_SUM,
                0x99 as _,
                r.stream,
            );
            refused(code, HCCL_E_PARA, &["is not a live communicator"]);
            let name = CStr::from_ptr((hccl.HcclGetErrorString)(HCCL_E_REMOTE));
            assert_eq!(name.to_str(), Ok("HCCL_E_REMOTE"));
        }
        // stream work is read back only after a synchronize
        let acl = &cann().acl;
        let mut host = [0u8; 4];
        // SAFETY: a device buffer of 16 bytes, host memory of 4.
        unsafe {
            ok((hccl.HcclBroadcast)(
                x,
                1,
                HCCL_DATA_TYPE_FP32,
                0,
                r.comm,
                r.stream,
            ));
            let code = (acl.aclrtMemcpy)(host.as_mut_ptr().cast(), 4, x, 4, 2);
            assert_ne!(code, 0);
        }
    });
}

/// A rank table file in `dir` listing `rank_ids`, one device each on one server.
fn rank_table(dir: &Path, rank_ids: &[u32]) -> CString {
    let devices: Vec<String> = rank_ids
        .iter()
        .enumerate()
        .map(|(d, id)| {
            format!(r#"{{"device_id": "{d}", "device_ip": "192.168.1.{d}", "rank_id": "{id}"}}"#)
        })
        .collect();
    let json = format!(
        r#"{{"version": "1.0", "server_count": "1", "server_list": [{{"server_id": "node_0", "device": [{}]}}], "status": "completed"}}"#,
        devices.join(", ")
    );
    let path = dir.join(format!("rank_table_{}.json", rank_ids.len()));
    std::fs::write(&path, json).unwrap();
    CString::new(path.to_str().unwrap()).unwrap()
}

/// `HcclCommInitClusterInfo(file, rank)` on this thread: the rank, or the code.
fn cluster_rank(file: &CStr, rank: u32) -> Result<Rank, HcclResult> {
    let stream = bind_device();
    let mut comm = null_mut();
    // SAFETY: a NUL-terminated path and a valid out-pointer.
    let code = unsafe { (cann().hccl.HcclCommInitClusterInfo)(file.as_ptr(), rank, &mut comm) };
    if code != 0 {
        // SAFETY: the stream made above.
        unsafe { (cann().acl.aclrtDestroyStream)(stream) };
        return Err(code);
    }
    Ok(Rank::of(comm, stream))
}

#[test]
fn rank_tables_join_ranks_and_bad_ones_are_refused_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    with_runtime(|| {
        let table = rank_table(dir.path(), &[0, 1]);
        let sums = thread_ranks(
            2,
            |rank| cluster_rank(&table, rank).unwrap(),
            |r| {
                let x = r.upload(&bytes_of_f32(&[r.rank as f32 + 1.0]));
                // SAFETY: a device buffer of 1 f32, a live comm and stream.
                ok(unsafe {
                    (cann().hccl.HcclAllReduce)(
                        x,
                        x,
                        1,
                        HCCL_DATA_TYPE_FP32,
                        HCCL_REDUCE_SUM,
                        r.comm,
                        r.stream,
                    )
                });
                r.f32s(x, 1)[0]
            },
        );
        assert_eq!(sums, [3.0, 3.0]);

        let twice = rank_table(dir.path(), &[0, 1, 1]);
        let code = cluster_rank(&twice, 0).err().unwrap();
        refused(
            code,
            HCCL_E_PARA,
            &[twice.to_str().unwrap(), "rank_id 1 appears twice"],
        );
        let missing = CString::new(dir.path().join("none.json").to_str().unwrap()).unwrap();
        let code = cluster_rank(&missing, 0).err().unwrap();
        refused(code, HCCL_E_OPEN_FILE_FAILURE, &[missing.to_str().unwrap()]);
        let code = cluster_rank(&table, 2).err().unwrap();
        refused(code, HCCL_E_PARA, &["rank 2 is not a rank of 2"]);
        // SAFETY: this thread's device, set by cluster_rank.
        ok(unsafe { (cann().acl.aclrtResetDevice)(0) });
    });
}

#[test]
fn sub_communicators_reduce_over_their_ranks_and_bad_ones_are_refused() {
    with_runtime(|| {
        let root = root_info();
        let sums = thread_ranks(
            4,
            |rank| Rank::join(&root, 4, rank),
            |r| {
                // ranks {0, 2} and {1, 3}, each group named by its first rank
                let mut members = [r.rank % 2, r.rank % 2 + 2];
                let (id, me) = (u64::from(members[0]), r.rank / 2);
                let mut parent = r.comm;
                let mut sub = null_mut();
                let mut create = |ids: &mut [u32], me: u32, config: &mut HcclCommConfig| {
                    let n = ids.len() as u32;
                    // SAFETY: a live communicator, `n` rank ids, a configuration and an
                    // out-pointer, all outliving the call.
                    unsafe {
                        (cann().hccl.HcclCreateSubCommConfig)(
                            &mut parent,
                            n,
                            ids.as_mut_ptr(),
                            id,
                            me,
                            config,
                            &mut sub,
                        )
                    }
                };
                let mut unmade = HcclCommConfig::new();
                unmade.reserved[8] = 0;
                let code = create(&mut members, me, &mut unmade);
                refused(code, HCCL_E_PARA, &["not made by HcclCommConfigInit"]);
                let code = create(&mut members, 1 - me, &mut HcclCommConfig::new());
                refused(code, HCCL_E_PARA, &["the caller is rank"]);
                let code = create(&mut [r.rank, 4], 0, &mut HcclCommConfig::new());
                refused(code, HCCL_E_PARA, &["not distinct ranks of the 4"]);
                ok(create(&mut members, me, &mut HcclCommConfig::new()));
                let (mut rank, mut size) = (0, 0);
                let x = r.upload(&bytes_of_f32(&[r.rank as f32 + 1.0]));
                // SAFETY: the sub-communicator just made, valid out-pointers, a device buffer
                // of 1 f32 and this rank's stream.
                unsafe {
                    ok((cann().hccl.HcclGetRankId)(sub, &mut rank));
                    ok((cann().hccl.HcclGetRankSize)(sub, &mut size));
                    let hccl = &cann().hccl;
                    let (f32, sum) = (HCCL_DATA_TYPE_FP32, HCCL_REDUCE_SUM);
                    ok((hccl.HcclAllReduce)(x, x, 1, f32, sum, sub, r.stream));
                }
                let total = r.f32s(x, 1)[0];
                // SAFETY: the sub-communicator made above, destroyed once.
                ok(unsafe { (cann().hccl.HcclCommDestroy)(sub) });
                (rank, size, total)
            },
        );
        assert_eq!(sums, [(0, 2, 4.0), (0, 2, 6.0), (1, 2, 4.0), (1, 2, 6.0)]);
    });
}
