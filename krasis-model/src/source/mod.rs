//! Weight sources: canonical tensor names → typed views. Implemented by the safetensors
//! directory and by GGUF files; the loader above never knows which one it talks to.

pub mod files;
pub mod gguf;
mod safetensors;

#[cfg(test)]
mod kimi_layout_tests;

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use krasis_core::{DType, TensorView};
use memmap2::Mmap;

pub use self::safetensors::{fnv1a, SafetensorsDir, SafetensorsFile};

use crate::error::Result;

/// Bytes of one tensor: a range of a shared read-only mapping (zero-copy), or values a source
/// produced on read (a dequantised GGUF block tensor). Cheap to clone either way.
#[derive(Clone)]
pub struct SharedBytes {
    backing: Backing,
    range: Range<usize>,
}

#[derive(Clone)]
enum Backing {
    Map(Arc<Mmap>),
    /// f32 storage, so the bytes are 4-byte aligned and a loader keeps them without a copy.
    Floats(Arc<[f32]>),
}

impl SharedBytes {
    pub fn new(map: Arc<Mmap>, range: Range<usize>) -> Self {
        assert!(range.start <= range.end && range.end <= map.len());
        SharedBytes { backing: Backing::Map(map), range }
    }

    /// Owned f32 values (little-endian bytes, as `DType::F32` reads them).
    pub fn from_f32(values: Vec<f32>) -> Self {
        let len = values.len() * 4;
        SharedBytes { backing: Backing::Floats(values.into()), range: 0..len }
    }

    pub fn as_slice(&self) -> &[u8] {
        match &self.backing {
            Backing::Map(m) => &m[self.range.clone()],
            Backing::Floats(v) => &bytemuck::cast_slice(v)[self.range.clone()],
        }
    }
}

/// A stored tensor and the file it lives in (for messages).
#[derive(Clone)]
pub struct StoredTensor {
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub bytes: SharedBytes,
    pub file: PathBuf,
}

impl StoredTensor {
    pub fn view(&self) -> TensorView<'_> {
        TensorView { dtype: self.dtype, shape: &self.shape, bytes: self.bytes.as_slice() }
    }
}

pub trait WeightSource: Send + Sync {
    /// Where the weights come from (for messages).
    fn location(&self) -> &Path;
    fn contains(&self, name: &str) -> bool;
    /// The stored tensor, or `ModelError::MissingTensor`.
    fn tensor(&self, name: &str) -> Result<StoredTensor>;
    /// One line for reports: the files and their size.
    fn describe(&self) -> String;
    /// The dtype [`WeightSource::tensor`] would serve `name` in, without reading it (`None`:
    /// no such tensor).
    fn stored_dtype(&self, name: &str) -> Option<DType> {
        self.tensor(name).ok().map(|t| t.dtype)
    }
    /// Drops this process's resident copy of the mapped files ([`release_mapping`]), so weights
    /// an engine has copied or quantised stop counting in its RSS; bytes still in use fault back
    /// in from the page cache when next read. Default: nothing mapped.
    fn release_resident(&self) {}
}

/// `madvise(MADV_DONTNEED)` over a read-only file mapping: its pages leave this process's
/// resident set (the page cache keeps them while memory allows) and are read again on the next
/// access. Advisory: a failure only means the pages stay resident.
pub fn release_mapping(map: &Mmap) {
    // SAFETY: the mapping is read-only and file-backed, so no data is lost: a later read of any
    // byte faults the same file contents back in.
    let r = unsafe { map.unchecked_advise(memmap2::UncheckedAdvice::DontNeed) };
    if let Err(e) = r {
        tracing::debug!("madvise(MADV_DONTNEED) on a weight mapping failed: {e}");
    }
}
