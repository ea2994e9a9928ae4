//! No library string names a CLI flag (issue #36): a library error or warning names the option
//! (`GpuOptions::vram_budget`), and the CLI maps options to its flags (`krasis-cli/src/flags.rs`).
//!
//! The scanner reads every `.rs` file under the library crates' `src/` and reports each string
//! literal outside test code that holds a `--word`. Test code is left out: files named
//! `*tests.rs`, files under a `tests/` folder, and items under `#[cfg(test)]`. Comments are not
//! string literals, so doc comments may still mention a flag.
//!
//! A library string names an option as its Rust path in backticks (`` `GpuOptions::vram_budget` ``,
//! `` `DevicePolicy::Gpu` ``); a second check reads the CLI's table of them and fails when a
//! library string names an option of an options type (one the table knows, or a type whose name
//! ends in `Options` or `Config`) that the table does not map to a flag.
//!
//! The scanner is a set of plain functions over text; the `scanner_*` tests feed it planted
//! sources to show that it finds what it should and passes over what it should.

use std::fs;
use std::path::{Path, PathBuf};

/// The library crates: everything below the CLI.
const LIBRARY_CRATES: [&str; 6] =
    ["krasis-core", "krasis-quant", "krasis-cpu", "krasis-gpu", "krasis-cache", "krasis-model"];

/// Text in library strings that looks like a flag but is another program's option, not one of
/// the CLI's: NVRTC's compiler options and numactl's.
const OTHER_PROGRAMS_OPTIONS: [&str; 4] =
    ["--std=", "--generate-line-info", "--gpu-architecture=", "numactl --interleave"];

/// A string literal: the line it starts on and its text as written in the source (escapes and
/// line continuations included).
#[derive(Debug, PartialEq)]
struct Literal {
    line: usize,
    text: String,
}

#[derive(Debug, PartialEq)]
enum Tok {
    Ident(String),
    Punct(char),
    Str(Literal),
}

/// Rust source as identifiers, punctuation and string literals; comments, whitespace, char
/// literals and lifetimes are dropped.
fn tokens(src: &str) -> Vec<Tok> {
    let c: Vec<char> = src.chars().collect();
    let mut out = Vec::new();
    let mut line = 1;
    let mut i = 0;
    // Consumes c[from..to], counting its newlines.
    let advance = |line: &mut usize, from: usize, to: usize| {
        *line += c[from..to.min(c.len())].iter().filter(|&&x| x == '\n').count();
        to
    };
    while i < c.len() {
        let ch = c[i];
        let next = c.get(i + 1).copied();
        if ch == '/' && next == Some('/') {
            let mut j = i;
            while j < c.len() && c[j] != '\n' {
                j += 1;
            }
            i = j;
        } else if ch == '/' && next == Some('*') {
            let (mut j, mut depth) = (i + 2, 1);
            while j < c.len() && depth > 0 {
                if c[j] == '/' && c.get(j + 1) == Some(&'*') {
                    depth += 1;
                    j += 2;
                } else if c[j] == '*' && c.get(j + 1) == Some(&'/') {
                    depth -= 1;
                    j += 2;
                } else {
                    j += 1;
                }
            }
            i = advance(&mut line, i, j);
        } else if ch == '"' {
            let start = line;
            let mut j = i + 1;
            while j < c.len() && c[j] != '"' {
                j += if c[j] == '\\' { 2 } else { 1 };
            }
            let text: String = c[i + 1..j.min(c.len())].iter().collect();
            i = advance(&mut line, i, j + 1);
            out.push(Tok::Str(Literal { line: start, text }));
        } else if ch == '\'' {
            // A char literal ('x', '\n', '\'', '"') or a lifetime ('a).
            if next == Some('\\') {
                let mut j = i + 3;
                while j < c.len() && c[j] != '\'' {
                    j += 1;
                }
                i = j + 1;
            } else if c.get(i + 2) == Some(&'\'') {
                i = advance(&mut line, i, i + 3);
            } else {
                i += 1;
            }
        } else if ch.is_alphanumeric() || ch == '_' {
            let mut j = i;
            while j < c.len() && (c[j].is_alphanumeric() || c[j] == '_') {
                j += 1;
            }
            let word: String = c[i..j].iter().collect();
            // Raw strings: r"…", r#"…"#, br"…" and cr"…".
            let hashes = c[j..].iter().take_while(|&&x| x == '#').count();
            if matches!(word.as_str(), "r" | "br" | "cr") && c.get(j + hashes) == Some(&'"') {
                let close: String = std::iter::once('"').chain(std::iter::repeat_n('#', hashes)).collect();
                let body_start = j + hashes + 1;
                let rest: String = c[body_start..].iter().collect();
                let body_len = rest.find(&close).map(|b| rest[..b].chars().count()).unwrap_or(c.len() - body_start);
                let text: String = c[body_start..body_start + body_len].iter().collect();
                let start = line;
                i = advance(&mut line, i, body_start + body_len + close.chars().count());
                out.push(Tok::Str(Literal { line: start, text }));
            } else {
                out.push(Tok::Ident(word));
                i = j;
            }
        } else {
            if ch == '\n' {
                line += 1;
            } else if !ch.is_whitespace() {
                out.push(Tok::Punct(ch));
            }
            i += 1;
        }
    }
    out
}

