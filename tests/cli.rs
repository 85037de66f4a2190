//! The command line on bad input: clear errors naming file, line/row and field, a non-zero exit,
//! nothing half-written; `--skip-bad-records` skips and counts by reason; outputs are never
//! overwritten without `--force`.

mod common;

use assert_cmd::Command;
use common::run_with_umask_022;
use std::fs;
use std::path::{Path, PathBuf};

const TOKENIZER: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/tokenizers/tiny-bpe");
const CORPUS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/corpus");

fn mindkit() -> Command {
    Command::cargo_bin("mindkit").unwrap()
}

/// Runs `preprocess` on `input` (pretrain mode, key `text`) writing into `dir/out`; the summary
/// goes to stderr (and no progress bar: stderr is not a terminal).
fn preprocess(dir: &Path, input: &Path, extra: &[&str]) -> assert_cmd::assert::Assert {
    mindkit()
        .args(["preprocess", "--tokenizer", TOKENIZER, "--input"])
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

/// A one-batch record batch of named columns.
fn batch(columns: Vec<(&str, arrow::array::ArrayRef)>) -> arrow::record_batch::RecordBatch {
    arrow::record_batch::RecordBatch::try_from_iter(columns).unwrap()
}

fn parquet_of(batch: &arrow::record_batch::RecordBatch) -> Vec<u8> {
    let mut buf = Vec::new();
    let mut w = parquet::arrow::ArrowWriter::try_new(&mut buf, batch.schema(), None).unwrap();
    w.write(batch).unwrap();
    w.close().unwrap();
    buf
}

fn arrow_file_of(batch: &arrow::record_batch::RecordBatch) -> Vec<u8> {
    let mut buf = Vec::new();
    let mut w = arrow::ipc::writer::FileWriter::try_new(&mut buf, &batch.schema()).unwrap();
    w.write(batch).unwrap();
    w.finish().unwrap();
    drop(w);
    buf
}

fn parquet_bytes(texts: &[&str]) -> Vec<u8> {
    let column = std::sync::Arc::new(arrow::array::StringArray::from(texts.to_vec()));
    parquet_of(&batch(vec![("text", column)]))
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
    assert_fails_cleanly(dir.path(), a, &["'3/3' for '--shard <I/N>'"]);
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

/// The `.bin` bytes of a successful run's `out_text_document`.
fn text_bin(dir: &Path) -> Vec<u8> {
    fs::read(dir.join("out_text_document.bin")).unwrap()
}

#[test]
fn mixed_formats_refused() {
    use std::io::Write;
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(GOOD.repeat(3).as_bytes()).unwrap();
    let gz = gz.finish().unwrap();
    let cases: [(&str, &[u8], &str, &[u8]); 2] = [
        (
            "corpus.jsonl",
            GOOD.as_bytes(),
            "README.txt",
            b"How to use this corpus.\n",
        ),
        (
            "corpus.jsonl.gz",
            &gz,
            "SHA256SUMS.txt",
            b"0123abcd  corpus.jsonl.gz\n",
        ),
    ];
    for (data, data_bytes, stray, stray_bytes) in cases {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().join("d");
        fs::create_dir(&d).unwrap();
        write(&d, data, data_bytes);
        write(&d, stray, stray_bytes);
        let glob = d.join("*");
        for input in [&d, &glob] {
            let a = preprocess(dir.path(), input, &[]);
            let expected = [
                &format!("jsonl: {data}"),
                &format!("txt: {stray}"),
                "--input-format jsonl|txt",
            ];
            assert_fails_cleanly(dir.path(), a, &expected);
            let a = preprocess(dir.path(), input, &["--input-format", "jsonl", "--force"]);
            let msg = stderr(&a);
            a.success();
            assert!(
                msg.contains(&format!("1 file not read: {stray} (txt);")),
                "{msg}"
            );
            // Only the corpus was read: the same tokens as the corpus alone.
            let read = text_bin(dir.path());
            preprocess(dir.path(), &d.join(data), &["--force"]).success();
            assert_eq!(read, text_bin(dir.path()), "{data} beside {stray}");
            for f in outputs(dir.path()) {
                fs::remove_file(dir.path().join(f)).unwrap();
            }
        }
        // A file named directly must be of the chosen format.
        let a = preprocess(dir.path(), &d.join(stray), &["--input-format", "jsonl"]);
        assert_fails_cleanly(
            dir.path(),
            a,
            &[stray, "a txt file, but --input-format is jsonl"],
        );
    }
}

/// `text` as a parquet file and an arrow IPC file with a binary column of these values.
fn binary_inputs(dir: &Path, values: &[&[u8]]) -> [PathBuf; 2] {
    use arrow::array::{ArrayRef, BinaryArray, LargeBinaryArray};
    use std::sync::Arc;
    let binary: ArrayRef = Arc::new(BinaryArray::from(values.to_vec()));
    let large: ArrayRef = Arc::new(LargeBinaryArray::from(values.to_vec()));
    // A binary column the run does not read: it need not be text.
    let image: ArrayRef = Arc::new(BinaryArray::from(vec![&b"\x89PNG\xff"[..]; values.len()]));
    [
        write(
            dir,
            "in.parquet",
            &parquet_of(&batch(vec![("text", binary), ("image", image.clone())])),
        ),
        write(
            dir,
            "in.arrow",
            &arrow_file_of(&batch(vec![("text", large), ("image", image)])),
        ),
    ]
}

#[test]
fn binary_column_read_as_utf8() {
    let texts = ["hello world", "héllo wörld, 你好"];
    let dir = tempfile::tempdir().unwrap();
    let as_text = write(
        dir.path(),
        "in.jsonl",
        texts
            .iter()
            .map(|t| format!("{{\"text\": {t:?}}}\n"))
            .collect::<String>()
            .as_bytes(),
    );
    preprocess(dir.path(), &as_text, &[]).success();
    let expected = text_bin(dir.path());
    let values: Vec<&[u8]> = texts.iter().map(|t| t.as_bytes()).collect();
    for input in binary_inputs(dir.path(), &values) {
        preprocess(dir.path(), &input, &["--force"]).success();
        assert_eq!(text_bin(dir.path()), expected, "{}", input.display());
    }

    let dir = tempfile::tempdir().unwrap();
    let values: [&[u8]; 3] = [b"fine", b"bad \xff byte", b"fine too"];
    for input in binary_inputs(dir.path(), &values) {
        let name = input.file_name().unwrap().to_string_lossy().into_owned();
        let a = preprocess(dir.path(), &input, &[]);
        let expected = [
            &format!("{name}:row 2"),
            "column \"text\"",
            "not valid UTF-8",
        ];
        assert_fails_cleanly(dir.path(), a, &expected);
        let a = preprocess(dir.path(), &input, &["--skip-bad-records", "--force"]);
        assert!(stderr(&a).contains("invalid utf-8: 1"), "{}", stderr(&a));
        a.success();
        for f in outputs(dir.path()) {
            fs::remove_file(dir.path().join(f)).unwrap();
        }
    }
}

/// Preprocesses `line` (one record per line) with `handler` (and `extra` flags): it must fail
/// naming `in.jsonl:line 2` and `fragment`, and `--skip-bad-records` must skip it for `reason`.
fn refuses_instruction_record(handler: &[&str], line: &str, fragment: &str, reason: &str) {
    let good = match handler[1] {
        "alpaca" => r#"{"instruction": "q", "input": "", "output": "a"}"#,
        "belle" => r#"{"instruction": "Human: hi\nAssistant:", "output": "hello"}"#,
        "moss" => {
            r#"{"chat": {"turn_1": {"Human": "<|Human|>: hi<eoh>", "MOSS": "<|MOSS|>: hello<eom>"}}}"#
        }
        _ => {
            r#"{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}"#
        }
    };
    let dir = tempfile::tempdir().unwrap();
    let input = write(
        dir.path(),
        "in.jsonl",
        format!("{good}\n{line}\n{good}\n").as_bytes(),
    );
    let a = preprocess(dir.path(), &input, handler);
    assert_fails_cleanly(dir.path(), a, &["in.jsonl:line 2", fragment]);
    let skip = [handler, &["--skip-bad-records"]].concat();
    let a = preprocess(dir.path(), &input, &skip);
    let msg = stderr(&a);
    a.success();
    assert!(msg.contains(&format!("1 skipped ({reason}: 1)")), "{msg}");
}

#[test]
fn instruction_records_missing_fields_are_errors() {
    let alpaca_chat = ["--handler", "alpaca", "--prompt-type", "alpaca"];
    let alpaca = ["--handler", "alpaca"];
    let sharegpt = ["--handler", "sharegpt", "--prompt-type", "chatml"];
    let no_output = r#"{"instruction": "q", "input": ""}"#;
    let missing = "missing field";
    refuses_instruction_record(&alpaca_chat, no_output, "missing field \"output\"", missing);
    let null_output = r#"{"instruction": "q", "output": null}"#;
    refuses_instruction_record(
        &alpaca_chat,
        null_output,
        "missing field \"output\"",
        missing,
    );
    let no_answer = r#"{"instruction": "q", "output": []}"#;
    refuses_instruction_record(
        &alpaca_chat,
        no_answer,
        "\"output\" is an empty list",
        missing,
    );
    let number = r#"{"instruction": "q", "output": 7}"#;
    refuses_instruction_record(&alpaca_chat, number, "\"output\" should be", "wrong type");
    refuses_instruction_record(&alpaca, no_output, "missing field \"output\"", missing);
    let belle = ["--handler", "belle"];
    let no_output = r#"{"instruction": "Human: hi\nAssistant:"}"#;
    refuses_instruction_record(&belle, no_output, "missing field \"output\"", missing);
    let moss = ["--handler", "moss"];
    let no_reply = r#"{"chat": {"turn_1": {"Human": "hi"}}}"#;
    refuses_instruction_record(
        &moss,
        no_reply,
        "chat.turn_1: missing field \"MOSS\"",
        missing,
    );
    let unknown_role =
        r#"{"conversations": [{"from": "human", "value": "q"}, {"from": "bot", "value": "a"}]}"#;
    let fragment = "conversations[1].from is \"bot\"";
    refuses_instruction_record(&sharegpt, unknown_role, fragment, "unknown role");
    let no_role = r#"{"conversations": [{"from": "human", "value": "q"}, {"value": "a"}]}"#;
    let fragment = "missing field \"conversations[1].from\"";
    refuses_instruction_record(&sharegpt, no_role, fragment, missing);
    let no_content = r#"{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt"}]}"#;
    let fragment = "missing field \"conversations[1].value\"";
    refuses_instruction_record(&sharegpt, no_content, fragment, missing);
    let openai_unknown =
        r#"{"messages": [{"role": "user", "content": "q"}, {"role": "robot", "content": "a"}]}"#;
    let fragment = "messages[1].role is \"robot\"";
    refuses_instruction_record(&sharegpt, openai_unknown, fragment, "unknown role");
    let no_messages = r#"{"conversation": []}"#;
    refuses_instruction_record(
        &sharegpt,
        no_messages,
        "missing field \"conversations\"",
        missing,
    );
}

/// Tool data MindSpeed-LLM's DeepSeek4Template raises on is refused naming the field; a system
/// message after the first, which only deepseek4 renders, is refused by the slot templates
/// (their `_encode` raises on it); `--map-keys` may not name a tools column for alpaca records.
#[test]
fn deepseek4_tool_data_mindspeed_raises_on_is_refused_by_field() {
    let ds4 = ["--handler", "sharegpt", "--prompt-type", "deepseek4"];
    let user = r#"{"role": "user", "content": "q"}"#;
    let answer = r#"{"role": "assistant", "content": "a"}"#;
    let list_arguments = format!(
        r#"{{"messages": [{user}, {{"role": "assistant", "content": "", "tool_calls": [{{"id": "1",
        "function": {{"name": "f", "arguments": "[1]"}}}}]}}, {{"role": "tool", "content": "r"}},
        {answer}]}}"#
    )
    .replace('\n', " ");
    let fragment = "messages[1].tool_calls[0].function.arguments parse to a list";
    refuses_instruction_record(&ds4, &list_arguments, fragment, "invalid tool data");
    let bad_tools = format!(r#"{{"messages": [{user}, {answer}], "tools": "[{{"}}"#);
    refuses_instruction_record(
        &ds4,
        &bad_tools,
        "tools column is not JSON",
        "invalid tool data",
    );
    let later_system = format!(
        r#"{{"messages": [{user}, {{"role": "system", "content": "s"}}, {user}, {answer}]}}"#
    );
    let chatml = ["--handler", "sharegpt", "--prompt-type", "chatml"];
    let fragment = "message 1 is a system message after the first";
    refuses_instruction_record(&chatml, &later_system, fragment, "unsupported role");

    let dir = tempfile::tempdir().unwrap();
    let input = write(dir.path(), "in.jsonl", b"{}\n");
    let alpaca_tools = [
        "--handler",
        "alpaca",
        "--prompt-type",
        "deepseek4",
        "--map-keys",
        r#"{"tools": "t"}"#,
    ];
    let a = preprocess(dir.path(), &input, &alpaca_tools);
    assert_fails_cleanly(
        dir.path(),
        a,
        &["\"tools\" is not a column of the alpaca format"],
    );
}

