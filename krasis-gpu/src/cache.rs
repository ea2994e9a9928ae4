//! The on-disk cache of NVRTC output. A file's name carries its whole key — kernel name, target,
//! NVRTC version and a 128-bit hash of (cache format, source, headers, options) — so a changed
//! kernel, a different GPU architecture or another NVRTC never reuses a stale image. Files are
//! written to a temporary name and renamed, so concurrent processes and crashes never leave a
//! truncated image under a final name.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use crate::kernels::KernelSource;
use crate::nvrtc::{ImageKind, Nvrtc, Target};
use crate::GpuError;

/// Overrides the cache directory.
pub const CACHE_DIR_ENV: &str = "KRASIS_NVRTC_CACHE";

/// Bumped when the cache's file format or the compile options change meaning.
const CACHE_FORMAT: &str = "krasis-nvrtc-cache-v1";

/// Options every kernel is compiled with (besides `--gpu-architecture`). No fast-math: kernels must
/// agree with their scalar twins to rounding.
pub const COMPILE_OPTIONS: &[&str] = &["--std=c++17", "--generate-line-info"];

/// `$KRASIS_NVRTC_CACHE`, else `$XDG_CACHE_HOME/krasis/nvrtc`, else `~/.cache/krasis/nvrtc`.
pub fn default_cache_dir() -> Option<PathBuf> {
    let k = krasis_core::knobs::knobs();
    if let Some(d) = &k.nvrtc_cache {
        return Some(d.clone());
    }
    let set = |v: &Option<std::ffi::OsString>| v.as_ref().filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(x) = set(&k.xdg_cache_home) {
        return Some(x.join("krasis").join("nvrtc"));
    }
    set(&k.home).map(|h| h.join(".cache").join("krasis").join("nvrtc"))
}

/// 128-bit FNV-1a over length-prefixed parts (no two part lists hash the same byte stream).
pub fn hash128(parts: &[&[u8]]) -> u128 {
    const OFFSET: u128 = 0x6c62272e07bb014262b821756295c58d;
    const PRIME: u128 = 0x0000000001000000000000000000013B;
    let mut h = OFFSET;
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            h ^= b as u128;
            h = h.wrapping_mul(PRIME);
        }
    };
    for p in parts {
        eat(&(p.len() as u64).to_le_bytes());
        eat(p);
    }
    h
}

/// The cache file name for `kernel` compiled for `target` by NVRTC `version`.
pub fn cache_file_name(kernel: &KernelSource, target: Target, version: (i32, i32)) -> String {
    let mut parts: Vec<&[u8]> = vec![CACHE_FORMAT.as_bytes(), kernel.name.as_bytes(), kernel.src.as_bytes()];
    for h in kernel.headers {
        parts.push(h.name.as_bytes());
        parts.push(h.src.as_bytes());
    }
    for o in kernel.compile_options() {
        parts.push(o.as_bytes());
    }
    let hash = hash128(&parts);
    let ext = match target.kind {
        ImageKind::Cubin => "cubin",
        ImageKind::Ptx => "ptx",
    };
    format!("{}-{}-nvrtc{}.{}-{:032x}.{}", kernel.name, target.arch_flag(), version.0, version.1, hash, ext)
}

/// Writes `bytes` to `path` atomically: a unique temporary file in the same directory, flushed,
/// then renamed over `path`.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    fs::create_dir_all(dir)?;
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let tmp = dir.join(format!(
        ".{}.{}.{}.{}.tmp",
        path.file_name().map_or("image".into(), |n| n.to_string_lossy()),
        std::process::id(),
        nanos,
        SEQ.fetch_add(1, Ordering::Relaxed)
    ));
    let res = (|| {
        let mut f = fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        fs::rename(&tmp, path)
    })();
    if res.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    res
}

/// A compiled kernel image.
#[derive(Debug)]
pub struct CompiledImage {
    pub bytes: Vec<u8>,
    pub target: Target,
    /// True when read from the disk cache.
    pub from_cache: bool,
    /// The cache file (absent when no cache directory is usable).
    pub path: Option<PathBuf>,
}

/// Cache hits and misses since the compiler was made.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    pub hits: u64,
    pub misses: u64,
}

/// Compiles kernels through NVRTC, caching the images on disk.
pub struct KernelCompiler {
    nvrtc: &'static Nvrtc,
    dir: Option<PathBuf>,
    hits: AtomicU64,
    misses: AtomicU64,
}

impl KernelCompiler {
    /// A compiler caching under `dir` (`None`: no disk cache).
    pub fn new(nvrtc: &'static Nvrtc, dir: Option<PathBuf>) -> Self {
        KernelCompiler { nvrtc, dir, hits: AtomicU64::new(0), misses: AtomicU64::new(0) }
    }

    /// A compiler caching under [`default_cache_dir`].
    pub fn with_default_dir() -> Result<Self, GpuError> {
        Ok(KernelCompiler::new(crate::nvrtc::nvrtc()?, default_cache_dir()))
    }

