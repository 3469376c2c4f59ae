//! A layer tensor `[N, D]`: row blocks, `share_basis`, the tail, threads.
//!
//! Rows are cut into blocks of `block_size`; the last `N mod block_size` rows (the tail) form a
//! shorter block coded the same way, so every row comes back and every byte of the tail is
//! counted. Blocks are independent, so they are coded in parallel; each block is computed
//! sequentially, which makes the bytes independent of the thread count.

use super::block::{self, Basis, BlockCodes, Rotation, Skeleton, StageTimes};
use super::decode;
use super::params::{CodecParams, SkeletonDtype};
use crate::error::{param, Result};
use crate::f16::{pow2, to_bits_scaled, ScaledF16};
use crate::limits::{check_input, saturate, size, zeros};
use crate::quant::Quantizer;
use crate::threads::with_threads_for;
use rayon::prelude::*;
use std::sync::Arc;

/// A layer in coded form, independent of its byte layout (see [`super::container`]).
#[derive(Debug, Clone, PartialEq)]
pub struct EncodedLayer {
    pub params: CodecParams,
    pub n: usize,
    pub d: usize,
    /// The layer-wide mean and basis when `params.share_basis`.
    pub shared: Option<Basis>,
    pub blocks: Vec<(Skeleton, BlockCodes)>,
}

impl EncodedLayer {
    pub fn quantizer(&self) -> Result<Quantizer> {
        self.params.validate()
    }
}

fn block_ranges(n: usize, bs: usize) -> Vec<(usize, usize)> {
    (0..n.div_ceil(bs))
        .map(|b| (b * bs, ((b + 1) * bs).min(n)))
        .collect()
}

/// Inputs whose largest magnitude exceeds `2^PRESCALE_ABOVE` are coded divided by a power of
/// two: the float32 arithmetic of the encoder (squared norms of residuals up to
/// `2^8 * max|x|`) stays far from overflow below it. Ordinary inputs are never pre-scaled, so
/// their bytes do not depend on this rule.
pub const PRESCALE_ABOVE: i32 = 50;

/// The `s` by which `x` is divided (`x * 2^-s`) before coding: 0 up to `2^PRESCALE_ABOVE`,
/// else the smallest `s` that brings the largest magnitude down to it.
pub fn prescale_exponent(x: &[f32]) -> i32 {
    let m = x.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
    let limit = 2f64.powi(PRESCALE_ABOVE);
    let mut s = 0;
    while m * 2f64.powi(-s) > limit {
        s += 1;
    }
    s
}

/// Multiplies the stored mean by `2^s`: exactly (a new shared exponent) when it stays in
/// range; an fp16 mean that would round past `f32::MAX` is stepped back to stay finite.
fn scale_mean(dtype: SkeletonDtype, exp: &mut i8, mean: &mut Arc<Vec<f32>>, s: i32) -> Result<()> {
    match dtype {
        SkeletonDtype::F16 => {
            let bits = mean.iter().map(|&v| to_bits_scaled(v, *exp)).collect();
            let mut v = ScaledF16 { exp: *exp, bits }.scaled_by_pow2(s)?;
            v.clamp_to_f32();
            *exp = v.exp;
            *mean = Arc::new(v.decode());
        }
        SkeletonDtype::F32 => {
            let f = 2f64.powi(s);
            *mean = Arc::new(mean.iter().map(|&v| saturate(v as f64 * f)).collect());
        }
    }
    Ok(())
}

/// Undoes a pre-scale of `2^-s` on coded rows: the mean, `t` and the scales are linear in the
/// rows (basis, centres and residual codes are scale-free), so multiplying them by `2^s`
/// gives the codes of the unscaled rows.
fn scale_codes(c: &mut BlockCodes, s: i32) -> Result<()> {
    c.t = c.t.scaled_by_pow2(s)?;
    c.scale = c.scale.scaled_by_pow2(s)?;
    Ok(())
}

