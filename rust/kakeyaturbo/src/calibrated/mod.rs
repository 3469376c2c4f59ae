//! The calibrated mode: the expensive part of the transform is fitted once per model.
//!
//! The per-block mode fits a mean, a basis and k-means centres for every block of rows and
//! stores them with the block: at head_dim 128 a full-rank fp16 basis alone costs 4 bits per
//! element of a 512-row block. Here the caller supplies, per (layer, kv-head, stream), a model
//! level *calibration* fitted on calibration text: a mean `mu` (`D`), an analysis matrix `A`
//! (`m x D`), a synthesis matrix `S` (`m x D`) with `S^T A ~ I` on the data's span (for a plain
//! PCA basis `A = S = U`; for keys whitened by the query covariance `A = U L^T`,
//! `S = U L^-1`), a spread `sigma_j > 0` per component and an integer bit width `b_j` in
//! `1..=8` per component (components given 0 bits by the allocation are left out by the caller;
//! they decode as the mean). Per row only the quantiser indices and, optionally, one fp16 scale
//! are stored.
//!
//! Encode of a row `x` (the stages of the design card; `FORMAT.md` is normative):
//! `u_j = <x - mu, A_j / sigma_j>` (unit-variance components, stage 2); bands = maximal runs of
//! equal `b_j`, each split into power-of-two sub-bands (largest first), sub-band `k` of width
//! `W` rotated by `y = H (s * u) / sqrt(W)` with the signs at its offset of the length-`m`
//! pattern (stage 4); the per-row scale `g = rms(u)` (or 1 without `norm`), stored as fp16 with
//! one shared exponent per container; `z = y / g`; Lloyd-Max at `b_j` bits per coordinate and
//! sparse fp16 outliers (stage 5). Decode: `u^ = s * H (g q) / sqrt(W)`,
//! `x^ = mu + sum_j u^_j sigma_j S_j`.
//!
//! Arrows run one way: [`calibration`] (the checked calibration, its derived tables, canonical
//! bytes and fingerprint) -> [`codec`] (rows to codes and back) -> [`container`] (the `KKYC`
//! bytes) -> [`many`] (a layer's blocks in one call).

pub mod calibration;
pub mod codec;
pub mod container;
pub mod many;

pub use calibration::{Band, CalibratedCodec, CalibratedParams};
pub use codec::{on_threads, CalibratedCodes, CalibratedParts};
pub use container::{read_header, CalibratedBytes, CalibratedHeader, MAGIC, VERSION};
pub use many::{decode_many, decode_many_into, encode_many, DecodeJob, EncodeJob};

/// Calibrations and rows for the unit tests of the three modules.
#[cfg(test)]
pub(crate) mod testutil {
    use super::*;
    use crate::metric::Metric;
    use crate::rng::SplitMix64;

    pub fn noise(g: &mut SplitMix64) -> f32 {
        (0..4)
            .map(|_| (g.next_u64() >> 40) as f32 / 16777216.0 - 0.5)
            .sum::<f32>()
            * 1.7
    }

    /// An orthonormal-ish basis from Gram-Schmidt on seeded noise.
    pub fn basis(d: usize, seed: u64) -> Vec<f32> {
        let mut g = SplitMix64::new(seed);
        let mut b: Vec<Vec<f64>> = Vec::new();
        while b.len() < d {
            let mut v: Vec<f64> = (0..d).map(|_| noise(&mut g) as f64).collect();
            for u in &b {
                let p: f64 = v.iter().zip(u).map(|(a, c)| a * c).sum();
                v.iter_mut().zip(u).for_each(|(a, c)| *a -= p * c);
            }
            let n = v.iter().map(|a| a * a).sum::<f64>().sqrt();
            if n > 1e-6 {
                b.push(v.iter().map(|a| a / n).collect());
            }
        }
        b.concat().iter().map(|&v| v as f32).collect()
    }

    pub fn codec(
        d: usize,
        bits: Vec<u8>,
        norm: bool,
        metric: Metric,
        outl: Option<f32>,
    ) -> CalibratedCodec {
        let m = bits.len();
        let u = basis(d, 7);
        let u = u[..m * d].to_vec();
        let spread = (0..m).map(|j| 0.9f32.powi(j as i32) * 2.0).collect();
        CalibratedCodec::new(
            d,
            vec![0.5; d],
            u.clone(),
            u,
            spread,
            bits,
            vec![],
            CalibratedParams {
                rotation_seed: 0xCAFE_BABE,
                metric,
                outlier_threshold: outl,
                norm,
            },
        )
        .unwrap()
    }

    /// Rows drawn from the codec's own model: mean + sum_j sigma_j e_j U_j.
    pub fn rows(c: &CalibratedCodec, n: usize, seed: u64) -> Vec<f32> {
        let mut g = SplitMix64::new(seed);
        let mut x = vec![0f32; n * c.d];
        for row in x.chunks_exact_mut(c.d) {
            row.copy_from_slice(&c.mean);
            for j in 0..c.m {
                let e = noise(&mut g) * c.spread[j];
                for (v, &b) in row.iter_mut().zip(&c.analysis[j * c.d..(j + 1) * c.d]) {
                    *v += e * b;
                }
            }
        }
        x
    }

    pub fn rel(x: &[f32], y: &[f32], mean: &[f32]) -> f64 {
        let d = mean.len();
        let e: f64 = x.iter().zip(y).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
        let s: f64 = x
            .iter()
            .enumerate()
            .map(|(i, a)| ((a - mean[i % d]) as f64).powi(2))
            .sum();
        e / s
    }
}
