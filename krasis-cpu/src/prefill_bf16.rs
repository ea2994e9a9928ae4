//! Prefill matmuls on AMX-BF16 tiles: what [`crate::moe::PoolMatmul`] and
//! [`crate::moe::PoolExperts`] run instead of the INT8 kernels once a call carries at least
//! [`min_tokens`] tokens and the CPU has AMX-BF16.
//!
//! Why a second number format for prefill: the INT8 kernels quantise every activation row into
//! two INT8 rows (value + residual) and apply the scales per group of 128 in a float epilogue,
//! which at decode's M = 2 costs nothing (the weights' bandwidth bounds it) but in a prefill
//! doubles the integer work and stores the AMX accumulators once per group. Here each row
//! block's weights are dequantised once per task into a BF16 panel with the group scales folded
//! in ([`crate::quant::bf16`]), the activations are rounded to BF16 once per call, and the
//! tiles accumulate f32 over all of K (`quant::amx::bf16`). The result differs from the
//! INT8 path's by BF16 rounding of weights and activations (well inside the quantised-fidelity
//! bounds; checked on the oracle fixtures with the emulated tiles in CI and the hardware tiles
//! on the GPU box).
//!
//! Experts run in two dispatches. The first holds three kinds of task, in this order: each
//! expert's token rows gathered and rounded to BF16; w13 tasks (expert, block pairs) computing
//! SiLU(gate)·up and writing the intermediate as BF16 in the tiled layout w2 reads; w2 tasks
//! (expert, row blocks) into a per-expert output. A task waits (spinning, on per-expert
//! counters) only for the tasks of its own expert that it reads, so workers move on to the w2
//! tasks of finished experts instead of idling at the end of the w13 phase. The second dispatch
//! is the weighted sum per token in job order. `KRASIS_EXPERT_DISPATCH=split` runs the three
//! kinds of task as three dispatches instead (for comparison).
//!
//! `KRASIS_PREFILL_MATMUL=int8` keeps the INT8 kernels for prefill too; `bf16-emulated` runs this
//! path with the scalar tile emulation on any CPU (for the fidelity tests);
//! `KRASIS_BF16_MIN_TOKENS` sets [`min_tokens`].

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

use krasis_core::spec::ExpertActivation;
use krasis_quant::cpu_layout::{PackedLayout, ROW_BLOCK};

use crate::aligned::AlignedVec;
use crate::isa::Isa;
use crate::moe::{block_runs, block_unit_starts, wait_ready, ExpertJob, FailOnUnwind, OutPtr, X_WAIT_PREFETCH};
use crate::par::DisjointPtr;
use crate::phase_ns::PhaseNs;
use crate::pool::WorkerPool;
use crate::quant::activate_w13;
use crate::quant::amx::bf16::{tiled_index, TILE_K, TILE_ROWS};
use crate::quant::bf16::{block_panel, panel_len, to_bf16, to_bf16_runs};

/// Smallest number of tokens per matrix (a dense call's tokens; an expert call's mean tokens per
/// expert) that takes the BF16 tiles: each call dequantises every weight it reads once, which
/// only many rows pay back. Measured on the GPU box's Xeon (`bf16_rates`, one thread, V2-Lite
/// shapes with the dequantisation): 52–68 GMAC/s at 16 rows, 131–142 at 48, against the INT8
/// tiles' ~90–95 per token (two rows each) at 16–48 tokens; a 16-token prefill on the BF16 tiles
/// ran at 85 tok/s, its experts seeing ~1.5 tokens each. `KRASIS_BF16_MIN_TOKENS` overrides.
pub const BF16_MIN_TOKENS: usize = 32;

/// Bytes of dequantised panel a task builds before running the tiles over it: with a row chunk
/// of activations (512 KiB at K = 2048) it stays in the 2 MiB L2 of a Sapphire Rapids core.
const PANEL_BYTES: usize = 512 << 10;

/// Tasks per worker in each phase (tasks are sized by work, largest first, so the phase ends in
/// small ones).
const TASKS_PER_WORKER: usize = 4;

/// Tile-equivalents of work a row block's dequantisation costs, in the task sizing (about one
/// 16-row activation tile's `tdpbf16ps` time per block, by operation counts).
const DEQUANT_TILES: usize = 1;

/// How the BF16 tiles run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bf16Tiles {
    /// AMX-BF16.
    Hardware,
    /// The scalar emulation of the tile instructions (tests; any CPU).
    Emulated,
}

