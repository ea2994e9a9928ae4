//! MLA prefill attention in the decompressed form: the latent rows attended to are expanded with
//! `kv_b` into per-head keys (`nope`) and values (`v_dim`), a tile of key rows at a time, and each
//! head runs a flash-attention loop over them (blocks of queries × blocks of keys, online
//! softmax) whose products are [`crate::gemm`]'s blocked kernels.
//!
//! Per query row this is `Σ_d q·k` over `nope + rope` and `P·V` over `v_dim` (192 and 128 on
//! DeepSeek-V2) where the absorbed form ([`crate::attention::causal_attention`] over the latent)
//! does `latent + rope` and `latent` (576 and 512), at the price of expanding every key row once
//! per call (`heads × (nope + v_dim) × latent` multiply-adds a row): worth it when a call has many
//! query rows, not for decode.
//!
//! Key blocks and tiles sit at absolute positions (multiples of [`BLOCK_K`] and of the tile), and a
//! query row takes part only in the key blocks at or before its own position, each over the full
//! block width (keys past the row or the cache masked), so a row's arithmetic and its order do
//! not depend on the call it is in: a prompt prefilled in one call or in several (each on this
//! path) gives the same bits.

use std::cell::RefCell;

use krasis_core::spec::MlaDims;

use crate::aligned::AlignedVec;
use crate::expf::{exp_scalar, softmax_step};
use crate::gemm::gemm;
use crate::isa::{self, Isa};
use crate::par::DisjointPtr;
use crate::prefill_bf16::Bf16Tiles;
use crate::quant::{Bits, PackedLayout, ROW_BLOCK};

/// Query rows per task: a block's q (64 × 192 floats), output accumulator (64 × 128) and scores
/// stay in L2 beside the key block, and 512 tokens make 8 blocks per head (128 tasks over 16
/// heads) for the pool to balance.
pub const BLOCK_Q: usize = 64;
/// Keys per inner step: one 64 × 64 score block (16 KiB) per step, two micro-tile widths, and
/// few enough fully-masked columns on the diagonal.
pub const BLOCK_K: usize = 64;
/// Bytes of expanded keys and values held at once: the key rows are expanded a tile at a time
/// (the largest multiple of `BLOCK_K` rows that fits), so an 8K-token context needs no more
/// than this beside the cache (V2-Lite: 16 heads × 320 floats a row → 768-row tiles).
pub const KV_TILE_BYTES: usize = 16 << 20;

/// Columns of one panel of a head's expansion weights: one micro-tile width of
/// [`crate::gemm`], so each panel is a contiguous `latent × 64` operand (a `[latent][nope + v_dim]`
/// matrix puts its rows 1 KiB apart on V2-Lite, 16 of them to an L1 set).
const W_PANEL: usize = 64;
/// Expansion tasks per pool thread: each task dequantises its head's `kv_b` (512 KiB of f32 on
/// V2-Lite; ~14 µs with AVX-512, under 1 % of expanding a 768-row tile) once for all its blocks, so few long tasks; two per
/// thread keep the last ones from leaving threads idle.
const EXPAND_TASKS_PER_THREAD: usize = 2;

/// What the caller got wrong.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MlaPrefillError {
    #[error("MLA prefill: {what} holds {found} floats, the shapes need {expected}")]
    Len { what: &'static str, found: usize, expected: usize },
    #[error("MLA prefill: the cache holds {cached} rows, queries reach position {needed}")]
    Cache { cached: usize, needed: usize },
    #[error("MLA prefill: cache rows of {stride} floats cannot hold latent {latent} + rope {rope}")]
    Stride { stride: usize, latent: usize, rope: usize },
    #[error("MLA prefill: kv_b's packed {what} layout {layout:?} does not fit the dims")]
    Layout { what: &'static str, layout: PackedLayout },
}

/// `kv_b` as the prefill reads it: each task expands one head's weights into an f32 scratch of
/// `latent × (nope + v_dim)` floats for the key rows it expands, so no f32 copy is kept.
#[derive(Clone, Copy, Debug)]
pub enum KvBWeights<'a> {
    /// `[heads · (nope + v_dim), latent]` f32 rows: per head its `W_UK` rows, then its `W_UV`
    /// rows, as checkpoints store it.
    F32(&'a [f32]),
    /// Per head packed back to back (`krasis_quant::cpu_layout`, the dense-weight cache's form):
    /// `W_UKᵀ` `[latent, K ≥ nope]` in `uk` (columns past nope ignored) and `W_UV` `[v_dim,
    /// latent]` in `uv`.
    Packed { uk: &'a [u8], uk_layout: PackedLayout, uv: &'a [u8], uv_layout: PackedLayout },
}

impl KvBWeights<'_> {
    fn check(&self, d: &MlaDims) -> Result<(), MlaPrefillError> {
        match *self {
            KvBWeights::F32(w) => {
                let n = d.heads * (d.nope + d.v_dim) * d.latent;
                if w.len() < n {
                    return Err(MlaPrefillError::Len { what: "kv_b", found: w.len(), expected: n });
                }
            }
            KvBWeights::Packed { uk, uk_layout: lu, uv, uv_layout: lv } => {
                if lu.rows != d.latent || lu.k < d.nope || uk.len() < d.heads * lu.bytes() {
                    return Err(MlaPrefillError::Layout { what: "W_UK", layout: lu });
                }
                if lv.rows != d.v_dim || lv.k != d.latent || uv.len() < d.heads * lv.bytes() {
                    return Err(MlaPrefillError::Layout { what: "W_UV", layout: lv });
                }
            }
        }
        Ok(())
    }
}

