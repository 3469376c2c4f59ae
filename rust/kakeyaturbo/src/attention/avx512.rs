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
//! RoPE with the bfloat16 synthesis instead store their centroids as bfloat16 pairs, looked up
//! 32 rows at a time from tables rounded once ([`centroids_bf16`]).

use super::kernel::{bf16_half, rotate_tile, Rot, Scratch, Tile, TILE};
use super::store::SealedBlock;
use super::tables::{Component, Lookup, StreamTables};
use std::arch::x86_64::*;

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
        assert!(s.packed.len() >= t.m.div_ceil(2) * TILE);
        // SAFETY: as in `scales`; `unpack` checks what it reads, the packed tile's size was
        // checked.
        unsafe {
            unpack(t, b, row0, rows, s);
            centroids_bf16(t, &s.bytes, &mut s.packed);
        }
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
        let h = rot.half;
        if !has_bf16() || h == 0 {
            self.synthesize_bf16(d, pairs, packed, mb, g, mean, keys);
            rotate_tile(rot, keys);
            return;
        }
        assert!(packed.len() >= pairs * TILE && mb.len() >= pairs * d && keys.len() >= d * TILE);
        assert!(mean.len() >= d && 2 * h <= d);
        assert!(rot.cos.len() >= rot.at(h - 1) + TILE && rot.sin.len() >= rot.at(h - 1) + TILE);
        let y = Affine { g, mean };
        // SAFETY: as in `scales` (and `has_bf16`); the sizes were checked: every channel is
        // below `d`, every frequency's run inside the tables.
        unsafe {
            // Both channels of two frequencies per block, rotated in registers; then the
            // channels past the rotation as `synthesize_bf16` does them.
            let mut i = 0;
            while i + 2 <= h {
                let ((a0, b0), (a1, b1)) = (rot.pair(i), rot.pair(i + 1));
                synthesize_bf16_rot::<4, 2>(
                    d,
                    [a0, a1, b0, b1],
                    [i, i + 1],
                    pairs,
                    packed,
                    mb,
                    &y,
                    rot,
                    keys,
                );
                i += 2;
            }
            if i < h {
                let (a, b) = rot.pair(i);
                synthesize_bf16_rot::<2, 1>(d, [a, b], [i], pairs, packed, mb, &y, rot, keys);
            }
            synthesize_bf16_from(d, 2 * h, pairs, packed, mb, &y, keys);
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

/// The 8 x 8 transpose of qwords: `out[k]` = qword `k` of `w[0..8]`, 24 two-source permutes.
#[inline(always)]
unsafe fn transpose8(w: [__m512i; 8]) -> [__m512i; 8] {
    let ix = |v: [i64; 8]| _mm512_set_epi64(v[7], v[6], v[5], v[4], v[3], v[2], v[1], v[0]);
    let (a_lo, a_hi) = (
        ix([0, 8, 1, 9, 2, 10, 3, 11]),
        ix([4, 12, 5, 13, 6, 14, 7, 15]),
    );
    let (b_0, b_1) = (
        ix([0, 1, 8, 9, 2, 3, 10, 11]),
        ix([4, 5, 12, 13, 6, 7, 14, 15]),
    );
    let (c_0, c_1) = (
        ix([0, 1, 2, 3, 8, 9, 10, 11]),
        ix([4, 5, 6, 7, 12, 13, 14, 15]),
    );
    let p = _mm512_permutex2var_epi64;
    // Rows in pairs: [r0 w0, r1 w0, r0 w1, r1 w1, ...] (windows 0-3) and windows 4-7.
    let a = [
        p(w[0], a_lo, w[1]),
        p(w[0], a_hi, w[1]),
        p(w[2], a_lo, w[3]),
        p(w[2], a_hi, w[3]),
        p(w[4], a_lo, w[5]),
        p(w[4], a_hi, w[5]),
        p(w[6], a_lo, w[7]),
        p(w[6], a_hi, w[7]),
    ];
    // Rows in fours: windows (0, 1), (2, 3), (4, 5), (6, 7) of rows 0-3, then of rows 4-7.
    let b = [
        p(a[0], b_0, a[2]),
        p(a[0], b_1, a[2]),
        p(a[1], b_0, a[3]),
        p(a[1], b_1, a[3]),
        p(a[4], b_0, a[6]),
        p(a[4], b_1, a[6]),
        p(a[5], b_0, a[7]),
        p(a[5], b_1, a[7]),
    ];
    [
        p(b[0], c_0, b[4]),
        p(b[0], c_1, b[4]),
        p(b[1], c_0, b[5]),
        p(b[1], c_1, b[5]),
        p(b[2], c_0, b[6]),
        p(b[2], c_1, b[6]),
        p(b[3], c_0, b[7]),
        p(b[3], c_1, b[7]),
    ]
}

/// The index bytes of the tile's rows, components-by-rows: `bytes[(rg * slots + slot) * 16 +
/// l]` = the index of the component in `slot` of row `16 rg + l` (0 past `rows`).
///
/// Per 16 rows and batch of groups: each row's bytes of the batch in one masked load (nothing
/// past the row is read), its windows by one byte permute, the windows of 8 rows transposed
/// to one register per group, then per group the multishift, the mask, and the byte permutes
/// to components-by-rows.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi")]
unsafe fn unpack(t: &StreamTables, b: &SealedBlock, row0: usize, rows: usize, s: &mut Scratch) {
    let rb = t.row_bytes;
    let slots = 8 * t.groups.len();
    assert!((1..=TILE).contains(&rows) && row0 + rows <= b.n);
    assert!(s.bytes.len() >= slots * TILE);
    let blob = b.blob();
    assert!(b.codes_at + (row0 + rows) * rb <= blob.len());
    // Row-major [row][8] bytes of two registers (rows 0-7 and 8-15) to component-major
    // [component][16 rows], components 0-3 and 4-7.
    let mut ia = [0u8; 64];
    let mut ib = [0u8; 64];
    for i in 0..4 {
        for r in 0..16 {
            let src = |c: usize| {
                if r < 8 {
                    r * 8 + c
                } else {
                    64 + (r - 8) * 8 + c
                }
            };
            ia[i * 16 + r] = src(i) as u8;
            ib[i * 16 + r] = src(i + 4) as u8;
        }
    }
    let (ia, ib) = (
        _mm512_loadu_si512(ia.as_ptr() as *const _),
        _mm512_loadu_si512(ib.as_ptr() as *const _),
    );
    let zero = _mm512_setzero_si512();
    let out = s.bytes.as_mut_ptr();
    for rg in 0..TILE / 16 {
        let live = rows.saturating_sub(16 * rg).min(16);
        let base = blob.as_ptr().add(b.codes_at + (row0 + 16 * rg) * rb);
        // The rows of the next tile start loading now (a hint; past the block it reads
        // nothing and never faults). Sealed rows stream from memory at long contexts, and a
        // masked load that misses stalls the permutes behind it.
        for r in (0..16 * rb).step_by(64) {
            _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(TILE * rb + r) as *const i8);
        }
        for bt in &t.batches {
            let off = bt.off as usize;
            let len = (rb - off).min(64);
            let keep: __mmask64 = if len == 64 { !0 } else { (1u64 << len) - 1 };
            let perm = _mm512_loadu_si512(bt.perm.as_ptr() as *const _);
            let mut w = [zero; 16];
            for (r, x) in w.iter_mut().enumerate().take(live) {
                let row = _mm512_maskz_loadu_epi8(keep, base.add(r * rb + off) as *const i8);
                *x = _mm512_permutexvar_epi8(perm, row);
            }
            let lo = transpose8([w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]]);
            let hi = transpose8([w[8], w[9], w[10], w[11], w[12], w[13], w[14], w[15]]);
            for k in 0..bt.groups as usize {
                let gi = bt.first as usize + k;
                let grp = &t.groups[gi];
                let ctrl = _mm512_set1_epi64(grp.ctrl as i64);
                let mask = _mm512_set1_epi64(grp.mask as i64);
                let l = _mm512_and_si512(_mm512_multishift_epi64_epi8(ctrl, lo[k]), mask);
                let h = _mm512_and_si512(_mm512_multishift_epi64_epi8(ctrl, hi[k]), mask);
                let dst = out.add((rg * slots + 8 * gi) * 16);
                _mm512_storeu_si512(dst as *mut _, _mm512_permutex2var_epi8(l, ia, h));
                _mm512_storeu_si512(dst.add(64) as *mut _, _mm512_permutex2var_epi8(l, ib, h));
            }
        }
    }
}

