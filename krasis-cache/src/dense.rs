//! The dense-weight cache (`dense_cpu_int{b}_g{gs}.bin`): every dense linear the CPU engine
//! quantises (`--cpu-dense-bits`), packed, so a cached start reads them at disk or page-cache
//! speed instead of quantising them again. Same container as the expert cache
//! (`container`: preamble, JSON header, checksum table, 4 KiB-aligned data; atomic write;
//! every damage detected and the file rebuilt), with named entries of different sizes instead of
//! uniform records. The entries' bytes are opaque here; the caller names, sizes and produces them.
//! Specified in docs/FORMATS.md.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use krasis_core::budget::format_bytes;
use krasis_core::memory::{huge_page_bytes, PageBuffer};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::Xxh3;

use crate::build::{drop_page_cache, finish_writeback_and_drop};
use crate::container::{check_common_fields, read_checksum_table, read_hashed, read_preamble_and_header, AtomicWrite};
use crate::format::{round_up, CHECKSUM_NAME, PREAMBLE_BYTES};
use crate::load::reopen;
use crate::{BuildReport, CacheError, CacheOutcome, LoadReport};

/// How every dense-weight cache file name starts (messages tell the two caches apart by it).
pub const FILE_PREFIX: &str = "dense_";
/// First eight bytes of every dense-weight cache file.
pub const DENSE_MAGIC: [u8; 8] = *b"KRASISDC";
/// Version of the layout in docs/FORMATS.md; a file of another version is stale.
pub const DENSE_FORMAT_VERSION: u32 = 2;
/// Alignment of every entry in the file and in memory: whole pages, so an entry is read straight
/// into its place and starts on a cache line (the packed kernels' chunks are 64-byte aligned).
pub const ENTRY_ALIGN: u64 = 4096;

/// `dense_cpu_int{bits}_g{group_size}.bin`
pub fn dense_cache_file_name(bits: u8, group_size: u32) -> String {
    format!("{FILE_PREFIX}cpu_int{bits}_g{group_size}.bin")
}

/// One packed matrix: its tensor name, shape, the group size chosen for it and its packed size.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DenseEntry {
    pub name: String,
    pub rows: u64,
    pub cols: u64,
    pub group_size: u32,
    pub bytes: u64,
}

/// What a dense-weight cache holds and how it was made; `open_dense` refuses a file whose header
/// differs from the one the caller expects.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DenseHeader {
    /// Must be [`DENSE_FORMAT_VERSION`].
    pub format_version: u32,
    /// Packed layout name, e.g. `"cpu-rb16-v1"`.
    pub layout: String,
    /// The model's fingerprint (the expert cache's key).
    pub config_hash: u64,
    pub bits: u8,
    /// The group size asked for (each entry records the one it got).
    pub group_size: u32,
    /// In the order the engine builds them.
    pub entries: Vec<DenseEntry>,
}

/// The JSON header as stored.
#[derive(Serialize, Deserialize)]
struct DiskHeader {
    format_version: u32,
    layout: String,
    config_hash: String,
    bits: u8,
    group_size: u32,
    entry_align: u64,
    entries: Vec<DiskEntry>,
    data_bytes: u64,
    checksum: String,
    writer: String,
}

#[derive(Serialize, Deserialize)]
struct DiskEntry {
    #[serde(flatten)]
    entry: DenseEntry,
    /// From the start of the data section.
    offset: u64,
}

/// Where everything lies in a file with a given header.
#[derive(Clone, Debug, PartialEq, Eq)]
struct DenseLayout {
    /// Offset of each entry from the start of the data section.
    offsets: Vec<u64>,
    data_bytes: u64,
    table_offset: u64,
    data_offset: u64,
    file_len: u64,
}

impl DenseLayout {
    fn new(h: &DenseHeader, header_len: u64) -> Result<DenseLayout, String> {
        if h.entries.is_empty() {
            return Err("no entries".into());
        }
        let overflow = || "entry sizes overflow".to_string();
        let mut offsets = Vec::with_capacity(h.entries.len());
        let mut at = 0u64;
        for e in &h.entries {
            if e.bytes == 0 {
                return Err(format!("entry `{}` is empty", e.name));
            }
            offsets.push(at);
            at = round_up(e.bytes, ENTRY_ALIGN).and_then(|b| b.checked_add(at)).ok_or_else(overflow)?;
        }
        let count = h.entries.len() as u64;
        let table_offset = round_up(PREAMBLE_BYTES + header_len, 8).ok_or_else(overflow)?;
        let data_offset = count
            .checked_mul(8)
            .and_then(|t| t.checked_add(table_offset))
            .and_then(|t| round_up(t, ENTRY_ALIGN))
            .ok_or_else(overflow)?;
        let file_len = data_offset.checked_add(at).ok_or_else(overflow)?;
        if usize::try_from(at).is_err() {
            return Err(overflow());
        }
        Ok(DenseLayout { offsets, data_bytes: at, table_offset, data_offset, file_len })
    }

