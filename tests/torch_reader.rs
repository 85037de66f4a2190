//! The safe `.pt` reader against files written by `torch.save` itself
//! (fixtures/torch, made by fixtures/gen/make_torch_fixtures.py).

use mindkit::ckpt::torch::pickle::Value;
use mindkit::ckpt::torch::TorchFile;
use mindkit::tensor::DType;
use serde_json::Value as Json;
use std::path::{Path, PathBuf};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/torch")
        .join(name)
}

fn torch_name(d: DType) -> &'static str {
    match d {
        DType::F64 => "float64",
        DType::F32 => "float32",
        DType::F16 => "float16",
        DType::BF16 => "bfloat16",
        DType::I64 => "int64",
        DType::I32 => "int32",
        DType::I16 => "int16",
        DType::I8 => "int8",
        DType::U8 => "uint8",
        DType::Bool => "bool",
        DType::F8E4M3 => "float8_e4m3fn",
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Every tensor torch listed in expected.json has its dtype, shape and bytes.
fn check_tensors(file: &str, tensors: &Value) {
    let expected: Json =
        serde_json::from_slice(&std::fs::read(fixture("expected.json")).unwrap()).unwrap();
    let pt = TorchFile::open(&fixture(file)).unwrap();
    let tensors = if file == "megatron_like.pt" {
        pt.root().get("model").unwrap()
    } else {
        tensors
    };
    let Value::Dict(items) = tensors else {
        panic!("{file}: not a dict")
    };
    let want = expected[file].as_object().unwrap();
    assert_eq!(items.len(), want.len(), "{file}: tensor count");
    for (name, w) in want {
        let Some(Value::Tensor(t)) = tensors.get(name) else {
            panic!("{file}: {name} missing")
        };
        assert_eq!(
            torch_name(t.storage.dtype),
            w["dtype"].as_str().unwrap(),
            "{file}: {name} dtype"
        );
        let shape: Vec<u64> = serde_json::from_value(w["shape"].clone()).unwrap();
        assert_eq!(t.shape, shape, "{file}: {name} shape");
        let bytes = pt.tensor_bytes(name, t).unwrap();
        assert_eq!(
            hex(bytes),
            w["hex"].as_str().unwrap(),
            "{file}: {name} bytes"
        );
    }
}

#[test]
fn state_dicts_in_protocols_2_and_4() {
    for file in ["state_dict_p2.pt", "state_dict_p4.pt"] {
        let pt = TorchFile::open(&fixture(file)).unwrap();
        check_tensors(file, pt.root());
    }
}

#[test]
fn shared_storage_views_keep_their_offset() {
    let pt = TorchFile::open(&fixture("state_dict_p2.pt")).unwrap();
    let (Some(Value::Tensor(big)), Some(Value::Tensor(slice))) =
        (pt.root().get("big"), pt.root().get("slice_of_big"))
    else {
        panic!("tensors missing")
    };
    assert_eq!(big.storage.key, slice.storage.key);
    assert_eq!(slice.offset, 5);
}

#[test]
fn megatron_checkpoint_dict_and_args() {
    let pt = TorchFile::open(&fixture("megatron_like.pt")).unwrap();
    check_tensors("megatron_like.pt", pt.root());
    let root = pt.root();
    assert_eq!(root.get("checkpoint_version"), Some(&Value::Float(3.0)));
    assert_eq!(root.get("iteration"), Some(&Value::Int(7)));
    let args = root.get("args").unwrap();
    assert!(matches!(args, Value::Namespace(_)), "{args:?}");
    assert_eq!(args.get("num_layers"), Some(&Value::Int(2)));
    assert_eq!(
        args.get("params_dtype"),
        Some(&Value::TorchDType(DType::BF16))
    );
    assert_eq!(args.get("ffn_hidden_size"), Some(&Value::None));
    assert_eq!(
        args.get("tokenizer_type"),
        Some(&Value::Str("Llama2Tokenizer".into()))
    );
    assert_eq!(args.get("bf16"), Some(&Value::Bool(true)));
}

#[test]
fn pickled_code_is_refused_by_name() {
    let err = TorchFile::open(&fixture("evil.pt"))
        .err()
        .expect("evil.pt must be refused")
        .to_string();
    assert!(
        err.contains("evil.pt") && err.contains("forbidden global") && err.contains("system"),
        "{err}"
    );
}

#[test]
fn non_contiguous_views_are_refused_by_name() {
    let pt = TorchFile::open(&fixture("noncontiguous.pt")).unwrap();
    let Some(Value::Tensor(t)) = pt.root().get("t") else {
        panic!()
    };
    assert_eq!(t.stride, vec![1, 3]);
    let err = pt.tensor_bytes("t", t).unwrap_err().to_string();
    assert!(
        err.contains("tensor t") && err.contains("non-contiguous"),
        "{err}"
    );
}

#[test]
fn truncated_and_corrupt_files_are_errors_not_panics() {
    let bytes = std::fs::read(fixture("state_dict_p2.pt")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("damaged.pt");
    for cut in (0..bytes.len()).step_by(97) {
        std::fs::write(&path, &bytes[..cut]).unwrap();
        assert!(TorchFile::open(&path).is_err(), "truncated at {cut} opened");
    }
    for at in (0..bytes.len()).step_by(13) {
        let mut damaged = bytes.clone();
        damaged[at] ^= 0xa5;
        std::fs::write(&path, &damaged).unwrap();
        if let Ok(pt) = TorchFile::open(&path) {
            if let Value::Dict(items) = pt.root() {
                for (k, v) in items {
                    if let (Value::Str(name), Value::Tensor(t)) = (k, v) {
                        let _ = pt.tensor_bytes(name, t);
                    }
                }
            }
        }
    }
    std::fs::write(&path, b"\x80\x02}q\x00.").unwrap();
    let err = TorchFile::open(&path).err().unwrap().to_string();
    assert!(err.contains("legacy"), "{err}");
}

/// `bytes` with one byte flipped in the middle of the stored record whose name ends in `suffix`.
fn flip_in_record(bytes: &[u8], suffix: &str) -> Vec<u8> {
    let mut zip = zip::ZipArchive::new(std::io::Cursor::new(bytes)).unwrap();
    let names: Vec<String> = zip.file_names().map(str::to_string).collect();
    let name = names.iter().find(|n| n.ends_with(suffix)).unwrap();
    let entry = zip.by_name(name).unwrap();
    let at = (entry.data_start() + entry.size() / 2) as usize;
    let mut damaged = bytes.to_vec();
    damaged[at] ^= 0x40;
    damaged
}

#[test]
fn a_flipped_byte_in_a_tensor_fails_its_records_crc() {
    let bytes = std::fs::read(fixture("state_dict_p2.pt")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("flipped.pt");
    std::fs::write(&path, flip_in_record(&bytes, "/data/0")).unwrap();
    // The pickle is intact: the file opens; the damaged storage's tensors do not read.
    let pt = TorchFile::open(&path).unwrap();
    let Value::Dict(items) = pt.root() else {
        panic!("not a dict")
    };
    let mut refused = 0;
    for (k, v) in items {
        let (Value::Str(name), Value::Tensor(t)) = (k, v) else {
            continue;
        };
        if t.storage.key != "0" {
            pt.read_tensor(name, t).unwrap();
            continue;
        }
        for err in [
            pt.read_tensor(name, t).err().map(|e| e.to_string()),
            pt.tensor_bytes(name, t).err().map(|e| e.to_string()),
        ] {
            let err = err.expect("a damaged tensor was served");
            assert!(err.contains("CRC") && err.contains("data/0"), "{err}");
        }
        refused += 1;
    }
    assert!(refused > 0);
    // A damaged data.pkl is refused when the file is opened.
    std::fs::write(&path, flip_in_record(&bytes, "/data.pkl")).unwrap();
    if let Err(e) = TorchFile::open(&path) {
        assert!(e.to_string().contains("data.pkl"), "{e}");
    } else {
        panic!("a damaged data.pkl opened");
    }
}
