//! Round trips and every way a cache can be bad: each is detected, and rebuilt by `open_or_build`
//! (or refused with the reason), never used.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use crate::format::{read_header, Layout, PREAMBLE_BYTES};
use crate::*;

fn hdr(config_hash: u64) -> CacheHeader {
    CacheHeader {
        format_version: FORMAT_VERSION,
        layout: "test-v1".into(),
        config_hash,
        group_size_hidden: 128,
        group_size_intermediate: 64,
        hidden: 256,
        intermediate: 96,
        n_experts: 5,
        moe_layers: vec![1, 3, 4],
        parts: vec![parts(4, 4, 6001, 3003); 3],
    }
}

fn parts(w13_bits: u8, w2_bits: u8, w13_bytes: u64, w2_bytes: u64) -> LayerParts {
    LayerParts { w13_bits, w2_bits, w13_bytes, w2_bytes }
}

/// `h` with every layer's record parts `w13` and `w2` bytes long.
fn sized(h: CacheHeader, w13: u64, w2: u64) -> CacheHeader {
    let n = h.moe_layers.len();
    CacheHeader { parts: vec![parts(4, 4, w13, w2); n], ..h }
}

/// Three MoE layers of different widths, as a Q4_K_M GGUF gives: w13 INT4 everywhere, w2 INT8
/// in the first and last layer (sizes differ per layer, so do strides).
fn mixed(config_hash: u64) -> CacheHeader {
    CacheHeader {
        parts: vec![parts(4, 8, 6001, 5990), parts(4, 4, 6001, 3003), parts(8, 8, 12000, 5990)],
        ..hdr(config_hash)
    }
}

fn record_len(h: &CacheHeader, l: usize) -> usize {
    (h.parts[l].w13_bytes + h.parts[l].w2_bytes) as usize
}

/// Deterministic pseudo-random record of (layer_idx, expert).
pub(crate) fn fake(l: usize, e: usize, len: usize) -> Vec<u8> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ ((l as u64) << 32 | e as u64).wrapping_mul(0xff51_afd7_ed55_8ccd);
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

fn producer(h: &CacheHeader) -> impl Fn(usize, usize) -> Result<Vec<u8>, String> + Sync {
    let h = h.clone();
    move |l, e| Ok(fake(l, e, record_len(&h, l)))
}

fn quiet(_: BuildProgress) {}

fn cache_path(dir: &Path) -> PathBuf {
    dir.join(cache_file_name(Some(4), 128))
}

fn build_ok(path: &Path, h: &CacheHeader) -> BuildReport {
    build(path, h, &producer(h), &quiet).unwrap()
}

fn layout_of(path: &Path) -> Layout {
    read_header(&File::open(path).unwrap(), path).unwrap().1
}

pub(crate) fn flip_byte(path: &Path, off: u64) {
    let f = OpenOptions::new().read(true).write(true).open(path).unwrap();
    let mut b = [0u8];
    f.read_exact_at(&mut b, off).unwrap();
    b[0] ^= 0x20;
    f.write_all_at(&b, off).unwrap();
}

fn dir_names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> =
        std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    v.sort();
    v
}

/// Every record equals what the producer made, with the promised alignment.
fn check_contents(c: &ExpertCache, h: &CacheHeader) {
    assert_eq!(c.header(), h);
    for l in 0..h.moe_layers.len() {
        let (w13, w2) = (h.parts[l].w13_bytes as usize, h.parts[l].w2_bytes as usize);
        for e in 0..h.n_experts as usize {
            let rec = fake(l, e, w13 + w2);
            assert_eq!(c.w13(l, e), &rec[..w13], "w13 of ({l}, {e})");
            assert_eq!(c.w2(l, e), &rec[w13..], "w2 of ({l}, {e})");
            let (p, len) = c.record_ptr_range(l, e);
            assert_eq!(p as usize % 4096, 0, "record ({l}, {e}) not 4 KiB-aligned");
            assert_eq!(len % 4096, 0);
            assert_eq!(len, c.stride(l));
            assert_eq!(c.w13(l, e).as_ptr(), p);
            assert_eq!(c.w2(l, e).as_ptr() as usize % 64, 0, "w2 of ({l}, {e}) not 64-aligned");
        }
    }
    let strides: usize = (0..h.moe_layers.len()).map(|l| c.stride(l)).sum();
    assert_eq!(c.resident_bytes(), h.n_experts as usize * strides);
}

/// `open_or_build` must rebuild the bad cache (with a reason matching `expect_reason`) and the
/// result must be good.
fn assert_rebuilt(path: &Path, h: &CacheHeader, expect_reason: &str) {
    let (c, outcome) = open_or_build(path, h, &producer(h), &quiet, LoadOptions::default()).unwrap();
    match outcome {
        CacheOutcome::Built { reason } => assert!(reason.contains(expect_reason), "reason {reason:?}"),
        CacheOutcome::Hit => panic!("a bad cache was used"),
    }
    check_contents(&c, h);
    let (_, again) = open_or_build(path, h, &producer(h), &quiet, LoadOptions::default()).unwrap();
    assert_eq!(again, CacheOutcome::Hit);
}

#[test]
fn file_names() {
    assert_eq!(cache_file_name(Some(4), 128), "experts_cpu_int4_g128.bin");
    assert_eq!(cache_file_name(Some(8), 64), "experts_cpu_int8_g64.bin");
    assert_eq!(cache_file_name(None, 128), "experts_cpu_mixed_g128.bin");
}

