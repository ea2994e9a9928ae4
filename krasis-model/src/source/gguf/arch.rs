//! llama.cpp's architectures (`general.architecture` = `deepseek2`, `qwen3moe`, `llama` with
//! experts: Mixtral, and the gated-DeltaNet hybrids `qwen3next` and `qwen35moe`: [`qwen3next`])
//! → [`ModelSpec`],
//! and llama.cpp's tensor names → the canonical (HF) names of [`crate::model::tensors`].
//!
//! The metadata is turned into the `config.json` object transformers would read and handed to
//! the one config parser, so a GGUF model gets exactly the defaults and checks of its hub twin.
//! What GGUF does not say is inferred as llama.cpp infers it:
//! - DeepSeek routing: an `exp_probs_b` tensor means `noaux_tc` (V3), else `expert_group_count`
//!   > 1 means `group_limited_greedy`, else `greedy`; `expert_gating_func` 2 is sigmoid.
//! - YaRN: `rope.scaling.yarn_log_multiplier` is `0.1 · mscale_all_dim` (DeepSeek's convention in
//!   llama.cpp's converter); `mscale` is taken equal to it (the released DeepSeek configs have
//!   them equal, and llama.cpp's attention factor assumes it).
//! - Qwen3-MoE: llama.cpp always normalises the top-k weights, so `norm_topk_prob` is true
//!   unless `expert_weights_norm` says otherwise; every layer is MoE (llama.cpp's qwen3moe has no
//!   dense layers).
//! - Mixtral is `llama` with `expert_count`; llama.cpp's converter permutes a LLaMA's q/k rows so
//!   that each rotary pair is adjacent (it rotates them as pairs (2i, 2i + 1)), so the GGUF's
//!   rows are read as stored with interleaved pairing (`rope_interleave`), which is the same
//!   attention as transformers' half-split pairs on the unpermuted rows. A `llama` without
//!   experts is a dense model and is refused.
//! - Qwen2-MoE (`qwen2moe`): llama.cpp never renormalises its top-k weights and stores the shared
//!   expert's gate as `ffn_gate_inp_shexp` (`[1, hidden]`, as the hub's `shared_expert_gate`).
//! - MiniMax-M2 (`minimax-m2`): `rope.dimension_count` is the hub's `rotary_dim` (half-split pairs,
//!   llama.cpp's NEOX rotation: the converter does not permute the rows); `attn_q_norm` /
//!   `attn_k_norm` span the whole projections; the correction bias is `exp_probs_b`.
//! - Qwen3-Next / Qwen3.5 (`qwen3next`, `qwen35moe`): their norms are stored with the 1 of the
//!   zero-centred `1 + w` added, so the spec has `norm_plus_one` false (the one field in which it
//!   differs from the hub twin's); the DeltaNet tensors the converter reordered or mapped are
//!   [`Rearranged`] back (the [`qwen3next`] module docs list each).

use std::collections::HashMap;

use serde_json::{json, Map, Value as Json};

use krasis_quant::ggml::GgmlType;

use super::{gguf_err, GgufModel};
use crate::arch::parse_config;
use crate::error::{ModelError, Result};
use crate::model::tensors::{model_tensors, AttentionTensors, FfnTensors, MlpTensors, QueryTensors, TensorSpec};
use crate::spec::ModelSpec;

pub mod qwen3next;

#[cfg(test)]
mod families_tests;

/// Where a canonical tensor's values are in the GGUF.
#[derive(Clone, Debug, PartialEq)]
pub enum GgufTensorRef {
    /// The whole GGUF tensor of this name.
    Whole(String),
    /// Expert `expert` of a stacked `[E, rows, cols]` tensor (`ffn_*_exps`).
    Expert { stacked: String, expert: usize },
    /// MLA's `kv_b_proj` rebuilt from llama.cpp's `attn_k_b` and `attn_v_b`.
    KvB { k_b: String, v_b: String },
    /// Values of one GGUF tensor that llama.cpp's converter moved or mapped, put back.
    Rearranged(Rearranged),
}

/// A canonical tensor made from one GGUF tensor: the stored tensor (of shape `stored`,
/// row-major) read as rows of its last dimension; row `i` of the canonical tensor (of shape
/// `shape`) is stored row `rows[i]` (every row in order when `None`), and its value `j` is that
/// row's value `cols[j]` (every value in order when `None`), passed through `values`. Without
/// rows, columns or a value map it is the stored tensor reshaped, served from the mapping.
#[derive(Clone, Debug, PartialEq)]
pub struct Rearranged {
    pub from: String,
    pub stored: Vec<usize>,
    pub shape: Vec<usize>,
    pub rows: Option<Vec<usize>>,
    pub cols: Option<Vec<usize>>,
    pub values: StoredValues,
}

