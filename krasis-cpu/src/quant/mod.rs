//! Quantised expert matmuls on the CPU packed layout of `krasis_quant::cpu_layout` (INT4/INT8
//! weights, per-group f16 scales along K), with INT8 activations quantised once per token.
//!
//! `y[i][r] = Σ_g s_w[r,g] · s_x[i,g] · (Σ_{k∈g} u[r,k] · q_x[i,k] − off · Σ_{k∈g} q_x[i,k])` where
//! `u = q_w + off` is the stored unsigned weight (off = 128 for INT8, 8 for INT4). The integer
//! part is exact in every implementation; the float epilogue is one fma per group in K order
//! (`y = fma(d, s_w · s_x, y)`), the same in all of them, so the ISAs agree bit for bit.
//!
//! Implementations: `scalar` (reference), `avx2` (`maddubs`/`madd`), `avx512` (VNNI `vpdpbusd`),
//! chosen by the [`Isa`] argument; with [`Isa::Avx512`] and at least [`amx::min_rows`] activation
//! rows, `amx` (AMX-INT8 tiles, where the CPU and the OS allow them, see [`amx::enabled`]). The
//! kernels stream the weights once, front to back, with a
//! software prefetch a little ahead (see [`Prefetch`]); for M > 1 every weight chunk is applied to
//! all activation rows while it is in L1.
//!
//! **FP4** (MXFP4 / NVFP4, a layout with `fp4` set, see `krasis_quant::fp4`): the codes are
//! looked up through a 16-entry table as INT8 (`2·value + 12`) and run on the same integer
//! instructions (`fp4_scalar`, `fp4_avx2` with `vpshufb` + `maddubs`, `fp4_avx512` with
//! `vpshufb` + VNNI `vpdpbusd`), per group `y = fma(d, (s · f) · s_x, y)`. They have no AMX
//! form: an FP4 layout never takes the AMX tiles, whatever the row count.
//!
//! **Asymmetric INT4 g32** (a layout with `asym` set, see `krasis_quant::int4_asym`): codes
//! 0..=15 as stored, an f16 scale `d` and minimum `m` per group; per group
//! `y = fma(Σ q·x_q, d · s_x, y)` then `y = fma(Σ x_q, m · s_x, y)` with both integer sums exact
//! (`int4a_scalar`, `int4a_avx2` with `maddubs`, `int4a_avx512` with VNNI `vpdpbusd`). No AMX
//! form either: an asymmetric layout never takes the AMX tiles.
//!
//! **Q4_K / Q6_K kept as stored** (a layout with `kq` set, see `krasis_quant::kquant`): the codes
//! as unsigned bytes (Q6_K's 6 bits rebuilt from its low-nibble and high-bit chunks), per group
//! of 32 (Q4_K) or 16 (Q6_K) `y = fma(Σ q·x_q, (d · sc) · s_x, y)`, then for Q4_K
//! `y = fma(−Σ x_q, (dmin · m) · s_x, y)` and for Q6_K the offset `32 · Σ x_q` taken from the
//! exact integer sum first (`kq_scalar`, `kq_avx2` with `maddubs`, `kq_avx512` with VNNI
//! `vpdpbusd`). No AMX form: a K-quant layout never takes the AMX tiles.
//!
//! Threading is the caller's: [`matmul_packed`] computes any sub-range of row blocks into its own
//! output, so workers can split a matrix by row blocks (and w13 by block pairs, see
//! [`silu_mul_w13`]).

use std::ops::Range;

pub use krasis_quant::cpu_layout::{PackedLayout, ROW_BLOCK};
use krasis_quant::group::check_group_size;
pub use krasis_quant::Bits;

pub(crate) use actq::{quantize_group, quantize_group_split};

use crate::activation::silu;
use crate::isa::Isa;

