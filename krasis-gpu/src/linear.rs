//! Dense linears on the GPU: `y[m, rows] = x[m, cols] · Wᵀ` with f32 activations.
//!
//! * **BF16** weights: x is rounded to BF16 and multiplied with f32 accumulation, as transformers
//!   does for a BF16 model. For `m <= BF16_GEMV_MAX_M` (decode) our own GEMV does it in one
//!   launch: it rounds x to BF16 as it stages it in shared memory and streams every weight byte
//!   once with 16-byte loads. For larger `m` x is rounded by a small kernel (into the
//!   [`GemmContext`]'s scratch) and cuBLAS `GemmEx` multiplies BF16 × BF16 into an f32 `y` with
//!   compute type 32F.
//! * **INT8** weight-only, symmetric per output row ([`quantize_int8_rows`]): for
//!   `m <= INT8_GEMV_MAX_M` (decode) our own GEMV reads every weight byte once with f32 `x` and f32
//!   accumulation and applies the row scale at the end. For larger `m` the INT8 rows are expanded
//!   to BF16 tile by tile (exact: no scale applied, `|q| <= 127` fits BF16's significand), cuBLAS
//!   multiplies them with BF16-rounded `x` on the tensor cores, and one kernel scales `y`'s rows.
//!   Why not a hand-written tiled INT8 kernel: prefill-sized GEMMs are compute bound, and cuBLAS's
//!   tensor-core BF16 GEMM is far faster than a CUDA-core kernel; the expansion costs 3 extra bytes
//!   of traffic per weight, small next to the `2·m` FLOPs per weight once `m` is in the tens.
//!   The two INT8 paths therefore differ in one respect: the GEMV uses f32 `x`, the tiled path
//!   BF16-rounded `x` (like the BF16 path).
//! * **Exact input** ([`GpuLinear::set_exact_input`], the precise GPU mode): x is not rounded.
//!   Every BF16 product goes through cuBLAS with x split into two BF16 halves (`hi + lo` within
//!   2⁻¹⁷ |x|), two GEMMs summing into one f32 `y` (the second with β = 1); the tiled INT8 path
//!   does the same, and the INT8 GEMV already reads f32 `x`. Twice the GEMM work for about f32's
//!   accuracy: a verification mode, not a fast one.
//! * **Fixed rows** ([`GemmContext::set_fixed_rows`], the row-invariant prefill): every product
//!   runs on cuBLAS in blocks of exactly [`FIXED_ROWS`] rows of x, whatever `m` (a last partial
//!   block padded with zero rows into the scratch, its rows copied out). Each call then has one
//!   shape, so cuBLAS runs one kernel with one summation order per output, and a row's outputs do
//!   not depend on how many rows the call had or where the row sat: a prompt split into calls
//!   differently gives the same bits. The GEMVs (whose order per row is fixed too, but is not
//!   cuBLAS's) are not used then.
//!
//! Nothing here synchronises; every launch goes on the device's compute stream.

use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use cudarc::driver::{CudaContext, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg};

use crate::cublas::{self, CublasHandle};
use crate::device::kernel_args;
use crate::kernels::{KernelSource, HEADERS};
use crate::{DeviceBuffer, GpuDevice, GpuError};

/// Rows of every cuBLAS call under [`GemmContext::set_fixed_rows`]: enough to keep the tensor
/// cores busy on prefill-sized products (128 is a whole tile of cuBLAS's large kernels), few
/// enough that a short call pays little for its padding.
pub const FIXED_ROWS: usize = 128;

/// The pieces around cuBLAS and the INT8 path's dequantisation.
pub const LINEAR: KernelSource = KernelSource {
    name: "linear",
    src: include_str!("../kernels/linear.cu"),
    headers: HEADERS,
    options: &[],
    functions: &["f32_to_bf16_pad", "f32_to_bf16_split_pad", "int8_dequant_bf16", "scale_rows_f32"],
};

/// The INT8 GEMVs: a program of their own (the same file), so that the GEMV families compile in
/// parallel with each other and the rest (one program of all three took 5.3 s on the H100 box,
/// the longest of a cold start).
pub const LINEAR_INT8_GEMV: KernelSource = KernelSource {
    name: "linear_int8_gemv",
    src: include_str!("../kernels/linear.cu"),
    headers: HEADERS,
    options: &["-DLINEAR_INT8_GEMV"],
    functions: &[
        "int8_gemv_m1_r1",
        "int8_gemv_m2_r1",
        "int8_gemv_m4_r1",
        "int8_gemv_m8_r1",
        "int8_gemv_m1_r4",
        "int8_gemv_m2_r4",
        "int8_gemv_m4_r4",
        "int8_gemv_m8_r4",
    ],
};

/// The BF16 GEMVs of one row per warp (see [`LINEAR_INT8_GEMV`]; the BF16 family alone took
/// ~5 s as one program, so it is two).
pub const LINEAR_BF16_GEMV_R1: KernelSource = KernelSource {
    name: "linear_bf16_gemv_r1",
    src: include_str!("../kernels/linear.cu"),
    headers: HEADERS,
    options: &["-DLINEAR_BF16_GEMV=1"],
    functions: &["bf16_gemv_m1_r1", "bf16_gemv_m2_r1", "bf16_gemv_m4_r1", "bf16_gemv_m8_r1"],
};

/// The BF16 GEMVs of four rows per warp.
pub const LINEAR_BF16_GEMV_R4: KernelSource = KernelSource {
    name: "linear_bf16_gemv_r4",
    src: include_str!("../kernels/linear.cu"),
    headers: HEADERS,
    options: &["-DLINEAR_BF16_GEMV=4"],
    functions: &["bf16_gemv_m1_r4", "bf16_gemv_m2_r4", "bf16_gemv_m4_r4", "bf16_gemv_m8_r4"],
};

/// Largest `m` served by the INT8 GEMV: up to 8 tokens it stays bound by the weight bytes (x is
/// re-read from L1 per token); beyond that, expanding to BF16 for the tensor cores wins.
pub const INT8_GEMV_MAX_M: usize = 8;
/// INT8 rows are padded to this many bytes so that every row starts 16-byte aligned (one vector
/// load per lane per step).
const INT8_ROW_ALIGN: usize = 16;
/// Threads per INT8 GEMV block (8 warps, one output row or four per warp).
const GEMV_BLOCK: u32 = 256;
/// Warps per SM the INT8 GEMV keeps when it gives each warp 4 rows (every lane keeps 8 loads in
/// flight either way, `INT8_GEMV_LOADS` in linear.cu). Four rows re-use each lane's f32 x loads
/// (64 bytes per 16-byte weight load) four times; with one row those loads held GLM-4.5-Air's
/// o_proj to 1.5 TB/s on the H200 against 2.8 with four rows on its q/k/v (s42,
/// `h200-int8-gemv-s42.log`), so four rows win down to 4 warps of 4 KiB in flight per SM.
const INT8_GEMV_MIN_WARPS_PER_SM: usize = 4;
/// Largest `m` served by the BF16 GEMV: up to 8 tokens its CUDA-core work (2 FLOPs per weight
/// per token, plus BF16 unpacking) stays under the time to stream the weight bytes; beyond that
/// cuBLAS's tensor cores win, and the conversion launch in front of them is amortised.
pub const BF16_GEMV_MAX_M: usize = 8;
/// 16-byte weight loads each BF16 GEMV lane keeps in flight (`BF16_GEMV_LOADS` in linear.cu; the
/// two must agree): with `R` rows per warp a chunk is `8 / R` steps of 256 columns.
const BF16_GEMV_LOADS: usize = 8;
/// Columns one warp covers per step of the BF16 GEMV: 32 lanes × 8 BF16 (one 16-byte load each).
const BF16_GEMV_STEP_COLS: usize = 256;
/// Shared memory for the BF16 GEMV's staged x (BF16 `[m, tile]`): 2048 columns of 8 tokens (a
/// whole V2-Lite hidden row in one tile), 16K columns of 1 token, and room for several blocks
/// per SM on every target (sm_89 has 100 KiB); under the 48 KiB that needs no opt-in.
const BF16_GEMV_X_SMEM_BYTES: usize = 32 << 10;
/// Warps per SM the BF16 GEMV wants before it gives each warp 4 rows (for m = 2, 3): every warp
/// keeps 4 KiB of weight loads in flight, so 16 per SM is ~8 MiB on an H100 — several times
/// HBM3's bandwidth-delay product (~2.5 MiB), leaving slack for the reductions and stores.
const BF16_GEMV_WARPS_PER_SM: usize = 16;
/// The same for m >= 4, where 4 rows per warp pay more (a quarter of the x reads and unpacking
/// per weight, which at m = 8 would otherwise rival the weight streaming): 4 warps per SM keep
/// ~2 MiB in flight on an H100, about the bandwidth-delay product.
const BF16_GEMV_MIN_WARPS_PER_SM: usize = 4;
/// Most warps per BF16 GEMV block (256 threads, like the INT8 GEMV); fewer when the rows would
/// not give every SM a block, so that small matrices (kv_a: 576 rows) still spread over the GPU.
const BF16_GEMV_MAX_WARPS_PER_BLOCK: usize = 8;
/// BF16 bytes expanded per INT8 tile in the large-`m` path: each cuBLAS call then covers
/// thousands of rows (many waves of tensor-core tiles) while the scratch stays small.
const INT8_DEQUANT_TILE_BYTES: usize = 32 << 20;
/// cuBLAS workspace we hand it (charged to the budget): NVIDIA's recommended size for Hopper,
/// ample for Ampere/Ada, and it keeps cuBLAS from allocating behind the budget's back.
const CUBLAS_WORKSPACE_BYTES: usize = 32 << 20;
/// Scratch sub-buffers start on this boundary (cuBLAS's preferred alignment).
const SCRATCH_ALIGN: usize = 256;
/// Threads per block of the elementwise kernels.
const EW_BLOCK: u32 = 256;
/// Grid cap of the grid-stride elementwise kernels (enough blocks to fill any current GPU).
const EW_MAX_BLOCKS: usize = 4096;

