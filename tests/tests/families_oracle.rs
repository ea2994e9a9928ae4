//! The families of `../shared/fixtures-next` that Krasis runs (float64 transformers oracles, README
//! there), on every path:
//!
//! - the CPU reference path against the oracle: per-layer hidden states, prefill logits and every
//!   greedy step at rel ≤ 1e-4, greedy ids identical (`check_against_reference`);
//! - the quantised CPU experts (INT8, INT4) within `quant_bounds.json`'s rule: (1 − mean cos) ≤
//!   2 × an ideal quantisation's + 1e-4, top-1 ≥ its − 0.1, and at INT8 the first greedy token
//!   wherever the ideal keeps it;
//! - the whole GPU (BF16 and INT4 experts) and the hybrid (BF16 and INT4 CPU experts) against the
//!   transformers-BF16 bar of `quant_bounds.json` (1 − mean cos ≤ 3 × its + 1e-4 for BF16, plus
//!   the INT4 ideal's error for INT4 experts; top-1 ≥ its − 0.1). Skipped visibly without a GPU;
//! - for the families llama.cpp writes (Mixtral, Qwen2-MoE, MiniMax-M2, GLM-4.x, gpt-oss), the BF16
//!   GGUF twin made by llama.cpp's converter: its spec is config.json's, its reference path
//!   matches the oracle, and the whole GPU on it is within the BF16 bar; the Q8_0 twin on the CPU
//!   reference path against transformers in float64 on that file's dequantised weights
//!   (`reference-q8_0.safetensors`, `scripts/gguf-dequant-reference.py`), the same bar; and the
//!   MXFP4 experts of gpt-oss's twin kept as stored at `auto`.
//!
//! The fixture list grows with each family: `mixtral-tiny` (Mixtral: GQA without qk-norm,
//! softmax top-2 renormalised, `block_sparse_moe` names); `glm4moe-tiny` (GLM-4.5-Air: q/k/v
//! biases, RoPE on the first half of each 48-dim head with half-split pairs, a dense first
//! layer, sigmoid routing with 4 groups and a correction bias, a shared expert) and
//! `glm4moe-qknorm-tiny` (GLM-4.5/4.6/4.7: the same with per-head qk-norm, one group);
//! `qwen2moe-tiny` (Qwen2-MoE: MHA with q/k/v biases, softmax top-4 not renormalised, a shared
//! expert scaled by its sigmoid gate); `minimaxm2-tiny` (MiniMax-M2: qk-norm over the whole q and
//! k projections, RoPE on the first 16 of 32 dims from `rotary_dim`, sigmoid routing with the
//! correction bias beside the gate, no groups, `block_sparse_moe` names).

use krasis_model::cpu::Model;
use krasis_model::gpu::{GpuModel, GpuOptions};
use krasis_model::source::files::ModelFiles;
use krasis_tests::{
    check_against_reference, fidelity, fixture_next, gguf_fixtures_dir, gpu_available, load_reference,
    load_reference_file, quant_bound, Reference,
};

fn vocab(r: &Reference) -> usize {
    r.prefill_logits.len() / r.prompt_ids.len()
}

fn reference_path(name: &str) {
    let Some(dir) = fixture_next(name) else { return };
    let model = Model::load(&dir).unwrap_or_else(|e| panic!("{name}: load failed: {e}"));
    for line in check_against_reference(name, &model, &load_reference(&dir)) {
        eprintln!("{line}");
    }
}

/// The BF16 GGUF twin of the fixture (llama.cpp's own converter, `scripts/make-gguf-fixtures.sh`)
/// on the CPU reference path: the spec its metadata gives is config.json's (but for what GGUF
/// stores otherwise: the rotary pairing of llama.cpp's permuted q/k rows, eps through f32, the
/// experts' stored types), and it matches the oracle as the safetensors checkpoint does.
fn gguf_twin(name: &str) {
    gguf_twin_stored(name, 16);
}

