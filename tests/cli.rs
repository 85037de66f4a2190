//! The command line on bad input: clear errors naming file, line/row and field, a non-zero exit,
//! nothing half-written; `--skip-bad-records` skips and counts by reason; outputs are never
//! overwritten without `--force`.

use assert_cmd::Command;
use std::fs;
use std::path::{Path, PathBuf};

const TOKENIZER: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/tokenizers/tiny-bpe");
const CORPUS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/corpus");

fn mindkit() -> Command {
    Command::cargo_bin("mindkit").unwrap()
}

/// Runs `preprocess` on `input` (pretrain mode, key `text`) writing into `dir/out`.
fn preprocess(dir: &Path, input: &Path, extra: &[&str]) -> assert_cmd::assert::Assert {
    mindkit()
        .args(["preprocess", "--quiet", "--tokenizer", TOKENIZER, "--input"])
        .arg(input)
        .arg("--output-prefix")
        .arg(dir.join("out"))
        .args(extra)
        .assert()
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let path = dir.join(name);
    fs::write(&path, bytes).unwrap();
    path
}

fn stderr(a: &assert_cmd::assert::Assert) -> String {
    String::from_utf8_lossy(&a.get_output().stderr).into_owned()
}

/// Names of the files in `dir` other than the inputs: what a run left behind.
fn outputs(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("out") || n.starts_with('.'))
        .collect();
    names.sort();
    names
}

/// Asserts the run failed, its message contains every fragment, and it wrote nothing.
fn assert_fails_cleanly(dir: &Path, a: assert_cmd::assert::Assert, fragments: &[&str]) {
    let msg = stderr(&a);
    a.failure();
    for f in fragments {
        assert!(msg.contains(f), "error {msg:?} should mention {f:?}");
    }
    assert_eq!(
        outputs(dir),
        Vec::<String>::new(),
        "a failed run left files behind"
    );
}

const GOOD: &str = "{\"text\": \"hello world\"}\n";

/// Preprocessing `bytes` saved as `name` must fail cleanly with every fragment in the message.
fn rejects(name: &str, bytes: &[u8], extra: &[&str], fragments: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let input = write(dir.path(), name, bytes);
    let a = preprocess(dir.path(), &input, extra);
    assert_fails_cleanly(dir.path(), a, fragments);
}

#[test]
fn malformed_json_line_is_named() {
    // Many good records first, so that output has been written when the bad one arrives.
    let input = format!("{}{{\"text\": \"oops\n{GOOD}", GOOD.repeat(50_000));
    let expected = ["in.jsonl:line 50001", "--skip-bad-records"];
    rejects("in.jsonl", input.as_bytes(), &["--workers", "2"], &expected);
}

#[test]
fn missing_field_is_named() {
    let input = format!("{GOOD}{GOOD}{{\"body\": \"x\"}}\n");
    let expected = ["in.jsonl:line 3", "missing field \"text\""];
    rejects("in.jsonl", input.as_bytes(), &[], &expected);
}

#[test]
fn wrong_type_is_named() {
    let input = format!("{{\"text\": [1, 2]}}\n{GOOD}");
    let expected = ["in.jsonl:line 1", "field \"text\" should be a string"];
    rejects("in.jsonl", input.as_bytes(), &[], &expected);
}

#[test]
fn invalid_utf8_is_named() {
    let input = b"{\"text\": \"ok\"}\n{\"text\": \"bad \xff\"}\n";
    rejects("in.jsonl", input, &[], &["in.jsonl:line 2", "utf-8"]);
    rejects(
        "in.txt",
        b"fine\nbad \xfe line\n",
        &[],
        &["in.txt:line 2", "utf-8"],
    );
}

#[test]
fn truncated_json_array_is_named() {
    let input = b"[{\"text\": \"a\"},\n {\"text\": \"b\"},\n {\"text\":";
    rejects(
        "in.json",
        input,
        &[],
        &["in.json:line 3", "after element 2"],
    );
}

