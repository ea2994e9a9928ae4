//! Tool calls and reasoning through `krasis serve` (issue #41 item 2) on the synthesized tiny
//! model. Its chat template is replaced by a Qwen3-style one (tools, tool calls and tool results,
//! a thinking switch), and `KRASIS_TEST_SCRIPT` makes the reply a scripted text, so random
//! weights still write the family's calls: tool_calls and reasoning_content, streamed and not,
//! tool_choice none, parallel_tool_calls false, a round trip whose prompt is checked token for
//! token, the thinking switch, and the 400s of bad tools and unmatched tool results. A second
//! server reads gpt-oss's harmony form (`<|call|>` ends the turn).

mod common;

use common::{sse_events, Scripted};
use serde_json::{json, Value};

/// The weather tool as Python's `json.dumps` writes it (what the template's `tojson` gives).
const WEATHER_TOOL: &str = r#"{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}"#;

const TIME_TOOL: &str = r#"{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}}"#;

/// A reply in Qwen3's form: a think block, a sentence, two parallel calls.
const QWEN_REPLY: &str = "<think>\nI should look it up.\n</think>\n\nChecking.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"tz\": \"CET\"}}\n</tool_call>";

fn tools() -> Value {
    json!([serde_json::from_str::<Value>(WEATHER_TOOL).unwrap(), serde_json::from_str::<Value>(TIME_TOOL).unwrap()])
}

