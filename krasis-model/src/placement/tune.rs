//! The choice a tuning run saves (`<cache dir>/tune.json`, written by `krasis tune`) and what
//! opening an engine does with it: under the `auto` device policy (the default) the tuned
//! device, GPU expert width and cache strategy replace the automatic choice, on the GPU and model
//! it was measured on ([`apply`], called by [`crate::runtime::open_engine`]); an explicit device
//! keeps every option as given.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::{CachePlan, CacheStrategy};
use crate::cpu::quantized::WeightBits;
use crate::error::{ModelError, Result};
use crate::runtime::{DevicePolicy, EngineConfig};
use crate::source::files::ModelFiles;

fn invalid(msg: String) -> ModelError {
    ModelError::Invalid(msg)
}

/// The `format` field of a tune file.
pub const TUNE_FORMAT: &str = "krasis-tune";
/// The version this build writes and reads.
pub const TUNE_VERSION: u32 = 1;
/// File name in the model's cache directory.
pub const TUNE_FILE: &str = "tune.json";
/// Largest tune file read (a table of a few strategies is ~2 KB).
const MAX_TUNE_BYTES: u64 = 1 << 20;

/// One strategy: how the engine is opened.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Strategy {
    /// `persistent`, `layer_grouped`, `cpu_experts`, or a [`CacheStrategy`] name
    /// (`hot_cached_static`, `active_only`, `static_pin`, `weighted_pin`, `lru`, `chunked`).
    pub name: String,
    /// `gpu` or `hybrid`.
    pub device: String,
    /// GPU expert width (4 or 8); `None`: the routed experts stay on the CPU.
    pub gpu_expert_bits: Option<u8>,
    /// CPU expert width as [`WeightBits`] parses it (hybrid).
    pub cpu_expert_bits: String,
    /// A cache strategy's heatmap (the pinning ones) and VRAM (`None`: the default budget).
    pub heatmap_path: Option<PathBuf>,
    pub pin_vram: Option<u64>,
}

/// One measured row of the table.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Row {
    pub strategy: Strategy,
    /// Medians over the runs; `None` with `error` when the strategy could not run.
    pub prefill_tok_s: Option<f64>,
    pub decode_tok_s: Option<f64>,
    pub load_s: Option<f64>,
    pub error: Option<String>,
}

/// What `krasis tune` measured and chose.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Tuned {
    pub format: String,
    pub version: u32,
    /// [`ModelFiles::fingerprint`] of the model it was measured on (hex).
    pub fingerprint: String,
    /// The GPU it was measured on, and the VRAM budget given.
    pub gpu: String,
    pub vram_budget: String,
    pub prompt_tokens: usize,
    pub decode_tokens: usize,
    pub runs: usize,
    /// When it was measured (seconds since the Unix epoch).
    pub measured_at: u64,
    pub choice: Strategy,
    pub table: Vec<Row>,
}

/// Prefills within this fraction of the fastest count as equally fast: the choice among them is
/// the fastest decode (repeated identical prefills on the H200 box spread by ~5 %).
pub const PREFILL_TIE: f64 = 0.95;

/// The fastest prefill first, then among the rows within [`PREFILL_TIE`] of it the fastest
/// decode (#9: prefill gets first claim). `None` when no row ran.
pub fn choose(rows: &[Row]) -> Option<&Row> {
    let best =
        rows.iter().filter_map(|r| r.prefill_tok_s).fold(None, |m: Option<f64>, p| Some(m.map_or(p, |m| m.max(p))))?;
    rows.iter()
        .filter(|r| r.prefill_tok_s.is_some_and(|p| p >= PREFILL_TIE * best))
        .max_by(|a, b| a.decode_tok_s.unwrap_or(0.0).total_cmp(&b.decode_tok_s.unwrap_or(0.0)))
}