#[test]
fn round_trip_is_byte_identical_and_aligned() {
    let tiny = sized(hdr(7), 77, 33);
    let exact = sized(hdr(8), 4096, 4096);
    for h in [hdr(1), tiny, exact, mixed(9)] {
        let d = tempfile::tempdir().unwrap();
        let p = cache_path(d.path());
        let rep = build_ok(&p, &h);
        assert_eq!(rep.records, 15);
        assert_eq!(rep.bytes, std::fs::metadata(&p).unwrap().len());
        let c = open(&p, &h, LoadOptions::default()).unwrap();
        check_contents(&c, &h);
        let r = c.load_report();
        assert!(r.verified && !r.numa_bound);
        assert_eq!(r.bytes, c.resident_bytes() as u64);
        assert_eq!(dir_names(d.path()), vec![cache_file_name(Some(4), 128)], "no temp files left behind");
    }
}

#[test]
fn on_disk_layout_matches_the_spec() {
    let d = tempfile::tempdir().unwrap();
    let p = cache_path(d.path());
    let h = hdr(0xdead_beef_0123_4567);
    build_ok(&p, &h);
    let bytes = std::fs::read(&p).unwrap();
    assert_eq!(&bytes[0..8], b"KRASISXC");
    assert_eq!(u32::from_le_bytes(bytes[8..12].try_into().unwrap()), FORMAT_VERSION);
    let header_len = u64::from_le_bytes(bytes[16..24].try_into().unwrap()) as usize;
    let json: serde_json::Value = serde_json::from_slice(&bytes[64..64 + header_len]).unwrap();
    assert_eq!(json["config_hash"], "0xdeadbeef01234567");
    assert_eq!(json["format_version"], 2);
    assert_eq!(json["checksum"], "xxh3-64");
    // w2 at round_up(6001, 64) = 6016; stride round_up(6016 + 3003, 4096) = 12288.
    for (l, layer) in [1, 3, 4].into_iter().enumerate() {
        let want = serde_json::json!({"layer": layer, "w13_bits": 4, "w2_bits": 4, "w13_bytes": 6001,
            "w2_bytes": 3003, "w2_offset": 6016, "record_stride": 12288, "layer_offset": l * 5 * 12288});
        assert_eq!(json["layers"][l], want);
    }
    assert_eq!(json["record_count"], 15);
    assert_eq!(json["records_bytes"], 15 * 12288);
    let table_offset = (64 + header_len).div_ceil(8) * 8;
    let records_offset = (table_offset + 15 * 8).div_ceil(4096) * 4096;
    assert_eq!(bytes.len(), records_offset + 15 * 12288);
    let table_xxh3 = u64::from_le_bytes(bytes[32..40].try_into().unwrap());
    assert_eq!(xxhash_rust::xxh3::xxh3_64(&bytes[table_offset..table_offset + 120]), table_xxh3);
    for i in 0..15 {
        let rec = &bytes[records_offset + i * 12288..][..12288];
        let want = fake(i / 5, i % 5, 9004);
        assert_eq!(&rec[..6001], &want[..6001]);
        assert!(rec[6001..6016].iter().all(|&b| b == 0), "padding before w2 is zero");
        assert_eq!(&rec[6016..9019], &want[6001..]);
        assert!(rec[9019..].iter().all(|&b| b == 0), "padding after w2 is zero");
        let sum = u64::from_le_bytes(bytes[table_offset + 8 * i..][..8].try_into().unwrap());
        assert_eq!(xxhash_rust::xxh3::xxh3_64(rec), sum, "record {i} checksum covers the whole stride");
    }
}

#[test]
fn progress_is_reported_in_order() {
    let d = tempfile::tempdir().unwrap();
    let h = hdr(2);
    let seen = Mutex::new(Vec::new());
    build(&cache_path(d.path()), &h, &producer(&h), &|p| seen.lock().unwrap().push(p)).unwrap();
    let seen = seen.into_inner().unwrap();
    assert_eq!(seen.len(), 15);
    for (i, p) in seen.iter().enumerate() {
        assert_eq!(p.records_done, i as u64 + 1);
        assert_eq!(p.records_total, 15);
        assert_eq!(p.bytes_done, (i as u64 + 1) * 12288);
        assert_eq!(p.layers_done, (i + 1) / 5);
        assert_eq!(p.layers_total, 3);
    }
    assert_eq!(seen.last().unwrap().bytes_done, seen.last().unwrap().bytes_total);
}

#[test]
fn truncated_file_is_detected_and_rebuilt() {
    let d = tempfile::tempdir().unwrap();
    let p = cache_path(d.path());
    let h = hdr(3);
    for keep in [None, Some(PREAMBLE_BYTES + 10), Some(10)] {
        build_ok(&p, &h);
        let len = std::fs::metadata(&p).unwrap().len();
        let new_len = keep.unwrap_or(len - 1);
        OpenOptions::new().write(true).open(&p).unwrap().set_len(new_len).unwrap();
        let err = open(&p, &h, LoadOptions::default()).unwrap_err();
        assert!(matches!(err, CacheError::SizeMismatch { actual, .. } if actual == new_len), "{err}");
        assert!(err.to_string().contains(&p.display().to_string()), "the message names the file: {err}");
        assert!(err.to_string().contains("truncated"), "{err}");
        assert_rebuilt(&p, &h, "truncated or extended");
    }
}

