//! The HTTP side: routes, API-key check, request limits, and the OpenAI response and SSE shapes
//! (Anthropic's Messages API is mounted from [`super::anthropic`]).

use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::http::{header, HeaderMap, StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::stream::{self, Stream, StreamExt};
use krasis_model::text::tokenizer::TextCodec;
use krasis_model::text::tool_calls::{Parsed, ParserOptions, StreamParser, ToolCall, ToolFormat};
use serde_json::{json, Value};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use super::api::{parse, ChatRequest, CompletionRequest, Generation, Prompt, ToolChoice};
use super::error::ApiError;
use krasis_model::runtime::metrics::Metrics;
use krasis_model::runtime::scheduler::{Event, Finish, Job, Refused, Scheduler, SHUTDOWN};

/// What every handler shares.
pub struct AppState {
    pub scheduler: Scheduler,
    pub codec: Arc<TextCodec>,
    pub metrics: Arc<Metrics>,
    /// The id `/v1/models` lists and responses carry.
    pub model_id: String,
    /// Prompt + completion tokens one request may span.
    pub context: usize,
    pub vocab: usize,
    pub api_key: Option<String>,
    /// Unix time the server started (the model's `created`).
    pub started: u64,
    /// Set on SIGINT/SIGTERM: new generations get 503.
    pub shutting_down: AtomicBool,
    /// Numbers the response ids and request log lines.
    pub next_id: AtomicU64,
    /// How the model writes tool calls and reasoning (by its chat template, else its family);
    /// `None`: replies are plain text.
    pub tool_format: Option<ToolFormat>,
}

pub(super) type Shared = Arc<AppState>;

pub fn router(state: Shared, max_body_bytes: usize) -> Router {
    let v1 = Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route_layer(middleware::from_fn_with_state(state.clone(), require_key));
    Router::new()
        .merge(v1)
        .merge(super::anthropic::router(state.clone()))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(|uri: Uri| async move { refuse(&uri, ApiError::not_found("no such route")) })
        .method_not_allowed_fallback(|uri: Uri| async move {
            let e = ApiError::invalid("method not allowed on this route").with_status(StatusCode::METHOD_NOT_ALLOWED);
            refuse(&uri, e)
        })
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .layer(middleware::from_fn_with_state(state.clone(), count_requests))
        .with_state(state)
}

/// A refusal in the shape of the API the path belongs to: Anthropic's under `/v1/messages`,
/// else OpenAI's.
fn refuse(uri: &Uri, e: ApiError) -> Response {
    if uri.path().starts_with("/v1/messages") {
        super::anthropic::AnthropicError(e).into_response()
    } else {
        e.into_response()
    }
}

pub(super) fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// Counts every answered request by route and status (`/metrics`), and logs it at debug.
async fn count_requests(State(s): State<Shared>, req: Request, next: Next) -> Response {
    let route = req.extensions().get::<MatchedPath>().map_or("unmatched", |p| p.as_str()).to_string();
    let method = req.method().clone();
    let res = next.run(req).await;
    s.metrics.record_request(&route, res.status().as_u16());
    tracing::debug!("{method} {route} -> {}", res.status());
    res
}

/// `Authorization: Bearer <key>` when the server has `--api-key`.
async fn require_key(State(s): State<Shared>, req: Request, next: Next) -> Response {
    if let Some(e) = key_refusal(&s, req.headers()) {
        return e.into_response();
    }
    next.run(req).await
}

/// Why a request's key is refused when the server has `--api-key`: the key goes in
/// `Authorization: Bearer <key>` (OpenAI's clients) or `x-api-key: <key>` (Anthropic's).
pub(super) fn key_refusal(s: &AppState, headers: &HeaderMap) -> Option<ApiError> {
    let key = s.api_key.as_ref()?;
    let wrong = || Some(ApiError::unauthorized("incorrect API key", Some("invalid_api_key")));
    // Header values are not repeated back: they may be the key itself.
    if let Some(value) = headers.get("x-api-key") {
        return if same_key(value.as_bytes().trim_ascii(), key.as_bytes()) { None } else { wrong() };
    }
    match headers.get(header::AUTHORIZATION) {
        None => Some(ApiError::unauthorized(
            "no API key: send it as `Authorization: Bearer <key>` or `x-api-key: <key>`",
            None,
        )),
        Some(value) => match bearer(value.as_bytes()) {
            None => Some(ApiError::unauthorized(
                "the Authorization header is malformed: its form is `Authorization: Bearer <key>`",
                None,
            )),
            Some(k) if !same_key(k, key.as_bytes()) => wrong(),
            Some(_) => None,
        },
    }
}

/// The key of an `Authorization: Bearer <key>` value (the scheme's name in any case, RFC 9110),
/// or `None` for another form.
fn bearer(value: &[u8]) -> Option<&[u8]> {
    let (scheme, key) = value.split_at_checked(6)?;
    let key = key.strip_prefix(b" ")?.trim_ascii();
    (scheme.eq_ignore_ascii_case(b"bearer") && !key.is_empty()).then_some(key)
}

/// Compares keys in time that does not depend on where they differ.
fn same_key(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn health(State(s): State<Shared>) -> Response {
    if s.shutting_down.load(Relaxed) {
        return (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"status": "shutting down"}))).into_response();
    }
    Json(json!({"status": "ok"})).into_response()
}

