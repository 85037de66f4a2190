//! mindkit's outputs against files written by the real tools: Megatron-LM's
//! `tools/preprocess_data.py` (byte for byte) and MindSpeed-LLM's instruction handlers
//! (token and label arrays). Generators: fixtures/gen/. Goldens that need a fetched real
//! tokenizer (scripts/fetch-test-assets.sh) are skipped, with a message, when it is absent.

use std::path::{Path, PathBuf};

use mindkit::data::handlers::chat::PAIRWISE_KEYS;
use mindkit::data::handlers::template::ReasoningEffort;
use mindkit::data::handlers::INSTRUCTION_KEYS;
use mindkit::data::indexed::IndexedDataset;
use mindkit::data::preprocess::{
    key_prefix, preprocess, DTypeChoice, HandlerKind, PreprocessOptions,
};
use serde_json::Value;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures")
}

/// A tokenizer directory by name: tiny-bpe is committed, the real ones are fetched.
fn tokenizer(name: &str) -> Option<PathBuf> {
    if name == "tiny-bpe" || name == "tiny" {
        return Some(fixtures().join("tokenizers/tiny-bpe"));
    }
    let assets = std::env::var_os("MINDKIT_ASSETS")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                .join(".cache/mindkit/assets")
        });
    let dir = assets.join(name);
    if dir.is_dir() {
        Some(dir)
    } else {
        eprintln!(
            "SKIPPED: tokenizer {name} not found in {} (run scripts/fetch-test-assets.sh)",
            assets.display()
        );
        None
    }
}

fn options(input: PathBuf, out: PathBuf, tok: PathBuf) -> PreprocessOptions {
    PreprocessOptions {
        inputs: vec![input],
        output_prefix: out,
        tokenizer: tok,
        tokenizer_type: None,
        json_keys: vec!["text".into()],
        append_eod: false,
        handler: None,
        prompt_type: None,
        prompt_type_path: None,
        enable_thinking: None,
        reasoning_effort: None,
        drop_thinking: true,
        map_keys: None,
        seq_length: None,
        pack: false,
        workers: 2,
        dtype: DTypeChoice::Auto,
        add_special_tokens: true,
        skip_bad_records: false,
        force: false,
        shard: None,
        progress: false,
        input_format: None,
        max_record_bytes: mindkit::data::source::DEFAULT_MAX_RECORD_BYTES,
    }
}

#[test]
fn pretrain_is_byte_identical_to_megatron() {
    let golden = fixtures().join("golden/megatron");
    let mut compared = 0;
    for entry in std::fs::read_dir(&golden).unwrap() {
        let name = entry.unwrap().file_name().to_string_lossy().to_string();
        let Some(case) = name.strip_suffix("_text_document.idx") else {
            continue;
        };
        let (tok_name, mode) = case.rsplit_once('_').unwrap();
        let Some(tok) = tokenizer(tok_name) else {
            continue;
        };
        for workers in [1, 2, 3] {
            let dir = tempfile::tempdir().unwrap();
            let mut o = options(
                fixtures().join("corpus/pretrain.jsonl"),
                dir.path().join("out"),
                tok.clone(),
            );
            o.append_eod = true;
            o.add_special_tokens = mode == "special";
            o.workers = workers;
            preprocess(&o).unwrap();
            for ext in ["bin", "idx"] {
                let ours =
                    std::fs::read(dir.path().join(format!("out_text_document.{ext}"))).unwrap();
                let theirs =
                    std::fs::read(golden.join(format!("{case}_text_document.{ext}"))).unwrap();
                assert!(
                    ours == theirs,
                    "{case}.{ext} differs from Megatron's (workers {workers})"
                );
            }
        }
        compared += 1;
    }
    assert!(
        compared >= 2,
        "the tiny-bpe goldens must always be compared"
    );
}

/// `--enable-thinking` of a golden case: absent (the earlier goldens, made with MindSpeed's
/// `fix_model_tokenizer` default False) or true / false / null.
fn enable_thinking(g: &Value) -> Option<bool> {
    g.get("enable_thinking").and_then(Value::as_bool)
}

/// A golden case's thinking switches into the options: `--enable-thinking`, and the deepseek4
/// cases' `--reasoning-effort` (absent or null: none), `--drop-thinking` (absent: true) and
/// `--map-keys` (absent: none).
fn set_thinking(o: &mut PreprocessOptions, g: &Value) {
    o.enable_thinking = enable_thinking(g);
    o.reasoning_effort = g
        .get("reasoning_effort")
        .and_then(Value::as_str)
        .map(|e| ReasoningEffort::parse(e).unwrap());
    o.drop_thinking = g
        .get("drop_thinking")
        .and_then(Value::as_bool)
        .unwrap_or(true);
    o.map_keys = g.get("map_keys").and_then(Value::as_object).cloned();
}

