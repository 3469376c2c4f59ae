//! A layer tensor `[N, D]`: row blocks, `share_basis`, the tail, threads.
//!
//! Rows are cut into blocks of `block_size`; the last `N mod block_size` rows (the tail) form a
//! shorter block coded the same way, so every row comes back and every byte of the tail is
//! counted. Blocks are independent, so they are coded in parallel; each block is computed
//! sequentially, which makes the bytes independent of the thread count.

use super::block::{self, Basis, BlockCodes, Rotation, Skeleton, StageTimes};
use super::params::CodecParams;
use crate::error::{Error, Result};
use crate::limits::check_input;
use crate::quant::Quantizer;
use crate::threads::with_threads;
use rayon::prelude::*;

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

/// Encodes a row-major `[n, d]` tensor.
pub fn encode_layer(
    x: &[f32],
    n: usize,
    d: usize,
    weights: Option<&[f32]>,
    p: &CodecParams,
    threads: Option<usize>,
) -> Result<(EncodedLayer, StageTimes)> {
    check_input(x, n, d, weights)?;
    let q = p.validate()?;
    with_threads(threads, || {
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
                    &q,
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
    })?
}

/// Decodes a layer into a row-major `[n, d]` tensor.
pub fn decode_layer(enc: &EncodedLayer, threads: Option<usize>) -> Result<Vec<f32>> {
    let q = enc.quantizer()?;
    let d = enc.d;
    let mut out = Vec::new();
    out.try_reserve_exact(enc.n * d)
        .map_err(|_| Error::InvalidInput(format!("cannot allocate [{}, {d}] floats", enc.n)))?;
    out.resize(enc.n * d, 0f32);
    let bs = enc.params.block_size;
    let bw = enc.params.bit_width;
    let seed = enc.params.rotation_seed;
    with_threads(threads, || {
        out.par_chunks_mut(bs * d)
            .zip(enc.blocks.par_iter())
            .for_each(|(o, (s, c))| {
                let rot = Rotation::new(seed, s.d_eff);
                block::decode_block(s, c, bw, &q, &rot, o);
            });
    })?;
    Ok(out)
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
