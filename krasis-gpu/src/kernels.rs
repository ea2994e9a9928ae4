//! The CUDA C kernel sources (compiled by NVRTC at first use) and the ops that launch them.
//!
//! Every op validates its shapes on the host, launches on the device's compute stream and does
//! not synchronise. Tensors are row-major; BF16 is passed as its `u16` bits.

use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use crate::device::kernel_args;
use crate::nvrtc::Header;
use crate::{GpuDevice, GpuError, GpuKvCache, MappedHost};

/// One NVRTC program: its name (the cache key's prefix and NVRTC's file name), source, the headers
/// it may include, its own compile options (e.g. `-D` macros that pick which kernels of a shared
/// `.cu` file it instantiates), and the `extern "C"` kernels it defines.
#[derive(Clone, Copy, Debug)]
pub struct KernelSource {
    pub name: &'static str,
    pub src: &'static str,
    pub headers: &'static [Header],
    pub options: &'static [&'static str],
    pub functions: &'static [&'static str],
}

impl KernelSource {
    /// Every option this program compiles with: [`crate::cache::COMPILE_OPTIONS`], then its own.
    pub fn compile_options(&self) -> Vec<&'static str> {
        crate::cache::COMPILE_OPTIONS.iter().chain(self.options).copied().collect()
    }
}

/// Headers every kernel may `#include "..."`.
pub const HEADERS: &[Header] =
    &[Header { name: "krasis_common.cuh", src: include_str!("../kernels/krasis_common.cuh") }];

pub const EMBEDDING: KernelSource = KernelSource {
    name: "embedding",
    src: include_str!("../kernels/embedding.cu"),
    headers: HEADERS,
    options: &[],
    functions: &["embedding_gather_bf16_f32", "embedding_gather_bf16_bf16"],
};

pub const RMSNORM: KernelSource = KernelSource {
    name: "rmsnorm",
    src: include_str!("../kernels/rmsnorm.cu"),
    headers: HEADERS,
    options: &[],
    functions: &["rmsnorm_residual"],
};

pub const ROPE: KernelSource = KernelSource {
    name: "rope",
    src: include_str!("../kernels/rope.cu"),
    headers: HEADERS,
    options: &[],
    functions: &["rope_f32", "rope_bf16", "mla_rope_norm", "gqa_prep"],
};

pub const SILU_MUL: KernelSource = KernelSource {
    name: "silu_mul",
    src: include_str!("../kernels/silu_mul.cu"),
    headers: HEADERS,
    options: &[],
    functions: &["silu_mul_f32", "silu_mul_bf16", "silu_mul_f32_bf16"],
};

/// Every kernel source; CI compiles each of them for sm_80, sm_89 and sm_90.
pub const ALL: &[KernelSource] = &[
    EMBEDDING,
    RMSNORM,
    ROPE,
    SILU_MUL,
    crate::elementwise::ELEMENTWISE,
    crate::router::ROUTER,
    crate::sampling::SAMPLING,
    crate::linear::LINEAR,
    crate::linear::LINEAR_INT8_GEMV,
    crate::linear::LINEAR_BF16_GEMV_R1,
    crate::linear::LINEAR_BF16_GEMV_R4,
    crate::moe::MOE,
    crate::moe::MOE_Q4_TILES,
    crate::moe::MOE_Q8_TILES,
    crate::moe::MOE_QDEC,
    crate::moe::MOE_FP4_TILES,
    crate::moe::MOE_QDEC_FP4,
    crate::flash_prefill::FLASH_PREFILL,
    crate::flash_prefill::FLASH_PREFILL_WGMMA,
    crate::kv_cache::KV_CACHE,
    crate::attn_decode::ATTN_DECODE,
    crate::attn_decode::ATTN_DECODE_VARIANTS[0],
    crate::attn_decode::ATTN_DECODE_VARIANTS[1],
    crate::attn_decode::ATTN_DECODE_VARIANTS[2],
    crate::attn_decode::ATTN_DECODE_VARIANTS[3],
    crate::attn_decode::ATTN_DECODE_VARIANTS[4],
    crate::attn_decode::ATTN_DECODE_VARIANTS[5],
    crate::attn_decode::ATTN_DECODE_VARIANTS[6],
    crate::attn_decode::ATTN_DECODE_VARIANTS[7],
    crate::mla_decode::MLA_DECODE,
    crate::relayout::RELAYOUT,
    crate::moe_pcie::MOE_PCIE,
    crate::delta_rule::DELTA_RULE,
];

