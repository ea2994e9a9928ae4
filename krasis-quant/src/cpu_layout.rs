//! The CPU packed layout of a [`QuantizedMatrix`]: one sequential byte stream per matrix, shaped
//! for AVX-512 VNNI `vpdpbusd` (u8 × s8 → i32, four adjacent products summed per 32-bit lane) at
//! M = 1, and read just as well by the AVX2 and scalar kernels.
//!
//! - Rows (outputs) go in **row blocks** of [`ROW_BLOCK`] = 16 (one zmm of i32 lanes); the row
//!   count is padded to a multiple of 16 with zero rows (q = 0, scale 0).
//! - A row block is `[scale header][group 0 weights][group 1 weights]…`, groups in K order. The
//!   header holds, for each group g in order, the 16 f16 scales (little-endian, row 0 first) of
//!   that group: 32 bytes per group, zero-padded to a multiple of 64 bytes.
//! - Weights are stored unsigned. INT8: `u = q + 128` (1..=255); each 4 k-steps form one 64-byte
//!   chunk in which byte `4·j + b` is (row j, k0 + b). INT4: `u = q + 8` (1..=15); each 8 k-steps
//!   form one 64-byte chunk in which byte `4·j + b` holds (row j, k0 + b) in its low nibble and
//!   (row j, k0 + 4 + b) in its high nibble. A group is `16·gs` bytes (INT8) or `8·gs` (INT4).
//! - Every chunk is 64-byte aligned relative to the matrix start (header and groups are whole
//!   multiples of 64 bytes), so with a 64-byte-aligned buffer no load straddles a cache line.
//!   (The first draft put each group's 32 bytes of scales after its weights; that leaves every
//!   other group 32 bytes off a cache line, so every zmm load of it is a split load. Measured on
//!   the 16-core Xeon, AVX-512 INT4 M = 1, one thread: all-split is 3–4% slower than aligned,
//!   so the trailer layout would cost about half that; the header costs nothing.)
//! - The matrix is the row blocks in order: no indirection, one forward stream.
//!
//! **Fused gate+up (w13).** [`pack_w13`] interleaves the row blocks of `gate` and `up`:
//! `[gate rb0][up rb0][gate rb1][up rb1]…`, described by a plain [`PackedLayout`] with
//! `rows = 2 · inter`. Block `2b` is gate rows `16b..16b+16`, block `2b+1` the same up rows, so
//! a worker that owns block pair b can apply `silu(gate) · up` to its 16 outputs alone. gate and
//! up must have equal shapes and a row count that is a multiple of 16 (no padding inside the
//! fused form). Real models always satisfy this: `inter` is the K of w2, which must be a
//! multiple of 32 anyway (1408, 768, 512, 128 …).
//!
//! **FP4 (MXFP4, NVFP4).** A layout with [`PackedLayout::fp4`] set holds E2M1 codes in the INT4
//! chunk arrangement (the code's 4 bits in place of `q + 8`), groups of 32 (MXFP4) or 16
//! (NVFP4), and a different header: 16 f32 row factors (64 bytes), then per group the 16 rows'
//! one-byte scales as stored (E8M0 or E4M3), padded to 64. See [`crate::fp4`].
//!
//! **Asymmetric INT4 g32.** A layout with [`PackedLayout::asym`] set holds codes 0..=15 (no
//! offset) in the INT4 chunk arrangement, groups of 32, and a header of 64 bytes per group: the
//! 16 rows' f16 scales, then their 16 f16 minimums (`w = scale · q + min`). See
//! [`crate::int4_asym`].
//!
//! **Q4_K / Q6_K kept as stored.** A layout with [`PackedLayout::kq`] set holds llama.cpp's
//! K-quant codes in row blocks of 16, a header per super-block of 256 and groups of 32 (Q4_K) or
//! 16 (Q6_K). See [`crate::kquant`].

use half::f16;

