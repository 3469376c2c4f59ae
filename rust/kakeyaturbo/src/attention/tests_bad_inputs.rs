//! Bad inputs and damaged containers: typed errors, never a panic.

use super::*;
use proptest::prelude::*;

#[test]
fn bad_inputs_are_typed_errors() {
    let c = build(&Spec::default());
    let call = |q: &[f32],
                hq: usize,
                nq: usize,
                tail_rows: usize,
                mask: Option<&[f32]>,
                p: AttentionParams| {
        attend(
            &c.codes,
            q,
            hq,
            nq,
            RawRows {
                k: &c.sink.0,
                v: &c.sink.1,
                rows: c.sink.2,
            },
            RawRows {
                k: &c.tail.0,
                v: &c.tail.1,
                rows: tail_rows,
            },
            mask,
            &p,
            None,
        )
    };
    let p = c.params;
    assert!(call(&c.q, c.hq, 1, 9, None, p).is_ok());
    assert!(call(&c.q[1..], c.hq, 1, 9, None, p).is_err());
    assert!(call(&c.q, 5, 1, 9, None, p).is_err());
    assert!(call(&c.q, c.hq, 0, 9, None, p).is_err());
    assert!(call(&c.q, c.hq, 1, 8, None, p).is_err());
    let mut nan = c.q.clone();
    nan[3] = f32::NAN;
    assert!(call(&nan, c.hq, 1, 9, None, p).is_err());
    let t = 2 + 164 + 9;
    let mut m = vec![0f32; t];
    assert!(call(&c.q, c.hq, 1, 9, Some(&m), p).is_ok());
    assert!(call(&c.q, c.hq, 1, 9, Some(&m[1..]), p).is_err());
    m[4] = f32::INFINITY;
    assert!(call(&c.q, c.hq, 1, 9, Some(&m), p).is_err());
    for bad in [
        AttentionParams {
            scale: f32::NAN,
            ..p
        },
        AttentionParams {
            softcap: Some(0.0),
            ..p
        },
        AttentionParams {
            window: Some(0),
            ..p
        },
    ] {
        assert!(call(&c.q, c.hq, 1, 9, None, bad).is_err());
    }
    // Finite queries whose scores overflow float32: a typed error, not NaN.
    let top = c.q.iter().fold(0f32, |a, v| a.max(v.abs()));
    let huge: Vec<f32> = c.q.iter().map(|v| v / top * 3e38).collect();
    assert!(matches!(
        call(&huge, c.hq, 1, 9, None, p),
        Err(crate::Error::Numerical(_))
    ));
    // Sealed rows that differ across the layer.
    let mut uneven = c.codes.clone();
    uneven.select(&[0]).unwrap();
    let (ks, vs) = uneven.stores(0, 1).unwrap();
    let (kb, vb) = (
        ks.blocks()[0].bytes().to_vec(),
        vs.blocks()[0].bytes().to_vec(),
    );
    uneven.append(0, 1, kb, vb).unwrap();
    let e = attend(
        &uneven,
        &c.q,
        c.hq,
        1,
        RawRows {
            k: &c.sink.0,
            v: &c.sink.1,
            rows: 2,
        },
        RawRows {
            k: &c.tail.0,
            v: &c.tail.1,
            rows: 9,
        },
        None,
        &p,
        None,
    );
    assert!(matches!(e, Err(crate::Error::InvalidInput(_))));
}

/// A container with `edits` (position, xor) applied and its checksum recomputed, so that the
/// structure checks, not the checksum, meet the damage.
fn mutated(blob: &[u8], edits: &[(usize, u8)]) -> Vec<u8> {
    let mut b = blob.to_vec();
    let body = b.len() - 4;
    for &(at, x) in edits {
        b[at % body] ^= x;
    }
    let crc = crc32fast::hash(&b[..body]);
    b[body..].copy_from_slice(&crc.to_le_bytes());
    b
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]
    #[test]
    fn damaged_containers_are_refused_or_attended_without_panic(
        edits in proptest::collection::vec((any::<usize>(), 1u8..=255), 1..6),
        which in any::<bool>(),
    ) {
        let c = build(&Spec { blocks: vec![70], kv_heads: 1, ..Spec::default() });
        let (ks, vs) = c.codes.stores(0, 0).unwrap();
        let (kb, vb) = (ks.blocks()[0].bytes().to_vec(), vs.blocks()[0].bytes().to_vec());
        let (kb, vb) = if which { (mutated(&kb, &edits), vb) } else { (kb, mutated(&vb, &edits)) };
        let mut fresh = c.codes.clone();
        fresh.clear();
        if fresh.append(0, 0, kb, vb).is_ok() {
            let o = attend(
                &fresh,
                &c.q,
                c.hq,
                c.nq,
                RawRows { k: &c.sink.0, v: &c.sink.1, rows: c.sink.2 },
                RawRows { k: &c.tail.0, v: &c.tail.1, rows: c.tail.2 },
                None,
                &c.params,
                None,
            );
            // Accepted codes are valid codes: the output is finite (or a typed error).
            if let Ok(o) = o {
                prop_assert!(o.out.iter().all(|v| v.is_finite()));
            }
        }
    }
}
