//! Decode attention read straight from the [`GpuKvCache`] (BF16 or FP8 + scales), split over the
//! KV rows (flash-decoding), and the MLA weight-absorption ops around it.
//!
//! Each block takes up to 16 queries of one kv group (MLA: all heads of a token share the latent
//! row, so the row is read once per block for every head; GQA: the heads of one kv head), stages
//! 32 cache rows at a time into shared memory as BF16 (the next tile's bytes are in flight while
//! one is computed) and computes scores and P·V with BF16 tensor-core MMAs (f32 operands split
//! into BF16 hi + lo halves, f32 accumulation: ~2^-17 relative, see attn_decode.cu), with one
//! online-softmax update per tile; each split writes (max, sum, unnormalised output) into a
//! [`DecodeWorkspace`] and a combine kernel merges them ([`decode_split_count`] is the rule for
//! how many splits). With one split the attention kernel writes the output itself.
//!
//! Needs sm_80+ (mma.sync BF16). Limits: MLA latent ≤ [`MAX_LATENT`], rope ≤ [`MAX_ROPE`]; GQA
//! head_dim ≤ [`MAX_HEAD_DIM`]; the shared memory a configuration needs must fit the device
//! (V2-Lite's MLA: ~80 KB BF16, ~118 KB FP8).

use std::collections::HashMap;

use cudarc::driver::sys::{CUdevice_attribute_enum as DevAttr, CUfunction_attribute_enum as FnAttr};
use cudarc::driver::{DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg};

use crate::device::kernel_args;
use crate::kernels::{to_i32, KernelSource, DEFAULT_SMEM_LIMIT, HEADERS};
use crate::kv_cache::{GpuKvCache, KvCapacity, KvDtype};
use crate::{DeviceBuffer, GpuDevice, GpuError};

/// The decode kernels besides the attention itself: the split combine, MLA's query absorption and
/// W_UV.
pub const ATTN_DECODE: KernelSource = KernelSource {
    name: "attn_decode",
    src: include_str!("../kernels/attn_decode.cu"),
    headers: HEADERS,
    options: &[],
    functions: &["attn_decode_combine", "mla_absorb_q", "mla_apply_uv"],
};

/// One program per attention kernel variant (dtype × value n-tiles per warp), each the same
/// source with the variant's macros: one instantiation takes seconds to compile (all eight as one
/// program took 16–23 s on the H100 box), so they compile in parallel and only on first use.
macro_rules! attn_variant {
    ($name:literal, $fp8:literal, $ntw:literal) => {
        KernelSource {
            name: $name,
            src: include_str!("../kernels/attn_decode.cu"),
            headers: HEADERS,
            options: &[concat!("-DATT_NAME=", $name), concat!("-DATT_FP8=", $fp8), concat!("-DATT_NTW=", $ntw)],
            functions: &[$name],
        }
    };
}

/// The attention kernel variants, named `attn_decode_<bf16|fp8>_n<value n-tiles per warp>`.
pub const ATTN_DECODE_VARIANTS: [KernelSource; 8] = [
    attn_variant!("attn_decode_bf16_n2", "false", "2"),
    attn_variant!("attn_decode_bf16_n4", "false", "4"),
    attn_variant!("attn_decode_bf16_n8", "false", "8"),
    attn_variant!("attn_decode_bf16_n16", "false", "16"),
    attn_variant!("attn_decode_fp8_n2", "true", "2"),
    attn_variant!("attn_decode_fp8_n4", "true", "4"),
    attn_variant!("attn_decode_fp8_n8", "true", "8"),
    attn_variant!("attn_decode_fp8_n16", "true", "16"),
];

/// Whether `k` is one of the attention variants for another KV dtype than `kv`: a model with a
/// `kv` cache never launches it, so its start need not compile it (every variant, for an f32
/// cache: its attention runs in the prefill form).
pub fn attention_variant_of_other_dtype(k: &KernelSource, kv: KvDtype) -> bool {
    ATTN_DECODE_VARIANTS.iter().any(|v| v.name == k.name) && !VALUE_TILES.iter().any(|&n| kernel_name(kv, n) == k.name)
}

/// The program that defines attention kernel `fname` (one of [`ATTN_DECODE_VARIANTS`]).
fn variant_source(fname: &str) -> Result<&'static KernelSource, GpuError> {
    ATTN_DECODE_VARIANTS
        .iter()
        .find(|k| k.name == fname)
        .ok_or_else(|| GpuError::Shape { op: "attn_decode", detail: format!("no attention kernel variant {fname}") })
}

/// Largest MLA latent (values per head) the decode kernel supports: 16 value n-tiles per warp.
pub const MAX_LATENT: usize = 1024;
/// Largest MLA rope-key width.
pub const MAX_ROPE: usize = 256;
/// Largest GQA head_dim.
pub const MAX_HEAD_DIM: usize = 256;

