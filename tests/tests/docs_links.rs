//! The documents' promises about themselves, checked:
//!
//! - every repository path that README.md, docs/*.md, docs/history/*.md or bench/logs/README.md
//!   names (`bench/…`, `scripts/…`, `docs/…`, and relative Markdown link targets) exists, so a
//!   figure never cites a log or a script that is not there;
//! - every device log under bench/logs/ is listed in bench/logs/README.md, and every entry there
//!   exists;
//! - docs/ holds no `*.log` files (logs live in bench/logs/DATE/);
//! - no paragraph of docs/ARCHITECTURE.md runs past 250 words;
//! - README.md stays at most 120 lines, with its two set-up commands in the first 30.
//!
//! The scanners are plain functions over text, and the `*_reports_*` tests feed them a bad
//! document to show that each check can fail.

use std::fs;
use std::path::{Path, PathBuf};

/// Longest paragraph allowed in docs/ARCHITECTURE.md, in words.
const MAX_PARAGRAPH_WORDS: usize = 250;
/// Longest README allowed, in lines.
const MAX_README_LINES: usize = 120;
/// The set-up commands must start within this many lines of README's top.
const SETUP_WITHIN_LINES: usize = 30;
/// README's set-up commands.
const SETUP_COMMANDS: [&str; 2] = ["./scripts/demo.sh", "cargo xtask test"];
/// Path prefixes that name a file or folder of this repository wherever they appear.
const ROOTS: [&str; 3] = ["bench/", "scripts/", "docs/"];

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("tests/ has a parent").to_path_buf()
}

fn read(path: &Path) -> String {
    fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// The Markdown files whose paths are checked, relative to the repository root.
fn scanned_documents(root: &Path) -> Vec<PathBuf> {
    let mut docs = vec![PathBuf::from("README.md"), PathBuf::from("bench/logs/README.md")];
    for dir in ["docs", "docs/history"] {
        let Ok(entries) = fs::read_dir(root.join(dir)) else { continue };
        let mut found: Vec<PathBuf> = entries
            .map(|e| e.expect("reading a docs entry").path())
            .filter(|p| p.extension().is_some_and(|x| x == "md"))
            .map(|p| p.strip_prefix(root).expect("under the root").to_path_buf())
            .collect();
        found.sort();
        docs.extend(found);
    }
    docs
}

fn is_path_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | '/' | '*')
}

/// The repository paths a document names: each maximal run of path characters that starts with
/// one of [`ROOTS`] (and is not the tail of a longer path such as `../x/docs/a`), with trailing
/// sentence punctuation dropped.
fn named_paths(text: &str) -> Vec<String> {
    let chars: Vec<(usize, char)> = text.char_indices().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let (at, c) = chars[i];
        let starts_token = i == 0 || !is_path_char(chars[i - 1].1);
        if starts_token && c.is_ascii_alphabetic() && ROOTS.iter().any(|r| text[at..].starts_with(r)) {
            let mut j = i;
            while j < chars.len() && is_path_char(chars[j].1) {
                j += 1;
            }
            let end = if j < chars.len() { chars[j].0 } else { text.len() };
            let token = text[at..end].trim_end_matches(['.', ',', ':', ';']);
            // A bare root ("docs/") in prose names the folder; keep it, it must exist too.
            out.push(token.to_string());
            i = j;
        } else {
            i += 1;
        }
    }
    out
}

/// Relative targets of Markdown links, `[text](target)`: not URLs, not in-page anchors.
fn link_targets(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(k) = rest.find("](") {
        rest = &rest[k + 2..];
        let Some(close) = rest.find(')') else { break };
        let target = rest[..close].split('#').next().unwrap_or("").trim();
        if !target.is_empty() && !target.contains("://") && !target.starts_with("mailto:") && !target.contains(' ') {
            out.push(target.to_string());
        }
    }
    out
}

/// Whether `pattern` (a path whose last component may hold `*` wildcards) names something under
/// `base`.
fn exists(base: &Path, pattern: &str) -> bool {
    if !pattern.contains('*') {
        return base.join(pattern).exists();
    }
    let (dir, name) = pattern.rsplit_once('/').unwrap_or(("", pattern));
    if dir.contains('*') {
        return false;
    }
    let parts: Vec<&str> = name.split('*').collect();
    let Ok(entries) = fs::read_dir(base.join(dir)) else { return false };
    entries.filter_map(|e| e.ok()).any(|e| wildcard_match(&parts, &e.file_name().to_string_lossy()))
}

