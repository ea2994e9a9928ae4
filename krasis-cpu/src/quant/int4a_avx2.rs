//! AVX2 twin of [`super::int4a_scalar`] (asymmetric INT4 g32). A 64-byte chunk is two ymm (rows
//! 0–7, rows 8–15, each row's 4 bytes adjacent); its nibbles (codes 0..=15) go to
//! `maddubs(q, x)` (u8 × s8 → pairwise i16: at most 2·15·127 = 3810, twice per chunk 7620 <
//! 2¹⁵, no saturation) and `madd(·, 1)` gives each row's i32 sum per chunk. The epilogue is the
//! scalar's: `y = fma(Σ q·x_q, d · s_x, y)` then `y = fma(m, Σ x_q · s_x, y)`. Activation rows go
//! in tiles of up to 4, each over all the groups with its outputs in registers (one Zen 4 VM,
//! `KRASIS_ISA=avx2`, V2-Lite shapes: a 64-token prefill 224–226 → 242–243 tok/s against loading
//! and storing them around every group of 32).

use std::arch::x86_64::*;
use std::ops::Range;

use krasis_quant::cpu_layout::{PackedLayout, CHUNK, ROW_BLOCK};

use super::avx2::bcast4;
use super::{Prefetch, PrefetchHint, QuantizedActs};

/// 8 f16 at `p` as f32.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn f16x8(p: *const u8) -> __m256 {
    _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
}

/// # Safety
/// The CPU must have AVX2, FMA and F16C; arguments checked by [`super::matmul_packed_with`] (an
/// asymmetric INT4 layout).
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn matmul(
    w: &[u8],
    l: &PackedLayout,
    acts: &QuantizedActs,
    blocks: Range<usize>,
    groups: Range<usize>,
    out: &mut [f32],
    pf: Prefetch,
) {
    debug_assert!(l.asym);
    let pfd = if pf.hint == PrefetchHint::None { 0 } else { pf.distance };
    let ncols = blocks.len() * ROW_BLOCK;
    let bb = l.block_bytes();
    for (bi, b) in blocks.enumerate() {
        let blk = w.as_ptr().add(b * bb);
        let y = out.as_mut_ptr().add(bi * ROW_BLOCK);
        if groups.start == 0 {
            for i in 0..acts.m {
                _mm256_storeu_ps(y.add(i * ncols), _mm256_setzero_ps());
                _mm256_storeu_ps(y.add(i * ncols + 8), _mm256_setzero_ps());
            }
        }
        // Tiles of up to 4 activation rows (a decode token's 2 included), each over every group
        // with its outputs in registers; the first tile brings the row block in, later ones read
        // it from cache.
        let mut i = 0;
        let mut pfd_t = pfd;
        while i < acts.m {
            let left = acts.m - i;
            i += if left >= 4 {
                rows_tile::<4>(blk, l, acts, i, y, ncols, groups.clone(), pfd_t)
            } else if left >= 2 {
                rows_tile::<2>(blk, l, acts, i, y, ncols, groups.clone(), pfd_t)
            } else {
                rows_tile::<1>(blk, l, acts, i, y, ncols, groups.clone(), pfd_t)
            };
            pfd_t = 0;
        }
    }
}

/// Activation rows `i0 .. i0 + T` of one row block over groups `groups` in K order, their
/// outputs in registers throughout (continuing what `y` holds): the same operations in the same
/// order as the scalar twin. Returns `T`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn rows_tile<const T: usize>(
    blk: *const u8,
    l: &PackedLayout,
    acts: &QuantizedActs,
    i0: usize,
    y: *mut f32,
    ncols: usize,
    groups: Range<usize>,
    pfd: usize,
) -> usize {
    let (k, gs, ng) = (l.k, l.gs, l.groups());
    let nchunks = l.group_weight_bytes() / CHUNK;
    let mask = _mm256_set1_epi8(0x0f);
    let ones = _mm256_set1_epi16(1);
    let mut ya: [__m256; T] = std::array::from_fn(|t| _mm256_loadu_ps(y.add((i0 + t) * ncols)));
    let mut yb: [__m256; T] = std::array::from_fn(|t| _mm256_loadu_ps(y.add((i0 + t) * ncols + 8)));
    for g in groups {
        let hp = blk.add(l.scales_offset(g));
        if pfd != 0 {
            _mm_prefetch::<_MM_HINT_T0>(hp.wrapping_add(pfd) as *const i8);
        }
        let wp = blk.add(l.weights_offset(g));
        let xq: [*const i8; T] = std::array::from_fn(|t| acts.q.as_ptr().add((i0 + t) * k + g * gs));
        let mut aa = [_mm256_setzero_si256(); T];
        let mut ab = [_mm256_setzero_si256(); T];
        for c in 0..nchunks {
            let p = wp.add(c * CHUNK);
            if pfd != 0 {
                _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(pfd) as *const i8);
            }
            let va = _mm256_loadu_si256(p as *const __m256i);
            let vb = _mm256_loadu_si256(p.add(32) as *const __m256i);
            let (la, ha) = (_mm256_and_si256(va, mask), _mm256_and_si256(_mm256_srli_epi16::<4>(va), mask));
            let (lb, hb) = (_mm256_and_si256(vb, mask), _mm256_and_si256(_mm256_srli_epi16::<4>(vb), mask));
            for t in 0..T {
                let (xl, xh) = (bcast4(xq[t].add(c * 8)), bcast4(xq[t].add(c * 8 + 4)));
                let sa = _mm256_add_epi16(_mm256_maddubs_epi16(la, xl), _mm256_maddubs_epi16(ha, xh));
                let sb = _mm256_add_epi16(_mm256_maddubs_epi16(lb, xl), _mm256_maddubs_epi16(hb, xh));
                aa[t] = _mm256_add_epi32(aa[t], _mm256_madd_epi16(sa, ones));
                ab[t] = _mm256_add_epi32(ab[t], _mm256_madd_epi16(sb, ones));
            }
        }
        // The scales of rows 0–7, 8–15, then the minimums of rows 0–7, 8–15.
        let dm = (f16x8(hp), f16x8(hp.add(16)), f16x8(hp.add(32)), f16x8(hp.add(48)));
        for t in 0..T {
            let i = i0 + t;
            let s = acts.scales[i * ng + g];
            let (sx, offset) = (_mm256_set1_ps(s), _mm256_set1_ps(acts.sums[i * ng + g] as f32 * s));
            let a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(aa[t]), _mm256_mul_ps(dm.0, sx), ya[t]);
            let b = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ab[t]), _mm256_mul_ps(dm.1, sx), yb[t]);
            ya[t] = _mm256_fmadd_ps(dm.2, offset, a);
            yb[t] = _mm256_fmadd_ps(dm.3, offset, b);
        }
    }
    for t in 0..T {
        _mm256_storeu_ps(y.add((i0 + t) * ncols), ya[t]);
        _mm256_storeu_ps(y.add((i0 + t) * ncols + 8), yb[t]);
    }
    T
}
