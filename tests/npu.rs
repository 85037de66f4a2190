//! `mindkit npu info` through the whole runtime-loading path, on the CANN stand-in
//! (`crates/cann-stand-in`, built here into its own target directory): two devices, the
//! stand-in's counters, a library that lacks the runtime's functions, and no library at all.

mod common;

use assert_cmd::Command;
use common::{stand_in, toolkit};
use std::path::{Path, PathBuf};

/// `mindkit npu info` with CANN at `toolkit`.
fn npu_info(toolkit: &Path) -> Command {
    on_toolkit(toolkit, &["npu", "info"])
}

/// `mindkit args…` with CANN looked for at `toolkit` only.
fn on_toolkit(toolkit: &Path, args: &[&str]) -> Command {
    let mut cmd = Command::cargo_bin("mindkit").unwrap();
    // cargo's LD_LIBRARY_PATH for tests holds its target directories, where a stand-in built
    // there would be found by soname
    cmd.args(args)
        .env("ASCEND_TOOLKIT_HOME", toolkit)
        .env_remove("ASCEND_HOME_PATH")
        .env_remove("LD_LIBRARY_PATH");
    cmd
}

/// What `cmd` printed on stdout, having succeeded.
fn succeeds(mut cmd: Command) -> String {
    String::from_utf8(cmd.assert().success().get_output().stdout.clone()).unwrap()
}

/// What `cmd` printed on stderr, having failed.
fn fails(mut cmd: Command) -> String {
    String::from_utf8(cmd.assert().failure().get_output().stderr.clone()).unwrap()
}

#[test]
fn npu_info_reports_each_device_of_the_runtime() {
    let dir = tempfile::tempdir().unwrap();
    let home = toolkit(&dir.path().join("toolkit"), stand_in());
    let report = dir.path().join("report.json");
    let mut cmd = npu_info(&home);
    cmd.env("MINDKIT_STAND_IN_DEVICES", "2")
        .env("MINDKIT_STAND_IN_REPORT", &report);
    let text = succeeds(cmd);
    assert!(text.contains("CANN     8.1.RC1"), "{text}");
    let hccl = home.join("lib64/libhccl.so").display().to_string();
    assert!(text.contains(&format!("HCCL     {hccl}")), "{text}");
    assert!(text.contains("devices  2"), "{text}");
    assert!(
        text.contains("npu 0    Ascend910B4, HBM 64.0 GiB free of 64.0 GiB"),
        "{text}"
    );
    assert!(
        text.contains("npu 1    Ascend910B4, HBM 64.0 GiB free of 64.0 GiB"),
        "{text}"
    );
    assert!(
        text.contains(&home.join("lib64/libascendcl.so").display().to_string()),
        "{text}"
    );
    // aclFinalize was reached (the report is written there) with nothing allocated
    let report = std::fs::read_to_string(&report).unwrap();
    assert!(report.contains("\"allocations\": 0"), "{report}");
}

#[test]
fn a_library_without_the_runtime_functions_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let libm = [
        "/lib/x86_64-linux-gnu/libm.so.6",
        "/usr/lib/x86_64-linux-gnu/libm.so.6",
        "/lib64/libm.so.6",
    ]
    .iter()
    .map(Path::new)
    .find(|p| p.is_file());
    let Some(libm) = libm else {
        eprintln!("SKIPPED: no libm.so.6 to stand for a library without the runtime's functions");
        return;
    };
    let home = toolkit(dir.path(), libm);
    let err = fails(npu_info(&home));
    assert!(
        err.contains("libascendcl.so has no function aclInit"),
        "{err}"
    );
}

