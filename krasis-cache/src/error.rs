//! Errors of the expert cache. Each way a cache can be unusable is its own variant, so callers (and
//! tests) can tell a stale cache from a damaged one from an I/O failure that has nothing to do with
//! the cache's contents.

use std::io;
use std::path::PathBuf;

use krasis_core::budget::format_bytes;

#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error("expert cache {} does not exist", path.display())]
    Missing { path: PathBuf },

    #[error("expert cache {} is {actual} bytes but {what} {expected} (truncated or extended)", path.display())]
    SizeMismatch { path: PathBuf, actual: u64, expected: u64, what: &'static str },

    #[error("{} is not a Krasis expert cache (magic {}, expected \"KRASISXC\")", path.display(), show_magic(found))]
    BadMagic { path: PathBuf, found: [u8; 8] },

    #[error("expert cache {} has format version {found}; this build reads version {supported}", path.display())]
    FormatVersion { path: PathBuf, found: u32, supported: u32 },

    #[error(
        "expert cache {}: {section} checksum mismatch (stored {stored:#018x}, computed {computed:#018x})",
        path.display()
    )]
    HeaderChecksum { path: PathBuf, section: &'static str, stored: u64, computed: u64 },

    #[error("expert cache {}: invalid header: {detail}", path.display())]
    HeaderInvalid { path: PathBuf, detail: String },

    #[error("expert cache {} is stale: {field} differs (cache {cache}, model {expected})", path.display())]
    Stale { path: PathBuf, field: &'static str, cache: String, expected: String },

    #[error(
        "expert cache {}: checksum mismatch in the record of layer {layer} (MoE layer index {layer_idx}), expert {expert}",
        path.display()
    )]
    RecordChecksum { path: PathBuf, layer_idx: usize, layer: u32, expert: usize },

    #[error("invalid expert cache header: {0}")]
    InvalidRequest(String),

    #[error(
        "building expert cache {}: layer {layer} (MoE layer index {layer_idx}), expert {expert}: {message}",
        path.display()
    )]
    Produce { path: PathBuf, layer_idx: usize, layer: u32, expert: usize, message: String },

    #[error(
        "expert cache {}: binding MoE layer index {layer_idx}, expert {expert} to NUMA node {node}: {source}",
        path.display()
    )]
    Placement { path: PathBuf, layer_idx: usize, expert: usize, node: usize, source: io::Error },

    #[error(
        "expert cache {}: not enough disk space in {} ({} needed, {} available)",
        path.display(), dir.display(), format_bytes(*needed), format_bytes(*available)
    )]
    NoSpace { path: PathBuf, dir: PathBuf, needed: u64, available: u64 },

    #[error("expert cache {}: {op}: {source}", path.display())]
    Io { path: PathBuf, op: &'static str, source: io::Error },

    /// The cache was found missing, stale or damaged (`reason`), and building it anew failed.
    /// `error` is not a `source`: the message carries it already.
    #[error("expert cache {} was found {reason}, and rebuilding it failed: {error}", path.display())]
    Rebuild { path: PathBuf, reason: String, error: Box<CacheError> },
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
