//! AVX2 twin of [`super::fp4_scalar`]. A 64-byte chunk is two ymm (rows 0–7, rows 8–15, each
//! row's 4 bytes adjacent); its nibbles index the code table [`E2M1_X2_BIASED`] with `vpshufb`
//! (`2·value + 12`, 0..=24), and `maddubs(u, x)` (u8 × s8 → pairwise i16: at most
//! 2·24·127 = 6096, twice per chunk 12192 < 2¹⁵, no saturation) followed by `madd(·, 1)` gives
//! each row's i32 sum per chunk. The +12 is removed per group with the activation sums, and the
//! epilogue is the scalar's `fma(d, (s · f) · s_x, y)`; group scales are decoded from their bytes
//! as in the AVX-512 twin (E4M3 through F16C's `vcvtph2ps`). The outputs of one row (M = 1), of a
//! decode token's two rows, or of each tile of up to 4 rows stay in registers over all groups
//! ([`block_rows`]; at M > 2 this replaced a load and store of every row's outputs around every
//! group: a 64-token NVFP4 prefill with `KRASIS_ISA=avx2`, one Zen 4 VM, 245–249 → 314–315 tok/s).

use std::arch::x86_64::*;
use std::ops::Range;

use krasis_quant::cpu_layout::{PackedLayout, CHUNK, ROW_BLOCK};
use krasis_quant::fp4::{Fp4Kind, E2M1_X2_BIASED};

use super::avx2::bcast4;
use super::{Prefetch, PrefetchHint, QuantizedActs};

/// The table entries of the low nibbles of `v`.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn look(lut: __m256i, v: __m256i, mask: __m256i) -> __m256i {
    _mm256_shuffle_epi8(lut, _mm256_and_si256(v, mask))
}

/// 8 scales (bytes at `p`) as f32 times the row factors `f`.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn scales8(p: *const u8, nv: bool, f: __m256) -> __m256 {
    let s = if nv {
        // E4M3 / 256 as an f16 (see `krasis_quant::fp4::kernel_scale`): exact, one conversion;
        // sign-extended and shifted as in the AVX-512 twin.
        let w = _mm_cvtepi8_epi16(_mm_loadl_epi64(p as *const __m128i));
        _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16::<7>(w), _mm_set1_epi16(super::fp4_avx512::E4M3_AS_F16_BITS)))
    } else {
        let b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i));
        let bits = _mm256_slli_epi32::<23>(b);
        let zero = _mm256_cmpeq_epi32(b, _mm256_setzero_si256());
        _mm256_castsi256_ps(_mm256_blendv_epi8(bits, _mm256_set1_epi32(0x0040_0000), zero))
    };
    _mm256_mul_ps(s, f)
}

/// # Safety
/// The CPU must have AVX2, FMA and F16C; arguments checked by [`super::matmul_packed_with`] (an FP4
/// layout).
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
    let nv = l.fp4.expect("an FP4 layout") == Fp4Kind::Nvfp4;
    let pfd = if pf.hint == PrefetchHint::None { 0 } else { pf.distance };
    let ncols = blocks.len() * ROW_BLOCK;
    let bb = l.block_bytes();
    let lut = _mm256_broadcastsi128_si256(_mm_loadu_si128(E2M1_X2_BIASED.as_ptr() as *const __m128i));
    for (bi, b) in blocks.enumerate() {
        let blk = w.as_ptr().add(b * bb);
        let y = out.as_mut_ptr().add(bi * ROW_BLOCK);
        if acts.m <= 2 {
            if acts.m == 1 {
                block_rows::<1>(blk, l, acts, 0, y, ncols, groups.clone(), pfd, lut, nv);
            } else {
                block_rows::<2>(blk, l, acts, 0, y, ncols, groups.clone(), pfd, lut, nv);
            }
            continue;
        }
        // Tiles of up to 4 activation rows, each over every group with its outputs in
        // registers; the first tile brings the row block in, later ones read it from cache.
        let mut i = 0;
        let mut pfd_t = pfd;
        while i < acts.m {
            let left = acts.m - i;
            let gr = groups.clone();
            i += if left >= 4 {
                rows_tile::<4>(blk, l, acts, i, y, ncols, gr, pfd_t, lut, nv)
            } else if left >= 2 {
                rows_tile::<2>(blk, l, acts, i, y, ncols, gr, pfd_t, lut, nv)
            } else {
                rows_tile::<1>(blk, l, acts, i, y, ncols, gr, pfd_t, lut, nv)
            };
            pfd_t = 0;
        }
    }
}

