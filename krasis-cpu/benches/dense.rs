//! Dense f32 reference kernels: GB/s of weight bytes for the linear op (bf16 weights), per ISA
//! available through `KRASIS_ISA` (run the bench once per value to compare).

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use krasis_cpu::linear::{linear, WeightRows};

fn bench_linear(c: &mut Criterion) {
    let mut g = c.benchmark_group("linear_bf16");
    for &(m, k, n) in &[(1usize, 2048usize, 2816usize), (16, 2048, 2816)] {
        let x: Vec<f32> = (0..m * k).map(|i| (i % 7) as f32 * 0.01).collect();
        let w: Vec<u16> = (0..n * k).map(|i| half::bf16::from_f32((i % 13) as f32 * 0.001).to_bits()).collect();
        let mut y = vec![0f32; m * n];
        g.throughput(Throughput::Bytes((n * k * 2) as u64));
        g.bench_function(format!("m{m}_k{k}_n{n}_{}", krasis_cpu::isa::active().name()), |b| {
            b.iter(|| linear(&x, m, k, WeightRows::Bf16(&w), n, &mut y))
        });
    }
    g.finish();
}

criterion_group!(benches, bench_linear);
criterion_main!(benches);
