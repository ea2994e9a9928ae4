//! Text ↔ token ids (`tokenizer.json` through the `tokenizers` crate, or Kimi's `tiktoken.model`
//! through [`crate::text::tiktoken`]) and the chat template of `tokenizer_config.json` (rendered
//! with minijinja); or both from a GGUF's `tokenizer.*` metadata ([`TextCodec::from_gguf`]).

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::error::{ModelError, Result};
use crate::source::gguf::GgufModel;
use crate::text::spm::SpmTokenizer;
use crate::text::tiktoken::TiktokenBpe;

/// `tokenizer.ggml.pre` values [`TextCodec::from_gguf`] understands (for `tokenizer.ggml.model =
/// gpt2`; the `llama` model has no pre-tokenizer).
pub const GGUF_PRE_TOKENIZERS: &[&str] = &[
    "default",
    "gpt-2",
    "phi-2",
    "mpt",
    "olmo",
    "llama-bpe",
    "llama3",
    "llama-v3",
    "dbrx",
    "smaug-bpe",
    "qwen2",
    "deepseek-r1-qwen",
    "stablelm2",
    "deepseek-llm",
    "deepseek-coder",
    "deepseek-v3",
    "falcon",
    "starcoder",
    "refact",
    "command-r",
    "smollm",
];

/// GPT-2's split, as llama.cpp writes it (the `tokenizers` ByteLevel regex adds `|\s+`).
const GPT2_SPLIT: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_SPLIT: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// DeepSeek-LLM's (V1, V2) splits, from its `tokenizer.json` (as llama.cpp copies them). Its
/// `\s+$` was written for Oniguruma, where `$` also matches before a `\n`: `(?m:$)` here.
const DEEPSEEK_LLM_SPLITS: &[&str] = &[
    "[\r\n]",
    "\\s?[A-Za-z\u{B5}\u{C0}-\u{D6}\u{D8}-\u{F6}\u{F8}-\u{1BA}\u{1BC}-\u{1BF}\u{1C4}-\u{293}\u{295}-\u{2AF}\u{370}-\u{373}\u{376}\u{377}\u{37B}-\u{37D}\u{37F}\u{386}\u{388}-\u{38A}\u{38C}\u{38E}-\u{3A1}\u{3A3}-\u{3F5}\u{3F7}-\u{481}\u{48A}-\u{52F}\u{531}-\u{556}\u{10A0}-\u{10C5}\u{13A0}-\u{13F5}\u{13F8}-\u{13FD}\u{1C90}-\u{1CBA}\u{1CBD}-\u{1CBF}\u{1D00}-\u{1D2B}\u{1D6B}-\u{1D77}\u{1D79}-\u{1D9A}\u{1E00}-\u{1F15}\u{1F18}-\u{1F1D}\u{1F20}-\u{1F45}\u{1F48}-\u{1F4D}\u{1F50}-\u{1F57}\u{1F59}\u{1F5B}\u{1F5D}\u{1F5F}-\u{1F7D}\u{1F80}-\u{1FB4}\u{1FB6}-\u{1FBC}\u{1FBE}\u{1FC2}-\u{1FC4}\u{1FC6}-\u{1FCC}\u{1FD0}-\u{1FD3}\u{1FD6}-\u{1FDB}\u{1FE0}-\u{1FEC}\u{1FF2}-\u{1FF4}\u{1FF6}-\u{1FFC}\u{2102}\u{2107}\u{210A}-\u{2113}\u{2115}\u{2119}-\u{211D}\u{2124}\u{2126}\u{2128}\u{212A}-\u{212D}\u{212F}-\u{2134}\u{2139}\u{213C}-\u{213F}\u{2145}-\u{2149}\u{214E}\u{2183}\u{2184}\u{2C00}-\u{2C7B}\u{2C7E}-\u{2CE4}\u{2CEB}-\u{2CEE}\u{2CF2}\u{2CF3}\u{A640}-\u{A66D}\u{A680}-\u{A69B}\u{A722}-\u{A76F}\u{A771}-\u{A787}\u{A78B}-\u{A78E}\u{AB70}-\u{ABBF}\u{FB00}-\u{FB06}\u{FB13}-\u{FB17}\u{FF21}-\u{FF3A}\u{FF41}-\u{FF5A}\u{10400}-\u{1044F}\u{104B0}-\u{104D3}\u{104D8}-\u{104FB}\u{10C80}-\u{10CB2}\u{10CC0}-\u{10CF2}\u{118A0}-\u{118DF}\u{1E900}-\u{1E943}]+",
    "\\s?[!-/:-~\u{FF01}-\u{FF0F}\u{FF1A}-\u{FF5E}\u{2018}-\u{201F}\u{3000}-\u{3002}]+",
    "\\s+(?m:$)",
    "[\u{4E00}-\u{9FA5}\u{800}-\u{4E00}\u{AC00}-\u{D7FF}]+",
    "\\p{N}+",
];
const DEEPSEEK_CODER_SPLITS: &[&str] =
    &["[\r\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", "[\u{4E00}-\u{9FA5}\u{800}-\u{4E00}\u{AC00}-\u{D7FF}]+", "\\p{N}"];
