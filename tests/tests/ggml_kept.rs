//! `--cpu-expert-bits auto` on a GGUF of llama.cpp's Q4_K_M expert types keeps the blocks exactly:
//! Q4_K and Q6_K as stored (`krasis_quant::kquant`), Q5_0 and Q8_0 as INT8 g32 of their values,
//! a fused w13 of two different K-quants requantised to INT8 g32. No fixtures needed: a small
//! Mixtral GGUF written here with random blocks, run through the CPU expert backend against the
//! reference experts on the file's exactly dequantised values.

use std::sync::Arc;

use krasis_cpu::pool::{PoolPlan, WorkerPool};
use krasis_model::cpu::experts::{ExpertExecutor, LayerExperts, ReferenceExperts, Routes};
use krasis_model::cpu::quantized::{open_expert_cache, CpuQuantExperts, CPU_GGML_LAYOUT_NAME};
use krasis_model::model::weights::WeightLoader;
use krasis_model::placement::precision::{describe_expert_bits, ggml_kept, ExpertWidthRule, KeptPart};
use krasis_model::source::files::ModelFiles;
use krasis_model::source::gguf::writer::{GgufWriter, MetaValue};
use krasis_model::spec::WeightBits;
use krasis_quant::ggml::GgmlType;
use krasis_quant::kquant::{self, KQuant, KQuantMatrix};
use krasis_tests::rel_l2;

const HIDDEN: usize = 256;
const INTER: usize = 256;
const EXPERTS: usize = 4;

/// A xorshift stream.
fn rng(seed: u64) -> impl FnMut() -> u64 {
    let mut s = seed | 1;
    move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    }
}

/// `n` random blocks of `ty` whose f16 scales are finite and small (2^-11 .. 2^-8), as
/// llama.cpp writes for weights of magnitude ~0.1.
fn blocks(ty: GgmlType, n: usize, seed: u64) -> Vec<u8> {
    let mut next = rng(seed);
    let bb = ty.block_bytes();
    let mut out: Vec<u8> = (0..n * bb).map(|_| next() as u8).collect();
    let scale_at: &[usize] = match ty {
        GgmlType::Q4K => &[0, 2],
        GgmlType::Q6K => &[208],
        _ => &[0],
    };
    for b in out.chunks_exact_mut(bb) {
        for &at in scale_at {
            let v = half::f16::from_f32((1 + next() % 100) as f32 / 100.0 * 2f32.powi(-8 - (next() % 4) as i32));
            b[at..at + 2].copy_from_slice(&v.to_bits().to_le_bytes());
        }
    }
    out
}

fn f32_bytes(v: impl Iterator<Item = f32>) -> Vec<u8> {
    v.flat_map(f32::to_le_bytes).collect()
}

/// A 3-layer Mixtral GGUF (hidden 256, 4 experts of width 256, top-2) whose experts are
/// `[gate, up, down]` of `types[l]` in layer `l`.
fn write_model(path: &std::path::Path, types: &[[GgmlType; 3]]) {
    let mut w = GgufWriter::default();
    w.meta("general.architecture", MetaValue::Str("llama".into()));
    for (k, v) in [
        ("block_count", types.len() as u32),
        ("embedding_length", HIDDEN as u32),
        ("feed_forward_length", INTER as u32),
        ("attention.head_count", 4),
        ("attention.head_count_kv", 2),
        ("expert_count", EXPERTS as u32),
        ("expert_used_count", 2),
        ("context_length", 256),
    ] {
        w.meta(&format!("llama.{k}"), MetaValue::U32(v));
    }
    let vocab = 32u64;
    let mut next = rng(5);
    let mut normal = move |n: usize, amp: f32| f32_bytes((0..n).map(|_| ((next() % 2001) as f32 / 1000.0 - 1.0) * amp));
    let h = HIDDEN as u64;
    w.tensor("token_embd.weight", &[h, vocab], GgmlType::F32, normal(HIDDEN * vocab as usize, 1.0));
    w.tensor("output_norm.weight", &[h], GgmlType::F32, f32_bytes(std::iter::repeat_n(1.0, HIDDEN)));
    for (l, t) in types.iter().enumerate() {
        let p = format!("blk.{l}");
        w.tensor(&format!("{p}.attn_norm.weight"), &[h], GgmlType::F32, f32_bytes(std::iter::repeat_n(1.0, HIDDEN)));
        w.tensor(&format!("{p}.ffn_norm.weight"), &[h], GgmlType::F32, f32_bytes(std::iter::repeat_n(1.0, HIDDEN)));
        for (name, rows) in [("attn_q", h), ("attn_k", h / 2), ("attn_v", h / 2), ("attn_output", h)] {
            w.tensor(&format!("{p}.{name}.weight"), &[h, rows], GgmlType::F32, normal((h * rows) as usize, 0.05));
        }
        w.tensor(
            &format!("{p}.ffn_gate_inp.weight"),
            &[h, EXPERTS as u64],
            GgmlType::F32,
            normal(HIDDEN * EXPERTS, 0.5),
        );
        for (j, part) in ["gate", "up", "down"].iter().enumerate() {
            let n = HIDDEN * INTER * EXPERTS / t[j].block_elems();
            let dims = [h, INTER as u64, EXPERTS as u64];
            w.tensor(&format!("{p}.ffn_{part}_exps.weight"), &dims, t[j], blocks(t[j], n, (10 * l + j) as u64 + 1));
        }
    }
    std::fs::write(path, w.to_bytes()).unwrap();
}