use crate::fp4::{Fp4Kind, FP4_FACTOR_BYTES, FP4_LUT_OFFSET};
use crate::group::{check_group_size, Bits, QuantError, QuantizedMatrix};
use crate::kquant::KQuant;

/// Rows per row block.
pub const ROW_BLOCK: usize = 16;
/// Bytes of one weight chunk (one zmm).
pub const CHUNK: usize = 64;
/// Bytes of one group's scales (16 f16).
pub const GROUP_SCALE_BYTES: usize = ROW_BLOCK * 2;

/// Geometry of a packed matrix.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PackedLayout {
    /// Logical rows (outputs).
    pub rows: usize,
    /// `rows` rounded up to a multiple of [`ROW_BLOCK`].
    pub rows_padded: usize,
    pub k: usize,
    pub gs: usize,
    /// `Int4` for the FP4 formats too (their codes are 4 bits wide, packed as INT4's).
    pub bits: Bits,
    /// `Some` for the 4-bit float formats (E2M1 codes, one-byte scales, row factors; see
    /// [`crate::fp4`]); `None` for the integer formats. A kernel that reads `bits` alone must
    /// refuse a layout with this set.
    pub fp4: Option<Fp4Kind>,
    /// Asymmetric INT4 in groups of 32 (codes 0..=15, an f16 scale and an f16 minimum per group;
    /// see [`crate::int4_asym`]). A kernel that reads `bits` alone must refuse a layout with
    /// this set.
    pub asym: bool,
    /// llama.cpp's Q4_K or Q6_K kept as stored (super-blocks of 256, a group of 32 or 16 per
    /// scale; see [`crate::kquant`]). `bits` is `Int4` for Q4_K and `Int8` for Q6_K (the width a
    /// requantisation keeps); a kernel that reads `bits` alone must refuse a layout with this set.
    pub kq: Option<KQuant>,
}

impl PackedLayout {
    pub fn new(rows: usize, k: usize, gs: usize, bits: Bits) -> Result<PackedLayout, QuantError> {
        check_group_size(k, gs)?;
        Ok(PackedLayout {
            rows,
            rows_padded: rows.div_ceil(ROW_BLOCK) * ROW_BLOCK,
            k,
            gs,
            bits,
            fp4: None,
            asym: false,
            kq: None,
        })
    }

    /// The layout of a `[rows, k]` matrix in the FP4 format `kind` (its group: 32 or 16). `k`
    /// must be a positive multiple of 32.
    pub fn new_fp4(rows: usize, k: usize, kind: Fp4Kind) -> Result<PackedLayout, QuantError> {
        if k == 0 || !k.is_multiple_of(32) {
            return Err(QuantError::KNotMultipleOf32 { k });
        }
        let rows_padded = rows.div_ceil(ROW_BLOCK) * ROW_BLOCK;
        Ok(PackedLayout {
            rows,
            rows_padded,
            k,
            gs: kind.group(),
            bits: Bits::Int4,
            fp4: Some(kind),
            asym: false,
            kq: None,
        })
    }

    /// The layout of a `[rows, k]` matrix in asymmetric INT4 g32 ([`crate::int4_asym`]). `k`
    /// must be a positive multiple of 32.
    pub fn new_int4_asym(rows: usize, k: usize) -> Result<PackedLayout, QuantError> {
        if k == 0 || !k.is_multiple_of(32) {
            return Err(QuantError::KNotMultipleOf32 { k });
        }
        let rows_padded = rows.div_ceil(ROW_BLOCK) * ROW_BLOCK;
        Ok(PackedLayout { rows, rows_padded, k, gs: 32, bits: Bits::Int4, fp4: None, asym: true, kq: None })
    }

    /// Whether this is the plain symmetric INT4/INT8 layout (neither FP4 nor asymmetric): the
    /// only one the AMX kernel, the BF16 prefill tiles and the GPU read.
    pub fn is_symmetric_int(&self) -> bool {
        self.fp4.is_none() && !self.asym && self.kq.is_none()
    }

