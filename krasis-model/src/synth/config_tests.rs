//! `synthesize` from a `config.json` (`SynthOptions::config`): the publisher's storage format
//! (block FP8 for a Kimi-K2-style config, compressed-tensors INT4 experts under
//! `language_model.` for a Kimi-K2.5-style one, gpt-oss's fused experts in MXFP4 or BF16,
//! ModelOpt NVFP4 experts for a Qwen3-MoE one), and the result loads and generates.

use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use super::*;
use crate::arch::parse_checkpoint_config;
use crate::runtime::{open_engine, DevicePolicy, EngineConfig};
use crate::source::files::ModelFiles;
use crate::source::SafetensorsDir;
use crate::spec::WeightBits;
use crate::text::generate::{generate, GenerateRequest};
use crate::text::sampling::SamplingParams;
use krasis_core::DType;

/// The tiny preset's dimensions with Kimi-K2's structure: `kimi_k2`, one dense layer, sigmoid
/// `noaux_tc` routing in one group, block FP8 128×128; four layers (cut to two by the tests).
fn kimi_k2_like() -> Value {
    let mut c = preset_config(Preset::Tiny, Some(4));
    let o = c.as_object_mut().unwrap();
    for (k, v) in [
        ("model_type", json!("kimi_k2")),
        ("architectures", json!(["DeepseekV3ForCausalLM"])),
        ("topk_method", json!("noaux_tc")),
        ("scoring_func", json!("sigmoid")),
        ("norm_topk_prob", json!(true)),
        ("routed_scaling_factor", json!(2.827)),
        ("q_lora_rank", json!(96)),
        (
            "quantization_config",
            json!({"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}),
        ),
    ] {
        o.insert(k.into(), v);
    }
    c
}

/// Kimi-K2.5's wrapper around the same text model, with its compressed-tensors INT4 experts.
fn kimi_k25_like() -> Value {
    let mut text = kimi_k2_like();
    text["quantization_config"] = json!({
        "config_groups": {"group_0": {"input_activations": null, "output_activations": null, "targets": ["Linear"],
            "weights": {"actorder": null, "block_structure": null, "dynamic": false, "group_size": 32, "num_bits": 4,
                        "observer": "minmax", "observer_kwargs": {}, "strategy": "group", "symmetric": true, "type": "int"}}},
        "format": "pack-quantized",
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
        "kv_cache_scheme": null, "quant_method": "compressed-tensors", "quantization_status": "compressed"
    });
    json!({
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "text_config": text,
        "vision_config": {"vt_hidden_size": 32, "vt_num_hidden_layers": 1, "patch_size": 14},
    })
}

/// gpt-oss-120b's structure at small widths: hidden 128, 8 experts of 64 (top 2) with biases,
/// GQA 4 / 2 heads of 32 with biases and sinks, sliding (8) and full layers alternating, the
/// experts in MXFP4 as published (`quantization_config` `mxfp4`) or, without it, BF16.
fn gpt_oss_like(mxfp4: bool) -> Value {
    let mut c = preset_config(Preset::GptOss120b, Some(4));
    let o = c.as_object_mut().unwrap();
    for (k, v) in [
        ("vocab_size", 512),
        ("hidden_size", 128),
        ("intermediate_size", 64),
        ("num_attention_heads", 4),
        ("num_key_value_heads", 2),
        ("head_dim", 32),
        ("num_local_experts", 8),
        ("num_experts_per_tok", 2),
        ("experts_per_token", 2),
        ("sliding_window", 8),
    ] {
        o.insert(k.into(), json!(v));
    }
    if !mxfp4 {
        o.remove("quantization_config");
    }
    c
}

fn synth_from(dir: &Path, config: &Value, layers: Option<usize>) -> Result<PathBuf> {
    let cfg_path = dir.join("published-config.json");
    std::fs::write(&cfg_path, serde_json::to_string_pretty(config).unwrap()).unwrap();
    let out = dir.join("model");
    let opts = SynthOptions { config: Some(cfg_path), layers, seed: 3, ..SynthOptions::new(Preset::Tiny, &out) };
    synthesize(&opts)?;
    Ok(out)
}

/// Every stored tensor: name, shape and dtype, sorted by name.
fn stored_in(dir: &Path) -> Vec<StoredSpec> {
    let files = SafetensorsDir::open(dir).unwrap();
    let mut out: Vec<StoredSpec> = files
        .files()
        .iter()
        .flat_map(|f| {
            f.names()
                .map(|n| {
                    let v = f.view(n).unwrap();
                    StoredSpec { name: n.to_string(), shape: v.shape.to_vec(), dtype: v.dtype }
                })
                .collect::<Vec<_>>()
        })
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

fn dtype_of(stored: &[StoredSpec], name: &str) -> (DType, Vec<usize>) {
    let t = stored.iter().find(|t| t.name == name).unwrap_or_else(|| panic!("`{name}` is not stored"));
    (t.dtype, t.shape.clone())
}

/// Four greedy tokens through the CPU engine at the given widths; the logits are finite.
fn generates(dir: &Path, bits: WeightBits) -> Vec<u32> {
    generates_logged(dir, bits).0
}

/// [`generates`], with the engine's loading log (which says how the routed experts are held).
fn generates_logged(dir: &Path, bits: WeightBits) -> (Vec<u32>, Vec<String>) {
    let files = ModelFiles::open(dir).unwrap();
    let mut c = EngineConfig { device: DevicePolicy::Cpu, ..EngineConfig::default() };
    (c.cpu.expert_bits, c.cpu.dense_bits) = (bits, WeightBits::Bf16);
    let opened = open_engine(&files, &c).unwrap();
    let req = GenerateRequest {
        prompt_ids: vec![5, 9, 200, 3],
        max_new_tokens: 4,
        sampling: SamplingParams::default(),
        ignore_eos: true,
        record_logits: true,
    };
    let out = generate(opened.engine.as_ref(), &req, |_| Ok(())).unwrap();
    assert!(out.prefill_logits.iter().chain(&out.step_logits).all(|x| x.is_finite()));
    assert_eq!(out.generated.len(), 4);
    (out.generated, opened.log)
}

#[test]
fn a_kimi_k2_config_is_written_in_block_fp8_and_generates() {
    let tmp = tempfile::tempdir().unwrap();
    let out = synth_from(tmp.path(), &kimi_k2_like(), Some(2)).unwrap();
    let text = std::fs::read_to_string(out.join("config.json")).unwrap();
    let cfg = parse_checkpoint_config(&text, &out.join("config.json")).unwrap();
    assert_eq!(cfg.spec.num_layers, 2);
    let mut want = stored_tensors(&cfg).unwrap();
    want.sort_by(|a, b| a.name.cmp(&b.name));
    let stored = stored_in(&out);
    assert_eq!(stored, want, "the files hold exactly the publisher's inventory");
    // As Kimi-K2-Instruct publishes them: FP8 projections with F32 block scales, a BF16 router,
    // LM head, embedding and norms, an F32 router bias.
    let e = "model.layers.1.mlp.experts.7.down_proj";
    assert_eq!(dtype_of(&stored, &format!("{e}.weight")), (DType::F8E4M3, vec![256, 128]));
    assert_eq!(dtype_of(&stored, &format!("{e}.weight_scale_inv")), (DType::F32, vec![2, 1]));
    let q = "model.layers.0.self_attn.q_b_proj";
    assert_eq!(dtype_of(&stored, &format!("{q}.weight")).0, DType::F8E4M3);
    assert_eq!(dtype_of(&stored, &format!("{q}.weight_scale_inv")), (DType::F32, vec![2, 1]));
    assert_eq!(dtype_of(&stored, "model.layers.0.mlp.down_proj.weight_scale_inv").1, vec![2, 4]);
    assert_eq!(dtype_of(&stored, "model.layers.1.mlp.gate.weight").0, DType::BF16);
    assert_eq!(dtype_of(&stored, "model.layers.1.mlp.gate.e_score_correction_bias").0, DType::F32);
    assert_eq!(dtype_of(&stored, "lm_head.weight").0, DType::BF16);
    assert_eq!(dtype_of(&stored, "model.embed_tokens.weight").0, DType::BF16);
    assert_eq!(dtype_of(&stored, "model.layers.0.input_layernorm.weight").0, DType::BF16);
    // The FP8 draw keeps the BF16 draw's scale: std 1/sqrt(in) per projection.
    let files = ModelFiles::open(&out).unwrap();
    let loader = crate::model::weights::WeightLoader::new(files.weights(), &files.spec().source_quant);
    let w = loader.matrix(&format!("{e}.weight"), 256, 128).unwrap();
    let mut row = vec![0f32; 128];
    let mut sum = 0f32;
    for r in 0..256 {
        w.row_into(r, &mut row);
        sum += row.iter().map(|x| x * x).sum::<f32>();
    }
    let std = (sum / (256.0 * 128.0)).sqrt();
    let want_std = 1.0 / 128f32.sqrt();
    assert!((std / want_std - 1.0).abs() < 0.1, "std {std}, want {want_std}");
    assert!(files.weights().contains("model.layers.1.mlp.experts.0.gate_proj.weight"));
    drop(files);
    generates(&out, WeightBits::Bf16);
    generates(&out, WeightBits::Int4);
}

#[test]
fn a_kimi_k25_config_is_written_with_int4_experts_under_language_model_and_generates() {
    let tmp = tempfile::tempdir().unwrap();
    let out = synth_from(tmp.path(), &kimi_k25_like(), Some(2)).unwrap();
    let text = std::fs::read_to_string(out.join("config.json")).unwrap();
    let cfg = parse_checkpoint_config(&text, &out.join("config.json")).unwrap();
    assert_eq!((cfg.spec.num_layers, cfg.tensor_prefix), (2, "language_model."));
    let mut want = stored_tensors(&cfg).unwrap();
    want.sort_by(|a, b| a.name.cmp(&b.name));
    let stored = stored_in(&out);
    assert_eq!(stored, want);
    // As Kimi-K2.5 publishes them: routed experts in compressed-tensors INT4, the rest BF16.
    let e = "language_model.model.layers.1.mlp.experts.3.gate_proj";
    assert_eq!(dtype_of(&stored, &format!("{e}.weight_packed")), (DType::I32, vec![128, 32]));
    assert_eq!(dtype_of(&stored, &format!("{e}.weight_scale")), (DType::BF16, vec![128, 8]));
    assert_eq!(dtype_of(&stored, &format!("{e}.weight_shape")), (DType::I32, vec![2]));
    assert!(!stored.iter().any(|t| t.name == format!("{e}.weight")));
    let shared = "language_model.model.layers.1.mlp.shared_experts.up_proj.weight";
    assert_eq!(dtype_of(&stored, shared), (DType::BF16, vec![128, 256]));
    assert_eq!(dtype_of(&stored, "language_model.model.layers.0.self_attn.o_proj.weight").0, DType::BF16);
    assert_eq!(dtype_of(&stored, "language_model.lm_head.weight").0, DType::BF16);
    assert!(stored.iter().all(|t| t.name.starts_with("language_model.")));
    let files = ModelFiles::open(&out).unwrap();
    assert_eq!(files.notes().len(), 1);
    // The stored shape says what it stands for.
    let shape = files.weights().tensor("model.layers.1.mlp.experts.3.gate_proj.weight_shape").unwrap();
    let ints: Vec<i32> =
        shape.bytes.as_slice().chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().unwrap())).collect();
    assert_eq!(ints, vec![128, 256]);
    drop(files);
    generates(&out, WeightBits::Bf16);
    generates(&out, WeightBits::Auto);
}

/// The standard deviation of the `[rows, cols]` linear `name` as the loader reads it (MXFP4
/// dequantised exactly), against a projection's draw, `1/sqrt(cols)`.
fn std_over_draw(files: &ModelFiles, name: &str, rows: usize, cols: usize) -> f32 {
    let loader = crate::model::weights::WeightLoader::new(files.weights(), &files.spec().source_quant);
    let w = loader.matrix(name, rows, cols).unwrap();
    let mut row = vec![0f32; cols];
    let mut sum = 0f64;
    for r in 0..rows {
        w.row_into(r, &mut row);
        sum += row.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>();
    }
    ((sum / (rows * cols) as f64).sqrt() * (cols as f64).sqrt()) as f32
}

/// gpt-oss in MXFP4 is written as OpenAI publishes it (llama.cpp's converter reads no other
/// form): per layer `mlp.experts.gate_up_proj_blocks` / `_scales` / `_bias` and `down_proj_*`,
/// nothing per expert. Krasis serves each expert's rows of them, the dequantised values keep a
/// projection's scale (within the power of two an E8M0 scale rounds to), and the model
/// generates with the experts kept as stored (`auto`) and at BF16.
#[test]
fn a_gpt_oss_config_is_written_fused_in_mxfp4_and_generates() {
    let tmp = tempfile::tempdir().unwrap();
    let out = synth_from(tmp.path(), &gpt_oss_like(true), Some(2)).unwrap();
    let text = std::fs::read_to_string(out.join("config.json")).unwrap();
    let cfg = parse_checkpoint_config(&text, &out.join("config.json")).unwrap();
    assert_eq!((cfg.spec.num_layers, &cfg.spec.source_quant), (2, &crate::spec::SourceQuant::Mxfp4));
    let mut want = stored_tensors(&cfg).unwrap();
    want.sort_by(|a, b| a.name.cmp(&b.name));
    let stored = stored_in(&out);
    assert_eq!(stored, want, "the files hold exactly the publisher's inventory");
    let p = "model.layers.1.mlp.experts";
    assert_eq!(dtype_of(&stored, &format!("{p}.gate_up_proj_blocks")), (DType::U8, vec![8, 128, 4, 16]));
    assert_eq!(dtype_of(&stored, &format!("{p}.gate_up_proj_scales")), (DType::U8, vec![8, 128, 4]));
    assert_eq!(dtype_of(&stored, &format!("{p}.gate_up_proj_bias")), (DType::BF16, vec![8, 128]));
    assert_eq!(dtype_of(&stored, &format!("{p}.down_proj_blocks")), (DType::U8, vec![8, 128, 2, 16]));
    assert_eq!(dtype_of(&stored, &format!("{p}.down_proj_scales")), (DType::U8, vec![8, 128, 2]));
    assert_eq!(dtype_of(&stored, &format!("{p}.down_proj_bias")), (DType::BF16, vec![8, 128]));
    assert_eq!(stored.iter().filter(|t| t.name.contains(".mlp.experts.")).count(), 2 * 6);
    assert_eq!(dtype_of(&stored, "model.layers.0.self_attn.sinks"), (DType::BF16, vec![4]));
    let files = ModelFiles::open(&out).unwrap();
    assert!(files.weights().contains(&format!("{p}.7.up_proj.weight_blocks")));
    assert!(files.weights().contains(&format!("{p}.7.down_proj.bias")));
    for (proj, rows, cols) in [("gate_proj", 64, 128), ("up_proj", 64, 128), ("down_proj", 128, 64)] {
        let r = std_over_draw(&files, &format!("{p}.3.{proj}.weight"), rows, cols);
        assert!((0.7..1.42).contains(&r), "{proj}: std {r} of the draw's");
    }
    drop(files);
    generates(&out, WeightBits::Auto);
    generates(&out, WeightBits::Bf16);
}

/// Without `quantization_config`, gpt-oss is written as transformers and the BF16 conversions
/// store it: `gate_up_proj` `[E, H, 2I]` and `down_proj` `[E, I, H]` (x · W) with their biases,
/// each projection with its own draw's scale.
#[test]
fn a_bf16_gpt_oss_config_is_written_fused_and_generates() {
    let tmp = tempfile::tempdir().unwrap();
    let out = synth_from(tmp.path(), &gpt_oss_like(false), Some(2)).unwrap();
    let stored = stored_in(&out);
    let p = "model.layers.0.mlp.experts";
    assert_eq!(dtype_of(&stored, &format!("{p}.gate_up_proj")), (DType::BF16, vec![8, 128, 128]));
    assert_eq!(dtype_of(&stored, &format!("{p}.down_proj")), (DType::BF16, vec![8, 64, 128]));
    assert_eq!(dtype_of(&stored, &format!("{p}.gate_up_proj_bias")), (DType::BF16, vec![8, 128]));
    assert_eq!(dtype_of(&stored, &format!("{p}.down_proj_bias")), (DType::BF16, vec![8, 128]));
    assert_eq!(stored.iter().filter(|t| t.name.contains(".mlp.experts.")).count(), 2 * 4);
    let files = ModelFiles::open(&out).unwrap();
    for (proj, rows, cols) in [("gate_proj", 64, 128), ("up_proj", 64, 128), ("down_proj", 128, 64)] {
        let r = std_over_draw(&files, &format!("{p}.5.{proj}.weight"), rows, cols);
        assert!((0.9..1.1).contains(&r), "{proj}: std {r} of the draw's");
    }
    drop(files);
    generates(&out, WeightBits::Bf16);
    generates(&out, WeightBits::Int4);
}

/// `../shared/fixtures-next/qwen3moe-nvfp4-tiny`'s configuration, written out: Qwen3-MoE, hidden
/// 192, three layers (layer 0 dense), 8 experts of `moe_intermediate` (top 3), 8 / 2 heads of
/// 32, with ModelOpt's NVFP4 `quantization_config` (the experts-only recipe's `ignore`).
fn qwen3_moe_nvfp4_like(moe_intermediate: usize) -> Value {
    json!({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": 512, "hidden_size": 192, "intermediate_size": 384,
        "moe_intermediate_size": moe_intermediate, "num_hidden_layers": 3,
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32,
        "num_experts": 8, "num_experts_per_tok": 3, "norm_topk_prob": true,
        "decoder_sparse_step": 1, "mlp_only_layers": [0],
        "rope_theta": 1000000.0, "rope_scaling": null, "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-06, "hidden_act": "silu", "tie_word_embeddings": false,
        "attention_bias": false, "use_sliding_window": false, "sliding_window": null,
        "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16",
        "quantization_config": {
            "config_groups": {"group_0": {
                "input_activations": {"dynamic": false, "num_bits": 4, "type": "float", "group_size": 16},
                "weights": {"dynamic": false, "num_bits": 4, "type": "float", "group_size": 16},
                "targets": ["Linear"]}},
            "ignore": ["lm_head", "model.layers.0*", "model.layers.1.mlp.gate", "model.layers.1.self_attn*",
                       "model.layers.2.mlp.gate", "model.layers.2.self_attn*"],
            "quant_algo": "NVFP4", "producer": {"name": "modelopt", "version": "0.47.0"},
            "quant_method": "modelopt"
        }
    })
}

/// The F32 scalar `name` as stored (shape `[]`).
fn f32_scalar(files: &ModelFiles, name: &str) -> f32 {
    let t = files.weights().tensor(name).unwrap();
    assert_eq!((t.dtype, t.shape.len()), (DType::F32, 0), "{name}");
    f32::from_le_bytes(t.bytes.as_slice()[..4].try_into().unwrap())
}

/// A Qwen3-MoE config with ModelOpt's NVFP4 `quantization_config` is written as NVIDIA's
/// *-NVFP4 checkpoints store it (the layout of `qwen3moe-nvfp4-tiny`): each routed expert's
/// projection `P` as `P.weight` U8 `[out, in/2]`, `P.weight_scale` F8_E4M3 `[out, in/16]`,
/// `P.weight_scale_2` and `P.input_scale` F32 scalars; attention, routers, the dense layer,
/// embeddings and the LM head BF16. The dequantised values keep a projection's scale, the
/// config comes through as given (it alone makes the loader read NVFP4), and the CPU engine
/// at `auto` keeps the experts as stored and generates.
#[test]
fn a_qwen3_moe_config_is_written_with_nvfp4_experts_and_generates() {
    let tmp = tempfile::tempdir().unwrap();
    let out = synth_from(tmp.path(), &qwen3_moe_nvfp4_like(128), Some(2)).unwrap();
    assert!(!out.join("hf_quant_config.json").exists());
    let text = std::fs::read_to_string(out.join("config.json")).unwrap();
    let written: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(written["quantization_config"], qwen3_moe_nvfp4_like(128)["quantization_config"]);
    let cfg = parse_checkpoint_config(&text, &out.join("config.json")).unwrap();
    assert_eq!((cfg.spec.num_layers, &cfg.spec.source_quant), (2, &crate::spec::SourceQuant::ModelOptNvfp4));
    let mut want = stored_tensors(&cfg).unwrap();
    want.sort_by(|a, b| a.name.cmp(&b.name));
    let stored = stored_in(&out);
    assert_eq!(stored, want, "the files hold exactly the publisher's inventory");
    let p = "model.layers.1.mlp.experts.5";
    for (proj, rows, cols) in [("gate_proj", 128, 192), ("up_proj", 128, 192), ("down_proj", 192, 128)] {
        let e = format!("{p}.{proj}");
        assert_eq!(dtype_of(&stored, &format!("{e}.weight")), (DType::U8, vec![rows, cols / 2]));
        assert_eq!(dtype_of(&stored, &format!("{e}.weight_scale")), (DType::F8E4M3, vec![rows, cols / 16]));
        assert_eq!(dtype_of(&stored, &format!("{e}.weight_scale_2")), (DType::F32, vec![]));
        assert_eq!(dtype_of(&stored, &format!("{e}.input_scale")), (DType::F32, vec![]));
    }
    // Four tensors for each of 8 experts × 3 projections, in the one MoE layer.
    assert_eq!(stored.iter().filter(|t| t.name.contains(".mlp.experts.")).count(), 8 * 3 * 4);
    assert_eq!(dtype_of(&stored, "model.layers.1.self_attn.q_proj.weight"), (DType::BF16, vec![256, 192]));
    assert_eq!(dtype_of(&stored, "model.layers.1.mlp.gate.weight"), (DType::BF16, vec![8, 192]));
    assert_eq!(dtype_of(&stored, "model.layers.0.mlp.down_proj.weight"), (DType::BF16, vec![192, 384]));
    assert_eq!(dtype_of(&stored, "lm_head.weight").0, DType::BF16);
    assert_eq!(dtype_of(&stored, "model.embed_tokens.weight").0, DType::BF16);

    let files = ModelFiles::open(&out).unwrap();
    assert_eq!(files.spec().source_quant, crate::spec::SourceQuant::ModelOptNvfp4);
    assert!(crate::model::tensors::missing_tensors(files.spec(), files.weights()).is_empty());
    for (proj, rows, cols) in [("gate_proj", 128, 192), ("down_proj", 192, 128)] {
        let e = format!("{p}.{proj}");
        // weight_scale_2 a power of two, every group scale one (non-NaN) E4M3 code.
        let global = f32_scalar(&files, &format!("{e}.weight_scale_2"));
        assert!(global > 0.0 && global.log2().fract() == 0.0, "{e}: weight_scale_2 {global}");
        assert!(f32_scalar(&files, &format!("{e}.input_scale")) > 0.0);
        let scales = files.weights().tensor(&format!("{e}.weight_scale")).unwrap();
        let first = scales.bytes.as_slice()[0];
        assert!(first & 0x7f != 0x7f && scales.bytes.as_slice().iter().all(|&b| b == first), "{e}");
        // The loader reads them as NVFP4; the values have the draw's scale (E4M3 rounding of
        // the group scale: within 1/16).
        let loader = crate::model::weights::WeightLoader::new(files.weights(), &files.spec().source_quant);
        let m = loader.stored_fp4(&format!("{e}.weight"), rows, cols).unwrap().expect("read as NVFP4");
        assert_eq!(m.kind, krasis_quant::fp4::Fp4Kind::Nvfp4);
        let r = std_over_draw(&files, &format!("{e}.weight"), rows, cols);
        assert!((0.9..1.1).contains(&r), "{proj}: std {r} of the draw's");
    }
    drop(files);
    let (_, log) = generates_logged(&out, WeightBits::Auto);
    assert!(log.iter().any(|l| l.contains("nvfp4 (as stored)")), "{log:?}");
    generates(&out, WeightBits::Int4);
}

/// NVFP4 groups 16 inputs: a routed expert whose input width is not a multiple of 16 (here
/// down_proj's 72) is refused before anything is written, naming the tensor.
#[test]
fn nvfp4_experts_of_a_width_off_the_group_are_refused_naming_the_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let e = synth_from(tmp.path(), &qwen3_moe_nvfp4_like(72), Some(2)).unwrap_err().to_string();
    assert!(
        e.contains("`model.layers.1.mlp.experts.0.down_proj.weight`") && e.contains("72") && e.contains("NVFP4"),
        "{e}"
    );
    assert!(!tmp.path().join("model").exists());
}

#[test]
fn a_layer_count_outside_the_configs_is_refused_naming_the_option() {
    let tmp = tempfile::tempdir().unwrap();
    let e = synth_from(tmp.path(), &kimi_k25_like(), Some(5)).unwrap_err().to_string();
    assert!(e.contains("`SynthOptions::layers`") && e.contains("5") && e.contains("1..=4"), "{e}");
    let e = synth_from(tmp.path(), &kimi_k2_like(), Some(0)).unwrap_err().to_string();
    assert!(e.contains("`SynthOptions::layers`"), "{e}");
}
