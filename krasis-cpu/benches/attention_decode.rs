//! One decode token's causal attention over a cache, on a worker pool as the engine runs it: absorbed
//! MLA (V2-Lite: 16 heads sharing one 576-float latent row, values its first 512) and GQA
//! (Qwen3-30B-A3B: 32 heads over 4 kv heads of 128), at several context lengths. Reports cache
//! bytes read per second.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use krasis_core::hw::probe;
use krasis_cpu::attention::{causal_attention, KvCacheView};
use krasis_cpu::pool::{PoolPlan, WorkerPool};

mod support;
use support::rand_f32;

fn bench_decode_attention(c: &mut Criterion) {
    let pool = WorkerPool::new(PoolPlan::from_system(&probe(), None)).expect("worker pool");
    krasis_cpu::par::with_pool(&pool, || decode_attention_on(c, &pool));
}

/// [`bench_decode_attention`] with the ops on `pool`.
fn decode_attention_on(c: &mut Criterion, pool: &WorkerPool) {
    let mut g = c.benchmark_group(format!("decode_attention_{}t", pool.threads()));
    // (name, heads, kv_heads, k_dim, v_dim, shared latent row)
    for &(name, heads, kv_heads, k_dim, v_dim, shared) in
        &[("mla_v2lite", 16usize, 1usize, 576usize, 512usize, true), ("gqa_qwen3", 32, 4, 128, 128, false)]
    {
        for &ctx in &[64usize, 576, 1536, 4096] {
            let k_width = kv_heads * k_dim;
            let k = rand_f32(ctx * k_width, 1);
            let v = if shared { Vec::new() } else { rand_f32(ctx * kv_heads * v_dim, 2) };
            let view = KvCacheView {
                k: &k,
                k_stride: k_width,
                v: if shared { &k } else { &v },
                v_stride: if shared { k_width } else { kv_heads * v_dim },
                kv_heads,
                k_dim,
                v_dim,
                len: ctx,
            };
            let q = rand_f32(heads * k_dim, 3);
            let mut out = vec![0f32; heads * v_dim];
            g.throughput(Throughput::Bytes(((k.len() + v.len()) * 4) as u64));
            g.bench_function(format!("{name}_ctx{ctx}"), |b| {
                b.iter(|| causal_attention(&q, 1, heads, ctx - 1, &view, 0.07, &mut out))
            });
        }
    }
    g.finish();
}

/// The grouped kernels alone on one thread: one task's share of the V2-Lite MLA call above (18
/// cached rows of 576 floats, 16 heads), against which the whole call's time shows its overhead.
fn bench_group_kernels(c: &mut Criterion) {
    use krasis_cpu::group_attention::{group_scores, group_values, Rows};
    let (group, width, v_width, n) = (16usize, 576usize, 512usize, 18usize);
    let cache = rand_f32(n * width, 4);
    let q = rand_f32(group * width, 5);
    let mut s = vec![0f32; group * n];
    let mut o = vec![0f32; group * v_width];
    let isa = krasis_cpu::isa::active();
    let mut g = c.benchmark_group(format!("group_kernels_{}", isa.name()));
    g.throughput(Throughput::Bytes((n * width * 4) as u64));
    g.bench_function("scores_16h_18x576", |b| {
        b.iter(|| group_scores(isa, &q, group, Rows { data: &cache, start: 0, stride: width, width }, n, &mut s))
    });
    g.bench_function("values_16h_18x512", |b| {
        b.iter(|| {
            group_values(isa, &s, group, n, Rows { data: &cache, start: 0, stride: width, width: v_width }, &mut o)
        })
    });
    g.finish();
}

criterion_group!(benches, bench_decode_attention, bench_group_kernels);
criterion_main!(benches);
