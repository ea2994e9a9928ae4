//! `config.json` → [`ModelSpec`]. Accepts the hub's `rope_theta` + `rope_scaling` and
//! transformers-5 `rope_parameters`. Every error names the file and the field.

use std::path::Path;

use serde_json::{Map, Value};

use crate::error::{ModelError, Result};
use crate::spec::*;

struct Fields<'a> {
    path: &'a Path,
    obj: &'a Map<String, Value>,
}

impl<'a> Fields<'a> {
    fn err(&self, field: &str, msg: impl Into<String>) -> ModelError {
        ModelError::Config { path: self.path.to_path_buf(), field: field.to_string(), msg: msg.into() }
    }

    fn present(&self, field: &str) -> Option<&'a Value> {
        self.obj.get(field).filter(|v| !v.is_null())
    }

    fn usize_opt(&self, field: &str) -> Result<Option<usize>> {
        match self.present(field) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .map(|x| Some(x as usize))
                .ok_or_else(|| self.err(field, format!("expected a non-negative integer, found {v}"))),
        }
    }

    fn usize(&self, field: &str) -> Result<usize> {
        self.usize_opt(field)?.ok_or_else(|| self.err(field, "missing (required for this architecture)"))
    }

    /// A required dimension: present and > 0.
    fn dim(&self, field: &str) -> Result<usize> {
        let v = self.usize(field)?;
        if v == 0 {
            return Err(self.err(field, "must be greater than 0"));
        }
        Ok(v)
    }

    fn f64_opt(&self, field: &str) -> Result<Option<f64>> {
        match self.present(field) {
            None => Ok(None),
            Some(v) => v.as_f64().map(Some).ok_or_else(|| self.err(field, format!("expected a number, found {v}"))),
        }
    }

    fn bool_or(&self, field: &str, default: bool) -> Result<bool> {
        match self.present(field) {
            None => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(v) => Err(self.err(field, format!("expected true or false, found {v}"))),
        }
    }

    fn str_opt(&self, field: &str) -> Result<Option<&'a str>> {
        match self.present(field) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.as_str())),
            Some(v) => Err(self.err(field, format!("expected a string, found {v}"))),
        }
    }

    /// `eos_token_id` may be an integer or a list of integers.
    fn token_ids(&self, field: &str) -> Result<Vec<u32>> {
        match self.present(field) {
            None => Ok(vec![]),
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| {
                    v.as_u64()
                        .map(|x| x as u32)
                        .ok_or_else(|| self.err(field, format!("expected token ids, found {v}")))
                })
                .collect(),
            Some(v) => v
                .as_u64()
                .map(|x| vec![x as u32])
                .ok_or_else(|| self.err(field, format!("expected a token id, found {v}"))),
        }
    }
}

/// What a model path must be, for the errors that find something else.
const MODEL_LAYOUT: &str = "a model is a Hugging Face-style directory holding config.json, the *.safetensors weights \
     (with model.safetensors.index.json when split) and tokenizer.json, or a GGUF file (*.gguf)";

/// Read and parse `<dir>/config.json`. A path that is a file, or a directory without
/// `config.json`, is an error saying what a model directory holds.
pub fn load_config(dir: &Path) -> Result<ModelSpec> {
    if dir.is_file() {
        let hint = match dir.parent().filter(|p| !p.as_os_str().is_empty() && p.join("config.json").is_file()) {
            Some(parent) => format!("; give its directory {}", parent.display()),
            None => String::new(),
        };
        return Err(ModelError::Invalid(format!(
            "model path {} is a file, not a model directory{hint} ({MODEL_LAYOUT})",
            dir.display()
        )));
    }
    if !dir.is_dir() {
        return Err(ModelError::MissingDir(dir.to_path_buf()));
    }
    let path = dir.join("config.json");
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(ModelError::Invalid(format!("{}: {e}: {MODEL_LAYOUT}", path.display())))
        }
        Err(e) => return Err(ModelError::io(&path, e)),
    };
    parse_config(&text, &path)
}

