//! The device choice: which engine an [`EngineConfig`] opens (CPU, the whole model on the GPU, or
//! hybrid) and the defaults that engine takes, with the reason the start line gives. A pure
//! function of the model's spec, the options, what the GPU probe found and the heatmap recorded
//! beside the caches, so every rule has a test without a GPU.
//!
//! `cpu`, `gpu` and `hybrid` do as told; `auto` takes the CPU without a usable GPU (or with a
//! quantised CPU dense width asked for), else the whole model on the GPU when it fits the VRAM
//! budget with the routed experts at the default GPU width, else hybrid.

use std::path::PathBuf;

use krasis_core::budget::format_bytes;

use crate::cpu::quantized::WeightBits;
use crate::error::{ModelError, Result};
use crate::runtime::{DevicePath, DevicePolicy, EngineConfig};
use crate::ModelSpec;

/// What the GPU probe found for the configured ordinal.
#[derive(Clone, Debug, PartialEq)]
pub enum GpuFound {
    /// A usable GPU whose VRAM budget (the option resolved on it) is this many bytes.
    Usable { budget: u64 },
    /// None usable, and why (no driver, no such ordinal, ...).
    Absent(String),
}

/// The engine to open, its options with the defaults applied, and why.
#[derive(Clone, Debug)]
pub struct DeviceChoice {
    pub path: DevicePath,
    pub config: EngineConfig,
    /// The reason, e.g. `auto: the whole model with INT4 experts (9.5 GiB) fits ...`.
    pub why: String,
    /// `auto` chose the whole GPU: if the GPU refuses the load, hybrid is the fallback.
    pub hybrid_fallback: Option<Box<DeviceChoice>>,
    /// Lines for the log, e.g. why a saved tune was not used.
    pub notes: Vec<String>,
}

