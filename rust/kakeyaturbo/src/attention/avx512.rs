//! The tile operations with AVX-512 intrinsics (F, BW, VL, VBMI2; x86_64), computing the
//! bits of [`super::kernel::Portable`].
//!
//! Decode: per 16 rows, one gather per 32-bit word of the packed rows (all rows share the
//! layout, so word `w` of 16 rows is one gather at stride `row_bytes`), then per component one
//! funnel shift of its word pair (`vpshrdvd`), a mask, and a look-up: a permute of the
//! centroid table held in one register (up to 4 bits) or two (5 bits), a gather from the table
//! otherwise. Dot products and value sums: register-blocked fused multiply-adds, up to 6
//! query rows x 64 rows at a time.

use super::kernel::{Tile, TILE};
use super::store::SealedBlock;
use super::tables::{Lookup, StreamTables};
use std::arch::x86_64::*;

/// Whether this CPU runs the AVX-512 kernel.
pub fn available() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512vbmi2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

/// The AVX-512 tile operations. Only constructed where [`available`] holds.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Avx512;

impl Tile for Avx512 {
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn decode(
        self,
        t: &StreamTables,
        b: &SealedBlock,
        row0: usize,
        rows: usize,
        tile: &mut [f32],
        g: &mut [f32; TILE],
        words: &mut [u32],
    ) {
        // SAFETY: only reached through `attend::run_task_avx512`, which `available` guards.
        unsafe { decode(t, b, row0, rows, tile, g, words) }
    }

    #[inline(always)]
    fn dot(self, tile: &[f32], m: usize, w: &[f32], qr: usize, dot: &mut [f32]) {
        assert!(tile.len() >= m * TILE && w.len() >= qr * m && dot.len() >= qr * TILE);
        let mut r0 = 0;
        while r0 < qr {
            let nr = (qr - r0).min(6);
            // SAFETY: as above; the sizes were checked.
            unsafe {
                match nr {
                    1 => dot_rows::<1>(tile, m, w, r0, dot),
                    2 => dot_rows::<2>(tile, m, w, r0, dot),
                    3 => dot_rows::<3>(tile, m, w, r0, dot),
                    4 => dot_rows::<4>(tile, m, w, r0, dot),
                    5 => dot_rows::<5>(tile, m, w, r0, dot),
                    _ => dot_rows::<6>(tile, m, w, r0, dot),
                }
            }
            r0 += nr;
        }
    }

