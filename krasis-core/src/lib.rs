//! Shared types for every Krasis crate: element types and their conversions, tensor views,
//! the model specification types (architecture plan, routing rule, RoPE pairing), the hardware
//! probe and memory-budget arithmetic. Nothing here parses model files or runs kernels.

pub mod budget;
pub mod dtype;
pub mod hw;
pub mod memory;
pub mod spec;
pub mod tensor;

pub use dtype::DType;
pub use spec::ModelSpec;
pub use tensor::TensorView;
