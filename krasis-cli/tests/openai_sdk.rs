//! `krasis serve` through the official `openai` Python package (`openai_client.py`). Python comes
//! from `KRASIS_PYTHON` (`.ci/run` points it at a venv with `openai`), else `python3`. Without the
//! package the test says so on a `*** SKIPPED` line; `KRASIS_REQUIRE_OPENAI=1` makes that a
//! failure.

mod common;

use std::process::Command;

use common::Server;

#[test]
fn the_openai_python_package_talks_to_the_server() {
    let Some(python) = common::openai_python() else { return };
    let s = Server::start(&["--api-key", "test-key"]);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/openai_client.py");
    let out = Command::new(&python)
        .args([script, &format!("http://{}/v1", s.addr), "test-key"])
        .output()
        .expect("run the openai client script");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "the openai client failed:\n{stdout}\n{stderr}\nserver log:\n{}", s.log());
    assert!(stdout.contains("checks passed"), "{stdout}");
    eprintln!("{}", stdout.trim());
}
