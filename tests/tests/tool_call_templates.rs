//! Issue #41 item 2: the tool calls each published chat template in `../shared/real-configs`
//! writes for an assistant message are read back as those calls by the family's parser
//! (`krasis_model::text::tool_calls`), split at every character. The parsers' own tests (every
//! family, malformed arguments, streaming splits) are in `krasis-model/src/text/tool_calls/`.

use std::path::PathBuf;

use krasis_model::text::tool_calls::{Parsed, ParserOptions, StreamParser, ToolFormat};
use krasis_tests::{report_skip, workspace_root};
use serde_json::{json, Value as Json};

/// `../shared/real-configs` from the workspace root, or `None` after a visible skip.
fn real_configs() -> Option<PathBuf> {
    let dir = workspace_root().join("../shared/real-configs");
    if dir.join("Qwen3-tokenizer/tokenizer_config.json").is_file() {
        return Some(dir);
    }
    if std::env::var("KRASIS_REQUIRE_REAL_CONFIGS").as_deref() == Ok("1") {
        panic!("KRASIS_REQUIRE_REAL_CONFIGS=1 but no published templates at {}", dir.display());
    }
    report_skip(&format!("published templates not found at {}", dir.display()));
    None
}

fn opts() -> ParserOptions {
    ParserOptions { tools: true, id_prefix: "t".into(), ..ParserOptions::default() }
}

/// The events of `reply`, checked equal whole, split in two at every character boundary, and
/// fed one character at a time (adjacent text events joined).
fn parse_all_splits(format: ToolFormat, reply: &str) -> Vec<Parsed> {
    let run = |pieces: &[&str]| {
        let mut p = StreamParser::new(format, opts());
        let mut ev: Vec<Parsed> = pieces.iter().flat_map(|x| p.push(x)).collect();
        ev.extend(p.finish());
        let mut out: Vec<Parsed> = Vec::new();
        for e in ev {
            match (out.last_mut(), e) {
                (Some(Parsed::Content(a)), Parsed::Content(b)) => a.push_str(&b),
                (Some(Parsed::Reasoning(a)), Parsed::Reasoning(b)) => a.push_str(&b),
                (_, e) => out.push(e),
            }
        }
        out
    };
    let whole = run(&[reply]);
    for (at, _) in reply.char_indices().skip(1) {
        let (a, b) = reply.split_at(at);
        assert_eq!(run(&[a, b]), whole, "{format:?} split at byte {at}");
    }
    let chars: Vec<String> = reply.chars().map(String::from).collect();
    assert_eq!(run(&chars.iter().map(String::as_str).collect::<Vec<_>>()), whole, "{format:?} char by char");
    whole
}

/// The calls a published template writes for an assistant message are read back as those calls.
/// Kimi's is the moonshotai variant: the Kimi-K2-Instruct one mutates a list
/// (`tool_response_queue.ids.append`), which the template engine does not support.
#[test]
fn published_templates_calls_parse_back() {
    let Some(dir) = real_configs() else { return };
    let read = |p: &str| std::fs::read_to_string(dir.join(p)).unwrap();
    let from_config = |p: &str| -> String {
        let v: Json = serde_json::from_str(&read(p)).unwrap();
        v["chat_template"].as_str().unwrap().to_string()
    };
    let templates = [
        (
            ToolFormat::Qwen3,
            from_config("Qwen3-tokenizer/tokenizer_config.json"),
            "<|im_start|>assistant\n",
            "<|im_end|>",
        ),
        (
            ToolFormat::DeepSeek,
            from_config("DeepSeek-R1/tokenizer_config.json"),
            "<｜Assistant｜>",
            "<｜end▁of▁sentence｜>",
        ),
        (
            ToolFormat::Kimi,
            read("Kimi-K2-Instruct/chat_template.jinja_from_llamacpp-moonshotai-Kimi-K2"),
            "<|im_assistant|>assistant<|im_middle|>",
            "<|im_end|>",
        ),
        (ToolFormat::Harmony, read("gpt-oss-120b/chat_template.jinja"), "<|start|>assistant", "<|start|>functions"),
    ];
    for (format, template, open, close) in templates {
        assert_eq!(ToolFormat::from_template(&template), Some(format));
        // As OpenAI clients send them: arguments as JSON strings, content null.
        let args = |v: Json| Json::String(v.to_string());
        let calls: Vec<Json> = if format == ToolFormat::Harmony {
            vec![
                json!({"type": "function", "function": {"name": "get_weather", "arguments": args(json!({"city": "Paris"}))}}),
            ]
        } else {
            vec![
                json!({"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": args(json!({"city": "Paris"}))}}),
                json!({"id": "b", "type": "function", "function": {"name": "get_time", "arguments": args(json!({"tz": "CET"}))}}),
            ]
        };
        let mut messages = vec![
            json!({"role": "user", "content": "Weather?"}),
            json!({"role": "assistant", "content": null, "tool_calls": calls}),
            json!({"role": "tool", "tool_call_id": "a", "content": "sunny"}),
        ];
        krasis_model::text::chat_template::fit_messages(&template, &mut messages);
        let input =
            krasis_model::text::chat_template::ChatInput { messages: Json::Array(messages), ..Default::default() };
        let text =
            krasis_model::text::chat_template::render(&template, &input).unwrap_or_else(|e| panic!("{format:?}: {e}"));
        let start = text.rfind(open).unwrap_or_else(|| panic!("{format:?}: no {open:?} in {text:?}")) + open.len();
        let reply = &text[start..];
        let reply = &reply[..reply.find(close).unwrap_or(reply.len())];
        let got = parse_all_splits(format, reply);
        let names: Vec<&str> =
            got.iter().filter_map(|e| if let Parsed::Call(c) = e { Some(c.name.as_str()) } else { None }).collect();
        let want: Vec<&str> =
            if format == ToolFormat::Harmony { vec!["get_weather"] } else { vec!["get_weather", "get_time"] };
        assert_eq!(names, want, "{format:?}: {reply:?} gave {got:?}");
        let Parsed::Call(first) = got.iter().find(|e| matches!(e, Parsed::Call(_))).unwrap() else { unreachable!() };
        assert_eq!(serde_json::from_str::<Json>(&first.arguments).unwrap(), json!({"city": "Paris"}), "{format:?}");
    }
}
