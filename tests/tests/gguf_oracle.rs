//! GGUF input against the HF oracle: the BF16 GGUF twin of each fixture (llama.cpp's own
//! converter, `scripts/make-gguf-fixtures.sh`) on the CPU reference path must match the oracle as
//! the safetensors checkpoint does (same weights, other container): hidden states, prefill
//! logits and greedy logits within 1e-4, greedy ids identical.

use std::path::PathBuf;

use krasis_model::engine::Model;
use krasis_model::files::ModelFiles;
use krasis_tests::{check_against_reference, fixtures_dir, gguf_fixtures_dir, load_reference, GGUF_FIXTURE_NAMES};

fn paths(name: &str, kind: &str) -> Option<(PathBuf, PathBuf)> {
    let hf = fixtures_dir()?.join(name);
    let gguf = gguf_fixtures_dir()?.join(name).join(format!("model-{kind}.gguf"));
    Some((hf, gguf))
}

fn check_bf16(name: &str) {
    let Some((hf, gguf)) = paths(name, "bf16") else { return };
    let files = ModelFiles::open(&gguf).unwrap_or_else(|e| panic!("{name}: {e}"));
    let hf_files = ModelFiles::open(&hf).unwrap();
    // The GGUF's metadata must give the spec config.json gives (the routing rule, YaRN, MLA dims).
    let (mut a, b) = (files.spec().clone(), hf_files.spec().clone());
    // max_position_embeddings, eps and YaRN's mscale pass through f32 in GGUF metadata.
    assert!((a.softmax_scale - b.softmax_scale).abs() <= 1e-6 * b.softmax_scale, "{name}: softmax scale");
    a.softmax_scale = b.softmax_scale;
    a.rope = b.rope.clone();
    a.rms_norm_eps = b.rms_norm_eps;
    assert_eq!(a, b, "{name}: spec from GGUF metadata differs from config.json's");
    let model = Model::from_files(&files).unwrap_or_else(|e| panic!("{name}: load failed: {e}"));
    for line in check_against_reference(name, &model, &load_reference(&hf)) {
        eprintln!("gguf bf16 {line}");
    }
}

#[test]
fn dsv2_lite_bf16() {
    check_bf16(GGUF_FIXTURE_NAMES[0]);
}

#[test]
fn dsv2_k256_bf16() {
    check_bf16(GGUF_FIXTURE_NAMES[1]);
}

#[test]
fn dsv2_grouped_bf16() {
    check_bf16(GGUF_FIXTURE_NAMES[2]);
}

#[test]
fn dsv3_bf16() {
    check_bf16(GGUF_FIXTURE_NAMES[3]);
}

/// The tokenizer rebuilt from GGUF metadata encodes and decodes like the fixture's
/// `tokenizer.json` on mixed text with special tokens, and the chat template comes through.
#[test]
fn gguf_tokenizer_matches_tokenizer_json() {
    let Some((hf, gguf)) = paths(GGUF_FIXTURE_NAMES[0], "q8_0") else { return };
    let theirs = ModelFiles::open(&hf).unwrap().text_codec().unwrap();
    let files = ModelFiles::open(&gguf).unwrap();
    assert!(files.has_tokenizer());
    let ours = files.text_codec().unwrap();
    let paragraph = "<|bos|>The experts live in RAM; attention lives on the GPU.\n\n  Prefill: 4,096 tokens \
        at 10,372 tok/s — decode: 53.4 tok/s!<|eos|> Ünïcödé, emoji 🦀, tabs\tand CJK 混合专家 \
        (MoE) x=3.14e-2 'quoted' \"double\" <|user|>Hi<|assistant|>\r\nend<|eos|>";
    let a = ours.encode(paragraph).unwrap();
    let b = theirs.encode(paragraph).unwrap();
    assert_eq!(a, b, "token ids differ");
    assert!(a.contains(&0) && a.contains(&1), "the special tokens are single ids");
    assert!(a.len() > 60);
    assert_eq!(ours.decode(&a).unwrap(), theirs.decode(&b).unwrap());
    // Special tokens dropped on decode, everything else back byte for byte.
    let plain = paragraph.replace("<|bos|>", "").replace("<|eos|>", "");
    assert_eq!(ours.decode(&a).unwrap(), plain);
    assert_eq!(ours.render_chat("Hi").unwrap(), theirs.render_chat("Hi").unwrap());
    assert_eq!(ours.encode_chat("Hi").unwrap(), theirs.encode_chat("Hi").unwrap());
}
