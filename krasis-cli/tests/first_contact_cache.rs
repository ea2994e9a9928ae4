//! Issue #37 ("First contact, round two"), the caches: a rewrite of the weights in place is never
//! served from the old caches, `synth --force` clears the replaced model's caches, the reference
//! path leaves no cache directory behind, and an interrupted cache build leaves no partial file.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn krasis(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_krasis")).args(args).output().expect("run krasis")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn ok(o: Output) -> Output {
    assert!(o.status.success(), "krasis failed: {}", stderr(&o));
    o
}

fn synth(dir: &Path, preset: &str, layers: &str, seed: &str) -> Output {
    ok(krasis(&[
        "synth",
        "--preset",
        preset,
        "--layers",
        layers,
        "--seed",
        seed,
        "--out",
        dir.to_str().unwrap(),
        "--force",
    ]))
}

/// Greedy generation of 4 tokens on the CPU with INT4 experts and INT8 dense weights (both cached).
fn generate_cached(dir: &Path) -> Output {
    let m = dir.to_str().unwrap();
    let args = ["--prompt-ids", "5,9,200,3", "--max-new-tokens", "4", "--ignore-eos", "--device", "cpu"];
    let mut all = vec!["generate", "--model", m, "--cpu-expert-bits", "4", "--cpu-dense-bits", "8"];
    all.extend_from_slice(&args);
    ok(krasis(&all))
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> =
        std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    v.sort();
    v
}

#[test]
fn a_rewrite_of_the_weights_in_place_rebuilds_both_caches() {
    let t = tempfile::tempdir().unwrap();
    let (dir, other) = (t.path().join("tiny"), t.path().join("seed7"));
    synth(&dir, "tiny", "2", "0");
    synth(&other, "tiny", "2", "7");
    let e = stderr(&generate_cached(&dir));
    assert!(e.contains("expert cache built") && e.contains("dense-weight cache built"), "{e}");
    let e = stderr(&generate_cached(&dir));
    assert!(e.contains("expert cache hit") && e.contains("dense-weight cache hit"), "{e}");

    // The seed-7 weights copied over the seed-0 ones: same sizes, same header; even the old
    // mtime put back, so only the bytes differ. The caches stay where they were.
    let weights = dir.join("model-00001-of-00001.safetensors");
    let mtime = std::fs::metadata(&weights).unwrap().modified().unwrap();
    let (old, new) =
        (std::fs::read(&weights).unwrap(), std::fs::read(other.join("model-00001-of-00001.safetensors")).unwrap());
    let header_len = 8 + u64::from_le_bytes(old[..8].try_into().unwrap()) as usize;
    assert_eq!(old.len(), new.len());
    assert_eq!(old[..header_len], new[..header_len], "same header");
    assert_ne!(old, new);
    std::fs::write(&weights, &new).unwrap();
    std::fs::File::options().write(true).open(&weights).unwrap().set_modified(mtime).unwrap();

    let rewritten = generate_cached(&dir);
    let e = stderr(&rewritten);
    assert!(!e.contains("cache hit"), "a cache of the old weights was used: {e}");
    assert!(e.contains("expert cache built (stale: config_hash differs"), "{e}");
    assert!(e.contains("dense-weight cache built (stale: config_hash differs"), "{e}");
    // What it generates is what the seed-7 model generates.
    assert_eq!(rewritten.stdout, generate_cached(&other).stdout);
}

#[test]
fn synth_force_clears_the_replaced_models_caches() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("tiny");
    synth(&dir, "tiny", "2", "0");
    ok(krasis(&["convert", "--model", dir.to_str().unwrap(), "--cpu-dense-bits", "8"]));
    assert_eq!(names(&dir.join(".krasis_cache")).len(), 2, "expert and dense-weight caches built");
    let e = stderr(&synth(&dir, "tiny", "2", "7"));
    assert!(!dir.join(".krasis_cache").exists(), "synth --force kept the old model's caches");
    assert!(
        e.contains(&format!("removed the caches of the replaced model: {}", dir.join(".krasis_cache").display())),
        "{e}"
    );
    // Nothing to clear the next time: no line about it.
    assert!(!stderr(&synth(&dir, "tiny", "2", "8")).contains("removed the caches"));
}