const DEEPSEEK_V3_SPLITS: &[&str] = &[
    "\\p{N}{1,3}",
    "[\u{4E00}-\u{9FA5}\u{3040}-\u{309F}\u{30A0}-\u{30FF}]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
];
const FALCON_SPLITS: &[&str] = &["[\\p{P}\\$\\+<=>\\^~\\|`]+", GPT2_SPLIT, "[0-9][0-9][0-9]"];

/// How a llama.cpp pre-tokenizer name splits text before byte-level BPE: its regexes in turn
/// (each cut isolated, as llama.cpp and `tokenizers`' `Split` do), then whether the GPT-2 regex
/// of the byte-level step follows, and whether whole words in the vocabulary skip the merges
/// (llama.cpp's `ignore_merges`, Llama-3's).
fn gguf_pre_tokenizer(pre: &str) -> Option<(Value, bool)> {
    let (splits, gpt2, ignore_merges): (&[&str], bool, bool) = match pre {
        "default" | "gpt-2" | "phi-2" | "mpt" | "olmo" => (&[], true, false),
        "llama-bpe" | "llama3" | "llama-v3" => (&[LLAMA3_SPLIT], false, true),
        "dbrx" | "smaug-bpe" => (&[LLAMA3_SPLIT], false, false),
        "qwen2" | "deepseek-r1-qwen" | "stablelm2" => (&[QWEN2_SPLIT], false, false),
        "deepseek-llm" => (DEEPSEEK_LLM_SPLITS, false, false),
        "deepseek-coder" => (DEEPSEEK_CODER_SPLITS, false, false),
        "deepseek-v3" => (DEEPSEEK_V3_SPLITS, false, false),
        "falcon" => (FALCON_SPLITS, false, false),
        "starcoder" | "refact" | "command-r" | "smollm" => (&["\\p{N}"], true, false),
        _ => return None,
    };
    let mut steps: Vec<Value> = splits
        .iter()
        .map(|r| {
            serde_json::json!({ "type": "Split", "pattern": { "Regex": r }, "behavior": "Isolated", "invert": false })
        })
        .collect();
    steps.push(
        serde_json::json!({ "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": gpt2 }),
    );
    Some((serde_json::json!({ "type": "Sequence", "pretokenizers": steps }), ignore_merges))
}

/// A GGUF's byte-level BPE (`tokenizer.ggml.model = gpt2`) as a `tokenizers` tokenizer.
fn gguf_bpe(
    m: &GgufModel,
    tokens: &[&str],
    types: &[i128],
    err: &dyn Fn(&str, &str) -> ModelError,
) -> Result<tokenizers::Tokenizer> {
    let merges = m
        .meta("tokenizer.ggml.merges")
        .and_then(|v| v.as_str_array(m.main().bytes()))
        .ok_or_else(|| err("tokenizer.ggml.merges", "missing or not a string array"))?;
    let pre = m.meta_str("tokenizer.ggml.pre").unwrap_or("default");
    let (pre_tokenizer, ignore_merges) = gguf_pre_tokenizer(pre).ok_or_else(|| {
        err("tokenizer.ggml.pre", &format!("`{pre}` is not supported (supported: {})", GGUF_PRE_TOKENIZERS.join(", ")))
    })?;
    let mut vocab = serde_json::Map::with_capacity(tokens.len());
    let mut added = Vec::new();
    for (id, (tok, ty)) in tokens.iter().zip(types).enumerate() {
        vocab.insert(tok.to_string(), Value::from(id));
        // llama.cpp's token types: 3 control, 4 user-defined.
        if *ty == 3 || *ty == 4 {
            added.push(serde_json::json!({
                "id": id, "content": tok, "single_word": false, "lstrip": false, "rstrip": false,
                "normalized": false, "special": *ty == 3,
            }));
        }
    }
    let json = serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": null,
        "decoder": { "type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true },
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": ignore_merges,
            "vocab": vocab, "merges": merges,
        },
    });
    json.to_string().parse().map_err(|e| {
        ModelError::Tokenizer(format!("{}: building the tokenizer from GGUF metadata: {e}", m.path().display()))
    })
}

