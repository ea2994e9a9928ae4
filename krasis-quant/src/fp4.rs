//! The 4-bit float weight formats MXFP4 and NVFP4, kept as stored: their blocks, exact
//! dequantisation, conversion from the published safetensors layouts, and their CPU packed
//! layout (the INT4 row blocks of [`crate::cpu_layout`] with one-byte scales).
//!
//! **Codes.** Both formats store E2M1 codes: bit 3 the sign, bits 0–2 index
//! {0, 0.5, 1, 1.5, 2, 3, 4, 6} (code 8 is −0). Twice a code's value is an integer in
//! {0, ±1, ±2, ±3, ±4, ±6, ±8, ±12} ([`E2M1_X2`]), so the kernels look a code up as an INT8 and
//! take exact integer dot products with INT8 activations, then scale once per group.
//!
//! **MXFP4** (OCP Microscaling; OpenAI's gpt-oss): groups of 32 codes along K with one E8M0 scale
//! (`2^(e − 127)`; 255 is NaN): `w = E2M1(c) · 2^(e − 127)`.
//!
//! **NVFP4** (NVIDIA ModelOpt): groups of 16 with one E4M3 scale (`float8_e4m3fn`: no
//! infinities, 0x7f / 0xff NaN) and one FP32 global scale per tensor (ModelOpt's
//! `weight_scale_2`, which *multiplies*: `weight_scale_2 = amax(W) / (6 · 448)`):
//! `w = E2M1(c) · E4M3(s) · weight_scale_2`. ModelOpt also stores `input_scale`, the activation
//! global scale of W4A4 kernels; Krasis runs these weights with INT8 activations per group of
//! 16 (W4A8) and does not read it, as the reference (W4A16) does not.
//!
//! **Published layouts.** ModelOpt NVFP4: `P.weight` uint8 `[out, in/2]` (element 2j in the low
//! nibble of byte j, 2j + 1 in the high nibble), `P.weight_scale` float8_e4m3fn `[out, in/16]`
//! (plain row-major, not a swizzled kernel layout), `P.weight_scale_2` float32 scalar. OpenAI
//! MXFP4 (gpt-oss): `*_blocks` uint8 `[E, out, in/32, 16]` (in row r, group g, byte b: the low
//! nibble is input 32g + 2b, the high nibble 32g + 2b + 1) and `*_scales` uint8 `[E, out, in/32]`.
//! Both are read into [`Fp4Matrix`] (row-major blocks [`BlockMxfp4`] / [`BlockNvfp4`], the bytes
//! as stored), never requantised.
//!
//! **CPU layout.** [`PackedLayout::new_fp4`]: row blocks of 16 rows as INT4's, each
//! `[16 f32 row factors][per group: 16 one-byte scales, padded to 64][group 0 weights]…`. The
//! weights are the codes in INT4's chunk order (64-byte chunks, byte `4·j + b` holding (row j,
//! k0 + b) in its low nibble and (row j, k0 + 4 + b) in its high nibble). The row factor of row
//! j ([`row_factor`]) is `1/2` for MXFP4 (undoing the doubled code table) and `128 ·
//! weight_scale_2` for NVFP4, whose scale bytes the kernels read as `E4M3 / 256` ([`kernel_scale`]:
//! the byte's bits moved into an f16, exact, one `vcvtph2ps`), so `s · f = E4M3 · weight_scale_2 /
//! 2` either way. Padding rows have factor 0, scale byte 0 and code 0.
//!
//! The matmul is then, per (row, group), `y += d · ((s · f) · s_x)` with `d` the exact integer
//! `Σ (2·E2M1(c)) · q_x`, `s` the group scale as the kernels read it ([`kernel_scale`]), `f` the
//! row factor and `s_x` the activations' group scale; `s · f` is exact for MXFP4 (a power of two
//! times ½) and one f32 rounding for NVFP4 (E4M3 times `weight_scale_2 / 2`, scaled by powers of
//! two).

use bytemuck::{Pod, Zeroable};

use crate::cpu_layout::{PackedLayout, CHUNK, ROW_BLOCK};

/// Twice the E2M1 value of each code (code 8, −0, is 0).
pub const E2M1_X2: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// Offset the kernels add to [`E2M1_X2`] so the looked-up weight is unsigned (VNNI `vpdpbusd`
/// takes u8 × s8); removed per group with the activation sums, as INT4's `+8`.
pub const FP4_LUT_OFFSET: i32 = 12;

/// [`E2M1_X2`] plus [`FP4_LUT_OFFSET`]: the kernels' 16-entry table (0..=24).
pub const E2M1_X2_BIASED: [u8; 16] = {
    let mut t = [0u8; 16];
    let mut i = 0;
    while i < 16 {
        t[i] = (E2M1_X2[i] as i32 + FP4_LUT_OFFSET) as u8;
        i += 1;
    }
    t
};

/// Bytes of a FP4 row block's row factors (16 f32), at the start of its header.
pub const FP4_FACTOR_BYTES: usize = 64;

