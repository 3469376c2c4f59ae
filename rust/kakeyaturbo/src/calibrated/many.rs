//! Many blocks in one call: the encodes and decodes a cache makes of a layer's blocks at once,
//! spread over threads, each block's bytes or rows those of its own encode or decode.

use super::calibration::CalibratedCodec;
use super::codec::{CalibratedCodes, CHUNK_ROWS};
use crate::error::{input, Error, Result};
use crate::limits::size;
use crate::stack::{self, Layout};
use crate::threads::spread_jobs;

/// One encode of [`encode_many`]: the calibration, its rows (row-major `[n, D]`) and `n`.
pub type EncodeJob<'a> = (&'a CalibratedCodec, &'a [f32], usize);

/// One decode of [`decode_many`]: the calibration and a container of it.
pub type DecodeJob<'a> = (&'a CalibratedCodec, &'a [u8]);

/// Several encodes at once, each against its own calibration, to container bytes in the jobs'
/// order, spread over `threads` threads (`threads::spread_jobs`; an encode of one chunk runs on one thread): a cache sealing a long prompt codes
/// every block of every kv-head of a layer in one call. Each job's bytes are its own encode's,
/// whatever thread ran it; the first job refused (in order) is the error.
pub fn encode_many(jobs: &[EncodeJob<'_>], threads: Option<usize>) -> Result<Vec<Vec<u8>>> {
    spread_jobs(
        jobs,
        |&(_, _, n)| n <= CHUNK_ROWS,
        |&(c, _, n)| n.saturating_mul(c.d),
        threads,
        |&(c, x, n)| Ok(c.to_bytes(&c.encode(x, n)?).0),
    )
}

/// Several decodes at once into one array, each container against its own calibration: the
/// containers of `blocks` blocks of `g` row sets, block-major (`jobs[j * g + h]`: block `j` of
/// set `h`), each of `block_rows` rows, decoded into `[g, blocks * block_rows, D]` (set `h`'s
/// blocks in order; `D` the first calibration's, which every other must share), each block as
/// its own decode gives it, spread as [`encode_many`] spreads its jobs. Every container is
/// parsed (and checked) before any is decoded; the first refused (in order) is the error, and
/// a container of another row count or width is refused before the output is allocated.
pub fn decode_many(
    jobs: &[DecodeJob<'_>],
    g: usize,
    block_rows: usize,
    threads: Option<usize>,
) -> Result<Vec<f32>> {
    let (parsed, d) = parse_blocks(jobs, g, block_rows)?;
    // The rows are those the containers hold (checked above).
    let rows = parsed.len() / g * block_rows;
    let mut out: Vec<f32> = Vec::new();
    out.try_reserve_exact(size(g * rows, d, "the decoded rows")?)
        .map_err(|_| Error::InvalidInput("cannot allocate the decoded rows".into()))?;
    out.resize(g * rows * d, 0.0);
    let to = Layout {
        g,
        block_rows,
        d,
        rows,
        at: 0,
    };
    write_blocks(&parsed, &to, &mut out, threads)?;
    Ok(out)
}

/// [`decode_many`] into rows `at ..` of each set of `out`, `[g, rows, D]` row-major (the rest
/// of `out` left as it is): a cache writes a layer's sealed blocks between the raw rows it
/// attends with. Refused as [`decode_many`] refuses, and where the blocks do not fit `out`,
/// before anything is written.
pub fn decode_many_into(
    jobs: &[DecodeJob<'_>],
    g: usize,
    block_rows: usize,
    out: &mut [f32],
    rows: usize,
    at: usize,
    threads: Option<usize>,
) -> Result<()> {
    let (parsed, d) = parse_blocks(jobs, g, block_rows)?;
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

/// Containers parsed and checked against their calibrations, with the width of their rows.
type Parsed<'a> = (Vec<(&'a CalibratedCodec, CalibratedCodes)>, usize);

/// [`decode_many`]'s jobs parsed: every container of `block_rows` rows of one width, whole
/// blocks of `g` row sets.
fn parse_blocks<'a>(jobs: &[DecodeJob<'a>], g: usize, block_rows: usize) -> Result<Parsed<'a>> {
    let parsed = jobs
        .iter()
        .map(|&(c, b)| Ok((c, c.from_bytes(b)?)))
        .collect::<Result<Vec<_>>>()?;
    if let Some(n) = parsed.iter().map(|(_, k)| k.n).find(|&n| n != block_rows) {
        return input(format!(
            "a container holds {n} rows, not the {block_rows} of a block"
        ));
    }
    let d = parsed.first().map_or(0, |(c, _)| c.d);
    if parsed.iter().any(|(c, _)| c.d != d) || g == 0 || parsed.len() % g != 0 {
        return input("the containers are not whole blocks of one row width");
    }
    Ok((parsed, d))
}

