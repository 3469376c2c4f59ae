//! The look-up of the AVX2 kernel: a tile's rows ([`Rows`]: read in place where every 8-byte
//! read stays inside the block, from a zero-padded copy where not), each component's indices of
//! 8 rows from the rows' 32-bit words (rows of up to 32 bytes: one load each and a transpose;
//! longer ones: a 32-bit gather shared by the components whose bits end in it), and the
//! centroids by `vpermps` from tables in registers (up to 5 bits) or a gather: into a float32
//! tile, or for keys coded before RoPE rounded to bfloat16, or in 16-bit fixed point (byte
//! shuffles up to 4 bits), packed in pairs.

use super::super::fixed::FixedLut;
use super::super::kernel::{BF16_FLOOR, TILE};
use super::super::store::SealedBlock;
use super::super::tables::{Component, StreamTables};
use std::arch::x86_64::*;

/// The tile's rows, read in place where every read of every row stays inside the block's
/// bytes (a component's 8 bytes, which may run past its row: the mask drops those bits), else
/// from a zero-padded copy of them: the last tile of a block whose codes end its bytes (one
/// without outliers), whose last row a read would take past them.
pub(super) struct Rows<'a> {
    p: *const u8,
    rb: usize,
    pub(super) rows: usize,
    /// Rows (from the first) whose first 32 bytes can be loaded (every row of 32 bytes or more,
    /// and every row of a copy): where they all can, a tile's rows are read by one 32-byte load
    /// each.
    whole: usize,
    bytes: std::marker::PhantomData<&'a [u8]>,
}

impl<'a> Rows<'a> {
    /// Rows `row0 .. row0 + rows` of block `b`; `copy` holds them where they are not read in
    /// place.
    #[inline(always)]
    pub(super) fn new(
        t: &StreamTables,
        b: &'a SealedBlock,
        row0: usize,
        rows: usize,
        copy: &'a mut Vec<u8>,
    ) -> Self {
        let (rb, blob) = (t.row_bytes, b.blob());
        assert!((1..=TILE).contains(&rows) && row0 + rows <= b.n);
        let start = b.codes_at + row0 * rb;
        let end = start + rows * rb;
        assert!(end <= blob.len());
        // A row's last 8-byte read ends at most 7 bytes past it (`index_at`).
        if end + 7 > blob.len() {
            copy.clear();
            copy.extend_from_slice(&blob[start..end]);
            copy.resize(end - start + 32, 0);
            return Rows {
                p: copy.as_ptr(),
                rb,
                rows,
                whole: rows,
                bytes: std::marker::PhantomData,
            };
        }
        let whole = match (blob.len() - start).checked_sub(32) {
            _ if rb >= 32 => rows,
            Some(room) => (room / rb.max(1) + 1).min(rows),
            None => 0,
        };
        Rows {
            p: blob[start..].as_ptr(),
            rb,
            rows,
            whole,
            bytes: std::marker::PhantomData,
        }
    }

