// Times the covariance product and the symmetric eigendecomposition of the codec (block
// shapes 512 x 128, 512 x 64 and a share_basis layer of 4096 x 128) in faer and nalgebra.
use std::time::Instant;
fn main() {
    for &(n, d) in &[(512usize, 128usize), (512, 64), (4096, 128)] {
        let x: Vec<f64> = (0..n * d).map(|i| (((i * 2654435761) % 1000) as f64) / 1000.0 - 0.5).collect();
        let reps = 20;
        // faer
        let xf = faer::MatRef::from_row_major_slice(&x, n, d);
        let t0 = Instant::now();
        let mut cov = faer::Mat::<f64>::zeros(d, d);
        for _ in 0..reps { faer::linalg::matmul::matmul(cov.as_mut(), faer::Accum::Replace, xf.transpose(), xf, 1.0, faer::Par::Seq); }
        let f_cov = t0.elapsed().as_secs_f64() / reps as f64 * 1e3;
        let t0 = Instant::now();
        for _ in 0..reps { let _ = cov.self_adjoint_eigen(faer::Side::Lower).unwrap(); }
        let f_eig = t0.elapsed().as_secs_f64() / reps as f64 * 1e3;
        // nalgebra
        let xn = nalgebra::DMatrix::<f64>::from_row_slice(n, d, &x);
        let t0 = Instant::now();
        let mut c = nalgebra::DMatrix::<f64>::zeros(d, d);
        for _ in 0..reps { c = xn.transpose() * &xn; }
        let n_cov = t0.elapsed().as_secs_f64() / reps as f64 * 1e3;
        let t0 = Instant::now();
        for _ in 0..reps { let _ = nalgebra::SymmetricEigen::new(c.clone()); }
        let n_eig = t0.elapsed().as_secs_f64() / reps as f64 * 1e3;
        println!("{n}x{d}: covariance faer {f_cov:.3} ms nalgebra {n_cov:.3} ms | symmetric eigen faer {f_eig:.3} ms nalgebra {n_eig:.3} ms");
    }
}