/// The configured BF16 prefill tiles, if any (read once): hardware when AMX is enabled
/// ([`crate::quant::amx::enabled`]) and the CPU has AMX-BF16 and AVX-512 BF16, unless
/// `KRASIS_PREFILL_MATMUL=int8`; `bf16-emulated` forces the emulation.
pub fn tiles() -> Option<Bf16Tiles> {
    static T: OnceLock<Option<Bf16Tiles>> = OnceLock::new();
    *T.get_or_init(|| {
        use krasis_core::knobs::PrefillMatmul;
        match krasis_core::knobs::knobs().prefill_matmul {
            PrefillMatmul::Int8 => None,
            PrefillMatmul::Bf16Emulated => Some(Bf16Tiles::Emulated),
            asked @ (PrefillMatmul::Auto | PrefillMatmul::Bf16) => {
                let hw = hardware();
                if asked == PrefillMatmul::Bf16 && !hw {
                    tracing::warn!(
                        "KRASIS_PREFILL_MATMUL=bf16, but the AMX-BF16 tiles are not usable here (AMX and AMX-BF16 \
                         with AVX-512 BF16 are needed, and KRASIS_ISA must allow amx); prefill stays on the INT8 kernels"
                    );
                }
                hw.then_some(Bf16Tiles::Hardware)
            }
        }
    })
}

#[cfg(target_arch = "x86_64")]
fn hardware() -> bool {
    crate::quant::amx::enabled() && crate::quant::amx::detect::bf16_available()
}

#[cfg(not(target_arch = "x86_64"))]
fn hardware() -> bool {
    false
}

/// [`BF16_MIN_TOKENS`] or `KRASIS_BF16_MIN_TOKENS` (read once).
pub fn min_tokens() -> usize {
    static M: OnceLock<usize> = OnceLock::new();
    *M.get_or_init(|| krasis_core::knobs::knobs().bf16_min_tokens.unwrap_or(BF16_MIN_TOKENS))
}

/// The tiles a call of `tokens` rows per matrix (for experts, the mean per expert) with ISA
/// `isa` over K = `k` runs on, or `None` for the INT8 kernels. The hardware tiles need the caller's ISA to be AVX-512 (a test naming a lower ISA
/// gets that ISA's kernel).
pub fn applies(isa: Isa, tokens: usize, k: usize) -> Option<Bf16Tiles> {
    let t = tiles()?;
    let ok = tokens >= min_tokens() && k.is_multiple_of(TILE_K) && (t == Bf16Tiles::Emulated || isa == Isa::Avx512);
    ok.then_some(t)
}

/// Calls that ran on the BF16 tiles so far in this process (for tests that must know the path
/// ran).
pub fn calls() -> usize {
    CALLS.load(Ordering::Relaxed)
}

static CALLS: AtomicUsize = AtomicUsize::new(0);

/// Nanoseconds spent so far (for benches): `[0]` conversion tasks' worker time, `[1]` wall time
/// of the expert tasks' dispatch(es), `[2]` worker time tasks spent waiting for their expert's
/// inputs, `[3]` wall time of the weighted sum; summed over workers in every BF16 matmul's panel
/// dequantisation `[4]` and its tiles `[5]`; the w13 `[6]` and w2 `[7]` tasks' busy time
/// (waits excluded: against `[1]` × workers it shows the idle time).
pub fn expert_phase_ns() -> [u64; 8] {
    PHASE_NS.get()
}

static PHASE_NS: PhaseNs<8> = PhaseNs::new();

/// Whether the expert tasks run as one dispatch (default) or, with
/// `KRASIS_EXPERT_DISPATCH=split`, one dispatch per kind of task (read once).
fn fused_dispatch() -> bool {
    !krasis_core::knobs::knobs().expert_dispatch_split
}

/// One line for the startup log.
pub fn describe() -> String {
    match tiles() {
        Some(Bf16Tiles::Hardware) => format!("prefill on AMX-BF16 tiles from {} tokens", min_tokens()),
        Some(Bf16Tiles::Emulated) => format!("prefill on emulated BF16 tiles from {} tokens (slow)", min_tokens()),
        None => "prefill on the INT8 kernels".into(),
    }
}

/// A worker's buffers (grow once).
#[derive(Default)]
struct Scratch {
    panel: AlignedVec<u16>,
    /// Tile output.
    c: AlignedVec<f32>,
    /// SiLU(gate)·up rows.
    act: AlignedVec<f32>,
}

