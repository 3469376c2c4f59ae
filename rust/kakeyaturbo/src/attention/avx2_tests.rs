//! Tests of `avx2.rs`: the bfloat16 and fixed-point syntheses against their definitions.

use super::super::kernel::testutil::{
    bits, check_i16_synthesis, check_look_ups, each_rot, SynthCase,
};
use super::super::kernel::{rotate_tile, synthesize_bf16_tile};
use super::*;
use crate::rng::SplitMix64;

/// The synthesis, plain and rotated (both pairings), against the definition.
#[test]
fn bf16_synthesis_matches_the_definition() {
    if !available() {
        return;
    }
    let mut g = SplitMix64::new(7);
    for (m, d, half) in [
        (1, 1, 0),
        (7, 5, 2),
        (56, 64, 32),
        (33, 128, 16),
        (20, 40, 20),
    ] {
        let c = SynthCase::new(&mut g, m, d);
        let (pairs, mut want) = (c.pairs, c.want.clone());
        let mut got = vec![0f32; d * TILE];
        Avx2.synthesize_bf16(d, pairs, &c.packed, &c.mb, &c.g, &c.mean, &mut got);
        assert_eq!(bits(&got), bits(&want), "m {m} d {d}");
        each_rot(&mut g, half, |rot| {
            rotate_tile(rot, &mut want);
            Avx2.synthesize_bf16_rotated(d, pairs, &c.packed, &c.mb, &c.g, &c.mean, rot, &mut got);
            assert_eq!(
                bits(&got),
                bits(&want),
                "rotated {:?}, m {m} d {d}",
                rot.style
            );
            synthesize_bf16_tile(d, pairs, &c.packed, &c.mb, &c.g, &c.mean, &mut want);
        });
    }
}

/// The fixed-point synthesis, with `vpdpwssd` where the CPU has AVX-VNNI and with
/// `vpmaddwd` + `vpaddd`, against the definition ([`check_i16_synthesis`]).
#[test]
fn i16_synthesis_matches_the_definition() {
    if !available() {
        return;
    }
    check_i16_synthesis(|d, pairs, packed, f, g, mean, rot, keys| {
        Avx2.synthesize_i16_rotated(d, pairs, packed, f, g, mean, rot, keys)
    });
    check_i16_synthesis(|d, pairs, packed, f, g, mean, rot, keys| {
        // SAFETY: `available` holds; `check_i16_synthesis` sizes the inputs.
        unsafe { rotated(d, pairs, packed, Weights::I16(f), g, mean, rot, keys) }
    });
}

/// The scores of a synthesised tile and the code-domain value sums, against their definitions,
/// bit for bit: every query-row count from 1 to 9 (one to three passes of up to 3 rows).
#[test]
fn float_sums_match_their_definitions() {
    use super::super::kernel::{acc_tile, dots_tile};
    if !available() {
        return;
    }
    let mut g = SplitMix64::new(13);
    let mut draw = |n: usize| -> Vec<f32> { (0..n).map(|_| SynthCase::value(&mut g)).collect() };
    for (m, d) in [(1, 1), (7, 5), (56, 64), (33, 128)] {
        for qr in 1..=9 {
            let (qs, keys) = (draw(qr * d), draw(d * TILE));
            let (mut want, mut got) = (vec![0f32; qr * TILE], vec![1f32; qr * TILE]);
            dots_tile(&qs, d, qr, &keys, &mut want);
            // SAFETY: `available` holds.
            unsafe { float_sums::dots(&qs, d, qr, &keys, &mut got) };
            assert_eq!(bits(&got), bits(&want), "dots: m {m} d {d} rows {qr}");
            let (tile, pg, acc) = (draw(m * TILE), draw(qr * TILE), draw(qr * m * 16));
            let (mut want, mut got) = (acc.clone(), acc);
            acc_tile(m, &tile, &pg, qr, &mut want);
            // SAFETY: `available` holds.
            unsafe { float_sums::accumulate(m, &tile, &pg, qr, &mut got) };
            assert_eq!(bits(&got), bits(&want), "accumulate: m {m} rows {qr}");
        }
    }
}

/// The look-ups against the portable kernel's ([`check_look_ups`]).
#[test]
fn look_ups_match_the_portable_ones() {
    if available() {
        check_look_ups(Avx2);
    }
}
