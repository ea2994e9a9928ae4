use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;

use krasis_core::DType;
use memmap2::MmapOptions;
use rand::{Rng, SeedableRng};
use serde_json::Value;

use super::init::{expert_preferences, layer_of, CHUNK_ELEMS};
use super::tokenizer::{tokenizer_json, BASE_VOCAB};
use super::*;
use crate::arch::parse_config;
use crate::cpu::{Logits, Model};
use crate::error::Result;
use crate::model::tensors::{param_counts, TensorSpec};
use crate::source::files::ModelFiles;
use crate::source::{SharedBytes, StoredTensor, WeightSource};
use crate::spec::ModelSpec;

fn tiny_config() -> Value {
    preset_config(Preset::Tiny, None)
}

fn write(config: &Value, out: &Path, seed: u64, skew: f32, limit: u64) -> SynthReport {
    write_model(config, out, seed, skew, false, limit, "test").expect("synth succeeds")
}

fn files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (e.file_name().to_string_lossy().into_owned(), std::fs::read(e.path()).unwrap())
        })
        .collect()
}

fn spec_of(config: &Value) -> ModelSpec {
    parse_config(&config.to_string(), Path::new("config.json")).unwrap()
}

fn last_logits(dir: &Path, tokens: &[u32]) -> Vec<f32> {
    let model = Model::load(dir).unwrap();
    let mut session = model.new_session();
    model.forward(&mut session, tokens, Logits::Last, None).unwrap()
}

#[test]
fn tiny_synth_loads_and_gives_finite_logits() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("tiny");
    let mut opts = SynthOptions::new(Preset::Tiny, &out);
    opts.seed = 7;
    let report = synthesize(&opts).unwrap();
    let spec = spec_of(&tiny_config());
    assert_eq!(report.tensors, expected_tensors(&spec).len());
    assert_eq!(report.shards, 1);
    assert_eq!(report.out, out);
    let on_disk: u64 = files(&out).values().map(|b| b.len() as u64).sum();
    assert_eq!(report.bytes_written, on_disk);

    let model = Model::load(&out).unwrap();
    assert_eq!(model.spec, spec);
    let mut session = model.new_session();
    let prompt: Vec<u32> = (0..24).map(|i| (i * 37 + 5) % 512).collect();
    let logits = model.forward(&mut session, &prompt, Logits::All, None).unwrap();
    assert_eq!(logits.len(), prompt.len() * 512);
    assert!(logits.iter().all(|x| x.is_finite()));
    // Unit-scale weights keep the logits O(1): neither vanishing nor exploding through depth.
    let rms = (logits.iter().map(|x| x * x).sum::<f32>() / logits.len() as f32).sqrt();
    assert!((0.2..20.0).contains(&rms), "logit rms {rms}");
    // Decoding continues from the cache.
    let next = model.forward(&mut session, &[3], Logits::Last, None).unwrap();
    assert!(next.iter().all(|x| x.is_finite()));
    assert_eq!(session.position(), prompt.len() + 1);
    assert!(!out.join("model-00001-of-00001.safetensors.tmp").exists());
}

#[test]
fn same_seed_same_bytes_other_seed_other_weights() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tiny_config();
    let a = tmp.path().join("a");
    let b = tmp.path().join("b");
    let c = tmp.path().join("c");
    write(&cfg, &a, 11, 1.5, SHARD_BYTES);
    // One worker thread instead of all: the bytes do not depend on parallelism.
    let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    pool.install(|| write(&cfg, &b, 11, 1.5, SHARD_BYTES));
    write(&cfg, &c, 12, 1.5, SHARD_BYTES);
    let (fa, fb, fc) = (files(&a), files(&b), files(&c));
    assert_eq!(fa, fb);
    let shard = "model-00001-of-00001.safetensors";
    assert_ne!(fa[shard], fc[shard]);
    assert_eq!(fa["tokenizer.json"], fc["tokenizer.json"]);
    assert_eq!(fa["config.json"], fc["config.json"]);
}

#[test]
fn large_tensors_span_chunks_deterministically() {
    // The embedding of v2-lite spans many chunks; chunk c is the same wherever it is generated.
    let spec = spec_of(&preset_config(Preset::V2Lite, Some(1)));
    let tensors = init::plan_tensors(&spec, expected_tensors(&spec), 3, 0.0);
    let embed = &tensors[0];
    assert!(embed.chunks() > 2);
    let (mut x, mut y, mut z) = (Vec::new(), Vec::new(), Vec::new());
    embed.gen_chunk(3, 1, &mut x);
    embed.gen_chunk(3, 1, &mut y);
    embed.gen_chunk(3, 2, &mut z);
    assert_eq!(x.len(), CHUNK_ELEMS * 2);
    assert_eq!(x, y);
    assert_ne!(x, z);
}

fn bf16_values(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(2).map(|b| f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16)).collect()
}

