//! A piece of sealed rows (`code_part`): per tile the scores from the codes (or from keys
//! synthesised and rotated per tile for keys coded before RoPE), the online softmax, and the
//! value sums in the code domain, each outlier's difference from its centroid added on the way.

use super::super::fixed::fixed16;
use super::super::kernel::{
    bf16_round, centroid_at, rotate_tile, zeroed, Rot, Scratch, Tile, TILE,
};
use super::super::rope::{KeyRope, Synthesis};
use super::super::store::SealedBlock;
use super::super::tables::StreamTables;
use super::{softmax_update, Ctx, Part, Prep};

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
pub(in crate::attention) fn code_part<K: Tile>(
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
            // The rows' centroids (as the synthesis multiplies them: bfloat16 or 16-bit
            // fixed-point pairs, or float32), each outlier's value in its place.
            let syn = kr.synthesis;
            if syn == Synthesis::F32 {
                k.centroids(kt, kb, row0, rows, scratch);
            } else {
                // Every word is written before it is read.
                scratch.packed.resize(mk.div_ceil(2) * TILE, 0);
                if syn == Synthesis::Bf16 {
                    k.centroids_bf16(kt, kb, row0, rows, scratch);
                } else {
                    k.centroids_i16(kt, kb, row0, rows, scratch);
                }
            }
            kcur.each(kb, bi, row0, rows, mk, |row, j, val| {
                let v = match syn {
                    Synthesis::F32 => {
                        scratch.tile[j * TILE + row - row0] = val;
                        return;
                    }
                    Synthesis::Bf16 => bf16_round(val),
                    Synthesis::I16 => fixed16(val) as u32 & 0xffff,
                };
                let w = &mut scratch.packed[(j / 2) * TILE + row - row0];
                *w = if j % 2 == 0 {
                    (*w & 0xffff_0000) | v
                } else {
                    (*w & 0xffff) | v << 16
                };
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
        Synthesis::Bf16 | Synthesis::I16 => {
            // `packed` holds the tile's centroids (`code_part`).
            let pairs = kt.m.div_ceil(2);
            let packed = &packed[..pairs * TILE];
            if kr.synthesis == Synthesis::Bf16 {
                let mb = kt.key_synthesis_bf16();
                k.synthesize_bf16_rotated(d, pairs, packed, mb, g, &kt.mean, &rot, keys);
            } else {
                let f = kt.key_synthesis_i16();
                k.synthesize_i16_rotated(d, pairs, packed, f, g, &kt.mean, &rot, keys);
            }
        }
    }
    k.dots(&prep.qs, d, qr, keys, s);
}
