//! `ModelSpec`: a model's architecture as a per-layer plan (attention kind, routing rule, RoPE
//! pairing, FFN kind per layer, source quantisation). The only place where architecture names
//! appear: krasis-model parses configs into it, the CPU and GPU crates take its rule types directly
//! (no mirror enums), and nothing downstream matches on model names.

/// Supported architectures. Kimi-K2 and K2-Thinking (`model_type` `kimi_k2`) and the text model
/// of Kimi-K2.5 (`kimi_k25`, nested in `text_config`) are [`Arch::DeepseekV3`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    DeepseekV2,
    DeepseekV3,
    Qwen3Moe,
    /// Mixtral (`MixtralForCausalLM`): GQA without qk-norm, softmax top-k renormalised, every
    /// layer MoE, the `block_sparse_moe` tensor names.
    Mixtral,
    /// GLM-4.5 / 4.6 / 4.7 (`Glm4MoeForCausalLM`): GQA with q/k/v biases, partial rotary and
    /// optional qk-norm; dense first layers, then MoE with sigmoid routing, groups and a
    /// correction bias (DeepSeek-V3's rule) and shared experts.
    Glm4Moe,
    /// Qwen3-Next (`Qwen3NextForCausalLM`: Qwen3-Next-80B-A3B, Qwen3-Coder-Next): gated-DeltaNet
    /// linear-attention layers interleaved with gated full attention, every layer MoE with a
    /// sigmoid-gated shared expert, zero-centred `(1 + w)` norms.
    Qwen3Next,
    /// Qwen3.5 / 3.6 MoE (`qwen3_5_moe`): Qwen3-Next's layers in a vision-language wrapper, with
    /// the DeltaNet projections stored apart and the routed experts fused per layer.
    Qwen35Moe,
    /// Qwen2-MoE (`Qwen2MoeForCausalLM`: Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): GQA with q/k/v
    /// biases, softmax routing, a shared expert scaled by a sigmoid gate, optional dense layers.
    Qwen2Moe,
    /// MiniMax-M2 (`MiniMaxM2ForCausalLM`): GQA with a qk-norm over the whole q and k
    /// projections and partial rotary; every layer MoE with sigmoid routing and a correction
    /// bias (no groups), the `block_sparse_moe` tensor names.
    MiniMaxM2,
    /// gpt-oss (`GptOssForCausalLM`: gpt-oss-20b, gpt-oss-120b): GQA with biases on q/k/v/o,
    /// attention sinks and sliding-window layers alternating with full ones; every layer MoE,
    /// the router a linear with a bias whose top-k logits take a softmax, experts with biases
    /// and a clamped SwiGLU, published with MXFP4 experts.
    GptOss,
}

impl Arch {
    /// The `model_type` values of `config.json` Krasis reads.
    pub const SUPPORTED: &'static [&'static str] = &[
        "deepseek_v2",
        "deepseek_v3",
        "qwen3_moe",
        "mixtral",
        "glm4_moe",
        "qwen3_next",
        "qwen3_5_moe",
        "qwen2_moe",
        "minimax_m2",
        "gpt_oss",
        "kimi_k2",
        "kimi_k25",
    ];

    pub fn model_type(self) -> &'static str {
        match self {
            Arch::DeepseekV2 => "deepseek_v2",
            Arch::DeepseekV3 => "deepseek_v3",
            Arch::Qwen3Moe => "qwen3_moe",
            Arch::Mixtral => "mixtral",
            Arch::Glm4Moe => "glm4_moe",
            Arch::Qwen3Next => "qwen3_next",
            Arch::Qwen35Moe => "qwen3_5_moe",
            Arch::Qwen2Moe => "qwen2_moe",
            Arch::MiniMaxM2 => "minimax_m2",
            Arch::GptOss => "gpt_oss",
        }
    }
}

/// How the two halves of a rotary pair are laid out in a head vector.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopePairing {
    /// Pairs are adjacent elements (2i, 2i+1): DeepSeek checkpoints (`rope_interleave`).
    Interleaved,
    /// Pairs are (i, i + d/2): the `rotate_half` convention of Llama/Qwen.
    Halves,
}

#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    None,
    Linear {
        factor: f64,
    },
    Yarn {
        factor: f64,
        original_max_position_embeddings: f64,
        beta_fast: f64,
        beta_slow: f64,
        mscale: Option<f64>,
        mscale_all_dim: Option<f64>,
        attention_factor: Option<f64>,
        truncate: bool,
    },
}

