//! Loading a model onto the GPU: every tensor validated by the same [`WeightLoader`] as the CPU
//! path, converted to BF16 bits (FP8 blocks dequantised first) and uploaded, each allocation
//! charged to the VRAM budget under the tensor's name.

use std::borrow::Cow;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use krasis_cache::{CacheOutcome, ExpertCache};
use krasis_core::budget::format_bytes;
use krasis_core::dtype::f32_to_bf16;
use krasis_cpu::linear::WeightRows;
use krasis_cpu::pool::WorkerPool;
use krasis_gpu::kv_cache::KvLayout;
use krasis_gpu::linear::{GemmContext, GpuLinear, LinearQuant};
use krasis_gpu::moe::GpuExperts;
use krasis_gpu::router::GpuRouter;
use krasis_gpu::sampling::GpuSampler;
use krasis_gpu::{DeviceBuffer, GpuDevice};

use super::deltanet::{kv_layers, session_state_bytes};
use super::expert_cache::{open_gpu_expert_cache, GpuCachePlan};
use super::expert_stream::{ExpertStreamer, StreamRecords};
use super::host_experts::ExpertServer;
use super::layers::{kv_geometry, GpuExpertBackend, GpuKinds, GpuKvB, GpuMlp};
use super::{GpuExpertCache, GpuModel, GpuOptions, StreamFrom, KV_RESERVE_BYTES};
use crate::cpu::experts::{ExecutorLayer, ExpertExecutor, LateExecutor, ReferenceExperts};
use crate::cpu::load::{open_cpu_experts, start_pool, EngineOptions};
use crate::error::{ModelError, Result};
use crate::model::build::{build, LinearClass, WeightBuilder};
use crate::model::linear::{DenseLinear, LinearOp};
use crate::model::rope::RotaryTables;
use crate::model::tensors::{MlpTensors, TensorSpec};
use crate::model::weights::WeightLoader;
use crate::placement::precision::expert_width_rule;
use crate::source::files::ModelFiles;
use crate::source::WeightSource;
use crate::spec::{ModelSpec, RoutingRule};

/// A matrix's elements as BF16 bits (zero-copy when the source is BF16).
fn bf16_bits(l: &DenseLinear) -> Cow<'_, [u16]> {
    match l.weights() {
        WeightRows::Bf16(s) => Cow::Borrowed(s),
        WeightRows::F32(s) => Cow::Owned(s.iter().map(|&v| f32_to_bf16(v)).collect()),
        WeightRows::F16(s) => Cow::Owned(s.iter().map(|&b| f32_to_bf16(half::f16::from_bits(b).to_f32())).collect()),
    }
}

fn f32_values(l: &DenseLinear) -> Vec<f32> {
    let (rows, cols) = (l.out_dim(), l.in_dim());
    let mut out = vec![0f32; rows * cols];
    if cols > 0 {
        for (r, row) in out.chunks_exact_mut(cols).enumerate() {
            l.row_into(r, row);
        }
    }
    out
}

/// Refuses, before anything is uploaded, a model with layers the GPU engine does not run: a
/// gated-DeltaNet layer whose geometry the kernels do not take (key dim above
/// [`krasis_gpu::delta_rule::MAX_KEY_DIM`], a conv kernel above
/// [`krasis_gpu::delta_rule::MAX_CONV_KERNEL`]). Qwen3-Next's and Qwen3.5's DeltaNet layers and
/// gated attention run.
pub fn check_gpu_layers(spec: &ModelSpec) -> Result<()> {
    use krasis_gpu::delta_rule::{MAX_CONV_KERNEL, MAX_KEY_DIM};
    // gpt-oss's attention sinks and sliding windows, its router's logit bias, its experts' biases
    // and clamped SwiGLU are options of the GPU ops; the hybrid engine's limits are
    // [`check_hybrid_gpu_experts`]'.
    if let Some(d) = &spec.delta_net {
        if d.key_dim > MAX_KEY_DIM || d.conv_kernel == 0 || d.conv_kernel > MAX_CONV_KERNEL {
            return Err(ModelError::Invalid(format!(
                "{}: gated-DeltaNet layers of key dim {} and conv kernel {} do not run on the GPU engine (at most {MAX_KEY_DIM} and {MAX_CONV_KERNEL}); the CPU engine runs them",
                spec.arch.model_type(),
                d.key_dim,
                d.conv_kernel
            )));
        }
    }
    Ok(())
}

/// Whether the hybrid engine may put `spec`'s routed experts on the GPU: a long prefill's
/// streamed experts, pinned or pooled experts, and a split layer's GPU share run renumbered
/// experts that take neither the experts' biases nor an activation other than SiLU yet (gpt-oss).
/// Such a model's hybrid engine keeps every routed expert on the CPU (whose expert backends take
/// both): `GpuOptions::expert_bits` and `GpuOptions::cache` must be unset for it.
pub fn check_hybrid_gpu_experts(spec: &ModelSpec) -> Result<()> {
    let missing: Vec<&str> = [
        (spec.expert_bias, "biased experts"),
        (spec.expert_activation != crate::spec::ExpertActivation::Silu, "the clamped SwiGLU"),
    ]
    .iter()
    .filter(|(on, _)| *on)
    .map(|(_, what)| *what)
    .collect();
    if missing.is_empty() {
        return Ok(());
    }
    Err(ModelError::Invalid(format!(
        "{}: {} do not run on the hybrid engine's GPU experts yet (streamed, pinned or pooled); its routed experts stay on the CPU, so `GpuOptions::expert_bits` and `GpuOptions::cache` must be unset",
        spec.arch.model_type(),
        missing.join(" and ")
    )))
}

/// Context the whole-model-on-the-GPU estimate keeps room for (below this, `--device auto` takes
/// the hybrid path): a model that loads but holds a few hundred tokens of KV is of no use.
pub const MIN_USEFUL_KV_TOKENS: usize = 4096;