/// Most matrices one grouped GEMV launch multiplies ([`GpuLinear::forward_group`];
/// `BF16_GEMV_PARTS` and `INT8_GEMV_PARTS` in linear.cu): a gated-DeltaNet layer's four input
/// projections.
pub const GEMV_GROUP_MAX: usize = 4;

/// A GEMV family's kernel names: one row per warp, then four; m = 1, 2, 4, 8 in each.
type GemvNames = [[&'static str; 4]; 2];

/// The grouped GEMV's matrices (`GemvParts` in linear.cu; same field order and types): part
/// `p`'s weight and output, and the running end of the parts' rows.
#[repr(C)]
#[derive(Clone, Copy)]
struct GemvParts {
    w: [u64; GEMV_GROUP_MAX],
    y: [u64; GEMV_GROUP_MAX],
    end: [i32; GEMV_GROUP_MAX],
}

// SAFETY: plain old data of the kernel's parameter layout (pointers as u64, ints as i32).
unsafe impl DeviceRepr for GemvParts {}
const _: () = assert!(std::mem::size_of::<GemvParts>() == 80);

/// The grouped INT8 GEMV's matrices (`Int8GemvParts` in linear.cu; same field order and types):
/// part `p`'s weight, row scales and output, and the running end of the parts' rows.
#[repr(C)]
#[derive(Clone, Copy)]
struct Int8GemvParts {
    w: [u64; GEMV_GROUP_MAX],
    scale: [u64; GEMV_GROUP_MAX],
    y: [u64; GEMV_GROUP_MAX],
    end: [i32; GEMV_GROUP_MAX],
}

// SAFETY: plain old data of the kernel's parameter layout (pointers as u64, ints as i32).
unsafe impl DeviceRepr for Int8GemvParts {}
const _: () = assert!(std::mem::size_of::<Int8GemvParts>() == 112);

/// How a [`GpuLinear`] stores its weight.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LinearQuant {
    /// The BF16 checkpoint values.
    Bf16,
    /// Weight-only INT8, symmetric per output row, f32 scales.
    Int8,
}

impl FromStr for LinearQuant {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "bf16" => Ok(LinearQuant::Bf16),
            "int8" => Ok(LinearQuant::Int8),
            _ => Err(format!("unknown linear precision {s:?}: expected bf16 or int8")),
        }
    }
}

impl fmt::Display for LinearQuant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LinearQuant::Bf16 => "bf16",
            LinearQuant::Int8 => "int8",
        })
    }
}

/// Weight-only symmetric INT8 per row of a row-major BF16 `[rows, cols]` matrix:
/// `s_r = max_c |w[r, c]| / 127`, `q = round(w / s_r)` (half away from zero), `s_r = 0` and
/// `q = 0` for an all-zero row. Returns `(q [rows, cols], s [rows])`, or the first row holding a
/// non-finite value.
pub fn quantize_int8_rows(w: &[u16], rows: usize, cols: usize) -> Result<(Vec<i8>, Vec<f32>), usize> {
    let mut q = Vec::with_capacity(rows * cols);
    let mut s = Vec::with_capacity(rows);
    for (r, row) in w.chunks_exact(cols.max(1)).take(rows).enumerate() {
        let vals = row.iter().map(|&b| krasis_core::dtype::bf16_to_f32(b));
        let mut amax = 0.0f32;
        for v in vals.clone() {
            if !v.is_finite() {
                return Err(r);
            }
            amax = amax.max(v.abs());
        }
        let scale = amax / 127.0;
        s.push(scale);
        if scale == 0.0 {
            q.extend(std::iter::repeat_n(0i8, cols));
        } else {
            q.extend(vals.map(|v| (v / scale).round().clamp(-127.0, 127.0) as i8));
        }
    }
    Ok((q, s))
}

pub(crate) fn check(op: &'static str, ok: bool, detail: impl FnOnce() -> String) -> Result<(), GpuError> {
    if ok {
        Ok(())
    } else {
        Err(GpuError::shape(op, detail()))
    }
}

pub(crate) use crate::kernels::{launch_err, to_i32};

pub(crate) fn align_up(v: usize, a: usize) -> usize {
    v.div_ceil(a) * a
}

/// Grid for a grid-stride loop over `n` elements.
pub(crate) fn ew_cfg(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(EW_BLOCK as usize).clamp(1, EW_MAX_BLOCKS) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (EW_BLOCK, 1, 1), shared_mem_bytes: 0 }
}

/// Per-device state of the GEMM paths: a cuBLAS handle bound to the device's compute stream, the
/// cuBLAS workspace, and a growable scratch buffer (BF16 activations, expanded INT8 tiles, the
/// MoE intermediates), all charged to the VRAM budget. Ops lock it for the span of their
/// launches; since everything on a stream runs in order, the scratch is reused safely call after
/// call. Work on the device's side stream ([`GpuDevice::on_side_stream`]) gets a second lane of
/// its own (handle, workspace, scratch), made and sized from the compute stream by
/// [`GemmContext::reserve_side`] before the work moves there.
pub struct GemmContext {
    inner: Mutex<Inner>,
    side: OnceLock<Mutex<Inner>>,
    stream: Arc<CudaStream>,
    ctx: Arc<CudaContext>,
    /// [`GemmContext::set_fixed_rows`]: the rows of every cuBLAS call, 0 when off.
    fixed_rows: AtomicUsize,
}

pub(crate) struct Inner {
    // Field order: the handle is destroyed before its workspace is freed.
    handle: CublasHandle,
    _workspace: Option<DeviceBuffer<u8>>,
    scratch: Option<DeviceBuffer<u8>>,
    scratch_ptr: u64,
}

impl Inner {
    /// A handle bound to `stream` with a budget-charged workspace. The CUDA context must be
    /// current on this thread.
    fn new(dev: &GpuDevice, stream: &CudaStream) -> Result<Self, GpuError> {
        let lib = cublas::cublas()?;
        // SAFETY: the stream belongs to the current context and outlives the handle (the device
        // holds it, and the GemmContext's users hold the device).
        let handle = unsafe { CublasHandle::new(lib, stream.cu_stream())? };
        let ws = dev.alloc_zeros::<u8>(CUBLAS_WORKSPACE_BYTES, "cuBLAS workspace")?;
        let (ws_ptr, _g) = ws.device_ptr(dev.stream());
        // SAFETY: the workspace lives in `Inner` next to the handle and is dropped after it.
        let used = unsafe { handle.set_workspace(ws_ptr, CUBLAS_WORKSPACE_BYTES)? };
        drop(_g);
        Ok(Inner { handle, _workspace: used.then_some(ws), scratch: None, scratch_ptr: 0 })
    }

    /// Device address of the scratch (valid while the lock is held); 0 when none was needed.
    pub(crate) fn scratch_ptr(&self) -> u64 {
        self.scratch_ptr
    }

    pub(crate) fn handle(&self) -> &CublasHandle {
        &self.handle
    }

    fn scratch_len(&self) -> usize {
        self.scratch.as_ref().map_or(0, |b| b.len())
    }

    /// Makes the scratch at least `bytes` long. Growth allocates on the compute stream; the old
    /// buffer is freed stream-ordered, after the work already queued on it.
    fn grow(&mut self, dev: &GpuDevice, bytes: usize) -> Result<(), GpuError> {
        let have = self.scratch_len();
        if bytes <= have {
            return Ok(());
        }
        self.scratch = None;
        self.scratch_ptr = 0;
        // Grow by at least half again so a slowly rising m does not reallocate every call;
        // fall back to the exact size when the headroom does not fit the budget.
        let roomy = bytes.max(have + have / 2);
        // SAFETY: scratch contents are always written by an op before being read.
        let buf = match unsafe { dev.alloc_uninit::<u8>(roomy, "GEMM scratch") } {
            Ok(b) => b,
            Err(GpuError::VramBudget { .. }) if roomy > bytes => unsafe {
                dev.alloc_uninit::<u8>(bytes, "GEMM scratch")?
            },
            Err(e) => return Err(e),
        };
        let (p, _g) = buf.device_ptr(dev.stream());
        self.scratch_ptr = p;
        drop(_g);
        self.scratch = Some(buf);
        Ok(())
    }
}

