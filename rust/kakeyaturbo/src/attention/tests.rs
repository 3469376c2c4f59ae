//! Attention over the codes against attention over the decoded rows in f64, every
//! instruction set against the definition, and the thread count against itself.

use super::*;
use crate::calibrated::testutil::{basis, noise};
use crate::calibrated::{CalibratedCodec, CalibratedParams};
use crate::metric::Metric;
use crate::rng::SplitMix64;
use proptest::prelude::*;
use std::sync::Arc;

/// A layer: codes, raw rows, queries and the settings of one call.
struct Case {
    codes: LayerCodes,
    hq: usize,
    nq: usize,
    dk: usize,
    dv: usize,
    q: Vec<f32>,
    sink: (Vec<f32>, Vec<f32>, usize),
    tail: (Vec<f32>, Vec<f32>, usize),
    mask: Option<Vec<f32>>,
    params: AttentionParams,
    rope: Option<RopeCase>,
}

/// A rotation of keys coded before RoPE: cos/sin tables and every sealed row's position.
struct RopeCase {
    cos: Vec<f32>,
    sin: Vec<f32>,
    rot: usize,
    style: RopeStyle,
    positions: Vec<u32>,
    synthesis: Synthesis,
}

impl RopeCase {
    fn key_rope(&self) -> KeyRope<'_> {
        KeyRope {
            cos: &self.cos,
            sin: &self.sin,
            rot: self.rot,
            style: self.style,
            positions: &self.positions,
            synthesis: self.synthesis,
        }
    }
}

#[derive(Debug, Clone)]
struct Spec {
    seed: u64,
    batch: usize,
    kv_heads: usize,
    group: usize,
    dk: usize,
    dv: usize,
    blocks: Vec<usize>,
    sink: usize,
    tail: usize,
    nq: usize,
    norm: bool,
    ip: bool,
    outliers: bool,
    bmax: u8,
    softcap: Option<f32>,
    window: Option<usize>,
    mask: bool,
    /// Keys coded before RoPE: (rotary dimension, interleaved pairing).
    rope: Option<(usize, bool)>,
    synthesis: Synthesis,
    /// Latent attention: queries `D_k + D_v` wide score both streams, K is summed.
    latent: bool,
}

impl Default for Spec {
    fn default() -> Self {
        Spec {
            seed: 1,
            batch: 1,
            kv_heads: 2,
            group: 3,
            dk: 32,
            dv: 24,
            blocks: vec![100, 64],
            sink: 2,
            tail: 9,
            nq: 1,
            norm: true,
            ip: false,
            outliers: true,
            bmax: 6,
            softcap: None,
            window: None,
            mask: false,
            rope: None,
            synthesis: Synthesis::Bf16,
            latent: false,
        }
    }
}

fn calibration(d: usize, seed: u64, bmax: u8, norm: bool, ip: bool, outl: bool) -> CalibratedCodec {
    let mut g = SplitMix64::new(seed);
    let m = 1 + (g.next_u64() % d as u64) as usize;
    // Water-filling-like: wide components first, the width falling every few components.
    let step = 1 + (g.next_u64() % 5) as usize;
    let bits: Vec<u8> = (0..m)
        .map(|j| (bmax as usize).saturating_sub(j / step).max(1) as u8)
        .collect();
    let u = basis(d, seed ^ 0x55);
    let spread = (0..m)
        .map(|j| 2.0 * 0.93f32.powi(j as i32) * (1.0 + 0.3 * noise(&mut g).abs()))
        .collect();
    let mean = (0..d).map(|_| noise(&mut g) * 0.5).collect();
    CalibratedCodec::new(
        d,
        mean,
        u[..m * d].to_vec(),
        u[..m * d].to_vec(),
        spread,
        bits,
        vec![],
        CalibratedParams {
            rotation_seed: seed,
            metric: if ip && norm {
                Metric::InnerProduct
            } else {
                Metric::Mse
            },
            outlier_threshold: outl.then_some(1.5),
            norm,
        },
    )
    .unwrap()
}

fn rand_rows(g: &mut SplitMix64, n: usize, d: usize, c: Option<&CalibratedCodec>) -> Vec<f32> {
    let mut x = vec![0f32; n * d];
    for row in x.chunks_exact_mut(d) {
        match c {
            Some(c) => {
                row.copy_from_slice(&c.mean);
                for j in 0..c.m {
                    let e = noise(g) * c.spread[j] * 1.3;
                    for (v, &a) in row.iter_mut().zip(&c.analysis[j * d..(j + 1) * d]) {
                        *v += e * a;
                    }
                }
            }
            None => row.iter_mut().for_each(|v| *v = noise(g) * 2.0),
        }
    }
    x
}

