//! What an engine is opened with: the device policy, the CPU and GPU options and the budgets.

use crate::cpu::load::EngineOptions;
use crate::cpu::quantized::WeightBits;
use crate::gpu::GpuOptions;

/// Where the model should run (`--device`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DevicePolicy {
    /// The CPU engine.
    Cpu,
    /// The whole model on the GPU.
    Gpu,
    /// Routed experts on the CPU, everything else on the GPU.
    Hybrid,
    /// Without a usable GPU the CPU; with one, the whole model on it when it fits the VRAM
    /// budget, else hybrid (routed experts on the CPU).
    #[default]
    Auto,
}

/// The device path an engine was opened on (what [`DevicePolicy::Auto`] resolved to).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DevicePath {
    Cpu,
    Gpu,
    Hybrid,
}

impl DevicePath {
    /// The name `--device` uses.
    pub fn name(self) -> &'static str {
        match self {
            DevicePath::Cpu => "cpu",
            DevicePath::Gpu => "gpu",
            DevicePath::Hybrid => "hybrid",
        }
    }
}

impl std::fmt::Display for DevicePath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Everything [`open_engine`](super::open_engine) needs besides the model files.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    pub device: DevicePolicy,
    /// The CPU engine's precisions, cache and threads.
    pub cpu: EngineOptions,
    /// The GPU's ordinal, VRAM budget, KV cache and per-linear precisions.
    pub gpu: GpuOptions,
    /// The routed experts' width on the GPU paths: the whole-model GPU's resident experts, and
    /// the width a hybrid prefill streams them at.
    /// - [`WeightBits::Auto`]: the default ([`crate::placement::precision::default_gpu_expert_bits`]; hybrid:
    ///   the CPU experts' width), unless [`GpuOptions::expert_bits`] is set, which is then taken
    ///   as asked.
    /// - [`WeightBits::Bf16`]: BF16 resident experts; a hybrid prefill keeps the experts on the
    ///   CPU.
    /// - [`WeightBits::Int8`], [`WeightBits::Int4`]: that width.
    pub gpu_expert_width: WeightBits,
    /// Hybrid: keep experts pinned in the VRAM the weights, the KV cache and the prefill reserve
    /// leave, when no cache strategy is given ([`super::open_engine`]'s defaults).
    pub pin_leftover_vram: bool,
    /// Tokens of context the RAM estimate of the CPU path assumes.
    pub context_tokens: u64,
    /// Load even when the RAM estimate exceeds the budget (a warning instead of an error).
    pub force: bool,
    /// Count every MoE layer's routes ([`super::Engine::expert_counts`], `--heatmap-out`).
    pub record_heatmap: bool,
    /// Under the `auto` policy, take the choice a tuning run saved for this model and GPU
    /// ([`crate::placement::tune`]) when there is one.
    pub use_saved_tune: bool,
}

/// Context the RAM estimate assumes unless told otherwise.
pub const DEFAULT_CONTEXT_TOKENS: u64 = 4096;

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            device: DevicePolicy::Auto,
            cpu: EngineOptions {
                expert_bits: WeightBits::Auto,
                dense_bits: WeightBits::Auto,
                ..EngineOptions::default()
            },
            gpu: GpuOptions::default(),
            gpu_expert_width: WeightBits::Auto,
            pin_leftover_vram: true,
            context_tokens: DEFAULT_CONTEXT_TOKENS,
            force: false,
            record_heatmap: false,
            use_saved_tune: true,
        }
    }
}

impl EngineConfig {
    /// Whether a CPU-only precision (quantised experts or dense weights) was asked for: the
    /// whole-model GPU path does not take those. `--cpu-expert-bits auto` (the default) is not
    /// asking: it applies only where experts run on the CPU.
    pub fn wants_cpu_precisions(&self) -> bool {
        !matches!(self.cpu.expert_bits, WeightBits::Bf16 | WeightBits::Auto)
            || !matches!(self.cpu.dense_bits, WeightBits::Bf16 | WeightBits::Auto)
    }
}
