//! Anthropic's Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`, over the
//! same chat template, scheduler and tool-call parsers as the OpenAI routes.
//!
//! - A request is checked and mapped to the OpenAI form the chat template takes
//!   ([`read_request`]): `system` becomes a system message; `tool_use` blocks an assistant
//!   message's `tool_calls`; each `tool_result` block a `tool` message; `thinking` blocks the
//!   assistant message's `reasoning_content`; a final assistant turn is a prefill the reply
//!   continues. `thinking: {"type": "enabled" | "disabled"}` sets the template's
//!   `enable_thinking` where the template reads one.
//! - The reply, read by the family's parser, becomes `thinking`, `text` and `tool_use` blocks,
//!   whole or as Anthropic's SSE events (`message_start`, `content_block_start` / `_delta` /
//!   `_stop`, `message_delta`, `message_stop`).
//! - Failures have Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`, the
//!   message naming the field at fault (`messages.1.content.0.type: …`).

use std::convert::Infallible;
use std::fmt::Display;
use std::sync::atomic::Ordering::Relaxed;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use futures_util::stream::{self, Stream, StreamExt};
use krasis_model::runtime::scheduler::{Event, Finish, Job, SHUTDOWN};
use krasis_model::runtime::stop::MAX_STOP_BYTES;
use krasis_model::text::sampling::SamplingParams;
use krasis_model::text::tool_calls::{Parsed, ParserOptions, ToolCall};
use serde_json::{json, Map, Value};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use super::api::{Generation, ToolChoice, ToolRequest, MAX_MESSAGES};
use super::error::ApiError;
use super::routes::{self, AppState, Reply, ReplyPlan, Shared};

/// Most `stop_sequences` in one request (each is matched against every generated token).
pub const MAX_STOP_SEQUENCES: usize = 16;
/// Longest tool name (Anthropic's rule: `^[a-zA-Z0-9_-]{1,128}$`).
const MAX_TOOL_NAME: usize = 128;

pub(super) fn router(state: Shared) -> Router<Shared> {
    Router::new()
        .route("/v1/messages", post(messages))
        .route("/v1/messages/count_tokens", post(count_tokens))
        .route_layer(middleware::from_fn_with_state(state, require_key))
}

/// A failed request in Anthropic's shape.
#[derive(Debug)]
pub struct AnthropicError(pub ApiError);

impl From<ApiError> for AnthropicError {
    fn from(e: ApiError) -> Self {
        AnthropicError(e)
    }
}

/// Anthropic's error `type` for an HTTP status.
pub fn error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        400 | 405 | 422 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        _ => "api_error",
    }
}

impl AnthropicError {
    /// `{"type": "error", "error": {"type", "message"}}` (also an SSE `error` event's data).
    pub fn body(&self) -> Value {
        let message = crate::flags::with_flags(&self.0.message);
        json!({"type": "error", "error": {"type": error_type(self.0.status), "message": message}})
    }
}

impl IntoResponse for AnthropicError {
    fn into_response(self) -> Response {
        (self.0.status, Json(self.body())).into_response()
    }
}

/// The API key, as the OpenAI routes check it (`x-api-key` or `Authorization: Bearer`), with the
/// refusal in Anthropic's shape.
async fn require_key(State(s): State<Shared>, req: Request, next: Next) -> Response {
    if let Some(e) = routes::key_refusal(&s, req.headers()) {
        return AnthropicError(e).into_response();
    }
    next.run(req).await
}

/// 400 naming the field at `path` (Anthropic's form: `messages.0.content.1.type: …`).
fn bad(path: impl Display, why: impl Display) -> ApiError {
    ApiError::invalid(format!("{path}: {why}"))
}

/// A `/v1/messages` request, checked and mapped to what the chat path runs.
#[derive(Debug)]
pub struct MessagesRequest {
    /// The conversation in OpenAI's form, as the chat template takes it (`system` first).
    pub messages: Vec<Value>,
    /// The text of a final assistant turn: the reply continues it.
    pub prefill: String,
    pub tools: ToolRequest,
    /// `max_tokens` is `None` only for `count_tokens`.
    pub gen: Generation,
    /// The request's `stop_sequences` (also the first entries of `gen.stop`).
    pub stop_sequences: Vec<String>,
}

/// One content block of a message, checked.
#[derive(Debug)]
enum Block {
    Text(String),
    ToolUse {
        id: String,
        name: String,
        input: Value,
    },
    ToolResult {
        id: String,
        text: String,
    },
    Thinking(String),
    /// `redacted_thinking`: encrypted reasoning that only Anthropic's models read; dropped.
    Redacted,
}

impl Block {
    fn kind(&self) -> &'static str {
        match self {
            Block::Text(_) => "text",
            Block::ToolUse { .. } => "tool_use",
            Block::ToolResult { .. } => "tool_result",
            Block::Thinking(_) => "thinking",
            Block::Redacted => "redacted_thinking",
        }
    }
}

/// A field of `o`; `null` counts as absent (clients send `null` for "not given").
fn field<'a>(o: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    o.get(key).filter(|v| !v.is_null())
}

fn string<'a>(o: &'a Map<String, Value>, key: &str, path: &str) -> Result<Option<&'a str>, ApiError> {
    match field(o, key) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(v) => Err(bad(format!("{path}{key}"), format!("must be a string, not {}", kind_of(v)))),
    }
}

fn required_string<'a>(o: &'a Map<String, Value>, key: &str, path: &str) -> Result<&'a str, ApiError> {
    string(o, key, path)?.ok_or_else(|| bad(format!("{path}{key}"), "Field required"))
}

/// The JSON type of `v`, for messages.
fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn number(o: &Map<String, Value>, key: &str, ok: impl Fn(f64) -> bool, range: &str) -> Result<Option<f64>, ApiError> {
    match field(o, key) {
        None => Ok(None),
        Some(v) => match v.as_f64() {
            Some(x) if ok(x) => Ok(Some(x)),
            _ => Err(bad(key, format!("must be a number in {range}, not {v}"))),
        },
    }
}

/// A non-negative integer field.
fn count(o: &Map<String, Value>, key: &str, path: &str, min: u64) -> Result<Option<u64>, ApiError> {
    match field(o, key) {
        None => Ok(None),
        Some(v) => match v.as_u64() {
            Some(n) if n >= min => Ok(Some(n)),
            _ => Err(bad(format!("{path}{key}"), format!("must be an integer >= {min}, not {v}"))),
        },
    }
}

