//! Attention computed from the codes of the calibrated mode, without decoding them (SPEC
//! section 12).
//!
//! A calibrated row decodes as `x = mean + sum_j u_j S'_j` with `u` = per sub-band
//! `s * H(g r c)` (`g` the row's scale, `c_j` the centroid of its index `z_j`, an outlier's
//! value where it has one). Everything after `c` is linear and shared by every row of a
//! (layer, kv-head, stream), so for a query `q`:
//!
//! - scores: `q . x_t = q . mean + g_t sum_j w_j c_tj` with `w` = per sub-band
//!   `r H(s (S' q))`, computed once per query ([`StreamTables::query_weights`]);
//! - values: `sum_t p_t x_t = (sum_t p_t) mean + S'^T s H(r sum_t p_t g_t c_t)`: the sum runs in
//!   the code domain and is synthesised once per query ([`StreamTables::synthesize`]).
//!
//! So a decode step reads each sealed row's packed indices and scale once for the keys and
//! once for the values, looks its centroids up and multiplies-adds them with every query of
//! the GQA group, instead of decoding `D`-wide rows. The queries must be in the domain the
//! keys were coded in (for keys coded after RoPE, queries after RoPE); the kernel does not
//! know which.
//!
//! Arrows run one way: [`tables`] (what one calibration gives attention) -> [`store`] (sealed
//! blocks held as their container bytes, parsed once) -> [`kernel`] / `avx512` / `avx2` (the inner
//! loops over a tile of 64 rows) -> `part` (one piece of work: its online softmax) -> [`attend`]
//! (one step of one layer: checks, pieces of work on rayon, their combination in `combine`).
//!
//! # Arithmetic
//!
//! Every instruction set computes the same bits, and so does every thread count: all sums
//! have a fixed order, written down here (float32 throughout, `fma` a fused multiply-add).
//!
//! - Queries are scaled first (`q * scale`); `w` and `q . mean` are sequential `fma` chains.
//! - A sealed row's score: `dot = fma` chain over `j` of `w_j c_j` from 0; then each outlier of
//!   the row (ascending component) adds `fma(w_j, value - c_j, dot)`; `s = fma(g, dot, q.mean)`.
//! - A raw row's score: 16 lane-wise `fma` chains over the dimensions (`d mod 16`), summed as a
//!   tree (lanes `l + 8`, `+ 4`, `+ 2`, `+ 1`).
//! - A sealed row of keys coded before RoPE ([`rope`]): `x_d` = `fma` chain over `j` from 0
//!   of `M_jd c_j` (outliers' values in place of their centroids), `y_d = fma(g, x_d, mean_d)`,
//!   per pair `(a, b)` of the rotation `y_a' = y_a cos + (-y_b) sin`, `y_b' = y_b cos + y_a sin`
//!   (each product rounded, then the sum, as transformers rotates), then the score
//!   `s` = `fma` chain over `d` from 0 of `q_d y'_d`. [`Synthesis::Bf16`] rounds `M` and the
//!   centroids to bfloat16 first and takes the chain pair by pair (the higher component, then
//!   the lower); [`Synthesis::I16`] takes `x_d = (sum_j W_jd C_j) as f32 * unit_d` with `W`
//!   and `C` 16-bit integers and the sum exact in 32 bits ([`fixed`]).
//! - Latent attention ([`AttentionParams::latent`]): a sealed row's score is the K stream's
//!   `s` above plus, added last, the V stream's `fma(g_v, dot_v, q_v . mean_v)` (its own
//!   `fma` chain and outliers, the query's last `D_v` entries); a raw row's score is the K
//!   part's `q . k` plus the V part's, each as above; the value sums below then run over the
//!   K stream (its scales, centroids, outliers and synthesis; raw rows' keys).
//! - Then `s = cap * tanh(s / cap)` with a softcap, then `s + mask` (`-inf` where the position
//!   is not seen: causal, outside the window, past the rows).
//! - Online softmax per tile of 64 rows: `M' = max(M, max s)`, `a = exp(M - M')`,
//!   `p = exp(s - M')`, `l = fma(l, a, sum p)` (the tile sum: the four groups of 16 added
//!   pairwise, then the 16-lane tree); the sums are multiplied by `a` when it is not 1. `exp`
//!   is [`math::exp_neg`].
//! - Sealed values: `acc[j][t mod 16] = fma(p_t g_t, c_tj, acc)` over the rows of a tile in
//!   order (four groups of 16), then each outlier `fma(p_t g_t, value - c_tj, acc)`; raw values
//!   `acc[d] = fma(p_t, v_td, acc)` row by row (rows of weight 0 skipped).
//! - Pieces of work: per (batch row, kv-head) the sink rows, the sealed rows in pieces of 8
//!   tiles (tiles start at each block's first row), the tail rows in pieces of 512; each
//!   piece ends with its 16 lanes summed as a tree. Pieces combine in position order with
//!   factors `exp(M_piece - M)`: `l`, the code-domain sum, its mass `pc` and the raw sum, each
//!   by `fma`.
//! - Output `((S'^T s H(r a) + pc mean) + raw) / l` (the synthesis in [`StreamTables::synthesize`]
//!   order), 0 when `l = 0`; `lse = M + ln l`.

pub mod attend;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512;
mod checks;
mod combine;
pub mod fixed;
pub mod kernel;
pub mod math;
mod part;
pub mod rope;
mod split;
pub mod store;
pub mod tables;
pub mod unrope;

pub use attend::{attend, attend_with, AttentionOutput, AttentionParams, Isa};
pub use part::RawRows;
pub use rope::{KeyRope, RopeStyle, Synthesis};
pub use split::{auto_threads, inline_work, INLINE_WORK, QUERY_ROWS_PER_UNIT};
pub use store::{Blob, CodeStore, LayerCodes, SealedBlock};
pub use tables::StreamTables;
pub use unrope::{unrope_bf16, unrope_f32, UnropeShape};

#[cfg(test)]
mod tests;
