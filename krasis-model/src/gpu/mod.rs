//! The whole model on one GPU (`--device gpu`): every weight in VRAM (BF16, or weight-only INT8
//! per output channel where a `--*-quant int8` flag asks for it), the KV cache on the device in
//! BF16 or FP8, and a forward pass that never waits for the device except to read back the sampled
//! token.
//!
//! The layer math mirrors the CPU reference engine (`crate::cpu`) op for op; activations and the
//! residual stream stay f32 between ops, matrix inputs are rounded to BF16 at each GEMM (as
//! transformers' BF16 run does). MLA runs in two forms: prefill expands the latent cache into
//! per-head K/V through `kv_b_proj` and runs the flash kernel; decode (one token) runs in the
//! absorbed form over the latent cache.
//!
//! [`GpuPrecision::F32`] is the precise mode, for checking the GPU path against an f32 reference
//! rather than for speed: no matrix input is rounded to BF16 (cuBLAS multiplies x as two BF16
//! halves), the KV cache keeps f32 rows, and attention runs in the prefill form for every call
//! (the SIMT flash kernel over f32 q, k and v; decode steps included). The routed experts were
//! already computed at about f32 accuracy (see `krasis_gpu::moe`).

mod deltanet;
pub mod expert_cache;
pub mod expert_pool;
pub mod expert_stream;
mod host_experts;
pub mod hot_experts;
mod layers;
mod load;
mod placed;
pub mod prefix;
mod profile;
mod session;
pub mod vram_plan;
mod watch;

use krasis_gpu::attn_decode::DecodeWorkspace;
use krasis_gpu::kv_cache::{GpuKvCache, KvCapacity, KvDtype, KvLayout};
use krasis_gpu::linear::{GemmContext, LinearQuant};
use krasis_gpu::sampling::{GpuSampler, GpuSamplingParams};
use krasis_gpu::{DeviceBuffer, GpuDevice, VramBudgetSpec};

pub use self::deltanet::session_state_bytes;
use self::layers::GpuKinds;
pub use self::load::{
    check_gpu_layers, check_hybrid_gpu_experts, whole_model_vram_bytes, ExpertPlacement, MIN_USEFUL_KV_TOKENS,
};
pub use self::session::GpuSession;
use self::session::{DeltaRows, KvRows, StepIo};
use crate::error::{ModelError, Result};
use crate::model::build::Weights;
pub use crate::placement::{
    CachePlan, CacheStrategy, StreamFrom, StreamSplit, HOT_MIN_KV_TOKENS, HOT_PREFILL_RESERVE_BYTES,
};
use crate::text::generate::{Decoder, DecoderStep};
use crate::text::sampling::Sampler;
use crate::ModelSpec;

/// `--device gpu` settings.
#[derive(Clone, Debug)]
pub struct GpuOptions {
    /// `--gpu N`.
    pub ordinal: usize,
    /// `--vram-budget BYTES|auto`.
    pub vram_budget: VramBudgetSpec,
    /// `--kv-dtype`.
    pub kv_dtype: KvDtype,
    /// `--attention-quant`: q/kv_a/o (and q_a/q_b) projections, GQA q/k/v/o.
    pub attention_quant: LinearQuant,
    /// `--shared-expert-quant`.
    pub shared_expert_quant: LinearQuant,
    /// `--dense-mlp-quant`: the dense (non-MoE) layers' MLP.
    pub dense_mlp_quant: LinearQuant,
    /// `--kv-b-proj-quant`: MLA's `kv_b_proj` as used by prefill (decode's absorbed form reads
    /// the BF16 copy).
    pub kv_b_proj_quant: LinearQuant,
    /// `--lm-head-quant`.
    pub lm_head_quant: LinearQuant,
    /// KV capacity in tokens; `None`: sized by the VRAM plan ([`vram_plan`]) from what the budget
    /// leaves after the weights, capped at the model's `max_position_embeddings`.
    pub kv_tokens: Option<usize>,
    /// Context the caller will need (a benchmark's prompt and decode), which a KV cache sized
    /// from the budget then holds at least; `None`: not said.
    pub context_tokens: Option<usize>,
    /// The resolved width of the routed experts the GPU loader gets: resident on the GPU in BF16
    /// (`None`) or quantised symmetric per group along K (INT8 / INT4, as the CPU cache). This is
    /// not the option a caller sets: that is [`crate::runtime::EngineConfig::gpu_expert_width`],
    /// which the device choice resolves into this field (a value set here is taken as asked).
    pub expert_bits: Option<krasis_quant::Bits>,
    /// With `expert_bits` INT4 on a 4-bit float checkpoint: the routed experts keep this format
    /// as stored (MXFP4, NVFP4: codes and scales never requantised, the GPU FP4 tile layout), as
    /// the CPU expert cache does at `auto`; `None`: INT4 requantised from the exact values. The
    /// device choice sets it with the default width ([`crate::placement::precision::native_fp4`]).
    pub expert_fp4: Option<krasis_quant::fp4::Fp4Kind>,
    /// `--group-size`: the quantised experts' group along K (halved while a dimension is not
    /// divisible, down to 32).
    pub expert_group_size: usize,
    /// Where quantised experts come from ([`GpuExpertCache`]).
    pub expert_cache: GpuExpertCache,
    /// Hybrid with `expert_bits`: prompts of at least this many tokens stream the routed experts
    /// to the GPU ([`expert_stream::GPU_STREAM_MIN_TOKENS`]; `KRASIS_GPU_STREAM_MIN_TOKENS`
    /// overrides it for measurements).
    pub stream_min_tokens: usize,
    /// How much of each layer a prompt that streams sends to the GPU while the CPU runs the rest.
    pub stream_split: StreamSplit,
    /// Which copy of the experts a hybrid prefill streams ([`StreamFrom`]).
    pub stream_from: StreamFrom,
    /// Hybrid with `expert_bits`: `--cache-strategy` ([`CachePlan`]).
    pub cache: Option<CachePlan>,
    /// Sessions that hold a KV cache at once (`krasis serve --max-batch`): with `kv_tokens`
    /// given, the VRAM plan keeps room for this many caches before it pins experts.
    pub sessions: usize,
    /// VRAM the plan keeps for the prefix cache (`krasis serve --prefix-cache-mib`).
    pub prefix_cache_bytes: u64,
    /// `--gpu-precision`: how the dense parts and attention compute ([`GpuPrecision`]).
    pub precision: GpuPrecision,
    /// `--invariant-prefill`: every prompt call (of at least [`INVARIANT_MIN_TOKENS`] tokens)
    /// computes each row independently of the call's other rows, so a prompt's logits and KV rows
    /// are the same bits however it is split into calls: a prefix resumed from the prefix cache,
    /// or a prompt run in chunks, gives the logits of one whole-prompt call. How: the GEMMs in
    /// cuBLAS calls of a fixed row count ([`krasis_gpu::linear::FIXED_ROWS`]), the routed
    /// experts' grouped kernels at every size, attention reading every key through the KV cache,
    /// and a hybrid prompt's experts all on the GPU (no CPU share for short calls). Decode steps
    /// keep their own kernels, so a saved prefix resumes exactly only up to where its prompt
    /// calls reached. Gated-DeltaNet layers run the token-by-token recurrence at every length
    /// (slower than the chunked form on long prompts). Refused with [`GpuPrecision::F32`].
    pub invariant_prefill: bool,
    /// Hybrid decode: routes of each token whose experts the GPU reads over PCIe from the CPU
    /// expert records in page-locked RAM, while the CPU reads the other routes' experts
    /// ([`krasis_gpu::moe_pcie`]); `None`: [`expert_stream::default_pcie_routes`] (from the
    /// experts' size) for SiLU experts without biases, none for others; `Some(0)`: off. Needs the
    /// stream from the CPU's records.
    pub pcie_routes: Option<usize>,
}