fn bool_field(o: &Map<String, Value>, key: &str, path: &str) -> Result<Option<bool>, ApiError> {
    match field(o, key) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(bad(format!("{path}{key}"), format!("must be a boolean, not {}", kind_of(v)))),
    }
}

/// Text from a string or a list of `text` blocks (`system`, a `tool_result`'s `content`),
/// blocks joined by a newline.
fn text_or_blocks(v: &Value, path: &str) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => {
            let mut parts = Vec::with_capacity(blocks.len());
            for (i, b) in blocks.iter().enumerate() {
                let p = format!("{path}.{i}.");
                let b = b.as_object().ok_or_else(|| bad(format!("{path}.{i}"), "must be a content block object"))?;
                match required_string(b, "type", &p)? {
                    "text" => parts.push(required_string(b, "text", &p)?.to_string()),
                    other => {
                        return Err(bad(
                            format!("{p}type"),
                            format!("{other:?} blocks are not supported here: text only"),
                        ))
                    }
                }
            }
            Ok(parts.join("\n"))
        }
        v => Err(bad(path, format!("must be a string or a list of text blocks, not {}", kind_of(v)))),
    }
}

/// A message's `content`: a string (one text block) or a list of blocks.
fn read_blocks(content: &Value, path: &str) -> Result<Vec<Block>, ApiError> {
    let list = match content {
        Value::String(s) => return Ok(vec![Block::Text(s.clone())]),
        Value::Array(list) => list,
        v => return Err(bad(path, format!("must be a string or a list of content blocks, not {}", kind_of(v)))),
    };
    let mut out = Vec::with_capacity(list.len());
    for (j, b) in list.iter().enumerate() {
        let p = format!("{path}.{j}.");
        let b = b.as_object().ok_or_else(|| bad(format!("{path}.{j}"), "must be a content block object"))?;
        let block = match required_string(b, "type", &p)? {
            "text" => Block::Text(required_string(b, "text", &p)?.to_string()),
            "tool_use" => {
                let id = required_string(b, "id", &p)?;
                if id.is_empty() {
                    return Err(bad(format!("{p}id"), "must not be empty"));
                }
                let name = required_string(b, "name", &p)?.to_string();
                let input = match field(b, "input") {
                    Some(v @ Value::Object(_)) => v.clone(),
                    None => return Err(bad(format!("{p}input"), "Field required")),
                    Some(v) => return Err(bad(format!("{p}input"), format!("must be an object, not {}", kind_of(v)))),
                };
                Block::ToolUse { id: id.to_string(), name, input }
            }
            "tool_result" => {
                let id = required_string(b, "tool_use_id", &p)?.to_string();
                let text = match field(b, "content") {
                    None => String::new(),
                    Some(c) => text_or_blocks(c, &format!("{p}content"))?,
                };
                bool_field(b, "is_error", &p)?;
                Block::ToolResult { id, text }
            }
            "thinking" => {
                string(b, "signature", &p)?;
                Block::Thinking(required_string(b, "thinking", &p)?.to_string())
            }
            "redacted_thinking" => Block::Redacted,
            t @ ("image" | "document" | "search_result" | "container_upload") => {
                return Err(bad(format!("{p}type"), format!("{t:?} blocks are not supported: this server reads text")))
            }
            other => {
                return Err(bad(
                    format!("{p}type"),
                    format!(
                        "unknown content block type {other:?}: one of text, tool_use, tool_result, thinking, redacted_thinking"
                    ),
                ))
            }
        };
        out.push(block);
    }
    Ok(out)
}

/// `tools`: client tools (`name`, `description`, `input_schema`), in OpenAI's form for the
/// template and the parsers.
fn read_tools(v: Option<&Value>) -> Result<Vec<Value>, ApiError> {
    let list = match v {
        None => return Ok(Vec::new()),
        Some(Value::Array(list)) => list,
        Some(v) => return Err(bad("tools", format!("must be a list of tools, not {}", kind_of(v)))),
    };
    let mut out: Vec<Value> = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        let p = format!("tools.{i}.");
        let t = t.as_object().ok_or_else(|| bad(format!("tools.{i}"), "must be a tool object"))?;
        match string(t, "type", &p)? {
            None | Some("custom") => {}
            Some(other) => {
                return Err(bad(
                    format!("{p}type"),
                    format!("{other:?} is a server tool, which this server does not run: client tools only (name, description, input_schema)"),
                ))
            }
        }
        let name = required_string(t, "name", &p)?;
        let name_ok = (1..=MAX_TOOL_NAME).contains(&name.len())
            && name.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b'-');
        if !name_ok {
            return Err(bad(
                format!("{p}name"),
                format!("{name:?} does not match ^[a-zA-Z0-9_-]{{1,{MAX_TOOL_NAME}}}$"),
            ));
        }
        if out.iter().any(|o| o["function"]["name"] == name) {
            return Err(bad(format!("{p}name"), format!("{name:?}: tool names must be unique")));
        }
        let description = string(t, "description", &p)?;
        let schema = match field(t, "input_schema") {
            None => return Err(bad(format!("{p}input_schema"), "Field required")),
            Some(Value::Object(s)) => s,
            Some(v) => {
                return Err(bad(
                    format!("{p}input_schema"),
                    format!("must be a JSON Schema object, not {}", kind_of(v)),
                ))
            }
        };
        if let Some(ty) = schema.get("type") {
            if ty != "object" {
                return Err(bad(format!("{p}input_schema.type"), format!("must be \"object\", not {ty}")));
            }
        }
        if schema.get("properties").is_some_and(|p| !p.is_object()) {
            return Err(bad(format!("{p}input_schema.properties"), "must be an object"));
        }
        super::schema::check(&Value::Object(schema.clone()), &format!("{p}input_schema")).map_err(ApiError::invalid)?;
        let mut function = Map::new();
        function.insert("name".into(), name.into());
        if let Some(d) = description {
            function.insert("description".into(), d.into());
        }
        function.insert("parameters".into(), Value::Object(schema.clone()));
        out.push(json!({"type": "function", "function": function}));
    }
    Ok(out)
}

