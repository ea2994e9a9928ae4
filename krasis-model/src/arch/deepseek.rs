//! DeepSeek-V2 / V3 `config.json` fields.

use super::{parse_common, parse_rope, parse_source_quant, yarn_get_mscale, FamilyParts, Fields};
use crate::error::Result;
use crate::spec::*;

/// DeepSeek-V2 and V3 (and their layouts: Kimi-K2): MLA attention, grouped routing.
pub(super) fn parse(f: &Fields, arch: Arch) -> Result<ModelSpec> {
    let c = parse_common(f)?;
    let heads = f.dim("num_attention_heads")?;
    let q_lora_rank = f.usize_opt("q_lora_rank")?.filter(|&r| r > 0);
    let kv_lora_rank = f.dim("kv_lora_rank")?;
    let qk_nope_head_dim = f.dim("qk_nope_head_dim")?;
    let qk_rope_head_dim = f.dim("qk_rope_head_dim")?;
    let v_head_dim = f.dim("v_head_dim")?;
    if qk_rope_head_dim % 2 != 0 {
        return Err(f.err("qk_rope_head_dim", "must be even"));
    }
    let pairing = if f.bool_or("rope_interleave", true)? { RopePairing::Interleaved } else { RopePairing::Halves };
    let rope = parse_rope(f, qk_rope_head_dim, pairing, c.max_position_embeddings)?;
    let mut softmax_scale = ((qk_nope_head_dim + qk_rope_head_dim) as f64).powf(-0.5);
    if let RopeScaling::Yarn { factor, mscale_all_dim: Some(m), .. } = rope.scaling {
        if m != 0.0 {
            let ms = yarn_get_mscale(factor, m);
            softmax_scale *= ms * ms;
        }
    }

    let n_routed = f.usize_opt("n_routed_experts")?.unwrap_or(0);
    let first_dense = f.usize_opt("first_k_dense_replace")?.unwrap_or(0);
    let freq = f.usize_opt("moe_layer_freq")?.unwrap_or(1);
    if freq == 0 {
        return Err(f.err("moe_layer_freq", "must be greater than 0"));
    }
    let intermediate = f.dim("intermediate_size")?;
    let layers: Vec<FfnKind> = (0..c.num_layers)
        .map(|l| {
            if n_routed > 0 && l >= first_dense && l % freq == 0 {
                FfnKind::Moe
            } else {
                FfnKind::Dense { intermediate_size: intermediate }
            }
        })
        .collect();
    let moe = if n_routed > 0 {
        let top_k = f.dim("num_experts_per_tok")?;
        if top_k > n_routed {
            return Err(f.err("num_experts_per_tok", format!("{top_k} exceeds n_routed_experts {n_routed}")));
        }
        let moe_inter = f.dim("moe_intermediate_size")?;
        let n_shared = f.usize_opt("n_shared_experts")?.unwrap_or(0);
        let scoring = match f.str_opt("scoring_func")?.unwrap_or("softmax") {
            "softmax" => ScoringFunc::Softmax,
            "sigmoid" => ScoringFunc::Sigmoid,
            other => return Err(f.err("scoring_func", format!("`{other}` is not supported (softmax, sigmoid)"))),
        };
        let default_method = if arch == Arch::DeepseekV3 { "noaux_tc" } else { "greedy" };
        let method = f.str_opt("topk_method")?.unwrap_or(default_method);
        let groups = |f: &Fields| -> Result<(usize, usize)> {
            let n_group = f.dim("n_group")?;
            let topk_group = f.dim("topk_group")?;
            if n_routed % n_group != 0 {
                return Err(f.err("n_group", format!("{n_group} does not divide n_routed_experts {n_routed}")));
            }
            if topk_group > n_group {
                return Err(f.err("topk_group", format!("{topk_group} exceeds n_group {n_group}")));
            }
            if top_k > topk_group * (n_routed / n_group) {
                return Err(f.err("num_experts_per_tok", "exceeds the experts in the kept groups"));
            }
            Ok((n_group, topk_group))
        };
        let topk = match method {
            "greedy" => TopkMethod::Greedy,
            "group_limited_greedy" => {
                let (n_group, topk_group) = groups(f)?;
                TopkMethod::GroupLimitedGreedy { n_group, topk_group }
            }
            "noaux_tc" => {
                let (n_group, topk_group) = groups(f)?;
                if n_routed / n_group < 2 {
                    return Err(f.err("n_group", "noaux_tc needs at least 2 experts per group"));
                }
                TopkMethod::NoauxTc { n_group, topk_group }
            }
            other => {
                return Err(f.err(
                    "topk_method",
                    format!("`{other}` is not supported (greedy, group_limited_greedy, noaux_tc)"),
                ))
            }
        };
        Some(MoeSpec {
            n_routed_experts: n_routed,
            moe_intermediate_size: moe_inter,
            shared_intermediate_size: moe_inter * n_shared,
            shared_gate: false,
            routing: RoutingRule {
                scoring,
                topk,
                top_k,
                norm_topk_prob: f.bool_or("norm_topk_prob", false)?,
                routed_scaling_factor: f.f64_opt("routed_scaling_factor")?.unwrap_or(1.0) as f32,
            },
            naming: ExpertNaming::Mlp,
        })
    } else {
        None
    };
    Ok(c.spec(FamilyParts {
        arch,
        attention: AttentionSpec::Mla {
            heads,
            q_lora_rank,
            kv_lora_rank,
            qk_nope_head_dim,
            qk_rope_head_dim,
            v_head_dim,
        },
        rope,
        softmax_scale: softmax_scale as f32,
        moe,
        layers,
        source_quant: parse_source_quant(f)?,
    }))
}
