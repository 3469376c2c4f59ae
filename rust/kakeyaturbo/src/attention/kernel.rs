//! The inner loops over one tile of 64 rows, in three implementations that compute the same
//! bits: [`Portable`] (plain Rust, the definition) and, on x86_64 CPUs with AVX-512
//! (F, BW, VL, VBMI2), [`super::avx512::Avx512`], or with AVX2, FMA and F16C only,
//! [`super::avx2::Avx2`]. Both follow one fixed order of IEEE
//! operations (`mod.rs`, "Arithmetic"), so results never depend on the instruction set.
//!
//! Layouts: per query row `r`, scores and weights are `[r * 64 + t]`; the lane-wise
//! code-domain sums are `acc[(r * m + j) * 16 + l]`, lane `l` holding rows `t = l mod 16` of
//! every tile. Rows past a tile's count read as component `j`'s centroid 0 with scale 0.

use super::rope::RopeStyle;
use super::store::{LayerCodes, SealedBlock};
use super::tables::StreamTables;

/// Rows per tile.
pub const TILE: usize = 64;

/// Per-piece scratch of the tile operations, sized for the larger of two calibrations.
pub(crate) struct Scratch {
    pub tile: Vec<f32>,
    pub words: Vec<u32>,
    pub bytes: Vec<u8>,
    /// The pieces' own buffers (scores, visibility, sums), reused between them.
    pub scores: Vec<f32>,
    /// Latent attention: the scores of the V stream (the rotated key part).
    pub scores2: Vec<f32>,
    pub add: Vec<f32>,
    pub acc: Vec<f32>,
    /// Synthesised keys of a tile, transposed (`D_k x 64`), and the cos/sin of its rows
    /// (keys coded before RoPE).
    pub keys: Vec<f32>,
    pub trig: Vec<f32>,
    /// The (flat index of the first row, rows) whose cos/sin `trig` holds.
    pub trig_at: Option<(usize, usize)>,
    /// The tile's centroids rounded to bfloat16, pairs of components packed (`[p * 64 + t]`).
    pub packed: Vec<u32>,
}

impl Scratch {
    /// Scratch for every calibration of a layer (one per worker thread, reused by its pieces).
    pub fn for_layer(codes: &LayerCodes) -> Self {
        Self::for_tables(
            (0..codes.kv_heads())
                .flat_map(|i| [&**codes.k_store(i).tables(), &**codes.v_store(i).tables()]),
        )
    }

    /// Scratch for the calibrations `tables`.
    pub fn for_tables<'a>(tables: impl IntoIterator<Item = &'a StreamTables>) -> Self {
        let (mut m, mut words, mut slots) = (0, 0, 0);
        for t in tables {
            m = m.max(t.m);
            words = words.max(t.words + 1);
            slots = slots.max(8 * t.groups.len());
        }
        Self {
            tile: vec![0f32; m * TILE],
            words: vec![0u32; words],
            bytes: vec![0u8; slots * TILE],
            scores: Vec::new(),
            scores2: Vec::new(),
            add: Vec::new(),
            acc: Vec::new(),
            keys: Vec::new(),
            trig: Vec::new(),
            trig_at: None,
            packed: Vec::new(),
        }
    }
}

/// `v` as `n` zeros, keeping its allocation.
pub(crate) fn zeroed(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    v.clear();
    v.resize(n, 0.0);
    v
}