/// Every element of one packed matrix (`krasis_quant::cpu_layout`: row blocks of 16 rows, per
/// group a scale header and 64-byte chunks of 4 (INT8) or 8 (INT4) k-steps) as
/// `f(row, column, q · scale)`, rows past `rows` skipped; one f16 conversion per (row, group).
#[inline]
fn for_each_packed(m: &[u8], l: &PackedLayout, rows: usize, mut f: impl FnMut(usize, usize, f32)) {
    let gs = l.gs;
    for rb in 0..rows.div_ceil(ROW_BLOCK) {
        let blk = &m[rb * l.block_bytes()..][..l.block_bytes()];
        let live = (rows - rb * ROW_BLOCK).min(ROW_BLOCK);
        for g in 0..l.groups() {
            let mut sc = [0f32; ROW_BLOCK];
            for (j, x) in sc.iter_mut().enumerate() {
                let so = l.scales_offset(g) + 2 * j;
                *x = half::f16::from_bits(u16::from_le_bytes([blk[so], blk[so + 1]])).to_f32();
            }
            let w = &blk[l.weights_offset(g)..][..l.group_weight_bytes()];
            let k0 = g * gs;
            match l.bits {
                Bits::Int8 => {
                    for (c4, chunk) in w.chunks_exact(64).enumerate() {
                        for (j, &s) in sc.iter().enumerate().take(live) {
                            for b in 0..4 {
                                f(rb * ROW_BLOCK + j, k0 + 4 * c4 + b, (chunk[4 * j + b] as i32 - 128) as f32 * s);
                            }
                        }
                    }
                }
                Bits::Int4 => {
                    for (c8, chunk) in w.chunks_exact(64).enumerate() {
                        for (j, &s) in sc.iter().enumerate().take(live) {
                            for b in 0..4 {
                                let byte = chunk[4 * j + b];
                                let r = rb * ROW_BLOCK + j;
                                f(r, k0 + 8 * c8 + b, ((byte & 0x0f) as i32 - 8) as f32 * s);
                                f(r, k0 + 8 * c8 + 4 + b, ((byte >> 4) as i32 - 8) as f32 * s);
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Float index of (latent row `j`, column `c`) in one head's expansion weights as
/// [`head_weights`] lays them out: panels of [`W_PANEL`] columns, each `[latent][width]`.
#[inline]
fn weight_index(lat: usize, per_head: usize, j: usize, c: usize) -> usize {
    let p0 = c - c % W_PANEL;
    p0 * lat + j * W_PANEL.min(per_head - p0) + c % W_PANEL
}

/// Head `hh`'s expansion weights `[latent][nope + v_dim]` (per latent index its `W_UK` column,
/// then its `W_UV` column) into `out`, in panels of [`W_PANEL`] columns: column `c` of latent
/// row `j` at `W_PANEL·latent·(c / W_PANEL) + j·w + c % W_PANEL`, `w` the panel's width. Packed
/// weights are dequantised exactly (`q · scale`, as `krasis_quant::group::dequantize`).
fn head_weights(isa: Isa, kv_b: &KvBWeights<'_>, d: &MlaDims, hh: usize, out: &mut [f32]) {
    let (lat, nope, per_head) = (d.latent, d.nope, d.nope + d.v_dim);
    #[cfg(target_arch = "x86_64")]
    if let (Isa::Avx512, KvBWeights::Packed { uk, uk_layout: lu, uv, uv_layout: lv }) = (isa, *kv_b) {
        if lu.bits == Bits::Int8 && lv.bits == Bits::Int8 && nope.is_multiple_of(16) {
            let (uk, uv) = (&uk[hh * lu.bytes()..][..lu.bytes()], &uv[hh * lv.bytes()..][..lv.bytes()]);
            // SAFETY: the active ISA is at most what the CPU has; the slices hold one head's
            // matrices of these layouts (checked by `KvBWeights::check`), `out` lat × per_head.
            unsafe { head_weights_int8_avx512(uk, &lu, uv, &lv, d, out) };
            return;
        }
    }
    let _ = isa;
    let at = |j: usize, c: usize| weight_index(lat, per_head, j, c);
    match *kv_b {
        KvBWeights::F32(w) => {
            for c in 0..per_head {
                let row = &w[(hh * per_head + c) * lat..][..lat];
                for (j, &x) in row.iter().enumerate() {
                    out[at(j, c)] = x;
                }
            }
        }
        KvBWeights::Packed { uk, uk_layout: lu, uv, uv_layout: lv } => {
            let (uk, uv) = (&uk[hh * lu.bytes()..][..lu.bytes()], &uv[hh * lv.bytes()..][..lv.bytes()]);
            for_each_packed(uk, &lu, lat, |j, c, x| {
                if c < nope {
                    out[at(j, c)] = x;
                }
            });
            for_each_packed(uv, &lv, d.v_dim, |c, j, x| out[at(j, nope + c)] = x);
        }
    }
}

/// [`head_weights`] of INT8 packed weights with `nope` a multiple of 16, 16 columns at a time
/// (the same exact products `q · scale`, so the same bits as the scalar loops).
///
/// # Safety
/// The CPU has AVX-512 F/BW; `uk`, `uv` hold one head's matrices of layouts `lu` (`[latent, K ≥
/// nope]`) and `lv` (`[v_dim, latent]`); `out` holds `latent · (nope + v_dim)` floats.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn head_weights_int8_avx512(
    uk: &[u8],
    lu: &PackedLayout,
    uv: &[u8],
    lv: &PackedLayout,
    d: &MlaDims,
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
    let (lat, nope, per_head) = (d.latent, d.nope, d.nope + d.v_dim);
    assert!(out.len() >= lat * per_head && uk.len() >= lu.bytes() && uv.len() >= lv.bytes());
    let o = out.as_mut_ptr();
    // c a multiple of 16 here (16 columns never straddle a panel: W_PANEL is a multiple of 16).
    let at = |j: usize, c: usize| weight_index(lat, per_head, j, c);
    let bias = _mm512_set1_epi32(128);
    let scales = |blk: *const u8, l: &PackedLayout, g: usize| {
        _mm512_cvtph_ps(_mm256_loadu_si256(blk.add(l.scales_offset(g)) as *const __m256i))
    };
    // W_UKᵀ: a row block is 16 latent rows; 4 chunks hold 16 columns of them, each chunk's
    // dword j the 4 bytes of row j. A 4 × 4 dword transpose per 128-bit lane gathers a row's 16.
    for rb in 0..lat.div_ceil(ROW_BLOCK) {
        let blk = uk.as_ptr().add(rb * lu.block_bytes());
        let live = (lat - rb * ROW_BLOCK).min(ROW_BLOCK);
        for g in 0..lu.groups() {
            let mut sc = [0f32; ROW_BLOCK];
            _mm512_storeu_ps(sc.as_mut_ptr(), scales(blk, lu, g));
            let w = blk.add(lu.weights_offset(g));
            for q in 0..lu.gs / 16 {
                let c0 = g * lu.gs + 16 * q;
                if c0 >= nope {
                    break;
                }
                let x: [__m512i; 4] = std::array::from_fn(|t| _mm512_loadu_si512(w.add((4 * q + t) * 64) as *const _));
                let (t0, t1) = (_mm512_unpacklo_epi32(x[0], x[1]), _mm512_unpackhi_epi32(x[0], x[1]));
                let (t2, t3) = (_mm512_unpacklo_epi32(x[2], x[3]), _mm512_unpackhi_epi32(x[2], x[3]));
                let u = [
                    _mm512_unpacklo_epi64(t0, t2),
                    _mm512_unpackhi_epi64(t0, t2),
                    _mm512_unpacklo_epi64(t1, t3),
                    _mm512_unpackhi_epi64(t1, t3),
                ];
                // Row 4·lane + i is lane `lane` of u[i].
                let mut bytes = [0u8; 256];
                for (i, &ui) in u.iter().enumerate() {
                    _mm512_storeu_si512(bytes.as_mut_ptr().add(64 * i) as *mut _, ui);
                }
                for (jj, &s) in sc.iter().enumerate().take(live) {
                    let b16 = _mm_loadu_si128(bytes.as_ptr().add(64 * (jj % 4) + 16 * (jj / 4)) as *const __m128i);
                    let v = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(b16), bias));
                    _mm512_storeu_ps(o.add(at(rb * ROW_BLOCK + jj, c0)), _mm512_mul_ps(v, _mm512_set1_ps(s)));
                }
            }
        }
    }
    // W_UV: a row block is 16 value columns; byte b of each dword of a chunk is one latent row's
    // 16 values.
    let lo = _mm512_set1_epi32(0xff);
    for rb in 0..d.v_dim.div_ceil(ROW_BLOCK) {
        let blk = uv.as_ptr().add(rb * lv.block_bytes());
        let keep: __mmask16 = crate::isa::lane_mask16(rb * ROW_BLOCK, d.v_dim);
        for g in 0..lv.groups() {
            let sv = scales(blk, lv, g);
            let w = blk.add(lv.weights_offset(g));
            for c4 in 0..lv.gs / 4 {
                let x = _mm512_loadu_si512(w.add(c4 * 64) as *const _);
                for b in 0..4 {
                    let byte = _mm512_and_si512(_mm512_srlv_epi32(x, _mm512_set1_epi32(8 * b as i32)), lo);
                    let v = _mm512_cvtepi32_ps(_mm512_sub_epi32(byte, bias));
                    let j = g * lv.gs + 4 * c4 + b;
                    _mm512_mask_storeu_ps(o.add(at(j, nope + rb * ROW_BLOCK)), keep, _mm512_mul_ps(v, sv));
                }
            }
        }
    }
}

/// One call's inputs.
#[derive(Clone, Copy, Debug)]
pub struct MlaPrefillInputs<'a> {
    pub dims: MlaDims,
    /// `[t, heads, nope + rope]`: per head the nope part, then the rotated rope part.
    pub q: &'a [f32],
    pub t: usize,
    /// Position of the first query row; query `i` sees cache rows `0..=q_start + i`.
    pub q_start: usize,
    /// Cache rows `[rows, stride]`: the normalised latent, then the rotated rope key.
    pub cache: &'a [f32],
    pub stride: usize,
    pub kv_b: KvBWeights<'a>,
    pub scale: f32,
}

/// Rows of one tile of expanded keys and values for these dims (a multiple of [`BLOCK_K`]).
pub fn tile_rows(dims: &MlaDims) -> usize {
    let per_row = (dims.heads * (dims.nope + dims.rope + dims.v_dim)).max(1) * 4;
    (KV_TILE_BYTES / per_row / BLOCK_K).max(1) * BLOCK_K
}

/// Floats written through from several tasks, each to its own elements (each use says which;
/// the dispatch returns only when every task is done).
type Shared = DisjointPtr<f32>;

/// One tile of expanded key rows `[start, start + rows)` (`rows ≤ cap`, zero past the cache): per
/// head and block of [`BLOCK_K`] rows the keys transposed, `[nope + rope][BLOCK_K]` (the nope part,
/// then the shared rope part copied beside it: one contiguous 48 KiB operand of one product per
/// score block on V2-Lite, where a `[nope][cap]` buffer put its rows 4 KiB apart, all in the same
/// L1 sets), and per head `[cap][v_dim]` values.
struct Tile<'a> {
    start: usize,
    cap: usize,
    kv: TileKv<'a>,
}

/// A tile's expanded keys and values: f32 for the f32 kernels, or BF16 B-tile panels for the
/// tiles ([`attend_tiles`]): per head and block of [`BLOCK_K`] keys, the keys as a panel of
/// `BLOCK_K / 16` column blocks over K = `nope + rope` (the scores' B), and the values as a panel
/// of `v_dim / 16` (rounded up) column blocks over K = `BLOCK_K` (the output's B), both in
/// [`crate::quant::bf16`]'s layout.
#[derive(Clone, Copy)]
enum TileKv<'a> {
    F32 { k: &'a [f32], v: &'a [f32] },
    Bf16 { k: &'a [u16], v: &'a [u16] },
}

thread_local! {
    /// Per-thread scratch of the tasks (scores, output rows, softmax state, expanded rows).
    static SCRATCH: RefCell<AlignedVec<f32>> = const { RefCell::new(AlignedVec::new()) };
    /// Per-thread f32 expansion weights of one head ([`head_weights`]).
    static WEIGHTS: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// The calling thread's tile buffer, reused across calls and layers.
    static TILE: RefCell<AlignedVec<f32>> = const { RefCell::new(AlignedVec::new()) };
    /// The calling thread's latent rows of a tile as BF16, tiled (the BF16 expansion's A).
    static LATENT: RefCell<AlignedVec<u16>> = const { RefCell::new(AlignedVec::new()) };
    /// Per-thread BF16 panel of one head's expansion weights (the BF16 expansion's B).
    static PANEL: RefCell<AlignedVec<u16>> = const { RefCell::new(AlignedVec::new()) };
    /// The calling thread's tile of BF16 key and value panels ([`TileKv::Bf16`]).
    static TILE_BF16: RefCell<AlignedVec<u16>> = const { RefCell::new(AlignedVec::new()) };
    /// Per-thread BF16 operands of the attention on tiles: a query block's rows, then its
    /// probabilities, both tiled.
    static ATTEND_BF16: RefCell<AlignedVec<u16>> = const { RefCell::new(AlignedVec::new()) };
}

/// The tiles the expansion runs on for these dims, or `None` for the f32 kernels: the prefill's
/// BF16 tiles ([`crate::prefill_bf16::tiles`]) when the latent is a whole number of tile K steps,
/// unless `KRASIS_MLA_EXPAND=f32`. Chosen per process and dims, never per call, so a prompt split
/// into calls expands every row the same way.
pub fn expand_tiles(dims: &MlaDims) -> Option<Bf16Tiles> {
    let f32_asked = krasis_core::knobs::knobs().mla_expand_f32;
    if f32_asked || !dims.latent.is_multiple_of(crate::quant::amx::bf16::TILE_K) {
        return None;
    }
    crate::prefill_bf16::applies(isa::active(), usize::MAX, dims.latent)
}

/// The tiles the attention itself runs on for these dims, or `None` for the f32 kernels: the
/// expansion's tiles ([`expand_tiles`]) (queries and keys zero-padded to whole tile K steps),
/// unless `KRASIS_MLA_ATTEND=f32`. The scores `q·k` and the products `p·v` then take BF16 operands
/// (queries, keys, probabilities and values rounded once each) with f32 sums; the online softmax
/// stays in f32. Chosen per process and dims, never per call.
pub fn attend_tiles(dims: &MlaDims) -> Option<Bf16Tiles> {
    let f32_asked = krasis_core::knobs::knobs().mla_attend_f32;
    if f32_asked || panel_qk(dims) > MAX_PANEL_QK {
        return None;
    }
    expand_tiles(dims)
}

/// Causal MLA attention of `t` new query rows over cache rows `0..q_start + t` in the
/// decompressed form; writes `out` `[t, heads, v_dim]` (the per-head values, before `o_proj`).
pub fn mla_prefill_attention(p: &MlaPrefillInputs<'_>, out: &mut [f32]) -> Result<(), MlaPrefillError> {
    let MlaDims { heads: h, nope, rope, v_dim: vd, latent: lat } = p.dims;
    let qk = nope + rope;
    let len = |what, found, expected| {
        if found < expected {
            Err(MlaPrefillError::Len { what, found, expected })
        } else {
            Ok(())
        }
    };
    len("q", p.q.len(), p.t * h * qk)?;
    len("out", out.len(), p.t * h * vd)?;
    p.kv_b.check(&p.dims)?;
    if p.stride < lat + rope {
        return Err(MlaPrefillError::Stride { stride: p.stride, latent: lat, rope });
    }
    let keys = p.q_start + p.t;
    if p.t == 0 || h == 0 {
        return Ok(());
    }
    let cached = if p.cache.len() >= lat + rope { (p.cache.len() - lat - rope) / p.stride + 1 } else { 0 };
    if cached < keys {
        return Err(MlaPrefillError::Cache { cached, needed: keys });
    }
    let cap = tile_rows(&p.dims).min(keys.next_multiple_of(BLOCK_K));
    let (expand, attend) = call_tiles(p);
    run(p, out, cap, expand, attend);
    Ok(())
}

/// The tiles a call's expansion and attention run on: [`expand_tiles`] and [`attend_tiles`] for
/// packed (quantised) `kv_b`, whose fidelity is judged by the quantised bounds; f32 weights (the
/// reference engine) keep the f32 kernels, so the reference path is f32 on every CPU.
fn call_tiles(p: &MlaPrefillInputs<'_>) -> (Option<Bf16Tiles>, Option<Bf16Tiles>) {
    match p.kv_b {
        KvBWeights::F32(_) => (None, None),
        KvBWeights::Packed { .. } => (expand_tiles(&p.dims), attend_tiles(&p.dims)),
    }
}

/// Nanoseconds spent so far expanding the latent cache and attending (for benches).
pub fn phase_ns() -> [u64; 2] {
    PHASE_NS.get()
}

static PHASE_NS: crate::phase_ns::PhaseNs<2> = crate::phase_ns::PhaseNs::new();

/// [`mla_prefill_attention`] with tiles of `cap` rows (a multiple of [`BLOCK_K`]), the expansion
/// on `tiles` (or the f32 kernels), the attention on `attend` (or the f32 kernels), inputs
/// checked.
fn run(p: &MlaPrefillInputs<'_>, out: &mut [f32], cap: usize, tiles: Option<Bf16Tiles>, attend: Option<Bf16Tiles>) {
    let MlaDims { heads: h, nope, rope, v_dim: vd, .. } = p.dims;
    let keys = p.q_start + p.t;
    let isa = isa::active();
    // Softmax state per (row, head): running max, running sum.
    let mut state = vec![0f32; p.t * h * 2];
    let qk = nope + rope;
    let mut each_tile = |mut kv: KvOut<'_>| {
        let mut start = 0;
        while start < keys {
            let rows = cap.min(keys - start);
            let mut clock = std::time::Instant::now();
            expand_tile(isa, tiles, p, start, rows, cap, kv.ptrs());
            PHASE_NS.lap(&mut clock, 0);
            let tile = Tile { start, cap, kv: kv.view() };
            attend_tile(isa, attend, p, &tile, out, &mut state);
            PHASE_NS.lap(&mut clock, 1);
            start += cap;
        }
    };
    // Every element is written by `expand_tile` before it is read: no clearing.
    match attend {
        None => TILE.with_borrow_mut(|buf| {
            let need = cap * h * (qk + vd);
            buf.grow(need);
            let (k, v) = buf[..need].split_at_mut(h * qk * cap);
            each_tile(KvOut::F32 { k, v })
        }),
        Some(_) => TILE_BF16.with_borrow_mut(|buf| {
            let qkp = panel_qk(&p.dims);
            let need = cap * h * (qkp + vd.next_multiple_of(ROW_BLOCK));
            buf.grow(need);
            let (k, v) = buf[..need].split_at_mut(h * qkp * cap);
            each_tile(KvOut::Bf16 { k, v })
        }),
    }
}

/// Where [`expand_tile`] writes a tile (the buffers of [`TileKv`]).
enum KvOut<'a> {
    F32 { k: &'a mut [f32], v: &'a mut [f32] },
    Bf16 { k: &'a mut [u16], v: &'a mut [u16] },
}

