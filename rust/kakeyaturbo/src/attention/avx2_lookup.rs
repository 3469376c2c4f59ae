//! The look-up of the AVX2 kernel: a tile's rows ([`Rows`]: read in place where every 8-byte
//! read stays inside the block, from a zero-padded copy where not), each component's indices of
//! 8 rows by one 32-bit gather shared by the components whose bits end in it, and the centroids
//! by `vpermps` from tables in registers (up to 5 bits) or a gather: into a float32 tile, or
//! for keys coded before RoPE rounded to bfloat16 or 16-bit fixed point and packed in pairs.

use super::super::fixed;
use super::super::kernel::{BF16_FLOOR, TILE};
use super::super::store::SealedBlock;
use super::super::tables::{Component, StreamTables};
use std::arch::x86_64::*;

/// The tile's rows: where they start in the block's bytes, and how many of them (`direct`)
/// every 8-byte read at a component stays inside the blob for (a read may run past its row:
/// the mask drops those bits). The rows after those are read from a zero-padded copy.
pub(super) struct Rows {
    p: *const u8,
    rb: usize,
    rows: usize,
    pub(super) direct: usize,
}

impl Rows {
    #[inline(always)]
    pub(super) fn new(t: &StreamTables, b: &SealedBlock, row0: usize, rows: usize) -> Self {
        let (rb, blob) = (t.row_bytes, b.blob());
        assert!((1..=TILE).contains(&rows) && row0 + rows <= b.n);
        let start = b.codes_at + row0 * rb;
        let end = start + rows * rb;
        assert!(end <= blob.len());
        // Row `r` is direct when its last byte's 8-byte read ends inside the blob.
        let direct = ((blob.len() - start).saturating_sub(7) / rb.max(1)).min(rows);
        Rows {
            p: blob[start..].as_ptr(),
            rb,
            rows,
            direct,
        }
    }

    /// Each component's index in rows `from .. rows`, `put(&tab, j, r, code)` (`tab =
    /// table(j)`, taken once per component of the direct rows); the rows past `direct` copied
    /// into `words` (`t.words + 1` of them) first.
    #[inline(always)]
    pub(super) fn each<T>(
        &self,
        t: &StreamTables,
        from: usize,
        words: &mut [u32],
        table: impl Fn(usize) -> T,
        mut put: impl FnMut(&T, usize, usize, usize),
    ) {
        for (j, c) in t.comps.iter().enumerate() {
            let tab = table(j);
            for r in from..self.direct {
                // SAFETY: row `r < direct` of the tile: its reads end inside the blob.
                put(&tab, j, r, unsafe { index_at(self.p.add(r * self.rb), c) });
            }
        }
        let words = &mut words[..t.words + 1];
        for r in self.direct.max(from)..self.rows {
            words.fill(0);
            // SAFETY: row `r < rows`, inside the blob (checked in `new`); `words` holds at
            // least `row_bytes + 4` bytes.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    self.p.add(r * self.rb),
                    words.as_mut_ptr() as *mut u8,
                    self.rb,
                );
            }
            for (j, c) in t.comps.iter().enumerate() {
                // SAFETY: `4 * c.word + 8 <= 4 * (t.words + 1)`.
                put(&table(j), j, r, unsafe {
                    index_at(words.as_ptr() as *const u8, c)
                });
            }
        }
    }
}

/// Component `c`'s index in the row at `p`.
///
/// # Safety
/// `p + 4 * c.word + 8` is inside the row's buffer ([`Rows`]).
#[inline(always)]
unsafe fn index_at(p: *const u8, c: &Component) -> usize {
    let w = (p.add(4 * c.word as usize) as *const u64).read_unaligned();
    ((w >> c.shift) as u32 & c.mask) as usize
}

/// A component's float32 centroids for 8-lane look-ups: in one, two or four registers up to
/// 5 bits (the tables are padded to 16 and 32 entries), gathered beyond.
enum Table {
    R1(__m256),
    R2(__m256, __m256),
    R4([__m256; 4]),
    Gather(*const f32),
}

#[inline(always)]
unsafe fn table(t: &StreamTables, c: &Component) -> Table {
    let p = t.lut.as_ptr().add(c.table as usize);
    let at = |k: usize| _mm256_loadu_ps(p.add(8 * k));
    match c.mask + 1 {
        0..=8 => Table::R1(at(0)),
        16 => Table::R2(at(0), at(1)),
        32 => Table::R4([at(0), at(1), at(2), at(3)]),
        _ => Table::Gather(p),
    }
}

/// The centroids of 8 rows' indices (`idx`, each below the table's size).
#[inline(always)]
unsafe fn look_up(tab: &Table, idx: __m256i) -> __m256 {
    // Index bit 3 (and 4) moved to the sign bit, which selects the blend's second source.
    let bit = |k: i32| _mm256_castsi256_ps(_mm256_sll_epi32(idx, _mm_cvtsi32_si128(31 - k)));
    let perm = |v: __m256| _mm256_permutevar8x32_ps(v, idx);
    match tab {
        Table::R1(a) => perm(*a),
        Table::R2(a, b) => _mm256_blendv_ps(perm(*a), perm(*b), bit(3)),
        Table::R4(v) => {
            let lo = _mm256_blendv_ps(perm(v[0]), perm(v[1]), bit(3));
            let hi = _mm256_blendv_ps(perm(v[2]), perm(v[3]), bit(3));
            _mm256_blendv_ps(lo, hi, bit(4))
        }
        Table::Gather(p) => _mm256_i32gather_ps::<4>(*p, idx),
    }
}

