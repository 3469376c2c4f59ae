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

use crate::block::dot;
use crate::error::{input, param, Error, Result};
use crate::f16::ScaledF16;
use crate::pack::{index_bits, pack_wide, packed_len, unpack_wide};
use crate::params::Metric;
use crate::quant::{gaussian_centroids, Quantizer, MAX_BITS};
use crate::rng::sign_pattern;
use crate::wht::{self, bands};
use faer::linalg::matmul::matmul;
use faer::{Accum, MatMut, MatRef, Par};
use half::f16;
use rayon::prelude::*;

/// Rows coded per task: fixed, so that the bytes never depend on the thread count.
const CHUNK_ROWS: usize = 256;

/// The parts of a calibration that are not matrices.
#[derive(Debug, Clone, PartialEq)]
pub struct CalibratedParams {
    pub rotation_seed: u64,
    /// `Mse`/`Linf`: stored scale = rms of the unit-variance components; `InnerProduct`: the
    /// least-squares gain between `z` and its dequantised value (needs `norm`).
    pub metric: Metric,
    pub outlier_threshold: Option<f32>,
    /// Store a per-row fp16 scale (16 bits per row). Without it `g = 1`.
    pub norm: bool,
}

/// A sub-band: `width` (a power of two) coordinates from `offset`, all at `bits` bits.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Band {
    pub offset: usize,
    pub width: usize,
    pub bits: u8,
    /// `1 / sqrt(width)` in f32: the normalisation of the Hadamard transform.
    pub norm: f32,
}

