//! Qwen3-Next and Qwen3.5 configurations: the layer pattern, the DeltaNet geometry, the nesting
//! of Qwen3.5's text model, and the errors that name their field.

use std::path::Path;

use serde_json::{json, Value};

use super::{parse_checkpoint_config, parse_config};
use crate::spec::*;

fn qwen3_next() -> Value {
    json!({
        "model_type": "qwen3_next", "vocab_size": 512, "hidden_size": 96, "num_hidden_layers": 4,
        "intermediate_size": 256, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "partial_rotary_factor": 0.25,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 32, "linear_value_head_dim": 32,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "num_experts": 16, "num_experts_per_tok": 4,
        "norm_topk_prob": true, "full_attention_interval": 4, "rope_theta": 10000000, "rms_norm_eps": 1e-6
    })
}

fn parse(v: &Value) -> crate::error::Result<ModelSpec> {
    parse_config(&v.to_string(), Path::new("config.json"))
}

fn field_of(e: crate::error::ModelError) -> String {
    match e {
        crate::error::ModelError::Config { field, .. } => field,
        e => panic!("not a config error: {e}"),
    }
}

#[test]
fn qwen3_next_reads_the_pattern_the_deltanet_heads_and_the_gated_attention() {
    let s = parse(&qwen3_next()).unwrap();
    assert_eq!(s.arch, Arch::Qwen3Next);
    use MixerKind::*;
    assert_eq!(s.mixers, [GatedDeltaNet, GatedDeltaNet, GatedDeltaNet, Attention]);
    assert_eq!(
        s.delta_net,
        Some(DeltaNetSpec { key_heads: 2, value_heads: 4, key_dim: 32, value_dim: 32, conv_kernel: 4 })
    );
    assert!(matches!(
        s.attention,
        AttentionSpec::Gqa { output_gate: true, qk_norm: QkNorm::PerHead, head_dim: 64, .. }
    ));
    assert_eq!((s.rope.dim, s.rope.pairing), (16, RopePairing::Halves));
    assert!(s.norm_plus_one);
    assert_eq!(s.moe_layers().count(), 4);
    // An explicit list wins over the interval.
    let mut v = qwen3_next();
    v["layer_types"] = json!(["full_attention", "linear_attention", "linear_attention", "full_attention"]);
    assert_eq!(parse(&v).unwrap().mixers, [Attention, GatedDeltaNet, GatedDeltaNet, Attention]);
}

#[test]
fn a_layer_types_list_of_the_wrong_length_names_the_field() {
    let mut v = qwen3_next();
    v["layer_types"] = json!(["linear_attention", "full_attention"]);
    let e = parse(&v).unwrap_err();
    assert!(e.to_string().contains("num_hidden_layers is 4"), "{e}");
    assert_eq!(field_of(e), "layer_types");
    v["layer_types"] = json!(["linear_attention", "sliding_attention", "linear_attention", "full_attention"]);
    assert_eq!(field_of(parse(&v).unwrap_err()), "layer_types[1]");
}

#[test]
fn deltanet_heads_that_do_not_divide_name_the_field() {
    let mut v = qwen3_next();
    v["linear_num_value_heads"] = json!(3);
    assert_eq!(field_of(parse(&v).unwrap_err()), "linear_num_value_heads");
    let mut v = qwen3_next();
    v["linear_key_head_dim"] = json!(0);
    assert_eq!(field_of(parse(&v).unwrap_err()), "linear_key_head_dim");
}

#[test]
fn qwen35_moe_nests_its_text_model_and_stores_experts_fused() {
    let mut text = qwen3_next();
    text["model_type"] = json!("qwen3_5_moe_text");
    text["attn_output_gate"] = json!(true);
    text["norm_topk_prob"] = json!(false);
    let wrapper = json!({"model_type": "qwen3_5_moe", "text_config": text, "vision_config": {"depth": 2}});
    let cfg = parse_checkpoint_config(&wrapper.to_string(), Path::new("config.json")).unwrap();
    assert_eq!(cfg.spec.arch, Arch::Qwen35Moe);
    assert_eq!((cfg.tensor_prefix, cfg.canonical_prefix), ("model.language_model.", "model."));
    assert!(cfg.layout.fused_experts && !cfg.layout.fused_delta_net_inputs);
    // Qwen3.5's router always renormalises, whatever the field says.
    assert!(cfg.spec.moe.unwrap().routing.norm_topk_prob);
    assert_eq!(cfg.notes.len(), 1, "the vision tower is left out with a note");
    // Errors inside name the nested field.
    let mut bad = wrapper.clone();
    bad["text_config"]["layer_types"] = json!(["full_attention"]);
    let e = parse_checkpoint_config(&bad.to_string(), Path::new("config.json")).unwrap_err();
    assert_eq!(field_of(e), "text_config.layer_types");
}