fn mean_std(v: &[f32]) -> (f64, f64) {
    let n = v.len() as f64;
    let m = v.iter().map(|&x| x as f64).sum::<f64>() / n;
    let var = v.iter().map(|&x| (x as f64 - m).powi(2)).sum::<f64>() / n;
    (m, var.sqrt())
}

#[test]
fn weight_scales_follow_fan_in() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("m");
    write(&tiny_config(), &out, 5, 0.0, SHARD_BYTES);
    let files = ModelFiles::open(&out).unwrap();
    let get = |name: &str| {
        let t = files.weights().tensor(name).unwrap();
        assert_eq!(t.dtype, DType::BF16, "{name}");
        (bf16_values(t.bytes.as_slice()), t.shape.clone())
    };
    for name in [
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.1.self_attn.kv_b_proj.weight",
        "model.layers.2.mlp.experts.3.gate_proj.weight",
        "model.layers.3.mlp.gate.weight",
    ] {
        let (v, shape) = get(name);
        let want = if name.contains("embed") { 1.0 } else { 1.0 / (shape[1] as f64).sqrt() };
        let (m, s) = mean_std(&v);
        assert!((s / want - 1.0).abs() < 0.05, "{name}: std {s}, want {want}");
        assert!(m.abs() < 0.05 * want, "{name}: mean {m}");
        let bound = want * 3f64.sqrt() * 1.01;
        assert!(v.iter().all(|&x| (x as f64).abs() <= bound), "{name}: value beyond the uniform bound");
    }
    for name in ["model.norm.weight", "model.layers.2.input_layernorm.weight"] {
        assert!(get(name).0.iter().all(|&x| x == 1.0), "{name}");
    }
}

/// Checks every `model.safetensors.index.json` promise and returns name → shard.
fn check_index(out: &Path, spec: &ModelSpec) -> BTreeMap<String, String> {
    let index: Value =
        serde_json::from_slice(&std::fs::read(out.join("model.safetensors.index.json")).unwrap()).unwrap();
    let map: BTreeMap<String, String> = index["weight_map"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_string()))
        .collect();
    let expected = expected_tensors(spec);
    let names: BTreeSet<&str> = expected.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(map.keys().map(String::as_str).collect::<BTreeSet<_>>(), names);
    let total: u64 = expected
        .iter()
        .map(|t| t.numel() as u64 * if t.name.ends_with("e_score_correction_bias") { 4 } else { 2 })
        .sum();
    assert_eq!(index["metadata"]["total_size"].as_u64(), Some(total));
    // Each shard holds exactly the tensors the index sends to it, with the inventory's shapes.
    let shards: BTreeSet<&String> = map.values().collect();
    let n = shards.len();
    let shapes: BTreeMap<&str, &TensorSpec> = expected.iter().map(|t| (t.name.as_str(), t)).collect();
    for (k, shard) in shards.iter().enumerate() {
        assert_eq!(**shard, format!("model-{:05}-of-{n:05}.safetensors", k + 1));
        let file = crate::source::SafetensorsFile::open(&out.join(shard)).unwrap();
        let mut held: Vec<&str> = file.names().collect();
        held.sort();
        let mut want: Vec<&str> = map.iter().filter(|(_, s)| s == shard).map(|(n, _)| n.as_str()).collect();
        want.sort();
        assert_eq!(held, want, "{shard}");
        for name in held {
            assert_eq!(file.view(name).unwrap().shape, shapes[name].shape.as_slice(), "{name}");
        }
        // The header is padded to 8 bytes and the data section has no gaps or trailing bytes.
        let bytes = std::fs::read(out.join(shard)).unwrap();
        let hlen = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        assert_eq!(hlen, hlen.next_multiple_of(8));
        let header: Value = serde_json::from_slice(&bytes[8..8 + hlen]).unwrap();
        assert_eq!(header["__metadata__"]["format"], "pt");
        let mut ranges: Vec<(u64, u64)> = header
            .as_object()
            .unwrap()
            .iter()
            .filter(|(k, _)| *k != "__metadata__")
            .map(|(_, v)| (v["data_offsets"][0].as_u64().unwrap(), v["data_offsets"][1].as_u64().unwrap()))
            .collect();
        ranges.sort();
        let mut at = 0;
        for (b, e) in ranges {
            assert_eq!(b, at);
            at = e;
        }
        assert_eq!(at as usize, bytes.len() - 8 - hlen);
    }
    let leftovers: Vec<String> = files(out).into_keys().filter(|n| n.ends_with(".tmp")).collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    map
}

#[test]
fn index_is_consistent() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("m");
    write(&tiny_config(), &out, 1, 0.0, SHARD_BYTES);
    let map = check_index(&out, &spec_of(&tiny_config()));
    assert!(map.values().all(|s| s == "model-00001-of-00001.safetensors"));
    let names: BTreeSet<String> = files(&out).into_keys().collect();
    let want: BTreeSet<String> = [
        "config.json",
        "model-00001-of-00001.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    .into_iter()
    .map(String::from)
    .collect();
    assert_eq!(names, want);
    // config.json is exactly the preset's.
    let cfg: Value = serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg, tiny_config());
}

