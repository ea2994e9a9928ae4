//! The hybrid engine's hand-off: a GPU MoE layer whose routed experts run on the host.
//!
//! Per MoE layer, on the compute stream: the router's ids and weights and the normed hidden
//! states go to pinned host buffers (three async copies), an event marks them; the shared expert
//! is enqueued next so the GPU computes it while the CPU works; the host waits for the event (the
//! layer's one host synchronisation), runs the CPU expert backend into a pinned output buffer and
//! enqueues its copy back into the layer output, then the shared expert's output is added there.
//! The buffers live in the session and grow to the largest call seen: decode steps allocate
//! nothing.
//!
//! Reuse of the pinned buffers is ordered by the stream: a layer's host writes to `out` happen
//! after its event completed, which is after every earlier copy out of `out` in stream order.

use std::time::{Duration, Instant};

use krasis_gpu::cudarc::driver::{CudaEvent, PinnedHostSlice};
use krasis_gpu::GpuDevice;

use crate::engine::experts::{LayerExperts, Routes};
use crate::error::{ModelError, Result};

/// Pinned staging of one session for the hand-off, plus where its time went.
#[derive(Default)]
pub(crate) struct HostStaging {
    tokens: usize,
    x: Option<PinnedHostSlice<f32>>,
    ids: Option<PinnedHostSlice<i32>>,
    weights: Option<PinnedHostSlice<f32>>,
    out: Option<PinnedHostSlice<f32>>,
    /// Marks the end of the device→host copies of the current layer.
    ready: Option<CudaEvent>,
    routes: Option<Routes>,
    pub stats: HandoffStats,
}

/// Where a session's hybrid MoE time went (cumulative; `krasis bench --device hybrid`).
#[derive(Clone, Copy, Debug, Default)]
pub struct HandoffStats {
    /// Layers handed to the host.
    pub calls: u64,
    /// Host time waiting for the device (the GPU part before the hand-off plus the copy).
    pub wait: Duration,
    /// Host time in the CPU expert backend.
    pub experts: Duration,
}

/// The shape of one hand-off: `t` tokens of `hidden`, `k` routes each.
#[derive(Clone, Copy, Debug)]
pub(crate) struct HandoffShape {
    pub t: usize,
    pub hidden: usize,
    pub k: usize,
}

fn pinned<T: krasis_gpu::cudarc::driver::DeviceRepr>(dev: &GpuDevice, n: usize) -> Result<PinnedHostSlice<T>> {
    // SAFETY: staging: every element a hand-off reads was written by its copy first.
    Ok(unsafe { dev.alloc_pinned::<T>(n.max(1))? })
}

fn host_slice<T: krasis_gpu::cudarc::driver::ValidAsZeroBits>(
    buf: &mut Option<PinnedHostSlice<T>>,
    n: usize,
) -> Result<&mut [T]> {
    let b = buf.as_mut().expect("HostStaging::ensure ran");
    let s = b.as_mut_slice().map_err(|e| ModelError::Invalid(format!("pinned staging buffer: {e}")))?;
    Ok(&mut s[..n])
}

impl HostStaging {
    fn ensure(&mut self, dev: &GpuDevice, t: usize, hidden: usize, k: usize) -> Result<()> {
        if self.ready.is_none() {
            self.ready = Some(dev.new_event(false)?);
        }
        if t > self.tokens || self.x.is_none() {
            self.x = Some(pinned(dev, t * hidden)?);
            self.ids = Some(pinned(dev, t * k)?);
            self.weights = Some(pinned(dev, t * k)?);
            self.out = Some(pinned(dev, t * hidden)?);
            self.tokens = t;
        }
        let routes = self.routes.get_or_insert_with(|| Routes::with_capacity(t, k));
        routes.k = k;
        Ok(())
    }

    /// Step 1 (device side): enqueue the copies of `xn [t, hidden]`, `ids`, `weights` (`[t, k]`)
    /// to the host and record the ready event.
    pub fn send(
        &mut self,
        dev: &GpuDevice,
        xn: &krasis_gpu::cudarc::driver::CudaView<'_, f32>,
        ids: &krasis_gpu::cudarc::driver::CudaView<'_, i32>,
        weights: &krasis_gpu::cudarc::driver::CudaView<'_, f32>,
        shape: HandoffShape,
    ) -> Result<()> {
        let HandoffShape { t, hidden, k } = shape;
        self.ensure(dev, t, hidden, k)?;
        // SAFETY: pinned buffers owned by the session; read only after `ready` completes.
        unsafe {
            dev.copy_to_host_async(xn, host_slice(&mut self.x, t * hidden)?)?;
            dev.copy_to_host_async(ids, host_slice(&mut self.ids, t * k)?)?;
            dev.copy_to_host_async(weights, host_slice(&mut self.weights, t * k)?)?;
        }
        dev.record(self.ready.as_ref().expect("created by ensure"))?;
        Ok(())
    }

    /// Step 2 (host side, after the shared expert was enqueued): wait for the copies, run
    /// `experts` (`n_experts` of them), and enqueue the copy of their weighted sum into `y [t, hidden]`.
    pub fn run_and_return(
        &mut self,
        dev: &GpuDevice,
        experts: &dyn LayerExperts,
        n_experts: usize,
        y: &mut krasis_gpu::cudarc::driver::CudaViewMut<'_, f32>,
        shape: HandoffShape,
    ) -> Result<()> {
        let HandoffShape { t, hidden, k } = shape;
        let t0 = Instant::now();
        dev.wait_event(self.ready.as_ref().expect("created by ensure"))?;
        let t1 = Instant::now();
        let mut routes = self.routes.take().expect("created by ensure");
        routes.ids.clear();
        routes.weights.clear();
        for &id in host_slice(&mut self.ids, t * k)?.iter() {
            match usize::try_from(id) {
                Ok(e) if e < n_experts => routes.ids.push(e),
                _ => {
                    self.routes = Some(routes);
                    return Err(ModelError::Invalid(format!(
                        "the GPU router returned expert id {id} (of {n_experts}); non-finite hidden states?"
                    )));
                }
            }
        }
        routes.weights.extend_from_slice(host_slice(&mut self.weights, t * k)?);
        let x: &[f32] = {
            let b = self.x.as_ref().expect("ensured");
            &b.as_slice().map_err(|e| ModelError::Invalid(format!("pinned staging buffer: {e}")))?[..t * hidden]
        };
        let out = {
            let b = self.out.as_mut().expect("ensured");
            &mut b.as_mut_slice().map_err(|e| ModelError::Invalid(format!("pinned staging buffer: {e}")))?[..t * hidden]
        };
        out.fill(0.0);
        experts.run(x, t, &routes, out);
        self.routes = Some(routes);
        let t2 = Instant::now();
        // SAFETY: `out` is written again only after a later layer's ready event, which the
        // stream orders after this copy.
        unsafe { dev.copy_to_device_async(&out[..], y)? };
        self.stats.calls += 1;
        self.stats.wait += t1 - t0;
        self.stats.experts += t2 - t1;
        Ok(())
    }
}
