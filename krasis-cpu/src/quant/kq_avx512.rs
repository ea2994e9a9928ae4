//! AVX-512 F/BW + VNNI twin of [`super::kq_scalar`] (Q4_K / Q6_K kept as stored). Per group the
//! codes become unsigned byte planes once — Q4_K: each chunk's low and high nibbles; Q6_K: the
//! two low-nibble chunks' halves with the high-bit chunk's 2-bit fields shifted to bit 4 — and
//! every activation row takes them through `vpdpbusd` with its broadcast INT8 activations.
//! The group's per-row scales (`d · sc`, `dmin · m`) are formed once from the super-block header,
//! and the epilogue is the scalar's: `y = fma(acc, (d · sc) · s_x, y)` then for Q4_K
//! `y = −Σ x_q · ((dmin · m) · s_x) + y` (`fnmadd`, one rounding, as the scalar's fma with
//! `−Σ x_q`). There is no AMX form (see [`super::matmul_packed`]).

use std::arch::x86_64::*;
use std::ops::Range;

use krasis_quant::cpu_layout::{PackedLayout, CHUNK, ROW_BLOCK};
use krasis_quant::kquant::KQuant;

use super::avx512::bcast4;
use super::{Prefetch, PrefetchHint, QuantizedActs};

/// 16 bytes at `p` as f32 lanes: unsigned, or signed when `SIGNED`.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn bytes_f32<const SIGNED: bool>(p: *const u8) -> __m512 {
    let v = _mm_loadu_si128(p as *const __m128i);
    _mm512_cvtepi32_ps(if SIGNED { _mm512_cvtepi8_epi32(v) } else { _mm512_cvtepu8_epi32(v) })
}

/// # Safety
/// The CPU must have AVX-512 F/BW/VNNI; arguments checked by [`super::matmul_packed_with`] (a
/// K-quant layout).
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
    let pfd = if pf.hint == PrefetchHint::None { 0 } else { pf.distance };
    match (l.kq.expect("a K-quant layout"), pf.hint) {
        (KQuant::Q4K, PrefetchHint::T1) => run::<_MM_HINT_T1, false>(w, l, acts, blocks, groups, out, pfd),
        (KQuant::Q4K, PrefetchHint::Nta) => run::<_MM_HINT_NTA, false>(w, l, acts, blocks, groups, out, pfd),
        (KQuant::Q4K, _) => run::<_MM_HINT_T0, false>(w, l, acts, blocks, groups, out, pfd),
        (KQuant::Q6K, PrefetchHint::T1) => run::<_MM_HINT_T1, true>(w, l, acts, blocks, groups, out, pfd),
        (KQuant::Q6K, PrefetchHint::Nta) => run::<_MM_HINT_NTA, true>(w, l, acts, blocks, groups, out, pfd),
        (KQuant::Q6K, _) => run::<_MM_HINT_T0, true>(w, l, acts, blocks, groups, out, pfd),
    }
}

/// The kernel for one format (`Q6` false: Q4_K, true: Q6_K).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn run<const HINT: i32, const Q6: bool>(
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
        // Tiles of up to 8 activation rows (a decode token's 2 are one), each over every group
        // with its outputs in registers: through memory, each group's fmas would wait on the last
        // one's store. The first tile brings the row block in, later ones read it from cache.
        let mut i = 0;
        let mut pfd_t = pfd;
        while i < acts.m {
            let left = acts.m - i;
            let gr = groups.clone();
            i += if left >= 8 {
                rows_tile::<HINT, Q6, 8>(blk, l, acts, i, y, ncols, gr, pfd_t)
            } else if left >= 4 {
                rows_tile::<HINT, Q6, 4>(blk, l, acts, i, y, ncols, gr, pfd_t)
            } else if left >= 2 {
                rows_tile::<HINT, Q6, 2>(blk, l, acts, i, y, ncols, gr, pfd_t)
            } else {
                rows_tile::<HINT, Q6, 1>(blk, l, acts, i, y, ncols, gr, pfd_t)
            };
            pfd_t = 0;
        }
    }
}