/// [`block_rows`] for the tiles of M > 2, kept out of line beside the M = 1 / 2 calls (as the
/// AVX-512 twin's, where inlining them moved those loops' code generation by 6–15 %).
#[inline(never)]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn rows_tile<const R: usize>(
    blk: *const u8,
    l: &PackedLayout,
    acts: &QuantizedActs,
    i0: usize,
    y: *mut f32,
    ncols: usize,
    groups: Range<usize>,
    pfd: usize,
    lut: __m256i,
    nv: bool,
) -> usize {
    block_rows::<R>(blk, l, acts, i0, y, ncols, groups, pfd, lut, nv)
}

/// Activation rows `i0 .. i0 + R` of one row block (R ≤ 4; 2: a decode token as value + residual
/// rows), groups `groups` in K order: the rows' outputs stay in registers over all groups
/// (continuing what `y` holds, or from zero when `groups` starts at 0), as in the AVX-512 twin's
/// `block_rows`. Returns `R`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn block_rows<const R: usize>(
    blk: *const u8,
    l: &PackedLayout,
    acts: &QuantizedActs,
    i0: usize,
    y: *mut f32,
    ncols: usize,
    groups: Range<usize>,
    pfd: usize,
    lut: __m256i,
    nv: bool,
) -> usize {
    let (k, gs, ng) = (l.k, l.gs, l.groups());
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
    let load = |p: *const f32| if fresh { _mm256_setzero_ps() } else { _mm256_loadu_ps(p) };
    let mut ya: [__m256; R] = std::array::from_fn(|i| load(y.add(i * ncols)));
    let mut yb: [__m256; R] = std::array::from_fn(|i| load(y.add(i * ncols + 8)));
    let (fa, fb) = (_mm256_loadu_ps(blk as *const f32), _mm256_loadu_ps(blk.add(32) as *const f32));
    for g in groups {
        let xq: [*const i8; R] = std::array::from_fn(|i| q.add(i * k + g * gs));
        let (aa, ab) = group_sums::<R>(blk.add(l.weights_offset(g)), l, xq, pfd, lut);
        let so = blk.add(l.scales_offset(g));
        let sf = (scales8(so, nv, fa), scales8(so.add(8), nv, fb));
        for i in 0..R {
            let corr = _mm256_set1_epi32(off * *sums.add(i * ng + g));
            let sx = _mm256_set1_ps(*scales.add(i * ng + g));
            let da = _mm256_cvtepi32_ps(_mm256_sub_epi32(aa[i], corr));
            let db = _mm256_cvtepi32_ps(_mm256_sub_epi32(ab[i], corr));
            ya[i] = _mm256_fmadd_ps(da, _mm256_mul_ps(sf.0, sx), ya[i]);
            yb[i] = _mm256_fmadd_ps(db, _mm256_mul_ps(sf.1, sx), yb[i]);
        }
    }
    for i in 0..R {
        _mm256_storeu_ps(y.add(i * ncols), ya[i]);
        _mm256_storeu_ps(y.add(i * ncols + 8), yb[i]);
    }
    R
}

/// One group's integer sums for activation rows `xq` (each at the group's first k): rows 0–7
/// and 8–15 of the row block, the +12 bias not yet removed.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn group_sums<const T: usize>(
    wp: *const u8,
    l: &PackedLayout,
    xq: [*const i8; T],
    pfd: usize,
    lut: __m256i,
) -> ([__m256i; T], [__m256i; T]) {
    let nchunks = l.group_weight_bytes() / CHUNK;
    let mask = _mm256_set1_epi8(0x0f);
    let ones = _mm256_set1_epi16(1);
    let mut aa = [_mm256_setzero_si256(); T];
    let mut ab = [_mm256_setzero_si256(); T];
    for c in 0..nchunks {
        let p = wp.add(c * CHUNK);
        if pfd != 0 {
            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(pfd) as *const i8);
        }
        let va = _mm256_loadu_si256(p as *const __m256i);
        let vb = _mm256_loadu_si256(p.add(32) as *const __m256i);
        let (la, ha) = (look(lut, va, mask), look(lut, _mm256_srli_epi16::<4>(va), mask));
        let (lb, hb) = (look(lut, vb, mask), look(lut, _mm256_srli_epi16::<4>(vb), mask));
        for t in 0..T {
            let (xl, xh) = (bcast4(xq[t].add(c * 8)), bcast4(xq[t].add(c * 8 + 4)));
            let sa = _mm256_add_epi16(_mm256_maddubs_epi16(la, xl), _mm256_maddubs_epi16(ha, xh));
            let sb = _mm256_add_epi16(_mm256_maddubs_epi16(lb, xl), _mm256_maddubs_epi16(hb, xh));
            aa[t] = _mm256_add_epi32(aa[t], _mm256_madd_epi16(sa, ones));
            ab[t] = _mm256_add_epi32(ab[t], _mm256_madd_epi16(sb, ones));
        }
    }
    (aa, ab)
}
