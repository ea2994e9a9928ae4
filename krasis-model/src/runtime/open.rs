//! [`open_engine`]: probes the GPU, asks the device choice ([`crate::placement::choose_device`])
//! which engine to open and with which defaults, and opens it. The choice's rules, and the
//! defaults a caller gets by asking for nothing, live there and in [`crate::placement::precision`]:
//! - CPU experts: INT4 on safetensors (per projection on a GGUF); CPU dense weights: INT8 on the
//!   CPU path. Both are built into the caches on first use; `bf16` asks for the reference path.
//! - GPU experts ([`EngineConfig::gpu_expert_width`] `Auto`): the source's width when it is
//!   8-bit, else INT4, for the whole-model GPU path; a hybrid prefill streams the CPU experts'
//!   own records at their width, so every prompt at or above the streaming length prefills on
//!   the GPU.
//! - Hybrid: the VRAM left after the weights, the KV cache and the prefill reserve holds pinned
//!   experts ([`crate::placement::CacheStrategy::HotCachedStatic`]), ranked by the model's
//!   recorded heatmap when one is beside the caches, else spread evenly over the layers.
//!
//! The engine opened reports its placement plan ([`Opened::placement`]): who runs the routed
//! experts for each call length, and why.

use krasis_core::budget::{check_ram_budget, format_bytes, rss_deviation_warning};

use super::{DecoderEngine, DevicePath, DevicePolicy, Engine, EngineConfig};
use crate::cpu::load::load_model;
use crate::cpu::memory::{cpu_estimate, estimate, MemoryEstimate};
use crate::cpu::quantized::WeightBits;
use crate::error::{ModelError, Result};
use crate::gpu::GpuModel;
use crate::placement::GpuFound;
use crate::source::files::ModelFiles;

/// An opened engine and what opening it did.
pub struct Opened {
    pub engine: Box<dyn Engine>,
    /// Human-readable lines about loading (pool, caches, GPU), in order.
    pub log: Vec<String>,
    /// Things the user should know (e.g. a RAM budget overridden by `force`).
    pub warnings: Vec<String>,
    /// One line: which device path was chosen and why, e.g. `device: cpu (auto: no GPU in use:
    /// no CUDA driver found (...); running on the CPU)`.
    pub why: String,
    /// The placement plan's start lines: who runs the routed experts, per call length, and why
    /// ([`crate::placement::PlacementPlan::describe`]).
    pub placement: Vec<String>,
    /// The resident-memory estimate of the CPU path at the widths the engine runs (`auto`
    /// resolved), at the context it was opened for (`None` on the GPU).
    pub memory_estimate: Option<u64>,
    /// The same estimate by parts, for the RSS check at the context a run actually held.
    pub resident_estimate: Option<MemoryEstimate>,
    /// Whether the estimate should match the resident set once the model has run (quantised
    /// experts are resident after loading the cache, dense weights after the first pass).
    pub check_rss: bool,
}

impl Opened {
    /// After a forward pass: the resident set against the estimate, as one line (`memory: ...`
    /// when within tolerance, `warning: ...` when not); `None` where no check applies.
    pub fn rss_report(&self) -> Option<String> {
        let est = self.memory_estimate.filter(|_| self.check_rss)?;
        rss_line(est, "")
    }

    /// [`Opened::rss_report`] at the context actually held (`tokens`), for runs far shorter than
    /// the context the start-up estimate assumes.
    pub fn rss_report_at(&self, tokens: u64) -> Option<String> {
        self.rss_report_after(tokens, tokens)
    }

    /// [`Opened::rss_report_at`] where the longest forward pass (the prompt's prefill) was
    /// `longest_pass` tokens: the prefill scratch that stays depends on it
    /// ([`MemoryEstimate::total_after`]).
    pub fn rss_report_after(&self, tokens: u64, longest_pass: u64) -> Option<String> {
        let estimate = self.resident_estimate.filter(|_| self.check_rss)?;
        rss_line(estimate.total_after(tokens, longest_pass), &format!(" for {tokens} tokens of context"))
    }
}