fn build(s: &Spec) -> Case {
    let mut g = SplitMix64::new(s.seed);
    let cal = |stream: u64, h: usize, d: usize| {
        calibration(
            d,
            s.seed.wrapping_mul(31).wrapping_add(stream * 7 + h as u64),
            s.bmax,
            s.norm,
            s.ip,
            s.outliers,
        )
    };
    let kc: Vec<_> = (0..s.kv_heads).map(|h| cal(1, h, s.dk)).collect();
    let vc: Vec<_> = (0..s.kv_heads).map(|h| cal(2, h, s.dv)).collect();
    let arc = |v: &[CalibratedCodec]| v.iter().map(|c| Arc::new(StreamTables::new(c))).collect();
    let mut codes = LayerCodes::new(arc(&kc), arc(&vc), s.batch).unwrap();
    for b in 0..s.batch {
        for h in 0..s.kv_heads {
            for &n in &s.blocks {
                let xk = rand_rows(&mut g, n, s.dk, Some(&kc[h]));
                let xv = rand_rows(&mut g, n, s.dv, Some(&vc[h]));
                let kb = kc[h].to_bytes(&kc[h].encode(&xk, n).unwrap()).0;
                let vb = vc[h].to_bytes(&vc[h].encode(&xv, n).unwrap()).0;
                codes.append(b, h, kb, vb).unwrap();
            }
        }
    }
    let bh = s.batch * s.kv_heads;
    let sink = (
        rand_rows(&mut g, bh * s.sink, s.dk, None),
        rand_rows(&mut g, bh * s.sink, s.dv, None),
        s.sink,
    );
    let tail = (
        rand_rows(&mut g, bh * s.tail, s.dk, None),
        rand_rows(&mut g, bh * s.tail, s.dv, None),
        s.tail,
    );
    let hq = s.kv_heads * s.group;
    let dq = if s.latent { s.dk + s.dv } else { s.dk };
    let q: Vec<f32> = (0..s.batch * hq * s.nq * dq)
        .map(|_| noise(&mut g))
        .collect();
    let total = s.sink + s.blocks.iter().sum::<usize>() + s.tail;
    let mask = s.mask.then(|| {
        (0..s.batch * s.nq * total)
            .map(|_| match g.next_u64() % 7 {
                0 => f32::NEG_INFINITY,
                1 => -3.0,
                _ => noise(&mut g),
            })
            .collect()
    });
    let sealed: usize = s.blocks.iter().sum();
    let rope = s.rope.map(|(rot, inter)| {
        let rot = (rot.min(s.dk) / 2 * 2).max(2).min(s.dk / 2 * 2);
        let half = rot / 2;
        let n_pos = s.sink + sealed + s.tail + 7;
        let inv: Vec<f32> = (0..half)
            .map(|i| 10000f32.powf(-((2 * i) as f32) / rot as f32))
            .collect();
        let (mut cos, mut sin) = (Vec::new(), Vec::new());
        for &f in &inv {
            for p in 0..n_pos {
                let a = p as f32 * f;
                cos.push(a.cos() * 1.1);
                sin.push(a.sin() * 1.1);
            }
        }
        // Positions as a left-padded batch row has them: an offset, then consecutive; batch
        // row 1 starts with pads (position 1) and reaches the table's last position.
        let positions = (0..s.batch)
            .flat_map(|b| {
                (0..sealed).map(move |t| match b {
                    0 => (s.sink + t) as u32,
                    _ if t < 5 => 1,
                    _ => (s.sink + t + 7 + s.tail) as u32,
                })
            })
            .collect();
        RopeCase {
            cos,
            sin,
            rot,
            style: if inter {
                RopeStyle::Interleaved
            } else {
                RopeStyle::Half
            },
            positions,
            synthesis: s.synthesis,
        }
    });
    Case {
        rope,
        codes,
        hq,
        nq: s.nq,
        dk: s.dk,
        dv: s.dv,
        q,
        sink,
        tail,
        mask,
        params: AttentionParams {
            scale: 1.0 / (s.dk as f32).sqrt(),
            softcap: s.softcap,
            window: s.window,
            latent: s.latent,
        },
    }
}

