//! Routed experts in BF16 on the GPU through a simple grouped path with no host synchronisation:
//! the expert ids stay on the device, and the kernels in `kernels/moe.cu` group the
//! (token, slot) pairs by expert (count / offsets / scatter), then run one block per
//! (expert tile of `MOE_TM` pairs, `MOE_BN` or `MOE_BN_DOWN` output columns), so each selected
//! expert's weights are read once per tile: once in total at decode (t = 1), once per 64 routed
//! tokens in prefill.
//! The tiles multiply on the tensor cores (`mma.sync`, BF16 operands, f32 accumulators); each f32
//! activation enters as two BF16 halves (within 2^-18 of it, two products each), so the products
//! keep about f32's accuracy; the SwiGLU intermediate is stored as its two halves too (f32 on the
//! decode path below). The result is deterministic (see the kernel file): per pair, each output
//! is one thread's accumulator in a fixed order, and the combine sums the top-k slots in
//! ascending order.
//!
//! Decode and tiny batches (at most [`DECODE_MAX_PAIRS`] pairs in a pass) take a GEMV-style path
//! instead: no grouping, each pair streams its expert's gate/up rows and then its down rows with
//! 16-byte coalesced loads, one warp per output element (several rows per warp in flight), then
//! the same combine. At t = 1 each selected expert's weights are still read once, now at close
//! to streaming bandwidth rather than through shared-memory tiles.
//!
//! Ids outside `[0, n_experts)` never index the weights: such a pair is left out of the grouping
//! and its token's output row is NaN (as the embedding gather does for bad token ids).

use std::sync::atomic::{AtomicBool, Ordering};

use cudarc::driver::sys::CUfunction_attribute_enum as FnAttr;
use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use crate::kernels::{KernelSource, HEADERS};
use crate::linear::{align_up, check, launch_err, to_i32, Carve, GemmContext};
use crate::{DeviceBuffer, GpuDevice, GpuError};

pub const MOE: KernelSource = KernelSource {
    name: "moe",
    src: include_str!("../kernels/moe.cu"),
    headers: HEADERS,
    options: &[],
    functions: &[
        "moe_route",
        "moe_split_rows",
        "moe_gate_up",
        "moe_down",
        "moe_combine",
        "moe_dec_gate_up",
        "moe_dec_down",
    ],
};

/// Pairs per tile (`MOE_TM` in moe.cu): 64 pairs (one 16-row MMA slice per warp) share each
/// weight chunk in shared memory.
const MOE_TM: usize = 64;
/// Output columns per gate/up block (`MOE_BN` in moe.cu).
const MOE_BN: usize = 64;
/// Output columns per down block (`MOE_BN_DOWN` in moe.cu).
const MOE_BN_DOWN: usize = 128;
/// Weight rows are padded to a multiple of this (`MOE_PAD` in moe.cu): the tiles' k chunks and
/// output column blocks divide it, so they never read past a row.
const MOE_PAD: usize = 64;
/// Threads of a GEMM block (`MOE_THREADS` in moe.cu): 4 warps.
const MOE_THREADS: u32 = 128;
/// BF16 row stride of a staged chunk (`MOE_SK` in moe.cu: the k chunk of 64 plus 8).
const MOE_SK: usize = 72;

/// Shared-memory buffers of the tiles' k loop (`MOE_STAGES` in moe.cu).
const MOE_STAGES: usize = 2;

/// Dynamic shared memory of a tile block: per buffer the weight rows (gate and up rows for the
/// gate/up step) and the pairs' two halves of A.
fn tile_smem(gated: bool) -> usize {
    let weight_rows = if gated { 2 * MOE_BN } else { MOE_BN_DOWN };
    MOE_STAGES * (weight_rows + 2 * MOE_TM) * MOE_SK * 2
}

