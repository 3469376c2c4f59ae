//! Lloyd-Max scalar quantisation (stage 5b).

use crate::error::{param, Result};
use crate::quant_tables::{HALF5, HALF6, HALF7, HALF8};

/// Positive halves of the Lloyd-Max quantisers for N(0, 1), b = 1..4, converged to 1e-10 by
/// Lloyd iteration on the exact density (`tests/test_quant.py` re-derives them with erf).
const GAUSS_HALF: [&[f64]; 4] = [
    &[0.797_884_560_8],
    &[0.452_780_034_6, 1.510_417_608_5],
    &[
        0.245_094_178_9,
        0.756_005_281_2,
        1.343_909_278_5,
        2.151_945_704_5,
    ],
    &[
        0.128_395_029_9,
        0.388_048_299_5,
        0.656_759_118_5,
        0.942_340_456_5,
        1.256_231_197_3,
        1.618_046_386_0,
        2.069_017_226_5,
        2.732_589_571_0,
    ],
];

/// Widest quantiser: indices are stored in a byte. The per-block mode uses 1..=4 bits, the
/// calibrated mode up to this.
pub const MAX_BITS: u8 = 8;

/// The exact N(0, 1) Lloyd-Max table with `2^bits` ascending centroids, `bits` in 1..=8.
pub fn gaussian_centroids(bits: u8) -> Result<Vec<f32>> {
    let half: &[f64] = match bits {
        1..=4 => GAUSS_HALF[bits as usize - 1],
        5 => &HALF5,
        6 => &HALF6,
        7 => &HALF7,
        8 => &HALF8,
        _ => return param(format!("bit width must be in 1..={MAX_BITS}, got {bits}")),
    };
    let mut c: Vec<f32> = half.iter().rev().map(|&v| -(v as f32)).collect();
    c.extend(half.iter().map(|&v| v as f32));
    Ok(c)
}

/// A scalar quantiser: ascending centroids and the midpoints between neighbours.
#[derive(Debug, Clone, PartialEq)]
pub struct Quantizer {
    centroids: Vec<f32>,
    thresholds: Vec<f32>,
}

impl Quantizer {
    /// Checks that `centroids` has `2^bits` finite, strictly ascending entries.
    pub fn new(centroids: Vec<f32>, bits: u8) -> Result<Self> {
        if !(1..=MAX_BITS).contains(&bits) {
            return param(format!("bit width must be in 1..={MAX_BITS}, got {bits}"));
        }
        let want = 1usize << bits;
        if centroids.len() != want {
            return param(format!(
                "centroid table for bit_width {bits} must have {want} entries, got {}",
                centroids.len()
            ));
        }
        if centroids.iter().any(|c| !c.is_finite()) {
            return param("centroid table holds a non-finite value");
        }
        if centroids.windows(2).any(|w| w[0] >= w[1]) {
            return param("centroid table must be strictly ascending");
        }
        // Midpoints in f32 exactly as written here: 0.5 * (a + b). Part of the format.
        let thresholds = centroids.windows(2).map(|w| 0.5 * (w[0] + w[1])).collect();
        Ok(Self {
            centroids,
            thresholds,
        })
    }

    pub fn gaussian(bits: u8) -> Result<Self> {
        Self::new(gaussian_centroids(bits)?, bits)
    }

    pub fn centroids(&self) -> &[f32] {
        &self.centroids
    }

    /// Index of the nearest centroid; a value exactly on a threshold goes to the lower index.
    #[inline]
    pub fn quantize(&self, z: f32) -> u8 {
        // The count of thresholds strictly below z (`z > t` holds on a prefix of the ascending
        // thresholds), by a binary search without branches: `bits` comparisons over the
        // `2^bits - 1` thresholds, each step half the last.
        let t = &self.thresholds;
        let mut idx = 0usize;
        let mut step = t.len().div_ceil(2);
        while step > 0 {
            // A select the compiler keeps as one (a branch here mispredicts on real rows).
            idx += std::hint::select_unpredictable(z > t[idx + step - 1], step, 0);
            step /= 2;
        }
        idx as u8
    }

    /// [`Self::quantize`] over a slice: the same count, threshold-major (so that it vectorises)
    /// for a small table over a slice of several values, else value by value.
    #[inline(always)]
    pub fn quantize_slice(&self, z: &[f32], out: &mut [u8]) {
        if self.thresholds.len() > 15 || z.len() < 8 {
            for (o, &v) in out.iter_mut().zip(z) {
                *o = self.quantize(v);
            }
            return;
        }
        out.fill(0);
        for &t in &self.thresholds {
            for (o, &v) in out.iter_mut().zip(z) {
                *o += (v > t) as u8;
            }
        }
    }

