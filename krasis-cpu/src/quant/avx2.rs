//! AVX2 twin of [`super::scalar`] (`maddubs`/`madd` family). A 64-byte chunk is two ymm: rows
//! 0–7 and rows 8–15, each row's 4 bytes adjacent.
//!
//! - INT4: nibbles split in registers (`and`, `srli`+`and`) give u4 in 1..=15; `maddubs(u4, x)`
//!   (u8 × s8 → pairwise i16 sums, at most 2·15·127 = 3810, no saturation) for the low and the
//!   high nibbles, summed in i16 over 4 chunks (≤ 8·3810 = 30480 < 2¹⁵), then `madd(·, 1)` folds
//!   each row's pair of i16 into its i32 lane. The +8 offset is removed per group with the
//!   activation sums, as in the scalar reference.
//! - INT8: `maddubs(u8 = q + 128, x)` could saturate (2·255·127 > 2¹⁵), so the stored byte is
//!   turned back into `q` (`xor 0x80`) and the sign moved onto the activation:
//!   `maddubs(|q|, sign(x, q))` — at most 2·127·127 = 32258, exact — then `madd(·, 1)`. This
//!   yields `Σ q·x` directly, the same integer as the scalar `Σ u·x − 128·Σx`.
//!
//! The per-group float epilogue is the scalar's `fma((acc − corr) as f32, s_w · s_x, y)`.
//! M > 1 takes tiles of up to 4 activation rows, each over all the groups with its outputs in
//! registers (a 64-token CPU prefill of V2-Lite's shapes, INT4 experts: 260–262 → 268–271 tok/s
//! against loading and storing them around every group, one Zen 4 VM with `KRASIS_ISA=avx2`).

use std::arch::x86_64::*;
use std::ops::Range;

use krasis_quant::cpu_layout::{PackedLayout, CHUNK, ROW_BLOCK};
use krasis_quant::Bits;

use super::{Prefetch, PrefetchHint, QuantizedActs};

/// The four activation bytes at `p` in every 32-bit lane (the other operand of the weight chunks;
/// every avx2 kernel's).
#[inline]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn bcast4(p: *const i8) -> __m256i {
    _mm256_set1_epi32(std::ptr::read_unaligned(p as *const i32))
}

#[inline(always)]
unsafe fn prefetch<const HINT: i32>(p: *const u8) {
    _mm_prefetch::<HINT>(p as *const i8);
}

#[inline]
#[target_feature(enable = "avx2")]
unsafe fn load2(p: *const u8) -> (__m256i, __m256i) {
    (_mm256_loadu_si256(p as *const __m256i), _mm256_loadu_si256(p.add(32) as *const __m256i))
}

/// `Σ q·x` per row (i32 lanes) of 8 rows × 4 k of INT8 stored as `q + 128`, for broadcast `x`.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn dot_i8(v: __m256i, x: __m256i, ones: __m256i) -> __m256i {
    let q = _mm256_xor_si256(v, _mm256_set1_epi8(-128));
    _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(x, q)), ones)
}

/// Per-group float epilogue for 8 rows (as the scalar twin: one fma).
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn epilogue(acc: __m256i, corr: i32, sw: __m256, sx: f32, y: __m256) -> __m256 {
    let d = _mm256_cvtepi32_ps(_mm256_sub_epi32(acc, _mm256_set1_epi32(corr)));
    _mm256_fmadd_ps(d, _mm256_mul_ps(sw, _mm256_set1_ps(sx)), y)
}

/// The 16 scales of group `g`, as two halves of 8.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn load_scales(blk: *const u8, l: &PackedLayout, g: usize) -> (__m256, __m256) {
    let p = blk.add(l.scales_offset(g));
    (
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)),
        _mm256_cvtph_ps(_mm_loadu_si128(p.add(16) as *const __m128i)),
    )
}

