//! AVX-512 F/BW + VNNI twin of [`super::fp4_scalar`]. A 64-byte chunk holds 16 rows × 8 k of
//! E2M1 codes in INT4's arrangement; its low and high nibbles (`and`, `srli`+`and`) index a
//! 16-entry table with `vpshufb` (the table [`E2M1_X2_BIASED`] in every 128-bit lane), giving
//! `2·value + 12` as unsigned bytes, which `vpdpbusd` multiplies with the broadcast INT8
//! activations exactly as the INT4 kernel does; the +12 is removed per group with the activation
//! sums. Group scales are decoded from their stored bytes in registers: E8M0 as `e << 23` (2⁻¹²⁷,
//! e = 0, blended in), E4M3 as the f16 `E4M3 / 256` (sign-extended, shifted and masked, then
//! `vcvtph2ps`; the row factor holds the 256).
//!
//! The outputs stay in registers over all groups: at M = 1 ([`block_rows`]), at M = 2 (a decode
//! token's value and residual rows, [`block_m2`], whose one chain per row starts at the bias
//! correction), and for more rows in tiles of up to 8 ([`block_rows`] out of line; the row block's
//! bytes stay in cache for the next tile). NVFP4's groups of 16 are too short to reload and store
//! them per group, as the first form of the tiles did. There is no AMX form: FP4 layouts never
//! take the AMX kernel (see [`super::matmul_packed`]).

use std::arch::x86_64::*;
use std::ops::Range;

use krasis_quant::cpu_layout::{PackedLayout, CHUNK, ROW_BLOCK};
use krasis_quant::fp4::{Fp4Kind, E2M1_X2_BIASED};

use super::avx512::bcast4;
use super::{Prefetch, PrefetchHint, QuantizedActs};

/// The 16 scales of group `g` as f32 times the row factors `f` (the scalar's `s · f`).
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn scales_times_factors(blk: *const u8, l: &PackedLayout, g: usize, nv: bool, f: __m512) -> __m512 {
    let s = if nv {
        // E4M3 / 256 as an f16 (see `krasis_quant::fp4::kernel_scale`): exact, one conversion.
        // Sign-extended to 16 bits and shifted left by 7, the byte's magnitude lands in the f16's
        // bits 7..=13 and its sign fills bits 14 and 15; clearing bit 14 leaves the f16.
        let w = _mm256_cvtepi8_epi16(_mm_loadu_si128(blk.add(l.scales_offset(g)) as *const __m128i));
        _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16::<7>(w), _mm256_set1_epi16(E4M3_AS_F16_BITS)))
    } else {
        let b = _mm512_cvtepu8_epi32(_mm_loadu_si128(blk.add(l.scales_offset(g)) as *const __m128i));
        let bits = _mm512_slli_epi32::<23>(b);
        let zero = _mm512_cmpeq_epi32_mask(b, _mm512_setzero_si512());
        _mm512_castsi512_ps(_mm512_mask_mov_epi32(bits, zero, _mm512_set1_epi32(0x0040_0000)))
    };
    _mm512_mul_ps(s, f)
}

/// The f16 bits an E4M3 scale shifted left by 7 keeps: magnitude (7..=13) and sign (15).
pub(super) const E4M3_AS_F16_BITS: i16 = 0xbf80u16 as i16;

/// # Safety
/// The CPU must have AVX-512 F/BW/VNNI; arguments checked by [`super::matmul_packed_with`]
/// (an FP4 layout).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub(super) unsafe fn matmul(
    w: &[u8],
    l: &PackedLayout,
    acts: &QuantizedActs,
    blocks: Range<usize>,
    groups: Range<usize>,
    out: &mut [f32],
    pf: Prefetch,
) {
    let nv = l.fp4.expect("an FP4 layout") == Fp4Kind::Nvfp4;
    match pf.hint {
        PrefetchHint::T1 => run::<_MM_HINT_T1>(w, l, acts, blocks, groups, out, pf.distance, nv),
        PrefetchHint::Nta => run::<_MM_HINT_NTA>(w, l, acts, blocks, groups, out, pf.distance, nv),
        PrefetchHint::T0 => run::<_MM_HINT_T0>(w, l, acts, blocks, groups, out, pf.distance, nv),
        PrefetchHint::None => run::<_MM_HINT_T0>(w, l, acts, blocks, groups, out, 0, nv),
    }
}