struct CallBufs {
    /// The call's activations as BF16 in the tiled layout ([`tiled_index`]), padded to whole
    /// tiles; experts: each job's tokens' rows from row `row0[e]` (one buffer for all jobs, so
    /// it stops growing once the largest call has been seen).
    x: AlignedVec<u16>,
    /// Experts: the intermediate as BF16 `[pad(m), inter]` per job, tiled, from row `row0[e]`.
    mid: AlignedVec<u16>,
    /// Experts: w2's output `[pad(m), 16·row blocks]` per job, from row `row0[e]`.
    y: AlignedVec<f32>,
    /// Experts: each job's first (padded) row in `x`, `mid` and `y`; one more entry: the total.
    row0: Vec<usize>,
    /// w13 tasks `(job, pair0, pair1, work)`.
    tasks: Vec<(usize, usize, usize, usize)>,
    /// w2 tasks `(job, block0, block1, work)`.
    tasks2: Vec<(usize, usize, usize, usize)>,
    /// Conversion tasks `(job, row0, row1)`.
    xtasks: Vec<(usize, usize, usize)>,
    /// Per token: its (job, row) entries in job order (CSR over `tok_start`).
    tok_start: Vec<usize>,
    tok_entries: Vec<(u32, u32)>,
}

impl CallBufs {
    const fn new() -> Self {
        CallBufs {
            x: AlignedVec::new(),
            mid: AlignedVec::new(),
            y: AlignedVec::new(),
            row0: Vec::new(),
            tasks: Vec::new(),
            tasks2: Vec::new(),
            xtasks: Vec::new(),
            tok_start: Vec::new(),
            tok_entries: Vec::new(),
        }
    }
}

thread_local! {
    /// The calling worker's buffers.
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::new(Scratch::default());
}

/// The call buffers, one set for the process: every runner and every layer reuses them (calls
/// take turns), so a prefill touches fresh pages once, not once per layer and linear, and RSS
/// holds one set (at 512 tokens of V2-Lite about 50 MB; it grows with the longest prompt).
static CALL: Mutex<CallBufs> = Mutex::new(CallBufs::new());

/// Bytes of call buffers [`trim`] keeps by default: a 512-token V2-Lite prefill's (~50 MB), so
/// repeated prompts of that size fault no pages again; a longer prompt's are handed back.
pub const KEEP_BYTES: usize = 64 << 20;

/// Frees the call buffers when they hold more than `keep` bytes: for the engine to call after a
/// forward pass (the layers of one pass reuse them; a long prompt's would otherwise stay resident).
pub fn trim(keep: usize) {
    let mut call = CALL.lock().unwrap_or_else(|e| e.into_inner());
    let held = call.x.capacity() * 2 + call.mid.capacity() * 2 + call.y.capacity() * 4;
    if held > keep {
        *call = CallBufs::new();
    }
}

/// [`trim`] to [`KEEP_BYTES`] after a forward pass of `tokens` tokens; nothing to do (not even the
/// lock) below [`min_tokens`], where no call can have grown the buffers: decode steps.
pub fn trim_after_forward(tokens: usize) {
    if tokens >= min_tokens() {
        trim(KEEP_BYTES);
    }
}

/// Rows padded to whole tiles.
fn padded(m: usize) -> usize {
    m.div_ceil(16) * 16
}

/// Row blocks per panel at K = `k` ([`PANEL_BYTES`], or `KRASIS_BF16_PANEL_KB`).
fn panel_blocks(k: usize) -> usize {
    static B: OnceLock<usize> = OnceLock::new();
    let bytes = *B.get_or_init(|| krasis_core::knobs::knobs().bf16_panel_kb.unwrap_or(PANEL_BYTES >> 10) << 10);
    (bytes / (k * ROW_BLOCK * 2)).max(1)
}

/// [`TASKS_PER_WORKER`], or `KRASIS_BF16_TASKS`.
fn tasks_per_worker() -> usize {
    static T: OnceLock<usize> = OnceLock::new();
    *T.get_or_init(|| krasis_core::knobs::knobs().bf16_tasks.unwrap_or(TASKS_PER_WORKER))
}

