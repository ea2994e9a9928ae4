//! The presets: `config.json` contents of real model shapes (and one tiny one for tests).

use std::fmt;
use std::str::FromStr;

use serde_json::{json, Value};

/// A model shape `krasis synth` can generate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Preset {
    /// A DeepSeek-V2-style model that runs in seconds (vocab 512, hidden 256, 4 layers, 8 experts).
    Tiny,
    /// DeepSeek-V2-Lite exactly (15.7 B parameters, ~31 GB of BF16).
    V2Lite,
    /// Qwen3-30B-A3B exactly (30.5 B parameters, ~61 GB of BF16).
    Qwen3_30bA3b,
    /// DeepSeek-V3 routing (noaux_tc, sigmoid, groups) and MLA with q_lora at reduced width.
    V3Mini,
    /// Mixtral-8x7B exactly (46.7 B parameters, ~93 GB of BF16; the published config, with the
    /// synthetic tokenizer's BOS 0 and EOS 1).
    Mixtral8x7b,
    /// GLM-4.5-Air's shapes (106 B parameters, ~213 GB of BF16): q/k/v biases, RoPE on half of
    /// each 128-dim head, one dense layer, 128 experts top-8 plus a shared one; its MTP layer is
    /// not written.
    Glm45Air,
    /// Qwen3-Next-80B-A3B's shapes (the published config, with the synthetic tokenizer's BOS 0 and
    /// EOS 1): 48 layers, three gated-DeltaNet layers to one gated full-attention layer, 512
    /// experts top-10 plus a gated shared expert. `layer_types` is written out, so that a trimmed
    /// model keeps both layer kinds.
    Qwen3Next80b,
    /// Qwen3.6-35B-A3B's text model in its published VL wrapper (`qwen3_5_moe`, `text_config`,
    /// tensors under `model.language_model.`): 40 layers (30 DeltaNet, 10 attention), 256 experts
    /// top-8 plus a gated shared expert. The experts are written per expert (the canonical
    /// layout, which Krasis reads as it reads the published fused one); no vision tower or MTP.
    Qwen36_35b,
    /// MiniMax-M2's shapes (the published config, with the synthetic tokenizer's BOS 0 and EOS 1;
    /// 229 B parameters, ~458 GB of BF16): 62 layers of GQA (48 / 8 heads of 128) with qk-norm
    /// over the whole q and k projections and RoPE on 64 of each head's 128 dims, 256 experts
    /// top-8 by sigmoid with a correction bias, no shared expert. Written in BF16 (the published
    /// checkpoint stores FP8 128×128 blocks; `--config` with its config.json writes that form);
    /// its MTP modules are not written.
    MiniMaxM2,
    /// gpt-oss-120b's shapes (the published config, with the synthetic tokenizer's BOS 0 and EOS
    /// 1; 117 B parameters): 36 layers of GQA (64 / 8 heads of 64) with biases and sinks,
    /// sliding-window (128) and full layers alternating, 128 experts top-4 with biases and the
    /// clamped SwiGLU, the routed experts in MXFP4 (`quantization_config` `mxfp4`, written fused
    /// per layer as OpenAI publishes them: `mlp.experts.gate_up_proj_blocks` / `_scales` /
    /// `_bias` and `down_proj_*`, which llama.cpp's converter reads), everything else BF16.
    /// `layer_types` is written out, so a trimmed model keeps the alternation.
    GptOss120b,
}

impl Preset {
    pub const ALL: [Preset; 10] = [
        Preset::Tiny,
        Preset::V2Lite,
        Preset::Qwen3_30bA3b,
        Preset::V3Mini,
        Preset::Mixtral8x7b,
        Preset::Glm45Air,
        Preset::Qwen3Next80b,
        Preset::Qwen36_35b,
        Preset::MiniMaxM2,
        Preset::GptOss120b,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Preset::Tiny => "tiny",
            Preset::V2Lite => "v2-lite",
            Preset::Qwen3_30bA3b => "qwen3-30b-a3b",
            Preset::V3Mini => "v3-mini",
            Preset::Mixtral8x7b => "mixtral-8x7b",
            Preset::Glm45Air => "glm-4.5-air",
            Preset::Qwen3Next80b => "qwen3-next-80b",
            Preset::Qwen36_35b => "qwen3.6-35b",
            Preset::MiniMaxM2 => "minimax-m2",
            Preset::GptOss120b => "gpt-oss-120b",
        }
    }

    /// The preset's full depth (`num_hidden_layers` without `--layers`).
    pub fn num_layers(self) -> usize {
        match self {
            Preset::Tiny => 4,
            Preset::V2Lite => 27,
            Preset::Qwen3_30bA3b => 48,
            Preset::V3Mini => 8,
            Preset::Mixtral8x7b => 32,
            Preset::Glm45Air => 46,
            Preset::Qwen3Next80b => 48,
            Preset::Qwen36_35b => 40,
            Preset::MiniMaxM2 => 62,
            Preset::GptOss120b => 36,
        }
    }

    /// Validate a layer-count override (`SynthOptions::layers`): `1..=num_layers()`. Returns the
    /// depth to generate.
    pub fn check_layers(self, layers: Option<usize>) -> crate::Result<usize> {
        let max = self.num_layers();
        match layers {
            None => Ok(max),
            Some(l) if (1..=max).contains(&l) => Ok(l),
            Some(l) => Err(crate::ModelError::Invalid(format!(
                "the layer count (`SynthOptions::layers`) {l} is out of range for preset {self}: it has {max} layers (allowed 1..={max})"
            ))),
        }
    }
}