/// Decodes parsed blocks into their rows of `out` (`stack::decode_into`).
fn write_blocks(
    parsed: &[(&CalibratedCodec, CalibratedCodes)],
    to: &Layout,
    out: &mut [f32],
    threads: Option<usize>,
) -> Result<()> {
    stack::decode_into(
        parsed,
        to,
        out,
        threads,
        |(_, k)| k.n <= CHUNK_ROWS,
        |(c, k)| k.n.saturating_mul(c.d),
        |(c, k), dst| c.decode_into(k, dst),
    )
}

#[cfg(test)]
mod tests {
    use super::super::testutil::{codec, rows};
    use super::*;
    use crate::metric::Metric;

    #[test]
    fn decode_many_stacks_each_blocks_own_decode() {
        // Two row sets (two calibrations), three blocks of 40 rows, block-major.
        let cals = [
            codec(8, vec![3; 6], true, Metric::Mse, Some(2.0)),
            codec(8, vec![2; 5], false, Metric::Mse, None),
        ];
        let blobs: Vec<Vec<u8>> = (0..6)
            .map(|i| {
                let c = &cals[i % 2];
                c.to_bytes(&c.encode(&rows(c, 40, i as u64), 40).unwrap()).0
            })
            .collect();
        let jobs: Vec<DecodeJob<'_>> = blobs
            .iter()
            .enumerate()
            .map(|(i, b)| (&cals[i % 2], &b[..]))
            .collect();
        for threads in [None, Some(1), Some(2)] {
            let y = decode_many(&jobs, 2, 40, threads).unwrap();
            assert_eq!(y.len(), 2 * 3 * 40 * 8);
            for (i, &(c, b)) in jobs.iter().enumerate() {
                let (h, j) = (i % 2, i / 2);
                let at = (h * 3 + j) * 40 * 8;
                assert_eq!(
                    &y[at..at + 40 * 8],
                    &c.decode(&c.from_bytes(b).unwrap()).unwrap()[..]
                );
            }
        }
        assert!(matches!(
            decode_many(&jobs, 2, 41, None),
            Err(Error::InvalidInput(_))
        ));
        assert!(matches!(
            decode_many(&jobs[..5], 2, 40, None),
            Err(Error::InvalidInput(_))
        ));
        let other = codec(4, vec![2; 3], true, Metric::Mse, None);
        let small = other
            .to_bytes(&other.encode(&rows(&other, 40, 9), 40).unwrap())
            .0;
        let mixed = [jobs[0], (&other, &small[..])];
        assert!(matches!(
            decode_many(&mixed, 2, 40, None),
            Err(Error::InvalidInput(_))
        ));
        let mut bad = blobs[3].clone();
        bad[20] ^= 0xff;
        let broken = [jobs[0], (&cals[1], &bad[..])];
        assert!(matches!(
            decode_many(&broken, 2, 40, None),
            Err(Error::Corrupt(_))
        ));
        assert!(decode_many(&[], 1, 40, None).unwrap().is_empty());
        // Into rows 5.. of sets of 130 rows, the rows around them untouched; blocks past the end
        // refused before anything is written.
        let mut out = vec![7.0f32; 2 * 130 * 8];
        decode_many_into(&jobs, 2, 40, &mut out, 130, 5, Some(2)).unwrap();
        let whole = decode_many(&jobs, 2, 40, None).unwrap();
        for h in 0..2 {
            let set = &out[h * 130 * 8..(h + 1) * 130 * 8];
            assert!(set[..5 * 8]
                .iter()
                .chain(&set[125 * 8..])
                .all(|&v| v == 7.0));
            assert_eq!(&set[5 * 8..125 * 8], &whole[h * 120 * 8..(h + 1) * 120 * 8]);
        }
        let mut short = vec![7.0f32; 2 * 130 * 8];
        for (rows, at) in [(130, 11), (119, 0)] {
            let out = &mut short[..2 * rows * 8];
            assert!(matches!(
                decode_many_into(&jobs, 2, 40, out, rows, at, None),
                Err(Error::InvalidInput(_))
            ));
        }
        assert!(short.iter().all(|&v| v == 7.0));
        assert!(matches!(
            decode_many_into(&jobs, 2, 40, &mut short[1..], 130, 0, None),
            Err(Error::InvalidInput(_))
        ));
    }
}
