//! Tests of `avx512.rs`: the bfloat16 syntheses against their definition.

use super::super::kernel::testutil::{bits, SynthCase};
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