pub struct TextCodec {
    tokenizer: Backend,
    chat_template: Option<String>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    add_bos_token: bool,
    bos_id: Option<u32>,
    config_path: PathBuf,
}

/// What turns text into ids and back.
enum Backend {
    /// `tokenizer.json`, or a GGUF's tokenizer turned into one.
    Hf(Box<tokenizers::Tokenizer>),
    /// Kimi's `tiktoken.model`.
    Tiktoken(Box<TiktokenBpe>),
    /// A GGUF's SentencePiece-style vocabulary (`tokenizer.ggml.model = llama`).
    Spm(Box<SpmTokenizer>),
}

impl Backend {
    /// `add_special_tokens`: the `tokenizers` post-processor applies. Kimi's tokenizer has none,
    /// and always reads special-token names in the text as their ids.
    fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        match self {
            Backend::Hf(t) => Ok(t
                .encode(text, add_special_tokens)
                .map_err(|e| ModelError::Tokenizer(e.to_string()))?
                .get_ids()
                .to_vec()),
            Backend::Tiktoken(t) => t.encode(text, true),
            Backend::Spm(t) => t.encode(text),
        }
    }

    /// Decodes; `skip_special`: drops special tokens.
    fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        match self {
            Backend::Hf(t) => t.decode(ids, skip_special).map_err(|e| ModelError::Tokenizer(e.to_string())),
            Backend::Tiktoken(t) => t.decode(ids, skip_special),
            Backend::Spm(t) => t.decode(ids, skip_special),
        }
    }

    fn token_to_id(&self, token: &str) -> Option<u32> {
        match self {
            Backend::Hf(t) => t.token_to_id(token),
            Backend::Tiktoken(t) => t.token_to_id(token),
            Backend::Spm(t) => t.token_to_id(token),
        }
    }
}

/// Whether a model directory's tiktoken tokenizer is Kimi's: `tokenization_kimi.py` is there, or
/// `tokenizer_config.json`'s `auto_map` names it. Only Kimi's split pattern is known.
fn names_kimi_tokenizer(dir: &Path, cfg: &Value) -> bool {
    let named = |v: &Value| v.as_str().is_some_and(|s| s.starts_with("tokenization_kimi."));
    dir.join("tokenization_kimi.py").exists()
        || match cfg.pointer("/auto_map/AutoTokenizer") {
            Some(Value::Array(a)) => a.iter().any(named),
            Some(v) => named(v),
            None => false,
        }
}

/// A special-token entry may be a string or `{"content": "..."}`.
fn token_string(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_string),
        _ => None,
    }
}

