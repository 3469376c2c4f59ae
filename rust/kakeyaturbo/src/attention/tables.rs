//! What attention over the codes needs from one calibration, derived once: where each
//! component's index sits in a packed row, the centroid tables laid out for SIMD look-ups, and
//! the two linear maps that move a query into the code domain and a code-domain sum back out.

use super::math::rows_times;
use crate::calibrated::{Band, CalibratedCodec};
use crate::wht;

/// How a component's centroid is looked up: a table of at most 16 entries (one SIMD register),
/// of 32 (two registers), or more (a gather from memory).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Lookup {
    Perm16,
    Perm32,
    Perm64,
    Gather,
}

/// Up to 8 consecutive groups whose windows lie in the 64 bytes from byte `off` of a row: one
/// masked load of those bytes and one byte permute (`perm`: qword `k` = the window of group
/// `first + k`) give all their windows.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Batch {
    pub off: u32,
    pub first: u32,
    pub groups: u32,
    pub perm: [u8; 64],
}

/// Up to 8 consecutive components whose bits lie in the 64 bits from byte `byte` of a row:
/// one multishift of that window extracts all of them (`ctrl` byte `i` = the bit offset of
/// component `first + i` in the window, `mask` byte `i` its width's mask; unused bytes 0).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Group {
    pub byte: u32,
    pub ctrl: u64,
    pub mask: u64,
}

/// One coded component: its index occupies bits `[32 word + shift, + bits)` of its row read
/// as little-endian u32 words; its centroids start at `lut[table]`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Component {
    pub word: u32,
    pub shift: u32,
    pub mask: u32,
    pub table: u32,
    pub lookup: Lookup,
    /// Byte slot of the component's index in the unpacked layout: `8 * group + position`.
    pub slot: u32,
}

/// The tables of one calibration (one stream of one (layer, kv-head)) that attention reads.
#[derive(Debug, Clone)]
pub struct StreamTables {
    pub(crate) codec: CalibratedCodec,
    pub(crate) d: usize,
    pub(crate) m: usize,
    pub(crate) row_bytes: usize,
    /// u32 words that cover a row's bits: `ceil(row_bits / 32)`.
    pub(crate) words: usize,
    pub(crate) comps: Vec<Component>,
    pub(crate) groups: Vec<Group>,
    pub(crate) batches: Vec<Batch>,
    /// Centroid tables of every bit width in use, each at a multiple of 16 entries and padded
    /// to at least 16 entries (32 for 5 bits), so that a SIMD look-up never reads past it.
    pub(crate) lut: Vec<f32>,
    pub(crate) bands: Vec<Band>,
    pub(crate) signs: Vec<f32>,
    /// `S'` (`m x D`), its transpose (`D x m`, for the query transform) and the mean (`D`).
    pub(crate) synthesis: Vec<f32>,
    pub(crate) synthesis_t: Vec<f32>,
    pub(crate) mean: Vec<f32>,
    /// `M` (`m x D`, row `j` = what component `j` adds to a decoded row per unit of its
    /// centroid): derived on first use by attention over keys coded before RoPE.
    key_synth: std::sync::OnceLock<Vec<f32>>,
    /// `M` rounded to bfloat16, pairs of components packed ([`Self::key_synthesis_bf16`]).
    key_synth_bf16: std::sync::OnceLock<Vec<u32>>,
    /// `M` in 16-bit fixed point ([`Self::key_synthesis_i16`]).
    key_synth_i16: std::sync::OnceLock<super::fixed::FixedSynthesis>,
    /// The centroid table of each width in use rounded to bfloat16 and in 16-bit fixed point
    /// ([`Self::table16`]).
    lut16: [std::sync::OnceLock<Vec<u16>>; 2],
    /// `lut` in 16-bit fixed point ([`Self::lut_fixed`]).
    lut_fixed: std::sync::OnceLock<super::fixed::FixedLut>,
}