/// Byte offsets of 8 consecutive rows.
#[inline(always)]
unsafe fn row_offsets(rb: usize) -> __m256i {
    let rb = rb as i32;
    _mm256_setr_epi32(0, rb, 2 * rb, 3 * rb, 4 * rb, 5 * rb, 6 * rb, 7 * rb)
}

/// `f(&setup(j), j, r0, idx)`: component `j`'s indices in rows `r0 .. r0 + 8`, for every
/// component in order and, per component, every `r0 < full` (a multiple of 8, all direct) in
/// steps of 8 (`setup(j)` once per component: its table in registers). One 32-bit gather per
/// 8 rows from the byte holding a component's first bit serves it and the components after it
/// whose bits end inside those 32 (an index of up to 8 bits starting in that byte always
/// does): the tile's gathers for such a run of components are taken first, then each index
/// is a shift and the mask.
#[inline(always)]
unsafe fn each_index<T>(
    t: &StreamTables,
    rw: &Rows,
    full: usize,
    setup: impl Fn(usize) -> T,
    mut f: impl FnMut(&T, usize, usize, __m256i),
) {
    assert!(full <= rw.direct && full.is_multiple_of(8) && full <= TILE);
    let offs = row_offsets(rw.rb);
    let groups = full / 8;
    let mut w = [_mm256_setzero_si256(); TILE / 8];
    let mut at = usize::MAX;
    for (j, c) in t.comps.iter().enumerate() {
        let bit = 32 * c.word as usize + c.shift as usize;
        let width = (c.mask + 1).trailing_zeros() as usize;
        if at == usize::MAX || bit + width > 8 * at + 32 {
            at = bit / 8;
            for (g, w) in w[..groups].iter_mut().enumerate() {
                // SAFETY (the caller's): reads end at byte `4 word + 7` of a direct row.
                let p = rw.p.add(8 * g * rw.rb + at);
                *w = _mm256_i32gather_epi32::<1>(p as *const i32, offs);
            }
        }
        let sh = _mm_cvtsi32_si128((bit - 8 * at) as i32);
        let mask = _mm256_set1_epi32(c.mask as i32);
        let tab = setup(j);
        for (g, &w) in w[..groups].iter().enumerate() {
            f(
                &tab,
                j,
                8 * g,
                _mm256_and_si256(_mm256_srl_epi32(w, sh), mask),
            );
        }
    }
}

/// Rows `0 .. full` (a multiple of 8, all direct) of the float32 tile, 8 at a time.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn decode_rows(t: &StreamTables, rw: &Rows, full: usize, tile: &mut [f32]) {
    assert!(tile.len() >= t.m * TILE);
    let tp = tile.as_mut_ptr();
    let setup = |j: usize| table(t, &t.comps[j]);
    each_index(t, rw, full, setup, |tab, j, r0, idx| {
        _mm256_storeu_ps(tp.add(j * TILE + r0), look_up(tab, idx));
    });
}

/// [`super::super::kernel::bf16_round`] of 8 lanes.
#[inline(always)]
unsafe fn round_bf16(x: __m256) -> __m256i {
    let b = _mm256_castps_si256(x);
    let tiny = _mm256_cmpgt_epi32(
        _mm256_set1_epi32(BF16_FLOOR as i32),
        _mm256_and_si256(b, _mm256_set1_epi32(0x7fff_ffff)),
    );
    let odd = _mm256_and_si256(_mm256_srli_epi32::<16>(b), _mm256_set1_epi32(1));
    let r = _mm256_add_epi32(b, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
    _mm256_andnot_si256(tiny, _mm256_srli_epi32::<16>(r))
}

/// [`super::super::fixed::fixed16`] of 8 lanes (`vmaxps` takes its second operand for a NaN,
/// as the definition does).
#[inline(always)]
unsafe fn round_fixed16(x: __m256) -> __m256i {
    let v = _mm256_mul_ps(x, _mm256_set1_ps(fixed::ONE));
    let v = _mm256_max_ps(v, _mm256_set1_ps(-fixed::LIMIT));
    _mm256_cvtps_epi32(_mm256_min_ps(v, _mm256_set1_ps(fixed::LIMIT)))
}

/// Rows `0 .. full` (a multiple of 8, all direct) of the packed pairs of 16-bit values, 8 at a
/// time: bfloat16 ([`round_bf16`]) or 16-bit fixed point (`FIXED`, [`round_fixed16`]); a
/// pair's low member stored alone (the high half 0), then the high one merged into it.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn decode_rows_packed<const FIXED: bool>(
    t: &StreamTables,
    rw: &Rows,
    full: usize,
    packed: &mut [u32],
) {
    assert!(packed.len() >= t.m.div_ceil(2) * TILE);
    let pp = packed.as_mut_ptr();
    let low16 = _mm256_set1_epi32(0xffff);
    let setup = |j: usize| table(t, &t.comps[j]);
    each_index(t, rw, full, setup, |tab, j, r0, idx| {
        let c = look_up(tab, idx);
        let v = if FIXED {
            _mm256_and_si256(round_fixed16(c), low16)
        } else {
            round_bf16(c)
        };
        let out = pp.add((j / 2) * TILE + r0) as *mut __m256i;
        if j % 2 == 0 {
            _mm256_storeu_si256(out, v);
        } else {
            let low = _mm256_loadu_si256(out);
            _mm256_storeu_si256(out, _mm256_or_si256(low, _mm256_slli_epi32::<16>(v)));
        }
    });
}