async fn metrics(State(s): State<Shared>) -> Response {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], s.metrics.render()).into_response()
}

fn model_object(s: &AppState) -> Value {
    json!({"id": s.model_id, "object": "model", "created": s.started, "owned_by": "krasis"})
}

async fn models(State(s): State<Shared>) -> Json<Value> {
    Json(json!({"object": "list", "data": [model_object(&s)]}))
}

async fn model(State(s): State<Shared>, axum::extract::Path(id): axum::extract::Path<String>) -> Response {
    if id == s.model_id {
        Json(model_object(&s)).into_response()
    } else {
        ApiError::not_found(format!("the model `{id}` does not exist (this server serves `{}`)", s.model_id))
            .with_code("model_not_found")
            .into_response()
    }
}

/// The body, or the OpenAI error for a body over the limit or unreadable.
pub(super) fn body(b: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    b.map_err(|r| {
        let status = r.status();
        let msg = if status == StatusCode::PAYLOAD_TOO_LARGE {
            "the request body is larger than the server's limit (--max-body-bytes)".to_string()
        } else {
            r.body_text()
        };
        ApiError::invalid(msg).with_status(status)
    })
}

/// Which endpoint a generation answers: the shapes differ, the work does not.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Text,
}

async fn chat(State(s): State<Shared>, b: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let req: ChatRequest = parse(&body(b)?)?;
    let mut gen = req.common.validate(fresh_seed)?;
    let tools = req.tool_request()?;
    let messages = req.template_messages()?;
    if !s.codec.has_chat_template() {
        return Err(ApiError::invalid("the model has no chat template (tokenizer_config.json); use /v1/completions"));
    }
    let schemas = tools.tools.clone();
    let rendered = s
        .codec
        .render_conversation(messages, tools.tools, tools.template_vars)
        .map_err(|e| ApiError::invalid_param("messages", e.to_string()))?;
    let prompt = s.codec.encode_plain(&rendered).map_err(|e| ApiError::invalid_param("messages", e.to_string()))?;
    let parse_calls = tools.choice != ToolChoice::None;
    let reply = s.tool_format.map(|format| {
        if parse_calls {
            gen.stop.extend(format.stop_strings().iter().map(|s| s.to_string()));
        }
        ReplyPlan {
            format,
            opts: ParserOptions {
                tools: parse_calls,
                starts_in_reasoning: ParserOptions::prompt_opens_think(&rendered),
                id_prefix: String::new(),
                schemas,
            },
            choice: tools.choice.clone(),
            parallel: tools.parallel,
        }
    });
    generate(s, Kind::Chat, prompt, gen, reply).await
}

