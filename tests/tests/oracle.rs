//! The CPU reference engine against the HF transformers float64 oracle, on every fixture:
//! per-layer hidden states, prefill logits, greedy ids and the logits each was chosen from.

use krasis_model::cpu::Model;
use krasis_tests::{check_against_reference, fixtures_dir, load_reference, FIXTURE_NAMES};

fn check_fixture(name: &str) -> Vec<String> {
    let Some(root) = fixtures_dir() else { return vec![] };
    let dir = root.join(name);
    let model = Model::load(&dir).unwrap_or_else(|e| panic!("{name}: load failed: {e}"));
    check_against_reference(name, &model, &load_reference(&dir))
}

macro_rules! fixture_test {
    ($fn_name:ident, $fixture:expr) => {
        #[test]
        fn $fn_name() {
            for line in check_fixture($fixture) {
                eprintln!("{line}");
            }
        }
    };
}

fixture_test!(dsv2_lite_tiny, FIXTURE_NAMES[0]);
fixture_test!(dsv2_k256_tiny, FIXTURE_NAMES[1]);
fixture_test!(dsv2_grouped_tiny, FIXTURE_NAMES[2]);
fixture_test!(dsv3_tiny, FIXTURE_NAMES[3]);
fixture_test!(dsv3_fp8_tiny, FIXTURE_NAMES[4]);
fixture_test!(qwen3moe_tiny, FIXTURE_NAMES[5]);
