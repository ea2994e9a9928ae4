//! What `cargo xtask test` counts in `cargo test`'s output: the harness's `test result:` lines
//! (one per test binary) and the `*** SKIPPED` lines of tests that passed having checked nothing
//! (no fixtures, no GPU, ...), which the harness itself counts as passed.

use std::collections::BTreeMap;

/// Why a check skipped, from the words of its `*** SKIPPED` line. The first rule whose needle
/// the line contains names the reason; a line no rule matches counts as `other`.
const REASONS: &[(&str, &[&str])] = &[
    ("no fixtures", &["fixtures not found", "make-gguf-fixtures", "fixtures at"]),
    ("no GPU", &["no GPU"]),
    ("no NVRTC", &["libnvrtc"]),
    ("no AMX", &["AMX"]),
    ("no openai package", &["openai"]),
    ("no Q4_K_M file (llama-quantize)", &["llama-quantize"]),
];

/// Skip lines kept per reason for the details printed above the summary line.
const EXAMPLES_PER_REASON: usize = 3;

#[derive(Default)]
pub struct Tally {
    pub passed: u64,
    pub failed: u64,
    pub ignored: u64,
    /// Test binaries that reported a result.
    pub binaries: u64,
    /// Skip count and the first few skip lines, per reason.
    skips: BTreeMap<&'static str, (u64, Vec<String>)>,
}

