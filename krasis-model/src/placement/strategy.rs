//! The strategies a hybrid engine chooses between for its routed experts: what it keeps in VRAM
//! beside the CPU copy ([`CacheStrategy`]), which copy a prefill streams ([`StreamFrom`]) and how
//! much of each layer ([`StreamSplit`]).

/// `--cache-strategy S [--heatmap-path FILE] [--pin-vram BYTES]`: which routed experts a hybrid
/// engine keeps in VRAM beside its CPU copy, and how it uses them below the full-streaming
/// prompt length (longer prompts stream every layer, [`crate::gpu::expert_stream`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CachePlan {
    pub strategy: CacheStrategy,
    /// A heatmap recorded with `--heatmap-out` on this model (the pinning strategies need one).
    pub heatmap: Option<std::path::PathBuf>,
    /// VRAM for the kept experts; `None`: what the budget leaves after the weights, the stream
    /// slots, [`HOT_PREFILL_RESERVE_BYTES`] and a KV cache of [`HOT_MIN_KV_TOKENS`] tokens.
    pub vram: Option<u64>,
}

/// The seeds' expert residency strategies a hybrid engine can run (`--cache-strategy`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheStrategy {
    /// The heatmap's hottest experts pinned; the CPU runs the others' routes beside them
    /// ([`crate::gpu::hot_experts`]).
    HotCachedStatic,
    /// Each MoE call copies exactly the experts its routes touch to the GPU and runs them there
    /// ([`crate::gpu::expert_pool`]); nothing is kept between calls.
    ActiveOnly,
    /// `active_only` plus the heatmap's globally hottest `(layer, expert)` pairs pinned.
    StaticPin,
    /// `active_only` plus pins shared out per layer by how concentrated its routes are.
    WeightedPin,
    /// A cross-layer cache of experts in VRAM, least recently used out; misses are copied.
    Lru,
    /// Long prompts stream each layer's experts in chunks through two slots of `--pin-vram`
    /// (for GPUs that cannot hold two layers' experts; [`crate::gpu::expert_stream`]); decode keeps the CPU
    /// experts. Chosen by itself when two layers do not fit the budget.
    Chunked,
}

impl CacheStrategy {
    /// Every strategy, as `--cache-strategy` names it.
    pub const ALL: [CacheStrategy; 6] = [
        CacheStrategy::HotCachedStatic,
        CacheStrategy::ActiveOnly,
        CacheStrategy::StaticPin,
        CacheStrategy::WeightedPin,
        CacheStrategy::Lru,
        CacheStrategy::Chunked,
    ];

    pub fn name(self) -> &'static str {
        match self {
            CacheStrategy::HotCachedStatic => "hot_cached_static",
            CacheStrategy::ActiveOnly => "active_only",
            CacheStrategy::StaticPin => "static_pin",
            CacheStrategy::WeightedPin => "weighted_pin",
            CacheStrategy::Lru => "lru",
            CacheStrategy::Chunked => "chunked",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|s| s.name() == name)
    }

    /// Whether the strategy pins experts a heatmap chooses (and so needs `--heatmap-path`).
    pub fn needs_heatmap(self) -> bool {
        matches!(self, CacheStrategy::HotCachedStatic | CacheStrategy::StaticPin | CacheStrategy::WeightedPin)
    }
}

/// KV tokens `hot_cached_static` leaves room for when it sizes the pinned experts from the budget
/// (the KV cache then takes what the pinned experts leave, at least this much).
pub const HOT_MIN_KV_TOKENS: usize = 16_384;

/// VRAM `hot_cached_static` leaves free for a long prefill's activations when it sizes the pinned
/// experts from the budget (prefill's claim comes first). Measured on the H200 box: a
/// 10K-token streamed prefill of v2-lite needs more than 2.26 GiB above the weights, the slots
/// and the KV cache (it failed there) and at most 2.52 GiB (it ran).
pub const HOT_PREFILL_RESERVE_BYTES: u64 = 3 << 30;

/// The records a hybrid prefill streams to the GPU (#9's "one resident copy").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamFrom {
    /// The GPU expert cache, read into RAM beside the CPU's: a second copy of the experts,
    /// already in the GPU layout.
    GpuCache,
    /// The CPU experts' cache (the one copy in RAM), laid out for the GPU on the device after
    /// each copy; no GPU expert cache is read or built. The default: half the RAM for ~17 % of a
    /// 2K prompt's streamed prefill (docs/BENCHMARKS.md). Needs the CPU experts at the GPU width
    /// and one record geometry for every layer; otherwise the GPU expert cache serves.
    CpuCache,
}

/// The share of each MoE layer's routed experts a streaming hybrid prefill runs on the GPU (the
/// CPU runs the routes to the others at the same time; [`crate::gpu::expert_stream`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum StreamSplit {
    /// From the measured times, by prompt length ([`crate::gpu::expert_stream::split_fraction`]; its
    /// `KRASIS_GPU_STREAM_SPLIT` overrides it for measurements).
    Measured,
    /// This fraction of the experts, in [0, 1], whatever the prompt (1: every expert streamed).
    Share(f64),
}
