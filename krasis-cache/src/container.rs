//! What every Krasis cache file shares (docs/FORMATS.md): a 64-byte preamble (magic, version,
//! header length and xxh3, checksum-table xxh3), a JSON header, a table of u64 xxh3 checksums and
//! 4 KiB-aligned data; written to `<file>.tmp.<pid>` and renamed into place. The expert cache
//! ([`crate::format`]) and the dense-weight cache ([`crate::dense`]) differ only in their magic,
//! header and data layout, so the checks that trust nothing in a file live here once.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use xxhash_rust::xxh3::{xxh3_64, Xxh3};

use crate::build::{clean_stale_tmp_files, drop_page_cache, free_bytes, tmp_path};
use crate::format::{Preamble, CHECKSUM_NAME, MAX_HEADER_BYTES, PREAMBLE_BYTES};
use crate::temp_files::TEMP_FILES;
use crate::CacheError;

/// Reads the preamble and the JSON header of `file` and checks, in order: at least a preamble's
/// bytes, the magic, the version, the reserved bytes, the header length (≤ [`MAX_HEADER_BYTES`]
/// and inside the file: nothing is allocated from it before both hold) and the header's xxh3.
/// Returns the preamble, the header bytes and the file's length.
pub(crate) fn read_preamble_and_header(
    file: &File,
    path: &Path,
    magic: [u8; 8],
    version: u32,
) -> Result<(Preamble, Vec<u8>, u64), CacheError> {
    let p = || path.to_path_buf();
    let len = file.metadata().map_err(|e| CacheError::io(path, "stat", e))?.len();
    if len < PREAMBLE_BYTES {
        return Err(CacheError::SizeMismatch {
            path: p(),
            actual: len,
            expected: PREAMBLE_BYTES,
            what: "the preamble alone needs",
        });
    }
    let mut pre = [0u8; PREAMBLE_BYTES as usize];
    file.read_exact_at(&mut pre, 0).map_err(|e| CacheError::io(path, "read preamble", e))?;
    let pre = Preamble::decode(&pre);
    if pre.magic != magic {
        return Err(CacheError::BadMagic { path: p(), found: pre.magic, expected: magic });
    }
    if pre.format_version != version {
        return Err(CacheError::FormatVersion { path: p(), found: pre.format_version, supported: version });
    }
    if !pre.reserved_zero {
        return Err(CacheError::HeaderInvalid { path: p(), detail: "reserved preamble bytes are not zero".into() });
    }
    if pre.header_len > MAX_HEADER_BYTES {
        return Err(CacheError::HeaderInvalid {
            path: p(),
            detail: format!("header length {} exceeds {MAX_HEADER_BYTES}", pre.header_len),
        });
    }
    if PREAMBLE_BYTES + pre.header_len > len {
        return Err(CacheError::SizeMismatch {
            path: p(),
            actual: len,
            expected: PREAMBLE_BYTES + pre.header_len,
            what: "the header alone needs",
        });
    }
    let mut json = vec![0u8; pre.header_len as usize];
    file.read_exact_at(&mut json, PREAMBLE_BYTES).map_err(|e| CacheError::io(path, "read header", e))?;
    let computed = xxh3_64(&json);
    if computed != pre.header_xxh3 {
        return Err(CacheError::HeaderChecksum { path: p(), section: "header", stored: pre.header_xxh3, computed });
    }
    Ok((pre, json, len))
}

/// Checks the header fields every cache has: `config_hash` (`"0x"` + hex, returned as a number),
/// `format_version` (must equal the preamble's `version`) and the checksum name.
pub(crate) fn check_common_fields(
    config_hash: &str,
    format_version: u32,
    version: u32,
    checksum: &str,
) -> Result<u64, String> {
    let hex = config_hash.strip_prefix("0x").ok_or("config_hash is not 0x-prefixed hex")?;
    let hash = u64::from_str_radix(hex, 16).map_err(|e| format!("config_hash {config_hash:?}: {e}"))?;
    if format_version != version {
        return Err(format!("header says format version {format_version}, preamble says {version}"));
    }
    if checksum != CHECKSUM_NAME {
        return Err(format!("checksum {checksum:?}, expected {CHECKSUM_NAME:?}"));
    }
    Ok(hash)
}

