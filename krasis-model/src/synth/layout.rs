//! The publisher's storage format of a synthetic model: which tensors a checkpoint of a
//! configuration stores, under which names, in which dtypes.
//!
//! - Unquantised tensors are BF16, the router's `e_score_correction_bias` F32 (as DeepSeek-V3
//!   and Kimi publish them).
//! - Block FP8 (`quant_method` `fp8`, DeepSeek-V3, Kimi-K2): every projection but the router
//!   and the LM head is `weight` in F8_E4M3 plus its F32 `weight_scale_inv`, one per block.
//! - compressed-tensors INT4 (Kimi-K2-Thinking, K2.5): each routed expert's projection is
//!   `weight_packed` (I32, eight codes per word along the input), `weight_scale` (BF16, one
//!   per group) and `weight_shape` (I32 `[out, in]`); everything else is BF16.
//! - gpt-oss ([`StoredLayout::gpt_oss_experts`](crate::arch::StoredLayout)): each MoE layer's
//!   routed experts fused as OpenAI publishes them, under `mlp.experts.`. In MXFP4
//!   (`quant_method` `mxfp4`): `gate_up_proj_blocks` (U8 `[E, 2I, H/32, 16]`, two E2M1 codes a
//!   byte; rows are outputs, gate j and up j alternating), `gate_up_proj_scales` (U8 E8M0
//!   `[E, 2I, H/32]`), `down_proj_blocks` / `down_proj_scales` (`[E, H, I/32, …]`) and the
//!   BF16 biases `gate_up_proj_bias` `[E, 2I]` and `down_proj_bias` `[E, H]`. Unquantised, as
//!   transformers and the BF16 conversions store them: `gate_up_proj` `[E, H, 2I]` and
//!   `down_proj` `[E, I, H]` (x · W) with the same biases. llama.cpp's converter reads only
//!   these forms.
//! - MXFP4 in another family: each routed expert's projection is `weight_blocks` (U8
//!   `[out, in/32, 16]`) and `weight_scales` (U8 E8M0 `[out, in/32]`), per expert; everything
//!   else is BF16.
//! - ModelOpt NVFP4 (`quant_method` `modelopt`, `quant_algo` `NVFP4`): each routed expert's
//!   projection `P` is `P.weight` (U8 `[out, in/2]`, two E2M1 codes a byte, element 2j in the
//!   low nibble), `P.weight_scale` (F8_E4M3 `[out, in/16]`), `P.weight_scale_2` and
//!   `P.input_scale` (F32 scalars, shape `[]`); everything else is BF16, as ModelOpt's
//!   experts-only recipe leaves it (attention, routers, shared experts, dense MLPs, embeddings,
//!   LM head). The `quantization_config` is written as given (no `hf_quant_config.json`: the
//!   loader reads `config.json`'s).
//! - A configuration nesting its text model (Kimi-K2.5) stores it under its tensor prefix
//!   (`language_model.`).
//!
//! The random values keep the scales of [`super::init`]: each quantised projection's scale is
//! chosen so its dequantised values have the standard deviation of the BF16 draw it replaces.

use std::path::Path;

use krasis_core::dtype::{f32_to_fp8_e4m3, fp8_e4m3_to_f32};
use serde_json::Value;

use super::init::{fnv1a, layer_of, Dtype, Fill, SynthTensor};
use crate::arch::CheckpointConfig;
use crate::error::{ModelError, Result};
use crate::model::tensors::{experts_prefix, is_matrix, TensorRole, TensorSpec};
use crate::spec::{MixerKind, ModelSpec, SourceQuant};

/// A tensor as a checkpoint stores it: name, shape and dtype.
#[derive(Clone, Debug, PartialEq)]
pub struct StoredSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: krasis_core::DType,
}

/// The root-mean-square value of the FP8 E4M3 codes a uniform draw of codes gives (NaNs as 0).
fn fp8_code_rms() -> f32 {
    let table = krasis_core::dtype::fp8_e4m3_table();
    let sum: f64 = table.iter().map(|&v| if v.is_nan() { 0.0 } else { (v as f64) * (v as f64) }).sum();
    (sum / 256.0).sqrt() as f32
}

