//! Issue #38 item 1 and 2 against the published files in `../shared/real-configs` (README
//! there): the Kimi-K2-Instruct and Kimi-K2.5 configurations parse, and the tensors Krasis
//! expects a checkpoint to store (`synth::stored_tensors`: names, shapes, dtypes) are exactly
//! the published tensor inventories (Kimi-K2-Instruct, Kimi-K2.5's text model, DeepSeek-V3),
//! apart from what each test names as left out. GLM-4.5's configuration (the part published
//! here) parses and its inventory is the published one less the MTP layer; so do MiniMax-M2.7's
//! (its inventory exactly the published one). Every supported published configuration
//! (DeepSeek-V3, R1, V2-Lite, Qwen3-30B-A3B, Kimi-K2-Instruct, Kimi-K2.5, GLM-4.5, MiniMax-M2.7,
//! Qwen3-Next-80B-A3B, Qwen3.6-35B-A3B) synthesizes with its widths cut down by the test, two MoE
//! layers deep (the hybrids keeping a DeltaNet and an attention layer), and generates on the CPU.
//!
//! Skips visibly when the folder is absent (CI may not have `../shared`), unless
//! `KRASIS_REQUIRE_REAL_CONFIGS=1`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use krasis_core::DType;
use krasis_model::arch::{load_checkpoint_config, parse_checkpoint_config, CheckpointConfig};
use krasis_model::runtime::{open_engine, DevicePolicy, EngineConfig};
use krasis_model::source::files::ModelFiles;
use krasis_model::spec::{
    Arch, AttentionSpec, AttnBias, FfnKind, QkNorm, RopePairing, RopeScaling, ScoringFunc, SourceQuant, TopkMethod,
    WeightBits,
};
use krasis_model::synth::{stored_tensors, synthesize, Preset, SynthOptions};
use krasis_model::text::generate::{generate, GenerateRequest};
use krasis_model::text::sampling::SamplingParams;
use krasis_tests::{report_skip, workspace_root};
use serde_json::{json, Value};

