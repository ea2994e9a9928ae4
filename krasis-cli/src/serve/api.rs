//! The OpenAI request bodies Krasis accepts and their validation into one [`Generation`]: what
//! the scheduler runs, whichever endpoint it came from. Unknown fields are ignored (clients send
//! many); a known field of the wrong type or out of range is a 400 naming it.

use serde::Deserialize;
use serde_json::{Map, Value};

use super::error::ApiError;
use krasis_model::runtime::stop::{MAX_STOP_BYTES, MAX_STOP_STRINGS};
use krasis_model::text::sampling::SamplingParams;

/// Most messages in one chat request (the body-size limit bounds their text).
pub const MAX_MESSAGES: usize = 4096;

/// `stop`: one string or a list of them.
#[derive(Deserialize, Debug)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize, Debug)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// The generation fields `/v1/chat/completions` and `/v1/completions` share. `model` is not
/// read: the server answers with the one model it serves, whatever name a client sends.
#[derive(Deserialize, Debug, Default)]
pub struct Common {
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub max_tokens: Option<i64>,
    #[serde(default)]
    pub max_completion_tokens: Option<i64>,
    #[serde(default)]
    pub temperature: Option<f32>,
    #[serde(default)]
    pub top_p: Option<f32>,
    /// Not in OpenAI's API; vLLM and llama.cpp take it.
    #[serde(default)]
    pub top_k: Option<i64>,
    #[serde(default)]
    pub stop: Option<Stop>,
    #[serde(default)]
    pub seed: Option<i64>,
    #[serde(default)]
    pub n: Option<i64>,
    /// Not in OpenAI's API (vLLM's): keep generating past the end-of-sequence token.
    #[serde(default)]
    pub ignore_eos: Option<bool>,
}

/// One chat message; `content` is a string or a list of `{"type": "text", "text": …}` parts.
/// Its other fields (`tool_calls`, `tool_call_id`, `name`, `reasoning_content`, …) go to the
/// chat template as they are.
#[derive(Deserialize, Debug)]
pub struct Message {
    pub role: String,
    #[serde(default)]
    pub content: Option<Content>,
    #[serde(flatten)]
    pub rest: Map<String, Value>,
}

#[derive(Deserialize, Debug)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Deserialize, Debug)]
pub struct Part {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
}

#[derive(Deserialize, Debug)]
pub struct ChatRequest {
    pub messages: Vec<Message>,
    /// OpenAI's `tools`: `[{"type": "function", "function": {"name", "description", "parameters"}}]`.
    #[serde(default)]
    pub tools: Option<Vec<Value>>,
    #[serde(default)]
    pub tool_choice: Option<Value>,
    #[serde(default)]
    pub parallel_tool_calls: Option<bool>,
    /// vLLM's: further chat-template variables, e.g. `{"enable_thinking": false}`.
    #[serde(default)]
    pub chat_template_kwargs: Option<Map<String, Value>>,
    #[serde(flatten)]
    pub common: Common,
}

/// `tool_choice`, validated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolChoice {
    /// Tool calls are not parsed: the reply is text (`none`; also when no tools are offered).
    None,
    Auto,
    /// The model should call a tool (not enforced by constrained decoding: a reply without a
    /// call ends as the model wrote it).
    Required,
    /// The model should call this function (only it is offered to the template).
    Named(String),
}

/// What a chat request asks of tools and the template, validated.
#[derive(Debug)]
pub struct ToolRequest {
    /// The tools offered to the template (the named one alone for a named `tool_choice`).
    pub tools: Option<Value>,
    pub choice: ToolChoice,
    pub parallel: bool,
    /// Variables for the template (`chat_template_kwargs`).
    pub template_vars: Map<String, Value>,
}

/// `prompt`: a string, a list of one string, token ids, or a list of one list of ids.
#[derive(Deserialize, Debug)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Ids(Vec<u32>),
    IdLists(Vec<Vec<u32>>),
}

