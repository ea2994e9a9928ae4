//! Anthropic's Messages API (`POST /v1/messages`, issue #41 item 3) over plain HTTP, on the
//! synthesized tiny model with a Qwen3-style chat template and scripted replies
//! (`KRASIS_TEST_SCRIPT`): the prompt a conversation of text, tool_use, tool_result and system
//! blocks renders to (token for token), the SSE wire form (each `event:` line naming its data's
//! type, blocks opened and closed in order, a call's input from `input_json_delta`), stop
//! reasons, count_tokens, the API key in `x-api-key`, error bodies in Anthropic's shape, and
//! random bodies that never get a 5xx or stop the server.

mod common;

use common::{request, Scripted};
use serde_json::{json, Value};

const WEATHER: &str = r#"{"name": "get_weather", "description": "Weather of a city", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}"#;

/// The weather tool as the template's `tojson` writes it (OpenAI's form, Python's separators).
const WEATHER_OPENAI: &str = r#"{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}"#;

const CALL_REPLY: &str = "<think>\nI should look it up.\n</think>\n\nChecking.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";

fn weather() -> Value {
    serde_json::from_str(WEATHER).unwrap()
}

fn ask(extra: Value) -> Value {
    let mut b = json!({"model": "tiny", "max_tokens": 300, "tools": [weather()],
        "messages": [{"role": "user", "content": "Weather in Paris?"}]});
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

fn post(s: &Scripted, reply: &str, body: &Value) -> common::Response {
    s.reply(reply);
    s.server.post("/v1/messages", body)
}

/// The SSE events of a body: (the `event:` name, its data), each checked to be named as its
/// data's `type`.
fn events(text: &str) -> Vec<(String, Value)> {
    let mut out = Vec::new();
    for e in text.split("\n\n").filter(|e| !e.trim().is_empty()) {
        let (mut name, mut data) = (None, None);
        for line in e.lines() {
            if let Some(n) = line.strip_prefix("event: ") {
                name = Some(n.to_string());
            } else if let Some(d) = line.strip_prefix("data: ") {
                data = Some(serde_json::from_str::<Value>(d).unwrap_or_else(|err| panic!("{err}: {d}")));
            }
        }
        let (name, data) = (name.expect("an event: line"), data.expect("a data: line"));
        assert_eq!(data["type"], name.as_str(), "{e}");
        out.push((name, data));
    }
    out
}

/// A stream's events put together as the whole message (what the SDK's accumulator does),
/// checking the order: message_start first, each block started, given deltas of its own kind
/// and stopped before the next, message_delta then message_stop last.
fn assemble(ev: &[(String, Value)]) -> Value {
    assert_eq!(ev[0].0, "message_start");
    let mut msg = ev[0].1["message"].clone();
    let mut open: Option<usize> = None;
    let mut partial = String::new();
    for (name, d) in &ev[1..] {
        let content = msg["content"].as_array_mut().unwrap();
        match name.as_str() {
            "ping" => {}
            "content_block_start" => {
                assert!(open.is_none(), "a block starts while another is open");
                let i = d["index"].as_u64().unwrap() as usize;
                assert_eq!(i, content.len(), "blocks are numbered in order");
                content.push(d["content_block"].clone());
                open = Some(i);
            }
            "content_block_delta" => {
                let i = d["index"].as_u64().unwrap() as usize;
                assert_eq!(Some(i), open, "a delta for the open block");
                let block = &mut content[i];
                let delta = &d["delta"];
                match (block["type"].as_str().unwrap(), delta["type"].as_str().unwrap()) {
                    ("text", "text_delta") => {
                        block["text"] =
                            json!(format!("{}{}", block["text"].as_str().unwrap(), delta["text"].as_str().unwrap()))
                    }
                    ("thinking", "thinking_delta") => {
                        block["thinking"] = json!(format!(
                            "{}{}",
                            block["thinking"].as_str().unwrap(),
                            delta["thinking"].as_str().unwrap()
                        ))
                    }
                    ("tool_use", "input_json_delta") => partial.push_str(delta["partial_json"].as_str().unwrap()),
                    (b, t) => panic!("a {t} delta in a {b} block"),
                }
            }
            "content_block_stop" => {
                let i = d["index"].as_u64().unwrap() as usize;
                assert_eq!(Some(i), open);
                if content[i]["type"] == "tool_use" {
                    content[i]["input"] = serde_json::from_str(&partial).expect("input_json_delta joins into JSON");
                    partial.clear();
                }
                open = None;
            }
            "message_delta" => {
                assert!(open.is_none(), "message_delta after every block stopped");
                msg["stop_reason"] = d["delta"]["stop_reason"].clone();
                msg["stop_sequence"] = d["delta"]["stop_sequence"].clone();
                msg["usage"]["output_tokens"] = d["usage"]["output_tokens"].clone();
            }
            "message_stop" => {}
            other => panic!("unexpected event {other}: {d}"),
        }
    }
    assert_eq!(ev.last().unwrap().0, "message_stop");
    assert_eq!(ev[ev.len() - 2].0, "message_delta");
    msg
}

#[test]
fn messages_whole_and_streamed() {
    let s = Scripted::start(common::QWEN_STYLE);
    let r = post(&s, CALL_REPLY, &ask(json!({})));
    assert_eq!(r.status, 200, "{}", r.text());
    let m = r.json();
    assert_eq!(
        (m["type"].as_str(), m["role"].as_str(), m["model"].as_str()),
        (Some("message"), Some("assistant"), Some("tiny"))
    );
    assert!(m["id"].as_str().unwrap().starts_with("msg_"), "{m}");
    assert_eq!(m["stop_reason"], "tool_use");
    let content = m["content"].as_array().unwrap();
    assert_eq!(content.len(), 3, "{m}");
    assert_eq!(content[0], json!({"type": "thinking", "thinking": "I should look it up.", "signature": ""}));
    assert_eq!(content[1], json!({"type": "text", "text": "Checking."}));
    assert_eq!((content[2]["type"].as_str(), content[2]["name"].as_str()), (Some("tool_use"), Some("get_weather")));
    assert_eq!(content[2]["input"], json!({"city": "Paris"}));
    assert!(content[2]["id"].as_str().unwrap().starts_with("toolu_"), "{m}");
    let usage = &m["usage"];
    assert!(usage["input_tokens"].as_u64().unwrap() > 0 && usage["output_tokens"].as_u64().unwrap() > 0, "{m}");

    let r = post(&s, CALL_REPLY, &ask(json!({"stream": true})));
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r.header("content-type").unwrap().starts_with("text/event-stream"), "{:?}", r.headers);
    let streamed = assemble(&events(&r.text()));
    assert_eq!(streamed["stop_reason"], "tool_use");
    assert_eq!(streamed["usage"]["input_tokens"], usage["input_tokens"]);
    assert_eq!(streamed["usage"]["output_tokens"], usage["output_tokens"]);
    let sc = streamed["content"].as_array().unwrap();
    assert_eq!((&sc[0]["thinking"], &sc[1]["text"]), (&content[0]["thinking"], &content[1]["text"]));
    assert_eq!((&sc[2]["name"], &sc[2]["input"]), (&content[2]["name"], &content[2]["input"]));

    // tool_choice none: the call's text is text.
    let m = post(&s, CALL_REPLY, &ask(json!({"tool_choice": {"type": "none"}}))).json();
    assert_eq!(m["stop_reason"], "end_turn");
    assert!(m["content"][1]["text"].as_str().unwrap().contains("<tool_call>"), "{m}");

    // Stop reasons: max_tokens, a stop sequence (streamed too), a stop string of the request
    // that never comes.
    let long = "one two three four five six seven eight";
    let m = post(&s, long, &ask(json!({"max_tokens": 2}))).json();
    assert_eq!((m["stop_reason"].as_str(), m["usage"]["output_tokens"].as_u64()), (Some("max_tokens"), Some(2)));
    let m = post(&s, long, &ask(json!({"stop_sequences": ["xyz", "four"]}))).json();
    assert_eq!((m["stop_reason"].as_str(), m["stop_sequence"].as_str()), (Some("stop_sequence"), Some("four")));
    assert_eq!(m["content"][0]["text"].as_str().unwrap().trim_end(), "one two three");
    let r = post(&s, long, &ask(json!({"stop_sequences": ["four"], "stream": true})));
    let streamed = assemble(&events(&r.text()));
    assert_eq!(
        (streamed["stop_reason"].as_str(), streamed["stop_sequence"].as_str()),
        (Some("stop_sequence"), Some("four"))
    );
    let m = post(&s, long, &ask(json!({"stop_sequences": ["xyz"]}))).json();
    assert_eq!((m["stop_reason"].as_str(), m["stop_sequence"].as_str()), (Some("end_turn"), None));
    // max_tokens beyond the context is cut to the room left.
    let m = post(&s, long, &ask(json!({"max_tokens": 100_000_000}))).json();
    assert_eq!(m["stop_reason"], "end_turn", "{m}");
}

