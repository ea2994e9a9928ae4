//! `krasis convert`: build (or check) the CPU expert cache, with `--gpu-expert-bits` the GPU
//! expert cache (both in one pass over the source weights), and with `--cpu-dense-bits` the
//! dense-weight cache, ahead of the first run.

use std::path::PathBuf;

use clap::builder::{PossibleValuesParser, TypedValueParser};
use clap::Args as ClapArgs;
use krasis_cache::CacheOutcome;
use krasis_core::budget::format_bytes;
use krasis_model::cpu::dense_cache::open_dense_cache;
use krasis_model::cpu::quantized::WeightBits;
use krasis_model::gpu::expert_cache::{open_gpu_expert_cache, GpuCachePlan};
use krasis_model::model::tensors::param_counts;
use krasis_model::placement::precision::{
    default_gpu_expert_bits, describe_layer_bits, expert_width_rule, int4a_by_default, native_fp4, quant_width,
    ExpertWidthRule,
};
use krasis_model::runtime::expert_caches::{convert_expert_caches, CacheRequest};
use krasis_model::runtime::{device_choice, EngineConfig};
use krasis_model::source::files::ModelFiles;
use krasis_quant::fp4::Fp4Kind;

use crate::cmd_generate::{check_group_size_flag, weight_bits_parser};

/// The values `--cpu-dense-bits` takes here: the widths a cache holds.
const CACHE_WIDTHS: [&str; 2] = ["4", "8"];

/// The values `--gpu-expert-bits` takes here: a width a cache holds, or `auto`.
const GPU_CACHE_WIDTHS: [&str; 3] = ["auto", "4", "8"];

/// `--cpu-expert-bits`: a width a cache holds, `auto`, or `none` (no CPU expert cache: `None`;
/// the bf16 reference experts read the model and need none, so `bf16` is not offered).
fn cpu_expert_bits_parser() -> impl TypedValueParser<Value = Option<WeightBits>> {
    PossibleValuesParser::new(["auto", "4", "4a", "8", "none"])
        .map(|s| (s != "none").then(|| s.parse::<WeightBits>().expect("every listed value parses")))
}