/// What a [`Rearranged`] tensor's stored values are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoredValues {
    /// The canonical values.
    AsStored,
    /// `−exp(x)` of the canonical values x (llama.cpp's `ssm_a` = −exp(`A_log`)), served as f32
    /// by [`qwen3next::a_log_of`].
    NegExp,
}

impl GgufTensorRef {
    /// The GGUF tensor the values (mostly) come from.
    pub fn primary(&self) -> &str {
        match self {
            GgufTensorRef::Whole(n) | GgufTensorRef::Expert { stacked: n, .. } => n,
            GgufTensorRef::KvB { v_b, .. } => v_b,
            GgufTensorRef::Rearranged(r) => &r.from,
        }
    }
}

/// Canonical tensor name → where it lives in the GGUF.
pub type TensorMap = HashMap<String, GgufTensorRef>;

/// Architectures this reader maps.
pub const SUPPORTED: &[&str] = &[
    "deepseek2",
    "qwen3moe",
    "llama (with experts: Mixtral)",
    "qwen2moe",
    "minimax-m2",
    "glm4moe",
    "gpt-oss",
    "qwen3next",
    "qwen35moe",
];

struct Meta<'a> {
    m: &'a GgufModel,
    arch: &'a str,
}

impl<'a> Meta<'a> {
    fn key(&self, k: &str) -> String {
        format!("{}.{k}", self.arch)
    }

    fn err(&self, key: &str, msg: impl std::fmt::Display) -> ModelError {
        gguf_err(self.m.path(), format!("metadata `{key}`: {msg}"))
    }

    fn int_opt(&self, key: &str) -> Result<Option<usize>> {
        match self.m.meta(key) {
            None => Ok(None),
            Some(v) => match v.as_int() {
                Some(i) if (0..=u32::MAX as i128 * 1024).contains(&i) => Ok(Some(i as usize)),
                _ => Err(self.err(key, format!("expected a non-negative integer, found {v:?}"))),
            },
        }
    }

    fn int(&self, key: &str) -> Result<usize> {
        self.int_opt(key)?.ok_or_else(|| self.err(key, "missing"))
    }

    /// `<arch>.<k>`, required.
    fn a(&self, k: &str) -> Result<usize> {
        self.int(&self.key(k))
    }

    fn a_opt(&self, k: &str) -> Result<Option<usize>> {
        self.int_opt(&self.key(k))
    }

    fn f_opt(&self, k: &str) -> Result<Option<f64>> {
        let key = self.key(k);
        match self.m.meta(&key) {
            None => Ok(None),
            Some(v) => v.as_f64().map(Some).ok_or_else(|| self.err(&key, format!("expected a number, found {v:?}"))),
        }
    }

    fn b_opt(&self, k: &str) -> Result<Option<bool>> {
        let key = self.key(k);
        match self.m.meta(&key) {
            None => Ok(None),
            Some(v) => v.as_bool().map(Some).ok_or_else(|| self.err(&key, format!("expected a bool, found {v:?}"))),
        }
    }
}

fn put(o: &mut Map<String, Json>, k: &str, v: impl Into<Json>) {
    o.insert(k.to_string(), v.into());
}

/// The embedding's row count (the vocabulary), from `token_embd.weight`.
fn embed_rows(m: &GgufModel) -> Result<usize> {
    let (_, t) = m
        .tensor_info("token_embd.weight")
        .ok_or_else(|| gguf_err(m.path(), "tensor `token_embd.weight` is missing"))?;
    match t.shape()[..] {
        [rows, _] => Ok(rows),
        ref s => {
            Err(gguf_err(m.path(), format!("tensor `token_embd.weight` has shape {s:?}, expected [vocab, hidden]")))
        }
    }
}

