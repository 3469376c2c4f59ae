//! The scale rule of stage 4, shared by both modes: which per-row scale is stored. Every
//! metric decodes with its stored scale; they differ only in which scale is stored.

/// How the per-vector scale of the rotated residual (per-block) or of a row's coefficients
/// (calibrated) is chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Metric {
    /// Scale = |r|, the residual norm (coordinates of `z` have unit second moment).
    Mse,
    /// Scale = the least-squares gain `|r| <z, q> / <q, q>` between the scaled residual `z` and
    /// its dequantised value `q`: it minimises |r - r_hat|^2 per vector, hence the expected
    /// squared error of `q . k` for any isotropic query distribution.
    InnerProduct,
    /// An alias of `Mse`: no scale choice was found that measurably lowers the maximum absolute
    /// error of the decoded vectors (see README, "Metrics").
    Linf,
}

impl Metric {
    pub fn code(self) -> u8 {
        match self {
            Metric::Mse => 0,
            Metric::InnerProduct => 1,
            Metric::Linf => 2,
        }
    }
    pub fn from_code(c: u8) -> Option<Self> {
        Some(match c {
            0 => Metric::Mse,
            1 => Metric::InnerProduct,
            2 => Metric::Linf,
            _ => return None,
        })
    }
    pub fn name(self) -> &'static str {
        match self {
            Metric::Mse => "mse",
            Metric::InnerProduct => "inner_product",
            Metric::Linf => "linf",
        }
    }
}

/// Dot product in f32 with 8 interleaved partial sums (lane `j mod 8`), added pairwise at the
/// end: a fixed order that vectorises.
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    for (l, (x, y)) in ra.iter().zip(rb).enumerate() {
        acc[l] += x * y;
    }
    let s4 = [
        acc[0] + acc[4],
        acc[1] + acc[5],
        acc[2] + acc[6],
        acc[3] + acc[7],
    ];
    (s4[0] + s4[2]) + (s4[1] + s4[3])
}

/// The `inner_product` scale: `scale * <z, q> / <q, q>` (`scale` when `q = 0`), the gain that
/// makes `scale_stored * q` the least-squares fit of `scale * z`.
#[inline(always)]
pub fn least_squares_gain(scale: f32, z: &[f32], q: &[f32]) -> f32 {
    let qq = dot(q, q);
    if qq > 0.0 {
        scale * (dot(z, q) / qq)
    } else {
        scale
    }
}
