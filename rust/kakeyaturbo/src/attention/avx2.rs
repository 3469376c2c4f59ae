//! The tile operations for x86_64 CPUs with AVX2, FMA, F16C and BMI2 but without the AVX-512
//! of [`super::avx512`] (AMD Zen 2 and 3, Intel client cores): the bits of
//! [`super::kernel::Portable`].
//!
//! - The look-up (`avx2_lookup.rs`): a component at a time over the tile, its indices of 8
//!   rows from the rows' words (rows of up to 32 bytes loaded whole and transposed, longer
//!   ones gathered), centroids by permutes of tables held in registers (gathered past 5
//!   bits); for keys coded before RoPE rounded to bfloat16, or 16 rows at a time in 16-bit
//!   fixed point (byte shuffles of the table's low and high bytes up to 4 bits), packed in
//!   pairs. A tile whose last row a read would take past the block's bytes is read from a
//!   zero-padded copy of its rows.
//! - The synthesis of keys coded before RoPE: the channels of whole frequencies per pass (8
//!   accumulators of 8 lanes), so that the scale, the mean and the rotation run in registers;
//!   fixed point as one `vpmaddwd` per word (exact 32-bit sums), two frequencies by 16 rows;
//!   bfloat16 as two float32 `fma`s per packed word (widened once for both channels), one
//!   frequency by 32 rows.
//! - The float32 sums of a tile (`avx2_sums.rs`): the scores of synthesised keys or of the
//!   centroids, and the values' code-domain sums, their accumulators held in registers.
//! - The rows' scales converted by F16C; the 16-lane sums as a tree in registers.

use super::fixed::FixedSynthesis;
use super::kernel::{Portable, Rot, Scratch, Tile, TILE};
use super::store::SealedBlock;
use super::tables::StreamTables;
use std::arch::x86_64::*;

#[path = "avx2_lookup.rs"]
mod lookup;

use lookup::{decode_rows, decode_rows_bf16, decode_rows_fixed, Rows};

#[path = "avx2_sums.rs"]
mod float_sums;

/// Whether this CPU runs the AVX2 kernel.
pub fn available() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
        && is_x86_feature_detected!("bmi2")
}

/// The AVX2 tile operations. Only constructed where [`available`] holds.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Avx2;

impl Avx2 {
    /// [`Portable`]'s float32 tile of centroids (`s.tile[j * 64 + t]`), component by component.
    #[inline(always)]
    fn decode(t: &StreamTables, b: &SealedBlock, row0: usize, rows: usize, s: &mut Scratch) {
        let tile = &mut s.tile[..t.m * TILE];
        for (c, out) in t.comps.iter().zip(tile.chunks_exact_mut(TILE)) {
            out[rows..].fill(t.lut[c.table as usize]);
        }
        let table = |j: usize| &t.lut[t.comps[j].table as usize..];
        let rw = Rows::new(t, b, row0, rows, &mut s.bytes);
        let full = rows / 8 * 8;
        // SAFETY: as in `scales`; the tile holds `m` x 64.
        unsafe { decode_rows(t, &rw, full, tile) };
        rw.each(t, full, table, |lut, j, r, code| {
            tile[j * TILE + r] = lut[code];
        });
    }
}

