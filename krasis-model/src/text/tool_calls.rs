//! Tool calls and reasoning in generated text, per model family: incremental parsers fed the
//! generated text piece by piece (split anywhere, even inside a marker) that return content,
//! reasoning and tool-call events as OpenAI's chat API streams them.
//!
//! Each family writes calls in the form its chat template renders them (the published templates
//! in `real-configs`):
//! - Qwen3 ([`ToolFormat::Qwen3`]) - `<tool_call>\n{"name": N, "arguments": {…}}\n</tool_call>`, or
//!   in the same block Qwen3-Coder's XML form (Qwen3-Coder, Qwen3-Coder-Next):
//!   `<tool_call>\n<function=N>\n<parameter=K>\nV\n</parameter>\n…</function>\n</tool_call>`;
//! - DeepSeek ([`ToolFormat::DeepSeek`]) - `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>N\n` +
//!   `` ```json\n{…}\n``` `` + `<｜tool▁call▁end｜>…<｜tool▁calls▁end｜>` (V3 and R1; the V3.1 form
//!   `<｜tool▁call▁begin｜>N<｜tool▁sep｜>{…}<｜tool▁call▁end｜>` is read too);
//! - Kimi ([`ToolFormat::Kimi`]) - `<|tool_calls_section_begin|><|tool_call_begin|>functions.N:IDX` +
//!   `<|tool_call_argument_begin|>{…}<|tool_call_end|>…<|tool_calls_section_end|>`; the call's id
//!   is the model's own `functions.N:IDX`;
//! - GLM-4.5 ([`ToolFormat::Glm45`]) - `<tool_call>N\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>\n…</tool_call>`;
//! - [`ToolFormat::Harmony`] (gpt-oss): messages `<|channel|>C … <|message|>TEXT<|end|>`; the
//!   `analysis` channel is reasoning, a message `to=functions.N` ending in `<|call|>` is a call,
//!   the other channels (`final`, a `commentary` preamble) are content;
//! - MiniMax-M2 ([`ToolFormat::MiniMaxM2`]) - `<minimax:tool_call>\n<invoke name="N">\n<parameter name="K">V`
//!   `</parameter>\n…</invoke>\n</minimax:tool_call>` (several invokes in one block are parallel
//!   calls).
//!
//! Every family but Harmony writes its reasoning as `<think>…</think>`; a prompt that already
//! opens the think block (the template wrote `<think>` in the generation prompt) starts the
//! parser in reasoning ([`ParserOptions::starts_in_reasoning`]).
//!
//! A call is returned once its end marker has been generated, so that its arguments can be
//! checked first: arguments that are not a JSON object (or a body that is not in the family's
//! form) keep the call's text as content, with an [`Parsed::Note`] saying why. Whitespace between
//! a marker and the text beside it (the newlines templates write around blocks) is dropped.

use serde_json::{Map, Value as Json};

/// A family's tool-call and reasoning text format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ToolFormat {
    Qwen3,
    DeepSeek,
    Kimi,
    Glm45,
    Harmony,
    MiniMaxM2,
}

impl ToolFormat {
    pub const ALL: [ToolFormat; 6] = [
        ToolFormat::Qwen3,
        ToolFormat::DeepSeek,
        ToolFormat::Kimi,
        ToolFormat::Glm45,
        ToolFormat::Harmony,
        ToolFormat::MiniMaxM2,
    ];