/// The index just past the bracket that closes the one at `open` (`(`, `[` or `{`), or the end.
fn past_group(toks: &[Tok], open: usize) -> usize {
    let mut depth = 0i32;
    for (k, t) in toks.iter().enumerate().skip(open) {
        match t {
            Tok::Punct('(' | '[' | '{') => depth += 1,
            Tok::Punct(')' | ']' | '}') => {
                depth -= 1;
                if depth == 0 {
                    return k + 1;
                }
            }
            _ => {}
        }
    }
    toks.len()
}

/// Whether an attribute's tokens (between `[` and `]`) are `cfg(...)` of a predicate that holds
/// only in test builds: `cfg(test)`, `cfg(all(test, …))`; not `cfg(not(test))`.
fn is_test_cfg(attr: &[Tok]) -> bool {
    let ident = |t: &Tok, name: &str| matches!(t, Tok::Ident(w) if w == name);
    attr.first().is_some_and(|t| ident(t, "cfg"))
        && attr.iter().any(|t| ident(t, "test"))
        && !attr.iter().any(|t| ident(t, "not") || ident(t, "any"))
}

/// The string literals of `src` outside the items under `#[cfg(test)]` (and outside a file that
/// starts with `#![cfg(test)]`).
fn non_test_literals(src: &str) -> Vec<Literal> {
    let toks = tokens(src);
    let skipped = test_ranges(&toks);
    let mut out = Vec::new();
    for (k, t) in toks.into_iter().enumerate() {
        if let Tok::Str(lit) = t {
            if !skipped.iter().any(|r| r.contains(&k)) {
                out.push(lit);
            }
        }
    }
    out
}

/// The index just past the item that starts at `from`: its `;` or its `{…}` body, whichever
/// comes first outside brackets.
fn past_item(toks: &[Tok], from: usize) -> usize {
    let mut k = from;
    while k < toks.len() {
        match toks[k] {
            Tok::Punct(';') => return k + 1,
            Tok::Punct('{') => return past_group(toks, k),
            Tok::Punct('(' | '[') => k = past_group(toks, k),
            _ => k += 1,
        }
    }
    toks.len()
}

/// The token ranges of the items under `#[cfg(test)]` (the whole file for `#![cfg(test)]`).
fn test_ranges(toks: &[Tok]) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < toks.len() {
        if toks[i] == Tok::Punct('#') {
            let inner = toks.get(i + 1) == Some(&Tok::Punct('!'));
            let open = i + 1 + usize::from(inner);
            if toks.get(open) == Some(&Tok::Punct('[')) {
                let close = past_group(toks, open);
                if is_test_cfg(&toks[open + 1..close.saturating_sub(1)]) {
                    let end = if inner { toks.len() } else { past_item(toks, close) };
                    out.push(i..end);
                    i = end;
                    continue;
                }
            }
        }
        i += 1;
    }
    out
}

/// The `--word`s in a string's text: `--` not preceded by a letter, digit or `-`, then a lower-case
/// letter and more letters, digits or single hyphens. Other programs' options
/// ([`OTHER_PROGRAMS_OPTIONS`]) are not counted.
fn flags_in(text: &str) -> Vec<(usize, String)> {
    let mut text = text.to_string();
    for other in OTHER_PROGRAMS_OPTIONS {
        text = text.replace(other, &" ".repeat(other.len()));
    }
    let b = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i + 2 < b.len() {
        let starts = b[i] == b'-'
            && b[i + 1] == b'-'
            && b[i + 2].is_ascii_lowercase()
            && (i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'-'));
        if !starts {
            i += 1;
            continue;
        }
        let mut j = i + 2;
        while j < b.len() && (b[j].is_ascii_lowercase() || b[j].is_ascii_digit() || b[j] == b'-') {
            j += 1;
        }
        let word = text[i..j].trim_end_matches('-').to_string();
        out.push((i, word));
        i = j;
    }
    out
}

