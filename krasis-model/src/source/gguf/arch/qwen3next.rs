//! llama.cpp's `qwen3next` (Qwen3-Next, Qwen3-Coder-Next) and `qwen35moe` (Qwen3.5 / 3.6 MoE):
//! the metadata as the `config.json` transformers would read, and the gated-DeltaNet tensors
//! mapped back through every transformation of llama.cpp's converter (`conversion/qwen.py`).
//!
//! Metadata: `ssm.group_count` is the key heads, `ssm.state_size` the key head dim,
//! `ssm.time_step_rank` the value heads, `ssm.inner_size` the value width (value heads × value
//! head dim), `ssm.conv_kernel` the convolution's taps; `attention.recurrent_layers` (one bool per
//! layer: DeltaNet) is `layer_types`, else `full_attention_interval`; `rope.dimension_count` is
//! the rotated dims of a head (`partial_rotary_factor` × `attention.key_length`); a layer without
//! `ffn_gate_inp` is a dense MLP (`mlp_only_layers`). Qwen3.5's `rope.dimension_sections` (M-RoPE)
//! are the same rotation for text and are not read. The last `nextn_predict_layers` blocks are the
//! MTP head (llama.cpp counts them in `block_count`): recognised and not loaded.
//!
//! Tensors (the GGUF name, then what the converter did to the hub's tensor, undone here):
//! - `attn_norm`, `post_attention_norm`, `output_norm`, `attn_q_norm`, `attn_k_norm`: the
//!   zero-centred gains with the 1 added (`1 + w`). The GGUF spec says so with `norm_plus_one`
//!   false: the stored values are the gains, loaded as they are (no rounding added).
//! - `ssm_a` = −exp(`A_log`), as f32: served as `A_log` by [`a_log_of`] (the CPU op takes
//!   `A_log`; see there for how close this comes).
//! - `ssm_conv1d` `[C, K]`: `conv1d.weight` `[C, 1, K]` squeezed (the same values in order).
//! - `ssm_dt.bias`: `dt_bias`; `ssm_norm`: the gated output norm (stored as is, no 1 added);
//!   `ssm_out`: `out_proj`.
//! - qwen3next: `attn_qkv` (q of all key heads, then k, then v) and `attn_gate` (z) were regrouped
//!   from `in_proj_qkvz` into the canonical flat `in_proj_qkv` / `in_proj_z`: served as stored;
//!   `ssm_ba` is `in_proj_ba` as stored (per key head its b rows, then its a rows): `in_proj_b` and
//!   `in_proj_a` are its rows gathered.
//! - qwen35moe: `attn_qkv` = `in_proj_qkv`, `attn_gate` = `in_proj_z`, `ssm_beta` = `in_proj_b`,
//!   `ssm_alpha` = `in_proj_a`, but when the value heads outnumber the key heads the converter
//!   reordered the value heads from grouped by key head (`[k0 v0, k0 v1, k1 v0, k1 v1]`, the
//!   canonical order) to tiled (`[k0 v0, k1 v0, k0 v1, k1 v1]`) in the v rows of `attn_qkv`, the
//!   rows of `attn_gate`, `ssm_beta`, `ssm_alpha`, the elements of `ssm_a` and `ssm_dt`, the v
//!   channels of `ssm_conv1d` and the columns of `ssm_out`: each is gathered back.
//! - The full-attention layers' `attn_q` holds per head the query then the output gate, as
//!   `q_proj` does; the experts are stacked `ffn_{gate,up,down}_exps` (Qwen3.5's fused
//!   `gate_up_proj` split by the converter), the shared expert `ffn_*_shexp` and its sigmoid gate
//!   `ffn_gate_inp_shexp` `[1, hidden]`.

use serde_json::{json, Map, Value as Json};

use super::{common, put, rope_scaling, Mapper, Meta, Rearranged, StoredValues};
use crate::error::Result;
use crate::model::tensors::TensorSpec;
use crate::spec::{DeltaNetSpec, ModelSpec};

/// The architectures of this module.
pub(super) const ARCHS: [&str; 2] = ["qwen3next", "qwen35moe"];

