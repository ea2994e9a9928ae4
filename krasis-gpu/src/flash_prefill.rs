//! Causal flash-style prefill attention on the GPU: MLA with the latent expanded to per-head K/V
//! (a two-part query/key: nope part `a` per head, rope part `b` whose key is shared by all heads)
//! and GQA (part `a` only). Online softmax in f32 over key tiles, so memory is O(T): nothing of
//! size T² is ever stored, and no workspace is allocated.
//!
//! # Kernels and the rule that picks one ([`GpuDevice::flash_prefill_kernel`])
//!
//! - [`FlashKernel::Wgmma`]: the fixed-dims mathematics on Hopper's asynchronous warpgroup MMAs
//!   (`wgmma`, built only when kernels target `sm_90a`): two warpgroups of 64 query rows per
//!   128-query block taking the tensor cores in turn, K/V in wgmma's 128-byte swizzle through a
//!   `cp.async` pipeline (tile sizes per shape in `WGMMA_TILES`). Same shapes, alignment and
//!   scale rules as `MmaFixed`.
//! - [`FlashKernel::MmaFixed`]: the same mathematics as `Mma` with the head dims fixed at compile
//!   time ([`FIXED_SHAPES`]: MLA 128+64 / 128, GQA 128 / 128; smaller multiples of 8 are
//!   zero-filled): 128-query × 64-key tiles on 8 warps, a three-stage `cp.async` K/V pipeline with
//!   one barrier per key tile, fragments through `ldmatrix`, the scale folded into the exp2.
//!   Needs 16-byte-aligned inputs, an 8-byte-aligned output and a positive scale.
//! - [`FlashKernel::Mma`]: tensor cores (`mma.sync m16n8k16` BF16 → f32), FlashAttention-2 style,
//!   64-query × 64-key tiles, dims zero-padded to 16 in shared memory (ragged dims work), K/V tiles
//!   double-buffered (`cp.async` for 16-byte-aligned tensors, plain loads otherwise). P is rounded
//!   to BF16 before the P·V product (hence its looser tolerance).
//! - [`FlashKernel::Simt`]: plain f32 CUDA cores, one warp per (query, head); slow, exact up to
//!   f32 rounding; the correctness fallback. It alone also takes f32 q, k and v
//!   ([`GpuDevice::flash_prefill_f32`], the precise GPU mode: nothing rounded to BF16).
//!
//! Rule: **Wgmma** when the kernels target `sm_90a` and MmaFixed could run; else **MmaFixed** when
//! `Mma` could run, the shapes fit one of [`FIXED_SHAPES`] (every dim a multiple of 8, part b
//! present iff the entry has one), its shared memory fits, and every buffer is aligned as above
//! ([`GpuDevice::flash_prefill_kernel`] assumes aligned buffers, as allocations are;
//! [`GpuDevice::flash_prefill`] checks the pointers and takes **Mma** when one is not). Otherwise
//! **Mma** when the GPU is sm_80 or newer, the scale is positive (both MMA kernels fold it into the
//! exp2), `pad16(dim_a) + pad16(dim_b) ≤ 256`, `pad16(dim_v) ≤ 128`, and the two K/V tile buffers
//! fit the device's opt-in shared memory per block; otherwise **Simt**. (V2-Lite: 128+64 / 128 and
//! Qwen3: 128 / 128 both take Wgmma on sm_90, MmaFixed on sm_80/sm_89.) Every part dim may be
//! 1..=[`MAX_PART_DIM`]; the SIMT kernel covers all of them. `KRASIS_FLASH_KERNEL=simt|mma|fixed`
//! caps the choice (measurements of the slower kernels inside a model; the kernel tests expect it
//! unset).
//!
//! # Options
//!
//! [`GpuDevice::flash_prefill_opts`] takes [`AttnOptions`] (gpt-oss): a sliding window (keys
//! before a query's window are masked like those past its diagonal; a block starts at the key
//! tile of its first query's window, and a warp skips the products of a later tile none of its
//! rows sees) and one sink logit per head (one more softmax column in the denominator). Every
//! kernel takes them.

use cudarc::driver::sys::{CUdevice_attribute_enum, CUfunction_attribute_enum};
use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use crate::attn_decode::AttnOptions;
use crate::kernels::{KernelSource, DEFAULT_SMEM_LIMIT, HEADERS};
use crate::nvrtc::Target;
use crate::{GpuDevice, GpuError};

pub const FLASH_PREFILL: KernelSource = KernelSource {
    name: "flash_prefill",
    src: include_str!("../kernels/flash_prefill.cu"),
    headers: HEADERS,
    options: &[],
    functions: &[
        "flash_prefill_simt",
        "flash_prefill_simt_f32",
        "flash_prefill_mma",
        "flash_prefill_fixed_128_64_128",
        "flash_prefill_fixed_128_0_128",
    ],
};

/// The wgmma kernels (sm_90a): a program of their own (the same file), compiled in parallel with
/// [`FLASH_PREFILL`] (one program of all six took 4.6 s of a fresh H200 machine's cold start).
pub const FLASH_PREFILL_WGMMA: KernelSource = KernelSource {
    name: "flash_prefill_wgmma",
    src: include_str!("../kernels/flash_prefill.cu"),
    headers: HEADERS,
    options: &["-DFLASH_WGMMA"],
    functions: &["flash_prefill_wgmma_128_64_128", "flash_prefill_wgmma_128_0_128"],
};

/// Head dims `(a, b, v)` the fixed-dims kernel is compiled for (mirrors the `FLASH_FIXED_ENTRY`
/// lines of the kernel source; each has a kernel `flash_prefill_fixed_{a}_{b}_{v}`).
pub const FIXED_SHAPES: [(usize, usize, usize); 2] = [(128, 64, 128), (128, 0, 128)];
/// The kernel of each [`FIXED_SHAPES`] entry.
const FIXED_FUNCTIONS: [&str; 2] = ["flash_prefill_fixed_128_64_128", "flash_prefill_fixed_128_0_128"];
/// The wgmma kernel of each [`FIXED_SHAPES`] entry (same shapes, `v` = 128 only).
const WGMMA_FUNCTIONS: [&str; 2] = ["flash_prefill_wgmma_128_64_128", "flash_prefill_wgmma_128_0_128"];
/// Query rows per wgmma block (2 warpgroups × 64 rows; mirrors `WG_BQ`).
const WGMMA_BQ: usize = 128;
/// Threads per wgmma block (mirrors `WG_THREADS`).
const WGMMA_THREADS: u32 = 256;
/// (keys per tile, K/V stages, Q in shared memory) of each [`FIXED_SHAPES`] entry's wgmma kernel (mirrors the
/// `FLASH_WGMMA_ENTRY` lines): MLA 64-key tiles in 4 stages (128-key ones take 80 KiB a stage),
/// GQA 128-key tiles in 3 with Q in shared memory (the wider S product runs nearer the tensor
/// cores' peak).
const WGMMA_TILES: [(usize, usize, bool); 2] = [(64, 4, false), (128, 3, true)];
/// Query rows per fixed-dims block (8 warps × 16 rows; mirrors `FIX_BQ`).
const FIXED_BQ: usize = 128;
// The two kernels share the launch grid.
const _: () = assert!(WGMMA_BQ == FIXED_BQ);
/// Threads per fixed-dims block (mirrors `FIX_THREADS`).
const FIXED_THREADS: u32 = 256;
/// K/V stages in flight (mirrors `FIX_STAGES`): three let one barrier per tile order the reuse.
const FIXED_STAGES: usize = 3;

