//! Pure quantisation functions. Every packer has an unpacker and a scalar reference.
//! Today: FP8 E4M3 block dequantisation (DeepSeek-V3 / Kimi-K2 checkpoints); symmetric per-group
//! INT4/INT8 quantisation along K (`group`), its CPU packed layout (`cpu_layout`) and its GPU tile
//! layout (`gpu_layout`); llama.cpp's
//! GGUF tensor types and their dequantisers (`ggml`); the 4-bit float formats MXFP4 and NVFP4 kept
//! as stored, and their CPU layout (`fp4`); asymmetric INT4 in groups of 32 (`int4_asym`).

pub mod cpu_layout;
pub mod fp4;
pub mod fp8_block;
pub mod ggml;
pub mod gpu_layout;
pub mod group;
pub mod int4_asym;

pub use group::{Bits, QuantError, QuantizedMatrix};
