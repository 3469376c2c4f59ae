//! The 8-bit integer synthesis of keys coded before RoPE ([`super::Synthesis::I8`]).
//!
//! A key is `mean + g * sum_j c_j M_j`. Here each centroid is held as an unsigned byte
//! `u = round(c / tau_b) + 128` (`tau_b` = the largest centroid magnitude of its bit width /
//! 127) and each `M_jd tau_bj` as a signed byte, so that a key channel is an integer dot
//! product: four byte products per 32-bit lane and instruction with AVX-512 VNNI
//! (`vpdpbusd`), against two with the bfloat16 synthesis. The integer sums are exact, so every
//! instruction set and order gives the same bits.
//!
//! The bytes of `M_jd tau_bj` are scaled per channel `d` (its largest weight is 127 units).
//! One scale for all components would give weak components (small `M_j`) few significant
//! bits; so the components are cut into [`GROUPS`] by bit width (strong components first)
//! and each group's bytes count `2^k` times finer units than the group's before it (`k` per
//! group and channel, the largest that keeps the group's bytes within 127), its sum added after
//! the sum so far was shifted left by `k`:
//! `I_d = ((S_0 << k_1d) + S_1) << k_2d) + S_2 - C_d` (the first group's own `k_0d` only
//! refines its bytes), `C_d` the same expression over `128 * weights` (the bytes' offset), then
//! `x_d = f32(I_d) * s_d` (`s_d` = the unit / `2^(k_0d + k_1d + k_2d)`), `y_d = fma(g, x_d, mean_d)`, rotated as the other syntheses.
//! The shifts are bounded so that no sum leaves `i32`.

use super::kernel::TILE;
use super::store::SealedBlock;
use super::tables::StreamTables;

/// The component groups, by bit width: at least 6 bits, 3 to 5, at most 2.
pub(crate) const GROUPS: [(u8, u8); 3] = [(6, 8), (3, 5), (1, 2)];

/// A padding slot of a quad (weights 0).
pub(crate) const NONE: u32 = u32::MAX;

/// The integer synthesis of one calibration, derived once.
#[derive(Debug, Clone)]
pub struct I8Synthesis {
    pub(crate) d: usize,
    /// Quads of components (4 per 32-bit lane), group by group; `ends[g]` = the first quad
    /// past group `g`.
    pub(crate) quads: usize,
    pub(crate) ends: [usize; GROUPS.len()],
    /// The component of each slot `[q * 4 + i]` ([`NONE`]: padding).
    pub(crate) comp: Vec<u32>,
    /// Signed byte weights, `[q * D + d]`, byte `i` = slot `i` of quad `q`.
    pub(crate) w: Vec<u32>,
    /// Per group and channel `[g * D + d]`: the left shift before the group's sum (0 for the
    /// first group).
    pub(crate) shift: Vec<u32>,
    /// Per channel: `C_d` and `s_d`.
    pub(crate) corr: Vec<i32>,
    pub(crate) scale: Vec<f32>,
    /// Unsigned byte centroids: component `j`'s `2^b` entries from `lut[tab[j]]`, each table
    /// padded to at least 64 entries (so that a 64-byte permute reads inside it).
    pub(crate) lut: Vec<u8>,
    pub(crate) tab: Vec<u32>,
    pub(crate) bits: Vec<u8>,
}

