//! Columnar decoders (arrow-rs IPC, parquet) run on untrusted files with their panics caught.
//! arrow-rs panics on IPC schemas its flatbuffer verifier accepts (`fb_to_schema` unwraps
//! optional fields, `get_data_type` has `panic!`/`unimplemented!` arms: apache/arrow-rs
//! issues 10437, 10575, 10663, fixed by pull requests 10647 and 10744 after the arrow 56 this
//! crate uses), and parquet reaches the same code through a footer's `ARROW:schema`. Until
//! those releases are in, a panic inside the decoder becomes an error naming the file.

use std::panic::{self, AssertUnwindSafe};
use std::sync::{Arc, Mutex};

/// Serializes the panic-hook swap of [`contain_panics`] (the hook is process-wide).
static HOOK: Mutex<()> = Mutex::new(());

/// Run `decode` with a panic inside it caught and returned as its message. The process's
/// panic hook (which prints the panic, or aborts under a fuzzer) is set aside while `decode`
/// runs, so keep `decode` to the decoder's own calls: a panic elsewhere in that window would
/// be reported only through its own unwinding.
pub(super) fn contain_panics<T>(decode: impl FnOnce() -> T) -> Result<T, String> {
    let _swap = HOOK.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let message = Arc::new(Mutex::new(String::new()));
    let slot = Arc::clone(&message);
    let previous = panic::take_hook();
    panic::set_hook(Box::new(move |info| {
        let payload = info.payload();
        let what = (payload.downcast_ref::<&str>().copied())
            .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
            .unwrap_or("a panic");
        if let Ok(mut m) = slot.lock() {
            *m = what.to_string();
        }
    }));
    let result = panic::catch_unwind(AssertUnwindSafe(decode));
    panic::set_hook(previous);
    result.map_err(|_| {
        let m = message.lock().map(|m| m.clone()).unwrap_or_default();
        format!("the decoder failed on malformed data: {m}")
    })
}

/// Rows a columnar file may declare per byte it spends on them, above [`ROWS_FLOOR`]: the
/// rows of a text dataset take bytes, while nulls run-length encoded, or columns that need no
/// buffers, let a few hundred bytes declare billions of empty rows that would take minutes
/// and gigabytes to turn into records.
const ROWS_PER_BYTE: u64 = 64;
const ROWS_FLOOR: u64 = 1 << 16;

/// `rows` declared in `bytes` (a batch's body, a file): refused past [`ROWS_PER_BYTE`].
pub(super) fn check_rows(rows: i64, bytes: u64, what: &str) -> Result<(), String> {
    let most = bytes
        .saturating_mul(ROWS_PER_BYTE)
        .saturating_add(ROWS_FLOOR);
    match u64::try_from(rows) {
        Ok(n) if n <= most => Ok(()),
        _ => Err(format!(
            "{what} declares {rows} rows in {bytes} bytes (at most {ROWS_PER_BYTE} rows a byte \
             beyond {ROWS_FLOOR} are read)"
        )),
    }
}

/// A decoder's batches, each decoded under [`contain_panics`]; a panic ends the stream with
/// an error item.
pub(super) struct Contained<I> {
    inner: I,
    done: bool,
}

impl<I> Contained<I> {
    pub(super) fn new(inner: I) -> Self {
        Contained { inner, done: false }
    }
}

impl<I, T, E> Iterator for Contained<I>
where
    I: Iterator<Item = Result<T, E>>,
    E: std::fmt::Display,
{
    type Item = Result<T, String>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        match contain_panics(|| self.inner.next()) {
            Ok(item) => item.map(|r| r.map_err(|e| e.to_string())),
            Err(panicked) => {
                self.done = true;
                Some(Err(panicked))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decoder_panics_become_errors() {
        let e = contain_panics(|| -> u8 { panic!("fb.fields() was None") }).unwrap_err();
        assert!(
            e.contains("malformed data") && e.contains("fb.fields() was None"),
            "{e}"
        );
        assert_eq!(contain_panics(|| 7), Ok(7));
        // The hook is back: a later panic is reported as usual (caught here by the harness).
        let items = [Ok(1), Err("bad batch")];
        let mut batches = Contained::new(
            items
                .into_iter()
                .chain(std::iter::from_fn(|| panic!("inside"))),
        );
        assert_eq!(batches.next(), Some(Ok(1)));
        assert_eq!(batches.next(), Some(Err("bad batch".to_string())));
        assert!(matches!(batches.next(), Some(Err(e)) if e.contains("inside")));
        assert_eq!(batches.next(), None);
    }
}
