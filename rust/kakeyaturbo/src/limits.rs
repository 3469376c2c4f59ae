//! The documented limits of the codec and the checks of caller input both modes share.
//!
//! Everything a caller can ask for is bounded: a row length, a row count, a sign pattern; sizes
//! computed from caller values use checked arithmetic; outputs sized by caller or container
//! values are allocated fallibly, so a request the machine cannot hold is an error, not an
//! abort.

use crate::error::{input, Error, Result};

/// Largest row length `D` (and number of calibrated components `m`): an attention head is at
/// most a few hundred wide, and exact PCA costs O(D^3) time and O(D^2) memory.
pub const MAX_DIM: usize = 4096;

/// Largest number of rows in one call: row indices and outlier positions are 32-bit.
pub const MAX_ROWS: usize = u32::MAX as usize;

/// Longest sign pattern a caller may request (`wht_sign_pattern`): 2^26 entries, 256 MiB of
/// float32, far beyond any rotation the codec uses (at most `MAX_DIM` wide).
pub const MAX_SIGN_PATTERN: usize = 1 << 26;

/// Most (batch row, kv-head) pairs one layer of attention codes holds (`LayerCodes`): every
/// pair holds an empty store of each stream before any block (about 40 bytes each), so the
/// count is bounded, not only the batch (2^20 x 64 kv-heads asked for 2.7 GB of empty stores).
pub const MAX_STORES: usize = 1 << 20;

/// `a * b` for sizes given by a caller; an overflow is invalid input.
pub fn size(a: usize, b: usize, what: &str) -> Result<usize> {
    a.checked_mul(b)
        .ok_or_else(|| Error::InvalidInput(format!("size of {what} overflows ({a} x {b})")))
}

/// A zeroed vector of `len` elements, or an error if the memory cannot be had.
pub fn zeros<T: Clone + Default>(len: usize, what: &str) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(len).map_err(|_| {
        Error::InvalidInput(format!(
            "cannot allocate {what} ({len} values of {} bytes)",
            std::mem::size_of::<T>()
        ))
    })?;
    v.resize(len, T::default());
    Ok(v)
}

/// `v` rounded to float32, saturating at `+-f32::MAX` (NaN stays NaN): how the decoders'
/// f64 fallback returns reconstructions that overshoot the float32 range.
#[inline]
pub fn saturate(v: f64) -> f32 {
    v.clamp(-(f32::MAX as f64), f32::MAX as f64) as f32
}

/// Magnitudes up to which the float32 decoders cannot overflow (`f32::MAX` is about 2^128;
/// the margin covers rounding).
pub const SAFE_F32: f64 = 1.329_227_995_784_916e36; // 2^120

/// Largest magnitude of a slice of finite values, in f64. The bits of non-negative floats
/// are ordered like their values, so an integer max (which vectorises) finds it.
#[multiversion::multiversion(targets("x86_64+avx2", "x86_64+sse4.1"))]
pub fn max_abs(v: &[f32]) -> f64 {
    let m = v
        .iter()
        .fold(0i32, |m, x| m.max((x.to_bits() & 0x7fff_ffff) as i32));
    f32::from_bits(m as u32) as f64
}

/// True when every value is finite, for the decoders' check of their whole output. Branch
/// free and vectorisable with plain integer ops: an exponent field `e` plus one ulp of the
/// exponent carries into the sign bit exactly when `e` is all ones (inf or NaN).
#[inline]
pub fn all_finite(v: &[f32]) -> bool {
    let flag = |x: &f32| (x.to_bits() & 0x7f80_0000) + 0x0080_0000;
    let mut lanes = [0u32; 16];
    let chunks = v.chunks_exact(16);
    let mut bad = chunks.remainder().iter().fold(0, |a, x| a | flag(x));
    for c in chunks {
        for (l, x) in lanes.iter_mut().zip(c) {
            *l |= flag(x);
        }
    }
    bad |= lanes.iter().fold(0, |a, l| a | l);
    bad & 0x8000_0000 == 0
}

/// Checks a row-major `[n, d]` float32 tensor and optional weights.
pub fn check_input(x: &[f32], n: usize, d: usize, weights: Option<&[f32]>) -> Result<()> {
    if n == 0 {
        return input("the tensor has no rows (N = 0)");
    }
    if d == 0 {
        return input("the tensor has no columns (D = 0)");
    }
    if n.checked_mul(d) != Some(x.len()) {
        return input(format!(
            "expected {n} x {d} values for [{n}, {d}], got {}",
            x.len()
        ));
    }
    if d > MAX_DIM {
        return input(format!(
            "D = {d} exceeds the supported maximum {MAX_DIM} (PCA needs a D x D covariance)"
        ));
    }
    if n > MAX_ROWS {
        return input("N must fit in 32 bits");
    }
    if let Some(i) = x.iter().position(|v| !v.is_finite()) {
        return input(format!(
            "non-finite value {} at row {}, column {}",
            x[i],
            i / d,
            i % d
        ));
    }
    if let Some(w) = weights {
        if w.len() != n {
            return input(format!("expected {n} weights, got {}", w.len()));
        }
        if let Some(i) = w.iter().position(|v| !v.is_finite() || *v < 0.0) {
            return input(format!(
                "weights must be finite and >= 0; weight {i} is {}",
                w[i]
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_allocations_fail_softly() {
        assert!(size(usize::MAX, 2, "x").is_err());
        assert_eq!(size(3, 4, "x").unwrap(), 12);
        assert!(zeros::<f32>(usize::MAX / 2, "x").is_err());
        assert_eq!(zeros::<u8>(3, "x").unwrap(), vec![0; 3]);
        assert_eq!(saturate(1e39), f32::MAX);
        assert_eq!(saturate(-1e300), -f32::MAX);
        assert_eq!(saturate(1.5), 1.5);
        assert!(saturate(f64::NAN).is_nan());
        assert!(all_finite(&[0.0, -f32::MAX, f32::MIN_POSITIVE, 1e-45]));
        assert_eq!(max_abs(&[0.5, -3.0, 2.0, -0.0]), 3.0);
        assert_eq!(max_abs(&[]), 0.0);
        for bad in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN] {
            assert!(!all_finite(&[1.0, bad, 2.0]));
        }
    }

    #[test]
    fn bad_tensors_are_refused() {
        assert!(check_input(&[], 0, 4, None).is_err());
        assert!(check_input(&[], 4, 0, None).is_err());
        assert!(check_input(&[1.0], usize::MAX, 2, None).is_err());
        assert!(check_input(&[1.0, f32::NAN], 1, 2, None).is_err());
        assert!(check_input(&[1.0, 2.0], 1, 2, Some(&[-1.0])).is_err());
        assert!(check_input(&[1.0, 2.0], 1, 2, Some(&[1.0, 1.0])).is_err());
        assert!(check_input(&[1.0, 2.0], 1, 2, Some(&[1.0])).is_ok());
    }
}
