//! Storage of floats as IEEE fp16, with an optional shared power-of-two exponent.
//!
//! A plain fp16 value overflows to inf above 65504 and flushes to zero below 6e-8. The mean,
//! the projections `t` and the per-vector scales of a block are stored as fp16 *mantissas* with
//! one shared exponent `e` (an i8 in [-126, 127]): value = f32(h) * 2^e, with `e` chosen so that
//! the largest magnitude lands in (2^14, 2^15]. The scaling is by a power of two, so it adds no
//! rounding of its own and any finite f32 survives: [`ScaledF16::encode`] never stores a value
//! whose float32 decode is inf (a mantissa that rounds past `f32::MAX` is stepped back towards
//! zero by one fp16 ulp).
//!
//! Values beyond the float32 range (a scale or projection of rows near `f32::MAX`) are stored
//! with [`ScaledF16::encode_f64`] (up to `32768 * 2^127`) and read back exactly with
//! [`ScaledF16::decode_f64`]; decoders fall back to f64 arithmetic for them.

use crate::error::{corrupt, input, Result};
use half::f16;
use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};

pub const MIN_EXP: i32 = -126;
pub const MAX_EXP: i32 = 127;

/// IEEE fp16 bits widened to f32 (exact), a slice at a time (F16C where the CPU has it).
pub fn widen(bits: &[u16]) -> Vec<f32> {
    let mut out = vec![0f32; bits.len()];
    bits.reinterpret_cast::<f16>()
        .convert_to_f32_slice(&mut out);
    out
}

/// 2^e as f32, exact for e in [MIN_EXP, MAX_EXP].
#[inline]
pub fn pow2(e: i32) -> f32 {
    debug_assert!((MIN_EXP..=MAX_EXP).contains(&e));
    f32::from_bits(((e + 127) as u32) << 23)
}

/// The shared exponent for values whose largest magnitude is `max_abs`.
pub fn shared_exponent(max_abs: f32) -> i8 {
    if max_abs == 0.0 || !max_abs.is_finite() {
        return 0;
    }
    // Smallest e with max_abs * 2^-e <= 2^15, found exactly from the float's own exponent.
    let mut e = (max_abs.log2().ceil() as i32 - 15).clamp(MIN_EXP, MAX_EXP);
    while e < MAX_EXP && (max_abs as f64) * 2f64.powi(-e) > 32768.0 {
        e += 1;
    }
    while e > MIN_EXP && (max_abs as f64) * 2f64.powi(-(e - 1)) <= 32768.0 {
        e -= 1;
    }
    e as i8
}

/// Rounds `v * 2^-e` to fp16 (round to nearest even) and returns the raw bits.
#[inline]
pub fn to_bits_scaled(v: f32, e: i8) -> u16 {
    f16::from_f64(v as f64 * 2f64.powi(-(e as i32))).to_bits()
}

/// The value that [`to_bits_scaled`] stored: `f32(h) * 2^e`.
#[inline]
pub fn from_bits_scaled(h: u16, e: i8) -> f32 {
    f16::from_bits(h).to_f32() * pow2(e as i32)
}

/// Rounds to plain fp16 and back (the value every later stage uses).
#[inline]
pub fn round_f16(v: f32) -> f32 {
    f16::from_f32(v).to_f32()
}

/// The largest magnitude a [`ScaledF16`] holds: 32768 (the largest mantissa the shared
/// exponent rule produces) times `2^MAX_EXP`.
pub const MAX_SCALED: f64 = 32768.0 * 1.7014118346046923e38; // 2^15 * 2^127

/// The shared exponent for a largest magnitude given in f64 (which may exceed the f32 range);
/// the same rule as [`shared_exponent`].
fn shared_exponent_f64(max_abs: f64) -> i8 {
    if max_abs == 0.0 || !max_abs.is_finite() {
        return 0;
    }
    let mut e = (max_abs.log2().ceil() as i32 - 15).clamp(MIN_EXP, MAX_EXP);
    while e < MAX_EXP && max_abs * 2f64.powi(-e) > 32768.0 {
        e += 1;
    }
    while e > MIN_EXP && max_abs * 2f64.powi(-(e - 1)) <= 32768.0 {
        e -= 1;
    }
    e as i8
}