/// [`gguf_twin`] for a file whose routed experts are stored at `expert_bits` (4: the MXFP4 that
/// llama.cpp's converter copies from a gpt-oss checkpoint, served dequantised exactly).
fn gguf_twin_stored(name: &str, expert_bits: u32) {
    let Some(dir) = fixture_next(name) else { return };
    let Some(gguf) = bf16_twin(name) else { return };
    let files = ModelFiles::open(&gguf).unwrap_or_else(|e| panic!("{name}: {e}"));
    let (mut a, b) = (files.spec().clone(), ModelFiles::open(&dir).unwrap().spec().clone());
    assert_eq!(a.expert_source_bits, vec![[expert_bits; 3]; a.moe_layers().count()], "{name}: expert source types");
    a.expert_source_bits = b.expert_source_bits.clone();
    a.expert_source_types = b.expert_source_types.clone();
    // A GGUF says how its experts are stored by their tensor types, not by a config field.
    a.source_quant = b.source_quant.clone();
    a.rms_norm_eps = b.rms_norm_eps;
    a.rope.pairing = b.rope.pairing;
    assert_eq!(a, b, "{name}: spec from GGUF metadata differs from config.json's");
    let model = Model::from_files(&files).unwrap_or_else(|e| panic!("{name}: load failed: {e}"));
    let r = load_reference(&dir);
    for line in check_against_reference(name, &model, &r) {
        eprintln!("gguf bf16 {line}");
    }
    // The whole GPU on the GGUF (its rotary pairs interleaved): the BF16 bar of gpu_and_hybrid.
    if !gpu_available(name) {
        return;
    }
    let b = quant_bound(dir.parent().unwrap(), name, "bf16");
    let bar = 3.0 * (1.0 - b.mean_cos) + 1e-4;
    let m = GpuModel::load(&gguf, &GpuOptions { kv_tokens: Some(512), ..GpuOptions::default() })
        .unwrap_or_else(|e| panic!("{name} gguf gpu: {e}"));
    let mut s = m.new_session().unwrap();
    let l = m.forward_logits(&mut s, &r.prompt_ids, true).unwrap();
    let f = fidelity(&l, &r.prefill_logits, vocab(&r));
    eprintln!("{name} gguf gpu bf16: 1-cos {:.3e} (bar {bar:.3e}), top1 {:.2}", 1.0 - f.mean_cos, f.top1);
    assert!(1.0 - f.mean_cos <= bar, "{name} gguf gpu: 1 - mean cos {:.3e} > {bar:.3e}", 1.0 - f.mean_cos);
    assert!(f.top1 >= b.top1 - 0.1, "{name} gguf gpu: top-1 {:.2} < {:.2} - 0.1", f.top1, b.top1);
}

/// The BF16 GGUF twin of fixture `name` (`scripts/make-gguf-fixtures.sh`), or a visible skip (a
/// failure under `KRASIS_REQUIRE_FIXTURES=1`) when it is missing.
fn bf16_twin(name: &str) -> Option<std::path::PathBuf> {
    let gguf = gguf_fixtures_dir()?.join(name).join("model-bf16.gguf");
    if gguf.exists() {
        return Some(gguf);
    }
    let msg = format!("{} missing (scripts/make-gguf-fixtures.sh makes it)", gguf.display());
    krasis_tests::missing_fixture(&msg);
    None
}

