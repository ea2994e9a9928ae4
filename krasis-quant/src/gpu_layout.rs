//! The GPU tile layout of a [`QuantizedMatrix`]: weights stored in the order the tensor-core
//! MoE tiles (`krasis-gpu/kernels/moe.cu`, `moe_qtile`) consume them, so each thread's 4-byte
//! shared-memory load is already its `mma.sync` B fragments of one or two n8 tiles (a warp's
//! load is 128 contiguous bytes), and dequantisation is a few register operations with no
//! shuffles.
//!
//! - Rows (outputs) go in **panels** of [`PANEL_ROWS`] = 64, K in **chunks** of [`CHUNK_K`] = 64;
//!   rows and K are zero padded to those multiples (q = 0, scale 0). A (panel, chunk) block is
//!   `64 · 64 · bits / 8` contiguous bytes (2 KiB INT4, 4 KiB INT8), blocks panel-major:
//!   block (p, c) at `(p · chunks + c) · block_bytes`. One block is what a tile stages per k step.
//! - Inside a block, k steps of 16 (`ks` 0..4) and n8 tiles of 8 rows (`t` 0..8). For lane
//!   `l = 4g + q` (g, q as in the PTX m16n8k16 B fragment) the fragment of tile t at step ks is
//!   row `8t + g`, k `16ks + {2q, 2q+1}` (b0) and `16ks + {2q+8, 2q+9}` (b1). Words (u32) go
//!   `[ks][j][lane]`, so the 32 lanes of a warp read 128 contiguous bytes for any one `j`:
//!   - INT4 (`u = q + 8`): `j = t / 2` (0..4) holds an even tile and the odd one after it. The
//!     element of tile t at k (within the step) is nibble `s + 4 · (k % 2)` (bits 4j..4j+3 of the
//!     word) with `s = 2 · (t % 2) + (k ≥ 8)`, so `(word >> 4s) & 0x000f000f` is one fragment
//!     register (its two k values in the low and high halves).
//!   - INT8 (`u = q + 128`): `j = t` (0..8); byte `2 · (k ≥ 8) + k % 2`.
//! - **Scales** (f16 bits, the same values as the matrix's) are `[panel][group][g][t]`: the 8
//!   scales a lane needs for one group of one panel are 16 contiguous bytes. Groups run over the
//!   padded K (`k_pad / gs` of them; padding groups have scale 0).
//!
//! [`pack`] and [`unpack`] are exact inverses (padding dropped).

use half::f16;

use crate::group::{check_group_size, Bits, QuantError, QuantizedMatrix};

/// Rows of a panel (one tile block's share of output columns).
pub const PANEL_ROWS: usize = 64;
/// K elements of a chunk (one staged k step of the tiles).
pub const CHUNK_K: usize = 64;

/// Geometry of a matrix in the GPU tile layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GpuLayout {
    pub rows: usize,
    pub k: usize,
    pub gs: usize,
    pub bits: Bits,
}

impl GpuLayout {
    pub fn new(rows: usize, k: usize, gs: usize, bits: Bits) -> Result<GpuLayout, QuantError> {
        check_group_size(k, gs)?;
        Ok(GpuLayout { rows, k, gs, bits })
    }

    pub fn of(m: &QuantizedMatrix) -> GpuLayout {
        GpuLayout::new(m.rows, m.k, m.gs, m.bits).expect("QuantizedMatrix with a valid group size")
    }

    pub fn panels(&self) -> usize {
        self.rows.div_ceil(PANEL_ROWS)
    }

    pub fn k_pad(&self) -> usize {
        self.k.div_ceil(CHUNK_K) * CHUNK_K
    }

    pub fn chunks(&self) -> usize {
        self.k_pad() / CHUNK_K
    }

    /// Scale groups per row over the padded K (`gs` divides it: K is a multiple of `gs`, and a
    /// `gs` of 64 or more divides K, which is then a multiple of 64 already).
    pub fn groups(&self) -> usize {
        self.k_pad() / self.gs
    }

    /// Bytes of one (panel, chunk) block.
    pub fn block_bytes(&self) -> usize {
        PANEL_ROWS * CHUNK_K * self.bits.bits() as usize / 8
    }

    pub fn weight_bytes(&self) -> usize {
        self.panels() * self.chunks() * self.block_bytes()
    }

    /// Number of f16 scales (padding included).
    pub fn scale_count(&self) -> usize {
        self.panels() * self.groups() * PANEL_ROWS
    }

