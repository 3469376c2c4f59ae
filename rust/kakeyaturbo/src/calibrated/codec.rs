//! Rows to codes and back against a calibration: projection (stage 2), sub-band rotation
//! (stage 4), per-row scale, Lloyd-Max and outliers (stage 5), and the reverse.

use super::calibration::CalibratedCodec;
use crate::error::{input, Error, Result};
use crate::f16::{ScaledF16, MAX_SCALED};
use crate::gemm::matmul;
use crate::limits::{all_finite, check_input, saturate};
use crate::metric::{least_squares_gain, Metric};
use crate::pack::pack_fields;
use crate::threads::{spread_jobs, with_threads_for};
use crate::wht;
use faer::{Accum, MatMut, MatRef, Par};
use half::f16;
use rayon::prelude::*;

#[path = "codec_decode.rs"]
mod decode;

/// Rows coded per task: fixed, so that the bytes never depend on the thread count.
const CHUNK_ROWS: usize = 256;

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

/// One encode of [`encode_many`]: the calibration, its rows (row-major `[n, D]`) and `n`.
pub type EncodeJob<'a> = (&'a CalibratedCodec, &'a [f32], usize);

/// One decode of [`decode_many`]: the calibration and a container of it.
pub type DecodeJob<'a> = (&'a CalibratedCodec, &'a [u8]);

/// Several encodes at once, each against its own calibration, to container bytes in the jobs'
/// order, spread over `threads` threads (`threads::spread_jobs`; an encode of one chunk runs on one thread): a cache sealing a long prompt codes
/// every block of every kv-head of a layer in one call. Each job's bytes are its own encode's,
/// whatever thread ran it; the first job refused (in order) is the error.
pub fn encode_many(jobs: &[EncodeJob<'_>], threads: Option<usize>) -> Result<Vec<Vec<u8>>> {
    spread_jobs(
        jobs,
        |&(_, _, n)| n <= CHUNK_ROWS,
        |&(c, _, n)| n.saturating_mul(c.d),
        threads,
        |&(c, x, n)| Ok(c.to_bytes(&c.encode(x, n)?).0),
    )
}

/// Several decodes at once, each container against its own calibration, spread as
/// [`encode_many`] spreads its jobs: each container's rows (row-major `[n, D]`) in the jobs'
/// order, as its own decode gives them. Every container is parsed (and checked) before any is
/// decoded; the first refused (in order) is the error.
pub fn decode_many(jobs: &[DecodeJob<'_>], threads: Option<usize>) -> Result<Vec<Vec<f32>>> {
    let parsed = jobs
        .iter()
        .map(|&(c, b)| Ok((c, c.from_bytes(b)?)))
        .collect::<Result<Vec<_>>>()?;
    spread_jobs(
        &parsed,
        |(_, k)| k.n <= CHUNK_ROWS,
        |(c, k)| k.n.saturating_mul(c.d),
        threads,
        |(c, k)| c.decode(k),
    )
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
