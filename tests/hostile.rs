//! Hostile and malformed checkpoints (issue 17): deep pickles, configuration fields of the wrong
//! type or out of range, LoRA scales that overflow, missing rank files, an adapter trained on
//! another base. Each must end in a clear error (exit 1) naming the file and field, and leave
//! no output behind — or, for the adapter, a warning.

mod common;

use common::{convert, copy_dir, fixture, leftovers, lora_merge, lora_merge_err, mindkit as run};
use serde_json::{json, Value as Json};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

/// Rewrite the `.pt` file at `path` with `edit` applied to its `data.pkl` (other records kept).
fn edit_pickle(path: &Path, edit: impl Fn(&mut Vec<u8>)) {
    let bytes = std::fs::read(path).unwrap();
    let mut archive = zip::ZipArchive::new(std::io::Cursor::new(bytes)).unwrap();
    let mut out = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
    let stored =
        zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored);
    for i in 0..archive.len() {
        let mut entry = archive.by_index(i).unwrap();
        let name = entry.name().to_string();
        let mut data = Vec::new();
        entry.read_to_end(&mut data).unwrap();
        if name.ends_with("/data.pkl") {
            edit(&mut data);
        }
        out.start_file(name, stored).unwrap();
        out.write_all(&data).unwrap();
    }
    std::fs::write(path, out.finish().unwrap().into_inner()).unwrap();
}

/// `root["nest"] = [[[…]]]`, `lists` lists deep, added at the end of a dict-rooted pickle.
fn add_nested_lists(pickle: &mut Vec<u8>, lists: usize) {
    assert_eq!(pickle.pop(), Some(b'.'));
    pickle.extend_from_slice(b"X\x04\x00\x00\x00nest");
    pickle.extend(std::iter::repeat_n(b']', lists));
    pickle.extend(std::iter::repeat_n(b'a', lists - 1));
    pickle.extend_from_slice(b"s.");
}

/// The llama fixture converted to a TP-`tp` Megatron checkpoint under `dir`.
fn megatron_llama(dir: &Path, tp: usize) -> PathBuf {
    let out = dir.join(format!("mg-tp{tp}"));
    convert(
        "megatron",
        &fixture("models/llama"),
        &out,
        &["--tp", &tp.to_string()],
    );
    out
}

fn rank_file(ckpt: &Path, tp: usize) -> PathBuf {
    ckpt.join(format!("iter_0000001/mp_rank_{tp:02}/model_optim_rng.pt"))
}

/// A command line as text, for assertion messages.
fn show(args: &[&dyn AsRef<std::ffi::OsStr>]) -> String {
    let words: Vec<String> = (args.iter())
        .map(|a| a.as_ref().to_string_lossy().into_owned())
        .collect();
    words.join(" ")
}

/// Stderr of a command that must exit 1.
fn stderr_of_failure(args: &[&dyn AsRef<std::ffi::OsStr>]) -> String {
    let out = run(args).code(1).get_output().clone();
    String::from_utf8(out.stderr).unwrap()
}

#[test]
fn deep_pickle_is_refused_by_every_command() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = megatron_llama(tmp.path(), 1);
    // Control: a shallow nest beside the model leaves a checkpoint every command reads.
    let shallow = tmp.path().join("shallow");
    copy_dir(&ckpt, &shallow);
    edit_pickle(&rank_file(&shallow, 0), |p| add_nested_lists(p, 3));
    run(&[&"ckpt", &"info", &shallow]).success();
    // The file: the same checkpoint with 200,000 nested lists (about 630 KB).
    let rank = rank_file(&ckpt, 0);
    edit_pickle(&rank, |p| add_nested_lists(p, 200_000));
    assert!(std::fs::metadata(&rank).unwrap().len() > 400_000);
    let llama = fixture("models/llama");
    let adapter = fixture("lora/llama");
    let out = tmp.path().join("out");
    #[rustfmt::skip]
    let commands: Vec<Vec<&dyn AsRef<std::ffi::OsStr>>> = vec![
        vec![&"ckpt", &"info", &ckpt],
        vec![&"convert", &"--quiet", &"--to", &"hf", &"--input", &ckpt, &"--output", &out],
        vec![&"lora", &"merge", &"--quiet", &"--base", &llama, &"--adapter", &ckpt, &"--output", &out],
        vec![&"lora", &"merge", &"--quiet", &"--base", &ckpt, &"--adapter", &adapter, &"--output", &out],
        vec![&"generate", &"--model", &ckpt, &"--tokenizer", &llama, &"--prompt", &"hi", &"--max-new-tokens", &"2"],
    ];
    for args in commands {
        let err = stderr_of_failure(&args);
        assert!(
            err.contains(&rank.display().to_string()) && err.contains("nested more than 1000 deep"),
            "{}: {err}",
            show(&args)
        );
        assert!(!out.exists(), "{} left {}", show(&args), out.display());
        assert!(leftovers(tmp.path()).is_empty(), "{}", show(&args));
    }
}

