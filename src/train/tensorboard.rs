//! TensorBoard scalars, written as TensorBoard reads them: an `events.out.tfevents.*` file of
//! TFRecords (length, masked CRC-32C, payload, masked CRC-32C) holding `Event` protocol
//! buffers (tensorflow/core/util/event.proto, tensorflow/core/framework/summary.proto: a
//! `file_version` event first, then one `Summary` of simple values per step). Megatron writes
//! each scalar against the iteration and, under `<tag> vs samples`, against consumed samples.

use anyhow::{Context, Result};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

/// An open event file.
pub struct TensorBoard {
    out: BufWriter<File>,
}

/// Protocol-buffer encoding of the few fields an event needs.
fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn bytes_field(out: &mut Vec<u8>, field: u64, bytes: &[u8]) {
    varint(out, field << 3 | 2);
    varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// An `Event` with wall time, step and either a file version or a summary.
fn event(
    wall_time: f64,
    step: u64,
    file_version: Option<&str>,
    scalars: &[(&str, f32)],
) -> Vec<u8> {
    let mut e = Vec::new();
    varint(&mut e, 1 << 3 | 1);
    e.extend_from_slice(&wall_time.to_le_bytes());
    varint(&mut e, 2 << 3);
    varint(&mut e, step);
    if let Some(v) = file_version {
        bytes_field(&mut e, 3, v.as_bytes());
    } else {
        let mut summary = Vec::new();
        for (tag, value) in scalars {
            let mut v = Vec::new();
            bytes_field(&mut v, 1, tag.as_bytes());
            varint(&mut v, 2 << 3 | 5);
            v.extend_from_slice(&value.to_le_bytes());
            bytes_field(&mut summary, 1, &v);
        }
        bytes_field(&mut e, 5, &summary);
    }
    e
}

/// TFRecord's masked CRC-32C.
fn masked_crc(bytes: &[u8]) -> u32 {
    let crc = crc32c::crc32c(bytes);
    (crc.rotate_right(15)).wrapping_add(0xa282_ead8)
}

impl TensorBoard {
    /// A new event file in `dir` (created if missing).
    pub fn create(dir: &Path) -> Result<TensorBoard> {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("--tensorboard-dir {}", dir.display()))?;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let host = std::fs::read_to_string("/etc/hostname").unwrap_or_else(|_| "localhost".into());
        let name = format!(
            "events.out.tfevents.{}.{}.{}.mindkit",
            now as u64,
            host.trim(),
            std::process::id()
        );
        let path = dir.join(name);
        let file = File::create(&path).with_context(|| format!("creating {}", path.display()))?;
        let mut tb = TensorBoard {
            out: BufWriter::new(file),
        };
        tb.record(&event(now, 0, Some("brain.Event:2"), &[]))?;
        Ok(tb)
    }

    fn record(&mut self, payload: &[u8]) -> Result<()> {
        let len = (payload.len() as u64).to_le_bytes();
        self.out.write_all(&len)?;
        self.out.write_all(&masked_crc(&len).to_le_bytes())?;
        self.out.write_all(payload)?;
        self.out.write_all(&masked_crc(payload).to_le_bytes())?;
        Ok(())
    }

    /// Write `scalars` at `iteration`, and each again as `<tag> vs samples` at `samples`.
    pub fn scalars(&mut self, iteration: u64, samples: u64, scalars: &[(&str, f64)]) -> Result<()> {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let values: Vec<(&str, f32)> = scalars.iter().map(|&(t, v)| (t, v as f32)).collect();
        self.record(&event(now, iteration, None, &values))?;
        let vs: Vec<String> = scalars
            .iter()
            .map(|(t, _)| format!("{t} vs samples"))
            .collect();
        let values: Vec<(&str, f32)> = vs
            .iter()
            .zip(scalars)
            .map(|(t, &(_, v))| (t.as_str(), v as f32))
            .collect();
        self.record(&event(now, samples, None, &values))?;
        self.out.flush()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // The CRC of TensorFlow's record-format tests: masked_crc32c(b"") and of "foo".
    #[test]
    fn records_are_framed_as_tfrecord() {
        assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);
        let mut out = Vec::new();
        varint(&mut out, 300);
        assert_eq!(out, [0xac, 0x02]);
    }
}