#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn run<const HINT: i32>(
    w: &[u8],
    l: &PackedLayout,
    acts: &QuantizedActs,
    blocks: Range<usize>,
    groups: Range<usize>,
    out: &mut [f32],
    pfd: usize,
    nv: bool,
) {
    let ncols = blocks.len() * ROW_BLOCK;
    let bb = l.block_bytes();
    let lut = _mm512_broadcast_i32x4(_mm_loadu_si128(E2M1_X2_BIASED.as_ptr() as *const __m128i));
    for (bi, b) in blocks.enumerate() {
        let blk = w.as_ptr().add(b * bb);
        let y = out.as_mut_ptr().add(bi * ROW_BLOCK);
        if groups.start == 0 && acts.m > 2 {
            for i in 0..acts.m {
                _mm512_storeu_ps(y.add(i * ncols), _mm512_setzero_ps());
            }
        }
        if pfd != 0 {
            _mm_prefetch::<HINT>(blk.wrapping_add(pfd) as *const i8);
        }
        let f = _mm512_loadu_ps(blk as *const f32);
        if acts.m == 1 {
            block_rows::<HINT, 1>(blk, l, acts, 0, y, ncols, groups.clone(), pfd, lut, nv, f);
            continue;
        }
        if acts.m == 2 {
            block_m2::<HINT>(blk, l, acts, y, ncols, groups.clone(), pfd, lut, nv, f);
            continue;
        }
        // Tiles of up to 8 activation rows, each over every group with its outputs in
        // registers; the first tile brings the row block in, later ones read it from cache.
        let mut i = 0;
        let mut pfd_t = pfd;
        while i < acts.m {
            let left = acts.m - i;
            let gr = groups.clone();
            i += if left >= 8 {
                rows_tile::<HINT, 8>(blk, l, acts, i, y, ncols, gr, pfd_t, lut, nv, f)
            } else if left >= 4 {
                rows_tile::<HINT, 4>(blk, l, acts, i, y, ncols, gr, pfd_t, lut, nv, f)
            } else if left >= 2 {
                rows_tile::<HINT, 2>(blk, l, acts, i, y, ncols, gr, pfd_t, lut, nv, f)
            } else {
                rows_tile::<HINT, 1>(blk, l, acts, i, y, ncols, gr, pfd_t, lut, nv, f)
            };
            pfd_t = 0;
        }
    }
}

/// Activation rows `i0 .. i0 + R` of one row block (M = 1; the tiles of up to 8 rows at M > 2;
/// M = 2, a decode token as value + residual rows, takes [`block_m2`]), groups `groups` in K
/// order: the rows' 16 outputs stay in registers
/// (continuing what `y` holds, or from zero when `groups` starts at 0), so each group reads its
/// weights and decodes its scales once for all rows and touches no output memory. Two chains per
/// row (low / high nibble) keep the `vpdpbusd` latency hidden: with one row, one chain waits on
/// its latency (measured 17 % slower on one Zen 4 core). Returns `R`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[allow(clippy::too_many_arguments)]
unsafe fn block_rows<const HINT: i32, const R: usize>(
    blk: *const u8,
    l: &PackedLayout,
    acts: &QuantizedActs,
    i0: usize,
    y: *mut f32,
    ncols: usize,
    groups: Range<usize>,
    pfd: usize,
    lut: __m512i,
    nv: bool,
    f: __m512,
) -> usize {
    let (gs, k, ng) = (l.gs, l.k, l.groups());
    let off = l.offset();
    let fresh = groups.start == 0;
    debug_assert!(i0 + R <= acts.m);
    // Row i0's activations, sums, scales and outputs (rows i0 .. i0 + R are inside `acts`).
    let (q, sums, scales, y) = (
        acts.q.as_ptr().add(i0 * k),
        acts.sums.as_ptr().add(i0 * ng),
        acts.scales.as_ptr().add(i0 * ng),
        y.add(i0 * ncols),
    );
    let mut yv: [__m512; R] =
        std::array::from_fn(|i| if fresh { _mm512_setzero_ps() } else { _mm512_loadu_ps(y.add(i * ncols)) });
    for g in groups {
        let xq: [*const i8; R] = std::array::from_fn(|i| q.add(i * k + g * gs));
        let a = group_sums::<HINT, R>(blk.add(l.weights_offset(g)), l, xq, pfd, lut);
        let sf = scales_times_factors(blk, l, g, nv, f);
        for (i, acc) in a.iter().enumerate() {
            let corr = _mm512_set1_epi32(off * *sums.add(i * ng + g));
            let d = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_add_epi32(acc[0], acc[1]), corr));
            yv[i] = _mm512_fmadd_ps(d, _mm512_mul_ps(sf, _mm512_set1_ps(*scales.add(i * ng + g))), yv[i]);
        }
    }
    for (i, v) in yv.iter().enumerate() {
        _mm512_storeu_ps(y.add(i * ncols), *v);
    }
    R
}

/// [`block_rows`] for the tiles of M > 2, kept out of line: inlined beside the M = 1 and M = 2
/// loops in [`run`], its four instantiations cost those loops 6–15 % (one Zen 4 core, hot;
/// alternated with 5cda964 since: NVFP4 M = 1 / 2 within 1–2 %, M = 8 10.1 → 17.1 GiB/s; MXFP4
/// M = 8 14.0–14.9 → 20.3–21.8).
#[inline(never)]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[allow(clippy::too_many_arguments)]
unsafe fn rows_tile<const HINT: i32, const R: usize>(
    blk: *const u8,
    l: &PackedLayout,
    acts: &QuantizedActs,
    i0: usize,
    y: *mut f32,
    ncols: usize,
    groups: Range<usize>,
    pfd: usize,
    lut: __m512i,
    nv: bool,
    f: __m512,
) -> usize {
    block_rows::<HINT, R>(blk, l, acts, i0, y, ncols, groups, pfd, lut, nv, f)
}

