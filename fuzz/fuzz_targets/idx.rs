//! `cargo fuzz run idx`: see `mindkit::fuzzing::idx` for what the input is.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    mindkit::fuzzing::idx(data);
});
