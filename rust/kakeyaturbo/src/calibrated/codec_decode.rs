//! Codes back to rows: the checks of codes against a calibration, the decode in float32 with
//! its f64 fallback for the rows that overflow, and the unpacked indices.

use super::super::calibration::CalibratedCodec;
use super::{row_bound, CalibratedCodes, CHUNK_ROWS};
use crate::error::{Error, Result};
use crate::gemm::matmul;
use crate::limits::{all_finite, max_abs, saturate, size, SAFE_F32};
use crate::pack::unpack_fields;
use crate::wht;
use faer::{Accum, MatMut, MatRef, Par};
use half::f16;
use rayon::prelude::*;

impl CalibratedCodec {
    fn unpack_row(&self, row: &[u8], idx: &mut [u8]) {
        unpack_fields(row, self.bits.iter().map(|&b| b as u32), idx, |v| v as u8);
    }

    /// Checks codes against this calibration (lengths, positions, stored values); never
    /// panics, and after it decoding cannot index out of bounds.
    pub fn check_codes(&self, c: &CalibratedCodes) -> Result<()> {
        let bad = |m: String| Err(Error::Corrupt(m));
        if c.n.checked_mul(self.row_bytes()) != Some(c.codes.len()) {
            return bad(format!(
                "{} code bytes for {} rows of {} bytes",
                c.codes.len(),
                c.n,
                self.row_bytes()
            ));
        }
        match (&c.scale, self.params.norm) {
            (Some(s), true) if s.bits.len() == c.n => s.check("scale")?,
            (None, false) => {}
            _ => return bad("per-row scales disagree with the calibration".into()),
        }
        if c.outlier_pos.len() != c.outlier_val.len() {
            return bad("outlier positions and values differ in number".into());
        }
        if self.params.outlier_threshold.is_none() && !c.outlier_pos.is_empty() {
            return bad("outliers in a container of a calibration without them".into());
        }
        // n * row_bytes fits (above) and m <= 8 * row_bytes, so n * m fits in u128.
        let cells = c.n as u128 * self.m as u128;
        if c.outlier_pos.windows(2).any(|w| w[0] >= w[1])
            || c.outlier_pos.last().is_some_and(|&p| p as u128 >= cells)
        {
            return bad("outlier positions out of range or not ascending".into());
        }
        if c.outlier_val
            .iter()
            .any(|&h| !f16::from_bits(h).to_f32().is_finite())
        {
            return bad("an outlier value is not finite".into());
        }
        Ok(())
    }

    /// Decodes codes into `[n, D]` row-major, in float32; a row whose result is not finite
    /// (a scale beyond the float32 range, or a reconstruction past `f32::MAX`) is decoded again
    /// in f64, each value saturating at `+-f32::MAX`. Every value returned is finite.
    pub fn decode(&self, c: &CalibratedCodes) -> Result<Vec<f32>> {
        self.check_codes(c)?;
        // Reserved fallibly: the rows are what the container says it holds.
        let mut out: Vec<f32> = Vec::new();
        out.try_reserve_exact(size(c.n, self.d, "the decoded rows")?)
            .map_err(|_| {
                Error::InvalidInput(format!("cannot allocate [{}, {}] floats", c.n, self.d))
            })?;
        // Every row starts as the mean (the synthesis is added to it).
        (0..c.n).for_each(|_| out.extend_from_slice(&self.mean));
        self.decode_checked(c, &mut out)?;
        Ok(out)
    }

    /// [`Self::decode`] into `out`, which must hold `n x D` values (overwritten).
    pub fn decode_into(&self, c: &CalibratedCodes, out: &mut [f32]) -> Result<()> {
        self.check_codes(c)?;
        if Some(out.len()) != c.n.checked_mul(self.d) {
            return Err(Error::InvalidInput(format!(
                "{} floats given for [{}, {}] decoded rows",
                out.len(),
                c.n,
                self.d
            )));
        }
        out.chunks_exact_mut(self.d)
            .for_each(|row| row.copy_from_slice(&self.mean));
        self.decode_checked(c, out)
    }