    /// The format's name (`qwen3`, `deepseek`, `kimi`, `glm45`, `harmony`, `minimax-m2`).
    pub fn name(self) -> &'static str {
        match self {
            ToolFormat::Qwen3 => "qwen3",
            ToolFormat::DeepSeek => "deepseek",
            ToolFormat::Kimi => "kimi",
            ToolFormat::Glm45 => "glm45",
            ToolFormat::Harmony => "harmony",
            ToolFormat::MiniMaxM2 => "minimax-m2",
        }
    }

    /// The format a name given by [`ToolFormat::name`] names.
    pub fn from_name(name: &str) -> Option<ToolFormat> {
        Self::ALL.into_iter().find(|f| f.name() == name)
    }

    /// The format a chat template writes, by the markers in its text (most specific first:
    /// GLM's and Qwen3's calls both open with `<tool_call>`).
    pub fn from_template(template: &str) -> Option<ToolFormat> {
        let has = |m: &str| template.contains(m);
        Some(if has("<|channel|>") {
            ToolFormat::Harmony
        } else if has("<minimax:tool_call>") {
            ToolFormat::MiniMaxM2
        } else if has("<arg_key>") {
            ToolFormat::Glm45
        } else if has("<|tool_call_begin|>") || has("<|tool_calls_section_begin|>") {
            ToolFormat::Kimi
        } else if has("tool▁call▁begin") {
            ToolFormat::DeepSeek
        } else if has("<tool_call>") {
            ToolFormat::Qwen3
        } else {
            return None;
        })
    }

    /// The format of a family by its config's `model_type`.
    pub fn from_model_type(model_type: &str) -> Option<ToolFormat> {
        Some(match model_type {
            "qwen3_moe" | "qwen3" | "qwen2_moe" | "qwen3_next" => ToolFormat::Qwen3,
            "deepseek_v3" | "deepseek_v2" => ToolFormat::DeepSeek,
            "kimi_k2" | "kimi_k25" => ToolFormat::Kimi,
            "glm4_moe" => ToolFormat::Glm45,
            "gpt_oss" => ToolFormat::Harmony,
            "minimax_m2" => ToolFormat::MiniMaxM2,
            _ => return None,
        })
    }

    /// The template's markers decide where they show a format (Kimi-K2 says `deepseek_v3` in
    /// `architectures`); the `model_type` otherwise.
    pub fn choose(model_type: Option<&str>, template: Option<&str>) -> Option<ToolFormat> {
        template.and_then(Self::from_template).or_else(|| model_type.and_then(Self::from_model_type))
    }

    /// Text that ends a turn which called tools and that the generation must stop at (gpt-oss
    /// ends a call with `<|call|>`, which its `generation_config.json` does not list as EOS).
    pub fn stop_strings(self) -> &'static [&'static str] {
        match self {
            ToolFormat::Harmony => &["<|call|>"],
            _ => &[],
        }
    }

    /// Markers of the `<think>` families and of their calls (`None` for Harmony).
    fn markup(self) -> Option<Markup> {
        const THINK: (&str, &str) = ("<think>", "</think>");
        Some(match self {
            ToolFormat::Qwen3 => Markup { think: THINK, call: ("<tool_call>", "</tool_call>"), drop: &[] },
            ToolFormat::Glm45 => Markup { think: THINK, call: ("<tool_call>", "</tool_call>"), drop: &[] },
            ToolFormat::DeepSeek => Markup {
                think: THINK,
                call: ("<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"),
                drop: &["<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"],
            },
            ToolFormat::Kimi => Markup {
                think: THINK,
                call: ("<|tool_call_begin|>", "<|tool_call_end|>"),
                drop: &["<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"],
            },
            ToolFormat::MiniMaxM2 => {
                Markup { think: THINK, call: ("<minimax:tool_call>", "</minimax:tool_call>"), drop: &[] }
            }
            ToolFormat::Harmony => return None,
        })
    }
}

/// The markers of a `<think>` family.
#[derive(Clone, Copy, Debug)]
struct Markup {
    think: (&'static str, &'static str),
    call: (&'static str, &'static str),
    /// Section markers around calls: removed from the content.
    drop: &'static [&'static str],
}

/// One parsed tool call, as OpenAI returns it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolCall {
    /// The call's place among this response's calls, from 0.
    pub index: usize,
    pub id: String,
    pub name: String,
    /// The arguments: a JSON object's text.
    pub arguments: String,
}

/// What the parser found in the text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Parsed {
    /// Text for the reply's `content`.
    Content(String),
    /// Text for `reasoning_content`.
    Reasoning(String),
    /// A complete tool call.
    Call(ToolCall),
    /// Why a call's text was kept as content (for the log).
    Note(String),
}

