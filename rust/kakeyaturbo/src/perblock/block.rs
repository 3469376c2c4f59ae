//! One block through stages 1-5 and back (the per-block mode).

use super::params::{CodecParams, Metric, SkeletonDtype};
use crate::error::{corrupt, input, Result};
use crate::f16::{round_f16, ScaledF16};
use crate::kmeans;
use crate::limits::{all_finite, max_abs, saturate, size, MAX_DIM, SAFE_F32};
use crate::metric::least_squares_gain;
use crate::pack::{index_bits, pack_into, packed_len, unpack_into};
use crate::pca::{self, normalised_weights};
use crate::quant::Quantizer;
use crate::rng::{sign_pattern, SplitMix64, STREAM_SKETCH};
use crate::wht::{self, bands};
use faer::linalg::matmul::matmul;
use faer::{Accum, MatMut, MatRef, Par};
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

/// Decode of the residuals in place: rescale, inverse rotation, `+ t centre`. Multiversioned
/// like [`code_rows`].
#[multiversion::multiversion(targets("x86_64+avx2+fma", "x86_64+avx512f+avx512bw+avx512vl"))]
fn unrotate_rows(
    c: &mut [f32],
    de: usize,
    s: &[f32],
    t: &[f32],
    seg: &[u32],
    centers: &[f32],
    rot: &Rotation,
) {
    for (i, row) in c.chunks_exact_mut(de).enumerate() {
        for &(o, w, f) in &rot.bands {
            let mul = s[i] / f;
            for v in &mut row[o..o + w] {
                *v *= mul;
            }
        }
        rot.inverse(row);
        let sg = seg[i] as usize;
        for (v, &cv) in row.iter_mut().zip(&centers[sg * de..(sg + 1) * de]) {
            *v += t[i] * cv;
        }
    }
}

/// Decodes a block into `out` (`n x d`, row-major), in float32. A block whose result is not
/// finite (stored `t` or scales beyond the float32 range, as rows near `f32::MAX` give) is
/// decoded again in f64, each value saturating at `+-f32::MAX`; every value written is finite
/// or the block is an error.
pub fn decode_block(
    skel: &Skeleton,
    codes: &BlockCodes,
    bit_width: u8,
    q: &Quantizer,
    rot: &Rotation,
    out: &mut [f32],
) -> Result<()> {
    let (n, de, d) = (codes.n, skel.d_eff, skel.d);
    let mut idx = vec![0u8; n * de];
    unpack_into(&codes.residual, bit_width as u32, &mut idx);
    let mut c = vec![0f32; n * de];
    q.dequantize_slice(&idx, &mut c);
    for (&pos, &v) in codes.outlier_pos.iter().zip(&codes.outlier_val) {
        c[pos as usize] = f16::from_bits(v).to_f32();
    }
    let t = codes.t.decode();
    let s = codes.scale.decode();
    unrotate_rows(&mut c, de, &s, &t, &codes.seg, &skel.centers, rot);
    // x = mu + U^T c
    let cm = MatRef::from_row_major_slice(&c, n, de);
    let u = MatRef::from_row_major_slice(&skel.basis, de, d);
    for row in out.chunks_exact_mut(d) {
        row.copy_from_slice(&skel.mean);
    }
    matmul(
        MatMut::from_row_major_slice_mut(out, n, d),
        Accum::Add,
        cm,
        u,
        1.0,
        Par::Seq,
    );
    // Every input is finite, so only an overflow can make the result non-finite: skip the
    // scan of the output when the bound rules that out (always, for ordinary data).
    if decode_bound(skel, codes, q) <= SAFE_F32 || all_finite(out) {
        return Ok(());
    }
    decode_block_wide(skel, codes, &idx, q, rot, out);
    if all_finite(out) {
        Ok(())
    } else {
        corrupt("a block decodes to values that are not finite")
    }
}