/// Threads per attention block (must match `ATT_THREADS` in attn_decode.cu).
const ATT_THREADS: u32 = 256;
/// Cache rows per shared-memory tile (must match `ATT_ROWS`: 4 MMA n-tiles, one lane per row).
const ATT_ROWS: usize = 32;
/// Queries per block (must match `ATT_Q`: the MMA's M).
const ATT_Q: usize = 16;
/// f32 score row stride and BF16 probability row stride (`ATT_SLD`, `ATT_PLD`).
const ATT_SLD: usize = ATT_ROWS + 4;
const ATT_PLD: usize = ATT_ROWS + 8;
/// Value n-tiles per warp compiled (`_n2` .. `_n16`): 8 warps x 8 columns each.
const VALUE_TILES: [usize; 4] = [2, 4, 8, 16];
/// A split covers at least one tile: shorter splits leave MMA rows idle and only add combine work.
pub const MIN_ROWS_PER_SPLIT: usize = 32;
/// Target resident blocks per SM: V2-Lite's BF16 configuration takes ~80 KB of shared memory, so
/// two fit an H100/H200 SM, and a second block hides the first one's load latency.
pub const BLOCKS_PER_SM: usize = 2;
/// Upper bound on splits (the combine kernel keeps one weight per split in shared memory).
pub const MAX_SPLITS: usize = 256;
/// Threads of the combine kernel (must match `COMB_THREADS`).
const COMBINE_THREADS: u32 = 256;
/// Output columns per combine block (must match `COMB_COLS`: 32 quads of columns).
const COMBINE_COLS: usize = 128;
/// Threads of the absorb kernel (`ABS_THREADS`: 8 warps splitting the nope rows).
const ABSORB_THREADS: u32 = 256;
/// Latent columns per absorb block (`ABS_COLS`: two per lane).
const ABSORB_COLS: usize = 64;
/// Tokens per absorb block (`ABS_TT`): each weight element loaded serves this many tokens.
const ABSORB_TOK_TILE: usize = 4;
/// Threads of the W_UV kernel (one warp per output element).
const UV_THREADS: u32 = 256;

/// How many splits decode attention uses for `visible` rows when the rest of the grid has
/// `base_blocks` blocks (kv heads × query tiles) on a device with `sms` multiprocessors: enough
/// blocks for [`BLOCKS_PER_SM`] per SM, no split shorter than [`MIN_ROWS_PER_SPLIT`] rows, at most
/// [`MAX_SPLITS`], at least 1.
pub fn decode_split_count(visible: usize, base_blocks: usize, sms: usize) -> usize {
    let want = (BLOCKS_PER_SM * sms.max(1)).div_ceil(base_blocks.max(1));
    let by_len = visible.div_ceil(MIN_ROWS_PER_SPLIT);
    want.min(by_len).clamp(1, MAX_SPLITS)
}

/// The most splits [`decode_split_count`] picks for `t` queries of `heads` heads over `kv_heads`
/// kv heads on `sms` multiprocessors (workspace sizing).
pub(crate) fn most_splits(t: usize, heads: usize, kv_heads: usize, sms: usize) -> usize {
    let kv_heads = kv_heads.max(1);
    let base = kv_heads * (t * (heads / kv_heads)).div_ceil(ATT_Q);
    decode_split_count(usize::MAX, base, sms)
}

/// Split-KV partial results (per split and query: the running max, the sum and the unnormalised
/// output) plus launch bookkeeping. Charged to the budget. It grows when a call needs more than it
/// holds: it is sized for the most splits the rule can choose for that configuration, so growth
/// happens only on the first call of each new (tokens, heads, value width) configuration — in
/// decode, the first one or two calls — never as the context grows.
#[derive(Debug, Default)]
pub struct DecodeWorkspace {
    o: Option<DeviceBuffer<f32>>,
    ml: Option<DeviceBuffer<f32>>,
    pub(crate) force_splits: Option<usize>,
    pub(crate) last_splits: usize,
    growths: usize,
    /// Tests and A/B runs: skip the one-token MLA kernel of [`crate::mla_decode`].
    general_only: bool,
    smem_optin: Option<usize>,
    smem_set: HashMap<&'static str, usize>,
}

impl DecodeWorkspace {
    /// An empty workspace (allocates on first use).
    pub fn new() -> Self {
        Self::default()
    }

    /// Forces the split count (tests, benchmarks); `None` restores [`decode_split_count`]. A
    /// forced count is clamped to `1..=min(MAX_SPLITS, visible rows)` and splits are not rounded
    /// to whole tiles.
    pub fn force_splits(&mut self, n: Option<usize>) {
        self.force_splits = n;
    }

    /// Forces the general tensor-core kernel even where [`crate::mla_decode`]'s one-token MLA
    /// kernel applies (tests comparing the two, A/B benchmarks); `KRASIS_MLA_DECODE=general` does
    /// the same for a whole process.
    pub fn force_general(&mut self, on: bool) {
        self.general_only = on;
    }

    /// Whether a call may take the one-token MLA kernel.
    pub(crate) fn allows_t1(&self) -> bool {
        !self.general_only && !crate::mla_decode::disabled_by_env()
    }

    /// Splits used by the last call.
    pub fn last_splits(&self) -> usize {
        self.last_splits
    }

    /// How many times the buffers were (re)allocated.
    pub fn growths(&self) -> usize {
        self.growths
    }

    /// Bytes charged now.
    pub fn charged_bytes(&self) -> u64 {
        self.o.as_ref().map_or(0, |b| b.charged_bytes()) + self.ml.as_ref().map_or(0, |b| b.charged_bytes())
    }

    pub(crate) fn ensure(
        &mut self,
        dev: &GpuDevice,
        splits: usize,
        queries: usize,
        v_dim: usize,
    ) -> Result<(), GpuError> {
        let need_o = splits * queries * v_dim;
        let need_ml = splits * queries * 2;
        if self.o.as_ref().is_some_and(|b| b.len() >= need_o) && self.ml.as_ref().is_some_and(|b| b.len() >= need_ml) {
            return Ok(());
        }
        let keep_o = self.o.as_ref().map_or(0, |b| b.len());
        let keep_ml = self.ml.as_ref().map_or(0, |b| b.len());
        self.o = None;
        self.ml = None;
        // SAFETY: every element a kernel reads is written earlier in the same call.
        unsafe {
            self.o = Some(dev.alloc_uninit::<f32>(need_o.max(keep_o), "decode attention workspace")?);
            self.ml = Some(dev.alloc_uninit::<f32>(need_ml.max(keep_ml), "decode attention workspace")?);
        }
        self.growths += 1;
        Ok(())
    }