/// How a parser reads one response.
#[derive(Clone, Debug, Default)]
pub struct ParserOptions {
    /// Parse tool calls (off: a call's text stays content, as for `tool_choice: none`).
    pub tools: bool,
    /// The prompt ends inside a think block: the text starts as reasoning.
    pub starts_in_reasoning: bool,
    /// Ids are `call_{id_prefix}_{index}` (Kimi's calls keep their own ids).
    pub id_prefix: String,
    /// The request's `tools` (OpenAI's form): GLM's and MiniMax's arguments are text, turned into
    /// JSON by each parameter's schema type (a `string` parameter stays a string; others are read
    /// as JSON when they parse).
    pub schemas: Option<Json>,
}

impl ParserOptions {
    /// Whether a rendered prompt ends inside an open think block (`<think>` after the last
    /// `</think>`, with only whitespace after it).
    pub fn prompt_opens_think(prompt: &str) -> bool {
        let tail = prompt.trim_end();
        tail.ends_with("<think>")
    }
}

/// An incremental parser of one response.
#[derive(Debug)]
pub struct StreamParser {
    format: ToolFormat,
    opts: ParserOptions,
    /// Text not yet decided on.
    buf: String,
    mode: Mode,
    /// Whitespace at the end of the text emitted so far, held until more text follows it.
    pending_ws: String,
    /// Drop whitespace at the start of the next text (a marker came just before it).
    skip_ws: bool,
    /// Whether any marker has been read (whitespace at the very end is kept if none was).
    saw_marker: bool,
    calls: usize,
    out: Vec<Parsed>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Mode {
    Content,
    Reasoning,
    /// Inside a call block of a `<think>` family.
    Call,
    /// Harmony: reading a message's header (up to `<|message|>`).
    Header,
    /// Harmony: a message's body; `Some(name)`: a call to function `name`.
    Body {
        reasoning: bool,
        call: Option<String>,
    },
}

const H_MESSAGE: &str = "<|message|>";
const H_ENDS: [&str; 4] = ["<|end|>", "<|call|>", "<|return|>", "<|start|>"];

impl StreamParser {
    pub fn new(format: ToolFormat, opts: ParserOptions) -> Self {
        let mode = match (format, opts.starts_in_reasoning) {
            (ToolFormat::Harmony, _) => Mode::Header,
            (_, true) => Mode::Reasoning,
            (_, false) => Mode::Content,
        };
        let skip_ws = opts.starts_in_reasoning;
        StreamParser {
            format,
            opts,
            buf: String::new(),
            mode,
            pending_ws: String::new(),
            skip_ws,
            saw_marker: false,
            calls: 0,
            out: Vec::new(),
        }
    }

    pub fn format(&self) -> ToolFormat {
        self.format
    }

    /// Calls returned so far.
    pub fn calls(&self) -> usize {
        self.calls
    }

    /// Adds generated text; returns what it completes.
    pub fn push(&mut self, text: &str) -> Vec<Parsed> {
        self.buf.push_str(text);
        self.run(false);
        std::mem::take(&mut self.out)
    }

    /// The end of the generation: what is still held back (an unterminated call is read as if
    /// it had ended: a stop string or EOS may have cut its end marker).
    pub fn finish(&mut self) -> Vec<Parsed> {
        self.run(true);
        let rest = std::mem::take(&mut self.buf);
        match self.mode.clone() {
            Mode::Content | Mode::Reasoning => {
                self.text(&rest);
                if !self.saw_marker && self.mode == Mode::Content {
                    let ws = std::mem::take(&mut self.pending_ws);
                    self.emit_raw(ws);
                }
            }
            Mode::Call => {
                let (open, _) = self.format.markup().expect("Call mode is a markup family's").call;
                self.call_block(open, &rest, "");
            }
            Mode::Header => {
                // Text outside harmony's message form: content as it is.
                self.mode = Mode::Content;
                self.text(&rest);
            }
            Mode::Body { call: Some(name), .. } => self.harmony_call(&name, &rest),
            Mode::Body { .. } => self.text(&rest),
        }
        self.pending_ws.clear();
        std::mem::take(&mut self.out)
    }

    fn run(&mut self, at_end: bool) {
        loop {
            let progressed = match self.format.markup() {
                Some(m) => self.step_markup(m, at_end),
                None => self.step_harmony(at_end),
            };
            if !progressed {
                break;
            }
        }
    }

