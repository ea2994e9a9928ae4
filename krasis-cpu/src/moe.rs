//! Quantised matmuls and routed experts spread over the pinned [`WorkerPool`]: work is split
//! inside each matrix (by row blocks) and across experts, and each expert's tasks run on the
//! workers of the NUMA node that holds its weights.
//!
//! One decode step of a MoE layer is one dispatch: all experts' w13 row-block pairs (each task
//! applies SiLU(gate)·up to its own pairs; the task that completes a group of the intermediate
//! quantises it), then all experts' w2 row blocks, each consuming its own expert's intermediate
//! group by group as it is quantised and adding its weighted output into the layer output (see
//! [`PoolExperts::run`]).
//! No serial step and no second wake-up between them, nor after them.
//!
//! Activations enter the integer kernels as two INT8 rows per token ([`quantize_acts_split`]):
//! the INT8 quantisation and its INT8-quantised residual. Their outputs add up to the product with
//! a ~15-bit activation, so the only rounding left is the weights' own — INT8 activations alone
//! doubled the error of a weight-only quantisation on the oracle fixtures. The kernels apply each
//! weight chunk to both rows while it is in registers, so the weight stream (the decode bound) is
//! unchanged; the integer work doubles.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

use crate::isa::Isa;
use crate::moe_trace::{DispatchSpan, TaskKind, TaskSpan, Trace, TraceSummary};
use crate::pool::WorkerPool;
use crate::prefill_bf16;
use crate::quant::{
    activate_w13, matmul_packed, matmul_packed_groups, prefetch_l2, quantize_acts, quantize_group,
    quantize_group_split, PackedLayout, QuantizedActs, ROW_BLOCK,
};
use krasis_core::spec::ExpertActivation;
use krasis_quant::group::MAX_GROUP_SIZE;

/// Tasks per worker each phase of a [`PoolExperts`] dispatch aims for. Measured on the 16-core
/// Xeon with the one-dispatch runner (2026-11-21): one V2-Lite INT4 expert per dispatch
/// 123 GB/s at 2 against 101–109 at 4 (every task start begins a fresh DRAM stream), top-6 the
/// same at 2, 3 and 4; the older two-dispatch runner had been worse at 1 (idle workers in the
/// last round).
pub const TASKS_PER_WORKER: usize = 2;

/// Tasks per worker of a [`PoolMatmul`] (fewer leaves workers idle in the last round, more pays
/// the atomic claim per task for nothing; not re-measured with the expert runner's change).
pub(crate) const MATMUL_TASKS_PER_WORKER: usize = 4;

/// `KRASIS_TASKS_PER_WORKER`, if set (a tuning knob for both runners).
fn tasks_per_worker_env() -> Option<usize> {
    krasis_core::knobs::knobs().tasks_per_worker
}

/// Units (row blocks) per [`PoolMatmul`] task for `total` units over `workers`.
pub(crate) fn units_per_task(total: usize, workers: usize) -> usize {
    let t = tasks_per_worker_env().unwrap_or(MATMUL_TASKS_PER_WORKER);
    total.div_ceil(t * workers.max(1)).max(1)
}

/// Quantise `x[m, k]` as `2m` INT8 rows: row `2i` is `x_i` quantised, row `2i+1` the residual
/// `x_i − deq(row 2i)` quantised, so `deq(2i) + deq(2i+1) ≈ x_i` to ~1/127² of the group max.
/// Outputs of a matmul on these rows are summed pairwise with [`sum_split_rows`]. Each group is
/// quantised once and its residual straight after (`resid` holds one group; reused).
pub fn quantize_acts_split(x: &[f32], m: usize, k: usize, gs: usize, resid: &mut Vec<f32>, out: &mut QuantizedActs) {
    assert_eq!(x.len(), m * k);
    if split_factor() == 1 {
        quantize_acts(x, m, k, gs, out);
        return;
    }
    assert!(gs > 0 && k.is_multiple_of(gs), "quantize_acts_split: group size {gs} does not divide K = {k}");
    let ng = k / gs;
    shape_acts(out, 2 * m, k, gs);
    resid.resize(gs, 0.0);
    for i in 0..m {
        let (hi_q, lo_q) = out.q[2 * i * k..(2 * i + 2) * k].split_at_mut(k);
        for g in 0..ng {
            let xg = &x[i * k + g * gs..i * k + (g + 1) * gs];
            let [(s0, c0), (s1, c1)] =
                quantize_group_split(xg, &mut hi_q[g * gs..(g + 1) * gs], &mut lo_q[g * gs..(g + 1) * gs], resid);
            out.scales[2 * i * ng + g] = s0;
            out.sums[2 * i * ng + g] = c0;
            out.scales[(2 * i + 1) * ng + g] = s1;
            out.sums[(2 * i + 1) * ng + g] = c1;
        }
    }
}

/// Size `a` for `m` rows of `k` in groups of `gs` (contents left as they were).
pub(crate) fn shape_acts(a: &mut QuantizedActs, m: usize, k: usize, gs: usize) {
    let ng = k / gs;
    a.m = m;
    a.k = k;
    a.gs = gs;
    a.q.resize(m * k, 0);
    a.scales.resize(m * ng, 0.0);
    a.sums.resize(m * ng, 0);
}

/// INT8 rows per token: 2 (value + residual, the default) or 1 with `KRASIS_ACT_SPLIT=0`, which
/// trades accuracy for half the integer work (for measuring what the residual costs).
pub fn split_factor() -> usize {
    if krasis_core::knobs::knobs().act_split {
        2
    } else {
        1
    }
}

/// `KRASIS_DENSE_XQ=caller`: [`PoolMatmul`] and [`crate::heads::HeadMatmul`] quantise their
/// activations on the calling thread before the dispatch instead of in its first tasks (read
/// once; for measuring what the in-dispatch quantisation saves, or costs where the workers'
/// cores are shared and a waiting task spins while the quantising one is descheduled).
pub(crate) fn caller_quantises() -> bool {
    krasis_core::knobs::knobs().dense_xq_caller
}

/// `KRASIS_MOE_SUM=serial`: [`PoolExperts`] add the experts' outputs after the dispatch, on the
/// calling thread (the former runner; for measuring what the in-dispatch sum saves).
fn fused_sum_env() -> bool {
    !krasis_core::knobs::knobs().moe_sum_serial
}

/// `y[i] = out[2i] + out[2i+1]` for rows of width `w` (in place: the result occupies the first
/// `m·w` elements); nothing to do when activations are not split.
pub fn sum_split_rows(out: &mut [f32], m: usize, w: usize) {
    if split_factor() == 1 {
        return;
    }
    for i in 0..m {
        for j in 0..w {
            out[i * w + j] = out[2 * i * w + j] + out[(2 * i + 1) * w + j];
        }
    }
}

/// Raw pointer for disjoint writes from pool tasks.
#[derive(Clone, Copy)]
pub(crate) struct OutPtr(pub(crate) *mut f32);
// SAFETY: every task writes a disjoint set of elements (argued at each use).
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// The pointer (a method, so closures capture the whole `Sync` wrapper).
    pub(crate) fn ptr(self) -> *mut f32 {
        self.0
    }

    /// # Safety
    /// `at..at+src.len()` must be in bounds and written by no other task.
    pub(crate) unsafe fn write(self, at: usize, src: &[f32]) {
        std::ptr::copy_nonoverlapping(src.as_ptr(), self.0.add(at), src.len());
    }

    /// `len` floats from `at`, to read.
    ///
    /// # Safety
    /// `at..at + len` must be in bounds and written by no other thread while the slice lives.
    pub(crate) unsafe fn slice<'a>(self, at: usize, len: usize) -> &'a [f32] {
        std::slice::from_raw_parts(self.0.add(at), len)
    }

    /// `len` floats from `at`, to write.
    ///
    /// # Safety
    /// `at..at + len` must be in bounds and accessed by no other thread while the slice lives.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn slice_mut<'a>(self, at: usize, len: usize) -> &'a mut [f32] {
        std::slice::from_raw_parts_mut(self.0.add(at), len)
    }

    /// `self[at + j] += w · src[j]`.
    ///
    /// # Safety
    /// `at..at+src.len()` must be in bounds and accessed by no other thread meanwhile.
    unsafe fn add_scaled(self, at: usize, w: f32, src: &[f32]) {
        let dst = std::slice::from_raw_parts_mut(self.0.add(at), src.len());
        for (o, &v) in dst.iter_mut().zip(src) {
            *o += w * v;
        }
    }
}

/// Calls of more rows (tokens) than this free their scratch when they end. Decode and batched
/// decode (the server's up to 32 streams, with room) reuse theirs call after call; a prompt
/// chunk's buffers grow with its length and would otherwise stay for the process's life in
/// every matrix (measured, #38: the tiny preset after a 2048-token prompt on the INT8 kernels
/// held 45 MiB more than its 23 MiB estimate, all of it these buffers).
pub const KEEP_SCRATCH_MAX_ROWS: usize = 64;

/// Per-worker scratch buffers, each touched only by its worker.
pub(crate) struct WorkerScratch(Vec<Mutex<Vec<f32>>>);

impl WorkerScratch {
    pub(crate) fn new(workers: usize) -> Self {
        WorkerScratch((0..workers).map(|_| Mutex::new(Vec::new())).collect())
    }

    pub(crate) fn with<R>(&self, worker: usize, len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
        let mut v = self.0[worker].lock().unwrap_or_else(|e| e.into_inner());
        if v.len() < len {
            v.resize(len, 0.0);
        }
        f(&mut v[..len])
    }

    /// Bytes the workers' buffers hold.
    pub(crate) fn bytes(&self) -> usize {
        self.0.iter().map(|v| 4 * v.lock().unwrap_or_else(|e| e.into_inner()).capacity()).sum()
    }

    /// Frees every worker's buffer (see [`KEEP_SCRATCH_MAX_ROWS`]).
    pub(crate) fn release(&self) {
        for v in &self.0 {
            *v.lock().unwrap_or_else(|e| e.into_inner()) = Vec::new();
        }
    }
}

/// A packed matrix computed over the pool: `y[m, rows] = x · Wᵀ` (padding rows dropped).
pub struct PoolMatmul {
    scratch: WorkerScratch,
    acts: Mutex<QuantizedActs>,
}

impl PoolMatmul {
    pub fn new(pool: &WorkerPool) -> Self {
        PoolMatmul { scratch: WorkerScratch::new(pool.threads()), acts: Mutex::new(QuantizedActs::new()) }
    }

    /// Bytes its reusable buffers hold between calls (kept only after calls of at most
    /// [`KEEP_SCRATCH_MAX_ROWS`] rows).
    pub fn scratch_bytes(&self) -> usize {
        self.scratch.bytes() + self.acts.lock().unwrap_or_else(|e| e.into_inner()).held_bytes()
    }

    #[allow(clippy::too_many_arguments)]
    pub fn run(
        &self,
        pool: &WorkerPool,
        isa: Isa,
        w: &[u8],
        layout: &PackedLayout,
        x: &[f32],
        m: usize,
        y: &mut [f32],
    ) {
        self.run_many(pool, isa, &[(w, layout)], x, m, &mut [y]);
    }

