//! Shared types for every Krasis crate: element types and their conversions, tensor views,
//! the model specification types (architecture plan, routing rule, RoPE pairing), the hardware
//! probe and memory-budget arithmetic, and the environment variables the libraries read for tests
//! and measurements ([`knobs`]). Nothing here parses model files or runs kernels.

pub mod budget;
pub mod dtype;
pub mod hw;
pub mod knobs;
pub mod memory;
pub mod spec;
pub mod tensor;

pub use dtype::DType;
pub use spec::ModelSpec;
pub use tensor::TensorView;

/// Turns a caught panic's payload into text (for errors that report a panic instead of dying).
pub fn panic_text(p: Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".to_string()
    }
}