    /// (byte offset, nibble shift) of element (row, kk); the shift is 0 or 4 for INT4, 0 for INT8.
    #[inline]
    pub fn weight_at(&self, row: usize, kk: usize) -> (usize, u32) {
        let (p, rr) = (row / PANEL_ROWS, row % PANEL_ROWS);
        let (c, kc) = (kk / CHUNK_K, kk % CHUNK_K);
        let (ks, kl) = (kc / 16, kc % 16);
        let (t, g) = (rr / 8, rr % 8);
        let (khalf, kin) = (kl / 8, kl % 8);
        let (q, odd) = (kin / 2, kin % 2);
        let lane = g * 4 + q;
        let base = (p * self.chunks() + c) * self.block_bytes();
        match self.bits {
            Bits::Int4 => {
                let word = (ks * 4 + t / 2) * 32 + lane;
                let nibble = 2 * (t % 2) + khalf + 4 * odd;
                (base + word * 4 + nibble / 2, 4 * (nibble as u32 % 2))
            }
            Bits::Int8 => {
                let word = (ks * 8 + t) * 32 + lane;
                (base + word * 4 + 2 * khalf + odd, 0)
            }
        }
    }

    /// Index of the scale of (row, group).
    #[inline]
    pub fn scale_at(&self, row: usize, group: usize) -> usize {
        let (p, rr) = (row / PANEL_ROWS, row % PANEL_ROWS);
        ((p * self.groups() + group) * 8 + rr % 8) * 8 + rr / 8
    }

    fn offset(&self) -> i32 {
        match self.bits {
            Bits::Int4 => 8,
            Bits::Int8 => 128,
        }
    }
}

/// `m` in the GPU tile layout: (weights, f16 scale bits).
pub fn pack(m: &QuantizedMatrix) -> (Vec<u8>, Vec<u16>) {
    let l = GpuLayout::of(m);
    let mut w = vec![0u8; l.weight_bytes()];
    let mut s = vec![0u16; l.scale_count()];
    pack_into(m, &mut w, &mut s).expect("buffers sized from the layout");
    (w, s)
}

/// [`pack`] into caller buffers of exactly `weight_bytes()` and `scale_count()` elements.
pub fn pack_into(m: &QuantizedMatrix, w: &mut [u8], s: &mut [u16]) -> Result<GpuLayout, QuantError> {
    let l = GpuLayout::new(m.rows, m.k, m.gs, m.bits)?;
    if w.len() != l.weight_bytes() {
        return Err(QuantError::BufferLen { found: w.len(), expected: l.weight_bytes() });
    }
    if s.len() != l.scale_count() {
        return Err(QuantError::BufferLen { found: s.len() * 2, expected: l.scale_count() * 2 });
    }
    // Padding: unsigned code of q = 0 (8 or 128 per element), scale 0.
    let zero = l.offset() as u8;
    w.fill(match m.bits {
        Bits::Int4 => zero | (zero << 4),
        Bits::Int8 => zero,
    });
    s.fill(0);
    let ng = m.groups();
    for r in 0..m.rows {
        for g in 0..ng {
            s[l.scale_at(r, g)] = m.scales[r * ng + g].to_bits();
        }
        for (kk, &q) in m.q[r * m.k..(r + 1) * m.k].iter().enumerate() {
            let u = (q as i32 + l.offset()) as u8;
            let (at, shift) = l.weight_at(r, kk);
            match m.bits {
                Bits::Int4 => w[at] = (w[at] & !(0xf << shift)) | ((u & 0xf) << shift),
                Bits::Int8 => w[at] = u,
            }
        }
    }
    Ok(l)
}

