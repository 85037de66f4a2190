//! `cargo fuzz run torch_dist`: see `mindkit::fuzzing::torch_dist` for what the input is.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    mindkit::fuzzing::torch_dist(data);
});