/// The `config.json` of a `qwen3next` (`qwen35 == false`) or `qwen35moe` GGUF: Qwen3-Next's
/// fields, or Qwen3.5's wrapper with them in `text_config`.
pub(super) fn config(meta: &Meta, qwen35: bool) -> Result<Map<String, Json>> {
    let m = meta.m;
    let mut o = Map::new();
    common(meta, &mut o)?;
    // The MTP layers (`nextn_predict_layers`) follow the model's in `block_count`: not loaded.
    let blocks = meta.a("block_count")?;
    let mtp = meta.a_opt("nextn_predict_layers")?.unwrap_or(0);
    if mtp >= blocks {
        return Err(meta.err(
            &meta.key("nextn_predict_layers"),
            format!("{mtp} MTP layers leave none of block_count {blocks} to the model"),
        ));
    }
    let layers = blocks - mtp;
    put(&mut o, "num_hidden_layers", layers);
    let heads = meta.a("attention.head_count")?;
    put(&mut o, "num_key_value_heads", meta.a_opt("attention.head_count_kv")?.unwrap_or(heads));
    let head_dim = match meta.a_opt("attention.key_length")? {
        Some(d) => d,
        None => meta.a("embedding_length")? / heads.max(1),
    };
    if let Some(v) = meta.a_opt("attention.value_length")?.filter(|&v| v != head_dim) {
        return Err(meta.err(
            &meta.key("attention.value_length"),
            format!("{v} differs from attention.key_length {head_dim} (gated attention has one head dim)"),
        ));
    }
    put(&mut o, "head_dim", head_dim);
    let rot = meta.a("rope.dimension_count")?;
    let factor = rot as f64 / head_dim as f64;
    if rot == 0 || rot > head_dim || (head_dim as f64 * factor) as usize != rot {
        return Err(meta.err(
            &meta.key("rope.dimension_count"),
            format!("{rot} rotated dims do not fit a head of {head_dim} (attention.key_length)"),
        ));
    }
    put(&mut o, "partial_rotary_factor", factor);

    // The gated DeltaNet.
    let key_heads = meta.a("ssm.group_count")?;
    let value_heads = meta.a("ssm.time_step_rank")?;
    let inner = meta.a("ssm.inner_size")?;
    if key_heads == 0 {
        return Err(meta.err(&meta.key("ssm.group_count"), "must be greater than 0 (the DeltaNet key heads)"));
    }
    if value_heads == 0 || !value_heads.is_multiple_of(key_heads) {
        return Err(meta.err(
            &meta.key("ssm.time_step_rank"),
            format!("{value_heads} value heads are not a positive multiple of ssm.group_count {key_heads} key heads"),
        ));
    }
    if inner == 0 || !inner.is_multiple_of(value_heads) {
        return Err(meta.err(
            &meta.key("ssm.inner_size"),
            format!("{inner} does not divide into ssm.time_step_rank {value_heads} value heads"),
        ));
    }
    put(&mut o, "linear_num_key_heads", key_heads);
    put(&mut o, "linear_num_value_heads", value_heads);
    put(&mut o, "linear_key_head_dim", meta.a("ssm.state_size")?);
    put(&mut o, "linear_value_head_dim", inner / value_heads);
    put(&mut o, "linear_conv_kernel_dim", meta.a("ssm.conv_kernel")?);

    // Which layers are DeltaNet.
    let key = meta.key("attention.recurrent_layers");
    match m.meta(&key) {
        Some(v) => {
            let flags = v
                .as_int_array(m.main().bytes())
                .ok_or_else(|| meta.err(&key, "expected an array of booleans (one per layer)"))?;
            if flags.len() != blocks {
                return Err(meta.err(
                    &key,
                    format!("has {} entries but block_count is {blocks}: one entry per layer", flags.len()),
                ));
            }
            let kinds: Vec<&str> =
                flags[..layers].iter().map(|&f| if f != 0 { "linear_attention" } else { "full_attention" }).collect();
            put(&mut o, "layer_types", kinds);
        }
        None => {
            if let Some(every) = meta.a_opt("full_attention_interval")? {
                put(&mut o, "full_attention_interval", every);
            }
        }
    }

    // The MoE blocks: a layer without a router is a dense MLP.
    put(&mut o, "num_experts", meta.a("expert_count")?);
    put(&mut o, "shared_expert_intermediate_size", meta.a_opt("expert_shared_feed_forward_length")?.unwrap_or(0));
    if let Some(norm) = meta.b_opt("expert_weights_norm")? {
        put(&mut o, "norm_topk_prob", norm);
    }
    let dense: Vec<usize> = (0..layers).filter(|l| !m.has_tensor(&format!("blk.{l}.ffn_gate_inp.weight"))).collect();
    if !dense.is_empty() {
        put(&mut o, "mlp_only_layers", dense);
        put(&mut o, "intermediate_size", meta.a("feed_forward_length")?);
    }
    rope_scaling(meta, &mut o)?;
    if !qwen35 {
        put(&mut o, "model_type", "qwen3_next");
        return Ok(o);
    }
    // Qwen3.5's output gate is optional (`attn_output_gate`): the query projection is doubled
    // when it is there.
    let recurrent = o.get("layer_types").and_then(Json::as_array).cloned();
    let first_full = (0..layers).find(|&l| match &recurrent {
        Some(kinds) => kinds[l] == "full_attention",
        None => m.has_tensor(&format!("blk.{l}.attn_q.weight")),
    });
    if let Some((_, t)) = first_full.and_then(|l| m.tensor_info(&format!("blk.{l}.attn_q.weight"))) {
        put(&mut o, "attn_output_gate", t.shape().first() == Some(&(2 * heads * head_dim)));
    }
    put(&mut o, "model_type", "qwen3_5_moe_text");
    let tie = o.remove("tie_word_embeddings").unwrap_or(Json::Bool(false));
    let mut wrapper = Map::new();
    put(&mut wrapper, "model_type", "qwen3_5_moe");
    put(&mut wrapper, "tie_word_embeddings", tie);
    put(&mut wrapper, "text_config", json!(o));
    Ok(wrapper)
}

