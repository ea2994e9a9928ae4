//! Pure quantisation functions. Every packer has an unpacker and a scalar reference.
//! Today: FP8 E4M3 block dequantisation (DeepSeek-V3 / Kimi-K2 checkpoints).

pub mod fp8_block;
