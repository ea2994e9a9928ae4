//! The hybrid engine's hand-off: GPU MoE layers whose routed experts run on the host.
//!
//! Per MoE layer the compute stream gets, in order: the router's one launch that computes the
//! routes and publishes them with a copy of the normed hidden states into mapped host memory,
//! then sets the `ready` flag to the hand-off's sequence number from the device
//! ([`krasis_gpu::router::GpuRouter::publish`]); the shared expert's kernels (the GPU computes
//! them while the CPU works); a wait until the `go` flag reaches the sequence number; then the
//! next residual norm adds the CPU's weighted sum, read from mapped host memory, with the shared
//! expert's output. No copy-engine operation, no kernel of its own and one stream memory
//! operation per layer: each costs microseconds of latency on the critical path, which is CPU
//! experts + GPU kernel time. Both flags are host
//! memory ([`krasis_gpu::HostFlag`]), so the host thread that launches kernels never waits: it
//! enqueues the whole forward pass, while the model's expert thread ([`ExpertServer`], pinned to
//! worker 0's core of the CPU pool) spins on `ready`, runs the layer's CPU expert backend and
//! stores `go`.
//!
//! One set of mapped buffers serves every layer: stream order puts layer l+1's publication into
//! them after `go(l)`, i.e. after the expert thread finished with layer l, and the expert thread
//! writes layer l+1's output only after `ready(l+1)`, i.e. after the norm that read layer l's
//! output. Buffers grow to the largest call seen; decode steps allocate nothing on the device or
//! in host memory.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, RecvError, SyncSender, TryRecvError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use krasis_cpu::pool::WorkerPool;
use krasis_gpu::cudarc::driver::{CudaView, DeviceRepr, ValidAsZeroBits};
use krasis_gpu::router::{GpuRouter, PublishTarget};
use krasis_gpu::{DeviceBuffer, GpuDevice, HostFlag, MappedHost, StreamState};

use crate::cpu::experts::{LayerExperts, Routes};
use crate::error::{ModelError, Result};
use crate::runtime::HandoffStats;

/// How long the expert thread waits for a hand-off's inputs before it fails the call, when the
/// launching thread has not already stopped it: far beyond any layer's GPU work, so reached only
/// by a stream that stopped without an error the launcher could see.
const HANDOFF_WAIT_LIMIT: std::time::Duration = std::time::Duration::from_secs(120);

/// How often the launching thread, waiting for a call's end, checks the compute stream for an
/// error or for idling while the expert thread still waits on it.
const STREAM_CHECK_EVERY: std::time::Duration = std::time::Duration::from_millis(200);

/// Most tokens per call into the host expert backend (longer prompts go in chunks): bounds the
/// backend's per-call scratch, which otherwise grows with the prompt (measured on the H100 box,
/// v2-lite INT4: RSS 1.11× the expert copy after a 512-token prefill, 1.25× after 2 048).
const HOST_EXPERT_CHUNK_TOKENS: usize = 512;

/// How long the expert thread and the launching thread spin on their channel before they sleep
/// on it: a decode step's messages (a call's start, its hand-offs, its end) come microseconds to
/// a few hundred microseconds apart, and a sleeping thread needs the scheduler to wake it, which
/// can take as long as a step when every core runs a spinning worker (the expert thread is pinned
/// to a core the launcher may be running on). The pool's workers spin as long between jobs.
const CHANNEL_SPIN: std::time::Duration = krasis_cpu::pool::SPIN_BEFORE_PARK;

/// Spin iterations between clock reads while spinning on a channel.
const SPINS_PER_CLOCK_CHECK: u32 = 64;

/// The next message of `rx` within [`CHANNEL_SPIN`] of spinning (`Ok(None)`: none came;
/// `Err`: every sender is gone).
fn spin_recv<T>(rx: &Receiver<T>) -> std::result::Result<Option<T>, RecvError> {
    let start = Instant::now();
    let mut spins = 0u32;
    loop {
        match rx.try_recv() {
            Ok(m) => return Ok(Some(m)),
            Err(TryRecvError::Disconnected) => return Err(RecvError),
            Err(TryRecvError::Empty) => {}
        }
        std::hint::spin_loop();
        spins += 1;
        if spins.is_multiple_of(SPINS_PER_CLOCK_CHECK) && start.elapsed() >= CHANNEL_SPIN {
            return Ok(None);
        }
    }
}

/// The next message of `rx`: spinning for up to [`CHANNEL_SPIN`], then sleeping (`None` when
/// every sender is gone).
fn recv_spinning<T>(rx: &Receiver<T>) -> Option<T> {
    match spin_recv(rx) {
        Ok(Some(m)) => Some(m),
        Ok(None) => rx.recv().ok(),
        Err(RecvError) => None,
    }
}

