//! One attention step of one layer over sealed codes and raw rows (its inputs checked in
//! `checks.rs`): the split of every (batch row, kv-head) into fixed pieces of work, the pieces
//! on rayon (small calls on a pool of two, from outside it: about half the rows on the calling
//! thread, the rest on one scoped thread), and their combination in a fixed order (so the
//! result is the same at any thread count).

use super::kernel::{Portable, Scratch, Tile, TILE};
use super::math::exp_neg;
use super::part::{code_part, raw_part, Ctx, Part, Prep, RawRows, Source};
use super::rope::KeyRope;
use super::store::LayerCodes;
use crate::error::{param, Result};
use rayon::prelude::*;

/// Tiles per piece of work over the codes (512 rows): fixed, so that the pieces, and hence
/// the result, do not depend on the thread count.
pub const SPLIT_TILES: usize = 8;

/// Sealed work (batch rows x kv-heads x sealed rows x `D_k`) up to which a call that asks
/// for all cores (`threads = None`) runs on the calling thread instead ([`auto_threads`]):
/// 2,048 positions of 3 kv-heads of 64 dims take about 0.7 ms on one core of the 2-core test
/// machine and gained nothing from a second thread, whose wake-up costs about 0.3 ms there
/// (`benches/bench_generate.py --kernel-threads 1,2`: one thread was the faster at 2k, two at
/// 8k).
pub const INLINE_WORK: usize = 1 << 19;

/// The most sealed work (as for [`INLINE_WORK`]) that a call on a pool of two threads, from
/// outside it, splits between the calling thread and one scoped thread instead of handing it
/// to the pool (measured on a 2-core VM, 2026-12-04, README "Generation through the codes": in
/// generation at 8k tokens, 1.6M elements, the split cut the attention from 45-61 to 34-38 ms
/// per token; on 8.4M-element calls after an idle pause the pool's workers were faster).
pub const PAIR_WORK: usize = 1 << 21;

/// The thread count a call run through `threads::with_threads_inline` should use: `threads`
/// as asked, except that `None` becomes `Some(1)` (the calling thread) for at most
/// [`INLINE_WORK`] of sealed work. The result never depends on it.
pub fn auto_threads(codes: &LayerCodes, threads: Option<usize>) -> Option<usize> {
    let rows = codes.common_rows().unwrap_or(usize::MAX);
    let work = sealed_work(codes.batch() * codes.kv_heads(), codes.k_dim(), rows);
    match threads {
        None if work <= INLINE_WORK => Some(1),
        t => t,
    }
}

/// The sealed work of a call, as [`INLINE_WORK`] and [`PAIR_WORK`] count it: (batch rows x
/// kv-heads) x `D_k` x sealed rows per (batch row, kv-head).
fn sealed_work(pairs: usize, dk: usize, rows: usize) -> usize {
    pairs.saturating_mul(dk).saturating_mul(rows)
}

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
}

impl Isa {
    /// The fastest one this CPU runs.
    pub fn best() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            if super::avx512::available() {
                return Isa::Avx512;
            }
        }
        Isa::Portable
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