/// How a chat reply's text is read: the family's parser and what the request asked of tools.
pub(super) struct ReplyPlan {
    pub(super) format: ToolFormat,
    pub(super) opts: ParserOptions,
    pub(super) choice: ToolChoice,
    pub(super) parallel: bool,
}

/// One chat reply's parser and the calls it has returned.
pub(super) struct Reply {
    parser: StreamParser,
    choice: ToolChoice,
    parallel: bool,
    /// Calls kept (with `parallel_tool_calls: false`, the first only).
    pub(super) calls: usize,
    label: String,
}

impl Reply {
    /// A reply to the response `id` (`chatcmpl-…` or Anthropic's `msg_…`): its calls' ids are
    /// `call_{the id's unique part}_{index}`.
    pub(super) fn new(plan: ReplyPlan, id: &str, label: String) -> Reply {
        let mut opts = plan.opts;
        opts.id_prefix = id.trim_start_matches("chatcmpl-").trim_start_matches("msg_").to_string();
        Reply {
            parser: StreamParser::new(plan.format, opts),
            choice: plan.choice,
            parallel: plan.parallel,
            calls: 0,
            label,
        }
    }

    /// What the parser makes of `text` (`None`: the end), with notes logged and calls past the
    /// first dropped when parallel calls are off.
    pub(super) fn feed(&mut self, text: Option<&str>) -> Vec<Parsed> {
        let events = match text {
            Some(t) => self.parser.push(t),
            None => self.parser.finish(),
        };
        let mut out = Vec::with_capacity(events.len());
        for e in events {
            match e {
                Parsed::Note(n) => tracing::warn!("{}: {n}", self.label),
                Parsed::Call(c) if !self.parallel && self.calls > 0 => {
                    tracing::warn!("{}: parallel_tool_calls is false: the call to {} is dropped", self.label, c.name)
                }
                Parsed::Call(mut c) => {
                    c.index = self.calls;
                    self.calls += 1;
                    out.push(Parsed::Call(c));
                }
                e => out.push(e),
            }
        }
        out
    }

    /// The `finish_reason` of a reply that ended for `reason`: `tool_calls` when it ended after
    /// calls; a `required` or named choice that got no call is logged (the reply is the text).
    pub(super) fn finish_reason(&self, reason: &'static str) -> &'static str {
        if self.calls > 0 && reason == "stop" {
            return "tool_calls";
        }
        if self.calls == 0 && matches!(self.choice, ToolChoice::Required | ToolChoice::Named(_)) {
            tracing::warn!(
                "{}: tool_choice asked for a call but the model wrote none; the reply is its text (finish_reason {reason})",
                self.label
            );
        }
        reason
    }
}

fn tool_call_json(c: &ToolCall) -> Value {
    json!({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}})
}

async fn completions(State(s): State<Shared>, b: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let req: CompletionRequest = parse(&body(b)?)?;
    let gen = req.common.validate(fresh_seed)?;
    if req.echo == Some(true) {
        return Err(ApiError::invalid_param("echo", "echo is not supported"));
    }
    let one = |n: usize| {
        if n == 1 {
            Ok(())
        } else {
            Err(ApiError::invalid_param("prompt", format!("{n} prompts: one prompt per request")))
        }
    };
    let prompt = match req.prompt {
        Prompt::Text(t) => encode(&s, t).await?,
        Prompt::Texts(mut v) => {
            one(v.len())?;
            encode(&s, v.swap_remove(0)).await?
        }
        Prompt::Ids(ids) => ids,
        Prompt::IdLists(mut v) => {
            one(v.len())?;
            v.swap_remove(0)
        }
    };
    generate(s, Kind::Text, prompt, gen, None).await
}

/// Tokenising a prompt of up to `--max-body-bytes` takes a while: off the async workers.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f).await.map_err(|e| ApiError::internal(format!("tokeniser task failed: {e}")))
}