#[test]
fn a_conversation_reaches_the_template() {
    let s = Scripted::start(common::QWEN_STYLE);
    let convo = json!({"model": "tiny", "max_tokens": 50, "tools": [weather()], "system": "Be brief.",
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_7", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_7",
                "content": [{"type": "text", "text": "sunny"}]}]}]});
    let r = post(&s, "It is sunny in Paris.", &convo);
    assert_eq!(r.status, 200, "{}", r.text());
    let m = r.json();
    assert_eq!(
        (m["content"][0]["text"].as_str(), m["stop_reason"].as_str()),
        (Some("It is sunny in Paris."), Some("end_turn"))
    );
    // The prompt the template must have written, token for token.
    let want = format!(
        "<|im_start|>system\n# Tools\n<tools>\n{WEATHER_OPENAI}\n</tools><|im_end|>\n<|im_start|>system\nBe brief.<|im_end|>\n\
         <|im_start|>user\nWeather in Paris?<|im_end|>\n\
         <|im_start|>assistant\nChecking.\n<tool_call>\n{{\"name\": \"get_weather\", \"arguments\": {{\"city\": \"Paris\"}}}}\n</tool_call><|im_end|>\n\
         <|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    );
    assert_eq!(m["usage"]["input_tokens"].as_u64(), Some(s.tokens(&want)), "the rendered prompt is:\n{want}");
    let counted = s.server.post("/v1/messages/count_tokens", &convo).json();
    assert_eq!(counted, json!({"input_tokens": s.tokens(&want)}));

    // A final assistant turn is a prefill: the prompt ends with it.
    let mut prefill = convo.clone();
    prefill["messages"].as_array_mut().unwrap().push(json!({"role": "assistant", "content": "It is"}));
    let m = post(&s, " sunny.", &prefill).json();
    assert_eq!(m["usage"]["input_tokens"].as_u64(), Some(s.tokens(&format!("{want}It is"))));
    assert_eq!(m["content"][0]["text"], " sunny.", "the continuation, its space kept");

    // The thinking switch: disabled closes an empty think block in the generation prompt.
    let hi = json!({"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}]});
    let mut off = hi.clone();
    off["thinking"] = json!({"type": "disabled"});
    let base = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n";
    let count = |b: &Value| s.server.post("/v1/messages/count_tokens", b).json()["input_tokens"].as_u64().unwrap();
    assert_eq!(count(&hi), s.tokens(base));
    assert_eq!(count(&off), s.tokens(&format!("{base}<think>\n\n</think>\n\n")));
}

#[test]
fn parallel_calls_and_harmony() {
    let s = Scripted::start(common::QWEN_STYLE);
    let two = format!(
        "{CALL_REPLY}\n<tool_call>\n{{\"name\": \"get_weather\", \"arguments\": {{\"city\": \"Rome\"}}}}\n</tool_call>"
    );
    let m = post(&s, &two, &ask(json!({}))).json();
    let inputs: Vec<&Value> =
        m["content"].as_array().unwrap().iter().filter(|b| b["type"] == "tool_use").map(|b| &b["input"]).collect();
    assert_eq!(inputs, [&json!({"city": "Paris"}), &json!({"city": "Rome"})], "{m}");
    assert_ne!(m["content"][2]["id"], m["content"][3]["id"]);
    let streamed = assemble(&events(&post(&s, &two, &ask(json!({"stream": true}))).text()));
    assert_eq!(streamed["content"].as_array().unwrap().len(), 4, "{streamed}");
    assert_eq!(streamed["content"][3]["input"], json!({"city": "Rome"}));
    let one = ask(json!({"tool_choice": {"type": "auto", "disable_parallel_tool_use": true}}));
    let m = post(&s, &two, &one).json();
    assert_eq!(m["content"].as_array().unwrap().iter().filter(|b| b["type"] == "tool_use").count(), 1, "{m}");
    drop(s);

    // gpt-oss's harmony form: `<|call|>` is a stop string of the format, after the request's
    // stop_sequences; the reply that it ends is a tool_use, not a stop_sequence.
    let s = Scripted::start(common::HARMONY_STYLE);
    let reply = "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}<|call|>";
    let m = post(&s, reply, &ask(json!({"stop_sequences": ["never"]}))).json();
    assert_eq!((m["stop_reason"].as_str(), &m["stop_sequence"]), (Some("tool_use"), &Value::Null), "{m}");
    assert_eq!(m["content"][0], json!({"type": "thinking", "thinking": "Need the weather.", "signature": ""}));
    assert_eq!(m["content"][1]["input"], json!({"city": "Paris"}));
}

/// The error body of a response, checked to be Anthropic's shape; (status, type, message).
fn error(r: &common::Response) -> (u16, String, String) {
    let v = r.json();
    assert_eq!(v["type"], "error", "{v}");
    let e = &v["error"];
    (r.status, e["type"].as_str().unwrap().to_string(), e["message"].as_str().unwrap().to_string())
}

#[test]
fn errors_and_keys() {
    let s = Scripted::start_with(common::QWEN_STYLE, &["--api-key", "k1"]);
    let addr = &s.server.addr;
    let send = |headers: &[(&str, &str)], body: &Value| {
        request(addr, "POST", "/v1/messages", headers, Some(body.to_string().as_bytes()))
    };
    s.reply("Hi.");
    let hi = json!({"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}]});
    assert_eq!(send(&[("x-api-key", "k1")], &hi).status, 200);
    assert_eq!(send(&[("Authorization", "Bearer k1")], &hi).status, 200);
    let (status, kind, _) = error(&send(&[("x-api-key", "nope")], &hi));
    assert_eq!((status, kind.as_str()), (401, "authentication_error"));
    let (status, kind, _) = error(&send(&[], &hi));
    assert_eq!((status, kind.as_str()), (401, "authentication_error"));
    let key = [("x-api-key", "k1")];
    for (body, field) in [
        (json!({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}), "max_tokens"),
        (json!({"model": "tiny", "max_tokens": 5, "messages": [{"role": "bot", "content": "Hi"}]}), "messages.0.role"),
        (
            json!({"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "audio"}]}]}),
            "messages.0.content.0.type",
        ),
        (
            json!({"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tools": [weather()],
                "tool_choice": {"type": "tool", "name": "nope"}}),
            "tool_choice.name",
        ),
    ] {
        let (status, kind, message) = error(&send(&key, &body));
        assert_eq!((status, kind.as_str()), (400, "invalid_request_error"), "{body}: {message}");
        assert!(message.starts_with(field), "{body}: {message}");
    }
    let r = request(addr, "POST", "/v1/messages", &key, Some(b"{not json"));
    assert_eq!(error(&r).0, 400);
    // Unknown routes and methods under /v1/messages answer in Anthropic's shape too.
    let r = request(addr, "GET", "/v1/messages", &key, None);
    assert_eq!(error(&r).0, 405);
    let (status, kind, _) = error(&request(addr, "POST", "/v1/messages/batches", &key, Some(b"{}")));
    assert_eq!((status, kind.as_str()), (404, "not_found_error"));
    // A prompt longer than the context.
    let big =
        json!({"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "word ".repeat(20_000)}]});
    let (status, kind, message) = error(&send(&key, &big));
    assert_eq!((status, kind.as_str()), (400, "invalid_request_error"), "{message}");
}

/// A small deterministic generator (xorshift), so that a failure can be replayed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// `v` with one random change somewhere: a value replaced by another kind, a key removed, an
/// array emptied or its items repeated.
fn mutate(v: &mut Value, rng: &mut Rng, depth: usize) {
    let replacements = [
        json!(null),
        json!(0),
        json!(-1),
        json!(1e308),
        json!("text"),
        json!("tool_use"),
        json!(""),
        json!([]),
        json!({}),
        json!([{"type": "tool_result"}]),
        json!({"type": "tool"}),
        json!(true),
        json!("\u{0}\u{ffff}"),
    ];
    let descend = depth < 6 && rng.below(4) != 0;
    match v {
        Value::Object(o) if descend && !o.is_empty() => {
            let key = o.keys().nth(rng.below(o.len())).unwrap().clone();
            if rng.below(5) == 0 {
                o.remove(&key);
            } else {
                mutate(o.get_mut(&key).unwrap(), rng, depth + 1);
            }
        }
        Value::Array(a) if descend && !a.is_empty() => {
            let i = rng.below(a.len());
            match rng.below(6) {
                0 => a.clear(),
                1 => {
                    let item = a[i].clone();
                    a.push(item);
                }
                _ => mutate(&mut a[i], rng, depth + 1),
            }
        }
        _ => *v = replacements[rng.below(replacements.len())].clone(),
    }
}

#[test]
fn random_bodies_never_get_a_5xx() {
    let s = Scripted::start(common::QWEN_STYLE);
    s.reply(CALL_REPLY);
    let seed_body = json!({"model": "tiny", "max_tokens": 8, "system": [{"type": "text", "text": "Be brief."}],
        "tools": [weather()], "tool_choice": {"type": "auto"}, "stop_sequences": ["END"],
        "thinking": {"type": "enabled", "budget_tokens": 1024}, "stream": false,
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "t", "signature": ""},
                {"type": "tool_use", "id": "toolu_7", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_7", "content": "sunny"}]}]});
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let (mut ok, mut refused) = (0, 0);
    for round in 0..150 {
        let mut body = seed_body.clone();
        for _ in 0..1 + rng.below(3) {
            mutate(&mut body, &mut rng, 0);
        }
        // Keep replies short: a mutated max_tokens may ask for the whole context.
        if body.get("max_tokens").and_then(Value::as_u64).is_some_and(|m| m > 8) {
            body["max_tokens"] = json!(8);
        }
        let r = s.server.post("/v1/messages", &body);
        assert!(
            r.status == 200 || (400..500).contains(&r.status),
            "round {round}: {} for {body}\n{}",
            r.status,
            r.text()
        );
        if r.status == 200 {
            ok += 1;
        } else {
            let (_, kind, _) = error(&r);
            assert!(!kind.is_empty(), "{body}");
            refused += 1;
        }
    }
    assert!(ok > 0 && refused > 0, "{ok} accepted, {refused} refused: the mutations should do both");
    assert_eq!(s.server.get("/health").status, 200, "the server still answers");
    assert!(!s.server.log().contains("panicked"), "a handler panicked:\n{}", s.server.log());
}