    /// [`Self::decode_into`] of checked codes into `n x D` values, each row holding the mean
    /// (the synthesis is added to it).
    fn decode_checked(&self, c: &CalibratedCodes, out: &mut [f32]) -> Result<()> {
        let (d, m, n) = (self.d, self.m, c.n);
        let g: Vec<f32> = match &c.scale {
            Some(s) => s.decode(),
            None => vec![1.0; n],
        };
        // Every stored value is finite, so only an overflow can make a row non-finite: a row
        // whose intermediates are all bounded below 2^120 (every ordinary row) is not scanned.
        // With qmax bounding the centroids and outlier values: `|g|`; `|q g r| <= qmax |g|`
        // (r <= 1); the butterfly's sums of at most m such terms; and the synthesis,
        // `|mean| + m (m qmax |g|) |S'|`. (Each is listed: a product with 0 could otherwise turn
        // an overflow into NaN.)
        let qmax = self
            .bands
            .iter()
            .map(|b| max_abs(self.q(b.bits).centroids()))
            .fold(0f64, f64::max)
            .max(if c.outlier_pos.is_empty() {
                0.0
            } else {
                65504.0
            });
        let (butterfly, synth) = (m as f64 * qmax, m as f64 * max_abs(&self.s_scaled));
        let mean_max = max_abs(&self.mean);
        out.par_chunks_mut(CHUNK_ROWS * d)
            .enumerate()
            .try_for_each(|(ci, oc)| {
                let rows = oc.len() / d;
                let r0 = ci * CHUNK_ROWS;
                // The chunk's components column-major (component j of every row at
                // u[j * rows..]).
                let u = components(self, c, r0, &g[r0..r0 + rows]);
                matmul(
                    MatMut::from_row_major_slice_mut(oc, rows, d),
                    Accum::Add,
                    MatRef::from_column_major_slice(&u, rows, m),
                    MatRef::from_row_major_slice(&self.s_scaled, m, d),
                    1.0,
                    Par::Seq,
                );
                for (r, orow) in oc.chunks_exact_mut(d).enumerate() {
                    let bound = row_bound(g[r0 + r], mean_max, butterfly, synth);
                    if !(bound <= SAFE_F32 || all_finite(orow)) {
                        self.decode_row_wide(c, r0 + r, orow);
                        if !all_finite(orow) {
                            return Err(Error::Corrupt(format!(
                                "row {} decodes to values that are not finite",
                                r0 + r
                            )));
                        }
                    }
                }
                Ok(())
            })
    }

    /// One row of [`Self::decode`] in f64: every stored value is finite and at most
    /// `32768 * 2^127`, so nothing overflows; the result saturates to the float32 range.
    #[cold]
    #[inline(never)]
    fn decode_row_wide(&self, c: &CalibratedCodes, row: usize, out: &mut [f32]) {
        let (m, rb) = (self.m, self.row_bytes());
        let mut idx = vec![0u8; m];
        self.unpack_row(&c.codes[row * rb..(row + 1) * rb], &mut idx);
        let mut u = vec![0f64; m];
        for band in &self.bands {
            let q = self.q(band.bits);
            for j in band.offset..band.offset + band.width {
                u[j] = q.dequantize(idx[j] & (q.centroids().len() - 1) as u8) as f64;
            }
        }
        let lo = c.outlier_pos.partition_point(|&p| (p as usize) < row * m);
        for (&p, &h) in c.outlier_pos[lo..].iter().zip(&c.outlier_val[lo..]) {
            if p as usize >= (row + 1) * m {
                break;
            }
            u[p as usize - row * m] = f16::from_bits(h).to_f64();
        }
        let g = c.scale.as_ref().map_or(1.0, |s| s.value_f64(row));
        for band in &self.bands {
            let (of, w) = (band.offset, band.width);
            let seg = &mut u[of..of + w];
            seg.iter_mut().for_each(|v| *v *= g * band.norm as f64);
            wht::fwht(seg);
            for (v, &s) in seg.iter_mut().zip(&self.signs[of..of + w]) {
                *v *= s as f64;
            }
        }
        let mut x: Vec<f64> = self.mean.iter().map(|&v| v as f64).collect();
        for (&uj, sj) in u.iter().zip(self.s_scaled.chunks_exact(self.d)) {
            x.iter_mut().zip(sj).for_each(|(a, &s)| *a += uj * s as f64);
        }
        out.iter_mut().zip(&x).for_each(|(o, &v)| *o = saturate(v));
    }