/// The strategies a tuning run measures on `spec`: the whole model on the GPU (`persistent`),
/// hybrid streaming whole layers (`layer_grouped`), hybrid with the experts on the CPU only
/// (`cpu_experts`), then the cache strategies: those without a heatmap always, the pinning ones
/// when `heatmap` is given, `chunked` when `pin_vram` sizes its slots (without it, chunked
/// streams whole layers: `layer_grouped`). `gpu_bits`: the GPU strategies' expert width (4 or 8);
/// `cpu_bits`: the CPU experts' width asked for (`auto`: the default,
/// [`crate::placement::precision::resolve_expert_bits`]).
pub fn candidates(
    spec: &crate::ModelSpec,
    gpu_bits: u8,
    cpu_bits: WeightBits,
    heatmap: Option<PathBuf>,
    pin_vram: Option<u64>,
) -> Result<Vec<Strategy>> {
    if spec.moe.is_none() {
        return Err(invalid("the model has no routed experts: there is no expert strategy to tune".into()));
    }
    let cpu_bits = crate::placement::precision::resolve_expert_bits(spec, cpu_bits).flag_value();
    let s = |name: &str, device: &str, gpu_bits: Option<u8>| Strategy {
        name: name.into(),
        device: device.into(),
        gpu_expert_bits: gpu_bits,
        cpu_expert_bits: cpu_bits.into(),
        heatmap_path: None,
        pin_vram: None,
    };
    let mut out = vec![
        Strategy { cpu_expert_bits: "auto".into(), ..s("persistent", "gpu", Some(gpu_bits)) },
        s("layer_grouped", "hybrid", Some(gpu_bits)),
        s("cpu_experts", "hybrid", None),
    ];
    for strategy in CacheStrategy::ALL {
        if strategy.needs_heatmap() && heatmap.is_none() {
            continue;
        }
        if strategy == CacheStrategy::Chunked && pin_vram.is_none() {
            continue;
        }
        let mut c = s(strategy.name(), "hybrid", Some(gpu_bits));
        c.heatmap_path = heatmap.clone().filter(|_| strategy.needs_heatmap());
        c.pin_vram = pin_vram;
        out.push(c);
    }
    Ok(out)
}

/// Where a model's tune file lives: `cache_dir` (the cache directory option), else the model's
/// default cache directory.
pub fn path(files: &ModelFiles, cache_dir: Option<&Path>) -> PathBuf {
    cache_dir.map(Path::to_path_buf).unwrap_or_else(|| files.default_cache_dir()).join(TUNE_FILE)
}

impl Tuned {
    /// Writes the file through `path.tmp` and a rename (a reader never sees half a file).
    pub fn save(&self, path: &Path) -> Result<()> {
        let io = |what: String| move |e: std::io::Error| invalid(format!("{what}: {e}"));
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(io(format!("creating {}", dir.display())))?;
        }
        let tmp = path.with_extension("json.tmp");
        let text = serde_json::to_string_pretty(self).map_err(|e| invalid(format!("tune file: {e}")))? + "\n";
        std::fs::write(&tmp, text).map_err(io(format!("writing {}", tmp.display())))?;
        std::fs::rename(&tmp, path).map_err(io(format!("renaming {} to {}", tmp.display(), path.display())))
    }

    /// Reads a tune file, checking its format and version and capping its size.
    pub fn load(path: &Path) -> Result<Tuned> {
        let read = |e: std::io::Error| invalid(format!("reading {}: {e}", path.display()));
        let len = std::fs::metadata(path).map_err(read)?.len();
        if len > MAX_TUNE_BYTES {
            return Err(invalid(format!(
                "tune file {}: {len} bytes, more than a tune file's {MAX_TUNE_BYTES}",
                path.display()
            )));
        }
        let bytes = std::fs::read(path).map_err(read)?;
        let t: Tuned = serde_json::from_slice(&bytes)
            .map_err(|e| invalid(format!("tune file {}: not a krasis tune file ({e})", path.display())))?;
        if t.format != TUNE_FORMAT || t.version != TUNE_VERSION {
            return Err(invalid(format!(
                "tune file {}: format {:?} version {}, this build reads {TUNE_FORMAT:?} version {TUNE_VERSION} (tune again)",
                path.display(),
                t.format,
                t.version
            )));
        }
        Ok(t)
    }
}

/// The model's fingerprint as the tune file writes it.
pub fn fingerprint(files: &ModelFiles) -> String {
    format!("{:016x}", files.fingerprint())
}

