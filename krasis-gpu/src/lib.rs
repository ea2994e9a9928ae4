//! GPU execution for Krasis: the CUDA driver through cudarc, kernels in CUDA C compiled by NVRTC
//! at first use and cached on disk, and a VRAM budget that every device allocation is charged
//! against.
//!
//! # Design note (krasis-gpu)
//!
//! **Dynamic loading, no CUDA at build time.** The crate links nothing from CUDA. cudarc is built
//! with `dynamic-loading` and the CUDA 12.8 bindings: `libcuda.so.1` (and later cuBLAS) are
//! `dlopen`ed at run time, and only symbols that every 12.8+ driver exports are called, so one
//! binary serves users on 12.x and 13.x drivers and runs (CPU only) on machines with no NVIDIA
//! driver at all. cudarc's loader panics on a missing library; [`probe`] and
//! [`GpuDevice::open`] check for the library first and also catch panics, so the answer is always
//! a one-line [`GpuError`] such as "no CUDA driver found (libcuda.so.1 not loadable)". libnvrtc
//! is loaded by this crate itself ([`nvrtc`]) so that any major version (13, 12, 11.2), a toolkit
//! under `$CUDA_HOME` or `/usr/local/cuda`, or an explicit `KRASIS_NVRTC_LIB` path (the PyPI
//! wheel in CI) works.
//!
//! **Kernels.** CUDA C sources live in `krasis-gpu/kernels/` and are compiled into the binary with
//! `include_str!` ([`kernels::ALL`]). They are header-free (BF16 is `unsigned short` with bit
//! conversions in `krasis_common.cuh`, passed to NVRTC as an in-memory header), so any NVRTC can
//! build them without the CUDA include tree. At first use a kernel is compiled for the device's
//! own architecture (`-arch=sm_XY` from its compute capability, to SASS; when NVRTC is older than
//! the GPU, PTX for the newest architecture it knows, which the driver JITs). No fast-math: every
//! kernel must agree with its scalar twin to rounding.
//!
//! **NVRTC cache.** Images are cached under `$KRASIS_NVRTC_CACHE`, else
//! `$XDG_CACHE_HOME/krasis/nvrtc`, else `~/.cache/krasis/nvrtc`. The file name is the whole key:
//! `{kernel}-{sm_90|compute_90}-nvrtc{major}.{minor}-{hash}.{cubin|ptx}`, where the 128-bit hash
//! covers the cache format version, the source, every header and the compile options; so an
//! edited kernel, another GPU architecture or another NVRTC release never reuses a stale image.
//! Writes go to a unique temporary file in the same directory and are renamed into place (atomic
//! on POSIX), so concurrent processes and crashes never leave a truncated image under a final
//! name; an image the driver refuses anyway is evicted and recompiled. A compile is logged on
//! stderr with its time and cache path; hits and misses are counted
//! ([`GpuDevice::kernel_cache_stats`]). A rejected kernel is [`GpuError::Compile`] with NVRTC's
//! log.
//!
//! **VRAM budget rule.** `--vram-budget BYTES|auto` becomes a [`VramBudget`] when the device is
//! opened: `auto` is the free memory at that moment minus [`AUTO_VRAM_SAFETY_MARGIN`] (1 GiB, for
//! what the budget does not see: module images, library workspaces, allocator slack); an explicit
//! value above the free memory is refused at open. Every device allocation goes through
//! [`GpuDevice`] (`alloc_zeros`, `alloc_uninit`, `upload`), is charged *before* the driver is
//! asked (rounded up to 512 bytes), and is released when its [`DeviceBuffer`] drops. Exceeding the
//! budget is [`GpuError::VramBudget`] naming what was being allocated, never a CUDA OOM crash; a
//! driver OOM inside the budget (another process took the memory) is [`GpuError::OutOfMemory`].
//! Components that size themselves (the KV cache, expert slots) ask [`VramBudget::remaining`].
//!
//! **Streams and events.** cudarc's automatic per-buffer event tracking is switched off (it
//! creates two events per allocation and records them around every launch). Instead every buffer
//! lives on the device's compute stream and cross-stream work is ordered with explicit events
//! ([`GpuDevice::new_event`], `CudaStream::record_event` / `wait`). Ops launch asynchronously and
//! never synchronise; only downloads do.
//!
//! **CI without a GPU.** `scripts/nvrtc-check.sh` installs libnvrtc from the PyPI wheel and runs
//! `cargo test -p krasis-gpu --test nvrtc_compile`, which compiles every kernel for sm_80, sm_89
//! and sm_90 and fails on any error. Without NVRTC that test prints `SKIPPED` and passes, unless
//! `KRASIS_REQUIRE_NVRTC=1`. The kernel tests (`--test kernels`) compare each kernel with a scalar
//! twin on random and ragged shapes; they skip visibly without a GPU.

pub mod attn_decode;
pub mod budget;
pub mod cache;
pub mod cublas;
pub mod delta_rule;
mod device;
pub mod elementwise;
mod error;
pub mod flash_prefill;
pub mod kernels;
pub mod kv_cache;
mod libsearch;
pub mod linear;
mod mapped;
pub mod mla_decode;
pub mod moe;
pub mod moe_pcie;
pub mod nvrtc;
pub mod relayout;
pub mod router;
pub mod sampling;

pub use attn_decode::{
    bench_mla_decode, bench_mla_decode_kernel, AttnOptions, DecodeBench, DecodeTiming, DecodeWorkspace,
};
pub use budget::{VramBudget, VramBudgetSpec, VramCharge, AUTO_VRAM_SAFETY_MARGIN};
pub use device::{probe, probe_ordinal, vram_budget_bytes, DeviceBuffer, DeviceInfo, GpuDevice, StreamState};
pub use elementwise::RowsView;
pub use error::GpuError;
pub use flash_prefill::{bench_gqa_prefill, bench_mla_prefill, FlashBench, FlashKernel, FlashPrefillArgs, HeadsLayout};
pub use kernels::{GqaShape, RopeLayout, RopePairing, SwiGluLayout};
pub use kv_cache::{GpuKvCache, KvCapacity, KvDtype};
pub use linear::{GemmContext, GpuLinear, LinearQuant};
pub use moe::GpuExperts;
pub use router::GpuRouter;
pub mod host_flag;
pub use host_flag::HostFlag;
pub use mapped::MappedHost;
pub use sampling::{GpuSampler, GpuSamplingParams};

/// Re-exported so callers name cudarc's types without depending on it directly.
pub use cudarc;

#[cfg(test)]
mod tests {
    use super::*;

    /// On a machine without an NVIDIA driver (this crate's CI), probing must return a clean
    /// one-line error, not panic. On a GPU machine it must succeed.
    #[test]
    fn probe_never_panics() {
        match probe() {
            Ok(info) => {
                assert!(info.total_bytes > 0 && info.compute_capability.0 > 0, "{info:?}");
                eprintln!("probe: {info}");
            }
            Err(e) => {
                let msg = e.to_string();
                eprintln!("probe: {msg}");
                assert!(!msg.contains('\n'), "{msg}");
                assert!(matches!(e, GpuError::NoDriver { .. } | GpuError::NoDevice { .. }), "{e:?}");
            }
        }
        // A second call answers the same way (the load result is cached, not retried into a panic).
        assert_eq!(probe().is_ok(), probe().is_ok());
        assert!(probe_ordinal(1 << 20).is_err());
    }
}
