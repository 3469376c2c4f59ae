//! The syntheses of a tile of keys coded before RoPE from its centroids (float32 `fma`
//! chains; `vdpbf16ps` or its float32 pairs for the bfloat16 synthesis; `vpdpwssd` or
//! `vpmaddwd` for the fixed-point one; the rotation in registers), and the look-up of the
//! centroids as the 16-bit pairs the last two read.

use super::super::fixed::FixedSynthesis;
use super::super::kernel::{bf16_half, Rot, TILE};
use super::super::tables::{Component, StreamTables};
use std::arch::x86_64::*;

/// Dimensions `d0 .. d0 + N` of [`Tile::synthesize`]: `N x 4` accumulators of 16 rows held in
/// registers across the components (the same `fma` chains as the definition).
///
/// [`Tile::synthesize`]: super::super::kernel::Tile::synthesize
#[target_feature(enable = "avx512f,fma")]
pub(super) unsafe fn synthesize_block<const N: usize>(
    d: usize,
    d0: usize,
    m: usize,
    tile: &[f32],
    msyn: &[f32],
    keys: &mut [f32],
) {
    let mut acc = [[_mm512_setzero_ps(); 4]; N];
    let (tp, mp) = (tile.as_ptr(), msyn.as_ptr());
    for j in 0..m {
        let c = [
            _mm512_loadu_ps(tp.add(j * TILE)),
            _mm512_loadu_ps(tp.add(j * TILE + 16)),
            _mm512_loadu_ps(tp.add(j * TILE + 32)),
            _mm512_loadu_ps(tp.add(j * TILE + 48)),
        ];
        for (k, a) in acc.iter_mut().enumerate() {
            let w = _mm512_set1_ps(*mp.add(j * d + d0 + k));
            for (x, &cg) in a.iter_mut().zip(&c) {
                *x = _mm512_fmadd_ps(w, cg, *x);
            }
        }
    }
    let kp = keys.as_mut_ptr();
    for (k, a) in acc.iter().enumerate() {
        for (g, &x) in a.iter().enumerate() {
            _mm512_storeu_ps(kp.add((d0 + k) * TILE + 16 * g), x);
        }
    }
}

/// Whether this CPU has AVX-512 BF16 (`vdpbf16ps`); without it the same chains run as pairs of
/// float32 `fma`s.
pub fn has_bf16() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| is_x86_feature_detected!("avx512bf16"))
}

/// The unpacked indices of a tile looked up and rounded to bfloat16 pairs, or (`FIXED`) to
/// 16-bit fixed-point ones: [`centroids`] then [`super::kernel::pack_tile`] (or
/// [`super::super::fixed::pack_tile`]) without the float32 tile between them. Each component is
/// looked up from its table rounded beforehand ([`StreamTables::table16`]), 32 rows per 16-bit
/// permute of 64 entries (blended by the index's bits 6 and 7 past 6 bits), and the two members
/// of a pair interleaved into packed words by two more permutes.
///
/// [`centroids`]: super::lookup::centroids
/// [`super::kernel::pack_tile`]: super::super::kernel::pack_tile
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
pub(super) unsafe fn centroids_packed<const FIXED: bool>(
    t: &StreamTables,
    bytes: &[u8],
    packed: &mut [u32],
) {
    let slots = 8 * t.groups.len();
    let bp = bytes.as_ptr();
    let pp = packed.as_mut_ptr();
    // Word `2l` from word `l` of the first source, word `2l + 1` from word `l` of the second:
    // rows 0-15 of the 32 (`h = 0`), rows 16-31 (`h = 1`).
    let inter = |h: u16| {
        let w: [u16; 32] = std::array::from_fn(|i| (i as u16 / 2) + 16 * h + 32 * (i as u16 % 2));
        _mm512_loadu_si512(w.as_ptr() as *const _)
    };
    let (inter_lo, inter_hi) = (inter(0), inter(1));
    let at = |rg: usize, c: &Component| bp.add((rg * slots + c.slot as usize) * 16);
    // Rows 32 h .. 32 h + 31 of component `j`: its index bytes as words, looked up.
    let words = |j: usize, h: usize| {
        let (c, tab) = (&t.comps[j], t.table16(j, FIXED));
        let idx = _mm512_cvtepu8_epi16(_mm256_set_m128i(
            _mm_loadu_si128(at(2 * h + 1, c) as *const __m128i),
            _mm_loadu_si128(at(2 * h, c) as *const __m128i),
        ));
        let chunk = |k: usize| {
            let p = tab.as_ptr().add(64 * k);
            _mm512_permutex2var_epi16(
                _mm512_loadu_si512(p as *const _),
                idx,
                _mm512_loadu_si512(p.add(32) as *const _),
            )
        };
        let bit = |b: u16| _mm512_test_epi16_mask(idx, _mm512_set1_epi16(b as i16));
        match tab.len() {
            64 => chunk(0),
            128 => _mm512_mask_blend_epi16(bit(64), chunk(0), chunk(1)),
            _ => {
                let lo = _mm512_mask_blend_epi16(bit(64), chunk(0), chunk(1));
                let hi = _mm512_mask_blend_epi16(bit(64), chunk(2), chunk(3));
                _mm512_mask_blend_epi16(bit(128), lo, hi)
            }
        }
    };
    for p in 0..t.comps.len().div_ceil(2) {
        for h in 0..2 {
            let a = words(2 * p, h);
            let b = if 2 * p + 1 < t.comps.len() {
                words(2 * p + 1, h)
            } else {
                _mm512_setzero_si512()
            };
            let out = pp.add(p * TILE + 32 * h);
            _mm512_storeu_si512(out as *mut _, _mm512_permutex2var_epi16(a, inter_lo, b));
            _mm512_storeu_si512(
                out.add(16) as *mut _,
                _mm512_permutex2var_epi16(a, inter_hi, b),
            );
        }
    }
}

