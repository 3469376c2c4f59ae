//! Fast Walsh-Hadamard butterfly and the seeded rotation of stage 4.
//!
//! The residual of a block has `d_eff` coordinates. Instead of zero-padding it to the next
//! power of two (which would code up to twice as many numbers as there are), the coordinates
//! are split into *bands* whose widths are the binary digits of `d_eff`, largest first
//! (96 = 64 + 32, 100 = 64 + 32 + 4), and each band is rotated by its own Sylvester Hadamard
//! matrix. When `d_eff` is a power of two this is the single W-point transform.

use std::ops::{Add, Sub};

/// In-place unnormalised Sylvester-Hadamard transform, iterative radix-2 butterfly:
/// for h = 1, 2, 4, ...: (a, b) -> (a + b, a - b) on pairs (j, j + h).
/// The order of additions is part of the format (GPU kernels mirror it). Generic so that the
/// decoders' f64 fallback (values beyond the float32 range) runs the same butterfly.
#[inline(always)]
pub fn fwht<T: Copy + Add<Output = T> + Sub<Output = T>>(x: &mut [T]) {
    debug_assert!(x.len().is_power_of_two() || x.is_empty());
    butterflies_from(x, 1);
}

/// The butterflies of [`fwht`] with `h` from `h0` on (those below already done).
#[inline(always)]
fn butterflies_from<T: Copy + Add<Output = T> + Sub<Output = T>>(x: &mut [T], h0: usize) {
    let n = x.len();
    let mut h = h0;
    while h < n {
        for chunk in x.chunks_exact_mut(2 * h) {
            let (lo, hi) = chunk.split_at_mut(h);
            for (a, b) in lo.iter_mut().zip(hi.iter_mut()) {
                let (u, v) = (*a, *b);
                *a = u + v;
                *b = u - v;
            }
        }
        h *= 2;
    }
}

/// [`fwht`] of every row of a column-major block at once: `x` holds `width` columns of `rows`
/// values each (column `j` at `x[j * rows..(j + 1) * rows]`), and each row's `width` values are
/// transformed with the additions of [`fwht`] in its order, so each row's result is
/// [`fwht`]'s of that row bit for bit; the loops run down the columns, where they vectorise.
#[inline(always)]
pub fn fwht_columns(x: &mut [f32], rows: usize) {
    let n = x.len().checked_div(rows).unwrap_or(0);
    debug_assert!(n * rows == x.len() && (n.is_power_of_two() || n == 0));
    let mut h = 1;
    while h < n {
        for block in x.chunks_exact_mut(2 * h * rows) {
            let (lo, hi) = block.split_at_mut(h * rows);
            for (a, b) in lo.iter_mut().zip(hi.iter_mut()) {
                let (u, v) = (*a, *b);
                *a = u + v;
                *b = u - v;
            }
        }
        h *= 2;
    }
}

/// [`fwht`] of at least 16 values (a power of two) with AVX-512: the butterflies of
/// `h = 1, 2, 4, 8` inside each register of 16 lanes (a lane's partner, `lane ^ h`, brought in by
/// a permute: `a + b` where `h`'s bit of the lane is clear, `a - b` where it is set), then those
/// of `h >= 16` between registers. Every value gets [`fwht`]'s additions in its order, so the
/// result is [`fwht`]'s bit for bit; shorter slices are [`fwht`]'s.
///
/// # Safety
/// The CPU must support AVX-512F ([`crate::cpu::simd`]).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
pub unsafe fn fwht_avx512(x: &mut [f32]) {
    use std::arch::x86_64::*;
    if x.len() < 16 {
        return fwht(x);
    }
    let partner = |h: i32| {
        _mm512_set_epi32(
            15 ^ h,
            14 ^ h,
            13 ^ h,
            12 ^ h,
            11 ^ h,
            10 ^ h,
            9 ^ h,
            8 ^ h,
            7 ^ h,
            6 ^ h,
            5 ^ h,
            4 ^ h,
            3 ^ h,
            2 ^ h,
            1 ^ h,
            h,
        )
    };
    let stages = [
        (partner(1), 0xAAAAu16),
        (partner(2), 0xCCCC),
        (partner(4), 0xF0F0),
        (partner(8), 0xFF00),
    ];
    for chunk in x.chunks_exact_mut(16) {
        // SAFETY: `chunk` holds 16 floats; unaligned loads and stores.
        let mut v = unsafe { _mm512_loadu_ps(chunk.as_ptr()) };
        for &(ix, upper) in &stages {
            let p = _mm512_permutexvar_ps(ix, v);
            v = _mm512_mask_blend_ps(upper, _mm512_add_ps(v, p), _mm512_sub_ps(p, v));
        }
        unsafe { _mm512_storeu_ps(chunk.as_mut_ptr(), v) };
    }
    butterflies_from(x, 16);
}

