//! RoPE taken off keys before they are sealed (keys coded before RoPE, SPEC section 12): the
//! inverse of the model's rotation, `y = x * c' - rot(x) * s'` with `c' = cos / (cos^2 + sin^2)`
//! and `s'` alike. The division makes it exact for rope types that scale cos and sin, and
//! absorbs the rounding of float32 tables whose squares do not sum to exactly 1. `c'` and `s'`
//! are computed in float64 once per row of the table (shared by every head) and rounded to
//! float32; the rows are then turned in float32, one pass over them.

use super::rope::RopeStyle;
use crate::error::{input, param, Result};

/// The shape of what [`unrope`] turns: `[batch, heads, t, d]` rows (row-major), of which the
/// first `rows` of every `(batch, head)` are turned; a table of `table_batch` (1 or `batch`)
/// times `rows` rows of `rot` channels (`rot` even, at most `d`; channels past it pass through).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnropeShape {
    pub batch: usize,
    pub heads: usize,
    pub t: usize,
    pub d: usize,
    pub rows: usize,
    pub table_batch: usize,
    pub rot: usize,
}

impl UnropeShape {
    fn check(&self, x_len: usize, table_len: usize) -> Result<()> {
        let s = *self;
        if !s.rot.is_multiple_of(2) || s.rot > s.d {
            return param(format!(
                "the rotated channels ({}) must be even and at most the row width ({})",
                s.rot, s.d
            ));
        }
        if s.rows > s.t {
            return input(format!("{} rows asked of {} held", s.rows, s.t));
        }
        if s.table_batch != 1 && s.table_batch != s.batch {
            return input(format!(
                "the table's batch ({}) must be 1 or the rows' ({})",
                s.table_batch, s.batch
            ));
        }
        let want = [s.batch, s.heads, s.t, s.d]
            .iter()
            .try_fold(1usize, |a, &b| a.checked_mul(b));
        if want != Some(x_len) {
            return input(format!(
                "rows of {x_len} values for [{}, {}, {}, {}]",
                s.batch, s.heads, s.t, s.d
            ));
        }
        let table = [s.table_batch, s.rows, s.rot]
            .iter()
            .try_fold(1usize, |a, &b| a.checked_mul(b));
        if table != Some(table_len) {
            return input(format!(
                "a table of {table_len} values for [{}, {}, {}]",
                s.table_batch, s.rows, s.rot
            ));
        }
        Ok(())
    }
}

/// `x` (`shape`, each value widened to float32 by `widen`) with RoPE taken off its first
/// `shape.rows` rows per `(batch, head)`: `[batch, heads, rows, d]` float32. `cos`/`sin`:
/// `[table_batch, rows, rot]`, channel form (as a rotary module gives them: one entry per
/// channel), `style` the pairing. Errors: shapes that disagree; a table entry that is not
/// finite or whose `cos^2 + sin^2` is 0 (with rows to turn). Allocates the rows returned (at
/// most as many values as `x` holds) and one row of the table.
#[inline(always)]
pub fn unrope<T: Copy>(
    x: &[T],
    widen: impl Fn(T) -> f32 + Copy,
    shape: UnropeShape,
    cos: &[f32],
    sin: &[f32],
    style: RopeStyle,
) -> Result<Vec<f32>> {
    if cos.len() != sin.len() {
        return input("cos and sin must have the same shape");
    }
    shape.check(x.len(), cos.len())?;
    let UnropeShape {
        batch,
        heads,
        t,
        d,
        rows,
        table_batch,
        rot,
    } = shape;
    let mut out = vec![0f32; batch * heads * rows * d];
    if d == 0 || rows == 0 {
        return Ok(out);
    }
    // Row by row, every head of it in turn: the table's row is turned into `c' = c / n`,
    // `s' = s / n` once (one division per entry, without a branch), then read from L1.
    let (mut cp, mut sp) = (vec![0f32; rot], vec![0f32; rot]);
    for b in 0..batch {
        let tb = if table_batch == 1 { 0 } else { b };
        for r in 0..rows {
            let at = (tb * rows + r) * rot;
            if !inverse_row(&cos[at..at + rot], &sin[at..at + rot], &mut cp, &mut sp) {
                return input("cos and sin must be finite, with cos^2 + sin^2 > 0");
            }
            for h in 0..heads {
                let bh = b * heads + h;
                let x = &x[(bh * t + r) * d..][..d];
                let o = &mut out[(bh * rows + r) * d..][..d];
                turn_row(x, widen, o, &cp, &sp, style);
            }
        }
    }
    Ok(out)
}

/// `c' = c / (c^2 + s^2)` and `s'` alike for one row of the table, in float64 rounded to
/// float32; false where an entry is not finite or `c^2 + s^2` is 0.
#[inline(always)]
fn inverse_row(cos: &[f32], sin: &[f32], cp: &mut [f32], sp: &mut [f32]) -> bool {
    let mut ok = true;
    for (((&c, &s), cp), sp) in cos.iter().zip(sin).zip(cp).zip(sp) {
        let (c, s) = (c as f64, s as f64);
        let n = c * c + s * s;
        ok &= n > 0.0 && n.is_finite();
        let inv = 1.0 / n;
        (*cp, *sp) = ((c * inv) as f32, (s * inv) as f32);
    }
    ok
}