/// The centroid tables of a component, loaded once per tile.
struct Table {
    t: [__m512; 4],
    p: *const f32,
}

#[inline(always)]
unsafe fn table(t: &StreamTables, c: &Component) -> Table {
    let p = t.lut.as_ptr().add(c.table as usize);
    let z = _mm512_setzero_ps();
    let t = match c.lookup {
        Lookup::Perm16 => [_mm512_loadu_ps(p), z, z, z],
        Lookup::Perm32 => [_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(16)), z, z],
        Lookup::Perm64 => [
            _mm512_loadu_ps(p),
            _mm512_loadu_ps(p.add(16)),
            _mm512_loadu_ps(p.add(32)),
            _mm512_loadu_ps(p.add(48)),
        ],
        Lookup::Gather => [z; 4],
    };
    Table { t, p }
}

/// The centroids of 16 rows of a component from their index bytes.
#[inline(always)]
unsafe fn look_up(kind: Lookup, tab: &Table, bytes: *const u8) -> __m512 {
    let idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(bytes as *const __m128i));
    match kind {
        Lookup::Perm16 => _mm512_permutexvar_ps(idx, tab.t[0]),
        Lookup::Perm32 => _mm512_permutex2var_ps(tab.t[0], idx, tab.t[1]),
        Lookup::Perm64 => {
            let lo = _mm512_permutex2var_ps(tab.t[0], idx, tab.t[1]);
            let hi = _mm512_permutex2var_ps(tab.t[2], idx, tab.t[3]);
            _mm512_mask_blend_ps(_mm512_test_epi32_mask(idx, _mm512_set1_epi32(32)), lo, hi)
        }
        Lookup::Gather => _mm512_i32gather_ps::<4>(idx, tab.p),
    }
}

