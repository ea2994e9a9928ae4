//! AVX-512 F/BW + VNNI twin of [`super::scalar`]. One 64-byte weight chunk is one zmm: 16 rows ×
//! 4 adjacent k as unsigned bytes, so `vpdpbusd(acc, chunk, broadcast(x[k0..k0+4]))` adds the
//! four products of every row into its own i32 lane. INT4 chunks are split into their low and
//! high nibbles (`and`, `srli`+`and`) in registers and fed to two `vpdpbusd` with `x[k0..k0+4]`
//! and `x[k0+4..k0+8]`. The stored weights carry an offset (+128 / +8), removed per group with
//! the precomputed activation sums: `acc − off·Σx`.
//!
//! M = 1 runs a dedicated loop: four independent i32 accumulators (so `vpdpbusd`'s latency never
//! limits the stream), the f32 result of the row block held in one register; M = 2 holds both
//! rows'. M > 2 takes tiles of up to 8 activation rows, each over all the groups with its outputs
//! in registers (the row block's bytes stay in cache for the next tile). The first form loaded
//! and stored every row's outputs around every group: a 64-token CPU prefill of V2-Lite's shapes
//! (INT4 experts, INT8 dense) ran 663–681 tok/s against 779–787 since (one Zen 4 VM, 2 cores,
//! alternated three times), the same bits.

use std::arch::x86_64::*;
use std::ops::Range;

use krasis_quant::cpu_layout::{PackedLayout, CHUNK, ROW_BLOCK};
use krasis_quant::Bits;

use super::{Prefetch, PrefetchHint, QuantizedActs};

/// The four activation bytes at `p` in every 32-bit lane (the other operand of the weight chunks;
/// every avx512 kernel's).
#[inline]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn bcast4(p: *const i8) -> __m512i {
    _mm512_set1_epi32(std::ptr::read_unaligned(p as *const i32))
}

#[inline(always)]
unsafe fn prefetch<const HINT: i32>(p: *const u8) {
    _mm_prefetch::<HINT>(p as *const i8);
}

/// Prefetch the four chunks `pfd` bytes past `p` (the unit of the M = 1 and M = 2 loops).
#[inline(always)]
unsafe fn prefetch4<const HINT: i32>(p: *const u8, pfd: usize) {
    if pfd != 0 {
        for u in 0..4 {
            prefetch::<HINT>(p.wrapping_add(pfd + u * CHUNK));
        }
    }
}

/// # Safety
/// The CPU must have AVX-512 F/BW/VNNI; arguments checked by [`super::matmul_packed_with`].
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

#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
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
        } else if acts.m == 2 {
            block_m2::<INT4, HINT>(blk, l, acts, y, ncols, groups.clone(), pfd);
        } else {
            if groups.start == 0 {
                for i in 0..acts.m {
                    _mm512_storeu_ps(y.add(i * ncols), _mm512_setzero_ps());
                }
            }
            // Tiles of up to 8 activation rows, each over every group with its outputs in
            // registers; the first tile brings the row block in, later ones read it from cache.
            let mut i = 0;
            let mut pfd_t = pfd;
            while i < acts.m {
                let left = acts.m - i;
                i += if left >= 8 {
                    rows_tile::<INT4, HINT, 8>(blk, l, acts, i, y, ncols, groups.clone(), pfd_t)
                } else if left >= 4 {
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

/// Sum of four i32 accumulators (exact in any order).
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn sum4(a: &[__m512i; 4]) -> __m512i {
    _mm512_add_epi32(_mm512_add_epi32(a[0], a[1]), _mm512_add_epi32(a[2], a[3]))
}

/// Per-group float epilogue: `y + (acc − corr) · (s_w · s_x)` (one fma, as the scalar twin).
#[inline]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn epilogue(acc: __m512i, corr: i32, sw: __m512, sx: f32, y: __m512) -> __m512 {
    let d = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc, _mm512_set1_epi32(corr)));
    _mm512_fmadd_ps(d, _mm512_mul_ps(sw, _mm512_set1_ps(sx)), y)
}

#[inline]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn load_scales(blk: *const u8, l: &PackedLayout, g: usize) -> __m512 {
    _mm512_cvtph_ps(_mm256_loadu_si256(blk.add(l.scales_offset(g)) as *const __m256i))
}