/// `tool_choice` (`auto`, `any`, `tool` with a name, `none`) and its `disable_parallel_tool_use`.
fn read_tool_choice(v: Option<&Value>, tools: &[Value]) -> Result<(ToolChoice, bool), ApiError> {
    let Some(v) = v else {
        return Ok((if tools.is_empty() { ToolChoice::None } else { ToolChoice::Auto }, true));
    };
    let o = v.as_object().ok_or_else(|| {
        bad("tool_choice", format!("must be an object such as {{\"type\": \"auto\"}}, not {}", kind_of(v)))
    })?;
    let parallel = !bool_field(o, "disable_parallel_tool_use", "tool_choice.")?.unwrap_or(false);
    let needs_tools = |what: &str| bad("tool_choice.type", format!("{what:?} needs tools"));
    let choice = match required_string(o, "type", "tool_choice.")? {
        "auto" if tools.is_empty() => ToolChoice::None,
        "auto" => ToolChoice::Auto,
        "none" => ToolChoice::None,
        "any" if tools.is_empty() => return Err(needs_tools("any")),
        "any" => ToolChoice::Required,
        "tool" => {
            let name = required_string(o, "name", "tool_choice.")?;
            if !tools.iter().any(|t| t["function"]["name"] == name) {
                return Err(bad("tool_choice.name", format!("{name:?} is not among the tools")));
            }
            ToolChoice::Named(name.to_string())
        }
        other => return Err(bad("tool_choice.type", format!("{other:?}: one of auto, any, tool, none"))),
    };
    Ok((choice, parallel))
}

/// Checks a `/v1/messages` body and maps it to the chat path's form. `counting`: a
/// `count_tokens` body (no `max_tokens`). `thinking_switch`: the template reads
/// `enable_thinking`, which `thinking` then sets. `fresh_seed` seeds the sampler.
pub fn read_request(
    body: &[u8],
    counting: bool,
    thinking_switch: bool,
    fresh_seed: impl FnOnce() -> u64,
) -> Result<MessagesRequest, ApiError> {
    let v: Value =
        serde_json::from_slice(body).map_err(|e| ApiError::invalid(format!("the body is not valid JSON: {e}")))?;
    let o = v
        .as_object()
        .ok_or_else(|| ApiError::invalid(format!("the body must be a JSON object, not {}", kind_of(&v))))?;
    string(o, "model", "")?;
    let max_tokens = match count(o, "max_tokens", "", 1)? {
        None if !counting => return Err(bad("max_tokens", "Field required")),
        m => m.map(|m| usize::try_from(m).unwrap_or(usize::MAX)),
    };
    let temperature = number(o, "temperature", |t| (0.0..=1.0).contains(&t), "[0, 1]")?.unwrap_or(1.0);
    let top_p = number(o, "top_p", |p| p > 0.0 && p <= 1.0, "(0, 1]")?.unwrap_or(1.0);
    let top_k = count(o, "top_k", "", 0)?.map_or(0, |k| usize::try_from(k).unwrap_or(usize::MAX));
    let stream = bool_field(o, "stream", "")?.unwrap_or(false);
    let stop_sequences = match field(o, "stop_sequences") {
        None => Vec::new(),
        Some(Value::Array(list)) => {
            if list.len() > MAX_STOP_SEQUENCES {
                return Err(bad("stop_sequences", format!("{} strings: at most {MAX_STOP_SEQUENCES}", list.len())));
            }
            let mut out = Vec::with_capacity(list.len());
            for (i, s) in list.iter().enumerate() {
                match s.as_str() {
                    Some(s) if !s.is_empty() && s.len() <= MAX_STOP_BYTES => out.push(s.to_string()),
                    _ => {
                        return Err(bad(
                            format!("stop_sequences.{i}"),
                            format!("must be a string of 1 to {MAX_STOP_BYTES} bytes"),
                        ))
                    }
                }
            }
            out
        }
        Some(v) => return Err(bad("stop_sequences", format!("must be a list of strings, not {}", kind_of(v)))),
    };
    let mut template_vars = Map::new();
    if let Some(t) = field(o, "thinking") {
        let t = t.as_object().ok_or_else(|| bad("thinking", format!("must be an object, not {}", kind_of(t))))?;
        let on = match required_string(t, "type", "thinking.")? {
            "enabled" => true,
            "disabled" => false,
            other => return Err(bad("thinking.type", format!("{other:?}: one of enabled, disabled"))),
        };
        count(t, "budget_tokens", "thinking.", 1)?;
        if thinking_switch {
            template_vars.insert("enable_thinking".into(), on.into());
        }
    }
    let tools = read_tools(field(o, "tools"))?;
    let (choice, parallel) = read_tool_choice(field(o, "tool_choice"), &tools)?;
    let offered: Vec<Value> = match &choice {
        ToolChoice::Named(n) => tools.iter().filter(|t| t["function"]["name"] == n.as_str()).cloned().collect(),
        _ => tools,
    };
    let mut messages = Vec::new();
    if let Some(system) = field(o, "system") {
        let text = text_or_blocks(system, "system")?;
        if !text.is_empty() {
            messages.push(json!({"role": "system", "content": text}));
        }
    }
    let prefill = read_messages(field(o, "messages"), &mut messages)?;
    Ok(MessagesRequest {
        messages,
        prefill,
        tools: ToolRequest {
            tools: (!offered.is_empty()).then_some(Value::Array(offered)),
            choice,
            parallel,
            template_vars,
        },
        gen: Generation {
            stream,
            include_usage: false,
            max_tokens,
            sampling: SamplingParams {
                temperature: temperature as f32,
                top_k,
                top_p: top_p as f32,
                seed: fresh_seed(),
            },
            stop: stop_sequences.clone(),
            ignore_eos: false,
        },
        stop_sequences,
    })
}

