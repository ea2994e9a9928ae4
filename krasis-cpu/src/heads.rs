//! Per-head batched matmuls over the pool: `heads` packed matrices of one layout, each applied
//! to its own head's activation rows, in one dispatch. MLA's absorbed attention is two of them
//! per layer: `q_lat = W_UKᵀ · q_nope` and `o = W_UV · o_lat`, per head.
//!
//! Activations are quantised once per (head, token) as [`quantize_acts_split`] does (value +
//! residual INT8 rows), inside the dispatch: the first `heads` tasks quantise one head each, and
//! a matmul task waits for its head only. Head `h`'s output is bit for bit what
//! [`crate::moe::PoolMatmul`] gives for its matrix and rows alone. The row blocks of all heads
//! form one list, cut into about `MATMUL_TASKS_PER_WORKER` tasks per worker; a task may span
//! two heads.
//!
//! [`quantize_acts_split`]: crate::moe::quantize_acts_split

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

use crate::isa::Isa;
use crate::moe::{
    caller_quantises, quantize_rows_group, shape_acts, split_factor, sum_split_rows, units_per_task, wait_ready,
    ActBufs, FailOnUnwind, OutPtr, WorkerScratch, KEEP_SCRATCH_MAX_ROWS,
};
use crate::pool::WorkerPool;
use crate::quant::{matmul_packed, PackedLayout, QuantizedActs, ROW_BLOCK};

/// Bytes of its weights a matmul task pulls towards L2 while its head is being quantised.
const HEAD_WAIT_PREFETCH: usize = 16 << 10;

/// Where per-head rows live in a buffer: head `h` of token `i` starts at `i · token + h · head`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeadStrides {
    pub token: usize,
    pub head: usize,
}

/// Per-head quantised activations and their readiness (reused across calls).
#[derive(Default)]
struct Step {
    acts: Vec<QuantizedActs>,
    ready: Vec<AtomicUsize>,
}

/// `heads` packed matrices applied to per-head rows over the pool ([`HeadMatmul::run`]).
pub struct HeadMatmul {
    scratch: WorkerScratch,
    step: Mutex<Step>,
}

impl HeadMatmul {
    pub fn new(pool: &WorkerPool) -> Self {
        HeadMatmul { scratch: WorkerScratch::new(pool.threads()), step: Mutex::new(Step::default()) }
    }

    /// Bytes its reusable buffers hold between calls (kept only after calls of at most
    /// [`KEEP_SCRATCH_MAX_ROWS`] tokens).
    pub fn scratch_bytes(&self) -> usize {
        let step = self.step.lock().unwrap_or_else(|e| e.into_inner());
        self.scratch.bytes() + step.acts.iter().map(QuantizedActs::held_bytes).sum::<usize>()
    }

    /// For every head `h < heads` and token `i < m`:
    /// `y[i·ys.token + h·ys.head ..][..layout.rows] = W_h · x[i·xs.token + h·xs.head ..][..layout.k]`,
    /// where `W_h` is the packed matrix at `w[h · layout.bytes() ..]` (padding rows dropped).
    ///
    /// # Panics
    /// When `w`, `x` or `y` is too short for these shapes, or output rows could overlap
    /// (`ys.head < layout.rows` or `ys.token < heads · ys.head`).
    #[allow(clippy::too_many_arguments)]
    pub fn run(
        &self,
        pool: &WorkerPool,
        isa: Isa,
        w: &[u8],
        layout: &PackedLayout,
        heads: usize,
        x: &[f32],
        xs: HeadStrides,
        m: usize,
        y: &mut [f32],
        ys: HeadStrides,
    ) {
        let (rows, k, gs, hb) = (layout.rows, layout.k, layout.gs, layout.bytes());
        if m == 0 || heads == 0 {
            return;
        }
        assert!(w.len() >= heads * hb, "HeadMatmul: {} weight bytes for {heads} heads of {hb}", w.len());
        let last = |s: HeadStrides, width: usize| (m - 1) * s.token + (heads - 1) * s.head + width;
        assert!(last(xs, k) <= x.len(), "HeadMatmul: x holds {} floats, the strides need {}", x.len(), last(xs, k));
        assert!(
            last(ys, rows) <= y.len(),
            "HeadMatmul: y holds {} floats, the strides need {}",
            y.len(),
            last(ys, rows)
        );
        assert!(
            ys.head >= rows && (m == 1 || ys.token >= heads * ys.head),
            "HeadMatmul: output strides {ys:?} overlap rows of {rows} over {heads} heads"
        );
        let split = split_factor();
        let mut guard = self.step.lock().unwrap_or_else(|e| e.into_inner());
        let step = &mut *guard;
        step.acts.resize_with(heads, QuantizedActs::new);
        step.ready.resize_with(heads, || AtomicUsize::new(0));
        let dst: Vec<ActBufs> = step.acts[..heads]
            .iter_mut()
            .map(|a| {
                shape_acts(a, split * m, k, gs);
                ActBufs::of(a)
            })
            .collect();
        let (acts, ready) = (&step.acts[..heads], &step.ready[..heads]);
        ready.iter().for_each(|r| r.store(0, Ordering::Relaxed));
        let nb = layout.row_blocks();
        let total = heads * nb;
        let per = units_per_task(total, pool.threads());
        let out = OutPtr(y.as_mut_ptr());
        let failed = AtomicBool::new(false);
        let quantize = |h: usize| {
            for g in 0..k / gs {
                // SAFETY: rows of head h lie inside x (asserted); its buffers are written by this
                // call alone and read by matmul tasks only after the release below.
                unsafe {
                    quantize_rows_group(|i| x[i * xs.token + h * xs.head..].as_ptr(), m, dst[h], k, gs, g, split)
                };
            }
            ready[h].store(1, Ordering::Release);
        };
        // The first `nx` tasks quantise one head each (none: the caller already has).
        let nx = if caller_quantises() {
            (0..heads).for_each(quantize);
            0
        } else {
            heads
        };
        pool.run(nx + total.div_ceil(per), &|t, ctx| {
            let _guard = FailOnUnwind(&failed);
            if t < nx {
                return quantize(t);
            }
            let t = t - nx;
            let end = ((t + 1) * per).min(total);
            let mut u = t * per;
            while u < end {
                let (h, b0) = (u / nb, u % nb);
                let b1 = nb.min(b0 + end - u);
                let wh = &w[h * hb..(h + 1) * hb];
                let bb = layout.block_bytes();
                wait_ready(&ready[h], 1, &failed, &wh[b0 * bb..(b0 * bb + HEAD_WAIT_PREFETCH).min(b1 * bb)]);
                let cols = (b1 - b0) * ROW_BLOCK;
                self.scratch.with(ctx.worker, split * m * cols, |tmp| {
                    matmul_packed(isa, wh, layout, &acts[h], b0..b1, tmp);
                    sum_split_rows(tmp, m, cols);
                    let keep = cols.min(rows - b0 * ROW_BLOCK);
                    for i in 0..m {
                        // SAFETY: (token i, head h, rows 16·b0 .. +keep) is written by this task
                        // alone: the strides keep (i, h) rows disjoint (asserted above) and the
                        // tasks' block ranges are disjoint; bounds asserted above.
                        unsafe {
                            out.write(i * ys.token + h * ys.head + b0 * ROW_BLOCK, &tmp[i * cols..i * cols + keep])
                        };
                    }
                });
                u += b1 - b0;
            }
        });
        if m > KEEP_SCRATCH_MAX_ROWS {
            *guard = Step::default();
            self.scratch.release();
        }
    }
}

#[cfg(test)]
#[path = "heads_tests.rs"]
mod tests;
