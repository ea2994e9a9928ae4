//! GGUF input of the gated-DeltaNet hybrids: llama.cpp's converter output of fixtures-next's
//! `qwen3next-tiny` (GGUF arch `qwen3next`) and `qwen35moe-tiny` (`qwen35moe`), made by
//! scripts/make-gguf-fixtures.sh (through scripts/gguf-convert.py, `--no-mtp`), on the CPU
//! reference path.
//!
//! - BF16: the spec from the GGUF metadata is the one config.json gives, except `norm_plus_one`
//!   (the GGUF stores the gains `1 + w`) and the eps (through f32); every canonical tensor the
//!   GGUF serves equals the safetensors checkpoint's (the norms as `1 + w` in f32, `A_log` to
//!   f32 rounding of its exponential); the model matches the fixture's float64 oracle to 1e-4
//!   (hidden states, prefill and greedy logits; greedy ids identical). transformers run on the
//!   BF16 file's dequantised weights (scripts/gguf-dequant-reference.py) gives that oracle bit
//!   for bit, so this is also the file's own oracle.
//! - Q8_0: against transformers in float64 on the Q8_0 file's dequantised weights
//!   (`reference-q8_0.safetensors`, scripts/gguf-dequant-reference.py), the same bars.
//!
//! - BF16 on the GPU engine and the hybrid (routed experts on the CPU), BF16 experts: within
//!   `quant_bounds.json`'s BF16 rule on the prefill and the greedy decode steps, the first greedy
//!   token exact (as `deltanet_oracle` on the safetensors checkpoint). Skips visibly without a GPU.
//!
//! Without the GGUF fixtures the tests skip visibly; `KRASIS_REQUIRE_FIXTURES=1` makes that a
//! failure.

use std::path::PathBuf;

use krasis_model::cpu::quantized::WeightBits;
use krasis_model::cpu::Model;
use krasis_model::gpu::{GpuExpertCache, GpuModel, GpuOptions};
use krasis_model::model::tensors::{expected_tensors, TensorRole};
use krasis_model::source::files::ModelFiles;
use krasis_model::text::sampling::argmax;
use krasis_tests::{
    check_against_reference, fidelity, fixture_next, gguf_fixtures_dir, gpu_available, load_reference,
    load_reference_file, missing_fixture, quant_bound,
};

/// The fixture's directory and its GGUF twin `model-<kind>.gguf` (with `reference-<kind>` when
/// `own_reference`), or `None` after a visible skip.
fn twin(name: &str, kind: &str, own_reference: bool) -> Option<(PathBuf, PathBuf)> {
    let dir = fixture_next(name)?;
    let root = gguf_fixtures_dir()?;
    let gguf = root.join(name).join(format!("model-{kind}.gguf"));
    let reference = gguf.with_file_name(format!("reference-{kind}.safetensors"));
    let mut missing = vec![];
    if !gguf.exists() {
        missing.push(gguf.display().to_string());
    }
    if own_reference && !reference.exists() {
        missing.push(reference.display().to_string());
    }
    if !missing.is_empty() {
        let msg = format!("{} missing (scripts/make-gguf-fixtures.sh makes it)", missing.join(" and "));
        missing_fixture(&msg);
        return None;
    }
    Some((dir, gguf))
}

/// The BF16 twin: its spec, its tensors against the checkpoint's, and the oracle.
fn bf16_twin(name: &str) {
    let Some((dir, gguf)) = twin(name, "bf16", false) else { return };
    let files = ModelFiles::open(&gguf).unwrap_or_else(|e| panic!("{name}: {e}"));
    let hub = ModelFiles::open(&dir).unwrap();
    let (mut a, b) = (files.spec().clone(), hub.spec().clone());
    assert!(b.norm_plus_one && !a.norm_plus_one, "{name}: the GGUF stores the norms' gains 1 + w");
    assert_eq!(a.expert_source_bits, vec![[16; 3]; a.moe_layers().count()], "{name}: expert source types");
    assert!((a.rms_norm_eps - b.rms_norm_eps).abs() <= 1e-6 * b.rms_norm_eps, "{name}: eps");
    a.norm_plus_one = b.norm_plus_one;
    a.expert_source_bits = b.expert_source_bits.clone();
    a.expert_source_types = b.expert_source_types.clone();
    a.rms_norm_eps = b.rms_norm_eps;
    assert_eq!(a, b, "{name}: spec from GGUF metadata differs from config.json's");

    // Every canonical tensor, served by the GGUF, against the checkpoint's.
    let mut a_logs = 0;
    for t in expected_tensors(files.spec()) {
        let g = files.source().tensor(&t.name).unwrap_or_else(|e| panic!("{name}: {e}"));
        let h = hub.source().tensor(&t.name).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(g.shape, h.shape, "{name}: `{}` shape", t.name);
        let (g, h) = (g.view().to_f32_vec().unwrap(), h.view().to_f32_vec().unwrap());
        if t.name.ends_with(".A_log") {
            // −exp(A_log) went through f32 and back: the decay e^A_log within 3 f32 ulps.
            for (x, y) in g.iter().zip(&h) {
                let (ex, ey) = (x.exp() as f64, y.exp() as f64);
                assert!((ex - ey).abs() <= 3.0 * f32::EPSILON as f64 * ey, "{name}: `{}` {x} vs {y}", t.name);
            }
            a_logs += 1;
            continue;
        }
        // The zero-centred norms (role in the hub spec) are stored as 1 + w, computed in f32.
        let centred = hub_role(&b, &t.name) == Some(TensorRole::CentredNorm);
        let want: Vec<f32> = if centred { h.iter().map(|w| w + 1.0).collect() } else { h };
        assert!(g == want, "{name}: `{}` differs from the checkpoint's", t.name);
    }
    assert_eq!(a_logs, b.mixers.iter().filter(|m| **m == krasis_model::spec::MixerKind::GatedDeltaNet).count());

    let model = Model::from_files(&files).unwrap_or_else(|e| panic!("{name}: load failed: {e}"));
    for line in check_against_reference(name, &model, &load_reference(&dir)) {
        eprintln!("gguf bf16 {line}");
    }
}

