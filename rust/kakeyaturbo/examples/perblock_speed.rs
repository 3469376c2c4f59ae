// Profiling aid: the per-block encode (or decode) of one container of one block, repeated.
//
//     cargo run --release -p kakeyaturbo --example perblock_speed -- [ROWS] [STREAM] [REPS] [OP]
//
// STREAM: `k` or `v`, the `balanced` recipe's key or value parameters (4 bits, full rank,
// `inner_product` for keys, `mse` for values, 16 centres), one block of ROWS rows (default
// 128, the cache's block) of D = 64: noise of spread 0.93^j along channel j, plus 0.1. OP:
// `encode` (the default) or `decode` (the container of those rows, parsed and decoded). Prints
// the median time of one operation (`benches/ab_builds.py` reads it).
use kakeyaturbo::perblock::params::Metric;
use kakeyaturbo::rng::SplitMix64;
use kakeyaturbo::{decode_layer, encode_layer, from_bytes, to_bytes, CodecParams};

fn main() {
    let a: Vec<String> = std::env::args().collect();
    let arg = |i: usize, d: &str| a.get(i).cloned().unwrap_or_else(|| d.to_string());
    let n: usize = arg(1, "128").parse().unwrap();
    let stream = arg(2, "k");
    let reps: usize = arg(3, "2000").parse().unwrap();
    let op = arg(4, "encode");
    let d = 64;
    let metric = match stream.as_str() {
        "k" => Metric::InnerProduct,
        "v" => Metric::Mse,
        s => panic!("STREAM is k or v, got {s:?}"),
    };
    let p = CodecParams {
        metric,
        bit_width: 4,
        variance_ratio: 1.0,
        share_basis: true,
        block_size: n,
        ..Default::default()
    };
    let mut g = SplitMix64::new(3);
    let x: Vec<f32> = (0..n * d)
        .map(|i| {
            let e = (0..4)
                .map(|_| (g.next_u64() >> 40) as f32 / 16777216.0 - 0.5)
                .sum::<f32>()
                * 1.7;
            0.1 + e * 0.93f32.powi((i % d) as i32)
        })
        .collect();
    let code = || to_bytes(&encode_layer(&x, n, d, None, &p, Some(1)).unwrap().0).0;
    let blob = code();
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t0 = std::time::Instant::now();
        match op.as_str() {
            "encode" => drop(std::hint::black_box(code())),
            "decode" => drop(std::hint::black_box(decode_layer(
                &from_bytes(&blob).unwrap(),
                Some(1),
            ))),
            o => panic!("OP is encode or decode, got {o:?}"),
        }
        times.push(t0.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    println!(
        "{stream}: {n} rows of D = {d}, balanced: median {:.4} ms (min {:.4}) per {op}, a container of {} bytes",
        times[reps / 2],
        times[0],
        blob.len()
    );
}