#[test]
fn without_cann_the_error_says_where_it_looked_and_what_to_do() {
    let dir = tempfile::tempdir().unwrap();
    let err = fails(npu_info(dir.path()));
    assert!(err.contains("CANN's libascendcl.so was not found"), "{err}");
    assert!(
        err.contains(
            &dir.path()
                .join("lib64/libascendcl.so")
                .display()
                .to_string()
        ),
        "{err}"
    );
    assert!(
        err.contains("/usr/local/Ascend/ascend-toolkit/latest/lib64/libascendcl.so"),
        "{err}"
    );
    assert!(
        err.contains("source /usr/local/Ascend/ascend-toolkit/set_env.sh"),
        "{err}"
    );
}

#[test]
fn without_cann_every_npu_command_says_what_it_looked_for() {
    let dir = tempfile::tempdir().unwrap();
    let model = common::fixture("models/demo");
    let model = model.to_str().unwrap();
    let boolq = common::fixture("eval/boolq-superglue.jsonl");
    let commands: [&[&str]; 4] = [
        &["selftest", "--device", "npu"],
        &[
            "generate", "--model", model, "--prompt", "x", "--device", "npu",
        ],
        &[
            "eval",
            "--model",
            model,
            "--task",
            "boolq",
            "--data",
            boolq.to_str().unwrap(),
            "--device",
            "npu",
        ],
        &["train", "--device", "npu", "--data-path", "unused"],
    ];
    for args in commands {
        let err = fails(on_toolkit(dir.path(), args));
        assert!(
            err.contains("CANN's libascendcl.so was not found") && err.contains("set_env.sh"),
            "{args:?}: {err}"
        );
    }
}

/// Calls into the stand-in in this process, with the message the runtime gives for a failure.
struct Runtime {
    api: ascendcl_sys::Functions,
    _library: ascendcl_sys::libloading::Library,
}

impl Runtime {
    fn open() -> Runtime {
        // SAFETY: the stand-in exports the runtime's functions with ascendcl-sys's types.
        let library = unsafe { ascendcl_sys::libloading::Library::new(stand_in()) }.unwrap();
        let api = unsafe { ascendcl_sys::Functions::resolve(&library) }.unwrap();
        Runtime {
            api,
            _library: library,
        }
    }

    /// `code`, and the recent error message when it is not success.
    fn said(&self, code: ascendcl_sys::aclError) -> (i32, String) {
        // SAFETY: the runtime's own NUL-terminated string.
        let message = unsafe { std::ffi::CStr::from_ptr((self.api.aclGetRecentErrMsg)()) };
        let message = if code == 0 {
            String::new()
        } else {
            message.to_string_lossy().into_owned()
        };
        (code, message)
    }
}