/// An upper bound on every intermediate of the float32 decode of a block, each listed (a
/// bound that skips one lets a product with 0 turn an overflow into NaN): the decoded `t` and
/// scales; `|q| <= qmax` times `scale / f_b <= smax` (`f_b >= 1`); the butterfly's sums of at
/// most `d_eff` such terms; `|c| <= tmax |centre| + qmax smax`; and `x`'s partial sums,
/// `|mu| + d_eff |U| |c|`.
pub(crate) fn decode_bound(skel: &Skeleton, codes: &BlockCodes, q: &Quantizer) -> f64 {
    let qmax = if codes.outlier_val.is_empty() {
        max_abs(q.centroids())
    } else {
        max_abs(q.centroids()).max(65504.0)
    };
    let de = skel.d_eff as f64;
    let (tmax, smax) = (codes.t.max_abs_f64(), codes.scale.max_abs_f64());
    let r = qmax * smax;
    let c = tmax * max_abs(&skel.centers) + r;
    [
        tmax,
        smax,
        de * r,
        c,
        max_abs(&skel.mean) + de * max_abs(&skel.basis) * c,
    ]
    .into_iter()
    .fold(0f64, f64::max)
}

/// [`decode_block`] in f64: every stored value is finite and at most `32768 * 2^127`, so no
/// intermediate overflows; the result saturates to the float32 range.
#[cold]
#[inline(never)]
fn decode_block_wide(
    skel: &Skeleton,
    codes: &BlockCodes,
    idx: &[u8],
    q: &Quantizer,
    rot: &Rotation,
    out: &mut [f32],
) {
    let (de, d) = (skel.d_eff, skel.d);
    let mut c: Vec<f64> = idx
        .iter()
        .map(|&i| q.dequantize(i & (q.centroids().len() - 1) as u8) as f64)
        .collect();
    for (&pos, &v) in codes.outlier_pos.iter().zip(&codes.outlier_val) {
        c[pos as usize] = f16::from_bits(v).to_f64();
    }
    let mut x = vec![0f64; d];
    for (i, (row, o)) in c
        .chunks_exact_mut(de)
        .zip(out.chunks_exact_mut(d))
        .enumerate()
    {
        let (si, ti) = (codes.scale.value_f64(i), codes.t.value_f64(i));
        for &(off, w, f) in &rot.bands {
            let band = &mut row[off..off + w];
            band.iter_mut().for_each(|v| *v *= si / f as f64);
            wht::fwht(band);
            for (v, &sg) in band.iter_mut().zip(&rot.signs[off..off + w]) {
                *v = *v * sg as f64 / w as f64;
            }
        }
        let sg = codes.seg[i] as usize;
        for (v, &cv) in row.iter_mut().zip(&skel.centers[sg * de..(sg + 1) * de]) {
            *v += ti * cv as f64;
        }
        x.iter_mut()
            .zip(skel.mean.iter())
            .for_each(|(a, &m)| *a = m as f64);
        for (&cj, uj) in row.iter().zip(skel.basis.chunks_exact(d)) {
            x.iter_mut().zip(uj).for_each(|(a, &u)| *a += cj * u as f64);
        }
        o.iter_mut().zip(&x).for_each(|(o, &v)| *o = saturate(v));
    }
}