    /// Several packed matrices of one input `x[m, k]` in one dispatch: `ys[j][m, rows_j] = x ·
    /// W_jᵀ`. The activations are quantised once for all of them; the row blocks of all the
    /// matrices form one task list. Each `ys[j]` gets exactly what [`PoolMatmul::run`] gives.
    ///
    /// # Panics
    /// When the matrices differ in K or group size, or a `ys[j]` is not `m × rows_j`.
    pub fn run_many(
        &self,
        pool: &WorkerPool,
        isa: Isa,
        mats: &[(&[u8], &PackedLayout)],
        x: &[f32],
        m: usize,
        ys: &mut [&mut [f32]],
    ) {
        let Some(&(_, first)) = mats.first() else { return };
        assert_eq!(mats.len(), ys.len(), "PoolMatmul: {} matrices, {} outputs", mats.len(), ys.len());
        for ((_, l), y) in mats.iter().zip(ys.iter()) {
            assert!(l.k == first.k && l.gs == first.gs, "PoolMatmul: matrices of one input differ in K or group size");
            assert_eq!(y.len(), m * l.rows, "PoolMatmul: y must be m×rows = {m}×{}", l.rows);
        }
        assert_eq!(x.len(), m * first.k, "PoolMatmul: x must be m×k = {m}×{}", first.k);
        if let Some(tiles) = prefill_bf16::applies(isa, m, first.k) {
            return prefill_bf16::run_many(tiles, pool, mats, x, m, ys);
        }
        let (k, gs, split) = (first.k, first.gs, split_factor());
        let ng = k / gs;
        let mut guard = self.acts.lock().unwrap_or_else(|e| e.into_inner());
        let acts = &mut *guard;
        shape_acts(acts, split * m, k, gs);
        let dst = ActBufs::of(acts);
        let acts = &*acts;
        let starts = block_unit_starts(mats);
        let total = *starts.last().unwrap_or(&0);
        let per = units_per_task(total, pool.threads());
        // The activations are quantised inside the dispatch: the first `nx` tasks (claimed
        // first: the pool hands out tasks in order) quantise about one round of group ranges,
        // and matmul tasks wait for all groups (a few µs) with their weights' first bytes
        // already on the way, instead of the caller quantising alone before the dispatch.
        let perx = ng.div_ceil(pool.threads()).max(1);
        let mut nx = ng.div_ceil(perx);
        let (x_ready, failed) = (AtomicUsize::new(0), AtomicBool::new(false));
        if caller_quantises() {
            for g in 0..ng {
                // SAFETY: x is m×k (asserted); no task runs yet.
                unsafe { quantize_rows_group(|i| x[i * k..].as_ptr(), m, dst, k, gs, g, split) };
            }
            x_ready.store(ng, Ordering::Release);
            nx = 0;
        }
        let outs: Vec<OutPtr> = ys.iter_mut().map(|y| OutPtr(y.as_mut_ptr())).collect();
        pool.run(nx + total.div_ceil(per), &|t, ctx| {
            let _guard = FailOnUnwind(&failed);
            if t < nx {
                let (g0, g1) = (t * perx, ((t + 1) * perx).min(ng));
                for g in g0..g1 {
                    // SAFETY: x is m×k (asserted); group g of every row is written by this task
                    // alone and read by matmul tasks only after the release below.
                    unsafe { quantize_rows_group(|i| x[i * k..].as_ptr(), m, dst, k, gs, g, split) };
                }
                x_ready.fetch_add(g1 - g0, Ordering::Release);
                return;
            }
            let t = t - nx;
            for (j, b0, b1) in block_runs(&starts, t * per, ((t + 1) * per).min(total)) {
                let (w, layout) = mats[j];
                let rows = layout.rows;
                let bb = layout.block_bytes();
                wait_ready(&x_ready, ng, &failed, &w[b0 * bb..(b0 * bb + X_WAIT_PREFETCH).min(b1 * bb)]);
                let cols = (b1 - b0) * ROW_BLOCK;
                self.scratch.with(ctx.worker, split * m * cols, |tmp| {
                    matmul_packed(isa, w, layout, acts, b0..b1, tmp);
                    sum_split_rows(tmp, m, cols);
                    let keep = cols.min(rows - b0 * ROW_BLOCK);
                    for i in 0..m {
                        // SAFETY: this task alone owns columns [16·b0, 16·b0 + keep) of every row
                        // of ys[j] (the tasks' unit ranges are disjoint); in bounds (asserted).
                        unsafe { outs[j].write(i * rows + b0 * ROW_BLOCK, &tmp[i * cols..i * cols + keep]) };
                    }
                });
            }
        });
        if m > KEEP_SCRATCH_MAX_ROWS {
            *guard = QuantizedActs::new();
            self.scratch.release();
        }
    }
}

/// Row blocks of several matrices as one task list: matrix j's blocks are units
/// `starts[j]..starts[j + 1]`; the last entry is the total.
pub(crate) fn block_unit_starts(mats: &[(&[u8], &PackedLayout)]) -> Vec<usize> {
    let mut starts = Vec::with_capacity(mats.len() + 1);
    starts.push(0);
    for (_, l) in mats {
        starts.push(starts.last().copied().unwrap_or(0) + l.row_blocks());
    }
    starts
}

/// The runs `(matrix j, block b0, block b1)` that units `u..end` of [`block_unit_starts`]'s task
/// list cover, in order.
pub(crate) fn block_runs(
    starts: &[usize],
    mut u: usize,
    end: usize,
) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
    std::iter::from_fn(move || {
        (u < end).then(|| {
            let j = starts.partition_point(|&s| s <= u) - 1;
            let (b0, b1) = (u - starts[j], (end - starts[j]).min(starts[j + 1] - starts[j]));
            u += b1 - b0;
            (j, b0, b1)
        })
    })
}

/// One routed expert's packed weights and the NUMA node (pool node index) that holds them.
#[derive(Clone, Copy)]
pub struct ExpertWeights<'a> {
    pub w13: &'a [u8],
    pub w2: &'a [u8],
    pub node: usize,
}

/// One task of [`PoolExperts::run`]'s dispatch.
#[derive(Clone, Copy, Debug)]
enum Task {
    /// Groups `g0..g1` (along the hidden size) of activation set `a`: its tokens' rows of `x`,
    /// quantised as [`quantize_acts_split`] does.
    X { a: usize, g0: usize, g1: usize },
    /// w13 block pairs `p0..p1` of job `e`, once its activation set is quantised:
    /// SiLU(gate)·up into `mid[e]`, and quantisation of every w2 group of `mid[e]` this task
    /// completes.
    W13 { e: usize, p0: usize, p1: usize },
    /// w2 row blocks `b0..b1` of job `e` over the intermediate's groups `g0..g1`, consuming
    /// `mid[e]`'s quantised groups in K order as they become ready. Over all groups: into
    /// `y[e]` (or, fused, `out`). Over part of them ([`W2Mode::GroupMajor`]): continuing the
    /// blocks' partial sums in `part[e]` after the task over groups `..g0` (turn counter), and,
    /// when `g1` is the last group, adding the result as above.
    W2 { e: usize, b0: usize, b1: usize, g0: usize, g1: usize },
}

impl Task {
    /// The weight bytes this task reads, in the order it reads them (none for an X task).
    fn weights<'a>(self, jobs: &[ExpertJob<'a>], lay: &JobLayouts<'_>) -> &'a [u8] {
        match self {
            Task::W13 { e, p0, p1 } => {
                let (w13, bb) = (jobs[e].weights.w13, lay.of(e).0.block_bytes());
                &w13[(2 * p0 * bb).min(w13.len())..(2 * p1 * bb).min(w13.len())]
            }
            Task::W2 { e, b0, b1, .. } => {
                let (w2, bb) = (jobs[e].weights.w2, lay.of(e).1.block_bytes());
                &w2[(b0 * bb).min(w2.len())..(b1 * bb).min(w2.len())]
            }
            Task::X { .. } => &[],
        }
    }
}

/// The layouts of a call's jobs: those of the first `extra` jobs ([`PoolExperts::run_with`]),
/// then the runner's own.
#[derive(Clone, Copy)]
struct JobLayouts<'a> {
    extra: usize,
    own: (&'a PackedLayout, &'a PackedLayout),
    extra_layouts: (&'a PackedLayout, &'a PackedLayout),
}

impl<'a> JobLayouts<'a> {
    fn of(&self, e: usize) -> (&'a PackedLayout, &'a PackedLayout) {
        if e < self.extra {
            self.extra_layouts
        } else {
            self.own
        }
    }

    /// Where job `e`'s w2 groups start in the per-(job, group) counters.
    fn group_base(&self, e: usize) -> usize {
        let (g, ge) = (self.own.1.groups(), self.extra_layouts.1.groups());
        if e < self.extra {
            e * ge
        } else {
            self.extra * ge + (e - self.extra) * g
        }
    }
}

/// Jobs of other layouts in the same dispatch as a runner's own ([`PoolExperts::run_with`]): a
/// shared expert beside the routed ones.
#[derive(Clone, Copy)]
pub struct ExtraJobs<'a> {
    pub w13_layout: &'a PackedLayout,
    pub w2_layout: &'a PackedLayout,
    pub jobs: &'a [ExpertJob<'a>],
}

/// How [`PoolExperts`]' w2 tasks meet the intermediate their job's w13 tasks produce.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum W2Mode {
    /// Each task (a row-block range over all groups) waits until the whole intermediate is
    /// quantised (the former runner; `KRASIS_MOE_W2=whole`).
    Whole,
    /// Each task (a row-block range over all groups) consumes the groups in K order as they are
    /// quantised, in kernel calls of at least [`W2_RUN_MIN_K`] columns (the default;
    /// `KRASIS_MOE_W2=groups`).
    ByGroups,
    /// Group-major tasks (`KRASIS_MOE_W2=major`): a job's w2 is cut into group ranges (as many
    /// as w2 tasks per worker, at most one per group) and each range into the same row-block
    /// ranges (about one per worker over all jobs); tasks are listed range by range, and each
    /// continues its blocks' partial sums after the previous range's task over the same blocks.
    /// So the work that needs the last w13 round's groups is spread over all workers at the
    /// hand-over (each holding a slice it has pulled into L2 while waiting) instead of sitting
    /// on the workers that finish w13 last. Opt-in: measured worse on the 16-core Xeon
    /// (2026-11-21, `--gemv-compare`, log `-moe8.log`): INT4 one expert 92.3 GB/s median
    /// against 102.3 by groups, top-6 100.2 against 137.7 (the workers leaving w13 last still
    /// claim first-range tasks, and the next range waits for them; each block's range is a
    /// short stream the kernel's linear prefetch overruns).
    GroupMajor,
}

impl W2Mode {
    /// `KRASIS_MOE_W2=whole|groups|major` (default [`W2Mode::ByGroups`]).
    fn from_env() -> W2Mode {
        match krasis_core::knobs::knobs().moe_w2 {
            krasis_core::knobs::MoeW2::Whole => W2Mode::Whole,
            krasis_core::knobs::MoeW2::ByGroups => W2Mode::ByGroups,
            krasis_core::knobs::MoeW2::GroupMajor => W2Mode::GroupMajor,
        }
    }
}

/// Raw view of a [`QuantizedActs`]' buffers (`[rows, k]` i8, `[rows, groups]` scales and sums),
/// for disjoint writes from pool tasks (and reads after the writes, ordered by the progress
/// counters).
#[derive(Clone, Copy)]
pub(crate) struct ActBufs {
    q: *mut i8,
    scales: *mut f32,
    sums: *mut i32,
}
// SAFETY: every task writes a disjoint set of elements, and reads only what the progress
// counters say is complete (argued at each use).
unsafe impl Send for ActBufs {}
unsafe impl Sync for ActBufs {}

impl ActBufs {
    pub(crate) fn of(a: &mut QuantizedActs) -> ActBufs {
        ActBufs { q: a.q.as_mut_ptr(), scales: a.scales.as_mut_ptr(), sums: a.sums.as_mut_ptr() }
    }
}

/// Raw views of one job's step buffers: the `[m, inter]` f32 intermediate and its quantisation.
#[derive(Clone, Copy)]
struct JobBufs {
    mid: *mut f32,
    acts: ActBufs,
}
// SAFETY: as for ActBufs.
unsafe impl Send for JobBufs {}
unsafe impl Sync for JobBufs {}

/// Reusable buffers of [`PoolExperts::run`] (grow once, then no allocation per step).
#[derive(Default)]
struct StepScratch {
    /// Quantised activations, one per distinct token list (decode: one for all experts).
    acts: Vec<QuantizedActs>,
    /// Index into `acts` of each job.
    acts_of: Vec<usize>,
    /// Per activation set: the first job that uses it (its token list gives the rows).
    act_src: Vec<usize>,
    /// Per activation set: hidden-size groups quantised so far.
    x_ready: Vec<AtomicUsize>,
    /// Per activation set: quantised by each w13 task's worker for itself (no X tasks).
    local_x: Vec<bool>,
    /// Calls of `run` so far (tells a worker's [`LocalActs`] of this call from stale ones).
    serial: u64,
    xbufs: Vec<ActBufs>,
    mid: Vec<Vec<f32>>,
    mid_acts: Vec<QuantizedActs>,
    y: Vec<Vec<f32>>,
    /// Per node: its task list (the activation sets its jobs introduce, then all w13 tasks of
    /// the node's jobs, then all their w2 tasks).
    tasks: Vec<Vec<Task>>,
    counts: Vec<usize>,
    /// Per node: its first w13 task (after the activation tasks), where the affine dispatch's
    /// owned run starts (see [`PoolExperts::prefetch_first_tasks`]).
    owned_from: Vec<usize>,
    /// Per (job, w2 group): intermediate columns of the group computed so far.
    cols_done: Vec<AtomicUsize>,
    /// Per (job, w2 group): 1 once the group of the job's intermediate is quantised.
    group_ok: Vec<AtomicUsize>,
    /// Per job: raw views of `mid`/`mid_acts` and of `y`, for the tasks.
    bufs: Vec<JobBufs>,
    ys: Vec<OutPtr>,
    /// Per w2 row block: jobs whose weighted output has been added to `out` there.
    out_turn: Vec<AtomicUsize>,
    /// [`W2Mode::GroupMajor`]: per job, the `[split·m, 16·blocks]` partial sums of w2, each
    /// task's block range contiguous (at `split·m·16·b0`), and their raw views for the tasks.
    part: Vec<Vec<f32>>,
    parts: Vec<OutPtr>,
    /// [`W2Mode::GroupMajor`]: per (job, first row block of a task's range): groups whose
    /// partial sums are in `part` so far.
    part_turn: Vec<AtomicUsize>,
    /// What `tasks` was planned for (see `plan_key`); decode repeats it call after call.
    plan_key: Vec<usize>,
    /// This call's key, compared with `plan_key`.
    key_now: Vec<usize>,
}

