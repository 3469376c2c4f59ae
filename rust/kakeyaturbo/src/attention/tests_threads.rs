//! Where the work runs: the thread count, small calls on the calling thread, many query
//! rows split by rows, and the kernel chosen for the CPU; none of them changes the bits.

use super::reference::check;
use super::*;

#[test]
fn thread_count_does_not_change_the_bits() {
    for rope in [None, Some((32, false))] {
        thread_count_case(rope);
    }
}

#[test]
fn small_calls_run_on_the_calling_thread() {
    let c = build(&Spec {
        blocks: vec![256],
        ..Spec::default()
    });
    let work = c.codes.batch() * c.codes.kv_heads() * c.codes.k_dim() * 256;
    assert!(work <= super::super::inline_work());
    assert_eq!(super::super::auto_threads(&c.codes, 6, 1, None), Some(1));
    assert_eq!(super::super::auto_threads(&c.codes, 6, 1, Some(2)), Some(2));
    // Query rows count in units of `QUERY_ROWS_PER_UNIT` per kv-head (heads x tokens): up to
    // one unit the same, past it each unit as much work again.
    let unit = super::super::QUERY_ROWS_PER_UNIT;
    assert_eq!(
        super::super::auto_threads(&c.codes, 2 * unit, 1, None),
        Some(1)
    );
    let units = super::super::inline_work() / work + 1;
    assert_eq!(
        super::super::auto_threads(&c.codes, 2 * unit * units, 1, None),
        None
    );
    assert_eq!(
        super::super::auto_threads(&c.codes, 2 * unit, units, None),
        None
    );
    let big = build(&Spec {
        blocks: vec![2048, 2048, 1000],
        kv_heads: 3,
        dk: 64,
        ..Spec::default()
    });
    assert_eq!(super::super::auto_threads(&big.codes, 9, 1, None), None);
}

#[test]
fn many_query_rows_split_by_rows_without_changing_the_bits() {
    // A latent layer with 96 query heads: its queries' preparation and its combination cost
    // past `ROWS_WORK`, so they run in units of `ROW_CHUNK` rows on the threads asked for.
    let s = Spec {
        latent: true,
        kv_heads: 1,
        group: 96,
        dk: 256,
        dv: 32,
        blocks: vec![512, 512, 300],
        ..Spec::default()
    };
    check(&s);
    let c = build(&s);
    let (mk, mv) = (c.codes.k_store(0).tables().m, c.codes.v_store(0).tables().m);
    assert!(96 * (c.dk + c.dv) * (mk + mv) >= super::super::split::ROWS_WORK);
    assert!(96 * mk * c.dk >= super::super::split::ROWS_WORK);
    const { assert!(96 > 2 * super::super::split::ROW_CHUNK) };
    thread_count_same(&c);
    // Several query tokens: the units of 16 rows cut across a head's tokens (row = g * n_q + i),
    // and a grouped-query layer with a causal mask over its tokens.
    for s in [
        Spec {
            nq: 3,
            group: 40,
            mask: true,
            ..s.clone()
        },
        Spec {
            latent: false,
            kv_heads: 2,
            group: 24,
            nq: 5,
            dk: 256,
            dv: 64,
            ..s
        },
    ] {
        check(&s);
        thread_count_same(&build(&s));
    }
}

fn thread_count_case(rope: Option<(usize, bool)>) {
    let c = build(&Spec {
        blocks: vec![2048, 2048, 1000],
        kv_heads: 3,
        rope,
        ..Spec::default()
    });
    thread_count_same(&c);
}

/// One, two, all and no pool threads give the same bits.
fn thread_count_same(c: &Case) {
    let one = crate::threads::with_threads(Some(1), || run(c, Isa::best()))
        .unwrap()
        .unwrap();
    let two = crate::threads::with_threads(Some(2), || run(c, Isa::best()))
        .unwrap()
        .unwrap();
    let all = run(c, Isa::best()).unwrap();
    let inline = crate::threads::with_threads_inline(Some(1), || run(c, Isa::best()))
        .unwrap()
        .unwrap();
    assert_eq!(one, two);
    assert_eq!(one, all);
    assert_eq!(one, inline);
}

#[test]
fn the_fast_kernel_runs_where_the_cpu_has_it() {
    #[cfg(target_arch = "x86_64")]
    {
        let (a512, a2) = (
            super::super::avx512::available(),
            super::super::avx2::available(),
        );
        let want = if a512 {
            Isa::Avx512
        } else if a2 {
            Isa::Avx2
        } else {
            Isa::Portable
        };
        assert_eq!(Isa::best(), want);
        assert_eq!(Isa::Avx2.runs_here(), a2);
        assert_eq!(Isa::Avx512.runs_here(), a512);
    }
    assert!(Isa::Portable.runs_here());
    eprintln!("attention kernel: {:?}", Isa::best());
}
