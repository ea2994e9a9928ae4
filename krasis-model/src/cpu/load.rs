//! Loading a model for a chosen precision: the reference path, or quantised experts from the
//! expert cache (built on first use) and optionally quantised dense weights, on a pinned pool.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use krasis_cache::CacheOutcome;
use krasis_cpu::pool::{PoolPlan, WorkerPool};
use krasis_quant::group::DEFAULT_GROUP_SIZE;

use crate::cpu::dense_cache::{cached_linears, open_dense_cache};
use crate::cpu::experts::ExpertExecutor;
use crate::cpu::quantized::{dense_quant_bits, open_expert_cache, CpuQuantExperts, QuantLinear, WeightBits};
use crate::cpu::{reference_dense, Model, PrebuiltDense};
use crate::error::{ModelError, Result};
use crate::model::linear::{DenseLinear, LinearOp};
use crate::placement::precision::{expert_width_rule, resolve_expert_bits, ExpertWidthRule};
use crate::source::files::ModelFiles;

#[derive(Clone, Debug)]
pub struct EngineOptions {
    /// `--cpu-expert-bits`. `Auto` (the CLI's default) is decided per projection from a GGUF's
    /// types and means `Bf16` on safetensors (see [`crate::placement::precision`]): [`load_model`] and
    /// `open_engine` resolve it; a loader handed it unresolved builds an INT4 cache there.
    pub expert_bits: WeightBits,
    pub dense_bits: WeightBits,
    /// Preferred quantisation group along K (halved while a dimension is not divisible, ≥ 32).
    pub group_size: usize,
    pub cache_dir: Option<PathBuf>,
    /// Worker threads (default: one per physical core).
    pub threads: Option<usize>,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            expert_bits: WeightBits::Bf16,
            dense_bits: WeightBits::Bf16,
            group_size: DEFAULT_GROUP_SIZE,
            cache_dir: None,
            threads: None,
        }
    }
}

/// A loaded model and what loading did, for logs and benchmarks.
pub struct Loaded {
    pub model: Model,
    /// Human-readable lines: pool, cache hit/build and its load speed, huge pages, NUMA.
    pub log: Vec<String>,
    /// Bytes of one routed expert as executed (for bytes-per-token arithmetic).
    pub expert_bytes: u64,
    pub pool: Option<Arc<WorkerPool>>,
}

fn make_pool(threads: Option<usize>) -> Result<Arc<WorkerPool>> {
    let plan = PoolPlan::from_system(&krasis_core::hw::probe(), threads);
    WorkerPool::new(plan).map(Arc::new).map_err(|e| ModelError::Invalid(format!("starting the worker pool: {e}")))
}

/// The quantised routed experts of every MoE layer on the pinned pool, from the expert cache
/// (built on first use).
pub struct CpuExperts {
    pub executor: Arc<CpuQuantExperts>,
    /// Bytes of one routed expert as executed.
    pub expert_bytes: u64,
}

/// Starts a worker pool (logged). The engine that gets it runs its CPU kernels on it: the
/// quantised ops hold it, and the CPU engine's forward calls run the dense ops on it
/// ([`Model::set_pool`]).
pub fn start_pool(threads: Option<usize>, log: &mut Vec<String>) -> Result<Arc<WorkerPool>> {
    let p = make_pool(threads)?;
    log.push(format!(
        "worker pool: {}; kernels: {}",
        p.describe(),
        krasis_cpu::quant::describe_kernels(krasis_cpu::isa::active())
    ));
    Ok(p)
}

/// Opens (or builds) the expert cache at the widths `bits` gives each layer and puts the experts
/// on `pool`.
pub fn open_cpu_experts(
    files: &ModelFiles,
    bits: ExpertWidthRule,
    opts: &EngineOptions,
    pool: &Arc<WorkerPool>,
    log: &mut Vec<String>,
) -> Result<CpuExperts> {
    let t = Instant::now();
    let (cache, outcome) = open_expert_cache(files, bits, opts.group_size, opts.cache_dir.as_deref(), pool)?;
    match &outcome {
        CacheOutcome::Hit => log.push(format!("expert cache hit: {}", cache.path().display())),
        CacheOutcome::Built { reason } => {
            log.push(format!("expert cache built ({reason}): {}", cache.path().display()))
        }
    }
    log.push(format!("{} ({:.2} s)", krasis_cache::describe(&cache), t.elapsed().as_secs_f64()));
    let mut ex = CpuQuantExperts::new(cache, files.spec(), pool.clone())?;
    ex.load_biases(files)?;
    Ok(CpuExperts { expert_bytes: ex.expert_bytes(), executor: Arc::new(ex) })
}