/// The shape of one hand-off: `t` tokens of `hidden`, `k` routes each.
#[derive(Clone, Copy, Debug)]
pub(crate) struct HandoffShape {
    pub t: usize,
    pub hidden: usize,
    pub k: usize,
}

/// Default of `KRASIS_EXPERT_PREFETCH_MB`: at most this much of the predicted next experts is
/// pulled per hand-off (a quarter MiB per worker on 16). Measured on the H100 box's host
/// (2026-11-24, in-run A/B, `KRASIS_EXPERT_PREFETCH_AB=1`, v2-lite INT4): a hand-off after a
/// 4 MiB pull took 252 µs against 295 µs without, and an 8 MiB one (the GPU's share usually cut
/// it at ~6.7 MB) 254 against 295: the rest of a worker's first task gains nothing more.
const DEFAULT_EXPERT_PREFETCH_MB: usize = 4;

/// `KRASIS_EXPERT_PREFETCH_AB=1` (diagnosis): pull only during every other forward call, so one
/// run times the CPU experts with and without the pull under the same conditions (the bench
/// prints both).
pub(crate) fn expert_prefetch_ab() -> bool {
    static AB: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AB.get_or_init(|| krasis_core::knobs::knobs().expert_prefetch_ab)
}

/// Bytes of the next layer's predicted experts to pull while the GPU works (0: no route
/// prediction and no pull); `KRASIS_EXPERT_PREFETCH_MB` overrides the default.
pub(crate) fn expert_prefetch_budget() -> usize {
    static BUDGET: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *BUDGET.get_or_init(|| {
        let mb = krasis_core::knobs::knobs().expert_prefetch_mb;
        mb.unwrap_or(DEFAULT_EXPERT_PREFETCH_MB) << 20
    })
}

/// One hand-off the expert thread serves: MoE layer `layer`, sequence number `seq`.
#[derive(Clone, Debug)]
pub(crate) struct HostWork {
    pub seq: u64,
    pub layer: usize,
    pub n_experts: usize,
    /// The CPU runs the routes to experts `[cpu_from, n_experts)`; the GPU the rest (a split
    /// layer; 0: the CPU runs every route).
    pub cpu_from: usize,
    /// Experts whose routes the GPU runs (the layer's pinned experts), by id.
    pub cpu_skips: Option<Arc<[bool]>>,
    /// The same for the next MoE layer in this call: its pinned experts are not prefetched
    /// for the CPU, which will not read them.
    pub next_skips: Option<Arc<[bool]>>,
    /// The GPU runs the last `gpu_routes` routes of each token (decode's PCIe share), the CPU
    /// the others.
    pub gpu_routes: usize,
    /// The same for the next MoE layer in this call: those routes are not prefetched.
    pub next_gpu_routes: usize,
    pub shape: HandoffShape,
}

/// A mapped host buffer, grown on demand.
struct Mapped<T: DeviceRepr> {
    buf: Option<MappedHost<T>>,
}

impl<T: DeviceRepr + ValidAsZeroBits> Mapped<T> {
    fn ensure(&mut self, dev: &GpuDevice, n: usize) -> Result<()> {
        if self.buf.as_ref().is_none_or(|b| b.len() < n) {
            self.buf = None;
            self.buf = Some(MappedHost::new(dev, n)?);
        }
        Ok(())
    }

    fn get(&self) -> &MappedHost<T> {
        self.buf.as_ref().expect("HostStaging::prepare ran for this call")
    }

    /// The first `n` elements as a raw window (the buffer stays owned here).
    fn raw(&self, n: usize) -> RawSlice<T> {
        RawSlice { ptr: self.get().host_ptr(), len: n }
    }
}

/// A window into mapped host memory that the device writes and reads (the router's hand-off
/// kernel, the next residual norm) and the expert thread reads and writes between the flags.
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

/// The mapped windows of one forward call.
#[derive(Clone, Copy)]
struct Windows {
    x: RawSlice<f32>,
    ids: RawSlice<i32>,
    weights: RawSlice<f32>,
    out: RawSlice<f32>,
    /// The predicted routes of the next hand-off, by the parity of the predicting hand-off's
    /// sequence number (decode with prediction on).
    predicted: Option<[RawSlice<i32>; 2]>,
}

/// One slot of route predictions: what the next MoE layer's router says of the current layer's
/// hidden state (attention output + shared expert, the routed experts' part not yet in).
struct PredictionSlot {
    x: MappedHost<f32>,
    ids: MappedHost<i32>,
    weights: MappedHost<f32>,
}

