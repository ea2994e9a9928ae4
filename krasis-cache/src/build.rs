//! Streaming, atomic build: one layer at a time, records produced in parallel, written at their
//! offsets to `<path>.tmp.<pid>`, checksum table + header + preamble last, fsync, rename.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Instant;

use rayon::prelude::*;
use xxhash_rust::xxh3::Xxh3;

use crate::container::AtomicWrite;
use crate::format::{header_json, Layout, FORMAT_VERSION, MAGIC};
use crate::{CacheError, CacheHeader};

/// Produces the record of (MoE layer index, expert): `w13_bytes` then `w2_bytes`, back to back.
pub type Produce<'a> = dyn Fn(usize, usize) -> Result<Vec<u8>, String> + Sync + 'a;

/// Progress of a build, reported after every record (in order, from the calling thread).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BuildProgress {
    pub records_done: u64,
    pub records_total: u64,
    /// MoE layers completely written.
    pub layers_done: usize,
    pub layers_total: usize,
    /// File bytes of the records written so far (strides, padding included).
    pub bytes_done: u64,
    pub bytes_total: u64,
    pub seconds: f64,
    pub gb_per_s: f64,
}

/// What a finished build did.
#[derive(Clone, Debug, PartialEq)]
pub struct BuildReport {
    pub path: PathBuf,
    /// Size of the file written.
    pub bytes: u64,
    pub records: u64,
    pub seconds: f64,
    /// File bytes per second, 1e9 based.
    pub gb_per_s: f64,
}

/// `<path>.tmp.<pid>` (same directory, so the rename is atomic).
pub(crate) fn tmp_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".tmp.{}", std::process::id()));
    path.with_file_name(name)
}

