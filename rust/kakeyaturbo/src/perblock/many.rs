//! Many containers in one call: the encodes and decodes a cache makes of a layer's blocks at
//! once, spread over threads, each block's bytes or rows those of its own encode or decode.

use super::container::{from_bytes, to_bytes};
use super::layer::{decode_layer_into, encode_layer, EncodedLayer};
use super::params::CodecParams;
use crate::error::{input, Result};
use crate::limits::{size, zeros};
use crate::stack::{self, Layout};
use crate::threads::spread_jobs;

/// Several row sets (row-major `[n, d]` each, with `n`) coded at once with one set of
/// parameters, each to the container bytes [`encode_layer`] gives it: spread over `threads`
/// threads (`threads::spread_jobs`; a set of one block runs on one thread: the cache's
/// blocks). The first refused (in order) is the error.
pub fn encode_many(
    jobs: &[(&[f32], usize)],
    d: usize,
    p: &CodecParams,
    threads: Option<usize>,
) -> Result<Vec<Vec<u8>>> {
    spread_jobs(
        jobs,
        |&(_, n)| n <= p.block_size,
        |&(_, n)| n.saturating_mul(d),
        threads,
        |&(x, n)| Ok(to_bytes(&encode_layer(x, n, d, None, p, threads)?.0).0),
    )
}

/// The containers of `blocks` blocks of `g` row sets, block-major (`containers[j * g + h]`:
/// block `j` of set `h`), each of `block_rows` rows of one width `D`, decoded into
/// `[g, blocks * block_rows, D]` (set `h`'s blocks in order), each as [`super::decode_layer`]
/// gives it, spread over `threads` threads (a container of one block decodes on one thread: the
/// cache's sealed blocks); with `D`. Every container is parsed (and checked) before any is
/// decoded and before the output is allocated; the first refused (in order) is the error.
pub fn decode_blocks(
    containers: &[&[u8]],
    g: usize,
    block_rows: usize,
    threads: Option<usize>,
) -> Result<(Vec<f32>, usize)> {
    let (parsed, d) = parse_blocks(containers, g, block_rows)?;
    let rows = parsed.len() / g * block_rows;
    let mut out = zeros(size(g * rows, d, "the decoded rows")?, "the decoded rows")?;
    let to = Layout {
        g,
        block_rows,
        d,
        rows,
        at: 0,
    };
    write_blocks(&parsed, &to, &mut out, threads)?;
    Ok((out, d))
}

/// [`decode_blocks`] into rows `at ..` of each set of `out`, `[g, rows, D]` row-major (the
/// rest of `out` left as it is): a cache writes a layer's sealed blocks between the raw rows
/// it attends with. Refused as [`decode_blocks`] refuses, and where the blocks do not fit
/// `out` or are not `d` wide, before anything is written.
#[allow(clippy::too_many_arguments)]
pub fn decode_blocks_into(
    containers: &[&[u8]],
    g: usize,
    block_rows: usize,
    out: &mut [f32],
    rows: usize,
    d: usize,
    at: usize,
    threads: Option<usize>,
) -> Result<()> {
    let (parsed, width) = parse_blocks(containers, g, block_rows)?;
    if width != d && !parsed.is_empty() {
        return input(format!(
            "the containers hold rows of {width} values, not {d}"
        ));
    }
    write_blocks(
        &parsed,
        &Layout {
            g,
            block_rows,
            d,
            rows,
            at,
        },
        out,
        threads,
    )
}

/// The containers parsed: every one of `block_rows` rows and one width (returned), whole
/// blocks of `g` row sets.
fn parse_blocks(
    containers: &[&[u8]],
    g: usize,
    block_rows: usize,
) -> Result<(Vec<EncodedLayer>, usize)> {
    let parsed = containers
        .iter()
        .map(|b| from_bytes(b))
        .collect::<Result<Vec<_>>>()?;
    if let Some(n) = parsed.iter().map(|e| e.n).find(|&n| n != block_rows) {
        return input(format!(
            "a container holds {n} rows, not the {block_rows} of a block"
        ));
    }
    let d = parsed.first().map_or(0, |e| e.d);
    if parsed.iter().any(|e| e.d != d) {
        return input("the containers hold rows of different widths");
    }
    if g == 0 || parsed.len() % g != 0 {
        return input("the containers are not whole blocks of one row width");
    }
    Ok((parsed, d))
}

/// Decodes parsed blocks into their rows of `out` (`stack::decode_into`).
fn write_blocks(
    parsed: &[EncodedLayer],
    to: &Layout,
    out: &mut [f32],
    threads: Option<usize>,
) -> Result<()> {
    stack::decode_into(
        parsed,
        to,
        out,
        threads,
        |e| e.blocks.len() <= 1,
        |e| e.n.saturating_mul(e.d),
        |e, dst| decode_layer_into(e, threads, dst),
    )
}
