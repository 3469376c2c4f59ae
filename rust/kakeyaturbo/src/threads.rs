//! Thread pools: a bounded set, so that no sequence of calls can pile up OS threads.
//!
//! `threads = None` runs on rayon's global pool (one thread per core, or `RAYON_NUM_THREADS`).
//! `Some(t)` is capped at the number of cores ([`max_threads`]); the cap itself runs on the
//! global pool, and smaller counts on a pool of exactly that many threads, built once and
//! cached. At most [`MAX_CACHED_POOLS`] such pools are kept (the least recently used one is
//! dropped; its threads end when its last job does), so the process never holds more than
//! `max_threads() * (1 + MAX_CACHED_POOLS)` codec threads. The bytes never depend on the
//! thread count.
//!
//! In the child of a `fork` ([`after_fork`]) rayon's pools, the global one and the cached ones,
//! have their state but none of their threads, and a job handed to one would wait forever: there
//! the calls run on pools built in the child, the global pool's share on a cached pool of its
//! size.

use crate::error::{param, Result};
use std::cell::Cell;
use std::sync::atomic::{AtomicPtr, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// Pools of distinct sizes kept alive besides the global pool.
pub const MAX_CACHED_POOLS: usize = 4;

/// The largest useful thread count: the machine's available parallelism.
pub fn max_threads() -> usize {
    static CORES: OnceLock<usize> = OnceLock::new();
    *CORES.get_or_init(|| {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    })
}

/// The `fork`s this process is a child of since the library was loaded ([`after_fork`]).
static FORKS: AtomicUsize = AtomicUsize::new(0);

/// To be called in the child of a `fork`, for instance from a `pthread_atfork` child handler
/// (it only adds to an atomic): from then on no call hands work to a rayon pool built before the
/// fork (see the module docs). The Python extension registers it at import.
pub fn after_fork() {
    FORKS.fetch_add(1, Ordering::Relaxed);
}

/// Whether this process is the child of a `fork` ([`after_fork`]).
pub fn forked() -> bool {
    FORKS.load(Ordering::Relaxed) > 0
}

/// The pools cached in one process: their size, the pool.
type Pools = Mutex<Vec<(usize, Arc<rayon::ThreadPool>)>>;

/// The pool cache of the processes since fork `forks`: each `fork` starts a cache of its own,
/// so that a child never waits for the lock of a cache another thread of its parent held at the
/// `fork` (a thread the child does not have). The parent's pools have their state there but none
/// of their threads: forgotten, not dropped (a drop wakes them through state a parent's thread
/// may have held).
struct Generation {
    forks: usize,
    pools: Pools,
}

/// The pool cache of this process ([`Generation`]), made on first use after each `fork`.
fn generation() -> &'static Generation {
    static CURRENT: AtomicPtr<Generation> = AtomicPtr::new(std::ptr::null_mut());
    let forks = FORKS.load(Ordering::Relaxed);
    let mut cur = CURRENT.load(Ordering::Acquire);
    loop {
        // SAFETY: a non-null pointer in CURRENT came from `Box::into_raw` below and is never
        // freed (a cache replaced after a fork is leaked on purpose, see [`Generation`]).
        if let Some(g) = unsafe { cur.as_ref() } {
            if g.forks == forks {
                return g;
            }
        }
        let fresh = Box::into_raw(Box::new(Generation {
            forks,
            pools: Mutex::new(Vec::new()),
        }));
        match CURRENT.compare_exchange(cur, fresh, Ordering::AcqRel, Ordering::Acquire) {
            // SAFETY: `fresh` is the live box just stored, never freed.
            Ok(_) => return unsafe { &*fresh },
            Err(now) => {
                // SAFETY: `fresh` was never shared: this thread still owns it.
                drop(unsafe { Box::from_raw(fresh) });
                cur = now;
            }
        }
    }
}