/// Most experts `moe_route` can count in shared memory (`MOE_MAX_EXPERTS` in moe.cu).
pub const MOE_MAX_EXPERTS: usize = 4096;
/// Threads of the single routing block.
const ROUTE_THREADS: u32 = 1024;
/// Scratch (f32 intermediates of the pairs) per pass: long prompts are processed in passes of as
/// many tokens as fit, so the scratch stays bounded; 128 MiB holds ~3.6k pairs at hidden 7168 +
/// inter 2048 (14 pairs per expert for 256 experts), enough to fill most tiles.
const MOE_PASS_SCRATCH_BYTES: usize = 128 << 20;
/// Default largest pass (in (token, slot) pairs) that takes the decode path: there every pair
/// reads its expert's rows on its own, which wins while few pairs share an expert (decode, small
/// batches); beyond, the grouped tiles share each weight chunk between pairs. Measured on H200
/// (128 experts, hidden 2048, inter 768, top-8): decode 3.7× faster at 8 pairs, still 1.8× at
/// 128; 64 keeps a margin for shapes where pairs repeat experts more.
pub const DECODE_MAX_PAIRS: usize = 64;
/// Threads of a decode-path block (`MOE_DEC_THREADS` in moe.cu).
const MOE_DEC_THREADS: u32 = 128;
/// Intermediate columns per decode-path gate/up block: 4 warps × `MOE_DEC_GU_COLS` (2) in moe.cu.
const MOE_DEC_GU_BLOCK_COLS: usize = 8;
/// Hidden rows per decode-path down block: 4 warps × `MOE_DEC_DN_ROWS` (4) in moe.cu.
const MOE_DEC_DN_BLOCK_ROWS: usize = 16;
/// Threads per block of the combine (a block per token and chunk of this many columns).
const COMBINE_THREADS: u32 = 256;
/// Threads per block of `moe_split_rows` (a block per token and chunk of this many columns).
const SPLIT_THREADS: u32 = 256;

/// The routed experts of one MoE layer, BF16, resident on the GPU.
pub struct GpuExperts {
    name: String,
    n_experts: usize,
    hidden: usize,
    inter: usize,
    /// `[E, 2·inter, hidden_pad]`: gate rows then up rows of each expert, zero padded.
    w13: DeviceBuffer<u16>,
    /// `[E, hidden, inter_pad]`, zero padded.
    w2: DeviceBuffer<u16>,
    hidden_pad: usize,
    inter_pad: usize,
    /// Tokens per pass (bounds the scratch); see [`GpuExperts::set_max_tokens_per_pass`].
    max_pass_tokens: usize,
    /// Passes of at most this many pairs take the decode path; see [`DECODE_MAX_PAIRS`].
    decode_max_pairs: usize,
    /// Whether the tile kernels' dynamic shared-memory limit has been raised.
    tile_smem_set: AtomicBool,
}

impl std::fmt::Debug for GpuExperts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuExperts")
            .field("name", &self.name)
            .field("n_experts", &self.n_experts)
            .field("hidden", &self.hidden)
            .field("inter", &self.inter)
            .finish()
    }
}