/// Threads per block of the row-wise kernels.
const BLOCK: u32 = 256;

/// Dynamic shared memory a kernel launch may take without opting in
/// (`CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`): 48 KiB on every CUDA device.
pub(crate) const DEFAULT_SMEM_LIMIT: usize = 48 << 10;

/// Most threads of an RMSNorm block (the hardware's limit). A block normalises one row, and with
/// one thread per 4 elements a decode step's single row of 4096 issues all its loads at once
/// instead of in 4 dependent rounds (each a PCIe round trip when the residual comes from the CPU
/// experts' mapped output).
const NORM_MAX_THREADS: usize = 1024;

/// One block of [`norm_threads`] per row of `hidden`.
pub(crate) fn cfg_norm_rows(rows: usize, hidden: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (norm_threads(hidden), 1, 1), shared_mem_bytes: 0 }
}

/// Threads of an RMSNorm block for rows of `hidden`: one per 4 elements, whole warps, from
/// [`BLOCK`] to [`NORM_MAX_THREADS`]. It depends on the row length alone, so a row's sum is taken
/// in the same order whatever the number of rows in the call.
pub(crate) fn norm_threads(hidden: usize) -> u32 {
    hidden.div_ceil(4).next_multiple_of(32).clamp(BLOCK as usize, NORM_MAX_THREADS) as u32
}

pub(crate) fn cfg_rows(rows: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 }
}

pub(crate) fn check(op: &'static str, ok: bool, detail: impl FnOnce() -> String) -> Result<(), GpuError> {
    if ok {
        Ok(())
    } else {
        Err(GpuError::shape(op, detail()))
    }
}

pub(crate) fn to_i32(op: &'static str, what: &str, v: usize) -> Result<i32, GpuError> {
    i32::try_from(v).map_err(|_| GpuError::shape(op, format!("{what} = {v} does not fit in i32")))
}

pub(crate) fn launch_err(op: &'static str) -> impl FnOnce(cudarc::driver::DriverError) -> GpuError {
    move |e| GpuError::Driver { op, detail: e.to_string() }
}

pub use krasis_core::spec::RopePairing;

/// The shape of [`GpuDevice::gqa_prep`]'s call: contiguous `[tokens, heads, head_dim]` q, k and v
/// rows, RoPE on the first `rot_dim` elements of each head (all of it, or partial rotary).
#[derive(Clone, Copy, Debug)]
pub struct GqaShape {
    pub n_tokens: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub rot_dim: usize,
    pub pairing: RopePairing,
}

/// Where RoPE applies inside a `[tokens, heads, head_dim]`-like tensor (strides in elements).
#[derive(Clone, Copy, Debug)]
pub struct RopeLayout {
    pub n_tokens: usize,
    pub n_heads: usize,
    pub token_stride: usize,
    pub head_stride: usize,
    /// First rotated element inside a head.
    pub rot_offset: usize,
    /// Rotated elements per head (even).
    pub rot_dim: usize,
    pub pairing: RopePairing,
}

impl RopeLayout {
    /// Rotating all `head_dim` elements of contiguous `[tokens, heads, head_dim]`.
    pub fn contiguous(n_tokens: usize, n_heads: usize, head_dim: usize, pairing: RopePairing) -> Self {
        RopeLayout {
            n_tokens,
            n_heads,
            token_stride: n_heads * head_dim,
            head_stride: head_dim,
            rot_offset: 0,
            rot_dim: head_dim,
            pairing,
        }
    }

    /// One past the last element touched.
    fn extent(&self) -> usize {
        if self.n_tokens == 0 || self.n_heads == 0 {
            return 0;
        }
        (self.n_tokens - 1) * self.token_stride + (self.n_heads - 1) * self.head_stride + self.rot_offset + self.rot_dim
    }
}

/// Rows/columns layout of a SiLU·mul (strides in elements between rows).
#[derive(Clone, Copy, Debug)]
pub struct SwiGluLayout {
    pub rows: usize,
    pub cols: usize,
    pub gate_stride: usize,
    pub up_stride: usize,
    pub out_stride: usize,
}

impl SwiGluLayout {
    /// Separate contiguous `[rows, cols]` gate, up and out.
    pub fn separate(rows: usize, cols: usize) -> Self {
        SwiGluLayout { rows, cols, gate_stride: cols, up_stride: cols, out_stride: cols }
    }