#[test]
fn qwen3_next_stores_its_deltanet_inputs_fused() {
    let cfg = parse_checkpoint_config(&qwen3_next().to_string(), Path::new("config.json")).unwrap();
    assert!(cfg.layout.fused_delta_net_inputs && !cfg.layout.fused_experts);
    assert_eq!(cfg.tensor_prefix, "");
}

/// The presets have the published shapes (80 B / 3 B active; 35 B / 3 B active), and a trimmed
/// one keeps both layer kinds.
#[test]
fn the_hybrid_presets_have_the_published_shapes_and_survive_trimming() {
    use crate::model::tensors::param_counts;
    use crate::synth::{preset_config, Preset};
    let spec = |v: Value| parse_checkpoint_config(&v.to_string(), Path::new("config.json")).unwrap().spec;
    let next = spec(preset_config(Preset::Qwen3Next80b, None));
    assert_eq!(next.arch, Arch::Qwen3Next);
    assert_eq!(next.mixers.iter().filter(|m| **m == MixerKind::Attention).count(), 12);
    let c = param_counts(&next);
    eprintln!("qwen3-next-80b: total {} active {}", c.total, c.active);
    assert!((79.0e9..81.5e9).contains(&(c.total as f64)), "qwen3-next total {}", c.total);
    assert!((2.8e9..4.2e9).contains(&(c.active as f64)), "qwen3-next active {}", c.active);
    let q36 = spec(preset_config(Preset::Qwen36_35b, None));
    assert_eq!(q36.arch, Arch::Qwen35Moe);
    assert_eq!(q36.mixers.iter().filter(|m| **m == MixerKind::GatedDeltaNet).count(), 30);
    let c = param_counts(&q36);
    eprintln!("qwen3.6-35b: total {} active {}", c.total, c.active);
    assert!((33.0e9..36.0e9).contains(&(c.total as f64)), "qwen3.6 total {}", c.total);
    assert!((2.5e9..4.0e9).contains(&(c.active as f64)), "qwen3.6 active {}", c.active);
    for preset in [Preset::Qwen3Next80b, Preset::Qwen36_35b] {
        for n in [2, 3, 5] {
            let s = spec(preset_config(preset, Some(n)));
            assert_eq!(s.num_layers, n);
            assert!(s.mixers.contains(&MixerKind::Attention), "{preset} --layers {n}: {:?}", s.mixers);
            assert!(s.mixers.contains(&MixerKind::GatedDeltaNet), "{preset} --layers {n}: {:?}", s.mixers);
        }
    }
}

/// The CPU memory estimate counts KV for the attention layers only and one sequence's DeltaNet
/// state once, whatever the context.
#[test]
fn the_memory_estimate_counts_kv_of_attention_layers_and_the_deltanet_state_once() {
    use crate::cpu::memory::{estimate, WeightBits};
    use crate::synth::{preset_config, Preset};
    let v = preset_config(Preset::Qwen3Next80b, None);
    let s = parse_checkpoint_config(&v.to_string(), Path::new("config.json")).unwrap().spec;
    let e = estimate(&s, WeightBits::Int4);
    // 12 attention layers of 2 KV heads × 256, K and V in f32.
    assert_eq!(e.kv_bytes_per_token, 12 * 2 * 2 * 256 * 4);
    // 36 DeltaNet layers: 32 value heads × 128 × 128, and 3 conv inputs of 2·2048 + 4096 channels.
    assert_eq!(e.sequence_state_bytes, 36 * (32 * 128 * 128 + 3 * 8192) * 4);
    assert_eq!(e.total(1000) - e.total(0), 1000 * e.kv_bytes_per_token);
}