    pub fn nvrtc(&self) -> &'static Nvrtc {
        self.nvrtc
    }

    pub fn cache_dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    pub fn stats(&self) -> CacheStats {
        CacheStats { hits: self.hits.load(Ordering::Relaxed), misses: self.misses.load(Ordering::Relaxed) }
    }

    /// The path `kernel` for `target` is cached at.
    pub fn cache_path(&self, kernel: &KernelSource, target: Target) -> Option<PathBuf> {
        self.dir.as_ref().map(|d| d.join(cache_file_name(kernel, target, self.nvrtc.version())))
    }

    /// Compiles without touching the cache.
    pub fn compile_uncached(&self, kernel: &KernelSource, target: Target) -> Result<Vec<u8>, GpuError> {
        self.nvrtc.compile(kernel.name, kernel.src, kernel.headers, target, &kernel.compile_options())
    }

    /// The image of `kernel` for `target`: from the cache when present, else compiled and stored.
    /// A cache directory that cannot be written only costs the caching (a warning is logged).
    pub fn image(&self, kernel: &KernelSource, target: Target) -> Result<CompiledImage, GpuError> {
        let path = self.cache_path(kernel, target);
        if let Some(p) = &path {
            if let Ok(bytes) = fs::read(p) {
                if !bytes.is_empty() {
                    tracing::debug!(
                        "krasis-gpu: kernel {} for {target} from the cache at {}",
                        kernel.name,
                        p.display()
                    );
                    self.hits.fetch_add(1, Ordering::Relaxed);
                    return Ok(CompiledImage { bytes, target, from_cache: true, path });
                }
            }
        }
        self.misses.fetch_add(1, Ordering::Relaxed);
        let t0 = Instant::now();
        let bytes = self.compile_uncached(kernel, target)?;
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        let (maj, min) = self.nvrtc.version();
        match &path {
            Some(p) => match write_atomic(p, &bytes) {
                Ok(()) => tracing::info!(
                    "krasis-gpu: compiled kernel {} for {target} with NVRTC {maj}.{min} in {ms:.0} ms; cached at {}",
                    kernel.name,
                    p.display()
                ),
                Err(e) => tracing::warn!(
                    "krasis-gpu: compiled kernel {} for {target} in {ms:.0} ms but cannot cache it at {}: {e}",
                    kernel.name,
                    p.display()
                ),
            },
            None => tracing::info!(
                "krasis-gpu: compiled kernel {} for {target} in {ms:.0} ms; no cache directory (set {CACHE_DIR_ENV})",
                kernel.name
            ),
        }
        Ok(CompiledImage { bytes, target, from_cache: false, path })
    }

    /// Removes a cached image that the driver refused (corrupt or truncated by a foreign writer).
    pub fn evict(&self, kernel: &KernelSource, target: Target) {
        if let Some(p) = self.cache_path(kernel, target) {
            let _ = fs::remove_file(p);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nvrtc::Header;

    #[test]
    fn hash_separates_parts() {
        assert_ne!(hash128(&[b"ab", b"c"]), hash128(&[b"a", b"bc"]));
        assert_eq!(hash128(&[b"x"]), hash128(&[b"x"]));
    }

    #[test]
    fn file_name_keys_on_source_headers_arch_and_version() {
        const H1: &[Header] = &[Header { name: "h.cuh", src: "int a;" }];
        const H2: &[Header] = &[Header { name: "h.cuh", src: "int b;" }];
        let k = KernelSource { name: "k", src: "x", headers: H1, options: &[], functions: &[] };
        let n = cache_file_name(&k, Target::sass(90), (12, 9));
        assert!(n.starts_with("k-sm_90a-nvrtc12.9-") && n.ends_with(".cubin"), "{n}");
        assert_eq!(n, cache_file_name(&k, Target::sass(90), (12, 9)));
        assert_ne!(n, cache_file_name(&k, Target::sass(80), (12, 9)));
        assert_ne!(n, cache_file_name(&k, Target::sass(90), (13, 0)));
        assert_ne!(n, cache_file_name(&KernelSource { src: "y", ..k }, Target::sass(90), (12, 9)));
        assert_ne!(n, cache_file_name(&KernelSource { headers: H2, ..k }, Target::sass(90), (12, 9)));
        assert_ne!(n, cache_file_name(&KernelSource { options: &["-DX=1"], ..k }, Target::sass(90), (12, 9)));
        let ptx = cache_file_name(&k, Target { arch: 90, kind: ImageKind::Ptx }, (12, 9));
        assert!(ptx.contains("compute_90") && ptx.ends_with(".ptx"), "{ptx}");
    }

    #[test]
    fn atomic_write_replaces_and_leaves_no_temp() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("sub").join("a.cubin");
        write_atomic(&p, b"one").unwrap();
        write_atomic(&p, b"two").unwrap();
        assert_eq!(fs::read(&p).unwrap(), b"two");
        let names: Vec<_> = fs::read_dir(p.parent().unwrap()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names.len(), 1, "{names:?}");
    }
}