impl GpuExperts {
    /// Allocates (zeroed, budget-charged as `name`) room for `n_experts` experts.
    pub fn new(dev: &GpuDevice, name: &str, n_experts: usize, hidden: usize, inter: usize) -> Result<Self, GpuError> {
        const OP: &str = "GpuExperts::new";
        check(OP, n_experts > 0 && hidden > 0 && inter > 0, || {
            format!("{name}: empty shape (experts {n_experts}, hidden {hidden}, inter {inter})")
        })?;
        check(OP, n_experts <= MOE_MAX_EXPERTS, || {
            format!("{name}: {n_experts} experts, at most {MOE_MAX_EXPERTS} supported")
        })?;
        let (hidden_pad, inter_pad) = (align_up(hidden, MOE_PAD), align_up(inter, MOE_PAD));
        to_i32(OP, "2·inter·hidden_pad", 2 * inter * hidden_pad)?;
        to_i32(OP, "hidden·inter_pad", hidden * inter_pad)?;
        let n13 = n_experts.checked_mul(2 * inter * hidden_pad);
        let n2 = n_experts.checked_mul(hidden * inter_pad);
        let (Some(n13), Some(n2)) = (n13, n2) else {
            return Err(GpuError::shape(OP, format!("{name}: expert weights overflow usize")));
        };
        let w13 = dev.alloc_zeros::<u16>(n13, &format!("{name} w13"))?;
        let w2 = dev.alloc_zeros::<u16>(n2, &format!("{name} w2"))?;
        let max_pass_tokens = usize::MAX;
        Ok(GpuExperts {
            name: name.to_string(),
            n_experts,
            hidden,
            inter,
            w13,
            w2,
            hidden_pad,
            inter_pad,
            max_pass_tokens,
            decode_max_pairs: DECODE_MAX_PAIRS,
            tile_smem_set: AtomicBool::new(false),
        })
    }

    pub fn n_experts(&self) -> usize {
        self.n_experts
    }

    pub fn hidden(&self) -> usize {
        self.hidden
    }

    pub fn inter(&self) -> usize {
        self.inter
    }

    /// Copies expert `e`'s BF16 weights in: `gate` and `up` `[inter, hidden]`, `down`
    /// `[hidden, inter]` (HF `out × in`). Padding stays zero.
    pub fn upload_expert(
        &mut self,
        dev: &GpuDevice,
        e: usize,
        gate: &[u16],
        up: &[u16],
        down: &[u16],
    ) -> Result<(), GpuError> {
        const OP: &str = "GpuExperts::upload_expert";
        let (h, i, name) = (self.hidden, self.inter, &self.name);
        check(OP, e < self.n_experts, || format!("{name}: expert {e} of {}", self.n_experts))?;
        for (what, v, want) in [("gate", gate, i * h), ("up", up, i * h), ("down", down, h * i)] {
            check(OP, v.len() == want, || format!("{name} expert {e}: {what} has {} elements, not {want}", v.len()))?;
        }
        let (hp, ip) = (self.hidden_pad, self.inter_pad);
        let mut w13 = vec![0u16; 2 * i * hp];
        for (r, src) in gate.chunks_exact(h).chain(up.chunks_exact(h)).enumerate() {
            w13[r * hp..r * hp + h].copy_from_slice(src);
        }
        let mut w2 = vec![0u16; h * ip];
        for (r, src) in down.chunks_exact(i).enumerate() {
            w2[r * ip..r * ip + i].copy_from_slice(src);
        }
        let s = dev.stream();
        let mut dst13 = self.w13.slice_mut().slice_mut(e * w13.len()..(e + 1) * w13.len());
        s.memcpy_htod(&w13, &mut dst13).map_err(|err| GpuError::driver("cuMemcpyHtoDAsync", err))?;
        let mut dst2 = self.w2.slice_mut().slice_mut(e * w2.len()..(e + 1) * w2.len());
        s.memcpy_htod(&w2, &mut dst2).map_err(|err| GpuError::driver("cuMemcpyHtoDAsync", err))?;
        Ok(())
    }

    /// Device bytes of all expert weights (padding included).
    pub fn weight_bytes(&self) -> usize {
        (self.w13.len() + self.w2.len()) * 2
    }

    /// Caps the tokens one pass of [`GpuExperts::forward`] handles (at least 1), on top of the
    /// built-in scratch bound of 128 MiB per pass: a smaller cap means less scratch, a larger
    /// one fuller expert tiles.
    pub fn set_max_tokens_per_pass(&mut self, tokens: usize) {
        self.max_pass_tokens = tokens.max(1);
    }