    /// Content or reasoning text (by the mode), with the whitespace rules.
    fn text(&mut self, t: &str) {
        let mut t = t;
        if self.skip_ws {
            t = t.trim_start();
            if t.is_empty() {
                return;
            }
            self.skip_ws = false;
        }
        if t.is_empty() {
            return;
        }
        let body = t.trim_end();
        let ws = &t[body.len()..];
        if !body.is_empty() {
            let mut s = std::mem::take(&mut self.pending_ws);
            s.push_str(body);
            self.emit_raw(s);
        }
        self.pending_ws.push_str(ws);
    }

    fn emit_raw(&mut self, s: String) {
        if s.is_empty() {
            return;
        }
        let reasoning = matches!(self.mode, Mode::Reasoning | Mode::Body { reasoning: true, .. });
        match (self.out.last_mut(), reasoning) {
            (Some(Parsed::Reasoning(r)), true) => r.push_str(&s),
            (Some(Parsed::Content(c)), false) => c.push_str(&s),
            (_, true) => self.out.push(Parsed::Reasoning(s)),
            (_, false) => self.out.push(Parsed::Content(s)),
        }
    }

    /// After a marker: the whitespace held before it is dropped, and the whitespace after it.
    fn marker(&mut self, mode: Mode) {
        self.pending_ws.clear();
        self.skip_ws = true;
        self.saw_marker = true;
        self.mode = mode;
    }

    /// One step of a `<think>` family; `false` when the buffer needs more text.
    fn step_markup(&mut self, m: Markup, at_end: bool) -> bool {
        match self.mode {
            Mode::Content | Mode::Reasoning => {
                let mut markers: Vec<&str> = Vec::new();
                if self.mode == Mode::Reasoning {
                    markers.push(m.think.1);
                } else {
                    markers.push(m.think.0);
                    if self.opts.tools {
                        markers.push(m.call.0);
                        markers.extend_from_slice(m.drop);
                    }
                }
                match earliest(&self.buf, &markers) {
                    Some((at, k)) => {
                        let before: String = self.buf[..at].to_string();
                        self.text(&before);
                        self.buf.drain(..at + markers[k].len());
                        let next = match (self.mode.clone(), markers[k]) {
                            (Mode::Reasoning, _) => Mode::Content,
                            (_, mk) if mk == m.think.0 => Mode::Reasoning,
                            (_, mk) if mk == m.call.0 => Mode::Call,
                            _ => Mode::Content,
                        };
                        self.marker(next);
                        true
                    }
                    None => {
                        let keep = if at_end { 0 } else { held_suffix(&self.buf, &markers) };
                        let now: String = self.buf.drain(..self.buf.len() - keep).collect();
                        self.text(&now);
                        false
                    }
                }
            }
            Mode::Call => match self.buf.find(m.call.1) {
                Some(at) => {
                    let body: String = self.buf[..at].to_string();
                    self.buf.drain(..at + m.call.1.len());
                    self.call_block(m.call.0, &body, m.call.1);
                    true
                }
                None => false,
            },
            _ => unreachable!("harmony modes in a markup family"),
        }
    }

    /// A complete call block of a `<think>` family: its calls, or its text kept as content.
    fn call_block(&mut self, open: &str, body: &str, close: &str) {
        let parsed = match self.format {
            ToolFormat::Qwen3 => qwen3_call(body, self.opts.schemas.as_ref()).map(|c| vec![c]),
            ToolFormat::DeepSeek => deepseek_call(body).map(|c| vec![c]),
            ToolFormat::Kimi => kimi_call(body).map(|c| vec![c]),
            ToolFormat::Glm45 => glm_call(body, self.opts.schemas.as_ref()).map(|c| vec![c]),
            ToolFormat::MiniMaxM2 => minimax_calls(body, self.opts.schemas.as_ref()),
            ToolFormat::Harmony => unreachable!("harmony has no call blocks"),
        };
        self.mode = Mode::Content;
        match parsed {
            Ok(calls) => {
                for (name, arguments, own_id) in calls {
                    self.push_call(name, arguments, own_id);
                }
            }
            Err(why) => self.keep_as_text(format!("{open}{body}{close}"), why),
        }
        self.marker(Mode::Content);
    }

