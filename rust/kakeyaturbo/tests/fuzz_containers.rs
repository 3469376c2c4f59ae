//! The container fuzzer, bounded for CI: every corpus container decodes; then proptest-driven
//! mutations of both modes (shrinking to the smallest failing mutation list), then a seeded
//! run of `KAKEYATURBO_FUZZ_INPUTS` random inputs (default 20,000). The long run is
//! `make fuzz` (`examples/fuzz_containers.rs`). One test function: the allocation bound is
//! measured process-wide, so nothing else may run beside it.

#[path = "fuzz/harness.rs"]
mod harness;

use harness::*;
use kakeyaturbo::rng::SplitMix64;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

fn mutation() -> impl Strategy<Value = Mutation> {
    let at = 0usize..4096;
    prop_oneof![
        (at.clone(), 0u8..8).prop_map(|(at, bit)| Mutation::Flip { at, bit }),
        (at.clone(), any::<u8>()).prop_map(|(at, byte)| Mutation::Set { at, byte }),
        (
            at.clone(),
            prop::sample::select(vec![1u8, 2, 4, 8]),
            prop_oneof![prop::sample::select(BOUNDARY.to_vec()), any::<u64>()]
        )
            .prop_map(|(at, width, value)| Mutation::Field { at, width, value }),
        (0usize..4096).prop_map(|len| Mutation::Truncate { len }),
        (at.clone(), prop::collection::vec(any::<u8>(), 1..8))
            .prop_map(|(at, bytes)| Mutation::Insert { at, bytes }),
        (at.clone(), 1usize..16).prop_map(|(at, len)| Mutation::Delete { at, len }),
        (at, 1usize..32).prop_map(|(at, len)| Mutation::Duplicate { at, len }),
    ]
}

#[test]
fn containers_of_both_modes_survive_mutation() {
    let perblock = perblock_corpus();
    let calibrated = calibrated_corpus();
    for b in &perblock {
        assert_eq!(check_perblock(b), Outcome::Decoded);
    }
    for (c, b) in &calibrated {
        assert_eq!(check_calibrated(c, b), Outcome::Decoded);
    }

    let mut runner = TestRunner::new(Config {
        cases: 3000,
        failure_persistence: None,
        ..Config::default()
    });
    let np = perblock.len();
    runner
        .run(
            &(
                0..np,
                prop::collection::vec(mutation(), 1..4),
                any::<bool>(),
            ),
            |(i, muts, crc)| {
                check_perblock(&mutate(&perblock[i], &muts, !crc));
                Ok(())
            },
        )
        .unwrap();
    let nc = calibrated.len();
    runner
        .run(
            &(
                0..nc,
                prop::collection::vec(mutation(), 1..4),
                any::<bool>(),
            ),
            |(i, muts, crc)| {
                let (c, b) = &calibrated[i];
                check_calibrated(c, &mutate(b, &muts, !crc));
                Ok(())
            },
        )
        .unwrap();

    let inputs: u64 = std::env::var("KAKEYATURBO_FUZZ_INPUTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000);
    let mut g = SplitMix64::new(0x5EED);
    let mut tally = Tally::default();
    for _ in 0..inputs {
        tally.add(one(&mut g, &perblock, &calibrated));
    }
    // Both outcomes must occur, or the mutations never reach the decoder.
    assert!(tally.decoded > 0 && tally.refused > 0, "{tally:?}");
}