#[test]
fn conversations_mindspeed_drops_are_dropped_and_counted() {
    // MindSpeed-LLM skips these itself (the goldens hold them as dropped): mindkit does too,
    // without --skip-bad-records, and counts them.
    let dir = tempfile::tempdir().unwrap();
    let input = PathBuf::from(CORPUS).join("sharegpt.jsonl");
    let a = preprocess(
        dir.path(),
        &input,
        &["--handler", "sharegpt", "--prompt-type", "chatml"],
    );
    let msg = stderr(&a);
    a.success();
    assert!(
        msg.contains("1 skipped (malformed conversation: 1)"),
        "{msg}"
    );
}

#[test]
fn record_above_max_record_bytes_is_refused() {
    let big = format!("{{\"text\": \"{}\"}}\n", "word ".repeat(1000));
    let input = format!("{GOOD}{big}{GOOD}");
    let cap = ["--max-record-bytes", "4096"];
    let expected = [
        "in.jsonl:line 2",
        "5012 bytes",
        "4096-byte limit",
        "--max-record-bytes",
    ];
    rejects("in.jsonl", input.as_bytes(), &cap, &expected);
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "in.jsonl", input.as_bytes());
    let a = preprocess(
        dir.path(),
        &path,
        &[&cap[..], &["--skip-bad-records"]].concat(),
    );
    let msg = stderr(&a);
    a.success();
    assert!(msg.contains("1 skipped (record too large: 1)"), "{msg}");
    // Under the cap the record is read.
    preprocess(
        dir.path(),
        &path,
        &["--max-record-bytes", "5012", "--force"],
    )
    .success();
    // A JSON array element above the cap stops the run (the parser cannot resynchronise).
    let array = format!("[{}, {}]", GOOD.trim(), big.trim());
    let expected = ["in.json:element 2", "4096-byte limit"];
    rejects("in.json", array.as_bytes(), &cap, &expected);
}