/// `out[pad(m) rows, row stride os] = a · W[b0..b1]ᵀ` (16 columns per block, from column 0 of
/// `out`), `a` `[pad(m), l.k]` BF16, tiled.
///
/// # Safety
/// `out` valid for `pad(m)` rows of stride `os` ≥ 16·(b1 − b0); `a` finite in its padding rows.
#[allow(clippy::too_many_arguments)]
unsafe fn matmul_blocks(
    tiles: Bf16Tiles,
    w: &[u8],
    l: &PackedLayout,
    b0: usize,
    b1: usize,
    a: &[u16],
    m: usize,
    out: *mut f32,
    os: usize,
    panel: &mut AlignedVec<u16>,
) {
    matmul_blocks_with(tiles, w, l, b0, b1, a, m, out, os, panel, panel_blocks(l.k));
}

/// [`matmul_blocks`] with `per` row blocks per panel.
///
/// # Safety
/// As [`matmul_blocks`].
#[allow(clippy::too_many_arguments)]
unsafe fn matmul_blocks_with(
    tiles: Bf16Tiles,
    w: &[u8],
    l: &PackedLayout,
    b0: usize,
    b1: usize,
    a: &[u16],
    m: usize,
    out: *mut f32,
    os: usize,
    panel: &mut AlignedVec<u16>,
    per: usize,
) {
    let k = l.k;
    let per = per.max(1);
    let mtiles = m.div_ceil(16);
    debug_assert!(a.len() >= mtiles * 16 * k);
    let pl = panel_len(l);
    let mut b = b0;
    while b < b1 {
        let nb = (b1 - b).min(per);
        panel.grow(nb * pl);
        let mut clock = std::time::Instant::now();
        for i in 0..nb {
            block_panel(w, l, b + i, &mut panel[i * pl..(i + 1) * pl]);
        }
        // No prefetch of the next panel's weights here: issued before the tiles (one `prefetcht1`
        // per line) or spread over the tile kernel's K steps, it moved its time into the tiles
        // and slowed the expert prefill (GPU box, run_experts at V2-Lite's shapes: INT4 13.0 /
        // 11.4 ms without, 14.5 / 13.5 before the tiles, 15.7 / 15.1 spread; INT8 14.5 / 15.1,
        // 17.5 / 16.5, 16.1 / 18.5; `device-2026-11-25-h100-panel-prefetch-ab.log`).
        PHASE_NS.lap(&mut clock, 4);
        tiles_on_panel(tiles, panel, nb, k, a.as_ptr(), mtiles, out.add((b - b0) * ROW_BLOCK), os);
        PHASE_NS.lap(&mut clock, 5);
        b += nb;
    }
}

/// `out[mtiles · 16 rows, row stride os] = a · panelᵀ` for a ready `panel` of `nb` row blocks
/// over K = `k` ([`crate::quant::bf16`]'s layout), `a` tiled BF16 ([`tiled_index`]).
///
/// # Safety
/// `k` a multiple of [`TILE_K`]; `panel` holds `nb` blocks' panels; `a` `mtiles · 16 · k`
/// elements, all finite; `out` valid for `mtiles · 16` rows of stride `os` ≥ 16·nb.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn tiles_on_panel(
    tiles: Bf16Tiles,
    panel: &[u16],
    nb: usize,
    k: usize,
    a: *const u16,
    mtiles: usize,
    out: *mut f32,
    os: usize,
) {
    debug_assert!(panel.len() >= nb * k * ROW_BLOCK);
    #[cfg(target_arch = "x86_64")]
    match tiles {
        Bf16Tiles::Hardware => {
            crate::quant::amx::bf16::matmul(&mut crate::quant::amx::HwTiles, panel.as_ptr(), nb, k, a, mtiles, out, os)
        }
        Bf16Tiles::Emulated => crate::quant::amx::bf16::matmul(
            &mut crate::quant::amx::EmuTiles::new(),
            panel.as_ptr(),
            nb,
            k,
            a,
            mtiles,
            out,
            os,
        ),
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (tiles, panel, nb, k, a, mtiles, out, os);
        unreachable!("BF16 tiles exist on x86_64 only");
    }
}

/// `src` (one row of K = `k`) as BF16 into row `i` of the tiled `dst`.
pub(crate) fn convert_row(src: &[f32], i: usize, k: usize, dst: &mut [u16]) {
    // The row's runs of TILE_K floats lie one A tile (16 rows × TILE_K) apart.
    let at = tiled_index(i, 0, k / TILE_K);
    to_bf16_runs(&src[..k], TILE_K, &mut dst[at..], TILE_ROWS * TILE_K);
}

/// Zeroes rows `m..pad(m)` of the tiled `dst` (K = `k`).
fn zero_padding(m: usize, k: usize, dst: &mut [u16]) {
    zero_padding_rows(m, padded(m), k, dst);
}

