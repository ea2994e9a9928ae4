//! Memory arithmetic: bytes per expert in each storage format and the resident-set estimate
//! used by the budget check and `krasis info`.

use krasis_quant::group::DEFAULT_GROUP_SIZE;

use crate::precision::{resolve_expert_bits, CacheBits};
use crate::spec::{ModelSpec, SourceQuant};
use crate::tensors::{expected_tensors, TensorRole};

pub use crate::quantized::WeightBits;

/// How `krasis info` names a storage format.
pub fn format_name(w: WeightBits) -> &'static str {
    match w {
        WeightBits::Bf16 => "bf16",
        WeightBits::Int8 => "int8 g128",
        WeightBits::Int4 => "int4 g128",
        WeightBits::Auto => "auto g128",
    }
}

/// Bytes to store `params` weights (plus one 2-byte scale per group for the integer formats).
/// `Auto` counts the widest width it can choose (INT8), a bound; [`estimate`] counts the widths
/// it does choose.
pub fn stored_bytes(w: WeightBits, params: u64) -> u64 {
    let scales = params.div_ceil(DEFAULT_GROUP_SIZE as u64) * 2;
    match w {
        WeightBits::Bf16 => params * 2,
        WeightBits::Int8 | WeightBits::Auto => params + scales,
        WeightBits::Int4 => params.div_ceil(2) + scales,
    }
}

/// Bytes of every routed expert at `auto`'s per-layer, per-projection widths.
fn auto_expert_bytes(spec: &ModelSpec) -> u64 {
    let Some(moe) = &spec.moe else { return 0 };
    let (h, i, n) = (spec.hidden_size as u64, moe.moe_intermediate_size as u64, moe.n_routed_experts as u64);
    let at = |b: krasis_quant::Bits, params| {
        stored_bytes(if b == krasis_quant::Bits::Int4 { WeightBits::Int4 } else { WeightBits::Int8 }, params)
    };
    CacheBits::Auto.layer_bits(spec).iter().map(|b| n * (at(b.w13, 2 * i * h) + at(b.w2, h * i))).sum()
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryEstimate {
    /// Everything but the routed experts, as the reference path holds it.
    pub dense_bytes: u64,
    pub expert_bytes: u64,
    /// KV cache per token of context (f32 reference cache).
    pub kv_bytes_per_token: u64,
}

impl MemoryEstimate {
    pub fn total(&self, context_tokens: u64) -> u64 {
        self.dense_bytes + self.expert_bytes + self.kv_bytes_per_token * context_tokens
    }
}

/// Resident estimate of the CPU reference path: source weights as stored (FP8 is dequantised to
/// f32), MLA's `kv_b_proj` kept again in f32, experts in `format` (`auto` as
/// [`crate::precision`] resolves it for `spec`: per layer and projection on a GGUF).
pub fn estimate(spec: &ModelSpec, format: WeightBits) -> MemoryEstimate {
    let format = resolve_expert_bits(spec, format);
    let src_bytes_per_param: u64 = match spec.source_quant {
        SourceQuant::Fp8Block { .. } => 4,
        SourceQuant::None => 2,
    };
    let mut est = MemoryEstimate::default();
    let mut expert_params = 0u64;
    for t in expected_tensors(spec) {
        let n = t.numel() as u64;
        match t.role {
            TensorRole::RoutedExpert { .. } => expert_params += n,
            TensorRole::Norm | TensorRole::RouterBias => est.dense_bytes += n * 2,
            _ => est.dense_bytes += n * src_bytes_per_param,
        }
        if t.name.ends_with("kv_b_proj.weight") {
            est.dense_bytes += n * 4;
        }
    }
    est.expert_bytes = match (format, &spec.source_quant) {
        (WeightBits::Bf16, SourceQuant::Fp8Block { .. }) => expert_params * 4,
        (WeightBits::Auto, _) => auto_expert_bytes(spec),
        (f, _) => stored_bytes(f, expert_params),
    };
    let per_layer = match spec.attention {
        crate::spec::AttentionSpec::Mla { kv_lora_rank, qk_rope_head_dim, .. } => kv_lora_rank + qk_rope_head_dim,
        crate::spec::AttentionSpec::Gqa { kv_heads, head_dim, .. } => 2 * kv_heads * head_dim,
    };
    est.kv_bytes_per_token = (per_layer * spec.num_layers * 4) as u64;
    est
}