#[test]
fn extended_file_is_detected_and_rebuilt() {
    let d = tempfile::tempdir().unwrap();
    let p = cache_path(d.path());
    let h = hdr(4);
    build_ok(&p, &h);
    let len = std::fs::metadata(&p).unwrap().len();
    OpenOptions::new().append(true).open(&p).unwrap().write_all_at(b"junk", len).unwrap();
    let err = open(&p, &h, LoadOptions::default()).unwrap_err();
    match &err {
        CacheError::SizeMismatch { actual, expected, .. } => assert_eq!((*actual, *expected), (len + 4, len)),
        e => panic!("{e}"),
    }
    assert_rebuilt(&p, &h, &format!("file is {} bytes but the header implies {len}", len + 4));
}

#[test]
fn flipped_byte_in_a_record_names_layer_and_expert() {
    let d = tempfile::tempdir().unwrap();
    let p = cache_path(d.path());
    let h = hdr(5);
    // In w13, in w2, and in the zero padding after w2: all are inside the checksummed record.
    for (l, e, within) in [(1usize, 2usize, 17u64), (2, 4, 6016 + 3000), (0, 0, 12000)] {
        build_ok(&p, &h);
        let lay = layout_of(&p);
        flip_byte(&p, lay.record_offset(l * 5 + e) + within);
        let err = open(&p, &h, LoadOptions::default()).unwrap_err();
        match &err {
            CacheError::RecordChecksum { layer_idx, layer, expert, .. } => {
                assert_eq!((*layer_idx, *layer, *expert), (l, h.moe_layers[l], e))
            }
            e => panic!("{e}"),
        }
        let msg = err.to_string();
        assert!(msg.contains(&format!("layer {}", h.moe_layers[l])) && msg.contains(&format!("expert {e}")), "{msg}");
        assert_rebuilt(&p, &h, &format!("record checksum mismatch at layer {}", h.moe_layers[l]));
    }
}

#[test]
fn cache_from_another_config_is_stale() {
    let d = tempfile::tempdir().unwrap();
    let p = cache_path(d.path());
    let old = hdr(0x1111);
    let cases: Vec<(CacheHeader, &str, &str)> = vec![
        (hdr(0x2222), "config_hash", "stale: config_hash differs (cache 0x0000000000001111, model 0x0000000000002222)"),
        (
            CacheHeader {
                parts: vec![parts(4, 4, 6001, 3003), parts(4, 8, 6001, 3003), parts(4, 4, 6001, 3003)],
                ..old.clone()
            },
            "w2_bits",
            "stale: w2_bits differs (cache 4 at layer 3, model 8)",
        ),
        (mixed(0x1111), "w2_bits", "stale: w2_bits differs (cache 4 at layer 1, model 8)"),
        (CacheHeader { group_size_hidden: 64, ..old.clone() }, "group_size_hidden", "group_size_hidden differs"),
        (CacheHeader { moe_layers: vec![1, 2, 3], ..old.clone() }, "moe_layers", "(cache [1, 3, 4], model [1, 2, 3])"),
        (CacheHeader { layout: "cpu-other".into(), ..old.clone() }, "layout", "layout differs"),
        (CacheHeader { n_experts: 6, ..old.clone() }, "n_experts", "n_experts differs (cache 5, model 6)"),
        (sized(old.clone(), 6001, 3004), "w2_bytes", "w2_bytes differs"),
    ];
    for (new, field, reason) in cases {
        build_ok(&p, &old);
        let err = open(&p, &new, LoadOptions::default()).unwrap_err();
        match &err {
            CacheError::Stale { field: f, .. } => assert_eq!(*f, field),
            e => panic!("{e}"),
        }
        assert!(err.to_string().contains(&p.display().to_string()));
        assert_rebuilt(&p, &new, reason);
    }
}

#[test]
fn header_corruption_is_detected_and_rebuilt() {
    let d = tempfile::tempdir().unwrap();
    let p = cache_path(d.path());
    let h = hdr(6);
    type Check = fn(&CacheError) -> bool;
    type Damage = Box<dyn Fn(&Path, &Layout)>;
    let cases: Vec<(&str, Damage, Check, &str)> = vec![
        ("magic", Box::new(|p, _| flip_byte(p, 3)), |e| matches!(e, CacheError::BadMagic { .. }), "bad magic"),
        (
            "version",
            Box::new(|p, _| flip_byte(p, 8)),
            |e| matches!(e, CacheError::FormatVersion { found: 34, .. }),
            "format version 34",
        ),
        ("reserved", Box::new(|p, _| flip_byte(p, 50)), |e| matches!(e, CacheError::HeaderInvalid { .. }), "reserved"),
        (
            "header json",
            Box::new(|p, _| flip_byte(p, PREAMBLE_BYTES + 20)),
            |e| matches!(e, CacheError::HeaderChecksum { section: "header", .. }),
            "header checksum mismatch",
        ),
        (
            "header checksum",
            Box::new(|p, _| flip_byte(p, 26)),
            |e| matches!(e, CacheError::HeaderChecksum { section: "header", .. }),
            "header checksum mismatch",
        ),
        (
            "header length",
            Box::new(|p, _| flip_byte(p, 17)),
            |e| matches!(e, CacheError::HeaderChecksum { .. } | CacheError::SizeMismatch { .. }),
            "damaged",
        ),
        (
            "checksum table",
            Box::new(|p, lay| flip_byte(p, lay.table_offset + 8 * 7 + 3)),
            |e| matches!(e, CacheError::HeaderChecksum { section: "checksum table", .. }),
            "checksum table checksum mismatch",
        ),
        (
            "zeroed preamble (never finished)",
            Box::new(|p, _| OpenOptions::new().write(true).open(p).unwrap().write_all_at(&[0; 64], 0).unwrap()),
            |e| matches!(e, CacheError::BadMagic { .. }),
            "bad magic",
        ),
    ];
    for (what, damage, check, reason) in cases {
        build_ok(&p, &h);
        damage(&p, &layout_of(&p));
        let err = open(&p, &h, LoadOptions::default()).unwrap_err();
        assert!(check(&err), "{what}: {err}");
        assert!(err.is_rebuildable(), "{what}");
        assert!(err.to_string().contains(&p.display().to_string()), "{what}: {err}");
        assert_rebuilt(&p, &h, reason);
    }
}