/// Parse config text (`path` is only used in messages).
pub fn parse_config(text: &str, path: &Path) -> Result<ModelSpec> {
    let value: Value =
        serde_json::from_str(text).map_err(|e| ModelError::Json { path: path.to_path_buf(), msg: e.to_string() })?;
    let obj = value
        .as_object()
        .ok_or_else(|| ModelError::Json { path: path.to_path_buf(), msg: "top level is not a JSON object".into() })?;
    let f = Fields { path, obj };
    let model_type = f.str_opt("model_type")?.ok_or_else(|| f.err("model_type", "missing"))?;
    let arch = match model_type {
        "deepseek_v2" => Arch::DeepseekV2,
        "deepseek_v3" => Arch::DeepseekV3,
        "qwen3_moe" => Arch::Qwen3Moe,
        other => {
            return Err(ModelError::UnsupportedArch {
                path: path.to_path_buf(),
                found: other.to_string(),
                supported: Arch::SUPPORTED.join(", "),
            })
        }
    };
    match arch {
        Arch::DeepseekV2 | Arch::DeepseekV3 => parse_deepseek(&f, arch),
        Arch::Qwen3Moe => parse_qwen3_moe(&f),
    }
}

struct Common {
    vocab_size: usize,
    hidden_size: usize,
    num_layers: usize,
    rms_norm_eps: f32,
    tie_word_embeddings: bool,
    bos_token_id: Option<u32>,
    eos_token_ids: Vec<u32>,
    max_position_embeddings: usize,
}

fn parse_common(f: &Fields) -> Result<Common> {
    if let Some(act) = f.str_opt("hidden_act")? {
        if act != "silu" {
            return Err(f.err("hidden_act", format!("`{act}` is not supported (only silu)")));
        }
    }
    if f.bool_or("attention_bias", false)? {
        return Err(f.err("attention_bias", "attention biases are not supported"));
    }
    let eps = f.f64_opt("rms_norm_eps")?.unwrap_or(1e-6);
    if !(eps > 0.0 && eps < 1.0) {
        return Err(f.err("rms_norm_eps", format!("{eps} is out of range")));
    }
    Ok(Common {
        vocab_size: f.dim("vocab_size")?,
        hidden_size: f.dim("hidden_size")?,
        num_layers: f.dim("num_hidden_layers")?,
        rms_norm_eps: eps as f32,
        tie_word_embeddings: f.bool_or("tie_word_embeddings", false)?,
        bos_token_id: f.token_ids("bos_token_id")?.first().copied(),
        eos_token_ids: f.token_ids("eos_token_id")?,
        max_position_embeddings: f.usize_opt("max_position_embeddings")?.unwrap_or(4096),
    })
}

/// The rope block: transformers-5 `rope_parameters` (with `rope_theta` inside) or the hub's
/// top-level `rope_theta` + `rope_scaling`.
fn parse_rope(f: &Fields, dim: usize, pairing: RopePairing, max_pos: usize) -> Result<RopeSpec> {
    let (params, params_field): (Option<&Map<String, Value>>, &str) = match f.present("rope_parameters") {
        Some(Value::Object(o)) => (Some(o), "rope_parameters"),
        Some(v) => return Err(f.err("rope_parameters", format!("expected an object, found {v}"))),
        None => match f.present("rope_scaling") {
            Some(Value::Object(o)) => (Some(o), "rope_scaling"),
            Some(v) => return Err(f.err("rope_scaling", format!("expected an object or null, found {v}"))),
            None => (None, "rope_scaling"),
        },
    };
    let sub = params.map(|obj| Fields { path: f.path, obj });
    let theta = match sub.as_ref().and_then(|s| s.present("rope_theta")) {
        Some(v) => v.as_f64().ok_or_else(|| f.err("rope_parameters.rope_theta", "expected a number"))?,
        None => f.f64_opt("rope_theta")?.unwrap_or(10000.0),
    };
    if theta.is_nan() || theta <= 1.0 {
        return Err(f.err("rope_theta", format!("{theta} must be greater than 1")));
    }
    let Some(s) = sub else {
        return Ok(RopeSpec { theta, dim, pairing, scaling: RopeScaling::None });
    };
    let field = |name: &str| format!("{params_field}.{name}");
    let kind = match (s.str_opt("rope_type")?, s.str_opt("type")?) {
        (Some(t), _) | (None, Some(t)) => t,
        (None, None) => "default",
    };
    let factor = |s: &Fields| -> Result<f64> {
        let v = s.f64_opt("factor")?.ok_or_else(|| f.err(&field("factor"), "missing"))?;
        if v.is_nan() || v < 1.0 {
            return Err(f.err(&field("factor"), format!("{v} must be >= 1")));
        }
        Ok(v)
    };
    let scaling = match kind {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear { factor: factor(&s)? },
        "yarn" => RopeScaling::Yarn {
            factor: factor(&s)?,
            original_max_position_embeddings: s.f64_opt("original_max_position_embeddings")?.unwrap_or(max_pos as f64),
            beta_fast: s.f64_opt("beta_fast")?.unwrap_or(32.0),
            beta_slow: s.f64_opt("beta_slow")?.unwrap_or(1.0),
            mscale: s.f64_opt("mscale")?,
            mscale_all_dim: s.f64_opt("mscale_all_dim")?,
            attention_factor: s.f64_opt("attention_factor")?,
            truncate: s.bool_or("truncate", true)?,
        },
        other => {
            return Err(
                f.err(&field("rope_type"), format!("`{other}` is not supported (supported: default, linear, yarn)"))
            )
        }
    };
    Ok(RopeSpec { theta, dim, pairing, scaling })
}

