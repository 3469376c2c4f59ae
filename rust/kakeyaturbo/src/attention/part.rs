//! One piece of work of an attention call (`attend.rs`): the online softmax over its tiles of
//! sealed codes (scores from the codes, or from keys synthesised and rotated per tile for keys
//! coded before RoPE; the value sums in the code domain) or over its raw rows.

use super::kernel::{bf16_round, centroid_at, rotate_tile, zeroed, Rot, Scratch, Tile, TILE};
use super::math::{exp_neg, hsum16, tanh, tile_sum};
use super::rope::{KeyRope, Synthesis};
use super::store::{CodeStore, LayerCodes, SealedBlock};
use super::tables::StreamTables;

/// Raw rows of K and V for every (batch row, kv-head): `k` is `[B, H_kv, rows, D_k]`, `v`
/// `[B, H_kv, rows, D_v]`, row-major float32.
#[derive(Debug, Clone, Copy)]
pub struct RawRows<'a> {
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub rows: usize,
}

impl RawRows<'_> {
    pub const EMPTY: RawRows<'static> = RawRows {
        k: &[],
        v: &[],
        rows: 0,
    };
}

/// The checked inputs of one call.
pub(super) struct Ctx<'a> {
    pub(super) codes: &'a LayerCodes,
    pub(super) q: &'a [f32],
    pub(super) sink: RawRows<'a>,
    pub(super) tail: RawRows<'a>,
    pub(super) mask: Option<&'a [f32]>,
    pub(super) rope: Option<KeyRope<'a>>,
    pub(super) scale: f32,
    pub(super) softcap: Option<f32>,
    pub(super) window: Option<usize>,
    pub(super) batch: usize,
    pub(super) kv_heads: usize,
    pub(super) q_heads: usize,
    pub(super) group: usize,
    pub(super) n_q: usize,
    pub(super) dk: usize,
    pub(super) dv: usize,
    /// Latent attention ([`super::AttentionParams::latent`]): both streams score, the K stream is summed.
    pub(super) latent: bool,
    /// The width of a query row (`D_k`, or `D_k + D_v` for latent attention) and of an output
    /// row (`D_v`, or `D_k`).
    pub(super) dq: usize,
    pub(super) dout: usize,
    pub(super) sealed: usize,
    pub(super) total: usize,
}

/// The queries of one (batch row, kv-head) moved into each domain: `qs` scaled (`qr x D_q`),
/// `w` and `qm` the code-domain weights and `q . mean` of each query row (`r = g * n_q + i`);
/// for latent attention `w2` and `qm2` the same for the V stream (else empty).
pub(super) struct Prep {
    pub(super) qs: Vec<f32>,
    pub(super) w: Vec<f32>,
    pub(super) qm: Vec<f32>,
    pub(super) w2: Vec<f32>,
    pub(super) qm2: Vec<f32>,
}

#[derive(Debug, Clone, Copy)]
pub(super) enum Source {
    Sink,
    Tail,
}

/// The partial softmax of one piece: per query row its running maximum, denominator and
/// weighted sum (`m` code-domain values, or `D_v` raw ones).
#[derive(Debug)]
pub(super) struct Part {
    pub(super) code: bool,
    /// A score was NaN or `+inf` (float32 overflow).
    pub(super) overflow: bool,
    pub(super) mx: Vec<f32>,
    pub(super) l: Vec<f32>,
    pub(super) acc: Vec<f32>,
}

impl<'a> Ctx<'a> {
    pub(super) fn qr(&self) -> usize {
        self.group * self.n_q
    }

    /// The stream whose rows are summed: V, or K for latent attention.
    pub(super) fn value_store(&self, bh: usize) -> &'a CodeStore {
        if self.latent {
            self.codes.k_store(bh)
        } else {
            self.codes.v_store(bh)
        }
    }

    /// `add[i * 64 + t]`: 0 or the mask where query token `i` sees position `pos0 + t`
    /// (`t < rows`), else `-inf`. Returns whether any position is seen.
    pub(super) fn visibility(&self, b: usize, pos0: usize, rows: usize, add: &mut [f32]) -> bool {
        let mut any = false;
        for i in 0..self.n_q {
            let qp = self.total - self.n_q + i;
            let row = &mut add[i * TILE..(i + 1) * TILE];
            for (t, a) in row.iter_mut().enumerate() {
                let pos = pos0 + t;
                let seen = t < rows && pos <= qp && self.window.is_none_or(|w| qp - pos < w);
                *a = if seen {
                    self.mask
                        .map_or(0.0, |m| m[(b * self.n_q + i) * self.total + pos])
                } else {
                    f32::NEG_INFINITY
                };
                any |= *a != f32::NEG_INFINITY;
            }
        }
        any
    }

    /// Softcap and mask on raw scores `s` (`qr x 64`).
    #[inline(always)]
    pub(super) fn finish_scores(&self, s: &mut [f32], add: &[f32]) {
        for r in 0..self.qr() {
            let i = r % self.n_q;
            let row = &mut s[r * TILE..(r + 1) * TILE];
            if let Some(c) = self.softcap {
                for v in row.iter_mut() {
                    *v = c * tanh(*v / c);
                }
            }
            for (v, &a) in row.iter_mut().zip(&add[i * TILE..(i + 1) * TILE]) {
                *v += a;
            }
        }
    }
}

