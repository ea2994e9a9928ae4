//! On-disk expert caches (`experts_cpu_int{b}_g{gs}.bin`, `experts_marlin_int{b}_g{gs}.bin`):
//! streaming atomic build, validation, mmap load with NUMA placement and pinning.
//!
//! Not built yet: it arrives with the CPU-expert issue. The crate exists so the dependency
//! graph (core ← quant ← {cpu, gpu, cache} ← model ← cli) is fixed from day one.