/// The root-mean-square value of a uniform INT4 code in `[-8, 7]`: sqrt(344 / 16).
fn int4_code_rms() -> f32 {
    (344.0f32 / 16.0).sqrt()
}

/// The root-mean-square value of a uniform E2M1 code: sqrt(68.5 / 8).
fn e2m1_code_rms() -> f32 {
    (68.5f32 / 8.0).sqrt()
}

/// The standard deviation of a tensor's BF16 draw (uniform on `(-b, b)`: `b / sqrt(3)`).
fn draw_std(t: &SynthTensor) -> Result<f32> {
    match t.fill {
        Fill::Uniform { bound, plus: None } => Ok(bound / 3f32.sqrt()),
        _ => Err(ModelError::Invalid(format!("tensor `{}` has no plain random draw to quantise", t.spec.name))),
    }
}

fn derived(t: &SynthTensor, name: String, shape: Vec<usize>, dtype: Dtype, fill: Fill) -> SynthTensor {
    let key = fnv1a(&name);
    SynthTensor { spec: TensorSpec { name, shape, role: t.spec.role }, dtype, fill, key }
}

/// Rewrites the BF16 plan of [`super::init::plan_tensors`] into what a checkpoint of `cfg`
/// stores (see the module docs). A plan without quantisation or prefix is returned unchanged.
pub(crate) fn store_layout(tensors: Vec<SynthTensor>, cfg: &CheckpointConfig) -> Result<Vec<SynthTensor>> {
    let quant = &cfg.spec.source_quant;
    let fuse = cfg.layout.gpt_oss_experts && matches!(quant, SourceQuant::None | SourceQuant::Mxfp4);
    let mut out = Vec::with_capacity(tensors.len());
    // With `fuse`, one MoE layer's routed-expert tensors (contiguous in the inventory) and their
    // layer, written fused once the run ends.
    let mut group: Vec<SynthTensor> = Vec::new();
    let mut group_layer = None;
    for t in tensors {
        let layer = if fuse { routed_expert_layer(&cfg.spec, &t) } else { None };
        if layer != group_layer {
            if let Some(l) = group_layer {
                out.extend(gpt_oss_fused(&cfg.spec, l, &std::mem::take(&mut group))?);
            }
            group_layer = layer;
        }
        if layer.is_some() {
            group.push(t);
            continue;
        }
        match *quant {
            SourceQuant::Fp8Block { block_rows, block_cols }
                if is_matrix(&t.spec) && t.spec.role != TensorRole::LmHead =>
            {
                let (rows, cols) = (t.spec.shape[0], t.spec.shape[1]);
                let scale = draw_std(&t)? / fp8_code_rms();
                let grid = krasis_quant::fp8_block::scale_grid(rows, cols, block_rows, block_cols);
                let scale_name = format!("{}_scale_inv", t.spec.name);
                out.push(derived(&t, t.spec.name.clone(), t.spec.shape.clone(), Dtype::F8E4M3, Fill::Codes));
                out.push(derived(&t, scale_name, vec![grid.0, grid.1], Dtype::F32, Fill::Const(scale)));
            }
            SourceQuant::CompressedInt4 { group_size } if matches!(t.spec.role, TensorRole::RoutedExpert { .. }) => {
                let (rows, cols) = (t.spec.shape[0], t.spec.shape[1]);
                let base = t.spec.name.strip_suffix(".weight").expect("a projection's name ends in .weight");
                if !cols.is_multiple_of(8) || !cols.is_multiple_of(group_size) {
                    return Err(ModelError::Invalid(format!(
                        "tensor `{}`: {cols} inputs are not a whole number of INT4 words (8) and groups ({group_size})",
                        t.spec.name
                    )));
                }
                // A power of two: exact in BF16 and in the f16 of Krasis' own INT4 groups.
                let scale = 2f32.powf((draw_std(&t)? / int4_code_rms()).log2().round());
                out.push(derived(&t, format!("{base}.weight_packed"), vec![rows, cols / 8], Dtype::I32, Fill::Codes));
                out.push(derived(
                    &t,
                    format!("{base}.weight_scale"),
                    vec![rows, cols / group_size],
                    Dtype::Bf16,
                    Fill::Const(scale),
                ));
                out.push(derived(
                    &t,
                    format!("{base}.weight_shape"),
                    vec![2],
                    Dtype::I32,
                    Fill::Ints(vec![rows as i32, cols as i32]),
                ));
            }
            SourceQuant::Mxfp4 if matches!(t.spec.role, TensorRole::RoutedExpert { .. }) => {
                let (rows, cols) = (t.spec.shape[0], t.spec.shape[1]);
                let base = t.spec.name.strip_suffix(".weight").expect("a projection's name ends in .weight");
                if !cols.is_multiple_of(32) {
                    return Err(ModelError::Invalid(format!(
                        "tensor `{}`: {cols} inputs are not a whole number of MXFP4 groups (32)",
                        t.spec.name
                    )));
                }
                // E8M0: a power of two, 2^(byte − 127).
                let log2 = (draw_std(&t)? / e2m1_code_rms()).log2().round().clamp(-127.0, 127.0);
                let g = cols / 32;
                out.push(derived(&t, format!("{base}.weight_blocks"), vec![rows, g, 16], Dtype::U8, Fill::Codes));
                out.push(derived(
                    &t,
                    format!("{base}.weight_scales"),
                    vec![rows, g],
                    Dtype::U8,
                    Fill::Const(127.0 + log2),
                ));
            }
            SourceQuant::ModelOptNvfp4 if matches!(t.spec.role, TensorRole::RoutedExpert { .. }) => {
                out.extend(nvfp4_linear(&t)?);
            }
            _ => out.push(t),
        }
    }
    if let Some(l) = group_layer {
        out.extend(gpt_oss_fused(&cfg.spec, l, &group)?);
    }
    if !cfg.tensor_prefix.is_empty() {
        // The canonical names under `canonical_prefix` (all of them when it is empty) are stored
        // under `tensor_prefix` instead.
        for t in &mut out {
            if let Some(rest) = t.spec.name.strip_prefix(cfg.canonical_prefix) {
                t.spec.name = format!("{}{rest}", cfg.tensor_prefix);
            }
        }
    }
    Ok(out)
}