#[test]
fn the_reference_path_creates_no_cache_directory() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("tiny");
    synth(&dir, "tiny", "2", "0");
    let m = dir.to_str().unwrap();
    let reference = ["--cpu-expert-bits", "bf16", "--cpu-dense-bits", "bf16"];
    let o = ok(krasis(
        &[&["generate", "--model", m, "--prompt-ids", "1,2", "--max-new-tokens", "2"][..], &reference].concat(),
    ));
    assert!(stderr(&o).contains("routed experts: reference"), "{}", stderr(&o));
    ok(krasis(
        &[
            &["generate", "--model", m, "--prompt-ids", "1,2", "--max-new-tokens", "2", "--device", "cpu"][..],
            &reference,
        ]
        .concat(),
    ));
    ok(krasis(&["info", "--model", m]));
    assert!(!dir.join(".krasis_cache").exists(), "created: {:?}", names(&dir));
}

/// Starts `krasis args`, waits until a `*.tmp.<pid>` file appears in `cache`, sends `signal`,
/// and returns the exit code, stderr and the temp file seen.
fn interrupt_build(args: &[&str], cache: &Path, signal: libc::c_int) -> (Option<i32>, String, PathBuf) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_krasis"))
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start krasis");
    let pattern = format!(".tmp.{}", child.id());
    let deadline = Instant::now() + Duration::from_secs(120);
    let tmp = loop {
        let found = std::fs::read_dir(cache)
            .ok()
            .and_then(|rd| rd.flatten().map(|e| e.path()).find(|p| p.to_string_lossy().ends_with(&pattern)));
        if let Some(p) = found {
            break p;
        }
        if let Some(status) = child.try_wait().unwrap() {
            let mut e = String::new();
            std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut e).unwrap();
            panic!("krasis ended ({status}) before a temp file appeared in {}: {e}", cache.display());
        }
        assert!(Instant::now() < deadline, "no temp file appeared in {}", cache.display());
        std::thread::sleep(Duration::from_millis(2));
    };
    // SAFETY: sending a signal to our own child process.
    assert_eq!(unsafe { libc::kill(child.id() as libc::pid_t, signal) }, 0);
    let o = child.wait_with_output().unwrap();
    (o.status.code(), stderr(&o), tmp)
}

#[test]
fn an_interrupted_cache_build_removes_its_partial_files_and_says_so() {
    let t = tempfile::tempdir().unwrap();
    // v2-lite, 2 layers: one MoE layer of 64 experts (1.1 GB of BF16 experts), whose build takes
    // seconds, so the signal arrives while the temp file is being written.
    let dir = t.path().join("v2-lite");
    synth(&dir, "v2-lite", "2", "0");
    let (m, cache) = (dir.to_str().unwrap(), t.path().join("cache"));
    let c = cache.to_str().unwrap();

    for (args, signal, code, word) in [
        (vec!["convert", "--model", m, "--cpu-expert-bits", "4", "--cache-dir", c], libc::SIGINT, 130, "interrupted"),
        (
            vec![
                "generate",
                "--model",
                m,
                "--cpu-expert-bits",
                "4",
                "--prompt-ids",
                "1",
                "--max-new-tokens",
                "1",
                "--device",
                "cpu",
                "--cache-dir",
                c,
            ],
            libc::SIGTERM,
            143,
            "terminated",
        ),
    ] {
        let (status, e, tmp) = interrupt_build(&args, &cache, signal);
        assert_eq!(status, Some(code), "{args:?}: {e}");
        assert!(!e.contains("panicked"), "{e}");
        assert!(e.contains(&format!("{word}: removed the partial cache file(s) {}", tmp.display())), "{args:?}: {e}");
        let left: Vec<String> = names(&cache).into_iter().filter(|n| n.contains(".tmp.")).collect();
        assert!(left.is_empty(), "{args:?} left {left:?}");
        assert!(!cache.join("experts_cpu_int4_g128.bin").exists(), "no cache was finished");
    }
}
