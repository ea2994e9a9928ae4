//! What an engine reports about itself: [`EngineStats`], one plain struct for every device path,
//! read through [`super::Engine::stats`]. A field is `None` where the path has no such notion
//! (host synchronisations on the CPU, the forward-time split on the GPU), so a front end prints
//! what is there without knowing which engine runs.

use std::time::Duration;

/// An engine's counters and sizes at one moment. Counters run since load unless a field says
/// otherwise; the per-session fields are filled only when [`super::Engine::stats`] is given a
/// session of this engine.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EngineStats {
    /// Host synchronisations since load (GPU engines).
    pub host_syncs: Option<u64>,
    /// Bytes of one routed expert as the CPU reads it (quantised CPU and hybrid paths), for
    /// bandwidth arithmetic: a token reads `top_k` of them per MoE layer.
    pub expert_bytes: Option<u64>,
    /// Weight bytes a decode step reads outside the routed experts (CPU).
    pub dense_bytes_per_token: Option<u64>,
    /// Where forward time went since the last [`super::Engine::reset_stats`] (CPU).
    pub forward: Option<ForwardBreakdown>,
    /// Where the CPU time of the hybrid hand-offs of batched decode steps went since load
    /// (hybrid). A single sequence's steps count in its session ([`EngineStats::handoffs`]).
    pub batch_handoffs: Option<HandoffStats>,
    /// The session's hybrid hand-offs since it started (hybrid, with a session).
    pub handoffs: Option<HandoffStats>,
    /// Device time per part of the session's forward calls since the last
    /// [`super::Engine::reset_stats`] of that session, as one line (GPU engines with
    /// `KRASIS_GPU_PROFILE=1`, with a session).
    pub profile: Option<String>,
    /// Routed experts pinned in VRAM beside the CPU's share (hybrid with pinned hot experts).
    pub pinned_experts: Option<PinnedExperts>,
    /// The slots that routed experts stream through for long prefills (hybrid with streaming).
    pub stream_slots: Option<StreamSlots>,
    /// The VRAM expert pool of a copy-on-demand cache strategy (hybrid with an expert pool).
    pub expert_pool: Option<ExpertPoolSize>,
}

/// Where forward time went, in seconds since the last reset (the CPU engine).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ForwardBreakdown {
    /// The routed experts (the expert backend's calls).
    pub experts: f64,
    /// Attention layers: projections, RoPE, the attention core, MLA's absorption, o-proj.
    pub attention: f64,
    /// Gated-DeltaNet layers (their projections, convolution, delta rule, gated norm and
    /// `out_proj`), apart from `attention`; 0 for models without them.
    pub deltanet: f64,
    /// Shared experts of the MoE layers.
    pub shared: f64,
    /// The LM head.
    pub lm_head: f64,
    /// Weight bytes of shared experts that ran inside the routed experts' dispatch (their time
    /// is in `experts`, not `shared`).
    pub shared_in_experts_bytes: u64,
    /// The whole forward pass (the rest: norms, routers, dense-layer MLPs, residual adds).
    pub total: f64,
}

/// Where the hybrid engine's MoE time went (cumulative): the hand-offs of MoE layers from the GPU
/// stream to the CPU expert thread.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
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
    /// Routed experts the hand-offs read, each counted once per hand-off however many of the
    /// hand-off's tokens chose it (a batch of sequences reads the union of their experts).
    pub experts_read: u64,
    /// Expert-thread time pulling the predicted next experts into the caches (part of the time
    /// the CPU waits for the GPU: `wait` + `prefetch` is the GPU's share).
    pub prefetch: Duration,
    /// Bytes of expert weights those pulls requested.
    pub prefetch_bytes: u64,
    /// Routes predicted for hand-offs that then ran, and how many of them the router chose.
    pub predicted: u64,
    pub predicted_hits: u64,
    /// Hand-offs whose experts had been pulled (`KRASIS_EXPERT_PREFETCH_AB=1` times every other
    /// call without), and their CPU expert time (part of `calls` and `experts`).
    pub pulled_calls: u64,
    pub pulled_experts: Duration,
    /// Expert-pool layers (the copy-on-demand cache strategies `active_only`, `static_pin`,
    /// `weighted_pin` and `lru`): experts copied into VRAM, and their bytes over PCIe. Their
    /// routes count as hand-offs (`calls`, `experts_read`); `wait` is the launcher's wait for the
    /// routes and `experts` its time enqueueing the copies.
    pub copied: u64,
    pub copied_bytes: u64,
    /// Of `calls`, the expert-pool layers.
    pub pool_calls: u64,
    /// Routes the GPU ran by reading their experts over PCIe (decode's PCIe share); not in
    /// `experts_read`.
    pub pcie_routes: u64,
}

impl HandoffStats {
    /// Adds `o`'s counts to these.
    pub(crate) fn add(&mut self, o: &HandoffStats) {
        self.calls += o.calls;
        self.wait += o.wait;
        self.experts += o.experts;
        self.launch_wait += o.launch_wait;
        self.experts_read += o.experts_read;
        self.prefetch += o.prefetch;
        self.prefetch_bytes += o.prefetch_bytes;
        self.predicted += o.predicted;
        self.predicted_hits += o.predicted_hits;
        self.pulled_calls += o.pulled_calls;
        self.pulled_experts += o.pulled_experts;
        self.copied += o.copied;
        self.copied_bytes += o.copied_bytes;
        self.pool_calls += o.pool_calls;
        self.pcie_routes += o.pcie_routes;
    }
}

/// Routed experts pinned in VRAM (hybrid with pinned hot experts).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PinnedExperts {
    /// Experts pinned, over all MoE layers.
    pub experts: usize,
    /// Their VRAM.
    pub bytes: usize,
}

/// The VRAM slots the routed experts stream through (hybrid with streaming).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StreamSlots {
    /// Experts one slot holds.
    pub experts_per_slot: usize,
    /// VRAM one expert takes in the GPU's record layout (`None`: the slots hold four arrays,
    /// and experts cannot be pinned one by one).
    pub record_bytes: Option<usize>,
}

/// The size of a VRAM expert pool (the copy-on-demand cache strategies). What its calls copy is
/// counted per session, in [`HandoffStats`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExpertPoolSize {
    /// Expert slots, pinned ones included.
    pub slots: usize,
    /// Slots holding pinned experts.
    pub pinned: usize,
    /// VRAM of the pool.
    pub bytes: usize,
}
