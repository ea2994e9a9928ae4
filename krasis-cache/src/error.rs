//! Errors of the expert cache. Each way a cache can be unusable is its own variant, so callers (and
//! tests) can tell a stale cache from a damaged one from an I/O failure that has nothing to do with
//! the cache's contents.

use std::io;
use std::path::PathBuf;

use krasis_core::budget::format_bytes;

#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error("{} {} does not exist", kind(path), path.display())]
    Missing { path: PathBuf },

    #[error("{} {} is {actual} bytes but {what} {expected} (truncated or extended)", kind(path), path.display())]
    SizeMismatch { path: PathBuf, actual: u64, expected: u64, what: &'static str },

    #[error("{} is not a Krasis {} (magic {}, expected \"{}\")", path.display(), kind(path), show_magic(found), show_magic(expected))]
    BadMagic { path: PathBuf, found: [u8; 8], expected: [u8; 8] },

    #[error("{} {} has format version {found}; this build reads version {supported}", kind(path), path.display())]
    FormatVersion { path: PathBuf, found: u32, supported: u32 },

    #[error(
        "{} {}: {section} checksum mismatch (stored {stored:#018x}, computed {computed:#018x})",
        kind(path), path.display()
    )]
    HeaderChecksum { path: PathBuf, section: &'static str, stored: u64, computed: u64 },

    #[error("{} {}: invalid header: {detail}", kind(path), path.display())]
    HeaderInvalid { path: PathBuf, detail: String },

    #[error("{} {} is stale: {field} differs (cache {cache}, model {expected})", kind(path), path.display())]
    Stale { path: PathBuf, field: &'static str, cache: String, expected: String },

    #[error(
        "{} {}: checksum mismatch in the record of layer {layer} (MoE layer index {layer_idx}), expert {expert}",
        kind(path), path.display()
    )]
    RecordChecksum { path: PathBuf, layer_idx: usize, layer: u32, expert: usize },

    #[error("dense-weight cache {}: checksum mismatch in entry {index} (`{name}`)", path.display())]
    EntryChecksum { path: PathBuf, index: usize, name: String },

    #[error("building dense-weight cache {}: `{name}`: {message}", path.display())]
    ProduceEntry { path: PathBuf, name: String, message: String },

    #[error("invalid cache header: {0}")]
    InvalidRequest(String),

    #[error(
        "building expert cache {}: layer {layer} (MoE layer index {layer_idx}), expert {expert}: {message}",
        path.display()
    )]
    Produce { path: PathBuf, layer_idx: usize, layer: u32, expert: usize, message: String },

    #[error(
        "{} {}: binding MoE layer index {layer_idx}, expert {expert} to NUMA node {node}: {source}",
        kind(path), path.display()
    )]
    Placement { path: PathBuf, layer_idx: usize, expert: usize, node: usize, source: io::Error },

    #[error(
        "{} {}: not enough disk space in {} ({} needed, {} available)",
        kind(path), path.display(), dir.display(), format_bytes(*needed), format_bytes(*available)
    )]
    NoSpace { path: PathBuf, dir: PathBuf, needed: u64, available: u64 },

    #[error("{} {}: {op}: {source}", kind(path), path.display())]
    Io { path: PathBuf, op: &'static str, source: io::Error },

    /// The cache was found missing, stale or damaged (`reason`), and building it anew failed.
    /// `error` is not a `source`: the message carries it already.
    #[error("{} {} was found {reason}, and rebuilding it failed: {error}", kind(path), path.display())]
    Rebuild { path: PathBuf, reason: String, error: Box<CacheError> },
}

/// What kind of cache a file is, by its name, for messages: `dense_…` files are dense-weight
/// caches ([`crate::dense`]), anything else an expert cache.
fn kind(path: &std::path::Path) -> &'static str {
    let dense = path.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with(crate::dense::FILE_PREFIX));
    if dense {
        "dense-weight cache"
    } else {
        "expert cache"
    }
}

fn show_magic(m: &[u8; 8]) -> String {
    m.iter().map(|&b| if b.is_ascii_graphic() { (b as char).to_string() } else { format!("\\x{b:02x}") }).collect()
}

impl CacheError {
    pub(crate) fn io(path: &std::path::Path, op: &'static str, source: io::Error) -> CacheError {
        CacheError::Io { path: path.to_path_buf(), op, source }
    }

    /// Whether the error is about the cache file itself (missing, damaged or stale), so that
    /// rebuilding it is the cure. I/O failures, bad requests, producer errors and placement
    /// failures are not: rebuilding would not help, and `open_or_build` returns them.
    pub fn is_rebuildable(&self) -> bool {
        matches!(
            self,
            CacheError::Missing { .. }
                | CacheError::SizeMismatch { .. }
                | CacheError::BadMagic { .. }
                | CacheError::FormatVersion { .. }
                | CacheError::HeaderChecksum { .. }
                | CacheError::HeaderInvalid { .. }
                | CacheError::Stale { .. }
                | CacheError::RecordChecksum { .. }
                | CacheError::EntryChecksum { .. }
        )
    }

    /// Whether the cache's directory is at fault (cannot be written, no space), so another
    /// directory would help.
    pub fn is_location(&self) -> bool {
        match self {
            CacheError::Io { .. } | CacheError::NoSpace { .. } => true,
            CacheError::Rebuild { error, .. } => error.is_location(),
            _ => false,
        }
    }

    /// A short reason, without the path, for log lines such as `"rebuilding: <reason>"`.
    pub fn reason(&self) -> String {
        match self {
            CacheError::Missing { .. } => "missing".into(),
            CacheError::SizeMismatch { actual, expected, what, .. } => {
                format!("damaged: file is {actual} bytes but {what} {expected} (truncated or extended)")
            }
            CacheError::BadMagic { found, .. } => format!("damaged: bad magic {}", show_magic(found)),
            CacheError::EntryChecksum { name, .. } => format!("damaged: checksum mismatch in `{name}`"),
            CacheError::FormatVersion { found, supported, .. } => {
                format!("stale: format version {found} (this build reads {supported})")
            }
            CacheError::HeaderChecksum { section, .. } => format!("damaged: {section} checksum mismatch"),
            CacheError::HeaderInvalid { detail, .. } => format!("damaged: invalid header: {detail}"),
            CacheError::Stale { field, cache, expected, .. } => {
                format!("stale: {field} differs (cache {cache}, model {expected})")
            }
            CacheError::RecordChecksum { layer_idx, layer, expert, .. } => format!(
                "damaged: record checksum mismatch at layer {layer} (MoE layer index {layer_idx}), expert {expert}"
            ),
            other => other.to_string(),
        }
    }
}