    /// The padded span of entry `i` in the data section.
    fn span(&self, i: usize) -> std::ops::Range<usize> {
        let end = self.offsets.get(i + 1).copied().unwrap_or(self.data_bytes);
        self.offsets[i] as usize..end as usize
    }
}

fn header_json(h: &DenseHeader, layout: &DenseLayout) -> Result<Vec<u8>, String> {
    let d = DiskHeader {
        format_version: h.format_version,
        layout: h.layout.clone(),
        config_hash: format!("{:#018x}", h.config_hash),
        bits: h.bits,
        group_size: h.group_size,
        entry_align: ENTRY_ALIGN,
        entries: h
            .entries
            .iter()
            .zip(&layout.offsets)
            .map(|(e, &o)| DiskEntry { entry: e.clone(), offset: o })
            .collect(),
        data_bytes: layout.data_bytes,
        checksum: CHECKSUM_NAME.into(),
        writer: concat!("krasis-cache ", env!("CARGO_PKG_VERSION")).into(),
    };
    serde_json::to_vec(&d).map_err(|e| e.to_string())
}

fn parse_header_json(bytes: &[u8], header_len: u64) -> Result<(DenseHeader, DenseLayout), String> {
    let d: DiskHeader = serde_json::from_slice(bytes).map_err(|e| format!("not a valid header: {e}"))?;
    let config_hash = check_common_fields(&d.config_hash, d.format_version, DENSE_FORMAT_VERSION, &d.checksum)?;
    if d.entry_align != ENTRY_ALIGN {
        return Err(format!("entry_align {}, expected {ENTRY_ALIGN}", d.entry_align));
    }
    let offsets: Vec<u64> = d.entries.iter().map(|e| e.offset).collect();
    let h = DenseHeader {
        format_version: d.format_version,
        layout: d.layout,
        config_hash,
        bits: d.bits,
        group_size: d.group_size,
        entries: d.entries.into_iter().map(|e| e.entry).collect(),
    };
    let layout = DenseLayout::new(&h, header_len)?;
    if offsets != layout.offsets || d.data_bytes != layout.data_bytes {
        return Err("entry offsets or data_bytes disagree with the entry sizes".into());
    }
    Ok((h, layout))
}