fn pid_alive(pid: u32) -> bool {
    let Ok(p) = libc::pid_t::try_from(pid) else { return false };
    if p <= 0 {
        return false;
    }
    // SAFETY: signal 0 only checks for existence and permission.
    let r = unsafe { libc::kill(p, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// Remove `<path>.tmp.<pid>` files left by builds whose process is gone (an interrupted build).
/// Temp files of live processes (a concurrent build) and names that do not end in a pid are left
/// alone. Returns the files removed; errors are ignored (the files are never read anyway).
pub fn clean_stale_tmp_files(path: &Path) -> Vec<PathBuf> {
    let mut removed = Vec::new();
    let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else { return removed };
    let dir = if dir.as_os_str().is_empty() { Path::new(".") } else { dir };
    let prefix = format!("{}.tmp.", name.to_string_lossy());
    let Ok(entries) = std::fs::read_dir(dir) else { return removed };
    for entry in entries.flatten() {
        let fname = entry.file_name();
        let Some(pid) = fname.to_str().and_then(|f| f.strip_prefix(&prefix)).and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        if pid != std::process::id() && !pid_alive(pid) && std::fs::remove_file(entry.path()).is_ok() {
            removed.push(entry.path());
        }
    }
    removed
}

#[cfg(target_os = "linux")]
fn start_writeback(f: &File, off: u64, len: u64) {
    use std::os::fd::AsRawFd;
    // SAFETY: advisory syscall on an open fd.
    unsafe {
        libc::sync_file_range(f.as_raw_fd(), off as i64, len as i64, libc::SYNC_FILE_RANGE_WRITE);
    }
}

#[cfg(target_os = "linux")]
pub(crate) fn finish_writeback_and_drop(f: &File, off: u64, len: u64) {
    use std::os::fd::AsRawFd;
    let flags = libc::SYNC_FILE_RANGE_WAIT_BEFORE | libc::SYNC_FILE_RANGE_WRITE | libc::SYNC_FILE_RANGE_WAIT_AFTER;
    // SAFETY: advisory syscalls on an open fd.
    unsafe {
        libc::sync_file_range(f.as_raw_fd(), off as i64, len as i64, flags);
        libc::posix_fadvise(f.as_raw_fd(), off as i64, len as i64, libc::POSIX_FADV_DONTNEED);
    }
}

#[cfg(not(target_os = "linux"))]
fn start_writeback(_: &File, _: u64, _: u64) {}

#[cfg(not(target_os = "linux"))]
pub(crate) fn finish_writeback_and_drop(_: &File, _: u64, _: u64) {}

/// Drop the page-cache copy of `[off, off+len)` (`len` 0: to the end of the file).
pub(crate) fn drop_page_cache(f: &File, off: u64, len: u64) {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        // SAFETY: advisory syscall on an open fd.
        unsafe {
            libc::posix_fadvise(f.as_raw_fd(), off as i64, len as i64, libc::POSIX_FADV_DONTNEED);
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (f, off, len);
}

/// Bytes available to this user on the file system of `dir` (`None` if unknown).
pub(crate) fn free_bytes(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: statvfs is plain old data, all-zero is a valid value.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: a NUL-terminated path and a statvfs struct to fill.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return None;
    }
    Some((st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
}

static ZEROS: [u8; 4096] = [0; 4096];

/// Build the cache at `path` for `header`, calling `produce(layer_idx, expert)` for every record.
///
/// Streaming: the records of one MoE layer are produced in parallel (rayon), checksummed and written
/// at their offsets; the next layer starts only when the whole layer is on its way to disk, whose
/// page-cache copy is dropped once written back, so memory holds about one layer. The file is
/// `<path>.tmp.<pid>` until complete; checksum table, header and preamble are written last, then
/// fsync and rename over `path`. On any error (or panic) the temp file is removed and `path` is
/// left as it was.
pub fn build(
    path: &Path,
    header: &CacheHeader,
    produce: &Produce<'_>,
    progress: &dyn Fn(BuildProgress),
) -> Result<BuildReport, CacheError> {
    let one = |l: usize, e: usize| produce(l, e).map(|r| vec![r]);
    let mut reports = build_many(&[(path, header)], &one, progress)?;
    Ok(reports.remove(0))
}

/// Produces the records of (MoE layer index, expert) for every target of [`build_many`], in the
/// targets' order (e.g. the CPU and the GPU layout of one quantisation).
pub type ProduceMany<'a> = dyn Fn(usize, usize) -> Result<Vec<Vec<u8>>, String> + Sync + 'a;

/// [`build`] of several caches over the same MoE layers and experts in one pass: each
/// (layer, expert) is produced once, as one record per target, so the source weights are read
/// and quantised once for all of them. Every file is written as [`build`] writes one; all are
/// renamed into place only when all are complete (an error leaves every path as it was).
/// Progress counts the records of all targets together.
pub fn build_many(
    targets: &[(&Path, &CacheHeader)],
    produce: &ProduceMany<'_>,
    progress: &dyn Fn(BuildProgress),
) -> Result<Vec<BuildReport>, CacheError> {
    let t0 = Instant::now();
    let Some(&(_, first)) = targets.first() else {
        return Err(CacheError::InvalidRequest("build_many: no caches to build".into()));
    };
    let mut plans = Vec::with_capacity(targets.len());
    for &(path, header) in targets {
        if header.format_version != FORMAT_VERSION {
            return Err(CacheError::InvalidRequest(format!(
                "format_version {} (this build writes {FORMAT_VERSION})",
                header.format_version
            )));
        }
        if (&header.moe_layers, header.n_experts) != (&first.moe_layers, first.n_experts) {
            return Err(CacheError::InvalidRequest(format!(
                "{}: built in one pass with caches of other MoE layers or expert counts",
                path.display()
            )));
        }
        let json = header_json(header).map_err(CacheError::InvalidRequest)?;
        let layout = Layout::new(header, json.len() as u64).map_err(CacheError::InvalidRequest)?;
        plans.push((json, layout));
    }
    let outs = targets
        .iter()
        .zip(&plans)
        .map(|(&(path, _), (_, layout))| AtomicWrite::create(path, layout.file_len))
        .collect::<Result<Vec<_>, _>>()?;
    let files: Vec<Target<'_>> = targets
        .iter()
        .zip(&plans)
        .zip(&outs)
        .map(|((&(path, header), (_, layout)), out)| Target { path, header, layout, file: out.file() })
        .collect();

    let n_layers = first.moe_layers.len();
    let n_experts = first.n_experts as usize;
    let record_count = plans[0].1.record_count;
    let bytes_total: u64 = plans.iter().map(|(_, l)| l.records_bytes).sum();

    // Records are produced and written on rayon's pool (driven from a scoped thread); this thread
    // relays progress in order, so `progress` need not be `Sync`.
    let sums = std::thread::scope(|s| {
        let (tx, rx) = mpsc::channel::<u64>();
        let worker = s.spawn(|| write_layers(&files, produce, tx));
        let (mut done, mut bytes_done) = (0u64, 0u64);
        for strides in rx {
            done += 1;
            bytes_done += strides;
            let seconds = t0.elapsed().as_secs_f64();
            progress(BuildProgress {
                records_done: done,
                records_total: record_count,
                layers_done: (done / n_experts as u64) as usize,
                layers_total: n_layers,
                bytes_done,
                bytes_total,
                seconds,
                gb_per_s: bytes_done as f64 / seconds.max(1e-9) / 1e9,
            });
        }
        match worker.join() {
            Ok(r) => r,
            Err(panic) => std::panic::resume_unwind(panic),
        }
    })?;

    let mut reports = Vec::with_capacity(targets.len());
    for ((out, (json, layout)), (&(path, _), sums)) in outs.into_iter().zip(&plans).zip(targets.iter().zip(&sums)) {
        out.commit(MAGIC, FORMAT_VERSION, json, layout.table_offset, sums)?;
        let seconds = t0.elapsed().as_secs_f64();
        reports.push(BuildReport {
            path: path.to_path_buf(),
            bytes: layout.file_len,
            records: layout.record_count,
            seconds,
            gb_per_s: layout.file_len as f64 / seconds.max(1e-9) / 1e9,
        });
    }
    Ok(reports)
}

/// One file of a [`build_many`]: where it goes, what it holds, its open temp file.
struct Target<'a> {
    path: &'a Path,
    header: &'a CacheHeader,
    layout: &'a Layout,
    file: &'a File,
}

/// Why record `rec` of MoE layer `l` does not fit `t` (the producer's fault), if it does not.
fn record_size_error(t: &Target<'_>, l: usize, rec: &[u8]) -> Option<String> {
    let parts = t.header.parts[l];
    let (w13, w2) = (parts.w13_bytes as usize, parts.w2_bytes as usize);
    (rec.len() != w13 + w2)
        .then(|| format!("record is {} bytes, expected {} (w13 {w13} + w2 {w2})", rec.len(), w13 + w2))
}

/// Checksum one record of the right size (its w13 part, zeros up to w2, w2, zeros to the stride)
/// and write it at its offset.
fn write_record(t: &Target<'_>, l: usize, e: usize, rec: &[u8]) -> Result<u64, CacheError> {
    let parts = t.header.parts[l];
    let (w13, w2) = (parts.w13_bytes as usize, parts.w2_bytes as usize);
    let geom = t.layout.layers[l];
    let (w2_off, stride) = (geom.w2_offset as usize, geom.stride as usize);
    let mut h = Xxh3::new();
    h.update(&rec[..w13]);
    h.update(&ZEROS[..w2_off - w13]);
    h.update(&rec[w13..]);
    let mut pad = stride - w2_off - w2;
    while pad > 0 {
        let n = pad.min(ZEROS.len());
        h.update(&ZEROS[..n]);
        pad -= n;
    }
    let off = t.layout.record_offset(l * t.layout.n_experts as usize + e);
    // The padding is already zero: the file was extended with set_len.
    let io = |er| CacheError::io(t.path, "write record", er);
    t.file.write_all_at(&rec[..w13], off).map_err(io)?;
    t.file.write_all_at(&rec[w13..], off + w2_off as u64).map_err(io)?;
    Ok(h.digest())
}

/// Produce, checksum and write every record of every target, layer by layer; returns each
/// target's checksums in record order.
fn write_layers(
    targets: &[Target<'_>],
    produce: &ProduceMany<'_>,
    tx: mpsc::Sender<u64>,
) -> Result<Vec<Vec<u64>>, CacheError> {
    let first = targets[0].header;
    let n_experts = first.n_experts as usize;
    let mut sums = vec![Vec::with_capacity(targets[0].layout.record_count as usize); targets.len()];
    let mut previous: Vec<(u64, u64)> = Vec::new();
    for (l, &layer) in first.moe_layers.iter().enumerate() {
        let layer_sums = (0..n_experts)
            .into_par_iter()
            .map(|e| {
                let produce_err = |path: &Path, message: String| CacheError::Produce {
                    path: path.to_path_buf(),
                    layer_idx: l,
                    layer,
                    expert: e,
                    message,
                };
                let recs = produce(l, e).map_err(|m| produce_err(targets[0].path, m))?;
                if recs.len() != targets.len() {
                    let m = format!("{} records for {} caches", recs.len(), targets.len());
                    return Err(produce_err(targets[0].path, m));
                }
                let mut digests = Vec::with_capacity(targets.len());
                let mut strides = 0;
                for (t, rec) in targets.iter().zip(&recs) {
                    if let Some(m) = record_size_error(t, l, rec) {
                        return Err(produce_err(t.path, m));
                    }
                    digests.push(write_record(t, l, e, rec)?);
                    strides += t.layout.layers[l].stride;
                }
                let _ = tx.send(strides);
                Ok(digests)
            })
            .collect::<Result<Vec<Vec<u64>>, CacheError>>()?;
        for digests in layer_sums {
            for (s, d) in sums.iter_mut().zip(digests) {
                s.push(d);
            }
        }
        // Keep at most ~two layers of dirty page cache per file: start writing this layer back,
        // wait for the previous one and drop its pages.
        let this: Vec<(u64, u64)> = targets
            .iter()
            .map(|t| (t.layout.record_offset(l * n_experts), n_experts as u64 * t.layout.layers[l].stride))
            .collect();
        for (t, &(off, bytes)) in targets.iter().zip(&this) {
            start_writeback(t.file, off, bytes);
        }
        for (t, &(off, bytes)) in targets.iter().zip(&previous) {
            finish_writeback_and_drop(t.file, off, bytes);
        }
        previous = this;
    }
    Ok(sums)
}