/// `messages` in OpenAI's form, added to `out`; returns the prefill (a final assistant turn's
/// text).
fn read_messages(v: Option<&Value>, out: &mut Vec<Value>) -> Result<String, ApiError> {
    let list = match v {
        None => return Err(bad("messages", "Field required")),
        Some(Value::Array(list)) => list,
        Some(v) => return Err(bad("messages", format!("must be a list of messages, not {}", kind_of(v)))),
    };
    if list.is_empty() {
        return Err(bad("messages", "must hold at least one message"));
    }
    if list.len() > MAX_MESSAGES {
        return Err(bad("messages", format!("more than {MAX_MESSAGES} messages")));
    }
    // The ids of the tool_use blocks so far: each tool_result answers one of them.
    let mut called: Vec<String> = Vec::new();
    let mut prefill = String::new();
    for (i, m) in list.iter().enumerate() {
        let p = format!("messages.{i}.");
        let m = m.as_object().ok_or_else(|| bad(format!("messages.{i}"), "must be an object with role and content"))?;
        let role = required_string(m, "role", &p)?;
        let content = field(m, "content").ok_or_else(|| bad(format!("{p}content"), "Field required"))?;
        let blocks = read_blocks(content, &format!("{p}content"))?;
        let misplaced = |j: usize, b: &Block, turn: &str| {
            bad(format!("{p}content.{j}.type"), format!("a {} block cannot be in {turn} turn", b.kind()))
        };
        match role {
            "user" => {
                let (mut text, mut results): (Vec<String>, bool) = (Vec::new(), false);
                for (j, b) in blocks.into_iter().enumerate() {
                    match b {
                        Block::Text(t) => text.push(t),
                        Block::ToolResult { id, text: result } => {
                            if !called.contains(&id) {
                                return Err(bad(
                                    format!("{p}content.{j}.tool_use_id"),
                                    format!("{id:?} answers no tool_use block of an earlier assistant turn"),
                                ));
                            }
                            // Text before a result stays before it.
                            if !text.is_empty() {
                                out.push(json!({"role": "user", "content": text.join("\n")}));
                                text.clear();
                            }
                            out.push(json!({"role": "tool", "tool_call_id": id, "content": result}));
                            results = true;
                        }
                        b => return Err(misplaced(j, &b, "a user")),
                    }
                }
                // A turn of tool results alone adds no user message.
                if !(results && text.is_empty()) {
                    out.push(json!({"role": "user", "content": text.join("\n")}));
                }
            }
            "assistant" => {
                let (mut text, mut reasoning, mut calls) = (Vec::new(), Vec::new(), Vec::new());
                for (j, b) in blocks.into_iter().enumerate() {
                    match b {
                        Block::Text(t) => text.push(t),
                        Block::Thinking(t) => reasoning.push(t),
                        Block::Redacted => {}
                        Block::ToolUse { id, name, input } => {
                            calls.push(json!({"id": id, "type": "function",
                                "function": {"name": name, "arguments": input.to_string()}}));
                            called.push(id);
                        }
                        b => return Err(misplaced(j, &b, "an assistant")),
                    }
                }
                if i + 1 == list.len() {
                    if !calls.is_empty() {
                        return Err(bad(
                            format!("{p}content"),
                            "a final assistant turn is a prefill the reply continues: text only, no tool_use",
                        ));
                    }
                    prefill = text.join("\n");
                    continue;
                }
                let mut msg = json!({"role": "assistant",
                    "content": if text.is_empty() && !calls.is_empty() { Value::Null } else { text.join("\n").into() }});
                if !calls.is_empty() {
                    msg["tool_calls"] = Value::Array(calls);
                }
                if !reasoning.is_empty() {
                    msg["reasoning_content"] = reasoning.join("\n").into();
                }
                out.push(msg);
            }
            "system" => {
                return Err(bad(
                    format!("{p}role"),
                    "\"system\" is not a message role: the system prompt goes in `system`",
                ))
            }
            other => return Err(bad(format!("{p}role"), format!("{other:?}: one of user, assistant"))),
        }
    }
    Ok(prefill)
}

/// Whether the chat template has a thinking switch (`enable_thinking`, Qwen3's).
fn thinking_switch(s: &AppState) -> bool {
    s.codec.chat_template().is_some_and(|t| t.contains("enable_thinking"))
}

/// The prompt's tokens and text: the conversation through the chat template, then the prefill.
fn render(s: &AppState, req: &MessagesRequest) -> Result<(Vec<u32>, String), ApiError> {
    if !s.codec.has_chat_template() {
        return Err(ApiError::invalid(
            "the model has no chat template (tokenizer_config.json): /v1/messages needs one",
        ));
    }
    let mut text = s
        .codec
        .render_conversation(req.messages.clone(), req.tools.tools.clone(), req.tools.template_vars.clone())
        .map_err(|e| bad("messages", e))?;
    text.push_str(&req.prefill);
    let prompt = s.codec.encode_plain(&text).map_err(|e| bad("messages", e))?;
    Ok((prompt, text))
}

async fn count_tokens(State(s): State<Shared>, b: Result<Bytes, BytesRejection>) -> Result<Response, AnthropicError> {
    let req = read_request(&routes::body(b)?, true, thinking_switch(&s), || 0)?;
    let (prompt, _) = render(&s, &req)?;
    Ok(Json(json!({"input_tokens": prompt.len()})).into_response())
}

async fn messages(State(s): State<Shared>, b: Result<Bytes, BytesRejection>) -> Result<Response, AnthropicError> {
    let req = read_request(&routes::body(b)?, false, thinking_switch(&s), routes::fresh_seed)?;
    let (prompt, rendered) = render(&s, &req)?;
    // `max_tokens` beyond the room the context leaves is cut to it (Anthropic's clients ask for
    // tens of thousands); a reply that fills it ends with `model_context_window_exceeded`.
    let room = routes::admit(&s, "messages", &prompt, None)?;
    let requested = req.gen.max_tokens.unwrap_or(room);
    let n = s.next_id.fetch_add(1, Relaxed);
    let id = format!("msg_{:x}{n:06x}", s.started);
    let label = format!("request {n} (messages)");
    let parse_calls = req.tools.choice != ToolChoice::None;
    let mut stop = req.gen.stop.clone();
    let reply = s.tool_format.map(|format| {
        if parse_calls {
            stop.extend(format.stop_strings().iter().map(|s| s.to_string()));
        }
        let plan = ReplyPlan {
            format,
            opts: ParserOptions {
                tools: parse_calls,
                starts_in_reasoning: ParserOptions::prompt_opens_think(&rendered),
                id_prefix: String::new(),
                schemas: req.tools.tools.clone(),
            },
            choice: req.tools.choice.clone(),
            parallel: req.tools.parallel,
        };
        Reply::new(plan, &id, label.clone())
    });
    let (tx, rx) = unbounded_channel();
    let job = Job {
        prompt,
        max_tokens: requested.min(room),
        sampling: req.gen.sampling,
        stop,
        ignore_eos: false,
        events: tx,
        label: Some(label),
        keep_special: reply.is_some(),
    };
    let input_tokens = job.prompt.len();
    routes::submit(&s, job)?;
    let out = Out {
        id,
        model: s.model_id.clone(),
        input_tokens,
        stop_sequences: req.stop_sequences,
        context_capped: requested > room,
        reply,
    };
    if req.gen.stream {
        Ok(Sse::new(sse(Streamer::new(out), rx)).into_response())
    } else {
        whole(out, rx).await
    }
}