/// VRAM the whole model needs on the GPU at `opts`' precisions: every weight (BF16, or INT8 plus
/// a scale per row where a `--*-quant int8` flag asks), routers in f32, MLA's BF16 `kv_b` copy
/// for the absorbed decode, [`MIN_USEFUL_KV_TOKENS`] of KV cache and the activation reserve.
pub fn whole_model_vram_bytes(spec: &ModelSpec, opts: &GpuOptions) -> u64 {
    use crate::model::tensors::{expected_tensors, TensorRole};
    let int8 = |q: krasis_gpu::linear::LinearQuant| q == krasis_gpu::linear::LinearQuant::Int8;
    let mut bytes = 0u64;
    for t in expected_tensors(spec) {
        let n = t.numel() as u64;
        let rows = t.shape[0] as u64;
        let linear = |q| if int8(q) { n + 4 * rows } else { 2 * n };
        bytes += match t.role {
            TensorRole::Router => 4 * n,
            TensorRole::Attention if t.name.ends_with("kv_b_proj.weight") => 2 * n + linear(opts.kv_b_proj_quant),
            TensorRole::Attention => linear(opts.attention_quant),
            TensorRole::SharedExpert => linear(opts.shared_expert_quant),
            TensorRole::DenseMlp => linear(opts.dense_mlp_quant),
            TensorRole::LmHead => linear(opts.lm_head_quant),
            TensorRole::Embedding if spec.tie_word_embeddings => 2 * n + linear(opts.lm_head_quant),
            TensorRole::RoutedExpert { .. } => match (opts.expert_bits, opts.expert_fp4) {
                // FP4 codes plus one f32 scale per group of 32 or 16.
                (Some(_), Some(kind)) => n / 2 + 4 * n / kind.group() as u64,
                // Codes plus one f16 scale per group of at least 32.
                (Some(bits), None) => n * bits.bits() as u64 / 8 + n / 16,
                (None, _) => 2 * n,
            },
            TensorRole::Embedding
            | TensorRole::Norm
            | TensorRole::CentredNorm
            | TensorRole::RouterBias
            | TensorRole::Bias => 2 * n,
            TensorRole::MixerParam => 4 * n,
        };
    }
    let (planes, row, group) = kv_geometry(spec);
    let kv_per_token = KvLayout::new(opts.kv_storage().unwrap_or(opts.kv_dtype), kv_layers(spec), planes, row, group)
        .map_or(0, |l| l.bytes_per_token() as u64);
    let min_ctx = MIN_USEFUL_KV_TOKENS.min(spec.max_position_embeddings.max(1)) as u64;
    bytes + kv_per_token * min_ctx + session_state_bytes(spec) + KV_RESERVE_BYTES
}

/// Where a GPU build puts the routed experts.
pub enum ExpertPlacement {
    /// Uploaded to VRAM (BF16), the whole model on the GPU.
    Gpu,
    /// On the host (the hybrid engine): a quantised model-wide executor (the expert cache on the
    /// CPU pool, whose worker 0's core the expert thread takes) ...
    Host { executor: Arc<dyn ExpertExecutor>, pool: Option<Arc<WorkerPool>> },
    /// ... or the reference f32 experts over the source weights.
    HostReference,
}

/// Builds the GPU engine's weights: every dense part in VRAM (BF16, or INT8 per class of linear);
/// the routed experts resident in VRAM, or on the host behind a CPU expert backend (hybrid).
struct GpuBuilder<'a> {
    dev: &'a GpuDevice,
    w: WeightLoader<'a>,
    opts: &'a GpuOptions,
    spec: &'a ModelSpec,
    experts: ExpertPlacement,
    /// The GPU expert cache the quantised experts are uploaded from (else quantised here).
    expert_cache: Option<&'a ExpertCache>,
}

