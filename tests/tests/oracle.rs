//! The CPU reference engine against the HF transformers float64 oracle, on every fixture:
//! per-layer hidden states, prefill logits, greedy ids and the logits each was chosen from.

use krasis_model::engine::{Logits, Model};
use krasis_model::sampling::argmax;
use krasis_tests::{fixtures_dir, load_reference, rel_l2, FIXTURE_NAMES};

const TOL: f64 = 1e-4;

fn check_fixture(name: &str) -> Vec<String> {
    let Some(root) = fixtures_dir() else { return vec![] };
    let dir = root.join(name);
    let r = load_reference(&dir);
    let model = Model::load(&dir).unwrap_or_else(|e| panic!("{name}: load failed: {e}"));
    let mut report = Vec::new();

    // Prefill with per-layer hidden states.
    let [layers_plus_one, t, h] = r.hidden_shape[..] else { panic!("hidden_states shape") };
    let mut hidden: Vec<Vec<f32>> = Vec::new();
    let mut session = model.new_session();
    let mut observe = |_: usize, x: &[f32]| hidden.push(x.to_vec());
    let logits = model.forward(&mut session, &r.prompt_ids, Logits::All, Some(&mut observe)).unwrap();
    assert_eq!(hidden.len(), layers_plus_one, "{name}: hidden state count");
    for (l, hs) in hidden.iter().enumerate() {
        let want = &r.hidden_states[l * t * h..(l + 1) * t * h];
        let e = rel_l2(hs, want);
        report.push(format!("{name} hidden[{l}] rel {e:.2e}"));
        assert!(
            e <= TOL,
            "{name}: hidden_states[{l}] relative L2 error {e:.3e} > {TOL:e} (bug at or before layer {l})"
        );
    }
    let e = rel_l2(&logits, &r.prefill_logits);
    report.push(format!("{name} prefill_logits rel {e:.2e}"));
    assert!(e <= TOL, "{name}: prefill logits relative L2 error {e:.3e}");

    // Greedy decode over the cache: ids exact, step logits close.
    let v = model.spec.vocab_size;
    let mut step = logits[(t - 1) * v..].to_vec();
    let mut worst = 0f64;
    for (i, &want_id) in r.greedy_ids.iter().enumerate() {
        let e = rel_l2(&step, &r.greedy_logits[i * v..(i + 1) * v]);
        worst = worst.max(e);
        assert!(e <= TOL, "{name}: step {i} logits relative L2 error {e:.3e}");
        let got = argmax(&step) as u32;
        assert_eq!(got, want_id, "{name}: greedy token {i}");
        if i + 1 < r.greedy_ids.len() {
            step = model.forward(&mut session, &[got], Logits::Last, None).unwrap();
        }
    }
    report.push(format!("{name} greedy {} ids exact, worst step logits rel {worst:.2e}", r.greedy_ids.len()));
    report
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