#[test]
fn a_build_in_progress_is_listed_for_removal_until_its_rename_or_its_failure() {
    let d = tempfile::tempdir().unwrap();
    let p = cache_path(d.path());
    let tmp = crate::build::tmp_path(&p);
    let h = hdr(7);
    let seen = Mutex::new(Vec::new());
    let produce = |l: usize, e: usize| {
        seen.lock().unwrap().push(temp_files_in_progress().contains(&tmp) && tmp.exists());
        Ok(fake(l, e, record_len(&h, l)))
    };
    build(&p, &h, &produce, &quiet).unwrap();
    let seen = seen.into_inner().unwrap();
    assert!(!seen.is_empty() && seen.iter().all(|&s| s), "the temp file is listed while the build runs");
    assert!(!temp_files_in_progress().contains(&tmp), "renamed into place: no longer listed");
    assert!(p.is_file() && !tmp.exists());

    // A failing build removes its temp file and leaves the list.
    let bad = |_: usize, _: usize| -> Result<Vec<u8>, String> { Err("no".into()) };
    build(&d.path().join("other.bin"), &h, &bad, &quiet).unwrap_err();
    assert!(!temp_files_in_progress().iter().any(|t| t.starts_with(d.path())));
    assert_eq!(dir_names(d.path()), vec![cache_file_name(Some(4), 128)]);
}

#[test]
fn write_interrupted_before_rename_is_rebuilt_and_cleaned() {
    let d = tempfile::tempdir().unwrap();
    let p = cache_path(d.path());
    let h = hdr(7);
    let name = cache_file_name(Some(4), 128);
    // An interrupted build: a partial temp file of a process that no longer exists, no final file.
    let dead = d.path().join(format!("{name}.tmp.999999999"));
    std::fs::write(&dead, fake(0, 0, 10000)).unwrap();
    // A concurrent build's temp file (pid 1 is alive) and an unrelated file stay.
    let live = d.path().join(format!("{name}.tmp.1"));
    std::fs::write(&live, b"partial").unwrap();
    let other = d.path().join(format!("{name}.tmp.notapid"));
    std::fs::write(&other, b"x").unwrap();

    assert!(matches!(open(&p, &h, LoadOptions::default()), Err(CacheError::Missing { .. })));
    assert_rebuilt(&p, &h, "missing");
    assert!(!dead.exists(), "the interrupted build's temp file is removed");
    assert!(live.exists() && other.exists());

    // Interrupted while a good cache exists: the old cache is untouched and used, the temp removed.
    std::fs::write(&dead, b"partial").unwrap();
    let (c, outcome) = open_or_build(&p, &h, &producer(&h), &quiet, LoadOptions::default()).unwrap();
    assert_eq!(outcome, CacheOutcome::Hit);
    check_contents(&c, &h);
    assert!(!dead.exists());
}

#[test]
fn produce_error_leaves_no_file() {
    let d = tempfile::tempdir().unwrap();
    let p = cache_path(d.path());
    let h = hdr(8);
    let good = producer(&h);
    let failing =
        |l: usize, e: usize| if (l, e) == (1, 2) { Err("source tensor missing".to_string()) } else { good(l, e) };
    let err = build(&p, &h, &failing, &quiet).unwrap_err();
    match &err {
        CacheError::Produce { layer_idx: 1, layer: 3, expert: 2, message, .. } => {
            assert_eq!(message, "source tensor missing")
        }
        e => panic!("{e}"),
    }
    assert!(dir_names(d.path()).is_empty(), "no final file, no temp file: {:?}", dir_names(d.path()));

    // Through open_or_build: returned, not retried; an old (stale) cache is left as it was.
    let err = open_or_build(&p, &h, &failing, &quiet, LoadOptions::default()).unwrap_err();
    assert!(matches!(err, CacheError::Produce { .. }) && !err.is_rebuildable());
    assert!(dir_names(d.path()).is_empty());
    build_ok(&p, &hdr(9));
    let before = std::fs::read(&p).unwrap();
    assert!(open_or_build(&p, &h, &failing, &quiet, LoadOptions::default()).is_err());
    assert_eq!(dir_names(d.path()), vec![cache_file_name(Some(4), 128)]);
    assert_eq!(std::fs::read(&p).unwrap(), before);

    // A record of the wrong size is a producer error too.
    let short = |l: usize, e: usize| {
        good(l, e).map(|mut v| {
            v.pop();
            v
        })
    };
    let err = build(&d.path().join("x.bin"), &h, &short, &quiet).unwrap_err();
    assert!(err.to_string().contains("record is 9003 bytes, expected 9004"), "{err}");
    assert_eq!(dir_names(d.path()), vec![cache_file_name(Some(4), 128)]);
}

#[test]
fn produce_panic_removes_the_temp_file() {
    let d = tempfile::tempdir().unwrap();
    let p = cache_path(d.path());
    let h = hdr(10);
    let good = producer(&h);
    let panicking = |l: usize, e: usize| {
        assert!((l, e) != (2, 0), "boom");
        good(l, e)
    };
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| build(&p, &h, &panicking, &quiet)));
    assert!(r.is_err());
    assert!(dir_names(d.path()).is_empty(), "{:?}", dir_names(d.path()));
}