/// The scale and mean a synthesised tile is stored with: `fma(g_t, x, mean_d)`.
pub(super) struct Affine<'a> {
    pub(super) g: &'a [f32; TILE],
    pub(super) mean: &'a [f32],
}

impl Affine<'_> {
    #[inline(always)]
    unsafe fn store<const N: usize>(&self, d0: usize, acc: &[[__m512; 4]; N], keys: &mut [f32]) {
        let gp = self.g.as_ptr();
        let kp = keys.as_mut_ptr();
        let gv = [
            _mm512_loadu_ps(gp),
            _mm512_loadu_ps(gp.add(16)),
            _mm512_loadu_ps(gp.add(32)),
            _mm512_loadu_ps(gp.add(48)),
        ];
        for (k, a) in acc.iter().enumerate() {
            let mu = _mm512_set1_ps(self.mean[d0 + k]);
            for (g, &x) in a.iter().enumerate() {
                _mm512_storeu_ps(
                    kp.add((d0 + k) * TILE + 16 * g),
                    _mm512_fmadd_ps(gv[g], x, mu),
                );
            }
        }
    }
}

/// What the syntheses of keys coded before RoPE sum per channel over a tile's packed pairs,
/// rows in lanes, before the scale and the mean: [`Bf16`]'s `vdpbf16ps` chains or [`Fixed`]'s
/// exact integer sums. The loops over channels and frequencies ([`from_with`],
/// [`rotated_with`]) are written once for both.
pub(super) trait Chains: Copy {
    /// The sums of channels `dims`.
    unsafe fn sums<const N: usize>(
        self,
        d: usize,
        dims: [usize; N],
        pairs: usize,
        packed: &[u32],
    ) -> [[__m512; 4]; N];
}

/// The bfloat16 synthesis: `M` rounded to bfloat16 pairs ([`StreamTables::key_synthesis_bf16`]);
/// its sums need AVX-512 BF16.
#[derive(Clone, Copy)]
pub(super) struct Bf16<'a>(pub(super) &'a [u32]);

impl Chains for Bf16<'_> {
    /// The `vdpbf16ps` chains (high pair member first, then the low one, each rounded as an
    /// `fma`: the definition's chain).
    #[inline(always)]
    unsafe fn sums<const N: usize>(
        self,
        d: usize,
        dims: [usize; N],
        pairs: usize,
        packed: &[u32],
    ) -> [[__m512; 4]; N] {
        let mut acc = [[_mm512_setzero_ps(); 4]; N];
        let (tp, mp) = (packed.as_ptr(), self.0.as_ptr());
        for p in 0..pairs {
            let c: [__m512bh; 4] = std::array::from_fn(|g| {
                std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(
                    tp.add(p * TILE + 16 * g) as *const _,
                ))
            });
            for (a, &dd) in acc.iter_mut().zip(&dims) {
                let w: __m512bh =
                    std::mem::transmute(_mm512_set1_epi32(*mp.add(p * d + dd) as i32));
                for (x, &cg) in a.iter_mut().zip(&c) {
                    *x = _mm512_dpbf16_ps(*x, w, cg);
                }
            }
        }
        acc
    }
}

/// The 16-bit fixed-point synthesis ([`super::super::fixed::synthesize_tile`]): per pair of
/// components and 16 rows one `vpdpwssd` (`VNNI`, AVX-512 VNNI) or `vpmaddwd` + `vpaddd`,
/// summed exactly in 32 bits, then `x as f32 * unit_d`.
#[derive(Clone, Copy)]
pub(super) struct Fixed<'a, const VNNI: bool>(pub(super) &'a FixedSynthesis);