/// The fewest tokens a row-invariant prompt call has: one token runs the decode form (its own
/// kernels), so a resumed prefix or a prompt's last chunk always leaves at least this many.
pub const INVARIANT_MIN_TOKENS: usize = 2;

/// How the GPU computes its dense parts and attention (`--gpu-precision bf16|f32`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GpuPrecision {
    /// Matrix inputs rounded to BF16 at each GEMM, attention on the tensor cores over BF16 q, k
    /// and v, the KV cache in [`GpuOptions::kv_dtype`]: as transformers' BF16 run computes.
    #[default]
    Bf16,
    /// Nothing rounded to BF16 but the weights as stored: x multiplied as two BF16 halves, an f32
    /// KV cache, attention in the prefill form over f32 (module docs). Several times slower;
    /// for verification. One sequence per call (no batched decode steps). Norm weights stay BF16
    /// vectors, so a zero-centred norm's `1 + w` is rounded (the gated-DeltaNet families).
    F32,
}

impl std::str::FromStr for GpuPrecision {
    type Err = ModelError;

    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "bf16" => Ok(GpuPrecision::Bf16),
            "f32" => Ok(GpuPrecision::F32),
            _ => Err(ModelError::Invalid(format!("{s:?} is not a GPU precision (expected bf16 or f32)"))),
        }
    }
}

impl std::fmt::Display for GpuPrecision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            GpuPrecision::Bf16 => "bf16",
            GpuPrecision::F32 => "f32",
        })
    }
}

impl GpuOptions {
    /// The KV cache's storage: [`GpuOptions::kv_dtype`], or f32 with [`GpuPrecision::F32`] (which
    /// refuses an FP8 cache: it would round what the mode keeps).
    pub fn kv_storage(&self) -> Result<KvDtype> {
        match (self.precision, self.kv_dtype) {
            (GpuPrecision::Bf16, kv) => Ok(kv),
            (GpuPrecision::F32, KvDtype::Fp8) => Err(ModelError::Invalid(
                "`GpuPrecision::F32` keeps the KV cache in f32; it cannot be combined with `KvDtype::Fp8` \
                 (`GpuOptions::kv_dtype`)"
                    .into(),
            )),
            (GpuPrecision::F32, _) => Ok(KvDtype::F32),
        }
    }

    /// Refuses [`GpuOptions::invariant_prefill`] where it cannot hold: with the precise mode
    /// (whose products have no fixed-row form).
    pub fn check_invariant(&self) -> Result<()> {
        if self.invariant_prefill && self.precision == GpuPrecision::F32 {
            return Err(ModelError::Invalid(
                "`GpuOptions::invariant_prefill` cannot be combined with `GpuPrecision::F32` (the precise mode has no \
                 fixed-row products)"
                    .into(),
            ));
        }
        Ok(())
    }
}

