//! libFuzzer target: any bytes, their last four replaced by the CRC-32 of the rest, through
//! the per-block reader and decoder (typed error, or finite values of the stated size, within
//! the allocation bound; see `tests/fuzz/harness.rs`).
#![no_main]

#[path = "../../tests/fuzz/harness.rs"]
mod harness;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    harness::check_perblock(&harness::with_crc(data));
});