/// The role of a tensor in the inventory of `spec`.
fn hub_role(spec: &krasis_model::spec::ModelSpec, name: &str) -> Option<TensorRole> {
    expected_tensors(spec).into_iter().find(|t| t.name == name).map(|t| t.role)
}

/// The Q8_0 twin, dequantised exactly, against transformers on its dequantised weights.
fn q8_0_twin(name: &str) {
    let Some((_, gguf)) = twin(name, "q8_0", true) else { return };
    let files = ModelFiles::open(&gguf).unwrap_or_else(|e| panic!("{name}: {e}"));
    let model = Model::from_files(&files).unwrap_or_else(|e| panic!("{name} q8_0: load failed: {e}"));
    let own = gguf.with_file_name("reference-q8_0.safetensors");
    for line in check_against_reference(name, &model, &load_reference_file(&own)) {
        eprintln!("gguf q8_0 (dequantised) vs float64 on its weights: {line}");
    }
}

/// The BF16 twin on the GPU engine and the hybrid, BF16 experts (module docs).
fn gpu_bf16_twin(name: &str) {
    if !gpu_available(name) {
        return;
    }
    let Some((dir, gguf)) = twin(name, "bf16", false) else { return };
    let r = load_reference(&dir);
    let v = r.prefill_logits.len() / r.prompt_ids.len();
    let b = quant_bound(dir.parent().unwrap(), name, "bf16");
    let bar = 3.0 * (1.0 - b.mean_cos) + 1e-4;
    let tmp = tempfile::tempdir().unwrap();
    let gpu = GpuOptions {
        kv_tokens: Some(512),
        expert_cache: GpuExpertCache::In(Some(tmp.path().to_path_buf())),
        ..GpuOptions::default()
    };
    let cpu = krasis_model::cpu::load::EngineOptions {
        expert_bits: WeightBits::Bf16,
        cache_dir: Some(tmp.path().to_path_buf()),
        threads: Some(2),
        ..Default::default()
    };
    for device in ["gpu", "hybrid"] {
        let m = match device {
            "gpu" => GpuModel::load(&gguf, &gpu),
            _ => GpuModel::load_hybrid(&gguf, &gpu, &cpu),
        }
        .unwrap_or_else(|e| panic!("{name} gguf {device}: {e}"));
        let mut s = m.new_session().unwrap();
        let l = m.forward_logits(&mut s, &r.prompt_ids, true).unwrap();
        // greedy_logits[i + 1] chose greedy_ids[i + 1] after greedy_ids[i] was fed.
        let n = r.greedy_ids.len();
        let mut steps = Vec::with_capacity((n - 1) * v);
        for &id in &r.greedy_ids[..n - 1] {
            steps.extend(m.forward_logits(&mut s, &[id], false).unwrap());
        }
        for (what, got, want) in [("prefill", &l, &r.prefill_logits[..]), ("decode", &steps, &r.greedy_logits[v..])] {
            let f = fidelity(got, want, v);
            eprintln!(
                "{name} gguf {device} bf16 {what}: 1-cos {:.3e} (bar {bar:.3e}), top1 {:.2} (bar {:.2})",
                1.0 - f.mean_cos,
                f.top1,
                b.top1 - 0.1
            );
            assert!(
                1.0 - f.mean_cos <= bar,
                "{name} gguf {device} {what}: 1 - mean cos {:.3e} > {bar:.3e}",
                1.0 - f.mean_cos
            );
            assert!(f.top1 >= b.top1 - 0.1, "{name} gguf {device} {what}: top-1 {:.2} < {:.2} - 0.1", f.top1, b.top1);
        }
        assert_eq!(argmax(&l[l.len() - v..]) as u32, r.greedy_ids[0], "{name} gguf {device}: first greedy token");
    }
}

#[test]
fn qwen3next_bf16_twin_on_the_gpu_and_hybrid_within_the_bf16_bounds() {
    gpu_bf16_twin("qwen3next-tiny");
}

#[test]
fn qwen35moe_bf16_twin_on_the_gpu_and_hybrid_within_the_bf16_bounds() {
    gpu_bf16_twin("qwen35moe-tiny");
}

#[test]
fn qwen3next_bf16_twin_matches_the_checkpoint_and_the_oracle() {
    bf16_twin("qwen3next-tiny");
}

#[test]
fn qwen35moe_bf16_twin_matches_the_checkpoint_and_the_oracle() {
    bf16_twin("qwen35moe-tiny");
}

#[test]
fn qwen3next_q8_0_twin_matches_float64_on_its_weights() {
    q8_0_twin("qwen3next-tiny");
}

#[test]
fn qwen35moe_q8_0_twin_matches_float64_on_its_weights() {
    q8_0_twin("qwen35moe-tiny");
}