/// Dimensions `d0 .. d0 + N` of [`Tile::synthesize`]: `N x 4` accumulators of 16 rows held in
/// registers across the components (the same `fma` chains as the definition).
#[target_feature(enable = "avx512f,fma")]
unsafe fn synthesize_block<const N: usize>(
    d: usize,
    d0: usize,
    m: usize,
    tile: &[f32],
    msyn: &[f32],
    keys: &mut [f32],
) {
    let mut acc = [[_mm512_setzero_ps(); 4]; N];
    let (tp, mp) = (tile.as_ptr(), msyn.as_ptr());
    for j in 0..m {
        let c = [
            _mm512_loadu_ps(tp.add(j * TILE)),
            _mm512_loadu_ps(tp.add(j * TILE + 16)),
            _mm512_loadu_ps(tp.add(j * TILE + 32)),
            _mm512_loadu_ps(tp.add(j * TILE + 48)),
        ];
        for (k, a) in acc.iter_mut().enumerate() {
            let w = _mm512_set1_ps(*mp.add(j * d + d0 + k));
            for (x, &cg) in a.iter_mut().zip(&c) {
                *x = _mm512_fmadd_ps(w, cg, *x);
            }
        }
    }
    let kp = keys.as_mut_ptr();
    for (k, a) in acc.iter().enumerate() {
        for (g, &x) in a.iter().enumerate() {
            _mm512_storeu_ps(kp.add((d0 + k) * TILE + 16 * g), x);
        }
    }
}

/// Whether this CPU has AVX-512 BF16 (`vdpbf16ps`); without it the same chains run as pairs of
/// float32 `fma`s.
pub fn has_bf16() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| is_x86_feature_detected!("avx512bf16"))
}