fn run(c: &Case, isa: Isa) -> Result<AttentionOutput, crate::Error> {
    attend_with(
        isa,
        &c.codes,
        &c.q,
        c.hq,
        c.nq,
        RawRows {
            k: &c.sink.0,
            v: &c.sink.1,
            rows: c.sink.2,
        },
        RawRows {
            k: &c.tail.0,
            v: &c.tail.1,
            rows: c.tail.2,
        },
        c.mask.as_deref(),
        &c.params,
        c.rope.as_ref().map(|r| r.key_rope()).as_ref(),
    )
}

/// Decode every block, then attention in f64. Returns (out, lse, the largest |V|, the
/// largest score magnitude `scale * sum |q_d k_d|`).
fn reference(c: &Case) -> (Vec<f64>, Vec<f64>, f64, f64) {
    let (batch, hkv) = (c.codes.batch(), c.codes.kv_heads());
    let group = c.hq / hkv;
    let (dk, dv, nq, latent) = (c.dk, c.dv, c.nq, c.params.latent);
    let mut out = vec![0f64; batch * c.hq * nq * if latent { dk } else { dv }];
    let mut lse = vec![f64::NEG_INFINITY; batch * c.hq * nq];
    let (mut vmax, mut smax) = (0f64, 0f64);
    for b in 0..batch {
        for h in 0..hkv {
            let bh = b * hkv + h;
            let (ks, vs) = c.codes.stores(b, h).unwrap();
            let mut k: Vec<f32> = c.sink.0[bh * c.sink.2 * dk..(bh + 1) * c.sink.2 * dk].to_vec();
            let mut v: Vec<f32> = c.sink.1[bh * c.sink.2 * dv..(bh + 1) * c.sink.2 * dv].to_vec();
            let sealed0 = k.len() / dk;
            for (blk_k, blk_v) in ks.blocks().iter().zip(vs.blocks()) {
                let kc = ks.tables().codec();
                let vc = vs.tables().codec();
                k.extend(kc.decode(&kc.from_bytes(blk_k.bytes()).unwrap()).unwrap());
                v.extend(vc.decode(&vc.from_bytes(blk_v.bytes()).unwrap()).unwrap());
            }
            // Keys coded before RoPE: rotated here as the model would (in f64).
            let mut k64: Vec<f64> = k.iter().map(|&x| x as f64).collect();
            if let Some(r) = c.rope.as_ref().filter(|r| r.synthesis == Synthesis::Bf16) {
                let _ = r;
                bf16_keys(ks, &mut k64[sealed0 * dk..sealed0 * dk + ks.rows() * dk]);
            }
            if let Some(r) = &c.rope {
                let sealed = k.len() / dk - sealed0;
                let half = r.rot / 2;
                for t in 0..sealed {
                    let p = r.positions[b * sealed + t] as usize;
                    let row = &mut k64[(sealed0 + t) * dk..(sealed0 + t + 1) * dk];
                    for i in 0..half {
                        let (ia, ib) = match r.style {
                            RopeStyle::Half => (i, i + half),
                            RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                        };
                        let n_pos = r.cos.len() / half;
                        let (cs, sn) = (r.cos[i * n_pos + p] as f64, r.sin[i * n_pos + p] as f64);
                        let (a, bb) = (row[ia], row[ib]);
                        row[ia] = a * cs - bb * sn;
                        row[ib] = bb * cs + a * sn;
                    }
                }
            }
            k64.extend(
                c.tail.0[bh * c.tail.2 * dk..(bh + 1) * c.tail.2 * dk]
                    .iter()
                    .map(|&x| x as f64),
            );
            k.extend_from_slice(&c.tail.0[bh * c.tail.2 * dk..(bh + 1) * c.tail.2 * dk]);
            v.extend_from_slice(&c.tail.1[bh * c.tail.2 * dv..(bh + 1) * c.tail.2 * dv]);
            let t = k.len() / dk;
            // Latent attention scores `[k, v]` and sums `k`.
            let (k64, v, dq, dout) = if latent {
                let ka: Vec<f64> = (0..t)
                    .flat_map(|p| {
                        let vr = v[p * dv..(p + 1) * dv].iter().map(|&x| x as f64);
                        k64[p * dk..(p + 1) * dk].iter().copied().chain(vr)
                    })
                    .collect();
                (ka, k, dk + dv, dk)
            } else {
                (k64, v, dk, dv)
            };
            vmax = v.iter().fold(vmax, |a, &x| a.max(x.abs() as f64));
            for gq in 0..group {
                for i in 0..nq {
                    let hqi = h * group + gq;
                    let qa = ((b * c.hq + hqi) * nq + i) * dq;
                    let q = &c.q[qa..qa + dq];
                    let qp = t - nq + i;
                    let scale = c.params.scale as f64;
                    let s: Vec<f64> = (0..t)
                        .map(|p| {
                            let kr = &k64[p * dq..(p + 1) * dq];
                            let mut x: f64 = q.iter().zip(kr).map(|(&a, &b)| a as f64 * b).sum();
                            let mag: f64 =
                                q.iter().zip(kr).map(|(&a, &b)| (a as f64 * b).abs()).sum();
                            smax = smax.max(mag * scale.abs());
                            x *= scale;
                            if let Some(cap) = c.params.softcap {
                                x = cap as f64 * (x / cap as f64).tanh();
                            }
                            let seen = p <= qp && c.params.window.is_none_or(|w| qp - p < w);
                            if !seen {
                                return f64::NEG_INFINITY;
                            }
                            x + c
                                .mask
                                .as_ref()
                                .map_or(0.0, |m| m[(b * nq + i) * t + p] as f64)
                        })
                        .collect();
                    let top = s.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b));
                    if top == f64::NEG_INFINITY {
                        continue;
                    }
                    let p: Vec<f64> = s.iter().map(|&x| (x - top).exp()).collect();
                    let l: f64 = p.iter().sum();
                    let row = (b * c.hq + hqi) * nq + i;
                    lse[row] = top + l.ln();
                    for d in 0..dout {
                        out[row * dout + d] =
                            (0..t).map(|r| p[r] * v[r * dout + d] as f64).sum::<f64>() / l;
                    }
                }
            }
        }
    }
    (out, lse, vmax, smax)
}

