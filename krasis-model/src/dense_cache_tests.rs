//! The dense-weight cache in the engine: the cached linears are the freshly quantised ones bit
//! for bit (so are the logits), a cached start reads no source dense weight, damage is rebuilt
//! with its reason in the load log, and the memory estimate counts the caches exactly.

use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use super::*;
use crate::engine::{Logits, Model};
use crate::load::{load_model, EngineOptions};
use crate::memory::cpu_estimate;
use crate::precision::CacheBits;
use crate::quantized::{open_expert_cache, WeightBits};
use crate::synth::{synthesize, Preset, SynthOptions};

fn tiny(dir: &Path) -> PathBuf {
    let out = dir.join("tiny");
    // Three layers: a dense MLP layer, then MoE layers with a shared expert.
    synthesize(&SynthOptions { layers: Some(3), seed: 11, ..SynthOptions::new(Preset::Tiny, &out) }).unwrap();
    out
}

fn opts(cache: &Path) -> EngineOptions {
    EngineOptions {
        expert_bits: WeightBits::Int4,
        dense_bits: WeightBits::Int8,
        cache_dir: Some(cache.to_path_buf()),
        threads: Some(2),
        ..EngineOptions::default()
    }
}

const PROMPT: &[u32] = &[1, 7, 42, 300, 5, 99];

fn logits(m: &Model) -> Vec<f32> {
    let mut s = m.new_session();
    m.forward(&mut s, PROMPT, Logits::All, None).unwrap()
}

fn load(dir: &Path, cache: &Path) -> (Vec<f32>, Vec<String>) {
    let files = ModelFiles::open(dir).unwrap();
    let loaded = load_model(&files, &opts(cache)).unwrap();
    (logits(&loaded.model), loaded.log)
}

fn line<'a>(log: &'a [String], prefix: &str) -> &'a str {
    log.iter().find(|l| l.starts_with(prefix)).unwrap_or_else(|| panic!("no `{prefix}` line in {log:#?}"))
}

#[test]
fn cached_linears_are_the_freshly_quantised_ones_and_so_are_the_logits() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tiny(tmp.path());
    let cache = tmp.path().join("cache");
    let files = ModelFiles::open(&dir).unwrap();
    let spec = files.spec().clone();
    let plan = quantised_linears(&spec).unwrap();
    // attention (q, kv_a, o) ×3, the dense MLP and two shared experts (gate, up, down), LM head
    assert_eq!(plan.len(), 3 * 3 + 3 * 3 + 1, "{:?}", plan.iter().map(|p| &p.0).collect::<Vec<_>>());
    assert!(plan.iter().any(|(n, _)| n == "lm_head.weight"));

    // Reference: every dense linear quantised at load, no dense cache.
    let o = opts(&cache);
    let loaded = load_model(&files, &EngineOptions { dense_bits: WeightBits::Bf16, ..o.clone() }).unwrap();
    let pool = loaded.pool.clone().unwrap();
    let (ec, _) = open_expert_cache(&files, CacheBits::Uniform(Bits::Int4), 128, Some(&cache), &pool).unwrap();
    let experts = Arc::new(crate::quantized::CpuQuantExperts::new(ec, &spec, pool.clone()).unwrap());
    let fresh = |l: crate::linear::DenseLinear, name: &str| -> Result<Box<dyn LinearOp>> {
        Ok(Box::new(QuantLinear::from_dense(&l, Bits::Int8, 128, pool.clone(), name)?))
    };
    let reference = Model::from_source(spec.clone(), files.weights(), &fresh, Some(experts as _)).unwrap();
    let want = logits(&reference);

    let (built, log) = load(&dir, &cache);
    assert!(line(&log, "dense-weight cache built (missing)").contains("dense_cpu_int8_g128.bin"), "{log:#?}");
    let (hit, log) = load(&dir, &cache);
    assert!(line(&log, "dense-weight cache hit").contains("dense_cpu_int8_g128.bin"), "{log:#?}");
    assert_eq!(built, want, "logits from a freshly built cache");
    assert_eq!(hit, want, "logits from a cached start");

    // Entry bytes equal a fresh pack of the source matrix.
    let (c, outcome) = open_dense_cache(&files, Bits::Int8, 128, Some(&cache)).unwrap();
    assert_eq!(outcome, CacheOutcome::Hit);
    let loader = WeightLoader::new(files.weights(), &spec.source_quant);
    for (i, (name, t)) in plan.iter().enumerate() {
        let layout = dense_layout(t.shape[0], t.shape[1], Bits::Int8, 128, name).unwrap();
        assert_eq!(c.entry(i), pack_dense(&loader.matrix_of(t).unwrap(), &layout).as_slice(), "{name}");
    }
}

/// A source whose dense linears cannot be read: a cached start must not need them.
struct NoDenseLinears<'a>(&'a dyn crate::source::WeightSource, Vec<String>);

impl crate::source::WeightSource for NoDenseLinears<'_> {
    fn location(&self) -> &Path {
        self.0.location()
    }
    fn contains(&self, name: &str) -> bool {
        self.0.contains(name)
    }
    fn tensor(&self, name: &str) -> Result<crate::source::StoredTensor> {
        if self.1.iter().any(|n| n == name) {
            return Err(ModelError::Invalid(format!("read `{name}`")));
        }
        self.0.tensor(name)
    }
    fn describe(&self) -> String {
        self.0.describe()
    }
}