/// Zeroes rows `m..end` of the tiled `dst` (K = `k`).
pub(crate) fn zero_padding_rows(m: usize, end: usize, k: usize, dst: &mut [u16]) {
    let ks = k / TILE_K;
    for i in m..end {
        for s in 0..ks {
            let at = tiled_index(i, s * TILE_K, ks);
            dst[at..at + TILE_K].fill(0);
        }
    }
}

/// `(tasks, rows per task)` for a round of row tasks over `m` rows (row conversion, the sum).
fn row_tasks(workers: usize, m: usize) -> (usize, usize) {
    let per = m.div_ceil(workers.max(1)).max(1);
    (m.div_ceil(per), per)
}

/// [`crate::moe::PoolMatmul::run_many`] on the BF16 tiles (same contract).
pub(crate) fn run_many(
    tiles: Bf16Tiles,
    pool: &WorkerPool,
    mats: &[(&[u8], &PackedLayout)],
    x: &[f32],
    m: usize,
    ys: &mut [&mut [f32]],
) {
    CALLS.fetch_add(1, Ordering::Relaxed);
    let k = mats[0].1.k;
    let mp = padded(m);
    let mut call = CALL.lock().unwrap_or_else(|e| e.into_inner());
    call.x.grow(mp * k);
    let xbuf = &mut call.x[..mp * k];
    zero_padding(m, k, xbuf);
    let xb = DisjointPtr(xbuf.as_mut_ptr());
    let xlen = xbuf.len();
    let starts = block_unit_starts(mats);
    let total = *starts.last().unwrap_or(&0);
    let per = total.div_ceil(tasks_per_worker() * pool.threads().max(1)).max(1);
    let (nx, xper) = row_tasks(pool.threads(), m);
    let (done, failed) = (AtomicUsize::new(0), AtomicBool::new(false));
    let outs: Vec<OutPtr> = ys.iter_mut().map(|y| OutPtr(y.as_mut_ptr())).collect();
    pool.run(nx + total.div_ceil(per), &|t, _| {
        let _guard = FailOnUnwind(&failed);
        if t < nx {
            let (r0, r1) = (t * xper, ((t + 1) * xper).min(m));
            // SAFETY: rows r0..r1 are written by this task alone; read after the release below.
            let dst = unsafe { std::slice::from_raw_parts_mut(xb.get(), xlen) };
            for i in r0..r1 {
                convert_row(&x[i * k..(i + 1) * k], i, k, dst);
            }
            done.fetch_add(r1 - r0, Ordering::Release);
            return;
        }
        let t = t - nx;
        SCRATCH.with_borrow_mut(|s| {
            for (j, b0, b1) in block_runs(&starts, t * per, ((t + 1) * per).min(total)) {
                let (w, l) = mats[j];
                let rows = l.rows;
                let bb = l.block_bytes();
                wait_ready(&done, m, &failed, &w[b0 * bb..(b0 * bb + X_WAIT_PREFETCH).min(b1 * bb)]);
                // SAFETY: all rows converted (counter above, acquire); nobody writes them now.
                let a = unsafe { std::slice::from_raw_parts(xb.get(), xlen) };
                let cols = (b1 - b0) * ROW_BLOCK;
                s.c.grow(mp * cols);
                // SAFETY: c holds pad(m) rows of `cols`; a is pad(m)·k with zero padding rows.
                unsafe { matmul_blocks(tiles, w, l, b0, b1, a, m, s.c.as_mut_ptr(), cols, &mut s.panel) };
                let keep = cols.min(rows - b0 * ROW_BLOCK);
                for i in 0..m {
                    // SAFETY: this task alone owns columns [16·b0, 16·b0 + keep) of ys[j]'s rows.
                    unsafe { outs[j].write(i * rows + b0 * ROW_BLOCK, &s.c[i * cols..i * cols + keep]) };
                }
            }
        })
    });
}