/// A routed expert's projection `t` (`P.weight`, BF16 `[out, in]` in the plan) as ModelOpt's
/// NVFP4 linear: `P.weight` (U8 `[out, in/2]`, uniformly random bytes: two E2M1 codes each),
/// `P.weight_scale` (F8_E4M3 `[out, in/16]`, one constant), `P.weight_scale_2` and
/// `P.input_scale` (F32 scalars, shape `[]` as ModelOpt writes them).
fn nvfp4_linear(t: &SynthTensor) -> Result<Vec<SynthTensor>> {
    let (rows, cols) = (t.spec.shape[0], t.spec.shape[1]);
    let base = t.spec.name.strip_suffix(".weight").expect("a projection's name ends in .weight");
    if !cols.is_multiple_of(16) {
        return Err(ModelError::Invalid(format!(
            "tensor `{}`: {cols} inputs are not a whole number of NVFP4 groups (16)",
            t.spec.name
        )));
    }
    // weight_scale · weight_scale_2 is the draw's standard deviation over the codes' RMS. ModelOpt
    // sets weight_scale_2 = amax / (6 · 448), so its group scales run up to E4M3's 448; here the
    // power of two that puts the one group scale near 256 (target / weight_scale_2 in [181, 362],
    // E4M3 normals whatever the draw) keeps it in that range, and rounding it to E4M3 (3 mantissa
    // bits) moves the product by at most 1/16.
    let target = draw_std(t)? / e2m1_code_rms();
    let global = 2f32.powi((target / 256.0).log2().round().clamp(-126.0, 127.0) as i32);
    let group_scale = fp8_e4m3_to_f32(f32_to_fp8_e4m3(target / global));
    // Not read by Krasis (it quantises activations itself); ModelOpt's value for an input amax
    // of 6, about what a unit-RMS activation reaches: amax / (6 · 448).
    let input_scale = 1.0 / 448.0;
    Ok(vec![
        derived(t, t.spec.name.clone(), vec![rows, cols / 2], Dtype::U8, Fill::Codes),
        derived(t, format!("{base}.weight_scale"), vec![rows, cols / 16], Dtype::F8E4M3, Fill::Const(group_scale)),
        derived(t, format!("{base}.weight_scale_2"), vec![], Dtype::F32, Fill::Const(global)),
        derived(t, format!("{base}.input_scale"), vec![], Dtype::F32, Fill::Const(input_scale)),
    ])
}