/// [`fwht`] with AVX2: as [`fwht_avx512`] with registers of 8 lanes (`h = 1, 2, 4` inside
/// them); the result is [`fwht`]'s bit for bit, and shorter slices are [`fwht`]'s.
///
/// # Safety
/// The CPU must support AVX2 ([`crate::cpu::simd`]).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
pub unsafe fn fwht_avx2(x: &mut [f32]) {
    use std::arch::x86_64::*;
    if x.len() < 8 {
        return fwht(x);
    }
    let partner = |h: i32| _mm256_set_epi32(7 ^ h, 6 ^ h, 5 ^ h, 4 ^ h, 3 ^ h, 2 ^ h, 1 ^ h, h);
    let (p1, p2, p4) = (partner(1), partner(2), partner(4));
    for chunk in x.chunks_exact_mut(8) {
        // SAFETY: `chunk` holds 8 floats; unaligned loads and stores.
        let mut v = unsafe { _mm256_loadu_ps(chunk.as_ptr()) };
        let p = _mm256_permutevar8x32_ps(v, p1);
        v = _mm256_blend_ps::<0xAA>(_mm256_add_ps(v, p), _mm256_sub_ps(p, v));
        let p = _mm256_permutevar8x32_ps(v, p2);
        v = _mm256_blend_ps::<0xCC>(_mm256_add_ps(v, p), _mm256_sub_ps(p, v));
        let p = _mm256_permutevar8x32_ps(v, p4);
        v = _mm256_blend_ps::<0xF0>(_mm256_add_ps(v, p), _mm256_sub_ps(p, v));
        unsafe { _mm256_storeu_ps(chunk.as_mut_ptr(), v) };
    }
    butterflies_from(x, 8);
}

/// [`fwht`] of float32 values, through [`fwht_avx512`] or [`fwht_avx2`] where the CPU has
/// them: the same values either way.
#[inline(always)]
pub fn fwht_f32(x: &mut [f32]) {
    match crate::cpu::simd() {
        // SAFETY: the CPU has the extension (`cpu::simd`).
        #[cfg(target_arch = "x86_64")]
        crate::cpu::Simd::Avx512 => unsafe { fwht_avx512(x) },
        #[cfg(target_arch = "x86_64")]
        crate::cpu::Simd::Avx2 => unsafe { fwht_avx2(x) },
        _ => fwht(x),
    }
}

/// `y = H (s * x)` in place; `signs.len() == x.len()`, a power of two.
#[inline(always)]
pub fn rotate(x: &mut [f32], signs: &[f32]) {
    for (v, s) in x.iter_mut().zip(signs) {
        *v *= s;
    }
    fwht_f32(x);
}

/// `x = s * (H y) / W` in place: the exact inverse of [`rotate`] up to rounding.
#[inline(always)]
pub fn inverse_rotate(y: &mut [f32], signs: &[f32]) {
    fwht_f32(y);
    let inv = 1.0 / y.len() as f32;
    for (v, s) in y.iter_mut().zip(signs) {
        *v = *v * s * inv;
    }
}

/// Band widths for `d` coordinates: the powers of two in the binary expansion of `d`,
/// largest first. `bands(0)` is empty.
pub fn bands(d: usize) -> Vec<usize> {
    (0..usize::BITS)
        .rev()
        .map(|b| 1usize << b)
        .filter(|w| d & w != 0)
        .collect()
}