/// Each non-test string of `src` that names flags, as `path:line: --a, --b in "…"` (the line of
/// its first flag; the text shortened, with its whitespace runs as single spaces).
fn violations(path: &str, src: &str) -> Vec<String> {
    let mut out = Vec::new();
    for lit in non_test_literals(src) {
        let found = flags_in(&lit.text);
        let Some(&(first, _)) = found.first() else { continue };
        let line = lit.line + lit.text[..first].matches('\n').count();
        let mut names: Vec<&str> = Vec::new();
        for (_, flag) in &found {
            if !names.contains(&flag.as_str()) {
                names.push(flag);
            }
        }
        let flat = lit.text.replace("\\\n", " ").split_whitespace().collect::<Vec<_>>().join(" ");
        let shown: String = flat.chars().take(120).collect();
        out.push(format!("{path}:{line}: {} in \"{shown}\"", names.join(", ")));
    }
    out
}

/// The options a string names in the library's form: `` `Type::name` `` in backticks, `Type`
/// starting with an upper-case letter.
fn options_in(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let parts: Vec<&str> = text.split('`').collect();
    // Odd parts lie between a pair of backticks.
    for inner in parts.iter().skip(1).step_by(2).take(parts.len() / 2) {
        let Some((ty, name)) = inner.split_once("::") else { continue };
        let ident = |s: &str| !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if ty.starts_with(|c: char| c.is_ascii_uppercase()) && ident(ty) && ident(name) {
            out.push(inner.to_string());
        }
    }
    out
}

/// The options the CLI's table maps to flags: each `("Type::name", "--flag…")` of its source.
fn mapped_options(flags_rs: &str) -> Vec<String> {
    let mut out = Vec::new();
    for lit in non_test_literals(flags_rs).windows(2) {
        if lit[1].text.starts_with("--") && options_in(&format!("`{}`", lit[0].text)).len() == 1 {
            out.push(lit[0].text.clone());
        }
    }
    out
}

/// Each option of an options type that `src`'s non-test strings name and `mapped` lacks, as
/// `path:line: `Type::name``.
fn unmapped(path: &str, src: &str, mapped: &[String]) -> Vec<String> {
    let types: Vec<&str> = mapped.iter().filter_map(|o| o.split("::").next()).collect();
    let mut out = Vec::new();
    for lit in non_test_literals(src) {
        for option in options_in(&lit.text) {
            let ty = option.split("::").next().expect("split_once found ::");
            let options_type = types.contains(&ty) || ty.ends_with("Options") || ty.ends_with("Config");
            if options_type && !mapped.contains(&option) {
                out.push(format!("{path}:{}: `{option}`", lit.line));
            }
        }
    }
    out
}

/// Whether a file under `src/` is test code by its name or folder.
fn is_test_file(rel: &Path) -> bool {
    let name = rel.file_name().and_then(|n| n.to_str()).unwrap_or("");
    name.ends_with("tests.rs") || rel.components().any(|c| c.as_os_str() == "tests")
}

fn read(path: &Path) -> String {
    fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<PathBuf> = fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|e| e.expect("reading a directory entry").path())
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// Every non-test library source file: its path from the workspace root and its text.
fn library_sources() -> Vec<(String, String)> {
    let root = krasis_tests::workspace_root();
    let mut out = Vec::new();
    for krate in LIBRARY_CRATES {
        let src = root.join(krate).join("src");
        let mut files = Vec::new();
        rust_files(&src, &mut files);
        for file in files {
            if is_test_file(file.strip_prefix(&src).expect("under src")) {
                continue;
            }
            let text = read(&file);
            out.push((file.strip_prefix(&root).expect("under the root").display().to_string(), text));
        }
    }
    assert!(out.len() > 50, "only {} library source files found under {}", out.len(), root.display());
    out
}

#[test]
fn library_strings_name_no_cli_flags() {
    let found: Vec<String> = library_sources().iter().flat_map(|(path, text)| violations(path, text)).collect();
    assert!(
        found.is_empty(),
        "{} library string(s) name a CLI flag; name the option instead (e.g. `GpuOptions::vram_budget`) \
         and map it to its flag in krasis-cli/src/flags.rs:\n{}",
        found.len(),
        found.join("\n")
    );
}

