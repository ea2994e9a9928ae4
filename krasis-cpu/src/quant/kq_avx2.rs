//! AVX2 twin of [`super::kq_scalar`] (Q4_K / Q6_K kept as stored). A 64-byte chunk is two ymm
//! (rows 0–7, rows 8–15); the code planes are formed as in [`super::kq_avx512`] and go to
//! `maddubs(q, x)` (u8 × s8 → pairwise i16: Q6_K's codes ≤ 63 give at most 2·63·127 = 16002 per
//! pair and 32004 for a chunk's two planes, inside i16) and `madd(·, 1)` for each row's i32 sum.
//! The epilogue is the scalar's: `y = fma(acc, (d · sc) · s_x, y)` then for Q4_K
//! `y = −Σ x_q · ((dmin · m) · s_x) + y` (`fnmadd`).

use std::arch::x86_64::*;
use std::ops::Range;

use krasis_quant::cpu_layout::{PackedLayout, CHUNK, ROW_BLOCK};
use krasis_quant::kquant::KQuant;

use super::avx2::bcast4;
use super::{Prefetch, PrefetchHint, QuantizedActs};

/// 8 bytes at `p` as f32 lanes: unsigned, or signed when `signed`.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn bytes_f32(p: *const u8, signed: bool) -> __m256 {
    let v = _mm_loadl_epi64(p as *const __m128i);
    _mm256_cvtepi32_ps(if signed { _mm256_cvtepi8_epi32(v) } else { _mm256_cvtepu8_epi32(v) })
}

/// # Safety
/// The CPU must have AVX2, FMA and F16C; arguments checked by [`super::matmul_packed_with`] (a
/// K-quant layout).
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
    let pfd = if pf.hint == PrefetchHint::None { 0 } else { pf.distance };
    match l.kq.expect("a K-quant layout") {
        KQuant::Q4K => run::<false>(w, l, acts, blocks, groups, out, pfd),
        KQuant::Q6K => run::<true>(w, l, acts, blocks, groups, out, pfd),
    }
}

/// The kernel for one format (`Q6` false: Q4_K, true: Q6_K): the chunk count a compile-time
/// constant, so the planes stay in registers.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn run<const Q6: bool>(
    w: &[u8],
    l: &PackedLayout,
    acts: &QuantizedActs,
    blocks: Range<usize>,
    groups: Range<usize>,
    out: &mut [f32],
    pfd: usize,
) {
    let (kind, q6) = if Q6 { (KQuant::Q6K, true) } else { (KQuant::Q4K, false) };
    let (k, gs, ng, gpsb) = (l.k, l.gs, l.groups(), kind.groups_per_sb());
    let gwb = l.group_weight_bytes();
    let ncols = blocks.len() * ROW_BLOCK;
    let bb = l.block_bytes();
    let mask = _mm256_set1_epi8(0x0f);
    let m3 = _mm256_set1_epi8(0x30);
    let ones = _mm256_set1_epi16(1);
    for (bi, b) in blocks.enumerate() {
        let blk = w.as_ptr().add(b * bb);
        let y = out.as_mut_ptr().add(bi * ROW_BLOCK);
        if groups.start == 0 {
            for i in 0..acts.m {
                _mm256_storeu_ps(y.add(i * ncols), _mm256_setzero_ps());
                _mm256_storeu_ps(y.add(i * ncols + 8), _mm256_setzero_ps());
            }
        }
        for g in groups.clone() {
            let hdr = blk.add(l.scales_offset(g));
            let jg = g % gpsb;
            let wp = blk.add(l.weights_offset(g));
            if pfd != 0 {
                if jg == 0 {
                    for u in 0..krasis_quant::kquant::SB_HEADER_BYTES / CHUNK {
                        _mm_prefetch::<_MM_HINT_T0>(hdr.wrapping_add(pfd + u * CHUNK) as *const i8);
                    }
                }
                for u in 0..gwb / CHUNK {
                    _mm_prefetch::<_MM_HINT_T0>(wp.wrapping_add(pfd + u * CHUNK) as *const i8);
                }
            }
            // Per half h (rows 8h .. 8h + 8): d · sc and dmin · m.
            let mut ds = [_mm256_setzero_ps(); 2];
            let mut mins = [_mm256_setzero_ps(); 2];
            for h in 0..2 {
                let d = _mm256_cvtph_ps(_mm_loadu_si128(hdr.add(16 * h) as *const __m128i));
                ds[h] = _mm256_mul_ps(d, bytes_f32(hdr.add(64 + 16 * jg + 8 * h), q6));
                if !q6 {
                    let dmin = _mm256_cvtph_ps(_mm_loadu_si128(hdr.add(32 + 16 * h) as *const __m128i));
                    mins[h] = _mm256_mul_ps(dmin, bytes_f32(hdr.add(192 + 16 * jg + 8 * h), false));
                }
            }
            // planes[h][2c], planes[h][2c + 1]: as kq_avx512's, per half.
            let mut planes = [[_mm256_setzero_si256(); 8]; 2];
            let chunks = if Q6 { 2 } else { 4 };
            debug_assert_eq!(chunks, gs / 8);
            for (h, ph) in planes.iter_mut().enumerate() {
                let hb = if q6 {
                    _mm256_loadu_si256(wp.add(2 * CHUNK + 32 * h) as *const __m256i)
                } else {
                    _mm256_setzero_si256()
                };
                for c in 0..chunks {
                    let v = _mm256_loadu_si256(wp.add(c * CHUNK + 32 * h) as *const __m256i);
                    let mut lo = _mm256_and_si256(v, mask);
                    let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), mask);
                    if q6 {
                        let (f0, f1) = if c == 0 {
                            (_mm256_slli_epi16::<4>(hb), _mm256_slli_epi16::<2>(hb))
                        } else {
                            (hb, _mm256_srli_epi16::<2>(hb))
                        };
                        lo = _mm256_or_si256(lo, _mm256_and_si256(f0, m3));
                        hi = _mm256_or_si256(hi, _mm256_and_si256(f1, m3));
                    }
                    ph[2 * c] = lo;
                    ph[2 * c + 1] = hi;
                }
            }
            for i in 0..acts.m {
                let xg = acts.q.as_ptr().add(i * k + g * gs);
                let sum = acts.sums[i * ng + g];
                let sx = _mm256_set1_ps(acts.scales[i * ng + g]);
                let yp = y.add(i * ncols);
                for (h, ph) in planes.iter().enumerate() {
                    let mut acc = _mm256_setzero_si256();
                    for c in 0..chunks {
                        let s = _mm256_add_epi16(
                            _mm256_maddubs_epi16(ph[2 * c], bcast4(xg.add(8 * c))),
                            _mm256_maddubs_epi16(ph[2 * c + 1], bcast4(xg.add(8 * c + 4))),
                        );
                        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(s, ones));
                    }
                    if q6 {
                        acc = _mm256_sub_epi32(acc, _mm256_set1_epi32(32 * sum));
                    }
                    let yh = yp.add(8 * h);
                    let mut yv =
                        _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), _mm256_mul_ps(ds[h], sx), _mm256_loadu_ps(yh));
                    if !q6 {
                        yv = _mm256_fnmadd_ps(_mm256_set1_ps(sum as f32), _mm256_mul_ps(mins[h], sx), yv);
                    }
                    _mm256_storeu_ps(yh, yv);
                }
            }
        }
    }
}
