//! Parameters of the per-block mode, their defaults and their checks.

use crate::error::{param, Result};
pub use crate::metric::Metric;
use crate::pca::PcaMethod;
use crate::quant::{gaussian_centroids, Quantizer};

/// Precision of the stored mean, basis and k-means centres.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SkeletonDtype {
    F16,
    F32,
}

impl SkeletonDtype {
    pub fn bytes(self) -> usize {
        match self {
            SkeletonDtype::F16 => 2,
            SkeletonDtype::F32 => 4,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct CodecParams {
    pub metric: Metric,
    pub block_size: usize,
    pub bit_width: u8,
    pub variance_ratio: f64,
    pub k: usize,
    pub rotation_seed: u64,
    pub kmeans_max_iter: u32,
    pub pca_method: PcaMethod,
    pub skeleton_dtype: SkeletonDtype,
    pub rank_cap: Option<usize>,
    /// A custom Lloyd-Max table (`2^bit_width` ascending values); `None` = the N(0,1) table.
    pub centroids: Option<Vec<f32>>,
    pub outlier_threshold: Option<f32>,
    pub share_basis: bool,
}

pub const DEFAULT_ROTATION_SEED: u64 = 0xCAFE_BABE;

impl Default for CodecParams {
    fn default() -> Self {
        Self {
            metric: Metric::Mse,
            block_size: 512,
            bit_width: 3,
            variance_ratio: 0.95,
            k: 16,
            rotation_seed: DEFAULT_ROTATION_SEED,
            kmeans_max_iter: 32,
            pca_method: PcaMethod::Exact,
            skeleton_dtype: SkeletonDtype::F16,
            rank_cap: None,
            centroids: None,
            outlier_threshold: None,
            share_basis: false,
        }
    }
}

/// Largest accepted `power_iters`: more never helps and only burns time.
pub const MAX_POWER_ITERS: usize = 64;
/// Largest accepted `kmeans_max_iter`: Lloyd iterations stop at convergence long before, and
/// the cap keeps a pathological oscillation from looking like a hang.
pub const MAX_KMEANS_ITER: u32 = 10_000;

impl CodecParams {
    /// Checks every parameter and returns the quantiser it implies.
    pub fn validate(&self) -> Result<Quantizer> {
        if self.block_size == 0 {
            return param("block_size must be >= 1");
        }
        if self.block_size > u32::MAX as usize {
            return param("block_size must fit in 32 bits");
        }
        if !(1..=4).contains(&self.bit_width) {
            return param(format!(
                "bit_width must be in 1..=4, got {}",
                self.bit_width
            ));
        }
        if !(0.0..=1.0).contains(&self.variance_ratio) {
            return param(format!(
                "variance_ratio must be in [0, 1], got {}",
                self.variance_ratio
            ));
        }
        if self.k == 0 || self.k > u32::MAX as usize {
            return param("k must be >= 1");
        }
        if self.kmeans_max_iter > MAX_KMEANS_ITER {
            return param(format!("kmeans_max_iter must be <= {MAX_KMEANS_ITER}"));
        }
        if self.rank_cap == Some(0) {
            return param("rank_cap must be >= 1");
        }
        // Stored as u32 fields of the container.
        let u32_max = u32::MAX as usize;
        if self.rank_cap.is_some_and(|r| r > u32_max) {
            return param("rank_cap must fit in 32 bits");
        }
        if let PcaMethod::Randomized {
            target_rank,
            oversample,
            power_iters,
        } = self.pca_method
        {
            if target_rank == Some(0) {
                return param("rsvd_target_rank must be >= 1");
            }
            if target_rank.is_some_and(|t| t > u32_max) || oversample > u32_max {
                return param("rsvd_target_rank and rsvd_oversample must fit in 32 bits");
            }
            if power_iters > MAX_POWER_ITERS {
                return param(format!("rsvd_power_iters must be <= {MAX_POWER_ITERS}"));
            }
        }
        if let Some(t) = self.outlier_threshold {
            if !(t.is_finite() && t > 0.0) {
                return param(format!("outlier_threshold must be finite and > 0, got {t}"));
            }
        }
        let table = match &self.centroids {
            Some(c) => c.clone(),
            None => gaussian_centroids(self.bit_width)?,
        };
        Quantizer::new(table, self.bit_width)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_bad_values_are_not() {
        assert!(CodecParams::default().validate().is_ok());
        let bad = [
            CodecParams {
                block_size: 0,
                ..Default::default()
            },
            CodecParams {
                bit_width: 0,
                ..Default::default()
            },
            CodecParams {
                bit_width: 5,
                ..Default::default()
            },
            CodecParams {
                variance_ratio: 1.5,
                ..Default::default()
            },
            CodecParams {
                variance_ratio: -0.1,
                ..Default::default()
            },
            CodecParams {
                variance_ratio: f64::NAN,
                ..Default::default()
            },
            CodecParams {
                k: 0,
                ..Default::default()
            },
            CodecParams {
                rank_cap: Some(0),
                ..Default::default()
            },
            CodecParams {
                outlier_threshold: Some(-1.0),
                ..Default::default()
            },
            CodecParams {
                centroids: Some(vec![0.0, 1.0]),
                ..Default::default()
            },
        ];
        for p in bad {
            assert!(p.validate().is_err(), "{p:?}");
        }
    }
}