#[test]
fn malformed_shard_names_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let input = PathBuf::from(CORPUS).join("pretrain.jsonl");
    for (spec, why) in [
        ("a/b", "I \"a\" is not a whole number"),
        ("0/0", "N must be at least 1"),
        ("3/2", "I is 3, so N must be at least 4"),
        ("1", "has no '/'"),
    ] {
        let a = preprocess(dir.path(), &input, &["--shard", spec]);
        let msg = stderr(&a);
        assert_eq!(a.get_output().status.code(), Some(2), "{msg}");
        for fragment in [&format!("'{spec}' for '--shard <I/N>'"), "0 ≤ I < N", why] {
            assert!(
                msg.contains(fragment),
                "{msg:?} should mention {fragment:?}"
            );
        }
        assert_eq!(outputs(dir.path()), Vec::<String>::new());
    }
}

#[test]
fn help_shows_every_alias() {
    let help = mindkit().args(["preprocess", "--help"]).assert().success();
    let help = String::from_utf8_lossy(&help.get_output().stdout).into_owned();
    for alias in [
        "--tokenizer-model",
        "--tokenizer-name-or-path",
        "--handler-name",
        "--tokenizer-hf-no-include-special-tokens",
    ] {
        assert!(
            help.contains(alias),
            "preprocess --help should show {alias}:\n{help}"
        );
    }
}