/// `parts` is a pattern split at its `*`s.
fn wildcard_match(parts: &[&str], name: &str) -> bool {
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if !name.starts_with(first) || !name[first.len()..].ends_with(last) || name.len() < first.len() + last.len() {
        return false;
    }
    let mut rest = &name[first.len()..name.len() - last.len()];
    for p in &parts[1..parts.len() - 1] {
        match rest.find(p) {
            Some(k) => rest = &rest[k + p.len()..],
            None => return false,
        }
    }
    true
}

/// The paths `doc` (at `doc_path`, relative to `root`) names that do not exist, one message each.
fn missing_paths(root: &Path, doc_path: &Path, doc: &str) -> Vec<String> {
    let doc_dir = root.join(doc_path.parent().unwrap_or(Path::new("")));
    let mut missing = Vec::new();
    for p in named_paths(doc) {
        if !exists(root, &p) {
            missing.push(format!("{}: names `{p}`, which does not exist", doc_path.display()));
        }
    }
    for t in link_targets(doc) {
        if !exists(&doc_dir, &t) {
            missing.push(format!("{}: links to `{t}`, which does not exist", doc_path.display()));
        }
    }
    missing
}

/// Paragraphs of a Markdown text: runs of lines between blank lines, where a heading, a list item
/// or a table row also starts a new paragraph and fenced code blocks are left out.
fn paragraphs(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut in_code = false;
    let mut flush = |cur: &mut String| {
        if !cur.trim().is_empty() {
            out.push(std::mem::take(cur));
        }
        cur.clear();
    };
    for line in text.lines() {
        let t = line.trim_start();
        if t.starts_with("```") {
            flush(&mut cur);
            in_code = !in_code;
            continue;
        }
        if in_code {
            continue;
        }
        let starts_new = t.is_empty()
            || t.starts_with('#')
            || t.starts_with('|')
            || t.starts_with("- ")
            || t.starts_with("* ")
            || t.split_once(". ").is_some_and(|(n, _)| !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()));
        if starts_new {
            flush(&mut cur);
        }
        cur.push_str(line);
        cur.push('\n');
    }
    flush(&mut cur);
    out
}

/// The words of a paragraph: whitespace-separated tokens with a letter or digit in them, so that
/// list and table markup (`-`, `|`) is not counted.
fn word_count(paragraph: &str) -> usize {
    paragraph.split_whitespace().filter(|w| w.chars().any(char::is_alphanumeric)).count()
}

/// Paragraphs of `text` longer than `max` words, as "N words: first words…".
fn long_paragraphs(text: &str, max: usize) -> Vec<String> {
    paragraphs(text)
        .iter()
        .filter_map(|p| {
            let words = word_count(p);
            (words > max).then(|| {
                let start: Vec<&str> = p.split_whitespace().take(12).collect();
                format!("{words} words: {}…", start.join(" "))
            })
        })
        .collect()
}

fn logs_under(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else { return };
    for e in entries {
        let p = e.expect("reading a directory entry").path();
        if p.is_dir() {
            logs_under(&p, out);
        } else if p.extension().is_some_and(|x| x == "log") {
            out.push(p);
        }
    }
}

#[test]
fn every_path_the_documents_name_exists() {
    let root = repo_root();
    let mut missing = Vec::new();
    for doc in scanned_documents(&root) {
        missing.extend(missing_paths(&root, &doc, &read(&root.join(&doc))));
    }
    assert!(missing.is_empty(), "{} missing path(s):\n{}", missing.len(), missing.join("\n"));
}

