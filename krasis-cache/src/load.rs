//! Open: validate the header, read every record into one anonymous page-aligned buffer (THP
//! advised, NUMA-bound before first touch), verifying each record's checksum as it arrives; the
//! file's page-cache copy is dropped behind the reads unless RAM has room to keep it for the next
//! start ([`crate::page_cache`]).

use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::Instant;

use krasis_core::budget::format_bytes;
use krasis_core::memory::{bind_to_node, huge_page_bytes, PageBuffer};
use rayon::prelude::*;

use crate::build::drop_page_cache;
use crate::container::read_hashed;
use crate::format::{first_difference, read_header, Layout};
use crate::{CacheError, CacheHeader};

/// Chooses the NUMA node of (MoE layer index, expert); `None` leaves the record to the default policy.
pub type Placement<'a> = dyn Fn(usize, usize) -> Option<usize> + 'a;

/// How to load a cache.
#[derive(Clone, Copy)]
pub struct LoadOptions<'a> {
    /// Check every record's checksum while reading (default true). The header, size and checksum
    /// table are always checked.
    pub verify: bool,
    /// NUMA node per record, bound (`mbind`) before the record's pages are first touched.
    pub placement: Option<&'a Placement<'a>>,
    /// Advise transparent huge pages on the record buffer (default true).
    pub huge_pages: bool,
}

impl Default for LoadOptions<'_> {
    fn default() -> Self {
        LoadOptions { verify: true, placement: None, huge_pages: true }
    }
}

/// What a load did and how fast.
#[derive(Clone, Debug, PartialEq)]
pub struct LoadReport {
    /// Whole `open`: header checks, allocation, placement, reads and verification.
    pub seconds: f64,
    /// Record bytes read (the resident size).
    pub bytes: u64,
    /// `bytes / seconds`, 1e9 based.
    pub gb_per_s: f64,
    /// Bytes of the record buffer backed by transparent huge pages (`None`: smaps unreadable).
    pub huge_page_bytes: Option<u64>,
    /// Whether a placement was given and every bound range was accepted by a NUMA kernel.
    pub numa_bound: bool,
    /// Whether record checksums were verified.
    pub verified: bool,
    /// Whether the file's page-cache copy was kept for the next start ([`crate::page_cache`]).
    pub page_cache_kept: bool,
}

/// A loaded cache: every record resident in one anonymous buffer, laid out as in the file: the
/// layers one after another, a layer's records `stride(layer_idx)` apart (4 KiB-aligned), w2 at
/// `w2_offset(layer_idx)` inside each (64-aligned).
pub struct ExpertCache {
    path: PathBuf,
    header: CacheHeader,
    layout: Layout,
    buf: PageBuffer,
    report: LoadReport,
}

impl std::fmt::Debug for ExpertCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExpertCache")
            .field("path", &self.path)
            .field("header", &self.header)
            .field("records_bytes", &self.layout.records_bytes)
            .field("report", &self.report)
            .finish()
    }
}