    /// Sets the largest pass (in pairs, `tokens · top_k`) that takes the decode path instead of
    /// the grouped one (default [`DECODE_MAX_PAIRS`]): 0 forces the grouped path, `usize::MAX`
    /// the decode path. For tests and tuning; both paths give the same result up to rounding
    /// (f32 sums; the grouped path's activations split into two BF16 halves, within 2^-18).
    #[doc(hidden)]
    pub fn set_decode_path_max_pairs(&mut self, pairs: usize) {
        self.decode_max_pairs = pairs;
    }

    /// Whether a pass of `tokens` tokens at `top_k` takes the decode path (for tests).
    #[doc(hidden)]
    pub fn uses_decode_path(&self, tokens: usize, top_k: usize) -> bool {
        tokens.saturating_mul(top_k) <= self.decode_max_pairs
    }

    /// Tokens per pass at `top_k`, bounded by [`MOE_PASS_SCRATCH_BYTES`] and the caller's cap.
    fn tokens_per_pass(&self, top_k: usize) -> usize {
        (MOE_PASS_SCRATCH_BYTES / self.scratch_per_token(top_k)).clamp(1, self.max_pass_tokens)
    }

    /// Scratch bytes per token of a pass: per pair its sorted index, intermediate (f32 on the
    /// decode path, two BF16 halves on the grouped one, padded) and output row; per token the
    /// two BF16 halves of its activations.
    fn scratch_per_token(&self, top_k: usize) -> usize {
        top_k * (1 + self.inter_pad + self.hidden) * 4 + self.hidden_pad * 4
    }

