//! AMX-INT8 twin of the scalar kernel (`quant::scalar`) for many activation rows (prefill): the same integer sums
//! and the same per-group float epilogue in K order, so it agrees with every other ISA bit for
//! bit and a row's result never depends on which kernel, or which batch, computed it.
//!
//! The packed layout already is AMX's B-tile layout: a 64-byte chunk is 16 weight rows × 4
//! consecutive k, i.e. one B row of `tdpbsud` (signed activations × unsigned weights), so
//! `kt / 4` consecutive chunks of a row block's group are one B tile, loaded with stride 64
//! straight from the weights (INT8). INT4 chunks hold k0..k0+3 in the low nibbles and
//! k0+4..k0+7 in the high ones: they are split with AVX-512 into an L1 scratch (B rows 2c and
//! 2c + 1) once per row block and group, and every activation tile reuses them. A tiles are 16
//! activation rows × `kt` (64, or 32 for a group of 32) bytes loaded from `QuantizedActs` with
//! the row stride K; a last, ragged tile of fewer than 16 rows is copied into a zero-padded
//! scratch first (only the groups being computed are read, as the w2 tasks require).
//!
//! Per group, each pass keeps up to 2 × 2 C tiles (two activation tiles × two row blocks: every
//! A and B tile load feeds two `tdpbsud`), stores them to a 4 KiB buffer and runs the epilogue
//! with AVX-512 straight from it: `y = fma((acc − off·Σx) as f32, s_w · s_x, y)`, the scalar
//! twin's operation. The epilogue costs ~4 vector ops per 16 outputs per group against 2 × 64
//! MACs per output in the tiles, so at gs = 128 it is about an eighth of what the AVX-512 VNNI
//! kernel spends on the same group, and it overlaps the next group's `tdpbsud`.

use std::cell::RefCell;
use std::ops::Range;
use std::sync::OnceLock;

use krasis_quant::cpu_layout::{PackedLayout, CHUNK, ROW_BLOCK};
use krasis_quant::Bits;

use super::QuantizedActs;

pub(crate) mod bf16;
pub mod detect;
mod emu;
#[cfg(test)]
mod tests;
mod tiles;

pub(crate) use emu::EmuTiles;
pub(crate) use tiles::HwTiles;
use tiles::{TileConfig, Tiles, TILE_A, TILE_B};

/// Activation rows per A / C tile (the tile height).
const TILE_ROWS: usize = 16;

/// Activation tiles per row chunk: 128 rows × K (≤ 7168 in the supported models: ≤ 896 KiB,
/// 256 KiB at V2-Lite's 2048) stay in L2 (2 MiB per Sapphire Rapids core) while the call's
/// row blocks pass by.
const ROW_CHUNK_TILES: usize = 8;

/// Smallest M (activation rows: two per token, value + residual) that takes the AMX path.
/// Measured on the GPU box's Xeon (`amx_crossover`, one thread, 2026-11-24): at 16 rows the tiles
/// beat the VNNI kernel 1.5–1.9× on every V2-Lite shape (expert w13/w2, dense 2048², INT8 and
/// INT4); at 8 rows the VNNI kernel still wins on half of them (0.85–1.19×). `KRASIS_AMX_MIN_ROWS`
/// overrides it.
pub const AMX_MIN_ROWS: usize = 16;

/// Whether [`super::matmul_packed`] may use AMX: the hardware probe ([`detect`]) passes and
/// `KRASIS_ISA` is unset or `amx` (naming a lower ISA, `avx512` included, turns AMX off).
pub fn enabled() -> bool {
    static E: OnceLock<bool> = OnceLock::new();
    *E.get_or_init(|| {
        let isa = &krasis_core::knobs::knobs().isa;
        let asked = isa.as_ref().is_none_or(|i| *i == krasis_core::knobs::IsaChoice::Amx);
        let on = asked && crate::isa::active() == crate::isa::Isa::Avx512 && detect::hw_available();
        match (asked, detect::support()) {
            (true, detect::AmxSupport::Unusable(why)) => tracing::debug!("AMX off: {why}"),
            (false, _) => tracing::debug!("AMX off: KRASIS_ISA names a lower ISA"),
            _ => {}
        }
        on
    })
}

/// The M from which the AMX path runs: [`AMX_MIN_ROWS`], or `KRASIS_AMX_MIN_ROWS` (read once).
pub fn min_rows() -> usize {
    static M: OnceLock<usize> = OnceLock::new();
    *M.get_or_init(|| krasis_core::knobs::knobs().amx_min_rows.unwrap_or(AMX_MIN_ROWS))
}