    /// Whether the CPU's BF16 prefill tiles dequantise this layout into their panels: integer
    /// codes with f16 scales, symmetric or asymmetric, and FP4 (not K-quant blocks).
    pub fn has_bf16_panel(&self) -> bool {
        self.kq.is_none()
    }

    /// The layout [`pack`] gives `m`.
    pub fn of(m: &QuantizedMatrix) -> PackedLayout {
        PackedLayout::new(m.rows, m.k, m.gs, m.bits).expect("QuantizedMatrix with a valid group size")
    }

    pub fn groups(&self) -> usize {
        self.k / self.gs
    }

    pub fn row_blocks(&self) -> usize {
        self.rows_padded / ROW_BLOCK
    }

    /// Weight bytes of one group of one row block.
    pub fn group_weight_bytes(&self) -> usize {
        if let Some(kind) = self.kq {
            return kind.group_weight_bytes();
        }
        match self.bits {
            Bits::Int8 => ROW_BLOCK * self.gs,
            Bits::Int4 => ROW_BLOCK * self.gs / 2,
        }
    }

    /// Bytes of one group of one row block: its weights plus its scales (32 bytes of f16; FP4:
    /// 16 bytes).
    pub fn group_bytes(&self) -> usize {
        self.group_weight_bytes() + self.group_scale_bytes()
    }

    /// Bytes of one group's scales in the header: 16 f16, or 16 one-byte FP4 scales, or 16 f16
    /// scales and 16 f16 minimums (asymmetric INT4).
    #[inline]
    pub fn group_scale_bytes(&self) -> usize {
        if self.fp4.is_some() {
            ROW_BLOCK
        } else if self.asym {
            4 * ROW_BLOCK
        } else {
            GROUP_SCALE_BYTES
        }
    }

    /// Bytes of a row block's header: all groups' scales, padded to 64 (FP4: after the 64 bytes
    /// of row factors).
    pub fn header_bytes(&self) -> usize {
        if self.kq.is_some() {
            return self.k / crate::ggml::QK_K * crate::kquant::SB_HEADER_BYTES;
        }
        let factors = if self.fp4.is_some() { FP4_FACTOR_BYTES } else { 0 };
        factors + (self.groups() * self.group_scale_bytes()).div_ceil(CHUNK) * CHUNK
    }

    /// Offset of group `g`'s 16 scales inside a row block (f16; FP4: one byte each, after the
    /// row factors; K-quants: the header of the group's super-block).
    #[inline]
    pub fn scales_offset(&self, g: usize) -> usize {
        if let Some(kind) = self.kq {
            return crate::kquant::sb_header_offset(g / kind.groups_per_sb());
        }
        if self.fp4.is_some() {
            FP4_FACTOR_BYTES + g * ROW_BLOCK
        } else {
            g * self.group_scale_bytes()
        }
    }

    /// Offset of group `g`'s 16 f16 minimums inside a row block (asymmetric INT4 only).
    #[inline]
    pub fn mins_offset(&self, g: usize) -> usize {
        debug_assert!(self.asym, "mins_offset of a layout without minimums");
        self.scales_offset(g) + GROUP_SCALE_BYTES
    }

    /// Offset of group `g`'s weights inside a row block.
    #[inline]
    pub fn weights_offset(&self, g: usize) -> usize {
        self.header_bytes() + g * self.group_weight_bytes()
    }

    pub fn block_bytes(&self) -> usize {
        self.header_bytes() + self.groups() * self.group_weight_bytes()
    }

    /// Total bytes of the packed matrix.
    pub fn bytes(&self) -> usize {
        self.row_blocks() * self.block_bytes()
    }

    /// Byte range of row block `rb`.
    pub fn block_range(&self, rb: usize) -> std::ops::Range<usize> {
        rb * self.block_bytes()..(rb + 1) * self.block_bytes()
    }

