//! Kimi-K2 and Kimi-K2.5 checkpoint layouts, on a tiny synthesized DeepSeek-V3 with Kimi's
//! routing (sigmoid scores, `noaux_tc` with one group): the same weights written the way the
//! published checkpoints write them must run exactly like the plain layout.
//!
//! - Kimi-K2: `model_type` `kimi_k2`, shards named without zero padding
//!   (`model-1-of-3.safetensors`), a stray `rotary_emb.inv_freq` per layer, and its end of turn
//!   in `generation_config.json` only.
//! - Kimi-K2.5: `model_type` `kimi_k25` with the text model in `text_config` and a
//!   `vision_config`, text tensors under `language_model.`, vision tensors beside them.

use std::path::{Path, PathBuf};

use serde_json::{json, Map, Value};

use crate::runtime::{open_engine, DevicePolicy, EngineConfig};
use crate::source::files::ModelFiles;
use crate::spec::{Arch, WeightBits};
use crate::synth::{preset_config, write_model, Preset};
use crate::text::generate::{generate, GenerateOutput, GenerateRequest};
use crate::text::sampling::SamplingParams;

/// The tiny preset as a Kimi-style DeepSeek-V3 of two layers (one dense, one MoE).
fn base_config() -> Value {
    let mut c = preset_config(Preset::Tiny, Some(2));
    let o = c.as_object_mut().unwrap();
    o.insert("model_type".into(), json!("deepseek_v3"));
    o.insert("architectures".into(), json!(["DeepseekV3ForCausalLM"]));
    o.insert("topk_method".into(), json!("noaux_tc"));
    o.insert("scoring_func".into(), json!("sigmoid"));
    o.insert("norm_topk_prob".into(), json!(true));
    o.insert("routed_scaling_factor".into(), json!(2.827));
    c
}

/// Writes the base model in several shards (so renaming them means something).
fn write_base(dir: &Path) -> PathBuf {
    let out = dir.join("base");
    let r = write_model(&base_config(), &out, 5, 0.0, false, 200_000, "test").unwrap();
    assert!(r.shards >= 3, "the test needs several shards, got {}", r.shards);
    out
}

fn read_json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn write_json(path: &Path, v: &Value) {
    std::fs::write(path, serde_json::to_string_pretty(v).unwrap()).unwrap();
}

/// A safetensors file's header entries and data section.
fn read_safetensors(path: &Path) -> (Map<String, Value>, Vec<u8>) {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    (header.as_object().unwrap().clone(), bytes[8 + n..].to_vec())
}

fn write_safetensors(path: &Path, header: &Map<String, Value>, data: &[u8]) {
    let mut h = serde_json::to_vec(header).unwrap();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&h);
    out.extend_from_slice(data);
    std::fs::write(path, out).unwrap();
}

/// Appends a BF16 tensor of `shape` (zeros) to a header and data section.
fn push_bf16(header: &mut Map<String, Value>, data: &mut Vec<u8>, name: &str, shape: &[usize]) {
    let len = shape.iter().product::<usize>() * 2;
    let start = data.len();
    data.resize(start + len, 0);
    header.insert(name.into(), json!({"dtype": "BF16", "shape": shape, "data_offsets": [start, start + len]}));
}

/// Copies `base` into `out`, with the tensors renamed by `rename`, extra BF16 tensors added to
/// the first shard, the shards renamed by `shard_name(k, n)` (1-based) and the index rewritten.
fn relayout(
    base: &Path,
    out: &Path,
    rename: impl Fn(&str) -> String,
    extra: &[(String, Vec<usize>)],
    shard_name: impl Fn(usize, usize) -> String,
) {
    std::fs::create_dir_all(out).unwrap();
    let index = read_json(&base.join("model.safetensors.index.json"));
    let mut shards: Vec<String> =
        index["weight_map"].as_object().unwrap().values().map(|v| v.as_str().unwrap().to_string()).collect();
    shards.sort();
    shards.dedup();
    let mut weight_map = Map::new();
    for (k, shard) in shards.iter().enumerate() {
        let (header, mut data) = read_safetensors(&base.join(shard));
        let mut renamed = Map::new();
        for (name, info) in header {
            let name = if name == "__metadata__" { name } else { rename(&name) };
            renamed.insert(name, info);
        }
        if k == 0 {
            for (name, shape) in extra {
                push_bf16(&mut renamed, &mut data, name, shape);
            }
        }
        let new_name = shard_name(k + 1, shards.len());
        for name in renamed.keys().filter(|n| *n != "__metadata__") {
            weight_map.insert(name.clone(), json!(new_name));
        }
        write_safetensors(&out.join(&new_name), &renamed, &data);
    }
    write_json(&out.join("model.safetensors.index.json"), &json!({"metadata": {}, "weight_map": weight_map}));
}

fn cpu_config() -> EngineConfig {
    let mut c = EngineConfig { device: DevicePolicy::Cpu, ..EngineConfig::default() };
    (c.cpu.expert_bits, c.cpu.dense_bits) = (WeightBits::Bf16, WeightBits::Bf16);
    c
}

