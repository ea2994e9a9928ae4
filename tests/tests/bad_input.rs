//! Bad input: every case gives one clear error naming the file, tensor or field — no panic.
//! Built on a synthesized tiny model, so these run with or without the fixtures.

use std::path::Path;

use krasis_model::cpu::Model;
use krasis_model::runtime::DecoderEngine;
use krasis_model::text::generate::{generate, GenerateRequest};
use krasis_model::text::sampling::SamplingParams;
use krasis_tests::{edit_header, tiny_model, weight_files};
use serde_json::{json, Value};

fn load_err(dir: &Path) -> String {
    match Model::load(dir) {
        Ok(_) => panic!("{} loaded but should have been refused", dir.display()),
        Err(e) => e.to_string(),
    }
}

fn fresh() -> (tempfile::TempDir, std::path::PathBuf) {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("tiny");
    tiny_model(&dir);
    (t, dir)
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut serde_json::Map<String, Value>)) {
    let p = dir.join("config.json");
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(v.as_object_mut().unwrap());
    std::fs::write(p, serde_json::to_string_pretty(&v).unwrap()).unwrap();
}

#[test]
fn the_untouched_model_loads() {
    let (_t, dir) = fresh();
    Model::load(&dir).unwrap();
}

#[test]
fn missing_directory() {
    let e = load_err(Path::new("/nonexistent/krasis-model"));
    assert!(e.contains("/nonexistent/krasis-model") && e.contains("does not exist"), "{e}");
}

#[test]
fn missing_config() {
    let (_t, dir) = fresh();
    std::fs::remove_file(dir.join("config.json")).unwrap();
    let e = load_err(&dir);
    assert!(e.contains("config.json") && e.contains("No such file"), "{e}");
}

#[test]
fn malformed_config() {
    let (_t, dir) = fresh();
    std::fs::write(dir.join("config.json"), "{ \"model_type\": \"deepseek_v2\", ").unwrap();
    let e = load_err(&dir);
    assert!(e.contains("config.json") && e.contains("malformed JSON"), "{e}");
}

#[test]
fn config_field_of_the_wrong_type_or_missing() {
    let (_t, dir) = fresh();
    edit_config(&dir, |c| {
        c.insert("hidden_size".into(), json!("big"));
    });
    let e = load_err(&dir);
    assert!(e.contains("config.json") && e.contains("`hidden_size`"), "{e}");
    edit_config(&dir, |c| {
        c.insert("hidden_size".into(), json!(256));
        c.remove("kv_lora_rank");
    });
    let e = load_err(&dir);
    assert!(e.contains("`kv_lora_rank`") && e.contains("missing"), "{e}");
}

#[test]
fn unsupported_model_type() {
    let (_t, dir) = fresh();
    edit_config(&dir, |c| {
        c.insert("model_type".into(), json!("llama"));
    });
    let e = load_err(&dir);
    assert!(e.contains("`llama`") && e.contains("deepseek_v2, deepseek_v3, qwen3_moe"), "{e}");
}

#[test]
fn header_length_past_the_end() {
    let (_t, dir) = fresh();
    let f = &weight_files(&dir)[0];
    let mut bytes = std::fs::read(f).unwrap();
    let len = bytes.len() as u64;
    bytes[..8].copy_from_slice(&(len + 10).to_le_bytes());
    std::fs::write(f, &bytes).unwrap();
    let e = load_err(&dir);
    assert!(e.contains(&f.display().to_string()) && e.contains("header length"), "{e}");
    // An absurd length is refused before anything is sized from it.
    bytes[..8].copy_from_slice(&(1u64 << 62).to_le_bytes());
    std::fs::write(f, &bytes).unwrap();
    let e = load_err(&dir);
    assert!(e.contains("exceeds"), "{e}");
}

#[test]
fn truncated_data_section() {
    let (_t, dir) = fresh();
    let f = &weight_files(&dir)[0];
    let bytes = std::fs::read(f).unwrap();
    std::fs::write(f, &bytes[..bytes.len() - 100]).unwrap();
    let e = load_err(&dir);
    assert!(e.contains(&f.display().to_string()) && e.contains("run past the end"), "{e}");
    assert!(e.contains("tensor `"), "names the tensor: {e}");
}

#[test]
fn missing_tensor() {
    let (_t, dir) = fresh();
    let name = "model.layers.1.mlp.experts.3.up_proj.weight";
    for f in weight_files(&dir) {
        edit_header(&f, |h| {
            h.remove(name);
        });
    }
    let e = load_err(&dir);
    assert!(e.contains(name) && e.contains("not found"), "{e}");
}

#[test]
fn wrong_shape() {
    let (_t, dir) = fresh();
    let name = "model.layers.0.self_attn.o_proj.weight";
    for f in weight_files(&dir) {
        edit_header(&f, |h| {
            if let Some(t) = h.get_mut(name) {
                let s = t["shape"].as_array().unwrap().clone();
                t["shape"] = json!([s[1], s[0]]);
            }
        });
    }
    let e = load_err(&dir);
    assert!(e.contains(name) && e.contains("expected shape"), "{e}");
}

#[test]
fn wrong_dtype() {
    let (_t, dir) = fresh();
    let name = "model.layers.0.input_layernorm.weight";
    for f in weight_files(&dir) {
        edit_header(&f, |h| {
            if let Some(t) = h.get_mut(name) {
                let n = t["shape"][0].as_u64().unwrap();
                t["dtype"] = json!("U8");
                t["shape"] = json!([n * 2]);
            }
        });
    }
    let e = load_err(&dir);
    assert!(e.contains(name) && e.contains("dtype U8"), "{e}");
}

#[test]
fn prompt_id_outside_the_vocabulary_and_empty_prompt() {
    let (_t, dir) = fresh();
    let model = DecoderEngine::new(Model::load(&dir).unwrap());
    let vocab = model.decoder().spec.vocab_size as u32;
    let req = |ids: Vec<u32>| GenerateRequest {
        prompt_ids: ids,
        max_new_tokens: 2,
        sampling: SamplingParams::default(),
        ignore_eos: true,
        record_logits: false,
    };
    let e = generate(&model, &req(vec![3, vocab]), |_| Ok(())).unwrap_err().to_string();
    assert!(e.contains(&format!("{vocab}")) && e.contains("position 1") && e.contains("vocab"), "{e}");
    let e = generate(&model, &req(vec![]), |_| Ok(())).unwrap_err().to_string();
    assert!(e.contains("empty"), "{e}");
}
