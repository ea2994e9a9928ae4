//! Asymmetric INT4 in groups of 32 ("INT4a"): codes `q` in 0..=15 with one scale `d` and one
//! minimum `m` per group of 32 along K, both f16: `w = d · q + m`. 5.0 bits per weight
//! (4 + 2 · 16 / 32). A block is byte for byte llama.cpp's `block_q4_1` ([`BlockInt4Asym`]).
//!
//! **Quantisation** ([`quantize`]; the rule of `scripts/trained-weights.py`'s `asym`, whose ideal
//! the trained-weights test compares against): per group, `m` = the group's minimum rounded to the
//! nearest f16; `d` = the smallest f16 ≥ `(max − m) / 15` (so the group's maximum is reached
//! without clipping), at least [`MIN_SCALE`] when the range is nonzero; `q = clamp(⌊(w − m) / d +
//! ½⌋, 0, 15)` in f64 (0 when `d` is 0: a constant group is `m` exactly). An error-minimising
//! search (llama.cpp's `make_qkx`) is not used: on the trained model the min/max rule is already
//! within 0.2 % of the unquantised perplexity (docs/BENCHMARKS.md, "Trained weights").
//!
//! **CPU layout** ([`PackedLayout::new_int4_asym`]): the row blocks of 16 rows of
//! [`crate::cpu_layout`], the codes in INT4's chunk order as they are (no `+8` offset: they are
//! already unsigned, which `vpdpbusd` takes), and a header of 64 bytes per group: the 16 rows' f16
//! scales, then their 16 f16 minimums. Padding rows are zero (scale 0, minimum 0, code 0).
//!
//! The matmul with INT8 activations `x ≈ s_x · x_q` per group is then, per (row, group),
//! `Σ x·w = (d · s_x) · Σ x_q·q + (m · s_x) · Σ x_q`: both integer sums exact (`Σ x_q` is the
//! activation group sum the symmetric kernels already compute for their offset), two fmas per
//! group.

use bytemuck::{Pod, Zeroable};
use half::f16;

use crate::cpu_layout::{PackedLayout, CHUNK, ROW_BLOCK};
use crate::group::{QuantError, MIN_SCALE};

/// Codes per scale and minimum.
pub const ASYM_GROUP: usize = 32;

/// Header bytes of one group of a row block: 16 f16 scales, then 16 f16 minimums.
pub const ASYM_GROUP_HEADER_BYTES: usize = 4 * ROW_BLOCK;

/// One group of 32 weights: f16 scale `d` and minimum `m` (bits, little-endian as stored), and
/// the codes, element `i` in the low nibble of `qs[i]` and element `i + 16` in its high nibble
/// (llama.cpp's `block_q4_1`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct BlockInt4Asym {
    pub d: u16,
    pub m: u16,
    pub qs: [u8; 16],
}

const _: () = assert!(std::mem::size_of::<BlockInt4Asym>() == 20);

impl BlockInt4Asym {
    /// Code of element `i` (0..32).
    #[inline]
    pub fn code(&self, i: usize) -> u8 {
        (self.qs[i % 16] >> (4 * (i / 16))) & 0xf
    }

    pub fn scale(&self) -> f16 {
        f16::from_bits(self.d)
    }

    pub fn min(&self) -> f16 {
        f16::from_bits(self.m)
    }
}

/// A `[rows, k]` matrix in asymmetric INT4 g32: `rows · k / 32` blocks, row-major by (row, group).
#[derive(Clone, Debug, PartialEq)]
pub struct AsymMatrix {
    pub rows: usize,
    pub k: usize,
    pub blocks: Vec<BlockInt4Asym>,
}

impl AsymMatrix {
    pub fn groups(&self) -> usize {
        self.k / ASYM_GROUP
    }

    pub fn block(&self, r: usize, g: usize) -> &BlockInt4Asym {
        &self.blocks[r * self.groups() + g]
    }

    /// Code of (row `r`, column `c`).
    pub fn code(&self, r: usize, c: usize) -> u8 {
        self.block(r, c / ASYM_GROUP).code(c % ASYM_GROUP)
    }

    /// `d · q + m` of every weight in f64 (exact: f16 products and sums fit f64's significand).
    pub fn dequantize_f64(&self) -> Vec<f64> {
        let mut out = Vec::with_capacity(self.rows * self.k);
        for b in &self.blocks {
            let (d, m) = (b.scale().to_f64(), b.min().to_f64());
            out.extend((0..ASYM_GROUP).map(|i| b.code(i) as f64 * d + m));
        }
        out
    }