/// One row block at M = 1, groups `groups` (in K order): writes its 16 outputs to `y`,
/// continuing the sums `y` holds when `groups` does not start at 0.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn block_m1<const INT4: bool, const HINT: i32>(
    blk: *const u8,
    l: &PackedLayout,
    acts: &QuantizedActs,
    y: *mut f32,
    groups: Range<usize>,
    pfd: usize,
) {
    let gs = l.gs;
    let off = l.offset();
    let gwb = l.group_weight_bytes();
    let nchunks = gwb / CHUNK;
    let mask = _mm512_set1_epi8(0x0f);
    let mut yv = if groups.start == 0 { _mm512_setzero_ps() } else { _mm512_loadu_ps(y) };
    let xq = acts.q.as_ptr();
    if pfd != 0 {
        // The scale header (the weights' lines are prefetched as the loop goes).
        prefetch::<HINT>(blk.wrapping_add(pfd));
    }
    for g in groups {
        let wp = blk.add(l.weights_offset(g));
        let xg = xq.add(g * gs);
        let mut a = [_mm512_setzero_si512(); 4];
        // 4 chunks per step (a group has ≥ 4 INT4 / ≥ 8 INT8 chunks, always a multiple of 4).
        let mut c = 0;
        while c < nchunks {
            let p = wp.add(c * CHUNK);
            prefetch4::<HINT>(p, pfd);
            if INT4 {
                for u in 0..4 {
                    let v = _mm512_loadu_si512(p.add(u * CHUNK) as *const _);
                    let lo = _mm512_and_si512(v, mask);
                    let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), mask);
                    let xk = xg.add((c + u) * 8);
                    let e = 2 * (u % 2);
                    a[e] = _mm512_dpbusd_epi32(a[e], lo, bcast4(xk));
                    a[e + 1] = _mm512_dpbusd_epi32(a[e + 1], hi, bcast4(xk.add(4)));
                }
            } else {
                for (u, acc) in a.iter_mut().enumerate() {
                    let v = _mm512_loadu_si512(p.add(u * CHUNK) as *const _);
                    *acc = _mm512_dpbusd_epi32(*acc, v, bcast4(xg.add((c + u) * 4)));
                }
            }
            c += 4;
        }
        let acc = _mm512_add_epi32(_mm512_add_epi32(a[0], a[1]), _mm512_add_epi32(a[2], a[3]));
        let corr = off * acts.sums[g];
        yv = epilogue(acc, corr, load_scales(blk, l, g), acts.scales[g], yv);
    }
    _mm512_storeu_ps(y, yv);
}

