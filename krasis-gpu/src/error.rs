//! The one error type of the crate. Every variant displays as one line a user can act on, except
//! [`GpuError::Compile`], which carries the NVRTC log after its first line.

use krasis_core::budget::format_bytes;

/// Why the GPU cannot be used, or why a GPU operation failed.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// `libcuda.so.1` could not be loaded: no NVIDIA driver on this machine.
    #[error("no CUDA driver found ({detail})")]
    NoDriver { detail: String },
    /// The driver loaded but reports no usable device (or `cuInit` failed).
    #[error("CUDA driver found but no GPU is usable: {detail}")]
    NoDevice { detail: String },
    /// The GPU ordinal asked for (`GpuOptions::ordinal`) names a device that does not exist.
    #[error("GPU {ordinal} does not exist: the CUDA driver sees {count} device(s)")]
    BadOrdinal { ordinal: usize, count: usize },
    /// A CUDA driver call failed.
    #[error("CUDA error in {op}: {detail}")]
    Driver { op: &'static str, detail: String },
    /// The dynamic loader (or a CUDA library) panicked; caught so that it cannot abort the run.
    #[error("CUDA library failure in {op}: {detail}")]
    Panicked { op: &'static str, detail: String },
    /// No libnvrtc could be loaded, so kernels cannot be compiled.
    #[error(
        "no NVRTC library found ({detail}); set KRASIS_NVRTC_LIB=/path/to/libnvrtc.so.12 or install the CUDA toolkit"
    )]
    NoNvrtc { detail: String },
    /// NVRTC rejected a kernel; `log` is NVRTC's program log.
    #[error("NVRTC failed to compile kernel `{kernel}` for {arch}:\n{log}")]
    Compile { kernel: String, arch: String, log: String },
    /// An NVRTC call other than the compile itself failed.
    #[error("NVRTC error in {op}: {detail}")]
    Nvrtc { op: &'static str, detail: String },
    /// An allocation would take the charged VRAM above the budget (`GpuOptions::vram_budget`).
    #[error(
        "VRAM budget exceeded allocating {what}: {} requested, {} already in use of a {} budget \
         (`GpuOptions::vram_budget`); raise the budget or choose a smaller configuration",
        format_bytes(*.requested), format_bytes(*.used), format_bytes(*.budget)
    )]
    VramBudget { requested: u64, used: u64, budget: u64, what: String },
    /// An explicit VRAM budget larger than the memory the device has free.
    #[error(
        "the VRAM budget (`GpuOptions::vram_budget`) of {} is more than the {} free on GPU {ordinal} ({name}); \
         use `VramBudgetSpec::Auto` or a smaller value",
        format_bytes(*.budget), format_bytes(*.free)
    )]
    BudgetAboveFree { budget: u64, free: u64, ordinal: usize, name: String },
    /// The driver itself ran out of memory inside the budget (another process took VRAM).
    #[error(
        "GPU out of memory allocating {what} ({}) although the VRAM budget allowed it: another process \
         is probably using the GPU; lower the VRAM budget (`GpuOptions::vram_budget`)",
        format_bytes(*.requested)
    )]
    OutOfMemory { requested: u64, what: String },
    /// A VRAM budget ([`crate::VramBudgetSpec`]) that does not parse.
    #[error("VRAM budget {value:?}: {reason}")]
    BadBudget { value: String, reason: String },
    /// No libcublas could be loaded, so the dense linears cannot run.
    #[error("{detail}")]
    NoCublas { detail: String },
    /// A cuBLAS call failed; `detail` is the status name and code.
    #[error("cuBLAS error in {op}: {detail}")]
    Cublas { op: &'static str, detail: String },
    /// A caller passed buffers whose sizes do not match the shapes.
    #[error("invalid arguments to {op}: {detail}")]
    Shape { op: &'static str, detail: String },
}

impl GpuError {
    pub(crate) fn driver(op: &'static str, e: cudarc::driver::DriverError) -> Self {
        GpuError::Driver { op, detail: e.to_string() }
    }

    pub(crate) fn shape(op: &'static str, detail: impl Into<String>) -> Self {
        GpuError::Shape { op, detail: detail.into() }
    }
}

pub(crate) use krasis_core::panic_text;
