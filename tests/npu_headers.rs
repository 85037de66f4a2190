//! `ascendcl-sys`'s and `hccl-sys`'s declarations against CANN's own headers: a C++ file generated
//! from their `FUNCTIONS`, `CONSTANTS` and `STRUCT_SIZES` is compiled with `-Werror` against the
//! `acl/*.h` and `hccl/*.h` the torch-npu wheel ships (C++, since `hccl_types.h` sizes an array by
//! a `const` variable) and run: a function whose type differs from the header's fails the build
//! (`std::is_same` on the function's type), a constant or struct size that differs fails the run;
//! each is named.

mod common;

use std::path::PathBuf;
use std::process::Command;

/// The C spelling of a Rust type of the declarations (`*mut u32` → `uint32_t *`, const written
/// after what it qualifies: `*const *const T` → `T const * const *`); C typedef names the crates
/// re-declare (`aclError`, `aclrtStream`, `HcclComm`, `aclTensor`, …) are the same in both.
fn c_type(rust: &str) -> String {
    let t: String = rust.split_whitespace().collect();
    if let Some(inner) = t.strip_prefix("*const") {
        return format!("{} const *", c_type(inner));
    }
    if let Some(inner) = t.strip_prefix("*mut") {
        return format!("{} *", c_type(inner));
    }
    match t.as_str() {
        "()" | "c_void" => "void",
        "c_char" => "char",
        "c_int" => "int",
        "bool" => "bool",
        "i8" => "int8_t",
        "i32" => "int32_t",
        "u32" => "uint32_t",
        "i64" => "int64_t",
        "u64" => "uint64_t",
        "usize" => "size_t",
        "f32" => "float",
        "f64" => "double",
        other => other,
    }
    .to_string()
}

/// What one crate declares, for the generated check.
struct Declarations {
    functions: &'static [(&'static str, &'static str, &'static [&'static str])],
    constants: &'static [(&'static str, i64)],
    structs: &'static [(&'static str, usize)],
}

/// Declarations checked against CANN's own headers (ascendcl-sys's runtime, hccl-sys) and
/// against `crates/ascendcl-sys/reference/aclnn-8.1.RC1.h` (aclnn, whose headers no fetchable
/// package ships).
const CRATES: [Declarations; 4] = [
    Declarations {
        functions: ascendcl_sys::FUNCTIONS,
        constants: ascendcl_sys::CONSTANTS,
        structs: ascendcl_sys::STRUCT_SIZES,
    },
    Declarations {
        functions: hccl_sys::FUNCTIONS,
        constants: hccl_sys::CONSTANTS,
        structs: hccl_sys::STRUCT_SIZES,
    },
    Declarations {
        functions: ascendcl_sys::aclnn::nnopbase::FUNCTIONS,
        constants: &[],
        structs: &[],
    },
    Declarations {
        functions: ascendcl_sys::aclnn::opapi::FUNCTIONS,
        constants: &[],
        structs: &[],
    },
];

/// The transcribed aclnn header.
fn aclnn_reference() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("crates/ascendcl-sys/reference")
}

fn check_source(crates: &[Declarations]) -> String {
    let mut c = String::from(
        "#include <cstdio>\n#include <cstdint>\n#include <type_traits>\n\
         #include \"acl/acl.h\"\n#include \"hccl/hccl.h\"\n#include \"aclnn-8.1.RC1.h\"\n\n",
    );
    for (name, ret, params) in crates.iter().flat_map(|d| d.functions) {
        let params: Vec<String> = params.iter().map(|p| c_type(p)).collect();
        c += &format!(
            "static_assert(std::is_same<decltype(&{name}), {} (*)({})>::value, \
             \"{name}: the header's type differs from the Rust declaration\");\n",
            c_type(ret),
            params.join(", ")
        );
    }
    c += "\nint main() {\n    int bad = 0;\n";
    for (name, value) in crates.iter().flat_map(|d| d.constants) {
        c += &format!(
            "    if ((long long)({name}) != {value}LL) {{ std::printf(\"%s: header %lld, Rust {value}\\n\", \"{name}\", (long long)({name})); bad = 1; }}\n"
        );
    }
    for (name, size) in crates.iter().flat_map(|d| d.structs) {
        c += &format!(
            "    if (sizeof({name}) != {size}) {{ std::printf(\"%s: header %zu bytes, Rust {size}\\n\", \"{name}\", sizeof({name})); bad = 1; }}\n"
        );
    }
    c += "    return bad;\n}\n";
    c
}

