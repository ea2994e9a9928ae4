//! Scalar reference of [`super::matmul_packed`]: the definition, read straight off the packed
//! layout. Integer sums per (row, group) are exact; the float epilogue is, per group in K
//! order, `y = fma((acc − off·Σx) as f32, s_w · s_x, y)`, the order every SIMD twin uses too.

use std::ops::Range;

use krasis_quant::cpu_layout::{PackedLayout, CHUNK, ROW_BLOCK};
use krasis_quant::Bits;

use super::{row_f16s, QuantizedActs};

/// Integer sums `Σ_k u[j, k] · x[k]` of one group for the 16 rows of a row block, with `u` the
/// stored (unsigned) weights.
#[inline]
fn group_dots(wg: &[u8], bits: Bits, xq: &[i8]) -> [i32; ROW_BLOCK] {
    let mut acc = [0i32; ROW_BLOCK];
    match bits {
        Bits::Int8 => {
            for (chunk, x) in wg.chunks_exact(CHUNK).zip(xq.chunks_exact(4)) {
                for (j, a) in acc.iter_mut().enumerate() {
                    for b in 0..4 {
                        *a += chunk[4 * j + b] as i32 * x[b] as i32;
                    }
                }
            }
        }
        Bits::Int4 => {
            for (chunk, x) in wg.chunks_exact(CHUNK).zip(xq.chunks_exact(8)) {
                for (j, a) in acc.iter_mut().enumerate() {
                    for b in 0..4 {
                        let byte = chunk[4 * j + b];
                        *a += (byte & 0x0f) as i32 * x[b] as i32 + (byte >> 4) as i32 * x[4 + b] as i32;
                    }
                }
            }
        }
    }
    acc
}

/// Groups `groups` of row blocks `blocks` (see [`super::matmul_packed_groups`]): `out` starts
/// from 0 when `groups` starts at group 0 and from its contents otherwise.
pub(super) fn matmul(
    w: &[u8],
    l: &PackedLayout,
    acts: &QuantizedActs,
    blocks: Range<usize>,
    groups: Range<usize>,
    out: &mut [f32],
) {
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
        for g in groups.clone() {
            let sw = row_f16s(blk, l.scales_offset(g));
            let wg = &blk[l.weights_offset(g)..l.weights_offset(g) + gwb];
            for i in 0..m {
                let xq = &acts.q[i * k + g * gs..i * k + (g + 1) * gs];
                let sx = acts.scales[i * ng + g];
                let corr = off * acts.sums[i * ng + g];
                let y = &mut out[i * ncols + bi * ROW_BLOCK..i * ncols + (bi + 1) * ROW_BLOCK];
                let acc = group_dots(wg, l.bits, xq);
                for j in 0..ROW_BLOCK {
                    let d = (acc[j] - corr) as f32;
                    y[j] = d.mul_add(sw[j] * sx, y[j]);
                }
            }
        }
    }
}