fn body(extra: Value) -> Value {
    let mut b = json!({"model": "tiny", "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "max_tokens": 400, "tools": tools()});
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

/// (message, finish_reason) of a whole chat response.
fn message(r: &common::Response) -> (Value, String) {
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    (v["choices"][0]["message"].clone(), v["choices"][0]["finish_reason"].as_str().unwrap().to_string())
}

/// A stream's deltas put together as the whole message: content, reasoning_content and
/// tool_calls (id, type and name from their first fragment, arguments joined by index).
fn streamed_message(events: &[String]) -> (Value, String) {
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{events:?}");
    let (mut content, mut reasoning, mut calls, mut finish) = (String::new(), String::new(), Vec::<Value>::new(), None);
    for e in &events[..events.len() - 1] {
        let v: Value = serde_json::from_str(e).unwrap();
        let Some(c) = v["choices"].get(0) else { continue };
        let d = &c["delta"];
        content.push_str(d["content"].as_str().unwrap_or(""));
        reasoning.push_str(d["reasoning_content"].as_str().unwrap_or(""));
        for tc in d["tool_calls"].as_array().into_iter().flatten() {
            let i = tc["index"].as_u64().unwrap() as usize;
            if i == calls.len() {
                assert!(tc["id"].is_string() && tc["function"]["name"].is_string(), "a call's first fragment: {tc}");
                calls.push(json!({"id": tc["id"], "type": tc["type"],
                    "function": {"name": tc["function"]["name"], "arguments": ""}}));
            }
            let args = format!(
                "{}{}",
                calls[i]["function"]["arguments"].as_str().unwrap(),
                tc["function"]["arguments"].as_str().unwrap_or("")
            );
            calls[i]["function"]["arguments"] = json!(args);
        }
        if let Some(f) = c["finish_reason"].as_str() {
            finish = Some(f.to_string());
        }
    }
    let mut m = json!({"content": if content.is_empty() { Value::Null } else { json!(content) },
        "reasoning_content": if reasoning.is_empty() { Value::Null } else { json!(reasoning) }});
    if !calls.is_empty() {
        m["tool_calls"] = json!(calls);
    }
    (m, finish.expect("a finish_reason"))
}

fn args(call: &Value) -> Value {
    serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).expect("arguments are JSON")
}

#[test]
fn tool_calls_and_reasoning_streamed_and_whole() {
    let s = Scripted::start(common::QWEN_STYLE);
    let (m, finish) = message(&s.chat(QWEN_REPLY, &body(json!({}))));
    assert_eq!(finish, "tool_calls");
    assert_eq!(
        (m["content"].as_str(), m["reasoning_content"].as_str()),
        (Some("Checking."), Some("I should look it up."))
    );
    let calls = m["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 2, "{m}");
    assert_eq!(
        (calls[0]["type"].as_str(), calls[0]["function"]["name"].as_str()),
        (Some("function"), Some("get_weather"))
    );
    assert_eq!(args(&calls[0]), json!({"city": "Paris"}));
    assert_eq!((calls[1]["function"]["name"].as_str(), args(&calls[1])), (Some("get_time"), json!({"tz": "CET"})));
    assert_ne!(calls[0]["id"], calls[1]["id"]);

    let r = s.chat(QWEN_REPLY, &body(json!({"stream": true})));
    assert_eq!(r.status, 200, "{}", r.text());
    let (sm, sfinish) = streamed_message(&r.sse_data());
    assert_eq!(sfinish, "tool_calls");
    assert_eq!((&sm["content"], &sm["reasoning_content"]), (&m["content"], &m["reasoning_content"]));
    let scalls = sm["tool_calls"].as_array().unwrap();
    assert_eq!(scalls.len(), 2, "{sm}");
    for (a, b) in scalls.iter().zip(calls) {
        assert_eq!((&a["function"]["name"], args(a)), (&b["function"]["name"], args(b)));
    }

    // parallel_tool_calls false: the first call only.
    let (m, finish) = message(&s.chat(QWEN_REPLY, &body(json!({"parallel_tool_calls": false}))));
    assert_eq!((m["tool_calls"].as_array().map(Vec::len), finish.as_str()), (Some(1), "tool_calls"));

    // tool_choice none: calls are not parsed; the reasoning still is.
    let (m, finish) = message(&s.chat(QWEN_REPLY, &body(json!({"tool_choice": "none"}))));
    assert_eq!(finish, "stop");
    assert!(m.get("tool_calls").is_none(), "{m}");
    assert!(m["content"].as_str().unwrap().contains("<tool_call>\n{\"name\": \"get_weather\""), "{m}");
    assert_eq!(m["reasoning_content"], "I should look it up.");

    // Malformed arguments: the text is content, no call.
    let bad = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": }\n</tool_call>";
    let (m, finish) = message(&s.chat(bad, &body(json!({}))));
    assert_eq!((m.get("tool_calls"), finish.as_str()), (None, "stop"), "{m}");
    assert!(m["content"].as_str().unwrap().contains("\"city\": }"), "{m}");

    // A named tool_choice that the model does not follow: its text, finish_reason stop.
    let named = json!({"tool_choice": {"type": "function", "function": {"name": "get_time"}}});
    let (m, finish) = message(&s.chat("It is sunny.", &body(named)));
    assert_eq!((m["content"].as_str(), finish.as_str()), (Some("It is sunny."), "stop"));
}

#[test]
fn tools_results_and_the_thinking_switch_reach_the_template() {
    let s = Scripted::start(common::QWEN_STYLE);
    let weather = serde_json::from_str::<Value>(WEATHER_TOOL).unwrap();
    let convo = json!({"model": "tiny", "tools": [weather], "max_tokens": 50, "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]});
    let r = s.chat("It is sunny in Paris.", &convo);
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["choices"][0]["message"]["content"], "It is sunny in Paris.");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    // The prompt the template must have written, token for token.
    let want = format!(
        "<|im_start|>system\n# Tools\n<tools>\n{WEATHER_TOOL}\n</tools><|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n\
         <|im_start|>assistant\n\n<tool_call>\n{{\"name\": \"get_weather\", \"arguments\": {{\"city\": \"Paris\"}}}}\n</tool_call><|im_end|>\n\
         <|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    );
    assert_eq!(v["usage"]["prompt_tokens"].as_u64(), Some(s.tokens(&want)), "the rendered prompt is:\n{want}");

    // The thinking switch of chat_template_kwargs.
    let plain = json!({"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}]});
    let off = json!({"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}],
        "chat_template_kwargs": {"enable_thinking": false}});
    let p = |b: &Value| s.chat("Hello.", b).json()["usage"]["prompt_tokens"].as_u64().unwrap();
    let base = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n";
    assert_eq!(p(&plain), s.tokens(base));
    assert_eq!(p(&off), s.tokens(&format!("{base}<think>\n\n</think>\n\n")));

    // Bad input: a tool result answering no call, a schema that is not one.
    let mut orphan = convo.clone();
    orphan["messages"][2]["tool_call_id"] = json!("call_9");
    let r = s.chat("x", &orphan);
    assert_eq!((r.status, r.json()["error"]["param"].as_str()), (400, Some("messages")), "{}", r.text());
    let bad_schema =
        body(json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": "a string"}}]}));
    let r = s.chat("x", &bad_schema);
    assert_eq!((r.status, r.json()["error"]["param"].as_str()), (400, Some("tools")), "{}", r.text());
}

#[test]
fn harmony_channels_and_calls() {
    let s = Scripted::start(common::HARMONY_STYLE);
    let reply = "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}<|call|>";
    let (m, finish) = message(&s.chat(reply, &body(json!({}))));
    assert_eq!(finish, "tool_calls");
    assert_eq!(m["reasoning_content"], "Need the weather.");
    let calls = m["tool_calls"].as_array().unwrap();
    assert_eq!((calls.len(), args(&calls[0])), (1, json!({"city": "Paris"})), "{m}");
    // `<|call|>` ends the turn: the rest of the script is never generated.
    let usage = s.chat(&format!("{reply}<|start|>assistant<|channel|>final<|message|>more"), &body(json!({}))).json();
    assert_eq!(usage["choices"][0]["message"]["content"], Value::Null, "{usage}");
    let final_reply = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>Paris is sunny.<|return|>";
    let r = s.chat(final_reply, &body(json!({"stream": true})));
    let (m, finish) = streamed_message(&sse_events(&r.text()));
    assert_eq!(
        (m["content"].as_str(), m["reasoning_content"].as_str(), finish.as_str()),
        (Some("Paris is sunny."), Some("Easy."), "stop")
    );
}