/// Which 4-bit float format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fp4Kind {
    /// E2M1 codes, an E8M0 scale per 32.
    Mxfp4,
    /// E2M1 codes, an E4M3 scale per 16, an FP32 global scale per tensor.
    Nvfp4,
}

impl Fp4Kind {
    /// Codes per scale: 32 or 16.
    pub const fn group(self) -> usize {
        match self {
            Fp4Kind::Mxfp4 => 32,
            Fp4Kind::Nvfp4 => 16,
        }
    }

    /// `"mxfp4"` or `"nvfp4"`.
    pub const fn name(self) -> &'static str {
        match self {
            Fp4Kind::Mxfp4 => "mxfp4",
            Fp4Kind::Nvfp4 => "nvfp4",
        }
    }

    /// Bytes of one stored block (scale + codes): 17 or 9.
    pub const fn block_bytes(self) -> usize {
        match self {
            Fp4Kind::Mxfp4 => std::mem::size_of::<BlockMxfp4>(),
            Fp4Kind::Nvfp4 => std::mem::size_of::<BlockNvfp4>(),
        }
    }

    /// Whether `s` is a scale byte the format can hold (not NaN).
    pub const fn scale_ok(self, s: u8) -> bool {
        match self {
            Fp4Kind::Mxfp4 => s != 0xff,
            Fp4Kind::Nvfp4 => s & 0x7f != 0x7f,
        }
    }
}

impl std::fmt::Display for Fp4Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One MXFP4 group: its E8M0 scale and 32 codes (element 2b in the low nibble of `qs[b]`,
/// 2b + 1 in the high nibble).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct BlockMxfp4 {
    pub e: u8,
    pub qs: [u8; 16],
}

/// One NVFP4 group: its E4M3 scale and 16 codes (order as [`BlockMxfp4`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct BlockNvfp4 {
    pub scale: u8,
    pub qs: [u8; 8],
}

const _: () = assert!(std::mem::size_of::<BlockMxfp4>() == 17);
const _: () = assert!(std::mem::size_of::<BlockNvfp4>() == 9);

/// The value of E2M1 code `c` (low 4 bits).
#[inline]
pub fn e2m1(c: u8) -> f32 {
    E2M1_X2[(c & 0xf) as usize] as f32 * 0.5
}

/// The value of an E8M0 byte, `2^(e − 127)` (exact in f32: 2⁻¹²⁷ is a subnormal), NaN for 255.
#[inline]
pub fn e8m0(e: u8) -> f32 {
    match e {
        0xff => f32::NAN,
        0 => f32::from_bits(0x0040_0000),
        e => f32::from_bits((e as u32) << 23),
    }
}

/// The value of an E4M3 (`float8_e4m3fn`) byte, exact in f32; NaN for 0x7f / 0xff. Computed as
/// the kernels do: a normal byte's 7 magnitude bits shifted into an f32's exponent and mantissa
/// with the exponent rebased by 120 (integer arithmetic), a subnormal's (exponent 0) as
/// `m · 2⁻⁹`, then the sign bit.
#[inline]
pub fn e4m3(b: u8) -> f32 {
    if b & 0x7f == 0x7f {
        return f32::NAN;
    }
    let mag = if b & 0x78 == 0 {
        (b & 7) as f32 * (1.0 / 512.0)
    } else {
        f32::from_bits((((b & 0x7f) as u32) << 20) + (120 << 23))
    };
    f32::from_bits(mag.to_bits() | (((b & 0x80) as u32) << 24))
}

/// A stored group scale byte of `kind` as f32 (the kernels' `s`).
#[inline]
pub fn scale_value(kind: Fp4Kind, s: u8) -> f32 {
    match kind {
        Fp4Kind::Mxfp4 => e8m0(s),
        Fp4Kind::Nvfp4 => e4m3(s),
    }
}

/// A stored group scale byte of `kind` as the kernels read it: MXFP4's E8M0 value; for NVFP4
/// the E4M3 value divided by 256 (exact), read as the f16 whose bits are the byte's magnitude
/// shifted left by 7 and its sign moved to bit 15 (E4M3's exponent field lands in f16's, whose
/// bias is 8 larger; E4M3's subnormals become f16 subnormals).
#[inline]
pub fn kernel_scale(kind: Fp4Kind, s: u8) -> f32 {
    match kind {
        Fp4Kind::Mxfp4 => e8m0(s),
        Fp4Kind::Nvfp4 => half::f16::from_bits((((s & 0x7f) as u16) << 7) | (((s & 0x80) as u16) << 8)).to_f32(),
    }
}

/// The row factor of the CPU layout for a matrix of `kind` with global scale `global` (see the
/// module docs): `1/2` (MXFP4), `128 · global` (NVFP4).
#[inline]
pub fn row_factor(kind: Fp4Kind, global: f32) -> f32 {
    match kind {
        Fp4Kind::Mxfp4 => 0.5,
        Fp4Kind::Nvfp4 => global * 128.0,
    }
}