#[test]
fn every_device_log_is_indexed_and_every_index_entry_exists() {
    let root = repo_root();
    let logs_dir = root.join("bench/logs");
    let index = read(&logs_dir.join("README.md"));
    let mut logs = Vec::new();
    logs_under(&logs_dir, &mut logs);
    assert!(!logs.is_empty(), "no logs under {}", logs_dir.display());
    let mut problems = Vec::new();
    for log in &logs {
        let rel = log.strip_prefix(&logs_dir).expect("under bench/logs").to_string_lossy().into_owned();
        if !index.contains(&format!("`{rel}`")) {
            problems.push(format!("bench/logs/{rel} is not listed in bench/logs/README.md"));
        }
    }
    // Entries are "- `DATE/NAME.log` — what it holds".
    for line in index.lines().filter(|l| l.starts_with("- `")) {
        let entry = line[3..].split('`').next().unwrap_or("");
        if !logs_dir.join(entry).is_file() {
            problems.push(format!("bench/logs/README.md lists `{entry}`, which does not exist"));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn docs_holds_no_logs() {
    let mut logs = Vec::new();
    logs_under(&repo_root().join("docs"), &mut logs);
    assert!(logs.is_empty(), "logs belong in bench/logs/DATE/, not docs/: {logs:?}");
}

#[test]
fn architecture_paragraphs_stay_short() {
    let text = read(&repo_root().join("docs/ARCHITECTURE.md"));
    let long = long_paragraphs(&text, MAX_PARAGRAPH_WORDS);
    assert!(
        long.is_empty(),
        "docs/ARCHITECTURE.md has {} paragraph(s) over {MAX_PARAGRAPH_WORDS} words (figures belong in \
         docs/BENCHMARKS.md):\n{}",
        long.len(),
        long.join("\n")
    );
}

#[test]
fn readme_is_short_with_the_set_up_commands_first() {
    let text = read(&repo_root().join("README.md"));
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines.len() <= MAX_README_LINES, "README.md has {} lines (at most {MAX_README_LINES})", lines.len());
    let top = lines[..lines.len().min(SETUP_WITHIN_LINES)].join("\n");
    for cmd in SETUP_COMMANDS {
        assert!(top.contains(cmd), "README.md does not show `{cmd}` in its first {SETUP_WITHIN_LINES} lines");
    }
}

#[test]
fn missing_path_check_reports_a_bad_path() {
    let root = repo_root();
    let doc = "Figures: `bench/logs/2026-11-28/h200-no-such-run.log`, `scripts/demo.sh`, \
               [diary](history/no-such-diary.md), `bench/logs/2026-11-28/h200-*.log`, \
               `scripts/no-such-*.sh`. Not checked: `../shared/tools/x`, `device-bundle/run7.sh`.";
    let missing = missing_paths(&root, Path::new("docs/BENCHMARKS.md"), doc);
    assert_eq!(missing.len(), 3, "{missing:#?}");
    assert!(missing[0].contains("`bench/logs/2026-11-28/h200-no-such-run.log`"), "{missing:#?}");
    assert!(missing[1].contains("`scripts/no-such-*.sh`"), "{missing:#?}");
    assert!(missing[2].contains("`history/no-such-diary.md`"), "{missing:#?}");
}

#[test]
fn paragraph_check_reports_a_long_paragraph() {
    let long = "word ".repeat(MAX_PARAGRAPH_WORDS + 1);
    let short = "word ".repeat(MAX_PARAGRAPH_WORDS);
    let text =
        format!("# Title\n\n{short}\n\n- {short}\n- {short}\n\n| {short} |\n| b | c |\n\n```\n{long}\n```\n\n{long}\n");
    let found = long_paragraphs(&text, MAX_PARAGRAPH_WORDS);
    assert_eq!(found.len(), 1, "{found:#?}");
    assert!(found[0].starts_with(&format!("{} words", MAX_PARAGRAPH_WORDS + 1)), "{found:#?}");
}

/// Lines of `text` that state a build's duration ("N min" beside "crates" or "build"): the build
/// time is measured once and said once, in README.
fn build_time_claims(text: &str) -> Vec<String> {
    text.lines()
        .filter(|l| {
            let l = l.to_lowercase();
            let minutes = l.split_whitespace().collect::<Vec<_>>().windows(2).any(|w| {
                w[0].trim_start_matches('(').chars().all(|c| c.is_ascii_digit() || c == '-') && w[1].starts_with("min")
            });
            minutes && (l.contains("crates") || l.contains("compil"))
        })
        .map(str::to_string)
        .collect()
}

#[test]
fn the_build_time_is_stated_once_in_readme() {
    let root = repo_root();
    let readme = build_time_claims(&read(&root.join("README.md")));
    assert_eq!(readme.len(), 1, "README states the build time once: {readme:?}");
    for other in ["scripts/demo.sh", "scripts/build-krasis.sh", "CONTRIBUTING.md"] {
        let claims = build_time_claims(&read(&root.join(other)));
        assert!(claims.is_empty(), "{other} states a build time of its own (README has the one measured): {claims:?}");
    }
}

#[test]
fn build_time_check_reports_a_second_figure() {
    let demo = "echo \"the first build compiles about 120 crates and takes 3-6 minutes on 2 cores\"";
    assert_eq!(build_time_claims(demo).len(), 1);
    assert!(build_time_claims("cargo build --release -p krasis-cli").is_empty());
}
