//! The AVX2 kernel's synthesis of a tile of keys coded before RoPE from its packed centroids:
//! bfloat16 pairs as two float32 `fma`s each, 16-bit fixed-point pairs as exact 32-bit sums
//! (`vpdpwssd` with AVX-VNNI, `vpmaddwd` + `vpaddd` without it), the scale, the mean and the
//! rotation in registers.

use super::super::fixed::FixedSynthesis;
use super::super::kernel::{Rot, TILE};
use std::arch::x86_64::*;

#[cfg(doc)]
use super::super::kernel::Tile;
#[cfg(doc)]
use super::super::tables::StreamTables;

/// Whether this CPU has AVX-VNNI (`vpdpwssd` on 256-bit registers; Intel since Alder Lake).
pub(super) fn has_avx_vnni() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| is_x86_feature_detected!("avxvnni"))
}

/// What a synthesis multiplies the packed centroids by: bfloat16 pairs
/// ([`StreamTables::key_synthesis_bf16`]) or 16-bit fixed-point ones
/// ([`StreamTables::key_synthesis_i16`]).
#[derive(Clone, Copy)]
pub(super) enum Weights<'a> {
    Bf16(&'a [u32]),
    I16(&'a FixedSynthesis),
}

/// `x` of channels `dims`, rows `r0 .. r0 + 8 G` in lanes, before the scale and the mean.
#[inline(always)]
unsafe fn sums<const N: usize, const G: usize, const VNNI: bool>(
    d: usize,
    dims: [usize; N],
    r0: usize,
    pairs: usize,
    packed: &[u32],
    w: Weights<'_>,
) -> [[__m256; G]; N] {
    match w {
        Weights::Bf16(mb) => sums_bf16(d, dims, r0, pairs, packed, mb),
        Weights::I16(f) => {
            let acc = sums_i16::<N, G, VNNI>(d, dims, r0, pairs, packed, &f.words);
            // Plain loops: the intrinsics inline here, not through closures.
            let mut x = [[_mm256_setzero_ps(); G]; N];
            for k in 0..N {
                let s = _mm256_set1_ps(f.unit[dims[k]]);
                for g in 0..G {
                    x[k][g] = _mm256_mul_ps(_mm256_cvtepi32_ps(acc[k][g]), s);
                }
            }
            x
        }
    }
}

/// The `fma` chains of the bfloat16 synthesis for channels `dims`, rows `r0 .. r0 + 8 G` in
/// lanes: per pair the high member's `fma`, then the low one's (the definition's order).
#[inline(always)]
unsafe fn sums_bf16<const N: usize, const G: usize>(
    d: usize,
    dims: [usize; N],
    r0: usize,
    pairs: usize,
    packed: &[u32],
    mb: &[u32],
) -> [[__m256; G]; N] {
    let mut acc = [[_mm256_setzero_ps(); G]; N];
    let (tp, mp) = (packed.as_ptr().add(r0), mb.as_ptr());
    let high = _mm256_set1_epi32(0xffff_0000u32 as i32);
    // A packed pair as float32: the high member in place, the low one moved up.
    let hi = |v: __m256i| _mm256_castsi256_ps(_mm256_and_si256(v, high));
    let lo = |v: __m256i| _mm256_castsi256_ps(_mm256_slli_epi32::<16>(v));
    for p in 0..pairs {
        let w: [u32; N] = std::array::from_fn(|k| *mp.add(p * d + dims[k]));
        let wh: [__m256; N] =
            std::array::from_fn(|k| _mm256_set1_ps(f32::from_bits(w[k] & 0xffff_0000)));
        let wl: [__m256; N] = std::array::from_fn(|k| _mm256_set1_ps(f32::from_bits(w[k] << 16)));
        for g in 0..G {
            let c = _mm256_loadu_si256(tp.add(p * TILE + 8 * g) as *const __m256i);
            let (ch, cl) = (hi(c), lo(c));
            for (a, (&h, &l)) in acc.iter_mut().zip(wh.iter().zip(&wl)) {
                a[g] = _mm256_fmadd_ps(h, ch, a[g]);
                a[g] = _mm256_fmadd_ps(l, cl, a[g]);
            }
        }
    }
    acc
}

/// The exact 32-bit sums of the fixed-point synthesis
/// ([`super::super::fixed::synthesize_tile`]) for channels `dims`, rows `r0 .. r0 + 8 G` in
/// lanes: per pair of components and 8 rows one `vpdpwssd` (`VNNI`: both members' products
/// and the sum), or `vpmaddwd` then `vpaddd`.
#[inline(always)]
unsafe fn sums_i16<const N: usize, const G: usize, const VNNI: bool>(
    d: usize,
    dims: [usize; N],
    r0: usize,
    pairs: usize,
    packed: &[u32],
    words: &[u32],
) -> [[__m256i; G]; N] {
    let mut acc = [[_mm256_setzero_si256(); G]; N];
    let (tp, wp) = (packed.as_ptr().add(r0), words.as_ptr());
    for p in 0..pairs {
        let mut w = [_mm256_setzero_si256(); N];
        for k in 0..N {
            w[k] = _mm256_set1_epi32(*wp.add(p * d + dims[k]) as i32);
        }
        for g in 0..G {
            let c = _mm256_loadu_si256(tp.add(p * TILE + 8 * g) as *const __m256i);
            for (a, &wk) in acc.iter_mut().zip(&w) {
                a[g] = if VNNI {
                    _mm256_dpwssd_avx_epi32(a[g], c, wk)
                } else {
                    _mm256_add_epi32(a[g], _mm256_madd_epi16(c, wk))
                };
            }
        }
    }
    acc
}

/// [`Tile::synthesize_bf16_rotated`] or [`Tile::synthesize_i16_rotated`] after their checks
/// ([`rotated_with`]).
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn rotated(
    d: usize,
    pairs: usize,
    packed: &[u32],
    w: Weights<'_>,
    g: &[f32; TILE],
    mean: &[f32],
    rot: &Rot<'_>,
    keys: &mut [f32],
) {
    rotated_with::<false>(d, pairs, packed, w, g, mean, rot, keys)
}

/// [`rotated`] with the fixed-point sums as `vpdpwssd` (AVX-VNNI).
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,avxvnni")]
pub(super) unsafe fn rotated_vnni(
    d: usize,
    pairs: usize,
    packed: &[u32],
    w: Weights<'_>,
    g: &[f32; TILE],
    mean: &[f32],
    rot: &Rot<'_>,
    keys: &mut [f32],
) {
    rotated_with::<true>(d, pairs, packed, w, g, mean, rot, keys)
}

/// The rotated frequencies in registers ([`rotate_store`]), then the channels past them
/// ([`from_with`]).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn rotated_with<const VNNI: bool>(
    d: usize,
    pairs: usize,
    packed: &[u32],
    w: Weights<'_>,
    g: &[f32; TILE],
    mean: &[f32],
    rot: &Rot<'_>,
    keys: &mut [f32],
) {
    let h = rot.half;
    assert!(packed.len() >= pairs * TILE && keys.len() >= d * TILE);
    assert!(mean.len() >= d && 2 * h <= d);
    if h > 0 {
        assert!(rot.cos.len() >= rot.at(h - 1) + TILE && rot.sin.len() >= rot.at(h - 1) + TILE);
    }
    // Fixed point: two frequencies (four channels) by 16 rows per pass (12 registers; 0.99x
    // the time of one frequency by 32 rows, `benches/ab_builds.py`), then a last odd one by 32.
    // The bfloat16 sums need two weights per channel and stay at one frequency by 32 rows.
    let mut i = 0;
    while i + 2 <= h && matches!(w, Weights::I16(_)) {
        let ([a0, b0], [a1, b1]) = (pair(rot, i), pair(rot, i + 1));
        for r0 in (0..TILE).step_by(16) {
            let x = sums::<4, 2, VNNI>(d, [a0, b0, a1, b1], r0, pairs, packed, w);
            rotate_store(i, r0, [&x[0], &x[1]], [a0, b0], g, mean, rot, keys);
            rotate_store(i + 1, r0, [&x[2], &x[3]], [a1, b1], g, mean, rot, keys);
        }
        i += 2;
    }
    for i in i..h {
        let [a, b] = pair(rot, i);
        for r0 in [0, 32] {
            let x = sums::<2, 4, VNNI>(d, [a, b], r0, pairs, packed, w);
            rotate_store(i, r0, [&x[0], &x[1]], [a, b], g, mean, rot, keys);
        }
    }
    from_with::<VNNI>(d, 2 * h, pairs, packed, w, g, mean, keys);
}