/// Route prediction for the next MoE layer (one-token calls): the GPU runs the next layer's
/// post-attention norm and router over this layer's hidden state while the CPU computes this
/// layer's experts (the stream would idle then), and publishes the ids; once done with this layer,
/// the expert thread pulls the start of those experts' weights into the caches while the GPU runs
/// the next attention. Two slots, by sequence parity: the expert thread reads slot `seq & 1` right
/// after storing `go(seq)`, and the GPU writes that slot again only during hand-off `seq + 2`,
/// i.e. after `go(seq + 1)`, which that same thread stores later.
struct Predictor {
    /// Device scratch: the hidden state to route, and its norm.
    h: DeviceBuffer<f32>,
    hn: DeviceBuffer<f32>,
    slots: [PredictionSlot; 2],
    /// `= seq` once slot `seq & 1` holds the prediction made during hand-off `seq`.
    flag: Arc<HostFlag>,
}

/// Mapped staging and flags of one session.
#[derive(Default)]
pub(crate) struct HostStaging {
    x: Mapped<f32>,
    ids: Mapped<i32>,
    weights: Mapped<f32>,
    out: Mapped<f32>,
    flags: Option<(Arc<HostFlag>, Arc<HostFlag>)>,
    /// The last sequence number handed out (flags only grow).
    seq: u64,
    windows: Option<Windows>,
    /// Where the current call's hand-offs go (set while the expert thread serves the call).
    work: Option<SyncSender<Msg>>,
    /// Set by [`HostStaging::receive`] until the next residual norm adds the CPU experts' output.
    pending: Option<bool>,
    /// Route prediction (allocated by the first one-token call when prefetching is on).
    predictor: Option<Predictor>,
    pub stats: HandoffStats,
}

impl<T: DeviceRepr> Default for Mapped<T> {
    fn default() -> Self {
        Mapped { buf: None }
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
        // A call that failed midway may have left an output unconsumed; it belongs to no call now.
        self.pending = None;
        self.x.ensure(dev, t * hidden)?;
        self.ids.ensure(dev, t * k)?;
        self.weights.ensure(dev, t * k)?;
        self.out.ensure(dev, t * hidden)?;
        let predicts = t == 1 && k > 0 && expert_prefetch_budget() > 0;
        if predicts && self.predictor.is_none() {
            let slot = || -> Result<PredictionSlot> {
                Ok(PredictionSlot {
                    x: MappedHost::new(dev, hidden)?,
                    ids: MappedHost::new(dev, k)?,
                    weights: MappedHost::new(dev, k)?,
                })
            };
            self.predictor = Some(Predictor {
                // SAFETY: written (copy, then norm) before every read in `predict`.
                h: unsafe { dev.alloc_uninit(hidden, "route prediction")? },
                hn: unsafe { dev.alloc_uninit(hidden, "route prediction")? },
                slots: [slot()?, slot()?],
                flag: Arc::new(HostFlag::new(dev)?),
            });
        }
        let predicted = match &self.predictor {
            Some(p) if predicts => Some([0, 1].map(|i| RawSlice { ptr: p.slots[i].ids.host_ptr(), len: k })),
            _ => None,
        };
        self.windows = Some(Windows {
            x: self.x.raw(t * hidden),
            ids: self.ids.raw(t * k),
            weights: self.weights.raw(t * k),
            out: self.out.raw(t * hidden),
            predicted,
        });
        Ok(self.flags.clone().expect("created above"))
    }

    /// Device side, between `send` and `receive` of hand-off `seq` (one-token calls with
    /// prediction on; otherwise nothing): routes `h + y` (this layer's residual stream after
    /// attention, plus the shared expert's output when given) with the next MoE layer's
    /// post-attention norm `norm` and `router`, and publishes the ids for the expert thread's
    /// prefetch. Runs while the stream would wait for the CPU experts anyway.
    #[allow(clippy::too_many_arguments)]
    pub fn predict(
        &mut self,
        dev: &GpuDevice,
        router: &GpuRouter,
        norm: &DeviceBuffer<u16>,
        h: &CudaView<'_, f32>,
        y: Option<&CudaView<'_, f32>>,
        eps: f32,
        seq: u64,
    ) -> Result<()> {
        let Some(p) = self.predictor.as_mut() else { return Ok(()) };
        if self.windows.is_none_or(|w| w.predicted.is_none()) || h.len() != p.h.len() {
            return Ok(());
        }
        let hidden = p.h.len();
        dev.copy_device(h, p.h.slice_mut())?;
        let delta = y.map(|y| y as &dyn krasis_gpu::cudarc::driver::DevicePtr<f32>);
        dev.rmsnorm_residual(p.h.slice_mut(), delta, None, None, norm, Some(p.hn.slice_mut()), None, hidden, eps)?;
        let slot = &p.slots[(seq & 1) as usize];
        router.publish(
            dev,
            p.hn.slice(),
            1,
            &PublishTarget { x: Some(&slot.x), ids: &slot.ids, weights: &slot.weights, flag: &p.flag, seq },
        )?;
        Ok(())
    }