/// The per-tile operations an instruction set provides. Rows `row0 .. row0 + rows` of a
/// block (`1 <= rows <= 64`); row `t` of the tile is lane `t`.
pub(crate) trait Tile: Copy + Send + Sync {
    /// The rows' scales into `g` (0 past `rows`).
    fn scales(self, b: &SealedBlock, row0: usize, rows: usize, g: &mut [f32; TILE]);
    /// `dot[r * 64 + t] = sum_j w[r * m + j] c_tj`, a fused multiply-add chain over `j` from 0,
    /// for `qr` query rows (`c_tj` = component `j`'s centroid 0 past `rows`).
    #[allow(clippy::too_many_arguments)]
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
    );
    /// The rows' centroids, component-major: `s.tile[j * 64 + t]` (`t >= rows`: centroid 0).
    fn centroids(
        self,
        t: &StreamTables,
        b: &SealedBlock,
        row0: usize,
        rows: usize,
        s: &mut Scratch,
    );
    /// `keys[d * 64 + t]` = the `fma` chain over `j` from 0 of `msyn[j * D + d] * tile[j * 64 + t]`.
    #[inline(always)]
    fn synthesize(self, d: usize, m: usize, tile: &[f32], msyn: &[f32], keys: &mut [f32]) {
        synthesize_tile(d, m, tile, msyn, keys)
    }
    /// [`Tile::centroids`], then [`pack_tile`] into `s.packed` (sized by the caller): the
    /// same bits, without the float32 tile where an implementation can round as it looks up.
    #[inline(always)]
    fn centroids_bf16(
        self,
        t: &StreamTables,
        b: &SealedBlock,
        row0: usize,
        rows: usize,
        s: &mut Scratch,
    ) {
        self.centroids(t, b, row0, rows, s);
        pack_tile(t.m, &s.tile, &mut s.packed);
    }
    /// `keys[d * 64 + t] = fma(g_t, x_dt, mean_d)`, `x_dt` = over the pairs `p` in order,
    /// `fma(M_(2p+1)d, c_(2p+1)t, acc)` then `fma(M_(2p)d, c_(2p)t, acc)`, from 0 (`mb` =
    /// [`StreamTables::key_synthesis_bf16`]).
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
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
        synthesize_bf16_tile(d, pairs, packed, mb, g, mean, keys)
    }
    /// [`Tile::synthesize_bf16`], then [`rotate_tile`] with `rot`: the same bits, in one pass
    /// where an implementation can hold a pair's two channels at once.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
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
        self.synthesize_bf16(d, pairs, packed, mb, g, mean, keys);
        rotate_tile(rot, keys);
    }
    /// [`Tile::centroids`], then [`super::fixed::pack_tile`] into `s.packed` (sized by the
    /// caller): the 16-bit fixed-point pairs of [`super::Synthesis::I16`].
    #[inline(always)]
    fn centroids_i16(
        self,
        t: &StreamTables,
        b: &SealedBlock,
        row0: usize,
        rows: usize,
        s: &mut Scratch,
    ) {
        self.centroids(t, b, row0, rows, s);
        super::fixed::pack_tile(t.m, &s.tile, &mut s.packed);
    }
    /// [`super::fixed::synthesize_tile`] (`f` = [`StreamTables::key_synthesis_i16`]), then
    /// [`rotate_tile`] with `rot`.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn synthesize_i16_rotated(
        self,
        d: usize,
        pairs: usize,
        packed: &[u32],
        f: &super::fixed::FixedSynthesis,
        g: &[f32; TILE],
        mean: &[f32],
        rot: &Rot<'_>,
        keys: &mut [f32],
    ) {
        super::fixed::synthesize_tile(d, pairs, packed, &f.words, &f.unit, g, mean, keys);
        rotate_tile(rot, keys);
    }
    /// `s[r * 64 + t]` = the `fma` chain over `d` from 0 of `qs[r * D + d] * keys[d * 64 + t]`
    /// for the `qr` query rows ([`dots_tile`]).
    #[inline(always)]
    fn dots(self, qs: &[f32], d: usize, qr: usize, keys: &[f32], s: &mut [f32]) {
        dots_tile(qs, d, qr, keys, s)
    }
    /// `sums[i]` = [`super::math::hsum16`] of `acc[16 i .. 16 i + 16]` (the same tree of
    /// additions).
    #[inline(always)]
    fn lane_sums(self, acc: &[f32], sums: &mut [f32]) {
        for (dst, lanes) in sums.iter_mut().zip(acc.chunks_exact(16)) {
            *dst = super::math::hsum16(lanes.try_into().expect("16 lanes"));
        }
    }
    /// `acc[(r * m + j) * 16 + l] = fma(pg[r * 64 + 16 k + l], c_(16k+l)j, acc)` for
    /// `k = 0..4` in order.
    #[allow(clippy::too_many_arguments)]
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
    );
}

