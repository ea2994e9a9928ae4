//! llama.cpp's (ggml's) tensor types as GGUF stores them, and their scalar dequantisers.
//!
//! Each block type is a `#[repr(C)]` struct of bytes (its f16 scales as `[u8; 2]`, so the struct has
//! alignment 1 and any byte slice of whole blocks casts to it with bytemuck), with its size checked
//! at compile time against ggml's. Dequantisation follows ggml's reference C code operation for
//! operation in f32, so the output is bit-identical to `dequantize_row_*` and to the `gguf` Python
//! package's dequantisers (the golden vectors in `tests/data/ggml/` say so).

use bytemuck::{Pod, Zeroable};
use krasis_core::dtype::{bf16_to_f32, f16_to_f32};

use crate::fp4::BlockMxfp4;

/// Elements per super-block of the K-quants (ggml's `QK_K`).
pub const QK_K: usize = 256;

/// ggml tensor types Krasis reads (ids as in `ggml.h` / the GGUF tensor-info `type` field).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    BF16,
    /// OCP MXFP4 as ggml stores it (gpt-oss): E2M1 codes with an E8M0 scale per 32.
    Mxfp4,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum GgmlError {
    #[error("ggml type id {0} is not supported (supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, MXFP4)")]
    UnknownType(u32),
    #[error("{ty}: {elements} elements is not a whole number of {block}-element blocks")]
    RaggedBlocks { ty: GgmlType, elements: usize, block: usize },
    #[error("{ty}: {found} bytes for {elements} elements, expected {expected}")]
    ByteLen { ty: GgmlType, elements: usize, found: usize, expected: usize },
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl GgmlType {
    /// The type with ggml id `id`, or [`GgmlError::UnknownType`].
    pub fn from_id(id: u32) -> Result<GgmlType, GgmlError> {
        Ok(match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            6 => GgmlType::Q5_0,
            7 => GgmlType::Q5_1,
            8 => GgmlType::Q8_0,
            10 => GgmlType::Q2K,
            11 => GgmlType::Q3K,
            12 => GgmlType::Q4K,
            13 => GgmlType::Q5K,
            14 => GgmlType::Q6K,
            30 => GgmlType::BF16,
            39 => GgmlType::Mxfp4,
            other => return Err(GgmlError::UnknownType(other)),
        })
    }

    /// ggml's id of the type.
    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q4_1 => 3,
            GgmlType::Q5_0 => 6,
            GgmlType::Q5_1 => 7,
            GgmlType::Q8_0 => 8,
            GgmlType::Q2K => 10,
            GgmlType::Q3K => 11,
            GgmlType::Q4K => 12,
            GgmlType::Q5K => 13,
            GgmlType::Q6K => 14,
            GgmlType::BF16 => 30,
            GgmlType::Mxfp4 => 39,
        }
    }

    /// ggml's name of the type (`Q4_K`, …).
    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q4_1 => "Q4_1",
            GgmlType::Q5_0 => "Q5_0",
            GgmlType::Q5_1 => "Q5_1",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Q2K => "Q2_K",
            GgmlType::Q3K => "Q3_K",
            GgmlType::Q4K => "Q4_K",
            GgmlType::Q5K => "Q5_K",
            GgmlType::Q6K => "Q6_K",
            GgmlType::BF16 => "BF16",
            GgmlType::Mxfp4 => "MXFP4",
        }
    }

    pub const ALL: [GgmlType; 14] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q2K,
        GgmlType::Q3K,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
        GgmlType::Mxfp4,
    ];

    /// Elements per block (1 for the float types).
    pub fn block_elems(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => 1,
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q8_0 | GgmlType::Mxfp4 => 32,
            GgmlType::Q2K | GgmlType::Q3K | GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K => QK_K,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        use std::mem::size_of;
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::BF16 => 2,
            GgmlType::Q4_0 => size_of::<BlockQ4_0>(),
            GgmlType::Q4_1 => size_of::<BlockQ4_1>(),
            GgmlType::Q5_0 => size_of::<BlockQ5_0>(),
            GgmlType::Q5_1 => size_of::<BlockQ5_1>(),
            GgmlType::Q8_0 => size_of::<BlockQ8_0>(),
            GgmlType::Q2K => size_of::<BlockQ2K>(),
            GgmlType::Q3K => size_of::<BlockQ3K>(),
            GgmlType::Q4K => size_of::<BlockQ4K>(),
            GgmlType::Q5K => size_of::<BlockQ5K>(),
            GgmlType::Q6K => size_of::<BlockQ6K>(),
            GgmlType::Mxfp4 => size_of::<BlockMxfp4>(),
        }
    }

    /// Bits of precision of one weight's code: what a requantisation should keep (4-bit sources
    /// go to INT4, 5-bit and wider to INT8). Float types report their mantissa-ish width (16/32).
    pub fn code_bits(self) -> u32 {
        match self {
            GgmlType::F32 => 32,
            GgmlType::F16 | GgmlType::BF16 => 16,
            GgmlType::Q2K => 2,
            GgmlType::Q3K => 3,
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q4K | GgmlType::Mxfp4 => 4,
            GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q5K => 5,
            GgmlType::Q6K => 6,
            GgmlType::Q8_0 => 8,
        }
    }

    /// Bytes that `elements` elements take, or an error when they are not whole blocks (or the
    /// count overflows, reported the same way).
    pub fn bytes_for(self, elements: usize) -> Result<usize, GgmlError> {
        let block = self.block_elems();
        if !elements.is_multiple_of(block) {
            return Err(GgmlError::RaggedBlocks { ty: self, elements, block });
        }
        (elements / block).checked_mul(self.block_bytes()).ok_or(GgmlError::RaggedBlocks { ty: self, elements, block })
    }
}

