//! The checks of `quant_fidelity.rs`, shared with `quant_fidelity_bf16.rs` (the same checks with
//! the prefill matmuls on emulated BF16 tiles).
#![allow(dead_code)] // each test file uses part of them

use std::path::Path;

use krasis_model::cpu::quantized::WeightBits;
use krasis_model::text::sampling::argmax;
use krasis_tests::{fidelity, fixtures_dir, load_reference, prefill_logits, quant_bound};

pub fn prefill(dir: &Path, experts: WeightBits, dense: WeightBits, cache: &Path) -> Vec<f32> {
    prefill_logits(dir, experts, dense, cache, &load_reference(dir).prompt_ids)
}

pub fn check(name: &str) {
    let Some(root) = fixtures_dir() else { return };
    let dir = root.join(name);
    let r = load_reference(&dir);
    let vocab = r.prefill_logits.len() / r.prompt_ids.len();
    let tmp = tempfile::tempdir().unwrap();
    eprintln!("{name}: {}", krasis_cpu::prefill_bf16::describe());
    let last = |l: &[f32]| argmax(&l[l.len() - vocab..]) as u32;
    for (kind, bits) in [("int8", WeightBits::Int8), ("int4", WeightBits::Int4)] {
        let ideal = quant_bound(&root, name, kind);
        let logits = prefill(&dir, bits, WeightBits::Bf16, tmp.path());
        let f = fidelity(&logits, &r.prefill_logits, vocab);
        let bar = 2.0 * (1.0 - ideal.mean_cos) + 1e-4;
        eprintln!(
            "{name} experts {kind}: 1-cos {:.3e} (bar {bar:.3e}, ideal {:.3e}), top1 {:.2} (ideal {:.2}), min cos {:.5}",
            1.0 - f.mean_cos,
            1.0 - ideal.mean_cos,
            f.top1,
            ideal.top1,
            f.min_cos
        );
        assert!(1.0 - f.mean_cos <= bar, "{name} {kind}: 1 - mean cos {:.3e} > {bar:.3e}", 1.0 - f.mean_cos);
        assert!(f.top1 >= ideal.top1 - 0.1, "{name} {kind}: top-1 {:.2} < ideal {:.2} - 0.1", f.top1, ideal.top1);
        if kind == "int8" && ideal.first_token_same == Some(true) {
            assert_eq!(last(&logits), r.greedy_ids[0], "{name} int8: first greedy token changed");
        }
    }
}

/// `--cpu-dense-bits 8` on INT8 experts. No 8-bit weight scheme meets this bar on all six
/// fixtures (issue #3; `dense_fidelity_diag.rs` measures why): the error is all weight rounding
/// (split activations change nothing), and 8-bit weights move the residual stream by ~1.5 %,
/// which flips near-tied routes (margins down to ~1e-3 in score) on some fixture whichever group
/// size / scale rule is used; simulated 10-bit weights pass all six. Run with `--ignored`.
pub fn check_dense(name: &str) {
    let Some((root, f)) = dense_int8(name) else { return };
    let ideal8 = quant_bound(&root, name, "int8");
    let bar = 4.0 * (1.0 - ideal8.mean_cos) + 2e-4;
    eprintln!("{name} experts int8 + dense int8: 1-cos {:.3e} (bar {bar:.3e}), top1 {:.2}", 1.0 - f.mean_cos, f.top1);
    assert!(1.0 - f.mean_cos <= bar, "{name} dense int8: 1 - mean cos {:.3e} > {bar:.3e}", 1.0 - f.mean_cos);
}

/// The fixtures' root and the fidelity of `--cpu-dense-bits 8` on INT8 experts (`None` without
/// fixtures).
pub fn dense_int8(name: &str) -> Option<(std::path::PathBuf, krasis_tests::Fidelity)> {
    let root = fixtures_dir()?;
    let dir = root.join(name);
    let r = load_reference(&dir);
    let vocab = r.prefill_logits.len() / r.prompt_ids.len();
    let tmp = tempfile::tempdir().unwrap();
    let logits = prefill(&dir, WeightBits::Int8, WeightBits::Int8, tmp.path());
    Some((root, fidelity(&logits, &r.prefill_logits, vocab)))
}

/// `--cpu-dense-bits 8` on INT8 experts (the dense-weight cache: linears, fused gate+up, MLA's
/// `kv_b` per head in INT8) against an ideal INT8 quantisation of experts and dense weights
/// together: (1 − mean cos) ≤ 2 × its error + 1e-4 and top-1 ≥ its − 0.1.
pub fn check_int8dense(name: &str) {
    let Some((root, f)) = dense_int8(name) else { return };
    let ideal = quant_bound(&root, name, "int8dense");
    let bar = 2.0 * (1.0 - ideal.mean_cos) + 1e-4;
    eprintln!(
        "{name} experts int8 + dense int8: 1-cos {:.3e} (bar {bar:.3e}, ideal int8dense {:.3e}), top1 {:.2} (ideal {:.2})",
        1.0 - f.mean_cos,
        1.0 - ideal.mean_cos,
        f.top1,
        ideal.top1
    );
    assert!(1.0 - f.mean_cos <= bar, "{name} dense int8: 1 - mean cos {:.3e} > {bar:.3e}", 1.0 - f.mean_cos);
    assert!(f.top1 >= ideal.top1 - 0.1, "{name} dense int8: top-1 {:.2} < ideal {:.2} - 0.1", f.top1, ideal.top1);
}
