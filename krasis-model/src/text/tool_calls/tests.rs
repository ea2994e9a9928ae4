use super::*;
use serde_json::json;

/// Adjacent text events of one kind joined (a stream's granularity is not its meaning).
fn merged(events: Vec<Parsed>) -> Vec<Parsed> {
    let mut out: Vec<Parsed> = Vec::new();
    for e in events {
        match (out.last_mut(), e) {
            (_, Parsed::Content(s) | Parsed::Reasoning(s)) if s.is_empty() => {}
            (Some(Parsed::Content(a)), Parsed::Content(b)) => a.push_str(&b),
            (Some(Parsed::Reasoning(a)), Parsed::Reasoning(b)) => a.push_str(&b),
            (_, e) => out.push(e),
        }
    }
    out
}

fn opts() -> ParserOptions {
    ParserOptions { tools: true, id_prefix: "t".into(), ..ParserOptions::default() }
}

fn parse_pieces(format: ToolFormat, o: &ParserOptions, pieces: &[&str]) -> Vec<Parsed> {
    let mut p = StreamParser::new(format, o.clone());
    let mut ev = Vec::new();
    for piece in pieces {
        ev.extend(p.push(piece));
    }
    ev.extend(p.finish());
    merged(ev)
}

/// The events of `text` whole, checked equal to those of `text` split in two at every character
/// boundary and fed one character at a time.
fn parse_all_splits(format: ToolFormat, o: &ParserOptions, text: &str) -> Vec<Parsed> {
    let whole = parse_pieces(format, o, &[text]);
    for (at, _) in text.char_indices().skip(1) {
        let (a, b) = text.split_at(at);
        assert_eq!(parse_pieces(format, o, &[a, b]), whole, "{format:?} split at byte {at} of {text:?}");
    }
    let chars: Vec<String> = text.chars().map(String::from).collect();
    let chars: Vec<&str> = chars.iter().map(String::as_str).collect();
    assert_eq!(parse_pieces(format, o, &chars), whole, "{format:?} char by char");
    whole
}

fn call(index: usize, id: &str, name: &str, arguments: Json) -> Parsed {
    Parsed::Call(ToolCall { index, id: id.into(), name: name.into(), arguments: arguments.to_string() })
}

fn reasoning(s: &str) -> Parsed {
    Parsed::Reasoning(s.into())
}

fn content(s: &str) -> Parsed {
    Parsed::Content(s.into())
}

/// The same reply in every family's form: reasoning, a sentence, two parallel calls.
fn sample(format: ToolFormat) -> &'static str {
    match format {
        ToolFormat::Qwen3 => concat!(
            "<think>\nThe user wants weather.\n</think>\n\nLet me check.\n",
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 2}}\n</tool_call>\n",
            "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"tz\": \"CET\"}}\n</tool_call>"
        ),
        ToolFormat::DeepSeek => concat!(
            "<think>\nThe user wants weather.\n</think>\n\nLet me check.",
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n",
            "{\"city\": \"Paris\", \"days\": 2}\n```<｜tool▁call▁end｜>\n",
            "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{\"tz\": \"CET\"}\n```<｜tool▁call▁end｜>",
            "<｜tool▁calls▁end｜>"
        ),
        ToolFormat::Kimi => concat!(
            "<think>The user wants weather.</think>Let me check.<|tool_calls_section_begin|>",
            "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{\"city\": \"Paris\", \"days\": 2}",
            "<|tool_call_end|><|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{\"tz\": \"CET\"}",
            "<|tool_call_end|><|tool_calls_section_end|>"
        ),
        ToolFormat::Glm45 => concat!(
            "\n<think>The user wants weather.</think>\nLet me check.\n",
            "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n",
            "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>\n",
            "<tool_call>get_time\n<arg_key>tz</arg_key>\n<arg_value>CET</arg_value>\n</tool_call>"
        ),
        ToolFormat::Harmony => concat!(
            "<|channel|>analysis<|message|>The user wants weather.<|end|>",
            "<|start|>assistant<|channel|>commentary<|message|>Let me check.<|end|>",
            "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>",
            "{\"city\": \"Paris\", \"days\": 2}<|call|>",
            "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{\"tz\": \"CET\"}"
        ),
        ToolFormat::MiniMaxM2 => concat!(
            "<think>\nThe user wants weather.\n</think>\n\nLet me check.\n<minimax:tool_call>\n",
            "<invoke name=\"get_weather\">\n<parameter name=\"city\">Paris</parameter>\n",
            "<parameter name=\"days\">2</parameter>\n</invoke>\n",
            "<invoke name=\"get_time\">\n<parameter name=\"tz\">CET</parameter>\n</invoke>\n</minimax:tool_call>"
        ),
    }
}