impl EncodedLayer {
    fn scale_by_pow2(&mut self, s: i32) -> Result<()> {
        let dt = self.params.skeleton_dtype;
        if let Some(b) = &mut self.shared {
            scale_mean(dt, &mut b.mean_exp, &mut b.mean, s)?;
        }
        for (sk, c) in &mut self.blocks {
            match &self.shared {
                Some(b) => {
                    sk.mean_exp = b.mean_exp;
                    sk.mean = b.mean.clone();
                }
                None => scale_mean(dt, &mut sk.mean_exp, &mut sk.mean, s)?,
            }
            scale_codes(c, s)?;
        }
        Ok(())
    }
}

/// Checks what [`encode_layer`] and [`encode_single_block`] share; returns the quantiser.
fn check_encode(
    x: &[f32],
    n: usize,
    d: usize,
    weights: Option<&[f32]>,
    p: &CodecParams,
) -> Result<Quantizer> {
    check_input(x, n, d, weights)?;
    let q = p.validate()?;
    if p.outlier_threshold.is_some() && (p.block_size.min(n) as u64) * (d as u64) > 1 << 32 {
        return param(format!(
            "with outliers, block_size x D must be at most 2^32 (positions are 32-bit), got \
             {} x {d}",
            p.block_size.min(n)
        ));
    }
    Ok(q)
}

/// Encodes a row-major `[n, d]` tensor. Every finite input is accepted: rows beyond
/// `2^PRESCALE_ABOVE` in magnitude are coded pre-scaled (see [`prescale_exponent`]).
pub fn encode_layer(
    x: &[f32],
    n: usize,
    d: usize,
    weights: Option<&[f32]>,
    p: &CodecParams,
    threads: Option<usize>,
) -> Result<(EncodedLayer, StageTimes)> {
    let q = check_encode(x, n, d, weights, p)?;
    let s = prescale_exponent(x);
    if s == 0 {
        return encode_rows(x, n, d, weights, p, &q, threads);
    }
    let f = pow2(-s);
    let scaled: Vec<f32> = x.iter().map(|&v| v * f).collect();
    let (mut e, times) = encode_rows(&scaled, n, d, weights, p, &q, threads)?;
    e.scale_by_pow2(s)?;
    Ok((e, times))
}

/// All rows of `x` as ONE block (the parts `encode_block_codes` returns), checked and
/// pre-scaled like [`encode_layer`].
pub fn encode_single_block(
    x: &[f32],
    n: usize,
    d: usize,
    weights: Option<&[f32]>,
    p: &CodecParams,
) -> Result<(Skeleton, BlockCodes, Quantizer)> {
    let q = check_encode(x, n, d, weights, p)?;
    let s = prescale_exponent(x);
    if s == 0 {
        let (sk, c, _) = block::encode_block(x, d, weights, p, &q, 0, None)?;
        return Ok((sk, c, q));
    }
    let f = pow2(-s);
    let scaled: Vec<f32> = x.iter().map(|&v| v * f).collect();
    let (mut sk, mut c, _) = block::encode_block(&scaled, d, weights, p, &q, 0, None)?;
    scale_mean(p.skeleton_dtype, &mut sk.mean_exp, &mut sk.mean, s)?;
    scale_codes(&mut c, s)?;
    Ok((sk, c, q))
}