impl StreamTables {
    /// Derives the tables of a (validated) calibration.
    pub fn new(codec: &CalibratedCodec) -> Self {
        let mut lut: Vec<f32> = Vec::new();
        let mut table_at = [u32::MAX; 9];
        for &b in &codec.bits {
            if table_at[b as usize] != u32::MAX {
                continue;
            }
            let q = codec
                .quantizer(b)
                .expect("a quantiser exists for every bit width in use");
            // Tables read whole by a SIMD look-up hold at least 16 entries.
            let pad = (1usize << b).max(16);
            table_at[b as usize] = lut.len() as u32;
            let start = lut.len();
            lut.extend_from_slice(q.centroids());
            lut.resize(start + pad, 0.0);
        }
        let mut bit = 0usize;
        let comps = codec
            .bits
            .iter()
            .map(|&b| {
                let c = Component {
                    word: (bit / 32) as u32,
                    shift: (bit % 32) as u32,
                    mask: (1u32 << b) - 1,
                    table: table_at[b as usize],
                    lookup: match b {
                        1..=4 => Lookup::Perm16,
                        5 => Lookup::Perm32,
                        6 => Lookup::Perm64,
                        _ => Lookup::Gather,
                    },
                    slot: 0,
                };
                bit += b as usize;
                c
            })
            .collect::<Vec<Component>>();
        let mut comps = comps;
        let mut groups = Vec::new();
        let mut j0 = 0;
        let starts: Vec<usize> = comps
            .iter()
            .map(|c| 32 * c.word as usize + c.shift as usize)
            .collect();
        let at = |j: usize| starts[j];
        while j0 < comps.len() {
            let byte = at(j0) / 8;
            let (mut ctrl, mut mask, mut k) = (0u64, 0u64, 0);
            while j0 + k < comps.len() && k < 8 {
                let j = j0 + k;
                let off = at(j) - 8 * byte;
                if off + codec.bits[j] as usize > 64 {
                    break;
                }
                ctrl |= (off as u64) << (8 * k);
                mask |= (comps[j].mask as u64) << (8 * k);
                comps[j].slot = (8 * groups.len() + k) as u32;
                k += 1;
            }
            groups.push(Group {
                byte: byte as u32,
                ctrl,
                mask,
            });
            j0 += k;
        }
        let mut batches = Vec::new();
        let mut g0 = 0;
        while g0 < groups.len() {
            let off = groups[g0].byte;
            let mut perm = [0u8; 64];
            let mut k = 0;
            while g0 + k < groups.len() && k < 8 && groups[g0 + k].byte + 8 <= off + 64 {
                for i in 0..8 {
                    perm[8 * k + i] = (groups[g0 + k].byte - off + i as u32) as u8;
                }
                k += 1;
            }
            batches.push(Batch {
                off,
                first: g0 as u32,
                groups: k as u32,
                perm,
            });
            g0 += k;
        }
        Self {
            d: codec.d,
            m: codec.m,
            row_bytes: codec.row_bytes(),
            words: codec.row_bits().div_ceil(32),
            comps,
            groups,
            batches,
            lut,
            bands: codec.bands().to_vec(),
            signs: codec.signs().to_vec(),
            synthesis: codec.synthesis_scaled().to_vec(),
            synthesis_t: (0..codec.d)
                .flat_map(|d| (0..codec.m).map(move |j| codec.synthesis_scaled()[j * codec.d + d]))
                .collect(),
            mean: codec.mean.clone(),
            key_synth: std::sync::OnceLock::new(),
            key_synth_bf16: std::sync::OnceLock::new(),
            key_synth_i16: std::sync::OnceLock::new(),
            lut16: Default::default(),
            lut_fixed: std::sync::OnceLock::new(),
            codec: codec.clone(),
        }
    }

    /// Row length `D`.
    pub fn dim(&self) -> usize {
        self.d
    }
    /// Coded components `m`.
    pub fn components(&self) -> usize {
        self.m
    }
    /// The calibration these tables come from.
    pub fn codec(&self) -> &CalibratedCodec {
        &self.codec
    }