impl I8Synthesis {
    /// The integer synthesis of `t` (`M` = [`StreamTables::key_synthesis`]).
    pub(crate) fn new(t: &StreamTables) -> Self {
        let (m, d) = (t.m, t.d);
        let codec = t.codec();
        let ms = t.key_synthesis();
        // Byte centroids and their scale per bit width.
        let mut lut = Vec::new();
        let mut at = [u32::MAX; 9];
        let mut tau = [0f64; 9];
        for &b in &codec.bits {
            let b = b as usize;
            if at[b] != u32::MAX {
                continue;
            }
            let q = codec
                .quantizer(b as u8)
                .expect("a quantiser exists for every bit width in use");
            let c = q.centroids();
            let top = c.iter().fold(0f64, |a, &v| a.max((v as f64).abs()));
            tau[b] = if top > 0.0 { top / 127.0 } else { 1.0 };
            at[b] = lut.len() as u32;
            let start = lut.len();
            lut.extend(
                c.iter().map(|&v| {
                    ((v as f64 / tau[b]).round().clamp(-127.0, 127.0) as i32 + 128) as u8
                }),
            );
            lut.resize(start + (1usize << b).max(64), 128);
        }
        let bits: Vec<u8> = codec.bits.clone();
        let tab: Vec<u32> = bits.iter().map(|&b| at[b as usize]).collect();
        // Quads, group by group.
        let mut comp = Vec::new();
        let mut ends = [0usize; GROUPS.len()];
        for (g, &(lo, hi)) in GROUPS.iter().enumerate() {
            let members: Vec<u32> = (0..m as u32)
                .filter(|&j| (lo..=hi).contains(&bits[j as usize]))
                .collect();
            for q in members.chunks(4) {
                for i in 0..4 {
                    comp.push(q.get(i).copied().unwrap_or(NONE));
                }
            }
            ends[g] = comp.len() / 4;
        }
        let quads = comp.len() / 4;
        // The total shift keeps every partial sum inside i32: at most m components of
        // |byte| <= 127 times u <= 255, shifted by at most `budget` bits.
        let per = (m.max(1) as f64) * 127.0 * 255.0;
        let budget = ((i32::MAX as f64 / per).log2().floor().max(0.0) as u32).min(20);
        let weight =
            |j: u32, dd: usize| ms[j as usize * d + dd] as f64 * tau[bits[j as usize] as usize];
        let mut w = vec![0u32; quads * d];
        let mut shift = vec![0u32; GROUPS.len() * d];
        let mut corr = vec![0i32; d];
        let mut scale = vec![0f32; d];
        for dd in 0..d {
            let top = |g: usize| {
                let q0 = if g == 0 { 0 } else { ends[g - 1] };
                comp[4 * q0..4 * ends[g]]
                    .iter()
                    .filter(|&&j| j != NONE)
                    .fold(0f64, |a, &j| a.max(weight(j, dd).abs()))
            };
            // The unit: the largest weight of the channel is 127 units. Group `g`'s bytes
            // count units / 2^T_g, T_g non-decreasing (the sum so far can only be shifted
            // left): T_g = the least, over this group and the ones after it, of the most bits
            // that keep that group's largest weight within 127 (and within the budget).
            let tops: Vec<f64> = (0..GROUPS.len()).map(top).collect();
            let big = tops.iter().fold(0f64, |a, &v| a.max(v));
            let unit = (big > 0.0).then_some(big / 127.0);
            let most = |mx: f64| -> u32 {
                match unit {
                    Some(u) if mx > 0.0 => {
                        let mut k = 0;
                        while k < budget && mx * f64::from(1u32 << (k + 1)) <= 127.0 * u {
                            k += 1;
                        }
                        k
                    }
                    _ => budget,
                }
            };
            let allowed: Vec<u32> = tops.iter().map(|&mx| most(mx)).collect();
            let mut total = 0u32;
            let mut c: i64 = 0;
            for g in 0..GROUPS.len() {
                let q0 = if g == 0 { 0 } else { ends[g - 1] };
                let at = allowed[g..].iter().copied().min().unwrap_or(0);
                let k = at.max(total) - total;
                shift[g * d + dd] = k;
                total += k;
                c <<= k;
                let u = unit.unwrap_or(1.0);
                for q in q0..ends[g] {
                    let mut word = 0u32;
                    for i in 0..4 {
                        let j = comp[4 * q + i];
                        let b = if j == NONE {
                            0
                        } else {
                            (weight(j, dd) * f64::from(1u32 << total) / u)
                                .round()
                                .clamp(-127.0, 127.0) as i32
                        };
                        c += 128 * b as i64;
                        word |= (b as u8 as u32) << (8 * i);
                    }
                    w[q * d + dd] = word;
                }
            }
            corr[dd] = c as i32;
            scale[dd] = (unit.unwrap_or(0.0) / f64::from(1u32 << total)) as f32;
        }
        Self {
            d,
            quads,
            ends,
            comp,
            w,
            shift,
            corr,
            scale,
            lut,
            tab,
            bits,
        }
    }