#[test]
fn build_streams_one_layer_at_a_time() {
    let d = tempfile::tempdir().unwrap();
    let p = cache_path(d.path());
    let h = sized(CacheHeader { n_experts: 16, moe_layers: vec![0, 1, 2, 3, 4, 5], ..hdr(11) }, 6001, 3003);
    let n = 16;
    let len = record_len(&h, 0);
    let w13 = h.parts[0].w13_bytes as usize;
    let started: Vec<AtomicUsize> = (0..6).map(|_| AtomicUsize::new(0)).collect();
    let finished: Vec<AtomicUsize> = (0..6).map(|_| AtomicUsize::new(0)).collect();
    let tmp = crate::build::tmp_path(&p);
    let violations = Mutex::new(Vec::<String>::new());
    let produce = |l: usize, e: usize| {
        started[l].fetch_add(1, Ordering::SeqCst);
        if l + 1 < 6 && started[l + 1].load(Ordering::SeqCst) > 0 {
            violations.lock().unwrap().push(format!("layer {} started before layer {l}", l + 1));
        }
        if l > 0 {
            // The whole previous layer was produced and is already in the file at its offset.
            if finished[l - 1].load(Ordering::SeqCst) != n {
                violations.lock().unwrap().push(format!("layer {l} started before layer {} finished", l - 1));
            }
            let f = File::open(&tmp).unwrap();
            let mut hd = [0u8; 64];
            f.read_exact_at(&mut hd, 0).unwrap();
            let header_len = u64::from_le_bytes(hd[16..24].try_into().unwrap()) as usize;
            // The header is not written yet (preamble still zero): compute the offsets ourselves.
            assert_eq!(header_len, 0);
            let json = crate::format::header_json(&h).unwrap();
            let lay = Layout::new(&h, json.len() as u64).unwrap();
            let mut rec = vec![0u8; w13];
            f.read_exact_at(&mut rec, lay.record_offset((l - 1) * n + (e % n))).unwrap();
            if rec[..] != fake(l - 1, e % n, len)[..w13] {
                violations.lock().unwrap().push(format!("record ({}, {e}) not written before layer {l}", l - 1));
            }
        }
        let r = fake(l, e, len);
        finished[l].fetch_add(1, Ordering::SeqCst);
        Ok(r)
    };
    build(&p, &h, &produce, &quiet).unwrap();
    assert_eq!(violations.into_inner().unwrap(), Vec::<String>::new());
    assert!(started.iter().all(|s| s.load(Ordering::SeqCst) == n), "each record produced exactly once");
    check_contents(&open(&p, &h, LoadOptions::default()).unwrap(), &h);
}

#[test]
fn io_errors_are_returned_not_rebuilt() {
    let d = tempfile::tempdir().unwrap();
    // The "directory" is a regular file: not a cache problem, nothing to rebuild.
    let not_dir = d.path().join("plainfile");
    std::fs::write(&not_dir, b"x").unwrap();
    let p = not_dir.join(cache_file_name(Some(4), 128));
    let h = hdr(12);
    let err = open_or_build(&p, &h, &producer(&h), &quiet, LoadOptions::default()).unwrap_err();
    assert!(matches!(err, CacheError::Io { .. }) && !err.is_rebuildable(), "{err}");
    let err = build(&p, &h, &producer(&h), &quiet).unwrap_err();
    assert!(matches!(err, CacheError::Io { op: "create cache directory", .. }), "{err}");
}

#[test]
fn failed_rebuild_of_a_damaged_cache_says_it_was_damaged() {
    let d = tempfile::tempdir().unwrap();
    let p = cache_path(d.path());
    let h = hdr(17);
    build_ok(&p, &h);
    flip_byte(&p, 0);
    // The rebuild cannot create its temp file (a directory is in the way; root ignores
    // permissions, so a read-only directory would not do here).
    std::fs::create_dir(crate::build::tmp_path(&p)).unwrap();
    let err = open_or_build(&p, &h, &producer(&h), &quiet, LoadOptions::default()).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, CacheError::Rebuild { .. }) && err.is_location(), "{msg}");
    assert!(msg.contains("was found damaged: bad magic") && msg.contains("rebuilding it failed"), "{msg}");
    // A missing cache that cannot be built is just the build's error.
    std::fs::remove_file(&p).unwrap();
    let err = open_or_build(&p, &h, &producer(&h), &quiet, LoadOptions::default()).unwrap_err();
    assert!(matches!(err, CacheError::Io { .. }), "{err}");
}

#[test]
fn invalid_headers_are_refused_by_build() {
    let d = tempfile::tempdir().unwrap();
    let p = cache_path(d.path());
    for bad in [
        sized(hdr(13), 0, 3003),
        CacheHeader { parts: vec![parts(4, 4, 6001, 3003); 2], ..hdr(13) },
        CacheHeader { n_experts: 0, ..hdr(13) },
        CacheHeader { moe_layers: vec![], ..hdr(13) },
        CacheHeader { format_version: FORMAT_VERSION + 1, ..hdr(13) },
        sized(hdr(13), 6001, u64::MAX - 10),
        sized(hdr(13), 6001, u64::MAX / 8),
    ] {
        let err = build(&p, &bad, &producer(&hdr(13)), &quiet).unwrap_err();
        assert!(matches!(err, CacheError::InvalidRequest(_)), "{err}");
    }
    assert!(dir_names(d.path()).is_empty());
}

