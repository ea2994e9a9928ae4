//! `krasis convert`: build (or check) the CPU expert cache, and with `--cpu-dense-bits` the
//! dense-weight cache, ahead of the first run.

use std::path::PathBuf;
use std::time::Instant;

use clap::{Args as ClapArgs, ValueEnum};
use krasis_cache::CacheOutcome;
use krasis_core::budget::format_bytes;
use krasis_cpu::pool::{PoolPlan, WorkerPool};
use krasis_model::dense_cache::open_dense_cache;
use krasis_model::files::ModelFiles;
use krasis_model::precision::{describe_layer_bits, CacheBits as Widths};
use krasis_model::quantized::open_expert_cache;
use krasis_model::tensors::param_counts;
use krasis_quant::Bits;

use crate::cmd_generate::check_group_size_flag;

/// The widths an expert cache holds (bf16 experts are read from the model and need none).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum CacheBits {
    Auto,
    #[value(name = "4")]
    Int4,
    #[value(name = "8")]
    Int8,
}

/// The width of the dense-weight cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum DenseBits {
    #[value(name = "4")]
    Int4,
    #[value(name = "8")]
    Int8,
}

#[derive(ClapArgs)]
pub struct Args {
    /// Model directory or GGUF file.
    #[arg(long)]
    model: PathBuf,
    /// INT4 or INT8 routed experts, or auto: per projection from a GGUF's types (INT4 from 4-bit or
    /// narrower, INT8 from 5/6/8-bit and float); INT4 for a safetensors model.
    #[arg(long, value_enum, default_value_t = CacheBits::Auto)]
    cpu_expert_bits: CacheBits,
    /// Also build the dense-weight cache for `--cpu-dense-bits 8|4` (attention, shared experts,
    /// dense MLPs, LM head), so a cached start quantises nothing.
    #[arg(long, value_enum)]
    cpu_dense_bits: Option<DenseBits>,
    /// Quantisation group along K (halved while a dimension is not divisible, down to 32).
    #[arg(long, default_value_t = 128)]
    group_size: usize,
    /// Where the cache goes (default: `<model>/.krasis_cache`, else a per-user cache dir).
    #[arg(long)]
    cache_dir: Option<PathBuf>,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let bits = match a.cpu_expert_bits {
        CacheBits::Auto => Widths::Auto,
        CacheBits::Int4 => Widths::Uniform(Bits::Int4),
        CacheBits::Int8 => Widths::Uniform(Bits::Int8),
    };
    check_group_size_flag(a.group_size)?;
    let files = ModelFiles::open(&a.model)?;
    eprintln!("routed experts: {}", describe_layer_bits(&bits.layer_bits(files.spec())));
    let pool = WorkerPool::new(PoolPlan::from_system(&krasis_core::hw::probe(), None))?;
    let source_bytes = param_counts(files.spec()).routed_expert * 2;
    let t = Instant::now();
    let (cache, outcome) = open_expert_cache(&files, bits, a.group_size, a.cache_dir.as_deref(), &pool)?;
    let total = t.elapsed().as_secs_f64();
    let load = cache.load_report().seconds;
    match outcome {
        CacheOutcome::Hit => eprintln!("expert cache up to date: {}", cache.path().display()),
        CacheOutcome::Built { reason } => {
            let build = (total - load).max(1e-9);
            eprintln!(
                "converted {} of source expert weights in {:.1} s ({:.2} GB/s of source; {reason})",
                format_bytes(source_bytes),
                build,
                source_bytes as f64 / 1e9 / build
            );
        }
    }
    eprintln!("{}", krasis_cache::describe(&cache));
    drop(cache);
    if let Some(dense) = a.cpu_dense_bits {
        let dense = match dense {
            DenseBits::Int4 => Bits::Int4,
            DenseBits::Int8 => Bits::Int8,
        };
        let (cache, outcome) = open_dense_cache(&files, dense, a.group_size, a.cache_dir.as_deref())?;
        match outcome {
            CacheOutcome::Hit => eprintln!("dense-weight cache up to date: {}", cache.path().display()),
            CacheOutcome::Built { reason } => eprintln!("dense-weight cache built ({reason})"),
        }
        eprintln!("{}", krasis_cache::describe_dense(&cache));
    }
    Ok(())
}