    /// Fused `gate_up [rows, 2*cols]` (gate first): pass the same buffer as gate and up; `up` is
    /// read from offset `cols`.
    pub fn fused(rows: usize, cols: usize) -> Self {
        SwiGluLayout { rows, cols, gate_stride: 2 * cols, up_stride: 2 * cols, out_stride: cols }
    }

    fn need(rows: usize, cols: usize, stride: usize) -> usize {
        if rows == 0 || cols == 0 {
            0
        } else {
            (rows - 1) * stride + cols
        }
    }
}

impl GpuDevice {
    /// `out[t, :] = table[ids[t], :]` for a BF16 `table [vocab, hidden]` into f32
    /// `out [ids.len(), hidden]`. Ids outside `[0, vocab)` give NaN rows.
    pub fn embedding_gather_f32(
        &self,
        table: &impl DevicePtr<u16>,
        vocab: usize,
        hidden: usize,
        ids: &impl DevicePtr<i32>,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), GpuError> {
        let n = out.len();
        let (out_p, _g) = out.device_ptr_mut(self.stream());
        self.embedding_launch("embedding_gather_bf16_f32", table, vocab, hidden, ids, out_p, n)
    }

    /// [`GpuDevice::embedding_gather_f32`] into a BF16 `out` (an exact copy of the rows).
    pub fn embedding_gather_bf16(
        &self,
        table: &impl DevicePtr<u16>,
        vocab: usize,
        hidden: usize,
        ids: &impl DevicePtr<i32>,
        out: &mut impl DevicePtrMut<u16>,
    ) -> Result<(), GpuError> {
        let n = out.len();
        let (out_p, _g) = out.device_ptr_mut(self.stream());
        self.embedding_launch("embedding_gather_bf16_bf16", table, vocab, hidden, ids, out_p, n)
    }

    #[allow(clippy::too_many_arguments)]
    fn embedding_launch(
        &self,
        fname: &'static str,
        table: &impl DevicePtr<u16>,
        vocab: usize,
        hidden: usize,
        ids: &impl DevicePtr<i32>,
        out_p: u64,
        out_len: usize,
    ) -> Result<(), GpuError> {
        const OP: &str = "embedding_gather";
        let n = ids.len();
        check(OP, table.len() == vocab * hidden, || {
            format!("table has {} elements, not {vocab}x{hidden}", table.len())
        })?;
        check(OP, out_len == n * hidden, || format!("out has {out_len} elements, not {n}x{hidden}"))?;
        if n == 0 || hidden == 0 {
            return Ok(());
        }
        let (n_i, h_i, v_i) = (to_i32(OP, "tokens", n)?, to_i32(OP, "hidden", hidden)?, to_i32(OP, "vocab", vocab)?);
        let s = self.stream();
        let (table_p, _g1) = table.device_ptr(s);
        let (ids_p, _g2) = ids.device_ptr(s);
        let f = self.function(&EMBEDDING, fname)?;
        let mut b = s.launch_builder(&f);
        b.arg(&table_p).arg(&ids_p).arg(&out_p).arg(&n_i).arg(&h_i).arg(&v_i);
        // SAFETY: argument list matches the kernel's signature; lengths checked above.
        unsafe { b.launch(cfg_rows(n)) }.map_err(launch_err(OP))?;
        Ok(())
    }