impl GpuBuilder<'_> {
    /// `l` with its input kept unrounded under [`super::GpuPrecision::F32`].
    fn precise(&self, mut l: GpuLinear) -> GpuLinear {
        l.set_exact_input(self.opts.precision == super::GpuPrecision::F32);
        l
    }

    fn quant_of(&self, class: LinearClass) -> LinearQuant {
        match class {
            LinearClass::Attention => self.opts.attention_quant,
            LinearClass::SharedExpert => self.opts.shared_expert_quant,
            LinearClass::DenseMlp => self.opts.dense_mlp_quant,
            LinearClass::LmHead => self.opts.lm_head_quant,
        }
    }

    fn bf16_matrix(&self, t: &TensorSpec) -> Result<(DenseLinear, usize, usize)> {
        Ok((self.w.matrix_of(t)?, t.shape[0], t.shape[1]))
    }

    /// A layer's routed experts quantised to `bits` (the CPU cache's rule: symmetric, f16 scales,
    /// group 128 halved to fit K) on all cores, then uploaded in the GPU tile layout.
    fn quantized_experts(
        &self,
        name: &str,
        experts: &[MlpTensors],
        h: usize,
        inter: usize,
        bits: krasis_quant::Bits,
    ) -> Result<GpuExperts> {
        use krasis_quant::group::{group_size_for, quantize};
        // Experts stored as INT4 groups (compressed-tensors) keep their groups, and at INT4 their
        // stored codes and scales (as the expert caches do, `cpu::quantized::ExpertSource`).
        let group = self.w.quant.stored_int4_group().unwrap_or(self.opts.expert_group_size);
        let gs = |k: usize| {
            group_size_for(k, group)
                .map_err(|e| ModelError::Invalid(format!("{name}: {e} (quantising the experts for the GPU)")))
        };
        let (gs13, gs2) = (gs(h)?, gs(inter)?);
        let mut resident = GpuExperts::new_quantized(self.dev, name, experts.len(), h, inter, bits, gs13, gs2)?;
        let source = |t: &TensorSpec, gs: usize| -> Result<ExpertProj> {
            if bits == krasis_quant::Bits::Int4 {
                if let Some(q) = self.w.stored_int4(&t.name, t.shape[0], t.shape[1])?.filter(|q| q.gs == gs) {
                    return Ok(ExpertProj::Kept(q));
                }
            }
            Ok(ExpertProj::Values(self.w.matrix_of(t)?))
        };
        let mats = experts
            .iter()
            .map(|m| Ok([source(&m.gate, gs13)?, source(&m.up, gs13)?, source(&m.down, gs2)?]))
            .collect::<Result<Vec<_>>>()?;
        let layout = resident.quant_layout().expect("quantised experts");
        let q = |p: &ExpertProj, gs| match p {
            ExpertProj::Kept(q) => q.clone(),
            ExpertProj::Values(l) => quantize(&f32_values(l), l.out_dim(), l.in_dim(), bits, gs),
        };
        self.pack_and_upload(&mut resident, mats.len(), |e| {
            let [g, u, d] = &mats[e];
            Ok(layout.pack(e, &q(g, gs13), &q(u, gs13), &q(d, gs2))?)
        })?;
        Ok(resident)
    }

    /// Packs experts `0..n` with `pack` on up to one thread per core (each thread a contiguous run
    /// of experts) and uploads them into `resident` on this thread, in expert order.
    fn pack_and_upload(
        &self,
        resident: &mut GpuExperts,
        n: usize,
        pack: impl Fn(usize) -> Result<krasis_gpu::moe::PackedExpert> + Sync,
    ) -> Result<()> {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(n.max(1));
        let per = n.div_ceil(threads).max(1);
        let packed = std::thread::scope(|s| {
            let pack = &pack;
            let jobs: Vec<_> = (0..n)
                .step_by(per)
                .map(|e0| s.spawn(move || (e0..n.min(e0 + per)).map(pack).collect::<Vec<_>>()))
                .collect();
            jobs.into_iter()
                .flat_map(|j| j.join().expect("packing the experts for the GPU panicked"))
                .collect::<Vec<_>>()
        });
        for (x, p) in packed.into_iter().enumerate() {
            resident.upload_packed_expert(self.dev, x, &p?)?;
        }
        Ok(())
    }

    /// A layer's routed experts kept in the 4-bit float format `kind` as stored (no GPU expert
    /// cache: [`GpuExpertCache::Off`]), packed on all cores in the GPU FP4 tile layout and uploaded.
    fn fp4_experts(
        &self,
        name: &str,
        layer: usize,
        n: usize,
        h: usize,
        inter: usize,
        kind: krasis_quant::fp4::Fp4Kind,
    ) -> Result<GpuExperts> {
        let mut resident = GpuExperts::new_fp4(self.dev, name, n, h, inter, kind)?;
        let layout = resident.quant_layout().expect("FP4 experts");
        self.pack_and_upload(&mut resident, n, |e| {
            let (m, what) = crate::cpu::quantized::stored_fp4_expert(&self.w, self.spec, layer, e, (h, inter), kind)?;
            layout
                .pack_fp4(e, &m[0], &m[1], &m[2])
                .map_err(|err| ModelError::Invalid(format!("{what}: packing for the GPU: {err}")))
        })?;
        Ok(resident)
    }

    /// Model layer `layer`'s routed experts uploaded from the GPU expert cache's records.
    fn cached_experts(&self, cache: &ExpertCache, name: &str, layer: usize) -> Result<GpuExperts> {
        let head = cache.header();
        let li = head.moe_layers.iter().position(|&l| l as usize == layer).ok_or_else(|| {
            ModelError::Invalid(format!("{}: no records of model layer {layer}", cache.path().display()))
        })?;
        let n = head.n_experts as usize;
        let layout = super::expert_cache::gpu_record_layout(head, name)?;
        let mut resident = GpuExperts::new_with_layout(self.dev, &layout, n)?;
        for e in 0..n {
            resident.upload_expert_record(self.dev, e, cache.w13(li, e), cache.w2(li, e))?;
        }
        Ok(resident)
    }
}

/// One routed-expert projection on its way to the GPU's quantised experts: the stored INT4 kept
/// as it is, or the values to quantise.
enum ExpertProj {
    Kept(krasis_quant::QuantizedMatrix),
    Values(DenseLinear),
}

