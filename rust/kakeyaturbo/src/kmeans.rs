//! Stage 1b: spherical k-means on unit directions, sign-aware (a direction and its negative
//! belong to the same centre, since stage 3 stores a signed `t`).

use crate::gemm::matmul;
use faer::{Accum, MatRef, Par};

/// Directions whose |cos| to an existing centre is at least this are treated as already
/// covered by the farthest-first init, which then stops early instead of duplicating a centre.
const DUPLICATE_COS: f32 = 1.0 - 1e-6;

/// Index of the largest |g|, ties to the lowest index.
#[inline]
pub fn argmax_abs(g: &[f32]) -> usize {
    let mut best = 0;
    let mut best_v = f32::NEG_INFINITY;
    for (c, &v) in g.iter().enumerate() {
        if v.abs() > best_v {
            best_v = v.abs();
            best = c;
        }
    }
    best
}

/// `out[i, c] = <rows[i], centres[c]>` for row-major `rows` (`n x d`) and `centres` (`k x d`).
pub fn dots(rows: &[f32], centres: &[f32], d: usize, out: &mut [f32]) {
    let n = rows.len() / d;
    let k = centres.len() / d;
    let a = MatRef::from_row_major_slice(rows, n, d);
    let b = MatRef::from_row_major_slice(centres, k, d);
    let dst = faer::MatMut::from_row_major_slice_mut(out, n, k);
    matmul(dst, Accum::Replace, a, b.transpose(), 1.0, Par::Seq);
}

