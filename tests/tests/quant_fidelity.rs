//! Quantised CPU paths against the HF oracle, judged relative to `quant_bounds.json` (what an
//! ideal weight-only quantisation of the routed experts reaches on each fixture):
//! `--cpu-expert-bits 8|4`: (1 − mean cos) ≤ 2 × ideal's + 1e-4, top-1 ≥ ideal's − 0.1, and at
//! INT8 the first greedy token wherever the ideal keeps it; `--cpu-dense-bits 8` on INT8 experts:
//! within 2 × the error of an ideal INT8 quantisation of experts and dense weights together
//! (`int8dense`) + 1e-4 and its top-1 − 0.1 (and, ignored, the stricter 4 × ideal INT8's + 2e-4).

use std::path::Path;

use krasis_model::quantized::WeightBits;
use krasis_model::sampling::argmax;
use krasis_tests::{fidelity, fixtures_dir, load_reference, prefill_logits, quant_bound, FIXTURE_NAMES};

fn prefill(dir: &Path, experts: WeightBits, dense: WeightBits, cache: &Path) -> Vec<f32> {
    prefill_logits(dir, experts, dense, cache, &load_reference(dir).prompt_ids)
}

fn check(name: &str) {
    let Some(root) = fixtures_dir() else { return };
    let dir = root.join(name);
    let r = load_reference(&dir);
    let vocab = r.prefill_logits.len() / r.prompt_ids.len();
    let tmp = tempfile::tempdir().unwrap();
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
fn check_dense(name: &str) {
    let Some((root, f)) = dense_int8(name) else { return };
    let ideal8 = quant_bound(&root, name, "int8");
    let bar = 4.0 * (1.0 - ideal8.mean_cos) + 2e-4;
    eprintln!("{name} experts int8 + dense int8: 1-cos {:.3e} (bar {bar:.3e}), top1 {:.2}", 1.0 - f.mean_cos, f.top1);
    assert!(1.0 - f.mean_cos <= bar, "{name} dense int8: 1 - mean cos {:.3e} > {bar:.3e}", 1.0 - f.mean_cos);
}

/// The fixtures' root and the fidelity of `--cpu-dense-bits 8` on INT8 experts (`None` without
/// fixtures).
fn dense_int8(name: &str) -> Option<(std::path::PathBuf, krasis_tests::Fidelity)> {
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
fn check_int8dense(name: &str) {
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

#[test]
fn dense_int8_within_twice_ideal_int8dense() {
    for name in FIXTURE_NAMES {
        check_int8dense(name);
    }
}

macro_rules! fixture_test {
    ($fn_name:ident, $dense_name:ident, $i:expr) => {
        #[test]
        fn $fn_name() {
            check(FIXTURE_NAMES[$i]);
        }

        #[test]
        #[ignore = "no 8-bit dense scheme meets the bar on every fixture: near-tied routes flip (issue #3, dense_fidelity_diag.rs)"]
        fn $dense_name() {
            check_dense(FIXTURE_NAMES[$i]);
        }
    };
}

fixture_test!(dsv2_lite_tiny, dense_int8_dsv2_lite_tiny, 0);
fixture_test!(dsv2_k256_tiny, dense_int8_dsv2_k256_tiny, 1);
fixture_test!(dsv2_grouped_tiny, dense_int8_dsv2_grouped_tiny, 2);
fixture_test!(dsv3_tiny, dense_int8_dsv3_tiny, 3);
fixture_test!(dsv3_fp8_tiny, dense_int8_dsv3_fp8_tiny, 4);
fixture_test!(qwen3moe_tiny, dense_int8_qwen3moe_tiny, 5);