/// # Safety
/// The CPU must have AVX2, FMA and F16C; arguments checked by [`super::matmul_packed_with`].
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
    let gr = groups;
    match (l.bits, pf.hint) {
        (Bits::Int4, PrefetchHint::T0) => run::<true, _MM_HINT_T0>(w, l, acts, blocks, gr, out, pf.distance),
        (Bits::Int4, PrefetchHint::T1) => run::<true, _MM_HINT_T1>(w, l, acts, blocks, gr, out, pf.distance),
        (Bits::Int4, _) => run::<true, _MM_HINT_NTA>(w, l, acts, blocks, gr, out, pf.distance_if_on()),
        (Bits::Int8, PrefetchHint::T0) => run::<false, _MM_HINT_T0>(w, l, acts, blocks, gr, out, pf.distance),
        (Bits::Int8, PrefetchHint::T1) => run::<false, _MM_HINT_T1>(w, l, acts, blocks, gr, out, pf.distance),
        (Bits::Int8, _) => run::<false, _MM_HINT_NTA>(w, l, acts, blocks, gr, out, pf.distance_if_on()),
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn run<const INT4: bool, const HINT: i32>(
    w: &[u8],
    l: &PackedLayout,
    acts: &QuantizedActs,
    blocks: Range<usize>,
    groups: Range<usize>,
    out: &mut [f32],
    pfd: usize,
) {
    let ncols = blocks.len() * ROW_BLOCK;
    let bb = l.block_bytes();
    for (bi, b) in blocks.enumerate() {
        let blk = w.as_ptr().add(b * bb);
        let y = out.as_mut_ptr().add(bi * ROW_BLOCK);
        if acts.m == 1 {
            block_m1::<INT4, HINT>(blk, l, acts, y, groups.clone(), pfd);
        } else {
            if groups.start == 0 {
                for i in 0..acts.m {
                    _mm256_storeu_ps(y.add(i * ncols), _mm256_setzero_ps());
                    _mm256_storeu_ps(y.add(i * ncols + 8), _mm256_setzero_ps());
                }
            }
            // Tiles of up to 4 activation rows, each over every group with its outputs in
            // registers; the first tile brings the row block in, later ones read it from cache.
            let mut i = 0;
            let mut pfd_t = pfd;
            while i < acts.m {
                let left = acts.m - i;
                i += if left >= 4 {
                    rows_tile::<INT4, HINT, 4>(blk, l, acts, i, y, ncols, groups.clone(), pfd_t)
                } else if left >= 2 {
                    rows_tile::<INT4, HINT, 2>(blk, l, acts, i, y, ncols, groups.clone(), pfd_t)
                } else {
                    rows_tile::<INT4, HINT, 1>(blk, l, acts, i, y, ncols, groups.clone(), pfd_t)
                };
                pfd_t = 0;
            }
        }
    }
}

/// One row block at M = 1, groups `groups` (in K order): writes its 16 outputs to `y`,
/// continuing the sums `y` holds when `groups` does not start at 0.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn block_m1<const INT4: bool, const HINT: i32>(
    blk: *const u8,
    l: &PackedLayout,
    acts: &QuantizedActs,
    y: *mut f32,
    groups: Range<usize>,
    pfd: usize,
) {
    let gs = l.gs;
    let nchunks = l.group_weight_bytes() / CHUNK;
    let mask = _mm256_set1_epi8(0x0f);
    let ones = _mm256_set1_epi16(1);
    let (mut ya, mut yb) = if groups.start == 0 {
        (_mm256_setzero_ps(), _mm256_setzero_ps())
    } else {
        (_mm256_loadu_ps(y), _mm256_loadu_ps(y.add(8)))
    };
    let xq = acts.q.as_ptr();
    if pfd != 0 {
        prefetch::<HINT>(blk.wrapping_add(pfd));
    }
    for g in groups {
        let wp = blk.add(l.weights_offset(g));
        let xg = xq.add(g * gs);
        let (mut aa, mut ab) = (_mm256_setzero_si256(), _mm256_setzero_si256());
        // 4 chunks per step (always a whole number of steps per group).
        let mut c = 0;
        while c < nchunks {
            let p = wp.add(c * CHUNK);
            if pfd != 0 {
                for u in 0..4 {
                    prefetch::<HINT>(p.wrapping_add(pfd + u * CHUNK));
                }
            }
            if INT4 {
                let (mut sa, mut sb) = (_mm256_setzero_si256(), _mm256_setzero_si256());
                for u in 0..4 {
                    let (va, vb) = load2(p.add(u * CHUNK));
                    let xk = xg.add((c + u) * 8);
                    let (xl, xh) = (bcast4(xk), bcast4(xk.add(4)));
                    let la = _mm256_and_si256(va, mask);
                    let ha = _mm256_and_si256(_mm256_srli_epi16::<4>(va), mask);
                    let lb = _mm256_and_si256(vb, mask);
                    let hb = _mm256_and_si256(_mm256_srli_epi16::<4>(vb), mask);
                    sa = _mm256_add_epi16(
                        sa,
                        _mm256_add_epi16(_mm256_maddubs_epi16(la, xl), _mm256_maddubs_epi16(ha, xh)),
                    );
                    sb = _mm256_add_epi16(
                        sb,
                        _mm256_add_epi16(_mm256_maddubs_epi16(lb, xl), _mm256_maddubs_epi16(hb, xh)),
                    );
                }
                aa = _mm256_add_epi32(aa, _mm256_madd_epi16(sa, ones));
                ab = _mm256_add_epi32(ab, _mm256_madd_epi16(sb, ones));
            } else {
                for u in 0..4 {
                    let (va, vb) = load2(p.add(u * CHUNK));
                    let x = bcast4(xg.add((c + u) * 4));
                    aa = _mm256_add_epi32(aa, dot_i8(va, x, ones));
                    ab = _mm256_add_epi32(ab, dot_i8(vb, x, ones));
                }
            }
            c += 4;
        }
        let corr = if INT4 { 8 * acts.sums[g] } else { 0 };
        let (swa, swb) = load_scales(blk, l, g);
        let sx = acts.scales[g];
        ya = epilogue(aa, corr, swa, sx, ya);
        yb = epilogue(ab, corr, swb, sx, yb);
    }
    _mm256_storeu_ps(y, ya);
    _mm256_storeu_ps(y.add(8), yb);
}