/// Chooses the engine for `config` (its CPU expert width already resolved, see
/// [`crate::placement::precision::resolve_expert_bits`]). `cpu_asked`: the caller named a CPU
/// expert width; `cpu_precisions_asked`: the caller named a quantised CPU expert or dense width
/// ([`EngineConfig::wants_cpu_precisions`] before resolving), which the whole-model GPU does not
/// take. `heatmap`: the routes recorded beside the caches, which rank the pinned experts of a
/// hybrid engine.
pub fn choose_device(
    spec: &ModelSpec,
    config: &EngineConfig,
    cpu_asked: bool,
    cpu_precisions_asked: bool,
    gpu: &GpuFound,
    heatmap: Option<PathBuf>,
) -> Result<DeviceChoice> {
    check_options(config)?;
    let ordinal = config.gpu.ordinal;
    let choice =
        |path, config, why: String| DeviceChoice { path, config, why, hybrid_fallback: None, notes: Vec::new() };
    // Layers the GPU engine does not run (gpt-oss's options): the CPU under `auto`, an error for
    // an explicit GPU or hybrid.
    if let (Err(e), false) = (crate::gpu::check_gpu_layers(spec), config.device == DevicePolicy::Cpu) {
        if config.device != DevicePolicy::Auto {
            return Err(e);
        }
        return Ok(choice(DevicePath::Cpu, config.clone(), format!("auto: {e}; running on the CPU")));
    }
    match config.device {
        DevicePolicy::Cpu => Ok(choice(DevicePath::Cpu, config.clone(), "as asked".into())),
        DevicePolicy::Hybrid => {
            if let GpuFound::Absent(e) = gpu {
                return Err(ModelError::Invalid(format!("`DevicePolicy::Hybrid`: {e}")));
            }
            // Experts the hybrid's GPU side does not run (gpt-oss's biased experts) stay on the
            // CPU: asking to stream or pin them is an error.
            let asks_gpu_experts = config.gpu.expert_bits.is_some()
                || config.gpu_expert_width.int_bits().is_some()
                || config.gpu.cache.is_some();
            if let (Err(e), true) = (crate::gpu::check_hybrid_gpu_experts(spec), asks_gpu_experts) {
                return Err(e);
            }
            let why = format!("as asked: routed experts on the CPU, the rest on CUDA device {ordinal}");
            Ok(choice(DevicePath::Hybrid, hybrid_defaults(spec, config, heatmap), why))
        }
        DevicePolicy::Gpu => {
            if let GpuFound::Absent(e) = gpu {
                return Err(ModelError::Invalid(format!("`DevicePolicy::Gpu`: {e}")));
            }
            if cpu_precisions_asked {
                return Err(ModelError::Invalid(
                    "`DevicePolicy::Gpu` runs the whole model on the GPU; `EngineOptions::expert_bits`/`EngineOptions::dense_bits` apply to `DevicePolicy::Cpu` and `DevicePolicy::Hybrid`".into(),
                ));
            }
            let cfg = whole_gpu_defaults(spec, config);
            let why = format!(
                "as asked: the whole model on CUDA device {ordinal}, routed experts {}",
                gpu_width_name(cfg.gpu.expert_bits, cfg.gpu.expert_fp4)
            );
            Ok(choice(DevicePath::Gpu, cfg, why))
        }
        DevicePolicy::Auto => {
            let budget = match gpu {
                GpuFound::Absent(e) => {
                    return Ok(choice(
                        DevicePath::Cpu,
                        config.clone(),
                        format!("auto: no GPU in use: {e}; running on the CPU"),
                    ))
                }
                GpuFound::Usable { .. } if !matches!(config.cpu.dense_bits, WeightBits::Bf16 | WeightBits::Auto) => {
                    let why = "auto: a quantised CPU dense width applies to the CPU path; running on the CPU";
                    return Ok(choice(DevicePath::Cpu, config.clone(), why.into()));
                }
                GpuFound::Usable { budget } => *budget,
            };
            let hybrid = |reason: String| {
                let cfg = hybrid_defaults(spec, config, heatmap.clone());
                let why = format!(
                    "auto: {reason}; routed experts {} on the CPU, the rest on CUDA device {ordinal}",
                    cpu_width_name(spec, cfg.cpu.expert_bits)
                );
                choice(DevicePath::Hybrid, cfg, why)
            };
            if cpu_asked {
                return Ok(hybrid(format!("a CPU expert width ({}) was asked for", config.cpu.expert_bits)));
            }
            let whole = whole_gpu_defaults(spec, config);
            let need = crate::gpu::whole_model_vram_bytes(spec, &whole.gpu);
            let experts = gpu_width_name(whole.gpu.expert_bits, whole.gpu.expert_fp4);
            if need > budget {
                return Ok(hybrid(format!(
                    "the whole model with {experts} experts needs {} of VRAM, over the budget of {}",
                    format_bytes(need),
                    format_bytes(budget)
                )));
            }
            let why = format!(
                "auto: the whole model with {experts} experts ({}) fits the VRAM budget of {} on CUDA device {ordinal}",
                format_bytes(need),
                format_bytes(budget)
            );
            let fallback = hybrid("the GPU could not take the whole model".into());
            Ok(DeviceChoice { hybrid_fallback: Some(Box::new(fallback)), ..choice(DevicePath::Gpu, whole, why) })
        }
    }
}

