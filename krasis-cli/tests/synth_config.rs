//! `krasis synth --config FILE [--layers N]` writes the model a `config.json` describes, in its
//! publisher's storage format, and `krasis generate` runs on it. The configurations here have
//! the structure of Kimi-K2-Instruct (`kimi_k2`, block FP8) and Kimi-K2.5 (`kimi_k25` nesting
//! the text model, compressed-tensors INT4 experts under `language_model.`) at tiny dimensions;
//! tests/tests/real_configs.rs does the published Kimi-K2-Instruct configuration itself.

use std::path::Path;
use std::process::{Command, Output};

use serde_json::{json, Value};

fn krasis(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_krasis")).args(args).output().expect("run krasis")
}

fn ok(o: Output) -> Output {
    assert!(o.status.success(), "krasis failed: {}", String::from_utf8_lossy(&o.stderr));
    o
}

fn kimi_k2_like() -> Value {
    json!({
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "kimi_k2",
        "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128,
        "num_hidden_layers": 61, "num_attention_heads": 4, "num_key_value_heads": 4,
        "n_shared_experts": 1, "n_routed_experts": 8, "num_experts_per_tok": 2,
        "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "kv_lora_rank": 64, "q_lora_rank": 128, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
        "rope_theta": 50000.0,
        "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "type": "yarn"},
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
        "topk_method": "noaux_tc", "n_group": 1, "topk_group": 1, "norm_topk_prob": true,
        "routed_scaling_factor": 2.827, "scoring_func": "sigmoid", "hidden_act": "silu",
        "tie_word_embeddings": false, "bos_token_id": 0, "eos_token_id": 1,
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "weight_block_size": [128, 128]}
    })
}

fn kimi_k25_like() -> Value {
    let mut text = kimi_k2_like();
    text["quantization_config"] = json!({
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"group_size": 32, "num_bits": 4,
            "strategy": "group", "symmetric": true, "type": "int", "dynamic": false}}},
        "format": "pack-quantized",
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
        "quant_method": "compressed-tensors", "quantization_status": "compressed"
    });
    json!({"model_type": "kimi_k25", "eos_token_id": 1, "text_config": text, "vision_config": {"vt_hidden_size": 32}})
}

fn synth_and_generate(dir: &Path, config: &Value) -> String {
    let cfg = dir.join("config-published.json");
    std::fs::write(&cfg, config.to_string()).unwrap();
    let out = dir.join("model");
    let o = ok(krasis(&["synth", "--config", cfg.to_str().unwrap(), "--layers", "2", "--out", out.to_str().unwrap()]));
    assert!(String::from_utf8_lossy(&o.stderr).contains("wrote"));
    let o = ok(krasis(&[
        "generate",
        "--model",
        out.to_str().unwrap(),
        "--prompt-ids",
        "5,9,200,3",
        "--max-new-tokens",
        "4",
        "--ignore-eos",
        "--device",
        "cpu",
    ]));
    String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr)
}

fn stored_names(dir: &Path) -> Vec<String> {
    let index = std::fs::read_to_string(dir.join("model/model.safetensors.index.json")).unwrap();
    let v: Value = serde_json::from_str(&index).unwrap();
    v["weight_map"].as_object().unwrap().keys().cloned().collect()
}

#[test]
fn synth_config_writes_a_kimi_k2_layout_in_fp8_and_generate_runs_on_it() {
    let t = tempfile::tempdir().unwrap();
    synth_and_generate(t.path(), &kimi_k2_like());
    let names = stored_names(t.path());
    assert!(names.contains(&"model.layers.1.mlp.experts.7.up_proj.weight_scale_inv".to_string()));
    assert!(!names.iter().any(|n| n.starts_with("model.layers.2.")), "cut to two layers");
}

#[test]
fn synth_config_writes_a_kimi_k25_layout_in_int4_and_generate_runs_on_it() {
    let t = tempfile::tempdir().unwrap();
    let said = synth_and_generate(t.path(), &kimi_k25_like());
    assert!(said.contains("note: ") && said.contains("vision tower"), "{said}");
    let info = ok(krasis(&["info", "--model", t.path().join("model").to_str().unwrap()]));
    let info = String::from_utf8_lossy(&info.stdout).into_owned();
    assert!(info.contains("architecture deepseek_v3") && info.contains("text model"), "{info}");
    let names = stored_names(t.path());
    assert!(names.contains(&"language_model.model.layers.1.mlp.experts.7.up_proj.weight_packed".to_string()));
    assert!(names.iter().all(|n| n.starts_with("language_model.")));
}

#[test]
fn synth_takes_a_preset_or_a_config_not_both() {
    let t = tempfile::tempdir().unwrap();
    let out = t.path().join("m");
    let o = krasis(&["synth", "--preset", "tiny", "--config", "x.json", "--out", out.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("--config"));
    let o = krasis(&["synth", "--out", out.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("--preset"));
}

#[test]
fn info_config_describes_the_full_published_model_without_weights() {
    let t = tempfile::tempdir().unwrap();
    let cfg = t.path().join("config.json");
    std::fs::write(&cfg, kimi_k25_like().to_string()).unwrap();
    let o = ok(krasis(&["info", "--config", cfg.to_str().unwrap()]));
    let said = String::from_utf8_lossy(&o.stdout).into_owned();
    // 61 layers: 61 x 9 attention and norm tensors, 3 of the dense layer, 60 MoE layers of
    // 8 experts x 9 INT4 tensors + router, bias and 3 shared, embedding, norm, LM head.
    let tensors = 61 * 9 + 3 + 60 * (8 * 9 + 5) + 3;
    assert!(said.contains(&format!("as published: {tensors} tensors")), "{said}");
    assert!(said.contains("compressed-tensors INT4") && said.contains("61 layers"), "{said}");
    assert!(said.contains("architecture deepseek_v3") && said.contains("vision tower"), "{said}");
    assert!(said.contains("experts int4"), "{said}");
    let o = krasis(&["info"]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("--model"));
}
