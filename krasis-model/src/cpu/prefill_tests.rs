//! A long prefill in one call equals the same prompt in short calls, bit for bit, as long as the
//! calls take the same MLA form (decompressed from `MLA_PREFILL_MIN_ROWS` rows, absorbed below;
//! the two forms are equal in exact arithmetic, not in bits): the calls' attention tasks are shaped
//! by their lengths (a task per (token, kv head) over the head group, the absorbed products'
//! dispatches, the decompressed form's query blocks and key tiles), and every row's arithmetic
//! must not depend on which.

use super::attention::MLA_PREFILL_MIN_ROWS;
use super::{Logits, Model};
use crate::synth::{synthesize, Preset, SynthOptions};

/// Logits of `prompt` in one call, and in calls cut at `cut`.
fn whole_and_split(model: &Model, prompt: &[u32], cut: usize) -> (Vec<f32>, Vec<f32>) {
    let mut whole = model.new_session();
    let all = model.forward(&mut whole, prompt, Logits::All, None).unwrap();
    let mut parts = model.new_session();
    let mut pieces = model.forward(&mut parts, &prompt[..cut], Logits::All, None).unwrap();
    pieces.extend(model.forward(&mut parts, &prompt[cut..], Logits::All, None).unwrap());
    (all, pieces)
}

#[test]
fn one_long_prefill_equals_short_calls() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("tiny");
    synthesize(&SynthOptions { layers: Some(2), seed: 5, ..SynthOptions::new(Preset::Tiny, &dir) }).unwrap();
    let model = Model::load(&dir).unwrap();
    let vocab = model.spec.vocab_size as u32;
    const LONG: usize = 128; // past every length-dependent task shape of a 2-core pool
    let prompt: Vec<u32> = (0..(LONG + 21) as u32).map(|i| (i * 7919 + 13) % vocab).collect();
    // Decompressed MLA in every call (each at least MLA_PREFILL_MIN_ROWS rows), then absorbed in
    // every call (each below it).
    let short = MLA_PREFILL_MIN_ROWS - 1;
    for (n, cut) in [(prompt.len(), LONG - 5 - MLA_PREFILL_MIN_ROWS), (short, short / 2 + 1)] {
        let (all, pieces) = whole_and_split(&model, &prompt[..n], cut);
        assert_eq!(all.len(), pieces.len());
        let same = all.iter().zip(&pieces).all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "logits differ between one {n}-token call and calls of {cut} + {}", n - cut);
    }
}

/// The decompressed prefill and the absorbed form agree to f32 rounding on a whole model.
#[test]
fn decompressed_prefill_matches_absorbed_steps() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("tiny");
    synthesize(&SynthOptions { layers: Some(2), seed: 9, ..SynthOptions::new(Preset::Tiny, &dir) }).unwrap();
    let model = Model::load(&dir).unwrap();
    let vocab = model.spec.vocab_size as u32;
    let n = 3 * MLA_PREFILL_MIN_ROWS;
    let prompt: Vec<u32> = (0..n as u32).map(|i| (i * 104_729 + 7) % vocab).collect();
    let mut one = model.new_session();
    let dec = model.forward(&mut one, &prompt, Logits::All, None).unwrap();
    // The same prompt in calls below the threshold: absorbed throughout.
    let mut steps = model.new_session();
    let mut abs = Vec::new();
    for chunk in prompt.chunks(MLA_PREFILL_MIN_ROWS - 1) {
        abs.extend(model.forward(&mut steps, chunk, Logits::All, None).unwrap());
    }
    let (mut diff, mut norm) = (0f64, 0f64);
    for (a, b) in dec.iter().zip(&abs) {
        diff += ((a - b) as f64).powi(2);
        norm += (*b as f64).powi(2);
    }
    let rel = (diff / norm).sqrt();
    assert!(rel < 1e-4, "decompressed vs absorbed prefill logits: relative L2 {rel}");
}