    /// Device side, first half: `router` routes the `t` tokens of `xn` and publishes routes and
    /// (with `activations`; an expert pool's layer needs only the routes) the activations to the
    /// host, then `ready = seq`, all in one launch. Returns `seq`.
    pub fn send(
        &mut self,
        dev: &GpuDevice,
        router: &GpuRouter,
        xn: &CudaView<'_, f32>,
        t: usize,
        activations: bool,
    ) -> Result<u64> {
        let (ready, _) = self.flags.as_ref().expect("HostStaging::prepare ran for this call");
        let seq = self.seq + 1;
        let x = activations.then(|| self.x.get());
        router.publish(
            dev,
            xn,
            t,
            &PublishTarget { x, ids: self.ids.get(), weights: self.weights.get(), flag: ready, seq },
        )?;
        self.seq = seq;
        Ok(seq)
    }

    /// The flags (`ready`, `go`) and the last sequence number handed out, for a stall report.
    pub fn progress(&self) -> Option<(Arc<HostFlag>, Arc<HostFlag>, u64)> {
        self.flags.as_ref().map(|(r, g)| (r.clone(), g.clone(), self.seq))
    }

    /// The device address of the published expert ids (mapped host memory), valid after `send`
    /// until the layer's hand-off is served.
    pub fn published_ids(&self) -> u64 {
        self.ids.get().device_ptr()
    }

    /// The device address of the published routing weights, valid as [`HostStaging::published_ids`].
    pub fn published_weights(&self) -> u64 {
        self.weights.get().device_ptr()
    }

    /// Device side, after `send`: the first `n` published routes (ids and weights) into device
    /// buffers, on the compute stream, so a split layer's GPU share runs on exactly the routes
    /// the CPU got.
    pub fn routes_to_device(
        &self,
        dev: &GpuDevice,
        n: usize,
        ids: &mut impl krasis_gpu::cudarc::driver::DevicePtrMut<i32>,
        weights: &mut impl krasis_gpu::cudarc::driver::DevicePtrMut<f32>,
    ) -> Result<()> {
        dev.copy_from_mapped(self.ids.get(), n, ids)?;
        dev.copy_from_mapped(self.weights.get(), n, weights)?;
        Ok(())
    }

    /// Launching thread, after `send` of an expert-pool layer (`active_only`, `static_pin`,
    /// `weighted_pin`, `lru`; [`super::expert_pool`]): waits until the `n` published routes are
    /// on the host, then brings the experts they touch into `pool` (copies on the pool's copy
    /// stream, which the compute stream then waits for by event). The launcher, not the expert
    /// thread, does this so the compute stream never waits on a host flag for work on another
    /// stream (such a wait can hold up the copies queued behind it); it costs the launcher's
    /// run-ahead for these layers.
    pub fn fetch_into_pool(
        &mut self,
        dev: &GpuDevice,
        pool: &super::expert_pool::ExpertPool,
        layer: usize,
        seq: u64,
        n: usize,
    ) -> Result<()> {
        let (ready, _) = self.flags.as_ref().expect("HostStaging::prepare ran for this call");
        let t0 = Instant::now();
        ready.spin_until_geq(dev, seq)?;
        let t1 = Instant::now();
        let w = self.windows.expect("prepared");
        // SAFETY: `ready(seq)` says the routes are written, and the stream writes them again only in
        // a later layer's publication, which this thread has not enqueued yet.
        let ids = unsafe { w.ids.slice_mut(n) };
        let f = pool.fetch(dev, layer, ids)?;
        let st = &mut self.stats;
        st.calls += 1;
        st.pool_calls += 1;
        st.wait += t1 - t0;
        st.experts += t1.elapsed();
        st.experts_read += f.touched as u64;
        st.copied += f.copied as u64;
        st.copied_bytes += f.bytes as u64;
        Ok(())
    }

    /// Device side, second half (after the shared expert was enqueued): wait for `go = seq`, and
    /// hand the layer to the expert thread. The experts' weighted sum stays in mapped host memory:
    /// the next residual norm adds it ([`HostStaging::take_pending`]), after the layer output `y`
    /// when `y_counts` (it holds the shared expert's output or the GPU's share of the routed
    /// experts), instead of `y` otherwise.
    pub fn receive(&mut self, dev: &GpuDevice, work: HostWork, y_counts: bool) -> Result<()> {
        let (_, go) = self.flags.as_ref().expect("prepared");
        go.stream_wait_geq(dev, work.seq)?;
        debug_assert!(self.pending.is_none(), "a hand-off's output was never added");
        self.pending = Some(y_counts);
        let seq = work.seq;
        let sent = self.work.as_ref().expect("an expert thread serves this call").send(Msg::Work(work));
        if sent.is_err() {
            // Nobody will serve this hand-off: release the stream's wait ourselves, or the call's
            // final synchronisation would never return.
            go.store(seq);
            return Err(ModelError::Invalid("the CPU expert thread stopped early".into()));
        }
        Ok(())
    }

