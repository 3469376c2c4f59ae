//! The calibrated container (`KKYC`, version 1): the codes of `n` rows with the fingerprint of
//! the calibration that made them, on the shared [`crate::bytes`] writer and reader.

use super::calibration::CalibratedCodec;
use super::codec::CalibratedCodes;
use crate::bytes::{self, size, Reader, Writer};
use crate::error::{corrupt, param, Error, Result};
use crate::f16::ScaledF16;
use crate::metric::Metric;
use crate::pack::index_bits;

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

// Writer sections (0, the default, is the header).
const SCALES: usize = 1;
const CODES: usize = 2;
const OUTLIERS: usize = 3;

impl CalibratedCodec {
    /// Serialises codes (made by this calibration) with their header and checksum.
    pub fn to_bytes(&self, c: &CalibratedCodes) -> (Vec<u8>, CalibratedBytes) {
        let mut w = Writer::new(MAGIC, VERSION);
        let mut flags = 0;
        if self.params.norm {
            flags |= FLAG_NORM;
        }
        if self.params.outlier_threshold.is_some() {
            flags |= FLAG_OUTLIERS;
        }
        w.u8(flags);
        w.u8(self.params.metric.code());
        w.u64(c.n as u64);
        w.u32(self.d as u32);
        w.u32(self.m as u32);
        w.u32(self.row_bytes() as u32);
        w.u64(self.fingerprint);
        w.u32(c.outlier_pos.len() as u32);
        if let Some(s) = &c.scale {
            w.section(SCALES);
            w.u8(s.exp as u8);
            w.u16s(&s.bits);
        }
        w.section(CODES);
        w.bytes(&c.codes);
        w.section(OUTLIERS);
        w.packed(&c.outlier_pos, index_bits(c.n * self.m));
        w.u16s(&c.outlier_val);
        let (buf, [header, scales, codes, outliers]) = w.finish();
        (
            buf,
            CalibratedBytes {
                header,
                scales,
                codes,
                outliers,
            },
        )
    }

    /// Parses a container written with this calibration. Never panics on any input, and
    /// allocates nothing before the bytes it describes are known to be present.
    pub fn from_bytes(&self, buf: &[u8]) -> Result<CalibratedCodes> {
        let (_version, mut r) = bytes::open(buf, MAGIC, VERSION, "calibrated container")?;
        let h = header_fields(&mut r)?;
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
        let n = h.n;
        let scale = if h.norm {
            let exp = r.i8("scale exponent")?;
            if !(crate::f16::MIN_EXP..=crate::f16::MAX_EXP).contains(&(exp as i32)) {
                return corrupt(format!("scale exponent {exp} out of range"));
            }
            let s = ScaledF16 {
                exp,
                bits: r.u16s(n, "scales")?,
            };
            // Finite mantissas; the values may exceed the float32 range (see the decoder).
            s.check("scale")?;
            Some(s)
        } else {
            None
        };
        let codes = r.take(size(n, h.row_bytes, "codes")?, "codes")?.to_vec();
        let cells = size(n, self.m, "outlier positions")?;
        if h.num_outliers > cells {
            return corrupt(format!("{} outliers in {cells} cells", h.num_outliers));
        }
        let outlier_pos = r.packed(h.num_outliers, index_bits(cells), "outlier positions")?;
        let outlier_val = r.u16s(h.num_outliers, "outlier values")?;
        r.finish("the last field")?;
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

/// Reads and checks the header and checksum of a calibrated container.
pub fn read_header(buf: &[u8]) -> Result<CalibratedHeader> {
    let (_version, mut r) = bytes::open(buf, MAGIC, VERSION, "calibrated container")?;
    header_fields(&mut r)
}

fn header_fields(r: &mut Reader<'_>) -> Result<CalibratedHeader> {
    let flags = r.u8("flags")?;
    if flags & !(FLAG_NORM | FLAG_OUTLIERS) != 0 {
        return corrupt(format!("unknown flags {flags:#04x}"));
    }
    let metric = Metric::from_code(r.u8("metric")?)
        .ok_or_else(|| Error::Corrupt("unknown metric".into()))?;
    let n = r.len64("n")?;
    let d = r.len32("d")?;
    let m = r.len32("m")?;
    let row_bytes = r.len32("row_bytes")?;
    let fingerprint = r.u64("fingerprint")?;
    let num_outliers = r.len32("outlier count")?;
    if n == 0 || d == 0 || m == 0 {
        return corrupt("empty container");
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
    use super::super::testutil::{codec, rows};
    use super::*;

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
}
