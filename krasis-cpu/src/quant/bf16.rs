//! BF16 operands of the AMX-BF16 prefill kernel (`quant::amx::bf16`): packed INT4/INT8 row
//! blocks (symmetric, or asymmetric INT4 g32 with its minimums) and FP4 ones (MXFP4, NVFP4)
//! dequantised into B-tile panels, and f32 activation rows rounded to BF16.
//!
//! **Panel layout.** One row block (16 weight rows) over all of K is `K / 2` B-tile rows of 64
//! bytes: row `r` holds, for each weight row `n` of the block, the pair `(w[n, 2r], w[n, 2r + 1])`
//! as two BF16 (element `32·r + 2·n + i` is `w[n, 2r + i]`). K steps of 32 are then 16
//! consecutive rows, one `tileloadd` with stride 64. The value is `bf16((u − off) · s)`: the
//! product is exact in f32 (an 8-bit integer times an f16 scale), so the only rounding is the
//! one to BF16, to nearest even, the same in both twins. An FP4 value is `bf16(v · (s · f))`,
//! `v` twice the E2M1 value and `s · f` the group scale times the row factor as the integer
//! kernels form it (`fp4_scalar`): exact for MXFP4 (a power of two times a small integer); for
//! NVFP4 `s · f` and the product each round to f32 first.
//!
//! **Rounding.** [`bf16_bits`] is `vcvtne2ps2bf16`'s: round to nearest even, denormal inputs
//! as (signed) zero, NaN kept quiet.
//!
//! Each operation has a scalar twin and an AVX-512 BF16 one (chosen once at run time, the
//! scalar one with `KRASIS_ISA` below `avx512`), equal bit for bit (property tests).

use krasis_quant::cpu_layout::{PackedLayout, CHUNK, ROW_BLOCK};
use krasis_quant::fp4::{Fp4Kind, E2M1_X2};
use krasis_quant::Bits;

use super::row_f16s;

/// Twice the E2M1 value of each code, as f32 (the FP4 panels' lookup).
const E2M1_X2_F32: [f32; 16] = {
    let mut t = [0f32; 16];
    let mut c = 0;
    while c < 16 {
        t[c] = E2M1_X2[c] as f32;
        c += 1;
    }
    t
};

/// `x` rounded to BF16 as `vcvtneps2bf16` does (nearest even, denormals to signed zero).
#[inline]
pub fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) | 0x40) as u16;
    }
    if x.is_subnormal() {
        return ((b >> 16) & 0x8000) as u16;
    }
    let round = 0x7fff + ((b >> 16) & 1);
    (b.wrapping_add(round) >> 16) as u16
}