    /// Each component's index in rows `from .. rows`, `put(&tab, j, r, code)` (`tab =
    /// table(j)`, taken once per component).
    #[inline(always)]
    pub(super) fn each<T>(
        &self,
        t: &StreamTables,
        from: usize,
        table: impl Fn(usize) -> T,
        mut put: impl FnMut(&T, usize, usize, usize),
    ) {
        if from >= self.rows {
            return;
        }
        for (j, c) in t.comps.iter().enumerate() {
            let tab = table(j);
            for r in from..self.rows {
                // SAFETY: row `r < rows` of the tile: its reads end inside the bytes read.
                put(&tab, j, r, unsafe { index_at(self.p.add(r * self.rb), c) });
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

/// Component `c`'s table in `lut` ([`StreamTables::lut`], or its fixed-point twin
/// [`StreamTables::lut_fixed`] read as bits).
#[inline(always)]
unsafe fn table(lut: *const f32, c: &Component) -> Table {
    let p = lut.add(c.table as usize);
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

/// `f(&setup(j), j, idx)`: component `j`'s indices in rows `0 .. full` (a multiple of 8),
/// `idx[g]` those of rows `8 g .. 8 g + 8`, for every component in order (`setup(j)`
/// once per component: its table in registers). Where a row's bits fit in 64 bytes and the
/// rows' first 32 bytes can be read (`full <= whole`, [`words_whole`]), each of the first 8
/// 32-bit words of 8 rows comes from one load per row and an 8 x 8 transpose, a word after
/// those from a gather; otherwise every word from gathers ([`words_gathered`]).
/// Each index is then a shift (two and an `or` where it spans two words) and the mask.
#[inline(always)]
unsafe fn each_index<T>(
    t: &StreamTables,
    rw: &Rows,
    full: usize,
    setup: impl Fn(usize) -> T,
    f: impl FnMut(&T, usize, &[__m256i]),
) {
    assert!(full <= rw.rows && full.is_multiple_of(8) && full <= TILE);
    if t.words <= 16 && full <= rw.whole {
        words_whole(t, rw, full, setup, f)
    } else {
        words_gathered(t, rw, full, setup, f)
    }
}

/// [`each_index`] from whole rows: per 8 rows, 8 loads of 32 bytes transposed into the rows'
/// first 8 words, their words after those (up to 16) by gathers (`w[g][k]`: word `k` of rows
/// `8 g .. 8 g + 8`).
#[inline(always)]
unsafe fn words_whole<T>(
    t: &StreamTables,
    rw: &Rows,
    full: usize,
    setup: impl Fn(usize) -> T,
    mut f: impl FnMut(&T, usize, &[__m256i]),
) {
    let groups = full / 8;
    let zero = _mm256_setzero_si256();
    let offs = row_offsets(rw.rb);
    let mut w = [[zero; 16]; TILE / 8];
    for (g, w) in w[..groups].iter_mut().enumerate() {
        for (k, w) in w.iter_mut().enumerate().take(t.words).skip(8) {
            // SAFETY (the caller's): word `k < words` of a row of the tile: its 8-byte read at
            // `4 k` ends inside the bytes read.
            let p = rw.p.add(8 * g * rw.rb + 4 * k);
            *w = _mm256_i32gather_epi32::<1>(p as *const i32, offs);
        }
        // SAFETY (the caller's): rows below `full <= whole` have 32 bytes inside the bytes read.
        let r: [__m256i; 8] = std::array::from_fn(|i| {
            _mm256_loadu_si256(rw.p.add((8 * g + i) * rw.rb) as *const __m256i)
        });
        let lo = |a, b| _mm256_unpacklo_epi32(a, b);
        let hi = |a, b| _mm256_unpackhi_epi32(a, b);
        let t = [
            lo(r[0], r[1]),
            hi(r[0], r[1]),
            lo(r[2], r[3]),
            hi(r[2], r[3]),
            lo(r[4], r[5]),
            hi(r[4], r[5]),
            lo(r[6], r[7]),
            hi(r[6], r[7]),
        ];
        let u = [
            _mm256_unpacklo_epi64(t[0], t[2]),
            _mm256_unpackhi_epi64(t[0], t[2]),
            _mm256_unpacklo_epi64(t[1], t[3]),
            _mm256_unpackhi_epi64(t[1], t[3]),
            _mm256_unpacklo_epi64(t[4], t[6]),
            _mm256_unpackhi_epi64(t[4], t[6]),
            _mm256_unpacklo_epi64(t[5], t[7]),
            _mm256_unpackhi_epi64(t[5], t[7]),
        ];
        for k in 0..4 {
            w[k] = _mm256_permute2x128_si256::<0x20>(u[k], u[k + 4]);
            w[k + 4] = _mm256_permute2x128_si256::<0x31>(u[k], u[k + 4]);
        }
    }
    let mut idx = [zero; TILE / 8];
    for (j, c) in t.comps.iter().enumerate() {
        let (k, sh) = (c.word as usize, c.shift as i32);
        let width = (c.mask + 1).trailing_zeros() as i32;
        let mask = _mm256_set1_epi32(c.mask as i32);
        let right = _mm_cvtsi32_si128(sh);
        if sh + width <= 32 {
            for (i, w) in idx[..groups].iter_mut().zip(&w[..groups]) {
                *i = _mm256_and_si256(_mm256_srl_epi32(w[k], right), mask);
            }
        } else {
            // Spans words `k` and `k + 1` (`k + 1 < words`: the row's bits end in it).
            let left = _mm_cvtsi32_si128(32 - sh);
            for (i, w) in idx[..groups].iter_mut().zip(&w[..groups]) {
                let v = _mm256_or_si256(
                    _mm256_srl_epi32(w[k], right),
                    _mm256_sll_epi32(w[k + 1], left),
                );
                *i = _mm256_and_si256(v, mask);
            }
        }
        f(&setup(j), j, &idx[..groups]);
    }
}

/// [`each_index`] by gathers: one 32-bit gather per 8 rows from the byte holding a
/// component's first bit serves it and the components after it whose bits end inside those
/// 32 (an index of up to 8 bits starting in that byte always does); the tile's gathers for
/// such a run of components are taken first.
#[inline(always)]
unsafe fn words_gathered<T>(
    t: &StreamTables,
    rw: &Rows,
    full: usize,
    setup: impl Fn(usize) -> T,
    mut f: impl FnMut(&T, usize, &[__m256i]),
) {
    let offs = row_offsets(rw.rb);
    let groups = full / 8;
    let (mut w, mut idx) = (
        [_mm256_setzero_si256(); TILE / 8],
        [_mm256_setzero_si256(); TILE / 8],
    );
    let mut at = usize::MAX;
    for (j, c) in t.comps.iter().enumerate() {
        let bit = 32 * c.word as usize + c.shift as usize;
        let width = (c.mask + 1).trailing_zeros() as usize;
        if at == usize::MAX || bit + width > 8 * at + 32 {
            at = bit / 8;
            for (g, w) in w[..groups].iter_mut().enumerate() {
                // SAFETY (the caller's): reads end at byte `4 word + 7` of a row of the tile.
                let p = rw.p.add(8 * g * rw.rb + at);
                *w = _mm256_i32gather_epi32::<1>(p as *const i32, offs);
            }
        }
        let sh = _mm_cvtsi32_si128((bit - 8 * at) as i32);
        let mask = _mm256_set1_epi32(c.mask as i32);
        for (i, &w) in idx[..groups].iter_mut().zip(&w[..groups]) {
            *i = _mm256_and_si256(_mm256_srl_epi32(w, sh), mask);
        }
        f(&setup(j), j, &idx[..groups]);
    }
}

/// Rows `0 .. full` (a multiple of 8) of the float32 tile, 8 at a time.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn decode_rows(t: &StreamTables, rw: &Rows, full: usize, tile: &mut [f32]) {
    assert!(tile.len() >= t.m * TILE);
    let tp = tile.as_mut_ptr();
    let setup = |j: usize| table(t.lut.as_ptr(), &t.comps[j]);
    each_index(t, rw, full, setup, |tab, j, idx| {
        for (g, &i) in idx.iter().enumerate() {
            _mm256_storeu_ps(tp.add(j * TILE + 8 * g), look_up(tab, i));
        }
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

/// Rows `0 .. full` (a multiple of 8) of the packed pairs of bfloat16 values
/// ([`round_bf16`]), 8 at a time: a pair's low member stored alone (the high half 0), then
/// the high one merged into it.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn decode_rows_bf16(
    t: &StreamTables,
    rw: &Rows,
    full: usize,
    packed: &mut [u32],
) {
    assert!(packed.len() >= t.m.div_ceil(2) * TILE);
    let pp = packed.as_mut_ptr();
    let setup = |j: usize| table(t.lut.as_ptr(), &t.comps[j]);
    each_index(t, rw, full, setup, |tab, j, idx| {
        for (g, &i) in idx.iter().enumerate() {
            let v = round_bf16(look_up(tab, i));
            let out = pp.add((j / 2) * TILE + 8 * g) as *mut __m256i;
            if j % 2 == 0 {
                _mm256_storeu_si256(out, v);
            } else {
                let low = _mm256_loadu_si256(out);
                _mm256_storeu_si256(out, _mm256_or_si256(low, _mm256_slli_epi32::<16>(v)));
            }
        }
    });
}

/// A component's 16-bit fixed-point centroids for 16-lane look-ups: up to 4 bits, the low and
/// the high bytes of its 16 entries (each in both 128-bit lanes) for byte shuffles; wider, its
/// table of [`StreamTables::lut_fixed`] for [`look_up`].
enum Fixed {
    Bytes(__m256i, __m256i),
    Wide(Table),
}

#[inline(always)]
unsafe fn fixed_table(lut: &FixedLut, c: &Component) -> Fixed {
    if c.mask >= 16 {
        return Fixed::Wide(table(lut.values.as_ptr() as *const f32, c));
    }
    // Tables start at multiples of 16 entries (`FixedLut::bytes`).
    let b = lut.bytes[c.table as usize / 16].as_ptr() as *const __m128i;
    Fixed::Bytes(
        _mm256_broadcastsi128_si256(_mm_loadu_si128(b)),
        _mm256_broadcastsi128_si256(_mm_loadu_si128(b.add(1))),
    )
}

/// The 16-bit centroids of 16 rows, rows `0 .. 8` from `lo`'s indices and `8 .. 16` from
/// `hi`'s, in the order `vpackssdw` leaves them (per 128-bit lane, 4 rows of `lo`, then 4 of
/// `hi`), which `vpunpck*wd` undoes.
#[inline(always)]
unsafe fn look_up16(tab: &Fixed, lo: __m256i, hi: __m256i) -> __m256i {
    match tab {
        Fixed::Bytes(l, h) => {
            // Each 16-bit index (below 16) in both of its bytes: the low byte's shuffle
            // takes the value's low byte, the high one's its high byte.
            let i = _mm256_packus_epi32(lo, hi);
            let i = _mm256_or_si256(i, _mm256_slli_epi16::<8>(i));
            let odd = _mm256_set1_epi16(0xff00u16 as i16);
            _mm256_blendv_epi8(_mm256_shuffle_epi8(*l, i), _mm256_shuffle_epi8(*h, i), odd)
        }
        Fixed::Wide(t) => _mm256_packs_epi32(
            _mm256_castps_si256(look_up(t, lo)),
            _mm256_castps_si256(look_up(t, hi)),
        ),
    }
}

/// Rows `0 .. full` (a multiple of 8) of the packed pairs of 16-bit fixed-point
/// values ([`super::super::fixed::fixed16`], looked up in [`StreamTables::lut_fixed`]), 16
/// rows at a time: a pair's two members' values interleaved into words (the high half 0 for
/// the last component of an odd count).
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn decode_rows_fixed(
    t: &StreamTables,
    rw: &Rows,
    full: usize,
    packed: &mut [u32],
) {
    assert!(packed.len() >= t.m.div_ceil(2) * TILE);
    let (pp, m, lut) = (packed.as_mut_ptr(), t.m, t.lut_fixed());
    let zero = _mm256_setzero_si256();
    // The low member's values per 16 rows, held until its pair's high member comes.
    let mut low = [zero; TILE / 16];
    let setup = |j: usize| fixed_table(lut, &t.comps[j]);
    each_index(t, rw, full, setup, |tab, j, idx| {
        let mut v = [zero; TILE / 16];
        for (u, pair) in v.iter_mut().zip(idx.chunks(2)) {
            *u = look_up16(tab, pair[0], *pair.get(1).unwrap_or(&zero));
        }
        let (lo, hi) = match j % 2 {
            0 if j + 1 < m => {
                low = v;
                return;
            }
            0 => (v, [zero; TILE / 16]),
            _ => (low, v),
        };
        let out = pp.add((j / 2) * TILE) as *mut __m256i;
        for (u, g) in (0..idx.len()).step_by(2).enumerate() {
            _mm256_storeu_si256(out.add(g), _mm256_unpacklo_epi16(lo[u], hi[u]));
            if g + 1 < idx.len() {
                _mm256_storeu_si256(out.add(g + 1), _mm256_unpackhi_epi16(lo[u], hi[u]));
            }
        }
    });
}
