//! End-to-end: the `krasis` binary on a synthesized tiny model, and its behaviour on bad input
//! (one `error:` line, non-zero exit, never a panic).

use std::path::{Path, PathBuf};
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

/// A fresh temp dir with a synthesized `tiny` model at `<tmp>/tiny`.
fn tiny() -> (tempfile::TempDir, PathBuf) {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("tiny");
    synth_tiny(&dir);
    (t, dir)
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
    let (t, dir) = tiny();
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
    let (_t, dir) = tiny();
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
    assert_clean_failure(
        &krasis(&["generate", "--model", m, "--prompt-ids", "1", "--device", "cpu", "--gpu-expert-bits", "4"]),
        1,
        "--gpu-expert-bits applies",
    );
    let hybrid_bf16 = [
        "generate",
        "--model",
        m,
        "--prompt-ids",
        "1",
        "--device",
        "hybrid",
        "--gpu-expert-bits",
        "4",
        "--cpu-expert-bits",
        "bf16",
    ];
    assert_clean_failure(&krasis(&hybrid_bf16), 1, "give --cpu-expert-bits 4|8");
    assert_clean_failure(
        &krasis(&[
            "generate",
            "--model",
            m,
            "--prompt-ids",
            "1",
            "--device",
            "cpu",
            "--stream-experts-from",
            "gpu-cache",
        ]),
        1,
        "--stream-experts-from applies",
    );
    assert_clean_failure(
        &krasis(&["generate", "--model", m, "--prompt-ids", "1", "--stream-experts-from", "disk"]),
        2,
        "invalid value 'disk'",
    );
    assert_clean_failure(&krasis(&["generate", "--model", m, "--prompt-ids", "1", "--top-p", "0"]), 1, "--top-p");
    assert_clean_failure(&krasis(&["synth", "--preset", "huge", "--out", "/tmp/x"]), 2, "invalid value 'huge'");
    assert_clean_failure(&krasis(&["synth", "--preset", "tiny", "--out", m]), 1, m);
    std::fs::write(dir.join("config.json"), "not json").unwrap();
    assert_clean_failure(&krasis(&["info", "--model", m]), 1, "config.json");
}

fn krasis_env(args: &[&str], env: &[(&str, &str)]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_krasis")).args(args).envs(env.iter().copied()).output().expect("run krasis")
}

