//! The dense-weight cache: round trip, and every way a file can be bad is detected and rebuilt
//! (or refused with the reason), never used.

use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::dense::*;
use crate::format::PREAMBLE_BYTES;
use crate::tests::flip_byte;
use crate::{CacheError, CacheOutcome};

fn hdr(config_hash: u64) -> DenseHeader {
    let e = |name: &str, rows, cols, bytes| DenseEntry { name: name.into(), rows, cols, group_size: 64, bytes };
    DenseHeader {
        format_version: DENSE_FORMAT_VERSION,
        layout: "test-v1".into(),
        config_hash,
        bits: 8,
        group_size: 128,
        entries: vec![e("a.q", 16, 64, 5000), e("a.o", 32, 64, 4096), e("lm_head", 48, 64, 10001)],
    }
}

/// Deterministic pseudo-random bytes of entry `i`.
fn fake(i: usize, len: usize) -> Vec<u8> {
    crate::tests::fake(0, i, len)
}

fn producer(h: &DenseHeader) -> impl Fn(usize) -> Result<Vec<u8>, String> + Sync + '_ {
    move |i| Ok(fake(i, h.entries[i].bytes as usize))
}

fn quiet(_: u64, _: u64) {}

fn path_in(dir: &Path) -> PathBuf {
    dir.join(dense_cache_file_name(8, 128))
}

fn check_contents(c: &DenseCache, h: &DenseHeader) {
    for (i, e) in h.entries.iter().enumerate() {
        assert_eq!(c.entry(i), fake(i, e.bytes as usize).as_slice(), "entry {i}");
        assert_eq!(c.entry(i).as_ptr() as usize % ENTRY_ALIGN as usize, 0, "entry {i} aligned");
        assert_eq!(c.index_of(&e.name), Some(i));
    }
}

fn assert_rebuilt(path: &Path, h: &DenseHeader, reason: &str) {
    let (c, outcome) = open_or_build_dense(path, h, &producer(h), &quiet, &quiet).unwrap();
    match outcome {
        CacheOutcome::Built { reason: r } => assert!(r.contains(reason), "reason {r:?} lacks {reason:?}"),
        CacheOutcome::Hit => panic!("expected a rebuild ({reason})"),
    }
    check_contents(&c, h);
}

#[test]
fn round_trip_is_byte_identical_and_reports_progress() {
    let d = tempfile::tempdir().unwrap();
    let p = path_in(d.path());
    let h = hdr(1);
    assert_eq!(p.file_name().unwrap(), "dense_cpu_int8_g128.bin");
    let calls = AtomicUsize::new(0);
    let last = std::sync::Mutex::new((0, 0));
    // Load tasks report from several threads, so their calls may arrive out of order: keep the
    // furthest (the last task's sum is the whole).
    let progress = |done: u64, total: u64| {
        calls.fetch_add(1, Ordering::Relaxed);
        let mut l = last.lock().unwrap();
        if done >= l.0 {
            *l = (done, total);
        }
    };
    let r = build_dense(&p, &h, &producer(&h), &progress).unwrap();
    assert_eq!(r.bytes, std::fs::metadata(&p).unwrap().len());
    assert_eq!(calls.load(Ordering::Relaxed), 3);
    let bytes = std::fs::read(&p).unwrap();
    assert_eq!(&bytes[0..8], b"KRASISDC");
    assert_eq!(r.bytes % ENTRY_ALIGN, 0);

    calls.store(0, Ordering::Relaxed);
    *last.lock().unwrap() = (0, 0);
    let c = open_dense(&p, &h, true, &progress).unwrap();
    check_contents(&c, &h);
    assert_eq!(calls.load(Ordering::Relaxed), 3);
    let (done, total) = *last.lock().unwrap();
    assert_eq!((done, total), (c.resident_bytes() as u64, c.resident_bytes() as u64));
    assert!(describe_dense(&c).contains("3 matrices"), "{}", describe_dense(&c));
    assert!(c.load_report().verified);

    let (_, outcome) = open_or_build_dense(&p, &h, &producer(&h), &quiet, &quiet).unwrap();
    assert_eq!(outcome, CacheOutcome::Hit);
}

