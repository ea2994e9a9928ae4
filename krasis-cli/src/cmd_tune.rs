//! `krasis tune --model DIR`: each expert residency strategy this build has, measured on this
//! machine — a `--prompt-tokens` (10K) prefill and `--decode-tokens` (64) decode steps, `--runs`
//! (3) times each, every run in a fresh session after the engine's load-time warm-up — then the
//! fastest prefill, and among prefills as fast the fastest decode ([`krasis_model::placement::tune::choose`]).
//! Prints the table and saves it with the choice to `<cache dir>/tune.json`, which `generate`
//! and `serve` take under `--device auto`.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context};
use clap::Args as ClapArgs;
use krasis_model::cpu::quantized::WeightBits;
use krasis_model::runtime::{open_engine, EngineConfig};
use krasis_model::source::files::ModelFiles;
use krasis_model::text::sampling::{Sampler, SamplingParams};

use crate::cmd_bench::median;
use crate::cmd_generate::{Device, EngineArgs, GpuArgs};
use krasis_model::placement::tune::{self as tuned, Row, Strategy, Tuned};

#[derive(ClapArgs)]
pub struct Args {
    /// Model: an HF directory or a GGUF file.
    #[arg(long)]
    model: PathBuf,
    /// Prompt length of each prefill (random ids).
    #[arg(long, default_value_t = 10_240)]
    prompt_tokens: usize,
    /// Decode steps after each prefill.
    #[arg(long, default_value_t = 64)]
    decode_tokens: usize,
    /// Runs of each strategy (the median is kept).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=20))]
    runs: u32,
    /// Measure and print, but do not save the choice.
    #[arg(long)]
    dry_run: bool,
    #[command(flatten)]
    engine: EngineArgs,
    /// GPU flags: --gpu-expert-bits picks the width the GPU strategies use (default 4);
    /// --heatmap-path FILE adds the pinning strategies (hot_cached_static, static_pin,
    /// weighted_pin); --pin-vram sizes every cache strategy's VRAM and adds chunked.
    #[command(flatten)]
    gpu: GpuArgs,
}

/// The strategies to measure ([`tuned::candidates`]), with their configs.
fn candidates(a: &Args, files: &ModelFiles) -> anyhow::Result<Vec<(Strategy, EngineConfig)>> {
    let bits: u8 = match a.gpu.gpu_expert_bits {
        WeightBits::Int8 => 8,
        _ => 4,
    };
    let heatmap = match &a.gpu.heatmap_path {
        Some(h) => Some(std::fs::canonicalize(h).with_context(|| format!("--heatmap-path {}", h.display()))?),
        None => None,
    };
    let strategies = tuned::candidates(files.spec(), bits, a.engine.cpu_expert_bits, heatmap, a.gpu.pin_vram)
        .with_context(|| a.model.display().to_string())?;
    let context = (a.prompt_tokens + a.decode_tokens + 1) as u64;
    strategies
        .into_iter()
        .map(|s| {
            let mut gpu = a.gpu.clone();
            // The candidates set the strategy themselves.
            (gpu.cache_strategy, gpu.heatmap_path, gpu.pin_vram) = (None, None, None);
            gpu.kv_tokens = Some(context as usize);
            let mut c = a.engine.config(Device::Auto, &gpu, context)?;
            tuned::apply_strategy(&s, &mut c)?;
            Ok((s, c))
        })
        .collect()
}