async fn encode(s: &AppState, text: String) -> Result<Vec<u32>, ApiError> {
    let codec = s.codec.clone();
    blocking(move || codec.encode(&text)).await?.map_err(|e| ApiError::invalid_param("prompt", e.to_string()))
}

/// A seed for a request that names none.
pub(super) fn fresh_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
    h.finish()
}

/// Checks the prompt against the context, queues the job, and answers in the endpoint's shape.
async fn generate(
    s: Shared,
    kind: Kind,
    prompt: Vec<u32>,
    gen: Generation,
    reply: Option<ReplyPlan>,
) -> Result<Response, ApiError> {
    let param = if kind == Kind::Chat { "messages" } else { "prompt" };
    let max_tokens = admit(&s, param, &prompt, gen.max_tokens)?;
    let n = s.next_id.fetch_add(1, Relaxed);
    let id = match kind {
        Kind::Chat => format!("chatcmpl-{:x}{n:06x}", s.started),
        Kind::Text => format!("cmpl-{:x}{n:06x}", s.started),
    };
    let (tx, rx) = unbounded_channel();
    let label = format!("request {n} ({})", if kind == Kind::Chat { "chat" } else { "completion" });
    let reply = reply.map(|plan| Reply::new(plan, &id, label.clone()));
    let job = Job {
        prompt,
        max_tokens,
        sampling: gen.sampling,
        stop: gen.stop.clone(),
        ignore_eos: gen.ignore_eos,
        events: tx,
        label: Some(label),
        keep_special: reply.is_some(),
    };
    submit(&s, job)?;
    let shape = Shape { kind, id, created: now(), model: s.model_id.clone() };
    if gen.stream {
        Ok(Sse::new(sse(shape, rx, gen.include_usage, reply)).into_response())
    } else {
        whole(shape, rx, reply).await
    }
}

/// The checks before a prompt is queued: the server is not shutting down, the prompt has
/// tokens, each inside the vocabulary, and it fits the context with room for `max_tokens`
/// (`None`: up to the context). Returns the tokens the reply may have; a refusal names `param`.
pub(super) fn admit(
    s: &AppState,
    param: &'static str,
    prompt: &[u32],
    max_tokens: Option<usize>,
) -> Result<usize, ApiError> {
    if s.shutting_down.load(Relaxed) {
        return Err(ApiError::unavailable("the server is shutting down"));
    }
    if prompt.is_empty() {
        return Err(ApiError::invalid_param(param, "the prompt encodes to no tokens"));
    }
    // Ids a client gave, or a tokenizer with more ids than the model's embedding: refused here,
    // not in the engine step that would fail the whole batch.
    if let Some((pos, id)) = prompt.iter().enumerate().find(|(_, &id)| id as usize >= s.vocab) {
        return Err(ApiError::invalid_param(
            param,
            format!("token id {id} at position {pos} is outside the vocabulary of {}", s.vocab),
        ));
    }
    // The same check `krasis generate` makes (the library's).
    krasis_model::runtime::check_context(s.context, prompt.len(), max_tokens)
        .map_err(|e| ApiError::invalid_param(param, e.to_string()).with_code("context_length_exceeded"))
}

/// Queues `job`: 429 when every slot and queue place is taken, 503 once the scheduler stopped.
pub(super) fn submit(s: &AppState, job: Job) -> Result<(), ApiError> {
    match s.scheduler.submit(job) {
        Ok(()) => Ok(()),
        Err(Refused::Busy(q)) => {
            Err(ApiError::busy(format!("{q} requests are already waiting; try again later (--max-queue)")))
        }
        Err(Refused::Stopped) => Err(ApiError::unavailable("the server is shutting down")),
    }
}

/// The fixed parts of one response's objects.
struct Shape {
    kind: Kind,
    id: String,
    created: u64,
    model: String,
}

fn usage(f: &Finish) -> Value {
    json!({
        "prompt_tokens": f.prompt_tokens,
        "completion_tokens": f.completion_tokens,
        "total_tokens": f.prompt_tokens + f.completion_tokens,
    })
}

