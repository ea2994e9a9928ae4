//! The library crates read the environment in one place only: `krasis-core/src/knobs.rs`
//! (`krasis_core::knobs`, #36). Every other source file of krasis-core, -quant, -cpu, -gpu,
//! -cache and -model (their `src/`, test modules included) must take a variable from
//! `knobs()`, and docs/ENVIRONMENT.md must list every variable that file reads.
//!
//! The scanner is a plain function over a directory tree; `the_scanner_catches_a_planted_read`
//! feeds it a tree with reads in it to show that the check can fail.

use std::fs;
use std::path::{Path, PathBuf};

/// The library crates whose sources may not read the environment.
const LIBRARY_CRATES: [&str; 6] =
    ["krasis-core", "krasis-quant", "krasis-cpu", "krasis-gpu", "krasis-cache", "krasis-model"];
/// The one library file that reads the environment, relative to the repository root.
const KNOBS_FILE: &str = "krasis-core/src/knobs.rs";

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("tests/ has a parent").to_path_buf()
}

/// Whether a line of Rust reads the environment at run time: `env::var`, `env::var_os`,
/// `env::vars`, `env::vars_os` (however `env` is reached), an import of them in braces, or
/// libc's `getenv`. Comment lines are skipped (docs may name the functions); `env!` and
/// `option_env!` read the build's environment and are allowed.
fn reads_env(line: &str) -> bool {
    let code = line.trim_start();
    if code.starts_with("//") {
        return false;
    }
    code.contains("env::var") || code.contains("getenv") || (code.contains("env::{") && code.contains("var"))
}

/// Every `.rs` file under `dir`, sorted.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else { return };
    let mut paths: Vec<PathBuf> = entries.map(|e| e.expect("reading a source directory entry").path()).collect();
    paths.sort();
    for p in paths {
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// What a scan of the library sources under `root` found.
struct Scan {
    /// `path:line: text` of every read outside [`KNOBS_FILE`].
    reads: Vec<String>,
    /// Source files scanned (the knobs file excluded).
    files: usize,
}

fn scan(root: &Path) -> Scan {
    let mut files = Vec::new();
    for c in LIBRARY_CRATES {
        rust_files(&root.join(c).join("src"), &mut files);
    }
    let knobs = root.join(KNOBS_FILE);
    files.retain(|f| *f != knobs);
    let mut reads = Vec::new();
    for f in &files {
        let text = fs::read_to_string(f).unwrap_or_else(|e| panic!("reading {}: {e}", f.display()));
        let rel = f.strip_prefix(root).expect("under the root").display().to_string();
        for (i, line) in text.lines().enumerate() {
            if reads_env(line) {
                reads.push(format!("{rel}:{}: {}", i + 1, line.trim()));
            }
        }
    }
    Scan { reads, files: files.len() }
}

#[test]
fn library_sources_read_the_environment_only_in_knobs() {
    let root = repo_root();
    let s = scan(&root);
    assert!(s.files > 100, "only {} library sources found under {}", s.files, root.display());
    assert!(
        s.reads.is_empty(),
        "library sources read the environment outside {KNOBS_FILE}; add a field to krasis_core::knobs::Knobs \
         (and a row to docs/ENVIRONMENT.md) and read it through knobs():\n{}",
        s.reads.join("\n")
    );
    // The one reader is still where this test says it is.
    let knobs = fs::read_to_string(root.join(KNOBS_FILE)).expect("reading the knobs file");
    assert!(knobs.lines().any(reads_env), "{KNOBS_FILE} reads no variable: has the reader moved?");
}

#[test]
fn the_scanner_catches_a_planted_read() {
    let tmp = tempfile::tempdir().expect("a temporary directory");
    let root = tmp.path();
    let write = |rel: &str, text: &str| {
        let p = root.join(rel);
        fs::create_dir_all(p.parent().expect("a parent")).expect("creating a source directory");
        fs::write(p, text).expect("writing a planted source");
    };
    write(
        "krasis-cpu/src/deep/planted.rs",
        "//! Reads `std::env::var(\"X\")` in a doc comment: allowed.\n\
         fn a() -> bool {\n    std::env::var(\"KRASIS_PLANTED\").is_ok()\n}\n\
         // env::var_os in a comment: allowed\n\
         const DIR: &str = env!(\"CARGO_MANIFEST_DIR\");\n",
    );
    write("krasis-model/src/other.rs", "use std::env::{self, vars};\nfn b() { let _ = env::var_os(\"HOME\"); }\n");
    write("krasis-gpu/src/c.rs", "fn c() { unsafe { libc::getenv(std::ptr::null()) }; }\n");
    // Not library sources, and the knobs file: not scanned.
    write("krasis-cli/src/main.rs", "fn main() { std::env::var(\"KRASIS_API_KEY\").ok(); }\n");
    write("krasis-cpu/tests/t.rs", "fn t() { std::env::var(\"KRASIS_REQUIRE_AMX\").ok(); }\n");
    write(KNOBS_FILE, "fn k() { std::env::var_os(\"KRASIS_ISA\"); }\n");

    let s = scan(root);
    assert_eq!(s.files, 3);
    assert_eq!(
        s.reads,
        [
            "krasis-cpu/src/deep/planted.rs:3: std::env::var(\"KRASIS_PLANTED\").is_ok()",
            "krasis-gpu/src/c.rs:1: fn c() { unsafe { libc::getenv(std::ptr::null()) }; }",
            "krasis-model/src/other.rs:1: use std::env::{self, vars};",
            "krasis-model/src/other.rs:2: fn b() { let _ = env::var_os(\"HOME\"); }",
        ]
    );
}

#[test]
fn environment_md_lists_every_variable_the_libraries_read() {
    let doc = fs::read_to_string(repo_root().join("docs/ENVIRONMENT.md")).expect("reading docs/ENVIRONMENT.md");
    let missing: Vec<&str> = krasis_core::knobs::Knobs::VARIABLES.iter().copied().filter(|v| !names(&doc, v)).collect();
    assert!(missing.is_empty(), "docs/ENVIRONMENT.md does not name {missing:?}");
}

/// Whether `doc` names `var` in code: a backtick, the name, then no further name character
/// (so `` `KRASIS_MLA` `` does not count for `KRASIS_MLA_DECODE` nor the other way round).
fn names(doc: &str, var: &str) -> bool {
    let needle = format!("`{var}");
    doc.match_indices(&needle)
        .any(|(at, _)| !doc[at + needle.len()..].starts_with(|c: char| c.is_ascii_alphanumeric() || c == '_'))
}

#[test]
fn a_variable_counts_as_named_only_whole() {
    let doc = "| `KRASIS_MLA_DECODE` | … | `$CUDA_HOME/lib64` |, `KRASIS_PDL=0`";
    assert!(names(doc, "KRASIS_MLA_DECODE") && names(doc, "KRASIS_PDL"));
    assert!(!names(doc, "KRASIS_MLA") && !names(doc, "HOME") && !names(doc, "KRASIS_PDL_X"));
}