impl GemmContext {
    /// Loads cuBLAS (see [`crate::cublas`]), creates a handle on `dev`'s compute stream and gives
    /// it a budget-charged workspace.
    pub fn new(dev: &GpuDevice) -> Result<Self, GpuError> {
        let ctx = Arc::clone(dev.context());
        ctx.bind_to_thread().map_err(|e| GpuError::driver("cuCtxSetCurrent", e))?;
        let inner = Inner::new(dev, dev.main_stream())?;
        Ok(GemmContext {
            inner: Mutex::new(inner),
            side: OnceLock::new(),
            stream: Arc::clone(dev.main_stream()),
            ctx,
            fixed_rows: AtomicUsize::new(0),
        })
    }

    /// Row-invariant products (module docs): with `Some(n)`, every linear run through this
    /// context multiplies in cuBLAS calls of exactly `n` rows (the engine passes
    /// [`FIXED_ROWS`]), so a row's outputs are the same bits whatever the call's other rows;
    /// `None` (the default) picks the fastest kernel for each `m`. The engine sets it per forward
    /// call (prefill calls on, decode steps off); the routed experts' kernels read it too
    /// ([`crate::GpuExperts`]: the grouped path at every size).
    pub fn set_fixed_rows(&self, rows: Option<usize>) {
        self.fixed_rows.store(rows.unwrap_or(0), Ordering::Relaxed);
    }

    /// [`GemmContext::set_fixed_rows`]'s setting.
    pub fn fixed_rows(&self) -> Option<usize> {
        Some(self.fixed_rows.load(Ordering::Relaxed)).filter(|&n| n > 0)
    }

    /// Where libcublas was loaded from.
    pub fn cublas_path(&self) -> &'static str {
        cublas::cublas().map(|c| c.path()).unwrap_or("")
    }

    /// Current scratch size in bytes (the compute stream's lane).
    pub fn scratch_bytes(&self) -> usize {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).scratch_len()
    }

    /// Grows the scratch to at least `bytes` now (e.g. before capturing a CUDA graph, so that no
    /// forward call allocates).
    pub fn reserve(&self, dev: &GpuDevice, bytes: usize) -> Result<(), GpuError> {
        self.lock(dev, "GemmContext::reserve", bytes).map(|_| ())
    }

    /// Makes the side stream's lane (on first use) and grows its scratch to at least `bytes`, from
    /// the compute stream: GEMMs inside [`GpuDevice::on_side_stream`] cannot allocate, so the
    /// caller sizes the lane for them first ([`GpuLinear::gemm_scratch_bytes`]).
    pub fn reserve_side(&self, dev: &GpuDevice, bytes: usize) -> Result<(), GpuError> {
        const OP: &str = "GemmContext::reserve_side";
        self.check_device(dev, OP)?;
        check(OP, !dev.on_side(), || "called on the side stream".to_string())?;
        self.ctx.bind_to_thread().map_err(|e| GpuError::driver("cuCtxSetCurrent", e))?;
        if self.side.get().is_none() {
            let lane = Inner::new(dev, dev.side_stream()?)?;
            let _ = self.side.set(Mutex::new(lane)); // a racing thread's lane serves as well
        }
        let lane = self.side.get().expect("set above");
        lane.lock().unwrap_or_else(|p| p.into_inner()).grow(dev, bytes)
    }

    /// Checks that the context belongs to `dev`.
    pub(crate) fn check_device(&self, dev: &GpuDevice, op: &'static str) -> Result<(), GpuError> {
        check(op, Arc::ptr_eq(&self.stream, dev.main_stream()), || {
            "the GemmContext was created for another GpuDevice (stream)".to_string()
        })
    }

    /// Locks the lane of the stream this thread launches on for one op: checks the context
    /// belongs to `dev`, binds the CUDA context to this thread, and makes the scratch at least
    /// `bytes` long (on the side stream only within what [`GemmContext::reserve_side`] made).
    pub(crate) fn lock(
        &self,
        dev: &GpuDevice,
        op: &'static str,
        bytes: usize,
    ) -> Result<MutexGuard<'_, Inner>, GpuError> {
        self.check_device(dev, op)?;
        self.ctx.bind_to_thread().map_err(|e| GpuError::driver("cuCtxSetCurrent", e))?;
        if !dev.on_side() {
            let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
            g.grow(dev, bytes)?;
            return Ok(g);
        }
        let lane = self.side.get();
        check(op, lane.is_some(), || {
            "cuBLAS asked for on the side stream before GemmContext::reserve_side".to_string()
        })?;
        let g = lane.expect("checked").lock().unwrap_or_else(|p| p.into_inner());
        let have = g.scratch_len();
        check(op, bytes <= have, || {
            format!("the side stream's GEMM scratch holds {have} bytes, {bytes} needed (GemmContext::reserve_side sizes it first)")
        })?;
        Ok(g)
    }
}

impl Drop for GemmContext {
    fn drop(&mut self) {
        // cublasDestroy needs the handle's context current; errors at teardown are ignored.
        let _ = self.ctx.bind_to_thread();
    }
}

impl fmt::Debug for GemmContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GemmContext").field("scratch_bytes", &self.scratch_bytes()).finish()
    }
}

/// Carves 256-byte-aligned sub-buffers out of the scratch.
pub(crate) struct Carve {
    base: u64,
    off: usize,
}

impl Carve {
    pub(crate) fn new(base: u64) -> Self {
        Carve { base, off: 0 }
    }

    /// Bytes needed for the given sub-buffer sizes.
    pub(crate) fn total(sizes: &[usize]) -> usize {
        sizes.iter().map(|&s| align_up(s, SCRATCH_ALIGN)).sum()
    }

    pub(crate) fn take(&mut self, bytes: usize) -> u64 {
        let p = self.base + self.off as u64;
        self.off += align_up(bytes, SCRATCH_ALIGN);
        p
    }
}

enum Weights {
    Bf16(DeviceBuffer<u16>),
    /// `q [rows, ldw]` (zero padded), `scale [rows]`.
    Int8 {
        q: DeviceBuffer<i8>,
        scale: DeviceBuffer<f32>,
        ldw: usize,
    },
}

/// Which kernel multiplies by a BF16 weight (see [`GpuLinear::set_bf16_path`]).
#[doc(hidden)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Bf16Path {
    /// The GEMV for `m <= BF16_GEMV_MAX_M` with [`bf16_gemv_rows_per_warp`]'s rule, else cuBLAS.
    #[default]
    Auto,
    /// cuBLAS for every `m`.
    Cublas,
    /// The GEMV with this many rows per warp (1 or 4) for `m <= BF16_GEMV_MAX_M`, else cuBLAS.
    Gemv { rows_per_warp: usize },
}

/// Rows per warp of the BF16 GEMV for a `[rows, _]` weight, `m` tokens and `sms` SMs: 1 for one
/// token (that kernel is held to 64 registers, so twice as many warps fit an SM as with 4 rows:
/// on the H200, GLM-4.5-Air's q/k/v 30.5 against 36 µs, a 102400-row head 95 against 107); else
/// 4 when that still leaves `BF16_GEMV_WARPS_PER_SM` warps per SM (or
/// `BF16_GEMV_MIN_WARPS_PER_SM` for `m >= 4`, where re-using each staged x value for 4 rows pays
/// most), else 1.
pub fn bf16_gemv_rows_per_warp(rows: usize, m: usize, sms: usize) -> usize {
    let per_sm = if m >= 4 { BF16_GEMV_MIN_WARPS_PER_SM } else { BF16_GEMV_WARPS_PER_SM };
    if m > 1 && rows / 4 >= per_sm * sms.max(1) {
        4
    } else {
        1
    }
}

/// Rows per warp of the INT8 GEMV for `rows` output rows on `sms` SMs: 4 (each lane's x loads
/// serve four rows) while that still leaves `INT8_GEMV_MIN_WARPS_PER_SM` warps per SM, else 1.
/// Every lane sums its columns in the same order either way, so both give the same bits.
pub fn int8_gemv_rows_per_warp(rows: usize, sms: usize) -> usize {
    if rows / 4 >= INT8_GEMV_MIN_WARPS_PER_SM * sms.max(1) {
        4
    } else {
        1
    }
}

