//! The f64 reference the attention tests compare with: every block decoded, then attention
//! in f64; and `check`, a case against it and every instruction set against the definition.

use super::*;

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
            if let Some(r) = c.rope.as_ref().filter(|r| r.synthesis != Synthesis::F32) {
                let rows = sealed0 * dk..sealed0 * dk + ks.rows() * dk;
                synthesis_keys(ks, r.synthesis, &mut k64[rows]);
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

/// The sealed keys of `store` as `synthesis` (bfloat16 or 16-bit fixed point) defines them,
/// in f64: `mean + g * sum_j M'_jd c'_j` with `M'` and `c'` the factors as that synthesis
/// rounds them (outliers' values in place of their centroids). Checks on the way that they lie
/// within those roundings' error of the decoded keys in `keys` (`rows x D`), which they
/// replace: `M` and the centroids are the decode's factors.
fn synthesis_keys(store: &CodeStore, synthesis: Synthesis, keys: &mut [f64]) {
    let t = store.tables();
    let (m, d) = (t.m, t.d);
    let ms = t.key_synthesis();
    let wq: Vec<f64> = t
        .key_synthesis_values(synthesis)
        .iter()
        .map(|&x| x as f64)
        .collect();
    let cq = |x: f32| match synthesis {
        Synthesis::I16 => fixed::fixed16(x) as f64 / fixed::ONE as f64,
        _ => kernel::bf16_half(kernel::bf16_round(x), false) as f64,
    };
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
                let x: f64 = (0..m).map(|j| wq[j * d + i] * cq(c[j])).sum();
                // |M c - M' c'| <= |M - M'| |c| + |M'| |c - c'|, and the decode's f32 rounding.
                let (mut err, mut mag) = (0f64, 0f64);
                for (j, &cj) in c.iter().enumerate() {
                    let (mj, c64, w) = (ms[j * d + i] as f64, cj as f64, wq[j * d + i]);
                    err += (mj - w).abs() * c64.abs() + w.abs() * (c64 - cq(cj)).abs();
                    mag += (mj * c64).abs();
                }
                let want = t.mean[i] as f64 + g * x;
                let bound = g.abs() * (err * (1.0 + 1e-6) + mag * 1e-5) + 1e-5 * (1.0 + o.abs());
                assert!(
                    (want - *o).abs() <= bound,
                    "{synthesis:?} key {want} vs decoded {o} (row {}, dim {i})",
                    row0 + r
                );
                *o = want;
            }
        }
        row0 += blk.n;
    }
}

pub(super) fn check(s: &Spec) {
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
    for isa in [Isa::Avx512, Isa::Avx2]
        .into_iter()
        .filter(|i| i.runs_here())
    {
        let fast = run(&c, isa).unwrap();
        if let Some(i) = fast
            .out
            .iter()
            .zip(&got.out)
            .position(|(a, b)| a.to_bits() != b.to_bits())
        {
            panic!(
                "{s:?}: the {isa:?} kernel differs at flat index {i}: {} vs {}",
                fast.out[i], got.out[i]
            );
        }
        assert_eq!(fast, got, "{isa:?}");
    }
}