/// Largest errors of the output (relative to the largest |V|) and of lse (absolute) against
/// the f64 reference, with the index of the worst output value.
fn errors(c: &Case, got: &AttentionOutput) -> (f64, f64, usize) {
    let (out, lse, vmax, _) = reference(c);
    let mut worst = (0f64, 0usize);
    for (i, (&a, &b)) in got.out.iter().zip(&out).enumerate() {
        let e = (a as f64 - b).abs() / vmax.max(1e-30);
        if e > worst.0 || e.is_nan() {
            worst = (e, i);
        }
    }
    let mut le = 0f64;
    for (&a, &b) in got.lse.iter().zip(&lse) {
        if b == f64::NEG_INFINITY {
            assert_eq!(a, f32::NEG_INFINITY);
        } else {
            le = le.max((a as f64 - b).abs());
        }
    }
    (worst.0, le, worst.1)
}

/// The sealed keys of `store` as [`Synthesis::Bf16`] defines them, in f64: `mean + g *
/// sum_j bf16(M_jd) bf16(c_j)` (outliers' values in place of their centroids). Checks on the
/// way that they lie within bfloat16 rounding of the decoded keys in `keys` (`rows x D`),
/// which they replace: `M` and the centroids are the decode's factors.
fn bf16_keys(store: &CodeStore, keys: &mut [f64]) {
    let t = store.tables();
    let (m, d) = (t.m, t.d);
    let ms = t.key_synthesis();
    let r16 = |x: f32| kernel::bf16_half(kernel::bf16_round(x), false) as f64;
    let mut row0 = 0;
    for blk in store.blocks() {
        let mut outl = vec![None; blk.n * m];
        for i in 0..blk.outliers {
            let (pos, val) = blk.outlier(i);
            outl[pos as usize] = Some(val);
        }
        for r in 0..blk.n {
            let g = blk.scale(r) as f64;
            let c: Vec<f32> = (0..m)
                .map(|j| outl[r * m + j].unwrap_or_else(|| kernel::centroid_at(t, blk, r, j)))
                .collect();
            let out = &mut keys[(row0 + r) * d..(row0 + r + 1) * d];
            for (i, o) in out.iter_mut().enumerate() {
                let x: f64 = (0..m).map(|j| r16(ms[j * d + i]) * r16(c[j])).sum();
                let mag: f64 = (0..m)
                    .map(|j| (ms[j * d + i] as f64 * c[j] as f64).abs())
                    .sum();
                let want = t.mean[i] as f64 + g * x;
                let bound = g.abs() * mag * 2f64.powi(-7) + 1e-5 * (1.0 + o.abs());
                assert!(
                    (want - *o).abs() <= bound,
                    "bf16 key {want} vs decoded {o} (row {}, dim {i})",
                    row0 + r
                );
                *o = want;
            }
        }
        row0 += blk.n;
    }
}