/// The unpacked indices of a tile looked up and rounded to bfloat16 pairs: [`centroids`]
/// then [`super::kernel::pack_tile`] without the float32 tile between them. Each component is
/// looked up from its table rounded beforehand ([`StreamTables::table_bf16`]), 32 rows per
/// 16-bit permute of 64 entries (blended by the index's bits 6 and 7 past 6 bits), and the
/// two members of a pair interleaved into packed words by two more permutes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn centroids_bf16(t: &StreamTables, bytes: &[u8], packed: &mut [u32]) {
    let slots = 8 * t.groups.len();
    let bp = bytes.as_ptr();
    let pp = packed.as_mut_ptr();
    // Word `2l` from word `l` of the first source, word `2l + 1` from word `l` of the second:
    // rows 0-15 of the 32 (`h = 0`), rows 16-31 (`h = 1`).
    let inter = |h: u16| {
        let w: [u16; 32] = std::array::from_fn(|i| (i as u16 / 2) + 16 * h + 32 * (i as u16 % 2));
        _mm512_loadu_si512(w.as_ptr() as *const _)
    };
    let (inter_lo, inter_hi) = (inter(0), inter(1));
    let at = |rg: usize, c: &Component| bp.add((rg * slots + c.slot as usize) * 16);
    // Rows 32 h .. 32 h + 31 of component `j`: its index bytes as words, looked up.
    let words = |j: usize, h: usize| {
        let (c, tab) = (&t.comps[j], t.table_bf16(j));
        let idx = _mm512_cvtepu8_epi16(_mm256_set_m128i(
            _mm_loadu_si128(at(2 * h + 1, c) as *const __m128i),
            _mm_loadu_si128(at(2 * h, c) as *const __m128i),
        ));
        let chunk = |k: usize| {
            let p = tab.as_ptr().add(64 * k);
            _mm512_permutex2var_epi16(
                _mm512_loadu_si512(p as *const _),
                idx,
                _mm512_loadu_si512(p.add(32) as *const _),
            )
        };
        let bit = |b: u16| _mm512_test_epi16_mask(idx, _mm512_set1_epi16(b as i16));
        match tab.len() {
            64 => chunk(0),
            128 => _mm512_mask_blend_epi16(bit(64), chunk(0), chunk(1)),
            _ => {
                let lo = _mm512_mask_blend_epi16(bit(64), chunk(0), chunk(1));
                let hi = _mm512_mask_blend_epi16(bit(64), chunk(2), chunk(3));
                _mm512_mask_blend_epi16(bit(128), lo, hi)
            }
        }
    };
    for p in 0..t.comps.len().div_ceil(2) {
        for h in 0..2 {
            let a = words(2 * p, h);
            let b = if 2 * p + 1 < t.comps.len() {
                words(2 * p + 1, h)
            } else {
                _mm512_setzero_si512()
            };
            let out = pp.add(p * TILE + 32 * h);
            _mm512_storeu_si512(out as *mut _, _mm512_permutex2var_epi16(a, inter_lo, b));
            _mm512_storeu_si512(
                out.add(16) as *mut _,
                _mm512_permutex2var_epi16(a, inter_hi, b),
            );
        }
    }
}

/// The scale and mean a synthesised tile is stored with: `fma(g_t, x, mean_d)`.
struct Affine<'a> {
    g: &'a [f32; TILE],
    mean: &'a [f32],
}

impl Affine<'_> {
    #[inline(always)]
    unsafe fn store<const N: usize>(&self, d0: usize, acc: &[[__m512; 4]; N], keys: &mut [f32]) {
        let gp = self.g.as_ptr();
        let kp = keys.as_mut_ptr();
        let gv = [
            _mm512_loadu_ps(gp),
            _mm512_loadu_ps(gp.add(16)),
            _mm512_loadu_ps(gp.add(32)),
            _mm512_loadu_ps(gp.add(48)),
        ];
        for (k, a) in acc.iter().enumerate() {
            let mu = _mm512_set1_ps(self.mean[d0 + k]);
            for (g, &x) in a.iter().enumerate() {
                _mm512_storeu_ps(
                    kp.add((d0 + k) * TILE + 16 * g),
                    _mm512_fmadd_ps(gv[g], x, mu),
                );
            }
        }
    }
}

/// The `vdpbf16ps` chains of channels `dims` (high pair member first, then the low one, each
/// rounded as an `fma`: the definition's chain), rows in lanes.
#[inline(always)]
unsafe fn bf16_sums<const N: usize>(
    d: usize,
    dims: [usize; N],
    pairs: usize,
    packed: &[u32],
    mb: &[u32],
) -> [[__m512; 4]; N] {
    let mut acc = [[_mm512_setzero_ps(); 4]; N];
    let (tp, mp) = (packed.as_ptr(), mb.as_ptr());
    for p in 0..pairs {
        let c: [__m512bh; 4] = std::array::from_fn(|g| {
            std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(
                tp.add(p * TILE + 16 * g) as *const _
            ))
        });
        for (a, &dd) in acc.iter_mut().zip(&dims) {
            let w: __m512bh = std::mem::transmute(_mm512_set1_epi32(*mp.add(p * d + dd) as i32));
            for (x, &cg) in a.iter_mut().zip(&c) {
                *x = _mm512_dpbf16_ps(*x, w, cg);
            }
        }
    }
    acc
}

/// Channels `d0 .. d` of [`Tile::synthesize_bf16`] with `vdpbf16ps`, in blocks of 4, then 1.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn synthesize_bf16_from(
    d: usize,
    d0: usize,
    pairs: usize,
    packed: &[u32],
    mb: &[u32],
    y: &Affine<'_>,
    keys: &mut [f32],
) {
    let mut d0 = d0;
    while d0 + 4 <= d {
        let acc = bf16_sums::<4>(d, std::array::from_fn(|k| d0 + k), pairs, packed, mb);
        y.store(d0, &acc, keys);
        d0 += 4;
    }
    while d0 < d {
        y.store(d0, &bf16_sums::<1>(d, [d0], pairs, packed, mb), keys);
        d0 += 1;
    }
}