fn common(meta: &Meta, o: &mut Map<String, Json>) -> Result<()> {
    let m = meta.m;
    let vocab = match meta.a_opt("vocab_size")? {
        Some(v) => v,
        None => embed_rows(m)?,
    };
    put(o, "vocab_size", vocab);
    put(o, "hidden_size", meta.a("embedding_length")?);
    put(o, "num_hidden_layers", meta.a("block_count")?);
    put(o, "num_attention_heads", meta.a("attention.head_count")?);
    if let Some(eps) = meta.f_opt("attention.layer_norm_rms_epsilon")? {
        put(o, "rms_norm_eps", eps);
    }
    if let Some(c) = meta.a_opt("context_length")? {
        put(o, "max_position_embeddings", c);
    }
    put(o, "tie_word_embeddings", !m.has_tensor("output.weight"));
    for (key, field) in
        [("tokenizer.ggml.bos_token_id", "bos_token_id"), ("tokenizer.ggml.eos_token_id", "eos_token_id")]
    {
        if let Some(id) = meta.int_opt(key)? {
            put(o, field, id);
        }
    }
    let theta = meta.f_opt("rope.freq_base")?.unwrap_or(10000.0);
    put(o, "rope_theta", theta);
    put(o, "num_experts_per_tok", meta.a("expert_used_count")?);
    // llama's Mixtral keeps the expert width in `feed_forward_length`.
    let moe_inter = match meta.a_opt("expert_feed_forward_length")? {
        Some(i) => i,
        None => meta.a("feed_forward_length")?,
    };
    put(o, "moe_intermediate_size", moe_inter);
    Ok(())
}

/// A GQA model's KV heads (`attention.head_count_kv`, else every head) and `head_dim`
/// (`attention.key_length`, when stored; returned then).
fn gqa_heads(meta: &Meta, o: &mut Map<String, Json>) -> Result<Option<usize>> {
    let heads = meta.a("attention.head_count")?;
    put(o, "num_key_value_heads", meta.a_opt("attention.head_count_kv")?.unwrap_or(heads));
    let head_dim = meta.a_opt("attention.key_length")?;
    if let Some(d) = head_dim {
        put(o, "head_dim", d);
    }
    Ok(head_dim)
}

fn rope_scaling(meta: &Meta, o: &mut Map<String, Json>) -> Result<()> {
    let key = meta.key("rope.scaling.type");
    let kind = match meta.m.meta(&key) {
        None => return Ok(()),
        Some(v) => v.as_str(meta.m.main().bytes()).ok_or_else(|| meta.err(&key, "expected a string"))?,
    };
    let factor = meta.f_opt("rope.scaling.factor")?;
    let s = match kind {
        "none" => return Ok(()),
        "linear" => json!({ "type": "linear", "factor": factor }),
        "yarn" => {
            let mut s = json!({ "type": "yarn", "factor": factor });
            let so = s.as_object_mut().expect("object");
            if let Some(c) = meta.a_opt("rope.scaling.original_context_length")? {
                put(so, "original_max_position_embeddings", c);
            }
            if let Some(b) = meta.f_opt("rope.scaling.yarn_beta_fast")? {
                put(so, "beta_fast", b);
            }
            if let Some(b) = meta.f_opt("rope.scaling.yarn_beta_slow")? {
                put(so, "beta_slow", b);
            }
            if let Some(a) = meta.f_opt("rope.scaling.yarn_attn_factor")? {
                put(so, "attention_factor", a);
            }
            if let Some(lm) = meta.f_opt("rope.scaling.yarn_log_multiplier")? {
                put(so, "mscale_all_dim", lm / 0.1);
                put(so, "mscale", lm / 0.1);
            }
            s
        }
        other => return Err(meta.err(&key, format!("`{other}` is not supported (none, linear, yarn)"))),
    };
    put(o, "rope_scaling", s);
    Ok(())
}

