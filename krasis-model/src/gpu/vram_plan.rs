//! How the VRAM the weights (and a hybrid engine's stream slots) leave is shared out: the KV
//! cache, the activation scratch of a prefill chunk, and a hybrid engine's pinned experts. This
//! is the one place they are traded against each other:
//!
//! 1. **KV cache.** As asked (`kv_tokens`), else at least the context the caller needs, at least
//!    [`DEFAULT_KV_TOKENS`] when experts are pinned beside it, and otherwise as much of the
//!    model's context as fits beside a prefill chunk of [`PREFILL_CHUNK_TARGET`] tokens.
//! 2. **Prefill chunks.** A prompt runs in chunks whose activation scratch fits what the KV cache
//!    (and the scratch that grows with the context it holds) leaves: a prompt of any length runs
//!    under any budget that holds the weights and a [`MIN_PREFILL_CHUNK`]-token chunk.
//! 3. **Pinned experts** (hybrid, when asked for): whatever is left after the KV cache and a
//!    [`PREFILL_CHUNK_TARGET`]-token chunk.
//!
//! The scratch a call holds is estimated from the spec ([`ScratchCost`]): the per-token buffers
//! of the largest layer part (a dense MLP's gate and up, MLA's query and latent rows) and the
//! per-context buffers of attention's prefill form (MLA's expanded keys and values over the whole
//! context). The routed experts' own pass scratch sizes itself from the budget
//! (`krasis_gpu::moe`), within [`FIXED_RESERVE_BYTES`]. A gated-DeltaNet model's KV cache covers
//! its attention layers only, and the states of its DeltaNet layers (a constant per sequence,
//! [`super::session_state_bytes`]) are taken off the free VRAM before the plan shares it out.

use crate::spec::{AttentionSpec, FfnKind, ModelSpec};

/// KV tokens a hybrid engine keeps beside pinned experts unless more is asked or needed: a long
/// conversation's worth, leaving the rest to the experts.
pub const DEFAULT_KV_TOKENS: usize = 16_384;

/// Prompt chunk the plan keeps room for before it gives VRAM to pinned experts or to KV beyond
/// what is needed: at 8K tokens a chunk's compute hides the copies of a streamed prefill (v2-lite
/// INT4 on an H200: ~0.15 s to stream every layer's experts, ~0.3 s to compute 8K tokens).
pub const PREFILL_CHUNK_TARGET: usize = 8192;

/// The smallest prompt chunk: below it a prefill is all launch overhead and expert copies.
pub const MIN_PREFILL_CHUNK: usize = 256;

/// VRAM kept free beside the estimated scratch: cuBLAS workspaces (two lanes), the routed experts'
/// pass scratch floor (128 MiB), the sampler and allocation granules.
pub const FIXED_RESERVE_BYTES: u64 = 512 << 20;

/// Margin on the scratch estimate (buffers the estimate does not list, and rounding).
const SCRATCH_MARGIN_PERCENT: u64 = 25;

/// Activation scratch of a prefill call, in bytes: per token of the call and per token of the
/// context it attends over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScratchCost {
    pub per_token: u64,
    pub per_context: u64,
}

