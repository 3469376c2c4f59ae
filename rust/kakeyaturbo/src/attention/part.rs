//! One piece of work of an attention call (`attend.rs`): the online softmax over its tiles of
//! sealed codes (scores from the codes, or from keys synthesised and rotated per tile for keys
//! coded before RoPE; the value sums in the code domain) or over its raw rows.

use super::kernel::TILE;
use super::math::{exp_neg, hsum16, tanh, tile_sum};
use super::rope::KeyRope;
use super::store::{CodeStore, LayerCodes};

#[path = "part_code.rs"]
mod code;

pub(super) use code::code_part;

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