impl WeightBuilder for GpuBuilder<'_> {
    type Kinds = GpuKinds;
    /// Gate and up rows stacked into one `[2·inter, hidden]` matrix: one GEMV at decode.
    type GateUp = GpuLinear;

    fn embedding(&mut self, t: &TensorSpec) -> Result<DeviceBuffer<u16>> {
        let (m, _, _) = self.bf16_matrix(t)?;
        Ok(self.dev.upload(&bf16_bits(&m), &t.name)?)
    }

    fn linear(&mut self, t: &TensorSpec, class: LinearClass) -> Result<GpuLinear> {
        let q = self.quant_of(class);
        let name = if class == LinearClass::LmHead && t.name != "lm_head.weight" {
            "lm_head.weight (tied)".to_string()
        } else {
            t.name.clone()
        };
        let (m, rows, cols) = self.bf16_matrix(t)?;
        Ok(self.precise(GpuLinear::new(self.dev, &name, &bf16_bits(&m), rows, cols, q)?))
    }

    fn gate_up(&mut self, gate: &TensorSpec, up: &TensorSpec, class: LinearClass) -> Result<GpuLinear> {
        let (g, rows, cols) = self.bf16_matrix(gate)?;
        let (u, up_rows, _) = self.bf16_matrix(up)?;
        let mut both = bf16_bits(&g).into_owned();
        both.extend_from_slice(&bf16_bits(&u));
        let name = format!("{} + up_proj", gate.name);
        Ok(self.precise(GpuLinear::new(self.dev, &name, &both, rows + up_rows, cols, self.quant_of(class))?))
    }

    fn mlp(&mut self, gate_up: GpuLinear, down: GpuLinear) -> Result<GpuMlp> {
        Ok(GpuMlp { gate_up, down })
    }

    fn vector(&mut self, t: &TensorSpec) -> Result<DeviceBuffer<u16>> {
        let v: Vec<u16> = self.w.vector_of(t)?.iter().map(|&x| f32_to_bf16(x)).collect();
        Ok(self.dev.upload(&v, &t.name)?)
    }

    fn kv_b(&mut self, t: &TensorSpec) -> Result<GpuKvB> {
        let (m, rows, cols) = self.bf16_matrix(t)?;
        let bits = bf16_bits(&m);
        Ok(GpuKvB {
            linear: self.precise(GpuLinear::new(self.dev, &t.name, &bits, rows, cols, self.opts.kv_b_proj_quant)?),
            bf16: self.dev.upload(&bits, &format!("{} (absorbed, bf16)", t.name))?,
        })
    }

    fn router(&mut self, weight: &TensorSpec, bias: Option<&TensorSpec>, rule: &RoutingRule) -> Result<GpuRouter> {
        let (e, h) = (weight.shape[0], weight.shape[1]);
        let gate = f32_values(&self.w.matrix_of(weight)?);
        let bias = bias.map(|b| self.w.vector_of(b)).transpose()?;
        Ok(GpuRouter::new(self.dev, &weight.name, &gate, e, h, bias.as_deref(), *rule)?)
    }

    fn experts(&mut self, layer: usize, experts: &[MlpTensors]) -> Result<GpuExpertBackend> {
        let h = self.spec.hidden_size;
        match &self.experts {
            ExpertPlacement::Host { executor, .. } => {
                return Ok(GpuExpertBackend::Host(Arc::new(ExecutorLayer { executor: executor.clone(), layer })))
            }
            ExpertPlacement::HostReference => {
                let reference =
                    ReferenceExperts::load(&self.w, h, experts)?.with_activation(self.spec.expert_activation);
                return Ok(GpuExpertBackend::Host(Arc::new(reference)));
            }
            ExpertPlacement::Gpu => {}
        }
        let inter = self.spec.moe.as_ref().map_or(0, |m| m.moe_intermediate_size);
        let name = crate::model::tensors::experts_prefix(self.spec, layer);
        let mut resident = if let (Some(_), Some(cache)) = (self.opts.expert_bits, self.expert_cache) {
            self.cached_experts(cache, &name, layer)?
        } else if let (Some(_), Some(kind)) = (self.opts.expert_bits, self.opts.expert_fp4) {
            self.fp4_experts(&name, layer, experts.len(), h, inter, kind)?
        } else if let Some(bits) = self.opts.expert_bits {
            self.quantized_experts(&name, experts, h, inter, bits)?
        } else {
            let mut resident = GpuExperts::new(self.dev, &name, experts.len(), h, inter)?;
            for (x, m) in experts.iter().enumerate() {
                let g = self.w.matrix_of(&m.gate)?;
                let u = self.w.matrix_of(&m.up)?;
                let d = self.w.matrix_of(&m.down)?;
                resident.upload_expert(self.dev, x, &bf16_bits(&g), &bf16_bits(&u), &bf16_bits(&d))?;
            }
            resident
        };
        self.expert_options(&mut resident, &name, experts)?;
        Ok(GpuExpertBackend::Resident(Box::new(resident)))
    }
}

impl GpuBuilder<'_> {
    /// The model's expert activation and, where the inventory names them (gpt-oss), every
    /// expert's gate, up and down biases, on a layer's resident experts.
    fn expert_options(&self, resident: &mut GpuExperts, name: &str, experts: &[MlpTensors]) -> Result<()> {
        resident.set_activation(self.spec.expert_activation);
        if experts.iter().all(|m| m.bias.is_none()) {
            return Ok(());
        }
        let (mut b13, mut b2) = (Vec::new(), Vec::new());
        for (x, m) in experts.iter().enumerate() {
            let Some([g, u, d]) = &m.bias else {
                return Err(ModelError::Invalid(format!("{name}: expert {x} has no biases where others have")));
            };
            b13.extend(self.w.vector_of(g)?);
            b13.extend(self.w.vector_of(u)?);
            b2.extend(self.w.vector_of(d)?);
        }
        resident.set_biases(self.dev, &b13, &b2)?;
        Ok(())
    }
}

/// The log line of a GPU that runs a GGUF's Q4_K / Q6_K experts (which the CPU keeps as stored)
/// at its own width `bits`.
fn ggml_requantised_line(bits: krasis_quant::Bits) -> String {
    format!(
        "GGUF Q4_K / Q6_K experts on the GPU: requantised to int{} from their exact values (the GPU has no kernels for the blocks as stored)",
        bits.bits()
    )
}

/// `KRASIS_STREAM_FROM=cpu|gpu` overrides [`GpuOptions::stream_from`] (measurements of both).
fn stream_from(opt: StreamFrom) -> StreamFrom {
    match krasis_core::knobs::knobs().stream_from {
        Some(krasis_core::knobs::StreamSource::CpuCache) => StreamFrom::CpuCache,
        Some(krasis_core::knobs::StreamSource::GpuCache) => StreamFrom::GpuCache,
        None => opt,
    }
}

impl GpuModel {
    /// Loads a hub-format directory onto GPU `opts.ordinal` (opens [`ModelFiles`] first).
    pub fn load(dir: &Path, opts: &GpuOptions) -> Result<GpuModel> {
        Self::from_files(&ModelFiles::open(dir)?, opts)
    }

    /// Loads opened model files onto GPU `opts.ordinal`. Quantised routed experts
    /// (`opts.expert_bits`) come from the GPU expert cache ([`GpuExpertCache::In`]: built on the
    /// first start) or are quantised here ([`GpuExpertCache::Off`]).
    pub fn from_files(files: &ModelFiles, opts: &GpuOptions) -> Result<GpuModel> {
        let spec = files.spec();
        opts.check_invariant()?;
        let (cache, line) = match (opts.expert_bits, &opts.expert_cache, &spec.moe) {
            (Some(bits), GpuExpertCache::In(dir), Some(_)) => {
                let plan = GpuCachePlan::new(files, bits, opts.expert_fp4, opts.expert_group_size, dir.as_deref())?;
                let (cache, outcome) = open_gpu_expert_cache(files, &plan)?;
                let how = match outcome {
                    CacheOutcome::Hit => "read".to_string(),
                    CacheOutcome::Built { reason } => format!("built ({reason}) and read"),
                };
                let line = format!("GPU expert cache {how}: {}", krasis_cache::describe(&cache));
                (Some(cache), Some(line))
            }
            _ => (None, None),
        };
        let mut m =
            Self::from_source_cached(spec.clone(), files.weights(), opts, ExpertPlacement::Gpu, cache.as_ref())?;
        m.log.extend(line);
        if let (Some(bits), Some(_)) = (opts.expert_bits, crate::placement::precision::ggml_kept(spec)) {
            m.log.push(ggml_requantised_line(bits));
        }
        Ok(m)
    }

