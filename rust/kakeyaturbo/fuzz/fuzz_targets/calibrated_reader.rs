//! libFuzzer target: the first byte picks one of the corpus calibrations; the rest, its last
//! four bytes replaced by the CRC-32 of the others, goes through that calibration's reader and
//! decoder (typed error, or finite values of the stated size, within the allocation bound).
#![no_main]

#[path = "../../tests/fuzz/harness.rs"]
mod harness;

use std::sync::OnceLock;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    static CODECS: OnceLock<Vec<kakeyaturbo::CalibratedCodec>> = OnceLock::new();
    let codecs = CODECS.get_or_init(harness::calibrated_codecs);
    if let Some((&k, rest)) = data.split_first() {
        let c = &codecs[k as usize % codecs.len()];
        harness::check_calibrated(c, &harness::with_crc(rest));
    }
});