/// Activation rows `i0 .. i0 + T` of one row block over groups `groups` in K order, their
/// outputs in registers throughout (continuing what `y` holds): each group's code planes are
/// decoded once for the tile's rows, the same operations per row and group as the scalar twin.
/// Returns `T`. Out of line, as the other kernels' tiles: inlined, the same loops' speed moved
/// with code generation alone (the first form measured 58 or 80 GiB/s at Q4_K M = 1 depending on
/// what else the file held). The first form kept rows in registers only at M ≤ 2 and otherwise loaded
/// and stored every row's outputs around every group: alternated twice with it on one Zen 4 core,
/// cache-resident, V2-Lite-sized matrices (Q6_K at K 1536), Q4_K w13 M = 1 / 2 / 8 58.1–58.8 /
/// 48.3–48.8 / 15.7–15.8 → 69.6–70.0 / 50.4–53.5 / 18.5–19.0 GiB/s, Q6_K w2 66.0–66.3 / 51.8–52.5 /
/// 13.4–13.5 → 61.6–61.7 / 49.2–49.6 / 15.0–15.2.
#[inline(never)]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[allow(clippy::too_many_arguments)]
unsafe fn rows_tile<const HINT: i32, const Q6: bool, const T: usize>(
    blk: *const u8,
    l: &PackedLayout,
    acts: &QuantizedActs,
    i0: usize,
    y: *mut f32,
    ncols: usize,
    groups: Range<usize>,
    pfd: usize,
) -> usize {
    let kind = if Q6 { KQuant::Q6K } else { KQuant::Q4K };
    let (k, gs, ng, gpsb) = (l.k, l.gs, l.groups(), kind.groups_per_sb());
    let gwb = l.group_weight_bytes();
    let mask = _mm512_set1_epi8(0x0f);
    let m3 = _mm512_set1_epi8(0x30);
    let mut yr: [__m512; T] = std::array::from_fn(|t| _mm512_loadu_ps(y.add((i0 + t) * ncols)));
    // The super-block's f16 `d` and `dmin` as f32, read at its first group.
    let (mut d, mut dmin) = (_mm512_setzero_ps(), _mm512_setzero_ps());
    for g in groups.clone() {
        let hdr = blk.add(l.scales_offset(g));
        let jg = g % gpsb;
        let wp = blk.add(l.weights_offset(g));
        if pfd != 0 {
            if jg == 0 {
                for u in 0..krasis_quant::kquant::SB_HEADER_BYTES / CHUNK {
                    _mm_prefetch::<HINT>(hdr.wrapping_add(pfd + u * CHUNK) as *const i8);
                }
            }
            for u in 0..gwb / CHUNK {
                _mm_prefetch::<HINT>(wp.wrapping_add(pfd + u * CHUNK) as *const i8);
            }
        }
        if jg == 0 || g == groups.start {
            d = _mm512_cvtph_ps(_mm256_loadu_si256(hdr as *const __m256i));
            if !Q6 {
                dmin = _mm512_cvtph_ps(_mm256_loadu_si256(hdr.add(32) as *const __m256i));
            }
        }
        let ds = _mm512_mul_ps(d, bytes_f32::<Q6>(hdr.add(64 + 16 * jg)));
        let mins =
            if Q6 { _mm512_setzero_ps() } else { _mm512_mul_ps(dmin, bytes_f32::<false>(hdr.add(192 + 16 * jg))) };
        // The group's code planes: plane 2c holds (row j, k0 + b) at byte 4j + b, plane
        // 2c + 1 (row j, k0 + 4 + b), k0 = 8c.
        let mut planes = [_mm512_setzero_si512(); 8];
        // A compile-time count, so the planes stay in registers (Q4_K: 4 chunks, Q6_K: 2).
        let chunks = if Q6 { 2 } else { 4 };
        debug_assert_eq!(chunks, gs / 8);
        let hb = if Q6 { _mm512_loadu_si512(wp.add(2 * CHUNK) as *const _) } else { _mm512_setzero_si512() };
        for c in 0..chunks {
            let v = _mm512_loadu_si512(wp.add(c * CHUNK) as *const _);
            let mut lo = _mm512_and_si512(v, mask);
            let mut hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), mask);
            if Q6 {
                // The 2-bit fields 2c and 2c + 1 of the high-bit chunk, moved to bits 4–5.
                let (f0, f1) = if c == 0 {
                    (_mm512_slli_epi16::<4>(hb), _mm512_slli_epi16::<2>(hb))
                } else {
                    (hb, _mm512_srli_epi16::<2>(hb))
                };
                lo = _mm512_or_si512(lo, _mm512_and_si512(f0, m3));
                hi = _mm512_or_si512(hi, _mm512_and_si512(f1, m3));
            }
            planes[2 * c] = lo;
            planes[2 * c + 1] = hi;
        }
        for (t, yv) in yr.iter_mut().enumerate() {
            let i = i0 + t;
            let xg = acts.q.as_ptr().add(i * k + g * gs);
            // Four independent chains (integer sums: any order gives the same bits).
            let mut a = [_mm512_setzero_si512(); 4];
            for c in 0..chunks {
                let e = 2 * (c % 2);
                a[e] = _mm512_dpbusd_epi32(a[e], planes[2 * c], bcast4(xg.add(8 * c)));
                a[e + 1] = _mm512_dpbusd_epi32(a[e + 1], planes[2 * c + 1], bcast4(xg.add(8 * c + 4)));
            }
            let mut acc = _mm512_add_epi32(_mm512_add_epi32(a[0], a[1]), _mm512_add_epi32(a[2], a[3]));
            let sum = acts.sums[i * ng + g];
            if Q6 {
                acc = _mm512_sub_epi32(acc, _mm512_set1_epi32(32 * sum));
            }
            let sx = _mm512_set1_ps(acts.scales[i * ng + g]);
            let mut v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(ds, sx), *yv);
            if !Q6 {
                v = _mm512_fnmadd_ps(_mm512_set1_ps(sum as f32), _mm512_mul_ps(mins, sx), v);
            }
            *yv = v;
        }
    }
    for (t, v) in yr.iter().enumerate() {
        _mm512_storeu_ps(y.add((i0 + t) * ncols), *v);
    }
    T
}
