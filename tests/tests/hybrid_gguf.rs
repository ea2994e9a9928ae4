//! `--device hybrid` on GGUF input with `--cpu-expert-bits auto`: the expert cache gets each
//! projection's width from the file's types (w13 INT4 from Q4_0, w2 INT8 where the file holds
//! Q8_0 — the `q4_0_mixed` fixtures — or INT8 throughout on the small fixtures' Q4_K_M, whose
//! experts llama-quantize stores in Q5_0/Q8_0), and the hybrid engine runs that mixed cache through
//! the same CPU expert backend as the CPU path. Held to the bar `gguf_oracle.rs` holds the CPU path
//! to: against the HF oracle, (1 − mean cosine) ≤ the exactly dequantised file's own error plus
//! 3 × the ideal INT4 error plus 1e-4; and the hybrid's logits are printed beside the CPU path's
//! on the same cache.
//!
//! Without a GPU, or without the GGUF fixtures (`scripts/make-gguf-fixtures.sh`), every test
//! prints its SKIPPED line and passes; `KRASIS_REQUIRE_GPU=1` / `KRASIS_REQUIRE_FIXTURES=1` fail.

use krasis_model::cpu::load::EngineOptions;
use krasis_model::cpu::quantized::WeightBits;
use krasis_model::gpu::{GpuModel, GpuOptions};
use krasis_tests::{fidelity, gguf_fixtures_dir, gpu_fixture, prefill_logits, quant_bound, GpuFixture};

/// KV tokens per session: the fixtures' prompts fit easily.
const TEST_KV_TOKENS: usize = 512;

fn check(name: &str, kind: &str) {
    let Some(GpuFixture { root, dir: _, reference: r, vocab }) = gpu_fixture(name) else { return };
    let Some(gguf_root) = gguf_fixtures_dir() else { return };
    let gguf = gguf_root.join(name).join(format!("model-{kind}.gguf"));
    if !gguf.exists() {
        let msg = format!("{} missing (KRASIS_GGUF_Q4KM=1 scripts/make-gguf-fixtures.sh)", gguf.display());
        krasis_tests::missing_fixture(&msg);
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let exact = prefill_logits(&gguf, WeightBits::Bf16, WeightBits::Bf16, tmp.path(), &r.prompt_ids);
    let exact_err = 1.0 - fidelity(&exact, &r.prefill_logits, vocab).mean_cos;
    let cpu = prefill_logits(&gguf, WeightBits::Auto, WeightBits::Bf16, tmp.path(), &r.prompt_ids);

    let gpu = GpuOptions { kv_tokens: Some(TEST_KV_TOKENS), ..GpuOptions::default() };
    let opts = EngineOptions {
        expert_bits: WeightBits::Auto,
        cache_dir: Some(tmp.path().to_path_buf()),
        threads: Some(2),
        ..EngineOptions::default()
    };
    let m = GpuModel::load_hybrid(&gguf, &gpu, &opts).unwrap_or_else(|e| panic!("{}: {e}", gguf.display()));
    let mut s = m.new_session().unwrap();
    let hybrid = m.forward_logits(&mut s, &r.prompt_ids, true).unwrap();

    let ideal = quant_bound(&root, name, "int4");
    let bar = exact_err + 3.0 * (1.0 - ideal.mean_cos) + 1e-4;
    let f = fidelity(&hybrid, &r.prefill_logits, vocab);
    let c = fidelity(&cpu, &r.prefill_logits, vocab);
    let vs_cpu = fidelity(&hybrid, &cpu, vocab);
    eprintln!(
        "{name} gguf {kind}, auto widths: hybrid 1-cos {:.3e}, CPU path 1-cos {:.3e} (bar {bar:.3e}; the file \
         exactly {exact_err:.3e}); hybrid vs CPU path: mean cos {:.6}, top1 {:.2}",
        1.0 - f.mean_cos,
        1.0 - c.mean_cos,
        vs_cpu.mean_cos,
        vs_cpu.top1
    );
    assert!(1.0 - f.mean_cos <= bar, "{name} {kind}: hybrid 1 - mean cos {:.3e} > {bar:.3e}", 1.0 - f.mean_cos);
}

#[test]
fn dsv2_grouped_q4_0_mixed() {
    check("dsv2-grouped-tiny", "q4_0_mixed");
}

#[test]
fn dsv3_q4_0_mixed() {
    check("dsv3-tiny", "q4_0_mixed");
}

#[test]
fn dsv3_q4_k_m() {
    check("dsv3-tiny", "q4_k_m");
}
