//! Routed experts streamed from host memory to the GPU for the hybrid engine's prefill (#9's
//! `layer_grouped` strategy with groups of one layer): the GPU expert cache's records stay in
//! page-locked RAM; two VRAM slots each hold one MoE layer's experts. While a layer's experts run
//! in one slot, the next MoE layer's records copy into the other on a copy stream, so a long
//! prompt pays the PCIe copy of every expert once, behind the compute, instead of running its
//! experts on the CPU. Decode, and prompts shorter than the threshold
//! ([`GPU_STREAM_MIN_TOKENS`] by default), keep the CPU experts.
//!
//! **Split layers.** A short prompt is bound by the copy (every expert crosses PCIe whatever the
//! prompt), a CPU prefill by its expert math: each does part of the work in the time of the
//! other. So a prompt of `t` tokens streams only the first [`ExpertStreamer::gpu_experts`]
//! experts of each layer and the CPU runs the routes to the rest at the same time
//! ([`split_fraction`] says how many, from measured times); long prompts stream every expert.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use krasis_cache::ExpertCache;
use krasis_gpu::cudarc::driver::{CudaEvent, CudaStream};
use krasis_gpu::moe::GpuExperts;
use krasis_gpu::relayout::converted_bits;
use krasis_gpu::{GpuDevice, GpuError};
use krasis_quant::int4_asym::ASYM_GROUP;
use krasis_quant::Bits;

use crate::error::{ModelError, Result};

/// Prompt tokens from which a hybrid prefill streams experts to the GPU (a share of each layer,
/// [`split_fraction`]) instead of running them all on the CPU. Measured on the H200 box, V2-Lite
/// INT4, whole prefill: 16 tokens 0.103 s on the CPU against 0.092 s with 30 % streamed (every
/// expert streamed: 0.207 s); 64 tokens 0.262 against 0.151 s with 45 % streamed
/// (docs/BENCHMARKS.md).
pub const GPU_STREAM_MIN_TOKENS: usize = 16;

/// The share of each layer's experts a `t`-token prompt streams to the GPU (the CPU runs the
/// rest): the GPU's time is about fixed for short prompts (the copy), the CPU's grows with the
/// prompt, so the share that ends both at once is `cpu / (cpu + gpu)` of their whole-layer times.
/// From `KRASIS_GPU_STREAM_SPLIT` (a fraction in [0, 1]) when set, for measurements.
pub fn split_fraction(t: usize) -> f64 {
    let forced = krasis_core::knobs::knobs().gpu_stream_split;
    if let Some(f) = forced {
        return f;
    }
    if t >= SPLIT_MAX_TOKENS {
        return 1.0;
    }
    let cpu = SPLIT_CPU_BASE_S + SPLIT_CPU_PER_TOKEN_S * t as f64;
    let f = cpu / (cpu + SPLIT_GPU_S);
    if f >= SPLIT_ALL_GPU_FROM {
        1.0
    } else {
        f
    }
}

/// The fewest prompt tokens whose calls stream every expert ([`split_fraction`] 1): shorter calls
/// run a share of the experts on the CPU at its much higher cost per token, so a scheduler that
/// sizes its chunks from the cost it sees should not go below this.
pub fn all_streamed_from() -> usize {
    (GPU_STREAM_MIN_TOKENS..SPLIT_MAX_TOKENS).find(|&t| split_fraction(t) >= 1.0).unwrap_or(SPLIT_MAX_TOKENS)
}

/// Whole-prefill time of the CPU experts on a short prompt, `base + per_token · t` (H200 box,
/// V2-Lite INT4, 16 cores: 16 tokens 0.10–0.12 s, 32 0.16–0.21 s, 64 0.26 s, 128 0.39 s).
const SPLIT_CPU_BASE_S: f64 = 0.08;
const SPLIT_CPU_PER_TOKEN_S: f64 = 0.003;
/// The GPU's whole-layer time in the balance, fitted to the best measured shares on two H200
/// machines whose CPUs differ (16 tokens 30 / 45 %, 32 tokens 30 / 45 %, 64 tokens 45 / 55 %,
/// 128 tokens 65 / 75 %; docs/BENCHMARKS.md): above the ~0.2 s an all-streamed short prompt
/// takes, as the copies run slower beside the CPU experts. The best share moves with the host's
/// CPU; within ±0.1 of it the prefill changes by ~10 %.
const SPLIT_GPU_S: f64 = 0.25;
/// From this prompt length on every expert streams: the time model is fitted to 16–128 tokens,
/// and the CPU's per-token cost falls with longer prompts (0.58 s at 512 tokens, not the model's
/// 1.6 s), while the GPU's whole prefill stays near 0.2 s up to 2K tokens.
const SPLIT_MAX_TOKENS: usize = 256;
/// From this share on the GPU takes the whole layer (a sliver on the CPU would not pay for its
/// hand-off).
const SPLIT_ALL_GPU_FROM: f64 = 0.85;

/// The id map of a chunk starting at expert `first` of `n`: `e → (e − first) mod n`, so the
/// chunk's experts are numbered from 0 in order, as its slot stores them.
fn rotation(n: usize, first: usize) -> Vec<i32> {
    (0..n).map(|e| ((e + n - first) % n) as i32).collect()
}

/// The VRAM whole-layer slots may take of `left` bytes of budget: what leaves a prefill's
/// activations room, or half.
fn slot_room(left: u64) -> u64 {
    left.saturating_sub(super::KV_RESERVE_BYTES).max(left / 2)
}

/// VRAM slots, each one MoE layer's experts: one computing, one filling.
const SLOTS: usize = 2;