impl fmt::Display for Preset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Preset {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Preset::ALL.into_iter().find(|p| p.name().eq_ignore_ascii_case(s)).ok_or_else(|| {
            let names: Vec<&str> = Preset::ALL.iter().map(|p| p.name()).collect();
            format!("unknown preset `{s}` (available: {})", names.join(", "))
        })
    }
}

/// DeepSeek's YaRN block (V2-Lite, V3).
fn deepseek_yarn() -> Value {
    json!({
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 0.707,
        "mscale_all_dim": 0.707
    })
}

/// The DeltaNet / full-attention pattern of `n` of a hybrid's `full` layers (every fourth full
/// attention), both kinds kept when the cut would drop one ([`super::layout::trimmed_layer_types`]).
fn hybrid_layer_types(full: usize, n: usize) -> Value {
    use crate::spec::MixerKind;
    let all: Vec<MixerKind> =
        (0..full).map(|l| if (l + 1) % 4 == 0 { MixerKind::Attention } else { MixerKind::GatedDeltaNet }).collect();
    Value::from(super::layout::trimmed_layer_types(&all, n))
}

/// The `config.json` of `preset`, with `num_hidden_layers` trimmed to `layers` when given.
///
/// `layers` is clamped into `1..=preset.num_layers()`; validate it first with
/// [`Preset::check_layers`] (which [`super::synthesize`] does) to report a bad value.
pub fn preset_config(preset: Preset, layers: Option<usize>) -> Value {
    let n = layers.unwrap_or(preset.num_layers()).clamp(1, preset.num_layers());
    match preset {
        Preset::Tiny => json!({
            "architectures": ["DeepseekV2ForCausalLM"],
            "model_type": "deepseek_v2",
            "vocab_size": 512,
            "hidden_size": 256,
            "intermediate_size": 512,
            "moe_intermediate_size": 128,
            "num_hidden_layers": n,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "n_shared_experts": 1,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "first_k_dense_replace": 1,
            "moe_layer_freq": 1,
            "kv_lora_rank": 64,
            "q_lora_rank": null,
            "qk_nope_head_dim": 32,
            "qk_rope_head_dim": 16,
            "v_head_dim": 32,
            "rope_theta": 10000,
            "rope_scaling": deepseek_yarn(),
            "max_position_embeddings": 163840,
            "rms_norm_eps": 1e-6,
            "topk_method": "greedy",
            "n_group": 1,
            "topk_group": 1,
            "norm_topk_prob": false,
            "routed_scaling_factor": 1.0,
            "scoring_func": "softmax",
            "hidden_act": "silu",
            "tie_word_embeddings": false,
            "attention_bias": false,
            "bos_token_id": 0,
            "eos_token_id": 1,
            "initializer_range": 0.02,
            "torch_dtype": "bfloat16",
            "use_cache": true
        }),
        Preset::V2Lite => json!({
            "architectures": ["DeepseekV2ForCausalLM"],
            "model_type": "deepseek_v2",
            "vocab_size": 102400,
            "hidden_size": 2048,
            "intermediate_size": 10944,
            "moe_intermediate_size": 1408,
            "num_hidden_layers": n,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "n_shared_experts": 2,
            "n_routed_experts": 64,
            "num_experts_per_tok": 6,
            "first_k_dense_replace": 1,
            "moe_layer_freq": 1,
            "kv_lora_rank": 512,
            "q_lora_rank": null,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "rope_theta": 10000,
            "rope_scaling": deepseek_yarn(),
            "max_position_embeddings": 163840,
            "rms_norm_eps": 1e-6,
            "topk_method": "greedy",
            "n_group": 1,
            "topk_group": 1,
            "norm_topk_prob": false,
            "routed_scaling_factor": 1.0,
            "scoring_func": "softmax",
            "aux_loss_alpha": 0.001,
            "seq_aux": true,
            "hidden_act": "silu",
            "tie_word_embeddings": false,
            "attention_bias": false,
            "attention_dropout": 0.0,
            "bos_token_id": 0,
            "eos_token_id": 1,
            "initializer_range": 0.02,
            "torch_dtype": "bfloat16",
            "use_cache": true
        }),
        Preset::Qwen3_30bA3b => json!({
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "vocab_size": 151936,
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "moe_intermediate_size": 768,
            "num_hidden_layers": n,
            "max_window_layers": n,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "norm_topk_prob": true,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "rope_theta": 1000000.0,
            "rope_scaling": null,
            "max_position_embeddings": 40960,
            "rms_norm_eps": 1e-6,
            "router_aux_loss_coef": 0.001,
            "output_router_logits": false,
            "hidden_act": "silu",
            "tie_word_embeddings": false,
            "attention_bias": false,
            "attention_dropout": 0.0,
            "use_sliding_window": false,
            "sliding_window": null,
            "bos_token_id": 0,
            "eos_token_id": 1,
            "initializer_range": 0.02,
            "torch_dtype": "bfloat16",
            "use_cache": true
        }),
        Preset::V3Mini => json!({
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            "vocab_size": 32000,
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "moe_intermediate_size": 512,
            "num_hidden_layers": n,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "n_shared_experts": 1,
            "n_routed_experts": 64,
            "num_experts_per_tok": 6,
            "first_k_dense_replace": 1,
            "moe_layer_freq": 1,
            "kv_lora_rank": 512,
            "q_lora_rank": 768,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "rope_theta": 10000,
            "rope_scaling": deepseek_yarn(),
            "max_position_embeddings": 163840,
            "rms_norm_eps": 1e-6,
            "topk_method": "noaux_tc",
            "n_group": 8,
            "topk_group": 4,
            "norm_topk_prob": true,
            "routed_scaling_factor": 2.5,
            "scoring_func": "sigmoid",
            "hidden_act": "silu",
            "tie_word_embeddings": false,
            "attention_bias": false,
            "attention_dropout": 0.0,
            "bos_token_id": 0,
            "eos_token_id": 1,
            "initializer_range": 0.02,
            "torch_dtype": "bfloat16",
            "use_cache": true
        }),
        Preset::Mixtral8x7b => json!({
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "vocab_size": 32000,
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": n,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "rope_theta": 1000000.0,
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-5,
            "sliding_window": null,
            "hidden_act": "silu",
            "tie_word_embeddings": false,
            "router_aux_loss_coef": 0.02,
            "output_router_logits": false,
            "attention_dropout": 0.0,
            "bos_token_id": 0,
            "eos_token_id": 1,
            "initializer_range": 0.02,
            "torch_dtype": "bfloat16",
            "use_cache": true
        }),
        Preset::Glm45Air => json!({
            "architectures": ["Glm4MoeForCausalLM"],
            "model_type": "glm4_moe",
            "vocab_size": 151552,
            "hidden_size": 4096,
            "intermediate_size": 10944,
            "moe_intermediate_size": 1408,
            "num_hidden_layers": n,
            "num_attention_heads": 96,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "partial_rotary_factor": 0.5,
            "attention_bias": true,
            "use_qk_norm": false,
            "n_routed_experts": 128,
            "n_shared_experts": 1,
            "num_experts_per_tok": 8,
            "first_k_dense_replace": 1,
            "n_group": 1,
            "topk_group": 1,
            "norm_topk_prob": true,
            "routed_scaling_factor": 1.0,
            "num_nextn_predict_layers": 0,
            "rope_theta": 1000000,
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5,
            "hidden_act": "silu",
            "tie_word_embeddings": false,
            "attention_dropout": 0.0,
            "bos_token_id": 0,
            "eos_token_id": 1,
            "initializer_range": 0.02,
            "torch_dtype": "bfloat16",
            "use_cache": true
        }),
        Preset::Qwen3Next80b => json!({
            "architectures": ["Qwen3NextForCausalLM"],
            "model_type": "qwen3_next",
            "vocab_size": 151936,
            "hidden_size": 2048,
            "intermediate_size": 5120,
            "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512,
            "num_hidden_layers": n,
            "layer_types": hybrid_layer_types(48, n),
            "full_attention_interval": 4,
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "head_dim": 256,
            "partial_rotary_factor": 0.25,
            "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 32,
            "num_experts": 512,
            "num_experts_per_tok": 10,
            "norm_topk_prob": true,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "rope_theta": 10000000,
            "max_position_embeddings": 262144,
            "rms_norm_eps": 1e-6,
            "hidden_act": "silu",
            "tie_word_embeddings": false,
            "attention_bias": false,
            "bos_token_id": 0,
            "eos_token_id": 1,
            "initializer_range": 0.02,
            "torch_dtype": "bfloat16",
            "use_cache": true
        }),
        Preset::Qwen36_35b => json!({
            "architectures": ["Qwen3_5MoeForConditionalGeneration"],
            "model_type": "qwen3_5_moe",
            "tie_word_embeddings": false,
            "text_config": {
                "model_type": "qwen3_5_moe_text",
                "vocab_size": 248320,
                "hidden_size": 2048,
                "moe_intermediate_size": 512,
                "shared_expert_intermediate_size": 512,
                "num_hidden_layers": n,
                "layer_types": hybrid_layer_types(40, n),
                "full_attention_interval": 4,
                "num_attention_heads": 16,
                "num_key_value_heads": 2,
                "head_dim": 256,
                "attn_output_gate": true,
                "linear_conv_kernel_dim": 4,
                "linear_key_head_dim": 128,
                "linear_value_head_dim": 128,
                "linear_num_key_heads": 16,
                "linear_num_value_heads": 32,
                "num_experts": 256,
                "num_experts_per_tok": 8,
                "rope_parameters": {
                    "mrope_interleaved": true,
                    "mrope_section": [11, 11, 10],
                    "partial_rotary_factor": 0.25,
                    "rope_theta": 10000000,
                    "rope_type": "default"
                },
                "max_position_embeddings": 262144,
                "rms_norm_eps": 1e-6,
                "hidden_act": "silu",
                "tie_word_embeddings": false,
                "attention_bias": false,
                "bos_token_id": 0,
                "eos_token_id": 1,
                "initializer_range": 0.02,
                "dtype": "bfloat16",
                "use_cache": true
            }
        }),
        Preset::MiniMaxM2 => json!({
            "architectures": ["MiniMaxM2ForCausalLM"],
            "model_type": "minimax_m2",
            "vocab_size": 200064,
            "hidden_size": 3072,
            "intermediate_size": 1536,
            "num_hidden_layers": n,
            "attn_type_list": vec![1; n],
            "num_attention_heads": 48,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "rotary_dim": 64,
            "rope_theta": 5000000,
            "qk_norm_type": "per_layer",
            "use_qk_norm": true,
            "num_local_experts": 256,
            "num_experts_per_tok": 8,
            "scoring_func": "sigmoid",
            "use_routing_bias": true,
            "shared_intermediate_size": 0,
            "use_mtp": false,
            "max_position_embeddings": 196608,
            "rms_norm_eps": 1e-6,
            "hidden_act": "silu",
            "tie_word_embeddings": false,
            "bos_token_id": 0,
            "eos_token_id": 1,
            "torch_dtype": "bfloat16",
            "use_cache": true
        }),
        Preset::GptOss120b => json!({
            "architectures": ["GptOssForCausalLM"],
            "model_type": "gpt_oss",
            "vocab_size": 201088,
            "hidden_size": 2880,
            "intermediate_size": 2880,
            "num_hidden_layers": n,
            "layer_types": (0..n)
                .map(|l| if l % 2 == 0 { "sliding_attention" } else { "full_attention" })
                .collect::<Vec<_>>(),
            "sliding_window": 128,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "attention_bias": true,
            "num_local_experts": 128,
            "num_experts_per_tok": 4,
            "experts_per_token": 4,
            "swiglu_limit": 7.0,
            "rope_theta": 150000,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": false,
                "original_max_position_embeddings": 4096
            },
            "initial_context_length": 4096,
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5,
            "router_aux_loss_coef": 0.9,
            "output_router_logits": false,
            "quantization_config": {
                "modules_to_not_convert": [
                    "model.layers.*.self_attn",
                    "model.layers.*.mlp.router",
                    "model.embed_tokens",
                    "lm_head"
                ],
                "quant_method": "mxfp4"
            },
            "hidden_act": "silu",
            "tie_word_embeddings": false,
            "attention_dropout": 0.0,
            "bos_token_id": 0,
            "eos_token_id": 1,
            "initializer_range": 0.02,
            "torch_dtype": "bfloat16",
            "use_cache": true
        }),
    }
}