#[test]
fn the_stand_in_refuses_what_the_runtime_forbids() {
    use ascendcl_sys::*;
    use std::ffi::c_void;
    let rt = Runtime::open();
    let a = rt.api;
    let expect = |got: (i32, String), code: i32, text: &str| {
        assert!(
            got.0 == code && got.1.contains(text),
            "expected {code} '{text}', got {got:?}"
        );
    };
    let mut ptr: *mut c_void = std::ptr::null_mut();
    let mut count = 0u32;
    // SAFETY (whole test): every pointer passed is a valid out-pointer or a buffer of the size
    // given; the stand-in checks the device side.
    unsafe {
        expect(
            rt.said((a.aclrtGetDeviceCount)(&mut count)),
            100001,
            "before aclInit",
        );
        expect(rt.said((a.aclInit)(std::ptr::null())), 0, "");
        expect(
            rt.said((a.aclrtMalloc)(&mut ptr, 64, ACL_MEM_MALLOC_HUGE_FIRST)),
            107002,
            "no device set",
        );
        expect(
            rt.said((a.aclrtSetDevice)(3)),
            107001,
            "device 3 does not exist",
        );
        expect(rt.said((a.aclrtSetDevice)(0)), 0, "");
        expect(
            rt.said((a.aclrtMalloc)(&mut ptr, 0, ACL_MEM_MALLOC_HUGE_FIRST)),
            100000,
            "0 bytes",
        );
        expect(
            rt.said((a.aclrtMalloc)(&mut ptr, 100, ACL_MEM_MALLOC_HUGE_FIRST)),
            0,
            "",
        );
        assert_eq!(ptr as usize % 64, 0, "device addresses are 64-byte aligned");
        let host: Vec<u8> = (0..200).map(|i| i as u8).collect();
        let h2d = ACL_MEMCPY_HOST_TO_DEVICE;
        let src = host.as_ptr().cast();
        expect(
            rt.said((a.aclrtMemcpy)(ptr, 200, src, 200, h2d)),
            100000,
            "overrun the 100-byte allocation",
        );
        expect(
            rt.said((a.aclrtMemcpy)(ptr, 50, src, 100, h2d)),
            100000,
            "exceeds destMax",
        );
        let stray = (ptr as usize + 4096 * 1024) as *mut c_void;
        expect(
            rt.said((a.aclrtMemcpy)(stray, 8, src, 8, h2d)),
            100000,
            "is not device memory",
        );
        let mut stream: aclrtStream = std::ptr::null_mut();
        expect(rt.said((a.aclrtCreateStream)(&mut stream)), 0, "");
        expect(
            rt.said((a.aclrtMemcpyAsync)(ptr, 100, src, 100, h2d, stream)),
            0,
            "",
        );
        let mut back = vec![0u8; 100];
        let d2h = ACL_MEMCPY_DEVICE_TO_HOST;
        let dst = back.as_mut_ptr().cast();
        expect(
            rt.said((a.aclrtMemcpy)(dst, 100, ptr, 100, d2h)),
            100000,
            "before aclrtSynchronizeStream",
        );
        expect(rt.said((a.aclrtSynchronizeStream)(stream)), 0, "");
        expect(rt.said((a.aclrtMemcpy)(dst, 100, ptr, 100, d2h)), 0, "");
        assert_eq!(back, host[..100]);
        expect(
            rt.said((a.aclrtFree)(stray)),
            207002,
            "not the start of a live allocation",
        );
        expect(rt.said((a.aclrtDestroyStream)(stream)), 0, "");
        expect(
            rt.said((a.aclFinalize)()),
            100000,
            "1 allocations (100 bytes) and 0 streams never freed",
        );
    }
}

/// `mindkit args…` on the stand-in with its report written to `report`.
fn on_stand_in(dir: &Path, args: &[&str]) -> (Command, PathBuf) {
    let home = toolkit(&dir.join("toolkit"), stand_in());
    let report = dir.join("report.json");
    let mut cmd = on_toolkit(&home, args);
    cmd.env("MINDKIT_STAND_IN_REPORT", &report);
    (cmd, report)
}

#[test]
fn selftest_on_the_stand_in_checks_every_operator_against_the_cpu() {
    let dir = tempfile::tempdir().unwrap();
    let (cmd, report) = on_stand_in(dir.path(), &["selftest", "--device", "npu"]);
    let table = succeeds(cmd);
    assert!(
        table.starts_with("npu 0 (Ascend910B4) against the cpu backend"),
        "{table}"
    );
    for op in [
        "matmul_bwd",
        "attention_bwd",
        "cached_attention",
        "cross_entropy_bwd",
        "rope",
        "adamw",
        "sum_squares",
        "dropout",
        "attention dropout",
        "index_add_rows",
        "scale_rows",
        "row_dots",
        "gather / scatter",
        "grouped_matmul",
        "grouped_matmul_bwd",
        "softmax_topk",
        "permute",
        "permute_bwd",
        "unpermute",
        "unpermute_bwd",
        "layer_norm",
        "layer_norm_bwd",
        "squared_relu",
        "squared_relu_bwd",
    ] {
        assert!(
            table
                .lines()
                .any(|l| l.starts_with(op) && l.ends_with("ok")),
            "{op}: {table}"
        );
    }
    assert!(table.contains(" 0 failed"), "{table}");
    // With every kernel there, the fused operators run (attention dropout alone runs as
    // BatchMatMul and Softmax, with mindkit's mask).
    let counted = std::fs::read_to_string(report).unwrap();
    let fused = [
        "aclnnFlashAttentionVarLenScore",
        "aclnnFlashAttentionUnpaddingScoreGrad",
        "aclnnRotaryPositionEmbedding",
        "aclnnRotaryPositionEmbeddingGrad",
        "aclnnGroupedMatmulV4",
        "aclnnMoeTokenPermute",
        "aclnnMoeTokenPermuteGrad",
        "aclnnMoeTokenUnpermute",
        "aclnnMoeTokenUnpermuteGrad",
        "aclnnMoeGatingTopKSoftmax",
        "aclnnLayerNorm",
        "aclnnLayerNormBackward",
        "aclnnRelu",
    ];
    assert!(
        fused
            .iter()
            .all(|op| counted.contains(&format!("\"{op}\""))),
        "{counted}"
    );
}