#[test]
fn every_option_a_library_string_names_has_a_cli_flag() {
    let flags_rs = krasis_tests::workspace_root().join("krasis-cli/src/flags.rs");
    let mapped = mapped_options(&read(&flags_rs));
    assert!(mapped.len() >= 10 && mapped.iter().any(|o| o == "GpuOptions::vram_budget"), "{mapped:?}");
    let found: Vec<String> = library_sources().iter().flat_map(|(path, text)| unmapped(path, text, &mapped)).collect();
    assert!(
        found.is_empty(),
        "{} option(s) named by library strings have no flag in krasis-cli/src/flags.rs (OPTION_FLAGS):\n{}",
        found.len(),
        found.join("\n")
    );
}

#[test]
fn scanner_reports_flags_in_strings_of_library_code() {
    let src = r####"
//! Mentions --vram-budget in a doc comment: fine.
/* and --force in a block /* nested */ comment: fine */
#[derive(Debug, thiserror::Error)]
pub enum E {
    #[error("--vram-budget {0} is too small: raise --vram-budget or lower --pin-vram")]
    Small(u64),
}
fn f(c: char) -> String {
    let _ = '"'; // a quote as a char literal does not open a string
    let _: &'static str = "no flag - here, nor x--y, nor ---";
    if c == '\'' { return String::new(); }
    format!("raise the budget \
             or pass --force")
}
const RAW: &str = r#"use "--cache-dir" to move it"#;
"####;
    let v = violations("lib.rs", src);
    assert_eq!(
        v,
        [
            "lib.rs:6: --vram-budget, --pin-vram in \"--vram-budget {0} is too small: raise --vram-budget or lower --pin-vram\"",
            "lib.rs:14: --force in \"raise the budget or pass --force\"",
            "lib.rs:16: --cache-dir in \"use \"--cache-dir\" to move it\"",
        ],
        "{v:#?}"
    );
}

#[test]
fn scanner_passes_over_test_code_and_other_programs_options() {
    let src = r#"
const NVRTC: &[&str] = &["--std=c++17", "--generate-line-info"];
fn hint() -> &'static str { "run without numactl --interleave" }
fn named() -> &'static str { "the VRAM budget (`GpuOptions::vram_budget`)" }
#[cfg(test)]
mod tests {
    #[test]
    fn t() { assert!("--force".len() > 0); }
}
#[cfg(test)]
fn helper() -> &'static str { "--cache-dir" }
#[cfg(test)]
const FLAG: &str = "--layers";
#[cfg(not(test))]
const REAL: &str = "--seed";
"#;
    assert_eq!(violations("lib.rs", src), ["lib.rs:15: --seed in \"--seed\""]);
    assert!(violations("lib.rs", "#![cfg(test)]\nconst F: &str = \"--force\";\n").is_empty());
    assert!(is_test_file(Path::new("runtime/tests.rs")));
    assert!(is_test_file(Path::new("prefill_bf16_tests.rs")));
    assert!(is_test_file(Path::new("quant/tests/mod.rs")));
    assert!(!is_test_file(Path::new("runtime/open.rs")));
}

#[test]
fn scanner_reports_options_the_cli_does_not_map() {
    let flags_rs = r#"
pub const OPTION_FLAGS: &[(&str, &str)] = &[
    ("GpuOptions::vram_budget", "--vram-budget"),
    ("DevicePolicy::Gpu", "--device gpu"),
];
"#;
    let mapped = mapped_options(flags_rs);
    assert_eq!(mapped, ["GpuOptions::vram_budget", "DevicePolicy::Gpu"]);
    let src = r#"
fn a() -> &'static str { "raise the VRAM budget (`GpuOptions::vram_budget`) or use `DevicePolicy::Gpu`" }
fn b() -> &'static str { "lower `GpuOptions::vram_budgt`, `DevicePolicy::Hybrid` or `SynthOptions::force`" }
fn c() -> &'static str { "metadata `tokenizer.ggml.model`; see `Engine::expert_counts` and `x::y`" }
"#;
    assert_eq!(
        unmapped("lib.rs", src, &mapped),
        ["lib.rs:3: `GpuOptions::vram_budgt`", "lib.rs:3: `DevicePolicy::Hybrid`", "lib.rs:3: `SynthOptions::force`"]
    );
}
