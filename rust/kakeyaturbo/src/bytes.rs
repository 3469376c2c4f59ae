//! The one byte writer and reader of both containers (`KKYT`, `KKYC`; `FORMAT.md`).
//!
//! Integers are little-endian. A container is `magic (4) | version (u16) | body | crc32 (u32)`,
//! the checksum covering everything before it. The [`Reader`] never trusts a size field: it
//! checks that the bytes a field needs are present, with checked arithmetic, before it
//! allocates anything sized by that field, so the memory a parse can take is bounded by the
//! length of the input.

use crate::error::{corrupt, Error, Result};
use crate::pack::{checked_packed_len, pack_wide, unpack_wide};
use half::f16;

/// Bytes of the trailing checksum.
pub const CRC_LEN: usize = 4;
/// Bytes of magic and version.
pub const PREFIX_LEN: usize = 6;

/// Appends fields to a container and counts the bytes of each section (header, skeleton,
/// codes, ... as the container defines them); the checksum counts towards section 0.
#[derive(Debug, Default)]
pub struct Writer {
    buf: Vec<u8>,
    sections: [usize; 4],
    section: usize,
}

impl Writer {
    /// A container that starts with `magic` and `version` (both counted in section 0).
    pub fn new(magic: [u8; 4], version: u16) -> Self {
        let mut w = Self::default();
        w.bytes(&magic);
        w.u16(version);
        w
    }
    /// Counts the bytes written from now on towards section `s` (0..4).
    pub fn section(&mut self, s: usize) {
        self.section = s;
    }
    pub fn len(&self) -> usize {
        self.buf.len()
    }
    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }
    pub fn bytes(&mut self, b: &[u8]) {
        self.buf.extend_from_slice(b);
        self.sections[self.section] += b.len();
    }
    pub fn u8(&mut self, v: u8) {
        self.bytes(&[v]);
    }
    pub fn u16(&mut self, v: u16) {
        self.bytes(&v.to_le_bytes());
    }
    pub fn u32(&mut self, v: u32) {
        self.bytes(&v.to_le_bytes());
    }
    pub fn u64(&mut self, v: u64) {
        self.bytes(&v.to_le_bytes());
    }
    pub fn f32(&mut self, v: f32) {
        self.bytes(&v.to_le_bytes());
    }
    pub fn f64(&mut self, v: f64) {
        self.bytes(&v.to_le_bytes());
    }
    pub fn u16s(&mut self, v: &[u16]) {
        for &x in v {
            self.u16(x);
        }
    }
    pub fn f32s(&mut self, v: &[f32]) {
        for &x in v {
            self.f32(x);
        }
    }
    /// Each value rounded to IEEE fp16 (round to nearest even).
    pub fn f16s(&mut self, v: &[f32]) {
        for &x in v {
            self.u16(f16::from_f32(x).to_bits());
        }
    }
    /// `values` of `bits` bits each (0..=32), packed LSB-first and padded to a whole byte.
    pub fn packed(&mut self, values: &[u32], bits: u32) {
        self.bytes(&pack_wide(values, bits));
    }
    /// Overwrites a u32 written earlier at byte offset `at` (a length known only afterwards).
    pub fn patch_u32(&mut self, at: usize, v: u32) {
        self.buf[at..at + 4].copy_from_slice(&v.to_le_bytes());
    }
    /// Appends the CRC-32 of everything written; returns the bytes and the section counts.
    pub fn finish(mut self) -> (Vec<u8>, [usize; 4]) {
        let crc = crc32fast::hash(&self.buf);
        self.section(0);
        self.u32(crc);
        (self.buf, self.sections)
    }
}

/// Reads fields from the body of a container; every read is bounds checked.
#[derive(Debug, Clone)]
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

