//! `krasis synth`: random-weight models of real shapes, written streaming.

use std::path::PathBuf;

use clap::Args as ClapArgs;
use krasis_core::budget::format_bytes;
use krasis_model::synth::{synthesize, Preset, SynthOptions};

#[derive(ClapArgs)]
pub struct Args {
    /// tiny | v2-lite | qwen3-30b-a3b | v3-mini | mixtral-8x7b | glm-4.5-air | qwen3-next-80b |
    /// qwen3.6-35b | minimax-m2 | gpt-oss-120b (MXFP4 experts, fused as OpenAI publishes them)
    #[arg(long, required_unless_present = "config", conflicts_with = "config")]
    preset: Option<Preset>,
    /// A config.json to synthesize instead of a preset (a published one: every dimension as
    /// published, stored as its publisher stores it: BF16, block FP8, compressed-tensors INT4,
    /// ModelOpt NVFP4 or MXFP4; gpt-oss's experts fused).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Keep only the first N layers.
    #[arg(long)]
    layers: Option<usize>,
    /// Seed of the random weights (the same seed writes the same model).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Output directory (must be empty or absent unless --force).
    #[arg(long)]
    out: PathBuf,
    /// Give the routers a preference so some experts are hot (0 = uniform).
    #[arg(long, default_value_t = 0.0)]
    router_skew: f32,
    /// Overwrite a non-empty output directory (its model files, and the caches of the model
    /// there, which would describe other weights).
    #[arg(long)]
    force: bool,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let r = synthesize(&SynthOptions {
        preset: a.preset.unwrap_or(Preset::Tiny),
        config: a.config,
        layers: a.layers,
        seed: a.seed,
        out: a.out,
        router_skew: a.router_skew,
        force: a.force,
    })?;
    for dir in &r.caches_removed {
        eprintln!("removed the caches of the replaced model: {}", dir.display());
    }
    eprintln!(
        "wrote {} ({} tensors, {} shard(s), {}) in {:.1} s ({:.2} GB/s)",
        r.out.display(),
        r.tensors,
        r.shards,
        format_bytes(r.bytes_written),
        r.seconds,
        r.bytes_written as f64 / 1e9 / r.seconds.max(1e-9)
    );
    Ok(())
}