/// The f32 value of BF16 bits.
#[inline]
pub fn bf16_value(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// u16 elements of one row block's panel: `K / 2` rows of 32.
pub fn panel_len(l: &PackedLayout) -> usize {
    l.k * ROW_BLOCK
}

/// Bytes ahead of the chunk being dequantised that [`block_panel`]'s AVX-512 twin prefetches
/// (`prefetcht0`), across row blocks: a pool task streams its blocks from DRAM, and one core's
/// demand misses alone read far below its share of the bandwidth (the INT8 kernels' distance).
const PANEL_PREFETCH: usize = 4096;

/// Whether the SIMD twins run (AVX-512 BF16 present and `KRASIS_ISA` not below `avx512`).
fn simd() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static S: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *S.get_or_init(|| {
            crate::isa::active() == crate::isa::Isa::Avx512 && std::arch::is_x86_feature_detected!("avx512bf16")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Row block `b`'s BF16 panel (see the module docs) into `dst` (`panel_len(l)` elements).
pub fn block_panel(w: &[u8], l: &PackedLayout, b: usize, dst: &mut [u16]) {
    let blk = &w[l.block_range(b)];
    assert_eq!(dst.len(), panel_len(l), "block_panel: dst must be K·16 elements");
    #[cfg(target_arch = "x86_64")]
    if panel_simd() {
        // SAFETY: AVX-512 F/BW/BF16/VBMI checked by `panel_simd`; sizes asserted above and by
        // block_range.
        return unsafe { block_panel_avx512(blk, l, dst) };
    }
    block_panel_scalar(blk, l, dst);
}

/// Scalar twin of [`block_panel`] for one row block's bytes `blk`: symmetric codes as
/// `(u − off) · s` (exact), asymmetric ones as `fma(q, d, m)` (one rounding to f32), FP4 codes
/// as `v · (s · f)` (INT4's chunk arrangement of E2M1 codes).
pub fn block_panel_scalar(blk: &[u8], l: &PackedLayout, dst: &mut [u16]) {
    let (gs, off) = (l.gs, l.offset());
    let gwb = l.group_weight_bytes();
    let mut put = |k: usize, j: usize, v: f32| dst[(k / 2) * 2 * ROW_BLOCK + 2 * j + k % 2] = bf16_bits(v);
    // FP4's row factors (zeros for the integer layouts, which do not read them).
    let factors = if l.fp4.is_some() { super::fp4_scalar::row_factors(blk) } else { [0.0; ROW_BLOCK] };
    for g in 0..l.groups() {
        // The 16 rows' multipliers: the f16 scales, or FP4's `s · f` as the integer kernels form it.
        let s = match l.fp4 {
            Some(_) => super::fp4_scalar::scales_times_factors(blk, l, g, &factors),
            None => row_f16s(blk, l.scales_offset(g)),
        };
        // An asymmetric group's minimums (zeros for a symmetric one, which takes `off` instead).
        let mins = if l.asym { row_f16s(blk, l.mins_offset(g)) } else { [0.0; ROW_BLOCK] };
        let value = |u: i32, j: usize| {
            if l.fp4.is_some() {
                E2M1_X2_F32[u as usize] * s[j]
            } else if l.asym {
                (u as f32).mul_add(s[j], mins[j])
            } else {
                (u - off) as f32 * s[j]
            }
        };
        let wg = &blk[l.weights_offset(g)..l.weights_offset(g) + gwb];
        for (c, chunk) in wg.chunks_exact(CHUNK).enumerate() {
            for j in 0..ROW_BLOCK {
                for b in 0..4 {
                    let u = chunk[4 * j + b] as i32;
                    match l.bits {
                        Bits::Int8 => put(g * gs + 4 * c + b, j, value(u, j)),
                        Bits::Int4 => {
                            put(g * gs + 8 * c + b, j, value(u & 0x0f, j));
                            put(g * gs + 8 * c + 4 + b, j, value(u >> 4, j));
                        }
                    }
                }
            }
        }
    }
}

/// `src` rounded to BF16 into `dst` (same length).
pub fn to_bf16(src: &[f32], dst: &mut [u16]) {
    assert_eq!(src.len(), dst.len(), "to_bf16: lengths differ");
    #[cfg(target_arch = "x86_64")]
    if simd() {
        // SAFETY: AVX-512 F/BF16 checked by `simd`; equal lengths asserted.
        return unsafe { to_bf16_avx512(src, dst) };
    }
    to_bf16_scalar(src, dst);
}

/// Scalar twin of [`to_bf16`].
pub fn to_bf16_scalar(src: &[f32], dst: &mut [u16]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = bf16_bits(s);
    }
}

/// `src` rounded to BF16 in runs of `run` elements, run `r` into `dst[r·stride..][..run]` (a row
/// of activations into its A tiles: one call per row instead of one [`to_bf16`] per 32 floats,
/// whose per-call checks cost more than the conversion).
pub fn to_bf16_runs(src: &[f32], run: usize, dst: &mut [u16], stride: usize) {
    assert!(run > 0 && src.len().is_multiple_of(run), "to_bf16_runs: src must be whole runs");
    let runs = src.len() / run;
    assert!(runs == 0 || (runs - 1) * stride + run <= dst.len(), "to_bf16_runs: dst too short");
    #[cfg(target_arch = "x86_64")]
    if simd() && run.is_multiple_of(16) {
        // SAFETY: AVX-512 F/BF16 checked by `simd`; extents asserted above.
        return unsafe { to_bf16_runs_avx512(src, run, dst, stride) };
    }
    to_bf16_runs_scalar(src, run, dst, stride);
}

/// Scalar twin of [`to_bf16_runs`].
pub fn to_bf16_runs_scalar(src: &[f32], run: usize, dst: &mut [u16], stride: usize) {
    for (r, chunk) in src.chunks_exact(run).enumerate() {
        to_bf16_scalar(chunk, &mut dst[r * stride..r * stride + run]);
    }
}

/// One B-tile row of a panel from two rows of 16 f32 weights along K: `dst[2n + i]` is
/// `bf16(src_i[n])` for the k pair (`lo` = k even, `hi` = k + 1) and output column n (what
/// [`block_panel`] writes for packed weights, for weights already in f32).
pub fn pair_row(lo: &[f32], hi: &[f32], dst: &mut [u16]) {
    assert!(lo.len() == ROW_BLOCK && hi.len() == ROW_BLOCK && dst.len() == 2 * ROW_BLOCK, "pair_row: 16, 16 → 32");
    #[cfg(target_arch = "x86_64")]
    if simd() {
        // SAFETY: AVX-512 F/BW/BF16 checked by `simd`; lengths asserted above.
        return unsafe { pair_row_avx512(lo, hi, dst) };
    }
    pair_row_scalar(lo, hi, dst);
}

/// Scalar twin of [`pair_row`].
pub fn pair_row_scalar(lo: &[f32], hi: &[f32], dst: &mut [u16]) {
    for n in 0..ROW_BLOCK {
        dst[2 * n] = bf16_bits(lo[n]);
        dst[2 * n + 1] = bf16_bits(hi[n]);
    }
}

/// Word index of the pair interleave: out[2n] = lo[n], out[2n + 1] = hi[n] (hi at 16..32 of a
/// `vcvtne2ps2bf16` result).
#[cfg(target_arch = "x86_64")]
const PAIR_INTERLEAVE: [u16; 32] = {
    let mut idx = [0u16; 32];
    let mut w = 0;
    while w < 32 {
        idx[w] = if w % 2 == 0 { (w / 2) as u16 } else { (16 + w / 2) as u16 };
        w += 1;
    }
    idx
};

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn pair_row_avx512(lo: &[f32], hi: &[f32], dst: &mut [u16]) {
    use std::arch::x86_64::*;
    let idx = _mm512_loadu_si512(PAIR_INTERLEAVE.as_ptr() as *const _);
    let h: __m512i =
        std::mem::transmute(_mm512_cvtne2ps_pbh(_mm512_loadu_ps(hi.as_ptr()), _mm512_loadu_ps(lo.as_ptr())));
    _mm512_storeu_si512(dst.as_mut_ptr() as *mut _, _mm512_permutexvar_epi16(idx, h));
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn to_bf16_avx512(src: &[f32], dst: &mut [u16]) {
    use std::arch::x86_64::*;
    let n = src.len() / 16 * 16;
    for i in (0..n).step_by(16) {
        let v = _mm512_loadu_ps(src.as_ptr().add(i));
        let h: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(v));
        _mm256_storeu_si256(dst.as_mut_ptr().add(i) as *mut __m256i, h);
    }
    to_bf16_scalar(&src[n..], &mut dst[n..]);
}

/// [`to_bf16_runs`] 16 floats at a time (`run` a multiple of 16).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn to_bf16_runs_avx512(src: &[f32], run: usize, dst: &mut [u16], stride: usize) {
    use std::arch::x86_64::*;
    for r in 0..src.len() / run {
        let (s, d) = (src.as_ptr().add(r * run), dst.as_mut_ptr().add(r * stride));
        for i in (0..run).step_by(16) {
            let h: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(_mm512_loadu_ps(s.add(i))));
            _mm256_storeu_si256(d.add(i) as *mut __m256i, h);
        }
    }
}

