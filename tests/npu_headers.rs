//! `ascendcl-sys`'s declarations against CANN's own headers: a C file generated from
//! `ascendcl_sys::{FUNCTIONS, CONSTANTS, STRUCT_SIZES}` is compiled with `-Werror` against the
//! `acl/*.h` the torch-npu wheel ships (fetched by `scripts/fetch-test-assets.sh` into
//! `$MINDKIT_ASSETS/cann/include`) and run: a function whose type differs from the header's fails
//! the build, a constant or struct size that differs fails the run, each named.

use std::path::PathBuf;
use std::process::Command;

/// The C spelling of a Rust type of the declarations (`*mut u32` → `uint32_t *`); C typedef
/// names the crate re-declares (`aclError`, `aclrtStream`, …) are the same in both.
fn c_type(rust: &str) -> String {
    let t: String = rust.split_whitespace().collect();
    if let Some(inner) = t.strip_prefix("*const") {
        return format!("const {} *", c_type(inner));
    }
    if let Some(inner) = t.strip_prefix("*mut") {
        return format!("{} *", c_type(inner));
    }
    match t.as_str() {
        "()" => "void",
        "c_void" => "void",
        "c_char" => "char",
        "c_int" => "int",
        "i32" => "int32_t",
        "u32" => "uint32_t",
        "i64" => "int64_t",
        "u64" => "uint64_t",
        "usize" => "size_t",
        "f32" => "float",
        other => other,
    }
    .to_string()
}

fn check_source() -> String {
    let mut c = String::from("#include <stdio.h>\n#include <stdint.h>\n#include \"acl/acl.h\"\n\n");
    for (name, ret, params) in ascendcl_sys::FUNCTIONS {
        let params: Vec<String> = params.iter().map(|p| c_type(p)).collect();
        let params = if params.is_empty() {
            "void".to_string()
        } else {
            params.join(", ")
        };
        c += &format!(
            "_Static_assert(__builtin_types_compatible_p(__typeof__(&{name}), {} (*)({params})), \
             \"{name}: the header's type differs from ascendcl-sys's\");\n",
            c_type(ret)
        );
    }
    c += "\nint main(void) {\n    int bad = 0;\n";
    for (name, value) in ascendcl_sys::CONSTANTS {
        c += &format!(
            "    if ((long long)({name}) != {value}LL) {{ printf(\"%s: header %lld, ascendcl-sys {value}\\n\", \"{name}\", (long long)({name})); bad = 1; }}\n"
        );
    }
    for (name, size) in ascendcl_sys::STRUCT_SIZES {
        c += &format!(
            "    if (sizeof({name}) != {size}) {{ printf(\"%s: header %zu bytes, ascendcl-sys {size}\\n\", \"{name}\", sizeof({name})); bad = 1; }}\n"
        );
    }
    c += "    return bad;\n}\n";
    c
}

#[test]
fn declarations_match_cann_headers() {
    let Some(assets) = std::env::var_os("MINDKIT_ASSETS") else {
        eprintln!("SKIPPED: MINDKIT_ASSETS is unset (scripts/fetch-test-assets.sh fetches CANN's headers)");
        return;
    };
    let include = PathBuf::from(assets).join("cann/include");
    assert!(
        include.join("acl/acl.h").is_file(),
        "{}: no acl/acl.h (run scripts/fetch-test-assets.sh)",
        include.display()
    );
    let dir = tempfile::tempdir().unwrap();
    let (source, binary) = (dir.path().join("check.c"), dir.path().join("check"));
    std::fs::write(&source, check_source()).unwrap();
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let build = Command::new(&cc)
        .args([
            "-std=gnu11",
            "-Werror",
            "-Wall",
            "-Wno-deprecated-declarations",
            "-I",
        ])
        .arg(&include)
        .arg(&source)
        .arg("-o")
        .arg(&binary)
        .output()
        .unwrap_or_else(|e| panic!("{cc}: {e}"));
    assert!(
        build.status.success(),
        "{}",
        String::from_utf8_lossy(&build.stderr)
    );
    let run = Command::new(&binary).output().unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stdout)
    );
    let checked = ascendcl_sys::FUNCTIONS.len() + ascendcl_sys::CONSTANTS.len();
    assert!(checked > 20, "only {checked} declarations checked");
}

#[test]
fn a_wrong_declaration_fails_the_check() {
    assert_eq!(c_type("*mut *mut c_void"), "void * *");
    assert_eq!(c_type("* const c_char"), "const char *");
    assert_eq!(c_type("aclrtStream"), "aclrtStream");
    let Some(assets) = std::env::var_os("MINDKIT_ASSETS") else {
        eprintln!("SKIPPED: MINDKIT_ASSETS is unset");
        return;
    };
    let include = PathBuf::from(assets).join("cann/include");
    let dir = tempfile::tempdir().unwrap();
    let source = dir.path().join("wrong.c");
    // aclrtGetDeviceCount takes uint32_t *: declared as int32_t * the check must refuse it.
    std::fs::write(
        &source,
        "#include <stdint.h>\n#include \"acl/acl.h\"\n_Static_assert(__builtin_types_compatible_p(\
         __typeof__(&aclrtGetDeviceCount), aclError (*)(int32_t *)), \"aclrtGetDeviceCount\");\n",
    )
    .unwrap();
    let build = Command::new("cc")
        .args(["-std=gnu11", "-Werror", "-fsyntax-only", "-I"])
        .arg(&include)
        .arg(&source)
        .output()
        .unwrap();
    assert!(!build.status.success(), "a wrong type passed the check");
}
