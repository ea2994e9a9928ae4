//! Scalar reference of the FP4 (MXFP4 / NVFP4) matmul on the CPU layout of
//! `krasis_quant::fp4`: each E2M1 code is looked up as `2·value + 12` ([`E2M1_X2_BIASED`]), the
//! group's integer sum `Σ u·q_x − 12·Σ q_x = Σ (2·value)·q_x` is exact, and the float epilogue is,
//! per group in K order, `y = fma(d, (s · f) · s_x, y)` with `s` the group scale as
//! `krasis_quant::fp4::kernel_scale` reads it and `f` the row factor (`128 · weight_scale_2`, or
//! `1/2`). The SIMD twins use the same operations in the
//! same order, so they agree bit for bit.

use std::ops::Range;

use krasis_quant::cpu_layout::{PackedLayout, CHUNK, ROW_BLOCK};
use krasis_quant::fp4::{kernel_scale, E2M1_X2_BIASED};

use super::QuantizedActs;

/// Integer sums `Σ_k u[j, k] · x[k]` of one group for the 16 rows of a row block, `u` the
/// looked-up (biased) codes.
#[inline]
fn group_dots(wg: &[u8], xq: &[i8]) -> [i32; ROW_BLOCK] {
    let mut acc = [0i32; ROW_BLOCK];
    let lut = |c: u8| E2M1_X2_BIASED[(c & 0xf) as usize] as i32;
    for (chunk, x) in wg.chunks_exact(CHUNK).zip(xq.chunks_exact(8)) {
        for (j, a) in acc.iter_mut().enumerate() {
            for b in 0..4 {
                let byte = chunk[4 * j + b];
                *a += lut(byte) * x[b] as i32 + lut(byte >> 4) * x[4 + b] as i32;
            }
        }
    }
    acc
}

/// The 16 row factors of a row block.
#[inline]
pub(super) fn row_factors(blk: &[u8]) -> [f32; ROW_BLOCK] {
    std::array::from_fn(|j| f32::from_le_bytes(blk[4 * j..4 * j + 4].try_into().expect("4 bytes")))
}

/// The 16 rows' `s · f` of group `g`: each row's group scale as the kernels read it
/// ([`kernel_scale`]) times its row factor (the twin of `fp4_avx512::scales_times_factors`).
#[inline]
pub(super) fn scales_times_factors(blk: &[u8], l: &PackedLayout, g: usize, f: &[f32; ROW_BLOCK]) -> [f32; ROW_BLOCK] {
    let (kind, so) = (l.fp4.expect("an FP4 layout"), l.scales_offset(g));
    std::array::from_fn(|j| kernel_scale(kind, blk[so + j]) * f[j])
}

/// Groups `groups` of row blocks `blocks` (see [`super::matmul_packed_groups`]) of an FP4 layout.
pub(super) fn matmul(
    w: &[u8],
    l: &PackedLayout,
    acts: &QuantizedActs,
    blocks: Range<usize>,
    groups: Range<usize>,
    out: &mut [f32],
) {
    debug_assert!(l.fp4.is_some(), "an FP4 layout");
    let (m, k, gs) = (acts.m, l.k, l.gs);
    let ng = l.groups();
    let ncols = blocks.len() * ROW_BLOCK;
    let off = l.offset();
    let gwb = l.group_weight_bytes();
    for (bi, b) in blocks.enumerate() {
        let blk = &w[l.block_range(b)];
        if groups.start == 0 {
            super::zero_block_columns(out, m, ncols, bi);
        }
        let f = row_factors(blk);
        for g in groups.clone() {
            let sf = scales_times_factors(blk, l, g, &f);
            let wg = &blk[l.weights_offset(g)..l.weights_offset(g) + gwb];
            for i in 0..m {
                let xq = &acts.q[i * k + g * gs..i * k + (g + 1) * gs];
                let sx = acts.scales[i * ng + g];
                let corr = off * acts.sums[i * ng + g];
                let y = &mut out[i * ncols + bi * ROW_BLOCK..i * ncols + (bi + 1) * ROW_BLOCK];
                let acc = group_dots(wg, xq);
                for j in 0..ROW_BLOCK {
                    let d = (acc[j] - corr) as f32;
                    y[j] = d.mul_add(sf[j] * sx, y[j]);
                }
            }
        }
    }
}