/// Page-locked registration of a host buffer (`cuMemHostRegister`, mapped into the device's
/// address space), undone on drop.
struct HostRegistration {
    ptr: *mut std::ffi::c_void,
    /// The buffer's address for kernels (decode's PCIe share reads the records there).
    device: u64,
}

// SAFETY: the registration is a handle on memory owned elsewhere; registering and unregistering
// are thread-safe driver calls.
unsafe impl Send for HostRegistration {}
unsafe impl Sync for HostRegistration {}

impl HostRegistration {
    fn new(dev: &GpuDevice, bytes: &[u8]) -> std::result::Result<Self, GpuError> {
        use krasis_gpu::cudarc::driver::sys;
        dev.context()
            .bind_to_thread()
            .map_err(|e| GpuError::Driver { op: "cuCtxSetCurrent", detail: e.to_string() })?;
        let ptr = bytes.as_ptr() as *mut std::ffi::c_void;
        // SAFETY: `bytes` is a live host allocation; it outlives the registration (the owner
        // holds both and drops the registration first).
        let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
        let r = unsafe { sys::cuMemHostRegister_v2(ptr, bytes.len(), flags) };
        r.result().map_err(|e| GpuError::Driver { op: "cuMemHostRegister", detail: e.to_string() })?;
        // From here on, dropping `reg` (also on the error below) undoes the registration.
        let mut reg = HostRegistration { ptr, device: 0 };
        // SAFETY: `ptr` was registered with DEVICEMAP just above, in this context.
        let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut reg.device, ptr, 0) };
        r.result().map_err(|e| GpuError::Driver { op: "cuMemHostGetDevicePointer", detail: e.to_string() })?;
        Ok(reg)
    }
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        // SAFETY: registered in `new`.
        unsafe {
            let _ = krasis_gpu::cudarc::driver::sys::cuMemHostUnregister(self.ptr);
        }
    }
}

struct Slot {
    experts: GpuExperts,
    /// MoE layer index whose experts the slot holds (or is filling with), and how many of them
    /// from expert `first` on (0 unless the slots are chunks of a layer).
    layer: Option<usize>,
    first: usize,
    present: usize,
    /// Recorded on the copy stream when the slot's copies are done.
    ready: CudaEvent,
    /// Recorded on the compute stream after the slot's last use.
    free: CudaEvent,
    /// Whether `free` was ever recorded.
    used: bool,
}

/// Where streamed experts come from.
pub enum StreamRecords {
    /// The GPU expert cache: a second copy of the experts in RAM, already in the slots' layout.
    GpuCache(Box<ExpertCache>),
    /// The CPU experts' own cache (the one copy in RAM), laid out for the GPU on the device after
    /// each copy ([`krasis_gpu::relayout`]).
    CpuCache(Arc<crate::cpu::quantized::CpuQuantExperts>),
}

/// The streamer's source, with what converting CPU records needs.
enum Source {
    /// `in_place`: the slots hold the records as they are (one copy per run of experts), which
    /// needs one record geometry for every layer; otherwise the four arrays (copies per part).
    Gpu { cache: Box<ExpertCache>, in_place: bool },
    Cpu {
        experts: Arc<crate::cpu::quantized::CpuQuantExperts>,
        geometry: krasis_gpu::relayout::CpuRecordGeometry,
        /// Device staging for one slot's CPU records (one copy stream: each staging copy waits
        /// for the conversion that read the previous one by stream order).
        staging: krasis_gpu::DeviceBuffer<u8>,
    },
}

impl Source {
    fn cache(&self) -> &ExpertCache {
        match self {
            Source::Gpu { cache, .. } => cache,
            Source::Cpu { experts, .. } => experts.cache(),
        }
    }
}

/// The one CPU record geometry of every MoE layer of `experts`, at `bits`, or why there is none.
fn cpu_record_geometry(
    experts: &crate::cpu::quantized::CpuQuantExperts,
    bits: Bits,
) -> Result<krasis_gpu::relayout::CpuRecordGeometry> {
    let c = experts.cache();
    let bad = |why: String| ModelError::Invalid(format!("streaming the CPU expert cache: {why}"));
    if experts.ggml_kept() {
        return Err(bad(
            "its experts are GGUF blocks kept as stored (Q4_K / Q6_K), which the GPU does not run: the GPU expert cache requantises them from their exact values"
                .into(),
        ));
    }
    let (stride, w2_offset) = (c.stride(0), c.w2_offset(0));
    let (w13, w2) = experts.record_layouts(0)?;
    for li in 0..c.header().moe_layers.len() {
        if experts.record_layouts(li)? != (w13, w2) || (c.stride(li), c.w2_offset(li)) != (stride, w2_offset) {
            return Err(bad(format!("MoE layer {li} differs from layer 0 in widths or record geometry")));
        }
    }
    if let Some(kind) = w13.fp4.or(w2.fp4) {
        return Err(bad(format!(
            "its experts are {kind} in the CPU's layout, which the GPU does not convert (the GPU expert cache holds {kind} in the GPU's)"
        )));
    }
    // The GPU's form of `4a` is INT8 g32, requantised on the device after each copy.
    let converted = (converted_bits(&w13), converted_bits(&w2));
    if (w13.asym || w2.asym)
        && (w13.asym != w2.asym || converted != (bits, bits) || (w13.gs, w2.gs) != (ASYM_GROUP, ASYM_GROUP))
    {
        return Err(bad(format!(
            "its experts are asymmetric INT4 (`4a`), which stream to the GPU as INT8 g32 only, not {bits:?}"
        )));
    }
    if converted != (bits, bits) {
        return Err(bad(format!("its experts are {:?}/{:?}, the GPU's {bits:?}", w13.bits, w2.bits)));
    }
    Ok(krasis_gpu::relayout::CpuRecordGeometry { w13, w2, w2_offset, stride })
}

