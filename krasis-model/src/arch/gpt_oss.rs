//! gpt-oss `config.json` fields (`GptOssForCausalLM`, `model_type` `gpt_oss`: gpt-oss-20b,
//! gpt-oss-120b).

use serde_json::Value;

use super::{parse_common_biased, parse_gqa_heads, parse_rope, parse_source_quant, FamilyParts, Fields};
use crate::error::Result;
use crate::spec::*;

/// The SwiGLU's sigmoid slope, which no config states: OpenAI's reference and transformers'
/// `GptOssExperts` hard-code 1.702.
pub const SWIGLU_ALPHA: f32 = 1.702;
/// The clamp when a config does not state `swiglu_limit` (the published configs say 7.0, what
/// transformers hard-codes).
pub const DEFAULT_SWIGLU_LIMIT: f64 = 7.0;

/// Each layer's window from `layer_types` (`sliding_attention` / `full_attention`), or, without
/// it, transformers' default for gpt-oss: even layers sliding, odd layers full.
fn windows(f: &Fields, num_layers: usize) -> Result<Vec<Option<usize>>> {
    let sliding: Vec<bool> = match f.present("layer_types") {
        None => (0..num_layers).map(|l| l % 2 == 0).collect(),
        Some(Value::Array(a)) => {
            if a.len() != num_layers {
                return Err(f.err("layer_types", format!("has {} entries, num_hidden_layers is {num_layers}", a.len())));
            }
            a.iter()
                .enumerate()
                .map(|(i, v)| match v.as_str() {
                    Some("sliding_attention") => Ok(true),
                    Some("full_attention") => Ok(false),
                    _ => Err(f.err(
                        &format!("layer_types[{i}]"),
                        format!("{v} is not supported (sliding_attention or full_attention)"),
                    )),
                })
                .collect::<Result<_>>()?
        }
        Some(v) => return Err(f.err("layer_types", format!("expected a list, found {v}"))),
    };
    if !sliding.contains(&true) {
        return Ok(vec![None; num_layers]);
    }
    let w =
        f.usize_opt("sliding_window")?.ok_or_else(|| f.err("sliding_window", "missing (sliding layers need it)"))?;
    if w == 0 {
        return Err(f.err("sliding_window", "must be greater than 0"));
    }
    Ok(sliding.into_iter().map(|s| s.then_some(w)).collect())
}

/// gpt-oss as transformers' `GptOssForCausalLM` and OpenAI's reference define it:
/// - GQA with biases on q, k, v and o (`attention_bias`, default true), one learned sink logit
///   per query head (`self_attn.sinks`, an extra softmax column that is dropped), RoPE over the
///   whole head with half-split pairs (YaRN in the published configs), and per layer a sliding
///   window of `sliding_window` positions or full attention ([`windows`]);
/// - every layer MoE: `num_local_experts` experts of `intermediate_size`, top
///   `num_experts_per_tok` (or `experts_per_token`) of the router's logits (`mlp.router`, a
///   linear with a bias), softmax over those k. That is softmax over all the logits, top-k and
///   renormalised, which is the rule Krasis runs;
/// - experts with biases on gate, up and down and the clamped SwiGLU
///   ([`ExpertActivation::ClampedSwiglu`], alpha [`SWIGLU_ALPHA`], limit `swiglu_limit`,
///   default [`DEFAULT_SWIGLU_LIMIT`]).
///
/// The published checkpoints fuse each layer's experts (`mlp.experts.gate_up_proj` with gate
/// and up interleaved, `down_proj`, their `_bias`, in MXFP4 as `*_blocks` / `*_scales`);
/// [`super::StoredLayout::gpt_oss_experts`] serves them by the per-expert names.
pub(super) fn parse(f: &Fields) -> Result<ModelSpec> {
    let c = parse_common_biased(f)?;
    let (heads, kv_heads, head_dim) = parse_gqa_heads(f, c.hidden_size)?;
    let biased = f.bool_or("attention_bias", true)?;
    let rope = parse_rope(f, head_dim, RopePairing::Halves, c.max_position_embeddings)?;
    let sliding_windows = windows(f, c.num_layers)?;
    let n_experts = f.dim("num_local_experts")?;
    let top_k = match f.usize_opt("num_experts_per_tok")? {
        Some(k) => k,
        None => f.dim("experts_per_token")?,
    };
    if top_k == 0 || top_k > n_experts {
        return Err(f.err("num_experts_per_tok", format!("{top_k} is outside 1..={n_experts} (num_local_experts)")));
    }
    let limit = f.f64_opt("swiglu_limit")?.unwrap_or(DEFAULT_SWIGLU_LIMIT);
    if !(limit > 0.0 && limit.is_finite()) {
        return Err(f.err("swiglu_limit", format!("{limit} must be a positive number")));
    }
    let layers = vec![FfnKind::Moe; c.num_layers];
    let mut spec = c.spec(FamilyParts {
        arch: Arch::GptOss,
        attention: AttentionSpec::Gqa {
            heads,
            kv_heads,
            head_dim,
            qk_norm: QkNorm::None,
            bias: AttnBias { qkv: biased, o: biased },
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
            naming: ExpertNaming::Router,
        }),
        layers,
        source_quant: parse_source_quant(f)?,
    });
    spec.sliding_windows = sliding_windows;
    spec.attention_sinks = true;
    spec.expert_activation = ExpertActivation::ClampedSwiglu { alpha: SWIGLU_ALPHA, limit: limit as f32 };
    spec.expert_bias = true;
    Ok(spec)
}
