//! Entry points for fuzzing the readers of untrusted files, each taking one input as bytes,
//! and the seed inputs built from `fixtures/`. The cargo-fuzz targets in `fuzz/` and the
//! smoke test `tests/fuzz_smoke.rs` call them: any input may be refused with an error, but a
//! panic, an abort or a sanitizer report is a bug. Each returns whether the input was read
//! (so that a test can tell seeds that reach the readers' depths from refused ones).
//!
//! Readers that take paths get the bytes written into a scratch directory that each thread
//! reuses (on tmpfs where there is one), so an execution costs no directory creation.

use crate::arch::roles::canonical;
use crate::ckpt::convert::open_checkpoint;
use crate::ckpt::hf::HfWeights;
use crate::ckpt::torch::pickle::{self, TensorRef, Value};
use crate::ckpt::torch::TorchFile;
use crate::data::indexed::IndexedDataset;
use crate::data::source::{expand_inputs, Item, RecordReader, Sink};
use crate::model::ModelSpec;
use std::path::{Path, PathBuf};

thread_local! {
    static SCRATCH: tempfile::TempDir = {
        let shm = Path::new("/dev/shm");
        let dir = if shm.is_dir() {
            tempfile::Builder::new().prefix("mindkit-fuzz-").tempdir_in(shm)
        } else {
            tempfile::Builder::new().prefix("mindkit-fuzz-").tempdir()
        };
        dir.expect("a scratch directory for fuzz inputs")
    };
}

/// `bytes` written to `rel` under this thread's scratch directory (parents created).
fn scratch_file(rel: &str, bytes: &[u8]) -> PathBuf {
    let path = SCRATCH.with(|d| d.path().join(rel));
    let parent = path
        .parent()
        .expect("scratch files lie in the scratch directory");
    std::fs::create_dir_all(parent).expect("scratch directory is writable");
    std::fs::write(&path, bytes).expect("scratch directory is writable");
    path
}

/// Two inputs packed into one: `[a's length, u32 little-endian][a][b]`; a length past the end
/// takes what is there.
pub fn split(data: &[u8]) -> (&[u8], &[u8]) {
    let Some((len, rest)) = data.split_first_chunk::<4>() else {
        return (data, &[]);
    };
    let len = (u32::from_le_bytes(*len) as usize).min(rest.len());
    rest.split_at(len)
}

/// The input [`split`] takes apart into `a` and `b`.
pub fn join(a: &[u8], b: &[u8]) -> Vec<u8> {
    let len = u32::try_from(a.len()).expect("fuzz inputs are far below 4 GiB");
    [&len.to_le_bytes()[..], a, b].concat()
}

/// The pickle reader and the `.pt` archive: the opcode machine on the bytes, then (for a zip)
/// the archive with every tensor's bytes read, the same file as an HF `pytorch_model.bin`, and
/// as the rank file of a Megatron checkpoint opened, read and configured as `convert` and the
/// engine do.
/// Returns whether the pickle (raw, or the archive's) parsed.
pub fn pickle(data: &[u8]) -> bool {
    let parsed = pickle::parse(data).is_ok();
    if !data.starts_with(b"PK") {
        return parsed;
    }
    let path = scratch_file("mg/mp_rank_00/model_optim_rng.pt", data);
    let Ok(pt) = TorchFile::open(&path) else {
        return false;
    };
    for (i, t) in tensors(pt.root()).into_iter().enumerate() {
        let _ = pt.read_tensor(&i.to_string(), t);
    }
    let _ = HfWeights::open_files(vec![path.clone()]);
    checkpoint(path.parent().and_then(Path::parent).expect("mg/mp_rank_00"));
    true
}

/// Every tensor of a parsed object (an explicit stack: depth is bounded by the reader, but
/// nothing here needs recursion).
fn tensors(root: &Value) -> Vec<&TensorRef> {
    let mut out = Vec::new();
    let mut todo = vec![root];
    while let Some(v) = todo.pop() {
        match v {
            Value::Tensor(t) => out.push(&**t),
            Value::List(items) | Value::Tuple(items) => todo.extend(items),
            Value::Dict(items) => todo.extend(items.iter().flat_map(|(k, v)| [k, v])),
            Value::Namespace(attrs) => todo.extend(attrs.iter().map(|(_, v)| v)),
            _ => {}
        }
    }
    out
}

/// A checkpoint directory opened as every command opens it, each canonical tensor read, and
/// the engine's configuration built from it.
fn checkpoint(dir: &Path) -> bool {
    let Ok(input) = open_checkpoint(dir, None, None) else {
        return false;
    };
    let read = canonical(&input.cfg)
        .into_iter()
        .all(|c| input.read(c).is_ok());
    ModelSpec::from_config(&input.cfg).is_ok() && read
}

