//! `mindkit eval --cache FILE`: every document's raw result (loglikelihoods, or the generated
//! text) is appended to FILE as soon as it is computed, so a run that was interrupted, or is
//! repeated with other options that leave the prompts unchanged, computes only what is missing.
//!
//! FILE is JSON lines: a header naming the model and tokenizer the results belong to, then
//! `{"key": "<xxh3-128 hex>", "value": ...}` per document, the key hashing the request (kind,
//! prompt, continuations or generation settings). The header binds the results to the
//! *contents* of the weights and of the tokenizer ([`files_hash`], `Tokenizer::fingerprint`),
//! not to their paths: weights replaced in the same directory make the cache refuse, and a
//! model copied elsewhere keeps it. A last line cut short by the interruption is ignored.

use anyhow::{bail, Context, Result};
use memmap2::Mmap;
use rayon::prelude::*;
use serde_json::{json, Value as Json};
use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use twox_hash::XxHash3_128;

/// Its first line's marker key.
const HEADER: &str = "mindkit-eval-cache";
/// The header's version: 1 bound results to paths, 2 to contents.
const VERSION: u64 = 2;

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

/// A hash of the contents of `files` (each hashed whole, in parallel; sizes and order
/// included), independent of where they live.
pub fn files_hash(files: &[PathBuf]) -> Result<u128> {
    let hashes: Vec<(u64, u128)> = files
        .par_iter()
        .map(|path| {
            let file =
                File::open(path).with_context(|| format!("cannot read {}", path.display()))?;
            let len = file.metadata()?.len();
            if len == 0 {
                return Ok((0, XxHash3_128::oneshot(&[])));
            }
            // SAFETY: read-only map of a file we only read; a concurrent writer could change
            // the bytes we hash, which at worst gives a hash that matches no cache.
            let map = unsafe { Mmap::map(&file) }
                .with_context(|| format!("cannot map {}", path.display()))?;
            Ok((len, XxHash3_128::oneshot(&map)))
        })
        .collect::<Result<_>>()?;
    let mut bytes = Vec::with_capacity(hashes.len() * 24);
    for (len, h) in hashes {
        bytes.extend_from_slice(&len.to_le_bytes());
        bytes.extend_from_slice(&h.to_le_bytes());
    }
    Ok(XxHash3_128::oneshot(&bytes))
}

impl Cache {
    /// Open (or create) `path` for the model and tokenizer `identity` names (contents, not
    /// paths); `about` is recorded beside it for people reading the file.
    pub fn open(path: &Path, identity: Json, about: Json) -> Result<Cache> {
        let mut text = String::new();
        if path.exists() {
            File::open(path)
                .and_then(|mut f| f.read_to_string(&mut text))
                .with_context(|| format!("cannot read the cache {}", path.display()))?;
        }
        let mut lines = text.lines();
        let header = json!({HEADER: VERSION, "identity": identity, "about": about});
        let mut entries = HashMap::new();
        if let Some(first) = lines.next() {
            let found: Json = serde_json::from_str(first).unwrap_or(Json::Null);
            if found.get(HEADER).is_none() {
                bail!(
                    "{} is not a mindkit eval cache (line 1 lacks \"{HEADER}\"); not touching it",
                    path.display()
                );
            }
            if found[HEADER].as_u64() != Some(VERSION) {
                bail!(
                    "the cache {} was written by an older mindkit that bound results to paths, \
                     not to the weights; start a new cache file",
                    path.display()
                );
            }
            if found["identity"] != header["identity"] {
                bail!(
                    "the cache {} holds results of another model or tokenizer ({} {}), not of \
                     this one ({} {}); the weights or tokenizer changed, so use another file",
                    path.display(),
                    found["about"],
                    found["identity"],
                    header["about"],
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
        let mut c = Cache::open(&path, id.clone(), Json::Null).unwrap();
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
        let mut c = Cache::open(&path, id.clone(), Json::Null).unwrap();
        assert_eq!(
            c.get(key(&["ll", "ctx", " yes"])),
            Some(json!([[-1.5, true]]))
        );
        assert_eq!(c.get(key(&["ll", "ctx", " no"])), None);
        assert_eq!(c.reused, 1);
        c.put(key(&["gen", "q"]), json!("text")).unwrap();
        drop(c);
        let mut c = Cache::open(&path, id, Json::Null).unwrap();
        assert_eq!(c.get(key(&["gen", "q"])), Some(json!("text")));
    }

    #[test]
    fn a_cache_of_another_model_or_a_foreign_file_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cache.jsonl");
        drop(Cache::open(&path, json!({"model": "a"}), Json::Null).unwrap());
        let err = Cache::open(&path, json!({"model": "b"}), Json::Null)
            .err()
            .unwrap();
        assert!(err.to_string().contains("holds results of"), "{err}");
        let foreign = dir.path().join("results.json");
        std::fs::write(&foreign, "{\"results\": {}}\n").unwrap();
        let err = Cache::open(&foreign, json!({"model": "a"}), Json::Null)
            .err()
            .unwrap();
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
    fn a_cache_follows_the_weights_not_their_path() {
        let dir = tempfile::tempdir().unwrap();
        let weights = dir.path().join("model.safetensors");
        std::fs::write(&weights, b"weights one").unwrap();
        let before = files_hash(std::slice::from_ref(&weights)).unwrap();
        let moved = dir.path().join("copy.safetensors");
        std::fs::copy(&weights, &moved).unwrap();
        assert_eq!(before, files_hash(std::slice::from_ref(&moved)).unwrap());
        std::fs::write(&weights, b"weights two").unwrap();
        assert_ne!(before, files_hash(std::slice::from_ref(&weights)).unwrap());
    }

    #[test]
    fn a_version_1_cache_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cache.jsonl");
        std::fs::write(&path, "{\"mindkit-eval-cache\": 1, \"identity\": {}}\n").unwrap();
        let err = Cache::open(&path, json!({}), Json::Null).err().unwrap();
        assert!(err.to_string().contains("older mindkit"), "{err}");
    }

    #[test]
    fn keys_do_not_collide_by_concatenation() {
        assert_ne!(key(&["ab", "c"]), key(&["a", "bc"]));
    }
}