/// Byte lanes of [`block_panel_avx512`]'s `vpermb`: for byte pair `p` (bytes `2p`, `2p + 1` of
/// each row's 4-byte chunk) and half `r` (rows `8r..8r + 8`), dword lane `2j + i` takes byte
/// `2p + i` of row `8r + j`, zero-extended (the other three bytes of each lane are masked off).
#[cfg(target_arch = "x86_64")]
const PAIR_BYTES: [[[u8; 64]; 2]; 2] = {
    let mut t = [[[0u8; 64]; 2]; 2];
    let mut p = 0;
    while p < 2 {
        let mut r = 0;
        while r < 2 {
            let mut lane = 0;
            while lane < 16 {
                t[p][r][4 * lane] = (4 * (8 * r + lane / 2) + 2 * p + lane % 2) as u8;
                lane += 1;
            }
            r += 1;
        }
        p += 1;
    }
    t
};

/// The low byte of every dword lane (the `vpermb` write mask of [`PAIR_BYTES`]).
#[cfg(target_arch = "x86_64")]
const LOW_BYTES: u64 = 0x1111_1111_1111_1111;

/// Scale lanes of the two halves: lane `2j + i` takes row `8r + j`'s scale.
#[cfg(target_arch = "x86_64")]
const PAIR_SCALES: [[u32; 16]; 2] = {
    let mut t = [[0u32; 16]; 2];
    let mut lane = 0;
    while lane < 16 {
        t[0][lane] = (lane / 2) as u32;
        t[1][lane] = (8 + lane / 2) as u32;
        lane += 1;
    }
    t
};