const PROMPT: [u32; 5] = [5, 9, 200, 3, 77];

fn run(dir: &Path, max_new_tokens: usize, ignore_eos: bool) -> GenerateOutput {
    let files = ModelFiles::open(dir).unwrap();
    let opened = open_engine(&files, &cpu_config()).unwrap();
    let req = GenerateRequest {
        prompt_ids: PROMPT.to_vec(),
        max_new_tokens,
        sampling: SamplingParams::default(),
        ignore_eos,
        record_logits: true,
    };
    generate(opened.engine.as_ref(), &req, |_| Ok(())).unwrap()
}

fn unpadded(k: usize, n: usize) -> String {
    format!("model-{k}-of-{n}.safetensors")
}

#[test]
fn a_kimi_k2_layout_runs_like_the_plain_one_and_stops_at_generation_configs_eos() {
    let tmp = tempfile::tempdir().unwrap();
    let base = write_base(tmp.path());
    let reference = run(&base, 6, true);

    // Kimi-K2's layout: kimi_k2, unpadded shard names, a stray inv_freq per layer, and an
    // end-of-turn id that only generation_config.json names.
    let k2 = tmp.path().join("k2");
    let inv_freq: Vec<(String, Vec<usize>)> =
        (0..2).map(|l| (format!("model.layers.{l}.self_attn.rotary_emb.inv_freq"), vec![8])).collect();
    relayout(&base, &k2, str::to_string, &inv_freq, unpadded);
    let mut config = base_config();
    config["model_type"] = json!("kimi_k2");
    write_json(&k2.join("config.json"), &config);
    let files = ModelFiles::open(&k2).unwrap();
    assert_eq!(files.spec().arch, Arch::DeepseekV3);
    assert_eq!(files.spec().eos_token_ids, vec![1], "config.json's eos while generation_config.json is absent");
    let shards = shard_names(&k2);
    let n = shards.len();
    assert_eq!(shards, (1..=n).map(|k| unpadded(k, n)).collect::<Vec<_>>());
    drop(files);
    let out = run(&k2, 6, true);
    assert_eq!(out.generated, reference.generated);
    assert_eq!(out.prefill_logits, reference.prefill_logits);
    assert_eq!(out.step_logits, reference.step_logits);

    // generation_config.json's eos (the third greedy token here) replaces config.json's for
    // stopping: generation ends there, where the plain layout (eos 1) goes on.
    let eos = reference.generated[2];
    assert!(!reference.generated[..2].contains(&eos) && eos != 1, "pick another position: {:?}", reference.generated);
    write_json(&k2.join("generation_config.json"), &json!({"max_length": 131072, "eos_token_id": eos}));
    assert_eq!(ModelFiles::open(&k2).unwrap().spec().eos_token_ids, vec![eos]);
    let stopped = run(&k2, 6, false);
    assert!(stopped.stopped_at_eos);
    assert_eq!(stopped.generated, reference.generated[..3]);
    assert!(!run(&base, 6, false).stopped_at_eos || reference.generated.contains(&1));
}

/// The shard files a directory holds, in the order Krasis keeps them.
fn shard_names(dir: &Path) -> Vec<String> {
    crate::source::SafetensorsDir::open(dir)
        .unwrap()
        .files()
        .iter()
        .map(|f| f.path().file_name().unwrap().to_string_lossy().into_owned())
        .collect()
}

#[test]
fn a_kimi_k25_layout_runs_its_text_model_like_the_plain_one() {
    let tmp = tempfile::tempdir().unwrap();
    let base = write_base(tmp.path());
    let reference = run(&base, 4, true);

    let k25 = tmp.path().join("k25");
    let vision: Vec<(String, Vec<usize>)> = vec![
        ("vision_tower.patch_embed.proj.weight".into(), vec![16, 3, 14, 14]),
        ("mm_projector.proj.2.weight".into(), vec![256, 64]),
    ];
    relayout(
        &base,
        &k25,
        |n| format!("language_model.{n}"),
        &vision,
        |k, n| format!("model-{k:05}-of-{n:06}.safetensors"),
    );
    let mut text = base_config();
    text["model_type"] = json!("kimi_k2");
    let config = json!({
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "text_config": text,
        "vision_config": {"vt_hidden_size": 16, "vt_num_hidden_layers": 1, "patch_size": 14},
    });
    write_json(&k25.join("config.json"), &config);
    let files = ModelFiles::open(&k25).unwrap();
    assert_eq!(files.spec(), ModelFiles::open(&base).unwrap().spec());
    assert!(files.weights().contains("model.embed_tokens.weight") && files.weights().contains("lm_head.weight"));
    assert!(!files.weights().contains("language_model.lm_head.weight"));
    assert_eq!(files.notes().len(), 1);
    assert!(
        files.notes()[0].contains("vision tower") && files.notes()[0].contains("text_config"),
        "{:?}",
        files.notes()
    );
    drop(files);
    let out = run(&k25, 4, true);
    assert_eq!(out.generated, reference.generated);
    assert_eq!(out.prefill_logits, reference.prefill_logits);
    assert_eq!(out.step_logits, reference.step_logits);
}