fn check(s: &Spec) {
    let c = build(s);
    let got = run(&c, Isa::Portable).unwrap();
    let (eo, el, at) = errors(&c, &got);
    let (_, _, _, smax) = reference(&c);
    // f32 rounding of the scores, relative to their magnitude, and of the value sums.
    let tol = 2e-6 * (1.0 + smax) + 1e-6;
    assert!(
        eo <= tol,
        "{s:?}: output error {eo:.3e} > {tol:.3e} at flat index {at}"
    );
    assert!(el <= tol, "{s:?}: lse error {el:.3e} > {tol:.3e}");
    if Isa::best() != Isa::Portable {
        let fast = run(&c, Isa::best()).unwrap();
        if let Some(i) = fast
            .out
            .iter()
            .zip(&got.out)
            .position(|(a, b)| a.to_bits() != b.to_bits())
        {
            panic!(
                "{s:?}: the AVX-512 kernel differs at flat index {i}: {} vs {}",
                fast.out[i], got.out[i]
            );
        }
        assert_eq!(fast, got);
    }
}

#[test]
fn matches_the_decoded_attention() {
    check(&Spec::default());
    check(&Spec {
        norm: false,
        outliers: false,
        ..Spec::default()
    });
    check(&Spec {
        ip: true,
        bmax: 8,
        blocks: vec![512, 3, 700],
        ..Spec::default()
    });
    check(&Spec {
        batch: 2,
        kv_heads: 1,
        group: 8,
        dk: 64,
        dv: 64,
        nq: 4,
        tail: 6,
        mask: true,
        softcap: Some(5.0),
        ..Spec::default()
    });
}

#[test]
fn latent_attention_scores_both_streams_and_sums_the_keys() {
    // DeepSeek-like: one latent row per position (K), a rotated key part (V), many query
    // heads reading it; and two kv-heads with several query tokens, masks and a softcap.
    check(&Spec {
        latent: true,
        kv_heads: 1,
        group: 16,
        dk: 64,
        dv: 16,
        ..Spec::default()
    });
    check(&Spec {
        latent: true,
        batch: 2,
        nq: 3,
        mask: true,
        softcap: Some(4.0),
        window: Some(150),
        ip: true,
        blocks: vec![64, 200, 5],
        ..Spec::default()
    });
    // The rotated part alone moves the result: zero queries for it give other scores.
    let c = build(&Spec {
        latent: true,
        ..Spec::default()
    });
    let got = run(&c, Isa::Portable).unwrap();
    let mut q = c.q.clone();
    let dq = c.dk + c.dv;
    for row in q.chunks_exact_mut(dq) {
        row[c.dk..].fill(0.0);
    }
    let other = Case { q, ..c };
    let diff = run(&other, Isa::Portable).unwrap();
    assert_ne!(got.lse, diff.lse);
    assert_eq!(got.out.len(), c_rows(&other) * other.dk);
    // A key rotation with latent attention is a typed error.
    let mut r = build(&Spec {
        rope: Some((16, false)),
        ..Spec::default()
    });
    r.params.latent = true;
    r.q = vec![0.5f32; c_rows(&r) * (r.dk + r.dv)];
    let e = run(&r, Isa::Portable);
    assert!(matches!(e, Err(crate::Error::InvalidParameter(_))), "{e:?}");
}

/// Query rows of a case (`B x H_q x n_q`).
fn c_rows(c: &Case) -> usize {
    c.codes.batch() * c.hq * c.nq
}

#[test]
fn keys_coded_before_rope_in_f32_match_the_rotated_decode() {
    for (dk, rope) in [(64, (64, false)), (40, (40, true)), (96, (32, false))] {
        check(&Spec {
            dk,
            rope: Some(rope),
            synthesis: Synthesis::F32,
            ..Spec::default()
        });
    }
}