    /// The value a stored weight is offset by (128 for INT8, 8 for INT4; FP4: 12, the offset of
    /// the kernels' code table [`crate::fp4::E2M1_X2_BIASED`]; asymmetric INT4: 0, its codes
    /// are unsigned as they are; K-quants: [`KQuant::offset`]).
    pub fn offset(&self) -> i32 {
        if self.fp4.is_some() {
            return FP4_LUT_OFFSET;
        }
        if self.asym {
            return 0;
        }
        if let Some(kind) = self.kq {
            return kind.offset();
        }
        match self.bits {
            Bits::Int8 => 128,
            Bits::Int4 => 8,
        }
    }
}

/// Pack `m` into a new buffer (see the module docs for the layout).
pub fn pack(m: &QuantizedMatrix) -> Vec<u8> {
    let layout = PackedLayout::of(m);
    let mut out = vec![0u8; layout.bytes()];
    pack_into(m, &mut out).expect("buffer sized from the layout");
    out
}

/// Pack `m` into `out`, which must be exactly `PackedLayout::of(m).bytes()` long.
pub fn pack_into(m: &QuantizedMatrix, out: &mut [u8]) -> Result<PackedLayout, QuantError> {
    let layout = PackedLayout::new(m.rows, m.k, m.gs, m.bits)?;
    if out.len() != layout.bytes() {
        return Err(QuantError::BufferLen { found: out.len(), expected: layout.bytes() });
    }
    let bb = layout.block_bytes();
    for (rb, dst) in out.chunks_exact_mut(bb).enumerate() {
        pack_block(m, rb, &layout, dst);
    }
    Ok(layout)
}

/// Write row block `rb` of `m` (rows `16·rb ..`, zero rows past `m.rows`) into `dst`.
fn pack_block(m: &QuantizedMatrix, rb: usize, layout: &PackedLayout, dst: &mut [u8]) {
    let ng = layout.groups();
    let gs = layout.gs;
    let gwb = layout.group_weight_bytes();
    dst[..layout.header_bytes()].fill(0);
    for j in 0..ROW_BLOCK {
        let r = rb * ROW_BLOCK + j;
        let real = r < m.rows;
        for g in 0..ng {
            let s = if real { m.scales[r * ng + g] } else { f16::ZERO };
            let so = layout.scales_offset(g) + 2 * j;
            dst[so..so + 2].copy_from_slice(&s.to_bits().to_le_bytes());
            let w = &mut dst[layout.weights_offset(g)..layout.weights_offset(g) + gwb];
            let qg: &[i8] = if real { &m.q[r * m.k + g * gs..r * m.k + (g + 1) * gs] } else { &[] };
            let qv = |kk: usize| -> i32 {
                if real {
                    qg[kk] as i32
                } else {
                    0
                }
            };
            match layout.bits {
                Bits::Int8 => {
                    for c in 0..gs / 4 {
                        for b in 0..4 {
                            w[c * CHUNK + 4 * j + b] = (qv(4 * c + b) + 128) as u8;
                        }
                    }
                }
                Bits::Int4 => {
                    for c in 0..gs / 8 {
                        for b in 0..4 {
                            let lo = (qv(8 * c + b) + 8) as u8;
                            let hi = (qv(8 * c + 4 + b) + 8) as u8;
                            w[c * CHUNK + 4 * j + b] = (lo & 0x0f) | (hi << 4);
                        }
                    }
                }
            }
        }
    }
}