#[test]
fn a_cached_start_reads_no_source_dense_linear() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tiny(tmp.path());
    let cache = tmp.path().join("cache");
    let files = ModelFiles::open(&dir).unwrap();
    let spec = files.spec().clone();
    let (c, _) = open_dense_cache(&files, Bits::Int8, 128, Some(&cache)).unwrap();
    let names = quantised_linears(&spec).unwrap().into_iter().map(|(_, t)| t.name).collect();
    let source = NoDenseLinears(files.weights(), names);
    let pool = crate::load::start_pool(Some(2), &mut Vec::new()).unwrap();
    let cached = cached_linears(Arc::new(c), Bits::Int8, pool);
    let refuse = |_: crate::linear::DenseLinear, name: &str| -> Result<Box<dyn LinearOp>> {
        Err(ModelError::Invalid(format!("{name} was not in the cache")))
    };
    let m = Model::from_source_with(spec.clone(), &source, &refuse, Some(&cached), None).unwrap();
    assert!(logits(&m).iter().all(|v| v.is_finite()));
    // Without the cache the same source fails: the test can tell.
    assert!(Model::from_source_with(spec, &source, &refuse, None, None).is_err());
}

#[test]
fn damaged_truncated_and_stale_dense_caches_are_rebuilt_with_the_reason() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tiny(tmp.path());
    let cache = tmp.path().join("cache");
    let (want, _) = load(&dir, &cache);
    let path = cache.join("dense_cpu_int8_g128.bin");
    let len = std::fs::metadata(&path).unwrap().len();

    let f = OpenOptions::new().read(true).write(true).open(&path).unwrap();
    f.write_all_at(&[0x5a; 16], len - 5000).unwrap();
    let (got, log) = load(&dir, &cache);
    assert!(line(&log, "dense-weight cache built (damaged: checksum mismatch in `").contains(&*path.to_string_lossy()));
    assert_eq!(got, want);

    OpenOptions::new().write(true).open(&path).unwrap().set_len(len / 2).unwrap();
    let (got, log) = load(&dir, &cache);
    line(&log, "dense-weight cache built (damaged: file is");
    assert_eq!(got, want);

    // A cache of another model under the same name (its configuration differs): stale.
    let other = tmp.path().join("other");
    synthesize(&SynthOptions { layers: Some(2), seed: 11, ..SynthOptions::new(Preset::Tiny, &other) }).unwrap();
    let other_cache = tmp.path().join("other-cache");
    std::fs::create_dir_all(&other_cache).unwrap();
    std::fs::copy(&path, other_cache.join("dense_cpu_int8_g128.bin")).unwrap();
    let (_, log) = load(&other, &other_cache);
    line(&log, "dense-weight cache built (stale: config_hash differs");
}

#[test]
fn the_estimate_counts_both_caches_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tiny(tmp.path());
    let cache = tmp.path().join("cache");
    let files = ModelFiles::open(&dir).unwrap();
    let spec = files.spec();
    let pool = crate::load::start_pool(Some(2), &mut Vec::new()).unwrap();
    let (ec, _) = open_expert_cache(&files, CacheBits::Uniform(Bits::Int4), 128, Some(&cache), &pool).unwrap();
    let (dc, _) = open_dense_cache(&files, Bits::Int8, 128, Some(&cache)).unwrap();
    let q = cpu_estimate(spec, Some(files.weights()), WeightBits::Int4, WeightBits::Int8, 128);
    let r = cpu_estimate(spec, Some(files.weights()), WeightBits::Int4, WeightBits::Bf16, 128);
    assert_eq!(q.expert_bytes, ec.resident_bytes() as u64);
    // Only the linears change between the two: by the dense cache's pages against their bf16 bytes.
    let bf16: u64 = quantised_linears(spec).unwrap().iter().map(|(_, t)| t.numel() as u64 * 2).sum();
    assert_eq!(q.dense_bytes + bf16, r.dense_bytes + dc.resident_bytes() as u64);
    // The embedding is read through the mapping: one row (and the page it straddles) per token.
    assert_eq!(q.embed_bytes_per_token, 8192);
}

#[test]
fn a_tied_lm_head_left_as_stored_holds_the_embedding_once() {
    let tmp = tempfile::tempdir().unwrap();
    let files = ModelFiles::open(&tiny(tmp.path())).unwrap();
    let mut tied = files.spec().clone();
    tied.tie_word_embeddings = true;
    let untied = cpu_estimate(files.spec(), None, WeightBits::Int4, WeightBits::Bf16, 128);
    let t = cpu_estimate(&tied, None, WeightBits::Int4, WeightBits::Bf16, 128);
    // Untied: the LM head's own bytes, the embedding a row per token. Tied: the embedding's pages
    // (the same size) read whole by the LM head, nothing per token.
    assert_eq!(t.dense_bytes, untied.dense_bytes);
    assert_eq!((t.embed_bytes_per_token, untied.embed_bytes_per_token), (0, 8192));
    // Quantised, the tied head is a cache entry and the embedding is read a row per token again.
    let q = cpu_estimate(&tied, None, WeightBits::Int4, WeightBits::Int8, 128);
    assert_eq!(q.embed_bytes_per_token, 8192);
    let plan = quantised_linears(&tied).unwrap();
    assert_eq!(plan.last().unwrap().0, "lm_head.weight (tied to model.embed_tokens.weight)");
}