/// The definition, in plain Rust.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Portable;

impl Portable {
    /// The centroids of the rows, component-major: `tile[j * 64 + t]`.
    #[inline(always)]
    fn decode(t: &StreamTables, b: &SealedBlock, row0: usize, rows: usize, s: &mut Scratch) {
        let rb = t.row_bytes;
        let words = &mut s.words[..t.words + 1];
        words.fill(0);
        let tile = &mut s.tile;
        for r in 0..TILE {
            if r < rows {
                let row = b.row(row0 + r, rb);
                for (w, chunk) in words.iter_mut().zip(row.chunks(4)) {
                    let mut le = [0u8; 4];
                    le[..chunk.len()].copy_from_slice(chunk);
                    *w = u32::from_le_bytes(le);
                }
                for (j, c) in t.comps.iter().enumerate() {
                    let w = c.word as usize;
                    let pair = words[w] as u64 | (words[w + 1] as u64) << 32;
                    let code = (pair >> c.shift) as u32 & c.mask;
                    tile[j * TILE + r] = t.lut[(c.table + code) as usize];
                }
            } else {
                for (j, c) in t.comps.iter().enumerate() {
                    tile[j * TILE + r] = t.lut[c.table as usize];
                }
            }
        }
    }
}

impl Tile for Portable {
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
    fn scales(self, b: &SealedBlock, row0: usize, rows: usize, g: &mut [f32; TILE]) {
        for (r, x) in g.iter_mut().enumerate() {
            *x = if r < rows { b.scale(row0 + r) } else { 0.0 };
        }
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
        dots_tile(w, t.m, qr, &s.tile, dot);
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
        acc_tile(t.m, &s.tile, pg, qr, acc);
    }
}

/// The definition of [`Tile::dots`], and of [`Tile::dot`] from the tile's centroids (`qs` the
/// weights `w`, `d` the components, `keys` the tile): up to 4 query rows at a time.
#[inline(always)]
pub(crate) fn dots_tile(qs: &[f32], d: usize, qr: usize, keys: &[f32], s: &mut [f32]) {
    let mut r0 = 0;
    while r0 < qr {
        match qr - r0 {
            1 => dots_rows::<1>(qs, d, r0, keys, s),
            2 => dots_rows::<2>(qs, d, r0, keys, s),
            3 => dots_rows::<3>(qs, d, r0, keys, s),
            _ => dots_rows::<4>(qs, d, r0, keys, s),
        }
        r0 += (qr - r0).min(4);
    }
}

/// [`dots_tile`] of query rows `r0 .. r0 + R`.
#[inline(always)]
fn dots_rows<const R: usize>(qs: &[f32], d: usize, r0: usize, keys: &[f32], s: &mut [f32]) {
    let mut acc = [[0f32; TILE]; R];
    let qrows: [&[f32]; R] = std::array::from_fn(|r| &qs[(r0 + r) * d..(r0 + r + 1) * d]);
    for (dd, x) in keys[..d * TILE].chunks_exact(TILE).enumerate() {
        let x: &[f32; TILE] = x.try_into().expect("a tile");
        for (a, q) in acc.iter_mut().zip(&qrows) {
            let q = q[dd];
            for t in 0..TILE {
                a[t] = q.mul_add(x[t], a[t]);
            }
        }
    }
    for (r, a) in acc.iter().enumerate() {
        s[(r0 + r) * TILE..(r0 + r + 1) * TILE].copy_from_slice(a);
    }
}