/// The fp16 value one ulp closer to zero (for a finite, non-zero `h`).
fn toward_zero(h: u16) -> u16 {
    (h & 0x8000) | ((h & 0x7fff) - 1)
}

/// A vector stored as fp16 mantissas with one shared exponent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScaledF16 {
    pub exp: i8,
    pub bits: Vec<u16>,
}

impl ScaledF16 {
    /// Stores finite f32 values; each decodes (in f32) to a finite value.
    pub fn encode(values: &[f32]) -> Self {
        let max_abs = values.iter().fold(0f32, |m, v| m.max(v.abs()));
        let exp = shared_exponent(max_abs);
        // 2^-exp as f64 is exact for every exponent; scaling by it adds no rounding.
        let scale = 2f64.powi(-(exp as i32));
        Self {
            exp,
            bits: values
                .iter()
                .map(|&v| {
                    let h = f16::from_f64(v as f64 * scale).to_bits();
                    // Only a value within half an fp16 ulp of f32::MAX can round past it.
                    if v.is_finite() && !from_bits_scaled(h, exp).is_finite() {
                        toward_zero(h)
                    } else {
                        h
                    }
                })
                .collect(),
        }
    }

    /// Stores values that may lie beyond the float32 range (up to [`MAX_SCALED`]); for values
    /// that are float32 numbers whose decode stays finite it writes the bits of [`Self::encode`].
    pub fn encode_f64(values: &[f64]) -> Result<Self> {
        let max_abs = values.iter().fold(0f64, |m, v| m.max(v.abs()));
        if values.iter().any(|v| v.is_nan()) || !(max_abs.is_finite() && max_abs <= MAX_SCALED) {
            return input(format!(
                "a scale of {max_abs:e} is beyond what the format stores ({MAX_SCALED:e})"
            ));
        }
        let exp = shared_exponent_f64(max_abs);
        let scale = 2f64.powi(-(exp as i32));
        Ok(Self {
            exp,
            bits: values
                .iter()
                .map(|&v| f16::from_f64(v * scale).to_bits())
                .collect(),
        })
    }

    /// The stored values in f32 (inf where a value lies beyond the float32 range).
    pub fn decode(&self) -> Vec<f32> {
        // [`from_bits_scaled`] of each value: the exact widening, then one product.
        let p = pow2(self.exp as i32);
        let mut v = widen(&self.bits);
        v.iter_mut().for_each(|x| *x *= p);
        v
    }

    /// Stored value `i`, exactly, in f64.
    pub fn value_f64(&self, i: usize) -> f64 {
        f16::from_bits(self.bits[i]).to_f64() * 2f64.powi(self.exp as i32)
    }

    /// The largest stored magnitude, exactly, in f64.
    pub fn max_abs_f64(&self) -> f64 {
        // The bits of non-negative fp16 numbers are ordered like their values.
        let m = self.bits.iter().fold(0u16, |m, &h| m.max(h & 0x7fff));
        f16::from_bits(m).to_f64() * 2f64.powi(self.exp as i32)
    }

    /// The stored values, exactly, in f64.
    pub fn decode_f64(&self) -> Vec<f64> {
        (0..self.bits.len()).map(|i| self.value_f64(i)).collect()
    }

    /// The stored values times `2^s`: the same mantissas when the exponent stays in range,
    /// else re-rounded.
    pub fn scaled_by_pow2(&self, s: i32) -> Result<Self> {
        let e = self.exp as i32 + s;
        if (MIN_EXP..=MAX_EXP).contains(&e) {
            return Ok(Self {
                exp: e as i8,
                bits: self.bits.clone(),
            });
        }
        let f = 2f64.powi(s);
        Self::encode_f64(&self.decode_f64().iter().map(|v| v * f).collect::<Vec<_>>())
    }

    /// Steps every mantissa whose f32 decode is inf back towards zero until it is finite (for
    /// a field that must hold float32 numbers, such as a mean).
    pub fn clamp_to_f32(&mut self) {
        for h in &mut self.bits {
            while !from_bits_scaled(*h, self.exp).is_finite() && f16::from_bits(*h).is_finite() {
                *h = toward_zero(*h);
            }
        }
    }