#[test]
fn keys_coded_before_rope_match_the_rotated_decode() {
    for (dk, rope) in [
        (32, (32, false)),
        (64, (64, false)),
        (128, (128, true)),
        (64, (24, false)),
        (40, (40, true)),
        (256, (256, false)),
    ] {
        check(&Spec {
            dk,
            rope: Some(rope),
            ..Spec::default()
        });
    }
    check(&Spec {
        batch: 2,
        kv_heads: 1,
        group: 7,
        dk: 64,
        nq: 3,
        tail: 5,
        mask: true,
        softcap: Some(5.0),
        window: Some(150),
        blocks: vec![512, 70],
        rope: Some((64, false)),
        ..Spec::default()
    });
    // Widths from 8 bits down: the bfloat16 look-up's one, two and four permutes per 32 rows
    // (up to 6, 7 and 8 bits), pairs of mixed widths.
    for seed in [3, 4] {
        check(&Spec {
            seed,
            dk: 64,
            bmax: 8,
            rope: Some((64, false)),
            ..Spec::default()
        });
    }
}

#[test]
fn a_bad_rotation_is_a_typed_error() {
    let mut c = build(&Spec {
        rope: Some((32, false)),
        ..Spec::default()
    });
    assert!(run(&c, Isa::Portable).is_ok());
    let r = c.rope.as_mut().unwrap();
    let n = r.cos.len() / 16;
    r.positions[5] = n as u32;
    assert!(matches!(
        run(&c, Isa::Portable),
        Err(crate::Error::InvalidInput(_))
    ));
    let r = c.rope.as_mut().unwrap();
    r.positions[5] = 0;
    r.positions.pop();
    assert!(matches!(
        run(&c, Isa::Portable),
        Err(crate::Error::InvalidInput(_))
    ));
    let r = c.rope.as_mut().unwrap();
    r.positions.push(0);
    r.cos.iter_mut().for_each(|v| *v = f32::NAN);
    assert!(matches!(
        run(&c, Isa::Portable),
        Err(crate::Error::Numerical(_))
    ));
    let r = c.rope.as_mut().unwrap();
    r.cos.iter_mut().for_each(|v| *v = 0.5);
    r.rot = 33;
    assert!(run(&c, Isa::Portable).is_err());
    let r = c.rope.as_mut().unwrap();
    r.rot = 34;
    assert!(run(&c, Isa::Portable).is_err());
}

#[test]
fn no_sealed_rows_windows_and_masks() {
    check(&Spec {
        blocks: vec![],
        sink: 0,
        ..Spec::default()
    });
    check(&Spec {
        blocks: vec![300, 300],
        window: Some(40),
        nq: 3,
        ..Spec::default()
    });
    check(&Spec {
        blocks: vec![300, 300],
        window: Some(350),
        mask: true,
        ..Spec::default()
    });
    // A query that sees nothing has output 0 and lse -inf.
    let mut c = build(&Spec {
        mask: true,
        ..Spec::default()
    });
    c.mask.as_mut().unwrap().fill(f32::NEG_INFINITY);
    let o = run(&c, Isa::best()).unwrap();
    assert!(o.out.iter().all(|&x| x == 0.0));
    assert!(o.lse.iter().all(|&x| x == f32::NEG_INFINITY));
}

#[test]
fn thread_count_does_not_change_the_bits() {
    for rope in [None, Some((32, false))] {
        thread_count_case(rope);
    }
}

#[test]
fn small_calls_run_on_the_calling_thread() {
    let c = build(&Spec {
        blocks: vec![256],
        ..Spec::default()
    });
    let work = c.codes.batch() * c.codes.kv_heads() * c.codes.k_dim() * 256;
    assert!(work <= super::INLINE_WORK);
    assert_eq!(super::auto_threads(&c.codes, 6, 1, None), Some(1));
    assert_eq!(super::auto_threads(&c.codes, 6, 1, Some(2)), Some(2));
    // Query rows count in units of `QUERY_ROWS_PER_UNIT` per kv-head (heads x tokens): up to
    // one unit the same, past it each unit as much work again.
    let unit = super::QUERY_ROWS_PER_UNIT;
    assert_eq!(super::auto_threads(&c.codes, 2 * unit, 1, None), Some(1));
    let units = super::INLINE_WORK / work + 1;
    assert_eq!(
        super::auto_threads(&c.codes, 2 * unit * units, 1, None),
        None
    );
    assert_eq!(super::auto_threads(&c.codes, 2 * unit, units, None), None);
    let big = build(&Spec {
        blocks: vec![2048, 2048, 1000],
        kv_heads: 3,
        dk: 64,
        ..Spec::default()
    });
    assert_eq!(super::auto_threads(&big.codes, 9, 1, None), None);
}

