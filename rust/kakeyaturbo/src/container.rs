//! The versioned, self-describing byte format of an encoded layer. `FORMAT.md` at the
//! repository root is the normative description; this file implements it.

use crate::block::{Basis, BlockCodes, Skeleton};
use crate::error::{corrupt, Error, Result};
use crate::f16::ScaledF16;
use crate::layer::EncodedLayer;
use crate::pack::{pack_wide, packed_len, unpack_wide};
use crate::params::{CodecParams, Metric, SkeletonDtype};
use crate::pca::PcaMethod;
use crate::quant::{gaussian_centroids, Quantizer};
use half::f16;

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

#[derive(Clone, Copy)]
enum Part {
    Header,
    Skeleton,
    Codes,
    Outliers,
}

struct Writer {
    buf: Vec<u8>,
    parts: ByteBreakdown,
}

impl Writer {
    fn put(&mut self, part: Part, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
        let c = match part {
            Part::Header => &mut self.parts.header,
            Part::Skeleton => &mut self.parts.skeleton,
            Part::Codes => &mut self.parts.codes,
            Part::Outliers => &mut self.parts.outliers,
        };
        *c += bytes.len();
    }
    fn u32(&mut self, part: Part, v: u32) {
        self.put(part, &v.to_le_bytes());
    }
    fn u16s(&mut self, part: Part, v: &[u16]) {
        for x in v {
            self.put(part, &x.to_le_bytes());
        }
    }
    fn floats(&mut self, dtype: SkeletonDtype, v: &[f32]) {
        for &x in v {
            match dtype {
                SkeletonDtype::F16 => {
                    self.put(Part::Skeleton, &f16::from_f32(x).to_bits().to_le_bytes())
                }
                SkeletonDtype::F32 => self.put(Part::Skeleton, &x.to_le_bytes()),
            }
        }
    }
    fn mean(&mut self, dtype: SkeletonDtype, exp: i8, mean: &[f32]) {
        match dtype {
            SkeletonDtype::F16 => {
                self.put(Part::Skeleton, &[exp as u8]);
                let bits: Vec<u16> = mean
                    .iter()
                    .map(|&v| crate::f16::to_bits_scaled(v, exp))
                    .collect();
                self.u16s(Part::Skeleton, &bits);
            }
            SkeletonDtype::F32 => self.floats(dtype, mean),
        }
    }
}