/// Checks the envelope of a container: length, magic, version (0 does not exist; above
/// `supported` is [`Error::UnsupportedVersion`]) and checksum. Returns the version and a
/// reader over the body, positioned after the version.
pub fn open<'a>(
    buf: &'a [u8],
    magic: [u8; 4],
    supported: u16,
    what: &str,
) -> Result<(u16, Reader<'a>)> {
    if buf.len() < PREFIX_LEN + CRC_LEN {
        return corrupt(format!("{} bytes is too short for a {what}", buf.len()));
    }
    if buf[..4] != magic {
        return corrupt(format!("bad magic: not a kakeyaturbo {what}"));
    }
    let version = u16::from_le_bytes([buf[4], buf[5]]);
    if version > supported {
        return Err(Error::UnsupportedVersion {
            found: version,
            supported,
        });
    }
    if version == 0 {
        return corrupt("version 0 does not exist");
    }
    let (body, tail) = buf.split_at(buf.len() - CRC_LEN);
    let want = u32::from_le_bytes([tail[0], tail[1], tail[2], tail[3]]);
    let got = crc32fast::hash(body);
    if want != got {
        return corrupt(format!(
            "checksum mismatch (stored {want:08x}, computed {got:08x}): truncated or corrupted"
        ));
    }
    Ok((
        version,
        Reader {
            buf: body,
            pos: PREFIX_LEN,
        },
    ))
}