impl KvOut<'_> {
    fn ptrs(&mut self) -> KvPtr {
        match self {
            KvOut::F32 { k, v } => KvPtr::F32(DisjointPtr(k.as_mut_ptr()), DisjointPtr(v.as_mut_ptr())),
            KvOut::Bf16 { k, v } => KvPtr::Bf16(DisjointPtr(k.as_mut_ptr()), DisjointPtr(v.as_mut_ptr())),
        }
    }

    fn view(&self) -> TileKv<'_> {
        match self {
            KvOut::F32 { k, v } => TileKv::F32 { k, v },
            KvOut::Bf16 { k, v } => TileKv::Bf16 { k, v },
        }
    }
}

/// The tile buffers as the expansion tasks write them (each task its own blocks).
#[derive(Clone, Copy)]
enum KvPtr {
    F32(Shared, Shared),
    Bf16(DisjointPtr<u16>, DisjointPtr<u16>),
}

/// Expands cache rows `[start, start + rows)` into the tile buffers: tasks of one head and a run
/// of `BLOCK_K`-row blocks each, every task first dequantising its head's weights; rows past
/// `rows` zeroed (blocks past the last row are never read). With `tiles`, the latent rows are
/// rounded to BF16 once for all heads and each block is one tile matmul against the head's
/// weights as a BF16 panel (`latent` a multiple of the tile K).
#[allow(clippy::too_many_arguments)]
fn expand_tile(
    isa: Isa,
    tiles: Option<Bf16Tiles>,
    p: &MlaPrefillInputs<'_>,
    start: usize,
    rows: usize,
    cap: usize,
    kv: KvPtr,
) {
    let MlaDims { heads: h, nope, rope, v_dim: vd, latent: lat } = p.dims;
    let (per_head, qk) = (nope + vd, nope + rope);
    let blocks = cap / BLOCK_K;
    let used = rows.div_ceil(BLOCK_K);
    let runs = (EXPAND_TASKS_PER_THREAD * crate::par::threads()).div_ceil(h).clamp(1, used.max(1));
    // The tile product's rows are padded to whole column blocks of 16.
    let ts = if tiles.is_some() { per_head.next_multiple_of(ROW_BLOCK) } else { per_head };
    LATENT.with_borrow_mut(|lat_bf16| {
        if tiles.is_some() {
            latent_to_bf16(p, start, rows, used * BLOCK_K, lat_bf16);
        }
        let lat_bf16: &[u16] = lat_bf16;
        crate::par::for_each(h * runs, &|task| {
            let (hh, run) = (task / runs, task % runs);
            WEIGHTS.with_borrow_mut(|w| {
                w.resize(lat * per_head, 0.0);
                head_weights(isa, &p.kv_b, &p.dims, hh, w);
                PANEL.with_borrow_mut(|panel| {
                    if tiles.is_some() {
                        head_panel(w, lat, per_head, panel);
                    }
                    SCRATCH.with_borrow_mut(|tmp| {
                        tmp.resize(BLOCK_K * ts, 0.0);
                        for b in run * used / runs..(run + 1) * used / runs {
                            let r0 = b * BLOCK_K;
                            let n = (rows - r0).min(BLOCK_K);
                            let c = &p.cache[(start + r0) * p.stride..];
                            match tiles {
                                Some(t) => {
                                    let mtiles = n.div_ceil(ROW_BLOCK);
                                    tmp[mtiles * ROW_BLOCK * ts..].fill(0.0);
                                    // SAFETY: the latent buffer holds `used` blocks of BLOCK_K rows
                                    // (rows past `rows` zero), `lat` a multiple of the tile K; the
                                    // panel `ts / 16` blocks over K = lat; tmp BLOCK_K rows of ts.
                                    unsafe {
                                        crate::prefill_bf16::tiles_on_panel(
                                            t,
                                            panel,
                                            ts / ROW_BLOCK,
                                            lat,
                                            lat_bf16.as_ptr().add(r0 * lat),
                                            mtiles,
                                            tmp.as_mut_ptr(),
                                            ts,
                                        )
                                    };
                                }
                                None => {
                                    tmp[n * per_head..].fill(0.0);
                                    for p0 in (0..per_head).step_by(W_PANEL) {
                                        let pw = W_PANEL.min(per_head - p0);
                                        let wp = &w[p0 * lat..][..lat * pw];
                                        gemm(isa, (n, pw, lat), c, p.stride, wp, pw, &mut tmp[p0..], per_head, false);
                                    }
                                }
                            }
                            // SAFETY: task (hh, run) alone writes key blocks of its run of head hh and
                            // their value rows; both lie inside the buffers (`blocks` key blocks, cap
                            // value rows, of `vd` floats or `vd` rounded up to 16 BF16 values).
                            unsafe {
                                match kv {
                                    KvPtr::F32(kp, vp) => scatter_block(
                                        p,
                                        tmp,
                                        ts,
                                        c,
                                        n,
                                        kp.at((hh * blocks + b) * qk * BLOCK_K),
                                        vp.at((hh * cap + r0) * vd),
                                    ),
                                    KvPtr::Bf16(kp, vp) => scatter_block_bf16(
                                        p,
                                        tmp,
                                        ts,
                                        c,
                                        n,
                                        kp.get().add((hh * blocks + b) * panel_qk(&p.dims) * BLOCK_K),
                                        vp.get().add((hh * cap + r0) * vd.next_multiple_of(ROW_BLOCK)),
                                    ),
                                }
                            };
                        }
                    });
                });
            });
        });
    });
}

