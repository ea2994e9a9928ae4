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
//!    and applies `W_UV,h`; with the output projection in the dispatch, it also counts its
//!    values into the projection's input groups, and the task that completes a group quantises
//!    it;
//! 4. with the output projection: one per worker over a run of its row blocks. Claimed while
//!    the attention's last tasks run, each pulls its weights into L2 while it waits for the
//!    input groups, so the projection's memory traffic overlaps the attention's arithmetic
//!    (which leaves DRAM idle) instead of following it.
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
use crate::moe::{
    count_group_columns, quantize_acts_split, quantize_rows_group, shape_acts, split_factor, sum_split_rows,
    wait_ready, ActBufs, FailOnUnwind, OutPtr,
};
use crate::pool::WorkerPool;
use crate::quant::{matmul_packed, PackedLayout, QuantizedActs, ROW_BLOCK};

/// Most weight bytes an output-projection task pulls into L2 while it waits for its input: a
/// V2-Lite `o_proj` share on 16 workers is ~260 KB, well inside a 2 MB L2 beside the attention's
/// cache rows.
const OUTPUT_WAIT_PREFETCH: usize = 1 << 20;

/// The output projection (`o_proj`) run inside the dispatch: `y[..layout.rows] = W · out` for
/// the packed `w` (K = heads · v_dim).
pub struct OutputProj<'a> {
    pub w: &'a [u8],
    pub layout: PackedLayout,
    pub y: &'a mut [f32],
}

/// Whether an output projection of `layout` can run inside the dispatch for `dims`: its K is the
/// heads' values.
pub fn output_fusable(dims: &MlaDims, layout: &PackedLayout) -> bool {
    layout.k == dims.heads * dims.v_dim
}

/// `kv_b` packed per head: every head's `W_UKᵀ` (`[latent, K]`, K = nope padded with zero
/// columns to the layout's K) back to back, and every head's `W_UV` (`[v_dim, latent]`).
#[derive(Clone, Copy)]
pub struct AbsorbedKvB<'a> {
    pub uk: &'a [u8],
    pub uk_layout: PackedLayout,
    pub uv: &'a [u8],
    pub uv_layout: PackedLayout,
}

/// One worker's buffers: its activation quantisation (and its residual group), the zero-padded
/// `q_nope`, the matmul output and the combined `o_lat`.
#[derive(Default)]
struct Local {
    acts: QuantizedActs,
    resid: Vec<f32>,
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
    /// The output projection's quantised input; per group, its values written so far; groups
    /// quantised so far.
    o_acts: QuantizedActs,
    o_cols: Vec<AtomicUsize>,
    o_groups: AtomicUsize,
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
    /// values the first `latent` of each row); `out`: `[heads, v_dim]`. With `proj`, also
    /// `proj.y = proj.w · out`, bit for bit what [`crate::moe::PoolMatmul`] gives.
    ///
    /// # Panics
    /// When the shapes disagree with `dims` or the layouts, `proj` is not
    /// [`output_fusable`], or a task panicked.
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
        proj: Option<OutputProj<'_>>,
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
        if let Some(p) = &proj {
            assert!(output_fusable(dims, &p.layout), "MlaDecode: o_proj {:?} cannot take {dims:?}", p.layout);
            assert!(p.w.len() >= p.layout.bytes() && p.y.len() == p.layout.rows, "MlaDecode: o_proj sizes");
        }