/// Read row block `rb` of a packed matrix back into `m` (rows past `m.rows` are ignored).
fn unpack_block(src: &[u8], rb: usize, layout: &PackedLayout, m: &mut QuantizedMatrix) {
    let ng = layout.groups();
    let gs = layout.gs;
    let gwb = layout.group_weight_bytes();
    for j in 0..ROW_BLOCK {
        let r = rb * ROW_BLOCK + j;
        if r >= m.rows {
            break;
        }
        for g in 0..ng {
            let so = layout.scales_offset(g) + 2 * j;
            m.scales[r * ng + g] = f16::from_bits(u16::from_le_bytes([src[so], src[so + 1]]));
            let w = &src[layout.weights_offset(g)..layout.weights_offset(g) + gwb];
            let qg = &mut m.q[r * m.k + g * gs..r * m.k + (g + 1) * gs];
            match layout.bits {
                Bits::Int8 => {
                    for c in 0..gs / 4 {
                        for b in 0..4 {
                            qg[4 * c + b] = (w[c * CHUNK + 4 * j + b] as i32 - 128) as i8;
                        }
                    }
                }
                Bits::Int4 => {
                    for c in 0..gs / 8 {
                        for b in 0..4 {
                            let byte = w[c * CHUNK + 4 * j + b];
                            qg[8 * c + b] = ((byte & 0x0f) as i32 - 8) as i8;
                            qg[8 * c + 4 + b] = ((byte >> 4) as i32 - 8) as i8;
                        }
                    }
                }
            }
        }
    }
}

fn empty_matrix(rows: usize, layout: &PackedLayout) -> QuantizedMatrix {
    QuantizedMatrix {
        rows,
        k: layout.k,
        gs: layout.gs,
        bits: layout.bits,
        q: vec![0; rows * layout.k],
        scales: vec![f16::ZERO; rows * layout.groups()],
    }
}

/// The exact inverse of [`pack`]: padding rows are dropped.
pub fn unpack(src: &[u8], layout: &PackedLayout) -> Result<QuantizedMatrix, QuantError> {
    if src.len() < layout.bytes() {
        return Err(QuantError::BufferLen { found: src.len(), expected: layout.bytes() });
    }
    let mut m = empty_matrix(layout.rows, layout);
    for rb in 0..layout.row_blocks() {
        unpack_block(&src[layout.block_range(rb)], rb, layout, &mut m);
    }
    Ok(m)
}

/// Layout of the fused w13 of `gate` and `up` (checks that they fit together).
pub fn w13_layout(gate: &QuantizedMatrix, up: &QuantizedMatrix) -> Result<PackedLayout, QuantError> {
    if (gate.rows, gate.k, gate.gs, gate.bits) != (up.rows, up.k, up.gs, up.bits) {
        return Err(QuantError::W13Mismatch {
            gate_rows: gate.rows,
            gate_k: gate.k,
            gate_bits: gate.bits,
            gate_gs: gate.gs,
            up_rows: up.rows,
            up_k: up.k,
            up_bits: up.bits,
            up_gs: up.gs,
        });
    }
    if !gate.rows.is_multiple_of(ROW_BLOCK) {
        return Err(QuantError::W13Rows { rows: gate.rows });
    }
    PackedLayout::new(2 * gate.rows, gate.k, gate.gs, gate.bits)
}

/// Fused gate+up: row blocks interleaved `[gate rb0][up rb0][gate rb1][up rb1]…`.
pub fn pack_w13(gate: &QuantizedMatrix, up: &QuantizedMatrix) -> Result<(Vec<u8>, PackedLayout), QuantError> {
    let layout = w13_layout(gate, up)?;
    let mut out = vec![0u8; layout.bytes()];
    pack_w13_into(gate, up, &mut out)?;
    Ok((out, layout))
}

/// [`pack_w13`] into a caller's buffer of exactly `w13_layout(gate, up)?.bytes()` bytes.
pub fn pack_w13_into(gate: &QuantizedMatrix, up: &QuantizedMatrix, out: &mut [u8]) -> Result<PackedLayout, QuantError> {
    let layout = w13_layout(gate, up)?;
    if out.len() != layout.bytes() {
        return Err(QuantError::BufferLen { found: out.len(), expected: layout.bytes() });
    }
    let half = PackedLayout::of(gate);
    let bb = layout.block_bytes();
    for (i, dst) in out.chunks_exact_mut(bb).enumerate() {
        let src = if i % 2 == 0 { gate } else { up };
        pack_block(src, i / 2, &half, dst);
    }
    Ok(layout)
}