/// Errors of the FP4 conversions and packers. Messages name what is wrong; callers add the
/// tensor name.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum Fp4Error {
    #[error("{kind}: K = {k} must be a positive multiple of 32")]
    BadK { kind: Fp4Kind, k: usize },
    #[error("{what} has {found} bytes, [{rows}, {k}] in {kind} needs {expected}")]
    Len { kind: Fp4Kind, what: &'static str, rows: usize, k: usize, found: usize, expected: usize },
    #[error("{kind}: scale byte {byte:#04x} at row {row}, group {group} is NaN")]
    NanScale { kind: Fp4Kind, byte: u8, row: usize, group: usize },
    #[error("nvfp4: global scale (weight_scale_2) {0:e} is not a finite non-negative number")]
    BadGlobal(f32),
    #[error("fused w13: gate is {gate:?} but up is {up:?}; they must match and have a multiple of 16 rows")]
    W13Mismatch { gate: (Fp4Kind, usize, usize), up: (Fp4Kind, usize, usize) },
    #[error("packed buffer is {found} bytes, the layout needs {expected}")]
    BufferLen { found: usize, expected: usize },
    #[error("layout {0:?} is not an FP4 layout")]
    NotFp4(PackedLayout),
}

/// A `[rows, k]` matrix of FP4 weights as stored: `rows · k / group` blocks, row-major by
/// (row, group), each [`BlockMxfp4`] or [`BlockNvfp4`] by `kind`; `global` is NVFP4's per-tensor
/// `weight_scale_2` (1 for MXFP4).
#[derive(Clone, Debug, PartialEq)]
pub struct Fp4Matrix {
    pub kind: Fp4Kind,
    pub rows: usize,
    pub k: usize,
    pub global: f32,
    /// The blocks' bytes (cast with [`Fp4Matrix::mx_blocks`] / [`Fp4Matrix::nv_blocks`]).
    pub blocks: Vec<u8>,
}

impl Fp4Matrix {
    /// Groups per row.
    pub fn groups(&self) -> usize {
        self.k / self.kind.group()
    }

    /// The MXFP4 blocks (panics on an NVFP4 matrix).
    pub fn mx_blocks(&self) -> &[BlockMxfp4] {
        assert_eq!(self.kind, Fp4Kind::Mxfp4, "mx_blocks of an {} matrix", self.kind);
        bytemuck::cast_slice(&self.blocks)
    }

    /// The NVFP4 blocks (panics on an MXFP4 matrix).
    pub fn nv_blocks(&self) -> &[BlockNvfp4] {
        assert_eq!(self.kind, Fp4Kind::Nvfp4, "nv_blocks of an {} matrix", self.kind);
        bytemuck::cast_slice(&self.blocks)
    }

    /// Block `i`'s scale byte and packed codes (`group / 2` bytes).
    #[inline]
    pub fn block(&self, i: usize) -> (u8, &[u8]) {
        let bb = self.kind.block_bytes();
        let b = &self.blocks[i * bb..(i + 1) * bb];
        (b[0], &b[1..])
    }

    /// Code of element (row `r`, column `c`).
    #[inline]
    pub fn code(&self, r: usize, c: usize) -> u8 {
        let gs = self.kind.group();
        let (_, qs) = self.block(r * self.groups() + c / gs);
        let i = c % gs;
        (qs[i / 2] >> (4 * (i % 2))) & 0xf
    }

    /// Scale byte of (row `r`, group `g`).
    #[inline]
    pub fn scale_byte(&self, r: usize, g: usize) -> u8 {
        self.block(r * self.groups() + g).0
    }

    /// The row factor of the CPU layout ([`row_factor`]).
    pub fn row_factor(&self) -> f32 {
        row_factor(self.kind, self.global)
    }

    fn check_shape(kind: Fp4Kind, rows: usize, k: usize) -> Result<(), Fp4Error> {
        if k == 0 || !k.is_multiple_of(32) {
            return Err(Fp4Error::BadK { kind, k });
        }
        let _ = rows;
        Ok(())
    }

    fn check_scales(&self) -> Result<(), Fp4Error> {
        let ng = self.groups();
        for i in 0..self.rows * ng {
            let (s, _) = self.block(i);
            if !self.kind.scale_ok(s) {
                return Err(Fp4Error::NanScale { kind: self.kind, byte: s, row: i / ng, group: i % ng });
            }
        }
        Ok(())
    }