/// Largest dim of each part (a, b, v): the SIMT kernel keeps 256/32 = 8 values per lane.
pub const MAX_PART_DIM: usize = 256;
/// Largest padded q·k dim (`pad16(a) + pad16(b)`) of the MMA kernel: its Q fragments live in 64
/// registers per thread.
pub const MMA_MAX_QK: usize = 256;
/// Largest padded v dim of the MMA kernel: its O accumulator lives in 64 registers per thread.
pub const MMA_MAX_V: usize = 128;
/// BF16 `mma.sync` and `cp.async` need Ampere or newer.
pub const MMA_MIN_ARCH: i32 = 80;

/// Query rows per MMA block (4 warps × 16 rows) = keys per tile (mirrors `MMA_BQ`/`MMA_BK`).
const MMA_TILE: usize = 64;
/// Threads per block of both kernels.
const THREADS: u32 = 128;
/// Queries per SIMT block: one warp each (mirrors `SIMT_WARPS`).
const SIMT_WARPS: usize = 4;
/// Shared-memory row padding in elements (mirrors `MMA_ROW_PAD`; avoids bank conflicts).
const MMA_ROW_PAD: usize = 8;
/// CUDA's grid y limit (heads are the grid's y).
const MAX_GRID_Y: usize = 65_535;

/// Strided view of a BF16 `[tokens, heads, dim]` tensor (strides in elements); `head_stride` may
/// be 0 (one vector shared by all heads, e.g. MLA's rope key).
#[derive(Clone, Copy, Debug)]
pub struct HeadsLayout {
    pub token_stride: usize,
    pub head_stride: usize,
    pub dim: usize,
}

impl HeadsLayout {
    /// Contiguous `[tokens, heads, dim]`.
    pub fn contiguous(heads: usize, dim: usize) -> Self {
        HeadsLayout { token_stride: heads * dim, head_stride: dim, dim }
    }

    /// One `[tokens, dim]` vector per token shared by every head (`head_stride = 0`).
    pub fn shared(dim: usize) -> Self {
        HeadsLayout { token_stride: dim, head_stride: 0, dim }
    }

    /// The unused part (`dim = 0`).
    pub fn none() -> Self {
        HeadsLayout { token_stride: 0, head_stride: 0, dim: 0 }
    }

    /// One past the last element touched by `tokens` × `heads`; `None` on overflow.
    fn extent(&self, tokens: usize, heads: usize) -> Option<usize> {
        if tokens == 0 || heads == 0 || self.dim == 0 {
            return Some(0);
        }
        (tokens - 1)
            .checked_mul(self.token_stride)?
            .checked_add((heads - 1).checked_mul(self.head_stride)?)?
            .checked_add(self.dim)
    }

    /// Whether distinct (token, head) rows never share an element (needed for an output).
    fn disjoint(&self, tokens: usize, heads: usize) -> bool {
        let (mut small, mut n_small, mut big, mut n_big) = (self.head_stride, heads, self.token_stride, tokens);
        if small > big {
            std::mem::swap(&mut small, &mut big);
            std::mem::swap(&mut n_small, &mut n_big);
        }
        let inner_ok = n_small <= 1 || small >= self.dim;
        let span = (n_small.max(1) - 1).saturating_mul(small).saturating_add(self.dim);
        inner_ok && (n_big <= 1 || big >= span)
    }

    /// Whether 16-byte chunks of this view starting at `ptr` are aligned (the `cp.async` path).
    fn vec16(&self, ptr: u64) -> bool {
        ptr.is_multiple_of(16)
            && self.dim.is_multiple_of(8)
            && self.token_stride.is_multiple_of(8)
            && self.head_stride.is_multiple_of(8)
    }
}

/// The element type of a prefill's q, k and v: BF16 bits (`u16`, every kernel) or f32 (the SIMT
/// kernel only: the precise GPU mode).
pub trait FlashInput: cudarc::driver::DeviceRepr + private::Sealed {
    /// The SIMT kernel over this type.
    const SIMT_KERNEL: &'static str;
    /// Whether only the SIMT kernel takes it.
    const SIMT_ONLY: bool;
}

impl FlashInput for u16 {
    const SIMT_KERNEL: &'static str = "flash_prefill_simt";
    const SIMT_ONLY: bool = false;
}

impl FlashInput for f32 {
    const SIMT_KERNEL: &'static str = "flash_prefill_simt_f32";
    const SIMT_ONLY: bool = true;
}

mod private {
    pub trait Sealed {}
    impl Sealed for u16 {}
    impl Sealed for f32 {}
}

/// Shapes of one [`GpuDevice::flash_prefill`] call.
#[derive(Clone, Copy, Debug)]
pub struct FlashPrefillArgs {
    /// T query tokens.
    pub n_q: usize,
    /// S key/value tokens, `S ≥ q_start + T`.
    pub n_kv: usize,
    /// Position of query 0: query `i` attends to keys `0..=q_start + i`.
    pub q_start: usize,
    pub heads: usize,
    /// `heads % kv_heads == 0`; query head `h` uses kv head `h / (heads / kv_heads)`.
    pub kv_heads: usize,
    pub scale: f32,
    pub q_a: HeadsLayout,
    /// `dim = 0`: unused (then pass `None` for both `q_b` and `k_b`).
    pub q_b: HeadsLayout,
    pub k_a: HeadsLayout,
    pub k_b: HeadsLayout,
    pub v: HeadsLayout,
    /// f32 output `[T, heads, v.dim]`-like.
    pub out: HeadsLayout,
}

/// Dynamic shared memory of the wgmma kernel of [`FIXED_SHAPES`] entry `entry` `(fa, fb, fv)`,
/// `(bk, stages)` from [`WGMMA_TILES`]: 1 KiB to align the swizzled tiles, Q `[128][fa+fb]` and
/// `stages` × (K `[bk][fa+fb]` + V `[bk][fv]`), BF16, unpadded.
fn wgmma_smem_bytes(entry: usize) -> usize {
    let ((fa, fb, fv), (bk, stages, _)) = (FIXED_SHAPES[entry], WGMMA_TILES[entry]);
    1024 + (WGMMA_BQ * (fa + fb) + stages * bk * (fa + fb + fv)) * 2
}

/// The [`FIXED_SHAPES`] entry `a` runs on (the fixed-dims and wgmma kernels alike).
fn fixed_entry(a: &FlashPrefillArgs) -> Result<usize, String> {
    let shape = fixed_shape(a)?;
    Ok(FIXED_SHAPES.iter().position(|&e| e == shape).expect("fixed_shape returns an entry"))
}