// ---- block layouts (ggml-common.h) ----

/// 32 weights: `d · (q − 8)`, q 4 bits.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub struct BlockQ4_0 {
    pub d: [u8; 2],
    pub qs: [u8; 16],
}

/// 32 weights: `d · q + m`, q 4 bits.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub struct BlockQ4_1 {
    pub d: [u8; 2],
    pub m: [u8; 2],
    pub qs: [u8; 16],
}

/// 32 weights: `d · (q − 16)`, q 5 bits (low nibbles in `qs`, fifth bits in `qh`).
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub struct BlockQ5_0 {
    pub d: [u8; 2],
    pub qh: [u8; 4],
    pub qs: [u8; 16],
}

/// 32 weights: `d · q + m`, q 5 bits.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub struct BlockQ5_1 {
    pub d: [u8; 2],
    pub m: [u8; 2],
    pub qh: [u8; 4],
    pub qs: [u8; 16],
}

/// 32 weights: `d · q`, q signed 8 bits.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub struct BlockQ8_0 {
    pub d: [u8; 2],
    pub qs: [i8; 32],
}

/// 256 weights in 16 groups of 16: `d · sc · q − dmin · m`, q 2 bits, 4-bit sc and m.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub struct BlockQ2K {
    pub scales: [u8; 16],
    pub qs: [u8; 64],
    pub d: [u8; 2],
    pub dmin: [u8; 2],
}

/// 256 weights in 16 groups of 16: `d · (sc − 32) · (q − 4·!hbit)`, q 2 low bits + 1 high bit,
/// 6-bit scales packed in 12 bytes.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub struct BlockQ3K {
    pub hmask: [u8; 32],
    pub qs: [u8; 64],
    pub scales: [u8; 12],
    pub d: [u8; 2],
}

/// 256 weights in 8 groups of 32: `d · sc · q − dmin · m`, q 4 bits, 6-bit sc and m.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub struct BlockQ4K {
    pub d: [u8; 2],
    pub dmin: [u8; 2],
    pub scales: [u8; 12],
    pub qs: [u8; 128],
}

/// 256 weights in 8 groups of 32: as Q4_K with a fifth bit per weight in `qh`.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub struct BlockQ5K {
    pub d: [u8; 2],
    pub dmin: [u8; 2],
    pub scales: [u8; 12],
    pub qh: [u8; 32],
    pub qs: [u8; 128],
}

/// 256 weights in 16 groups of 16: `d · sc · (q − 32)`, q 6 bits (4 in `ql`, 2 in `qh`), sc i8.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub struct BlockQ6K {
    pub ql: [u8; 128],
    pub qh: [u8; 64],
    pub scales: [i8; 16],
    pub d: [u8; 2],
}

