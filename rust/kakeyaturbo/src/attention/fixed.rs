//! The 16-bit fixed-point synthesis of keys coded before RoPE ([`super::Synthesis::I16`]):
//! centroids in steps of `2^-8`, each channel's column of `M` in integer multiples of its own
//! step, products summed exactly in 32-bit integers. Integer sums do not depend on their order,
//! and two 16-bit products per 32-bit lane is one `vpmaddwd` (AVX2: 16 multiply-adds per
//! instruction where a float32 `fma` does 8, and no bfloat16 halves to widen first).
//!
//! The bound that keeps every sum exact: a channel's weights are scaled so that the sum of
//! their magnitudes is at most `65535` (each at most `32767`), and every centroid is at most
//! `32767` in magnitude, so any partial sum stays below `65535 * 32767 < 2^31`.

use super::kernel::TILE;

/// Fixed-point units per unit of a centroid (`2^8`).
pub(crate) const ONE: f32 = 256.0;

/// The largest fixed-point magnitude of a centroid or a weight.
pub(crate) const LIMIT: f32 = 32767.0;

/// `x` in fixed point: `x * 256` clamped to `[-32767, 32767]` (a NaN to `-32767`), rounded to
/// the nearest integer, ties to even (an outlier past `±128` saturates).
#[inline(always)]
pub(crate) fn fixed16(x: f32) -> i32 {
    let v = x * ONE;
    // The order of `max(v, lo)` then `min(v, hi)` as x86 computes them (a NaN takes `lo`).
    let v = if v > -LIMIT { v } else { -LIMIT };
    let v = if v < LIMIT { v } else { LIMIT };
    v.round_ties_even() as i32
}

/// `a` (low half) and `b` (high half) as 16-bit two's complement in one word.
#[inline(always)]
pub(crate) fn pair(a: i32, b: i32) -> u32 {
    (a as u32 & 0xffff) | (b as u32) << 16
}

/// The low (`hi = false`) or high 16-bit half of a word, sign-extended.
#[inline(always)]
pub(crate) fn half(w: u32, hi: bool) -> i32 {
    if hi {
        (w as i32) >> 16
    } else {
        ((w << 16) as i32) >> 16
    }
}

/// `M` (`m x D`, row `j` = component `j`'s contribution per unit of its centroid) in fixed
/// point: per channel `d` a step `s_d` and words `[p * D + d]` holding `round(M_(2p)d / s_d)`
/// in the low half and `round(M_(2p+1)d / s_d)` in the high one (0 past `m`). The step is the
/// smallest with every weight at most `32767` and the sum of their magnitudes at most `65535`.
/// `unit[d] = s_d / 256` is what one unit of channel `d`'s sum is worth.
#[derive(Debug, Clone)]
pub struct FixedSynthesis {
    pub words: Vec<u32>,
    pub unit: Vec<f32>,
}

impl FixedSynthesis {
    pub(crate) fn new(msyn: &[f32], m: usize, d: usize) -> Self {
        assert_eq!(msyn.len(), m * d);
        // Rounding adds at most 1/2 per weight: `m / 2` of slack keeps the sum within 65535.
        let budget = (65535 - m.min(65535)).max(1) as f64;
        let step: Vec<f32> = (0..d)
            .map(|i| {
                let col = (0..m).map(|j| (msyn[j * d + i] as f64).abs());
                let (l1, mx) = col.fold((0f64, 0f64), |(s, x), v| (s + v, x.max(v)));
                let s = (l1 / budget).max(mx / LIMIT as f64) as f32;
                if s > 0.0 && s.is_finite() {
                    s
                } else {
                    1.0
                }
            })
            .collect();
        let w = |j: usize, i: usize| -> i32 {
            if j >= m {
                return 0;
            }
            let v = (msyn[j * d + i] as f64 / step[i] as f64).round();
            v.clamp(-(LIMIT as f64), LIMIT as f64) as i32
        };
        let words = (0..m.div_ceil(2))
            .flat_map(|p| (0..d).map(move |i| (p, i)))
            .map(|(p, i)| pair(w(2 * p, i), w(2 * p + 1, i)))
            .collect();
        let unit = step.iter().map(|s| s / ONE).collect();
        FixedSynthesis { words, unit }
    }

    /// What the synthesis multiplies, as float32: `M_jd` as `weight * s_d` (for mirrors of the
    /// kernel, which multiply it by the centroids in fixed point over 256).
    pub fn values(&self, m: usize, d: usize) -> Vec<f32> {
        let mut out = vec![0f32; m * d];
        for (j, row) in out.chunks_exact_mut(d).enumerate() {
            for (i, o) in row.iter_mut().enumerate() {
                *o = half(self.words[(j / 2) * d + i], j % 2 == 1) as f32 * (self.unit[i] * ONE);
            }
        }
        out
    }
}

/// The centroid tables in 16-bit fixed point ([`fixed16`]): `values` entry by
/// entry (a component's table at the same `table` offset as in `lut`), and per 16 entries of
/// `values` (every table starts at a multiple of 16 and holds at least 16) their low bytes,
/// then their high bytes, for byte shuffles: the AVX2 look-up reads `bytes[table / 16]` for
/// the tables of up to 4 bits (16 entries); wider tables' runs are derived with them but not
/// read.
#[derive(Debug, Clone)]
pub(crate) struct FixedLut {
    pub values: Vec<i32>,
    pub bytes: Vec<[u8; 32]>,
}

