//! Storage of floats as IEEE fp16, with an optional shared power-of-two exponent.
//!
//! A plain fp16 value overflows to inf above 65504 and flushes to zero below 6e-8. The mean,
//! the projections `t` and the per-vector scales of a block are stored as fp16 *mantissas* with
//! one shared exponent `e` (an i8 in [-126, 127]): value = f32(h) * 2^e, with `e` chosen so that
//! the largest magnitude lands in (2^14, 2^15]. The scaling is by a power of two, so it adds no
//! rounding of its own and any finite f32 survives.

use half::f16;

pub const MIN_EXP: i32 = -126;
pub const MAX_EXP: i32 = 127;

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

/// A vector stored as fp16 mantissas with one shared exponent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScaledF16 {
    pub exp: i8,
    pub bits: Vec<u16>,
}

impl ScaledF16 {
    pub fn encode(values: &[f32]) -> Self {
        let max_abs = values.iter().fold(0f32, |m, v| m.max(v.abs()));
        let exp = shared_exponent(max_abs);
        // 2^-exp as f64 is exact for every exponent; scaling by it adds no rounding.
        let scale = 2f64.powi(-(exp as i32));
        Self {
            exp,
            bits: values
                .iter()
                .map(|&v| f16::from_f64(v as f64 * scale).to_bits())
                .collect(),
        }
    }

    pub fn decode(&self) -> Vec<f32> {
        self.bits
            .iter()
            .map(|&h| from_bits_scaled(h, self.exp))
            .collect()
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
            for (a, b) in v.iter().zip(&d) {
                prop_assert!(b.is_finite());
                // Error bounded by half an fp16 ulp of the largest value (relative 2^-11).
                prop_assert!(((a - b).abs() as f64) <= (m as f64) * 2f64.powi(-11) + 1e-30);
            }
        }
    }
}
