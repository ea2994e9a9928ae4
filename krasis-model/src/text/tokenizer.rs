//! Text ↔ token ids (`tokenizer.json` through the `tokenizers` crate, or Kimi's `tiktoken.model`
//! through [`crate::text::tiktoken`]) and the chat template of `tokenizer_config.json` (rendered
//! with minijinja); or both from a GGUF's `tokenizer.*` metadata ([`TextCodec::from_gguf`]).

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::error::{ModelError, Result};
use crate::source::gguf::GgufModel;
use crate::text::tiktoken::TiktokenBpe;

/// `tokenizer.ggml.pre` values [`TextCodec::from_gguf`] understands.
pub const GGUF_PRE_TOKENIZERS: &[&str] = &["default", "gpt-2", "llama-bpe", "llama3", "qwen2"];

/// The `tokenizers` pre-tokenizer of a llama.cpp pre-tokenizer name: GPT-2's byte-level regex, or
/// the Llama-3 / Qwen2 split regexes (digits in runs of up to three, or one by one) before the
/// byte-level mapping.
fn gguf_pre_tokenizer(pre: &str) -> Option<Value> {
    let split = |regex: &str| {
        serde_json::json!({ "type": "Sequence", "pretokenizers": [
            { "type": "Split", "pattern": { "Regex": regex }, "behavior": "Isolated", "invert": false },
            { "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false },
        ]})
    };
    const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    const QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    Some(match pre {
        "default" | "gpt-2" => {
            serde_json::json!({ "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true })
        }
        "llama-bpe" | "llama3" => split(LLAMA3),
        "qwen2" => split(QWEN2),
        _ => return None,
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
        }
    }

    /// Decodes, dropping special tokens.
    fn decode(&self, ids: &[u32]) -> Result<String> {
        match self {
            Backend::Hf(t) => t.decode(ids, true).map_err(|e| ModelError::Tokenizer(e.to_string())),
            Backend::Tiktoken(t) => t.decode(ids, true),
        }
    }

    fn token_to_id(&self, token: &str) -> Option<u32> {
        match self {
            Backend::Hf(t) => t.token_to_id(token),
            Backend::Tiktoken(t) => t.token_to_id(token),
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

    /// The tokenizer a GGUF carries: `tokenizer.ggml.model` = `gpt2` (byte-level BPE) with
    /// `tokens`, `merges`, `token_type` (3 = control and 4 = user-defined tokens are added tokens,
    /// control ones special), the pre-tokenizer named by `tokenizer.ggml.pre`, BOS/EOS ids,
    /// `add_bos_token`, and `tokenizer.chat_template`.
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
        if model != "gpt2" {
            return Err(err("tokenizer.ggml.model", &format!("`{model}` is not supported (gpt2 byte-level BPE only)")));
        }
        let tokens = m
            .meta("tokenizer.ggml.tokens")
            .and_then(|v| v.as_str_array(bytes))
            .ok_or_else(|| err("tokenizer.ggml.tokens", "missing or not a string array"))?;
        let merges = m
            .meta("tokenizer.ggml.merges")
            .and_then(|v| v.as_str_array(bytes))
            .ok_or_else(|| err("tokenizer.ggml.merges", "missing or not a string array"))?;
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
        let pre = m.meta_str("tokenizer.ggml.pre").unwrap_or("default");
        let pre_tokenizer = gguf_pre_tokenizer(pre).ok_or_else(|| {
            err(
                "tokenizer.ggml.pre",
                &format!("`{pre}` is not supported (supported: {})", GGUF_PRE_TOKENIZERS.join(", ")),
            )
        })?;
        let mut vocab = serde_json::Map::with_capacity(tokens.len());
        let mut added = Vec::new();
        for (id, (tok, ty)) in tokens.iter().zip(&types).enumerate() {
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
                "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                "vocab": vocab, "merges": merges,
            },
        });
        let tokenizer: tokenizers::Tokenizer = json.to_string().parse().map_err(|e| {
            ModelError::Tokenizer(format!("{}: building the tokenizer from GGUF metadata: {e}", path.display()))
        })?;
        let id =
            |key: &str| -> Option<u32> { m.meta(key).and_then(|v| v.as_int()).and_then(|i| u32::try_from(i).ok()) };
        let token = |i: Option<u32>| i.and_then(|i| tokens.get(i as usize)).map(|t| t.to_string());
        let bos_id = id("tokenizer.ggml.bos_token_id").filter(|&i| (i as usize) < tokens.len());
        Ok(TextCodec {
            add_bos_token: m.meta("tokenizer.ggml.add_bos_token").and_then(|v| v.as_bool()).unwrap_or(false),
            bos_token: token(bos_id),
            eos_token: token(id("tokenizer.ggml.eos_token_id")),
            bos_id,
            chat_template: m.meta_str("tokenizer.chat_template").map(str::to_string),
            tokenizer: Backend::Hf(Box::new(tokenizer)),
            config_path: path,
        })
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
        self.tokenizer.decode(ids)
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
}

impl TextStream {
    pub fn new() -> Self {
        TextStream { ids: Vec::new(), read: 0 }
    }

    /// Add one id; returns the newly completed text, if any.
    pub fn push(&mut self, codec: &TextCodec, id: u32) -> Result<String> {
        self.ids.push(id);
        let done = codec.decode(&self.ids[..self.read])?;
        let text = codec.decode(&self.ids)?;
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
        let done = codec.decode(&self.ids[..self.read])?;
        let text = codec.decode(&self.ids)?;
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