#[test]
fn selftest_on_the_cpu_checks_its_gradients() {
    let table = succeeds(on_toolkit(
        Path::new("/nonexistent"),
        &["selftest", "--device", "cpu"],
    ));
    assert!(
        table.contains("finite differences") && table.contains("10 of 10 checks passed"),
        "{table}"
    );
}

#[test]
fn generate_and_eval_on_the_stand_in_equal_the_cpu() {
    let dir = tempfile::tempdir().unwrap();
    let model = common::fixture("models/demo");
    let model = model.to_str().unwrap();
    let generate = [
        "generate",
        "--model",
        model,
        "--prompt",
        "The cat",
        "--max-new-tokens",
        "12",
    ];
    let cpu = succeeds(on_toolkit(dir.path(), &generate));
    let npu = succeeds(on_stand_in(dir.path(), &[&generate[..], &["--device", "npu"]].concat()).0);
    assert_eq!(cpu, npu);
    let boolq = common::fixture("eval/boolq-superglue.jsonl");
    let results = |device: &str| {
        let out = dir.path().join(format!("{device}.json"));
        let eval = [
            "eval",
            "--model",
            model,
            "--task",
            "boolq",
            "--data",
            boolq.to_str().unwrap(),
            "--limit",
            "6",
            "--quiet",
            "--device",
            device,
            "--output",
            out.to_str().unwrap(),
        ];
        let (cmd, _) = on_stand_in(dir.path(), &eval);
        succeeds(cmd);
        let json: serde_json::Value = serde_json::from_slice(&std::fs::read(out).unwrap()).unwrap();
        json["results"]["boolq"]["acc,none"].as_f64().unwrap()
    };
    assert_eq!(results("cpu"), results("npu"));
}

/// A near-random mixture-of-experts model with multi-latent attention (and `extra` flags),
/// saved by one `mindkit train` iteration from scratch on the shipped corpus into `dir/moe`
/// (its logits spread wide: greedy tokens that differ where the computation does).
fn moe_mla_checkpoint(dir: &Path, extra: &str) -> PathBuf {
    let demo = common::fixture("models/demo");
    let prefix = dir.join("corpus");
    common::mindkit(&[
        &"preprocess",
        &"--input",
        &common::fixture("corpus/pretrain.jsonl"),
        &"--output-prefix",
        &prefix,
        &"--tokenizer",
        &demo,
        &"--append-eod",
        &"--quiet",
    ])
    .success();
    let data = dir.join("corpus_text_document");
    let save = dir.join("moe");
    let flags = "train --split 1 --seq-length 32 --micro-batch-size 2 --global-batch-size 4 \
        --train-iters 1 --lr 1e-4 --eval-iters 0 --quiet --num-layers 2 --hidden-size 64 \
        --ffn-hidden-size 128 --num-attention-heads 4 --max-position-embeddings 64 --swiglu \
        --disable-bias-linear --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 32 \
        --multi-latent-attention --qk-layernorm --q-lora-rank 16 --kv-lora-rank 16 \
        --qk-head-dim 16 --qk-pos-emb-head-dim 8 --v-head-dim 16 --init-method-std 0.2";
    let flags = flags.split_whitespace().chain(extra.split_whitespace());
    let mut args: Vec<std::ffi::OsString> = flags.map(Into::into).collect();
    args.extend([
        "--data-path".into(),
        data.into_os_string(),
        "--tokenizer-name-or-path".into(),
        demo.into_os_string(),
        "--save".into(),
        save.clone().into_os_string(),
    ]);
    let args: Vec<&dyn AsRef<std::ffi::OsStr>> = args.iter().map(|a| a as _).collect();
    common::mindkit(&args).success();
    save
}