/// For each of `value_heads` heads of `dim` rows in the canonical order (grouped by key head),
/// the row llama.cpp's `qwen35moe` stores it at (tiled: value head `j` of key head `k` at
/// position `j · key_heads + k`).
pub fn tiled_rows(key_heads: usize, value_heads: usize, dim: usize) -> Vec<usize> {
    let r = value_heads / key_heads;
    (0..value_heads)
        .flat_map(|g| {
            let s = (g % r) * key_heads + g / r;
            s * dim..(s + 1) * dim
        })
        .collect()
}

/// The f32 `A_log` served for a stored `A` = −exp(`A_log`) (llama.cpp's `ssm_a`): the f32 nearest
/// ln(−A), then of it and its two neighbours on each side the one whose f32 exponential (what
/// the CPU op computes, −e^`A_log`) is nearest −A. The decay the op then uses is A exactly when
/// some nearby f32 gives it, and otherwise within a few f32 ulps of A (rounding ln(−A) to f32
/// moves e^x by |ln(−A)|·2⁻²⁴ relative; found at most 2.1·2⁻²³ relative over A in [0.01, 7.4]);
/// `None` for an A that is not negative and finite.
pub fn a_log_of(a: f32) -> Option<f32> {
    if !(a < 0.0 && a.is_finite()) {
        return None;
    }
    let target = -(a as f64);
    let y0 = target.ln() as f32;
    let err = |y: f32| (y.exp() as f64 - target).abs();
    let mut best = y0;
    // The neighbours by bit pattern (on either side, never across zero).
    for d in [-2i32, -1, 1, 2] {
        let y = f32::from_bits((y0.to_bits() as i64 + d as i64) as u32);
        if y.is_finite() && y.signum() == y0.signum() && err(y) < err(best) {
            best = y;
        }
    }
    Some(best)
}

