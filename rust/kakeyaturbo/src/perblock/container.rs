//! The per-block container (`KKYT`, version 1): the versioned, self-describing bytes of an
//! encoded layer. `FORMAT.md` at the repository root is the normative description; this file
//! implements it on the shared [`crate::bytes`] writer and reader.

use super::block::{Basis, BlockCodes, Skeleton};
use super::layer::EncodedLayer;
use super::params::{CodecParams, Metric, SkeletonDtype};
use crate::bytes::{self, size, Reader, Writer};
use crate::error::{corrupt, Error, Result};
use crate::f16::ScaledF16;
use crate::limits::MAX_DIM;
use crate::pack::checked_packed_len;
use crate::pca::PcaMethod;
use crate::quant::Quantizer;
use std::sync::Arc;

pub const MAGIC: [u8; 4] = *b"KKYT";
pub const VERSION: u16 = 1;

const FLAG_SHARE_BASIS: u8 = 1;
const FLAG_FP32_SKELETON: u8 = 2;
const FLAG_OUTLIERS: u8 = 4;
const FLAG_CUSTOM_CENTROIDS: u8 = 8;
const KNOWN_FLAGS: u8 = 15;

/// Where the bytes of a container went. `header` includes the magic, the parameters, any
/// custom centroid table, the per-block length and count fields, and the checksum.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ByteBreakdown {
    pub header: usize,
    /// Means, bases and k-means centres (shared and per block).
    pub skeleton: usize,
    /// Segment ids, `t`, scales and packed residual indices.
    pub codes: usize,
    /// Outlier positions and values.
    pub outliers: usize,
}

impl ByteBreakdown {
    pub fn total(&self) -> usize {
        self.header + self.skeleton + self.codes + self.outliers
    }
}

// Writer sections.
const HEADER: usize = 0;
const SKELETON: usize = 1;
const CODES: usize = 2;
const OUTLIERS: usize = 3;

fn put_floats(w: &mut Writer, dtype: SkeletonDtype, v: &[f32]) {
    w.section(SKELETON);
    match dtype {
        SkeletonDtype::F16 => w.f16s(v),
        SkeletonDtype::F32 => w.f32s(v),
    }
}

/// The mean: fp16 skeletons store the shared exponent and the scaled fp16 mantissas.
fn put_mean(w: &mut Writer, dtype: SkeletonDtype, exp: i8, mean: &[f32]) {
    w.section(SKELETON);
    match dtype {
        SkeletonDtype::F16 => {
            w.u8(exp as u8);
            for &v in mean {
                w.u16(crate::f16::to_bits_scaled(v, exp));
            }
        }
        SkeletonDtype::F32 => w.f32s(mean),
    }
}

/// `d_eff`, mean and basis: once for `share_basis`, else in every block.
fn put_basis(
    w: &mut Writer,
    dtype: SkeletonDtype,
    d_eff: usize,
    exp: i8,
    mean: &[f32],
    basis: &[f32],
) {
    w.section(HEADER);
    w.u32(d_eff as u32);
    put_mean(w, dtype, exp, mean);
    put_floats(w, dtype, basis);
}