/// Opens (or builds) the dense-weight cache for `bits` and serves its entries as the engine's
/// quantised linears.
fn open_cached_dense(
    files: &ModelFiles,
    bits: krasis_quant::Bits,
    opts: &EngineOptions,
    pool: &Arc<WorkerPool>,
    log: &mut Vec<String>,
) -> Result<Box<dyn PrebuiltDense>> {
    let t = Instant::now();
    let (cache, outcome) = open_dense_cache(files, bits, opts.group_size, opts.cache_dir.as_deref())?;
    match &outcome {
        CacheOutcome::Hit => log.push(format!("dense-weight cache hit: {}", cache.path().display())),
        CacheOutcome::Built { reason } => {
            log.push(format!("dense-weight cache built ({reason}): {}", cache.path().display()))
        }
    }
    log.push(format!("{} ({:.2} s)", krasis_cache::describe_dense(&cache), t.elapsed().as_secs_f64()));
    Ok(Box::new(cached_linears(Arc::new(cache), bits, pool.clone())))
}

/// Loads `files` for the CPU engine at the precisions of `opts` (the expert cache is opened, or
/// built on first use, when the experts are quantised).
pub fn load_model(files: &ModelFiles, opts: &EngineOptions) -> Result<Loaded> {
    let spec = files.spec().clone();
    let mut log = Vec::new();
    let expert_bits = resolve_expert_bits(&spec, opts.expert_bits);
    let dense_bits = dense_quant_bits(opts.dense_bits)?;
    let quantised = expert_bits != WeightBits::Bf16 || dense_bits.is_some();
    let pool = if quantised { Some(start_pool(opts.threads, &mut log)?) } else { None };
    let moe_per_expert = spec.moe.as_ref().map_or(0, |m| {
        crate::cpu::memory::stored_bytes(WeightBits::Bf16, 3 * m.moe_intermediate_size as u64 * spec.hidden_size as u64)
    });
    let rule = expert_width_rule(expert_bits);
    let (experts, expert_bytes): (Option<Arc<dyn ExpertExecutor>>, u64) = match (rule, &pool) {
        (Some(bits), Some(pool)) if spec.moe.is_some() => {
            let ex = open_cpu_experts(files, bits, opts, pool, &mut log)?;
            (Some(ex.executor as Arc<dyn ExpertExecutor>), ex.expert_bytes)
        }
        _ => (None, moe_per_expert),
    };
    let group = opts.group_size;
    let quant_dense = |l: DenseLinear, name: &str| -> Result<Box<dyn LinearOp>> {
        match (dense_bits, &pool) {
            (Some(bits), Some(pool)) => Ok(Box::new(QuantLinear::from_dense(&l, bits, group, pool.clone(), name)?)),
            _ => reference_dense(l, name),
        }
    };
    let cached = match (dense_bits, &pool) {
        (Some(bits), Some(pool)) => Some(open_cached_dense(files, bits, opts, pool, &mut log)?),
        _ => None,
    };
    let mut model = Model::from_source_with(spec, files.weights(), &quant_dense, cached.as_deref(), experts)?;
    if let Some(pool) = &pool {
        model.set_pool(pool.clone());
    }
    // Everything the engine keeps from the source is copied (norms, routers), quantised, read
    // from the file a row at a time (the embedding), or read whole through the mapping on use
    // (dense weights and experts left as stored), so the pages the load touched (quantising,
    // building the expert cache) leave the resident set.
    files.weights().release_resident();
    log.push(format!("routed experts: {}", model.experts_description()));
    Ok(Loaded { model, log, expert_bytes, pool })
}