/// Why the wgmma kernel cannot run `a` (buffers assumed aligned) with kernels built for `target`;
/// `None` when it can: the fixed-dims kernel's rules (smaller dims zero-filled to an entry) and
/// SASS for sm_90 with its architecture-specific features.
fn wgmma_unsupported(a: &FlashPrefillArgs, target: Target, smem_optin: usize) -> Option<String> {
    if !target.arch_specific() {
        return Some(format!("kernels are built for {target}, wgmma needs sm_90a"));
    }
    if let Some(why) = fixed_unsupported(a, target.arch, smem_optin) {
        return Some(why);
    }
    let smem = wgmma_smem_bytes(fixed_entry(a).ok()?);
    (smem > smem_optin).then(|| format!("needs {smem} bytes of shared memory, the device allows {smem_optin}"))
}

/// Which prefill kernel runs (ordered slowest first).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum FlashKernel {
    /// f32 CUDA cores, any supported dims, any architecture (the fallback).
    Simt,
    /// BF16 tensor cores (sm_80+), padded qk ≤ 256 and padded v ≤ 128.
    Mma,
    /// BF16 tensor cores with the head dims fixed at compile time ([`FIXED_SHAPES`]).
    MmaFixed,
    /// The fixed-dims mathematics on Hopper's warpgroup MMAs (`wgmma`, sm_90a).
    Wgmma,
}

impl std::fmt::Display for FlashKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            FlashKernel::Simt => "simt",
            FlashKernel::Mma => "mma-bf16",
            FlashKernel::MmaFixed => "mma-bf16-fixed",
            FlashKernel::Wgmma => "wgmma-bf16",
        })
    }
}

fn pad16(d: usize) -> usize {
    d.div_ceil(16) * 16
}

/// Dynamic shared memory of the MMA kernel: two buffers of K `[64][qk + 8]` and V `[64][v + 8]`
/// BF16 (Q is staged through one of them).
fn mma_smem_bytes(a: &FlashPrefillArgs) -> usize {
    let ldk = pad16(a.q_a.dim) + pad16(a.q_b.dim) + MMA_ROW_PAD;
    let ldv = pad16(a.v.dim) + MMA_ROW_PAD;
    2 * MMA_TILE * (ldk + ldv) * 2
}

/// Why the MMA kernel cannot run these shapes on a device with compute capability `arch` and
/// `smem_optin` bytes of opt-in shared memory per block; `None` when it can.
fn mma_unsupported(a: &FlashPrefillArgs, arch: i32, smem_optin: usize) -> Option<String> {
    let qk = pad16(a.q_a.dim) + pad16(a.q_b.dim);
    if arch < MMA_MIN_ARCH {
        Some(format!("sm_{arch} has no BF16 mma.sync (needs sm_{MMA_MIN_ARCH}+)"))
    } else if a.scale.is_nan() || a.scale <= 0.0 {
        Some(format!("scale {} is not positive", a.scale))
    } else if qk > MMA_MAX_QK {
        Some(format!("padded q.k dim {qk} > {MMA_MAX_QK}"))
    } else if pad16(a.v.dim) > MMA_MAX_V {
        Some(format!("padded v dim {} > {MMA_MAX_V}", pad16(a.v.dim)))
    } else if mma_smem_bytes(a) > smem_optin {
        Some(format!("needs {} bytes of shared memory, the device allows {smem_optin}", mma_smem_bytes(a)))
    } else {
        None
    }
}

/// The [`FIXED_SHAPES`] entry the fixed-dims kernel uses for `a`, or why none fits.
fn fixed_shape(a: &FlashPrefillArgs) -> Result<(usize, usize, usize), String> {
    let (da, db, dv) = (a.q_a.dim, a.q_b.dim, a.v.dim);
    if [da, db, dv].iter().any(|d| d % 8 != 0) {
        return Err(format!("dims {da}+{db} / {dv} are not all multiples of 8"));
    }
    FIXED_SHAPES
        .iter()
        .copied()
        .find(|&(fa, fb, fv)| da <= fa && db <= fb && (db == 0) == (fb == 0) && dv <= fv)
        .ok_or_else(|| format!("no compiled shape holds dims {da}+{db} / {dv} (compiled: {FIXED_SHAPES:?})"))
}

/// Dynamic shared memory of the fixed-dims kernel for entry `(fa, fb, fv)`: Q `[128][fa+fb+8]`
/// and three stages of K `[64][fa+fb+8]` + V `[64][fv+8]`, BF16.
fn fixed_smem_bytes((fa, fb, fv): (usize, usize, usize)) -> usize {
    let (ldk, ldv) = (fa + fb + MMA_ROW_PAD, fv + MMA_ROW_PAD);
    (FIXED_BQ * ldk + FIXED_STAGES * MMA_TILE * (ldk + ldv)) * 2
}

/// Why the fixed-dims kernel cannot run `a` (buffers assumed aligned); `None` when it can.
fn fixed_unsupported(a: &FlashPrefillArgs, arch: i32, smem_optin: usize) -> Option<String> {
    let shape = match fixed_shape(a) {
        Ok(s) => s,
        Err(why) => return Some(why),
    };
    if let Some(why) = mma_unsupported(a, arch, smem_optin) {
        Some(why)
    } else if fixed_smem_bytes(shape) > smem_optin {
        Some(format!("needs {} bytes of shared memory, the device allows {smem_optin}", fixed_smem_bytes(shape)))
    } else if a.n_q.div_ceil(FIXED_BQ) > MAX_GRID_Y {
        Some(format!("{} query tiles > {MAX_GRID_Y}", a.n_q.div_ceil(FIXED_BQ)))
    } else {
        None
    }
}

/// Whether the output view at `ptr` takes the fixed-dims kernel's 8-byte stores.
fn out_vec8(l: &HeadsLayout, ptr: u64) -> bool {
    ptr.is_multiple_of(8) && l.token_stride.is_multiple_of(2) && l.head_stride.is_multiple_of(2)
}

/// The tensors whose pointer or strides the fixed-dims kernel cannot take (inputs in 16-byte
/// chunks, the output in 8-byte stores), given the pointers of q_a, q_b, k_a, k_b, v, out; part b
/// counts only when `has_b`.
fn fixed_misaligned(a: &FlashPrefillArgs, [qa, qb, ka, kb, v, o]: [u64; 6], has_b: bool) -> Vec<&'static str> {
    [
        ("q_a", a.q_a.vec16(qa)),
        ("q_b", !has_b || a.q_b.vec16(qb)),
        ("k_a", a.k_a.vec16(ka)),
        ("k_b", !has_b || a.k_b.vec16(kb)),
        ("v", a.v.vec16(v)),
        ("out", out_vec8(&a.out, o)),
    ]
    .into_iter()
    .filter_map(|(name, ok)| (!ok).then_some(name))
    .collect()
}

const OP: &str = "flash_prefill";