    fn push_call(&mut self, name: String, arguments: String, own_id: Option<String>) {
        let index = self.calls;
        self.calls += 1;
        let id = own_id.unwrap_or_else(|| format!("call_{}_{index}", self.opts.id_prefix));
        self.out.push(Parsed::Call(ToolCall { index, id, name, arguments }));
    }

    fn keep_as_text(&mut self, raw: String, why: String) {
        let mode = std::mem::replace(&mut self.mode, Mode::Content);
        let s = std::mem::take(&mut self.pending_ws) + &raw;
        self.emit_raw(s);
        self.mode = mode;
        self.out.push(Parsed::Note(format!("a tool call was kept as text: {why}")));
    }

    /// One step of harmony; `false` when the buffer needs more text.
    fn step_harmony(&mut self, at_end: bool) -> bool {
        match self.mode.clone() {
            Mode::Header => {
                let Some(at) = self.buf.find(H_MESSAGE) else { return false };
                let header: String = self.buf[..at].to_string();
                self.buf.drain(..at + H_MESSAGE.len());
                let channel = harmony_field(&header, "<|channel|>").unwrap_or_default();
                let recipient = harmony_field(&header, "to=");
                let call = recipient
                    .filter(|r| self.opts.tools && r.starts_with("functions."))
                    .map(|r| r["functions.".len()..].to_string());
                self.saw_marker = true;
                self.skip_ws = false;
                self.pending_ws.clear();
                self.mode = Mode::Body { reasoning: call.is_none() && channel == "analysis", call };
                true
            }
            Mode::Body { call, .. } => match earliest(&self.buf, &H_ENDS) {
                Some((at, k)) => {
                    let body: String = self.buf[..at].to_string();
                    // `<|start|>` opens the next message: its header is read next.
                    let consumed = if H_ENDS[k] == "<|start|>" { at } else { at + H_ENDS[k].len() };
                    self.buf.drain(..consumed);
                    match call {
                        Some(name) => self.harmony_call(&name, &body),
                        None => {
                            self.text(&body);
                            self.pending_ws.clear();
                        }
                    }
                    self.mode = Mode::Header;
                    true
                }
                None if call.is_none() => {
                    let keep = if at_end { 0 } else { held_suffix(&self.buf, &H_ENDS) };
                    let now: String = self.buf.drain(..self.buf.len() - keep).collect();
                    self.text(&now);
                    false
                }
                None => false,
            },
            _ => unreachable!("markup modes in harmony"),
        }
    }

    fn harmony_call(&mut self, name: &str, body: &str) {
        self.mode = Mode::Content;
        match json_object(body.trim()) {
            Ok(args) => self.push_call(name.to_string(), args, None),
            Err(why) => {
                self.keep_as_text(body.to_string(), format!("the arguments of {name} are not a JSON object: {why}"))
            }
        }
        self.mode = Mode::Header;
    }
}

/// The earliest occurrence of any marker: (byte position, marker index).
fn earliest(buf: &str, markers: &[&str]) -> Option<(usize, usize)> {
    markers
        .iter()
        .enumerate()
        .filter_map(|(k, m)| buf.find(m).map(|at| (at, k)))
        .min_by_key(|&(at, k)| (at, std::cmp::Reverse(markers[k].len())))
}

/// The length of the longest end of `buf` that begins some marker (held back until more text
/// decides). It starts on a character boundary: it matches a marker's first bytes.
fn held_suffix(buf: &str, markers: &[&str]) -> usize {
    markers
        .iter()
        .map(|m| {
            (1..m.len().min(buf.len() + 1))
                .rev()
                .find(|&k| m.is_char_boundary(k) && buf.ends_with(&m[..k]))
                .unwrap_or(0)
        })
        .max()
        .unwrap_or(0)
}

/// The value after `key` in a harmony header, up to whitespace or the next `<|`.
fn harmony_field<'a>(header: &'a str, key: &str) -> Option<&'a str> {
    let at = header.find(key)? + key.len();
    let rest = &header[at..];
    let end = rest.find(|c: char| c.is_whitespace()).unwrap_or(rest.len()).min(rest.find("<|").unwrap_or(rest.len()));
    Some(&rest[..end])
}

