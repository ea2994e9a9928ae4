//! FP4 expert matmuls (`krasis_cpu::quant::matmul_packed` on MXFP4 / NVFP4 layouts of
//! `krasis_quant::fp4`) beside INT4 g128 on the same shapes: GB/s of packed weight bytes
//! (criterion `Throughput::Bytes`, one matrix per iteration) on gpt-oss-120b's expert shapes —
//! w13 = 2×2880 rows × K 2880, w2 = 2880 rows × K 2880 — per ISA this CPU runs (passed
//! explicitly), M = 1, 2 (a decode token: value and residual rows) and 8, on 1 thread and on all
//! threads (row blocks split evenly, a spin barrier between matrices as a decode pool would
//! have). `read/…` is a plain streaming read of the same bytes with the same threads: the ceiling
//! (#40 asks FP4 to stream at ≥ 85 % of the bandwidth probe, as INT4 does).
//!
//! Every iteration reads the next of enough distinct copies of the matrix
//! (`KRASIS_BENCH_POOL_MB`, default 1024 MiB) that the last-level cache cannot hold them: DRAM
//! streaming. `hot/…` reads one copy over and over (cache-resident: the compute ceiling).
//!
//! Quick run: `cargo bench -p krasis-cpu --bench fp4_matmul -- --warm-up-time 1 --measurement-time 2`
//! (append a filter such as `w13_nvfp4/avx512/m1` to select).

#[path = "support/packed.rs"]
mod packed;
mod support;

use criterion::{criterion_group, criterion_main, Criterion};
use krasis_quant::cpu_layout::{pack, pack_w13, PackedLayout};
use krasis_quant::fp4::{self, test_matrix, Fp4Kind};
use krasis_quant::group::quantize;
use krasis_quant::Bits;
use packed::{bench_cases, Case};
use support::rand_f32;

fn build_cases() -> Vec<Case> {
    let (h, inter) = (2880, 2880);
    let mut cases = Vec::new();
    for kind in [Fp4Kind::Mxfp4, Fp4Kind::Nvfp4] {
        let (g, u, d) =
            (test_matrix(kind, inter, h, 1), test_matrix(kind, inter, h, 2), test_matrix(kind, h, inter, 3));
        let l13 = fp4::w13_layout(&g, &u).unwrap();
        let mut p13 = vec![0u8; l13.bytes()];
        fp4::pack_w13_into(&g, &u, &mut p13).unwrap();
        let (p2, l2) = (fp4::pack(&d), fp4::layout_of(&d));
        for (n, p, l) in [("w13", &p13, l13), ("w2", &p2, l2)] {
            cases.push(Case::new(format!("{n}_{kind}"), p, l));
        }
    }
    // INT4 g128 on the same shapes (2880 = 22.5 · 128: g64 is the largest group that divides it).
    let gs = krasis_quant::group::group_size_for(h, 128).unwrap();
    let g = quantize(&rand_f32(inter * h, 1), inter, h, Bits::Int4, gs);
    let u = quantize(&rand_f32(inter * h, 2), inter, h, Bits::Int4, gs);
    let (p13, l13) = pack_w13(&g, &u).unwrap();
    let d = quantize(&rand_f32(h * inter, 3), h, inter, Bits::Int4, gs);
    let (p2, l2) = (pack(&d), PackedLayout::of(&d));
    for (n, p, l) in [("w13", &p13, l13), ("w2", &p2, l2)] {
        cases.push(Case::new(format!("{n}_int4g{gs}"), p, l));
    }
    cases
}

fn bench(c: &mut Criterion) {
    bench_cases(c, "fp4_matmul", &build_cases(), &[1, 2, 8]);
}

criterion_group!(benches, bench);
criterion_main!(benches);