    /// The CPU experts' output the next residual norm must add (ordered after their `go` by the
    /// stream), and whether the layer output `y` holds the shared expert's part beside it; `None`
    /// when the last FFN was not a host MoE layer.
    pub fn take_pending(&mut self) -> Option<(&MappedHost<f32>, bool)> {
        let y_holds_shared = self.pending.take()?;
        Some((self.out.get(), y_holds_shared))
    }
}

/// Bound of the messages in flight to the expert thread (a ring, allocated once): more than the
/// hand-offs of any one call need, so the launcher never blocks on it in practice.
const SERVER_QUEUE: usize = 1024;

enum Msg {
    /// A forward call starts: its mapped windows and flags, and the device it runs on.
    Begin(Call),
    Work(HostWork),
    /// The call's last hand-off was posted: reply with what the call's hand-offs did.
    End,
}

/// What the expert thread needs for one forward call.
struct Call {
    windows: Windows,
    ready: Arc<HostFlag>,
    go: Arc<HostFlag>,
    /// The route predictions' flag, when the call predicts (see [`Predictor`]).
    predicted: Option<Arc<HostFlag>>,
    dev: DevicePtrForThread,
}

/// `&GpuDevice` sent to the expert thread for the length of one call.
#[derive(Clone, Copy)]
struct DevicePtrForThread(*const GpuDevice);

// SAFETY: the launching thread keeps the device alive and waits for `End`'s reply before the call
// returns, so the pointer is only used while it is valid; `GpuDevice` is `Sync`.
unsafe impl Send for DevicePtrForThread {}

/// The thread that serves a hybrid model's hand-offs: one per model, pinned to worker 0's core of
/// the CPU pool (it is worker 0 during each expert call), started at load and stopped on drop.
/// Per call it gets a `Begin`, the hand-offs in order and an `End`, through a preallocated ring:
/// a decode step allocates nothing and starts no thread.
pub(crate) struct ExpertServer {
    tx: SyncSender<Msg>,
    /// What the thread is doing (for a stall report).
    state: Arc<ServerState>,
    /// The replies to `End`; locked for a whole call, which serialises the calls of different
    /// sessions (their messages must not interleave).
    replies: std::sync::Mutex<Receiver<Result<HandoffStats>>>,
    thread: Option<JoinHandle<()>>,
}

impl ExpertServer {
    /// Starts the thread over the host expert backend of each layer (`None` where the layer has
    /// none).
    pub fn start(experts: Vec<Option<Arc<dyn LayerExperts>>>, pool: Option<Arc<WorkerPool>>) -> Result<Self> {
        let (tx, rx) = sync_channel(SERVER_QUEUE);
        let (reply_tx, replies) = sync_channel(1);
        let state = Arc::new(ServerState::default());
        let st = state.clone();
        let thread = std::thread::Builder::new()
            .name("krasis-experts".into())
            .spawn(move || {
                let _pin = pool.as_deref().map(WorkerPool::pin_caller);
                // The expert backends hold the pool themselves; any dense op they run through
                // `krasis_cpu::par` runs on it too.
                match pool.as_deref() {
                    Some(pool) => krasis_cpu::par::with_pool(pool, || serve(rx, reply_tx, &experts, &st)),
                    None => serve(rx, reply_tx, &experts, &st),
                }
            })
            .map_err(|e| ModelError::Invalid(format!("starting the CPU expert thread: {e}")))?;
        Ok(ExpertServer { tx, state, replies: std::sync::Mutex::new(replies), thread: Some(thread) })
    }

    /// What the thread is doing now, in words (a stall report).
    pub fn describe_state(&self) -> String {
        self.state.describe()
    }

    fn send(&self, m: Msg) -> Result<()> {
        self.tx.send(m).map_err(|_| ModelError::Invalid("the CPU expert thread has stopped".into()))
    }
}

