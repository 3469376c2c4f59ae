//! A layer's blocks decoded into one array: the containers of `blocks` blocks of `g` row sets
//! (a cache's kv-heads), block-major, each decoded straight into its rows of a `[g, rows, D]`
//! array, every decode of the call spread over threads. Shared by both modes (`calibrated::many`,
//! `perblock::many`), which parse and check their containers first.

use crate::error::{input, Result};
use crate::threads::spread_jobs;
use std::sync::Mutex;

/// Where the blocks go: `g` row sets of `rows` rows of `d` values each in `out`, the blocks at
/// rows `at ..` of every set, `block_rows` rows each.
pub(crate) struct Layout {
    pub g: usize,
    pub block_rows: usize,
    pub d: usize,
    pub rows: usize,
    pub at: usize,
}

/// Decodes `parsed` (block `j` of set `h` at `parsed[j * g + h]`, each of `block_rows` rows of
/// width `d`, already checked) into its rows of `out`, the rest of `out` left as it is: through
/// `decode` (one block into its `block_rows x d` slice), spread as
/// [`crate::threads::spread_jobs`] spreads jobs (`single`: a block decodes on one thread;
/// `weight`: its share of the work). Refused before anything is written where the blocks do not
/// fit `out` or are not whole blocks of `g` sets; the first decode refused (in order) is the
/// error.
pub(crate) fn decode_into<T: Sync>(
    parsed: &[T],
    to: &Layout,
    out: &mut [f32],
    threads: Option<usize>,
    single: impl Fn(&T) -> bool,
    weight: impl Fn(&T) -> usize,
    decode: impl Fn(&T, &mut [f32]) -> Result<()> + Sync + Send,
) -> Result<()> {
    let Layout {
        g,
        block_rows,
        d,
        rows,
        at,
    } = *to;
    if g == 0 || !parsed.len().is_multiple_of(g) {
        return input("the containers are not whole blocks of one row width");
    }
    let blocks = parsed.len() / g;
    let fits = blocks
        .checked_mul(block_rows)
        .and_then(|r| r.checked_add(at))
        .is_some_and(|end| end <= rows);
    if !fits || Some(out.len()) != g.checked_mul(rows).and_then(|r| r.checked_mul(d)) {
        return input(format!(
            "{} floats for [{g}, {rows}, {d}] cannot take {blocks} blocks of {block_rows} rows \
             at row {at}",
            out.len()
        ));
    }
    if parsed.is_empty() || d == 0 {
        return Ok(());
    }
    // Block j of set h goes to rows at + j * block_rows of set h: piece h * blocks + j.
    let mut pieces: Vec<Option<&mut [f32]>> = Vec::with_capacity(parsed.len());
    for set in out.chunks_exact_mut(rows * d) {
        let blocks_of_set = set[at * d..].chunks_exact_mut(block_rows * d);
        pieces.extend(blocks_of_set.take(blocks).map(Some));
    }
    let work: Vec<_> = parsed
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let piece = pieces[(i % g) * blocks + i / g].take().unwrap_or_default();
            (p, Mutex::new(piece))
        })
        .collect();
    spread_jobs(
        &work,
        |(p, _)| single(p),
        |(p, _)| weight(p),
        threads,
        |(p, dst)| decode(p, &mut dst.lock().unwrap_or_else(|e| e.into_inner())),
    )?;
    Ok(())
}