/// Channels `dims` of [`Tile::synthesize_bf16_rotated`]: `dims[k]` and `dims[k + F]` are the
/// two channels of frequency `freqs[k]`; synthesised, scaled, shifted and rotated in registers
/// (the operations of [`rotate_tile`], in its order), then stored.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn synthesize_bf16_rot<const N: usize, const F: usize>(
    d: usize,
    dims: [usize; N],
    freqs: [usize; F],
    pairs: usize,
    packed: &[u32],
    mb: &[u32],
    y: &Affine<'_>,
    rot: &Rot<'_>,
    keys: &mut [f32],
) {
    let acc = bf16_sums::<N>(d, dims, pairs, packed, mb);
    let gp = y.g.as_ptr();
    let gv: [__m512; 4] = std::array::from_fn(|g| _mm512_loadu_ps(gp.add(16 * g)));
    let kp = keys.as_mut_ptr();
    for (k, &i) in freqs.iter().enumerate() {
        let (a, b) = (dims[k], dims[k + F]);
        let (mua, mub) = (_mm512_set1_ps(y.mean[a]), _mm512_set1_ps(y.mean[b]));
        let (cp, sp) = (
            rot.cos.as_ptr().add(rot.at(i)),
            rot.sin.as_ptr().add(rot.at(i)),
        );
        for g in 0..4 {
            let u = _mm512_fmadd_ps(gv[g], acc[k][g], mua);
            let v = _mm512_fmadd_ps(gv[g], acc[k + F][g], mub);
            let (c, sn) = (
                _mm512_loadu_ps(cp.add(16 * g)),
                _mm512_loadu_ps(sp.add(16 * g)),
            );
            let ya = _mm512_sub_ps(_mm512_mul_ps(u, c), _mm512_mul_ps(v, sn));
            let yb = _mm512_add_ps(_mm512_mul_ps(v, c), _mm512_mul_ps(u, sn));
            _mm512_storeu_ps(kp.add(a * TILE + 16 * g), ya);
            _mm512_storeu_ps(kp.add(b * TILE + 16 * g), yb);
        }
    }
}

/// A block of [`synthesize_bf16_from`] without AVX-512 BF16: each pair as two float32 `fma`s.
#[target_feature(enable = "avx512f,fma")]
unsafe fn synthesize_bf16_fma<const N: usize>(
    d: usize,
    d0: usize,
    pairs: usize,
    packed: &[u32],
    mb: &[u32],
    y: &Affine<'_>,
    keys: &mut [f32],
) {
    let mut acc = [[_mm512_setzero_ps(); 4]; N];
    let (tp, mp) = (packed.as_ptr(), mb.as_ptr());
    let high = _mm512_set1_epi32(0xffff_0000u32 as i32);
    for p in 0..pairs {
        let mut ch = [_mm512_setzero_ps(); 4];
        let mut cl = [_mm512_setzero_ps(); 4];
        for g in 0..4 {
            let w = _mm512_loadu_si512(tp.add(p * TILE + 16 * g) as *const _);
            ch[g] = _mm512_castsi512_ps(_mm512_and_si512(w, high));
            cl[g] = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(w));
        }
        for (k, a) in acc.iter_mut().enumerate() {
            let w = *mp.add(p * d + d0 + k);
            let (wh, wl) = (
                _mm512_set1_ps(bf16_half(w, true)),
                _mm512_set1_ps(bf16_half(w, false)),
            );
            for g in 0..4 {
                a[g] = _mm512_fmadd_ps(wh, ch[g], a[g]);
                a[g] = _mm512_fmadd_ps(wl, cl[g], a[g]);
            }
        }
    }
    y.store(d0, &acc, keys);
}

