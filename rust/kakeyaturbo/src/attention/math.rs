//! The scalar functions of the attention kernel, each a fixed sequence of IEEE operations so
//! that every instruction set computes the same bits: `exp` on `[-inf, 0]`, `tanh`, and the
//! fixed-order horizontal sums.

/// Inputs below this give 0 (`exp(-87) = 1.6e-38` is the smallest result kept, above the
/// smallest normal float32, so `2^n` below is always a normal number).
const EXP_LOW: f32 = -87.0;
const LOG2E: f32 = std::f32::consts::LOG2_E;
/// `ln 2` split so that `n * LN2_HI` is exact for `|n| <= 126` (Cody-Waite reduction).
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;

/// `e^x` for `x <= 0` (and `-inf`; positive inputs give 1), within about 2 float32 ulps: `x = n ln 2 + r`,
/// `|r| <= ln 2 / 2`, `e^r` by its Taylor polynomial of degree 7 (Horner, fused), times `2^n`.
#[inline(always)]
pub fn exp_neg(x: f32) -> f32 {
    // Branch-free (it vectorises): the polynomial runs on the clamped input and the result is
    // selected afterwards; `!(x >= LOW)` also sends NaN to 0 (the kernel never makes one).
    // `max` then `min` (not `clamp`, which keeps NaN) so that `n` is an integer in
    // `[-126, 0]` for every input: its conversion below then needs no saturation, which `as`
    // would add as scalar compares and moves per lane.
    #[allow(clippy::manual_clamp)] // `clamp` keeps NaN, which is what this avoids.
    let xc = x.max(EXP_LOW).min(0.0);
    let n = (xc * LOG2E).round_ties_even();
    let r = n.mul_add(-LN2_HI, xc);
    let r = n.mul_add(-LN2_LO, r);
    let mut p: f32 = 1.0 / 5040.0;
    p = p.mul_add(r, 1.0 / 720.0);
    p = p.mul_add(r, 1.0 / 120.0);
    p = p.mul_add(r, 1.0 / 24.0);
    p = p.mul_add(r, 1.0 / 6.0);
    p = p.mul_add(r, 0.5);
    p = p.mul_add(r, 1.0);
    p = p.mul_add(r, 1.0);
    // SAFETY: `n` is finite and in `[-126, 0]` (above).
    let ni: i32 = unsafe { n.to_int_unchecked() };
    let y = p * f32::from_bits(((ni + 127) as u32) << 23);
    if x >= EXP_LOW {
        y
    } else {
        0.0
    }
}

/// `tanh(x) = sign(x) (1 - e) / (1 + e)`, `e = e^(-2|x|)`.
#[inline(always)]
pub fn tanh(x: f32) -> f32 {
    let e = exp_neg(-2.0 * x.abs());
    ((1.0 - e) / (1.0 + e)).copysign(x)
}

/// The sum of 16 lanes as a tree: lanes `l` and `l + h` for `h = 8, 4, 2, 1`.
#[inline(always)]
pub fn hsum16(v: &[f32; 16]) -> f32 {
    let mut a = *v;
    let mut h = 8;
    while h > 0 {
        for l in 0..h {
            a[l] += a[l + h];
        }
        h /= 2;
    }
    a[0]
}

/// The sum of a tile's 64 lanes: `(v0 + v1) + (v2 + v3)` lane by lane over its four groups
/// of 16, then [`hsum16`].
#[inline(always)]
pub fn tile_sum(v: &[f32]) -> f32 {
    debug_assert_eq!(v.len(), 64);
    let mut a = [0f32; 16];
    for l in 0..16 {
        a[l] = (v[l] + v[16 + l]) + (v[32 + l] + v[48 + l]);
    }
    hsum16(&a)
}

/// Columns of [`rows_times`] held per row: 4 rows x 64 float32 sums fill 16 AVX-512 registers.
pub(crate) const ROW_BLOCK: usize = 64;