#[derive(Deserialize, Debug)]
pub struct CompletionRequest {
    pub prompt: Prompt,
    #[serde(default)]
    pub echo: Option<bool>,
    #[serde(flatten)]
    pub common: Common,
}

/// Parses a JSON body, turning serde's complaint into a 400.
pub fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| {
        let what = if e.is_syntax() || e.is_eof() { "the body is not valid JSON" } else { "invalid request" };
        ApiError::invalid(format!("{what}: {e}"))
    })
}

/// What a request asks the scheduler for, validated; the prompt is tokenised by the caller.
#[derive(Clone, Debug)]
pub struct Generation {
    pub stream: bool,
    pub include_usage: bool,
    /// `None`: up to the end of the context.
    pub max_tokens: Option<usize>,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
}

impl Common {
    /// Checks every field against OpenAI's ranges. `fresh_seed` gives the seed of a request
    /// that names none.
    pub fn validate(&self, fresh_seed: impl FnOnce() -> u64) -> Result<Generation, ApiError> {
        if let Some(n) = self.n {
            if n != 1 {
                return Err(ApiError::invalid_param("n", format!("n = {n}: only one choice per request (n = 1)")));
            }
        }
        let temperature = self.temperature.unwrap_or(1.0);
        if !(0.0..=2.0).contains(&temperature) {
            return Err(ApiError::invalid_param("temperature", format!("temperature {temperature} is not in [0, 2]")));
        }
        let top_p = self.top_p.unwrap_or(1.0);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(ApiError::invalid_param("top_p", format!("top_p {top_p} is not in (0, 1]")));
        }
        let top_k = match self.top_k {
            None | Some(-1) => 0,
            Some(k) if k >= 0 => usize::try_from(k).unwrap_or(usize::MAX),
            Some(k) => return Err(ApiError::invalid_param("top_k", format!("top_k {k} must be >= 0 (0 or -1: off)"))),
        };
        let max_tokens = match self.max_completion_tokens.or(self.max_tokens) {
            None => None,
            Some(m) if m >= 1 => Some(usize::try_from(m).unwrap_or(usize::MAX)),
            Some(m) => {
                let param = if self.max_completion_tokens.is_some() { "max_completion_tokens" } else { "max_tokens" };
                return Err(ApiError::invalid_param(param, format!("{param} = {m} must be at least 1")));
            }
        };
        let stop = match &self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        };
        if stop.len() > MAX_STOP_STRINGS {
            return Err(ApiError::invalid_param(
                "stop",
                format!("{} stop strings: at most {MAX_STOP_STRINGS}", stop.len()),
            ));
        }
        if let Some(s) = stop.iter().find(|s| s.is_empty() || s.len() > MAX_STOP_BYTES) {
            return Err(ApiError::invalid_param(
                "stop",
                format!("stop string of {} bytes: each must be 1 to {MAX_STOP_BYTES} bytes", s.len()),
            ));
        }
        let include_usage = self.stream_options.as_ref().is_some_and(|o| o.include_usage);
        let stream = self.stream.unwrap_or(false);
        if self.stream_options.is_some() && !stream {
            return Err(ApiError::invalid_param("stream_options", "stream_options is only allowed with stream: true"));
        }
        Ok(Generation {
            stream,
            include_usage,
            max_tokens,
            sampling: SamplingParams {
                temperature,
                top_k,
                top_p,
                seed: self.seed.map_or_else(fresh_seed, |s| s as u64),
            },
            stop,
            ignore_eos: self.ignore_eos.unwrap_or(false),
        })
    }
}

