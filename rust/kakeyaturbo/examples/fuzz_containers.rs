//! The long run of the container fuzzer (`make fuzz`):
//!
//!     cargo run --release -p kakeyaturbo --example fuzz_containers -- [INPUTS] [SEED] [--corpus DIR]
//!
//! INPUTS random inputs (default 1,000,000) from SEED (default 1): valid containers of both
//! modes, mutated, the CRC-32 recomputed 15 times in 16 (see `tests/fuzz/harness.rs`). Prints
//! the count, the outcomes and the wall time; a broken guarantee prints the seed and input
//! number and exits with status 1. `--corpus DIR` first writes the valid containers as seeds
//! for the libFuzzer targets of `fuzz/` (`DIR/perblock_reader`, `DIR/calibrated_reader`).

#[path = "../tests/fuzz/harness.rs"]
mod harness;

use harness::*;
use kakeyaturbo::rng::SplitMix64;
use std::time::Instant;

fn main() {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let corpus = args.iter().position(|a| a == "--corpus").map(|i| {
        let dir = args.get(i + 1).expect("--corpus DIR").clone();
        args.drain(i..i + 2);
        dir
    });
    let inputs: u64 = args
        .first()
        .map_or(1_000_000, |a| a.parse().expect("INPUTS"));
    let seed: u64 = args.get(1).map_or(1, |a| a.parse().expect("SEED"));
    let perblock = perblock_corpus();
    let calibrated = calibrated_corpus();
    if let Some(dir) = corpus {
        write_corpus(&dir, &perblock, &calibrated).expect("writing the corpus");
    }
    let t0 = Instant::now();
    let mut g = SplitMix64::new(seed);
    let mut tally = Tally::default();
    std::panic::set_hook(Box::new(|info| eprintln!("{info}")));
    for i in 0..inputs {
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            one(&mut g, &perblock, &calibrated)
        })) {
            Ok(o) => tally.add(o),
            Err(_) => {
                eprintln!("guarantee broken at input {i} of seed {seed}");
                std::process::exit(1);
            }
        }
        if (i + 1) % 100_000 == 0 {
            eprintln!("{} inputs, {:.1} s", i + 1, t0.elapsed().as_secs_f64());
        }
    }
    println!(
        "{} inputs (seed {seed}): {} refused with a typed error, {} decoded to finite values, \
         0 panics, 0 aborts, largest allocation within bound; {:.1} s",
        tally.inputs,
        tally.refused,
        tally.decoded,
        t0.elapsed().as_secs_f64()
    );
}

/// The valid containers as libFuzzer seeds; a calibrated seed starts with the index of its
/// calibration in `calibrated_codecs()`.
fn write_corpus(
    dir: &str,
    perblock: &[Vec<u8>],
    calibrated: &[(kakeyaturbo::CalibratedCodec, Vec<u8>)],
) -> std::io::Result<()> {
    let p = std::path::Path::new(dir);
    std::fs::create_dir_all(p.join("perblock_reader"))?;
    std::fs::create_dir_all(p.join("calibrated_reader"))?;
    for (i, b) in perblock.iter().enumerate() {
        std::fs::write(p.join("perblock_reader").join(format!("seed{i}")), b)?;
    }
    let codecs = calibrated_codecs();
    for (i, (c, b)) in calibrated.iter().enumerate() {
        let k = codecs
            .iter()
            .position(|x| x.fingerprint() == c.fingerprint())
            .expect("a corpus calibration") as u8;
        let mut seed = vec![k];
        seed.extend_from_slice(b);
        std::fs::write(p.join("calibrated_reader").join(format!("seed{i}")), seed)?;
    }
    Ok(())
}
