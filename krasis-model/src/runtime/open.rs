//! [`open_engine`]: the device policy. `cpu`, `gpu` and `hybrid` do as told; `auto` takes the CPU
//! without a usable GPU (or with a quantised CPU dense width asked for), else the whole model on
//! the GPU when it fits the VRAM budget with the routed experts at the default GPU width, else
//! hybrid (routed experts on the CPU). The CPU path checks the RAM estimate first.
//!
//! The defaults a caller gets by asking for nothing ([`crate::precision`] holds each rule):
//! - CPU experts: INT4 on safetensors (per projection on a GGUF); CPU dense weights: INT8 on the
//!   CPU path. Both are built into the caches on first use; `bf16` asks for the reference path.
//! - GPU experts ([`GpuExpertWidth::Auto`]): the source's width when it is 8-bit, else INT4, for
//!   the whole-model GPU path; a hybrid prefill streams the CPU experts' own records at their
//!   width, so every prompt at or above the streaming length prefills on the GPU.
//! - Hybrid: the VRAM left after the weights, the KV cache and the prefill reserve holds pinned
//!   experts ([`crate::gpu::CacheStrategy::HotCachedStatic`]), ranked by the model's recorded
//!   heatmap when one is beside the caches, else spread evenly over the layers.

use krasis_core::budget::{check_ram_budget, format_bytes, rss_deviation_warning};

use super::{DecoderEngine, DevicePath, DevicePolicy, Engine, EngineConfig, GpuExpertWidth};
use crate::error::{ModelError, Result};
use crate::files::ModelFiles;
use crate::gpu::GpuModel;
use crate::load::load_model;
use crate::memory::{cpu_estimate, MemoryEstimate};
use crate::quantized::WeightBits;

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
    /// The resident-memory estimate of the CPU path (`None` on the GPU).
    pub memory_estimate: Option<u64>,
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

    /// [`Opened::rss_report`] against `estimate` at the context actually held (`tokens`), for
    /// runs far shorter than the context the start-up estimate assumes.
    pub fn rss_report_at(&self, estimate: &MemoryEstimate, tokens: u64) -> Option<String> {
        self.memory_estimate.filter(|_| self.check_rss)?;
        rss_line(estimate.total(tokens), &format!(" for {tokens} tokens of context"))
    }
}

