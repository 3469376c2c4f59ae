//! One attention step of one layer over sealed codes and raw rows (its inputs checked in
//! `checks.rs`): the split of every (batch row, kv-head) into fixed pieces of work, the pieces
//! on threads (which ones: `split.rs`), and their combination in a fixed order (so the result
//! is the same at any thread count).

use super::combine::combine;
use super::kernel::{Portable, Scratch, Tile, TILE};
use super::part::{code_part, raw_part, Ctx, Part, Prep, RawRows, Source};
use super::rope::KeyRope;
use super::split::{call_mode, sealed_work, ROWS_WORK, ROW_CHUNK};
use super::store::LayerCodes;
use crate::error::{param, Result};
use crate::threads::{run_all, Mode};
use std::ops::Range;

/// Tiles per piece of work over the codes (512 rows): fixed, so that the pieces, and hence
/// the result, do not depend on the thread count.
pub const SPLIT_TILES: usize = 8;

/// How scores are formed: `s = scale * q . k`, then `softcap * tanh(s / softcap)` when set,
/// then the additive mask; a query sees only positions at or before its own and, with a
/// `window`, the last `window` of them (its own included).
///
/// `latent`: multi-head latent attention in its absorbed form (DeepSeek's MLA): the K stream
/// holds each position's latent row (`D_k` wide) and the V stream its rotated key part (`D_v`
/// wide), a query is `[q_latent (D_k), q_rotated (D_v)]`, the score `q . [k, v]` (both streams
/// dotted), and the value sum runs over the K stream: the output is `D_k` wide (the latent
/// space; the model's value projection follows). Takes no key rotation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionParams {
    pub scale: f32,
    pub softcap: Option<f32>,
    pub window: Option<usize>,
    pub latent: bool,
}

/// The attention output `[B, H_q, n_q, D_v]` (`D_k` for latent attention) and the natural log of each query's softmax
/// denominator (`-inf` for a query that sees no position; its output is 0), `[B, H_q, n_q]`.
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionOutput {
    pub out: Vec<f32>,
    pub lse: Vec<f32>,
}

/// The instruction sets with a kernel of their own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// Plain Rust (compiled for AVX2 + FMA where the CPU has them).
    Portable,
    /// x86_64 with AVX-512 F, BW, VL and VBMI2.
    Avx512,
    /// x86_64 with AVX2, FMA, F16C and BMI2 (the CPUs without that AVX-512).
    Avx2,
}

impl Isa {
    /// The fastest one this CPU runs (found once).
    pub fn best() -> Isa {
        static BEST: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
        *BEST.get_or_init(|| {
            [Isa::Avx512, Isa::Avx2]
                .into_iter()
                .find(|i| i.runs_here())
                .unwrap_or(Isa::Portable)
        })
    }