/// One line for the startup log: whether the AMX tiles are used, and from which M.
pub fn describe() -> String {
    if enabled() {
        format!("AMX-INT8 tiles for M ≥ {} rows", min_rows())
    } else {
        match detect::support() {
            detect::AmxSupport::Usable => "AMX off (KRASIS_ISA)".into(),
            detect::AmxSupport::Unusable(why) => format!("no AMX ({why})"),
        }
    }
}

/// Per-thread scratch of the kernel (grows once).
#[derive(Default)]
struct Scratch {
    /// The ragged last activation tile, zero-padded to 16 rows × K.
    pad: crate::aligned::AlignedVec<i8>,
    /// One group of two row blocks' INT4 weights as unpacked B rows (2 × 16·gs bytes).
    unpacked: crate::aligned::AlignedVec<u8>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// 4 C tiles of 16 × 16 i32, stored for the epilogue.
#[repr(C, align(64))]
struct CBuf([i32; 4 * TILE_ROWS * ROW_BLOCK]);

/// Where one activation tile's rows come from.
#[derive(Clone, Copy)]
struct ATile {
    /// Row 0 of the tile (row stride K).
    p: *const i8,
    /// First activation row.
    i0: usize,
    /// Real rows (the rest are padding).
    rows: usize,
}

/// [`super::matmul_packed_groups`] on AMX tiles `t` (the hardware, or the tests' emulation).
///
/// # Safety
/// The CPU must have AVX-512 F/BW, and AMX-INT8 usable by this process when `t` is
/// [`HwTiles`]; arguments checked by `super::matmul_groups_with`.
#[target_feature(enable = "avx512f,avx512bw")]
pub(crate) unsafe fn matmul<T: Tiles>(
    t: &mut T,
    w: &[u8],
    l: &PackedLayout,
    acts: &QuantizedActs,
    blocks: Range<usize>,
    groups: Range<usize>,
    out: &mut [f32],
) {
    assert!(l.is_symmetric_int(), "amx::matmul: layout {l:?} is not the symmetric INT4/INT8 one it reads");
    let (m, k, gs) = (acts.m, l.k, l.gs);
    let kt = if gs.is_multiple_of(64) { 64 } else { 32 };
    if groups.start == 0 {
        out.fill(0.0);
    }
    let full = m / TILE_ROWS;
    let tail = m % TILE_ROWS;
    SCRATCH.with_borrow_mut(|s| {
        if tail > 0 {
            s.pad.resize(TILE_ROWS * k, 0);
            let cols = groups.start * gs..groups.end * gs;
            for r in 0..TILE_ROWS {
                let dst = &mut s.pad[r * k + cols.start..r * k + cols.end];
                if r < tail {
                    let i = full * TILE_ROWS + r;
                    dst.copy_from_slice(&acts.q[i * k + cols.start..i * k + cols.end]);
                } else {
                    dst.fill(0);
                }
            }
        }
        if l.bits == Bits::Int4 {
            s.unpacked.resize(2 * ROW_BLOCK * gs, 0);
        }
        let ntiles = full + usize::from(tail > 0);
        let (q, pad) = (acts.q.as_ptr(), s.pad.as_ptr());
        let tile = |r: usize| {
            if r < full {
                ATile { p: q.add(r * TILE_ROWS * k), i0: r * TILE_ROWS, rows: TILE_ROWS }
            } else {
                ATile { p: pad, i0: r * TILE_ROWS, rows: tail }
            }
        };
        t.configure(&TileConfig::new(kt));
        let mut pass =
            Pass { l, acts, kt, ncols: blocks.len() * ROW_BLOCK, out: out.as_mut_ptr(), cbuf: CBuf([0; 1024]) };
        // Row chunks outermost: a chunk's activations stay in L2 while every row block of the
        // call passes by, so a call reads its activations from L3 once, however many blocks.
        for c0 in (0..ntiles).step_by(ROW_CHUNK_TILES) {
            let c1 = (c0 + ROW_CHUNK_TILES).min(ntiles);
            let mut b = blocks.start;
            while b < blocks.end {
                let nb = (blocks.end - b).min(2);
                for g in groups.clone() {
                    // The group's B rows and scales for the (one or two) row blocks of this pass.
                    let mut bsrc = [std::ptr::null::<u8>(); 2];
                    let mut sw = [std::arch::x86_64::_mm512_setzero_ps(); 2];
                    for bi in 0..nb {
                        let blk = w.as_ptr().add((b + bi) * l.block_bytes());
                        let wg = blk.add(l.weights_offset(g));
                        bsrc[bi] = if l.bits == Bits::Int4 {
                            let dst = s.unpacked.as_mut_ptr().add(bi * ROW_BLOCK * gs);
                            unpack_int4(wg, gs, dst);
                            dst
                        } else {
                            wg
                        };
                        sw[bi] = super::avx512::load_scales(blk, l, g);
                    }
                    let col0 = (b - blocks.start) * ROW_BLOCK;
                    let mut r = c0;
                    while r < c1 {
                        let na = (c1 - r).min(2);
                        match (na, nb) {
                            (2, 2) => pass.run::<T, 2, 2>(t, [tile(r), tile(r + 1)], &bsrc, &sw, g, col0),
                            (2, _) => pass.run::<T, 2, 1>(t, [tile(r), tile(r + 1)], &bsrc, &sw, g, col0),
                            (_, 2) => pass.run::<T, 1, 2>(t, [tile(r)], &bsrc, &sw, g, col0),
                            _ => pass.run::<T, 1, 1>(t, [tile(r)], &bsrc, &sw, g, col0),
                        }
                        r += na;
                    }
                }
                b += nb;
            }
        }
        t.release();
    });
}

/// What every pass of one [`matmul`] call shares.
struct Pass<'a> {
    l: &'a PackedLayout,
    acts: &'a QuantizedActs,
    kt: usize,
    /// Columns of `out` (16 per row block of the call).
    ncols: usize,
    out: *mut f32,
    cbuf: CBuf,
}