impl Shape {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.kind, chunk) {
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Text, _) => "text_completion",
        }
    }

    /// One streamed chunk: a text delta (chat: the first carries the role) or the final
    /// `finish_reason`; `usage` is `null` in each when the client asked for usage.
    fn chunk(&self, text: Option<&str>, first: bool, finish: Option<&str>, include_usage: bool) -> Value {
        let choice = match self.kind {
            Kind::Chat => {
                let mut delta = serde_json::Map::new();
                if first {
                    delta.insert("role".into(), "assistant".into());
                }
                if let Some(t) = text {
                    delta.insert("content".into(), t.into());
                }
                json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish})
            }
            Kind::Text => json!({"index": 0, "text": text.unwrap_or(""), "logprobs": null, "finish_reason": finish}),
        };
        let mut v = json!({
            "id": self.id, "object": self.object(true), "created": self.created, "model": self.model,
            "system_fingerprint": null, "choices": [choice],
        });
        if include_usage {
            v["usage"] = Value::Null;
        }
        v
    }

    /// One chat chunk of a parsed reply: its delta object and, in the last, `finish_reason`.
    fn delta_chunk(&self, delta: Value, finish: Option<&str>, include_usage: bool) -> Value {
        let mut v = json!({
            "id": self.id, "object": self.object(true), "created": self.created, "model": self.model,
            "system_fingerprint": null,
            "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}],
        });
        if include_usage {
            v["usage"] = Value::Null;
        }
        v
    }

    /// The chunks of parsed events: a text delta each, and a call as OpenAI streams one (its
    /// id, type and name with empty arguments, then the arguments).
    fn parsed_chunks(&self, events: Vec<Parsed>, include_usage: bool) -> Vec<Value> {
        let mut out = Vec::new();
        for e in events {
            match e {
                Parsed::Content(t) => out.push(self.delta_chunk(json!({"content": t}), None, include_usage)),
                Parsed::Reasoning(t) => {
                    out.push(self.delta_chunk(json!({"reasoning_content": t}), None, include_usage))
                }
                Parsed::Call(c) => {
                    let head = json!({"tool_calls": [{"index": c.index, "id": c.id, "type": "function",
                        "function": {"name": c.name, "arguments": ""}}]});
                    let args = json!({"tool_calls": [{"index": c.index, "function": {"arguments": c.arguments}}]});
                    out.push(self.delta_chunk(head, None, include_usage));
                    out.push(self.delta_chunk(args, None, include_usage));
                }
                Parsed::Note(_) => {}
            }
        }
        out
    }

    /// A whole chat reply read by its parser.
    fn whole_parsed(&self, events: Vec<Parsed>, finish: &'static str, f: &Finish) -> Value {
        let (mut content, mut reasoning, mut calls) = (String::new(), String::new(), Vec::new());
        for e in events {
            match e {
                Parsed::Content(t) => content.push_str(&t),
                Parsed::Reasoning(t) => reasoning.push_str(&t),
                Parsed::Call(c) => calls.push(tool_call_json(&c)),
                Parsed::Note(_) => {}
            }
        }
        let mut message = json!({
            "role": "assistant",
            "content": if content.is_empty() && !calls.is_empty() { Value::Null } else { content.into() },
            "reasoning_content": if reasoning.is_empty() { Value::Null } else { reasoning.into() },
            "refusal": null,
        });
        if !calls.is_empty() {
            message["tool_calls"] = Value::Array(calls);
        }
        json!({
            "id": self.id, "object": self.object(false), "created": self.created, "model": self.model,
            "system_fingerprint": null,
            "choices": [{"index": 0, "message": message, "logprobs": null, "finish_reason": finish}],
            "usage": usage(f),
        })
    }

    /// The final chunk of `stream_options.include_usage`: no choices, the usage.
    fn usage_chunk(&self, f: &Finish) -> Value {
        json!({
            "id": self.id, "object": self.object(true), "created": self.created, "model": self.model,
            "system_fingerprint": null, "choices": [], "usage": usage(f),
        })
    }

    fn whole(&self, text: String, f: &Finish) -> Value {
        let choice = match self.kind {
            Kind::Chat => json!({
                "index": 0,
                "message": {"role": "assistant", "content": text, "refusal": null},
                "logprobs": null,
                "finish_reason": f.reason,
            }),
            Kind::Text => json!({"index": 0, "text": text, "logprobs": null, "finish_reason": f.reason}),
        };
        json!({
            "id": self.id, "object": self.object(false), "created": self.created, "model": self.model,
            "system_fingerprint": null, "choices": [choice], "usage": usage(f),
        })
    }
}

