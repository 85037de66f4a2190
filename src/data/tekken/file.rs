//! The tekken tokenizer file (`tekken.json`), read as mistral-common 1.13.1 reads it
//! (`mistral_common/tokens/tokenizers/tekken.py`: `Tekkenizer.from_file`, `__init__`,
//! `_reload_mergeable_ranks`) and checked as MindSpeed-LLM's `reload_tekken` checks it
//! (`mindspeed_llm/training/tokenizer/magistral_tokenizer.py`). Nothing in the file is trusted:
//! every key is looked up by name, every size is checked against the entries actually there.
//!
//! ```json
//! {"config": {"pattern": "...", "default_vocab_size": 131072,
//!             "default_num_special_tokens": 1000, "version": "v7", ...},
//!  "vocab": [{"rank": 0, "token_bytes": "AA==", "token_str": "\u0000"}, ...],
//!  "special_tokens": [{"rank": 0, "token_str": "<unk>", "is_control": true}, ...]}
//! ```

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use base64::Engine;
use serde_json::{Map, Value};

/// What is wrong with a tekken file; every variant names the file.
#[derive(Debug, thiserror::Error)]
pub enum TekkenFileError {
    /// Not a file mistral-common's `MistralTokenizer.from_file` takes for tekken.
    #[error(
        "{0}: not a tekken file: mistral-common loads a .json file whose name contains \
         \"tekken\" (e.g. tekken.json)"
    )]
    NotTekken(PathBuf),
    /// The file cannot be read.
    #[error("{path}: cannot read: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The file is not JSON.
    #[error("{path}: invalid JSON: {source}")]
    Json {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: serde_json::Error,
    },
    /// A key is missing or holds the wrong kind of value.
    #[error("{path}: {key}: {msg}")]
    Key {
        /// The file.
        path: PathBuf,
        /// The key, e.g. `vocab[300].rank`.
        key: String,
        /// What is wrong, with expected vs got.
        msg: String,
    },
}

type Result<T> = std::result::Result<T, TekkenFileError>;

/// mistral-common's `TokenizerVersion` members, oldest first.
const VERSIONS: [&str; 7] = ["v1", "v2", "v3", "v7", "v11", "v13", "v15"];

/// The special tokens a file of version ≤ v7 without a `special_tokens` list has
/// (mistral-common's `Tekkenizer.DEPRECATED_SPECIAL_TOKENS`), in rank order.
const DEPRECATED_SPECIAL_TOKENS: [&str; 20] = [
    "<unk>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
    "[TOOL_CALLS]",
    "[IMG]",
    "<pad>",
    "[IMG_BREAK]",
    "[IMG_END]",
    "[PREFIX]",
    "[MIDDLE]",
    "[SUFFIX]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
    "[TOOL_CONTENT]",
];

/// A validated tekken file.
#[derive(Debug)]
pub struct TekkenFile {
    /// `config.pattern`: the pre-split regex (tiktoken's `pat_str`).
    pub pattern: String,
    /// The byte sequence of each ordinary token, by rank, truncated to what encoding uses:
    /// `default_vocab_size - default_num_special_tokens` entries.
    pub ranks: Vec<Vec<u8>>,
    /// Every special token by id: the file's list (or the deprecated defaults), then
    /// mistral-common's `<SPECIAL_{i}>` fillers up to `default_num_special_tokens`.
    pub specials: Vec<String>,
    /// MindSpeed-LLM's `vocab_size`, `len(token_to_id)` of `reload_tekken`: the file's
    /// entries up to `default_vocab_size` (not less the special tokens, unlike
    /// mistral-common) plus the special tokens the file lists. A file without a list (which
    /// `reload_tekken` cannot read) counts every special token, fillers included.
    pub msl_vocab_size: usize,
}

/// mistral-common's `is_tekken`: a `.json` file whose name contains "tekken".
pub fn is_tekken_path(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "json")
        && path
            .file_name()
            .is_some_and(|n| n.to_string_lossy().contains("tekken"))
}

