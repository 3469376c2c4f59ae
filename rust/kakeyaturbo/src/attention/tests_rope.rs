//! Keys coded before RoPE (both syntheses) against the rotated decode, and bad rotations.

use super::reference::check;
use super::*;

#[test]
fn keys_coded_before_rope_in_f32_match_the_rotated_decode() {
    for (dk, rope) in [(64, (64, false)), (40, (40, true)), (96, (32, false))] {
        check(&Spec {
            dk,
            rope: Some(rope),
            synthesis: Synthesis::F32,
            ..Spec::default()
        });
    }
}

#[test]
fn keys_coded_before_rope_match_the_rotated_decode() {
    for (dk, rope) in [
        (32, (32, false)),
        (64, (64, false)),
        (128, (128, true)),
        (64, (24, false)),
        (40, (40, true)),
        (256, (256, false)),
    ] {
        check(&Spec {
            dk,
            rope: Some(rope),
            ..Spec::default()
        });
    }
    check(&Spec {
        batch: 2,
        kv_heads: 1,
        group: 7,
        dk: 64,
        nq: 3,
        tail: 5,
        mask: true,
        softcap: Some(5.0),
        window: Some(150),
        blocks: vec![512, 70],
        rope: Some((64, false)),
        ..Spec::default()
    });
    // Widths from 8 bits down: the bfloat16 look-up's one, two and four permutes per 32 rows
    // (up to 6, 7 and 8 bits), pairs of mixed widths.
    for seed in [3, 4] {
        check(&Spec {
            seed,
            dk: 64,
            bmax: 8,
            rope: Some((64, false)),
            ..Spec::default()
        });
    }
}

#[test]
fn a_bad_rotation_is_a_typed_error() {
    let mut c = build(&Spec {
        rope: Some((32, false)),
        ..Spec::default()
    });
    assert!(run(&c, Isa::Portable).is_ok());
    let r = c.rope.as_mut().unwrap();
    let n = r.cos.len() / 16;
    r.positions[5] = n as u32;
    assert!(matches!(
        run(&c, Isa::Portable),
        Err(crate::Error::InvalidInput(_))
    ));
    let r = c.rope.as_mut().unwrap();
    r.positions[5] = 0;
    r.positions.pop();
    assert!(matches!(
        run(&c, Isa::Portable),
        Err(crate::Error::InvalidInput(_))
    ));
    let r = c.rope.as_mut().unwrap();
    r.positions.push(0);
    r.cos.iter_mut().for_each(|v| *v = f32::NAN);
    assert!(matches!(
        run(&c, Isa::Portable),
        Err(crate::Error::Numerical(_))
    ));
    let r = c.rope.as_mut().unwrap();
    r.cos.iter_mut().for_each(|v| *v = 0.5);
    r.rot = 33;
    assert!(run(&c, Isa::Portable).is_err());
    let r = c.rope.as_mut().unwrap();
    r.rot = 34;
    assert!(run(&c, Isa::Portable).is_err());
}