/// Where `--gpu-expert-bits 4|8` finds its experts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GpuExpertCache {
    /// The GPU expert cache ([`expert_cache`]) in this directory, or in the model's default
    /// cache directory (`None`; `--cache-dir`), built on the first start.
    In(Option<std::path::PathBuf>),
    /// Quantised from the source weights at every load; nothing is written (read-only places).
    Off,
}

impl Default for GpuOptions {
    fn default() -> Self {
        GpuOptions {
            ordinal: 0,
            vram_budget: VramBudgetSpec::Auto,
            kv_dtype: KvDtype::Bf16,
            attention_quant: LinearQuant::Bf16,
            shared_expert_quant: LinearQuant::Bf16,
            dense_mlp_quant: LinearQuant::Bf16,
            kv_b_proj_quant: LinearQuant::Bf16,
            lm_head_quant: LinearQuant::Bf16,
            kv_tokens: None,
            context_tokens: None,
            expert_bits: None,
            expert_fp4: None,
            expert_group_size: krasis_quant::group::DEFAULT_GROUP_SIZE,
            expert_cache: GpuExpertCache::In(None),
            stream_min_tokens: expert_stream::GPU_STREAM_MIN_TOKENS,
            stream_split: StreamSplit::Measured,
            stream_from: StreamFrom::CpuCache,
            cache: None,
            sessions: 1,
            prefix_cache_bytes: 0,
            precision: GpuPrecision::Bf16,
            invariant_prefill: false,
            pcie_routes: None,
        }
    }
}

/// VRAM left out of the KV cache when it is sized from the budget: activations and workspaces of
/// a prefill chunk (a 10K-token MLA prefill of V2-Lite needs ≈ 1.3 GB of expanded K/V and scratch).
pub const KV_RESERVE_BYTES: u64 = 2 << 30;

/// Largest query count that runs attention in the decode form (absorbed MLA / split-KV GQA); more
/// tokens take the flash prefill kernel. One: decode steps.
const DECODE_MAX_TOKENS: usize = 1;

/// Prompt length of the load-time warm-up ([`GpuModel::warm_up`]): long enough to take the
/// prefill's GEMMs (cuBLAS) and, on the hybrid engine, a split streamed layer. Measured on the
/// H200 box (v2-lite, INT4): without it the first prefill of a process spent 37–57 ms enqueueing
/// its first layer, and a 64-token hybrid prefill took 170 ms against 110 ms for the next one.
pub const WARM_UP_TOKENS: usize = 64;

/// A model loaded onto one GPU.
pub struct GpuModel {
    pub spec: ModelSpec,
    dev: GpuDevice,
    gemm: GemmContext,
    weights: Weights<GpuKinds>,
    /// RoPE tables for positions `0..max_pos`, `[max_pos, rot_dim/2]`.
    cos: DeviceBuffer<f32>,
    sin: DeviceBuffer<f32>,
    rope_half: usize,
    rope_pairing: krasis_gpu::RopePairing,
    max_pos: usize,
    sampler: GpuSampler,
    kv_layout: KvLayout,
    kv_tokens: usize,
    /// The longest prompt piece one forward call runs ([`vram_plan`]); longer prompts run in
    /// chunks of it.
    prefill_chunk: usize,
    /// The activation scratch estimate the chunk was sized by.
    scratch_cost: vram_plan::ScratchCost,
    /// Human-readable lines about what loading did.
    pub log: Vec<String>,
    /// Bytes of one routed expert as the host reads it, when the experts run on the host from
    /// the expert cache (the hybrid engine): for bytes-per-token arithmetic.
    pub host_expert_bytes: Option<u64>,
    /// The thread serving the host experts' hand-offs (hybrid).
    expert_server: Option<host_experts::ExpertServer>,
    /// The placement plan and the expert resources it names (stream slots, pins, pool).
    pub(crate) placed: placed::Placed,
    /// Buffers of batched decode steps ([`Decoder::step_batch`]), one step at a time.
    batch: std::sync::Mutex<BatchState>,
    /// Heatmap counts `[layers × experts]` on the device, while recording
    /// ([`GpuModel::record_heatmap`]).
    heat: Option<DeviceBuffer<u64>>,
    /// What the current forward call is doing ([`GpuModel::diagnose`]).
    watch: watch::CallWatch,
    /// [`GpuOptions::precision`].
    precision: GpuPrecision,
    /// [`GpuOptions::invariant_prefill`].
    invariant_prefill: bool,
}

/// What a batched decode step needs besides the sessions' KV caches: activations for one row per
/// sequence, the attention workspace and the hybrid hand-off buffers. Kept by the model, not by a
/// session, because a batch spans sessions; grown to the largest batch seen.
struct BatchState {
    scratch: session::Scratch,
    ws: DecodeWorkspace,
    host: host_experts::HostStaging,
    /// The batch's table of its sequences' DeltaNet state blocks (gated-DeltaNet models).
    delta_table: session::Slot<u64>,
}

impl Default for BatchState {
    fn default() -> Self {
        BatchState {
            scratch: Default::default(),
            ws: DecodeWorkspace::new(),
            host: Default::default(),
            delta_table: None,
        }
    }
}

/// Fewest decode steps that [`Decoder::step_batch`] runs as one batched forward pass; a single
/// one keeps the session's own path (its sampled id stays on the device, its profile runs).
const BATCH_MIN_SEQS: usize = 2;