/// A grouped GEMV launch's kernel (of `names`, by rows per warp and `m` rounded up to a power of
/// two) and its parts' running row ends (unused parts repeat the last), after checking that
/// there are 1 to [`GEMV_GROUP_MAX`] parts and every part but the last splits at a multiple of
/// `r`. `name` is the linear's, for the errors.
fn gemv_launch_plan(
    name: &str,
    op: &'static str,
    names: &GemvNames,
    m: usize,
    r: usize,
    rows_of: &[usize],
) -> Result<(&'static str, [i32; GEMV_GROUP_MAX]), GpuError> {
    let by_r = match r {
        1 => &names[0],
        4 => &names[1],
        _ => return Err(GpuError::shape(op, format!("{}: no GEMV for {r} rows per warp", name))),
    };
    let Some(&fname) = by_r.get(m.next_power_of_two().trailing_zeros() as usize).filter(|_| m >= 1) else {
        return Err(GpuError::shape(op, format!("{}: no GEMV for m = {m}", name)));
    };
    check(op, (1..=GEMV_GROUP_MAX).contains(&rows_of.len()), || {
        format!("{}: {} matrices in one GEMV launch (1 to {GEMV_GROUP_MAX})", name, rows_of.len())
    })?;
    check(op, rows_of[..rows_of.len() - 1].iter().all(|n| n.is_multiple_of(r)), || {
        format!("{}: parts of {rows_of:?} rows do not split at multiples of {r}", name)
    })?;
    let mut end = [0i32; GEMV_GROUP_MAX];
    let mut rows = 0usize;
    for (i, e) in end.iter_mut().enumerate() {
        rows += rows_of.get(i).copied().unwrap_or(0);
        *e = to_i32(op, "rows", rows)?;
    }
    Ok((fname, end))
}

/// One dense linear layer resident on the GPU.
pub struct GpuLinear {
    name: String,
    rows: usize,
    cols: usize,
    w: Weights,
    bf16_path: Bf16Path,
    /// x enters the products unrounded ([`GpuLinear::set_exact_input`]).
    exact_input: bool,
}

impl fmt::Debug for GpuLinear {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GpuLinear")
            .field("name", &self.name)
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .field("quant", &self.quant())
            .finish()
    }
}

