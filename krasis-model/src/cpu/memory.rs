//! Memory arithmetic: bytes per expert in each storage format and the resident-set estimate
//! used by the budget check and `krasis info`.

use krasis_quant::group::DEFAULT_GROUP_SIZE;

use krasis_core::DType;

use crate::cpu::dense_cache::{planned_entries, PlannedKind};
use crate::cpu::quantized::{dense_quant_bits, expected_cache_header};
use crate::model::tensors::{expected_tensors, is_matrix, TensorRole, TensorSpec};
use crate::placement::precision::{expert_width_rule, resolve_expert_bits};
use crate::source::WeightSource;
use crate::spec::{ModelSpec, SourceQuant};

pub use crate::cpu::quantized::WeightBits;

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

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryEstimate {
    /// Everything the engine holds outside the routed experts once loaded: dense linears (as
    /// stored, or their quantised pages), norms and `kv_b_proj` in f32, routers as stored, an
    /// embedding held whole.
    pub dense_bytes: u64,
    /// The routed experts: the expert cache's records (page-rounded), or the source weights.
    pub expert_bytes: u64,
    /// KV cache per token of context (f32 reference cache).
    pub kv_bytes_per_token: u64,
    /// Embedding pages a token brings in when the embedding is read through the file mapping
    /// (its row, and the page it straddles), up to `embed_mapped_bytes`; 0 when it is held whole.
    pub embed_bytes_per_token: u64,
    /// The mapped embedding's size: all of it is resident once every row has been used.
    pub embed_mapped_bytes: u64,
    /// The process itself: code, libraries, tokenizer, allocator arenas, thread stacks.
    pub process_bytes: u64,
}

impl MemoryEstimate {
    /// The weights alone: dense plus routed experts (what the page-size warnings of
    /// `krasis_core::hw::SystemReport::warnings` weigh).
    pub fn weight_bytes(&self) -> u64 {
        self.dense_bytes + self.expert_bytes
    }

    pub fn total(&self, context_tokens: u64) -> u64 {
        self.dense_bytes
            + self.expert_bytes
            + self.process_bytes
            + self.kv_bytes_per_token * context_tokens
            + (self.embed_bytes_per_token * context_tokens).min(self.embed_mapped_bytes)
    }
}

/// Resident bytes of a `krasis generate` process besides weights, KV and tokenizer: code,
/// libraries, allocator arenas, worker threads (measured: the tiny preset's 15.3–16.5 MiB RSS
/// less its ~3.5 MiB of caches, f32 copies and tokenizer; docs/BENCHMARKS.md).
pub const PROCESS_BYTES: u64 = 12 << 20;

/// Tokenizer bytes per vocabulary entry once loaded (vocabulary, merges, added-token tables:
/// measured ≈ 190 B on synthetic V2-Lite's 102 400 entries).
pub const TOKENIZER_BYTES_PER_TOKEN: u64 = 192;

/// Page size the resident set is counted in.
const PAGE: u64 = 4096;

/// Resident estimate of the CPU reference path with experts in `format` (dense weights as
/// stored): see [`cpu_estimate`].
pub fn estimate(spec: &ModelSpec, format: WeightBits) -> MemoryEstimate {
    cpu_estimate(spec, None, format, WeightBits::Bf16, DEFAULT_GROUP_SIZE)
}