/// The RSS against `est`: `memory: …` within tolerance, `warning: …` not. Heap the allocator
/// holds free (a long prefill's f32 activations, freed but kept in its arenas) is handed back
/// first: it is reusable, not held by the engine, and its size depends on the allocator alone.
fn rss_line(est: u64, context: &str) -> Option<String> {
    krasis_core::memory::release_free_heap();
    let rss = krasis_core::hw::current_rss_bytes()?;
    Some(match rss_deviation_warning(est, rss) {
        Some(w) => format!("warning: {w}"),
        None => format!("memory: RSS {} within 10% of the estimate {}{context}", format_bytes(rss), format_bytes(est)),
    })
}

/// What the CPU engine of `config` will hold resident (see [`cpu_estimate`]).
pub fn cpu_memory_estimate(files: &ModelFiles, config: &EngineConfig) -> MemoryEstimate {
    let cpu = &config.cpu;
    cpu_estimate(files.spec(), Some(files.weights()), cpu.expert_bits, cpu.dense_bits, cpu.group_size)
}

/// The `device: <path> (<why>)` line of [`Opened::why`].
fn device_line(path: DevicePath, why: &str) -> String {
    format!("device: {path} ({why})")
}

/// Opens `files` as `config` asks: the device choice ([`crate::placement::choose_device`]) on
/// what the GPU probe finds, then the engine it names. The CPU expert width `auto` is resolved
/// first ([`crate::placement::precision::resolve_expert_bits`]). A whole-model load that `auto` chose and
/// the GPU refuses falls back to hybrid.
pub fn open_engine(files: &ModelFiles, config: &EngineConfig) -> Result<Opened> {
    let choice = device_choice(files, config)?;
    let notes = choice.notes.clone();
    let mut opened = match choice.path {
        DevicePath::Cpu => open_cpu(files, &choice.config, &choice.why),
        DevicePath::Hybrid => open_hybrid(files, &choice.config, &choice.why),
        DevicePath::Gpu => match (open_gpu(files, &choice.config, &choice.why), choice.hybrid_fallback) {
            (Err(ModelError::Gpu(e)), Some(fallback)) => {
                let why = format!("{} ({e})", fallback.why);
                open_hybrid(files, &fallback.config, &why)
            }
            (opened, _) => opened,
        },
    }?;
    opened.log.splice(0..0, notes);
    Ok(opened)
}

/// The engine [`open_engine`] would open for `config`, with its options and why, without
/// loading anything: the GPU is probed, the recorded heatmap looked for.
pub fn device_choice(files: &ModelFiles, config: &EngineConfig) -> Result<crate::placement::DeviceChoice> {
    // Under `auto`, a tune saved for this model and GPU is the choice ([`crate::placement::tune`]).
    let mut tuned_config = config.clone();
    let mut tune_note = None;
    if config.device == DevicePolicy::Auto && config.use_saved_tune {
        tune_note = crate::placement::tune::apply(files, config.cpu.cache_dir.as_deref(), &mut tuned_config)?;
    }
    let tuned = tuned_config.device != config.device;
    let config = &tuned_config;
    // A CPU expert width other than `auto` is the caller's choice (auto then keeps the experts on
    // the CPU); `auto` resolves to the default here.
    let cpu_asked = config.cpu.expert_bits != WeightBits::Auto;
    let mut resolved = config.clone();
    resolved.cpu.expert_bits = crate::placement::precision::resolve_expert_bits(files.spec(), config.cpu.expert_bits);
    let int4a_note = if cpu_asked { None } else { cpu_expert_default(files, &mut resolved) };
    // `auto` leaves the width to the device's defaults; `bf16` is `None` (BF16 experts).
    if config.gpu_expert_width == WeightBits::Int4Asym {
        return Err(ModelError::Invalid(
            "the GPU experts take auto, bf16, 8 or 4: asymmetric INT4 (`4a`) runs on the CPU only".into(),
        ));
    }
    if config.gpu_expert_width != WeightBits::Auto {
        resolved.gpu.expert_bits = crate::placement::precision::quant_width(config.gpu_expert_width);
    }
    let ordinal = config.gpu.ordinal;
    let gpu = match (config.device, krasis_gpu::probe_ordinal(ordinal)) {
        (DevicePolicy::Cpu, _) => GpuFound::Absent("the CPU device was asked for".into()),
        (_, Err(e)) => GpuFound::Absent(e.to_string()),
        (_, Ok(_)) => GpuFound::Usable { budget: krasis_gpu::vram_budget_bytes(ordinal, config.gpu.vram_budget)? },
    };
    let heatmap = match config.device {
        DevicePolicy::Hybrid | DevicePolicy::Auto => recorded_heatmap(files, config.cpu.cache_dir.as_deref()),
        _ => None,
    };
    let precisions_asked = config.wants_cpu_precisions();
    let mut choice =
        crate::placement::choose_device(files.spec(), &resolved, cpu_asked, precisions_asked, &gpu, heatmap)?;
    if tuned {
        choice.why = tune_note.take().unwrap_or_default();
    }
    choice.notes.extend(tune_note);
    // The whole-model GPU engine keeps its own expert width: the CPU's is not its concern.
    if choice.path != DevicePath::Gpu {
        choice.notes.extend(int4a_note);
    }
    Ok(choice)
}

