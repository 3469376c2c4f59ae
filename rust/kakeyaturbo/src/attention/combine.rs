//! The end of an attention call (`attend.rs`): each (batch row, kv-head)'s parts combined per
//! query row in a fixed order, the code-domain value sums synthesised once per row, and the
//! rows put in place. A unit of work is one (batch row, kv-head) or a range of its query rows
//! (`Ctx::row_units`): every row is computed on its own, so the units change no bit.

use super::attend::AttentionOutput;
use super::math::exp_neg;
use super::part::{Ctx, Part};
use std::ops::Range;

impl Ctx<'_> {
    /// Query rows `rows` of one (batch row, kv-head) from its `parts`: each row's parts
    /// combined, then one synthesis of every row with a code-domain sum (`synthesize_rows`:
    /// the synthesis read once per four rows). Returns the rows' outputs (`rows.len() x
    /// D_out`, 0 for a row that sees no position) and log-sum-exps.
    #[inline(always)]
    fn combine(&self, bh: usize, rows: Range<usize>, parts: &[Part]) -> (Vec<f32>, Vec<f32>) {
        let dv = self.dout;
        let vt = self.value_store(bh).tables();
        let m = vt.m;
        let n = rows.len();
        let mut a = vec![0f32; n * m];
        let mut raw = vec![0f32; n * dv];
        let (mut bigs, mut ls) = (vec![0f32; n], vec![0f32; n]);
        let (mut coded, mut pcs) = (Vec::new(), Vec::new());
        for (k, r) in rows.enumerate() {
            let big = parts.iter().fold(f32::NEG_INFINITY, |x, p| x.max(p.mx[r]));
            let (mut l, mut pc) = (0f32, 0f32);
            let a = &mut a[k * m..(k + 1) * m];
            let raw = &mut raw[k * dv..(k + 1) * dv];
            let mut any_code = false;
            for p in parts {
                if p.mx[r] == f32::NEG_INFINITY {
                    continue;
                }
                let f = exp_neg(p.mx[r] - big);
                l = p.l[r].mul_add(f, l);
                if p.code {
                    any_code = true;
                    pc = p.l[r].mul_add(f, pc);
                    for (x, &y) in a.iter_mut().zip(&p.acc[r * m..(r + 1) * m]) {
                        *x = y.mul_add(f, *x);
                    }
                } else {
                    for (x, &y) in raw.iter_mut().zip(&p.acc[r * dv..(r + 1) * dv]) {
                        *x = y.mul_add(f, *x);
                    }
                }
            }
            (bigs[k], ls[k]) = (big, l);
            if l != 0.0 && any_code {
                coded.push(k);
                pcs.push(pc);
            }
        }
        let mut sums = Vec::with_capacity(coded.len() * m);
        for &k in &coded {
            sums.extend_from_slice(&a[k * m..(k + 1) * m]);
        }
        let mut o = vec![0f32; coded.len() * dv];
        vt.synthesize_rows(&mut sums, &pcs, &mut o);
        let mut out = vec![0f32; n * dv];
        let mut lse = vec![f32::NEG_INFINITY; n];
        let mut c = 0;
        for k in 0..n {
            let l = ls[k];
            if l == 0.0 {
                continue;
            }
            let dst = &mut out[k * dv..(k + 1) * dv];
            let raw = &raw[k * dv..(k + 1) * dv];
            if coded.get(c) == Some(&k) {
                for ((d, &x), &y) in dst.iter_mut().zip(&o[c * dv..(c + 1) * dv]).zip(raw) {
                    *d = (x + y) / l;
                }
                c += 1;
            } else {
                for (d, &y) in dst.iter_mut().zip(raw) {
                    *d = (0.0 + y) / l;
                }
            }
            lse[k] = bigs[k] + l.ln();
        }
        (out, lse)
    }

    /// The combined units ([`Self::combine`]) put in place: `[B, H_q, n_q, D_out]` and
    /// `[B, H_q, n_q]`.
    pub(super) fn scatter(
        &self,
        units: &[(usize, Range<usize>)],
        done: Vec<(Vec<f32>, Vec<f32>)>,
    ) -> AttentionOutput {
        let (dv, n_q) = (self.dout, self.n_q);
        let mut out = vec![0f32; self.batch * self.q_heads * n_q * dv];
        let mut lse = vec![f32::NEG_INFINITY; self.batch * self.q_heads * n_q];
        for ((bh, rows), (o, l)) in units.iter().zip(done) {
            let (b, h) = (bh / self.kv_heads, bh % self.kv_heads);
            for (k, r) in rows.clone().enumerate() {
                let (g, i) = (r / n_q, r % n_q);
                let row = (b * self.q_heads + h * self.group + g) * n_q + i;
                out[row * dv..(row + 1) * dv].copy_from_slice(&o[k * dv..(k + 1) * dv]);
                lse[row] = l[k];
            }
        }
        AttentionOutput { out, lse }
    }
}

// Compiled for FMA where the CPU has it (`mul_add` is otherwise a library call; the result is
// the same).
#[multiversion::multiversion(targets("x86_64+avx512f+avx512bw+avx512vl+fma", "x86_64+avx2+fma"))]
pub(super) fn combine(
    cx: &Ctx<'_>,
    bh: usize,
    rows: Range<usize>,
    parts: &[Part],
) -> (Vec<f32>, Vec<f32>) {
    cx.combine(bh, rows, parts)
}
