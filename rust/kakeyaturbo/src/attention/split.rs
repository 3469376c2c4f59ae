//! How one call of [`super::attend`] is spread over threads: the work it counts, the calls
//! small enough for the calling thread, and for the others the calling thread with one scoped
//! thread, rayon's pool or the host's team ([`crate::team`]). None of it changes a bit of the
//! result: the pieces of work are fixed, only who runs them varies.

use super::attend::Isa;
use super::store::LayerCodes;
use crate::threads::{pair_here, team_here, Mode};

/// Sealed work ([`sealed_work`]: batch rows x kv-heads x sealed rows x `D_k`, times the units of
/// 16 query rows per kv-head past the first) up to which a call that asks
/// for all cores (`threads = None`) runs on the calling thread instead ([`auto_threads`]):
/// 2,048 positions of 3 kv-heads of 64 dims take about 0.7 ms on one core of the 2-core test
/// machine and gained nothing from a second thread, whose wake-up costs about 0.3 ms there
/// (`benches/bench_generate.py --kernel-threads 1,2`: one thread was the faster at 2k, two at
/// 8k).
pub const INLINE_WORK: usize = 1 << 19;

/// [`INLINE_WORK`] for the kernel this CPU runs: as measured for the AVX-512 one; a quarter of
/// it for the others, whose step costs 3 to 4x as much per element (AVX2 on a 2-core Zen 3 VM,
/// 2026-12-06: at 2,053 tokens, 393,216 elements per call, two threads gave 0.77x and 0.84x of
/// `DynamicCache`'s decode tokens/s where one gave 0.67x and 0.63x, `benches/bench_generate.py
/// --kernel-threads 1,2`, docs/decode-attention.md). Half of that where the host's team would
/// run the call ([`crate::team`]), whose threads need no wake-up between the host's operations
/// (AVX2 on the Zen 3 VM, 2026-12-06, `benches/bench_decode_attention.py --recipes
/// calibrated-3bit --layers 1 --first-layer 15 --tokens 128,512,2048 --pause-ms 0`: the team's
/// two threads were no faster than one at 128 rows, 24,576 elements, and faster at 512,
/// 98,304; docs/decode-attention.md, "Torch's OpenMP team").
pub fn inline_work() -> usize {
    let own = match Isa::best() {
        Isa::Avx512 => INLINE_WORK,
        _ => INLINE_WORK / 4,
    };
    if crate::team::available().is_some() {
        own / 2
    } else {
        own
    }
}

/// The most sealed work (as for [`INLINE_WORK`], query rows left out) that a call on a pool of
/// two threads, from outside it, splits between the calling thread and one scoped thread
/// instead of handing it to the pool (measured on a 2-core VM, 2026-12-04, README "Generation through the codes": in
/// generation at 8k tokens, 1.6M elements, the split cut the attention from 45-61 to 34-38 ms
/// per token; on 8.4M-element calls after an idle pause the pool's workers were faster).
pub const PAIR_WORK: usize = 1 << 21;

/// Query rows per unit of the queries' preparation and of the final combination where a
/// phase is heavy ([`ROWS_WORK`]): latent attention has 16 to 128 query rows per kv-head, whose
/// preparation and combination ran on the calling thread whatever the thread count. A multiple
/// of the 4 rows that the synthesis is read once for.
pub(super) const ROW_CHUNK: usize = 16;

/// Multiply-adds of a phase (preparation or combination, all (batch row, kv-head)s) from
/// which its rows run as units of [`ROW_CHUNK`] in the call's mode, not on the calling thread
/// (grouped-query layers stay far below: 3 query rows of 64 dims and 56 components cost 11k
/// per kv-head; a 128-head latent layer 42M and 33M).
pub(super) const ROWS_WORK: usize = 1 << 20;

/// Query rows per kv-head (`H_q / H_kv x n_q`) that [`INLINE_WORK`] counts as one: up to 16
/// the work of a sealed row is mostly its own (reading, unpacking, synthesising its codes),
/// past that the query rows' (latent attention's 128 heads; `codes auto` of
/// `benches/bench_latent_attention.py --tokens 512,1024,2048 --bits 3 --heads 16,128`, three
/// alternating runs of each build: 128 heads at 1k 7.4-8.3 ms on the calling thread before,
/// 6.2-7.3 ms after; at 512 rows no faster on two threads after the benchmark's pause).
pub const QUERY_ROWS_PER_UNIT: usize = 16;

/// The thread count a call run through `threads::with_threads_inline` should use: `threads`
/// as asked, except that `None` becomes `Some(1)` (the calling thread) for at most
/// [`inline_work`] of sealed work, `q_heads` query heads of `n_q` tokens each. The result never
/// depends on it.
pub fn auto_threads(
    codes: &LayerCodes,
    q_heads: usize,
    n_q: usize,
    threads: Option<usize>,
) -> Option<usize> {
    let rows = codes.common_rows().unwrap_or(usize::MAX);
    let query_rows = (q_heads / codes.kv_heads().max(1)).saturating_mul(n_q);
    let work = sealed_work(
        codes.batch() * codes.kv_heads(),
        codes.k_dim(),
        rows,
        query_rows,
    );
    match threads {
        None if work <= inline_work() => Some(1),
        t => t,
    }
}

/// The sealed work of a call: (batch rows x kv-heads) x `D_k` x sealed rows per (batch row,
/// kv-head) x the units of [`QUERY_ROWS_PER_UNIT`] query rows per kv-head (at least one; as
/// [`INLINE_WORK`] counts it; [`PAIR_WORK`] counts one unit).
pub(super) fn sealed_work(pairs: usize, dk: usize, rows: usize, query_rows: usize) -> usize {
    let units = query_rows.div_ceil(QUERY_ROWS_PER_UNIT).max(1);
    pairs
        .saturating_mul(dk)
        .saturating_mul(rows)
        .saturating_mul(units)
}

/// The mode of a call of `work` ([`sealed_work`], query rows left out): the calling thread
/// inside a one-thread job (`threads::with_threads_inline`), the host's team where it has one,
/// the calling thread and one scoped thread up to [`PAIR_WORK`] on a pool of two, rayon's
/// pool otherwise.
pub(super) fn call_mode(work: usize) -> Mode {
    if crate::threads::inline() {
        Mode::Serial
    } else if let Some((team, n)) = team_here() {
        Mode::Team(team, n)
    } else if work <= PAIR_WORK && pair_here() {
        Mode::Pair
    } else {
        Mode::Pool
    }
}