mod actq;
#[cfg(target_arch = "x86_64")]
pub mod amx;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
pub mod bf16;
#[cfg(target_arch = "x86_64")]
mod fp4_avx2;
#[cfg(target_arch = "x86_64")]
mod fp4_avx512;
mod fp4_scalar;
#[cfg(test)]
mod fp4_tests;
#[cfg(target_arch = "x86_64")]
mod int4a_avx2;
#[cfg(target_arch = "x86_64")]
mod int4a_avx512;
mod int4a_scalar;
#[cfg(test)]
mod int4a_tests;
#[cfg(target_arch = "x86_64")]
mod kq_avx2;
#[cfg(target_arch = "x86_64")]
mod kq_avx512;
mod kq_scalar;
#[cfg(test)]
mod kq_tests;
mod scalar;
#[cfg(test)]
mod tests;

/// Activations quantised to INT8 per group of the weights' group size: `x ≈ q · scale`,
/// `scale = amax / 127` per (row, group), `q` rounded half to even.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct QuantizedActs {
    pub m: usize,
    pub k: usize,
    pub gs: usize,
    /// `[m, k]`, each in `[-127, 127]`.
    pub q: crate::aligned::AlignedVec<i8>,
    /// `[m, k / gs]`.
    pub scales: Vec<f32>,
    /// `[m, k / gs]`: `Σ q` over the group (for the unsigned-weight offset correction).
    pub sums: Vec<i32>,
}

impl QuantizedActs {
    pub fn new() -> QuantizedActs {
        QuantizedActs::default()
    }

    pub fn groups(&self) -> usize {
        self.k.checked_div(self.gs).unwrap_or(0)
    }

    /// Bytes its buffers hold (their capacity), for the runners' [`crate::moe::PoolMatmul::scratch_bytes`].
    pub fn held_bytes(&self) -> usize {
        self.q.capacity() + 4 * (self.scales.capacity() + self.sums.capacity())
    }

    /// Dequantised row-major `[m, k]` (for tests and diagnostics).
    pub fn dequantize(&self) -> Vec<f32> {
        let ng = self.groups();
        (0..self.m * self.k)
            .map(|e| self.q[e] as f32 * self.scales[(e / self.k) * ng + (e % self.k) / self.gs])
            .collect()
    }
}

/// Zero the 16 output columns of row block `bi` (of a call's `ncols`) in each of the `m` rows of
/// `out`: where the scalar kernels start a call over groups from 0.
pub(super) fn zero_block_columns(out: &mut [f32], m: usize, ncols: usize, bi: usize) {
    for row in out.chunks_exact_mut(ncols).take(m) {
        row[bi * ROW_BLOCK..(bi + 1) * ROW_BLOCK].fill(0.0);
    }
}

/// The 16 little-endian f16 values at byte `off` of a row block (one per row: a group's scales,
/// minimums or super-block factors), as f32.
#[inline]
pub(super) fn row_f16s(blk: &[u8], off: usize) -> [f32; ROW_BLOCK] {
    std::array::from_fn(|j| half::f16::from_bits(u16::from_le_bytes([blk[off + 2 * j], blk[off + 2 * j + 1]])).to_f32())
}

/// 1.5 · 2²³: adding it to |v| < 2²² rounds `v` half to even (see [`round_clamp_127`]).
const MAGIC: f32 = 12_582_912.0;
/// Bit pattern of [`MAGIC`].
const MAGIC_BITS: i32 = 0x4B40_0000;

/// Quantise `x[m, k]` into `out` (its buffers are reused: no allocation once they are large
/// enough). `gs` must divide `k` (use the weights' group size).
pub fn quantize_acts(x: &[f32], m: usize, k: usize, gs: usize, out: &mut QuantizedActs) {
    assert_eq!(x.len(), m * k, "quantize_acts: x has {} floats, expected {m}×{k}", x.len());
    assert!(gs > 0 && k.is_multiple_of(gs), "quantize_acts: group size {gs} does not divide K = {k}");
    let ng = k / gs;
    out.m = m;
    out.k = k;
    out.gs = gs;
    out.q.resize(m * k, 0);
    out.scales.resize(m * ng, 0.0);
    out.sums.resize(m * ng, 0);
    for (gi, (xg, qg)) in x.chunks_exact(gs).zip(out.q.chunks_exact_mut(gs)).enumerate() {
        let (scale, sum) = quantize_group(xg, qg);
        out.scales[gi] = scale;
        out.sums[gi] = sum;
    }
}