    /// [`AsymMatrix::dequantize_f64`] rounded to f32.
    pub fn dequantize(&self) -> Vec<f32> {
        self.dequantize_f64().into_iter().map(|v| v as f32).collect()
    }
}

/// The smallest f16 ≥ `t` (`t` ≥ 0, finite), saturating at `f16::MAX`.
fn f16_up(t: f64) -> f16 {
    let mut h = f16::from_f64(t);
    if h.is_infinite() || h.to_f64() > f16::MAX.to_f64() {
        return f16::MAX;
    }
    if h.to_f64() < t {
        h = f16::from_bits(h.to_bits() + 1);
        if h.is_infinite() {
            return f16::MAX;
        }
    }
    h
}

/// One group's block by the module's rule.
pub fn quantize_group(w: &[f32]) -> BlockInt4Asym {
    debug_assert_eq!(w.len(), ASYM_GROUP);
    let (lo, hi) = w.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &v| (a.min(v as f64), b.max(v as f64)));
    if !lo.is_finite() || !hi.is_finite() {
        // NaN or infinite weights: keep the group as zeros (a NaN never reaches the kernels).
        return BlockInt4Asym::default();
    }
    let m = f16::from_f64(lo);
    let m = if m.is_infinite() {
        if lo < 0.0 {
            f16::MIN
        } else {
            f16::MAX
        }
    } else {
        m
    };
    let mf = m.to_f64();
    let range = (hi - mf) / 15.0;
    let d = if range > 0.0 { f16_up(range).max(MIN_SCALE) } else { f16::ZERO };
    let df = d.to_f64();
    let mut qs = [0u8; 16];
    if df > 0.0 {
        for (i, &v) in w.iter().enumerate() {
            let q = ((v as f64 - mf) / df + 0.5).floor().clamp(0.0, 15.0) as u8;
            qs[i % 16] |= q << (4 * (i / 16));
        }
    }
    BlockInt4Asym { d: d.to_bits(), m: m.to_bits(), qs }
}

/// Quantise `w[rows, k]` (row-major) in groups of 32 along K (see the module docs).
pub fn quantize(w: &[f32], rows: usize, k: usize) -> Result<AsymMatrix, QuantError> {
    if k == 0 || !k.is_multiple_of(ASYM_GROUP) {
        return Err(QuantError::KNotMultipleOf32 { k });
    }
    assert_eq!(w.len(), rows * k, "int4_asym::quantize: w has {} elements, expected {rows}×{k}", w.len());
    Ok(AsymMatrix { rows, k, blocks: w.chunks_exact(ASYM_GROUP).map(quantize_group).collect() })
}

/// The CPU layout of `m`.
pub fn layout_of(m: &AsymMatrix) -> PackedLayout {
    PackedLayout::new_int4_asym(m.rows, m.k).expect("AsymMatrix with K a multiple of 32")
}

/// `m` in the CPU layout (see the module docs).
pub fn pack(m: &AsymMatrix) -> Vec<u8> {
    let l = layout_of(m);
    let mut out = vec![0u8; l.bytes()];
    pack_into(m, &mut out).expect("buffer sized from the layout");
    out
}

/// [`pack`] into `out`, exactly `layout_of(m).bytes()` long.
pub fn pack_into(m: &AsymMatrix, out: &mut [u8]) -> Result<PackedLayout, QuantError> {
    let l = PackedLayout::new_int4_asym(m.rows, m.k)?;
    if out.len() != l.bytes() {
        return Err(QuantError::BufferLen { found: out.len(), expected: l.bytes() });
    }
    for (rb, dst) in out.chunks_exact_mut(l.block_bytes()).enumerate() {
        pack_block(m, rb, &l, dst);
    }
    Ok(l)
}

/// Row block `rb` of `m` into `dst` (rows past `m.rows` are zero).
fn pack_block(m: &AsymMatrix, rb: usize, l: &PackedLayout, dst: &mut [u8]) {
    let (ng, gwb) = (l.groups(), l.group_weight_bytes());
    dst.fill(0);
    for j in 0..ROW_BLOCK {
        let r = rb * ROW_BLOCK + j;
        if r >= m.rows {
            break;
        }
        for g in 0..ng {
            let b = m.block(r, g);
            let (so, mo) = (l.scales_offset(g) + 2 * j, l.mins_offset(g) + 2 * j);
            dst[so..so + 2].copy_from_slice(&b.d.to_le_bytes());
            dst[mo..mo + 2].copy_from_slice(&b.m.to_le_bytes());
            let w = &mut dst[l.weights_offset(g)..l.weights_offset(g) + gwb];
            for c in 0..ASYM_GROUP / 8 {
                for bb in 0..4 {
                    w[c * CHUNK + 4 * j + bb] = b.code(8 * c + bb) | (b.code(8 * c + 4 + bb) << 4);
                }
            }
        }
    }
}

