//! faer's matrix product, leaving the vector registers as the rest of the crate expects.
//!
//! faer's x86 kernels (the generated assembly of `private-gemm-x86`) return without
//! `vzeroupper`: the upper halves of the AVX registers stay dirty. This crate is built for
//! baseline x86-64 (legacy SSE, with `f16c` and the attention kernels reached by run-time
//! dispatch), and so is the Python interpreter around it; on Intel CPUs every switch between
//! legacy SSE and VEX code that follows then pays a state transition (the fp16 conversions of
//! the per-row scales, each a VEX instruction among SSE ones, on a Xeon with AVX-512). Measured
//! there with `examples/encode_speed.rs` (`benches/ab_builds.py`, one core): one block of 128
//! rows encoded in 0.45x the time for the default model's 3-bit key calibration and 0.63x for
//! its value one. [`matmul`] is faer's product followed by [`clear_upper`].

use faer::linalg::matmul::matmul as faer_matmul;
use faer::mat::{AsMatMut, AsMatRef};
use faer::traits::{ComplexField, Conjugate};
use faer::{Accum, Par, Shape};

/// `dst = beta * dst + alpha * lhs * rhs` ([`faer::linalg::matmul::matmul`]), then
/// [`clear_upper`].
pub fn matmul<T, LhsT, RhsT, M, N, K>(
    dst: impl AsMatMut<T = T, Rows = M, Cols = N>,
    beta: Accum,
    lhs: impl AsMatRef<T = LhsT, Rows = M, Cols = K>,
    rhs: impl AsMatRef<T = RhsT, Rows = K, Cols = N>,
    alpha: T,
    par: Par,
) where
    T: ComplexField,
    LhsT: Conjugate<Canonical = T>,
    RhsT: Conjugate<Canonical = T>,
    M: Shape,
    N: Shape,
    K: Shape,
{
    faer_matmul(dst, beta, lhs, rhs, alpha, par);
    clear_upper();
}

/// `vzeroupper` where the CPU has AVX (nothing elsewhere): after faer's decompositions and
/// products, before scalar code.
#[inline]
pub fn clear_upper() {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx") {
        // SAFETY: the CPU has AVX, checked just above.
        unsafe { vzeroupper() }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn vzeroupper() {
    std::arch::x86_64::_mm256_zeroupper();
}