#[test]
fn build_refuses_early_without_disk_space() {
    let d = tempfile::tempdir().unwrap();
    let p = cache_path(d.path());
    let h = sized(CacheHeader { n_experts: 1, moe_layers: vec![0], ..hdr(16) }, 1 << 50, 3003);
    let err = build(&p, &h, &|_, _| panic!("nothing is produced"), &quiet).unwrap_err();
    assert!(matches!(err, CacheError::NoSpace { needed, .. } if needed > 1 << 50), "{err}");
    assert!(err.to_string().contains("not enough disk space"), "{err}");
    assert!(dir_names(d.path()).is_empty());
}

#[test]
fn placement_and_load_options() {
    let d = tempfile::tempdir().unwrap();
    let p = cache_path(d.path());
    let h = hdr(14);
    build_ok(&p, &h);
    // Node 0 exists everywhere; a kernel without NUMA reports numa_bound = false.
    let calls = AtomicUsize::new(0);
    let node0 = |_l: usize, _e: usize| {
        calls.fetch_add(1, Ordering::SeqCst);
        Some(0)
    };
    let c = open(&p, &h, LoadOptions { placement: Some(&node0), ..Default::default() }).unwrap();
    check_contents(&c, &h);
    assert_eq!(calls.load(Ordering::SeqCst), 15, "placement asked once per record");
    eprintln!("{}", describe(&c));
    let none = |_l: usize, _e: usize| None;
    let c = open(&p, &h, LoadOptions { placement: Some(&none), huge_pages: false, verify: false }).unwrap();
    check_contents(&c, &h);
    assert!(!c.load_report().numa_bound && !c.load_report().verified);
}

#[test]
fn describe_is_one_line() {
    let d = tempfile::tempdir().unwrap();
    let p = cache_path(d.path());
    let h = hdr(15);
    let (c, _) = open_or_build(&p, &h, &producer(&h), &quiet, LoadOptions::default()).unwrap();
    let s = describe(&c);
    assert!(!s.contains('\n'));
    for part in [&p.display().to_string()[..], "GB/s", "THP", "NUMA bound: no", "3 MoE layers × 5 experts"] {
        assert!(s.contains(part), "{part:?} missing from {s:?}");
    }
}

#[test]
fn default_cache_dir_prefers_the_model_directory() {
    let d = tempfile::tempdir().unwrap();
    let model = d.path().join("model");
    std::fs::create_dir(&model).unwrap();
    assert_eq!(default_cache_dir(&model), model.join(".krasis_cache"));
    assert!(!model.join(".krasis_cache").exists(), "looking for the cache directory does not create it");
    assert_eq!(dir_names(&model), Vec::<String>::new(), "the probe file is removed");
    std::fs::create_dir(model.join(".krasis_cache")).unwrap();
    assert_eq!(default_cache_dir(&model), model.join(".krasis_cache"));
    assert_eq!(dir_names(&model.join(".krasis_cache")), Vec::<String>::new(), "the probe file is removed");
    // A model directory that does not exist is not created either.
    let absent = d.path().join("absent");
    let chosen = crate::default_cache_dir_with(&absent, Some("/xdg".into()), None);
    assert!(chosen.starts_with("/xdg/krasis") && !absent.exists(), "{}", chosen.display());
    // `.krasis_cache` taken by a file: the per-user directory.
    let odd = d.path().join("odd");
    std::fs::create_dir(&odd).unwrap();
    std::fs::write(odd.join(".krasis_cache"), b"x").unwrap();
    assert!(crate::default_cache_dir_with(&odd, Some("/xdg".into()), None).starts_with("/xdg/krasis"));
    let dirs = crate::model_cache_dirs(&odd);
    assert_eq!((dirs.len(), &dirs[0]), (2, &odd.join(".krasis_cache")));

    // Not writable (here: below a regular file, since root ignores permissions): per-user dir.
    let file = d.path().join("file");
    std::fs::write(&file, b"x").unwrap();
    let model = file.join("model");
    let xdg = crate::default_cache_dir_with(&model, Some("/xdg".into()), Some("/home/u".into()));
    assert!(xdg.starts_with("/xdg/krasis"), "{}", xdg.display());
    let hash = xdg.file_name().unwrap().to_str().unwrap();
    assert!(hash.len() == 16 && hash.chars().all(|c| c.is_ascii_hexdigit()), "{hash}");
    let home = crate::default_cache_dir_with(&model, Some("relative".into()), Some("/home/u".into()));
    assert_eq!(home, Path::new("/home/u/.cache/krasis").join(hash));
    let other = crate::default_cache_dir_with(&file.join("other"), None, Some("/home/u".into()));
    assert_ne!(other, home, "different models get different directories");
}

/// A cache file written by hand: `version` in the preamble, `json` as the header (checksummed as a
/// writer would), an all-zero checksum table of `records` entries and `records_bytes` of zeros.
fn write_raw_cache(path: &Path, version: u32, json: &[u8], records: u64, records_bytes: u64) {
    let table_offset = (64 + json.len() as u64).div_ceil(8) * 8;
    let records_offset = (table_offset + 8 * records).div_ceil(4096) * 4096;
    let table = vec![0u8; 8 * records as usize];
    let mut pre = [0u8; 64];
    pre[0..8].copy_from_slice(b"KRASISXC");
    pre[8..12].copy_from_slice(&version.to_le_bytes());
    pre[16..24].copy_from_slice(&(json.len() as u64).to_le_bytes());
    pre[24..32].copy_from_slice(&xxhash_rust::xxh3::xxh3_64(json).to_le_bytes());
    pre[32..40].copy_from_slice(&xxhash_rust::xxh3::xxh3_64(&table).to_le_bytes());
    let f = File::create(path).unwrap();
    f.set_len(records_offset + records_bytes).unwrap();
    f.write_all_at(&pre, 0).unwrap();
    f.write_all_at(json, 64).unwrap();
    f.write_all_at(&table, table_offset).unwrap();
}

