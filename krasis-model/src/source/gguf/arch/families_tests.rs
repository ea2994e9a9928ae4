//! The `qwen2moe`, `minimax-m2`, `glm4moe` and `gpt-oss` metadata → the hub twin's spec (the options llama.cpp leaves
//! implicit inferred as it does), and bad metadata named by its key. The whole twins run in
//! `tests/families_oracle` (`*_gguf`).

use krasis_quant::ggml::GgmlType;

use super::*;
use crate::source::gguf::writer::{GgufWriter, MetaValue};
use crate::source::gguf::{spec_from_gguf, GgufModel};
use crate::spec::{AttentionSpec, AttnBias, ExpertNaming, QkNorm, ScoringFunc, TopkMethod};

fn f32_bytes(n: usize) -> Vec<u8> {
    vec![0u8; 4 * n]
}

/// A 2-layer `arch` file of hidden 16 (4 heads of 4, 2 KV heads), 4 experts top-2 of width 8:
/// `kv` on top of the common metadata, `tensors` (name, ggml dims) beside the embedding.
fn model(arch: &str, kv: &[(&str, MetaValue)], tensors: &[(&str, &[u64])]) -> GgufWriter {
    let common = [
        ("block_count", 2),
        ("embedding_length", 16),
        ("attention.head_count", 4),
        ("attention.head_count_kv", 2),
        ("attention.key_length", 4),
        ("expert_count", 4),
        ("expert_used_count", 2),
        ("expert_feed_forward_length", 8),
        ("context_length", 4096),
    ];
    let mut w = GgufWriter::default();
    w.meta("general.architecture", MetaValue::Str(arch.into()));
    for (k, v) in common {
        w.meta(&format!("{arch}.{k}"), MetaValue::U32(v));
    }
    for (k, v) in kv {
        w.meta(&format!("{arch}.{k}"), v.clone());
    }
    w.tensor("token_embd.weight", &[16, 32], GgmlType::F32, f32_bytes(16 * 32));
    for (name, dims) in tensors {
        w.tensor(name, dims, GgmlType::F32, f32_bytes(dims.iter().product::<u64>() as usize));
    }
    w
}

fn spec_of(w: &GgufWriter, arch: &str) -> Result<ModelSpec> {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path().join("m.gguf");
    std::fs::write(&p, w.to_bytes()).unwrap();
    let m = GgufModel::open(&p).unwrap();
    let meta = Meta { m: &m, arch };
    let cfg = match arch {
        "qwen2moe" => qwen2moe_config(&meta)?,
        "glm4moe" => glm4moe_config(&meta)?,
        "gpt-oss" => gpt_oss_config(&meta)?,
        _ => minimax_m2_config(&meta)?,
    };
    parse_config(&Json::Object(cfg).to_string(), m.path())
}

#[test]
fn qwen2moe_metadata_gives_biases_the_gated_shared_expert_and_no_renormalising() {
    let kv = [("feed_forward_length", MetaValue::U32(24)), ("expert_shared_feed_forward_length", MetaValue::U32(12))];
    let s = spec_of(&model("qwen2moe", &kv, &[("blk.0.attn_q.bias", &[16])]), "qwen2moe").unwrap();
    assert!(matches!(
        s.attention,
        AttentionSpec::Gqa {
            heads: 4,
            kv_heads: 2,
            head_dim: 4,
            qk_norm: QkNorm::None,
            bias: AttnBias { qkv: true, o: false },
            ..
        }
    ));
    let moe = s.moe.unwrap();
    assert_eq!((moe.moe_intermediate_size, moe.shared_intermediate_size), (8, 12));
    assert!(moe.shared_gate && !moe.routing.norm_topk_prob);
    assert_eq!(moe.naming, ExpertNaming::MlpSharedExpert);
    // Without a shared width the shared expert is `feed_forward_length` wide (llama.cpp's rule);
    // without stored biases, none.
    let s = spec_of(&model("qwen2moe", &kv[..1], &[]), "qwen2moe").unwrap();
    assert_eq!(s.moe.unwrap().shared_intermediate_size, 24);
    assert!(matches!(s.attention, AttentionSpec::Gqa { bias: AttnBias::NONE, .. }));
    let e = spec_of(&model("qwen2moe", &[], &[]), "qwen2moe").unwrap_err().to_string();
    assert!(e.contains("`qwen2moe.feed_forward_length`"), "{e}");
}