/// YaRN's magnitude correction, as DeepSeek defines it.
pub fn yarn_get_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

fn parse_source_quant(f: &Fields) -> Result<SourceQuant> {
    let Some(q) = f.present("quantization_config") else {
        return Ok(SourceQuant::None);
    };
    let Some(obj) = q.as_object() else {
        return Err(f.err("quantization_config", "expected an object"));
    };
    let s = Fields { path: f.path, obj };
    match s.str_opt("quant_method")? {
        Some("fp8") => {
            if let Some(fmt) = s.str_opt("fmt")? {
                if fmt != "e4m3" {
                    return Err(f.err("quantization_config.fmt", format!("`{fmt}` is not supported (only e4m3)")));
                }
            }
            let (r, c) = match s.present("weight_block_size") {
                Some(Value::Array(a)) if a.len() == 2 => {
                    let r = a[0].as_u64().unwrap_or(0) as usize;
                    let c = a[1].as_u64().unwrap_or(0) as usize;
                    if r == 0 || c == 0 {
                        return Err(f.err("quantization_config.weight_block_size", "expected two positive integers"));
                    }
                    (r, c)
                }
                None => (128, 128),
                Some(v) => {
                    return Err(
                        f.err("quantization_config.weight_block_size", format!("expected [rows, cols], found {v}"))
                    )
                }
            };
            Ok(SourceQuant::Fp8Block { block_rows: r, block_cols: c })
        }
        Some(other) => {
            Err(f.err("quantization_config.quant_method", format!("`{other}` is not supported (supported: fp8)")))
        }
        None => Err(f.err("quantization_config.quant_method", "missing")),
    }
}

