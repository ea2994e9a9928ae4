//! A new user's first commands (issue #37, round two): context limits in `generate`, help text
//! that matches what the commands do, notices for flags that do nothing, and no noise or
//! contradictions on the way.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn krasis(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_krasis")).args(args).output().expect("run krasis")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Exit code 1, no panic, and `needle` in stderr.
fn assert_error(o: &Output, needle: &str) {
    let e = stderr(o);
    assert_eq!(o.status.code(), Some(1), "exit code; stderr: {e}");
    assert!(!e.contains("panicked"), "panic: {e}");
    assert!(e.contains(needle), "stderr lacks {needle:?}: {e}");
}

/// A fresh temp dir with a synthesized two-layer `tiny` model at `<tmp>/tiny`.
fn tiny() -> (tempfile::TempDir, PathBuf) {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("tiny");
    let o = krasis(&["synth", "--preset", "tiny", "--layers", "2", "--out", dir.to_str().unwrap(), "--force"]);
    assert!(o.status.success(), "synth failed: {}", stderr(&o));
    (t, dir)
}

/// Sets `max_position_embeddings` in the model's config.json.
fn set_max_positions(dir: &Path, n: usize) {
    let path = dir.join("config.json");
    let mut c: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    c["max_position_embeddings"] = n.into();
    std::fs::write(&path, serde_json::to_vec_pretty(&c).unwrap()).unwrap();
}

/// `n` prompt token ids, comma-separated.
fn ids(n: usize) -> String {
    (0..n).map(|i| (5 + i % 300).to_string()).collect::<Vec<_>>().join(",")
}

/// The long help of one flag: from its line to the next flag's.
fn flag_help(help: &str, flag: &str) -> String {
    let start = help.find(&format!("  {flag} ")).unwrap_or_else(|| panic!("no {flag} in:\n{help}"));
    let rest = &help[start + 2..];
    let end = rest[2..].find("\n  -").map_or(rest.len(), |e| e + 2);
    rest[..end].split_whitespace().collect::<Vec<_>>().join(" ")
}

