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
//!   accumulators of 8 lanes), so that the scale, the mean and the rotation run in registers
//!   (`avx2_synth.rs`); fixed point as one `vpdpwssd` per word where the CPU has AVX-VNNI
//!   (Intel since Alder Lake), else `vpmaddwd` + `vpaddd` (exact 32-bit sums either way), two
//!   frequencies by 16 rows; bfloat16 as two float32 `fma`s per packed word (widened once for
//!   both channels), one frequency by 32 rows.
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

#[path = "avx2_synth.rs"]
mod synth;

use synth::{rotated, rotated_vnni, synthesize_from, Weights};

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
        // Rows past the tile's: centroid 0, from the tables rounded once per calibration.
        for j in (0..m).filter(|_| rows < TILE) {
            let c0 = t.table16(j, FIXED)[0];
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
        let table = |j: usize| t.table16(j, FIXED);
        rw.each(t, full, table, |tab, j, r, code| {
            put(packed, j, r, tab[code])
        });
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
        let w = Weights::I16(f);
        // SAFETY: as in `scales` (and `has_avx_vnni` for `vpdpwssd`); `rotated` checks the
        // sizes.
        unsafe {
            if synth::has_avx_vnni() {
                rotated_vnni(d, pairs, packed, w, g, mean, rot, keys)
            } else {
                rotated(d, pairs, packed, w, g, mean, rot, keys)
            }
        }
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
