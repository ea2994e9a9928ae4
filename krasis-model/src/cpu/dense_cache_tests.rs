//! The dense-weight cache in the engine: the cached linears are the freshly quantised ones bit
//! for bit (so are the logits), a cached start reads no source dense weight, damage is rebuilt
//! with its reason in the load log, and the memory estimate counts the caches exactly.

use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use super::*;
use crate::cpu::load::{load_model, EngineOptions};
use crate::cpu::memory::cpu_estimate;
use crate::cpu::quantized::{open_expert_cache, WeightBits};
use crate::cpu::{Logits, Model};
use crate::placement::precision::ExpertWidthRule;
use crate::synth::{synthesize, Preset, SynthOptions};
use krasis_quant::group::quantize;

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
    let plan = planned_entries(&spec).unwrap();
    let names: Vec<&str> = plan.iter().map(|p| p.name.as_str()).collect();
    // Per layer q, kv_a, kv_b (W_UKᵀ and W_UV per head), o; the dense MLP and two shared experts
    // (fused gate+up, down); the LM head.
    assert_eq!(plan.len(), 3 * 5 + 3 * 2 + 1, "{names:?}");
    assert!(names.contains(&"lm_head.weight"));
    assert!(names.contains(&"model.layers.0.self_attn.kv_b_proj.weight (W_UK^T per head)"), "{names:?}");
    assert!(names.contains(&"model.layers.1.mlp.shared_experts.gate_proj.weight + model.layers.1.mlp.shared_experts.up_proj.weight (fused w13)"), "{names:?}");

    // Reference: every dense linear quantised at load, no dense cache (kv_b in f32, gate and up
    // as two linears).
    let o = opts(&cache);
    let loaded = load_model(&files, &EngineOptions { dense_bits: WeightBits::Bf16, ..o.clone() }).unwrap();
    let pool = loaded.pool.clone().unwrap();
    let (ec, _) = open_expert_cache(&files, ExpertWidthRule::Uniform(Bits::Int4), 128, Some(&cache), &pool).unwrap();
    let experts = Arc::new(crate::cpu::quantized::CpuQuantExperts::new(ec, &spec, pool.clone()).unwrap());
    let fresh = |l: crate::model::linear::DenseLinear, name: &str| -> Result<Box<dyn LinearOp>> {
        Ok(Box::new(QuantLinear::from_dense(&l, Bits::Int8, 128, pool.clone(), name)?))
    };
    let reference = Model::from_source(spec.clone(), files.weights(), &fresh, Some(experts as _)).unwrap();
    let want = logits(&reference);

    let (built, log) = load(&dir, &cache);
    assert!(line(&log, "dense-weight cache built (missing)").contains("dense_cpu_int8_g128.bin"), "{log:#?}");
    let (hit, log) = load(&dir, &cache);
    assert!(line(&log, "dense-weight cache hit").contains("dense_cpu_int8_g128.bin"), "{log:#?}");
    assert_eq!(hit, built, "logits from a cached start");
    // The cached engine differs from the reference only by kv_b's INT8 rounding.
    let rel = |a: &[f32], b: &[f32]| {
        let n: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
        (n / b.iter().map(|y| (*y as f64).powi(2)).sum::<f64>()).sqrt()
    };
    assert!(rel(&built, &want) < 2e-2, "{:.3e}", rel(&built, &want));

    // Entry bytes equal a fresh pack of the source matrices: a linear alone, gate and up as
    // `pack_w13` interleaves them, kv_b per head.
    let (c, outcome) = open_dense_cache(&files, Bits::Int8, 128, Some(&cache)).unwrap();
    assert_eq!(outcome, CacheOutcome::Hit);
    let loader = WeightLoader::new(files.weights(), &spec.source_quant);
    let f32_rows = |t: &TensorSpec| {
        let m = loader.matrix_of(t).unwrap();
        let mut w = vec![0f32; t.numel()];
        w.chunks_exact_mut(t.shape[1]).enumerate().for_each(|(r, row)| m.row_into(r, row));
        w
    };
    for (i, p) in plan.iter().enumerate() {
        let want = match &p.kind {
            PlannedKind::Linear(t) => pack_dense(
                &loader.matrix_of(t).unwrap(),
                &dense_layout(t.shape[0], t.shape[1], Bits::Int8, 128, &p.name).unwrap(),
            ),
            PlannedKind::W13 { gate, up } => {
                let q = |t: &TensorSpec| quantize(&f32_rows(t), t.shape[0], t.shape[1], Bits::Int8, 128);
                krasis_quant::cpu_layout::pack_w13(&q(gate), &q(up)).unwrap().0
            }
            PlannedKind::KvB { t, dims, uk } => {
                // Head h's W_UKᵀ [latent, nope] or W_UV [v_dim, latent], quantised and packed alone.
                let w = f32_rows(t);
                let lat = dims.latent;
                let mut out = Vec::new();
                for h in 0..dims.heads {
                    let base = h * (dims.nope + dims.v_dim);
                    let (rows, k, m): (usize, usize, Vec<f32>) = if *uk {
                        (
                            lat,
                            dims.nope,
                            (0..lat)
                                .flat_map(|j| (0..dims.nope).map(move |n| (base + n, j)))
                                .map(|(r, j)| w[r * lat + j])
                                .collect(),
                        )
                    } else {
                        (dims.v_dim, lat, w[(base + dims.nope) * lat..(base + dims.nope + dims.v_dim) * lat].to_vec())
                    };
                    out.extend(krasis_quant::cpu_layout::pack(&quantize(&m, rows, k, Bits::Int8, 128.min(k))));
                }
                out
            }
        };
        assert_eq!(c.entry(i), want.as_slice(), "{}", p.name);
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
    let names =
        planned_entries(&spec).unwrap().iter().flat_map(|p| p.tensors().into_iter().map(|t| t.name.clone())).collect();
    let source = NoDenseLinears(files.weights(), names);
    let pool = crate::cpu::load::start_pool(Some(2), &mut Vec::new()).unwrap();
    let cached = cached_linears(Arc::new(c), Bits::Int8, pool);
    let refuse = |_: crate::model::linear::DenseLinear, name: &str| -> Result<Box<dyn LinearOp>> {
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
    let pool = crate::cpu::load::start_pool(Some(2), &mut Vec::new()).unwrap();
    let (ec, _) = open_expert_cache(&files, ExpertWidthRule::Uniform(Bits::Int4), 128, Some(&cache), &pool).unwrap();
    let (dc, _) = open_dense_cache(&files, Bits::Int8, 128, Some(&cache)).unwrap();
    let q = cpu_estimate(spec, Some(files.weights()), WeightBits::Int4, WeightBits::Int8, 128);
    let r = cpu_estimate(spec, Some(files.weights()), WeightBits::Int4, WeightBits::Bf16, 128);
    assert_eq!(q.expert_bytes, ec.resident_bytes() as u64);
    // Only the cache's entries change between the two: by the dense cache's pages against the
    // linears' bf16 bytes and kv_b's f32 ones.
    let plan = planned_entries(spec).unwrap();
    let unpacked: u64 = plan
        .iter()
        .flat_map(|p| p.tensors().into_iter().map(move |t| (p, t)))
        .map(|(p, t)| {
            t.numel() as u64
                * if matches!(p.kind, PlannedKind::KvB { uk: true, .. }) {
                    4
                } else if matches!(p.kind, PlannedKind::KvB { .. }) {
                    0
                } else {
                    2
                }
        })
        .sum();
    assert_eq!(q.dense_bytes + unpacked, r.dense_bytes + dc.resident_bytes() as u64);
    // The embedding's rows are read from the file, not the mapping: nothing of it is counted,
    // and a token of context costs its KV rows alone.
    assert_eq!(q.total_after(1000, 0) - q.total_after(0, 0), 1000 * q.kv_bytes_per_token);
}

#[test]
fn a_tied_lm_head_left_as_stored_holds_the_embedding_once() {
    let tmp = tempfile::tempdir().unwrap();
    let files = ModelFiles::open(&tiny(tmp.path())).unwrap();
    let mut tied = files.spec().clone();
    tied.tie_word_embeddings = true;
    let untied = cpu_estimate(files.spec(), None, WeightBits::Int4, WeightBits::Bf16, 128);
    let t = cpu_estimate(&tied, None, WeightBits::Int4, WeightBits::Bf16, 128);
    // Untied: the LM head's own bytes, nothing for the embedding (its rows are read from the
    // file). Tied: the embedding's pages (the same size) read whole by the LM head.
    assert_eq!(t.dense_bytes, untied.dense_bytes);
    // Quantised, the tied head is a cache entry of the untied head's size, and the embedding
    // again holds nothing.
    let q = cpu_estimate(&tied, None, WeightBits::Int4, WeightBits::Int8, 128);
    let qu = cpu_estimate(files.spec(), None, WeightBits::Int4, WeightBits::Int8, 128);
    assert_eq!(q.dense_bytes, qu.dense_bytes);
    let plan = planned_entries(&tied).unwrap();
    assert_eq!(plan.last().unwrap().name, "lm_head.weight (tied to model.embed_tokens.weight)");
}
