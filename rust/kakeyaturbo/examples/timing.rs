use kakeyaturbo::*;
use std::time::Instant;
fn main() {
    let (n, d) = (4096usize, 128usize);
    let mut g = rng::SplitMix64::new(1);
    let x: Vec<f32> = (0..n * d)
        .map(|i| {
            let j = i % d;
            ((g.next_u64() >> 40) as f32 / 16777216.0 - 0.5) * 4.0 / (1.0 + j as f32).sqrt()
        })
        .collect();
    let pk = CodecParams {
        bit_width: 3,
        pca_method: PcaMethod::Randomized {
            target_rank: Some(64),
            oversample: 8,
            power_iters: 2,
        },
        k: 16,
        outlier_threshold: Some(2.0),
        metric: Metric::InnerProduct,
        ..Default::default()
    };
    let pv = CodecParams {
        bit_width: 2,
        share_basis: true,
        ..Default::default()
    };
    for (name, p) in [("K", &pk), ("V", &pv)] {
        for th in [1, 2] {
            let mut best = f64::MAX;
            let mut bd = f64::MAX;
            let mut tt = block::StageTimes::default();
            for _ in 0..5 {
                let t0 = Instant::now();
                let (e, t) = encode_layer(&x, n, d, None, p, Some(th)).unwrap();
                let t1 = Instant::now();
                let _y = decode_layer(&e, Some(th)).unwrap();
                let t2 = Instant::now();
                if (t1 - t0).as_secs_f64() < best {
                    best = (t1 - t0).as_secs_f64();
                    tt = t;
                }
                bd = bd.min((t2 - t1).as_secs_f64());
            }
            println!(
                "{name} threads {th}: encode {:.2} ms (fit {:.2} code {:.2}) decode {:.2} ms",
                best * 1e3,
                tt.fit * 1e3,
                tt.code * 1e3,
                bd * 1e3
            );
        }
    }
}
