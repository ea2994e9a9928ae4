//! ModelOpt NVFP4 routed experts (NVIDIA's *-FP4 / *-NVFP4 checkpoints) on
//! `../shared/fixtures-next/qwen3moe-nvfp4-tiny` (made by `tools/fixtures/make_native4.py`
//! there: transformers 5.17 in float64 on the exactly dequantised checkpoint, W4A16; README
//! there):
//!
//! - the CPU reference path (every NVFP4 linear dequantised to f32: `E2M1 · weight_scale ·
//!   weight_scale_2`, one f32 rounding) against the oracle at rel ≤ 1e-4, greedy ids identical;
//! - `auto` experts keep the stored NVFP4 in the CPU expert cache exactly (codes, E4M3 scale
//!   bytes and the global scale), checked against the file's bytes read here;
//! - the CPU path with those NVFP4 experts (`auto`, the default; dense weights BF16 as in the
//!   int4ct precedent) against the oracle at the same bar, although its kernels quantise
//!   activations to INT8 per group of 16 (value + residual rows);
//! - an explicit width 4 requantises from the exact values (no stored groups reused);
//! - bad input: a scale tensor whose shape disagrees with the weight, a NaN scale, an unknown
//!   `quant_algo`: errors naming the tensor or field;
//! - ModelOpt's older `hf_quant_config.json` alone is read as `quantization_config`;
//! - MXFP4: `gptoss-mxfp4-tiny`'s experts (OpenAI's layout) convert exactly and run on every
//!   ISA's kernel within f32 rounding of the exact product (the gpt-oss family itself: gptoss_oracle);
//! - GPU (skipped visibly without one): the whole GPU and the hybrid keep the NVFP4 experts as
//!   stored on the GPU too (`family_checks::fp4_native_gpu_and_hybrid`).

use std::path::Path;

use krasis_model::cpu::quantized::{cache_fp4, open_expert_cache, WeightBits};
use krasis_model::cpu::Model;
use krasis_model::placement::precision::{resolve_expert_bits, ExpertWidthRule};
use krasis_model::source::files::ModelFiles;
use krasis_model::source::SafetensorsFile;
use krasis_model::spec::SourceQuant;
use krasis_quant::cpu_layout::{unpack, PackedLayout};
use krasis_quant::fp4::{self, Fp4Kind};
use krasis_quant::group::{group_size_for, quantize};
use krasis_quant::Bits;
use krasis_tests::{
    check_against_reference, copy_fixture_with, fidelity, fixture_next, load_quantized, load_reference,
    long_prefill_within_its_bar, quant_bound,
};

const NAME: &str = "qwen3moe-nvfp4-tiny";

#[test]
fn reference_path_matches_the_oracle() {
    let Some(dir) = fixture_next(NAME) else { return };
    let model = Model::load(&dir).unwrap_or_else(|e| panic!("{NAME}: load failed: {e}"));
    assert_eq!(model.spec.source_quant, SourceQuant::ModelOptNvfp4);
    for line in check_against_reference(NAME, &model, &load_reference(&dir)) {
        eprintln!("{line}");
    }
}

/// The bytes of tensor `name` as stored.
fn bytes(st: &SafetensorsFile, name: &str) -> Vec<u8> {
    st.view(name).unwrap_or_else(|| panic!("{name}: not in the file")).bytes.to_vec()
}

