//! Absorbed MLA attention of one query token in one pool dispatch: the `W_UK` absorption of the
//! query, the attention over the latent cache and `W_UV`, which decode otherwise runs as four
//! dispatches per layer (absorb, the position-split partials, their combine, `W_UV`), each
//! ending in a barrier whose tail and restart cost more than the ~1 MB of weights each reads.
//!
//! Three kinds of task, listed in dependency order (the pool claims tasks in index order, so
//! every wait is for a task that is already running or done):
//! 1. one per head: quantise its `q_nope`, `q_lat = W_UK,hᵀ · q_nope` over all row blocks, the
//!    rope part copied beside it; counts the head done for its sub-group;
//! 2. one per (sub-group, chunk of positions) of [`crate::attention`]'s split: waits for its
//!    sub-group's heads, then writes its flash-decoding partials;
//! 3. one per head: waits for its sub-group's chunks, combines them into `o_lat`, quantises it
//!    and applies `W_UV,h`.
//!
//! Every number is computed as the separate dispatches compute it (the same quantisation, the
//! same kernels over the same row blocks and position chunks, the same combine), so the result
//! is theirs bit for bit; the tests check that against [`crate::heads::HeadMatmul`] and
//! [`crate::attention::causal_attention`]'s split.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

use krasis_core::spec::MlaDims;

use crate::attention::{shared_kv_combine, shared_kv_part_len, shared_kv_partial, shared_kv_plan, KvCacheView};
use crate::isa::Isa;
use crate::moe::{quantize_rows_group, shape_acts, split_factor, sum_split_rows, wait_ready, ActBufs, FailOnUnwind};
use crate::pool::WorkerPool;
use crate::quant::{matmul_packed, PackedLayout, QuantizedActs, ROW_BLOCK};

/// `kv_b` packed per head: every head's `W_UKᵀ` (`[latent, K]`, K = nope padded with zero
/// columns to the layout's K) back to back, and every head's `W_UV` (`[v_dim, latent]`).
#[derive(Clone, Copy)]
pub struct AbsorbedKvB<'a> {
    pub uk: &'a [u8],
    pub uk_layout: PackedLayout,
    pub uv: &'a [u8],
    pub uv_layout: PackedLayout,
}

/// One worker's buffers: its activation quantisation, the zero-padded `q_nope`, the matmul
/// output and the combined `o_lat`.
#[derive(Default)]
struct Local {
    acts: QuantizedActs,
    padded: Vec<f32>,
    tmp: Vec<f32>,
    o_lat: Vec<f32>,
}

/// Buffers shared by one call's tasks (reused across calls).
#[derive(Default)]
struct Step {
    /// `[heads, latent + rope]`: the absorbed queries.
    q_abs: Vec<f32>,
    partials: Vec<f32>,
    /// Per sub-group: heads absorbed so far.
    absorbed: Vec<AtomicUsize>,
    /// Per sub-group: position chunks whose partials are written.
    chunks_done: Vec<AtomicUsize>,
}

/// Raw view of a buffer that tasks write in disjoint parts and read after a counter says the
/// part is complete.
#[derive(Clone, Copy)]
struct Shared(*mut f32);
// SAFETY: every use writes a part no other task touches, or reads one after the Acquire load
// of the counter its writer released (argued at each use).
unsafe impl Send for Shared {}
unsafe impl Sync for Shared {}

impl Shared {
    /// # Safety
    /// `at..at + len` is in bounds and not written by another task while the slice lives.
    unsafe fn slice<'a>(self, at: usize, len: usize) -> &'a [f32] {
        std::slice::from_raw_parts(self.0.add(at), len)
    }

    /// # Safety
    /// `at..at + len` is in bounds and touched by no other task while the slice lives.
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice_mut<'a>(self, at: usize, len: usize) -> &'a mut [f32] {
        std::slice::from_raw_parts_mut(self.0.add(at), len)
    }
}

/// Absorbed MLA attention of one token over the pool in one dispatch ([`MlaDecode::run`]).
pub struct MlaDecode {
    locals: Vec<Mutex<Local>>,
    step: Mutex<Step>,
}

impl MlaDecode {
    pub fn new(pool: &WorkerPool) -> Self {
        MlaDecode { locals: (0..pool.threads()).map(|_| Mutex::default()).collect(), step: Mutex::default() }
    }

