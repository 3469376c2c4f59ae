//! Tests of `avx2.rs`: the bfloat16 synthesis against its definition.

use super::super::kernel::{bf16_pair, pack_tile, synthesize_bf16_tile};
use super::*;
use crate::rng::SplitMix64;

/// The synthesis, plain and rotated, against the definition, on values spread over the
/// exponent range and around the floor (products near the smallest normal float32).
#[test]
fn bf16_synthesis_matches_the_definition() {
    if !available() {
        return;
    }
    let mut g = SplitMix64::new(7);
    let val = |g: &mut SplitMix64| {
        let e = (g.next_u64() % 140) as i32 - 70;
        let m = (g.next_u64() >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
        m * 2f32.powi(e)
    };
    for (m, d, half) in [
        (1, 1, 0),
        (7, 5, 2),
        (56, 64, 32),
        (33, 128, 16),
        (20, 40, 20),
    ] {
        let tile: Vec<f32> = (0..m * TILE).map(|_| val(&mut g)).collect();
        let msyn: Vec<f32> = (0..m * d).map(|_| val(&mut g)).collect();
        let pairs = m.div_ceil(2);
        let at = |j: usize, i: usize| if j < m { msyn[j * d + i] } else { 0.0 };
        let mb: Vec<u32> = (0..pairs)
            .flat_map(|p| (0..d).map(move |i| (p, i)))
            .map(|(p, i)| bf16_pair(at(2 * p, i), at(2 * p + 1, i)))
            .collect();
        let mut packed = vec![0u32; pairs * TILE];
        pack_tile(m, &tile, &mut packed);
        let gs: [f32; TILE] = std::array::from_fn(|t| 0.5 + t as f32 / 64.0);
        let mean: Vec<f32> = (0..d).map(|i| i as f32 - 2.5).collect();
        let mut want = vec![0f32; d * TILE];
        synthesize_bf16_tile(d, pairs, &packed, &mb, &gs, &mean, &mut want);
        let mut got = vec![0f32; d * TILE];
        Avx2.synthesize_bf16(d, pairs, &packed, &mb, &gs, &mean, &mut got);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got), bits(&want), "m {m} d {d}");
        let trig: Vec<f32> = (0..2 * half * TILE).map(|_| val(&mut g)).collect();
        let (cos, sin) = trig.split_at(half * TILE);
        for style in [
            super::super::rope::RopeStyle::Half,
            super::super::rope::RopeStyle::Interleaved,
        ] {
            let rot = Rot {
                cos,
                sin,
                stride: TILE,
                offset: 0,
                half,
                style,
            };
            rotate_tile(&rot, &mut want);
            Avx2.synthesize_bf16_rotated(d, pairs, &packed, &mb, &gs, &mean, &rot, &mut got);
            assert_eq!(bits(&got), bits(&want), "rotated {style:?}, m {m} d {d}");
            synthesize_bf16_tile(d, pairs, &packed, &mb, &gs, &mean, &mut want);
        }
    }
}
