//! A team of threads the calling thread already leads: the host's own (the binding registers
//! the OpenMP runtime torch loaded), so that a call made between the host's parallel
//! operations runs on the threads those just used instead of waking threads of its own beside
//! them.
//!
//! Why: OpenMP workers keep their cores busy for a while after each parallel region (libgomp
//! spins before it sleeps), so on a machine whose every core runs one of them, a thread of
//! ours woken right after a torch operation finds its core taken and the call waits for it.
//! Handing the work to the team instead starts it on those very threads.
//!
//! Work is split by weight (`threads::runs`): each member owns a contiguous run of the items
//! (of about equal weight) and takes them from the front; a member whose run is done takes
//! items from the back of the others' runs. So a member that starts late (or never) costs no
//! more than its items run elsewhere, and every item runs exactly once; the results go back in
//! the items' order, so they never depend on which thread ran what. The kernel's own pair of
//! threads (`threads::Mode::Pair`: the caller and one scoped thread) runs the same way.

use std::any::Any;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

/// A host's team of threads, led by the calling thread.
#[derive(Clone, Copy, Debug)]
pub struct Team {
    /// Runs `job` once on each thread of the calling thread's team (the caller among them)
    /// and returns when every one has returned. `job` never unwinds.
    pub run: fn(&(dyn Fn() + Sync)),
    /// The number of threads `run` would use now (0 or 1: no team to be had, e.g. the
    /// runtime is not loaded).
    pub size: fn() -> usize,
}

static TEAM: OnceLock<Team> = OnceLock::new();

/// Registers the host's team (once per process; later calls are ignored). Returns whether
/// this call registered it.
pub fn register(team: Team) -> bool {
    TEAM.set(team).is_ok()
}

/// The registered team and its size, where it has two threads or more now.
pub fn available() -> Option<(Team, usize)> {
    let t = *TEAM.get()?;
    let n = (t.size)();
    (n >= 2).then_some((t, n))
}

/// A run of items `front .. back` packed in one word, taken from either end atomically.
struct Run(AtomicU64);

impl Run {
    fn new(front: usize, back: usize) -> Self {
        Run(AtomicU64::new(front as u64 | (back as u64) << 32))
    }

    /// The next item from the front (`back == false`) or the back, or None once empty.
    fn take(&self, back: bool) -> Option<usize> {
        let mut cur = self.0.load(Ordering::Relaxed);
        loop {
            let (f, b) = (cur & 0xffff_ffff, cur >> 32);
            if f >= b {
                return None;
            }
            let (next, item) = if back {
                (f | (b - 1) << 32, b - 1)
            } else {
                ((f + 1) | b << 32, f)
            };
            match self
                .0
                .compare_exchange_weak(cur, next, Ordering::AcqRel, Ordering::Relaxed)
            {
                Ok(_) => return Some(item as usize),
                Err(now) => cur = now,
            }
        }
    }
}

/// `f` over `items` on `team` (`n` threads), a state per thread from `init` (made when it
/// takes its first item); the results in the items' order.
pub(crate) fn run_all<X, S, T>(
    team: Team,
    n: usize,
    items: &[X],
    weight: impl Fn(&X) -> usize,
    init: impl Fn() -> S + Sync,
    f: impl Fn(&mut S, &X) -> T + Sync,
) -> Vec<T>
where
    X: Sync,
    T: Send,
{
    assert!(items.len() < u32::MAX as usize);
    let weights: Vec<usize> = items.iter().map(weight).collect();
    let bounds = crate::threads::runs(&weights, n);
    let runs: Vec<Run> = bounds.windows(2).map(|w| Run::new(w[0], w[1])).collect();
    let out: Vec<Mutex<Option<T>>> = items.iter().map(|_| Mutex::new(None)).collect();
    let arrived = AtomicUsize::new(0);
    let panicked: Mutex<Option<Box<dyn Any + Send>>> = Mutex::new(None);
    let job = || {
        let me = arrived.fetch_add(1, Ordering::Relaxed) % n;
        let work = || {
            let mut state: Option<S> = None;
            let mut one = |i: usize| {
                let s = state.get_or_insert_with(&init);
                let r = f(s, &items[i]);
                *out[i].lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
            };
            while let Some(i) = runs[me].take(false) {
                one(i);
            }
            for k in 1..n {
                while let Some(i) = runs[(me + k) % n].take(true) {
                    one(i);
                }
            }
        };
        if let Err(e) = catch_unwind(AssertUnwindSafe(work)) {
            *panicked.lock().unwrap_or_else(|e| e.into_inner()) = Some(e);
        }
    };
    (team.run)(&job);
    if let Some(e) = panicked.into_inner().unwrap_or_else(|e| e.into_inner()) {
        resume_unwind(e);
    }
    // Every item was taken by a member that returned (the caller is one); should a team run
    // without its caller, what is left runs here.
    let mut state: Option<S> = None;
    out.into_iter()
        .zip(items)
        .map(|(m, x)| {
            m.into_inner()
                .unwrap_or_else(|e| e.into_inner())
                .unwrap_or_else(|| f(state.get_or_insert_with(&init), x))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A team of `THREADS` scoped threads started per call, the caller one of them.
    const THREADS: usize = 3;

    fn scoped(job: &(dyn Fn() + Sync)) {
        std::thread::scope(|s| {
            for _ in 1..THREADS {
                s.spawn(job);
            }
            job();
        });
    }

    fn late(job: &(dyn Fn() + Sync)) {
        // One member never comes: the others take its run.
        job();
        job();
    }

    fn size() -> usize {
        THREADS
    }

    #[test]
    fn every_item_once_in_order_whoever_runs_it() {
        for run in [scoped as fn(&(dyn Fn() + Sync)), late] {
            let team = Team { run, size };
            for len in [0usize, 1, 2, 7, 100] {
                let items: Vec<usize> = (0..len).collect();
                let calls = AtomicUsize::new(0);
                let got = run_all(
                    team,
                    THREADS,
                    &items,
                    |&x| x % 3 + 1,
                    || 10usize,
                    |s, &x| {
                        calls.fetch_add(1, Ordering::Relaxed);
                        *s + x
                    },
                );
                assert_eq!(got, items.iter().map(|x| x + 10).collect::<Vec<_>>());
                assert_eq!(calls.into_inner(), len);
            }
        }
    }

    #[test]
    fn a_panic_reaches_the_caller() {
        let team = Team { run: scoped, size };
        let r = catch_unwind(|| {
            run_all(
                team,
                THREADS,
                &[1, 2, 3, 4],
                |_| 1,
                || (),
                |_, &x: &i32| {
                    assert!(x != 3, "item three");
                    x
                },
            )
        });
        assert!(r.is_err());
    }
}
