//! `qwen2_moe` configurations (the shape of `../shared/fixtures-next/qwen2moe-tiny`'s, written
//! out here) and the inventory they imply: q/k/v biases without a flag, the sigmoid-gated shared
//! expert, the sparse-step layer plan; bad fields named.

use std::path::Path;

use serde_json::{json, Value};

use super::*;
use crate::model::tensors::{expected_tensors, TensorRole};

fn qwen2() -> Value {
    json!({
        "model_type": "qwen2_moe", "vocab_size": 512, "hidden_size": 128, "intermediate_size": 352,
        "moe_intermediate_size": 32, "shared_expert_intermediate_size": 128, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 4, "num_experts": 12, "num_experts_per_tok": 4,
        "norm_topk_prob": false, "decoder_sparse_step": 1, "mlp_only_layers": [], "rope_theta": 1000000.0,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "use_sliding_window": false,
        "sliding_window": 32768, "hidden_act": "silu"
    })
}

fn parse(v: &Value) -> Result<ModelSpec> {
    parse_config(&v.to_string(), Path::new("/m/config.json"))
}

#[test]
fn qwen2_moe_reads_biases_the_gated_shared_expert_and_softmax_without_renormalising() {
    let s = parse(&qwen2()).unwrap();
    assert_eq!(s.arch, Arch::Qwen2Moe);
    assert_eq!(
        s.attention,
        AttentionSpec::Gqa {
            heads: 4,
            kv_heads: 4,
            head_dim: 32,
            qk_norm: QkNorm::None,
            bias: AttnBias { qkv: true, o: false },
            output_gate: false,
        }
    );
    assert_eq!((s.rope.dim, s.rope.pairing, s.rope.theta), (32, RopePairing::Halves, 1e6));
    assert_eq!(s.layers, vec![FfnKind::Moe; 3]);
    let moe = s.moe.as_ref().unwrap();
    assert_eq!((moe.n_routed_experts, moe.moe_intermediate_size, moe.shared_intermediate_size), (12, 32, 128));
    assert!(moe.shared_gate);
    assert_eq!(moe.naming, ExpertNaming::MlpSharedExpert);
    let r = moe.routing;
    assert_eq!((r.scoring, r.topk, r.top_k), (ScoringFunc::Softmax, TopkMethod::Greedy, 4));
    assert!(!r.norm_topk_prob && r.routed_scaling_factor == 1.0);
    // transformers' `qkv_bias`, when a config states it.
    let mut v = qwen2();
    v["qkv_bias"] = json!(false);
    assert!(matches!(parse(&v).unwrap().attention, AttentionSpec::Gqa { bias: AttnBias::NONE, .. }));
}

#[test]
fn sparse_step_and_mlp_only_layers_make_dense_layers() {
    let mut v = qwen2();
    v["num_hidden_layers"] = json!(6);
    v["decoder_sparse_step"] = json!(2);
    v["mlp_only_layers"] = json!([3]);
    let s = parse(&v).unwrap();
    let d = FfnKind::Dense { intermediate_size: 352 };
    assert_eq!(s.layers, vec![d.clone(), FfnKind::Moe, d.clone(), d.clone(), d, FfnKind::Moe]);
}

#[test]
fn the_inventory_has_the_shared_expert_its_gate_and_the_biases() {
    let s = parse(&qwen2()).unwrap();
    let t = expected_tensors(&s);
    let find = |n: &str| t.iter().find(|t| t.name == n).unwrap_or_else(|| panic!("{n} missing"));
    let gate = find("model.layers.1.mlp.shared_expert_gate.weight");
    assert_eq!((gate.shape.as_slice(), gate.role), (&[1, 128][..], TensorRole::Router));
    assert_eq!(find("model.layers.2.mlp.shared_expert.down_proj.weight").shape, [128, 128]);
    assert_eq!(find("model.layers.0.mlp.experts.11.gate_proj.weight").shape, [32, 128]);
    assert_eq!(find("model.layers.0.self_attn.k_proj.bias").shape, [128]);
    assert!(!t.iter().any(|t| t.name.contains("shared_experts") || t.name.contains("e_score_correction_bias")));
    assert!(!t.iter().any(|t| t.name.ends_with("o_proj.bias") || t.name.contains("q_norm")));
}

#[test]
fn bad_qwen2_moe_fields_are_named() {
    let err = |v: &Value| parse(v).unwrap_err().to_string();
    let mut v = qwen2();
    v["shared_expert_intermediate_size"] = Value::Null;
    assert!(err(&v).contains("`shared_expert_intermediate_size`"), "{}", err(&v));
    let mut v = qwen2();
    v["num_experts_per_tok"] = json!(13);
    assert!(err(&v).contains("`num_experts_per_tok`"), "{}", err(&v));
    let mut v = qwen2();
    v["decoder_sparse_step"] = json!(0);
    assert!(err(&v).contains("`decoder_sparse_step`"), "{}", err(&v));
    let mut v = qwen2();
    v["mlp_only_layers"] = json!([5]);
    assert!(err(&v).contains("`mlp_only_layers`") && err(&v).contains('5'), "{}", err(&v));
    let mut v = qwen2();
    v["mlp_only_layers"] = json!([0]);
    v["intermediate_size"] = Value::Null;
    assert!(err(&v).contains("`intermediate_size`") && err(&v).contains("layer 0"), "{}", err(&v));
    let mut v = qwen2();
    v["use_sliding_window"] = json!(true);
    assert!(err(&v).contains("`use_sliding_window`"), "{}", err(&v));
    let mut v = qwen2();
    v["qkv_bias"] = json!("yes");
    assert!(err(&v).contains("`qkv_bias`"), "{}", err(&v));
}