    /// RMSNorm fused with the residual add, over `rows` rows of `hidden`:
    /// `x += delta` (when a delta is given; f32 or BF16), then `x += delta_host` (f32 in mapped
    /// host memory, at least as long as `x`; the stream must be ordered after the host's writes),
    /// then `y = x / sqrt(mean(x²) + eps) · w`, written to `y_f32` and/or `y_bf16`. With no delta,
    /// `x` is left unchanged.
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_residual(
        &self,
        x: &mut impl DevicePtrMut<f32>,
        delta_f32: Option<&dyn DevicePtr<f32>>,
        delta_bf16: Option<&dyn DevicePtr<u16>>,
        delta_host: Option<&MappedHost<f32>>,
        w: &impl DevicePtr<u16>,
        y_f32: Option<&mut dyn DevicePtrMut<f32>>,
        y_bf16: Option<&mut dyn DevicePtrMut<u16>>,
        hidden: usize,
        eps: f32,
    ) -> Result<(), GpuError> {
        const OP: &str = "rmsnorm_residual";
        check(OP, hidden > 0 && x.len() % hidden == 0, || format!("x has {} elements, not rows x {hidden}", x.len()))?;
        let n = x.len();
        let rows = n / hidden;
        check(OP, w.len() == hidden, || format!("weight has {} elements, not {hidden}", w.len()))?;
        check(OP, delta_f32.is_none() || delta_bf16.is_none(), || "give at most one delta".into())?;
        check(OP, y_f32.is_some() || y_bf16.is_some(), || "no output given".into())?;
        let lens = [
            delta_f32.map(|d| d.len()),
            delta_bf16.map(|d| d.len()),
            y_f32.as_ref().map(|y| y.len()),
            y_bf16.as_ref().map(|y| y.len()),
        ];
        check(OP, lens.iter().all(|l| l.is_none_or(|l| l == n)), || format!("x has {n} elements; others {lens:?}"))?;
        check(OP, delta_host.is_none_or(|d| d.len() >= n), || {
            format!("x has {n} elements, the host delta {}", delta_host.map_or(0, |d| d.len()))
        })?;
        let dh_p = delta_host.map_or(0, |d| d.device_ptr());
        if rows == 0 {
            return Ok(());
        }
        let (rows_i, h_i) = (to_i32(OP, "rows", rows)?, to_i32(OP, "hidden", hidden)?);
        let s = self.stream();
        let (x_p, _g0) = x.device_ptr_mut(s);
        let (df_p, _g1) = match delta_f32 {
            Some(d) => {
                let (p, g) = d.device_ptr(s);
                (p, Some(g))
            }
            None => (0, None),
        };
        let (db_p, _g2) = match delta_bf16 {
            Some(d) => {
                let (p, g) = d.device_ptr(s);
                (p, Some(g))
            }
            None => (0, None),
        };
        let (w_p, _g3) = w.device_ptr(s);
        let (yf_p, _g4) = match y_f32 {
            Some(y) => {
                let (p, g) = y.device_ptr_mut(s);
                (p, Some(g))
            }
            None => (0, None),
        };
        let (yb_p, _g5) = match y_bf16 {
            Some(y) => {
                let (p, g) = y.device_ptr_mut(s);
                (p, Some(g))
            }
            None => (0, None),
        };
        let f = self.function(&RMSNORM, "rmsnorm_residual")?;
        let mut args = kernel_args![&x_p, &df_p, &db_p, &dh_p, &w_p, &yf_p, &yb_p, &rows_i, &h_i, &eps];
        // SAFETY: argument list matches the kernel's signature; lengths checked above; the kernel
        // waits for the previous one first. After the host's output (a stream wait before this
        // launch), the ordinary launch.
        unsafe { self.launch_dependent(OP, &f, cfg_norm_rows(rows, hidden), &mut args, delta_host.is_none()) }
    }

    /// Checks a RoPE layout against its buffer and tables: `(tokens, heads)` as i32, or `None` when
    /// there is nothing to rotate.
    fn rope_check(
        &self,
        x_len: usize,
        positions: &impl DevicePtr<i32>,
        cos: &impl DevicePtr<f32>,
        sin: &impl DevicePtr<f32>,
        max_pos: usize,
        l: &RopeLayout,
    ) -> Result<Option<(i32, i32)>, GpuError> {
        const OP: &str = "rope";
        check(OP, l.rot_dim & 1 == 0 && l.rot_dim > 0, || format!("rot_dim {} must be even and > 0", l.rot_dim))?;
        check(OP, l.rot_offset + l.rot_dim <= l.head_stride || l.n_heads <= 1, || {
            format!("rot_offset {} + rot_dim {} exceeds head_stride {}", l.rot_offset, l.rot_dim, l.head_stride)
        })?;
        check(OP, l.extent() <= x_len, || format!("layout {l:?} reaches element {} of {x_len}", l.extent()))?;
        check(OP, positions.len() == l.n_tokens, || {
            format!("{} positions for {} tokens", positions.len(), l.n_tokens)
        })?;
        let half = l.rot_dim / 2;
        check(OP, cos.len() == max_pos * half && sin.len() == max_pos * half, || {
            format!("cos/sin have {}/{} elements, not {max_pos}x{half}", cos.len(), sin.len())
        })?;
        to_i32(OP, "max_pos", max_pos)?;
        to_i32(OP, "rot_offset", l.rot_offset)?;
        to_i32(OP, "heads * rot_dim", l.n_heads * l.rot_dim)?;
        if l.n_tokens == 0 || l.n_heads == 0 {
            return Ok(None);
        }
        Ok(Some((to_i32(OP, "tokens", l.n_tokens)?, to_i32(OP, "heads", l.n_heads)?)))
    }