/// `a * b` for sizes read from a container; an overflow is corruption.
pub fn size(a: usize, b: usize, what: &str) -> Result<usize> {
    a.checked_mul(b)
        .ok_or_else(|| Error::Corrupt(format!("size of {what} overflows")))
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Self { buf, pos: 0 }
    }
    pub fn pos(&self) -> usize {
        self.pos
    }
    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }
    /// Fails unless at least `n` more bytes are present.
    pub fn need(&self, n: usize, what: &str) -> Result<()> {
        if n <= self.remaining() {
            Ok(())
        } else {
            corrupt(format!(
                "truncated: {what} needs {n} bytes at offset {}, {} remain",
                self.pos,
                self.remaining()
            ))
        }
    }
    pub fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        self.need(n, what)?;
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N, what)?);
        Ok(a)
    }
    pub fn u8(&mut self, what: &str) -> Result<u8> {
        Ok(self.take(1, what)?[0])
    }
    pub fn i8(&mut self, what: &str) -> Result<i8> {
        Ok(self.u8(what)? as i8)
    }
    pub fn u16(&mut self, what: &str) -> Result<u16> {
        Ok(u16::from_le_bytes(self.array(what)?))
    }
    pub fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }
    pub fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }
    pub fn f32(&mut self, what: &str) -> Result<f32> {
        Ok(f32::from_le_bytes(self.array(what)?))
    }
    pub fn f64(&mut self, what: &str) -> Result<f64> {
        Ok(f64::from_le_bytes(self.array(what)?))
    }
    /// A u32 size field as `usize`.
    pub fn len32(&mut self, what: &str) -> Result<usize> {
        usize::try_from(self.u32(what)?).map_err(|_| Error::Corrupt(format!("{what} overflows")))
    }
    /// A u64 size field as `usize`.
    pub fn len64(&mut self, what: &str) -> Result<usize> {
        usize::try_from(self.u64(what)?).map_err(|_| Error::Corrupt(format!("{what} overflows")))
    }
    pub fn u16s(&mut self, count: usize, what: &str) -> Result<Vec<u16>> {
        let b = self.take(size(count, 2, what)?, what)?;
        let mut v = vec![0u16; count];
        for (x, c) in v.iter_mut().zip(b.chunks_exact(2)) {
            *x = u16::from_le_bytes([c[0], c[1]]);
        }
        Ok(v)
    }
    pub fn f32s(&mut self, count: usize, what: &str) -> Result<Vec<f32>> {
        let b = self.take(size(count, 4, what)?, what)?;
        Ok(b.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }
    /// `count` IEEE fp16 values, widened to f32.
    pub fn f16s(&mut self, count: usize, what: &str) -> Result<Vec<f32>> {
        Ok(crate::f16::widen(&self.u16s(count, what)?))
    }
    /// `count` values of `bits` bits (0..=32), packed LSB-first, padded to a whole byte.
    /// A 0-bit field occupies no bytes; every such field of the formats is followed by wider
    /// per-value fields, so its count may not exceed the bytes left.
    pub fn packed(&mut self, count: usize, bits: u32, what: &str) -> Result<Vec<u32>> {
        if bits > 32 {
            return corrupt(format!("{what}: {bits}-bit values do not exist"));
        }
        let len = checked_packed_len(count, bits)
            .ok_or_else(|| Error::Corrupt(format!("size of {what} overflows")))?;
        let b = self.take(len, what)?;
        if bits == 0 {
            self.need(count, what)?;
        }
        Ok(unpack_wide(b, bits, count))
    }
    /// Fails unless every byte has been read.
    pub fn finish(&self, what: &str) -> Result<()> {
        match self.remaining() {
            0 => Ok(()),
            n => corrupt(format!("{n} unexpected bytes after {what}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn container(body: &[u8]) -> Vec<u8> {
        let mut w = Writer::new(*b"TEST", 1);
        w.section(1);
        w.bytes(body);
        w.finish().0
    }

    #[test]
    fn writer_counts_sections_and_checksums() {
        let mut w = Writer::new(*b"TEST", 3);
        w.u32(7);
        w.section(2);
        w.u16s(&[1, 2, 3]);
        w.section(1);
        w.f32(1.5);
        let at = w.len();
        w.u32(0);
        w.patch_u32(at, 9);
        let (b, s) = w.finish();
        assert_eq!(s, [6 + 4 + 4, 4 + 4, 6, 0]);
        assert_eq!(b.len(), s.iter().sum::<usize>());
        let (v, mut r) = open(&b, *b"TEST", 3, "test").unwrap();
        assert_eq!(v, 3);
        assert_eq!(r.u32("a").unwrap(), 7);
        assert_eq!(r.u16s(3, "b").unwrap(), vec![1, 2, 3]);
        assert_eq!(r.f32("c").unwrap(), 1.5);
        assert_eq!(r.u32("d").unwrap(), 9);
        r.finish("the test").unwrap();
    }

    #[test]
    fn the_envelope_is_checked() {
        let b = container(&[1, 2, 3]);
        assert!(open(&b, *b"TEST", 1, "t").is_ok());
        assert!(open(&b, *b"TEXT", 1, "t").is_err());
        assert!(open(&b[..b.len() - 1], *b"TEST", 1, "t").is_err());
        let mut newer = b.clone();
        newer[4] = 2;
        assert_eq!(
            open(&newer, *b"TEST", 1, "t").unwrap_err(),
            Error::UnsupportedVersion {
                found: 2,
                supported: 1
            }
        );
        let mut flipped = b.clone();
        flipped[7] ^= 1;
        assert!(open(&flipped, *b"TEST", 1, "t").is_err());
    }

    #[test]
    fn sizes_are_checked_before_anything_is_allocated() {
        let b = container(&[0; 8]);
        let (_, r) = open(&b, *b"TEST", 1, "t").unwrap();
        assert!(r.clone().u16s(usize::MAX / 2 + 1, "x").is_err());
        assert!(r.clone().u16s(5, "x").is_err());
        assert!(r.clone().f32s(3, "x").is_err());
        assert!(r.clone().packed(usize::MAX, 8, "x").is_err());
        assert!(r.clone().packed(1 << 40, 0, "x").is_err());
        assert!(r.clone().packed(3, 33, "x").is_err());
        assert_eq!(r.clone().packed(8, 0, "x").unwrap(), vec![0; 8]);
        assert_eq!(r.clone().packed(4, 16, "x").unwrap(), vec![0; 4]);
    }

    proptest! {
        #[test]
        fn packed_fields_round_trip(bits in 0u32..=32, raw in proptest::collection::vec(any::<u32>(), 0..100)) {
            let v: Vec<u32> = raw.iter().map(|&x| if bits == 32 { x } else { x & ((1u64 << bits) - 1) as u32 }).collect();
            let mut w = Writer::new(*b"TEST", 1);
            w.packed(&v, bits);
            w.u32(0xDEAD_BEEF); // room for the 0-bit rule
            w.bytes(&vec![0; v.len()]);
            let (b, _) = w.finish();
            let (_, mut r) = open(&b, *b"TEST", 1, "t").unwrap();
            prop_assert_eq!(r.packed(v.len(), bits, "v").unwrap(), v);
            prop_assert_eq!(r.u32("tail").unwrap(), 0xDEAD_BEEF);
        }
    }
}