#[test]
fn truncated_gzip_is_named() {
    use std::io::Write;
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    for i in 0..20_000 {
        writeln!(gz, "{{\"text\": \"document number {i}\"}}").unwrap();
    }
    let bytes = gz.finish().unwrap();
    let expected = ["in.jsonl.gz", "after line"];
    rejects("in.jsonl.gz", &bytes[..bytes.len() / 2], &[], &expected);
}

fn parquet_bytes(texts: &[&str]) -> Vec<u8> {
    use arrow::array::StringArray;
    use arrow::datatypes::{DataType, Field, Schema};
    use arrow::record_batch::RecordBatch;
    use std::sync::Arc;
    let schema = Arc::new(Schema::new(vec![Field::new("text", DataType::Utf8, true)]));
    let column = Arc::new(StringArray::from(texts.to_vec()));
    let batch = RecordBatch::try_new(schema.clone(), vec![column]).unwrap();
    let mut buf = Vec::new();
    let mut w = parquet::arrow::ArrowWriter::try_new(&mut buf, schema, None).unwrap();
    w.write(&batch).unwrap();
    w.close().unwrap();
    buf
}

#[test]
fn truncated_parquet_is_named() {
    let bytes = parquet_bytes(&["one document", "another one", "a third"]);
    let expected = ["in.parquet", "parquet"];
    rejects("in.parquet", &bytes[..bytes.len() - 20], &[], &expected);
}

#[test]
fn parquet_missing_column_names_row_and_field() {
    let bytes = parquet_bytes(&["one", "two"]);
    let expected = ["in.parquet:row 1", "missing field \"body\""];
    rejects("in.parquet", &bytes, &["--json-keys", "body"], &expected);
}

#[test]
fn skip_bad_records_counts_by_reason() {
    let dir = tempfile::tempdir().unwrap();
    let mut input = Vec::new();
    input.extend_from_slice(GOOD.as_bytes());
    input.extend_from_slice(b"{\"text\": \"unterminated\n");
    input.extend_from_slice(b"{\"body\": \"no text\"}\n");
    input.extend_from_slice(b"{\"text\": 7}\n");
    input.extend_from_slice(b"{\"text\": \"\xff\"}\n");
    input.extend_from_slice(b"{\"text\": 8}\n");
    input.extend_from_slice(GOOD.as_bytes());
    let input = write(dir.path(), "in.jsonl", &input);
    let a = preprocess(dir.path(), &input, &["--skip-bad-records"]).success();
    let msg = stderr(&a);
    for reason in [
        "5 skipped",
        "malformed json: 1",
        "missing field: 1",
        "wrong type: 2",
        "invalid utf-8: 1",
    ] {
        assert!(
            msg.contains(reason),
            "summary {msg:?} should report {reason:?}"
        );
    }
    let info = mindkit()
        .arg("data")
        .arg("info")
        .arg(dir.path().join("out_text_document"))
        .assert()
        .success();
    let info = String::from_utf8_lossy(&info.get_output().stdout).into_owned();
    assert!(info.contains("documents 2 "), "{info}");
}

#[test]
fn empty_documents_are_counted() {
    let dir = tempfile::tempdir().unwrap();
    let input = write(
        dir.path(),
        "in.jsonl",
        format!("{GOOD}{{\"text\": \"\"}}\n{GOOD}").as_bytes(),
    );
    let a = preprocess(dir.path(), &input, &["--no-special-tokens"]).success();
    assert!(stderr(&a).contains("1 empty"), "{}", stderr(&a));
}