/// `line` without ANSI colour sequences (`ESC [ ... letter`).
fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            if chars.next() == Some('[') {
                for d in chars.by_ref() {
                    if d.is_ascii_alphabetic() {
                        break;
                    }
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// Whether `cargo test` arguments select packages themselves (`-p`, `--package`), before any
/// `--` that starts the test binaries' own arguments.
pub fn picks_packages(args: &[&str]) -> bool {
    args.iter()
        .take_while(|a| **a != "--")
        .any(|a| *a == "--package" || a.starts_with("--package=") || a.starts_with("-p"))
}

pub fn skip_reason(line: &str) -> &'static str {
    REASONS.iter().find(|(_, needles)| needles.iter().any(|n| line.contains(n))).map_or("other", |(r, _)| r)
}

impl Tally {
    /// Counts one line of cargo's or a test binary's output.
    pub fn line(&mut self, raw: &str) {
        let line = strip_ansi(raw);
        let line = line.trim_end();
        if let Some(rest) = line.trim_start().strip_prefix("test result:") {
            // `test result: ok. 5 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out; ...`
            self.binaries += 1;
            let counts = rest.split_once('.').map_or(rest, |(_, c)| c);
            for part in counts.split(';') {
                let mut words = part.split_whitespace();
                let (Some(n), Some(what)) = (words.next(), words.next()) else { continue };
                let Ok(n) = n.parse::<u64>() else { continue };
                match what {
                    "passed" => self.passed += n,
                    "failed" => self.failed += n,
                    "ignored" => self.ignored += n,
                    _ => {}
                }
            }
        } else if let Some(at) = line.find("*** SKIPPED") {
            let skip = &line[at..];
            let entry = self.skips.entry(skip_reason(skip)).or_default();
            entry.0 += 1;
            if entry.1.len() < EXAMPLES_PER_REASON {
                entry.1.push(skip.to_string());
            }
        }
    }

    pub fn skipped(&self) -> u64 {
        self.skips.values().map(|(n, _)| n).sum()
    }

    /// Per reason: how many checks skipped and the first few skip lines (each was also printed
    /// where it happened).
    pub fn skip_details(&self) -> Vec<String> {
        let mut out = Vec::new();
        for (reason, (n, examples)) in &self.skips {
            out.push(format!("skipped ({reason}): {n}, for example"));
            out.extend(examples.iter().map(|e| format!("  {e}")));
        }
        out
    }

    /// `summary: 812 passed, 0 failed, 3 ignored; 166 checks skipped at run time (no fixtures:
    /// 150, no GPU: 16)`.
    pub fn summary_line(&self) -> String {
        let mut s = format!("summary: {} passed, {} failed, {} ignored; ", self.passed, self.failed, self.ignored);
        s += &format!("{} checks skipped at run time", self.skipped());
        if !self.skips.is_empty() {
            let by: Vec<String> = self.skips.iter().map(|(r, (n, _))| format!("{r}: {n}")).collect();
            s += &format!(" ({})", by.join(", "));
        }
        if self.binaries == 0 {
            s += "; no test binary reported a result";
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tally(lines: &[&str]) -> Tally {
        let mut t = Tally::default();
        for l in lines {
            t.line(l);
        }
        t
    }

    #[test]
    fn result_lines_add_up_over_binaries() {
        let t = tally(&[
            "test result: ok. 5 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out; finished in 0.01s\n",
            "test result: FAILED. 3 passed; 2 failed; 0 ignored; 0 measured; 0 filtered out; finished in 1.20s\n",
            "test result: \u{1b}[32mok\u{1b}[0m. 10 passed; 0 failed; 4 ignored; 0 measured; 0 filtered out\n",
            "test some_test ... ok\n",
        ]);
        assert_eq!((t.passed, t.failed, t.ignored, t.binaries), (18, 2, 5, 3));
        assert_eq!(t.summary_line(), "summary: 18 passed, 2 failed, 5 ignored; 0 checks skipped at run time");
    }

    #[test]
    fn skip_lines_are_counted_by_reason() {
        let t = tally(&[
            "*** SKIPPED oracle::dsv3: HF oracle fixtures not found at /x (set KRASIS_FIXTURES) — it checked nothing ***",
            "*** SKIPPED gguf::a: GGUF fixtures not found at /y (run scripts/make-gguf-fixtures.sh, or set KRASIS_GGUF_FIXTURES) — it checked nothing ***",
            "*** SKIPPED: no GPU: moe_int4 checked nothing: no CUDA driver ***",
            "*** SKIPPED gpu_oracle::b: no GPU (dsv3-tiny): no CUDA driver — it checked nothing ***",
            "*** SKIPPED: no libnvrtc: every_kernel checked nothing: not found ***",
            "*** SKIPPED: amx_gemm checked nothing: the CPU has no AMX-INT8 ***",
            "*** SKIPPED t: something new — it checked nothing ***",
            "a line that merely mentions SKIPPED",
        ]);
        assert_eq!(t.skipped(), 7);
        assert_eq!(
            t.summary_line(),
            "summary: 0 passed, 0 failed, 0 ignored; 7 checks skipped at run time \
             (no AMX: 1, no GPU: 2, no NVRTC: 1, no fixtures: 2, other: 1); no test binary reported a result"
        );
        let details = t.skip_details();
        assert!(details.contains(&"skipped (no GPU): 2, for example".to_string()), "{details:?}");
        assert!(details.iter().any(|d| d.starts_with("  *** SKIPPED t: something new")), "{details:?}");
    }

    #[test]
    fn package_flags_are_recognised_before_the_separator() {
        assert!(picks_packages(&["-p", "krasis-tests", "--test", "oracle"]));
        assert!(picks_packages(&["-pkrasis-tests"]));
        assert!(picks_packages(&["--package=krasis-cli"]));
        assert!(!picks_packages(&["--release", "--", "-p"]));
        assert!(!picks_packages(&[]));
    }

    #[test]
    fn examples_are_capped_per_reason() {
        let lines: Vec<String> =
            (0..10).map(|i| format!("*** SKIPPED t{i}: no GPU (x): none — it checked nothing ***")).collect();
        let t = tally(&lines.iter().map(String::as_str).collect::<Vec<_>>());
        assert_eq!(t.skipped(), 10);
        assert_eq!(t.skip_details().len(), 1 + EXAMPLES_PER_REASON);
    }
}
