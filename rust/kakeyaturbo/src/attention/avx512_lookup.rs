//! The index bytes of a tile's rows unpacked to components-by-rows (the module's
//! "Unpacking"), and the centroids looked up from them: into a float32 tile, or straight into
//! the fused multiply-adds of the scores and of the value sums.

use super::super::kernel::{Scratch, TILE};
use super::super::store::SealedBlock;
use super::super::tables::{Component, Lookup, StreamTables};
use std::arch::x86_64::*;

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
pub(super) unsafe fn unpack(
    t: &StreamTables,
    b: &SealedBlock,
    row0: usize,
    rows: usize,
    s: &mut Scratch,
) {
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

/// The unpacked indices of a tile looked up into `tile[j * 64 + t]`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
pub(super) unsafe fn centroids(t: &StreamTables, bytes: &[u8], tile: &mut [f32]) {
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
pub(super) unsafe fn dot_rows<const N: usize>(
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
pub(super) unsafe fn acc_rows<const N: usize>(
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