/// The next power of two >= d (the predecessor's padded length W), reported for reference.
pub fn padded_len(d: usize) -> usize {
    d.max(1).next_power_of_two()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::sign_pattern;
    use proptest::prelude::*;

    fn naive_hadamard(x: &[f32]) -> Vec<f32> {
        let n = x.len();
        (0..n)
            .map(|i| {
                (0..n)
                    .map(|j| {
                        let sign = if (i & j).count_ones() % 2 == 0 {
                            1.0
                        } else {
                            -1.0
                        };
                        sign * x[j]
                    })
                    .sum()
            })
            .collect()
    }

    #[test]
    fn fwht_matches_the_matrix_definition() {
        for log in 0..8 {
            let n = 1 << log;
            let x: Vec<f32> = (0..n).map(|i| ((i * 7 + 3) % 11) as f32 - 5.0).collect();
            let mut y = x.clone();
            fwht(&mut y);
            assert_eq!(y, naive_hadamard(&x), "n = {n}");
        }
    }

    #[test]
    fn the_vector_butterflies_are_fwht_bit_for_bit() {
        use crate::cpu::{simd, Simd};
        let mut g = crate::rng::SplitMix64::new(11);
        for log in 0..11 {
            let n = 1usize << log;
            // Values of many magnitudes, so that every addition rounds.
            let x: Vec<f32> = (0..n)
                .map(|_| {
                    let u = g.next_u64();
                    (u >> 40) as f32 / 16777216.0 * 2f32.powi((u % 24) as i32 - 12) - 0.3
                })
                .collect();
            let mut want = x.clone();
            fwht(&mut want);
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            let mut got = x.clone();
            fwht_f32(&mut got);
            assert_eq!(bits(&want), bits(&got), "n = {n}");
            #[cfg(target_arch = "x86_64")]
            for (level, f) in [
                (Simd::Avx2, fwht_avx2 as unsafe fn(&mut [f32])),
                (Simd::Avx512, fwht_avx512),
            ] {
                if simd() >= level {
                    let mut got = x.clone();
                    // SAFETY: the CPU has the extension (checked above).
                    unsafe { f(&mut got) };
                    assert_eq!(bits(&want), bits(&got), "{level:?}, n = {n}");
                }
            }
        }
    }

    #[test]
    fn fwht_columns_is_fwht_of_each_row() {
        for log in 0..7 {
            let (n, rows) = (1usize << log, 5);
            let x: Vec<f32> = (0..n * rows)
                .map(|i| ((i * 13 + 1) % 17) as f32 * 0.37 - 2.9)
                .collect();
            // Column-major: row r's values are x[j * rows + r].
            let mut cols = x.clone();
            fwht_columns(&mut cols, rows);
            for r in 0..rows {
                let mut row: Vec<f32> = (0..n).map(|j| x[j * rows + r]).collect();
                fwht(&mut row);
                let got: Vec<u32> = (0..n).map(|j| cols[j * rows + r].to_bits()).collect();
                assert_eq!(
                    got,
                    row.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    "n = {n}"
                );
            }
        }
        fwht_columns(&mut [], 0);
    }

    #[test]
    fn band_decomposition() {
        assert_eq!(bands(96), vec![64, 32]);
        assert_eq!(bands(100), vec![64, 32, 4]);
        assert_eq!(bands(128), vec![128]);
        assert_eq!(bands(1), vec![1]);
        assert!(bands(0).is_empty());
        assert_eq!(padded_len(65), 128);
    }

    proptest! {
        #[test]
        fn rotation_round_trips(log in 0u32..10, seed in any::<u64>(), vals in proptest::collection::vec(-100.0f32..100.0, 512)) {
            let n = 1usize << log;
            let x = &vals[..n.min(vals.len())];
            let s = sign_pattern(seed, x.len());
            let mut y = x.to_vec();
            rotate(&mut y, &s);
            // Parseval for the unnormalised transform: |Hv|^2 = n |v|^2.
            let e_x: f64 = x.iter().map(|&v| (v as f64).powi(2)).sum();
            let e_y: f64 = y.iter().map(|&v| (v as f64).powi(2)).sum();
            prop_assert!((e_y - x.len() as f64 * e_x).abs() <= 1e-4 * (1.0 + e_y));
            inverse_rotate(&mut y, &s);
            for (a, b) in x.iter().zip(&y) {
                prop_assert!((a - b).abs() <= 1e-4 * (1.0 + a.abs()));
            }
        }

        #[test]
        fn bands_sum_to_d(d in 0usize..5000) {
            let b = bands(d);
            prop_assert_eq!(b.iter().sum::<usize>(), d);
            prop_assert!(b.windows(2).all(|w| w[0] > w[1]));
        }
    }
}
