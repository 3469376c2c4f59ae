//! Tests of `block.rs` and `decode.rs`: one block through stages 1-5 and back.

use super::super::layer::{decode_layer, encode_layer};
use super::*;
use crate::pca::PcaMethod;
use crate::rng::SplitMix64;
use proptest::prelude::*;

fn noise(g: &mut SplitMix64) -> f32 {
    // Sum of four uniforms: a cheap, deterministic, roughly Gaussian draw.
    (0..4)
        .map(|_| (g.next_u64() >> 40) as f32 / 16777216.0 - 0.5)
        .sum::<f32>()
        * 1.7
}

fn gaussian_rows(n: usize, d: usize, seed: u64) -> Vec<f32> {
    let mut g = SplitMix64::new(seed);
    (0..n * d).map(|_| noise(&mut g)).collect()
}

fn rel_err(x: &[f32], y: &[f32]) -> f64 {
    let e: f64 = x.iter().zip(y).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
    let s: f64 = x.iter().map(|&a| (a as f64).powi(2)).sum();
    e / s
}

fn roundtrip(x: &[f32], n: usize, d: usize, p: &CodecParams) -> Vec<f32> {
    let (e, _) = encode_layer(x, n, d, None, p, Some(1)).unwrap();
    decode_layer(&e, Some(1)).unwrap()
}

/// The plain decode (FORMAT.md's operations, one row after another, the portable butterfly,
/// row-major through the basis): the reference `decode_block` must equal bit for bit.
fn decode_by_rows(enc: &super::super::layer::EncodedLayer) -> Vec<f32> {
    let (q, d) = (enc.quantizer().unwrap(), enc.d);
    let mut out = Vec::new();
    for (skel, codes) in &enc.blocks {
        let (n, de) = (codes.n, skel.d_eff);
        let rot = Rotation::new(enc.params.rotation_seed, de);
        let mut idx = vec![0u8; n * de];
        crate::pack::unpack_into(&codes.residual, enc.params.bit_width as u32, &mut idx);
        let mut c = vec![0f32; n * de];
        q.dequantize_slice(&idx, &mut c);
        for (&pos, &v) in codes.outlier_pos.iter().zip(&codes.outlier_val) {
            c[pos as usize] = f16::from_bits(v).to_f32();
        }
        let (t, s) = (codes.t.decode(), codes.scale.decode());
        for (i, row) in c.chunks_exact_mut(de).enumerate() {
            for &(o, w, f) in &rot.bands {
                let (mul, band) = (s[i] / f, &mut row[o..o + w]);
                band.iter_mut().for_each(|v| *v *= mul);
                crate::wht::fwht(band);
                for (v, &sg) in band.iter_mut().zip(&rot.signs[o..o + w]) {
                    *v = *v * sg * (1.0 / w as f32);
                }
            }
            let sg = codes.seg[i] as usize;
            for (v, &cv) in row.iter_mut().zip(&skel.centers[sg * de..(sg + 1) * de]) {
                *v += t[i] * cv;
            }
        }
        let mut x: Vec<f32> = (0..n).flat_map(|_| skel.mean.iter().copied()).collect();
        crate::gemm::matmul(
            faer::MatMut::from_row_major_slice_mut(&mut x, n, d),
            faer::Accum::Add,
            faer::MatRef::from_row_major_slice(&c, n, de),
            faer::MatRef::from_row_major_slice(&skel.basis, de, d),
            1.0,
            faer::Par::Seq,
        );
        out.extend(x);
    }
    out
}

