//! The identity of a model's weight files for cache keys: what changes when a file is rewritten,
//! read without reading every byte.
//!
//! A file's identity hashes (xxh3-64) its size, its modification time (seconds and nanoseconds)
//! and [`SAMPLE_PAGES`] pages of [`SAMPLE_PAGE_BYTES`] spread evenly over the file, the first and
//! the last included (a file of at most that many pages is hashed whole). So a rewrite in place
//! with the same sizes and headers (`krasis synth --seed 7 --force` over an earlier synth) changes
//! it twice over: the new mtime, and any sampled page whose bytes differ. A rewrite that keeps the
//! mtime (`touch -d`, `cp -p` of other weights of the same shapes) and changes no sampled page is
//! the one thing it misses. A copy that keeps mtimes (`cp -p`, `rsync -a`) keeps the identity; a
//! plain `cp` does not, and the caches are rebuilt once.
//!
//! Cost: a stat and 64 page reads per file (files read in parallel), not per byte. Measured on
//! a start (`RUST_LOG=krasis_model=debug krasis info` logs it; 11 runs each, min / median / max;
//! a shared 2-core VM under load ~5, virtio disk, dev build; "cold": the weight files' pages
//! dropped with `POSIX_FADV_DONTNEED` first):
//! - tiny preset (1 file, 7.3 MiB): 0.14 / 0.15 / 0.22 ms in the page cache, 2.3 / 6.6 / 10 ms cold;
//! - v2-lite, full depth (14 files, 31 GB): 2.6 / 8.1 / 10.7 ms in the page cache, 12.7 / 15.6 /
//!   19.8 ms cold (against the seconds a start spends loading that model's caches).

use std::fs::File;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::Path;

use xxhash_rust::xxh3::Xxh3;

/// Pages sampled from each file.
pub const SAMPLE_PAGES: u64 = 64;
/// Bytes of each sampled page.
pub const SAMPLE_PAGE_BYTES: u64 = 4096;

/// Offsets of the pages [`file_identity`] reads from a file of `len` bytes: [`SAMPLE_PAGES`]
/// page-aligned offsets spread evenly from the first page to the last, or every page of a file
/// of at most that many pages.
pub fn sample_offsets(len: u64) -> Vec<u64> {
    let pages = len.div_ceil(SAMPLE_PAGE_BYTES);
    if pages <= SAMPLE_PAGES {
        return (0..pages).map(|p| p * SAMPLE_PAGE_BYTES).collect();
    }
    let last = pages - 1;
    (0..SAMPLE_PAGES).map(|k| last * k / (SAMPLE_PAGES - 1) * SAMPLE_PAGE_BYTES).collect()
}

/// The identity of one file: xxh3-64 of its size, its mtime and its sampled pages (see the module
/// documentation). Errors are the I/O errors of `stat` and of the reads.
pub fn file_identity(path: &Path) -> std::io::Result<u64> {
    let file = File::open(path)?;
    let meta = file.metadata()?;
    let len = meta.len();
    let mut h = Xxh3::new();
    h.update(&len.to_le_bytes());
    h.update(&meta.mtime().to_le_bytes());
    h.update(&meta.mtime_nsec().to_le_bytes());
    let offsets = sample_offsets(len);
    // Ask for every page before reading the first, so a cold start waits for one round of
    // concurrent reads rather than 64 one after the other.
    #[cfg(target_os = "linux")]
    for &off in &offsets {
        use std::os::fd::AsRawFd;
        // SAFETY: advisory syscall on an open fd.
        unsafe {
            libc::posix_fadvise(file.as_raw_fd(), off as i64, SAMPLE_PAGE_BYTES as i64, libc::POSIX_FADV_WILLNEED)
        };
    }
    let mut page = vec![0u8; SAMPLE_PAGE_BYTES as usize];
    for off in offsets {
        let n = (len - off).min(SAMPLE_PAGE_BYTES) as usize;
        file.read_exact_at(&mut page[..n], off)?;
        h.update(&off.to_le_bytes());
        h.update(&page[..n]);
    }
    Ok(h.digest())
}

/// Threads reading files' pages at once in [`files_identity`] (enough to keep a disk's queue
/// busy on a cold start; the reads are tiny).
const READERS: usize = 8;