/// The kept cache holds the blocks as stored and runs every layer within f32 and INT8-activation
/// rounding of the reference experts on the exact values; the requantised w13 is the one
/// difference the log names.
#[test]
fn auto_keeps_q4_k_m_expert_blocks_exactly() {
    use GgmlType::{Q4K, Q5_0, Q6K, Q8_0};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    let types = [[Q4K, Q4K, Q6K], [Q5_0, Q5_0, Q4K], [Q4K, Q6K, Q8_0]];
    write_model(&path, &types);
    let files = ModelFiles::open(&path).unwrap_or_else(|e| panic!("{e}"));
    let spec = files.spec().clone();
    let kept = ggml_kept(&spec).expect("Q4_K_M types are kept");
    let parts: Vec<(KeptPart, KeptPart)> = kept.iter().map(|l| (l.w13, l.w2)).collect();
    let (q4, q6) = (KeptPart::KQuant(KQuant::Q4K), KeptPart::KQuant(KQuant::Q6K));
    let exact = KeptPart::Int8G32 { exact: true };
    assert_eq!(parts, vec![(q4, q6), (exact, q4), (KeptPart::Int8G32 { exact: false }, exact)]);
    let words = describe_expert_bits(&spec, WeightBits::Auto);
    assert!(words.contains("GGUF blocks as stored") && words.contains("w13 Q4_K / w2 Q6_K"), "{words}");

    let pool = Arc::new(WorkerPool::new(PoolPlan::simulated(1, 2)).unwrap());
    let (cache, _) = open_expert_cache(&files, ExpertWidthRule::Auto, 128, Some(dir.path()), &pool).unwrap();
    assert!(cache.path().ends_with("experts_cpu_ggml.bin"), "{}", cache.path().display());
    assert_eq!(cache.header().layout, CPU_GGML_LAYOUT_NAME);
    let ex = CpuQuantExperts::new(cache, &spec, pool.clone()).unwrap();
    assert!(ex.ggml_kept() && ex.describe().contains("w13 Q4_K / w2 Q6_K × 1 layer"), "{}", ex.describe());

    // Layer 0's down projections are the file's Q6_K blocks byte for byte.
    let loader = WeightLoader::new(files.weights(), &spec.source_quant);
    let tensors = krasis_model::model::tensors::model_tensors(&spec);
    let (_, l2) = ex.record_layouts(0).unwrap();
    for e in 0..EXPERTS {
        let t = krasis_model::model::tensors::expert_tensors(&spec, 0, e);
        let (ty, stored) = loader.source.ggml_blocks(&t.down.name).unwrap().unwrap();
        assert_eq!(ty, Q6K);
        let want = KQuantMatrix::from_ggml(KQuant::Q6K, stored.as_slice(), HIDDEN, INTER).unwrap();
        assert_eq!(kquant::unpack(ex.cache().w2(0, e), &l2).unwrap(), want, "expert {e}'s down");
    }

    let (t, k) = (5, 2);
    let x: Vec<f32> = (0..t * HIDDEN).map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * 0.5).collect();
    let mut routes = Routes::with_capacity(t, k);
    for tok in 0..t {
        routes.push(&[tok % EXPERTS, (3 * tok + 1) % EXPERTS], &[0.6, 0.4]);
    }
    for (layer, ty) in types.iter().enumerate() {
        let mut got = vec![0f32; t * HIDDEN];
        ex.run(layer, &x, t, &routes, &mut got);
        let krasis_model::model::tensors::FfnTensors::Moe { experts, .. } = &tensors.layers[layer].ffn else {
            panic!("layer {layer} is not a MoE layer")
        };
        let reference = ReferenceExperts::load(&loader, HIDDEN, experts).unwrap();
        let mut want = vec![0f32; t * HIDDEN];
        reference.run(&x, t, &routes, &mut want);
        let err = rel_l2(&got, &want);
        eprintln!("layer {layer} {ty:?}: relative error {err:.3e} against the exact experts");
        // Kept exactly: the activations' INT8 value + residual split alone (measured 5.6e-5 and
        // 4.0e-5). The requantised w13 of layer 2: INT8 g32's rounding of uniform random codes
        // (measured 7.6e-3).
        let bar = if layer == 2 { 2e-2 } else { 1e-4 };
        assert!(err < bar, "layer {layer}: relative error {err:.3e} (bar {bar:e})");
    }
    // Explicit widths still requantise (their own cache).
    let (c8, _) =
        open_expert_cache(&files, ExpertWidthRule::Uniform(krasis_quant::Bits::Int8), 128, Some(dir.path()), &pool)
            .unwrap();
    assert!(c8.path().ends_with("experts_cpu_int8_g128.bin"), "{}", c8.path().display());
}

