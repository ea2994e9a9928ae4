//! `scripts/demo.sh` runs the binary cargo reports building, wherever the target directory is
//! (`CARGO_TARGET_DIR`), not `./target/release/krasis`.

use std::process::Command;

#[test]
fn demo_runs_the_binary_cargo_reports() {
    let t = tempfile::tempdir().unwrap();
    // Stand-ins: a target directory elsewhere holding the built binary, and a `cargo` that reports
    // it the way `cargo build --message-format=json` does.
    let release = t.path().join("elsewhere/release");
    std::fs::create_dir_all(&release).unwrap();
    let exe = release.join("krasis");
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_krasis"), &exe).unwrap();
    let bin = t.path().join("bin");
    std::fs::create_dir(&bin).unwrap();
    let cargo = bin.join("cargo");
    let artifact = format!(
        r#"{{"reason":"compiler-artifact","target":{{"name":"krasis"}},"executable":"{}","fresh":true}}"#,
        exe.display()
    );
    std::fs::write(&cargo, format!("#!/bin/sh\necho '{artifact}'\necho '{{\"reason\":\"build-finished\"}}'\n"))
        .unwrap();
    std::fs::set_permissions(&cargo, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();

    // The run-time value: a target directory shared by two checkouts may hold a test binary built
    // in the other one, with the other's compile-time path.
    let manifest = std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or(env!("CARGO_MANIFEST_DIR").into());
    let root = std::path::Path::new(&manifest).parent().unwrap();
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default());
    let o = Command::new("bash")
        .arg(root.join("scripts/demo.sh"))
        .arg("Hello")
        .env("PATH", path)
        .env_remove("KRASIS_DEMO_DIR")
        .output()
        .unwrap();
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{e}");
    assert!(e.contains("demo: building") && e.contains("first build"), "says what it builds: {e}");
    assert!(!o.stdout.is_empty());
    assert!(t.path().join("elsewhere/demo-tiny/config.json").exists(), "the demo model sits beside the binary: {e}");
}