impl TextCodec {
    /// Load `tokenizer.json` and `tokenizer_config.json` (optional) from `dir`. Without
    /// `tokenizer.json`, a `tiktoken.model` is read as Kimi's tokenizer
    /// ([`crate::text::tiktoken`]) when `tokenization_kimi.py` is there or `tokenizer_config.json`'s
    /// `auto_map` names it; its special tokens come from that file's `added_tokens_decoder`.
    pub fn load(dir: &Path) -> Result<TextCodec> {
        let tok_path = dir.join("tokenizer.json");
        let tiktoken_path = dir.join("tiktoken.model");
        let config_path = dir.join("tokenizer_config.json");
        let cfg: Value = if config_path.exists() {
            let text = std::fs::read_to_string(&config_path).map_err(|e| ModelError::io(&config_path, e))?;
            serde_json::from_str(&text)
                .map_err(|e| ModelError::Json { path: config_path.clone(), msg: e.to_string() })?
        } else {
            Value::Null
        };
        let tokenizer = if tok_path.exists() {
            Backend::Hf(Box::new(
                tokenizers::Tokenizer::from_file(&tok_path)
                    .map_err(|e| ModelError::Tokenizer(format!("{}: {e}", tok_path.display())))?,
            ))
        } else if tiktoken_path.exists() {
            if !names_kimi_tokenizer(dir, &cfg) {
                return Err(ModelError::Tokenizer(format!(
                    "{} without tokenizer.json: only Kimi's tiktoken tokenizer is read (its split pattern), and neither \
                     tokenization_kimi.py nor {}'s `auto_map` names it",
                    tiktoken_path.display(),
                    config_path.display()
                )));
            }
            Backend::Tiktoken(Box::new(TiktokenBpe::load(
                &tiktoken_path,
                cfg.get("added_tokens_decoder"),
                &config_path,
            )?))
        } else {
            return Err(ModelError::Tokenizer(format!(
                "{} not found, nor tiktoken.model (give the prompt as token ids, `GenerateRequest::prompt_ids`, to bypass \
                 the tokenizer)",
                tok_path.display()
            )));
        };
        let chat_template = match cfg.get("chat_template") {
            Some(Value::String(s)) => Some(s.clone()),
            // A list of named templates: take "default".
            Some(Value::Array(a)) => a
                .iter()
                .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                .and_then(|t| t.get("template"))
                .and_then(Value::as_str)
                .map(str::to_string),
            _ => None,
        };
        let bos_token = token_string(cfg.get("bos_token"));
        let bos_id = bos_token.as_deref().and_then(|b| tokenizer.token_to_id(b));
        Ok(TextCodec {
            add_bos_token: cfg.get("add_bos_token").and_then(Value::as_bool).unwrap_or(false),
            eos_token: token_string(cfg.get("eos_token")),
            bos_token,
            bos_id,
            chat_template,
            tokenizer,
            config_path,
        })
    }

    /// The tokenizer a GGUF carries, read as llama.cpp reads it. `tokenizer.ggml.model`:
    /// - `gpt2` (byte-level BPE): `tokens`, `merges`, `token_type` (3 = control and 4 =
    ///   user-defined tokens are added tokens, control ones special) and the pre-tokenizer named by
    ///   `tokenizer.ggml.pre` ([`GGUF_PRE_TOKENIZERS`]);
    /// - `llama` (SentencePiece-style, [`crate::text::spm`]): `tokens`, `scores` (default 0),
    ///   `token_type`, `add_space_prefix` (default true) and `unknown_token_id`.
    ///
    /// Both take the BOS/EOS ids, `add_bos_token` (where it is missing, true for `llama` and for
    /// Llama-3's pre-tokenizers, as in llama.cpp) and `tokenizer.chat_template`. A vocabulary-only
    /// GGUF (no tensors, as llama.cpp's `ggml-vocab-*.gguf`) opens with [`GgufModel::open`] too.
    pub fn from_gguf(m: &GgufModel) -> Result<TextCodec> {
        let path = m.path().to_path_buf();
        let bytes = m.main().bytes();
        let err = |key: &str, msg: &str| {
            ModelError::Tokenizer(format!(
                "{}: metadata `{key}`: {msg} (give the prompt as token ids, `GenerateRequest::prompt_ids`, to bypass the tokenizer)",
                path.display()
            ))
        };
        let model = m.meta_str("tokenizer.ggml.model").ok_or_else(|| err("tokenizer.ggml.model", "missing"))?;
        if model != "gpt2" && model != "llama" {
            return Err(err(
                "tokenizer.ggml.model",
                &format!("`{model}` is not supported (gpt2 byte-level BPE and llama SentencePiece only)"),
            ));
        }
        let tokens = m
            .meta("tokenizer.ggml.tokens")
            .and_then(|v| v.as_str_array(bytes))
            .ok_or_else(|| err("tokenizer.ggml.tokens", "missing or not a string array"))?;
        let types = match m.meta("tokenizer.ggml.token_type") {
            None => vec![1; tokens.len()],
            Some(v) => v.as_int_array(bytes).ok_or_else(|| err("tokenizer.ggml.token_type", "not an integer array"))?,
        };
        if types.len() != tokens.len() {
            return Err(err(
                "tokenizer.ggml.token_type",
                &format!("{} entries for {} tokens", types.len(), tokens.len()),
            ));
        }
        let id =
            |key: &str| -> Option<u32> { m.meta(key).and_then(|v| v.as_int()).and_then(|i| u32::try_from(i).ok()) };
        let token = |i: Option<u32>| i.and_then(|i| tokens.get(i as usize)).map(|t| t.to_string());
        let bos_id = id("tokenizer.ggml.bos_token_id").filter(|&i| (i as usize) < tokens.len());
        let flag = |key: &str| m.meta(key).and_then(|v| v.as_bool());
        let tokenizer = if model == "llama" {
            // Missing scores are all 0, as in llama.cpp (the leftmost pair merges first).
            let scores = match m.meta("tokenizer.ggml.scores") {
                None => vec![0.0; tokens.len()],
                Some(v) => v.as_f64_array(bytes).ok_or_else(|| err("tokenizer.ggml.scores", "not a number array"))?,
            };
            if scores.len() != tokens.len() {
                return Err(err(
                    "tokenizer.ggml.scores",
                    &format!("{} entries for {} tokens", scores.len(), tokens.len()),
                ));
            }
            let unk_id = id("tokenizer.ggml.unknown_token_id").filter(|&i| (i as usize) < tokens.len());
            Backend::Spm(Box::new(SpmTokenizer::new(
                tokens.iter().map(|t| t.to_string()).collect(),
                scores.iter().map(|&s| s as f32).collect(),
                types.clone(),
                unk_id,
                flag("tokenizer.ggml.add_space_prefix").unwrap_or(true),
            )?))
        } else {
            Backend::Hf(Box::new(gguf_bpe(m, &tokens, &types, &err)?))
        };
        Ok(TextCodec {
            // llama.cpp's default where the key is missing: a BOS for SentencePiece and Llama-3.
            add_bos_token: flag("tokenizer.ggml.add_bos_token").unwrap_or(
                model == "llama"
                    || matches!(m.meta_str("tokenizer.ggml.pre"), Some("llama-bpe" | "llama3" | "llama-v3")),
            ),
            bos_token: token(bos_id),
            eos_token: token(id("tokenizer.ggml.eos_token_id")),
            bos_id,
            chat_template: m.meta_str("tokenizer.chat_template").map(str::to_string),
            tokenizer,
            config_path: path,
        })
    }

