//! Rows to codes and back against a calibration: projection (stage 2), sub-band rotation
//! (stage 4), per-row scale, Lloyd-Max and outliers (stage 5), and the reverse.

use super::calibration::CalibratedCodec;
use crate::error::{input, Error, Result};
use crate::f16::{ScaledF16, MAX_SCALED};
use crate::limits::{all_finite, check_input, max_abs, saturate, size, SAFE_F32};
use crate::metric::{least_squares_gain, Metric};
use crate::pack::{pack_fields, unpack_fields};
use crate::wht;
use faer::linalg::matmul::matmul;
use faer::{Accum, MatMut, MatRef, Par};
use half::f16;
use rayon::prelude::*;

/// Rows coded per task: fixed, so that the bytes never depend on the thread count.
const CHUNK_ROWS: usize = 256;

/// The per-row codes of a container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CalibratedCodes {
    pub n: usize,
    /// One fp16 scale per row with a shared exponent; `None` without `norm`.
    pub scale: Option<ScaledF16>,
    /// `n` rows of `row_bytes` bytes, each the row's indices packed LSB-first.
    pub codes: Vec<u8>,
    /// Ascending flat positions `row * m + j` of the outliers.
    pub outlier_pos: Vec<u32>,
    /// fp16 bits of the outliers' scaled values `z`.
    pub outlier_val: Vec<u16>,
}

/// Everything an encode computes on the way, for the kernels' parity tests and for fitting
/// Lloyd-Max tables on the codec's own `z`.
#[derive(Debug, Clone)]
pub struct CalibratedParts {
    pub codes: CalibratedCodes,
    /// `n x m` unpacked indices.
    pub indices: Vec<u8>,
    /// `n x m` scaled, rotated coordinates before quantisation.
    pub z: Vec<f32>,
    /// The scale each row was divided by (stored `g`, or 1).
    pub g: Vec<f32>,
}

impl CalibratedCodec {
    /// Stage 2 for a chunk of rows: `u = (x - mu) A'^T`, `A' = A / sigma`.
    fn project(&self, x: &[f32]) -> Vec<f32> {
        let (d, m) = (self.d, self.m);
        let n = x.len() / d;
        let mut xc = x.to_vec();
        for row in xc.chunks_exact_mut(d) {
            for (v, mu) in row.iter_mut().zip(&self.mean) {
                *v -= mu;
            }
        }
        let mut u = vec![0f32; n * m];
        matmul(
            MatMut::from_row_major_slice_mut(&mut u, n, m),
            Accum::Replace,
            MatRef::from_row_major_slice(&xc, n, d),
            MatRef::from_row_major_slice(&self.a_scaled, m, d).transpose(),
            1.0,
            Par::Seq,
        );
        u
    }

    /// A row's indices, component `j` at `bits[j]` bits, LSB-first (the shared packing).
    fn pack_row(&self, idx: &[u8], out: &mut [u8]) {
        pack_fields(
            idx.iter()
                .zip(&self.bits)
                .map(|(&v, &b)| (v as u32, b as u32)),
            out,
        );
    }

    fn unpack_row(&self, row: &[u8], idx: &mut [u8]) {
        unpack_fields(row, self.bits.iter().map(|&b| b as u32), idx, |v| v as u8);
    }

    /// Stage 2 for one row in f64: `u = A' (x - mu)` for a row whose float32 projection
    /// overflows (`|x - mean| / spread` beyond the float32 range).
    fn project_wide(&self, x: &[f32]) -> Vec<f64> {
        self.a_scaled
            .chunks_exact(self.d)
            .map(|a| {
                x.iter()
                    .zip(&self.mean)
                    .zip(a)
                    .map(|((&v, &mu), &w)| (v as f64 - mu as f64) * w as f64)
                    .sum()
            })
            .collect()
    }

    /// Stage 4 for a wide row: rotate `u` per sub-band in f64, divide by `g` (0 when `g = 0`)
    /// and round `z` to f32, saturating.
    fn rotate_wide(&self, mut u: Vec<f64>, g: f64, z: &mut [f32]) {
        for band in &self.bands {
            let (o, w) = (band.offset, band.width);
            let seg = &mut u[o..o + w];
            seg.iter_mut()
                .zip(&self.signs[o..o + w])
                .for_each(|(v, &s)| *v *= s as f64);
            wht::fwht(seg);
            let f = if g > 0.0 { band.norm as f64 / g } else { 0.0 };
            for (zj, &v) in z[o..o + w].iter_mut().zip(seg.iter()) {
                *zj = saturate(v * f);
            }
        }
    }