fn deepseek2_config(meta: &Meta) -> Result<Map<String, Json>> {
    let m = meta.m;
    let mut o = Map::new();
    common(meta, &mut o)?;
    let layers = meta.a("block_count")?;
    let rope = meta.a("rope.dimension_count")?;
    let key_len = match meta.a_opt("attention.key_length_mla")? {
        Some(k) => k,
        None => meta.a("attention.key_length")?,
    };
    let v_dim = match meta.a_opt("attention.value_length_mla")? {
        Some(v) => v,
        None => meta.a("attention.value_length")?,
    };
    if key_len <= rope {
        return Err(
            meta.err(&meta.key("attention.key_length_mla"), format!("{key_len} must exceed the rope dimension {rope}"))
        );
    }
    put(&mut o, "qk_rope_head_dim", rope);
    put(&mut o, "qk_nope_head_dim", key_len - rope);
    put(&mut o, "v_head_dim", v_dim);
    put(&mut o, "kv_lora_rank", meta.a("attention.kv_lora_rank")?);
    if let Some(q) = meta.a_opt("attention.q_lora_rank")?.filter(|&q| q > 0) {
        put(&mut o, "q_lora_rank", q);
    }
    put(&mut o, "intermediate_size", meta.a("feed_forward_length")?);
    let first_dense = meta.a_opt("leading_dense_block_count")?.unwrap_or(0);
    put(&mut o, "first_k_dense_replace", first_dense);
    put(&mut o, "n_routed_experts", meta.a("expert_count")?);
    put(&mut o, "n_shared_experts", meta.a_opt("expert_shared_count")?.unwrap_or(0));
    put(&mut o, "routed_scaling_factor", meta.f_opt("expert_weights_scale")?.unwrap_or(1.0));
    put(&mut o, "norm_topk_prob", meta.b_opt("expert_weights_norm")?.unwrap_or(false));
    let scoring = match meta.a_opt("expert_gating_func")? {
        None | Some(1) => "softmax",
        Some(2) => "sigmoid",
        Some(g) => {
            return Err(
                meta.err(&meta.key("expert_gating_func"), format!("{g} is not supported (1 softmax, 2 sigmoid)"))
            )
        }
    };
    put(&mut o, "scoring_func", scoring);
    let groups = meta.a_opt("expert_group_count")?.unwrap_or(1);
    let groups_used = meta.a_opt("expert_group_used_count")?.unwrap_or(1);
    let has_bias = (first_dense..layers).any(|l| m.has_tensor(&format!("blk.{l}.exp_probs_b.bias")));
    let (model_type, method) = if has_bias {
        ("deepseek_v3", "noaux_tc")
    } else if groups > 1 {
        ("deepseek_v2", "group_limited_greedy")
    } else {
        ("deepseek_v2", "greedy")
    };
    put(&mut o, "model_type", model_type);
    put(&mut o, "topk_method", method);
    put(&mut o, "n_group", groups);
    put(&mut o, "topk_group", groups_used);
    rope_scaling(meta, &mut o)?;
    Ok(o)
}

fn qwen3moe_config(meta: &Meta) -> Result<Map<String, Json>> {
    let mut o = Map::new();
    common(meta, &mut o)?;
    put(&mut o, "model_type", "qwen3_moe");
    gqa_heads(meta, &mut o)?;
    let moe_inter = meta.a("expert_feed_forward_length")?;
    put(&mut o, "intermediate_size", meta.a_opt("feed_forward_length")?.filter(|&f| f > 0).unwrap_or(moe_inter));
    put(&mut o, "num_experts", meta.a("expert_count")?);
    put(&mut o, "norm_topk_prob", meta.b_opt("expert_weights_norm")?.unwrap_or(true));
    rope_scaling(meta, &mut o)?;
    Ok(o)
}

/// `llama` with experts: Mixtral (see the module doc for the q/k row order).
fn mixtral_config(meta: &Meta) -> Result<Map<String, Json>> {
    let experts = meta.a_opt("expert_count")?.unwrap_or(0);
    if experts == 0 {
        return Err(gguf_err(
            meta.m.path(),
            "`llama` without `llama.expert_count` is a dense model; Krasis runs mixture-of-experts models \
             (a Mixtral GGUF is `llama` with experts)",
        ));
    }
    let mut o = Map::new();
    common(meta, &mut o)?;
    put(&mut o, "model_type", "mixtral");
    gqa_heads(meta, &mut o)?;
    put(&mut o, "intermediate_size", meta.a("feed_forward_length")?);
    put(&mut o, "num_local_experts", experts);
    put(&mut o, "rope_interleave", true);
    rope_scaling(meta, &mut o)?;
    Ok(o)
}

/// Qwen2-MoE (`qwen2moe`): every layer MoE (llama.cpp's qwen2moe has no dense layers), q/k/v
/// biases when the file stores them, a shared expert of `expert_shared_feed_forward_length`
/// (else `feed_forward_length`, as llama.cpp) with its sigmoid gate `ffn_gate_inp_shexp`.
/// llama.cpp's qwen2moe graph never renormalises the top-k weights, so `norm_topk_prob` is false
/// unless `expert_weights_norm` says otherwise.
fn qwen2moe_config(meta: &Meta) -> Result<Map<String, Json>> {
    let mut o = Map::new();
    common(meta, &mut o)?;
    put(&mut o, "model_type", "qwen2_moe");
    gqa_heads(meta, &mut o)?;
    let ff = meta.a("feed_forward_length")?;
    put(&mut o, "intermediate_size", ff);
    put(&mut o, "shared_expert_intermediate_size", meta.a_opt("expert_shared_feed_forward_length")?.unwrap_or(ff));
    put(&mut o, "num_experts", meta.a("expert_count")?);
    put(&mut o, "norm_topk_prob", meta.b_opt("expert_weights_norm")?.unwrap_or(false));
    put(&mut o, "qkv_bias", meta.m.has_tensor("blk.0.attn_q.bias"));
    rope_scaling(meta, &mut o)?;
    Ok(o)
}