fn bits_of(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn zero_residual_rows_round_trip_exactly() {
    // Identical rows: c = 0, r = 0. The predecessor decoded these with an offset of ~0.245.
    let d = 8;
    let row: Vec<f32> = (0..d).map(|j| j as f32 * 0.375 - 1.0).collect();
    let x: Vec<f32> = (0..5).flat_map(|_| row.clone()).collect();
    for metric in [Metric::Mse, Metric::InnerProduct, Metric::Linf] {
        let p = CodecParams {
            metric,
            skeleton_dtype: SkeletonDtype::F32,
            ..Default::default()
        };
        assert_eq!(roundtrip(&x, 5, d, &p), x, "{metric:?}");
    }
}

#[test]
fn inner_product_decode_restores_the_norm() {
    // The predecessor's inner_product decoder never multiplied by the norm: residuals came
    // back at unit scale. Rows of norm ~40 make that an error of order 1.
    let (n, d) = (512, 64);
    let x: Vec<f32> = gaussian_rows(n, d, 3).iter().map(|v| v * 5.0).collect();
    let base = CodecParams {
        variance_ratio: 1.0,
        k: 1,
        bit_width: 3,
        ..Default::default()
    };
    let mse = rel_err(&x, &roundtrip(&x, n, d, &base));
    let ip = rel_err(
        &x,
        &roundtrip(
            &x,
            n,
            d,
            &CodecParams {
                metric: Metric::InnerProduct,
                ..base.clone()
            },
        ),
    );
    // Nearly everything is residual here, so both sit near the 3-bit Lloyd-Max error.
    assert!(mse < 0.06, "mse {mse}");
    assert!(ip < 0.06, "ip {ip}");
    assert!(
        ip <= mse,
        "least-squares gain must not lose to the norm: {ip} > {mse}"
    );
}

#[test]
fn t_is_rounded_before_the_residual() {
    // Rank-1 rows along v with t values fp16 cannot hold: the rounding error of t lands in
    // the residual and is coded. Coding the unrounded residual (the predecessor) leaves the
    // whole rounding error in the output.
    let d = 4;
    let v = [0.5f32, 0.5, 0.5, 0.5];
    let ts = [1000.3f32, -999.7, 2000.1, -1500.9, 1234.567, 10.01];
    let x: Vec<f32> = ts
        .iter()
        .flat_map(|&t| v.iter().map(move |&c| c * t))
        .collect();
    let p = CodecParams {
        k: 1,
        skeleton_dtype: SkeletonDtype::F32,
        ..Default::default()
    };
    let (e, _) = encode_layer(&x, ts.len(), d, None, &p, Some(1)).unwrap();
    let y = decode_layer(&e, Some(1)).unwrap();
    let (s, c) = &e.blocks[0];
    let t_hat = c.t.decode();
    let basis = Basis {
        d,
        d_eff: s.d_eff,
        mean_exp: 0,
        mean: s.mean.clone(),
        basis: s.basis.clone(),
    };
    let coef = project(&x, &basis);
    let mut worst_t = 0f32;
    let mut worst_out = 0f32;
    for i in 0..ts.len() {
        let g = coef[i * s.d_eff] * s.centers[0];
        worst_t = worst_t.max((g - t_hat[i]).abs());
        let e: f32 = (0..d)
            .map(|j| (x[i * d + j] - y[i * d + j]).powi(2))
            .sum::<f32>()
            .sqrt();
        worst_out = worst_out.max(e);
    }
    assert!(
        worst_t > 0.01,
        "the test needs t values that fp16 rounds: {worst_t}"
    );
    assert!(
        worst_out < 0.5 * worst_t,
        "decoded error {worst_out} vs t rounding {worst_t}"
    );
}

#[test]
fn fp16_overflow_is_handled() {
    // The codec is scale-invariant up to rounding: values far beyond fp16's 65504 must code
    // as well as the same data at unit scale, and nothing may become inf.
    let (n, d) = (64, 16);
    let small: Vec<f32> = gaussian_rows(n, d, 5).iter().map(|v| v + 3.0).collect();
    let big: Vec<f32> = small.iter().map(|v| v * 1e6).collect();
    let p = CodecParams::default();
    let ys = roundtrip(&small, n, d, &p);
    let yb = roundtrip(&big, n, d, &p);
    assert!(yb.iter().all(|v| v.is_finite()));
    let (es, eb) = (rel_err(&small, &ys), rel_err(&big, &yb));
    assert!(
        (es - eb).abs() <= 0.05 * es,
        "unit scale {es}, 1e6 scale {eb}"
    );
}

#[test]
fn randomized_rank_rule_counts_the_total_variance() {
    // Flat spectrum, 40 % of the variance: the randomized rule must agree with exact PCA.
    // Measured against the 40-dimensional sketch only (the predecessor), it stops far sooner.
    let (n, d) = (512, 64);
    let x = gaussian_rows(n, d, 9);
    let m = PcaMethod::Randomized {
        target_rank: Some(32),
        oversample: 8,
        power_iters: 2,
    };
    let exact = pca::fit(&x, n, d, None, PcaMethod::Exact, 0.4, None, 0).unwrap();
    let rand = pca::fit(&x, n, d, None, m, 0.4, None, 0).unwrap();
    assert!(
        rand.d_eff.abs_diff(exact.d_eff) <= 1,
        "{} vs {}",
        rand.d_eff,
        exact.d_eff
    );
    let sketch_total: f64 = rand.eigenvalues.iter().sum();
    let predecessor = pca::select_rank(&rand.eigenvalues, sketch_total, 0.4, 32);
    assert!(
        predecessor + 3 < rand.d_eff,
        "{predecessor} vs {}",
        rand.d_eff
    );
}

#[test]
fn outliers_override_and_are_counted() {
    let (n, d) = (256, 32);
    let mut x = gaussian_rows(n, d, 11);
    for i in 0..n {
        x[i * d + 3] *= 30.0; // a heavy channel
    }
    let plain = CodecParams {
        variance_ratio: 1.0,
        k: 1,
        ..Default::default()
    };
    let with = CodecParams {
        outlier_threshold: Some(2.0),
        ..plain.clone()
    };
    let (e, _) = encode_layer(&x, n, d, None, &with, Some(1)).unwrap();
    let count: usize = e.blocks.iter().map(|b| b.1.outlier_pos.len()).sum();
    assert!(count > 0);
    let a = rel_err(&x, &roundtrip(&x, n, d, &plain));
    let b = rel_err(&x, &decode_layer(&e, Some(1)).unwrap());
    assert!(b < a, "outliers must help: {b} vs {a}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn every_configuration_round_trips(
        seed in any::<u64>(), n in 1usize..200, d in 1usize..40, bits in 1u8..=4,
        metric in 0u8..3, randomized in any::<bool>(), fp32 in any::<bool>(),
        share in any::<bool>(), bs in 1usize..128, outl in any::<bool>(), k in 1usize..20,
    ) {
        let x = gaussian_rows(n, d, seed);
        let p = CodecParams {
            metric: Metric::from_code(metric).unwrap(),
            bit_width: bits,
            block_size: bs,
            k,
            share_basis: share,
            skeleton_dtype: if fp32 { SkeletonDtype::F32 } else { SkeletonDtype::F16 },
            outlier_threshold: outl.then_some(2.5),
            pca_method: if randomized {
                PcaMethod::Randomized { target_rank: None, oversample: 4, power_iters: 1 }
            } else {
                PcaMethod::Exact
            },
            ..Default::default()
        };
        let (e, _) = encode_layer(&x, n, d, None, &p, Some(1)).unwrap();
        let y = decode_layer(&e, Some(1)).unwrap();
        prop_assert_eq!(y.len(), n * d);
        prop_assert_eq!(bits_of(&y), bits_of(&decode_by_rows(&e)));
        prop_assert!(y.iter().all(|v| v.is_finite()));
        // Bounded error: never worse than replacing every row by zero, by a wide margin.
        prop_assert!(rel_err(&x, &y) < 1.5, "{}", rel_err(&x, &y));
        let (bytes, parts) = super::super::container::to_bytes(&e);
        prop_assert_eq!(bytes.len(), parts.total());
        let back = super::super::container::from_bytes(&bytes).unwrap();
        prop_assert_eq!(&back, &e);
    }
}