fn parse_deepseek(f: &Fields, arch: Arch) -> Result<ModelSpec> {
    let c = parse_common(f)?;
    let heads = f.dim("num_attention_heads")?;
    let q_lora_rank = f.usize_opt("q_lora_rank")?.filter(|&r| r > 0);
    let kv_lora_rank = f.dim("kv_lora_rank")?;
    let qk_nope_head_dim = f.dim("qk_nope_head_dim")?;
    let qk_rope_head_dim = f.dim("qk_rope_head_dim")?;
    let v_head_dim = f.dim("v_head_dim")?;
    if qk_rope_head_dim % 2 != 0 {
        return Err(f.err("qk_rope_head_dim", "must be even"));
    }
    let pairing = if f.bool_or("rope_interleave", true)? { RopePairing::Interleaved } else { RopePairing::Halves };
    let rope = parse_rope(f, qk_rope_head_dim, pairing, c.max_position_embeddings)?;
    let mut softmax_scale = ((qk_nope_head_dim + qk_rope_head_dim) as f64).powf(-0.5);
    if let RopeScaling::Yarn { factor, mscale_all_dim: Some(m), .. } = rope.scaling {
        if m != 0.0 {
            let ms = yarn_get_mscale(factor, m);
            softmax_scale *= ms * ms;
        }
    }

    let n_routed = f.usize_opt("n_routed_experts")?.unwrap_or(0);
    let first_dense = f.usize_opt("first_k_dense_replace")?.unwrap_or(0);
    let freq = f.usize_opt("moe_layer_freq")?.unwrap_or(1);
    if freq == 0 {
        return Err(f.err("moe_layer_freq", "must be greater than 0"));
    }
    let intermediate = f.dim("intermediate_size")?;
    let layers: Vec<FfnKind> = (0..c.num_layers)
        .map(|l| {
            if n_routed > 0 && l >= first_dense && l % freq == 0 {
                FfnKind::Moe
            } else {
                FfnKind::Dense { intermediate_size: intermediate }
            }
        })
        .collect();
    let moe = if n_routed > 0 {
        let top_k = f.dim("num_experts_per_tok")?;
        if top_k > n_routed {
            return Err(f.err("num_experts_per_tok", format!("{top_k} exceeds n_routed_experts {n_routed}")));
        }
        let moe_inter = f.dim("moe_intermediate_size")?;
        let n_shared = f.usize_opt("n_shared_experts")?.unwrap_or(0);
        let scoring = match f.str_opt("scoring_func")?.unwrap_or("softmax") {
            "softmax" => ScoringFunc::Softmax,
            "sigmoid" => ScoringFunc::Sigmoid,
            other => return Err(f.err("scoring_func", format!("`{other}` is not supported (softmax, sigmoid)"))),
        };
        let default_method = if arch == Arch::DeepseekV3 { "noaux_tc" } else { "greedy" };
        let method = f.str_opt("topk_method")?.unwrap_or(default_method);
        let groups = |f: &Fields| -> Result<(usize, usize)> {
            let n_group = f.dim("n_group")?;
            let topk_group = f.dim("topk_group")?;
            if n_routed % n_group != 0 {
                return Err(f.err("n_group", format!("{n_group} does not divide n_routed_experts {n_routed}")));
            }
            if topk_group > n_group {
                return Err(f.err("topk_group", format!("{topk_group} exceeds n_group {n_group}")));
            }
            if top_k > topk_group * (n_routed / n_group) {
                return Err(f.err("num_experts_per_tok", "exceeds the experts in the kept groups"));
            }
            Ok((n_group, topk_group))
        };
        let topk = match method {
            "greedy" => TopkMethod::Greedy,
            "group_limited_greedy" => {
                let (n_group, topk_group) = groups(f)?;
                TopkMethod::GroupLimitedGreedy { n_group, topk_group }
            }
            "noaux_tc" => {
                let (n_group, topk_group) = groups(f)?;
                if n_routed / n_group < 2 {
                    return Err(f.err("n_group", "noaux_tc needs at least 2 experts per group"));
                }
                TopkMethod::NoauxTc { n_group, topk_group }
            }
            other => {
                return Err(f.err(
                    "topk_method",
                    format!("`{other}` is not supported (greedy, group_limited_greedy, noaux_tc)"),
                ))
            }
        };
        Some(MoeSpec {
            n_routed_experts: n_routed,
            moe_intermediate_size: moe_inter,
            shared_intermediate_size: moe_inter * n_shared,
            routing: RoutingRule {
                scoring,
                topk,
                top_k,
                norm_topk_prob: f.bool_or("norm_topk_prob", false)?,
                routed_scaling_factor: f.f64_opt("routed_scaling_factor")?.unwrap_or(1.0) as f32,
            },
        })
    } else {
        None
    };
    Ok(ModelSpec {
        arch,
        vocab_size: c.vocab_size,
        hidden_size: c.hidden_size,
        num_layers: c.num_layers,
        rms_norm_eps: c.rms_norm_eps,
        tie_word_embeddings: c.tie_word_embeddings,
        bos_token_id: c.bos_token_id,
        eos_token_ids: c.eos_token_ids,
        max_position_embeddings: c.max_position_embeddings,
        attention: AttentionSpec::Mla {
            heads,
            q_lora_rank,
            kv_lora_rank,
            qk_nope_head_dim,
            qk_rope_head_dim,
            v_head_dim,
        },
        rope,
        softmax_scale: softmax_scale as f32,
        moe,
        layers,
        source_quant: parse_source_quant(f)?,
        expert_source_bits: Vec::new(),
    })
}