/// `auto` on the GGUF twin of `gptoss-mxfp4-tiny` keeps its ggml MXFP4 experts as stored: the
/// CPU expert cache's records are byte for byte those `auto` builds from the safetensors
/// checkpoint (the same codes and E8M0 scales; ggml's nibble order moved to Krasis'), and the run
/// on them matches the oracle at rel ≤ 1e-4, greedy ids identical.
fn gguf_mxfp4_experts_kept_as_stored(name: &str) {
    use krasis_model::cpu::quantized::{cache_fp4, open_expert_cache, WeightBits};
    use krasis_model::placement::precision::ExpertWidthRule;
    use krasis_quant::fp4::Fp4Kind;
    let Some(dir) = fixture_next(name) else { return };
    let Some(gguf) = bf16_twin(name) else { return };
    let tmp = tempfile::tempdir().unwrap();
    let loaded = krasis_tests::load_quantized(&gguf, WeightBits::Auto, WeightBits::Bf16, tmp.path());
    let described = loaded.model.experts_description();
    assert!(described.contains("mxfp4 (as stored)"), "{name} gguf: {described}");
    let pool = loaded.pool.as_ref().expect("a worker pool for the quantised experts");
    let group = krasis_quant::group::DEFAULT_GROUP_SIZE;
    let (g_files, s_files) = (ModelFiles::open(&gguf).unwrap(), ModelFiles::open(&dir).unwrap());
    let (g_dir, s_dir) = (tmp.path().join("gguf"), tmp.path().join("safetensors"));
    let (g, _) = open_expert_cache(&g_files, ExpertWidthRule::Auto, group, Some(&g_dir), pool).unwrap();
    let (st, _) = open_expert_cache(&s_files, ExpertWidthRule::Auto, group, Some(&s_dir), pool).unwrap();
    assert_eq!(cache_fp4(g.header()), Some(Fp4Kind::Mxfp4), "{name} gguf: the expert cache's format");
    let spec = g_files.spec();
    for li in 0..spec.moe_layers().count() {
        for e in 0..spec.routed_experts() {
            assert!(g.w13(li, e) == st.w13(li, e), "{name}: MoE layer {li} expert {e}: gate/up record differs");
            assert!(g.w2(li, e) == st.w2(li, e), "{name}: MoE layer {li} expert {e}: down record differs");
        }
    }
    for line in
        check_against_reference(&format!("{name} gguf (mxfp4 experts as stored)"), &loaded.model, &load_reference(&dir))
    {
        eprintln!("{line}");
    }
}

/// A GGUF MXFP4 expert with a NaN scale (E8M0 0xff) is refused when `auto` builds the expert
/// cache, with an error naming the expert's tensor and the file; nothing is left in the cache
/// directory that a later run would accept.
fn gguf_mxfp4_nan_scale_is_an_error(name: &str) {
    use krasis_model::cpu::quantized::WeightBits;
    let Some(gguf) = bf16_twin(name) else { return };
    let tmp = tempfile::tempdir().unwrap();
    let model = krasis_model::source::gguf::GgufModel::open(&gguf).unwrap();
    let (_, t) = model.tensor_info("blk.1.ffn_up_exps.weight").expect("blk.1.ffn_up_exps.weight");
    let at = t.data.start + 17 * 3; // the fourth block's scale byte (expert 0)
    drop(model);
    let mut bytes = std::fs::read(&gguf).unwrap();
    bytes[at] = 0xff;
    let bad = tmp.path().join("bad.gguf");
    std::fs::write(&bad, &bytes).unwrap();
    let cache = tmp.path().join("cache");
    let e = krasis_tests::load_error(&bad, WeightBits::Auto, WeightBits::Bf16, &cache);
    eprintln!("{name}: {e}");
    assert!(e.contains("model.layers.1.mlp.experts.0.up_proj.weight") && e.contains("bad.gguf"), "{name}: {e}");
    assert!(e.contains("NaN"), "{name}: {e}");
    let left: Vec<_> =
        std::fs::read_dir(&cache).map(|d| d.flatten().map(|f| f.file_name()).collect()).unwrap_or_default();
    assert!(left.iter().all(|f| !f.to_string_lossy().ends_with(".bin")), "{name}: left in the cache: {left:?}");
}