    #[allow(clippy::too_many_arguments)]
    fn rope_launch(
        &self,
        fname: &'static str,
        x_p: u64,
        x_len: usize,
        positions: &impl DevicePtr<i32>,
        cos: &impl DevicePtr<f32>,
        sin: &impl DevicePtr<f32>,
        max_pos: usize,
        l: &RopeLayout,
    ) -> Result<(), GpuError> {
        const OP: &str = "rope";
        let Some((n_i, h_i)) = self.rope_check(x_len, positions, cos, sin, max_pos, l)? else { return Ok(()) };
        let half = l.rot_dim / 2;
        let (ts, hs) = (l.token_stride as i64, l.head_stride as i64);
        let (off, rd) = (l.rot_offset as i32, l.rot_dim as i32);
        let inter: i32 = (l.pairing == RopePairing::Interleaved) as i32;
        let mp = max_pos as i32;
        let s = self.stream();
        let (pos_p, _g1) = positions.device_ptr(s);
        let (cos_p, _g2) = cos.device_ptr(s);
        let (sin_p, _g3) = sin.device_ptr(s);
        let f = self.function(&ROPE, fname)?;
        let mut b = s.launch_builder(&f);
        b.arg(&x_p).arg(&pos_p).arg(&cos_p).arg(&sin_p).arg(&n_i).arg(&h_i).arg(&ts).arg(&hs);
        b.arg(&off).arg(&rd).arg(&inter).arg(&mp);
        // One thread per rotated pair (heads x rot_dim/2 of them, rounded up to whole warps), 32 to
        // 512 threads: decode's 16 heads x 32 pairs are one pass instead of four per thread.
        let threads = (l.n_heads * half).next_multiple_of(32).clamp(32, 512) as u32;
        let cfg = LaunchConfig { grid_dim: (l.n_tokens as u32, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: argument list matches the kernel's signature; extents checked above.
        unsafe { b.launch(cfg) }.map_err(launch_err(OP))?;
        Ok(())
    }

    /// MLA's per-token preparation in one launch: [`GpuDevice::rope_f32`] on `q` with `q_rope`,
    /// on the kv_a rows `kv` with `kv_rope` (one head), and [`GpuDevice::rmsnorm_rows_inplace`]
    /// of the first `norm_w.len()` elements of each kv row (stride `kv_rope.token_stride`): the
    /// same f32 operations per element as those three launches.
    #[allow(clippy::too_many_arguments)]
    pub fn mla_rope_norm(
        &self,
        q: &mut impl DevicePtrMut<f32>,
        q_rope: &RopeLayout,
        kv: &mut impl DevicePtrMut<f32>,
        kv_rope: &RopeLayout,
        norm_w: &impl DevicePtr<u16>,
        eps: f32,
        positions: &impl DevicePtr<i32>,
        cos: &impl DevicePtr<f32>,
        sin: &impl DevicePtr<f32>,
        max_pos: usize,
        cache_out: Option<(&GpuKvCache, usize, usize)>,
    ) -> Result<bool, GpuError> {
        const OP: &str = "mla_rope_norm";
        let (ql, kl) = (q_rope, kv_rope);
        check(
            OP,
            ql.n_tokens == kl.n_tokens && ql.rot_dim == kl.rot_dim && ql.pairing == kl.pairing && kl.n_heads == 1,
            || format!("q layout {ql:?} and kv layout {kl:?} must share tokens, rot_dim and pairing (kv: one head)"),
        )?;
        let n = norm_w.len();
        check(OP, n <= kl.rot_offset && n > 0, || {
            format!("the norm's {n} elements must lie before the kv rope slice at {}", kl.rot_offset)
        })?;
        let q_ok = self.rope_check(q.len(), positions, cos, sin, max_pos, ql)?;
        let kv_ok = self.rope_check(kv.len(), positions, cos, sin, max_pos, kl)?;
        let (Some((n_i, qh_i)), Some(_)) = (q_ok, kv_ok) else { return Ok(false) };
        // The cache write rides along for a BF16 cache whose rows are the kv rows as laid out here.
        let out = match cache_out {
            Some((c, layer, pos)) if c.layout().planes == 1 && c.layout().row == kl.token_stride => {
                c.bf16_rows(OP, self, layer, 0, pos, kl.n_tokens)?
            }
            _ => None,
        };
        let (out_p, kv_row) = (out.unwrap_or(0), to_i32(OP, "kv row", kl.token_stride)?);
        let s = self.stream();
        let (q_p, _g0) = q.device_ptr_mut(s);
        let (kv_p, _g1) = kv.device_ptr_mut(s);
        let (w_p, _g2) = norm_w.device_ptr(s);
        let (pos_p, _g3) = positions.device_ptr(s);
        let (cos_p, _g4) = cos.device_ptr(s);
        let (sin_p, _g5) = sin.device_ptr(s);
        let (q_ts, q_hs, q_off) = (ql.token_stride as i64, ql.head_stride as i64, ql.rot_offset as i32);
        let (kv_ts, kv_off, n_norm) = (kl.token_stride as i64, kl.rot_offset as i32, n as i32);
        let (rd, inter, mp) = (ql.rot_dim as i32, (ql.pairing == RopePairing::Interleaved) as i32, max_pos as i32);
        let f = self.function(&ROPE, "mla_rope_norm")?;
        let mut args = kernel_args![
            &q_p, &q_ts, &q_hs, &qh_i, &q_off, &kv_p, &kv_ts, &kv_off, &w_p, &n_norm, &eps, &pos_p, &cos_p, &sin_p,
            &n_i, &rd, &inter, &mp, &out_p, &kv_row
        ];
        // SAFETY: argument list matches the kernel's signature; extents checked above (the norm's
        // elements lie inside each kv row, before its rope slice; the cache rows pos..pos+t exist
        // and are kv rows long); the kernel waits first.
        unsafe { self.launch_dependent(OP, &f, cfg_rows(ql.n_tokens), &mut args, true) }?;
        Ok(out.is_some())
    }

    /// GQA's per-token preparation in one launch: the biases `[q, k, v]` (when given) added to
    /// the rows of `q [t, q_heads·head_dim]`, `k` and `v [t, kv_heads·head_dim]`, then
    /// [`GpuDevice::rope_f32`] on q's and k's heads (`rot_dim` elements from each head's start),
    /// and with `cache_out` = (cache, layer, pos) of a BF16 two-plane cache whose rows are k's,
    /// k and v written to rows `pos..pos+t` of its key and value planes: the same f32 operations
    /// per element as those launches (up to seven). Returns whether the rows went into the cache
    /// (an FP8 cache, or none, is left to [`GpuKvCache::write`]).
    #[allow(clippy::too_many_arguments)]
    pub fn gqa_prep<B: DevicePtr<u16>>(
        &self,
        q: &mut impl DevicePtrMut<f32>,
        k: &mut impl DevicePtrMut<f32>,
        v: &mut impl DevicePtrMut<f32>,
        shape: GqaShape,
        bias: Option<&[B; 3]>,
        positions: &impl DevicePtr<i32>,
        cos: &impl DevicePtr<f32>,
        sin: &impl DevicePtr<f32>,
        max_pos: usize,
        cache_out: Option<(&GpuKvCache, usize, usize)>,
    ) -> Result<bool, GpuError> {
        const OP: &str = "gqa_prep";
        let GqaShape { n_tokens: t, q_heads, kv_heads, head_dim, rot_dim, pairing } = shape;
        let (q_row, kv_row) = (q_heads * head_dim, kv_heads * head_dim);
        check(OP, rot_dim <= head_dim, || format!("rot_dim {rot_dim} exceeds head_dim {head_dim}"))?;
        check(OP, v.len() >= t * kv_row, || format!("v has {} elements, not {t}x{kv_row}", v.len()))?;
        let ql = RopeLayout {
            n_tokens: t,
            n_heads: q_heads,
            token_stride: q_row,
            head_stride: head_dim,
            rot_offset: 0,
            rot_dim,
            pairing,
        };
        let kl = RopeLayout { n_heads: kv_heads, token_stride: kv_row, ..ql };
        let q_ok = self.rope_check(q.len(), positions, cos, sin, max_pos, &ql)?;
        let k_ok = self.rope_check(k.len(), positions, cos, sin, max_pos, &kl)?;
        if let Some(b) = bias {
            let lens = [b[0].len(), b[1].len(), b[2].len()];
            check(OP, lens == [q_row, kv_row, kv_row], || {
                format!("biases of {lens:?} elements for rows of {q_row}, {kv_row} and {kv_row}")
            })?;
        }
        let (Some((n_i, qh_i)), Some((_, kh_i))) = (q_ok, k_ok) else { return Ok(false) };
        // The cache writes ride along for a BF16 cache of two planes whose rows are k's.
        let out = match cache_out {
            Some((c, layer, pos)) if c.layout().planes == 2 && c.layout().row == kv_row => {
                match (c.bf16_rows(OP, self, layer, 0, pos, t)?, c.bf16_rows(OP, self, layer, 1, pos, t)?) {
                    (Some(kp), Some(vp)) => Some((kp, vp)),
                    _ => None,
                }
            }
            _ => None,
        };
        let (k_out, v_out) = out.unwrap_or((0, 0));
        let s = self.stream();
        let (q_p, _g0) = q.device_ptr_mut(s);
        let (k_p, _g1) = k.device_ptr_mut(s);
        let (v_p, _g2) = v.device_ptr_mut(s);
        let guards = bias.map(|b| [b[0].device_ptr(s), b[1].device_ptr(s), b[2].device_ptr(s)]);
        let [qb_p, kb_p, vb_p] = guards.as_ref().map_or([0; 3], |g| [g[0].0, g[1].0, g[2].0]);
        let (pos_p, _g3) = positions.device_ptr(s);
        let (cos_p, _g4) = cos.device_ptr(s);
        let (sin_p, _g5) = sin.device_ptr(s);
        let hd_i = to_i32(OP, "head_dim", head_dim)?;
        let (rd, inter, mp) = (rot_dim as i32, (pairing == RopePairing::Interleaved) as i32, max_pos as i32);
        let f = self.function(&ROPE, "gqa_prep")?;
        let mut args = kernel_args![
            &q_p, &k_p, &v_p, &qb_p, &kb_p, &vb_p, &qh_i, &kh_i, &hd_i, &pos_p, &cos_p, &sin_p, &n_i, &rd, &inter, &mp,
            &k_out, &v_out
        ];
        // One block per (token, head), a thread per element of a head (at most 256).
        let blocks_y = u32::try_from(q_heads + kv_heads)
            .map_err(|_| GpuError::shape(OP, format!("{} heads", q_heads + kv_heads)))?;
        let threads = head_dim.next_multiple_of(32).clamp(32, 256) as u32;
        let cfg = LaunchConfig { grid_dim: (t as u32, blocks_y, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: argument list matches the kernel's signature; extents checked above (q, k and v
        // hold t rows, the biases one row each; the cache rows pos..pos+t of both planes exist
        // and are k's rows long); the kernel waits first.
        unsafe { self.launch_dependent(OP, &f, cfg, &mut args, true) }?;
        Ok(out.is_some())
    }

    /// RoPE in place on f32 `x` with tables `cos`/`sin` `[max_pos, rot_dim/2]` (f32, computed on
    /// the host, YaRN included) at `positions[t]`. Positions outside `[0, max_pos)` give NaN.
    pub fn rope_f32(
        &self,
        x: &mut impl DevicePtrMut<f32>,
        positions: &impl DevicePtr<i32>,
        cos: &impl DevicePtr<f32>,
        sin: &impl DevicePtr<f32>,
        max_pos: usize,
        layout: &RopeLayout,
    ) -> Result<(), GpuError> {
        let len = x.len();
        let (x_p, _g) = x.device_ptr_mut(self.stream());
        self.rope_launch("rope_f32", x_p, len, positions, cos, sin, max_pos, layout)
    }

    /// [`GpuDevice::rope_f32`] on BF16 `x` (computed in f32, rounded once).
    pub fn rope_bf16(
        &self,
        x: &mut impl DevicePtrMut<u16>,
        positions: &impl DevicePtr<i32>,
        cos: &impl DevicePtr<f32>,
        sin: &impl DevicePtr<f32>,
        max_pos: usize,
        layout: &RopeLayout,
    ) -> Result<(), GpuError> {
        let len = x.len();
        let (x_p, _g) = x.device_ptr_mut(self.stream());
        self.rope_launch("rope_bf16", x_p, len, positions, cos, sin, max_pos, layout)
    }

    /// `out = silu(gate) · up` elementwise over `layout`, all f32. For the fused `gate_up` layout
    /// ([`SwiGluLayout::fused`]) pass `gate_up` as both `gate` and `up` with `up_offset = cols`;
    /// otherwise `up_offset = 0`.
    pub fn silu_mul_f32(
        &self,
        gate: &impl DevicePtr<f32>,
        up: &impl DevicePtr<f32>,
        up_offset: usize,
        out: &mut impl DevicePtrMut<f32>,
        layout: &SwiGluLayout,
    ) -> Result<(), GpuError> {
        self.silu_mul_launch("silu_mul_f32", 4, gate, up, up_offset, out, layout)
    }

    /// [`GpuDevice::silu_mul_f32`] with BF16 inputs and output (computed in f32, rounded once).
    pub fn silu_mul_bf16(
        &self,
        gate: &impl DevicePtr<u16>,
        up: &impl DevicePtr<u16>,
        up_offset: usize,
        out: &mut impl DevicePtrMut<u16>,
        layout: &SwiGluLayout,
    ) -> Result<(), GpuError> {
        self.silu_mul_launch("silu_mul_bf16", 2, gate, up, up_offset, out, layout)
    }

    /// [`GpuDevice::silu_mul_f32`] with f32 inputs and a BF16 output (e.g. straight into a BF16 GEMM).
    pub fn silu_mul_f32_to_bf16(
        &self,
        gate: &impl DevicePtr<f32>,
        up: &impl DevicePtr<f32>,
        up_offset: usize,
        out: &mut impl DevicePtrMut<u16>,
        layout: &SwiGluLayout,
    ) -> Result<(), GpuError> {
        self.silu_mul_launch("silu_mul_f32_bf16", 4, gate, up, up_offset, out, layout)
    }

    #[allow(clippy::too_many_arguments)]
    fn silu_mul_launch<In, Out>(
        &self,
        fname: &'static str,
        in_size: usize,
        gate: &impl DevicePtr<In>,
        up: &impl DevicePtr<In>,
        up_offset: usize,
        out: &mut impl DevicePtrMut<Out>,
        layout: &SwiGluLayout,
    ) -> Result<(), GpuError> {
        const OP: &str = "silu_mul";
        let l = layout;
        check(OP, SwiGluLayout::need(l.rows, l.cols, l.gate_stride) <= gate.len(), || {
            format!("gate has {} elements, layout {l:?} needs more", gate.len())
        })?;
        check(OP, up_offset + SwiGluLayout::need(l.rows, l.cols, l.up_stride) <= up.len(), || {
            format!("up has {} elements, layout {l:?} from offset {up_offset} needs more", up.len())
        })?;
        check(OP, SwiGluLayout::need(l.rows, l.cols, l.out_stride) <= out.len(), || {
            format!("out has {} elements, layout {l:?} needs more", out.len())
        })?;
        if l.rows == 0 || l.cols == 0 {
            return Ok(());
        }
        let (r_i, c_i) = (to_i32(OP, "rows", l.rows)?, to_i32(OP, "cols", l.cols)?);
        let (gs, us, os) = (l.gate_stride as i64, l.up_stride as i64, l.out_stride as i64);
        let s = self.stream();
        let (g_p, _g1) = gate.device_ptr(s);
        let (u_p, _g2) = up.device_ptr(s);
        let u_p = u_p + (up_offset * in_size) as u64;
        let (o_p, _g3) = out.device_ptr_mut(s);
        let f = self.function(&SILU_MUL, fname)?;
        let mut b = s.launch_builder(&f);
        b.arg(&g_p).arg(&u_p).arg(&o_p).arg(&r_i).arg(&c_i).arg(&gs).arg(&us).arg(&os);
        // Rows on x, column chunks of BLOCK on y (capped; the kernel strides over the rest).
        let chunks = l.cols.div_ceil(BLOCK as usize).min(65535) as u32;
        let cfg = LaunchConfig { grid_dim: (l.rows as u32, chunks, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: argument list matches the kernel's signature; extents checked above.
        unsafe { b.launch(cfg) }.map_err(launch_err(OP))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn norm_blocks_take_a_thread_per_four_elements_in_whole_warps() {
        for (hidden, want) in [(1, 256), (7, 256), (1000, 256), (2048, 512), (4096, 1024), (4097, 1024), (7168, 1024)] {
            assert_eq!(norm_threads(hidden), want, "hidden {hidden}");
        }
        // Any row length: whole warps, within one block's limit.
        for hidden in 1..20_000 {
            let n = norm_threads(hidden) as usize;
            assert!(n.is_multiple_of(32) && (BLOCK as usize..=NORM_MAX_THREADS).contains(&n), "hidden {hidden}: {n}");
        }
        let cfg = cfg_norm_rows(3, 4096);
        assert_eq!((cfg.grid_dim, cfg.block_dim), ((3, 1, 1), (1024, 1, 1)));
    }
}
