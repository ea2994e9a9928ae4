//! Weight sources: canonical tensor names → typed views. Implemented by the safetensors
//! directory today and by GGUF later; the loader above never knows which one it talks to.

mod safetensors;

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use krasis_core::{DType, TensorView};
use memmap2::Mmap;

pub use self::safetensors::{fnv1a, SafetensorsDir, SafetensorsFile};

use crate::error::Result;

/// Bytes of one tensor inside a shared, read-only mapping: cheap to clone, zero-copy.
#[derive(Clone)]
pub struct SharedBytes {
    map: Arc<Mmap>,
    range: Range<usize>,
}

impl SharedBytes {
    pub fn new(map: Arc<Mmap>, range: Range<usize>) -> Self {
        assert!(range.end <= map.len());
        SharedBytes { map, range }
    }

    pub fn as_slice(&self) -> &[u8] {
        &self.map[self.range.clone()]
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
}