// ggml's sizes (ggml-common.h static_asserts): a layout slip is a compile error, not a wrong weight.
const _: () = assert!(std::mem::size_of::<BlockQ4_0>() == 18);
const _: () = assert!(std::mem::size_of::<BlockQ4_1>() == 20);
const _: () = assert!(std::mem::size_of::<BlockQ5_0>() == 22);
const _: () = assert!(std::mem::size_of::<BlockQ5_1>() == 24);
const _: () = assert!(std::mem::size_of::<BlockQ8_0>() == 34);
const _: () = assert!(std::mem::size_of::<BlockQ2K>() == 84);
const _: () = assert!(std::mem::size_of::<BlockQ3K>() == 110);
const _: () = assert!(std::mem::size_of::<BlockQ4K>() == 144);
const _: () = assert!(std::mem::size_of::<BlockQ5K>() == 176);
const _: () = assert!(std::mem::size_of::<BlockQ6K>() == 210);

#[inline]
fn h(b: [u8; 2]) -> f32 {
    f16_to_f32(u16::from_le_bytes(b))
}

fn q4_0(b: &BlockQ4_0, y: &mut [f32]) {
    let d = h(b.d);
    for j in 0..16 {
        y[j] = ((b.qs[j] & 0x0f) as i32 - 8) as f32 * d;
        y[j + 16] = ((b.qs[j] >> 4) as i32 - 8) as f32 * d;
    }
}

/// ggml's MXFP4 block has the bytes of [`crate::fp4::BlockMxfp4`] (an E8M0 scale, 16 bytes of
/// codes) but ggml's nibble order: codes `j` and `j + 16` share byte `j` (low and high nibble), as
/// Q4_0's. 32 weights `E2M1(c) · 2^(e − 127)`, computed as ggml does, `kvalues_mxfp4[c] ·
/// 2^(e − 128)` with the doubled table ([`crate::fp4::E2M1_X2`]).
fn mxfp4(b: &BlockMxfp4, y: &mut [f32]) {
    // 2^(e − 128), exact in f32 for every e (e = 0 and 1 are subnormal, as ggml's table has them).
    let d = (2f64).powi(b.e as i32 - 128) as f32;
    let k = crate::fp4::E2M1_X2;
    for j in 0..16 {
        y[j] = k[(b.qs[j] & 0x0f) as usize] as f32 * d;
        y[j + 16] = k[(b.qs[j] >> 4) as usize] as f32 * d;
    }
}

fn q4_1(b: &BlockQ4_1, y: &mut [f32]) {
    let (d, m) = (h(b.d), h(b.m));
    for j in 0..16 {
        y[j] = (b.qs[j] & 0x0f) as f32 * d + m;
        y[j + 16] = (b.qs[j] >> 4) as f32 * d + m;
    }
}

/// The fifth bits of element j and j + 16 of a Q5 block, already at bit 4.
#[inline]
pub(crate) fn q5_high(qh: u32, j: usize) -> (u8, u8) {
    ((((qh >> j) << 4) & 0x10) as u8, ((qh >> (j + 12)) & 0x10) as u8)
}

fn q5_0(b: &BlockQ5_0, y: &mut [f32]) {
    let d = h(b.d);
    let qh = u32::from_le_bytes(b.qh);
    for j in 0..16 {
        let (h0, h1) = q5_high(qh, j);
        y[j] = (((b.qs[j] & 0x0f) | h0) as i32 - 16) as f32 * d;
        y[j + 16] = (((b.qs[j] >> 4) | h1) as i32 - 16) as f32 * d;
    }
}

fn q5_1(b: &BlockQ5_1, y: &mut [f32]) {
    let (d, m) = (h(b.d), h(b.m));
    let qh = u32::from_le_bytes(b.qh);
    for j in 0..16 {
        let (h0, h1) = q5_high(qh, j);
        y[j] = ((b.qs[j] & 0x0f) | h0) as f32 * d + m;
        y[j + 16] = ((b.qs[j] >> 4) | h1) as f32 * d + m;
    }
}

fn q8_0(b: &BlockQ8_0, y: &mut [f32]) {
    let d = h(b.d);
    for (o, &q) in y.iter_mut().zip(&b.qs) {
        *o = q as f32 * d;
    }
}

