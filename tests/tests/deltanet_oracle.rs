//! The gated-DeltaNet hybrids of `../shared/fixtures-next` (float64 transformers oracles, README
//! there): `qwen3next-tiny` (Qwen3-Next: fused `in_proj_qkvz` / `in_proj_ba`, per-expert
//! tensors) and `qwen35moe-tiny` (Qwen3.5: the VL wrapper's `text_config`, tensors under
//! `model.language_model.`, split DeltaNet projections, fused experts). Both have 3 DeltaNet
//! layers and one gated full-attention layer, and a 72-token prompt: the prefill runs the chunked
//! rule over 2 chunks of 64 with the state carried, the greedy steps the recurrence after it.
//!
//! - The CPU reference path against the oracle: per-layer hidden states, prefill logits and every
//!   greedy step at rel ≤ 1e-4, greedy ids identical.
//! - The quantised CPU experts (INT8, INT4) within `quant_bounds.json`'s rule (as
//!   `families_oracle`): (1 − mean cos) ≤ 2 × an ideal quantisation's + 1e-4, top-1 ≥ its − 0.1,
//!   at INT8 the first greedy token wherever the ideal keeps it.
//! - Decode after a prefill gives the logits the prefill gives at those positions (the state
//!   carried from the chunked form into the recurrence).
//! - The GPU engine (`--device gpu`, BF16 and INT4 experts) and the hybrid (routed experts on the
//!   CPU) within `quant_bounds.json`'s BF16 rule (as `families_oracle`), on the prefill and on the
//!   greedy decode steps after it; the first greedy token at BF16. Without a GPU these skip
//!   visibly.

use krasis_model::cpu::quantized::WeightBits;
use krasis_model::cpu::Model;
use krasis_tests::{check_against_reference, decode_and_prefill_logits, fixture_next, load_reference, rel_l2};

fn reference_path(name: &str) {
    let Some(dir) = fixture_next(name) else { return };
    let model = Model::load(&dir).unwrap_or_else(|e| panic!("{name}: load failed: {e}"));
    assert!(model.spec.delta_net.is_some(), "{name}: DeltaNet layers");
    for line in check_against_reference(name, &model, &load_reference(&dir)) {
        eprintln!("{line}");
    }
}

/// The last 9 prompt positions decoded one token at a time after a chunked prefill of the rest
/// (63 tokens: not a multiple of the chunk, and below it) match the whole prompt's prefill.
fn decode_matches_prefill(name: &str) {
    let Some(dir) = fixture_next(name) else { return };
    let r = load_reference(&dir);
    let tmp = tempfile::tempdir().unwrap();
    let (all, decoded) =
        decode_and_prefill_logits(&dir, WeightBits::Bf16, WeightBits::Bf16, tmp.path(), &r.prompt_ids, 9);
    let e = rel_l2(&decoded, &all);
    eprintln!("{name}: decode after prefill vs prefill, rel {e:.2e}");
    assert!(e <= 1e-5, "{name}: decoded logits differ from the prefill's by {e:.3e}");
}

macro_rules! deltanet_tests {
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
            fn decode_after_a_chunked_prefill_matches_the_prefill() {
                super::decode_matches_prefill($fixture);
            }
            #[test]
            fn gpu_and_hybrid_within_the_bf16_bounds() {
                krasis_tests::family_checks::gpu_and_hybrid($fixture, true);
            }
        }
    };
}

deltanet_tests!(qwen3next, "qwen3next-tiny");
deltanet_tests!(qwen35moe, "qwen35moe-tiny");

/// One batched step over two sequences (a prompt's tail and a one-token decode, each after its
/// own prefill) gives each the logits it gets alone: the DeltaNet states are per sequence.
#[test]
fn a_batched_step_keeps_each_sequences_deltanet_state() {
    use krasis_model::cpu::{BatchSeq, Logits};
    let Some(dir) = fixture_next("qwen3next-tiny") else { return };
    let m = Model::load(&dir).unwrap();
    let p = load_reference(&dir).prompt_ids;
    let (a_head, a_tail, b_head, b_tail) = (&p[..40], &p[40..70], &p[3..23], &p[23..24]);
    let alone = |head: &[u32], tail: &[u32]| {
        let mut s = m.new_session();
        m.forward(&mut s, head, Logits::Last, None).unwrap();
        m.forward(&mut s, tail, Logits::All, None).unwrap()
    };
    let (want_a, want_b) = (alone(a_head, a_tail), alone(b_head, b_tail));
    let (mut sa, mut sb) = (m.new_session(), m.new_session());
    m.forward(&mut sa, a_head, Logits::Last, None).unwrap();
    m.forward(&mut sb, b_head, Logits::Last, None).unwrap();
    let mut batch = [
        BatchSeq { session: &mut sa, tokens: a_tail, which: Logits::All },
        BatchSeq { session: &mut sb, tokens: b_tail, which: Logits::All },
    ];
    let got = m.forward_batch(&mut batch).unwrap();
    let (ea, eb) = (rel_l2(&got[0], &want_a), rel_l2(&got[1], &want_b));
    eprintln!("batched vs alone: rel {ea:.2e} / {eb:.2e}");
    assert!(ea <= 1e-5 && eb <= 1e-5, "batched logits differ: {ea:.3e} {eb:.3e}");
}