/// The RSS against `est`: `memory: …` within tolerance, `warning: …` not.
fn rss_line(est: u64, context: &str) -> Option<String> {
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
pub(crate) fn device_line(path: DevicePath, why: &str) -> String {
    format!("device: {path} ({why})")
}

/// Opens `files` as `config` asks; see the module documentation for the policy.
/// `--cpu-expert-bits auto` is resolved here first ([`crate::precision::resolve_expert_bits`]):
/// the reference experts on safetensors, per-projection widths on a GGUF.
pub fn open_engine(files: &ModelFiles, config: &EngineConfig) -> Result<Opened> {
    let mut resolved = config.clone();
    // A CPU expert width other than `auto` is the caller's choice (auto then keeps the experts on
    // the CPU); `auto` resolves to the default here.
    let cpu_asked = config.cpu.expert_bits != WeightBits::Auto;
    let cpu_precisions_asked = config.wants_cpu_precisions();
    resolved.cpu.expert_bits = crate::precision::resolve_expert_bits(files.spec(), config.cpu.expert_bits);
    match config.gpu_expert_width {
        GpuExpertWidth::Bits(b) => resolved.gpu.expert_bits = Some(b),
        GpuExpertWidth::Bf16 => resolved.gpu.expert_bits = None,
        GpuExpertWidth::Auto => {}
    }
    let config = &resolved;
    let ordinal = config.gpu.ordinal;
    if config.device == DevicePolicy::Cpu && (config.gpu.expert_bits.is_some() || config.gpu_expert_width.is_bits()) {
        return Err(ModelError::Invalid(
            "--gpu-expert-bits applies to the routed experts on the GPU (--device gpu: resident; --device hybrid: streamed for long prefills); with --device cpu they run on the CPU at --cpu-expert-bits".into(),
        ));
    }
    if config.device == DevicePolicy::Hybrid
        && config.gpu.expert_bits.is_some()
        && crate::quantized::quant_bits(config.cpu.expert_bits).is_none()
    {
        return Err(ModelError::Invalid(
            "--device hybrid --gpu-expert-bits streams the routed experts to the GPU for long prefills while the CPU decodes from its expert cache: give --cpu-expert-bits 4|8 too".into(),
        ));
    }
    let streams =
        config.gpu.expert_bits.is_some() && matches!(config.device, DevicePolicy::Hybrid | DevicePolicy::Auto);
    if config.gpu.stream_from != crate::gpu::StreamFrom::CpuCache && !streams {
        return Err(ModelError::Invalid(
            "--stream-experts-from applies when a hybrid prefill streams the experts: --device hybrid (or auto) with --gpu-expert-bits 4|8".into(),
        ));
    }
    match config.device {
        DevicePolicy::Cpu => open_cpu(files, config, "as asked"),
        DevicePolicy::Hybrid => crate::gpu::hybrid::open_hybrid(files, &hybrid_defaults(files, config)),
        DevicePolicy::Gpu => {
            if let Err(e) = krasis_gpu::probe_ordinal(ordinal) {
                return Err(ModelError::Invalid(format!("--device gpu: {e}")));
            }
            if cpu_precisions_asked {
                return Err(ModelError::Invalid(
                    "--device gpu runs the whole model on the GPU; --cpu-expert-bits/--cpu-dense-bits apply to --device cpu and --device hybrid".into(),
                ));
            }
            let cfg = whole_gpu_defaults(files, config);
            let why = format!(
                "as asked: the whole model on CUDA device {ordinal}, routed experts {}",
                gpu_width_name(cfg.gpu.expert_bits)
            );
            open_gpu(files, &cfg, &why)
        }
        DevicePolicy::Auto => match krasis_gpu::probe_ordinal(ordinal) {
            Err(e) => open_cpu(files, config, &format!("auto: no GPU in use: {e}; running on the CPU")),
            Ok(_) if !matches!(config.cpu.dense_bits, WeightBits::Bf16 | WeightBits::Auto) => {
                open_cpu(files, config, "auto: a quantised CPU dense width applies to the CPU path; running on the CPU")
            }
            Ok(_) => open_auto_gpu(files, config, cpu_asked),
        },
    }
}

/// `--device auto` with a usable GPU: the whole model on it when it fits the VRAM budget with the
/// routed experts at the GPU width (asked for, else [`crate::precision::default_gpu_expert_bits`]),
/// with room for [`crate::gpu::MIN_USEFUL_KV_TOKENS`] of context, and no CPU expert width was asked
/// for; otherwise hybrid ([`hybrid_defaults`]). A whole-model load the GPU refuses falls back to
/// hybrid too.
fn open_auto_gpu(files: &ModelFiles, config: &EngineConfig, cpu_asked: bool) -> Result<Opened> {
    let ordinal = config.gpu.ordinal;
    let whole = whole_gpu_defaults(files, config);
    let need = crate::gpu::whole_model_vram_bytes(files.spec(), &whole.gpu);
    let budget = krasis_gpu::vram_budget_bytes(ordinal, config.gpu.vram_budget)?;
    let hybrid = |reason: String| -> Result<Opened> {
        let cfg = hybrid_defaults(files, config);
        let why = format!(
            "auto: {reason}; routed experts {} on the CPU, the rest on CUDA device {ordinal}",
            match cfg.cpu.expert_bits {
                WeightBits::Int8 => "INT8".to_string(),
                WeightBits::Auto => crate::precision::describe_expert_bits(files.spec(), WeightBits::Auto),
                WeightBits::Bf16 => "BF16 (reference)".to_string(),
                WeightBits::Int4 => "INT4".to_string(),
            }
        );
        crate::gpu::hybrid::open_hybrid_because(files, &cfg, &why)
    };
    if cpu_asked {
        return hybrid(format!("a CPU expert width ({}) was asked for", config.cpu.expert_bits));
    }
    let experts = gpu_width_name(whole.gpu.expert_bits);
    if need > budget {
        return hybrid(format!(
            "the whole model with {experts} experts needs {} of VRAM, over the budget of {}",
            format_bytes(need),
            format_bytes(budget)
        ));
    }
    let why = format!(
        "auto: the whole model with {experts} experts ({}) fits the VRAM budget of {} on CUDA device {ordinal}",
        format_bytes(need),
        format_bytes(budget)
    );
    match open_gpu(files, &whole, &why) {
        Err(ModelError::Gpu(e)) => hybrid(format!("the GPU could not take the whole model ({e})")),
        other => other,
    }
}

/// The whole-model GPU engine's defaults on top of `config`: the routed experts resident at
/// [`crate::precision::default_gpu_expert_bits`] unless a GPU width was given.
fn whole_gpu_defaults(files: &ModelFiles, config: &EngineConfig) -> EngineConfig {
    let mut cfg = config.clone();
    if cfg.gpu_expert_width == GpuExpertWidth::Auto && cfg.gpu.expert_bits.is_none() {
        cfg.gpu.expert_bits = Some(crate::precision::default_gpu_expert_bits(files.spec()));
    }
    cfg
}

/// How a GPU expert width reads in the start line.
fn gpu_width_name(bits: Option<krasis_quant::Bits>) -> &'static str {
    match bits {
        Some(krasis_quant::Bits::Int4) => "INT4",
        Some(krasis_quant::Bits::Int8) => "INT8",
        None => "BF16",
    }
}