/// Option combinations no device takes.
fn check_options(config: &EngineConfig) -> Result<()> {
    if let Some(plan) = &config.gpu.cache {
        if config.device != DevicePolicy::Hybrid || config.gpu_expert_width == WeightBits::Bf16 {
            return Err(ModelError::Invalid(format!(
                "`GpuOptions::cache` {} needs `DevicePolicy::Hybrid` and `EngineConfig::gpu_expert_width` auto, 4 or 8",
                plan.strategy.name()
            )));
        }
    }
    if config.device == DevicePolicy::Cpu
        && (config.gpu.expert_bits.is_some() || config.gpu_expert_width.int_bits().is_some())
    {
        return Err(ModelError::Invalid(
            "`EngineConfig::gpu_expert_width` applies to the routed experts on the GPU (`DevicePolicy::Gpu`: resident; `DevicePolicy::Hybrid`: streamed for long prefills); with `DevicePolicy::Cpu` they run on the CPU at `EngineOptions::expert_bits`".into(),
        ));
    }
    if config.device == DevicePolicy::Hybrid
        && config.gpu.expert_bits.is_some()
        && crate::placement::precision::expert_width_rule(config.cpu.expert_bits).is_none()
    {
        return Err(ModelError::Invalid(
            "`DevicePolicy::Hybrid` with `EngineConfig::gpu_expert_width` streams the routed experts to the GPU for long prefills while the CPU decodes from its expert cache: give `EngineOptions::expert_bits` 4|8 too".into(),
        ));
    }
    let streams =
        config.gpu.expert_bits.is_some() && matches!(config.device, DevicePolicy::Hybrid | DevicePolicy::Auto);
    if config.gpu.stream_from != super::StreamFrom::CpuCache && !streams {
        return Err(ModelError::Invalid(
            "`GpuOptions::stream_from` applies when a hybrid prefill streams the experts: `DevicePolicy::Hybrid` (or auto) with `EngineConfig::gpu_expert_width` 4|8".into(),
        ));
    }
    Ok(())
}

/// The whole-model GPU engine's defaults on top of `config`: the routed experts resident at
/// [`crate::placement::precision::default_gpu_expert_bits`] unless a GPU width was given, a
/// 4-bit float checkpoint's kept in its format ([`crate::placement::precision::native_fp4`]).
pub fn whole_gpu_defaults(spec: &ModelSpec, config: &EngineConfig) -> EngineConfig {
    let mut cfg = config.clone();
    if cfg.gpu_expert_width == WeightBits::Auto && cfg.gpu.expert_bits.is_none() {
        cfg.gpu.expert_bits = Some(crate::placement::precision::default_gpu_expert_bits(spec));
        cfg.gpu.expert_fp4 = crate::placement::precision::native_fp4(spec);
    }
    cfg
}

/// The hybrid engine's defaults on top of `config` (its CPU expert width already resolved):
/// prefill streaming the CPU experts' records at their own width unless a GPU width was given,
/// and the leftover VRAM pinning experts (ranked by `heatmap` when there is one) unless a cache
/// strategy was given or pinning is off.
pub fn hybrid_defaults(spec: &ModelSpec, config: &EngineConfig, heatmap: Option<PathBuf>) -> EngineConfig {
    let mut cfg = config.clone();
    // Experts the hybrid's GPU side does not run (gpt-oss's biased experts): all on the CPU, none
    // streamed or pinned.
    if crate::gpu::check_hybrid_gpu_experts(spec).is_err() {
        cfg.gpu.expert_bits = None;
        cfg.gpu_expert_width = WeightBits::Auto;
        cfg.gpu.cache = None;
        return cfg;
    }
    if cfg.gpu_expert_width == WeightBits::Auto && cfg.gpu.expert_bits.is_none() {
        cfg.gpu.expert_bits = crate::placement::precision::default_stream_bits(spec, cfg.cpu.expert_bits);
        // The CPU keeps a 4-bit float checkpoint's format at `auto`: so does the GPU's stream.
        if cfg.cpu.expert_bits == WeightBits::Auto && cfg.gpu.expert_bits.is_some() {
            cfg.gpu.expert_fp4 = crate::placement::precision::native_fp4(spec);
        }
    }
    if cfg.pin_leftover_vram && cfg.gpu.cache.is_none() && cfg.gpu.expert_bits.is_some() && spec.moe.is_some() {
        cfg.gpu.cache = Some(super::CachePlan { strategy: super::CacheStrategy::HotCachedStatic, heatmap, vram: None });
    }
    cfg
}

/// How a GPU expert width (and a 4-bit float format kept as stored) reads in the start line.
pub fn gpu_width_name(bits: Option<krasis_quant::Bits>, fp4: Option<krasis_quant::fp4::Fp4Kind>) -> String {
    match (bits, fp4) {
        (Some(_), Some(kind)) => format!("{} (as stored)", kind.name().to_uppercase()),
        (Some(krasis_quant::Bits::Int4), None) => "INT4".into(),
        (Some(krasis_quant::Bits::Int8), None) => "INT8".into(),
        (None, _) => "BF16".into(),
    }
}