    /// `out[t, :] = Σ_j weights[t, j] · down_e(silu(gate_e x_t) · up_e x_t)` with `e = ids[t, j]`,
    /// `j` ascending; `x`, `out` `[t, hidden]` f32, `ids`, `weights` `[t, top_k]` on the device.
    /// `out` is overwritten; a token with an id outside `[0, n_experts)` gets a NaN row. Never
    /// synchronises.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        dev: &GpuDevice,
        ctx: &GemmContext,
        x: &impl DevicePtr<f32>,
        t: usize,
        ids: &impl DevicePtr<i32>,
        weights: &impl DevicePtr<f32>,
        top_k: usize,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), GpuError> {
        const OP: &str = "GpuExperts::forward";
        let (h, i, name) = (self.hidden, self.inter, &self.name);
        check(OP, top_k > 0, || format!("{name}: top_k = 0"))?;
        check(OP, x.len() == t * h, || format!("{name}: x has {} elements, not [{t}, {h}]", x.len()))?;
        check(OP, out.len() == t * h, || format!("{name}: out has {} elements, not [{t}, {h}]", out.len()))?;
        check(OP, ids.len() == t * top_k, || format!("{name}: ids has {} elements, not [{t}, {top_k}]", ids.len()))?;
        check(OP, weights.len() == t * top_k, || {
            format!("{name}: weights has {} elements, not [{t}, {top_k}]", weights.len())
        })?;
        if t == 0 {
            return Ok(());
        }
        to_i32(OP, "tokens·top_k", t * top_k)?;
        let e = self.n_experts;
        let pass = self.tokens_per_pass(top_k).min(t);
        let max_pairs = pass * top_k;
        let (hp, ip) = (self.hidden_pad, self.inter_pad);
        // `act`: the decode path's f32 intermediate [pairs, inter], or the grouped path's two BF16
        // halves [pairs, inter_pad] each; `xs`: the two BF16 halves of x [pass, hidden_pad] each.
        let sizes = |pairs: usize| [(e + 1) * 4, (e + 1) * 4, pairs * 4, pairs * ip * 4, pairs * h * 4, pass * hp * 4];
        let g = ctx.lock(dev, OP, Carve::total(&sizes(max_pairs)))?;
        let mut carve = Carve::new(g.scratch_ptr());
        let [offsets, tile_offsets, sorted, act, ypair, xs] = sizes(max_pairs).map(|b| carve.take(b));
        let (act_hi, act_lo) = (act, act + (max_pairs * ip * 2) as u64);
        let (xs_hi, xs_lo) = (xs, xs + (pass * hp * 2) as u64);

        let s = dev.stream();
        let (x_p, _g1) = x.device_ptr(s);
        let (ids_p, _g2) = ids.device_ptr(s);
        let (w_p, _g3) = weights.device_ptr(s);
        let (out_p, _g4) = out.device_ptr_mut(s);
        let (w13_p, _g5) = self.w13.device_ptr(s);
        let (w2_p, _g6) = self.w2.device_ptr(s);
        let (route, gate_up, down, combine) = (
            dev.function(&MOE, "moe_route")?,
            dev.function(&MOE, "moe_gate_up")?,
            dev.function(&MOE, "moe_down")?,
            dev.function(&MOE, "moe_combine")?,
        );
        let (dec_gate_up, dec_down) = (dev.function(&MOE, "moe_dec_gate_up")?, dev.function(&MOE, "moe_dec_down")?);
        let split = dev.function(&MOE, "moe_split_rows")?;
        // The tiles' dynamic shared memory (72 KiB for gate/up, above the 48 KiB default), once.
        if !self.tile_smem_set.load(Ordering::Relaxed) {
            for (f, gated) in [(&gate_up, true), (&down, false)] {
                f.set_attribute(FnAttr::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, tile_smem(gated) as i32)
                    .map_err(|e| GpuError::driver("cuFuncSetAttribute", e))?;
            }
            self.tile_smem_set.store(true, Ordering::Relaxed);
        }
        let (e_i, h_i, i_i, k_i) = (e as i32, h as i32, i as i32, top_k as i32);
        let (ldw13, ldw2) = (hp as i32, ip as i32);

        let launch_combine = |ypair: &u64, ids_t: &u64, w_t: &u64, out_t: &u64, nt_i: i32| {
            let mut b = s.launch_builder(&combine);
            b.arg(ypair).arg(ids_t).arg(w_t).arg(out_t).arg(&nt_i).arg(&k_i).arg(&h_i).arg(&e_i);
            // Tokens on x, column chunks of COMBINE_THREADS on y (capped; the kernel strides).
            let chunks = h.div_ceil(COMBINE_THREADS as usize).min(65535) as u32;
            let cfg = LaunchConfig {
                grid_dim: (nt_i as u32, chunks, 1),
                block_dim: (COMBINE_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: ypair [pairs, hidden] (rows of bad pairs are read but discarded), out [nt, hidden].
            unsafe { b.launch(cfg) }.map_err(launch_err(OP))
        };
        let mut t0 = 0;
        while t0 < t {
            let nt = pass.min(t - t0);
            let pairs = nt * top_k;
            let (nt_i, pairs_i) = (nt as i32, pairs as i32);
            let ids_t = ids_p + (t0 * top_k * 4) as u64;
            let w_t = w_p + (t0 * top_k * 4) as u64;
            let x_t = x_p + (t0 * h * 4) as u64;
            let out_t = out_p + (t0 * h * 4) as u64;

            if self.uses_decode_path(nt, top_k) {
                let grid = |n_out: usize, per_block: usize| LaunchConfig {
                    grid_dim: (pairs as u32, n_out.div_ceil(per_block) as u32, 1),
                    block_dim: (MOE_DEC_THREADS, 1, 1),
                    shared_mem_bytes: 0,
                };
                let mut b = s.launch_builder(&dec_gate_up);
                b.arg(&w13_p).arg(&ldw13).arg(&i_i).arg(&h_i).arg(&x_t).arg(&k_i).arg(&act).arg(&ids_t).arg(&e_i);
                // SAFETY: w13 [E, 2·inter, ldw13] indexed only by ids checked in [0, E) on the
                // device, x [nt, hidden], act [pairs, inter], ids [pairs] = grid.x.
                unsafe { b.launch(grid(i, MOE_DEC_GU_BLOCK_COLS)) }.map_err(launch_err(OP))?;
                let mut b = s.launch_builder(&dec_down);
                b.arg(&w2_p).arg(&ldw2).arg(&i_i).arg(&h_i).arg(&act).arg(&ypair).arg(&ids_t).arg(&e_i);
                // SAFETY: w2 [E, hidden, ldw2] (ids checked as above), act [pairs, inter],
                // ypair [pairs, hidden].
                unsafe { b.launch(grid(h, MOE_DEC_DN_BLOCK_ROWS)) }.map_err(launch_err(OP))?;
                launch_combine(&ypair, &ids_t, &w_t, &out_t, nt_i)?;
                t0 += nt;
                continue;
            }

            let mut b = s.launch_builder(&split);
            b.arg(&x_t).arg(&h_i).arg(&xs_hi).arg(&xs_lo).arg(&ldw13);
            let cfg = LaunchConfig {
                grid_dim: (nt as u32, hp.div_ceil(SPLIT_THREADS as usize) as u32, 1),
                block_dim: (SPLIT_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: x [nt, hidden]; xs_hi, xs_lo [nt, hidden_pad] each in the scratch.
            unsafe { b.launch(cfg) }.map_err(launch_err(OP))?;

            let mut b = s.launch_builder(&route);
            b.arg(&ids_t).arg(&pairs_i).arg(&e_i).arg(&offsets).arg(&tile_offsets).arg(&sorted);
            let one = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (ROUTE_THREADS, 1, 1), shared_mem_bytes: 0 };
            // SAFETY: ids [pairs]; offsets/tile_offsets [E+1] and sorted [pairs] in the scratch.
            unsafe { b.launch(one) }.map_err(launch_err(OP))?;

            // Upper bound on the tiles: each non-empty expert adds at most one partial tile, and
            // no tile is empty. Blocks past the device-side count exit at once.
            let max_tiles = pairs.min(pairs.div_ceil(MOE_TM) + e.min(pairs)) as u32;
            let grid = |n_out: usize, gated: bool| LaunchConfig {
                grid_dim: (max_tiles, n_out.div_ceil(if gated { MOE_BN } else { MOE_BN_DOWN }) as u32, 1),
                block_dim: (MOE_THREADS, 1, 1),
                shared_mem_bytes: tile_smem(gated) as u32,
            };
            let mut b = s.launch_builder(&gate_up);
            b.arg(&w13_p).arg(&ldw13).arg(&i_i).arg(&h_i).arg(&xs_hi).arg(&xs_lo).arg(&k_i);
            b.arg(&act_hi).arg(&act_lo).arg(&ldw2).arg(&sorted).arg(&offsets).arg(&tile_offsets).arg(&e_i);
            // SAFETY: w13 [E, 2·inter, ldw13]; xs halves [nt, ldw13]; act halves [pairs, ldw2],
            // every column of a pair's row written (the last column block ends at ldw2); rows of
            // A are pair / top_k < nt, and pairs with bad ids are never in `sorted`.
            unsafe { b.launch(grid(i, true)) }.map_err(launch_err(OP))?;

            let mut b = s.launch_builder(&down);
            b.arg(&w2_p).arg(&ldw2).arg(&i_i).arg(&h_i).arg(&act_hi).arg(&act_lo).arg(&ypair);
            b.arg(&sorted).arg(&offsets).arg(&tile_offsets).arg(&e_i);
            // SAFETY: w2 [E, hidden, ldw2], act halves [pairs, ldw2], ypair [pairs, hidden].
            unsafe { b.launch(grid(h, false)) }.map_err(launch_err(OP))?;

            launch_combine(&ypair, &ids_t, &w_t, &out_t, nt_i)?;
            t0 += nt;
        }
        drop(g);
        Ok(())
    }
}