#[test]
fn missing_truncated_extended_and_flipped_files_are_rebuilt_with_the_reason() {
    let d = tempfile::tempdir().unwrap();
    let p = path_in(d.path());
    let h = hdr(2);
    assert!(matches!(open_dense(&p, &h, true, &quiet), Err(CacheError::Missing { .. })));
    assert_rebuilt(&p, &h, "missing");

    let len = std::fs::metadata(&p).unwrap().len();
    OpenOptions::new().write(true).open(&p).unwrap().set_len(len - 100).unwrap();
    let e = open_dense(&p, &h, true, &quiet).unwrap_err();
    assert!(matches!(e, CacheError::SizeMismatch { .. }) && e.is_rebuildable(), "{e}");
    assert!(e.to_string().starts_with("dense-weight cache "), "{e}");
    assert_rebuilt(&p, &h, "truncated");

    OpenOptions::new().write(true).open(&p).unwrap().set_len(len + 4096).unwrap();
    assert_rebuilt(&p, &h, "extended");

    // A flipped byte in the last entry (and one in its zero padding) names the entry.
    for off in [len - 4096 + 10, len - 1] {
        flip_byte(&p, off);
        let e = open_dense(&p, &h, true, &quiet).unwrap_err();
        assert!(matches!(&e, CacheError::EntryChecksum { index: 2, name, .. } if name == "lm_head"), "{e}");
        assert!(e.to_string().contains("`lm_head`") && e.to_string().contains(&p.display().to_string()), "{e}");
        assert_rebuilt(&p, &h, "checksum mismatch in `lm_head`");
    }

    // Header damage: magic, version, reserved bytes, JSON, checksum table.
    let header_len = {
        let b = std::fs::read(&p).unwrap();
        u64::from_le_bytes(b[16..24].try_into().unwrap())
    };
    let table = (PREAMBLE_BYTES + header_len).div_ceil(8) * 8;
    let cases: [(u64, &str); 5] = [
        (3, "bad magic"),
        (8, "format version"),
        (50, "reserved"),
        (PREAMBLE_BYTES + 30, "header checksum mismatch"),
        (table + 11, "checksum table checksum mismatch"),
    ];
    for (off, reason) in cases {
        flip_byte(&p, off);
        let e = open_dense(&p, &h, true, &quiet).unwrap_err();
        assert!(e.is_rebuildable(), "{reason}: {e}");
        assert_rebuilt(&p, &h, reason);
    }
}

#[test]
fn a_file_of_another_model_or_precision_is_stale_and_named() {
    let d = tempfile::tempdir().unwrap();
    let p = path_in(d.path());
    let h = hdr(3);
    build_dense(&p, &h, &producer(&h), &quiet).unwrap();
    let mut other = hdr(4);
    let e = open_dense(&p, &other, true, &quiet).unwrap_err();
    assert!(e.to_string().contains("stale: config_hash differs") || e.reason().contains("config_hash"), "{e}");
    other = hdr(3);
    other.entries[1].name = "a.k".into();
    let e = open_dense(&p, &other, true, &quiet).unwrap_err();
    assert!(matches!(e, CacheError::Stale { field: "entry", .. }), "{e}");
    assert!(e.to_string().contains("`a.o`") && e.to_string().contains("`a.k`"), "{e}");
    let (c, outcome) = open_or_build_dense(&p, &other, &producer(&other), &quiet, &quiet).unwrap();
    assert!(matches!(outcome, CacheOutcome::Built { reason } if reason.starts_with("stale: entry differs")));
    check_contents(&c, &other);
    other.bits = 4;
    assert!(matches!(open_dense(&p, &other, true, &quiet), Err(CacheError::Stale { field: "bits", .. })));
}

