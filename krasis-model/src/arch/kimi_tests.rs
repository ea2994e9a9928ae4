//! `kimi_k2` and `kimi_k25` configurations and `generation_config.json`'s end-of-sequence ids,
//! on the tiny preset's configuration.

use std::path::Path;

use serde_json::{json, Value};

use super::*;
use crate::synth::{preset_config, Preset};

fn v3() -> Value {
    let mut c = preset_config(Preset::Tiny, Some(2));
    c["model_type"] = json!("deepseek_v3");
    c
}

fn parse(v: &Value) -> Result<CheckpointConfig> {
    parse_checkpoint_config(&v.to_string(), Path::new("/m/config.json"))
}

#[test]
fn kimi_k2_is_deepseek_v3() {
    let mut k2 = v3();
    k2["model_type"] = json!("kimi_k2");
    let (a, b) = (parse(&k2).unwrap(), parse(&v3()).unwrap());
    assert_eq!(a, b);
    assert_eq!(a.spec.arch, Arch::DeepseekV3);
}

#[test]
fn kimi_k25_reads_text_config_and_names_its_fields() {
    let mut text = v3();
    text["model_type"] = json!("kimi_k2");
    let mut k25 = json!({"model_type": "kimi_k25", "text_config": text, "vision_config": {}});
    let cfg = parse(&k25).unwrap();
    assert_eq!(cfg.spec, parse(&v3()).unwrap().spec);
    assert_eq!(cfg.tensor_prefix, "language_model.");
    assert!(cfg.notes[0].contains("/m/config.json") && cfg.notes[0].contains("vision_tower.*"), "{:?}", cfg.notes);
    // Without a vision_config there is nothing to leave out.
    k25.as_object_mut().unwrap().remove("vision_config");
    assert!(parse(&k25).unwrap().notes.is_empty());
    // A text model without model_type is a Kimi-K2.
    k25["text_config"].as_object_mut().unwrap().remove("model_type");
    assert_eq!(parse(&k25).unwrap().spec, cfg.spec);

    let err = |edit: &dyn Fn(&mut Value)| {
        let mut c = k25.clone();
        edit(&mut c);
        parse(&c).unwrap_err().to_string()
    };
    let e = err(&|c| c["text_config"]["hidden_size"] = json!("big"));
    assert!(e.contains("/m/config.json") && e.contains("`text_config.hidden_size`"), "{e}");
    let e = err(&|c| c["text_config"]["rope_scaling"]["type"] = json!("dynamic"));
    assert!(e.contains("`text_config.rope_scaling.rope_type`"), "{e}");
    let e = err(&|c| c["text_config"]["model_type"] = json!("qwen3_moe"));
    assert!(e.contains("`text_config.model_type`") && e.contains("`qwen3_moe`"), "{e}");
    let e = err(&|c| c["text_config"] = json!([1]));
    assert!(e.contains("`text_config`") && e.contains("expected an object"), "{e}");
    let e = err(&|c| {
        c.as_object_mut().unwrap().remove("text_config");
    });
    assert!(e.contains("`text_config`") && e.contains("missing"), "{e}");
}

#[test]
fn an_unsupported_model_type_lists_the_kimi_ones() {
    let mut c = v3();
    c["model_type"] = json!("llama");
    let e = parse(&c).unwrap_err().to_string();
    assert!(e.contains("`llama`") && e.contains("kimi_k2, kimi_k25"), "{e}");
}

#[test]
fn generation_configs_eos_replaces_configs() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    std::fs::write(dir.join("config.json"), v3().to_string()).unwrap();
    let eos = || load_config(dir).map(|s| s.eos_token_ids);
    assert_eq!(eos().unwrap(), vec![1], "config.json's without generation_config.json");
    let gen = dir.join("generation_config.json");
    for (text, want) in [
        (r#"{"eos_token_id": 163586, "max_length": 131072}"#, vec![163586]),
        (r#"{"eos_token_id": [7, 9]}"#, vec![7, 9]),
        (r#"{"max_length": 10}"#, vec![1]),
        (r#"{"eos_token_id": null}"#, vec![1]),
        (r#"{"eos_token_id": []}"#, vec![1]),
    ] {
        std::fs::write(&gen, text).unwrap();
        assert_eq!(eos().unwrap(), want, "{text}");
    }
    std::fs::write(&gen, r#"{"eos_token_id": "<|im_end|>"}"#).unwrap();
    let e = eos().unwrap_err().to_string();
    assert!(e.contains("generation_config.json") && e.contains("`eos_token_id`"), "{e}");
    std::fs::write(&gen, "{").unwrap();
    let e = eos().unwrap_err().to_string();
    assert!(e.contains("generation_config.json") && e.contains("malformed JSON"), "{e}");
}
