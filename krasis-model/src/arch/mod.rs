//! `config.json` → [`ModelSpec`]. Accepts the hub's `rope_theta` + `rope_scaling` and
//! transformers-5 `rope_parameters`. Every error names the file and the field.
//!
//! This file reads what every family shares (the common fields, rope, the source quantisation)
//! and dispatches on `model_type`; each family's own fields are read in its file
//! (`arch/deepseek.rs`, `arch/qwen3_moe.rs`). A new family is a file here plus the options it needs in the
//! operations of the two devices.

mod deepseek;
mod glm4_moe;
mod gpt_oss;
mod minimax_m2;
mod mixtral;
mod quant_fp4;
mod qwen2_moe;
mod qwen3_moe;
mod qwen3_next;

#[cfg(test)]
mod glm4_moe_tests;
#[cfg(test)]
mod gpt_oss_tests;
#[cfg(test)]
mod kimi_tests;
#[cfg(test)]
mod minimax_m2_tests;
#[cfg(test)]
mod qwen2_moe_tests;
#[cfg(test)]
mod qwen3_next_tests;

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

/// What a checkpoint's `config.json` (and `generation_config.json`) say: the [`ModelSpec`], and
/// where the text model's tensors are in the weight files.
#[derive(Clone, Debug, PartialEq)]
pub struct CheckpointConfig {
    pub spec: ModelSpec,
    /// The prefix every tensor of the text model carries in the weight files (`language_model.`
    /// for Kimi-K2.5, whose `config.json` nests the text model in `text_config`); the canonical
    /// name is what follows it. Empty when the stored names are the canonical ones.
    pub tensor_prefix: &'static str,
    /// What replaces `tensor_prefix` in a canonical name (`model.` for Qwen3.5, whose text model
    /// is stored under `model.language_model.`); empty when the prefix is only dropped.
    pub canonical_prefix: &'static str,
    /// How the checkpoint stores tensors the inventory names otherwise.
    pub layout: StoredLayout,
    /// What Krasis leaves out of the checkpoint, one sentence each (the vision tower of a
    /// vision-language model), for the caller to show.
    pub notes: Vec<String>,
}

/// How a checkpoint stores tensors that the inventory ([`crate::model::tensors`]) names one
/// way: what the weight source adapts when it opens the files
/// ([`crate::source::adapt::AdaptedSource`]), so the engines see the canonical tensors.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StoredLayout {
    /// The routed experts of a layer are two 3-D tensors without a `.weight` suffix:
    /// `experts.gate_up_proj` `[E, 2I, H]` (each expert's gate rows, then its up rows) and
    /// `experts.down_proj` `[E, H, I]` (Qwen3.5).
    pub fused_experts: bool,
    /// A DeltaNet layer's input projections are fused per key head: `in_proj_qkvz` holds, for
    /// each key head, its q rows, k rows, then the v and z rows of the value heads it serves;
    /// `in_proj_ba` holds, per key head, the b rows then the a rows of those value heads
    /// (Qwen3-Next).
    pub fused_delta_net_inputs: bool,
    /// The routed experts of a layer are fused as gpt-oss publishes them, under
    /// `mlp.experts.`: `gate_up_proj` `[E, H, 2I]` (x · W, the columns alternating gate j and up
    /// j) with `gate_up_proj_bias` `[E, 2I]`, `down_proj` `[E, I, H]` with `down_proj_bias`
    /// `[E, H]`; or in MXFP4, `gate_up_proj_blocks` `[E, 2I, H/32, 16]` and
    /// `gate_up_proj_scales` `[E, 2I, H/32]` (rows are outputs, alternating gate and up),
    /// `down_proj_blocks` / `down_proj_scales` likewise `[E, H, I/32, …]`.
    pub gpt_oss_experts: bool,
}