/// Tasks `(job, unit0, unit1, work)` over `units` per job, sized by work (`tiles(job)` activation
/// tiles + [`DEQUANT_TILES`] per unit), largest first.
fn size_tasks(out: &mut Vec<(usize, usize, usize, usize)>, mtiles: &[usize], units: usize, workers: usize) {
    out.clear();
    let total: usize = mtiles.iter().filter(|&&t| t > 0).map(|&t| (t + DEQUANT_TILES) * units).sum();
    let target = total.div_ceil(tasks_per_worker() * workers.max(1)).max(1);
    for (e, &t) in mtiles.iter().enumerate() {
        if t == 0 {
            continue;
        }
        let per = target.div_ceil(t + DEQUANT_TILES).clamp(1, units);
        let mut u = 0;
        while u < units {
            let u1 = (u + per).min(units);
            out.push((e, u, u1, (u1 - u) * (t + DEQUANT_TILES)));
            u = u1;
        }
    }
    out.sort_by_key(|t| std::cmp::Reverse(t.3));
}

/// The experts' activation between w13 and w2, as [`crate::moe::PoolExperts`] runs it: SiLU, or
/// another [`ExpertActivation`] after each job's gate and up biases (gpt-oss's clamped SwiGLU).
#[derive(Clone, Copy, Debug)]
pub(crate) struct ExpertAct<'a> {
    pub activation: ExpertActivation,
    /// Per job, `[gate biases | up biases]` (`2 · inter` floats); `None`: no biases.
    pub bias13: Option<&'a [&'a [f32]]>,
}

impl ExpertAct<'_> {
    /// SiLU(gate)·up with no biases (every family but gpt-oss; shared experts).
    pub(crate) const SILU: ExpertAct<'static> = ExpertAct { activation: ExpertActivation::Silu, bias13: None };
}

