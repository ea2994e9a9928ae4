//! Tool calls and reasoning through the official `openai` Python package (`openai_tools.py`),
//! against `krasis serve` on the synthesized tiny model with a Qwen3-style chat template and a
//! scripted reply (`KRASIS_TEST_SCRIPT`). Python comes from `KRASIS_PYTHON` (`.ci/run` points it
//! at a venv with `openai`), else `python3`; without the package the test says so on a
//! `*** SKIPPED` line, and `KRASIS_REQUIRE_OPENAI=1` makes that a failure.

mod common;

use std::process::Command;

use common::Server;
use serde_json::{json, Value};

/// The same Qwen3-style template as `serve_tools.rs`.
const TEMPLATE: &str = r#"{%- if tools %}{{ '<|im_start|>system\n# Tools\n<tools>' }}{% for t in tools %}{{ '\n' + (t | tojson) }}{% endfor %}{{ '\n</tools><|im_end|>\n' }}{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' %}{{ '<|im_start|>assistant\n' + m.content }}{% for tc in m.tool_calls or [] %}{{ '\n<tool_call>\n{"name": "' + tc.function.name + '", "arguments": ' + (tc.function.arguments | tojson) + '}\n</tool_call>' }}{% endfor %}{{ '<|im_end|>\n' }}
{%- elif m.role == 'tool' %}{{ '<|im_start|>user\n<tool_response>\n' + m.content + '\n</tool_response><|im_end|>\n' }}
{%- else %}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"#;

#[test]
fn the_openai_python_package_reads_tool_calls_and_reasoning() {
    let python = std::env::var("KRASIS_PYTHON").unwrap_or_else(|_| "python3".into());
    let probe = Command::new(&python).args(["-c", "import openai"]).output();
    if !probe.as_ref().is_ok_and(|o| o.status.success()) {
        let why = match &probe {
            Ok(o) => String::from_utf8_lossy(&o.stderr).lines().last().unwrap_or("").to_string(),
            Err(e) => e.to_string(),
        };
        if std::env::var("KRASIS_REQUIRE_OPENAI").as_deref() == Ok("1") {
            panic!("KRASIS_REQUIRE_OPENAI=1 but `{python} -c 'import openai'` failed: {why}");
        }
        krasis_tests::report_skip(&format!(
            "the openai Python package is not importable by {python} ({why}); `pip install openai` or set KRASIS_PYTHON"
        ));
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("reply.txt");
    std::fs::write(&script, "").unwrap();
    let s = Server::start_prepared(&[], &[("KRASIS_TEST_SCRIPT", script.to_str().unwrap())], |model| {
        let path = model.join("tokenizer_config.json");
        let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        cfg["chat_template"] = json!(TEMPLATE);
        std::fs::write(&path, cfg.to_string()).unwrap();
    });
    let client = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/openai_tools.py");
    let out = Command::new(&python)
        .args([client, &format!("http://{}/v1", s.addr), script.to_str().unwrap()])
        .output()
        .expect("run the openai client script");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "the openai client failed:\n{stdout}\n{stderr}\nserver log:\n{}", s.log());
    assert!(stdout.contains("tool checks passed"), "{stdout}");
    eprintln!("{}", stdout.trim());
}