/// `c` rounded half to even and clamped to ±127 (NaN → 0), branch-free and without a float →
/// int conversion, so the group loops vectorise: for |c| ≤ 127, `c + 1.5·2²³` lies in
/// [2²³, 2²⁴) where the f32 spacing is 1, so the addition rounds `c` half to even and its low
/// mantissa bits hold the result. Clamping before rounding gives the same integers as after
/// (the bounds are integers).
#[inline(always)]
fn round_clamp_127(c: f32) -> i32 {
    let c = c.clamp(-127.0, 127.0);
    #[allow(clippy::eq_op)] // c == c is false only for NaN
    let c = if c == c { c } else { 0.0 };
    (c + MAGIC).to_bits() as i32 - MAGIC_BITS
}

/// Software prefetch hint for the weight stream (`prefetchnta` was measured slower than no
/// software prefetch at all on the Xeon, see [`DEFAULT_PREFETCH`]). The knob's type is the
/// kernels' type: one enum.
pub use krasis_core::knobs::PrefetchHint;

/// Software prefetch of the weight stream: one prefetch per 64-byte line, `distance` bytes ahead
/// of the line being read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Prefetch {
    pub hint: PrefetchHint,
    pub distance: usize,
}

impl Prefetch {
    pub const OFF: Prefetch = Prefetch { hint: PrefetchHint::None, distance: 0 };

    fn distance_if_on(&self) -> usize {
        if self.hint == PrefetchHint::None {
            0
        } else {
            self.distance
        }
    }
}

/// What [`matmul_packed`] uses, chosen by the prefetch sweep of `benches/quant_matmul.rs`
/// (16-core Xeon, AVX-512, INT4 w13, M = 1, DRAM-resident). One thread: none 10.4 GiB/s, NTA
/// 7.0–9.1 (worse at every distance: the lines skip L2 and get evicted before use), T0/T1 at
/// 1 KiB 11.3, at 4–16 KiB 13.3–14.2 against a 15.7 GiB/s plain read. 16 threads: none 108,
/// T0 4 KiB 129, T0 16 KiB 132 against a 140 GiB/s read. Far-ahead T0 also crosses the 4 KiB
/// page boundaries the hardware streamer stops at.
pub const DEFAULT_PREFETCH: Prefetch = Prefetch { hint: PrefetchHint::T0, distance: 4096 };

/// The prefetch [`matmul_packed`] uses: [`DEFAULT_PREFETCH`], or `KRASIS_PREFETCH=none|nta|t0|t1[:distance]`
/// (read once; for tuning on a new machine).
pub fn active_prefetch() -> Prefetch {
    static P: std::sync::OnceLock<Prefetch> = std::sync::OnceLock::new();
    *P.get_or_init(|| {
        let Some(p) = krasis_core::knobs::knobs().prefetch else { return DEFAULT_PREFETCH };
        let hint = p.hint;
        Prefetch { hint, distance: p.distance.unwrap_or(DEFAULT_PREFETCH.distance) }
    })
}

/// Bytes [`prefetch_matrix_start`] touches.
pub const PREFETCH_START_BYTES: usize = 4096;

