//! Test helpers of the instruction sets' tile operations: a bfloat16 synthesis case and bit
//! patterns for exact comparisons.

use super::{bf16_pair, pack_tile, synthesize_bf16_tile, TILE};

/// A bfloat16 synthesis for the instruction sets' tests: `m` components of `d` channels, the
/// centroids and factors spread over the exponent range and around the floor (products near
/// the smallest normal float32), and the definition's keys.
pub(crate) struct SynthCase {
    pub pairs: usize,
    pub packed: Vec<u32>,
    pub mb: Vec<u32>,
    pub g: [f32; TILE],
    pub mean: Vec<f32>,
    pub want: Vec<f32>,
}

impl SynthCase {
    /// A value for [`SynthCase`]: a mantissa in `[-0.5, 0.5)` times `2^e`, `e` in `-70 .. 70`.
    pub fn value(g: &mut crate::rng::SplitMix64) -> f32 {
        let e = (g.next_u64() % 140) as i32 - 70;
        let m = (g.next_u64() >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
        m * 2f32.powi(e)
    }

    pub fn new(g: &mut crate::rng::SplitMix64, m: usize, d: usize) -> Self {
        let tile: Vec<f32> = (0..m * TILE).map(|_| Self::value(g)).collect();
        let msyn: Vec<f32> = (0..m * d).map(|_| Self::value(g)).collect();
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
        SynthCase {
            pairs,
            packed,
            mb,
            g: gs,
            mean,
            want,
        }
    }
}

/// The bit patterns of `v` (for comparisons that tell -0 from +0 and NaNs apart).
pub(crate) fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}
