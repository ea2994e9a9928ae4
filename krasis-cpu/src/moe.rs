//! Quantised matmuls and routed experts spread over the pinned [`WorkerPool`]: work is split
//! inside each matrix (by row blocks) and across experts, and each expert's tasks run on the
//! workers of the NUMA node that holds its weights.
//!
//! One decode step of a MoE layer is two dispatches: all experts' w13 row-block pairs (each task
//! applies SiLU(gate)·up to its own pairs), then all experts' w2 row blocks. Between them the
//! caller thread quantises each expert's intermediate activation once.
//!
//! Activations enter the integer kernels as two INT8 rows per token ([`quantize_acts_split`]):
//! the INT8 quantisation and its INT8-quantised residual. Their outputs add up to the product with
//! a ~15-bit activation, so the only rounding left is the weights' own — INT8 activations alone
//! doubled the error of a weight-only quantisation on the oracle fixtures. The kernels apply each
//! weight chunk to both rows while it is in registers, so the weight stream (the decode bound) is
//! unchanged; the integer work doubles.

use std::sync::Mutex;

use crate::isa::Isa;
use crate::pool::WorkerPool;
use crate::quant::{
    matmul_packed, quantize_acts, quantize_group, silu_mul_w13, PackedLayout, QuantizedActs, ROW_BLOCK,
};

/// Tasks per worker a dispatch aims for: fewer leaves workers idle in the last round (one V2-Lite
/// expert's w13 in 4-pair tasks kept 16 workers only 69 % busy, measured), more pays the atomic
/// claim per task for nothing.
const TASKS_PER_WORKER: usize = 4;

/// [`TASKS_PER_WORKER`], or `KRASIS_TASKS_PER_WORKER` (read once; a tuning knob).
fn tasks_per_worker() -> usize {
    static T: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *T.get_or_init(|| {
        std::env::var("KRASIS_TASKS_PER_WORKER")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|&t| t > 0)
            .unwrap_or(TASKS_PER_WORKER)
    })
}

/// Units (row blocks or block pairs) per task for `total` units over `workers`.
fn units_per_task(total: usize, workers: usize) -> usize {
    total.div_ceil(tasks_per_worker() * workers.max(1)).max(1)
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
    out.m = 2 * m;
    out.k = k;
    out.gs = gs;
    out.q.resize(2 * m * k, 0);
    out.scales.resize(2 * m * ng, 0.0);
    out.sums.resize(2 * m * ng, 0);
    resid.resize(gs, 0.0);
    for i in 0..m {
        let (hi_q, lo_q) = out.q[2 * i * k..(2 * i + 2) * k].split_at_mut(k);
        for g in 0..ng {
            let xg = &x[i * k + g * gs..i * k + (g + 1) * gs];
            let qg = &mut hi_q[g * gs..(g + 1) * gs];
            let (s, sum) = quantize_group(xg, qg);
            out.scales[2 * i * ng + g] = s;
            out.sums[2 * i * ng + g] = sum;
            for ((r, &v), &q) in resid.iter_mut().zip(xg).zip(qg.iter()) {
                *r = v - q as f32 * s;
            }
            let (s, sum) = quantize_group(resid, &mut lo_q[g * gs..(g + 1) * gs]);
            out.scales[(2 * i + 1) * ng + g] = s;
            out.sums[(2 * i + 1) * ng + g] = sum;
        }
    }
}

/// INT8 rows per token: 2 (value + residual, the default) or 1 with `KRASIS_ACT_SPLIT=0`, which
/// trades accuracy for half the integer work (for measuring what the residual costs).
pub fn split_factor() -> usize {
    static S: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *S.get_or_init(|| if std::env::var("KRASIS_ACT_SPLIT").is_ok_and(|v| v == "0") { 1 } else { 2 })
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
struct OutPtr(*mut f32);
// SAFETY: every task writes a disjoint set of elements (argued at each use).
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// # Safety
    /// `at..at+src.len()` must be in bounds and written by no other task.
    unsafe fn write(self, at: usize, src: &[f32]) {
        std::ptr::copy_nonoverlapping(src.as_ptr(), self.0.add(at), src.len());
    }
}

/// Per-worker scratch buffers, each touched only by its worker.
struct WorkerScratch(Vec<Mutex<Vec<f32>>>);

impl WorkerScratch {
    fn new(workers: usize) -> Self {
        WorkerScratch((0..workers).map(|_| Mutex::new(Vec::new())).collect())
    }

    fn with<R>(&self, worker: usize, len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
        let mut v = self.0[worker].lock().unwrap_or_else(|e| e.into_inner());
        if v.len() < len {
            v.resize(len, 0.0);
        }
        f(&mut v[..len])
    }
}

/// A packed matrix computed over the pool: `y[m, rows] = x · Wᵀ` (padding rows dropped).
pub struct PoolMatmul {
    scratch: WorkerScratch,
    acts: Mutex<(QuantizedActs, Vec<f32>)>,
}