/// Runs the routed experts of one layer over the pool.
pub struct PoolExperts {
    w13_layout: PackedLayout,
    w2_layout: PackedLayout,
    tasks_per_worker: usize,
    /// Tasks per worker of the w2 phase, when it differs from `tasks_per_worker` (measured with
    /// w2 by groups, device log `-moe7.log`: 1 instead of 2 gave one expert the same, top-6 INT4
    /// 139.4 against 143.8 GB/s median).
    w2_tasks_per_worker: Option<usize>,
    scratch: WorkerScratch,
    step: Mutex<StepScratch>,
    fused_sum: bool,
    /// Guided task sizes (see `plan`) for dispatches of at least this many jobs
    /// ([`GUIDED_MIN_JOBS`]; `KRASIS_MOE_TASKS=even|guided`: never / always).
    guided_min_jobs: usize,
    trace: Option<Trace>,
    /// Per worker: its own quantisation of a small activation set.
    local_acts: Vec<Mutex<LocalActs>>,
    /// Sets of at most this many tokens are quantised per worker (0, the default: none; see
    /// [`LOCAL_X_MAX_ROWS`]).
    local_x_max_rows: usize,
    /// ... and only in dispatches of at most this many jobs (`KRASIS_MOE_XQ=local1`: one).
    local_x_max_jobs: usize,
    /// Per worker: the groups of an intermediate its w2 task has consumed so far (copied out of
    /// the shared buffer, which other tasks are still filling).
    w2_acts: Vec<Mutex<QuantizedActs>>,
    /// How w2 tasks consume the intermediate ([`W2Mode`]).
    w2_mode: W2Mode,
    /// By groups, the fewest intermediate columns a w2 kernel call takes ([`W2_RUN_MIN_K`];
    /// `KRASIS_MOE_W2_RUN_K`).
    w2_run_k: usize,
    /// Dispatch with each node's first round of w13 tasks owned by its workers
    /// ([`WorkerPool::run_on_nodes_affine`]; default), so [`PoolExperts::prefetch_first_tasks`]
    /// warms the caches the call reads first; `KRASIS_MOE_AFFINE=0`: plain dynamic claims.
    affine: bool,
    /// The plan of [`PoolExperts::prefetch_first_tasks`] (kept apart from the calls' own).
    prefetch_step: Mutex<StepScratch>,
    /// The activation of the runner's own jobs (SiLU unless [`PoolExperts::with_activation`]).
    activation: ExpertActivation,
}

/// A worker's own quantisation of activation set `set` of call `serial`.
#[derive(Default)]
struct LocalActs {
    key: Option<(u64, usize)>,
    acts: QuantizedActs,
}

/// With `KRASIS_MOE_XQ=local`, activation sets of at most this many tokens are quantised by
/// every worker for itself (each w13 task's worker, once per call) instead of by shared X tasks.
/// Off by default: measured on the 16-core Xeon (2026-11-21, `--gemv-trace`, `--gemv-compare`)
/// the shared X tasks have a token's activations ready ≈ 5 µs after the dispatch, but one core
/// takes ≈ 4.5 µs to quantise a 2048-wide token (value + residual) on its own, so every w13
/// stream started as late; one expert per dispatch INT4 109.4 GB/s median local against 112.0
/// shared.
const LOCAL_X_MAX_ROWS: usize = 2;

/// By groups, a w2 task waits until at least this many intermediate columns are ready (or its
/// range ends) before a kernel call: each call reads a run of every row block's groups, and a
/// run of one NVFP4 group is 128 bytes per block. 128 columns (INT4 g128's one group, so INT4
/// is unchanged) measured best on the H200 host's 16 cores (2026-11-30, `--expert-gemv`, four
/// rounds against 1, 64 and 256: NVFP4 +8 % one expert per dispatch and +7 % top-6, MXFP4
/// +4 % / +4 %; `bench/logs/2026-11-30/h200-w2-run-s35.log`).
pub const W2_RUN_MIN_K: usize = 128;

/// Bytes of its weights a w13 task pulls towards L2 before quantising its activations itself:
/// a few lines in flight, not a long burst (prefetches beyond the L2 miss queue stall the core:
/// ≈ 8 µs per quantising task with 16 KiB, ≈ 4.5 with 4 KiB).
const LOCAL_X_PREFETCH: usize = 4 << 10;

/// `KRASIS_MOE_XQ=local|local1`: quantise small activation sets per worker
/// ([`LOCAL_X_MAX_ROWS`]) in every dispatch / in one-job dispatches only; (rows, jobs). `local1`
/// stays opt-in: measured (log `-moe8.log`) INT4 one expert 113.4 GB/s median against 102.3
/// shared, but INT8 134.3 against 138.2.
fn local_x_env() -> (usize, usize) {
    match krasis_core::knobs::knobs().moe_xq {
        krasis_core::knobs::MoeXq::Local => (LOCAL_X_MAX_ROWS, usize::MAX),
        krasis_core::knobs::MoeXq::Local1 => (LOCAL_X_MAX_ROWS, 1),
        krasis_core::knobs::MoeXq::Shared => (0, usize::MAX),
    }
}

/// [`PoolExperts`] dispatches of at least this many jobs shrink their tasks towards the end of
/// each phase (see `plan`). Measured on the 16-core Xeon (2026-11-21, `--gemv-compare`,
/// interleaved passes): top-6 INT4 147.6 GB/s median guided against 142.3 even (workers idled
/// 10–20 µs at the end of a top-6 dispatch), INT8 154.0 against 150.7; one expert per dispatch
/// 102.6 guided against 112.0 even (each extra task start costs more than the shorter tail).
const GUIDED_MIN_JOBS: usize = 2;

/// `KRASIS_MOE_TASKS=guided|even` overrides [`GUIDED_MIN_JOBS`] (always / never).
fn guided_env() -> usize {
    match krasis_core::knobs::knobs().moe_tasks {
        Some(krasis_core::knobs::MoeTasks::Guided) => 1,
        Some(krasis_core::knobs::MoeTasks::Even) => usize::MAX,
        None => GUIDED_MIN_JOBS,
    }
}

/// The work of one expert in a step: its weights, its tokens' rows of `x` and their weights.
#[derive(Clone, Copy)]
pub struct ExpertJob<'a> {
    pub weights: ExpertWeights<'a>,
    /// `(token, routing weight)`.
    pub tokens: &'a [(usize, f32)],
}

/// Sets the flag if dropped while unwinding (a task panicked), so waiters stop waiting for work
/// that will never complete.
pub(crate) struct FailOnUnwind<'a>(pub(crate) &'a AtomicBool);

impl Drop for FailOnUnwind<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.store(true, Ordering::Release);
        }
    }
}

/// Counts columns `cols` of a row as written into the per-group counters `done` (groups of `gs`
/// columns; several tasks write parts of a group) and calls `complete(g)` for each group that
/// this call completes. AcqRel on the counter: the task that completes a group sees every other
/// writer's columns of it.
pub(crate) fn count_group_columns(
    done: &[AtomicUsize],
    cols: std::ops::Range<usize>,
    gs: usize,
    mut complete: impl FnMut(usize),
) {
    let first = cols.start / gs;
    for (i, counter) in done[first..cols.end.div_ceil(gs)].iter().enumerate() {
        let g = first + i;
        let mine = cols.end.min((g + 1) * gs) - cols.start.max(g * gs);
        if counter.fetch_add(mine, Ordering::AcqRel) + mine == gs {
            complete(g);
        }
    }
}

/// Spins between `sched_yield`s while a w2 task waits for its intermediate: a preempted w13
/// task (more workers than free cores) gets its core back quickly.
const SPINS_PER_YIELD: u32 = 64;

/// Bytes [`PoolExperts::prefetch_first_tasks`] pulls between two looks at its `stop`: long
/// enough that the check costs nothing, short enough that the pool leaves within about a
/// microsecond of `stop`.
const PREFETCH_STOP_CHECK_BYTES: usize = 4096;

/// Bytes of its weights a w13 task pulls towards L2 while it waits for its activations.
pub(crate) const X_WAIT_PREFETCH: usize = 16 << 10;

/// Wait until `ready` reaches `want`; before spinning, pull `upcoming` (the weights the waiter
/// reads next) towards L2 so the wait still streams memory. Panics if `failed` is set.
pub(crate) fn wait_ready(ready: &AtomicUsize, want: usize, failed: &AtomicBool, upcoming: &[u8]) {
    if ready.load(Ordering::Acquire) >= want {
        return;
    }
    prefetch_l2(upcoming);
    let mut spins = 0u32;
    while ready.load(Ordering::Acquire) < want {
        if failed.load(Ordering::Acquire) {
            panic!("PoolExperts: a task this one depends on failed");
        }
        std::hint::spin_loop();
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(SPINS_PER_YIELD) {
            std::thread::yield_now();
        }
    }
}

impl PoolExperts {
    pub fn new(pool: &WorkerPool, w13_layout: PackedLayout, w2_layout: PackedLayout) -> Self {
        assert!(w13_layout.rows.is_multiple_of(2 * ROW_BLOCK), "w13 must be a fused gate+up layout");
        assert_eq!(w2_layout.k, w13_layout.rows / 2, "w2 K must equal the intermediate size");
        PoolExperts {
            w13_layout,
            w2_layout,
            tasks_per_worker: tasks_per_worker_env().unwrap_or(TASKS_PER_WORKER),
            w2_tasks_per_worker: None,
            scratch: WorkerScratch::new(pool.threads()),
            step: Mutex::new(StepScratch::default()),
            fused_sum: fused_sum_env(),
            guided_min_jobs: guided_env(),
            trace: None,
            local_acts: (0..pool.threads()).map(|_| Mutex::new(LocalActs::default())).collect(),
            local_x_max_rows: local_x_env().0,
            local_x_max_jobs: local_x_env().1,
            w2_acts: (0..pool.threads()).map(|_| Mutex::new(QuantizedActs::new())).collect(),
            w2_mode: W2Mode::from_env(),
            w2_run_k: krasis_core::knobs::knobs().moe_w2_run_k.unwrap_or(W2_RUN_MIN_K),
            affine: krasis_core::knobs::knobs().moe_affine,
            prefetch_step: Mutex::new(StepScratch::default()),
            activation: ExpertActivation::Silu,
        }
    }

    /// The runner's own jobs with `activation` in place of SiLU (gpt-oss's clamped SwiGLU); the
    /// extra jobs of [`PoolExperts::run_with`] (a shared expert) keep SiLU. Not SiLU, the calls
    /// keep the integer kernels (the BF16 prefill tiles apply SiLU only).
    pub fn with_activation(mut self, activation: ExpertActivation) -> Self {
        self.activation = activation;
        self
    }

    /// Add the experts' weighted outputs inside the dispatch (default; each w2 task adds its
    /// columns, in job order per row block) or serially after it (`false`; the former runner,
    /// for comparison; `KRASIS_MOE_SUM=serial` sets it for every runner).
    pub fn with_fused_sum(mut self, fused: bool) -> Self {
        self.fused_sum = fused;
        self
    }

    /// w2 tasks consume their intermediate group by group as it is quantised (`true`, the
    /// default) or only once all of it is (`false`; `KRASIS_MOE_W2=whole` sets it for every
    /// runner); for comparison and tests.
    pub fn with_w2_by_groups(mut self, by_groups: bool) -> Self {
        self.w2_mode = if by_groups { W2Mode::ByGroups } else { W2Mode::Whole };
        self
    }

    /// How w2 tasks consume the intermediate (default [`W2Mode::ByGroups`]; `KRASIS_MOE_W2`
    /// sets it for every runner); for comparison and tests.
    pub fn with_w2_mode(mut self, mode: W2Mode) -> Self {
        self.w2_mode = mode;
        self
    }

    /// By groups, the fewest intermediate columns a w2 kernel call takes (default
    /// [`W2_RUN_MIN_K`]; `KRASIS_MOE_W2_RUN_K` sets it for every runner); for tuning and tests.
    pub fn with_w2_run_k(mut self, k: usize) -> Self {
        self.w2_run_k = k;
        self
    }

    /// Split the w2 phase into about `t` tasks per worker (the w13 phase keeps
    /// [`Self::with_tasks_per_worker`]'s); for tuning.
    pub fn with_w2_tasks_per_worker(mut self, t: usize) -> Self {
        self.w2_tasks_per_worker = Some(t.max(1));
        self
    }