/// The hybrid engine's defaults on top of `config` (its CPU expert width already resolved):
/// prefill streaming the CPU experts' records at their own width unless a GPU width was given,
/// and the leftover VRAM pinning experts unless a cache strategy was given or pinning is off.
pub(crate) fn hybrid_defaults(files: &ModelFiles, config: &EngineConfig) -> EngineConfig {
    let spec = files.spec();
    let mut cfg = config.clone();
    if cfg.gpu_expert_width == GpuExpertWidth::Auto && cfg.gpu.expert_bits.is_none() {
        cfg.gpu.expert_bits = crate::precision::default_stream_bits(spec, cfg.cpu.expert_bits);
    }
    if cfg.pin_leftover_vram && cfg.gpu.cache.is_none() && cfg.gpu.expert_bits.is_some() && spec.moe.is_some() {
        let heatmap = recorded_heatmap(files, cfg.cpu.cache_dir.as_deref());
        cfg.gpu.cache =
            Some(crate::gpu::CachePlan { strategy: crate::gpu::CacheStrategy::HotCachedStatic, heatmap, vram: None });
    }
    cfg
}

/// The heatmap beside the caches when there is one that fits the model; a damaged or foreign one
/// is passed over with a warning (the pins then spread evenly), never a reason to refuse a start.
fn recorded_heatmap(files: &ModelFiles, cache_dir: Option<&std::path::Path>) -> Option<std::path::PathBuf> {
    let path = default_heatmap_path(files, cache_dir);
    if !path.is_file() {
        return None;
    }
    let (layers, experts) = (files.spec().num_layers, files.spec().routed_experts());
    match crate::heatmap::ExpertHeat::load(&path, layers, experts) {
        Ok(_) => Some(path),
        Err(e) => {
            tracing::warn!("{e}; pinning experts evenly over the layers instead");
            None
        }
    }
}

/// Where the model's recorded heatmap lives: [`crate::heatmap::DEFAULT_HEATMAP_FILE`] in its cache
/// directory (`cache_dir` when given).
pub fn default_heatmap_path(files: &ModelFiles, cache_dir: Option<&std::path::Path>) -> std::path::PathBuf {
    let dir = cache_dir.map(std::path::Path::to_path_buf).unwrap_or_else(|| files.default_cache_dir());
    dir.join(crate::heatmap::DEFAULT_HEATMAP_FILE)
}

/// The CPU engine, after checking the RAM estimate (refused above the budget unless
/// `config.force`). `why` goes into [`Opened::why`]. `config.gpu.kv_tokens`, when given, limits
/// every session to that many tokens here too (the CPU cache grows up to it), so the KV token
/// option means the same on every device.
pub fn open_cpu(files: &ModelFiles, config: &EngineConfig, why: &str) -> Result<Opened> {
    let mut resolved = config.clone();
    resolved.cpu.dense_bits = crate::precision::resolve_dense_bits(config.cpu.dense_bits);
    let config = &resolved;
    let est = cpu_memory_estimate(files, config).total(config.context_tokens);
    let warnings = check_ram(est, config)?;
    let mut loaded = load_model(files, &config.cpu)?;
    krasis_core::memory::release_free_heap();
    if config.record_heatmap {
        loaded.model.record_heatmap();
    }
    let engine =
        DecoderEngine::new(loaded.model).with_expert_bytes(loaded.expert_bytes).with_kv_limit(config.gpu.kv_tokens);
    Ok(Opened {
        engine: Box::new(engine),
        log: loaded.log,
        warnings,
        why: device_line(DevicePath::Cpu, why),
        memory_estimate: Some(est),
        check_rss: config.cpu.expert_bits != WeightBits::Bf16,
    })
}

/// Refuses (unless `config.force`) when `estimate` bytes exceed the RAM budget; the warnings to
/// show otherwise.
pub(crate) fn check_ram(estimate: u64, config: &EngineConfig) -> Result<Vec<String>> {
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
    Ok(Opened {
        engine: Box::new(DecoderEngine::new(model)),
        log,
        warnings: Vec::new(),
        why: device_line(DevicePath::Gpu, why),
        memory_estimate: None,
        check_rss: false,
    })
}
