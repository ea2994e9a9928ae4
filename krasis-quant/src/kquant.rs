//! llama.cpp's K-quants Q4_K and Q6_K kept as stored in the CPU packed layout, and ggml's
//! 32-element symmetric blocks (Q4_0, Q5_0, Q8_0) read exactly as INT8 g32.
//!
//! **Q4_K** (`block_q4_K`, 144 bytes per 256 weights): an f16 `d` and `dmin` per super-block,
//! a 6-bit scale `sc` and minimum `m` per 32 (packed in 12 bytes), 4-bit codes `q`:
//! `w = d · sc · q − dmin · m`. **Q6_K** (`block_q6_K`, 210 bytes per 256): an f16 `d` per
//! super-block, an i8 scale `sc` per 16, 6-bit codes (4 low bits in `ql`, 2 high in `qh`):
//! `w = d · sc · (q − 32)`. Both products `d · sc` and `dmin · m` are exact in f32 (an f16 times
//! an integer of at most 8 bits), so a kernel that takes them per group computes with exactly
//! the stored values.
//!
//! **CPU layout** ([`PackedLayout::new_kquant`]): the row blocks of 16 rows of
//! [`crate::cpu_layout`]; K in super-blocks of 256; the kernels' group is the format's scale
//! group (32 for Q4_K, 16 for Q6_K). A row block is a header of [`SB_HEADER_BYTES`] per
//! super-block, then every group's codes in K order:
//! - header of super-block `s` (at `s · 320`): the 16 rows' f16 `d` (32 bytes), then Q4_K: their
//!   f16 `dmin` (32 bytes), the 8 groups' scales (group `g`'s 16 rows at `64 + 16 g`, one byte
//!   each) and the 8 groups' minimums (at `192 + 16 g`); Q6_K: 32 zero bytes, then the 16 groups'
//!   i8 scales (at `64 + 16 g`). The 6-bit fields of Q4_K are unpacked to bytes (2.8 % more bytes
//!   than the file's 144 per block); Q6_K's header is its bytes re-ordered (1 % more, padding).
//! - Q4_K codes: INT4's chunk arrangement (byte `4·j + b` of a 64-byte chunk holds (row j,
//!   k0 + b) in its low nibble and (row j, k0 + 4 + b) in its high one), 4 chunks per group.
//! - Q6_K codes: per group of 16, two such chunks of the low 4 bits, then one chunk of the high
//!   2 bits: byte `4·j + b` holds those of (row j, k0 + b), (j, k0 + 4 + b), (j, k0 + 8 + b),
//!   (j, k0 + 12 + b) at bits 0–1, 2–3, 4–5, 6–7. 192 bytes per group, 6.75 bits per weight
//!   with the header, as the file's 6.5625 plus 1 %.
//!
//! Padding rows are zero (scales 0, codes 0). [`pack_into`] / [`unpack`] are exact inverses
//! (the blocks come back byte for byte).
//!
//! **Q4_0, Q5_0, Q8_0** are `d · (q − o)` per 32 with an f16 `d` (o = 8, 16, 0): exactly Krasis'
//! symmetric INT8 at group 32 with scale `d` and code `q − o` ([`ggml_int8_g32`]), which every
//! kernel and the GPU already run.

use half::f16;

use crate::cpu_layout::{PackedLayout, CHUNK, ROW_BLOCK};
use crate::ggml::{self, BlockQ4K, BlockQ4_0, BlockQ5_0, BlockQ6K, BlockQ8_0, GgmlType, QK_K};
use crate::group::{Bits, QuantError, QuantizedMatrix};

/// Header bytes of one super-block of a row block (both formats; see the module docs).
pub const SB_HEADER_BYTES: usize = 320;

/// The K-quant formats kept as stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KQuant {
    Q4K,
    Q6K,
}