    /// The text's ids alone: no BOS and no post-processor (llama.cpp's `add_special = false`).
    /// Special-token names in the text still become their ids.
    pub fn encode_plain(&self, text: &str) -> Result<Vec<u32>> {
        self.tokenizer.encode(text, false)
    }

    /// Encode plain text: the tokenizer's post-processor applies, plus a BOS when
    /// `add_bos_token` asks for one and none is there yet.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let mut ids = self.tokenizer.encode(text, true)?;
        if self.add_bos_token {
            if let Some(b) = self.bos_id {
                if ids.first() != Some(&b) {
                    ids.insert(0, b);
                }
            }
        }
        Ok(ids)
    }

    /// Wrap `prompt` as one user message through the chat template and encode the result
    /// (the template places any special tokens itself).
    pub fn encode_chat(&self, prompt: &str) -> Result<Vec<u32>> {
        self.encode_messages(&[ChatMessage::new("user", prompt)])
    }

    /// Render a conversation through the chat template (with the generation prompt) and encode
    /// the result; the template places any special tokens itself.
    pub fn encode_messages(&self, messages: &[ChatMessage]) -> Result<Vec<u32>> {
        let text = self.render_messages(messages)?;
        self.tokenizer.encode(text.as_str(), false)
    }

    pub fn render_chat(&self, prompt: &str) -> Result<String> {
        self.render_messages(&[ChatMessage::new("user", prompt)])
    }

    /// Whether `tokenizer_config.json` has a chat template.
    pub fn has_chat_template(&self) -> bool {
        self.chat_template.is_some()
    }

    /// `messages` through the chat template, ending with the generation prompt. A template that
    /// rejects the conversation (`raise_exception`, say for a role it does not know) is a
    /// [`ModelError::Template`] carrying its message.
    pub fn render_messages(&self, messages: &[ChatMessage]) -> Result<String> {
        let template = self.chat_template.as_deref().ok_or_else(|| {
            ModelError::Template(format!(
                "{} has no chat_template; use the prompt as it is, without the chat template (`TextCodec::encode_chat`)",
                self.config_path.display()
            ))
        })?;
        let messages: Vec<serde_json::Value> =
            messages.iter().map(|m| serde_json::json!({ "role": m.role, "content": m.content })).collect();
        let input = super::chat_template::ChatInput {
            messages: serde_json::Value::Array(messages),
            add_generation_prompt: true,
            bos_token: self.bos_token.as_deref().unwrap_or_default(),
            eos_token: self.eos_token.as_deref().unwrap_or_default(),
            ..Default::default()
        };
        super::chat_template::render(template, &input).map_err(ModelError::Template)
    }

    /// Decode ids to text, dropping special tokens.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.tokenizer.decode(ids, true)
    }

    /// Decode ids to text, special tokens included (the tool-call parsers read markers such as
    /// gpt-oss's `<|channel|>` or Kimi's `<|tool_call_begin|>`, which are special tokens).
    pub fn decode_with_special(&self, ids: &[u32]) -> Result<String> {
        self.tokenizer.decode(ids, false)
    }

    /// The chat template's text, if `tokenizer_config.json` (or the GGUF) has one.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// An OpenAI-form conversation through the chat template, ending with the generation prompt,
    /// as transformers' `apply_chat_template(messages, tools=tools, **extra)`: `messages` keep
    /// every field the template may read (`tool_calls`, `tool_call_id`, `name`,
    /// `reasoning_content`, …), fitted by [`super::chat_template::fit_messages`]; `extra` holds
    /// further variables such as `enable_thinking`.
    pub fn render_conversation(
        &self,
        mut messages: Vec<serde_json::Value>,
        tools: Option<serde_json::Value>,
        extra: serde_json::Map<String, serde_json::Value>,
    ) -> Result<String> {
        let template = self
            .chat_template
            .as_deref()
            .ok_or_else(|| ModelError::Template(format!("{} has no chat_template", self.config_path.display())))?;
        super::chat_template::fit_messages(template, &mut messages);
        let input = super::chat_template::ChatInput {
            messages: serde_json::Value::Array(messages),
            tools,
            add_generation_prompt: true,
            bos_token: self.bos_token.as_deref().unwrap_or_default(),
            eos_token: self.eos_token.as_deref().unwrap_or_default(),
            extra,
            today: None,
        };
        super::chat_template::render(template, &input).map_err(ModelError::Template)
    }
}