    /// The centroid of component `j` for index `code` (masked to the component's width).
    #[inline]
    pub(crate) fn centroid(&self, j: usize, code: u32) -> f32 {
        let c = &self.comps[j];
        self.lut[(c.table + (code & c.mask)) as usize]
    }

    /// Moves a (scaled) query into the code domain: returns `q . mean` and writes `w` (`m`)
    /// with `q . x = q . mean + g * sum_j w_j c_j` for every row `x` of scale `g` and centroids
    /// `c`. `w` = per sub-band `r * H(s * (S' q))` (H is symmetric, so the band rotation moves
    /// onto the query). Sums are sequential fused multiply-adds in index order (each `S' q`
    /// entry over the dimensions in order; the loop runs over the dimensions outside so that it
    /// vectorises over the components).
    #[inline(always)]
    pub fn query_weights(&self, q: &[f32], w: &mut [f32]) -> f32 {
        debug_assert_eq!(q.len(), self.d);
        debug_assert_eq!(w.len(), self.m);
        let mut qm = [0f32];
        self.query_weights_rows(q, self.d, w, &mut qm);
        qm[0]
    }

    /// [`Self::query_weights`] of `qm.len()` queries at once, the same bits: query `r` is
    /// `q[r * stride .. r * stride + D]`, its weights `w[r * m .. (r + 1) * m]`, its `q . mean`
    /// `qm[r]`. The product with `S'` runs through `math::rows_times`, so that `S'` is
    /// read once per 4 queries, not once per query (latent attention has 16 to 128 per kv-head).
    #[inline(always)]
    pub fn query_weights_rows(&self, q: &[f32], stride: usize, w: &mut [f32], qm: &mut [f32]) {
        let (d, m, rows) = (self.d, self.m, qm.len());
        assert!(rows == 0 || (q.len() >= (rows - 1) * stride + d && w.len() >= rows * m));
        for (r, x) in qm.iter_mut().enumerate() {
            *x = q[r * stride..r * stride + d]
                .iter()
                .zip(&self.mean)
                .fold(0f32, |acc, (&a, &b)| a.mul_add(b, acc));
        }
        rows_times(q, stride, rows, &self.synthesis_t, d, m, w);
        for wr in w[..rows * m].chunks_exact_mut(m.max(1)) {
            for band in &self.bands {
                let seg = &mut wr[band.offset..band.offset + band.width];
                for (v, s) in seg.iter_mut().zip(&self.signs[band.offset..]) {
                    *v *= s;
                }
                wht::fwht(seg);
                for v in seg.iter_mut() {
                    *v *= band.norm;
                }
            }
        }
    }

    /// `M` (`m x D` row-major): a row of scale `g` and centroids `c` (outliers' values in
    /// place) decodes as `mean + g * sum_j c_j M_j`. Row `j` is [`Self::synthesize`] of the
    /// unit vector `e_j` without the mean; derived once, on first use.
    pub fn key_synthesis(&self) -> &[f32] {
        self.key_synth.get_or_init(|| {
            let (m, d) = (self.m, self.d);
            let mut out = vec![0f32; m * d];
            let mut e = vec![0f32; m];
            for (j, row) in out.chunks_exact_mut(d).enumerate() {
                e.fill(0.0);
                e[j] = 1.0;
                self.synthesize(&mut e, 0.0, row);
            }
            out
        })
    }

    /// [`Self::key_synthesis`] as the kernel multiplies it under `synthesis`: as it is
    /// ([`super::Synthesis::F32`]) or each entry rounded to bfloat16 and widened back
    /// ([`super::Synthesis::Bf16`]); for mirrors of the kernel (the Triton one).
    pub fn key_synthesis_values(&self, synthesis: super::Synthesis) -> Vec<f32> {
        let ms = self.key_synthesis();
        match synthesis {
            super::Synthesis::F32 => ms.to_vec(),
            super::Synthesis::Bf16 => ms
                .iter()
                .map(|&x| f32::from_bits(super::kernel::bf16_round(x) << 16))
                .collect(),
            super::Synthesis::I16 => self.key_synthesis_i16().values(self.m, self.d),
        }
    }

