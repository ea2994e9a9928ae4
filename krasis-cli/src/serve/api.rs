//! The OpenAI request bodies Krasis accepts and their validation into one [`Generation`]: what
//! the scheduler runs, whichever endpoint it came from. Unknown fields are ignored (clients send
//! many); a known field of the wrong type or out of range is a 400 naming it.

use serde::Deserialize;

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
#[derive(Deserialize, Debug)]
pub struct Message {
    pub role: String,
    #[serde(default)]
    pub content: Option<Content>,
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
    #[serde(flatten)]
    pub common: Common,
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
}