/// Cache rows `[start, start + rows)`'s latent as BF16 in the tiled layout into `dst`
/// (`padded_rows` rows, those past `rows` zero), rows split over the pool.
fn latent_to_bf16(p: &MlaPrefillInputs<'_>, start: usize, rows: usize, padded_rows: usize, dst: &mut AlignedVec<u16>) {
    let lat = p.dims.latent;
    dst.grow(padded_rows * lat);
    let len = padded_rows * lat;
    let dp = crate::par::DisjointPtr(dst.as_mut_ptr());
    let per = rows.div_ceil(crate::par::threads().max(1)).max(1);
    crate::par::for_each(rows.div_ceil(per), &|t| {
        // SAFETY: task t alone writes rows [t·per, (t + 1)·per) (tiled rows are disjoint runs of
        // 32 elements); `len` elements allocated above.
        let d = unsafe { std::slice::from_raw_parts_mut(dp.get(), len) };
        for i in t * per..((t + 1) * per).min(rows) {
            crate::prefill_bf16::convert_row(&p.cache[(start + i) * p.stride..][..lat], i, lat, d);
        }
    });
    crate::prefill_bf16::zero_padding_rows(rows, padded_rows, lat, &mut dst[..len]);
}

/// Head weights `w` (`[latent][nope + v_dim]` in [`head_weights`]' panels) as a BF16 B-tile panel
/// per 16 output columns (`crate::quant::bf16`'s layout; columns past `per_head` zero).
fn head_panel(w: &[f32], lat: usize, per_head: usize, panel: &mut AlignedVec<u16>) {
    let nb = per_head.div_ceil(ROW_BLOCK);
    panel.resize(nb * lat * ROW_BLOCK, 0);
    let at = |j: usize, c: usize| weight_index(lat, per_head, j, c);
    // 16 columns of a row lie side by side in one panel (W_PANEL a multiple of 16), but for the
    // last block's columns past `per_head`.
    let column16 = |j: usize, c0: usize, buf: &mut [f32; ROW_BLOCK]| -> usize {
        let live = (per_head - c0).min(ROW_BLOCK);
        let at0 = at(j, c0);
        buf[..live].copy_from_slice(&w[at0..at0 + live]);
        buf[live..].fill(0.0);
        live
    };
    let (mut lo, mut hi) = ([0f32; ROW_BLOCK], [0f32; ROW_BLOCK]);
    for cb in 0..nb {
        let blk = &mut panel[cb * lat * ROW_BLOCK..(cb + 1) * lat * ROW_BLOCK];
        for r in 0..lat / 2 {
            column16(2 * r, cb * ROW_BLOCK, &mut lo);
            column16(2 * r + 1, cb * ROW_BLOCK, &mut hi);
            crate::quant::bf16::pair_row(&lo, &hi, &mut blk[r * 2 * ROW_BLOCK..(r + 1) * 2 * ROW_BLOCK]);
        }
    }
}

