//! One block through stages 1-5 and back (the per-block mode).

use super::params::{CodecParams, Metric, SkeletonDtype};
use crate::error::{input, Result};
use crate::f16::{round_f16, ScaledF16};
use crate::kmeans;
use crate::metric::least_squares_gain;
use crate::pack::{index_bits, pack_into, packed_len};
use crate::pca::{self, normalised_weights};
use crate::quant::Quantizer;
use crate::rng::{sign_pattern, SplitMix64, STREAM_SKETCH};
use crate::wht::{self, bands};
use half::f16;
use std::sync::Arc;
use std::time::Instant;

/// The stored skeleton of a block; every value is already rounded to its stored precision,
/// and every stage uses these rounded values.
#[derive(Debug, Clone, PartialEq)]
pub struct Skeleton {
    pub d: usize,
    pub d_eff: usize,
    pub k_eff: usize,
    pub dtype: SkeletonDtype,
    /// Shared exponent of the fp16 mean (0 for fp32).
    pub mean_exp: i8,
    /// Shared with every block of a `share_basis` layer, never copied per block.
    pub mean: Arc<Vec<f32>>,
    /// `d_eff x d`, row-major; shared like `mean`.
    pub basis: Arc<Vec<f32>>,
    /// `k_eff x d_eff`, row-major, unit rows (before rounding).
    pub centers: Vec<f32>,
}

/// The per-vector codes of a block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockCodes {
    pub n: usize,
    /// Segment (centre) id of each row.
    pub seg: Vec<u32>,
    /// `t_i`, fp16 with a shared exponent.
    pub t: ScaledF16,
    /// The per-vector scale of the rotated residual, fp16 with a shared exponent.
    pub scale: ScaledF16,
    /// `n * d_eff` quantiser indices of `bit_width` bits, packed LSB-first, row-major.
    pub residual: Vec<u8>,
    /// Ascending flat positions `row * d_eff + coord` of the outliers.
    pub outlier_pos: Vec<u32>,
    /// fp16 bits of the outliers' scaled values `z`.
    pub outlier_val: Vec<u16>,
}

impl BlockCodes {
    pub fn seg_bits(k_eff: usize) -> u32 {
        index_bits(k_eff)
    }
    pub fn outlier_pos_bits(n: usize, d_eff: usize) -> u32 {
        index_bits(n * d_eff)
    }
}

/// The fixed per-layer tables every block uses: quantiser, sign pattern, band layout.
#[derive(Debug, Clone)]
pub struct Rotation {
    pub signs: Vec<f32>,
    /// (offset, width, f_b = sqrt(d_eff / width)) per band.
    pub bands: Vec<(usize, usize, f32)>,
}

impl Rotation {
    /// Band `b` of width `W_b` uses signs `[offset_b, offset_b + W_b)` of the pattern of length
    /// `d_eff` and is normalised by `f_b = sqrt(d_eff / W_b)` so that `z` has unit second moment.
    pub fn new(seed: u64, d_eff: usize) -> Self {
        let mut off = 0;
        let bands = bands(d_eff)
            .into_iter()
            .map(|w| {
                let b = (off, w, ((d_eff as f32) / (w as f32)).sqrt());
                off += w;
                b
            })
            .collect();
        Self {
            signs: sign_pattern(seed, d_eff),
            bands,
        }
    }

    /// Rotates `r` (length d_eff) in place into `y`.
    #[inline(always)]
    pub fn forward(&self, r: &mut [f32]) {
        for &(o, w, _) in &self.bands {
            wht::rotate(&mut r[o..o + w], &self.signs[o..o + w]);
        }
    }

    #[inline(always)]
    pub fn inverse(&self, y: &mut [f32]) {
        for &(o, w, _) in &self.bands {
            wht::inverse_rotate(&mut y[o..o + w], &self.signs[o..o + w]);
        }
    }
}

/// `out = a * b^T` for row-major `a` (`n x d`), `b` (`m x d`), `out` (`n x m`).
fn mul_abt(a: &[f32], b: &[f32], d: usize, out: &mut [f32]) {
    kmeans::dots(a, b, d, out)
}

/// Rounds a float to the skeleton precision.
fn round_to(dtype: SkeletonDtype, v: f32) -> f32 {
    match dtype {
        SkeletonDtype::F16 => round_f16(v),
        SkeletonDtype::F32 => v,
    }
}

/// Rounds a mean vector; fp16 means get a shared exponent.
pub fn round_mean(dtype: SkeletonDtype, mean: &[f32]) -> (i8, Vec<f32>) {
    match dtype {
        SkeletonDtype::F16 => {
            let s = ScaledF16::encode(mean);
            (s.exp, s.decode())
        }
        SkeletonDtype::F32 => (0, mean.to_vec()),
    }
}