    /// `(splits, rows per split)` for `visible` rows: the forced count if one is set, else
    /// `rule` splits with their rows rounded up to a multiple of `round`; empty splits dropped.
    /// Recorded as the last call's split count.
    pub(crate) fn plan_splits(&mut self, visible: usize, rule: usize, round: usize) -> (usize, usize) {
        let (n, round) = match self.force_splits {
            Some(n) => (n.clamp(1, MAX_SPLITS.min(visible.max(1))), 1),
            None => (rule.max(1), round.max(1)),
        };
        let rows = visible.div_ceil(n).next_multiple_of(round).max(1);
        self.last_splits = visible.div_ceil(rows).max(1);
        (self.last_splits, rows)
    }

    /// Device addresses of the partial outputs and the (max, sum) pairs (after [`Self::ensure`]).
    pub(crate) fn ptrs(&self, dev: &GpuDevice) -> (u64, u64) {
        let s = dev.stream();
        match (&self.o, &self.ml) {
            (Some(o), Some(ml)) => (o.device_ptr(s).0, ml.device_ptr(s).0),
            _ => (0, 0),
        }
    }

    fn smem_optin(&mut self, dev: &GpuDevice) -> Result<usize, GpuError> {
        if let Some(v) = self.smem_optin {
            return Ok(v);
        }
        let v = dev
            .context()
            .attribute(DevAttr::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .map_err(|e| GpuError::driver("cuDeviceGetAttribute", e))?;
        let v = usize::try_from(v).unwrap_or(0).max(DEFAULT_SMEM_LIMIT);
        self.smem_optin = Some(v);
        Ok(v)
    }
}

/// The kernel's argument block (`AttnArgs` in attn_decode.cu; same field order and types).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct AttnArgs {
    k: u64,
    v: u64,
    k_scales: u64,
    v_scales: u64,
    q: u64,
    ws_o: u64,
    ws_ml: u64,
    out: u64,
    t: i32,
    heads: i32,
    kv_heads: i32,
    k_dim: i32,
    v_dim: i32,
    k_row: i32,
    v_row: i32,
    shared_kv: i32,
    group: i32,
    q_start: i32,
    n_splits: i32,
    split_rows: i32,
    ldk: i32,
    ldv: i32,
    vec: i32,
    scale: f32,
    window: i32,
    kv_lo: i32,
    sinks: u64,
}

// SAFETY: plain-old-data with the C layout of the kernel's struct.
unsafe impl DeviceRepr for AttnArgs {}

/// Options of the GQA attention kernels, decode ([`GpuDevice::gqa_decode_attention_with`]) and
/// prefill ([`GpuDevice::flash_prefill_opts`]): gpt-oss's sliding window and attention sinks.
/// The default is plain causal attention.
#[derive(Clone, Copy, Default)]
pub struct AttnOptions<'a> {
    /// `Some(w)`: the query at position `p` sees the keys `p − w < j ≤ p` (`w ≥ 1`).
    pub window: Option<usize>,
    /// One BF16 sink logit per query head: one more softmax column per head, in the units of
    /// the scaled scores, that takes its share of the probability and adds nothing to the output.
    pub sinks: Option<&'a DeviceBuffer<u16>>,
}

impl std::fmt::Debug for AttnOptions<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AttnOptions")
            .field("window", &self.window)
            .field("sinks", &self.sinks.map(|s| s.len()))
            .finish()
    }
}

impl AttnOptions<'_> {
    /// Checks the window and the sinks against `heads` query heads for `op`.
    pub(crate) fn check(&self, op: &'static str, heads: usize) -> Result<(), GpuError> {
        shape(op, self.window != Some(0), || "a sliding window of 0 positions".to_string())?;
        shape(op, self.window.is_none_or(|w| i32::try_from(w).is_ok()), || {
            format!("sliding window {:?} does not fit in i32", self.window)
        })?;
        shape(op, self.sinks.is_none_or(|s| s.len() == heads), || {
            format!("{} sink logits for {heads} query heads", self.sinks.map_or(0, |s| s.len()))
        })
    }

    /// The window as the kernels take it: 0 for none.
    pub(crate) fn window_i32(&self) -> i32 {
        self.window.map_or(0, |w| w as i32)
    }

    /// The first key position a query at position `q_start` sees.
    pub(crate) fn first_visible(&self, q_start: usize) -> usize {
        self.window.map_or(0, |w| (q_start + 1).saturating_sub(w))
    }
}

/// Which attention a call computes.
#[derive(Clone, Copy, Debug)]
enum Kind {
    Mla { latent: usize },
    Gqa { kv_heads: usize, head_dim: usize },
}

/// Elements per staging unit: 16 bytes' worth when every row, slice offset and (FP8) scale
/// group is a multiple of it, else 1 (unaligned shapes take the element-wise path).
fn stage_vec(dtype: KvDtype, row: usize, len: usize, group: usize) -> i32 {
    let v = 16 / dtype.elem_bytes();
    let ok = row.is_multiple_of(v) && len.is_multiple_of(v) && (dtype == KvDtype::Bf16 || group.is_multiple_of(v));
    if ok {
        v as i32
    } else {
        1
    }
}

/// Shared-memory row stride (BF16 elements) for `dim` columns: a multiple of 16 plus 8, so the
/// MMA fragment loads of 8 rows hit 32 distinct banks and rows stay 16-byte aligned.
fn smem_ld(dim: usize) -> usize {
    dim.next_multiple_of(16) + 8
}