impl GpuModel {
    pub fn device(&self) -> &GpuDevice {
        &self.dev
    }

    /// The placement plan's start lines, with `why` (the device choice's reason) where no other
    /// reason applies ([`crate::placement::PlacementPlan::describe`]).
    pub fn placement_lines(&mut self, why: &str) -> Vec<String> {
        self.placed.because(why);
        self.placed.plan().describe()
    }

    /// Whether the routed experts run on the host (the hybrid engine).
    pub fn experts_on_host(&self) -> bool {
        self.expert_server.is_some()
    }

    /// Counts every MoE layer's routes on the device from now on ([`GpuModel::expert_counts`]).
    pub fn record_heatmap(&mut self) -> Result<()> {
        let n = self.weights.layers.len() * self.spec.routed_experts();
        self.heat = Some(self.dev.alloc_zeros::<u64>(n.max(1), "heatmap counts")?);
        Ok(())
    }

    /// The heatmap counts so far, `[layers × experts]` (a synchronisation), while recording.
    pub fn expert_counts(&self) -> Result<Option<Vec<u64>>> {
        match &self.heat {
            Some(b) => {
                let mut v = self.dev.download(b)?;
                v.truncate(self.weights.layers.len() * self.spec.routed_experts());
                Ok(Some(v))
            }
            None => Ok(None),
        }
    }

    /// Tokens of KV cache each session holds.
    pub fn kv_capacity(&self) -> usize {
        self.kv_tokens
    }

    pub fn check_tokens(&self, tokens: &[u32]) -> Result<()> {
        for (pos, &id) in tokens.iter().enumerate() {
            if id as usize >= self.spec.vocab_size {
                return Err(ModelError::TokenOutOfRange { id: id as u64, pos, vocab: self.spec.vocab_size });
            }
        }
        Ok(())
    }

    /// A session with its own KV cache of [`GpuModel::kv_capacity`] tokens (and, for
    /// gated-DeltaNet models, the zero states of its DeltaNet layers).
    pub fn new_session(&self) -> Result<GpuSession> {
        let cache = GpuKvCache::with_layout(&self.dev, self.kv_layout, KvCapacity::Tokens(self.kv_tokens))?;
        let delta = deltanet::SessionDelta::new(&self.dev, &self.spec)?;
        Ok(GpuSession::new(cache, delta, DecodeWorkspace::new()))
    }

    /// A session holding `pos` tokens has room in its KV cache for `t` more.
    fn check_room(&self, pos: usize, t: usize) -> Result<()> {
        if pos + t > self.kv_tokens {
            let what = if t == 1 { "token exceeds" } else { "tokens exceed" };
            return Err(ModelError::Invalid(format!(
                "context full: {pos} cached + {t} new {what} the KV cache's {} tokens (raise the VRAM budget, `GpuOptions::vram_budget`, or keep the KV cache in FP8, `KvDtype::Fp8`)",
                self.kv_tokens
            )));
        }
        Ok(())
    }

    /// Runs `tokens` after what `session` holds; the logits of the last position (or of every
    /// position with `all`) stay on the device in `session`'s logits buffer, `[rows, vocab]`.
    /// Returns the number of logit rows. A prompt longer than the prefill chunk
    /// ([`vram_plan`]) runs as equal chunks, one forward call each; only the last one's logits
    /// are kept (the others' positions reach later ones through the KV cache).
    fn run(
        &self,
        s: &mut GpuSession,
        tokens: Option<&[u32]>,
        all: bool,
        tail: &mut dyn FnMut(&mut session::Scratch, usize) -> Result<()>,
    ) -> Result<usize> {
        let chunk = self.prefill_chunk.max(1);
        let Some(ids) = tokens.filter(|t| t.len() > chunk) else {
            return self.run_call(s, tokens, all, tail);
        };
        if all {
            return Err(ModelError::Invalid(format!(
                "the logits of every position of a {}-token prompt: the VRAM budget runs prompts in chunks of up to {chunk} tokens",
                ids.len()
            )));
        }
        let pieces = ids.len().div_ceil(chunk);
        let size = ids.len().div_ceil(pieces);
        let mut cut = (pieces - 1) * size;
        // A row-invariant prompt never ends in a piece shorter than a prompt call
        // (`INVARIANT_MIN_TOKENS`): the piece before gives it a token.
        if self.invariant_prefill && ids.len() - cut < INVARIANT_MIN_TOKENS && size > INVARIANT_MIN_TOKENS {
            cut = ids.len() - INVARIANT_MIN_TOKENS;
        }
        let (head, last) = ids.split_at(cut);
        self.check_room(s.position, ids.len())?;
        for piece in head.chunks(size) {
            self.run_call(s, Some(piece), false, &mut |_, _| Ok(()))?;
            if let Some(p) = s.profile.as_mut() {
                p.mark(&self.dev, profile::Part::Head)?;
                p.close_call()?;
            }
        }
        self.run_call(s, Some(last), all, tail)
    }

