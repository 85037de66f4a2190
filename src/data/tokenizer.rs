//! Hugging Face tokenizers: a `tokenizer.json`, or a model directory holding one (or a
//! GPT-2 style `vocab.json` + `merges.txt`) plus `tokenizer_config.json` /
//! `special_tokens_map.json` for the bos / eos / pad tokens and the chat template; and
//! Mistral's tekken files (`tekken.json`, [`super::tekken`]) behind the same interface.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::Value;
use tokenizers::Tokenizer as HfModel;

use super::tekken::{is_tekken_path, Tekken, TekkenError};

/// Errors loading or using a tokenizer.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// Nothing loadable at the path.
    #[error("{0}: no tokenizer.json (or vocab.json + merges.txt) found")]
    NotFound(PathBuf),
    /// The tokenizers library refused the file.
    #[error("{path}: cannot load tokenizer: {msg}")]
    Load {
        /// The file.
        path: PathBuf,
        /// The library's message.
        msg: String,
    },
    /// A config file is not valid JSON.
    #[error("{path}: {msg}")]
    Config {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        msg: String,
    },
    /// A needed special token is not defined.
    #[error("tokenizer {path} has no {which} token; {hint}")]
    MissingSpecial {
        /// The tokenizer path.
        path: PathBuf,
        /// "eos", "bos", "pad".
        which: &'static str,
        /// What the user can do.
        hint: &'static str,
    },
    /// A named token is not in the vocabulary.
    #[error("tokenizer {path}: token {token:?} is not in the vocabulary")]
    UnknownToken {
        /// The tokenizer path.
        path: PathBuf,
        /// The token.
        token: String,
    },
    /// Encoding failed.
    #[error("tokenization failed: {0}")]
    Encode(String),
    /// A tekken file is malformed, or an id is outside it.
    #[error(transparent)]
    Tekken(#[from] TekkenError),
    /// `--tokenizer-type MagistralTokenizer` names something else than a tekken file, or
    /// another type names one.
    #[error("{path}: {msg}")]
    Kind {
        /// The tokenizer path.
        path: PathBuf,
        /// What was expected.
        msg: &'static str,
    },
    /// A tekken tokenizer's vocabulary is fixed.
    #[error(
        "tokenizer {path}: cannot add the token {token:?}: a tekken tokenizer has no \
         add_special_tokens (nor has MindSpeed-LLM's MagistralTokenizer)"
    )]
    Fixed {
        /// The tokenizer path.
        path: PathBuf,
        /// The token.
        token: String,
    },
    /// The chat template is missing or failed to render.
    #[error("tokenizer {path}: chat template: {msg}")]
    Template {
        /// The tokenizer path.
        path: PathBuf,
        /// What went wrong.
        msg: String,
    },
}

type Result<T> = std::result::Result<T, TokenizerError>;

/// The model that turns text into ids.
#[derive(Clone)]
enum Model {
    Hf(Box<HfModel>),
    /// Shared: the rank tables are large and never change.
    Tekken(Arc<Tekken>),
}

/// A loaded tokenizer with its special tokens resolved to ids: a Hugging Face one, or a
/// tekken file as MindSpeed-LLM's `MagistralTokenizer` uses it (encode never adds bos/eos,
/// bos `<s>`, eos = eod `</s>`, pad `<pad>`, unk `<unk>`, no chat template).
#[derive(Clone)]
pub struct Tokenizer {
    inner: Model,
    path: PathBuf,
    bos: Option<u32>,
    eos: Option<u32>,
    pad: Option<u32>,
    /// tokenizer_config.json's `unk_token`: what transformers' `convert_tokens_to_ids` gives
    /// for a token outside the vocabulary.
    unk: Option<u32>,
    chat_template: Option<String>,
    /// tokenizer_config.json's `clean_up_tokenization_spaces`.
    clean_up_spaces: bool,
}

fn read_json(path: &Path) -> Result<Option<Value>> {
    match std::fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| TokenizerError::Config {
                path: path.to_path_buf(),
                msg: format!("invalid JSON: {e}"),
            }),
        Err(_) => Ok(None),
    }
}