/// One row: `x` and `o` `[d]`, `c`/`s` `[rot]`.
#[inline(always)]
fn turn_row<T: Copy>(
    x: &[T],
    widen: impl Fn(T) -> f32 + Copy,
    o: &mut [f32],
    c: &[f32],
    s: &[f32],
    style: RopeStyle,
) {
    let rot = c.len();
    let h = rot / 2;
    let (o, rest) = o.split_at_mut(rot);
    match style {
        // rot(x) = (-x2, x1): y1 = x1 c1 + x2 s1, y2 = x2 c2 - x1 s2.
        RopeStyle::Half => {
            let (x1, x2) = x[..rot].split_at(h);
            let (o1, o2) = o.split_at_mut(h);
            let ((c1, c2), (s1, s2)) = (c.split_at(h), s.split_at(h));
            for (((o, &a), &b), (&c, &s)) in o1.iter_mut().zip(x1).zip(x2).zip(c1.iter().zip(s1)) {
                *o = widen(a) * c + widen(b) * s;
            }
            for (((o, &a), &b), (&c, &s)) in o2.iter_mut().zip(x1).zip(x2).zip(c2.iter().zip(s2)) {
                *o = widen(b) * c - widen(a) * s;
            }
        }
        // rot(x) = (-x1, x0, -x3, x2, ...).
        RopeStyle::Interleaved => {
            for (((o, x), c), s) in o
                .chunks_exact_mut(2)
                .zip(x[..rot].chunks_exact(2))
                .zip(c.chunks_exact(2))
                .zip(s.chunks_exact(2))
            {
                let (a, b) = (widen(x[0]), widen(x[1]));
                o[0] = a * c[0] + b * s[0];
                o[1] = b * c[1] - a * s[1];
            }
        }
    }
    for (o, &v) in rest.iter_mut().zip(&x[rot..]) {
        *o = widen(v);
    }
}

/// [`unrope`] of float32 rows, compiled for the wider vector units where the CPU has them.
#[multiversion::multiversion(targets("x86_64+avx512f+avx512bw", "x86_64+avx2"))]
pub fn unrope_f32(
    x: &[f32],
    shape: UnropeShape,
    cos: &[f32],
    sin: &[f32],
    style: RopeStyle,
) -> Result<Vec<f32>> {
    unrope(x, |v| v, shape, cos, sin, style)
}

