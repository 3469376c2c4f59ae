// Profiling aid: stages 2-5 encode and the decode of one 512 x 128 block, repeated.
use kakeyaturbo::perblock::{block, decode};
use kakeyaturbo::*;
fn main() {
    let (n, d) = (512usize, 128usize);
    let mut g = rng::SplitMix64::new(1);
    let x: Vec<f32> = (0..n * d)
        .map(|i| {
            let j = i % d;
            ((g.next_u64() >> 40) as f32 / 16777216.0 - 0.5) * 4.0 * 0.97f32.powi(j as i32)
        })
        .collect();
    let p = CodecParams {
        bit_width: 3,
        pca_method: PcaMethod::Randomized {
            target_rank: Some(64),
            oversample: 8,
            power_iters: 2,
        },
        outlier_threshold: Some(2.0),
        metric: Metric::InnerProduct,
        ..Default::default()
    };
    let q = p.validate().unwrap();
    let (s, c, _) = block::encode_block(&x, d, None, &p, &q, 0, None).unwrap();
    let rot = block::Rotation::new(p.rotation_seed, s.d_eff);
    let mode = std::env::args().nth(1).unwrap_or_default();
    let t0 = std::time::Instant::now();
    let mut out = vec![0f32; n * d];
    for _ in 0..2000 {
        if mode == "decode" {
            decode::decode_block(&s, &c, 3, &q, &rot, &mut out).unwrap();
        } else {
            std::hint::black_box(block::encode_with_skeleton(&x, &s, &p, &q));
        }
    }
    println!(
        "{mode} {:.3} us/vector (d_eff {})",
        t0.elapsed().as_secs_f64() / 2000.0 / n as f64 * 1e6,
        s.d_eff
    );
}
