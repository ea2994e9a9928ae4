//! CPU execution. Today: ISA detection and the dense f32 ops of the reference path (linear with
//! f32/bf16/f16 weights, RMSNorm, RoPE, causal attention over a cache, SiLU gating). Every SIMD
//! kernel sits next to its scalar twin; tests compare them.

pub mod activation;
pub mod aligned;
pub mod attention;
pub mod delta_rule;
pub mod expf;
pub mod gemm;
pub mod group_attention;
pub mod heads;
pub mod isa;
pub mod linear;
pub mod membw;
pub mod mla_decode;
pub mod mla_prefill;
pub mod moe;
pub mod moe_trace;
pub mod norm;
pub mod par;
pub mod phase_ns;
pub mod pool;
pub mod prefill_bf16;
pub mod quant;
pub mod rope;

pub use isa::Isa;
pub use linear::WeightRows;
