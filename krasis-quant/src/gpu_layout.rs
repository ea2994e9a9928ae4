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
//! - **FP4** ([`GpuLayout::new_fp4`]: MXFP4, NVFP4): the blocks and words of INT4, holding E2M1
//!   codes, arranged so a 16-bit half of a word is one fragment register's four codes (the kernels
//!   look four codes up with one byte permute each way): of the two words of a tile pair at k16
//!   steps `2s` and `2s + 1` (one k32 step `s`), the first holds register 0 of the even tile (bits
//!   0–15) and of the odd tile (16–31), the second their register 1. Byte `i` of register `r` of
//!   lane `(g, q)` is k `16 · (i / 2) + 8r + 2q + i % 2` of the k32 step (`moe_qk`'s INT4 order in
//!   the kernels). Scales are f32 (4 bytes each, the same `[panel][group][g][t]` order): the
//!   CPU's product `s · f` of the group scale as its kernels read it and the matrix's row factor
//!   ([`crate::fp4::kernel_scale`], [`crate::fp4::row_factor`]), since the kernels hold the code
//!   table's doubled values: exact for MXFP4 (a power of two), one f32 rounding for NVFP4 (its
//!   E4M3 times the global scale), the same bits as the CPU's. Padding: code 0, scale 0.
//!
//! [`pack`] and [`unpack`] are exact inverses (padding dropped), as are [`pack_fp4_rows_into`] and
//! [`unpack_fp4`].

use half::f16;

use crate::fp4::{self, Fp4Kind, Fp4Matrix};
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
    /// E2M1 codes of this 4-bit float format in the words of INT4 (`bits` is `Int4`), f32 scales.
    pub fp4: Option<Fp4Kind>,
}

impl GpuLayout {
    pub fn new(rows: usize, k: usize, gs: usize, bits: Bits) -> Result<GpuLayout, QuantError> {
        check_group_size(k, gs)?;
        Ok(GpuLayout { rows, k, gs, bits, fp4: None })
    }

    /// The layout of a `[rows, k]` matrix of `kind` (groups of 32 or 16 along K; K a multiple of
    /// 32, as [`Fp4Matrix`] holds).
    pub fn new_fp4(rows: usize, k: usize, kind: Fp4Kind) -> Result<GpuLayout, QuantError> {
        if k == 0 || !k.is_multiple_of(32) {
            return Err(QuantError::BadGroupSize { k, gs: kind.group() });
        }
        Ok(GpuLayout { rows, k, gs: kind.group(), bits: Bits::Int4, fp4: Some(kind) })
    }

