//! On-disk expert caches (`experts_cpu_int{b}_g{gs}.bin`): streaming atomic build, validation,
//! and load into one anonymous page-aligned buffer with NUMA placement and transparent huge pages.
//!
//! A cache holds the routed experts of every MoE layer, one record per (MoE layer, expert), each
//! record `w13_bytes` (fused gate+up) then `w2_bytes` (down) of packer output that this crate treats
//! as opaque bytes; the header records each MoE layer's widths (`w13_bits`, `w2_bits`) and sizes,
//! which may differ between layers. Records are contiguous and 4 KiB-aligned, checksummed with
//! xxh3-64, and laid out layer-major. The file format is specified in docs/FORMATS.md and [`mod@format`].
//!
//! ```no_run
//! # use krasis_cache::*;
//! # fn f(model_dir: &std::path::Path, expected: CacheHeader,
//! #      produce: &(dyn Fn(usize, usize) -> Result<Vec<u8>, String> + Sync)) -> Result<(), CacheError> {
//! let path = default_cache_dir(model_dir).join(cache_file_name(Some(4), 128));
//! let (cache, outcome) = open_or_build(&path, &expected, produce, &|_p| {}, LoadOptions::default())?;
//! if let CacheOutcome::Built { reason } = &outcome { eprintln!("rebuilt expert cache: {reason}"); }
//! eprintln!("{}", describe(&cache));
//! let _w13: &[u8] = cache.w13(0, 3);
//! # Ok(()) }
//! ```

mod build;
mod container;
pub mod dense;
mod error;
pub mod format;
pub mod identity;
mod load;
pub mod page_cache;
pub mod temp_files;

#[cfg(test)]
mod dense_tests;
#[cfg(test)]
mod tests;

use std::path::{Path, PathBuf};

pub use build::{build, build_many, clean_stale_tmp_files, BuildProgress, BuildReport, Produce, ProduceMany};
pub use dense::{
    build_dense, dense_cache_file_name, describe_dense, open_dense, open_or_build_dense, DenseCache, DenseEntry,
    DenseHeader, DENSE_FORMAT_VERSION,
};
pub use error::CacheError;
pub use format::{
    cache_file_name, describe_layer_runs, describe_widths, CacheHeader, LayerParts, FORMAT_VERSION, MAGIC,
};
pub use identity::{file_identity, files_identity};
pub use load::{describe, open, ExpertCache, LoadOptions, LoadReport, Placement};
pub use temp_files::{remove_temp_files_and_stop, temp_files_in_progress};

/// Whether `open_or_build` found a usable cache or had to build one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CacheOutcome {
    Hit,
    /// Built because the cache was missing, stale or damaged; `reason` says which (e.g.
    /// `"stale: config_hash differs (cache 0x…, model 0x…)"`).
    Built {
        reason: String,
    },
}

/// Open the cache at `path`; if it is missing, stale or damaged, build it with `produce` and open
/// the result. Errors that rebuilding cannot cure (I/O such as permission denied, a failing
/// `produce`, a bad placement) are returned; a failed rebuild of a cache that was there but
/// stale or damaged is [`CacheError::Rebuild`], saying so. Temp files of interrupted builds are
/// removed.
pub fn open_or_build(
    path: &Path,
    expected: &CacheHeader,
    produce: &Produce<'_>,
    progress: &dyn Fn(BuildProgress),
    load: LoadOptions<'_>,
) -> Result<(ExpertCache, CacheOutcome), CacheError> {
    open_or_rebuild(path, || open(path, expected, load), || build(path, expected, produce, progress).map(|_| ()))
}