/// Serialises a layer; returns the bytes and where they went.
pub fn to_bytes(layer: &EncodedLayer) -> (Vec<u8>, ByteBreakdown) {
    let p = &layer.params;
    let mut w = Writer {
        buf: Vec::new(),
        parts: ByteBreakdown::default(),
    };
    let h = Part::Header;
    w.put(h, &MAGIC);
    w.put(h, &VERSION.to_le_bytes());
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
    w.put(h, &[flags, p.metric.code(), p.bit_width, randomized as u8]);
    w.put(h, &(layer.n as u64).to_le_bytes());
    w.u32(h, layer.d as u32);
    w.u32(h, p.block_size as u32);
    w.put(h, &p.rotation_seed.to_le_bytes());
    w.put(h, &p.variance_ratio.to_le_bytes());
    w.u32(h, p.k as u32);
    w.u32(h, p.kmeans_max_iter);
    w.u32(h, p.rank_cap.unwrap_or(0) as u32);
    if let PcaMethod::Randomized {
        target_rank,
        oversample,
        power_iters,
    } = p.pca_method
    {
        w.u32(h, target_rank.unwrap_or(0) as u32);
        w.u32(h, oversample as u32);
        w.u32(h, power_iters as u32);
    }
    if let Some(t) = p.outlier_threshold {
        w.put(h, &t.to_le_bytes());
    }
    if let Some(c) = &p.centroids {
        for v in c {
            w.put(h, &v.to_le_bytes());
        }
    }
    let dt = p.skeleton_dtype;
    if let Some(b) = &layer.shared {
        w.u32(h, b.d_eff as u32);
        w.mean(dt, b.mean_exp, &b.mean);
        w.floats(dt, &b.basis);
    }
    for (s, c) in &layer.blocks {
        let len_at = w.buf.len();
        w.u32(h, 0); // patched below
        let start = w.buf.len();
        if layer.shared.is_none() {
            w.u32(h, s.d_eff as u32);
            w.mean(dt, s.mean_exp, &s.mean);
            w.floats(dt, &s.basis);
        }
        w.u32(h, s.k_eff as u32);
        w.floats(dt, &s.centers);
        w.put(Part::Codes, &[c.t.exp as u8, c.scale.exp as u8]);
        w.u32(h, c.outlier_pos.len() as u32);
        w.put(
            Part::Codes,
            &pack_wide(&c.seg, BlockCodes::seg_bits(s.k_eff)),
        );
        w.u16s(Part::Codes, &c.t.bits);
        w.u16s(Part::Codes, &c.scale.bits);
        w.put(Part::Codes, &c.residual);
        let pb = BlockCodes::outlier_pos_bits(c.n, s.d_eff);
        w.put(Part::Outliers, &pack_wide(&c.outlier_pos, pb));
        w.u16s(Part::Outliers, &c.outlier_val);
        let len = (w.buf.len() - start) as u32;
        w.buf[len_at..len_at + 4].copy_from_slice(&len.to_le_bytes());
    }
    let crc = crc32fast::hash(&w.buf);
    w.u32(h, crc);
    (w.buf, w.parts)
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        match self.pos.checked_add(n) {
            Some(end) if end <= self.buf.len() => {
                let s = &self.buf[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            _ => corrupt(format!(
                "truncated: {what} needs {n} bytes at offset {}, {} remain",
                self.pos,
                self.buf.len() - self.pos
            )),
        }
    }
    fn u8(&mut self, what: &str) -> Result<u8> {
        Ok(self.take(1, what)?[0])
    }
    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4, what)?.try_into().unwrap()))
    }
    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8, what)?.try_into().unwrap()))
    }
    fn f32(&mut self, what: &str) -> Result<f32> {
        Ok(f32::from_le_bytes(self.take(4, what)?.try_into().unwrap()))
    }
    fn u16s(&mut self, count: usize, what: &str) -> Result<Vec<u16>> {
        let b = self.take(count.checked_mul(2).ok_or_else(|| overflow(what))?, what)?;
        Ok(b.chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .collect())
    }
    fn floats(&mut self, dtype: SkeletonDtype, count: usize, what: &str) -> Result<Vec<f32>> {
        let nbytes = count
            .checked_mul(dtype.bytes())
            .ok_or_else(|| overflow(what))?;
        let b = self.take(nbytes, what)?;
        let v: Vec<f32> = match dtype {
            SkeletonDtype::F16 => b
                .chunks_exact(2)
                .map(|c| f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
                .collect(),
            SkeletonDtype::F32 => b
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect(),
        };
        finite(&v, what)?;
        Ok(v)
    }
    fn mean(&mut self, dtype: SkeletonDtype, d: usize) -> Result<(i8, Vec<f32>)> {
        match dtype {
            SkeletonDtype::F16 => {
                let exp = exponent(self.u8("mean exponent")?, "mean")?;
                let s = ScaledF16 {
                    exp,
                    bits: self.u16s(d, "mean")?,
                };
                let v = s.decode();
                finite(&v, "mean")?;
                Ok((exp, v))
            }
            SkeletonDtype::F32 => Ok((0, self.floats(dtype, d, "mean")?)),
        }
    }
    fn scaled(&mut self, exp: i8, n: usize, what: &str) -> Result<ScaledF16> {
        let s = ScaledF16 {
            exp,
            bits: self.u16s(n, what)?,
        };
        finite(&s.decode(), what)?;
        Ok(s)
    }
}

fn overflow(what: &str) -> Error {
    Error::Corrupt(format!("size of {what} overflows"))
}

fn finite(v: &[f32], what: &str) -> Result<()> {
    if v.iter().all(|x| x.is_finite()) {
        Ok(())
    } else {
        corrupt(format!("{what} holds a non-finite value"))
    }
}

fn exponent(b: u8, what: &str) -> Result<i8> {
    let e = b as i8;
    if (crate::f16::MIN_EXP..=crate::f16::MAX_EXP).contains(&(e as i32)) {
        Ok(e)
    } else {
        corrupt(format!("{what} exponent {e} is out of range"))
    }
}