    /// [`GpuModel::hybrid_from_files`] for a hub-format directory.
    pub fn load_hybrid(dir: &Path, gpu: &GpuOptions, cpu: &EngineOptions) -> Result<GpuModel> {
        Self::hybrid_from_files(&ModelFiles::open(dir)?, gpu, cpu)
    }

    /// Loads the hybrid engine from a hub-format directory: everything but the routed experts on
    /// GPU `gpu.ordinal`; the routed experts on the CPU, from the INT4/INT8 expert cache on the
    /// pinned pool (`cpu.expert_bits` 4 or 8; bf16: the reference f32 experts over the source
    /// weights). The GPU's weights are not kept in host memory once the caller drops `files`
    /// (the source mapping lives there).
    pub fn hybrid_from_files(files: &ModelFiles, gpu: &GpuOptions, cpu: &EngineOptions) -> Result<GpuModel> {
        let spec = files.spec().clone();
        gpu.check_invariant()?;
        if gpu.invariant_prefill && gpu.expert_bits.is_none() {
            return Err(ModelError::Invalid(
                "`GpuOptions::invariant_prefill` on the hybrid runs every prompt's experts on the GPU: it needs \
                 `GpuOptions::expert_bits` (the experts streamed for prefill)"
                    .into(),
            ));
        }
        if gpu.expert_bits.is_some() || gpu.cache.is_some() {
            check_hybrid_gpu_experts(&spec)?;
        }
        let mut log = Vec::new();
        let mut expert_bytes = None;
        let mut m = match expert_width_rule(cpu.expert_bits) {
            Some(bits) if spec.moe.is_some() => {
                let pool = start_pool(cpu.threads, &mut log)?;
                let late = Arc::new(LateExecutor::default());
                let placement = ExpertPlacement::Host { executor: late.clone(), pool: Some(pool.clone()) };
                // The expert cache streams in from disk while the GPU takes the rest of the model.
                let (cache, model) = std::thread::scope(|s| {
                    let cache = s.spawn(|| {
                        let mut cache_log = Vec::new();
                        open_cpu_experts(files, bits, cpu, &pool, &mut cache_log).map(|ex| (ex, cache_log))
                    });
                    let model = Self::from_source(spec, files.weights(), gpu, placement);
                    (cache.join(), model)
                });
                let (ex, mut cache_log) = cache.map_err(|p| {
                    ModelError::Invalid(format!("loading the expert cache panicked: {}", krasis_core::panic_text(p)))
                })??;
                let mut model = model?;
                // --gpu-expert-bits: long prefills stream the experts to the GPU.
                if let Some(bits) = gpu.expert_bits {
                    let (layers, mut min, mut split) =
                        (files.spec().num_layers, gpu.stream_min_tokens, gpu.stream_split);
                    // Row-invariant prompts run every expert of every call on the GPU: a CPU share
                    // computes other bits than the GPU kernels.
                    if gpu.invariant_prefill {
                        (min, split) = (super::INVARIANT_MIN_TOKENS, super::StreamSplit::Share(1.0));
                    }
                    let pcie = pcie_routes(files.spec(), gpu.pcie_routes)?;
                    // `--cache-strategy chunked --pin-vram B`: two slots in B (whole layers when B
                    // holds them).
                    let chunk = match &gpu.cache {
                        Some(super::CachePlan { strategy: super::CacheStrategy::Chunked, vram, .. }) => *vram,
                        _ => None,
                    };
                    // `None`: the GPU expert cache is off (library use): nothing to stream from it.
                    let gpu_cache_records = |log: &mut Vec<String>| -> Result<Option<StreamRecords>> {
                        let GpuExpertCache::In(dir) = &gpu.expert_cache else { return Ok(None) };
                        let plan =
                            GpuCachePlan::new(files, bits, gpu.expert_fp4, gpu.expert_group_size, dir.as_deref())?;
                        let (cache, outcome) = open_gpu_expert_cache(files, &plan)?;
                        if let CacheOutcome::Built { reason } = outcome {
                            log.push(format!("GPU expert cache built ({reason})"));
                        }
                        Ok(Some(StreamRecords::GpuCache(Box::new(cache))))
                    };
                    let from_gpu_cache = |records: Option<StreamRecords>| match records {
                        Some(r) => ExpertStreamer::new(&model.dev, r, bits, layers, min, split, chunk, pcie),
                        None => Err(ModelError::Invalid("the GPU expert cache is off (GpuExpertCache::Off)".into())),
                    };
                    let streamer = match stream_from(gpu.stream_from) {
                        // The CPU's records at another width or geometry cannot stream: then the
                        // GPU expert cache serves, and the log says why.
                        StreamFrom::CpuCache => {
                            let records = StreamRecords::CpuCache(ex.executor.clone());
                            match ExpertStreamer::new(&model.dev, records, bits, layers, min, split, chunk, pcie) {
                                Ok(s) => Ok(s),
                                Err(e) => {
                                    if ex.executor.ggml_kept() {
                                        log.push(ggml_requantised_line(bits));
                                    }
                                    log.push(format!("streaming the GPU expert cache instead of the CPU's: {e}"));
                                    from_gpu_cache(gpu_cache_records(&mut log)?)
                                }
                            }
                        }
                        StreamFrom::GpuCache => from_gpu_cache(gpu_cache_records(&mut log)?),
                    };
                    // Page-locking can be refused (a memlock limit), or the GPU expert cache be off
                    // where it is needed: then prefill keeps the CPU experts, and the log says why.
                    match streamer {
                        Ok(streamer) => {
                            log.push(streamer.describe());
                            let why =
                                "GPU prefill is always on: long prompts stream the experts to the GPU".to_string();
                            model.placed.set_streamer(std::sync::Arc::new(streamer), why);
                        }
                        Err(e) => log.push(format!("warning: prefill keeps the routed experts on the CPU: {e}")),
                    }
                }
                // The VRAM the stream slots leave: KV, prompt chunks and, for pinned experts sized
                // from the budget, their share (one plan: `vram_plan`).
                match &gpu.cache {
                    Some(plan) => {
                        let mut plan = plan.clone();
                        if plan.strategy == super::CacheStrategy::HotCachedStatic && plan.vram.is_none() {
                            plan.vram = Some(model.replan_vram(gpu, true, &mut log)?);
                        }
                        let beside = model.kept_beside(gpu);
                        model.apply_cache_plan(&plan, gpu.kv_tokens, beside, &mut log)?;
                    }
                    None => {
                        model.replan_vram(gpu, false, &mut log)?;
                    }
                }
                late.set(ex.executor.clone());
                log.append(&mut cache_log);
                log.push(format!("routed experts on the CPU: {}", ex.executor.describe()));
                expert_bytes = Some(ex.expert_bytes);
                model
            }
            _ => {
                log.push("routed experts on the CPU: reference f32 over the source weights".into());
                Self::from_source(spec, files.weights(), gpu, ExpertPlacement::HostReference)?
            }
        };
        // The model's own lines (the GPU, its weights) first, then what the hybrid load added.
        let mut lines = std::mem::take(&mut m.log);
        lines.append(&mut log);
        m.log = lines;
        m.host_expert_bytes = expert_bytes;
        Ok(m)
    }