#[test]
fn moe_and_mla_generation_on_the_stand_in_equals_the_cpu() {
    let dir = tempfile::tempdir().unwrap();
    let model = moe_mla_checkpoint(dir.path(), "");
    let (cpu, report) = generates_as_the_cpu(dir.path(), &model);
    // the tokens routed by the router's top-k on the device, permuted and their outputs
    // summed back there
    let counted = std::fs::read_to_string(report).unwrap();
    let routing = [
        "aclnnMoeGatingTopKSoftmax",
        "aclnnMoeTokenPermute",
        "aclnnMoeTokenUnpermute",
    ];
    for op in routing {
        assert!(counted.contains(&format!("\"{op}\"")), "{op}: {counted}");
    }
    // the same model with MindSpeed-LLM's --mla-mm-split up projections decodes so there too
    let split = dir.path().join("split");
    let layout = ["--mla-layout", "mindspeed-mm-split"];
    common::convert("megatron", &model, &split, &layout);
    assert_eq!(cpu, generates_as_the_cpu(dir.path(), &split).0);
}

/// What `mindkit generate` greedily decodes from `model` on the CPU, having checked that the
/// stand-in decodes the same; and the stand-in's report of the operators it ran.
fn generates_as_the_cpu(dir: &Path, model: &Path) -> (String, PathBuf) {
    let generate = [
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        "The cat",
        "--max-new-tokens",
        "12",
    ];
    let cpu = succeeds(on_toolkit(dir, &generate));
    let (cmd, report) = on_stand_in(dir, &[&generate[..], &["--device", "npu"]].concat());
    assert_eq!(cpu, succeeds(cmd), "{}", model.display());
    (cpu, report)
}

#[test]
fn pre_softmax_scaled_routing_on_the_stand_in_decodes_as_the_cpu() {
    let dir = tempfile::tempdir().unwrap();
    let flags = "--moe-router-pre-softmax --moe-router-topk-scaling-factor 2.5";
    let model = moe_mla_checkpoint(dir.path(), flags);
    let (_, report) = generates_as_the_cpu(dir.path(), &model);
    let counted = std::fs::read_to_string(report).unwrap();
    assert!(
        counted.contains("\"aclnnMoeGatingTopKSoftmax\""),
        "{counted}"
    );
}

#[test]
fn longcat_flash_generation_on_the_stand_in_equals_the_cpu() {
    // LongCat-Flash's paired layers: shortcut experts with zero-computation ones, scaled latents
    let dir = tempfile::tempdir().unwrap();
    let longcat = "--spec mindspeed_llm.tasks.models.spec.longcat_spec layer_spec \
        --enable-mla-scale-q-lora --enable-mla-scale-kv-lora --num-zero-experts 2 \
        --moe-router-load-balancing-type softmax_topk --moe-router-enable-expert-bias \
        --moe-router-topk-scaling-factor 6 --untie-embeddings-and-output-weights";
    let model = moe_mla_checkpoint(dir.path(), longcat);
    generates_as_the_cpu(dir.path(), &model);
}