/// `out[r * n + c]` = the `fma` chain over `i` from 0 of `x[r * stride + i] * mat[i * n + c]`
/// (`rows` rows of `k` entries, `mat` `k x n` row-major): blocks of 4 rows x [`ROW_BLOCK`]
/// columns held in registers across `i`, so that `mat` is read once per 4 rows (the loops of
/// the last partial blocks are plain; the same chains).
#[inline(always)]
pub(crate) fn rows_times(
    x: &[f32],
    stride: usize,
    rows: usize,
    mat: &[f32],
    k: usize,
    n: usize,
    out: &mut [f32],
) {
    assert!(mat.len() >= k * n && out.len() >= rows * n);
    if n == 0 {
        return;
    }
    assert!(rows == 0 || x.len() >= (rows - 1) * stride + k);
    let full = n / ROW_BLOCK * ROW_BLOCK;
    for c0 in (0..full).step_by(ROW_BLOCK) {
        let mut r0 = 0;
        while r0 < rows {
            match rows - r0 {
                1 => rows_block::<1>(x, stride, r0, mat, k, n, c0, out),
                2 => rows_block::<2>(x, stride, r0, mat, k, n, c0, out),
                3 => rows_block::<3>(x, stride, r0, mat, k, n, c0, out),
                _ => rows_block::<4>(x, stride, r0, mat, k, n, c0, out),
            }
            r0 += (rows - r0).min(4);
        }
    }
    if full < n {
        for r in 0..rows {
            let o = &mut out[r * n + full..(r + 1) * n];
            o.fill(0.0);
            for (i, row) in mat.chunks_exact(n).take(k).enumerate() {
                let xi = x[r * stride + i];
                for (v, &m) in o.iter_mut().zip(&row[full..]) {
                    *v = xi.mul_add(m, *v);
                }
            }
        }
    }
}

/// Rows `r0 .. r0 + R`, columns `c0 .. c0 + ROW_BLOCK` of [`rows_times`].
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn rows_block<const R: usize>(
    x: &[f32],
    stride: usize,
    r0: usize,
    mat: &[f32],
    k: usize,
    n: usize,
    c0: usize,
    out: &mut [f32],
) {
    let mut acc = [[0f32; ROW_BLOCK]; R];
    for (i, row) in mat.chunks_exact(n).take(k).enumerate() {
        let row: &[f32; ROW_BLOCK] = row[c0..c0 + ROW_BLOCK].try_into().expect("a block");
        for (r, a) in acc.iter_mut().enumerate() {
            let xi = x[(r0 + r) * stride + i];
            for (v, &m) in a.iter_mut().zip(row) {
                *v = xi.mul_add(m, *v);
            }
        }
    }
    for (r, a) in acc.iter().enumerate() {
        out[(r0 + r) * n + c0..(r0 + r) * n + c0 + ROW_BLOCK].copy_from_slice(a);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn exp_is_accurate_and_exact_at_the_ends() {
        assert_eq!(exp_neg(0.0), 1.0);
        assert_eq!(exp_neg(-0.0), 1.0);
        assert_eq!(exp_neg(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_neg(-1000.0), 0.0);
        assert_eq!(exp_neg(f32::NAN).to_bits(), 0.0f32.to_bits());
        assert_eq!(exp_neg(f32::INFINITY), 1.0);
        assert_eq!(exp_neg(1e-30), 1.0);
        assert!(exp_neg(-87.0) > 0.0 && exp_neg(-87.0).is_normal());
        let mut worst = 0f64;
        let mut x = -87.0f32;
        while x <= 0.0 {
            let want = (x as f64).exp();
            let err = ((exp_neg(x) as f64 - want) / want).abs();
            worst = worst.max(err);
            x += 0.001_37;
        }
        assert!(worst < 2.5e-7, "{worst}");
    }

    #[test]
    fn sums_follow_their_tree() {
        let v: [f32; 16] = std::array::from_fn(|i| i as f32);
        assert_eq!(hsum16(&v), 120.0);
        let t: Vec<f32> = (0..64).map(|i| i as f32).collect();
        assert_eq!(tile_sum(&t), 2016.0);
        // The order is fixed: 1e8 + 1 - 1e8 lands where the tree puts it.
        let mut w = [0f32; 16];
        w[0] = 1e8;
        w[8] = 1.0;
        w[1] = -1e8;
        assert_eq!(hsum16(&w), 0.0);
    }

    proptest! {
        #[test]
        fn tanh_is_accurate(x in -30.0f32..30.0) {
            let want = (x as f64).tanh();
            prop_assert!((tanh(x) as f64 - want).abs() < 3e-7);
            prop_assert_eq!(tanh(-x), -tanh(x));
        }
    }
}
