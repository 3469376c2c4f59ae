//! LSB-first bit packing (stage 5c): value i occupies stream bits `[i*b, (i+1)*b)`, bit 0 of
//! the stream being the least significant bit of byte 0. Both containers pack through here:
//! fixed widths ([`pack_bits`], `pack_wide`) and a row of per-value widths
//! ([`pack_fields`], the calibrated mode's rows).

use crate::error::{param, Error, Result};

/// Bytes needed for `count` values of `bits` bits; for sizes the codec itself chose (a caller
/// or a container's sizes go through [`checked_packed_len`]).
pub fn packed_len(count: usize, bits: u32) -> usize {
    (count * bits as usize).div_ceil(8)
}

/// [`packed_len`], `None` when `count * bits` overflows.
pub fn checked_packed_len(count: usize, bits: u32) -> Option<usize> {
    count
        .checked_mul(bits as usize)
        .map(|total| total.div_ceil(8))
}

fn check_width(bits: u32) -> Result<()> {
    if (1..=8).contains(&bits) {
        Ok(())
    } else {
        param(format!("bit width must be in 1..=8, got {bits}"))
    }
}

/// Packs `values` (each `< 2^bits`) LSB-first.
pub fn pack_bits(values: &[u8], bits: u32) -> Result<Vec<u8>> {
    check_width(bits)?;
    if bits < 8 {
        if let Some((i, &v)) = values
            .iter()
            .enumerate()
            .find(|(_, &v)| (v as u32) >> bits != 0)
        {
            return param(format!(
                "value {v} at index {i} does not fit in {bits} bits"
            ));
        }
    }
    let mut out = vec![0u8; packed_len(values.len(), bits)];
    pack_into(values, bits, &mut out);
    Ok(out)
}

/// Packs into a zeroed buffer of at least `packed_len` bytes; values must already fit.
pub(crate) fn pack_into(values: &[u8], bits: u32, out: &mut [u8]) {
    match bits {
        1 => pack_groups::<1>(values, out),
        2 => pack_groups::<2>(values, out),
        3 => pack_groups::<3>(values, out),
        4 => pack_groups::<4>(values, out),
        5 => pack_groups::<5>(values, out),
        6 => pack_groups::<6>(values, out),
        7 => pack_groups::<7>(values, out),
        _ => pack_groups::<8>(values, out),
    }
}

/// Eight values fill exactly `B` bytes: pack them through a u64, LSB-first. `B` is a constant
/// so that the shifts are too.
fn pack_groups<const B: usize>(values: &[u8], out: &mut [u8]) {
    let chunks = values.chunks_exact(8);
    let rest = chunks.remainder();
    for (group, dst) in chunks.zip(out.chunks_exact_mut(B)) {
        let mut acc = 0u64;
        for (k, &v) in group.iter().enumerate() {
            acc |= (v as u64) << (k * B);
        }
        dst.copy_from_slice(&acc.to_le_bytes()[..B]);
    }
    let done = (values.len() / 8) * B;
    pack_tail(rest, B as u32, &mut out[done..]);
}

fn pack_tail(values: &[u8], bits: u32, out: &mut [u8]) {
    pack_fields(values.iter().map(|&v| (v as u32, bits)), out);
}

