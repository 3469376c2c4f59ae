//! The tile operations with AVX-512 intrinsics (F, BW, VL, VBMI; x86_64), computing the bits
//! of [`super::kernel::Portable`].
//!
//! Unpacking: the calibration's components are cut into groups of up to 8 whose bits lie in
//! one 64-bit window of a row ([`super::tables::Group`]). Per group and 16 rows: two gathers of
//! the rows' windows (one row layout, so a fixed stride), one `vpmultishiftqb` each that pulls
//! every component's bits to its own byte, a mask, and one `vpermt2b` per 4 components that
//! turns rows-by-components into components-by-rows bytes. Per component and 16 rows then:
//! widen 16 index bytes and look the centroids up (a permute of the table held in one, two or
//! four registers for widths up to 6 bits, a gather from the table beyond) straight into the
//! fused multiply-adds with every query row: the centroids are never stored. Keys coded before
//! RoPE with the bfloat16 or the fixed-point synthesis instead store their centroids as 16-bit
//! pairs, looked up 32 rows at a time from tables rounded once ([`centroids_packed`]), then
//! summed by `vdpbf16ps` or `vpdpwssd` ([`synth`]).

use super::fixed::FixedSynthesis;
use super::kernel::{rotate_tile, Rot, Scratch, Tile, TILE};
use super::store::SealedBlock;
use super::tables::StreamTables;
use std::arch::x86_64::*;

#[path = "avx512_lookup.rs"]
mod lookup;
#[path = "avx512_synth.rs"]
mod synth;

use lookup::{acc_rows, centroids, dot_rows, unpack};
pub use synth::has_bf16;
use synth::has_vnni;
use synth::{
    centroids_packed, synthesize_bf16_fma, synthesize_bf16_from, synthesize_bf16_rot,
    synthesize_block, synthesize_i16_madd, synthesize_i16_vnni, Affine,
};

/// Whether this CPU runs the AVX-512 kernel.
pub fn available() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512vbmi")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

/// The AVX-512 tile operations. Only constructed where [`available`] holds.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Avx512;

/// Query rows per register block: 6 x 4 accumulators of 16 lanes.
const NR: usize = 6;

impl Avx512 {
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
        assert!(s.packed.len() >= t.m.div_ceil(2) * TILE);
        // SAFETY: only reached through `attend::run_task_avx512`, which `available` guards;
        // `unpack` checks what it reads, the packed tile's size was checked.
        unsafe {
            unpack(t, b, row0, rows, s);
            centroids_packed::<FIXED>(t, &s.bytes, &mut s.packed);
        }
    }
}

