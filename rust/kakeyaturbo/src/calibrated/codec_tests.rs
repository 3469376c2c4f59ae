//! Tests of `codec.rs` and `codec_decode.rs`: rows to codes and back.

use super::super::testutil::{codec, noise, rel, rows};
use super::*;
use crate::limits::SAFE_F32;
use crate::rng::SplitMix64;
use proptest::prelude::*;

#[test]
fn error_falls_with_bits_as_lloyd_max_predicts() {
    // Every component at b bits: the relative error (against the centred energy) is about
    // the N(0,1) Lloyd-Max distortion of b bits.
    let lm = [0.3634, 0.1175, 0.03455, 0.0095, 0.0025, 0.00064];
    for (b, want) in (1..=6).zip(lm) {
        let c = codec(32, vec![b; 32], true, Metric::Mse, None);
        let x = rows(&c, 2048, 3);
        let y = c.decode(&c.encode(&x, 2048).unwrap()).unwrap();
        let e = rel(&x, &y, &c.mean);
        assert!((e / want - 1.0).abs() < 0.25, "b = {b}: {e} vs {want}");
    }
}

#[test]
fn deterministic_across_thread_counts() {
    let c = codec(16, vec![3; 12], true, Metric::Mse, Some(3.0));
    let x = rows(&c, 1000, 9);
    let a = crate::threads::with_threads(Some(1), || c.encode(&x, 1000))
        .unwrap()
        .unwrap();
    let b = crate::threads::with_threads(Some(2), || c.encode(&x, 1000))
        .unwrap()
        .unwrap();
    assert_eq!(a, b);
}

#[test]
fn rows_beyond_the_float32_range_are_coded_in_f64() {
    // The same calibration for rows 1e9 times larger, with spreads 1e-30 times smaller:
    // the coefficients are 1e39 times larger and overflow float32. norm makes the codec
    // scale-invariant, so the error must match the unit calibration's.
    let unit = codec(12, vec![4; 8], true, Metric::InnerProduct, Some(2.5));
    let tiny = CalibratedCodec::new(
        unit.d,
        unit.mean.iter().map(|v| v * 1e9).collect(),
        unit.analysis.clone(),
        unit.synthesis.clone(),
        unit.spread.iter().map(|v| v * 1e-30).collect(),
        unit.bits.clone(),
        vec![],
        unit.params.clone(),
    )
    .unwrap();
    let x = rows(&unit, 300, 4);
    let big: Vec<f32> = x.iter().map(|v| v * 1e9).collect();
    let codes = tiny.encode(&big, 300).unwrap();
    let y = tiny
        .decode(&tiny.from_bytes(&tiny.to_bytes(&codes).0).unwrap())
        .unwrap();
    assert!(y.iter().all(|v| v.is_finite()));
    let r = rel(&big, &y, &tiny.mean);
    let ru = rel(
        &x,
        &unit.decode(&unit.encode(&x, 300).unwrap()).unwrap(),
        &unit.mean,
    );
    assert!((r / ru - 1.0).abs() < 0.05, "{r} vs {ru}");
}

#[test]
fn huge_or_negative_scales_decode_to_finite_values() {
    // Found by `make fuzz`: a negative scale of a large magnitude slipped past the bound
    // that lets ordinary rows skip the scan of their output.
    let c = codec(16, vec![1, 1, 1], true, Metric::Mse, Some(0.5));
    let mut codes = c.encode(&rows(&c, 9, 2), 9).unwrap();
    let s = codes.scale.as_mut().unwrap();
    s.exp = 120;
    s.bits[3] |= 0x8000;
    s.bits[5] = 0xfbff; // -65504
    let y = c.decode(&codes).unwrap();
    assert!(y.iter().all(|v| v.is_finite()));
}

#[test]
fn overflows_multiplied_by_zero_are_caught() {
    // The per-block twin was found by `make fuzz`: a bound that only looks at the output
    // (here the synthesis, 0) misses a scale whose q * g overflows on the way. Every
    // intermediate must count.
    assert!(row_bound(3e38, 0.0, 65504.0, 0.0) > SAFE_F32);
    assert!(row_bound(-3e38, 1.0, 1.0, 1.0) > SAFE_F32);
    assert!(row_bound(f32::INFINITY, 1.0, 1.0, 0.0) > SAFE_F32);
    assert!(row_bound(1e3, 1.0, 8.0 * 2.7, 8.0) <= SAFE_F32);
}