/// The CPU experts at `auto` on a checkpoint of float experts, on the CPU engine and the hybrid
/// alike: asymmetric INT4 g32 ([`crate::placement::precision::int4a_by_default`]) when the CPU
/// engine's estimate at that width fits the RAM limit (the hybrid holds less: the dense weights
/// live on the GPU); otherwise INT4 g128 as resolved, and a note saying why. The hybrid then
/// streams the `4a` records for prefill and requantises them on the GPU to INT8 g32
/// ([`crate::placement::precision::default_stream_bits`]); a GPU expert width of 4 asked for keeps
/// INT4 g128 on the CPU, whose records stream as they are (one copy in RAM).
pub(crate) fn cpu_expert_default(files: &ModelFiles, config: &mut EngineConfig) -> Option<String> {
    if config.cpu.expert_bits != WeightBits::Int4
        || !crate::placement::precision::int4a_by_default(files.spec())
        || config.gpu_expert_width == WeightBits::Int4
    {
        return None;
    }
    let mut trial = config.clone();
    trial.cpu.expert_bits = WeightBits::Int4Asym;
    let est = cpu_memory_estimate(files, &trial).total(trial.context_tokens);
    match check_ram_budget(est, krasis_core::hw::probe().mem_total_bytes, false) {
        Ok(_) => {
            config.cpu.expert_bits = WeightBits::Int4Asym;
            None
        }
        Err(_) => Some(format!(
            "routed experts: INT4 g128, not the default asymmetric INT4 g32, whose estimated {} on the CPU engine \
             exceeds the RAM limit (`EngineOptions::expert_bits` 4a asks for it anyway)",
            format_bytes(est)
        )),
    }
}

/// The heatmap beside the caches when there is one that fits the model; a damaged or foreign one
/// is passed over with a warning (the pins then spread evenly), never a reason to refuse a start.
fn recorded_heatmap(files: &ModelFiles, cache_dir: Option<&std::path::Path>) -> Option<std::path::PathBuf> {
    let path = default_heatmap_path(files, cache_dir);
    if !path.is_file() {
        return None;
    }
    let (layers, experts) = (files.spec().num_layers, files.spec().routed_experts());
    match crate::placement::heatmap::ExpertHeat::load(&path, layers, experts) {
        Ok(_) => Some(path),
        Err(e) => {
            tracing::warn!("{e}; pinning experts evenly over the layers instead");
            None
        }
    }
}

/// The hybrid engine's defaults for `config` with the heatmap recorded beside the caches
/// ([`crate::placement::device::hybrid_defaults`]).
#[cfg(test)]
pub(crate) fn hybrid_defaults(files: &ModelFiles, config: &EngineConfig) -> EngineConfig {
    let heatmap = recorded_heatmap(files, config.cpu.cache_dir.as_deref());
    crate::placement::device::hybrid_defaults(files.spec(), config, heatmap)
}

/// Where the model's recorded heatmap lives: [`crate::placement::heatmap::DEFAULT_HEATMAP_FILE`] in its cache
/// directory (`cache_dir` when given).
pub fn default_heatmap_path(files: &ModelFiles, cache_dir: Option<&std::path::Path>) -> std::path::PathBuf {
    let dir = cache_dir.map(std::path::Path::to_path_buf).unwrap_or_else(|| files.default_cache_dir());
    dir.join(crate::placement::heatmap::DEFAULT_HEATMAP_FILE)
}