        let mut guard = self.step.lock().unwrap_or_else(|e| e.into_inner());
        let step = &mut *guard;
        step.q_abs.resize(h * row, 0.0);
        step.partials.resize(subs * chunks * part, 0.0);
        step.absorbed.resize_with(subs, AtomicUsize::default);
        step.chunks_done.resize_with(subs, AtomicUsize::default);
        for c in step.absorbed.iter().chain(&step.chunks_done) {
            c.store(0, Ordering::Relaxed);
        }
        let (q_abs, partials) = (OutPtr(step.q_abs.as_mut_ptr()), OutPtr(step.partials.as_mut_ptr()));
        step.o_groups.store(0, Ordering::Relaxed);
        if let Some(p) = &proj {
            shape_acts(&mut step.o_acts, split, p.layout.k, p.layout.gs);
            step.o_cols.resize_with(p.layout.groups(), AtomicUsize::default);
            step.o_cols.iter().for_each(|c| c.store(0, Ordering::Relaxed));
        }
        let (o_dst, o_acts, o_groups) = (ActBufs::of(&mut step.o_acts), &step.o_acts, &step.o_groups);
        let o_cols = &step.o_cols;
        let (absorbed, chunks_done) = (&step.absorbed, &step.chunks_done);
        let o = OutPtr(out.as_mut_ptr());
        // The projection: one task per worker over an even share of its row blocks.
        let proj = proj.map(|p| {
            let nb = p.layout.row_blocks();
            (p.w, p.layout, OutPtr(p.y.as_mut_ptr()), nb, pool.threads().min(nb))
        });
        let n_proj = proj.map_or(0, |p| p.4);
        let failed = AtomicBool::new(false);

        // `y[..layout.rows] = W · x` for one head's packed matrix `wh` and activation row `x`
        // (`layout.k` floats), quantised as HeadMatmul quantises it.
        let head_matmul = |local: &mut Local, wh: &[u8], layout: &PackedLayout, x: &[f32], y: &mut [f32]| {
            let Local { acts, resid, tmp, .. } = local;
            quantize_acts_split(x, 1, layout.k, layout.gs, resid, acts);
            let cols = layout.row_blocks() * ROW_BLOCK;
            tmp.resize(split * cols, 0.0);
            matmul_packed(isa, wh, layout, acts, 0..layout.row_blocks(), tmp);
            sum_split_rows(tmp, 1, cols);
            y.copy_from_slice(&tmp[..layout.rows]);
        };

        let (n1, n2) = (h, h + subs * chunks);
        let n3 = n2 + h;
        pool.run(n3 + n_proj, &|t, ctx| {
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
            } else if t < n3 {
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
                if let Some((_, pl, ..)) = proj {
                    count_group_columns(o_cols, hh * vd..(hh + 1) * vd, pl.gs, |g| {
                        // SAFETY: every value of group g is written (counted) and not written
                        // again; group g of the projection's input is quantised by this task
                        // alone and read by projection tasks only after the Release below.
                        unsafe { quantize_rows_group(|_| o.0, 1, o_dst, pl.k, pl.gs, g, split) };
                        o_groups.fetch_add(1, Ordering::Release);
                    });
                }
            } else if let Some((pw, pl, y, nb, tasks)) = proj {
                let j = t - n3;
                let (b0, b1) = (j * nb / tasks, (j + 1) * nb / tasks);
                let bb = pl.block_bytes();
                let wr = &pw[b0 * bb..(b1 * bb).min(pw.len())];
                wait_ready(o_groups, pl.groups(), &failed, &wr[..wr.len().min(OUTPUT_WAIT_PREFETCH)]);
                let cols = (b1 - b0) * ROW_BLOCK;
                local.tmp.resize(split * cols, 0.0);
                // Every group of o_acts is quantised (Acquire in wait_ready) and no longer written.
                matmul_packed(isa, pw, &pl, o_acts, b0..b1, &mut local.tmp);
                sum_split_rows(&mut local.tmp, 1, cols);
                let keep = cols.min(pl.rows - b0 * ROW_BLOCK);
                // SAFETY: rows 16·b0 .. +keep of y are written by this task alone.
                unsafe { y.slice_mut(b0 * ROW_BLOCK, keep) }.copy_from_slice(&local.tmp[..keep]);
            }
        });
    }
}

#[cfg(test)]
#[path = "mla_decode_tests.rs"]
mod tests;
