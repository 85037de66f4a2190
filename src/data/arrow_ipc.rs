//! The lengths an Arrow IPC stream or file declares, checked against the file before arrow-rs
//! reads it. Its readers allocate whatever a message, footer or block declares and slice record
//! batch buffers without bounds checks (arrow-rs `arrow-ipc/src/reader.rs`: `MessageReader::
//! maybe_next`, `read_block`, `read_buffer`), so a 20-byte file could ask for gigabytes or
//! panic. Framing as the Arrow columnar format specification ("Serialization and
//! Interprocess Communication") defines it: messages are `[0xFFFFFFFF][i32 metadata
//! length][Message flatbuffer][body]` (the marker is absent in pre-0.15 streams) up to a zero
//! length or the end; a file is `ARROW1\0\0`, such a stream, the `Footer` flatbuffer, its i32
//! length and `ARROW1`, the footer listing the blocks the reader seeks to.
//!
//! A flatbuffer that does not verify is left for arrow-rs to report: it reads nothing more.

use super::untrusted::check_rows;
use arrow::ipc::{root_as_footer, root_as_message, Block, Message, MessageHeader};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

const MAGIC: &[u8; 6] = b"ARROW1";
const CONTINUATION: [u8; 4] = [0xff; 4];

/// Check the stream or file at `path` (a file when it starts with `ARROW1`); the error says
/// which length is out of bounds and where.
pub fn check(path: &Path) -> Result<(), String> {
    let mut ipc = Ipc::open(path).map_err(|e| e.to_string())?;
    let head = ipc.read_at(0, MAGIC.len().min(ipc.len as usize))?;
    if head.as_slice() == MAGIC {
        ipc.check_file()
    } else {
        ipc.check_stream()
    }
}

/// An open IPC file and its length.
struct Ipc {
    file: File,
    len: u64,
}

impl Ipc {
    fn open(path: &Path) -> std::io::Result<Ipc> {
        let file = File::open(path)?;
        let len = file.metadata()?.len();
        Ok(Ipc { file, len })
    }

    /// `n` bytes at `at`, which must lie inside the file.
    fn read_at(&mut self, at: u64, n: usize) -> Result<Vec<u8>, String> {
        if at.checked_add(n as u64).is_none_or(|end| end > self.len) {
            return Err(format!(
                "{n} bytes at byte {at} run past the end of the {}-byte file",
                self.len
            ));
        }
        let mut buf = vec![0u8; n];
        self.file
            .seek(SeekFrom::Start(at))
            .and_then(|_| self.file.read_exact(&mut buf))
            .map_err(|e| e.to_string())?;
        Ok(buf)
    }