fn encode_rows(
    x: &[f32],
    n: usize,
    d: usize,
    weights: Option<&[f32]>,
    p: &CodecParams,
    q: &Quantizer,
    threads: Option<usize>,
) -> Result<(EncodedLayer, StageTimes)> {
    with_threads_for(threads, n.div_ceil(p.block_size), || {
        let mut times = StageTimes::default();
        let shared = if p.share_basis {
            let t0 = std::time::Instant::now();
            // Stream index u64::MAX keeps the layer-wide sketch apart from every block's.
            let b = block::fit_basis(x, n, d, weights, p, u64::MAX)?;
            times.fit += t0.elapsed().as_secs_f64();
            Some(b)
        } else {
            None
        };
        let coded: Vec<_> = block_ranges(n, p.block_size)
            .into_par_iter()
            .enumerate()
            .map(|(b, (lo, hi))| {
                block::encode_block(
                    &x[lo * d..hi * d],
                    d,
                    weights.map(|w| &w[lo..hi]),
                    p,
                    q,
                    b as u64,
                    shared.as_ref(),
                )
            })
            .collect::<Result<_>>()?;
        let mut blocks = Vec::with_capacity(coded.len());
        for (s, c, t) in coded {
            times += t;
            blocks.push((s, c));
        }
        Ok((
            EncodedLayer {
                params: p.clone(),
                n,
                d,
                shared,
                blocks,
            },
            times,
        ))
    })
}

/// Decodes a layer into a row-major `[n, d]` tensor; every value is finite (see
/// [`decode::decode_block`]).
pub fn decode_layer(enc: &EncodedLayer, threads: Option<usize>) -> Result<Vec<f32>> {
    let mut out: Vec<f32> = zeros(
        size(enc.n, enc.d, "the decoded layer")?,
        "the decoded layer",
    )?;
    decode_layer_into(enc, threads, &mut out)?;
    Ok(out)
}