impl std::fmt::Display for KQuant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl KQuant {
    /// ggml's name (`Q4_K`, `Q6_K`).
    pub fn name(self) -> &'static str {
        self.ggml().name()
    }

    pub fn ggml(self) -> GgmlType {
        match self {
            KQuant::Q4K => GgmlType::Q4K,
            KQuant::Q6K => GgmlType::Q6K,
        }
    }

    /// The format of a ggml type, `None` for the others.
    pub fn of(ty: GgmlType) -> Option<KQuant> {
        match ty {
            GgmlType::Q4K => Some(KQuant::Q4K),
            GgmlType::Q6K => Some(KQuant::Q6K),
            _ => None,
        }
    }

    /// Weights per scale (the kernels' group): 32 for Q4_K, 16 for Q6_K.
    pub fn group(self) -> usize {
        match self {
            KQuant::Q4K => 32,
            KQuant::Q6K => 16,
        }
    }

    /// Groups per super-block of 256.
    pub fn groups_per_sb(self) -> usize {
        QK_K / self.group()
    }

    /// Bytes of one group's codes in a row block (16 rows).
    pub fn group_weight_bytes(self) -> usize {
        match self {
            KQuant::Q4K => 4 * CHUNK,
            KQuant::Q6K => 3 * CHUNK,
        }
    }

    /// The codes' offset (`w ∝ q − offset`): 0 for Q4_K (a minimum instead), 32 for Q6_K.
    pub fn offset(self) -> i32 {
        match self {
            KQuant::Q4K => 0,
            KQuant::Q6K => 32,
        }
    }

    fn block_bytes(self) -> usize {
        self.ggml().block_bytes()
    }
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum KQuantError {
    #[error("{ty} [{rows}, {k}]: K must be a positive multiple of {block} (its block)")]
    Ragged { ty: GgmlType, rows: usize, k: usize, block: usize },
    #[error("{ty} [{rows}, {k}]: {found} bytes of blocks, expected {expected}")]
    BlockBytes { ty: GgmlType, rows: usize, k: usize, found: usize, expected: usize },
    #[error("{0} blocks are not read as INT8 g32 (Q4_0, Q5_0 and Q8_0 are)")]
    NotInt8G32(GgmlType),
    #[error("layout {0:?} is not a K-quant layout")]
    NotKQuant(PackedLayout),
    #[error("fused w13: gate is {gate} [{gate_rows}, {gate_k}] but up is {up} [{up_rows}, {up_k}]; they must match")]
    W13Mismatch { gate: KQuant, gate_rows: usize, gate_k: usize, up: KQuant, up_rows: usize, up_k: usize },
    #[error(transparent)]
    Quant(#[from] QuantError),
}

/// A `[rows, k]` matrix of Q4_K or Q6_K blocks as ggml stores them: row-major, `k / 256`
/// blocks per row (the interchange form).
#[derive(Clone, Debug, PartialEq)]
pub struct KQuantMatrix {
    pub kind: KQuant,
    pub rows: usize,
    pub k: usize,
    pub blocks: Vec<u8>,
}

impl KQuantMatrix {
    /// `rows × k` weights of `kind` from ggml's blocks; the byte count must be exactly theirs.
    pub fn from_ggml(kind: KQuant, bytes: &[u8], rows: usize, k: usize) -> Result<KQuantMatrix, KQuantError> {
        let ty = kind.ggml();
        if k == 0 || !k.is_multiple_of(QK_K) {
            return Err(KQuantError::Ragged { ty, rows, k, block: QK_K });
        }
        let expected = rows.checked_mul(k / QK_K).and_then(|n| n.checked_mul(kind.block_bytes()));
        let Some(expected) = expected.filter(|&e| e == bytes.len()) else {
            let expected = expected.unwrap_or(usize::MAX);
            return Err(KQuantError::BlockBytes { ty, rows, k, found: bytes.len(), expected });
        };
        debug_assert_eq!(bytes.len(), expected);
        Ok(KQuantMatrix { kind, rows, k, blocks: bytes.to_vec() })
    }

    pub fn superblocks(&self) -> usize {
        self.k / QK_K
    }

    fn block(&self, r: usize, s: usize) -> &[u8] {
        let bb = self.kind.block_bytes();
        let i = r * self.superblocks() + s;
        &self.blocks[i * bb..(i + 1) * bb]
    }

    /// The values, exactly as ggml's dequantiser gives them (row-major `[rows, k]`).
    pub fn dequantize(&self) -> Vec<f32> {
        ggml::dequantize_vec(self.kind.ggml(), &self.blocks, self.rows * self.k).expect("sized by from_ggml")
    }
}

impl PackedLayout {
    /// The layout of a `[rows, k]` matrix of `kind` kept as stored ([`crate::kquant`]). `k`
    /// must be a positive multiple of 256.
    pub fn new_kquant(rows: usize, k: usize, kind: KQuant) -> Result<PackedLayout, KQuantError> {
        if k == 0 || !k.is_multiple_of(QK_K) {
            return Err(KQuantError::Ragged { ty: kind.ggml(), rows, k, block: QK_K });
        }
        let mut l = PackedLayout::new(rows, k, 32, Bits::Int4)?;
        l.gs = kind.group();
        l.bits = match kind {
            KQuant::Q4K => Bits::Int4,
            KQuant::Q6K => Bits::Int8,
        };
        l.kq = Some(kind);
        Ok(l)
    }
}

/// The layout [`pack_into`] gives `m`.
pub fn layout_of(m: &KQuantMatrix) -> PackedLayout {
    PackedLayout::new_kquant(m.rows, m.k, m.kind).expect("a KQuantMatrix has whole super-blocks")
}

/// Offset of super-block `s`'s header in a row block.
#[inline]
pub fn sb_header_offset(s: usize) -> usize {
    s * SB_HEADER_BYTES
}

/// Q4_K's 6-bit scale and minimum of group `j` (ggml's `get_scale_min_k4`) from its 12 bytes.
fn q4k_scale_min(j: usize, q: &[u8; 12]) -> (u8, u8) {
    ggml::scale_min_k4(j, q)
}

/// The inverse of [`q4k_scale_min`] over all 8 groups: the 12 bytes.
fn q4k_pack_scales(sc: &[u8; 8], m: &[u8; 8]) -> [u8; 12] {
    let mut q = [0u8; 12];
    for j in 0..4 {
        q[j] = (sc[j] & 63) | ((sc[j + 4] >> 4) << 6);
        q[j + 4] = (m[j] & 63) | ((m[j + 4] >> 4) << 6);
        q[j + 8] = (sc[j + 4] & 0x0f) | ((m[j + 4] & 0x0f) << 4);
    }
    q
}

/// Code of element `e` (0..256) of a Q4_K block.
#[inline]
fn q4k_code(b: &BlockQ4K, e: usize) -> u8 {
    (b.qs[(e / 64) * 32 + e % 32] >> (4 * ((e % 64) / 32))) & 0x0f
}

/// Code (0..64) of element `e` (0..256) of a Q6_K block.
#[inline]
fn q6k_code(b: &BlockQ6K, e: usize) -> u8 {
    let (h, t, l) = (e / 128, (e % 128) / 32, e % 32);
    let lo = (b.ql[h * 64 + l + 32 * (t % 2)] >> (4 * (t / 2))) & 0x0f;
    let hi = (b.qh[h * 32 + l] >> (2 * t)) & 3;
    lo | (hi << 4)
}

/// Where element `kk` (0..group) of a group's codes lies in the group's bytes for row `j`:
/// (byte of the low nibble, its shift) and, for Q6_K, (byte of the high bits, their shift).
#[inline]
fn code_place(kind: KQuant, j: usize, kk: usize) -> ((usize, u32), (usize, u32)) {
    let (c, b) = (kk / 8, kk % 8);
    let lo = (c * CHUNK + 4 * j + b % 4, 4 * (b / 4) as u32);
    let hi = match kind {
        KQuant::Q4K => (0, 0),
        KQuant::Q6K => (2 * CHUNK + 4 * j + b % 4, 2 * (2 * c + b / 4) as u32),
    };
    (lo, hi)
}

/// Pack `m` into `out`, exactly `layout_of(m).bytes()` long.
pub fn pack_into(m: &KQuantMatrix, out: &mut [u8]) -> Result<PackedLayout, KQuantError> {
    let l = layout_of(m);
    if out.len() != l.bytes() {
        return Err(QuantError::BufferLen { found: out.len(), expected: l.bytes() }.into());
    }
    for (rb, dst) in out.chunks_exact_mut(l.block_bytes()).enumerate() {
        pack_block(m, rb, &l, dst);
    }
    Ok(l)
}

/// [`pack_into`] into a new buffer.
pub fn pack(m: &KQuantMatrix) -> Vec<u8> {
    let mut out = vec![0u8; layout_of(m).bytes()];
    pack_into(m, &mut out).expect("sized from the layout");
    out
}

/// Row block `rb` of `m` into `dst` (one row block's bytes).
fn pack_block(m: &KQuantMatrix, rb: usize, l: &PackedLayout, dst: &mut [u8]) {
    dst.fill(0);
    let kind = m.kind;
    let (gpsb, gs, gwb) = (kind.groups_per_sb(), kind.group(), kind.group_weight_bytes());
    for j in 0..ROW_BLOCK.min(m.rows.saturating_sub(rb * ROW_BLOCK)) {
        let r = rb * ROW_BLOCK + j;
        for s in 0..m.superblocks() {
            let hdr = sb_header_offset(s);
            let raw = m.block(r, s);
            let (code, d, dmin): (&dyn Fn(usize) -> u8, [u8; 2], [u8; 2]) = match kind {
                KQuant::Q4K => {
                    let b: &BlockQ4K = bytemuck::from_bytes(raw);
                    let scales: &[u8; 12] = &b.scales;
                    for g in 0..8 {
                        let (sc, mn) = q4k_scale_min(g, scales);
                        dst[hdr + 64 + 16 * g + j] = sc;
                        dst[hdr + 192 + 16 * g + j] = mn;
                    }
                    (&move |e| q4k_code(b, e), b.d, b.dmin)
                }
                KQuant::Q6K => {
                    let b: &BlockQ6K = bytemuck::from_bytes(raw);
                    for g in 0..16 {
                        dst[hdr + 64 + 16 * g + j] = b.scales[g] as u8;
                    }
                    (&move |e| q6k_code(b, e), b.d, [0, 0])
                }
            };
            dst[hdr + 2 * j..hdr + 2 * j + 2].copy_from_slice(&d);
            if kind == KQuant::Q4K {
                dst[hdr + 32 + 2 * j..hdr + 34 + 2 * j].copy_from_slice(&dmin);
            }
            for e in 0..QK_K {
                let g = s * gpsb + e / gs;
                let base = l.weights_offset(g);
                let q = code(e);
                let ((lo, ls), (hi, hs)) = code_place(kind, j, e % gs);
                dst[base + lo] |= (q & 0x0f) << ls;
                if kind == KQuant::Q6K {
                    dst[base + hi] |= (q >> 4) << hs;
                }
            }
            debug_assert!(gwb * gpsb * (s + 1) <= l.block_bytes());
        }
    }
}

/// The inverse of [`pack_into`]: the matrix `src` holds in layout `l` (its blocks byte for byte).
pub fn unpack(src: &[u8], l: &PackedLayout) -> Result<KQuantMatrix, KQuantError> {
    let kind = l.kq.ok_or(KQuantError::NotKQuant(*l))?;
    if src.len() < l.bytes() {
        return Err(QuantError::BufferLen { found: src.len(), expected: l.bytes() }.into());
    }
    let (sbs, gpsb, gs) = (l.k / QK_K, kind.groups_per_sb(), kind.group());
    let bb = kind.block_bytes();
    let mut blocks = vec![0u8; l.rows * sbs * bb];
    for r in 0..l.rows {
        let (rb, j) = (r / ROW_BLOCK, r % ROW_BLOCK);
        let blk = &src[l.block_range(rb)];
        for s in 0..sbs {
            let hdr = sb_header_offset(s);
            let codes: Vec<u8> = (0..QK_K)
                .map(|e| {
                    let base = l.weights_offset(s * gpsb + e / gs);
                    let ((lo, ls), (hi, hs)) = code_place(kind, j, e % gs);
                    let low = (blk[base + lo] >> ls) & 0x0f;
                    if kind == KQuant::Q6K {
                        low | (((blk[base + hi] >> hs) & 3) << 4)
                    } else {
                        low
                    }
                })
                .collect();
            let out = &mut blocks[(r * sbs + s) * bb..(r * sbs + s + 1) * bb];
            let d = [blk[hdr + 2 * j], blk[hdr + 2 * j + 1]];
            match kind {
                KQuant::Q4K => {
                    let b: &mut BlockQ4K = bytemuck::from_bytes_mut(out);
                    b.d = d;
                    b.dmin = [blk[hdr + 32 + 2 * j], blk[hdr + 33 + 2 * j]];
                    let sc: [u8; 8] = std::array::from_fn(|g| blk[hdr + 64 + 16 * g + j]);
                    let mn: [u8; 8] = std::array::from_fn(|g| blk[hdr + 192 + 16 * g + j]);
                    b.scales = q4k_pack_scales(&sc, &mn);
                    for (e, &q) in codes.iter().enumerate() {
                        b.qs[(e / 64) * 32 + e % 32] |= q << (4 * ((e % 64) / 32));
                    }
                }
                KQuant::Q6K => {
                    let b: &mut BlockQ6K = bytemuck::from_bytes_mut(out);
                    b.d = d;
                    b.scales = std::array::from_fn(|g| blk[hdr + 64 + 16 * g + j] as i8);
                    for (e, &q) in codes.iter().enumerate() {
                        let (h, t, ll) = (e / 128, (e % 128) / 32, e % 32);
                        b.ql[h * 64 + ll + 32 * (t % 2)] |= (q & 0x0f) << (4 * (t / 2));
                        b.qh[h * 32 + ll] |= (q >> 4) << (2 * t);
                    }
                }
            }
        }
    }
    Ok(KQuantMatrix { kind, rows: l.rows, k: l.k, blocks })
}

/// The fused gate+up layout of two equal-shaped matrices of one format.
pub fn w13_layout(gate: &KQuantMatrix, up: &KQuantMatrix) -> Result<PackedLayout, KQuantError> {
    if (gate.kind, gate.rows, gate.k) != (up.kind, up.rows, up.k) {
        return Err(KQuantError::W13Mismatch {
            gate: gate.kind,
            gate_rows: gate.rows,
            gate_k: gate.k,
            up: up.kind,
            up_rows: up.rows,
            up_k: up.k,
        });
    }
    if !gate.rows.is_multiple_of(ROW_BLOCK) {
        return Err(QuantError::W13Rows { rows: gate.rows }.into());
    }
    PackedLayout::new_kquant(2 * gate.rows, gate.k, gate.kind)
}

/// Fused gate+up (w13): the row blocks of `gate` and `up` interleaved, as
/// [`crate::cpu_layout::pack_w13_into`] does for INT4/INT8.
pub fn pack_w13_into(gate: &KQuantMatrix, up: &KQuantMatrix, out: &mut [u8]) -> Result<PackedLayout, KQuantError> {
    let l = w13_layout(gate, up)?;
    if out.len() != l.bytes() {
        return Err(QuantError::BufferLen { found: out.len(), expected: l.bytes() }.into());
    }
    let half = layout_of(gate);
    for (i, dst) in out.chunks_exact_mut(l.block_bytes()).enumerate() {
        pack_block(if i % 2 == 0 { gate } else { up }, i / 2, &half, dst);
    }
    Ok(l)
}

/// [`pack_w13_into`] into a new buffer.
pub fn pack_w13(gate: &KQuantMatrix, up: &KQuantMatrix) -> Result<(Vec<u8>, PackedLayout), KQuantError> {
    let l = w13_layout(gate, up)?;
    let mut out = vec![0u8; l.bytes()];
    pack_w13_into(gate, up, &mut out)?;
    Ok((out, l))
}

/// ggml's `rows × k` blocks of Q4_0, Q5_0 or Q8_0 (`d · (q − o)` per 32) as the symmetric INT8
/// g32 matrix of the same values: scale `d` (the f16 as stored), code `q − o`. Exact: the
/// kernels' `code · scale` is ggml's `(q − o) · d`.
pub fn ggml_int8_g32(ty: GgmlType, bytes: &[u8], rows: usize, k: usize) -> Result<QuantizedMatrix, KQuantError> {
    if k == 0 || !k.is_multiple_of(32) {
        return Err(KQuantError::Ragged { ty, rows, k, block: 32 });
    }
    if !matches!(ty, GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0) {
        return Err(KQuantError::NotInt8G32(ty));
    }
    let n = rows.saturating_mul(k / 32);
    let expected = n.saturating_mul(ty.block_bytes());
    if bytes.len() != expected || expected == usize::MAX {
        return Err(KQuantError::BlockBytes { ty, rows, k, found: bytes.len(), expected });
    }
    let mut q = vec![0i8; rows * k];
    let mut scales = Vec::with_capacity(n);
    for (raw, qg) in bytes.chunks_exact(ty.block_bytes()).zip(q.chunks_exact_mut(32)) {
        let d = match ty {
            GgmlType::Q4_0 => {
                let b: &BlockQ4_0 = bytemuck::from_bytes(raw);
                for j in 0..16 {
                    qg[j] = (b.qs[j] & 0x0f) as i8 - 8;
                    qg[j + 16] = (b.qs[j] >> 4) as i8 - 8;
                }
                b.d
            }
            GgmlType::Q5_0 => {
                let b: &BlockQ5_0 = bytemuck::from_bytes(raw);
                let qh = u32::from_le_bytes(b.qh);
                for j in 0..16 {
                    let (h0, h1) = ggml::q5_high(qh, j);
                    qg[j] = ((b.qs[j] & 0x0f) | h0) as i8 - 16;
                    qg[j + 16] = ((b.qs[j] >> 4) | h1) as i8 - 16;
                }
                b.d
            }
            _ => {
                let b: &BlockQ8_0 = bytemuck::from_bytes(raw);
                qg.copy_from_slice(&b.qs);
                b.d
            }
        };
        scales.push(f16::from_bits(u16::from_le_bytes(d)));
    }
    Ok(QuantizedMatrix { rows, k, gs: 32, bits: Bits::Int8, q, scales })
}

/// A `[rows, k]` matrix of `kind` with random codes, scales and minimums and finite f16 `d` /
/// `dmin` of magnitude 2^-11 .. 2^-8 (benchmarks and tests; `seed` picks the bytes).
pub fn test_matrix(kind: KQuant, rows: usize, k: usize, seed: u64) -> KQuantMatrix {
    let mut s = seed | 1;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let bb = kind.block_bytes();
    let mut bytes: Vec<u8> = (0..rows * (k / QK_K) * bb).map(|_| next() as u8).collect();
    let scales: &[usize] = match kind {
        KQuant::Q4K => &[0, 2],
        KQuant::Q6K => &[208],
    };
    for b in bytes.chunks_exact_mut(bb) {
        for &at in scales {
            let v = f16::from_f32((1 + next() % 100) as f32 / 100.0 * 2f32.powi(-8 - (next() % 4) as i32));
            b[at..at + 2].copy_from_slice(&v.to_bits().to_le_bytes());
        }
    }
    KQuantMatrix::from_ggml(kind, &bytes, rows, k).expect("sized from the shape")
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Random bytes as `rows × sbs` blocks of `kind` whose f16 fields are finite (NaN and
    /// infinity scales are never written by llama.cpp, and would make the value checks moot).
    pub(crate) fn random_blocks(kind: KQuant, rows: usize, sbs: usize, raw: &[u8]) -> Vec<u8> {
        let bb = kind.block_bytes();
        let mut out: Vec<u8> = raw.iter().cycle().take(rows * sbs * bb).copied().collect();
        for (i, b) in out.chunks_exact_mut(bb).enumerate() {
            let tame = |x: &mut [u8], salt: usize| {
                // exponents 8..=15 (2^-7 .. 1), any mantissa and sign
                let v = u16::from_le_bytes([x[0], x[1]]);
                let v = (v & 0x83ff) | ((8 + ((i + salt) % 8) as u16) << 10);
                x.copy_from_slice(&v.to_le_bytes());
            };
            match kind {
                KQuant::Q4K => {
                    tame(&mut b[0..2], 0);
                    tame(&mut b[2..4], 3);
                }
                KQuant::Q6K => tame(&mut b[208..210], 0),
            }
        }
        out
    }

    #[test]
    fn scale_packing_is_ggmls_inverse() {
        let sc = [1, 63, 17, 32, 48, 5, 60, 33];
        let m = [0, 62, 16, 1, 63, 47, 2, 31];
        let q = q4k_pack_scales(&sc, &m);
        for j in 0..8 {
            assert_eq!(q4k_scale_min(j, &q), (sc[j], m[j]), "group {j}");
        }
    }

    #[test]
    fn ragged_and_short_inputs_are_refused_naming_the_type() {
        let e = KQuantMatrix::from_ggml(KQuant::Q4K, &[0; 144], 1, 128).unwrap_err();
        assert!(e.to_string().contains("Q4_K [1, 128]"), "{e}");
        let e = KQuantMatrix::from_ggml(KQuant::Q6K, &[0; 209], 1, 256).unwrap_err();
        assert_eq!(e.to_string(), "Q6_K [1, 256]: 209 bytes of blocks, expected 210");
        assert!(ggml_int8_g32(GgmlType::Q4K, &[0; 144], 1, 256).is_err());
        assert!(ggml_int8_g32(GgmlType::Q5_0, &[0; 21], 1, 32).is_err());
        assert!(PackedLayout::new_kquant(16, 320, KQuant::Q4K).is_err());
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

        /// pack then unpack gives the blocks back byte for byte (ragged rows, several
        /// super-blocks, both formats, plain and fused).
        #[test]
        fn pack_unpack_round_trip(
            q6 in any::<bool>(),
            rows in 1usize..40,
            sbs in 1usize..4,
            raw in prop::collection::vec(any::<u8>(), 211..700),
        ) {
            let kind = if q6 { KQuant::Q6K } else { KQuant::Q4K };
            let bytes = random_blocks(kind, rows, sbs, &raw);
            let m = KQuantMatrix::from_ggml(kind, &bytes, rows, 256 * sbs).unwrap();
            let (p, l) = (pack(&m), layout_of(&m));
            prop_assert_eq!(p.len(), l.bytes());
            prop_assert_eq!(unpack(&p, &l).unwrap(), m.clone());
            let r16 = rows.div_ceil(16) * 16;
            let bytes16 = random_blocks(kind, r16, sbs, &raw);
            let g = KQuantMatrix::from_ggml(kind, &bytes16, r16, 256 * sbs).unwrap();
            let mut u = g.clone();
            u.blocks.reverse();
            // keep the f16 fields finite after the reversal
            u.blocks = random_blocks(kind, r16, sbs, &u.blocks);
            let (w13, l13) = pack_w13(&g, &u).unwrap();
            let (mut gp, mut up) = (Vec::new(), Vec::new());
            for i in 0..l13.row_blocks() {
                if i % 2 == 0 { gp.extend_from_slice(&w13[l13.block_range(i)]) } else { up.extend_from_slice(&w13[l13.block_range(i)]) }
            }
            let half = layout_of(&g);
            prop_assert_eq!(unpack(&gp, &half).unwrap(), g);
            prop_assert_eq!(unpack(&up, &half).unwrap(), u);
        }

        /// Q4_0 / Q5_0 / Q8_0 read as INT8 g32 hold ggml's dequantised values bit for bit.
        #[test]
        fn int8_g32_holds_ggmls_values(
            which in 0usize..3,
            rows in 1usize..5,
            groups in 1usize..5,
            raw in prop::collection::vec(any::<u8>(), 34 * 20),
        ) {
            let ty = [GgmlType::Q4_0, GgmlType::Q5_0, GgmlType::Q8_0][which];
            let k = 32 * groups;
            let bb = ty.block_bytes();
            let mut bytes = raw[..rows * groups * bb].to_vec();
            for b in bytes.chunks_exact_mut(bb) {
                b[1] &= 0x7b; // a finite f16 scale
            }
            let want = ggml::dequantize_vec(ty, &bytes, rows * k).unwrap();
            let m = ggml_int8_g32(ty, &bytes, rows, k).unwrap();
            let got = crate::group::dequantize(&m);
            prop_assert_eq!(
                got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            );
        }
    }
}