/// Channels `d0 .. d` of [`Tile::synthesize_bf16`] ([`from_with`]).
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn synthesize_from(
    d: usize,
    d0: usize,
    pairs: usize,
    packed: &[u32],
    w: Weights<'_>,
    g: &[f32; TILE],
    mean: &[f32],
    keys: &mut [f32],
) {
    from_with::<false>(d, d0, pairs, packed, w, g, mean, keys)
}

/// Channels `d0 .. d` of a synthesis (bfloat16 or fixed point, by `w`): two at a time, then
/// one, each in two passes of 32 rows; `keys[dd * 64 + t] = fma(g_t, x, mean_dd)`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn from_with<const VNNI: bool>(
    d: usize,
    d0: usize,
    pairs: usize,
    packed: &[u32],
    w: Weights<'_>,
    g: &[f32; TILE],
    mean: &[f32],
    keys: &mut [f32],
) {
    let mut dd = d0;
    while dd + 2 <= d {
        for r0 in [0, 32] {
            let acc = sums::<2, 4, VNNI>(d, [dd, dd + 1], r0, pairs, packed, w);
            store(dd, r0, &acc[0], g, mean, keys);
            store(dd + 1, r0, &acc[1], g, mean, keys);
        }
        dd += 2;
    }
    if dd < d {
        for r0 in [0, 32] {
            let acc = sums::<1, 4, VNNI>(d, [dd], r0, pairs, packed, w);
            store(dd, r0, &acc[0], g, mean, keys);
        }
    }
}

