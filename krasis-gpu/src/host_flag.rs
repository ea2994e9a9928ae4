//! A 64-bit counter in page-locked, device-mapped host memory through which the host and the
//! compute stream signal each other without a host synchronisation: the stream can wait until
//! the counter reaches a value (`cuStreamWaitValue64`), a kernel can store to it (its device
//! address, after a system-wide fence so its earlier writes are visible first), and the host can
//! spin until it reaches a value or store to it.
//!
//! The hybrid engine uses two per session: the router's hand-off kernel announces "this layer's
//! activations are on the host" ([`crate::router::GpuRouter::publish`]) and the stream waits for
//! "the CPU experts' output is in mapped memory". With the wait on the stream, the host enqueues
//! the next layers while the CPU computes, so kernel launches leave the critical path.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use cudarc::driver::sys::{self, CUdeviceptr};

use crate::mapped::MappedHost;
use crate::{GpuDevice, GpuError, StreamState};

/// Spins between checks of the stream's health while waiting (a dead stream never writes).
const SPINS_PER_STREAM_CHECK: u32 = 4096;
/// A wait this long with the stream still busy is reported as a hang.
const WAIT_LIMIT: Duration = Duration::from_secs(120);

pub struct HostFlag {
    /// Its one element is the counter.
    mem: MappedHost<u64>,
}

fn check(op: &'static str, r: sys::CUresult) -> Result<(), GpuError> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(GpuError::Driver { op, detail: format!("{r:?}") })
    }
}

impl HostFlag {
    /// A counter starting at 0.
    pub fn new(dev: &GpuDevice) -> Result<Self, GpuError> {
        Ok(HostFlag { mem: MappedHost::new(dev, 1)? })
    }

    /// The counter's device address (kernels may store to it: `volatile u64*`).
    pub fn device_ptr(&self) -> CUdeviceptr {
        self.mem.device_ptr()
    }

    fn atomic(&self) -> &AtomicU64 {
        // SAFETY: one live, aligned u64 of the mapped allocation, alive as long as `self`; every
        // host access to it is atomic.
        unsafe { &*(self.mem.host_ptr() as *const AtomicU64) }
    }

    pub fn load(&self) -> u64 {
        self.atomic().load(Ordering::Acquire)
    }

    /// Stores `v` (release: host writes before it are visible to a stream that sees `v`).
    pub fn store(&self, v: u64) {
        self.atomic().store(v, Ordering::Release);
    }

    /// Enqueues on the compute stream: wait until the counter is ≥ `v`.
    pub fn stream_wait_geq(&self, dev: &GpuDevice, v: u64) -> Result<(), GpuError> {
        let s = dev.stream();
        dev.context().bind_to_thread().map_err(|e| GpuError::driver("cuCtxSetCurrent", e))?;
        let flags = sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32;
        // SAFETY: the address is the device mapping of a live pinned allocation.
        check("cuStreamWaitValue64", unsafe {
            sys::cuStreamWaitValue64_v2(s.cu_stream(), self.mem.device_ptr(), v, flags)
        })
    }

    /// Spins until the counter is ≥ `v` or `give_up()` says to stop (checked every few thousand
    /// spins; then `Ok(false)`), with no driver call at all: a thread that serves the stream
    /// (stores what it waits for) must not block in the driver, where a synchronising call of
    /// another thread can hold a lock until the stream passes that very wait. Fails after
    /// `limit`. Counted as a host synchronisation in [`GpuDevice::sync_counters`].
    pub fn spin_until_geq_or(
        &self,
        dev: &GpuDevice,
        v: u64,
        give_up: impl Fn() -> bool,
        limit: Duration,
    ) -> Result<bool, GpuError> {
        self.spin(dev, v, limit, || Ok(!give_up()))
    }

    /// Spins until the counter is ≥ `v`. Fails if the stream reports an error, finishes
    /// everything without writing `v`, or stays busy past a generous limit.
    /// Counted as a host synchronisation in [`GpuDevice::sync_counters`].
    pub fn spin_until_geq(&self, dev: &GpuDevice, v: u64) -> Result<(), GpuError> {
        self.spin(dev, v, WAIT_LIMIT, || match dev.stream_state(dev.stream()) {
            StreamState::Busy => Ok(true),
            // The flag may have been written just before the stream went idle.
            StreamState::Idle if self.load() >= v => Ok(true),
            StreamState::Idle => Err(GpuError::Driver {
                op: "host flag wait",
                detail: format!("the stream is idle but the flag is {} < {v}", self.load()),
            }),
            StreamState::Failed(e) => Err(GpuError::Driver { op: "cuStreamQuery", detail: e }),
        })
        .map(|_| ())
    }

    /// The waits' loop: spins until the counter is ≥ `v` (`Ok(true)`); every
    /// [`SPINS_PER_STREAM_CHECK`] spins asks `go_on` (`Ok(false)` ends the wait with `Ok(false)`,
    /// an error with it) and fails once `limit` has passed.
    fn spin(
        &self,
        dev: &GpuDevice,
        v: u64,
        limit: Duration,
        mut go_on: impl FnMut() -> Result<bool, GpuError>,
    ) -> Result<bool, GpuError> {
        dev.note_host_sync();
        let started = Instant::now();
        let mut spins = 0u32;
        loop {
            if self.load() >= v {
                return Ok(true);
            }
            std::hint::spin_loop();
            spins += 1;
            if spins.is_multiple_of(SPINS_PER_STREAM_CHECK) {
                if !go_on()? {
                    return Ok(false);
                }
                if started.elapsed() > limit {
                    return Err(GpuError::Driver {
                        op: "host flag wait",
                        detail: format!("no progress for {} s (flag {} < {v})", limit.as_secs(), self.load()),
                    });
                }
            }
        }
    }
}