#[test]
fn generate_refuses_a_prompt_over_the_kv_tokens_before_loading() {
    let (_t, dir) = tiny();
    let m = dir.to_str().unwrap();
    let prompt = ids(27);
    let o = krasis(&["generate", "--model", m, "--prompt-ids", &prompt, "--kv-tokens", "4", "--device", "cpu"]);
    assert_error(&o, "the prompt does not fit the context");
    let e = stderr(&o);
    assert!(e.contains("context is 4 tokens") && e.contains("27 prompt") && e.contains("--kv-tokens 4"), "{e}");
    assert!(!e.contains("loaded"), "refused before loading the model: {e}");
    assert!(o.stdout.is_empty(), "nothing generated: {}", stdout(&o));

    // Within the limit the CPU engine holds it as its context: the new tokens are capped aloud.
    let o = krasis(&[
        "generate",
        "--model",
        m,
        "--prompt-ids",
        &ids(3),
        "--kv-tokens",
        "8",
        "--max-new-tokens",
        "10",
        "--ignore-eos",
        "--device",
        "cpu",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(e.contains("notice: --max-new-tokens 10 capped to 5: the context is 8 tokens (--kv-tokens 8)"), "{e}");
    assert!(e.contains("decode: 5 tokens"), "{e}");
}

#[test]
fn generate_holds_to_the_models_max_position_embeddings() {
    let (_t, dir) = tiny();
    let m = dir.to_str().unwrap();
    set_max_positions(&dir, 16);
    let o = krasis(&["generate", "--model", m, "--prompt-ids", &ids(81), "--max-new-tokens", "40"]);
    assert_error(&o, "the prompt does not fit the context");
    let e = stderr(&o);
    assert!(e.contains("max_position_embeddings 16") && e.contains("81 prompt"), "{e}");
    assert!(!e.contains("loaded"), "{e}");

    // A prompt that fits, asking for more than the room: capped with a notice, never silent.
    let o = krasis(&["generate", "--model", m, "--prompt-ids", &ids(10), "--max-new-tokens", "40", "--ignore-eos"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(
        e.contains("notice: --max-new-tokens 40 capped to 6: the context is 16 tokens (the model's max_position_embeddings 16) and the prompt takes 10"),
        "{e}"
    );
    assert!(e.contains("decode: 6 tokens"), "{e}");
    // What fits runs without a notice.
    let o = krasis(&["generate", "--model", m, "--prompt-ids", &ids(10), "--max-new-tokens", "6", "--ignore-eos"]);
    assert!(o.status.success() && !stderr(&o).contains("capped"), "{}", stderr(&o));
}

#[test]
fn help_is_current() {
    let top = stdout(&krasis(&["--help"]));
    assert!(!top.contains("is next") && top.contains("hybrid"), "{top}");
    for cmd in ["generate", "serve"] {
        let help = stdout(&krasis(&[cmd, "--help"]));
        let model = flag_help(&help, "--model");
        assert!(model.contains("GGUF") && model.contains("config.json"), "{cmd}: {model}");
        let bits = flag_help(&help, "--gpu-expert-bits");
        assert!(bits.contains("--device gpu") && bits.contains("--device hybrid"), "{cmd}: {bits}");
        let kv = flag_help(&help, "--kv-tokens");
        assert!(kv.contains("CPU"), "{cmd}: {kv}");
    }
    let generate = stdout(&krasis(&["generate", "--help"]));
    let temperature = flag_help(&generate, "--temperature");
    assert!(temperature.contains("--top-k") && temperature.contains("notice"), "{temperature}");
    let max_new = flag_help(&generate, "--max-new-tokens");
    assert!(max_new.contains("capped") && max_new.contains("max_position_embeddings"), "{max_new}");
}

#[test]
fn sampling_flags_at_temperature_zero_get_a_notice() {
    let (_t, dir) = tiny();
    let m = dir.to_str().unwrap();
    let run = |extra: &[&str]| {
        let o =
            krasis(&[&["generate", "--model", m, "--prompt-ids", "5,9,200", "--max-new-tokens", "2"], extra].concat());
        assert!(o.status.success(), "{}", stderr(&o));
        stderr(&o)
    };
    let e = run(&["--top-k", "5", "--seed", "3"]);
    assert!(e.contains("notice: --top-k, --seed do nothing at --temperature 0"), "{e}");
    let e = run(&["--top-p", "0.5"]);
    assert!(e.contains("notice: --top-p does nothing at --temperature 0"), "{e}");
    let e = run(&["--top-k", "5", "--temperature", "0.7"]);
    assert!(!e.contains("notice: --top-k"), "{e}");
    let e = run(&[]);
    assert!(!e.contains("at --temperature 0"), "{e}");
}

#[test]
fn a_small_model_hears_nothing_about_huge_pages() {
    let (_t, dir) = tiny();
    let m = dir.to_str().unwrap();
    let o = krasis(&["generate", "--model", m, "--prompt-ids", "5,9", "--max-new-tokens", "1"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!stderr(&o).contains("hugepages"), "{}", stderr(&o));
    let o = krasis(&["info", "--model", m]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!stdout(&o).contains("hugepages"), "{}", stdout(&o));
}

#[test]
fn bench_auto_says_auto_on_its_device_line() {
    let (_t, dir) = tiny();
    let m = dir.to_str().unwrap();
    let o = krasis(&[
        "bench",
        "--model",
        m,
        "--device",
        "auto",
        "--decode-tokens",
        "2",
        "--prompt-tokens",
        "2",
        "--membw-bytes",
        "16MiB",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    if stderr(&o).contains("running on the CPU") {
        assert!(out.contains("device: cpu (auto: no GPU in use"), "{out}");
        assert!(!out.contains("(as asked)"), "{out}");
    }
}

#[test]
fn convert_says_why_it_built_a_cache() {
    let (_t, dir) = tiny();
    let o = krasis(&["convert", "--model", dir.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let e = stderr(&o);
    // The default's asymmetric INT4 cache is built on its own pass ("built (missing)"); a cache
    // built beside the GPU one reports the pass's reasons ("the CPU expert cache was missing").
    let why = e.contains("the CPU expert cache was missing") || e.contains("expert cache built (missing)");
    assert!(!e.contains("CPU: missing") && why, "{e}");
}

#[test]
fn serve_checks_context_against_the_model_before_the_memory_estimate() {
    let (_t, dir) = tiny();
    let m = dir.to_str().unwrap();
    let o = krasis(&["serve", "--model", m, "--port", "0", "--device", "cpu", "--context", "999999999"]);
    assert_error(&o, "--context 999999999 exceeds the model's max_position_embeddings 163840");
}

#[test]
fn model_path_errors_say_what_a_model_is() {
    let t = tempfile::tempdir().unwrap();
    let empty = t.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    for cmd in ["info", "generate"] {
        let o = krasis(
            &[cmd, "--model", empty.to_str().unwrap(), "--prompt-ids", "1"][..if cmd == "info" { 3 } else { 5 }],
        );
        assert_error(&o, "config.json");
        assert!(stderr(&o).contains("a model is a Hugging Face-style directory holding config.json"), "{}", stderr(&o));
    }
    let (_t, dir) = tiny();
    let config = dir.join("config.json");
    let o = krasis(&["info", "--model", config.to_str().unwrap()]);
    assert_error(&o, "is a file, not a model directory");
    let e = stderr(&o);
    assert!(e.contains(&format!("give its directory {}", dir.display())), "{e}");
    assert!(!e.contains("does not exist"), "{e}");
}
