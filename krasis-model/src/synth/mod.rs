//! `krasis synth`: random models of real shapes, written in HF hub format (sharded safetensors
//! and their index, `config.json`, byte-level BPE tokenizer) for benchmarks and GPU-vs-CPU tests
//! where no real checkpoint is needed.
//!
//! - The model is a preset, or any `config.json` Krasis reads (a published one: every dimension
//!   as published, `num_hidden_layers` optionally cut).
//! - The tensor list is [`expected_tensors`] of the spec that [`parse_checkpoint_config`] makes of
//!   the `config.json`, so the loader and the synthesiser cannot disagree, stored in the
//!   publisher's format ([`stored_tensors`]): BF16 for the presets (gpt-oss-120b: MXFP4
//!   experts, fused as published); block FP8, compressed-tensors INT4, ModelOpt NVFP4 or MXFP4
//!   where the configuration says so.
//! - Weights are deterministic in the seed alone (see [`init`] for the random stream, the scales
//!   and the router-skew scheme), independent of threads and shard layout.
//! - Writing streams: chunks are generated in parallel and written in order, never the whole
//!   model in memory. Every file goes through `<name>.tmp` + rename and `config.json` is written
//!   last, so a directory left half-written by a crash is never loadable.

pub mod init;
mod layout;
mod presets;
mod tokenizer;
mod writer;
pub(crate) use writer::write_atomic;

#[cfg(test)]
mod config_tests;
#[cfg(test)]
mod tests;

use std::path::{Path, PathBuf};
use std::time::Instant;

use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{json, Value};

pub use self::layout::{stored_tensors, StoredSpec};
pub use self::presets::{preset_config, Preset};
use crate::arch::parse_checkpoint_config;
use crate::error::{ModelError, Result};
use crate::model::tensors::expected_tensors;

/// A new shard starts at the next layer boundary once the current one holds this many bytes.
pub const SHARD_BYTES: u64 = 2 << 30;

#[derive(Clone, Debug, PartialEq)]
pub struct SynthOptions {
    pub preset: Preset,
    /// A `config.json` to synthesize instead of the preset (`preset` is then not used): any
    /// configuration Krasis reads, written in its publisher's storage format (see
    /// [`stored_tensors`]: BF16, block FP8, compressed-tensors INT4, ModelOpt NVFP4 or MXFP4,
    /// gpt-oss's fused experts, and the tensor prefix of a nested text model), with every
    /// dimension as published.
    pub config: Option<PathBuf>,
    /// Trim `num_hidden_layers` to this many (1..= the preset's).
    pub layers: Option<usize>,
    pub seed: u64,
    pub out: PathBuf,
    /// Hot-expert strength, ≥ 0 (0 = i.i.d. routers); see [`init`].
    pub router_skew: f32,
    /// Write into a non-empty `out` (replacing the model files there).
    pub force: bool,
}

impl SynthOptions {
    /// Seed 0, full depth, no skew, no force.
    pub fn new(preset: Preset, out: impl Into<PathBuf>) -> Self {
        SynthOptions { preset, config: None, layers: None, seed: 0, out: out.into(), router_skew: 0.0, force: false }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct SynthReport {
    pub out: PathBuf,
    /// All files written (shards, index, tokenizer, config).
    pub bytes_written: u64,
    pub tensors: usize,
    pub shards: usize,
    pub seconds: f64,
    /// The cache directories of the model this one replaced (under `force`), removed.
    pub caches_removed: Vec<PathBuf>,
}

/// Generate the model `opts` describes into `opts.out`, with a progress bar on stderr.
pub fn synthesize(opts: &SynthOptions) -> Result<SynthReport> {
    let (config, label) = match &opts.config {
        Some(path) => (layout::config_from_file(path, opts.layers)?, format!("synth {}", path.display())),
        None => {
            opts.preset.check_layers(opts.layers)?;
            (preset_config(opts.preset, opts.layers), format!("synth {}", opts.preset))
        }
    };
    write_model(&config, &opts.out, opts.seed, opts.router_skew, opts.force, SHARD_BYTES, &label)
}

/// Files a synth run owns: removed from a non-empty directory under `force`.
fn is_model_file(name: &str) -> bool {
    let base = name.strip_suffix(".tmp").unwrap_or(name);
    matches!(
        base,
        "config.json"
            | "model.safetensors"
            | "model.safetensors.index.json"
            | "tokenizer.json"
            | "tokenizer_config.json"
    ) || (base.starts_with("model-") && base.ends_with(".safetensors"))
}

/// Make `out` an empty-enough directory: create it, or refuse a non-empty one without `force`.
/// Under `force`, `config.json` goes first (the directory stops being loadable), then the caches
/// of the model being replaced (`.krasis_cache` and the per-user cache directory, see
/// [`krasis_cache::model_cache_dirs`]; returned), then the other model files; unrelated files
/// are left alone.
fn prepare_out_dir(out: &Path, force: bool) -> Result<Vec<PathBuf>> {
    if !out.exists() {
        std::fs::create_dir_all(out).map_err(|e| ModelError::io(out, e))?;
        return Ok(Vec::new());
    }
    if !out.is_dir() {
        return Err(ModelError::Invalid(format!("output path {} exists and is not a directory", out.display())));
    }
    let names: Vec<String> = std::fs::read_dir(out)
        .map_err(|e| ModelError::io(out, e))?
        .map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned()))
        .collect::<std::io::Result<_>>()
        .map_err(|e| ModelError::io(out, e))?;
    if names.is_empty() {
        return Ok(Vec::new());
    }
    if !force {
        return Err(ModelError::Invalid(format!(
            "output directory {} is not empty ({} entries); choose another directory or overwrite \
             the model files in it (`SynthOptions::force`)",
            out.display(),
            names.len()
        )));
    }
    let config = out.join("config.json");
    if config.exists() {
        std::fs::remove_file(&config).map_err(|e| ModelError::io(&config, e))?;
    }
    let mut caches_removed = Vec::new();
    for dir in krasis_cache::model_cache_dirs(out) {
        if dir.is_dir() {
            std::fs::remove_dir_all(&dir).map_err(|e| ModelError::io(&dir, e))?;
            caches_removed.push(dir);
        }
    }
    for name in names.iter().filter(|n| is_model_file(n)) {
        let p = out.join(name);
        if p.is_file() {
            std::fs::remove_file(&p).map_err(|e| ModelError::io(&p, e))?;
        }
    }
    Ok(caches_removed)
}