/// A copy of fixture directory `from` at `to` whose JSON file `file` has `edit` applied.
fn copy_with_json(from: &str, to: PathBuf, file: &str, edit: impl Fn(&mut Json)) -> PathBuf {
    copy_dir(&fixture(from), &to);
    let path = to.join(file);
    let mut json: Json = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut json);
    std::fs::write(&path, serde_json::to_string_pretty(&json).unwrap()).unwrap();
    to
}

/// A copy of the llama fixture whose config.json has `edit` applied.
fn llama_with_config(dir: &Path, edit: impl Fn(&mut Json)) -> PathBuf {
    copy_with_json("models/llama", dir.join("llama"), "config.json", edit)
}

/// `generate` and `convert` on the llama fixture with config.json field `pointer` set to
/// `value` both fail naming the file and `field` with `what`; nothing is written.
fn refused_config(pointer: &str, value: Json, field: &str, what: &str) {
    let tmp = tempfile::tempdir().unwrap();
    let model = llama_with_config(tmp.path(), |cfg| {
        *cfg.pointer_mut(pointer).unwrap() = value.clone();
    });
    let cfg_path = model.join("config.json").display().to_string();
    for err in generate_and_convert_fail(&model, &model, "megatron", &tmp.path().join("out")) {
        assert!(
            err.contains(&cfg_path) && err.contains(&format!("\"{field}\"")) && err.contains(what),
            "{pointer} = {value}: {err}"
        );
    }
}

/// Stderr of `generate` and of `convert --to TO` on `model` (its tokenizer from `tokenizer`),
/// each of which must exit 1 without writing `out`.
fn generate_and_convert_fail(model: &Path, tokenizer: &Path, to: &str, out: &Path) -> Vec<String> {
    #[rustfmt::skip]
    let commands: [Vec<&dyn AsRef<std::ffi::OsStr>>; 2] = [
        vec![&"generate", &"--model", &model, &"--tokenizer", &tokenizer, &"--prompt", &"hi", &"--max-new-tokens", &"2"],
        vec![&"convert", &"--quiet", &"--to", &to, &"--input", &model, &"--output", &out],
    ];
    let run_one = |args: &Vec<&dyn AsRef<std::ffi::OsStr>>| {
        let err = stderr_of_failure(args);
        assert!(!out.exists(), "{} wrote {}", show(args), out.display());
        err
    };
    commands.iter().map(run_one).collect()
}

#[test]
fn config_fields_of_the_wrong_type_are_errors() {
    refused_config(
        "/rope_theta",
        json!("500000"),
        "rope_theta",
        "must be a number, got the string \"500000\"",
    );
    refused_config(
        "/rope_theta",
        json!("abc"),
        "rope_theta",
        "the string \"abc\"",
    );
    refused_config(
        "/num_hidden_layers",
        json!("4"),
        "num_hidden_layers",
        "must be a positive integer",
    );
    refused_config("/hidden_size", json!(32.5), "hidden_size", "got 32.5");
    refused_config(
        "/rms_norm_eps",
        json!([1e-6]),
        "rms_norm_eps",
        "got an array",
    );
    refused_config(
        "/tie_word_embeddings",
        json!("false"),
        "tie_word_embeddings",
        "must be true or false",
    );
    refused_config(
        "/rope_scaling/factor",
        json!("8"),
        "rope_scaling.factor",
        "must be a number",
    );
    refused_config(
        "/rope_scaling",
        json!(8),
        "rope_scaling",
        "must be an object",
    );
}