/// A pool of `threads` threads (`1 <= threads < max_threads()`, or in a forked child the
/// global pool's size), from this process's cache if it holds one; `None` if the operating
/// system refuses the threads (the caller then runs on the global pool, or in a forked child on
/// the calling thread). The cache's lock is never held while threads start.
fn cached_pool(threads: usize) -> Option<Arc<rayon::ThreadPool>> {
    let pools = &generation().pools;
    let lock = || pools.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(p) = take_cached(&mut lock(), threads) {
        return Some(p);
    }
    let built = Arc::new(
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("kakeyaturbo-{i}"))
            .build()
            .ok()?,
    );
    let mut g = lock();
    // Another caller built one meanwhile: the first stays (this one ends unused).
    if let Some(p) = take_cached(&mut g, threads) {
        return Some(p);
    }
    g.push((threads, built.clone()));
    let evicted = (g.len() > MAX_CACHED_POOLS).then(|| g.remove(0));
    drop(g);
    drop(evicted);
    Some(built)
}

/// The cached pool of `threads` threads, now the most recently used.
fn take_cached(
    g: &mut Vec<(usize, Arc<rayon::ThreadPool>)>,
    threads: usize,
) -> Option<Arc<rayon::ThreadPool>> {
    let hit = g.remove(g.iter().position(|e| e.0 == threads)?);
    let p = hit.1.clone();
    g.push(hit);
    Some(p)
}

/// `f` on the global pool's threads: called from outside rayon's pools, the global pool itself
/// (its jobs go there), except in a forked child, where a pool of its size built in the child
/// runs `f`, or one of a single thread where the system refuses that many (where it refuses
/// even one, `f` runs on the calling thread and a job it hands to rayon waits: not seen).
fn on_global<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    // A pool thread in a forked child belongs to a pool built there.
    if !forked() || rayon::current_thread_index().is_some() {
        return f();
    }
    match cached_pool(rayon::current_num_threads()).or_else(|| cached_pool(1)) {
        Some(p) => p.install(f),
        None => f(),
    }
}

/// Runs `f` on `threads` threads (`None`: rayon's global pool; see the module docs for the
/// cap and for a forked child). `Some(0)` is an error.
pub fn with_threads<R: Send>(threads: Option<usize>, f: impl FnOnce() -> R + Send) -> Result<R> {
    match threads {
        None => Ok(on_global(f)),
        Some(0) => param("threads must be >= 1"),
        Some(t) if t >= max_threads() => Ok(on_global(f)),
        Some(t) => match cached_pool(t) {
            Some(p) => Ok(p.install(f)),
            None => Ok(on_global(f)),
        },
    }
}

/// [`with_threads`] for a job of `pieces` independent pieces whose result is a `Result`,
/// except that a job of one piece runs on the calling thread: one thread runs it wherever it
/// runs, and handing it to a pool thread and back costs more than a small job (a sleeping pool
/// thread takes tens of microseconds to wake; the cache's blocks are such jobs). `Some(0)` is
/// an error either way.
pub fn with_threads_for<R: Send>(
    threads: Option<usize>,
    pieces: usize,
    f: impl FnOnce() -> Result<R> + Send,
) -> Result<R> {
    match threads {
        Some(0) => param("threads must be >= 1"),
        _ if pieces <= 1 => f(),
        _ => with_threads(threads, f)?,
    }
}

thread_local! {
    static INLINE: Cell<bool> = const { Cell::new(false) };
}

/// Whether the calling thread runs a [`with_threads_inline`] job of one thread: code that
/// checks it iterates sequentially instead of handing its pieces to a pool.
pub fn inline() -> bool {
    INLINE.with(Cell::get)
}

/// [`with_threads`], except that one thread (`Some(1)`, or a machine of one core) runs `f` on
/// the calling thread, with [`inline`] true while it runs: no hand-over to a pool thread and
/// back (on a small machine, waking a sleeping pool thread per call costs more than a short
/// job). Only for jobs whose parallel parts check [`inline`].
pub fn with_threads_inline<R: Send>(
    threads: Option<usize>,
    f: impl FnOnce() -> R + Send,
) -> Result<R> {
    let one = threads == Some(1) || (threads.is_none() && rayon::current_num_threads() == 1);
    if !one {
        return with_threads(threads, f);
    }
    struct Reset(bool);
    impl Drop for Reset {
        fn drop(&mut self) {
            INLINE.with(|c| c.set(self.0));
        }
    }
    let _reset = Reset(INLINE.with(|c| c.replace(true)));
    Ok(f())
}

