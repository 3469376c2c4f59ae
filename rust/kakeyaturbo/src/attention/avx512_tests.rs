//! Tests of `avx512.rs`: the bfloat16 syntheses against their definition.

use super::super::kernel::{bf16_pair, pack_tile, synthesize_bf16_tile};
use super::*;
use crate::rng::SplitMix64;

/// Both BF16 syntheses (`vdpbf16ps` where the CPU has it, float32 `fma` pairs) against
/// the definition, on values spread over the exponent range and around
/// the floor (products near the smallest normal float32).
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
    for (m, d) in [(1, 1), (7, 5), (56, 64), (33, 128)] {
        let tile: Vec<f32> = (0..m * TILE).map(|_| val(&mut g)).collect();
        let msyn: Vec<f32> = (0..m * d).map(|_| val(&mut g)).collect();
        let pairs = m.div_ceil(2);
        let at = |j: usize, i: usize| if j < m { msyn[j * d + i] } else { 0.0 };
        let mb: Vec<u32> = (0..pairs)
            .flat_map(|p| (0..d).map(move |i| (p, i)))
            .map(|(p, i)| bf16_pair(at(2 * p, i), at(2 * p + 1, i)))
            .collect();
        let mut want_p = vec![0u32; pairs * TILE];
        pack_tile(m, &tile, &mut want_p);
        let gs: [f32; TILE] = std::array::from_fn(|t| 0.5 + t as f32 / 64.0);
        let mean: Vec<f32> = (0..d).map(|i| i as f32 - 2.5).collect();
        let y = Affine {
            g: &gs,
            mean: &mean,
        };
        let mut want = vec![0f32; d * TILE];
        synthesize_bf16_tile(d, pairs, &want_p, &mb, &gs, &mean, &mut want);
        let mut fma = vec![0f32; d * TILE];
        unsafe {
            for d0 in 0..d {
                synthesize_bf16_fma::<1>(d, d0, pairs, &want_p, &mb, &y, &mut fma);
            }
        }
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&fma), bits(&want), "fma pairs, m {m} d {d}");
        if has_bf16() {
            let mut dp = vec![0f32; d * TILE];
            Avx512.synthesize_bf16(d, pairs, &want_p, &mb, &gs, &mean, &mut dp);
            assert_eq!(bits(&dp), bits(&want), "vdpbf16ps, m {m} d {d}");
        }
    }
}