#[derive(ClapArgs)]
pub struct Args {
    /// Model directory or GGUF file.
    #[arg(long)]
    model: PathBuf,
    /// INT4, asymmetric INT4 g32 (4a) or INT8 routed experts, or auto: the width `krasis generate`
    /// at its defaults runs: per projection from a GGUF's types (INT4 from 4-bit or narrower, INT8
    /// from 5/6/8-bit and float; a GGUF of Q4_K/Q6_K/Q5_0/Q8_0 experts is kept exactly); a 4-bit
    /// float checkpoint's (NVFP4, MXFP4) experts as stored; else asymmetric INT4 g32 when it fits
    /// the RAM limit (INT4 g128 otherwise); none: no CPU expert cache (with --gpu-expert-bits, the
    /// GPU one alone).
    // `::std::option::Option` keeps clap from treating the flag as optional: `none` is a value.
    #[arg(long, default_value = "auto", value_parser = cpu_expert_bits_parser())]
    cpu_expert_bits: ::std::option::Option<WeightBits>,
    /// Also build the GPU expert cache for `--gpu-expert-bits 4|8` (the experts in the GPU tile
    /// layout: resident with `--device gpu`, streamed for long prefills with `--device hybrid
    /// --stream-experts-from gpu-cache`), in the same pass over the source weights as the CPU
    /// expert cache; auto: the one the GPU engine's defaults read (a 4-bit float checkpoint's
    /// experts as stored, MXFP4 or NVFP4; else INT4, or INT8 from 8-bit sources).
    #[arg(long, value_parser = weight_bits_parser(&GPU_CACHE_WIDTHS))]
    gpu_expert_bits: Option<WeightBits>,
    /// Also build the dense-weight cache for `--cpu-dense-bits 8|4` (attention, shared experts,
    /// dense MLPs, LM head), so a cached start quantises nothing.
    #[arg(long, value_parser = weight_bits_parser(&CACHE_WIDTHS))]
    cpu_dense_bits: Option<WeightBits>,
    /// Quantisation group along K (halved while a dimension is not divisible, down to 32).
    #[arg(long, default_value_t = 128)]
    group_size: usize,
    /// Where the cache goes (default: `<model>/.krasis_cache`, else a per-user cache dir).
    #[arg(long)]
    cache_dir: Option<PathBuf>,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let bits = a.cpu_expert_bits.and_then(expert_width_rule);
    if bits.is_none() && a.gpu_expert_bits.is_none() && a.cpu_dense_bits.is_none() {
        anyhow::bail!("--cpu-expert-bits none leaves nothing to build: add --gpu-expert-bits or --cpu-dense-bits");
    }
    check_group_size_flag(a.group_size)?;
    let files = ModelFiles::open(&a.model)?;
    // `--gpu-expert-bits auto` on a 4-bit float checkpoint: the GPU cache of its experts as
    // stored, built on its own (nothing to requantise); elsewhere the default GPU width.
    let gpu = match (a.gpu_expert_bits, native_fp4(files.spec())) {
        (Some(WeightBits::Auto), Some(kind)) if files.spec().moe.is_some() => {
            build_gpu_fp4_cache(&files, kind, &a)?;
            None
        }
        (Some(WeightBits::Auto), _) => Some(default_gpu_expert_bits(files.spec())),
        (w, _) => w.and_then(quant_width),
    };
    // `auto` on a checkpoint of float experts: the width the first `generate` at its defaults
    // runs the CPU experts at (asymmetric INT4 g32 when it fits the RAM limit).
    let bits = match bits {
        Some(ExpertWidthRule::Auto) if int4a_by_default(files.spec()) => Some(auto_cpu_width(&files, &a)?),
        b => b,
    };
    // A 4-bit float checkpoint, or a GGUF of K-quant experts, at `auto`, or asymmetric INT4: its
    // CPU expert cache holds its own layout, built on its own (nothing to share with the GPU
    // cache's pass).
    let kept = krasis_model::placement::precision::ggml_kept(files.spec()).is_some();
    let bits = match (bits, native_fp4(files.spec())) {
        (Some(rule @ (ExpertWidthRule::Auto | ExpertWidthRule::Int4Asym)), kind)
            if files.spec().moe.is_some() && (kind.is_some() || kept || rule == ExpertWidthRule::Int4Asym) =>
        {
            let asked = if rule == ExpertWidthRule::Int4Asym { WeightBits::Int4Asym } else { WeightBits::Auto };
            eprintln!(
                "routed experts on the CPU: {}",
                krasis_model::placement::precision::describe_expert_bits(files.spec(), asked)
            );
            let mut log = Vec::new();
            let opts = krasis_model::cpu::load::EngineOptions {
                group_size: a.group_size,
                cache_dir: a.cache_dir.clone(),
                ..Default::default()
            };
            let pool = krasis_model::cpu::load::start_pool(None, &mut log)?;
            let ex = krasis_model::cpu::load::open_cpu_experts(&files, rule, &opts, &pool, &mut log)?;
            drop(ex);
            for line in log {
                eprintln!("{line}");
            }
            None
        }
        (b, _) => b,
    };
    let layer_bits = bits.map(|b| b.layer_bits(files.spec()));
    if let Some(lb) = &layer_bits {
        eprintln!("routed experts on the CPU: {}", describe_layer_bits(lb));
    }
    if let Some(b) = gpu {
        eprintln!("routed experts on the GPU: int{}", b.bits());
    }
    if (layer_bits.is_some() || gpu.is_some()) && files.spec().moe.is_some() {
        let req =
            CacheRequest { cpu: layer_bits.as_deref(), gpu, group: a.group_size, cache_dir: a.cache_dir.as_deref() };
        let report = convert_expert_caches(&files, &req)?;
        if let Some(build) = report.build_seconds {
            let source_bytes = param_counts(files.spec()).routed_expert * 2;
            let reasons: Vec<String> = report
                .caches
                .iter()
                .filter_map(|c| match &c.outcome {
                    CacheOutcome::Built { reason } => Some(format!("the {} expert cache was {reason}", c.kind)),
                    CacheOutcome::Hit => None,
                })
                .collect();
            eprintln!(
                "converted {} of source expert weights in {:.1} s ({:.2} GB/s of source; {})",
                format_bytes(source_bytes),
                build,
                source_bytes as f64 / 1e9 / build.max(1e-9),
                reasons.join("; ")
            );
        }
        for c in &report.caches {
            if c.outcome == CacheOutcome::Hit {
                eprintln!("{} expert cache up to date: {}", c.kind, c.path.display());
            }
            eprintln!("{}", c.description);
        }
    } else if files.spec().moe.is_none() {
        eprintln!("the model has no routed experts: no expert cache to build");
    }
    if let Some(dense) = a.cpu_dense_bits.and_then(quant_width) {
        let (cache, outcome) = open_dense_cache(&files, dense, a.group_size, a.cache_dir.as_deref())?;
        match outcome {
            CacheOutcome::Hit => eprintln!("dense-weight cache up to date: {}", cache.path().display()),
            CacheOutcome::Built { reason } => eprintln!("dense-weight cache built (it was {reason})"),
        }
        eprintln!("{}", krasis_cache::describe_dense(&cache));
    }
    Ok(())
}

/// The GPU expert cache of a 4-bit float checkpoint's experts as stored (what `--device gpu` and
/// the hybrid's stream read at their defaults), built or checked.
fn build_gpu_fp4_cache(files: &ModelFiles, kind: Fp4Kind, a: &Args) -> anyhow::Result<()> {
    eprintln!("routed experts on the GPU: {kind} (as stored)");
    let plan = GpuCachePlan::new(files, krasis_quant::Bits::Int4, Some(kind), a.group_size, a.cache_dir.as_deref())?;
    let started = std::time::Instant::now();
    let (cache, outcome) = open_gpu_expert_cache(files, &plan)?;
    match outcome {
        CacheOutcome::Hit => eprintln!("GPU expert cache up to date: {}", plan.path.display()),
        CacheOutcome::Built { reason } => {
            eprintln!("GPU expert cache built in {:.1} s (it was {reason})", started.elapsed().as_secs_f64())
        }
    }
    eprintln!("{}", krasis_cache::describe(&cache));
    Ok(())
}

/// `--cpu-expert-bits auto` on a checkpoint of float experts: what `krasis generate` at its
/// defaults runs its CPU experts at here ([`device_choice`], on the CPU engine and the hybrid):
/// asymmetric INT4 g32 when the CPU engine's estimate at that width fits the RAM limit, else
/// INT4 g128 (with the note saying why).
fn auto_cpu_width(files: &ModelFiles, a: &Args) -> anyhow::Result<ExpertWidthRule> {
    let mut config = EngineConfig::default();
    config.cpu.group_size = a.group_size;
    config.cpu.cache_dir = a.cache_dir.clone();
    let choice = device_choice(files, &config)?;
    for note in &choice.notes {
        eprintln!("{note}");
    }
    Ok(if choice.config.cpu.expert_bits == WeightBits::Int4Asym {
        ExpertWidthRule::Int4Asym
    } else {
        ExpertWidthRule::Uniform(krasis_quant::Bits::Int4)
    })
}
