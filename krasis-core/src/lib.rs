//! Shared types for every Krasis crate: element types and their conversions, tensor views,
//! the hardware probe and memory-budget arithmetic. Nothing here knows about models or kernels.

pub mod budget;
pub mod dtype;
pub mod hw;
pub mod memory;
pub mod tensor;

pub use dtype::DType;
pub use tensor::TensorView;
