//! The hybrid engine's hand-off: GPU MoE layers whose routed experts run on the host.
//!
//! Per MoE layer the compute stream gets, in order: the copies of the normed hidden states, the
//! router's ids and weights into pinned host buffers, then a write of the hand-off's sequence
//! number to the `ready` flag; the shared expert's kernels (the GPU computes them while the CPU
//! works); a wait until the `go` flag reaches the sequence number; the copy of the CPU's weighted
//! sum from the pinned output buffer into the layer output. Both flags are host memory the stream
//! reads and writes itself ([`krasis_gpu::HostFlag`]), so the host thread that launches kernels
//! never waits: it enqueues the whole forward pass, while an expert thread (worker 0 of the CPU
//! pool during each expert call) spins on `ready`, runs the layer's CPU expert backend and stores
//! `go`. Kernel launches leave the critical path, which becomes CPU experts + GPU kernel time.
//!
//! One set of pinned buffers serves every layer: stream order puts layer l+1's copies into them
//! after `go(l)`, i.e. after the expert thread finished with layer l, and the expert thread writes
//! layer l+1's output only after `ready(l+1)`, i.e. after the copy of layer l's output. Buffers
//! grow to the largest call seen; decode steps allocate nothing on the device or in pinned memory.

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use krasis_cpu::pool::WorkerPool;
use krasis_gpu::cudarc::driver::{CudaView, CudaViewMut, DeviceRepr, PinnedHostSlice, ValidAsZeroBits};
use krasis_gpu::{GpuDevice, HostFlag};

use crate::engine::experts::{LayerExperts, Routes};
use crate::error::{ModelError, Result};

/// Most tokens per call into the host expert backend (longer prompts go in chunks): bounds the
/// backend's per-call scratch, which otherwise grows with the prompt (measured on the H100 box,
/// v2-lite INT4: RSS 1.11× the expert copy after a 512-token prefill, 1.25× after 2 048).
const HOST_EXPERT_CHUNK_TOKENS: usize = 512;

/// The shape of one hand-off: `t` tokens of `hidden`, `k` routes each.
#[derive(Clone, Copy, Debug)]
pub(crate) struct HandoffShape {
    pub t: usize,
    pub hidden: usize,
    pub k: usize,
}

/// Where a session's hybrid MoE time went (cumulative; `krasis bench --device hybrid`).
#[derive(Clone, Copy, Debug, Default)]
pub struct HandoffStats {
    /// Layers handed to the host.
    pub calls: u64,
    /// Expert-thread time waiting for the device (the GPU's share of the step, as the critical
    /// path sees it).
    pub wait: Duration,
    /// Expert-thread time in the CPU expert backend.
    pub experts: Duration,
    /// Expert-thread time waiting for the launching thread to enqueue the next hand-off (the
    /// launcher falling behind; also the start of each call).
    pub launch_wait: Duration,
}

/// One hand-off the expert thread serves: MoE layer `layer`, sequence number `seq`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct HostWork {
    pub seq: u64,
    pub layer: usize,
    pub n_experts: usize,
    pub shape: HandoffShape,
}

/// A pinned buffer of `cap` elements, grown on demand.
struct Pinned<T> {
    buf: Option<PinnedHostSlice<T>>,
}

impl<T: DeviceRepr + ValidAsZeroBits> Pinned<T> {
    fn ensure(&mut self, dev: &GpuDevice, n: usize) -> Result<()> {
        if self.buf.as_ref().is_none_or(|b| b.len() < n) {
            self.buf = None;
            // SAFETY: staging: every element a hand-off reads was written by its copy first.
            self.buf = Some(unsafe { dev.alloc_pinned::<T>(n.max(1))? });
        }
        Ok(())
    }

    /// The first `n` elements as a raw view (the buffer stays owned here).
    fn raw(&mut self, n: usize) -> Result<RawSlice<T>> {
        let b = self.buf.as_mut().expect("ensured");
        let p = b.as_mut_ptr().map_err(|e| ModelError::Invalid(format!("pinned staging buffer: {e}")))?;
        Ok(RawSlice { ptr: p, len: n })
    }
}

/// A window into pinned memory shared by the launching thread (which only names it in copies)
/// and the expert thread (which reads and writes it between the flags).
#[derive(Clone, Copy)]
struct RawSlice<T> {
    ptr: *mut T,
    len: usize,
}

// SAFETY: access is ordered by the ready/go flags (module docs).
unsafe impl<T> Send for RawSlice<T> {}