#[test]
fn many_query_rows_split_by_rows_without_changing_the_bits() {
    // A latent layer with 96 query heads: its queries' preparation and its combination cost
    // past `ROWS_WORK`, so they run in units of `ROW_CHUNK` rows on the threads asked for.
    let s = Spec {
        latent: true,
        kv_heads: 1,
        group: 96,
        dk: 256,
        dv: 32,
        blocks: vec![512, 512, 300],
        ..Spec::default()
    };
    check(&s);
    let c = build(&s);
    let (mk, mv) = (c.codes.k_store(0).tables().m, c.codes.v_store(0).tables().m);
    assert!(96 * (c.dk + c.dv) * (mk + mv) >= super::attend::ROWS_WORK);
    assert!(96 * mk * c.dk >= super::attend::ROWS_WORK);
    const { assert!(96 > 2 * super::attend::ROW_CHUNK) };
    thread_count_same(&c);
    // Several query tokens: the units of 16 rows cut across a head's tokens (row = g * n_q + i),
    // and a grouped-query layer with a causal mask over its tokens.
    for s in [
        Spec {
            nq: 3,
            group: 40,
            mask: true,
            ..s.clone()
        },
        Spec {
            latent: false,
            kv_heads: 2,
            group: 24,
            nq: 5,
            dk: 256,
            dv: 64,
            ..s
        },
    ] {
        check(&s);
        thread_count_same(&build(&s));
    }
}

fn thread_count_case(rope: Option<(usize, bool)>) {
    let c = build(&Spec {
        blocks: vec![2048, 2048, 1000],
        kv_heads: 3,
        rope,
        ..Spec::default()
    });
    thread_count_same(&c);
}

/// One, two, all and no pool threads give the same bits.
fn thread_count_same(c: &Case) {
    let one = crate::threads::with_threads(Some(1), || run(c, Isa::best()))
        .unwrap()
        .unwrap();
    let two = crate::threads::with_threads(Some(2), || run(c, Isa::best()))
        .unwrap()
        .unwrap();
    let all = run(c, Isa::best()).unwrap();
    let inline = crate::threads::with_threads_inline(Some(1), || run(c, Isa::best()))
        .unwrap()
        .unwrap();
    assert_eq!(one, two);
    assert_eq!(one, all);
    assert_eq!(one, inline);
}

#[test]
fn bad_inputs_are_typed_errors() {
    let c = build(&Spec::default());
    let call = |q: &[f32],
                hq: usize,
                nq: usize,
                tail_rows: usize,
                mask: Option<&[f32]>,
                p: AttentionParams| {
        attend(
            &c.codes,
            q,
            hq,
            nq,
            RawRows {
                k: &c.sink.0,
                v: &c.sink.1,
                rows: c.sink.2,
            },
            RawRows {
                k: &c.tail.0,
                v: &c.tail.1,
                rows: tail_rows,
            },
            mask,
            &p,
            None,
        )
    };
    let p = c.params;
    assert!(call(&c.q, c.hq, 1, 9, None, p).is_ok());
    assert!(call(&c.q[1..], c.hq, 1, 9, None, p).is_err());
    assert!(call(&c.q, 5, 1, 9, None, p).is_err());
    assert!(call(&c.q, c.hq, 0, 9, None, p).is_err());
    assert!(call(&c.q, c.hq, 1, 8, None, p).is_err());
    let mut nan = c.q.clone();
    nan[3] = f32::NAN;
    assert!(call(&nan, c.hq, 1, 9, None, p).is_err());
    let t = 2 + 164 + 9;
    let mut m = vec![0f32; t];
    assert!(call(&c.q, c.hq, 1, 9, Some(&m), p).is_ok());
    assert!(call(&c.q, c.hq, 1, 9, Some(&m[1..]), p).is_err());
    m[4] = f32::INFINITY;
    assert!(call(&c.q, c.hq, 1, 9, Some(&m), p).is_err());
    for bad in [
        AttentionParams {
            scale: f32::NAN,
            ..p
        },
        AttentionParams {
            softcap: Some(0.0),
            ..p
        },
        AttentionParams {
            window: Some(0),
            ..p
        },
    ] {
        assert!(call(&c.q, c.hq, 1, 9, None, bad).is_err());
    }
    // Finite queries whose scores overflow float32: a typed error, not NaN.
    let top = c.q.iter().fold(0f32, |a, v| a.max(v.abs()));
    let huge: Vec<f32> = c.q.iter().map(|v| v / top * 3e38).collect();
    assert!(matches!(
        call(&huge, c.hq, 1, 9, None, p),
        Err(crate::Error::Numerical(_))
    ));
    // Sealed rows that differ across the layer.
    let mut uneven = c.codes.clone();
    uneven.select(&[0]).unwrap();
    let (ks, vs) = uneven.stores(0, 1).unwrap();
    let (kb, vb) = (
        ks.blocks()[0].bytes().to_vec(),
        vs.blocks()[0].bytes().to_vec(),
    );
    uneven.append(0, 1, kb, vb).unwrap();
    let e = attend(
        &uneven,
        &c.q,
        c.hq,
        1,
        RawRows {
            k: &c.sink.0,
            v: &c.sink.1,
            rows: 2,
        },
        RawRows {
            k: &c.tail.0,
            v: &c.tail.1,
            rows: 9,
        },
        None,
        &p,
        None,
    );
    assert!(matches!(e, Err(crate::Error::InvalidInput(_))));
}