/// A special-token entry is a string or an `AddedToken` dict `{"content": ...}`.
fn token_text(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

/// GPT-2 byte-level BPE from `vocab.json` + `merges.txt`, as transformers' GPT2 converter builds it.
fn byte_level_bpe(vocab: &Path, merges: &Path) -> Result<HfModel> {
    use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
    use tokenizers::models::bpe::BPE;
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    let load_err = |msg: String| TokenizerError::Load {
        path: vocab.to_path_buf(),
        msg,
    };
    let bpe = BPE::from_file(&vocab.to_string_lossy(), &merges.to_string_lossy())
        .build()
        .map_err(|e| load_err(e.to_string()))?;
    let mut tok = HfModel::new(bpe);
    tok.with_pre_tokenizer(Some(ByteLevel::default().add_prefix_space(false)));
    tok.with_decoder(Some(ByteLevelDecoder::default()));
    tok.with_post_processor(Some(ByteLevel::default().trim_offsets(false)));
    Ok(tok)
}

impl Tokenizer {
    /// Load from a `tokenizer.json` file or a model directory; a tekken file (a `.json`
    /// whose name contains "tekken", mistral-common's rule), or a directory holding only a
    /// `tekken.json`, loads as tekken.
    pub fn load(path: &Path) -> Result<Self> {
        if path.is_file() && is_tekken_path(path) {
            return Self::load_tekken(path);
        }
        let (dir, inner) = if path.is_dir() {
            let json = path.join("tokenizer.json");
            let (vocab, merges) = (path.join("vocab.json"), path.join("merges.txt"));
            let tekken = path.join("tekken.json");
            let inner = if json.is_file() {
                HfModel::from_file(&json).map_err(|e| TokenizerError::Load {
                    path: json.clone(),
                    msg: e.to_string(),
                })?
            } else if vocab.is_file() && merges.is_file() {
                byte_level_bpe(&vocab, &merges)?
            } else if tekken.is_file() {
                return Self::load_tekken(&tekken);
            } else {
                return Err(TokenizerError::NotFound(path.to_path_buf()));
            };
            (Some(path.to_path_buf()), inner)
        } else if path.is_file() {
            let inner = HfModel::from_file(path).map_err(|e| TokenizerError::Load {
                path: path.to_path_buf(),
                msg: e.to_string(),
            })?;
            (path.parent().map(Path::to_path_buf), inner)
        } else {
            return Err(TokenizerError::NotFound(path.to_path_buf()));
        };
        let mut tok = Tokenizer {
            inner: Model::Hf(Box::new(inner)),
            path: path.to_path_buf(),
            bos: None,
            eos: None,
            pad: None,
            unk: None,
            chat_template: None,
            clean_up_spaces: false,
        };
        if let Some(dir) = dir {
            tok.read_special_tokens(&dir)?;
        }
        Ok(tok)
    }

    /// Load a tekken file, as `--tokenizer-type MagistralTokenizer` does.
    pub fn load_tekken(path: &Path) -> Result<Self> {
        let tekken = Tekken::load(path)?;
        let special = |s: &str| tekken.token_id(s);
        let (bos, eos, pad, unk) = (
            special("<s>"),
            special("</s>"),
            special("<pad>"),
            special("<unk>"),
        );
        Ok(Tokenizer {
            inner: Model::Tekken(Arc::new(tekken)),
            path: path.to_path_buf(),
            bos,
            eos,
            pad,
            unk,
            chat_template: None,
            clean_up_spaces: false,
        })
    }

    /// Load as `--tokenizer-type` says: MagistralTokenizer takes a tekken file (as
    /// MindSpeed-LLM, which hands the path to mistral-common), other types anything but one.
    pub fn load_as(path: &Path, magistral: bool) -> Result<Self> {
        let kind = |msg| TokenizerError::Kind {
            path: path.to_path_buf(),
            msg,
        };
        if magistral {
            if !(path.is_file() && is_tekken_path(path)) {
                return Err(kind(
                    "--tokenizer-type MagistralTokenizer needs a tekken file: a .json whose name \
                     contains \"tekken\" (mistral-common's MistralTokenizer.from_file)",
                ));
            }
            return Self::load_tekken(path);
        }
        let tok = Self::load(path)?;
        if tok.is_tekken() {
            return Err(kind(
                "a tekken file: give --tokenizer-type MagistralTokenizer",
            ));
        }
        Ok(tok)
    }

    /// Whether this is a tekken tokenizer.
    pub fn is_tekken(&self) -> bool {
        matches!(self.inner, Model::Tekken(_))
    }

    fn hf(&self) -> Option<&HfModel> {
        match &self.inner {
            Model::Hf(t) => Some(t),
            Model::Tekken(_) => None,
        }
    }

    fn read_special_tokens(&mut self, dir: &Path) -> Result<()> {
        let config = read_json(&dir.join("tokenizer_config.json"))?;
        let map = read_json(&dir.join("special_tokens_map.json"))?;
        let lookup = |key: &str| {
            token_text(config.as_ref().and_then(|c| c.get(key)))
                .or_else(|| token_text(map.as_ref().and_then(|m| m.get(key))))
        };
        let resolve = |key: &str| -> Result<Option<u32>> {
            match lookup(key) {
                Some(text) => self.token_id(&text).map(Some),
                None => Ok(None),
            }
        };
        let (bos, eos, pad) = (
            resolve("bos_token")?,
            resolve("eos_token")?,
            resolve("pad_token")?,
        );
        self.bos = bos;
        self.eos = eos;
        self.pad = pad;
        // An unk token missing from the vocabulary reads as none, as transformers' unk_token_id.
        self.unk = lookup("unk_token").and_then(|t| self.lookup_id(&t));
        self.clean_up_spaces = config
            .as_ref()
            .and_then(|c| c.get("clean_up_tokenization_spaces"))
            .and_then(Value::as_bool)
            .unwrap_or(false);
        // transformers ≥ 4.43 saves the template beside the config, in chat_template.jinja.
        self.chat_template = config
            .as_ref()
            .and_then(|c| c.get("chat_template"))
            .and_then(Value::as_str)
            .map(str::to_string)
            .or_else(|| std::fs::read_to_string(dir.join("chat_template.jinja")).ok());
        Ok(())
    }

    /// The path it was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A hash of everything that decides how text becomes ids and back: the tokenizer's own
    /// serialization (vocabulary, merges, normalizer, added tokens), the special tokens and the
    /// chat template; two tokenizers with equal fingerprints tokenize alike.
    pub fn fingerprint(&self) -> Result<u128> {
        let serialized = match &self.inner {
            Model::Hf(t) => t.to_string(false).map_err(|e| TokenizerError::Load {
                path: self.path.clone(),
                msg: e.to_string(),
            })?,
            Model::Tekken(t) => format!("tekken {:032x}", t.fingerprint()),
        };
        let specials = format!(
            "{:?} {:?} {:?} {}",
            self.bos, self.eos, self.pad, self.clean_up_spaces
        );
        let mut bytes = Vec::with_capacity(serialized.len() + 64);
        for part in [
            serialized.as_str(),
            specials.as_str(),
            self.chat_template.as_deref().unwrap_or(""),
        ] {
            bytes.extend_from_slice(&(part.len() as u64).to_le_bytes());
            bytes.extend_from_slice(part.as_bytes());
        }
        Ok(twox_hash::XxHash3_128::oneshot(&bytes))
    }

    /// The vocabulary size MindSpeed-LLM pads and records: `len(tokenizer)` in transformers
    /// (the vocabulary including added tokens); for tekken `MagistralTokenizer.vocab_size`
    /// (see [`super::tekken::TekkenFile::msl_vocab_size`]), which can exceed [`Self::id_limit`].
    pub fn vocab_size(&self) -> usize {
        match &self.inner {
            Model::Hf(t) => t.get_vocab_size(true),
            Model::Tekken(t) => t.msl_vocab_size(),
        }
    }

    /// One past the highest id the tokenizer can give: what an embedding needs rows for.
    /// [`Self::vocab_size`] for Hugging Face tokenizers; mistral-common's `n_words` for tekken.
    pub fn id_limit(&self) -> usize {
        match &self.inner {
            Model::Hf(t) => t.get_vocab_size(true),
            Model::Tekken(t) => t.num_ids(),
        }
    }

    fn lookup_id(&self, token: &str) -> Option<u32> {
        match &self.inner {
            Model::Hf(t) => t.token_to_id(token),
            Model::Tekken(t) => t.token_id(token),
        }
    }

    /// Id of a token string (for tekken a special token's text, else an ordinary token's
    /// bytes), or an error naming it.
    pub fn token_id(&self, token: &str) -> Result<u32> {
        self.lookup_id(token)
            .ok_or_else(|| TokenizerError::UnknownToken {
                path: self.path.clone(),
                token: token.to_string(),
            })
    }

    /// The bos id, if the tokenizer defines one.
    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    /// The eos id, if the tokenizer defines one.
    pub fn eos(&self) -> Option<u32> {
        self.eos
    }

    /// The pad id, if the tokenizer defines one.
    pub fn pad(&self) -> Option<u32> {
        self.pad
    }

    /// transformers' `convert_tokens_to_ids(token)`: the token's id, else the unk id, else none.
    pub fn token_id_or_unk(&self, token: &str) -> Option<u32> {
        self.lookup_id(token).or(self.unk)
    }

    /// transformers' `add_special_tokens` for one token: it becomes a special added token (kept
    /// whole in text, never normalized), with a new id after the vocabulary when it has none.
    /// Returns its id (an empty token, which the library does not add, is an error). A tekken
    /// tokenizer refuses: MindSpeed-LLM's MagistralTokenizer has no such method.
    pub fn add_special_token(&mut self, token: &str) -> Result<u32> {
        match &mut self.inner {
            Model::Hf(t) => {
                t.add_special_tokens(&[tokenizers::AddedToken::from(token, true)]);
            }
            Model::Tekken(_) => {
                return Err(TokenizerError::Fixed {
                    path: self.path.clone(),
                    token: token.to_string(),
                })
            }
        }
        self.token_id(token)
    }

    /// `add_special_tokens({"eos_token": token})`: the token (added as a special token, see
    /// [`Self::add_special_token`]) becomes eos; MindSpeed's `replace_eos` for chat templates.
    pub fn set_eos(&mut self, token: &str) -> Result<()> {
        self.eos = Some(self.add_special_token(token)?);
        Ok(())
    }

    /// Make `id` the pad token.
    pub fn set_pad(&mut self, id: u32) {
        self.pad = Some(id);
    }

    /// The eos id, or an error explaining how to provide one.
    pub fn require_eos(&self) -> Result<u32> {
        self.eos.ok_or_else(|| TokenizerError::MissingSpecial {
            path: self.path.clone(),
            which: "eos",
            hint: "give a model directory whose tokenizer_config.json sets eos_token",
        })
    }

    /// Pad id, falling back to eos as MindSpeed does when no pad token is set.
    pub fn pad_or_eos(&self) -> Result<u32> {
        self.pad.map(Ok).unwrap_or_else(|| self.require_eos())
    }

    /// The chat template from tokenizer_config.json.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// Token ids of `text`; with `add_special` the post-processor adds BOS etc., like
    /// transformers' `tokenizer(text).input_ids`. A tekken tokenizer adds nothing either way:
    /// MindSpeed-LLM's MagistralTokenizer encodes with `bos=False, eos=False`, also when
    /// called as `tokenizer(text)` (TokenizerAdaptor's `do_adapt`).
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        match &self.inner {
            Model::Hf(t) => t
                .encode_fast(text, add_special)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| TokenizerError::Encode(e.to_string())),
            Model::Tekken(t) => Ok(t.encode(text)),
        }
    }

    /// Decode ids to text (special tokens kept, so prompts read as the model sees them).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        match &self.inner {
            Model::Hf(t) => t
                .decode(ids, false)
                .map_err(|e| TokenizerError::Encode(e.to_string())),
            Model::Tekken(t) => Ok(t.decode(ids, true)?),
        }
    }

    /// Decode ids to text without special tokens (generated text as a user reads it), as
    /// transformers' `decode(ids, skip_special_tokens=True)` does: with its
    /// `clean_up_tokenization` when tokenizer_config.json asks for it.
    pub fn decode_text(&self, ids: &[u32]) -> Result<String> {
        let text = match &self.inner {
            Model::Hf(t) => t
                .decode(ids, true)
                .map_err(|e| TokenizerError::Encode(e.to_string()))?,
            // mistral-common's default policy, IGNORE.
            Model::Tekken(t) => t.decode(ids, false)?,
        };
        if !self.clean_up_spaces {
            return Ok(text);
        }
        let pairs = [
            (" .", "."),
            (" ?", "?"),
            (" !", "!"),
            (" ,", ","),
            (" ' ", "'"),
            (" n't", "n't"),
            (" 'm", "'m"),
            (" 's", "'s"),
            (" 've", "'ve"),
            (" 're", "'re"),
        ];
        Ok(pairs.iter().fold(text, |t, (from, to)| t.replace(from, to)))
    }

    /// Render the chat template (transformers' `apply_chat_template(..., tokenize=False)`):
    /// `messages` as (role, content) pairs, with `bos_token` / `eos_token` defined and Python
    /// string methods available, as templates expect; `enable_thinking`, when given, is passed
    /// to the template as transformers passes extra keyword arguments (Qwen3's template reads
    /// it; left undefined otherwise, as there).
    pub fn apply_chat_template(
        &self,
        messages: &[(&str, &str)],
        add_generation_prompt: bool,
        enable_thinking: Option<bool>,
    ) -> Result<String> {
        let fail = |msg: String| TokenizerError::Template {
            path: self.path.clone(),
            msg,
        };
        let source = self.chat_template.as_deref().ok_or_else(|| {
            fail("no chat_template in tokenizer_config.json nor a chat_template.jinja".into())
        })?;
        let mut env = minijinja::Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        env.add_template("chat", source)
            .map_err(|e| fail(e.to_string()))?;
        let token = |id: Option<u32>| {
            id.and_then(|i| self.hf()?.id_to_token(i))
                .unwrap_or_default()
        };
        let messages: Vec<_> = messages
            .iter()
            .map(|(role, content)| minijinja::context! { role => role, content => content })
            .collect();
        env.get_template("chat")
            .and_then(|t| {
                let base = minijinja::context! {
                    messages => messages,
                    add_generation_prompt => add_generation_prompt,
                    bos_token => token(self.bos),
                    eos_token => token(self.eos),
                };
                match enable_thinking {
                    Some(on) => t.render(minijinja::context! { enable_thinking => on, ..base }),
                    None => t.render(base),
                }
            })
            .map_err(|e| fail(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use base64::Engine;

    /// A tekken file of the 256 bytes and 4 special tokens, named `name` in `dir`.
    fn write_tekken(dir: &Path, name: &str) -> PathBuf {
        let vocab: Vec<_> = (0..256u32)
            .map(|i| {
                let bytes = base64::engine::general_purpose::STANDARD.encode([i as u8]);
                serde_json::json!({"rank": i, "token_bytes": bytes, "token_str": null})
            })
            .collect();
        let specials: Vec<_> = ["<unk>", "<s>", "</s>", "<pad>"]
            .iter()
            .enumerate()
            .map(|(i, s)| serde_json::json!({"rank": i, "token_str": s, "is_control": true}))
            .collect();
        let root = serde_json::json!({
            "config": {"pattern": r"\S+|\s+", "default_vocab_size": 260,
                       "default_num_special_tokens": 4, "version": "v7"},
            "vocab": vocab, "special_tokens": specials,
        });
        let path = dir.join(name);
        std::fs::write(&path, root.to_string()).unwrap();
        path
    }

    #[test]
    fn a_tekken_file_loads_with_mindspeeds_special_ids_and_adds_no_bos() {
        let dir = tempfile::tempdir().unwrap();
        let tok = Tokenizer::load(&write_tekken(dir.path(), "tekken.json")).unwrap();
        assert!(tok.is_tekken());
        assert_eq!(
            (tok.bos(), tok.eos(), tok.pad()),
            (Some(1), Some(2), Some(3))
        );
        assert_eq!(tok.encode("ab", true).unwrap(), [4 + 97, 4 + 98]);
        assert_eq!((tok.vocab_size(), tok.id_limit()), (260, 260));
        // A directory holding only a tekken.json loads it.
        assert!(Tokenizer::load(dir.path()).unwrap().is_tekken());
    }

    #[test]
    fn magistral_type_needs_a_tekken_file_and_other_types_refuse_one() {
        let dir = tempfile::tempdir().unwrap();
        let tekken = write_tekken(dir.path(), "tekken.json");
        let misnamed = write_tekken(dir.path(), "vocab.json");
        assert!(Tokenizer::load_as(&tekken, true).is_ok());
        for path in [misnamed.as_path(), dir.path()] {
            let err = Tokenizer::load_as(path, true).err().unwrap().to_string();
            assert!(err.contains("needs a tekken file"), "{err}");
        }
        let err = Tokenizer::load_as(&tekken, false)
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("give --tokenizer-type MagistralTokenizer"),
            "{err}"
        );
    }

    #[test]
    fn a_tekken_tokenizer_cannot_add_tokens() {
        let dir = tempfile::tempdir().unwrap();
        let mut tok = Tokenizer::load(&write_tekken(dir.path(), "tekken.json")).unwrap();
        assert!(matches!(
            tok.set_eos("<|im_end|>"),
            Err(TokenizerError::Fixed { .. })
        ));
    }
}