/// The streamed experts of every MoE layer ([`ExpertStreamer::run_layer`]).
pub struct ExpertStreamer {
    // Field order: the registration goes before the records it pins.
    pinned: HostRegistration,
    source: Source,
    copy: Arc<CudaStream>,
    /// Model layer → MoE layer index of the cache.
    moe_index: Vec<Option<usize>>,
    slots: Mutex<Vec<Slot>>,
    /// The slots' record geometry `(stride, w2 offset)`, when they hold records in place.
    slot_geometry: Option<(usize, usize)>,
    /// The streamed experts' layout (width, groups, FP4 format).
    layout: krasis_gpu::moe::QuantExpertLayout,
    min_tokens: usize,
    split: super::StreamSplit,
    copied: AtomicU64,
    /// Experts a slot holds: the whole layer, or a chunk of it (`chunked`).
    slot_experts: usize,
    /// Chunked slots: per chunk start `c`, the id map that renumbers expert `e` to `(e − c) mod n`
    /// (the chunk's experts first, as its slot stores them).
    rotations: Vec<krasis_gpu::DeviceBuffer<i32>>,
    /// Decode's PCIe share: the GPU reads this many routes of each decode token from the CPU's
    /// records in place (0: none), or why it cannot.
    pcie: std::result::Result<PcieShare, String>,
}

/// The GPU's reader of the CPU records over PCIe, and how many routes of a decode token it takes.
struct PcieShare {
    experts: krasis_gpu::moe_pcie::PcieExperts,
    routes: usize,
}

/// Rates of the two reads of a decode token's experts side by side, for the default PCIe share.
/// Measured on the H200 box (2026-11-30, glm-4.5-air at 4 layers, INT4 g128, 16 cores;
/// bench/logs/2026-11-30/h200-pcie-share-s40.log): the CPU kept ~100–110 GB/s beside the PCIe
/// kernel, which read ~40 GB/s; of top-8, 2 routes gave 368–381 tok/s against 336–344 with none,
/// 3 routes 328 and 4 routes 281 (the GPU's share the slower).
const PCIE_READ_GBPS: f64 = 40.0;
const CPU_READ_GBPS: f64 = 105.0;
/// The PCIe share's cost beside its bytes: two launches and a few PCIe round trips in series
/// (w2 waits for every w13 row; its routes run one after another). Fitted to V2-Lite (4.5 MB
/// experts, top-6, bench/logs/2026-11-30/h200-pcie-suites-s40.log), where 2 routes over PCIe
/// decoded 121–126 tok/s against 128–136 with none: the model puts 2 routes at 263 µs a layer
/// against the CPU's 255 alone, 1 route at 212.
const PCIE_FIXED_US: f64 = 40.0;

/// Routes of a decode token of `top_k` the GPU reads over PCIe by default, for experts of
/// `bytes` each: the count that ends the layer soonest, the GPU's `fixed + g · bytes / PCIe rate`
/// against the CPU's `(top_k − g) · bytes / CPU rate` (0 when no share beats the CPU alone; never
/// every route).
pub fn default_pcie_routes(top_k: usize, bytes: usize) -> usize {
    let b = bytes as f64 / 1e3; // KB: µs at GB/s
    let layer_us = |g: usize| {
        let cpu = (top_k - g) as f64 * b / CPU_READ_GBPS;
        if g == 0 {
            cpu
        } else {
            cpu.max(PCIE_FIXED_US + g as f64 * b / PCIE_READ_GBPS)
        }
    };
    (0..top_k).min_by(|&a, &c| layer_us(a).total_cmp(&layer_us(c))).unwrap_or(0)
}

/// What decode's PCIe share is asked to be ([`ExpertStreamer::new`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PcieAsk {
    /// The model's routes per token.
    pub top_k: usize,
    /// Routes per token the GPU takes; `None`: [`default_pcie_routes`]; `Some(0)`: none.
    pub routes: Option<usize>,
}