    /// From ModelOpt's NVFP4 tensors of one linear: `weight` (`[rows, k/2]` bytes),
    /// `weight_scale` (`[rows, k/16]` E4M3 bytes) and `weight_scale_2`. The bytes are kept as
    /// they are; a NaN scale or a negative / non-finite global is an error.
    pub fn from_modelopt_nvfp4(
        weight: &[u8],
        weight_scale: &[u8],
        weight_scale_2: f32,
        rows: usize,
        k: usize,
    ) -> Result<Fp4Matrix, Fp4Error> {
        let kind = Fp4Kind::Nvfp4;
        Self::check_shape(kind, rows, k)?;
        let len = |what, found, expected| {
            (found != expected).then_some(Fp4Error::Len { kind, what, rows, k, found, expected })
        };
        if let Some(e) =
            len("weight", weight.len(), rows * k / 2).or(len("weight_scale", weight_scale.len(), rows * k / 16))
        {
            return Err(e);
        }
        if !weight_scale_2.is_finite() || weight_scale_2 < 0.0 {
            return Err(Fp4Error::BadGlobal(weight_scale_2));
        }
        let ng = k / 16;
        let mut blocks = Vec::with_capacity(rows * ng * kind.block_bytes());
        for i in 0..rows * ng {
            blocks.extend_from_slice(bytemuck::bytes_of(&BlockNvfp4 {
                scale: weight_scale[i],
                qs: weight[8 * i..8 * i + 8].try_into().expect("8 bytes"),
            }));
        }
        let m = Fp4Matrix { kind, rows, k, global: weight_scale_2, blocks };
        m.check_scales()?;
        Ok(m)
    }

    /// From OpenAI's MXFP4 tensors of one matrix (one expert's slice of `*_blocks`
    /// `[rows, k/32, 16]` and `*_scales` `[rows, k/32]`). The bytes are kept as they are; a NaN
    /// scale (255) is an error.
    pub fn from_openai_mxfp4(blocks: &[u8], scales: &[u8], rows: usize, k: usize) -> Result<Fp4Matrix, Fp4Error> {
        let kind = Fp4Kind::Mxfp4;
        Self::check_shape(kind, rows, k)?;
        let len = |what, found, expected| {
            (found != expected).then_some(Fp4Error::Len { kind, what, rows, k, found, expected })
        };
        if let Some(e) = len("blocks", blocks.len(), rows * k / 2).or(len("scales", scales.len(), rows * k / 32)) {
            return Err(e);
        }
        let ng = k / 32;
        let mut out = Vec::with_capacity(rows * ng * kind.block_bytes());
        for i in 0..rows * ng {
            out.extend_from_slice(bytemuck::bytes_of(&BlockMxfp4 {
                e: scales[i],
                qs: blocks[16 * i..16 * i + 16].try_into().expect("16 bytes"),
            }));
        }
        let m = Fp4Matrix { kind, rows, k, global: 1.0, blocks: out };
        m.check_scales()?;
        Ok(m)
    }

    /// From ggml's MXFP4 blocks of one `[rows, k]` matrix (GGUF type 39: row-major by (row,
    /// group), each an E8M0 scale and 16 bytes in which codes `j` and `j + 16` share byte `j`, low
    /// and high nibble). The scales are kept as they are and the codes moved to
    /// [`BlockMxfp4`]'s order (`2b` and `2b + 1` in byte `b`): the same 32 values per group, since
    /// ggml's `kvalues_mxfp4[c] · 2^(e − 128)` is `E2M1(c) · 2^(e − 127)`. A NaN scale (0xff) is an
    /// error.
    pub fn from_ggml_mxfp4(bytes: &[u8], rows: usize, k: usize) -> Result<Fp4Matrix, Fp4Error> {
        let kind = Fp4Kind::Mxfp4;
        Self::check_shape(kind, rows, k)?;
        let n = rows * (k / 32);
        let expected = n * kind.block_bytes();
        if bytes.len() != expected {
            return Err(Fp4Error::Len { kind, what: "ggml blocks", rows, k, found: bytes.len(), expected });
        }
        let mut out = Vec::with_capacity(expected);
        for b in bytes.chunks_exact(kind.block_bytes()) {
            let code = |j: usize| if j < 16 { b[1 + j] & 0x0f } else { b[1 + j - 16] >> 4 };
            let mut qs = [0u8; 16];
            for (i, q) in qs.iter_mut().enumerate() {
                *q = code(2 * i) | (code(2 * i + 1) << 4);
            }
            out.extend_from_slice(bytemuck::bytes_of(&BlockMxfp4 { e: b[0], qs }));
        }
        let m = Fp4Matrix { kind, rows, k, global: 1.0, blocks: out };
        m.check_scales()?;
        Ok(m)
    }

    /// The exact values `E2M1(c) · scale (· global)` as f64, row-major `[rows, k]` (every
    /// product is exact in f64).
    pub fn dequantize_f64(&self) -> Vec<f64> {
        let (ng, gs) = (self.groups(), self.kind.group());
        let mut out = Vec::with_capacity(self.rows * self.k);
        for i in 0..self.rows * ng {
            let (s, qs) = self.block(i);
            let s = scale_value(self.kind, s) as f64 * self.global as f64;
            out.extend((0..gs).map(|j| e2m1(qs[j / 2] >> (4 * (j % 2))) as f64 * s));
        }
        out
    }