impl ExpertCache {
    pub fn header(&self) -> &CacheHeader {
        &self.header
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Bytes between consecutive records of MoE layer `layer_idx` (a multiple of 4096).
    pub fn stride(&self, layer_idx: usize) -> usize {
        self.layout.layers[layer_idx].stride as usize
    }

    /// Offset of w2 inside a record of MoE layer `layer_idx` (a multiple of 64).
    pub fn w2_offset(&self, layer_idx: usize) -> usize {
        self.layout.layers[layer_idx].w2_offset as usize
    }

    fn index(&self, layer_idx: usize, expert: usize) -> usize {
        let (nl, ne) = (self.header.moe_layers.len(), self.header.n_experts as usize);
        assert!(layer_idx < nl && expert < ne, "expert ({layer_idx}, {expert}) out of range ({nl} layers × {ne})");
        layer_idx * ne + expert
    }

    /// Where the record of (MoE layer index, expert) starts in [`ExpertCache::records`].
    pub fn record_start(&self, layer_idx: usize, expert: usize) -> usize {
        self.layout.record_start(self.index(layer_idx, expert)) as usize
    }

    /// The fused gate+up part of the record of (MoE layer index, expert).
    pub fn w13(&self, layer_idx: usize, expert: usize) -> &[u8] {
        let s = self.record_start(layer_idx, expert);
        &self.buf.as_slice()[s..s + self.header.parts[layer_idx].w13_bytes as usize]
    }

    /// The down part of the record of (MoE layer index, expert); 64-byte aligned.
    pub fn w2(&self, layer_idx: usize, expert: usize) -> &[u8] {
        let s = self.record_start(layer_idx, expert) + self.w2_offset(layer_idx);
        &self.buf.as_slice()[s..s + self.header.parts[layer_idx].w2_bytes as usize]
    }

    /// The whole record of (MoE layer index, expert), padding included: a 4 KiB-aligned start and
    /// a length of the layer's `stride` (whole pages), for pinning, DMA or NUMA moves.
    pub fn record_ptr_range(&self, layer_idx: usize, expert: usize) -> (*const u8, usize) {
        let s = self.record_start(layer_idx, expert);
        (self.buf.as_slice()[s..].as_ptr(), self.stride(layer_idx))
    }

    /// The records of experts `experts` of MoE layer `layer_idx`, back to back (`stride` apart,
    /// padding included): one contiguous run, as a layer's records lie in the file.
    pub fn layer_records(&self, layer_idx: usize, experts: std::ops::Range<usize>) -> &[u8] {
        let ne = self.header.n_experts as usize;
        assert!(experts.start <= experts.end && experts.end <= ne, "experts {experts:?} of {ne}");
        if experts.is_empty() {
            return &[];
        }
        let s = self.record_start(layer_idx, experts.start);
        &self.buf.as_slice()[s..s + experts.len() * self.stride(layer_idx)]
    }

    /// All records, back to back (each layer's `stride` apart).
    pub fn records(&self) -> &[u8] {
        self.buf.as_slice()
    }

    /// Bytes of the record buffer (the one resident copy of the experts).
    pub fn resident_bytes(&self) -> usize {
        self.buf.len()
    }

    pub fn load_report(&self) -> &LoadReport {
        &self.report
    }
}

/// One line for logs: path, size, load speed, THP bytes, NUMA binding.
pub fn describe(c: &ExpertCache) -> String {
    let r = &c.report;
    let h = &c.header;
    let thp = match r.huge_page_bytes {
        Some(b) => format_bytes(b),
        None => "unknown".into(),
    };
    format!(
        "expert cache {}: {} resident ({} MoE layers × {} experts, {}), loaded in {:.2} s at {:.2} GB/s{}; \
         THP {thp}; NUMA bound: {}; page cache {}",
        c.path.display(),
        format_bytes(c.resident_bytes() as u64),
        h.moe_layers.len(),
        h.n_experts,
        h.bits_summary(),
        r.seconds,
        r.gb_per_s,
        if r.verified { ", checksums verified" } else { ", not verified" },
        if r.numa_bound { "yes" } else { "no" },
        if r.page_cache_kept { "kept" } else { "dropped" },
    )
}

/// Open and load the cache at `path`, refusing it (with a distinct error) when it is missing,
/// damaged, or differs from `expected`.
pub fn open(path: &Path, expected: &CacheHeader, load: LoadOptions<'_>) -> Result<ExpertCache, CacheError> {
    let t0 = Instant::now();
    let file = File::open(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => CacheError::Missing { path: path.to_path_buf() },
        _ => CacheError::io(path, "open", e),
    })?;
    let (header, layout, sums) = read_header(&file, path)?;
    if let Some((field, cache, expected)) = first_difference(&header, expected) {
        return Err(CacheError::Stale { path: path.to_path_buf(), field, cache, expected });
    }

    let total = layout.records_bytes as usize;
    let keep = crate::page_cache::keep_page_cache(total as u64);
    let n_experts = header.n_experts as usize;
    let mut buf = PageBuffer::new(total).map_err(|e| CacheError::io(path, "allocate record buffer", e))?;
    if load.huge_pages {
        buf.advise_huge_pages();
    }
    let numa_bound = match load.placement {
        Some(place) => bind_records(path, &buf, &layout, n_experts, place)?,
        None => false,
    };

