//! `krasis convert` and `krasis generate` on a ModelOpt NVFP4 checkpoint
//! (`../shared/fixtures-next/qwen3moe-nvfp4-tiny`): at `--cpu-expert-bits auto` (the default)
//! convert builds the CPU expert cache of the experts as stored (`experts_cpu_nvfp4_g16.bin`, not
//! an INT4 requantisation), and generate runs from it without building another.

use std::process::Command;

fn krasis(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_krasis")).args(args).output().expect("run krasis")
}

fn stderr(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn convert_and_generate_keep_nvfp4_experts_as_stored() {
    let Some(dir) = krasis_tests::fixture_next("qwen3moe-nvfp4-tiny") else { return };
    let tmp = tempfile::tempdir().unwrap();
    let (m, c) = (dir.to_str().unwrap(), tmp.path().to_str().unwrap());
    let o = krasis(&["convert", "--model", m, "--cache-dir", c]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("routed experts on the CPU: nvfp4 (as stored)"), "{}", stderr(&o));
    let experts = || {
        let mut v: Vec<String> = std::fs::read_dir(tmp.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("experts_"))
            .collect();
        v.sort();
        v
    };
    assert_eq!(experts(), vec!["experts_cpu_nvfp4_g16.bin".to_string()]);
    let o = krasis(&[
        "generate",
        "--model",
        m,
        "--cache-dir",
        c,
        "--prompt-ids",
        "5,6,7",
        "--max-new-tokens",
        "2",
        "--threads",
        "2",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("nvfp4 (as stored)"), "{}", stderr(&o));
    assert!(stderr(&o).contains("expert cache hit"), "{}", stderr(&o));
    assert_eq!(experts(), vec!["experts_cpu_nvfp4_g16.bin".to_string()]);
}

/// `--gpu-expert-bits auto` builds the GPU expert cache the GPU engine reads at its defaults: on
/// the NVFP4 checkpoint the experts as stored in the GPU FP4 tile layout (`experts_gpu_nvfp4.bin`,
/// no INT4 requantisation) beside the CPU one; a second convert finds both up to date. Host
/// work only: no GPU needed.
#[test]
fn convert_gpu_auto_builds_the_fp4_gpu_cache() {
    let Some(dir) = krasis_tests::fixture_next("qwen3moe-nvfp4-tiny") else { return };
    let tmp = tempfile::tempdir().unwrap();
    let (m, c) = (dir.to_str().unwrap(), tmp.path().to_str().unwrap());
    let o = krasis(&["convert", "--model", m, "--cache-dir", c, "--gpu-expert-bits", "auto"]);
    let e = stderr(&o);
    assert!(o.status.success(), "{e}");
    assert!(e.contains("routed experts on the GPU: nvfp4 (as stored)"), "{e}");
    assert!(e.contains("GPU expert cache built"), "{e}");
    let mut names: Vec<String> = std::fs::read_dir(tmp.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("experts_"))
        .collect();
    names.sort();
    assert_eq!(names, vec!["experts_cpu_nvfp4_g16.bin".to_string(), "experts_gpu_nvfp4.bin".to_string()]);
    let o = krasis(&["convert", "--model", m, "--cache-dir", c, "--gpu-expert-bits", "auto"]);
    let e = stderr(&o);
    assert!(o.status.success(), "{e}");
    assert!(e.contains("GPU expert cache up to date"), "{e}");
}