fn q2_k(b: &BlockQ2K, y: &mut [f32]) {
    let (d, dmin) = (h(b.d), h(b.dmin));
    let mut is = 0;
    let mut out = 0;
    for half in 0..2 {
        let q = &b.qs[half * 32..half * 32 + 32];
        for shift in [0u32, 2, 4, 6] {
            for sub in 0..2 {
                let sc = b.scales[is];
                is += 1;
                let dl = d * (sc & 0x0f) as f32;
                let ml = dmin * (sc >> 4) as f32;
                for &qb in &q[sub * 16..sub * 16 + 16] {
                    y[out] = dl * ((qb >> shift) & 3) as f32 - ml;
                    out += 1;
                }
            }
        }
    }
}

/// Q3_K's sixteen 6-bit scales (stored biased by 32) from their 12-byte packing.
fn q3_k_scales(packed: &[u8; 12]) -> [i8; 16] {
    const KMASK1: u32 = 0x0303_0303;
    const KMASK2: u32 = 0x0f0f_0f0f;
    let word = |i: usize| u32::from_le_bytes([packed[4 * i], packed[4 * i + 1], packed[4 * i + 2], packed[4 * i + 3]]);
    let (a0, a1, tmp) = (word(0), word(1), word(2));
    let aux = [
        (a0 & KMASK2) | ((tmp & KMASK1) << 4),
        (a1 & KMASK2) | (((tmp >> 2) & KMASK1) << 4),
        ((a0 >> 4) & KMASK2) | (((tmp >> 4) & KMASK1) << 4),
        ((a1 >> 4) & KMASK2) | (((tmp >> 6) & KMASK1) << 4),
    ];
    let mut out = [0i8; 16];
    for (i, w) in aux.iter().enumerate() {
        for (k, byte) in w.to_le_bytes().iter().enumerate() {
            out[4 * i + k] = *byte as i8;
        }
    }
    out
}

fn q3_k(b: &BlockQ3K, y: &mut [f32]) {
    let d_all = h(b.d);
    let scales = q3_k_scales(&b.scales);
    let mut is = 0;
    let mut out = 0;
    let mut m = 1u8;
    for half in 0..2 {
        let q = &b.qs[half * 32..half * 32 + 32];
        for shift in [0u32, 2, 4, 6] {
            for sub in 0..2 {
                let dl = d_all * (scales[is] as i32 - 32) as f32;
                is += 1;
                let range = sub * 16..sub * 16 + 16;
                for (&qb, &hb) in q[range.clone()].iter().zip(&b.hmask[range]) {
                    let low = ((qb >> shift) & 3) as i32;
                    let high = if hb & m != 0 { 0 } else { 4 };
                    y[out] = dl * (low - high) as f32;
                    out += 1;
                }
            }
            m <<= 1;
        }
    }
}

/// Scale and min of group `j` of a Q4_K / Q5_K block (ggml's `get_scale_min_k4`).
#[inline]
pub(crate) fn scale_min_k4(j: usize, q: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

fn q4_k(b: &BlockQ4K, y: &mut [f32]) {
    let (d, dmin) = (h(b.d), h(b.dmin));
    for pair in 0..4 {
        let (sc1, m1) = scale_min_k4(2 * pair, &b.scales);
        let (sc2, m2) = scale_min_k4(2 * pair + 1, &b.scales);
        let (d1, mm1) = (d * sc1 as f32, dmin * m1 as f32);
        let (d2, mm2) = (d * sc2 as f32, dmin * m2 as f32);
        let q = &b.qs[pair * 32..pair * 32 + 32];
        let y = &mut y[pair * 64..pair * 64 + 64];
        for l in 0..32 {
            y[l] = d1 * (q[l] & 0x0f) as f32 - mm1;
            y[l + 32] = d2 * (q[l] >> 4) as f32 - mm2;
        }
    }
}

fn q5_k(b: &BlockQ5K, y: &mut [f32]) {
    let (d, dmin) = (h(b.d), h(b.dmin));
    for pair in 0..4 {
        let (sc1, m1) = scale_min_k4(2 * pair, &b.scales);
        let (sc2, m2) = scale_min_k4(2 * pair + 1, &b.scales);
        let (d1, mm1) = (d * sc1 as f32, dmin * m1 as f32);
        let (d2, mm2) = (d * sc2 as f32, dmin * m2 as f32);
        let (u1, u2) = (1u8 << (2 * pair), 2u8 << (2 * pair));
        let ql = &b.qs[pair * 32..pair * 32 + 32];
        let y = &mut y[pair * 64..pair * 64 + 64];
        for l in 0..32 {
            let h1 = if b.qh[l] & u1 != 0 { 16 } else { 0 };
            let h2 = if b.qh[l] & u2 != 0 { 16 } else { 0 };
            y[l] = d1 * ((ql[l] & 0x0f) + h1) as f32 - mm1;
            y[l + 32] = d2 * ((ql[l] >> 4) + h2) as f32 - mm2;
        }
    }
}

fn q6_k(b: &BlockQ6K, y: &mut [f32]) {
    let d = h(b.d);
    for half in 0..2 {
        let ql = &b.ql[half * 64..half * 64 + 64];
        let qh = &b.qh[half * 32..half * 32 + 32];
        let sc = &b.scales[half * 8..half * 8 + 8];
        let y = &mut y[half * 128..half * 128 + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0x0f) | (qh[l] & 3) << 4) as i32 - 32;
            let q2 = ((ql[l + 32] & 0x0f) | ((qh[l] >> 2) & 3) << 4) as i32 - 32;
            let q3 = ((ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4) as i32 - 32;
            y[l] = d * sc[is] as f32 * q1 as f32;
            y[l + 32] = d * sc[is + 2] as f32 * q2 as f32;
            y[l + 64] = d * sc[is + 4] as f32 * q3 as f32;
            y[l + 96] = d * sc[is + 6] as f32 * q4 as f32;
        }
    }
}

