//! Scalar reference of the asymmetric INT4 g32 matmul (a layout with `asym` set, see
//! `krasis_quant::int4_asym`): per (row, group) the exact integer sum `Σ q·x_q` of the stored
//! codes (0..=15) with the INT8 activations, and the float epilogue, per group in K order,
//! `y = fma(Σ q·x_q, d · s_x, y)` then `y = fma(m, Σ x_q · s_x, y)` (`d` the scale, `m` the
//! minimum, `Σ x_q` the activations' group sum: its product with `s_x` is one f32 per activation
//! row and group, shared by the 16 rows of a block). The SIMD twins use the same operations in
//! the same order, so they agree bit for bit.

use std::ops::Range;

use krasis_quant::cpu_layout::{PackedLayout, CHUNK, ROW_BLOCK};

use super::{row_f16s, QuantizedActs};

/// Integer sums `Σ_k q[j, k] · x[k]` of one group for the 16 rows of a row block.
#[inline]
fn group_dots(wg: &[u8], xq: &[i8]) -> [i32; ROW_BLOCK] {
    let mut acc = [0i32; ROW_BLOCK];
    for (chunk, x) in wg.chunks_exact(CHUNK).zip(xq.chunks_exact(8)) {
        for (j, a) in acc.iter_mut().enumerate() {
            for b in 0..4 {
                let byte = chunk[4 * j + b];
                *a += (byte & 0x0f) as i32 * x[b] as i32 + (byte >> 4) as i32 * x[4 + b] as i32;
            }
        }
    }
    acc
}

/// Groups `groups` of row blocks `blocks` (see [`super::matmul_packed_groups`]) of an
/// asymmetric INT4 layout.
pub(super) fn matmul(
    w: &[u8],
    l: &PackedLayout,
    acts: &QuantizedActs,
    blocks: Range<usize>,
    groups: Range<usize>,
    out: &mut [f32],
) {
    debug_assert!(l.asym);
    let (m, k, gs) = (acts.m, l.k, l.gs);
    let ng = l.groups();
    let ncols = blocks.len() * ROW_BLOCK;
    let gwb = l.group_weight_bytes();
    for (bi, b) in blocks.enumerate() {
        let blk = &w[l.block_range(b)];
        if groups.start == 0 {
            super::zero_block_columns(out, m, ncols, bi);
        }
        for g in groups.clone() {
            let (sw, mw) = (row_f16s(blk, l.scales_offset(g)), row_f16s(blk, l.mins_offset(g)));
            let wg = &blk[l.weights_offset(g)..l.weights_offset(g) + gwb];
            for i in 0..m {
                let xq = &acts.q[i * k + g * gs..i * k + (g + 1) * gs];
                let sx = acts.scales[i * ng + g];
                let offset = acts.sums[i * ng + g] as f32 * sx;
                let y = &mut out[i * ncols + bi * ROW_BLOCK..i * ncols + (bi + 1) * ROW_BLOCK];
                let acc = group_dots(wg, xq);
                for j in 0..ROW_BLOCK {
                    y[j] = (acc[j] as f32).mul_add(sw[j] * sx, y[j]);
                    y[j] = mw[j].mul_add(offset, y[j]);
                }
            }
        }
    }
}
