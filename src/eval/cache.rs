//! `mindkit eval --cache FILE`: every document's raw result (loglikelihoods, or the generated
//! text) is appended to FILE as soon as it is computed, so a run that was interrupted, or is
//! repeated with other options that leave the prompts unchanged, computes only what is missing.
//!
//! FILE is JSON lines: a header naming the model and tokenizer the results belong to, then
//! `{"key": "<xxh3-128 hex>", "value": ...}` per document, the key hashing the request (kind,
//! prompt, continuations or generation settings). A cache of another model is refused; a last
//! line cut short by the interruption is ignored.

use anyhow::{bail, Context, Result};
use serde_json::{json, Value as Json};
use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use twox_hash::XxHash3_128;

/// Its first line's marker key.
const HEADER: &str = "mindkit-eval-cache";

/// Results of earlier runs, and the file new ones are appended to.
pub struct Cache {
    path: PathBuf,
    file: File,
    entries: HashMap<u128, Json>,
    /// Documents answered from the file in this run.
    pub reused: usize,
}

/// The key of a request: its parts, each length-prefixed so that no two lists collide by
/// concatenation.
pub fn key(parts: &[&str]) -> u128 {
    let mut bytes = Vec::new();
    for p in parts {
        bytes.extend_from_slice(&(p.len() as u64).to_le_bytes());
        bytes.extend_from_slice(p.as_bytes());
    }
    XxHash3_128::oneshot(&bytes)
}

impl Cache {
    /// Open (or create) `path` for the model and tokenizer `identity` names.
    pub fn open(path: &Path, identity: Json) -> Result<Cache> {
        let mut text = String::new();
        if path.exists() {
            File::open(path)
                .and_then(|mut f| f.read_to_string(&mut text))
                .with_context(|| format!("cannot read the cache {}", path.display()))?;
        }
        let mut lines = text.lines();
        let header = json!({HEADER: 1, "identity": identity});
        let mut entries = HashMap::new();
        if let Some(first) = lines.next() {
            let found: Json = serde_json::from_str(first).unwrap_or(Json::Null);
            if found.get(HEADER).is_none() {
                bail!(
                    "{} is not a mindkit eval cache (line 1 lacks \"{HEADER}\"); not touching it",
                    path.display()
                );
            }
            if found["identity"] != header["identity"] {
                bail!(
                    "the cache {} holds results of {}, not of {}; use another file",
                    path.display(),
                    found["identity"],
                    header["identity"]
                );
            }
            for line in lines {
                // A line that does not parse is the tail of an interrupted write.
                let Ok(entry) = serde_json::from_str::<Json>(line) else {
                    continue;
                };
                let key = entry["key"]
                    .as_str()
                    .and_then(|k| u128::from_str_radix(k, 16).ok());
                if let Some(key) = key {
                    entries.insert(key, entry["value"].clone());
                }
            }
        }
        let mut file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .with_context(|| format!("cannot write the cache {}", path.display()))?;
        if text.is_empty() {
            writeln!(file, "{header}")?;
        } else if !text.ends_with('\n') {
            // Start a fresh line after a cut-short one.
            writeln!(file)?;
        }
        Ok(Cache {
            path: path.to_path_buf(),
            file,
            entries,
            reused: 0,
        })
    }

    /// The stored result for `key`, counted as reused.
    pub fn get(&mut self, key: u128) -> Option<Json> {
        let v = self.entries.get(&key).cloned();
        self.reused += v.is_some() as usize;
        v
    }

    /// Store a result, on disk at once.
    pub fn put(&mut self, key: u128, value: Json) -> Result<()> {
        let line = json!({"key": format!("{key:032x}"), "value": value});
        writeln!(self.file, "{line}")
            .and_then(|_| self.file.flush())
            .with_context(|| format!("cannot append to the cache {}", self.path.display()))?;
        self.entries.insert(key, value);
        Ok(())
    }

    /// Where it lives.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn results_survive_a_reopen_and_a_cut_short_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cache.jsonl");
        let id = json!({"model": "m"});
        let mut c = Cache::open(&path, id.clone()).unwrap();
        c.put(key(&["ll", "ctx", " yes"]), json!([[-1.5, true]]))
            .unwrap();
        drop(c);
        // An interrupted append leaves half a line.
        OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap()
            .write_all(b"{\"key\": \"12")
            .unwrap();
        let mut c = Cache::open(&path, id.clone()).unwrap();
        assert_eq!(
            c.get(key(&["ll", "ctx", " yes"])),
            Some(json!([[-1.5, true]]))
        );
        assert_eq!(c.get(key(&["ll", "ctx", " no"])), None);
        assert_eq!(c.reused, 1);
        c.put(key(&["gen", "q"]), json!("text")).unwrap();
        drop(c);
        let mut c = Cache::open(&path, id).unwrap();
        assert_eq!(c.get(key(&["gen", "q"])), Some(json!("text")));
    }

    #[test]
    fn a_cache_of_another_model_or_a_foreign_file_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cache.jsonl");
        drop(Cache::open(&path, json!({"model": "a"})).unwrap());
        let err = Cache::open(&path, json!({"model": "b"})).err().unwrap();
        assert!(err.to_string().contains("holds results of"), "{err}");
        let foreign = dir.path().join("results.json");
        std::fs::write(&foreign, "{\"results\": {}}\n").unwrap();
        let err = Cache::open(&foreign, json!({"model": "a"})).err().unwrap();
        assert!(
            err.to_string().contains("not a mindkit eval cache"),
            "{err}"
        );
        assert_eq!(
            std::fs::read_to_string(&foreign).unwrap(),
            "{\"results\": {}}\n"
        );
    }

    #[test]
    fn keys_do_not_collide_by_concatenation() {
        assert_ne!(key(&["ab", "c"]), key(&["a", "bc"]));
    }
}