/// [`unrope`] of bfloat16 rows held as their bits (widened exactly).
#[multiversion::multiversion(targets("x86_64+avx512f+avx512bw", "x86_64+avx2"))]
pub fn unrope_bf16(
    x: &[u16],
    shape: UnropeShape,
    cos: &[f32],
    sin: &[f32],
    style: RopeStyle,
) -> Result<Vec<f32>> {
    unrope(
        x,
        |v| f32::from_bits((v as u32) << 16),
        shape,
        cos,
        sin,
        style,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(
        batch: usize,
        heads: usize,
        t: usize,
        d: usize,
        rows: usize,
        tb: usize,
        rot: usize,
    ) -> UnropeShape {
        UnropeShape {
            batch,
            heads,
            t,
            d,
            rows,
            table_batch: tb,
            rot,
        }
    }

    /// The model's rotation in float64, for the round trip.
    fn rope(x: &[f64], c: &[f64], s: &[f64], style: RopeStyle) -> Vec<f64> {
        let h = c.len() / 2;
        let mut y = x.to_vec();
        for i in 0..h {
            let (a, b) = match style {
                RopeStyle::Half => (i, i + h),
                RopeStyle::Interleaved => (2 * i, 2 * i + 1),
            };
            y[a] = x[a] * c[a] - x[b] * s[a];
            y[b] = x[b] * c[b] + x[a] * s[b];
        }
        y
    }

    #[test]
    fn takes_off_what_rope_puts_on_with_scaled_tables_and_partial_rotary() {
        let (b, hds, t, d, rows, rot) = (2, 3, 7, 10, 5, 6);
        let mut v = 0.37f64;
        let mut next = || {
            v = (v * 9301.0 + 49297.0) % 233280.0;
            v / 233280.0 - 0.5
        };
        for style in [RopeStyle::Half, RopeStyle::Interleaved] {
            for tb in [1, b] {
                let ang: Vec<f64> = (0..tb * rows * rot).map(|_| next() * 400.0).collect();
                let scale: Vec<f64> = (0..tb * rows).map(|_| 1.0 + next()).collect();
                // Channel form: both channels of a pair share the angle.
                let (mut c, mut s) = (vec![0f64; ang.len()], vec![0f64; ang.len()]);
                for r in 0..tb * rows {
                    for i in 0..rot / 2 {
                        let (a, bb) = match style {
                            RopeStyle::Half => (i, i + rot / 2),
                            RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                        };
                        let th = ang[r * rot + i];
                        for ch in [a, bb] {
                            c[r * rot + ch] = th.cos() * scale[r];
                            s[r * rot + ch] = th.sin() * scale[r];
                        }
                    }
                }
                let (cf, sf): (Vec<f32>, Vec<f32>) = (
                    c.iter().map(|&v| v as f32).collect(),
                    s.iter().map(|&v| v as f32).collect(),
                );
                let pre: Vec<f64> = (0..b * hds * t * d).map(|_| next() * 4.0).collect();
                let mut post = vec![0f32; pre.len()];
                for bh in 0..b * hds {
                    let tr = if tb == 1 { 0 } else { bh / hds };
                    for r in 0..t {
                        let row = &pre[(bh * t + r) * d..][..d];
                        let at = (tr * rows + r.min(rows - 1)) * rot;
                        let cc: Vec<f64> = cf[at..at + rot].iter().map(|&v| v as f64).collect();
                        let ss: Vec<f64> = sf[at..at + rot].iter().map(|&v| v as f64).collect();
                        for (o, y) in post[(bh * t + r) * d..][..d]
                            .iter_mut()
                            .zip(rope(row, &cc, &ss, style))
                        {
                            *o = y as f32;
                        }
                    }
                }
                let got =
                    unrope_f32(&post, shape(b, hds, t, d, rows, tb, rot), &cf, &sf, style).unwrap();
                assert_eq!(got.len(), b * hds * rows * d);
                for bh in 0..b * hds {
                    for r in 0..rows {
                        for ch in 0..d {
                            let (g, w) =
                                (got[(bh * rows + r) * d + ch], pre[(bh * t + r) * d + ch]);
                            let p = post[(bh * t + r) * d + ch];
                            if ch >= rot {
                                assert_eq!(g, p);
                            } else {
                                assert!((g as f64 - w).abs() < 1e-5 * 4.0, "{style:?} {g} {w}");
                            }
                        }
                    }
                }
                // bfloat16 rows: the same as their widened float32.
                let bits: Vec<u16> = post.iter().map(|v| (v.to_bits() >> 16) as u16).collect();
                let wide: Vec<f32> = bits
                    .iter()
                    .map(|&v| f32::from_bits((v as u32) << 16))
                    .collect();
                let sh = shape(b, hds, t, d, rows, tb, rot);
                assert_eq!(
                    unrope_bf16(&bits, sh, &cf, &sf, style).unwrap(),
                    unrope_f32(&wide, sh, &cf, &sf, style).unwrap()
                );
            }
        }
    }

    #[test]
    fn refuses_shapes_that_disagree_and_degenerate_tables() {
        let x = vec![1f32; 2 * 3 * 4 * 8];
        let t = vec![0.5f32; 4 * 8];
        let ok = shape(2, 3, 4, 8, 4, 1, 8);
        assert!(unrope_f32(&x, ok, &t, &t, RopeStyle::Half).is_ok());
        // No rows turned, and rows of no width.
        assert_eq!(
            unrope_f32(&x, shape(2, 3, 4, 8, 0, 1, 8), &[], &[], RopeStyle::Half).unwrap(),
            vec![]
        );
        assert_eq!(
            unrope_f32(&[], shape(2, 3, 4, 0, 4, 1, 0), &[], &[], RopeStyle::Half).unwrap(),
            vec![]
        );
        for bad in [
            shape(2, 3, 4, 8, 5, 1, 8), // more rows than held
            shape(2, 3, 4, 8, 4, 3, 8), // a table batch of neither 1 nor 2
            shape(2, 3, 5, 8, 4, 1, 8), // x of another size
            shape(2, 3, 4, 8, 2, 1, 8), // a table of another size
        ] {
            assert!(matches!(
                unrope_f32(&x, bad, &t, &t, RopeStyle::Half),
                Err(crate::Error::InvalidInput(_))
            ));
        }
        for bad in [shape(2, 3, 4, 8, 4, 1, 7), shape(2, 3, 4, 6, 4, 1, 8)] {
            assert!(unrope_f32(&x, bad, &t, &t, RopeStyle::Half).is_err());
        }
        assert!(unrope_f32(&x, ok, &t, &t[1..], RopeStyle::Half).is_err());
        let mut z = t.clone();
        z[3] = 0.0;
        assert!(unrope_f32(&x, ok, &z, &z, RopeStyle::Half).is_err());
        z[3] = f32::NAN;
        assert!(unrope_f32(&x, ok, &t, &z, RopeStyle::Half).is_err());
        let huge = usize::MAX / 2;
        assert!(unrope_f32(&x, shape(huge, 3, 4, 8, 4, 1, 8), &t, &t, RopeStyle::Half).is_err());
    }
}