    /// The values as f32: `(E2M1(c) · scale) · global`. `E2M1 · scale` is exact in f32 (MXFP4:
    /// unless `scale` ≥ 2¹²⁶, where 6 · scale overflows); the product with NVFP4's global is
    /// one f32 rounding (≤ 2⁻²⁴ relative). MXFP4 values are exact.
    pub fn dequantize(&self) -> Vec<f32> {
        let (ng, gs) = (self.groups(), self.kind.group());
        let mut out = Vec::with_capacity(self.rows * self.k);
        for i in 0..self.rows * ng {
            let (s, qs) = self.block(i);
            let s = scale_value(self.kind, s);
            out.extend((0..gs).map(|j| {
                let v = e2m1(qs[j / 2] >> (4 * (j % 2))) * s;
                match self.kind {
                    Fp4Kind::Mxfp4 => v,
                    Fp4Kind::Nvfp4 => v * self.global,
                }
            }));
        }
        out
    }
}

/// One MXFP4 matrix per expert from OpenAI's fused tensors: `blocks` `[experts, rows, k/32, 16]`
/// and `scales` `[experts, rows, k/32]`.
pub fn openai_mxfp4_experts(
    blocks: &[u8],
    scales: &[u8],
    experts: usize,
    rows: usize,
    k: usize,
) -> Result<Vec<Fp4Matrix>, Fp4Error> {
    let kind = Fp4Kind::Mxfp4;
    Fp4Matrix::check_shape(kind, rows, k)?;
    let (nb, ns) = (rows * k / 2, rows * k / 32);
    if blocks.len() != experts * nb {
        return Err(Fp4Error::Len { kind, what: "blocks", rows, k, found: blocks.len(), expected: experts * nb });
    }
    if scales.len() != experts * ns {
        return Err(Fp4Error::Len { kind, what: "scales", rows, k, found: scales.len(), expected: experts * ns });
    }
    (0..experts)
        .map(|e| Fp4Matrix::from_openai_mxfp4(&blocks[e * nb..(e + 1) * nb], &scales[e * ns..(e + 1) * ns], rows, k))
        .collect()
}

/// The even and the odd rows of `m` (gpt-oss stores gate and up interleaved in one
/// `gate_up_proj`: row 2j is gate j, row 2j + 1 up j). Blocks are moved, not changed.
pub fn split_interleaved_rows(m: &Fp4Matrix) -> (Fp4Matrix, Fp4Matrix) {
    let row_bytes = m.groups() * m.kind.block_bytes();
    let mut parts = [Vec::new(), Vec::new()];
    for (r, row) in m.blocks.chunks_exact(row_bytes).enumerate() {
        parts[r % 2].extend_from_slice(row);
    }
    let [even, odd] = parts;
    let half =
        |blocks: Vec<u8>| Fp4Matrix { kind: m.kind, rows: blocks.len() / row_bytes, k: m.k, global: m.global, blocks };
    (half(even), half(odd))
}

/// The CPU layout of `m`./// The CPU layout of `m`.
pub fn layout_of(m: &Fp4Matrix) -> PackedLayout {
    PackedLayout::new_fp4(m.rows, m.k, m.kind).expect("Fp4Matrix with K a multiple of 32")
}

/// `m` in the CPU layout (see the module docs).
pub fn pack(m: &Fp4Matrix) -> Vec<u8> {
    let l = layout_of(m);
    let mut out = vec![0u8; l.bytes()];
    pack_into(m, &mut out).expect("buffer sized from the layout");
    out
}

/// [`pack`] into `out`, exactly `layout_of(m).bytes()` long.
pub fn pack_into(m: &Fp4Matrix, out: &mut [u8]) -> Result<PackedLayout, Fp4Error> {
    let l = PackedLayout::new_fp4(m.rows, m.k, m.kind).map_err(|_| Fp4Error::BadK { kind: m.kind, k: m.k })?;
    if out.len() != l.bytes() {
        return Err(Fp4Error::BufferLen { found: out.len(), expected: l.bytes() });
    }
    for (rb, dst) in out.chunks_exact_mut(l.block_bytes()).enumerate() {
        pack_block(m, rb, &l, dst);
    }
    Ok(l)
}

/// Row block `rb` of `m` into `dst` (rows past `m.rows` are zero: factor 0, scale 0, code 0).
fn pack_block(m: &Fp4Matrix, rb: usize, l: &PackedLayout, dst: &mut [u8]) {
    let (ng, gs, gwb) = (l.groups(), l.gs, l.group_weight_bytes());
    dst.fill(0);
    for j in 0..ROW_BLOCK {
        let r = rb * ROW_BLOCK + j;
        if r >= m.rows {
            break;
        }
        dst[4 * j..4 * j + 4].copy_from_slice(&m.row_factor().to_le_bytes());
        for g in 0..ng {
            dst[l.scales_offset(g) + j] = m.scale_byte(r, g);
            let w = &mut dst[l.weights_offset(g)..l.weights_offset(g) + gwb];
            for c in 0..gs / 8 {
                for b in 0..4 {
                    let lo = m.code(r, g * gs + 8 * c + b);
                    let hi = m.code(r, g * gs + 8 * c + 4 + b);
                    w[c * CHUNK + 4 * j + b] = lo | (hi << 4);
                }
            }
        }
    }
}