/// MiniMax-M2 (`minimax-m2`): every layer MoE; the experts' width is
/// `expert_feed_forward_length`, the rotated dims `rope.dimension_count` (the hub's
/// `rotary_dim`); qk-norm over the whole q and k projections (`attn_q_norm` /
/// `attn_k_norm`, as the hub's `qk_norm_type` per_layer) when the file stores it; sigmoid
/// routing (`expert_gating_func` 2, the only kind MiniMax-M2 has) with the correction bias
/// `exp_probs_b` when stored. llama.cpp renormalises the top-k weights, as the hub model does.
fn minimax_m2_config(meta: &Meta) -> Result<Map<String, Json>> {
    let m = meta.m;
    let mut o = Map::new();
    common(meta, &mut o)?;
    put(&mut o, "model_type", "minimax_m2");
    gqa_heads(meta, &mut o)?;
    put(&mut o, "intermediate_size", meta.a("expert_feed_forward_length")?);
    put(&mut o, "num_local_experts", meta.a("expert_count")?);
    if let Some(r) = meta.a_opt("rope.dimension_count")? {
        put(&mut o, "rotary_dim", r);
    }
    match meta.a_opt("expert_gating_func")? {
        None | Some(2) => put(&mut o, "scoring_func", "sigmoid"),
        Some(g) => return Err(meta.err(&meta.key("expert_gating_func"), format!("{g} is not supported (2: sigmoid)"))),
    }
    put(&mut o, "use_qk_norm", m.has_tensor("blk.0.attn_q_norm.weight"));
    put(&mut o, "qk_norm_type", "per_layer");
    put(&mut o, "use_routing_bias", m.has_tensor("blk.0.exp_probs_b.bias"));
    rope_scaling(meta, &mut o)?;
    Ok(o)
}

/// GLM-4.5/4.6/4.7 (`glm4moe`): the first `leading_dense_block_count` layers dense of
/// `feed_forward_length`, the rest MoE of `expert_feed_forward_length` with
/// `expert_shared_count` shared experts; DeepSeek-V3's sigmoid routing (`expert_gating_func` 2)
/// in `expert_group_count` groups of which `expert_group_used_count` are kept, the correction
/// bias `exp_probs_b`, `expert_weights_norm` and `expert_weights_scale`; q/k/v biases and per-head
/// qk-norm when the file stores them; RoPE on the first `rope.dimension_count` dims of each head,
/// in the hub's half-split pairing (llama.cpp's converter does not permute GLM's q/k). The
/// multi-token-prediction blocks (`nextn_predict_layers`, after the last layer) are not loaded.
fn glm4moe_config(meta: &Meta) -> Result<Map<String, Json>> {
    let m = meta.m;
    let mut o = Map::new();
    common(meta, &mut o)?;
    put(&mut o, "model_type", "glm4_moe");
    let blocks = meta.a("block_count")?;
    let nextn = meta.a_opt("nextn_predict_layers")?.unwrap_or(0);
    if nextn >= blocks {
        return Err(meta.err(&meta.key("nextn_predict_layers"), format!("{nextn} is not below block_count {blocks}")));
    }
    put(&mut o, "num_hidden_layers", blocks - nextn);
    let head_dim = match gqa_heads(meta, &mut o)? {
        Some(d) => d,
        None => match meta.a("attention.head_count")? {
            0 => return Err(meta.err(&meta.key("attention.head_count"), "0 heads")),
            heads => meta.a("embedding_length")? / heads,
        },
    };
    put(&mut o, "head_dim", head_dim);
    if let Some(r) = meta.a_opt("rope.dimension_count")? {
        if r == 0 || r > head_dim {
            return Err(
                meta.err(&meta.key("rope.dimension_count"), format!("{r} is outside 1..={head_dim} (head_dim)"))
            );
        }
        put(&mut o, "partial_rotary_factor", r as f64 / head_dim as f64);
    }
    put(&mut o, "intermediate_size", meta.a_opt("feed_forward_length")?.unwrap_or(0));
    put(&mut o, "n_routed_experts", meta.a("expert_count")?);
    put(&mut o, "n_shared_experts", meta.a_opt("expert_shared_count")?.unwrap_or(1));
    put(&mut o, "first_k_dense_replace", meta.a_opt("leading_dense_block_count")?.unwrap_or(0));
    put(&mut o, "n_group", meta.a_opt("expert_group_count")?.unwrap_or(1));
    put(&mut o, "topk_group", meta.a_opt("expert_group_used_count")?.unwrap_or(1));
    put(&mut o, "norm_topk_prob", meta.b_opt("expert_weights_norm")?.unwrap_or(true));
    put(&mut o, "routed_scaling_factor", meta.f_opt("expert_weights_scale")?.unwrap_or(1.0));
    match meta.a_opt("expert_gating_func")? {
        None | Some(2) => {}
        Some(g) => return Err(meta.err(&meta.key("expert_gating_func"), format!("{g} is not supported (2: sigmoid)"))),
    }
    put(&mut o, "attention_bias", m.has_tensor("blk.0.attn_q.bias"));
    put(&mut o, "use_qk_norm", m.has_tensor("blk.0.attn_q_norm.weight"));
    rope_scaling(meta, &mut o)?;
    Ok(o)
}