/// A fitted mean and basis, rounded: the part of a skeleton `share_basis` shares (cloning it
/// shares the vectors).
#[derive(Debug, Clone, PartialEq)]
pub struct Basis {
    pub d: usize,
    pub d_eff: usize,
    pub mean_exp: i8,
    pub mean: Arc<Vec<f32>>,
    pub basis: Arc<Vec<f32>>,
}

/// Stage 1a on rows `x` (`n x d`): PCA, rounded to the stored precision.
pub fn fit_basis(
    x: &[f32],
    n: usize,
    d: usize,
    weights: Option<&[f32]>,
    p: &CodecParams,
    index: u64,
) -> Result<Basis> {
    let seed = SplitMix64::derive(p.rotation_seed, STREAM_SKETCH, index).next_u64();
    let f = pca::fit(
        x,
        n,
        d,
        weights,
        p.pca_method,
        p.variance_ratio,
        p.rank_cap,
        seed,
    )?;
    let (mean_exp, mean) = round_mean(p.skeleton_dtype, &f.mean);
    Ok(Basis {
        d,
        d_eff: f.d_eff,
        mean_exp,
        mean: Arc::new(mean),
        basis: Arc::new(
            f.basis
                .iter()
                .map(|&v| round_to(p.skeleton_dtype, v))
                .collect(),
        ),
    })
}

/// Stage 2: `c_i = U (x_i - mu)` for every row.
pub fn project(x: &[f32], basis: &Basis) -> Vec<f32> {
    let d = basis.d;
    let n = x.len() / d;
    let mut xc = x.to_vec();
    for row in xc.chunks_exact_mut(d) {
        for (v, m) in row.iter_mut().zip(basis.mean.iter()) {
            *v -= m;
        }
    }
    let mut c = vec![0f32; n * basis.d_eff];
    mul_abt(&xc, &basis.basis, d, &mut c);
    c
}

/// Wall-clock seconds spent in skeleton fitting (stage 1) and in coding (stages 2-5).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StageTimes {
    pub fit: f64,
    pub code: f64,
}

impl std::ops::AddAssign for StageTimes {
    fn add_assign(&mut self, o: Self) {
        self.fit += o.fit;
        self.code += o.code;
    }
}

/// Encodes one block: fits a skeleton (or uses `shared` for mean and basis), then codes it.
pub fn encode_block(
    x: &[f32],
    d: usize,
    weights: Option<&[f32]>,
    p: &CodecParams,
    q: &Quantizer,
    index: u64,
    shared: Option<&Basis>,
) -> Result<(Skeleton, BlockCodes, StageTimes)> {
    let n = x.len() / d;
    if n == 0 {
        return input("a block needs at least one row");
    }
    let t0 = Instant::now();
    let fitted;
    let basis = match shared {
        Some(b) => b,
        None => {
            fitted = fit_basis(x, n, d, weights, p, index)?;
            &fitted
        }
    };
    let t1 = Instant::now();
    let c = project(x, basis);
    let t2 = Instant::now();
    let w = normalised_weights(weights, n);
    let centers: Vec<f32> = kmeans::fit(&c, basis.d_eff, &w, p.k, p.kmeans_max_iter)
        .into_iter()
        .map(|v| round_to(p.skeleton_dtype, v))
        .collect();
    let skel = Skeleton {
        d,
        d_eff: basis.d_eff,
        k_eff: centers.len() / basis.d_eff,
        dtype: p.skeleton_dtype,
        mean_exp: basis.mean_exp,
        mean: basis.mean.clone(),
        basis: basis.basis.clone(),
        centers,
    };
    let t3 = Instant::now();
    let rot = Rotation::new(p.rotation_seed, skel.d_eff);
    let codes = code_coefficients(&c, &skel, p, q, &rot);
    let t4 = Instant::now();
    let times = StageTimes {
        fit: (t1 - t0).as_secs_f64() + (t3 - t2).as_secs_f64(),
        code: (t2 - t1).as_secs_f64() + (t4 - t3).as_secs_f64(),
    };
    Ok((skel, codes, times))
}

/// Stages 2-5 for rows `x` against a given skeleton.
pub fn encode_with_skeleton(
    x: &[f32],
    skel: &Skeleton,
    p: &CodecParams,
    q: &Quantizer,
) -> BlockCodes {
    let basis = Basis {
        d: skel.d,
        d_eff: skel.d_eff,
        mean_exp: skel.mean_exp,
        mean: skel.mean.clone(),
        basis: skel.basis.clone(),
    };
    let c = project(x, &basis);
    code_coefficients(&c, skel, p, q, &Rotation::new(p.rotation_seed, skel.d_eff))
}