/// What the CPU engine keeps resident (RSS) at these precisions, counted the way the engine
/// holds each tensor once loaded (the source mapping's pages are released after loading):
///
/// - routed experts quantised: the expert cache's records, page-rounded, exactly; as stored
///   (bf16): the source bytes, read through the mapping;
/// - dense linears quantised: the dense-weight cache's entries, page-rounded, exactly; as
///   stored: the source bytes;
/// - norms, router biases and MLA's `kv_b_proj`: f32 copies; routers: as stored (read through
///   the mapping every token);
/// - the embedding: read through the mapping a row per token, unless the engine holds it whole
///   (an LM head tied to it and left unquantised reads all of it; a source that dequantises it
///   on read gives f32);
/// - [`PROCESS_BYTES`], the tokenizer ([`TOKENIZER_BYTES_PER_TOKEN`]) and the KV cache per token.
///
/// `source` gives the stored dtypes (what is read as f32 costs 4 bytes a weight); without it, a
/// 2-byte dtype is assumed (FP8 checkpoints: matrices dequantised to f32).
pub fn cpu_estimate(
    spec: &ModelSpec,
    source: Option<&dyn WeightSource>,
    experts: WeightBits,
    dense: WeightBits,
    group: usize,
) -> MemoryEstimate {
    let experts = resolve_expert_bits(spec, experts);
    let held = |t: &TensorSpec| -> u64 {
        let per = match source.and_then(|s| s.stored_dtype(&t.name)) {
            Some(DType::BF16 | DType::F16) => 2,
            Some(_) => 4,
            None if matches!(spec.source_quant, SourceQuant::Fp8Block { .. }) && is_matrix(t) => 4,
            None => 2,
        };
        t.numel() as u64 * per
    };
    let process_bytes = PROCESS_BYTES + spec.vocab_size as u64 * TOKENIZER_BYTES_PER_TOKEN;
    let mut est = MemoryEstimate { process_bytes, ..MemoryEstimate::default() };
    let entries = planned_entries(spec).unwrap_or_default();
    let dense_quant = dense_quant_bits(dense).ok().flatten().filter(|_| !entries.is_empty());
    let mut lm_head_whole = false;
    // `kv_b` is in f32 unless the dense-weight cache holds it packed.
    let mut kv_b_packed = false;
    for p in &entries {
        let kv_b = matches!(p.kind, PlannedKind::KvB { .. });
        let bytes = match dense_quant.map(|bits| p.shape(bits, group)) {
            Some(Ok(Some(s))) => {
                kv_b_packed |= kv_b;
                (s.bytes as u64).div_ceil(PAGE) * PAGE
            }
            // kv_b left in f32: counted with the tensors below.
            _ if kv_b => 0,
            _ => p.tensors().iter().map(|t| held(t)).sum(),
        };
        // A tied LM head left as stored reads the whole embedding (its pages, counted here).
        lm_head_whole |= p.tensors().iter().any(|t| t.role == TensorRole::LmHead)
            && spec.tie_word_embeddings
            && dense_quant.is_none();
        est.dense_bytes += bytes;
    }
    let mut routed = 0u64;
    for t in expected_tensors(spec) {
        let n = t.numel() as u64;
        match t.role {
            TensorRole::RoutedExpert { .. } => routed += held(&t),
            TensorRole::Norm | TensorRole::RouterBias => est.dense_bytes += n * 4,
            TensorRole::Router => est.dense_bytes += held(&t),
            TensorRole::Attention if t.name.ends_with("kv_b_proj.weight") && !kv_b_packed => est.dense_bytes += n * 4,
            TensorRole::Embedding => {
                let whole = held(&t);
                let mapped =
                    source.and_then(|s| s.stored_dtype(&t.name)).is_none_or(|d| matches!(d, DType::BF16 | DType::F16));
                if lm_head_whole {
                    // The same mapped pages as the LM head, counted with the linears.
                } else if !mapped {
                    est.dense_bytes += whole;
                } else {
                    let row = whole / spec.vocab_size.max(1) as u64;
                    est.embed_bytes_per_token = (row.div_ceil(PAGE) + 1) * PAGE;
                    est.embed_mapped_bytes = whole.div_ceil(PAGE) * PAGE;
                }
            }
            // The linears, counted above.
            _ => {}
        }
    }
    est.expert_bytes = match expert_width_rule(experts)
        .and_then(|b| expected_cache_header(spec, 0, &b.layer_bits(spec), group).ok())
    {
        Some(h) => krasis_cache::format::records_bytes(&h).unwrap_or(0),
        None => routed,
    };
    let per_layer = match spec.attention {
        crate::spec::AttentionSpec::Mla { kv_lora_rank, qk_rope_head_dim, .. } => kv_lora_rank + qk_rope_head_dim,
        crate::spec::AttentionSpec::Gqa { kv_heads, head_dim, .. } => 2 * kv_heads * head_dim,
    };
    est.kv_bytes_per_token = (per_layer * spec.num_layers * 4) as u64;
    est
}