/// A container with `edits` (position, xor) applied and its checksum recomputed, so that the
/// structure checks, not the checksum, meet the damage.
fn mutated(blob: &[u8], edits: &[(usize, u8)]) -> Vec<u8> {
    let mut b = blob.to_vec();
    let body = b.len() - 4;
    for &(at, x) in edits {
        b[at % body] ^= x;
    }
    let crc = crc32fast::hash(&b[..body]);
    b[body..].copy_from_slice(&crc.to_le_bytes());
    b
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]
    #[test]
    fn damaged_containers_are_refused_or_attended_without_panic(
        edits in proptest::collection::vec((any::<usize>(), 1u8..=255), 1..6),
        which in any::<bool>(),
    ) {
        let c = build(&Spec { blocks: vec![70], kv_heads: 1, ..Spec::default() });
        let (ks, vs) = c.codes.stores(0, 0).unwrap();
        let (kb, vb) = (ks.blocks()[0].bytes().to_vec(), vs.blocks()[0].bytes().to_vec());
        let (kb, vb) = if which { (mutated(&kb, &edits), vb) } else { (kb, mutated(&vb, &edits)) };
        let mut fresh = c.codes.clone();
        fresh.clear();
        if fresh.append(0, 0, kb, vb).is_ok() {
            let o = attend(
                &fresh,
                &c.q,
                c.hq,
                c.nq,
                RawRows { k: &c.sink.0, v: &c.sink.1, rows: c.sink.2 },
                RawRows { k: &c.tail.0, v: &c.tail.1, rows: c.tail.2 },
                None,
                &c.params,
                None,
            );
            // Accepted codes are valid codes: the output is finite (or a typed error).
            if let Ok(o) = o {
                prop_assert!(o.out.iter().all(|v| v.is_finite()));
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(40))]
    #[test]
    fn every_configuration_matches(
        seed in any::<u64>(), batch in 1usize..3, kv_heads in 1usize..3, group in 1usize..9,
        dk in 1usize..80, dv in 1usize..80,
        blocks in proptest::collection::vec(1usize..300, 0..4), sink in 0usize..4,
        extra in 0usize..70, nq in 1usize..5, norm in any::<bool>(), ip in any::<bool>(),
        outliers in any::<bool>(), bmax in 1u8..=8, cap in any::<bool>(),
        window in proptest::option::of(1usize..400), mask in any::<bool>(),
        rope in proptest::option::of((2usize..80, any::<bool>())), f32_synthesis in any::<bool>(),
        latent in any::<bool>(),
    ) {
        check(&Spec {
            seed, batch, kv_heads, group, dk, dv, blocks, sink, tail: nq + extra, nq, norm, ip,
            outliers, bmax, softcap: cap.then_some(3.0), window, mask,
            rope: rope.filter(|_| dk >= 2 && !latent),
            synthesis: if f32_synthesis { Synthesis::F32 } else { Synthesis::Bf16 },
            latent,
        });
    }
}

#[test]
fn the_fast_kernel_runs_where_the_cpu_has_it() {
    #[cfg(target_arch = "x86_64")]
    assert_eq!(Isa::best() == Isa::Avx512, super::avx512::available());
    eprintln!("attention kernel: {:?}", Isa::best());
}
