//! One block's codes back to rows (the per-block mode): the residuals unrotated and rescaled,
//! the mean and the basis added back; the parts checked against their skeleton first.

use super::block::{BlockCodes, Rotation, Skeleton};
use crate::error::{corrupt, input, Result};
use crate::gemm::matmul;
use crate::limits::{all_finite, max_abs, saturate, size, MAX_DIM, SAFE_F32};
use crate::pack::unpack_into;
use crate::quant::Quantizer;
use crate::wht;
use faer::{Accum, MatMut, MatRef, Par};
use half::f16;

/// Decode of the residuals in place (row-major, `n x d_eff`): the scale over `f_b`, the
/// inverse rotation and `+ t centre`, row by row in FORMAT.md's float32 operations and order.
/// Multiversioned like `block::code_rows`; the butterflies run in AVX-512 or AVX2 registers
/// where the CPU has them (`wht::fwht_f32`, the same values).
#[multiversion::multiversion(targets("x86_64+avx512f+avx512bw+avx512vl", "x86_64+avx2+fma"))]
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
            row[o..o + w].iter_mut().for_each(|v| *v *= mul);
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
    q.dequantize_fast(&idx, &mut c);
    for (&pos, &v) in codes.outlier_pos.iter().zip(&codes.outlier_val) {
        c[pos as usize] = f16::from_bits(v).to_f32();
    }
    let (t, s) = (codes.t.decode(), codes.scale.decode());
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