/// Prefetch the first [`PREFETCH_START_BYTES`] of a packed matrix into L2 (`prefetcht1`), e.g.
/// the next expert's while the current one finishes, so its stream starts without a DRAM stall.
pub fn prefetch_matrix_start(w: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
        let n = w.len().min(PREFETCH_START_BYTES);
        for off in (0..n).step_by(64) {
            // SAFETY: prefetch never faults; the address is inside `w`.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(w.as_ptr().add(off) as *const i8) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = w;
}

/// Issue the prefetches for the first `distance` bytes of `w` at once. The kernels prefetch
/// `distance` ahead of the line they read, so without this the start of each range arrives one
/// demand miss at a time; a pool task covers only ~20–300 KiB, so its first 4 KiB matter.
pub fn prefetch_burst(w: &[u8], pf: Prefetch) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_NTA, _MM_HINT_T0, _MM_HINT_T1};
        let n = w.len().min(pf.distance_if_on());
        for off in (0..n).step_by(64) {
            let p = w[off..].as_ptr() as *const i8;
            // SAFETY: prefetch never faults; the address is inside `w`.
            unsafe {
                match pf.hint {
                    PrefetchHint::T0 => _mm_prefetch::<_MM_HINT_T0>(p),
                    PrefetchHint::T1 => _mm_prefetch::<_MM_HINT_T1>(p),
                    PrefetchHint::Nta => _mm_prefetch::<_MM_HINT_NTA>(p),
                    PrefetchHint::None => {}
                }
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (w, pf);
}

/// Prefetch all of `w` into L2 (`prefetcht1`, one per 64-byte line): for a thread that has to
/// wait before it can compute on `w`, so the wait still moves its bytes from DRAM.
pub fn prefetch_l2(w: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
        for off in (0..w.len()).step_by(64) {
            // SAFETY: prefetch never faults; the address is inside `w`.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(w.as_ptr().add(off) as *const i8) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = w;
}

/// The kernels [`matmul_packed`] runs with `isa`, for the startup log: the ISA's name, and on
/// AVX-512 whether AMX tiles take the many-row calls (see [`amx::enabled`]) and the prefill's
/// matmuls (see [`crate::prefill_bf16`]).
pub fn describe_kernels(isa: Isa) -> String {
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 {
        return format!("{} ({}; {})", isa.name(), amx::describe(), crate::prefill_bf16::describe());
    }
    isa.name().to_string()
}

/// Whether this CPU runs the kernels of `isa` (AVX2 also needs F16C for the f16 scales).
pub fn isa_supported(isa: Isa) -> bool {
    match isa {
        Isa::Scalar => true,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => {
            is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => {
            is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vnni")
        }
        #[cfg(not(target_arch = "x86_64"))]
        _ => false,
    }
}

/// `out[m, blocks.len()·16] = acts · W[blocks]ᵀ` for row blocks `blocks` of the packed matrix `w`:
/// column `16·(b − blocks.start) + j` is row `16·b + j` (padding rows of the last block give 0).
/// With [`active_prefetch`].
///
/// # Panics
/// On inconsistent shapes (`acts` vs `layout`, `w` shorter than the layout, `blocks` past the
/// end, `out` not `m · blocks.len() · 16`), or an `isa` this CPU lacks.
pub fn matmul_packed(
    isa: Isa,
    w: &[u8],
    layout: &PackedLayout,
    acts: &QuantizedActs,
    blocks: Range<usize>,
    out: &mut [f32],
) {
    matmul_packed_with(isa, w, layout, acts, blocks, out, active_prefetch())
}

/// [`matmul_packed`] with an explicit prefetch setting (benchmarks, tuning).
pub fn matmul_packed_with(
    isa: Isa,
    w: &[u8],
    layout: &PackedLayout,
    acts: &QuantizedActs,
    blocks: Range<usize>,
    out: &mut [f32],
    prefetch: Prefetch,
) {
    matmul_groups_with(isa, w, layout, acts, blocks, 0..layout.groups(), out, prefetch)
}

/// [`matmul_packed`] over the K groups `groups` only, continuing partial sums: with `groups =
/// g0..g1`, `out` must hold the result of this call over groups `0..g0` (it is ignored, as if
/// zero, when `g0 = 0`), and receives the result over `0..g1`. The per-group epilogue runs in K
/// order either way, so calls over consecutive group ranges give exactly [`matmul_packed`]'s
/// numbers. Only groups `groups` of `acts` are read (a caller may still be filling the
/// others). With [`active_prefetch`].
///
/// # Panics
/// As [`matmul_packed`], and when `groups` is not inside `0..layout.groups()`.
pub fn matmul_packed_groups(
    isa: Isa,
    w: &[u8],
    layout: &PackedLayout,
    acts: &QuantizedActs,
    blocks: Range<usize>,
    groups: Range<usize>,
    out: &mut [f32],
) {
    matmul_groups_with(isa, w, layout, acts, blocks, groups, out, active_prefetch())
}

#[allow(clippy::too_many_arguments)]
fn matmul_groups_with(
    isa: Isa,
    w: &[u8],
    layout: &PackedLayout,
    acts: &QuantizedActs,
    blocks: Range<usize>,
    groups: Range<usize>,
    out: &mut [f32],
    prefetch: Prefetch,
) {
    let l = layout;
    if let Some(kind) = l.fp4 {
        assert!(
            l.k > 0 && l.k.is_multiple_of(32) && l.gs == kind.group(),
            "matmul_packed: inconsistent {kind} layout {l:?}"
        );
    } else if let Some(kind) = l.kq {
        assert!(
            l.k > 0 && l.k.is_multiple_of(256) && l.gs == kind.group(),
            "matmul_packed: inconsistent {kind} layout {l:?}"
        );
    } else if l.asym {
        assert!(
            l.k > 0 && l.k.is_multiple_of(32) && l.gs == 32 && l.bits == Bits::Int4,
            "matmul_packed: inconsistent asymmetric INT4 layout {l:?}"
        );
    } else if let Err(e) = check_group_size(l.k, l.gs) {
        panic!("matmul_packed: {e}");
    }
    assert!(
        l.rows_padded.is_multiple_of(ROW_BLOCK) && l.rows_padded >= l.rows && l.rows_padded < l.rows + ROW_BLOCK,
        "matmul_packed: inconsistent layout {l:?}"
    );
    assert!(w.len() >= l.bytes(), "matmul_packed: weights are {} bytes, the layout needs {}", w.len(), l.bytes());
    assert!(
        acts.k == l.k && acts.gs == l.gs,
        "matmul_packed: activations are K={} g{}, weights K={} g{}",
        acts.k,
        acts.gs,
        l.k,
        l.gs
    );
    let ng = l.groups();
    assert!(
        acts.q.len() >= acts.m * acts.k && acts.scales.len() >= acts.m * ng && acts.sums.len() >= acts.m * ng,
        "matmul_packed: activation buffers shorter than m={}",
        acts.m
    );
    assert!(
        blocks.start <= blocks.end && blocks.end <= l.row_blocks(),
        "matmul_packed: blocks {blocks:?} outside 0..{}",
        l.row_blocks()
    );
    assert!(groups.start <= groups.end && groups.end <= ng, "matmul_packed: groups {groups:?} outside 0..{ng}");
    assert_eq!(
        out.len(),
        acts.m * blocks.len() * ROW_BLOCK,
        "matmul_packed: out must be m×(blocks·16) = {}×{}",
        acts.m,
        blocks.len() * ROW_BLOCK
    );
    if acts.m == 0 || blocks.is_empty() || groups.is_empty() {
        return;
    }
    assert!(isa_supported(isa), "matmul_packed: this CPU cannot run {}", isa.name());
    if isa != Isa::Scalar && groups.start == 0 {
        let bb = l.block_bytes();
        prefetch_burst(&w[blocks.start * bb..blocks.end * bb], prefetch);
    }
    if l.fp4.is_some() {
        // FP4 layouts have their own kernels (no AMX form).
        match isa {
            Isa::Scalar => fp4_scalar::matmul(w, l, acts, blocks, groups, out),
            // SAFETY: the CPU has the features (checked above); shapes checked above.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { fp4_avx2::matmul(w, l, acts, blocks, groups, out, prefetch) },
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { fp4_avx512::matmul(w, l, acts, blocks, groups, out, prefetch) },
            #[cfg(not(target_arch = "x86_64"))]
            _ => fp4_scalar::matmul(w, l, acts, blocks, groups, out),
        }
        return;
    }
    if l.kq.is_some() {
        // Q4_K / Q6_K have their own kernels (no AMX form).
        match isa {
            Isa::Scalar => kq_scalar::matmul(w, l, acts, blocks, groups, out),
            // SAFETY: the CPU has the features (checked above); shapes checked above.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { kq_avx2::matmul(w, l, acts, blocks, groups, out, prefetch) },
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { kq_avx512::matmul(w, l, acts, blocks, groups, out, prefetch) },
            #[cfg(not(target_arch = "x86_64"))]
            _ => kq_scalar::matmul(w, l, acts, blocks, groups, out),
        }
        return;
    }
    if l.asym {
        // Asymmetric INT4 has its own kernels (no AMX form).
        match isa {
            Isa::Scalar => int4a_scalar::matmul(w, l, acts, blocks, groups, out),
            // SAFETY: the CPU has the features (checked above); shapes checked above.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { int4a_avx2::matmul(w, l, acts, blocks, groups, out, prefetch) },
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { int4a_avx512::matmul(w, l, acts, blocks, groups, out, prefetch) },
            #[cfg(not(target_arch = "x86_64"))]
            _ => int4a_scalar::matmul(w, l, acts, blocks, groups, out),
        }
        return;
    }
    match isa {
        Isa::Scalar => scalar::matmul(w, l, acts, blocks, groups, out),
        // SAFETY: the CPU has the features (checked above); shapes checked above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2::matmul(w, l, acts, blocks, groups, out, prefetch) },
        // SAFETY: as above; `amx::enabled` checked that the process may use the tiles.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 if acts.m >= amx::min_rows() && amx::enabled() => unsafe {
            amx::matmul(&mut amx::HwTiles, w, l, acts, blocks, groups, out)
        },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::matmul(w, l, acts, blocks, groups, out, prefetch) },
        #[cfg(not(target_arch = "x86_64"))]
        _ => scalar::matmul(w, l, acts, blocks, groups, out),
    }
    let _ = prefetch;
}

/// SiLU-gate the output of a fused w13 matmul: `h13` is `[m, 32·pairs]` with row blocks
/// interleaved (16 gate columns, then the 16 up columns of the same rows, …), `out` is
/// `[m, 16·pairs]` with `out = silu(gate) · up`.
///
/// With `isa` AVX-512, 16 lanes at a time on [`crate::expf`]'s `exp` (a prefill's experts
/// evaluate ~150 M of these; libm's scalar `exp` took ~0.07 s of a 512-token V2-Lite prefill):
/// within a few ulp of [`silu_mul_w13_scalar`] (tests).
pub fn silu_mul_w13(isa: Isa, h13: &[f32], m: usize, out: &mut [f32]) {
    assert_eq!(h13.len() % (m.max(1) * 2 * ROW_BLOCK), 0, "silu_mul_w13: h13 is not m × 32·pairs");
    let pairs = h13.len() / (m.max(1) * 2 * ROW_BLOCK);
    assert_eq!(out.len(), m * pairs * ROW_BLOCK, "silu_mul_w13: out must be m × 16·pairs");
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 {
        // SAFETY: the active ISA is at most what the CPU has; `out` holds 16 per 32 of `h13`
        // (asserted above).
        return unsafe { silu_mul_w13_avx512(h13, out) };
    }
    let _ = isa;
    silu_mul_w13_scalar(h13, out);
}

/// Scalar twin of [`silu_mul_w13`] (libm's `exp`), lengths as checked there.
pub fn silu_mul_w13_scalar(h13: &[f32], out: &mut [f32]) {
    for (hp, op) in h13.chunks_exact(2 * ROW_BLOCK).zip(out.chunks_exact_mut(ROW_BLOCK)) {
        let (gate, up) = hp.split_at(ROW_BLOCK);
        for ((o, &g), &u) in op.iter_mut().zip(gate).zip(up) {
            *o = silu(g) * u;
        }
    }
}

/// [`silu_mul_w13`] with another activation and with the gate and up biases added first (the
/// option gpt-oss's experts take; scalar, it is its own twin): `h13` holds, per row of `m`, the
/// block pairs `p0..` of a fused w13 (16 gate values, then the 16 up values of the same
/// intermediate columns); `bias13` is `[gate biases | up biases]` over the whole intermediate
/// (`2 · inter` floats), or `None`. Writes the intermediate columns `16·p0..` of each row into
/// `out` (`m × 16·pairs`).
pub fn act_mul_w13(
    act: krasis_core::spec::ExpertActivation,
    bias13: Option<&[f32]>,
    p0: usize,
    h13: &[f32],
    m: usize,
    out: &mut [f32],
) {
    assert_eq!(h13.len() % (m.max(1) * 2 * ROW_BLOCK), 0, "act_mul_w13: h13 is not m × 32·pairs");
    let pairs = h13.len() / (m.max(1) * 2 * ROW_BLOCK);
    assert_eq!(out.len(), m * pairs * ROW_BLOCK, "act_mul_w13: out must be m × 16·pairs");
    let inter = bias13.map_or(0, |b| b.len() / 2);
    if let Some(b) = bias13 {
        assert!(b.len() % 2 == 0 && (p0 + pairs) * ROW_BLOCK <= inter, "act_mul_w13: bias13 does not cover the pairs");
    }
    let row_out = pairs * ROW_BLOCK;
    for (hr, or) in h13.chunks_exact(2 * row_out).zip(out.chunks_exact_mut(row_out.max(1))) {
        for (p, (hp, op)) in hr.chunks_exact(2 * ROW_BLOCK).zip(or.chunks_exact_mut(ROW_BLOCK)).enumerate() {
            let c0 = (p0 + p) * ROW_BLOCK;
            let (gate, up) = hp.split_at(ROW_BLOCK);
            for j in 0..ROW_BLOCK {
                let (bg, bu) = bias13.map_or((0.0, 0.0), |b| (b[c0 + j], b[inter + c0 + j]));
                op[j] = act.apply(gate[j] + bg, up[j] + bu);
            }
        }
    }
}

/// The experts' activation between w13 and w2 over block pairs `p0..` of `h13` (layouts as
/// [`act_mul_w13`]'s): SiLU(gate)·up without biases on [`silu_mul_w13`]'s SIMD form, any other
/// activation or biases on [`act_mul_w13`]. The one choice of both expert runners (the integer
/// kernels' `moe::PoolExperts` and the BF16 tiles' `prefill_bf16`).
pub fn activate_w13(
    isa: Isa,
    act: krasis_core::spec::ExpertActivation,
    bias13: Option<&[f32]>,
    p0: usize,
    h13: &[f32],
    m: usize,
    out: &mut [f32],
) {
    match (act, bias13) {
        (krasis_core::spec::ExpertActivation::Silu, None) => silu_mul_w13(isa, h13, m, out),
        (act, bias13) => act_mul_w13(act, bias13, p0, h13, m, out),
    }
}

/// [`silu_mul_w13`] 16 lanes (one row block) at a time: `g / (1 + e^−g) · u`.
///
/// # Safety
/// The CPU has AVX-512 F; `out.len() · 2 == h13.len()`, both whole row blocks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn silu_mul_w13_avx512(h13: &[f32], out: &mut [f32]) {
    use std::arch::x86_64::*;
    debug_assert_eq!(out.len() * 2, h13.len());
    let one = _mm512_set1_ps(1.0);
    for (i, o) in out.chunks_exact_mut(ROW_BLOCK).enumerate() {
        let g = _mm512_loadu_ps(h13.as_ptr().add(2 * ROW_BLOCK * i));
        let u = _mm512_loadu_ps(h13.as_ptr().add(2 * ROW_BLOCK * i + ROW_BLOCK));
        let e = crate::expf::exp_avx512(_mm512_sub_ps(_mm512_setzero_ps(), g));
        _mm512_storeu_ps(o.as_mut_ptr(), _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(one, e)), u));
    }
}

