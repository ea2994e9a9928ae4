//! Architectures (config → layer plan), weight sources, tokenizer and chat template, the engine
//! (prefill/decode orchestration, sampling, KV cache) and synthetic models.

pub mod build;
pub mod config;
pub mod dense_cache;
pub mod error;
pub mod files;
pub mod source;
pub use krasis_core::spec;
pub mod synth;
pub mod tensors;

pub use error::{ModelError, Result};
pub use spec::ModelSpec;
pub mod engine;
pub mod expert_caches;
pub mod generate;
pub mod gpu;
pub mod heatmap;
pub mod linear;
pub mod load;
pub mod memory;
pub mod packed_ops;
pub mod placement;
pub mod precision;
pub mod quantized;
pub mod rope;
pub mod router;
pub mod runtime;
pub mod sampling;
pub mod tokenizer;
pub mod walk;
pub mod weights;