/// Runs mindkit on one golden case of MindSpeed-LLM's arrays (`{"dropped": true}`: a record its
/// alignment drops; `{"refused": "..."}`: one its handler raises on, which mindkit refuses, and
/// skips with --skip-bad-records) and compares every document. False when its tokenizer is absent.
fn matches_json_golden(path: &Path) -> bool {
    let g: Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    let case = path.file_stem().unwrap().to_string_lossy().to_string();
    let Some(tok) = tokenizer(g["tokenizer"].as_str().unwrap()) else {
        return false;
    };
    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().join("out");
    let mut o = options(
        fixtures()
            .join("corpus")
            .join(g["corpus"].as_str().unwrap()),
        prefix.clone(),
        tok,
    );
    o.handler = HandlerKind::parse(g["handler"].as_str().unwrap());
    o.prompt_type = g["prompt_type"].as_str().map(String::from);
    o.append_eod = g["append_eod"].as_bool().unwrap();
    set_thinking(&mut o, &g);
    let documents = g["documents"].as_array().unwrap();
    let refused = documents
        .iter()
        .filter(|d| d.get("refused").is_some())
        .count();
    if refused > 0 {
        let e = preprocess(&o).expect_err(&format!("{case}: MindSpeed refuses a record"));
        assert!(e.to_string().contains("--skip-bad-records"), "{case}: {e}");
        o.skip_bad_records = true;
    }
    let summary = preprocess(&o).unwrap_or_else(|e| panic!("{case}: {e}"));
    assert_eq!(
        summary.skipped.values().sum::<u64>() as usize,
        refused
            + documents
                .iter()
                .filter(|d| d.get("dropped").is_some())
                .count(),
        "{case}: records skipped"
    );
    let expected: Vec<&Value> = documents
        .iter()
        .filter(|d| d.get("dropped").is_none() && d.get("refused").is_none())
        .collect();
    let keys = match o.handler.is_some_and(HandlerKind::pairwise) {
        true => &PAIRWISE_KEYS[..],
        false => &INSTRUCTION_KEYS[..],
    };
    for &key in keys {
        let ds = IndexedDataset::open(&key_prefix(&prefix, key, true)).unwrap();
        assert_eq!(
            ds.doc_count(),
            expected.len(),
            "{case}: document count of {key}"
        );
        for (k, doc) in expected.iter().enumerate() {
            let want: Vec<Vec<i64>> = serde_json::from_value(doc[key].clone()).unwrap();
            let got: Vec<Vec<i64>> = ds.document_sequences(k).map(|s| ds.sequence(s)).collect();
            assert_eq!(got, want, "{case}: document {k}, {key}");
        }
    }
    true
}

/// The JSON goldens of `dir` whose name holds `infix`, compared; returns (compared, total).
fn compare_json_goldens(dir: &str, infix: &str) -> (usize, usize) {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(fixtures().join(dir))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .filter(|p| p.file_name().unwrap().to_string_lossy().contains(infix))
        .collect();
    paths.sort();
    let compared = paths.iter().filter(|p| matches_json_golden(p)).count();
    (compared, paths.len())
}

#[test]
fn instruction_handlers_match_mindspeed() {
    let (compared, _) = compare_json_goldens("golden/mindspeed", "");
    assert!(
        compared >= 10,
        "the tiny-bpe goldens must always be compared"
    );
}

/// The pairwise handlers (AlpacaStylePairwiseHandler, SharegptStylePairwiseHandler): string and
/// list answers, --map-keys as the shipped DPO data scripts give them, reasoning templates in each
/// --enable-thinking mode, records MindSpeed-LLM drops or raises on.
#[test]
fn pairwise_handlers_match_mindspeed() {
    let (compared, total) = compare_json_goldens("golden/mindspeed/pairwise", "");
    assert_eq!(total, 12);
    assert!(
        compared >= 4,
        "the tiny-bpe goldens must always be compared"
    );
}

/// Every template of MindSpeed-LLM's templates.json but deepseek4, on the alpaca fixtures.
#[test]
fn every_builtin_template_matches_mindspeed() {
    let (compared, total) = compare_json_goldens("golden/mindspeed/templates", "_alpaca_");
    assert_eq!(
        total, 34,
        "one golden per encodable template (magistral also with tekken)"
    );
    assert!(compared == total || compared == 0, "{compared} of {total}");
}

/// Reasoning templates (qwen3, glm4_moe, magistral, gpt_oss) in each --enable-thinking mode:
/// thoughts kept, removed, the empty thought in the prompt or in the answer; LFDefault and plain
/// templates on the same records, where the flag changes nothing.
#[test]
fn reasoning_templates_place_thoughts_as_mindspeed_in_each_thinking_mode() {
    let (compared, total) = compare_json_goldens("golden/mindspeed/templates", "_thinking_");
    assert_eq!(total, 18);
    assert!(compared == total || compared == 0, "{compared} of {total}");
}

/// Function-call messages: FunctionFormatter, FunctionFormatterForThink (bailing_mini), and the
/// records MindSpeed-LLM raises on (qwen3's tool format has no tool utils; invalid JSON), which
/// mindkit refuses.
#[test]
fn function_calls_are_formatted_or_refused_as_mindspeed() {
    let (compared, total) = compare_json_goldens("golden/mindspeed/templates", "_functions_");
    assert_eq!(total, 5);
    assert!(compared == total || compared == 0, "{compared} of {total}");
}