impl Avx2 {
    /// The tile's centroids as 16-bit values packed in pairs into `s.packed`: rounded to
    /// bfloat16 or (`FIXED`) to 16-bit fixed point, as [`Tile::centroids_bf16`] and
    /// [`Tile::centroids_i16`] define them.
    #[inline(always)]
    fn packed<const FIXED: bool>(
        t: &StreamTables,
        b: &SealedBlock,
        row0: usize,
        rows: usize,
        s: &mut Scratch,
    ) {
        let m = t.m;
        let packed = &mut s.packed[..m.div_ceil(2) * TILE];
        let put = |packed: &mut [u32], j: usize, r: usize, v: u16| {
            // Pair `j / 2`'s low member first, which clears the high one (+0 without one).
            let o = &mut packed[(j / 2) * TILE + r];
            *o = if j % 2 == 1 {
                (*o & 0xffff) | (v as u32) << 16
            } else {
                v as u32
            };
        };
        // The centroids already in fixed point (derived once per calibration).
        let fixed = FIXED.then(|| &t.lut_fixed().values);
        let at = |j: usize| t.comps[j].table as usize;
        for j in 0..m {
            let c0 = if let Some(f) = fixed {
                f[at(j)] as u16
            } else {
                t.table_bf16(j)[0]
            };
            for r in rows..TILE {
                put(packed, j, r, c0);
            }
        }
        let rw = Rows::new(t, b, row0, rows, &mut s.bytes);
        let full = rows / 8 * 8;
        // SAFETY: as in `scales`; `packed` holds the pairs x 64.
        unsafe {
            if FIXED {
                decode_rows_fixed(t, &rw, full, packed)
            } else {
                decode_rows_bf16(t, &rw, full, packed)
            }
        };
        // The rows after `full`, each component's table taken once.
        if let Some(f) = fixed {
            let table = |j: usize| &f[at(j)..];
            rw.each(t, full, table, |tab, j, r, code| {
                put(packed, j, r, tab[code] as u16);
            });
        } else {
            let table = |j: usize| t.table_bf16(j);
            rw.each(t, full, table, |tab, j, r, code| {
                put(packed, j, r, tab[code]);
            });
        }
    }
}

impl Tile for Avx2 {
    #[inline(always)]
    fn scales(self, b: &SealedBlock, row0: usize, rows: usize, g: &mut [f32; TILE]) {
        let Some(at) = b.scales_at else {
            return Portable.scales(b, row0, rows, g);
        };
        let mut h = [0u16; TILE];
        let blob = &b.blob()[at + 2 * row0..at + 2 * (row0 + rows)];
        for (x, c) in h.iter_mut().zip(blob.chunks_exact(2)) {
            *x = u16::from_le_bytes([c[0], c[1]]);
        }
        // SAFETY: only reached through `attend::run_task_avx2`, which `available` guards.
        unsafe { scales(&h, crate::f16::pow2(b.scale_exp as i32), g) }
    }

    #[inline(always)]
    fn dot(
        self,
        t: &StreamTables,
        b: &SealedBlock,
        row0: usize,
        rows: usize,
        w: &[f32],
        qr: usize,
        dot: &mut [f32],
        s: &mut Scratch,
    ) {
        Self::decode(t, b, row0, rows, s);
        // SAFETY: as in `scales`; `dots` checks the sizes.
        unsafe { float_sums::dots(w, t.m, qr, &s.tile, dot) }
    }

    #[inline(always)]
    fn centroids(
        self,
        t: &StreamTables,
        b: &SealedBlock,
        row0: usize,
        rows: usize,
        s: &mut Scratch,
    ) {
        Self::decode(t, b, row0, rows, s);
    }

    #[inline(always)]
    fn centroids_bf16(
        self,
        t: &StreamTables,
        b: &SealedBlock,
        row0: usize,
        rows: usize,
        s: &mut Scratch,
    ) {
        Self::packed::<false>(t, b, row0, rows, s);
    }

    #[inline(always)]
    fn centroids_i16(
        self,
        t: &StreamTables,
        b: &SealedBlock,
        row0: usize,
        rows: usize,
        s: &mut Scratch,
    ) {
        Self::packed::<true>(t, b, row0, rows, s);
    }

    #[inline(always)]
    fn synthesize_bf16(
        self,
        d: usize,
        pairs: usize,
        packed: &[u32],
        mb: &[u32],
        g: &[f32; TILE],
        mean: &[f32],
        keys: &mut [f32],
    ) {
        assert!(packed.len() >= pairs * TILE && mb.len() >= pairs * d && keys.len() >= d * TILE);
        assert!(mean.len() >= d);
        // SAFETY: as in `scales`; every channel is below `d` and every read inside the
        // sizes checked.
        unsafe { synthesize_from(d, 0, pairs, packed, Weights::Bf16(mb), g, mean, keys) }
    }

