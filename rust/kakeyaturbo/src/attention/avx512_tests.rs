//! Tests of `avx512.rs`: the bfloat16 and fixed-point syntheses against their definitions, and
//! the look-ups against the portable kernel's.

use super::super::kernel::testutil::{bits, check_i16_synthesis, check_look_ups, SynthCase};
use super::*;
use crate::rng::SplitMix64;

/// Both BF16 syntheses (`vdpbf16ps` where the CPU has it, float32 `fma` pairs) against
/// the definition.
#[test]
fn bf16_synthesis_matches_the_definition() {
    if !available() {
        return;
    }
    let mut g = SplitMix64::new(7);
    for (m, d) in [(1, 1), (7, 5), (56, 64), (33, 128)] {
        let c = SynthCase::new(&mut g, m, d);
        let y = Affine {
            g: &c.g,
            mean: &c.mean,
        };
        let mut fma = vec![0f32; d * TILE];
        unsafe {
            for d0 in 0..d {
                synthesize_bf16_fma::<1>(d, d0, c.pairs, &c.packed, &c.mb, &y, &mut fma);
            }
        }
        assert_eq!(bits(&fma), bits(&c.want), "fma pairs, m {m} d {d}");
        if has_bf16() {
            let mut dp = vec![0f32; d * TILE];
            Avx512.synthesize_bf16(d, c.pairs, &c.packed, &c.mb, &c.g, &c.mean, &mut dp);
            assert_eq!(bits(&dp), bits(&c.want), "vdpbf16ps, m {m} d {d}");
        }
    }
}

/// The fixed-point synthesis, with `vpdpwssd` where the CPU has it and with `vpmaddwd` +
/// `vpaddd`, against the definition ([`check_i16_synthesis`]).
#[test]
fn i16_synthesis_matches_the_definition() {
    if !available() {
        return;
    }
    check_i16_synthesis(|d, pairs, packed, f, g, mean, rot, keys| {
        Avx512.synthesize_i16_rotated(d, pairs, packed, f, g, mean, rot, keys)
    });
    check_i16_synthesis(|d, pairs, packed, f, g, mean, rot, keys| {
        // SAFETY: `available` holds (AVX-512 F and BW); `check_i16_synthesis` sizes the inputs.
        unsafe { synth::synthesize_i16_madd(d, pairs, packed, f, &Affine { g, mean }, rot, keys) }
    });
}

/// The look-ups (the float32 tile, the bfloat16 and the fixed-point packed pairs) against the
/// portable kernel's ([`check_look_ups`]).
#[test]
fn look_ups_match_the_portable_ones() {
    if available() {
        check_look_ups(Avx512);
    }
}