    /// `--cache-strategy`: keeps the experts `plan` asks for in VRAM ([`super::hot_experts`] for
    /// `hot_cached_static`, [`super::expert_pool`] for the others), then fits the KV cache into
    /// what they leave (an explicit `--kv-tokens` that no longer fits is an error).
    fn apply_cache_plan(
        &mut self,
        plan: &super::CachePlan,
        kv_asked: Option<usize>,
        beside: u64,
        log: &mut Vec<String>,
    ) -> Result<()> {
        use super::CacheStrategy;
        let strategy = plan.strategy;
        let what = format!("`CachePlan::strategy` {}", strategy.name());
        if strategy == CacheStrategy::Chunked {
            // The streamer's slots are the strategy (sized when it was built).
            return match self.placed.streamer() {
                Some(_) => Ok(()),
                None => Err(ModelError::Invalid(format!("{what}: the experts cannot stream (see the warning above)"))),
            };
        }
        let Some(streamer) = self.placed.streamer().cloned() else {
            return Err(ModelError::Invalid(format!(
                "{what} needs a GPU expert width of 4 or 8 bits (`EngineConfig::gpu_expert_width`) and the experts' records page-locked for copies (see the warning above if prefill keeps the experts on the CPU)"
            )));
        };
        let Some(record) = streamer.record_bytes() else {
            return Err(ModelError::Invalid(format!(
                "{what}: the GPU expert cache's layers differ in record geometry, so experts cannot be kept one by one"
            )));
        };
        let n = self.spec.routed_experts();
        let moe: Vec<usize> = self.spec.moe_layers().collect();
        let heat = match (&plan.heatmap, strategy) {
            (Some(h), _) if strategy.needs_heatmap() => {
                Some(crate::placement::heatmap::ExpertHeat::load(h, self.spec.num_layers, n)?)
            }
            // Pins without a recorded heatmap spread evenly over the layers.
            (None, CacheStrategy::HotCachedStatic) => {
                let k = self.spec.moe.as_ref().map_or(1, |m| m.routing.top_k);
                log.push(
                    "hot_cached_static: no heatmap recorded for this model; pinning experts evenly over the layers"
                        .into(),
                );
                Some(crate::placement::heatmap::ExpertHeat::even(self.spec.num_layers, n, k))
            }
            (None, _) if strategy.needs_heatmap() => {
                return Err(ModelError::Invalid(format!("{what} needs a heatmap")))
            }
            _ => None,
        };
        let per_token = self.kv_layout.bytes_per_token() as u64;
        let kv_keep = kv_asked.unwrap_or_else(|| self.kv_tokens.min(super::HOT_MIN_KV_TOKENS)) as u64 * per_token;
        let vram = plan.vram.unwrap_or_else(|| {
            let reserve = KV_RESERVE_BYTES.max(super::HOT_PREFILL_RESERVE_BYTES);
            self.plan_free().saturating_sub(reserve).saturating_sub(kv_keep).saturating_sub(beside)
        });
        let kept = if strategy == CacheStrategy::HotCachedStatic {
            let heat = heat.as_ref().expect("loaded above");
            let hot = super::hot_experts::HotExperts::pin(&self.dev, &streamer, heat, &moe, vram)?;
            let line = hot.describe(moe.len() * n);
            log.push(line.clone());
            let bytes = hot.bytes;
            self.placed.set_hot(hot, line);
            bytes
        } else {
            let capacity = (vram / record.max(1) as u64) as usize;
            // Pins take what is left after one layer's worth of slots for the calls' other experts;
            // `lru` makes every slot a cache entry.
            let (dynamic, pins, share) = match strategy {
                CacheStrategy::Lru => {
                    (capacity.min(krasis_gpu::moe::MOE_MAX_EXPERTS), vec![Vec::new(); moe.len()], 0.0)
                }
                _ => {
                    let room = capacity.saturating_sub(n).min(krasis_gpu::moe::MOE_MAX_EXPERTS - n);
                    let by_layer = match (strategy, &heat) {
                        (CacheStrategy::StaticPin, Some(h)) => super::hot_experts::choose_pinned(h, &moe, room),
                        (CacheStrategy::WeightedPin, Some(h)) => super::hot_experts::choose_weighted(h, &moe, room),
                        _ => vec![Vec::new(); self.spec.num_layers],
                    };
                    let share =
                        heat.as_ref().map_or(0.0, |h| super::hot_experts::chosen_route_share(h, &moe, &by_layer));
                    // Model layer → MoE layer of the cache.
                    let pins = moe.iter().map(|&l| by_layer.get(l).cloned().unwrap_or_default()).collect();
                    (n, pins, share)
                }
            };
            let pool = super::expert_pool::ExpertPool::new(&self.dev, streamer, strategy, &pins, dynamic, share)?;
            let line = pool.describe();
            log.push(line.clone());
            let bytes = pool.stats().bytes;
            self.placed.set_pool(std::sync::Arc::new(pool), line);
            bytes
        };
        let after = format!("the {} of experts {what} keeps", format_bytes(kept as u64));
        self.fit_prefill_chunk(kv_asked, &after, log)
    }