/// The GGUF tensors of DeltaNet layer `l` for each canonical tensor (module docs).
pub(super) fn map_delta_net(x: &mut Mapper, spec: &ModelSpec, l: usize, t: DeltaNetTensors, qwen35: bool) {
    let d: DeltaNetSpec = spec.delta_net.expect("a DeltaNet layer implies the DeltaNet spec");
    let (h, kw, vw) = (spec.hidden_size, d.key_width(), d.value_width());
    let (nk, nv, ch) = (d.key_heads, d.value_heads, d.conv_channels());
    let b = |s: &str| format!("blk.{l}.{s}");
    // Canonical → stored rows of the value heads (identity unless qwen35moe tiled them).
    let tiled = qwen35 && nk != nv;
    let v_rows = |dim: usize, at: usize| -> Option<Vec<usize>> {
        tiled.then(|| (0..at).chain(tiled_rows(nk, nv, dim).into_iter().map(|r| at + r)).collect())
    };
    let re = |from: String, stored: Vec<usize>, shape: &[usize]| Rearranged {
        from,
        stored,
        shape: shape.to_vec(),
        rows: None,
        cols: None,
        values: StoredValues::AsStored,
    };
    // The conv taps: `[C, K]` stored, `[C, 1, K]` canonical.
    x.rearranged(
        t.conv,
        Rearranged {
            rows: v_rows(d.value_dim, 2 * kw),
            ..re(b("ssm_conv1d.weight"), vec![ch, d.conv_kernel], &t.conv.shape)
        },
    );
    x.rearranged(
        t.a_log,
        Rearranged { cols: v_rows(1, 0), values: StoredValues::NegExp, ..re(b("ssm_a"), vec![nv], &t.a_log.shape) },
    );
    x.rearranged(t.dt_bias, Rearranged { cols: v_rows(1, 0), ..re(b("ssm_dt.bias"), vec![nv], &t.dt_bias.shape) });
    x.whole(t.norm, b("ssm_norm.weight"));
    if qwen35 {
        x.rearranged(
            t.qkv,
            Rearranged {
                rows: v_rows(d.value_dim, 2 * kw),
                ..re(b("attn_qkv.weight"), vec![2 * kw + vw, h], &t.qkv.shape)
            },
        );
        x.rearranged(
            t.z,
            Rearranged { rows: v_rows(d.value_dim, 0), ..re(b("attn_gate.weight"), vec![vw, h], &t.z.shape) },
        );
        x.rearranged(t.b, Rearranged { rows: v_rows(1, 0), ..re(b("ssm_beta.weight"), vec![nv, h], &t.b.shape) });
        x.rearranged(t.a, Rearranged { rows: v_rows(1, 0), ..re(b("ssm_alpha.weight"), vec![nv, h], &t.a.shape) });
        x.rearranged(
            t.out,
            Rearranged { cols: v_rows(d.value_dim, 0), ..re(b("ssm_out.weight"), vec![h, vw], &t.out.shape) },
        );
    } else {
        x.whole(t.qkv, b("attn_qkv.weight"));
        x.whole(t.z, b("attn_gate.weight"));
        // `ssm_ba`: per key head, the b rows then the a rows of its value heads.
        let r = nv / nk;
        let ba = |at: usize| (0..nk).flat_map(|k| k * 2 * r + at..k * 2 * r + at + r).collect::<Vec<_>>();
        x.rearranged(t.b, Rearranged { rows: Some(ba(0)), ..re(b("ssm_ba.weight"), vec![2 * nv, h], &t.b.shape) });
        x.rearranged(t.a, Rearranged { rows: Some(ba(r)), ..re(b("ssm_ba.weight"), vec![2 * nv, h], &t.a.shape) });
        x.whole(t.out, b("ssm_out.weight"));
    }
}

/// The canonical tensors of one DeltaNet layer.
pub(super) struct DeltaNetTensors<'a> {
    pub qkv: &'a TensorSpec,
    pub z: &'a TensorSpec,
    pub b: &'a TensorSpec,
    pub a: &'a TensorSpec,
    pub conv: &'a TensorSpec,
    pub a_log: &'a TensorSpec,
    pub dt_bias: &'a TensorSpec,
    pub norm: &'a TensorSpec,
    pub out: &'a TensorSpec,
}

#[cfg(test)]
mod tests;
