//! `minimax_m2` configurations (the shape of `../shared/fixtures-next/minimaxm2-tiny`'s, written
//! out here) and the inventory they imply: the whole-projection qk-norm, partial rotary from
//! `rotary_dim`, sigmoid routing with the correction bias beside the gate; bad fields named.

use std::path::Path;

use serde_json::{json, Value};

use super::*;
use crate::model::tensors::{expected_tensors, TensorRole};

fn minimax() -> Value {
    json!({
        "model_type": "minimax_m2", "vocab_size": 512, "hidden_size": 128, "intermediate_size": 32,
        "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32,
        "rotary_dim": 16, "rope_theta": 5000000, "num_local_experts": 16, "num_experts_per_tok": 4,
        "scoring_func": "sigmoid", "use_routing_bias": true, "use_qk_norm": true,
        "qk_norm_type": "per_layer", "shared_intermediate_size": 0, "max_position_embeddings": 196608,
        "rms_norm_eps": 1e-6, "sliding_window": null, "use_mtp": false, "attn_type_list": [1, 1, 1],
        "hidden_act": "silu"
    })
}

fn parse(v: &Value) -> Result<ModelSpec> {
    parse_config(&v.to_string(), Path::new("/m/config.json"))
}

#[test]
fn minimax_m2_reads_whole_qk_norm_rotary_dim_and_biased_sigmoid_routing() {
    let s = parse(&minimax()).unwrap();
    assert_eq!(s.arch, Arch::MiniMaxM2);
    assert_eq!(
        s.attention,
        AttentionSpec::Gqa {
            heads: 8,
            kv_heads: 2,
            head_dim: 32,
            qk_norm: QkNorm::Whole,
            bias: AttnBias::NONE,
            output_gate: false,
        }
    );
    assert_eq!((s.rope.dim, s.rope.pairing, s.rope.theta), (16, RopePairing::Halves, 5e6));
    assert_eq!(s.layers, vec![FfnKind::Moe; 3]);
    let moe = s.moe.as_ref().unwrap();
    assert_eq!((moe.n_routed_experts, moe.moe_intermediate_size, moe.shared_intermediate_size), (16, 32, 0));
    assert!(!moe.shared_gate);
    assert_eq!(moe.naming, ExpertNaming::BlockSparse);
    let r = moe.routing;
    assert_eq!(
        (r.scoring, r.topk, r.top_k),
        (ScoringFunc::Sigmoid, TopkMethod::NoauxTc { n_group: 1, topk_group: 1 }, 4)
    );
    assert!(r.norm_topk_prob && r.routed_scaling_factor == 1.0);
    // The fixture's config states the factor as well (agreeing); a factor alone gives the dims.
    let mut v = minimax();
    v["partial_rotary_factor"] = json!(0.5);
    assert_eq!(parse(&v).unwrap().rope.dim, 16);
    v["rotary_dim"] = Value::Null;
    v["partial_rotary_factor"] = json!(0.25);
    assert_eq!(parse(&v).unwrap().rope.dim, 8);
    v["partial_rotary_factor"] = Value::Null;
    assert_eq!(parse(&v).unwrap().rope.dim, 32);
    // The per-head form, no norm, and routing without the bias.
    let mut v = minimax();
    v["qk_norm_type"] = json!("per_head");
    assert!(matches!(parse(&v).unwrap().attention, AttentionSpec::Gqa { qk_norm: QkNorm::PerHead, .. }));
    v["use_qk_norm"] = json!(false);
    v["use_routing_bias"] = json!(false);
    let s = parse(&v).unwrap();
    assert!(matches!(s.attention, AttentionSpec::Gqa { qk_norm: QkNorm::None, .. }));
    assert_eq!(s.moe.unwrap().routing.topk, TopkMethod::Greedy);
}

#[test]
fn the_inventory_has_whole_projection_norms_and_the_bias_beside_the_gate() {
    let s = parse(&minimax()).unwrap();
    let t = expected_tensors(&s);
    let find = |n: &str| t.iter().find(|t| t.name == n).unwrap_or_else(|| panic!("{n} missing"));
    assert_eq!(find("model.layers.0.self_attn.q_norm.weight").shape, [256]);
    assert_eq!(find("model.layers.0.self_attn.k_norm.weight").shape, [64]);
    let bias = find("model.layers.2.block_sparse_moe.e_score_correction_bias");
    assert_eq!((bias.shape.as_slice(), bias.role), (&[16][..], TensorRole::RouterBias));
    assert_eq!(find("model.layers.1.block_sparse_moe.gate.weight").shape, [16, 128]);
    assert_eq!(find("model.layers.1.block_sparse_moe.experts.15.w2.weight").shape, [128, 32]);
    assert!(!t.iter().any(|t| t.name.contains("gate.e_score") || t.name.contains("shared")));
    assert!(!t.iter().any(|t| t.role == TensorRole::Bias));
    // Per head, the norms are head-wide.
    let mut v = minimax();
    v["qk_norm_type"] = json!("per_head");
    let t = expected_tensors(&parse(&v).unwrap());
    assert!(t.iter().any(|t| t.name == "model.layers.0.self_attn.q_norm.weight" && t.shape == [32]));
}

#[test]
fn bad_minimax_m2_fields_are_named() {
    let err = |v: &Value| parse(v).unwrap_err().to_string();
    let mut v = minimax();
    v["rotary_dim"] = json!(15);
    assert!(err(&v).contains("`rotary_dim`") && err(&v).contains("15"), "{}", err(&v));
    let mut v = minimax();
    v["partial_rotary_factor"] = json!(1.0);
    assert!(err(&v).contains("`rotary_dim`") && err(&v).contains("disagrees"), "{}", err(&v));
    let mut v = minimax();
    v["qk_norm_type"] = json!("per_token");
    assert!(err(&v).contains("`qk_norm_type`") && err(&v).contains("per_token"), "{}", err(&v));
    let mut v = minimax();
    v["scoring_func"] = json!("softmax");
    assert!(err(&v).contains("`scoring_func`"), "{}", err(&v));
    let mut v = minimax();
    v["attn_type_list"] = json!([1, 0, 1]);
    assert!(err(&v).contains("`attn_type_list[1]`"), "{}", err(&v));
    let mut v = minimax();
    v["shared_intermediate_size"] = json!(64);
    assert!(err(&v).contains("`shared_intermediate_size`"), "{}", err(&v));
    let mut v = minimax();
    v["sliding_window"] = json!(4096);
    assert!(err(&v).contains("`sliding_window`"), "{}", err(&v));
    let mut v = minimax();
    v["num_experts_per_tok"] = json!(17);
    assert!(err(&v).contains("`num_experts_per_tok`"), "{}", err(&v));
    let mut v = minimax();
    v["attention_bias"] = json!(true);
    assert!(err(&v).contains("`attention_bias`"), "{}", err(&v));
}

#[test]
fn fp8_as_the_published_config_names_it() {
    let mut v = minimax();
    v["quantization_config"] = json!({
        "activation_scheme": "dynamic", "fmt": "float8_e4m3fn", "quant_method": "fp8",
        "weight_block_size": [128, 128], "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"]
    });
    assert_eq!(parse(&v).unwrap().source_quant, SourceQuant::Fp8Block { block_rows: 128, block_cols: 128 });
    v["quantization_config"]["fmt"] = json!("e5m2");
    assert!(parse(&v).unwrap_err().to_string().contains("`quantization_config.fmt`"));
}