/// One block's expanded rows `tmp` `[BLOCK_K][ts ≥ nope + v_dim]` (the first `n` real, the rest
/// zero) into its key block (`[nope + rope][BLOCK_K]`, the rope part from the cache rows `c`
/// starting at the block's first row, zero past `n`) and value rows (`[BLOCK_K][v_dim]`).
///
/// # Safety
/// `kblk` and `vrows` point to `(nope + rope)·BLOCK_K` and `BLOCK_K·v_dim` floats no one else
/// touches meanwhile.
unsafe fn scatter_block(
    p: &MlaPrefillInputs<'_>,
    tmp: &[f32],
    ts: usize,
    c: &[f32],
    n: usize,
    kblk: *mut f32,
    vrows: *mut f32,
) {
    let MlaDims { nope, rope, v_dim: vd, latent: lat, .. } = p.dims;
    for d in 0..nope {
        for r in 0..BLOCK_K {
            *kblk.add(d * BLOCK_K + r) = tmp[r * ts + d];
        }
    }
    for d in 0..rope {
        for r in 0..BLOCK_K {
            *kblk.add((nope + d) * BLOCK_K + r) = if r < n { c[r * p.stride + lat + d] } else { 0.0 };
        }
    }
    for r in 0..BLOCK_K {
        std::ptr::copy_nonoverlapping(tmp[r * ts + nope..].as_ptr(), vrows.add(r * vd), vd);
    }
}