/// The exact inverse of [`pack`]: padding rows, columns and groups are dropped.
pub fn unpack(w: &[u8], s: &[u16], l: &GpuLayout) -> Result<QuantizedMatrix, QuantError> {
    if w.len() < l.weight_bytes() {
        return Err(QuantError::BufferLen { found: w.len(), expected: l.weight_bytes() });
    }
    if s.len() < l.scale_count() {
        return Err(QuantError::BufferLen { found: s.len() * 2, expected: l.scale_count() * 2 });
    }
    let ng = l.k / l.gs;
    let mut q = vec![0i8; l.rows * l.k];
    let mut scales = vec![f16::ZERO; l.rows * ng];
    for r in 0..l.rows {
        for g in 0..ng {
            scales[r * ng + g] = f16::from_bits(s[l.scale_at(r, g)]);
        }
        for kk in 0..l.k {
            let (at, shift) = l.weight_at(r, kk);
            let u = match l.bits {
                Bits::Int4 => (w[at] >> shift) & 0xf,
                Bits::Int8 => w[at],
            };
            q[r * l.k + kk] = (u as i32 - l.offset()) as i8;
        }
    }
    Ok(QuantizedMatrix { rows: l.rows, k: l.k, gs: l.gs, bits: l.bits, q, scales })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::group::{group_size_for, quantize};
    use proptest::prelude::*;

    fn data(n: usize, seed: u64) -> Vec<f32> {
        crate::group::test_data(n, seed, 1.0)
    }

    /// The fragment a kernel lane reads, decoded the way `moe_qtile` does (words and shifts), for
    /// (panel, chunk, k step, tile, lane): (b0 k values, b1 k values) as unsigned codes.
    fn fragment(w: &[u8], l: &GpuLayout, p: usize, c: usize, ks: usize, t: usize, lane: usize) -> [u32; 4] {
        let base = (p * l.chunks() + c) * l.block_bytes();
        let word = |i: usize| u32::from_le_bytes(w[base + 4 * i..base + 4 * i + 4].try_into().unwrap());
        match l.bits {
            Bits::Int4 => {
                let v = word((ks * 4 + t / 2) * 32 + lane);
                let reg = |s: u32| (v >> (4 * s)) & 0x000f_000f;
                let (r0, r1) = (reg(2 * (t as u32 % 2)), reg(2 * (t as u32 % 2) + 1));
                [r0 & 0xf, r0 >> 16, r1 & 0xf, r1 >> 16]
            }
            Bits::Int8 => {
                let v = word((ks * 8 + t) * 32 + lane);
                [v & 0xff, (v >> 8) & 0xff, (v >> 16) & 0xff, v >> 24]
            }
        }
    }

    #[test]
    fn fragments_are_the_ptx_b_layout() {
        // Every lane's fragment of every tile holds rows 8t + g at k 2q, 2q+1, 2q+8, 2q+9.
        for bits in [Bits::Int4, Bits::Int8] {
            let (rows, k) = (128, 128);
            let w = data(rows * k, 5);
            let m = quantize(&w, rows, k, bits, 64);
            let (pw, _) = pack(&m);
            let l = GpuLayout::of(&m);
            let off = l.offset();
            for p in 0..2 {
                for c in 0..2 {
                    for ks in 0..4 {
                        for t in 0..8 {
                            for lane in 0..32 {
                                let (g, q) = (lane / 4, lane % 4);
                                let row = p * 64 + 8 * t + g;
                                let k0 = c * 64 + ks * 16;
                                let want = [2 * q, 2 * q + 1, 2 * q + 8, 2 * q + 9]
                                    .map(|kk| (m.q[row * k + k0 + kk] as i32 + off) as u32);
                                assert_eq!(
                                    fragment(&pw, &l, p, c, ks, t, lane),
                                    want,
                                    "{bits:?} p{p} c{c} ks{ks} t{t} l{lane}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn short_buffers_are_refused() {
        let m = quantize(&data(64 * 64, 1), 64, 64, Bits::Int4, 32);
        let (w, s) = pack(&m);
        let l = GpuLayout::of(&m);
        assert!(unpack(&w[..w.len() - 1], &s, &l).is_err());
        assert!(unpack(&w, &s[..s.len() - 1], &l).is_err());
        let mut short = vec![0u8; w.len() - 1];
        assert!(pack_into(&m, &mut short, &mut vec![0u16; s.len()]).is_err());
    }

    proptest! {
        #[test]
        fn pack_then_unpack_is_identity(
            rows in 1usize..150,
            kk in prop::sample::select(vec![32usize, 64, 96, 160, 256, 1408]),
            int8 in any::<bool>(),
            gpref in prop::sample::select(vec![32usize, 64, 128, 256]),
            seed in any::<u64>(),
        ) {
            let bits = if int8 { Bits::Int8 } else { Bits::Int4 };
            let gs = group_size_for(kk, gpref).unwrap();
            let m = quantize(&data(rows * kk, seed), rows, kk, bits, gs);
            let (w, s) = pack(&m);
            let l = GpuLayout::of(&m);
            prop_assert_eq!(w.len(), l.weight_bytes());
            prop_assert_eq!(s.len(), l.scale_count());
            prop_assert_eq!(unpack(&w, &s, &l).unwrap(), m);
            // Padding decodes to q = 0 with scale 0.
            let off = l.offset();
            for r in rows..l.panels() * PANEL_ROWS {
                let (at, sh) = l.weight_at(r, 0);
                prop_assert_eq!(((w[at] >> sh) & if int8 { 0xff } else { 0xf }) as i32, off);
                prop_assert_eq!(s[l.scale_at(r, 0)], 0);
            }
            for c in kk..l.k_pad() {
                let (at, sh) = l.weight_at(0, c);
                prop_assert_eq!(((w[at] >> sh) & if int8 { 0xff } else { 0xf }) as i32, off);
            }
        }
    }
}
