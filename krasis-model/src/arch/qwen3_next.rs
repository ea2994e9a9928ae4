//! Qwen3-Next (`qwen3_next`) and Qwen3.5 / 3.6 MoE (`qwen3_5_moe`, whose text model is nested
//! in `text_config`) `config.json` fields.
//!
//! Both interleave gated-DeltaNet linear-attention layers with gated full-attention layers
//! (`layer_types`, or every `full_attention_interval`-th layer when the list is absent), and
//! every layer is MoE with a sigmoid-gated shared expert. The layer norms, the final norm and the
//! q/k norms are zero-centred (`1 + w`). Full attention: `q_proj` yields per head the query and
//! an output gate of the same width, per-head q/k RMSNorm, RoPE on the first
//! `head_dim · partial_rotary_factor` dims, pairs half-split. The multi-token-prediction head
//! (`mtp.*`, `mtp_num_hidden_layers`) is recognised and not loaded.
//!
//! Qwen3.5's `rope_parameters.mrope_section` splits the rotary dims between three position
//! streams (time, height, width); for text all three are the token's position, so the rotation
//! is plain partial RoPE and the sections are not needed.

use serde_json::Value;

use super::{parse_common, parse_gqa_heads, parse_rope, parse_source_quant, sparse_step_layers, FamilyParts, Fields};
use crate::error::Result;
use crate::spec::*;

/// `layer_types`: each layer's mixer, `num_hidden_layers` long; absent, every
/// `full_attention_interval`-th layer (default 4) is full attention and the rest DeltaNet.
fn parse_layer_types(f: &Fields, n: usize) -> Result<Vec<MixerKind>> {
    match f.present("layer_types") {
        Some(Value::Array(a)) => {
            if a.len() != n {
                return Err(f.err(
                    "layer_types",
                    format!("has {} entries but num_hidden_layers is {n}: one entry per layer", a.len()),
                ));
            }
            a.iter()
                .enumerate()
                .map(|(i, v)| match v.as_str() {
                    Some("linear_attention") => Ok(MixerKind::GatedDeltaNet),
                    Some("full_attention") => Ok(MixerKind::Attention),
                    _ => Err(f.err(
                        &format!("layer_types[{i}]"),
                        format!("{v} is not a layer type Krasis runs (linear_attention or full_attention)"),
                    )),
                })
                .collect()
        }
        Some(v) => Err(f.err("layer_types", format!("expected a list, found {v}"))),
        None => {
            let every = f.usize_opt("full_attention_interval")?.unwrap_or(4);
            if every == 0 {
                return Err(f.err("full_attention_interval", "must be greater than 0"));
            }
            Ok((0..n)
                .map(|l| if (l + 1) % every == 0 { MixerKind::Attention } else { MixerKind::GatedDeltaNet })
                .collect())
        }
    }
}

/// The DeltaNet geometry: `linear_num_key_heads` × `linear_key_head_dim` for q and k,
/// `linear_num_value_heads` × `linear_value_head_dim` for v, `linear_conv_kernel_dim` taps.
fn parse_delta_net(f: &Fields) -> Result<DeltaNetSpec> {
    let key_heads = f.dim("linear_num_key_heads")?;
    let value_heads = f.dim("linear_num_value_heads")?;
    if value_heads % key_heads != 0 {
        return Err(f.err(
            "linear_num_value_heads",
            format!("{value_heads} is not a multiple of linear_num_key_heads {key_heads}"),
        ));
    }
    let conv_kernel = f.usize_opt("linear_conv_kernel_dim")?.unwrap_or(4);
    if conv_kernel == 0 {
        return Err(f.err("linear_conv_kernel_dim", "must be greater than 0"));
    }
    Ok(DeltaNetSpec {
        key_heads,
        value_heads,
        key_dim: f.dim("linear_key_head_dim")?,
        value_dim: f.dim("linear_value_head_dim")?,
        conv_kernel,
    })
}

/// `partial_rotary_factor` (top level or in `rope_parameters`), the rotated dims of a head.
fn rotary_dim(f: &Fields, head_dim: usize) -> Result<usize> {
    let factor = match f.present("rope_parameters").and_then(|p| p.get("partial_rotary_factor")) {
        Some(v) => v
            .as_f64()
            .ok_or_else(|| f.err("rope_parameters.partial_rotary_factor", format!("expected a number, found {v}")))?,
        None => f.f64_opt("partial_rotary_factor")?.unwrap_or(0.25),
    };
    if !(factor > 0.0 && factor <= 1.0) {
        return Err(f.err("partial_rotary_factor", format!("{factor} is outside (0, 1]")));
    }
    let dim = (head_dim as f64 * factor) as usize;
    if dim == 0 || !dim.is_multiple_of(2) {
        return Err(f.err(
            "partial_rotary_factor",
            format!("head_dim {head_dim} × {factor} gives {dim} rotated dims, which must be even and > 0"),
        ));
    }
    Ok(dim)
}

/// The text model of Qwen3-Next (`arch` [`Arch::Qwen3Next`]) or Qwen3.5 (`text_config`,
/// [`Arch::Qwen35Moe`]: the router always renormalises, the output gate is `attn_output_gate`).
pub(super) fn parse(f: &Fields, arch: Arch) -> Result<ModelSpec> {
    let c = parse_common(f)?;
    if f.bool_or("use_sliding_window", false)? {
        return Err(f.err("use_sliding_window", "sliding-window attention is not supported"));
    }
    let (heads, kv_heads, head_dim) = parse_gqa_heads(f, c.hidden_size)?;
    let rope = parse_rope(f, rotary_dim(f, head_dim)?, RopePairing::Halves, c.max_position_embeddings)?;
    let mixers = parse_layer_types(f, c.num_layers)?;
    let delta_net = parse_delta_net(f)?;
    let output_gate = match arch {
        Arch::Qwen35Moe => f.bool_or("attn_output_gate", true)?,
        _ => true,
    };

    let n_experts = f.dim("num_experts")?;
    let top_k = f.dim("num_experts_per_tok")?;
    if top_k > n_experts {
        return Err(f.err("num_experts_per_tok", format!("{top_k} exceeds num_experts {n_experts}")));
    }
    let layers = sparse_step_layers(f, c.num_layers, n_experts)?;
    let norm_topk_prob = match arch {
        Arch::Qwen35Moe => true,
        _ => f.bool_or("norm_topk_prob", true)?,
    };
    let mut spec = c.spec(FamilyParts {
        arch,
        attention: AttentionSpec::Gqa {
            heads,
            kv_heads,
            head_dim,
            qk_norm: QkNorm::PerHead,
            bias: AttnBias::NONE,
            output_gate,
        },
        rope,
        softmax_scale: (head_dim as f64).powf(-0.5) as f32,
        moe: Some(MoeSpec {
            n_routed_experts: n_experts,
            moe_intermediate_size: f.dim("moe_intermediate_size")?,
            shared_intermediate_size: f.usize_opt("shared_expert_intermediate_size")?.unwrap_or(0),
            shared_gate: true,
            routing: RoutingRule {
                scoring: ScoringFunc::Softmax,
                topk: TopkMethod::Greedy,
                top_k,
                norm_topk_prob,
                routed_scaling_factor: 1.0,
            },
            naming: ExpertNaming::MlpSharedExpert,
        }),
        layers,
        source_quant: parse_source_quant(f)?,
    });
    spec.mixers = mixers;
    spec.delta_net = Some(delta_net);
    spec.norm_plus_one = true;
    Ok(spec)
}
