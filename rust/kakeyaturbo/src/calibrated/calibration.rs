//! The calibration of one stream of one (layer, kv-head): checked once, with the tables every
//! row uses derived from it (scaled analysis and synthesis, sub-bands, signs, quantisers), its
//! canonical bytes and their fingerprint (`FORMAT.md`).

use crate::error::{param, Result};
use crate::limits::MAX_DIM;
use crate::metric::Metric;
use crate::quant::{gaussian_centroids, Quantizer, MAX_BITS};
use crate::rng::sign_pattern;
use crate::wht::bands;

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
    pub(super) a_scaled: Vec<f32>,
    pub(super) s_scaled: Vec<f32>,
    pub(super) quantizers: Vec<Option<Quantizer>>,
    pub(super) bands: Vec<Band>,
    pub(super) signs: Vec<f32>,
    pub(super) row_bits: usize,
    pub(super) fingerprint: u64,
    pub(super) model_bytes: usize,
}

fn check_matrix(name: &str, v: &[f32], len: usize, what: &str) -> Result<()> {
    if v.len() != len {
        return param(format!(
            "{name} must hold {len} values ({what}), got {}",
            v.len()
        ));
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
        if d == 0 || d > MAX_DIM {
            return param(format!("D must be in 1..={}, got {d}", MAX_DIM));
        }
        if m == 0 || m > MAX_DIM {
            return param(format!(
                "the calibration must code 1..={} components, got {m}",
                MAX_DIM
            ));
        }
        check_matrix("mean", &mean, d, "one per column, D")?;
        for (name, v) in [("analysis", &analysis), ("synthesis", &synthesis)] {
            if v.len() % d == 0 && v.len() / d != m {
                return param(format!(
                    "{name} has {} rows but bits has {m} entries: one bit width per coded \
                     component (row of {name})",
                    v.len() / d
                ));
            }
            check_matrix(name, v, m * d, "m x D")?;
        }
        check_matrix("spread", &spread, m, "one per entry of bits")?;
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
        let a_scaled: Vec<f32> = analysis
            .chunks_exact(d)
            .zip(&spread)
            .flat_map(|(row, &s)| row.iter().map(move |&v| v / s))
            .collect();
        let s_scaled: Vec<f32> = synthesis
            .chunks_exact(d)
            .zip(&spread)
            .flat_map(|(row, &s)| row.iter().map(move |&v| v * s))
            .collect();
        // The scaled matrices every row uses must be float32 numbers: a spread so small (or
        // large) that they overflow is refused here, not met as a container that cannot decode.
        for (name, op, v) in [("analysis", "/", &a_scaled), ("synthesis", "*", &s_scaled)] {
            if let Some(i) = v.iter().position(|x: &f32| !x.is_finite()) {
                let j = i / d;
                return param(format!(
                    "{name} row {j} {op} spread[{j}] = {:e} overflows float32",
                    spread[j]
                ));
            }
        }
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
    /// `S'_j = synthesis_j * spread_j` (`m x D`, row-major, f32): the matrix every decode and
    /// the attention over the codes synthesise with.
    pub fn synthesis_scaled(&self) -> &[f32] {
        &self.s_scaled
    }
    pub fn quantizer(&self, bits: u8) -> Option<&Quantizer> {
        self.quantizers.get(bits as usize).and_then(|q| q.as_ref())
    }
    pub(super) fn q(&self, bits: u8) -> &Quantizer {
        self.quantizers[bits as usize]
            .as_ref()
            .expect("a quantiser exists for every bit width in use")
    }
}

#[cfg(test)]
mod tests {
    use super::super::testutil::codec;
    use super::*;

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
}
