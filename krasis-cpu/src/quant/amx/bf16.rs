//! AMX-BF16 matmul of BF16 activation rows by dequantised weight panels
//! ([`crate::quant::bf16`]): the prefill kernel. Unlike the INT8 tiles ([`super::matmul`]) it
//! needs no per-group epilogue (the group scales are folded into the BF16 weights) and no
//! second activation row per token, so the C tiles accumulate in f32 over all of K and are
//! stored once, straight into the output.
//!
//! Blocking: activation rows in chunks of [`ROW_CHUNK_TILES`] tiles (they stay in L2 while the
//! panel's row blocks pass by); per pass 2 × 2 C tiles (two activation tiles × two row blocks),
//! every A and B tile load feeding two `tdpbf16ps`.

use super::tiles::{TileConfig, Tiles, TILE_A, TILE_B};

/// Activation rows per tile.
pub const TILE_ROWS: usize = 16;
/// K per tile step (32 BF16 = 64 bytes per A row).
pub const TILE_K: usize = 32;

/// Activation tiles per row chunk: 128 rows × K BF16 (512 KiB at K = 2048) stay in L2 (2 MiB
/// per Sapphire Rapids core) beside a panel of up to `PANEL_BYTES` while the panel passes by.
const ROW_CHUNK_TILES: usize = 8;

/// Index of activation (row `i`, column `k`) in the tiled layout of rows with `ks` K steps:
/// each (row tile, K step) is one contiguous 1 KiB A tile (16 rows × 32 BF16), row tiles in order
/// and each tile's K steps in order, so a tile load reads 1 KiB front to back (a row-major
/// matrix with K = 2048 puts a tile's 16 lines 4 KiB apart, all in one L1 set: measured on the
/// GPU box's Xeon, one thread, ready panel, M = 48–512: 140–210 GMAC/s row-major, 475–570
/// tiled; prefetching the next step's tiles into L1 as well cut it to ~220).
#[inline]
pub fn tiled_index(i: usize, k: usize, ks: usize) -> usize {
    ((i / TILE_ROWS * ks + k / TILE_K) * TILE_ROWS + i % TILE_ROWS) * TILE_K + k % TILE_K
}

/// `out[i, 16·b + n] = Σ_k x[i, k] · w_b[n, k]` for `mtiles · 16` rows and `nb` row blocks:
/// `panel` holds the blocks' panels back to back (`k · 16` u16 each, the layout of
/// [`crate::quant::bf16`]), `x` the rows in the tiled layout ([`tiled_index`], BF16 bits, padding
/// rows finite), `out` f32 with row stride `os` (every one of the `mtiles · 16` rows is written).
///
/// # Safety
/// `k` a multiple of [`TILE_K`]; the pointers valid for the extents above; with [`super::HwTiles`]
/// AMX-BF16 usable by this thread.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn matmul<T: Tiles>(
    t: &mut T,
    panel: *const u16,
    nb: usize,
    k: usize,
    x: *const u16,
    mtiles: usize,
    out: *mut f32,
    os: usize,
) {
    debug_assert!(k.is_multiple_of(TILE_K));
    t.configure(&TileConfig::new(64));
    let p = Pass { panel, k, x, out, os };
    for c0 in (0..mtiles).step_by(ROW_CHUNK_TILES) {
        let c1 = (c0 + ROW_CHUNK_TILES).min(mtiles);
        let mut b = 0;
        while b < nb {
            let nbp = (nb - b).min(2);
            let mut r = c0;
            while r < c1 {
                let na = (c1 - r).min(2);
                match (na, nbp) {
                    (2, 2) => p.run::<T, 2, 2>(t, r, b),
                    (2, _) => p.run::<T, 2, 1>(t, r, b),
                    (_, 2) => p.run::<T, 1, 2>(t, r, b),
                    _ => p.run::<T, 1, 1>(t, r, b),
                }
                r += na;
            }
            b += nbp;
        }
    }
    t.release();
}

struct Pass {
    panel: *const u16,
    k: usize,
    x: *const u16,
    out: *mut f32,
    os: usize,
}

impl Pass {
    /// Activation tiles `r..r + NA` × row blocks `b..b + NB` over all of K.
    #[inline(always)]
    unsafe fn run<T: Tiles, const NA: usize, const NB: usize>(&self, t: &mut T, r: usize, b: usize) {
        for ai in 0..NA {
            for bi in 0..NB {
                t.zero(2 * ai + bi);
            }
        }
        let (block, ks) = (self.k * 16, self.k / TILE_K);
        const TILE: usize = TILE_ROWS * TILE_K;
        // 16 k-pair rows of 64 bytes: step st's 32 k of row block b + bi; and activation tile
        // r + ai's 16 rows × 32 k.
        let bt = |bi: usize, st: usize| self.panel.add((b + bi) * block + st * TILE) as *const u8;
        let at = |ai: usize, st: usize| self.x.add(((r + ai) * ks + st) * TILE) as *const u8;
        for st in 0..ks {
            for bi in 0..NB {
                t.load(TILE_B + bi, bt(bi, st), 64);
            }
            for ai in 0..NA {
                t.load(TILE_A + ai, at(ai, st), 64);
            }
            for ai in 0..NA {
                for bi in 0..NB {
                    t.dp_bf16(2 * ai + bi);
                }
            }
        }
        for ai in 0..NA {
            for bi in 0..NB {
                let o = self.out.add((r + ai) * TILE_ROWS * self.os + (b + bi) * 16);
                t.store(2 * ai + bi, o as *mut u8, 4 * self.os);
            }
        }
    }
}

/// Scalar twin of [`matmul`] (same operands, f32 products summed in k order; the tiles may sum
/// a pair's two products in another order, so the two agree to rounding, not bit for bit).
///
/// # Safety
/// As [`matmul`], without the AMX requirement.
#[cfg(test)]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn matmul_scalar(
    panel: *const u16,
    nb: usize,
    k: usize,
    x: *const u16,
    mtiles: usize,
    out: *mut f32,
    os: usize,
) {
    use crate::quant::bf16::bf16_value;
    for i in 0..mtiles * TILE_ROWS {
        for b in 0..nb {
            for n in 0..16 {
                let mut acc = 0f32;
                for kk in 0..k {
                    let w = *panel.add(b * k * 16 + (kk / 2) * 32 + 2 * n + kk % 2);
                    acc += bf16_value(*x.add(tiled_index(i, kk, k / TILE_K))) * bf16_value(w);
                }
                *out.add(i * os + b * 16 + n) = acc;
            }
        }
    }
}