/// Serialises a layer; returns the bytes and where they went.
pub fn to_bytes(layer: &EncodedLayer) -> (Vec<u8>, ByteBreakdown) {
    let p = &layer.params;
    let mut w = Writer::new(MAGIC, VERSION);
    let mut flags = 0;
    if p.share_basis {
        flags |= FLAG_SHARE_BASIS;
    }
    if p.skeleton_dtype == SkeletonDtype::F32 {
        flags |= FLAG_FP32_SKELETON;
    }
    if p.outlier_threshold.is_some() {
        flags |= FLAG_OUTLIERS;
    }
    if p.centroids.is_some() {
        flags |= FLAG_CUSTOM_CENTROIDS;
    }
    let randomized = matches!(p.pca_method, PcaMethod::Randomized { .. });
    w.bytes(&[flags, p.metric.code(), p.bit_width, randomized as u8]);
    w.u64(layer.n as u64);
    w.u32(layer.d as u32);
    w.u32(p.block_size as u32);
    w.u64(p.rotation_seed);
    w.f64(p.variance_ratio);
    w.u32(p.k as u32);
    w.u32(p.kmeans_max_iter);
    w.u32(p.rank_cap.unwrap_or(0) as u32);
    if let PcaMethod::Randomized {
        target_rank,
        oversample,
        power_iters,
    } = p.pca_method
    {
        w.u32(target_rank.unwrap_or(0) as u32);
        w.u32(oversample as u32);
        w.u32(power_iters as u32);
    }
    if let Some(t) = p.outlier_threshold {
        w.f32(t);
    }
    if let Some(c) = &p.centroids {
        w.f32s(c);
    }
    let dt = p.skeleton_dtype;
    if let Some(b) = &layer.shared {
        put_basis(&mut w, dt, b.d_eff, b.mean_exp, &b.mean, &b.basis);
    }
    for (s, c) in &layer.blocks {
        w.section(HEADER);
        let len_at = w.len();
        w.u32(0); // the block length, patched below
        let start = w.len();
        if layer.shared.is_none() {
            put_basis(&mut w, dt, s.d_eff, s.mean_exp, &s.mean, &s.basis);
        }
        w.section(HEADER);
        w.u32(s.k_eff as u32);
        put_floats(&mut w, dt, &s.centers);
        w.section(CODES);
        w.bytes(&[c.t.exp as u8, c.scale.exp as u8]);
        w.section(HEADER);
        w.u32(c.outlier_pos.len() as u32);
        w.section(CODES);
        w.packed(&c.seg, BlockCodes::seg_bits(s.k_eff));
        w.u16s(&c.t.bits);
        w.u16s(&c.scale.bits);
        w.bytes(&c.residual);
        w.section(OUTLIERS);
        w.packed(&c.outlier_pos, BlockCodes::outlier_pos_bits(c.n, s.d_eff));
        w.u16s(&c.outlier_val);
        let len = (w.len() - start) as u32;
        w.patch_u32(len_at, len);
    }
    let (buf, [header, skeleton, codes, outliers]) = w.finish();
    (
        buf,
        ByteBreakdown {
            header,
            skeleton,
            codes,
            outliers,
        },
    )
}

fn finite(v: &[f32], what: &str) -> Result<()> {
    // Every value looked at (no early exit), so the scan vectorises.
    if v.iter().fold(true, |ok, x| ok & x.is_finite()) {
        Ok(())
    } else {
        corrupt(format!("{what} holds a non-finite value"))
    }
}

fn exponent(b: i8, what: &str) -> Result<i8> {
    if (crate::f16::MIN_EXP..=crate::f16::MAX_EXP).contains(&(b as i32)) {
        Ok(b)
    } else {
        corrupt(format!("{what} exponent {b} is out of range"))
    }
}

/// Skeleton values: fp16 or f32, each finite.
fn get_floats(
    r: &mut Reader<'_>,
    dtype: SkeletonDtype,
    count: usize,
    what: &str,
) -> Result<Vec<f32>> {
    let v = match dtype {
        SkeletonDtype::F16 => r.f16s(count, what)?,
        SkeletonDtype::F32 => r.f32s(count, what)?,
    };
    finite(&v, what)?;
    Ok(v)
}

fn get_mean(r: &mut Reader<'_>, dtype: SkeletonDtype, d: usize) -> Result<(i8, Vec<f32>)> {
    match dtype {
        SkeletonDtype::F16 => {
            let exp = exponent(r.i8("mean exponent")?, "mean")?;
            let v = ScaledF16 {
                exp,
                bits: r.u16s(d, "mean")?,
            }
            .decode();
            finite(&v, "mean")?;
            Ok((exp, v))
        }
        SkeletonDtype::F32 => Ok((0, get_floats(r, dtype, d, "mean")?)),
    }
}

