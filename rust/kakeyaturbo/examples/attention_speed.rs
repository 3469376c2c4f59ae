// Profiling aid: one decode step of attention over the codes of a layer, repeated.
//
//     cargo run --release -p kakeyaturbo --example attention_speed -- [T] [HQ] [HKV] [D] [BITS] [ISA] [REPS] [ROPE] [SYNTHESIS]
//
// ISA: best, portable or avx2; ROPE: `rope` reads the keys as coded before RoPE (base 10000,
// all channels: the shipped recipes' path), anything else after it; SYNTHESIS (of keys coded
// before RoPE): bf16 (the default), f32 or i16.
//
// Calibrations: an orthonormal basis, spreads 0.93^j, bits given greedily to the component
// with the largest remaining variance (water-filling) for BITS per element with the fp16
// scale counted; blocks of 512 rows of the calibrations' own model.
use kakeyaturbo::attention::{
    attend_with, AttentionParams, Isa, KeyRope, LayerCodes, RawRows, RopeStyle, StreamTables,
    Synthesis,
};
use kakeyaturbo::calibrated::{CalibratedCodec, CalibratedParams};
use kakeyaturbo::rng::SplitMix64;
use kakeyaturbo::Metric;
use std::sync::Arc;

fn noise(g: &mut SplitMix64) -> f32 {
    (0..4)
        .map(|_| (g.next_u64() >> 40) as f32 / 16777216.0 - 0.5)
        .sum::<f32>()
        * 1.7
}

fn calibration(d: usize, bits_per_elem: f64, seed: u64) -> CalibratedCodec {
    let mut g = SplitMix64::new(seed);
    // Gram-Schmidt on noise: an orthonormal basis.
    let mut u: Vec<Vec<f64>> = Vec::new();
    while u.len() < d {
        let mut v: Vec<f64> = (0..d).map(|_| noise(&mut g) as f64).collect();
        for w in &u {
            let p: f64 = v.iter().zip(w).map(|(a, b)| a * b).sum();
            v.iter_mut().zip(w).for_each(|(a, b)| *a -= p * b);
        }
        let n = v.iter().map(|a| a * a).sum::<f64>().sqrt();
        if n > 1e-6 {
            u.push(v.iter().map(|a| a / n).collect());
        }
    }
    let lam: Vec<f64> = (0..d).map(|j| 0.93f64.powi(j as i32)).collect();
    let budget = (bits_per_elem * d as f64 - 16.0).round() as usize;
    let mut bits = vec![0u8; d];
    for _ in 0..budget {
        let j = (0..d)
            .filter(|&j| bits[j] < 8)
            .max_by(|&a, &b| {
                (lam[a] / 4f64.powi(bits[a] as i32))
                    .total_cmp(&(lam[b] / 4f64.powi(bits[b] as i32)))
            })
            .unwrap();
        bits[j] += 1;
    }
    let m = bits.iter().filter(|&&b| b > 0).count();
    let basis: Vec<f32> = u[..m].concat().iter().map(|&v| v as f32).collect();
    CalibratedCodec::new(
        d,
        vec![0.1; d],
        basis.clone(),
        basis,
        lam[..m].iter().map(|v| v.sqrt() as f32).collect(),
        bits[..m].to_vec(),
        vec![],
        CalibratedParams {
            rotation_seed: seed,
            metric: Metric::Mse,
            outlier_threshold: None,
            norm: true,
        },
    )
    .unwrap()
}