/// Applies `strategy` to `config` (device, expert widths, cache strategy).
pub fn apply_strategy(s: &Strategy, config: &mut EngineConfig) -> Result<()> {
    config.device = match s.device.as_str() {
        "gpu" => DevicePolicy::Gpu,
        "hybrid" => DevicePolicy::Hybrid,
        d => return Err(invalid(format!("tuned device {d:?} is neither gpu nor hybrid"))),
    };
    config.gpu_expert_width = match s.gpu_expert_bits {
        None => WeightBits::Bf16,
        Some(4) => WeightBits::Int4,
        Some(8) => WeightBits::Int8,
        Some(b) => return Err(invalid(format!("tuned GPU expert width {b} is neither 4 nor 8"))),
    };
    config.gpu.expert_bits = None;
    // The tuned strategy is the whole choice: no default pins beside it.
    config.pin_leftover_vram = false;
    if config.device == DevicePolicy::Gpu {
        // The whole model on the GPU: no CPU precisions (the engine refuses them there).
        (config.cpu.expert_bits, config.cpu.dense_bits) = (WeightBits::Auto, WeightBits::Bf16);
    } else {
        config.cpu.expert_bits =
            s.cpu_expert_bits.parse::<WeightBits>().map_err(|e| invalid(format!("tuned CPU expert width: {e}")))?;
    }
    config.gpu.cache = match CacheStrategy::from_name(&s.name) {
        Some(strategy) => {
            if strategy.needs_heatmap() && s.heatmap_path.is_none() {
                return Err(invalid(format!("tuned {} without a heatmap path", s.name)));
            }
            Some(CachePlan { strategy, heatmap: s.heatmap_path.clone(), vram: s.pin_vram })
        }
        None => None,
    };
    Ok(())
}