/// Selftest on a stand-in without the kernels of `missing`: the one warning names the
/// operator and the composition `instead`, the `checks` rows pass, and the stand-in ran `used`
/// in place of `missing`.
fn falls_back(missing: &[&str], instead: &str, checks: &[&str], used: &[&str]) {
    falls_back_warning(missing, &[instead], checks, used);
}

/// [`falls_back`] with a warning for each of `instead`, the first naming `missing[0]`.
fn falls_back_warning(missing: &[&str], instead: &[&str], checks: &[&str], used: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let (mut cmd, report) = on_stand_in(dir.path(), &["selftest", "--device", "npu"]);
    cmd.env("MINDKIT_STAND_IN_NO_KERNEL", missing.join(","));
    let out = cmd.assert().success();
    let (table, err) = (
        String::from_utf8_lossy(&out.get_output().stdout),
        String::from_utf8_lossy(&out.get_output().stderr),
    );
    assert!(
        err.contains(&format!("no kernel of {}", missing[0]))
            && (instead.iter()).all(|i| err.contains(&format!("runs as {i}")))
            && err.matches("warning").count() == instead.len(),
        "{err}"
    );
    for check in checks {
        let rows: Vec<&str> = table
            .lines()
            .filter(|l| l.strip_prefix(check).is_some_and(|r| r.starts_with("  ")))
            .collect();
        // each dtype's row of each of the check's shapes
        assert!(
            !rows.is_empty()
                && rows.len().is_multiple_of(3)
                && rows.iter().all(|l| l.ends_with("ok")),
            "{table}"
        );
    }
    let counted = std::fs::read_to_string(report).unwrap();
    assert!(
        used.iter().all(|op| counted.contains(&format!("\"{op}\"")))
            && missing
                .iter()
                .all(|op| !counted.contains(&format!("\"{op}\""))),
        "{counted}"
    );
}

#[test]
fn without_a_rope_kernel_the_backend_says_so_and_falls_back() {
    falls_back(
        &["aclnnRotaryPositionEmbedding"],
        "aclnnMul + aclnnInplaceAdd",
        &["rope"],
        &["aclnnMul", "aclnnRotaryPositionEmbeddingGrad"],
    );
    falls_back(
        &["aclnnRotaryPositionEmbeddingGrad"],
        "its forward with −sin",
        &["rope"],
        &["aclnnRotaryPositionEmbedding"],
    );
}

#[test]
fn without_flash_attention_kernels_attention_runs_as_batch_matmul_and_softmax() {
    let attention = ["attention", "attention_bwd", "cached_attention"];
    let used = [
        "aclnnBatchMatMul",
        "aclnnSoftmax",
        "aclnnSoftmaxBackward",
        "aclnnInplaceMaskedFillScalar",
    ];
    let instead = "aclnnBatchMatMul + aclnnSoftmax(+Backward)";
    let both = [
        "aclnnFlashAttentionVarLenScore",
        "aclnnFlashAttentionUnpaddingScoreGrad",
    ];
    falls_back(&both, instead, &attention, &used);
    // A CANN with the forward kernel but not the backward's: the backward falls back.
    falls_back(&both[1..], instead, &attention, &used);
}

#[test]
fn without_a_grouped_matmul_kernel_experts_run_one_matmul_per_group() {
    falls_back(
        &["aclnnGroupedMatmulV4"],
        "one aclnnMatmul per group",
        &["grouped_matmul", "grouped_matmul_bwd"],
        &["aclnnMatmul"],
    );
}

#[test]
fn without_a_permutation_kernel_tokens_move_on_the_routing_kernel_then_by_index_gathers() {
    let checks = ["permute", "unpermute_bwd"];
    let routing = "aclnnMoeInitRoutingV2";
    falls_back(&["aclnnMoeTokenPermute"], routing, &checks, &[routing]);
    let both = ["aclnnMoeTokenPermute", routing];
    let instead = [routing, "aclnnIndexSelect"];
    falls_back_warning(&both, &instead, &checks, &["aclnnIndexSelect"]);
}