#[test]
fn hugging_face_longrope_outside_phimoe_is_refused_by_name() {
    // transformers' LongRoPE is built as Phi-3.5-MoE applies it (long or short mscale by the
    // running length); other families keep one attention factor
    let tmp = tempfile::tempdir().unwrap();
    let model = llama_with_config(tmp.path(), |cfg| {
        cfg["rope_scaling"] =
            json!({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]});
    });
    let cfg_path = model.join("config.json").display().to_string();
    for err in generate_and_convert_fail(&model, &model, "megatron", &tmp.path().join("out")) {
        assert!(
            err.contains(&cfg_path) && err.contains("rope_scaling longrope"),
            "{err}"
        );
    }
}

#[test]
fn nonsensical_numbers_are_refused_up_front() {
    let positive = "it must be a finite number above 0";
    refused_config("/rms_norm_eps", json!(0.0), "rms_norm_eps", positive);
    refused_config("/rms_norm_eps", json!(-1e-6), "rms_norm_eps", positive);
    refused_config("/rope_theta", json!(0), "rope_theta", positive);
    refused_config(
        "/rope_scaling/factor",
        json!(0),
        "rope_scaling.factor",
        positive,
    );
    refused_config(
        "/rope_scaling/high_freq_factor",
        json!(1.0),
        "rope_scaling.high_freq_factor",
        "it must be above low_freq_factor",
    );
    refused_config(
        "/num_key_value_heads",
        json!(0),
        "num_key_value_heads",
        "it must be at least 1",
    );
}

#[test]
fn zero_heads_and_uneven_groups_read_right() {
    refused_config(
        "/num_attention_heads",
        json!(0),
        "num_attention_heads",
        "is 0; it must be at least 1",
    );
    let tmp = tempfile::tempdir().unwrap();
    let model = llama_with_config(tmp.path(), |cfg| cfg["num_attention_heads"] = json!(6));
    let err = stderr_of_failure(&[&"ckpt", &"info", &model]);
    assert!(
        err.contains("num_attention_heads (6) must be a multiple of num_key_value_heads (4)"),
        "{err}"
    );
}

/// Replace the attribute `name` of the args a mindkit-written rank file pickles (a
/// BINUNICODE key followed by a BINFLOAT) with the pickled `value`, and drop the carried
/// config.json so that the args are what is read.
fn edit_args(pickle: &mut Vec<u8>, name: &str, value: &[u8]) {
    let key = |k: &str| [&[b'X'][..], &(k.len() as u32).to_le_bytes(), k.as_bytes()].concat();
    let find = |p: &[u8], needle: &[u8]| p.windows(needle.len()).position(|w| w == needle);
    let at = find(pickle, &key(name)).unwrap() + key(name).len();
    assert_eq!(pickle[at], b'G', "{name} is not pickled as a float");
    pickle.splice(at..at + 9, value.iter().copied());
    let carried = key("mindkit_hf_config");
    let at = find(pickle, &carried).unwrap();
    let len = u32::from_le_bytes(pickle[at + carried.len() + 1..][..4].try_into().unwrap());
    pickle.drain(at..at + carried.len() + 5 + len as usize);
}

