//! The tensor inventory a [`ModelSpec`] implies: canonical (HF) names, logical shapes and roles.
//! The loader validates against it, `krasis synth` writes it, `krasis info` counts it.

use crate::source::WeightSource;
use crate::spec::{AttentionSpec, FfnKind, ModelSpec, TopkMethod};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TensorRole {
    Embedding,
    LmHead,
    Norm,
    Attention,
    Router,
    RouterBias,
    SharedExpert,
    DenseMlp,
    RoutedExpert { layer: usize, expert: usize },
}

#[derive(Clone, Debug, PartialEq)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub role: TensorRole,
}

impl TensorSpec {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Whether a tensor is a 2-D projection (an FP8 checkpoint stores those quantised).
pub fn is_matrix(t: &TensorSpec) -> bool {
    t.shape.len() == 2 && !matches!(t.role, TensorRole::Embedding | TensorRole::Router)
}

pub fn expected_tensors(spec: &ModelSpec) -> Vec<TensorSpec> {
    let h = spec.hidden_size;
    let mut out = Vec::new();
    let mut push = |name: String, shape: Vec<usize>, role: TensorRole| {
        out.push(TensorSpec { name, shape, role });
    };
    push("model.embed_tokens.weight".into(), vec![spec.vocab_size, h], TensorRole::Embedding);
    for (l, ffn) in spec.layers.iter().enumerate() {
        let p = ModelSpec::layer_prefix(l);
        push(format!("{p}.input_layernorm.weight"), vec![h], TensorRole::Norm);
        push(format!("{p}.post_attention_layernorm.weight"), vec![h], TensorRole::Norm);
        let a = format!("{p}.self_attn");
        match spec.attention {
            AttentionSpec::Mla { heads, q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim } => {
                let qk = qk_nope_head_dim + qk_rope_head_dim;
                match q_lora_rank {
                    Some(r) => {
                        push(format!("{a}.q_a_proj.weight"), vec![r, h], TensorRole::Attention);
                        push(format!("{a}.q_a_layernorm.weight"), vec![r], TensorRole::Norm);
                        push(format!("{a}.q_b_proj.weight"), vec![heads * qk, r], TensorRole::Attention);
                    }
                    None => push(format!("{a}.q_proj.weight"), vec![heads * qk, h], TensorRole::Attention),
                }
                push(
                    format!("{a}.kv_a_proj_with_mqa.weight"),
                    vec![kv_lora_rank + qk_rope_head_dim, h],
                    TensorRole::Attention,
                );
                push(format!("{a}.kv_a_layernorm.weight"), vec![kv_lora_rank], TensorRole::Norm);
                push(
                    format!("{a}.kv_b_proj.weight"),
                    vec![heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank],
                    TensorRole::Attention,
                );
                push(format!("{a}.o_proj.weight"), vec![h, heads * v_head_dim], TensorRole::Attention);
            }
            AttentionSpec::Gqa { heads, kv_heads, head_dim, qk_norm } => {
                push(format!("{a}.q_proj.weight"), vec![heads * head_dim, h], TensorRole::Attention);
                push(format!("{a}.k_proj.weight"), vec![kv_heads * head_dim, h], TensorRole::Attention);
                push(format!("{a}.v_proj.weight"), vec![kv_heads * head_dim, h], TensorRole::Attention);
                push(format!("{a}.o_proj.weight"), vec![h, heads * head_dim], TensorRole::Attention);
                if qk_norm {
                    push(format!("{a}.q_norm.weight"), vec![head_dim], TensorRole::Norm);
                    push(format!("{a}.k_norm.weight"), vec![head_dim], TensorRole::Norm);
                }
            }
        }
        let m = format!("{p}.mlp");
        match ffn {
            FfnKind::Dense { intermediate_size: i } => {
                push(format!("{m}.gate_proj.weight"), vec![*i, h], TensorRole::DenseMlp);
                push(format!("{m}.up_proj.weight"), vec![*i, h], TensorRole::DenseMlp);
                push(format!("{m}.down_proj.weight"), vec![h, *i], TensorRole::DenseMlp);
            }
            FfnKind::Moe => {
                let moe = spec.moe.as_ref().expect("MoE layer implies a MoE spec");
                let e = moe.n_routed_experts;
                let i = moe.moe_intermediate_size;
                push(format!("{m}.gate.weight"), vec![e, h], TensorRole::Router);
                if matches!(moe.routing.topk, TopkMethod::NoauxTc { .. }) {
                    push(format!("{m}.gate.e_score_correction_bias"), vec![e], TensorRole::RouterBias);
                }
                for x in 0..e {
                    let role = TensorRole::RoutedExpert { layer: l, expert: x };
                    push(format!("{m}.experts.{x}.gate_proj.weight"), vec![i, h], role);
                    push(format!("{m}.experts.{x}.up_proj.weight"), vec![i, h], role);
                    push(format!("{m}.experts.{x}.down_proj.weight"), vec![h, i], role);
                }
                let s = moe.shared_intermediate_size;
                if s > 0 {
                    push(format!("{m}.shared_experts.gate_proj.weight"), vec![s, h], TensorRole::SharedExpert);
                    push(format!("{m}.shared_experts.up_proj.weight"), vec![s, h], TensorRole::SharedExpert);
                    push(format!("{m}.shared_experts.down_proj.weight"), vec![h, s], TensorRole::SharedExpert);
                }
            }
        }
    }
    push("model.norm.weight".into(), vec![h], TensorRole::Norm);
    if !spec.tie_word_embeddings {
        push("lm_head.weight".into(), vec![spec.vocab_size, h], TensorRole::LmHead);
    }
    out
}

/// The names of the tensors `spec` needs that `source` lacks, in inventory order.
pub fn missing_tensors(spec: &ModelSpec, source: &dyn WeightSource) -> Vec<String> {
    expected_tensors(spec).into_iter().map(|t| t.name).filter(|n| !source.contains(n)).collect()
}

/// Parameter counts: total, and active per token (routed experts counted `top_k` times per MoE layer).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ParamCounts {
    pub total: u64,
    pub active: u64,
    pub routed_expert: u64,
    /// Parameters of one routed expert (gate + up + down).
    pub per_expert: u64,
}

pub fn param_counts(spec: &ModelSpec) -> ParamCounts {
    let mut c = ParamCounts::default();
    for t in expected_tensors(spec) {
        let n = t.numel() as u64;
        c.total += n;
        match t.role {
            TensorRole::RoutedExpert { .. } => c.routed_expert += n,
            TensorRole::Embedding => {} // a gather, not a matmul: one row per token
            _ => c.active += n,
        }
    }
    if let Some(moe) = &spec.moe {
        let i = moe.moe_intermediate_size as u64;
        c.per_expert = 3 * i * spec.hidden_size as u64;
        let moe_layers = spec.moe_layers().count() as u64;
        c.active += moe_layers * moe.routing.top_k as u64 * c.per_expert;
    }
    c.active += spec.hidden_size as u64;
    c
}
