//! Memory arithmetic: bytes per expert in each storage format and the resident-set estimate
//! used by the budget check and `krasis info`.

use krasis_quant::group::DEFAULT_GROUP_SIZE;

use krasis_core::DType;

use crate::cpu::dense_cache::{planned_entries, PlannedKind};
use crate::cpu::quantized::{dense_quant_bits, expected_cache_header};
use crate::model::tensors::{expected_tensors, is_matrix, TensorRole, TensorSpec};
use crate::placement::precision::{expert_width_rule, resolve_expert_bits, ExpertWidthRule};
use crate::source::WeightSource;
use crate::spec::{ModelSpec, SourceQuant};

pub use crate::cpu::quantized::WeightBits;

/// How `krasis info` names a storage format.
pub fn format_name(w: WeightBits) -> &'static str {
    match w {
        WeightBits::Bf16 => "bf16",
        WeightBits::Int8 => "int8 g128",
        WeightBits::Int4 => "int4 g128",
        WeightBits::Int4Asym => "int4a g32",
        // Per projection from the source (on a Q4_K_M GGUF: its blocks as stored, groups of 32).
        WeightBits::Auto => "auto",
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
        // A 2-byte scale and a 2-byte minimum per group of 32.
        WeightBits::Int4Asym => params.div_ceil(2) + params.div_ceil(32) * 4,
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryEstimate {
    /// Everything the engine holds outside the routed experts once loaded: dense linears (as
    /// stored, or their quantised pages), norms and `kv_b_proj` in f32, routers as stored, an
    /// embedding held whole (one the source produces on read; a mapped embedding is read from
    /// its file a row at a time and holds nothing).
    pub dense_bytes: u64,
    /// The routed experts: the expert cache's records (page-rounded), or the source weights.
    pub expert_bytes: u64,
    /// KV cache per token of context (f32 reference cache), over the attention layers.
    pub kv_bytes_per_token: u64,
    /// One sequence's recurrent state, whatever its length: every gated-DeltaNet layer's (f32
    /// convolution inputs and `[dk, dv]` per value head); 0 without such layers.
    pub sequence_state_bytes: u64,
    /// The process itself: code, libraries, tokenizer, allocator arenas, thread stacks.
    pub process_bytes: u64,
    /// Prefill on the BF16 tiles (`krasis_cpu::prefill_bf16`, quantised experts, prompts of at
    /// least its minimum length): its call buffers per token of the longest pass (each routed
    /// slot's activations and intermediate in BF16 and its output in f32). Kept after the pass
    /// while they hold at most [`MemoryEstimate::prefill_kept_max`], else freed.
    pub prefill_call_bytes_per_token: u64,
    /// The call buffers' padding (each expert's rows padded to whole tiles: half a tile on
    /// average per expert with tokens).
    pub prefill_call_pad_bytes: u64,
    /// `krasis_cpu::prefill_bf16::KEEP_BYTES` (0 when the BF16 tiles do not run).
    pub prefill_kept_max: u64,
    /// The workers' tile outputs per token of the longest pass over the quantised dense weights
    /// (together about one byte per output row of the largest packed dense matrix): they grow once
    /// and stay.
    pub prefill_tile_bytes_per_token: u64,
    /// Shortest pass that runs on the BF16 tiles.
    pub prefill_min_tokens: u64,
    /// MLA's decompressed prefill (passes of at least
    /// [`crate::cpu::attention::MLA_PREFILL_MIN_ROWS`] rows): bytes of the expanded key and value
    /// tile per key row (every head's `nope + rope + v_dim` floats); the calling thread keeps
    /// the tile, sized for the longest pass's keys (whole blocks of
    /// `krasis_cpu::mla_prefill::BLOCK_K`) up to [`MemoryEstimate::mla_tile_max_rows`].
    pub mla_tile_bytes_per_row: u64,
    /// `krasis_cpu::mla_prefill::tile_rows`: the most key rows a tile holds.
    pub mla_tile_max_rows: u64,
    /// MLA's per-call buffers (`q`, the latent rows and the output, f32) per token of the longest
    /// pass: kept after the pass while they hold at most `krasis_cpu::prefill_bf16::KEEP_BYTES`
    /// ([`crate::cpu::attention::trim_scratch`]), else freed.
    pub mla_scratch_bytes_per_token: u64,
}

impl MemoryEstimate {
    /// The weights alone: dense plus routed experts (what the page-size warnings of
    /// `krasis_core::hw::SystemReport::warnings` weigh).
    pub fn weight_bytes(&self) -> u64 {
        self.dense_bytes + self.expert_bytes
    }

    /// Resident after passes over `context_tokens` tokens, the longest pass a whole prompt of
    /// that length ([`MemoryEstimate::total_after`]).
    pub fn total(&self, context_tokens: u64) -> u64 {
        self.total_after(context_tokens, context_tokens)
    }

    /// Resident with `context_tokens` tokens in the KV cache after passes of at most
    /// `longest_pass` tokens (the prompt's prefill): weights, process, KV and the prefill
    /// scratch that stays ([`MemoryEstimate::prefill_kept_bytes`]).
    ///
    /// This is what the engine holds between passes, and what the RSS check after a run compares
    /// with (`runtime::Opened::rss_report_after`). It is not the peak: while a prefill runs it
    /// also holds that pass's f32 activations (a few rows of hidden and intermediate width per
    /// token, per layer in turn) and call buffers above their keep limit, all freed (and handed
    /// back to the OS) before the check reads the RSS. Those grow with the prompt and are not
    /// counted here; the peak of a long prompt is above this figure (v2-lite at two layers and
    /// 2048 tokens: 38 % above, bench/logs/2026-11-28/devvm-memory-estimate-s24.log).
    pub fn total_after(&self, context_tokens: u64, longest_pass: u64) -> u64 {
        self.dense_bytes
            + self.expert_bytes
            + self.process_bytes
            + self.sequence_state_bytes
            + self.kv_bytes_per_token * context_tokens
            + self.prefill_kept_bytes(longest_pass)
    }

    /// Prefill scratch still held after a pass of `tokens` tokens: the workers' tile outputs,
    /// and the call buffers when they fit [`MemoryEstimate::prefill_kept_max`]. (While the pass
    /// runs, the call buffers are held whatever their size, and the f32 activations besides.)
    pub fn prefill_kept_bytes(&self, tokens: u64) -> u64 {
        let scratch = self.mla_scratch_bytes_per_token * tokens;
        let mla = self.mla_tile_bytes(tokens)
            + if scratch <= krasis_cpu::prefill_bf16::KEEP_BYTES as u64 { scratch } else { 0 };
        if tokens < self.prefill_min_tokens.max(1) {
            return mla;
        }
        let call = self.prefill_call_pad_bytes + self.prefill_call_bytes_per_token * tokens;
        let call = if call <= self.prefill_kept_max { call } else { 0 };
        mla + call + self.prefill_tile_bytes_per_token * tokens.next_multiple_of(16)
    }

    /// MLA's expanded key/value tile after a pass of `tokens` tokens (0 below
    /// [`crate::cpu::attention::MLA_PREFILL_MIN_ROWS`], where passes stay absorbed).
    pub fn mla_tile_bytes(&self, tokens: u64) -> u64 {
        if tokens < crate::cpu::attention::MLA_PREFILL_MIN_ROWS as u64 {
            return 0;
        }
        let block = krasis_cpu::mla_prefill::BLOCK_K as u64;
        tokens.next_multiple_of(block).min(self.mla_tile_max_rows) * self.mla_tile_bytes_per_row
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
/// - norms, router biases and MLA's `kv_b_proj`: f32 copies; routers: copies as stored (read
///   whole every token, so not through the mapping, whose page-cache folio around them would
///   become resident);
/// - the embedding: nothing when it is mapped (rows are read from the file, not the mapping:
///   `DenseLinear::gather_row`), unless the engine holds it whole (an LM head tied to it and
///   left unquantised reads all of it; a source that dequantises it on read gives f32);
/// - [`PROCESS_BYTES`], the tokenizer ([`TOKENIZER_BYTES_PER_TOKEN`]) and the KV cache per token;
/// - the scratch a prompt's pass leaves behind, by the prompt's length
///   ([`MemoryEstimate::prefill_kept_bytes`]): the BF16 prefill's call buffers and tile outputs
///   (where the BF16 tiles run), MLA's per-call buffers and its expanded key/value tile.
///
/// `dense` `auto` counts the width the engine resolves it to (INT8).
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
    let dense = crate::placement::precision::resolve_dense_bits(dense);
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
            TensorRole::Norm
            | TensorRole::CentredNorm
            | TensorRole::MixerParam
            | TensorRole::RouterBias
            | TensorRole::Bias => est.dense_bytes += n * 4,
            TensorRole::Router => est.dense_bytes += held(&t),
            TensorRole::Attention if t.name.ends_with("kv_b_proj.weight") && !kv_b_packed => est.dense_bytes += n * 4,
            TensorRole::Embedding => {
                // Without a source, a checkpoint's embedding is mapped (safetensors).
                let mapped = source.is_none_or(|s| s.is_mapped(&t.name));
                if lm_head_whole {
                    // The same mapped pages as the LM head, counted with the linears.
                } else if !mapped {
                    est.dense_bytes += held(&t);
                }
                // Mapped: its rows are read from the file (`DenseLinear::gather_row`), so none of
                // its pages are resident.
            }
            // The linears, counted above.
            _ => {}
        }
    }
    est.expert_bytes = match expert_width_rule(experts).and_then(|b| match b {
        ExpertWidthRule::Int4Asym => crate::cpu::quantized::expected_int4_asym_cache_header(spec, 0).ok(),
        // A 4-bit float checkpoint at `auto`: its experts as stored (FP4 layout).
        ExpertWidthRule::Auto if crate::placement::precision::native_fp4(spec).is_some() => {
            let kind = crate::placement::precision::native_fp4(spec).expect("checked");
            crate::cpu::quantized::expected_fp4_cache_header(spec, 0, kind).ok()
        }
        // A GGUF whose expert blocks `auto` keeps as stored (Q4_K / Q6_K layouts, INT8 g32).
        ExpertWidthRule::Auto if crate::placement::precision::ggml_kept(spec).is_some() => {
            let kept = crate::placement::precision::ggml_kept(spec).expect("checked");
            crate::cpu::quantized::expected_ggml_cache_header(spec, 0, &kept).ok()
        }
        _ => expected_cache_header(spec, 0, &b.layer_bits(spec), group).ok(),
    }) {
        Some(h) => krasis_cache::format::records_bytes(&h).unwrap_or(0),
        None => routed,
    };
    let per_layer = match spec.attention {
        crate::spec::AttentionSpec::Mla { kv_lora_rank, qk_rope_head_dim, .. } => kv_lora_rank + qk_rope_head_dim,
        crate::spec::AttentionSpec::Gqa { kv_heads, head_dim, .. } => 2 * kv_heads * head_dim,
    };
    let delta_layers = (0..spec.num_layers).filter(|&l| spec.is_delta_net(l)).count();
    est.kv_bytes_per_token = (per_layer * (spec.num_layers - delta_layers) * 4) as u64;
    if let Some(d) = spec.delta_net {
        let per_layer = d.rule_state_len() + d.conv_state_len();
        est.sequence_state_bytes = (per_layer * delta_layers * 4) as u64;
    }
    if let crate::spec::AttentionSpec::Mla {
        heads, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, kv_lora_rank, ..
    } = spec.attention
    {
        let floats =
            heads * (qk_nope_head_dim + qk_rope_head_dim) + kv_lora_rank + qk_rope_head_dim + heads * v_head_dim;
        est.mla_scratch_bytes_per_token = floats as u64 * 4;
        // As `krasis_cpu::mla_prefill::tile_rows` sizes it.
        let per_row = (heads * (qk_nope_head_dim + qk_rope_head_dim + v_head_dim)).max(1) * 4;
        let block = krasis_cpu::mla_prefill::BLOCK_K;
        est.mla_tile_bytes_per_row = per_row as u64;
        est.mla_tile_max_rows = ((krasis_cpu::mla_prefill::KV_TILE_BYTES / per_row / block).max(1) * block) as u64;
    }
    let bf16 = krasis_cpu::prefill_bf16::applies(krasis_cpu::isa::active(), usize::MAX, 32).is_some();
    let largest_dense = dense_quant.map_or(0, |_| entries.iter().map(packed_rows).max().unwrap_or(0));
    prefill_scratch(&mut est, spec, bf16, expert_width_rule(experts).is_some(), largest_dense);
    est
}