/// The header of a version-1 cache (one `bits` and one record size per cache) for `hdr(..)`.
fn v1_json(config_hash: u64) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "format_version": 1, "layout": "test-v1", "config_hash": format!("{config_hash:#018x}"), "bits": 4,
        "group_size_hidden": 128, "group_size_intermediate": 64, "hidden": 256, "intermediate": 96,
        "n_experts": 5, "moe_layers": [1, 3, 4], "w13_bytes": 6001, "w2_bytes": 3003, "w2_offset": 6016,
        "record_stride": 12288, "record_count": 15, "record_order": "layer-major, expert-minor",
        "checksum": "xxh3-64", "writer": "krasis-cache 0.1.0"
    }))
    .unwrap()
}

/// A cache of format version 1 (one width per cache) is refused by its version before its header
/// is read, and rebuilt; a version-1 header behind a version-2 preamble is refused as invalid,
/// never read as a version-2 one.
#[test]
fn version_1_cache_is_rejected_and_rebuilt() {
    let d = tempfile::tempdir().unwrap();
    let p = cache_path(d.path());
    let h = hdr(0x77);
    write_raw_cache(&p, 1, &v1_json(0x77), 15, 15 * 12288);
    let err = open(&p, &h, LoadOptions::default()).unwrap_err();
    assert!(matches!(err, CacheError::FormatVersion { found: 1, supported: 2, .. }), "{err}");
    let msg = err.to_string();
    assert!(msg.contains("format version 1; this build reads version 2") && msg.contains(&p.display().to_string()));
    assert_rebuilt(&p, &h, "stale: format version 1 (this build reads 2)");

    write_raw_cache(&p, FORMAT_VERSION, &v1_json(0x77), 15, 15 * 12288);
    let err = open(&p, &h, LoadOptions::default()).unwrap_err();
    assert!(matches!(&err, CacheError::HeaderInvalid { detail, .. } if detail.contains("unknown field")), "{err}");
    assert_rebuilt(&p, &h, "damaged: invalid header");
}

/// Header fields that a writer derives (offsets, strides, counts) must agree with the record
/// sizes, layer by layer; a header that lies about them is refused even with a valid checksum.
#[test]
fn header_geometry_that_disagrees_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let p = cache_path(d.path());
    let h = mixed(0x88);
    build_ok(&p, &h);
    let bytes = std::fs::read(&p).unwrap();
    let header_len = u64::from_le_bytes(bytes[16..24].try_into().unwrap()) as usize;
    let good: serde_json::Value = serde_json::from_slice(&bytes[64..64 + header_len]).unwrap();
    let records_bytes = good["records_bytes"].as_u64().unwrap();
    type Edit = fn(&mut serde_json::Value);
    let cases: [(&str, Edit, &str); 6] = [
        (
            "layer_offset",
            |j| j["layers"][2]["layer_offset"] = 0.into(),
            "layer 4: w2_offset/record_stride/layer_offset",
        ),
        ("record_stride", |j| j["layers"][1]["record_stride"] = 4096.into(), "layer 3: w2_offset/record_stride"),
        ("records_bytes", |j| j["records_bytes"] = 4096.into(), "record_count/records_bytes"),
        ("no layers", |j| j["layers"] = serde_json::json!([]), "no records"),
        ("empty part", |j| j["layers"][0]["w2_bytes"] = 0.into(), "empty record part at layer 1"),
        ("huge part", |j| j["layers"][0]["w13_bytes"] = u64::MAX.into(), "overflow"),
    ];
    for (what, edit, detail_part) in cases {
        let mut j = good.clone();
        edit(&mut j);
        write_raw_cache(&p, FORMAT_VERSION, &serde_json::to_vec(&j).unwrap(), 15, records_bytes);
        let err = open(&p, &h, LoadOptions::default()).unwrap_err();
        match &err {
            CacheError::HeaderInvalid { detail, .. } => assert!(detail.contains(detail_part), "{what}: {detail}"),
            e => panic!("{what}: {e}"),
        }
        assert_rebuilt(&p, &h, "damaged: invalid header");
    }
}