/// `text` if it is a JSON object, compacted.
fn json_object(text: &str) -> Result<String, String> {
    match serde_json::from_str::<Json>(text) {
        Ok(v @ Json::Object(_)) => Ok(v.to_string()),
        Ok(other) => Err(format!("expected a JSON object, found {other}")),
        Err(e) => Err(e.to_string()),
    }
}

type FoundCall = (String, String, Option<String>);

/// Qwen3: `{"name": N, "arguments": {…}}` (arguments may also be a string of JSON), or
/// Qwen3-Coder's `<function=N><parameter=K>V</parameter>…</function>`.
fn qwen3_call(body: &str, schemas: Option<&Json>) -> Result<FoundCall, String> {
    if body.trim_start().starts_with("<function=") {
        return qwen3_coder_call(body, schemas);
    }
    let v: Json = serde_json::from_str(body.trim()).map_err(|e| format!("the call is not JSON: {e}"))?;
    let name = v.get("name").and_then(Json::as_str).ok_or("the call has no string `name`")?;
    let args = match v.get("arguments").or_else(|| v.get("parameters")) {
        None => "{}".to_string(),
        Some(Json::String(s)) => json_object(s).map_err(|e| format!("the arguments of {name}: {e}"))?,
        Some(a @ Json::Object(_)) => a.to_string(),
        Some(other) => return Err(format!("the arguments of {name} are not a JSON object: {other}")),
    };
    Ok((name.to_string(), args, None))
}

/// Qwen3-Coder: `<function=N>\n<parameter=K>\nV\n</parameter>\n…</function>`; a value is the text
/// between its tags less one newline at each end, typed by the tool's schema.
fn qwen3_coder_call(body: &str, schemas: Option<&Json>) -> Result<FoundCall, String> {
    let (name, after) = between(body, "<function=", ">").ok_or("<function= is not closed by >")?;
    let name = name.trim();
    if name.is_empty() {
        return Err("the call has no function name".into());
    }
    let rest = &body[after..];
    let end = rest.find("</function>").ok_or_else(|| format!("<function={name}> is not closed"))?;
    if !rest[end + "</function>".len()..].trim().is_empty() {
        return Err(format!("text after </function>: {:?}", rest[end + "</function>".len()..].trim()));
    }
    let mut args = Map::new();
    let mut p = &rest[..end];
    while !p.trim().is_empty() {
        let not_a_parameter = || format!("text that is not a parameter: {:?}", p.trim());
        if !p[..p.find("<parameter=").ok_or_else(not_a_parameter)?].trim().is_empty() {
            return Err(not_a_parameter());
        }
        let (key, a) = between(p, "<parameter=", ">").ok_or_else(not_a_parameter)?;
        let key = key.trim();
        let (value, b) =
            between(&p[a..], "", "</parameter>").ok_or_else(|| format!("parameter {key:?} is not closed"))?;
        let value = value.strip_prefix('\n').unwrap_or(value);
        let value = value.strip_suffix('\n').unwrap_or(value);
        args.insert(key.to_string(), typed_value(schemas, name, key, value));
        p = &p[a + b..];
    }
    Ok((name.to_string(), Json::Object(args).to_string(), None))
}

/// DeepSeek-V3/R1: `function<｜tool▁sep｜>N\n```json\n{…}\n```` ; V3.1: `N<｜tool▁sep｜>{…}`.
fn deepseek_call(body: &str) -> Result<FoundCall, String> {
    let (head, rest) = body.split_once("<｜tool▁sep｜>").ok_or("no <｜tool▁sep｜> in the call")?;
    let (name, args) = match rest.split_once('\n') {
        Some((name, args)) if head.trim() == "function" => {
            let a = args.trim();
            let a = a.strip_prefix("```json").or_else(|| a.strip_prefix("```")).unwrap_or(a);
            (name.trim(), a.strip_suffix("```").unwrap_or(a).trim())
        }
        _ => (head.trim(), rest.trim()),
    };
    if name.is_empty() {
        return Err("the call has no function name".into());
    }
    let args = json_object(args).map_err(|e| format!("the arguments of {name} are not a JSON object: {e}"))?;
    Ok((name.to_string(), args, None))
}