/// The inverse of [`pack_w13`]: `(gate, up)`.
pub fn unpack_w13(src: &[u8], layout: &PackedLayout) -> Result<(QuantizedMatrix, QuantizedMatrix), QuantError> {
    if !layout.rows.is_multiple_of(2 * ROW_BLOCK) {
        return Err(QuantError::W13Rows { rows: layout.rows / 2 });
    }
    if src.len() < layout.bytes() {
        return Err(QuantError::BufferLen { found: src.len(), expected: layout.bytes() });
    }
    let inter = layout.rows / 2;
    let half = PackedLayout::new(inter, layout.k, layout.gs, layout.bits)?;
    let mut gate = empty_matrix(inter, &half);
    let mut up = empty_matrix(inter, &half);
    for i in 0..layout.row_blocks() {
        let dst = if i % 2 == 0 { &mut gate } else { &mut up };
        unpack_block(&src[layout.block_range(i)], i / 2, &half, dst);
    }
    Ok((gate, up))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::group::{dequantize, quantize};
    use proptest::prelude::*;

    fn data(n: usize, seed: u64) -> Vec<f32> {
        crate::group::test_data(n, seed, 1.0)
    }

    /// A random matrix that uses the full integer range, incl. ±qmax and 0.
    fn random_q(rows: usize, k: usize, gs: usize, bits: Bits, seed: u64) -> QuantizedMatrix {
        let mut w = data(rows * k, seed);
        for (i, v) in w.iter_mut().enumerate() {
            if i % 11 == 3 {
                *v = 0.0;
            }
        }
        quantize(&w, rows, k, bits, gs)
    }

    #[test]
    fn sizes_and_alignment() {
        let l = PackedLayout::new(2048, 1408, 128, Bits::Int4).unwrap();
        assert_eq!(l.row_blocks(), 128);
        assert_eq!(l.group_weight_bytes(), 1024);
        assert_eq!(l.header_bytes(), 384); // 11 groups · 32 = 352 → 384
        assert_eq!(l.block_bytes(), 384 + 11 * 1024);
        assert_eq!(l.bytes() % CHUNK, 0);
        let l = PackedLayout::new(17, 96, 32, Bits::Int8).unwrap();
        assert_eq!(l.rows_padded, 32);
        assert_eq!(l.group_weight_bytes(), 512);
        assert_eq!(l.block_bytes(), 128 + 3 * 512);
        assert!(PackedLayout::new(16, 100, 32, Bits::Int8).is_err());
        assert!(PackedLayout::new(16, 96, 64, Bits::Int8).is_err());
    }

    #[test]
    fn byte_positions_match_spec() {
        // One row block, one group of 32: check a few bytes by hand.
        let mut m = random_q(16, 32, 32, Bits::Int8, 5);
        m.q[3 * 32 + 6] = -127; // row 3, k 6 → chunk 1, byte 4·3 + 2
        let p = pack(&m);
        let l = PackedLayout::of(&m);
        assert_eq!(p[l.weights_offset(0) + 64 + 14], 1);
        assert_eq!(&p[6..8], &m.scales[3].to_bits().to_le_bytes());
        let mut m = random_q(16, 32, 32, Bits::Int4, 6);
        m.q[5 * 32 + 13] = 7; // row 5, k 13 → chunk 1 (k 8..16), k0+4+1 → high nibble of byte 4·5 + 1
        m.q[5 * 32 + 9] = -7; // k0 + 1 → low nibble of the same byte
        let p = pack(&m);
        assert_eq!(p[l.weights_offset(0) + 64 + 21], 0xf1);
    }

    #[test]
    fn w13_rejects_mismatch_and_ragged() {
        let g = random_q(32, 64, 32, Bits::Int4, 1);
        let u = random_q(32, 64, 32, Bits::Int8, 2);
        assert!(matches!(pack_w13(&g, &u), Err(QuantError::W13Mismatch { .. })));
        let g = random_q(24, 64, 32, Bits::Int4, 1);
        assert_eq!(pack_w13(&g, &g).unwrap_err(), QuantError::W13Rows { rows: 24 });
    }

    #[test]
    fn buffer_len_checked() {
        let m = random_q(5, 64, 32, Bits::Int4, 1);
        let l = PackedLayout::of(&m);
        let mut buf = vec![0u8; l.bytes() + 1];
        assert!(matches!(pack_into(&m, &mut buf), Err(QuantError::BufferLen { .. })));
        assert!(matches!(unpack(&buf[..l.bytes() - 1], &l), Err(QuantError::BufferLen { .. })));
    }

    proptest! {
        #[test]
        fn pack_unpack_round_trip(
            rows in prop::sample::select(vec![1usize, 5, 16, 17, 31, 33, 48, 64]),
            k in prop::sample::select(vec![32usize, 64, 96, 160, 256, 2048]),
            int8 in any::<bool>(),
            gpref in prop::sample::select(vec![32usize, 64, 128]),
            seed in any::<u64>(),
        ) {
            let bits = if int8 { Bits::Int8 } else { Bits::Int4 };
            let gs = crate::group::group_size_for(k, gpref).unwrap();
            let m = random_q(rows, k, gs, bits, seed);
            let p = pack(&m);
            let l = PackedLayout::of(&m);
            prop_assert_eq!(p.len(), l.bytes());
            // Padding rows are zero rows: q = 0 stored as the offset, scale 0.
            if l.rows_padded > rows {
                let last = &p[l.block_range(l.row_blocks() - 1)];
                for j in rows % ROW_BLOCK..ROW_BLOCK {
                    for g in 0..l.groups() {
                        let so = l.scales_offset(g) + 2 * j;
                        prop_assert_eq!(&last[so..so + 2], &[0u8, 0]);
                    }
                    let b = last[l.weights_offset(0) + 4 * j];
                    prop_assert_eq!(b, if int8 { 128 } else { 0x88 });
                }
            }
            let back = unpack(&p, &l).unwrap();
            prop_assert_eq!(&back, &m);
            prop_assert_eq!(dequantize(&back), dequantize(&m));
        }

        #[test]
        fn w13_round_trip(
            blocks in 1usize..5,
            k in prop::sample::select(vec![32usize, 96, 160, 256]),
            int8 in any::<bool>(),
            seed in any::<u64>(),
        ) {
            let bits = if int8 { Bits::Int8 } else { Bits::Int4 };
            let gs = crate::group::group_size_for(k, 128).unwrap();
            let rows = blocks * ROW_BLOCK;
            let g = random_q(rows, k, gs, bits, seed);
            let u = random_q(rows, k, gs, bits, seed ^ 77);
            let (p, l) = pack_w13(&g, &u).unwrap();
            prop_assert_eq!(l.rows, 2 * rows);
            prop_assert_eq!(p.len(), l.bytes());
            // Block 2b is gate block b, block 2b+1 is up block b.
            let pg = pack(&g);
            let pu = pack(&u);
            let hl = PackedLayout::of(&g);
            for b in 0..blocks {
                prop_assert_eq!(&p[l.block_range(2 * b)], &pg[hl.block_range(b)]);
                prop_assert_eq!(&p[l.block_range(2 * b + 1)], &pu[hl.block_range(b)]);
            }
            let (g2, u2) = unpack_w13(&p, &l).unwrap();
            prop_assert_eq!(g2, g);
            prop_assert_eq!(u2, u);
        }
    }
}
