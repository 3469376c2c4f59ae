//! Tests of `store.rs`: sealed blocks parsed and refused, a layer's stores appended, selected
//! and counted.

use super::*;
use crate::calibrated::testutil::{codec, rows};
use crate::metric::Metric;

#[test]
fn blocks_are_read_in_place() {
    for (norm, outl) in [(true, Some(1.0)), (false, None), (false, Some(0.5))] {
        let c = codec(20, vec![7, 5, 5, 4, 3, 3, 2, 1], norm, Metric::Mse, outl);
        let t = StreamTables::new(&c);
        let x = rows(&c, 77, 5);
        let codes = c.encode(&x, 77).unwrap();
        let (bytes, _) = c.to_bytes(&codes);
        let b = SealedBlock::parse(&t, bytes.clone()).unwrap();
        assert_eq!(b.bytes(), &bytes[..]);
        assert_eq!(b.outliers, codes.outlier_pos.len());
        assert!(outl.is_none() || b.outliers > 0);
        let g = codes.scale.as_ref().map(|s| s.decode());
        for r in 0..77 {
            assert_eq!(
                b.row(r, t.row_bytes),
                &codes.codes[r * t.row_bytes..][..t.row_bytes]
            );
            assert_eq!(b.scale(r), g.as_ref().map_or(1.0, |g| g[r]));
        }
        for i in 0..b.outliers {
            let want = (
                codes.outlier_pos[i],
                half::f16::from_bits(codes.outlier_val[i]).to_f32(),
            );
            assert_eq!(b.outlier(i), want);
            assert_eq!(b.first_outlier_from(want.0), i);
            assert_eq!(b.first_outlier_from(want.0 + 1), i + 1);
        }
        // Damaged or foreign bytes are refused.
        let mut bad = bytes.clone();
        bad[50] ^= 1;
        assert!(SealedBlock::parse(&t, bad).is_err());
        let other = StreamTables::new(&codec(
            20,
            vec![7, 5, 5, 4, 3, 3, 2, 2],
            norm,
            Metric::Mse,
            outl,
        ));
        assert!(SealedBlock::parse(&other, bytes).is_err());
    }
}

#[test]
fn layers_append_select_and_count() {
    let ck = codec(16, vec![4, 4, 3, 3, 2], true, Metric::Mse, None);
    let cv = codec(16, vec![3, 3, 3, 2], true, Metric::Mse, Some(2.0));
    let tk = Arc::new(StreamTables::new(&ck));
    let tv = Arc::new(StreamTables::new(&cv));
    let mut l = LayerCodes::new(vec![tk.clone(), tk], vec![tv.clone(), tv], 2).unwrap();
    let x = rows(&ck, 30, 1);
    let kb = ck.to_bytes(&ck.encode(&x, 30).unwrap()).0;
    let vb = cv.to_bytes(&cv.encode(&x, 30).unwrap()).0;
    let vb20 = cv.to_bytes(&cv.encode(&x[..20 * 16], 20).unwrap()).0;
    assert!(l.append(0, 0, kb.clone(), vb20).is_err());
    assert!(l.append(2, 0, kb.clone(), vb.clone()).is_err());
    assert!(l.append(0, 0, vb.clone(), kb.clone()).is_err());
    for b in 0..2 {
        for h in 0..2 {
            l.append(b, h, kb.clone(), vb.clone()).unwrap();
        }
    }
    l.append(1, 1, kb.clone(), vb.clone()).unwrap();
    assert!(l.common_rows().is_err());
    assert_eq!(l.rows(1, 1).unwrap(), 60);
    let five = 5 * (kb.len() + vb.len());
    assert_eq!(l.nbytes(), five);
    l.select(&[1, 1, 0]).unwrap();
    assert_eq!(l.batch(), 3);
    // A repeated batch row shares its blocks: they are held, and counted, once.
    assert_eq!(l.nbytes(), five);
    assert_eq!(l.rows(0, 1).unwrap(), 60);
    assert_eq!(l.rows(2, 1).unwrap(), 30);
    assert_eq!(l.blob(1, 1, "k", 1).unwrap(), &kb[..]);
    assert!(l.blob(1, 1, "x", 0).is_err());
    assert!(l.select(&[3]).is_err());
    // The (batch row, kv-head) pairs are bounded, for a new layer and for a selection.
    let (t2k, t2v) = (
        vec![l.k_store(0).tables().clone(); 2],
        vec![l.v_store(0).tables().clone(); 2],
    );
    assert!(LayerCodes::new(t2k.clone(), t2v.clone(), MAX_STORES / 2).is_ok());
    let e = LayerCodes::new(t2k, t2v, MAX_STORES / 2 + 1);
    assert!(matches!(e, Err(Error::InvalidParameter(_))), "{e:?}");
    let e = l.select(&vec![0; MAX_STORES / 2 + 1]);
    assert!(matches!(e, Err(Error::InvalidInput(_))), "{e:?}");
    assert_eq!(l.batch(), 3);
    // Shared bytes read the same as owned ones, and the front block can go.
    let shared: Arc<[u8]> = kb.clone().into();
    l.append(2, 1, Blob::shared(shared.clone()), vb.clone())
        .unwrap();
    // The same bytes appended to two stores (as the binding shares one Python `bytes`) count once.
    let before = l.nbytes();
    l.append(2, 0, Blob::shared(shared), vb.clone()).unwrap();
    assert_eq!(l.nbytes(), before + vb.len());
    assert_eq!(l.rows(2, 1).unwrap(), 60);
    assert_eq!(l.blob(2, 1, "k", 1).unwrap(), &kb[..]);
    l.pop_front_block();
    assert_eq!(l.rows(2, 1).unwrap(), 30);
    assert_eq!(l.rows(0, 1).unwrap(), 30);
    assert_eq!(l.blob(2, 1, "k", 0).unwrap(), &kb[..]);
    l.append(0, 1, kb.clone(), vb.clone()).unwrap();
    l.append(2, 1, kb.clone(), vb.clone()).unwrap();
    l.pop_block();
    assert_eq!(l.rows(0, 1).unwrap(), 30);
    assert_eq!(l.rows(0, 0).unwrap(), 0);
    l.pop_block();
    assert_eq!(l.common_rows().unwrap(), 0);
    assert_eq!(l.nbytes(), 0);
}
