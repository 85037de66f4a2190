//! Helpers shared by the integration tests (convert, lora, cli).
#![allow(dead_code)] // each test crate uses its own subset

use assert_cmd::Command;
use std::path::{Path, PathBuf};

/// A path under fixtures/.
pub fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(rel)
}

/// Run the mindkit binary with `args`.
pub fn mindkit(args: &[&dyn AsRef<std::ffi::OsStr>]) -> assert_cmd::assert::Assert {
    let mut cmd = Command::cargo_bin("mindkit").unwrap();
    for a in args {
        cmd.arg(a);
    }
    cmd.assert()
}

/// Run the mindkit binary with `args` under umask 022; it must succeed.
pub fn run_with_umask_022(args: &[&dyn AsRef<std::ffi::OsStr>]) {
    let status = std::process::Command::new("sh")
        .args(["-c", "umask 022; exec \"$0\" \"$@\""])
        .arg(assert_cmd::cargo::cargo_bin("mindkit"))
        .args(args.iter().map(|a| a.as_ref()))
        .status()
        .unwrap();
    assert!(status.success());
}

/// `mindkit convert --quiet --to TO --input IN --output OUT EXTRA…`.
pub fn run_convert(
    to: &str,
    input: &Path,
    output: &Path,
    extra: &[&str],
) -> assert_cmd::assert::Assert {
    let mut cmd = Command::cargo_bin("mindkit").unwrap();
    cmd.args(["convert", "--quiet", "--to", to, "--input"])
        .arg(input)
        .arg("--output")
        .arg(output)
        .args(extra);
    cmd.assert()
}

/// A conversion that must succeed.
pub fn convert(to: &str, input: &Path, output: &Path, extra: &[&str]) {
    run_convert(to, input, output, extra).success();
}

/// `mindkit lora merge --quiet --base BASE --adapter ADAPTER --output OUT EXTRA…`.
pub fn lora_merge(
    base: &Path,
    adapter: &Path,
    out: &Path,
    extra: &[&str],
) -> assert_cmd::assert::Assert {
    let mut cmd = Command::cargo_bin("mindkit").unwrap();
    cmd.args(["lora", "merge", "--quiet", "--base"])
        .arg(base)
        .arg("--adapter")
        .arg(adapter)
        .arg("--output")
        .arg(out)
        .args(extra);
    cmd.assert()
}

/// Stderr of a [`lora_merge`] that must exit 1.
pub fn lora_merge_err(base: &Path, adapter: &Path, out: &Path, extra: &[&str]) -> String {
    let o = lora_merge(base, adapter, out, extra)
        .code(1)
        .get_output()
        .clone();
    String::from_utf8(o.stderr).unwrap()
}

/// Temporary directories mindkit left in `dir`.
pub fn leftovers(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".mindkit"))
        .collect()
}

/// Recursive copy.
pub fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            copy_dir(&p, &to.join(e.file_name()));
        } else {
            std::fs::copy(&p, to.join(e.file_name())).unwrap();
        }
    }
}

/// The include directories of CANN's headers as the torch-npu wheel ships them
/// (`$MINDKIT_ASSETS/cann/include`: `third_party/acl/inc`, `third_party/hccl/inc`, and the root
/// that `hccl.h`'s own include is relative to), or None, said on stderr, when the assets are not
/// fetched (scripts/fetch-test-assets.sh).
pub fn cann_include() -> Option<Vec<PathBuf>> {
    let Some(assets) = std::env::var_os("MINDKIT_ASSETS") else {
        eprintln!("SKIPPED: MINDKIT_ASSETS is unset (scripts/fetch-test-assets.sh fetches CANN's headers)");
        return None;
    };
    let root = PathBuf::from(assets).join("cann/include");
    let dirs = vec![
        root.join("third_party/acl/inc"),
        root.join("third_party/hccl/inc"),
        root.clone(),
    ];
    assert!(
        dirs[0].join("acl/acl.h").is_file() && dirs[1].join("hccl/hccl.h").is_file(),
        "{}: no third_party/acl/inc/acl/acl.h or hccl.h (run scripts/fetch-test-assets.sh)",
        root.display()
    );
    Some(dirs)
}

/// The stand-in `libascendcl.so`, built once per test run.
pub fn stand_in() -> &'static Path {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT.get_or_init(|| {
        let target = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/stand-in");
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let out = std::process::Command::new(cargo)
            .args(["build", "--quiet", "-p", "cann-stand-in", "--target-dir"])
            .arg(&target)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        target.join("debug/libascendcl.so")
    })
}

/// A toolkit directory whose `lib64/libascendcl.so` is `library`, with `libnnopbase.so`,
/// `libopapi.so` and `libhccl.so` linked to it (the stand-in exports all four libraries' functions; the
/// dynamic loader maps the one file once, so they share its state).
pub fn toolkit(dir: &Path, library: &Path) -> PathBuf {
    if dir.join("lib64/libascendcl.so").exists() {
        return dir.to_path_buf();
    }
    std::fs::create_dir_all(dir.join("lib64")).unwrap();
    std::fs::copy(library, dir.join("lib64/libascendcl.so")).unwrap();
    for alias in ["libnnopbase.so", "libopapi.so", "libhccl.so"] {
        std::os::unix::fs::symlink("libascendcl.so", dir.join("lib64").join(alias)).unwrap();
    }
    dir.to_path_buf()
}