/// Reads the `count` checksums at `offset` and checks them against the preamble's table xxh3.
/// The caller has checked the file's size against its header, so the table lies inside the file.
pub(crate) fn read_checksum_table(
    file: &File,
    path: &Path,
    pre: &Preamble,
    offset: u64,
    count: u64,
) -> Result<Vec<u64>, CacheError> {
    let mut table = vec![0u8; count as usize * 8];
    file.read_exact_at(&mut table, offset).map_err(|e| CacheError::io(path, "read checksum table", e))?;
    let computed = xxh3_64(&table);
    if computed != pre.table_xxh3 {
        return Err(CacheError::HeaderChecksum {
            path: path.to_path_buf(),
            section: "checksum table",
            stored: pre.table_xxh3,
            computed,
        });
    }
    Ok(table.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8-byte chunk"))).collect())
}

/// Reads `dst.len()` bytes at `off` in pieces small enough to hash while they are still in cache;
/// returns their xxh3 (0 when `hash` is false).
pub(crate) fn read_hashed(file: &File, path: &Path, dst: &mut [u8], off: u64, hash: bool) -> Result<u64, CacheError> {
    /// Hash while the piece just read is still in the CPU's caches.
    const PIECE: usize = 1 << 20;
    let mut h = Xxh3::new();
    for (k, piece) in dst.chunks_mut(PIECE).enumerate() {
        file.read_exact_at(piece, off + (k * PIECE) as u64).map_err(|e| CacheError::io(path, "read record", e))?;
        if hash {
            h.update(piece);
        }
    }
    Ok(if hash { h.digest() } else { 0 })
}

/// A cache file being written: `<path>.tmp.<pid>` in the final directory, at its final size,
/// removed on drop unless [`AtomicWrite::commit`] renamed it into place (an error or a panic
/// leaves `path` as it was). Created, renamed and removed through [`crate::temp_files`], so an
/// interrupted process can remove it before it exits.
pub(crate) struct AtomicWrite<'a> {
    path: &'a Path,
    tmp: PathBuf,
    dir: PathBuf,
    file: Option<File>,
}

impl<'a> AtomicWrite<'a> {
    /// Creates the directory if needed, removes temp files of dead builds, refuses early when the
    /// file system has less than `len` bytes free, and creates the temp file extended to `len`.
    pub fn create(path: &'a Path, len: u64) -> Result<AtomicWrite<'a>, CacheError> {
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        std::fs::create_dir_all(&dir).map_err(|e| CacheError::io(&dir, "create cache directory", e))?;
        clean_stale_tmp_files(path);
        if let Some(available) = free_bytes(&dir) {
            // The file being replaced (if any) is freed only at the rename.
            if available < len {
                return Err(CacheError::NoSpace { path: path.to_path_buf(), dir, needed: len, available });
            }
        }
        let tmp = tmp_path(path);
        let file = TEMP_FILES.create(&tmp).map_err(|e| CacheError::io(&tmp, "create temp file", e))?;
        let w = AtomicWrite { path, tmp, dir, file: Some(file) };
        w.file().set_len(len).map_err(|e| CacheError::io(&w.tmp, "set length", e))?;
        Ok(w)
    }

    pub fn file(&self) -> &File {
        self.file.as_ref().expect("open until commit")
    }

    /// The temp file's path (for messages).
    pub fn tmp(&self) -> &Path {
        &self.tmp
    }

    /// Writes the checksum table at `table_offset`, the header and the preamble last; fsync,
    /// drops the page cache, renames over the final path and fsyncs the directory.
    pub fn commit(
        mut self,
        magic: [u8; 8],
        version: u32,
        json: &[u8],
        table_offset: u64,
        sums: &[u64],
    ) -> Result<(), CacheError> {
        let table: Vec<u8> = sums.iter().flat_map(|s| s.to_le_bytes()).collect();
        let pre = Preamble {
            magic,
            format_version: version,
            header_len: json.len() as u64,
            header_xxh3: xxh3_64(json),
            table_xxh3: xxh3_64(&table),
            reserved_zero: true,
        };
        let file = self.file.take().expect("open until commit");
        let w = |bytes: &[u8], off: u64, what| {
            file.write_all_at(bytes, off).map_err(|e| CacheError::io(&self.tmp, what, e))
        };
        w(&table, table_offset, "write checksum table")?;
        w(json, PREAMBLE_BYTES, "write header")?;
        w(&pre.encode(), 0, "write preamble")?;
        file.sync_all().map_err(|e| CacheError::io(&self.tmp, "fsync", e))?;
        drop_page_cache(&file, 0, 0);
        drop(file);
        TEMP_FILES
            .rename(&self.tmp, self.path)
            .map_err(|e| CacheError::io(self.path, "rename temp file into place", e))?;
        // Renamed: nothing is left for drop to remove.
        self.tmp = PathBuf::new();
        if let Ok(d) = File::open(&self.dir) {
            let _ = d.sync_all();
        }
        Ok(())
    }
}

impl Drop for AtomicWrite<'_> {
    fn drop(&mut self) {
        if !self.tmp.as_os_str().is_empty() {
            TEMP_FILES.remove(&self.tmp);
        }
    }
}
