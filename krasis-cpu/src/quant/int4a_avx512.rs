//! AVX-512 F/BW + VNNI twin of [`super::int4a_scalar`] (asymmetric INT4 g32). A 64-byte chunk
//! holds 16 rows × 8 k of codes 0..=15 in INT4's arrangement; its low and high nibbles (`and`,
//! `srli`+`and`) are already the unsigned bytes `vpdpbusd` multiplies with the broadcast INT8
//! activations, so there is no offset to remove. Per group the scale and minimum rows (one cache
//! line of the header) give `y = fma(Σ q·x_q, d · s_x, y)` then `y = fma(m, Σ x_q · s_x, y)`.
//!
//! M = 1 keeps the row block's 16 outputs in a register with four independent accumulators per
//! group (a group is four chunks), M = 2 (a decode token's value and residual rows) both rows'
//! outputs; M > 2 takes tiles of up to 8 activation rows, each over all the groups with its
//! outputs in registers (the row block's bytes stay in cache for the next tile). There is no AMX
//! form (see [`super::matmul_packed`]).

use std::arch::x86_64::*;
use std::ops::Range;

use krasis_quant::cpu_layout::{PackedLayout, CHUNK, ROW_BLOCK};

use super::avx512::bcast4;
use super::{Prefetch, PrefetchHint, QuantizedActs};

/// The 16 f16 values at `p` as f32.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn f16x16(p: *const u8) -> __m512 {
    _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
}

/// The epilogue of one group: `y + acc · (d · s_x) + m · (sum · s_x)`, two fmas in that order
/// (the offset `sum · s_x` is one scalar product per row and group, where `m · s_x` was a
/// vector one).
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn epilogue(acc: __m512i, sum: i32, d: __m512, m: __m512, sx: f32, y: __m512) -> __m512 {
    let offset = _mm512_set1_ps(sum as f32 * sx);
    let y = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(d, _mm512_set1_ps(sx)), y);
    _mm512_fmadd_ps(m, offset, y)
}

/// # Safety
/// The CPU must have AVX-512 F/BW/VNNI; arguments checked by [`super::matmul_packed_with`]
/// (an asymmetric INT4 layout).
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
    debug_assert!(l.asym);
    match pf.hint {
        PrefetchHint::T1 => run::<_MM_HINT_T1>(w, l, acts, blocks, groups, out, pf.distance),
        PrefetchHint::Nta => run::<_MM_HINT_NTA>(w, l, acts, blocks, groups, out, pf.distance),
        PrefetchHint::T0 => run::<_MM_HINT_T0>(w, l, acts, blocks, groups, out, pf.distance),
        PrefetchHint::None => run::<_MM_HINT_T0>(w, l, acts, blocks, groups, out, 0),
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn run<const HINT: i32>(
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
        if groups.start == 0 {
            for i in 0..acts.m {
                _mm512_storeu_ps(y.add(i * ncols), _mm512_setzero_ps());
            }
        }
        if acts.m == 1 {
            block_m1::<HINT>(blk, l, acts, y, groups.clone(), pfd);
            continue;
        }
        if acts.m == 2 {
            block_m2::<HINT>(blk, l, acts, y, ncols, groups.clone(), pfd);
            continue;
        }
        // Tiles of up to 8 activation rows, each over every group with its outputs in
        // registers; the first tile brings the row block in, later ones read it from cache.
        let mut i = 0;
        let mut pfd_t = pfd;
        while i < acts.m {
            let left = acts.m - i;
            i += if left >= 8 {
                rows_tile::<HINT, 8>(blk, l, acts, i, y, ncols, groups.clone(), pfd_t)
            } else if left >= 4 {
                rows_tile::<HINT, 4>(blk, l, acts, i, y, ncols, groups.clone(), pfd_t)
            } else if left >= 2 {
                rows_tile::<HINT, 2>(blk, l, acts, i, y, ncols, groups.clone(), pfd_t)
            } else {
                rows_tile::<HINT, 1>(blk, l, acts, i, y, ncols, groups.clone(), pfd_t)
            };
            pfd_t = 0;
        }
    }
}

/// One row block at M = 1, groups `groups` in K order: the 16 outputs stay in a register
/// (continuing what `y` holds, zeroed by the caller when `groups` starts at 0).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn block_m1<const HINT: i32>(
    blk: *const u8,
    l: &PackedLayout,
    acts: &QuantizedActs,
    y: *mut f32,
    groups: Range<usize>,
    pfd: usize,
) {
    let gs = l.gs;
    let mask = _mm512_set1_epi8(0x0f);
    let xq = acts.q.as_ptr();
    let mut yv = _mm512_loadu_ps(y);
    for g in groups {
        let wp = blk.add(l.weights_offset(g));
        let hp = blk.add(l.scales_offset(g));
        if pfd != 0 {
            // The group's header line (scales and minimums) and its four weight lines.
            _mm_prefetch::<HINT>(hp.wrapping_add(pfd) as *const i8);
            for u in 0..4 {
                _mm_prefetch::<HINT>(wp.wrapping_add(pfd + u * CHUNK) as *const i8);
            }
        }
        let xg = xq.add(g * gs);
        let mut a = [_mm512_setzero_si512(); 4];
        // A group of 32 is exactly four chunks.
        for u in 0..4 {
            let v = _mm512_loadu_si512(wp.add(u * CHUNK) as *const _);
            let lo = _mm512_and_si512(v, mask);
            let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), mask);
            let xk = xg.add(u * 8);
            let e = 2 * (u % 2);
            a[e] = _mm512_dpbusd_epi32(a[e], lo, bcast4(xk));
            a[e + 1] = _mm512_dpbusd_epi32(a[e + 1], hi, bcast4(xk.add(4)));
        }
        let acc = _mm512_add_epi32(_mm512_add_epi32(a[0], a[1]), _mm512_add_epi32(a[2], a[3]));
        yv = epilogue(acc, acts.sums[g], f16x16(hp), f16x16(hp.add(32)), acts.scales[g], yv);
    }
    _mm512_storeu_ps(y, yv);
}

