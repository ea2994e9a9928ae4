//! A long prefill in one call equals the same prompt in short calls, bit for bit: the calls'
//! attention tasks are shaped by their lengths (a task per (token, kv head) over the head group,
//! the absorbed products' dispatches), and every row's arithmetic must not depend on which.

use super::{Logits, Model};
use crate::synth::{synthesize, Preset, SynthOptions};

#[test]
fn one_long_prefill_equals_short_calls() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("tiny");
    synthesize(&SynthOptions { layers: Some(2), seed: 5, ..SynthOptions::new(Preset::Tiny, &dir) }).unwrap();
    let model = Model::load(&dir).unwrap();
    let vocab = model.spec.vocab_size as u32;
    const LONG: usize = 128; // past every length-dependent task shape of a 2-core pool
    let n = LONG + 21;
    let prompt: Vec<u32> = (0..n as u32).map(|i| (i * 7919 + 13) % vocab).collect();
    let mut whole = model.new_session();
    let all = model.forward(&mut whole, &prompt, Logits::All, None).unwrap();
    let mut parts = model.new_session();
    let cut = LONG - 5;
    let mut pieces = model.forward(&mut parts, &prompt[..cut], Logits::All, None).unwrap();
    pieces.extend(model.forward(&mut parts, &prompt[cut..], Logits::All, None).unwrap());
    assert_eq!(all.len(), pieces.len());
    let same = all.iter().zip(&pieces).all(|(a, b)| a.to_bits() == b.to_bits());
    assert!(same, "logits differ between one {n}-token call and calls of {cut} + {}", n - cut);
}