/// A validated calibration of one stream of one (layer, kv-head), ready to code rows.
#[derive(Debug, Clone)]
pub struct CalibratedCodec {
    pub d: usize,
    pub m: usize,
    pub mean: Vec<f32>,
    pub analysis: Vec<f32>,
    pub synthesis: Vec<f32>,
    pub spread: Vec<f32>,
    pub bits: Vec<u8>,
    /// Custom Lloyd-Max tables by bit width, ascending widths; others use the N(0,1) table.
    pub custom_tables: Vec<(u8, Vec<f32>)>,
    pub params: CalibratedParams,
    a_scaled: Vec<f32>,
    s_scaled: Vec<f32>,
    quantizers: Vec<Option<Quantizer>>,
    bands: Vec<Band>,
    signs: Vec<f32>,
    row_bits: usize,
    fingerprint: u64,
    model_bytes: usize,
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

fn check_matrix(name: &str, v: &[f32], len: usize) -> Result<()> {
    if v.len() != len {
        return param(format!("{name} must hold {len} values, got {}", v.len()));
    }
    if let Some(i) = v.iter().position(|x| !x.is_finite()) {
        return param(format!("{name} holds a non-finite value at index {i}"));
    }
    Ok(())
}

/// FNV-1a, 64 bits: the fingerprint of a calibration's canonical bytes.
fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

impl CalibratedCodec {
    /// Checks a calibration and derives the tables every row uses.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        d: usize,
        mean: Vec<f32>,
        analysis: Vec<f32>,
        synthesis: Vec<f32>,
        spread: Vec<f32>,
        bits: Vec<u8>,
        custom_tables: Vec<(u8, Vec<f32>)>,
        params: CalibratedParams,
    ) -> Result<Self> {
        let m = bits.len();
        if d == 0 || d > crate::layer::MAX_DIM {
            return param(format!(
                "D must be in 1..={}, got {d}",
                crate::layer::MAX_DIM
            ));
        }
        if m == 0 || m > crate::layer::MAX_DIM {
            return param(format!(
                "the calibration must code 1..={} components, got {m}",
                crate::layer::MAX_DIM
            ));
        }
        check_matrix("mean", &mean, d)?;
        check_matrix("analysis", &analysis, m * d)?;
        check_matrix("synthesis", &synthesis, m * d)?;
        check_matrix("spread", &spread, m)?;
        if let Some(j) = spread.iter().position(|&s| s <= 0.0) {
            return param(format!(
                "spread must be > 0; component {j} has {}",
                spread[j]
            ));
        }
        if let Some(j) = bits.iter().position(|&b| !(1..=MAX_BITS).contains(&b)) {
            return param(format!(
                "bits must be in 1..={MAX_BITS}; component {j} has {}",
                bits[j]
            ));
        }
        if let Some(t) = params.outlier_threshold {
            if !(t.is_finite() && t > 0.0) {
                return param(format!("outlier_threshold must be finite and > 0, got {t}"));
            }
        }
        if params.metric == Metric::InnerProduct && !params.norm {
            return param("metric inner_product needs the per-row scale (norm = true)");
        }
        let mut custom_tables = custom_tables;
        custom_tables.sort_by_key(|t| t.0);
        if custom_tables.windows(2).any(|w| w[0].0 == w[1].0) {
            return param("two custom tables for the same bit width");
        }
        let mut quantizers: Vec<Option<Quantizer>> = vec![None; MAX_BITS as usize + 1];
        for (b, table) in &custom_tables {
            quantizers[*b as usize] = Some(Quantizer::new(table.clone(), *b)?);
        }
        for &b in &bits {
            if quantizers[b as usize].is_none() {
                quantizers[b as usize] = Some(Quantizer::new(gaussian_centroids(b)?, b)?);
            }
        }
        // Sub-bands: maximal runs of equal bits, each split by the binary digits of its length.
        let mut band_list = Vec::new();
        let mut start = 0;
        while start < m {
            let b = bits[start];
            let mut end = start;
            while end < m && bits[end] == b {
                end += 1;
            }
            let mut off = start;
            for w in bands(end - start) {
                band_list.push(Band {
                    offset: off,
                    width: w,
                    bits: b,
                    norm: 1.0 / (w as f32).sqrt(),
                });
                off += w;
            }
            start = end;
        }
        let row_bits = bits.iter().map(|&b| b as usize).sum();
        let a_scaled = analysis
            .chunks_exact(d)
            .zip(&spread)
            .flat_map(|(row, &s)| row.iter().map(move |&v| v / s))
            .collect();
        let s_scaled = synthesis
            .chunks_exact(d)
            .zip(&spread)
            .flat_map(|(row, &s)| row.iter().map(move |&v| v * s))
            .collect();
        let mut c = Self {
            d,
            m,
            signs: sign_pattern(params.rotation_seed, m),
            mean,
            analysis,
            synthesis,
            spread,
            bits,
            custom_tables,
            params,
            a_scaled,
            s_scaled,
            quantizers,
            bands: band_list,
            row_bits,
            fingerprint: 0,
            model_bytes: 0,
        };
        let canon = c.canonical_bytes();
        c.fingerprint = fnv1a(&canon);
        c.model_bytes = canon.len();
        Ok(c)
    }