/// The rule both caches follow: try `open`; when the file is missing, stale or damaged, `build`
/// and open again; errors rebuilding cannot cure are returned as they are. Temp files of
/// interrupted builds are removed first.
pub(crate) fn open_or_rebuild<T>(
    path: &Path,
    open: impl Fn() -> Result<T, CacheError>,
    build: impl FnOnce() -> Result<(), CacheError>,
) -> Result<(T, CacheOutcome), CacheError> {
    clean_stale_tmp_files(path);
    let (reason, found) = match open() {
        Ok(cache) => return Ok((cache, CacheOutcome::Hit)),
        Err(e) if e.is_rebuildable() => (e.reason(), !matches!(e, CacheError::Missing { .. })),
        Err(e) => return Err(e),
    };
    tracing::debug!("cache {}: {reason}; building it", path.display());
    if let Err(error) = build() {
        // A cache that was there but unusable is news the build error alone would hide.
        return Err(if found {
            CacheError::Rebuild { path: path.to_path_buf(), reason, error: Box::new(error) }
        } else {
            error
        });
    }
    let cache = open()?;
    Ok((cache, CacheOutcome::Built { reason }))
}

/// `<model>/.krasis_cache` if it can be written (or, while it does not exist, created: probed by
/// creating and removing a file in it, or in the model directory), else
/// `$XDG_CACHE_HOME/krasis/<hash>` or `~/.cache/krasis/<hash>`, where `<hash>` is 16 hex digits of
/// the xxh3-64 of the canonical model path. Neither directory is created here: a writer creates
/// it (a run that only looks for a cache leaves nothing behind).
pub fn default_cache_dir(model_dir: &Path) -> PathBuf {
    let k = krasis_core::knobs::knobs();
    default_cache_dir_with(model_dir, k.xdg_cache_home.clone(), k.home.clone())
}

/// Every directory [`default_cache_dir`] may choose for `model_dir` (the model's own
/// `.krasis_cache` first, then the per-user one), whether or not it exists: where the caches of a
/// model being replaced are to be cleared.
pub fn model_cache_dirs(model_dir: &Path) -> Vec<PathBuf> {
    let k = krasis_core::knobs::knobs();
    let (xdg, home) = (k.xdg_cache_home.clone(), k.home.clone());
    vec![model_dir.join(".krasis_cache"), user_cache_dir(model_dir, xdg, home)]
}

fn default_cache_dir_with(
    model_dir: &Path,
    xdg_cache_home: Option<std::ffi::OsString>,
    home: Option<std::ffi::OsString>,
) -> PathBuf {
    let local = model_dir.join(".krasis_cache");
    let writable = if local.is_dir() { dir_is_writable(&local) } else { !local.exists() && dir_is_writable(model_dir) };
    if writable {
        return local;
    }
    user_cache_dir(model_dir, xdg_cache_home, home)
}

/// `$XDG_CACHE_HOME/krasis/<hash>` or `~/.cache/krasis/<hash>` (see [`default_cache_dir`]).
fn user_cache_dir(
    model_dir: &Path,
    xdg_cache_home: Option<std::ffi::OsString>,
    home: Option<std::ffi::OsString>,
) -> PathBuf {
    let base = match (xdg_cache_home, home) {
        (Some(x), _) if Path::new(&x).is_absolute() => PathBuf::from(x),
        (_, Some(h)) if !h.is_empty() => Path::new(&h).join(".cache"),
        _ => std::env::temp_dir(),
    };
    let canonical = std::fs::canonicalize(model_dir)
        .unwrap_or_else(|_| std::env::current_dir().map(|d| d.join(model_dir)).unwrap_or(model_dir.to_path_buf()));
    use std::os::unix::ffi::OsStrExt;
    let hash = xxhash_rust::xxh3::xxh3_64(canonical.as_os_str().as_bytes());
    base.join("krasis").join(format!("{hash:016x}"))
}

/// Whether a file can be created in the existing directory `dir` (probed by creating and
/// removing one).
fn dir_is_writable(dir: &Path) -> bool {
    if !dir.is_dir() {
        return false;
    }
    let probe = dir.join(format!(".krasis_probe.{}", std::process::id()));
    match std::fs::OpenOptions::new().write(true).create_new(true).open(&probe) {
        Ok(_) => {
            let _ = std::fs::remove_file(&probe);
            true
        }
        Err(e) => e.kind() == std::io::ErrorKind::AlreadyExists,
    }
}
