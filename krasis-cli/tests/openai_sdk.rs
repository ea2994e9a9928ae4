//! `krasis serve` through the official `openai` Python package (`openai_client.py`). Python comes
//! from `KRASIS_PYTHON` (`.ci/run` points it at a venv with `openai`), else `python3`. Without the
//! package the test says so on a `*** SKIPPED` line; `KRASIS_REQUIRE_OPENAI=1` makes that a
//! failure.

mod common;

use std::process::Command;

use common::Server;

#[test]
fn the_openai_python_package_talks_to_the_server() {
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