#[test]
fn reconstructions_past_the_float32_maximum_saturate() {
    let c = CalibratedCodec::new(
        1,
        vec![0.0],
        vec![1.0],
        vec![1.0],
        vec![3e38],
        vec![2],
        vec![],
        crate::calibrated::CalibratedParams {
            rotation_seed: 1,
            metric: Metric::Mse,
            outlier_threshold: None,
            norm: false,
        },
    )
    .unwrap();
    let y = c
        .decode(&c.encode(&[-3.3e38, 3.3e38, 1e30], 3).unwrap())
        .unwrap();
    assert_eq!(y[0], -f32::MAX);
    assert_eq!(y[1], f32::MAX);
    assert!(y[2].is_finite());
}

/// FORMAT.md's encode of ordinary rows one row at a time (the encode as it was before the
/// column-major chunks): the projection as one product per chunk over row-major components,
/// the rms scale, then per row and sub-band the signs, the butterfly and `norm / g`, the
/// Lloyd-Max indices, outliers, the gain of `inner_product`, and the row packed. With `z`.
fn encode_by_rows(c: &CalibratedCodec, x: &[f32], n: usize) -> (CalibratedCodes, Vec<f32>) {
    let (d, m, rb) = (c.d, c.m, c.row_bytes());
    let mut u = vec![0f32; n * m];
    for (uc, xc) in u.chunks_mut(CHUNK_ROWS * m).zip(x.chunks(CHUNK_ROWS * d)) {
        let rows = xc.len() / d;
        let xm: Vec<f32> = xc
            .chunks_exact(d)
            .flat_map(|r| r.iter().zip(&c.mean).map(|(v, mu)| v - mu))
            .collect();
        matmul(
            MatMut::from_row_major_slice_mut(uc, rows, m),
            Accum::Replace,
            MatRef::from_row_major_slice(&xm, rows, d),
            MatRef::from_row_major_slice(&c.a_scaled, m, d).transpose(),
            1.0,
            Par::Seq,
        );
    }
    let rms: Vec<f32> = u
        .chunks_exact(m)
        .map(|r| (r.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / m as f64).sqrt() as f32)
        .collect();
    let scale = c.params.norm.then(|| ScaledF16::encode(&rms));
    let g: Vec<f32> = scale.as_ref().map_or(vec![1.0; n], |s| s.decode());
    let (mut codes, mut pos, mut val, mut gains) = (vec![0u8; n * rb], vec![], vec![], vec![]);
    let (mut idx, mut qv) = (vec![0u8; m], vec![0f32; m]);
    for (r, zr) in u.chunks_exact_mut(m).enumerate() {
        for band in &c.bands {
            let (o, w) = (band.offset, band.width);
            wht::rotate(&mut zr[o..o + w], &c.signs[o..o + w]);
            let f = if g[r] > 0.0 { band.norm / g[r] } else { 0.0 };
            zr[o..o + w].iter_mut().for_each(|v| *v *= f);
            let q = c.q(band.bits);
            q.quantize_slice(&zr[o..o + w], &mut idx[o..o + w]);
            q.dequantize_slice(&idx[o..o + w], &mut qv[o..o + w]);
        }
        assert!(zr.iter().all(|v| v.is_finite()), "an ordinary row");
        for (j, &zj) in zr.iter().enumerate() {
            if c.params.outlier_threshold.is_some_and(|th| zj.abs() > th) {
                let h = f16::from_f32(zj.clamp(-65504.0, 65504.0));
                pos.push((r * m + j) as u32);
                val.push(h.to_bits());
                qv[j] = h.to_f32();
            }
        }
        gains.push(least_squares_gain(g[r], zr, &qv));
        crate::pack::pack_fields(
            idx.iter().zip(&c.bits).map(|(&v, &b)| (v as u32, b as u32)),
            &mut codes[r * rb..(r + 1) * rb],
        );
    }
    let ip = c.params.metric == Metric::InnerProduct;
    let codes = CalibratedCodes {
        n,
        scale: if ip {
            Some(ScaledF16::encode(&gains))
        } else {
            scale
        },
        codes,
        outlier_pos: pos,
        outlier_val: val,
    };
    (codes, u)
}

