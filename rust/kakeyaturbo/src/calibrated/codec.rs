//! Rows to codes and back against a calibration: projection (stage 2), sub-band rotation
//! (stage 4), per-row scale, Lloyd-Max and outliers (stage 5), and the reverse.

use super::calibration::CalibratedCodec;
use crate::error::{input, Error, Result};
use crate::f16::{ScaledF16, MAX_SCALED};
use crate::gemm::matmul;
use crate::limits::{check_input, saturate};
use crate::metric::{least_squares_gain, Metric};
use crate::threads::with_threads_for;
use crate::wht;
use faer::{Accum, MatMut, MatRef, Par};
use half::f16;
use rayon::prelude::*;

#[path = "codec_decode.rs"]
mod decode;

/// Rows coded per task: fixed, so that the bytes never depend on the thread count.
pub(super) const CHUNK_ROWS: usize = 256;

/// Runs `f`, an encode or decode of `n` rows, on `threads` threads, or on the calling thread
/// where the rows fit one chunk of `CHUNK_ROWS` (256) ([`with_threads_for`]).
pub fn on_threads<R: Send>(
    threads: Option<usize>,
    n: usize,
    f: impl FnOnce() -> Result<R> + Send,
) -> Result<R> {
    with_threads_for(threads, n.div_ceil(CHUNK_ROWS), f)
}

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
    /// Stage 2 for a chunk of rows: `u = (x - mu) A'^T`, `A' = A / sigma`, into `u`
    /// column-major (component `j` of the chunk's rows at `u[j * rows..]`).
    fn project(&self, x: &[f32], u: &mut [f32]) {
        let (d, m) = (self.d, self.m);
        let n = x.len() / d;
        let mut xc = x.to_vec();
        for row in xc.chunks_exact_mut(d) {
            for (v, mu) in row.iter_mut().zip(&self.mean) {
                *v -= mu;
            }
        }
        matmul(
            MatMut::from_column_major_slice_mut(u, n, m),
            Accum::Replace,
            MatRef::from_row_major_slice(&xc, n, d),
            MatRef::from_row_major_slice(&self.a_scaled, m, d).transpose(),
            1.0,
            Par::Seq,
        );
    }

    /// The rms scale of each row of a chunk from its components `u` (column-major, as
    /// [`Self::project`] leaves them): the f64 sum of squares in component order, rounded
    /// through f32; a row whose float32 components overflowed from its f64 projection instead.
    /// With whether any row did.
    fn rms(&self, u: &[f32], x: &[f32]) -> (Vec<f64>, bool) {
        let (d, m) = (self.d, self.m);
        let rows = x.len() / d;
        let (sum, finite) = sums_of_squares(u, rows);
        let mut wide = false;
        let rms = (0..rows)
            .map(|r| {
                if finite[r] {
                    (sum[r] / m as f64).sqrt() as f32 as f64
                } else {
                    wide = true;
                    let w = self.project_wide(&x[r * d..(r + 1) * d]);
                    (w.iter().map(|v| v * v).sum::<f64>() / m as f64).sqrt()
                }
            })
            .collect();
        (rms, wide)
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
        self.encode_keeping(x, n, true)
    }

    /// [`Self::encode_parts`]; without `keep`, `indices` and `z` are not filled in (the codes,
    /// all an encode returns, are the same).
    fn encode_keeping(&self, x: &[f32], n: usize, keep: bool) -> Result<CalibratedParts> {
        check_input(x, n, self.d, None)?;
        if (n as u64) * (self.m as u64) > u32::MAX as u64 {
            return input("N x m must fit in 32 bits (outlier positions)");
        }
        let (d, m, rb) = (self.d, self.m, self.row_bytes());
        // Pass 1: unit-variance components (column-major within each chunk) and the rms
        // scale of every row.
        let mut u = vec![0f32; n * m];
        let norm = self.params.norm;
        let rms: Vec<(Vec<f64>, bool)> = u
            .par_chunks_mut(CHUNK_ROWS * m)
            .zip(x.par_chunks(CHUNK_ROWS * d))
            .map(|(dst, src)| {
                self.project(src, dst);
                if norm {
                    self.rms(dst, src)
                } else {
                    (vec![], false)
                }
            })
            .collect();
        let scale = if norm {
            let wide = rms.iter().any(|c| c.1);
            Some(scales(
                &rms.into_iter().flat_map(|c| c.0).collect::<Vec<_>>(),
                wide,
            )?)
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
        let per_chunk: Vec<ChunkOut> = z
            .par_chunks_mut(CHUNK_ROWS * m)
            .zip(indices.par_chunks_mut(CHUNK_ROWS * m))
            .zip(codes.par_chunks_mut(CHUNK_ROWS * rb))
            .zip(x.par_chunks(CHUNK_ROWS * d))
            .enumerate()
            .map(|(ci, (((zc, ic), cc), xc))| {
                let r0 = ci * CHUNK_ROWS;
                let g = &g[r0..r0 + zc.len() / m];
                encode_chunk(self, zc, ic, cc, xc, g, r0, scale.as_ref(), keep)
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
        Ok(self.encode_keeping(x, n, false)?.codes)
    }
}

/// Pass 2 of [`CalibratedCodec::encode_parts`] for one chunk of `rows` rows starting at row `r0`: `zt`
/// their unit-variance components, column-major (component `j` of every row at
/// `zt[j * rows..]`: worked on in place down the columns), `g` their scales; writes their
/// packed codes, and with `keep` (or for `inner_product`'s gains) their `z` into `zt`,
/// row-major, and their indices into `ic`. Each value goes through the float32 operations
/// of FORMAT.md in their order, so the bytes are those of coding the rows one at a time
/// (compiled for several instruction sets, picked at run time: the loops run down columns,
/// where they vectorise, and each value's operations are the same on every one).
#[allow(clippy::too_many_arguments)]
#[multiversion::multiversion(targets("x86_64+avx512f+avx512bw+avx512vl", "x86_64+avx2"))]
fn encode_chunk(
    c: &CalibratedCodec,
    zt: &mut [f32],
    ic: &mut [u8],
    cc: &mut [u8],
    xc: &[f32],
    g: &[f32],
    r0: usize,
    scale: Option<&ScaledF16>,
    keep: bool,
) -> ChunkOut {
    let (d, m) = (c.d, c.m);
    let rows = g.len();
    // Rotate each sub-band (signs, butterfly), then times norm / g.
    let mut f = vec![0f32; rows];
    for band in &c.bands {
        let (o, w) = (band.offset, band.width);
        let seg = &mut zt[o * rows..(o + w) * rows];
        for (col, &s) in seg.chunks_exact_mut(rows).zip(&c.signs[o..o + w]) {
            col.iter_mut().for_each(|v| *v *= s);
        }
        wht::fwht_columns(seg, rows);
        for (fr, &gi) in f.iter_mut().zip(g) {
            *fr = if gi > 0.0 { band.norm / gi } else { 0.0 };
        }
        for col in seg.chunks_exact_mut(rows) {
            col.iter_mut().zip(&f).for_each(|(v, &s)| *v *= s);
        }
    }
    // Rows whose float32 values overflowed: coded from f64 instead.
    let mut wide: Vec<bool> = g.iter().map(|gi| !gi.is_finite()).collect();
    for col in zt.chunks_exact(rows) {
        wide.iter_mut()
            .zip(col)
            .for_each(|(w, v)| *w |= !v.is_finite());
    }
    let g64 = |r: usize| match scale {
        Some(s) if wide[r] => s.value_f64(r0 + r),
        _ => g[r] as f64,
    };
    let mut zr = vec![0f32; m];
    for r in (0..rows).filter(|&r| wide[r]) {
        c.rotate_wide(c.project_wide(&xc[r * d..(r + 1) * d]), g64(r), &mut zr);
        zr.iter()
            .enumerate()
            .for_each(|(j, &v)| zt[j * rows + r] = v);
    }
    let mut it = vec![0u8; m * rows];
    for band in &c.bands {
        let (o, w) = (band.offset, band.width);
        let q = c.q(band.bits);
        for (zcol, icol) in zt[o * rows..(o + w) * rows]
            .chunks_exact(rows)
            .zip(it[o * rows..(o + w) * rows].chunks_exact_mut(rows))
        {
            q.quantize_slice(zcol, icol);
        }
    }
    pack_columns(c, &it, rows, cc);
    // Outliers, in ascending position (row-major).
    let (mut pos, mut val) = (Vec::new(), Vec::new());
    if let Some(th) = c.params.outlier_threshold {
        for (j, col) in zt.chunks_exact(rows).enumerate() {
            for (r, &v) in col.iter().enumerate() {
                if v.abs() > th {
                    pos.push(((r0 + r) * m + j) as u32);
                }
            }
        }
        pos.sort_unstable();
        val = pos
            .iter()
            .map(|&p| {
                let (r, j) = (p as usize / m - r0, p as usize % m);
                f16::from_f32(zt[j * rows + r].clamp(-65504.0, 65504.0)).to_bits()
            })
            .collect();
    }
    let ip = c.params.metric == Metric::InnerProduct;
    if keep || ip {
        let columns = zt.to_vec();
        transpose(&columns, zt, m, rows);
        transpose(&it, ic, m, rows);
    }
    let mut gains = Vec::new();
    let mut any_wide = wide.iter().any(|&w| w);
    if ip {
        let mut qv = vec![0f32; m];
        let mut next = 0;
        for (r, (zr, ir)) in zt.chunks_exact(m).zip(ic.chunks_exact(m)).enumerate() {
            for band in &c.bands {
                let (o, w) = (band.offset, band.width);
                c.q(band.bits)
                    .dequantize_slice(&ir[o..o + w], &mut qv[o..o + w]);
            }
            while next < pos.len() && (pos[next] as usize) < (r0 + r + 1) * m {
                qv[pos[next] as usize - (r0 + r) * m] = f16::from_bits(val[next]).to_f32();
                next += 1;
            }
            let gain = least_squares_gain(g[r], zr, &qv);
            if wide[r] || !gain.is_finite() {
                any_wide = true;
                gains.push(gain_wide(g64(r), zr, &qv));
            } else {
                gains.push(gain as f64);
            }
        }
    }
    (pos, val, gains, any_wide)
}

/// Packs the indices of `rows` rows, column-major in `it` (component `j` of row `r` at
/// `it[j * rows + r]`, below `2^bits[j]`), into their zeroed rows of codes `cc`: the bytes
/// of [`crate::pack::pack_fields`] row by row (LSB-first, component
/// `j` at `bits[j]` bits).
#[inline(always)]
fn pack_columns(c: &CalibratedCodec, it: &[u8], rows: usize, cc: &mut [u8]) {
    let rb = c.row_bytes();
    let mut bit = 0;
    for (col, &b) in it.chunks_exact(rows).zip(&c.bits) {
        let (byte, shift) = (bit / 8, bit % 8);
        for (&v, row) in col.iter().zip(cc.chunks_exact_mut(rb)) {
            let w = (v as u16) << shift;
            row[byte] |= w as u8;
            if shift + b as usize > 8 {
                row[byte + 1] |= (w >> 8) as u8;
            }
        }
        bit += b as usize;
    }
}

/// One chunk's part of pass 2: outlier positions and values, gains, whether a row was wide.
type ChunkOut = (Vec<u32>, Vec<u16>, Vec<f64>, bool);

/// Each row's f64 sum of squares of its values in `u` (column-major, `rows` rows), in column
/// order, and whether they are all finite (multiversioned: the loops run across rows).
#[multiversion::multiversion(targets("x86_64+avx512f+avx512bw+avx512vl", "x86_64+avx2"))]
fn sums_of_squares(u: &[f32], rows: usize) -> (Vec<f64>, Vec<bool>) {
    let mut sum = vec![0f64; rows];
    let mut finite = vec![true; rows];
    for col in u.chunks_exact(rows) {
        for ((s, ok), &v) in sum.iter_mut().zip(finite.iter_mut()).zip(col) {
            *s += (v as f64) * (v as f64);
            *ok &= v.is_finite();
        }
    }
    (sum, finite)
}

/// `dst[c][r] = src[r][c]`: `src` row-major `rows x cols`, `dst` its transpose (row-major).
fn transpose<T: Copy>(src: &[T], dst: &mut [T], rows: usize, cols: usize) {
    for (r, row) in src.chunks_exact(cols).enumerate() {
        for (c, &v) in row.iter().enumerate() {
            dst[c * rows + r] = v;
        }
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
#[path = "codec_tests.rs"]
mod tests;
