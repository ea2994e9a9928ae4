//! Issue #38 item 6: after a run on the CPU with its defaults (quantised experts and dense
//! weights), the weight files' mappings hold no resident pages, whatever the page cache's folio
//! size. A file written in one piece (as Python writers do: `safetensors.numpy.save_file`, the
//! trained-weights checkpoints) is cached in folios of up to 2 MiB on a recent kernel, and a read
//! through the mapping makes the whole folio around the bytes resident (`madvise` advice does not
//! change that; measured in bench/logs/2026-11-28/devvm-memory-rss-s25.log), so the embedding's
//! rows read a token at a time and the routers read every token made several MiB of the file
//! resident, above the memory estimate. The engine now reads embedding rows from the file with
//! positioned reads and holds the routers in memory of their own.
//!
//! The resident pages are read from `/proc/self/smaps` (Linux; elsewhere a visible skip). The
//! check is on pages, not on the RSS total, so it does not depend on the folio size: before the
//! fix the mapping held at least the embedding rows' pages.

use std::path::Path;

use krasis_model::runtime::{open_engine, DevicePolicy, EngineConfig};
use krasis_model::source::files::ModelFiles;
use krasis_model::text::generate::{generate, GenerateRequest};
use krasis_model::text::sampling::SamplingParams;
use krasis_tests::{report_skip, tiny_model, weight_files};

/// Resident kB of every mapping of `file` in this process (`None`: no `/proc/self/smaps`).
fn mapped_rss_kb(file: &Path) -> Option<u64> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
    let want = file.to_string_lossy();
    let mut inside = false;
    let mut kb = 0;
    for line in smaps.lines() {
        let mut words = line.split_whitespace();
        let first = words.next().unwrap_or("");
        if first.contains('-') && first.chars().all(|c| c.is_ascii_hexdigit() || c == '-') {
            // A mapping's header: range, perms, offset, dev, inode, then the path, if any.
            inside = words.nth(4).is_some_and(|p| p == want);
        } else if inside && first == "Rss:" {
            kb += words.next().and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
        }
    }
    Some(kb)
}

#[test]
fn a_file_written_in_one_piece_leaves_no_mapped_pages_resident_after_a_cpu_run() {
    if !Path::new("/proc/self/smaps").exists() {
        report_skip("no /proc/self/smaps on this system");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    tiny_model(tmp.path());
    // Rewrite every weight file in one write, as a Python writer does.
    let files = weight_files(tmp.path());
    assert!(!files.is_empty());
    for f in &files {
        let bytes = std::fs::read(f).unwrap();
        std::fs::remove_file(f).unwrap();
        std::fs::write(f, &bytes).unwrap();
    }
    let model = ModelFiles::open(tmp.path()).unwrap();
    let vocab = model.spec().vocab_size as u32;
    let opened = open_engine(&model, &EngineConfig { device: DevicePolicy::Cpu, ..EngineConfig::default() }).unwrap();
    // A few hundred prompt ids over most of the vocabulary: every embedding page is read.
    let prompt_ids: Vec<u32> = (0..300u32).map(|i| (i * 37) % (vocab - 8) + 5).collect();
    let req = GenerateRequest {
        prompt_ids,
        max_new_tokens: 4,
        sampling: SamplingParams::default(),
        ignore_eos: true,
        record_logits: false,
    };
    let out = generate(opened.engine.as_ref(), &req, |_| Ok(())).unwrap();
    assert_eq!(out.generated.len(), 4);
    for f in &files {
        let kb = mapped_rss_kb(f).expect("smaps readable");
        assert_eq!(kb, 0, "{}: {kb} kB of the weight file's mapping resident after the run", f.display());
    }
}
