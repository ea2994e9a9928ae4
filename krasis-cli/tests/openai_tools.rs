//! Tool calls and reasoning through the official `openai` Python package (`openai_tools.py`),
//! against `krasis serve` on the synthesized tiny model with a Qwen3-style chat template and a
//! scripted reply (`KRASIS_TEST_SCRIPT`). Python comes from `KRASIS_PYTHON` (`.ci/run` points it
//! at a venv with `openai`), else `python3`; without the package the test says so on a
//! `*** SKIPPED` line, and `KRASIS_REQUIRE_OPENAI=1` makes that a failure.

mod common;

use std::process::Command;

use common::Server;

#[test]
fn the_openai_python_package_reads_tool_calls_and_reasoning() {
    let Some(python) = common::openai_python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("reply.txt");
    std::fs::write(&script, "").unwrap();
    let s = Server::start_prepared(&[], &[("KRASIS_TEST_SCRIPT", script.to_str().unwrap())], |model| {
        common::set_chat_template(model, common::QWEN_STYLE)
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