impl ChatRequest {
    /// `tools`, `tool_choice`, `parallel_tool_calls` and `chat_template_kwargs`, checked: each
    /// tool is a function with a name and an object schema, a named choice names one of them.
    pub fn tool_request(&self) -> Result<ToolRequest, ApiError> {
        let tools = self.tools.as_deref().unwrap_or_default();
        let mut names = Vec::new();
        for (i, t) in tools.iter().enumerate() {
            let bad = |why: &str| ApiError::invalid_param("tools", format!("tools[{i}]: {why}"));
            if t.get("type").and_then(Value::as_str) != Some("function") {
                return Err(bad("`type` must be \"function\""));
            }
            let f = t.get("function").and_then(Value::as_object).ok_or_else(|| bad("no `function` object"))?;
            let name = f.get("name").and_then(Value::as_str).filter(|n| !n.is_empty());
            let name = name.ok_or_else(|| bad("`function.name` must be a non-empty string"))?;
            match f.get("parameters") {
                None => {}
                Some(Value::Object(schema)) => {
                    if let Some(ty) = schema.get("type") {
                        if !ty.is_string() && !ty.is_array() {
                            return Err(bad("`function.parameters.type` is not a JSON Schema type"));
                        }
                    }
                    if schema.get("properties").is_some_and(|p| !p.is_object()) {
                        return Err(bad("`function.parameters.properties` must be an object"));
                    }
                    super::schema::check(&Value::Object(schema.clone()), &format!("tools[{i}].function.parameters"))
                        .map_err(|e| ApiError::invalid_param("tools", e))?;
                }
                Some(_) => return Err(bad("`function.parameters` must be a JSON Schema object")),
            }
            names.push(name.to_string());
        }
        let choice = match &self.tool_choice {
            None if tools.is_empty() => ToolChoice::None,
            None => ToolChoice::Auto,
            Some(Value::String(s)) => match s.as_str() {
                "none" => ToolChoice::None,
                "auto" => ToolChoice::Auto,
                "required" => ToolChoice::Required,
                other => {
                    return Err(ApiError::invalid_param(
                        "tool_choice",
                        format!("tool_choice {other:?}: one of none, auto, required, or a named function"),
                    ))
                }
            },
            Some(v) => {
                let name = v.pointer("/function/name").and_then(Value::as_str).filter(|_| v["type"] == "function");
                let name = name.ok_or_else(|| {
                    ApiError::invalid_param(
                        "tool_choice",
                        "tool_choice must be a string or {\"type\": \"function\", \"function\": {\"name\": …}}",
                    )
                })?;
                if !names.iter().any(|n| n == name) {
                    return Err(ApiError::invalid_param(
                        "tool_choice",
                        format!("tool_choice names {name:?}, which is not among the tools"),
                    ));
                }
                ToolChoice::Named(name.to_string())
            }
        };
        let choice = match choice {
            ToolChoice::Required if tools.is_empty() => {
                return Err(ApiError::invalid_param("tool_choice", "tool_choice \"required\" needs tools"))
            }
            ToolChoice::Auto if tools.is_empty() => ToolChoice::None,
            c => c,
        };
        let offered: Vec<Value> = match &choice {
            ToolChoice::Named(n) => tools.iter().filter(|t| t["function"]["name"] == n.as_str()).cloned().collect(),
            _ => tools.to_vec(),
        };
        Ok(ToolRequest {
            tools: (!offered.is_empty()).then_some(Value::Array(offered)),
            choice,
            parallel: self.parallel_tool_calls.unwrap_or(true),
            template_vars: self.chat_template_kwargs.clone().unwrap_or_default(),
        })
    }