fn get_basis(r: &mut Reader<'_>, dtype: SkeletonDtype, d: usize) -> Result<Basis> {
    let d_eff = r.len32("d_eff")?;
    if d_eff == 0 || d_eff > d {
        return corrupt(format!("d_eff {d_eff} is outside 1..={d}"));
    }
    let (mean_exp, mean) = get_mean(r, dtype, d)?;
    let basis = get_floats(r, dtype, size(d_eff, d, "basis")?, "basis")?;
    Ok(Basis {
        d,
        d_eff,
        mean_exp,
        mean: Arc::new(mean),
        basis: Arc::new(basis),
    })
}

fn get_scaled(r: &mut Reader<'_>, exp: i8, n: usize, what: &str) -> Result<ScaledF16> {
    let s = ScaledF16 {
        exp,
        bits: r.u16s(n, what)?,
    };
    // Finite mantissas; the values themselves may exceed the float32 range (rows near
    // f32::MAX), which the decoder handles in f64.
    s.check(what)?;
    Ok(s)
}

/// The parameters of a container, checked as an encoder would check them.
fn get_params(r: &mut Reader<'_>) -> Result<(CodecParams, u64, usize)> {
    let flags = r.u8("flags")?;
    if flags & !KNOWN_FLAGS != 0 {
        return corrupt(format!("unknown flags {flags:#04x}"));
    }
    let metric = Metric::from_code(r.u8("metric")?)
        .ok_or_else(|| Error::Corrupt("unknown metric".into()))?;
    let bit_width = r.u8("bit_width")?;
    let randomized = match r.u8("pca_method")? {
        0 => false,
        1 => true,
        m => return corrupt(format!("unknown pca method {m}")),
    };
    let n = r.u64("n")?;
    let d = r.len32("d")?;
    let block_size = r.len32("block_size")?;
    let rotation_seed = r.u64("rotation_seed")?;
    let variance_ratio = r.f64("variance_ratio")?;
    let k = r.len32("k")?;
    let kmeans_max_iter = r.u32("kmeans_max_iter")?;
    let rank_cap = r.len32("rank_cap")?;
    let pca_method = if randomized {
        let t = r.len32("rsvd_target_rank")?;
        PcaMethod::Randomized {
            target_rank: (t > 0).then_some(t),
            oversample: r.len32("rsvd_oversample")?,
            power_iters: r.len32("rsvd_power_iters")?,
        }
    } else {
        PcaMethod::Exact
    };
    let outlier_threshold = if flags & FLAG_OUTLIERS != 0 {
        Some(r.f32("outlier_threshold")?)
    } else {
        None
    };
    if !(1..=4).contains(&bit_width) {
        return corrupt(format!("bit_width {bit_width} is out of range"));
    }
    let centroids = if flags & FLAG_CUSTOM_CENTROIDS != 0 {
        Some(r.f32s(1usize << bit_width, "centroid table")?)
    } else {
        None
    };
    let params = CodecParams {
        metric,
        block_size,
        bit_width,
        variance_ratio,
        k,
        rotation_seed,
        kmeans_max_iter,
        pca_method,
        skeleton_dtype: if flags & FLAG_FP32_SKELETON != 0 {
            SkeletonDtype::F32
        } else {
            SkeletonDtype::F16
        },
        rank_cap: (rank_cap > 0).then_some(rank_cap),
        centroids,
        outlier_threshold,
        share_basis: flags & FLAG_SHARE_BASIS != 0,
    };
    let _q: Quantizer = params
        .validate()
        .map_err(|e| Error::Corrupt(format!("stored parameters: {e}")))?;
    Ok((params, n, d))
}