/// The inverse of [`pack`] (padding rows dropped): the blocks and the global scale (of row 0;
/// 1 for MXFP4 and for an empty matrix).
pub fn unpack(src: &[u8], l: &PackedLayout) -> Result<Fp4Matrix, Fp4Error> {
    let kind = l.fp4.ok_or(Fp4Error::NotFp4(*l))?;
    if src.len() < l.bytes() {
        return Err(Fp4Error::BufferLen { found: src.len(), expected: l.bytes() });
    }
    let (ng, gs, gwb) = (l.groups(), l.gs, l.group_weight_bytes());
    let bb = kind.block_bytes();
    let mut blocks = vec![0u8; l.rows * ng * bb];
    let mut global = 1.0;
    for r in 0..l.rows {
        let blk = &src[l.block_range(r / ROW_BLOCK)];
        let j = r % ROW_BLOCK;
        if r == 0 && kind == Fp4Kind::Nvfp4 {
            global = f32::from_le_bytes(blk[0..4].try_into().expect("4 bytes")) / 128.0;
        }
        for g in 0..ng {
            let out = &mut blocks[(r * ng + g) * bb..(r * ng + g + 1) * bb];
            out[0] = blk[l.scales_offset(g) + j];
            let w = &blk[l.weights_offset(g)..l.weights_offset(g) + gwb];
            for c in 0..gs / 8 {
                for b in 0..4 {
                    let byte = w[c * CHUNK + 4 * j + b];
                    for (i, code) in [(8 * c + b, byte & 0xf), (8 * c + 4 + b, byte >> 4)] {
                        out[1 + i / 2] |= code << (4 * (i % 2));
                    }
                }
            }
        }
    }
    Ok(Fp4Matrix { kind, rows: l.rows, k: l.k, global, blocks })
}

/// The layout of the fused w13 of `gate` and `up` (equal kinds and shapes, rows a multiple of
/// 16; their globals may differ: each row block carries its own row factors).
pub fn w13_layout(gate: &Fp4Matrix, up: &Fp4Matrix) -> Result<PackedLayout, Fp4Error> {
    let (g, u) = ((gate.kind, gate.rows, gate.k), (up.kind, up.rows, up.k));
    if g != u || !gate.rows.is_multiple_of(ROW_BLOCK) {
        return Err(Fp4Error::W13Mismatch { gate: g, up: u });
    }
    PackedLayout::new_fp4(2 * gate.rows, gate.k, gate.kind).map_err(|_| Fp4Error::BadK { kind: gate.kind, k: gate.k })
}

/// Fused gate+up as [`crate::cpu_layout::pack_w13`]: row blocks `[gate 0][up 0][gate 1]…`.
pub fn pack_w13_into(gate: &Fp4Matrix, up: &Fp4Matrix, out: &mut [u8]) -> Result<PackedLayout, Fp4Error> {
    let l = w13_layout(gate, up)?;
    if out.len() != l.bytes() {
        return Err(Fp4Error::BufferLen { found: out.len(), expected: l.bytes() });
    }
    let half = layout_of(gate);
    for (i, dst) in out.chunks_exact_mut(l.block_bytes()).enumerate() {
        pack_block(if i % 2 == 0 { gate } else { up }, i / 2, &half, dst);
    }
    Ok(l)
}

/// The inverse of [`pack_w13_into`]: `(gate, up)`.
pub fn unpack_w13(src: &[u8], l: &PackedLayout) -> Result<(Fp4Matrix, Fp4Matrix), Fp4Error> {
    let kind = l.fp4.ok_or(Fp4Error::NotFp4(*l))?;
    if src.len() < l.bytes() {
        return Err(Fp4Error::BufferLen { found: src.len(), expected: l.bytes() });
    }
    let inter = l.rows / 2;
    let half = PackedLayout::new_fp4(inter, l.k, kind).map_err(|_| Fp4Error::BadK { kind, k: l.k })?;
    let mut parts = [Vec::new(), Vec::new()];
    for i in 0..l.row_blocks() {
        parts[i % 2].extend_from_slice(&src[l.block_range(i)]);
    }
    let [g, u] = parts;
    Ok((unpack(&g, &half)?, unpack(&u, &half)?))
}

