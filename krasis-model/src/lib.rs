//! The model side of Krasis, in the rooms a new family or device goes into:
//!
//! - [`arch`]: `config.json` → [`ModelSpec`], one file per model family.
//! - [`model`]: what every device shares: the tensor inventory, the typed weight loading, the
//!   build walk and the forward walk, and the math both devices follow (rope, routing, linears).
//! - [`source`]: the weight files (safetensors, GGUF) and the front door ([`source::files`]).
//! - [`cpu`] and [`gpu`]: the two implementations of the walks' operations, their sessions and
//!   their expert backends and caches.
//! - [`placement`]: who computes the routed experts (the device choice, the per-layer plan, the
//!   strategies, the precision defaults, the heatmap and the saved tune).
//! - [`runtime`]: the `Engine` API, its options, sessions, stats and the batching scheduler.
//! - [`text`]: tokenizer and chat template, sampling and the generation loop.
//! - [`synth`]: synthetic models for tests and benchmarks.

pub mod arch;
pub mod cpu;
pub mod error;
pub mod gpu;
pub mod model;
pub mod placement;
pub mod runtime;
pub mod source;
pub mod synth;
pub mod text;

pub use error::{ModelError, Result};
pub use krasis_core::spec;
pub use spec::ModelSpec;
