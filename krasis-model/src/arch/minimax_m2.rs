//! MiniMax-M2 `config.json` fields (`MiniMaxM2ForCausalLM`, `model_type` `minimax_m2`:
//! MiniMax-M2, M2.1, M2.5, M2.7).

use serde_json::Value;

use super::{parse_common, parse_gqa_heads, parse_rope, parse_source_quant, FamilyParts, Fields};
use crate::error::Result;
use crate::spec::*;

/// The rotated dims of a head. The published configs state partial rotary only as
/// `rotary_dim` (MiniMax's own modelling code and vLLM rotate the first `rotary_dim` dims);
/// transformers 5.17 ignores that field and reads `partial_rotary_factor` (default 1.0), which
/// the published configs do not carry. Krasis follows the published semantics: `rotary_dim` when
/// given, else `head_dim · partial_rotary_factor` (top level or in `rope_parameters`), else the
/// whole head; a config giving both must agree.
fn rotary_dim(f: &Fields, head_dim: usize) -> Result<usize> {
    let factor =
        match f.present("rope_parameters").and_then(|p| p.get("partial_rotary_factor")) {
            Some(v) => Some(v.as_f64().ok_or_else(|| {
                f.err("rope_parameters.partial_rotary_factor", format!("expected a number, found {v}"))
            })?),
            None => f.f64_opt("partial_rotary_factor")?,
        };
    if let Some(x) = factor {
        if !(x > 0.0 && x <= 1.0) {
            return Err(f.err("partial_rotary_factor", format!("{x} is outside (0, 1]")));
        }
    }
    let from_factor = factor.map(|x| (head_dim as f64 * x) as usize);
    let dim = match (f.usize_opt("rotary_dim")?, from_factor) {
        (Some(d), Some(g)) if d != g => {
            return Err(
                f.err("rotary_dim", format!("{d} disagrees with partial_rotary_factor × head_dim {head_dim} = {g}"))
            )
        }
        (Some(d), _) => d,
        (None, Some(g)) => g,
        (None, None) => head_dim,
    };
    if dim == 0 || dim > head_dim || !dim.is_multiple_of(2) {
        return Err(
            f.err("rotary_dim", format!("{dim} rotated dims must be even, > 0 and at most head_dim {head_dim}"))
        );
    }
    Ok(dim)
}

/// MiniMax-M2: GQA without biases, with qk-norm (`use_qk_norm`, default true) over the whole q
/// and the whole k projection before the head split (`qk_norm_type` `per_layer`, the published
/// one; `per_head` is the Qwen3 form), partial RoPE ([`rotary_dim`]) with half-split pairs. Every
/// layer is MoE: `num_local_experts` gated MLPs of `intermediate_size`, named as Mixtral's
/// (`block_sparse_moe.experts.E.w1/w3/w2`); the router's sigmoid scores plus
/// `block_sparse_moe.e_score_correction_bias` (`use_routing_bias`, default true) choose the top
/// k, which weigh by their unbiased sigmoids renormalised, unscaled, without groups. No shared
/// expert (`shared_intermediate_size` 0). Full attention only (`attn_type_list` all 1; the
/// lightning-attention layers of MiniMax-Text-01 are refused). The multi-token-prediction modules
/// (`use_mtp`) are not loaded.
pub(super) fn parse(f: &Fields) -> Result<ModelSpec> {
    let c = parse_common(f)?;
    let (heads, kv_heads, head_dim) = parse_gqa_heads(f, c.hidden_size)?;
    if let Some(w) = f.usize_opt("sliding_window")? {
        if w < c.max_position_embeddings {
            return Err(f.err(
                "sliding_window",
                format!(
                    "a {w}-token window is not supported (shorter than max_position_embeddings {})",
                    c.max_position_embeddings
                ),
            ));
        }
    }
    match f.present("attn_type_list") {
        None => {}
        Some(Value::Array(a)) => {
            if let Some(i) = a.iter().position(|v| v.as_u64() != Some(1)) {
                return Err(f.err(
                    &format!("attn_type_list[{i}]"),
                    format!("{} is not supported (only 1: full softmax attention)", a[i]),
                ));
            }
        }
        Some(v) => return Err(f.err("attn_type_list", format!("expected a list, found {v}"))),
    }
    let qk_norm = if f.bool_or("use_qk_norm", true)? {
        match f.str_opt("qk_norm_type")?.unwrap_or("per_layer") {
            "per_layer" => QkNorm::Whole,
            "per_head" => QkNorm::PerHead,
            other => return Err(f.err("qk_norm_type", format!("`{other}` is not supported (per_layer or per_head)"))),
        }
    } else {
        QkNorm::None
    };
    let rope = parse_rope(f, rotary_dim(f, head_dim)?, RopePairing::Halves, c.max_position_embeddings)?;

    if let Some(s) = f.str_opt("scoring_func")? {
        if s != "sigmoid" {
            return Err(f.err("scoring_func", format!("`{s}` is not supported (only sigmoid)")));
        }
    }
    let n_experts = f.dim("num_local_experts")?;
    let top_k = f.dim("num_experts_per_tok")?;
    if top_k > n_experts {
        return Err(f.err("num_experts_per_tok", format!("{top_k} exceeds num_local_experts {n_experts}")));
    }
    if let Some(s) = f.usize_opt("shared_intermediate_size")?.filter(|&s| s > 0) {
        return Err(f.err("shared_intermediate_size", format!("{s}: a shared expert is not supported for minimax_m2")));
    }
    // Sigmoid + correction bias without groups: DeepSeek-V3's rule with one group.
    let topk = if f.bool_or("use_routing_bias", true)? {
        TopkMethod::NoauxTc { n_group: 1, topk_group: 1 }
    } else {
        TopkMethod::Greedy
    };
    let layers = vec![FfnKind::Moe; c.num_layers];
    Ok(c.spec(FamilyParts {
        arch: Arch::MiniMaxM2,
        attention: AttentionSpec::Gqa { heads, kv_heads, head_dim, qk_norm, bias: AttnBias::NONE, output_gate: false },
        rope,
        softmax_scale: (head_dim as f64).powf(-0.5) as f32,
        moe: Some(MoeSpec {
            n_routed_experts: n_experts,
            moe_intermediate_size: f.dim("intermediate_size")?,
            shared_intermediate_size: 0,
            shared_gate: false,
            routing: RoutingRule {
                scoring: ScoringFunc::Sigmoid,
                topk,
                top_k,
                norm_topk_prob: true,
                routed_scaling_factor: f.f64_opt("routed_scaling_factor")?.unwrap_or(1.0) as f32,
            },
            naming: ExpertNaming::BlockSparse,
        }),
        layers,
        source_quant: parse_source_quant(f)?,
    }))
}