    #[inline(always)]
    fn synthesize_bf16_rotated(
        self,
        d: usize,
        pairs: usize,
        packed: &[u32],
        mb: &[u32],
        g: &[f32; TILE],
        mean: &[f32],
        rot: &Rot<'_>,
        keys: &mut [f32],
    ) {
        assert!(mb.len() >= pairs * d);
        // SAFETY: as in `scales`; `rotated` checks the sizes.
        unsafe { rotated(d, pairs, packed, Weights::Bf16(mb), g, mean, rot, keys) }
    }

    #[inline(always)]
    fn synthesize_i16_rotated(
        self,
        d: usize,
        pairs: usize,
        packed: &[u32],
        f: &FixedSynthesis,
        g: &[f32; TILE],
        mean: &[f32],
        rot: &Rot<'_>,
        keys: &mut [f32],
    ) {
        assert!(f.words.len() >= pairs * d && f.unit.len() >= d);
        // SAFETY: as in `scales`; `rotated` checks the sizes.
        unsafe { rotated(d, pairs, packed, Weights::I16(f), g, mean, rot, keys) }
    }

    #[inline(always)]
    fn lane_sums(self, acc: &[f32], sums: &mut [f32]) {
        assert!(acc.len() >= 16 * sums.len());
        // SAFETY: as in `scales`; every chunk read is inside `acc` (checked).
        unsafe { lane_sums(acc, sums) }
    }

    #[inline(always)]
    fn accumulate(
        self,
        t: &StreamTables,
        b: &SealedBlock,
        row0: usize,
        rows: usize,
        pg: &[f32],
        qr: usize,
        acc: &mut [f32],
        s: &mut Scratch,
    ) {
        Self::decode(t, b, row0, rows, s);
        // SAFETY: as in `scales`; `accumulate` checks the sizes.
        unsafe { float_sums::accumulate(t.m, &s.tile, pg, qr, acc) }
    }

    #[inline(always)]
    fn dots(self, qs: &[f32], d: usize, qr: usize, keys: &[f32], s: &mut [f32]) {
        // SAFETY: as in `scales`; `dots` checks the sizes.
        unsafe { float_sums::dots(qs, d, qr, keys, s) }
    }
}

/// What a synthesis multiplies the packed centroids by: bfloat16 pairs
/// ([`StreamTables::key_synthesis_bf16`]) or 16-bit fixed-point ones
/// ([`StreamTables::key_synthesis_i16`]).
#[derive(Clone, Copy)]
enum Weights<'a> {
    Bf16(&'a [u32]),
    I16(&'a FixedSynthesis),
}

/// `x` of channels `dims`, rows `r0 .. r0 + 8 G` in lanes, before the scale and the mean.
#[inline(always)]
unsafe fn sums<const N: usize, const G: usize>(
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
            let acc = sums_i16::<N, G>(d, dims, r0, pairs, packed, &f.words);
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

/// The exact 32-bit sums of the fixed-point synthesis ([`super::fixed::synthesize_tile`]) for
/// channels `dims`, rows `r0 .. r0 + 8 G` in lanes: one `vpmaddwd` per pair of components and
/// 8 rows (both members' products, added), then `vpaddd`.
#[inline(always)]
unsafe fn sums_i16<const N: usize, const G: usize>(
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
                a[g] = _mm256_add_epi32(a[g], _mm256_madd_epi16(c, wk));
            }
        }
    }
    acc
}