/// Activation rows `i0 .. i0 + T` of one row block over groups `groups` in K order, their
/// outputs in registers throughout (continuing what `y` holds): the same operations in the same
/// order as the scalar twin. Returns `T`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn rows_tile<const INT4: bool, const HINT: i32, const T: usize>(
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
        let wp = blk.add(l.weights_offset(g));
        let xq: [*const i8; T] = std::array::from_fn(|t| acts.q.as_ptr().add((i0 + t) * k + g * gs));
        let mut aa = [_mm256_setzero_si256(); T];
        let mut ab = [_mm256_setzero_si256(); T];
        for c in 0..nchunks {
            let p = wp.add(c * CHUNK);
            if pfd != 0 {
                prefetch::<HINT>(p.wrapping_add(pfd));
            }
            let (va, vb) = load2(p);
            if INT4 {
                let la = _mm256_and_si256(va, mask);
                let ha = _mm256_and_si256(_mm256_srli_epi16::<4>(va), mask);
                let lb = _mm256_and_si256(vb, mask);
                let hb = _mm256_and_si256(_mm256_srli_epi16::<4>(vb), mask);
                for t in 0..T {
                    let (xl, xh) = (bcast4(xq[t].add(c * 8)), bcast4(xq[t].add(c * 8 + 4)));
                    let sa = _mm256_add_epi16(_mm256_maddubs_epi16(la, xl), _mm256_maddubs_epi16(ha, xh));
                    let sb = _mm256_add_epi16(_mm256_maddubs_epi16(lb, xl), _mm256_maddubs_epi16(hb, xh));
                    aa[t] = _mm256_add_epi32(aa[t], _mm256_madd_epi16(sa, ones));
                    ab[t] = _mm256_add_epi32(ab[t], _mm256_madd_epi16(sb, ones));
                }
            } else {
                let s80 = _mm256_set1_epi8(-128);
                let (qa, qb) = (_mm256_xor_si256(va, s80), _mm256_xor_si256(vb, s80));
                let (ua, ub) = (_mm256_abs_epi8(qa), _mm256_abs_epi8(qb));
                for t in 0..T {
                    let x = bcast4(xq[t].add(c * 4));
                    let pa = _mm256_maddubs_epi16(ua, _mm256_sign_epi8(x, qa));
                    let pb = _mm256_maddubs_epi16(ub, _mm256_sign_epi8(x, qb));
                    aa[t] = _mm256_add_epi32(aa[t], _mm256_madd_epi16(pa, ones));
                    ab[t] = _mm256_add_epi32(ab[t], _mm256_madd_epi16(pb, ones));
                }
            }
        }
        let (swa, swb) = load_scales(blk, l, g);
        for t in 0..T {
            let i = i0 + t;
            let corr = if INT4 { 8 * acts.sums[i * ng + g] } else { 0 };
            let sx = acts.scales[i * ng + g];
            ya[t] = epilogue(aa[t], corr, swa, sx, ya[t]);
            yb[t] = epilogue(ab[t], corr, swb, sx, yb[t]);
        }
    }
    for t in 0..T {
        _mm256_storeu_ps(y.add((i0 + t) * ncols), ya[t]);
        _mm256_storeu_ps(y.add((i0 + t) * ncols + 8), yb[t]);
    }
    T
}
