//! Fuzzing of the two container readers, shared by the bounded run in `cargo test`
//! (`tests/fuzz_containers.rs`) and the long run (`examples/fuzz_containers.rs`, `make fuzz`).
//!
//! Inputs are valid containers of both modes (per-block `KKYT`, calibrated `KKYC`, over the
//! corners of the formats), mutated: bit flips, byte sets, size fields overwritten with
//! boundary values, truncation, insertion, deletion, duplication. The CRC-32 is recomputed for
//! 15 of 16 inputs, so that the structural parser, not the checksum, meets the mutation. For
//! each input the reader and then the decoder must either return a typed error or finite
//! values of the size the header states, never panic, and never allocate more than the input
//! can describe (checked by the counting allocator below, which refuses any single request
//! above [`HARD_LIMIT`] outright).

#![allow(dead_code)]

use kakeyaturbo::calibrated::{self, CalibratedCodec, CalibratedParams};
use kakeyaturbo::rng::SplitMix64;
use kakeyaturbo::{decode_layer, encode_layer, from_bytes, to_bytes, CodecParams};
use kakeyaturbo::{Metric, PcaMethod, SkeletonDtype};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

// ---- the allocator ------------------------------------------------------------------------

/// Largest single request since the last [`reset_peak`], over every thread.
static PEAK: AtomicUsize = AtomicUsize::new(0);
/// Requests above this are refused (null), so that a missing bounds check fails the run
/// instead of taking the machine's memory.
pub const HARD_LIMIT: usize = 1 << 30;

/// Forwards to the system allocator, recording the largest request.
pub struct Counting;