fn blocks<B: Pod, const N: usize>(bytes: &[u8], out: &mut [f32], f: fn(&B, &mut [f32])) {
    let blocks: &[B] = bytemuck::cast_slice(bytes);
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(N)) {
        f(b, y);
    }
}

/// Dequantise `out.len()` elements of type `ty` from `bytes` into `out` (scalar reference, the
/// exact arithmetic of ggml's `dequantize_row_*`). `bytes` must hold exactly those elements.
pub fn dequantize(ty: GgmlType, bytes: &[u8], out: &mut [f32]) -> Result<(), GgmlError> {
    let expected = ty.bytes_for(out.len())?;
    if bytes.len() != expected {
        return Err(GgmlError::ByteLen { ty, elements: out.len(), found: bytes.len(), expected });
    }
    match ty {
        GgmlType::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        GgmlType::F16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16_to_f32(u16::from_le_bytes([c[0], c[1]]));
            }
        }
        GgmlType::BF16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = bf16_to_f32(u16::from_le_bytes([c[0], c[1]]));
            }
        }
        GgmlType::Q4_0 => blocks::<BlockQ4_0, 32>(bytes, out, q4_0),
        GgmlType::Q4_1 => blocks::<BlockQ4_1, 32>(bytes, out, q4_1),
        GgmlType::Q5_0 => blocks::<BlockQ5_0, 32>(bytes, out, q5_0),
        GgmlType::Q5_1 => blocks::<BlockQ5_1, 32>(bytes, out, q5_1),
        GgmlType::Q8_0 => blocks::<BlockQ8_0, 32>(bytes, out, q8_0),
        GgmlType::Q2K => blocks::<BlockQ2K, QK_K>(bytes, out, q2_k),
        GgmlType::Q3K => blocks::<BlockQ3K, QK_K>(bytes, out, q3_k),
        GgmlType::Q4K => blocks::<BlockQ4K, QK_K>(bytes, out, q4_k),
        GgmlType::Q5K => blocks::<BlockQ5K, QK_K>(bytes, out, q5_k),
        GgmlType::Q6K => blocks::<BlockQ6K, QK_K>(bytes, out, q6_k),
        GgmlType::Mxfp4 => blocks::<BlockMxfp4, 32>(bytes, out, mxfp4),
    }
    Ok(())
}

