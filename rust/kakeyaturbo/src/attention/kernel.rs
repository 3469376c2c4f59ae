//! The inner loops over one tile of 64 rows, in two implementations that compute the same
//! bits: [`Portable`] (plain Rust, the definition) and, on x86_64 CPUs with AVX-512
//! (F, BW, VL, VBMI2), [`super::avx512::Avx512`]. Both follow one fixed order of IEEE
//! operations (`mod.rs`, "Arithmetic"), so results never depend on the instruction set.
//!
//! Layouts: a decoded tile is component-major, `tile[j * 64 + t]` = the centroid of component
//! `j` of row `t` (rows past the tile's count hold component `j`'s centroid 0 and scale 0);
//! per query row `r`, scores and weights are `[r * 64 + t]`; the lane-wise code-domain sums
//! are `acc[(r * m + j) * 16 + l]`, lane `l` holding rows `t = l mod 16` of every tile.

use super::store::SealedBlock;
use super::tables::StreamTables;

/// Rows per tile.
pub const TILE: usize = 64;

/// The per-tile operations an instruction set provides.
pub(crate) trait Tile: Copy + Send + Sync {
    /// Decodes rows `row0 .. row0 + rows` (`rows <= 64`) of a block: centroids into `tile`
    /// (`m * 64`), scales into `g` (0 past `rows`); `words` is scratch of at least
    /// `16 * (t.words + 1)` entries.
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
    );
    /// `dot[r * 64 + t] = sum_j w[r * m + j] tile[j * 64 + t]`, a fused multiply-add chain
    /// over `j` from 0, for `qr` query rows.
    fn dot(self, tile: &[f32], m: usize, w: &[f32], qr: usize, dot: &mut [f32]);
    /// `acc[(r * m + j) * 16 + l] = fma(pg[r * 64 + 16 k + l], tile[j * 64 + 16 k + l], acc)`
    /// for `k = 0..4` in order.
    fn accumulate(self, tile: &[f32], m: usize, pg: &[f32], qr: usize, acc: &mut [f32]);
}

/// The definition, in plain Rust.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Portable;

impl Tile for Portable {
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
        let rb = t.row_bytes;
        let words = &mut words[..t.words + 1];
        words.fill(0);
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
                g[r] = b.scale(row0 + r);
            } else {
                for (j, c) in t.comps.iter().enumerate() {
                    tile[j * TILE + r] = t.lut[c.table as usize];
                }
                g[r] = 0.0;
            }
        }
    }

    #[inline(always)]
    fn dot(self, tile: &[f32], m: usize, w: &[f32], qr: usize, dot: &mut [f32]) {
        for r in 0..qr {
            let d = &mut dot[r * TILE..(r + 1) * TILE];
            d.fill(0.0);
            for j in 0..m {
                let wj = w[r * m + j];
                for (o, &v) in d.iter_mut().zip(&tile[j * TILE..(j + 1) * TILE]) {
                    *o = wj.mul_add(v, *o);
                }
            }
        }
    }

    #[inline(always)]
    fn accumulate(self, tile: &[f32], m: usize, pg: &[f32], qr: usize, acc: &mut [f32]) {
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
