//! Page-locked host memory mapped into the device's address space: kernels read and write it
//! over PCIe with ordinary loads and stores, so a small hand-off between the GPU and a host thread
//! needs no copy-engine operation (the hybrid engine publishes each MoE layer's activations and
//! routes this way, and reads the CPU experts' output back the same way).

use cudarc::driver::sys::{self, CUdeviceptr};
use cudarc::driver::{DeviceRepr, PinnedHostSlice, ValidAsZeroBits};

use crate::{GpuDevice, GpuError};

/// `len` elements of `T` in mapped, page-locked host memory, zero-filled.
pub struct MappedHost<T: DeviceRepr> {
    /// Keeps the allocation alive.
    _mem: PinnedHostSlice<T>,
    host: *mut T,
    device: CUdeviceptr,
    len: usize,
}

// SAFETY: the memory is plain host memory owned by this value; who reads and writes it when is
// the user's protocol (flags), as for any shared buffer handed to raw pointers.
unsafe impl<T: DeviceRepr> Send for MappedHost<T> {}
unsafe impl<T: DeviceRepr> Sync for MappedHost<T> {}

impl<T: DeviceRepr + ValidAsZeroBits> MappedHost<T> {
    /// Allocates `len` (≥ 1) elements, zero-filled.
    pub fn new(dev: &GpuDevice, len: usize) -> Result<Self, GpuError> {
        let len = len.max(1);
        // SAFETY: zero-filled below before any use.
        let mut mem = unsafe {
            dev.context()
                .alloc_pinned_with_flags::<T>(len, sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE)
        }
        .map_err(|e| GpuError::driver("cuMemHostAlloc", e))?;
        let host = mem.as_mut_ptr().map_err(|e| GpuError::driver("cuEventSynchronize", e))?;
        // SAFETY: `host` points at `len` elements of the allocation; all-zero bits are valid.
        unsafe { std::ptr::write_bytes(host, 0, len) };
        let mut device: CUdeviceptr = 0;
        dev.context().bind_to_thread().map_err(|e| GpuError::driver("cuCtxSetCurrent", e))?;
        // SAFETY: `host` was allocated with DEVICEMAP in this context.
        let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, host.cast(), 0) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(GpuError::Driver { op: "cuMemHostGetDevicePointer", detail: format!("{r:?}") });
        }
        Ok(MappedHost { _mem: mem, host, device, len })
    }
}

impl<T: DeviceRepr> MappedHost<T> {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The address kernels use.
    pub fn device_ptr(&self) -> CUdeviceptr {
        self.device
    }

    /// The address the host uses.
    pub fn host_ptr(&self) -> *mut T {
        self.host
    }
}