/// Waits for the whole generation (dropping this future, as a closed connection does, cancels
/// it). A request the shutdown ended before its first token gets 503.
async fn whole(shape: Shape, mut rx: UnboundedReceiver<Event>, mut reply: Option<Reply>) -> Result<Response, ApiError> {
    let mut text = String::new();
    let mut parsed = Vec::new();
    while let Some(e) = rx.recv().await {
        match e {
            Event::Text(t) => match &mut reply {
                Some(r) => parsed.extend(r.feed(Some(&t))),
                None => text.push_str(&t),
            },
            Event::Done(f) if f.reason == SHUTDOWN && f.completion_tokens == 0 => {
                return Err(ApiError::unavailable("the server shut down before this request started"))
            }
            Event::Done(f) => {
                if let Some(r) = &mut reply {
                    parsed.extend(r.feed(None));
                    let finish = r.finish_reason(f.reason);
                    return Ok(Json(shape.whole_parsed(parsed, finish, &f)).into_response());
                }
                // Cut by the shutdown after some tokens: the partial text, `finish_reason` says so.
                return Ok(Json(shape.whole(text, &f)).into_response());
            }
            Event::Failed(msg) => return Err(ApiError::internal(msg)),
        }
    }
    Err(ApiError::unavailable("the server stopped before the generation finished"))
}

/// The SSE stream: chunks as the scheduler sends text, the final chunk, the usage chunk when
/// asked, then `data: [DONE]`. Dropping it (the client went away) closes the receiver, which
/// cancels the generation.
fn sse(
    shape: Shape,
    rx: UnboundedReceiver<Event>,
    include_usage: bool,
    reply: Option<Reply>,
) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    let data = |v: Value| SseEvent::default().data(v.to_string());
    // Chat streams open with the role; completions start with the first text.
    let opening = (shape.kind == Kind::Chat).then(|| data(shape.chunk(Some(""), true, None, include_usage)));
    let body = stream::unfold((shape, rx, false, reply), move |(shape, mut rx, done, mut reply)| async move {
        if done {
            return None;
        }
        let events: Vec<SseEvent> = match rx.recv().await {
            Some(Event::Text(t)) => match &mut reply {
                Some(r) => shape.parsed_chunks(r.feed(Some(&t)), include_usage).into_iter().map(data).collect(),
                None => vec![data(shape.chunk(Some(&t), false, None, include_usage))],
            },
            Some(Event::Done(f)) => {
                let mut v = Vec::new();
                let mut reason = f.reason;
                if let Some(r) = &mut reply {
                    v.extend(shape.parsed_chunks(r.feed(None), include_usage).into_iter().map(data));
                    reason = r.finish_reason(f.reason);
                }
                v.push(data(shape.chunk(None, false, Some(reason), include_usage)));
                if include_usage {
                    v.push(data(shape.usage_chunk(&f)));
                }
                v.push(SseEvent::default().data("[DONE]"));
                return Some((v, (shape, rx, true, reply)));
            }
            Some(Event::Failed(msg)) => {
                let v = vec![data(ApiError::internal(msg).body()), SseEvent::default().data("[DONE]")];
                return Some((v, (shape, rx, true, reply)));
            }
            None => return None,
        };
        Some((events, (shape, rx, false, reply)))
    });
    stream::iter(opening).chain(body.flat_map(stream::iter)).map(Ok)
}