    /// Unpacks the indices of every row (`n x m`), for inspection and the kernels' tests.
    pub fn unpack(&self, c: &CalibratedCodes) -> Result<Vec<u8>> {
        self.check_codes(c)?;
        let (m, rb) = (self.m, self.row_bytes());
        let mut idx = vec![0u8; c.n * m];
        for (row, out) in idx.chunks_exact_mut(m).enumerate() {
            self.unpack_row(&c.codes[row * rb..(row + 1) * rb], out);
        }
        Ok(idx)
    }
}

/// The components of rows `r0..r0 + g.len()` of checked codes `c` (`g` their scales),
/// column-major (component `j` of row `r0 + r` at `[j * rows + r]`): centroids, outliers, then
/// per sub-band times `g * norm`, the butterfly and the signs, each value through the float32
/// operations of FORMAT.md in their order, so each row's are those of decoding it alone.
/// Compiled for several instruction sets, picked at run time (the loops run down columns, where
/// they vectorise).
#[multiversion::multiversion(targets("x86_64+avx512f+avx512bw+avx512vl", "x86_64+avx2"))]
fn components(cal: &CalibratedCodec, c: &CalibratedCodes, r0: usize, g: &[f32]) -> Vec<f32> {
    let (m, rb, rows) = (cal.m, cal.row_bytes(), g.len());
    let mut u = vec![0f32; m * rows];
    dequantize_columns(cal, &c.codes[r0 * rb..(r0 + rows) * rb], rows, &mut u);
    // Outliers of these rows: a contiguous run of the ascending positions.
    let lo = c.outlier_pos.partition_point(|&p| (p as usize) < r0 * m);
    let hi = c
        .outlier_pos
        .partition_point(|&p| (p as usize) < (r0 + rows) * m);
    for (&p, &h) in c.outlier_pos[lo..hi].iter().zip(&c.outlier_val[lo..hi]) {
        let (r, j) = (p as usize / m - r0, p as usize % m);
        u[j * rows + r] = f16::from_bits(h).to_f32();
    }
    let mut f = vec![0f32; rows];
    for band in &cal.bands {
        let (of, w) = (band.offset, band.width);
        for (fr, &gr) in f.iter_mut().zip(g) {
            *fr = gr * band.norm;
        }
        let seg = &mut u[of * rows..(of + w) * rows];
        for col in seg.chunks_exact_mut(rows) {
            col.iter_mut().zip(&f).for_each(|(v, &s)| *v *= s);
        }
        wht::fwht_columns(seg, rows);
        for (col, &s) in seg.chunks_exact_mut(rows).zip(&cal.signs[of..of + w]) {
            col.iter_mut().for_each(|v| *v *= s);
        }
    }
    u
}

/// The centroids of `rows` rows of codes (`codes` their bytes, checked) into `u`
/// column-major: component `j` of row `r` at `u[j * rows + r]`. A component's field lies at
/// the same bits of every row (LSB-first, [`unpack_fields`]' layout), one byte or two.
#[inline(always)]
fn dequantize_columns(cal: &CalibratedCodec, codes: &[u8], rows: usize, u: &mut [f32]) {
    let rb = cal.row_bytes();
    let mut bit = 0;
    for band in &cal.bands {
        let cent = cal.q(band.bits).centroids();
        let (bits, mask) = (band.bits as usize, cent.len() - 1);
        let cols = &mut u[band.offset * rows..(band.offset + band.width) * rows];
        for col in cols.chunks_exact_mut(rows) {
            let (byte, shift) = (bit / 8, bit % 8);
            let rows_of = codes.chunks_exact(rb);
            if shift + bits <= 8 {
                for (v, row) in col.iter_mut().zip(rows_of) {
                    *v = cent[(row[byte] >> shift) as usize & mask];
                }
            } else {
                for (v, row) in col.iter_mut().zip(rows_of) {
                    let w = u16::from_le_bytes([row[byte], row[byte + 1]]);
                    *v = cent[(w >> shift) as usize & mask];
                }
            }
            bit += bits;
        }
    }
}