/// `../shared/real-configs` from the workspace root, or `None` after a visible skip.
fn real_configs() -> Option<PathBuf> {
    let dir = workspace_root().join("../shared/real-configs");
    if dir.join("Kimi-K2-Instruct/config.json").is_file() {
        return Some(dir);
    }
    if std::env::var("KRASIS_REQUIRE_REAL_CONFIGS").as_deref() == Ok("1") {
        panic!("KRASIS_REQUIRE_REAL_CONFIGS=1 but no published configs at {}", dir.display());
    }
    report_skip(&format!("published configs not found at {}", dir.display()));
    None
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The published Kimi-K2.5 configuration as Moonshot names it. The copy in real-configs is a
/// third party's rebrand (level D in the README): `model_type` `kite` for `kimi_k25` (what the
/// inventory file records) and `kite_text` for the text model, which is a Kimi-K2
/// (`DeepseekV3ForCausalLM` with Kimi's `configuration_deepseek`): undone here, nothing else.
fn kimi_k25_config(dir: &Path) -> String {
    let mut v: Value = serde_json::from_str(&read(&dir.join("Kimi-K2.5/config.json-modified-kite"))).unwrap();
    assert_eq!((v["model_type"].as_str(), v["text_config"]["model_type"].as_str()), (Some("kite"), Some("kite_text")));
    v["model_type"] = json!("kimi_k25");
    v["text_config"]["model_type"] = json!("kimi_k2");
    serde_json::to_string_pretty(&v).unwrap()
}

#[test]
fn kimi_k2_instruct_parses_as_deepseek_v3_and_stops_at_generation_configs_eos() {
    let Some(dir) = real_configs() else { return };
    let k2 = dir.join("Kimi-K2-Instruct");
    let cfg = parse_checkpoint_config(&read(&k2.join("config.json")), &k2.join("config.json")).unwrap();
    let s = &cfg.spec;
    assert_eq!(cfg.tensor_prefix, "");
    assert!(cfg.notes.is_empty());
    assert_eq!(s.arch, Arch::DeepseekV3);
    assert_eq!((s.vocab_size, s.hidden_size, s.num_layers), (163840, 7168, 61));
    assert_eq!(s.eos_token_ids, vec![163585], "config.json alone");
    assert_eq!(
        s.attention,
        AttentionSpec::Mla {
            heads: 64,
            q_lora_rank: Some(1536),
            kv_lora_rank: 512,
            qk_nope_head_dim: 128,
            qk_rope_head_dim: 64,
            v_head_dim: 128
        }
    );
    assert!(matches!(s.rope.scaling, RopeScaling::Yarn { factor, .. } if factor == 32.0));
    let moe = s.moe.as_ref().unwrap();
    assert_eq!((moe.n_routed_experts, moe.moe_intermediate_size, moe.shared_intermediate_size), (384, 2048, 2048));
    assert_eq!(moe.routing.top_k, 8);
    assert_eq!(moe.routing.topk, TopkMethod::NoauxTc { n_group: 1, topk_group: 1 });
    assert_eq!(moe.routing.scoring, ScoringFunc::Sigmoid);
    assert!((moe.routing.routed_scaling_factor - 2.827).abs() < 1e-6 && moe.routing.norm_topk_prob);
    assert_eq!(s.source_quant, SourceQuant::Fp8Block { block_rows: 128, block_cols: 128 });
    assert_eq!(s.moe_layers().collect::<Vec<_>>(), (1..61).collect::<Vec<_>>());

    // The directory as published: generation_config.json's end of turn (163586, `<|im_end|>`)
    // is the one generation stops at.
    let tmp = tempfile::tempdir().unwrap();
    for f in ["config.json", "generation_config.json"] {
        std::fs::copy(k2.join(f), tmp.path().join(f)).unwrap();
    }
    assert_eq!(load_checkpoint_config(tmp.path()).unwrap().spec.eos_token_ids, vec![163586]);
}

#[test]
fn kimi_k25_reads_its_text_model_and_leaves_the_vision_tower_out() {
    let Some(dir) = real_configs() else { return };
    let path = dir.join("Kimi-K2.5/config.json");
    let cfg = parse_checkpoint_config(&kimi_k25_config(&dir), &path).unwrap();
    let s = &cfg.spec;
    assert_eq!(cfg.tensor_prefix, "language_model.");
    assert!(cfg.notes.len() == 1 && cfg.notes[0].contains("vision tower"), "{:?}", cfg.notes);
    assert_eq!(s.arch, Arch::DeepseekV3);
    assert_eq!((s.vocab_size, s.hidden_size, s.num_layers, s.max_position_embeddings), (163840, 7168, 61, 262144));
    assert_eq!(s.rms_norm_eps, 1e-5);
    assert!(
        matches!(s.rope.scaling, RopeScaling::Yarn { factor, beta_fast, .. } if factor == 64.0 && beta_fast == 32.0)
    );
    assert_eq!(s.source_quant, SourceQuant::CompressedInt4 { group_size: 32 });
    assert_eq!(s.moe.as_ref().unwrap().n_routed_experts, 384);

    // The rebranded copy as it is: its model_type is named, with what Krasis reads.
    let raw = read(&dir.join("Kimi-K2.5/config.json-modified-kite"));
    let e = parse_checkpoint_config(&raw, &path).unwrap_err().to_string();
    assert!(e.contains("`kite`") && e.contains("kimi_k2") && e.contains("kimi_k25"), "{e}");
    // A field of the nested text model is named with its path.
    let mut v: Value = serde_json::from_str(&kimi_k25_config(&dir)).unwrap();
    v["text_config"]["kv_lora_rank"] = json!("wide");
    let e = parse_checkpoint_config(&v.to_string(), &path).unwrap_err().to_string();
    assert!(e.contains("config.json") && e.contains("`text_config.kv_lora_rank`"), "{e}");
    v["text_config"] = json!(null);
    let e = parse_checkpoint_config(&v.to_string(), &path).unwrap_err().to_string();
    assert!(e.contains("`text_config`") && e.contains("missing"), "{e}");
}

/// One tensor of a published inventory: shape and dtype.
type Inventory = BTreeMap<String, (Vec<usize>, DType)>;

fn dtype_of(s: &str) -> DType {
    match s.trim().trim_matches('*') {
        "bf16" => DType::BF16,
        "f32" | "float32" => DType::F32,
        "int32" => DType::I32,
        s if s.starts_with("fp8") => DType::F8E4M3,
        other => panic!("unknown dtype `{other}` in an inventory"),
    }
}

fn shape_of(s: &str) -> Vec<usize> {
    let s = s.trim().trim_start_matches('[').trim_end_matches(']');
    s.split(',').map(|d| d.trim().parse().unwrap_or_else(|_| panic!("bad shape `{s}`"))).collect()
}

/// Expands `0-60` segments and `{a,b}` groups of a name pattern.
fn expand(pattern: &str) -> Vec<String> {
    if let Some(open) = pattern.find('{') {
        let close = open + pattern[open..].find('}').unwrap();
        return pattern[open + 1..close]
            .split(',')
            .flat_map(|alt| expand(&format!("{}{alt}{}", &pattern[..open], &pattern[close + 1..])))
            .collect();
    }
    let segs: Vec<&str> = pattern.split('.').collect();
    for (i, seg) in segs.iter().enumerate() {
        if let Some((a, b)) = seg.split_once('-') {
            if let (Ok(a), Ok(b)) = (a.parse::<usize>(), b.parse::<usize>()) {
                return (a..=b)
                    .flat_map(|n| {
                        let mut s = segs.clone();
                        let n = n.to_string();
                        s[i] = &n;
                        expand(&s.join("."))
                    })
                    .collect();
            }
        }
    }
    vec![pattern.to_string()]
}

/// `cell` without its parenthesised notes (GLM-4.5's `(+scale [12288,1])`).
fn without_notes(cell: &str) -> String {
    let (mut out, mut depth) = (String::new(), 0usize);
    for ch in cell.chars() {
        match ch {
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            c if depth == 0 => out.push(c),
            _ => {}
        }
    }
    out.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// The rows of a `tensor_inventory_*.md` table whose name starts with one of `prefixes`,
/// expanded. A row `P.a / b` lists `P.a` and `P` with its last segments replaced by `b`, with
/// the shapes and dtypes in the same order (one for all when only one is given); `scale_inv`
/// abbreviates `weight_scale_inv` (DeepSeek-V3's transcription). Parenthesised notes in a name
/// are dropped (GLM-4.5's FP8 weight scales, which are not listed).
fn published(path: &Path, prefixes: &[&str]) -> Inventory {
    let mut out = Inventory::new();
    for line in read(path).lines() {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        if cells.len() < 5 || !prefixes.iter().any(|p| cells[1].starts_with(p)) {
            continue;
        }
        let name = without_notes(cells[1]);
        let alts: Vec<&str> = name.split(" / ").map(str::trim).collect();
        let shapes: Vec<&str> = cells[2].split(" / ").collect();
        let dtypes: Vec<&str> = cells[3].split(" / ").collect();
        let first: Vec<&str> = alts[0].split('.').collect();
        for (k, alt) in alts.iter().enumerate() {
            let pattern = if k == 0 {
                alts[0].to_string()
            } else {
                let alt = match alt.trim_start_matches('.') {
                    "scale_inv" => "weight_scale_inv",
                    a => a,
                };
                let keep = first.len() - alt.split('.').count();
                format!("{}.{alt}", first[..keep].join("."))
            };
            let shape = shape_of(shapes[if shapes.len() == alts.len() { k } else { 0 }]);
            let dtype = dtype_of(dtypes[if dtypes.len() == alts.len() { k } else { 0 }]);
            for name in expand(&pattern) {
                out.insert(name, (shape.clone(), dtype));
            }
        }
    }
    out
}

fn expected(cfg: &CheckpointConfig) -> Inventory {
    stored_tensors(cfg).unwrap().into_iter().map(|t| (t.name, (t.shape, t.dtype))).collect()
}

/// Krasis' inventory is the published one less `left_out` (each must be published); every shape
/// and dtype agrees.
fn compare(krasis: &Inventory, published: &Inventory, left_out: impl Fn(&str) -> bool) -> usize {
    let missing: Vec<&String> = krasis.keys().filter(|n| !published.contains_key(*n)).collect();
    assert!(
        missing.is_empty(),
        "Krasis expects tensors the publisher does not store: {:?}",
        &missing[..missing.len().min(10)]
    );
    let mut disagree = Vec::new();
    for (name, want) in krasis {
        if published[name] != *want {
            disagree.push(format!("{name}: Krasis {want:?}, published {:?}", published[name]));
        }
    }
    assert!(disagree.is_empty(), "{} tensors disagree: {:?}", disagree.len(), &disagree[..disagree.len().min(10)]);
    let extra: Vec<&String> = published.keys().filter(|n| !krasis.contains_key(*n)).collect();
    let unexplained: Vec<&&String> = extra.iter().filter(|n| !left_out(n)).collect();
    assert!(
        unexplained.is_empty(),
        "published tensors Krasis does not expect: {:?}",
        &unexplained[..unexplained.len().min(10)]
    );
    extra.len()
}

#[test]
fn kimi_k2_instruct_inventory_is_the_published_one_less_the_stray_inv_freq() {
    let Some(dir) = real_configs() else { return };
    let k2 = dir.join("Kimi-K2-Instruct");
    let cfg = parse_checkpoint_config(&read(&k2.join("config.json")), &k2.join("config.json")).unwrap();
    let published = published(&k2.join("tensor_inventory_gogongxt.md"), &["model.", "lm_head."]);
    // The inventory file's own count (all 61 shards read): the expansion is complete.
    assert_eq!(published.len(), 139_644);
    let krasis = expected(&cfg);
    let left = compare(&krasis, &published, |n| n.ends_with(".self_attn.rotary_emb.inv_freq"));
    assert_eq!(left, 61, "one stray inv_freq per layer");
}

#[test]
fn kimi_k25_inventory_is_the_published_text_model() {
    let Some(dir) = real_configs() else { return };
    let cfg = parse_checkpoint_config(&kimi_k25_config(&dir), &dir.join("Kimi-K2.5/config.json")).unwrap();
    let published = published(&dir.join("Kimi-K2.5/tensor_inventory_gogongxt.md"), &["language_model."]);
    let krasis = expected(&cfg);
    // Routed experts in compressed-tensors INT4 (three tensors per projection), everything else
    // one BF16/F32 tensor: 61 layers × 9 + 3 dense + 60 × (384 × 9 + 2 + 3) + 3.
    assert_eq!(published.len(), 61 * 9 + 3 + 60 * (384 * 9 + 2 + 3) + 3);
    assert_eq!(compare(&krasis, &published, |_| false), 0);
}

#[test]
fn deepseek_v3_inventory_is_the_published_one_less_the_mtp_layer() {
    let Some(dir) = real_configs() else { return };
    let v3 = dir.join("DeepSeek-V3");
    let cfg = parse_checkpoint_config(&read(&v3.join("config.json")), &v3.join("config.json")).unwrap();
    let published = published(&v3.join("tensor_inventory_gogongxt.md"), &["model.", "lm_head."]);
    assert_eq!(published.len(), 91_991, "the inventory file's own count");
    // The multi-token-prediction block is stored as layer 61 (num_nextn_predict_layers 1);
    // Krasis does not run it.
    let left = compare(&expected(&cfg), &published, |n| n.starts_with("model.layers.61."));
    assert!(left > 0);
}

/// GLM-4.5's configuration from the part published here (`config.json-GLM-4.5-FP8-PARTIAL.txt`,
/// level D: the first 1.6 KB of GLM-4.5-FP8's, up to and into its `quantization_config`): the
/// fields before `quantization_config`, closed. Without that block it is the BF16 GLM-4.5
/// (same architecture fields; the FP8 checkpoint's compressed-tensors `float-quantized` scheme
/// is not one Krasis reads).
fn glm45_config(dir: &Path) -> String {
    let raw = read(&dir.join("GLM-4.5/config.json-GLM-4.5-FP8-PARTIAL.txt"));
    let body: String = raw.lines().filter(|l| !l.starts_with('#')).collect::<Vec<_>>().join("\n");
    let cut = body.find("\"quantization_config\"").expect("the excerpt reaches quantization_config");
    let text = format!("{}\n}}", body[..cut].trim_end().trim_end_matches(','));
    let v: Value = serde_json::from_str(&text).expect("the excerpt's fields before quantization_config are JSON");
    serde_json::to_string_pretty(&v).unwrap()
}

#[test]
fn glm_4_5_parses_and_its_inventory_is_the_published_one_less_the_mtp_layer() {
    let Some(dir) = real_configs() else { return };
    let path = dir.join("GLM-4.5/config.json");
    let s = parse_checkpoint_config(&glm45_config(&dir), &path).unwrap().spec;
    assert_eq!(s.arch, Arch::Glm4Moe);
    assert_eq!((s.vocab_size, s.hidden_size, s.num_layers), (151552, 5120, 92));
    assert_eq!(s.eos_token_ids, vec![151329, 151336]);
    let bias = AttnBias { qkv: true, o: false };
    assert_eq!(
        s.attention,
        AttentionSpec::Gqa {
            heads: 96,
            kv_heads: 8,
            head_dim: 128,
            qk_norm: QkNorm::PerHead,
            bias,
            output_gate: false
        }
    );
    // partial_rotary_factor 0.5: the first 64 of 128 dims, half-split pairs.
    assert_eq!((s.rope.dim, s.rope.pairing, s.rope.theta), (64, RopePairing::Halves, 1e6));
    assert!(s.layers[..3].iter().all(|l| *l == FfnKind::Dense { intermediate_size: 12288 }));
    assert_eq!(s.moe_layers().collect::<Vec<_>>(), (3..92).collect::<Vec<_>>());
    let moe = s.moe.as_ref().unwrap();
    assert_eq!((moe.n_routed_experts, moe.moe_intermediate_size, moe.shared_intermediate_size), (160, 1536, 1536));
    assert_eq!((moe.routing.scoring, moe.routing.top_k), (ScoringFunc::Sigmoid, 8));
    assert_eq!(moe.routing.topk, TopkMethod::NoauxTc { n_group: 1, topk_group: 1 });
    assert!(moe.routing.norm_topk_prob && moe.routing.routed_scaling_factor == 2.5);

    // The published inventory is GLM-4.5-FP8's: 88,543 tensors, 43,852 of them FP8 weight
    // scales (q/k/v/o of 93 layers, 3 dense MLPs, 90 MoE layers of 160 experts plus the shared
    // one, the MTP head), which the table folds into notes. The BF16 GLM-4.5 stores the same
    // names without the scales, its projections in BF16.
    let mut published =
        published(&dir.join("GLM-4.5/tensor_inventory_GLM-4.5-FP8_gogongxt.md"), &["model.", "lm_head."]);
    assert_eq!(published.len(), 88_543 - 43_852, "the inventory's own count less the FP8 scales");
    for (_, dtype) in published.values_mut() {
        if *dtype == DType::F8E4M3 {
            *dtype = DType::BF16;
        }
    }
    // The multi-token-prediction block is stored as layer 92 (num_nextn_predict_layers 1): a
    // whole decoder layer plus eh_proj, enorm/hnorm, shared_head and a copy of the embedding.
    // Krasis does not load it.
    let left = compare(
        &expected(&CheckpointConfig {
            spec: s,
            tensor_prefix: "",
            canonical_prefix: "",
            layout: Default::default(),
            notes: Vec::new(),
        }),
        &published,
        |n| n.starts_with("model.layers.92."),
    );
    assert_eq!(left, 11 + 485 + 6, "layer 92: attention and norms, its MoE block, the MTP parts");
}

/// gpt-oss-120b's published config: GQA 64 / 8 heads of 64 with biases and sinks, sliding (128)
/// and full layers alternating, 128 experts top-4 with biases and the clamped SwiGLU, MXFP4.
#[test]
fn gpt_oss_120b_parses_with_its_options() {
    use krasis_model::spec::ExpertActivation;
    let Some(dir) = real_configs() else { return };
    let path = dir.join("gpt-oss-120b/config.json");
    let cfg = parse_checkpoint_config(&read(&path), &path).unwrap();
    let s = &cfg.spec;
    assert_eq!(s.arch, Arch::GptOss);
    assert_eq!((s.vocab_size, s.hidden_size, s.num_layers), (201088, 2880, 36));
    assert_eq!(
        s.attention,
        AttentionSpec::Gqa {
            heads: 64,
            kv_heads: 8,
            head_dim: 64,
            qk_norm: QkNorm::None,
            bias: AttnBias { qkv: true, o: true },
            output_gate: false
        }
    );
    assert_eq!(s.sliding_windows.len(), 36);
    assert!(s.sliding_windows.iter().enumerate().all(|(l, w)| *w == (l % 2 == 0).then_some(128)));
    assert!(s.attention_sinks && s.expert_bias);
    assert_eq!(s.expert_activation, ExpertActivation::ClampedSwiglu { alpha: 1.702, limit: 7.0 });
    let moe = s.moe.as_ref().unwrap();
    assert_eq!((moe.n_routed_experts, moe.moe_intermediate_size, moe.routing.top_k), (128, 2880, 4));
    assert_eq!(s.source_quant, SourceQuant::Mxfp4);
    assert!(cfg.layout.gpt_oss_experts);
    assert_eq!(s.eos_token_ids, vec![200002]);
}

#[test]
fn minimax_m2_7_parses_and_its_inventory_is_the_published_one() {
    let Some(dir) = real_configs() else { return };
    let path = dir.join("MiniMax-M2.7/config.json");
    let cfg = parse_checkpoint_config(&read(&path), &path).unwrap();
    let s = &cfg.spec;
    assert_eq!(s.arch, Arch::MiniMaxM2);
    assert_eq!((s.vocab_size, s.hidden_size, s.num_layers), (200064, 3072, 62));
    assert_eq!(
        s.attention,
        AttentionSpec::Gqa {
            heads: 48,
            kv_heads: 8,
            head_dim: 128,
            qk_norm: QkNorm::Whole,
            bias: AttnBias::NONE,
            output_gate: false
        }
    );
    // `rotary_dim` 64: the first half of each 128-dim head (half-split pairs).
    assert_eq!((s.rope.dim, s.rope.pairing, s.rope.theta), (64, RopePairing::Halves, 5e6));
    assert_eq!(s.moe_layers().count(), 62);
    let moe = s.moe.as_ref().unwrap();
    assert_eq!((moe.n_routed_experts, moe.moe_intermediate_size, moe.shared_intermediate_size), (256, 1536, 0));
    assert_eq!((moe.routing.scoring, moe.routing.top_k), (ScoringFunc::Sigmoid, 8));
    assert_eq!(moe.routing.topk, TopkMethod::NoauxTc { n_group: 1, topk_group: 1 });
    assert!(moe.routing.norm_topk_prob && moe.routing.routed_scaling_factor == 1.0);
    assert_eq!(s.source_quant, SourceQuant::Fp8Block { block_rows: 128, block_cols: 128 });

    // 96,103 tensors: the FP8 projections with their block scales, the router in float32, which
    // Krasis reads as it reads a BF16 one (its synthesized checkpoints write BF16 routers).
    let mut published = published(&dir.join("MiniMax-M2.7/tensor_inventory_gogongxt.md"), &["model.", "lm_head."]);
    assert_eq!(published.len(), 96_103, "the inventory's own count");
    for (name, (_, dtype)) in published.iter_mut() {
        if name.ends_with("block_sparse_moe.gate.weight") {
            assert_eq!(*dtype, DType::F32, "{name}");
            *dtype = DType::BF16;
        }
    }
    assert_eq!(compare(&expected(&cfg), &published, |_| false), 0);
}

/// The published Kimi-K2-Instruct configuration with its dimensions cut down by this test
/// (the structure, routing, rope and FP8 blocks kept): at full shape even two layers are
/// ~22 GB (the embedding and LM head are 2.3 GB each, one MoE layer of 384 FP8 experts of
/// 3 × 2048 × 7168 is 16.9 GB), too much for CI.
fn reduced_kimi_k2(dir: &Path) -> Value {
    let mut c: Value = serde_json::from_str(&read(&dir.join("Kimi-K2-Instruct/config.json"))).unwrap();
    for (k, v) in [
        ("vocab_size", 4096),
        ("hidden_size", 256),
        ("intermediate_size", 512),
        ("moe_intermediate_size", 128),
        ("n_routed_experts", 16),
        ("num_attention_heads", 4),
        ("num_key_value_heads", 4),
        ("q_lora_rank", 128),
        ("kv_lora_rank", 64),
        ("qk_nope_head_dim", 32),
        ("qk_rope_head_dim", 16),
        ("v_head_dim", 32),
        ("shared_expert_intermediate_size", 128),
        ("linear_num_key_heads", 2),
        ("linear_num_value_heads", 4),
        ("linear_key_head_dim", 32),
        ("linear_value_head_dim", 32),
        ("bos_token_id", 0),
        ("eos_token_id", 1),
    ] {
        c[k] = json!(v);
    }
    c
}

#[test]
fn a_kimi_k2_instruct_config_synthesizes_at_reduced_size_and_generates() {
    let Some(dir) = real_configs() else { return };
    // The full-shape size at two layers, from the inventory Krasis would write.
    let mut full: Value = serde_json::from_str(&read(&dir.join("Kimi-K2-Instruct/config.json"))).unwrap();
    full["num_hidden_layers"] = json!(2);
    let cfg = parse_checkpoint_config(&full.to_string(), Path::new("config.json")).unwrap();
    let bytes: usize =
        stored_tensors(&cfg).unwrap().iter().map(|t| t.shape.iter().product::<usize>() * t.dtype.size_bytes()).sum();
    assert!(bytes > 20_000_000_000, "{bytes} bytes at full shape");

    let tmp = tempfile::tempdir().unwrap();
    let cfg_path = tmp.path().join("kimi-k2-reduced.json");
    std::fs::write(&cfg_path, reduced_kimi_k2(&dir).to_string()).unwrap();
    let out = tmp.path().join("model");
    let opts = SynthOptions { config: Some(cfg_path), layers: Some(2), ..SynthOptions::new(Preset::Tiny, &out) };
    synthesize(&opts).unwrap();
    std::fs::copy(dir.join("Kimi-K2-Instruct/generation_config.json"), out.join("generation_config.json")).unwrap();
    let files = ModelFiles::open(&out).unwrap();
    assert_eq!(files.spec().source_quant, SourceQuant::Fp8Block { block_rows: 128, block_cols: 128 });
    assert_eq!(files.spec().eos_token_ids, vec![163586]);
    for bits in [WeightBits::Bf16, WeightBits::Int4] {
        let mut c = EngineConfig { device: DevicePolicy::Cpu, ..EngineConfig::default() };
        c.cpu.expert_bits = bits;
        let opened = open_engine(&files, &c).unwrap();
        let req = GenerateRequest {
            prompt_ids: vec![5, 9, 200, 3],
            max_new_tokens: 4,
            sampling: SamplingParams::default(),
            ignore_eos: false,
            record_logits: true,
        };
        let o = generate(opened.engine.as_ref(), &req, |_| Ok(())).unwrap();
        assert_eq!(o.generated.len(), 4);
        assert!(o.prefill_logits.iter().chain(&o.step_logits).all(|x| x.is_finite()));
    }
}

/// A published text-model configuration with its widths cut down (every key present set to a
/// small value; structure, routing, rope and quantisation kept), so two MoE layers fit in CI.
fn shrink(text: &mut Value) {
    let mla = text.get("kv_lora_rank").is_some();
    let q_lora = text.get("q_lora_rank").is_some_and(|v| !v.is_null());
    let mut set = |k: &str, v: Value| {
        if text.get(k).is_some() {
            text[k] = v;
        }
    };
    for (k, v) in [
        ("vocab_size", 4096),
        ("hidden_size", 256),
        ("intermediate_size", 512),
        ("moe_intermediate_size", 128),
        ("n_routed_experts", 16),
        ("num_experts", 16),
        ("num_local_experts", 16),
        ("rotary_dim", 32),
        ("num_attention_heads", 4),
        ("num_key_value_heads", if mla { 4 } else { 2 }),
        ("head_dim", 64),
        ("kv_lora_rank", 64),
        ("qk_nope_head_dim", 32),
        ("qk_rope_head_dim", 16),
        ("v_head_dim", 32),
        ("bos_token_id", 0),
        ("eos_token_id", 1),
    ] {
        set(k, json!(v));
    }
    if q_lora {
        set("q_lora_rank", json!(128));
    }
}

#[test]
fn every_supported_published_config_synthesizes_at_reduced_size_and_generates() {
    let Some(dir) = real_configs() else { return };
    let configs: Vec<(&str, Value)> = vec![
        ("DeepSeek-V3", serde_json::from_str(&read(&dir.join("DeepSeek-V3/config.json"))).unwrap()),
        ("DeepSeek-R1", serde_json::from_str(&read(&dir.join("DeepSeek-R1/config.json"))).unwrap()),
        (
            "DeepSeek-V2-Lite",
            serde_json::from_str(&read(&dir.join("DeepSeek-V2-Lite/config.json-reformatted"))).unwrap(),
        ),
        ("Qwen3-30B-A3B", serde_json::from_str(&read(&dir.join("Qwen3-30B-A3B/config.json"))).unwrap()),
        ("Kimi-K2-Instruct", serde_json::from_str(&read(&dir.join("Kimi-K2-Instruct/config.json"))).unwrap()),
        ("Kimi-K2.5", serde_json::from_str(&kimi_k25_config(&dir)).unwrap()),
        ("GLM-4.5", serde_json::from_str(&glm45_config(&dir)).unwrap()),
        ("MiniMax-M2.7", serde_json::from_str(&read(&dir.join("MiniMax-M2.7/config.json"))).unwrap()),
        (
            "Qwen3-Next-80B-A3B",
            serde_json::from_str(&read(&dir.join("Qwen3-Next-80B-A3B-Instruct/config.json"))).unwrap(),
        ),
        ("Qwen3.6-35B-A3B", serde_json::from_str(&read(&dir.join("Qwen3.6-35B-A3B/config.json"))).unwrap()),
        ("gpt-oss-120b", serde_json::from_str(&read(&dir.join("gpt-oss-120b/config.json"))).unwrap()),
    ];
    let tmp = tempfile::tempdir().unwrap();
    for (name, mut config) in configs {
        let nested = config.get("text_config").is_some();
        shrink(if nested { &mut config["text_config"] } else { &mut config });
        let path = tmp.path().join(format!("{name}.json"));
        std::fs::write(&path, config.to_string()).unwrap();
        // Deep enough for two MoE layers after the dense ones (DeepSeek-V3: three dense).
        let spec = parse_checkpoint_config(&config.to_string(), &path).unwrap().spec;
        let first_moe = spec.moe_layers().next().unwrap_or_else(|| panic!("{name}: no MoE layer"));
        let out = tmp.path().join(name);
        let opts =
            SynthOptions { config: Some(path), layers: Some(first_moe + 2), ..SynthOptions::new(Preset::Tiny, &out) };
        synthesize(&opts).unwrap_or_else(|e| panic!("{name}: {e}"));
        let files = ModelFiles::open(&out).unwrap();
        assert_eq!(files.spec().moe_layers().count(), 2, "{name}");
        let c = EngineConfig { device: DevicePolicy::Cpu, ..EngineConfig::default() };
        let opened = open_engine(&files, &c).unwrap_or_else(|e| panic!("{name}: {e}"));
        let req = GenerateRequest {
            prompt_ids: vec![5, 9, 200, 3],
            max_new_tokens: 3,
            sampling: SamplingParams::default(),
            ignore_eos: true,
            record_logits: true,
        };
        let o = generate(opened.engine.as_ref(), &req, |_| Ok(())).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(o.generated.len(), 3, "{name}");
        assert!(o.prefill_logits.iter().chain(&o.step_logits).all(|x| x.is_finite()), "{name}");
    }
}