#[test]
fn small_shard_limit_cuts_at_layer_boundaries() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tiny_config();
    let spec = spec_of(&cfg);
    let one = tmp.path().join("one");
    let many = tmp.path().join("many");
    write(&cfg, &one, 9, 0.0, SHARD_BYTES);
    // 1 byte: every group (embedding, each layer, final norm + lm_head) gets its own shard.
    let report = write(&cfg, &many, 9, 0.0, 1);
    assert_eq!(report.shards, spec.num_layers + 2);
    let map = check_index(&many, &spec);
    let group = |name: &str| layer_of(name).map(|l| l as i64).unwrap_or(if name.contains("embed") { -1 } else { 99 });
    let mut shard_of_group: BTreeMap<i64, &String> = BTreeMap::new();
    for (name, shard) in &map {
        let prev = shard_of_group.insert(group(name), shard);
        assert!(prev.is_none() || prev == Some(shard), "group of {name} split across shards");
    }
    assert_eq!(shard_of_group.values().collect::<BTreeSet<_>>().len(), report.shards);

    // A limit of ~2 layers packs several groups per shard, still at boundaries.
    let mid = tmp.path().join("mid");
    let tensors = init::plan_tensors(&spec, expected_tensors(&spec), 9, 0.0);
    let layer_bytes: u64 = tensors.iter().filter(|t| layer_of(&t.spec.name) == Some(2)).map(|t| t.bytes()).sum();
    let r = write(&cfg, &mid, 9, 0.0, 2 * layer_bytes);
    assert!(r.shards > 1 && r.shards < report.shards, "{} shards", r.shards);
    check_index(&mid, &spec);

    // Same tensors, same bytes, same model, whatever the sharding.
    let (a, b) = (ModelFiles::open(&one).unwrap(), ModelFiles::open(&many).unwrap());
    let (a, b) = (a.weights(), b.weights());
    for t in expected_tensors(&spec) {
        assert_eq!(a.tensor(&t.name).unwrap().bytes.as_slice(), b.tensor(&t.name).unwrap().bytes.as_slice());
    }
    let prompt = [0u32, 17, 99, 300, 511, 2];
    assert_eq!(last_logits(&one, &prompt), last_logits(&many, &prompt));
    assert_eq!(last_logits(&one, &prompt), last_logits(&mid, &prompt));
}

#[test]
fn refuses_non_empty_output_unless_forced() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tiny_config();
    let out = tmp.path().join("m");
    std::fs::create_dir(&out).unwrap();
    // An existing empty directory is fine.
    write(&cfg, &out, 1, 0.0, SHARD_BYTES);
    let err = write_model(&cfg, &out, 2, 0.0, false, SHARD_BYTES, "t").unwrap_err().to_string();
    assert!(err.contains("not empty") && err.contains("(`SynthOptions::force`)"), "{err}");
    let mut opts = SynthOptions::new(Preset::Tiny, &out);
    assert!(synthesize(&opts).unwrap_err().to_string().contains("not empty"));

    // Forced: stale model files go, unrelated files stay, the new model loads.
    std::fs::write(out.join("notes.txt"), "keep me").unwrap();
    std::fs::write(out.join("model-00007-of-00009.safetensors"), "stale").unwrap();
    opts.force = true;
    opts.seed = 2;
    std::fs::create_dir_all(out.join(".krasis_cache")).unwrap();
    std::fs::write(out.join(".krasis_cache/experts_cpu_int4_g128.bin"), "old experts").unwrap();
    let report = synthesize(&opts).unwrap();
    assert_eq!(std::fs::read_to_string(out.join("notes.txt")).unwrap(), "keep me");
    assert!(!out.join("model-00007-of-00009.safetensors").exists());
    // The caches of the model replaced go with it.
    assert!(!out.join(".krasis_cache").exists(), "the old model's caches are cleared");
    assert_eq!(report.caches_removed, vec![out.join(".krasis_cache")]);
    opts.seed = 3;
    assert_eq!(synthesize(&opts).unwrap().caches_removed, Vec::<std::path::PathBuf>::new());
    check_index(&out, &spec_of(&cfg));
    Model::load(&out).unwrap();

    // A file in the way is an error even with force.
    let file = tmp.path().join("file");
    std::fs::write(&file, "x").unwrap();
    let mut opts = SynthOptions::new(Preset::Tiny, &file);
    opts.force = true;
    assert!(synthesize(&opts).unwrap_err().to_string().contains("not a directory"));
    // A bad skew is refused before anything is written.
    let never = tmp.path().join("never");
    assert!(write_model(&cfg, &never, 0, -1.0, false, SHARD_BYTES, "t").is_err());
    assert!(write_model(&cfg, &never, 0, f32::NAN, false, SHARD_BYTES, "t").is_err());
    assert!(!never.exists());
}