/// `nope + rope` rounded up to whole tile K steps: the keys' and queries' width on the tiles
/// (zero past `nope + rope`).
fn panel_qk(dims: &MlaDims) -> usize {
    (dims.nope + dims.rope).next_multiple_of(crate::quant::amx::bf16::TILE_K)
}

/// Largest `nope + rope` the attention on the tiles takes (a key row's BF16 scratch on the stack;
/// DeepSeek's MLA models have 192).
const MAX_PANEL_QK: usize = 1024;

/// [`scatter_block`] into BF16 panels ([`TileKv::Bf16`]): the block's keys (`[BLOCK_K][nope +
/// rope]`, zero past `n`) as `BLOCK_K / 16` column blocks over K = [`panel_qk`], its values as
/// `v_dim / 16` (rounded up; columns past `v_dim` zero) column blocks over K = `BLOCK_K`.
///
/// # Safety
/// `kblk` and `vblk` point to `panel_qk·BLOCK_K` and `BLOCK_K·v_dim` (rounded up to 16) values no
/// one else touches meanwhile.
unsafe fn scatter_block_bf16(
    p: &MlaPrefillInputs<'_>,
    tmp: &[f32],
    ts: usize,
    c: &[f32],
    n: usize,
    kblk: *mut u16,
    vblk: *mut u16,
) {
    use crate::quant::bf16::{bf16_bits, pair_row, to_bf16};
    let MlaDims { nope, rope, v_dim: vd, latent: lat, .. } = p.dims;
    let (qk, qkp) = (nope + rope, panel_qk(&p.dims));
    // Keys as BF16 rows first (nope, then rope; zero past `n` and past `qk`), then each key's
    // dim pairs transposed into the panel: key j of column block cb, dims (2r, 2r + 1) at pair
    // row r, words 2j and 2j + 1.
    let mut row = [0u16; MAX_PANEL_QK];
    for cb in 0..BLOCK_K / ROW_BLOCK {
        let dst = std::slice::from_raw_parts_mut(kblk.add(cb * qkp * ROW_BLOCK), qkp * ROW_BLOCK);
        for j in 0..ROW_BLOCK {
            let r = cb * ROW_BLOCK + j;
            to_bf16(&tmp[r * ts..r * ts + nope], &mut row[..nope]);
            if r < n {
                to_bf16(&c[r * p.stride + lat..][..rope], &mut row[nope..qk]);
            } else {
                row[nope..qk].fill(0);
            }
            for (pr, w) in row[..qkp].chunks_exact(2).enumerate() {
                dst[(pr * ROW_BLOCK + j) * 2..][..2].copy_from_slice(w);
            }
        }
    }
    // Values: column block cb holds value columns 16·cb.., one pair row per two keys.
    let vdp = vd.next_multiple_of(ROW_BLOCK);
    for cb in 0..vdp / ROW_BLOCK {
        let dst = std::slice::from_raw_parts_mut(vblk.add(cb * BLOCK_K * ROW_BLOCK), BLOCK_K * ROW_BLOCK);
        let c0 = nope + cb * ROW_BLOCK;
        let live = (vd - cb * ROW_BLOCK).min(ROW_BLOCK);
        for r in 0..BLOCK_K / 2 {
            let row = &mut dst[r * 2 * ROW_BLOCK..(r + 1) * 2 * ROW_BLOCK];
            let (lo, hi) = (&tmp[2 * r * ts + c0..], &tmp[(2 * r + 1) * ts + c0..]);
            if live == ROW_BLOCK {
                pair_row(&lo[..ROW_BLOCK], &hi[..ROW_BLOCK], row);
            } else {
                for j in 0..ROW_BLOCK {
                    row[2 * j] = if j < live { bf16_bits(lo[j]) } else { 0 };
                    row[2 * j + 1] = if j < live { bf16_bits(hi[j]) } else { 0 };
                }
            }
        }
    }
}

