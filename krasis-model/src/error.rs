//! Errors of model loading and running. Every variant names the file, tensor or field at fault.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("model directory {0} does not exist or is not a directory")]
    MissingDir(PathBuf),
    /// Not a `source`: the message already carries the OS error, and a source would print it
    /// twice in the CLI's `{:#}` chain.
    #[error("{path}: {err}")]
    Io { path: PathBuf, err: std::io::Error },
    #[error("{path}: malformed JSON: {msg}")]
    Json { path: PathBuf, msg: String },
    #[error("{path}: field `{field}`: {msg}")]
    Config { path: PathBuf, field: String, msg: String },
    #[error("{path}: unsupported model_type `{found}`; supported: {supported}")]
    UnsupportedArch { path: PathBuf, found: String, supported: String },
    #[error("{path}: {msg}")]
    Safetensors { path: PathBuf, msg: String },
    #[error("{path}: GGUF: {msg}")]
    Gguf { path: PathBuf, msg: String },
    #[error("tensor `{name}` not found in {dir}")]
    MissingTensor { name: String, dir: PathBuf },
    #[error("tensor `{name}` in {path}: expected shape {expected:?}, found {found:?}")]
    Shape { name: String, path: PathBuf, expected: Vec<usize>, found: Vec<usize> },
    #[error("tensor `{name}` in {path}: dtype {found} is not usable here ({msg})")]
    DType { name: String, path: PathBuf, found: String, msg: String },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    Template(String),
    #[error("prompt token id {id} at position {pos} is outside the vocabulary (vocab_size {vocab})")]
    TokenOutOfRange { id: u64, pos: usize, vocab: usize },
    #[error("{0}")]
    Invalid(String),
    /// Not marked `#[source]`: the message already carries the GPU error, and a source would
    /// print it twice in the CLI's `{:#}` chain.
    #[error("GPU: {0}")]
    Gpu(krasis_gpu::GpuError),
}

impl From<krasis_gpu::GpuError> for ModelError {
    fn from(e: krasis_gpu::GpuError) -> Self {
        ModelError::Gpu(e)
    }
}

pub type Result<T> = std::result::Result<T, ModelError>;

impl ModelError {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        ModelError::Io { path: path.into(), err: source }
    }
}