    /// The messages in OpenAI's form as the chat template takes them (text parts joined, other
    /// fields kept). A tool result must answer a call an earlier assistant message made.
    pub fn template_messages(&self) -> Result<Vec<Value>, ApiError> {
        let plain = self.conversation()?;
        let mut calls: Vec<String> = Vec::new();
        let mut out = Vec::with_capacity(plain.len());
        for (i, (m, p)) in self.messages.iter().zip(plain).enumerate() {
            let mut v = m.rest.clone();
            v.insert("role".into(), Value::String(p.role));
            let content = match &m.content {
                None => Value::Null,
                Some(_) => Value::String(p.content),
            };
            v.insert("content".into(), content);
            if let Some(tc) = m.rest.get("tool_calls").filter(|t| !t.is_null()) {
                let Value::Array(list) = tc else {
                    return Err(ApiError::invalid_param(
                        "messages",
                        format!("messages[{i}].tool_calls must be an array"),
                    ));
                };
                for (j, c) in list.iter().enumerate() {
                    let name = c.pointer("/function/name").and_then(Value::as_str);
                    let args = c.pointer("/function/arguments");
                    if name.is_none() || !args.is_some_and(|a| a.is_string() || a.is_object()) {
                        return Err(ApiError::invalid_param(
                            "messages",
                            format!("messages[{i}].tool_calls[{j}] needs function.name and function.arguments"),
                        ));
                    }
                    if let Some(id) = c.get("id").and_then(Value::as_str) {
                        calls.push(id.to_string());
                    }
                }
            }
            if m.role == "tool" {
                match m.rest.get("tool_call_id").and_then(Value::as_str) {
                    None => {
                        return Err(ApiError::invalid_param(
                            "messages",
                            format!("messages[{i}] (role tool) has no tool_call_id"),
                        ))
                    }
                    Some(id) if !calls.iter().any(|c| c == id) => {
                        return Err(ApiError::invalid_param(
                            "messages",
                            format!(
                                "messages[{i}] answers tool_call_id {id:?}, which no earlier assistant message called"
                            ),
                        ))
                    }
                    Some(_) => {}
                }
            }
            out.push(Value::Object(v));
        }
        Ok(out)
    }