/// The online-softmax update of query row `r` with the tile's final scores `s` (64):
/// returns the factor its sums must be multiplied by (1: unchanged), or None when the tile
/// shows it nothing; `s` becomes the weights `p`. Sets `overflow` when a score is NaN or
/// `+inf`.
#[inline(always)]
fn softmax_update(s: &mut [f32], mx: &mut f32, l: &mut f32, overflow: &mut bool) -> Option<f32> {
    // Lane-wise over the four groups of 16, then across the lanes: `max` is exact and skips
    // NaN, so this is the largest non-NaN score (or -inf) in any order; written so that it
    // vectorises (a fold over the 64 scores is a chain of scalar comparisons).
    let s: &mut [f32; TILE] = s.try_into().expect("a tile of scores");
    let (mut lanes, mut bad) = ([f32::NEG_INFINITY; 16], [false; 16]);
    for group in s.chunks_exact(16) {
        for ((m, b), &v) in lanes.iter_mut().zip(&mut bad).zip(group) {
            *m = m.max(v);
            *b |= v.is_nan() | (v == f32::INFINITY);
        }
    }
    *overflow |= bad.iter().any(|&b| b);
    let mut h = 8;
    while h > 0 {
        for l in 0..h {
            lanes[l] = lanes[l].max(lanes[l + h]);
        }
        h /= 2;
    }
    let top = lanes[0];
    if top == f32::NEG_INFINITY {
        s.fill(0.0);
        return None;
    }
    let new = mx.max(top);
    let alpha = exp_neg(*mx - new);
    for v in s.iter_mut() {
        *v = exp_neg(*v - new);
    }
    *l = l.mul_add(alpha, tile_sum(&s[..]));
    *mx = new;
    Some(alpha)
}

/// Where the outliers of the next tile of a stream start: the tiles of a piece run in
/// order, so a tile that begins where the last one read ended (same block) continues from
/// the outlier after the last one it read, and the binary search runs once per block.
#[derive(Debug, Clone, Copy, Default)]
struct Cursor(Option<(usize, usize, usize)>);

impl Cursor {
    /// Calls `f(row, j, value)` for each outlier of rows `row0 .. row0 + rows` of block `b`
    /// (number `bi`, `m` components per row), in order, and remembers where the next tile
    /// continues.
    #[inline(always)]
    fn each(
        &mut self,
        b: &SealedBlock,
        bi: usize,
        row0: usize,
        rows: usize,
        m: usize,
        mut f: impl FnMut(usize, usize, f32),
    ) {
        let hi = ((row0 + rows) * m) as u32;
        let mut o = match self.0 {
            Some((block, row, next)) if block == bi && row == row0 => next,
            _ => b.first_outlier_from((row0 * m) as u32),
        };
        while o < b.outliers {
            let (pos, val) = b.outlier(o);
            if pos >= hi {
                break;
            }
            o += 1;
            f(pos as usize / m, pos as usize % m, val);
        }
        self.0 = Some((bi, row0 + rows, o));
    }
}