impl Tile for Avx512 {
    #[inline(always)]
    fn centroids(
        self,
        t: &StreamTables,
        b: &SealedBlock,
        row0: usize,
        rows: usize,
        s: &mut Scratch,
    ) {
        assert!(s.tile.len() >= t.m * TILE);
        // SAFETY: as in `scales`; `unpack` checks what it reads, the tile's size was checked.
        unsafe {
            unpack(t, b, row0, rows, s);
            centroids(t, &s.bytes, &mut s.tile);
        }
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
    fn synthesize(self, d: usize, m: usize, tile: &[f32], msyn: &[f32], keys: &mut [f32]) {
        assert!(tile.len() >= m * TILE && msyn.len() >= m * d && keys.len() >= d * TILE);
        // SAFETY: as in `scales`; the sizes were checked.
        unsafe {
            let mut d0 = 0;
            while d0 + 4 <= d {
                synthesize_block::<4>(d, d0, m, tile, msyn, keys);
                d0 += 4;
            }
            while d0 < d {
                synthesize_block::<1>(d, d0, m, tile, msyn, keys);
                d0 += 1;
            }
        }
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
        let y = Affine { g, mean };
        // SAFETY: as in `scales` (and `has_bf16` for the BF16 instructions); sizes checked.
        unsafe {
            let mut d0 = 0;
            if has_bf16() {
                synthesize_bf16_from(d, 0, pairs, packed, mb, &y, keys);
            } else {
                while d0 + 4 <= d {
                    synthesize_bf16_fma::<4>(d, d0, pairs, packed, mb, &y, keys);
                    d0 += 4;
                }
                while d0 < d {
                    synthesize_bf16_fma::<1>(d, d0, pairs, packed, mb, &y, keys);
                    d0 += 1;
                }
            }
        }
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
        if !has_bf16() || rot.half == 0 {
            self.synthesize_bf16(d, pairs, packed, mb, g, mean, keys);
            rotate_tile(rot, keys);
            return;
        }
        rotated_sizes(d, pairs, packed, mb.len(), mean, rot, keys);
        // SAFETY: as in `scales` (and `has_bf16`); the sizes were checked.
        unsafe { synthesize_bf16_rot(d, pairs, packed, mb, &Affine { g, mean }, rot, keys) }
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
        rotated_sizes(d, pairs, packed, f.words.len(), mean, rot, keys);
        assert!(f.unit.len() >= d);
        let y = Affine { g, mean };
        // SAFETY: as in `scales` (and `has_vnni` for `vpdpwssd`); the sizes were checked.
        unsafe {
            if has_vnni() {
                synthesize_i16_vnni(d, pairs, packed, f, &y, rot, keys)
            } else {
                synthesize_i16_madd(d, pairs, packed, f, &y, rot, keys)
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
    fn scales(self, b: &SealedBlock, row0: usize, rows: usize, g: &mut [f32; TILE]) {
        // SAFETY: only reached through `attend::run_task_avx512`, which `available` guards.
        unsafe { scales(b, row0, rows, g) }
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
        assert!(w.len() >= qr * t.m && dot.len() >= qr * TILE);
        // SAFETY: as above; `unpack` checks what it reads, the sizes were checked.
        unsafe {
            unpack(t, b, row0, rows, s);
            let mut r0 = 0;
            while r0 < qr {
                let nr = (qr - r0).min(NR);
                match nr {
                    1 => dot_rows::<1>(t, &s.bytes, w, r0, dot),
                    2 => dot_rows::<2>(t, &s.bytes, w, r0, dot),
                    3 => dot_rows::<3>(t, &s.bytes, w, r0, dot),
                    4 => dot_rows::<4>(t, &s.bytes, w, r0, dot),
                    5 => dot_rows::<5>(t, &s.bytes, w, r0, dot),
                    _ => dot_rows::<6>(t, &s.bytes, w, r0, dot),
                }
                r0 += nr;
            }
        }
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
        assert!(pg.len() >= qr * TILE && acc.len() >= qr * t.m * 16);
        // SAFETY: as above.
        unsafe {
            unpack(t, b, row0, rows, s);
            let mut r0 = 0;
            while r0 < qr {
                let nr = (qr - r0).min(NR);
                match nr {
                    1 => acc_rows::<1>(t, &s.bytes, pg, r0, acc),
                    2 => acc_rows::<2>(t, &s.bytes, pg, r0, acc),
                    3 => acc_rows::<3>(t, &s.bytes, pg, r0, acc),
                    4 => acc_rows::<4>(t, &s.bytes, pg, r0, acc),
                    5 => acc_rows::<5>(t, &s.bytes, pg, r0, acc),
                    _ => acc_rows::<6>(t, &s.bytes, pg, r0, acc),
                }
                r0 += nr;
            }
        }
    }
}

/// The sizes a synthesis with the rotation in registers reads and writes: every channel below
/// `d` (`weights` words of `M`, pairs x D), every frequency's run inside the cos/sin tables.
fn rotated_sizes(
    d: usize,
    pairs: usize,
    packed: &[u32],
    weights: usize,
    mean: &[f32],
    rot: &Rot<'_>,
    keys: &[f32],
) {
    let h = rot.half;
    assert!(packed.len() >= pairs * TILE && weights >= pairs * d && keys.len() >= d * TILE);
    assert!(mean.len() >= d && 2 * h <= d);
    if h > 0 {
        assert!(rot.cos.len() >= rot.at(h - 1) + TILE && rot.sin.len() >= rot.at(h - 1) + TILE);
    }
}

/// Lanes `0 .. n` set.
#[inline(always)]
fn lanes(n: usize) -> u16 {
    if n >= 16 {
        0xFFFF
    } else {
        (1u16 << n) - 1
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
unsafe fn scales(b: &SealedBlock, row0: usize, rows: usize, g: &mut [f32; TILE]) {
    assert!((1..=TILE).contains(&rows) && row0 + rows <= b.n);
    let blob = b.blob();
    if let Some(at) = b.scales_at {
        let next = blob.as_ptr().wrapping_add(at + 2 * (row0 + TILE));
        _mm_prefetch::<_MM_HINT_T0>(next as *const i8);
        _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(64) as *const i8);
    }
    for grp in 0..TILE / 16 {
        let first = grp * 16;
        let live = lanes(rows.saturating_sub(first));
        let v = match b.scales_at {
            // A masked load reads nothing outside the live lanes (rows of this block).
            Some(at) => {
                let h = _mm256_maskz_loadu_epi16(
                    live,
                    blob.as_ptr().add(at + 2 * (row0 + first)) as *const i16,
                );
                let e = crate::f16::pow2(b.scale_exp as i32);
                _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(e))
            }
            None => _mm512_maskz_mov_ps(live, _mm512_set1_ps(1.0)),
        };
        _mm512_storeu_ps(g.as_mut_ptr().add(first), v);
    }
}

/// [`super::math::hsum16`] of each chunk of 16 in registers: lanes `l + 8`, `+ 4`, `+ 2`,
/// `+ 1` added by halving the register (the same additions, in the same tree).
#[target_feature(enable = "avx512f")]
unsafe fn lane_sums(acc: &[f32], sums: &mut [f32]) {
    let ap = acc.as_ptr();
    for (i, dst) in sums.iter_mut().enumerate() {
        let v = _mm512_loadu_ps(ap.add(16 * i));
        let a = _mm256_add_ps(
            _mm512_castps512_ps256(v),
            _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v))),
        );
        let b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
        let c = _mm_add_ps(b, _mm_movehl_ps(b, b));
        *dst = _mm_cvtss_f32(_mm_add_ss(c, _mm_movehdup_ps(c)));
    }
}

#[cfg(test)]
#[path = "avx512_tests.rs"]
mod tests;