/// Output rows of a dense-weight cache entry as one packed matrix (a fused w13: gate and up).
/// The LM head runs on one row per sequence (never on the tiles): 0.
fn packed_rows(p: &crate::cpu::dense_cache::Planned) -> u64 {
    match &p.kind {
        PlannedKind::Linear(t) if t.role == TensorRole::LmHead => 0,
        PlannedKind::Linear(t) => t.shape[0] as u64,
        PlannedKind::W13 { gate, .. } => 2 * gate.shape[0] as u64,
        PlannedKind::KvB { .. } => 0,
    }
}

/// Fills the prefill scratch parts of `est` (see [`MemoryEstimate::prefill_kept_bytes`]): with
/// `bf16` tiles in use, call buffers when the routed experts are quantised (`quant_experts`),
/// and tile outputs for the largest packed dense matrix (`largest_dense_rows`; 0 when dense
/// weights are not quantised).
pub fn prefill_scratch(
    est: &mut MemoryEstimate,
    spec: &ModelSpec,
    bf16: bool,
    quant_experts: bool,
    largest_dense_rows: u64,
) {
    if !bf16 {
        return;
    }
    est.prefill_min_tokens = krasis_cpu::prefill_bf16::min_tokens() as u64;
    est.prefill_kept_max = krasis_cpu::prefill_bf16::KEEP_BYTES as u64;
    if let Some(m) = spec.moe.as_ref().filter(|_| quant_experts) {
        let (h, i) = (spec.hidden_size as u64, m.moe_intermediate_size as u64);
        // x (BF16) and y (f32, whole row blocks) per row of hidden; mid (BF16) per intermediate.
        let per_slot = 2 * h + 4 * h.next_multiple_of(16) + 2 * i;
        est.prefill_call_bytes_per_token = m.routing.top_k as u64 * per_slot;
        est.prefill_call_pad_bytes = m.n_routed_experts as u64 * 8 * per_slot;
    }
    est.prefill_tile_bytes_per_token = largest_dense_rows;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth::{preset_config, Preset};

    fn spec(p: Preset, layers: usize) -> ModelSpec {
        let text = preset_config(p, Some(layers)).to_string();
        crate::arch::parse_config(&text, std::path::Path::new("config.json")).expect("preset config")
    }

    /// The parts of the estimate at several sizes: `auto` dense weights count as INT8 (as the
    /// engine resolves them; they were counted as stored), the prefill call buffers per routed
    /// slot, kept only up to their cap, and the tile outputs of the largest packed dense matrix
    /// (never the LM head). Measured on this machine: bench/logs/2026-11-28/devvm-memory-estimate-s24.log.
    #[test]
    fn estimate_parts_at_several_sizes() {
        for (p, layers) in [(Preset::Tiny, 4), (Preset::V2Lite, 2), (Preset::V2Lite, 4), (Preset::V2Lite, 27)] {
            let s = spec(p, layers);
            let auto = cpu_estimate(&s, None, WeightBits::Int4, WeightBits::Auto, 128);
            let int8 = cpu_estimate(&s, None, WeightBits::Int4, WeightBits::Int8, 128);
            let bf16 = cpu_estimate(&s, None, WeightBits::Int4, WeightBits::Bf16, 128);
            assert_eq!(auto, int8, "{p} L{layers}: auto dense is INT8");
            assert!(int8.dense_bytes < bf16.dense_bytes, "{p} L{layers}");

            let mut e = MemoryEstimate::default();
            let m = s.moe.as_ref().expect("MoE preset");
            prefill_scratch(&mut e, &s, true, true, 1000);
            let (h, i) = (s.hidden_size as u64, m.moe_intermediate_size as u64);
            let slot = 6 * h + 2 * i;
            assert_eq!(e.prefill_call_bytes_per_token, m.routing.top_k as u64 * slot);
            assert_eq!(e.prefill_call_pad_bytes, m.n_routed_experts as u64 * 8 * slot);
            assert_eq!(e.prefill_tile_bytes_per_token, 1000);
            // Below the tiles' minimum nothing is kept; a pass whose call buffers exceed the cap
            // keeps only the tile outputs.
            assert_eq!(e.prefill_kept_bytes(e.prefill_min_tokens - 1), 0);
            let t = e.prefill_min_tokens;
            let call = e.prefill_call_pad_bytes + e.prefill_call_bytes_per_token * t;
            let kept_call = if call <= e.prefill_kept_max { call } else { 0 };
            assert_eq!(e.prefill_kept_bytes(t), kept_call + 1000 * t.next_multiple_of(16));
            let big = 1 << 20;
            assert_eq!(e.prefill_kept_bytes(big), 1000 * big);
            assert_eq!(e.total_after(16, big) - e.total_after(16, 0), 1000 * big);
            // Without the tiles, or with unquantised experts, there are no call buffers.
            let mut none = MemoryEstimate::default();
            prefill_scratch(&mut none, &s, false, true, 1000);
            assert_eq!(none, MemoryEstimate::default());
            let mut reference = MemoryEstimate::default();
            prefill_scratch(&mut reference, &s, true, false, 0);
            assert_eq!(reference.prefill_call_bytes_per_token + reference.prefill_tile_bytes_per_token, 0);
        }
        // MLA's expanded tile: V2-Lite's 16 heads × (128 + 64 + 128) floats a key row, at most
        // 768 rows (16 MiB); tiny's 4 × 80 floats, up to 13 056 rows. Nothing below 32 rows.
        let v2 = cpu_estimate(&spec(Preset::V2Lite, 2), None, WeightBits::Int4, WeightBits::Int8, 128);
        assert_eq!((v2.mla_tile_bytes_per_row, v2.mla_tile_max_rows), (20480, 768));
        assert_eq!(v2.mla_tile_bytes(16), 0);
        assert_eq!(v2.mla_tile_bytes(100), 128 * 20480);
        assert_eq!(v2.mla_tile_bytes(2048), 768 * 20480);
        // Its per-call buffers: 16 · 192 + 576 + 16 · 128 floats a token, kept up to 64 MiB.
        assert_eq!(v2.mla_scratch_bytes_per_token, 5696 * 4);
        let kept = |e: &MemoryEstimate, t: u64| e.total_after(16, t) - e.total_after(16, 0);
        let no_bf16 = MemoryEstimate {
            prefill_min_tokens: 0,
            prefill_call_bytes_per_token: 0,
            prefill_call_pad_bytes: 0,
            prefill_tile_bytes_per_token: 0,
            ..v2
        };
        assert_eq!(kept(&no_bf16, 2048), 768 * 20480 + 2048 * 5696 * 4);
        assert_eq!(kept(&no_bf16, 4096), 768 * 20480, "93 MB of buffers are freed after the pass");
        let tiny = cpu_estimate(&spec(Preset::Tiny, 4), None, WeightBits::Int4, WeightBits::Int8, 128);
        assert_eq!((tiny.mla_tile_bytes_per_row, tiny.mla_tile_max_rows), (1280, 13056));
        assert_eq!(tiny.mla_tile_bytes(2048), 2048 * 1280);
        assert!(tiny.total_after(2048, 2048) >= tiny.total_after(2048, 16) + 2048 * 1280);
        // The tile outputs follow the largest packed dense matrix, not the LM head: V2-Lite's
        // dense MLP (2 · 10944 rows), though its LM head has 102400.
        let s = spec(Preset::V2Lite, 2);
        let largest = planned_entries(&s).expect("plan").iter().map(packed_rows).max();
        assert_eq!(largest, Some(2 * 10944));
    }
}
