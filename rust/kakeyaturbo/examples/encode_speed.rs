// Profiling aid: the calibrated encode (or decode) of one block, repeated.
//
//     cargo run --release -p kakeyaturbo --example encode_speed -- [ROWS] [STREAM] [REPS] [OP]
//
// STREAM: `k` or `v`, the component bits of the default model's `calibrated-3bit` key or value
// calibration (layer 5, kv-head 1: 17 and 64 components of D = 64); norm, mse, outliers above
// 4.5 as that recipe codes; an orthonormal basis, spreads 0.5 * 0.93^j. ROWS (default 128, the
// cache's block) drawn from the calibration's own model. OP: `encode` (the default) or `decode`
// (the container of those rows, parsed and decoded). Prints the median time of one operation
// (`benches/ab_builds.py` reads it).
use kakeyaturbo::calibrated::{CalibratedCodec, CalibratedParams};
use kakeyaturbo::rng::SplitMix64;
use kakeyaturbo::Metric;

fn main() {
    let a: Vec<String> = std::env::args().collect();
    let arg = |i: usize, d: &str| a.get(i).cloned().unwrap_or_else(|| d.to_string());
    let n: usize = arg(1, "128").parse().unwrap();
    let stream = arg(2, "k");
    let reps: usize = arg(3, "2000").parse().unwrap();
    let op = arg(4, "encode");
    let d = 64;
    let bits: Vec<u8> = match stream.as_str() {
        "k" => vec![7, 5, 4, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1],
        "v" => [(7u8, 5usize), (6, 6), (5, 4), (4, 2), (3, 7), (2, 40)]
            .iter()
            .flat_map(|&(b, k)| std::iter::repeat_n(b, k))
            .collect(),
        s => panic!("STREAM is k or v, got {s:?}"),
    };
    let m = bits.len();
    let mut g = SplitMix64::new(3);
    let mut noise = || {
        (0..4)
            .map(|_| (g.next_u64() >> 40) as f32 / 16777216.0 - 0.5)
            .sum::<f32>()
            * 1.7
    };
    // Gram-Schmidt on noise: an orthonormal basis, its first m rows the calibration's.
    let mut basis: Vec<Vec<f32>> = Vec::new();
    while basis.len() < m {
        let mut v: Vec<f32> = (0..d).map(|_| noise()).collect();
        for w in &basis {
            let p: f32 = v.iter().zip(w).map(|(a, b)| a * b).sum();
            v.iter_mut().zip(w).for_each(|(a, b)| *a -= p * b);
        }
        let norm = v.iter().map(|a| a * a).sum::<f32>().sqrt();
        if norm > 1e-3 {
            basis.push(v.iter().map(|a| a / norm).collect());
        }
    }
    let spread: Vec<f32> = (0..m).map(|j| 0.5 * 0.93f32.powi(j as i32)).collect();
    let mean = vec![0.1; d];
    // Rows of the calibration's own model: mean + sum_j spread_j e_j basis_j, e of unit variance.
    let mut x = Vec::with_capacity(n * d);
    for _ in 0..n {
        let mut row = mean.clone();
        for (b, &s) in basis.iter().zip(&spread) {
            let e = noise() * s;
            row.iter_mut().zip(b).for_each(|(v, &w)| *v += e * w);
        }
        x.extend(row);
    }
    let basis = basis.concat();
    let params = CalibratedParams {
        rotation_seed: 0xCAFE_BABE,
        metric: Metric::Mse,
        outlier_threshold: Some(4.5),
        norm: true,
    };
    let c =
        CalibratedCodec::new(d, mean, basis.clone(), basis, spread, bits, vec![], params).unwrap();
    let blob = c.to_bytes(&c.encode(&x, n).unwrap()).0;
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t0 = std::time::Instant::now();
        match op.as_str() {
            "encode" => drop(std::hint::black_box(c.to_bytes(&c.encode(&x, n).unwrap()))),
            "decode" => drop(std::hint::black_box(
                c.decode(&c.from_bytes(&blob).unwrap()),
            )),
            o => panic!("OP is encode or decode, got {o:?}"),
        }
        times.push(t0.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    println!(
        "{stream}: {n} rows of D = {d}, m = {m}: median {:.4} ms (min {:.4}) per {op}, a container of {} bytes",
        times[reps / 2],
        times[0],
        blob.len()
    );
}