#[test]
fn minimax_m2_metadata_gives_whole_qk_norm_rotary_dim_and_the_correction_bias() {
    let kv = [("rope.dimension_count", MetaValue::U32(2)), ("expert_gating_func", MetaValue::U32(2))];
    let t: [(&str, &[u64]); 2] = [("blk.0.attn_q_norm.weight", &[16]), ("blk.0.exp_probs_b.bias", &[4])];
    let s = spec_of(&model("minimax-m2", &kv, &t), "minimax-m2").unwrap();
    assert!(matches!(s.attention, AttentionSpec::Gqa { qk_norm: QkNorm::Whole, bias: AttnBias::NONE, .. }));
    assert_eq!(s.rope.dim, 2);
    let moe = s.moe.unwrap();
    assert_eq!((moe.n_routed_experts, moe.moe_intermediate_size, moe.routing.top_k), (4, 8, 2));
    assert_eq!(moe.routing.scoring, ScoringFunc::Sigmoid);
    assert_eq!(moe.routing.topk, TopkMethod::NoauxTc { n_group: 1, topk_group: 1 });
    assert_eq!(moe.naming, ExpertNaming::BlockSparse);
    // Neither tensor stored: no qk-norm, routing without the bias.
    let s = spec_of(&model("minimax-m2", &kv, &[]), "minimax-m2").unwrap();
    assert!(matches!(s.attention, AttentionSpec::Gqa { qk_norm: QkNorm::None, .. }));
    assert_eq!(s.moe.unwrap().routing.topk, TopkMethod::Greedy);
    let e = spec_of(&model("minimax-m2", &[("expert_gating_func", MetaValue::U32(1))], &[]), "minimax-m2")
        .unwrap_err()
        .to_string();
    assert!(e.contains("`minimax-m2.expert_gating_func`"), "{e}");
    let e = spec_of(&model("minimax-m2", &[("rope.dimension_count", MetaValue::U32(3))], &[]), "minimax-m2")
        .unwrap_err()
        .to_string();
    assert!(e.contains("`rotary_dim`") && e.contains('3'), "{e}");
}

#[test]
fn glm4moe_metadata_gives_groups_partial_rotary_dense_lead_and_drops_the_mtp_blocks() {
    let kv = [
        ("nextn_predict_layers", MetaValue::U32(1)),
        ("feed_forward_length", MetaValue::U32(24)),
        ("leading_dense_block_count", MetaValue::U32(0)),
        ("expert_shared_count", MetaValue::U32(1)),
        ("expert_group_count", MetaValue::U32(2)),
        ("expert_group_used_count", MetaValue::U32(1)),
        ("expert_gating_func", MetaValue::U32(2)),
        ("expert_weights_scale", MetaValue::F32(2.5)),
        ("expert_weights_norm", MetaValue::Bool(true)),
        ("rope.dimension_count", MetaValue::U32(2)),
    ];
    let t: [(&str, &[u64]); 1] = [("blk.0.attn_q.bias", &[16])];
    let s = spec_of(&model("glm4moe", &kv, &t), "glm4moe").unwrap();
    assert_eq!(s.num_layers, 1, "the MTP block after the last layer is not a layer");
    assert!(matches!(
        s.attention,
        AttentionSpec::Gqa { qk_norm: QkNorm::None, bias: AttnBias { qkv: true, o: false }, .. }
    ));
    assert_eq!(s.rope.dim, 2);
    let moe = s.moe.unwrap();
    assert_eq!((moe.shared_intermediate_size, moe.routing.routed_scaling_factor), (8, 2.5));
    assert_eq!(moe.routing.topk, TopkMethod::NoauxTc { n_group: 2, topk_group: 1 });
    let bad = |k: &'static str, v: u32| {
        let mut kv: Vec<(&str, MetaValue)> = kv.to_vec();
        kv.retain(|(n, _)| *n != k);
        kv.push((k, MetaValue::U32(v)));
        spec_of(&model("glm4moe", &kv, &t), "glm4moe").unwrap_err().to_string()
    };
    let e = bad("expert_gating_func", 1);
    assert!(e.contains("`glm4moe.expert_gating_func`"), "{e}");
    let e = bad("rope.dimension_count", 5);
    assert!(e.contains("`glm4moe.rope.dimension_count`") && e.contains("head_dim"), "{e}");
    let e = bad("nextn_predict_layers", 2);
    assert!(e.contains("`glm4moe.nextn_predict_layers`"), "{e}");
}

#[test]
fn gpt_oss_metadata_gives_windows_on_even_layers_sinks_biases_and_untruncated_yarn() {
    let kv = [
        ("attention.sliding_window", MetaValue::U32(8)),
        ("rope.scaling.type", MetaValue::Str("yarn".into())),
        ("rope.scaling.factor", MetaValue::F32(32.0)),
        ("rope.scaling.original_context_length", MetaValue::U32(64)),
    ];
    let t: [(&str, &[u64]); 1] = [("blk.0.attn_q.bias", &[16])];
    let s = spec_of(&model("gpt-oss", &kv, &t), "gpt-oss").unwrap();
    assert_eq!(s.sliding_windows, vec![Some(8), None], "even layers slide, odd ones attend fully");
    assert!(s.attention_sinks && s.expert_bias);
    assert!(matches!(s.attention, AttentionSpec::Gqa { bias: AttnBias { qkv: true, o: true }, .. }));
    assert!(matches!(s.rope.scaling, crate::spec::RopeScaling::Yarn { truncate: false, .. }));
    let moe = s.moe.unwrap();
    assert_eq!((moe.n_routed_experts, moe.moe_intermediate_size, moe.naming), (4, 8, ExpertNaming::Router));
}

#[test]
fn the_whole_maps_need_their_tensors() {
    // The metadata parses; the file lacks every layer tensor, which the map names.
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path().join("m.gguf");
    let kv = [("feed_forward_length", MetaValue::U32(24))];
    std::fs::write(&p, model("qwen2moe", &kv, &[]).to_bytes()).unwrap();
    let e = spec_from_gguf(&GgufModel::open(&p).unwrap()).unwrap_err().to_string();
    assert!(e.contains("missing") && e.contains("blk.0."), "{e}");
}
