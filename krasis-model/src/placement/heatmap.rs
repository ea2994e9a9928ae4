//! Expert activation counts per (layer, routed expert): what `--heatmap-out FILE` writes, the
//! input the seeds' pinning strategies (`static_pin`, `weighted_pin`, `hot_cached_static`) rank
//! experts by. docs/FORMATS.md describes the file.
//!
//! Every engine counts where its routes are made: the CPU engine after each MoE layer's top-k,
//! the GPU engines (whole model and hybrid) on the device right after the router (one small
//! kernel per MoE layer, only while recording), so a count is one (token, slot) pair whatever
//! device ran the expert.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

use crate::error::{ModelError, Result};

/// Counts recorded on the host: `layers × experts` atomics (dense layers' rows stay zero).
pub struct HeatCounter {
    experts: usize,
    counts: Vec<AtomicU64>,
}

impl HeatCounter {
    pub fn new(layers: usize, experts: usize) -> Self {
        HeatCounter { experts, counts: (0..layers * experts).map(|_| AtomicU64::new(0)).collect() }
    }

    /// Counts each id of `ids` below the layer's expert count (others, e.g. a route computed
    /// elsewhere, are left out) for `layer`.
    pub fn record(&self, layer: usize, ids: &[usize]) {
        let row = &self.counts[layer * self.experts..(layer + 1) * self.experts];
        for &e in ids {
            if let Some(c) = row.get(e) {
                c.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// The counts so far, `[layers × experts]`.
    pub fn snapshot(&self) -> Vec<u64> {
        self.counts.iter().map(|c| c.load(Ordering::Relaxed)).collect()
    }
}

/// A heatmap: how many (token, slot) pairs each routed expert of each layer received.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ExpertHeat {
    /// Always [`HEATMAP_FORMAT`].
    pub format: String,
    pub version: u32,
    /// The model directory or file it was recorded on (for the reader's information).
    pub model: String,
    /// Decoder layers (dense layers included: their rows are zero) and routed experts per layer.
    pub layers: usize,
    pub experts: usize,
    /// Experts each token is routed to.
    pub top_k: usize,
    /// Tokens that went through the model while recording (prompt and generated).
    pub tokens: u64,
    /// `counts[layer][expert]`.
    pub counts: Vec<Vec<u64>>,
}

/// The `format` field of a heatmap file.
pub const HEATMAP_FORMAT: &str = "krasis-expert-heatmap";
/// The version this build writes and reads.
pub const HEATMAP_VERSION: u32 = 1;
/// The heatmap's file name in a model's cache directory: `krasis serve` writes it there when it
/// stops, and the hybrid engine's default pins rank experts by it when it is there.
pub const DEFAULT_HEATMAP_FILE: &str = "heatmap.json";
/// Largest heatmap file read (a 64-layer, 4096-expert map is ~6 MB of JSON).
const MAX_HEATMAP_BYTES: u64 = 256 << 20;

impl ExpertHeat {
    /// A heatmap from flat `[layers × experts]` counts; `tokens` is taken from the busiest
    /// layer (every MoE layer routes every token `top_k` times).
    pub fn from_counts(model: &str, layers: usize, experts: usize, top_k: usize, flat: &[u64]) -> Self {
        let counts: Vec<Vec<u64>> = flat.chunks(experts.max(1)).take(layers).map(<[u64]>::to_vec).collect();
        let pairs = counts.iter().map(|r| r.iter().sum::<u64>()).max().unwrap_or(0);
        ExpertHeat {
            format: HEATMAP_FORMAT.into(),
            version: HEATMAP_VERSION,
            model: model.into(),
            layers,
            experts,
            top_k,
            tokens: pairs / top_k.max(1) as u64,
            counts,
        }
    }

    /// A stand-in for a heatmap when none was recorded: every expert of every layer gets nearly
    /// the same count, lower ids a little more, so that ranking the `(layer, expert)` pairs by
    /// count takes expert 0 of every layer, then expert 1 of every layer, and so on: pins spread
    /// evenly over the layers, and each expert's route share is as good as uniform.
    pub fn even(layers: usize, experts: usize, top_k: usize) -> Self {
        /// Count of the least expert: large enough that the per-id steps leave the shares uniform
        /// to within one part in a million.
        const BASE: u64 = 1 << 40;
        let row: Vec<u64> = (0..experts as u64).map(|e| BASE + (experts as u64 - e)).collect();
        let mut h = Self::from_counts("even", layers, experts, top_k, &row.repeat(layers));
        h.model = "even (no heatmap recorded)".into();
        h
    }

    /// The experts of `layer` from most to least used (ties: lower id first).
    pub fn ranked(&self, layer: usize) -> Vec<usize> {
        let row = &self.counts[layer];
        let mut ids: Vec<usize> = (0..row.len()).collect();
        ids.sort_by(|&a, &b| row[b].cmp(&row[a]).then(a.cmp(&b)));
        ids
    }

    /// Writes the heatmap as JSON to `path` (through `path.tmp` and a rename: a reader never
    /// sees half a file).
    /// One line per layer's counts.
    pub fn save(&self, path: &Path) -> Result<()> {
        fn js<T: Serialize + ?Sized>(v: &T) -> String {
            serde_json::to_string(v).expect("strings and numbers serialise")
        }
        let rows: Vec<String> = self.counts.iter().map(js).collect();
        let text = format!(
            "{{\n  \"format\": {},\n  \"version\": {},\n  \"model\": {},\n  \"layers\": {},\n  \"experts\": {},\n  \"top_k\": {},\n  \"tokens\": {},\n  \"counts\": [\n    {}\n  ]\n}}\n",
            js(&self.format),
            self.version,
            js(&self.model),
            self.layers,
            self.experts,
            self.top_k,
            self.tokens,
            rows.join(",\n    ")
        );
        crate::synth::write_atomic(path, text.as_bytes())
    }

    /// Reads a heatmap and checks it against the model it will serve (`layers`, `experts`).
    pub fn load(path: &Path, layers: usize, experts: usize) -> Result<Self> {
        let bad = |what: String| ModelError::Invalid(format!("heatmap {}: {what}", path.display()));
        let len = std::fs::metadata(path).map_err(|e| ModelError::io(path, e))?.len();
        if len > MAX_HEATMAP_BYTES {
            return Err(bad(format!("{len} bytes, more than a heatmap's {MAX_HEATMAP_BYTES}")));
        }
        let bytes = std::fs::read(path).map_err(|e| ModelError::io(path, e))?;
        let h: ExpertHeat = serde_json::from_slice(&bytes).map_err(|e| bad(format!("not a heatmap: {e}")))?;
        if h.format != HEATMAP_FORMAT {
            return Err(bad(format!("format {:?}, not {HEATMAP_FORMAT:?}", h.format)));
        }
        if h.version != HEATMAP_VERSION {
            return Err(bad(format!("version {} (this build reads {HEATMAP_VERSION})", h.version)));
        }
        if h.layers != layers || h.experts != experts {
            return Err(bad(format!(
                "recorded for {} layers × {} experts, the model has {layers} × {experts}",
                h.layers, h.experts
            )));
        }
        if h.counts.len() != h.layers || h.counts.iter().any(|r| r.len() != h.experts) {
            return Err(bad(format!("counts are not [{} layers][{} experts]", h.layers, h.experts)));
        }
        Ok(h)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_rank_save_and_load() {
        let c = HeatCounter::new(3, 4);
        c.record(1, &[2, 3, 2, usize::MAX, 4, 0]); // ids ≥ 4 are not this layer's
        c.record(2, &[1, 1, 0, 0]);
        let h = ExpertHeat::from_counts("m", 3, 4, 2, &c.snapshot());
        assert_eq!(h.counts, vec![vec![0; 4], vec![1, 0, 2, 1], vec![2, 2, 0, 0]]);
        assert_eq!(h.tokens, 2); // 4 pairs in the busiest layer, top-2
        assert_eq!(h.ranked(1), vec![2, 0, 3, 1]);
        assert_eq!(h.ranked(2), vec![0, 1, 2, 3]);
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("heat.json");
        h.save(&p).unwrap();
        assert!(!dir.path().join("heat.json.tmp").exists());
        assert_eq!(ExpertHeat::load(&p, 3, 4).unwrap(), h);
        let e = ExpertHeat::load(&p, 3, 8).unwrap_err().to_string();
        assert!(e.contains("3 layers × 4 experts") && e.contains("heat.json"), "{e}");
        std::fs::write(&p, b"{\"format\": 1}").unwrap();
        assert!(ExpertHeat::load(&p, 3, 4).unwrap_err().to_string().contains("not a heatmap"));
        let mut wrong = h.clone();
        wrong.counts[1].pop();
        wrong.save(&p).unwrap();
        assert!(ExpertHeat::load(&p, 3, 4).unwrap_err().to_string().contains("counts are not"));
        wrong = h.clone();
        wrong.format = "other".into();
        wrong.save(&p).unwrap();
        assert!(ExpertHeat::load(&p, 3, 4).unwrap_err().to_string().contains("format"));
    }
}
