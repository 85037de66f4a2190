//! Mistral's tekken tokenizer, as mistral-common 1.13.1's `Tekkenizer` encodes and decodes
//! (`mistral_common/tokens/tokenizers/tekken.py`), which is what MindSpeed-LLM's
//! `--tokenizer-type MagistralTokenizer` calls (`magistral_tokenizer.py`, `tokenize`:
//! `Tekkenizer.encode(text, bos=False, eos=False)`).
//!
//! Ids: the special tokens take `0..num_special`; ordinary token `r` (its rank in the file)
//! is id `num_special + r`. Encoding never produces a special id: text such as `[INST]` or
//! `</s>` is ordinary text to tekken, as to tiktoken with no special tokens registered.
//!
//! Encoding is tiktoken's (openai/tiktoken `src/lib.rs`, `CoreBPE::encode_ordinary` and
//! `byte_pair_encode`): split the text with the file's pattern, keep a piece that is a token
//! whole, else start from its bytes and merge, again and again, the leftmost adjacent pair
//! whose concatenation has the lowest rank. It is written here rather than built as a
//! `tokenizers` BPE model (transformers' tekken converter does that) because a BPE model
//! merges by a list of merge pairs: it equals tiktoken only with every split of every token
//! as a merge and `ignore_merges`, and would still need the special-id hole and offset
//! handled around it; the loop below is tiktoken's rule itself, so exactness does not rest on
//! that equivalence. The pattern's `\s+(?!\S)` needs lookahead: it runs on Oniguruma (the
//! `tokenizers` crate's regex engine, `SysRegex`), a backtracking engine with the same
//! leftmost-first alternation as tiktoken's fancy-regex.

mod file;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

pub use file::{is_tekken_path, TekkenFile, TekkenFileError};
use tokenizers::utils::SysRegex;

/// Errors loading or using a tekken tokenizer.
#[derive(Debug, thiserror::Error)]
pub enum TekkenError {
    /// The file is unreadable or malformed.
    #[error(transparent)]
    File(#[from] TekkenFileError),
    /// The file's pattern does not compile.
    #[error("{path}: config.pattern does not compile: {msg}")]
    Pattern {
        /// The file.
        path: PathBuf,
        /// The regex engine's message.
        msg: String,
    },
    /// An id past the vocabulary was given to decode.
    #[error("{path}: id {id} is outside the vocabulary ({size} ids)")]
    UnknownId {
        /// The file.
        path: PathBuf,
        /// The id.
        id: u32,
        /// Ids the tokenizer has.
        size: usize,
    },
}

/// A loaded tekken tokenizer.
pub struct Tekken {
    path: PathBuf,
    split: SysRegex,
    /// Token bytes → rank (the id less `specials.len()`).
    ranks: HashMap<Vec<u8>, u32>,
    /// Rank → token bytes.
    tokens: Vec<Vec<u8>>,
    /// Id → special token text, for ids below `specials.len()`.
    specials: Vec<String>,
    special_ids: HashMap<String, u32>,
    msl_vocab_size: usize,
    digest: u128,
}

impl std::fmt::Debug for Tekken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tekken")
            .field("path", &self.path)
            .field("tokens", &self.tokens.len())
            .field("specials", &self.specials.len())
            .finish()
    }
}

impl Tekken {
    /// Load a `tekken.json` (see [`TekkenFile`] for what is checked).
    pub fn load(path: &Path) -> Result<Self, TekkenError> {
        let file = TekkenFile::read(path)?;
        let split = SysRegex::new(&file.pattern).map_err(|e| TekkenError::Pattern {
            path: path.to_path_buf(),
            msg: e.to_string(),
        })?;
        let mut hashed = Vec::new();
        for part in std::iter::once(file.pattern.as_bytes())
            .chain(file.specials.iter().map(String::as_bytes))
            .chain(file.ranks.iter().map(Vec::as_slice))
        {
            hashed.extend_from_slice(&(part.len() as u64).to_le_bytes());
            hashed.extend_from_slice(part);
        }
        hashed.extend_from_slice(&(file.msl_vocab_size as u64).to_le_bytes());
        let ranks = (file.ranks.iter().enumerate())
            .map(|(rank, bytes)| (bytes.clone(), rank as u32))
            .collect();
        let special_ids = (file.specials.iter().enumerate())
            .map(|(id, s)| (s.clone(), id as u32))
            .collect();
        Ok(Tekken {
            path: path.to_path_buf(),
            split,
            ranks,
            tokens: file.ranks,
            specials: file.specials,
            special_ids,
            msl_vocab_size: file.msl_vocab_size,
            digest: twox_hash::XxHash3_128::oneshot(&hashed),
        })
    }