    /// VRAM the plan shares out now: what the budget has left, less one session's gated-DeltaNet
    /// states (allocated with its KV cache; a constant per sequence).
    fn plan_free(&self) -> u64 {
        self.dev.budget().remaining().saturating_sub(session_state_bytes(&self.spec))
    }

    /// The VRAM plan over what the budget leaves now (after the stream slots), with pinned
    /// experts when `pins`: the KV cache shrinks to the plan's (with pins
    /// [`super::vram_plan::DEFAULT_KV_TOKENS`] unless more is asked or needed) and the bytes for
    /// the pins are returned.
    /// VRAM the plan leaves to what runs beside one session: the further sessions' KV caches
    /// (when their size was asked) and the prefix cache.
    fn kept_beside(&self, opts: &GpuOptions) -> u64 {
        let per_session = opts.kv_tokens.map_or(0, |t| t as u64 * self.kv_layout.bytes_per_token() as u64);
        opts.sessions.saturating_sub(1) as u64 * per_session + opts.prefix_cache_bytes
    }

    fn replan_vram(&mut self, opts: &GpuOptions, pins: bool, log: &mut Vec<String>) -> Result<u64> {
        let ask = super::vram_plan::VramAsk {
            free: self.plan_free(),
            kv_bytes_per_token: self.kv_layout.bytes_per_token() as u64,
            scratch: self.scratch_cost,
            model_context: self.kv_tokens,
            kv_asked: opts.kv_tokens,
            context_needed: opts.context_tokens,
            pins,
            beside: self.kept_beside(opts),
        };
        let plan = super::vram_plan::plan_vram(&ask).map_err(|e| {
            ModelError::Invalid(format!("the VRAM budget left after the weights and the stream slots: {}", e.0))
        })?;
        self.kv_tokens = plan.kv_tokens.min(self.kv_tokens);
        self.prefill_chunk = plan.prefill_chunk;
        log.push(plan.describe(&ask));
        Ok(plan.pin_bytes)
    }

    /// Sizes the prompt chunk from what the budget leaves now (after `what`), beside the KV
    /// cache and the scratch its context needs; when not even a
    /// [`super::vram_plan::MIN_PREFILL_CHUNK`]-token chunk fits, the KV cache shrinks (an asked
    /// `kv_tokens` is refused instead).
    fn fit_prefill_chunk(&mut self, kv_asked: Option<usize>, what: &str, log: &mut Vec<String>) -> Result<()> {
        use super::vram_plan::{CHUNK_STEP, FIXED_RESERVE_BYTES, MIN_PREFILL_CHUNK};
        let (cost, kv_bpt) = (self.scratch_cost, self.kv_layout.bytes_per_token() as u64);
        let free = self.plan_free().saturating_sub(FIXED_RESERVE_BYTES);
        if cost.chunk_beside(free, kv_bpt, self.kv_tokens) < MIN_PREFILL_CHUNK {
            let fit = cost.kv_beside(free, kv_bpt, MIN_PREFILL_CHUNK);
            if kv_asked.is_some() || fit == 0 {
                return Err(ModelError::Invalid(format!(
                    "{what}: the VRAM left ({}) holds {fit} KV tokens beside a {MIN_PREFILL_CHUNK}-token prompt chunk, not {} (lower the kv_tokens or pinned-VRAM options, or raise the VRAM budget)",
                    format_bytes(free),
                    self.kv_tokens
                )));
            }
            log.push(format!("KV cache: {fit} tokens after {what} (was {})", self.kv_tokens));
            self.kv_tokens = fit;
        }
        let chunk = cost.chunk_beside(free, kv_bpt, self.kv_tokens) / CHUNK_STEP * CHUNK_STEP;
        if chunk < self.prefill_chunk {
            log.push(format!("prompts run in chunks of up to {chunk} tokens after {what}"));
        }
        self.prefill_chunk = chunk;
        Ok(())
    }

    /// Builds the model on the GPU from `source`, its routed experts placed by `experts`
    /// (quantised ones quantised here).
    pub fn from_source(
        spec: ModelSpec,
        source: &dyn WeightSource,
        opts: &GpuOptions,
        experts: ExpertPlacement,
    ) -> Result<GpuModel> {
        Self::from_source_cached(spec, source, opts, experts, None)
    }