#[test]
fn without_unpermutation_kernels_sums_and_their_gradients_fall_back_to_their_neighbours() {
    let sum = "aclnnMoeTokenPermuteGrad";
    falls_back(&["aclnnMoeTokenUnpermute"], sum, &["unpermute"], &[sum]);
    let gather = "aclnnMoeTokenPermute";
    let grad = ["aclnnMoeTokenUnpermuteGrad"];
    falls_back(&grad, "the permutation", &["unpermute_bwd"], &[gather]);
    // and the permutation's gradient, once more the indexed add
    let add = "aclnnEmbeddingDenseBackward";
    falls_back(&[sum], add, &["permute_bwd"], &[add]);
}

#[test]
fn without_layer_norm_kernels_the_rows_are_normed_on_the_host() {
    falls_back(
        &["aclnnLayerNorm"],
        "the rows read back and normed on the host",
        &["layer_norm", "layer_norm_bwd"],
        &["aclnnLayerNormBackward"],
    );
    falls_back(
        &["aclnnLayerNormBackward"],
        "the rows read back and differentiated on the host",
        &["layer_norm_bwd"],
        &["aclnnLayerNorm"],
    );
}

#[test]
fn without_a_gating_kernel_the_router_logits_are_read_back_and_routed_on_the_host() {
    let instead = "the logits read back and routed on the host";
    falls_back(
        &["aclnnMoeGatingTopKSoftmax"],
        instead,
        &["softmax_topk"],
        &[],
    );
}

#[test]
fn permutations_sorted_otherwise_than_stably_are_noticed_and_replaced_by_index_gathers() {
    let dir = tempfile::tempdir().unwrap();
    let (mut cmd, _) = on_stand_in(dir.path(), &["selftest", "--device", "npu"]);
    cmd.env("MINDKIT_STAND_IN_UNSTABLE_SORT", "1");
    let out = cmd.assert().success();
    let (table, err) = (
        String::from_utf8_lossy(&out.get_output().stdout),
        String::from_utf8_lossy(&out.get_output().stderr),
    );
    // the permutation, then the routing operator that sorts as it does
    let why = "sorts equal expert indices out of their tokens' order: ";
    let instead = [
        "MoE token permutation runs as aclnnMoeInitRoutingV2",
        "MoE routing runs as aclnnIndexSelect",
    ];
    assert!(
        instead.iter().all(|i| err.contains(&format!("{why}{i}")))
            && err.matches("warning").count() == 2,
        "{err}"
    );
    assert!(table.contains(" 0 failed"), "{table}");
}

#[test]
fn npu_info_reads_every_other_device_when_one_cannot_be_opened() {
    let dir = tempfile::tempdir().unwrap();
    let home = toolkit(&dir.path().join("toolkit"), stand_in());
    let mut cmd = npu_info(&home);
    cmd.env("MINDKIT_STAND_IN_DEVICES", "3")
        .env("MINDKIT_STAND_IN_BUSY", "1");
    let out = cmd.assert().failure();
    let text = String::from_utf8(out.get_output().stdout.clone()).unwrap();
    let err = String::from_utf8(out.get_output().stderr.clone()).unwrap();
    assert!(text.contains("CANN     8.1.RC1"), "{text}");
    assert!(text.contains("devices  3"), "{text}");
    for id in [0, 2] {
        let line = format!("npu {id}    Ascend910B4, HBM 64.0 GiB free of 64.0 GiB");
        assert!(text.contains(&line), "{text}");
    }
    let busy = text
        .lines()
        .find(|l| l.starts_with("npu 1 "))
        .unwrap_or_default();
    assert!(
        busy.starts_with("npu 1    unavailable: aclrtSetDevice failed with ACL error 507033: ")
            && busy.contains("device 1 could not be set up"),
        "{text}"
    );
    assert!(err.contains("device(s) [1] could not be opened"), "{err}");
}
