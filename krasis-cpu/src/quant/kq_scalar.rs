//! Scalar reference of the K-quant matmul (a layout with `kq` set: Q4_K or Q6_K kept as stored,
//! see `krasis_quant::kquant`). Per (row, group) the exact integer sum `Σ q·x_q` of the stored
//! codes with the INT8 activations (Q6_K: less `32 · Σ x_q`, its code offset), and the float
//! epilogue, per group in K order: `y = fma(acc, (d · sc) · s_x, y)`, and for Q4_K then
//! `y = fma(−Σ x_q, (dmin · m) · s_x, y)`. `d · sc` and `dmin · m` are exact in f32 (an f16
//! times a 6- or 8-bit integer). The SIMD twins use the same operations in the same order, so
//! they agree bit for bit.

use std::ops::Range;

use krasis_quant::cpu_layout::{PackedLayout, CHUNK, ROW_BLOCK};
use krasis_quant::kquant::KQuant;

use super::{row_f16s, QuantizedActs};

/// Per row of a row block, group `g`: (`d · sc`, `dmin · m`; 0 for Q6_K), exact in f32.
#[inline]
pub(super) fn group_scales(kind: KQuant, blk: &[u8], hdr: usize, jg: usize) -> ([f32; ROW_BLOCK], [f32; ROW_BLOCK]) {
    let d = row_f16s(blk, hdr);
    match kind {
        KQuant::Q4K => {
            let dmin = row_f16s(blk, hdr + 32);
            (
                std::array::from_fn(|j| d[j] * blk[hdr + 64 + 16 * jg + j] as f32),
                std::array::from_fn(|j| dmin[j] * blk[hdr + 192 + 16 * jg + j] as f32),
            )
        }
        KQuant::Q6K => (std::array::from_fn(|j| d[j] * (blk[hdr + 64 + 16 * jg + j] as i8) as f32), [0.0; ROW_BLOCK]),
    }
}

/// Integer sums `Σ_k q[j, k] · x[k]` of one group for the 16 rows of a row block (Q6_K's codes
/// 0..=63 before the offset).
#[inline]
fn group_dots(kind: KQuant, wg: &[u8], xq: &[i8]) -> [i32; ROW_BLOCK] {
    let mut acc = [0i32; ROW_BLOCK];
    let chunks = kind.group() / 8;
    for c in 0..chunks {
        let lo = &wg[c * CHUNK..(c + 1) * CHUNK];
        let x = &xq[8 * c..8 * c + 8];
        for (j, a) in acc.iter_mut().enumerate() {
            for b in 0..4 {
                let byte = lo[4 * j + b];
                let (mut ql, mut qh) = ((byte & 0x0f) as i32, (byte >> 4) as i32);
                if kind == KQuant::Q6K {
                    let h = wg[2 * CHUNK + 4 * j + b] >> (4 * c);
                    ql |= ((h & 3) as i32) << 4;
                    qh |= (((h >> 2) & 3) as i32) << 4;
                }
                *a += ql * x[b] as i32 + qh * x[4 + b] as i32;
            }
        }
    }
    acc
}

/// Groups `groups` of row blocks `blocks` (see [`super::matmul_packed_groups`]) of a K-quant
/// layout.
pub(super) fn matmul(
    w: &[u8],
    l: &PackedLayout,
    acts: &QuantizedActs,
    blocks: Range<usize>,
    groups: Range<usize>,
    out: &mut [f32],
) {
    let kind = l.kq.expect("a K-quant layout");
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
            let (ds, mins) = group_scales(kind, blk, l.scales_offset(g), g % kind.groups_per_sb());
            let wg = &blk[l.weights_offset(g)..l.weights_offset(g) + gwb];
            for i in 0..m {
                let xq = &acts.q[i * k + g * gs..i * k + (g + 1) * gs];
                let sx = acts.scales[i * ng + g];
                let sum = acts.sums[i * ng + g];
                let y = &mut out[i * ncols + bi * ROW_BLOCK..i * ncols + (bi + 1) * ROW_BLOCK];
                let acc = group_dots(kind, wg, xq);
                for j in 0..ROW_BLOCK {
                    match kind {
                        KQuant::Q4K => {
                            y[j] = (acc[j] as f32).mul_add(ds[j] * sx, y[j]);
                            y[j] = (-(sum as f32)).mul_add(mins[j] * sx, y[j]);
                        }
                        KQuant::Q6K => y[j] = ((acc[j] - 32 * sum) as f32).mul_add(ds[j] * sx, y[j]),
                    }
                }
            }
        }
    }
}