/// Deterministic random FP4 matrices for tests and benches: every code, scales from a range
/// that keeps values moderate (E8M0 120..=130; E4M3 every finite byte but the NaNs, signs
/// included), a random global (NVFP4).
pub fn test_matrix(kind: Fp4Kind, rows: usize, k: usize, seed: u64) -> Fp4Matrix {
    let mut s = seed | 1;
    let mut next = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 24) as u32
    };
    let ng = k / kind.group();
    let bb = kind.block_bytes();
    let mut blocks = vec![0u8; rows * ng * bb];
    for b in blocks.chunks_exact_mut(bb) {
        b[0] = match kind {
            Fp4Kind::Mxfp4 => 120 + (next() % 11) as u8,
            Fp4Kind::Nvfp4 => loop {
                let v = next() as u8;
                if kind.scale_ok(v) {
                    break v;
                }
            },
        };
        for q in &mut b[1..] {
            *q = next() as u8;
        }
    }
    let global = match kind {
        Fp4Kind::Mxfp4 => 1.0,
        Fp4Kind::Nvfp4 => (1 + next() % 1000) as f32 * 1e-5,
    };
    Fp4Matrix { kind, rows, k, global, blocks }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn tables() {
        let vals = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
        for c in 0..16u8 {
            let v = vals[(c & 7) as usize] * if c & 8 != 0 { -1.0 } else { 1.0 };
            assert_eq!(e2m1(c), v, "code {c}");
            assert_eq!(E2M1_X2_BIASED[c as usize] as i32 - FP4_LUT_OFFSET, (2.0 * v) as i32);
        }
        assert_eq!(e8m0(127), 1.0);
        assert_eq!(e8m0(0), 2f32.powi(-127));
        assert_eq!(e8m0(254), 2f32.powi(127));
        assert_eq!(e8m0(1), 2f32.powi(-126));
        assert!(e8m0(255).is_nan());
        // E4M3: every byte against the definition.
        for b in 0..=255u8 {
            let (sign, e, m) = ((b >> 7) as i32, ((b >> 3) & 0xf) as i32, (b & 7) as f64);
            let want = if e == 0x0f && m == 7.0 {
                f64::NAN
            } else if e == 0 {
                m / 8.0 * 2f64.powi(-6)
            } else {
                (1.0 + m / 8.0) * 2f64.powi(e - 7)
            } * if sign == 1 { -1.0 } else { 1.0 };
            let got = e4m3(b) as f64;
            assert!(got == want || (got.is_nan() && want.is_nan()), "byte {b:#04x}: {got} vs {want}");
        }
        for b in 0..=255u8 {
            if b & 0x7f != 0x7f {
                assert_eq!(kernel_scale(Fp4Kind::Nvfp4, b) * 256.0, e4m3(b), "byte {b:#04x}");
            }
            if b != 0xff {
                assert_eq!(kernel_scale(Fp4Kind::Mxfp4, b), e8m0(b));
            }
        }
        assert_eq!(e4m3(0x77), 240.0);
        assert_eq!(e4m3(0x7e), 448.0);
        assert_eq!(e4m3(0x01), 2f32.powi(-9));
    }

    /// The README's worked example of `qwen3moe-nvfp4-tiny` (layer 1, expert 0, gate_proj).
    #[test]
    fn modelopt_worked_example() {
        let k = 32;
        let mut weight = vec![0u8; k / 2];
        weight[..4].copy_from_slice(&[0x21, 0xce, 0xc2, 0xb1]);
        let scales = [0x77u8, 0x38];
        let g = 7.99269910203293e-05_f64 as f32; // the stored float32
        let m = Fp4Matrix::from_modelopt_nvfp4(&weight, &scales, g, 1, k).unwrap();
        let codes: Vec<u8> = (0..8).map(|c| m.code(0, c)).collect();
        assert_eq!(codes, [1, 2, 14, 12, 2, 12, 1, 11]);
        let v = m.dequantize_f64();
        let want = [0.5, 1.0, -4.0, -2.0, 1.0, -2.0, 0.5, -1.5];
        for (i, w) in want.iter().enumerate() {
            assert_eq!(v[i], w * 240.0 * g as f64);
        }
        assert!((v[0] - 0.00959123892).abs() < 1e-11);
        let f = m.dequantize();
        assert!(f.iter().zip(&v).all(|(&a, &b)| (a as f64 - b).abs() <= b.abs() * 2f64.powi(-24)));
    }

    #[test]
    fn bad_input_is_named() {
        let e = Fp4Matrix::from_modelopt_nvfp4(&[0; 16], &[0x7f, 0], 1.0, 1, 32).unwrap_err();
        assert_eq!(e, Fp4Error::NanScale { kind: Fp4Kind::Nvfp4, byte: 0x7f, row: 0, group: 0 });
        let e = Fp4Matrix::from_modelopt_nvfp4(&[0; 16], &[0; 3], 1.0, 1, 32).unwrap_err();
        assert!(e.to_string().contains("weight_scale has 3 bytes"), "{e}");
        assert!(matches!(
            Fp4Matrix::from_modelopt_nvfp4(&[0; 16], &[0; 2], f32::NAN, 1, 32),
            Err(Fp4Error::BadGlobal(_))
        ));
        assert!(matches!(Fp4Matrix::from_openai_mxfp4(&[0; 8], &[0; 1], 1, 16), Err(Fp4Error::BadK { .. })));
        let e = Fp4Matrix::from_openai_mxfp4(&[0; 32], &[1, 255], 2, 32).unwrap_err();
        assert_eq!(e, Fp4Error::NanScale { kind: Fp4Kind::Mxfp4, byte: 255, row: 1, group: 0 });
    }

    /// OpenAI's order: in row r, group g, byte b, the low nibble is input 32g + 2b.
    #[test]
    fn openai_order_and_experts() {
        let (e, rows, k) = (2, 3, 64);
        let blocks: Vec<u8> = (0..e * rows * k / 2).map(|i| (i * 37 % 251) as u8).collect();
        let scales: Vec<u8> = (0..e * rows * k / 32).map(|i| 120 + (i % 9) as u8).collect();
        let ms = openai_mxfp4_experts(&blocks, &scales, e, rows, k).unwrap();
        for (x, m) in ms.iter().enumerate() {
            for r in 0..rows {
                for c in 0..k {
                    let byte = blocks[((x * rows + r) * (k / 32) + c / 32) * 16 + (c % 32) / 2];
                    let code = if c % 2 == 0 { byte & 0xf } else { byte >> 4 };
                    let s = scales[(x * rows + r) * (k / 32) + c / 32];
                    assert_eq!(m.code(r, c), code);
                    assert_eq!(m.dequantize()[r * k + c], e2m1(code) * 2f32.powi(s as i32 - 127));
                }
            }
        }
        assert!(openai_mxfp4_experts(&blocks, &scales[1..], e, rows, k).is_err());
    }

    #[test]
    fn interleaved_rows_split() {
        let m = test_matrix(Fp4Kind::Mxfp4, 6, 64, 3);
        let (even, odd) = split_interleaved_rows(&m);
        assert_eq!((even.rows, odd.rows), (3, 3));
        for r in 0..6 {
            let h = if r % 2 == 0 { &even } else { &odd };
            for c in 0..64 {
                assert_eq!(h.code(r / 2, c), m.code(r, c));
            }
            assert_eq!(h.scale_byte(r / 2, 1), m.scale_byte(r, 1));
        }
    }

    #[test]
    fn layout_geometry() {
        let l = PackedLayout::new_fp4(17, 96, Fp4Kind::Nvfp4).unwrap();
        assert_eq!((l.rows_padded, l.gs, l.groups()), (32, 16, 6));
        assert_eq!(l.group_weight_bytes(), 128);
        assert_eq!(l.header_bytes(), 64 + 128); // factors + 6·16 = 96 → 128
        assert_eq!(l.weights_offset(0), 192);
        assert_eq!(l.offset(), 12);
        let l = PackedLayout::new_fp4(16, 64, Fp4Kind::Mxfp4).unwrap();
        assert_eq!(l.header_bytes(), 128);
        assert_eq!(l.block_bytes(), 128 + 2 * 256);
        assert!(PackedLayout::new_fp4(16, 48, Fp4Kind::Nvfp4).is_err());
    }

    proptest! {
        #[test]
        fn pack_unpack_round_trip(
            rows in prop::sample::select(vec![1usize, 5, 16, 17, 33]),
            k in prop::sample::select(vec![32usize, 64, 96, 160]),
            nv in any::<bool>(),
            seed in any::<u64>(),
        ) {
            let kind = if nv { Fp4Kind::Nvfp4 } else { Fp4Kind::Mxfp4 };
            let m = test_matrix(kind, rows, k, seed);
            let p = pack(&m);
            let l = layout_of(&m);
            prop_assert_eq!(p.len(), l.bytes());
            let back = unpack(&p, &l).unwrap();
            prop_assert_eq!(&back, &m);
            // Byte positions: row r, column c is in the chunk (c % gs) / 8 of its group.
            let (r, c) = (rows - 1, k - 3);
            let (rb, j) = (r / 16, r % 16);
            let (g, i) = (c / l.gs, c % l.gs);
            let byte = p[l.block_range(rb)][l.weights_offset(g) + (i / 8) * 64 + 4 * j + i % 4];
            prop_assert_eq!(if i % 8 < 4 { byte & 0xf } else { byte >> 4 }, m.code(r, c));
            let f = f32::from_le_bytes(p[l.block_range(rb)][4 * j..4 * j + 4].try_into().unwrap());
            prop_assert_eq!(f, row_factor(kind, m.global));
        }

        #[test]
        fn w13_round_trip(blocks in 1usize..4, nv in any::<bool>(), seed in any::<u64>()) {
            let kind = if nv { Fp4Kind::Nvfp4 } else { Fp4Kind::Mxfp4 };
            let g = test_matrix(kind, 16 * blocks, 64, seed);
            let u = test_matrix(kind, 16 * blocks, 64, seed ^ 5);
            let l = w13_layout(&g, &u).unwrap();
            let mut p = vec![0u8; l.bytes()];
            pack_w13_into(&g, &u, &mut p).unwrap();
            let (g2, u2) = unpack_w13(&p, &l).unwrap();
            prop_assert_eq!(g2, g);
            prop_assert_eq!(u2, u);
        }
    }
}
