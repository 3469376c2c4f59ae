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
        let (bytes, parts) = c.to_bytes(&codes);
        prop_assert_eq!(bytes.len(), parts.total());
        let back = c.from_bytes(&bytes).unwrap();
        prop_assert_eq!(&back, &codes);
        let y = c.decode(&back).unwrap();
        prop_assert_eq!(y.len(), n * d);
        prop_assert!(y.iter().all(|v| v.is_finite()));
        let parts = c.encode_parts(&x, n).unwrap();
        prop_assert_eq!(c.unpack(&codes).unwrap(), parts.indices);
    }
}