#[test]
fn layers_override_trims_and_is_validated() {
    for preset in Preset::ALL {
        let spec = spec_of(&preset_config(preset, Some(2)));
        assert_eq!(spec.num_layers, 2, "{preset}");
        assert_eq!(spec_of(&preset_config(preset, None)).num_layers, preset.num_layers());
        assert_eq!(preset.check_layers(Some(1)).unwrap(), 1);
        assert_eq!(preset.check_layers(None).unwrap(), preset.num_layers());
        let max = preset.num_layers();
        assert_eq!(preset.check_layers(Some(max)).unwrap(), max);
        for bad in [0, max + 1] {
            let err = preset.check_layers(Some(bad)).unwrap_err().to_string();
            assert!(err.contains(preset.name()) && err.contains(&max.to_string()), "{err}");
        }
    }
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("never");
    let mut opts = SynthOptions::new(Preset::V2Lite, &out);
    opts.layers = Some(28);
    assert!(synthesize(&opts).is_err());
    opts.layers = Some(0);
    assert!(synthesize(&opts).is_err());
    assert!(!out.exists());
}

#[test]
fn preset_names_round_trip() {
    for p in Preset::ALL {
        assert_eq!(p.to_string().parse::<Preset>().unwrap(), p);
    }
    assert_eq!("qwen3-30b-a3b".parse::<Preset>().unwrap(), Preset::Qwen3_30bA3b);
    assert_eq!("V2-Lite".parse::<Preset>().unwrap(), Preset::V2Lite);
    let err = "v4".parse::<Preset>().unwrap_err();
    assert!(err.contains("tiny, v2-lite, qwen3-30b-a3b, v3-mini, mixtral-8x7b, glm-4.5-air"), "{err}");
}

#[test]
fn presets_have_the_real_shapes() {
    use crate::spec::{Arch, AttentionSpec, FfnKind, QkNorm, ScoringFunc, TopkMethod};
    // (preset, tensors, total parameters, active parameters) of the published checkpoints.
    let v2 = spec_of(&preset_config(Preset::V2Lite, None));
    assert_eq!(v2.arch, Arch::DeepseekV2);
    assert_eq!((v2.vocab_size, v2.hidden_size, v2.num_layers), (102400, 2048, 27));
    assert_eq!(v2.layers[0], FfnKind::Dense { intermediate_size: 10944 });
    assert_eq!(v2.moe_layers().count(), 26);
    let moe = v2.moe.as_ref().unwrap();
    assert_eq!((moe.n_routed_experts, moe.moe_intermediate_size, moe.shared_intermediate_size), (64, 1408, 2816));
    assert_eq!((moe.routing.top_k, moe.routing.topk, moe.routing.norm_topk_prob), (6, TopkMethod::Greedy, false));
    assert!(matches!(v2.attention, AttentionSpec::Mla { heads: 16, q_lora_rank: None, kv_lora_rank: 512, .. }));
    assert_eq!(expected_tensors(&v2).len(), 1 + 10 + 26 * 203 + 2);
    let c = param_counts(&v2);
    assert!((15.6e9..15.8e9).contains(&(c.total as f64)), "v2-lite total {}", c.total);
    assert!((2.3e9..2.6e9).contains(&(c.active as f64)), "v2-lite active {}", c.active);

    let q = spec_of(&preset_config(Preset::Qwen3_30bA3b, None));
    assert_eq!(q.arch, Arch::Qwen3Moe);
    assert_eq!(q.moe_layers().count(), 48);
    assert!(matches!(
        q.attention,
        AttentionSpec::Gqa { heads: 32, kv_heads: 4, head_dim: 128, qk_norm: QkNorm::PerHead, .. }
    ));
    assert_eq!(expected_tensors(&q).len(), 18867);
    let c = param_counts(&q);
    assert!((30.4e9..30.6e9).contains(&(c.total as f64)), "qwen3 total {}", c.total);
    assert!((3.2e9..3.4e9).contains(&((c.active + 151936 * 2048) as f64)), "qwen3 active {}", c.active);

    let v3 = spec_of(&preset_config(Preset::V3Mini, None));
    assert_eq!(v3.arch, Arch::DeepseekV3);
    let moe = v3.moe.as_ref().unwrap();
    assert_eq!(moe.routing.scoring, ScoringFunc::Sigmoid);
    assert_eq!(moe.routing.topk, TopkMethod::NoauxTc { n_group: 8, topk_group: 4 });
    assert_eq!((moe.routing.top_k, moe.routing.routed_scaling_factor), (6, 2.5));
    assert!(matches!(v3.attention, AttentionSpec::Mla { q_lora_rank: Some(768), kv_lora_rank: 512, .. }));
    // Dense layer 0: 2 norms + 7 attention (q_a, q_a_norm, q_b, kv_a, kv_a_norm, kv_b, o) + 3;
    // MoE layers: 2 + 7 + router + bias + 64·3 + 3 shared.
    assert_eq!(expected_tensors(&v3).len(), 1 + 12 + 7 * 206 + 2);

    let m = spec_of(&preset_config(Preset::Mixtral8x7b, None));
    assert_eq!(m.arch, Arch::Mixtral);
    assert_eq!((m.vocab_size, m.hidden_size, m.moe_layers().count()), (32000, 4096, 32));
    assert!(matches!(
        m.attention,
        AttentionSpec::Gqa { heads: 32, kv_heads: 8, head_dim: 128, qk_norm: QkNorm::None, .. }
    ));
    let c = param_counts(&m);
    assert!((46.6e9..46.8e9).contains(&(c.total as f64)), "mixtral total {}", c.total);
    // The published 12.9 B active counts the embedding row lookup's matrix, as qwen3's above.
    assert!((12.8e9..13.0e9).contains(&((c.active + 32000 * 4096) as f64)), "mixtral active {}", c.active);

    let g = spec_of(&preset_config(Preset::Glm45Air, None));
    assert_eq!(g.arch, Arch::Glm4Moe);
    assert_eq!((g.num_layers, g.moe_layers().count(), g.rope.dim), (46, 45, 64));
    let moe = g.moe.as_ref().unwrap();
    assert_eq!((moe.n_routed_experts, moe.moe_intermediate_size, moe.shared_intermediate_size), (128, 1408, 1408));
    assert_eq!(moe.routing.topk, TopkMethod::NoauxTc { n_group: 1, topk_group: 1 });
    let c = param_counts(&g);
    // GLM-4.5-Air: 106 B in total, "12 B" active (published, rounded: 12.8 B counted here,
    // the LM head included; the MTP layer not counted).
    assert!((106.0e9..107.5e9).contains(&(c.total as f64)), "glm-4.5-air total {}", c.total);
    assert!((12.0e9..13.0e9).contains(&(c.active as f64)), "glm-4.5-air active {}", c.active);

    for p in Preset::ALL {
        let spec = spec_of(&preset_config(p, None));
        assert_eq!(spec.bos_token_id, Some(0));
        assert_eq!(spec.eos_token_ids, vec![1]);
        let cfg = preset_config(p, None);
        // A vision-language wrapper (qwen3.6-35b) holds the text model's fields in `text_config`,
        // its dtype as transformers 5 writes it (`dtype`).
        let text = cfg.get("text_config").unwrap_or(&cfg);
        let dtype = text.get("torch_dtype").or_else(|| text.get("dtype"));
        assert_eq!(dtype, Some(&serde_json::json!("bfloat16")), "{p}");
        assert_eq!(text["hidden_act"], "silu", "{p}");
    }
}