/// Checks a skeleton and codes that did not come from the container reader (a parts dict):
/// every length, index and stored value, so that decoding them can neither panic nor produce
/// NaN. Errors are [`crate::Error::InvalidInput`].
pub fn check_parts(skel: &Skeleton, codes: &BlockCodes, bit_width: u8) -> Result<()> {
    let (n, d, de, k) = (codes.n, skel.d, skel.d_eff, skel.k_eff);
    if n == 0 || d == 0 || de == 0 || de > d || d > MAX_DIM || k == 0 || k > n {
        return input(format!(
            "inconsistent parts: n = {n}, d = {d}, d_eff = {de}, k = {k} (need 1 <= d_eff <= \
             d <= {MAX_DIM}, 1 <= k <= n)"
        ));
    }
    let len = |what: &str, got: usize, want: usize| -> Result<()> {
        if got == want {
            Ok(())
        } else {
            input(format!("{what} has {got} values, expected {want}"))
        }
    };
    len("mean", skel.mean.len(), d)?;
    len("basis", skel.basis.len(), size(de, d, "basis")?)?;
    len("centers", skel.centers.len(), size(k, de, "centers")?)?;
    for (what, v) in [
        ("mean", &skel.mean[..]),
        ("basis", &skel.basis[..]),
        ("centers", &skel.centers[..]),
    ] {
        if v.iter().any(|x| !x.is_finite()) {
            return input(format!("{what} holds a non-finite value"));
        }
    }
    len("seg_id", codes.seg.len(), n)?;
    if codes.seg.iter().any(|&s| s as usize >= k) {
        return input(format!("seg_id out of range (k = {k})"));
    }
    len("t_bits", codes.t.bits.len(), n)?;
    len("norm_bits", codes.scale.bits.len(), n)?;
    for (what, v) in [("t", &codes.t), ("norm", &codes.scale)] {
        v.check(what).map_err(|e| match e {
            crate::Error::Corrupt(m) => crate::Error::InvalidInput(m),
            e => e,
        })?;
    }
    let cells = size(n, de, "codes")?;
    let want = crate::pack::checked_packed_len(cells, bit_width as u32)
        .ok_or_else(|| crate::Error::InvalidInput("size of residual_packed overflows".into()))?;
    if codes.residual.len() != want {
        return input(format!(
            "residual_packed has {} bytes, expected {want} ({n} x {de} values of {bit_width} bits)",
            codes.residual.len()
        ));
    }
    len(
        "outlier_bits",
        codes.outlier_val.len(),
        codes.outlier_pos.len(),
    )?;
    if codes.outlier_pos.iter().any(|&p| p as usize >= cells) {
        return input(format!("outlier_pos out of range ({cells} cells)"));
    }
    if codes
        .outlier_val
        .iter()
        .any(|&h| !f16::from_bits(h).is_finite())
    {
        return input("outlier_bits holds a non-finite fp16 value");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::layer::{decode_layer, encode_layer};
    use super::*;
    use crate::pca::PcaMethod;
    use crate::rng::SplitMix64;
    use proptest::prelude::*;

    fn noise(g: &mut SplitMix64) -> f32 {
        // Sum of four uniforms: a cheap, deterministic, roughly Gaussian draw.
        (0..4)
            .map(|_| (g.next_u64() >> 40) as f32 / 16777216.0 - 0.5)
            .sum::<f32>()
            * 1.7
    }

    fn gaussian_rows(n: usize, d: usize, seed: u64) -> Vec<f32> {
        let mut g = SplitMix64::new(seed);
        (0..n * d).map(|_| noise(&mut g)).collect()
    }

    fn rel_err(x: &[f32], y: &[f32]) -> f64 {
        let e: f64 = x.iter().zip(y).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
        let s: f64 = x.iter().map(|&a| (a as f64).powi(2)).sum();
        e / s
    }

    fn roundtrip(x: &[f32], n: usize, d: usize, p: &CodecParams) -> Vec<f32> {
        let (e, _) = encode_layer(x, n, d, None, p, Some(1)).unwrap();
        decode_layer(&e, Some(1)).unwrap()
    }

    #[test]
    fn zero_residual_rows_round_trip_exactly() {
        // Identical rows: c = 0, r = 0. The predecessor decoded these with an offset of ~0.245.
        let d = 8;
        let row: Vec<f32> = (0..d).map(|j| j as f32 * 0.375 - 1.0).collect();
        let x: Vec<f32> = (0..5).flat_map(|_| row.clone()).collect();
        for metric in [Metric::Mse, Metric::InnerProduct, Metric::Linf] {
            let p = CodecParams {
                metric,
                skeleton_dtype: SkeletonDtype::F32,
                ..Default::default()
            };
            assert_eq!(roundtrip(&x, 5, d, &p), x, "{metric:?}");
        }
    }

    #[test]
    fn inner_product_decode_restores_the_norm() {
        // The predecessor's inner_product decoder never multiplied by the norm: residuals came
        // back at unit scale. Rows of norm ~40 make that an error of order 1.
        let (n, d) = (512, 64);
        let x: Vec<f32> = gaussian_rows(n, d, 3).iter().map(|v| v * 5.0).collect();
        let base = CodecParams {
            variance_ratio: 1.0,
            k: 1,
            bit_width: 3,
            ..Default::default()
        };
        let mse = rel_err(&x, &roundtrip(&x, n, d, &base));
        let ip = rel_err(
            &x,
            &roundtrip(
                &x,
                n,
                d,
                &CodecParams {
                    metric: Metric::InnerProduct,
                    ..base.clone()
                },
            ),
        );
        // Nearly everything is residual here, so both sit near the 3-bit Lloyd-Max error.
        assert!(mse < 0.06, "mse {mse}");
        assert!(ip < 0.06, "ip {ip}");
        assert!(
            ip <= mse,
            "least-squares gain must not lose to the norm: {ip} > {mse}"
        );
    }

    #[test]
    fn t_is_rounded_before_the_residual() {
        // Rank-1 rows along v with t values fp16 cannot hold: the rounding error of t lands in
        // the residual and is coded. Coding the unrounded residual (the predecessor) leaves the
        // whole rounding error in the output.
        let d = 4;
        let v = [0.5f32, 0.5, 0.5, 0.5];
        let ts = [1000.3f32, -999.7, 2000.1, -1500.9, 1234.567, 10.01];
        let x: Vec<f32> = ts
            .iter()
            .flat_map(|&t| v.iter().map(move |&c| c * t))
            .collect();
        let p = CodecParams {
            k: 1,
            skeleton_dtype: SkeletonDtype::F32,
            ..Default::default()
        };
        let (e, _) = encode_layer(&x, ts.len(), d, None, &p, Some(1)).unwrap();
        let y = decode_layer(&e, Some(1)).unwrap();
        let (s, c) = &e.blocks[0];
        let t_hat = c.t.decode();
        let basis = Basis {
            d,
            d_eff: s.d_eff,
            mean_exp: 0,
            mean: s.mean.clone(),
            basis: s.basis.clone(),
        };
        let coef = project(&x, &basis);
        let mut worst_t = 0f32;
        let mut worst_out = 0f32;
        for i in 0..ts.len() {
            let g = coef[i * s.d_eff] * s.centers[0];
            worst_t = worst_t.max((g - t_hat[i]).abs());
            let e: f32 = (0..d)
                .map(|j| (x[i * d + j] - y[i * d + j]).powi(2))
                .sum::<f32>()
                .sqrt();
            worst_out = worst_out.max(e);
        }
        assert!(
            worst_t > 0.01,
            "the test needs t values that fp16 rounds: {worst_t}"
        );
        assert!(
            worst_out < 0.5 * worst_t,
            "decoded error {worst_out} vs t rounding {worst_t}"
        );
    }

    #[test]
    fn fp16_overflow_is_handled() {
        // The codec is scale-invariant up to rounding: values far beyond fp16's 65504 must code
        // as well as the same data at unit scale, and nothing may become inf.
        let (n, d) = (64, 16);
        let small: Vec<f32> = gaussian_rows(n, d, 5).iter().map(|v| v + 3.0).collect();
        let big: Vec<f32> = small.iter().map(|v| v * 1e6).collect();
        let p = CodecParams::default();
        let ys = roundtrip(&small, n, d, &p);
        let yb = roundtrip(&big, n, d, &p);
        assert!(yb.iter().all(|v| v.is_finite()));
        let (es, eb) = (rel_err(&small, &ys), rel_err(&big, &yb));
        assert!(
            (es - eb).abs() <= 0.05 * es,
            "unit scale {es}, 1e6 scale {eb}"
        );
    }

    #[test]
    fn randomized_rank_rule_counts_the_total_variance() {
        // Flat spectrum, 40 % of the variance: the randomized rule must agree with exact PCA.
        // Measured against the 40-dimensional sketch only (the predecessor), it stops far sooner.
        let (n, d) = (512, 64);
        let x = gaussian_rows(n, d, 9);
        let m = PcaMethod::Randomized {
            target_rank: Some(32),
            oversample: 8,
            power_iters: 2,
        };
        let exact = pca::fit(&x, n, d, None, PcaMethod::Exact, 0.4, None, 0).unwrap();
        let rand = pca::fit(&x, n, d, None, m, 0.4, None, 0).unwrap();
        assert!(
            rand.d_eff.abs_diff(exact.d_eff) <= 1,
            "{} vs {}",
            rand.d_eff,
            exact.d_eff
        );
        let sketch_total: f64 = rand.eigenvalues.iter().sum();
        let predecessor = pca::select_rank(&rand.eigenvalues, sketch_total, 0.4, 32);
        assert!(
            predecessor + 3 < rand.d_eff,
            "{predecessor} vs {}",
            rand.d_eff
        );
    }

    #[test]
    fn outliers_override_and_are_counted() {
        let (n, d) = (256, 32);
        let mut x = gaussian_rows(n, d, 11);
        for i in 0..n {
            x[i * d + 3] *= 30.0; // a heavy channel
        }
        let plain = CodecParams {
            variance_ratio: 1.0,
            k: 1,
            ..Default::default()
        };
        let with = CodecParams {
            outlier_threshold: Some(2.0),
            ..plain.clone()
        };
        let (e, _) = encode_layer(&x, n, d, None, &with, Some(1)).unwrap();
        let count: usize = e.blocks.iter().map(|b| b.1.outlier_pos.len()).sum();
        assert!(count > 0);
        let a = rel_err(&x, &roundtrip(&x, n, d, &plain));
        let b = rel_err(&x, &decode_layer(&e, Some(1)).unwrap());
        assert!(b < a, "outliers must help: {b} vs {a}");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        #[test]
        fn every_configuration_round_trips(
            seed in any::<u64>(), n in 1usize..200, d in 1usize..40, bits in 1u8..=4,
            metric in 0u8..3, randomized in any::<bool>(), fp32 in any::<bool>(),
            share in any::<bool>(), bs in 1usize..128, outl in any::<bool>(), k in 1usize..20,
        ) {
            let x = gaussian_rows(n, d, seed);
            let p = CodecParams {
                metric: Metric::from_code(metric).unwrap(),
                bit_width: bits,
                block_size: bs,
                k,
                share_basis: share,
                skeleton_dtype: if fp32 { SkeletonDtype::F32 } else { SkeletonDtype::F16 },
                outlier_threshold: outl.then_some(2.5),
                pca_method: if randomized {
                    PcaMethod::Randomized { target_rank: None, oversample: 4, power_iters: 1 }
                } else {
                    PcaMethod::Exact
                },
                ..Default::default()
            };
            let (e, _) = encode_layer(&x, n, d, None, &p, Some(1)).unwrap();
            let y = decode_layer(&e, Some(1)).unwrap();
            prop_assert_eq!(y.len(), n * d);
            prop_assert!(y.iter().all(|v| v.is_finite()));
            // Bounded error: never worse than replacing every row by zero, by a wide margin.
            prop_assert!(rel_err(&x, &y) < 1.5, "{}", rel_err(&x, &y));
            let (bytes, parts) = super::super::container::to_bytes(&e);
            prop_assert_eq!(bytes.len(), parts.total());
            let back = super::super::container::from_bytes(&bytes).unwrap();
            prop_assert_eq!(&back, &e);
        }
    }
}