    // Chunks of whole records of one layer: at least ~4 per thread for balance, at most ~64 MiB.
    let threads = rayon::current_num_threads().max(1);
    let n = layout.record_count as usize;
    let per_chunk_records = |stride: usize| (64usize << 20).div_ceil(stride).min(n.div_ceil(4 * threads)).max(1);
    let mut chunks: Vec<(usize, usize, &mut [u8])> = Vec::new(); // (first record, stride, bytes)
    let mut rest = buf.as_mut_slice();
    for (l, g) in layout.layers.iter().enumerate() {
        let stride = g.stride as usize;
        let (layer, tail) = rest.split_at_mut(stride * n_experts);
        rest = tail;
        let per = per_chunk_records(stride);
        for (ci, chunk) in layer.chunks_mut(per * stride).enumerate() {
            chunks.push((l * n_experts + ci * per, stride, chunk));
        }
    }
    let verify = load.verify;
    chunks.into_par_iter().try_for_each(|(first, stride, chunk)| {
        let f = reopen(&file).map_err(|e| CacheError::io(path, "reopen", e))?;
        #[cfg(target_os = "linux")]
        {
            use std::os::fd::AsRawFd;
            // SAFETY: advisory syscall on an open fd.
            unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_SEQUENTIAL) };
        }
        for (j, rec) in chunk.chunks_mut(stride).enumerate() {
            let i = first + j;
            let off = layout.record_offset(i);
            let digest = read_hashed(&f, path, rec, off, verify)?;
            if verify && digest != sums[i] {
                let (l, e) = (i / n_experts, i % n_experts);
                return Err(CacheError::RecordChecksum {
                    path: path.to_path_buf(),
                    layer_idx: l,
                    layer: header.moe_layers[l],
                    expert: e,
                });
            }
        }
        if !keep {
            drop_page_cache(&f, layout.record_offset(first), chunk.len() as u64);
        }
        Ok(())
    })?;
    if !keep {
        // Header, table and anything the chunks missed: the page cache keeps no second copy.
        drop_page_cache(&file, 0, 0);
    }

    let thp = huge_page_bytes(buf.as_ptr(), buf.len());
    let seconds = t0.elapsed().as_secs_f64();
    let report = LoadReport {
        seconds,
        bytes: total as u64,
        gb_per_s: total as f64 / seconds.max(1e-9) / 1e9,
        huge_page_bytes: thp,
        numa_bound,
        verified: verify,
        page_cache_kept: keep,
    };
    Ok(ExpertCache { path: path.to_path_buf(), header, layout, buf, report })
}

/// A new open file description of the same inode (`/proc/self/fd/N`), so that each reader has its
/// own sequential readahead state and a concurrent rebuild that renames over the path cannot mix
/// files; a shared duplicate where /proc is unavailable.
pub(crate) fn reopen(file: &File) -> std::io::Result<File> {
    use std::os::fd::AsRawFd;
    File::open(format!("/proc/self/fd/{}", file.as_raw_fd())).or_else(|_| file.try_clone())
}

/// Bind each record's pages to its node, coalescing runs of consecutive records on one node.
/// Returns whether anything was bound and the kernel honoured every binding.
fn bind_records(
    path: &Path,
    buf: &PageBuffer,
    layout: &Layout,
    n_experts: usize,
    place: &Placement<'_>,
) -> Result<bool, CacheError> {
    let n = layout.record_count as usize;
    let nodes: Vec<Option<usize>> = (0..n).map(|i| place(i / n_experts, i % n_experts)).collect();
    let mut any = false;
    let mut all = true;
    let mut i = 0;
    while i < n {
        let Some(node) = nodes[i] else {
            i += 1;
            continue;
        };
        let mut j = i + 1;
        while j < n && nodes[j] == Some(node) {
            j += 1;
        }
        let start = layout.record_start(i) as usize;
        let end = if j < n { layout.record_start(j) as usize } else { layout.records_bytes as usize };
        let ptr = buf.as_slice()[start..].as_ptr();
        let ok = bind_to_node(ptr, end - start, node).map_err(|source| CacheError::Placement {
            path: path.to_path_buf(),
            layer_idx: i / n_experts,
            expert: i % n_experts,
            node,
            source,
        })?;
        any = true;
        all &= ok;
        i = j;
    }
    Ok(any && all)
}