/// FORMAT.md's decode of ordinary rows one row at a time (the decode as it was before the
/// column-major chunks): unpack, centroids, outliers, then per sub-band times `g * norm`, the
/// butterfly and the signs, and the synthesis as one product over the row-major components.
fn decode_by_rows(c: &CalibratedCodec, k: &CalibratedCodes) -> Vec<f32> {
    let (d, m) = (c.d, c.m);
    let idx = c.unpack(k).unwrap();
    let g: Vec<f32> = k.scale.as_ref().map_or(vec![1.0; k.n], |s| s.decode());
    let mut u = vec![0f32; k.n * m];
    for (r, ur) in u.chunks_exact_mut(m).enumerate() {
        for band in &c.bands {
            let (of, w) = (band.offset, band.width);
            c.q(band.bits)
                .dequantize_slice(&idx[r * m + of..r * m + of + w], &mut ur[of..of + w]);
        }
    }
    for (&p, &h) in k.outlier_pos.iter().zip(&k.outlier_val) {
        u[p as usize] = f16::from_bits(h).to_f32();
    }
    for (r, ur) in u.chunks_exact_mut(m).enumerate() {
        for band in &c.bands {
            let (of, w) = (band.offset, band.width);
            let f = g[r] * band.norm;
            let seg = &mut ur[of..of + w];
            seg.iter_mut().for_each(|v| *v *= f);
            wht::fwht(seg);
            seg.iter_mut()
                .zip(&c.signs[of..of + w])
                .for_each(|(v, s)| *v *= s);
        }
    }
    let mut out: Vec<f32> = (0..k.n).flat_map(|_| c.mean.iter().copied()).collect();
    for (oc, uc) in out.chunks_mut(CHUNK_ROWS * d).zip(u.chunks(CHUNK_ROWS * m)) {
        let rows = uc.len() / m;
        matmul(
            MatMut::from_row_major_slice_mut(oc, rows, d),
            Accum::Add,
            MatRef::from_row_major_slice(uc, rows, m),
            MatRef::from_row_major_slice(&c.s_scaled, m, d),
            1.0,
            Par::Seq,
        );
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn every_configuration_round_trips(
        seed in any::<u64>(), n in 1usize..300, d in 1usize..40, m_frac in 0.05f64..1.0,
        bmax in 1u8..=8, norm in any::<bool>(), ip in any::<bool>(), outl in any::<bool>(),
    ) {
        let m = ((d as f64 * m_frac).ceil() as usize).clamp(1, d);
        let bits: Vec<u8> = (0..m).map(|j| (bmax as usize).saturating_sub(j / 3).max(1) as u8).collect();
        let metric = if ip && norm { Metric::InnerProduct } else { Metric::Mse };
        let c = codec(d, bits, norm, metric, outl.then_some(2.0));
        let mut g = SplitMix64::new(seed);
        let x: Vec<f32> = (0..n * d).map(|_| noise(&mut g) * 3.0).collect();
        let codes = c.encode(&x, n).unwrap();
        // The codes (and z) of coding the rows one at a time, byte for byte.
        let (want, z) = encode_by_rows(&c, &x, n);
        prop_assert_eq!(&codes, &want);
        let bits_of = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        prop_assert_eq!(bits_of(&c.encode_parts(&x, n).unwrap().z), bits_of(&z));
        let (bytes, parts) = c.to_bytes(&codes);
        prop_assert_eq!(bytes.len(), parts.total());
        let back = c.from_bytes(&bytes).unwrap();
        prop_assert_eq!(&back, &codes);
        let y = c.decode(&back).unwrap();
        prop_assert_eq!(y.len(), n * d);
        // Bit for bit the decode one row at a time (these rows are all ordinary).
        prop_assert_eq!(bits_of(&y), bits_of(&decode_by_rows(&c, &back)));
        prop_assert!(y.iter().all(|v| v.is_finite()));
        let parts = c.encode_parts(&x, n).unwrap();
        prop_assert_eq!(c.unpack(&codes).unwrap(), parts.indices);
    }
}