/// gpt-oss-120b: the published config's shapes (117 B parameters, 5.1 B active as OpenAI counts
/// them), MXFP4 experts written fused as OpenAI publishes them (blocks, scales and biases per
/// layer), the sliding / full alternation kept by `--layers`; a two-layer cut at reduced width
/// is `config_tests::a_gpt_oss_config_is_written_fused_in_mxfp4_and_generates`: here the
/// one-layer tensors' stored forms are checked.
#[test]
fn the_gpt_oss_120b_preset_has_the_published_shapes() {
    use crate::spec::{Arch, AttentionSpec, ExpertActivation, SourceQuant};
    let g = spec_of(&preset_config(Preset::GptOss120b, None));
    assert_eq!(g.arch, Arch::GptOss);
    assert_eq!((g.vocab_size, g.hidden_size, g.num_layers, g.moe_layers().count()), (201088, 2880, 36, 36));
    assert!(matches!(g.attention, AttentionSpec::Gqa { heads: 64, kv_heads: 8, head_dim: 64, .. }));
    assert_eq!(g.source_quant, SourceQuant::Mxfp4);
    assert!(g.attention_sinks && g.expert_bias);
    assert_eq!(g.expert_activation, ExpertActivation::ClampedSwiglu { alpha: 1.702, limit: 7.0 });
    assert_eq!((g.window(0), g.window(1), g.window(34), g.window(35)), (Some(128), None, Some(128), None));
    let c = param_counts(&g);
    assert!((116.0e9..117.5e9).contains(&(c.total as f64)), "gpt-oss-120b total {}", c.total);
    let t = spec_of(&preset_config(Preset::GptOss120b, Some(3)));
    assert_eq!((t.window(0), t.window(1), t.window(2)), (Some(128), None, Some(128)));
    let cfg = crate::arch::parse_checkpoint_config(
        &preset_config(Preset::GptOss120b, Some(1)).to_string(),
        std::path::Path::new("config.json"),
    )
    .unwrap();
    let stored = super::layout::stored_tensors(&cfg).unwrap();
    let find = |n: &str| stored.iter().find(|s| s.name == n).unwrap_or_else(|| panic!("{n} not written"));
    let p = "model.layers.0.mlp.experts";
    let (u8_, bf16) = (krasis_core::DType::U8, krasis_core::DType::BF16);
    for (name, shape, dtype) in [
        ("gate_up_proj_blocks", vec![128, 5760, 90, 16], u8_),
        ("gate_up_proj_scales", vec![128, 5760, 90], u8_),
        ("gate_up_proj_bias", vec![128, 5760], bf16),
        ("down_proj_blocks", vec![128, 2880, 90, 16], u8_),
        ("down_proj_scales", vec![128, 2880, 90], u8_),
        ("down_proj_bias", vec![128, 2880], bf16),
    ] {
        let t = find(&format!("{p}.{name}"));
        assert_eq!((&t.shape, t.dtype), (&shape, dtype), "{name}");
    }
    // Nothing per expert: the six fused tensors are the layer's experts.
    assert!(!stored.iter().any(|s| s.name.starts_with(&format!("{p}.5."))));
    assert_eq!(stored.iter().filter(|s| s.name.starts_with(&format!("{p}."))).count(), 6);
    assert_eq!(find("model.layers.0.self_attn.sinks").shape, vec![64]);
    assert_eq!(find("model.layers.0.mlp.router.bias").shape, vec![128]);
    assert_eq!("gpt-oss-120b".parse::<Preset>().unwrap(), Preset::GptOss120b);
}