/// Loads `config`, then `runs` × (prefill of `prompt`, `decode` steps) in fresh sessions: the
/// median prefill and decode tok/s and the load seconds.
fn measure(
    files: &ModelFiles,
    config: &EngineConfig,
    prompt: &[u32],
    decode: usize,
    runs: u32,
) -> anyhow::Result<(f64, f64, f64)> {
    let t = Instant::now();
    let opened = open_engine(files, config)?;
    let load_s = t.elapsed().as_secs_f64();
    let engine = opened.engine.as_ref();
    let mut sampler = Sampler::new(SamplingParams::default());
    let (mut prefill, mut dec) = (Vec::new(), Vec::new());
    for _ in 0..runs {
        let mut s = engine.new_session()?;
        let t = Instant::now();
        let mut id = engine.step_one(s.as_mut(), prompt, &mut sampler, false)?.token;
        prefill.push(prompt.len() as f64 / t.elapsed().as_secs_f64());
        let t = Instant::now();
        for _ in 0..decode {
            id = engine.step_one(s.as_mut(), &[id], &mut sampler, false)?.token;
        }
        dec.push(decode as f64 / t.elapsed().as_secs_f64().max(1e-9));
    }
    Ok((median(&prefill), median(&dec), load_s))
}

pub fn run(a: Args) -> anyhow::Result<()> {
    if a.prompt_tokens == 0 || a.decode_tokens == 0 {
        bail!("--prompt-tokens and --decode-tokens must be at least 1");
    }
    let gpu = krasis_gpu::probe_ordinal(a.gpu.gpu)
        .map_err(|e| anyhow::anyhow!("krasis tune compares where the routed experts live on a GPU: {e}"))?;
    let files = ModelFiles::open(&a.model)?;
    let cands = candidates(&a, &files)?;
    let prompt = crate::cmd_bench::random_prompt(files.spec().vocab_size, a.prompt_tokens);
    eprintln!(
        "tuning {} on {} ({} strategies × {} runs of a {}-token prefill and {} decode steps)",
        a.model.display(),
        gpu.name,
        cands.len(),
        a.runs,
        a.prompt_tokens,
        a.decode_tokens
    );
    let mut rows = Vec::new();
    for (strategy, config) in cands {
        eprintln!("  {} …", strategy.name);
        let row = match measure(&files, &config, &prompt, a.decode_tokens, a.runs) {
            Ok((p, d, l)) => {
                Row { strategy, prefill_tok_s: Some(p), decode_tok_s: Some(d), load_s: Some(l), error: None }
            }
            Err(e) => {
                Row { strategy, prefill_tok_s: None, decode_tok_s: None, load_s: None, error: Some(format!("{e:#}")) }
            }
        };
        rows.push(row);
    }
    println!("| strategy | prefill {} tokens, tok/s | decode, tok/s | load, s |", a.prompt_tokens);
    println!("|---|---|---|---|");
    let f = |v: Option<f64>, p: usize| v.map_or("—".to_string(), |v| format!("{v:.p$}"));
    for r in &rows {
        match &r.error {
            None => println!(
                "| {} | {} | {} | {} |",
                r.strategy.name,
                f(r.prefill_tok_s, 0),
                f(r.decode_tok_s, 1),
                f(r.load_s, 1)
            ),
            Some(e) => println!("| {} | not run: {} | | |", r.strategy.name, e.lines().next().unwrap_or("")),
        }
    }
    let Some(best) = tuned::choose(&rows) else { bail!("no strategy ran on this machine (the table says why)") };
    let choice = best.strategy.clone();
    println!(
        "chosen: {} (fastest prefill, then the fastest decode among prefills within {:.0} % of it)",
        choice.name,
        100.0 * (1.0 - tuned::PREFILL_TIE)
    );
    let path = tuned::path(&files, a.engine.cache_dir.as_deref());
    if a.dry_run {
        println!("--dry-run: not saved ({} unchanged)", path.display());
        return Ok(());
    }
    let t = Tuned {
        format: tuned::TUNE_FORMAT.into(),
        version: tuned::TUNE_VERSION,
        fingerprint: tuned::fingerprint(&files),
        gpu: gpu.name,
        vram_budget: format!("{:?}", a.gpu.vram_budget),
        prompt_tokens: a.prompt_tokens,
        decode_tokens: a.decode_tokens,
        runs: a.runs as usize,
        measured_at: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs()),
        choice,
        table: rows,
    };
    t.save(&path)?;
    println!(
        "saved to {}: `krasis generate` and `krasis serve` use it under --device auto (the default)",
        path.display()
    );
    Ok(())
}