/// `r_i = c_i - t^_i centre_seg` in place; returns `|r_i|`. Multiversioned like [`code_rows`].
#[multiversion::multiversion(targets("x86_64+avx2+fma", "x86_64+avx512f+avx512bw+avx512vl"))]
fn residuals(r: &mut [f32], de: usize, t_hat: &[f32], seg: &[u32], centers: &[f32]) -> Vec<f32> {
    r.chunks_exact_mut(de)
        .enumerate()
        .map(|(i, row)| {
            let sg = seg[i] as usize;
            for (v, &cv) in row.iter_mut().zip(&centers[sg * de..(sg + 1) * de]) {
                *v -= t_hat[i] * cv;
            }
            crate::metric::dot(row, row).sqrt()
        })
        .collect()
}

/// Stages 4-5 for every row of the residuals `r` (`n x d_eff`, rotated in place): scale,
/// quantise, outliers, and the stored scale per metric. Compiled for several instruction sets
/// and picked at run time; every sum has a fixed order, so the result is the same on each.
#[allow(clippy::too_many_arguments)]
#[multiversion::multiversion(targets("x86_64+avx2+fma", "x86_64+avx512f+avx512bw+avx512vl"))]
fn code_rows(
    r: &mut [f32],
    de: usize,
    s_hat: &[f32],
    rot: &Rotation,
    q: &Quantizer,
    threshold: Option<f32>,
    ip: bool,
    idx: &mut [u8],
    outliers: &mut (Vec<u32>, Vec<u16>),
    gains: &mut Vec<f32>,
) {
    let mut qv = vec![0f32; de];
    for (i, (z, codes)) in r
        .chunks_exact_mut(de)
        .zip(idx.chunks_exact_mut(de))
        .enumerate()
    {
        rot.forward(z);
        for &(o, w, f) in &rot.bands {
            let inv = if s_hat[i] > 0.0 { f / s_hat[i] } else { 0.0 };
            z[o..o + w].iter_mut().for_each(|v| *v *= inv);
        }
        q.quantize_slice(z, codes);
        q.dequantize_slice(codes, &mut qv);
        if let Some(th) = threshold {
            if z.iter().any(|v| v.abs() > th) {
                for (j, &zj) in z.iter().enumerate() {
                    if zj.abs() > th {
                        let h = f16::from_f32(zj.clamp(-65504.0, 65504.0));
                        outliers.0.push((i * de + j) as u32);
                        outliers.1.push(h.to_bits());
                        qv[j] = h.to_f32();
                    }
                }
            }
        }
        gains.push(if ip {
            least_squares_gain(s_hat[i], z, &qv)
        } else {
            s_hat[i]
        });
    }
}

/// Stages 3-5 on projected coefficients `c` (`n x d_eff`).
pub fn code_coefficients(
    c: &[f32],
    skel: &Skeleton,
    p: &CodecParams,
    q: &Quantizer,
    rot: &Rotation,
) -> BlockCodes {
    let de = skel.d_eff;
    let k = skel.k_eff;
    let n = c.len() / de;
    // Stage 3: assignment by |<c, centre>|, t rounded before the residual is formed.
    let mut g = vec![0f32; n * k];
    mul_abt(c, &skel.centers, de, &mut g);
    let mut seg = Vec::with_capacity(n);
    let mut t_raw = Vec::with_capacity(n);
    for i in 0..n {
        let row = &g[i * k..(i + 1) * k];
        let s = kmeans::argmax_abs(row);
        seg.push(s as u32);
        t_raw.push(row[s]);
    }
    let t = ScaledF16::encode(&t_raw);
    let t_hat = t.decode();
    let mut r = c.to_vec();
    let norms = residuals(&mut r, de, &t_hat, &seg, &skel.centers);
    // Stage 4: z = y * f_b / s_hat, with the stored (rounded) norm.
    let norm_store = ScaledF16::encode(&norms);
    let s_hat = norm_store.decode();
    let mut idx = vec![0u8; n * de];
    let mut outliers = (Vec::new(), Vec::new());
    let mut gains = Vec::with_capacity(n);
    let ip = p.metric == Metric::InnerProduct;
    code_rows(
        &mut r,
        de,
        &s_hat,
        rot,
        q,
        p.outlier_threshold,
        ip,
        &mut idx,
        &mut outliers,
        &mut gains,
    );
    let (outlier_pos, outlier_val) = outliers;
    let scale = match p.metric {
        Metric::InnerProduct => ScaledF16::encode(&gains),
        Metric::Mse | Metric::Linf => norm_store,
    };
    let bits = p.bit_width as u32;
    let mut residual = vec![0u8; packed_len(n * de, bits)];
    pack_into(&idx, bits, &mut residual);
    BlockCodes {
        n,
        seg,
        t,
        scale,
        residual,
        outlier_pos,
        outlier_val,
    }
}

#[cfg(test)]
#[path = "block_tests.rs"]
mod tests;