/// Reusable buffers of [`expert_forward`] (grow once, then no allocation).
#[derive(Clone, Debug, Default)]
pub struct ExpertScratch {
    /// The token's activations (input of w13).
    pub acts: QuantizedActs,
    /// `silu(gate) · up`, quantised (input of w2).
    pub acts_mid: QuantizedActs,
    pub h13: Vec<f32>,
    pub mid: Vec<f32>,
    pub y: Vec<f32>,
}

/// One expert, single-threaded: `out[m, h] += weight · (silu(x·gateᵀ) · (x·upᵀ)) · w2ᵀ`, with
/// `w13` packed by `pack_w13` (`[2·inter, h]`) and `w2` (`[h, inter]`) by `pack`.
#[allow(clippy::too_many_arguments)]
pub fn expert_forward(
    isa: Isa,
    w13: &[u8],
    w13_layout: &PackedLayout,
    w2: &[u8],
    w2_layout: &PackedLayout,
    x: &[f32],
    m: usize,
    weight: f32,
    out: &mut [f32],
    scratch: &mut ExpertScratch,
) {
    let mut acts = std::mem::take(&mut scratch.acts);
    quantize_acts(x, m, w13_layout.k, w13_layout.gs, &mut acts);
    expert_forward_quantized(isa, w13, w13_layout, w2, w2_layout, &acts, weight, out, scratch);
    scratch.acts = acts;
}