/// One row block at M = 2 (a decode token as value + residual rows, see
/// `moe::quantize_acts_split`): both rows' outputs stay in registers over the groups, so the
/// weight stream is read once as at M = 1. Writes 16 outputs to `y` and 16 to `y + ncols`
/// (continuing what they hold, zeroed by the caller when `groups` starts at 0).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn block_m2<const HINT: i32>(
    blk: *const u8,
    l: &PackedLayout,
    acts: &QuantizedActs,
    y: *mut f32,
    ncols: usize,
    groups: Range<usize>,
    pfd: usize,
) {
    let (gs, k, ng) = (l.gs, l.k, l.groups());
    let mask = _mm512_set1_epi8(0x0f);
    let (x0, x1) = (acts.q.as_ptr(), acts.q.as_ptr().add(k));
    let (mut y0, mut y1) = (_mm512_loadu_ps(y), _mm512_loadu_ps(y.add(ncols)));
    for g in groups {
        let wp = blk.add(l.weights_offset(g));
        let hp = blk.add(l.scales_offset(g));
        if pfd != 0 {
            _mm_prefetch::<HINT>(hp.wrapping_add(pfd) as *const i8);
            for u in 0..4 {
                _mm_prefetch::<HINT>(wp.wrapping_add(pfd + u * CHUNK) as *const i8);
            }
        }
        let (x0g, x1g) = (x0.add(g * gs), x1.add(g * gs));
        // One chain per row: its eight steps are serial, but each group starts fresh chains, so
        // consecutive groups overlap, and no adds are left to join partial sums (the dev VM's one
        // core at a token's top-6: 26.0 → 27.3–29.5 GB/s with the scalar offset, where two chains
        // per row, one per nibble half, gave 26.2–26.9).
        let (mut a0, mut a1) = (_mm512_setzero_si512(), _mm512_setzero_si512());
        for u in 0..4 {
            let v = _mm512_loadu_si512(wp.add(u * CHUNK) as *const _);
            let lo = _mm512_and_si512(v, mask);
            let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), mask);
            let kk = u * 8;
            a0 = _mm512_dpbusd_epi32(a0, lo, bcast4(x0g.add(kk)));
            a1 = _mm512_dpbusd_epi32(a1, lo, bcast4(x1g.add(kk)));
            a0 = _mm512_dpbusd_epi32(a0, hi, bcast4(x0g.add(kk + 4)));
            a1 = _mm512_dpbusd_epi32(a1, hi, bcast4(x1g.add(kk + 4)));
        }
        let (d, m) = (f16x16(hp), f16x16(hp.add(32)));
        y0 = epilogue(a0, acts.sums[g], d, m, acts.scales[g], y0);
        y1 = epilogue(a1, acts.sums[ng + g], d, m, acts.scales[ng + g], y1);
    }
    _mm512_storeu_ps(y, y0);
    _mm512_storeu_ps(y.add(ncols), y1);
}

/// Activation rows `i0 .. i0 + T` of one row block over groups `groups` in K order, their
/// outputs in registers throughout (continuing what `y` holds): per group one `vpdpbusd` chain
/// per row and the two-fma epilogue, the same operations in the same order as the scalar twin.
/// Returns `T`. (The first form loaded and stored each row's outputs around every group of 32:
/// one Zen 4 core, cache-resident, w13 at M = 8 went 18.6 → 20.2 GiB/s, and a 64-token CPU
/// prefill of V2-Lite's shapes with `4a` experts 406–425 → 579–592 tok/s, its experts 0.112–0.119
/// → 0.068–0.071 s.)
#[inline(never)]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[allow(clippy::too_many_arguments)]
unsafe fn rows_tile<const HINT: i32, const T: usize>(
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
    let mask = _mm512_set1_epi8(0x0f);
    let mut yv: [__m512; T] = std::array::from_fn(|t| _mm512_loadu_ps(y.add((i0 + t) * ncols)));
    for g in groups {
        let wp = blk.add(l.weights_offset(g));
        let hp = blk.add(l.scales_offset(g));
        if pfd != 0 {
            _mm_prefetch::<HINT>(hp.wrapping_add(pfd) as *const i8);
            for u in 0..4 {
                _mm_prefetch::<HINT>(wp.wrapping_add(pfd + u * CHUNK) as *const i8);
            }
        }
        let xg: [*const i8; T] = std::array::from_fn(|t| acts.q.as_ptr().add((i0 + t) * k + g * gs));
        let mut a = [_mm512_setzero_si512(); T];
        // A group of 32 is exactly four chunks.
        for u in 0..4 {
            let v = _mm512_loadu_si512(wp.add(u * CHUNK) as *const _);
            let lo = _mm512_and_si512(v, mask);
            let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), mask);
            for t in 0..T {
                a[t] = _mm512_dpbusd_epi32(a[t], lo, bcast4(xg[t].add(u * 8)));
                a[t] = _mm512_dpbusd_epi32(a[t], hi, bcast4(xg[t].add(u * 8 + 4)));
            }
        }
        let (d, m) = (f16x16(hp), f16x16(hp.add(32)));
        for t in 0..T {
            let i = i0 + t;
            yv[t] = epilogue(a[t], acts.sums[i * ng + g], d, m, acts.scales[i * ng + g], yv[t]);
        }
    }
    for (t, v) in yv.iter().enumerate() {
        _mm512_storeu_ps(y.add((i0 + t) * ncols), *v);
    }
    T
}