impl Drop for ExpertServer {
    fn drop(&mut self) {
        // Closing the ring ends the thread's loop.
        let (dead, _) = sync_channel(1);
        drop(std::mem::replace(&mut self.tx, dead));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// What the expert thread is doing, stored as it goes (relaxed atomics: a stall report reads
/// them from another thread; nothing depends on them).
#[derive(Default)]
struct ServerState {
    /// Set by the launching thread when the stream can no longer publish what the expert thread
    /// waits for (a stream error, or an idle stream short of the flag); the expert thread then
    /// fails the call. Cleared at each call's start.
    abort: AtomicBool,
    phase: AtomicU8,
    seq: AtomicU64,
    layer: AtomicU64,
    calls: AtomicU64,
}

/// [`ServerState::phase`] values.
const PHASE_IDLE: u8 = 0;
const PHASE_IN_CALL: u8 = 1;
const PHASE_WAIT_READY: u8 = 2;
const PHASE_EXPERTS: u8 = 3;
const PHASE_PREFETCH: u8 = 4;

impl ServerState {
    fn set(&self, phase: u8, work: Option<&HostWork>) {
        if let Some(w) = work {
            self.seq.store(w.seq, Ordering::Relaxed);
            self.layer.store(w.layer as u64, Ordering::Relaxed);
        }
        self.phase.store(phase, Ordering::Relaxed);
    }

    fn describe(&self) -> String {
        let (seq, layer) = (self.seq.load(Ordering::Relaxed), self.layer.load(Ordering::Relaxed));
        let calls = self.calls.load(Ordering::Relaxed);
        let what = match self.phase.load(Ordering::Relaxed) {
            PHASE_IDLE => "between calls".to_string(),
            PHASE_IN_CALL => format!("in a call, waiting for its next message (last hand-off {seq}, layer {layer})"),
            PHASE_WAIT_READY => format!("waiting for hand-off {seq}'s ready flag (layer {layer})"),
            PHASE_EXPERTS => format!("running layer {layer}'s experts (hand-off {seq})"),
            PHASE_PREFETCH => format!("prefetching after hand-off {seq} (layer {layer})"),
            p => format!("phase {p}"),
        };
        format!("expert thread {what}; {calls} calls begun")
    }
}

/// Runs one forward call with `server` serving its hand-offs: `enqueue` launches the call's GPU
/// work (handing each host MoE layer over through `staging`) while the expert thread serves them
/// in order.
pub(crate) fn with_expert_server<R>(
    dev: &GpuDevice,
    staging: &mut HostStaging,
    server: &ExpertServer,
    shape: HandoffShape,
    enqueue: impl FnOnce(&mut HostStaging) -> Result<R>,
) -> Result<R> {
    let replies = server.replies.lock().unwrap_or_else(|p| p.into_inner());
    let (ready, go) = staging.prepare(dev, shape.t, shape.hidden, shape.k)?;
    server.state.abort.store(false, Ordering::Relaxed);
    let windows = staging.windows.expect("prepared");
    let predicted = windows.predicted.and(staging.predictor.as_ref()).map(|p| p.flag.clone());
    let call = Call { windows, ready: ready.clone(), go, predicted, dev: DevicePtrForThread(dev) };
    server.send(Msg::Begin(call))?;
    staging.work = Some(server.tx.clone());
    let result = enqueue(staging);
    staging.work = None;
    // Always close the call, also after an error: the thread must not keep the device pointer.
    server.send(Msg::End)?;
    let stats = await_call_end(dev, &replies, &server.state, &ready)??;
    staging.stats.add(&stats);
    result
}

/// Waits for the expert thread's reply to a call's `End`. This thread, not the expert thread,
/// watches the stream meanwhile (the expert thread makes no driver call while it serves: see
/// [`HostFlag::spin_until_geq_or`]): a stream error, or a stream gone idle while the expert
/// thread still waits for a `ready` it will never publish, stops the expert thread's wait, so
/// the call ends with an error instead of hanging.
fn await_call_end(
    dev: &GpuDevice,
    replies: &Receiver<Result<HandoffStats>>,
    state: &ServerState,
    ready: &HostFlag,
) -> Result<Result<HandoffStats>> {
    use std::sync::mpsc::RecvTimeoutError;
    let stopped = || ModelError::Invalid("the CPU expert thread stopped during a call".into());
    // The reply normally comes within the spin (the last hand-off is the end of the call's CPU
    // work); a failed call's reply may need the stream checks below.
    match spin_recv(replies) {
        Ok(Some(r)) => return Ok(r),
        Ok(None) => {}
        Err(RecvError) => return Err(stopped()),
    }
    loop {
        match replies.recv_timeout(STREAM_CHECK_EVERY) {
            Ok(r) => return Ok(r),
            Err(RecvTimeoutError::Disconnected) => return Err(stopped()),
            Err(RecvTimeoutError::Timeout) => {
                let waiting = state.phase.load(Ordering::Relaxed) == PHASE_WAIT_READY;
                let short = ready.load() < state.seq.load(Ordering::Relaxed);
                match dev.stream_state(dev.stream()) {
                    StreamState::Busy => {}
                    StreamState::Idle if !(waiting && short) => {}
                    StreamState::Idle | StreamState::Failed(_) => state.abort.store(true, Ordering::Relaxed),
                }
            }
        }
    }
}

/// The expert thread's loop: for each hand-off of a call, spin until the stream says its inputs
/// are on the host, run the layer's experts, release the stream. After an error the stream is
/// still released (with every later hand-off of the call), so the launching thread's final
/// synchronisation cannot hang; the error is the call's reply.
fn serve(
    rx: Receiver<Msg>,
    replies: SyncSender<Result<HandoffStats>>,
    experts: &[Option<Arc<dyn LayerExperts>>],
    state: &ServerState,
) {
    let mut routes = Routes::with_capacity(0, 0);
    let mut seen = Vec::new();
    let mut guess = Guess::default();
    let mut call: Option<Call> = None;
    let mut stats = HandoffStats::default();
    let mut failure: Option<ModelError> = None;
    let mut since = Instant::now();
    while let Some(m) = recv_spinning(&rx) {
        match m {
            Msg::Begin(c) => {
                state.calls.fetch_add(1, Ordering::Relaxed);
                state.set(PHASE_IN_CALL, None);
                call = Some(c);
                stats = HandoffStats::default();
                failure = None;
                guess.layer = None;
                since = Instant::now();
            }
            Msg::Work(work) => {
                stats.launch_wait += since.elapsed();
                let Some(c) = call.as_ref() else { continue };
                if failure.is_none() {
                    // SAFETY: see `DevicePtrForThread`.
                    let dev = unsafe { &*c.dev.0 };
                    // A panic in an expert backend must not kill the thread before `go` is stored:
                    // the stream would wait on it forever.
                    let served = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        let ctx = ServeCtx { dev, w: c.windows, ready: &c.ready, experts, state };
                        serve_one(&ctx, &work, &mut routes, &mut seen, &guess, &mut stats)
                    }));
                    match served {
                        Ok(Ok(())) => {}
                        Ok(Err(e)) => failure = Some(e),
                        Err(p) => {
                            failure = Some(ModelError::Invalid(format!(
                                "the CPU experts of layer {} panicked: {}",
                                work.layer,
                                krasis_core::panic_text(p)
                            )));
                        }
                    }
                }
                c.go.store(work.seq);
                guess.layer = None;
                guess.pulled = false;
                let pull = !expert_prefetch_ab() || state.calls.load(Ordering::Relaxed).is_multiple_of(2);
                if failure.is_none() && pull {
                    if let (Some(slots), Some(flag)) = (c.windows.predicted, c.predicted.as_deref()) {
                        state.set(PHASE_PREFETCH, None);
                        let t = Instant::now();
                        let pulled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            prefetch_next(&work, slots, flag, &c.ready, experts, &mut guess)
                        }));
                        let pulled = pulled.unwrap_or(0);
                        guess.pulled = pulled > 0;
                        stats.prefetch_bytes += pulled as u64;
                        stats.prefetch += t.elapsed();
                    }
                }
                state.set(PHASE_IN_CALL, None);
                since = Instant::now();
            }
            Msg::End => {
                state.set(PHASE_IDLE, None);
                call = None;
                let r = match failure.take() {
                    Some(e) => Err(e),
                    None => Ok(stats),
                };
                if replies.send(r).is_err() {
                    return;
                }
            }
        }
    }
}