fn parse_qwen3_moe(f: &Fields) -> Result<ModelSpec> {
    let c = parse_common(f)?;
    let heads = f.dim("num_attention_heads")?;
    let kv_heads = f.usize_opt("num_key_value_heads")?.unwrap_or(heads);
    if kv_heads == 0 || heads % kv_heads != 0 {
        return Err(f.err("num_key_value_heads", format!("{kv_heads} must divide num_attention_heads {heads}")));
    }
    let head_dim = match f.usize_opt("head_dim")? {
        Some(d) if d > 0 => d,
        Some(_) => return Err(f.err("head_dim", "must be greater than 0")),
        None => c.hidden_size / heads,
    };
    if head_dim % 2 != 0 {
        return Err(f.err("head_dim", "must be even"));
    }
    if f.bool_or("use_sliding_window", false)? {
        return Err(f.err("use_sliding_window", "sliding-window attention is not supported"));
    }
    let rope = parse_rope(f, head_dim, RopePairing::Halves, c.max_position_embeddings)?;
    let n_experts = f.usize_opt("num_experts")?.unwrap_or(0);
    let step = f.usize_opt("decoder_sparse_step")?.unwrap_or(1);
    if step == 0 {
        return Err(f.err("decoder_sparse_step", "must be greater than 0"));
    }
    let mlp_only: Vec<usize> = match f.present("mlp_only_layers") {
        None => vec![],
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| {
                v.as_u64()
                    .map(|x| x as usize)
                    .ok_or_else(|| f.err("mlp_only_layers", format!("expected layer indices, found {v}")))
            })
            .collect::<Result<_>>()?,
        Some(v) => return Err(f.err("mlp_only_layers", format!("expected a list, found {v}"))),
    };
    let intermediate = f.dim("intermediate_size")?;
    let layers = (0..c.num_layers)
        .map(|l| {
            if !mlp_only.contains(&l) && n_experts > 0 && (l + 1) % step == 0 {
                FfnKind::Moe
            } else {
                FfnKind::Dense { intermediate_size: intermediate }
            }
        })
        .collect();
    let moe = if n_experts > 0 {
        let top_k = f.dim("num_experts_per_tok")?;
        if top_k > n_experts {
            return Err(f.err("num_experts_per_tok", format!("{top_k} exceeds num_experts {n_experts}")));
        }
        Some(MoeSpec {
            n_routed_experts: n_experts,
            moe_intermediate_size: f.dim("moe_intermediate_size")?,
            shared_intermediate_size: 0,
            routing: RoutingRule {
                scoring: ScoringFunc::Softmax,
                topk: TopkMethod::Greedy,
                top_k,
                norm_topk_prob: f.bool_or("norm_topk_prob", false)?,
                routed_scaling_factor: 1.0,
            },
        })
    } else {
        None
    };
    Ok(ModelSpec {
        arch: Arch::Qwen3Moe,
        vocab_size: c.vocab_size,
        hidden_size: c.hidden_size,
        num_layers: c.num_layers,
        rms_norm_eps: c.rms_norm_eps,
        tie_word_embeddings: c.tie_word_embeddings,
        bos_token_id: c.bos_token_id,
        eos_token_ids: c.eos_token_ids,
        max_position_embeddings: c.max_position_embeddings,
        attention: AttentionSpec::Gqa { heads, kv_heads, head_dim, qk_norm: true },
        rope,
        softmax_scale: (head_dim as f64).powf(-0.5) as f32,
        moe,
        layers,
        source_quant: parse_source_quant(f)?,
        expert_source_bits: Vec::new(),
    })
}
