//! The OpenMP team torch runs its CPU operations on, lent to the attention kernel
//! (`kakeyaturbo::team`): found at run time among the symbols the process has loaded
//! (`GOMP_parallel`, which libgomp and LLVM's OpenMP both export), so nothing is linked and a
//! process without torch keeps the kernel's own threads. `KAKEYATURBO_OPENMP_TEAM=0` in the
//! environment (read at import) turns it off, and so does a `fork`: libgomp's team does not
//! survive into the child (a parallel region there waits for threads that are not there), so a
//! child keeps the kernel's own threads (`kakeyaturbo::threads::forked`, set by the handler
//! [`install`] registers).

use kakeyaturbo::team::{register, Team};
use kakeyaturbo::threads::{after_fork, forked};
use std::ffi::{c_int, c_uint, c_void, CStr};
use std::sync::OnceLock;

type Parallel = unsafe extern "C" fn(extern "C" fn(*mut c_void), *mut c_void, c_uint, c_uint);
type MaxThreads = unsafe extern "C" fn() -> c_int;

#[derive(Clone, Copy)]
struct Omp {
    parallel: Parallel,
    max_threads: MaxThreads,
}

static OMP: OnceLock<Omp> = OnceLock::new();

/// The `pthread_atfork` child handler: tells the core it runs in a forked child, where rayon's
/// pools and this team are then left alone.
extern "C" fn in_child() {
    after_fork();
}

/// The runtime's entry points, once a loaded library exports both (looked up again on each
/// call until then: torch may be imported after this module).
fn omp() -> Option<Omp> {
    if let Some(o) = OMP.get() {
        return Some(*o);
    }
    let find = |name: &CStr| {
        // SAFETY: a symbol lookup in the libraries already loaded; a null result is handled.
        let p = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) };
        (!p.is_null()).then_some(p)
    };
    let (p, m) = (find(c"GOMP_parallel")?, find(c"omp_get_max_threads")?);
    // SAFETY: the two symbols of the OpenMP runtime ABI, with these signatures
    // (`GOMP_parallel(fn, data, num_threads, flags)`, `int omp_get_max_threads(void)`).
    let o = unsafe {
        Omp {
            parallel: std::mem::transmute::<*mut c_void, Parallel>(p),
            max_threads: std::mem::transmute::<*mut c_void, MaxThreads>(m),
        }
    };
    Some(*OMP.get_or_init(|| o))
}

extern "C" fn trampoline(data: *mut c_void) {
    // SAFETY: `data` is the `&&(dyn Fn() + Sync)` that `run` passes, alive until the parallel
    // region it starts has ended.
    let job = unsafe { *(data as *const &(dyn Fn() + Sync)) };
    // The job catches its own panics; an unwind must never cross into C.
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
}

fn run(job: &(dyn Fn() + Sync)) {
    match omp() {
        // SAFETY: `trampoline` reads `data` as the reference it is; the region's threads have
        // all returned when `GOMP_parallel` does. 0 threads: the team's default size (what
        // `omp_get_max_threads` gave `size`).
        Some(o) => unsafe {
            (o.parallel)(
                trampoline,
                &job as *const &(dyn Fn() + Sync) as *mut c_void,
                0,
                0,
            )
        },
        None => job(),
    }
}

fn size() -> usize {
    if forked() {
        return 0;
    }
    // SAFETY: `omp_get_max_threads` takes nothing and returns an int.
    omp().map_or(0, |o| unsafe { (o.max_threads)() }.max(0) as usize)
}

/// Registers the fork handler (whether or not the team is on), then the team unless the
/// environment turns it off.
pub fn install() {
    // SAFETY: registers a handler that only adds to an atomic.
    let handled = unsafe { libc::pthread_atfork(None, None, Some(in_child)) } == 0;
    // Without the handler (no memory for it) a forked child could not tell it is one: the team
    // stays off rather than unsafe there.
    if !handled || std::env::var_os("KAKEYATURBO_OPENMP_TEAM").is_some_and(|v| v == "0") {
        return;
    }
    register(Team { run, size });
}
