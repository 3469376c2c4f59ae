//! Stage 1a: weighted mean, exact and randomized PCA, and the d_eff rule.

use crate::error::{Error, Result};
use crate::gemm::{clear_upper, matmul};
use crate::rng::SplitMix64;
use faer::{Accum, Mat, MatRef, Par, Side};

/// How the principal subspace is found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PcaMethod {
    /// Symmetric eigendecomposition of the weighted covariance.
    Exact,
    /// Halko-Martinsson-Tropp randomized range finder with a Rademacher sketch from the
    /// project's generator, `power_iters` subspace iterations (re-orthonormalised by QR after
    /// each product) and a thin SVD of the projected matrix.
    Randomized {
        /// Rank the sketch targets; `None` means `max(D / 2, 8)` (capped at D).
        target_rank: Option<usize>,
        oversample: usize,
        power_iters: usize,
    },
}

impl PcaMethod {
    /// The rank the randomized method resolves for dimension `d`, or `d` for exact PCA.
    pub fn max_rank(&self, d: usize) -> usize {
        match *self {
            PcaMethod::Exact => d,
            PcaMethod::Randomized { target_rank, .. } => {
                target_rank.unwrap_or_else(|| (d / 2).max(8)).clamp(1, d)
            }
        }
    }
}

/// A fitted principal subspace, before any rounding to the stored precision.
#[derive(Debug, Clone)]
pub struct PcaFit {
    pub mean: Vec<f32>,
    /// `d_eff x D`, row-major, orthonormal rows.
    pub basis: Vec<f32>,
    pub d_eff: usize,
    /// Variances along the computed components, descending.
    pub eigenvalues: Vec<f64>,
    /// The trace of the weighted covariance (the total variance).
    pub total_variance: f64,
}

/// Normalised weights (sum 1). All-zero (or absent) weights mean uniform weights.
pub fn normalised_weights(weights: Option<&[f32]>, n: usize) -> Vec<f64> {
    let uniform = || vec![1.0 / n as f64; n];
    match weights {
        None => uniform(),
        Some(w) => {
            let s: f64 = w.iter().map(|&v| v as f64).sum();
            if s > 0.0 {
                w.iter().map(|&v| v as f64 / s).collect()
            } else {
                uniform()
            }
        }
    }
}

/// Weighted mean of the rows of `x` (`n x d`, row-major) in f64.
pub fn weighted_mean(x: &[f32], d: usize, w: &[f64]) -> Vec<f64> {
    let mut mu = vec![0f64; d];
    for (row, &wi) in x.chunks_exact(d).zip(w) {
        for (m, &v) in mu.iter_mut().zip(row) {
            *m += wi * v as f64;
        }
    }
    mu
}

/// Smallest rank whose leading eigenvalues reach `ratio` of `total`, at least 1, at most
/// `max_rank`. A relative slack of 1e-9 lets `ratio = 1` stop at the numerical rank.
pub fn select_rank(eigenvalues: &[f64], total: f64, ratio: f64, max_rank: usize) -> usize {
    let goal = ratio * total * (1.0 - 1e-9);
    let mut acc = 0.0;
    let limit = max_rank.min(eigenvalues.len()).max(1);
    for (r, &l) in eigenvalues.iter().take(limit).enumerate() {
        acc += l.max(0.0);
        if acc >= goal {
            return r + 1;
        }
    }
    limit
}

/// Makes the sign of each eigenvector deterministic: the largest-magnitude entry is positive.
fn canonical_sign(v: &mut [f64]) {
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if x.abs() > v[best].abs() {
            best = i;
        }
    }
    if v[best] < 0.0 {
        v.iter_mut().for_each(|x| *x = -*x);
    }
}

fn thin_q(m: &Mat<f64>) -> Mat<f64> {
    let q = m.qr().compute_thin_Q();
    clear_upper();
    q
}

