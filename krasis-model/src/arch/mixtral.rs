//! Mixtral `config.json` fields (`MixtralForCausalLM`).

use super::{parse_common, parse_gqa_heads, parse_rope, parse_source_quant, FamilyParts, Fields};
use crate::error::Result;
use crate::spec::*;

/// Mixtral: GQA without qk-norm, every layer a MoE of `num_local_experts` gated MLPs of width
/// `intermediate_size`; the router takes the softmax over all experts, keeps the top-k and
/// renormalises them (transformers' `MixtralSparseMoeBlock`), so `norm_topk_prob` is fixed.
pub(super) fn parse(f: &Fields) -> Result<ModelSpec> {
    let c = parse_common(f)?;
    let (heads, kv_heads, head_dim) = parse_gqa_heads(f, c.hidden_size)?;
    // A window at least as long as the context never masks anything.
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
    // `rope_interleave` (as DeepSeek's configs name it) is set by the GGUF reader: llama.cpp's
    // converter stores a LLaMA's q/k rows with each rotary pair adjacent.
    let pairing = if f.bool_or("rope_interleave", false)? { RopePairing::Interleaved } else { RopePairing::Halves };
    let rope = parse_rope(f, head_dim, pairing, c.max_position_embeddings)?;
    let n_experts = f.dim("num_local_experts")?;
    let top_k = f.dim("num_experts_per_tok")?;
    if top_k > n_experts {
        return Err(f.err("num_experts_per_tok", format!("{top_k} exceeds num_local_experts {n_experts}")));
    }
    let layers = vec![FfnKind::Moe; c.num_layers];
    Ok(c.spec(FamilyParts {
        arch: Arch::Mixtral,
        attention: AttentionSpec::Gqa {
            heads,
            kv_heads,
            head_dim,
            qk_norm: QkNorm::None,
            bias: AttnBias::NONE,
            output_gate: false,
        },
        rope,
        softmax_scale: (head_dim as f64).powf(-0.5) as f32,
        moe: Some(MoeSpec {
            n_routed_experts: n_experts,
            moe_intermediate_size: f.dim("intermediate_size")?,
            shared_intermediate_size: 0,
            shared_gate: false,
            routing: RoutingRule {
                scoring: ScoringFunc::Softmax,
                topk: TopkMethod::Greedy,
                top_k,
                norm_topk_prob: true,
                routed_scaling_factor: 1.0,
            },
            naming: ExpertNaming::BlockSparse,
        }),
        layers,
        source_quant: parse_source_quant(f)?,
    }))
}