/// Whether [`block_panel`]'s SIMD twin runs: [`simd`] and AVX-512 VBMI (its byte permutes).
fn panel_simd() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static S: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *S.get_or_init(|| simd() && std::arch::is_x86_feature_detected!("avx512vbmi"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// AVX-512 twin of [`block_panel_scalar`]. A 64-byte chunk holds 4 (INT8) or 8 (INT4, FP4) k of
/// each of the 16 rows; one `vpermb` per (k pair, half of the rows) gathers a B row's bytes already
/// in pair order (lane `2j + i` = row `8r + j`, k `2p + i`), so the two halves, converted and
/// scaled (`fmsub(u, s, off·s)`, exact), round straight into one B row (`vcvtne2ps2bf16`: the
/// first half low) with no interleave after it. An INT4 byte's two nibbles are two k pairs 4
/// apart, from the same gather. An FP4 code is looked up instead (`vpermps` over
/// [`E2M1_X2_F32`]) and multiplied by its row's `s · f`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx512vbmi")]
unsafe fn block_panel_avx512(blk: &[u8], l: &PackedLayout, dst: &mut [u16]) {
    use std::arch::x86_64::*;
    let gather: [[__m512i; 2]; 2] =
        std::array::from_fn(|p| std::array::from_fn(|r| _mm512_loadu_si512(PAIR_BYTES[p][r].as_ptr() as *const _)));
    let dup: [__m512i; 2] = std::array::from_fn(|r| _mm512_loadu_si512(PAIR_SCALES[r].as_ptr() as *const _));
    let (gs, off) = (l.gs, _mm512_set1_ps(l.offset() as f32));
    let gwb = l.group_weight_bytes();
    let nib = _mm512_set1_epi32(0x0f);
    let out = dst.as_mut_ptr();
    // FP4: the E2M1 lookup (`vpermps` takes an index's low four bits) and the row factors.
    let lut = _mm512_loadu_ps(E2M1_X2_F32.as_ptr());
    let factors = if l.fp4.is_some() { _mm512_loadu_ps(blk.as_ptr() as *const f32) } else { _mm512_setzero_ps() };
    for g in 0..l.groups() {
        // The 16 rows' multipliers: the f16 scales, or FP4's `s · f` as the integer kernels form it.
        let s = match l.fp4 {
            Some(kind) => super::fp4_avx512::scales_times_factors(blk.as_ptr(), l, g, kind == Fp4Kind::Nvfp4, factors),
            None => _mm512_cvtph_ps(_mm256_loadu_si256(blk.as_ptr().add(l.scales_offset(g)) as *const __m256i)),
        };
        let sh: [__m512; 2] = std::array::from_fn(|r| _mm512_permutexvar_ps(dup[r], s));
        // What `fmsub(u, s, ·)` takes away: `off · s` (exact), or an asymmetric group's negated
        // minimum, so the value is the scalar's `fma(q, d, m)`.
        let offs: [__m512; 2] = if l.asym {
            let m = _mm512_cvtph_ps(_mm256_loadu_si256(blk.as_ptr().add(l.mins_offset(g)) as *const __m256i));
            let neg = _mm512_sub_ps(_mm512_setzero_ps(), m);
            std::array::from_fn(|r| _mm512_permutexvar_ps(dup[r], neg))
        } else {
            std::array::from_fn(|r| _mm512_mul_ps(sh[r], off))
        };
        let scaled = |u: __m512i, r: usize| match l.fp4 {
            Some(_) => _mm512_mul_ps(_mm512_permutexvar_ps(u, lut), sh[r]),
            None => _mm512_fmsub_ps(_mm512_cvtepi32_ps(u), sh[r], offs[r]),
        };
        // B row of the k pair starting at even k from its two halves' lanes.
        let row = |k: usize, a: __m512, b: __m512| {
            let h: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(b, a));
            _mm512_storeu_si512(out.add((k / 2) * 2 * ROW_BLOCK) as *mut _, h);
        };
        let wg = blk.as_ptr().add(l.weights_offset(g));
        for c in 0..gwb / CHUNK {
            // Prefetch never faults: the address may lie past the matrix.
            _mm_prefetch::<_MM_HINT_T0>(wg.wrapping_add(c * CHUNK + PANEL_PREFETCH) as *const i8);
            let v = _mm512_loadu_si512(wg.add(c * CHUNK) as *const _);
            for (p, halves) in gather.iter().enumerate() {
                let a = _mm512_maskz_permutexvar_epi8(LOW_BYTES, halves[0], v);
                let b = _mm512_maskz_permutexvar_epi8(LOW_BYTES, halves[1], v);
                match l.bits {
                    Bits::Int8 => row(g * gs + 4 * c + 2 * p, scaled(a, 0), scaled(b, 1)),
                    Bits::Int4 => {
                        let k0 = g * gs + 8 * c + 2 * p;
                        row(k0, scaled(_mm512_and_si512(a, nib), 0), scaled(_mm512_and_si512(b, nib), 1));
                        row(k0 + 4, scaled(_mm512_srli_epi32::<4>(a), 0), scaled(_mm512_srli_epi32::<4>(b), 1));
                    }
                }
            }
        }
    }
}

#[cfg(test)]
#[path = "bf16_tests.rs"]
mod tests;