    #[inline]
    pub fn dequantize(&self, idx: u8) -> f32 {
        self.centroids[idx as usize]
    }

    /// [`Self::dequantize_slice`], 16 (AVX-512) or 8 (AVX2) indices per look-up where the CPU
    /// has them and the table holds at most 16 centroids (every per-block table): the same
    /// values.
    pub fn dequantize_fast(&self, idx: &[u8], out: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if self.centroids.len() <= 16 {
            use crate::cpu::{simd, Simd};
            match simd() {
                // SAFETY: the CPU has the extension (`cpu::simd`).
                Simd::Avx512 => return unsafe { self.dequantize_avx512(idx, out) },
                Simd::Avx2 => return unsafe { self.dequantize_avx2(idx, out) },
                Simd::Portable => {}
            }
        }
        self.dequantize_slice(idx, out)
    }

    /// The table padded to 16 entries: entry `j` holds centroid `j & mask`, so a look-up of
    /// index `i` by its low 4 bits gives `centroids[i & mask]` (a table of at most 16).
    #[cfg(target_arch = "x86_64")]
    fn table16(&self) -> [f32; 16] {
        let mask = self.centroids.len() - 1;
        std::array::from_fn(|j| self.centroids[j & mask])
    }

    /// [`Self::dequantize_slice`] by `vpermps` from two halves of [`Self::table16`], the
    /// index's bit 3 choosing between them.
    ///
    /// # Safety
    /// The CPU must support AVX2, and the table hold at most 16 centroids.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn dequantize_avx2(&self, idx: &[u8], out: &mut [f32]) {
        use std::arch::x86_64::*;
        let table = self.table16();
        // SAFETY: `table` holds 16 floats.
        let (lo, hi) = unsafe {
            (
                _mm256_loadu_ps(table.as_ptr()),
                _mm256_loadu_ps(table.as_ptr().add(8)),
            )
        };
        let (o8, i8s) = (out.chunks_exact_mut(8), idx.chunks_exact(8));
        let tail = o8.len() * 8;
        for (o, i) in o8.zip(i8s) {
            // SAFETY: 8 index bytes read, 8 floats written.
            unsafe {
                let ix = _mm256_cvtepu8_epi32(_mm_loadl_epi64(i.as_ptr().cast()));
                let upper = _mm256_castsi256_ps(_mm256_slli_epi32::<28>(ix));
                let v = _mm256_blendv_ps(
                    _mm256_permutevar8x32_ps(lo, ix),
                    _mm256_permutevar8x32_ps(hi, ix),
                    upper,
                );
                _mm256_storeu_ps(o.as_mut_ptr(), v);
            }
        }
        let n = out.len().min(idx.len());
        if tail < n {
            self.dequantize_slice(&idx[tail..n], &mut out[tail..n]);
        }
    }

    /// [`Self::dequantize_slice`] by `vpermps` from [`Self::table16`].
    ///
    /// # Safety
    /// The CPU must support AVX-512F, and the table hold at most 16 centroids.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    unsafe fn dequantize_avx512(&self, idx: &[u8], out: &mut [f32]) {
        use std::arch::x86_64::*;
        let table = self.table16();
        // SAFETY: `table` holds 16 floats.
        let t = unsafe { _mm512_loadu_ps(table.as_ptr()) };
        let (o16, i16) = (out.chunks_exact_mut(16), idx.chunks_exact(16));
        let tail = o16.len() * 16;
        for (o, i) in o16.zip(i16) {
            // SAFETY: 16 index bytes read, 16 floats written.
            unsafe {
                let ix = _mm512_cvtepu8_epi32(_mm_loadu_si128(i.as_ptr().cast()));
                _mm512_storeu_ps(o.as_mut_ptr(), _mm512_permutexvar_ps(ix, t));
            }
        }
        let n = out.len().min(idx.len());
        if tail < n {
            self.dequantize_slice(&idx[tail..n], &mut out[tail..n]);
        }
    }

    /// Centroid lookup over a slice; indices must be < 2^bits.
    #[inline(always)]
    pub fn dequantize_slice(&self, idx: &[u8], out: &mut [f32]) {
        let mask = self.centroids.len() - 1;
        for (o, &i) in out.iter_mut().zip(idx) {
            *o = self.centroids[i as usize & mask];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn gaussian_tables_are_symmetric_and_match_the_anchors() {
        let c = gaussian_centroids(2).unwrap();
        assert_eq!(c, vec![-1.5104176, -0.45278004, 0.45278004, 1.5104176]);
        for b in 1..=MAX_BITS {
            let c = gaussian_centroids(b).unwrap();
            assert!(c.windows(2).all(|w| w[0] < w[1]));
            assert_eq!(c.len(), 1 << b);
            for i in 0..c.len() {
                assert_eq!(c[i], -c[c.len() - 1 - i]);
            }
        }
        assert!(gaussian_centroids(0).is_err());
        assert!(gaussian_centroids(9).is_err());
    }

    #[test]
    fn dequantize_fast_is_dequantize_slice() {
        for bits in 1..=4u8 {
            let q = Quantizer::gaussian(bits).unwrap();
            for n in [0usize, 1, 15, 16, 17, 40, 257] {
                let idx: Vec<u8> = (0..n).map(|i| ((i * 7 + 3) % (1 << bits)) as u8).collect();
                let (mut a, mut b) = (vec![0f32; n], vec![1f32; n]);
                q.dequantize_slice(&idx, &mut a);
                q.dequantize_fast(&idx, &mut b);
                assert_eq!(a, b, "bits {bits}, n {n}");
                #[cfg(target_arch = "x86_64")]
                if crate::cpu::simd() >= crate::cpu::Simd::Avx2 {
                    let mut c = vec![1f32; n];
                    // SAFETY: the CPU has AVX2 (checked above); at most 16 centroids.
                    unsafe { q.dequantize_avx2(&idx, &mut c) };
                    assert_eq!(a, c, "AVX2: bits {bits}, n {n}");
                }
            }
        }
    }

    #[test]
    fn ties_go_to_the_lower_index() {
        let q = Quantizer::gaussian(1).unwrap();
        assert_eq!(q.quantize(0.0), 0);
        assert_eq!(q.quantize(1e-30), 1);
        let q = Quantizer::new(vec![0.0, 1.0, 2.0, 3.0], 2).unwrap();
        assert_eq!(q.quantize(0.5), 0);
        assert_eq!(q.quantize(1.5), 1);
        assert_eq!(q.quantize(2.5000002), 3);
        assert_eq!(q.quantize(f32::INFINITY), 3);
        assert_eq!(q.quantize(f32::NEG_INFINITY), 0);
    }

    #[test]
    fn bad_tables_are_rejected() {
        assert!(Quantizer::new(vec![0.0, 1.0, 2.0], 2).is_err());
        assert!(Quantizer::new(vec![0.0, 1.0, 1.0, 2.0], 2).is_err());
        assert!(Quantizer::new(vec![0.0, f32::NAN, 1.0, 2.0], 2).is_err());
        assert!(Quantizer::new(vec![1.0, 0.0], 1).is_err());
    }

    proptest! {
        #[test]
        fn quantize_picks_a_nearest_centroid(z in -10.0f32..10.0, bits in 1u8..=MAX_BITS) {
            let q = Quantizer::gaussian(bits).unwrap();
            let i = q.quantize(z);
            let d = (q.dequantize(i) - z).abs();
            for &c in q.centroids() {
                prop_assert!(d <= (c - z).abs() + 1e-6);
            }
            let mut out = [0u8; 1];
            q.quantize_slice(&[z], &mut out);
            prop_assert_eq!(out[0], i);
        }

        #[test]
        fn quantize_counts_the_thresholds_below(
            mut zs in proptest::collection::vec(-10.0f32..10.0, 1..40),
            on in 0usize..255,
            bits in 1u8..=MAX_BITS,
        ) {
            // Both paths of the slice (value by value, threshold-major from 8 values on), with
            // a value exactly on a threshold and the non-finite ones.
            let q = Quantizer::gaussian(bits).unwrap();
            let t = q.thresholds.clone();
            zs[0] = t[on % t.len()];
            zs.extend([f32::NAN, f32::INFINITY, f32::NEG_INFINITY]);
            let mut out = vec![0u8; zs.len()];
            q.quantize_slice(&zs, &mut out);
            for (&z, &o) in zs.iter().zip(&out) {
                let want = t.iter().filter(|&&th| z > th).count() as u8;
                prop_assert_eq!(q.quantize(z), want);
                prop_assert_eq!(o, want);
            }
        }
    }
}
