//! `glm4_moe` configurations (the shape of `../shared/fixtures-next/glm4moe-tiny`'s, written out
//! here) and the inventory they imply: the biases and partial rotary as spec options, and the
//! refusal of `attention_bias` by families whose attention takes none.

use std::path::Path;

use serde_json::{json, Value};

use super::*;
use crate::model::tensors::{expected_tensors, TensorRole};

fn glm() -> Value {
    json!({
        "model_type": "glm4_moe", "vocab_size": 512, "hidden_size": 128, "intermediate_size": 320,
        "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 48, "partial_rotary_factor": 0.5, "attention_bias": true,
        "use_qk_norm": false, "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 3,
        "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5, "norm_topk_prob": true,
        "first_k_dense_replace": 1, "num_nextn_predict_layers": 0, "rope_theta": 1000000.0,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "hidden_act": "silu"
    })
}

fn parse(v: &Value) -> Result<ModelSpec> {
    parse_config(&v.to_string(), Path::new("/m/config.json"))
}

#[test]
fn glm4_moe_reads_biases_partial_rotary_groups_and_dense_first_layers() {
    let s = parse(&glm()).unwrap();
    assert_eq!(s.arch, Arch::Glm4Moe);
    assert_eq!(
        s.attention,
        AttentionSpec::Gqa {
            heads: 4,
            kv_heads: 2,
            head_dim: 48,
            qk_norm: QkNorm::None,
            bias: AttnBias { qkv: true, o: false },
            output_gate: false
        }
    );
    assert_eq!((s.rope.dim, s.rope.pairing, s.rope.theta), (24, RopePairing::Halves, 1e6));
    assert_eq!(s.layers, vec![FfnKind::Dense { intermediate_size: 320 }, FfnKind::Moe, FfnKind::Moe]);
    let moe = s.moe.as_ref().unwrap();
    assert_eq!((moe.n_routed_experts, moe.moe_intermediate_size, moe.shared_intermediate_size), (8, 32, 32));
    assert_eq!(moe.naming, ExpertNaming::Mlp);
    let r = moe.routing;
    assert_eq!(
        (r.scoring, r.topk, r.top_k),
        (ScoringFunc::Sigmoid, TopkMethod::NoauxTc { n_group: 4, topk_group: 2 }, 3)
    );
    assert!(r.norm_topk_prob && r.routed_scaling_factor == 2.5);
    assert!((s.softmax_scale - 48f32.powf(-0.5)).abs() < 1e-7);

    // The qk-norm variant, and transformers-5 `rope_parameters` carrying the factor.
    let mut v = glm();
    v["use_qk_norm"] = json!(true);
    v["rope_parameters"] = json!({"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25});
    let s = parse(&v).unwrap();
    assert!(matches!(s.attention, AttentionSpec::Gqa { qk_norm: QkNorm::PerHead, .. }));
    assert_eq!(s.rope.dim, 12);
}

#[test]
fn the_inventory_has_the_qkv_biases_and_no_o_bias() {
    let s = parse(&glm()).unwrap();
    let t = expected_tensors(&s);
    let biases: Vec<(&str, &[usize])> =
        t.iter().filter(|t| t.role == TensorRole::Bias).map(|t| (t.name.as_str(), t.shape.as_slice())).collect();
    let want: Vec<(String, Vec<usize>)> = (0..3)
        .flat_map(|l| {
            [("q", 192), ("k", 96), ("v", 96)]
                .map(|(p, n)| (format!("model.layers.{l}.self_attn.{p}_proj.bias"), vec![n]))
        })
        .collect();
    assert_eq!(biases.len(), want.len());
    for ((n, s), (wn, ws)) in biases.iter().zip(&want) {
        assert_eq!((*n, *s), (wn.as_str(), ws.as_slice()));
    }
    assert!(t.iter().any(|t| t.name == "model.layers.1.mlp.gate.e_score_correction_bias"));
    assert!(t.iter().any(|t| t.name == "model.layers.2.mlp.shared_experts.down_proj.weight"));
    assert!(t.iter().any(|t| t.name == "model.layers.0.mlp.up_proj.weight" && t.shape == [320, 128]));
    // Without `attention_bias`, none.
    let mut v = glm();
    v["attention_bias"] = json!(false);
    assert!(!expected_tensors(&parse(&v).unwrap()).iter().any(|t| t.role == TensorRole::Bias));
}

#[test]
fn bad_rotary_and_group_fields_are_named() {
    let err = |v: &Value| parse(v).unwrap_err().to_string();
    let mut v = glm();
    v["partial_rotary_factor"] = json!(0.3); // 48 × 0.3 = 14.4 → 14 is even, so make it odd:
    v["head_dim"] = json!(50); // 50 × 0.3 = 15
    assert!(err(&v).contains("`partial_rotary_factor`") && err(&v).contains("15"), "{}", err(&v));
    let mut v = glm();
    v["partial_rotary_factor"] = json!(1.5);
    assert!(err(&v).contains("`partial_rotary_factor`"), "{}", err(&v));
    let mut v = glm();
    v["n_group"] = json!(3);
    assert!(err(&v).contains("`n_group`"), "{}", err(&v));
    let mut v = glm();
    v["topk_group"] = json!(5);
    assert!(err(&v).contains("`topk_group`"), "{}", err(&v));
}

#[test]
fn families_without_the_bias_option_refuse_attention_bias() {
    for model_type in ["qwen3_moe", "mixtral", "deepseek_v3"] {
        let mut v = crate::synth::preset_config(crate::synth::Preset::Tiny, Some(2));
        v["model_type"] = json!(model_type);
        v["num_experts"] = json!(8);
        v["num_local_experts"] = json!(8);
        v["attention_bias"] = json!(true);
        let e = parse(&v).unwrap_err().to_string();
        assert!(e.contains("`attention_bias`") && e.contains("glm4_moe"), "{model_type}: {e}");
    }
}