/// The inverse of [`pack`] (padding rows dropped). `l` must be an asymmetric INT4 layout.
pub fn unpack(src: &[u8], l: &PackedLayout) -> Result<AsymMatrix, QuantError> {
    assert!(l.asym, "int4_asym::unpack: layout {l:?} is not asymmetric INT4");
    if src.len() < l.bytes() {
        return Err(QuantError::BufferLen { found: src.len(), expected: l.bytes() });
    }
    let (ng, gwb) = (l.groups(), l.group_weight_bytes());
    let mut blocks = vec![BlockInt4Asym::default(); l.rows * ng];
    for r in 0..l.rows {
        let blk = &src[l.block_range(r / ROW_BLOCK)];
        let j = r % ROW_BLOCK;
        for g in 0..ng {
            let out = &mut blocks[r * ng + g];
            let (so, mo) = (l.scales_offset(g) + 2 * j, l.mins_offset(g) + 2 * j);
            out.d = u16::from_le_bytes([blk[so], blk[so + 1]]);
            out.m = u16::from_le_bytes([blk[mo], blk[mo + 1]]);
            let w = &blk[l.weights_offset(g)..l.weights_offset(g) + gwb];
            for c in 0..ASYM_GROUP / 8 {
                for bb in 0..4 {
                    let byte = w[c * CHUNK + 4 * j + bb];
                    for (i, code) in [(8 * c + bb, byte & 0xf), (8 * c + 4 + bb, byte >> 4)] {
                        out.qs[i % 16] |= code << (4 * (i / 16));
                    }
                }
            }
        }
    }
    Ok(AsymMatrix { rows: l.rows, k: l.k, blocks })
}

/// The layout of the fused w13 of `gate` and `up` (equal shapes, rows a multiple of 16).
pub fn w13_layout(gate: &AsymMatrix, up: &AsymMatrix) -> Result<PackedLayout, QuantError> {
    if (gate.rows, gate.k) != (up.rows, up.k) {
        return Err(QuantError::W13Mismatch {
            gate_rows: gate.rows,
            gate_k: gate.k,
            gate_bits: crate::Bits::Int4,
            gate_gs: ASYM_GROUP,
            up_rows: up.rows,
            up_k: up.k,
            up_bits: crate::Bits::Int4,
            up_gs: ASYM_GROUP,
        });
    }
    if !gate.rows.is_multiple_of(ROW_BLOCK) {
        return Err(QuantError::W13Rows { rows: gate.rows });
    }
    PackedLayout::new_int4_asym(2 * gate.rows, gate.k)
}

/// Fused gate+up as [`crate::cpu_layout::pack_w13`]: row blocks `[gate 0][up 0][gate 1]…`.
pub fn pack_w13_into(gate: &AsymMatrix, up: &AsymMatrix, out: &mut [u8]) -> Result<PackedLayout, QuantError> {
    let l = w13_layout(gate, up)?;
    if out.len() != l.bytes() {
        return Err(QuantError::BufferLen { found: out.len(), expected: l.bytes() });
    }
    let half = layout_of(gate);
    for (i, dst) in out.chunks_exact_mut(l.block_bytes()).enumerate() {
        pack_block(if i % 2 == 0 { gate } else { up }, i / 2, &half, dst);
    }
    Ok(l)
}

/// [`pack_w13_into`] into a new buffer.
pub fn pack_w13(gate: &AsymMatrix, up: &AsymMatrix) -> Result<(Vec<u8>, PackedLayout), QuantError> {
    let l = w13_layout(gate, up)?;
    let mut out = vec![0u8; l.bytes()];
    pack_w13_into(gate, up, &mut out)?;
    Ok((out, l))
}

