//! `cargo fuzz run records`: see `mindkit::fuzzing::records` for what the input is.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    mindkit::fuzzing::records(data);
});