/// `auto` on this checkpoint keeps NVFP4: every expert record of the CPU expert cache holds the
/// file's codes, E4M3 scale bytes and `weight_scale_2` exactly (no requantisation).
#[test]
fn auto_keeps_the_stored_nvfp4_exactly() {
    let Some(dir) = fixture_next(NAME) else { return };
    let files = ModelFiles::open(&dir).unwrap();
    let spec = files.spec().clone();
    assert_eq!(resolve_expert_bits(&spec, WeightBits::Auto), WeightBits::Auto);
    let missing = krasis_model::model::tensors::missing_tensors(&spec, files.weights());
    assert!(missing.is_empty(), "reported missing: {missing:?}");
    let tmp = tempfile::tempdir().unwrap();
    let loaded = load_quantized(&dir, WeightBits::Auto, WeightBits::Bf16, tmp.path());
    let pool = loaded.pool.as_ref().expect("a worker pool for the quantised experts");
    let (cache, _) = open_expert_cache(
        &files,
        ExpertWidthRule::Auto,
        krasis_quant::group::DEFAULT_GROUP_SIZE,
        Some(tmp.path()),
        pool,
    )
    .unwrap();
    let h = cache.header();
    assert_eq!(cache_fp4(h), Some(Fp4Kind::Nvfp4));
    assert_eq!((h.group_size_hidden, h.group_size_intermediate), (16, 16), "cache groups");
    // The RAM estimate at `auto` counts exactly these records.
    let est = krasis_model::cpu::memory::estimate(&spec, WeightBits::Auto).expert_bytes;
    assert_eq!(est, krasis_cache::format::records_bytes(h).unwrap(), "RAM estimate of the NVFP4 records");
    let (hid, inter) = (spec.hidden_size, spec.moe.as_ref().unwrap().moe_intermediate_size);
    let l13 = PackedLayout::new_fp4(2 * inter, hid, Fp4Kind::Nvfp4).unwrap();
    let l2 = PackedLayout::new_fp4(hid, inter, Fp4Kind::Nvfp4).unwrap();
    let st = SafetensorsFile::open(&dir.join("model.safetensors")).unwrap();
    let (mut checked, mut minus_zero) = (0usize, 0usize);
    for (li, layer) in spec.moe_layers().enumerate() {
        for e in 0..spec.routed_experts() {
            let (gate, up) = fp4::unpack_w13(cache.w13(li, e), &l13).unwrap();
            let down = fp4::unpack(cache.w2(li, e), &l2).unwrap();
            for (m, proj) in [(&gate, "gate_proj"), (&up, "up_proj"), (&down, "down_proj")] {
                let p = format!("model.layers.{layer}.mlp.experts.{e}.{proj}");
                let (w, s, g) = (
                    bytes(&st, &format!("{p}.weight")),
                    bytes(&st, &format!("{p}.weight_scale")),
                    bytes(&st, &format!("{p}.weight_scale_2")),
                );
                assert_eq!(w.len(), m.rows * m.k / 2, "{p}: weight bytes");
                // The file's bytes, element by element (low nibble first) and group by group.
                for r in 0..m.rows {
                    for c in 0..m.k {
                        let byte = w[(r * m.k + c) / 2];
                        let code = if c % 2 == 0 { byte & 0xf } else { byte >> 4 };
                        assert_eq!(m.code(r, c), code, "{p}: code [{r}, {c}]");
                        minus_zero += (code == 8) as usize;
                    }
                    for gi in 0..m.k / 16 {
                        assert_eq!(m.scale_byte(r, gi), s[r * m.k / 16 + gi], "{p}: scale [{r}, {gi}]");
                    }
                }
                assert_eq!(m.global.to_le_bytes().to_vec(), g, "{p}: weight_scale_2");
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 48, "quantised linears");
    assert!(minus_zero > 0, "code 8 (-0) occurs in the file and is kept");
    // The README's worked example: layer 1, expert 0, gate_proj, row 0.
    let (gate, _) = fp4::unpack_w13(cache.w13(0, 0), &l13).unwrap();
    let codes: Vec<u8> = (0..8).map(|c| gate.code(0, c)).collect();
    assert_eq!(codes, [1, 2, 14, 12, 2, 12, 1, 11]);
    assert_eq!(gate.scale_byte(0, 0), 0x77);
    assert_eq!(gate.global as f64, 7.99269910203293e-05_f64 as f32 as f64);
    assert!((gate.dequantize_f64()[0] - 0.00959123892).abs() < 1e-11);
}

/// The NVFP4 experts kept as stored, end to end on the CPU, meet the reference path's bar:
/// per-layer hidden states, prefill logits and every greedy step's logits within rel 1e-4 of the
/// oracle, greedy ids identical (W4A8: the kernels quantise activations to INT8 per group of 16,
/// as value + residual rows).
#[test]
fn nvfp4_experts_kept_as_stored_match_the_oracle() {
    let Some(dir) = fixture_next(NAME) else { return };
    let r = load_reference(&dir);
    let tmp = tempfile::tempdir().unwrap();
    let loaded = load_quantized(&dir, WeightBits::Auto, WeightBits::Bf16, tmp.path());
    let described = loaded.model.experts_description();
    eprintln!("{NAME}: experts {described}");
    assert!(described.contains("nvfp4 (as stored)"), "{described}");
    for line in check_against_reference(&format!("{NAME} (nvfp4 experts as stored)"), &loaded.model, &r) {
        eprintln!("{line}");
    }
}

/// A long prefill (128 tokens: about 48 per expert, past the BF16 tiles' threshold) with the
/// NVFP4 experts as stored. On the FP4 integer kernels (a CPU without AMX-BF16, the default here)
/// it gives the reference path's logits within 1e-4. Where the BF16 prefill tiles run (AMX-BF16
/// hardware, or `KRASIS_PREFILL_MATMUL=bf16-emulated` with `KRASIS_BF16_MIN_TOKENS=1`), they
/// dequantise the FP4 codes into their panels (`quant::bf16`) and round weights and activations
/// to BF16: then within the noise of transformers' own BF16 run of this fixture
/// (`quant_bounds.json`'s `bf16.rel`), the bar of a path that reads the weights exactly and
/// computes in BF16. Before the panels read FP4, a guard kept such calls on the integer kernels
/// (without it they gave NaN).
#[test]
fn long_prefill_on_the_fp4_kernels_or_the_bf16_tiles() {
    let Some(dir) = fixture_next(NAME) else { return };
    long_prefill_within_its_bar(&dir, NAME);
}

/// An explicit width 4 requantises every expert from its exact values (INT4 g64 here: the
/// stored groups of 16 are not reused), and the model still runs within the INT4 bound.
#[test]
fn explicit_int4_requantises_from_the_exact_values() {
    let Some(dir) = fixture_next(NAME) else { return };
    let files = ModelFiles::open(&dir).unwrap();
    let spec = files.spec().clone();
    let tmp = tempfile::tempdir().unwrap();
    let loaded = load_quantized(&dir, WeightBits::Int4, WeightBits::Bf16, tmp.path());
    let pool = loaded.pool.as_ref().unwrap();
    let (cache, _) =
        open_expert_cache(&files, ExpertWidthRule::Uniform(Bits::Int4), 128, Some(tmp.path()), pool).unwrap();
    assert_eq!(cache_fp4(cache.header()), None);
    let (hid, inter) = (spec.hidden_size, spec.moe.as_ref().unwrap().moe_intermediate_size);
    let gs = group_size_for(inter, 128).unwrap();
    let l2 = PackedLayout::new(hid, inter, gs, Bits::Int4).unwrap();
    let st = SafetensorsFile::open(&dir.join("model.safetensors")).unwrap();
    let p = "model.layers.2.mlp.experts.3.down_proj";
    let m = fp4::Fp4Matrix::from_modelopt_nvfp4(
        &bytes(&st, &format!("{p}.weight")),
        &bytes(&st, &format!("{p}.weight_scale")),
        f32::from_le_bytes(bytes(&st, &format!("{p}.weight_scale_2"))[..4].try_into().unwrap()),
        hid,
        inter,
    )
    .unwrap();
    let want = quantize(&m.dequantize(), hid, inter, Bits::Int4, gs);
    assert_eq!(unpack(cache.w2(1, 3), &l2).unwrap(), want, "{p}: requantised from the exact values");
    let r = load_reference(&dir);
    let v = r.prefill_logits.len() / r.prompt_ids.len();
    let mut s = loaded.model.new_session();
    let l = loaded.model.forward(&mut s, &r.prompt_ids, krasis_model::cpu::Logits::All, None).unwrap();
    let f = fidelity(&l, &r.prefill_logits, v);
    let b = quant_bound(dir.parent().unwrap(), NAME, "int4");
    eprintln!(
        "{NAME} int4 requantised: 1-cos {:.3e} (ideal {:.3e}), top1 {:.2}",
        1.0 - f.mean_cos,
        1.0 - b.mean_cos,
        f.top1
    );
    assert!(1.0 - f.mean_cos <= 3.0 * (1.0 - b.mean_cos) + 1e-4, "1 - mean cos {:.3e}", 1.0 - f.mean_cos);
}

/// Opens and loads `dir` with `auto` experts (the FP4 expert cache) and BF16 dense weights,
/// expecting an error (a layout error comes when the files open).
fn auto_load_error(dir: &std::path::Path, cache: &std::path::Path) -> String {
    krasis_tests::load_error(dir, WeightBits::Auto, WeightBits::Bf16, cache)
}

/// A `weight_scale` whose shape disagrees with its weight (same bytes, [64, 24] for [128, 12]),
/// and a NaN scale byte (0x7f): errors naming the tensor, on the expert cache and on the
/// reference path alike.
#[test]
fn bad_scales_are_errors_naming_the_tensor() {
    let Some(dir) = fixture_next(NAME) else { return };
    let tensor = "model.layers.2.mlp.experts.5.gate_proj.weight_scale";
    let tmp = tempfile::tempdir().unwrap();
    let shaped = tmp.path().join("shape");
    std::fs::create_dir(&shaped).unwrap();
    copy_fixture_with(&dir, &shaped, |h, _| h[tensor]["shape"] = serde_json::json!([64, 24]));
    let err = auto_load_error(&shaped, &tmp.path().join("c1"));
    assert!(err.contains(tensor), "{err}");
    let err = match Model::load(&shaped) {
        Ok(_) => panic!("the reference path accepted a scale of the wrong shape"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains(tensor), "{err}");

    let nan = tmp.path().join("nan");
    std::fs::create_dir(&nan).unwrap();
    copy_fixture_with(&dir, &nan, |h, data| {
        let at = h[tensor]["data_offsets"][0].as_u64().unwrap() as usize;
        data[at + 5] = 0x7f;
    });
    let err = auto_load_error(&nan, &tmp.path().join("c2"));
    assert!(err.contains("model.layers.2.mlp.experts.5.gate_proj") && err.contains("NaN"), "{err}");
}

/// An edit of a config's JSON.
type Edit = fn(&mut serde_json::Value);

/// An unknown ModelOpt algorithm and a group size other than 16 are refused naming the field.
#[test]
fn unknown_quant_algo_is_refused_naming_the_field() {
    let Some(dir) = fixture_next(NAME) else { return };
    let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
    let path = Path::new("/x/config.json");
    let edits: [(&str, Edit); 3] = [
        ("quantization_config.quant_algo", |v| v["quantization_config"]["quant_algo"] = "W4A8_AWQ".into()),
        ("quantization_config.quant_method", |v| v["quantization_config"]["quant_method"] = "nvfp4-custom".into()),
        ("config_groups.group_0.weights.group_size", |v| {
            v["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 32.into()
        }),
    ];
    for (field, edit) in edits {
        let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
        edit(&mut v);
        let err = krasis_model::arch::parse_config(&v.to_string(), path).unwrap_err().to_string();
        assert!(err.contains(field), "{field}: {err}");
    }
    assert_eq!(krasis_model::arch::parse_config(&text, path).unwrap().source_quant, SourceQuant::ModelOptNvfp4);
}

/// The fixture with its `quantization_config` only in `hf_quant_config.json` (ModelOpt's older
/// form, all that early NVIDIA FP4 checkpoints carry) opens as NVFP4 and runs its experts as
/// stored within the oracle's bar; an `FP8` there is refused naming the file and the field.
#[test]
fn hf_quant_config_alone_is_read() {
    let Some(dir) = fixture_next(NAME) else { return };
    let tmp = tempfile::tempdir().unwrap();
    let m = tmp.path().join("m");
    std::fs::create_dir(&m).unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json", "model.safetensors", "hf_quant_config.json"] {
        std::fs::copy(dir.join(f), m.join(f)).unwrap();
    }
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    cfg.as_object_mut().unwrap().remove("quantization_config");
    std::fs::write(m.join("config.json"), cfg.to_string()).unwrap();
    assert_eq!(ModelFiles::open(&m).unwrap().spec().source_quant, SourceQuant::ModelOptNvfp4);
    let loaded = load_quantized(&m, WeightBits::Auto, WeightBits::Bf16, &tmp.path().join("cache"));
    assert!(loaded.model.experts_description().contains("nvfp4 (as stored)"));
    check_against_reference(&format!("{NAME} (hf_quant_config.json)"), &loaded.model, &load_reference(&dir));

    let mut hq: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("hf_quant_config.json")).unwrap()).unwrap();
    hq["quantization"]["quant_algo"] = "FP8".into();
    std::fs::write(m.join("hf_quant_config.json"), hq.to_string()).unwrap();
    let err = match ModelFiles::open(&m) {
        Ok(_) => panic!("an FP8 hf_quant_config.json was accepted"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("hf_quant_config.json") && err.contains("quantization.quant_algo"), "{err}");
}

/// The whole GPU and the hybrid on this checkpoint as a first start runs them (device only): the
/// NVFP4 experts kept as stored on the GPU (its FP4 tile layout, from the GPU expert cache: the
/// CPU cache's NVFP4 records do not stream) and on the CPU; greedy ids exact, the GPU's BF16 bar,
/// and no further from the oracle than the GPU with BF16 experts (`family_checks`).
#[test]
fn gpu_and_hybrid_keep_nvfp4() {
    krasis_tests::family_checks::fp4_native_gpu_and_hybrid(NAME, Fp4Kind::Nvfp4);
}

/// `gptoss-mxfp4-tiny`'s experts in OpenAI's published MXFP4 layout (the gpt-oss family itself
/// runs in gptoss_oracle): every expert of every layer converts (bytes kept; gate and up split from
/// the interleaved `gate_up_proj`), its values are the README's formula read independently here,
/// and every ISA's kernel on the packed CPU layout gives the exact product within f32 rounding.
#[test]
fn mxfp4_fixture_experts_convert_and_run_on_the_kernels() {
    let Some(dir) = fixture_next("gptoss-mxfp4-tiny") else { return };
    use krasis_cpu::isa::Isa;
    use krasis_cpu::quant::{matmul_packed, quantize_acts, QuantizedActs};
    let st = SafetensorsFile::open(&dir.join("model.safetensors")).unwrap();
    let (n_exp, h, i) = (8usize, 160usize, 64usize);
    let mut matrices = 0;
    for layer in 0..3 {
        let p = format!("model.layers.{layer}.mlp.experts");
        for (proj, rows, k) in [("gate_up_proj", 2 * i, h), ("down_proj", h, i)] {
            let blocks = bytes(&st, &format!("{p}.{proj}_blocks"));
            let scales = bytes(&st, &format!("{p}.{proj}_scales"));
            let ms = fp4::openai_mxfp4_experts(&blocks, &scales, n_exp, rows, k).unwrap();
            for (e, m) in ms.iter().enumerate() {
                // w[r, 32g + i] = E2M1(code) · 2^(scales[r, g] − 127), low nibble = even input.
                let v = m.dequantize_f64();
                for r in 0..rows {
                    for c in 0..k {
                        let byte = blocks[((e * rows + r) * (k / 32) + c / 32) * 16 + (c % 32) / 2];
                        let code = if c % 2 == 0 { byte & 0xf } else { byte >> 4 };
                        let s = scales[(e * rows + r) * (k / 32) + c / 32] as i32;
                        let want = fp4::e2m1(code) as f64 * 2f64.powi(s - 127);
                        assert_eq!(v[r * k + c], want, "{p}.{proj} expert {e} [{r}, {c}]");
                    }
                }
                let (w, l) = if proj == "gate_up_proj" {
                    let (gate, up) = fp4::split_interleaved_rows(m);
                    assert_eq!(gate.code(1, 3), m.code(2, 3));
                    assert_eq!(up.code(1, 3), m.code(3, 3));
                    let l = fp4::w13_layout(&gate, &up).unwrap();
                    let mut w = vec![0u8; l.bytes()];
                    fp4::pack_w13_into(&gate, &up, &mut w).unwrap();
                    (w, l)
                } else {
                    (fp4::pack(m), fp4::layout_of(m))
                };
                let x: Vec<f32> = (0..3 * k).map(|j| ((j * 7919 + e * 31) % 201) as f32 / 50.0 - 2.0).collect();
                let mut a = QuantizedActs::new();
                quantize_acts(&x, 3, k, 32, &mut a);
                let xd = a.dequantize();
                // The exact product in the CPU layout's row order (w13: gate rows then up rows
                // per block pair).
                let ordered: Vec<f64> = if proj == "gate_up_proj" {
                    let (gate, up) = fp4::split_interleaved_rows(m);
                    let (g, u) = (gate.dequantize_f64(), up.dequantize_f64());
                    (0..rows / 32)
                        .flat_map(|b| [&g[b * 16 * k..(b + 1) * 16 * k], &u[b * 16 * k..(b + 1) * 16 * k]])
                        .flatten()
                        .copied()
                        .collect()
                } else {
                    v.clone()
                };
                for isa in Isa::available() {
                    let mut y = vec![0f32; 3 * l.rows_padded];
                    matmul_packed(isa, &w, &l, &a, 0..l.row_blocks(), &mut y);
                    for t in 0..3 {
                        for r in 0..rows {
                            let exact: f64 = (0..k).map(|c| ordered[r * k + c] * xd[t * k + c] as f64).sum();
                            let mag: f64 = (0..k).map(|c| (ordered[r * k + c] * xd[t * k + c] as f64).abs()).sum();
                            let got = y[t * l.rows_padded + r] as f64;
                            assert!(
                                (got - exact).abs() <= 1e-6 * mag.max(1e-30),
                                "{isa:?} {p}.{proj} expert {e} row {r}: {got} vs {exact}"
                            );
                        }
                    }
                }
                matrices += 1;
            }
        }
    }
    assert_eq!(matrices, 3 * 2 * n_exp);
}