#[inline(always)]
pub(super) fn code_part<K: Tile>(
    k: K,
    cx: &Ctx<'_>,
    prep: &Prep,
    bh: usize,
    tiles: &[(usize, usize, usize, usize)],
    scratch: &mut Scratch,
) -> Part {
    let (ks, vs) = (cx.codes.k_store(bh), cx.codes.v_store(bh));
    let (kt, vt) = (ks.tables(), vs.tables());
    // The stream summed: V, or K for latent attention (whose V stream scores beside K).
    let ss = cx.value_store(bh);
    let st = ss.tables();
    let (mk, ms, qr) = (kt.m, st.m, cx.qr());
    let b = bh / cx.kv_heads;
    let (mut gk, mut gv) = ([0f32; TILE], [0f32; TILE]);
    let mut s = std::mem::take(&mut scratch.scores);
    let mut s2 = std::mem::take(&mut scratch.scores2);
    let mut add = std::mem::take(&mut scratch.add);
    let mut acc = std::mem::take(&mut scratch.acc);
    zeroed(&mut s, qr * TILE);
    if cx.latent {
        zeroed(&mut s2, qr * TILE);
    }
    zeroed(&mut add, cx.n_q * TILE);
    zeroed(&mut acc, qr * ms * 16);
    let mut mx = vec![f32::NEG_INFINITY; qr];
    let mut l = vec![0f32; qr];
    let mut overflow = false;
    let (mut kcur, mut vcur) = (Cursor::default(), Cursor::default());
    // Latent attention reads the V stream's outliers for the scores and the K stream's twice.
    let mut scur = Cursor::default();
    for &(bi, row0, rows, pos0) in tiles {
        if !cx.visibility(b, pos0, rows, &mut add) {
            continue;
        }
        let (kb, vb) = (&ks.blocks()[bi], &vs.blocks()[bi]);
        k.scales(kb, row0, rows, &mut gk);
        if cx.latent {
            k.scales(vb, row0, rows, &mut gv);
        }
        if let Some(kr) = &cx.rope {
            // The rows' centroids (rounded to bfloat16 pairs for that synthesis), each
            // outlier's value in its place.
            let bf16 = kr.synthesis == Synthesis::Bf16;
            if bf16 {
                // Every word is written before it is read.
                scratch.packed.resize(mk.div_ceil(2) * TILE, 0);
                k.centroids_bf16(kt, kb, row0, rows, scratch);
            } else {
                k.centroids(kt, kb, row0, rows, scratch);
            }
            kcur.each(kb, bi, row0, rows, mk, |row, j, val| {
                if bf16 {
                    let w = &mut scratch.packed[(j / 2) * TILE + row - row0];
                    *w = if j % 2 == 0 {
                        (*w & 0xffff_0000) | bf16_round(val)
                    } else {
                        (*w & 0xffff) | bf16_round(val) << 16
                    };
                } else {
                    scratch.tile[j * TILE + row - row0] = val;
                }
            });
            let first = b * cx.sealed + pos0 - cx.sink.rows;
            rope_scores(k, cx, prep, kt, kr, first, rows, &gk, &mut s, scratch);
        } else {
            let (w, qm) = (&prep.w[..], &prep.qm[..]);
            stream_scores(
                k,
                kt,
                kb,
                (bi, row0, rows),
                w,
                qm,
                &gk,
                &mut kcur,
                &mut s,
                scratch,
            );
            if cx.latent {
                // The rotated key part's scores, from the V stream's codes, added.
                let (w, qm) = (&prep.w2[..], &prep.qm2[..]);
                stream_scores(
                    k,
                    vt,
                    vb,
                    (bi, row0, rows),
                    w,
                    qm,
                    &gv,
                    &mut vcur,
                    &mut s2,
                    scratch,
                );
                for (v, &x) in s[..qr * TILE].iter_mut().zip(&s2[..qr * TILE]) {
                    *v += x;
                }
            }
        }
        cx.finish_scores(&mut s, &add);
        let mut any = false;
        for r in 0..qr {
            let row = &mut s[r * TILE..(r + 1) * TILE];
            if let Some(alpha) = softmax_update(row, &mut mx[r], &mut l[r], &mut overflow) {
                any = true;
                if alpha != 1.0 {
                    for v in &mut acc[r * ms * 16..(r + 1) * ms * 16] {
                        *v *= alpha;
                    }
                }
            }
        }
        if !any {
            continue;
        }
        let (sb, gs, cur) = if cx.latent {
            (kb, &gk, &mut scur)
        } else {
            k.scales(vb, row0, rows, &mut gv);
            (vb, &gv, &mut vcur)
        };
        for r in 0..qr {
            for (v, &g) in s[r * TILE..(r + 1) * TILE].iter_mut().zip(gs) {
                *v *= g;
            }
        }
        k.accumulate(st, sb, row0, rows, &s, qr, &mut acc, scratch);
        cur.each(sb, bi, row0, rows, ms, |row, j, val| {
            let diff = val - centroid_at(st, sb, row, j);
            let t = row - row0;
            for r in 0..qr {
                let a = &mut acc[(r * ms + j) * 16 + t % 16];
                *a = s[r * TILE + t].mul_add(diff, *a);
            }
        });
    }
    let mut sums = vec![0f32; qr * ms];
    k.lane_sums(&acc, &mut sums);
    (scratch.scores, scratch.scores2, scratch.add, scratch.acc) = (s, s2, add, acc);
    Part {
        code: true,
        overflow,
        mx,
        l,
        acc: sums,
    }
}