/// Channel `dd`, rows `r0 .. r0 + 32`: `fma(g_t, x, mean_dd)` (a function, not a closure,
/// so that its intrinsics inline into the callers compiled for AVX2).
#[inline(always)]
unsafe fn store(
    dd: usize,
    r0: usize,
    acc: &[__m256; 4],
    g: &[f32; TILE],
    mean: &[f32],
    keys: &mut [f32],
) {
    let (gp, kp) = (g.as_ptr(), keys.as_mut_ptr());
    let mu = _mm256_set1_ps(mean[dd]);
    for (k, &x) in acc.iter().enumerate() {
        let gv = _mm256_loadu_ps(gp.add(r0 + 8 * k));
        _mm256_storeu_ps(kp.add(dd * TILE + r0 + 8 * k), _mm256_fmadd_ps(gv, x, mu));
    }
}

/// The channels of frequency `i`.
#[inline(always)]
fn pair(rot: &Rot<'_>, i: usize) -> [usize; 2] {
    let (a, b) = rot.pair(i);
    [a, b]
}

/// Frequency `i` of [`Tile::synthesize_bf16_rotated`] (or [`Tile::synthesize_i16_rotated`]),
/// rows `r0 .. r0 + 8 G`: its two channels' sums `x` (channels `a`, `b`) scaled, shifted and
/// rotated in registers (the operations of [`super::super::kernel::rotate_tile`], in its order),
/// then stored.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn rotate_store<const G: usize>(
    i: usize,
    r0: usize,
    [xa, xb]: [&[__m256; G]; 2],
    [a, b]: [usize; 2],
    g: &[f32; TILE],
    mean: &[f32],
    rot: &Rot<'_>,
    keys: &mut [f32],
) {
    let (mua, mub) = (_mm256_set1_ps(mean[a]), _mm256_set1_ps(mean[b]));
    let (cp, sp) = (
        rot.cos.as_ptr().add(rot.at(i) + r0),
        rot.sin.as_ptr().add(rot.at(i) + r0),
    );
    let (gp, kp) = (g.as_ptr().add(r0), keys.as_mut_ptr());
    for k in 0..G {
        let gv = _mm256_loadu_ps(gp.add(8 * k));
        let u = _mm256_fmadd_ps(gv, xa[k], mua);
        let v = _mm256_fmadd_ps(gv, xb[k], mub);
        let (c, sn) = (
            _mm256_loadu_ps(cp.add(8 * k)),
            _mm256_loadu_ps(sp.add(8 * k)),
        );
        let ya = _mm256_sub_ps(_mm256_mul_ps(u, c), _mm256_mul_ps(v, sn));
        let yb = _mm256_add_ps(_mm256_mul_ps(v, c), _mm256_mul_ps(u, sn));
        _mm256_storeu_ps(kp.add(a * TILE + r0 + 8 * k), ya);
        _mm256_storeu_ps(kp.add(b * TILE + r0 + 8 * k), yb);
    }
}
