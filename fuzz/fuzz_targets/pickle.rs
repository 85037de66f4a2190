//! `cargo fuzz run pickle`: see `mindkit::fuzzing::pickle` for what the input is.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    mindkit::fuzzing::pickle(data);
});