/// The first field in which `cache` differs from `expected`: `(field, cache value, expected value)`.
fn first_difference(cache: &DenseHeader, expected: &DenseHeader) -> Option<(&'static str, String, String)> {
    if cache.config_hash != expected.config_hash {
        let hex = |v: u64| format!("{v:#018x}");
        return Some(("config_hash", hex(cache.config_hash), hex(expected.config_hash)));
    }
    let pairs: [(&'static str, String, String); 5] = [
        ("format_version", cache.format_version.to_string(), expected.format_version.to_string()),
        ("layout", format!("{:?}", cache.layout), format!("{:?}", expected.layout)),
        ("bits", cache.bits.to_string(), expected.bits.to_string()),
        ("group_size", cache.group_size.to_string(), expected.group_size.to_string()),
        ("entries", cache.entries.len().to_string(), expected.entries.len().to_string()),
    ];
    if let Some(d) = pairs.into_iter().find(|(_, a, b)| a != b) {
        return Some(d);
    }
    let show = |e: &DenseEntry| format!("`{}` [{}, {}] g{} {} bytes", e.name, e.rows, e.cols, e.group_size, e.bytes);
    cache.entries.iter().zip(&expected.entries).find(|(a, b)| a != b).map(|(a, b)| ("entry", show(a), show(b)))
}

/// Produces the packed bytes of entry `i` (exactly `entries[i].bytes` of them).
pub type DenseProduce<'a> = dyn Fn(usize) -> Result<Vec<u8>, String> + Sync + 'a;

/// Progress of a build or a load: `(bytes done, bytes total)`.
pub type ByteProgress<'a> = dyn Fn(u64, u64) + Sync + 'a;

/// Builds the cache at `path` for `header`, calling `produce(i)` for each entry in order (one
/// entry in memory at a time; its page-cache copy is dropped once written back). Atomic: the
/// file is `<path>.tmp.<pid>` until complete, then renamed; an error or a panic removes it.
pub fn build_dense(
    path: &Path,
    header: &DenseHeader,
    produce: &DenseProduce<'_>,
    progress: &ByteProgress<'_>,
) -> Result<BuildReport, CacheError> {
    let t0 = Instant::now();
    if header.format_version != DENSE_FORMAT_VERSION {
        return Err(CacheError::InvalidRequest(format!(
            "format_version {} (this build writes {DENSE_FORMAT_VERSION})",
            header.format_version
        )));
    }
    // Entry offsets are relative to the data section, so the header's JSON does not depend on
    // its own length.
    let json = header_json(header, &DenseLayout::new(header, 0).map_err(CacheError::InvalidRequest)?)
        .map_err(CacheError::InvalidRequest)?;
    let layout = DenseLayout::new(header, json.len() as u64).map_err(CacheError::InvalidRequest)?;
    let out = AtomicWrite::create(path, layout.file_len)?;
    let file = out.file();
    let mut sums = Vec::with_capacity(header.entries.len());
    for (i, e) in header.entries.iter().enumerate() {
        let produce_err =
            |message: String| CacheError::ProduceEntry { path: path.to_path_buf(), name: e.name.clone(), message };
        let bytes = produce(i).map_err(produce_err)?;
        if bytes.len() as u64 != e.bytes {
            return Err(produce_err(format!("produced {} bytes, expected {}", bytes.len(), e.bytes)));
        }
        let span = layout.span(i);
        let mut h = Xxh3::new();
        h.update(&bytes);
        let mut pad = span.len() - bytes.len();
        while pad > 0 {
            let n = pad.min(ZEROS.len());
            h.update(&ZEROS[..n]);
            pad -= n;
        }
        sums.push(h.digest());
        let off = layout.data_offset + span.start as u64;
        // The padding is already zero: the file was extended to its final size.
        file.write_all_at(&bytes, off).map_err(|er| CacheError::io(out.tmp(), "write entry", er))?;
        finish_writeback_and_drop(file, off, span.len() as u64);
        progress(span.end as u64, layout.data_bytes);
    }
    out.commit(DENSE_MAGIC, DENSE_FORMAT_VERSION, &json, layout.table_offset, &sums)?;
    let seconds = t0.elapsed().as_secs_f64();
    Ok(BuildReport {
        path: path.to_path_buf(),
        bytes: layout.file_len,
        records: header.entries.len() as u64,
        seconds,
        gb_per_s: layout.file_len as f64 / seconds.max(1e-9) / 1e9,
    })
}

static ZEROS: [u8; 4096] = [0; 4096];

/// A loaded dense-weight cache: every entry resident in one anonymous buffer, each at a 4 KiB
/// aligned offset.
pub struct DenseCache {
    path: PathBuf,
    header: DenseHeader,
    layout: DenseLayout,
    by_name: HashMap<String, usize>,
    buf: PageBuffer,
    report: LoadReport,
}

impl std::fmt::Debug for DenseCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DenseCache")
            .field("path", &self.path)
            .field("entries", &self.header.entries.len())
            .field("report", &self.report)
            .finish()
    }
}

impl DenseCache {
    pub fn header(&self) -> &DenseHeader {
        &self.header
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The index of the entry named `name`.
    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.by_name.get(name).copied()
    }

    /// The packed bytes of entry `i` (4 KiB aligned).
    pub fn entry(&self, i: usize) -> &[u8] {
        let start = self.layout.offsets[i] as usize;
        &self.buf.as_slice()[start..start + self.header.entries[i].bytes as usize]
    }

    /// Bytes of the entry buffer (the one resident copy of the dense weights).
    pub fn resident_bytes(&self) -> usize {
        self.buf.len()
    }

    pub fn load_report(&self) -> &LoadReport {
        &self.report
    }
}

/// One line for logs: path, size, entries, load speed.
pub fn describe_dense(c: &DenseCache) -> String {
    let r = &c.report;
    format!(
        "dense-weight cache {}: {} resident ({} matrices), loaded in {:.2} s at {:.2} GB/s{}; page cache {}",
        c.path.display(),
        format_bytes(c.resident_bytes() as u64),
        c.header.entries.len(),
        r.seconds,
        r.gb_per_s,
        if r.verified { ", checksums verified" } else { ", not verified" },
        if r.page_cache_kept { "kept" } else { "dropped" },
    )
}