    /// Encodes `n` rows (`x` row-major `[n, D]`), keeping the intermediate values.
    ///
    /// Float32 arithmetic as `FORMAT.md` gives it. A row it cannot hold ("wide": its
    /// coefficients or `z` overflow, or its scale lies beyond the float32 range or is so small
    /// that `1 / g` overflows) is coded from f64 arithmetic instead, and the scales then come
    /// from [`ScaledF16::encode_f64`]; ordinary rows never take that path, so their bytes are
    /// those of the float32 rule. A row whose scale exceeds what the format stores (about
    /// 5.6e42) is refused with [`crate::Error::InvalidInput`].
    pub fn encode_parts(&self, x: &[f32], n: usize) -> Result<CalibratedParts> {
        check_input(x, n, self.d, None)?;
        if (n as u64) * (self.m as u64) > u32::MAX as u64 {
            return input("N x m must fit in 32 bits (outlier positions)");
        }
        let (d, m, rb) = (self.d, self.m, self.row_bytes());
        // Pass 1: unit-variance components and the rms scale of every row.
        let mut u = vec![0f32; n * m];
        u.par_chunks_mut(CHUNK_ROWS * m)
            .zip(x.par_chunks(CHUNK_ROWS * d))
            .for_each(|(dst, src)| dst.copy_from_slice(&self.project(src)));
        let scale = if self.params.norm {
            let mut wide = false;
            let rms: Vec<f64> = u
                .chunks_exact(m)
                .zip(x.chunks_exact(d))
                .map(|(r, xr)| {
                    if all_finite(r) {
                        let s: f64 = r.iter().map(|&v| (v as f64) * (v as f64)).sum();
                        (s / m as f64).sqrt() as f32 as f64
                    } else {
                        wide = true;
                        let w = self.project_wide(xr);
                        (w.iter().map(|v| v * v).sum::<f64>() / m as f64).sqrt()
                    }
                })
                .collect();
            Some(scales(&rms, wide)?)
        } else {
            None
        };
        let g: Vec<f32> = match &scale {
            Some(s) => s.decode(),
            None => vec![1.0; n],
        };
        // Pass 2: rotate, scale, quantise, outliers, pack; rows in fixed chunks.
        let ip = self.params.metric == Metric::InnerProduct;
        let mut z = u;
        let mut indices = vec![0u8; n * m];
        let mut codes = vec![0u8; n * rb];
        type ChunkOut = (Vec<u32>, Vec<u16>, Vec<f64>, bool);
        let per_chunk: Vec<ChunkOut> = z
            .par_chunks_mut(CHUNK_ROWS * m)
            .zip(indices.par_chunks_mut(CHUNK_ROWS * m))
            .zip(codes.par_chunks_mut(CHUNK_ROWS * rb))
            .zip(x.par_chunks(CHUNK_ROWS * d))
            .enumerate()
            .map(|(ci, (((zc, ic), cc), xc))| {
                let mut pos = Vec::new();
                let mut val = Vec::new();
                let mut gains = Vec::new();
                let mut any_wide = false;
                let mut qv = vec![0f32; m];
                for (r, ((zr, ir), xr)) in zc
                    .chunks_exact_mut(m)
                    .zip(ic.chunks_exact_mut(m))
                    .zip(xc.chunks_exact(d))
                    .enumerate()
                {
                    let row = ci * CHUNK_ROWS + r;
                    let gi = g[row];
                    for band in &self.bands {
                        let (o, w) = (band.offset, band.width);
                        wht::rotate(&mut zr[o..o + w], &self.signs[o..o + w]);
                        let f = if gi > 0.0 { band.norm / gi } else { 0.0 };
                        zr[o..o + w].iter_mut().for_each(|v| *v *= f);
                    }
                    let wide = !gi.is_finite() || !all_finite(zr);
                    let g64 = match &scale {
                        Some(s) if wide => s.value_f64(row),
                        _ => gi as f64,
                    };
                    if wide {
                        any_wide = true;
                        self.rotate_wide(self.project_wide(xr), g64, zr);
                    }
                    for band in &self.bands {
                        let (o, w) = (band.offset, band.width);
                        let q = self.q(band.bits);
                        q.quantize_slice(&zr[o..o + w], &mut ir[o..o + w]);
                        q.dequantize_slice(&ir[o..o + w], &mut qv[o..o + w]);
                    }
                    if let Some(th) = self.params.outlier_threshold {
                        for (j, &zj) in zr.iter().enumerate() {
                            if zj.abs() > th {
                                let h = f16::from_f32(zj.clamp(-65504.0, 65504.0));
                                pos.push((row * m + j) as u32);
                                val.push(h.to_bits());
                                qv[j] = h.to_f32();
                            }
                        }
                    }
                    if ip {
                        let gain = least_squares_gain(gi, zr, &qv);
                        if wide || !gain.is_finite() {
                            any_wide = true;
                            gains.push(gain_wide(g64, zr, &qv));
                        } else {
                            gains.push(gain as f64);
                        }
                    }
                    self.pack_row(ir, &mut cc[r * rb..(r + 1) * rb]);
                }
                (pos, val, gains, any_wide)
            })
            .collect();
        let mut outlier_pos = Vec::new();
        let mut outlier_val = Vec::new();
        let mut gains = Vec::new();
        let mut any_wide = false;
        for (p, v, g, w) in per_chunk {
            outlier_pos.extend(p);
            outlier_val.extend(v);
            gains.extend(g);
            any_wide |= w;
        }
        let g = match &scale {
            Some(s) if any_wide => s.decode_f64().into_iter().map(saturate).collect(),
            _ => g,
        };
        let scale = if ip {
            Some(scales(&gains, any_wide)?)
        } else {
            scale
        };
        Ok(CalibratedParts {
            codes: CalibratedCodes {
                n,
                scale,
                codes,
                outlier_pos,
                outlier_val,
            },
            indices,
            z,
            g,
        })
    }