impl GpuLinear {
    /// `w`: BF16 bits, row-major `[rows, cols]` (HF `out × in`). `Int8` quantises with
    /// [`quantize_int8_rows`] on the host. Allocations are charged to the budget as `name`.
    pub fn new(
        dev: &GpuDevice,
        name: &str,
        w: &[u16],
        rows: usize,
        cols: usize,
        quant: LinearQuant,
    ) -> Result<Self, GpuError> {
        const OP: &str = "GpuLinear::new";
        check(OP, rows > 0 && cols > 0, || format!("{name}: empty weight [{rows}, {cols}]"))?;
        check(OP, rows.checked_mul(cols) == Some(w.len()), || {
            format!("{name}: weight has {} elements, not [{rows}, {cols}]", w.len())
        })?;
        to_i32(OP, "rows", rows)?;
        to_i32(OP, "cols", align_up(cols, INT8_ROW_ALIGN))?;
        let w = match quant {
            LinearQuant::Bf16 => Weights::Bf16(dev.upload(w, name)?),
            LinearQuant::Int8 => {
                let ldw = align_up(cols, INT8_ROW_ALIGN);
                // Charge before building the host copy, so an over-budget layer fails fast.
                let need = rows as u64 * (ldw as u64 + 4);
                let remaining = dev.budget().remaining();
                if need > remaining {
                    return Err(GpuError::VramBudget {
                        requested: need,
                        used: dev.budget().used(),
                        budget: dev.budget().budget(),
                        what: name.to_string(),
                    });
                }
                let (q, scale) = quantize_int8_rows(w, rows, cols)
                    .map_err(|r| GpuError::shape(OP, format!("{name}: row {r} holds a non-finite weight")))?;
                let mut padded = vec![0i8; rows * ldw];
                for (dst, src) in padded.chunks_exact_mut(ldw).zip(q.chunks_exact(cols)) {
                    dst[..cols].copy_from_slice(src);
                }
                let q = dev.upload(&padded, name)?;
                let scale = dev.upload(&scale, &format!("{name} scales"))?;
                Weights::Int8 { q, scale, ldw }
            }
        };
        Ok(GpuLinear { name: name.to_string(), rows, cols, w, bf16_path: Bf16Path::Auto, exact_input: false })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Output features.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input features.
    pub fn cols(&self) -> usize {
        self.cols
    }

    pub fn quant(&self) -> LinearQuant {
        match self.w {
            Weights::Bf16(_) => LinearQuant::Bf16,
            Weights::Int8 { .. } => LinearQuant::Int8,
        }
    }

    /// Device bytes of the weight (and scales), padding included.
    pub fn weight_bytes(&self) -> usize {
        match &self.w {
            Weights::Bf16(b) => b.len() * 2,
            Weights::Int8 { q, scale, .. } => q.len() + scale.len() * 4,
        }
    }

    /// Whether [`GpuLinear::forward`] of `m` rows through `ctx` runs a GEMV of its own (no
    /// cuBLAS, no GEMM scratch): never with fixed rows.
    pub fn runs_alone(&self, ctx: &GemmContext, m: usize) -> bool {
        if ctx.fixed_rows().is_some() {
            return false;
        }
        match &self.w {
            Weights::Bf16(_) => m <= BF16_GEMV_MAX_M && self.bf16_path != Bf16Path::Cublas && !self.exact_input,
            Weights::Int8 { .. } => m <= INT8_GEMV_MAX_M,
        }
    }

    /// GEMM scratch bytes [`GpuLinear::forward`] of `m` rows through `ctx` locks (0 for a
    /// GEMV): what [`GemmContext::reserve_side`] must provide before it runs on the side stream.
    pub fn gemm_scratch_bytes(&self, ctx: &GemmContext, m: usize) -> usize {
        if self.runs_alone(ctx, m) {
            return 0;
        }
        let fixed = ctx.fixed_rows();
        let (xb_bytes, pad) = (self.staged_x_bytes(fixed, m), self.pad_block_bytes(fixed, m));
        match &self.w {
            Weights::Bf16(_) => Carve::total(&[xb_bytes, pad]),
            Weights::Int8 { ldw, .. } => Carve::total(&[xb_bytes, pad, self.int8_tile_rows(*ldw) * ldw * 2]),
        }
    }

    /// Bytes of `m` rows of x staged as BF16 for cuBLAS ([`GpuLinear::stage_x`]): one copy, or
    /// its two halves with exact input; with fixed rows, padded to whole blocks.
    fn staged_x_bytes(&self, fixed: Option<usize>, m: usize) -> usize {
        let copies = if self.exact_input { 2 } else { 1 };
        let m = fixed.map_or(m, |b| m.next_multiple_of(b));
        copies * m * align_up(self.cols, 8) * 2
    }

    /// Bytes of the padded last block's f32 outputs (`[block, rows]`) with fixed rows when `m` is
    /// not a whole number of blocks; 0 otherwise ([`BfGemm::run_fixed`]).
    fn pad_block_bytes(&self, fixed: Option<usize>, m: usize) -> usize {
        fixed.map_or(0, |b| if m.is_multiple_of(b) { 0 } else { b * self.rows * 4 })
    }

    /// `x [m, cols]` staged as BF16 at `xb` (row stride `align_up(cols, 8)`): rounded, or as its
    /// two halves with exact input ([`convert_x_split`]).
    /// With fixed rows the rows past `m` up to the block are zeroed (their outputs are dropped;
    /// zeros keep them finite).
    fn stage_x(&self, dev: &GpuDevice, x: u64, xb: u64, m: i32, fixed: Option<usize>) -> Result<(), GpuError> {
        const OP: &str = "GpuLinear::forward (staging x)";
        let (cols, ldx) = (self.cols, align_up(self.cols, 8));
        if let Some(block) = fixed {
            check(OP, !self.exact_input, || {
                format!("{}: fixed rows with exact input (the precise mode has no row-invariant form)", self.name)
            })?;
            let (m, padded) = (m as usize, (m as usize).next_multiple_of(block));
            if padded > m {
                let (at, bytes) = (xb + (m * ldx * 2) as u64, (padded - m) * ldx * 2);
                // SAFETY: the scratch holds `padded` rows of `ldx` BF16 (`staged_x_bytes`).
                let r = unsafe { cudarc::driver::sys::cuMemsetD8Async(at, 0, bytes, dev.stream().cu_stream()) };
                r.result().map_err(|e| GpuError::driver("cuMemsetD8Async", e))?;
            }
        }
        if self.exact_input {
            convert_x_split(dev, x, xb, m, cols, ldx)
        } else {
            convert_x(dev, x, xb, m, cols, ldx)
        }
    }

    /// `gemm` over x as [`GpuLinear::stage_x`] staged it, into an f32 `y`; with `fixed`
    /// (`Some((block, pad))`), in calls of `block` rows ([`BfGemm::run_fixed`]).
    fn gemm_staged(
        &self,
        dev: &GpuDevice,
        gemm: BfGemm,
        h: &CublasHandle,
        y: u64,
        ldy: usize,
        fixed: Option<(usize, u64)>,
    ) -> Result<(), GpuError> {
        match fixed {
            Some((block, pad)) => gemm.run_fixed(dev, h, y, ldy, block, pad),
            None if self.exact_input => gemm.run_halves(h, y, ldy),
            None => gemm.run(h, y, ldy),
        }
    }

    /// Rows of the INT8 weight expanded to BF16 per GEMM of the tiled path.
    fn int8_tile_rows(&self, ldw: usize) -> usize {
        (INT8_DEQUANT_TILE_BYTES / (ldw * 2)).clamp(1, self.rows)
    }

    /// Whether x enters the products unrounded (the precise GPU mode): every BF16 product then
    /// runs on cuBLAS with x as two BF16 halves, two GEMMs into one f32 `y` (module docs). Off by
    /// default: x is rounded to BF16, as transformers' BF16 run does.
    pub fn set_exact_input(&mut self, exact: bool) {
        self.exact_input = exact;
    }

    /// [`GpuLinear::set_exact_input`]'s setting.
    pub fn exact_input(&self) -> bool {
        self.exact_input
    }

    /// Forces the kernel of a BF16 weight (no effect on INT8). For tests and tuning: every path
    /// rounds x to BF16 and accumulates in f32, so they agree up to f32 rounding order.
    #[doc(hidden)]
    pub fn set_bf16_path(&mut self, path: Bf16Path) {
        self.bf16_path = path;
    }

    /// `y[m, rows] = x[m, cols] · Wᵀ`; `x` and `y` f32 row-major, f32 accumulation. `y` is
    /// overwritten. `ctx` must belong to `dev`. Never synchronises.
    pub fn forward(
        &self,
        dev: &GpuDevice,
        ctx: &GemmContext,
        x: &impl DevicePtr<f32>,
        m: usize,
        y: &mut (impl DevicePtrMut<f32> + ?Sized),
    ) -> Result<(), GpuError> {
        const OP: &str = "GpuLinear::forward";
        let rows = self.rows;
        self.check_shapes(OP, x.len(), y.len(), m)?;
        ctx.check_device(dev, OP)?;
        if m == 0 {
            return Ok(());
        }
        to_i32(OP, "m", m)?;
        let s = dev.stream();
        let (x_p, _gx) = x.device_ptr(s);
        let (y_p, _gy) = y.device_ptr_mut(s);
        match &self.w {
            Weights::Bf16(w) => {
                let gemv_rows = match self.bf16_path {
                    _ if !self.runs_alone(ctx, m) => None,
                    Bf16Path::Auto => {
                        Some(bf16_gemv_rows_per_warp(rows, m, dev.info().multiprocessors.max(1) as usize))
                    }
                    Bf16Path::Cublas => None,
                    Bf16Path::Gemv { rows_per_warp } => Some(rows_per_warp),
                };
                let (w_p, _gw) = w.device_ptr(s);
                if let Some(r) = gemv_rows {
                    return self.bf16_gemv(dev, w_p, x_p, m, y_p, r);
                }
                self.cublas_bf16(dev, ctx, w_p, x_p, m, (y_p, cublas::R_32F))
            }
            Weights::Int8 { q, scale, ldw } => {
                let (q_p, _gq) = q.device_ptr(s);
                let (s_p, _gs) = scale.device_ptr(s);
                if self.runs_alone(ctx, m) {
                    let r = int8_gemv_rows_per_warp(rows, dev.info().multiprocessors.max(1) as usize);
                    self.int8_gemv_launch(dev, x_p, m, r, *ldw, &[(q_p, s_p, y_p, rows)])
                } else {
                    self.int8_tiled(dev, ctx, q_p, s_p, *ldw, x_p, m, y_p)
                }
            }
        }
    }

    /// `y_p = x·W_pᵀ` for every `(W_p, y_p)` of `parts`, all of the same columns and the same `x`
    /// (a gated-DeltaNet layer's four input projections, attention's q, k and v, MLA's q and
    /// kv_a): one GEMV launch over all of them when every one is BF16 on the automatic path,
    /// `m <= BF16_GEMV_MAX_M`, there are at most [`GEMV_GROUP_MAX`] of them and every part but the
    /// last has a multiple of the launch's rows per warp; one INT8 GEMV launch when every one is
    /// INT8 with `m <= INT8_GEMV_MAX_M` (`int8_group`); on cuBLAS's path, x converted to BF16
    /// once for all the GEMMs; one [`forward`] per part otherwise. The values are those of one
    /// `forward` per part either way (a GEMV lane sums its columns in the same order whatever the
    /// rows per warp, and the parts' launch only picks each warp's matrix).
    ///
    /// [`forward`]: GpuLinear::forward
    pub fn forward_group(
        dev: &GpuDevice,
        ctx: &GemmContext,
        x: &impl DevicePtr<f32>,
        m: usize,
        parts: &mut [(&GpuLinear, &mut dyn DevicePtrMut<f32>)],
    ) -> Result<(), GpuError> {
        const OP: &str = "GpuLinear::forward_group";
        let Some(first) = parts.first().map(|p| p.0) else { return Ok(()) };
        let cols = first.cols;
        let bf16 = |l: &GpuLinear| matches!(l.w, Weights::Bf16(_));
        let same = parts.iter().all(|(l, _)| l.cols == cols && bf16(l));
        let all_rows: usize = parts.iter().map(|(l, _)| l.rows).sum();
        let sms = dev.info().multiprocessors.max(1) as usize;
        let r = bf16_gemv_rows_per_warp(all_rows, m, sms);
        let fused = same
            && parts.iter().all(|(l, _)| !l.exact_input)
            && parts.len() <= GEMV_GROUP_MAX
            && parts.iter().all(|(l, _)| l.bf16_path == Bf16Path::Auto)
            && (1..=BF16_GEMV_MAX_M).contains(&m)
            && ctx.fixed_rows().is_none()
            && parts[..parts.len() - 1].iter().all(|(l, _)| l.rows.is_multiple_of(r));
        let cublas = same && parts.iter().all(|(l, _)| l.writes_bf16(ctx, m));
        let int8 = |l: &GpuLinear| matches!(l.w, Weights::Int8 { .. });
        let int8_fused = m >= 1
            && parts.len() <= GEMV_GROUP_MAX
            && parts.iter().all(|(l, _)| l.cols == cols && int8(l) && l.runs_alone(ctx, m));
        if parts.len() > 1 && int8_fused {
            return Self::int8_group(dev, ctx, x, m, parts);
        }
        if parts.len() == 1 || (!fused && !cublas) {
            for (l, y) in parts.iter_mut() {
                l.forward(dev, ctx, x, m, *y)?;
            }
            return Ok(());
        }
        Self::check_group(OP, dev, ctx, x.len(), m, parts)?;
        let scratch = parts.iter().map(|(l, _)| l.gemm_scratch_bytes(ctx, m)).max().unwrap_or(0);
        let s = dev.stream();
        let (x_p, _gx) = x.device_ptr(s);
        let mut ptrs = Vec::with_capacity(parts.len());
        let mut guards = Vec::with_capacity(2 * parts.len());
        for (l, y) in parts.iter_mut() {
            let Weights::Bf16(w) = &l.w else { unreachable!("checked above") };
            let (w_p, gw) = w.device_ptr(s);
            let (y_p, gy) = y.device_ptr_mut(s);
            guards.push(gw);
            guards.push(gy);
            ptrs.push((w_p, y_p, l.rows));
        }
        if fused {
            return first.bf16_gemv_launch(dev, x_p, m, r, &ptrs);
        }
        let (m_i, ldx) = (to_i32(OP, "m", m)?, align_up(cols, 8));
        let g = ctx.lock(dev, OP, scratch)?;
        let xb = g.scratch_ptr();
        convert_x(dev, x_p, xb, m_i, cols, ldx)?;
        for &(w_p, y_p, rows) in &ptrs {
            BfGemm { w: w_p, n: rows, k: cols, ldw: cols, xb, ldx, m: m_i }.run(g.handle(), y_p, rows)?;
        }
        Ok(())
    }

    /// [`GpuLinear::forward_group`] of INT8 parts that each run their own GEMV (same columns): one
    /// INT8 GEMV launch, four rows per warp where [`int8_gemv_rows_per_warp`] gives it for all the
    /// rows and every part but the last splits there, else one.
    fn int8_group(
        dev: &GpuDevice,
        ctx: &GemmContext,
        x: &impl DevicePtr<f32>,
        m: usize,
        parts: &mut [(&GpuLinear, &mut dyn DevicePtrMut<f32>)],
    ) -> Result<(), GpuError> {
        const OP: &str = "GpuLinear::forward_group (int8)";
        Self::check_group(OP, dev, ctx, x.len(), m, parts)?;
        to_i32(OP, "m", m)?;
        let all_rows: usize = parts.iter().map(|(l, _)| l.rows).sum();
        let r = int8_gemv_rows_per_warp(all_rows, dev.info().multiprocessors.max(1) as usize);
        let r = if parts[..parts.len() - 1].iter().all(|(l, _)| l.rows.is_multiple_of(r)) { r } else { 1 };
        let first: &GpuLinear = parts[0].0;
        // The same for every part: one column count, one padding rule.
        let Weights::Int8 { ldw, .. } = first.w else { unreachable!("checked by forward_group") };
        let s = dev.stream();
        let (x_p, _gx) = x.device_ptr(s);
        let (mut ptrs, mut guards) = (Vec::with_capacity(parts.len()), Vec::with_capacity(parts.len()));
        for (l, y) in parts.iter_mut() {
            let Weights::Int8 { q, scale, .. } = &l.w else { unreachable!("checked by forward_group") };
            let (q_p, gq) = q.device_ptr(s);
            let (s_p, gs) = scale.device_ptr(s);
            let (y_p, gy) = y.device_ptr_mut(s);
            guards.push((gq, gs, gy));
            ptrs.push((q_p, s_p, y_p, l.rows));
        }
        first.int8_gemv_launch(dev, x_p, m, r, ldw, &ptrs)
    }

    /// Every part of a [`GpuLinear::forward_group`] launch against `x`'s length and `m`, and the
    /// context against the device.
    fn check_group(
        op: &'static str,
        dev: &GpuDevice,
        ctx: &GemmContext,
        x_len: usize,
        m: usize,
        parts: &[(&GpuLinear, &mut dyn DevicePtrMut<f32>)],
    ) -> Result<(), GpuError> {
        for (l, y) in parts {
            l.check_shapes(op, x_len, y.len(), m)?;
        }
        ctx.check_device(dev, op)
    }

    /// Whether [`GpuLinear::forward_bf16`] runs for `m` rows through `ctx`: a BF16 weight on the
    /// cuBLAS path, without fixed rows (whose padded block is copied out in f32).
    pub fn writes_bf16(&self, ctx: &GemmContext, m: usize) -> bool {
        matches!(self.w, Weights::Bf16(_))
            && !self.runs_alone(ctx, m)
            && !self.exact_input
            && ctx.fixed_rows().is_none()
    }

    /// `y[m, rows] = x[m, cols] · Wᵀ` as [`GpuLinear::forward`] computes it, rounded to BF16 by
    /// the GEMM's epilogue (to nearest even) instead of written in f32: a BF16 consumer (the flash
    /// prefill's K and V) without the f32 round trip. Only where [`GpuLinear::writes_bf16`] says so.
    pub fn forward_bf16(
        &self,
        dev: &GpuDevice,
        ctx: &GemmContext,
        x: &impl DevicePtr<f32>,
        m: usize,
        y: &mut impl DevicePtrMut<u16>,
    ) -> Result<(), GpuError> {
        const OP: &str = "GpuLinear::forward_bf16";
        check(OP, self.writes_bf16(ctx, m), || {
            format!("{}: no BF16 output for {m} rows ({:?})", self.name, self.quant())
        })?;
        self.check_shapes(OP, x.len(), y.len(), m)?;
        ctx.check_device(dev, OP)?;
        let Weights::Bf16(w) = &self.w else { unreachable!("checked by writes_bf16") };
        let s = dev.stream();
        let (x_p, _gx) = x.device_ptr(s);
        let (y_p, _gy) = y.device_ptr_mut(s);
        let (w_p, _gw) = w.device_ptr(s);
        self.cublas_bf16(dev, ctx, w_p, x_p, m, (y_p, cublas::R_16BF))
    }

    /// Checks that `x` holds `[m, cols]` elements and `y` `[m, rows]`.
    fn check_shapes(&self, op: &'static str, x: usize, y: usize, m: usize) -> Result<(), GpuError> {
        let (rows, cols) = (self.rows, self.cols);
        check(op, x == m * cols, || format!("{}: x has {x} elements, not [{m}, {cols}]", self.name))?;
        check(op, y == m * rows, || format!("{}: y has {y} elements, not [{m}, {rows}]", self.name))
    }

    /// A BF16 weight `w` on cuBLAS: x converted to BF16 in the GEMM scratch, then
    /// `y (of y_type) = x·Wᵀ` with f32 sums.
    fn cublas_bf16(
        &self,
        dev: &GpuDevice,
        ctx: &GemmContext,
        w: u64,
        x: u64,
        m: usize,
        y: (u64, std::ffi::c_int),
    ) -> Result<(), GpuError> {
        const OP: &str = "GpuLinear::forward (cuBLAS)";
        let (rows, cols) = (self.rows, self.cols);
        let (m_i, ldx) = (to_i32(OP, "m", m)?, align_up(cols, 8));
        let fixed = ctx.fixed_rows();
        let g = ctx.lock(dev, OP, self.gemm_scratch_bytes(ctx, m))?;
        let mut carve = Carve::new(g.scratch_ptr());
        let xb = carve.take(self.staged_x_bytes(fixed, m));
        self.stage_x(dev, x, xb, m_i, fixed)?;
        let gemm = BfGemm { w, n: rows, k: cols, ldw: cols, xb, ldx, m: m_i };
        if y.1 == cublas::R_32F {
            let fixed = fixed.map(|b| (b, carve.take(self.pad_block_bytes(fixed, m))));
            self.gemm_staged(dev, gemm, g.handle(), y.0, rows, fixed)
        } else {
            // A BF16 output: never with exact input (`writes_bf16`).
            gemm.run_to(g.handle(), y, rows)
        }
    }

    /// The BF16 GEMV (`m <= BF16_GEMV_MAX_M`) with `r` rows per warp (1 or 4).
    fn bf16_gemv(&self, dev: &GpuDevice, w: u64, x: u64, m: usize, y: u64, r: usize) -> Result<(), GpuError> {
        self.bf16_gemv_launch(dev, x, m, r, &[(w, y, self.rows)])
    }

    /// The BF16 GEMV over `parts` (`(W, y, rows)`, this one's columns, at most
    /// [`GEMV_GROUP_MAX`], every part's rows but the last a multiple of `r`), in one launch.
    fn bf16_gemv_launch(
        &self,
        dev: &GpuDevice,
        x: u64,
        m: usize,
        r: usize,
        parts: &[(u64, u64, usize)],
    ) -> Result<(), GpuError> {
        const OP: &str = "GpuLinear::forward (bf16 gemv)";
        const NAMES: GemvNames = [
            ["bf16_gemv_m1_r1", "bf16_gemv_m2_r1", "bf16_gemv_m4_r1", "bf16_gemv_m8_r1"],
            ["bf16_gemv_m1_r4", "bf16_gemv_m2_r4", "bf16_gemv_m4_r4", "bf16_gemv_m8_r4"],
        ];
        let rows_of: Vec<usize> = parts.iter().map(|p| p.2).collect();
        let (fname, end) = gemv_launch_plan(&self.name, OP, &NAMES, m, r, &rows_of)?;
        let mut args_parts = GemvParts { w: [parts[0].0; GEMV_GROUP_MAX], y: [parts[0].1; GEMV_GROUP_MAX], end };
        for (i, &(w, y, _)) in parts.iter().enumerate() {
            args_parts.w[i] = w;
            args_parts.y[i] = y;
        }
        let rows = rows_of.iter().sum::<usize>();
        let sms = dev.info().multiprocessors.max(1) as usize;
        let warps = rows.div_ceil(r);
        let wpb = (warps / sms).clamp(1, BF16_GEMV_MAX_WARPS_PER_BLOCK);
        let wpb = 1usize << wpb.ilog2(); // a power of two: 1, 2, 4 or 8
                                         // x is staged `tile` columns at a time; a tile is a whole number of chunks.
        let chunk = BF16_GEMV_LOADS / r * BF16_GEMV_STEP_COLS;
        let tile = (BF16_GEMV_X_SMEM_BYTES / (2 * m) / chunk * chunk).max(chunk).min(align_up(self.cols, chunk));
        let cfg = LaunchConfig {
            grid_dim: (warps.div_ceil(wpb) as u32, 1, 1),
            block_dim: (wpb as u32 * 32, 1, 1),
            shared_mem_bytes: (m * tile * 2) as u32,
        };
        let (m_i, cols_i) = (m as i32, self.cols as i32);
        let tile_i = to_i32(OP, "tile", tile)?;
        let aligned = parts.iter().all(|p| p.0.is_multiple_of(16));
        let w_vec = i32::from(self.cols.is_multiple_of(8) && aligned);
        let x_vec4 = i32::from(self.cols.is_multiple_of(4) && x.is_multiple_of(16));
        let f = dev.function(if r == 1 { &LINEAR_BF16_GEMV_R1 } else { &LINEAR_BF16_GEMV_R4 }, fname)?;
        let mut args = kernel_args![&args_parts, &x, &m_i, &cols_i, &tile_i, &w_vec, &x_vec4];
        // SAFETY: arguments match the kernel's signature (`GemvParts` its struct); shapes checked
        // by the callers; the dynamic shared memory holds the kernel's [m, tile] BF16 x tile (at
        // most 32 KiB, no opt-in); the kernel reads only the (static) weights before waiting for
        // the previous kernel.
        unsafe { dev.launch_dependent(OP, &f, cfg, &mut args, true) }
    }

    /// The INT8 GEMV over `parts` (`(W, scale, y, rows)`, this one's columns and row stride `ldw`,
    /// at most [`GEMV_GROUP_MAX`], every part's rows but the last a multiple of `r`), in one
    /// dependent launch (the kernel reads only the static weights before it waits for the
    /// previous kernel).
    fn int8_gemv_launch(
        &self,
        dev: &GpuDevice,
        x: u64,
        m: usize,
        r: usize,
        ldw: usize,
        parts: &[(u64, u64, u64, usize)],
    ) -> Result<(), GpuError> {
        const OP: &str = "GpuLinear::forward (int8 gemv)";
        const NAMES: GemvNames = [
            ["int8_gemv_m1_r1", "int8_gemv_m2_r1", "int8_gemv_m4_r1", "int8_gemv_m8_r1"],
            ["int8_gemv_m1_r4", "int8_gemv_m2_r4", "int8_gemv_m4_r4", "int8_gemv_m8_r4"],
        ];
        let rows_of: Vec<usize> = parts.iter().map(|p| p.3).collect();
        let (fname, end) = gemv_launch_plan(&self.name, OP, &NAMES, m, r, &rows_of)?;
        let (w0, s0, y0, _) = parts[0];
        let mut args_parts =
            Int8GemvParts { w: [w0; GEMV_GROUP_MAX], scale: [s0; GEMV_GROUP_MAX], y: [y0; GEMV_GROUP_MAX], end };
        for (i, &(w, sc, y, _)) in parts.iter().enumerate() {
            args_parts.w[i] = w;
            args_parts.scale[i] = sc;
            args_parts.y[i] = y;
        }
        let rows = rows_of.iter().sum::<usize>();
        let warps = rows.div_ceil(r);
        let warps_per_block = GEMV_BLOCK as usize / 32;
        let cfg = LaunchConfig {
            grid_dim: (warps.div_ceil(warps_per_block) as u32, 1, 1),
            block_dim: (GEMV_BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        let (m_i, cols_i, ldw_i) = (m as i32, to_i32(OP, "cols", self.cols)?, to_i32(OP, "ldw", ldw)?);
        let x_vec4 = i32::from(self.cols.is_multiple_of(4) && x.is_multiple_of(16));
        let f = dev.function(&LINEAR_INT8_GEMV, fname)?;
        let mut args = kernel_args![&args_parts, &x, &m_i, &cols_i, &ldw_i, &x_vec4];
        // SAFETY: arguments match the kernel's signature (`Int8GemvParts` its struct); shapes
        // checked by the callers; no shared memory; the kernel reads only the (static) weights
        // before waiting for the previous kernel.
        unsafe { dev.launch_dependent(OP, &f, cfg, &mut args, true) }
    }

    #[allow(clippy::too_many_arguments)]
    fn int8_tiled(
        &self,
        dev: &GpuDevice,
        ctx: &GemmContext,
        q: u64,
        scale: u64,
        ldw: usize,
        x: u64,
        m: usize,
        y: u64,
    ) -> Result<(), GpuError> {
        const OP: &str = "GpuLinear::forward (int8 tiled)";
        let (rows, cols) = (self.rows, self.cols);
        let ldx = align_up(cols, 8);
        let tile_rows = self.int8_tile_rows(ldw);
        let fixed = ctx.fixed_rows();
        let g = ctx.lock(dev, OP, self.gemm_scratch_bytes(ctx, m))?;
        let mut carve = Carve::new(g.scratch_ptr());
        let xb = carve.take(self.staged_x_bytes(fixed, m));
        let pad = fixed.map(|b| (b, carve.take(self.pad_block_bytes(fixed, m))));
        let wb = carve.take(tile_rows * ldw * 2);
        let m_i = to_i32(OP, "m", m)?;
        self.stage_x(dev, x, xb, m_i, fixed)?;
        let s = dev.stream();
        let deq = dev.function(&LINEAR, "int8_dequant_bf16")?;
        let mut r0 = 0;
        while r0 < rows {
            let tr = tile_rows.min(rows - r0);
            let n16 = (tr * ldw / 16) as i64;
            let src = q + (r0 * ldw) as u64;
            let mut b = s.launch_builder(&deq);
            b.arg(&src).arg(&wb).arg(&n16);
            // SAFETY: `src` covers `tr` padded rows, `wb` holds `tile_rows * ldw` BF16.
            unsafe { b.launch(ew_cfg(n16 as usize)) }.map_err(launch_err(OP))?;
            // Rows r0..r0+tr of y's column-major [rows, m] view: pointer offset r0, ldc = rows.
            let gemm = BfGemm { w: wb, n: tr, k: cols, ldw, xb, ldx, m: m_i };
            // The padded block's rows at the same column offset.
            let pad = pad.map(|(b, p)| (b, p + (r0 * 4) as u64));
            self.gemm_staged(dev, gemm, g.handle(), y + (r0 * 4) as u64, rows, pad)?;
            r0 += tr;
        }
        let rows_i = to_i32(OP, "rows", rows)?;
        let f = dev.function(&LINEAR, "scale_rows_f32")?;
        let mut b = s.launch_builder(&f);
        b.arg(&y).arg(&scale).arg(&m_i).arg(&rows_i);
        // SAFETY: y is [m, rows], scale [rows].
        unsafe { b.launch(ew_cfg(m * rows)) }.map_err(launch_err(OP))?;
        Ok(())
    }
}

/// `xb[t, c] = bf16(x[t, c])` into `[m, ldx]` (padding zeroed).
fn convert_x(dev: &GpuDevice, x: u64, xb: u64, m: i32, cols: usize, ldx: usize) -> Result<(), GpuError> {
    convert_x_with(dev, "f32_to_bf16_pad", x, xb, m, cols, ldx)
}

/// `x` as its BF16 halves: hi into `xb [m, ldx]`, lo into `xb + m·ldx` (padding zeroed).
fn convert_x_split(dev: &GpuDevice, x: u64, xb: u64, m: i32, cols: usize, ldx: usize) -> Result<(), GpuError> {
    convert_x_with(dev, "f32_to_bf16_split_pad", x, xb, m, cols, ldx)
}

/// One block per row of `x [m, cols]` f32 through the conversion kernel `op` into `xb` (`[m, ldx]`
/// BF16, or two of them for the split).
fn convert_x_with(
    dev: &GpuDevice,
    op: &'static str,
    x: u64,
    xb: u64,
    m: i32,
    cols: usize,
    ldx: usize,
) -> Result<(), GpuError> {
    let (c_i, ld_i) = (to_i32(op, "cols", cols)?, to_i32(op, "ld", ldx)?);
    let f = dev.function(&LINEAR, op)?;
    let s = dev.stream();
    let mut b = s.launch_builder(&f);
    b.arg(&x).arg(&xb).arg(&m).arg(&c_i).arg(&ld_i);
    let cfg = LaunchConfig { grid_dim: (m as u32, 1, 1), block_dim: (EW_BLOCK, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: x is [m, cols] f32; xb holds what `op` writes ([m, ldx] BF16, twice for the split)
    // in the scratch the caller locked.
    unsafe { b.launch(cfg) }.map_err(launch_err(op))?;
    Ok(())
}

/// One BF16 × BF16 product on cuBLAS: row-major `y[m, n] (ld ldy) = x[m, k] (ld ldx, BF16) ·
/// W[n, k]ᵀ (ld ldw, BF16)` with f32 sums; in cuBLAS's column-major terms `Yᵀ[n, m] = op_T(W) ·
/// Xᵀ`. The callers pass device buffers of these shapes on the handle's stream.
#[derive(Clone, Copy)]
struct BfGemm {
    w: u64,
    n: usize,
    k: usize,
    ldw: usize,
    xb: u64,
    ldx: usize,
    m: i32,
}

impl BfGemm {
    /// `y = x·Wᵀ` into an f32 `y`.
    fn run(&self, h: &CublasHandle, y: u64, ldy: usize) -> Result<(), GpuError> {
        self.run_beta(h, (y, cublas::R_32F), ldy, 0.0)
    }

    /// [`BfGemm::run`] with the output's type given: `R_32F`, or `R_16BF` (the f32 sums rounded
    /// by cuBLAS's epilogue).
    fn run_to(&self, h: &CublasHandle, y: (u64, std::ffi::c_int), ldy: usize) -> Result<(), GpuError> {
        self.run_beta(h, y, ldy, 0.0)
    }

    /// With `xb` holding x's two BF16 halves ([`convert_x_split`]: hi, then lo `m·ldx` elements
    /// on): `y = hi·Wᵀ`, then `y += lo·Wᵀ` (β = 1), both with f32 sums.
    fn run_halves(&self, h: &CublasHandle, y: u64, ldy: usize) -> Result<(), GpuError> {
        self.run(h, y, ldy)?;
        let lo = BfGemm { xb: self.xb + (self.m as usize * self.ldx * 2) as u64, ..*self };
        lo.run_beta(h, (y, cublas::R_32F), ldy, 1.0)
    }

    /// [`BfGemm::run`] in cuBLAS calls of exactly `block` rows (fixed rows, module docs): x
    /// staged with its rows padded to whole blocks; the last partial block's `[block, ldy]` f32
    /// outputs go to `pad` and its real rows are copied into `y` (same column offset, pitch
    /// `ldy`).
    fn run_fixed(
        &self,
        dev: &GpuDevice,
        h: &CublasHandle,
        y: u64,
        ldy: usize,
        block: usize,
        pad: u64,
    ) -> Result<(), GpuError> {
        let m = self.m as usize;
        let blk = to_i32("cublasGemmEx", "block", block)?;
        let mut r0 = 0;
        while r0 < m {
            let rows = block.min(m - r0);
            let part = BfGemm { xb: self.xb + (r0 * self.ldx * 2) as u64, m: blk, ..*self };
            let out = y + (r0 * ldy * 4) as u64;
            if rows == block {
                part.run(h, out, ldy)?;
            } else {
                part.run(h, pad, ldy)?;
                use cudarc::driver::sys::{CUmemorytype, CUDA_MEMCPY2D};
                let device = CUmemorytype::CU_MEMORYTYPE_DEVICE;
                let copy = CUDA_MEMCPY2D {
                    srcXInBytes: 0,
                    srcY: 0,
                    srcMemoryType: device,
                    srcHost: std::ptr::null(),
                    srcDevice: pad,
                    srcArray: std::ptr::null_mut(),
                    srcPitch: ldy * 4,
                    dstXInBytes: 0,
                    dstY: 0,
                    dstMemoryType: device,
                    dstHost: std::ptr::null_mut(),
                    dstDevice: out,
                    dstArray: std::ptr::null_mut(),
                    dstPitch: ldy * 4,
                    WidthInBytes: self.n * 4,
                    Height: rows,
                };
                // SAFETY: `pad` holds `[block, ldy]` f32 and `y` `[m, ldy]` from the callers'
                // offsets; the copy is stream-ordered after the GEMM that wrote `pad`.
                let r = unsafe { cudarc::driver::sys::cuMemcpy2DAsync_v2(&copy, dev.stream().cu_stream()) };
                r.result().map_err(|e| GpuError::driver("cuMemcpy2DAsync", e))?;
            }
            r0 += rows;
        }
        Ok(())
    }

    /// `y = x·Wᵀ + beta·y`.
    fn run_beta(
        &self,
        h: &CublasHandle,
        (y, y_type): (u64, std::ffi::c_int),
        ldy: usize,
        beta: f32,
    ) -> Result<(), GpuError> {
        const OP: &str = "cublasGemmEx";
        let (n, k, ldw, ldx, ldy) = (
            to_i32(OP, "n", self.n)?,
            to_i32(OP, "k", self.k)?,
            to_i32(OP, "ldw", self.ldw)?,
            to_i32(OP, "ldx", self.ldx)?,
            to_i32(OP, "ldy", ldy)?,
        );
        // SAFETY: the callers pass device buffers of the stated shapes on the handle's stream.
        unsafe {
            h.gemm_ex_f32_compute(
                (cublas::OP_T, cublas::OP_N),
                (n, self.m, k),
                1.0,
                (self.w, cublas::R_16BF, ldw),
                (self.xb, cublas::R_16BF, ldx),
                beta,
                (y, y_type, ldy),
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use krasis_core::dtype::{bf16_to_f32, f32_to_bf16};

    #[test]
    fn quant_parse_and_display() {
        for q in [LinearQuant::Bf16, LinearQuant::Int8] {
            assert_eq!(q.to_string().parse::<LinearQuant>().unwrap(), q);
        }
        assert_eq!("INT8".parse::<LinearQuant>().unwrap(), LinearQuant::Int8);
        assert!("int4".parse::<LinearQuant>().unwrap_err().contains("bf16 or int8"));
    }

    /// The INT8 rule on 132 SMs: four rows a warp from 4 · 4 · 132 = 2112 rows (GLM-4.5-Air's
    /// o_proj, 4096 rows, among them), one below.
    #[test]
    fn int8_gemv_rows_per_warp_rule() {
        for (rows, want) in [(1, 1), (2111, 1), (2112, 4), (4096, 4), (14336, 4), (102400, 4)] {
            assert_eq!(int8_gemv_rows_per_warp(rows, 132), want, "{rows} rows");
        }
        assert_eq!((int8_gemv_rows_per_warp(15, 0), int8_gemv_rows_per_warp(16, 0)), (1, 4), "no SM count: one SM");
    }

    /// The grouped launch's plan: the kernel by `m` rounded up to a power of two and the rows per
    /// warp, the running ends (unused parts repeat the last), and errors naming the linear for an
    /// `m` past 8 or of 0, a rows-per-warp count without kernels, no parts or too many, and a
    /// part that does not split at a multiple of the rows per warp.
    #[test]
    fn gemv_launch_plan_picks_the_kernel_and_the_ends() {
        const N: GemvNames = [["a1", "a2", "a4", "a8"], ["b1", "b2", "b4", "b8"]];
        let plan = |m, r, rows: &[usize]| gemv_launch_plan("lin", "op", &N, m, r, rows);
        for (m, want) in [(1, "a1"), (2, "a2"), (3, "a4"), (4, "a4"), (5, "a8"), (8, "a8")] {
            assert_eq!(plan(m, 1, &[7]).unwrap(), (want, [7, 7, 7, 7]), "m = {m}");
        }
        assert_eq!(plan(3, 4, &[12288, 1024, 1024]).unwrap(), ("b4", [12288, 13312, 14336, 14336]));
        assert_eq!(plan(1, 4, &[8, 4, 12, 5]).unwrap(), ("b1", [8, 12, 24, 29]));
        for (m, r, rows, needle) in [
            (9, 1, &[4usize][..], "m = 9"),
            (0, 1, &[4][..], "m = 0"),
            (1, 2, &[4][..], "2 rows per warp"),
            (1, 1, &[][..], "0 matrices"),
            (1, 1, &[1, 1, 1, 1, 1][..], "5 matrices"),
            (1, 4, &[6, 4][..], "multiples of 4"),
        ] {
            let e = plan(m, r, rows).unwrap_err().to_string();
            assert!(e.contains("lin") && e.contains(needle), "{e}");
        }
    }

    #[test]
    fn bf16_gemv_rows_per_warp_rule() {
        // An H100 (132 SMs): one token always takes 1 row per warp (lm_head too); m = 2, 3 with
        // rows for 16 warps per SM, or m >= 4 with rows to spare, takes 4.
        let sms = 132;
        for (rows, m, want) in [
            (3072, 1, 1),
            (576, 8, 1),
            (2048, 8, 1),
            (3072, 2, 1),
            (3072, 4, 4),
            (2816, 8, 4),
            (102400, 1, 1),
            (102400, 2, 4),
            (14336, 3, 4),
        ] {
            assert_eq!(bf16_gemv_rows_per_warp(rows, m, sms), want, "rows {rows}, m {m}");
        }
        assert_eq!(bf16_gemv_rows_per_warp(1, 1, 0), 1);
        // Both kernels' chunk (2048 / R columns) fits the x tile of 8 tokens.
        for r in [1, 4] {
            let chunk = BF16_GEMV_LOADS / r * BF16_GEMV_STEP_COLS;
            assert!(BF16_GEMV_X_SMEM_BYTES / (2 * BF16_GEMV_MAX_M) >= chunk);
        }
    }

    #[test]
    fn int8_rows_round_trip_within_half_a_step() {
        let (rows, cols) = (5, 13);
        let w: Vec<u16> = (0..rows * cols).map(|i| f32_to_bf16(((i * 37 % 23) as f32 - 11.0) * 0.173)).collect();
        let mut w = w;
        w[2 * cols..3 * cols].fill(0); // all-zero row
        let (q, s) = quantize_int8_rows(&w, rows, cols).unwrap();
        assert_eq!((q.len(), s.len()), (rows * cols, rows));
        assert_eq!(s[2], 0.0);
        for r in 0..rows {
            let row = &w[r * cols..(r + 1) * cols];
            let amax = row.iter().map(|&b| bf16_to_f32(b).abs()).fold(0.0f32, f32::max);
            assert!(amax == 0.0 || q[r * cols..(r + 1) * cols].iter().any(|&v| v.abs() == 127), "row {r}");
            for c in 0..cols {
                let err = (q[r * cols + c] as f32 * s[r] - bf16_to_f32(row[c])).abs();
                assert!(err <= s[r] * 0.5 * (1.0 + 1e-5), "row {r} col {c}: err {err}");
            }
        }
        let mut bad = w.clone();
        bad[3 * cols + 4] = 0x7f80; // +inf
        assert_eq!(quantize_int8_rows(&bad, rows, cols).unwrap_err(), 3);
    }
}