impl<T> RawSlice<T> {
    /// # Safety
    /// No other access to the window may happen at the same time (the flags order them).
    unsafe fn slice_mut<'a>(self, n: usize) -> &'a mut [T] {
        assert!(n <= self.len);
        std::slice::from_raw_parts_mut(self.ptr, n)
    }
}

/// The pinned windows of one forward call.
#[derive(Clone, Copy)]
struct Windows {
    x: RawSlice<f32>,
    ids: RawSlice<i32>,
    weights: RawSlice<f32>,
    out: RawSlice<f32>,
}

/// Pinned staging and flags of one session.
#[derive(Default)]
pub(crate) struct HostStaging {
    x: Pinned<f32>,
    ids: Pinned<i32>,
    weights: Pinned<f32>,
    out: Pinned<f32>,
    flags: Option<(Arc<HostFlag>, Arc<HostFlag>)>,
    /// The last sequence number handed out (flags only grow).
    seq: u64,
    windows: Option<Windows>,
    /// Where the current call's hand-offs go (set while an expert thread serves the call).
    work: Option<Sender<HostWork>>,
    pub stats: HandoffStats,
}

impl<T> Default for Pinned<T> {
    fn default() -> Self {
        Pinned { buf: None }
    }
}

impl HostStaging {
    /// Room for a call of `t` tokens; returns the flags for the expert thread.
    fn prepare(
        &mut self,
        dev: &GpuDevice,
        t: usize,
        hidden: usize,
        k: usize,
    ) -> Result<(Arc<HostFlag>, Arc<HostFlag>)> {
        if self.flags.is_none() {
            self.flags = Some((Arc::new(HostFlag::new(dev)?), Arc::new(HostFlag::new(dev)?)));
        }
        self.x.ensure(dev, t * hidden)?;
        self.ids.ensure(dev, t * k)?;
        self.weights.ensure(dev, t * k)?;
        self.out.ensure(dev, t * hidden)?;
        self.windows = Some(Windows {
            x: self.x.raw(t * hidden)?,
            ids: self.ids.raw(t * k)?,
            weights: self.weights.raw(t * k)?,
            out: self.out.raw(t * hidden)?,
        });
        Ok(self.flags.clone().expect("created above"))
    }

    /// Device side, first half: copies of `xn`, `ids`, `weights` to the host, then `ready = seq`.
    /// Returns `seq`.
    pub fn send(
        &mut self,
        dev: &GpuDevice,
        xn: &CudaView<'_, f32>,
        ids: &CudaView<'_, i32>,
        weights: &CudaView<'_, f32>,
        shape: HandoffShape,
    ) -> Result<u64> {
        let HandoffShape { t, hidden, k } = shape;
        let w = self.windows.expect("HostStaging::prepare ran for this call");
        let (ready, _) = self.flags.as_ref().expect("prepared");
        // SAFETY: pinned windows; the expert thread touches them only after `ready` (module docs).
        unsafe {
            dev.copy_to_host_async(xn, w.x.slice_mut(t * hidden))?;
            dev.copy_to_host_async(ids, w.ids.slice_mut(t * k))?;
            dev.copy_to_host_async(weights, w.weights.slice_mut(t * k))?;
        }
        self.seq += 1;
        ready.stream_write(dev, self.seq)?;
        Ok(self.seq)
    }

    /// Device side, second half (after the shared expert was enqueued): wait for `go = seq`, then
    /// copy the experts' weighted sum into `y`; and hand the layer to the expert thread.
    pub fn receive(&mut self, dev: &GpuDevice, work: HostWork, y: &mut CudaViewMut<'_, f32>) -> Result<()> {
        let HandoffShape { t, hidden, .. } = work.shape;
        let w = self.windows.expect("prepared");
        let (_, go) = self.flags.as_ref().expect("prepared");
        go.stream_wait_geq(dev, work.seq)?;
        // SAFETY: the copy runs after `go`, when the expert thread is done writing the window.
        unsafe { dev.copy_to_device_async(w.out.slice_mut(t * hidden), y)? };
        self.work
            .as_ref()
            .expect("an expert thread serves this call")
            .send(work)
            .map_err(|_| ModelError::Invalid("the CPU expert thread stopped early".into()))
    }
}