    fn i32_at(&mut self, at: u64) -> Result<i32, String> {
        let b = self.read_at(at, 4)?;
        Ok(i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    /// Walk the messages of a stream from its start.
    fn check_stream(&mut self) -> Result<(), String> {
        let mut at = 0u64;
        while at < self.len {
            let mut meta_len = self.i32_at(at)?;
            at += 4;
            if meta_len.to_le_bytes() == CONTINUATION {
                meta_len = self.i32_at(at)?;
                at += 4;
            }
            if meta_len == 0 {
                return Ok(());
            }
            let meta_len = usize::try_from(meta_len)
                .map_err(|_| format!("negative metadata length {meta_len} at byte {at}"))?;
            let meta = self.read_at(at, meta_len)?;
            at += meta_len as u64;
            let Ok(message) = root_as_message(&meta) else {
                return Ok(());
            };
            let body = check_message(&message, self.len - at, at)?;
            at += body;
        }
        Ok(())
    }

    /// The footer and every block it lists.
    fn check_file(&mut self) -> Result<(), String> {
        let trailer = MAGIC.len() as u64 + 4;
        let Some(footer_end) = self.len.checked_sub(trailer) else {
            return Err(format!("{} bytes: too short for an Arrow file", self.len));
        };
        let footer_len = self.i32_at(footer_end)?;
        let footer_len = usize::try_from(footer_len)
            .map_err(|_| format!("negative footer length {footer_len}"))?;
        let footer_at = footer_end
            .checked_sub(footer_len as u64)
            .filter(|&at| at >= 8)
            .ok_or_else(|| {
                format!(
                    "a {footer_len}-byte footer does not fit the {}-byte file",
                    self.len
                )
            })?;
        let footer = self.read_at(footer_at, footer_len)?;
        let Ok(footer) = root_as_footer(&footer) else {
            return Ok(());
        };
        let blocks = (footer.dictionaries().into_iter().flatten())
            .chain(footer.recordBatches().into_iter().flatten());
        for block in blocks {
            self.check_block(block, footer_at)?;
        }
        Ok(())
    }

    /// A block lies before the footer, and its message's buffers inside its body.
    fn check_block(&mut self, block: &Block, footer_at: u64) -> Result<(), String> {
        let (at, meta, body) = (block.offset(), block.metaDataLength(), block.bodyLength());
        let bad = || {
            format!("block at byte {at} ({meta}-byte metadata, {body}-byte body) lies outside the file before its footer")
        };
        let (Ok(at), Ok(meta), Ok(body)) = (
            u64::try_from(at),
            usize::try_from(meta),
            u64::try_from(body),
        ) else {
            return Err(bad());
        };
        let end = at
            .checked_add(meta as u64)
            .and_then(|e| e.checked_add(body));
        if meta < 8 || end.is_none_or(|e| e > footer_at) {
            return Err(bad());
        }
        let bytes = self.read_at(at, meta)?;
        let prefix = if bytes[..4] == CONTINUATION { 8 } else { 4 };
        if let Ok(message) = root_as_message(&bytes[prefix..]) {
            check_buffers(&message, body, at + meta as u64)?;
        }
        Ok(())
    }
}

/// A message's body fits in `left` bytes and its buffers lie inside it; returns the body's
/// length. `at` (where the body starts) is only used in errors.
fn check_message(message: &Message, left: u64, at: u64) -> Result<u64, String> {
    let body = u64::try_from(message.bodyLength())
        .ok()
        .filter(|&b| b <= left)
        .ok_or_else(|| {
            format!(
                "the message body at byte {at} declares {} bytes, {left} are left",
                message.bodyLength()
            )
        })?;
    check_buffers(message, body, at)?;
    Ok(body)
}

/// The buffers of a record or dictionary batch lie inside its `body` bytes, and its rows are
/// not many more than those bytes can hold ([`check_rows`]).
fn check_buffers(message: &Message, body: u64, at: u64) -> Result<(), String> {
    let batch = match message.header_type() {
        MessageHeader::RecordBatch => message.header_as_record_batch(),
        MessageHeader::DictionaryBatch => {
            message.header_as_dictionary_batch().and_then(|d| d.data())
        }
        _ => None,
    };
    if let Some(b) = batch {
        check_rows(b.length(), body, &format!("the batch at byte {at}"))?;
    }
    for b in batch.and_then(|b| b.buffers()).into_iter().flatten() {
        let inside = u64::try_from(b.offset())
            .ok()
            .zip(u64::try_from(b.length()).ok())
            .and_then(|(o, l)| o.checked_add(l))
            .is_some_and(|end| end <= body);
        if !inside {
            return Err(format!(
                "a buffer at offset {} of {} bytes lies outside the {body}-byte body at byte {at}",
                b.offset(),
                b.length()
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fuzzing::arrow_bytes;

    fn stream() -> Vec<u8> {
        arrow_bytes(&["one document", "another"], false)
    }

    fn file() -> Vec<u8> {
        arrow_bytes(&["one document", "another"], true)
    }

    fn check_bytes(bytes: &[u8]) -> Result<(), String> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("in.arrow");
        std::fs::write(&path, bytes).unwrap();
        check(&path)
    }

    #[test]
    fn arrow_declared_lengths_are_checked() {
        check_bytes(&stream()).unwrap();
        check_bytes(&file()).unwrap();
        // What the records fuzzer fed arrow-rs: lengths that made it allocate 2 GiB (and
        // abort for larger bodies) on a file of a few bytes.
        let e = check_bytes(b"\xff\xff\xff\xff\xff\xff\xff\x7f").unwrap_err();
        assert!(
            e.contains("2147483647 bytes at byte 8 run past the end of the 8-byte file"),
            "{e}"
        );
        let e = check_bytes(b"\xff\xff\xff\xff\x00\x00\x00\x80").unwrap_err();
        assert!(e.contains("negative metadata length"), "{e}");
        // A stream cut inside its record batch's body.
        let s = stream();
        let e = check_bytes(&s[..s.len() - 20]).unwrap_err();
        assert!(e.contains("declares") || e.contains("run past"), "{e}");
        // What the records fuzzer found next: a batch of billions of rows in a 192-byte body
        // (no column needs a buffer), which took minutes and gigabytes to turn into records.
        let nulls: arrow::array::ArrayRef =
            std::sync::Arc::new(arrow::array::NullArray::new(10_000_000));
        let batch = arrow::record_batch::RecordBatch::try_from_iter([("text", nulls)]).unwrap();
        let mut empty_rows = Vec::new();
        let mut w =
            arrow::ipc::writer::StreamWriter::try_new(&mut empty_rows, &batch.schema()).unwrap();
        w.write(&batch).unwrap();
        w.finish().unwrap();
        drop(w);
        let e = check_bytes(&empty_rows).unwrap_err();
        assert!(e.contains("declares 10000000 rows in 0 bytes"), "{e}");
        // A file whose footer length points before the start.
        let mut f = file();
        let at = f.len() - 10;
        f[at..at + 4].copy_from_slice(&i32::MAX.to_le_bytes());
        let e = check_bytes(&f).unwrap_err();
        assert!(e.contains("footer does not fit"), "{e}");
    }
}