/// `s[r * 64 + t] = fma(g_t, dot_rt, qm_r)` for the `qm.len()` query rows: a tile's scores
/// from one stream's codes (rows `row0 .. row0 + rows` of block `bi`, `b`), each outlier's
/// difference from its centroid added to the dot product (mod.rs, "Arithmetic").
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn stream_scores<K: Tile>(
    k: K,
    t: &StreamTables,
    b: &SealedBlock,
    (bi, row0, rows): (usize, usize, usize),
    w: &[f32],
    qm: &[f32],
    g: &[f32; TILE],
    cur: &mut Cursor,
    s: &mut [f32],
    scratch: &mut Scratch,
) {
    let (m, qr) = (t.m, qm.len());
    k.dot(t, b, row0, rows, w, qr, s, scratch);
    cur.each(b, bi, row0, rows, m, |row, j, val| {
        let diff = val - centroid_at(t, b, row, j);
        let at = row - row0;
        for r in 0..qr {
            s[r * TILE + at] = w[r * m + j].mul_add(diff, s[r * TILE + at]);
        }
    });
    for (r, &q) in qm.iter().enumerate() {
        for (v, &gt) in s[r * TILE..(r + 1) * TILE].iter_mut().zip(g) {
            *v = gt.mul_add(*v, q);
        }
    }
}

/// The scores of a tile of keys coded before RoPE (mod.rs, "Arithmetic"): `scratch.tile`
/// holds the rows' centroids (outliers in place), `first` is the flat index of the tile's
/// first row in `positions`. Everything runs with the tile's 64 rows in lanes: the keys are
/// synthesised transposed (`keys[d * 64 + t]`), so that the scale, the mean, the rotation and
/// the dot products are all 64-wide. Rows past `rows` hold finite values that the mask hides.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn rope_scores<K: Tile>(
    k: K,
    cx: &Ctx<'_>,
    prep: &Prep,
    kt: &StreamTables,
    kr: &KeyRope<'_>,
    first: usize,
    rows: usize,
    g: &[f32; TILE],
    s: &mut [f32],
    scratch: &mut Scratch,
) {
    let (d, qr, half) = (kt.d, cx.qr(), kr.rot / 2);
    let Scratch {
        tile,
        keys,
        trig,
        trig_at,
        packed,
        ..
    } = scratch;
    // Every value of `keys` and `trig` is written below before it is read.
    keys.resize(d * TILE, 0.0);
    let keys = &mut keys[..d * TILE];
    // cos and sin of each row's position, frequency-major: a full tile of consecutive
    // positions reads them from the table in place; otherwise they are gathered into
    // trig[i * 64 + t], then the sines (the previous tile of this worker may have been the
    // same rows of another kv-head).
    let direct = kr.run_at(first, rows);
    if direct.is_none() && (*trig_at != Some((first, rows)) || trig.len() != 2 * half * TILE) {
        trig.resize(2 * half * TILE, 0.0);
        kr.gather(first, rows, &mut trig[..2 * half * TILE]);
        *trig_at = Some((first, rows));
    }
    let rot = match direct {
        Some(p0) => Rot {
            cos: kr.cos,
            sin: kr.sin,
            stride: kr.n_pos(),
            offset: p0,
            half,
            style: kr.style,
        },
        None => {
            let (cos, sin) = trig[..2 * half * TILE].split_at(half * TILE);
            Rot {
                cos,
                sin,
                stride: TILE,
                offset: 0,
                half,
                style: kr.style,
            }
        }
    };
    match kr.synthesis {
        Synthesis::F32 => {
            k.synthesize(d, kt.m, tile, kt.key_synthesis(), keys);
            for (x, &mu) in keys.chunks_exact_mut(TILE).zip(&kt.mean) {
                for (v, &gt) in x.iter_mut().zip(g) {
                    *v = gt.mul_add(*v, mu);
                }
            }
            rotate_tile(&rot, keys);
        }
        Synthesis::Bf16 => {
            // `packed` holds the tile's centroids (`code_part`).
            let pairs = kt.m.div_ceil(2);
            let packed = &packed[..pairs * TILE];
            let mb = kt.key_synthesis_bf16();
            k.synthesize_bf16_rotated(d, pairs, packed, mb, g, &kt.mean, &rot, keys);
        }
    }
    let keys = &*keys;
    let mut r0 = 0;
    while r0 < qr {
        match qr - r0 {
            1 => tile_dots::<1>(&prep.qs, d, r0, keys, s),
            2 => tile_dots::<2>(&prep.qs, d, r0, keys, s),
            3 => tile_dots::<3>(&prep.qs, d, r0, keys, s),
            _ => tile_dots::<4>(&prep.qs, d, r0, keys, s),
        }
        r0 += (qr - r0).min(4);
    }
}