#[test]
fn every_family_reads_reasoning_content_and_two_parallel_calls_split_anywhere() {
    for format in ToolFormat::ALL {
        let got = parse_all_splits(format, &opts(), sample(format));
        let (id0, id1) = match format {
            ToolFormat::Kimi => ("functions.get_weather:0", "functions.get_time:1"),
            _ => ("call_t_0", "call_t_1"),
        };
        let want = vec![
            reasoning("The user wants weather."),
            content("Let me check."),
            call(0, id0, "get_weather", json!({"city": "Paris", "days": 2})),
            call(1, id1, "get_time", json!({"tz": "CET"})),
        ];
        assert_eq!(got, want, "{format:?}");
    }
}

#[test]
fn without_tools_call_text_stays_content_and_reasoning_is_still_split() {
    let o = ParserOptions { tools: false, ..opts() };
    let got = parse_all_splits(ToolFormat::Qwen3, &o, sample(ToolFormat::Qwen3));
    assert_eq!(got[0], reasoning("The user wants weather."));
    let Parsed::Content(c) = &got[1] else { panic!("{got:?}") };
    assert!(
        c.starts_with("Let me check.\n<tool_call>\n{\"name\": \"get_weather\"") && c.ends_with("</tool_call>"),
        "{c}"
    );
    assert_eq!(got.len(), 2);
    // Harmony without tools: the call message's arguments are content.
    let got = parse_all_splits(ToolFormat::Harmony, &o, sample(ToolFormat::Harmony));
    assert!(got.iter().all(|e| !matches!(e, Parsed::Call(_))), "{got:?}");
}

#[test]
fn malformed_arguments_are_kept_as_text_with_a_note() {
    let cases = [
        (ToolFormat::Qwen3, "Hi <tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": }\n</tool_call> bye"),
        (ToolFormat::Kimi, "Hi <|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{oops<|tool_call_end|><|tool_calls_section_end|> bye"),
        (ToolFormat::DeepSeek, "Hi <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n[1]\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜> bye"),
        (ToolFormat::Glm45, "Hi <tool_call>f\n<arg_key>a</arg_key>\n</tool_call> bye"),
        (ToolFormat::MiniMaxM2, "Hi <minimax:tool_call>\nnot an invoke\n</minimax:tool_call> bye"),
        (ToolFormat::Harmony, "<|channel|>commentary to=functions.f json<|message|>{\"a\": 1<|call|>"),
    ];
    for (format, text) in cases {
        let got = parse_all_splits(format, &opts(), text);
        assert!(got.iter().all(|e| !matches!(e, Parsed::Call(_))), "{format:?}: {got:?}");
        let note = got.iter().find_map(|e| if let Parsed::Note(n) = e { Some(n) } else { None });
        assert!(note.is_some_and(|n| n.starts_with("a tool call was kept as text")), "{format:?}: {got:?}");
        let text_out: String =
            got.iter().filter_map(|e| if let Parsed::Content(c) = e { Some(c.as_str()) } else { None }).collect();
        assert!(!text_out.is_empty(), "{format:?}: the call's text is in the content: {got:?}");
    }
}

#[test]
fn a_prompt_that_opens_the_think_block_starts_in_reasoning() {
    assert!(ParserOptions::prompt_opens_think("<|im_start|>assistant\n<think>\n"));
    assert!(!ParserOptions::prompt_opens_think("<|im_start|>assistant\n<think>\n\n</think>\n\n"));
    let o = ParserOptions { starts_in_reasoning: true, ..opts() };
    let got = parse_all_splits(ToolFormat::MiniMaxM2, &o, "Thinking hard.\n</think>\n\nThe answer is 4.");
    assert_eq!(got, vec![reasoning("Thinking hard."), content("The answer is 4.")]);
    // A reply with no think block keeps its text (and whitespace) as content.
    let got = parse_all_splits(ToolFormat::Qwen3, &opts(), "Just text.\n");
    assert_eq!(got, vec![content("Just text.\n")]);
}