fn note(size: usize) -> bool {
    PEAK.fetch_max(size, Ordering::Relaxed);
    size <= HARD_LIMIT
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        if note(l.size()) {
            System.alloc(l)
        } else {
            std::ptr::null_mut()
        }
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        if note(l.size()) {
            System.alloc_zeroed(l)
        } else {
            std::ptr::null_mut()
        }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        if note(new) {
            System.realloc(p, l, new)
        } else {
            std::ptr::null_mut()
        }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        System.dealloc(p, l)
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

pub fn reset_peak() {
    PEAK.store(0, Ordering::Relaxed);
}

pub fn peak() -> usize {
    PEAK.load(Ordering::Relaxed)
}

/// What `len` input bytes may legitimately make a decoder allocate in one piece: every row
/// costs at least one byte and decodes to at most `MAX_DIM` float32 values.
pub fn allowed(len: usize) -> usize {
    (1 << 20) + len * kakeyaturbo::MAX_DIM * 4
}

// ---- the corpus ---------------------------------------------------------------------------

fn rows(n: usize, d: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut g = SplitMix64::new(seed);
    (0..n * d)
        .map(|i| {
            let u = (g.next_u64() >> 40) as f32 / 16777216.0 - 0.5;
            u * scale * 4.0 / (1.0 + (i % d) as f32)
        })
        .collect()
}

/// Valid per-block containers over the corners of the format.
pub fn perblock_corpus() -> Vec<Vec<u8>> {
    let randomized = PcaMethod::Randomized {
        target_rank: Some(3),
        oversample: 2,
        power_iters: 1,
    };
    let cases: Vec<(usize, usize, f32, CodecParams)> = vec![
        (
            70,
            12,
            1.0,
            CodecParams {
                block_size: 32,
                ..Default::default()
            },
        ),
        // One centre: 0-bit segment ids; one block as wide as a u32 allows.
        (
            40,
            6,
            1.0,
            CodecParams {
                k: 1,
                block_size: u32::MAX as usize,
                ..Default::default()
            },
        ),
        (
            50,
            9,
            3.0,
            CodecParams {
                share_basis: true,
                skeleton_dtype: SkeletonDtype::F32,
                pca_method: randomized,
                outlier_threshold: Some(1.5),
                centroids: Some(vec![-1.2, -0.4, 0.4, 1.2]),
                bit_width: 2,
                block_size: 16,
                ..Default::default()
            },
        ),
        (
            23,
            5,
            1.0,
            CodecParams {
                metric: Metric::InnerProduct,
                bit_width: 1,
                block_size: 7,
                ..Default::default()
            },
        ),
        (3, 1, 1.0, CodecParams::default()),
        (
            40,
            33,
            1.0,
            CodecParams {
                bit_width: 4,
                outlier_threshold: Some(2.0),
                block_size: 20,
                ..Default::default()
            },
        ),
        // Magnitudes beyond the float32 range of the scales: pre-scaled, large exponents.
        (
            30,
            8,
            1e37,
            CodecParams {
                block_size: 16,
                metric: Metric::InnerProduct,
                ..Default::default()
            },
        ),
    ];
    cases
        .into_iter()
        .enumerate()
        .map(|(i, (n, d, scale, p))| {
            let x = rows(n, d, i as u64 + 1, scale);
            to_bytes(&encode_layer(&x, n, d, None, &p, Some(1)).unwrap().0).0
        })
        .collect()
}

/// The corpus calibrations, in a fixed order (the libFuzzer target picks one by index).
pub fn calibrated_codecs() -> Vec<CalibratedCodec> {
    let cal = |d: usize, bits: Vec<u8>, norm: bool, metric: Metric, outl: Option<f32>| {
        let m = bits.len();
        let mut g = SplitMix64::new(d as u64 * 31 + m as u64);
        let a: Vec<f32> = (0..m * d)
            .map(|_| (g.next_u64() >> 40) as f32 / 16777216.0 - 0.5)
            .collect();
        let tables = if norm {
            vec![(3u8, vec![-2.2, -1.3, -0.7, -0.2, 0.2, 0.7, 1.3, 2.2])]
        } else {
            vec![]
        };
        CalibratedCodec::new(
            d,
            vec![0.25; d],
            a.clone(),
            a.iter().map(|v| v * 1.5).collect(),
            (0..m).map(|j| 1.0 / (1.0 + j as f32)).collect(),
            bits,
            tables,
            CalibratedParams {
                rotation_seed: 0xCAFE_BABE,
                metric,
                outlier_threshold: outl,
                norm,
            },
        )
        .unwrap()
    };
    vec![
        cal(
            12,
            vec![5, 4, 4, 3, 3, 3, 2, 1],
            true,
            Metric::InnerProduct,
            Some(1.8),
        ),
        cal(6, vec![8; 6], false, Metric::Mse, None),
        cal(16, vec![1, 1, 1], true, Metric::Mse, Some(0.5)),
    ]
}

/// Valid containers of each corpus calibration.
pub fn calibrated_corpus() -> Vec<(CalibratedCodec, Vec<u8>)> {
    let mut out = Vec::new();
    for (i, c) in calibrated_codecs().into_iter().enumerate() {
        for (n, scale) in [(1, 1.0), (5, 1.0), (70, 1.0), (9, 1e36)] {
            let x = rows(n, c.d, 100 + i as u64 * 7 + n as u64, scale);
            let bytes = c.to_bytes(&c.encode(&x, n).unwrap()).0;
            out.push((c.clone(), bytes));
        }
    }
    out
}

// ---- mutations ----------------------------------------------------------------------------

/// One change to a container; positions are taken modulo its length.
#[derive(Debug, Clone)]
pub enum Mutation {
    Flip {
        at: usize,
        bit: u8,
    },
    Set {
        at: usize,
        byte: u8,
    },
    /// Overwrites `width` (1, 2, 4 or 8) bytes at `at` with a little-endian boundary value.
    Field {
        at: usize,
        width: u8,
        value: u64,
    },
    Truncate {
        len: usize,
    },
    Insert {
        at: usize,
        bytes: Vec<u8>,
    },
    Delete {
        at: usize,
        len: usize,
    },
    Duplicate {
        at: usize,
        len: usize,
    },
}

/// Values at the edges of the size fields' ranges.
pub const BOUNDARY: [u64; 16] = [
    0,
    1,
    2,
    3,
    7,
    8,
    255,
    0x7fff,
    0xffff,
    0x7fff_ffff,
    0xffff_ffff,
    1 << 32,
    1 << 40,
    1 << 61,
    u64::MAX,
    u64::MAX / 2,
];

impl Mutation {
    pub fn random(g: &mut SplitMix64) -> Self {
        let r = |g: &mut SplitMix64, n: u64| (g.next_u64() % n) as usize;
        match r(g, 7) {
            0 => Mutation::Flip {
                at: r(g, 1 << 20),
                bit: r(g, 8) as u8,
            },
            1 => Mutation::Set {
                at: r(g, 1 << 20),
                byte: r(g, 256) as u8,
            },
            2 => Mutation::Field {
                at: r(g, 1 << 20),
                width: [1, 2, 4, 8][r(g, 4)],
                value: if r(g, 4) == 0 {
                    g.next_u64() >> r(g, 64)
                } else {
                    BOUNDARY[r(g, BOUNDARY.len() as u64)]
                },
            },
            3 => Mutation::Truncate { len: r(g, 1 << 20) },
            4 => Mutation::Insert {
                at: r(g, 1 << 20),
                bytes: (0..1 + r(g, 16)).map(|_| g.next_u64() as u8).collect(),
            },
            5 => Mutation::Delete {
                at: r(g, 1 << 20),
                len: 1 + r(g, 16),
            },
            _ => Mutation::Duplicate {
                at: r(g, 1 << 20),
                len: 1 + r(g, 32),
            },
        }
    }

    pub fn apply(&self, b: &mut Vec<u8>) {
        if b.is_empty() {
            return;
        }
        let n = b.len();
        match *self {
            Mutation::Flip { at, bit } => b[at % n] ^= 1 << (bit % 8),
            Mutation::Set { at, byte } => b[at % n] = byte,
            Mutation::Field { at, width, value } => {
                let w = (width as usize).min(n);
                let at = at % (n - w + 1);
                b[at..at + w].copy_from_slice(&value.to_le_bytes()[..w]);
            }
            Mutation::Truncate { len } => b.truncate(len % n),
            Mutation::Insert { at, ref bytes } => {
                let at = at % (n + 1);
                b.splice(at..at, bytes.iter().copied());
            }
            Mutation::Delete { at, len } => {
                let at = at % n;
                b.drain(at..(at + len).min(n));
            }
            Mutation::Duplicate { at, len } => {
                let at = at % n;
                let piece = b[at..(at + len).min(n)].to_vec();
                b.splice(at..at, piece);
            }
        }
    }
}

/// `b` with its last four bytes replaced by the CRC-32 of the others (shorter: unchanged).
pub fn with_crc(b: &[u8]) -> Vec<u8> {
    let mut b = b.to_vec();
    if b.len() >= 4 {
        let at = b.len() - 4;
        let crc = crc32fast::hash(&b[..at]);
        b[at..].copy_from_slice(&crc.to_le_bytes());
    }
    b
}

/// Applies the mutations, then (unless `keep_crc`) recomputes the trailing CRC-32.
pub fn mutate(base: &[u8], muts: &[Mutation], keep_crc: bool) -> Vec<u8> {
    let mut b = base.to_vec();
    for m in muts {
        m.apply(&mut b);
    }
    if keep_crc {
        b
    } else {
        with_crc(&b)
    }
}

// ---- the checks ---------------------------------------------------------------------------

/// What became of an input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Refused,
    Decoded,
}