/// The engine of [`synthesize`], for any config `parse_checkpoint_config` accepts (tests use small custom
/// ones) and any shard limit (tests force several shards).
pub(crate) fn write_model(
    config: &Value,
    out: &Path,
    seed: u64,
    router_skew: f32,
    force: bool,
    shard_limit: u64,
    label: &str,
) -> Result<SynthReport> {
    let started = Instant::now();
    if !(router_skew.is_finite() && router_skew >= 0.0) {
        return Err(ModelError::Invalid(format!("router skew must be a finite number >= 0, got {router_skew}")));
    }
    let config_path = out.join("config.json");
    let config_text = serde_json::to_string_pretty(config).expect("json serialises") + "\n";
    let cfg = parse_checkpoint_config(&config_text, &config_path)?;
    let spec = &cfg.spec;
    let tokenizer = tokenizer::tokenizer_json(spec.vocab_size)?;
    let tokenizer_config = tokenizer::tokenizer_config_json(spec.max_position_embeddings);
    let tensors = layout::store_layout(init::plan_tensors(spec, expected_tensors(spec), seed, router_skew), &cfg)?;
    let shards = writer::plan_shards(&tensors, spec.num_layers, shard_limit.max(1));
    let caches_removed = prepare_out_dir(out, force)?;

    let total: u64 =
        shards.iter().map(|s| s.data_bytes + writer::shard_header(&tensors[s.tensors.clone()]).len() as u64).sum();
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template(
            "{msg} [{bar:40}] {decimal_bytes}/{decimal_total_bytes} {decimal_bytes_per_sec} eta {eta}",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    bar.set_message(label.to_string());
    let mut written = writer::write_shards(out, &tensors, &shards, seed, &|n| bar.inc(n))?;
    bar.finish();

    let mut weight_map = serde_json::Map::new();
    for s in &shards {
        for t in &tensors[s.tensors.clone()] {
            weight_map.insert(t.spec.name.clone(), Value::String(s.file_name.clone()));
        }
    }
    let total_size: u64 = tensors.iter().map(|t| t.bytes()).sum();
    let index = json!({"metadata": {"total_size": total_size}, "weight_map": weight_map});
    let index_text = serde_json::to_string_pretty(&index).expect("json serialises") + "\n";
    for (name, text) in [
        ("model.safetensors.index.json", index_text.as_str()),
        ("tokenizer.json", tokenizer.as_str()),
        ("tokenizer_config.json", tokenizer_config.as_str()),
        ("config.json", config_text.as_str()), // last: the directory becomes loadable here
    ] {
        writer::write_atomic(&out.join(name), text.as_bytes())?;
        written += text.len() as u64;
    }
    // Make the renames durable too (best effort: not every platform can open a directory).
    if let Ok(d) = std::fs::File::open(out) {
        let _ = d.sync_all();
    }
    Ok(SynthReport {
        out: out.to_path_buf(),
        bytes_written: written,
        tensors: tensors.len(),
        shards: shards.len(),
        seconds: started.elapsed().as_secs_f64(),
        caches_removed,
    })
}