/// gpt-oss (`gpt-oss`): every layer MoE of `expert_feed_forward_length`, the router a linear with a
/// bias (`ffn_gate_inp.bias`), experts with biases (`ffn_{gate,up,down}_exps.bias`, one row per
/// expert) and the clamped SwiGLU, attention with q/k/v/o biases and one sink logit per head
/// (`attn_sinks`), sliding windows of `attention.sliding_window` on the even layers and full
/// attention on the odd ones (llama.cpp's and transformers' pattern for gpt-oss; the file does not
/// store it), YaRN without truncating its correction range (the hub's `truncate: false`, which the
/// file does not store either). The SwiGLU's limit is the published 7.0 (llama.cpp hard-codes it).
/// The experts are MXFP4 as the converter copies them from the hub's checkpoint.
fn gpt_oss_config(meta: &Meta) -> Result<Map<String, Json>> {
    let m = meta.m;
    let mut o = Map::new();
    common(meta, &mut o)?;
    put(&mut o, "model_type", "gpt_oss");
    gqa_heads(meta, &mut o)?;
    put(&mut o, "intermediate_size", meta.a("expert_feed_forward_length")?);
    put(&mut o, "num_local_experts", meta.a("expert_count")?);
    if let Some(w) = meta.a_opt("attention.sliding_window")? {
        put(&mut o, "sliding_window", w);
    }
    put(&mut o, "attention_bias", m.has_tensor("blk.0.attn_q.bias"));
    rope_scaling(meta, &mut o)?;
    if let Some(Json::Object(s)) = o.get_mut("rope_scaling") {
        if s.get("type").and_then(Json::as_str) == Some("yarn") {
            s.insert("truncate".into(), Json::Bool(false));
        }
    }
    Ok(o)
}

/// The spec of a GGUF model and where each canonical tensor lives in it.
pub fn spec_from_gguf(m: &GgufModel) -> Result<(ModelSpec, TensorMap)> {
    let arch = m
        .meta_str("general.architecture")
        .ok_or_else(|| gguf_err(m.path(), "metadata `general.architecture` is missing or not a string"))?;
    let meta = Meta { m, arch };
    let config = match arch {
        "deepseek2" => deepseek2_config(&meta)?,
        "qwen3moe" => qwen3moe_config(&meta)?,
        "llama" => mixtral_config(&meta)?,
        "qwen2moe" => qwen2moe_config(&meta)?,
        "minimax-m2" => minimax_m2_config(&meta)?,
        "glm4moe" => glm4moe_config(&meta)?,
        "gpt-oss" => gpt_oss_config(&meta)?,
        "qwen3next" => qwen3next::config(&meta, false)?,
        "qwen35moe" => qwen3next::config(&meta, true)?,
        other => {
            return Err(ModelError::UnsupportedArch {
                path: m.path().to_path_buf(),
                found: format!("{other} (general.architecture)"),
                supported: SUPPORTED.join(", "),
            })
        }
    };
    let mut spec = parse_config(&Json::Object(config).to_string(), m.path())?;
    if qwen3next::ARCHS.contains(&arch) {
        // llama.cpp's converter stored the gains `1 + w` of the zero-centred norms.
        spec.norm_plus_one = false;
    }
    let map = tensor_map(&spec, m, arch)?;
    let types = expert_source_types(m, &spec);
    // Every MoE layer's experts are stacked tensors (the mapping above checked they exist).
    if types.len() == spec.moe_layers().count() {
        spec.expert_source_bits = types.iter().map(|(_, t)| t.map(GgmlType::code_bits)).collect();
        spec.expert_source_types = types.iter().map(|(_, t)| t.map(GgmlType::id)).collect();
        // Every routed expert in ggml's MXFP4 (gpt-oss's, as llama.cpp's converter copies them):
        // the same format as a gpt-oss checkpoint's, so `auto` keeps it as stored, as there.
        if !types.is_empty() && types.iter().all(|(_, t)| t.iter().all(|&ty| ty == GgmlType::Mxfp4)) {
            spec.source_quant = crate::spec::SourceQuant::Mxfp4;
        }
    }
    Ok((spec, map))
}