    /// Activation sets of at most `rows` tokens are quantised by each worker for itself (0: all
    /// in shared tasks); for tests and tuning.
    pub fn with_local_x_rows(mut self, rows: usize) -> Self {
        self.local_x_max_rows = rows;
        self
    }

    /// Quantise activations per worker ([`Self::with_local_x_rows`]) only in dispatches of at
    /// most `jobs` jobs (default: any); for tests and tuning.
    pub fn with_local_x_max_jobs(mut self, jobs: usize) -> Self {
        self.local_x_max_jobs = jobs;
        self
    }

    /// Guided task sizes (shrinking towards the end of each phase) or even ones; for tests
    /// and tuning.
    pub fn with_guided_tasks(mut self, guided: bool) -> Self {
        self.guided_min_jobs = if guided { 1 } else { usize::MAX };
        self
    }

    /// Record a timeline of up to `cap` dispatches (tasks per worker likewise) for
    /// [`PoolExperts::take_trace_summary`]; bench-only (costs a few clock reads per task).
    pub fn with_trace(mut self, pool: &WorkerPool, cap: usize) -> Self {
        self.trace = Some(Trace::new(pool.threads(), cap));
        self
    }

    /// Summary of the dispatches traced since the last call (`None` without [`Self::with_trace`]).
    pub fn take_trace_summary(&self) -> Option<TraceSummary> {
        self.trace.as_ref().map(Trace::take_summary)
    }

    /// Split each phase into about `t` tasks per worker (default [`TASKS_PER_WORKER`]); for
    /// tests of odd task boundaries and for tuning.
    pub fn with_tasks_per_worker(mut self, t: usize) -> Self {
        self.tasks_per_worker = t.max(1);
        self
    }

    pub fn w13_layout(&self) -> &PackedLayout {
        &self.w13_layout
    }

    pub fn w2_layout(&self) -> &PackedLayout {
        &self.w2_layout
    }

    /// Units (block pairs or row blocks) per task for `total` units over `workers`.
    fn units_per_task(total: usize, tpw: usize, workers: usize) -> usize {
        total.div_ceil(tpw * workers.max(1)).max(1)
    }