impl TekkenFile {
    /// Read and check `path`.
    pub fn read(path: &Path) -> Result<Self> {
        if !is_tekken_path(path) {
            return Err(TekkenFileError::NotTekken(path.to_path_buf()));
        }
        let bytes = std::fs::read(path).map_err(|source| TekkenFileError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let root: Value =
            serde_json::from_slice(&bytes).map_err(|source| TekkenFileError::Json {
                path: path.to_path_buf(),
                source,
            })?;
        Self::parse(path, &root)
    }

    fn parse(path: &Path, root: &Value) -> Result<Self> {
        let fail = |key: &str, msg: String| TekkenFileError::Key {
            path: path.to_path_buf(),
            key: key.to_string(),
            msg,
        };
        let root = root
            .as_object()
            .ok_or_else(|| fail("(top level)", "expected an object".into()))?;
        let config = object(root, "config").map_err(|m| fail("config", m))?;
        let pattern = config
            .get("pattern")
            .and_then(Value::as_str)
            .ok_or_else(|| fail("config.pattern", "expected a string".into()))?
            .to_string();
        let count = |key: &str| {
            config
                .get(key)
                .and_then(Value::as_u64)
                .and_then(|n| usize::try_from(n).ok())
                .ok_or_else(|| {
                    fail(
                        &format!("config.{key}"),
                        "expected a non-negative integer".into(),
                    )
                })
        };
        let vocab_size = count("default_vocab_size")?;
        let num_special = count("default_num_special_tokens")?;
        let version = config
            .get("version")
            .and_then(Value::as_str)
            .ok_or_else(|| fail("config.version", "expected a string".into()))?;
        let version_index = VERSIONS.iter().position(|v| *v == version).ok_or_else(|| {
            fail(
                "config.version",
                format!("unknown version {version:?}: expected one of {VERSIONS:?}"),
            )
        })?;
        let vocab = root
            .get("vocab")
            .and_then(Value::as_array)
            .ok_or_else(|| fail("vocab", "expected an array".into()))?;
        let inner = vocab_size.checked_sub(num_special).ok_or_else(|| {
            fail(
                "config.default_vocab_size",
                format!("{vocab_size} is below default_num_special_tokens {num_special}"),
            )
        })?;
        if inner > vocab.len() {
            return Err(fail(
                "config.default_vocab_size",
                format!(
                    "{vocab_size} needs {inner} vocab entries beside {num_special} special \
                     tokens, the file has {}",
                    vocab.len()
                ),
            ));
        }
        if inner < 256 {
            return Err(fail(
                "config.default_vocab_size",
                format!(
                    "{vocab_size} leaves {inner} ordinary tokens beside {num_special} special \
                     tokens: fewer than the 256 single bytes"
                ),
            ));
        }
        // MindSpeed-LLM checks the entries up to default_vocab_size, mistral-common those it
        // encodes with (fewer): check the former, keep the latter.
        let checked = vocab.len().min(vocab_size);
        let mut ranks = Vec::with_capacity(inner);
        let mut seen = HashSet::with_capacity(inner);
        for (i, entry) in vocab.iter().take(checked).enumerate() {
            let key = |k: &str| format!("vocab[{i}]{k}");
            let entry = exact_keys(entry, &["rank", "token_bytes", "token_str"])
                .map_err(|m| fail(&key(""), m))?;
            check_rank(entry, i).map_err(|m| fail(&key(".rank"), m))?;
            let encoded = entry
                .get("token_bytes")
                .and_then(Value::as_str)
                .ok_or_else(|| fail(&key(".token_bytes"), "expected a string".into()))?;
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(encoded)
                .map_err(|e| fail(&key(".token_bytes"), format!("invalid base64: {e}")))?;
            if i < 256 && bytes != [i as u8] {
                return Err(fail(
                    &key(".token_bytes"),
                    format!(
                        "the first 256 tokens are the single bytes: expected [{i}], got {bytes:?}"
                    ),
                ));
            }
            if i < inner {
                if !seen.insert(bytes.clone()) {
                    return Err(fail(
                        &key(".token_bytes"),
                        format!("{bytes:?} is already the bytes of an earlier token"),
                    ));
                }
                ranks.push(bytes);
            }
        }
        let listed = match root.get("special_tokens") {
            None | Some(Value::Null) if version_index > 3 => {
                return Err(fail(
                    "special_tokens",
                    format!(
                        "missing: a {version} file (newer than v7) must list its special tokens"
                    ),
                ))
            }
            None | Some(Value::Null) => None,
            Some(v) => Some(special_tokens(v).map_err(|(k, m)| fail(&k, m))?),
        };
        let listed_count = listed.as_ref().map(Vec::len);
        let mut specials = listed.unwrap_or_else(|| {
            DEPRECATED_SPECIAL_TOKENS
                .iter()
                .map(|s| s.to_string())
                .collect()
        });
        if specials.len() > num_special {
            return Err(fail(
                "special_tokens",
                format!(
                    "{} special tokens, more than config.default_num_special_tokens {num_special}",
                    specials.len()
                ),
            ));
        }
        let filled = specials.len()..num_special;
        specials.extend(filled.map(|i| format!("<SPECIAL_{i}>")));
        let mut unique = HashSet::with_capacity(specials.len());
        if let Some(dup) = specials.iter().find(|s| !unique.insert(s.as_str())) {
            return Err(fail(
                "special_tokens",
                format!("{dup:?} is listed twice (with the <SPECIAL_i> fillers)"),
            ));
        }
        for needed in ["<unk>", "<s>", "</s>", "<pad>"] {
            if !unique.contains(needed) {
                return Err(fail(
                    "special_tokens",
                    format!("no {needed:?}, which MindSpeed-LLM's MagistralTokenizer needs"),
                ));
            }
        }
        let msl_vocab_size = checked + listed_count.unwrap_or(specials.len());
        Ok(TekkenFile {
            pattern,
            ranks,
            specials,
            msl_vocab_size,
        })
    }
}

fn object<'v>(
    parent: &'v Map<String, Value>,
    key: &str,
) -> std::result::Result<&'v Map<String, Value>, String> {
    parent
        .get(key)
        .and_then(Value::as_object)
        .ok_or_else(|| "expected an object".to_string())
}