/// Bit-serial LSB-first packing of `(value, width)` pairs, widths 0..=32, into a zeroed buffer
/// of at least `ceil(sum of widths / 8)` bytes. Value `i` occupies the stream bits after those
/// of the values before it.
pub fn pack_fields(values: impl Iterator<Item = (u32, u32)>, out: &mut [u8]) {
    let mut acc: u64 = 0;
    let mut nacc: u32 = 0;
    let mut o = 0;
    for (v, bits) in values {
        acc |= (v as u64) << nacc;
        nacc += bits;
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

/// The inverse of [`pack_fields`]: value `i` of width `widths[i]` (0..=32) is written to
/// `out[i]` through `conv`; `buf` must hold at least `ceil(sum of widths / 8)` bytes.
#[inline]
pub fn unpack_fields<T>(
    buf: &[u8],
    widths: impl Iterator<Item = u32>,
    out: &mut [T],
    conv: impl Fn(u32) -> T,
) {
    let mut acc: u64 = 0;
    let mut nacc: u32 = 0;
    let mut i = 0;
    for (bits, o) in widths.zip(out.iter_mut()) {
        while nacc < bits {
            acc |= (buf[i] as u64) << nacc;
            i += 1;
            nacc += 8;
        }
        *o = conv((acc & ((1u64 << bits) - 1)) as u32);
        acc >>= bits;
        nacc -= bits;
    }
}

/// Unpacks `count` values of `bits` bits; `buf` must hold at least `packed_len(count, bits)`
/// bytes (checked, so the output is bounded by the input: `count <= 8 * buf.len() / bits`).
pub fn unpack_bits(buf: &[u8], bits: u32, count: usize) -> Result<Vec<u8>> {
    check_width(bits)?;
    let need = checked_packed_len(count, bits)
        .filter(|&need| need <= buf.len())
        .ok_or_else(|| {
            Error::Corrupt(format!(
                "{count} values of {bits} bits need more than the {} bytes given",
                buf.len()
            ))
        })?;
    debug_assert!(need <= buf.len());
    let mut out = vec![0u8; count];
    unpack_into(buf, bits, &mut out);
    Ok(out)
}

pub(crate) fn unpack_into(buf: &[u8], bits: u32, out: &mut [u8]) {
    match bits {
        1 => unpack_groups::<1>(buf, out),
        2 => unpack_groups::<2>(buf, out),
        3 => unpack_groups::<3>(buf, out),
        4 => unpack_groups::<4>(buf, out),
        5 => unpack_groups::<5>(buf, out),
        6 => unpack_groups::<6>(buf, out),
        7 => unpack_groups::<7>(buf, out),
        _ => unpack_groups::<8>(buf, out),
    }
}

fn unpack_groups<const B: usize>(buf: &[u8], out: &mut [u8]) {
    let mask = (1u64 << B) - 1;
    let full = out.len() / 8;
    for (dst, src) in out.chunks_exact_mut(8).zip(buf.chunks_exact(B)) {
        let mut word = [0u8; 8];
        word[..B].copy_from_slice(src);
        let acc = u64::from_le_bytes(word);
        for (k, v) in dst.iter_mut().enumerate() {
            *v = ((acc >> (k * B)) & mask) as u8;
        }
    }
    unpack_tail(&buf[full * B..], B as u32, &mut out[full * 8..]);
}

fn unpack_tail(buf: &[u8], bits: u32, out: &mut [u8]) {
    let n = out.len();
    unpack_fields(buf, std::iter::repeat_n(bits, n), out, |v| v as u8);
}

/// Packs u32 values of `bits` bits (0..=32) LSB-first; used for outlier positions and segment ids.
pub(crate) fn pack_wide(values: &[u32], bits: u32) -> Vec<u8> {
    let mut out = vec![0u8; packed_len(values.len(), bits)];
    if bits > 0 {
        pack_fields(values.iter().map(|&v| (v, bits)), &mut out);
    }
    out
}

/// Unpacks `count` u32 values of `bits` bits (0..=32); `buf` must hold `packed_len` bytes.
pub(crate) fn unpack_wide(buf: &[u8], bits: u32, count: usize) -> Vec<u32> {
    if bits == 0 {
        return vec![0; count];
    }
    let mut out = vec![0; count];
    unpack_fields(buf, std::iter::repeat_n(bits, count), &mut out, |v| v);
    out
}

/// Bits needed to tell `n` values apart: ceil(log2 n), 0 for n <= 1.
pub fn index_bits(n: usize) -> u32 {
    if n <= 1 {
        0
    } else {
        usize::BITS - (n - 1).leading_zeros()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn golden_lsb_first_bytes() {
        // 3-bit values 1..=6: stream 001 010 011 100 101 110 read LSB-first.
        assert_eq!(
            pack_bits(&[1, 2, 3, 4, 5, 6], 3).unwrap(),
            vec![0xD1, 0x58, 0x03]
        );
        assert_eq!(
            pack_bits(&[1, 0, 1, 1, 0, 0, 0, 1, 1], 1).unwrap(),
            vec![0x8D, 0x01]
        );
        assert_eq!(pack_bits(&[0xA, 0x5], 4).unwrap(), vec![0x5A]);
        assert_eq!(pack_bits(&[0xFF, 0x01], 8).unwrap(), vec![0xFF, 0x01]);
    }

    #[test]
    fn rejects_bad_input() {
        assert!(pack_bits(&[4], 2).is_err());
        assert!(pack_bits(&[0], 0).is_err());
        assert!(pack_bits(&[0], 9).is_err());
        assert!(unpack_bits(&[0], 3, 3).is_err());
    }

    #[test]
    fn index_bits_values() {
        assert_eq!(index_bits(0), 0);
        assert_eq!(index_bits(1), 0);
        assert_eq!(index_bits(2), 1);
        assert_eq!(index_bits(16), 4);
        assert_eq!(index_bits(17), 5);
    }

    proptest! {
        #[test]
        fn round_trip(bits in 1u32..=8, raw in proptest::collection::vec(any::<u8>(), 0..400)) {
            let vals: Vec<u8> = raw.iter().map(|&v| if bits == 8 { v } else { v & ((1u8 << bits) - 1) }).collect();
            let p = pack_bits(&vals, bits).unwrap();
            prop_assert_eq!(p.len(), packed_len(vals.len(), bits));
            prop_assert_eq!(unpack_bits(&p, bits, vals.len()).unwrap(), vals);
        }

        #[test]
        fn mixed_widths_round_trip(raw in proptest::collection::vec((any::<u32>(), 0u32..=32), 0..100)) {
            let vals: Vec<(u32, u32)> = raw
                .iter()
                .map(|&(v, b)| (if b == 32 { v } else { v & ((1u32 << b) - 1) }, b))
                .collect();
            let total: u32 = vals.iter().map(|v| v.1).sum();
            let mut buf = vec![0u8; (total as usize).div_ceil(8)];
            pack_fields(vals.iter().copied(), &mut buf);
            let mut back = vec![0u32; vals.len()];
            unpack_fields(&buf, vals.iter().map(|v| v.1), &mut back, |v| v);
            prop_assert_eq!(back, vals.iter().map(|v| v.0).collect::<Vec<_>>());
            // The same stream as packing each value's bits one by one, LSB-first.
            let mut bits = Vec::new();
            for &(v, b) in &vals {
                bits.extend((0..b).map(|k| (v >> k) & 1));
            }
            for (k, &bit) in bits.iter().enumerate() {
                prop_assert_eq!(((buf[k / 8] >> (k % 8)) & 1) as u32, bit);
            }
        }

        #[test]
        fn wide_round_trip(bits in 1u32..=32, raw in proptest::collection::vec(any::<u32>(), 0..200)) {
            let vals: Vec<u32> = raw.iter().map(|&v| if bits == 32 { v } else { v & ((1u32 << bits) - 1) }).collect();
            let p = pack_wide(&vals, bits);
            prop_assert_eq!(unpack_wide(&p, bits, vals.len()), vals);
        }
    }
}