/// `KRASIS_FLASH_KERNEL=simt|mma|fixed` caps the automatic choice at that kernel (to measure or
/// test the slower ones inside a whole model); unset, empty or unknown: no cap. Read once.
fn kernel_cap_from_env() -> FlashKernel {
    use krasis_core::knobs::FlashKernelCap;
    match krasis_core::knobs::knobs().flash_kernel {
        Some(FlashKernelCap::Simt) => FlashKernel::Simt,
        Some(FlashKernelCap::Mma) => FlashKernel::Mma,
        Some(FlashKernelCap::MmaFixed) => FlashKernel::MmaFixed,
        None => FlashKernel::Wgmma,
    }
}

fn check(ok: bool, detail: impl FnOnce() -> String) -> Result<(), GpuError> {
    if ok {
        Ok(())
    } else {
        Err(GpuError::shape(OP, detail()))
    }
}

fn i32_of(what: &str, v: usize) -> Result<i32, GpuError> {
    crate::kernels::to_i32(OP, what, v)
}

fn i64_of(what: &str, v: usize) -> Result<i64, GpuError> {
    i64::try_from(v).map_err(|_| GpuError::shape(OP, format!("{what} = {v} does not fit in i64")))
}

/// `layout` over `tokens` × `heads` fits in `len` elements.
fn check_extent(name: &str, l: &HeadsLayout, tokens: usize, heads: usize, len: usize) -> Result<(), GpuError> {
    match l.extent(tokens, heads) {
        Some(e) if e <= len => Ok(()),
        Some(e) => Err(GpuError::shape(
            OP,
            format!("{name} {l:?} over {tokens} tokens x {heads} heads reaches element {e}, buffer has {len}"),
        )),
        None => Err(GpuError::shape(OP, format!("{name} {l:?} over {tokens} tokens x {heads} heads overflows"))),
    }
}

/// Every shape rule that does not depend on the buffers.
fn validate_shapes(a: &FlashPrefillArgs, has_q_b: bool, has_k_b: bool) -> Result<(), GpuError> {
    check(a.heads >= 1 && a.kv_heads >= 1, || format!("heads {} and kv_heads {} must be >= 1", a.heads, a.kv_heads))?;
    check(a.heads.is_multiple_of(a.kv_heads), || {
        format!("heads {} is not a multiple of kv_heads {}", a.heads, a.kv_heads)
    })?;
    check(a.heads <= MAX_GRID_Y, || format!("heads {} > {MAX_GRID_Y}", a.heads))?;
    check(a.q_a.dim == a.k_a.dim && (1..=MAX_PART_DIM).contains(&a.q_a.dim), || {
        format!("q_a.dim {} and k_a.dim {} must be equal and in 1..={MAX_PART_DIM}", a.q_a.dim, a.k_a.dim)
    })?;
    check(a.q_b.dim == a.k_b.dim && a.q_b.dim <= MAX_PART_DIM, || {
        format!("q_b.dim {} and k_b.dim {} must be equal and <= {MAX_PART_DIM}", a.q_b.dim, a.k_b.dim)
    })?;
    let want_b = a.q_b.dim > 0;
    check(has_q_b == want_b && has_k_b == want_b, || {
        format!(
            "part b has dim {} but q_b is {} and k_b is {} (give both buffers iff dim > 0)",
            a.q_b.dim,
            if has_q_b { "given" } else { "None" },
            if has_k_b { "given" } else { "None" }
        )
    })?;
    check((1..=MAX_PART_DIM).contains(&a.v.dim), || format!("v.dim {} must be in 1..={MAX_PART_DIM}", a.v.dim))?;
    check(a.out.dim == a.v.dim, || format!("out.dim {} != v.dim {}", a.out.dim, a.v.dim))?;
    check(a.q_start.checked_add(a.n_q).is_some_and(|e| e <= a.n_kv), || {
        format!("n_kv {} < q_start {} + n_q {}", a.n_kv, a.q_start, a.n_q)
    })?;
    check(a.scale.is_finite(), || format!("scale {} is not finite", a.scale))?;
    check(a.out.disjoint(a.n_q, a.heads), || format!("out {:?} has overlapping (token, head) rows", a.out))?;
    i32_of("n_kv", a.n_kv)?;
    Ok(())
}

/// Kernel arguments shared by both kernels, in signature order after the pointers.
struct Scalars {
    n_q: i32,
    n_kv: i32,
    q_start: i32,
    group: i32,
    da: i32,
    db: i32,
    dv: i32,
    strides: [i64; 12],
}

fn scalars(a: &FlashPrefillArgs) -> Result<Scalars, GpuError> {
    let s = |n: &str, v: usize| i64_of(n, v);
    Ok(Scalars {
        n_q: i32_of("n_q", a.n_q)?,
        n_kv: i32_of("n_kv", a.n_kv)?,
        q_start: i32_of("q_start", a.q_start)?,
        group: i32_of("heads / kv_heads", a.heads / a.kv_heads)?,
        da: a.q_a.dim as i32,
        db: a.q_b.dim as i32,
        dv: a.v.dim as i32,
        strides: [
            s("q_a.token_stride", a.q_a.token_stride)?,
            s("q_a.head_stride", a.q_a.head_stride)?,
            s("q_b.token_stride", a.q_b.token_stride)?,
            s("q_b.head_stride", a.q_b.head_stride)?,
            s("k_a.token_stride", a.k_a.token_stride)?,
            s("k_a.head_stride", a.k_a.head_stride)?,
            s("k_b.token_stride", a.k_b.token_stride)?,
            s("k_b.head_stride", a.k_b.head_stride)?,
            s("v.token_stride", a.v.token_stride)?,
            s("v.head_stride", a.v.head_stride)?,
            s("out.token_stride", a.out.token_stride)?,
            s("out.head_stride", a.out.head_stride)?,
        ],
    })
}

/// Launches one of the MMA kernels: pointers (q_a, q_b, k_a, k_b, v, out), the scalars, the
/// vector mask when the kernel takes one; raises the dynamic shared-memory limit when needed.
///
/// # Safety
/// `f` must take exactly these arguments, and every view must lie inside its buffer.
#[allow(clippy::too_many_arguments)]
unsafe fn launch_tiles(
    s: &std::sync::Arc<cudarc::driver::CudaStream>,
    f: &cudarc::driver::CudaFunction,
    (grid, threads, smem): ((u32, u32, u32), u32, usize),
    ptrs: [u64; 6],
    scale: f32,
    sc: &Scalars,
    vec_mask: Option<i32>,
    (window, sinks): (i32, u64),
) -> Result<(), GpuError> {
    if smem > DEFAULT_SMEM_LIMIT {
        f.set_attribute(CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32)
            .map_err(|e| GpuError::driver("cuFuncSetAttribute", e))?;
    }
    let mut b = s.launch_builder(f);
    for p in &ptrs {
        b.arg(p);
    }
    b.arg(&sc.n_q).arg(&sc.n_kv).arg(&sc.q_start).arg(&sc.group).arg(&scale);
    b.arg(&sc.da).arg(&sc.db).arg(&sc.dv);
    for st in &sc.strides {
        b.arg(st);
    }
    if let Some(m) = &vec_mask {
        b.arg(m);
    }
    b.arg(&window).arg(&sinks);
    let cfg = LaunchConfig { grid_dim: grid, block_dim: (threads, 1, 1), shared_mem_bytes: smem as u32 };
    // SAFETY: the caller's contract.
    unsafe { b.launch(cfg) }.map(|_| ()).map_err(|e| GpuError::driver("flash_prefill launch", e))
}