impl<const VNNI: bool> Chains for Fixed<'_, VNNI> {
    #[inline(always)]
    unsafe fn sums<const N: usize>(
        self,
        d: usize,
        dims: [usize; N],
        pairs: usize,
        packed: &[u32],
    ) -> [[__m512; 4]; N] {
        let mut acc = [[_mm512_setzero_si512(); 4]; N];
        let (tp, wp) = (packed.as_ptr(), self.0.words.as_ptr());
        for p in 0..pairs {
            let c: [__m512i; 4] =
                std::array::from_fn(|g| _mm512_loadu_si512(tp.add(p * TILE + 16 * g) as *const _));
            for (a, &dd) in acc.iter_mut().zip(&dims) {
                let w = _mm512_set1_epi32(*wp.add(p * d + dd) as i32);
                for (x, &cg) in a.iter_mut().zip(&c) {
                    // Exact: the bound in `fixed.rs`'s documentation.
                    *x = if VNNI {
                        _mm512_dpwssd_epi32(*x, cg, w)
                    } else {
                        _mm512_add_epi32(*x, _mm512_madd_epi16(cg, w))
                    };
                }
            }
        }
        let mut out = [[_mm512_setzero_ps(); 4]; N];
        for k in 0..N {
            let unit = _mm512_set1_ps(self.0.unit[dims[k]]);
            for g in 0..4 {
                out[k][g] = _mm512_mul_ps(_mm512_cvtepi32_ps(acc[k][g]), unit);
            }
        }
        out
    }
}

/// Whether this CPU has AVX-512 VNNI (`vpdpwssd`).
pub(super) fn has_vnni() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| is_x86_feature_detected!("avx512vnni"))
}

/// Channels `d0 .. d` of a synthesis, in blocks of 4, then 1: `fma(g_t, x, mean_d)`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn from_with<C: Chains>(
    c: C,
    d: usize,
    d0: usize,
    pairs: usize,
    packed: &[u32],
    y: &Affine<'_>,
    keys: &mut [f32],
) {
    let mut d0 = d0;
    while d0 + 4 <= d {
        let acc = c.sums::<4>(d, std::array::from_fn(|k| d0 + k), pairs, packed);
        y.store(d0, &acc, keys);
        d0 += 4;
    }
    while d0 < d {
        y.store(d0, &c.sums::<1>(d, [d0], pairs, packed), keys);
        d0 += 1;
    }
}

/// A synthesis with the rotation in registers: both channels of two frequencies per block
/// ([`rot_block`]), a last odd one alone, then the channels past the rotation as
/// [`from_with`] does them. The caller checks the sizes.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn rotated_with<C: Chains>(
    c: C,
    d: usize,
    pairs: usize,
    packed: &[u32],
    y: &Affine<'_>,
    rot: &Rot<'_>,
    keys: &mut [f32],
) {
    let h = rot.half;
    let mut i = 0;
    while i + 2 <= h {
        let ((a0, b0), (a1, b1)) = (rot.pair(i), rot.pair(i + 1));
        let acc = c.sums::<4>(d, [a0, a1, b0, b1], pairs, packed);
        rot_block::<4, 2>(&acc, [a0, a1, b0, b1], [i, i + 1], y, rot, keys);
        i += 2;
    }
    if i < h {
        let (a, b) = rot.pair(i);
        let acc = c.sums::<2>(d, [a, b], pairs, packed);
        rot_block::<2, 1>(&acc, [a, b], [i], y, rot, keys);
    }
    from_with(c, d, 2 * h, pairs, packed, y, keys);
}

/// Channels `dims` from their sums `acc`: `dims[k]` and `dims[k + F]` are the two channels of
/// frequency `freqs[k]`; scaled, shifted and rotated in registers (the operations of
/// [`rotate_tile`], in its order), then stored.
///
/// [`rotate_tile`]: super::super::kernel::rotate_tile
#[inline(always)]
unsafe fn rot_block<const N: usize, const F: usize>(
    acc: &[[__m512; 4]; N],
    dims: [usize; N],
    freqs: [usize; F],
    y: &Affine<'_>,
    rot: &Rot<'_>,
    keys: &mut [f32],
) {
    let gp = y.g.as_ptr();
    let gv: [__m512; 4] = std::array::from_fn(|g| _mm512_loadu_ps(gp.add(16 * g)));
    let kp = keys.as_mut_ptr();
    for (k, &i) in freqs.iter().enumerate() {
        let (a, b) = (dims[k], dims[k + F]);
        let (mua, mub) = (_mm512_set1_ps(y.mean[a]), _mm512_set1_ps(y.mean[b]));
        let (cp, sp) = (
            rot.cos.as_ptr().add(rot.at(i)),
            rot.sin.as_ptr().add(rot.at(i)),
        );
        for g in 0..4 {
            let u = _mm512_fmadd_ps(gv[g], acc[k][g], mua);
            let v = _mm512_fmadd_ps(gv[g], acc[k + F][g], mub);
            let (c, sn) = (
                _mm512_loadu_ps(cp.add(16 * g)),
                _mm512_loadu_ps(sp.add(16 * g)),
            );
            let ya = _mm512_sub_ps(_mm512_mul_ps(u, c), _mm512_mul_ps(v, sn));
            let yb = _mm512_add_ps(_mm512_mul_ps(v, c), _mm512_mul_ps(u, sn));
            _mm512_storeu_ps(kp.add(a * TILE + 16 * g), ya);
            _mm512_storeu_ps(kp.add(b * TILE + 16 * g), yb);
        }
    }
}