/// Mixed widths: each layer's records have their own size and stride, all 4 KiB-aligned, and
/// the log line names the widths.
#[test]
fn mixed_widths_round_trip_with_per_layer_strides() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join(cache_file_name(None, 128));
    let h = mixed(0x99);
    assert_eq!(h.uniform_bits(), None);
    assert_eq!(hdr(1).uniform_bits(), Some(4));
    let (c, outcome) = open_or_build(&p, &h, &producer(&h), &quiet, LoadOptions::default()).unwrap();
    assert!(matches!(outcome, CacheOutcome::Built { .. }));
    check_contents(&c, &h);
    // w2 of layer 0: round_up(6001, 64) + 5990 = 12006 → 12288; layer 2: 12032 + 5990 → 20480.
    assert_eq!((c.stride(0), c.stride(1), c.stride(2)), (12288, 12288, 20480));
    assert_eq!((c.w2_offset(0), c.w2_offset(2)), (6016, 12032));
    assert_eq!(c.resident_bytes(), 5 * (12288 + 12288 + 20480));
    assert_eq!(
        h.bits_summary(),
        "w13 int4 / w2 int8 × 1 layer, w13 int4 / w2 int4 × 1 layer, w13 int8 / w2 int8 × 1 layer"
    );
    assert_eq!(hdr(1).bits_summary(), "int4");
    for (layout, want) in [
        ("cpu-rb16-mxfp4-v1", "mxfp4"),
        ("gpu-tile64-nvfp4-v1", "nvfp4"),
        ("cpu-rb16-int4a-g32-v1", "int4a"),
        ("cpu-rb16-ggml-v1", "ggml"),
    ] {
        let h = CacheHeader { layout: layout.into(), ..hdr(1) };
        assert_eq!(h.bits_summary(), want, "{layout}");
    }
    assert_eq!(
        describe_widths(&[(4, 8), (4, 4), (4, 8)]),
        "w13 int4 / w2 int8 × 2 layers, w13 int4 / w2 int4 × 1 layer"
    );
    assert!(describe(&c).contains("w13 int4 / w2 int8 × 1 layer"), "{}", describe(&c));
    let (_, again) = open_or_build(&p, &h, &producer(&h), &quiet, LoadOptions::default()).unwrap();
    assert_eq!(again, CacheOutcome::Hit);
    // A flipped byte in the last layer's record is found there.
    let lay = layout_of(&p);
    flip_byte(&p, lay.record_offset(2 * 5 + 3) + 12040);
    let err = open(&p, &h, LoadOptions::default()).unwrap_err();
    assert!(matches!(err, CacheError::RecordChecksum { layer_idx: 2, layer: 4, expert: 3, .. }), "{err}");
}

/// Two caches of different record sizes (a CPU and a GPU layout) built in one pass: each record
/// produced once, both files as `build` writes them, progress over both.
#[test]
fn build_many_writes_every_cache_in_one_pass() {
    let d = tempfile::tempdir().unwrap();
    let (pa, pb) = (d.path().join("a.bin"), d.path().join("b.bin"));
    let (ha, hb) = (hdr(11), CacheHeader { layout: "other-v1".into(), ..mixed(11) });
    let calls = AtomicUsize::new(0);
    let both = |l: usize, e: usize| {
        calls.fetch_add(1, Ordering::Relaxed);
        Ok(vec![fake(l, e, record_len(&ha, l)), fake(l, e, record_len(&hb, l))])
    };
    let seen = Mutex::new(Vec::new());
    let reports = build_many(&[(&pa, &ha), (&pb, &hb)], &both, &|p| seen.lock().unwrap().push(p)).unwrap();
    assert_eq!(calls.load(Ordering::Relaxed), 15, "one produce call per (layer, expert)");
    assert_eq!(reports.len(), 2);
    assert_eq!((reports[0].path.as_path(), reports[1].path.as_path()), (pa.as_path(), pb.as_path()));
    for (p, h, r) in [(&pa, &ha, &reports[0]), (&pb, &hb, &reports[1])] {
        assert_eq!(r.bytes, std::fs::metadata(p).unwrap().len());
        let (c, outcome) = open_or_build(p, h, &producer(h), &quiet, LoadOptions::default()).unwrap();
        assert_eq!(outcome, CacheOutcome::Hit);
        check_contents(&c, h);
    }
    // Byte for byte what `build` writes alone.
    let alone = d.path().join("alone.bin");
    build_ok(&alone, &hb);
    assert_eq!(std::fs::read(&alone).unwrap(), std::fs::read(&pb).unwrap());
    let seen = seen.into_inner().unwrap();
    let last = seen.last().unwrap();
    assert_eq!((last.records_done, last.records_total), (15, 15));
    assert_eq!(last.bytes_done, last.bytes_total);
    assert_eq!(last.bytes_total, layout_of(&pa).records_bytes + layout_of(&pb).records_bytes);
}

/// A failure in any target's record leaves no file of any target; caches over other layers are
/// refused before anything is written.
#[test]
fn build_many_is_all_or_nothing() {
    let d = tempfile::tempdir().unwrap();
    let (pa, pb) = (d.path().join("a.bin"), d.path().join("b.bin"));
    let (ha, hb) = (hdr(12), mixed(12));
    let short_b = |l: usize, e: usize| {
        let mut b = fake(l, e, record_len(&hb, l));
        if (l, e) == (2, 4) {
            b.pop();
        }
        Ok(vec![fake(l, e, record_len(&ha, l)), b])
    };
    let err = build_many(&[(&pa, &ha), (&pb, &hb)], &short_b, &quiet).unwrap_err();
    match &err {
        CacheError::Produce { path, layer_idx: 2, expert: 4, message, .. } => {
            assert_eq!(path, &pb);
            assert!(message.contains("record is"), "{message}");
        }
        e => panic!("{e}"),
    }
    assert!(dir_names(d.path()).is_empty(), "{:?}", dir_names(d.path()));
    let one_short = |l: usize, e: usize| Ok(vec![fake(l, e, record_len(&ha, l))]);
    let err = build_many(&[(&pa, &ha), (&pb, &hb)], &one_short, &quiet).unwrap_err();
    assert!(err.to_string().contains("1 records for 2 caches"), "{err}");
    let other_layers = CacheHeader { moe_layers: vec![1, 2, 4], ..hdr(12) };
    let err = build_many(&[(&pa, &ha), (&pb, &other_layers)], &short_b, &quiet).unwrap_err();
    assert!(matches!(err, CacheError::InvalidRequest(_)), "{err}");
    assert!(build_many(&[], &short_b, &quiet).is_err());
    assert!(dir_names(d.path()).is_empty());
}