/// The definition of [`Tile::accumulate`] from the tile's centroids (`tile[j * 64 + t]`).
#[inline(always)]
pub(crate) fn acc_tile(m: usize, tile: &[f32], pg: &[f32], qr: usize, acc: &mut [f32]) {
    for r in 0..qr {
        let p = &pg[r * TILE..(r + 1) * TILE];
        for j in 0..m {
            let a = &mut acc[(r * m + j) * 16..(r * m + j + 1) * 16];
            let v = &tile[j * TILE..(j + 1) * TILE];
            for k in 0..4 {
                for l in 0..16 {
                    a[l] = p[16 * k + l].mul_add(v[16 * k + l], a[l]);
                }
            }
        }
    }
}

/// Component `j` of row `r` of a block: its centroid (for the outlier corrections).
#[inline]
pub(crate) fn centroid_at(t: &StreamTables, b: &SealedBlock, r: usize, j: usize) -> f32 {
    let c = &t.comps[j];
    let row = b.row(r, t.row_bytes);
    let at = 4 * c.word as usize;
    let mut le = [0u8; 8];
    let end = (at + 8).min(row.len());
    le[..end - at].copy_from_slice(&row[at..end]);
    let code = (u64::from_le_bytes(le) >> c.shift) as u32 & c.mask;
    t.centroid(j, code)
}

/// Magnitudes below `2^-56` (this float32 bit pattern without its sign) round to +0 in
/// [`bf16_round`]: every nonzero product of two rounded values is then a multiple of
/// `2^-126`, and so is every sum of them, so no value of a synthesis is subnormal and the
/// flush-to-zero of AVX-512 BF16's dot product never acts.
pub(crate) const BF16_FLOOR: u32 = 0x2380_0000;

/// `x` rounded to bfloat16 (to nearest, ties to even; +0 below `2^-56`): the upper 16 bits
/// of the float32 it stands for, in the low half.
#[inline(always)]
pub(crate) fn bf16_round(x: f32) -> u32 {
    let b = x.to_bits();
    if b & 0x7fff_ffff < BF16_FLOOR {
        0
    } else {
        b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16
    }
}

/// `a` (low half) and `b` (high half) rounded to bfloat16 in one word.
#[inline(always)]
pub(crate) fn bf16_pair(a: f32, b: f32) -> u32 {
    bf16_round(a) | bf16_round(b) << 16
}

/// The low (`hi = false`) or high bfloat16 of a packed word, as float32.
#[inline(always)]
pub(crate) fn bf16_half(w: u32, hi: bool) -> f32 {
    f32::from_bits(if hi { w & 0xffff_0000 } else { w << 16 })
}

/// The definition of [`Tile::centroids_bf16`]'s packing (bfloat16 pairs, `[p * 64 + t]`).
#[inline(always)]
pub(crate) fn pack_tile(m: usize, tile: &[f32], packed: &mut [u32]) {
    for p in 0..m.div_ceil(2) {
        for t in 0..TILE {
            let a = tile[2 * p * TILE + t];
            let b = if 2 * p + 1 < m {
                tile[(2 * p + 1) * TILE + t]
            } else {
                0.0
            };
            packed[p * TILE + t] = bf16_pair(a, b);
        }
    }
}

/// The definition of [`Tile::synthesize_bf16`]: per pair of components the high one's `fma`,
/// then the low one's (the order of AVX-512 BF16's `vdpbf16ps`); then scale and mean.
#[inline(always)]
pub(crate) fn synthesize_bf16_tile(
    d: usize,
    pairs: usize,
    packed: &[u32],
    mb: &[u32],
    g: &[f32; TILE],
    mean: &[f32],
    keys: &mut [f32],
) {
    for dd in 0..d {
        let mut acc = [0f32; TILE];
        for p in 0..pairs {
            let w = mb[p * d + dd];
            let (wh, wl) = (bf16_half(w, true), bf16_half(w, false));
            for (a, &c) in acc.iter_mut().zip(&packed[p * TILE..(p + 1) * TILE]) {
                *a = wh.mul_add(bf16_half(c, true), *a);
                *a = wl.mul_add(bf16_half(c, false), *a);
            }
        }
        for ((o, &a), &gt) in keys[dd * TILE..(dd + 1) * TILE].iter_mut().zip(&acc).zip(g) {
            *o = gt.mul_add(a, mean[dd]);
        }
    }
}