/// [`block_rows`] at M = 2 (a decode token's value and residual rows), with one `vpdpbusd` chain
/// per row that starts at the row's `−12·Σ q_x` ([`group_sums_chained`]): two fewer integer
/// operations per row and group than two chains and a correction, which at NVFP4's groups of 16
/// is a quarter of the epilogue; the same integer sums, so the same outputs.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[allow(clippy::too_many_arguments)]
unsafe fn block_m2<const HINT: i32>(
    blk: *const u8,
    l: &PackedLayout,
    acts: &QuantizedActs,
    y: *mut f32,
    ncols: usize,
    groups: Range<usize>,
    pfd: usize,
    lut: __m512i,
    nv: bool,
    f: __m512,
) {
    let (gs, k, ng) = (l.gs, l.k, l.groups());
    let off = l.offset();
    let fresh = groups.start == 0;
    let mut yv: [__m512; 2] =
        std::array::from_fn(|i| if fresh { _mm512_setzero_ps() } else { _mm512_loadu_ps(y.add(i * ncols)) });
    for g in groups {
        let xq: [*const i8; 2] = std::array::from_fn(|i| acts.q.as_ptr().add(i * k + g * gs));
        let init = std::array::from_fn(|i| _mm512_set1_epi32(-(off * acts.sums[i * ng + g])));
        let a = group_sums_chained::<HINT, 2>(blk.add(l.weights_offset(g)), l, xq, init, pfd, lut);
        let sf = scales_times_factors(blk, l, g, nv, f);
        for (i, acc) in a.iter().enumerate() {
            let d = _mm512_cvtepi32_ps(*acc);
            yv[i] = _mm512_fmadd_ps(d, _mm512_mul_ps(sf, _mm512_set1_ps(acts.scales[i * ng + g])), yv[i]);
        }
    }
    for (i, v) in yv.iter().enumerate() {
        _mm512_storeu_ps(y.add(i * ncols), *v);
    }
}

/// One group's integer sums for activation rows `xq` (each at the group's first k), one
/// `vpdpbusd` chain per row continuing `init` (at M = 2 the two rows' chains, and the next
/// group's, hide each other's latency; one chain per row spares an add per row and group).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn group_sums_chained<const HINT: i32, const T: usize>(
    wp: *const u8,
    l: &PackedLayout,
    xq: [*const i8; T],
    init: [__m512i; T],
    pfd: usize,
    lut: __m512i,
) -> [__m512i; T] {
    let nchunks = l.group_weight_bytes() / CHUNK;
    let mask = _mm512_set1_epi8(0x0f);
    let mut a = init;
    for c in 0..nchunks {
        let p = wp.add(c * CHUNK);
        if pfd != 0 {
            _mm_prefetch::<HINT>(p.wrapping_add(pfd) as *const i8);
        }
        let v = _mm512_loadu_si512(p as *const _);
        let lo = _mm512_shuffle_epi8(lut, _mm512_and_si512(v, mask));
        let hi = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16::<4>(v), mask));
        for (acc, x) in a.iter_mut().zip(xq) {
            *acc = _mm512_dpbusd_epi32(*acc, lo, bcast4(x.add(c * 8)));
            *acc = _mm512_dpbusd_epi32(*acc, hi, bcast4(x.add(c * 8 + 4)));
        }
    }
    a
}

/// One group's integer sums for activation rows `xq` (each at the group's first k), low and high
/// nibbles in separate accumulators (two independent chains per row), the +12 bias not yet
/// removed.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn group_sums<const HINT: i32, const T: usize>(
    wp: *const u8,
    l: &PackedLayout,
    xq: [*const i8; T],
    pfd: usize,
    lut: __m512i,
) -> [[__m512i; 2]; T] {
    let nchunks = l.group_weight_bytes() / CHUNK;
    let mask = _mm512_set1_epi8(0x0f);
    let mut a = [[_mm512_setzero_si512(); 2]; T];
    for c in 0..nchunks {
        let p = wp.add(c * CHUNK);
        if pfd != 0 {
            _mm_prefetch::<HINT>(p.wrapping_add(pfd) as *const i8);
        }
        let v = _mm512_loadu_si512(p as *const _);
        let lo = _mm512_shuffle_epi8(lut, _mm512_and_si512(v, mask));
        let hi = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16::<4>(v), mask));
        for (acc, x) in a.iter_mut().zip(xq) {
            acc[0] = _mm512_dpbusd_epi32(acc[0], lo, bcast4(x.add(c * 8)));
            acc[1] = _mm512_dpbusd_epi32(acc[1], hi, bcast4(x.add(c * 8 + 4)));
        }
    }
    a
}
