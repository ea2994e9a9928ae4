//! Quantised experts from the CPU expert cache's records (`cpu-rb16-v1`) to the GPU tile layout
//! (`gpu-tile64-v1`) on the device (`kernels/relayout.cu`): the hybrid engine can stream the one
//! copy of the experts the CPU uses and lay it out for the tensor-core tiles after the copy,
//! instead of keeping a second copy in RAM. Same codes and scales; only the order changes. The
//! result is byte for byte what the host packer writes (test `relayout`).
//!
//! Asymmetric INT4 g32 records (`cpu-rb16-int4a-g32-v1`, `--cpu-expert-bits 4a`) have no
//! tensor-core kernel: they become the GPU's INT8 g32 (`relayout_int4a_int8`, each group
//! requantised from its dequantised values exactly as `krasis_quant::int4_asym::to_int8_g32`
//! does on the host), so those experts stream from their one copy too.

use cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use krasis_quant::cpu_layout::PackedLayout;
use krasis_quant::gpu_layout::GpuLayout;
use krasis_quant::int4_asym::ASYM_GROUP;
use krasis_quant::Bits;

use crate::kernels::{KernelSource, HEADERS};
use crate::{GpuDevice, GpuError};

pub const RELAYOUT: KernelSource = KernelSource {
    name: "relayout",
    src: include_str!("../kernels/relayout.cu"),
    headers: HEADERS,
    options: &[],
    functions: &["relayout_codes", "relayout_scales", "relayout_int4a_int8"],
};

/// Threads per block of both kernels.
const THREADS: u32 = 256;

/// `CpuPart` of the kernels (same field order and types).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct CpuPart {
    rows: i32,
    fused: i32,
    inter_pad: i32,
    k: i32,
    gs: i32,
    bits: i32,
    block_bytes: i32,
    header_bytes: i32,
    group_weight_bytes: i32,
}

// SAFETY: plain-old-data with the C layout of the kernel's struct.
unsafe impl DeviceRepr for CpuPart {}

/// Where the two parts of a CPU expert cache record lie: w13 (gate and up row blocks
/// interleaved) at 0, w2 at `w2_offset`, records `stride` bytes apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CpuRecordGeometry {
    pub w13: PackedLayout,
    pub w2: PackedLayout,
    pub w2_offset: usize,
    pub stride: usize,
}

/// The width of the GPU records a CPU part of layout `cpu` converts to: its own, or INT8 (same
/// groups of 32) for asymmetric INT4, which has no tile kernel.
pub fn converted_bits(cpu: &PackedLayout) -> Bits {
    if cpu.asym {
        Bits::Int8
    } else {
        cpu.bits
    }
}

/// One matrix part to convert: the CPU part (`fused`: a w13) and the GPU layout it becomes.
pub(crate) struct PartJob {
    pub cpu: PackedLayout,
    pub fused: bool,
    pub gpu: GpuLayout,
    /// Device addresses of expert 0's CPU part and GPU codes and scales.
    pub src: u64,
    pub codes: u64,
    pub scales: u64,
}

const OP: &str = "relayout";

fn to_i32(what: &str, v: usize) -> Result<i32, GpuError> {
    crate::kernels::to_i32(OP, what, v)
}

/// Enqueues on `stream` the conversion of `experts` experts' part `job` (CPU parts `src_stride`
/// apart, GPU codes and scales `dst_stride` apart).
///
/// # Safety
/// Every address must hold `experts` parts of the stated layouts, readable and writable on
/// `stream` until the launch is done.
pub(crate) unsafe fn convert_part(
    dev: &GpuDevice,
    stream: &cudarc::driver::CudaStream,
    job: &PartJob,
    experts: usize,
    src_stride: usize,
    dst_stride: usize,
) -> Result<(), GpuError> {
    if experts == 0 {
        return Ok(());
    }
    let (c, g) = (&job.cpu, &job.gpu);
    let half = if job.fused { c.rows / 2 } else { c.rows };
    let part = CpuPart {
        rows: to_i32("rows", half)?,
        fused: job.fused as i32,
        inter_pad: to_i32("inter_pad", if job.fused { g.rows / 2 } else { 0 })?,
        k: to_i32("k", c.k)?,
        gs: to_i32("gs", c.gs)?,
        bits: c.bits.bits() as i32,
        block_bytes: to_i32("block bytes", c.block_bytes())?,
        header_bytes: to_i32("header bytes", c.header_bytes())?,
        group_weight_bytes: to_i32("group bytes", c.group_weight_bytes())?,
    };
    let (ss, ds) = (src_stride as i64, dst_stride as i64);
    let y = u32::try_from(experts).map_err(|_| GpuError::shape(OP, format!("{experts} experts")))?;
    let chunks = to_i32("chunks", g.chunks())?;
    let cfg = |n: i32| LaunchConfig {
        grid_dim: ((n as u32).div_ceil(THREADS), y, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    if c.asym {
        // 4a → INT8 g32: one thread per GPU scale (row, group) writes it and its group's codes.
        // (The caller checked the GPU layout against `converted_bits` and the groups.)
        debug_assert!(g.bits == converted_bits(c) && g.gs == ASYM_GROUP && c.gs == ASYM_GROUP && g.fp4.is_none());
        let count = to_i32("scales", g.scale_count())?;
        let groups = to_i32("groups", g.groups())?;
        let f = dev.function(&RELAYOUT, "relayout_int4a_int8")?;
        let mut b = stream.launch_builder(&f);
        b.arg(&job.src).arg(&ss).arg(&job.codes).arg(&job.scales).arg(&ds).arg(&part).arg(&chunks).arg(&groups);
        b.arg(&count);
        // SAFETY: the caller's contract; the kernel reads inside each CPU part and writes the
        // codes and `count` scales of each expert.
        unsafe { b.launch(cfg(count)) }.map_err(crate::kernels::launch_err(OP))?;
        return Ok(());
    }
    let words = to_i32("words", g.weight_bytes() / 4)?;
    let f = dev.function(&RELAYOUT, "relayout_codes")?;
    let mut b = stream.launch_builder(&f);
    b.arg(&job.src).arg(&ss).arg(&job.codes).arg(&ds).arg(&part).arg(&chunks).arg(&words);
    // SAFETY: the caller's contract; the kernel reads inside each CPU part and writes `words`
    // words of each expert's codes.
    unsafe { b.launch(cfg(words)) }.map_err(crate::kernels::launch_err(OP))?;
    let count = to_i32("scales", g.scale_count())?;
    let groups = to_i32("groups", g.groups())?;
    let f = dev.function(&RELAYOUT, "relayout_scales")?;
    let mut b = stream.launch_builder(&f);
    b.arg(&job.src).arg(&ss).arg(&job.scales).arg(&ds).arg(&part).arg(&groups).arg(&count);
    // SAFETY: as above, `count` scales of each expert.
    unsafe { b.launch(cfg(count)) }.map_err(crate::kernels::launch_err(OP))?;
    Ok(())
}