/// Dynamic shared memory of one block: scores, softmax state, Q hi/lo, K (and GQA V) tiles (FP8:
/// hi and lo planes), P hi/lo.
fn smem_bytes(dtype: KvDtype, ldk: usize, ldv: Option<usize>) -> usize {
    let planes = if dtype == KvDtype::Fp8 { 2 } else { 1 };
    4 * (2 * ATT_Q * ATT_SLD + 3 * ATT_Q)
        + 2 * (2 * ATT_Q * ldk + planes * ATT_ROWS * (ldk + ldv.unwrap_or(0)) + 2 * ATT_Q * ATT_PLD)
}

pub(crate) fn shape(op: &'static str, ok: bool, detail: impl FnOnce() -> String) -> Result<(), GpuError> {
    if ok {
        Ok(())
    } else {
        Err(GpuError::shape(op, detail()))
    }
}

impl GpuDevice {
    /// MLA absorbed decode attention: `q [t, heads, latent+rope]` f32 (q_lat ‖ q_pe), keys = the
    /// cache rows `[S, latent+rope]` of `layer` (plane 0), values = their first `latent` elements;
    /// `out [t, heads, latent]` f32. Query `i` (position `q_start + i`) sees rows `0..=q_start+i`.
    #[allow(clippy::too_many_arguments)]
    pub fn mla_decode_attention(
        &self,
        cache: &GpuKvCache,
        layer: usize,
        q: &impl DevicePtr<f32>,
        t: usize,
        heads: usize,
        latent: usize,
        q_start: usize,
        scale: f32,
        out: &mut impl DevicePtrMut<f32>,
        ws: &mut DecodeWorkspace,
    ) -> Result<(), GpuError> {
        let opts = AttnOptions::default();
        self.decode_attention(cache, layer, Kind::Mla { latent }, q, t, heads, q_start, scale, out, ws, &opts)
    }

    /// GQA decode attention: `q [t, heads, head_dim]` f32, K = plane 0 and V = plane 1 of `layer`
    /// (`[S, kv_heads, head_dim]` each); `out [t, heads, head_dim]` f32; causal as MLA.
    #[allow(clippy::too_many_arguments)]
    pub fn gqa_decode_attention(
        &self,
        cache: &GpuKvCache,
        layer: usize,
        q: &impl DevicePtr<f32>,
        t: usize,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        q_start: usize,
        scale: f32,
        out: &mut impl DevicePtrMut<f32>,
        ws: &mut DecodeWorkspace,
    ) -> Result<(), GpuError> {
        let opts = AttnOptions::default();
        self.gqa_decode_attention_with(cache, layer, q, t, heads, kv_heads, head_dim, q_start, scale, out, ws, &opts)
    }

    /// [`GpuDevice::gqa_decode_attention`] with a sliding window and attention sinks
    /// ([`AttnOptions`]): query `i` sees rows `max(0, q_start + i + 1 − w) ..= q_start + i`, and
    /// head `h`'s sink logit joins its softmax's denominator.
    #[allow(clippy::too_many_arguments)]
    pub fn gqa_decode_attention_with(
        &self,
        cache: &GpuKvCache,
        layer: usize,
        q: &impl DevicePtr<f32>,
        t: usize,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        q_start: usize,
        scale: f32,
        out: &mut impl DevicePtrMut<f32>,
        ws: &mut DecodeWorkspace,
        opts: &AttnOptions<'_>,
    ) -> Result<(), GpuError> {
        let kind = Kind::Gqa { kv_heads, head_dim };
        self.decode_attention(cache, layer, kind, q, t, heads, q_start, scale, out, ws, opts)
    }