/// The Hugging Face reader: `split(data)` is (`config.json`, `model.safetensors`) of a model
/// directory, opened as [`pickle()`] opens its checkpoint. Returns whether every tensor was read.
pub fn safetensors_config(data: &[u8]) -> bool {
    let (config, weights) = split(data);
    scratch_file("hf/config.json", config);
    let path = scratch_file("hf/model.safetensors", weights);
    checkpoint(path.parent().expect("hf/"))
}

/// The `torch_dist` index reader: `split(data)` is (`.metadata`, a `.distcp` file), the index
/// read over a directory holding that file as both of a writer's files, every chunk it names
/// opened and read. Returns whether the index was read.
pub fn torch_dist(data: &[u8]) -> bool {
    let (index, items) = split(data);
    let meta = scratch_file("td/.metadata", index);
    for f in ["__0_0.distcp", "__0_1.distcp"] {
        scratch_file(&format!("td/{f}"), items);
    }
    let dir = meta.parent().expect("td/");
    let _ = crate::ckpt::torch_dist::read_every_chunk(dir);
    crate::ckpt::torch::pickle::parse(index).is_ok()
}

/// The `.bin/.idx` reader: `split(data)` is (`.idx`, `.bin`), opened as a dataset whose every
/// sequence and document is read. Returns whether the pair opened.
pub fn idx(data: &[u8]) -> bool {
    let (index, tokens) = split(data);
    scratch_file("d.idx", index);
    let bin = scratch_file("d.bin", tokens);
    let Ok(ds) = IndexedDataset::open(&bin.with_extension("")) else {
        return false;
    };
    for i in 0..ds.len() {
        let _ = ds.sequence(i);
    }
    for k in 0..ds.doc_count() {
        let _ = ds.document_sequences(k);
    }
    true
}

/// File names [`records`] gives its input, by the first byte (modulo their count).
pub const RECORD_FILES: [&str; 8] = [
    "in.jsonl",
    "in.json",
    "in.txt",
    "in.parquet",
    "in.arrow",
    "in.jsonl.gz",
    "in.json.gz",
    "in.txt.gz",
];

/// The record sources: the first byte picks the format ([`RECORD_FILES`]), the rest is the
/// file, whose every record is streamed. Returns whether the stream ended without error.
pub fn records(data: &[u8]) -> bool {
    let Some((&kind, file)) = data.split_first() else {
        return false;
    };
    let name = RECORD_FILES[kind as usize % RECORD_FILES.len()];
    let path = scratch_file(name, file);
    let Ok(files) = expand_inputs(&[path]) else {
        return false;
    };
    RecordReader::new(files).run(&mut TakeAll).is_ok()
}

/// A sink that wants every record.
struct TakeAll;

impl Sink for TakeAll {
    fn wants(&mut self, _index: u64) -> bool {
        true
    }

    fn accept(&mut self, _index: u64, _item: Item) -> bool {
        true
    }
}

/// A seed input: the fuzz target it is for, a file name, and its bytes.
pub struct Seed {
    /// `pickle`, `safetensors_config`, `idx` or `records`.
    pub target: &'static str,
    /// A name unique within the target.
    pub name: String,
    /// The input.
    pub bytes: Vec<u8>,
}