#[test]
fn the_minimax_m2_preset_has_the_published_shapes() {
    use crate::spec::{Arch, AttentionSpec, FfnKind, QkNorm, ScoringFunc, TopkMethod};
    let m = spec_of(&preset_config(Preset::MiniMaxM2, None));
    assert_eq!(m.arch, Arch::MiniMaxM2);
    assert_eq!((m.vocab_size, m.hidden_size, m.num_layers, m.rope.dim), (200064, 3072, 62, 64));
    assert!(m.layers.iter().all(|l| *l == FfnKind::Moe));
    assert!(matches!(
        m.attention,
        AttentionSpec::Gqa { heads: 48, kv_heads: 8, head_dim: 128, qk_norm: QkNorm::Whole, .. }
    ));
    let moe = m.moe.as_ref().unwrap();
    assert_eq!((moe.n_routed_experts, moe.moe_intermediate_size, moe.shared_intermediate_size), (256, 1536, 0));
    assert_eq!((moe.routing.scoring, moe.routing.top_k), (ScoringFunc::Sigmoid, 8));
    assert_eq!(moe.routing.topk, TopkMethod::NoauxTc { n_group: 1, topk_group: 1 });
    // 62 × (1 + 256 × 3 + 4 + 2 + 2 + 1) + 3 tensors: embedding, final norm, LM head.
    assert_eq!(expected_tensors(&m).len(), 62 * 778 + 3);
    let c = param_counts(&m);
    // MiniMax-M2: "230 B total, 10 B active" (published, rounded; the LM head counted here).
    assert!((228.0e9..230.0e9).contains(&(c.total as f64)), "minimax-m2 total {}", c.total);
    assert!((10.0e9..11.0e9).contains(&(c.active as f64)), "minimax-m2 active {}", c.active);
    // Trimmed, the attention-type list follows the depth.
    let cfg = preset_config(Preset::MiniMaxM2, Some(3));
    assert_eq!(cfg["attn_type_list"], serde_json::json!([1, 1, 1]));
    assert_eq!(spec_of(&cfg).num_layers, 3);
    assert_eq!("minimax-m2".parse::<Preset>().unwrap(), Preset::MiniMaxM2);
}

#[test]
fn tokenizer_covers_the_vocabulary() {
    let tmp = tempfile::tempdir().unwrap();
    for vocab in [512usize, 32000, 102400, 151936] {
        let text = tokenizer_json(vocab).unwrap();
        assert!(text.len() < 6 << 20, "{vocab}: {} bytes", text.len());
        let tok: tokenizers::Tokenizer = text.parse().unwrap();
        assert_eq!(tok.get_vocab_size(true), vocab);
        assert_eq!(tok.token_to_id("<|bos|>"), Some(0));
        assert_eq!(tok.token_to_id("<|eos|>"), Some(1));
        for id in 0..vocab as u32 {
            let s = tok.decode(&[id], false).unwrap_or_else(|e| panic!("{vocab}: id {id}: {e}"));
            assert!(!s.is_empty(), "{vocab}: id {id} decodes to nothing");
            if id as usize >= BASE_VOCAB {
                assert!(
                    s.chars().all(|c| !c.is_control() && c != char::REPLACEMENT_CHARACTER),
                    "{vocab}: id {id} decodes to {s:?}"
                );
            }
        }
        for text in ["Hello, world!", "The experts live in the system memory.\nx = [1, 2]; é€ 🦀 \t end"] {
            let enc = tok.encode(text, false).unwrap();
            assert_eq!(tok.decode(enc.get_ids(), false).unwrap(), text, "{vocab}");
            assert!(enc.get_ids().iter().all(|&i| (i as usize) < vocab));
        }
        // The merges are real: English takes far fewer tokens than bytes.
        let sentence = "The model is running on the system and the experts are in memory.";
        let n = tok.encode(sentence, false).unwrap().get_ids().len();
        assert!(n * 2 < sentence.len(), "{vocab}: {n} tokens");
        if vocab == 512 {
            // Written through synth it loads like the fixtures' tokenizers.
            let out = tmp.path().join("t");
            write(&tiny_config(), &out, 0, 0.0, SHARD_BYTES);
            let from_file = tokenizers::Tokenizer::from_file(out.join("tokenizer.json")).unwrap();
            assert_eq!(from_file.get_vocab_size(true), 512);
            let cfg: Value =
                serde_json::from_slice(&std::fs::read(out.join("tokenizer_config.json")).unwrap()).unwrap();
            assert_eq!(cfg["add_bos_token"], false);
            assert_eq!(cfg["bos_token"], "<|bos|>");
            assert_eq!(cfg["eos_token"], "<|eos|>");
            assert!(cfg["chat_template"].as_str().unwrap().contains("add_generation_prompt"));
        }
    }
    assert!(tokenizer_json(100).is_err());
    assert_eq!(tokenizer_json(2048).unwrap(), tokenizer_json(2048).unwrap());
}