impl ExpertStreamer {
    /// Pins the records of `records` (at `bits`) and allocates the slots; prompts of at least
    /// `min_tokens` (≥ 2: decode steps stay on the CPU) stream. The two slots take at most
    /// `slot_vram` bytes, each a whole layer's experts or a chunk of them (`None`: whole layers,
    /// or when two do not fit the VRAM budget, chunks of what the budget leaves beside a prefill's
    /// activations).
    /// Decode steps give the GPU the last routes of each token that `pcie` asks for, read over
    /// PCIe from CPU records in place (none for GPU-cache records or records the kernel cannot
    /// read).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        dev: &GpuDevice,
        records: StreamRecords,
        bits: Bits,
        num_layers: usize,
        min_tokens: usize,
        split: super::StreamSplit,
        slot_vram: Option<u64>,
        pcie: PcieAsk,
    ) -> Result<Self> {
        let cache = match &records {
            StreamRecords::GpuCache(c) => c,
            StreamRecords::CpuCache(e) => e.cache(),
        };
        let h = cache.header().clone();
        // CPU records stream only at the GPU's width with one geometry for every layer: checked
        // before anything is pinned or allocated.
        let cpu_geometry = match &records {
            StreamRecords::CpuCache(e) => Some(cpu_record_geometry(e, bits)?),
            StreamRecords::GpuCache(_) => None,
        };
        let (hidden, inter, n) = (h.hidden as usize, h.intermediate as usize, h.n_experts as usize);
        let (gs13, gs2) = (h.group_size_hidden as usize, h.group_size_intermediate as usize);
        let layout = match &records {
            StreamRecords::GpuCache(c) => super::expert_cache::gpu_record_layout(c.header(), "streamed experts")?,
            StreamRecords::CpuCache(_) => {
                krasis_gpu::moe::QuantExpertLayout::new("streamed experts", hidden, inter, bits, gs13, gs2)?
            }
        };
        let pinned = HostRegistration::new(dev, cache.records()).map_err(|e| {
            ModelError::Invalid(format!(
                "page-locking the streamed expert records ({} bytes): {e}",
                cache.records().len()
            ))
        })?;
        // The slots keep GPU records as the GPU cache lays them out, (stride, w2 offset), when
        // there is one geometry: the GPU cache's own when every layer shares it, or for CPU
        // records the one that cache would have (the container's alignments); otherwise (`None`)
        // the four arrays.
        let layers = h.moe_layers.len();
        let slot_geometry = match &records {
            StreamRecords::GpuCache(c) => {
                let g = (c.stride(0), c.w2_offset(0));
                (0..layers).all(|li| (c.stride(li), c.w2_offset(li)) == g).then_some(g)
            }
            StreamRecords::CpuCache(_) => {
                use krasis_cache::format::{RECORD_ALIGN, W2_ALIGN};
                let (p13, p2) = layout.record_parts();
                let w2 = p13.next_multiple_of(W2_ALIGN as usize);
                Some(((w2 + p2).next_multiple_of(RECORD_ALIGN as usize), w2))
            }
        };
        let chunked_geometry = |why: &str| -> Result<(usize, usize)> {
            slot_geometry.ok_or_else(|| {
                ModelError::Invalid(format!(
                    "streaming chunks of a layer ({why}) needs one record geometry for every MoE layer of the GPU expert cache"
                ))
            })
        };
        let alloc_slots = |per_slot: usize| -> std::result::Result<Vec<Slot>, ModelError> {
            let mut slots = Vec::with_capacity(SLOTS);
            for i in 0..SLOTS {
                let name = format!("streamed experts slot {i}");
                let experts = match slot_geometry {
                    Some(g) => GpuExperts::new_records_with_layout(dev, &layout.named(&name), n, per_slot, g)?,
                    None => GpuExperts::new_with_layout(dev, &layout.named(&name), n)?,
                };
                slots.push(Slot {
                    experts,
                    layer: None,
                    first: 0,
                    present: 0,
                    ready: dev.new_event(false)?,
                    free: dev.new_event(false)?,
                    used: false,
                });
            }
            Ok(slots)
        };
        let asked = match slot_vram {
            Some(v) => {
                Some(((v / (SLOTS * chunked_geometry("`CachePlan::strategy` chunked")?.0) as u64) as usize).clamp(1, n))
            }
            None => None,
        };
        // VRAM per expert of a slot: its two slots' records, and for CPU records a staging place.
        let staged = matches!(records, StreamRecords::CpuCache(_));
        let per_expert = slot_geometry.map(|(stride, _)| (SLOTS + staged as usize) * stride);
        let slot_experts = match (asked, per_expert) {
            (Some(c), _) => c,
            // Whole layers when they leave a prefill's activations `KV_RESERVE_BYTES` or take at
            // most half of what the budget leaves (measured on the H200 box: whole layers in
            // 3.52 GiB left 0.1 GiB and a 512-token prefill failed; chunks of 12 ran it).
            (None, Some(per)) if (n * per) as u64 > slot_room(dev.budget().remaining()) => {
                // Chunks of what the budget leaves after a prefill's activations, at least a
                // quarter of what it leaves.
                let left = dev.budget().remaining();
                let room = left.saturating_sub(super::KV_RESERVE_BYTES).max(left / 4);
                let fit = (room / per as u64) as usize;
                if fit == 0 {
                    return Err(ModelError::Invalid(format!(
                        "the VRAM budget leaves room for no streamed expert ({} each in two slots)",
                        krasis_core::budget::format_bytes(per as u64)
                    )));
                }
                fit.min(n)
            }
            _ => n,
        };
        let slots = alloc_slots(slot_experts)?;
        let rotations = if slot_experts < n {
            (0..n)
                .step_by(slot_experts)
                .map(|c0| dev.upload(&rotation(n, c0), "streamed chunk id map").map_err(ModelError::from))
                .collect::<Result<Vec<_>>>()?
        } else {
            Vec::new()
        };
        let mut moe_index = vec![None; num_layers];
        for (li, &l) in h.moe_layers.iter().enumerate() {
            if let Some(slot) = moe_index.get_mut(l as usize) {
                *slot = Some(li);
            }
        }
        let pcie = match (&cpu_geometry, pcie.routes) {
            (_, Some(0)) => Err("off".to_string()),
            (None, _) => Err("the stream reads the GPU expert cache, not the CPU's records".to_string()),
            (Some(g), asked) => match krasis_gpu::moe_pcie::PcieExperts::new(*g) {
                Err(e) => Err(e.to_string()),
                Ok(experts) => {
                    match asked.unwrap_or_else(|| default_pcie_routes(pcie.top_k, experts.bytes_per_route())) {
                        0 => Err("the CPU alone is faster for experts this small".to_string()),
                        routes => Ok(PcieShare { experts, routes }),
                    }
                }
            },
        };
        let source = match records {
            StreamRecords::GpuCache(cache) => Source::Gpu { cache, in_place: slot_geometry.is_some() },
            StreamRecords::CpuCache(experts) => {
                let geometry = cpu_geometry.expect("worked out above for CPU records");
                // Every copy (a slot's run, a chunk, one expert) is staged at the start.
                let staging =
                    dev.alloc_zeros::<u8>(slot_experts * geometry.stride, "streamed CPU records (staging)")?;
                Source::Cpu { experts, geometry, staging }
            }
        };
        let min_tokens = krasis_core::knobs::knobs().gpu_stream_min_tokens.unwrap_or(min_tokens).max(2);
        Ok(ExpertStreamer {
            pinned,
            source,
            copy: dev.new_stream()?,
            moe_index,
            slots: Mutex::new(slots),
            slot_geometry,
            layout,
            min_tokens,
            split,
            copied: AtomicU64::new(0),
            slot_experts,
            rotations,
            pcie,
        })
    }

    /// Routes of each decode token whose experts the GPU reads over PCIe (0: none).
    pub fn pcie_routes(&self) -> usize {
        self.pcie.as_ref().map_or(0, |p| p.routes)
    }

    /// Enqueues decode's PCIe share of model layer `l` on the current stream: for `t` tokens of
    /// `xn`, the last `g` routes of each token's `top_k` in the published `ids` / `weights`
    /// (device addresses), added into `y` (or written, without `accumulate`), with `h` grown as
    /// the intermediate.
    #[allow(clippy::too_many_arguments)]
    pub fn run_pcie_share(
        &self,
        dev: &GpuDevice,
        l: usize,
        xn: &krasis_gpu::cudarc::driver::CudaView<'_, f32>,
        t: usize,
        routes: (u64, u64),
        (top_k, g): (usize, usize),
        h: &mut Option<krasis_gpu::DeviceBuffer<f32>>,
        y: &mut krasis_gpu::cudarc::driver::CudaViewMut<'_, f32>,
        accumulate: bool,
    ) -> Result<()> {
        let Ok(share) = &self.pcie else {
            return Err(ModelError::Invalid("the plan gave a layer a PCIe share the stream cannot read".into()));
        };
        let li = self
            .moe_index
            .get(l)
            .copied()
            .flatten()
            .ok_or_else(|| ModelError::Invalid(format!("layer {l} has no experts in the streamed records")))?;
        let cache = self.source.cache();
        let layer = cache.record_start(li, 0);
        let n = share.experts.scratch_len(t, g);
        let h = super::session::grow(dev, h, n, "PCIe share intermediate")?;
        // SAFETY: the records stay registered (mapped) for the streamer's life, which outlives
        // every call; the published routes are written by the router earlier on this stream.
        unsafe {
            share.experts.run(
                dev,
                self.pinned.device + layer as u64,
                self.n_experts(),
                xn,
                t,
                routes,
                (top_k, top_k - g, g),
                &mut h.slice_mut().slice_mut(..n),
                y,
                accumulate,
            )
        }?;
        Ok(())
    }

    /// Experts a slot holds (a whole layer's unless [`ExpertStreamer::chunked`]).
    pub fn slot_experts(&self) -> usize {
        self.slot_experts
    }

    /// Whether a slot holds only a chunk of a layer ([`ExpertStreamer::run_layer_chunks`]).
    pub fn chunked(&self) -> bool {
        self.slot_experts < self.n_experts()
    }

    /// When a call streams, and how many of each layer's experts ([`crate::placement::StreamRule`]).
    pub fn rule(&self) -> crate::placement::StreamRule {
        crate::placement::StreamRule {
            min_tokens: self.min_tokens,
            split: self.split,
            chunked: self.chunked(),
            n_experts: self.n_experts(),
            pcie_routes: self.pcie_routes(),
        }
    }

    /// How many of each layer's first experts a forward pass of `t` tokens streams
    /// ([`crate::placement::StreamRule::gpu_experts`]).
    pub fn gpu_experts(&self, t: usize) -> usize {
        self.rule().gpu_experts(t)
    }

    /// VRAM one expert takes in the GPU's record layout (`None`: the slots hold four arrays, and
    /// experts cannot be pinned one by one).
    pub fn record_bytes(&self) -> Option<usize> {
        self.slot_geometry.map(|(stride, _)| stride)
    }

    /// The experts `ids` of MoE layer `li` copied (and laid out for the GPU) into VRAM, renumbered
    /// `0..ids.len()` in that order: a layer's pinned experts ([`super::hot_experts`]). Done at
    /// load, on the copy stream, synchronously.
    pub fn pin(&self, dev: &GpuDevice, li: usize, ids: &[usize]) -> Result<GpuExperts> {
        let n = self.n_experts();
        let name = format!("pinned experts of MoE layer {li}");
        let mut ex = self.new_records(dev, &name, n, ids.len().max(1))?;
        for (j, &e) in ids.iter().enumerate() {
            self.copy_expert_async(dev, li, e, &mut ex, j)?;
        }
        self.sync_copies()?;
        Ok(ex)
    }

    /// Experts of this streamer's width and record geometry, numbered `0..n_experts`, with storage
    /// for the first `stored`.
    pub(crate) fn new_records(
        &self,
        dev: &GpuDevice,
        name: &str,
        n_experts: usize,
        stored: usize,
    ) -> Result<GpuExperts> {
        let Some(geometry) = self.slot_geometry else {
            return Err(ModelError::Invalid(
                "keeping experts one by one in VRAM needs one record geometry for every MoE layer of the GPU expert cache".into(),
            ));
        };
        Ok(GpuExperts::new_records_with_layout(dev, &self.layout.named(name), n_experts, stored, geometry)?)
    }

    /// Routed experts per MoE layer.
    pub fn n_experts(&self) -> usize {
        self.source.cache().header().n_experts as usize
    }

    /// MoE layers of the cache.
    pub fn moe_layers(&self) -> usize {
        self.source.cache().header().moe_layers.len()
    }

    /// Enqueues on the copy stream expert `e` of MoE layer `li` into expert `slot` of `dst`
    /// (records from [`ExpertStreamer::new_records`]), laid out for the GPU (CPU records pass
    /// through the start of the staging buffer, which the copy stream's order keeps from being
    /// overwritten before the conversion read it). Returns the bytes copied over PCIe. The copy is
    /// ordered after the copy stream's earlier work; [`ExpertStreamer::sync_copies`] or an event
    /// recorded after it ([`ExpertStreamer::compute_waits_for_copies`]) waits for it, and `dst`
    /// must not be read before.
    pub(crate) fn copy_expert_async(
        &self,
        dev: &GpuDevice,
        li: usize,
        e: usize,
        dst: &mut GpuExperts,
        slot: usize,
    ) -> Result<usize> {
        let n = self.n_experts();
        if e >= n || li >= self.moe_layers() {
            return Err(ModelError::Invalid(format!(
                "copying expert {e} of MoE layer {li}: the cache has {} layers of {n}",
                self.moe_layers()
            )));
        }
        // SAFETY: the caller does not read `dst` before waiting for the copy stream.
        unsafe { self.copy_records(dev, dst, li, e..e + 1, slot) }
    }

    /// Enqueues on the copy stream MoE layer `li`'s experts `experts` into `dst`'s experts from
    /// `at` on, laid out for the GPU; returns the bytes copied over PCIe. CPU records pass through
    /// the start of the staging buffer (one slot long), which only the copy stream touches: its
    /// order keeps each staging copy behind the conversion that read the previous one.
    ///
    /// # Safety
    /// Nothing may read or write those experts of `dst` on another stream before the copy
    /// stream's work enqueued so far is done (an event recorded after this call, or a sync).
    unsafe fn copy_records(
        &self,
        dev: &GpuDevice,
        dst: &mut GpuExperts,
        li: usize,
        experts: std::ops::Range<usize>,
        at: usize,
    ) -> Result<usize> {
        let cache = self.source.cache();
        let run = cache.layer_records(li, experts.clone());
        let to = at..at + experts.len();
        // SAFETY: the records are registered (page-locked) for the streamer's life, which the
        // copies cannot outlive (the experts are dropped after the stream work drains on drop of
        // the device); the staging buffer as above; `dst` as the caller promises.
        let bytes = unsafe {
            match &self.source {
                Source::Cpu { geometry, staging, .. } => {
                    let from = self.stage(staging, run)?;
                    dst.convert_cpu_records_async(dev, &self.copy, to, from, geometry)?
                }
                Source::Gpu { in_place: true, .. } => dst.copy_record_run_async(&self.copy, to, run)?,
                Source::Gpu { in_place: false, .. } => {
                    let e = |p: usize| p - at + experts.start;
                    dst.copy_records_async(&self.copy, to, &|p| (cache.w13(li, e(p)), cache.w2(li, e(p))))?
                }
            }
        };
        self.copied.fetch_add(bytes as u64, Ordering::Relaxed);
        Ok(bytes)
    }

    /// Makes the compute stream wait for the copy stream's work enqueued so far (through `ev`, an
    /// event of the caller's, recorded now).
    pub(crate) fn compute_waits_for_copies(&self, dev: &GpuDevice, ev: &CudaEvent) -> Result<()> {
        ev.record(&self.copy).map_err(|e| GpuError::Driver { op: "cuEventRecord", detail: e.to_string() })?;
        dev.stream().wait(ev).map_err(|e| GpuError::Driver { op: "cuStreamWaitEvent", detail: e.to_string() })?;
        Ok(())
    }

    /// Waits until the copy stream's work is done.
    pub(crate) fn sync_copies(&self) -> Result<()> {
        self.copy.synchronize().map_err(|e| GpuError::Driver { op: "cuStreamSynchronize", detail: e.to_string() })?;
        Ok(())
    }

    /// Enqueues on the copy stream a copy of CPU records `run` into the start of the staging
    /// buffer; returns that device address (where the conversion reads them).
    ///
    /// # Safety
    /// `run` must lie in the page-locked records, and the staging buffer must not be in use by a
    /// conversion still in flight on another stream (the copy stream orders its own).
    unsafe fn stage(&self, staging: &krasis_gpu::DeviceBuffer<u8>, run: &[u8]) -> Result<u64> {
        use krasis_gpu::cudarc::driver::DevicePtr;
        if run.len() > staging.len() {
            return Err(ModelError::Invalid(format!(
                "streamed experts: {} bytes of records do not fit the {}-byte staging buffer",
                run.len(),
                staging.len()
            )));
        }
        let (at, _g) = staging.device_ptr(&self.copy);
        // SAFETY: as the caller promises; the range lies in the staging buffer (checked).
        let r = unsafe {
            krasis_gpu::cudarc::driver::sys::cuMemcpyHtoDAsync_v2(
                at,
                run.as_ptr().cast(),
                run.len(),
                self.copy.cu_stream(),
            )
        };
        r.result().map_err(|e| GpuError::Driver { op: "cuMemcpyHtoDAsync", detail: e.to_string() })?;
        Ok(at)
    }

    /// MoE layer index of the cache for model layer `layer`.
    pub fn moe_layer(&self, layer: usize) -> Option<usize> {
        self.moe_index.get(layer).copied().flatten()
    }

    /// VRAM the slots hold.
    pub fn vram_bytes(&self) -> usize {
        self.slots.lock().unwrap_or_else(|p| p.into_inner()).iter().map(|s| s.experts.weight_bytes()).sum()
    }

    /// Host→device bytes copied so far.
    pub fn copied_bytes(&self) -> u64 {
        self.copied.load(Ordering::Relaxed)
    }

    /// The copy stream's state and the slots' contents, for a stall report (the slots are
    /// skipped while a call holds them).
    pub fn describe_state(&self, dev: &GpuDevice) -> String {
        let slots = match self.slots.try_lock() {
            Ok(slots) => slots
                .iter()
                .enumerate()
                .map(|(i, s)| match s.layer {
                    Some(l) => format!("slot {i}: MoE layer {l}, experts {}..{}", s.first, s.first + s.present),
                    None => format!("slot {i}: empty"),
                })
                .collect::<Vec<_>>()
                .join(", "),
            Err(_) => "slots held by the call".into(),
        };
        format!("expert stream: copy stream {}, {slots}", dev.stream_state(&self.copy))
    }

    /// One line for the load log.
    pub fn describe(&self) -> String {
        let slots = if self.chunked() {
            format!("{SLOTS} slots of {} experts: each layer streams in chunks", self.slot_experts)
        } else {
            format!("{SLOTS} slots of one MoE layer")
        };
        format!(
            "prefills of ≥ {} tokens stream the routed experts to the GPU, short ones only a share while the CPU runs the rest (64 tokens: {} of {}; {slots}, {}, {}; records page-locked in RAM: {})",
            self.min_tokens,
            self.gpu_experts(64.max(self.min_tokens)),
            self.source.cache().header().n_experts,
            krasis_core::budget::format_bytes(self.vram_bytes() as u64),
            match &self.source {
                Source::Cpu { .. } => "from the CPU expert cache (no second copy), laid out on the GPU after each copy",
                Source::Gpu { in_place: true, .. } => "records in place, one copy per run",
                Source::Gpu { in_place: false, .. } => "one copy per expert part",
            },
            krasis_cache::describe(self.source.cache())
        ) + &match &self.pcie {
            Ok(p) => format!(
                "; decode: the GPU reads {} routes of each token's experts over PCIe from those records while the CPU reads the rest",
                p.routes
            ),
            Err(why) => format!("; decode: the CPU reads every route's experts (PCIe share: {why})"),
        }
    }

    /// Enqueues the records of MoE layer `li`'s first `present` experts into `slot` on the copy
    /// stream (only those it lacks when it holds the layer already).
    fn fill(&self, dev: &GpuDevice, slot: &mut Slot, li: usize, present: usize) -> Result<()> {
        let have = if slot.layer == Some(li) && slot.first == 0 { slot.present } else { 0 };
        if have >= present {
            return Ok(());
        }
        self.load_slot(dev, slot, li, have..present, have)
    }

    /// Enqueues the records of MoE layer `li`'s experts `chunk` into slot positions
    /// `0..chunk.len()` on the copy stream (nothing when it holds them already).
    fn fill_chunk(&self, dev: &GpuDevice, slot: &mut Slot, li: usize, chunk: std::ops::Range<usize>) -> Result<()> {
        if slot.layer == Some(li) && slot.first == chunk.start && slot.present == chunk.len() {
            return Ok(());
        }
        self.load_slot(dev, slot, li, chunk, 0)
    }

    /// Enqueues on the copy stream, after the slot's last use on the compute stream, MoE layer
    /// `li`'s experts `experts` into slot positions from `at` on, then the slot's `ready`; the
    /// slot then holds the layer's experts from `experts.start − at` to `experts.end`.
    fn load_slot(
        &self,
        dev: &GpuDevice,
        slot: &mut Slot,
        li: usize,
        experts: std::ops::Range<usize>,
        at: usize,
    ) -> Result<()> {
        if slot.used {
            self.copy
                .wait(&slot.free)
                .map_err(|e| GpuError::Driver { op: "cuStreamWaitEvent", detail: e.to_string() })?;
        }
        // SAFETY: the compute stream waits `ready`, recorded below, before it reads the slot.
        unsafe { self.copy_records(dev, &mut slot.experts, li, experts.clone(), at) }?;
        slot.ready.record(&self.copy).map_err(|e| GpuError::Driver { op: "cuEventRecord", detail: e.to_string() })?;
        (slot.layer, slot.first, slot.present) = (Some(li), experts.start - at, at + experts.len());
        Ok(())
    }

    /// Chunked slots: runs `f(experts, first, count, map)` for each chunk of model layer `layer`'s
    /// routed experts in turn — `experts` holds experts `first..first + count` as its first
    /// `count`, and `map` renumbers the layer's expert ids to match (`(e − first) mod n`) — while
    /// the next chunk (the next MoE layer's first after the last) copies into the other slot.
    pub fn run_layer_chunks(
        &self,
        dev: &GpuDevice,
        layer: usize,
        mut f: impl FnMut(&GpuExperts, usize, usize, &krasis_gpu::DeviceBuffer<i32>) -> Result<()>,
    ) -> Result<()> {
        let li = self.moe_layer(layer).ok_or_else(|| {
            ModelError::Invalid(format!("streamed experts: model layer {layer} is not a MoE layer of the cache"))
        })?;
        let (n, c, n_moe) = (self.n_experts(), self.slot_experts, self.moe_layers());
        let chunk_of = |li: usize, first: usize| (li, first..(first + c).min(n));
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        for (j, first) in (0..n).step_by(c).enumerate() {
            let (_, range) = chunk_of(li, first);
            let (next_li, next_first) = if first + c < n { (li, first + c) } else { ((li + 1) % n_moe, 0) };
            let holds = |s: &Slot, l: usize, f0: usize| s.layer == Some(l) && s.first == f0;
            let i = slots
                .iter()
                .position(|s| holds(s, li, first))
                .unwrap_or_else(|| slots.iter().position(|s| !holds(s, next_li, next_first)).unwrap_or(0));
            self.fill_chunk(dev, &mut slots[i], li, range.clone())?;
            let slot = &mut slots[i];
            dev.stream()
                .wait(&slot.ready)
                .map_err(|e| GpuError::Driver { op: "cuStreamWaitEvent", detail: e.to_string() })?;
            f(&slot.experts, first, range.len(), &self.rotations[j])?;
            slot.free
                .record(dev.stream())
                .map_err(|e| GpuError::Driver { op: "cuEventRecord", detail: e.to_string() })?;
            slot.used = true;
            let (nl, nr) = chunk_of(next_li, next_first);
            let other = (i + 1) % SLOTS;
            if !holds(&slots[other], nl, nr.start) {
                self.fill_chunk(dev, &mut slots[other], nl, nr)?;
            }
        }
        Ok(())
    }

    /// Runs `f` with model layer `layer`'s first `present` routed experts in VRAM (copied in now
    /// unless the previous call already did), then starts copying the next MoE layer's into the
    /// other slot. Everything is ordered with events: no host synchronisation.
    pub fn run_layer(
        &self,
        dev: &GpuDevice,
        layer: usize,
        present: usize,
        f: impl FnOnce(&GpuExperts) -> Result<()>,
    ) -> Result<()> {
        let li = self.moe_index.get(layer).copied().flatten().ok_or_else(|| {
            ModelError::Invalid(format!("streamed experts: model layer {layer} is not a MoE layer of the cache"))
        })?;
        let n_moe = self.source.cache().header().moe_layers.len();
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        let i = match slots.iter().position(|s| s.layer == Some(li)) {
            Some(i) => i,
            None => {
                // The slot not holding the layer after this one (a prefetch in flight) takes it.
                let next = (li + 1) % n_moe;
                slots.iter().position(|s| s.layer != Some(next)).unwrap_or(0)
            }
        };
        self.fill(dev, &mut slots[i], li, present)?;
        let slot = &mut slots[i];
        dev.stream()
            .wait(&slot.ready)
            .map_err(|e| GpuError::Driver { op: "cuStreamWaitEvent", detail: e.to_string() })?;
        f(&slot.experts)?;
        slot.free.record(dev.stream()).map_err(|e| GpuError::Driver { op: "cuEventRecord", detail: e.to_string() })?;
        slot.used = true;
        // The next MoE layer (the first after the last: the next prompt starts there).
        let next = (li + 1) % n_moe;
        if next != li {
            let j = slots.iter().position(|s| s.layer == Some(next)).unwrap_or((i + 1) % SLOTS);
            self.fill(dev, &mut slots[j], next, present)?;
        }
        Ok(())
    }
}