/// Fits the principal subspace of the rows of `x` (`n x d`).
#[allow(clippy::too_many_arguments)]
pub fn fit(
    x: &[f32],
    n: usize,
    d: usize,
    weights: Option<&[f32]>,
    method: PcaMethod,
    variance_ratio: f64,
    rank_cap: Option<usize>,
    sketch_seed: u64,
) -> Result<PcaFit> {
    let w = normalised_weights(weights, n);
    let mu = weighted_mean(x, d, &w);
    // Centred rows scaled by sqrt(w_i): Xc^T Xc is the weighted covariance.
    let mut rows = vec![0f64; n * d];
    for ((dst, src), &wi) in rows.chunks_exact_mut(d).zip(x.chunks_exact(d)).zip(&w) {
        let sw = wi.sqrt();
        for ((o, &v), &m) in dst.iter_mut().zip(src).zip(&mu) {
            *o = sw * (v as f64 - m);
        }
    }
    let total: f64 = rows.iter().map(|v| v * v).sum();
    let xc = MatRef::from_row_major_slice(&rows, n, d);
    let max_rank = method
        .max_rank(d)
        .min(rank_cap.unwrap_or(usize::MAX))
        .max(1);

    // The weighted covariance, d x d. Both methods work on it: for the D <= 256 of attention
    // heads it is cheaper than sketching the n x D data matrix (measured: 512 x 128 blocks,
    // 2.4 ms for the sketch on the data against under 1 ms on the covariance).
    let mut cov = Mat::<f64>::zeros(d, d);
    matmul(
        cov.as_mut(),
        Accum::Replace,
        xc.transpose(),
        xc,
        1.0,
        Par::Seq,
    );
    let (eigenvalues, vectors): (Vec<f64>, Vec<Vec<f64>>) = match method {
        PcaMethod::Exact => {
            let evd = cov
                .self_adjoint_eigen(Side::Lower)
                .map_err(|e| Error::Numerical(format!("eigendecomposition failed: {e:?}")))?;
            clear_upper();
            let s = evd.S().column_vector();
            let u = evd.U();
            // faer sorts ascending; we want descending.
            (0..d)
                .rev()
                .take(max_rank)
                .map(|j| (s[j], (0..d).map(|i| u[(i, j)]).collect()))
                .unzip()
        }
        PcaMethod::Randomized {
            oversample,
            power_iters,
            ..
        } => {
            // Halko-Martinsson-Tropp on the symmetric PSD covariance C: range finder
            // Q = orth(C^(1 + power_iters) Omega), re-orthonormalised after every product, then
            // the Rayleigh-Ritz step B = Q^T C Q and a thin SVD of B (their algorithm 5.3).
            let target = method.max_rank(d);
            let l = (target + oversample).min(d).max(1);
            let mut g = SplitMix64::new(sketch_seed);
            let mut omega = Mat::<f64>::zeros(d, l);
            for i in 0..d {
                for j in 0..l {
                    omega[(i, j)] = g.next_sign() as f64;
                }
            }
            let mut y = Mat::<f64>::zeros(d, l);
            matmul(
                y.as_mut(),
                Accum::Replace,
                cov.as_ref(),
                omega.as_ref(),
                1.0,
                Par::Seq,
            );
            let mut q = thin_q(&y);
            for _ in 0..power_iters {
                let mut y = Mat::<f64>::zeros(d, q.ncols());
                matmul(
                    y.as_mut(),
                    Accum::Replace,
                    cov.as_ref(),
                    q.as_ref(),
                    1.0,
                    Par::Seq,
                );
                q = thin_q(&y);
            }
            let mut cq = Mat::<f64>::zeros(d, q.ncols());
            matmul(
                cq.as_mut(),
                Accum::Replace,
                cov.as_ref(),
                q.as_ref(),
                1.0,
                Par::Seq,
            );
            let mut b = Mat::<f64>::zeros(q.ncols(), q.ncols());
            matmul(
                b.as_mut(),
                Accum::Replace,
                q.transpose(),
                cq.as_ref(),
                1.0,
                Par::Seq,
            );
            let svd = b
                .thin_svd()
                .map_err(|e| Error::Numerical(format!("SVD failed: {e:?}")))?;
            clear_upper();
            let s = svd.S().column_vector();
            let mut v = Mat::<f64>::zeros(d, q.ncols());
            matmul(
                v.as_mut(),
                Accum::Replace,
                q.as_ref(),
                svd.U(),
                1.0,
                Par::Seq,
            );
            let k = s.nrows().min(max_rank).min(target);
            (0..k)
                .map(|j| (s[j], (0..d).map(|i| v[(i, j)]).collect()))
                .unzip()
        }
    };

    let d_eff = select_rank(
        &eigenvalues,
        total,
        variance_ratio,
        max_rank.min(vectors.len()),
    );
    let mut basis = Vec::with_capacity(d_eff * d);
    for mut v in vectors.into_iter().take(d_eff) {
        canonical_sign(&mut v);
        basis.extend(v.iter().map(|&x| x as f32));
    }
    Ok(PcaFit {
        mean: mu.iter().map(|&m| m as f32).collect(),
        basis,
        d_eff,
        eigenvalues,
        total_variance: total,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Rows with variances `spectrum` along the coordinate axes, deterministic.
    fn axis_data(n: usize, spectrum: &[f64]) -> Vec<f32> {
        let mut g = SplitMix64::new(7);
        let d = spectrum.len();
        let mut x = vec![0f32; n * d];
        for i in 0..n {
            for j in 0..d {
                // Rademacher entries: variance exactly 1 before scaling.
                x[i * d + j] = (g.next_sign() as f64 * spectrum[j].sqrt()) as f32;
            }
        }
        x
    }

    #[test]
    fn rank_rule_uses_total_variance() {
        let ev = [5.0, 3.0, 1.0, 1.0];
        assert_eq!(select_rank(&ev, 10.0, 0.5, 4), 1);
        assert_eq!(select_rank(&ev, 10.0, 0.8, 4), 2);
        assert_eq!(select_rank(&ev, 10.0, 0.0, 4), 1);
        assert_eq!(select_rank(&ev, 10.0, 1.0, 4), 4);
        assert_eq!(select_rank(&ev, 10.0, 1.0, 2), 2);
        // Only part of the spectrum known (randomized): still measured against the trace, so a
        // ratio the known part cannot reach takes everything available, not fewer components.
        assert_eq!(select_rank(&ev[..2], 10.0, 0.9, 2), 2);
    }

    #[test]
    fn exact_pca_finds_the_axes() {
        let spectrum = [16.0, 4.0, 1.0, 0.01];
        let x = axis_data(2000, &spectrum);
        let f = fit(&x, 2000, 4, None, PcaMethod::Exact, 0.9, None, 0).unwrap();
        assert_eq!(f.d_eff, 2);
        assert!((f.basis[0].abs() - 1.0).abs() < 0.01);
        assert!((f.basis[5].abs() - 1.0).abs() < 0.01);
        assert!((f.total_variance - 21.01).abs() < 1.0);
    }

    #[test]
    fn randomized_matches_exact_on_a_decaying_spectrum() {
        let spectrum: Vec<f64> = (0..32).map(|j| 0.7f64.powi(j)).collect();
        let x = axis_data(1000, &spectrum);
        let e = fit(&x, 1000, 32, None, PcaMethod::Exact, 0.9, None, 0).unwrap();
        let m = PcaMethod::Randomized {
            target_rank: Some(16),
            oversample: 8,
            power_iters: 2,
        };
        let r = fit(&x, 1000, 32, None, m, 0.9, None, 1).unwrap();
        assert_eq!(e.d_eff, r.d_eff);
        for j in 0..4 {
            assert!((e.eigenvalues[j] / r.eigenvalues[j] - 1.0).abs() < 1e-3);
        }
    }

    #[test]
    fn rank_cap_applies_to_both_methods() {
        let spectrum: Vec<f64> = (0..16).map(|_| 1.0).collect();
        let x = axis_data(200, &spectrum);
        let e = fit(&x, 200, 16, None, PcaMethod::Exact, 0.99, Some(3), 0).unwrap();
        let m = PcaMethod::Randomized {
            target_rank: None,
            oversample: 8,
            power_iters: 2,
        };
        let r = fit(&x, 200, 16, None, m, 0.99, Some(3), 0).unwrap();
        assert_eq!(e.d_eff, 3);
        assert_eq!(r.d_eff, 3);
    }

    #[test]
    fn single_row_gives_zero_variance() {
        let f = fit(
            &[1.0, 2.0, 3.0],
            1,
            3,
            None,
            PcaMethod::Exact,
            0.95,
            None,
            0,
        )
        .unwrap();
        assert_eq!(f.d_eff, 1);
        assert_eq!(f.mean, vec![1.0, 2.0, 3.0]);
        assert_eq!(f.total_variance, 0.0);
    }

    #[test]
    fn weights_shift_the_mean() {
        let x = [0.0f32, 0.0, 10.0, 10.0];
        let f = fit(&x, 2, 2, Some(&[3.0, 1.0]), PcaMethod::Exact, 0.95, None, 0).unwrap();
        assert_eq!(f.mean, vec![2.5, 2.5]);
    }

    proptest! {
        #[test]
        fn basis_is_orthonormal(seed in any::<u64>(), n in 2usize..40, d in 1usize..12, randomized in any::<bool>()) {
            let mut g = SplitMix64::new(seed);
            let x: Vec<f32> = (0..n * d).map(|_| (g.next_u64() >> 40) as f32 / 16777216.0 - 0.5).collect();
            let m = if randomized { PcaMethod::Randomized { target_rank: None, oversample: 4, power_iters: 1 } } else { PcaMethod::Exact };
            let f = fit(&x, n, d, None, m, 1.0, None, seed).unwrap();
            prop_assert!(f.d_eff >= 1 && f.d_eff <= d);
            for a in 0..f.d_eff {
                for b in 0..f.d_eff {
                    let dot: f32 = (0..d).map(|j| f.basis[a * d + j] * f.basis[b * d + j]).sum();
                    let want = if a == b { 1.0 } else { 0.0 };
                    prop_assert!((dot - want).abs() < 1e-4, "{} {} {}", a, b, dot);
                }
            }
        }
    }
}