/// The routes predicted for the next hand-off (of MoE layer `layer`), kept to count hits.
#[derive(Default)]
struct Guess {
    layer: Option<usize>,
    ids: Vec<usize>,
    /// Whether their weights were pulled.
    pulled: bool,
}

/// After hand-off `work`: when the GPU's prediction for the next MoE layer is in (it normally
/// is: the CPU experts took far longer), pull the start of those experts' weights into the
/// caches until the next hand-off is ready. Returns the bytes requested.
fn prefetch_next(
    work: &HostWork,
    slots: [RawSlice<i32>; 2],
    flag: &HostFlag,
    ready: &HostFlag,
    experts: &[Option<Arc<dyn LayerExperts>>],
    guess: &mut Guess,
) -> usize {
    let Some(next) = (work.layer + 1..experts.len()).find(|&l| experts[l].is_some()) else { return 0 };
    if work.shape.t != 1 || flag.load() != work.seq {
        return 0;
    }
    let slot = slots[(work.seq & 1) as usize];
    // SAFETY: the flag says the device finished writing this slot, and it writes it again only
    // after a `go` this thread has not stored yet (see `Predictor`).
    let ids = unsafe { slot.slice_mut(slot.len) };
    guess.ids.clear();
    guess.ids.extend(ids.iter().filter_map(|&i| usize::try_from(i).ok()).filter(|&i| i < work.n_experts));
    // The GPU reads the next layer's last routes over PCIe (its PCIe share): the budget goes
    // to the CPU's.
    let cpu_k = guess.ids.len().saturating_sub(work.next_gpu_routes);
    guess.layer = Some(next);
    let backend = experts[next].as_deref().expect("found above");
    // The budget goes to the experts the CPU will read: not the next layer's pinned ones.
    let ready_for_next = || ready.load() > work.seq;
    match &work.next_skips {
        Some(skips) => {
            let pulled: Vec<usize> =
                guess.ids[..cpu_k].iter().copied().filter(|&e| !skips.get(e).copied().unwrap_or(false)).collect();
            backend.prefetch(&pulled, expert_prefetch_budget(), &ready_for_next)
        }
        None => backend.prefetch(&guess.ids[..cpu_k], expert_prefetch_budget(), &ready_for_next),
    }
}