/// The CPU engine, after checking the RAM estimate (refused above the budget unless
/// `config.force`). `why` goes into [`Opened::why`]. `config.gpu.kv_tokens`, when given, limits
/// every session to that many tokens here too (the CPU cache grows up to it), so the KV token
/// option means the same on every device.
pub fn open_cpu(files: &ModelFiles, config: &EngineConfig, why: &str) -> Result<Opened> {
    let mut resolved = config.clone();
    resolved.cpu.dense_bits = crate::placement::precision::resolve_dense_bits(config.cpu.dense_bits);
    let config = &resolved;
    let resident = cpu_memory_estimate(files, config);
    let est = resident.total(config.context_tokens);
    let warnings = check_ram(est, config)?;
    let mut loaded = load_model(files, &config.cpu)?;
    krasis_core::memory::release_free_heap();
    if config.record_heatmap {
        loaded.model.record_heatmap();
    }
    let placement = crate::placement::PlacementPlan::cpu(files.spec(), why).describe();
    let engine =
        DecoderEngine::new(loaded.model).with_expert_bytes(loaded.expert_bytes).with_kv_limit(config.gpu.kv_tokens);
    Ok(Opened {
        engine: Box::new(engine),
        log: loaded.log,
        warnings,
        why: device_line(DevicePath::Cpu, why),
        placement,
        memory_estimate: Some(est),
        resident_estimate: Some(resident),
        check_rss: config.cpu.expert_bits != WeightBits::Bf16,
    })
}

/// Refuses (unless `config.force`) when `estimate` bytes exceed the RAM budget; the warnings to
/// show otherwise.
fn check_ram(estimate: u64, config: &EngineConfig) -> Result<Vec<String>> {
    let mem_total = krasis_core::hw::probe().mem_total_bytes;
    let warning =
        check_ram_budget(estimate, mem_total, config.force).map_err(|e| ModelError::Invalid(e.to_string()))?;
    Ok(warning.into_iter().collect())
}

/// The whole model on GPU `config.gpu.ordinal`. `why` goes into [`Opened::why`].
pub fn open_gpu(files: &ModelFiles, config: &EngineConfig, why: &str) -> Result<Opened> {
    let mut model = GpuModel::from_files(files, &config.gpu)?;
    model.warm_up()?;
    if config.record_heatmap {
        model.record_heatmap()?;
    }
    let log = std::mem::take(&mut model.log);
    let placement = model.placement_lines(why);
    Ok(Opened {
        engine: Box::new(DecoderEngine::new(model)),
        log,
        warnings: Vec::new(),
        why: device_line(DevicePath::Gpu, why),
        placement,
        memory_estimate: None,
        resident_estimate: None,
        check_rss: false,
    })
}

/// Opens the hybrid engine on GPU `config.gpu.ordinal`, after checking the host RAM the routed
/// experts take against the budget. `why` goes into the device line.
pub(crate) fn open_hybrid(files: &ModelFiles, config: &EngineConfig, why: &str) -> Result<Opened> {
    let mut host_bytes = estimate(files.spec(), config.cpu.expert_bits).expert_bytes;
    // Prefill streaming from the GPU expert cache keeps it in RAM beside the CPU one (streaming
    // the CPU cache's own records adds nothing).
    // FP4 records do not stream from the CPU cache: the GPU expert cache serves them.
    let gpu_cache = config.gpu.stream_from == crate::gpu::StreamFrom::GpuCache || config.gpu.expert_fp4.is_some();
    if let Some(bits) = config.gpu.expert_bits.filter(|_| gpu_cache) {
        let (h, _) = crate::gpu::expert_cache::expected_gpu_cache_header(
            files.spec(),
            files.fingerprint(),
            bits,
            config.gpu.expert_fp4,
            config.gpu.expert_group_size,
        )?;
        host_bytes += krasis_cache::format::records_bytes(&h).unwrap_or(0);
    }
    let warnings = check_ram(host_bytes, config)?;
    let mut model = GpuModel::hybrid_from_files(files, &config.gpu, &config.cpu)?;
    model.warm_up()?;
    if config.record_heatmap {
        model.record_heatmap()?;
    }
    let log = std::mem::take(&mut model.log);
    let placement = model.placement_lines(why);
    let expert_bytes = model.host_expert_bytes;
    let mut engine = DecoderEngine::new(model);
    if let Some(b) = expert_bytes {
        engine = engine.with_expert_bytes(b);
    }
    Ok(Opened {
        engine: Box::new(engine),
        log,
        warnings,
        why: device_line(DevicePath::Hybrid, why),
        placement,
        memory_estimate: None,
        resident_estimate: None,
        check_rss: false,
    })
}