/// Kimi-K2: `functions.N:IDX<|tool_call_argument_begin|>{…}`.
fn kimi_call(body: &str) -> Result<FoundCall, String> {
    let (id, args) = body.split_once("<|tool_call_argument_begin|>").ok_or("no <|tool_call_argument_begin|>")?;
    let id = id.trim();
    let name = id.strip_prefix("functions.").unwrap_or(id);
    let name = name.rsplit_once(':').map_or(name, |(n, _)| n);
    if name.is_empty() {
        return Err(format!("no function name in the call id {id:?}"));
    }
    let args = json_object(args.trim()).map_err(|e| format!("the arguments of {name} are not a JSON object: {e}"))?;
    Ok((name.to_string(), args, Some(id.to_string())))
}

/// A parameter's text as JSON: a `string` parameter (by the tool's schema) as it is; otherwise
/// JSON when it parses, else the text as a string.
fn typed_value(schemas: Option<&Json>, function: &str, key: &str, text: &str) -> Json {
    let ty = schemas.and_then(Json::as_array).and_then(|tools| {
        tools.iter().find_map(|t| {
            let f = t.get("function")?;
            (f.get("name")?.as_str()? == function).then_some(())?;
            f.get("parameters")?.get("properties")?.get(key)?.get("type")?.as_str()
        })
    });
    if ty == Some("string") {
        return Json::String(text.to_string());
    }
    serde_json::from_str(text).unwrap_or_else(|_| Json::String(text.to_string()))
}

/// The text between `open` and `close` after `from`: (inner, position after `close`).
fn between<'a>(s: &'a str, open: &str, close: &str) -> Option<(&'a str, usize)> {
    let a = s.find(open)? + open.len();
    let b = a + s[a..].find(close)?;
    Some((&s[a..b], b + close.len()))
}

/// GLM-4.5: `N\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>…`.
fn glm_call(body: &str, schemas: Option<&Json>) -> Result<FoundCall, String> {
    let name_end = body.find("<arg_key>").unwrap_or(body.len());
    let name = body[..name_end].trim();
    if name.is_empty() || name.contains(['<', '>', '{']) {
        return Err(format!("no function name before the arguments ({:?})", &body[..name_end]));
    }
    let mut args = Map::new();
    let mut rest = &body[name_end..];
    while !rest.trim().is_empty() {
        let (key, after) =
            between(rest, "<arg_key>", "</arg_key>").ok_or("an argument without <arg_key>…</arg_key>")?;
        rest = &rest[after..];
        let (value, after) = between(rest, "<arg_value>", "</arg_value>")
            .ok_or_else(|| format!("argument {key:?} has no <arg_value>"))?;
        rest = &rest[after..];
        args.insert(key.trim().to_string(), typed_value(schemas, name, key.trim(), value));
    }
    Ok((name.to_string(), Json::Object(args).to_string(), None))
}

/// MiniMax-M2: `<invoke name="N"><parameter name="K">V</parameter>…</invoke>`, one or more.
fn minimax_calls(body: &str, schemas: Option<&Json>) -> Result<Vec<FoundCall>, String> {
    let mut calls = Vec::new();
    let mut rest = body;
    while let Some((head, after)) = between(rest, "<invoke name=", ">") {
        let name = head.trim().trim_matches('"').to_string();
        let (inner, end) =
            between(&rest[after..], "", "</invoke>").ok_or_else(|| format!("<invoke name={head}> is not closed"))?;
        let mut args = Map::new();
        let mut p = inner;
        while let Some((key, a)) = between(p, "<parameter name=", ">") {
            let key = key.trim().trim_matches('"');
            let (value, b) =
                between(&p[a..], "", "</parameter>").ok_or_else(|| format!("parameter {key:?} is not closed"))?;
            args.insert(key.to_string(), typed_value(schemas, &name, key, value.trim_matches('\n')));
            p = &p[a + b..];
        }
        calls.push((name, Json::Object(args).to_string(), None));
        rest = &rest[after + end..];
    }
    if calls.is_empty() {
        return Err("no <invoke name=…> in the block".into());
    }
    if !rest.trim().is_empty() {
        return Err(format!("text after the last </invoke>: {:?}", rest.trim()));
    }
    Ok(calls)
}

#[cfg(test)]
mod tests;