/// [`crate::moe::PoolExperts::run`] on the BF16 tiles (same contract: `out += Σ_e w·expert_e(x)`
/// per token, jobs added in order), with `act` between w13 and w2.
#[allow(clippy::too_many_arguments)]
pub(crate) fn run_experts(
    tiles: Bf16Tiles,
    pool: &WorkerPool,
    l13: &PackedLayout,
    l2: &PackedLayout,
    x: &[f32],
    hidden: usize,
    jobs: &[ExpertJob<'_>],
    act: ExpertAct<'_>,
    out: &mut [f32],
) {
    run_experts_as(fused_dispatch(), tiles, pool, l13, l2, x, hidden, jobs, act, out)
}

/// [`run_experts`] with the expert tasks in one dispatch (`fused`) or one per kind of task.
#[allow(clippy::too_many_arguments)]
fn run_experts_as(
    fused: bool,
    tiles: Bf16Tiles,
    pool: &WorkerPool,
    l13: &PackedLayout,
    l2: &PackedLayout,
    x: &[f32],
    hidden: usize,
    jobs: &[ExpertJob<'_>],
    act: ExpertAct<'_>,
    out: &mut [f32],
) {
    if let Some(b) = act.bias13 {
        assert_eq!(b.len(), jobs.len(), "run_experts: one bias13 per job");
        assert!(b.iter().all(|b| b.len() == l13.rows), "run_experts: each bias13 holds 2 × {} floats", l13.rows / 2);
    }
    CALLS.fetch_add(1, Ordering::Relaxed);
    let mut clock = std::time::Instant::now();
    let rows = x.len() / hidden;
    let inter = l13.rows / 2;
    let (pairs, nb2) = (l13.row_blocks() / 2, l2.row_blocks());
    let ys = nb2 * ROW_BLOCK;
    let workers = pool.threads();
    let mut guard = CALL.lock().unwrap_or_else(|e| e.into_inner());
    let call = &mut *guard;
    let n = jobs.len();
    // Each job's token rows as BF16, tiled (tasks of about a round's share of all rows; the
    // task holding a job's last row also zeroes its padding rows).
    let all: usize = jobs.iter().map(|j| j.tokens.len()).sum();
    let chunk = all.div_ceil(2 * workers.max(1)).max(TILE_ROWS);
    call.row0.clear();
    call.row0.push(0);
    call.xtasks.clear();
    for (e, job) in jobs.iter().enumerate() {
        let mut r = 0;
        while r < job.tokens.len() {
            call.xtasks.push((e, r, (r + chunk).min(job.tokens.len())));
            r += chunk;
        }
        call.row0.push(call.row0[e] + padded(job.tokens.len()));
    }
    let total_rows = call.row0[n];
    call.x.grow(total_rows * hidden);
    call.mid.grow(total_rows * inter);
    call.y.grow(total_rows * ys);
    let mtiles: Vec<usize> = jobs.iter().map(|j| j.tokens.len().div_ceil(16)).collect();
    // w13 tasks (expert, block pairs), largest first; then w2 tasks (expert, row blocks) in the
    // order their experts' intermediates complete (the expert's last w13 task), largest first
    // within an expert.
    size_tasks(&mut call.tasks, &mtiles, pairs, workers);
    let mut tasks2 = std::mem::take(&mut call.tasks2);
    size_tasks(&mut tasks2, &mtiles, nb2, workers);
    let mut last13 = vec![0usize; n];
    for (i, t) in call.tasks.iter().enumerate() {
        last13[t.0] = i;
    }
    tasks2.sort_by_key(|t| (last13[t.0], std::cmp::Reverse(t.3)));
    call.tasks2 = tasks2;
    // Per job: conversion tasks and w13 tasks it has, and how many of each have finished.
    let mut want = vec![[0usize; 2]; n];
    for &(e, ..) in &call.xtasks {
        want[e][0] += 1;
    }
    for &(e, ..) in &call.tasks {
        want[e][1] += 1;
    }
    let done: Vec<[AtomicUsize; 2]> = (0..n).map(|_| [AtomicUsize::new(0), AtomicUsize::new(0)]).collect();
    let failed = AtomicBool::new(false);
    let (xp, mids, yp) =
        (DisjointPtr(call.x.as_mut_ptr()), DisjointPtr(call.mid.as_mut_ptr()), OutPtr(call.y.as_mut_ptr()));
    let (xtasks, tasks, tasks2, row0) = (&call.xtasks, &call.tasks, &call.tasks2, &call.row0);
    let (nx, n13) = (xtasks.len(), tasks.len());
    let (ks2, isa) = (inter / TILE_K, crate::isa::active());
    // Waits until every task of kind `kind` (0: conversion, 1: w13) of expert e has finished,
    // pulling the first bytes of `w` (the weights read next) towards L2 meanwhile; the wait
    // counts as waiting time.
    let wait_inputs = |e: usize, kind: usize, w: &[u8], busy: &mut std::time::Instant| {
        wait_ready(&done[e][kind], want[e][kind], &failed, &w[..w.len().min(X_WAIT_PREFETCH)]);
        PHASE_NS.lap(busy, 2);
    };
    let task = |t: usize| {
        let _fail = FailOnUnwind(&failed);
        let mut busy = std::time::Instant::now();
        if t < nx {
            // Job e's token rows r0..r1 as BF16, tiled.
            let (e, r0, r1) = xtasks[t];
            let toks = jobs[e].tokens;
            // SAFETY: rows r0..r1 of job e (and its padding rows, for the task ending at its last
            // row) are written by this task alone; the job's rows lie inside x; readers wait for
            // every conversion task of the job (`done[e][0]`).
            let dst =
                unsafe { std::slice::from_raw_parts_mut(xp.get().add(row0[e] * hidden), padded(toks.len()) * hidden) };
            for (i, &(tok, _)) in toks.iter().enumerate().take(r1).skip(r0) {
                convert_row(&x[tok * hidden..(tok + 1) * hidden], i, hidden, dst);
            }
            if r1 == toks.len() {
                zero_padding(toks.len(), hidden, dst);
            }
            done[e][0].fetch_add(1, Ordering::Release);
            PHASE_NS.lap(&mut busy, 0);
        } else if t < nx + n13 {
            // w13: SiLU(gate)·up of block pairs p0..p1 into mid[e] as BF16 (padding rows zero).
            let (e, p0, p1, _) = tasks[t - nx];
            let (m, mp) = (jobs[e].tokens.len(), padded(jobs[e].tokens.len()));
            let w = jobs[e].weights.w13;
            wait_inputs(e, 0, w, &mut busy);
            // SAFETY: x[e] is complete (every conversion task of e has finished, Acquire above)
            // and no task writes it any more.
            let xa = unsafe { std::slice::from_raw_parts(xp.get().add(row0[e] * hidden).cast_const(), mp * hidden) };
            SCRATCH.with_borrow_mut(|s| {
                let (cols13, cols) = ((p1 - p0) * 2 * ROW_BLOCK, (p1 - p0) * ROW_BLOCK);
                s.c.grow(mp * cols13);
                // SAFETY: c holds pad(m) rows of cols13; xa is pad(m)·hidden, tiled, zero padding.
                unsafe { matmul_blocks(tiles, w, l13, 2 * p0, 2 * p1, xa, m, s.c.as_mut_ptr(), cols13, &mut s.panel) };
                s.act.grow(m * cols);
                let bias = act.bias13.map(|b| b[e]);
                activate_w13(isa, act.activation, bias, p0, &s.c[..m * cols13], m, &mut s.act[..m * cols]);
                for i in 0..mp {
                    for c in (0..cols).step_by(ROW_BLOCK) {
                        let at = tiled_index(i, p0 * ROW_BLOCK + c, ks2);
                        // SAFETY: this task alone writes columns [16·p0, 16·p1) of mid[e]'s rows
                        // (16 consecutive tiled elements per 16-aligned column run).
                        let dst =
                            unsafe { std::slice::from_raw_parts_mut(mids.get().add(row0[e] * inter + at), ROW_BLOCK) };
                        if i < m {
                            to_bf16(&s.act[i * cols + c..i * cols + c + ROW_BLOCK], dst);
                        } else {
                            dst.fill(0);
                        }
                    }
                }
            });
            done[e][1].fetch_add(1, Ordering::Release);
            PHASE_NS.lap(&mut busy, 6);
        } else {
            // w2: row blocks b0..b1 of expert e into y[e].
            let (e, b0, b1, _) = tasks2[t - nx - n13];
            let (m, mp) = (jobs[e].tokens.len(), padded(jobs[e].tokens.len()));
            let w = jobs[e].weights.w2;
            wait_inputs(e, 1, w, &mut busy);
            // SAFETY: mid[e] is complete (every w13 task of e has finished, Acquire above) with
            // zero padding rows, and no task writes it any more.
            let mid = unsafe { std::slice::from_raw_parts(mids.get().add(row0[e] * inter).cast_const(), mp * inter) };
            SCRATCH.with_borrow_mut(|s| {
                // SAFETY: y[e] holds pad(m) rows of `ys`; this task alone writes its columns
                // [16·b0, 16·b1).
                unsafe {
                    matmul_blocks(
                        tiles,
                        w,
                        l2,
                        b0,
                        b1,
                        mid,
                        m,
                        yp.ptr().add(row0[e] * ys + b0 * ROW_BLOCK),
                        ys,
                        &mut s.panel,
                    )
                };
            });
            PHASE_NS.lap(&mut busy, 7);
        }
    };
    let all_tasks = nx + n13 + tasks2.len();
    if fused {
        // One dispatch: tasks are claimed in index order, so every task a waiter depends on has
        // been claimed (and runs to completion) before the waiter is; workers move on to w2 tasks
        // of finished experts instead of idling at the end of the w13 phase.
        pool.run(all_tasks, &|t, _| task(t));
    } else {
        for (start, end) in [(0, nx), (nx, nx + n13), (nx + n13, all_tasks)] {
            pool.run(end - start, &|t, _| task(start + t));
        }
    }
    PHASE_NS.lap(&mut clock, 1);
    // Weighted sum per token, jobs in order.
    call.tok_start.clear();
    call.tok_start.resize(rows + 1, 0);
    for job in jobs {
        for &(tok, _) in job.tokens {
            call.tok_start[tok + 1] += 1;
        }
    }
    for i in 0..rows {
        call.tok_start[i + 1] += call.tok_start[i];
    }
    call.tok_entries.resize(call.tok_start[rows], (0, 0));
    let mut fill = call.tok_start.clone();
    for (e, job) in jobs.iter().enumerate() {
        for (r, &(tok, _)) in job.tokens.iter().enumerate() {
            call.tok_entries[fill[tok]] = (e as u32, r as u32);
            fill[tok] += 1;
        }
    }
    let (starts, entries, y, row0) = (&call.tok_start, &call.tok_entries, &call.y, &call.row0);
    let out_p = OutPtr(out.as_mut_ptr());
    let (ns, sper) = row_tasks(workers, rows);
    pool.run(ns, &|t, _| {
        for tok in t * sper..((t + 1) * sper).min(rows) {
            // SAFETY: token rows are disjoint between tasks; tok < rows ≤ out.len() / hidden.
            let o = unsafe { std::slice::from_raw_parts_mut(out_p.ptr().add(tok * hidden), hidden) };
            for &(e, r) in &entries[starts[tok]..starts[tok + 1]] {
                let (e, r) = (e as usize, r as usize);
                let w = jobs[e].tokens[r].1;
                for (ov, &v) in o.iter_mut().zip(&y[(row0[e] + r) * ys..(row0[e] + r) * ys + hidden]) {
                    *ov += w * v;
                }
            }
        }
    });
    PHASE_NS.lap(&mut clock, 3);
}

#[cfg(test)]
#[path = "prefill_bf16_tests.rs"]
mod tests;