#[test]
fn megatron_args_of_the_wrong_type_or_out_of_range_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let base = megatron_llama(tmp.path(), 1);
    for (value, what) in [
        (
            &b"X\x06\x00\x00\x00500000"[..],
            "\"args.rotary_base\" must be a number, got the string \"500000\"",
        ),
        (
            b"G\x00\x00\x00\x00\x00\x00\x00\x00",
            "\"args.rotary_base\" is 0; it must be a finite number above 0",
        ),
    ] {
        let ckpt = tmp.path().join("edited");
        copy_dir(&base, &ckpt);
        let rank = rank_file(&ckpt, 0);
        edit_pickle(&rank, |p| edit_args(p, "rotary_base", value));
        let out = tmp.path().join("out");
        for err in generate_and_convert_fail(&ckpt, &fixture("models/llama"), "hf", &out) {
            assert!(
                err.contains(&rank.display().to_string()) && err.contains(what),
                "{err}"
            );
        }
        std::fs::remove_dir_all(&ckpt).unwrap();
    }
}

/// A copy of the llama PEFT adapter whose adapter_config.json has `edit` applied.
fn adapter_with_config(dir: &Path, edit: impl Fn(&mut Json)) -> PathBuf {
    copy_with_json(
        "lora/llama",
        dir.join("adapter"),
        "adapter_config.json",
        edit,
    )
}

#[test]
fn lora_scales_that_overflow_are_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let base = fixture("models/llama");
    let out = tmp.path().join("merged");
    for (alpha, extra, what) in [
        (json!(1e308), "fp32", "is too large for f32"),
        (
            json!(0),
            "fp32",
            "\"lora_alpha\" is 0; it must be a finite number above 0",
        ),
        (
            json!(-8),
            "fp32",
            "\"lora_alpha\" is -8; it must be a finite number above 0",
        ),
        // A finite scale whose merged weights overflow fp16.
        (json!(1e9), "fp16", "which float16 cannot hold"),
    ] {
        let adapter = adapter_with_config(tmp.path(), |cfg| cfg["lora_alpha"] = alpha.clone());
        let err = lora_merge_err(&base, &adapter, &out, &["--dtype", extra]);
        assert!(err.contains(what), "lora_alpha {alpha}: {err}");
        assert!(!out.exists() && leftovers(tmp.path()).is_empty());
        std::fs::remove_dir_all(&adapter).unwrap();
    }
}

#[test]
fn a_missing_rank_file_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = megatron_llama(tmp.path(), 2);
    let missing = rank_file(&ckpt, 1);
    std::fs::remove_dir_all(missing.parent().unwrap()).unwrap();
    let err = stderr_of_failure(&[&"ckpt", &"info", &ckpt]);
    assert!(
        err.contains(&format!("missing rank file {}", missing.display()))
            && err.contains("rank 0's args say TP 2 × PP 1 × EP 1"),
        "{err}"
    );
}

#[test]
fn an_adapter_for_another_base_warns() {
    let tmp = tempfile::tempdir().unwrap();
    let base = fixture("models/llama");
    let merge = |adapter: &Path, out: &str| {
        let out = lora_merge(&base, adapter, &tmp.path().join(out), &[])
            .success()
            .get_output()
            .clone();
        String::from_utf8(out.stderr).unwrap()
    };
    // The fixture adapter names fixtures/models/llama: the base's directory name.
    assert_eq!(merge(&fixture("lora/llama"), "same"), "");
    let other = adapter_with_config(tmp.path(), |cfg| {
        cfg["base_model_name_or_path"] = json!("meta-llama/Llama-2-7b-hf")
    });
    let err = merge(&other, "other");
    assert!(
        err.contains("warning: the adapter was trained on \"meta-llama/Llama-2-7b-hf\"")
            && err.contains(&format!("the base {} goes by \"llama\"", base.display())),
        "{err}"
    );
    // A hub id of the same model as the base directory's name is no mismatch.
    let same = tmp.path().join("same-name");
    let hub = adapter_with_config(&same, |cfg| {
        cfg["base_model_name_or_path"] = json!("someone/LLaMA")
    });
    assert_eq!(merge(&hub, "hub"), "");
}

