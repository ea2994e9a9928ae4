//! `krasis convert`: build (or check) the CPU expert cache ahead of the first run.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::bail;
use clap::Args as ClapArgs;
use krasis_cache::CacheOutcome;
use krasis_core::budget::format_bytes;
use krasis_cpu::pool::{PoolPlan, WorkerPool};
use krasis_model::files::ModelFiles;
use krasis_model::quantized::open_expert_cache;
use krasis_model::tensors::param_counts;

use krasis_model::quantized::{quant_bits, WeightBits};

use crate::cmd_generate::{check_group_size_flag, weight_bits_parser};

#[derive(ClapArgs)]
pub struct Args {
    /// Model directory.
    #[arg(long)]
    model: PathBuf,
    /// 4 or 8.
    #[arg(long, default_value = "4", value_parser = weight_bits_parser(&["4", "8"]))]
    cpu_expert_bits: WeightBits,
    /// Quantisation group along K (halved while a dimension is not divisible, down to 32).
    #[arg(long, default_value_t = 128)]
    group_size: usize,
    /// Where the cache goes (default: <model>/.krasis_cache, else a per-user cache dir).
    #[arg(long)]
    cache_dir: Option<PathBuf>,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let Some(bits) = quant_bits(a.cpu_expert_bits) else {
        bail!("--cpu-expert-bits bf16 needs no conversion; choose 4 or 8");
    };
    check_group_size_flag(a.group_size)?;
    let files = ModelFiles::open(&a.model)?;
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
    Ok(())
}