/// [`attend`] on a given instruction set (which this CPU must run: [`Isa::best`] or
/// [`Isa::Portable`]). Every instruction set computes the same bits.
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
    if isa == Isa::Avx512 && Isa::best() != Isa::Avx512 {
        return param("this CPU does not run the AVX-512 kernel");
    }
    let cx = Ctx::new(codes, q, q_heads, n_q, sink, tail, mask, p, rope)?;
    // One thread (`threads::with_threads_inline`): the same pieces in the same order, on the
    // calling thread.
    let serial = crate::threads::inline();
    let work = sealed_work(cx.batch * cx.kv_heads, cx.dk, cx.sealed);
    let pair = !serial && work <= PAIR_WORK && pair_here();
    let preps: Vec<Prep> = if serial || pair {
        (0..cx.batch * cx.kv_heads)
            .map(|bh| prep(&cx, bh))
            .collect()
    } else {
        (0..cx.batch * cx.kv_heads)
            .into_par_iter()
            .map(|bh| prep(&cx, bh))
            .collect()
    };
    let tasks = cx.tasks();
    // Run the pieces of the kv-heads of a batch row side by side (a worker takes neighbouring
    // tasks): keys coded before RoPE then reuse one tile's cos/sin across the heads. The parts
    // go back to task order, so the result does not depend on the order they ran in.
    let mut order: Vec<usize> = (0..tasks.len()).collect();
    order.sort_by_key(|&i| {
        let t = &tasks[i];
        (t.bh / cx.kv_heads, t.start(), t.bh % cx.kv_heads)
    });
    let run = |s: &mut Scratch, &i: &usize| run_task(isa, &cx, &preps[tasks[i].bh], &tasks[i], s);
    let ran: Vec<Part> = if serial {
        let mut s = Scratch::for_layer(codes);
        order.iter().map(|i| run(&mut s, i)).collect()
    } else if pair {
        // Two threads asked of a pool of two, from outside it: the caller runs the first half
        // of the rows and one scoped thread the second, instead of handing every piece to
        // the pool's two workers and sleeping until they finish (one wake-up, not two).
        let rows: Vec<usize> = order.iter().map(|&i| tasks[i].rows()).collect();
        let (a, b) = order.split_at(crate::threads::halfway(&rows));
        std::thread::scope(|sc| {
            let helper = std::thread::Builder::new().spawn_scoped(sc, || {
                let mut s = Scratch::for_layer(codes);
                b.iter().map(|i| run(&mut s, i)).collect::<Vec<Part>>()
            });
            let mut s = Scratch::for_layer(codes);
            let mut parts: Vec<Part> = a.iter().map(|i| run(&mut s, i)).collect();
            match helper {
                Ok(h) => match h.join() {
                    Ok(rest) => parts.extend(rest),
                    Err(e) => std::panic::resume_unwind(e),
                },
                // No thread to be had: the caller runs the rest too.
                Err(_) => parts.extend(b.iter().map(|i| run(&mut s, i))),
            }
            parts
        })
    } else {
        order
            .par_iter()
            .map_init(|| Scratch::for_layer(codes), run)
            .collect()
    };
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
    let out = combine(&cx, &tasks, &parts);
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
    #[inline(always)]
    fn prep(&self, bh: usize) -> Prep {
        let (b, h) = (bh / self.kv_heads, bh % self.kv_heads);
        let t = self.codes.k_store(bh).tables();
        let t2 = self.codes.v_store(bh).tables();
        let (qr, dk, dq, m) = (self.qr(), self.dk, self.dq, t.m);
        let m2 = if self.latent { t2.m } else { 0 };
        let mut qs = vec![0f32; qr * dq];
        let mut w = vec![0f32; qr * m];
        let mut qm = vec![0f32; qr];
        let mut w2 = vec![0f32; qr * m2];
        let mut qm2 = vec![0f32; if self.latent { qr } else { 0 }];
        for r in 0..qr {
            let (g, i) = (r / self.n_q, r % self.n_q);
            let at = ((b * self.q_heads + h * self.group + g) * self.n_q + i) * dq;
            let dst = &mut qs[r * dq..(r + 1) * dq];
            for (o, &x) in dst.iter_mut().zip(&self.q[at..at + dq]) {
                *o = x * self.scale;
            }
        }
        if self.sealed > 0 && self.rope.is_none() {
            // Every query row at once (`query_weights_rows`: the synthesis read once).
            t.query_weights_rows(&qs, dq, &mut w, &mut qm);
            if self.latent {
                t2.query_weights_rows(&qs[dk..], dq, &mut w2, &mut qm2);
            }
        }
        Prep { qs, w, qm, w2, qm2 }
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

    #[inline(always)]
    fn combine(&self, tasks: &[Task], parts: &[Part]) -> AttentionOutput {
        let (qr, dv, n_q) = (self.qr(), self.dout, self.n_q);
        let mut out = vec![0f32; self.batch * self.q_heads * n_q * dv];
        let mut lse = vec![f32::NEG_INFINITY; self.batch * self.q_heads * n_q];
        let mut start = 0;
        while start < tasks.len() {
            let bh = tasks[start].bh;
            let end = start + tasks[start..].iter().take_while(|t| t.bh == bh).count();
            let (b, h) = (bh / self.kv_heads, bh % self.kv_heads);
            let vt = self.value_store(bh).tables();
            let m = vt.m;
            // Per query row: the parts combined; then one synthesis of every row with a
            // code-domain sum (`synthesize_rows`: the synthesis read once for all of them).
            let mut a = vec![0f32; qr * m];
            let mut raw = vec![0f32; qr * dv];
            let (mut bigs, mut ls) = (vec![0f32; qr], vec![0f32; qr]);
            let (mut coded, mut pcs) = (Vec::new(), Vec::new());
            for r in 0..qr {
                let big = parts[start..end]
                    .iter()
                    .fold(f32::NEG_INFINITY, |x, p| x.max(p.mx[r]));
                let (mut l, mut pc) = (0f32, 0f32);
                let a = &mut a[r * m..(r + 1) * m];
                let raw = &mut raw[r * dv..(r + 1) * dv];
                let mut any_code = false;
                for p in &parts[start..end] {
                    if p.mx[r] == f32::NEG_INFINITY {
                        continue;
                    }
                    let f = exp_neg(p.mx[r] - big);
                    l = p.l[r].mul_add(f, l);
                    if p.code {
                        any_code = true;
                        pc = p.l[r].mul_add(f, pc);
                        for (x, &y) in a.iter_mut().zip(&p.acc[r * m..(r + 1) * m]) {
                            *x = y.mul_add(f, *x);
                        }
                    } else {
                        for (x, &y) in raw.iter_mut().zip(&p.acc[r * dv..(r + 1) * dv]) {
                            *x = y.mul_add(f, *x);
                        }
                    }
                }
                (bigs[r], ls[r]) = (big, l);
                if l != 0.0 && any_code {
                    coded.push(r);
                    pcs.push(pc);
                }
            }
            let mut sums = Vec::with_capacity(coded.len() * m);
            for &r in &coded {
                sums.extend_from_slice(&a[r * m..(r + 1) * m]);
            }
            let mut o = vec![0f32; coded.len() * dv];
            vt.synthesize_rows(&mut sums, &pcs, &mut o);
            let zero = vec![0f32; dv];
            let mut k = 0;
            for r in 0..qr {
                let l = ls[r];
                if l == 0.0 {
                    continue;
                }
                let x = if coded.get(k) == Some(&r) {
                    k += 1;
                    &o[(k - 1) * dv..k * dv]
                } else {
                    &zero[..]
                };
                let (g, i) = (r / n_q, r % n_q);
                let row = (b * self.q_heads + h * self.group + g) * n_q + i;
                let raw = &raw[r * dv..(r + 1) * dv];
                for ((x, &y), dst) in x.iter().zip(raw).zip(&mut out[row * dv..(row + 1) * dv]) {
                    *dst = (x + y) / l;
                }
                lse[row] = bigs[r] + l.ln();
            }
            start = end;
        }
        AttentionOutput { out, lse }
    }
}