/// Under the `auto` device policy, the tune file of `files` (in `cache_dir`), when there is one
/// for this model and this GPU, replaces `config`'s device choice. Returns a line for the log:
/// what was taken, or why a file found was not (`None`: no file).
pub fn apply(files: &ModelFiles, cache_dir: Option<&Path>, config: &mut EngineConfig) -> Result<Option<String>> {
    let p = path(files, cache_dir);
    if config.device != DevicePolicy::Auto || !p.exists() {
        return Ok(None);
    }
    let t = match Tuned::load(&p) {
        Ok(t) => t,
        Err(e) => return Ok(Some(format!("warning: {e}; not used"))),
    };
    if t.fingerprint != fingerprint(files) {
        return Ok(Some(format!("tune file {} is for another model (or other files): not used", p.display())));
    }
    let gpu = match krasis_gpu::probe_ordinal(config.gpu.ordinal) {
        Ok(info) => info.name,
        Err(e) => return Ok(Some(format!("tune file {} not used: no GPU ({e})", p.display()))),
    };
    if gpu != t.gpu {
        return Ok(Some(format!("tune file {} was measured on {}, not this {gpu}: not used", p.display(), t.gpu)));
    }
    apply_strategy(&t.choice, config)?;
    Ok(Some(format!(
        "tuned: {} (from {}, measured by a tuning run; give `EngineConfig::device` to choose yourself)",
        t.choice.name,
        p.display()
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strategy(name: &str) -> Strategy {
        Strategy {
            name: name.into(),
            device: "hybrid".into(),
            gpu_expert_bits: Some(4),
            cpu_expert_bits: "4".into(),
            heatmap_path: None,
            pin_vram: None,
        }
    }

    fn row(name: &str, prefill: Option<f64>, decode: Option<f64>) -> Row {
        Row { strategy: strategy(name), prefill_tok_s: prefill, decode_tok_s: decode, load_s: Some(1.0), error: None }
    }

    #[test]
    fn fastest_prefill_first_then_fastest_decode_among_ties() {
        let rows = vec![
            row("persistent", None, None),
            row("layer_grouped", Some(25_000.0), Some(110.0)),
            row("cpu_experts", Some(1_700.0), Some(120.0)),
            row("hot_cached_static", Some(24_500.0), Some(170.0)),
        ];
        assert_eq!(choose(&rows).unwrap().strategy.name, "hot_cached_static");
        // Outside the tie the faster prefill wins whatever its decode.
        let rows = vec![row("a", Some(40_000.0), Some(100.0)), row("b", Some(30_000.0), Some(400.0))];
        assert_eq!(choose(&rows).unwrap().strategy.name, "a");
        assert!(choose(&[row("x", None, None)]).is_none());
    }

    #[test]
    fn the_file_round_trips_and_refuses_others() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("sub").join(TUNE_FILE);
        let t = Tuned {
            format: TUNE_FORMAT.into(),
            version: TUNE_VERSION,
            fingerprint: "00000000deadbeef".into(),
            gpu: "NVIDIA H200".into(),
            vram_budget: "auto".into(),
            prompt_tokens: 10240,
            decode_tokens: 64,
            runs: 3,
            measured_at: 1,
            choice: strategy("layer_grouped"),
            table: vec![row("layer_grouped", Some(1.0), Some(2.0))],
        };
        t.save(&p).unwrap();
        assert_eq!(Tuned::load(&p).unwrap(), t);
        assert!(!p.with_extension("json.tmp").exists());
        std::fs::write(&p, b"{\"format\": \"other\"}").unwrap();
        assert!(Tuned::load(&p).unwrap_err().to_string().contains("not a krasis tune file"));
        let mut other = t.clone();
        other.version = 99;
        std::fs::write(&p, serde_json::to_string(&other).unwrap()).unwrap();
        assert!(Tuned::load(&p).unwrap_err().to_string().contains("tune again"));
    }

    #[test]
    fn the_candidates_follow_the_heatmap_and_the_pin_vram() {
        let text = crate::synth::preset_config(crate::synth::Preset::Tiny, None).to_string();
        let spec = crate::arch::parse_config(&text, Path::new("config.json")).unwrap();
        let names = |v: Vec<Strategy>| v.into_iter().map(|s| s.name).collect::<Vec<_>>();
        let plain = candidates(&spec, 4, WeightBits::Auto, None, None).unwrap();
        assert_eq!(plain[1].cpu_expert_bits, "4", "safetensors auto: INT4 CPU experts");
        assert_eq!(names(plain), ["persistent", "layer_grouped", "cpu_experts", "active_only", "lru"]);
        let all = candidates(&spec, 8, WeightBits::Int8, Some("/h.json".into()), Some(1 << 30)).unwrap();
        assert_eq!(all.len(), 9);
        assert!(all.iter().all(|s| s.gpu_expert_bits.is_none() || s.gpu_expert_bits == Some(8)));
        assert_eq!(all[1].cpu_expert_bits, "8");
    }

    #[test]
    fn strategies_apply_to_the_config() {
        let mut c = EngineConfig::default();
        apply_strategy(&strategy("layer_grouped"), &mut c).unwrap();
        assert_eq!(c.device, DevicePolicy::Hybrid);
        assert_eq!(c.gpu_expert_width, WeightBits::Int4);
        assert!(!c.pin_leftover_vram, "a tuned strategy takes no default pins");
        assert_eq!(c.cpu.expert_bits, WeightBits::Int4);
        assert!(c.gpu.cache.is_none());
        apply_strategy(&strategy("lru"), &mut c).unwrap();
        assert_eq!(c.gpu.cache, Some(CachePlan { strategy: CacheStrategy::Lru, heatmap: None, vram: None }));
        assert!(apply_strategy(&strategy("weighted_pin"), &mut c).is_err(), "weighted_pin needs its heatmap");
        let mut hot = strategy("hot_cached_static");
        assert!(apply_strategy(&hot, &mut c).is_err(), "hot_cached_static needs its heatmap");
        hot.heatmap_path = Some("/h.json".into());
        hot.pin_vram = Some(1 << 30);
        apply_strategy(&hot, &mut c).unwrap();
        assert_eq!(
            c.gpu.cache,
            Some(CachePlan {
                strategy: CacheStrategy::HotCachedStatic,
                heatmap: Some("/h.json".into()),
                vram: Some(1 << 30)
            })
        );
        let gpu = Strategy { device: "gpu".into(), gpu_expert_bits: Some(8), ..strategy("persistent") };
        c.cpu.dense_bits = WeightBits::Int8;
        apply_strategy(&gpu, &mut c).unwrap();
        assert!(!c.wants_cpu_precisions(), "the whole-GPU strategy drops the CPU precisions");
        assert_eq!((c.device, c.gpu_expert_width, c.gpu.cache.is_none()), (DevicePolicy::Gpu, WeightBits::Int8, true));
    }
}
