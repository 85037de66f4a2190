//! `cargo fuzz run safetensors_config`: see `mindkit::fuzzing::safetensors_config` for what the input is.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    mindkit::fuzzing::safetensors_config(data);
});
