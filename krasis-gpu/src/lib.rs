//! GPU execution through cudarc with dynamic loading: device selection, VRAM budget, NVRTC
//! kernels with an on-disk cache, attention/MoE/norm/rope/sampling kernels, CUDA graphs.
//!
//! Not built yet: it arrives with the GPU-runtime issue. Until then [`probe`] reports that
//! this build has no GPU support, and `--device gpu` refuses with that message.

/// Why no GPU can be used by this build or on this machine.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error("this krasis build has no GPU runtime yet; run with --device cpu")]
    NotBuilt,
}

/// Look for a usable GPU.
pub fn probe() -> Result<(), GpuError> {
    Err(GpuError::NotBuilt)
}