/// Seed inputs for every target from the files under `fixtures` (the repository's
/// `fixtures/`): `.pt` files and their pickles, the tiny models' config.json + safetensors,
/// the `.idx/.bin` goldens, and the corpora as JSON lines, JSON, text, gzip, parquet and arrow.
pub fn seeds(fixtures: &Path) -> std::io::Result<Vec<Seed>> {
    let mut out = Vec::new();
    let mut seed = |target, path: &Path, suffix: &str, bytes| {
        let rel = path.strip_prefix(fixtures).unwrap_or(path);
        let name = rel.to_string_lossy().replace('/', "_") + suffix;
        out.push(Seed {
            target,
            name,
            bytes,
        });
    };
    for path in files_under(fixtures)? {
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
        let name = name.unwrap_or_default();
        let sibling = |ext: &str| std::fs::read(path.with_extension(ext));
        let kind = RECORD_FILES.iter().position(|f| {
            let ext = &f["in".len()..];
            name.ends_with(ext) && !ext.ends_with(".gz")
        });
        if name.ends_with(".pt") {
            let bytes = std::fs::read(&path)?;
            if let Some(pkl) = zip_record(&bytes, "data.pkl") {
                seed("pickle", &path, ".pkl", pkl);
            }
            seed("pickle", &path, "", bytes);
        } else if name == "config.json" && path.with_file_name("model.safetensors").is_file() {
            let weights = std::fs::read(path.with_file_name("model.safetensors"))?;
            seed(
                "safetensors_config",
                &path,
                "",
                join(&std::fs::read(&path)?, &weights),
            );
        } else if name.ends_with(".metadata") {
            let items = std::fs::read(path.with_file_name("__0_0.distcp")).unwrap_or_default();
            seed(
                "torch_dist",
                &path,
                "",
                join(&std::fs::read(&path)?, &items),
            );
        } else if name.ends_with(".idx") {
            if let Ok(bin) = sibling("bin") {
                seed("idx", &path, "", join(&std::fs::read(&path)?, &bin));
            }
        } else if let Some(kind) = kind.filter(|_| !path.starts_with(fixtures.join("golden"))) {
            let text = std::fs::read(&path)?;
            let gz_kind = RECORD_FILES
                .iter()
                .position(|f| *f == format!("{}.gz", RECORD_FILES[kind]));
            if let Some(gz) = gz_kind {
                seed(
                    "records",
                    &path,
                    ".gz",
                    [&[gz as u8][..], &gzip(&text)?].concat(),
                );
            }
            seed("records", &path, "", [&[kind as u8][..], &text].concat());
        }
    }
    let texts = [
        "one document",
        "another, longer document\nwith a newline",
        "",
    ];
    let columnar = [
        ("parquet", 3u8, parquet_bytes(&texts)),
        ("arrow_stream", 4, arrow_bytes(&texts, false)),
        ("arrow_file", 4, arrow_bytes(&texts, true)),
    ];
    for (name, kind, bytes) in columnar {
        let name = format!("columnar_{name}");
        out.push(Seed {
            target: "records",
            name,
            bytes: [&[kind][..], &bytes].concat(),
        });
    }
    Ok(out)
}

/// Every file under `dir`, sorted.
fn files_under(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d)? {
            let p = e?.path();
            if p.is_dir() {
                todo.push(p);
            } else {
                out.push(p);
            }
        }
    }
    out.sort();
    Ok(out)
}

/// The record `<archive>/name` of a zip, if it has one.
fn zip_record(zip_bytes: &[u8], name: &str) -> Option<Vec<u8>> {
    use std::io::Read;
    let mut archive = zip::ZipArchive::new(std::io::Cursor::new(zip_bytes)).ok()?;
    let full = archive
        .file_names()
        .find(|n| n.ends_with(&format!("/{name}")))?
        .to_string();
    let mut out = Vec::new();
    archive.by_name(&full).ok()?.read_to_end(&mut out).ok()?;
    Some(out)
}

fn gzip(bytes: &[u8]) -> std::io::Result<Vec<u8>> {
    use std::io::Write;
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(bytes)?;
    gz.finish()
}

/// A record batch with one `text` column.
fn text_batch(texts: &[&str]) -> arrow::record_batch::RecordBatch {
    use arrow::array::StringArray;
    use arrow::datatypes::{DataType, Field, Schema};
    let schema = Schema::new(vec![Field::new("text", DataType::Utf8, true)]);
    let column = std::sync::Arc::new(StringArray::from(texts.to_vec()));
    arrow::record_batch::RecordBatch::try_new(std::sync::Arc::new(schema), vec![column])
        .expect("one utf-8 column matches its schema")
}

pub(crate) fn parquet_bytes(texts: &[&str]) -> Vec<u8> {
    let batch = text_batch(texts);
    let mut buf = Vec::new();
    let mut w = parquet::arrow::ArrowWriter::try_new(&mut buf, batch.schema(), None)
        .expect("writing parquet to memory");
    w.write(&batch).expect("writing parquet to memory");
    w.close().expect("writing parquet to memory");
    buf
}

/// An Arrow IPC stream (as Hugging Face `datasets` caches tables) or file.
pub(crate) fn arrow_bytes(texts: &[&str], file_format: bool) -> Vec<u8> {
    use arrow::ipc::writer::{FileWriter, StreamWriter};
    let batch = text_batch(texts);
    let mut buf = Vec::new();
    let written = if file_format {
        FileWriter::try_new(&mut buf, &batch.schema())
            .and_then(|mut w| w.write(&batch).and_then(|_| w.finish()))
    } else {
        StreamWriter::try_new(&mut buf, &batch.schema())
            .and_then(|mut w| w.write(&batch).and_then(|_| w.finish()))
    };
    written.expect("writing arrow to memory");
    buf
}
