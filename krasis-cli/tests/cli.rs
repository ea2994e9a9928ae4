//! End-to-end: the `krasis` binary on a synthesized tiny model, and its behaviour on bad input
//! (one `error:` line, non-zero exit, never a panic).

use std::path::Path;
use std::process::{Command, Output};

fn krasis(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_krasis")).args(args).output().expect("run krasis")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn assert_clean_failure(o: &Output, code: i32, needle: &str) {
    let e = stderr(o);
    assert_eq!(o.status.code(), Some(code), "exit code; stderr: {e}");
    assert!(!e.contains("panicked"), "panic: {e}");
    assert!(e.contains(needle), "stderr lacks {needle:?}: {e}");
}

fn synth_tiny(dir: &Path) {
    let o = krasis(&["synth", "--preset", "tiny", "--layers", "2", "--out", dir.to_str().unwrap(), "--force"]);
    assert!(o.status.success(), "synth failed: {}", stderr(&o));
}

/// Read one F32/I64 tensor's shape and raw bytes from a small safetensors file.
fn read_tensor(file: &Path, name: &str) -> (Vec<usize>, Vec<u8>) {
    let b = std::fs::read(file).unwrap();
    let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
    let h: serde_json::Value = serde_json::from_slice(&b[8..8 + n]).unwrap();
    let t = &h[name];
    let shape = t["shape"].as_array().unwrap().iter().map(|d| d.as_u64().unwrap() as usize).collect();
    let o = t["data_offsets"].as_array().unwrap();
    let (s, e) = (o[0].as_u64().unwrap() as usize, o[1].as_u64().unwrap() as usize);
    (shape, b[8 + n + s..8 + n + e].to_vec())
}

#[test]
fn synth_generate_info_and_dump_logits() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("tiny");
    synth_tiny(&dir);
    let m = dir.to_str().unwrap();

    let o = krasis(&["generate", "--model", m, "--prompt", "Hello there", "--max-new-tokens", "8", "--ignore-eos"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!o.stdout.is_empty());
    let e = stderr(&o);
    assert!(e.contains("prefill:") && e.contains("tok/s"), "timings go to stderr: {e}");
    assert!(e.contains("running on the CPU"), "auto falls back with a notice: {e}");
    assert!(e.contains("device: cpu (auto: no GPU in use"), "one line says which device and why: {e}");

    // Sampled generation with a logits dump; the same seed reproduces the same tokens.
    let sampled = |dump: &Path| {
        let o = krasis(&[
            "generate",
            "--model",
            m,
            "--prompt-ids",
            "5,9,200,3",
            "--max-new-tokens",
            "5",
            "--ignore-eos",
            "--device",
            "cpu",
            "--temperature",
            "0.7",
            "--top-k",
            "20",
            "--top-p",
            "0.9",
            "--seed",
            "4",
            "--dump-logits",
            dump.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
    };
    let dump = t.path().join("logits.safetensors");
    sampled(&dump);
    let (ps, pre) = read_tensor(&dump, "prefill_logits");
    let (ss, steps) = read_tensor(&dump, "step_logits");
    let (is, ids) = read_tensor(&dump, "generated_ids");
    assert_eq!(ps[0], 4);
    assert_eq!(ss, vec![5, ps[1]]);
    assert_eq!(is, vec![5]);
    assert_eq!(ids.len(), 5 * 8);
    let v = ps[1] * 4;
    assert_eq!(&steps[..v], &pre[3 * v..4 * v], "step_logits[0] is the last prompt position's");
    let dump2 = t.path().join("logits2.safetensors");
    sampled(&dump2);
    assert_eq!(read_tensor(&dump2, "generated_ids").1, ids);

    let o = krasis(&["generate", "--model", m, "--prompt", "Hi", "--chat", "--max-new-tokens", "3"]);
    assert!(o.status.success(), "{}", stderr(&o));

    let o = krasis(&["info", "--model", m]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("deepseek_v2") && out.contains("active per token") && out.contains("int4"), "{out}");
}

#[test]
fn bad_input_fails_cleanly() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("tiny");
    synth_tiny(&dir);
    let m = dir.to_str().unwrap();
    assert_clean_failure(&krasis(&["generate", "--model", "/nonexistent/m", "--prompt-ids", "1"]), 1, "/nonexistent/m");
    assert_clean_failure(
        &krasis(&["generate", "--model", m, "--prompt-ids", "1", "--device", "tpu"]),
        2,
        "invalid value 'tpu'",
    );
    assert_clean_failure(
        &krasis(&["generate", "--model", m, "--prompt-ids", "1", "--cpu-expert-bits", "3"]),
        2,
        "invalid value '3'",
    );
    assert_clean_failure(&krasis(&["generate", "--model", m, "--prompt-ids", "1,x"]), 2, "invalid value");
    assert_clean_failure(&krasis(&["generate", "--model", m, "--prompt-ids", "1,999999"]), 1, "outside the vocabulary");
    assert_clean_failure(
        &krasis(&["generate", "--model", m, "--prompt-ids", "1", "--device", "gpu"]),
        1,
        "--device gpu",
    );
    assert_clean_failure(
        &krasis(&["generate", "--model", m, "--prompt-ids", "1", "--device", "hybrid"]),
        1,
        "--device hybrid",
    );
    assert_clean_failure(&krasis(&["generate", "--model", m, "--prompt-ids", "1", "--top-p", "0"]), 1, "--top-p");
    assert_clean_failure(&krasis(&["synth", "--preset", "huge", "--out", "/tmp/x"]), 2, "invalid value 'huge'");
    assert_clean_failure(&krasis(&["synth", "--preset", "tiny", "--out", m]), 1, m);
    std::fs::write(dir.join("config.json"), "not json").unwrap();
    assert_clean_failure(&krasis(&["info", "--model", m]), 1, "config.json");
}