/// What [`serve_one`] reads of the call it serves.
struct ServeCtx<'a> {
    dev: &'a GpuDevice,
    w: Windows,
    ready: &'a HostFlag,
    experts: &'a [Option<Arc<dyn LayerExperts>>],
    state: &'a ServerState,
}

fn serve_one(
    ctx: &ServeCtx<'_>,
    work: &HostWork,
    routes: &mut Routes,
    seen: &mut Vec<bool>,
    guess: &Guess,
    stats: &mut HandoffStats,
) -> Result<()> {
    let ServeCtx { dev, w, ready, experts, state } = *ctx;
    let HandoffShape { t, hidden, k } = work.shape;
    let t0 = Instant::now();
    state.set(PHASE_WAIT_READY, Some(work));
    let abort = || state.abort.load(Ordering::Relaxed);
    if !ready.spin_until_geq_or(dev, work.seq, abort, HANDOFF_WAIT_LIMIT)? {
        return Err(ModelError::Invalid(format!(
            "the GPU stream stopped (an error, or idle) before hand-off {} of layer {} was ready",
            work.seq, work.layer
        )));
    }
    state.set(PHASE_EXPERTS, None);
    let t1 = Instant::now();
    // SAFETY: `ready(seq)` says the device's writes into the windows are complete and visible,
    // and the stream touches them again only after `go(seq)`.
    let (x, ids, weights, out) = unsafe {
        (w.x.slice_mut(t * hidden), w.ids.slice_mut(t * k), w.weights.slice_mut(t * k), w.out.slice_mut(t * hidden))
    };
    if let Some(&id) = ids.iter().find(|&&id| usize::try_from(id).map_or(true, |e| e >= work.n_experts)) {
        return Err(ModelError::Invalid(format!(
            "the GPU router returned expert id {id} (of {}) at layer {}; non-finite hidden states?",
            work.n_experts, work.layer
        )));
    }
    let backend = experts[work.layer].as_deref().expect("hand-offs come from host MoE layers");
    out.fill(0.0);
    // Routes at positions `cpu_k..k` of each token are the GPU's (decode's PCIe share).
    let cpu_k = k - work.gpu_routes.min(k);
    // Long prompts in chunks: the backend's scratch grows with the tokens of a call, and a chunk
    // of this size still reads each expert once per ~100 routed tokens.
    for c0 in (0..t).step_by(HOST_EXPERT_CHUNK_TOKENS) {
        let n = HOST_EXPERT_CHUNK_TOKENS.min(t - c0);
        routes.k = k;
        routes.ids.clear();
        routes.ids.extend(ids[c0 * k..(c0 + n) * k].iter().enumerate().map(|(r, &id)| {
            let e = id as usize;
            if r % k >= cpu_k || e < work.cpu_from || work.cpu_skips.as_ref().is_some_and(|s| s[e]) {
                Routes::ELSEWHERE
            } else {
                e
            }
        }));
        routes.weights.clear();
        routes.weights.extend_from_slice(&weights[c0 * k..(c0 + n) * k]);
        let rows = c0 * hidden..(c0 + n) * hidden;
        backend.run(&x[rows.clone()], n, routes, &mut out[rows]);
    }
    // Which experts the hand-off read (the ids were range-checked above).
    seen.clear();
    seen.resize(work.n_experts, false);
    for (r, &id) in ids.iter().enumerate() {
        let on_cpu = r % k < cpu_k && id as usize >= work.cpu_from;
        seen[id as usize] |= on_cpu && !work.cpu_skips.as_ref().is_some_and(|s| s[id as usize]);
    }
    stats.pcie_routes += (t * (k - cpu_k)) as u64;
    stats.experts_read += seen.iter().filter(|&&s| s).count() as u64;
    if guess.layer == Some(work.layer) && t == 1 {
        stats.predicted += k as u64;
        // Against every route the router chose (the GPU's PCIe share included).
        stats.predicted_hits += guess.ids.iter().filter(|&&g| ids.iter().any(|&i| i as usize == g)).count() as u64;
    }
    stats.calls += 1;
    stats.wait += t1 - t0;
    let spent = t1.elapsed();
    stats.experts += spent;
    if guess.layer == Some(work.layer) && guess.pulled {
        stats.pulled_calls += 1;
        stats.pulled_experts += spent;
    }
    Ok(())
}