    /// [`Self::key_synthesis`] rounded to bfloat16 ([`super::kernel::bf16_round`]), two
    /// components per word: `[p * D + d]` holds component `2p` in its low half and `2p + 1` in
    /// its high half (0 past `m`), `ceil(m / 2) x D` words.
    pub fn key_synthesis_bf16(&self) -> &[u32] {
        self.key_synth_bf16.get_or_init(|| {
            let (m, d) = (self.m, self.d);
            let ms = self.key_synthesis();
            let at = |j: usize, i: usize| if j < m { ms[j * d + i] } else { 0.0 };
            (0..m.div_ceil(2))
                .flat_map(|p| {
                    (0..d).map(move |i| super::kernel::bf16_pair(at(2 * p, i), at(2 * p + 1, i)))
                })
                .collect()
        })
    }

    /// [`Self::key_synthesis`] in 16-bit fixed point ([`super::fixed::FixedSynthesis`]),
    /// derived on first use.
    pub fn key_synthesis_i16(&self) -> &super::fixed::FixedSynthesis {
        self.key_synth_i16
            .get_or_init(|| super::fixed::FixedSynthesis::new(self.key_synthesis(), self.m, self.d))
    }

    /// The centroid table of component `j` rounded to bfloat16 ([`super::kernel::bf16_round`])
    /// or (`fixed`) to 16-bit fixed point ([`super::fixed::fixed16`]) in `max(64, 2^bits)`
    /// words (zeros past its entries), so that 16-bit permutes of two registers look up 32 rows
    /// at a time (one permute up to 6 bits, two and a blend at 7, four and three blends at 8).
    /// One table per width in use, like [`Self::centroid`]'s; derived once, on first use.
    #[inline]
    pub(crate) fn table16(&self, j: usize, fixed: bool) -> &[u16] {
        // Width `b` at word `64 (b - 1)` up to 6 bits, then 7 bits at 384 and 8 bits at 512.
        let at = |n: usize| match n {
            128 => 384..512,
            256 => 512..768,
            _ => 64 * (n.trailing_zeros() as usize - 1)..64 * n.trailing_zeros() as usize,
        };
        let all = self.lut16[fixed as usize].get_or_init(|| {
            let mut all = vec![0u16; 768];
            for (j, c) in self.comps.iter().enumerate() {
                let n = c.mask as usize + 1;
                for (code, w) in all[at(n)][..n].iter_mut().enumerate() {
                    let x = self.centroid(j, code as u32);
                    *w = if fixed {
                        super::fixed::fixed16(x) as u16
                    } else {
                        super::kernel::bf16_round(x) as u16
                    };
                }
            }
            all
        });
        &all[at(self.comps[j].mask as usize + 1)]
    }

    /// `lut` in 16-bit fixed point ([`super::fixed::FixedLut`]): what the packed look-up of
    /// [`super::Synthesis::I16`] reads, so that no centroid is rounded per row. Derived once,
    /// on first use.
    pub(crate) fn lut_fixed(&self) -> &super::fixed::FixedLut {
        self.lut_fixed
            .get_or_init(|| super::fixed::FixedLut::new(&self.lut))
    }

    /// Moves a code-domain sum back out: with `a = sum_t p_t g_t c_t` (`m`, overwritten) and
    /// `pc = sum_t p_t`, writes `out` (`D`) `= sum_t p_t x_t = pc * mean + sum_j u_j S'_j`,
    /// `u` = per sub-band `s * H(r * a)` (the decode's inverse rotation, once for all rows).
    #[inline(always)]
    pub fn synthesize(&self, a: &mut [f32], pc: f32, out: &mut [f32]) {
        debug_assert_eq!(a.len(), self.m);
        debug_assert_eq!(out.len(), self.d);
        self.synthesize_rows(a, &[pc], out);
    }