/// Runs every (head, query block) that sees a key of `tile` over its key blocks, heaviest first,
/// on `attend`'s tiles when the tile holds BF16 panels.
fn attend_tile(
    isa: Isa,
    attend: Option<Bf16Tiles>,
    p: &MlaPrefillInputs<'_>,
    tile: &Tile<'_>,
    out: &mut [f32],
    state: &mut [f32],
) {
    let h = p.dims.heads;
    let end = p.q_start + p.t;
    // Query blocks at absolute positions: block b holds rows at positions [b·BLOCK_Q, +BLOCK_Q).
    let (first, last) = (p.q_start / BLOCK_Q, (end - 1) / BLOCK_Q);
    // Blocks whose last row is before the tile see none of it.
    let from = first.max(tile.start / BLOCK_Q);
    if from > last {
        return;
    }
    let n_blocks = last - from + 1;
    let (op, sp) = (DisjointPtr(out.as_mut_ptr()), DisjointPtr(state.as_mut_ptr()));
    crate::par::for_each(h * n_blocks, &|task| {
        let (b, hh) = (last - task / h, task % h);
        let rows = (b * BLOCK_Q).max(p.q_start)..((b + 1) * BLOCK_Q).min(end);
        // SAFETY: (head hh, query rows `rows`) belongs to this task alone in this dispatch.
        unsafe {
            match (tile.kv, attend) {
                (TileKv::F32 { k, v }, _) => attend_block(isa, p, tile, k, v, hh, rows, op, sp),
                (TileKv::Bf16 { k, v }, Some(t)) => attend_block_bf16(t, isa, p, tile, k, v, hh, rows, op, sp),
                (TileKv::Bf16 { .. }, None) => unreachable!("BF16 panels are built for the tiles only"),
            }
        };
    });
}

/// Flash-attention loop of head `hh`'s query rows at positions `rows` over the tile's key blocks
/// up to the last row's position. Loads the rows' running output and softmax state (fresh in the
/// first tile), stores them back, normalised after the tile holding the rows' own positions.
///
/// # Safety
/// No other thread touches `out`'s or `state`'s elements of (these rows, head `hh`) meanwhile.
#[allow(clippy::too_many_arguments)]
unsafe fn attend_block(
    isa: Isa,
    p: &MlaPrefillInputs<'_>,
    tile: &Tile<'_>,
    keys: &[f32],
    values: &[f32],
    hh: usize,
    rows: std::ops::Range<usize>,
    out: Shared,
    state: Shared,
) {
    let MlaDims { heads: h, nope, rope, v_dim: vd, .. } = p.dims;
    let qk = nope + rope;
    let nr = rows.len();
    let i0 = rows.start - p.q_start;
    let first_tile = tile.start == 0;
    let done = tile.start + tile.cap >= rows.end;
    SCRATCH.with_borrow_mut(|buf| {
        // Every element read below is written first in this call: grown, not cleared.
        buf.grow(BLOCK_Q * (BLOCK_K + vd + 2));
        let (s, rest) = buf.split_at_mut(BLOCK_Q * BLOCK_K);
        let (o, ml) = rest.split_at_mut(BLOCK_Q * vd);
        let (o, ml) = (&mut o[..nr * vd], &mut ml[..2 * nr]);
        // SAFETY: (these rows, head hh) are this task's (caller's contract).
        load_rows(p, hh, i0, first_tile, out, state, o, ml);
        let tile_end = tile.start + tile.cap;
        let mut kb = tile.start;
        while kb < tile_end.min(rows.end) {
            // Rows at or after the block's first key take part: a suffix of the block.
            let ia = kb.saturating_sub(rows.start);
            let na = nr - ia;
            let col = kb - tile.start;
            let s = &mut s[..na * BLOCK_K];
            let q = &p.q[((i0 + ia) * h + hh) * qk..];
            let kblk = &keys[(hh * (tile.cap / BLOCK_K) + col / BLOCK_K) * qk * BLOCK_K..];
            gemm(isa, (na, BLOCK_K, qk), q, h * qk, kblk, BLOCK_K, s, BLOCK_K, false);
            for r in 0..na {
                // Keys kb..=pos of the block are visible to the row at `pos`.
                let valid = (rows.start + ia + r + 1 - kb).min(BLOCK_K);
                let srow = &mut s[r * BLOCK_K..(r + 1) * BLOCK_K];
                let alpha = online_step(isa, srow, valid, p.scale, &mut ml[2 * (ia + r)..2 * (ia + r) + 2]);
                if alpha != 1.0 {
                    for x in &mut o[(ia + r) * vd..(ia + r + 1) * vd] {
                        *x *= alpha;
                    }
                }
            }
            let v = &values[(hh * tile.cap + col) * vd..];
            gemm(isa, (na, vd, BLOCK_K), s, BLOCK_K, v, vd, &mut o[ia * vd..], vd, true);
            kb += BLOCK_K;
        }
        // SAFETY: as above.
        store_rows(p, hh, i0, done, out, state, o, ml);
    });
}

/// The running output rows (`o`, `nr × v_dim`) and softmax states (`ml`, per row its max and
/// sum) of head `hh`'s query rows `i0..i0 + nr` (call-relative): fresh in a call's first tile,
/// else as the previous tile left them in `out` and `state`.
///
/// # Safety
/// No other thread touches `out`'s or `state`'s elements of (these rows, head `hh`) meanwhile.
#[allow(clippy::too_many_arguments)]
unsafe fn load_rows(
    p: &MlaPrefillInputs<'_>,
    hh: usize,
    i0: usize,
    first_tile: bool,
    out: Shared,
    state: Shared,
    o: &mut [f32],
    ml: &mut [f32],
) {
    let (h, vd) = (p.dims.heads, p.dims.v_dim);
    for r in 0..ml.len() / 2 {
        let at = (i0 + r) * h + hh;
        if first_tile {
            o[r * vd..(r + 1) * vd].fill(0.0);
            ml[2 * r] = f32::NEG_INFINITY;
            ml[2 * r + 1] = 0.0;
        } else {
            std::ptr::copy_nonoverlapping(out.at(at * vd), o[r * vd..].as_mut_ptr(), vd);
            ml[2 * r] = *state.at(2 * at);
            ml[2 * r + 1] = *state.at(2 * at + 1);
        }
    }
}