/// One row block at M = 2 (a token as value + residual rows, see `moe::quantize_acts_split`):
/// both rows' accumulators stay in registers, so the weight stream is read once and the kernel
/// stays memory-bound like [`block_m1`]. Writes 16 outputs to `y` and 16 to `y + ncols`
/// (groups `groups`; continuing from `y` as [`block_m1`]).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn block_m2<const INT4: bool, const HINT: i32>(
    blk: *const u8,
    l: &PackedLayout,
    acts: &QuantizedActs,
    y: *mut f32,
    ncols: usize,
    groups: Range<usize>,
    pfd: usize,
) {
    let (gs, k, ng) = (l.gs, l.k, l.groups());
    let off = l.offset();
    let nchunks = l.group_weight_bytes() / CHUNK;
    let mask = _mm512_set1_epi8(0x0f);
    let (mut y0, mut y1) = if groups.start == 0 {
        (_mm512_setzero_ps(), _mm512_setzero_ps())
    } else {
        (_mm512_loadu_ps(y), _mm512_loadu_ps(y.add(ncols)))
    };
    let (x0, x1) = (acts.q.as_ptr(), acts.q.as_ptr().add(k));
    if pfd != 0 {
        prefetch::<HINT>(blk.wrapping_add(pfd));
    }
    for g in groups {
        let wp = blk.add(l.weights_offset(g));
        let (x0g, x1g) = (x0.add(g * gs), x1.add(g * gs));
        // Four independent chains per row (even/odd chunk × low/high nibble), as block_m1: the
        // INT4 step issues 16 `vpdpbusd`, and chains of 2 per step keep their latency hidden.
        let mut a0 = [_mm512_setzero_si512(); 4];
        let mut a1 = [_mm512_setzero_si512(); 4];
        let mut c = 0;
        while c < nchunks {
            let p = wp.add(c * CHUNK);
            prefetch4::<HINT>(p, pfd);
            for u in 0..4 {
                let v = _mm512_loadu_si512(p.add(u * CHUNK) as *const _);
                let e = 2 * (u % 2);
                if INT4 {
                    let lo = _mm512_and_si512(v, mask);
                    let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), mask);
                    let kk = (c + u) * 8;
                    a0[e] = _mm512_dpbusd_epi32(a0[e], lo, bcast4(x0g.add(kk)));
                    a0[e + 1] = _mm512_dpbusd_epi32(a0[e + 1], hi, bcast4(x0g.add(kk + 4)));
                    a1[e] = _mm512_dpbusd_epi32(a1[e], lo, bcast4(x1g.add(kk)));
                    a1[e + 1] = _mm512_dpbusd_epi32(a1[e + 1], hi, bcast4(x1g.add(kk + 4)));
                } else {
                    let kk = (c + u) * 4;
                    a0[e] = _mm512_dpbusd_epi32(a0[e], v, bcast4(x0g.add(kk)));
                    a1[e] = _mm512_dpbusd_epi32(a1[e], v, bcast4(x1g.add(kk)));
                }
            }
            c += 4;
        }
        let sw = load_scales(blk, l, g);
        y0 = epilogue(sum4(&a0), off * acts.sums[g], sw, acts.scales[g], y0);
        y1 = epilogue(sum4(&a1), off * acts.sums[ng + g], sw, acts.scales[ng + g], y1);
    }
    _mm512_storeu_ps(y, y0);
    _mm512_storeu_ps(y.add(ncols), y1);
}

/// Activation rows `i0 .. i0 + T` of one row block over groups `groups` in K order, their
/// outputs in registers throughout (continuing what `y` holds): the same operations in the same
/// order as the scalar twin. Returns `T`.
#[inline(never)]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
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
    let mask = _mm512_set1_epi8(0x0f);
    let off = l.offset();
    let mut yv: [__m512; T] = std::array::from_fn(|t| _mm512_loadu_ps(y.add((i0 + t) * ncols)));
    if pfd != 0 {
        // The scale header (the weights' lines are prefetched as the loop goes).
        prefetch::<HINT>(blk.wrapping_add(pfd));
    }
    for g in groups {
        let wp = blk.add(l.weights_offset(g));
        let xq: [*const i8; T] = std::array::from_fn(|t| acts.q.as_ptr().add((i0 + t) * k + g * gs));
        // INT4: separate accumulators for the low and high nibbles (two independent chains).
        let mut alo = [_mm512_setzero_si512(); T];
        let mut ahi = [_mm512_setzero_si512(); T];
        for c in 0..nchunks {
            let p = wp.add(c * CHUNK);
            if pfd != 0 {
                prefetch::<HINT>(p.wrapping_add(pfd));
            }
            let v = _mm512_loadu_si512(p as *const _);
            if INT4 {
                let lo = _mm512_and_si512(v, mask);
                let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), mask);
                for t in 0..T {
                    alo[t] = _mm512_dpbusd_epi32(alo[t], lo, bcast4(xq[t].add(c * 8)));
                    ahi[t] = _mm512_dpbusd_epi32(ahi[t], hi, bcast4(xq[t].add(c * 8 + 4)));
                }
            } else {
                for t in 0..T {
                    alo[t] = _mm512_dpbusd_epi32(alo[t], v, bcast4(xq[t].add(c * 4)));
                }
            }
        }
        let sw = load_scales(blk, l, g);
        for t in 0..T {
            let i = i0 + t;
            let acc = if INT4 { _mm512_add_epi32(alo[t], ahi[t]) } else { alo[t] };
            yv[t] = epilogue(acc, off * acts.sums[i * ng + g], sw, acts.scales[i * ng + g], yv[t]);
        }
    }
    for (t, v) in yv.iter().enumerate() {
        _mm512_storeu_ps(y.add((i0 + t) * ncols), *v);
    }
    T
}
