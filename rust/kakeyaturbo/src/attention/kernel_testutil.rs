//! Test helpers of the instruction sets' tile operations: a bfloat16 synthesis case and bit
//! patterns for exact comparisons.

use super::super::fixed::{self, FixedSynthesis};
use super::super::rope::RopeStyle;
use super::super::store::SealedBlock;
use super::super::tables::StreamTables;
use super::{
    bf16_pair, pack_tile, rotate_tile, synthesize_bf16_tile, Portable, Rot, Scratch, Tile, TILE,
};
use crate::calibrated::testutil::{codec, rows};
use crate::metric::Metric;
use crate::rng::SplitMix64;

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

/// `f(rot)` for a random table of `half` frequencies in both pairings.
pub(crate) fn each_rot(g: &mut SplitMix64, half: usize, mut f: impl FnMut(&Rot<'_>)) {
    let trig: Vec<f32> = (0..2 * half * TILE).map(|_| SynthCase::value(g)).collect();
    let (cos, sin) = trig.split_at(half * TILE);
    for style in [RopeStyle::Half, RopeStyle::Interleaved] {
        f(&Rot {
            cos,
            sin,
            stride: TILE,
            offset: 0,
            half,
            style,
        });
    }
}

/// The fixed-point synthesis, rotated (both pairings, and no rotated frequency), against the
/// definition: weights from a random `M` spread over the exponent range, centroids of every
/// 16-bit value including both limits.
/// `run`: the kernel's `synthesize_i16_rotated`.
pub(crate) fn check_i16_synthesis(
    mut run: impl FnMut(
        usize,
        usize,
        &[u32],
        &FixedSynthesis,
        &[f32; TILE],
        &[f32],
        &Rot<'_>,
        &mut [f32],
    ),
) {
    let mut g = SplitMix64::new(11);
    for (m, d, half) in [
        (1, 1, 0),
        (7, 5, 2),
        (56, 64, 32),
        (33, 128, 16),
        (20, 40, 0),
    ] {
        let msyn: Vec<f32> = (0..m * d).map(|_| SynthCase::value(&mut g)).collect();
        let f = fixed::FixedSynthesis::new(&msyn, m, d);
        let pairs = m.div_ceil(2);
        let packed: Vec<u32> = (0..pairs * TILE)
            .map(|i| match i % 5 {
                0 => fixed::pair(32767, -32767),
                _ => {
                    let v = |g: &mut SplitMix64| (g.next_u64() % 65535) as i32 - 32767;
                    let lo = v(&mut g);
                    fixed::pair(lo, if 2 * (i / TILE) + 1 < m { v(&mut g) } else { 0 })
                }
            })
            .collect();
        let gs: [f32; TILE] = std::array::from_fn(|t| 0.5 + t as f32 / 64.0);
        let mean: Vec<f32> = (0..d).map(|i| i as f32 - 2.5).collect();
        each_rot(&mut g, half, |rot| {
            let mut want = vec![0f32; d * TILE];
            fixed::synthesize_tile(d, pairs, &packed, &f.words, &f.unit, &gs, &mean, &mut want);
            rotate_tile(rot, &mut want);
            let mut got = vec![0f32; d * TILE];
            run(d, pairs, &packed, &f, &gs, &mean, rot, &mut got);
            let style = rot.style;
            assert_eq!(
                bits(&got),
                bits(&want),
                "{style:?}, m {m} d {d} half {half}"
            );
        });
    }
}

/// A tile's look-ups (the float32 tile, the bfloat16 and the fixed-point packed pairs) against
/// the portable kernel's, bit for bit: every width from 1 to 8 bits, alone and mixed, odd and
/// even component counts, rows of up to 32 bytes (read whole), of 40 (the words past 32 bytes
/// gathered) and of 72 (all gathered), tiles of 1 to 64 rows at several offsets (8-row groups
/// whole, half of a 16-row pair, and a block's last rows, read from a zero-padded copy: the
/// test's codes have no outliers, so the codes end the block's bytes).
pub(crate) fn check_look_ups<T: Tile>(k: T) {
    let mut cases: Vec<Vec<u8>> = (1..=8).map(|b| vec![b; 9]).collect();
    cases.push((0..40).map(|j| 8 - (j / 5) as u8).collect());
    cases.push(vec![4, 3, 4, 3, 2, 4, 1, 4, 5, 4, 3]);
    cases.push(vec![4; 64]);
    // Rows of 40 bytes: the first 32 transposed, the rest gathered; of 72: all gathered.
    cases.push(vec![5; 64]);
    cases.push(vec![8; 72]);
    for widths in cases {
        let c = codec(
            widths.len().max(64),
            widths.clone(),
            true,
            Metric::Mse,
            None,
        );
        let t = StreamTables::new(&c);
        let n = 150;
        let codes = c.encode(&rows(&c, n, 3), n).unwrap();
        let b = SealedBlock::parse(&t, c.to_bytes(&codes).0).unwrap();
        let scratch = || Scratch {
            packed: vec![0u32; t.m.div_ceil(2) * TILE],
            ..Scratch::for_tables([&t])
        };
        for (row0, rows) in [
            (0, 64),
            (64, 64),
            (0, 8),
            (0, 24),
            (8, 40),
            (3, 57),
            (100, 50),
            (149, 1),
            (90, 1),
            (130, 20),
        ] {
            let (mut a, mut p) = (scratch(), scratch());
            k.centroids(&t, &b, row0, rows, &mut a);
            Portable.centroids(&t, &b, row0, rows, &mut p);
            assert_eq!(bits(&a.tile), bits(&p.tile), "{widths:?} {row0}+{rows}");
            for fixed in [false, true] {
                let (mut a, mut p) = (scratch(), scratch());
                if fixed {
                    k.centroids_i16(&t, &b, row0, rows, &mut a);
                    Portable.centroids_i16(&t, &b, row0, rows, &mut p);
                } else {
                    k.centroids_bf16(&t, &b, row0, rows, &mut a);
                    Portable.centroids_bf16(&t, &b, row0, rows, &mut p);
                }
                assert_eq!(a.packed, p.packed, "{widths:?} {row0}+{rows} fixed {fixed}");
            }
        }
    }
}