impl ScratchCost {
    /// The estimate for `spec`; `f32_context` when attention's context is also held in f32: MLA's
    /// `kv_b` expanding it in f32 before BF16 (an INT8 `kv_b`), or the precise mode's f32 keys and
    /// values ([`super::GpuPrecision::F32`]).
    pub fn of(spec: &ModelSpec, f32_context: bool) -> ScratchCost {
        let h = spec.hidden_size as u64;
        let dense_inter = spec
            .layers
            .iter()
            .map(|l| match l {
                FfnKind::Dense { intermediate_size } => *intermediate_size as u64,
                FfnKind::Moe => 0,
            })
            .max()
            .unwrap_or(0);
        let shared_inter = spec.moe.as_ref().map_or(0, |m| m.shared_intermediate_size as u64);
        let inter = dense_inter.max(shared_inter);
        let k = spec.moe.as_ref().map_or(0, |m| m.routing.top_k as u64);
        // f32 per token: x, xn, y; the MLP's gate+up and activation; the shared expert's output;
        // a chunked stream's partial output; attention's query, latent/keys and output.
        let (q, kv_row, out, q16, per_context) = match spec.attention {
            AttentionSpec::Mla { heads, q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim } => {
                let (hh, qk, row) = (
                    heads as u64,
                    (qk_nope_head_dim + qk_rope_head_dim) as u64,
                    (kv_lora_rank + qk_rope_head_dim) as u64,
                );
                let kvb_cols = hh * (qk_nope_head_dim + v_head_dim) as u64;
                let per_context = 4 * row
                    + 4 * kv_lora_rank as u64
                    + 2 * qk_rope_head_dim as u64
                    + 2 * kvb_cols
                    + if f32_context { 4 * kvb_cols + 4 * qk_rope_head_dim as u64 } else { 0 };
                (hh * qk + q_lora_rank.unwrap_or(0) as u64, row, hh * v_head_dim as u64, 2 * hh * qk, per_context)
            }
            AttentionSpec::Gqa { heads, kv_heads, head_dim, output_gate, .. } => {
                let (q, kv) = ((heads * head_dim) as u64, (kv_heads * head_dim) as u64);
                // Gated attention keeps q_proj's whole output (queries and gates) beside q.
                let gates = if output_gate { 2 * q } else { 0 };
                (q, 2 * kv, q + gates, 2 * q, if f32_context { 12 * kv } else { 4 * kv })
            }
        };
        let f32s = 3 * h + (2 * inter).max(q) + inter.max(kv_row) + h + h + out;
        // A gated-DeltaNet layer's per-token f32s: q/k/v before and after the convolution, z, b, a
        // and the output (its states are per sequence, not per token: see `session_state_bytes`).
        let f32s = match &spec.delta_net {
            Some(d) => {
                let (ch, vw, nv) = (d.conv_channels() as u64, d.value_width() as u64, d.value_heads as u64);
                f32s.max(3 * h + 2 * ch + 2 * vw + 2 * nv)
            }
            None => f32s,
        };
        let per_token = 4 * f32s + q16 + 12 * k;
        let margin = |b: u64| b + b * SCRATCH_MARGIN_PERCENT / 100;
        ScratchCost { per_token: margin(per_token), per_context: margin(per_context) }
    }
}

impl ScratchCost {
    /// KV tokens that fit in `free` bytes beside a prompt chunk of `chunk` tokens, each KV token
    /// costing `kv_bytes_per_token` plus the scratch its context needs.
    pub fn kv_beside(&self, free: u64, kv_bytes_per_token: u64, chunk: usize) -> usize {
        let per_kv = kv_bytes_per_token + self.per_context;
        (free.saturating_sub(chunk as u64 * self.per_token) / per_kv.max(1)) as usize
    }

    /// Prompt-chunk tokens whose scratch fits in `free` bytes beside `kv_tokens` of KV cache.
    pub fn chunk_beside(&self, free: u64, kv_bytes_per_token: u64, kv_tokens: usize) -> usize {
        let per_kv = kv_bytes_per_token + self.per_context;
        (free.saturating_sub(kv_tokens as u64 * per_kv) / self.per_token.max(1)) as usize
    }
}

/// Prompt chunks are whole multiples of this many tokens (the kernels' row tiles divide it).
pub const CHUNK_STEP: usize = 64;

/// What the plan asks of the VRAM that is free.
#[derive(Clone, Copy, Debug)]
pub struct VramAsk {
    /// Bytes free after the weights (and a hybrid engine's stream slots).
    pub free: u64,
    /// KV cache bytes per token.
    pub kv_bytes_per_token: u64,
    pub scratch: ScratchCost,
    /// The model's context (`max_position_embeddings`).
    pub model_context: usize,
    /// `kv_tokens` as asked (taken as it is).
    pub kv_asked: Option<usize>,
    /// Context the caller needs (a benchmark's prompt and decode), when it said.
    pub context_needed: Option<usize>,
    /// Give what is left to pinned experts.
    pub pins: bool,
    /// VRAM kept out of the plan for what runs beside the one session it sizes: the KV caches of
    /// further sessions (a server's batch slots) and the prefix cache.
    pub beside: u64,
}

/// The plan: KV tokens, the largest prompt chunk, and bytes for pinned experts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VramPlan {
    pub kv_tokens: usize,
    pub prefill_chunk: usize,
    pub pin_bytes: u64,
}

