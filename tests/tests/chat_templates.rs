//! The published chat templates (DeepSeek-R1, DeepSeek-V3, Qwen3, Kimi-K2, gpt-oss; copied from
//! ../shared/real-configs into tests/data/chat_templates/) render exactly as transformers'
//! `render_jinja_template` (what `apply_chat_template` calls) renders them, on a fixed set of
//! conversations: one turn, a system prompt with several turns and non-ASCII text, no generation
//! prompt, tools offered, a tool call and its result, and the thinking switch off and on. A
//! template that transformers refuses (a template error or `raise_exception`) must be refused
//! here too. The expected texts were made by `scripts/make-chat-template-refs.py` with
//! transformers 5.24.0 (the version is in expected.json), `strftime_now` fixed to 2026-11-28.

use std::path::PathBuf;

use krasis_model::text::chat_template::{render, ChatInput};
use serde_json::Value;

fn data() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data/chat_templates")
}

#[test]
fn published_templates_render_as_transformers_renders_them() {
    let dir = data();
    let refs: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    let cases = refs["cases"].as_array().unwrap();
    let mut failures = Vec::new();
    let mut checked = 0;
    for e in refs["expected"].as_array().unwrap() {
        let (name, case) = (e["template"].as_str().unwrap(), e["case"].as_str().unwrap());
        let template = std::fs::read_to_string(dir.join(format!("{name}.jinja"))).unwrap();
        let c = cases.iter().find(|c| c["name"] == case).unwrap();
        let special = &refs["templates"][name];
        let input = ChatInput {
            messages: c["messages"].clone(),
            tools: c.get("tools").cloned(),
            add_generation_prompt: c["add_generation_prompt"].as_bool().unwrap(),
            bos_token: special["bos_token"].as_str().unwrap(),
            eos_token: special["eos_token"].as_str().unwrap(),
            extra: c.get("kwargs").and_then(Value::as_object).cloned().unwrap_or_default(),
            today: Some((2026, 11, 28)),
        };
        let got = render(&template, &input);
        checked += 1;
        match (e.get("rendered").and_then(Value::as_str), got) {
            (Some(want), Ok(got)) if want == got => {}
            (Some(want), Ok(got)) => {
                let at = want.chars().zip(got.chars()).take_while(|(a, b)| a == b).count();
                let near = |s: &str| s.chars().skip(at.saturating_sub(20)).take(60).collect::<String>();
                failures.push(format!(
                    "{name}/{case}: differs at char {at}:\n  transformers: {:?}\n  krasis:       {:?}",
                    near(want),
                    near(&got)
                ));
            }
            (Some(_), Err(err)) => failures.push(format!("{name}/{case}: transformers renders it, krasis: {err}")),
            (None, Ok(_)) => failures.push(format!(
                "{name}/{case}: transformers refuses it ({}), krasis renders it",
                e["error"].as_str().unwrap_or("?")
            )),
            (None, Err(_)) => {}
        }
    }
    assert!(checked >= 30, "only {checked} renders checked");
    assert!(failures.is_empty(), "{} of {checked} renders differ:\n{}", failures.len(), failures.join("\n"));
}