    /// [`GpuModel::from_source`], quantised routed experts uploaded from `expert_cache` when given.
    fn from_source_cached(
        spec: ModelSpec,
        source: &dyn WeightSource,
        opts: &GpuOptions,
        experts: ExpertPlacement,
        expert_cache: Option<&ExpertCache>,
    ) -> Result<GpuModel> {
        check_gpu_layers(&spec)?;
        let started = Instant::now();
        let dev = GpuDevice::open(opts.ordinal, opts.vram_budget)?;
        let mut log = vec![format!("GPU {}: {}; kernels {}", opts.ordinal, dev.info(), dev.target())];
        // Every program the model can launch (not the other KV dtype's attention variants),
        // compiled on other threads while the weights upload (a machine's first start compiles
        // them all with NVRTC: seconds that would otherwise come before the copies).
        let kv = opts.kv_storage()?;
        let fp4 = opts.expert_fp4.is_some();
        let keep = |k: &krasis_gpu::kernels::KernelSource| {
            !krasis_gpu::attn_decode::attention_variant_of_other_dtype(k, kv)
                && (fp4 || !krasis_gpu::moe::is_fp4_program(k))
        };
        let gemm = GemmContext::new(&dev)?;
        let quant = spec.source_quant.clone(); // the built tree's type borrows it, not `spec`
        let spec_ref = spec.clone();
        let mut builder = GpuBuilder {
            dev: &dev,
            w: WeightLoader::new(source, &quant),
            opts,
            spec: &spec_ref,
            experts,
            expert_cache,
        };
        let (weights, images) = std::thread::scope(|s| {
            let compiling = s.spawn(|| dev.compile_kernels_where(&keep));
            let weights = build(&spec_ref, &mut builder);
            (weights, compiling.join())
        });
        let images = images.map_err(|p| {
            ModelError::Invalid(format!("compiling the GPU kernels panicked: {}", krasis_core::panic_text(p)))
        })?;
        let weights = weights?;
        dev.load_kernels(images, &keep)?;
        // Host experts: one thread serves their hand-offs for the model's life.
        let host: Vec<_> = weights.layers.iter().map(|l| l.moe().and_then(|m| m.experts.host()).cloned()).collect();
        let expert_server = match (host.iter().any(Option::is_some), &builder.experts) {
            (false, _) => None,
            (true, ExpertPlacement::Host { pool, .. }) => Some(ExpertServer::start(host, pool.clone())?),
            (true, _) => Some(ExpertServer::start(host, None)?),
        };
        let placed = super::placed::Placed::new(&spec, expert_server.is_none());
        let weights_bytes = dev.budget().used();

        // KV capacity and the prompt chunk: the VRAM plan over what the weights leave.
        let (planes, row, group) = kv_geometry(&spec);
        // The attention layers only: a DeltaNet layer keeps a constant state instead.
        let kv_layout = KvLayout::new(kv, kv_layers(&spec), planes, row, group)?;
        let scratch_cost = super::vram_plan::ScratchCost::of(
            &spec,
            opts.kv_b_proj_quant != krasis_gpu::linear::LinearQuant::Bf16 || opts.precision == super::GpuPrecision::F32,
        );
        let ask = super::vram_plan::VramAsk {
            free: dev.budget().remaining().saturating_sub(session_state_bytes(&spec)),
            kv_bytes_per_token: kv_layout.bytes_per_token() as u64,
            scratch: scratch_cost,
            model_context: spec.max_position_embeddings.max(1),
            kv_asked: opts.kv_tokens,
            context_needed: opts.context_tokens,
            pins: false,
            // Nothing is pinned from this plan; later sessions and the prefix cache take what
            // the weights and this session leave.
            beside: 0,
        };
        let plan = super::vram_plan::plan_vram(&ask).map_err(|e| {
            ModelError::Invalid(format!(
                "the VRAM budget {} leaves no room for the KV cache and a prompt chunk after {} of weights: {}",
                format_bytes(dev.budget().budget()),
                format_bytes(weights_bytes),
                e.0
            ))
        })?;
        let kv_tokens = plan.kv_tokens;
        let kv_bytes = kv_tokens as u64 * kv_layout.bytes_per_token() as u64;
        log.push(plan.describe(&ask));
        log.push(format!(
            "KV cache: {kv_tokens} tokens × {} per token ({}, {})",
            format_bytes(kv_layout.bytes_per_token() as u64),
            kv,
            format_bytes(kv_bytes)
        ));
        if spec.delta_net.is_some() {
            log.push(format!(
                "KV cache over the {} attention layers; gated-DeltaNet states: {} per sequence, whatever its length",
                kv_layers(&spec),
                format_bytes(session_state_bytes(&spec))
            ));
        }
        if opts.invariant_prefill {
            log.push(format!(
                "row-invariant prefill: prompt calls of {} tokens and more compute each token alone (GEMMs in cuBLAS \
                 calls of {} rows, the experts' grouped kernels, attention through the KV cache): a resumed prefix \
                 gives the cold request's logits bit for bit",
                super::INVARIANT_MIN_TOKENS,
                krasis_gpu::linear::FIXED_ROWS
            ));
        }
        let rope = RotaryTables::new(&spec.rope);
        let (cos, sin) = rope.table(0, kv_tokens);
        let cos = dev.upload(&cos, "rope cos table")?;
        let sin = dev.upload(&sin, "rope sin table")?;
        let sampler = GpuSampler::new(&dev, spec.vocab_size)?;
        log.push(format!(
            "weights on GPU: {} in {:.2} s; VRAM budget {}",
            format_bytes(weights_bytes),
            started.elapsed().as_secs_f64(),
            dev.budget()
        ));
        Ok(GpuModel {
            rope_half: rope.half_dim(),
            rope_pairing: rope.pairing,
            max_pos: kv_tokens,
            spec,
            dev,
            gemm,
            weights,
            cos,
            sin,
            sampler,
            kv_layout,
            kv_tokens,
            prefill_chunk: plan.prefill_chunk,
            scratch_cost,
            log,
            host_expert_bytes: None,
            expert_server,
            placed,
            batch: Default::default(),
            heat: None,
            watch: Default::default(),
            precision: opts.precision,
            invariant_prefill: opts.invariant_prefill,
        })
    }
}

/// What decode's PCIe share is asked to be ([`GpuOptions::pcie_routes`]): the default (sized from
/// the experts by the streamer) for SiLU experts without biases (the PCIe kernel's activation),
/// none for others; an asked count is refused for those, or past the model's top-k.
fn pcie_routes(spec: &ModelSpec, asked: Option<usize>) -> Result<super::expert_stream::PcieAsk> {
    let plain = matches!(spec.expert_activation, krasis_core::spec::ExpertActivation::Silu) && !spec.expert_bias;
    let top_k = spec.moe.as_ref().map_or(0, |m| m.routing.top_k);
    let routes = match asked {
        None if plain => None,
        None | Some(0) => Some(0),
        Some(_) if !plain => {
            return Err(ModelError::Invalid(
                "`GpuOptions::pcie_routes`: the GPU's PCIe share runs SiLU experts without biases; this model's experts have another activation or biases".into(),
            ))
        }
        Some(g) if g > top_k => {
            return Err(ModelError::Invalid(format!(
                "`GpuOptions::pcie_routes` = {g}: more than the model's {top_k} routes per token"
            )))
        }
        Some(g) => Some(g),
    };
    Ok(super::expert_stream::PcieAsk { top_k, routes })
}