    /// Whether this CPU runs this instruction set's kernel.
    pub fn runs_here(self) -> bool {
        match self {
            Isa::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => super::avx512::available(),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => super::avx2::available(),
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }
}

/// One step of attention of `n_q` query tokens per query head over a layer's positions:
/// `sink` rows (positions `0 .. S`), the sealed codes (`S .. S + T_c`, every (batch row,
/// kv-head) holding `T_c` rows), and `tail` rows (`S + T_c .. T`), whose last `n_q` rows are
/// the queries' own tokens (query `i` sits at position `T - n_q + i`).
///
/// `q` is `[B, H_q, n_q, D_k]` (query head `h` reads kv-head `h / (H_q / H_kv)`), in the
/// domain the keys were coded in; `mask` an optional additive `[B, n_q, T]` (finite or
/// `-inf`). Sealed scores come from the codes (no key is decoded), raw ones exactly, one
/// softmax over all; the value sum runs over the codes and is synthesised once per query.
/// With `rope` the keys were coded before RoPE: each sealed key is synthesised in its tile,
/// rotated to its position ([`KeyRope`]) and dotted with the queries (which are after RoPE,
/// as the raw rows are); without it the queries are in the keys' coded domain.
/// Checks every input; never panics on any; an output that overflows float32 is
/// [`crate::Error::Numerical`].
#[allow(clippy::too_many_arguments)]
pub fn attend(
    codes: &LayerCodes,
    q: &[f32],
    q_heads: usize,
    n_q: usize,
    sink: RawRows<'_>,
    tail: RawRows<'_>,
    mask: Option<&[f32]>,
    p: &AttentionParams,
    rope: Option<&KeyRope<'_>>,
) -> Result<AttentionOutput> {
    attend_with(
        Isa::best(),
        codes,
        q,
        q_heads,
        n_q,
        sink,
        tail,
        mask,
        p,
        rope,
    )
}

/// [`attend`] on a given instruction set (which this CPU must run: [`Isa::runs_here`]).
/// Every instruction set computes the same bits.
#[allow(clippy::too_many_arguments)]
pub fn attend_with(
    isa: Isa,
    codes: &LayerCodes,
    q: &[f32],
    q_heads: usize,
    n_q: usize,
    sink: RawRows<'_>,
    tail: RawRows<'_>,
    mask: Option<&[f32]>,
    p: &AttentionParams,
    rope: Option<&KeyRope<'_>>,
) -> Result<AttentionOutput> {
    if !isa.runs_here() {
        return param(format!("this CPU does not run the {isa:?} kernel"));
    }
    let cx = Ctx::new(codes, q, q_heads, n_q, sink, tail, mask, p, rope)?;
    // By the rows alone, as `PAIR_WORK` was measured (the query rows count only in
    // `auto_threads`' choice of the calling thread).
    let mode = call_mode(sealed_work(cx.batch * cx.kv_heads, cx.dk, cx.sealed, 1));
    // The queries moved into the code domain: one unit per (batch row, kv-head), or per
    // `ROW_CHUNK` of its query rows where they are many; each row is computed on its own, so
    // the units change no bit.
    let (prep_cost, combine_cost) = cx.row_costs();
    let (units, unit_mode) = cx.row_units(prep_cost, mode);
    let chunks = run_all(
        unit_mode,
        &units,
        |u| u.1.len(),
        || (),
        |_, u| prep(&cx, u.0, u.1.clone()),
    );
    let preps = Prep::gather(&units, chunks);
    let tasks = cx.tasks();
    // Run the pieces of the kv-heads of a batch row side by side (a worker takes neighbouring
    // tasks): keys coded before RoPE then reuse one tile's cos/sin across the heads. The parts
    // go back to task order, so the result does not depend on the order they ran in.
    let mut order: Vec<usize> = (0..tasks.len()).collect();
    order.sort_by_key(|&i| {
        let t = &tasks[i];
        (t.bh / cx.kv_heads, t.start(), t.bh % cx.kv_heads)
    });
    let ran = run_all(
        mode,
        &order,
        |&i| tasks[i].rows(),
        || Scratch::for_layer(codes),
        |s, &i| run_task(isa, &cx, &preps[tasks[i].bh], &tasks[i], s),
    );
    let mut slots: Vec<Option<Part>> = (0..tasks.len()).map(|_| None).collect();
    for (&i, p) in order.iter().zip(ran) {
        slots[i] = Some(p);
    }
    let parts: Vec<Part> = slots
        .into_iter()
        .map(|p| p.expect("every task ran once"))
        .collect();
    // Finite inputs and codes can still overflow float32 (scores or value sums of keys and
    // values near its limit): a typed error, never a NaN or a silently dropped position.
    if parts.iter().any(|p| p.overflow) {
        return Err(crate::error::Error::Numerical(
            "attention overflowed float32: a score is beyond its range".into(),
        ));
    }
    // Each (batch row, kv-head)'s parts combined and the value sums synthesised, by the
    // units of the queries' preparation (its rows on their own, as there).
    let (units, unit_mode) = cx.row_units(combine_cost, mode);
    let spans = task_spans(&tasks, cx.batch * cx.kv_heads);
    let done = run_all(
        unit_mode,
        &units,
        |u| u.1.len(),
        || (),
        |_, u| {
            let (start, end) = spans[u.0];
            combine(&cx, u.0, u.1.clone(), &parts[start..end])
        },
    );
    let out = cx.scatter(&units, done);
    if let Some(i) = out.out.iter().position(|v| !v.is_finite()) {
        return Err(crate::error::Error::Numerical(format!(
            "attention overflowed float32 (output value {} at flat index {i}): scores or \
             value sums beyond its range",
            out.out[i]
        )));
    }
    Ok(out)
}

/// A piece of work: raw rows `row0 .. row0 + rows` of one source at positions from `pos0`,
/// or tiles of codes (block, first row, rows, position).
#[derive(Debug)]
enum Work {
    Raw {
        src: Source,
        row0: usize,
        rows: usize,
        pos0: usize,
    },
    Code(Vec<(usize, usize, usize, usize)>),
}

#[derive(Debug)]
struct Task {
    bh: usize,
    work: Work,
}

impl Task {
    /// The first position the piece covers.
    fn start(&self) -> usize {
        match &self.work {
            Work::Raw { pos0, .. } => *pos0,
            Work::Code(tiles) => tiles.first().map_or(0, |t| t.3),
        }
    }