/// Runs mindkit on every case of `dir/cases.json` (written by MindSpeed-LLM's own
/// `serialize_to_disk`) and compares the .bin/.idx bytes; returns (compared, total).
fn compare_disk_cases(dir: &str) -> (usize, usize) {
    let golden = fixtures().join(dir);
    let cases: Value =
        serde_json::from_slice(&std::fs::read(golden.join("cases.json")).unwrap()).unwrap();
    let mut compared = 0;
    for (case, c) in cases.as_object().unwrap() {
        let Some(tok) = tokenizer(c["tokenizer"].as_str().unwrap()) else {
            continue;
        };
        let dir = tempfile::tempdir().unwrap();
        let prefix = dir.path().join("out");
        let corpus = fixtures()
            .join("corpus")
            .join(c["corpus"].as_str().unwrap());
        let mut o = options(corpus, prefix.clone(), tok);
        o.handler = HandlerKind::parse(c["handler"].as_str().unwrap());
        o.prompt_type = c["prompt_type"].as_str().map(String::from);
        o.seq_length = c["seq_length"].as_u64().map(|n| n as usize);
        o.pack = c["pack"].as_bool().unwrap();
        set_thinking(&mut o, c);
        preprocess(&o).unwrap_or_else(|e| panic!("{case}: {e}"));
        for key in ["input_ids", "attention_mask", "labels"] {
            for ext in ["bin", "idx"] {
                let name = format!("_packed_{key}_document.{ext}");
                let want = std::fs::read(golden.join(format!("{case}{name}"))).unwrap();
                let got = std::fs::read(dir.path().join(format!("out{name}"))).unwrap();
                assert!(got == want, "{case}: {name} differs from MindSpeed-LLM's");
            }
        }
        compared += 1;
    }
    (compared, cases.as_object().unwrap().len())
}

/// MindSpeed-LLM's own `serialize_to_disk` wrote these .bin/.idx (seq-length drop rule, template
/// cutoff, greedy packing with padding): mindkit must write the same bytes.
#[test]
fn seq_length_and_packing_are_byte_identical_to_mindspeed() {
    let (compared, _) = compare_disk_cases("golden/mindspeed/disk");
    assert!(compared >= 5, "the tiny-bpe cases must always be compared");
}

/// Truncation to --seq-length by the template classes (`_infer_seqlen` to cutoff − 1 for
/// ReasoningTemplate and LFDefaultTemplate, `infer_max_len` for Template, efficient_eos), then
/// the drop rule: the same bytes as MindSpeed-LLM's.
#[test]
fn template_truncation_is_byte_identical_to_mindspeed() {
    let (compared, total) = compare_disk_cases("golden/mindspeed/templates/disk");
    assert_eq!(total, 6);
    assert!(compared == total || compared == 0, "{compared} of {total}");
}

/// deepseek4 (DeepSeek4Template's own V4 encoder): every --enable-thinking mode with
/// --drop-thinking true and false, --reasoning-effort max and high, system prompts, multi-turn
/// thoughts, function and observation messages as tool results, OpenAI records, a conversation
/// it raises on; its tool machinery (`*_tools_*`: OpenAI tools columns, tool calls and results,
/// reasoning content, later system messages, records it raises on, a ShareGPT tools column
/// named by --map-keys); the same ids and labels as MindSpeed-LLM's handler.
#[test]
fn deepseek4_matches_mindspeed_in_each_thinking_mode() {
    let (compared, total) = compare_json_goldens("golden/mindspeed/templates/deepseek4", "");
    assert_eq!(total, 24);
    assert!(compared == total || compared == 0, "{compared} of {total}");
}

/// deepseek4 cut to --seq-length (LFDefaultTemplate's `_infer_seqlen`) and the drop rule: the
/// same .bin/.idx bytes as MindSpeed-LLM's `serialize_to_disk`.
#[test]
fn deepseek4_truncation_is_byte_identical_to_mindspeed() {
    let (compared, total) = compare_disk_cases("golden/mindspeed/templates/deepseek4/disk");
    assert_eq!(total, 3);
    assert!(compared == total || compared == 0, "{compared} of {total}");
}

/// preprocess_data.py refuses `--reasoning-effort` without `--enable-thinking true` before it
/// reads anything; so does mindkit.
#[test]
fn reasoning_effort_without_thinking_is_refused_as_mindspeed_does() {
    let dir = tempfile::tempdir().unwrap();
    let mut o = options(
        fixtures().join("corpus/thinking.jsonl"),
        dir.path().join("out"),
        fixtures().join("tokenizers/tiny-bpe"),
    );
    o.handler = HandlerKind::parse("sharegpt");
    o.prompt_type = Some("deepseek4".into());
    o.reasoning_effort = Some(ReasoningEffort::Max);
    for thinking in [None, Some(false)] {
        o.enable_thinking = thinking;
        let e = preprocess(&o).unwrap_err().to_string();
        assert!(
            e.contains("--reasoning-effort requires --enable-thinking true"),
            "{e}"
        );
    }
}