/// [`expert_forward`] on activations already quantised with [`quantize_acts`] (shared by all
/// the experts of a token).
#[allow(clippy::too_many_arguments)]
pub fn expert_forward_quantized(
    isa: Isa,
    w13: &[u8],
    w13_layout: &PackedLayout,
    w2: &[u8],
    w2_layout: &PackedLayout,
    acts: &QuantizedActs,
    weight: f32,
    out: &mut [f32],
    scratch: &mut ExpertScratch,
) {
    let m = acts.m;
    let h = w2_layout.rows;
    let inter = w13_layout.rows / 2;
    assert!(w13_layout.rows.is_multiple_of(2 * ROW_BLOCK), "expert_forward: w13 is not a fused gate+up layout");
    assert_eq!(w2_layout.k, inter, "expert_forward: w2 K = {} but w13 gives {inter}", w2_layout.k);
    assert_eq!(out.len(), m * h, "expert_forward: out must be m×{h}");
    let nb13 = w13_layout.row_blocks();
    scratch.h13.resize(m * nb13 * ROW_BLOCK, 0.0);
    matmul_packed(isa, w13, w13_layout, acts, 0..nb13, &mut scratch.h13);
    scratch.mid.resize(m * inter, 0.0);
    silu_mul_w13(isa, &scratch.h13, m, &mut scratch.mid);
    quantize_acts(&scratch.mid, m, inter, w2_layout.gs, &mut scratch.acts_mid);
    let nb2 = w2_layout.row_blocks();
    let hp = nb2 * ROW_BLOCK;
    scratch.y.resize(m * hp, 0.0);
    matmul_packed(isa, w2, w2_layout, &scratch.acts_mid, 0..nb2, &mut scratch.y);
    for (orow, yrow) in out.chunks_exact_mut(h).zip(scratch.y.chunks_exact(hp)) {
        for (o, &v) in orow.iter_mut().zip(yrow) {
            *o += weight * v;
        }
    }
}