/// The MoE layer whose routed experts `t` belongs to (a projection or its bias, canonical name).
fn routed_expert_layer(spec: &ModelSpec, t: &SynthTensor) -> Option<usize> {
    let l = layer_of(&t.spec.name)?;
    t.spec.name.strip_prefix(&experts_prefix(spec, l))?.starts_with('.').then_some(l)
}

/// One MoE layer's routed experts as gpt-oss's published fused tensors (see the module docs).
/// `group` is the layer's per-expert plan (every expert's gate, up and down projections and
/// biases); expert 0's draws give the values' scales, which are the same for every expert: the
/// fused BF16 tensors keep each projection's draw, the MXFP4 scales are the power of two that
/// gives the dequantised values the standard deviation of that draw (as per expert).
fn gpt_oss_fused(spec: &ModelSpec, l: usize, group: &[SynthTensor]) -> Result<Vec<SynthTensor>> {
    let moe = spec.moe.as_ref().expect("routed experts imply a MoE spec");
    let (e, i, h) = (moe.n_routed_experts, moe.moe_intermediate_size, spec.hidden_size);
    let p = experts_prefix(spec, l);
    let find = |proj: &str| {
        let name = format!("{p}.0.{proj}");
        group
            .iter()
            .find(|t| t.spec.name == name)
            .ok_or_else(|| ModelError::Invalid(format!("layer {l}: `{name}` is not in the plan to fuse")))
    };
    let (gate, down, bias) = (find("gate_proj.weight")?, find("down_proj.weight")?, find("gate_proj.bias")?);
    let weights = TensorRole::RoutedExpert { layer: l, expert: 0 };
    let new = |name: &str, shape: Vec<usize>, dtype: Dtype, fill: Fill, role: TensorRole| {
        let name = format!("{p}.{name}");
        SynthTensor { key: fnv1a(&name), spec: TensorSpec { name, shape, role }, dtype, fill }
    };
    let biases = |out: &mut Vec<SynthTensor>| {
        out.push(new("gate_up_proj_bias", vec![e, 2 * i], bias.dtype, bias.fill.clone(), TensorRole::Bias));
        out.push(new("down_proj_bias", vec![e, h], bias.dtype, bias.fill.clone(), TensorRole::Bias));
    };
    let mut out = Vec::with_capacity(6);
    if spec.source_quant != SourceQuant::Mxfp4 {
        // x · W: `[E, in, out]`, gate_up's columns alternating gate j and up j.
        out.push(new("gate_up_proj", vec![e, h, 2 * i], gate.dtype, gate.fill.clone(), weights));
        out.push(new("down_proj", vec![e, i, h], down.dtype, down.fill.clone(), weights));
        biases(&mut out);
        return Ok(out);
    }
    for (dim, what) in [(h, "hidden_size"), (i, "intermediate_size")] {
        if !dim.is_multiple_of(32) {
            return Err(ModelError::Invalid(format!(
                "layer {l}: MXFP4 experts need {what} ({dim}) to be a whole number of MXFP4 groups (32)"
            )));
        }
    }
    // E8M0: a power of two, 2^(byte − 127).
    let scale = |t: &SynthTensor| -> Result<Fill> {
        Ok(Fill::Const(127.0 + (draw_std(t)? / e2m1_code_rms()).log2().round().clamp(-127.0, 127.0)))
    };
    out.push(new("gate_up_proj_blocks", vec![e, 2 * i, h / 32, 16], Dtype::U8, Fill::Codes, weights));
    out.push(new("gate_up_proj_scales", vec![e, 2 * i, h / 32], Dtype::U8, scale(gate)?, weights));
    out.push(new("down_proj_blocks", vec![e, h, i / 32, 16], Dtype::U8, Fill::Codes, weights));
    out.push(new("down_proj_scales", vec![e, h, i / 32], Dtype::U8, scale(down)?, weights));
    biases(&mut out);
    Ok(out)
}