/// Opens and loads the cache at `path`, refusing it (with a distinct error) when it is missing,
/// damaged, or differs from `expected`: the header is checked before anything is sized from it,
/// and every entry's checksum (with `verify`) before the cache is returned. Entries are read in
/// parallel into one buffer; the file's page cache is dropped behind them unless [`crate::page_cache`] keeps it.
pub fn open_dense(
    path: &Path,
    expected: &DenseHeader,
    verify: bool,
    progress: &ByteProgress<'_>,
) -> Result<DenseCache, CacheError> {
    let t0 = Instant::now();
    let p = || path.to_path_buf();
    let file = File::open(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => CacheError::Missing { path: p() },
        _ => CacheError::io(path, "open", e),
    })?;
    let (pre, json, len) = read_preamble_and_header(&file, path, DENSE_MAGIC, DENSE_FORMAT_VERSION)?;
    let (header, layout) =
        parse_header_json(&json, pre.header_len).map_err(|detail| CacheError::HeaderInvalid { path: p(), detail })?;
    if len != layout.file_len {
        return Err(CacheError::SizeMismatch {
            path: p(),
            actual: len,
            expected: layout.file_len,
            what: "the header implies",
        });
    }
    if let Some((field, cache, expected)) = first_difference(&header, expected) {
        return Err(CacheError::Stale { path: p(), field, cache, expected });
    }
    let sums = read_checksum_table(&file, path, &pre, layout.table_offset, header.entries.len() as u64)?;

    let keep = crate::page_cache::keep_page_cache(layout.data_bytes);
    let mut buf =
        PageBuffer::new(layout.data_bytes as usize).map_err(|e| CacheError::io(path, "allocate entry buffer", e))?;
    buf.advise_huge_pages();
    let mut pieces = Vec::with_capacity(header.entries.len());
    let mut rest = buf.as_mut_slice();
    for i in 0..header.entries.len() {
        let (this, tail) = rest.split_at_mut(layout.span(i).len());
        pieces.push((i, this));
        rest = tail;
    }
    let done = AtomicU64::new(0);
    pieces.into_par_iter().try_for_each_init(
        || reopen(&file),
        |f, (i, dst)| {
            let f =
                f.as_ref().map_err(|e| CacheError::io(path, "reopen", std::io::Error::new(e.kind(), e.to_string())))?;
            let off = layout.data_offset + layout.offsets[i];
            let digest = read_hashed(f, path, dst, off, verify)?;
            if verify && digest != sums[i] {
                return Err(CacheError::EntryChecksum { path: p(), index: i, name: header.entries[i].name.clone() });
            }
            if !keep {
                drop_page_cache(f, off, dst.len() as u64);
            }
            progress(done.fetch_add(dst.len() as u64, Ordering::Relaxed) + dst.len() as u64, layout.data_bytes);
            Ok(())
        },
    )?;
    if !keep {
        drop_page_cache(&file, 0, 0);
    }

    let seconds = t0.elapsed().as_secs_f64();
    let report = LoadReport {
        seconds,
        bytes: layout.data_bytes,
        gb_per_s: layout.data_bytes as f64 / seconds.max(1e-9) / 1e9,
        huge_page_bytes: huge_page_bytes(buf.as_ptr(), buf.len()),
        numa_bound: false,
        verified: verify,
        page_cache_kept: keep,
    };
    let by_name = header.entries.iter().enumerate().map(|(i, e)| (e.name.clone(), i)).collect();
    Ok(DenseCache { path: p(), header, layout, by_name, buf, report })
}

/// Opens the cache at `path`; when it is missing, stale or damaged, builds it with `produce` and
/// opens the result (see [`crate::open_or_build`], whose rules it follows).
pub fn open_or_build_dense(
    path: &Path,
    expected: &DenseHeader,
    produce: &DenseProduce<'_>,
    build_progress: &ByteProgress<'_>,
    load_progress: &ByteProgress<'_>,
) -> Result<(DenseCache, CacheOutcome), CacheError> {
    crate::open_or_rebuild(
        path,
        || open_dense(path, expected, true, load_progress),
        || build_dense(path, expected, produce, build_progress).map(|_| ()),
    )
}