fn main() {
    let a: Vec<String> = std::env::args().collect();
    let arg = |i: usize, d: &str| a.get(i).cloned().unwrap_or_else(|| d.to_string());
    let t: usize = arg(1, "32768").parse().unwrap();
    let hq: usize = arg(2, "9").parse().unwrap();
    let hkv: usize = arg(3, "3").parse().unwrap();
    let d: usize = arg(4, "64").parse().unwrap();
    let bpe: f64 = arg(5, "4").parse().unwrap();
    let isa = match arg(6, "best").as_str() {
        "portable" => Isa::Portable,
        "avx2" => Isa::Avx2,
        _ => Isa::best(),
    };
    let reps: usize = arg(7, "20").parse().unwrap();
    let pre_rope = arg(8, "") == "rope";
    let synthesis = match arg(9, "bf16").as_str() {
        "f32" => Synthesis::F32,
        "i16" => Synthesis::I16,
        _ => Synthesis::Bf16,
    };
    let cals: Vec<CalibratedCodec> = (0..2 * hkv)
        .map(|i| calibration(d, bpe, 11 + i as u64))
        .collect();
    let tabs: Vec<Arc<StreamTables>> = cals
        .iter()
        .map(|c| Arc::new(StreamTables::new(c)))
        .collect();
    let mut codes = LayerCodes::new(tabs[..hkv].to_vec(), tabs[hkv..].to_vec(), 1).unwrap();
    let mut g = SplitMix64::new(5);
    let mut bytes = 0usize;
    for h in 0..hkv {
        for _ in 0..t / 512 {
            let mut blobs = Vec::new();
            for c in [&cals[h], &cals[hkv + h]] {
                let mut x = vec![0f32; 512 * d];
                for row in x.chunks_exact_mut(d) {
                    for j in 0..c.m {
                        let e = noise(&mut g) * c.spread[j];
                        row.iter_mut()
                            .zip(&c.analysis[j * d..])
                            .for_each(|(v, &b)| *v += e * b);
                    }
                }
                blobs.push(c.to_bytes(&c.encode(&x, 512).unwrap()).0);
            }
            bytes += blobs[0].len() + blobs[1].len();
            let v = blobs.pop().unwrap();
            codes.append(0, h, blobs.pop().unwrap(), v).unwrap();
        }
    }
    let q: Vec<f32> = (0..hq * d).map(|_| noise(&mut g)).collect();
    let tail: Vec<f32> = (0..hkv * d).map(|_| noise(&mut g)).collect();
    let p = AttentionParams {
        scale: 1.0 / (d as f32).sqrt(),
        softcap: None,
        window: None,
        latent: false,
    };
    // cos and sin of positions 0 .. T, frequency-major; positions of the sealed rows per batch row.
    let (half, n_pos) = (d / 2, t + 1);
    let ang = |i: usize, p: usize| p as f64 * 10000f64.powf(-2.0 * i as f64 / d as f64);
    let cos: Vec<f32> = (0..half * n_pos)
        .map(|k| ang(k / n_pos, k % n_pos).cos() as f32)
        .collect();
    let sin: Vec<f32> = (0..half * n_pos)
        .map(|k| ang(k / n_pos, k % n_pos).sin() as f32)
        .collect();
    let positions: Vec<u32> = (0..t as u32).collect();
    let rope = KeyRope {
        cos: &cos,
        sin: &sin,
        rot: d,
        style: RopeStyle::Half,
        positions: &positions,
        synthesis,
    };
    let rope = pre_rope.then_some(&rope);
    let run = || {
        attend_with(
            isa,
            &codes,
            &q,
            hq,
            1,
            RawRows::EMPTY,
            RawRows {
                k: &tail,
                v: &tail,
                rows: 1,
            },
            None,
            &p,
            rope,
        )
        .unwrap()
    };
    run();
    // CPU time of this process (all threads), from /proc: robust to other processes sharing
    // the cores, unlike wall time.
    // With RAYON_NUM_THREADS=1 the loop runs on the pool's one thread (`install`), so that
    // thread's CPU time is the kernel's: robust to other processes sharing the cores.
    let cpu = || -> f64 { thread_cpu_ms() };
    let pool = rayon::ThreadPoolBuilder::new().build().unwrap();
    let (mut times, mut cpus) = pool.install(|| {
        let mut times = Vec::new();
        let mut cpus = Vec::new();
        // KT_PAUSE_MS: sleep before each call (the pool's threads fall asleep, as between the
        // layers of a model).
        let pause: u64 = std::env::var("KT_PAUSE_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        for _ in 0..reps {
            std::thread::sleep(std::time::Duration::from_millis(pause));
            let (t0, c0) = (std::time::Instant::now(), cpu());
            std::hint::black_box(run());
            times.push(t0.elapsed().as_secs_f64() * 1e3);
            cpus.push(cpu() - c0);
        }
        (times, cpus)
    });
    times.sort_by(f64::total_cmp);
    cpus.sort_by(f64::total_cmp);
    println!(
        "T={t} Hq={hq} Hkv={hkv} D={d} bits={bpe} m={} isa={isa:?} pre-RoPE={pre_rope} synthesis={synthesis:?} threads={}: median {:.3} ms \
         (min {:.3}, cpu median {:.3}), {:.2} bits/elem held, {:.1} ns/row/kv-head",
        cals[0].m,
        rayon::current_num_threads(),
        times[reps / 2],
        times[0],
        cpus[reps / 2],
        8.0 * bytes as f64 / (2 * t * hkv * d) as f64,
        times[reps / 2] * 1e6 / (t * hkv) as f64
    );
}

/// CPU time of the calling thread in ms (clock_gettime(CLOCK_THREAD_CPUTIME_ID); Linux x86_64).
fn thread_cpu_ms() -> f64 {
    #[cfg(all(target_os = "linux", target_arch = "x86_64"))]
    {
        let mut ts = [0i64; 2];
        // SAFETY: the clock_gettime system call (228) writes a timespec into `ts`.
        unsafe {
            std::arch::asm!("syscall", inlateout("rax") 228i64 => _, in("rdi") 3i64,
                            in("rsi") ts.as_mut_ptr(), lateout("rcx") _, lateout("r11") _);
        }
        ts[0] as f64 * 1e3 + ts[1] as f64 / 1e6
    }
    #[cfg(not(all(target_os = "linux", target_arch = "x86_64")))]
    0.0
}
