use std::sync::Arc;

use krasis_core::DType;
use krasis_quant::ggml::GgmlType;

use super::*;
use crate::source::gguf::writer::{GgufWriter, MetaValue};
use crate::source::gguf::{spec_from_gguf, GgufModel, GgufSource, GgufTensorRef, TensorMap};
use crate::source::WeightSource;

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// The metadata of a small `qwen3next` (2 key heads × 8, 4 value heads × 8, layers
/// [DeltaNet, attention]) with `edit` applied, and a token embedding.
fn qwen3next(edit: impl FnOnce(&mut Vec<(String, MetaValue)>)) -> GgufWriter {
    let mut kv: Vec<(String, MetaValue)> = [
        ("general.architecture", MetaValue::Str("qwen3next".into())),
        ("qwen3next.block_count", MetaValue::U32(2)),
        ("qwen3next.embedding_length", MetaValue::U32(16)),
        ("qwen3next.attention.head_count", MetaValue::U32(2)),
        ("qwen3next.attention.head_count_kv", MetaValue::U32(1)),
        ("qwen3next.attention.key_length", MetaValue::U32(8)),
        ("qwen3next.attention.value_length", MetaValue::U32(8)),
        ("qwen3next.rope.dimension_count", MetaValue::U32(2)),
        ("qwen3next.expert_count", MetaValue::U32(4)),
        ("qwen3next.expert_used_count", MetaValue::U32(2)),
        ("qwen3next.expert_feed_forward_length", MetaValue::U32(8)),
        ("qwen3next.expert_shared_feed_forward_length", MetaValue::U32(8)),
        ("qwen3next.ssm.conv_kernel", MetaValue::U32(4)),
        ("qwen3next.ssm.state_size", MetaValue::U32(8)),
        ("qwen3next.ssm.group_count", MetaValue::U32(2)),
        ("qwen3next.ssm.time_step_rank", MetaValue::U32(4)),
        ("qwen3next.ssm.inner_size", MetaValue::U32(32)),
        ("qwen3next.attention.recurrent_layers", MetaValue::I32Array(vec![1, 0])),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    edit(&mut kv);
    let mut w = GgufWriter { kv, ..GgufWriter::default() };
    w.tensor("token_embd.weight", &[16, 8], GgmlType::F32, f32_bytes(&[0.0; 128]));
    for l in 0..2 {
        w.tensor(&format!("blk.{l}.ffn_gate_inp.weight"), &[16, 4], GgmlType::F32, f32_bytes(&[0.0; 64]));
    }
    w
}

fn open(w: &GgufWriter) -> (tempfile::TempDir, GgufModel) {
    let tmp = tempfile::tempdir().unwrap();
    let p = tmp.path().join("m.gguf");
    std::fs::write(&p, w.to_bytes()).unwrap();
    let m = GgufModel::open(&p).unwrap();
    (tmp, m)
}

fn set(kv: &mut [(String, MetaValue)], key: &str, v: MetaValue) {
    kv.iter_mut().find(|(k, _)| k == key).expect("key in the template").1 = v;
}

/// The error of `spec_from_gguf` on the edited metadata, which must name `key`.
fn meta_error(edit: impl FnOnce(&mut Vec<(String, MetaValue)>), key: &str) -> String {
    let (_tmp, m) = open(&qwen3next(edit));
    let e = spec_from_gguf(&m).expect_err("bad metadata must be refused").to_string();
    assert!(e.contains(&format!("`{key}`")), "error `{e}` does not name `{key}`");
    assert!(!e.contains('\n'), "{e}");
    e
}

#[test]
fn the_metadata_gives_the_qwen3_next_spec() {
    let (_tmp, m) = open(&qwen3next(|_| {}));
    // The metadata parses; the tensors (only the embedding here) are then reported missing.
    let e = spec_from_gguf(&m).expect_err("tensors missing").to_string();
    assert!(e.contains("blk.0.ssm_conv1d.weight") || e.contains("missing"), "{e}");
    let cfg = config(&Meta { m: &m, arch: "qwen3next" }, false).unwrap();
    let spec = crate::arch::parse_config(&Json::Object(cfg).to_string(), m.path()).unwrap();
    let d = spec.delta_net.unwrap();
    assert_eq!((d.key_heads, d.value_heads, d.key_dim, d.value_dim, d.conv_kernel), (2, 4, 8, 8, 4));
    assert!(spec.is_delta_net(0) && !spec.is_delta_net(1));
    assert_eq!(spec.rope.dim, 2);
}

#[test]
fn mtp_layers_are_left_out() {
    let (_tmp, m) = open(&qwen3next(|kv| {
        set(kv, "qwen3next.block_count", MetaValue::U32(3));
        set(kv, "qwen3next.attention.recurrent_layers", MetaValue::I32Array(vec![1, 0, 0]));
        kv.push(("qwen3next.nextn_predict_layers".into(), MetaValue::U32(1)));
    }));
    let cfg = config(&Meta { m: &m, arch: "qwen3next" }, false).unwrap();
    let spec = crate::arch::parse_config(&Json::Object(cfg).to_string(), m.path()).unwrap();
    assert_eq!(spec.num_layers, 2);
    assert!(spec.is_delta_net(0) && !spec.is_delta_net(1));
    meta_error(
        |kv| kv.push(("qwen3next.nextn_predict_layers".into(), MetaValue::U32(2))),
        "qwen3next.nextn_predict_layers",
    );
}

#[test]
fn delta_net_dims_that_do_not_divide_are_named() {
    let e = meta_error(|kv| set(kv, "qwen3next.ssm.inner_size", MetaValue::U32(30)), "qwen3next.ssm.inner_size");
    assert!(e.contains("30") && e.contains("4 value heads"), "{e}");
    let e = meta_error(|kv| set(kv, "qwen3next.ssm.time_step_rank", MetaValue::U32(3)), "qwen3next.ssm.time_step_rank");
    assert!(e.contains("ssm.group_count 2"), "{e}");
    meta_error(|kv| set(kv, "qwen3next.ssm.group_count", MetaValue::U32(0)), "qwen3next.ssm.group_count");
    meta_error(|kv| kv.retain(|(k, _)| k != "qwen3next.ssm.state_size"), "qwen3next.ssm.state_size");
}

#[test]
fn other_bad_metadata_is_named() {
    meta_error(
        |kv| set(kv, "qwen3next.attention.recurrent_layers", MetaValue::I32Array(vec![1, 0, 1])),
        "qwen3next.attention.recurrent_layers",
    );
    meta_error(
        |kv| set(kv, "qwen3next.attention.recurrent_layers", MetaValue::Str("yes".into())),
        "qwen3next.attention.recurrent_layers",
    );
    meta_error(|kv| set(kv, "qwen3next.rope.dimension_count", MetaValue::U32(12)), "qwen3next.rope.dimension_count");
    meta_error(|kv| set(kv, "qwen3next.attention.value_length", MetaValue::U32(4)), "qwen3next.attention.value_length");
    // A layer without a router is a dense MLP, whose width the metadata must give.
    let (_tmp, m) = open(&{
        let mut w = qwen3next(|_| {});
        w.tensors.retain(|t| t.0 != "blk.1.ffn_gate_inp.weight");
        w
    });
    let e = spec_from_gguf(&m).err().unwrap().to_string();
    assert!(e.contains("`qwen3next.feed_forward_length`") && e.contains("missing"), "{e}");
}

#[test]
fn tiled_value_heads_are_llama_cpp_order() {
    // llama.cpp's qwen35moe stores [k0 v0, k1 v0, k0 v1, k1 v1]; canonical is grouped by key head.
    assert_eq!(tiled_rows(2, 4, 1), [0, 2, 1, 3]);
    assert_eq!(tiled_rows(2, 4, 2), [0, 1, 4, 5, 2, 3, 6, 7]);
    assert_eq!(tiled_rows(3, 6, 1), [0, 3, 1, 4, 2, 5]);
    // Equal heads: nothing moves.
    assert_eq!(tiled_rows(4, 4, 3), (0..12).collect::<Vec<_>>());
}

#[test]
fn a_log_comes_back_from_ssm_a() {
    // Every A the converter can write from an f32 A_log is served exactly (its decay as stored).
    let mut worst = 0f64;
    for i in 0..20_000 {
        let y = -4.0 + 8.0 * i as f32 / 20_000.0;
        let a = -y.exp();
        let back = a_log_of(a).unwrap();
        assert_eq!(-back.exp(), a, "A_log {y}: A {a} came back as −exp({back})");
        // Any stored A: within 2 ulps.
        let a = -(0.01 + i as f32 * 3.7e-4) * (1.0 + 1e-7 * (i % 7) as f32);
        let got = -(a_log_of(a).unwrap().exp() as f64);
        worst = worst.max(((got - a as f64) / a as f64).abs());
    }
    assert!(worst <= 3.0 * f32::EPSILON as f64, "worst relative error {worst:.3e}");
    for bad in [0.0, 1.0, f32::NAN, f32::NEG_INFINITY] {
        assert_eq!(a_log_of(bad), None, "{bad}");
    }
}

#[test]
fn rearranged_tensors_gather_rows_columns_and_values() {
    let mut w = GgufWriter::default();
    // x: [3 rows, 2 cols] F32; b: the same in BF16; a: ssm_a.
    let x = [1.0f32, 2., 3., 4., 5., 6.];
    let bf: Vec<u8> = x.iter().flat_map(|v| half::bf16::from_f32(*v).to_le_bytes()).collect();
    w.tensor("x", &[2, 3], GgmlType::F32, f32_bytes(&x))
        .tensor("b", &[2, 3], GgmlType::BF16, bf)
        .tensor("a", &[2], GgmlType::F32, f32_bytes(&[-0.5, -2.0]))
        .tensor("p", &[2], GgmlType::F32, f32_bytes(&[0.5, -2.0]));
    let (_tmp, m) = open(&w);
    let r = |from: &str, stored: Vec<usize>, shape: Vec<usize>| Rearranged {
        from: from.into(),
        stored,
        shape,
        rows: None,
        cols: None,
        values: StoredValues::AsStored,
    };
    let mut map = TensorMap::new();
    let mut add = |name: &str, v: Rearranged| map.insert(name.into(), GgufTensorRef::Rearranged(v));
    add("rows", Rearranged { rows: Some(vec![2, 0]), ..r("x", vec![3, 2], vec![2, 2]) });
    add("cols", Rearranged { cols: Some(vec![1, 0]), ..r("x", vec![3, 2], vec![3, 2]) });
    add("both_bf16", Rearranged { rows: Some(vec![1]), cols: Some(vec![1, 0]), ..r("b", vec![3, 2], vec![1, 2]) });
    add("reshaped", r("x", vec![3, 2], vec![3, 1, 2]));
    add("a_log", Rearranged { cols: Some(vec![1, 0]), values: StoredValues::NegExp, ..r("a", vec![2], vec![2]) });
    add("bad_a", Rearranged { values: StoredValues::NegExp, ..r("p", vec![2], vec![2]) });
    add("wrong_shape", r("x", vec![2, 3], vec![2, 3]));
    let s = GgufSource::new(Arc::new(m), map);
    let get = |n: &str| {
        let t = s.tensor(n).unwrap();
        (t.dtype, t.shape.clone(), t.view().to_f32_vec().unwrap())
    };
    assert_eq!(get("rows"), (DType::F32, vec![2, 2], vec![5., 6., 1., 2.]));
    assert_eq!(get("cols"), (DType::F32, vec![3, 2], vec![2., 1., 4., 3., 6., 5.]));
    assert_eq!(get("both_bf16"), (DType::BF16, vec![1, 2], vec![4., 3.]));
    assert_eq!(s.stored_dtype("both_bf16"), Some(DType::BF16));
    assert_eq!(get("reshaped"), (DType::F32, vec![3, 1, 2], x.to_vec()));
    let (dtype, _, a_log) = get("a_log");
    assert_eq!(dtype, DType::F32);
    assert_eq!(s.stored_dtype("a_log"), Some(DType::F32));
    assert_eq!(a_log.iter().map(|v| -v.exp()).collect::<Vec<_>>(), [-2.0, -0.5]);
    let e = s.tensor("bad_a").err().unwrap().to_string();
    assert!(e.contains("`p`") && e.contains("not negative"), "{e}");
    let e = s.tensor("wrong_shape").err().unwrap().to_string();
    assert!(e.contains("`x`") && e.contains("[3, 2]"), "{e}");
}