    /// The conversation as the chat template takes it (text parts joined).
    pub fn conversation(&self) -> Result<Vec<krasis_model::text::tokenizer::ChatMessage>, ApiError> {
        if self.messages.is_empty() {
            return Err(ApiError::invalid_param("messages", "messages is empty"));
        }
        if self.messages.len() > MAX_MESSAGES {
            return Err(ApiError::invalid_param("messages", format!("more than {MAX_MESSAGES} messages")));
        }
        self.messages
            .iter()
            .map(|m| {
                let content = match &m.content {
                    None => String::new(),
                    Some(Content::Text(t)) => t.clone(),
                    Some(Content::Parts(parts)) => {
                        let mut text = String::new();
                        for p in parts {
                            match (p.kind.as_str(), &p.text) {
                                ("text", Some(t)) => text.push_str(t),
                                (kind, _) => {
                                    return Err(ApiError::invalid_param(
                                        "messages",
                                        format!("content part of type {kind:?}: only text parts are supported"),
                                    ))
                                }
                            }
                        }
                        text
                    }
                };
                Ok(krasis_model::text::tokenizer::ChatMessage::new(m.role.clone(), content))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn common(json: &str) -> Result<Generation, ApiError> {
        parse::<Common>(json.as_bytes())?.validate(|| 99)
    }

    #[test]
    fn fields_are_checked_against_openai_ranges() {
        let g = common(r#"{"stop": "x", "seed": 5, "top_k": 3, "max_tokens": 7}"#).unwrap();
        assert_eq!((g.stop, g.sampling.seed, g.sampling.top_k, g.max_tokens), (vec!["x".to_string()], 5, 3, Some(7)));
        assert_eq!(common("{}").unwrap().sampling.seed, 99, "a fresh seed when none is named");
        assert_eq!(common(r#"{"max_tokens": 3, "max_completion_tokens": 4}"#).unwrap().max_tokens, Some(4));
        for (body, param) in [
            (r#"{"temperature": 2.5}"#, "temperature"),
            (r#"{"top_p": 0}"#, "top_p"),
            (r#"{"top_k": -2}"#, "top_k"),
            (r#"{"max_tokens": 0}"#, "max_tokens"),
            (r#"{"n": 2}"#, "n"),
            (r#"{"stop": ["a","b","c","d","e"]}"#, "stop"),
            (r#"{"stop": [""]}"#, "stop"),
            (r#"{"stream_options": {"include_usage": true}}"#, "stream_options"),
        ] {
            let e = common(body).unwrap_err();
            assert_eq!((e.status.as_u16(), e.param), (400, Some(param)), "{body}: {}", e.message);
        }
        let e = common(r#"{"temperature": "hot"}"#).unwrap_err();
        assert!(e.message.starts_with("invalid request: invalid type"), "{}", e.message);
        let e = common(r#"{"temperature": "#).unwrap_err();
        assert!(e.message.starts_with("the body is not valid JSON"), "{}", e.message);
    }

    #[test]
    fn chat_content_is_text_or_text_parts() {
        let r: ChatRequest = parse(
            br#"{"messages": [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}"#,
        )
        .unwrap();
        let c = r.conversation().unwrap();
        assert_eq!((c[0].content.as_str(), c[1].content.as_str()), ("be brief", "ab"));
        let r: ChatRequest = parse(br#"{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}"#).unwrap();
        assert_eq!(r.conversation().unwrap_err().param, Some("messages"));
        let r: ChatRequest = parse(br#"{"messages": []}"#).unwrap();
        assert!(r.conversation().is_err());
    }

    #[test]
    fn tools_and_tool_choice_are_checked() {
        let tool =
            r#"{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}"#;
        let req = |extra: &str| -> ChatRequest {
            parse(format!(r#"{{"messages": [{{"role": "user", "content": "x"}}], {extra}}}"#).as_bytes()).unwrap()
        };
        let t = req(&format!(r#""tools": [{tool}]"#)).tool_request().unwrap();
        assert_eq!((t.choice, t.parallel), (ToolChoice::Auto, true));
        let t =
            req(&format!(r#""tools": [{tool}], "tool_choice": {{"type": "function", "function": {{"name": "f"}}}}"#));
        assert_eq!(t.tool_request().unwrap().choice, ToolChoice::Named("f".into()));
        assert_eq!(req("\"tool_choice\": \"none\"").tool_request().unwrap().choice, ToolChoice::None);
        let t = req(r#""chat_template_kwargs": {"enable_thinking": false}"#).tool_request().unwrap();
        assert_eq!(t.template_vars["enable_thinking"], false);
        for extra in [
            r#""tools": [{"type": "function", "function": {"name": "f", "parameters": "not a schema"}}]"#.to_string(),
            r#""tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]"#.to_string(),
            r#""tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": {"type": "strnig"}}}}}]"#.to_string(),
            r#""tools": [{"type": "function", "function": {"name": "f", "parameters": {"required": "a"}}}]"#.to_string(),
            r#""tools": [{"type": "code", "function": {"name": "f"}}]"#.to_string(),
            format!(r#""tools": [{tool}], "tool_choice": {{"type": "function", "function": {{"name": "g"}}}}"#),
            format!(r#""tools": [{tool}], "tool_choice": "sometimes""#),
            r#""tool_choice": "required""#.to_string(),
        ] {
            let e = req(&extra).tool_request().unwrap_err();
            assert_eq!(e.status.as_u16(), 400, "{extra}");
            assert!(matches!(e.param, Some("tools" | "tool_choice")), "{extra}: {:?}", e.param);
        }
    }

    #[test]
    fn tool_results_must_answer_a_call() {
        let call = r#"{"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
            "function": {"name": "f", "arguments": "{\"a\": 1}"}}]}"#;
        let ok: ChatRequest = parse(
            format!(
                r#"{{"messages": [{{"role": "user", "content": "x"}}, {call},
                {{"role": "tool", "tool_call_id": "c1", "content": "42"}}]}}"#
            )
            .as_bytes(),
        )
        .unwrap();
        let m = ok.template_messages().unwrap();
        assert_eq!((m[1]["content"].is_null(), m[1]["tool_calls"][0]["id"].as_str()), (true, Some("c1")));
        assert_eq!(m[2]["tool_call_id"], "c1");
        for tool in
            [r#"{"role": "tool", "tool_call_id": "c9", "content": "42"}"#, r#"{"role": "tool", "content": "42"}"#]
        {
            let bad: ChatRequest =
                parse(format!(r#"{{"messages": [{{"role": "user", "content": "x"}}, {call}, {tool}]}}"#).as_bytes())
                    .unwrap();
            assert_eq!(bad.template_messages().unwrap_err().param, Some("messages"), "{tool}");
        }
    }
}
