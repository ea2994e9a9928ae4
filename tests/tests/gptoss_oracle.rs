//! gpt-oss (`gpt_oss`) against the float64 transformers oracles of `../shared/fixtures-next`
//! (README there): `gptoss-tiny` (BF16 experts in transformers' fused, transposed layout) and
//! `gptoss-mxfp4-tiny` (the experts in OpenAI's published MXFP4 layout, the reference computed
//! on their exactly dequantised values). What the family adds to the one forward walk: biases
//! on q/k/v/o, attention sinks, sliding-window layers alternating with full ones, a router
//! that is a linear with a bias (top-k of the logits, softmax over those), experts with biases
//! and the clamped SwiGLU.
//!
//! - the CPU reference path: per-layer hidden states, prefill logits and every greedy step at
//!   rel ≤ 1e-4, greedy ids identical (`check_against_reference`);
//! - the quantised CPU experts (INT8, INT4) within `quant_bounds.json`'s rule.

use krasis_model::cpu::Model;
use krasis_tests::{check_against_reference, fixture_next, load_reference};

fn reference_path(name: &str) {
    let Some(dir) = fixture_next(name) else { return };
    let model = Model::load(&dir).unwrap_or_else(|e| panic!("{name}: load failed: {e}"));
    for line in check_against_reference(name, &model, &load_reference(&dir)) {
        eprintln!("{line}");
    }
}

mod gptoss {
    #[test]
    fn reference_path_matches_the_oracle() {
        super::reference_path("gptoss-tiny");
    }
}

mod gptoss_mxfp4 {
    #[test]
    fn reference_path_matches_the_oracle() {
        super::reference_path("gptoss-mxfp4-tiny");
    }
}