impl Pass<'_> {
    /// Group `g` for `NA` activation tiles × `NB` row blocks (B rows at `bsrc`, scales `sw`),
    /// into output columns `col0 ..`.
    #[inline(always)]
    #[allow(clippy::needless_range_loop)] // the indices are tile numbers too
    unsafe fn run<T: Tiles, const NA: usize, const NB: usize>(
        &mut self,
        t: &mut T,
        a: [ATile; NA],
        bsrc: &[*const u8; 2],
        sw: &[std::arch::x86_64::__m512; 2],
        g: usize,
        col0: usize,
    ) {
        use std::arch::x86_64::*;
        let (k, gs, kt) = (self.l.k, self.l.gs, self.kt);
        for ai in 0..NA {
            for bi in 0..NB {
                t.zero(2 * ai + bi);
            }
        }
        for st in 0..gs / kt {
            // kt / 4 B rows of 64 bytes per step.
            let boff = st * (kt / 4) * CHUNK;
            for bi in 0..NB {
                t.load(TILE_B + bi, bsrc[bi].add(boff), CHUNK);
            }
            for ai in 0..NA {
                t.load(TILE_A + ai, a[ai].p.add(g * gs + st * kt) as *const u8, k);
            }
            for ai in 0..NA {
                for bi in 0..NB {
                    t.dp(2 * ai + bi);
                }
            }
        }
        let cb = self.cbuf.0.as_mut_ptr();
        for ai in 0..NA {
            for bi in 0..NB {
                let c = 2 * ai + bi;
                t.store(c, cb.add(c * TILE_ROWS * ROW_BLOCK) as *mut u8, ROW_BLOCK * 4);
            }
        }
        let (ng, off) = (self.l.groups(), self.l.offset());
        for (ai, at) in a.iter().enumerate().take(NA) {
            for tr in 0..at.rows {
                let i = at.i0 + tr;
                let corr = off * self.acts.sums[i * ng + g];
                let sx = self.acts.scales[i * ng + g];
                for bi in 0..NB {
                    let acc =
                        _mm512_loadu_si512(cb.add((2 * ai + bi) * TILE_ROWS * ROW_BLOCK + tr * ROW_BLOCK) as *const _);
                    let yp = self.out.add(i * self.ncols + col0 + bi * ROW_BLOCK);
                    _mm512_storeu_ps(yp, super::avx512::epilogue(acc, corr, sw[bi], sx, _mm512_loadu_ps(yp)));
                }
            }
        }
    }
}

/// One group of a row block's INT4 chunks (`gs / 8` of them) into `2 · gs / 8` B rows of
/// unsigned bytes: chunk c's low nibbles (k 8c..8c+3) are row 2c, its high nibbles (k 8c+4..)
/// row 2c + 1.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn unpack_int4(src: *const u8, gs: usize, dst: *mut u8) {
    use std::arch::x86_64::*;
    let mask = _mm512_set1_epi8(0x0f);
    for c in 0..gs / 8 {
        let v = _mm512_loadu_si512(src.add(c * CHUNK) as *const _);
        _mm512_storeu_si512(dst.add(2 * c * CHUNK) as *mut _, _mm512_and_si512(v, mask));
        _mm512_storeu_si512(dst.add((2 * c + 1) * CHUNK) as *mut _, _mm512_and_si512(_mm512_srli_epi16::<4>(v), mask));
    }
}