/// Runs one forward call with an expert thread serving its hand-offs: `enqueue` launches the
/// call's GPU work (handing each host MoE layer over through `staging`), while the thread serves
/// them in order with the host expert backends of `experts[layer]`.
pub(crate) fn with_expert_thread<R>(
    dev: &GpuDevice,
    staging: &mut HostStaging,
    experts: &[Option<&dyn LayerExperts>],
    pool: Option<&WorkerPool>,
    shape: HandoffShape,
    enqueue: impl FnOnce(&mut HostStaging) -> Result<R>,
) -> Result<R> {
    let (ready, go) = staging.prepare(dev, shape.t, shape.hidden, shape.k)?;
    let windows = staging.windows.expect("prepared");
    let (tx, rx) = channel();
    staging.work = Some(tx);
    let (result, served) = std::thread::scope(|scope| {
        let thread = scope.spawn(move || {
            // The thread is worker 0 of the pool during each expert call: give it worker 0's core.
            let _pin = pool.map(WorkerPool::pin_caller);
            serve(dev, rx, windows, &ready, &go, experts)
        });
        let r = enqueue(staging);
        staging.work = None; // closes the channel: the thread ends after the last hand-off
        (r, thread.join())
    });
    let served = served.map_err(|_| ModelError::Invalid("the CPU expert thread panicked".into()))?;
    let stats = served?;
    staging.stats.calls += stats.calls;
    staging.stats.wait += stats.wait;
    staging.stats.experts += stats.experts;
    staging.stats.launch_wait += stats.launch_wait;
    result
}

/// The expert thread: for each hand-off, spin until the stream says its inputs are on the host,
/// run the layer's experts, release the stream. On an error the stream is released anyway (with
/// every later hand-off) so that the launching thread's final synchronisation cannot hang.
fn serve(
    dev: &GpuDevice,
    rx: Receiver<HostWork>,
    w: Windows,
    ready: &HostFlag,
    go: &HostFlag,
    experts: &[Option<&dyn LayerExperts>],
) -> Result<HandoffStats> {
    let mut stats = HandoffStats::default();
    let mut routes = Routes::with_capacity(0, 0);
    let mut failure = None;
    loop {
        let t = Instant::now();
        let Ok(work) = rx.recv() else { break };
        stats.launch_wait += t.elapsed();
        if failure.is_some() {
            go.store(work.seq);
            continue;
        }
        let r = serve_one(dev, work, w, ready, experts, &mut routes, &mut stats);
        go.store(work.seq);
        if let Err(e) = r {
            failure = Some(e);
        }
    }
    match failure {
        Some(e) => Err(e),
        None => Ok(stats),
    }
}

fn serve_one(
    dev: &GpuDevice,
    work: HostWork,
    w: Windows,
    ready: &HostFlag,
    experts: &[Option<&dyn LayerExperts>],
    routes: &mut Routes,
    stats: &mut HandoffStats,
) -> Result<()> {
    let HandoffShape { t, hidden, k } = work.shape;
    let t0 = Instant::now();
    ready.spin_until_geq(dev, work.seq)?;
    let t1 = Instant::now();
    // SAFETY: `ready(seq)` says the stream's copies into the windows are complete, and the
    // stream touches them again only after `go(seq)`.
    let (x, ids, weights, out) = unsafe {
        (w.x.slice_mut(t * hidden), w.ids.slice_mut(t * k), w.weights.slice_mut(t * k), w.out.slice_mut(t * hidden))
    };
    if let Some(&id) = ids.iter().find(|&&id| usize::try_from(id).map_or(true, |e| e >= work.n_experts)) {
        return Err(ModelError::Invalid(format!(
            "the GPU router returned expert id {id} (of {}) at layer {}; non-finite hidden states?",
            work.n_experts, work.layer
        )));
    }
    let backend = experts[work.layer].expect("hand-offs come from host MoE layers");
    out.fill(0.0);
    // Long prompts in chunks: the backend's scratch grows with the tokens of a call, and a chunk
    // of this size still reads each expert once per ~100 routed tokens.
    for c0 in (0..t).step_by(HOST_EXPERT_CHUNK_TOKENS) {
        let n = HOST_EXPERT_CHUNK_TOKENS.min(t - c0);
        routes.k = k;
        routes.ids.clear();
        routes.ids.extend(ids[c0 * k..(c0 + n) * k].iter().map(|&id| id as usize));
        routes.weights.clear();
        routes.weights.extend_from_slice(&weights[c0 * k..(c0 + n) * k]);
        let rows = c0 * hidden..(c0 + n) * hidden;
        backend.run(&x[rows.clone()], n, routes, &mut out[rows]);
    }
    stats.calls += 1;
    stats.wait += t1 - t0;
    stats.experts += t1.elapsed();
    Ok(())
}