/// [`Tile::synthesize_bf16_rotated`] or [`Tile::synthesize_i16_rotated`] after their checks:
/// the rotated frequencies in registers ([`synthesize_rot`]), then the channels past them.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma")]
unsafe fn rotated(
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
            let x = sums::<4, 2>(d, [a0, b0, a1, b1], r0, pairs, packed, w);
            rotate_store(i, r0, [&x[0], &x[1]], [a0, b0], g, mean, rot, keys);
            rotate_store(i + 1, r0, [&x[2], &x[3]], [a1, b1], g, mean, rot, keys);
        }
        i += 2;
    }
    for i in i..h {
        let [a, b] = pair(rot, i);
        for r0 in [0, 32] {
            let x = sums::<2, 4>(d, [a, b], r0, pairs, packed, w);
            rotate_store(i, r0, [&x[0], &x[1]], [a, b], g, mean, rot, keys);
        }
    }
    synthesize_from(d, 2 * h, pairs, packed, w, g, mean, keys);
}

/// Channels `d0 .. d` of [`Tile::synthesize_bf16`] (or the fixed-point synthesis, by `w`): two
/// at a time, then one, each in two passes of 32 rows; `keys[dd * 64 + t] = fma(g_t, x,
/// mean_dd)`.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma")]
unsafe fn synthesize_from(
    d: usize,
    d0: usize,
    pairs: usize,
    packed: &[u32],
    w: Weights<'_>,
    g: &[f32; TILE],
    mean: &[f32],
    keys: &mut [f32],
) {
    let (gp, kp) = (g.as_ptr(), keys.as_mut_ptr());
    let store = |dd: usize, r0: usize, acc: &[__m256; 4]| {
        let mu = _mm256_set1_ps(mean[dd]);
        for (k, &x) in acc.iter().enumerate() {
            let gv = _mm256_loadu_ps(gp.add(r0 + 8 * k));
            _mm256_storeu_ps(kp.add(dd * TILE + r0 + 8 * k), _mm256_fmadd_ps(gv, x, mu));
        }
    };
    let mut dd = d0;
    while dd + 2 <= d {
        for r0 in [0, 32] {
            let acc = sums::<2, 4>(d, [dd, dd + 1], r0, pairs, packed, w);
            store(dd, r0, &acc[0]);
            store(dd + 1, r0, &acc[1]);
        }
        dd += 2;
    }
    if dd < d {
        for r0 in [0, 32] {
            store(dd, r0, &sums::<1, 4>(d, [dd], r0, pairs, packed, w)[0]);
        }
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
/// rotated in registers (the operations of [`super::kernel::rotate_tile`], in its order), then
/// stored.
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

/// `g = h * e` (`h` float16 bits: 0 past the tile's rows).
#[target_feature(enable = "avx2,f16c")]
unsafe fn scales(h: &[u16; TILE], e: f32, g: &mut [f32; TILE]) {
    let e = _mm256_set1_ps(e);
    for k in 0..TILE / 8 {
        let v = _mm256_cvtph_ps(_mm_loadu_si128(h.as_ptr().add(8 * k) as *const __m128i));
        _mm256_storeu_ps(g.as_mut_ptr().add(8 * k), _mm256_mul_ps(v, e));
    }
}

/// [`super::math::hsum16`] of each chunk of 16: lanes `l + 8`, `+ 4`, `+ 2`, `+ 1` added by
/// halving registers (the same additions, in the same tree).
#[target_feature(enable = "avx2")]
unsafe fn lane_sums(acc: &[f32], sums: &mut [f32]) {
    let ap = acc.as_ptr();
    for (i, dst) in sums.iter_mut().enumerate() {
        let a = _mm256_add_ps(
            _mm256_loadu_ps(ap.add(16 * i)),
            _mm256_loadu_ps(ap.add(16 * i + 8)),
        );
        let b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
        let c = _mm_add_ps(b, _mm_movehl_ps(b, b));
        *dst = _mm_cvtss_f32(_mm_add_ss(c, _mm_movehdup_ps(c)));
    }
}

#[cfg(test)]
#[path = "avx2_tests.rs"]
mod tests;