/// Parses and checks a container. Never panics on any input, and allocates nothing before
/// the bytes it describes are known to be present.
pub fn from_bytes(buf: &[u8]) -> Result<EncodedLayer> {
    let (_version, mut r) = bytes::open(buf, MAGIC, VERSION, "container")?;
    let (params, n, d) = get_params(&mut r)?;
    if n == 0 || d == 0 {
        return corrupt("empty layer");
    }
    if d > MAX_DIM {
        return corrupt(format!("D = {d} exceeds the supported maximum"));
    }
    let n = usize::try_from(n).map_err(|_| Error::Corrupt("n overflows".into()))?;
    let (dt, block_size, bit_width) = (params.skeleton_dtype, params.block_size, params.bit_width);
    let shared = if params.share_basis {
        Some(get_basis(&mut r, dt, d)?)
    } else {
        None
    };
    let num_blocks = n.div_ceil(block_size);
    let mut blocks = Vec::new();
    for b in 0..num_blocks {
        let rows = block_size.min(n - b * block_size);
        let len = r.len32("block length")?;
        r.need(len, &format!("block {b}"))?;
        let start = r.pos();
        let basis = match &shared {
            Some(s) => s.clone(),
            None => get_basis(&mut r, dt, d)?,
        };
        let d_eff = basis.d_eff;
        let k_eff = r.len32("k_eff")?;
        if k_eff == 0 || k_eff > rows.max(1) || k_eff > params.k {
            return corrupt(format!("block {b}: k_eff {k_eff} is out of range"));
        }
        let centers = get_floats(&mut r, dt, size(k_eff, d_eff, "centres")?, "centres")?;
        let t_exp = exponent(r.i8("t exponent")?, "t")?;
        let s_exp = exponent(r.i8("scale exponent")?, "scale")?;
        let n_out = r.len32("outlier count")?;
        let cells = size(rows, d_eff, "codes")?;
        if n_out > cells {
            return corrupt(format!("block {b}: {n_out} outliers in {cells} cells"));
        }
        // The codes' sizes follow from the fields read so far: check them against the block
        // length before anything sized by `rows` is allocated.
        let sb = BlockCodes::seg_bits(k_eff);
        let pb = BlockCodes::outlier_pos_bits(rows, d_eff);
        let packed = |count: usize, bits: u32, what: &str| {
            checked_packed_len(count, bits)
                .ok_or_else(|| Error::Corrupt(format!("size of {what} overflows")))
        };
        let code_len = [
            packed(rows, sb, "segment ids")?,
            size(rows, 4, "t and scales")?,
            packed(cells, bit_width as u32, "residual codes")?,
            packed(n_out, pb, "outlier positions")?,
            size(n_out, 2, "outlier values")?,
        ]
        .into_iter()
        .try_fold(r.pos() - start, |a, v| a.checked_add(v))
        .ok_or_else(|| Error::Corrupt(format!("block {b}: size overflows")))?;
        if code_len != len {
            return corrupt(format!(
                "block {b}: length field {len} disagrees with its contents ({code_len})"
            ));
        }
        let seg = r.packed(rows, sb, "segment ids")?;
        if seg.iter().any(|&s| s as usize >= k_eff) {
            return corrupt(format!("block {b}: segment id out of range"));
        }
        let t = get_scaled(&mut r, t_exp, rows, "t")?;
        let scale = get_scaled(&mut r, s_exp, rows, "scales")?;
        let residual = r
            .take(
                packed(cells, bit_width as u32, "residual codes")?,
                "residual codes",
            )?
            .to_vec();
        let outlier_pos = r.packed(n_out, pb, "outlier positions")?;
        if outlier_pos.windows(2).any(|w| w[0] >= w[1])
            || outlier_pos.last().is_some_and(|&p| p as usize >= cells)
        {
            return corrupt(format!(
                "block {b}: outlier positions are not ascending and in range"
            ));
        }
        let outlier_val = r.u16s(n_out, "outlier values")?;
        if outlier_val
            .iter()
            .any(|&v| !half::f16::from_bits(v).is_finite())
        {
            return corrupt(format!("block {b}: non-finite outlier value"));
        }
        debug_assert_eq!(r.pos() - start, len);
        blocks.push((
            Skeleton {
                d,
                d_eff,
                k_eff,
                dtype: dt,
                mean_exp: basis.mean_exp,
                mean: basis.mean,
                basis: basis.basis,
                centers,
            },
            BlockCodes {
                n: rows,
                seg,
                t,
                scale,
                residual,
                outlier_pos,
                outlier_val,
            },
        ));
    }
    r.finish("the last block")?;
    Ok(EncodedLayer {
        params,
        n,
        d,
        shared,
        blocks,
    })
}

