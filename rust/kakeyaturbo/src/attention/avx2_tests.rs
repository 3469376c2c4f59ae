//! Tests of `avx2.rs`: the bfloat16 and fixed-point syntheses against their definitions.

use super::super::kernel::testutil::{bits, SynthCase};
use super::super::kernel::{rotate_tile, synthesize_bf16_tile};
use super::super::rope::RopeStyle;
use super::*;
use crate::rng::SplitMix64;

/// `f(rot)` for a random table of `half` frequencies in both pairings.
fn each_rot(g: &mut SplitMix64, half: usize, mut f: impl FnMut(&Rot<'_>)) {
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

/// The fixed-point synthesis, rotated (both pairings, and no rotated frequency), against the
/// definition: weights from a random `M` spread over the exponent range, centroids of every
/// 16-bit value including both limits.
#[test]
fn i16_synthesis_matches_the_definition() {
    use super::super::fixed;
    if !available() {
        return;
    }
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
            Avx2.synthesize_i16_rotated(d, pairs, &packed, &f, &gs, &mean, rot, &mut got);
            let style = rot.style;
            assert_eq!(
                bits(&got),
                bits(&want),
                "{style:?}, m {m} d {d} half {half}"
            );
        });
    }
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

/// A tile's look-ups (the float32 tile, the bfloat16 and the fixed-point packed pairs) against
/// the portable kernel's, bit for bit: every width from 1 to 8 bits, alone and mixed, odd and
/// even component counts, rows of up to 32 bytes (read whole), of 40 (the words past 32 bytes
/// gathered) and of 72 (all gathered), tiles of 1 to 64 rows at several offsets (8-row groups
/// whole, half of a 16-row pair, and a block's last rows, read from a zero-padded copy: the
/// test's codes have no outliers, so the codes end the block's bytes).
#[test]
fn look_ups_match_the_portable_ones() {
    use super::super::store::SealedBlock;
    use crate::calibrated::testutil::{codec, rows};
    use crate::metric::Metric;
    if !available() {
        return;
    }
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
            Avx2.centroids(&t, &b, row0, rows, &mut a);
            Portable.centroids(&t, &b, row0, rows, &mut p);
            assert_eq!(bits(&a.tile), bits(&p.tile), "{widths:?} {row0}+{rows}");
            for fixed in [false, true] {
                let (mut a, mut p) = (scratch(), scratch());
                if fixed {
                    Avx2.centroids_i16(&t, &b, row0, rows, &mut a);
                    Portable.centroids_i16(&t, &b, row0, rows, &mut p);
                } else {
                    Avx2.centroids_bf16(&t, &b, row0, rows, &mut a);
                    Portable.centroids_bf16(&t, &b, row0, rows, &mut p);
                }
                assert_eq!(a.packed, p.packed, "{widths:?} {row0}+{rows} fixed {fixed}");
            }
        }
    }
}
