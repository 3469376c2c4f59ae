//! Thread pools by size, built once each: building a pool costs more than coding a block.

use crate::error::{param, Error, Result};
use std::sync::{Arc, Mutex, OnceLock};

type Pools = Mutex<Vec<(usize, Arc<rayon::ThreadPool>)>>;

fn pool(threads: usize) -> Result<Arc<rayon::ThreadPool>> {
    static POOLS: OnceLock<Pools> = OnceLock::new();
    let pools = POOLS.get_or_init(|| Mutex::new(Vec::new()));
    let mut g = pools.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, p)) = g.iter().find(|(t, _)| *t == threads) {
        return Ok(p.clone());
    }
    let p = Arc::new(
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .map_err(|e| Error::Numerical(format!("cannot start {threads} threads: {e}")))?,
    );
    g.push((threads, p.clone()));
    Ok(p)
}

/// Runs `f` on a pool of `threads` threads (`None`: rayon's global pool).
pub fn with_threads<R: Send>(threads: Option<usize>, f: impl FnOnce() -> R + Send) -> Result<R> {
    match threads {
        None => Ok(f()),
        Some(0) => param("threads must be >= 1"),
        Some(t) => Ok(pool(t)?.install(f)),
    }
}