#[derive(Clone, Debug, PartialEq)]
pub struct RopeSpec {
    pub theta: f64,
    /// Number of rotated dimensions per head: MLA's rope part, or the first `dim` elements of
    /// each GQA head (`dim < head_dim` is partial rotary, as GLM-4.5's `partial_rotary_factor`;
    /// the pairs lie within those `dim` elements, the rest of the head is not rotated).
    pub dim: usize,
    pub pairing: RopePairing,
    pub scaling: RopeScaling,
}

#[derive(Clone, Debug, PartialEq)]
pub enum AttentionSpec {
    /// Multi-head latent attention (DeepSeek V2/V3).
    Mla {
        heads: usize,
        q_lora_rank: Option<usize>,
        kv_lora_rank: usize,
        qk_nope_head_dim: usize,
        qk_rope_head_dim: usize,
        v_head_dim: usize,
    },
    /// Grouped-query attention, optionally with RMSNorm on q and k ([`QkNorm`]: per head as
    /// Qwen3 and GLM-4.5, over the whole projection as MiniMax-M2), with biases on its
    /// projections (GLM-4.5: q/k/v) and with an output gate (Qwen3-Next: `q_proj` yields, per
    /// head, the query and then a gate of the same width; the attention output is multiplied by
    /// σ(gate) before `o_proj`).
    Gqa { heads: usize, kv_heads: usize, head_dim: usize, qk_norm: QkNorm, bias: AttnBias, output_gate: bool },
}

/// GQA's RMSNorm of q and k after their projections (and biases), before RoPE: one option of the
/// one GQA op on each device. The norm's extent is its weight's length (the op normalises each
/// run of that many values).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QkNorm {
    None,
    /// Each head alone: `q_norm` and `k_norm` are `[head_dim]` (Qwen3, GLM-4.5, Qwen3-Next).
    PerHead,
    /// The whole projection of a token before the head split: `q_norm` is
    /// `[heads · head_dim]`, `k_norm` `[kv_heads · head_dim]` (MiniMax-M2's `qk_norm_type`
    /// `per_layer`).
    Whole,
}

impl QkNorm {
    /// Whether q and k are normalised.
    pub fn on(self) -> bool {
        self != QkNorm::None
    }
}

/// What mixes tokens in a layer: attention (the model's [`AttentionSpec`]) or a gated-DeltaNet
/// linear-attention layer ([`DeltaNetSpec`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MixerKind {
    Attention,
    GatedDeltaNet,
}

/// A gated-DeltaNet layer's geometry (Qwen3-Next, Qwen3.5): `key_heads` heads of `key_dim` for q
/// and k, `value_heads` heads of `value_dim` for v (a multiple of the key heads: each key head
/// serves `value_heads / key_heads` consecutive value heads), and a depthwise causal convolution
/// of `conv_kernel` taps over the q, k and v channels. The state is `[key_dim, value_dim]` per
/// value head, whatever the context length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeltaNetSpec {
    pub key_heads: usize,
    pub value_heads: usize,
    pub key_dim: usize,
    pub value_dim: usize,
    pub conv_kernel: usize,
}

impl DeltaNetSpec {
    /// Width of the q and of the k channels (all key heads).
    pub fn key_width(&self) -> usize {
        self.key_heads * self.key_dim
    }

    /// Width of the v channels and of the output (all value heads).
    pub fn value_width(&self) -> usize {
        self.value_heads * self.value_dim
    }

    /// Channels of the convolution: q, k and v.
    pub fn conv_channels(&self) -> usize {
        2 * self.key_width() + self.value_width()
    }

    /// Floats of one sequence's convolution state in one layer: the last `conv_kernel − 1`
    /// inputs of every channel.
    pub fn conv_state_len(&self) -> usize {
        self.conv_kernel.saturating_sub(1) * self.conv_channels()
    }

    /// Floats of one sequence's rule state in one layer: `[key_dim, value_dim]` per value head.
    pub fn rule_state_len(&self) -> usize {
        self.value_heads * self.key_dim * self.value_dim
    }
}

/// Which projections of an attention layer add a bias after the matrix product (one option of
/// the one GQA op on each device, not a separate attention).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AttnBias {
    /// `q_proj`, `k_proj` and `v_proj` have biases (`attention_bias` of GLM-4.5, Qwen2).
    pub qkv: bool,
    /// `o_proj` has a bias (gpt-oss).
    pub o: bool,
}

impl AttnBias {
    /// No biases.
    pub const NONE: AttnBias = AttnBias { qkv: false, o: false };
}

/// MLA's per-head geometry, as the attention kernels use it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MlaDims {
    pub heads: usize,
    /// Non-rotary query/key dimensions per head.
    pub nope: usize,
    /// Rotary query/key dimensions per head (shared rotary key).
    pub rope: usize,
    pub v_dim: usize,
    /// Latent (compressed KV) rank.
    pub latent: usize,
}