impl VramPlan {
    /// One line for the start log: how the VRAM was shared out.
    pub fn describe(&self, ask: &VramAsk) -> String {
        let gib = |b: u64| krasis_core::budget::format_bytes(b);
        let kv = self.kv_tokens as u64 * ask.kv_bytes_per_token;
        let mut s = format!(
            "VRAM plan: KV cache {} tokens ({}{}), prompts in chunks of up to {} tokens",
            self.kv_tokens,
            gib(kv),
            match (ask.kv_asked, ask.context_needed) {
                (Some(_), _) => ", as asked".to_string(),
                (None, _) if ask.pins => format!(", {DEFAULT_KV_TOKENS} beside pinned experts unless more is needed"),
                (None, _) if self.kv_tokens >= ask.model_context => ", the model's whole context".to_string(),
                (None, _) => format!(" of the model's {}", ask.model_context),
            },
            self.prefill_chunk
        );
        if ask.pins {
            s.push_str(&format!(", {} for pinned experts", gib(self.pin_bytes)));
        }
        s
    }
}

/// Why no plan fits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NoRoom(pub String);

/// Shares `ask.free` out (see the module documentation).
pub fn plan_vram(ask: &VramAsk) -> Result<VramPlan, NoRoom> {
    let free = ask.free.saturating_sub(FIXED_RESERVE_BYTES).saturating_sub(ask.beside);
    let (scratch, kv_bpt) = (&ask.scratch, ask.kv_bytes_per_token);
    let ctx = ask.model_context.max(1);
    let needed = ask.context_needed.unwrap_or(0).min(ctx);
    let kv_tokens = match ask.kv_asked {
        Some(n) => n,
        None => {
            // What fits beside a target chunk (at least beside the smallest one).
            let beside = |chunk: usize| scratch.kv_beside(free, kv_bpt, chunk);
            let fit = beside(PREFILL_CHUNK_TARGET).max(beside(MIN_PREFILL_CHUNK).min(needed.max(1)));
            let want = if ask.pins { DEFAULT_KV_TOKENS.min(ctx).max(needed) } else { ctx };
            want.min(fit)
        }
    };
    if kv_tokens == 0 {
        return Err(NoRoom("no room for a KV cache".into()));
    }
    let chunk_room = scratch.chunk_beside(free, kv_bpt, kv_tokens);
    if chunk_room < MIN_PREFILL_CHUNK {
        return Err(NoRoom(format!(
            "{kv_tokens} KV tokens leave room for prompt chunks of {chunk_room} tokens, fewer than {MIN_PREFILL_CHUNK}"
        )));
    }
    // Pins get what is left beside a target chunk; the chunk then gets the rest.
    let after_kv = free.saturating_sub(kv_tokens as u64 * (kv_bpt + scratch.per_context));
    let pin_bytes = if ask.pins { after_kv.saturating_sub(PREFILL_CHUNK_TARGET as u64 * scratch.per_token) } else { 0 };
    let prefill_chunk = ((after_kv - pin_bytes) / scratch.per_token.max(1)) as usize;
    Ok(VramPlan { kv_tokens, prefill_chunk: prefill_chunk / CHUNK_STEP * CHUNK_STEP, pin_bytes })
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn ask(free: u64) -> VramAsk {
        VramAsk {
            free,
            kv_bytes_per_token: 31_104,
            scratch: ScratchCost { per_token: 200_000, per_context: 30_000 },
            model_context: 163_840,
            kv_asked: None,
            context_needed: None,
            pins: false,
            beside: 0,
        }
    }

    /// Every plan fits what was free: KV, its context scratch, the chunk and the pins.
    fn fits(a: &VramAsk, p: &VramPlan) -> bool {
        let used = p.kv_tokens as u64 * (a.kv_bytes_per_token + a.scratch.per_context)
            + p.prefill_chunk as u64 * a.scratch.per_token
            + p.pin_bytes
            + a.beside
            + FIXED_RESERVE_BYTES;
        used <= a.free
    }

    /// What is kept beside the plan (further sessions, the prefix cache) comes out of the pins.
    #[test]
    fn what_runs_beside_comes_out_of_the_pins() {
        let a = VramAsk { pins: true, kv_asked: Some(8192), ..ask(40 * GIB) };
        let b = VramAsk { beside: 5 * GIB, ..a };
        let (pa, pb) = (plan_vram(&a).unwrap(), plan_vram(&b).unwrap());
        assert_eq!(pa.pin_bytes - pb.pin_bytes, 5 * GIB);
        assert_eq!((pa.kv_tokens, pa.prefill_chunk), (pb.kv_tokens, pb.prefill_chunk));
        assert!(fits(&b, &pb));
    }

    #[test]
    fn without_pins_kv_takes_the_context_beside_a_target_chunk() {
        let a = ask(40 * GIB);
        let p = plan_vram(&a).unwrap();
        assert_eq!(p.kv_tokens, 163_840, "the whole context fits");
        assert!(p.prefill_chunk >= PREFILL_CHUNK_TARGET, "{p:?}");
        assert_eq!(p.pin_bytes, 0);
        assert!(fits(&a, &p));
        // A smaller budget: KV shrinks so that the target chunk still fits.
        let a = ask(4 * GIB);
        let p = plan_vram(&a).unwrap();
        assert!(p.kv_tokens < 163_840 && p.kv_tokens > 10_000, "{p:?}");
        assert!(p.prefill_chunk >= PREFILL_CHUNK_TARGET, "{p:?}");
        assert!(fits(&a, &p));
    }

    #[test]
    fn pins_take_what_kv_and_a_target_chunk_leave() {
        let a = VramAsk { pins: true, ..ask(20 * GIB) };
        let p = plan_vram(&a).unwrap();
        assert_eq!(p.kv_tokens, DEFAULT_KV_TOKENS);
        assert!(p.pin_bytes > 10 * GIB, "{p:?}");
        assert_eq!(p.prefill_chunk / 64, PREFILL_CHUNK_TARGET / 64, "{p:?}");
        assert!(fits(&a, &p));
        // A caller that needs a longer context gets it before the pins do.
        let a = VramAsk { context_needed: Some(40_000), ..a };
        let p = plan_vram(&a).unwrap();
        assert_eq!(p.kv_tokens, 40_000);
        assert!(fits(&a, &p));
    }

    #[test]
    fn a_long_prompt_in_a_small_budget_gets_its_context_and_smaller_chunks() {
        // 2 GiB free: a 32K context fits only with chunks below the target.
        let a = VramAsk { context_needed: Some(32_769), pins: true, ..ask(2 * GIB + (800 << 20)) };
        let p = plan_vram(&a).unwrap();
        assert_eq!(p.kv_tokens, 32_769, "{p:?}");
        assert!(p.prefill_chunk >= MIN_PREFILL_CHUNK && p.prefill_chunk < PREFILL_CHUNK_TARGET, "{p:?}");
        assert_eq!(p.pin_bytes, 0);
        assert!(fits(&a, &p));
    }

    #[test]
    fn asked_kv_is_kept_or_refused() {
        let a = VramAsk { kv_asked: Some(1000), ..ask(8 * GIB) };
        assert_eq!(plan_vram(&a).unwrap().kv_tokens, 1000);
        let a = VramAsk { kv_asked: Some(1_000_000), ..ask(8 * GIB) };
        let e = plan_vram(&a).unwrap_err();
        assert!(e.0.contains("1000000 KV tokens"), "{e:?}");
        assert!(plan_vram(&ask(FIXED_RESERVE_BYTES)).is_err(), "nothing free: no plan");
    }

    #[test]
    fn v2_lite_scratch_estimate() {
        let config = crate::synth::preset_config(crate::synth::Preset::V2Lite, None).to_string();
        let spec = crate::arch::parse_config(&config, std::path::Path::new("config.json")).unwrap();
        let c = ScratchCost::of(&spec, false);
        // The dense layer's gate+up (2 × 10944 f32) dominates a token's scratch; the expanded
        // keys and values (16 heads × 256, BF16) a context token's.
        assert!(c.per_token > 4 * 2 * 10_944 && c.per_token < 400_000, "{c:?}");
        assert!(c.per_context > 2 * 16 * 256 && c.per_context < 40_000, "{c:?}");
        assert!(ScratchCost::of(&spec, true).per_context > c.per_context);
    }
}