impl Drop for ExpertStreamer {
    fn drop(&mut self) {
        // Copies still in flight read the pinned records and write the slots: let them finish
        // before either goes.
        let _ = self.copy.synchronize();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The default share: glm-4.5-air's experts (8.9 MB INT4, top-8) 2 routes, V2-Lite's (4.5 MB,
    /// top-6) 1, tiny ones none; never every route.
    #[test]
    fn the_default_pcie_share_follows_the_expert_size() {
        assert_eq!(default_pcie_routes(8, 8_930_000), 2);
        assert_eq!(default_pcie_routes(6, 4_460_000), 1);
        assert_eq!(default_pcie_routes(6, 40_000), 0);
        assert_eq!(default_pcie_routes(1, 100_000_000), 0);
        assert_eq!(default_pcie_routes(0, 1), 0);
        for k in 1..=16 {
            assert!(default_pcie_routes(k, 1 << 30) < k);
        }
    }

    #[test]
    fn chunk_rotations_number_each_chunk_first_and_are_permutations() {
        for (n, c) in [(64, 7), (16, 3), (4, 3), (5, 1), (8, 8)] {
            let mut covered = vec![0; n];
            for first in (0..n).step_by(c) {
                let m = rotation(n, first);
                let mut sorted = m.clone();
                sorted.sort();
                assert_eq!(sorted, (0..n as i32).collect::<Vec<_>>(), "n {n} first {first}");
                // The chunk's experts are 0..len in order; every other id lands at len or above.
                let len = c.min(n - first);
                for (e, &id) in m.iter().enumerate() {
                    let inside = (first..first + len).contains(&e);
                    assert_eq!(inside, (id as usize) < len, "n {n} first {first} e {e}");
                    if inside {
                        assert_eq!(id as usize, e - first);
                        covered[e] += 1;
                    }
                }
            }
            assert!(covered.iter().all(|&k| k == 1), "every expert in exactly one chunk: {covered:?}");
        }
    }

    #[test]
    fn split_share_grows_with_the_prompt_and_ends_at_every_expert() {
        if krasis_core::knobs::knobs().gpu_stream_split.is_some() {
            eprintln!("SKIPPED: KRASIS_GPU_STREAM_SPLIT is set; the measured policy is not in use");
            return;
        }
        let shares: Vec<f64> = (GPU_STREAM_MIN_TOKENS..SPLIT_MAX_TOKENS).map(split_fraction).collect();
        assert!(shares.windows(2).all(|w| w[0] <= w[1]), "the share never shrinks as the prompt grows");
        assert!(shares.iter().all(|&f| (0.2..=1.0).contains(&f)), "{shares:?}");
        // The measured best shares: ~30-45 % at 16 tokens, 45-55 % at 64, 65-75 % at 128.
        assert!((0.3..=0.45).contains(&split_fraction(16)), "{}", split_fraction(16));
        assert!((0.45..=0.6).contains(&split_fraction(64)), "{}", split_fraction(64));
        assert!((0.6..=0.75).contains(&split_fraction(128)), "{}", split_fraction(128));
        assert_eq!(split_fraction(SPLIT_MAX_TOKENS), 1.0);
        assert_eq!(split_fraction(10_240), 1.0);
        let all = all_streamed_from();
        assert!(split_fraction(all) == 1.0 && split_fraction(all - 1) < 1.0, "{all}");
    }
}