/// [`dequantize`] into a new vector of `elements` floats.
pub fn dequantize_vec(ty: GgmlType, bytes: &[u8], elements: usize) -> Result<Vec<f32>, GgmlError> {
    let mut out = vec![0f32; elements];
    // Check the length before the allocation is used; the caller sized `elements` from a
    // validated header, and a mismatch returns before any block is read.
    dequantize(ty, bytes, &mut out)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_unknown_ids_are_refused() {
        for ty in GgmlType::ALL {
            assert_eq!(GgmlType::from_id(ty.id()), Ok(ty));
        }
        for id in [4, 5, 9, 15, 16, 29, 31, 38, 40, 1000, u32::MAX] {
            assert_eq!(GgmlType::from_id(id), Err(GgmlError::UnknownType(id)));
        }
    }

    #[test]
    fn sizes_are_checked_before_reading() {
        let mut out = vec![0f32; 64];
        let e = dequantize(GgmlType::Q8_0, &[0u8; 67], &mut out).unwrap_err();
        assert_eq!(e, GgmlError::ByteLen { ty: GgmlType::Q8_0, elements: 64, found: 67, expected: 68 });
        let mut out = vec![0f32; 33];
        assert!(matches!(dequantize(GgmlType::Q4_0, &[0u8; 36], &mut out), Err(GgmlError::RaggedBlocks { .. })));
        assert!(GgmlType::F32.bytes_for(usize::MAX / 2).is_err());
    }

    /// ggml's `dequantize_row_mxfp4`: `kvalues_mxfp4[c] · GGML_E8M0_TO_FP32_HALF(e)`, codes j and
    /// j + 16 in byte j; checked against values written out by hand, subnormal scales included.
    #[test]
    fn mxfp4_is_the_doubled_e2m1_table_times_half_the_e8m0_scale() {
        let mut b = BlockMxfp4::zeroed();
        b.e = 127 + 2; // 2^2 / 2
        for (j, q) in b.qs.iter_mut().enumerate() {
            *q = (j as u8) | (((15 - j) as u8) << 4);
        }
        let y = dequantize_vec(GgmlType::Mxfp4, bytemuck::bytes_of(&b), 32).unwrap();
        let e2m1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];
        for j in 0..16 {
            assert_eq!(y[j], e2m1[j] * 4.0, "low nibble {j}");
            assert_eq!(y[j + 16], e2m1[15 - j] * 4.0, "high nibble {j}");
        }
        b.e = 0;
        let y = dequantize_vec(GgmlType::Mxfp4, bytemuck::bytes_of(&b), 32).unwrap();
        assert_eq!(y[1], f32::from_bits(0x0020_0000), "1 · 2^-128 (ggml: 0x00200000 << 0)");
        b.e = 1;
        let y = dequantize_vec(GgmlType::Mxfp4, bytemuck::bytes_of(&b), 32).unwrap();
        assert_eq!(y[1], f32::from_bits(0x0040_0000), "1 · 2^-127");
    }

    proptest::proptest! {
        /// ggml's MXFP4 blocks read as an [`crate::fp4::Fp4Matrix`] (codes moved to its nibble
        /// order, scales kept) hold the values ggml's dequantiser gives, bit for bit, over ragged
        /// shapes and every scale but the NaN one (refused).
        #[test]
        fn ggml_mxfp4_blocks_read_as_an_fp4_matrix_keep_their_values(
            rows in 1usize..5,
            groups in 1usize..5,
            raw in proptest::collection::vec(proptest::prelude::any::<u8>(), 16 * 17),
            scales in proptest::collection::vec(0u8..0xff, 16),
        ) {
            let k = 32 * groups;
            let mut bytes = raw[..rows * groups * 17].to_vec();
            for (b, &e) in bytes.chunks_exact_mut(17).zip(&scales) {
                b[0] = e;
            }
            let want = dequantize_vec(GgmlType::Mxfp4, &bytes, rows * k).unwrap();
            let m = crate::fp4::Fp4Matrix::from_ggml_mxfp4(&bytes, rows, k).unwrap();
            let got = m.dequantize();
            proptest::prop_assert_eq!(
                got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            );
            bytes[17 * (rows * groups - 1)] = 0xff;
            proptest::prop_assert!(crate::fp4::Fp4Matrix::from_ggml_mxfp4(&bytes, rows, k).is_err());
            proptest::prop_assert!(crate::fp4::Fp4Matrix::from_ggml_mxfp4(&bytes[1..], rows, k).is_err());
        }
    }

    #[test]
    fn q8_0_is_scale_times_code() {
        let mut b = BlockQ8_0::zeroed();
        b.d = half::f16::from_f32(0.5).to_bits().to_le_bytes();
        for (i, q) in b.qs.iter_mut().enumerate() {
            *q = i as i8 - 16;
        }
        let y = dequantize_vec(GgmlType::Q8_0, bytemuck::bytes_of(&b), 32).unwrap();
        let expect: Vec<f32> = (0..32).map(|i| (i as f32 - 16.0) * 0.5).collect();
        assert_eq!(y, expect);
    }
}
