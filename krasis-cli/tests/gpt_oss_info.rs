//! `krasis info` on gpt-oss (the published gpt-oss-120b configuration, in `../shared/real-configs`):
//! the per-layer attention plan (sliding and full layers, sinks), the expert activation and
//! biases, and the MXFP4 experts of the published files.

use std::process::Command;

#[test]
fn info_describes_gpt_oss_120b() {
    let cfg =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/real-configs/gpt-oss-120b/config.json");
    if !cfg.exists() {
        krasis_tests::report_skip(&format!("{} missing", cfg.display()));
        return;
    }
    let o =
        Command::new(env!("CARGO_BIN_EXE_krasis")).args(["info", "--config", cfg.to_str().unwrap()]).output().unwrap();
    let said = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(said.contains("architecture gpt_oss"), "{said}");
    assert!(
        said.contains(&format!(
            "layers       {} (S sliding window of 128, F full attention); a sink logit per head",
            "SF".repeat(18)
        )),
        "{said}"
    );
    assert!(said.contains("q/k/v biases, o bias"), "{said}");
    assert!(
        said.contains("clamped SwiGLU (alpha 1.702, limit 7") && said.contains("experts and router with biases"),
        "{said}"
    );
    assert!(said.contains("(MXFP4 routed experts, the rest BF16)"), "{said}");
}