    /// One forward call of [`GpuModel::run`].
    fn run_call(
        &self,
        s: &mut GpuSession,
        tokens: Option<&[u32]>,
        all: bool,
        tail: &mut dyn FnMut(&mut session::Scratch, usize) -> Result<()>,
    ) -> Result<usize> {
        let t = tokens.map_or(1, |t| t.len());
        if t == 0 {
            return Err(ModelError::Invalid("forward called with no tokens".into()));
        }
        let pos = s.position;
        self.check_room(pos, t)?;
        let h = self.spec.hidden_size;
        s.scratch.ensure(&self.dev, t, h)?;
        if let Some(ids) = tokens {
            let ids: Vec<i32> = ids.iter().map(|&i| i as i32).collect();
            self.dev.copy_to_device(&ids, &mut s.scratch.ids)?;
        } else {
            // The previous step's sampled id is already on the device.
            s.scratch.copy_next_id_to_ids(&self.dev)?;
        }
        if let Some(p) = s.profile.as_mut() {
            p.mark(&self.dev, profile::Part::Start)?; // opens the call
        }
        self.dev.iota_i32(&mut *s.scratch.positions, pos, t)?;
        let GpuSession { kv, delta, ws, scratch, host, profile, .. } = s;
        let delta = DeltaRows {
            table: delta.as_ref().map(|d| &d.table),
            seqs: krasis_gpu::delta_rule::DeltaSeqs { n_seqs: 1, rows_per_seq: t },
        };
        let mut io = StepIo { scratch, ws, profile: profile.as_mut(), kv: KvRows::Seq(kv), delta };
        let rows = if all { t } else { 1 };
        self.forward(&mut io, host, t, pos, rows, tail)?;
        if self.invariant_call(t, true) && s.invariant_len == pos {
            s.invariant_len = pos + t;
        }
        // The CPU experts' prefill buffers of a long prompt go back (see `prefill_bf16::trim`).
        krasis_cpu::prefill_bf16::trim_after_forward(t);
        s.position += t;
        Ok(rows)
    }

    /// The forward pass of a call whose token ids and positions are in `io`'s scratch: embedding,
    /// every layer (handing host MoE layers to the expert thread through `staging`), the final
    /// norm and the LM head over the last `logit_rows` rows into the scratch's logits.
    fn forward(
        &self,
        io: &mut StepIo<'_>,
        staging: &mut host_experts::HostStaging,
        t: usize,
        pos: usize,
        logit_rows: usize,
        tail: &mut dyn FnMut(&mut session::Scratch, usize) -> Result<()>,
    ) -> Result<()> {
        let h = self.spec.hidden_size;
        let eps = self.spec.rms_norm_eps;
        let invariant = self.invariant_call(t, matches!(io.kv, KvRows::Seq(_)));
        self.gemm.set_fixed_rows(invariant.then_some(krasis_gpu::linear::FIXED_ROWS));
        self.watch.begin(match io.kv {
            KvRows::PerRow(_) => format!("a batched decode step of {t} sequences"),
            KvRows::Seq(_) => format!("{t} token(s) of one sequence at position {pos}"),
        });
        {
            let sc = &mut *io.scratch;
            let ids = sc.ids.slice().slice(..t);
            let mut x = sc.x.slice_mut().slice_mut(..t * h);
            self.dev.embedding_gather_f32(&self.weights.embed, self.spec.vocab_size, h, &ids, &mut x)?;
        }
        io.mark(&self.dev, profile::Part::Start)?;
        let ctx = layers::Ctx {
            dev: &self.dev,
            spec: &self.spec,
            gemm: &self.gemm,
            cos: &self.cos,
            sin: &self.sin,
            max_pos: self.max_pos,
            rope_half: self.rope_half,
            pairing: self.rope_pairing,
            eps,
            t,
            pos,
            decode: self.precision == GpuPrecision::Bf16
                && (t <= DECODE_MAX_TOKENS || matches!(io.kv, KvRows::PerRow(_))),
            precise: self.precision == GpuPrecision::F32,
            invariant,
            placed: &self.placed,
            streams: self.placed.plan().streams(t),
            heat: self.heat.as_ref().map(|b| {
                let (p, _g) = krasis_gpu::cudarc::driver::DevicePtr::device_ptr(b, self.dev.stream());
                (p, self.spec.routed_experts())
            }),
        };
        // Everything the step runs on the device is enqueued before the launching thread waits
        // for the expert thread's end-of-call reply: a wait that sleeps, so enqueueing the head
        // after it would put the thread's wake-up on the critical path of every token.
        let v = self.spec.vocab_size;
        let mut enqueue = |staging: &mut host_experts::HostStaging| -> Result<()> {
            self.watch.flags(staging.progress());
            self.watch.phase("enqueuing the layers");
            // Every layer and the final norm (adding the last FFN output), then the LM head over
            // the requested rows and the caller's tail (sampling), given the number of logit rows.
            let mut step = layers::GpuStep { c: &ctx, s: &mut *io, host: staging };
            crate::model::walk::forward(&self.weights, &mut step, 0..self.weights.layers.len())?;
            let sc = &mut *io.scratch;
            sc.ensure_logits(&self.dev, logit_rows * v)?;
            let first = t - logit_rows;
            let xn = sc.xn.slice().slice(first * h..t * h);
            let mut logits = sc.logits.slice_mut().slice_mut(..logit_rows * v);
            self.weights.lm_head.forward(&self.dev, &self.gemm, &xn, logit_rows, &mut logits)?;
            tail(sc, logit_rows)?;
            self.watch.phase("enqueued; waiting for the expert thread's end of the call");
            Ok(())
        };
        let r = if let Some(server) = &self.expert_server {
            let k = self.spec.moe.as_ref().map_or(0, |m| m.routing.top_k);
            let shape = host_experts::HandoffShape { t, hidden: h, k };
            host_experts::with_expert_server(&self.dev, staging, server, shape, enqueue)
        } else {
            enqueue(staging)
        };
        self.watch.phase("reading back the results (waits for the stream)");
        r
    }