    /// Task lists per node: the activation quantisation tasks, every job's w13 tasks, then
    /// every job's w2 tasks. A task waits only for tasks that sit earlier in a node's list (a w2
    /// task for its job's w13 tasks, on the same node; a w13 task for its activation set, on the
    /// node of the set's first job; with the fused sum, a w2 task also for the w2 tasks of
    /// earlier jobs over the same blocks, which sit earlier in their nodes' lists): take the
    /// first task in (phase, job) order that never ends; it is not waiting, as everything it
    /// waits on comes earlier and ends; nor unclaimed, as its node's workers claim in order and
    /// the tasks ahead of it end; so waits end. (Activation sets of ≤ [`LOCAL_X_MAX_ROWS`]
    /// tokens have no X tasks: each w13 task's worker quantises them itself. In
    /// [`W2Mode::GroupMajor`] a w2 task also waits for the previous group range's task over
    /// its blocks, which the job's list holds earlier: ranges are listed in order.)
    fn plan(&self, step: &mut StepScratch, jobs: &[ExpertJob<'_>], lay: &JobLayouts<'_>, nodes: usize, workers: usize) {
        let pairs_of = |e: usize| lay.of(e).0.row_blocks() / 2;
        let nb2 = self.w2_layout.row_blocks();
        let n = jobs.len();
        let (tpw13, tpw2) = (self.tasks_per_worker, self.w2_tasks_per_worker.unwrap_or(self.tasks_per_worker));
        // Units of the jobs from e on (the guided sizes shrink with what is left).
        let pairs_from = |e: usize| (e..n).map(pairs_of).sum::<usize>();
        let per13 = Self::units_per_task(pairs_from(0), tpw13, workers);
        // A w2 row block costs its job's groups: w2 tasks are sized in the runner's own blocks
        // (a job of twice the intermediate gets half the blocks per task).
        let (own_g, g_of) = (lay.own.1.groups(), |e: usize| lay.of(e).1.groups());
        let own_blocks_from = |e: usize| (e..n).map(|j| nb2 * g_of(j)).sum::<usize>() / own_g;
        let per2 = Self::units_per_task(own_blocks_from(0), tpw2, workers);
        // Guided: a task's size shrinks with the units left in its phase, down to half the even
        // size, so the phase ends in small tasks (less idle time at the w13 → w2 hand-over and
        // at the end) while its bulk keeps long streams.
        let guided = n >= self.guided_min_jobs;
        let size = move |per: usize, tpw: usize, left: usize| {
            if guided {
                left.div_ceil(tpw * workers.max(1)).clamp(per.div_ceil(2), per)
            } else {
                per
            }
        };
        // Activation groups: one round over the workers (tiny tasks; decode has 16 groups).
        step.tasks.resize_with(nodes, Vec::new);
        step.tasks.iter_mut().for_each(Vec::clear);
        for (a, &e) in step.act_src.iter().enumerate() {
            if step.local_x[a] {
                continue;
            }
            let ng13 = lay.of(e).0.groups();
            let perx = ng13.div_ceil(workers.max(1)).max(1);
            let node = jobs[e].weights.node.min(nodes - 1);
            for g0 in (0..ng13).step_by(perx) {
                step.tasks[node].push(Task::X { a, g0, g1: (g0 + perx).min(ng13) });
            }
        }
        step.owned_from.clear();
        step.owned_from.extend(step.tasks.iter().map(Vec::len));
        for (e, job) in jobs.iter().enumerate() {
            let node = job.weights.node.min(nodes - 1);
            let (pairs, left) = (pairs_of(e), pairs_from(e));
            let mut p0 = 0;
            while p0 < pairs {
                let p1 = (p0 + size(per13, tpw13, left - p0)).min(pairs);
                step.tasks[node].push(Task::W13 { e, p0, p1 });
                p0 = p1;
            }
        }
        for (e, job) in jobs.iter().enumerate() {
            let node = job.weights.node.min(nodes - 1);
            let ng2 = lay.of(e).1.groups();
            if self.w2_mode == W2Mode::GroupMajor {
                // Group ranges (the w2 tasks per worker), each over the same block ranges of
                // about one per worker over all jobs; a range's tasks all before the next's.
                let ranges = tpw2.min(ng2).max(1);
                let per = Self::units_per_task(nb2 * n, 1, workers);
                for j in 0..ranges {
                    let (g0, g1) = (j * ng2 / ranges, (j + 1) * ng2 / ranges);
                    let mut b0 = 0;
                    while b0 < nb2 {
                        let b1 = (b0 + size(per, 1, nb2 * (n - e) - b0)).min(nb2);
                        step.tasks[node].push(Task::W2 { e, b0, b1, g0, g1 });
                        b0 = b1;
                    }
                }
                continue;
            }
            let (per, left) = ((per2 * own_g / ng2).max(1), own_blocks_from(e) * own_g / ng2);
            let mut b0 = 0;
            while b0 < nb2 {
                let b1 = (b0 + size(per, tpw2, left.saturating_sub(b0).max(1))).min(nb2);
                step.tasks[node].push(Task::W2 { e, b0, b1, g0: 0, g1: ng2 });
                b0 = b1;
            }
        }
        step.counts.clear();
        step.counts.extend(step.tasks.iter().map(Vec::len));
    }

    /// Whether an activation set of `rows` tokens in a dispatch of `jobs` jobs is quantised by
    /// each w13 task's worker for itself (no X tasks).
    fn quantises_locally(&self, jobs: usize, rows: usize) -> bool {
        jobs <= self.local_x_max_jobs && rows <= self.local_x_max_rows
    }

    /// Plans `step` for `jobs` unless its plan already fits: the plan depends only on the job
    /// count, the pool's shape, the jobs' nodes, which jobs share activation sets
    /// (`step.acts_of`) and which sets are quantised per worker (`step.local_x`).
    fn plan_if_changed(&self, step: &mut StepScratch, jobs: &[ExpertJob<'_>], lay: &JobLayouts<'_>, pool: &WorkerPool) {
        step.key_now.clear();
        step.key_now.extend([jobs.len(), lay.extra, pool.nodes(), pool.threads()]);
        if lay.extra > 0 {
            for l in [lay.extra_layouts.0, lay.extra_layouts.1] {
                step.key_now.extend([l.rows, l.k, l.gs, l.bits as usize]);
            }
        }
        step.key_now.extend(jobs.iter().map(|j| j.weights.node));
        step.key_now.extend(step.acts_of.iter().copied());
        step.key_now.extend(step.local_x.iter().map(|&l| l as usize));
        if step.key_now != step.plan_key {
            self.plan(step, jobs, lay, pool.nodes(), pool.threads());
            std::mem::swap(&mut step.key_now, &mut step.plan_key);
        }
    }

    /// Pulls into each worker's L2 the weights of the task it will run first in a one-token
    /// call of `experts` (in that order), up to `budget` bytes in all, until `stop()`: the
    /// same affine dispatch plan as [`PoolExperts::run`]'s, so when the call comes with the same
    /// experts each worker finds the start of its first w13 task in its own cache. Returns the
    /// bytes requested. Does nothing when the runner dispatches without affinity.
    pub fn prefetch_first_tasks(
        &self,
        pool: &WorkerPool,
        experts: &[ExpertWeights<'_>],
        budget: usize,
        stop: &(dyn Fn() -> bool + Sync),
    ) -> usize {
        if !self.affine || experts.is_empty() || budget == 0 {
            return 0;
        }
        const ONE_TOKEN: [(usize, f32); 1] = [(0, 0.0)];
        let jobs: Vec<ExpertJob<'_>> =
            experts.iter().map(|&weights| ExpertJob { weights, tokens: &ONE_TOKEN }).collect();
        let mut guard = self.prefetch_step.lock().unwrap_or_else(|e| e.into_inner());
        let step = &mut *guard;
        // The activation sets of a one-token call, as `run` sets them up: one, shared by all.
        step.acts_of.clear();
        step.acts_of.resize(jobs.len(), 0);
        step.act_src.clear();
        step.act_src.push(0);
        step.local_x.clear();
        step.local_x.push(self.quantises_locally(jobs.len(), 1));
        let lay = self.own_layouts();
        self.plan_if_changed(step, &jobs, &lay, pool);
        // Tasks up to the end of each node's owned run (the ones before it do nothing here).
        let counts: Vec<usize> = (0..step.tasks.len())
            .map(|j| (step.owned_from[j] + pool.node_threads(j)).min(step.tasks[j].len()))
            .collect();
        let per_task = budget.div_ceil(pool.threads().max(1));
        let (tasks, owned_from) = (&step.tasks, &step.owned_from);
        let requested = AtomicUsize::new(0);
        pool.run_on_nodes_affine(&counts, owned_from, &|node, t, _| {
            if t < owned_from[node] {
                return;
            }
            let w = tasks[node][t].weights(&jobs, &lay);
            let w = &w[..w.len().min(per_task)];
            let mut done = 0;
            for piece in w.chunks(PREFETCH_STOP_CHECK_BYTES) {
                if stop() {
                    break;
                }
                prefetch_l2(piece);
                done += piece.len();
            }
            requested.fetch_add(done, Ordering::Relaxed);
        });
        requested.into_inner()
    }

    /// `out[t, hidden] += Σ_jobs w · expert(x[t])` for each job's tokens. `x` is `[t, hidden]`.
    ///
    /// One pool dispatch per call: tiny tasks quantise each distinct token list's rows of `x`
    /// (by groups, in parallel); w13 tasks wait for theirs, write SiLU(gate)·up into the job's
    /// intermediate and count the columns they finish per w2 group; the task that completes a
    /// group quantises it (value + residual rows, as [`quantize_acts_split`]); w2 tasks consume
    /// their job's groups in K order as they are quantised (each kernel call continues the sums
    /// over the next run of ready groups, see [`matmul_packed_groups`]) and add `w · y` for their row blocks into
    /// `out`, job after job (a per-block turn counter keeps the job order). The numbers are those of the phase-by-phase composition
    /// (quantise x, w13, SiLU·up, quantise, w2, weighted sum in job order), bit for bit.
    pub fn run(&self, pool: &WorkerPool, isa: Isa, x: &[f32], hidden: usize, jobs: &[ExpertJob<'_>], out: &mut [f32]) {
        self.run_with(pool, isa, x, hidden, jobs, None, out)
    }

    /// The runner's own layouts for every job.
    fn own_layouts(&self) -> JobLayouts<'_> {
        let own = (&self.w13_layout, &self.w2_layout);
        JobLayouts { extra: 0, own, extra_layouts: own }
    }

    /// [`PoolExperts::run`] with `extra` jobs of their own layouts (same hidden size) in the same
    /// dispatch, before `jobs`: their outputs are added first, so `out` gets the bits of a
    /// runner of the extra layouts on `extra.jobs` followed by `run(jobs)`. Calls that take the
    /// BF16 prefill tiles run the two sets one after the other.
    #[allow(clippy::too_many_arguments)]
    pub fn run_with(
        &self,
        pool: &WorkerPool,
        isa: Isa,
        x: &[f32],
        hidden: usize,
        jobs: &[ExpertJob<'_>],
        extra: Option<ExtraJobs<'_>>,
        out: &mut [f32],
    ) {
        self.run_inner(pool, isa, x, hidden, jobs, extra, None, out);
        self.release_if_long(x.len() / hidden.max(1));
    }

    /// [`PoolExperts::run`] with each job's gate and up biases added before the activation:
    /// `bias13[j]` is job `j`'s `[gate biases | up biases]` (`2 · inter` floats). The down
    /// projection's bias is the caller's to add (`Σ w · b_down` per token does not depend on
    /// the kernel). A prefill that takes the BF16 tiles adds them there the same way.
    #[allow(clippy::too_many_arguments)]
    pub fn run_biased(
        &self,
        pool: &WorkerPool,
        isa: Isa,
        x: &[f32],
        hidden: usize,
        jobs: &[ExpertJob<'_>],
        bias13: &[&[f32]],
        out: &mut [f32],
    ) {
        assert_eq!(bias13.len(), jobs.len(), "run_biased: one bias13 per job");
        let inter = self.w13_layout.rows / 2;
        assert!(bias13.iter().all(|b| b.len() == 2 * inter), "run_biased: each bias13 holds 2 × {inter} floats");
        self.run_inner(pool, isa, x, hidden, jobs, None, Some(bias13), out);
        self.release_if_long(x.len() / hidden.max(1));
    }

    /// Bytes its reusable buffers hold between calls (kept only after calls of at most
    /// [`KEEP_SCRATCH_MAX_ROWS`] tokens).
    pub fn scratch_bytes(&self) -> usize {
        let step = self.step.lock().unwrap_or_else(|e| e.into_inner());
        let vecs = |v: &[Vec<f32>]| v.iter().map(|b| 4 * b.capacity()).sum::<usize>();
        let acts = |v: &[QuantizedActs]| v.iter().map(QuantizedActs::held_bytes).sum::<usize>();
        let w2 = self.w2_acts.iter().map(|a| a.lock().unwrap_or_else(|e| e.into_inner()).held_bytes()).sum::<usize>();
        let local = self.local_acts.iter().map(|a| a.lock().unwrap_or_else(|e| e.into_inner()).acts.held_bytes());
        self.scratch.bytes()
            + vecs(&step.mid)
            + vecs(&step.y)
            + vecs(&step.part)
            + acts(&step.acts)
            + acts(&step.mid_acts)
            + w2
            + local.sum::<usize>()
    }

    /// After a call over `tokens` rows of x: frees the call's buffers when it was longer than
    /// [`KEEP_SCRATCH_MAX_ROWS`] (the plan too, so the next call plans again).
    fn release_if_long(&self, tokens: usize) {
        if tokens <= KEEP_SCRATCH_MAX_ROWS {
            return;
        }
        *self.step.lock().unwrap_or_else(|e| e.into_inner()) = StepScratch::default();
        self.scratch.release();
        for a in &self.w2_acts {
            *a.lock().unwrap_or_else(|e| e.into_inner()) = QuantizedActs::new();
        }
        for a in &self.local_acts {
            *a.lock().unwrap_or_else(|e| e.into_inner()) = LocalActs::default();
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn run_inner(
        &self,
        pool: &WorkerPool,
        isa: Isa,
        x: &[f32],
        hidden: usize,
        jobs: &[ExpertJob<'_>],
        extra: Option<ExtraJobs<'_>>,
        bias13: Option<&[&[f32]]>,
        out: &mut [f32],
    ) {
        let t_call = self.trace.as_ref().map_or(0, Trace::now);
        let (l13, l2) = (&self.w13_layout, &self.w2_layout);
        assert_eq!(l13.k, hidden, "x width {hidden} differs from the experts' hidden size {}", l13.k);
        assert_eq!(l2.rows, hidden);
        let mut lay = self.own_layouts();
        let all: Vec<ExpertJob<'_>>;
        let jobs = match extra {
            Some(ex) if !ex.jobs.is_empty() => {
                assert!(
                    ex.w13_layout.k == hidden
                        && ex.w2_layout.rows == hidden
                        && ex.w2_layout.k == ex.w13_layout.rows / 2,
                    "extra jobs' layouts {:?} / {:?} do not fit hidden size {hidden}",
                    ex.w13_layout,
                    ex.w2_layout
                );
                lay.extra = ex.jobs.len();
                lay.extra_layouts = (ex.w13_layout, ex.w2_layout);
                // First: a large extra job's last tasks would otherwise end the dispatch alone.
                all = ex.jobs.iter().chain(jobs).copied().collect();
                &all[..]
            }
            _ => jobs,
        };
        let inter_of = |e: usize| lay.of(e).0.rows / 2;
        let split = split_factor();
        let mut guard = self.step.lock().unwrap_or_else(|e| e.into_inner());
        let step = &mut *guard;
        let n = jobs.len();
        step.mid.resize_with(n, Vec::new);
        step.mid_acts.resize_with(n, QuantizedActs::new);
        step.y.resize_with(n, Vec::new);
        let major = self.w2_mode == W2Mode::GroupMajor;
        if major {
            step.part.resize_with(n, Vec::new);
        }
        for job in jobs {
            for &(tok, _) in job.tokens {
                assert!(
                    (tok + 1) * hidden <= x.len() && (tok + 1) * hidden <= out.len(),
                    "token {tok} is outside x ({} floats of width {hidden}) or out ({} floats)",
                    x.len(),
                    out.len()
                );
            }
        }
        let per_expert = jobs.iter().map(|j| j.tokens.len()).sum::<usize>() / n.max(1);
        // The BF16 tiles dequantise INT4/INT8 records, symmetric or asymmetric, and FP4 ones,
        // and take the activation and biases as options: K-quant layouts keep their integer
        // kernels.
        let bf16_fits = (0..n)
            .all(|e| inter_of(e).is_multiple_of(32) && lay.of(e).0.has_bf16_panel() && lay.of(e).1.has_bf16_panel());
        if let Some(tiles) = prefill_bf16::applies(isa, per_expert, hidden).filter(|_| bf16_fits) {
            drop(guard);
            // One set of layouts per BF16 dispatch: the extra jobs, then the runner's.
            let (first, rest) = jobs.split_at(lay.extra);
            if !first.is_empty() {
                let (l13x, l2x) = lay.extra_layouts;
                prefill_bf16::run_experts(tiles, pool, l13x, l2x, x, hidden, first, prefill_bf16::ExpertAct::SILU, out);
            }
            let act = prefill_bf16::ExpertAct { activation: self.activation, bias13 };
            prefill_bf16::run_experts(tiles, pool, l13, l2, x, hidden, rest, act, out);
            return;
        }
        // Activations: one set per distinct token list (in decode every expert of the token
        // shares one), quantised inside the dispatch.
        step.acts_of.clear();
        step.act_src.clear();
        for (e, job) in jobs.iter().enumerate() {
            let (l13e, l2e) = lay.of(e);
            // A set is shared by jobs of one token list whose w13 groups the hidden size alike.
            let same = (0..e).find(|&j| {
                jobs[j].tokens.len() == job.tokens.len()
                    && lay.of(j).0.gs == l13e.gs
                    && jobs[j].tokens.iter().zip(job.tokens).all(|(a, b)| a.0 == b.0)
            });
            if let Some(j) = same {
                step.acts_of.push(step.acts_of[j]);
            } else {
                let a = step.act_src.len();
                step.acts_of.push(a);
                step.act_src.push(e);
                if step.acts.len() <= a {
                    step.acts.push(QuantizedActs::new());
                }
                shape_acts(&mut step.acts[a], split * job.tokens.len(), hidden, l13e.gs);
            }
            let m = job.tokens.len();
            step.mid[e].resize(m * inter_of(e), 0.0);
            shape_acts(&mut step.mid_acts[e], split * m, inter_of(e), l2e.gs);
            step.y[e].resize(m * hidden, 0.0);
            if major {
                step.part[e].resize(split * m * l2.row_blocks() * ROW_BLOCK, 0.0);
            }
        }
        let counters = lay.group_base(n);
        step.cols_done.resize_with(counters, AtomicUsize::default);
        step.cols_done.iter().for_each(|c| c.store(0, Ordering::Relaxed));
        step.group_ok.resize_with(counters, AtomicUsize::default);
        step.group_ok.iter().for_each(|c| c.store(0, Ordering::Relaxed));
        let sets = step.act_src.len();
        step.x_ready.resize_with(sets, AtomicUsize::default);
        step.x_ready.iter().for_each(|c| c.store(0, Ordering::Relaxed));
        step.xbufs.clear();
        step.local_x.clear();
        for a in 0..sets {
            step.xbufs.push(ActBufs::of(&mut step.acts[a]));
            step.local_x.push(self.quantises_locally(n, jobs[step.act_src[a]].tokens.len()));
        }
        step.serial = step.serial.wrapping_add(1);
        self.plan_if_changed(step, jobs, &lay, pool);
        step.out_turn.resize_with(l2.row_blocks(), AtomicUsize::default);
        step.out_turn.iter().for_each(|c| c.store(0, Ordering::Relaxed));
        if major {
            step.part_turn.resize_with(n * l2.row_blocks(), AtomicUsize::default);
            step.part_turn.iter().for_each(|c| c.store(0, Ordering::Relaxed));
        }

        step.bufs.clear();
        step.ys.clear();
        step.parts.clear();
        for e in 0..n {
            step.bufs.push(JobBufs { mid: step.mid[e].as_mut_ptr(), acts: ActBufs::of(&mut step.mid_acts[e]) });
            step.ys.push(OutPtr(step.y[e].as_mut_ptr()));
            if major {
                step.parts.push(OutPtr(step.part[e].as_mut_ptr()));
            }
        }
        let failed = AtomicBool::new(false);
        let (tasks, acts, acts_of) = (&step.tasks, &step.acts, &step.acts_of);
        let (cols_done, group_ok, bufs, ys) = (&step.cols_done, &step.group_ok, &step.bufs, &step.ys);
        let w2_by_groups = self.w2_mode != W2Mode::Whole;
        let (parts, part_turn, nb2) = (&step.parts, &step.part_turn, l2.row_blocks());
        let (act_src, x_ready, xbufs) = (&step.act_src, &step.x_ready, &step.xbufs);
        let (local_x, serial) = (&step.local_x, step.serial);
        let (out_turn, fused) = (&step.out_turn, self.fused_sum);
        let out_ptr = OutPtr(out.as_mut_ptr());
        let trace = self.trace.as_ref();
        let d_index = trace.map_or(0, Trace::next_dispatch);
        let t_dispatch = trace.map_or(0, Trace::now);
        let body = |node: usize, t: usize, ctx: &crate::pool::WorkerCtx| {
            let _flag = FailOnUnwind(&failed);
            let task = tasks[node][t];
            let start = trace.map_or(0, Trace::now);
            // (ready, computed) moments for the trace; 0 = as the task's start / end.
            let (mut ready, mut computed) = (0u64, 0u64);
            match task {
                Task::X { a, g0, g1 } => {
                    let toks = jobs[act_src[a]].tokens;
                    let gs = lay.of(act_src[a]).0.gs;
                    for g in g0..g1 {
                        // SAFETY: tokens are inside x (checked above); group g of set a's rows
                        // is written only by this task, and read by w13 tasks only after the
                        // release below.
                        unsafe {
                            quantize_rows_group(
                                |i| x[toks[i].0 * hidden..].as_ptr(),
                                toks.len(),
                                xbufs[a],
                                hidden,
                                gs,
                                g,
                                split,
                            )
                        };
                    }
                    x_ready[a].fetch_add(g1 - g0, Ordering::Release);
                }
                Task::W13 { e, p0, p1 } => {
                    let w13 = jobs[e].weights.w13;
                    let (l13, l2) = lay.of(e);
                    let (ng13, inter, gs2) = (l13.groups(), l13.rows / 2, l2.gs);
                    let upcoming = task.weights(jobs, &lay);
                    let upcoming = &upcoming[..upcoming.len().min(X_WAIT_PREFETCH)];
                    let set = acts_of[e];
                    let mut local =
                        local_x[set].then(|| self.local_acts[ctx.worker].lock().unwrap_or_else(|e| e.into_inner()));
                    let a: &QuantizedActs = match local.as_deref_mut() {
                        Some(la) => {
                            if la.key != Some((serial, set)) {
                                prefetch_l2(&upcoming[..upcoming.len().min(LOCAL_X_PREFETCH)]);
                                let toks = jobs[act_src[set]].tokens;
                                shape_acts(&mut la.acts, split * toks.len(), hidden, l13.gs);
                                la.key = None;
                                let dst = ActBufs::of(&mut la.acts);
                                for g in 0..ng13 {
                                    // SAFETY: tokens are inside x (checked above); `dst` is this
                                    // worker's own buffer, shaped for these rows just above.
                                    unsafe {
                                        quantize_rows_group(
                                            |i| x[toks[i].0 * hidden..].as_ptr(),
                                            toks.len(),
                                            dst,
                                            hidden,
                                            l13.gs,
                                            g,
                                            split,
                                        )
                                    };
                                }
                                la.key = Some((serial, set));
                            }
                            &la.acts
                        }
                        None => {
                            wait_ready(&x_ready[set], ng13, &failed, upcoming);
                            &acts[set]
                        }
                    };
                    ready = trace.map_or(0, Trace::now);
                    let m = a.m / split;
                    let cols13 = (p1 - p0) * 2 * ROW_BLOCK;
                    let cols = (p1 - p0) * ROW_BLOCK;
                    let b = bufs[e];
                    self.scratch.with(ctx.worker, split * m * cols13 + m * cols, |tmp| {
                        let (h13, act) = tmp.split_at_mut(split * m * cols13);
                        matmul_packed(isa, w13, l13, a, 2 * p0..2 * p1, h13);
                        sum_split_rows(h13, m, cols13);
                        // Extra jobs (shared experts) are SiLU without biases.
                        let (activation, bias) = match e.checked_sub(lay.extra) {
                            Some(r) => (self.activation, bias13.map(|b| b[r])),
                            None => (ExpertActivation::Silu, None),
                        };
                        activate_w13(isa, activation, bias, p0, &h13[..m * cols13], m, act);
                        for i in 0..m {
                            // SAFETY: this task owns columns [16·p0, 16·p1) of job e's mid rows.
                            unsafe { OutPtr(b.mid).write(i * inter + p0 * ROW_BLOCK, &act[i * cols..(i + 1) * cols]) };
                        }
                    });
                    let (base, ng2) = (lay.group_base(e), l2.groups());
                    count_group_columns(&cols_done[base..base + ng2], p0 * ROW_BLOCK..p1 * ROW_BLOCK, gs2, |g| {
                        // SAFETY: all columns of group g are written (counted) and no task writes
                        // them again; group g of the quantised rows is written only here, and read
                        // by w2 tasks only after the release below.
                        unsafe { quantize_rows_group(|i| b.mid.add(i * inter), m, b.acts, inter, gs2, g, split) };
                        group_ok[base + g].store(1, Ordering::Release);
                    });
                }
                Task::W2 { e, b0, b1, g0: ga, g1: gb } => {
                    let w2 = jobs[e].weights.w2;
                    let l2 = lay.of(e).1;
                    let (bb, inter, gs2, ng2) = (l2.block_bytes(), l2.k, l2.gs, l2.groups());
                    let upcoming = task.weights(jobs, &lay);
                    let m = jobs[e].tokens.len();
                    let cols = (b1 - b0) * ROW_BLOCK;
                    let ok = &group_ok[lay.group_base(e)..lay.group_base(e) + ng2];
                    let run_groups = self.w2_run_k.div_ceil(gs2).max(1);
                    let mut own = self.w2_acts[ctx.worker].lock().unwrap_or_else(|e| e.into_inner());
                    shape_acts(&mut own, split * m, inter, gs2);
                    // Pull groups g..gb of this task's blocks (and, for a range after the first,
                    // the blocks' scale headers) into L2, so a wait still streams its weights.
                    let pull = |g: usize| {
                        for blk in b0..b1 {
                            let (at, end) = (blk * bb, ((blk + 1) * bb).min(w2.len()));
                            if ga > 0 && g == ga {
                                prefetch_l2(&w2[at.min(end)..(at + l2.weights_offset(0)).min(end)]);
                            }
                            prefetch_l2(
                                &w2[(at + l2.weights_offset(g)).min(end)..(at + l2.weights_offset(gb)).min(end)],
                            );
                        }
                    };
                    let mut body = |tmp: &mut [f32]| {
                        // Consume the intermediate's groups ga..gb as they are quantised, in K
                        // order: each kernel call continues the row blocks' sums over the next
                        // run of ready groups (or, in `W2Mode::Whole`, one call once all are).
                        let mut g0 = ga;
                        let mut pulled = false;
                        while g0 < gb {
                            if !pulled && w2_by_groups && ok[g0].load(Ordering::Acquire) == 0 {
                                // About to wait for the rest of the intermediate: pull the rest
                                // of this task's weights into L2 meanwhile, so they stream from
                                // L2 once the groups come.
                                pulled = true;
                                pull(g0);
                            }
                            let pf = if g0 == 0 && !w2_by_groups { upcoming } else { &[][..] };
                            wait_ready(&ok[g0], 1, &failed, pf);
                            let mut g1 = g0 + 1;
                            if w2_by_groups {
                                let least = g0.saturating_add(run_groups).min(gb);
                                for flag in &ok[g1.min(least)..least] {
                                    wait_ready(flag, 1, &failed, &[]);
                                }
                                g1 = g1.max(least);
                                while g1 < gb && ok[g1].load(Ordering::Acquire) != 0 {
                                    g1 += 1;
                                }
                            } else {
                                for flag in &ok[g1..gb] {
                                    wait_ready(flag, 1, &failed, &[]);
                                }
                                g1 = gb;
                            }
                            if g0 == ga {
                                ready = trace.map_or(0, Trace::now);
                            }
                            // SAFETY: groups g0..g1 of job e's quantised intermediate are
                            // complete (their flags, acquired above) and not written again in
                            // this call; `own` is this worker's buffer, shaped for these rows.
                            unsafe { copy_groups(bufs[e].acts, &mut own, g0..g1) };
                            matmul_packed_groups(isa, w2, l2, &own, b0..b1, g0..g1, tmp);
                            g0 = g1;
                        }
                        if gb < ng2 {
                            // A group range before the last: the next range's task goes on.
                            return;
                        }
                        sum_split_rows(tmp, m, cols);
                        let keep = cols.min(hidden - b0 * ROW_BLOCK);
                        if !fused {
                            for i in 0..m {
                                // SAFETY: this task owns columns [16·b0, 16·b0 + keep) of job e's y rows.
                                unsafe { ys[e].write(i * hidden + b0 * ROW_BLOCK, &tmp[i * cols..i * cols + keep]) };
                            }
                            return;
                        }
                        computed = trace.map_or(0, Trace::now);
                        // Jobs add into these columns of `out` in job order, block by block: the
                        // tasks of jobs < e over these blocks sit earlier in their nodes' lists
                        // (plan: w2 tasks in job order) and wait only on still earlier ones, so
                        // this wait ends.
                        let turns = &out_turn[b0..b1];
                        for turn in turns {
                            wait_ready(turn, e, &failed, &[]);
                        }
                        for (r, &(tok, w)) in jobs[e].tokens.iter().enumerate() {
                            // SAFETY: tok is inside out (checked above); columns [16·b0, 16·b0 +
                            // keep) of out are touched only by the tasks over these blocks, one
                            // job at a time (the turn counter orders them).
                            unsafe {
                                out_ptr.add_scaled(tok * hidden + b0 * ROW_BLOCK, w, &tmp[r * cols..r * cols + keep])
                            };
                        }
                        for turn in turns {
                            turn.store(e + 1, Ordering::Release);
                        }
                    };
                    if ga == 0 && gb == ng2 {
                        self.scratch.with(ctx.worker, split * m * cols, &mut body);
                    } else {
                        // Group-major: continue the partial sums the task over groups ..ga left
                        // for these blocks (it sits earlier in this node's list: plan lists the
                        // ranges in order, so this wait ends).
                        let turn = &part_turn[e * nb2 + b0];
                        if turn.load(Ordering::Acquire) < ga {
                            pull(ga);
                            wait_ready(turn, ga, &failed, &[]);
                        }
                        // SAFETY: part[e] holds split·m rows of 16·nb2 columns; block range
                        // b0..b1 owns the `split·m·cols` floats at `split·m·16·b0` (ranges
                        // partition 0..nb2), and of the tasks over it only this one runs now:
                        // the previous range's task has released the turn (acquired above), the
                        // next waits for this one's release below.
                        let tmp = unsafe {
                            std::slice::from_raw_parts_mut(parts[e].0.add(split * m * ROW_BLOCK * b0), split * m * cols)
                        };
                        body(tmp);
                        if gb < ng2 {
                            turn.store(gb, Ordering::Release);
                        }
                    }
                }
            }
            if let Some(tr) = trace {
                let end = tr.now();
                let (kind, job) = match task {
                    Task::X { a, .. } => (TaskKind::X, act_src[a]),
                    Task::W13 { e, .. } => (TaskKind::W13, e),
                    Task::W2 { e, .. } => (TaskKind::W2, e),
                };
                let ready = if ready == 0 { start } else { ready };
                let computed = if computed == 0 { end } else { computed };
                tr.task(TaskSpan {
                    dispatch: d_index,
                    worker: ctx.worker as u16,
                    kind,
                    job: job as u16,
                    start,
                    ready,
                    computed,
                    end,
                });
            }
        };
        if self.affine {
            pool.run_on_nodes_affine(&step.counts, &step.owned_from, &body);
        } else {
            pool.run_on_nodes(&step.counts, &body);
        }
        let t_back = trace.map_or(0, Trace::now);

        if !fused {
            // Weighted accumulate, in job order (deterministic).
            for (e, job) in jobs.iter().enumerate() {
                for (r, &(tok, w)) in job.tokens.iter().enumerate() {
                    let yr = &step.y[e][r * hidden..(r + 1) * hidden];
                    for (o, v) in out[tok * hidden..(tok + 1) * hidden].iter_mut().zip(yr) {
                        *o += w * v;
                    }
                }
            }
        }
        if let Some(tr) = trace {
            tr.dispatch(DispatchSpan {
                jobs: n as u16,
                call: t_call,
                dispatch: t_dispatch,
                back: t_back,
                done: tr.now(),
            });
        }
    }
}

/// Copy groups `groups` of every row of `src` (shaped as `dst`) into `dst`.
///
/// # Safety
/// `src` must hold `dst.m` rows of `dst.k` values (and their groups), and groups `groups` of them
/// must be complete, visible to this thread and written by no thread meanwhile.
unsafe fn copy_groups(src: ActBufs, dst: &mut QuantizedActs, groups: std::ops::Range<usize>) {
    let (k, gs, ng) = (dst.k, dst.gs, dst.groups());
    let (g0, g1) = (groups.start, groups.end);
    for r in 0..dst.m {
        let (q0, q1) = (r * k + g0 * gs, r * k + g1 * gs);
        std::ptr::copy_nonoverlapping(src.q.add(q0), dst.q[q0..q1].as_mut_ptr(), q1 - q0);
        let (s0, s1) = (r * ng + g0, r * ng + g1);
        std::ptr::copy_nonoverlapping(src.scales.add(s0), dst.scales[s0..s1].as_mut_ptr(), s1 - s0);
        std::ptr::copy_nonoverlapping(src.sums.add(s0), dst.sums[s0..s1].as_mut_ptr(), s1 - s0);
    }
}

/// Quantise group `g` of `m` rows of width `k` into `dst` (rows `split·i` and, when split,
/// `2i+1`), as [`quantize_acts_split`] / [`quantize_acts`] do; `row(i)` points at row `i`.
///
/// # Safety
/// `row(i)` must point at `k` readable floats whose group `g` is complete and visible to this
/// thread; `dst` must hold `split·m` rows of `k` (and their groups), and no other thread may
/// access group `g` of those rows meanwhile.
pub(crate) unsafe fn quantize_rows_group(
    row: impl Fn(usize) -> *const f32,
    m: usize,
    dst: ActBufs,
    k: usize,
    gs: usize,
    g: usize,
    split: usize,
) {
    let ng = k / gs;
    let mut resid = [0f32; MAX_GROUP_SIZE];
    for i in 0..m {
        let xg = std::slice::from_raw_parts(row(i).add(g * gs), gs);
        if split == 1 {
            let q = std::slice::from_raw_parts_mut(dst.q.add(i * k + g * gs), gs);
            let (s, sum) = quantize_group(xg, q);
            *dst.scales.add(i * ng + g) = s;
            *dst.sums.add(i * ng + g) = sum;
        } else {
            let hi = std::slice::from_raw_parts_mut(dst.q.add(2 * i * k + g * gs), gs);
            let lo = std::slice::from_raw_parts_mut(dst.q.add((2 * i + 1) * k + g * gs), gs);
            let [(s0, c0), (s1, c1)] = quantize_group_split(xg, hi, lo, &mut resid[..gs]);
            *dst.scales.add(2 * i * ng + g) = s0;
            *dst.sums.add(2 * i * ng + g) = c0;
            *dst.scales.add((2 * i + 1) * ng + g) = s1;
            *dst.sums.add((2 * i + 1) * ng + g) = c1;
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::activation::silu;
    use crate::pool::PoolPlan;
    use krasis_quant::cpu_layout::{pack, pack_w13};
    use krasis_quant::group::{dequantize, quantize};
    use krasis_quant::Bits;

    pub(crate) fn data(n: usize, seed: u64) -> Vec<f32> {
        krasis_quant::group::test_data(n, seed, 1.0)
    }

    struct Expert {
        w13: Vec<u8>,
        w2: Vec<u8>,
        l13: PackedLayout,
        l2: PackedLayout,
        /// Dequantised gate, up, down (f32 twins).
        f: [Vec<f32>; 3],
    }

    fn expert(h: usize, inter: usize, bits: Bits, seed: u64) -> Expert {
        expert_gs(h, inter, [bits, bits], seed, 32, 32)
    }

    /// An expert with w13 at `bits[0]` and w2 at `bits[1]` (a cache may mix them), group size
    /// `gs13` along the hidden size and `gs2` along the intermediate.
    fn expert_gs(h: usize, inter: usize, bits: [Bits; 2], seed: u64, gs13: usize, gs2: usize) -> Expert {
        let gate = quantize(&data(inter * h, seed), inter, h, bits[0], gs13);
        let up = quantize(&data(inter * h, seed + 1), inter, h, bits[0], gs13);
        let down = quantize(&data(h * inter, seed + 2), h, inter, bits[1], gs2);
        let (w13, l13) = pack_w13(&gate, &up).unwrap();
        let w2 = pack(&down);
        Expert { w13, w2, l2: PackedLayout::of(&down), l13, f: [dequantize(&gate), dequantize(&up), dequantize(&down)] }
    }

    fn matvec(w: &[f32], x: &[f32]) -> Vec<f32> {
        w.chunks_exact(x.len())
            .map(|r| r.iter().zip(x).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() as f32)
            .collect()
    }

    fn expert_f32(ex: &Expert, x: &[f32]) -> Vec<f32> {
        let g = matvec(&ex.f[0], x);
        let u = matvec(&ex.f[1], x);
        let a: Vec<f32> = g.iter().zip(&u).map(|(g, u)| silu(*g) * u).collect();
        matvec(&ex.f[2], &a)
    }

    pub(crate) fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
        let n: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
        let d: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
        (n / d).sqrt()
    }

    #[test]
    fn pool_experts_match_f32_on_dequantised_weights() {
        let (h, inter, t) = (96, 160, 5);
        let (i4, i8) = (Bits::Int4, Bits::Int8);
        // Mixed widths too: a GGUF-sourced cache has w13 INT4 and w2 INT8 (or the reverse).
        for bits in [[i4, i4], [i8, i8], [i4, i8], [i8, i4]] {
            let experts: Vec<Expert> = (0..3).map(|e| expert_gs(h, inter, bits, 10 + 7 * e as u64, 32, 32)).collect();
            let x = data(t * h, 99);
            let routes: Vec<Vec<(usize, f32)>> =
                vec![vec![(0, 0.5), (3, 0.25)], vec![(1, 1.0)], vec![(0, 0.3), (2, 0.7), (4, 1.5)]];
            let isa = crate::isa::active();
            let mut want = vec![0f32; t * h];
            for (e, toks) in routes.iter().enumerate() {
                for &(tok, w) in toks {
                    let y = expert_f32(&experts[e], &x[tok * h..(tok + 1) * h]);
                    for (a, b) in want[tok * h..(tok + 1) * h].iter_mut().zip(&y) {
                        *a += w * b;
                    }
                }
            }
            for plan in [PoolPlan::simulated(1, 2), PoolPlan::simulated(2, 2)] {
                let pool = WorkerPool::new(plan).unwrap();
                let runner = PoolExperts::new(&pool, experts[0].l13, experts[0].l2);
                let jobs: Vec<ExpertJob> = routes
                    .iter()
                    .enumerate()
                    .map(|(e, toks)| ExpertJob {
                        weights: ExpertWeights { w13: &experts[e].w13, w2: &experts[e].w2, node: e % pool.nodes() },
                        tokens: toks,
                    })
                    .collect();
                let mut first = Vec::new();
                for run in 0..2 {
                    let mut got = vec![0f32; t * h];
                    runner.run(&pool, isa, &x, h, &jobs, &mut got);
                    let e = rel_l2(&got, &want);
                    assert!(e < 1e-3, "{bits:?}, {} nodes: relative error {e:.2e}", pool.nodes());
                    if run == 0 {
                        first = got;
                    } else {
                        assert_eq!(got, first, "runs differ");
                    }
                }
            }
        }
    }

    /// The phase-by-phase composition [`PoolExperts::run`] must equal bit for bit: quantise
    /// each job's rows, w13, SiLU·up, quantise, w2, weighted sum in job order; one thread.
    fn phased_reference(isa: Isa, experts: &[&Expert], routes: &[Vec<(usize, f32)>], x: &[f32], h: usize) -> Vec<f32> {
        let t = x.len() / h;
        let mut out = vec![0f32; t * h];
        let (mut tmp, mut acts, mut mid_acts) = (Vec::new(), QuantizedActs::new(), QuantizedActs::new());
        for (ex, toks) in experts.iter().zip(routes) {
            let m = toks.len();
            let rows: Vec<f32> = toks.iter().flat_map(|&(tok, _)| x[tok * h..(tok + 1) * h].iter().copied()).collect();
            quantize_acts_split(&rows, m, h, ex.l13.gs, &mut tmp, &mut acts);
            let c13 = ex.l13.row_blocks() * ROW_BLOCK;
            let mut h13 = vec![f32::NAN; split_factor() * m * c13];
            matmul_packed(isa, &ex.w13, &ex.l13, &acts, 0..ex.l13.row_blocks(), &mut h13);
            sum_split_rows(&mut h13, m, c13);
            let inter = c13 / 2;
            let mut mid = vec![f32::NAN; m * inter];
            crate::quant::silu_mul_w13(isa, &h13[..m * c13], m, &mut mid);
            quantize_acts_split(&mid, m, inter, ex.l2.gs, &mut tmp, &mut mid_acts);
            let c2 = ex.l2.row_blocks() * ROW_BLOCK;
            let mut y = vec![f32::NAN; split_factor() * m * c2];
            matmul_packed(isa, &ex.w2, &ex.l2, &mid_acts, 0..ex.l2.row_blocks(), &mut y);
            sum_split_rows(&mut y, m, c2);
            for (r, &(tok, w)) in toks.iter().enumerate() {
                for (o, v) in out[tok * h..(tok + 1) * h].iter_mut().zip(&y[r * c2..r * c2 + h]) {
                    *o += w * v;
                }
            }
        }
        out
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 24, ..Default::default() })]

        /// One dispatch with in-task quantisation of the intermediate equals the phased
        /// composition bit for bit, for random shapes, group sizes whose groups straddle task
        /// boundaries, several tokens per expert, shared and distinct token lists, 1–2 nodes and
        /// 1–5 workers per node, 1–7 tasks per worker, even or guided task sizes, the weighted
        /// sum inside the dispatch or after it, activations quantised per worker (≤ 2 tokens;
        /// in every dispatch or in one-job ones only) or in shared tasks, w2 tasks consuming the
        /// intermediate whole, group by group (in kernel calls of at least 1, 48, 128 or all
        /// columns), or in group-major tasks (1–7 group ranges) continuing each other's
        /// partial sums; w13 and w2 each INT4 or INT8 (mixed widths);
        /// and 0–2 extra jobs of another layout ([`PoolExperts::run_with`]: another width,
        /// intermediate size and hidden group size) over every token, added before the rest.
        #[test]
        fn one_dispatch_equals_phased_composition(
            h32 in 1usize..5,
            inter16 in 1usize..13,
            gs13_log in 0u32..2,
            gs2_log in 0u32..2,
            n_experts in 1usize..5,
            t in 1usize..5,
            nodes in 1usize..3,
            per_node in 1usize..6,
            tpw in 1usize..8,
            tpw2 in 1usize..8,
            int8_13 in proptest::prelude::any::<bool>(),
            int8_2 in proptest::prelude::any::<bool>(),
            guided in proptest::prelude::any::<bool>(),
            fused in proptest::prelude::any::<bool>(),
            local_x in 0usize..3,
            w2_mode in 0usize..3,
            w2_run in 0usize..4,
            seed in 0u64..1000,
            n_extra in 0usize..3,
            inter_x16 in 1usize..13,
            gs13x_log in 0u32..2,
            int8_x in proptest::prelude::any::<bool>(),
        ) {
            let (gs13, gs2) = (32 << gs13_log, 32 << gs2_log);
            let gs13x = 32 << gs13x_log;
            let h = (h32 * 32).div_ceil(gs13.max(gs13x)) * gs13.max(gs13x);
            let inter = (inter16 * 16).div_ceil(gs2) * gs2;
            let width = |int8: bool| if int8 { Bits::Int8 } else { Bits::Int4 };
            let bits = [width(int8_13), width(int8_2)];
            let experts: Vec<Expert> =
                (0..n_experts).map(|e| expert_gs(h, inter, bits, seed * 31 + 5 * e as u64, gs13, gs2)).collect();
            let bx = if int8_x { Bits::Int8 } else { Bits::Int4 };
            let extras: Vec<Expert> =
                (0..n_extra).map(|e| expert_gs(h, 32 * inter_x16, [bx, bx], seed * 17 + e as u64, gs13x, 32)).collect();
            let x = data(t * h, seed + 7);
            // Expert e takes tokens e, e+1, … (mod t); every other expert also all tokens from 0,
            // so some token lists repeat and some differ.
            let mut routes: Vec<Vec<(usize, f32)>> = (0..n_experts)
                .map(|e| {
                    let len = 1 + (e + seed as usize) % t;
                    let start = if e % 2 == 0 { 0 } else { e % t };
                    (0..len).map(|j| ((start + j) % t, 0.25 + 0.5 * j as f32)).collect()
                })
                .collect();
            // The extra jobs, first: every token at weight 1 (a shared expert).
            let mut all_routes: Vec<Vec<(usize, f32)>> = (0..n_extra).map(|_| (0..t).map(|i| (i, 1.0)).collect()).collect();
            all_routes.append(&mut routes);
            let routes = all_routes;
            let isa = crate::isa::active();
            let refs: Vec<&Expert> = extras.iter().chain(&experts).collect();
            let want = phased_reference(isa, &refs, &routes, &x, h);
            let pool = WorkerPool::new(PoolPlan::simulated(nodes, per_node)).unwrap();
            let runner = PoolExperts::new(&pool, experts[0].l13, experts[0].l2)
                .with_tasks_per_worker(tpw)
                .with_w2_tasks_per_worker(tpw2)
                .with_guided_tasks(guided)
                .with_fused_sum(fused)
                .with_local_x_rows(if local_x > 0 { LOCAL_X_MAX_ROWS } else { 0 })
                .with_local_x_max_jobs(if local_x == 2 { 1 } else { usize::MAX })
                .with_w2_mode([W2Mode::Whole, W2Mode::ByGroups, W2Mode::GroupMajor][w2_mode])
                .with_w2_run_k([1, 48, W2_RUN_MIN_K, usize::MAX][w2_run]);
            let jobs: Vec<ExpertJob> = routes
                .iter()
                .zip(&refs)
                .enumerate()
                .map(|(e, (toks, ex))| ExpertJob {
                    weights: ExpertWeights { w13: &ex.w13, w2: &ex.w2, node: e % nodes },
                    tokens: toks,
                })
                .collect();
            let (first, main) = jobs.split_at(n_extra);
            let extra = extras.first().map(|ex| ExtraJobs { w13_layout: &ex.l13, w2_layout: &ex.l2, jobs: first });
            for _ in 0..2 {
                let mut got = vec![0f32; t * h];
                runner.run_with(&pool, isa, &x, h, main, extra, &mut got);
                let same = got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                proptest::prop_assert!(same, "differs from the phased composition");
            }
        }
    }

    /// The activation and bias options (gpt-oss's experts): the gate and up biases added before
    /// the clamped SwiGLU, on 1 and 2 nodes and INT4 / INT8, against f32 math on the dequantised
    /// weights; the clamp is hit (limit 1) and the biases change the result.
    #[test]
    fn biased_clamped_swiglu_matches_f32_on_dequantised_weights() {
        let (h, inter, t) = (64, 96, 4);
        let act = ExpertActivation::ClampedSwiglu { alpha: 1.702, limit: 1.0 };
        for bits in [Bits::Int4, Bits::Int8] {
            let experts: Vec<Expert> = (0..3).map(|e| expert(h, inter, bits, 70 + 3 * e as u64)).collect();
            let biases: Vec<Vec<f32>> =
                (0..3).map(|e| data(2 * inter, 500 + e).iter().map(|v| 4.0 * v).collect()).collect();
            let x: Vec<f32> = data(t * h, 17).iter().map(|v| 3.0 * v).collect();
            let routes: Vec<Vec<(usize, f32)>> =
                vec![vec![(0, 0.5), (3, 0.25)], vec![(1, 1.0), (2, 0.5)], vec![(0, 0.3)]];
            let mut want = vec![0f32; t * h];
            let mut clamped = 0;
            for (e, toks) in routes.iter().enumerate() {
                for &(tok, w) in toks {
                    let xr = &x[tok * h..(tok + 1) * h];
                    let g = matvec(&experts[e].f[0], xr);
                    let u = matvec(&experts[e].f[1], xr);
                    let a: Vec<f32> = (0..inter)
                        .map(|j| {
                            let (g, u) = (g[j] + biases[e][j], u[j] + biases[e][inter + j]);
                            clamped += usize::from(g > 1.0 || u.abs() > 1.0);
                            act.apply(g, u)
                        })
                        .collect();
                    for (o, y) in want[tok * h..(tok + 1) * h].iter_mut().zip(matvec(&experts[e].f[2], &a)) {
                        *o += w * y;
                    }
                }
            }
            assert!(clamped > 0, "the clamp is not exercised");
            let isa = crate::isa::active();
            for plan in [PoolPlan::simulated(1, 2), PoolPlan::simulated(2, 2)] {
                let pool = WorkerPool::new(plan).unwrap();
                let runner = PoolExperts::new(&pool, experts[0].l13, experts[0].l2).with_activation(act);
                let jobs: Vec<ExpertJob> = routes
                    .iter()
                    .enumerate()
                    .map(|(e, toks)| ExpertJob {
                        weights: ExpertWeights { w13: &experts[e].w13, w2: &experts[e].w2, node: e % pool.nodes() },
                        tokens: toks,
                    })
                    .collect();
                let b: Vec<&[f32]> = biases.iter().map(|b| &b[..]).collect();
                let mut got = vec![0f32; t * h];
                runner.run_biased(&pool, isa, &x, h, &jobs, &b, &mut got);
                let e = rel_l2(&got, &want);
                assert!(e < 2e-2, "{bits:?}, {} nodes: relative error {e:.2e}", pool.nodes());
                let mut unbiased = vec![0f32; t * h];
                runner.run(&pool, isa, &x, h, &jobs, &mut unbiased);
                assert!(rel_l2(&unbiased, &want) > 10.0 * e, "the biases change nothing");
            }
        }
    }

    /// Calls whose job sets change shape (count, nodes, shared token lists) and then repeat get
    /// a fresh plan each time the shape changes and the cached one when it repeats; every call
    /// equals the phased composition.
    #[test]
    fn cached_plan_follows_changing_job_sets() {
        let (h, inter, t) = (64, 96, 3);
        let experts: Vec<Expert> = (0..4).map(|e| expert(h, inter, Bits::Int4, 40 + e as u64)).collect();
        let x = data(t * h, 5);
        let pool = WorkerPool::new(PoolPlan::simulated(2, 2)).unwrap();
        let runner = PoolExperts::new(&pool, experts[0].l13, experts[0].l2);
        let isa = crate::isa::active();
        let sets: [Vec<Vec<(usize, f32)>>; 3] = [
            vec![vec![(0, 0.5)], vec![(0, 0.25)], vec![(1, 1.0), (2, 0.5)]],
            vec![vec![(2, 1.5)]],
            vec![vec![(0, 0.5)], vec![(1, 0.25)], vec![(1, 1.0), (2, 0.5)]],
        ];
        for (round, s) in [0, 1, 0, 0, 2, 0, 1, 1].into_iter().enumerate() {
            let routes = &sets[s];
            let refs: Vec<&Expert> = (0..routes.len()).map(|e| &experts[e]).collect();
            let want = phased_reference(isa, &refs, routes, &x, h);
            let jobs: Vec<ExpertJob> = routes
                .iter()
                .enumerate()
                .map(|(e, toks)| ExpertJob {
                    weights: ExpertWeights { w13: &experts[e].w13, w2: &experts[e].w2, node: (e + s) % 2 },
                    tokens: toks,
                })
                .collect();
            let mut got = vec![0f32; t * h];
            runner.run(&pool, isa, &x, h, &jobs, &mut got);
            let same = got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "call {round} (set {s}) differs from the phased composition");
        }
    }

    /// A w13 task that panics (weights shorter than the layout) makes `run` panic instead of
    /// leaving the expert's w2 tasks waiting forever; the pool stays usable.
    #[test]
    fn failing_w13_task_panics_instead_of_hanging() {
        let (h, inter) = (64, 96);
        let ex = expert(h, inter, Bits::Int4, 3);
        let pool = WorkerPool::new(PoolPlan::simulated(1, 3)).unwrap();
        let runner = PoolExperts::new(&pool, ex.l13, ex.l2).with_tasks_per_worker(3);
        let x = data(h, 1);
        let toks = [(0usize, 1.0f32)];
        let bad = ExpertJob {
            weights: ExpertWeights { w13: &ex.w13[..ex.w13.len() / 2], w2: &ex.w2, node: 0 },
            tokens: &toks,
        };
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut out = vec![0f32; h];
            runner.run(&pool, crate::isa::active(), &x, h, &[bad], &mut out);
        }));
        assert!(r.is_err(), "a short w13 must make run panic");
        let good = ExpertJob { weights: ExpertWeights { w13: &ex.w13, w2: &ex.w2, node: 0 }, tokens: &toks };
        let mut out = vec![0f32; h];
        runner.run(&pool, crate::isa::active(), &x, h, &[good], &mut out);
        let want = expert_f32(&ex, &x);
        assert!(rel_l2(&out, &want) < 1e-3);
    }

    #[test]
    fn split_activations_are_near_exact() {
        let (m, k, gs) = (3, 256, 64);
        let x = data(m * k, 4);
        let (mut tmp, mut acts) = (Vec::new(), QuantizedActs::new());
        quantize_acts_split(&x, m, k, gs, &mut tmp, &mut acts);
        let d = acts.dequantize();
        let mut y: Vec<f32> = d.clone();
        sum_split_rows(&mut y, m, k);
        let e = rel_l2(&y[..m * k], &x);
        assert!(e < 1e-4, "split activation error {e:.2e}");
        let mut single = QuantizedActs::new();
        quantize_acts(&x, m, k, gs, &mut single);
        assert!(rel_l2(&single.dequantize(), &x) > 20.0 * e, "the residual row must matter");
        // Row 2i is exactly the plain quantisation of x_i; row 2i+1 that of the residual.
        let ng = k / gs;
        let resid: Vec<f32> = (0..m * k).map(|j| x[j] - single.q[j] as f32 * single.scales[j / gs]).collect();
        let mut lo = QuantizedActs::new();
        quantize_acts(&resid, m, k, gs, &mut lo);
        for i in 0..m {
            assert_eq!(&acts.q[2 * i * k..(2 * i + 1) * k], &single.q[i * k..(i + 1) * k]);
            assert_eq!(&acts.scales[2 * i * ng..(2 * i + 1) * ng], &single.scales[i * ng..(i + 1) * ng]);
            assert_eq!(&acts.sums[2 * i * ng..(2 * i + 1) * ng], &single.sums[i * ng..(i + 1) * ng]);
            assert_eq!(&acts.q[(2 * i + 1) * k..(2 * i + 2) * k], &lo.q[i * k..(i + 1) * k]);
            assert_eq!(&acts.scales[(2 * i + 1) * ng..(2 * i + 2) * ng], &lo.scales[i * ng..(i + 1) * ng]);
        }
    }

    /// Calls of more than [`KEEP_SCRATCH_MAX_ROWS`] rows leave no buffers behind (a long prompt
    /// used to leave its buffers in every matrix for the process's life, #38); shorter calls
    /// keep theirs for the next. Scalar kernels, so no ISA takes the BF16 prefill tiles instead.
    #[test]
    fn calls_longer_than_the_keep_limit_leave_no_scratch() {
        let (rows, k, h, inter) = (40, 64, 64, 32);
        let q = quantize(&data(rows * k, 5), rows, k, Bits::Int8, 32);
        let (w, l) = (pack(&q), PackedLayout::of(&q));
        let ex = expert(h, inter, Bits::Int4, 3);
        let pool = WorkerPool::new(PoolPlan::simulated(1, 2)).unwrap();
        let pm = PoolMatmul::new(&pool);
        let runner = PoolExperts::new(&pool, ex.l13, ex.l2);
        let keep = KEEP_SCRATCH_MAX_ROWS;
        for (m, kept) in [(1, true), (keep, true), (keep + 1, false), (2, true), (4 * keep, false)] {
            let x = data(m * k, 6);
            let mut y = vec![0f32; m * rows];
            pm.run(&pool, Isa::Scalar, &w, &l, &x, m, &mut y);
            assert_eq!(pm.scratch_bytes() > 0, kept, "PoolMatmul after {m} rows: {} bytes", pm.scratch_bytes());
            let toks: Vec<(usize, f32)> = (0..m).map(|t| (t, 1.0)).collect();
            let job = ExpertJob { weights: ExpertWeights { w13: &ex.w13, w2: &ex.w2, node: 0 }, tokens: &toks };
            let mut out = vec![0f32; m * h];
            runner.run(&pool, Isa::Scalar, &data(m * h, 7), h, &[job], &mut out);
            let held = runner.scratch_bytes();
            assert_eq!(held > 0, kept, "PoolExperts after {m} tokens: {held} bytes");
        }
    }

    #[test]
    fn pool_matmul_matches_f32_with_ragged_rows() {
        let (rows, k, m) = (53, 64, 3);
        let q = quantize(&data(rows * k, 5), rows, k, Bits::Int8, 32);
        let w = pack(&q);
        let l = PackedLayout::of(&q);
        let wf = dequantize(&q);
        let x = data(m * k, 6);
        let pool = WorkerPool::new(PoolPlan::simulated(1, 2)).unwrap();
        let mut y = vec![0f32; m * rows];
        PoolMatmul::new(&pool).run(&pool, crate::isa::active(), &w, &l, &x, m, &mut y);
        for i in 0..m {
            let want = matvec(&wf, &x[i * k..(i + 1) * k]);
            let e = rel_l2(&y[i * rows..(i + 1) * rows], &want);
            assert!(e < 1e-4, "row {i}: {e:.2e}");
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 16, ..Default::default() })]

        /// Matrices of one input in one dispatch give each exactly its own `run`'s numbers, for
        /// ragged row counts, 1–4 matrices, 1–5 workers and 1–3 tokens.
        #[test]
        fn run_many_equals_one_run_per_matrix(
            rows in proptest::collection::vec(1usize..70, 1..5),
            k32 in 1usize..4,
            m in 1usize..4,
            workers in 1usize..6,
        ) {
            let k = 32 * k32;
            let pool = WorkerPool::new(PoolPlan::simulated(1, workers)).unwrap();
            let mats: Vec<(Vec<u8>, PackedLayout)> = rows
                .iter()
                .enumerate()
                .map(|(j, &r)| {
                    let q = quantize(&data(r * k, 20 + j as u64), r, k, if j % 2 == 0 { Bits::Int8 } else { Bits::Int4 }, 32);
                    (pack(&q), PackedLayout::of(&q))
                })
                .collect();
            let x = data(m * k, 9);
            let pm = PoolMatmul::new(&pool);
            let mut many: Vec<Vec<f32>> = rows.iter().map(|&r| vec![f32::NAN; m * r]).collect();
            let refs: Vec<(&[u8], &PackedLayout)> = mats.iter().map(|(w, l)| (w.as_slice(), l)).collect();
            let mut outs: Vec<&mut [f32]> = many.iter_mut().map(|v| v.as_mut_slice()).collect();
            pm.run_many(&pool, crate::isa::active(), &refs, &x, m, &mut outs);
            let (mut acts, mut resid) = (QuantizedActs::new(), Vec::new());
            quantize_acts_split(&x, m, k, 32, &mut resid, &mut acts);
            for ((w, l), got) in mats.iter().zip(&many) {
                let mut want = vec![0f32; m * l.rows];
                pm.run(&pool, crate::isa::active(), w, l, &x, m, &mut want);
                proptest::prop_assert_eq!(got, &want);
                // The in-dispatch quantisation is the caller-side one: the same numbers as
                // quantising first and running the kernel over every block.
                let cols = l.row_blocks() * ROW_BLOCK;
                let mut serial = vec![0f32; split_factor() * m * cols];
                matmul_packed(crate::isa::Isa::Scalar, w, l, &acts, 0..l.row_blocks(), &mut serial);
                sum_split_rows(&mut serial, m, cols);
                for i in 0..m {
                    proptest::prop_assert_eq!(&got[i * l.rows..(i + 1) * l.rows], &serial[i * cols..i * cols + l.rows]);
                }
            }
        }
    }
}