    pub fn encode(&self, x: &[f32], n: usize) -> Result<CalibratedCodes> {
        Ok(self.encode_parts(x, n)?.codes)
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
        let (d, m, rb, n) = (self.d, self.m, self.row_bytes(), c.n);
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
        // Every row starts as the mean (the synthesis is added to it); reserved fallibly.
        let mut out: Vec<f32> = Vec::new();
        out.try_reserve_exact(size(n, d, "the decoded rows")?)
            .map_err(|_| Error::InvalidInput(format!("cannot allocate [{n}, {d}] floats")))?;
        (0..n).for_each(|_| out.extend_from_slice(&self.mean));
        out.par_chunks_mut(CHUNK_ROWS * d)
            .enumerate()
            .try_for_each(|(ci, oc)| {
                let rows = oc.len() / d;
                let r0 = ci * CHUNK_ROWS;
                let mut u = vec![0f32; rows * m];
                let mut idx = vec![0u8; m];
                // Outliers of this chunk: a contiguous run of the ascending positions.
                let lo = c.outlier_pos.partition_point(|&p| (p as usize) < r0 * m);
                let hi = c
                    .outlier_pos
                    .partition_point(|&p| (p as usize) < (r0 + rows) * m);
                let mut o = lo;
                for (r, ur) in u.chunks_exact_mut(m).enumerate() {
                    let row = r0 + r;
                    self.unpack_row(&c.codes[row * rb..(row + 1) * rb], &mut idx);
                    for band in &self.bands {
                        let (of, w) = (band.offset, band.width);
                        self.q(band.bits)
                            .dequantize_slice(&idx[of..of + w], &mut ur[of..of + w]);
                    }
                    while o < hi && (c.outlier_pos[o] as usize) < (row + 1) * m {
                        ur[c.outlier_pos[o] as usize - row * m] =
                            f16::from_bits(c.outlier_val[o]).to_f32();
                        o += 1;
                    }
                    for band in &self.bands {
                        let (of, w) = (band.offset, band.width);
                        let f = g[row] * band.norm;
                        let seg = &mut ur[of..of + w];
                        seg.iter_mut().for_each(|v| *v *= f);
                        wht::fwht(seg);
                        for (v, s) in seg.iter_mut().zip(&self.signs[of..of + w]) {
                            *v *= s;
                        }
                    }
                }
                matmul(
                    MatMut::from_row_major_slice_mut(oc, rows, d),
                    Accum::Add,
                    MatRef::from_row_major_slice(&u, rows, m),
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
            })?;
        Ok(out)
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

/// The stored per-row scales: the float32 rule when every row took it, else from f64 values
/// (a refusal when one exceeds what the format stores).
fn scales(v: &[f64], wide: bool) -> Result<ScaledF16> {
    if !wide {
        return Ok(ScaledF16::encode(
            &v.iter().map(|&x| x as f32).collect::<Vec<_>>(),
        ));
    }
    ScaledF16::encode_f64(v).map_err(|_| {
        let max = v.iter().fold(0f64, |a, b| a.max(b.abs()));
        Error::InvalidInput(format!(
            "a row's scale of {max:e} (its coefficients (x - mean) . analysis / spread) is \
             beyond what the format stores ({MAX_SCALED:e})"
        ))
    })
}

/// The bound of [`CalibratedCodec::decode`] on every intermediate of a row with scale `g`:
/// `|g|`, the butterfly's `m qmax |g|`, and the synthesis `|mean| + m |S'| m qmax |g|`.
fn row_bound(g: f32, mean_max: f64, butterfly: f64, synth: f64) -> f64 {
    let g = g.abs() as f64;
    g.max(butterfly * g).max(mean_max + synth * butterfly * g)
}

/// The `inner_product` gain of a wide row in f64.
fn gain_wide(g: f64, z: &[f32], q: &[f32]) -> f64 {
    let qq: f64 = q.iter().map(|&v| v as f64 * v as f64).sum();
    if qq > 0.0 {
        let zq: f64 = z.iter().zip(q).map(|(&a, &b)| a as f64 * b as f64).sum();
        g * (zq / qq)
    } else {
        g
    }
}

#[cfg(test)]
mod tests {
    use super::super::testutil::{codec, noise, rel, rows};
    use super::*;
    use crate::rng::SplitMix64;
    use proptest::prelude::*;

    #[test]
    fn error_falls_with_bits_as_lloyd_max_predicts() {
        // Every component at b bits: the relative error (against the centred energy) is about
        // the N(0,1) Lloyd-Max distortion of b bits.
        let lm = [0.3634, 0.1175, 0.03455, 0.0095, 0.0025, 0.00064];
        for (b, want) in (1..=6).zip(lm) {
            let c = codec(32, vec![b; 32], true, Metric::Mse, None);
            let x = rows(&c, 2048, 3);
            let y = c.decode(&c.encode(&x, 2048).unwrap()).unwrap();
            let e = rel(&x, &y, &c.mean);
            assert!((e / want - 1.0).abs() < 0.25, "b = {b}: {e} vs {want}");
        }
    }

    #[test]
    fn deterministic_across_thread_counts() {
        let c = codec(16, vec![3; 12], true, Metric::Mse, Some(3.0));
        let x = rows(&c, 1000, 9);
        let a = crate::threads::with_threads(Some(1), || c.encode(&x, 1000))
            .unwrap()
            .unwrap();
        let b = crate::threads::with_threads(Some(2), || c.encode(&x, 1000))
            .unwrap()
            .unwrap();
        assert_eq!(a, b);
    }

    #[test]
    fn rows_beyond_the_float32_range_are_coded_in_f64() {
        // The same calibration for rows 1e9 times larger, with spreads 1e-30 times smaller:
        // the coefficients are 1e39 times larger and overflow float32. norm makes the codec
        // scale-invariant, so the error must match the unit calibration's.
        let unit = codec(12, vec![4; 8], true, Metric::InnerProduct, Some(2.5));
        let tiny = CalibratedCodec::new(
            unit.d,
            unit.mean.iter().map(|v| v * 1e9).collect(),
            unit.analysis.clone(),
            unit.synthesis.clone(),
            unit.spread.iter().map(|v| v * 1e-30).collect(),
            unit.bits.clone(),
            vec![],
            unit.params.clone(),
        )
        .unwrap();
        let x = rows(&unit, 300, 4);
        let big: Vec<f32> = x.iter().map(|v| v * 1e9).collect();
        let codes = tiny.encode(&big, 300).unwrap();
        let y = tiny
            .decode(&tiny.from_bytes(&tiny.to_bytes(&codes).0).unwrap())
            .unwrap();
        assert!(y.iter().all(|v| v.is_finite()));
        let r = rel(&big, &y, &tiny.mean);
        let ru = rel(
            &x,
            &unit.decode(&unit.encode(&x, 300).unwrap()).unwrap(),
            &unit.mean,
        );
        assert!((r / ru - 1.0).abs() < 0.05, "{r} vs {ru}");
    }

    #[test]
    fn huge_or_negative_scales_decode_to_finite_values() {
        // Found by `make fuzz`: a negative scale of a large magnitude slipped past the bound
        // that lets ordinary rows skip the scan of their output.
        let c = codec(16, vec![1, 1, 1], true, Metric::Mse, Some(0.5));
        let mut codes = c.encode(&rows(&c, 9, 2), 9).unwrap();
        let s = codes.scale.as_mut().unwrap();
        s.exp = 120;
        s.bits[3] |= 0x8000;
        s.bits[5] = 0xfbff; // -65504
        let y = c.decode(&codes).unwrap();
        assert!(y.iter().all(|v| v.is_finite()));
    }

    #[test]
    fn overflows_multiplied_by_zero_are_caught() {
        // The per-block twin was found by `make fuzz`: a bound that only looks at the output
        // (here the synthesis, 0) misses a scale whose q * g overflows on the way. Every
        // intermediate must count.
        assert!(row_bound(3e38, 0.0, 65504.0, 0.0) > SAFE_F32);
        assert!(row_bound(-3e38, 1.0, 1.0, 1.0) > SAFE_F32);
        assert!(row_bound(f32::INFINITY, 1.0, 1.0, 0.0) > SAFE_F32);
        assert!(row_bound(1e3, 1.0, 8.0 * 2.7, 8.0) <= SAFE_F32);
    }

    #[test]
    fn reconstructions_past_the_float32_maximum_saturate() {
        let c = CalibratedCodec::new(
            1,
            vec![0.0],
            vec![1.0],
            vec![1.0],
            vec![3e38],
            vec![2],
            vec![],
            crate::calibrated::CalibratedParams {
                rotation_seed: 1,
                metric: Metric::Mse,
                outlier_threshold: None,
                norm: false,
            },
        )
        .unwrap();
        let y = c
            .decode(&c.encode(&[-3.3e38, 3.3e38, 1e30], 3).unwrap())
            .unwrap();
        assert_eq!(y[0], -f32::MAX);
        assert_eq!(y[1], f32::MAX);
        assert!(y[2].is_finite());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        #[test]
        fn every_configuration_round_trips(
            seed in any::<u64>(), n in 1usize..300, d in 1usize..40, m_frac in 0.05f64..1.0,
            bmax in 1u8..=8, norm in any::<bool>(), ip in any::<bool>(), outl in any::<bool>(),
        ) {
            let m = ((d as f64 * m_frac).ceil() as usize).clamp(1, d);
            let bits: Vec<u8> = (0..m).map(|j| (bmax as usize).saturating_sub(j / 3).max(1) as u8).collect();
            let metric = if ip && norm { Metric::InnerProduct } else { Metric::Mse };
            let c = codec(d, bits, norm, metric, outl.then_some(2.0));
            let mut g = SplitMix64::new(seed);
            let x: Vec<f32> = (0..n * d).map(|_| noise(&mut g) * 3.0).collect();
            let codes = c.encode(&x, n).unwrap();
            let (bytes, parts) = c.to_bytes(&codes);
            prop_assert_eq!(bytes.len(), parts.total());
            let back = c.from_bytes(&bytes).unwrap();
            prop_assert_eq!(&back, &codes);
            let y = c.decode(&back).unwrap();
            prop_assert_eq!(y.len(), n * d);
            prop_assert!(y.iter().all(|v| v.is_finite()));
            let parts = c.encode_parts(&x, n).unwrap();
            prop_assert_eq!(c.unpack(&codes).unwrap(), parts.indices);
        }
    }
}