    /// What the engine is doing now, in words, for a stall report: the forward call and its
    /// phase, the streams' states, the expert thread and the streamed-expert slots. Enqueues
    /// nothing and waits for nothing; safe while a call runs on another thread.
    pub fn diagnose(&self) -> String {
        let mut parts = vec![self.watch.describe(), self.dev.streams_state()];
        if let Some(server) = &self.expert_server {
            parts.push(server.describe_state());
        }
        if let Some(st) = self.placed.streamer() {
            parts.push(st.describe_state(&self.dev));
        }
        parts.join("; ")
    }

    /// Whether a call of `t` tokens (of one sequence: `seq`) runs row-invariant
    /// ([`GpuOptions::invariant_prefill`]): prompt calls of at least [`INVARIANT_MIN_TOKENS`].
    fn invariant_call(&self, t: usize, seq: bool) -> bool {
        self.invariant_prefill && seq && t >= INVARIANT_MIN_TOKENS
    }

    /// [`GpuOptions::invariant_prefill`]'s setting.
    pub fn invariant_prefill(&self) -> bool {
        self.invariant_prefill
    }

    /// [`crate::runtime::Engine::prefill_min_tokens`]: [`INVARIANT_MIN_TOKENS`] with the
    /// row-invariant prefill, else 1.
    pub fn prefill_min_tokens(&self) -> usize {
        if self.invariant_prefill {
            INVARIANT_MIN_TOKENS
        } else {
            1
        }
    }

    /// [`crate::runtime::Engine::prompt_chunk_floor`]: a hybrid that streams its experts for
    /// prefill runs shorter calls' experts partly on the CPU; other paths have no threshold.
    pub fn prompt_chunk_floor(&self) -> usize {
        match self.placed.streamer() {
            Some(_) if self.experts_on_host() => expert_stream::all_streamed_from(),
            _ => 1,
        }
    }

    /// The sampling parameters and uniform draw of `sampler`'s next token.
    fn sampling_params(sampler: &mut Sampler) -> (GpuSamplingParams, f64) {
        let p = sampler.params();
        match sampler.next_uniform() {
            None => (GpuSamplingParams { temperature: 0.0, top_k: 1, top_p: 1.0 }, 0.0),
            Some(u) => (GpuSamplingParams { temperature: p.temperature, top_k: p.top_k, top_p: p.top_p }, u),
        }
    }

    /// A sampled id as a token of the vocabulary.
    fn check_sampled(&self, id: i32) -> Result<u32> {
        let v = self.spec.vocab_size;
        u32::try_from(id)
            .ok()
            .filter(|&i| (i as usize) < v)
            .ok_or_else(|| ModelError::Invalid(format!("GPU sampler returned token id {id} (vocab {v})")))
    }

