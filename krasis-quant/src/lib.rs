//! Pure quantisation functions. Every packer has an unpacker and a scalar reference.
//! Today: FP8 E4M3 block dequantisation (DeepSeek-V3 / Kimi-K2 checkpoints); symmetric per-group
//! INT4/INT8 quantisation along K (`group`), its CPU packed layout (`cpu_layout`) and its GPU tile
//! layout (`gpu_layout`); llama.cpp's
//! GGUF tensor types and their dequantisers (`ggml`); the 4-bit float formats MXFP4 and NVFP4 kept
//! as stored, and their CPU layout (`fp4`); asymmetric INT4 in groups of 32 (`int4_asym`); llama.cpp's Q4_K and Q6_K
//! kept as stored, and Q4_0/Q5_0/Q8_0 read exactly as INT8 g32 (`kquant`).

pub mod cpu_layout;
pub mod fp4;
pub mod fp8_block;
pub mod ggml;
pub mod gpu_layout;
pub mod group;
pub mod int4_asym;
pub mod kquant;

pub use group::{Bits, QuantError, QuantizedMatrix};