#[test]
fn existing_output_needs_force() {
    let dir = tempfile::tempdir().unwrap();
    let input = write(dir.path(), "in.jsonl", GOOD.as_bytes());
    let bin = dir.path().join("out_text_document.bin");
    fs::write(&bin, b"precious user data").unwrap();
    let a = preprocess(dir.path(), &input, &[]);
    assert!(stderr(&a).contains("--force"), "{}", stderr(&a));
    a.failure();
    assert_eq!(fs::read(&bin).unwrap(), b"precious user data");
    assert!(!dir.path().join("out_text_document.idx").exists());
    preprocess(dir.path(), &input, &["--force"]).success();
    assert_ne!(fs::read(&bin).unwrap(), b"precious user data");
}

#[test]
fn configuration_errors_are_clear() {
    let dir = tempfile::tempdir().unwrap();
    let input = PathBuf::from(CORPUS).join("alpaca.jsonl");
    let a = preprocess(dir.path(), &input, &["--handler", "foo"]);
    assert_fails_cleanly(dir.path(), a, &["unknown --handler \"foo\""]);
    let a = preprocess(
        dir.path(),
        &input,
        &["--handler", "alpaca", "--prompt-type", "nope"],
    );
    assert_fails_cleanly(dir.path(), a, &["unknown prompt type \"nope\"", "chatml"]);
    let a = preprocess(dir.path(), &dir.path().join("absent.jsonl"), &[]);
    assert_fails_cleanly(dir.path(), a, &["absent.jsonl", "no such input"]);
    let a = preprocess(dir.path(), &input, &["--shard", "3/3"]);
    assert_fails_cleanly(dir.path(), a, &["--shard 3/3"]);
}

#[test]
fn append_eod_needs_an_eos_token() {
    let dir = tempfile::tempdir().unwrap();
    let bare = dir.path().join("bare.json");
    fs::copy(PathBuf::from(TOKENIZER).join("tokenizer.json"), &bare).unwrap();
    let a = mindkit()
        .args([
            "preprocess",
            "--quiet",
            "--append-eod",
            "--input",
            &format!("{CORPUS}/pretrain.jsonl"),
        ])
        .arg("--tokenizer")
        .arg(&bare)
        .arg("--output-prefix")
        .arg(dir.path().join("out"))
        .assert();
    assert_fails_cleanly(dir.path(), a, &["no eos token", "bare.json"]);
}

#[test]
fn data_show_marks_prompt_and_answer() {
    let dir = tempfile::tempdir().unwrap();
    let input = PathBuf::from(CORPUS).join("alpaca.jsonl");
    preprocess(
        dir.path(),
        &input,
        &["--handler", "alpaca", "--prompt-type", "alpaca"],
    )
    .success();
    let show = mindkit()
        .args(["data", "show", "--index", "1", "--tokenizer", TOKENIZER])
        .arg(dir.path().join("out"))
        .assert()
        .success();
    let text = String::from_utf8_lossy(&show.get_output().stdout).into_owned();
    let (prompt, answer) = text
        .split_once("[answer, trained]")
        .expect("answer section");
    assert!(
        prompt.contains("[prompt, masked]") && prompt.contains("### Instruction:"),
        "{text}"
    );
    assert!(answer.trim_start().starts_with("Bonjour"), "{text}");
    let a = mindkit()
        .args(["data", "show", "--index", "99", "--tokenizer", TOKENIZER])
        .arg(dir.path().join("out"))
        .assert();
    assert!(stderr(&a).contains("99"), "{}", stderr(&a));
    a.failure();
}

#[test]
fn corrupt_index_file_is_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let input = PathBuf::from(CORPUS).join("pretrain.jsonl");
    preprocess(dir.path(), &input, &[]).success();
    let idx = dir.path().join("out_text_document.idx");
    let bytes = fs::read(&idx).unwrap();
    fs::write(&idx, &bytes[..bytes.len() - 3]).unwrap();
    let a = mindkit()
        .arg("data")
        .arg("info")
        .arg(dir.path().join("out_text_document"))
        .assert();
    assert!(
        stderr(&a).contains("out_text_document.idx"),
        "{}",
        stderr(&a)
    );
    a.failure();
}
