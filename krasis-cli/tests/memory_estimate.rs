//! Issue #38 item 6: the resident set after a CPU run stays near the memory estimate at several
//! prompt lengths. Before the fix the INT8 kernels' per-matrix buffers kept a long prompt's size
//! for the process's life: the tiny preset held 77 MiB after a 2048-token prompt against its
//! 23 MiB estimate (+230 %, on a CPU without AMX, where prefill runs on those kernels), and the
//! warning asked the user to report it.
//!
//! Each run is its own `krasis generate` process, so the RSS it reports is its own. The bound
//! here (25 %) is looser than the warning's 10 % so that a debug build's larger code and a busy
//! machine do not make it flaky; the regression it guards against is of order 100 %. The
//! figures at each size are printed.

use std::process::Command;

/// Mebibytes in a "… 12.3 MiB …" figure following `after` in `line`.
fn mib_after(line: &str, after: &str) -> Option<f64> {
    let rest = &line[line.find(after)? + after.len()..];
    let num: String = rest.trim_start().chars().take_while(|c| c.is_ascii_digit() || *c == '.').collect();
    let v: f64 = num.parse().ok()?;
    let unit = rest.trim_start()[num.len()..].trim_start();
    Some(if unit.starts_with("GiB") { v * 1024.0 } else { v })
}

/// (RSS, estimate) in MiB from the run's memory line, whichever form it took.
fn rss_and_estimate(stderr: &str) -> Option<(f64, f64)> {
    for line in stderr.lines() {
        if line.starts_with("memory: RSS") {
            return Some((mib_after(line, "RSS")?, mib_after(line, "of the estimate")?));
        }
        if line.contains("measured RSS") {
            return Some((mib_after(line, "measured RSS")?, mib_after(line, "the estimate of")?));
        }
    }
    None
}

#[test]
fn rss_after_a_cpu_run_stays_near_the_estimate_at_several_prompt_lengths() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("tiny");
    let m = dir.to_str().unwrap();
    let krasis = |args: &[&str]| Command::new(env!("CARGO_BIN_EXE_krasis")).args(args).output().expect("run krasis");
    let o = krasis(&["synth", "--preset", "tiny", "--out", m]);
    assert!(o.status.success(), "synth: {}", String::from_utf8_lossy(&o.stderr));
    for n in [16usize, 512, 2048] {
        let ids: Vec<String> = (0..n).map(|i| ((i * 7919) % 502 + 5).to_string()).collect();
        let ids = ids.join(",");
        for extra in [&[][..], &["--cpu-dense-bits", "bf16"][..]] {
            let mut args = vec!["generate", "--model", m, "--device", "cpu", "--prompt-ids", &ids];
            args.extend_from_slice(&["--max-new-tokens", "4"]);
            args.extend_from_slice(extra);
            let o = krasis(&args);
            let e = String::from_utf8_lossy(&o.stderr);
            assert!(o.status.success(), "generate {n} tokens {extra:?}: {e}");
            let (rss, est) =
                rss_and_estimate(&e).unwrap_or_else(|| panic!("no memory line for {n} tokens {extra:?}: {e}"));
            let dev = rss / est - 1.0;
            eprintln!("{n} tokens {extra:?}: RSS {rss:.1} MiB, estimate {est:.1} MiB ({:+.1} %)", 100.0 * dev);
            assert!(dev.abs() <= 0.25, "{n} tokens {extra:?}: RSS {rss:.1} MiB against the estimate {est:.1} MiB");
        }
    }
}

#[test]
fn memory_lines_parse() {
    assert_eq!(
        rss_and_estimate("memory: RSS 24.9 MiB within 10% of the estimate 22.8 MiB for 2052 tokens of context"),
        Some((24.9, 22.8))
    );
    let warn = "warning: measured RSS 1.05 GiB is 44.3% above the estimate of 742.9 MiB (tolerance 10%); …";
    assert_eq!(rss_and_estimate(warn), Some((1.05 * 1024.0, 742.9)));
    assert_eq!(rss_and_estimate("nothing here"), None);
}