/// Read and parse `<dir>/config.json`. A path that is a file, or a directory without
/// `config.json`, is an error saying what a model directory holds.
///
/// `generation_config.json`, when present, gives the end-of-sequence ids generation stops at:
/// its `eos_token_id` replaces `config.json`'s (as transformers' `generate` uses it; Kimi-K2's
/// end of turn, `<|im_end|>`, is only there).
pub fn load_config(dir: &Path) -> Result<ModelSpec> {
    Ok(load_checkpoint_config(dir)?.spec)
}

/// [`load_config`], with what the configuration says about the weight files' layout.
pub fn load_checkpoint_config(dir: &Path) -> Result<CheckpointConfig> {
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
    let mut cfg = parse_checkpoint_config(&text, &path)?;
    if cfg.spec.source_quant == SourceQuant::None {
        if let Some(q) = quant_fp4::hf_quant_config(dir)? {
            cfg.spec.source_quant = q;
        }
    }
    let gen_path = dir.join("generation_config.json");
    match std::fs::read_to_string(&gen_path) {
        Ok(gen) => {
            if let Some(eos) = parse_generation_eos(&gen, &gen_path)? {
                cfg.spec.eos_token_ids = eos;
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(ModelError::io(&gen_path, e)),
    }
    Ok(cfg)
}

/// The `eos_token_id` of a `generation_config.json` (an id or a list of ids); `None` when it
/// names none (absent, null or an empty list: `config.json`'s ids stay).
pub fn parse_generation_eos(text: &str, path: &Path) -> Result<Option<Vec<u32>>> {
    let value: Value =
        serde_json::from_str(text).map_err(|e| ModelError::Json { path: path.to_path_buf(), msg: e.to_string() })?;
    let obj = value
        .as_object()
        .ok_or_else(|| ModelError::Json { path: path.to_path_buf(), msg: "top level is not a JSON object".into() })?;
    let ids = Fields { path, obj }.token_ids("eos_token_id")?;
    Ok((!ids.is_empty()).then_some(ids))
}

/// Parse config text (`path` is only used in messages).
pub fn parse_config(text: &str, path: &Path) -> Result<ModelSpec> {
    Ok(parse_checkpoint_config(text, path)?.spec)
}

/// Parse config text into the spec and the weight layout (`path` is only used in messages).
///
/// `model_type` picks the family. `kimi_k2` (Kimi-K2, K2-Thinking: `DeepseekV3ForCausalLM`)
/// is DeepSeek-V3. `kimi_k25` (Kimi-K2.5) is a vision-language wrapper: the text model is read
/// from its `text_config` (errors there name `text_config.<field>`), its tensors are under
/// `language_model.`, and the vision tower is left out with a note.
pub fn parse_checkpoint_config(text: &str, path: &Path) -> Result<CheckpointConfig> {
    let value: Value =
        serde_json::from_str(text).map_err(|e| ModelError::Json { path: path.to_path_buf(), msg: e.to_string() })?;
    let obj = value
        .as_object()
        .ok_or_else(|| ModelError::Json { path: path.to_path_buf(), msg: "top level is not a JSON object".into() })?;
    let f = Fields { path, obj };
    let model_type = f.str_opt("model_type")?.ok_or_else(|| f.err("model_type", "missing"))?;
    if model_type == "kimi_k25" {
        return parse_kimi_k25(&f);
    }
    if model_type == "qwen3_5_moe" {
        return parse_qwen35_moe(&f);
    }
    let spec = parse_text_model(&f, model_type).ok_or_else(|| ModelError::UnsupportedArch {
        path: path.to_path_buf(),
        found: model_type.to_string(),
        supported: Arch::SUPPORTED.join(", "),
    })??;
    let layout = StoredLayout {
        fused_delta_net_inputs: spec.arch == Arch::Qwen3Next,
        gpt_oss_experts: spec.arch == Arch::GptOss,
        ..StoredLayout::default()
    };
    Ok(CheckpointConfig { spec, tensor_prefix: "", canonical_prefix: "", layout, notes: Vec::new() })
}

/// The text model of a `model_type` (`None`: not a text family Krasis runs).
fn parse_text_model(f: &Fields, model_type: &str) -> Option<Result<ModelSpec>> {
    Some(match model_type {
        "deepseek_v2" => deepseek::parse(f, Arch::DeepseekV2),
        "deepseek_v3" | "kimi_k2" => deepseek::parse(f, Arch::DeepseekV3),
        "qwen3_moe" => qwen3_moe::parse(f),
        "mixtral" => mixtral::parse(f),
        "glm4_moe" => glm4_moe::parse(f),
        "qwen2_moe" => qwen2_moe::parse(f),
        "minimax_m2" => minimax_m2::parse(f),
        "gpt_oss" => gpt_oss::parse(f),
        "qwen3_next" => qwen3_next::parse(f, Arch::Qwen3Next),
        _ => return None,
    })
}

/// Kimi-K2.5: the text model is `text_config` (a Kimi-K2, so DeepSeek-V3 semantics), its tensors
/// are under `language_model.`; `vision_config` and the vision tower's tensors are not read.
fn parse_kimi_k25(f: &Fields) -> Result<CheckpointConfig> {
    let text = match f.present("text_config") {
        Some(Value::Object(o)) => o,
        Some(v) => return Err(f.err("text_config", format!("expected an object, found {v}"))),
        None => return Err(f.err("text_config", "missing (kimi_k25 nests its text model there)")),
    };
    let t = Fields { path: f.path, obj: text };
    let nested = |e: ModelError| match e {
        ModelError::Config { path, field, msg } => {
            ModelError::Config { path, field: format!("text_config.{field}"), msg }
        }
        e => e,
    };
    // The text model of the published K2.5 is a Kimi-K2; `model_type` may be absent (the
    // architecture then says DeepSeek-V3).
    let text_type = t.str_opt("model_type").map_err(nested)?.unwrap_or("kimi_k2");
    let spec = match text_type {
        "kimi_k2" | "deepseek_v3" => deepseek::parse(&t, Arch::DeepseekV3).map_err(nested)?,
        other => {
            return Err(f.err(
                "text_config.model_type",
                format!("`{other}` is not a text model of kimi_k25 that Krasis runs (supported: kimi_k2, deepseek_v3)"),
            ))
        }
    };
    let notes = match f.present("vision_config") {
        None => Vec::new(),
        Some(_) => vec![format!(
            "{}: kimi_k25 is a vision-language model; Krasis runs its text model (`text_config`) only: \
             the vision tower (`vision_config`, tensors `vision_tower.*` and `mm_projector.*`) is not loaded",
            f.path.display()
        )],
    };
    Ok(CheckpointConfig {
        spec,
        tensor_prefix: "language_model.",
        canonical_prefix: "",
        layout: StoredLayout::default(),
        notes,
    })
}

/// `text_config` of a vision-language wrapper as [`Fields`], and the mapping of its errors'
/// fields to `text_config.<field>`.
fn text_config<'a>(f: &Fields<'a>, wrapper: &str) -> Result<Fields<'a>> {
    match f.present("text_config") {
        Some(Value::Object(obj)) => Ok(Fields { path: f.path, obj }),
        Some(v) => Err(f.err("text_config", format!("expected an object, found {v}"))),
        None => Err(f.err("text_config", format!("missing ({wrapper} nests its text model there)"))),
    }
}