/// [`load_rows`]' rows back into `out`: normalised when the tile holds the rows' own positions
/// (`done`), else unnormalised with their softmax state kept in `state` for the next tile.
///
/// # Safety
/// As [`load_rows`].
#[allow(clippy::too_many_arguments)]
unsafe fn store_rows(
    p: &MlaPrefillInputs<'_>,
    hh: usize,
    i0: usize,
    done: bool,
    out: Shared,
    state: Shared,
    o: &mut [f32],
    ml: &[f32],
) {
    let (h, vd) = (p.dims.heads, p.dims.v_dim);
    for r in 0..ml.len() / 2 {
        let at = (i0 + r) * h + hh;
        let orow = &mut o[r * vd..(r + 1) * vd];
        if done {
            let inv = 1.0 / ml[2 * r + 1];
            orow.iter_mut().for_each(|x| *x *= inv);
        } else {
            *state.at(2 * at) = ml[2 * r];
            *state.at(2 * at + 1) = ml[2 * r + 1];
        }
        std::ptr::copy_nonoverlapping(orow.as_ptr(), out.at(at * vd), vd);
    }
}

/// One online-softmax step of a row's scores `srow` (keys past `valid` masked) against its
/// state `ml` = [running max, running sum]: the scores become probabilities, the state moves on,
/// and the returned factor is what the row's output so far is rescaled by.
fn online_step(isa: Isa, srow: &mut [f32], valid: usize, scale: f32, ml: &mut [f32]) -> f32 {
    let (m_old, l_old) = (ml[0], ml[1]);
    let (m_new, sum) = softmax_step(isa, srow, valid, scale, m_old);
    let alpha = exp_scalar(m_old - m_new);
    ml[0] = m_new;
    ml[1] = l_old * alpha + sum;
    alpha
}

/// [`attend_block`] on the tiles: per key block the scores are one tile product of the rows'
/// queries (BF16, tiled) by the block's key panel, the online softmax runs on them in f32, and the
/// probabilities (BF16, tiled) times the block's value panel are added to the rescaled output.
/// Query and key blocks sit at the same absolute positions ([`BLOCK_Q`] = [`BLOCK_K`]), so every
/// row of the task takes part in every key block it reaches.
///
/// # Safety
/// As [`attend_block`]; `keys`/`values` the tile's BF16 panels.
#[allow(clippy::too_many_arguments)]
unsafe fn attend_block_bf16(
    tiles: Bf16Tiles,
    isa: Isa,
    p: &MlaPrefillInputs<'_>,
    tile: &Tile<'_>,
    keys: &[u16],
    values: &[u16],
    hh: usize,
    rows: std::ops::Range<usize>,
    out: Shared,
    state: Shared,
) {
    const { assert!(BLOCK_Q == BLOCK_K) };
    use crate::prefill_bf16::{convert_row, tiles_on_panel, zero_padding_rows};
    let MlaDims { heads: h, nope, rope, v_dim: vd, .. } = p.dims;
    let (qk, qkp, vdp) = (nope + rope, panel_qk(&p.dims), vd.next_multiple_of(ROW_BLOCK));
    let nr = rows.len();
    let (mt, i0) = (nr.div_ceil(ROW_BLOCK), rows.start - p.q_start);
    let padded = mt * ROW_BLOCK;
    let first_tile = tile.start == 0;
    let done = tile.start + tile.cap >= rows.end;
    let blocks = tile.cap / BLOCK_K;
    SCRATCH.with_borrow_mut(|buf| {
        ATTEND_BF16.with_borrow_mut(|ab| {
            // Every element read below is written first in this call: grown, not cleared.
            buf.grow(BLOCK_Q * (BLOCK_K + vdp + vd + 3));
            let (s, rest) = buf.split_at_mut(BLOCK_Q * BLOCK_K);
            let (pv, rest) = rest.split_at_mut(BLOCK_Q * vdp);
            let (o, rest) = rest.split_at_mut(BLOCK_Q * vd);
            let (ml, alpha) = rest.split_at_mut(2 * BLOCK_Q);
            ab.resize(BLOCK_Q * (qkp + BLOCK_K), 0);
            let (qa, pa) = ab.split_at_mut(BLOCK_Q * qkp);
            let mut qrow = [0f32; MAX_PANEL_QK];
            let (o, ml) = (&mut o[..nr * vd], &mut ml[..2 * nr]);
            // SAFETY: (these rows, head hh) are this task's (caller's contract).
            load_rows(p, hh, i0, first_tile, out, state, o, ml);
            for r in 0..nr {
                let at = (i0 + r) * h + hh;
                qrow[..qk].copy_from_slice(&p.q[at * qk..(at + 1) * qk]);
                convert_row(&qrow[..qkp], r, qkp, qa);
            }
            zero_padding_rows(nr, padded, qkp, qa);
            zero_padding_rows(nr, padded, BLOCK_K, pa);
            let tile_end = tile.start + tile.cap;
            let mut kb = tile.start;
            while kb < tile_end.min(rows.end) {
                let b = hh * blocks + (kb - tile.start) / BLOCK_K;
                let kpanel = &keys[b * qkp * BLOCK_K..(b + 1) * qkp * BLOCK_K];
                // SAFETY: qkp a multiple of the tile K; the panel holds BLOCK_K / 16 column blocks
                // over qkp; qa `mt` tiles of rows (padding zero); s 64 rows of BLOCK_K.
                tiles_on_panel(tiles, kpanel, BLOCK_K / ROW_BLOCK, qkp, qa.as_ptr(), mt, s.as_mut_ptr(), BLOCK_K);
                for r in 0..nr {
                    // Keys kb..=pos of the block are visible to the row at `pos`.
                    let valid = (rows.start + r + 1 - kb).min(BLOCK_K);
                    let srow = &mut s[r * BLOCK_K..(r + 1) * BLOCK_K];
                    alpha[r] = online_step(isa, srow, valid, p.scale, &mut ml[2 * r..2 * r + 2]);
                    convert_row(srow, r, BLOCK_K, pa);
                }
                let vpanel = &values[b * BLOCK_K * vdp..(b + 1) * BLOCK_K * vdp];
                // SAFETY: BLOCK_K a multiple of the tile K; the panel holds vdp / 16 column blocks
                // over BLOCK_K; pa `mt` tiles of rows (padding zero); pv 64 rows of vdp.
                tiles_on_panel(tiles, vpanel, vdp / ROW_BLOCK, BLOCK_K, pa.as_ptr(), mt, pv.as_mut_ptr(), vdp);
                for r in 0..nr {
                    let a = alpha[r];
                    for (x, &y) in o[r * vd..(r + 1) * vd].iter_mut().zip(&pv[r * vdp..r * vdp + vd]) {
                        *x = *x * a + y;
                    }
                }
                kb += BLOCK_K;
            }
            // SAFETY: as above.
            store_rows(p, hh, i0, done, out, state, o, ml);
        });
    });
}

#[cfg(test)]
#[path = "mla_prefill_tests.rs"]
mod tests;