struct Mapper<'a> {
    m: &'a GgufModel,
    map: TensorMap,
    missing: Vec<String>,
    /// Stored tensors whose shape is not the one the spec implies: `name [found], expected [..]`.
    wrong: Vec<String>,
}

impl Mapper<'_> {
    fn need(&mut self, g: &str) {
        if !self.m.has_tensor(g) {
            self.missing.push(g.to_string());
        }
    }

    fn whole(&mut self, t: &TensorSpec, g: String) {
        self.need(&g);
        self.map.insert(t.name.clone(), GgufTensorRef::Whole(g));
    }

    /// `t` from a rearranged GGUF tensor, whose stored shape is checked here.
    fn rearranged(&mut self, t: &TensorSpec, r: Rearranged) {
        match self.m.tensor_info(&r.from) {
            None => self.missing.push(r.from.clone()),
            Some((_, info)) if info.shape() != r.stored => {
                self.wrong.push(format!("`{}` {:?}, expected {:?}", r.from, info.shape(), r.stored))
            }
            Some(_) => {}
        }
        self.map.insert(t.name.clone(), GgufTensorRef::Rearranged(r));
    }

    fn mlp(&mut self, t: &MlpTensors, l: usize, suffix: &str) {
        self.whole(&t.gate, format!("blk.{l}.ffn_gate{suffix}.weight"));
        self.whole(&t.up, format!("blk.{l}.ffn_up{suffix}.weight"));
        self.whole(&t.down, format!("blk.{l}.ffn_down{suffix}.weight"));
    }
}