impl PoolMatmul {
    pub fn new(pool: &WorkerPool) -> Self {
        PoolMatmul { scratch: WorkerScratch::new(pool.threads()), acts: Mutex::new((QuantizedActs::new(), Vec::new())) }
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
        let rows = layout.rows;
        assert_eq!(y.len(), m * rows, "PoolMatmul: y must be m×rows = {m}×{rows}");
        let mut guard = self.acts.lock().unwrap_or_else(|e| e.into_inner());
        let (acts, tmp) = &mut *guard;
        quantize_acts_split(x, m, layout.k, layout.gs, tmp, acts);
        let acts = &*acts;
        let nb = layout.row_blocks();
        let per = units_per_task(nb, pool.threads());
        let tasks = nb.div_ceil(per);
        let out = OutPtr(y.as_mut_ptr());
        pool.run(tasks, &|t, ctx| {
            let b0 = t * per;
            let b1 = (b0 + per).min(nb);
            let cols = (b1 - b0) * ROW_BLOCK;
            self.scratch.with(ctx.worker, split_factor() * m * cols, |tmp| {
                matmul_packed(isa, w, layout, acts, b0..b1, tmp);
                sum_split_rows(tmp, m, cols);
                let keep = cols.min(rows - b0 * ROW_BLOCK);
                for i in 0..m {
                    // SAFETY: task t owns columns [16·b0, 16·b0 + keep) of every row of y.
                    unsafe { out.write(i * rows + b0 * ROW_BLOCK, &tmp[i * cols..i * cols + keep]) };
                }
            })
        });
    }
}

/// One routed expert's packed weights and the NUMA node (pool node index) that holds them.
#[derive(Clone, Copy)]
pub struct ExpertWeights<'a> {
    pub w13: &'a [u8],
    pub w2: &'a [u8],
    pub node: usize,
}

/// Reusable buffers of [`PoolExperts::run`] (grow once, then no allocation per step).
#[derive(Default)]
struct StepScratch {
    acts: Vec<QuantizedActs>,
    mid: Vec<Vec<f32>>,
    mid_acts: Vec<QuantizedActs>,
    y: Vec<Vec<f32>>,
    rows: Vec<f32>,
    /// One group's residual for [`quantize_acts_split`].
    split_tmp: Vec<f32>,
    /// Per node: (expert slot, first unit, end unit) task list.
    tasks: Vec<Vec<(usize, usize, usize)>>,
    counts: Vec<usize>,
}

/// Runs the routed experts of one layer over the pool.
pub struct PoolExperts {
    w13_layout: PackedLayout,
    w2_layout: PackedLayout,
    scratch: WorkerScratch,
    step: Mutex<StepScratch>,
}

/// The work of one expert in a step: its weights, its tokens' rows of `x` and their weights.
pub struct ExpertJob<'a> {
    pub weights: ExpertWeights<'a>,
    /// `(token, routing weight)`.
    pub tokens: &'a [(usize, f32)],
}

impl PoolExperts {
    pub fn new(pool: &WorkerPool, w13_layout: PackedLayout, w2_layout: PackedLayout) -> Self {
        assert!(w13_layout.rows.is_multiple_of(2 * ROW_BLOCK), "w13 must be a fused gate+up layout");
        assert_eq!(w2_layout.k, w13_layout.rows / 2, "w2 K must equal the intermediate size");
        PoolExperts {
            w13_layout,
            w2_layout,
            scratch: WorkerScratch::new(pool.threads()),
            step: Mutex::new(StepScratch::default()),
        }
    }

    pub fn w13_layout(&self) -> &PackedLayout {
        &self.w13_layout
    }

    pub fn w2_layout(&self) -> &PackedLayout {
        &self.w2_layout
    }