/// The bounds of `n >= 1` contiguous runs of the pieces of about equal total weight (`n + 1`
/// of them, from 0 to `weights.len()`): a piece joins a run if at least half of its weight lies
/// before the run's share ends (`k / n` of the total for run `k`). Halving the count of pieces
/// instead gave one thread three of a single kv-head's four pieces of 512 rows and the other
/// the fourth and a one-row tail.
pub(crate) fn runs(weights: &[usize], n: usize) -> Vec<usize> {
    let total: u128 = weights.iter().map(|&w| w as u128).sum();
    let mut bounds = vec![0];
    let (mut acc, mut i) = (0u128, 0usize);
    for k in 1..n as u128 {
        // The piece's middle, acc + w / 2, at or before k / n of the total (doubled).
        while i < weights.len() && n as u128 * (2 * acc + weights[i] as u128) <= 2 * total * k {
            acc += weights[i] as u128;
            i += 1;
        }
        bounds.push(i);
    }
    bounds.push(weights.len());
    bounds
}

/// How a call's units of work run: all on the calling thread; on the calling thread and one
/// scoped thread, as a team of two ([`PAIR`]); on rayon's pool; or on the host's team of that
/// many threads that the caller leads ([`crate::team`]).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Mode {
    Serial,
    Pair,
    Pool,
    Team(crate::team::Team, usize),
}

/// The calling thread and one scoped thread as a team ([`crate::team::run_all`]): each owns
/// about half of the pieces by weight and takes the other's from the back once its own are
/// done, so a helper that starts late (its core busy) or not at all (no thread to be had)
/// leaves its pieces to the caller instead of keeping it waiting.
const PAIR: crate::team::Team = crate::team::Team {
    run: run_pair,
    size: || 2,
};

fn run_pair(job: &(dyn Fn() + Sync)) {
    std::thread::scope(|s| {
        // A refused thread leaves every piece to the caller; `job` never unwinds.
        let _ = std::thread::Builder::new().spawn_scoped(s, job);
        job();
    });
}

/// The host's team ([`crate::team`]) where this call would otherwise use every core: the
/// caller runs outside rayon's pools and that team has two threads or more now.
pub(crate) fn team_here() -> Option<(crate::team::Team, usize)> {
    if rayon::current_thread_index().is_some() || rayon::current_num_threads() < max_threads() {
        return None;
    }
    crate::team::available()
}

/// Whether a call's pieces may run on the calling thread and one scoped thread ([`Mode::Pair`]):
/// the pool they would run on has two threads and the caller is not one of them.
pub(crate) fn pair_here() -> bool {
    rayon::current_num_threads() == 2 && rayon::current_thread_index().is_none()
}

/// The mode of a call of independent pieces on `threads` threads that has no measured size
/// limits of its own (attention's are in `attention::split`): the calling thread for one
/// thread or inside a one-thread job ([`inline`]); for all cores the host's team where it has
/// one, else the calling thread and one scoped thread on a pool of two, else rayon's pool;
/// `None` for another count, to be run on its pool ([`with_threads`]).
pub(crate) fn spread(threads: Option<usize>) -> Option<Mode> {
    if threads == Some(1) || inline() {
        return Some(Mode::Serial);
    }
    if threads.is_some_and(|t| t < max_threads()) {
        return None;
    }
    Some(match team_here() {
        Some((team, n)) => Mode::Team(team, n),
        None if pair_here() => Mode::Pair,
        None => Mode::Pool,
    })
}