/// A weight source that serves zeros for the routed and shared experts of one layer, so that the
/// hidden state after that layer is exactly the MoE block's input residual (x + attention).
struct ZeroExperts {
    inner: Arc<dyn WeightSource>,
    prefix: String,
    zeros: Arc<memmap2::Mmap>,
}

impl WeightSource for ZeroExperts {
    fn location(&self) -> &Path {
        self.inner.location()
    }

    fn contains(&self, name: &str) -> bool {
        self.inner.contains(name)
    }

    fn tensor(&self, name: &str) -> Result<StoredTensor> {
        let mut t = self.inner.tensor(name)?;
        let experts = format!("{}.mlp.experts.", self.prefix);
        let shared = format!("{}.mlp.shared_experts.", self.prefix);
        if name.starts_with(&experts) || name.starts_with(&shared) {
            let len = t.bytes.as_slice().len();
            t.bytes = SharedBytes::new(Arc::clone(&self.zeros), 0..len);
        }
        Ok(t)
    }

    fn describe(&self) -> String {
        format!("{} with zeroed experts", self.inner.describe())
    }
}

/// How often each expert of the first MoE layer is chosen over `t` random tokens, computed with
/// the engine's own attention and router on the synthesised weights.
fn first_moe_layer_choices(dir: &Path, t: usize) -> Vec<usize> {
    let files = ModelFiles::open(dir).unwrap();
    let spec = files.spec().clone();
    let layer = spec.moe_layers().next().unwrap();
    let zeros = MmapOptions::new().len(64 << 20).map_anon().unwrap().make_read_only().unwrap();
    let source = ZeroExperts {
        inner: Arc::clone(files.source()),
        prefix: crate::model::tensors::layer_prefix(layer),
        zeros: Arc::new(zeros),
    };
    let model = Model::from_source(spec.clone(), &source, &crate::cpu::reference_dense, None).unwrap();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(42);
    let tokens: Vec<u32> = (0..t).map(|_| rng.random_range(2..spec.vocab_size as u32)).collect();
    let mut after: Vec<f32> = Vec::new();
    let mut observe = |i: usize, h: &[f32]| {
        if i == layer + 1 {
            after = h.to_vec();
        }
    };
    let mut session = model.new_session();
    model.forward(&mut session, &tokens, Logits::Last, Some(&mut observe)).unwrap();

    let p = crate::model::tensors::layer_prefix(layer);
    let tensor = |name: String| source.inner.tensor(&name).unwrap().view().to_f32_vec().unwrap();
    let norm = tensor(format!("{p}.post_attention_layernorm.weight"));
    let router = tensor(format!("{p}.mlp.gate.weight"));
    let moe = spec.moe.as_ref().unwrap();
    let bias = source
        .inner
        .contains(&format!("{p}.mlp.gate.e_score_correction_bias"))
        .then(|| tensor(format!("{p}.mlp.gate.e_score_correction_bias")));
    let (h, e) = (spec.hidden_size, moe.n_routed_experts);
    let mut counts = vec![0usize; e];
    for row in after.chunks_exact(h) {
        let rms = (row.iter().map(|x| x * x).sum::<f32>() / h as f32 + spec.rms_norm_eps).sqrt();
        let xn: Vec<f32> = row.iter().zip(&norm).map(|(x, w)| x / rms * w).collect();
        let logits: Vec<f32> = router.chunks_exact(h).map(|w| w.iter().zip(&xn).map(|(a, b)| a * b).sum()).collect();
        let (ids, _) = crate::model::router::route(&moe.routing, &logits, bias.as_deref());
        for id in ids {
            counts[id] += 1;
        }
    }
    counts
}

/// Most-chosen expert's count over the uniform expectation.
fn hottest_ratio(counts: &[usize], top_k: usize, t: usize) -> f64 {
    let uniform = (t * top_k) as f64 / counts.len() as f64;
    *counts.iter().max().unwrap() as f64 / uniform
}