    /// The file it was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// mistral-common's `n_words`: special plus ordinary tokens, one past the highest id.
    pub fn num_ids(&self) -> usize {
        self.specials.len() + self.tokens.len()
    }

    /// MindSpeed-LLM's `vocab_size` (see [`TekkenFile::msl_vocab_size`]); what Megatron pads.
    pub fn msl_vocab_size(&self) -> usize {
        self.msl_vocab_size
    }

    /// A hash of the pattern, the special tokens and the ranks.
    pub fn fingerprint(&self) -> u128 {
        self.digest
    }

    /// The id of a special token's text, else of the ordinary token with these bytes.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.special_ids.get(token).copied().or_else(|| {
            self.ranks
                .get(token.as_bytes())
                .map(|r| r + self.specials.len() as u32)
        })
    }

    /// `Tekkenizer.encode(text, bos=False, eos=False)`.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let offset = self.specials.len() as u32;
        let mut ids = Vec::with_capacity(text.len() / 3 + 1);
        // Text the pattern does not match is dropped, as tiktoken drops it (this pattern
        // matches every character).
        for (start, end) in self.split.find_iter(text) {
            let piece = &text.as_bytes()[start..end];
            match self.ranks.get(piece) {
                Some(&rank) => ids.push(rank + offset),
                None => self.merge(piece, offset, &mut ids),
            }
        }
        ids
    }

    /// Byte-pair merge of one piece that is not a token whole: `bounds` are the starts of
    /// the current parts (and the end), `pair_ranks[k]` the rank of parts k and k+1 joined.
    fn merge(&self, piece: &[u8], offset: u32, ids: &mut Vec<u32>) {
        let mut bounds: Vec<usize> = (0..=piece.len()).collect();
        let joined = |bounds: &[usize], k: usize| match bounds.get(k + 2) {
            Some(&end) => self.ranks.get(&piece[bounds[k]..end]).copied(),
            None => None,
        };
        let mut pair_ranks: Vec<Option<u32>> = (0..piece.len().saturating_sub(1))
            .map(|k| joined(&bounds, k))
            .collect();
        // `min_by_key` keeps the first of equal minima: the leftmost pair, as tiktoken.
        while let Some((k, _)) = (pair_ranks.iter().enumerate())
            .filter_map(|(k, r)| r.map(|r| (k, r)))
            .min_by_key(|&(_, r)| r)
        {
            bounds.remove(k + 1);
            pair_ranks.remove(k);
            if k < pair_ranks.len() {
                pair_ranks[k] = joined(&bounds, k);
            }
            if k > 0 {
                pair_ranks[k - 1] = joined(&bounds, k - 1);
            }
        }
        // Every part is a single byte (all 256 are tokens, checked at load) or a merge found
        // in the ranks.
        ids.extend(
            bounds
                .windows(2)
                .filter_map(|w| self.ranks.get(&piece[w[0]..w[1]]).map(|r| r + offset)),
        );
    }

    /// `Tekkenizer.decode`: ordinary tokens' bytes as UTF-8 (invalid sequences replaced, as
    /// tiktoken's `errors="replace"`), each run of them decoded on its own; special tokens as
    /// their text with `keep_specials` (policy KEEP), else left out (IGNORE, the default).
    pub fn decode(&self, ids: &[u32], keep_specials: bool) -> Result<String, TekkenError> {
        let num_special = self.specials.len();
        let mut text = String::new();
        let mut run: Vec<u8> = Vec::new();
        for &id in ids {
            let index = id as usize;
            if let Some(special) = self.specials.get(index) {
                text.push_str(&String::from_utf8_lossy(&run));
                run.clear();
                if keep_specials {
                    text.push_str(special);
                }
            } else if let Some(bytes) = self.tokens.get(index - num_special) {
                run.extend_from_slice(bytes);
            } else {
                return Err(TekkenError::UnknownId {
                    path: self.path.clone(),
                    id,
                    size: self.num_ids(),
                });
            }
        }
        text.push_str(&String::from_utf8_lossy(&run));
        Ok(text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use base64::Engine;
    use serde_json::json;

    /// A tekken file with the 256 bytes, then `extra` merges, 4 special tokens and
    /// mistral-common's pattern.
    fn write_tekken(dir: &Path, extra: &[&str]) -> PathBuf {
        let b64 = |b: &[u8]| base64::engine::general_purpose::STANDARD.encode(b);
        let mut vocab: Vec<_> = (0..256u32)
            .map(|i| json!({"rank": i, "token_bytes": b64(&[i as u8]), "token_str": null}))
            .collect();
        for (i, t) in extra.iter().enumerate() {
            vocab.push(json!({"rank": 256 + i, "token_bytes": b64(t.as_bytes()), "token_str": t}));
        }
        let pattern = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
        let root = json!({
            "config": {"pattern": pattern, "default_vocab_size": 4 + vocab.len(),
                       "default_num_special_tokens": 4, "version": "v7"},
            "vocab": vocab,
            "special_tokens": [
                {"rank": 0, "token_str": "<unk>", "is_control": true},
                {"rank": 1, "token_str": "<s>", "is_control": true},
                {"rank": 2, "token_str": "</s>", "is_control": true},
                {"rank": 3, "token_str": "<pad>", "is_control": true},
            ],
        });
        let path = dir.join("tekken.json");
        std::fs::write(&path, root.to_string()).unwrap();
        path
    }

    fn byte_id(b: u8) -> u32 {
        4 + b as u32
    }

    #[test]
    fn merges_the_lowest_ranked_pair_first_and_offsets_by_the_specials() {
        let dir = tempfile::tempdir().unwrap();
        // ranks "bc" 256, "ab" 257: "abcd" merges b+c (the lower rank), and a+bc is no token.
        let tok = Tekken::load(&write_tekken(dir.path(), &["bc", "ab", "xabc"])).unwrap();
        assert_eq!(tok.encode("abcd"), [byte_id(b'a'), 260, byte_id(b'd')]);
        // With "abc" (258) a token, a+bc merges next; a piece that is a token is taken whole.
        let tok = Tekken::load(&write_tekken(dir.path(), &["bc", "ab", "abc"])).unwrap();
        assert_eq!(tok.encode("abcd"), [262, byte_id(b'd')]);
        assert_eq!(tok.encode("abc"), [262]);
    }

    #[test]
    fn equal_ranks_merge_leftmost_first() {
        let dir = tempfile::tempdir().unwrap();
        let tok = Tekken::load(&write_tekken(dir.path(), &["aa"])).unwrap();
        assert_eq!(tok.encode("aaa"), [260, byte_id(b'a')]);
        assert_eq!(tok.encode("aaaa"), [260, 260]);
    }

    #[test]
    fn special_token_text_is_ordinary_text() {
        let dir = tempfile::tempdir().unwrap();
        let tok = Tekken::load(&write_tekken(dir.path(), &[])).unwrap();
        let ids = tok.encode("</s>");
        assert!(ids.iter().all(|&id| id >= 4), "{ids:?}");
        assert_eq!(tok.decode(&ids, false).unwrap(), "</s>");
        assert_eq!(tok.token_id("</s>"), Some(2));
    }

    #[test]
    fn splits_with_the_pattern_lookahead() {
        let dir = tempfile::tempdir().unwrap();
        // "   x": `\s+(?!\S)` takes two spaces, the third goes with the letter.
        let tok = Tekken::load(&write_tekken(dir.path(), &["  ", " x"])).unwrap();
        assert_eq!(tok.encode("   x"), [260, 261]);
        assert_eq!(tok.encode("a\r\n\r\n"), [byte_id(b'a'), 17, 14, 17, 14]);
    }

    #[test]
    fn decodes_runs_apart_and_keeps_or_drops_specials() {
        let dir = tempfile::tempdir().unwrap();
        let tok = Tekken::load(&write_tekken(dir.path(), &[])).unwrap();
        let euro = "€".as_bytes();
        let ids = [1, byte_id(euro[0]), 2, byte_id(euro[1]), byte_id(euro[2])];
        let bad = "\u{fffd}";
        assert_eq!(
            tok.decode(&ids, true).unwrap(),
            format!("<s>{bad}</s>{bad}{bad}")
        );
        assert_eq!(tok.decode(&ids, false).unwrap(), bad.repeat(3));
        let err = tok.decode(&[4 + 256], false).unwrap_err().to_string();
        assert!(
            err.contains("id 260 is outside the vocabulary (260 ids)"),
            "{err}"
        );
    }

    #[test]
    fn refuses_a_pattern_that_does_not_compile() {
        let dir = tempfile::tempdir().unwrap();
        let path = write_tekken(dir.path(), &[]);
        let mut root: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        root["config"]["pattern"] = json!("(unclosed");
        std::fs::write(&path, root.to_string()).unwrap();
        let err = Tekken::load(&path).unwrap_err().to_string();
        assert!(err.contains("config.pattern does not compile"), "{err}");
    }
}