    /// One decode step (one token each) for several sessions in one forward pass: every weight
    /// is read once for all of them, attention runs per sequence over its own KV cache, and a
    /// hybrid model hands each MoE layer's routed experts of all the sequences to the CPU in one
    /// hand-off (grouped per expert there). One host synchronisation per step.
    fn decode_batch(&self, seqs: &mut [DecoderStep<'_, GpuSession>]) -> Result<Vec<(u32, Option<Vec<f32>>)>> {
        let b = seqs.len();
        let (h, v) = (self.spec.hidden_size, self.spec.vocab_size);
        let mut ids = Vec::with_capacity(b);
        let mut positions = Vec::with_capacity(b);
        for st in seqs.iter() {
            self.check_tokens(st.tokens)?;
            let pos = st.session.position;
            self.check_room(pos, 1)?;
            ids.push(st.tokens[0] as i32);
            positions.push(pos as i32);
        }
        let mut guard = self.batch.lock().unwrap_or_else(|p| p.into_inner());
        let BatchState { scratch, ws, host, delta_table } = &mut *guard;
        scratch.ensure(&self.dev, b, h)?;
        // The sequences' DeltaNet state blocks, one table entry per row.
        let delta_table = match seqs.iter().map(|st| st.session.delta.as_ref()).collect::<Option<Vec<_>>>() {
            Some(blocks) if !blocks.is_empty() => {
                let addrs: Vec<u64> = blocks.iter().map(|d| d.address(&self.dev)).collect();
                let table = session::grow(&self.dev, delta_table, b, "DeltaNet state table (batch)")?;
                self.dev.copy_to_device(&addrs, table)?;
                Some(&*table)
            }
            _ => None,
        };
        scratch.ensure_next_ids(&self.dev, b)?;
        self.dev.copy_to_device(&ids, &mut scratch.ids)?;
        self.dev.copy_to_device(&positions, &mut scratch.positions)?;
        let params: Vec<(GpuSamplingParams, f64)> =
            seqs.iter_mut().map(|st| Self::sampling_params(st.sampler)).collect();
        {
            let rows: Vec<(&krasis_gpu::kv_cache::GpuKvCache, usize)> =
                seqs.iter().map(|st| (&st.session.kv, st.session.position)).collect();
            let mut sample = |sc: &mut session::Scratch, n_rows: usize| -> Result<()> {
                let logits = sc.logits.slice().slice(..n_rows * v);
                for (i, &(p, u)) in params.iter().enumerate() {
                    let mut out = sc.next_id.slice_mut().slice_mut(i..i + 1);
                    self.sampler.sample(&self.dev, &logits, i, p, u, &mut out)?;
                }
                Ok(())
            };
            let delta = DeltaRows {
                table: delta_table,
                seqs: krasis_gpu::delta_rule::DeltaSeqs { n_seqs: b, rows_per_seq: 1 },
            };
            let mut io = StepIo { scratch: &mut *scratch, ws, profile: None, kv: KvRows::PerRow(&rows), delta };
            self.forward(&mut io, host, b, 0, b, &mut sample)?;
        }
        let logits = scratch.logits.slice().slice(..b * v);
        let mut recorded = Vec::with_capacity(b);
        for st in seqs.iter() {
            let i = recorded.len();
            recorded.push(if st.record { Some(self.dev.download(&logits.slice(i * v..(i + 1) * v))?) } else { None });
        }
        let mut sampled = vec![0i32; b];
        self.dev.download_into(&scratch.next_id.slice().slice(..b), &mut sampled)?;
        let mut out = Vec::with_capacity(b);
        for ((st, id), rec) in seqs.iter_mut().zip(sampled).zip(recorded) {
            let id = self.check_sampled(id)?;
            st.session.position += 1;
            // The id is in the batch's buffers, not the session's: its next step uploads it.
            st.session.last_sampled = None;
            out.push((id, rec));
        }
        Ok(out)
    }

    /// What the engine reports ([`crate::runtime::Engine::stats`]): host synchronisations; on
    /// the hybrid path the hand-offs of the batched decode steps and, with `session`, the
    /// session's own, the bytes of one host expert, the pinned experts, the stream slots and the
    /// expert pool; with `session`, its device-time profile (`KRASIS_GPU_PROFILE=1`).
    pub fn stats(&self, session: Option<&GpuSession>) -> crate::runtime::EngineStats {
        use crate::runtime::{EngineStats, ExpertPoolSize, PinnedExperts, StreamSlots};
        let hybrid = self.experts_on_host();
        EngineStats {
            host_syncs: Some(self.dev.sync_counters().0),
            expert_bytes: self.host_expert_bytes,
            batch_handoffs: hybrid.then(|| self.batch.lock().unwrap_or_else(|p| p.into_inner()).host.stats),
            handoffs: session.filter(|_| hybrid).map(GpuSession::handoff_stats),
            profile: session.and_then(|s| s.profile.as_ref()).map(|p| p.summary()),
            pinned_experts: self.placed.hot().map(|h| PinnedExperts { experts: h.pinned, bytes: h.bytes }),
            stream_slots: self
                .placed
                .streamer()
                .map(|s| StreamSlots { experts_per_slot: s.slot_experts(), record_bytes: s.record_bytes() }),
            expert_pool: self.placed.pool().map(|p| {
                let s = p.stats();
                ExpertPoolSize { slots: s.slots, pinned: s.pinned, bytes: s.bytes }
            }),
            ..EngineStats::default()
        }
    }

    /// Starts `session`'s device-time profile over (e.g. between prefill and decode); the
    /// engine's counters run on.
    pub fn reset_stats(&self, session: Option<&mut GpuSession>) {
        if let Some(s) = session.filter(|s| s.profile.is_some()) {
            s.profile = profile::StepProfile::from_env();
        }
    }

    /// Runs one throwaway prefill of [`WARM_UP_TOKENS`] tokens and one decode step, so that the
    /// one-time costs of the first call of each kind (cuBLAS's initialisation on its first GEMM,
    /// the first touch of the host experts' call buffers, the streamer's slots) are paid at load
    /// instead of by the first request. Adds a line with the time it took to the load log.
    pub fn warm_up(&mut self) -> Result<()> {
        let started = std::time::Instant::now();
        let t = WARM_UP_TOKENS.min(self.kv_tokens.saturating_sub(1));
        if t == 0 {
            return Ok(());
        }
        let v = self.spec.vocab_size as u32;
        let prompt: Vec<u32> = (0..t as u32).map(|i| (i.wrapping_mul(7919) + 1) % v).collect();
        let mut s = self.new_session()?;
        self.forward_logits(&mut s, &prompt, false)?;
        self.forward_logits(&mut s, &prompt[..1], false)?;
        self.log.push(format!(
            "warmed up in {:.2} s (a {t}-token prefill and a decode step)",
            started.elapsed().as_secs_f64()
        ));
        Ok(())
    }

    /// Prefill/decode logits for tests: runs `tokens` and downloads the logits (`[t, vocab]` with
    /// `all`, else the last row).
    pub fn forward_logits(&self, s: &mut GpuSession, tokens: &[u32], all: bool) -> Result<Vec<f32>> {
        self.check_tokens(tokens)?;
        let rows = self.run(s, Some(tokens), all, &mut |_, _| Ok(()))?;
        let v = self.spec.vocab_size;
        if let Some(p) = s.profile.as_mut() {
            p.mark(&self.dev, profile::Part::Head)?;
        }
        let logits = self.dev.download(&s.scratch.logits.slice().slice(..rows * v))?;
        if let Some(p) = s.profile.as_mut() {
            p.close_call()?;
        }
        Ok(logits)
    }
}

impl Decoder for GpuModel {
    type Session = GpuSession;

    fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    fn check_tokens(&self, tokens: &[u32]) -> Result<()> {
        GpuModel::check_tokens(self, tokens)
    }

    fn new_session(&self) -> Result<GpuSession> {
        GpuModel::new_session(self)
    }

    fn step(
        &self,
        s: &mut GpuSession,
        tokens: &[u32],
        sampler: &mut Sampler,
        record: bool,
    ) -> Result<(u32, Option<Vec<f32>>)> {
        self.check_tokens(tokens)?;
        // A decode step whose token is the one just sampled reads it from the device.
        let resident = tokens.len() == 1 && s.last_sampled == Some(tokens[0]);
        let v = self.spec.vocab_size;
        let (params, u) = Self::sampling_params(sampler);
        let mut sample = |sc: &mut session::Scratch, rows: usize| -> Result<()> {
            let logits = sc.logits.slice().slice(..rows * v);
            Ok(self.sampler.sample(&self.dev, &logits, rows - 1, params, u, &mut *sc.next_id)?)
        };
        let rows = self.run(s, if resident { None } else { Some(tokens) }, record, &mut sample)?;
        let logits = s.scratch.logits.slice().slice(..rows * v);
        let recorded = if record { Some(self.dev.download(&logits)?) } else { None };
        if let Some(p) = s.profile.as_mut() {
            p.mark(&self.dev, profile::Part::Head)?;
        }
        let mut id = [0i32];
        self.dev.download_into(&*s.scratch.next_id, &mut id)?;
        if let Some(p) = s.profile.as_mut() {
            p.close_call()?;
        }
        let id = self.check_sampled(id[0])?;
        s.last_sampled = Some(id);
        Ok((id, recorded))
    }

    /// The decode steps (one token) of `seqs` as one batched forward pass when there are at least
    /// two of them (`BATCH_MIN_SEQS`); prefill calls (more tokens) one by one before them.
    fn step_batch(&self, seqs: &mut [DecoderStep<'_, GpuSession>]) -> Result<Vec<(u32, Option<Vec<f32>>)>> {
        let decodes = seqs.iter().filter(|st| st.tokens.len() == 1).count();
        // The precise mode's attention reads one sequence's cache per call (the prefill form).
        if decodes < BATCH_MIN_SEQS || self.precision == GpuPrecision::F32 {
            return seqs.iter_mut().map(|st| self.step(st.session, st.tokens, st.sampler, st.record)).collect();
        }
        let mut out: Vec<Option<(u32, Option<Vec<f32>>)>> = (0..seqs.len()).map(|_| None).collect();
        let mut batch = Vec::with_capacity(decodes);
        let mut batch_at = Vec::with_capacity(decodes);
        for (i, st) in seqs.iter_mut().enumerate() {
            if st.tokens.len() == 1 {
                batch_at.push(i);
                batch.push(DecoderStep {
                    session: &mut *st.session,
                    tokens: st.tokens,
                    sampler: &mut *st.sampler,
                    record: st.record,
                });
            } else {
                out[i] = Some(self.step(st.session, st.tokens, st.sampler, st.record)?);
            }
        }
        for (i, r) in batch_at.into_iter().zip(self.decode_batch(&mut batch)?) {
            out[i] = Some(r);
        }
        Ok(out.into_iter().map(|r| r.expect("every sequence ran")).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The row-invariant prefill refuses the precise mode, naming both options; each alone is
    /// accepted.
    #[test]
    fn the_invariant_prefill_refuses_the_precise_mode() {
        let opts = GpuOptions { invariant_prefill: true, precision: GpuPrecision::F32, ..GpuOptions::default() };
        let err = opts.check_invariant().unwrap_err().to_string();
        assert!(err.contains("invariant_prefill") && err.contains("GpuPrecision::F32"), "{err}");
        assert!(GpuOptions { invariant_prefill: true, ..GpuOptions::default() }.check_invariant().is_ok());
        assert!(GpuOptions { precision: GpuPrecision::F32, ..GpuOptions::default() }.check_invariant().is_ok());
    }

    /// The precise mode keeps an f32 KV cache, refuses an FP8 one naming both options, and
    /// parses and prints as the CLI spells it.
    #[test]
    fn precision_decides_the_kv_storage() {
        let opts = |precision, kv_dtype| GpuOptions { precision, kv_dtype, ..GpuOptions::default() };
        assert_eq!(GpuOptions::default().precision, GpuPrecision::Bf16);
        assert_eq!(opts(GpuPrecision::Bf16, KvDtype::Fp8).kv_storage().unwrap(), KvDtype::Fp8);
        assert_eq!(opts(GpuPrecision::Bf16, KvDtype::Bf16).kv_storage().unwrap(), KvDtype::Bf16);
        assert_eq!(opts(GpuPrecision::F32, KvDtype::Bf16).kv_storage().unwrap(), KvDtype::F32);
        let e = opts(GpuPrecision::F32, KvDtype::Fp8).kv_storage().unwrap_err().to_string();
        assert!(e.contains("GpuPrecision::F32") && e.contains("KvDtype::Fp8"), "{e}");
        for p in [GpuPrecision::Bf16, GpuPrecision::F32] {
            assert_eq!(p.to_string().parse::<GpuPrecision>().unwrap(), p);
        }
        assert!("fp16".parse::<GpuPrecision>().is_err());
    }
}
