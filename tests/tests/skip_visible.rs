//! A test that skips for want of the HF oracle fixtures says so in plain `cargo test` output:
//! the harness hides whatever a passing test prints with `eprintln!`, so the skip must get past
//! the capture. This test runs itself again as a child without fixtures and reads its stderr.

use std::process::Command;

/// Set in the child run.
const CHILD: &str = "KRASIS_SKIP_VISIBLE_CHILD";
const TEST: &str = "skip_without_fixtures_shows_in_default_test_output";

#[test]
fn skip_without_fixtures_shows_in_default_test_output() {
    if std::env::var_os(CHILD).is_some() {
        // What every oracle test does first.
        assert!(krasis_tests::fixtures_dir().is_none());
        return;
    }
    let missing = "/nonexistent/krasis-fixtures";
    let o = Command::new(std::env::current_exe().unwrap())
        .args([TEST, "--exact"])
        .env(CHILD, "1")
        .env("KRASIS_FIXTURES", missing)
        .env_remove("KRASIS_REQUIRE_FIXTURES")
        .env_remove("RUST_TEST_NOCAPTURE")
        .output()
        .unwrap();
    let (out, err) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success(), "{out}{err}");
    let want = format!("*** SKIPPED {TEST}: HF oracle fixtures not found at {missing}");
    assert!(err.contains(&want), "the skip is not in the default output:\nstdout: {out}\nstderr: {err}");
}