/// One reply: its fixed fields and its parser.
struct Out {
    id: String,
    model: String,
    input_tokens: usize,
    stop_sequences: Vec<String>,
    /// `max_tokens` was cut to the room the context left.
    context_capped: bool,
    /// The family's parser (`None`: no tool-call format; the reply is text).
    reply: Option<Reply>,
}

impl Out {
    /// What `text` (`None`: the end) adds to the reply.
    fn feed(&mut self, text: Option<&str>) -> Vec<Parsed> {
        match (&mut self.reply, text) {
            (Some(r), t) => r.feed(t),
            (None, Some(t)) => vec![Parsed::Content(t.to_string())],
            (None, None) => Vec::new(),
        }
    }

    /// `stop_reason` and `stop_sequence` of a reply that ended with `f`.
    fn stop_reason(&self, f: &Finish) -> (&'static str, Option<String>) {
        let calls = self.reply.as_ref().map_or(0, |r| {
            let _ = r.finish_reason(f.reason); // logs a requested call that never came
            r.calls
        });
        stop_reason(f, calls, &self.stop_sequences, self.context_capped)
    }

    fn message(&self, content: Vec<Value>, f: &Finish) -> Value {
        let (reason, sequence) = self.stop_reason(f);
        json!({
            "id": self.id, "type": "message", "role": "assistant", "model": self.model,
            "content": content, "stop_reason": reason, "stop_sequence": sequence,
            "usage": usage(f.prompt_tokens, f.completion_tokens),
        })
    }
}

/// Anthropic's `stop_reason` (and `stop_sequence`) for a finish: `max_tokens` (or
/// `model_context_window_exceeded` when the context cut `max_tokens`), `stop_sequence` for one
/// of the request's `stop_sequences` (the first entries of the job's stop strings), `tool_use`
/// after calls, else `end_turn`.
fn stop_reason(f: &Finish, calls: usize, stops: &[String], capped: bool) -> (&'static str, Option<String>) {
    if f.reason == "length" {
        return (if capped { "model_context_window_exceeded" } else { "max_tokens" }, None);
    }
    if let Some(s) = f.stop_sequence.and_then(|i| stops.get(i)) {
        return ("stop_sequence", Some(s.clone()));
    }
    (if calls > 0 { "tool_use" } else { "end_turn" }, None)
}