/// How a CPU expert width reads in the start line.
fn cpu_width_name(spec: &ModelSpec, bits: WeightBits) -> String {
    match bits {
        WeightBits::Int8 => "INT8".to_string(),
        WeightBits::Auto => crate::placement::precision::describe_expert_bits(spec, WeightBits::Auto),
        WeightBits::Bf16 => "BF16 (reference)".to_string(),
        WeightBits::Int4 => "INT4".to_string(),
        WeightBits::Int4Asym => "INT4 asymmetric g32".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth::{preset_config, Preset};

    fn spec() -> ModelSpec {
        let text = preset_config(Preset::Tiny, None).to_string();
        crate::arch::parse_config(&text, std::path::Path::new("config.json")).unwrap()
    }

    fn config(device: DevicePolicy) -> EngineConfig {
        let mut c = EngineConfig { device, ..EngineConfig::default() };
        c.cpu.expert_bits = WeightBits::Int4;
        c
    }

    const BIG: GpuFound = GpuFound::Usable { budget: 1 << 40 };

    #[test]
    fn auto_takes_the_cpu_without_a_gpu_and_says_why() {
        let c = choose_device(
            &spec(),
            &config(DevicePolicy::Auto),
            false,
            false,
            &GpuFound::Absent("no driver".into()),
            None,
        )
        .unwrap();
        assert_eq!(c.path, DevicePath::Cpu);
        assert!(c.why.contains("no GPU in use: no driver"), "{}", c.why);
    }

    /// gpt-oss (sinks, windows, a biased router, biased experts with the clamped SwiGLU): the
    /// whole-GPU engine takes it (`auto` with room for it); the hybrid engine keeps its routed
    /// experts on the CPU (its GPU experts take no biases): no streaming or pinning by default
    /// (auto's fallback, `auto` without the room, an explicit hybrid), and asking for them is an
    /// error.
    #[test]
    fn gpt_oss_runs_whole_on_the_gpu_or_hybrid_with_the_experts_on_the_cpu() {
        let text = preset_config(Preset::GptOss120b, Some(2)).to_string();
        let s = crate::arch::parse_config(&text, std::path::Path::new("config.json")).unwrap();
        let no_gpu_experts = |c: &EngineConfig| c.gpu.expert_bits.is_none() && c.gpu.cache.is_none();
        let c = choose_device(&s, &config(DevicePolicy::Auto), false, false, &BIG, None).unwrap();
        assert_eq!(c.path, DevicePath::Gpu, "{}", c.why);
        let fallback = c.hybrid_fallback.expect("a hybrid fallback");
        assert!(fallback.path == DevicePath::Hybrid && no_gpu_experts(&fallback.config));
        let c = choose_device(&s, &config(DevicePolicy::Gpu), false, false, &BIG, None).unwrap();
        assert_eq!(c.path, DevicePath::Gpu);
        let c = choose_device(&s, &config(DevicePolicy::Hybrid), false, false, &BIG, None).unwrap();
        assert!(c.path == DevicePath::Hybrid && no_gpu_experts(&c.config), "{:?}", c.config.gpu);
        let small = GpuFound::Usable { budget: 1 << 20 };
        let c = choose_device(&s, &config(DevicePolicy::Auto), false, false, &small, None).unwrap();
        assert!(c.path == DevicePath::Hybrid && no_gpu_experts(&c.config), "{}", c.why);
        let mut streams = config(DevicePolicy::Hybrid);
        streams.gpu.expert_bits = Some(krasis_quant::Bits::Int4);
        streams.cpu.expert_bits = WeightBits::Int4;
        let e = choose_device(&s, &streams, true, false, &BIG, None).unwrap_err().to_string();
        assert!(e.contains("hybrid engine's GPU experts") && e.contains("clamped SwiGLU"), "{e}");
        let c = choose_device(&s, &config(DevicePolicy::Cpu), false, false, &BIG, None).unwrap();
        assert_eq!(c.path, DevicePath::Cpu);
    }

    #[test]
    fn auto_puts_the_whole_model_on_the_gpu_at_the_default_width_when_it_fits() {
        let c = choose_device(&spec(), &config(DevicePolicy::Auto), false, false, &BIG, None).unwrap();
        assert_eq!(c.path, DevicePath::Gpu);
        assert_eq!(c.config.gpu.expert_bits, Some(krasis_quant::Bits::Int4));
        assert!(c.why.contains("INT4 experts") && c.why.contains("fits"), "{}", c.why);
        let fallback = c.hybrid_fallback.expect("a hybrid fallback");
        assert_eq!(fallback.path, DevicePath::Hybrid);
    }

    #[test]
    fn auto_takes_hybrid_with_pins_when_the_whole_model_does_not_fit() {
        let tiny = GpuFound::Usable { budget: 1 << 20 };
        let heat = Some(PathBuf::from("/cache/heatmap.json"));
        let c = choose_device(&spec(), &config(DevicePolicy::Auto), false, false, &tiny, heat.clone()).unwrap();
        assert_eq!(c.path, DevicePath::Hybrid);
        assert!(c.why.contains("over the budget"), "{}", c.why);
        assert_eq!(c.config.gpu.expert_bits, Some(krasis_quant::Bits::Int4), "prefill streams at the CPU width");
        let plan = c.config.gpu.cache.expect("pins by default");
        assert_eq!((plan.strategy, plan.heatmap), (super::super::CacheStrategy::HotCachedStatic, heat));
        // A CPU width asked for keeps the experts on the CPU however big the GPU.
        let c = choose_device(&spec(), &config(DevicePolicy::Auto), true, true, &BIG, None).unwrap();
        assert_eq!(c.path, DevicePath::Hybrid);
        assert!(c.why.contains("was asked for"), "{}", c.why);
    }

    #[test]
    fn explicit_devices_do_as_told_and_refuse_what_they_cannot_take() {
        let absent = GpuFound::Absent("no driver".into());
        assert_eq!(
            choose_device(&spec(), &config(DevicePolicy::Cpu), true, true, &absent, None).unwrap().path,
            DevicePath::Cpu
        );
        let e = choose_device(&spec(), &config(DevicePolicy::Gpu), false, false, &absent, None).unwrap_err();
        assert!(e.to_string().contains("no driver"), "{e}");
        // The CPU expert width resolved from `auto` is not asking for the CPU path.
        let c = choose_device(&spec(), &config(DevicePolicy::Gpu), false, false, &BIG, None).unwrap();
        assert_eq!((c.path, c.config.gpu.expert_bits), (DevicePath::Gpu, Some(krasis_quant::Bits::Int4)));
        let mut gpu = config(DevicePolicy::Gpu);
        gpu.cpu.dense_bits = WeightBits::Int8;
        let e = choose_device(&spec(), &gpu, false, true, &BIG, None).unwrap_err();
        assert!(e.to_string().contains("`EngineOptions::dense_bits`"), "{e}");
        let mut cpu = config(DevicePolicy::Cpu);
        cpu.gpu_expert_width = WeightBits::Int4;
        let e = choose_device(&spec(), &cpu, true, true, &absent, None).unwrap_err();
        assert!(e.to_string().contains("`EngineConfig::gpu_expert_width`"), "{e}");
        let mut cached = config(DevicePolicy::Auto);
        cached.gpu.cache =
            Some(super::super::CachePlan { strategy: super::super::CacheStrategy::Lru, heatmap: None, vram: None });
        let e = choose_device(&spec(), &cached, true, true, &BIG, None).unwrap_err();
        assert!(e.to_string().contains("`GpuOptions::cache` lru needs `DevicePolicy::Hybrid`"), "{e}");
        let mut off = config(DevicePolicy::Hybrid);
        off.pin_leftover_vram = false;
        let c = choose_device(&spec(), &off, true, true, &BIG, None).unwrap();
        assert!(c.config.gpu.cache.is_none(), "pinning off");
    }
}