/// The rotation of one tile of keys: frequency `i` turns channels `pair(i)` by the angle whose
/// cos and sin for the tile's rows are `cos[at(i) .. at(i) + 64]` and `sin[..]`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Rot<'a> {
    pub cos: &'a [f32],
    pub sin: &'a [f32],
    /// Where frequency `i`'s run starts: `i * stride + offset`.
    pub stride: usize,
    pub offset: usize,
    /// Rotated frequencies (`rot / 2`).
    pub half: usize,
    pub style: RopeStyle,
}

impl Rot<'_> {
    #[inline(always)]
    pub fn at(&self, i: usize) -> usize {
        i * self.stride + self.offset
    }

    /// The channels of frequency `i`.
    #[inline(always)]
    pub fn pair(&self, i: usize) -> (usize, usize) {
        match self.style {
            RopeStyle::Half => (i, i + self.half),
            RopeStyle::Interleaved => (2 * i, 2 * i + 1),
        }
    }
}

/// The rotation of a tile of keys (`keys[d * 64 + t]`), per frequency `i` and row `t`:
/// `y_a' = y_a cos + (-y_b) sin`, `y_b' = y_b cos + y_a sin` (each product rounded, then the
/// sum).
#[inline(always)]
pub(crate) fn rotate_tile(rot: &Rot<'_>, keys: &mut [f32]) {
    for i in 0..rot.half {
        let (a, b) = rot.pair(i);
        let (lo, hi) = keys.split_at_mut(b * TILE);
        let (xa, xb) = (&mut lo[a * TILE..(a + 1) * TILE], &mut hi[..TILE]);
        let at = rot.at(i);
        let (c, sn) = (&rot.cos[at..at + TILE], &rot.sin[at..at + TILE]);
        for t in 0..TILE {
            let (u, v) = (xa[t], xb[t]);
            xa[t] = u * c[t] + (-v) * sn[t];
            xb[t] = v * c[t] + u * sn[t];
        }
    }
}

/// Dimensions per block of [`synthesize_tile`].
const DB: usize = 4;

/// The definition of [`Tile::synthesize`], in blocks of [`DB`] dimensions.
#[inline(always)]
pub(crate) fn synthesize_tile(d: usize, m: usize, tile: &[f32], msyn: &[f32], keys: &mut [f32]) {
    let mut d0 = 0;
    while d0 + DB <= d {
        let mut acc = [[0f32; TILE]; DB];
        for j in 0..m {
            let c: &[f32; TILE] = tile[j * TILE..(j + 1) * TILE].try_into().expect("a tile");
            let w: &[f32; DB] = msyn[j * d + d0..j * d + d0 + DB]
                .try_into()
                .expect("DB values");
            for k in 0..DB {
                for t in 0..TILE {
                    acc[k][t] = w[k].mul_add(c[t], acc[k][t]);
                }
            }
        }
        for (k, a) in acc.iter().enumerate() {
            keys[(d0 + k) * TILE..(d0 + k + 1) * TILE].copy_from_slice(a);
        }
        d0 += DB;
    }
    for dd in d0..d {
        let x = &mut keys[dd * TILE..(dd + 1) * TILE];
        x.fill(0.0);
        for j in 0..m {
            let w = msyn[j * d + dd];
            for (o, &c) in x.iter_mut().zip(&tile[j * TILE..(j + 1) * TILE]) {
                *o = w.mul_add(c, *o);
            }
        }
    }
}

#[cfg(test)]
#[path = "kernel_testutil.rs"]
pub(crate) mod testutil;
