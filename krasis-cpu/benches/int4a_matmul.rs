//! Asymmetric INT4 g32 expert matmuls (`krasis_cpu::quant::matmul_packed` on the layout of
//! `krasis_quant::int4_asym`, 5.0 bits per weight) beside symmetric INT4 g128 (4.125) and g32
//! (4.5) on the same shapes: GB/s of packed weight bytes (criterion `Throughput::Bytes`, one
//! matrix per iteration) on DeepSeek-V2-Lite's expert shapes — w13 = 2×1408 rows × K 2048, w2 =
//! 2048 rows × K 1408 — per ISA this CPU runs (passed explicitly), M = 1, 2 (a decode token: value and residual rows) and 8, on 1 thread and on
//! all threads (row blocks split evenly, a spin barrier between matrices as a decode pool would
//! have). `read/…` is a plain streaming read of the same bytes with the same threads: the
//! bandwidth probe (issue #38 item 5 asks a new INT4 default to stream at ≥ 85 % of it in
//! decode, M = 1). Tokens per second follow bytes: at equal GB/s, 5.0 bits per weight reads
//! 21 % more bytes per token than 4.125.
//!
//! Every iteration reads the next of enough distinct copies of the matrix
//! (`KRASIS_BENCH_POOL_MB`, default 1024 MiB) that the last-level cache cannot hold them: DRAM
//! streaming. `hot/…` reads one copy over and over (cache-resident: the compute ceiling).
//!
//! Quick run: `cargo bench -p krasis-cpu --bench int4a_matmul -- --warm-up-time 1 --measurement-time 2`
//! (append a filter such as `w13_int4a/avx512/m1` to select).
#[path = "support/packed.rs"]
mod packed;
mod support;

use criterion::{criterion_group, criterion_main, Criterion};
use krasis_quant::cpu_layout::{pack, pack_w13, PackedLayout};
use krasis_quant::group::quantize;
use krasis_quant::int4_asym;
use krasis_quant::Bits;
use packed::{bench_cases, Case};
use support::rand_f32;

fn build_cases() -> Vec<Case> {
    let (h, inter) = (2048, 1408);
    let mut cases = Vec::new();
    let (gw, uw, dw) = (rand_f32(inter * h, 1), rand_f32(inter * h, 2), rand_f32(h * inter, 3));
    let q = |w: &[f32], rows, k| int4_asym::quantize(w, rows, k).unwrap();
    let (g, u, d) = (q(&gw, inter, h), q(&uw, inter, h), q(&dw, h, inter));
    let (p13, l13) = int4_asym::pack_w13(&g, &u).unwrap();
    let (p2, l2) = (int4_asym::pack(&d), int4_asym::layout_of(&d));
    for (n, p, l) in [("w13", &p13, l13), ("w2", &p2, l2)] {
        cases.push(Case::new(format!("{n}_int4a"), p, l));
    }
    for gs in [128, 32] {
        let g = quantize(&gw, inter, h, Bits::Int4, gs);
        let u = quantize(&uw, inter, h, Bits::Int4, gs);
        let (p13, l13) = pack_w13(&g, &u).unwrap();
        let d = quantize(&dw, h, inter, Bits::Int4, gs);
        let (p2, l2) = (pack(&d), PackedLayout::of(&d));
        for (n, p, l) in [("w13", &p13, l13), ("w2", &p2, l2)] {
            cases.push(Case::new(format!("{n}_int4g{gs}"), p, l));
        }
    }
    cases
}

fn bench(c: &mut Criterion) {
    bench_cases(c, "int4a_matmul", &build_cases(), &[1, 2, 8]);
}

criterion_group!(benches, bench);
criterion_main!(benches);