/// The identities of `paths`, read in parallel (on up to `READERS` short-lived threads of its
/// own, so no thread pool is started for it), folded in order into one value. The first error
/// is returned with the path it concerns.
pub fn files_identity<P: AsRef<Path> + Sync>(paths: &[P]) -> Result<u64, (std::path::PathBuf, std::io::Error)> {
    let identity = |p: &P| file_identity(p.as_ref()).map_err(|e| (p.as_ref().to_path_buf(), e));
    let readers = paths.len().min(READERS);
    let ids: Vec<_> = if readers <= 1 {
        paths.iter().map(identity).collect()
    } else {
        let mut ids: Vec<_> = (0..paths.len()).map(|_| None).collect();
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..readers)
                .map(|r| {
                    s.spawn(move || {
                        (r..paths.len()).step_by(readers).map(|i| (i, identity(&paths[i]))).collect::<Vec<_>>()
                    })
                })
                .collect();
            for h in handles {
                for (i, id) in h.join().expect("an identity reader does not panic") {
                    ids[i] = Some(id);
                }
            }
        });
        ids.into_iter().map(|id| id.expect("every file read")).collect()
    };
    let mut h = Xxh3::new();
    for id in ids {
        h.update(&id?.to_le_bytes());
    }
    Ok(h.digest())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;
    use std::time::{Duration, SystemTime};

    fn set_mtime(path: &Path, t: SystemTime) {
        std::fs::File::options().write(true).open(path).unwrap().set_modified(t).unwrap();
    }

    #[test]
    fn offsets_cover_small_files_whole_and_spread_over_large_ones() {
        assert_eq!(sample_offsets(0), Vec::<u64>::new());
        assert_eq!(sample_offsets(1), vec![0]);
        assert_eq!(sample_offsets(4097), vec![0, 4096]);
        let o = sample_offsets(1 << 30);
        assert_eq!(o.len() as u64, SAMPLE_PAGES);
        assert_eq!((o[0], *o.last().unwrap()), (0, (1 << 30) - SAMPLE_PAGE_BYTES));
        assert!(o.windows(2).all(|w| w[0] < w[1]) && o.iter().all(|x| x % SAMPLE_PAGE_BYTES == 0));
        // A last page shorter than a page is still read.
        let o = sample_offsets(100 * 4096 + 7);
        assert_eq!(*o.last().unwrap(), 100 * 4096);
    }

    #[test]
    fn a_rewrite_in_place_changes_the_identity_even_with_the_old_mtime() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("w.bin");
        let bytes: Vec<u8> = (0..4096 * 300u32).map(|i| (i * 7 % 251) as u8).collect();
        std::fs::write(&p, &bytes).unwrap();
        let t = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        set_mtime(&p, t);
        let first = file_identity(&p).unwrap();
        assert_eq!(file_identity(&p).unwrap(), first, "stable while nothing changes");

        // The same bytes with another mtime: a different identity.
        set_mtime(&p, t + Duration::from_nanos(1));
        assert_ne!(file_identity(&p).unwrap(), first);

        // Other bytes of the same size on a sampled page, the old mtime restored: different.
        let mut other = bytes.clone();
        other[sample_offsets(bytes.len() as u64)[10] as usize + 5] ^= 1;
        std::fs::write(&p, &other).unwrap();
        set_mtime(&p, t);
        assert_ne!(file_identity(&p).unwrap(), first);

        // The original bytes and mtime back: the original identity.
        std::fs::write(&p, &bytes).unwrap();
        set_mtime(&p, t);
        assert_eq!(file_identity(&p).unwrap(), first);
    }

    #[test]
    fn files_identity_depends_on_the_order_and_names_the_failing_file() {
        let d = tempfile::tempdir().unwrap();
        let (a, b) = (d.path().join("a"), d.path().join("b"));
        std::fs::write(&a, b"a").unwrap();
        std::fs::write(&b, b"b").unwrap();
        let ab = files_identity(&[&a, &b]).unwrap();
        assert_eq!(files_identity(&[&a, &b]).unwrap(), ab);
        assert_ne!(files_identity(&[&b, &a]).unwrap(), ab);
        // More files than readers: the same value as one after the other.
        let many: Vec<PathBuf> = (0..2 * READERS + 3)
            .map(|i| {
                let p = d.path().join(format!("f{i}"));
                std::fs::write(&p, vec![i as u8; 5000 * i]).unwrap();
                p
            })
            .collect();
        let mut one_by_one = Xxh3::new();
        for p in &many {
            one_by_one.update(&file_identity(p).unwrap().to_le_bytes());
        }
        assert_eq!(files_identity(&many).unwrap(), one_by_one.digest());
        let missing = d.path().join("missing");
        let (path, e) = files_identity(&[&a, &missing]).unwrap_err();
        assert_eq!((path, e.kind()), (missing, std::io::ErrorKind::NotFound));
    }
}