/// [`Tile::synthesize_bf16`] from channel `d0` with `vdpbf16ps`.
///
/// [`Tile::synthesize_bf16`]: super::super::kernel::Tile::synthesize_bf16
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bf16")]
pub(super) unsafe fn synthesize_bf16_from(
    d: usize,
    d0: usize,
    pairs: usize,
    packed: &[u32],
    mb: &[u32],
    y: &Affine<'_>,
    keys: &mut [f32],
) {
    from_with(Bf16(mb), d, d0, pairs, packed, y, keys)
}

/// [`Tile::synthesize_bf16_rotated`] with `vdpbf16ps` (sizes checked by the caller).
///
/// [`Tile::synthesize_bf16_rotated`]: super::super::kernel::Tile::synthesize_bf16_rotated
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bf16")]
pub(super) unsafe fn synthesize_bf16_rot(
    d: usize,
    pairs: usize,
    packed: &[u32],
    mb: &[u32],
    y: &Affine<'_>,
    rot: &Rot<'_>,
    keys: &mut [f32],
) {
    rotated_with(Bf16(mb), d, pairs, packed, y, rot, keys)
}

/// [`Tile::synthesize_i16_rotated`] with `vpdpwssd` (sizes checked by the caller).
///
/// [`Tile::synthesize_i16_rotated`]: super::super::kernel::Tile::synthesize_i16_rotated
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub(super) unsafe fn synthesize_i16_vnni(
    d: usize,
    pairs: usize,
    packed: &[u32],
    f: &FixedSynthesis,
    y: &Affine<'_>,
    rot: &Rot<'_>,
    keys: &mut [f32],
) {
    rotated_with(Fixed::<true>(f), d, pairs, packed, y, rot, keys)
}

/// [`synthesize_i16_vnni`] without AVX-512 VNNI: `vpmaddwd` + `vpaddd`, the same sums.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn synthesize_i16_madd(
    d: usize,
    pairs: usize,
    packed: &[u32],
    f: &FixedSynthesis,
    y: &Affine<'_>,
    rot: &Rot<'_>,
    keys: &mut [f32],
) {
    rotated_with(Fixed::<false>(f), d, pairs, packed, y, rot, keys)
}

/// A block of [`synthesize_bf16_from`] without AVX-512 BF16: each pair as two float32 `fma`s.
#[target_feature(enable = "avx512f,fma")]
pub(super) unsafe fn synthesize_bf16_fma<const N: usize>(
    d: usize,
    d0: usize,
    pairs: usize,
    packed: &[u32],
    mb: &[u32],
    y: &Affine<'_>,
    keys: &mut [f32],
) {
    let mut acc = [[_mm512_setzero_ps(); 4]; N];
    let (tp, mp) = (packed.as_ptr(), mb.as_ptr());
    let high = _mm512_set1_epi32(0xffff_0000u32 as i32);
    for p in 0..pairs {
        let mut ch = [_mm512_setzero_ps(); 4];
        let mut cl = [_mm512_setzero_ps(); 4];
        for g in 0..4 {
            let w = _mm512_loadu_si512(tp.add(p * TILE + 16 * g) as *const _);
            ch[g] = _mm512_castsi512_ps(_mm512_and_si512(w, high));
            cl[g] = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(w));
        }
        for (k, a) in acc.iter_mut().enumerate() {
            let w = *mp.add(p * d + d0 + k);
            let (wh, wl) = (
                _mm512_set1_ps(bf16_half(w, true)),
                _mm512_set1_ps(bf16_half(w, false)),
            );
            for g in 0..4 {
                a[g] = _mm512_fmadd_ps(wh, ch[g], a[g]);
                a[g] = _mm512_fmadd_ps(wl, cl[g], a[g]);
            }
        }
    }
    y.store(d0, &acc, keys);
}