/// The inverse of [`pack_w13_into`]: `(gate, up)`.
pub fn unpack_w13(src: &[u8], l: &PackedLayout) -> Result<(AsymMatrix, AsymMatrix), QuantError> {
    if src.len() < l.bytes() {
        return Err(QuantError::BufferLen { found: src.len(), expected: l.bytes() });
    }
    let half = PackedLayout::new_int4_asym(l.rows / 2, l.k)?;
    let mut parts = [Vec::new(), Vec::new()];
    for i in 0..l.row_blocks() {
        parts[i % 2].extend_from_slice(&src[l.block_range(i)]);
    }
    let [g, u] = parts;
    Ok((unpack(&g, &half)?, unpack(&u, &half)?))
}

/// Largest magnitude of an INT8 code of [`to_int8_g32`] (symmetric, as `crate::group`'s INT8).
const INT8_QMAX: f32 = 127.0;

/// The GPU's form of asymmetric INT4 ("4a" has no tensor-core kernel): each group of 32
/// requantised to symmetric INT8 with one f16 scale, the same group boundaries. Per (row, group):
/// `w = fma(q, d, m)` in f32 (the dequantised weight, as the BF16 prefill tiles compute it),
/// `s` = the smallest f16 ≥ `amax / 127` (f32 division; 0 for an all-zero group), `q8 =
/// round_half_even(w / s)` (f32 division) clamped to ±127. The device conversion
/// (`krasis-gpu/kernels/relayout.cu`, `relayout_int4a_int8`) computes exactly this, so its records
/// equal the host packer's of this matrix byte for byte. Each weight moves by at most `s / 2`,
/// ≈ `amax / 254`: an 8-bit rounding of the 4-bit grid, not a second 4-bit one.
pub fn to_int8_g32(m: &AsymMatrix) -> crate::QuantizedMatrix {
    let ng = m.groups();
    let mut q = vec![0i8; m.rows * m.k];
    let mut scales = vec![f16::ZERO; m.rows * ng];
    for (bi, b) in m.blocks.iter().enumerate() {
        let (d, mn) = (b.scale().to_f32(), b.min().to_f32());
        let w: [f32; ASYM_GROUP] = std::array::from_fn(|i| (b.code(i) as f32).mul_add(d, mn));
        let amax = w.iter().fold(0f32, |a, v| a.max(v.abs()));
        if amax == 0.0 || !amax.is_finite() {
            continue;
        }
        let s = f16_up((amax / INT8_QMAX) as f64);
        scales[bi] = s;
        let sf = s.to_f32();
        let (r, g) = (bi / ng, bi % ng);
        for (i, &v) in w.iter().enumerate() {
            q[r * m.k + g * ASYM_GROUP + i] = (v / sf).round_ties_even().clamp(-INT8_QMAX, INT8_QMAX) as i8;
        }
    }
    crate::QuantizedMatrix { rows: m.rows, k: m.k, gs: ASYM_GROUP, bits: crate::Bits::Int8, q, scales }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::group::test_data;
    use proptest::prelude::*;

    #[test]
    fn block_is_q4_1_sized_and_ordered() {
        let mut b = BlockInt4Asym::default();
        b.qs[3] = 0x5a;
        assert_eq!((b.code(3), b.code(19)), (0xa, 0x5));
        assert_eq!(bytemuck::bytes_of(&b).len(), 20);
    }

    #[test]
    fn rule_matches_the_study() {
        // min -1 (an f16), max 2: d = f16_up(3 / 15) = f16 ≥ 0.2; codes round half up.
        let mut w = vec![0.5f32; 32];
        w[0] = -1.0;
        w[1] = 2.0;
        let b = quantize_group(&w);
        assert_eq!(b.min().to_f32(), -1.0);
        let d = b.scale().to_f64();
        assert!((0.2..0.2 * (1.0 + 1.0 / 1024.0)).contains(&d));
        // (0.5 + 1) / 0.20007 = 7.497: code 7.
        assert_eq!((b.code(0), b.code(1), b.code(2)), (0, 15, 7));
    }

    #[test]
    fn constant_and_tiny_groups() {
        let b = quantize_group(&[0.25f32; 32]);
        assert_eq!((b.scale().to_f32(), b.min().to_f32(), b.code(5)), (0.0, 0.25, 0));
        let mut w = vec![0f32; 32];
        w[7] = 1e-9;
        let b = quantize_group(&w);
        assert_eq!(b.scale(), MIN_SCALE);
        assert!(quantize(&w, 1, 48).is_err());
    }

    #[test]
    fn sizes() {
        let l = PackedLayout::new_int4_asym(2048, 576).unwrap();
        assert_eq!(l.groups(), 18);
        assert_eq!(l.header_bytes(), 18 * 64);
        assert_eq!(l.block_bytes(), 18 * 64 + 18 * 256);
        // 5.0 bits per weight.
        assert_eq!(l.bytes() * 8, 2048 * 576 * 5);
        assert_eq!(l.offset(), 0);
        assert!(PackedLayout::new_int4_asym(16, 48).is_err());
    }

    proptest! {
        #[test]
        fn error_within_half_a_step_and_round_trip(
            rows in prop::sample::select(vec![1usize, 5, 16, 17, 33]),
            k in prop::sample::select(vec![32usize, 64, 96, 576]),
            amp in prop::sample::select(vec![1e-3f32, 1.0, 300.0]),
            seed in any::<u64>(),
        ) {
            let w = test_data(rows * k, seed, amp);
            let m = quantize(&w, rows, k).unwrap();
            let deq = m.dequantize_f64();
            for (i, (&v, &d)) in w.iter().zip(&deq).enumerate() {
                let b = m.block(i / k, (i % k) / ASYM_GROUP);
                let step = b.scale().to_f64();
                // Half a step, plus the minimum's f16 rounding when it lies above the true minimum.
                let err = (v as f64 - d).abs();
                prop_assert!(err <= 0.5 * step + (b.min().to_f64() * 2f64.powi(-11)).abs() + 1e-12,
                    "w {v} deq {d} step {step}");
            }
            let p = pack(&m);
            let l = layout_of(&m);
            prop_assert_eq!(p.len(), l.bytes());
            prop_assert_eq!(unpack(&p, &l).unwrap(), m.clone());
            if rows.is_multiple_of(16) {
                let u = quantize(&test_data(rows * k, seed ^ 5, amp), rows, k).unwrap();
                let (p13, l13) = pack_w13(&m, &u).unwrap();
                prop_assert_eq!(l13.rows, 2 * rows);
                let (g2, u2) = unpack_w13(&p13, &l13).unwrap();
                prop_assert_eq!(g2, m);
                prop_assert_eq!(u2, u);
            }
        }

        /// The GPU's INT8 g32 form of a 4a matrix: every weight within half its step of the
        /// dequantised value, the step the smallest f16 ≥ amax / 127, codes within ±127, all-zero
        /// groups scale 0.
        #[test]
        fn int8_form_within_half_an_int8_step(
            rows in prop::sample::select(vec![1usize, 3, 17]),
            k in prop::sample::select(vec![32usize, 96, 576]),
            amp in prop::sample::select(vec![1e-6f32, 1e-3, 1.0, 300.0]),
            zero_group in any::<bool>(),
            seed in any::<u64>(),
        ) {
            let mut w = test_data(rows * k, seed, amp);
            if zero_group {
                w[..ASYM_GROUP].fill(0.0);
            }
            let m = quantize(&w, rows, k).unwrap();
            let q8 = to_int8_g32(&m);
            prop_assert_eq!((q8.rows, q8.k, q8.gs, q8.bits), (rows, k, ASYM_GROUP, crate::Bits::Int8));
            let ng = m.groups();
            for r in 0..rows {
                for g in 0..ng {
                    let b = m.block(r, g);
                    let (d, mn) = (b.scale().to_f32(), b.min().to_f32());
                    let deq: Vec<f32> = (0..ASYM_GROUP).map(|i| (b.code(i) as f32).mul_add(d, mn)).collect();
                    let amax = deq.iter().fold(0f32, |a, v| a.max(v.abs()));
                    let s = q8.scale(r, g);
                    if amax == 0.0 {
                        prop_assert_eq!(s, 0.0);
                    } else {
                        // The smallest f16 at or above amax / 127.
                        let t = amax / 127.0;
                        prop_assert!(s >= t, "scale {s} below {t}");
                        let below = f16::from_bits(f16::from_f32(s).to_bits() - 1).to_f32();
                        prop_assert!(below < t, "scale {s} is not the smallest f16 ≥ {t}");
                    }
                    for (i, &v) in deq.iter().enumerate() {
                        let c = q8.q[r * k + g * ASYM_GROUP + i];
                        prop_assert!((-127..=127).contains(&c));
                        let err = (v as f64 - c as f64 * s as f64).abs();
                        prop_assert!(err <= 0.5 * s as f64 * (1.0 + 1e-6), "row {r} group {g}: {v} vs {c}·{s}");
                    }
                }
            }
        }
    }
}