impl AttentionSpec {
    /// MLA's geometry (`None` for GQA).
    pub fn mla_dims(&self) -> Option<MlaDims> {
        match *self {
            AttentionSpec::Mla { heads, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, .. } => {
                Some(MlaDims {
                    heads,
                    nope: qk_nope_head_dim,
                    rope: qk_rope_head_dim,
                    v_dim: v_head_dim,
                    latent: kv_lora_rank,
                })
            }
            AttentionSpec::Gqa { .. } => None,
        }
    }

    pub fn heads(&self) -> usize {
        match self {
            AttentionSpec::Mla { heads, .. } | AttentionSpec::Gqa { heads, .. } => *heads,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScoringFunc {
    Softmax,
    Sigmoid,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TopkMethod {
    /// Plain top-k over the scores.
    Greedy,
    /// Keep the `topk_group` groups with the highest max score, then top-k (DeepSeek-V2).
    GroupLimitedGreedy { n_group: usize, topk_group: usize },
    /// Scores plus `e_score_correction_bias` choose; groups ranked by their top-2 sum (DeepSeek-V3).
    NoauxTc { n_group: usize, topk_group: usize },
}

/// How the router turns logits into (expert, weight) pairs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RoutingRule {
    pub scoring: ScoringFunc,
    pub topk: TopkMethod,
    pub top_k: usize,
    pub norm_topk_prob: bool,
    pub routed_scaling_factor: f32,
}

#[derive(Clone, Debug, PartialEq)]
pub struct MoeSpec {
    pub n_routed_experts: usize,
    pub moe_intermediate_size: usize,
    /// Intermediate size of the fused shared expert (0 when there is none).
    pub shared_intermediate_size: usize,
    /// The shared expert's output is scaled per token by σ(x · w) of a one-row gate
    /// `shared_expert_gate` `[1, hidden]` over the block's input x (Qwen2-MoE, Qwen3-Next);
    /// otherwise it is added as it is.
    pub shared_gate: bool,
    pub routing: RoutingRule,
    /// How the checkpoint names the router and the routed experts.
    pub naming: ExpertNaming,
}

/// The tensor names of a MoE block in a family's checkpoints (only the names differ; the
/// weights are the same gated MLPs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertNaming {
    /// `mlp.gate.weight`, `mlp.experts.E.{gate,up,down}_proj.weight`, the shared experts
    /// `mlp.shared_experts.*` (DeepSeek, Qwen3, GLM).
    Mlp,
    /// As [`ExpertNaming::Mlp`], with one shared expert `mlp.shared_expert.*` and its gate
    /// `mlp.shared_expert_gate.weight` (Qwen2-MoE, Qwen3-Next).
    MlpSharedExpert,
    /// `block_sparse_moe.gate.weight`, `block_sparse_moe.experts.E.{w1,w3,w2}.weight`
    /// (gate, up, down: Mixtral, MiniMax).
    BlockSparse,
    /// `mlp.router.weight` with its logit bias `mlp.router.bias`, the routed experts
    /// `mlp.experts.E.{gate,up,down}_proj` (gpt-oss, whose checkpoints fuse the experts per layer:
    /// krasis-model's stored-layout adapter serves them by these names).
    Router,
}

/// The activation of the routed experts' gated MLPs (an option of the expert kernels and their
/// scalar twins).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum ExpertActivation {
    /// `silu(gate) · up`.
    #[default]
    Silu,
    /// gpt-oss's clamped SwiGLU: `g = min(gate, limit)`, `u = clamp(up, −limit, limit)`, the
    /// output `(u + 1) · g · σ(alpha · g)` (no lower clamp on the gate).
    ClampedSwiglu { alpha: f32, limit: f32 },
}

impl ExpertActivation {
    /// The activation of one gate and up value.
    #[inline]
    pub fn apply(self, gate: f32, up: f32) -> f32 {
        match self {
            ExpertActivation::Silu => gate / (1.0 + (-gate).exp()) * up,
            ExpertActivation::ClampedSwiglu { alpha, limit } => {
                let g = gate.min(limit);
                let u = up.clamp(-limit, limit);
                (u + 1.0) * (g / (1.0 + (-alpha * g).exp()))
            }
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum FfnKind {
    Dense { intermediate_size: usize },
    Moe,
}

/// Weight-quantisation scheme the checkpoint ships with.
#[derive(Clone, Debug, PartialEq)]
pub enum SourceQuant {
    None,
    /// FP8 E4M3 weights with one f32 `weight_scale_inv` per block (DeepSeek-V3, Kimi-K2).
    Fp8Block {
        block_rows: usize,
        block_cols: usize,
    },
    /// compressed-tensors `pack-quantized` INT4 (Kimi-K2-Thinking, Kimi-K2.5): the quantised
    /// linears store `weight_packed` (int32 words of eight 4-bit codes along the input dimension,
    /// the first element in the least significant nibble, each code `q + 8` for `q` in
    /// `[-8, 7]`), `weight_scale` (one scale per `group_size` inputs of a row) and `weight_shape`
    /// (`[out, in]`) instead of `weight`; symmetric (no zero point), `w = q · scale`. The other
    /// tensors keep their plain `weight`.
    CompressedInt4 {
        group_size: usize,
    },
    /// NVIDIA ModelOpt NVFP4 (`quant_method` `modelopt`, `quant_algo` `NVFP4`): a quantised
    /// linear `P` stores `P.weight` as uint8 `[out, in/2]` (two E2M1 codes per byte, element 2j in
    /// the low nibble), `P.weight_scale` float8_e4m3fn `[out, in/16]`, `P.weight_scale_2` (f32
    /// scalar) and `P.input_scale` (f32 scalar, unused): `w = E2M1 · weight_scale ·
    /// weight_scale_2`. The other tensors keep their plain `weight` (see `krasis_quant::fp4`).
    ModelOptNvfp4,
    /// OpenAI MXFP4 (`quant_method` `mxfp4`, gpt-oss): E2M1 codes with an E8M0 scale per 32 in
    /// `*_blocks` / `*_scales` tensors (see `krasis_quant::fp4`).
    Mxfp4,
}

impl SourceQuant {
    /// The group size of weights stored group-quantised to INT4 (compressed-tensors), if any.
    pub fn stored_int4_group(&self) -> Option<usize> {
        match *self {
            SourceQuant::CompressedInt4 { group_size } => Some(group_size),
            SourceQuant::None | SourceQuant::Fp8Block { .. } | SourceQuant::ModelOptNvfp4 | SourceQuant::Mxfp4 => None,
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct ModelSpec {
    pub arch: Arch,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub rms_norm_eps: f32,
    pub tie_word_embeddings: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    pub max_position_embeddings: usize,
    pub attention: AttentionSpec,
    pub rope: RopeSpec,
    /// Softmax scale of attention scores (includes YaRN's mscale² for DeepSeek).
    pub softmax_scale: f32,
    pub moe: Option<MoeSpec>,
    pub layers: Vec<FfnKind>,
    /// Each layer's token mixer, `num_layers` long: attention everywhere except in hybrid
    /// linear-attention models, whose DeltaNet layers are described by `delta_net`.
    pub mixers: Vec<MixerKind>,
    pub delta_net: Option<DeltaNetSpec>,
    /// The model's RMSNorm weights are stored zero-centred: a norm scales by `1 + w` (Qwen3-Next,
    /// Qwen3.5: the layer norms, the final norm and q/k norms; not the DeltaNet output norm).
    pub norm_plus_one: bool,
    pub source_quant: SourceQuant,
    /// Per MoE layer, in `moe_layers()` order: the code bits of the stored routed-expert
    /// projections `[gate, up, down]` where the weights carry a type per tensor (a GGUF: 4 for
    /// Q4_K, 6 for Q6_K, 16 for BF16); empty for checkpoints without one (safetensors).
    /// `--cpu-expert-bits auto` chooses each projection's width from it.
    pub expert_source_bits: Vec<[u32; 3]>,
    /// Beside [`ModelSpec::expert_source_bits`], the ggml type ids of those projections (a GGUF:
    /// 12 for Q4_K, 14 for Q6_K, …), which tell `auto` which blocks it keeps as stored; empty
    /// where the weights carry no type per tensor.
    pub expert_source_types: Vec<[u32; 3]>,
    /// Each layer's attention window, `num_layers` long or empty (every layer full): `Some(w)`
    /// lets the query at position `p` see the keys `p − w < j ≤ p` (gpt-oss's
    /// `sliding_attention` layers), `None` every key up to its own position.
    pub sliding_windows: Vec<Option<usize>>,
    /// GQA layers hold one learned sink logit per query head (`self_attn.sinks`): an extra
    /// softmax column that takes its share of the probability and is dropped (gpt-oss).
    pub attention_sinks: bool,
    /// The routed experts' activation ([`ExpertActivation::Silu`] but for gpt-oss).
    pub expert_activation: ExpertActivation,
    /// Each routed expert's gate, up and down projections add a bias (gpt-oss); a router of such
    /// a model is a linear with a bias added to its logits.
    pub expert_bias: bool,
}

impl ModelSpec {
    pub fn moe_layers(&self) -> impl Iterator<Item = usize> + '_ {
        self.layers.iter().enumerate().filter(|(_, k)| matches!(k, FfnKind::Moe)).map(|(i, _)| i)
    }

    /// Whether layer `l` is a gated-DeltaNet layer.
    pub fn is_delta_net(&self, l: usize) -> bool {
        self.mixers.get(l) == Some(&MixerKind::GatedDeltaNet)
    }

    /// Layer `l`'s sliding attention window (`None`: full attention).
    pub fn window(&self, l: usize) -> Option<usize> {
        self.sliding_windows.get(l).copied().flatten()
    }

    /// Routed experts per MoE layer (0 for a dense model).
    pub fn routed_experts(&self) -> usize {
        self.moe.as_ref().map_or(0, |m| m.n_routed_experts)
    }
}

/// Precision of a class of weights as an engine runs them, the one option type for a weight
/// width: the source weights unquantised (`Bf16`: the reference path on the CPU, BF16 on the GPU),
/// or INT8 / INT4 group-quantised, or (routed experts only) `Auto`: the default width, chosen
/// from the source (`krasis_model::precision` holds the rules: on the CPU per projection from the
/// source's own types, on the GPU the source's width when it is 8-bit, else INT4).
/// `Int4Asym` (routed experts on the CPU only) is asymmetric INT4 in groups of 32: a scale and a
/// minimum per group (`krasis_quant::int4_asym`, 5.0 bits per weight).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightBits {
    Bf16,
    Int8,
    Int4,
    Int4Asym,
    Auto,
}

impl WeightBits {
    /// The values `--cpu-dense-bits` takes.
    pub const FLAG_VALUES: [&'static str; 3] = ["bf16", "8", "4"];
    /// The values `--cpu-expert-bits` takes.
    pub const EXPERT_FLAG_VALUES: [&'static str; 5] = ["auto", "bf16", "8", "4", "4a"];
    /// The values `--gpu-expert-bits` and `--cpu-dense-bits` take (no `4a`: the GPU kernels and
    /// the dense weights hold no minimums).
    pub const SYMMETRIC_FLAG_VALUES: [&'static str; 4] = ["auto", "bf16", "8", "4"];

    /// Integer bits per weight, `None` for the unquantised source weights and for `Auto`
    /// (decided per projection).
    pub fn int_bits(self) -> Option<u8> {
        match self {
            WeightBits::Bf16 | WeightBits::Auto => None,
            WeightBits::Int8 => Some(8),
            WeightBits::Int4 | WeightBits::Int4Asym => Some(4),
        }
    }

    pub fn flag_value(self) -> &'static str {
        match self {
            WeightBits::Bf16 => "bf16",
            WeightBits::Int8 => "8",
            WeightBits::Int4 => "4",
            WeightBits::Int4Asym => "4a",
            WeightBits::Auto => "auto",
        }
    }
}

impl std::str::FromStr for WeightBits {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "bf16" => Ok(WeightBits::Bf16),
            "8" | "int8" => Ok(WeightBits::Int8),
            "4" | "int4" => Ok(WeightBits::Int4),
            "4a" | "int4a" | "int4-asym" => Ok(WeightBits::Int4Asym),
            "auto" => Ok(WeightBits::Auto),
            _ => Err(format!("unknown weight precision `{s}`: expected auto, bf16, 8, 4 or 4a")),
        }
    }
}

impl std::fmt::Display for WeightBits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.flag_value())
    }
}

#[cfg(test)]
mod tests {
    use super::WeightBits;

    #[test]
    fn int4_asym_is_a_cpu_expert_value_only() {
        for v in ["4a", "int4a", "INT4-asym"] {
            assert_eq!(v.parse::<WeightBits>().unwrap(), WeightBits::Int4Asym);
        }
        assert!(WeightBits::EXPERT_FLAG_VALUES.contains(&"4a"));
        assert!(!WeightBits::SYMMETRIC_FLAG_VALUES.contains(&"4a") && !WeightBits::FLAG_VALUES.contains(&"4a"));
    }

    #[test]
    fn weight_bits_flag_values_round_trip() {
        for v in WeightBits::EXPERT_FLAG_VALUES {
            let w: WeightBits = v.parse().unwrap();
            assert_eq!(w.flag_value(), v);
        }
        assert!("16".parse::<WeightBits>().is_err());
    }
}