/// The tensors a checkpoint of `cfg` stores, in file order, in the publisher's format (see the
/// module docs): what `krasis synth` writes for it.
pub fn stored_tensors(cfg: &CheckpointConfig) -> Result<Vec<StoredSpec>> {
    let plan = super::init::plan_tensors(&cfg.spec, crate::model::tensors::expected_tensors(&cfg.spec), 0, 0.0);
    Ok(store_layout(plan, cfg)?
        .into_iter()
        .map(|t| StoredSpec { name: t.spec.name, shape: t.spec.shape, dtype: t.dtype.dtype() })
        .collect())
}

/// `config.json` of `path` with the text model's `num_hidden_layers` cut to `layers` (the
/// text model is `text_config` where the configuration nests it).
pub(crate) fn config_from_file(path: &Path, layers: Option<usize>) -> Result<Value> {
    let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
    let mut config: Value =
        serde_json::from_str(&text).map_err(|e| ModelError::Json { path: path.to_path_buf(), msg: e.to_string() })?;
    // Validates the whole configuration first, so the edit below only meets known layouts.
    let full = crate::arch::parse_checkpoint_config(&text, path)?.spec;
    let Some(l) = layers else { return Ok(config) };
    let nested = config.get("text_config").is_some_and(Value::is_object);
    let text_model = if nested { &mut config["text_config"] } else { &mut config };
    let max = text_model.get("num_hidden_layers").and_then(Value::as_u64).unwrap_or(0) as usize;
    if !(1..=max).contains(&l) {
        return Err(ModelError::Invalid(format!(
            "the layer count (`SynthOptions::layers`) {l} is out of range for {}: it has {max} layers (allowed 1..={max})",
            path.display()
        )));
    }
    text_model["num_hidden_layers"] = Value::from(l);
    if full.delta_net.is_some() {
        text_model["layer_types"] = trimmed_layer_types(&full.mixers, l).into();
    } else if let Some(Value::Array(types)) = text_model.get_mut("layer_types") {
        // Attention kinds per layer (gpt-oss's sliding / full): the first `l`, as the layers.
        types.truncate(l);
    }
    Ok(config)
}

/// The first `n` layers' mixers as `layer_types`, with every kind of the whole model kept: when
/// the cut leaves a kind out (the first two of Qwen3-Next's `[linear × 3, full]`), the last
/// layers take the missing kinds, so a trimmed hybrid still runs both.
pub(crate) fn trimmed_layer_types(all: &[MixerKind], n: usize) -> Vec<Value> {
    let mut kept: Vec<MixerKind> = all[..n].to_vec();
    let mut missing: Vec<MixerKind> = Vec::new();
    for k in all {
        if !kept.contains(k) && !missing.contains(k) {
            missing.push(*k);
        }
    }
    let start = n.saturating_sub(missing.len());
    for (slot, k) in kept[start..].iter_mut().zip(missing) {
        *slot = k;
    }
    kept.iter()
        .map(|k| match k {
            MixerKind::Attention => Value::from("full_attention"),
            MixerKind::GatedDeltaNet => Value::from("linear_attention"),
        })
        .collect()
}