#[test]
fn quiet_is_silent_in_preprocess_and_merge() {
    let dir = tempfile::tempdir().unwrap();
    let input = PathBuf::from(CORPUS).join("pretrain.jsonl");
    let a = preprocess(dir.path(), &input, &[]);
    assert!(stderr(&a).contains("records →"), "{}", stderr(&a));
    let a = preprocess(dir.path(), &input, &["--quiet", "--force"]);
    assert_eq!(stderr(&a), "");
    a.success();
    let part = dir.path().join("out_text_document");
    let merge = |quiet: &[&str]| {
        mindkit()
            .args(["preprocess", "merge"])
            .arg(&part)
            .arg(&part)
            .arg("--output-prefix")
            .arg(dir.path().join("merged"))
            .args(["--force"])
            .args(quiet)
            .assert()
            .success()
    };
    assert!(stderr(&merge(&[])).contains("merged 2 datasets"));
    assert_eq!(stderr(&merge(&["--quiet"])), "");
}

#[test]
fn missing_required_flags_are_command_line_errors() {
    let out = mindkit()
        .args(["preprocess", "--input", CORPUS])
        .assert()
        .code(2);
    let err = stderr(&out);
    assert!(
        err.contains("--output-prefix <OUTPUT_PREFIX>") && err.contains("--tokenizer <TOKENIZER>"),
        "{err}"
    );
    let out = mindkit().args(["preprocess", "--help"]).assert().success();
    let help = String::from_utf8_lossy(&out.get_output().stdout).into_owned();
    let usage = help
        .lines()
        .find(|l| l.starts_with("Usage:"))
        .unwrap_or_default();
    assert!(
        usage.contains("--input") && usage.contains("--tokenizer"),
        "{usage}"
    );
}