impl FixedLut {
    /// The tables of a calibration's float32 centroid tables `lut` (laid out as
    /// `StreamTables::lut`).
    pub(crate) fn new(lut: &[f32]) -> Self {
        let values: Vec<i32> = lut.iter().map(|&c| fixed16(c)).collect();
        let bytes = values
            .chunks(16)
            .map(|chunk| {
                let mut b = [0u8; 32];
                for (e, &v) in chunk.iter().enumerate() {
                    (b[e], b[16 + e]) = (v as u16 as u8, (v as u16 >> 8) as u8);
                }
                b
            })
            .collect();
        FixedLut { values, bytes }
    }
}

/// The definition of [`super::kernel::Tile::centroids_i16`]'s packing, from the tile's
/// float32 centroids (`tile[j * 64 + t]`): pairs of components, `[p * 64 + t]`.
#[inline(always)]
pub(crate) fn pack_tile(m: usize, tile: &[f32], packed: &mut [u32]) {
    for p in 0..m.div_ceil(2) {
        for t in 0..TILE {
            let a = fixed16(tile[2 * p * TILE + t]);
            let b = if 2 * p + 1 < m {
                fixed16(tile[(2 * p + 1) * TILE + t])
            } else {
                0
            };
            packed[p * TILE + t] = pair(a, b);
        }
    }
}

/// The definition of [`super::kernel::Tile::synthesize_i16_rotated`] before the rotation:
/// `keys[d * 64 + t] = fma(g_t, (sum over the pairs of both products, exact) as f32 *
/// unit[d], mean_d)`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn synthesize_tile(
    d: usize,
    pairs: usize,
    packed: &[u32],
    words: &[u32],
    unit: &[f32],
    g: &[f32; TILE],
    mean: &[f32],
    keys: &mut [f32],
) {
    for dd in 0..d {
        let mut acc = [0i32; TILE];
        for p in 0..pairs {
            let w = words[p * d + dd];
            let (wl, wh) = (half(w, false), half(w, true));
            for (a, &c) in acc.iter_mut().zip(&packed[p * TILE..(p + 1) * TILE]) {
                // Exact: the bound in the module's documentation.
                *a = a.wrapping_add(wl * half(c, false) + wh * half(c, true));
            }
        }
        let out = &mut keys[dd * TILE..(dd + 1) * TILE];
        for ((o, &a), &gt) in out.iter_mut().zip(&acc).zip(g) {
            *o = gt.mul_add(a as f32 * unit[dd], mean[dd]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixed16_rounds_clamps_and_takes_nan_low() {
        assert_eq!(fixed16(1.0), 256);
        assert_eq!(fixed16(-0.5 / 256.0), 0); // a tie, to even
        assert_eq!(fixed16(1.5 / 256.0), 2);
        assert_eq!(fixed16(1e9), 32767);
        assert_eq!(fixed16(-1e9), -32767);
        assert_eq!(fixed16(f32::NAN), -32767);
        assert_eq!(half(pair(-3, 7), false), -3);
        assert_eq!(half(pair(-3, 7), true), 7);
        assert_eq!(half(pair(32767, -32767), true), -32767);
    }

    #[test]
    fn weights_keep_every_sum_exact_and_close_to_m() {
        let mut g = crate::rng::SplitMix64::new(7);
        for (m, d) in [(1, 1), (5, 3), (64, 64), (200, 16)] {
            let msyn: Vec<f32> = (0..m * d)
                .map(|i| {
                    let u = (g.next_u64() >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                    if i % 7 == 0 {
                        0.0
                    } else {
                        u * 2f32.powi((i % 9) as i32 - 4)
                    }
                })
                .collect();
            let f = FixedSynthesis::new(&msyn, m, d);
            let v = f.values(m, d);
            for i in 0..d {
                let l1: i64 = (0..m)
                    .map(|j| half(f.words[(j / 2) * d + i], j % 2 == 1).abs() as i64)
                    .sum();
                assert!(l1 <= 65535, "m {m} channel {i}: {l1}");
                for j in 0..m {
                    let (x, y) = (msyn[j * d + i], v[j * d + i]);
                    assert!(
                        (x - y).abs() <= 0.5 * f.unit[i] * ONE * (1.0 + 1e-6),
                        "{x} {y}"
                    );
                }
            }
        }
        // All zeros: a unit step, zero weights.
        let f = FixedSynthesis::new(&[0.0; 6], 3, 2);
        assert_eq!(f.unit, vec![1.0 / ONE, 1.0 / ONE]);
        assert!(f.words.iter().all(|&w| w == 0));
    }

    #[test]
    fn extreme_sums_stay_exact() {
        // Every weight and centroid at the bound's edge: the sum is the exact integer.
        let (m, d) = (64, 2);
        let msyn: Vec<f32> = (0..m * d)
            .map(|i| if i % 2 == 0 { 1.0 } else { -1.0 })
            .collect();
        let f = FixedSynthesis::new(&msyn, m, d);
        let tile = vec![1e6f32; m * TILE];
        let mut packed = vec![0u32; m.div_ceil(2) * TILE];
        pack_tile(m, &tile, &mut packed);
        let mut keys = vec![0f32; d * TILE];
        let g = [1f32; TILE];
        synthesize_tile(
            d,
            m / 2,
            &packed,
            &f.words,
            &f.unit,
            &g,
            &[0.0, 0.0],
            &mut keys,
        );
        let w0 = half(f.words[0], false) as i64;
        let want = (w0 * 64 * 32767) as f32 * f.unit[0];
        assert_eq!(keys[0], want);
        assert_eq!(keys[TILE], -want);
    }
}
