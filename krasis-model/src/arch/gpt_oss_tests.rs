//! `gpt_oss` configurations (the shape of `../shared/fixtures-next/gptoss-tiny`'s, written out
//! here) and the inventory they imply: biases on q/k/v/o, sinks, per-layer windows from
//! `layer_types` (or the alternation without it), the router linear with its bias, experts with
//! biases and the clamped SwiGLU; bad fields named.

use std::path::Path;

use serde_json::{json, Value};

use super::*;
use crate::model::tensors::{expected_tensors, TensorRole};

fn gpt_oss() -> Value {
    json!({
        "model_type": "gpt_oss", "vocab_size": 512, "hidden_size": 160, "intermediate_size": 64,
        "num_hidden_layers": 3, "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 32,
        "num_local_experts": 8, "num_experts_per_tok": 4, "experts_per_token": 4, "sliding_window": 8,
        "attention_bias": true, "swiglu_limit": 7.0, "rms_norm_eps": 1e-5, "rope_theta": 150000,
        "max_position_embeddings": 131072, "hidden_act": "silu",
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "truncate": false, "original_max_position_embeddings": 4096},
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]
    })
}

fn parse(v: &Value) -> Result<ModelSpec> {
    parse_config(&v.to_string(), Path::new("/m/config.json"))
}

fn err(v: &Value) -> String {
    parse(v).unwrap_err().to_string()
}

#[test]
fn gpt_oss_reads_its_options() {
    let s = parse(&gpt_oss()).unwrap();
    assert_eq!(s.arch, Arch::GptOss);
    assert!(matches!(
        s.attention,
        AttentionSpec::Gqa {
            heads: 6,
            kv_heads: 2,
            head_dim: 32,
            qk_norm: QkNorm::None,
            bias: AttnBias { qkv: true, o: true },
            output_gate: false
        }
    ));
    assert_eq!(s.sliding_windows, vec![Some(8), None, Some(8)]);
    assert!(s.attention_sinks && s.expert_bias);
    assert_eq!(s.expert_activation, ExpertActivation::ClampedSwiglu { alpha: 1.702, limit: 7.0 });
    assert_eq!((s.rope.dim, s.rope.pairing), (32, RopePairing::Halves));
    assert!(matches!(s.rope.scaling, RopeScaling::Yarn { truncate: false, .. }));
    let moe = s.moe.as_ref().unwrap();
    assert_eq!((moe.n_routed_experts, moe.moe_intermediate_size, moe.naming), (8, 64, ExpertNaming::Router));
    assert_eq!(
        moe.routing,
        RoutingRule {
            scoring: ScoringFunc::Softmax,
            topk: TopkMethod::Greedy,
            top_k: 4,
            norm_topk_prob: true,
            routed_scaling_factor: 1.0
        }
    );
    // Without layer_types: even layers sliding (transformers' default).
    let mut v = gpt_oss();
    v.as_object_mut().unwrap().remove("layer_types");
    v["num_hidden_layers"] = json!(4);
    assert_eq!(parse(&v).unwrap().sliding_windows, vec![Some(8), None, Some(8), None]);
}

#[test]
fn gpt_oss_inventory_has_sinks_router_bias_and_expert_biases() {
    let t = expected_tensors(&parse(&gpt_oss()).unwrap());
    let find = |n: &str| t.iter().find(|x| x.name == n).unwrap_or_else(|| panic!("{n} missing"));
    assert_eq!(find("model.layers.0.self_attn.sinks").shape, vec![6]);
    assert_eq!(find("model.layers.2.self_attn.o_proj.bias").shape, vec![160]);
    assert_eq!(find("model.layers.1.mlp.router.weight").shape, vec![8, 160]);
    let rb = find("model.layers.1.mlp.router.bias");
    assert_eq!((rb.shape.as_slice(), rb.role), (&[8][..], TensorRole::Bias));
    assert_eq!(find("model.layers.1.mlp.experts.7.gate_proj.weight").shape, vec![64, 160]);
    assert_eq!(find("model.layers.1.mlp.experts.7.up_proj.bias").shape, vec![64]);
    assert_eq!(find("model.layers.1.mlp.experts.7.down_proj.bias").shape, vec![160]);
    assert!(!t.iter().any(|x| x.role == TensorRole::RouterBias));
}

#[test]
fn gpt_oss_bad_fields_are_named() {
    let mut v = gpt_oss();
    v["layer_types"] = json!(["sliding_attention", "full_attention"]);
    assert!(err(&v).contains("layer_types") && err(&v).contains("num_hidden_layers is 3"), "{}", err(&v));
    v["layer_types"] = json!(["sliding_attention", "linear_attention", "full_attention"]);
    assert!(err(&v).contains("layer_types[1]"), "{}", err(&v));
    let mut v = gpt_oss();
    v.as_object_mut().unwrap().remove("sliding_window");
    assert!(err(&v).contains("sliding_window"), "{}", err(&v));
    let mut v = gpt_oss();
    v["swiglu_limit"] = json!(-1.0);
    assert!(err(&v).contains("swiglu_limit"), "{}", err(&v));
    let mut v = gpt_oss();
    v["num_experts_per_tok"] = json!(9);
    assert!(err(&v).contains("num_experts_per_tok"), "{}", err(&v));
    let mut v = gpt_oss();
    v.as_object_mut().unwrap().remove("num_local_experts");
    assert!(err(&v).contains("num_local_experts"), "{}", err(&v));
}