#[test]
fn a_mismatched_pair_is_refused_by_every_reader() {
    // What a crash between the .bin and .idx renames of a replace used to leave: the new .bin
    // beside the previous run's .idx.
    // The old index describes fewer bytes than the new .bin holds: every sequence it points to
    // lies inside, and only the total tells.
    let dir = tempfile::tempdir().unwrap();
    let small = write(dir.path(), "small.jsonl", GOOD.as_bytes());
    preprocess(dir.path(), &small, &[]).success();
    let idx = dir.path().join("out_text_document.idx");
    let old_idx = fs::read(&idx).unwrap();
    let input = PathBuf::from(CORPUS).join("pretrain.jsonl");
    preprocess(dir.path(), &input, &["--force"]).success();
    fs::write(&idx, old_idx).unwrap();
    let prefix = dir.path().join("out_text_document");
    let info = mindkit().args(["data", "info"]).arg(&prefix).assert();
    let show = mindkit()
        .args(["data", "show", "--tokenizer", TOKENIZER])
        .arg(&prefix)
        .assert();
    let merged = mindkit()
        .args(["preprocess", "merge", "--output-prefix"])
        .arg(dir.path().join("merged"))
        .arg(&prefix)
        .assert();
    for a in [info, show, merged] {
        let msg = stderr(&a);
        assert!(msg.contains("out_text_document.bin is"), "{msg}");
        assert!(msg.contains("out_text_document.idx describes"), "{msg}");
        a.failure();
    }
}

#[test]
fn datasets_get_the_umask_permissions() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let merged = dir.path().join("merged");
    let input = format!("{CORPUS}/pretrain.jsonl");
    run_with_umask_022(&[
        &"preprocess",
        &"--quiet",
        &"--tokenizer",
        &TOKENIZER,
        &"--input",
        &input,
        &"--output-prefix",
        &out,
    ]);
    let prefix = dir.path().join("out_text_document");
    run_with_umask_022(&[
        &"preprocess",
        &"merge",
        &"--quiet",
        &"--output-prefix",
        &merged,
        &prefix,
    ]);
    for name in [
        "out_text_document.bin",
        "out_text_document.idx",
        "merged.bin",
        "merged.idx",
    ] {
        let mode = dir
            .path()
            .join(name)
            .metadata()
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o644, "{name}: {mode:o}");
    }
}

#[test]
fn a_signal_removes_the_temporaries() {
    // The input is a named pipe nobody writes to: preprocess has created its output
    // temporaries and waits for input, for as long as the test needs.
    for (signal, status) in [("TERM", 143), ("INT", 130)] {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("in.jsonl");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        assert!(made.unwrap().success());
        let child = std::process::Command::new(assert_cmd::cargo::cargo_bin("mindkit"))
            .args(["preprocess", "--quiet", "--tokenizer", TOKENIZER, "--input"])
            .arg(&fifo)
            .arg("--output-prefix")
            .arg(dir.path().join("out"))
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut child = KillOnDrop(Some(child));
        let started = std::time::Instant::now();
        while outputs(dir.path()).is_empty() {
            let ended = child.0.as_mut().unwrap().try_wait().unwrap();
            assert!(ended.is_none(), "preprocess ended early");
            assert!(started.elapsed().as_secs() < 60, "no temporary appeared");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert!(
            outputs(dir.path())[0].starts_with(".mindkit-data-out_text_document.bin-"),
            "{:?}",
            outputs(dir.path())
        );
        let pid = child.0.as_ref().unwrap().id().to_string();
        let killed = std::process::Command::new("kill")
            .args([&format!("-{signal}"), &pid])
            .status();
        assert!(killed.unwrap().success());
        let out = child.0.take().unwrap().wait_with_output().unwrap();
        let msg = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(status), "SIG{signal}: {msg}");
        assert!(msg.contains(&format!("SIG{signal}")), "{msg}");
        assert_eq!(outputs(dir.path()), Vec::<String>::new(), "SIG{signal}");
    }
}

/// A child process killed if the test fails before waiting for it.
struct KillOnDrop(Option<std::process::Child>);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Some(child) = self.0.as_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
