//! GLM-4.5 / 4.6 / 4.7 `config.json` fields (`Glm4MoeForCausalLM`, `model_type` `glm4_moe`).

use super::{parse_common_biased, parse_gqa_heads, parse_rope, parse_source_quant, FamilyParts, Fields};
use crate::error::Result;
use crate::spec::*;

/// GLM-4.5: GQA with q/k/v biases (`attention_bias`; `o_proj` has none) and RoPE on the first
/// `head_dim · partial_rotary_factor` dims of each head, pairs half-split within that part
/// (transformers' `rotate_half` over the rotary slice); optional per-head qk-norm
/// (`use_qk_norm`). The first `first_k_dense_replace` layers are dense MLPs of
/// `intermediate_size`, the rest MoE: `n_routed_experts` of `moe_intermediate_size` chosen by
/// DeepSeek-V3's rule (sigmoid scores plus `e_score_correction_bias` choose, groups ranked by
/// their top-2 sum, the unbiased scores weigh, renormalised when `norm_topk_prob`, times
/// `routed_scaling_factor`), plus `n_shared_experts` shared experts fused into one
/// (`mlp.shared_experts.*`). Defaults are transformers' `Glm4MoeConfig`'s.
///
/// The multi-token-prediction layers (`num_nextn_predict_layers`, stored after the last layer
/// as `model.layers.{num_hidden_layers}.*`) are not loaded.
pub(super) fn parse(f: &Fields) -> Result<ModelSpec> {
    let c = parse_common_biased(f)?;
    let (heads, kv_heads, head_dim) = parse_gqa_heads(f, c.hidden_size)?;
    // transformers: `int(head_dim * partial_rotary_factor)` rotated dims (the top level, or
    // inside transformers-5 `rope_parameters`).
    let factor = match f.present("rope_parameters").and_then(|p| p.get("partial_rotary_factor")) {
        Some(v) => v
            .as_f64()
            .ok_or_else(|| f.err("rope_parameters.partial_rotary_factor", format!("expected a number, found {v}")))?,
        None => f.f64_opt("partial_rotary_factor")?.unwrap_or(0.5),
    };
    if !(factor > 0.0 && factor <= 1.0) {
        return Err(f.err("partial_rotary_factor", format!("{factor} is outside (0, 1]")));
    }
    let rotary_dim = (head_dim as f64 * factor) as usize;
    if rotary_dim == 0 || !rotary_dim.is_multiple_of(2) {
        return Err(f.err(
            "partial_rotary_factor",
            format!("head_dim {head_dim} × {factor} gives {rotary_dim} rotated dims, which must be even and > 0"),
        ));
    }
    let rope = parse_rope(f, rotary_dim, RopePairing::Halves, c.max_position_embeddings)?;
    let bias = AttnBias { qkv: f.bool_or("attention_bias", false)?, o: false };
    let qk_norm = if f.bool_or("use_qk_norm", false)? { QkNorm::PerHead } else { QkNorm::None };

    let n_routed = f.dim("n_routed_experts")?;
    let top_k = f.dim("num_experts_per_tok")?;
    if top_k > n_routed {
        return Err(f.err("num_experts_per_tok", format!("{top_k} exceeds n_routed_experts {n_routed}")));
    }
    let n_group = f.usize_opt("n_group")?.unwrap_or(1);
    let topk_group = f.usize_opt("topk_group")?.unwrap_or(1);
    if n_group == 0 || n_routed % n_group != 0 {
        return Err(f.err("n_group", format!("{n_group} does not divide n_routed_experts {n_routed}")));
    }
    if n_routed / n_group < 2 {
        return Err(f.err("n_group", "the group ranking needs at least 2 experts per group"));
    }
    if topk_group == 0 || topk_group > n_group {
        return Err(f.err("topk_group", format!("{topk_group} is outside 1..={n_group} (n_group)")));
    }
    if top_k > topk_group * (n_routed / n_group) {
        return Err(f.err("num_experts_per_tok", "exceeds the experts in the kept groups"));
    }
    let moe_inter = f.dim("moe_intermediate_size")?;
    let n_shared = f.usize_opt("n_shared_experts")?.unwrap_or(1);
    let first_dense = f.usize_opt("first_k_dense_replace")?.unwrap_or(1);
    let intermediate = f.usize_opt("intermediate_size")?.unwrap_or(0);
    if first_dense > 0 && intermediate == 0 {
        return Err(f.err("intermediate_size", "missing or 0 (the dense layers before first_k_dense_replace need it)"));
    }
    let layers = (0..c.num_layers)
        .map(|l| if l < first_dense { FfnKind::Dense { intermediate_size: intermediate } } else { FfnKind::Moe })
        .collect();
    Ok(c.spec(FamilyParts {
        arch: Arch::Glm4Moe,
        attention: AttentionSpec::Gqa { heads, kv_heads, head_dim, qk_norm, bias, output_gate: false },
        rope,
        softmax_scale: (head_dim as f64).powf(-0.5) as f32,
        moe: Some(MoeSpec {
            n_routed_experts: n_routed,
            moe_intermediate_size: moe_inter,
            shared_intermediate_size: moe_inter * n_shared,
            shared_gate: false,
            routing: RoutingRule {
                scoring: ScoringFunc::Sigmoid,
                topk: TopkMethod::NoauxTc { n_group, topk_group },
                top_k,
                norm_topk_prob: f.bool_or("norm_topk_prob", true)?,
                routed_scaling_factor: f.f64_opt("routed_scaling_factor")?.unwrap_or(1.0) as f32,
            },
            naming: ExpertNaming::Mlp,
        }),
        layers,
        source_quant: parse_source_quant(f)?,
    }))
}
