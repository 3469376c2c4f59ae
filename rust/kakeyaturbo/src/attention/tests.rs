//! Attention over the codes against attention over the decoded rows in f64, every
//! instruction set against the definition, and the thread count against itself.
//!
//! This file holds the cases (`Spec`, `build`, `run`); `tests_reference.rs` the f64
//! reference and `check`; the tests are in `tests_matches.rs`, `tests_rope.rs`,
//! `tests_threads.rs` and `tests_bad_inputs.rs`.

use super::*;
use crate::calibrated::testutil::{basis, noise};
use crate::calibrated::{CalibratedCodec, CalibratedParams};
use crate::metric::Metric;
use crate::rng::SplitMix64;
use std::sync::Arc;

#[path = "tests_bad_inputs.rs"]
mod bad_inputs;
#[path = "tests_matches.rs"]
mod matches;
#[path = "tests_reference.rs"]
mod reference;
#[path = "tests_rope.rs"]
mod rope;
#[path = "tests_threads.rs"]
mod threads;

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