/// A file of other types (Q4_0 experts) keeps the requantising rule.
#[test]
fn other_types_keep_the_requantising_rule() {
    use GgmlType::{Q4_0, Q8_0};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    write_model(&path, &[[Q4_0, Q4_0, Q8_0]]);
    let files = ModelFiles::open(&path).unwrap_or_else(|e| panic!("{e}"));
    assert!(ggml_kept(files.spec()).is_none());
    assert_eq!(describe_expert_bits(files.spec(), WeightBits::Auto), "w13 int4 / w2 int8 × 1 layer");
    // All Q8_0: the INT8 cache `8` uses too (nothing to keep that INT8 g128 loses much of).
    write_model(&path, &[[Q8_0, Q8_0, Q8_0]]);
    let files = ModelFiles::open(&path).unwrap_or_else(|e| panic!("{e}"));
    assert!(ggml_kept(files.spec()).is_none());
}

/// The hybrid on a GGUF of K-quant experts: the CPU keeps the blocks, and a prompt long enough to
/// stream every expert (300 tokens) streams the GPU expert cache, requantised from the exact
/// values, since the GPU does not run the blocks (the load log says so). Its prefill logits stay
/// within the requantisation's error of the CPU path's on the kept blocks. Skips visibly without
/// a GPU (`KRASIS_REQUIRE_GPU=1` fails instead).
#[test]
fn hybrid_streams_a_gpu_cache_requantised_from_kept_blocks() {
    use krasis_model::cpu::load::EngineOptions;
    use krasis_model::gpu::{GpuModel, GpuOptions};
    if !krasis_tests::gpu_available("ggml_kept hybrid") {
        return;
    }
    use GgmlType::{Q4K, Q6K};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    write_model(&path, &[[Q4K, Q4K, Q6K]; 3]);
    let ids: Vec<u32> = (0..300).map(|i| (i * 7 % 30 + 1) as u32).collect();
    let cpu = krasis_tests::prefill_logits(&path, WeightBits::Auto, WeightBits::Bf16, dir.path(), &ids);
    // The hybrid defaults' streaming width (`placement::device::hybrid_defaults`).
    let gpu = GpuOptions { kv_tokens: Some(512), expert_bits: Some(krasis_quant::Bits::Int4), ..GpuOptions::default() };
    let opts = EngineOptions {
        expert_bits: WeightBits::Auto,
        cache_dir: Some(dir.path().to_path_buf()),
        threads: Some(2),
        ..EngineOptions::default()
    };
    let m = GpuModel::load_hybrid(&path, &gpu, &opts).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let log = m.log.join("\n");
    assert!(log.contains("requantised to int"), "{log}");
    let mut s = m.new_session().unwrap();
    let hybrid = m.forward_logits(&mut s, &ids, true).unwrap();
    // The GPU's experts are INT4 g128 of the exact values: the CPU path at `4` holds the same.
    let int4 = krasis_tests::prefill_logits(&path, WeightBits::Int4, WeightBits::Bf16, dir.path(), &ids);
    let (f, g) = (krasis_tests::fidelity(&hybrid, &int4, 32), krasis_tests::fidelity(&hybrid, &cpu, 32));
    eprintln!(
        "ggml kept, hybrid (300-token prefill, GPU cache requantised): against the CPU path at INT4 g128 of the \
         exact values mean cos {:.6}, min cos {:.6}, top1 {:.2}; against the CPU path on the kept blocks mean cos {:.6}",
        f.mean_cos, f.min_cos, f.top1, g.mean_cos
    );
    assert!(f.mean_cos > 0.99, "mean cos {:.6}", f.mean_cos);
}