/// Compile `source` as C++ against CANN's headers (and, with `output`, link and run it).
fn compile(
    include: &[PathBuf],
    source: &str,
    output: Option<&std::path::Path>,
) -> std::process::Output {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("check.cpp");
    std::fs::write(&file, source).unwrap();
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let mut cmd = Command::new(&cxx);
    cmd.args([
        "-std=c++17",
        "-Werror",
        "-Wall",
        "-Wno-deprecated-declarations",
        "-Wno-unused-variable",
    ]);
    for dir in include.iter().chain([&aclnn_reference()]) {
        cmd.arg("-I").arg(dir);
    }
    match output {
        Some(binary) => cmd.arg(&file).arg("-o").arg(binary),
        None => cmd.arg("-fsyntax-only").arg(&file),
    };
    cmd.output().unwrap_or_else(|e| panic!("{cxx}: {e}"))
}

#[test]
fn declarations_match_cann_headers() {
    let Some(include) = common::cann_include() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let binary = dir.path().join("check");
    let build = compile(&include, &check_source(&CRATES), Some(&binary));
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
    let checked: usize = CRATES
        .iter()
        .map(|d| d.functions.len() + d.constants.len())
        .sum();
    assert!(checked > 75, "only {checked} declarations checked");
}

#[test]
fn a_wrong_declaration_fails_the_check() {
    assert_eq!(c_type("*mut *mut c_void"), "void * *");
    assert_eq!(c_type("* const c_char"), "char const *");
    assert_eq!(
        c_type("*const *const aclTensor"),
        "aclTensor const * const *"
    );
    assert_eq!(c_type("HcclComm"), "HcclComm");
    let Some(include) = common::cann_include() else {
        return;
    };
    // aclrtGetDeviceCount takes uint32_t *, HcclAllReduce a uint64_t count: declared otherwise,
    // and a constant with another value, the check must refuse each.
    let wrong =
        |f: &'static str, ret: &'static str, params: &'static [&'static str]| Declarations {
            functions: Box::leak(Box::new([(f, ret, params)])),
            constants: &[],
            structs: &[],
        };
    for bad in [
        wrong("aclrtGetDeviceCount", "aclError", &["*mut i32"]),
        wrong(
            "aclCreateIntArray",
            "*mut aclIntArray",
            &["*const i64", "u32"],
        ),
        wrong(
            "HcclAllReduce",
            "HcclResult",
            &[
                "*mut c_void",
                "*mut c_void",
                "u32",
                "HcclDataType",
                "HcclReduceOp",
                "HcclComm",
                "aclrtStream",
            ],
        ),
    ] {
        let name = bad.functions[0].0;
        let build = compile(&include, &check_source(&[bad]), None);
        let err = String::from_utf8_lossy(&build.stderr);
        assert!(
            !build.status.success() && err.contains(name),
            "{name} passed: {err}"
        );
    }
    let dir = tempfile::tempdir().unwrap();
    let binary = dir.path().join("check");
    let constant = Declarations {
        functions: &[],
        constants: &[("HCCL_DATA_TYPE_BFP16", 27)],
        structs: &[],
    };
    assert!(compile(&include, &check_source(&[constant]), Some(&binary))
        .status
        .success());
    let run = Command::new(&binary).output().unwrap();
    assert!(!run.status.success());
    assert!(
        String::from_utf8_lossy(&run.stdout).contains("HCCL_DATA_TYPE_BFP16: header 11, Rust 27")
    );
}