    /// Bytes of one scale: 2 (f16), 4 for FP4 (f32).
    pub fn scale_bytes(&self) -> usize {
        if self.fp4.is_some() {
            4
        } else {
            2
        }
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
    /// `gs` of 64 or more divides K, which is then a multiple of 64 already; FP4's 16 and 32
    /// divide 64).
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

    /// Number of scales (padding included; f16, or f32 for FP4: [`GpuLayout::scale_bytes`]).
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
        if self.fp4.is_some() {
            // k32 step s, register r, byte i of it (see the module docs).
            let (s, kw) = (kc / 32, kc % 32);
            let (r, i) = ((kw / 8) % 2, 2 * (kw / 16) + kw % 2);
            let lane = g * 4 + (kw % 8) / 2;
            let word = ((2 * s + r) * 4 + t / 2) * 32 + lane;
            let nibble = 4 * (t % 2) + i;
            return (base + word * 4 + nibble / 2, 4 * (nibble as u32 % 2));
        }
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

/// Refuses code and scale buffers (`w` bytes, `s` scales) shorter than `l`'s, or with `exact` of
/// any other length; the error counts bytes.
fn check_lens(l: &GpuLayout, w: usize, s: usize, exact: bool) -> Result<(), QuantError> {
    let bad = |have: usize, want: usize| if exact { have != want } else { have < want };
    if bad(w, l.weight_bytes()) {
        return Err(QuantError::BufferLen { found: w, expected: l.weight_bytes() });
    }
    if bad(s, l.scale_count()) {
        let sb = l.scale_bytes();
        return Err(QuantError::BufferLen { found: s * sb, expected: l.scale_count() * sb });
    }
    Ok(())
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
    check_lens(&l, w.len(), s.len(), true)?;
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
    check_lens(l, w.len(), s.len(), false)?;
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

/// Packs FP4 matrices into one GPU FP4 layout `l`: each `(m, row0)` fills rows `row0..row0 +
/// m.rows` (every matrix of `l`'s format and K); rows no part covers are padding. `w` and `s` are
/// exactly `weight_bytes()` and `scale_count()` long.
pub fn pack_fp4_rows_into(
    parts: &[(&Fp4Matrix, usize)],
    l: &GpuLayout,
    w: &mut [u8],
    s: &mut [u32],
) -> Result<(), QuantError> {
    let Some(kind) = l.fp4 else {
        return Err(QuantError::Fp4Pack(format!("the layout is {:?}, not a 4-bit float one", l.bits)));
    };
    check_lens(l, w.len(), s.len(), true)?;
    for (m, row0) in parts {
        if m.kind != kind || m.k != l.k || row0 + m.rows > l.rows {
            return Err(QuantError::Fp4Pack(format!(
                "a {} matrix of {} × {} at row {row0} does not fit a {kind} layout of {} × {}",
                m.kind, m.rows, m.k, l.rows, l.k
            )));
        }
    }
    w.fill(0);
    s.fill(0);
    for (m, row0) in parts {
        let (ng, f) = (m.groups(), m.row_factor());
        for r in 0..m.rows {
            for g in 0..ng {
                s[l.scale_at(row0 + r, g)] = (fp4::kernel_scale(kind, m.scale_byte(r, g)) * f).to_bits();
            }
            for kk in 0..m.k {
                let (at, shift) = l.weight_at(row0 + r, kk);
                w[at] |= m.code(r, kk) << shift;
            }
        }
    }
    Ok(())
}

/// One FP4 matrix in its GPU layout: (codes, f32 scale bits).
pub fn pack_fp4(m: &Fp4Matrix) -> Result<(GpuLayout, Vec<u8>, Vec<u32>), QuantError> {
    let l = GpuLayout::new_fp4(m.rows, m.k, m.kind)?;
    let (mut w, mut s) = (vec![0u8; l.weight_bytes()], vec![0u32; l.scale_count()]);
    pack_fp4_rows_into(&[(m, 0)], &l, &mut w, &mut s)?;
    Ok((l, w, s))
}

/// The codes (`[rows, k]`, one a byte) and f32 scales (`[rows, k / gs]`) of a GPU FP4 layout:
/// the inverse of [`pack_fp4_rows_into`] over the whole layout (padding K dropped).
pub fn unpack_fp4(w: &[u8], s: &[u32], l: &GpuLayout) -> Result<(Vec<u8>, Vec<f32>), QuantError> {
    check_lens(l, w.len(), s.len(), false)?;
    let ng = l.k / l.gs;
    let mut codes = vec![0u8; l.rows * l.k];
    let mut scales = vec![0f32; l.rows * ng];
    for r in 0..l.rows {
        for g in 0..ng {
            scales[r * ng + g] = f32::from_bits(s[l.scale_at(r, g)]);
        }
        for kk in 0..l.k {
            let (at, shift) = l.weight_at(r, kk);
            codes[r * l.k + kk] = (w[at] >> shift) & 0xf;
        }
    }
    Ok((codes, scales))
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

    /// The four fragment registers a kernel lane builds from an FP4 tile pair's two words of k32
    /// step `s` (`fp4_frags` in moe.cu: the 16-bit halves), each as 4 codes: [even tile r0, odd
    /// tile r0, even tile r1, odd tile r1].
    fn fp4_fragments(w: &[u8], l: &GpuLayout, p: usize, c: usize, s: usize, pair: usize, lane: usize) -> [[u8; 4]; 4] {
        let base = (p * l.chunks() + c) * l.block_bytes();
        let word = |ks: usize| {
            let i = (ks * 4 + pair) * 32 + lane;
            u32::from_le_bytes(w[base + 4 * i..base + 4 * i + 4].try_into().unwrap())
        };
        let (w0, w1) = (word(2 * s), word(2 * s + 1));
        let codes = |half: u32| std::array::from_fn(|i| ((half >> (4 * i)) & 0xf) as u8);
        [codes(w0 & 0xffff), codes(w0 >> 16), codes(w1 & 0xffff), codes(w1 >> 16)]
    }

    #[test]
    fn fp4_fragments_are_the_int4_k_order() {
        // Register r of tile t, byte i, for lane (g, q): row 8t + g, k 16(i / 2) + 8r + 2q + i % 2
        // of the k32 step (moe_qk's INT4 order, which the activations follow).
        for kind in [Fp4Kind::Mxfp4, Fp4Kind::Nvfp4] {
            let m = fp4::test_matrix(kind, 128, 128, 3);
            let (l, w, _) = pack_fp4(&m).unwrap();
            for p in 0..2 {
                for c in 0..2 {
                    for s in 0..2 {
                        for pair in 0..4 {
                            for lane in 0..32 {
                                let (g, q) = (lane / 4, lane % 4);
                                let f = fp4_fragments(&w, &l, p, c, s, pair, lane);
                                for (codes, (dt, r)) in f.iter().zip([(0, 0), (1, 0), (0, 1), (1, 1)]) {
                                    let row = p * 64 + 8 * (2 * pair + dt) + g;
                                    for (i, &code) in codes.iter().enumerate() {
                                        let k = c * 64 + 32 * s + 16 * (i / 2) + 8 * r + 2 * q + i % 2;
                                        assert_eq!(code, m.code(row, k), "{kind} p{p} c{c} s{s} pair{pair} l{lane}");
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn fp4_packing_refuses_what_does_not_fit() {
        let m = fp4::test_matrix(Fp4Kind::Mxfp4, 64, 64, 1);
        let l = GpuLayout::new_fp4(64, 64, Fp4Kind::Mxfp4).unwrap();
        let (mut w, mut s) = (vec![0u8; l.weight_bytes()], vec![0u32; l.scale_count()]);
        let nv = fp4::test_matrix(Fp4Kind::Nvfp4, 64, 64, 2);
        let e = pack_fp4_rows_into(&[(&nv, 0)], &l, &mut w, &mut s).unwrap_err().to_string();
        assert!(e.contains("nvfp4") && e.contains("mxfp4 layout"), "{e}");
        let e = pack_fp4_rows_into(&[(&m, 1)], &l, &mut w, &mut s).unwrap_err().to_string();
        assert!(e.contains("at row 1"), "{e}");
        let int = GpuLayout::new(64, 64, 32, Bits::Int4).unwrap();
        assert!(pack_fp4_rows_into(&[(&m, 0)], &int, &mut w, &mut s).unwrap_err().to_string().contains("not a 4-bit"));
        let e = pack_fp4_rows_into(&[(&m, 0)], &l, &mut w, &mut s[1..]).unwrap_err();
        assert_eq!(e, QuantError::BufferLen { found: (l.scale_count() - 1) * 4, expected: l.scale_count() * 4 });
        assert!(unpack_fp4(&w[1..], &s, &l).is_err());
    }

    proptest! {
        #[test]
        fn fp4_pack_then_unpack_is_identity(
            rows in 1usize..150,
            kk in prop::sample::select(vec![32usize, 64, 96, 160, 2880]),
            nv in any::<bool>(),
            seed in any::<u64>(),
        ) {
            let kind = if nv { Fp4Kind::Nvfp4 } else { Fp4Kind::Mxfp4 };
            let m = fp4::test_matrix(kind, rows, kk, seed);
            let (l, w, s) = pack_fp4(&m).unwrap();
            prop_assert_eq!(w.len(), l.weight_bytes());
            prop_assert_eq!(s.len(), l.scale_count());
            let (codes, scales) = unpack_fp4(&w, &s, &l).unwrap();
            let ng = kk / kind.group();
            for r in 0..rows {
                for c in 0..kk {
                    prop_assert_eq!(codes[r * kk + c], m.code(r, c));
                }
                for g in 0..ng {
                    let want = fp4::kernel_scale(kind, m.scale_byte(r, g)) * m.row_factor();
                    prop_assert_eq!(scales[r * ng + g].to_bits(), want.to_bits());
                    // The kernels' code table doubles E2M1, the scale halves it: the value.
                    prop_assert_eq!(
                        (scales[r * ng + g] as f64) * 2.0,
                        (fp4::scale_value(kind, m.scale_byte(r, g)) * if nv { m.global } else { 1.0 }) as f64,
                    );
                }
            }
            // Padding rows and columns: code 0, scale 0.
            for r in rows..l.panels() * PANEL_ROWS {
                let (at, sh) = l.weight_at(r, 0);
                prop_assert_eq!((w[at] >> sh) & 0xf, 0);
                prop_assert_eq!(s[l.scale_at(r, 0)], 0);
            }
        }

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
