//! Qwen2-MoE `config.json` fields (`Qwen2MoeForCausalLM`, `model_type` `qwen2_moe`:
//! Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B).

use super::{
    parse_common_biased, parse_gqa_heads, parse_rope, parse_source_quant, sparse_step_layers, FamilyParts, Fields,
};
use crate::error::Result;
use crate::spec::*;

/// Qwen2-MoE: GQA (MHA in the published checkpoints) with q/k/v biases, which the published
/// configs carry no flag for (transformers' `qkv_bias`, default true, is read when present) and
/// no qk-norm; RoPE over the whole head. MoE layers ([`sparse_step_layers`]): `num_experts`
/// routed experts of `moe_intermediate_size` chosen by the softmax over all experts, top-k,
/// renormalised only when `norm_topk_prob` (default false), plus one shared expert of
/// `shared_expert_intermediate_size` (`mlp.shared_expert.*`) whose output is scaled per token by
/// σ(`mlp.shared_expert_gate` · x). Defaults are transformers' `Qwen2MoeConfig`'s.
pub(super) fn parse(f: &Fields) -> Result<ModelSpec> {
    let c = parse_common_biased(f)?;
    let (heads, kv_heads, head_dim) = parse_gqa_heads(f, c.hidden_size)?;
    if f.bool_or("use_sliding_window", false)? {
        return Err(f.err("use_sliding_window", "sliding-window attention is not supported"));
    }
    let rope = parse_rope(f, head_dim, RopePairing::Halves, c.max_position_embeddings)?;
    let bias = AttnBias { qkv: f.bool_or("qkv_bias", true)?, o: false };
    let n_experts = f.usize_opt("num_experts")?.unwrap_or(0);
    let layers = sparse_step_layers(f, c.num_layers, n_experts)?;
    let moe = if n_experts > 0 {
        let top_k = f.dim("num_experts_per_tok")?;
        if top_k > n_experts {
            return Err(f.err("num_experts_per_tok", format!("{top_k} exceeds num_experts {n_experts}")));
        }
        Some(MoeSpec {
            n_routed_experts: n_experts,
            moe_intermediate_size: f.dim("moe_intermediate_size")?,
            shared_intermediate_size: f.dim("shared_expert_intermediate_size")?,
            shared_gate: true,
            routing: RoutingRule {
                scoring: ScoringFunc::Softmax,
                topk: TopkMethod::Greedy,
                top_k,
                norm_topk_prob: f.bool_or("norm_topk_prob", false)?,
                routed_scaling_factor: 1.0,
            },
            naming: ExpertNaming::MlpSharedExpert,
        })
    } else {
        None
    };
    Ok(c.spec(FamilyParts {
        arch: Arch::Qwen2Moe,
        attention: AttentionSpec::Gqa { heads, kv_heads, head_dim, qk_norm: QkNorm::None, bias, output_gate: false },
        rope,
        softmax_scale: (head_dim as f64).powf(-0.5) as f32,
        moe,
        layers,
        source_quant: parse_source_quant(f)?,
    }))
}
