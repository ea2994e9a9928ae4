//! Weight sources: canonical tensor names → typed views. Implemented by the safetensors
//! directory and by GGUF files; the loader above never knows which one it talks to.

pub mod adapt;
pub mod files;
pub mod gguf;
mod safetensors;

#[cfg(test)]
mod kimi_layout_tests;

use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use krasis_core::{DType, TensorView};
use memmap2::Mmap;

pub use self::safetensors::{fnv1a, SafetensorsDir, SafetensorsFile};

use crate::error::Result;

/// Bytes of one tensor: a range of a shared read-only mapping (zero-copy), or values a source
/// produced on read (a dequantised GGUF block tensor), or bytes copied out of a mapping
/// ([`SharedBytes::copied`]). Cheap to clone either way.
#[derive(Clone)]
pub struct SharedBytes {
    backing: Backing,
    range: Range<usize>,
}

#[derive(Clone)]
enum Backing {
    /// A file mapping, and the file itself where the source kept it open, so that small reads
    /// can bypass the mapping ([`SharedBytes::read_at`]).
    Map { map: Arc<Mmap>, file: Option<Arc<File>> },
    /// f32 storage, so the bytes are 4-byte aligned and a loader keeps them without a copy.
    Floats(Arc<[f32]>),
}

impl SharedBytes {
    /// `range` of `map`; [`SharedBytes::read_at`] reads it through the mapping.
    pub fn new(map: Arc<Mmap>, range: Range<usize>) -> Self {
        assert!(range.start <= range.end && range.end <= map.len());
        SharedBytes { backing: Backing::Map { map, file: None }, range }
    }

    /// `range` of `map`, which maps `file`: [`SharedBytes::read_at`] reads it from the file with
    /// positioned reads, leaving the mapping untouched.
    pub fn of_file(map: Arc<Mmap>, file: Arc<File>, range: Range<usize>) -> Self {
        assert!(range.start <= range.end && range.end <= map.len());
        SharedBytes { backing: Backing::Map { map, file: Some(file) }, range }
    }

    /// Owned f32 values (little-endian bytes, as `DType::F32` reads them).
    pub fn from_f32(values: Vec<f32>) -> Self {
        let len = values.len() * 4;
        SharedBytes { backing: Backing::Floats(values.into()), range: 0..len }
    }

    pub fn as_slice(&self) -> &[u8] {
        match &self.backing {
            Backing::Map { map, .. } => &map[self.range.clone()],
            Backing::Floats(v) => &bytemuck::cast_slice(v)[self.range.clone()],
        }
    }

    /// Bytes held in memory of their own (4-byte aligned), as [`SharedBytes::copied`] keeps them.
    pub fn from_bytes(src: &[u8]) -> Self {
        let mut v = vec![0f32; src.len().div_ceil(4)];
        bytemuck::cast_slice_mut::<f32, u8>(&mut v)[..src.len()].copy_from_slice(src);
        SharedBytes { backing: Backing::Floats(v.into()), range: 0..src.len() }
    }

    /// Bytes `range` of these bytes, sharing the backing (a mapped range stays mapped).
    ///
    /// # Panics
    /// If `range` runs past these bytes.
    pub fn slice(&self, range: Range<usize>) -> SharedBytes {
        assert!(range.start <= range.end && range.end <= self.range.len(), "SharedBytes::slice out of range");
        SharedBytes {
            backing: self.backing.clone(),
            range: self.range.start + range.start..self.range.start + range.end,
        }
    }

    /// Whether the bytes are a range of a file mapping (not copied or produced on read).
    pub fn is_mapped(&self) -> bool {
        matches!(self.backing, Backing::Map { .. })
    }

    /// The same bytes in memory of their own (4-byte aligned), so that reading them never
    /// touches the mapping: for small tensors read whole at every token (routers), whose mapped
    /// pages would bring in the page-cache folio around them (up to 2 MiB of a file written in
    /// one piece). Bytes already in memory are shared, not copied.
    pub fn copied(&self) -> SharedBytes {
        match &self.backing {
            Backing::Floats(_) => self.clone(),
            Backing::Map { .. } => Self::from_bytes(self.as_slice()),
        }
    }

    /// Copies bytes `offset..offset + buf.len()` of this tensor into `buf`. A mapped tensor whose
    /// file is known is read with a positioned read (`pread`), so its mapping gains no resident
    /// pages: a read through the mapping makes the whole page-cache folio around the bytes
    /// resident (a file written in one piece is cached in folios of up to 2 MiB, and
    /// `madvise` advice does not change that), which for an embedding read a row per token
    /// would make most of it resident. Falls back to the mapping if the read fails.
    ///
    /// # Panics
    /// If the bytes run past the tensor's end.
    pub fn read_at(&self, offset: usize, buf: &mut [u8]) {
        let end = offset.checked_add(buf.len()).filter(|&e| e <= self.range.len());
        let Some(end) = end else {
            panic!("SharedBytes::read_at: {offset}+{} past the {}-byte tensor", buf.len(), self.range.len())
        };
        if let Backing::Map { file: Some(file), .. } = &self.backing {
            match file.read_exact_at(buf, (self.range.start + offset) as u64) {
                Ok(()) => return,
                Err(e) => tracing::debug!("positioned read of a weight file failed ({e}); reading the mapping"),
            }
        }
        buf.copy_from_slice(&self.as_slice()[offset..end]);
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
    /// Whether [`WeightSource::tensor`] serves `name` as a range of a file mapping (zero-copy;
    /// [`SharedBytes::read_at`] reads it from the file), not as values produced on read.
    /// Default: no.
    fn is_mapped(&self, name: &str) -> bool {
        let _ = name;
        false
    }
    /// `name`'s stored ggml blocks and their type, when it is one block-typed tensor (or one
    /// expert's slice of a stacked one) of a GGUF: what an expert cache that keeps a stored format
    /// reads instead of [`WeightSource::tensor`]'s dequantised values. `None` for anything else
    /// (float tensors, tensors rebuilt from others, every safetensors source).
    fn ggml_blocks(&self, name: &str) -> Result<Option<(krasis_quant::ggml::GgmlType, SharedBytes)>> {
        let _ = name;
        Ok(None)
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