#[test]
fn rank_directories_naming_a_huge_layout_are_refused() {
    // One stray directory named for TP rank 99,999 made mindkit list 100,000 rank files (and
    // args saying TP 2^40 would have listed 2^40).
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = megatron_llama(tmp.path(), 1);
    std::fs::create_dir(ckpt.join("iter_0000001/mp_rank_99999")).unwrap();
    let err = stderr_of_failure(&[&"ckpt", &"info", &ckpt]);
    assert!(
        err.contains("TP 100000 × PP 1") && err.contains("more than the 65536 rank files"),
        "{err}"
    );
}

/// A parquet file of one text column holding `rows` nulls (run-length encoded: a few hundred
/// bytes whatever the count).
fn parquet_of_nulls(rows: usize) -> Vec<u8> {
    use arrow::array::{ArrayRef, StringArray};
    let column: ArrayRef = std::sync::Arc::new(StringArray::from(vec![None::<&str>; rows]));
    let batch = arrow::record_batch::RecordBatch::try_from_iter([("text", column)]).unwrap();
    let mut buf = Vec::new();
    let mut w = parquet::arrow::ArrowWriter::try_new(&mut buf, batch.schema(), None).unwrap();
    w.write(&batch).unwrap();
    w.close().unwrap();
    buf
}

#[test]
fn columnar_files_declaring_far_more_rows_than_bytes_are_refused() {
    // Found by the records fuzzer as an arrow batch of billions of empty rows (minutes and
    // gigabytes of records from 579 bytes); parquet's run-length-encoded nulls do the same.
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("nulls.parquet");
    let bytes = parquet_of_nulls(2_000_000);
    assert!(bytes.len() < 20_000, "{} bytes", bytes.len());
    std::fs::write(&input, &bytes).unwrap();
    let out = tmp.path().join("out");
    let err = stderr_of_failure(&[
        &"preprocess",
        &"--input",
        &input,
        &"--output-prefix",
        &out,
        &"--tokenizer",
        &fixture("models/llama"),
    ]);
    assert!(
        err.contains("nulls.parquet") && err.contains("declares 2000000 rows in"),
        "{err}"
    );
}

#[test]
fn damaged_or_hostile_torch_dist_indexes_are_named_and_leave_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let fixture_dir = fixture("torch_dist/llama");
    // the fixture itself is megatron-core's save of the llama fixture: read back exactly
    let hf = tmp.path().join("hf");
    convert("hf", &fixture_dir, &hf, &[]);
    let (a, b) = (
        mindkit::ckpt::hf::HfWeights::open(&fixture("models/llama")).unwrap(),
        mindkit::ckpt::hf::HfWeights::open(&hf).unwrap(),
    );
    let names: Vec<&String> = a.entries().keys().collect();
    assert_eq!(names, b.entries().keys().collect::<Vec<_>>());
    for n in names {
        assert_eq!(a.read(n).unwrap(), b.read(n).unwrap(), "{n}");
    }
    for (variant, error) in [
        ("forbidden_global", "forbidden global collections.Counter"),
        (
            "overlapping_chunks",
            "decoder.layers.mlp.linear_fc1.weight: chunks at",
        ),
        (
            "missing_chunk",
            "decoder.layers.mlp.linear_fc1.weight: its chunks cover",
        ),
        ("offset_past_file", "stored at bytes 1099511627776.."),
        ("path_outside", "not a file of the checkpoint directory"),
        (
            "irregular_flattened",
            "original shape [7, 3] is not the reformulated",
        ),
    ] {
        let dir = tmp.path().join(variant);
        copy_dir(&fixture_dir, &dir);
        let it = dir.join("iter_0000007");
        let hostile = fixture(&format!("torch_dist/hostile/{variant}.metadata"));
        std::fs::copy(hostile, it.join(".metadata")).unwrap();
        let out = tmp.path().join(format!("{variant}-hf"));
        let err = stderr_of_failure(&[
            &"convert",
            &"--to",
            &"hf",
            &"--input",
            &dir,
            &"--output",
            &out,
        ]);
        assert!(err.contains(error), "{variant}: {err}");
        assert!(
            err.contains(".metadata"),
            "{variant}: the index is named: {err}"
        );
        assert!(!out.exists(), "{variant}: {:?}", leftovers(tmp.path()));
    }
}