    #[allow(clippy::too_many_arguments)]
    fn decode_attention(
        &self,
        cache: &GpuKvCache,
        layer: usize,
        kind: Kind,
        q: &impl DevicePtr<f32>,
        t: usize,
        heads: usize,
        q_start: usize,
        scale: f32,
        out: &mut impl DevicePtrMut<f32>,
        ws: &mut DecodeWorkspace,
        opts: &AttnOptions<'_>,
    ) -> Result<(), GpuError> {
        const OP: &str = "decode attention";
        opts.check(OP, heads)?;
        let lay = cache.layout();
        shape(OP, lay.dtype != KvDtype::F32, || {
            "an f32 KV cache is read by the prefill form of attention only (flash_prefill_f32), not the decode kernels"
                .to_string()
        })?;
        let row = lay.row;
        let (kv_heads, k_dim, v_dim, shared_kv) = match kind {
            Kind::Mla { latent } => {
                shape(OP, lay.planes == 1, || format!("MLA needs a 1-plane cache, this one has {}", lay.planes))?;
                shape(OP, (1..=MAX_LATENT).contains(&latent) && latent < row && row - latent <= MAX_ROPE, || {
                    format!(
                        "MLA latent {latent} with cache row {row}: need 1 <= latent <= {MAX_LATENT} and \
                         1 <= rope = row - latent <= {MAX_ROPE}"
                    )
                })?;
                (1, row, latent, true)
            }
            Kind::Gqa { kv_heads, head_dim } => {
                shape(OP, lay.planes == 2, || {
                    format!("GQA needs a 2-plane (K, V) cache, this one has {}", lay.planes)
                })?;
                shape(OP, (1..=MAX_HEAD_DIM).contains(&head_dim), || {
                    format!("head_dim {head_dim} outside 1..={MAX_HEAD_DIM}")
                })?;
                shape(OP, kv_heads >= 1 && kv_heads * head_dim == row, || {
                    format!("kv_heads {kv_heads} x head_dim {head_dim} != cache row {row}")
                })?;
                (kv_heads, head_dim, head_dim, false)
            }
        };
        shape(OP, heads >= 1 && heads.is_multiple_of(kv_heads), || {
            format!("heads {heads} must be a positive multiple of kv_heads {kv_heads}")
        })?;
        shape(OP, q.len() == t * heads * k_dim, || format!("q has {} elements, not {t}x{heads}x{k_dim}", q.len()))?;
        shape(OP, out.len() == t * heads * v_dim, || {
            format!("out has {} elements, not {t}x{heads}x{v_dim}", out.len())
        })?;
        shape(OP, q_start.checked_add(t).is_some_and(|e| e <= cache.capacity()), || {
            format!("queries at positions {q_start}..{q_start}+{t} exceed the KV cache capacity {}", cache.capacity())
        })?;
        let (k_base, k_scales) = cache.plane(OP, self, layer, 0)?;
        let (v_base, v_scales) = if shared_kv { (k_base, k_scales) } else { cache.plane(OP, self, layer, 1)? };
        if t == 0 {
            return Ok(());
        }
        let visible = q_start + t;
        let optioned = opts.window.is_some() || opts.sinks.is_some();
        if let Kind::Mla { latent } = kind {
            if t == 1 && lay.dtype == KvDtype::Bf16 && ws.allows_t1() && !optioned {
                if let Some(fname) = crate::mla_decode::t1_kernel(row, latent, visible) {
                    return self.mla_decode_t1(fname, k_base, q, heads, row, latent, visible, scale, out, ws);
                }
            }
        }
        let group_heads = heads / kv_heads;
        let nq = t * group_heads;

        let ldk = smem_ld(k_dim);
        let ldv = if shared_kv { None } else { Some(smem_ld(v_dim)) };
        let limit = ws.smem_optin(self)?;
        let smem = smem_bytes(lay.dtype, ldk, ldv);
        shape(OP, smem <= limit, || {
            format!(
                "k_dim {k_dim} / v_dim {v_dim} need {smem} bytes of shared memory per block, the device allows {limit}"
            )
        })?;
        let qtiles = nq.div_ceil(ATT_Q);
        shape(OP, qtiles <= 65535 && kv_heads <= 65535, || {
            format!("{qtiles} query tiles x {kv_heads} kv heads: grid too large")
        })?;

        // Splits.
        let base = kv_heads * qtiles;
        let sms = usize::try_from(self.info().multiprocessors).unwrap_or(1);
        // The splits cover the rows some query of the call sees: with a window, from the first
        // query's first visible row.
        let kv_lo = opts.first_visible(q_start);
        let rows = visible - kv_lo;
        let (n_splits, split_rows) = ws.plan_splits(rows, decode_split_count(rows, base, sms), ATT_ROWS);
        if n_splits > 1 {
            // Size for the most splits the rule can pick for this configuration (or the forced count).
            let most = ws.force_splits.map_or(most_splits(t, heads, kv_heads, sms), |_| n_splits);
            ws.ensure(self, most.max(n_splits), t * heads, v_dim)?;
        }

        let ntw = v_dim.div_ceil(8 * (ATT_THREADS as usize / 32));
        let ntw = VALUE_TILES.iter().copied().find(|&n| n >= ntw).unwrap_or(16);
        let fname = kernel_name(lay.dtype, ntw);
        let f = self.function(variant_source(fname)?, fname)?;
        if smem > DEFAULT_SMEM_LIMIT && ws.smem_set.get(fname).is_none_or(|&s| s < smem) {
            f.set_attribute(FnAttr::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32)
                .map_err(|e| GpuError::driver("cuFuncSetAttribute", e))?;
            ws.smem_set.insert(fname, smem);
        }

        let s = self.stream();
        let (q_p, _gq) = q.device_ptr(s);
        let (out_p, _go) = out.device_ptr_mut(s);
        let (ws_o, ws_ml) = match (&ws.o, &ws.ml) {
            (Some(o), Some(ml)) if n_splits > 1 => (o.device_ptr(s).0, ml.device_ptr(s).0),
            _ => (0, 0),
        };
        let args = AttnArgs {
            k: k_base,
            v: v_base,
            k_scales,
            v_scales,
            q: q_p,
            ws_o,
            ws_ml,
            out: out_p,
            t: to_i32(OP, "t", t)?,
            heads: to_i32(OP, "heads", heads)?,
            kv_heads: kv_heads as i32,
            k_dim: k_dim as i32,
            v_dim: v_dim as i32,
            k_row: row as i32,
            v_row: row as i32,
            shared_kv: shared_kv as i32,
            group: lay.scale_group as i32,
            q_start: to_i32(OP, "q_start", q_start)?,
            n_splits: n_splits as i32,
            split_rows: to_i32(OP, "split rows", split_rows)?,
            ldk: ldk as i32,
            ldv: ldv.unwrap_or(0) as i32,
            vec: stage_vec(lay.dtype, row, k_dim, lay.scale_group).min(stage_vec(
                lay.dtype,
                row,
                v_dim,
                lay.scale_group,
            )),
            scale,
            window: opts.window_i32(),
            kv_lo: kv_lo as i32,
            sinks: opts.sinks.map_or(0, |b| b.device_ptr(s).0),
        };
        let cfg = LaunchConfig {
            grid_dim: (n_splits as u32, kv_heads as u32, qtiles as u32),
            block_dim: (ATT_THREADS, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let mut b = s.launch_builder(&f);
        b.arg(&args);
        // SAFETY: `args` matches the kernel's struct; every extent was checked above and the
        // workspace holds n_splits x t*heads x (v_dim + 2) floats when n_splits > 1.
        unsafe { b.launch(cfg) }.map_err(|e| GpuError::driver(OP, e))?;

        if n_splits > 1 {
            let sinks = opts.sinks.map_or(0, |b| b.device_ptr(s).0);
            self.combine_splits(ws_o, ws_ml, out_p, t * heads, v_dim, n_splits, (sinks, heads))?;
        }
        Ok(())
    }

    /// Merges `n_splits` partial results of the workspace (`ws_o [n_splits, nq, v_dim]`,
    /// `ws_ml [n_splits, nq, 2]`) into `out [nq, v_dim]` (attn_decode_combine); `sinks`: the
    /// device address of `heads` BF16 sink logits (query `i` is head `i % heads`), or 0.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn combine_splits(
        &self,
        ws_o: u64,
        ws_ml: u64,
        out_p: u64,
        nq: usize,
        v_dim: usize,
        n_splits: usize,
        (sinks, heads): (u64, usize),
    ) -> Result<(), GpuError> {
        const OP: &str = "decode attention combine";
        let f = self.function(&ATTN_DECODE, "attn_decode_combine")?;
        let (nq_total, v_i, n_i) =
            (to_i32(OP, "t*heads", nq)?, to_i32(OP, "v_dim", v_dim)?, to_i32(OP, "splits", n_splits)?);
        let heads_i = to_i32(OP, "heads", heads.max(1))?;
        let mut args = kernel_args![&ws_o, &ws_ml, &out_p, &nq_total, &v_i, &n_i, &sinks, &heads_i];
        let cfg = LaunchConfig {
            grid_dim: (nq as u32, v_dim.div_ceil(COMBINE_COLS) as u32, 1),
            block_dim: (COMBINE_THREADS, 1, 1),
            shared_mem_bytes: ((n_splits + 32).next_multiple_of(4) * 4 + COMBINE_THREADS as usize * 16) as u32,
        };
        // SAFETY: the caller's workspace holds n_splits x nq x (v_dim + 2) floats, all written
        // earlier on this stream; `out` holds nq x v_dim; the kernel waits first.
        unsafe { self.launch_dependent(OP, &f, cfg, &mut args, true) }
    }

    /// MLA weight absorption with `kv_b` BF16 `[heads·(nope+v_dim), latent]` (per head: `nope`
    /// rows of W_UK, then `v_dim` rows of W_UV): `dst[i,h,:latent] = Σ_d q[i,h,d] · W_UK[h][d,:]`
    /// for `q [t, heads, nope+rope]` (q_nope first), and `dst[i,h,latent:] = q_pe`;
    /// `dst [t, heads, latent+rope]` f32.
    #[allow(clippy::too_many_arguments)]
    pub fn mla_absorb_q(
        &self,
        kv_b: &impl DevicePtr<u16>,
        q: &impl DevicePtr<f32>,
        t: usize,
        heads: usize,
        nope: usize,
        rope: usize,
        v_dim: usize,
        latent: usize,
        dst: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), GpuError> {
        const OP: &str = "mla_absorb_q";
        shape(OP, kv_b.len() == heads * (nope + v_dim) * latent, || {
            format!("kv_b has {} elements, not {heads}x({nope}+{v_dim})x{latent}", kv_b.len())
        })?;
        shape(OP, q.len() == t * heads * (nope + rope), || {
            format!("q has {} elements, not {t}x{heads}x({nope}+{rope})", q.len())
        })?;
        shape(OP, dst.len() == t * heads * (latent + rope), || {
            format!("dst has {} elements, not {t}x{heads}x({latent}+{rope})", dst.len())
        })?;
        shape(OP, nope <= 8192 && t <= 65535 && heads <= 65535, || {
            format!("nope {nope} (max 8192), t {t} or heads {heads} (max 65535) too large")
        })?;
        if t == 0 || heads == 0 || latent + rope == 0 {
            return Ok(());
        }
        let s = self.stream();
        let (w_p, _g1) = kv_b.device_ptr(s);
        let (q_p, _g2) = q.device_ptr(s);
        let (d_p, _g3) = dst.device_ptr_mut(s);
        let [t_i, h_i, n_i, r_i, v_i, l_i] = [t, heads, nope, rope, v_dim, latent].map(|v| v as i32);
        let f = self.function(&ATTN_DECODE, "mla_absorb_q")?;
        let mut args = kernel_args![&w_p, &q_p, &d_p, &t_i, &h_i, &n_i, &r_i, &v_i, &l_i];
        let cfg = LaunchConfig {
            grid_dim: (latent.max(1).div_ceil(ABSORB_COLS) as u32, heads as u32, t.div_ceil(ABSORB_TOK_TILE) as u32),
            block_dim: (ABSORB_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: arguments match the kernel; sizes checked above; the kernel waits first.
        unsafe { self.launch_dependent(OP, &f, cfg, &mut args, true) }
    }

    /// `out[i,h,j] = Σ_l W_UV[h][j,l] · o_lat[i,h,l]` with W_UV the last `v_dim` rows of each
    /// head's block of `kv_b` (see [`GpuDevice::mla_absorb_q`]); `o_lat [t, heads, latent]`,
    /// `out [t, heads, v_dim]` f32.
    #[allow(clippy::too_many_arguments)]
    pub fn mla_apply_uv(
        &self,
        kv_b: &impl DevicePtr<u16>,
        o_lat: &impl DevicePtr<f32>,
        t: usize,
        heads: usize,
        nope: usize,
        v_dim: usize,
        latent: usize,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), GpuError> {
        const OP: &str = "mla_apply_uv";
        shape(OP, kv_b.len() == heads * (nope + v_dim) * latent, || {
            format!("kv_b has {} elements, not {heads}x({nope}+{v_dim})x{latent}", kv_b.len())
        })?;
        shape(OP, o_lat.len() == t * heads * latent, || {
            format!("o_lat has {} elements, not {t}x{heads}x{latent}", o_lat.len())
        })?;
        shape(OP, out.len() == t * heads * v_dim, || {
            format!("out has {} elements, not {t}x{heads}x{v_dim}", out.len())
        })?;
        let total = t * heads * v_dim;
        if total == 0 {
            return Ok(());
        }
        let warps = (UV_THREADS / 32) as usize;
        let blocks = to_i32(OP, "blocks", total.div_ceil(warps))?;
        let s = self.stream();
        let (w_p, _g1) = kv_b.device_ptr(s);
        let (o_p, _g2) = o_lat.device_ptr(s);
        let (d_p, _g3) = out.device_ptr_mut(s);
        let (t_i, h_i, n_i, v_i, l_i) = (
            to_i32(OP, "t", t)?,
            to_i32(OP, "heads", heads)?,
            nope as i32,
            v_dim as i32,
            to_i32(OP, "latent", latent)?,
        );
        let f = self.function(&ATTN_DECODE, "mla_apply_uv")?;
        let mut args = kernel_args![&w_p, &o_p, &d_p, &t_i, &h_i, &n_i, &v_i, &l_i];
        let cfg = LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (UV_THREADS, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: arguments match the kernel; sizes checked above; the kernel waits first.
        unsafe { self.launch_dependent(OP, &f, cfg, &mut args, true) }
    }
}

/// The decode kernel of a `dtype` cache with `ntw` value tiles per warp ("" for an f32 cache,
/// which [`GpuDevice::decode_attention`] refuses before it asks).
fn kernel_name(dtype: KvDtype, ntw: usize) -> &'static str {
    match (dtype, ntw) {
        (KvDtype::F32, _) => "",
        (KvDtype::Bf16, 2) => "attn_decode_bf16_n2",
        (KvDtype::Bf16, 4) => "attn_decode_bf16_n4",
        (KvDtype::Bf16, 8) => "attn_decode_bf16_n8",
        (KvDtype::Bf16, _) => "attn_decode_bf16_n16",
        (KvDtype::Fp8, 2) => "attn_decode_fp8_n2",
        (KvDtype::Fp8, 4) => "attn_decode_fp8_n4",
        (KvDtype::Fp8, 8) => "attn_decode_fp8_n8",
        (KvDtype::Fp8, _) => "attn_decode_fp8_n16",
    }
}

/// One timing of [`bench_mla_decode`].
#[derive(Clone, Copy, Debug)]
pub struct DecodeTiming {
    /// Attention calls (layers) per timed step.
    pub layers: usize,
    /// Seconds per attention call (one layer; combine included).
    pub seconds_per_call: f64,
    /// KV-cache bytes one call reads (codes and scales).
    pub kv_bytes_per_call: u64,
    /// `kv_bytes_per_call / seconds_per_call`, in GB/s (10^9).
    pub gb_per_s: f64,
}

/// [`bench_mla_decode`]'s result: one layer repeated, and [`BENCH_LAYERS`] layers' caches in
/// sequence per step (the decode pattern; it keeps launch gaps from hiding the bandwidth).
#[derive(Clone, Copy, Debug)]
pub struct DecodeBench {
    pub context: usize,
    pub dtype: KvDtype,
    pub splits: usize,
    pub one_layer: DecodeTiming,
    pub many_layers: DecodeTiming,
}

/// Layers of the many-layer variant: DeepSeek-V2-Lite has 27.
pub const BENCH_LAYERS: usize = 27;

/// Times V2-Lite-shaped MLA decode attention (16 heads, latent 512, rope 64, t = 1) over
/// `context` cached tokens with CUDA events, `iters` timed repetitions after one warm-up.
pub fn bench_mla_decode(
    dev: &GpuDevice,
    context: usize,
    dtype: KvDtype,
    iters: usize,
) -> Result<DecodeBench, GpuError> {
    bench_mla_decode_kernel(dev, context, dtype, iters, None, false)
}

/// [`bench_mla_decode`] with the split count forced (`None`: the rule) and, with `general`, the
/// general tensor-core kernel where the one-token kernel of [`crate::mla_decode`] would run: the
/// rule against its alternatives, one kernel against the other.
pub fn bench_mla_decode_kernel(
    dev: &GpuDevice,
    context: usize,
    dtype: KvDtype,
    iters: usize,
    splits: Option<usize>,
    general: bool,
) -> Result<DecodeBench, GpuError> {
    const OP: &str = "bench_mla_decode";
    const HEADS: usize = 16;
    const LATENT: usize = 512;
    const ROPE: usize = 64;
    if context == 0 || iters == 0 {
        return Err(GpuError::shape(OP, "context and iters must be positive"));
    }
    let row = LATENT + ROPE;
    let cache = GpuKvCache::new(dev, dtype, BENCH_LAYERS, 1, row, ROPE, KvCapacity::Tokens(context))?;
    // Fill every layer with deterministic pseudo-random rows (chunked, to bound host memory).
    let chunk = 1024.min(context);
    let mut host = vec![0f32; chunk * row];
    let mut x = 0x9e37_79b9u32;
    for layer in 0..BENCH_LAYERS {
        let mut pos = 0;
        while pos < context {
            let n = chunk.min(context - pos);
            for v in host[..n * row].iter_mut() {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                *v = (x as f32 / u32::MAX as f32) * 2.0 - 1.0;
            }
            let src = dev.upload(&host[..n * row], "bench KV rows")?;
            cache.write(dev, layer, 0, pos, n, &src)?;
            pos += n;
        }
    }
    let qh: Vec<f32> = (0..HEADS * row).map(|i| ((i * 37 % 101) as f32 / 101.0) - 0.5).collect();
    let q = dev.upload(&qh, "bench q")?;
    let mut out = dev.alloc_zeros::<f32>(HEADS * LATENT, "bench out")?;
    let mut ws = DecodeWorkspace::new();
    ws.force_splits(splits);
    ws.force_general(general);
    let scale = 1.0 / ((128 + ROPE) as f32).sqrt();
    let q_start = context - 1;
    let kv_bytes = (context * (row * dtype.elem_bytes() + cache.layout().groups_per_row() * 4)) as u64;
    let mut run = |layers: usize| -> Result<DecodeTiming, GpuError> {
        let step = |ws: &mut DecodeWorkspace, out: &mut DeviceBuffer<f32>| -> Result<(), GpuError> {
            for l in 0..layers {
                dev.mla_decode_attention(&cache, l, &q, 1, HEADS, LATENT, q_start, scale, out, ws)?;
            }
            Ok(())
        };
        step(&mut ws, &mut out)?;
        let (e0, e1) = (dev.new_event(true)?, dev.new_event(true)?);
        e0.record(dev.stream()).map_err(|e| GpuError::driver("cuEventRecord", e))?;
        for _ in 0..iters {
            step(&mut ws, &mut out)?;
        }
        e1.record(dev.stream()).map_err(|e| GpuError::driver("cuEventRecord", e))?;
        let ms = e0.elapsed_ms(&e1).map_err(|e| GpuError::driver("cuEventElapsedTime", e))?;
        let seconds_per_call = ms as f64 / 1e3 / (iters * layers) as f64;
        Ok(DecodeTiming {
            layers,
            seconds_per_call,
            kv_bytes_per_call: kv_bytes,
            gb_per_s: kv_bytes as f64 / seconds_per_call / 1e9,
        })
    };
    let one_layer = run(1)?;
    let many_layers = run(BENCH_LAYERS)?;
    let out_h = dev.download(&out)?;
    if out_h.iter().any(|v| !v.is_finite()) {
        return Err(GpuError::shape(OP, "the benchmark produced non-finite outputs"));
    }
    Ok(DecodeBench { context, dtype, splits: ws.last_splits(), one_layer, many_layers })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_start_skips_only_the_other_kv_dtypes_attention_programs() {
        for kv in [KvDtype::Bf16, KvDtype::Fp8] {
            let skipped: Vec<&str> = crate::kernels::ALL
                .iter()
                .filter(|k| attention_variant_of_other_dtype(k, kv))
                .map(|k| k.name)
                .collect();
            let other = if kv == KvDtype::Bf16 { KvDtype::Fp8 } else { KvDtype::Bf16 };
            let want: Vec<&str> = VALUE_TILES.iter().map(|&n| kernel_name(other, n)).collect();
            assert_eq!(skipped, want, "{kv:?}");
        }
        // Every variant the launcher can name has a program.
        for kv in [KvDtype::Bf16, KvDtype::Fp8] {
            for n in VALUE_TILES {
                assert!(variant_source(kernel_name(kv, n)).is_ok());
            }
        }
    }

    #[test]
    fn split_rule() {
        // V2-Lite, one query tile, 132 SMs: 4K context → 128 one-tile splits; long contexts cap at
        // MAX_SPLITS; short ones never go below MIN_ROWS_PER_SPLIT rows per split.
        assert_eq!(decode_split_count(4096, 1, 132), 128);
        assert_eq!(decode_split_count(100_000, 1, 132), 256);
        assert_eq!(decode_split_count(1, 1, 132), 1);
        assert_eq!(decode_split_count(32, 1, 132), 1);
        assert_eq!(decode_split_count(33, 1, 132), 2);
        // Qwen3 GQA: 4 kv heads → fewer splits needed to fill the device.
        assert_eq!(decode_split_count(100_000, 4, 132), 66);
        // Degenerate inputs stay in range.
        assert_eq!(decode_split_count(0, 0, 0), 1);
        assert!(decode_split_count(usize::MAX, 1, 10_000) <= MAX_SPLITS);
    }

    #[test]
    fn staging_vector_widths() {
        assert_eq!(stage_vec(KvDtype::Bf16, 576, 576, 576), 8);
        assert_eq!(stage_vec(KvDtype::Fp8, 576, 576, 64), 16);
        assert_eq!(stage_vec(KvDtype::Fp8, 512, 128, 128), 16);
        assert_eq!(stage_vec(KvDtype::Fp8, 72, 24, 24), 1);
        assert_eq!(stage_vec(KvDtype::Fp8, 576, 576, 8), 1);
        assert_eq!(stage_vec(KvDtype::Bf16, 72, 24, 72), 8);
        assert_eq!(stage_vec(KvDtype::Bf16, 40, 40, 40), 8);
        assert_eq!(stage_vec(KvDtype::Bf16, 42, 42, 42), 1);
        assert_eq!(stage_vec(KvDtype::Bf16, 21, 7, 21), 1);
    }

    #[test]
    fn shared_memory_of_the_v2_lite_configuration() {
        // 576 columns → row stride 584; BF16: scores + state + Q hi/lo + one K tile + P hi/lo.
        assert_eq!(smem_ld(576), 584);
        assert_eq!(smem_ld(7), 24);
        let bf16 = smem_bytes(KvDtype::Bf16, 584, None);
        assert_eq!(bf16, 4 * (2 * 16 * 36 + 48) + 2 * (2 * 16 * 584 + 32 * 584 + 2 * 16 * 40));
        // Two BF16 blocks fit an H100/H200 SM (228 KB); FP8 (hi/lo K planes) fits one block.
        assert!(2 * bf16 < 227 * 1024);
        assert!(smem_bytes(KvDtype::Fp8, 584, None) < 227 * 1024);
    }
}
