//! The vector extensions the codec's hand-written loops may use on this CPU, checked once
//! (the attention kernel picks its own builds: `attention::kernel`).

use std::sync::OnceLock;

/// The widest of the codec's vector builds this CPU runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Simd {
    /// Portable code only.
    Portable,
    /// AVX2 (256-bit registers).
    Avx2,
    /// AVX-512F (512-bit registers).
    Avx512,
}

/// The widest build this CPU runs (checked once).
pub fn simd() -> Simd {
    static LEVEL: OnceLock<Simd> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f") {
                return Simd::Avx512;
            }
            if is_x86_feature_detected!("avx2") {
                return Simd::Avx2;
            }
        }
        Simd::Portable
    })
}