    /// Checks a stored vector: exponent in range, every mantissa a finite fp16.
    pub fn check(&self, what: &str) -> Result<()> {
        if !(MIN_EXP..=MAX_EXP).contains(&(self.exp as i32)) {
            return corrupt(format!("{what} exponent {} is out of range", self.exp));
        }
        if let Some(i) = self
            .bits
            .iter()
            .position(|&h| !f16::from_bits(h).is_finite())
        {
            return corrupt(format!("{what} {i} is not a finite fp16 mantissa"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn large_values_do_not_become_inf() {
        let v = vec![1e30f32, -3e38, 70000.0, 1.0];
        let s = ScaledF16::encode(&v);
        let d = s.decode();
        assert!(d.iter().all(|x| x.is_finite()));
        assert!((d[1] / v[1] - 1.0).abs() < 1e-3);
        assert!((d[0] / v[0] - 1.0).abs() < 1e-3);
    }

    #[test]
    fn values_near_the_f32_maximum_stay_finite() {
        // 3.4e38 rounds to the mantissa 32768 at exponent 113: 2^128, inf in f32.
        for v in [f32::MAX, -f32::MAX, 3.4e38, 3.3e38] {
            let s = ScaledF16::encode(&[v, 1.0]);
            let d = s.decode();
            assert!(d[0].is_finite(), "{v}");
            assert!((d[0] / v - 1.0).abs() < 1e-3);
        }
        let mut big = ScaledF16::encode_f64(&[2f64.powi(130), 1.0]).unwrap();
        assert!(big.decode()[0].is_infinite());
        assert_eq!(big.value_f64(0), 2f64.powi(130));
        big.clamp_to_f32();
        assert!(big.decode()[0].is_finite());
        assert!(ScaledF16::encode_f64(&[1e44]).is_err());
        assert!(ScaledF16::encode_f64(&[f64::NAN]).is_err());
    }

    #[test]
    fn shifting_by_powers_of_two_is_exact_in_range() {
        let s = ScaledF16::encode(&[3.0, -0.5, 1e-3]);
        assert_eq!(
            s.max_abs_f64(),
            s.decode_f64().iter().fold(0f64, |m, v| m.max(v.abs()))
        );
        let up = s.scaled_by_pow2(100).unwrap();
        assert_eq!(up.bits, s.bits);
        for (a, b) in s.decode_f64().iter().zip(up.decode_f64()) {
            assert_eq!(a * 2f64.powi(100), b);
        }
        // Out of range: re-rounded into fp16 subnormals, still finite.
        let down = s.scaled_by_pow2(-200).unwrap();
        assert_eq!(down.exp as i32, MIN_EXP);
        assert!(down.decode().iter().all(|v| v.is_finite()));
        assert!(ScaledF16 {
            exp: -128,
            bits: vec![0]
        }
        .check("t")
        .is_err());
        assert!(ScaledF16 {
            exp: 0,
            bits: vec![0x7c00]
        }
        .check("t")
        .is_err());
    }

    #[test]
    fn ordinary_values_keep_fp16_precision() {
        let v = vec![0.1f32, -2.5, 1000.0];
        let d = ScaledF16::encode(&v).decode();
        for (a, b) in v.iter().zip(&d) {
            assert!((a - b).abs() <= a.abs() * 1e-3);
        }
        assert_eq!(ScaledF16::encode(&[0.0, 0.0]).decode(), vec![0.0, 0.0]);
    }

    proptest! {
        #[test]
        fn relative_error_is_fp16_sized(v in proptest::collection::vec(-3.0e38f32..3.0e38, 1..50)) {
            let s = ScaledF16::encode(&v);
            let d = s.decode();
            let m = v.iter().fold(0f32, |m, x| m.max(x.abs()));
            prop_assert_eq!(&ScaledF16::encode_f64(&v.iter().map(|&x| x as f64).collect::<Vec<_>>()).unwrap(), &s);
            for (a, b) in v.iter().zip(&d) {
                prop_assert!(b.is_finite());
                // Error bounded by half an fp16 ulp of the largest value (relative 2^-11).
                prop_assert!(((a - b).abs() as f64) <= (m as f64) * 2f64.powi(-11) + 1e-30);
            }
        }
    }
}