    #[inline(always)]
    fn accumulate(self, tile: &[f32], m: usize, pg: &[f32], qr: usize, acc: &mut [f32]) {
        assert!(tile.len() >= m * TILE && pg.len() >= qr * TILE && acc.len() >= qr * m * 16);
        let mut r0 = 0;
        while r0 < qr {
            let nr = (qr - r0).min(6);
            // SAFETY: as above; the sizes were checked.
            unsafe {
                match nr {
                    1 => acc_rows::<1>(tile, m, pg, r0, acc),
                    2 => acc_rows::<2>(tile, m, pg, r0, acc),
                    3 => acc_rows::<3>(tile, m, pg, r0, acc),
                    4 => acc_rows::<4>(tile, m, pg, r0, acc),
                    5 => acc_rows::<5>(tile, m, pg, r0, acc),
                    _ => acc_rows::<6>(tile, m, pg, r0, acc),
                }
            }
            r0 += nr;
        }
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn decode(
    t: &StreamTables,
    b: &SealedBlock,
    row0: usize,
    rows: usize,
    tile: &mut [f32],
    g: &mut [f32; TILE],
    words: &mut [u32],
) {
    let (rb, nw, m) = (t.row_bytes, t.words, t.m);
    let blob = b.blob();
    assert!((1..=TILE).contains(&rows) && row0 + rows <= b.n);
    assert!(tile.len() >= m * TILE && words.len() >= 16 * (nw + 1));
    // Word `w` of row `r` is read as 4 bytes at `codes_at + r rb + 4 w`: the last word of a
    // row may reach up to 3 bytes past the row, never past the container (its 4-byte checksum
    // follows the codes). Checked here for the rows of this tile.
    let last = b.codes_at + (row0 + rows - 1) * rb + 4 * nw;
    assert!(last <= blob.len() && 16 * rb < i32::MAX as usize / 2);
    let iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    let stride = _mm512_mullo_epi32(iota, _mm512_set1_epi32(rb as i32));
    let wp = words.as_mut_ptr() as *mut i32;
    _mm512_storeu_si512(wp.add(16 * nw) as *mut _, _mm512_setzero_si512());
    let lut = t.lut.as_ptr();
    for grp in 0..TILE / 16 {
        let first = grp * 16;
        let out = tile.as_mut_ptr().add(first);
        if first >= rows {
            for (j, c) in t.comps.iter().enumerate() {
                _mm512_storeu_ps(
                    out.add(j * TILE),
                    _mm512_set1_ps(*lut.add(c.table as usize)),
                );
            }
            _mm512_storeu_ps(g.as_mut_ptr().add(first), _mm512_setzero_ps());
            continue;
        }
        let valid = (rows - first).min(16);
        let live: __mmask16 = if valid == 16 {
            0xFFFF
        } else {
            (1u16 << valid) - 1
        };
        let base = blob.as_ptr().add(b.codes_at + (row0 + first) * rb);
        for w in 0..nw {
            let v = _mm512_mask_i32gather_epi32::<1>(
                _mm512_setzero_si512(),
                live,
                stride,
                base.add(4 * w) as *const i32,
            );
            _mm512_storeu_si512(wp.add(16 * w) as *mut _, v);
        }
        for (j, c) in t.comps.iter().enumerate() {
            let w = c.word as usize;
            let lo = _mm512_loadu_si512(wp.add(16 * w) as *const _);
            let hi = _mm512_loadu_si512(wp.add(16 * w + 16) as *const _);
            let x = _mm512_shrdv_epi32(lo, hi, _mm512_set1_epi32(c.shift as i32));
            let code = _mm512_and_si512(x, _mm512_set1_epi32(c.mask as i32));
            let tab = lut.add(c.table as usize);
            let val = match c.lookup {
                Lookup::Perm16 => _mm512_permutexvar_ps(code, _mm512_loadu_ps(tab)),
                Lookup::Perm32 => {
                    _mm512_permutex2var_ps(_mm512_loadu_ps(tab), code, _mm512_loadu_ps(tab.add(16)))
                }
                Lookup::Gather => _mm512_i32gather_ps::<4>(code, tab),
            };
            _mm512_storeu_ps(out.add(j * TILE), val);
        }
        let gv = match b.scales_at {
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
        _mm512_storeu_ps(g.as_mut_ptr().add(first), gv);
    }
}

#[target_feature(enable = "avx512f,fma")]
unsafe fn dot_rows<const NR: usize>(tile: &[f32], m: usize, w: &[f32], r0: usize, dot: &mut [f32]) {
    let mut acc = [[_mm512_setzero_ps(); 4]; NR];
    let tp = tile.as_ptr();
    let wp = w.as_ptr().add(r0 * m);
    for j in 0..m {
        let v = [
            _mm512_loadu_ps(tp.add(j * TILE)),
            _mm512_loadu_ps(tp.add(j * TILE + 16)),
            _mm512_loadu_ps(tp.add(j * TILE + 32)),
            _mm512_loadu_ps(tp.add(j * TILE + 48)),
        ];
        for (rr, a) in acc.iter_mut().enumerate() {
            let wb = _mm512_set1_ps(*wp.add(rr * m + j));
            for k in 0..4 {
                a[k] = _mm512_fmadd_ps(wb, v[k], a[k]);
            }
        }
    }
    let dp = dot.as_mut_ptr().add(r0 * TILE);
    for (rr, a) in acc.iter().enumerate() {
        for (k, &x) in a.iter().enumerate() {
            _mm512_storeu_ps(dp.add(rr * TILE + 16 * k), x);
        }
    }
}

#[target_feature(enable = "avx512f,fma")]
unsafe fn acc_rows<const NR: usize>(
    tile: &[f32],
    m: usize,
    pg: &[f32],
    r0: usize,
    acc: &mut [f32],
) {
    let pp = pg.as_ptr().add(r0 * TILE);
    let mut p = [[_mm512_setzero_ps(); 4]; NR];
    for (rr, x) in p.iter_mut().enumerate() {
        for (k, v) in x.iter_mut().enumerate() {
            *v = _mm512_loadu_ps(pp.add(rr * TILE + 16 * k));
        }
    }
    let tp = tile.as_ptr();
    let ap = acc.as_mut_ptr();
    for j in 0..m {
        let v = [
            _mm512_loadu_ps(tp.add(j * TILE)),
            _mm512_loadu_ps(tp.add(j * TILE + 16)),
            _mm512_loadu_ps(tp.add(j * TILE + 32)),
            _mm512_loadu_ps(tp.add(j * TILE + 48)),
        ];
        for (rr, x) in p.iter().enumerate() {
            let at = ap.add(((r0 + rr) * m + j) * 16);
            let mut a = _mm512_loadu_ps(at);
            for k in 0..4 {
                a = _mm512_fmadd_ps(x[k], v[k], a);
            }
            _mm512_storeu_ps(at, a);
        }
    }
}