/// Fits up to `k` unit centres (`k_eff x d`, row-major) to the rows `c` (`n x d`).
///
/// Rows with zero norm or zero weight do not take part. Init: the usable row of largest
/// `w_i |c_i|` first, then repeatedly the usable row whose largest |cos| to the chosen centres
/// is smallest (ties to the lowest index). Lloyd: assign by largest |cos|, update each centre
/// to the normalised `sum w_i sign(<dir_i, centre>) dir_i`; an empty centre keeps its value.
/// Stops when no assignment changes or after `max_iter` updates.
pub fn fit(c: &[f32], d: usize, w: &[f64], k: usize, max_iter: u32) -> Vec<f32> {
    let n = c.len() / d;
    let mut usable = Vec::new();
    let mut dirs = Vec::new();
    let mut strength = Vec::new();
    for i in 0..n {
        let row = &c[i * d..(i + 1) * d];
        let norm = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>().sqrt();
        if norm > 0.0 && w[i] > 0.0 {
            usable.push(i);
            dirs.extend(row.iter().map(|&v| (v as f64 / norm) as f32));
            strength.push(w[i] * norm);
        }
    }
    let m = usable.len();
    if m == 0 {
        // Nothing to fit: one axis-aligned centre keeps the format uniform.
        let mut e = vec![0f32; d];
        e[0] = 1.0;
        return e;
    }
    let k = k.min(m).max(1);

    // Farthest-first init by |cos|.
    let first = (0..m).fold(0, |b, i| if strength[i] > strength[b] { i } else { b });
    let mut centres: Vec<f32> = dirs[first * d..(first + 1) * d].to_vec();
    let mut closest = vec![0f32; m];
    let mut g = vec![0f32; m];
    dots(&dirs, &centres[..d], d, &mut g);
    for i in 0..m {
        closest[i] = g[i].abs();
    }
    while centres.len() / d < k {
        let far = (0..m).fold(0, |b, i| if closest[i] < closest[b] { i } else { b });
        if closest[far] >= DUPLICATE_COS {
            break;
        }
        let new = dirs[far * d..(far + 1) * d].to_vec();
        dots(&dirs, &new, d, &mut g);
        for i in 0..m {
            closest[i] = closest[i].max(g[i].abs());
        }
        centres.extend(new);
    }
    let k = centres.len() / d;

    // Lloyd iterations.
    let mut assign = vec![usize::MAX; m];
    let mut gm = vec![0f32; m * k];
    let mut sums = vec![0f64; k * d];
    for _ in 0..max_iter {
        dots(&dirs, &centres, d, &mut gm);
        let mut changed = false;
        for i in 0..m {
            let a = argmax_abs(&gm[i * k..(i + 1) * k]);
            if a != assign[i] {
                assign[i] = a;
                changed = true;
            }
        }
        if !changed {
            break;
        }
        sums.fill(0.0);
        for i in 0..m {
            let a = assign[i];
            let s = if gm[i * k + a] < 0.0 { -1.0 } else { 1.0 };
            let wi = w[usable[i]] * s;
            for (acc, &v) in sums[a * d..(a + 1) * d]
                .iter_mut()
                .zip(&dirs[i * d..(i + 1) * d])
            {
                *acc += wi * v as f64;
            }
        }
        for (centre, sum) in centres.chunks_exact_mut(d).zip(sums.chunks_exact(d)) {
            let norm = sum.iter().map(|v| v * v).sum::<f64>().sqrt();
            if norm > 0.0 {
                for (c, &v) in centre.iter_mut().zip(sum) {
                    *c = (v / norm) as f32;
                }
            }
        }
    }
    centres
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::SplitMix64;
    use proptest::prelude::*;

    #[test]
    fn antipodal_rows_share_a_centre() {
        // Two clusters along +-x and +-y: the sign-aware update keeps one centre each.
        let c = [1.0f32, 0.01, -1.0, 0.0, 2.0, -0.02, 0.0, 1.0, 0.01, -3.0];
        let w = vec![1.0; 5];
        let centres = fit(&c, 2, &w, 2, 10);
        assert_eq!(centres.len(), 4);
        let mut g = vec![0f32; 10];
        dots(&c, &centres, 2, &mut g);
        let a: Vec<usize> = (0..5).map(|i| argmax_abs(&g[i * 2..i * 2 + 2])).collect();
        assert_eq!(a[0], a[1]);
        assert_eq!(a[0], a[2]);
        assert_eq!(a[3], a[4]);
        assert_ne!(a[0], a[3]);
    }

    #[test]
    fn init_does_not_spend_centres_on_antipodes() {
        // Signed-cosine farthest-first would pick -x as the second centre; |cos| picks y.
        let c = [1.0f32, 0.0, -1.0, 0.0, 0.0, 0.5];
        let centres = fit(&c, 2, &[1.0; 3], 2, 0);
        assert_eq!(centres, vec![1.0, 0.0, 0.0, 1.0]);
    }

    #[test]
    fn degenerate_inputs() {
        assert_eq!(
            fit(&[0.0, 0.0, 0.0, 0.0], 2, &[1.0, 1.0], 4, 5),
            vec![1.0, 0.0]
        );
        // All rows along one direction: one centre, no duplicates.
        let c = [1.0f32, 1.0, 2.0, 2.0, -3.0, -3.0];
        assert_eq!(fit(&c, 2, &[1.0; 3], 3, 5).len(), 2);
    }

    proptest! {
        #[test]
        fn centres_are_unit_and_bounded(seed in any::<u64>(), n in 1usize..60, d in 1usize..9, k in 1usize..20) {
            let mut g = SplitMix64::new(seed);
            let c: Vec<f32> = (0..n * d).map(|_| (g.next_u64() >> 40) as f32 / 16777216.0 - 0.5).collect();
            let centres = fit(&c, d, &vec![1.0; n], k, 8);
            let kk = centres.len() / d;
            prop_assert!(kk >= 1 && kk <= k.min(n));
            for a in 0..kk {
                let nrm: f32 = centres[a * d..(a + 1) * d].iter().map(|v| v * v).sum::<f32>().sqrt();
                prop_assert!((nrm - 1.0).abs() < 1e-4);
            }
        }
    }
}
