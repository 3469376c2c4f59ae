//! The AVX2 kernel's float32 sums over a tile, with their accumulators in registers (where the
//! definitions' loops, compiled as written, keep them in memory or spill them): the scores of
//! synthesised keys, or of the centroids of keys coded after RoPE
//! ([`super::super::kernel::dots_tile`]), and the code-domain sums of the values
//! ([`super::super::kernel::acc_tile`]). The same fused multiply-adds in the same order.

use super::super::kernel::TILE;
use std::arch::x86_64::*;

/// [`super::super::kernel::dots_tile`]: up to 3 query rows by 32 keys at a time (12
/// accumulators of AVX2's 16 registers).
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn dots(qs: &[f32], d: usize, qr: usize, keys: &[f32], s: &mut [f32]) {
    assert!(qs.len() >= qr * d && keys.len() >= d * TILE && s.len() >= qr * TILE);
    let mut r0 = 0;
    while r0 < qr {
        match qr - r0 {
            1 => dots_rows::<1>(qs, d, r0, keys, s),
            2 => dots_rows::<2>(qs, d, r0, keys, s),
            _ => dots_rows::<3>(qs, d, r0, keys, s),
        }
        r0 += (qr - r0).min(3);
    }
}

/// Query rows `r0 .. r0 + R` of [`dots`] (sizes checked there).
#[inline(always)]
unsafe fn dots_rows<const R: usize>(qs: &[f32], d: usize, r0: usize, keys: &[f32], s: &mut [f32]) {
    let (qp, kp, sp) = (
        qs.as_ptr().add(r0 * d),
        keys.as_ptr(),
        s.as_mut_ptr().add(r0 * TILE),
    );
    for h in [0, 32] {
        let mut acc = [[_mm256_setzero_ps(); 4]; R];
        for dd in 0..d {
            let x: [__m256; 4] =
                std::array::from_fn(|g| _mm256_loadu_ps(kp.add(dd * TILE + h + 8 * g)));
            for (r, a) in acc.iter_mut().enumerate() {
                let q = _mm256_set1_ps(*qp.add(r * d + dd));
                for g in 0..4 {
                    a[g] = _mm256_fmadd_ps(q, x[g], a[g]);
                }
            }
        }
        for (r, a) in acc.iter().enumerate() {
            for (g, &v) in a.iter().enumerate() {
                _mm256_storeu_ps(sp.add(r * TILE + h + 8 * g), v);
            }
        }
    }
}

/// [`super::super::kernel::acc_tile`]: per query row, its 64 weights in 8 registers and each
/// component's 16 lanes in two.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn accumulate(m: usize, tile: &[f32], pg: &[f32], qr: usize, acc: &mut [f32]) {
    assert!(tile.len() >= m * TILE && pg.len() >= qr * TILE && acc.len() >= qr * m * 16);
    let (tp, ap) = (tile.as_ptr(), acc.as_mut_ptr());
    for r in 0..qr {
        let p: [__m256; 8] =
            std::array::from_fn(|i| _mm256_loadu_ps(pg.as_ptr().add(r * TILE + 8 * i)));
        for j in 0..m {
            let (v, a) = (tp.add(j * TILE), ap.add((r * m + j) * 16));
            let (mut a0, mut a1) = (_mm256_loadu_ps(a), _mm256_loadu_ps(a.add(8)));
            for k in 0..4 {
                a0 = _mm256_fmadd_ps(p[2 * k], _mm256_loadu_ps(v.add(16 * k)), a0);
                a1 = _mm256_fmadd_ps(p[2 * k + 1], _mm256_loadu_ps(v.add(16 * k + 8)), a1);
            }
            _mm256_storeu_ps(a, a0);
            _mm256_storeu_ps(a.add(8), a1);
        }
    }
}