    /// The calibration as bytes (`FORMAT.md`): what a serving engine stores once per model for
    /// this (layer, kv-head, stream), and what the fingerprint hashes.
    pub fn canonical_bytes(&self) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(b"KKYB");
        b.extend_from_slice(&1u16.to_le_bytes());
        b.extend_from_slice(&(self.d as u32).to_le_bytes());
        b.extend_from_slice(&(self.m as u32).to_le_bytes());
        b.extend_from_slice(&self.params.rotation_seed.to_le_bytes());
        b.push(self.params.metric.code());
        b.push(self.params.norm as u8);
        let t = self.params.outlier_threshold.unwrap_or(0.0);
        b.extend_from_slice(&t.to_le_bytes());
        for v in [&self.mean, &self.analysis, &self.synthesis, &self.spread] {
            for x in v.iter() {
                b.extend_from_slice(&x.to_le_bytes());
            }
        }
        b.extend_from_slice(&self.bits);
        b.push(self.custom_tables.len() as u8);
        for (bits, table) in &self.custom_tables {
            b.push(*bits);
            for x in table {
                b.extend_from_slice(&x.to_le_bytes());
            }
        }
        b
    }

    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }
    /// Bytes of the calibration itself (stored once per model, not per token).
    pub fn model_bytes(&self) -> usize {
        self.model_bytes
    }
    /// Bits of one row's indices, and the bytes a row occupies (rows start on byte boundaries).
    pub fn row_bits(&self) -> usize {
        self.row_bits
    }
    pub fn row_bytes(&self) -> usize {
        self.row_bits.div_ceil(8)
    }
    pub fn bands(&self) -> &[Band] {
        &self.bands
    }
    pub fn signs(&self) -> &[f32] {
        &self.signs
    }
    pub fn quantizer(&self, bits: u8) -> Option<&Quantizer> {
        self.quantizers.get(bits as usize).and_then(|q| q.as_ref())
    }
    fn q(&self, bits: u8) -> &Quantizer {
        self.quantizers[bits as usize]
            .as_ref()
            .expect("a quantiser exists for every bit width in use")
    }

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

    fn pack_row(&self, idx: &[u8], out: &mut [u8]) {
        let mut acc: u64 = 0;
        let mut nacc = 0u32;
        let mut o = 0;
        for (&v, &b) in idx.iter().zip(&self.bits) {
            acc |= (v as u64) << nacc;
            nacc += b as u32;
            while nacc >= 8 {
                out[o] = acc as u8;
                o += 1;
                acc >>= 8;
                nacc -= 8;
            }
        }
        if nacc > 0 {
            out[o] = acc as u8;
        }
    }

    fn unpack_row(&self, row: &[u8], idx: &mut [u8]) {
        let mut acc: u64 = 0;
        let mut nacc = 0u32;
        let mut i = 0;
        for (v, &b) in idx.iter_mut().zip(&self.bits) {
            while nacc < b as u32 {
                acc |= (row[i] as u64) << nacc;
                i += 1;
                nacc += 8;
            }
            *v = (acc & ((1u64 << b) - 1)) as u8;
            acc >>= b;
            nacc -= b as u32;
        }
    }

    /// Encodes `n` rows (`x` row-major `[n, D]`), keeping the intermediate values.
    pub fn encode_parts(&self, x: &[f32], n: usize) -> Result<CalibratedParts> {
        crate::layer::check_input(x, n, self.d, None)?;
        if (n as u64) * (self.m as u64) > u32::MAX as u64 {
            return input("N x m must fit in 32 bits (outlier positions)");
        }
        let (d, m, rb) = (self.d, self.m, self.row_bytes());
        // Pass 1: unit-variance components and the rms scale of every row.
        let mut u = vec![0f32; n * m];
        u.par_chunks_mut(CHUNK_ROWS * m)
            .zip(x.par_chunks(CHUNK_ROWS * d))
            .for_each(|(dst, src)| dst.copy_from_slice(&self.project(src)));
        let scale = self.params.norm.then(|| {
            let rms: Vec<f32> = u
                .chunks_exact(m)
                .map(|r| {
                    let s: f64 = r.iter().map(|&v| (v as f64) * (v as f64)).sum();
                    (s / m as f64).sqrt() as f32
                })
                .collect();
            ScaledF16::encode(&rms)
        });
        let g: Vec<f32> = match &scale {
            Some(s) => s.decode(),
            None => vec![1.0; n],
        };
        // Pass 2: rotate, scale, quantise, outliers, pack; rows in fixed chunks.
        let ip = self.params.metric == Metric::InnerProduct;
        let mut z = u;
        let mut indices = vec![0u8; n * m];
        let mut codes = vec![0u8; n * rb];
        type ChunkOut = (Vec<u32>, Vec<u16>, Vec<f32>);
        let per_chunk: Vec<ChunkOut> = z
            .par_chunks_mut(CHUNK_ROWS * m)
            .zip(indices.par_chunks_mut(CHUNK_ROWS * m))
            .zip(codes.par_chunks_mut(CHUNK_ROWS * rb))
            .enumerate()
            .map(|(ci, ((zc, ic), cc))| {
                let mut pos = Vec::new();
                let mut val = Vec::new();
                let mut gains = Vec::new();
                let mut qv = vec![0f32; m];
                for (r, (zr, ir)) in zc
                    .chunks_exact_mut(m)
                    .zip(ic.chunks_exact_mut(m))
                    .enumerate()
                {
                    let row = ci * CHUNK_ROWS + r;
                    let gi = g[row];
                    for band in &self.bands {
                        let (o, w) = (band.offset, band.width);
                        wht::rotate(&mut zr[o..o + w], &self.signs[o..o + w]);
                        let f = if gi > 0.0 { band.norm / gi } else { 0.0 };
                        zr[o..o + w].iter_mut().for_each(|v| *v *= f);
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
                        let qq = dot(&qv, &qv);
                        gains.push(if qq > 0.0 {
                            gi * (dot(zr, &qv) / qq)
                        } else {
                            gi
                        });
                    }
                    self.pack_row(ir, &mut cc[r * rb..(r + 1) * rb]);
                }
                (pos, val, gains)
            })
            .collect();
        let mut outlier_pos = Vec::new();
        let mut outlier_val = Vec::new();
        let mut gains = Vec::new();
        for (p, v, g) in per_chunk {
            outlier_pos.extend(p);
            outlier_val.extend(v);
            gains.extend(g);
        }
        let scale = if ip {
            Some(ScaledF16::encode(&gains))
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

    /// Checks codes against this calibration (lengths, positions); never panics.
    pub fn check_codes(&self, c: &CalibratedCodes) -> Result<()> {
        let bad = |m: String| Err(Error::Corrupt(m));
        if c.codes.len() != c.n * self.row_bytes() {
            return bad(format!(
                "{} code bytes for {} rows of {} bytes",
                c.codes.len(),
                c.n,
                self.row_bytes()
            ));
        }
        match (&c.scale, self.params.norm) {
            (Some(s), true) if s.bits.len() == c.n => {}
            (None, false) => {}
            _ => return bad("per-row scales disagree with the calibration".into()),
        }
        if c.outlier_pos.len() != c.outlier_val.len() {
            return bad("outlier positions and values differ in number".into());
        }
        if self.params.outlier_threshold.is_none() && !c.outlier_pos.is_empty() {
            return bad("outliers in a container of a calibration without them".into());
        }
        let cells = (c.n * self.m) as u64;
        if c.outlier_pos.windows(2).any(|w| w[0] >= w[1])
            || c.outlier_pos.last().is_some_and(|&p| p as u64 >= cells)
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

    /// Decodes codes into `[n, D]` row-major.
    pub fn decode(&self, c: &CalibratedCodes) -> Result<Vec<f32>> {
        self.check_codes(c)?;
        let (d, m, rb, n) = (self.d, self.m, self.row_bytes(), c.n);
        let g: Vec<f32> = match &c.scale {
            Some(s) => s.decode(),
            None => vec![1.0; n],
        };
        let mut out = vec![0f32; n * d];
        out.par_chunks_mut(CHUNK_ROWS * d)
            .enumerate()
            .for_each(|(ci, oc)| {
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
                for row in oc.chunks_exact_mut(d) {
                    row.copy_from_slice(&self.mean);
                }
                matmul(
                    MatMut::from_row_major_slice_mut(oc, rows, d),
                    Accum::Add,
                    MatRef::from_row_major_slice(&u, rows, m),
                    MatRef::from_row_major_slice(&self.s_scaled, m, d),
                    1.0,
                    Par::Seq,
                );
            });
        Ok(out)
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

// ---- container ------------------------------------------------------------------------------

pub const MAGIC: [u8; 4] = *b"KKYC";
pub const VERSION: u16 = 1;
const FLAG_NORM: u8 = 1;
const FLAG_OUTLIERS: u8 = 2;

/// Where the bytes of a calibrated container went.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CalibratedBytes {
    /// Magic, version, flags, sizes, fingerprint, outlier count, checksum.
    pub header: usize,
    /// Per-row scales (exponent and fp16 mantissas).
    pub scales: usize,
    /// Packed indices.
    pub codes: usize,
    pub outliers: usize,
}

impl CalibratedBytes {
    pub fn total(&self) -> usize {
        self.header + self.scales + self.codes + self.outliers
    }
}

/// The header of a calibrated container: what can be read without the calibration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CalibratedHeader {
    pub n: usize,
    pub d: usize,
    pub m: usize,
    pub row_bytes: usize,
    pub fingerprint: u64,
    pub norm: bool,
    pub metric: Metric,
    pub num_outliers: usize,
}

impl CalibratedCodec {
    /// Serialises codes (made by this calibration) with their header and checksum.
    pub fn to_bytes(&self, c: &CalibratedCodes) -> (Vec<u8>, CalibratedBytes) {
        let mut parts = CalibratedBytes::default();
        let mut b = Vec::new();
        b.extend_from_slice(&MAGIC);
        b.extend_from_slice(&VERSION.to_le_bytes());
        let mut flags = 0;
        if self.params.norm {
            flags |= FLAG_NORM;
        }
        if self.params.outlier_threshold.is_some() {
            flags |= FLAG_OUTLIERS;
        }
        b.push(flags);
        b.push(self.params.metric.code());
        b.extend_from_slice(&(c.n as u64).to_le_bytes());
        b.extend_from_slice(&(self.d as u32).to_le_bytes());
        b.extend_from_slice(&(self.m as u32).to_le_bytes());
        b.extend_from_slice(&(self.row_bytes() as u32).to_le_bytes());
        b.extend_from_slice(&self.fingerprint.to_le_bytes());
        b.extend_from_slice(&(c.outlier_pos.len() as u32).to_le_bytes());
        parts.header = b.len() + 4;
        if let Some(s) = &c.scale {
            let at = b.len();
            b.push(s.exp as u8);
            for h in &s.bits {
                b.extend_from_slice(&h.to_le_bytes());
            }
            parts.scales = b.len() - at;
        }
        b.extend_from_slice(&c.codes);
        parts.codes = c.codes.len();
        let at = b.len();
        b.extend_from_slice(&pack_wide(&c.outlier_pos, index_bits(c.n * self.m)));
        for h in &c.outlier_val {
            b.extend_from_slice(&h.to_le_bytes());
        }
        parts.outliers = b.len() - at;
        let crc = crc32fast::hash(&b);
        b.extend_from_slice(&crc.to_le_bytes());
        (b, parts)
    }

    /// Parses a container written with this calibration. Never panics on any input.
    pub fn from_bytes(&self, buf: &[u8]) -> Result<CalibratedCodes> {
        let h = read_header(buf)?;
        if h.fingerprint != self.fingerprint
            || h.d != self.d
            || h.m != self.m
            || h.row_bytes != self.row_bytes()
            || h.norm != self.params.norm
            || h.metric != self.params.metric
        {
            return param(format!(
                "the container was written with a different calibration (fingerprint {:016x}, \
                 this one is {:016x})",
                h.fingerprint, self.fingerprint
            ));
        }
        let body = &buf[..buf.len() - 4];
        let mut pos = HEADER_LEN;
        let mut take = |len: usize, what: &str| -> Result<&[u8]> {
            match pos.checked_add(len) {
                Some(end) if end <= body.len() => {
                    let s = &body[pos..end];
                    pos = end;
                    Ok(s)
                }
                _ => Err(Error::Corrupt(format!("truncated: {what}"))),
            }
        };
        let u16s = |b: &[u8]| -> Vec<u16> {
            b.chunks_exact(2)
                .map(|c| u16::from_le_bytes([c[0], c[1]]))
                .collect()
        };
        let n = h.n;
        let scale = if h.norm {
            let e = take(1, "scale exponent")?[0] as i8;
            if !(crate::f16::MIN_EXP..=crate::f16::MAX_EXP).contains(&(e as i32)) {
                return Err(Error::Corrupt(format!("scale exponent {e} out of range")));
            }
            let bytes = n
                .checked_mul(2)
                .ok_or_else(|| Error::Corrupt("size overflow".into()))?;
            let s = ScaledF16 {
                exp: e,
                bits: u16s(take(bytes, "scales")?),
            };
            if s.decode().iter().any(|v| !v.is_finite()) {
                return Err(Error::Corrupt("a scale is not finite".into()));
            }
            Some(s)
        } else {
            None
        };
        let code_len = n
            .checked_mul(h.row_bytes)
            .ok_or_else(|| Error::Corrupt("size overflow".into()))?;
        let codes = take(code_len, "codes")?.to_vec();
        let cells = n
            .checked_mul(self.m)
            .ok_or_else(|| Error::Corrupt("size overflow".into()))?;
        if h.num_outliers > cells {
            return Err(Error::Corrupt(format!(
                "{} outliers in {cells} cells",
                h.num_outliers
            )));
        }
        let pb = index_bits(cells);
        let outlier_pos = unpack_wide(
            take(packed_len(h.num_outliers, pb), "outlier positions")?,
            pb,
            h.num_outliers,
        );
        let outlier_val = u16s(take(2 * h.num_outliers, "outlier values")?);
        if pos != body.len() {
            return Err(Error::Corrupt(format!(
                "{} bytes left over after the last field",
                body.len() - pos
            )));
        }
        let c = CalibratedCodes {
            n,
            scale,
            codes,
            outlier_pos,
            outlier_val,
        };
        self.check_codes(&c)?;
        Ok(c)
    }
}

const HEADER_LEN: usize = 4 + 2 + 1 + 1 + 8 + 4 + 4 + 4 + 8 + 4;

/// Reads and checks the header and checksum of a calibrated container.
pub fn read_header(buf: &[u8]) -> Result<CalibratedHeader> {
    let corrupt = |m: String| Err(Error::Corrupt(m));
    if buf.len() < HEADER_LEN + 4 {
        return corrupt(format!(
            "{} bytes is too short for a calibrated container",
            buf.len()
        ));
    }
    if buf[..4] != MAGIC {
        return corrupt("bad magic: not a kakeyaturbo calibrated container".into());
    }
    let version = u16::from_le_bytes([buf[4], buf[5]]);
    if version > VERSION {
        return Err(Error::UnsupportedVersion {
            found: version,
            supported: VERSION,
        });
    }
    if version == 0 {
        return corrupt("version 0 does not exist".into());
    }
    let (body, tail) = buf.split_at(buf.len() - 4);
    let want = u32::from_le_bytes(tail.try_into().unwrap());
    let got = crc32fast::hash(body);
    if want != got {
        return corrupt(format!(
            "checksum mismatch (stored {want:08x}, computed {got:08x}): truncated or corrupted"
        ));
    }
    let flags = buf[6];
    if flags & !(FLAG_NORM | FLAG_OUTLIERS) != 0 {
        return corrupt(format!("unknown flags {flags:#04x}"));
    }
    let metric =
        Metric::from_code(buf[7]).ok_or_else(|| Error::Corrupt("unknown metric".into()))?;
    let u32_at = |o: usize| u32::from_le_bytes(buf[o..o + 4].try_into().unwrap()) as usize;
    let n = u64::from_le_bytes(buf[8..16].try_into().unwrap());
    let n = usize::try_from(n).map_err(|_| Error::Corrupt("n overflows".into()))?;
    let (d, m, row_bytes) = (u32_at(16), u32_at(20), u32_at(24));
    let fingerprint = u64::from_le_bytes(buf[28..36].try_into().unwrap());
    let num_outliers = u32_at(36);
    if n == 0 || d == 0 || m == 0 {
        return corrupt("empty container".into());
    }
    Ok(CalibratedHeader {
        n,
        d,
        m,
        row_bytes,
        fingerprint,
        norm: flags & FLAG_NORM != 0,
        metric,
        num_outliers,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::SplitMix64;
    use proptest::prelude::*;

    fn noise(g: &mut SplitMix64) -> f32 {
        (0..4)
            .map(|_| (g.next_u64() >> 40) as f32 / 16777216.0 - 0.5)
            .sum::<f32>()
            * 1.7
    }

    /// An orthonormal-ish basis from Gram-Schmidt on seeded noise.
    fn basis(d: usize, seed: u64) -> Vec<f32> {
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

    fn codec(
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
    fn rows(c: &CalibratedCodec, n: usize, seed: u64) -> Vec<f32> {
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

    fn rel(x: &[f32], y: &[f32], mean: &[f32]) -> f64 {
        let d = mean.len();
        let e: f64 = x.iter().zip(y).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
        let s: f64 = x
            .iter()
            .enumerate()
            .map(|(i, a)| ((a - mean[i % d]) as f64).powi(2))
            .sum();
        e / s
    }

    #[test]
    fn bands_follow_runs_of_equal_bits() {
        let c = codec(16, vec![4, 4, 4, 3, 3, 3, 3, 3, 1], true, Metric::Mse, None);
        let b: Vec<(usize, usize, u8)> = c
            .bands()
            .iter()
            .map(|b| (b.offset, b.width, b.bits))
            .collect();
        assert_eq!(
            b,
            vec![(0, 2, 4), (2, 1, 4), (3, 4, 3), (7, 1, 3), (8, 1, 1)]
        );
        assert_eq!(c.row_bits(), 12 + 15 + 1);
        assert_eq!(c.row_bytes(), 4);
    }

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
    fn bytes_round_trip_and_are_counted() {
        let c = codec(
            24,
            vec![5, 5, 4, 4, 4, 3, 2, 2, 1, 1],
            true,
            Metric::InnerProduct,
            Some(2.5),
        );
        let x = rows(&c, 300, 5);
        let codes = c.encode(&x, 300).unwrap();
        let (bytes, parts) = c.to_bytes(&codes);
        assert_eq!(bytes.len(), parts.total());
        assert_eq!(parts.codes, 300 * c.row_bytes());
        assert_eq!(parts.scales, 1 + 2 * 300);
        let back = c.from_bytes(&bytes).unwrap();
        assert_eq!(back, codes);
        assert_eq!(c.decode(&back).unwrap(), c.decode(&codes).unwrap());
        // Any single flipped byte is caught.
        for i in (0..bytes.len()).step_by(7) {
            let mut b = bytes.clone();
            b[i] ^= 0x10;
            assert!(c.from_bytes(&b).is_err(), "byte {i}");
        }
        // A different calibration refuses the container.
        let other = codec(
            24,
            vec![5, 5, 4, 4, 4, 3, 2, 2, 1, 2],
            true,
            Metric::InnerProduct,
            Some(2.5),
        );
        assert!(matches!(
            other.from_bytes(&bytes),
            Err(Error::InvalidParameter(_))
        ));
    }

    #[test]
    fn deterministic_across_thread_counts() {
        let c = codec(16, vec![3; 12], true, Metric::Mse, Some(3.0));
        let x = rows(&c, 1000, 9);
        let a = crate::layer::with_threads(Some(1), || c.encode(&x, 1000))
            .unwrap()
            .unwrap();
        let b = crate::layer::with_threads(Some(2), || c.encode(&x, 1000))
            .unwrap()
            .unwrap();
        assert_eq!(a, b);
    }

    #[test]
    fn bad_calibrations_are_rejected() {
        let p = CalibratedParams {
            rotation_seed: 1,
            metric: Metric::Mse,
            outlier_threshold: None,
            norm: true,
        };
        let ok = |bits: Vec<u8>, spread: Vec<f32>, p: CalibratedParams| {
            let m = bits.len();
            CalibratedCodec::new(
                4,
                vec![0.0; 4],
                vec![0.5; m * 4],
                vec![0.5; m * 4],
                spread,
                bits,
                vec![],
                p,
            )
        };
        assert!(ok(vec![2, 2], vec![1.0, 1.0], p.clone()).is_ok());
        assert!(ok(vec![], vec![], p.clone()).is_err());
        assert!(ok(vec![0, 2], vec![1.0, 1.0], p.clone()).is_err());
        assert!(ok(vec![9], vec![1.0], p.clone()).is_err());
        assert!(ok(vec![2], vec![0.0], p.clone()).is_err());
        assert!(ok(vec![2], vec![f32::NAN], p.clone()).is_err());
        let ip_without_norm = CalibratedParams {
            metric: Metric::InnerProduct,
            norm: false,
            ..p
        };
        assert!(ok(vec![2], vec![1.0], ip_without_norm).is_err());
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