/// `s[(r0 + r) * 64 + t]` = the `fma` chain over `d` from 0 of `qs[(r0 + r) * D + d] *
/// keys[d * 64 + t]`, `R` query rows at a time (their sums held in registers).
#[inline(always)]
fn tile_dots<const R: usize>(qs: &[f32], d: usize, r0: usize, keys: &[f32], s: &mut [f32]) {
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

/// `q . k` with 16 lane-wise fused multiply-add chains (lane `l` takes the indices `= l mod
/// 16`, in order), then [`hsum16`].
#[inline(always)]
fn raw_dot(q: &[f32], k: &[f32]) -> f32 {
    let mut lanes = [0f32; 16];
    let (qc, kc) = (q.chunks_exact(16), k.chunks_exact(16));
    let (qt, kt) = (qc.remainder(), kc.remainder());
    for (a, b) in qc.zip(kc) {
        for l in 0..16 {
            lanes[l] = a[l].mul_add(b[l], lanes[l]);
        }
    }
    for l in 0..qt.len() {
        lanes[l] = qt[l].mul_add(kt[l], lanes[l]);
    }
    hsum16(&lanes)
}

#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) fn raw_part(
    cx: &Ctx<'_>,
    prep: &Prep,
    bh: usize,
    src: Source,
    row0: usize,
    rows: usize,
    pos0: usize,
) -> Part {
    let raw = match src {
        Source::Sink => cx.sink,
        Source::Tail => cx.tail,
    };
    let (qr, dk, dv, dq, dout) = (cx.qr(), cx.dk, cx.dv, cx.dq, cx.dout);
    let b = bh / cx.kv_heads;
    let kk = &raw.k[bh * raw.rows * dk..(bh + 1) * raw.rows * dk];
    let vv = &raw.v[bh * raw.rows * dv..(bh + 1) * raw.rows * dv];
    // The rows summed: the values, or the keys (the latent rows) for latent attention.
    let (summed, ds) = if cx.latent { (kk, dk) } else { (vv, dv) };
    let mut s = vec![0f32; qr * TILE];
    let mut add = vec![0f32; cx.n_q * TILE];
    let mut acc = vec![0f32; qr * dout];
    let mut mx = vec![f32::NEG_INFINITY; qr];
    let mut l = vec![0f32; qr];
    let mut overflow = false;
    for t0 in (0..rows).step_by(TILE) {
        let n = TILE.min(rows - t0);
        if !cx.visibility(b, pos0 + t0, n, &mut add) {
            continue;
        }
        for r in 0..qr {
            let q = &prep.qs[r * dq..(r + 1) * dq];
            for t in 0..TILE {
                s[r * TILE + t] = if t < n {
                    let at = (row0 + t0 + t) * dk;
                    let x = raw_dot(&q[..dk], &kk[at..at + dk]);
                    if cx.latent {
                        let at = (row0 + t0 + t) * dv;
                        x + raw_dot(&q[dk..], &vv[at..at + dv])
                    } else {
                        x
                    }
                } else {
                    0.0
                };
            }
        }
        cx.finish_scores(&mut s, &add);
        for r in 0..qr {
            let row = &mut s[r * TILE..(r + 1) * TILE];
            let Some(alpha) = softmax_update(row, &mut mx[r], &mut l[r], &mut overflow) else {
                continue;
            };
            let a = &mut acc[r * ds..(r + 1) * ds];
            if alpha != 1.0 {
                a.iter_mut().for_each(|v| *v *= alpha);
            }
            for (t, &p) in row[..n].iter().enumerate() {
                if p == 0.0 {
                    continue;
                }
                let at = (row0 + t0 + t) * ds;
                for (x, &v) in a.iter_mut().zip(&summed[at..at + ds]) {
                    *x = p.mul_add(v, *x);
                }
            }
        }
    }
    Part {
        code: false,
        overflow,
        mx,
        l,
        acc,
    }
}