impl GpuDevice {
    fn smem_optin(&self) -> Result<usize, GpuError> {
        let v = self
            .context()
            .attribute(CUdevice_attribute_enum::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .map_err(|e| GpuError::driver("cuDeviceGetAttribute", e))?;
        Ok(usize::try_from(v).unwrap_or(0).max(DEFAULT_SMEM_LIMIT))
    }

    /// The kernel [`GpuDevice::flash_prefill`] runs for `args` on this device with aligned buffers
    /// (the rule in the module docs): [`FlashKernel::MmaFixed`] when it supports the shapes, else
    /// [`FlashKernel::Mma`] when that does, else [`FlashKernel::Simt`].
    pub fn flash_prefill_kernel(&self, args: &FlashPrefillArgs) -> Result<FlashKernel, GpuError> {
        let (optin, arch) = (self.smem_optin()?, self.info().arch());
        let cap = kernel_cap_from_env();
        Ok(if cap >= FlashKernel::Wgmma && wgmma_unsupported(args, self.target(), optin).is_none() {
            FlashKernel::Wgmma
        } else if cap >= FlashKernel::MmaFixed && fixed_unsupported(args, arch, optin).is_none() {
            FlashKernel::MmaFixed
        } else if cap >= FlashKernel::Mma && mma_unsupported(args, arch, optin).is_none() {
            FlashKernel::Mma
        } else {
            FlashKernel::Simt
        })
    }

    /// Causal attention of `n_q` queries over `n_kv` keys:
    /// `score(i, s) = scale · (q_a[i,h]·k_a[s,g] + q_b[i,h]·k_b[s,g])`,
    /// `out[i,h] = Σ_{s ≤ q_start+i} softmax_s(score) · v[s,g]` with `g = h / (heads/kv_heads)`.
    /// q/k/v BF16 (u16 bits), out f32. Never synchronises; allocates nothing (O(T) memory).
    /// The kernel is chosen by [`GpuDevice::flash_prefill_kernel`].
    #[allow(clippy::too_many_arguments)]
    pub fn flash_prefill(
        &self,
        args: &FlashPrefillArgs,
        q_a: &impl DevicePtr<u16>,
        q_b: Option<&dyn DevicePtr<u16>>,
        k_a: &impl DevicePtr<u16>,
        k_b: Option<&dyn DevicePtr<u16>>,
        v: &impl DevicePtr<u16>,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), GpuError> {
        self.flash_prefill_opts(args, &AttnOptions::default(), q_a, q_b, k_a, k_b, v, out)
    }

    /// [`GpuDevice::flash_prefill`] with a sliding window and attention sinks ([`AttnOptions`]):
    /// query `i` sees keys `max(0, q_start + i + 1 − w) ..= q_start + i`, and head `h`'s sink
    /// logit joins its softmax's denominator. f32 inputs ([`FlashInput`]) take the SIMT kernel.
    #[allow(clippy::too_many_arguments)]
    pub fn flash_prefill_opts<T: FlashInput>(
        &self,
        args: &FlashPrefillArgs,
        opts: &AttnOptions<'_>,
        q_a: &impl DevicePtr<T>,
        q_b: Option<&dyn DevicePtr<T>>,
        k_a: &impl DevicePtr<T>,
        k_b: Option<&dyn DevicePtr<T>>,
        v: &impl DevicePtr<T>,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), GpuError> {
        validate_shapes(args, q_b.is_some(), k_b.is_some())?;
        if T::SIMT_ONLY {
            return self.flash_prefill_with_opts(FlashKernel::Simt, args, opts, q_a, q_b, k_a, k_b, v, out);
        }
        let mut kernel = self.flash_prefill_kernel(args)?;
        if kernel >= FlashKernel::MmaFixed {
            let s = self.stream();
            let ptr = |p: &dyn DevicePtr<T>| p.device_ptr(s).0;
            let ptrs = [ptr(q_a), q_b.map_or(0, ptr), ptr(k_a), k_b.map_or(0, ptr), ptr(v), out.device_ptr_mut(s).0];
            if !fixed_misaligned(args, ptrs, q_b.is_some()).is_empty() {
                kernel = FlashKernel::Mma;
            }
        }
        self.flash_prefill_with_opts(kernel, args, opts, q_a, q_b, k_a, k_b, v, out)
    }

    /// [`GpuDevice::flash_prefill`] with the kernel forced (tests, benchmarks). Forcing
    /// [`FlashKernel::Mma`] on shapes or a device it does not support is a shape error.
    #[allow(clippy::too_many_arguments)]
    pub fn flash_prefill_with(
        &self,
        kernel: FlashKernel,
        args: &FlashPrefillArgs,
        q_a: &impl DevicePtr<u16>,
        q_b: Option<&dyn DevicePtr<u16>>,
        k_a: &impl DevicePtr<u16>,
        k_b: Option<&dyn DevicePtr<u16>>,
        v: &impl DevicePtr<u16>,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), GpuError> {
        self.flash_prefill_with_opts(kernel, args, &AttnOptions::default(), q_a, q_b, k_a, k_b, v, out)
    }

    /// [`GpuDevice::flash_prefill_opts`] over f32 q, k and v (the precise GPU mode): the SIMT
    /// kernel's mathematics with nothing rounded to BF16 (`flash_prefill_simt_f32`).
    #[allow(clippy::too_many_arguments)]
    pub fn flash_prefill_f32(
        &self,
        args: &FlashPrefillArgs,
        opts: &AttnOptions<'_>,
        q_a: &impl DevicePtr<f32>,
        q_b: Option<&dyn DevicePtr<f32>>,
        k_a: &impl DevicePtr<f32>,
        k_b: Option<&dyn DevicePtr<f32>>,
        v: &impl DevicePtr<f32>,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), GpuError> {
        self.flash_prefill_with_opts(FlashKernel::Simt, args, opts, q_a, q_b, k_a, k_b, v, out)
    }

    /// [`GpuDevice::flash_prefill_opts`] with the kernel forced (tests, benchmarks). With f32
    /// inputs ([`FlashInput`]) only [`FlashKernel::Simt`] runs.
    #[allow(clippy::too_many_arguments)]
    pub fn flash_prefill_with_opts<T: FlashInput>(
        &self,
        kernel: FlashKernel,
        args: &FlashPrefillArgs,
        opts: &AttnOptions<'_>,
        q_a: &impl DevicePtr<T>,
        q_b: Option<&dyn DevicePtr<T>>,
        k_a: &impl DevicePtr<T>,
        k_b: Option<&dyn DevicePtr<T>>,
        v: &impl DevicePtr<T>,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), GpuError> {
        let a = args;
        validate_shapes(a, q_b.is_some(), k_b.is_some())?;
        if T::SIMT_ONLY && kernel != FlashKernel::Simt {
            return Err(GpuError::shape(OP, format!("f32 inputs run on the SIMT kernel only, not {kernel:?}")));
        }
        opts.check(OP, a.heads)?;
        check_extent("q_a", &a.q_a, a.n_q, a.heads, q_a.len())?;
        check_extent("k_a", &a.k_a, a.n_kv, a.kv_heads, k_a.len())?;
        check_extent("v", &a.v, a.n_kv, a.kv_heads, v.len())?;
        check_extent("out", &a.out, a.n_q, a.heads, out.len())?;
        if let (Some(qb), Some(kb)) = (q_b, k_b) {
            check_extent("q_b", &a.q_b, a.n_q, a.heads, qb.len())?;
            check_extent("k_b", &a.k_b, a.n_kv, a.kv_heads, kb.len())?;
        }
        if kernel == FlashKernel::Mma {
            if let Some(why) = mma_unsupported(a, self.info().arch(), self.smem_optin()?) {
                return Err(GpuError::shape(OP, format!("the MMA kernel cannot run these shapes: {why}")));
            }
        }
        if kernel == FlashKernel::MmaFixed {
            if let Some(why) = fixed_unsupported(a, self.info().arch(), self.smem_optin()?) {
                return Err(GpuError::shape(OP, format!("the fixed-dims MMA kernel cannot run these shapes: {why}")));
            }
        }
        if kernel == FlashKernel::Wgmma {
            if let Some(why) = wgmma_unsupported(a, self.target(), self.smem_optin()?) {
                return Err(GpuError::shape(OP, format!("the wgmma kernel cannot run these shapes: {why}")));
            }
        }
        if a.n_q == 0 {
            return Ok(());
        }
        let sc = scalars(a)?;
        let s = self.stream();
        let (qa_p, _g0) = q_a.device_ptr(s);
        let (ka_p, _g1) = k_a.device_ptr(s);
        let (v_p, _g2) = v.device_ptr(s);
        let (o_p, _g3) = out.device_ptr_mut(s);
        let (qb_p, _g4) = match q_b {
            Some(b) => {
                let (p, g) = b.device_ptr(s);
                (p, Some(g))
            }
            None => (0, None),
        };
        let (kb_p, _g5) = match k_b {
            Some(b) => {
                let (p, g) = b.device_ptr(s);
                (p, Some(g))
            }
            None => (0, None),
        };
        let launch_err = |e| GpuError::driver("flash_prefill launch", e);
        let sinks_p = opts.sinks.map_or(0u64, |b| b.device_ptr(s).0);
        let window = opts.window_i32();
        match kernel {
            FlashKernel::Simt => {
                let f = self.function(&FLASH_PREFILL, T::SIMT_KERNEL)?;
                let mut b = s.launch_builder(&f);
                b.arg(&qa_p).arg(&qb_p).arg(&ka_p).arg(&kb_p).arg(&v_p).arg(&o_p);
                b.arg(&sc.n_q).arg(&sc.q_start).arg(&sc.group).arg(&a.scale).arg(&sc.da).arg(&sc.db).arg(&sc.dv);
                for st in &sc.strides {
                    b.arg(st);
                }
                b.arg(&window).arg(&sinks_p);
                let cfg = LaunchConfig {
                    grid_dim: (a.n_q.div_ceil(SIMT_WARPS) as u32, a.heads as u32, 1),
                    block_dim: (THREADS, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: arguments match the kernel's signature; every extent checked above.
                unsafe { b.launch(cfg) }.map_err(launch_err)?;
            }
            FlashKernel::Mma => {
                let l = &a;
                let mut vec_mask = 0i32;
                for (bit, ok) in [
                    (1, l.q_a.vec16(qa_p)),
                    (2, q_b.is_some() && l.q_b.vec16(qb_p)),
                    (4, l.k_a.vec16(ka_p)),
                    (8, k_b.is_some() && l.k_b.vec16(kb_p)),
                    (16, l.v.vec16(v_p)),
                ] {
                    if ok {
                        vec_mask |= bit;
                    }
                }
                let f = self.function(&FLASH_PREFILL, "flash_prefill_mma")?;
                let grid = (a.n_q.div_ceil(MMA_TILE) as u32, a.heads as u32, 1);
                let ptrs = [qa_p, qb_p, ka_p, kb_p, v_p, o_p];
                let cfg = (grid, THREADS, mma_smem_bytes(a));
                // SAFETY: flash_prefill_mma takes these arguments, the vector mask and the
                // options; every extent checked above, the shared memory against the opt-in limit.
                unsafe { launch_tiles(s, &f, cfg, ptrs, a.scale, &sc, Some(vec_mask), (window, sinks_p)) }?;
            }
            FlashKernel::MmaFixed | FlashKernel::Wgmma => {
                let misaligned = fixed_misaligned(a, [qa_p, qb_p, ka_p, kb_p, v_p, o_p], q_b.is_some());
                if !misaligned.is_empty() {
                    return Err(GpuError::shape(
                        OP,
                        format!(
                            "the fixed-dims MMA kernel needs 16-byte-aligned inputs and an 8-byte-aligned \
                             output (pointer and strides); {} are not",
                            misaligned.join(", ")
                        ),
                    ));
                }
                let entry = fixed_entry(a).map_err(|why| GpuError::shape(OP, why))?;
                let (program, name, threads, smem) = if kernel == FlashKernel::Wgmma {
                    (&FLASH_PREFILL_WGMMA, WGMMA_FUNCTIONS[entry], WGMMA_THREADS, wgmma_smem_bytes(entry))
                } else {
                    (&FLASH_PREFILL, FIXED_FUNCTIONS[entry], FIXED_THREADS, fixed_smem_bytes(FIXED_SHAPES[entry]))
                };
                let f = self.function(program, name)?;
                // Both take 128-query blocks.
                let grid = (a.heads as u32, a.n_q.div_ceil(FIXED_BQ) as u32, 1);
                let ptrs = [qa_p, qb_p, ka_p, kb_p, v_p, o_p];
                // SAFETY: the fixed-dims and wgmma kernels take these arguments; every extent and
                // alignment checked above, the shared memory against the opt-in limit.
                unsafe { launch_tiles(s, &f, (grid, threads, smem), ptrs, a.scale, &sc, None, (window, sinks_p)) }?;
            }
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------- benchmark

/// One timed prefill-attention configuration.
#[derive(Clone, Debug)]
pub struct FlashBench {
    pub tokens: usize,
    pub heads: usize,
    pub kv_heads: usize,
    /// q·k dim (both parts) and v dim.
    pub dim_qk: usize,
    pub dim_v: usize,
    /// Mean seconds per call (CUDA events around `iters` back-to-back calls).
    pub seconds: f64,
    /// Causal FLOPs `2 · (T²/2) · H · (dim_qk + dim_v)` per second, in TFLOP/s.
    pub tflops: f64,
    pub kernel: FlashKernel,
}

impl std::fmt::Display for FlashBench {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "prefill attention T={} heads={}/{} qk={} v={} [{}]: {:.3} ms, {:.1} TFLOP/s",
            self.tokens,
            self.heads,
            self.kv_heads,
            self.dim_qk,
            self.dim_v,
            self.kernel,
            self.seconds * 1e3,
            self.tflops
        )
    }
}

/// Causal FLOPs of one prefill attention call as counted by the benchmarks.
pub fn causal_flops(tokens: usize, heads: usize, dim_qk: usize, dim_v: usize) -> f64 {
    let t = tokens as f64;
    2.0 * (t * t / 2.0) * heads as f64 * (dim_qk + dim_v) as f64
}

/// Deterministic BF16 values in [-1, 1) (xorshift; the library has no rand dependency).
fn random_bf16(n: usize, seed: u64) -> Vec<u16> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let u = (x >> 40) as f32 / (1u64 << 24) as f32;
            krasis_core::dtype::f32_to_bf16(2.0 * u - 1.0)
        })
        .collect()
}

/// Times `iters` calls of `kernel` (the automatic choice when `None`) on random BF16 data,
/// contiguous separate buffers: q_a/k_a `dim_a` per head, part b (`dim_b > 0`) with a shared key,
/// v `dim_v`.
pub fn bench_prefill(
    dev: &GpuDevice,
    kernel: Option<FlashKernel>,
    tokens: usize,
    heads: usize,
    kv_heads: usize,
    (dim_a, dim_b, dim_v): (usize, usize, usize),
    iters: usize,
) -> Result<FlashBench, GpuError> {
    let t = tokens;
    let args = FlashPrefillArgs {
        n_q: t,
        n_kv: t,
        q_start: 0,
        heads,
        kv_heads,
        scale: 1.0 / ((dim_a + dim_b) as f32).sqrt(),
        q_a: HeadsLayout::contiguous(heads, dim_a),
        q_b: if dim_b > 0 { HeadsLayout::contiguous(heads, dim_b) } else { HeadsLayout::none() },
        k_a: HeadsLayout::contiguous(kv_heads, dim_a),
        k_b: if dim_b > 0 { HeadsLayout::shared(dim_b) } else { HeadsLayout::none() },
        v: HeadsLayout::contiguous(kv_heads, dim_v),
        out: HeadsLayout::contiguous(heads, dim_v),
    };
    let q_a = dev.upload(&random_bf16(t * heads * dim_a, 1), "bench q_a")?;
    let k_a = dev.upload(&random_bf16(t * kv_heads * dim_a, 2), "bench k_a")?;
    let v = dev.upload(&random_bf16(t * kv_heads * dim_v, 3), "bench v")?;
    let q_b = dev.upload(&random_bf16(t * heads * dim_b, 4), "bench q_b")?;
    let k_b = dev.upload(&random_bf16(t * dim_b, 5), "bench k_b")?;
    let mut out = dev.alloc_zeros::<f32>(t * heads * dim_v, "bench out")?;
    let (qb, kb): (Option<&dyn DevicePtr<u16>>, Option<&dyn DevicePtr<u16>>) =
        if dim_b > 0 { (Some(&q_b), Some(&k_b)) } else { (None, None) };
    let kernel = match kernel {
        Some(k) => k,
        None => dev.flash_prefill_kernel(&args)?,
    };
    // One untimed call: compiles/loads the kernel and warms the caches.
    dev.flash_prefill_with(kernel, &args, &q_a, qb, &k_a, kb, &v, &mut out)?;
    let (start, end) = (dev.new_event(true)?, dev.new_event(true)?);
    let iters = iters.max(1);
    start.record(dev.stream()).map_err(|e| GpuError::driver("cuEventRecord", e))?;
    for _ in 0..iters {
        dev.flash_prefill_with(kernel, &args, &q_a, qb, &k_a, kb, &v, &mut out)?;
    }
    end.record(dev.stream()).map_err(|e| GpuError::driver("cuEventRecord", e))?;
    end.synchronize().map_err(|e| GpuError::driver("cuEventSynchronize", e))?;
    let ms = start.elapsed_ms(&end).map_err(|e| GpuError::driver("cuEventElapsedTime", e))?;
    let seconds = ms as f64 * 1e-3 / iters as f64;
    let dim_qk = dim_a + dim_b;
    Ok(FlashBench {
        tokens: t,
        heads,
        kv_heads,
        dim_qk,
        dim_v,
        seconds,
        tflops: causal_flops(t, heads, dim_qk, dim_v) / seconds / 1e12,
        kernel,
    })
}

/// MLA prefill attention at DeepSeek-V2-Lite shapes: 16 heads, nope 128 + rope 64 (rope key
/// shared by all heads), v 128, causal over `tokens`.
pub fn bench_mla_prefill(
    dev: &GpuDevice,
    kernel: Option<FlashKernel>,
    tokens: usize,
    iters: usize,
) -> Result<FlashBench, GpuError> {
    bench_prefill(dev, kernel, tokens, 16, 16, (128, 64, 128), iters)
}

/// GQA prefill attention at Qwen3 shapes: 32 query heads over 4 kv heads, head dim 128.
pub fn bench_gqa_prefill(
    dev: &GpuDevice,
    kernel: Option<FlashKernel>,
    tokens: usize,
    iters: usize,
) -> Result<FlashBench, GpuError> {
    bench_prefill(dev, kernel, tokens, 32, 4, (128, 0, 128), iters)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mla(t: usize) -> FlashPrefillArgs {
        FlashPrefillArgs {
            n_q: t,
            n_kv: t,
            q_start: 0,
            heads: 16,
            kv_heads: 16,
            scale: 0.07,
            q_a: HeadsLayout::contiguous(16, 128),
            q_b: HeadsLayout::contiguous(16, 64),
            k_a: HeadsLayout::contiguous(16, 128),
            k_b: HeadsLayout::shared(64),
            v: HeadsLayout::contiguous(16, 128),
            out: HeadsLayout::contiguous(16, 128),
        }
    }

    #[test]
    fn kernel_rule() {
        let a = mla(8192);
        // V2-Lite: 2 x 64 x (200 + 136) x 2 bytes.
        assert_eq!(mma_smem_bytes(&a), 86_016);
        assert_eq!(mma_unsupported(&a, 90, 227 * 1024), None);
        assert!(mma_unsupported(&a, 75, 227 * 1024).unwrap().contains("sm_75"));
        assert!(mma_unsupported(&a, 89, 64 * 1024).unwrap().contains("shared memory"));
        let mut n = a;
        n.scale = 0.0;
        assert!(mma_unsupported(&n, 90, 227 * 1024).unwrap().contains("not positive"));
        // Qwen3 GQA head dim 128 fits; 256-wide v does not; 136 + 136 padded qk does not.
        let mut g = a;
        g.q_b = HeadsLayout::none();
        g.k_b = HeadsLayout::none();
        assert_eq!(mma_unsupported(&g, 80, 163 * 1024), None);
        g.v.dim = 256;
        assert!(mma_unsupported(&g, 90, 227 * 1024).unwrap().contains("v dim"));
        let mut w = a;
        (w.q_a.dim, w.q_b.dim) = (136, 136);
        assert!(mma_unsupported(&w, 90, 227 * 1024).unwrap().contains("q.k dim 288"));
        // Ragged dims pad to 16.
        (w.q_a.dim, w.q_b.dim, w.v.dim) = (24, 8, 8);
        assert_eq!(mma_unsupported(&w, 80, 48 * 1024), None);
    }

    #[test]
    fn fixed_kernel_rule() {
        let a = mla(8192);
        assert_eq!(fixed_shape(&a), Ok((128, 64, 128)));
        // Q [128][200] + 3 x (K [64][200] + V [64][136]), BF16.
        assert_eq!(fixed_smem_bytes((128, 64, 128)), 180_224);
        assert_eq!(fixed_unsupported(&a, 90, 227 * 1024), None);
        assert!(fixed_unsupported(&a, 80, 163 * 1024).unwrap().contains("shared memory"));
        assert!(fixed_unsupported(&a, 75, 227 * 1024).unwrap().contains("sm_75"));
        let mut n = a;
        n.scale = -0.1;
        assert!(fixed_unsupported(&n, 90, 227 * 1024).unwrap().contains("not positive"));
        // GQA takes the b-less entry; smaller multiples of 8 fit (zero-filled); others do not.
        let mut g = a;
        g.q_b = HeadsLayout::none();
        g.k_b = HeadsLayout::none();
        assert_eq!(fixed_shape(&g), Ok((128, 0, 128)));
        (g.q_a.dim, g.v.dim) = (96, 64);
        assert_eq!(fixed_shape(&g), Ok((128, 0, 128)));
        g.q_a.dim = 100;
        assert!(fixed_shape(&g).unwrap_err().contains("multiples of 8"));
        (g.q_a.dim, g.v.dim) = (128, 256);
        assert!(fixed_shape(&g).unwrap_err().contains("no compiled shape"));
        let mut w = a;
        w.q_b.dim = 72;
        assert!(fixed_shape(&w).unwrap_err().contains("no compiled shape"));
        // Each entry names its kernel, and the module compiles it.
        for (&(fa, fb, fv), name) in FIXED_SHAPES.iter().zip(FIXED_FUNCTIONS) {
            assert_eq!(name, format!("flash_prefill_fixed_{fa}_{fb}_{fv}"));
            assert!(FLASH_PREFILL.functions.contains(&name), "{name}");
            assert!(FLASH_PREFILL.src.contains(&format!("FLASH_FIXED_ENTRY({fa}, {fb}, {fv})")), "{name}");
        }
    }

    #[test]
    fn wgmma_kernel_rule() {
        let a = mla(8192);
        // 1 KiB + Q [128][192] + 4 x (K [64][192] + V [64][128]), BF16.
        assert_eq!(FIXED_SHAPES[0], (128, 64, 128));
        assert_eq!(wgmma_smem_bytes(0), 214_016);
        // 1 KiB + Q [128][128] + 3 x (K [128][128] + V [128][128]): fits H100's 227 KiB.
        assert_eq!(FIXED_SHAPES[1], (128, 0, 128));
        assert_eq!(wgmma_smem_bytes(1), 230_400);
        let h100 = Target::sass(90);
        assert_eq!(wgmma_unsupported(&a, h100, 227 * 1024), None);
        assert!(wgmma_unsupported(&a, Target::sass(89), 227 * 1024).unwrap().contains("sm_90a"));
        assert!(wgmma_unsupported(&a, Target::sass(90), 200 * 1024).unwrap().contains("shared memory"));
        let mut g = a;
        g.q_b = HeadsLayout::none();
        g.k_b = HeadsLayout::none();
        assert_eq!(wgmma_unsupported(&g, h100, 227 * 1024), None);
        // The fixed kernel's rules hold (smaller dims are zero-filled).
        (g.q_a.dim, g.v.dim) = (64, 32);
        assert_eq!(wgmma_unsupported(&g, h100, 227 * 1024), None);
        g.v.dim = 36;
        assert!(wgmma_unsupported(&g, h100, 227 * 1024).unwrap().contains("multiples of 8"));
        g.v.dim = 128;
        g.scale = 0.0;
        assert!(wgmma_unsupported(&g, h100, 227 * 1024).unwrap().contains("not positive"));
        for ((&(fa, fb, fv), name), (bk, stages, q_smem)) in FIXED_SHAPES.iter().zip(WGMMA_FUNCTIONS).zip(WGMMA_TILES) {
            assert_eq!(name, format!("flash_prefill_wgmma_{fa}_{fb}_{fv}"));
            assert!(FLASH_PREFILL_WGMMA.functions.contains(&name), "{name}");
            let entry = format!("FLASH_WGMMA_ENTRY({fa}, {fb}, {fv}, {bk}, {stages}, {q_smem})");
            assert!(FLASH_PREFILL.src.contains(&entry), "{entry}");
        }
    }

    #[test]
    fn shape_validation_names_the_problem() {
        let err = |a: &FlashPrefillArgs, qb: bool, kb: bool| validate_shapes(a, qb, kb).unwrap_err().to_string();
        let a = mla(10);
        assert!(validate_shapes(&a, true, true).is_ok());
        assert!(err(&a, false, true).contains("q_b is None"));
        let mut b = a;
        b.kv_heads = 3;
        assert!(err(&b, true, true).contains("not a multiple of kv_heads 3"));
        let mut b = a;
        b.q_start = 5;
        assert!(err(&b, true, true).contains("n_kv 10 < q_start 5 + n_q 10"));
        let mut b = a;
        b.k_a.dim = 64;
        assert!(err(&b, true, true).contains("k_a.dim 64"));
        let mut b = a;
        b.v.dim = 300;
        b.out.dim = 300;
        assert!(err(&b, true, true).contains("v.dim 300"));
        let mut b = a;
        b.out.head_stride = 64;
        assert!(err(&b, true, true).contains("overlapping"));
        let mut b = a;
        b.scale = f32::NAN;
        assert!(err(&b, true, true).contains("scale"));
        // Heads-major output [heads, T, dim] is disjoint too.
        let mut b = a;
        b.out = HeadsLayout { token_stride: 128, head_stride: 10 * 128, dim: 128 };
        assert!(validate_shapes(&b, true, true).is_ok());
    }

    #[test]
    fn extents() {
        let l = HeadsLayout::contiguous(4, 24);
        assert_eq!(l.extent(3, 4), Some(3 * 96));
        assert_eq!(HeadsLayout::shared(64).extent(5, 16), Some(5 * 64));
        assert_eq!(l.extent(0, 4), Some(0));
        let huge = HeadsLayout { token_stride: usize::MAX / 2, head_stride: 1, dim: 1 };
        assert_eq!(huge.extent(4, 1), None);
        assert!(check_extent("q_a", &l, 3, 4, 3 * 96 - 1).unwrap_err().to_string().contains("q_a"));
        assert!(l.vec16(256) && !l.vec16(8) && !HeadsLayout::contiguous(3, 12).vec16(0));
    }

    #[test]
    fn flop_count() {
        assert_eq!(causal_flops(8192, 16, 192, 128), 2.0 * (8192.0 * 8192.0 / 2.0) * 16.0 * 320.0);
    }
}
