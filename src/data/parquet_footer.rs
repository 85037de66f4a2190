//! A parquet footer's container sizes, checked against its bytes before the parquet crate
//! decodes it. parquet 56 reserves every thrift list's declared element count before
//! decoding an element (apache/arrow-rs issue 10920, fixed by pull request 10979 after 56),
//! so a 500-byte file could ask for 60 GB and abort the process.
//!
//! The footer is `FileMetaData` in the thrift compact protocol (Apache Thrift
//! `doc/specs/thrift-compact-protocol.md`), followed by its u32 length and `PAR1`. Walked
//! here without decoding: every list, set and map holds at most as many elements as bytes
//! are left (an element takes at least one), every binary at most the bytes left, and
//! structs nest at most [`MAX_NESTING`] deep. A footer that is not where the trailer says is
//! left for the parquet crate to report.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

/// Struct and container nesting the walk follows (the parquet schema is flattened in the
/// footer: real files nest a few levels).
const MAX_NESTING: usize = 64;

/// Check the footer of the parquet file at `path`; the error says what is out of bounds.
pub fn check(path: &Path) -> Result<(), String> {
    let mut file = File::open(path).map_err(|e| e.to_string())?;
    let len = file.metadata().map_err(|e| e.to_string())?.len();
    let Some(trailer_at) = len.checked_sub(8) else {
        return Ok(());
    };
    let mut trailer = [0u8; 8];
    file.seek(SeekFrom::Start(trailer_at))
        .and_then(|_| file.read_exact(&mut trailer))
        .map_err(|e| e.to_string())?;
    let footer_len = u64::from(u32::from_le_bytes([
        trailer[0], trailer[1], trailer[2], trailer[3],
    ]));
    if &trailer[4..] != b"PAR1" || footer_len > trailer_at {
        return Ok(());
    }
    let mut footer = vec![0u8; footer_len as usize];
    file.seek(SeekFrom::Start(trailer_at - footer_len))
        .and_then(|_| file.read_exact(&mut footer))
        .map_err(|e| e.to_string())?;
    let mut walk = Compact {
        bytes: &footer,
        at: 0,
    };
    walk.value(STRUCT, 0)
        .map_err(|what| format!("footer byte {}: {what}", walk.at))
}

// Compact-protocol type codes.
const BOOL_TRUE: u8 = 1;
const BOOL_FALSE: u8 = 2;
const I8: u8 = 3;
const I16: u8 = 4;
const I32: u8 = 5;
const I64: u8 = 6;
const DOUBLE: u8 = 7;
const BINARY: u8 = 8;
const LIST: u8 = 9;
const SET: u8 = 10;
const MAP: u8 = 11;
const STRUCT: u8 = 12;
const UUID: u8 = 13;

/// A walk over compact-protocol bytes.
struct Compact<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Compact<'_> {
    fn left(&self) -> usize {
        self.bytes.len() - self.at
    }

    fn skip(&mut self, n: usize) -> Result<(), String> {
        if n > self.left() {
            return Err(format!("{n} bytes declared, {} left", self.left()));
        }
        self.at += n;
        Ok(())
    }

    fn byte(&mut self) -> Result<u8, String> {
        let b = *self.bytes.get(self.at).ok_or("the footer ends early")?;
        self.at += 1;
        Ok(b)
    }

    fn varint(&mut self) -> Result<u64, String> {
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            let b = self.byte()?;
            value |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Ok(value);
            }
        }
        Err("a varint longer than 10 bytes".into())
    }

    /// `count` elements of at least `min_bytes` each must fit in what is left.
    fn elements(&self, count: u64, min_bytes: u64) -> Result<u64, String> {
        if count.saturating_mul(min_bytes) > self.left() as u64 {
            return Err(format!(
                "a container of {count} elements in {} bytes",
                self.left()
            ));
        }
        Ok(count)
    }

    /// Skip one value of compact type `ty`.
    fn value(&mut self, ty: u8, depth: usize) -> Result<(), String> {
        if depth > MAX_NESTING {
            return Err(format!("values nested more than {MAX_NESTING} deep"));
        }
        match ty {
            // A bool inside a container is a byte; as a field it lives in the header.
            BOOL_TRUE | BOOL_FALSE | I8 => self.skip(1),
            I16 | I32 | I64 => self.varint().map(drop),
            DOUBLE => self.skip(8),
            UUID => self.skip(16),
            BINARY => {
                let n = self.varint()?;
                self.skip(usize::try_from(n).unwrap_or(usize::MAX))
            }
            LIST | SET => {
                let head = self.byte()?;
                let count = match head >> 4 {
                    15 => self.varint()?,
                    n => u64::from(n),
                };
                for _ in 0..self.elements(count, 1)? {
                    self.value(head & 0x0f, depth + 1)?;
                }
                Ok(())
            }
            MAP => {
                let count = self.varint()?;
                if count == 0 {
                    return Ok(());
                }
                let types = self.byte()?;
                for _ in 0..self.elements(count, 2)? {
                    self.value(types >> 4, depth + 1)?;
                    self.value(types & 0x0f, depth + 1)?;
                }
                Ok(())
            }
            STRUCT => self.fields(depth),
            other => Err(format!("unknown thrift type {other}")),
        }
    }

    /// The fields of a struct, up to its stop byte.
    fn fields(&mut self, depth: usize) -> Result<(), String> {
        loop {
            let head = self.byte()?;
            if head == 0 {
                return Ok(());
            }
            if head >> 4 == 0 {
                self.varint()?; // a field id that is not a small delta
            }
            match head & 0x0f {
                BOOL_TRUE | BOOL_FALSE => {}
                ty => self.value(ty, depth + 1)?,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check_bytes(bytes: &[u8]) -> Result<(), String> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("in.parquet");
        std::fs::write(&path, bytes).unwrap();
        check(&path)
    }

    /// `PAR1`, `footer`, its length, `PAR1`.
    fn with_footer(footer: &[u8]) -> Vec<u8> {
        let len = (footer.len() as u32).to_le_bytes();
        [&b"PAR1"[..], footer, &len, b"PAR1"].concat()
    }

    #[test]
    fn parquet_footer_sizes_are_checked() {
        check_bytes(&crate::fuzzing::parquet_bytes(&["one", "two"])).unwrap();
        // What the records fuzzer found: FileMetaData whose key_value_metadata (field 5) list
        // declares 33 M elements in one byte (the fuzzer's declared 9.9 G: parquet reserved 63 GB).
        let footer = [0x59, 0xfc, 0xff, 0xff, 0xff, 0x0f, 0x00];
        let e = check_bytes(&with_footer(&footer)).unwrap_err();
        assert!(
            e.contains("a container of 33554431 elements in 1 bytes"),
            "{e}"
        );
        // A binary longer than the footer, and structs nested past the bound.
        let e = check_bytes(&with_footer(&[0x18, 0xff, 0x7f, 0x00])).unwrap_err();
        assert!(e.contains("16383 bytes declared"), "{e}");
        let nested = [vec![0x1c; 100], vec![0x00; 101]].concat();
        let e = check_bytes(&with_footer(&nested)).unwrap_err();
        assert!(e.contains("nested more than 64 deep"), "{e}");
    }
}