/// [`decode_layer`] into `out`, which must hold `n x d` values (every one overwritten).
pub fn decode_layer_into(
    enc: &EncodedLayer,
    threads: Option<usize>,
    out: &mut [f32],
) -> Result<()> {
    let d = enc.d;
    if Some(out.len()) != enc.n.checked_mul(d) {
        return Err(crate::Error::InvalidInput(format!(
            "{} floats given for [{}, {d}] decoded rows",
            out.len(),
            enc.n
        )));
    }
    let q = enc.quantizer()?;
    let bs = enc.params.block_size;
    let bw = enc.params.bit_width;
    let seed = enc.params.rotation_seed;
    with_threads_for(threads, enc.blocks.len(), || {
        out.par_chunks_mut(bs * d)
            .zip(enc.blocks.par_iter())
            .map(|(o, (s, c))| {
                let rot = Rotation::new(seed, s.d_eff);
                decode::decode_block(s, c, bw, &q, &rot, o)
            })
            .collect::<Result<()>>()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pca::PcaMethod;
    use crate::rng::SplitMix64;

    fn data(n: usize, d: usize, seed: u64) -> Vec<f32> {
        let mut g = SplitMix64::new(seed);
        (0..n * d)
            .map(|i| {
                let j = i % d;
                let u = (g.next_u64() >> 40) as f32 / 16777216.0 - 0.5;
                u * 4.0 / (1.0 + j as f32)
            })
            .collect()
    }

    #[test]
    fn every_row_comes_back_including_the_tail() {
        let (n, d) = (1100, 16);
        let x = data(n, d, 1);
        let p = CodecParams::default();
        let (e, _) = encode_layer(&x, n, d, None, &p, None).unwrap();
        assert_eq!(e.blocks.len(), 3);
        assert_eq!(e.blocks[2].1.n, 76);
        let y = decode_layer(&e, None).unwrap();
        assert_eq!(y.len(), n * d);
        let err: f64 = x
            .iter()
            .zip(&y)
            .map(|(a, b)| ((a - b) as f64).powi(2))
            .sum();
        let en: f64 = x.iter().map(|&a| (a as f64).powi(2)).sum();
        assert!(err / en < 0.2, "relative error {}", err / en);
    }

    #[test]
    fn bytes_do_not_depend_on_threads() {
        let (n, d) = (1500, 32);
        let x = data(n, d, 2);
        for pm in [
            PcaMethod::Exact,
            PcaMethod::Randomized {
                target_rank: None,
                oversample: 8,
                power_iters: 2,
            },
        ] {
            let p = CodecParams {
                pca_method: pm,
                block_size: 256,
                ..Default::default()
            };
            let a = encode_layer(&x, n, d, None, &p, Some(1)).unwrap().0;
            let b = encode_layer(&x, n, d, None, &p, Some(2)).unwrap().0;
            let c = encode_layer(&x, n, d, None, &p, Some(3)).unwrap().0;
            assert_eq!(a, b);
            assert_eq!(a, c);
        }
    }

    #[test]
    fn ordinary_inputs_are_never_prescaled() {
        assert_eq!(prescale_exponent(&[1e15, -3.0, 0.0]), 0);
        assert_eq!(prescale_exponent(&[2f32.powi(PRESCALE_ABOVE)]), 0);
        assert_eq!(prescale_exponent(&[2f32.powi(PRESCALE_ABOVE + 1)]), 1);
        assert_eq!(prescale_exponent(&[-f32::MAX]), 128 - PRESCALE_ABOVE);
        assert_eq!(prescale_exponent(&[]), 0);
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(40))]
        /// Every finite magnitude round-trips through the bytes to finite values; beyond the
        /// pre-scale threshold the relative error is that of the same rows at unit scale.
        #[test]
        fn rows_of_every_magnitude_round_trip(
            e in -149i32..=127, seed in 0u64..1000, share in proptest::prelude::any::<bool>(),
            ip in proptest::prelude::any::<bool>(),
        ) {
            let (n, d) = (40, 6);
            let unit = data(n, d, seed);
            let m = unit.iter().fold(0f32, |a, v| a.max(v.abs())) as f64;
            let f = 2f64.powi(e) / m;
            let x: Vec<f32> = unit.iter().map(|&v| (v as f64 * f) as f32).collect();
            let p = CodecParams {
                block_size: 16,
                share_basis: share,
                metric: if ip { crate::Metric::InnerProduct } else { crate::Metric::Mse },
                outlier_threshold: Some(2.0),
                ..Default::default()
            };
            let enc = encode_layer(&x, n, d, None, &p, Some(1)).unwrap().0;
            let back = super::super::container::from_bytes(&super::super::container::to_bytes(&enc).0).unwrap();
            let y = decode_layer(&back, Some(1)).unwrap();
            proptest::prop_assert!(y.iter().all(|v| v.is_finite()));
            if e > PRESCALE_ABOVE {
                let (eu, _) = encode_layer(&unit, n, d, None, &p, Some(1)).unwrap();
                let yu = decode_layer(&eu, Some(1)).unwrap();
                let rel = |a: &[f32], b: &[f32]| {
                    let num: f64 = a.iter().zip(b).map(|(p, q)| (*p as f64 - *q as f64).powi(2)).sum();
                    let den: f64 = a.iter().map(|p| (*p as f64).powi(2)).sum();
                    (num / den).sqrt()
                };
                let (r, ru) = (rel(&x, &y), rel(&unit, &yu));
                proptest::prop_assert!((r - ru).abs() <= 0.02 * ru + 1e-6, "{r} vs {ru}");
            }
        }
    }

    #[test]
    fn bad_inputs_are_errors() {
        let p = CodecParams::default();
        assert!(encode_layer(&[], 0, 4, None, &p, None).is_err());
        assert!(encode_layer(&[], 4, 0, None, &p, None).is_err());
        assert!(encode_layer(&[1.0, f32::NAN], 1, 2, None, &p, None).is_err());
        assert!(encode_layer(&[1.0, 2.0], 1, 2, Some(&[-1.0]), &p, None).is_err());
        assert!(encode_layer(&[1.0, 2.0], 1, 2, Some(&[1.0, 1.0]), &p, None).is_err());
        assert!(encode_layer(&[1.0, 2.0], 1, 2, None, &p, Some(0)).is_err());
    }
}