/// The unpacked indices of a tile looked up into `tile[j * 64 + t]`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn centroids(t: &StreamTables, bytes: &[u8], tile: &mut [f32]) {
    let slots = 8 * t.groups.len();
    let bp = bytes.as_ptr();
    let tp = tile.as_mut_ptr();
    for (j, c) in t.comps.iter().enumerate() {
        let tab = table(t, c);
        for rg in 0..4 {
            let v = look_up(c.lookup, &tab, bp.add((rg * slots + c.slot as usize) * 16));
            _mm512_storeu_ps(tp.add(j * TILE + 16 * rg), v);
        }
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
unsafe fn dot_rows<const N: usize>(
    t: &StreamTables,
    bytes: &[u8],
    w: &[f32],
    r0: usize,
    dot: &mut [f32],
) {
    let m = t.m;
    let slots = 8 * t.groups.len();
    let mut acc = [[_mm512_setzero_ps(); 4]; N];
    let wp = w.as_ptr().add(r0 * m);
    let bp = bytes.as_ptr();
    for (j, c) in t.comps.iter().enumerate() {
        let tab = table(t, c);
        for rg in 0..4 {
            let v = look_up(c.lookup, &tab, bp.add((rg * slots + c.slot as usize) * 16));
            for (rr, a) in acc.iter_mut().enumerate() {
                a[rg] = _mm512_fmadd_ps(_mm512_set1_ps(*wp.add(rr * m + j)), v, a[rg]);
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

#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
unsafe fn acc_rows<const N: usize>(
    t: &StreamTables,
    bytes: &[u8],
    pg: &[f32],
    r0: usize,
    acc: &mut [f32],
) {
    let m = t.m;
    let slots = 8 * t.groups.len();
    let pp = pg.as_ptr().add(r0 * TILE);
    let mut p = [[_mm512_setzero_ps(); 4]; N];
    for (rr, x) in p.iter_mut().enumerate() {
        for (k, v) in x.iter_mut().enumerate() {
            *v = _mm512_loadu_ps(pp.add(rr * TILE + 16 * k));
        }
    }
    let bp = bytes.as_ptr();
    let ap = acc.as_mut_ptr();
    for (j, c) in t.comps.iter().enumerate() {
        let tab = table(t, c);
        let mut v = [_mm512_setzero_ps(); 4];
        for (rg, x) in v.iter_mut().enumerate() {
            *x = look_up(c.lookup, &tab, bp.add((rg * slots + c.slot as usize) * 16));
        }
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

#[cfg(test)]
mod tests {
    use super::super::kernel::{bf16_pair, pack_tile, synthesize_bf16_tile};
    use super::*;
    use crate::rng::SplitMix64;

    /// Both BF16 syntheses (`vdpbf16ps` where the CPU has it, float32 `fma` pairs) against
    /// the definition, on values spread over the exponent range and around
    /// the floor (products near the smallest normal float32).
    #[test]
    fn bf16_synthesis_matches_the_definition() {
        if !available() {
            return;
        }
        let mut g = SplitMix64::new(7);
        let val = |g: &mut SplitMix64| {
            let e = (g.next_u64() % 140) as i32 - 70;
            let m = (g.next_u64() >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            m * 2f32.powi(e)
        };
        for (m, d) in [(1, 1), (7, 5), (56, 64), (33, 128)] {
            let tile: Vec<f32> = (0..m * TILE).map(|_| val(&mut g)).collect();
            let msyn: Vec<f32> = (0..m * d).map(|_| val(&mut g)).collect();
            let pairs = m.div_ceil(2);
            let at = |j: usize, i: usize| if j < m { msyn[j * d + i] } else { 0.0 };
            let mb: Vec<u32> = (0..pairs)
                .flat_map(|p| (0..d).map(move |i| (p, i)))
                .map(|(p, i)| bf16_pair(at(2 * p, i), at(2 * p + 1, i)))
                .collect();
            let mut want_p = vec![0u32; pairs * TILE];
            pack_tile(m, &tile, &mut want_p);
            let gs: [f32; TILE] = std::array::from_fn(|t| 0.5 + t as f32 / 64.0);
            let mean: Vec<f32> = (0..d).map(|i| i as f32 - 2.5).collect();
            let y = Affine {
                g: &gs,
                mean: &mean,
            };
            let mut want = vec![0f32; d * TILE];
            synthesize_bf16_tile(d, pairs, &want_p, &mb, &gs, &mean, &mut want);
            let mut fma = vec![0f32; d * TILE];
            unsafe {
                for d0 in 0..d {
                    synthesize_bf16_fma::<1>(d, d0, pairs, &want_p, &mb, &y, &mut fma);
                }
            }
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&fma), bits(&want), "fma pairs, m {m} d {d}");
            if has_bf16() {
                let mut dp = vec![0f32; d * TILE];
                Avx512.synthesize_bf16(d, pairs, &want_p, &mb, &gs, &mean, &mut dp);
                assert_eq!(bits(&dp), bits(&want), "vdpbf16ps, m {m} d {d}");
            }
        }
    }
}