#[cfg(test)]
mod tests {
    use super::super::layer::encode_layer;
    use super::*;
    use crate::rng::SplitMix64;
    use proptest::prelude::*;

    fn sample() -> Vec<u8> {
        let (n, d) = (70, 6);
        let mut g = SplitMix64::new(1);
        let x: Vec<f32> = (0..n * d)
            .map(|_| (g.next_u64() >> 40) as f32 / 1e6 - 8.0)
            .collect();
        let p = CodecParams {
            block_size: 32,
            outlier_threshold: Some(1.5),
            centroids: Some(vec![-1.2, -0.4, 0.4, 1.2]),
            bit_width: 2,
            ..Default::default()
        };
        to_bytes(&encode_layer(&x, n, d, None, &p, Some(1)).unwrap().0).0
    }

    #[test]
    fn every_truncation_is_an_error() {
        let b = sample();
        for len in 0..b.len() {
            assert!(from_bytes(&b[..len]).is_err(), "truncated to {len}");
        }
        assert!(from_bytes(&b).is_ok());
    }

    #[test]
    fn every_single_bit_flip_is_an_error() {
        let b = sample();
        for i in 0..b.len() {
            for bit in 0..8 {
                let mut c = b.clone();
                c[i] ^= 1 << bit;
                assert!(from_bytes(&c).is_err(), "byte {i} bit {bit}");
            }
        }
    }

    #[test]
    fn overflows_multiplied_by_zero_are_caught() {
        // Found by `make fuzz` (input 21,519,764 of seed 1): D = 1, a basis of 0 and a `t`
        // beyond the float32 range (exponent 126); the bound that lets ordinary blocks skip the
        // scan of their output ignored `t` itself, and inf * 0 decoded to NaN.
        const HEX: &str = "4b4b595401000000030003000000000000000100000000020000bebafeca00000000666666666666ee3f1000000020000000000000002300000001000000ef78f5000001000000003c7ee60000000083ecb87430f3286a3177a6716a0115c5ddbd";
        let b: Vec<u8> = (0..HEX.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&HEX[i..i + 2], 16).unwrap())
            .collect();
        let layer = from_bytes(&b).unwrap();
        let (s, c) = &layer.blocks[0];
        // Whether inf * 0 comes out NaN depends on the matmul kernel faer picks, so pin the
        // bound itself: this block must not be let through unscanned.
        let q = layer.quantizer().unwrap();
        assert!(super::super::decode::decode_bound(s, c, &q) > crate::limits::SAFE_F32);
        let y = crate::perblock::decode_layer(&layer, Some(1)).unwrap();
        assert!(y.iter().all(|v| v.is_finite()), "{y:?}");
    }

    #[test]
    fn future_versions_are_refused_by_kind() {
        let mut b = sample();
        b[4] = 2;
        assert_eq!(
            from_bytes(&b),
            Err(Error::UnsupportedVersion {
                found: 2,
                supported: 1
            })
        );
    }

    proptest! {
        #[test]
        fn random_bytes_never_panic(raw in proptest::collection::vec(any::<u8>(), 0..300)) {
            let _ = from_bytes(&raw);
            let mut with_magic = MAGIC.to_vec();
            with_magic.extend_from_slice(&[1, 0]);
            with_magic.extend_from_slice(&raw);
            let crc = crc32fast::hash(&with_magic);
            with_magic.extend_from_slice(&crc.to_le_bytes());
            // A valid checksum over garbage: the structural checks must still hold.
            let _ = from_bytes(&with_magic);
        }
    }
}