#[test]
fn router_skew_makes_hot_experts_softmax() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tiny_config();
    let t = 384;
    let mut ratios = Vec::new();
    for skew in [0.0f32, 3.0] {
        let out = tmp.path().join(format!("s{skew}"));
        write(&cfg, &out, 21, skew, SHARD_BYTES);
        let counts = first_moe_layer_choices(&out, t);
        let r = hottest_ratio(&counts, 2, t);
        eprintln!("softmax skew {skew}: counts {counts:?}, hottest/uniform {r:.2}");
        if skew > 0.0 {
            // The hottest expert is the one ranked first by the skew.
            let p = expert_preferences(21, 1, 8, skew);
            let hottest = (0..8).max_by_key(|&e| counts[e]).unwrap();
            assert_eq!(p[hottest], skew, "{counts:?} vs {p:?}");
        }
        ratios.push(r);
    }
    assert!(ratios[0] < 1.75, "skew 0 is already skewed: {ratios:?}");
    assert!(ratios[1] > 2.2, "skew 3 is not concentrated: {ratios:?}");
}

#[test]
fn router_skew_makes_hot_experts_noaux_tc() {
    // A tiny DeepSeek-V3: sigmoid scores, groups, e_score_correction_bias.
    let mut cfg = preset_config(Preset::V3Mini, Some(2));
    for (k, v) in [
        ("vocab_size", 512),
        ("hidden_size", 256),
        ("intermediate_size", 512),
        ("moe_intermediate_size", 64),
        ("num_attention_heads", 4),
        ("num_key_value_heads", 4),
        ("q_lora_rank", 96),
        ("kv_lora_rank", 64),
        ("qk_nope_head_dim", 32),
        ("qk_rope_head_dim", 16),
        ("v_head_dim", 32),
        ("n_routed_experts", 16),
        ("num_experts_per_tok", 4),
        ("n_group", 4),
        ("topk_group", 2),
    ] {
        cfg[k] = v.into();
    }
    let tmp = tempfile::tempdir().unwrap();
    let t = 512;
    let mut ratios = Vec::new();
    for skew in [0.0f32, 2.0] {
        let out = tmp.path().join(format!("s{skew}"));
        write(&cfg, &out, 4, skew, SHARD_BYTES);
        let files = ModelFiles::open(&out).unwrap();
        let bias = files.weights().tensor("model.layers.1.mlp.gate.e_score_correction_bias").unwrap();
        assert_eq!(bias.dtype, DType::F32);
        let bias = bias.view().to_f32_vec().unwrap();
        let want: Vec<f32> = expert_preferences(4, 1, 16, skew).iter().map(|p| p / 4.0).collect();
        assert_eq!(bias, want);
        if skew == 0.0 {
            assert!(bias.iter().all(|&b| b == 0.0));
        }
        let counts = first_moe_layer_choices(&out, t);
        let r = hottest_ratio(&counts, 4, t);
        eprintln!("noaux_tc skew {skew}: counts {counts:?}, hottest/uniform {r:.2}");
        ratios.push(r);
        Model::load(&out).unwrap();
    }
    assert!(ratios[0] < 1.75, "skew 0 is already skewed: {ratios:?}");
    assert!(ratios[1] > 2.2, "skew 2 is not concentrated: {ratios:?}");
}

#[test]
fn preferences_rank_every_expert_once() {
    let p = expert_preferences(1, 3, 64, 2.0);
    let mut sorted = p.clone();
    sorted.sort_by(|a, b| b.partial_cmp(a).unwrap());
    assert_eq!(sorted[0], 2.0);
    assert_eq!(*sorted.last().unwrap(), 0.0);
    assert!(sorted.windows(2).all(|w| w[0] > w[1]));
    // Different layers have different hot experts.
    let q = expert_preferences(1, 4, 64, 2.0);
    assert_ne!(p, q);
    assert!(expert_preferences(1, 3, 64, 0.0).iter().all(|&x| x == 0.0));
}

#[test]
fn whole_model_vram_estimate_counts_every_weight_and_the_flags() {
    use crate::gpu::{whole_model_vram_bytes, GpuOptions};
    use krasis_gpu::linear::LinearQuant;
    let v2 = spec_of(&preset_config(Preset::V2Lite, None));
    let bf16 = whole_model_vram_bytes(&v2, &GpuOptions::default());
    let weights = 2 * param_counts(&v2).total;
    // Every weight in BF16, plus KV, routers in f32, the absorbed kv_b copy and the reserve.
    assert!(bf16 > weights && bf16 < weights + (4 << 30), "{bf16} vs {weights} bytes of BF16 weights");
    let int8 =
        GpuOptions { attention_quant: LinearQuant::Int8, lm_head_quant: LinearQuant::Int8, ..GpuOptions::default() };
    assert!(whole_model_vram_bytes(&v2, &int8) < bf16, "INT8 linears need less VRAM");
}