/// One message of a conversation, as the chat template sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage { role: role.into(), content: content.into() }
    }
}

/// Turns a growing id sequence into text deltas, never emitting half a UTF-8 character: bytes
/// of an incomplete character wait for the ids that complete them. Each push decodes a short
/// window (the ids since the last emitted text plus the ids before them that the decoder may need
/// for context: a leading space, a merged character), so a long generation costs O(1) per token.
pub struct TextStream {
    /// Ids from the window's start on (earlier ones are done with).
    ids: Vec<u32>,
    /// `ids[..read]` has been emitted as text.
    read: usize,
    /// Special tokens are decoded too ([`TextCodec::decode_with_special`]).
    keep_special: bool,
}

impl TextStream {
    pub fn new() -> Self {
        TextStream { ids: Vec::new(), read: 0, keep_special: false }
    }

    /// A stream that decodes special tokens too (for the tool-call parsers).
    pub fn keeping_special() -> Self {
        TextStream { ids: Vec::new(), read: 0, keep_special: true }
    }

    fn decode(&self, codec: &TextCodec, ids: &[u32]) -> Result<String> {
        if self.keep_special {
            codec.decode_with_special(ids)
        } else {
            codec.decode(ids)
        }
    }

    /// Add one id; returns the newly completed text, if any.
    pub fn push(&mut self, codec: &TextCodec, id: u32) -> Result<String> {
        self.ids.push(id);
        let done = self.decode(codec, &self.ids[..self.read])?;
        let text = self.decode(codec, &self.ids)?;
        if text.len() <= done.len()
            || text.ends_with('\u{fffd}')
            || !text.is_char_boundary(done.len())
            || !text.starts_with(&done)
        {
            return Ok(String::new());
        }
        let delta = text[done.len()..].to_string();
        // The ids just emitted become the next window's context.
        self.ids.drain(..self.read);
        self.read = self.ids.len();
        Ok(delta)
    }

    /// The text still held back at the end of a generation (an incomplete character's bytes,
    /// decoded as U+FFFD), so that the deltas add up to the one-shot decode.
    pub fn finish(&mut self, codec: &TextCodec) -> Result<String> {
        let done = self.decode(codec, &self.ids[..self.read])?;
        let text = self.decode(codec, &self.ids)?;
        self.ids.clear();
        self.read = 0;
        Ok(match text.strip_prefix(done.as_str()) {
            Some(rest) => rest.to_string(),
            None => String::new(),
        })
    }
}

impl Default for TextStream {
    fn default() -> Self {
        Self::new()
    }
}