/// Reads and decodes a per-block container; panics (with the reason) if a guarantee breaks.
pub fn check_perblock(bytes: &[u8]) -> Outcome {
    reset_peak();
    let out = match from_bytes(bytes) {
        Err(_) => Outcome::Refused,
        Ok(layer) => match decode_layer(&layer, None) {
            Err(_) => Outcome::Refused,
            Ok(y) => {
                assert_eq!(y.len(), layer.n * layer.d, "decoded size");
                assert!(y.iter().all(|v| v.is_finite()), "non-finite decoded value");
                Outcome::Decoded
            }
        },
    };
    assert!(
        peak() <= allowed(bytes.len()),
        "{} input bytes made one allocation of {} bytes",
        bytes.len(),
        peak()
    );
    out
}

/// Reads and decodes a calibrated container with the calibration that wrote it.
pub fn check_calibrated(codec: &CalibratedCodec, bytes: &[u8]) -> Outcome {
    reset_peak();
    let _ = calibrated::read_header(bytes);
    let out = match codec.from_bytes(bytes) {
        Err(_) => Outcome::Refused,
        Ok(codes) => match codec.decode(&codes) {
            Err(_) => Outcome::Refused,
            Ok(y) => {
                assert_eq!(y.len(), codes.n * codec.d, "decoded size");
                assert!(y.iter().all(|v| v.is_finite()), "non-finite decoded value");
                Outcome::Decoded
            }
        },
    };
    assert!(
        peak() <= allowed(bytes.len()),
        "{} input bytes made one allocation of {} bytes",
        bytes.len(),
        peak()
    );
    out
}

/// Totals of a run.
#[derive(Debug, Default, Clone, Copy)]
pub struct Tally {
    pub inputs: u64,
    pub refused: u64,
    pub decoded: u64,
}

impl Tally {
    pub fn add(&mut self, o: Outcome) {
        self.inputs += 1;
        match o {
            Outcome::Refused => self.refused += 1,
            Outcome::Decoded => self.decoded += 1,
        }
    }
}

/// One random input from `g`: a container of either mode, 1 to 4 mutations, the CRC recomputed
/// 15 times in 16. Returns what became of it; panics if a guarantee breaks.
pub fn one(
    g: &mut SplitMix64,
    perblock: &[Vec<u8>],
    calibrated: &[(CalibratedCodec, Vec<u8>)],
) -> Outcome {
    let muts: Vec<Mutation> = (0..1 + g.next_u64() % 4)
        .map(|_| Mutation::random(g))
        .collect();
    let keep_crc = g.next_u64().is_multiple_of(16);
    if g.next_u64().is_multiple_of(2) {
        let base = &perblock[(g.next_u64() % perblock.len() as u64) as usize];
        check_perblock(&mutate(base, &muts, keep_crc))
    } else {
        let (c, base) = &calibrated[(g.next_u64() % calibrated.len() as u64) as usize];
        check_calibrated(c, &mutate(base, &muts, keep_crc))
    }
}