#[test]
fn schema_types_decide_how_glm_and_minimax_values_are_read() {
    let schemas = json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
        "properties": {"code": {"type": "string"}, "n": {"type": "integer"}, "tags": {"type": "array"}}}}}]);
    let o = ParserOptions { schemas: Some(schemas), ..opts() };
    let got = parse_all_splits(
        ToolFormat::Glm45,
        &o,
        "<tool_call>f\n<arg_key>code</arg_key>\n<arg_value>123</arg_value>\n<arg_key>n</arg_key>\n<arg_value>7</arg_value>\n<arg_key>tags</arg_key>\n<arg_value>[\"a\"]</arg_value>\n</tool_call>",
    );
    assert_eq!(got, vec![call(0, "call_t_0", "f", json!({"code": "123", "n": 7, "tags": ["a"]}))]);
}

#[test]
fn formats_are_chosen_by_template_markers_then_model_type() {
    assert_eq!(ToolFormat::choose(Some("deepseek_v3"), Some("<|tool_calls_section_begin|>")), Some(ToolFormat::Kimi));
    assert_eq!(ToolFormat::choose(Some("deepseek_v3"), Some("plain")), Some(ToolFormat::DeepSeek));
    assert_eq!(ToolFormat::choose(Some("mixtral"), Some("plain")), None);
    assert_eq!(ToolFormat::from_template("<tool_call>{{ name }}<arg_key>"), Some(ToolFormat::Glm45));
    for f in ToolFormat::ALL {
        assert_eq!(ToolFormat::from_name(f.name()), Some(f));
    }
}

#[test]
fn qwen3_coder_xml_calls_are_read_in_the_qwen3_block() {
    let schemas = json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "zip": {"type": "string"}}}}}]);
    let o = ParserOptions { schemas: Some(schemas), ..opts() };
    let text = concat!(
        "<think>\nThe user wants weather.\n</think>\n\nLet me check.\n",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nSão Paulo\n</parameter>\n",
        "<parameter=days>\n3\n</parameter>\n<parameter=zip>\n01000\n</parameter>\n</function>\n</tool_call>\n",
        "<tool_call>\n<function=get_time>\n<parameter=tz>\nCET\n</parameter>\n</function>\n</tool_call>"
    );
    let got = parse_all_splits(ToolFormat::Qwen3, &o, text);
    let want = vec![
        reasoning("The user wants weather."),
        content("Let me check."),
        // `zip` is a string by its schema; `tz` has no schema and is not JSON: a string.
        call(0, "call_t_0", "get_weather", json!({"city": "São Paulo", "days": 3, "zip": "01000"})),
        call(1, "call_t_1", "get_time", json!({"tz": "CET"})),
    ];
    assert_eq!(got, want);
    // A value keeps its inner newlines; a function with no parameters has empty arguments.
    let got = parse_all_splits(
        ToolFormat::Qwen3,
        &opts(),
        "<tool_call>\n<function=write>\n<parameter=text>\na\n\nb\n</parameter>\n</function>\n</tool_call><tool_call>\n<function=now>\n</function>\n</tool_call>",
    );
    assert_eq!(
        got,
        vec![call(0, "call_t_0", "write", json!({"text": "a\n\nb"})), call(1, "call_t_1", "now", json!({}))]
    );
    // Malformed: kept as text with a note.
    for bad in [
        "<tool_call>\n<function=f>\n<parameter=a>\n1\n</function>\n</tool_call>",
        "<tool_call>\n<function=f>\nstray <parameter=a>\n1\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>\n<function=>\n</function>\n</tool_call>",
        "<tool_call>\n<function=f>\n</function>\nmore\n</tool_call>",
    ] {
        let got = parse_all_splits(ToolFormat::Qwen3, &opts(), bad);
        assert!(got.iter().all(|e| !matches!(e, Parsed::Call(_))), "{bad:?}: {got:?}");
        assert!(got.iter().any(|e| matches!(e, Parsed::Note(_))), "{bad:?}: {got:?}");
    }
}