/// Whether a call of at most [`PAIR_WORK`] splits its pieces between the calling thread and one
/// scoped thread: the pool it would run on has two threads and the caller is not one of them.
fn pair_here() -> bool {
    rayon::current_num_threads() == 2 && rayon::current_thread_index().is_none()
}

// The queries' transforms and the final combination and synthesis, compiled for FMA where the
// CPU has it (`mul_add` is otherwise a library call; the result is the same).
#[multiversion::multiversion(targets("x86_64+avx512f+avx512bw+avx512vl+fma", "x86_64+avx2+fma"))]
fn prep(cx: &Ctx<'_>, bh: usize) -> Prep {
    cx.prep(bh)
}

#[multiversion::multiversion(targets("x86_64+avx512f+avx512bw+avx512vl+fma", "x86_64+avx2+fma"))]
fn combine(cx: &Ctx<'_>, tasks: &[Task], parts: &[Part]) -> AttentionOutput {
    cx.combine(tasks, parts)
}

fn run_task(isa: Isa, cx: &Ctx<'_>, prep: &Prep, t: &Task, s: &mut Scratch) -> Part {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `attend_with` runs the AVX-512 kernel only where the CPU has its features.
        Isa::Avx512 => unsafe { run_task_avx512(cx, prep, t, s) },
        _ => run_task_portable(cx, prep, t, s),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi2,avx2,fma,f16c,bmi2")]
unsafe fn run_task_avx512(cx: &Ctx<'_>, prep: &Prep, t: &Task, s: &mut Scratch) -> Part {
    run_task_generic(super::avx512::Avx512, cx, prep, t, s)
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