    /// The rows the piece covers.
    fn rows(&self) -> usize {
        match &self.work {
            Work::Raw { rows, .. } => *rows,
            Work::Code(tiles) => tiles.iter().map(|t| t.2).sum(),
        }
    }
}

impl<'a> Ctx<'a> {
    /// The queries of query rows `rows` of one (batch row, kv-head) moved into each domain.
    #[inline(always)]
    fn prep(&self, bh: usize, rows: Range<usize>) -> Prep {
        let (b, h) = (bh / self.kv_heads, bh % self.kv_heads);
        let t = self.codes.k_store(bh).tables();
        let t2 = self.codes.v_store(bh).tables();
        let (qr, dk, dq, m) = (rows.len(), self.dk, self.dq, t.m);
        let m2 = if self.latent { t2.m } else { 0 };
        let mut qs = vec![0f32; qr * dq];
        let mut w = vec![0f32; qr * m];
        let mut qm = vec![0f32; qr];
        let mut w2 = vec![0f32; qr * m2];
        let mut qm2 = vec![0f32; if self.latent { qr } else { 0 }];
        for (dst, r) in qs.chunks_exact_mut(dq.max(1)).zip(rows) {
            let (g, i) = (r / self.n_q, r % self.n_q);
            let at = ((b * self.q_heads + h * self.group + g) * self.n_q + i) * dq;
            for (o, &x) in dst.iter_mut().zip(&self.q[at..at + dq]) {
                *o = x * self.scale;
            }
        }
        if self.sealed > 0 && self.rope.is_none() {
            // Every query row at once (`query_weights_rows`: the synthesis read once per four).
            t.query_weights_rows(&qs, dq, &mut w, &mut qm);
            if self.latent {
                t2.query_weights_rows(&qs[dk..], dq, &mut w2, &mut qm2);
            }
        }
        Prep { qs, w, qm, w2, qm2 }
    }

    /// Multiply-adds per query row of [`Self::prep`] (moving a row into the code domain) and
    /// of [`Self::combine`] (synthesising its value sum), of the first (batch row, kv-head).
    fn row_costs(&self) -> (usize, usize) {
        let k = self.codes.k_store(0).tables().m;
        let v = self.codes.v_store(0).tables().m;
        let prep = if self.sealed == 0 || self.rope.is_some() {
            0
        } else if self.latent {
            self.dq * (k + v)
        } else {
            self.dq * k
        };
        (prep, self.value_store(0).tables().m * self.dout)
    }

    /// The units of [`Self::prep`] and [`Self::combine`]: every (batch row, kv-head) whole, or
    /// in [`ROW_CHUNK`]s of its query rows where a phase costs at least [`ROWS_WORK`]
    /// multiply-adds (`per_row` each); with the mode to run them in (on the calling thread
    /// below that).
    fn row_units(&self, per_row: usize, mode: Mode) -> (Vec<(usize, Range<usize>)>, Mode) {
        let (pairs, qr) = (self.batch * self.kv_heads, self.qr());
        let heavy = pairs.saturating_mul(qr).saturating_mul(per_row) >= ROWS_WORK;
        let chunk = if heavy { ROW_CHUNK } else { qr.max(1) };
        let units = (0..pairs)
            .flat_map(|bh| {
                (0..qr.max(1))
                    .step_by(chunk)
                    .map(move |r0| (bh, r0..qr.min(r0 + chunk)))
            })
            .collect();
        (units, if heavy { mode } else { Mode::Serial })
    }