/// The Q8_0 GGUF twin (llama.cpp's converter) on the CPU reference path against transformers in
/// float64 on the file's dequantised weights (`reference-q8_0.safetensors` beside it, made by
/// `scripts/gguf-dequant-reference.py`): rel ≤ 1e-4, greedy ids identical.
fn gguf_q8_0_twin(name: &str) {
    let Some(dir) = fixture_next(name) else { return };
    let Some(root) = gguf_fixtures_dir() else { return };
    let gguf = root.join(name).join("model-q8_0.gguf");
    let own = root.join(name).join("reference-q8_0.safetensors");
    if !gguf.exists() || !own.exists() {
        let msg = format!("{} or its reference missing (scripts/make-gguf-fixtures.sh makes them)", gguf.display());
        krasis_tests::missing_fixture(&msg);
        return;
    }
    let files = ModelFiles::open(&gguf).unwrap_or_else(|e| panic!("{name} q8_0: {e}"));
    assert_eq!(
        files.spec().moe.as_ref().map(|m| m.routing),
        ModelFiles::open(&dir).unwrap().spec().moe.as_ref().map(|m| m.routing),
        "{name} q8_0: routing"
    );
    let model = Model::from_files(&files).unwrap_or_else(|e| panic!("{name} q8_0: load failed: {e}"));
    for line in check_against_reference(name, &model, &load_reference_file(&own)) {
        eprintln!("gguf q8_0 (dequantised) vs float64 on its weights: {line}");
    }
}

/// Reference path, quantised CPU experts, GPU and hybrid for one fixture.
macro_rules! family_tests {
    ($module:ident, $fixture:expr) => {
        mod $module {
            #[test]
            fn reference_path_matches_the_oracle() {
                super::reference_path($fixture);
            }
            #[test]
            fn quantised_cpu_experts_within_the_ideal_bounds() {
                krasis_tests::family_checks::quantised_cpu_experts($fixture);
            }
            #[test]
            fn gpu_and_hybrid_within_the_bf16_bounds() {
                krasis_tests::family_checks::gpu_and_hybrid($fixture, false);
            }
        }
    };
}

/// The GGUF twin's test for a fixture whose family llama.cpp writes (with `q8_0`, its Q8_0 twin's
/// too).
macro_rules! gguf_twin_test {
    ($module:ident, $fixture:expr) => {
        mod $module {
            #[test]
            fn gguf_bf16_twin_matches_the_oracle() {
                super::gguf_twin($fixture);
            }
        }
    };
    ($module:ident, $fixture:expr, q8_0) => {
        mod $module {
            #[test]
            fn gguf_bf16_twin_matches_the_oracle() {
                super::gguf_twin($fixture);
            }
            #[test]
            fn gguf_q8_0_twin_matches_float64_on_its_weights() {
                super::gguf_q8_0_twin($fixture);
            }
        }
    };
}

family_tests!(mixtral, "mixtral-tiny");
gguf_twin_test!(mixtral_gguf, "mixtral-tiny", q8_0);
family_tests!(glm4moe, "glm4moe-tiny");
gguf_twin_test!(glm4moe_gguf, "glm4moe-tiny", q8_0);
family_tests!(glm4moe_qknorm, "glm4moe-qknorm-tiny");
gguf_twin_test!(glm4moe_qknorm_gguf, "glm4moe-qknorm-tiny", q8_0);
family_tests!(qwen2moe, "qwen2moe-tiny");
gguf_twin_test!(qwen2moe_gguf, "qwen2moe-tiny", q8_0);
family_tests!(minimaxm2, "minimaxm2-tiny");
gguf_twin_test!(minimaxm2_gguf, "minimaxm2-tiny", q8_0);
// gpt-oss runs in tests/gptoss_oracle; its GGUF twin (llama.cpp's converter) here.
gguf_twin_test!(gptoss_gguf, "gptoss-tiny", q8_0);
mod gptoss_mxfp4_gguf {
    #[test]
    fn gguf_bf16_twin_with_mxfp4_experts_matches_the_oracle() {
        super::gguf_twin_stored("gptoss-mxfp4-tiny", 4);
    }
    #[test]
    fn gguf_q8_0_twin_matches_float64_on_its_weights() {
        super::gguf_q8_0_twin("gptoss-mxfp4-tiny");
    }
    #[test]
    fn auto_keeps_the_gguf_mxfp4_experts_as_stored() {
        super::gguf_mxfp4_experts_kept_as_stored("gptoss-mxfp4-tiny");
    }
    #[test]
    fn a_nan_mxfp4_scale_in_the_gguf_is_an_error_naming_the_tensor() {
        super::gguf_mxfp4_nan_scale_is_an_error("gptoss-mxfp4-tiny");
    }
}