/// `f` over `jobs`, independent, the results in the jobs' order (`weight`: a job's share of
/// the work), spread over `threads` threads; the first error (in order) is the error. Where
/// every job runs on one thread wherever it runs (`single`: an encode or decode of one chunk
/// or block), they may go to the host's team, or the calling thread for one thread
/// ([`spread`]); jobs that spread their own pieces over rayon's pool run on the pool of
/// `threads` threads, which then bounds those too.
pub(crate) fn spread_jobs<J: Sync, T: Send>(
    jobs: &[J],
    single: impl Fn(&J) -> bool,
    weight: impl Fn(&J) -> usize,
    threads: Option<usize>,
    f: impl Fn(&J) -> Result<T> + Sync + Send,
) -> Result<Vec<T>> {
    use rayon::prelude::*;
    let mode = match threads {
        None => spread(None),
        _ if jobs.iter().all(single) => spread(threads),
        _ => None,
    };
    let out: Vec<Result<T>> = match mode {
        Some(mode) => run_all(mode, jobs, weight, || (), |_, j| f(j)),
        None => with_threads(threads, || jobs.par_iter().map(&f).collect())?,
    };
    out.into_iter().collect()
}

/// `f` over `items` (with a state per thread from `init`), the results in the items' order
/// whatever ran them: the result never depends on the mode.
pub(crate) fn run_all<X, S, T>(
    mode: Mode,
    items: &[X],
    weight: impl Fn(&X) -> usize,
    init: impl Fn() -> S + Sync + Send,
    f: impl Fn(&mut S, &X) -> T + Sync + Send,
) -> Vec<T>
where
    X: Sync,
    T: Send,
{
    // One item: nothing to share.
    let mode = if items.len() < 2 { Mode::Serial } else { mode };
    match mode {
        Mode::Serial => {
            let mut s = init();
            items.iter().map(|x| f(&mut s, x)).collect()
        }
        // Two threads asked of a pool of two, from outside it: the caller and one scoped
        // thread, instead of handing every piece to the pool's two workers and sleeping until
        // they finish (one wake-up, not two).
        Mode::Pair => crate::team::run_all(PAIR, 2, items, weight, init, f),
        Mode::Pool => {
            use rayon::prelude::*;
            on_global(|| items.par_iter().map_init(init, f).collect())
        }
        Mode::Team(team, n) => crate::team::run_all(team, n, items, weight, init, f),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_cover_the_pieces_once_in_order() {
        for (w, n) in [
            (vec![1usize; 10], 3),
            (vec![5, 1, 1, 1, 1, 1], 2),
            (vec![], 2),
            (vec![1], 4),
            (vec![0, 0, 7], 2),
            (vec![3, 3], 1),
        ] {
            let b = runs(&w, n);
            assert_eq!(b.len(), n + 1, "{w:?}");
            assert_eq!((b[0], b[n]), (0, w.len()), "{w:?}");
            assert!(b.windows(2).all(|p| p[0] <= p[1]), "{w:?} {b:?}");
        }
        assert_eq!(runs(&[1; 10], 2), vec![0, 5, 10]);
        assert_eq!(runs(&[1; 9], 3), vec![0, 3, 6, 9]);
        assert_eq!(runs(&[5, 1, 1, 1, 1, 1], 2), vec![0, 1, 6]);
    }

    #[test]
    fn a_job_of_one_piece_runs_on_the_calling_thread() {
        let here = std::thread::current().id();
        let on = |threads, pieces| {
            with_threads_for(threads, pieces, || Ok(std::thread::current().id())).unwrap()
        };
        assert_eq!(on(Some(1), 1), here);
        assert_eq!(on(None, 0), here);
        assert_ne!(on(Some(1), 2), here);
        assert!(with_threads_for(Some(0), 1, || Ok(())).is_err());
        assert!(with_threads_for(Some(0), 3, || Ok(())).is_err());
    }

    #[test]
    fn one_thread_runs_inline() {
        assert!(!inline());
        let here = std::thread::current().id();
        let (id, flag) =
            with_threads_inline(Some(1), || (std::thread::current().id(), inline())).unwrap();
        assert_eq!((id, flag), (here, true));
        assert!(!inline());
        assert!(with_threads_inline(Some(0), || ()).is_err());
        if max_threads() > 1 {
            assert!(!with_threads_inline(None, inline).unwrap());
        }
    }

    #[test]
    fn every_mode_returns_the_items_in_order() {
        for n in [0usize, 1, 2, 7] {
            let items: Vec<usize> = (0..n).collect();
            let want: Vec<usize> = items.iter().map(|x| x * x + 1).collect();
            for mode in [Mode::Serial, Mode::Pair, Mode::Pool] {
                let got = run_all(mode, &items, |&x| x + 1, || (), |_, &x| x * x + 1);
                assert_eq!(got, want, "{mode:?} {n}");
            }
        }
        // Two items in pairs: each waits (up to 10 s) until the other has started, so the
        // helper takes one of them while the caller runs the other.
        let started = AtomicUsize::new(0);
        let ids = run_all(
            Mode::Pair,
            &[1, 1],
            |_| 1,
            || (),
            |_, _| {
                started.fetch_add(1, Ordering::SeqCst);
                let t0 = std::time::Instant::now();
                while started.load(Ordering::SeqCst) < 2 && t0.elapsed().as_secs() < 10 {
                    std::thread::yield_now();
                }
                std::thread::current().id()
            },
        );
        assert_ne!(ids[0], ids[1]);
        assert!(ids.contains(&std::thread::current().id()));
        let here = std::thread::current().id();
        let one = run_all(
            Mode::Pair,
            &[1],
            |_| 1,
            || (),
            |_, _| std::thread::current().id(),
        );
        assert_eq!(one, [here]);
    }

    #[test]
    fn counts_are_capped_and_pools_bounded() {
        assert!(with_threads(Some(0), || ()).is_err());
        assert_eq!(
            with_threads(Some(1), rayon::current_num_threads).unwrap(),
            1
        );
        let global = rayon::current_num_threads();
        assert_eq!(
            with_threads(Some(1 << 40), rayon::current_num_threads).unwrap(),
            global
        );
        for t in 1..40 {
            let got = with_threads(Some(t), rayon::current_num_threads).unwrap();
            assert!(
                got == t.min(max_threads() - 1).max(1) || got == global,
                "{t}: {got}"
            );
        }
    }

    /// A `fork` while a thread of the parent holds the pool cache's lock (here the test's own
    /// thread, through the `fork`): the child builds its pool in a cache of its own instead of
    /// waiting for that lock forever (before, it did: SIGALRM ended it).
    #[cfg(unix)]
    #[test]
    fn a_forked_child_does_not_wait_for_its_parents_pool_lock() {
        let held = generation().pools.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: the child builds one pool, runs one job on it and leaves by `_exit`.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            let ok = std::panic::catch_unwind(|| {
                // SAFETY: a timer for this process only; a wait for the lock ends it.
                unsafe { libc::alarm(30) };
                after_fork();
                with_threads(Some(1), || 7).ok() == Some(7)
            });
            // SAFETY: leaves the child at once, running nothing of the parent's.
            unsafe { libc::_exit(if matches!(ok, Ok(true)) { 0 } else { 1 }) };
        }
        drop(held);
        let mut status = 0;
        // SAFETY: waits for the child forked above.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "child status {status:#x}"
        );
    }

    #[test]
    fn the_two_runs_hold_about_half_the_rows_each() {
        let half = |w: &[usize]| runs(w, 2)[1];
        // One kv-head: four pieces of 512 rows and a one-row tail, 1,024 + 1,025 rows (half
        // the count of pieces gave 1,536 + 513); with a sink row first, still two pieces each.
        assert_eq!(half(&[512, 512, 512, 512, 1]), 2);
        assert_eq!(half(&[1, 512, 512, 512, 512, 1]), 3);
        // Uneven pieces: the split nearest the middle of the rows.
        assert_eq!(half(&[100, 100, 100, 700]), 3);
        assert_eq!(half(&[700, 100, 100, 100]), 1);
        // A tie goes to the first run; one piece: the caller takes it; none: nothing to split.
        assert_eq!(half(&[64, 64]), 1);
        assert_eq!(half(&[64]), 1);
        assert_eq!(half(&[]), 0);
    }
}
