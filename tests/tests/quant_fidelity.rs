//! Quantised CPU paths against the HF oracle, judged relative to `quant_bounds.json` (what an
//! ideal weight-only quantisation of the routed experts reaches on each fixture):
//! `--cpu-expert-bits 8|4`: (1 − mean cos) ≤ 2 × ideal's + 1e-4, top-1 ≥ ideal's − 0.1, and at
//! INT8 the first greedy token wherever the ideal keeps it; `--cpu-dense-bits 8` on INT8 experts:
//! within 2 × the error of an ideal INT8 quantisation of experts and dense weights together
//! (`int8dense`) + 1e-4 and its top-1 − 0.1 (and, ignored, the stricter 4 × ideal INT8's + 2e-4).

mod fidelity_checks;

use fidelity_checks::{check, check_dense, check_int8dense};
use krasis_model::cpu::attention::MlaPrefillMode;
use krasis_model::cpu::quantized::WeightBits;
use krasis_tests::{decode_and_prefill_logits, fixtures_dir, load_reference, rel_l2, report_skip, FIXTURE_NAMES};

/// Decode on quantised dense weights (MLA's one-token attention runs W_UK to W_UV in one
/// dispatch there) gives the logits a prefill of the same tokens gives, on every fixture: the
/// two differ only in summation order and in how attention splits its positions, which moves
/// an INT8 activation's rounding now and then (measured 0.9–1.3e-4 relative L2 on the MLA
/// fixtures, the same with `KRASIS_CPU_MLA_DECODE=split`); a mis-wired step is off by O(1).
#[test]
fn int8_dense_decode_steps_equal_prefill_positions() {
    let Some(root) = fixtures_dir() else { return };
    for name in FIXTURE_NAMES {
        let dir = root.join(name);
        let prompt = load_reference(&dir).prompt_ids;
        let steps = (prompt.len() / 2).max(1);
        // Where the prompt's calls take the BF16 tiles (`KRASIS_BF16_MIN_TOKENS` below its
        // length), prefill and decode round activations differently: not this check's subject.
        if krasis_cpu::prefill_bf16::applies(krasis_cpu::isa::active(), prompt.len() - steps, 4096).is_some() {
            report_skip(&format!("{name}: decode vs prefill positions (the prefill runs on the BF16 tiles here)"));
            continue;
        }
        // Likewise where MLA's prefill runs decompressed (`KRASIS_MLA_PREFILL`) with the
        // expansion and attention on the BF16 tiles.
        let mla = std::fs::read_to_string(dir.join("config.json")).unwrap().contains("kv_lora_rank");
        let decompressed = MlaPrefillMode::from_env().decompressed(prompt.len() - steps, 0);
        if mla && decompressed && krasis_cpu::prefill_bf16::tiles().is_some() {
            report_skip(&format!("{name}: decode vs prefill positions (MLA prefill runs on the BF16 tiles here)"));
            continue;
        }
        let tmp = tempfile::tempdir().unwrap();
        let (by_prefill, by_decode) =
            decode_and_prefill_logits(&dir, WeightBits::Int8, WeightBits::Int8, tmp.path(), &prompt, steps);
        let e = rel_l2(&by_decode, &by_prefill);
        eprintln!("{name}: {steps} decode steps against prefill positions, relative L2 {e:.2e}");
        assert!(e <= 1e-3, "{name}: decode steps differ from prefill positions by {e:.2e}");
    }
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