/// Canonical → GGUF names for every tensor of the spec's inventory; names the first few GGUF
/// tensors that are missing.
fn tensor_map(spec: &ModelSpec, m: &GgufModel, arch: &str) -> Result<TensorMap> {
    let inv = model_tensors(spec);
    let mut x = Mapper { m, map: TensorMap::new(), missing: Vec::new(), wrong: Vec::new() };
    let qwen3next = qwen3next::ARCHS.contains(&arch);
    x.whole(&inv.embed, "token_embd.weight".into());
    x.whole(&inv.final_norm, "output_norm.weight".into());
    if !inv.tied_lm_head {
        x.whole(&inv.lm_head, "output.weight".into());
    }
    for (l, layer) in inv.layers.iter().enumerate() {
        let b = |s: &str| format!("blk.{l}.{s}");
        x.whole(&layer.input_norm, b("attn_norm.weight"));
        // llama.cpp names the post-attention norm by architecture.
        let post_attention = qwen3next || arch == "glm4moe" || arch == "gpt-oss";
        x.whole(&layer.post_norm, b(if post_attention { "post_attention_norm.weight" } else { "ffn_norm.weight" }));
        match &layer.attention {
            AttentionTensors::Mla { q, kv_a, kv_a_norm, kv_b, o } => {
                match q {
                    QueryTensors::Direct(q) => x.whole(q, b("attn_q.weight")),
                    QueryTensors::LowRank { a, norm, b: qb } => {
                        x.whole(a, b("attn_q_a.weight"));
                        x.whole(norm, b("attn_q_a_norm.weight"));
                        x.whole(qb, b("attn_q_b.weight"));
                    }
                }
                x.whole(kv_a, b("attn_kv_a_mqa.weight"));
                x.whole(kv_a_norm, b("attn_kv_a_norm.weight"));
                if m.has_tensor(&b("attn_kv_b.weight")) {
                    x.whole(kv_b, b("attn_kv_b.weight"));
                } else {
                    let (k_b, v_b) = (b("attn_k_b.weight"), b("attn_v_b.weight"));
                    x.need(&k_b);
                    x.need(&v_b);
                    x.map.insert(kv_b.name.clone(), GgufTensorRef::KvB { k_b, v_b });
                }
                x.whole(o, b("attn_output.weight"));
            }
            AttentionTensors::GatedDeltaNet { qkv, z, b: beta, a, conv, a_log, dt_bias, norm, out } => {
                let t = qwen3next::DeltaNetTensors { qkv, z, b: beta, a, conv, a_log, dt_bias, norm, out };
                qwen3next::map_delta_net(&mut x, spec, l, t, arch == "qwen35moe");
            }
            AttentionTensors::Gqa { q, k, v, o, qk_norm, qkv_bias, o_bias, sinks } => {
                x.whole(q, b("attn_q.weight"));
                x.whole(k, b("attn_k.weight"));
                x.whole(v, b("attn_v.weight"));
                x.whole(o, b("attn_output.weight"));
                if let Some([qb, kb, vb]) = qkv_bias {
                    x.whole(qb, b("attn_q.bias"));
                    x.whole(kb, b("attn_k.bias"));
                    x.whole(vb, b("attn_v.bias"));
                }
                if let Some(ob) = o_bias {
                    x.whole(ob, b("attn_output.bias"));
                }
                if let Some((qn, kn)) = qk_norm {
                    x.whole(qn, b("attn_q_norm.weight"));
                    x.whole(kn, b("attn_k_norm.weight"));
                }
                if let Some(sk) = sinks {
                    x.whole(sk, b("attn_sinks.weight"));
                }
            }
        }
        match &layer.ffn {
            FfnTensors::Dense(d) => x.mlp(d, l, ""),
            FfnTensors::Moe { router, bias, experts, shared, shared_gate } => {
                x.whole(router, b("ffn_gate_inp.weight"));
                if let Some(bias) = bias {
                    // A router that is a linear with a bias (gpt-oss) stores it beside the router;
                    // a correction bias (DeepSeek-V3's rule) is `exp_probs_b`.
                    let name = if bias.role == crate::model::tensors::TensorRole::Bias {
                        "ffn_gate_inp.bias"
                    } else {
                        "exp_probs_b.bias"
                    };
                    x.whole(bias, b(name));
                }
                for (i, proj) in ["gate", "up", "down"].into_iter().enumerate() {
                    let stacked = b(&format!("ffn_{proj}_exps.weight"));
                    x.need(&stacked);
                    let biases = b(&format!("ffn_{proj}_exps.bias"));
                    if experts.iter().any(|t| t.bias.is_some()) {
                        x.need(&biases);
                    }
                    for (e, t) in experts.iter().enumerate() {
                        let w = [&t.gate, &t.up, &t.down][i];
                        x.map.insert(w.name.clone(), GgufTensorRef::Expert { stacked: stacked.clone(), expert: e });
                        if let Some(bias) = &t.bias {
                            let r = GgufTensorRef::Expert { stacked: biases.clone(), expert: e };
                            x.map.insert(bias[i].name.clone(), r);
                        }
                    }
                }
                if let Some(s) = shared {
                    x.mlp(s, l, "_shexp");
                }
                if let Some(g) = shared_gate {
                    x.whole(g, b("ffn_gate_inp_shexp.weight"));
                }
            }
        }
    }
    let Mapper { map, missing, wrong, .. } = x;
    if let Some(w) = wrong.first() {
        return Err(gguf_err(
            m.path(),
            format!("{} tensor(s) have another shape than the metadata implies: tensor {w}", wrong.len()),
        ));
    }
    if !missing.is_empty() {
        let shown: Vec<&str> = missing.iter().take(5).map(String::as_str).collect();
        return Err(gguf_err(
            m.path(),
            format!(
                "{} tensor(s) the {} architecture needs are missing: {}{}",
                missing.len(),
                m.meta_str("general.architecture").unwrap_or("?"),
                shown.join(", "),
                if missing.len() > 5 { ", …" } else { "" }
            ),
        ));
    }
    Ok(map)
}

/// The stored types of the routed experts' projections (gate, up, down) per MoE layer (the
/// precision each suggests is `crate::placement::precision`'s rule).
pub fn expert_source_types(m: &GgufModel, spec: &ModelSpec) -> Vec<(usize, [GgmlType; 3])> {
    spec.moe_layers()
        .filter_map(|l| {
            let ty = |p: &str| m.tensor_info(&format!("blk.{l}.ffn_{p}_exps.weight")).map(|(_, t)| t.ty);
            Some((l, [ty("gate")?, ty("up")?, ty("down")?]))
        })
        .collect()
}
