//! Fuzz target: floodgate_h2::fuzzing::hpack on any input must return, never panic.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = floodgate_h2::fuzzing::hpack(data);
});