    /// The byte of component `j` for index `code`.
    #[inline(always)]
    pub(crate) fn byte(&self, j: usize, code: u32) -> u8 {
        self.lut[self.tab[j] as usize + code as usize]
    }
}

/// The definition of [`super::kernel::Tile::centroids_i8`]: `packed[q * 64 + t]` = the bytes
/// of the four components of quad `q` for row `t` (row `t >= rows`: every component's index
/// 0; padding slots 128).
pub(crate) fn centroids_i8_tile(
    t: &StreamTables,
    s8: &I8Synthesis,
    b: &SealedBlock,
    row0: usize,
    rows: usize,
    packed: &mut [u32],
) {
    let rb = t.row_bytes;
    let mut words = vec![0u32; t.words + 1];
    let mut codes = vec![0u32; t.m];
    for r in 0..TILE {
        if r < rows {
            let row = b.row(row0 + r, rb);
            words.fill(0);
            for (w, chunk) in words.iter_mut().zip(row.chunks(4)) {
                let mut le = [0u8; 4];
                le[..chunk.len()].copy_from_slice(chunk);
                *w = u32::from_le_bytes(le);
            }
            for (j, c) in t.comps.iter().enumerate() {
                let w = c.word as usize;
                let pair = words[w] as u64 | (words[w + 1] as u64) << 32;
                codes[j] = (pair >> c.shift) as u32 & c.mask;
            }
        } else {
            codes.fill(0);
        }
        for q in 0..s8.quads {
            let mut word = 0u32;
            for i in 0..4 {
                let j = s8.comp[4 * q + i];
                let v = if j == NONE {
                    128
                } else {
                    s8.byte(j as usize, codes[j as usize])
                };
                word |= (v as u32) << (8 * i);
            }
            packed[q * TILE + r] = word;
        }
    }
}

/// The integer dot product of a quad's bytes (`u`, unsigned) with its weights (`w`, signed).
#[inline(always)]
pub(crate) fn dot4(u: u32, w: u32) -> i32 {
    (0..4).fold(0i32, |a, i| {
        a + ((u >> (8 * i)) & 0xff) as i32 * ((w >> (8 * i)) as u8 as i8) as i32
    })
}

/// The definition of [`super::kernel::Tile::synthesize_i8`] (module docs): `keys[d * 64 + t]
/// = fma(g_t, f32(I_dt) * s_d, mean_d)`.
pub(crate) fn synthesize_i8_tile(
    s8: &I8Synthesis,
    packed: &[u32],
    g: &[f32; TILE],
    mean: &[f32],
    keys: &mut [f32],
) {
    let d = s8.d;
    for dd in 0..d {
        let mut acc = [0i32; TILE];
        let mut q0 = 0;
        for (gi, &end) in s8.ends.iter().enumerate() {
            let k = s8.shift[gi * d + dd];
            for a in acc.iter_mut() {
                *a <<= k;
            }
            for q in q0..end {
                let w = s8.w[q * d + dd];
                for (a, &u) in acc.iter_mut().zip(&packed[q * TILE..(q + 1) * TILE]) {
                    *a += dot4(u, w);
                }
            }
            q0 = end;
        }
        let (c, s, mu) = (s8.corr[dd], s8.scale[dd], mean[dd]);
        for ((o, &a), &gt) in keys[dd * TILE..(dd + 1) * TILE].iter_mut().zip(&acc).zip(g) {
            *o = gt.mul_add((a - c) as f32 * s, mu);
        }
    }
}
