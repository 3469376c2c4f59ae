//! Keys coded before RoPE (SPEC section 12): the rotation attention applies to each sealed key
//! after synthesising it from its codes.
//!
//! RoPE turns pair `i` of a key at position `p` by the angle `p * theta_i`. The angle depends on
//! the row, so the query cannot be moved into the code domain once for all rows (as it is for
//! keys coded after RoPE). Instead each tile of sealed rows is synthesised (`mean + g * M c`,
//! `M` = [`super::StreamTables::key_synthesis`], one `D`-wide fused multiply-add per component
//! shared by every query of the GQA group), rotated with the cos/sin of its position, and dotted
//! with the queries as a raw row is. The decoded keys never leave the tile.

use crate::error::{input, param, Result};

/// Which channels pair up under the rotation (transformers' two layouts).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    /// Channel `i` with `i + rot/2` (Llama, Qwen, Mistral, Gemma, Phi-3, ...).
    Half,
    /// Channel `2i` with `2i + 1` (Cohere).
    Interleaved,
}

/// How a sealed key coded before RoPE is synthesised from its centroids (mod.rs,
/// "Arithmetic").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Synthesis {
    /// `M` and the centroids rounded to bfloat16, float32 sums: products of two bfloat16 are
    /// exact in float32, so this is AVX-512 BF16's dot product of pairs (twice the
    /// multiply-adds per instruction of float32), computed the same everywhere.
    #[default]
    Bf16,
    /// `M` and the centroids in float32: the decoded keys to float32 rounding.
    F32,
    /// `M` and the centroids in 16-bit fixed point, sums exact in 32-bit integers
    /// ([`super::fixed`]): twice float32's multiply-adds per instruction on AVX2 (`vpmaddwd`).
    I16,
}

/// The rotation of the sealed keys of one call.
///
/// `cos` and `sin` are `[rot/2, n_pos]` row-major (frequency-major): `cos[i * n_pos + p]` is
/// the (already scaled) cos of frequency `i` at position `p`, as the model's rotary module
/// gives it. Frequency-major, a tile of consecutive positions reads each frequency's cos and
/// sin as one contiguous run.
/// `positions` is `[B, T_c]`: the position (a row of the table) of every sealed row of every
/// batch row, in the order the sealed rows are held. Channels past `rot` are not rotated.
#[derive(Debug, Clone, Copy)]
pub struct KeyRope<'a> {
    pub cos: &'a [f32],
    pub sin: &'a [f32],
    pub rot: usize,
    pub style: RopeStyle,
    pub positions: &'a [u32],
    pub synthesis: Synthesis,
}

impl KeyRope<'_> {
    /// Positions in the table.
    pub fn n_pos(&self) -> usize {
        self.cos.len().checked_div(self.rot / 2).unwrap_or(0)
    }

    /// `Some(p0)` when rows `first .. first + rows` sit at the consecutive positions
    /// `p0 .. p0 + rows` of the table.
    #[inline(always)]
    fn consecutive(&self, first: usize, rows: usize) -> Option<usize> {
        let pos = &self.positions[first..first + rows];
        let p0 = pos[0] as usize;
        (p0 + rows <= self.n_pos() && pos.iter().enumerate().all(|(t, &p)| p as usize == p0 + t))
            .then_some(p0)
    }

    /// `Some(p0)` when the tile of rows `first ..` is full (64 rows) at consecutive positions
    /// from `p0`: its cos and sin are read from the table in place.
    #[inline(always)]
    pub(crate) fn run_at(&self, first: usize, rows: usize) -> Option<usize> {
        (rows == super::kernel::TILE)
            .then(|| self.consecutive(first, rows))
            .flatten()
    }

    /// The cos (then, from `64 * rot/2`, the sin) of rows `t < rows` at `positions[first ..]`,
    /// frequency-major `trig[i * 64 + t]` (rows past `rows`: 0). A run of consecutive positions
    /// is copied frequency by frequency.
    #[inline(always)]
    pub(crate) fn gather(&self, first: usize, rows: usize, trig: &mut [f32]) {
        const T: usize = super::kernel::TILE;
        let (half, n) = (self.rot / 2, self.n_pos());
        let pos = &self.positions[first..first + rows];
        let run = self.consecutive(first, rows);
        let (ct, st) = trig.split_at_mut(half * T);
        for (src, dst) in [(self.cos, ct), (self.sin, st)] {
            for i in 0..half {
                let row = &src[i * n..(i + 1) * n];
                let out = &mut dst[i * T..(i + 1) * T];
                if let Some(p0) = run {
                    out[..rows].copy_from_slice(&row[p0..p0 + rows]);
                } else {
                    for (o, &p) in out.iter_mut().zip(pos) {
                        *o = row[p as usize];
                    }
                }
                out[rows..].fill(0.0);
            }
        }
    }

    /// Checks the rotation against a call of `batch` rows of `sealed` rows of `D = dk`.
    pub(crate) fn check(&self, batch: usize, sealed: usize, dk: usize) -> Result<()> {
        if self.rot == 0 || !self.rot.is_multiple_of(2) || self.rot > dk {
            return param(format!(
                "the rotary dimension must be even, >= 2 and <= D_k = {dk}, got {}",
                self.rot
            ));
        }
        let half = self.rot / 2;
        if self.cos.len() != self.sin.len()
            || !self.cos.len().is_multiple_of(half)
            || self.cos.is_empty()
        {
            return input(format!(
                "cos and sin must both be [rot/2 = {half}, n_pos] with n_pos >= 1; got {} and {} values",
                self.cos.len(),
                self.sin.len()
            ));
        }
        // Non-finite cos or sin values are not looked for here (the table is read whole only
        // where a row uses it): they make the scores that read them non-finite, which the
        // kernel reports as a numerical error.
        let want = batch.saturating_mul(sealed);
        if self.positions.len() != want {
            return input(format!(
                "positions must be [B, T_c] = [{batch}, {sealed}], got {} values",
                self.positions.len()
            ));
        }
        let n = self.n_pos();
        if let Some(i) = self.positions.iter().position(|&p| p as usize >= n) {
            return input(format!(
                "position {} (flat index {i}) is outside the table's {n} rows",
                self.positions[i]
            ));
        }
        Ok(())
    }
}