#[test]
fn hostile_header_sizes_are_refused_before_allocating() {
    let d = tempfile::tempdir().unwrap();
    let p = path_in(d.path());
    let h = hdr(5);
    build_dense(&p, &h, &producer(&h), &quiet).unwrap();
    let f = OpenOptions::new().write(true).open(&p).unwrap();
    // header_len of 2^60: refused by the cap, not allocated.
    f.write_all_at(&(1u64 << 60).to_le_bytes(), 16).unwrap();
    let e = open_dense(&p, &h, true, &quiet).unwrap_err();
    assert!(matches!(&e, CacheError::HeaderInvalid { detail, .. } if detail.contains("exceeds")), "{e}");

    // A well-formed, correctly checksummed header that claims an entry of 2^62 bytes: refused by
    // the size check against the real file, before the entry buffer is allocated.
    let mut huge = hdr(5);
    huge.entries[0].bytes = 1 << 62;
    let json = serde_json::json!({
        "format_version": DENSE_FORMAT_VERSION, "layout": "test-v1", "config_hash": "0x0000000000000005", "bits": 8,
        "group_size": 128, "entry_align": 4096, "data_bytes": (1u64 << 62) + 4096 + 12288,
        "entries": [
            {"name": "a.q", "rows": 16, "cols": 64, "group_size": 64, "bytes": 1u64 << 62, "offset": 0},
            {"name": "a.o", "rows": 32, "cols": 64, "group_size": 64, "bytes": 4096, "offset": 1u64 << 62},
            {"name": "lm_head", "rows": 48, "cols": 64, "group_size": 64, "bytes": 10001, "offset": (1u64 << 62) + 4096}
        ],
        "checksum": "xxh3-64", "writer": "test"
    })
    .to_string();
    let mut pre = [0u8; 64];
    pre[0..8].copy_from_slice(b"KRASISDC");
    pre[8..12].copy_from_slice(&DENSE_FORMAT_VERSION.to_le_bytes());
    pre[16..24].copy_from_slice(&(json.len() as u64).to_le_bytes());
    pre[24..32].copy_from_slice(&xxhash_rust::xxh3::xxh3_64(json.as_bytes()).to_le_bytes());
    std::fs::write(&p, [&pre[..], json.as_bytes()].concat()).unwrap();
    let e = open_dense(&p, &huge, true, &quiet).unwrap_err();
    assert!(matches!(e, CacheError::SizeMismatch { .. }), "{e}");
    assert_rebuilt(&p, &h, "truncated or extended");
}

#[test]
fn produce_errors_and_wrong_sizes_leave_no_file() {
    let d = tempfile::tempdir().unwrap();
    let p = path_in(d.path());
    let h = hdr(6);
    let failing = |i: usize| if i == 1 { Err("no such tensor".to_string()) } else { Ok(fake(i, 5000)) };
    let e = build_dense(&p, &h, &failing, &quiet).unwrap_err();
    assert!(e.to_string().contains("`a.o`") && e.to_string().contains("no such tensor"), "{e}");
    let short = |i: usize| Ok(fake(i, 10));
    let e = build_dense(&p, &h, &short, &quiet).unwrap_err();
    assert!(e.to_string().contains("produced 10 bytes, expected 5000"), "{e}");
    let names: Vec<_> = std::fs::read_dir(d.path()).unwrap().flatten().map(|e| e.file_name()).collect();
    assert!(names.is_empty(), "left behind: {names:?}");
    let mut empty = hdr(6);
    empty.entries.clear();
    assert!(matches!(build_dense(&p, &empty, &failing, &quiet), Err(CacheError::InvalidRequest(_))));
}

#[test]
fn an_expert_cache_is_not_taken_for_a_dense_one() {
    let d = tempfile::tempdir().unwrap();
    let p = path_in(d.path());
    let h = hdr(7);
    build_dense(&p, &h, &producer(&h), &quiet).unwrap();
    let f = OpenOptions::new().write(true).open(&p).unwrap();
    f.write_all_at(b"KRASISXC", 0).unwrap();
    let e = open_dense(&p, &h, true, &quiet).unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("not a Krasis dense-weight cache") && msg.contains("expected \"KRASISDC\""), "{msg}");
}
