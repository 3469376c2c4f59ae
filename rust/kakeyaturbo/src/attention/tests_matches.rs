//! Attention over the codes against the decoded attention: layouts, latent attention,
//! windows, masks, no sealed rows, and every configuration.

use super::reference::check;
use super::*;
use proptest::prelude::*;

#[test]
fn matches_the_decoded_attention() {
    check(&Spec::default());
    check(&Spec {
        norm: false,
        outliers: false,
        ..Spec::default()
    });
    check(&Spec {
        ip: true,
        bmax: 8,
        blocks: vec![512, 3, 700],
        ..Spec::default()
    });
    check(&Spec {
        batch: 2,
        kv_heads: 1,
        group: 8,
        dk: 64,
        dv: 64,
        nq: 4,
        tail: 6,
        mask: true,
        softcap: Some(5.0),
        ..Spec::default()
    });
}

#[test]
fn latent_attention_scores_both_streams_and_sums_the_keys() {
    // DeepSeek-like: one latent row per position (K), a rotated key part (V), many query
    // heads reading it; and two kv-heads with several query tokens, masks and a softcap.
    check(&Spec {
        latent: true,
        kv_heads: 1,
        group: 16,
        dk: 64,
        dv: 16,
        ..Spec::default()
    });
    check(&Spec {
        latent: true,
        batch: 2,
        nq: 3,
        mask: true,
        softcap: Some(4.0),
        window: Some(150),
        ip: true,
        blocks: vec![64, 200, 5],
        ..Spec::default()
    });
    // The rotated part alone moves the result: zero queries for it give other scores.
    let c = build(&Spec {
        latent: true,
        ..Spec::default()
    });
    let got = run(&c, Isa::Portable).unwrap();
    let mut q = c.q.clone();
    let dq = c.dk + c.dv;
    for row in q.chunks_exact_mut(dq) {
        row[c.dk..].fill(0.0);
    }
    let other = Case { q, ..c };
    let diff = run(&other, Isa::Portable).unwrap();
    assert_ne!(got.lse, diff.lse);
    assert_eq!(got.out.len(), c_rows(&other) * other.dk);
    // A key rotation with latent attention is a typed error.
    let mut r = build(&Spec {
        rope: Some((16, false)),
        ..Spec::default()
    });
    r.params.latent = true;
    r.q = vec![0.5f32; c_rows(&r) * (r.dk + r.dv)];
    let e = run(&r, Isa::Portable);
    assert!(matches!(e, Err(crate::Error::InvalidParameter(_))), "{e:?}");
}

/// Query rows of a case (`B x H_q x n_q`).
fn c_rows(c: &Case) -> usize {
    c.codes.batch() * c.hq * c.nq
}

#[test]
fn no_sealed_rows_windows_and_masks() {
    check(&Spec {
        blocks: vec![],
        sink: 0,
        ..Spec::default()
    });
    check(&Spec {
        blocks: vec![300, 300],
        window: Some(40),
        nq: 3,
        ..Spec::default()
    });
    check(&Spec {
        blocks: vec![300, 300],
        window: Some(350),
        mask: true,
        ..Spec::default()
    });
    // A query that sees nothing has output 0 and lse -inf.
    let mut c = build(&Spec {
        mask: true,
        ..Spec::default()
    });
    c.mask.as_mut().unwrap().fill(f32::NEG_INFINITY);
    let o = run(&c, Isa::best()).unwrap();
    assert!(o.out.iter().all(|&x| x == 0.0));
    assert!(o.lse.iter().all(|&x| x == f32::NEG_INFINITY));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(40))]
    #[test]
    fn every_configuration_matches(
        seed in any::<u64>(), batch in 1usize..3, kv_heads in 1usize..3, group in 1usize..9,
        dk in 1usize..80, dv in 1usize..80,
        blocks in proptest::collection::vec(1usize..300, 0..4), sink in 0usize..4,
        extra in 0usize..70, nq in 1usize..5, norm in any::<bool>(), ip in any::<bool>(),
        outliers in any::<bool>(), bmax in 1u8..=8, cap in any::<bool>(),
        window in proptest::option::of(1usize..400), mask in any::<bool>(),
        rope in proptest::option::of((2usize..80, any::<bool>())), synthesis in 0u8..3,
        latent in any::<bool>(),
    ) {
        check(&Spec {
            seed, batch, kv_heads, group, dk, dv, blocks, sink, tail: nq + extra, nq, norm, ip,
            outliers, bmax, softcap: cap.then_some(3.0), window, mask,
            rope: rope.filter(|_| dk >= 2 && !latent),
            synthesis: [Synthesis::Bf16, Synthesis::F32, Synthesis::I16][synthesis as usize],
            latent,
        });
    }
}