/// An entry whose keys are exactly `keys` (as MindSpeed-LLM's `reload_tekken` requires).
fn exact_keys<'v>(
    entry: &'v Value,
    keys: &[&str],
) -> std::result::Result<&'v Map<String, Value>, String> {
    let map = entry
        .as_object()
        .ok_or_else(|| "expected an object".to_string())?;
    let mut got: Vec<&str> = map.keys().map(String::as_str).collect();
    got.sort_unstable();
    let mut want = keys.to_vec();
    want.sort_unstable();
    if got != want {
        return Err(format!("expected the keys {want:?}, got {got:?}"));
    }
    Ok(map)
}

fn check_rank(entry: &Map<String, Value>, index: usize) -> std::result::Result<(), String> {
    match entry.get("rank").and_then(Value::as_u64) {
        Some(r) if r == index as u64 => Ok(()),
        Some(r) => Err(format!("ranks go in order: expected {index}, got {r}")),
        None => Err(format!("expected the integer {index}")),
    }
}

/// The `special_tokens` list: each `{rank, token_str, is_control}`, rank = position.
fn special_tokens(list: &Value) -> std::result::Result<Vec<String>, (String, String)> {
    let list = list.as_array().ok_or_else(|| {
        (
            "special_tokens".to_string(),
            "expected an array".to_string(),
        )
    })?;
    list.iter()
        .enumerate()
        .map(|(i, entry)| {
            let key = |k: &str| format!("special_tokens[{i}]{k}");
            let entry = exact_keys(entry, &["rank", "token_str", "is_control"])
                .map_err(|m| (key(""), m))?;
            check_rank(entry, i).map_err(|m| (key(".rank"), m))?;
            entry
                .get("token_str")
                .and_then(Value::as_str)
                .map(str::to_string)
                .ok_or_else(|| (key(".token_str"), "expected a string".to_string()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn byte_entries() -> Vec<Value> {
        (0..256u32)
            .map(|i| {
                let b = base64::engine::general_purpose::STANDARD.encode([i as u8]);
                json!({"rank": i, "token_bytes": b, "token_str": null})
            })
            .collect()
    }

    fn file(vocab: Vec<Value>, specials: Option<Value>, vocab_size: usize) -> Value {
        let mut root = json!({
            "config": {"pattern": "\\s+|\\S+", "default_vocab_size": vocab_size,
                       "default_num_special_tokens": 4, "version": "v7"},
            "vocab": vocab,
        });
        if let Some(s) = specials {
            root["special_tokens"] = s;
        }
        root
    }

    fn four_specials() -> Value {
        json!([
            {"rank": 0, "token_str": "<unk>", "is_control": true},
            {"rank": 1, "token_str": "<s>", "is_control": true},
            {"rank": 2, "token_str": "</s>", "is_control": true},
            {"rank": 3, "token_str": "<pad>", "is_control": true},
        ])
    }

    fn parse(root: &Value) -> Result<TekkenFile> {
        TekkenFile::parse(Path::new("t/tekken.json"), root)
    }

    fn key_error(root: &Value) -> (String, String) {
        match parse(root) {
            Err(TekkenFileError::Key { key, msg, .. }) => (key, msg),
            other => panic!("expected a key error, got {other:?}"),
        }
    }

    #[test]
    fn counts_the_vocab_size_as_mindspeed_does() {
        let mut vocab = byte_entries();
        vocab.push(json!({"rank": 256, "token_bytes": "YWI=", "token_str": "ab"}));
        vocab.push(json!({"rank": 257, "token_bytes": "Y2Q=", "token_str": "cd"}));
        // 260 = 4 special + 256 ordinary: mistral-common encodes with ranks 0..=255,
        // MindSpeed-LLM counts the 258 entries (all below 260) plus the 4 listed specials.
        let t = parse(&file(vocab, Some(four_specials()), 260)).unwrap();
        assert_eq!(t.ranks.len(), 256);
        assert_eq!(t.msl_vocab_size, 258 + 4);
        assert_eq!(t.specials, ["<unk>", "<s>", "</s>", "<pad>"]);
    }

    #[test]
    fn a_v7_file_without_special_tokens_gets_the_deprecated_ones_and_fillers() {
        let mut root = file(byte_entries(), None, 256 + 30);
        root["config"]["default_num_special_tokens"] = json!(30);
        let t = parse(&root).unwrap();
        assert_eq!(t.specials.len(), 30);
        assert_eq!(t.specials[11], "<pad>");
        assert_eq!(t.specials[20], "<SPECIAL_20>");
        assert_eq!(t.msl_vocab_size, 256 + 30);
    }

    #[test]
    fn a_newer_file_must_list_its_special_tokens() {
        let mut root = file(byte_entries(), None, 260);
        root["config"]["version"] = json!("v11");
        assert_eq!(key_error(&root).0, "special_tokens");
    }

    #[test]
    fn refuses_a_path_that_is_not_a_tekken_json() {
        for p in ["tokenizer.json", "tekken.txt", "tekken"] {
            assert!(matches!(
                TekkenFile::read(Path::new(p)),
                Err(TekkenFileError::NotTekken(_))
            ));
        }
    }

    #[test]
    fn refuses_ranks_out_of_order() {
        let mut vocab = byte_entries();
        vocab[7]["rank"] = json!(8);
        let (key, msg) = key_error(&file(vocab, Some(four_specials()), 260));
        assert_eq!(key, "vocab[7].rank");
        assert!(msg.contains("expected 7, got 8"), "{msg}");
    }

    #[test]
    fn refuses_an_entry_with_other_keys() {
        let mut vocab = byte_entries();
        vocab[3] = json!({"rank": 3, "token_bytes": "Aw=="});
        assert_eq!(
            key_error(&file(vocab, Some(four_specials()), 260)).0,
            "vocab[3]"
        );
    }

    #[test]
    fn refuses_first_tokens_that_are_not_the_bytes() {
        let mut vocab = byte_entries();
        vocab[65]["token_bytes"] = json!("Qg==");
        assert_eq!(
            key_error(&file(vocab, Some(four_specials()), 260)).0,
            "vocab[65].token_bytes"
        );
    }

    #[test]
    fn refuses_bad_base64() {
        let mut vocab = byte_entries();
        vocab.push(json!({"rank": 256, "token_bytes": "!!", "token_str": null}));
        let (key, msg) = key_error(&file(vocab, Some(four_specials()), 261));
        assert_eq!(key, "vocab[256].token_bytes");
        assert!(msg.contains("base64"), "{msg}");
    }

    #[test]
    fn refuses_duplicate_token_bytes() {
        let mut vocab = byte_entries();
        vocab.push(json!({"rank": 256, "token_bytes": "YQ==", "token_str": "a"}));
        assert_eq!(
            key_error(&file(vocab, Some(four_specials()), 261)).0,
            "vocab[256].token_bytes"
        );
    }

    #[test]
    fn refuses_a_vocab_size_the_entries_do_not_cover() {
        let (key, msg) = key_error(&file(byte_entries(), Some(four_specials()), 300));
        assert_eq!(key, "config.default_vocab_size");
        assert!(msg.contains("the file has 256"), "{msg}");
        let (key, _) = key_error(&file(byte_entries(), Some(four_specials()), 100));
        assert_eq!(key, "config.default_vocab_size");
    }

    #[test]
    fn refuses_missing_config_keys_and_unknown_versions() {
        let mut root = file(byte_entries(), Some(four_specials()), 260);
        root["config"]["version"] = json!("v4");
        assert_eq!(key_error(&root).0, "config.version");
        root["config"]
            .as_object_mut()
            .unwrap()
            .remove("default_num_special_tokens");
        assert_eq!(key_error(&root).0, "config.default_num_special_tokens");
        root.as_object_mut().unwrap().remove("config");
        assert_eq!(key_error(&root).0, "config");
    }

    #[test]
    fn refuses_special_tokens_without_eos_or_twice_listed() {
        let mut specials = four_specials();
        specials[2]["token_str"] = json!("<eos>");
        let (_, msg) = key_error(&file(byte_entries(), Some(specials), 260));
        assert!(msg.contains("</s>"), "{msg}");
        let mut specials = four_specials();
        specials[3]["token_str"] = json!("<s>");
        let (_, msg) = key_error(&file(byte_entries(), Some(specials), 260));
        assert!(msg.contains("twice"), "{msg}");
        let mut specials = four_specials();
        specials[1]["rank"] = json!(5);
        assert_eq!(
            key_error(&file(byte_entries(), Some(specials), 260)).0,
            "special_tokens[1].rank"
        );
    }

    #[test]
    fn reads_a_file_and_names_it_in_errors() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tekken.json");
        std::fs::write(&path, b"{not json").unwrap();
        let err = TekkenFile::read(&path).unwrap_err().to_string();
        assert!(err.contains("tekken.json: invalid JSON"), "{err}");
        std::fs::write(
            &path,
            file(byte_entries(), Some(four_specials()), 260).to_string(),
        )
        .unwrap();
        assert_eq!(TekkenFile::read(&path).unwrap().ranks.len(), 256);
    }
}
