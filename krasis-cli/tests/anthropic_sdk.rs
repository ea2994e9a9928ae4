//! `/v1/messages` through the official `anthropic` Python package (`anthropic_client.py`, issue
//! #41 item 3), against `krasis serve` on the synthesized tiny model with a Qwen3-style chat
//! template and scripted replies (`KRASIS_TEST_SCRIPT`): a plain message, streamed text, a tool
//! call whole and streamed, a tool result sent back, thinking blocks and the thinking switch,
//! count_tokens, the max_tokens and stop_sequence stop reasons, and the errors the SDK raises.
//! Python comes from `KRASIS_PYTHON` (`.ci/run` points it at a venv with `openai` and
//! `anthropic`), else `python3`; without the package the test says so on a `*** SKIPPED` line,
//! and `KRASIS_REQUIRE_ANTHROPIC=1` makes that a failure.

mod common;

use common::Scripted;

#[test]
fn the_anthropic_python_package_talks_to_the_messages_api() {
    let Some(python) = common::anthropic_python() else { return };
    let s = Scripted::start_with(common::QWEN_STYLE, &["--api-key", "test-key"]);
    let base = format!("http://{}", s.server.addr);
    let out =
        common::run_client(&python, "anthropic_client.py", &[&base, "test-key", s.script.to_str().unwrap()], &s.server);
    eprintln!("{}", out.trim());
}