    /// [`Self::synthesize`] of `pc.len()` sums at once, the same bits: sum `r` is `a[r * m ..
    /// (r + 1) * m]` (overwritten), its output `out[r * D .. (r + 1) * D]`; the product with
    /// `S'` through `math::rows_times`, as in [`Self::query_weights_rows`].
    #[inline(always)]
    pub fn synthesize_rows(&self, a: &mut [f32], pc: &[f32], out: &mut [f32]) {
        let (d, m, rows) = (self.d, self.m, pc.len());
        assert!(a.len() >= rows * m && out.len() >= rows * d);
        for ar in a[..rows * m].chunks_exact_mut(m.max(1)) {
            for band in &self.bands {
                let seg = &mut ar[band.offset..band.offset + band.width];
                for v in seg.iter_mut() {
                    *v *= band.norm;
                }
                wht::fwht(seg);
                for (v, s) in seg.iter_mut().zip(&self.signs[band.offset..]) {
                    *v *= s;
                }
            }
        }
        rows_times(a, m, rows, &self.synthesis, m, d, out);
        for (or, &p) in out[..rows * d].chunks_exact_mut(d.max(1)).zip(pc) {
            for (o, &mu) in or.iter_mut().zip(&self.mean) {
                *o = p.mul_add(mu, *o);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::calibrated::testutil::{codec, rows};
    use crate::metric::Metric;

    #[test]
    fn components_address_their_bits_and_tables() {
        let c = codec(
            20,
            vec![8, 6, 5, 5, 4, 3, 3, 2, 1, 1],
            true,
            Metric::Mse,
            None,
        );
        let t = StreamTables::new(&c);
        assert_eq!(t.words, 38usize.div_ceil(32));
        let shifts: Vec<(u32, u32)> = t.comps.iter().map(|c| (c.word, c.shift)).collect();
        assert_eq!(shifts[..4], [(0, 0), (0, 8), (0, 14), (0, 19)]);
        assert_eq!(shifts[4..7], [(0, 24), (0, 28), (0, 31)]);
        assert_eq!(shifts[7..], [(1, 2), (1, 4), (1, 5)]);
        for (j, comp) in t.comps.iter().enumerate() {
            assert_eq!(comp.table % 16, 0);
            let q = c.quantizer(c.bits[j]).unwrap();
            for (code, &v) in q.centroids().iter().enumerate() {
                assert_eq!(t.centroid(j, code as u32), v);
            }
        }
        assert_eq!(t.comps[2].lookup, Lookup::Perm32);
        assert_eq!(t.comps[1].lookup, Lookup::Perm64);
        // Groups: 8 + 6 + 5 + 5 + 4 + 3 + 3 + 2 bits from bit 0 fit one window; 1 + 1 the next.
        assert_eq!(t.groups.len(), 2);
        assert_eq!(t.groups[1].byte, 36 / 8);
        let slots: Vec<u32> = t.comps.iter().map(|c| c.slot).collect();
        assert_eq!(slots, [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]);
        assert_eq!(t.comps[0].lookup, Lookup::Gather);
        assert_eq!(t.comps[9].lookup, Lookup::Perm16);
    }

    #[test]
    fn key_synthesis_values_are_the_kernels_factors() {
        // f32: M itself; bf16: the halves of the packed words the kernel multiplies.
        let c = codec(20, vec![6, 5, 4, 3, 3, 2, 1], true, Metric::Mse, None);
        let t = StreamTables::new(&c);
        assert_eq!(
            t.key_synthesis_values(super::super::Synthesis::F32),
            t.key_synthesis()
        );
        let b = t.key_synthesis_values(super::super::Synthesis::Bf16);
        let w = t.key_synthesis_bf16();
        for j in 0..c.m {
            for i in 0..c.d {
                let packed = super::super::kernel::bf16_half(w[(j / 2) * c.d + i], j % 2 == 1);
                assert_eq!(b[j * c.d + i].to_bits(), packed.to_bits());
                let m = t.key_synthesis()[j * c.d + i];
                assert!((b[j * c.d + i] - m).abs() <= m.abs() / 256.0 + 1e-30);
            }
        }
    }

    #[test]
    fn many_rows_at_once_are_each_row_alone() {
        // More components and dimensions than a block (ROW_BLOCK), several rows, a stride
        // wider than the query: the same bits as one row at a time.
        let bits: Vec<u8> = (0..150).map(|j| [4u8, 3, 2, 1][j % 4]).collect();
        let c = codec(160, bits, true, Metric::Mse, None);
        let t = StreamTables::new(&c);
        let (d, m, rows, stride) = (160, c.m, 5, 170);
        let q: Vec<f32> = (0..rows * stride)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.1)
            .collect();
        let (mut w, mut qm) = (vec![0f32; rows * m], vec![0f32; rows]);
        t.query_weights_rows(&q, stride, &mut w, &mut qm);
        let mut a: Vec<f32> = (0..rows * m).map(|i| ((i * 13 % 7) as f32) * 0.2).collect();
        let pc: Vec<f32> = (0..rows).map(|r| 0.5 + r as f32).collect();
        let mut a_one = a.clone();
        let mut out = vec![0f32; rows * d];
        t.synthesize_rows(&mut a, &pc, &mut out);
        for r in 0..rows {
            let mut w1 = vec![0f32; m];
            let qm1 = t.query_weights(&q[r * stride..r * stride + d], &mut w1);
            assert_eq!(qm1.to_bits(), qm[r].to_bits());
            assert_eq!(w1, w[r * m..(r + 1) * m]);
            let mut o1 = vec![0f32; d];
            t.synthesize(&mut a_one[r * m..(r + 1) * m], pc[r], &mut o1);
            assert_eq!(o1, out[r * d..(r + 1) * d]);
        }
    }

    #[test]
    fn query_weights_and_synthesis_match_the_decode() {
        // q . x for decoded rows equals q . mean + g sum_j w_j c_j; sum_t p_t x_t equals the
        // synthesis of the code-domain sum.
        let c = codec(
            24,
            vec![5, 5, 4, 4, 4, 3, 3, 3, 2, 2, 1],
            true,
            Metric::Mse,
            None,
        );
        let t = StreamTables::new(&c);
        let x = rows(&c, 40, 3);
        let codes = c.encode(&x, 40).unwrap();
        let y = c.decode(&codes).unwrap();
        let idx = c.unpack(&codes).unwrap();
        let g = codes.scale.as_ref().unwrap().decode();
        let q: Vec<f32> = (0..24).map(|i| ((i * 7 % 11) as f32 - 5.0) * 0.3).collect();
        let mut w = vec![0f32; c.m];
        let qm = t.query_weights(&q, &mut w);
        let p: Vec<f32> = (0..40).map(|i| 1.0 / (1.0 + i as f32)).collect();
        let mut a = vec![0f32; c.m];
        for r in 0..40 {
            let exact: f64 = q
                .iter()
                .zip(&y[r * 24..(r + 1) * 24])
                .map(|(&a, &b)| a as f64 * b as f64)
                .sum();
            let vals: Vec<f32> = (0..c.m)
                .map(|j| t.centroid(j, idx[r * c.m + j] as u32))
                .collect();
            let dot: f64 = w
                .iter()
                .zip(&vals)
                .map(|(&a, &b)| a as f64 * b as f64)
                .sum();
            let got = qm as f64 + g[r] as f64 * dot;
            assert!(
                (got - exact).abs() < 1e-4 * (1.0 + exact.abs()),
                "{got} vs {exact}"
            );
            for (aj, v) in a.iter_mut().zip(&vals) {
                *aj += p[r] * g[r] * v;
            }
        }
        let mut out = vec![0f32; 24];
        t.synthesize(&mut a, p.iter().sum(), &mut out);
        for d in 0..24 {
            let exact: f64 = (0..40).map(|r| p[r] as f64 * y[r * 24 + d] as f64).sum();
            assert!((out[d] as f64 - exact).abs() < 1e-4 * (1.0 + exact.abs()));
        }
    }
}