/// Parses and checks a container. Never panics on any input.
pub fn from_bytes(buf: &[u8]) -> Result<EncodedLayer> {
    if buf.len() < 10 {
        return corrupt(format!("{} bytes is too short for a container", buf.len()));
    }
    if buf[..4] != MAGIC {
        return corrupt("bad magic: not a kakeyaturbo container");
    }
    let version = u16::from_le_bytes([buf[4], buf[5]]);
    if version > VERSION {
        return Err(Error::UnsupportedVersion {
            found: version,
            supported: VERSION,
        });
    }
    if version == 0 {
        return corrupt("version 0 does not exist");
    }
    let (body, tail) = buf.split_at(buf.len() - 4);
    let want = u32::from_le_bytes(tail.try_into().unwrap());
    let got = crc32fast::hash(body);
    if want != got {
        return corrupt(format!(
            "checksum mismatch (stored {want:08x}, computed {got:08x}): truncated or corrupted"
        ));
    }
    let mut r = Reader { buf: body, pos: 6 };
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
    let d = r.u32("d")? as usize;
    let block_size = r.u32("block_size")? as usize;
    let rotation_seed = r.u64("rotation_seed")?;
    let variance_ratio = f64::from_le_bytes(r.take(8, "variance_ratio")?.try_into().unwrap());
    let k = r.u32("k")? as usize;
    let kmeans_max_iter = r.u32("kmeans_max_iter")?;
    let rank_cap = r.u32("rank_cap")? as usize;
    let pca_method = if randomized {
        let t = r.u32("rsvd_target_rank")? as usize;
        PcaMethod::Randomized {
            target_rank: (t > 0).then_some(t),
            oversample: r.u32("rsvd_oversample")? as usize,
            power_iters: r.u32("rsvd_power_iters")? as usize,
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
        let mut c = Vec::new();
        for _ in 0..(1usize << bit_width) {
            c.push(r.f32("centroid table")?);
        }
        Some(c)
    } else {
        None
    };
    let skeleton_dtype = if flags & FLAG_FP32_SKELETON != 0 {
        SkeletonDtype::F32
    } else {
        SkeletonDtype::F16
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
        skeleton_dtype,
        rank_cap: (rank_cap > 0).then_some(rank_cap),
        centroids,
        outlier_threshold,
        share_basis: flags & FLAG_SHARE_BASIS != 0,
    };
    let _q: Quantizer = params
        .validate()
        .map_err(|e| Error::Corrupt(format!("stored parameters: {e}")))?;
    if n == 0 || d == 0 {
        return corrupt("empty layer");
    }
    if d > crate::layer::MAX_DIM {
        return corrupt(format!("D = {d} exceeds the supported maximum"));
    }
    let n = usize::try_from(n).map_err(|_| overflow("n"))?;
    let dt = skeleton_dtype;
    let read_basis = |r: &mut Reader<'_>| -> Result<Basis> {
        let d_eff = r.u32("d_eff")? as usize;
        if d_eff == 0 || d_eff > d {
            return corrupt(format!("d_eff {d_eff} is outside 1..={d}"));
        }
        let (mean_exp, mean) = r.mean(dt, d)?;
        let basis = r.floats(dt, d_eff * d, "basis")?;
        Ok(Basis {
            d,
            d_eff,
            mean_exp,
            mean,
            basis,
        })
    };
    let shared = if params.share_basis {
        Some(read_basis(&mut r)?)
    } else {
        None
    };
    let num_blocks = n.div_ceil(block_size);
    let mut blocks = Vec::new();
    for b in 0..num_blocks {
        let rows = block_size.min(n - b * block_size);
        let len = r.u32("block length")? as usize;
        let start = r.pos;
        if len > body.len() - start {
            return corrupt(format!(
                "block {b} claims {len} bytes, {} remain",
                body.len() - start
            ));
        }
        let basis = match &shared {
            Some(s) => s.clone(),
            None => read_basis(&mut r)?,
        };
        let d_eff = basis.d_eff;
        let k_eff = r.u32("k_eff")? as usize;
        if k_eff == 0 || k_eff > rows.max(1) || k_eff > k {
            return corrupt(format!("block {b}: k_eff {k_eff} is out of range"));
        }
        let centers = r.floats(
            dt,
            k_eff
                .checked_mul(d_eff)
                .ok_or_else(|| overflow("centres"))?,
            "centres",
        )?;
        let t_exp = exponent(r.u8("t exponent")?, "t")?;
        let s_exp = exponent(r.u8("scale exponent")?, "scale")?;
        let n_out = r.u32("outlier count")? as usize;
        let cells = rows.checked_mul(d_eff).ok_or_else(|| overflow("codes"))?;
        if n_out > cells {
            return corrupt(format!("block {b}: {n_out} outliers in {cells} cells"));
        }
        let sb = BlockCodes::seg_bits(k_eff);
        let seg = unpack_wide(r.take(packed_len(rows, sb), "segment ids")?, sb, rows);
        if seg.iter().any(|&s| s as usize >= k_eff) {
            return corrupt(format!("block {b}: segment id out of range"));
        }
        let t = r.scaled(t_exp, rows, "t")?;
        let scale = r.scaled(s_exp, rows, "scales")?;
        let residual = r
            .take(packed_len(cells, bit_width as u32), "residual codes")?
            .to_vec();
        let pb = BlockCodes::outlier_pos_bits(rows, d_eff);
        let outlier_pos = unpack_wide(
            r.take(packed_len(n_out, pb), "outlier positions")?,
            pb,
            n_out,
        );
        if outlier_pos.windows(2).any(|w| w[0] >= w[1])
            || outlier_pos.last().is_some_and(|&p| p as usize >= cells)
        {
            return corrupt(format!(
                "block {b}: outlier positions are not ascending and in range"
            ));
        }
        let outlier_val = r.u16s(n_out, "outlier values")?;
        if outlier_val.iter().any(|&v| !f16::from_bits(v).is_finite()) {
            return corrupt(format!("block {b}: non-finite outlier value"));
        }
        if r.pos - start != len {
            return corrupt(format!(
                "block {b}: length field {len} disagrees with its contents ({})",
                r.pos - start
            ));
        }
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
    if r.pos != body.len() {
        return corrupt(format!(
            "{} unexpected bytes after the last block",
            body.len() - r.pos
        ));
    }
    Ok(EncodedLayer {
        params,
        n,
        d,
        shared,
        blocks,
    })
}

/// The default N(0,1) table or the custom one a container carries.
pub fn table_of(p: &CodecParams) -> Result<Vec<f32>> {
    match &p.centroids {
        Some(c) => Ok(c.clone()),
        None => gaussian_centroids(p.bit_width),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layer::encode_layer;
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
