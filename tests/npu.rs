//! `mindkit npu info` through the whole runtime-loading path, on a stub `libascendcl.so` built
//! here against CANN's own headers (so its functions have the headers' types): two fake 910B
//! devices; a stub that lacks a function; no library at all. The stub only answers these calls:
//! it is not the validating CANN stand-in the NPU backend will be tested on.

mod common;

use assert_cmd::Command;
use std::path::{Path, PathBuf};

const STUB: &str = r#"
#include <string.h>
#include "acl/acl.h"
static int inits, current = -1;
aclError aclInit(const char *configPath) { (void)configPath; return inits++ ? ACL_ERROR_REPEAT_INITIALIZE : ACL_SUCCESS; }
aclError aclFinalize(void) { return inits-- > 0 ? ACL_SUCCESS : 100037; }
const char *aclGetRecentErrMsg(void) { return "EE1001: the stub was asked for a device it does not have"; }
const char *aclrtGetSocName(void) { return "Ascend910B4"; }
aclError aclsysGetCANNVersion(aclCANNPackageName name, aclCANNPackageVersion *v) {
    if (name != ACL_PKG_NAME_CANN) return ACL_ERROR_INVALID_PARAM;
    strcpy(v->version, "8.1.RC1"); return ACL_SUCCESS; }
aclError aclrtGetDeviceCount(uint32_t *count) { *count = DEVICES; return ACL_SUCCESS; }
aclError aclrtSetDevice(int32_t id) { if (id >= DEVICES) return 107001; current = id; return ACL_SUCCESS; }
aclError aclrtResetDevice(int32_t id) { (void)id; current = -1; return ACL_SUCCESS; }
aclError aclrtGetMemInfo(aclrtMemAttr attr, size_t *free, size_t *total) {
    if (current < 0 || attr != ACL_HBM_MEM) return ACL_ERROR_INVALID_PARAM;
    *total = (size_t)64 << 30; *free = (size_t)(60 - current) << 30; return ACL_SUCCESS; }
aclError aclrtCreateStream(aclrtStream *s) { *s = 0; return ACL_SUCCESS; }
aclError aclrtDestroyStream(aclrtStream s) { (void)s; return ACL_SUCCESS; }
aclError aclrtSynchronizeStream(aclrtStream s) { (void)s; return ACL_SUCCESS; }
aclError aclrtMalloc(void **p, size_t n, aclrtMemMallocPolicy policy) { (void)p; (void)n; (void)policy; return 207001; }
aclError aclrtFree(void *p) { (void)p; return ACL_SUCCESS; }
aclError aclrtMemcpy(void *d, size_t m, const void *s, size_t n, aclrtMemcpyKind k) { (void)d; (void)m; (void)s; (void)n; (void)k; return 207001; }
#ifndef DROP_ASYNC
aclError aclrtMemcpyAsync(void *d, size_t m, const void *s, size_t n, aclrtMemcpyKind k, aclrtStream st) { (void)d; (void)m; (void)s; (void)n; (void)k; (void)st; return 207001; }
#endif
"#;

/// A toolkit directory whose `lib64/libascendcl.so` is the stub built with `defines`.
fn stub_toolkit(dir: &Path, include: &[PathBuf], defines: &[&str]) -> PathBuf {
    let lib64 = dir.join("lib64");
    std::fs::create_dir_all(&lib64).unwrap();
    std::fs::write(dir.join("stub.c"), STUB).unwrap();
    let out = std::process::Command::new("cc")
        .args(["-std=gnu11", "-Werror", "-Wall", "-shared", "-fPIC", "-I"])
        .arg(&include[0])
        .args(defines)
        .arg(dir.join("stub.c"))
        .arg("-o")
        .arg(lib64.join("libascendcl.so"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    dir.to_path_buf()
}

fn npu_info(toolkit: &Path) -> assert_cmd::assert::Assert {
    Command::cargo_bin("mindkit")
        .unwrap()
        .args(["npu", "info"])
        .env("ASCEND_TOOLKIT_HOME", toolkit)
        .env_remove("ASCEND_HOME_PATH")
        .assert()
}

#[test]
fn npu_info_reports_each_device_of_the_runtime() {
    let Some(include) = common::cann_include() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let toolkit = stub_toolkit(dir.path(), &include, &["-DDEVICES=2"]);
    let out = npu_info(&toolkit).success().get_output().stdout.clone();
    let text = String::from_utf8(out).unwrap();
    assert!(text.contains("CANN     8.1.RC1"), "{text}");
    assert!(text.contains("devices  2"), "{text}");
    assert!(text.contains("HCCL     libhccl.so not found"), "{text}");
    assert!(
        text.contains("npu 0    Ascend910B4, HBM 60.0 GiB free of 64.0 GiB"),
        "{text}"
    );
    assert!(
        text.contains("npu 1    Ascend910B4, HBM 59.0 GiB free of 64.0 GiB"),
        "{text}"
    );
    assert!(
        text.contains(&toolkit.join("lib64/libascendcl.so").display().to_string()),
        "{text}"
    );
}

#[test]
fn a_runtime_without_a_needed_function_is_named() {
    let Some(include) = common::cann_include() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let toolkit = stub_toolkit(dir.path(), &include, &["-DDEVICES=1", "-DDROP_ASYNC"]);
    let err = npu_info(&toolkit).failure().get_output().stderr.clone();
    let err = String::from_utf8(err).unwrap();
    assert!(err.contains("has no function aclrtMemcpyAsync"), "{err}");
}

#[test]
fn without_cann_the_error_says_where_it_looked_and_what_to_do() {
    let dir = tempfile::tempdir().unwrap();
    let err = npu_info(dir.path()).failure().get_output().stderr.clone();
    let err = String::from_utf8(err).unwrap();
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
