//! Tests of `avx2.rs`: the bfloat16 synthesis against its definition.

use super::super::kernel::{bits, synthesize_bf16_tile, SynthCase};
use super::super::rope::RopeStyle;
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
        let trig: Vec<f32> = (0..2 * half * TILE)
            .map(|_| SynthCase::value(&mut g))
            .collect();
        let (cos, sin) = trig.split_at(half * TILE);
        for style in [RopeStyle::Half, RopeStyle::Interleaved] {
            let rot = Rot {
                cos,
                sin,
                stride: TILE,
                offset: 0,
                half,
                style,
            };
            rotate_tile(&rot, &mut want);
            Avx2.synthesize_bf16_rotated(d, pairs, &c.packed, &c.mb, &c.g, &c.mean, &rot, &mut got);
            assert_eq!(bits(&got), bits(&want), "rotated {style:?}, m {m} d {d}");
            synthesize_bf16_tile(d, pairs, &c.packed, &c.mb, &c.g, &c.mean, &mut want);
        }
    }
}