    fn plan(step: &mut StepScratch, jobs: &[ExpertJob<'_>], units: usize, per_task: usize, nodes: usize) {
        step.tasks.resize_with(nodes, Vec::new);
        step.tasks.iter_mut().for_each(Vec::clear);
        for (e, job) in jobs.iter().enumerate() {
            let node = job.weights.node.min(nodes - 1);
            let mut u = 0;
            while u < units {
                step.tasks[node].push((e, u, (u + per_task).min(units)));
                u += per_task;
            }
        }
        step.counts.clear();
        step.counts.extend(step.tasks.iter().map(Vec::len));
    }

    /// `out[t, hidden] += Σ_jobs w · expert(x[t])` for each job's tokens. `x` is `[t, hidden]`.
    pub fn run(&self, pool: &WorkerPool, isa: Isa, x: &[f32], hidden: usize, jobs: &[ExpertJob<'_>], out: &mut [f32]) {
        let (l13, l2) = (&self.w13_layout, &self.w2_layout);
        assert_eq!(l13.k, hidden, "x width {hidden} differs from the experts' hidden size {}", l13.k);
        assert_eq!(l2.rows, hidden);
        let inter = l13.rows / 2;
        let mut guard = self.step.lock().unwrap_or_else(|e| e.into_inner());
        let step = &mut *guard;
        let n = jobs.len();
        step.acts.resize_with(n, QuantizedActs::new);
        step.mid.resize_with(n, Vec::new);
        step.mid_acts.resize_with(n, QuantizedActs::new);
        step.y.resize_with(n, Vec::new);
        // Activations: each token's row quantised for every expert it routes to (shared weights
        // of one token cost one small copy, not a second quantisation pass over the weights).
        for (e, job) in jobs.iter().enumerate() {
            step.rows.clear();
            for &(tok, _) in job.tokens {
                step.rows.extend_from_slice(&x[tok * hidden..(tok + 1) * hidden]);
            }
            quantize_acts_split(&step.rows, job.tokens.len(), hidden, l13.gs, &mut step.split_tmp, &mut step.acts[e]);
            step.mid[e].resize(job.tokens.len() * inter, 0.0);
            step.y[e].resize(job.tokens.len() * hidden, 0.0);
        }

        // Phase 1: w13 pairs → silu(gate)·up into mid[e] columns.
        let pairs = l13.row_blocks() / 2;
        Self::plan(step, jobs, pairs, units_per_task(pairs * n, pool.threads()), pool.nodes());
        {
            let mids: Vec<OutPtr> = step.mid.iter_mut().map(|v| OutPtr(v.as_mut_ptr())).collect();
            let (tasks, acts) = (&step.tasks, &step.acts);
            pool.run_on_nodes(&step.counts, &|node, t, ctx| {
                let (e, p0, p1) = tasks[node][t];
                let m = acts[e].m / split_factor();
                let cols13 = (p1 - p0) * 2 * ROW_BLOCK;
                let cols = (p1 - p0) * ROW_BLOCK;
                self.scratch.with(ctx.worker, split_factor() * m * cols13 + m * cols, |tmp| {
                    let (h13, act) = tmp.split_at_mut(split_factor() * m * cols13);
                    matmul_packed(isa, jobs[e].weights.w13, l13, &acts[e], 2 * p0..2 * p1, h13);
                    sum_split_rows(h13, m, cols13);
                    silu_mul_w13(&h13[..m * cols13], m, act);
                    for i in 0..m {
                        // SAFETY: this task owns columns [16·p0, 16·p1) of expert e's mid rows.
                        unsafe { mids[e].write(i * inter + p0 * ROW_BLOCK, &act[i * cols..(i + 1) * cols]) };
                    }
                })
            });
        }
        for (e, job) in jobs.iter().enumerate() {
            let m = job.tokens.len();
            quantize_acts_split(&step.mid[e], m, inter, l2.gs, &mut step.split_tmp, &mut step.mid_acts[e]);
        }

        // Phase 2: w2 row blocks → y[e].
        let nb2 = l2.row_blocks();
        Self::plan(step, jobs, nb2, units_per_task(nb2 * n, pool.threads()), pool.nodes());
        {
            let ys: Vec<OutPtr> = step.y.iter_mut().map(|v| OutPtr(v.as_mut_ptr())).collect();
            let (tasks, acts) = (&step.tasks, &step.mid_acts);
            pool.run_on_nodes(&step.counts, &|node, t, ctx| {
                let (e, b0, b1) = tasks[node][t];
                let m = acts[e].m / split_factor();
                let cols = (b1 - b0) * ROW_BLOCK;
                self.scratch.with(ctx.worker, split_factor() * m * cols, |tmp| {
                    matmul_packed(isa, jobs[e].weights.w2, l2, &acts[e], b0..b1, tmp);
                    sum_split_rows(tmp, m, cols);
                    let keep = cols.min(hidden - b0 * ROW_BLOCK);
                    for i in 0..m {
                        // SAFETY: this task owns columns [16·b0, 16·b0 + keep) of expert e's y rows.
                        unsafe { ys[e].write(i * hidden + b0 * ROW_BLOCK, &tmp[i * cols..i * cols + keep]) };
                    }
                })
            });
        }

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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::activation::silu;
    use crate::pool::PoolPlan;
    use krasis_quant::cpu_layout::{pack, pack_w13};
    use krasis_quant::group::{dequantize, quantize};
    use krasis_quant::Bits;

    fn data(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
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
        let gate = quantize(&data(inter * h, seed), inter, h, bits, 32);
        let up = quantize(&data(inter * h, seed + 1), inter, h, bits, 32);
        let down = quantize(&data(h * inter, seed + 2), h, inter, bits, 32);
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

    fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
        let n: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
        let d: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
        (n / d).sqrt()
    }

    #[test]
    fn pool_experts_match_f32_on_dequantised_weights() {
        let (h, inter, t) = (96, 160, 5);
        for bits in [Bits::Int4, Bits::Int8] {
            let experts: Vec<Expert> = (0..3).map(|e| expert(h, inter, bits, 10 + 7 * e as u64)).collect();
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
}