    /// The pieces of every (batch row, kv-head), in position order within each.
    fn tasks(&self) -> Vec<Task> {
        let mut out = Vec::new();
        let step = SPLIT_TILES * TILE;
        for bh in 0..self.batch * self.kv_heads {
            let raw = |src, rows: usize, pos0: usize, out: &mut Vec<Task>| {
                for row0 in (0..rows).step_by(step) {
                    out.push(Task {
                        bh,
                        work: Work::Raw {
                            src,
                            row0,
                            rows: step.min(rows - row0),
                            pos0: pos0 + row0,
                        },
                    });
                }
            };
            raw(Source::Sink, self.sink.rows, 0, &mut out);
            let mut tiles = Vec::new();
            let mut pos = self.sink.rows;
            for (bi, blk) in self.codes.k_store(bh).blocks().iter().enumerate() {
                for row0 in (0..blk.n).step_by(TILE) {
                    tiles.push((bi, row0, TILE.min(blk.n - row0), pos + row0));
                }
                pos += blk.n;
            }
            for chunk in tiles.chunks(SPLIT_TILES) {
                out.push(Task {
                    bh,
                    work: Work::Code(chunk.to_vec()),
                });
            }
            raw(
                Source::Tail,
                self.tail.rows,
                self.sink.rows + self.sealed,
                &mut out,
            );
        }
        out
    }
}

impl Prep {
    /// One [`Prep`] per (batch row, kv-head) from the units of [`Ctx::row_units`] (in order).
    fn gather(units: &[(usize, Range<usize>)], chunks: Vec<Prep>) -> Vec<Prep> {
        let mut out: Vec<Prep> = Vec::new();
        for ((bh, _), c) in units.iter().zip(chunks) {
            if *bh < out.len() {
                let p = &mut out[*bh];
                p.qs.extend(c.qs);
                p.w.extend(c.w);
                p.qm.extend(c.qm);
                p.w2.extend(c.w2);
                p.qm2.extend(c.qm2);
            } else {
                out.push(c);
            }
        }
        out
    }
}

/// The range of tasks of each (batch row, kv-head) (`Ctx::tasks` keeps each one's together).
fn task_spans(tasks: &[Task], pairs: usize) -> Vec<(usize, usize)> {
    let mut spans = vec![(0, 0); pairs];
    let mut start = 0;
    while start < tasks.len() {
        let bh = tasks[start].bh;
        let end = start + tasks[start..].iter().take_while(|t| t.bh == bh).count();
        spans[bh] = (start, end);
        start = end;
    }
    spans
}

// The queries' transforms and the final combination and synthesis, compiled for FMA where the
// CPU has it (`mul_add` is otherwise a library call; the result is the same).
#[multiversion::multiversion(targets("x86_64+avx512f+avx512bw+avx512vl+fma", "x86_64+avx2+fma"))]
fn prep(cx: &Ctx<'_>, bh: usize, rows: Range<usize>) -> Prep {
    cx.prep(bh, rows)
}

fn run_task(isa: Isa, cx: &Ctx<'_>, prep: &Prep, t: &Task, s: &mut Scratch) -> Part {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `attend_with` runs the AVX-512 kernel only where the CPU has its features.
        Isa::Avx512 => unsafe { run_task_avx512(cx, prep, t, s) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `attend_with` runs the AVX2 kernel only where the CPU has its features.
        Isa::Avx2 => unsafe { run_task_avx2(cx, prep, t, s) },
        _ => run_task_portable(cx, prep, t, s),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx2,fma,f16c,bmi2")]
unsafe fn run_task_avx512(cx: &Ctx<'_>, prep: &Prep, t: &Task, s: &mut Scratch) -> Part {
    run_task_generic(super::avx512::Avx512, cx, prep, t, s)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,bmi2")]
unsafe fn run_task_avx2(cx: &Ctx<'_>, prep: &Prep, t: &Task, s: &mut Scratch) -> Part {
    run_task_generic(super::avx2::Avx2, cx, prep, t, s)
}

#[multiversion::multiversion(targets("x86_64+avx2+fma+f16c"))]
fn run_task_portable(cx: &Ctx<'_>, prep: &Prep, t: &Task, s: &mut Scratch) -> Part {
    run_task_generic(Portable, cx, prep, t, s)
}

/// One piece of work with the tile operations of `k`; inlined into each instruction set's
/// entry point so that everything around the tile operations is compiled for it too.
#[inline(always)]
fn run_task_generic<K: Tile>(k: K, cx: &Ctx<'_>, prep: &Prep, t: &Task, s: &mut Scratch) -> Part {
    match &t.work {
        Work::Raw {
            src,
            row0,
            rows,
            pos0,
        } => raw_part(cx, prep, t.bh, *src, *row0, *rows, *pos0),
        Work::Code(tiles) => code_part(k, cx, prep, t.bh, tiles, s),
    }
}