fn nested_field(e: ModelError) -> ModelError {
    match e {
        ModelError::Config { path, field, msg } => {
            ModelError::Config { path, field: format!("text_config.{field}"), msg }
        }
        e => e,
    }
}

/// Qwen3.5 / 3.6 MoE: the text model is `text_config` (`model_type` `qwen3_5_moe_text`), its
/// tensors are under `model.language_model.` (the LM head is `lm_head.weight`), the routed
/// experts fused per layer; the vision tower (`model.visual.*`) and the MTP head (`mtp.*`) are
/// not loaded.
fn parse_qwen35_moe(f: &Fields) -> Result<CheckpointConfig> {
    let t = text_config(f, "qwen3_5_moe")?;
    match t.str_opt("model_type").map_err(nested_field)? {
        None | Some("qwen3_5_moe_text") => {}
        Some(other) => {
            return Err(f.err(
                "text_config.model_type",
                format!("`{other}` is not the text model of qwen3_5_moe (expected qwen3_5_moe_text)"),
            ))
        }
    }
    let mut spec = qwen3_next::parse(&t, Arch::Qwen35Moe).map_err(nested_field)?;
    // The wrapper's own `tie_word_embeddings` is what transformers' model ties by.
    if let Some(tie) = f.present("tie_word_embeddings").and_then(Value::as_bool) {
        spec.tie_word_embeddings = tie;
    }
    let mut notes = Vec::new();
    if f.present("vision_config").is_some() {
        notes.push(format!(
            "{}: qwen3_5_moe is a vision-language model; Krasis runs its text model (`text_config`) only: \
             the vision tower (`vision_config`, tensors `model.visual.*`) is not loaded",
            f.path.display()
        ));
    }
    if let Some(n) = t.usize_opt("mtp_num_hidden_layers").map_err(nested_field)?.filter(|&n| n > 0) {
        notes.push(format!(
            "{}: the multi-token-prediction head ({n} layer(s), tensors `mtp.*`) is not loaded: Krasis decodes one \
             token per step",
            f.path.display()
        ));
    }
    Ok(CheckpointConfig {
        spec,
        tensor_prefix: "model.language_model.",
        canonical_prefix: "model.",
        layout: StoredLayout { fused_experts: true, ..StoredLayout::default() },
        notes,
    })
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

/// What a family's own parser decides; [`Common::spec`] adds the fields every family reads alike.
struct FamilyParts {
    arch: Arch,
    attention: AttentionSpec,
    rope: RopeSpec,
    softmax_scale: f32,
    moe: Option<MoeSpec>,
    layers: Vec<FfnKind>,
    source_quant: SourceQuant,
}

impl Common {
    /// The spec of a family: its own parts and the common fields.
    fn spec(self, p: FamilyParts) -> ModelSpec {
        ModelSpec {
            arch: p.arch,
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            num_layers: self.num_layers,
            rms_norm_eps: self.rms_norm_eps,
            tie_word_embeddings: self.tie_word_embeddings,
            bos_token_id: self.bos_token_id,
            eos_token_ids: self.eos_token_ids,
            max_position_embeddings: self.max_position_embeddings,
            attention: p.attention,
            rope: p.rope,
            softmax_scale: p.softmax_scale,
            moe: p.moe,
            // Attention in every layer; a hybrid family sets its own after.
            mixers: vec![MixerKind::Attention; self.num_layers],
            delta_net: None,
            norm_plus_one: false,
            layers: p.layers,
            source_quant: p.source_quant,
            expert_source_bits: Vec::new(),
            expert_source_types: Vec::new(),
            sliding_windows: Vec::new(),
            attention_sinks: false,
            expert_activation: ExpertActivation::Silu,
            expert_bias: false,
        }
    }
}

/// The common fields of a family whose attention takes no biases: `attention_bias: true` is
/// refused.
fn parse_common(f: &Fields) -> Result<Common> {
    if f.bool_or("attention_bias", false)? {
        return Err(f.err(
            "attention_bias",
            "attention biases are not supported for this architecture (supported with them: glm4_moe)",
        ));
    }
    parse_common_biased(f)
}

/// The common fields of a family whose attention op may take biases (the family reads
/// `attention_bias` itself).
fn parse_common_biased(f: &Fields) -> Result<Common> {
    if let Some(act) = f.str_opt("hidden_act")? {
        if act != "silu" {
            return Err(f.err("hidden_act", format!("`{act}` is not supported (only silu)")));
        }
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

/// Which layers are MoE, as Qwen2-MoE defines it (and Qwen3-MoE after it): layer `l` is MoE
/// when it is not in `mlp_only_layers`, the model has experts (`n_experts > 0`) and `l + 1` is a
/// multiple of `decoder_sparse_step` (default 1); every other layer is a dense MLP of
/// `intermediate_size`, which must then be given.
fn sparse_step_layers(f: &Fields, num_layers: usize, n_experts: usize) -> Result<Vec<FfnKind>> {
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
    if let Some(&l) = mlp_only.iter().find(|&&l| l >= num_layers) {
        return Err(f.err("mlp_only_layers", format!("layer {l} is past num_hidden_layers {num_layers}")));
    }
    let intermediate = f.usize_opt("intermediate_size")?.unwrap_or(0);
    (0..num_layers)
        .map(|l| {
            if !mlp_only.contains(&l) && n_experts > 0 && (l + 1) % step == 0 {
                Ok(FfnKind::Moe)
            } else if intermediate == 0 {
                Err(f.err("intermediate_size", format!("missing or 0 (layer {l} is a dense MLP)")))
            } else {
                Ok(FfnKind::Dense { intermediate_size: intermediate })
            }
        })
        .collect()
}

/// GQA's heads: `num_attention_heads`, `num_key_value_heads` (default: as many, MHA), which
/// must divide it, and `head_dim` (default `hidden_size / num_attention_heads`), which must be
/// even; `(heads, kv_heads, head_dim)`.
fn parse_gqa_heads(f: &Fields, hidden_size: usize) -> Result<(usize, usize, usize)> {
    let heads = f.dim("num_attention_heads")?;
    let kv_heads = f.usize_opt("num_key_value_heads")?.unwrap_or(heads);
    if kv_heads == 0 || heads % kv_heads != 0 {
        return Err(f.err("num_key_value_heads", format!("{kv_heads} must divide num_attention_heads {heads}")));
    }
    let head_dim = match f.usize_opt("head_dim")? {
        Some(d) if d > 0 => d,
        Some(_) => return Err(f.err("head_dim", "must be greater than 0")),
        None => hidden_size / heads,
    };
    if head_dim % 2 != 0 {
        return Err(f.err("head_dim", format!("{head_dim} must be even")));
    }
    Ok((heads, kv_heads, head_dim))
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
            // MiniMax-M2 names the format as torch does (`float8_e4m3fn`).
            if let Some(fmt) = s.str_opt("fmt")? {
                if fmt != "e4m3" && fmt != "float8_e4m3fn" {
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
        Some("compressed-tensors") => parse_compressed_tensors(f, &s),
        Some("modelopt") => quant_fp4::parse_modelopt(f, &s),
        Some("mxfp4") => quant_fp4::parse_mxfp4(f, &s),
        Some(other) => Err(f.err(
            "quantization_config.quant_method",
            format!("`{other}` is not supported (supported: fp8, compressed-tensors, modelopt, mxfp4)"),
        )),
        None => Err(f.err("quantization_config.quant_method", "missing")),
    }
}

/// compressed-tensors: the one variant Krasis reads is `pack-quantized` weight-only INT4
/// (symmetric, per group along the input dimension), as Kimi-K2-Thinking and Kimi-K2.5 publish
/// it. Which linears are quantised is read from the tensors themselves (`weight_packed` in place
/// of `weight`), which is what `targets` / `ignore` select; every other variant is refused here,
/// naming the field.
fn parse_compressed_tensors(f: &Fields, s: &Fields) -> Result<SourceQuant> {
    const Q: &str = "quantization_config";
    let unsupported = |field: &str, found: String, want: &str| {
        f.err(&format!("{Q}.{field}"), format!("{found} is not supported (Krasis reads {want})"))
    };
    match s.str_opt("format")? {
        Some("pack-quantized") => {}
        Some(other) => return Err(unsupported("format", format!("`{other}`"), "`pack-quantized`")),
        None => return Err(f.err(&format!("{Q}.format"), "missing (expected `pack-quantized`)")),
    }
    if let Some(status) = s.str_opt("quantization_status")? {
        if status != "compressed" {
            return Err(unsupported("quantization_status", format!("`{status}`"), "`compressed`"));
        }
    }
    if let Some(v) = s.present("kv_cache_scheme") {
        return Err(unsupported("kv_cache_scheme", v.to_string(), "null (an unquantised KV cache)"));
    }
    let groups = match s.present("config_groups") {
        Some(Value::Object(g)) if !g.is_empty() => g,
        Some(v) => return Err(f.err(&format!("{Q}.config_groups"), format!("expected a non-empty object, found {v}"))),
        None => return Err(f.err(&format!("{Q}.config_groups"), "missing")),
    };
    let mut group_size = None;
    for (name, g) in groups {
        let at = format!("config_groups.{name}");
        let Some(obj) = g.as_object() else {
            return Err(f.err(&format!("{Q}.{at}"), format!("expected an object, found {g}")));
        };
        let grp = Fields { path: f.path, obj };
        for act in ["input_activations", "output_activations"] {
            if let Some(v) = grp.present(act) {
                return Err(unsupported(&format!("{at}.{act}"), v.to_string(), "null (weight-only quantisation)"));
            }
        }
        let Some(Value::Object(w)) = grp.present("weights") else {
            return Err(f.err(&format!("{Q}.{at}.weights"), "missing or not an object"));
        };
        let w = Fields { path: f.path, obj: w };
        let wf = |field: &str| format!("{at}.weights.{field}");
        match w.usize_opt("num_bits")? {
            Some(4) => {}
            Some(b) => return Err(unsupported(&wf("num_bits"), b.to_string(), "4")),
            None => return Err(f.err(&format!("{Q}.{}", wf("num_bits")), "missing")),
        }
        match w.str_opt("type")? {
            Some("int") => {}
            Some(t) => return Err(unsupported(&wf("type"), format!("`{t}`"), "`int`")),
            None => return Err(f.err(&format!("{Q}.{}", wf("type")), "missing")),
        }
        if !w.bool_or("symmetric", false)? {
            return Err(unsupported(&wf("symmetric"), "an asymmetric scheme (zero points)".into(), "symmetric: true"));
        }
        match w.str_opt("strategy")? {
            Some("group") => {}
            Some(t) => return Err(unsupported(&wf("strategy"), format!("`{t}`"), "`group`")),
            None => return Err(f.err(&format!("{Q}.{}", wf("strategy")), "missing")),
        }
        if w.bool_or("dynamic", false)? {
            return Err(unsupported(&wf("dynamic"), "true".into(), "false"));
        }
        if let Some(v) = w.present("actorder") {
            return Err(unsupported(&wf("actorder"), v.to_string(), "null (no activation reordering)"));
        }
        if let Some(v) = w.present("block_structure") {
            return Err(unsupported(&wf("block_structure"), v.to_string(), "null"));
        }
        let gs = w.usize_opt("group_size")?.ok_or_else(|| f.err(&format!("{Q}.{}", wf("group_size")), "missing"))?;
        if !gs.is_power_of_two() || !(32..=1024).contains(&gs) {
            return Err(unsupported(&wf("group_size"), gs.to_string(), "a power of two from 32 to 1024"));
        }
        if group_size.is_some_and(|g| g != gs) {
            return Err(unsupported(
                &wf("group_size"),
                format!("{gs} beside {}", group_size.unwrap_or(0)),
                "one group size for all groups",
            ));
        }
        group_size = Some(gs);
    }
    Ok(SourceQuant::CompressedInt4 { group_size: group_size.expect("config_groups is not empty") })
}