fn usage(input: usize, output: usize) -> Value {
    json!({"input_tokens": input, "output_tokens": output,
        "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0})
}

/// A call's `tool_use` id: the parser's `call_…` ids become `toolu_…` (a family's own ids, such
/// as Kimi's, are kept).
fn tool_use_id(c: &ToolCall) -> String {
    match c.id.strip_prefix("call_") {
        Some(rest) => format!("toolu_{rest}"),
        None => c.id.clone(),
    }
}

/// A call's arguments as `input`: the parser returns a JSON object's text.
fn tool_input(c: &ToolCall) -> Value {
    match serde_json::from_str::<Value>(&c.arguments) {
        Ok(v @ Value::Object(_)) => v,
        _ => {
            tracing::warn!("the arguments of the call to {} are not a JSON object: {}", c.name, c.arguments);
            json!({})
        }
    }
}

/// A whole reply's content blocks: runs of text or reasoning joined into one block each.
fn blocks(events: Vec<Parsed>) -> Vec<Value> {
    let mut out: Vec<Value> = Vec::new();
    for e in events {
        let (kind, t) = match e {
            Parsed::Content(t) => ("text", t),
            Parsed::Reasoning(t) => ("thinking", t),
            Parsed::Call(c) => {
                out.push(json!({"type": "tool_use", "id": tool_use_id(&c), "name": c.name, "input": tool_input(&c)}));
                continue;
            }
            Parsed::Note(_) => continue,
        };
        if t.is_empty() {
            continue;
        }
        match out.last_mut() {
            Some(last) if last["type"] == kind => {
                let joined = format!("{}{t}", last[kind].as_str().unwrap_or_default());
                last[kind] = joined.into();
            }
            _ if kind == "thinking" => out.push(json!({"type": "thinking", "thinking": t, "signature": ""})),
            _ => out.push(json!({"type": "text", "text": t})),
        }
    }
    out
}

/// Waits for the whole reply (dropping this future, as a closed connection does, cancels it).
async fn whole(mut out: Out, mut rx: UnboundedReceiver<Event>) -> Result<Response, AnthropicError> {
    let mut parsed = Vec::new();
    while let Some(e) = rx.recv().await {
        match e {
            Event::Text(t) => parsed.extend(out.feed(Some(&t))),
            Event::Done(f) if f.reason == SHUTDOWN => {
                return Err(ApiError::unavailable("the server shut down before this reply ended").into())
            }
            Event::Done(f) => {
                parsed.extend(out.feed(None));
                return Ok(Json(out.message(blocks(parsed), &f)).into_response());
            }
            Event::Failed(msg) => return Err(ApiError::internal(msg).into()),
        }
    }
    Err(ApiError::unavailable("the server stopped before the generation finished").into())
}

/// The kind of the content block a stream has open.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Open {
    Text,
    Thinking,
}

/// A streamed reply: Anthropic's events from the parser's, with the open block tracked.
struct Streamer {
    out: Out,
    open: Option<Open>,
    /// The index of the next (or the open) content block.
    index: usize,
}

/// One SSE event: `event: <type>` and its JSON.
type Named = (&'static str, Value);

impl Streamer {
    fn new(out: Out) -> Streamer {
        Streamer { out, open: None, index: 0 }
    }

    fn start(&self) -> Vec<Named> {
        let message = json!({
            "id": self.out.id, "type": "message", "role": "assistant", "model": self.out.model, "content": [],
            "stop_reason": null, "stop_sequence": null, "usage": usage(self.out.input_tokens, 0),
        });
        vec![("message_start", json!({"type": "message_start", "message": message})), ("ping", json!({"type": "ping"}))]
    }

    fn close(&mut self, v: &mut Vec<Named>) {
        if self.open.take().is_some() {
            v.push(("content_block_stop", json!({"type": "content_block_stop", "index": self.index})));
            self.index += 1;
        }
    }

    fn delta(&mut self, kind: Open, text: String, v: &mut Vec<Named>) {
        if text.is_empty() {
            return;
        }
        if self.open != Some(kind) {
            self.close(v);
            let block = match kind {
                Open::Text => json!({"type": "text", "text": ""}),
                Open::Thinking => json!({"type": "thinking", "thinking": "", "signature": ""}),
            };
            v.push((
                "content_block_start",
                json!({"type": "content_block_start", "index": self.index, "content_block": block}),
            ));
            self.open = Some(kind);
        }
        let delta = match kind {
            Open::Text => json!({"type": "text_delta", "text": text}),
            Open::Thinking => json!({"type": "thinking_delta", "thinking": text}),
        };
        v.push(("content_block_delta", json!({"type": "content_block_delta", "index": self.index, "delta": delta})));
    }

    /// The events of parsed text.
    fn events(&mut self, parsed: Vec<Parsed>) -> Vec<Named> {
        let mut v = Vec::new();
        for e in parsed {
            match e {
                Parsed::Content(t) => self.delta(Open::Text, t, &mut v),
                Parsed::Reasoning(t) => self.delta(Open::Thinking, t, &mut v),
                Parsed::Call(c) => {
                    self.close(&mut v);
                    let i = self.index;
                    let block = json!({"type": "tool_use", "id": tool_use_id(&c), "name": c.name, "input": {}});
                    let args = tool_input(&c).to_string();
                    v.push((
                        "content_block_start",
                        json!({"type": "content_block_start", "index": i, "content_block": block}),
                    ));
                    v.push((
                        "content_block_delta",
                        json!({"type": "content_block_delta", "index": i,
                            "delta": {"type": "input_json_delta", "partial_json": args}}),
                    ));
                    v.push(("content_block_stop", json!({"type": "content_block_stop", "index": i})));
                    self.index += 1;
                }
                Parsed::Note(_) => {}
            }
        }
        v
    }

    /// The last events: the rest of the text, the open block's stop, `message_delta` and
    /// `message_stop`.
    fn finish(&mut self, f: &Finish) -> Vec<Named> {
        let rest = self.out.feed(None);
        let mut v = self.events(rest);
        self.close(&mut v);
        let (reason, sequence) = self.out.stop_reason(f);
        v.push((
            "message_delta",
            json!({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": {"input_tokens": f.prompt_tokens, "output_tokens": f.completion_tokens}}),
        ));
        v.push(("message_stop", json!({"type": "message_stop"})));
        v
    }
}

fn sse_event((name, data): Named) -> SseEvent {
    SseEvent::default().event(name).data(data.to_string())
}

fn error_event(e: ApiError) -> Named {
    ("error", AnthropicError(e).body())
}

/// The SSE stream. Dropping it (the client went away) closes the receiver, which cancels the
/// generation.
fn sse(streamer: Streamer, rx: UnboundedReceiver<Event>) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    let opening = streamer.start();
    let body = stream::unfold((streamer, rx, false), |(mut st, mut rx, done)| async move {
        if done {
            return None;
        }
        let events = match rx.recv().await? {
            Event::Text(t) => {
                let parsed = st.out.feed(Some(&t));
                st.events(parsed)
            }
            Event::Done(f) if f.reason == SHUTDOWN => {
                let e = ApiError::unavailable("the server shut down before this reply ended");
                return Some((vec![error_event(e)], (st, rx, true)));
            }
            Event::Done(f) => {
                let v = st.finish(&f);
                return Some((v, (st, rx, true)));
            }
            Event::Failed(msg) => return Some((vec![error_event(ApiError::internal(msg))], (st, rx, true))),
        };
        Some((events, (st, rx, false)))
    });
    stream::iter(opening).chain(body.flat_map(stream::iter)).map(|e| Ok(sse_event(e)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(body: Value) -> Result<MessagesRequest, ApiError> {
        read_request(body.to_string().as_bytes(), false, true, || 7)
    }

    fn user(content: Value) -> Value {
        json!({"role": "user", "content": content})
    }

    const WEATHER: &str = r#"{"name": "get_weather", "description": "Weather of a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}"#;

    fn weather() -> Value {
        serde_json::from_str(WEATHER).unwrap()
    }

    #[test]
    fn a_conversation_maps_to_the_openai_form() {
        let r = read(json!({
            "model": "m", "max_tokens": 20, "system": [{"type": "text", "text": "Be brief."}],
            "temperature": 0.5, "top_k": 4, "stop_sequences": ["END"], "metadata": {"user_id": "u"},
            "tools": [weather()], "thinking": {"type": "disabled"},
            "messages": [
                user(json!("Weather in Paris?")),
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "Look it up.", "signature": "sig"},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                user(json!([{"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
                    {"type": "text", "text": "And tomorrow?"}])),
                {"role": "assistant", "content": "Tomorrow"}]
        }))
        .unwrap();
        let m = &r.messages;
        assert_eq!(m.len(), 5, "{m:?}");
        assert_eq!(m[0], json!({"role": "system", "content": "Be brief."}));
        assert_eq!(m[1], json!({"role": "user", "content": "Weather in Paris?"}));
        assert_eq!(m[2]["content"], "Checking.");
        assert_eq!(m[2]["reasoning_content"], "Look it up.");
        assert_eq!(
            m[2]["tool_calls"],
            json!([{"id": "toolu_1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}])
        );
        assert_eq!(m[3], json!({"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"}));
        assert_eq!(m[4], json!({"role": "user", "content": "And tomorrow?"}));
        assert_eq!(r.prefill, "Tomorrow", "a final assistant turn is a prefill");
        assert_eq!(r.tools.choice, ToolChoice::Auto);
        let tools = r.tools.tools.unwrap();
        assert_eq!(tools[0]["function"]["name"], "get_weather");
        assert_eq!(tools[0]["function"]["parameters"]["properties"]["city"]["type"], "string");
        assert_eq!(r.tools.template_vars["enable_thinking"], false);
        assert_eq!(
            (r.gen.max_tokens, r.gen.stop.as_slice(), r.gen.sampling.top_k),
            (Some(20), &["END".to_string()][..], 4)
        );
        assert_eq!((r.gen.sampling.temperature, r.gen.sampling.seed, r.gen.stream), (0.5, 7, false));
    }

    #[test]
    fn tool_choice_and_thinking_map() {
        let base = |extra: Value| {
            let mut b = json!({"max_tokens": 5, "messages": [user(json!("x"))], "tools": [weather()]});
            for (k, v) in extra.as_object().unwrap() {
                b[k] = v.clone();
            }
            read(b).unwrap()
        };
        assert_eq!(base(json!({"tool_choice": {"type": "any"}})).tools.choice, ToolChoice::Required);
        assert_eq!(base(json!({"tool_choice": {"type": "none"}})).tools.choice, ToolChoice::None);
        let named =
            base(json!({"tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": true}}));
        assert_eq!((named.tools.choice, named.tools.parallel), (ToolChoice::Named("get_weather".into()), false));
        let on = base(json!({"thinking": {"type": "enabled", "budget_tokens": 1024}}));
        assert_eq!(on.tools.template_vars["enable_thinking"], true);
        // A template without the switch gets no variable.
        let b = json!({"max_tokens": 5, "messages": [user(json!("x"))], "thinking": {"type": "enabled"}});
        let r = read_request(b.to_string().as_bytes(), false, false, || 0).unwrap();
        assert!(r.tools.template_vars.is_empty());
        assert_eq!(r.tools.choice, ToolChoice::None, "no tools: nothing is parsed as a call");
        // count_tokens needs no max_tokens.
        let b = json!({"messages": [user(json!("x"))]});
        assert_eq!(read_request(b.to_string().as_bytes(), true, false, || 0).unwrap().gen.max_tokens, None);
    }

    #[test]
    fn bad_requests_name_the_field() {
        let ok = || json!({"max_tokens": 5, "messages": [user(json!("x"))], "tools": [weather()]});
        let with = |path: &[&str], v: Value| {
            let mut b = ok();
            let mut at = &mut b;
            for k in &path[..path.len() - 1] {
                at = match k.parse::<usize>() {
                    Ok(i) => &mut at[i],
                    Err(_) => &mut at[*k],
                };
            }
            match v {
                Value::Null => {
                    at.as_object_mut().unwrap().remove(path[path.len() - 1]);
                }
                v => at[path[path.len() - 1]] = v,
            }
            b
        };
        let tool_use = json!({"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}]});
        for (body, want) in [
            (with(&["max_tokens"], Value::Null), "max_tokens: Field required"),
            (with(&["max_tokens"], json!(0)), "max_tokens: must be an integer >= 1"),
            (with(&["messages"], json!([])), "messages: must hold at least one message"),
            (with(&["messages"], json!([{"role": "robot", "content": "x"}])), "messages.0.role: \"robot\""),
            (with(&["messages"], json!([{"role": "system", "content": "x"}])), "messages.0.role"),
            (with(&["messages"], json!([{"role": "user"}])), "messages.0.content: Field required"),
            (with(&["messages"], json!([user(json!([{"type": "video"}]))])), "messages.0.content.0.type: unknown"),
            (with(&["messages"], json!([user(json!([{"type": "image", "source": {}}]))])), "messages.0.content.0.type"),
            (
                with(&["messages"], json!([user(json!([{"type": "text"}]))])),
                "messages.0.content.0.text: Field required",
            ),
            (with(&["messages"], json!([user(json!([{"text": "x"}]))])), "messages.0.content.0.type: Field required"),
            (with(&["messages"], json!([user(json!(5))])), "messages.0.content: must be a string or a list"),
            (
                with(&["messages"], json!([user(json!("x")), tool_use.clone()])),
                "messages.1.content: a final assistant turn",
            ),
            (
                with(
                    &["messages"],
                    json!([
                        user(json!("x")),
                        tool_use.clone(),
                        user(json!([{"type": "tool_result", "tool_use_id": "t9", "content": "r"}]))
                    ]),
                ),
                "messages.2.content.0.tool_use_id: \"t9\" answers no tool_use",
            ),
            (
                with(&["messages"], json!([user(json!([{"type": "tool_use", "id": "a", "name": "b", "input": {}}]))])),
                "messages.0.content.0.type: a tool_use block cannot be in a user turn",
            ),
            (
                with(
                    &["messages"],
                    json!([user(json!("x")), {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "a"}]}, user(json!("y"))]),
                ),
                "messages.1.content.0.type: a tool_result block cannot be in an assistant turn",
            ),
            (
                with(
                    &["messages"],
                    json!([user(json!("x")), {"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "b", "input": "{}"}]}, user(json!("y"))]),
                ),
                "messages.1.content.0.input: must be an object",
            ),
            (
                with(&["tool_choice"], json!({"type": "tool", "name": "nope"})),
                "tool_choice.name: \"nope\" is not among the tools",
            ),
            (with(&["tool_choice"], json!({"type": "sometimes"})), "tool_choice.type"),
            (with(&["tool_choice"], json!("auto")), "tool_choice: must be an object"),
            (with(&["tools", "0", "input_schema"], Value::Null), "tools.0.input_schema: Field required"),
            (
                with(&["tools", "0", "input_schema"], json!("a string")),
                "tools.0.input_schema: must be a JSON Schema object",
            ),
            (with(&["tools", "0", "input_schema", "type"], json!("string")), "tools.0.input_schema.type"),
            (
                with(&["tools", "0", "input_schema", "properties", "city", "type"], json!("strnig")),
                "tools.0.input_schema.properties.city.type: \"strnig\" is not a JSON Schema type",
            ),
            (with(&["tools", "0", "input_schema", "required"], json!("city")), "tools.0.input_schema.required"),
            (with(&["tools", "0", "name"], json!("has space")), "tools.0.name"),
            (
                with(&["tools", "0", "type"], json!("web_search_20250305")),
                "tools.0.type: \"web_search_20250305\" is a server tool",
            ),
            (
                with(&["tools"], json!([weather(), weather()])),
                "tools.1.name: \"get_weather\": tool names must be unique",
            ),
            (with(&["temperature"], json!(1.5)), "temperature: must be a number in [0, 1]"),
            (with(&["top_p"], json!(0)), "top_p"),
            (with(&["top_k"], json!(-1)), "top_k"),
            (with(&["stream"], json!("yes")), "stream: must be a boolean"),
            (with(&["stop_sequences"], json!([""])), "stop_sequences.0"),
            (with(&["stop_sequences"], json!("END")), "stop_sequences: must be a list"),
            (with(&["system"], json!([{"type": "image"}])), "system.0.type"),
            (with(&["thinking"], json!({"type": "sometimes"})), "thinking.type"),
            (with(&["model"], json!(5)), "model: must be a string"),
        ] {
            let e = read(body.clone()).unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{body}");
            assert!(e.message.starts_with(want), "{body}:\n  got  {}\n  want {want}…", e.message);
        }
        let e = read_request(b"{\"max_tokens\": ", false, false, || 0).unwrap_err();
        assert!(e.message.starts_with("the body is not valid JSON"), "{}", e.message);
        let e = read_request(b"[1]", false, false, || 0).unwrap_err();
        assert!(e.message.starts_with("the body must be a JSON object"), "{}", e.message);
    }

    #[test]
    fn errors_have_anthropics_shape() {
        let e = AnthropicError(bad("max_tokens", "Field required"));
        assert_eq!(
            e.body(),
            json!({"type": "error", "error": {"type": "invalid_request_error", "message": "max_tokens: Field required"}})
        );
        for (status, kind) in [
            (401, "authentication_error"),
            (404, "not_found_error"),
            (413, "request_too_large"),
            (429, "rate_limit_error"),
            (500, "api_error"),
            (503, "overloaded_error"),
        ] {
            assert_eq!(error_type(StatusCode::from_u16(status).unwrap()), kind);
        }
    }

    fn finish(reason: &'static str, stop: Option<usize>) -> Finish {
        Finish { reason, prompt_tokens: 3, completion_tokens: 2, stop_sequence: stop }
    }

    #[test]
    fn stop_reasons() {
        let stops = ["END".to_string()];
        assert_eq!(stop_reason(&finish("stop", None), 0, &stops, false), ("end_turn", None));
        assert_eq!(stop_reason(&finish("stop", None), 1, &stops, false), ("tool_use", None));
        assert_eq!(stop_reason(&finish("stop", Some(0)), 0, &stops, false), ("stop_sequence", Some("END".into())));
        // A stop string of the tool-call format (after the request's) is not a stop_sequence.
        assert_eq!(stop_reason(&finish("stop", Some(1)), 1, &stops, false), ("tool_use", None));
        assert_eq!(stop_reason(&finish("length", None), 1, &stops, false), ("max_tokens", None));
        assert_eq!(stop_reason(&finish("length", None), 0, &stops, true), ("model_context_window_exceeded", None));
    }

    fn out() -> Out {
        Out {
            id: "msg_1".into(),
            model: "m".into(),
            input_tokens: 3,
            stop_sequences: Vec::new(),
            context_capped: false,
            reply: None,
        }
    }

    fn call(index: usize) -> Parsed {
        Parsed::Call(ToolCall {
            index,
            id: format!("call_1_{index}"),
            name: "get_weather".into(),
            arguments: "{\"city\": \"Paris\"}".into(),
        })
    }

    #[test]
    fn whole_replies_join_runs_into_blocks() {
        let b = blocks(vec![
            Parsed::Reasoning("a".into()),
            Parsed::Reasoning("b".into()),
            Parsed::Content("".into()),
            Parsed::Content("c".into()),
            Parsed::Note("n".into()),
            Parsed::Content("d".into()),
            call(0),
        ]);
        assert_eq!(
            Value::Array(b),
            json!([{"type": "thinking", "thinking": "ab", "signature": ""}, {"type": "text", "text": "cd"},
                {"type": "tool_use", "id": "toolu_1_0", "name": "get_weather", "input": {"city": "Paris"}}])
        );
    }

    #[test]
    fn stream_events_open_and_close_blocks_in_order() {
        let mut st = Streamer::new(out());
        let mut all = st.start();
        all.extend(st.events(vec![Parsed::Reasoning("think".into()), Parsed::Reasoning("ing".into())]));
        all.extend(st.events(vec![Parsed::Content("Hi".into()), call(0), call(1), Parsed::Content("".into())]));
        all.extend(st.finish(&finish("stop", None)));
        let names: Vec<&str> = all.iter().map(|(n, _)| *n).collect();
        assert_eq!(
            names,
            [
                "message_start",
                "ping",
                "content_block_start",
                "content_block_delta",
                "content_block_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "message_delta",
                "message_stop"
            ]
        );
        for (name, data) in &all {
            assert_eq!(data["type"], *name, "an event's name is its data's type");
        }
        let starts: Vec<(u64, &str)> = all
            .iter()
            .filter(|(n, _)| *n == "content_block_start")
            .map(|(_, d)| (d["index"].as_u64().unwrap(), d["content_block"]["type"].as_str().unwrap()))
            .collect();
        assert_eq!(starts, [(0, "thinking"), (1, "text"), (2, "tool_use"), (3, "tool_use")]);
        assert_eq!(all[4].1["delta"], json!({"type": "thinking_delta", "thinking": "ing"}));
        assert_eq!(all[10].1["delta"], json!({"type": "input_json_delta", "partial_json": "{\"city\":\"Paris\"}"}));
        assert_eq!(all[15].1["delta"], json!({"stop_reason": "end_turn", "stop_sequence": null}));
        assert_eq!(all[15].1["usage"]["output_tokens"], 2);
    }

    proptest::proptest! {
        /// Any JSON body, however mangled, is a request or a 400: never a panic.
        #[test]
        fn random_bodies_are_requests_or_400s(body in arb_body()) {
            if let Err(e) = read_request(body.to_string().as_bytes(), false, true, || 0) {
                proptest::prop_assert_eq!(e.status, StatusCode::BAD_REQUEST);
            }
        }
    }

    /// JSON built from the Messages API's own keys and values, so that most bodies get deep.
    fn arb_body() -> impl proptest::strategy::Strategy<Value = Value> {
        use proptest::prelude::*;
        let words = prop::sample::select(vec![
            "user",
            "assistant",
            "system",
            "text",
            "tool_use",
            "tool_result",
            "thinking",
            "image",
            "auto",
            "any",
            "tool",
            "none",
            "enabled",
            "object",
            "x",
            "",
            "t1",
        ]);
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            (-3i64..3000).prop_map(Value::from),
            (-1.0f64..2.0).prop_map(Value::from),
            words.prop_map(Value::from),
        ];
        let keys = prop::sample::select(vec![
            "model",
            "max_tokens",
            "messages",
            "system",
            "role",
            "content",
            "type",
            "text",
            "id",
            "name",
            "input",
            "tool_use_id",
            "tools",
            "tool_choice",
            "input_schema",
            "thinking",
            "stop_sequences",
            "temperature",
            "stream",
            "properties",
            "is_error",
        ]);
        leaf.prop_recursive(5, 64, 6, move |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                prop::collection::vec((keys.clone(), inner), 0..6)
                    .prop_map(|kv| Value::Object(kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect())),
            ]
        })
    }
}