#[test]
fn bench_device_auto_falls_back_to_the_cpu() {
    let (_t, dir) = tiny();
    let m = dir.to_str().unwrap();
    let args = ["bench", "--model", m, "--device", "auto", "--decode-tokens", "2", "--prompt-tokens", "2"];
    let o = krasis(&[&args[..], &["--membw-bytes", "16MiB"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("running on the CPU"), "{}", stderr(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("decode 2 tokens"));
}

#[test]
fn negative_numbers_reach_the_flags_own_checks() {
    let (_t, dir) = tiny();
    let m = dir.to_str().unwrap();
    let gen = |flag: &str, v: &str| krasis(&["generate", "--model", m, "--prompt-ids", "1", flag, v]);
    assert_clean_failure(&gen("--temperature", "-1"), 1, "--temperature -1 must be a finite number >= 0");
    assert_clean_failure(&gen("--top-p", "-0.5"), 1, "--top-p -0.5 must be in (0, 1]");
    assert_clean_failure(&gen("--seed", "-1"), 2, "invalid value '-1' for '--seed <SEED>'");
}

#[test]
fn dump_logits_path_is_checked_before_generating() {
    let (t, dir) = tiny();
    let m = dir.to_str().unwrap();
    let out = t.path().join("out");
    std::fs::create_dir(&out).unwrap();
    let before = names(t.path());
    let o = krasis(&["generate", "--model", m, "--prompt-ids", "1,2", "--dump-logits", out.to_str().unwrap()]);
    assert_clean_failure(&o, 1, "is a directory");
    assert!(o.stdout.is_empty() && !stderr(&o).contains("prefill:"), "nothing was generated: {}", stderr(&o));
    assert_eq!(names(t.path()), before, "no temp file beside the directory");
    let missing = t.path().join("no/such/dir/l.safetensors");
    let o = krasis(&["generate", "--model", m, "--prompt-ids", "1,2", "--dump-logits", missing.to_str().unwrap()]);
    assert_clean_failure(&o, 1, "does not exist");
    assert!(o.stdout.is_empty());
    // A plain file name lands in the working directory, with no temp file left.
    let o = Command::new(env!("CARGO_BIN_EXE_krasis"))
        .args(["generate", "--model", m, "--prompt-ids", "1,2", "--max-new-tokens", "2", "--dump-logits", "l.st"])
        .current_dir(&out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(names(&out), vec!["l.st".to_string()]);
}

#[test]
fn heatmap_out_writes_the_counts_and_checks_its_path_first() {
    let (t, dir) = tiny();
    let m = dir.to_str().unwrap();
    let missing = t.path().join("no/such/dir/h.json");
    let o = krasis(&["generate", "--model", m, "--prompt-ids", "1,2", "--heatmap-out", missing.to_str().unwrap()]);
    assert_clean_failure(&o, 1, "--heatmap-out");
    assert!(o.stdout.is_empty() && !stderr(&o).contains("prefill:"), "nothing was generated: {}", stderr(&o));
    let out = t.path().join("heat.json");
    let o = krasis(&[
        "generate",
        "--model",
        m,
        "--prompt-ids",
        "1,2,3,4",
        "--max-new-tokens",
        "3",
        "--heatmap-out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("expert heatmap of 6 tokens written to"), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    assert_eq!(v["format"], "krasis-expert-heatmap");
    assert_eq!(v["tokens"], 6);
    let (k, counts) = (v["top_k"].as_u64().unwrap(), v["counts"].as_array().unwrap());
    assert_eq!(counts.len() as u64, v["layers"].as_u64().unwrap());
    let sums: Vec<u64> =
        counts.iter().map(|r| r.as_array().unwrap().iter().map(|c| c.as_u64().unwrap()).sum()).collect();
    assert!(sums.iter().all(|&s| s == 0 || s == 6 * k) && sums.contains(&(6 * k)), "{sums:?}");
}

#[test]
fn cache_strategy_needs_a_heatmap_and_the_hybrid_gpu_experts() {
    let (t, dir) = tiny();
    let m = dir.to_str().unwrap();
    let heat = t.path().join("heat.json");
    let heat = heat.to_str().unwrap();
    // The pinning strategies need their heatmap; the others take none; the heatmap and the VRAM
    // need a strategy.
    for strategy in ["hot_cached_static", "static_pin", "weighted_pin"] {
        let o = krasis(&["generate", "--model", m, "--prompt-ids", "1,2", "--cache-strategy", strategy]);
        assert_clean_failure(&o, 1, "needs --heatmap-path");
    }
    for strategy in ["active_only", "lru", "chunked"] {
        let o = krasis(&[
            "generate",
            "--model",
            m,
            "--prompt-ids",
            "1,2",
            "--cache-strategy",
            strategy,
            "--heatmap-path",
            heat,
        ]);
        assert_clean_failure(&o, 1, "drop --heatmap-path");
    }
    let o = krasis(&["generate", "--model", m, "--prompt-ids", "1,2", "--heatmap-path", heat]);
    assert_clean_failure(&o, 1, "go with --cache-strategy");
    let o = krasis(&["generate", "--model", m, "--prompt-ids", "1,2", "--pin-vram", "1GiB"]);
    assert_clean_failure(&o, 1, "go with --cache-strategy");
    let o = krasis(&["generate", "--model", m, "--prompt-ids", "1,2", "--cache-strategy", "mru"]);
    assert_clean_failure(&o, 2, "lru");
    for device in ["cpu", "gpu", "auto"] {
        let o =
            krasis(&["generate", "--model", m, "--prompt-ids", "1,2", "--device", device, "--cache-strategy", "lru"]);
        assert_clean_failure(&o, 1, "--cache-strategy lru needs --device hybrid and --gpu-expert-bits");
    }
    // Pinning is a hybrid engine's, on its GPU expert layout.
    for device in ["cpu", "gpu", "auto"] {
        let o = krasis(&[
            "generate",
            "--model",
            m,
            "--prompt-ids",
            "1,2",
            "--device",
            device,
            "--cache-strategy",
            "hot_cached_static",
            "--heatmap-path",
            heat,
        ]);
        assert_clean_failure(&o, 1, "--device hybrid and --gpu-expert-bits");
    }
}

#[test]
fn tune_needs_a_gpu_and_its_file_is_taken_only_where_it_was_measured() {
    let (t, dir) = tiny();
    let m = dir.to_str().unwrap();
    if krasis_gpu::probe().is_ok() {
        eprintln!("SKIPPED: a GPU is present; this test checks the no-GPU behaviour (the device runs tune itself)");
        return;
    }
    let o = krasis(&["tune", "--model", m, "--prompt-tokens", "8", "--decode-tokens", "2"]);
    assert_clean_failure(&o, 1, "krasis tune compares where the routed experts live on a GPU");
    // A tune file in the cache dir: another model's is left alone, a damaged one is a warning,
    // and this model's needs the GPU it was measured on; generation goes on with --device auto.
    let cache = t.path().join("cache");
    std::fs::create_dir_all(&cache).unwrap();
    let fp = format!("{:016x}", krasis_model::source::files::ModelFiles::open(&dir).unwrap().fingerprint());
    let file = |fingerprint: &str| {
        serde_json::json!({
            "format": "krasis-tune", "version": 1, "fingerprint": fingerprint, "gpu": "NVIDIA H200",
            "vram_budget": "Auto", "prompt_tokens": 10240, "decode_tokens": 64, "runs": 3, "measured_at": 0,
            "choice": { "name": "layer_grouped", "device": "hybrid", "gpu_expert_bits": 4, "cpu_expert_bits": "4",
                        "heatmap_path": null, "pin_vram": null },
            "table": []
        })
        .to_string()
    };
    let cache_dir = cache.to_str().unwrap();
    let gen = |extra: &[&str]| {
        let mut args =
            vec!["generate", "--model", m, "--prompt-ids", "1,2", "--max-new-tokens", "2", "--cache-dir", cache_dir];
        args.extend_from_slice(extra);
        krasis(&args)
    };
    for (content, says) in [
        (file("0000000000000000"), "is for another model"),
        ("{ not json".to_string(), "not a krasis tune file"),
        (file(&fp), "not used: no GPU"),
    ] {
        std::fs::write(cache.join("tune.json"), content).unwrap();
        let o = gen(&[]);
        assert!(o.status.success(), "{}", stderr(&o));
        assert!(stderr(&o).contains(says), "stderr lacks {says:?}: {}", stderr(&o));
    }
    // An explicit --device never reads it.
    let o = gen(&["--device", "cpu"]);
    assert!(o.status.success() && !stderr(&o).contains("tune"), "{}", stderr(&o));
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> =
        std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    v.sort();
    v
}

#[test]
fn cache_dir_errors_say_what_and_suggest_the_flag() {
    let (t, dir) = tiny();
    let m = dir.to_str().unwrap();
    let file = t.path().join("plainfile");
    std::fs::write(&file, b"x").unwrap();
    let bad = file.join("cache");
    fn gen<'a>(m: &'a str, cache: &'a str) -> Vec<&'a str> {
        let args = ["generate", "--model", m, "--prompt-ids", "1,2", "--max-new-tokens", "1", "--device", "cpu"];
        [&args[..], &["--cpu-expert-bits", "4", "--cache-dir", cache]].concat()
    }
    let o = krasis(&gen(m, bad.to_str().unwrap()));
    assert_clean_failure(&o, 1, "cannot create the expert cache directory");
    let e = stderr(&o);
    assert!(e.contains("--cache-dir") && e.matches("os error").count() == 1, "{e}");

    // A damaged cache that cannot be rebuilt (here: writes beyond 64 KiB fail, which holds for
    // root too, unlike a read-only directory) is reported as damaged, not as a bare I/O error.
    let cache = t.path().join("cache");
    let o = krasis(&gen(m, cache.to_str().unwrap()));
    assert!(o.status.success(), "{}", stderr(&o));
    let file = cache.join("experts_cpu_int4_g128.bin");
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[0] ^= 0xff;
    std::fs::write(&file, bytes).unwrap();
    let o = small_files_only(Command::new(env!("CARGO_BIN_EXE_krasis")).args(gen(m, cache.to_str().unwrap())));
    assert_clean_failure(&o, 1, "was found damaged");
    assert!(stderr(&o).contains("rebuilding it failed") && stderr(&o).contains("--cache-dir"), "{}", stderr(&o));
}

/// Runs `cmd` with writes past 64 KiB failing (`EFBIG`) instead of succeeding.
fn small_files_only(cmd: &mut Command) -> Output {
    use std::os::unix::process::CommandExt;
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            let lim = libc::rlimit { rlim_cur: 64 << 10, rlim_max: 64 << 10 };
            libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
            if libc::setrlimit(libc::RLIMIT_FSIZE, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd.output().expect("run krasis")
}

#[test]
fn convert_offers_only_what_it_accepts_and_threads_are_capped_aloud() {
    let o = krasis(&["convert", "--help"]);
    let help = String::from_utf8_lossy(&o.stdout);
    assert!(help.contains("[possible values: auto, 4, 4a, 8, none]") && !help.contains("bf16"), "{help}");
    assert_clean_failure(
        &krasis(&["convert", "--model", "/x", "--cpu-expert-bits", "bf16"]),
        2,
        "invalid value 'bf16'",
    );

    let (_t, dir) = tiny();
    let m = dir.to_str().unwrap();
    let o = krasis(&["generate", "--model", m, "--prompt-ids", "1", "--max-new-tokens", "1", "--threads", "100000"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stderr(&o).matches("--threads 100000 is more than the").count(), 1, "{}", stderr(&o));

    // `auto` (the default) on safetensors is asymmetric INT4 g32 on the CPU engine: generate built
    // its expert cache (and the INT8 dense one) on first use, and convert, with no GPU in use,
    // finds it there.
    assert!(stderr(&o).contains("routed experts: cpu INT4 asymmetric g32"), "{}", stderr(&o));
    let experts =
        || names(&dir.join(".krasis_cache")).into_iter().filter(|n| n.starts_with("experts_")).collect::<Vec<_>>();
    assert_eq!(experts(), vec!["experts_cpu_int4a_g32.bin".to_string()]);
    let o = krasis(&["convert", "--model", m]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("routed experts on the CPU: int4a g32 (asymmetric)"), "{}", stderr(&o));
    assert!(stderr(&o).contains("expert cache hit"), "{}", stderr(&o));
    assert_eq!(experts(), vec!["experts_cpu_int4a_g32.bin".to_string()]);
    // `4`: INT4 g128 (the hybrid's) beside it.
    let o = krasis(&["convert", "--model", m, "--cpu-expert-bits", "4"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("routed experts on the CPU: int4"), "{}", stderr(&o));
    let both = ["experts_cpu_int4_g128.bin", "experts_cpu_int4a_g32.bin"].map(String::from).to_vec();
    assert_eq!(experts(), both);
    // The GPU expert cache alone (no GPU needed to build it); nothing asked is an error.
    let o = krasis(&["convert", "--model", m, "--cpu-expert-bits", "none", "--gpu-expert-bits", "8"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("the GPU expert cache was missing"), "{}", stderr(&o));
    assert_eq!(experts(), [both, vec!["experts_gpu_int8_g128.bin".to_string()]].concat());
    assert_clean_failure(&krasis(&["convert", "--model", m, "--cpu-expert-bits", "none"]), 1, "nothing to build");
}

#[test]
fn info_checks_that_the_weights_are_there_and_whole() {
    let (_t, dir) = tiny();
    let m = dir.to_str().unwrap();
    let o = krasis(&["info", "--model", m]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("headers, sizes and tensor names check out"));

    let weights = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .expect("a weight file");
    let bytes = std::fs::read(&weights).unwrap();
    std::fs::write(&weights, &bytes[..bytes.len() - 100]).unwrap();
    assert_clean_failure(&krasis(&["info", "--model", m]), 1, "truncated");
    assert!(krasis(&["info", "--model", m]).stdout.is_empty(), "no report on broken weights");
    std::fs::remove_file(&weights).unwrap();
    assert_clean_failure(&krasis(&["info", "--model", m]), 1, "No such file");
    std::fs::remove_file(dir.join("model.safetensors.index.json")).unwrap();
    assert_clean_failure(&krasis(&["info", "--model", m]), 1, "no *.safetensors weight files");
}

#[test]
fn every_flag_is_described_in_help() {
    for cmd in ["generate", "synth", "info", "convert", "bench"] {
        let o = krasis(&[cmd, "--help"]);
        let help = String::from_utf8_lossy(&o.stdout);
        let lines: Vec<&str> = help.lines().collect();
        for (i, l) in lines.iter().enumerate() {
            let l = l.trim();
            if !l.starts_with('-') {
                continue;
            }
            // The description follows the flag on its line (short help) or on the next (long help).
            let text = match l.split_once("  ") {
                Some((_, inline)) => inline.trim_start(),
                None => lines.get(i + 1).map_or("", |n| n.trim_start()),
            };
            assert!(
                !text.is_empty() && !text.starts_with('-') && !text.starts_with('['),
                "{cmd}: {l} has no description"
            );
        }
    }
    let bench = String::from_utf8_lossy(&krasis(&["bench", "--help"]).stdout).into_owned();
    assert!(bench.contains("(default 2 GiB)") && !bench.contains("2147483648") && bench.contains("GPU"), "{bench}");
    let top = String::from_utf8_lossy(&krasis(&["--help"]).stdout).into_owned();
    assert!(!top.contains("GPU prefill, CPU decode\n"), "{top}");
}

#[test]
fn library_logs_keep_the_cli_format_and_honour_rust_log() {
    let o = krasis_env(&["bench", "--membw", "--membw-bytes", "1MiB"], &[("KRASIS_ISA", "bogus")]);
    assert!(o.status.success(), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(e.contains("warning: KRASIS_ISA=\"bogus\" is not one of scalar|avx2|avx512"), "{e}");
    assert!(!e.contains("debug"), "{e}");
    let o = krasis_env(&["bench", "--membw", "--membw-bytes", "1MiB"], &[("RUST_LOG", "krasis_cpu=debug")]);
    assert!(stderr(&o).contains("debug krasis_cpu::isa: kernels use"), "{}", stderr(&o));
}

/// The library's messages name its options (`SynthOptions::force`); the CLI prints them as the
/// flags that set them, and never the library's name for them.
#[test]
fn library_messages_show_the_cli_flags() {
    let (t, dir) = tiny();
    let m = dir.to_str().unwrap();
    let no_library_names = |o: &Output| {
        let e = stderr(o);
        assert!(!e.contains("SynthOptions::") && !e.contains("GenerateRequest::") && !e.contains('`'), "{e}");
    };
    // A non-empty output directory without --force.
    let o = krasis(&["synth", "--preset", "tiny", "--layers", "2", "--out", m]);
    assert_clean_failure(&o, 1, "overwrite the model files in it (--force)");
    no_library_names(&o);
    // A layer count the preset does not have.
    let out = t.path().join("deep");
    let o = krasis(&["synth", "--preset", "tiny", "--layers", "99", "--out", out.to_str().unwrap()]);
    assert_clean_failure(&o, 1, "the layer count (--layers) 99 is out of range");
    no_library_names(&o);
    // Text without a tokenizer.
    std::fs::remove_file(dir.join("tokenizer.json")).unwrap();
    let o = krasis(&["generate", "--model", m, "--prompt", "hi", "--max-new-tokens", "1", "--device", "cpu"]);
    assert_clean_failure(&o, 1, "(give the prompt as token ids, --prompt-ids, to bypass the tokenizer)");
    no_library_names(&o);
}