    /// `out[h, ..v_dim] = W_UV,h · attention(W_UK,hᵀ · q_nope,h ‖ q_rope,h)` for every head of one
    /// token at the cache's last position. `q`: `[heads, nope + rope]`, rope parts rotated; `kv`:
    /// the latent cache with this token's row appended (one kv head, keys `latent + rope` wide,
    /// values the first `latent` of each row); `out`: `[heads, v_dim]`.
    ///
    /// # Panics
    /// When the shapes disagree with `dims` or the layouts, or a task panicked.
    #[allow(clippy::too_many_arguments)]
    pub fn run(
        &self,
        pool: &WorkerPool,
        isa: Isa,
        dims: &MlaDims,
        q: &[f32],
        kv: &KvCacheView<'_>,
        scale: f32,
        w: &AbsorbedKvB<'_>,
        out: &mut [f32],
    ) {
        let MlaDims { heads: h, nope, rope: rd, latent: lat, v_dim: vd } = *dims;
        let (qk, row) = (nope + rd, lat + rd);
        let (lk, lv) = (&w.uk_layout, &w.uv_layout);
        assert!(h > 0 && kv.len > 0, "MlaDecode: {h} heads over {} cached rows", kv.len);
        assert_eq!(q.len(), h * qk, "MlaDecode: q must hold [heads, nope + rope]");
        assert_eq!(out.len(), h * vd, "MlaDecode: out must hold [heads, v_dim]");
        assert!(kv.kv_heads == 1 && kv.k_dim == row && kv.v_dim == lat, "MlaDecode: {kv:?} is not a latent cache");
        assert!(lk.rows == lat && lk.k >= nope && lv.rows == vd && lv.k == lat, "MlaDecode: layouts {lk:?} {lv:?}");
        assert!(w.uk.len() >= h * lk.bytes() && w.uv.len() >= h * lv.bytes(), "MlaDecode: kv_b holds too few bytes");
        let visible = kv.len;
        let (rows, chunks, hs) = shared_kv_plan(visible, h, 1, pool.threads());
        let subs = h / hs;
        let part = shared_kv_part_len(hs, lat);
        let split = split_factor();

        let mut guard = self.step.lock().unwrap_or_else(|e| e.into_inner());
        let step = &mut *guard;
        step.q_abs.resize(h * row, 0.0);
        step.partials.resize(subs * chunks * part, 0.0);
        step.absorbed.resize_with(subs, AtomicUsize::default);
        step.chunks_done.resize_with(subs, AtomicUsize::default);
        for c in step.absorbed.iter().chain(&step.chunks_done) {
            c.store(0, Ordering::Relaxed);
        }
        let (q_abs, partials) = (Shared(step.q_abs.as_mut_ptr()), Shared(step.partials.as_mut_ptr()));
        let (absorbed, chunks_done) = (&step.absorbed, &step.chunks_done);
        let o = Shared(out.as_mut_ptr());
        let failed = AtomicBool::new(false);

        // `y[..layout.rows] = W · x` for one head's packed matrix `wh` and activation row `x`
        // (`layout.k` floats), quantised as HeadMatmul quantises it.
        let head_matmul = |local: &mut Local, wh: &[u8], layout: &PackedLayout, x: &[f32], y: &mut [f32]| {
            let Local { acts, tmp, .. } = local;
            shape_acts(acts, split, layout.k, layout.gs);
            let dst = ActBufs::of(acts);
            for g in 0..layout.groups() {
                // SAFETY: x holds layout.k floats; `acts` is this worker's own, shaped above.
                unsafe { quantize_rows_group(|_| x.as_ptr(), 1, dst, layout.k, layout.gs, g, split) };
            }
            let cols = layout.row_blocks() * ROW_BLOCK;
            tmp.resize(split * cols, 0.0);
            matmul_packed(isa, wh, layout, acts, 0..layout.row_blocks(), tmp);
            sum_split_rows(tmp, 1, cols);
            y.copy_from_slice(&tmp[..layout.rows]);
        };

        let (n1, n2) = (h, h + subs * chunks);
        pool.run(n2 + h, &|t, ctx| {
            let _guard = FailOnUnwind(&failed);
            let mut local = self.locals[ctx.worker].lock().unwrap_or_else(|e| e.into_inner());
            let local = &mut *local;
            if t < n1 {
                let hh = t;
                let qn = &q[hh * qk..hh * qk + nope];
                let mut padded = std::mem::take(&mut local.padded);
                let x = if lk.k == nope {
                    qn
                } else {
                    padded.clear();
                    padded.resize(lk.k, 0.0);
                    padded[..nope].copy_from_slice(qn);
                    &padded[..]
                };
                // SAFETY: head hh's row of q_abs is written by this task alone, and read by
                // partial tasks only after the Release below.
                let qa = unsafe { q_abs.slice_mut(hh * row, row) };
                head_matmul(local, &w.uk[hh * lk.bytes()..(hh + 1) * lk.bytes()], lk, x, &mut qa[..lat]);
                local.padded = padded;
                qa[lat..].copy_from_slice(&q[hh * qk + nope..(hh + 1) * qk]);
                absorbed[hh / hs].fetch_add(1, Ordering::Release);
            } else if t < n2 {
                let (u, c) = ((t - n1) / chunks, (t - n1) % chunks);
                let positions = c * rows..((c + 1) * rows).min(visible);
                let keys = &kv.k[positions.start * kv.k_stride..];
                wait_ready(
                    &absorbed[u],
                    hs,
                    &failed,
                    bytemuck::cast_slice(&keys[..keys.len().min(rows * kv.k_stride)]),
                );
                // SAFETY: the sub-group's q_abs rows are complete (Acquire in wait_ready) and
                // no longer written; this task's partials are its own until the Release below.
                let (qs, p) =
                    unsafe { (q_abs.slice(u * hs * row, hs * row), partials.slice_mut((u * chunks + c) * part, part)) };
                shared_kv_partial(isa, qs, hs, kv, 0, positions, scale, p);
                chunks_done[u].fetch_add(1, Ordering::Release);
            } else {
                let hh = t - n2;
                let u = hh / hs;
                let wv = &w.uv[hh * lv.bytes()..(hh + 1) * lv.bytes()];
                wait_ready(&chunks_done[u], chunks, &failed, wv);
                let mut o_lat = std::mem::take(&mut local.o_lat);
                o_lat.resize(lat, 0.0);
                // SAFETY: the sub-group's partials are complete (Acquire in wait_ready) and no
                // longer written.
                shared_kv_combine(
                    isa,
                    &|c| unsafe { partials.slice((u * chunks + c) * part, part) },
                    chunks,
                    hh % hs,
                    hs,
                    &mut o_lat,
                );
                // SAFETY: head hh's output row is written by this task alone.
                let y = unsafe { o.slice_mut(hh * vd, vd) };
                head_matmul(local, wv, lv, &o_lat, y);
                local.o_lat = o_lat;
            }
        });
    }
}

#[cfg(test)]
#[path = "mla_decode_tests.rs"]
mod tests;
