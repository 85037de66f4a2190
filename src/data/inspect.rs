//! `mindkit data info` and `mindkit data show`: look inside an indexed dataset.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use super::handlers::IGNORE;
use super::indexed::{IndexedDataset, IndexedError};
use super::tokenizer::{Tokenizer, TokenizerError};

/// Errors of the inspection commands.
#[derive(Debug, thiserror::Error)]
pub enum InspectError {
    /// Dataset error.
    #[error(transparent)]
    Indexed(#[from] IndexedError),
    /// Tokenizer error.
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    /// Nothing found at the prefix.
    #[error("{0}: no .idx found (give the prefix without extension, or the prefix passed to preprocess)")]
    NotFound(PathBuf),
    /// Index out of range.
    #[error("document {index} does not exist ({count} documents)")]
    OutOfRange {
        /// Requested.
        index: usize,
        /// Available.
        count: usize,
    },
}

/// The datasets behind a prefix: the prefix itself, or `{prefix}_*_document` outputs
/// of `preprocess` (packed instruction triples included), sorted by name.
pub fn resolve_prefixes(prefix: &Path) -> Result<Vec<PathBuf>, InspectError> {
    let direct = PathBuf::from(format!("{}.idx", prefix.display()));
    if direct.is_file() {
        return Ok(vec![prefix.to_path_buf()]);
    }
    let pattern = format!("{}_*.idx", glob::Pattern::escape(&prefix.to_string_lossy()));
    let mut found: Vec<PathBuf> = glob::glob(&pattern)
        .map_err(|_| InspectError::NotFound(prefix.to_path_buf()))?
        .filter_map(Result::ok)
        .map(|p| p.with_extension(""))
        .collect();
    found.sort();
    if found.is_empty() {
        return Err(InspectError::NotFound(prefix.to_path_buf()));
    }
    Ok(found)
}

/// A text report: documents, sequences, tokens, dtype and a length histogram.
pub fn info(prefix: &Path) -> Result<String, InspectError> {
    let mut out = String::new();
    for p in resolve_prefixes(prefix)? {
        let ds = IndexedDataset::open(&p)?;
        let lengths: Vec<usize> = (0..ds.len()).map(|i| ds.sequence_length(i)).collect();
        let tokens: u64 = lengths.iter().map(|&l| l as u64).sum();
        let empty_docs = (0..ds.doc_count())
            .filter(|&k| ds.document_sequences(k).is_empty())
            .count();
        let _ = writeln!(out, "{}", p.display());
        let _ = writeln!(
            out,
            "  documents {} (empty {}), sequences {}, tokens {}, dtype {}",
            ds.doc_count(),
            empty_docs,
            ds.len(),
            tokens,
            ds.dtype().name()
        );
        if let (Some(min), Some(max)) = (lengths.iter().min(), lengths.iter().max()) {
            let mut sorted = lengths.clone();
            sorted.sort_unstable();
            let _ = writeln!(
                out,
                "  sequence length min {min}, median {}, mean {:.1}, max {max}",
                sorted[sorted.len() / 2],
                tokens as f64 / lengths.len() as f64
            );
            out.push_str(&histogram(&lengths));
        }
    }
    Ok(out)
}

/// Power-of-two buckets of sequence lengths, with bars.
fn histogram(lengths: &[usize]) -> String {
    let mut buckets = [0usize; 40];
    for &l in lengths {
        let b = if l == 0 {
            0
        } else {
            (usize::BITS - l.leading_zeros()) as usize
        };
        buckets[b.min(39)] += 1;
    }
    let peak = buckets.iter().copied().max().unwrap_or(1).max(1);
    let mut out = String::new();
    for (b, &n) in buckets.iter().enumerate().filter(|(_, &n)| n > 0) {
        let (lo, hi) = if b == 0 {
            (0, 0)
        } else {
            (1usize << (b - 1), (1usize << b) - 1)
        };
        let bar = "#".repeat((n * 40).div_ceil(peak));
        let _ = writeln!(out, "  {lo:>8}..{hi:<8} {n:>9} {bar}");
    }
    out
}

/// Decoded text of document `index`; for instruction data the prompt (label -100) and
/// the trained answer are shown apart.
pub fn show(prefix: &Path, index: usize, tokenizer: &Path) -> Result<String, InspectError> {
    let tok = Tokenizer::load(tokenizer)?;
    let prefixes = resolve_prefixes(prefix)?;
    let find = |key: &str| {
        prefixes
            .iter()
            .find(|p| p.to_string_lossy().ends_with(&format!("_{key}_document")))
    };
    let mut out = String::new();
    if let (Some(ids_p), Some(labels_p)) = (find("input_ids"), find("labels")) {
        let (ids, labels) = (
            IndexedDataset::open(ids_p)?,
            IndexedDataset::open(labels_p)?,
        );
        check_index(index, ids.doc_count())?;
        for s in ids.document_sequences(index) {
            let (t, l) = (ids.sequence(s), labels.sequence(s));
            let split = l.iter().position(|&x| x != IGNORE).unwrap_or(l.len());
            let as_u32 = |v: &[i64]| v.iter().map(|&x| x as u32).collect::<Vec<_>>();
            let trained = t.iter().zip(&l).filter(|(_, &lab)| lab != IGNORE).count();
            let _ = writeln!(
                out,
                "── sequence {s}: {} tokens, {} trained (label ≠ -100)",
                t.len(),
                trained
            );
            let _ = writeln!(
                out,
                "[prompt, masked]\n{}",
                tok.decode(&as_u32(&t[..split]))?
            );
            let _ = writeln!(
                out,
                "[answer, trained]\n{}",
                tok.decode(&as_u32(&t[split..]))?
            );
        }
        return Ok(out);
    }
    for p in &prefixes {
        let ds = IndexedDataset::open(p)?;
        check_index(index, ds.doc_count())?;
        let _ = writeln!(out, "── {} document {index}", p.display());
        for s in ds.document_sequences(index) {
            let ids: Vec<u32> = ds.sequence(s).iter().map(|&x| x as u32).collect();
            let _ = writeln!(
                out,
                "[sequence {s}: {} tokens]\n{}",
                ids.len(),
                tok.decode(&ids)?
            );
        }
    }
    Ok(out)
}

fn check_index(index: usize, count: usize) -> Result<(), InspectError> {
    if index >= count {
        return Err(InspectError::OutOfRange { index, count });
    }
    Ok(())
}
