//! One V2-Lite MLA layer's attention core at 512 and 2048 prompt tokens (a fresh prompt: the
//! cache empty before the call): the absorbed form against the decompressed prefill
//! (`krasis_cpu::mla_prefill`), with `kv_b` as the quantised engine holds it (INT8 per head,
//! `packed`) and as the reference path does (`f32`). The projections before and `o_proj` after
//! are the same in both forms and are left out. Threads: `KRASIS_BENCH_THREADS` (default: one
//! per core), on the pinned worker pool as the engine runs them.

use std::sync::Arc;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use krasis_core::hw::probe;
use krasis_core::spec::MlaDims;
use krasis_cpu::pool::{PoolPlan, WorkerPool};
use krasis_model::cpu::attention::{CpuMlaParts, KvB, MlaAttention, MlaPrefillMode, SeqKv};
use krasis_model::cpu::packed_ops::{kv_b_layouts, pack_kv_b, PackedBytes, PackedKvB};
use krasis_model::model::build::MlaParts;
use krasis_model::model::linear::{DenseLinear, LinearOp, MatrixData};

/// DeepSeek-V2-Lite's attention geometry.
const DIMS: MlaDims = MlaDims { heads: 16, nope: 128, rope: 64, v_dim: 128, latent: 512 };

fn data(n: usize, seed: u64) -> Vec<f32> {
    (0..n).map(|i| ((i as f32 * 0.618_034 + seed as f32 * 1.7).sin()) * 0.5).collect()
}

/// The weights of a layer whose only part in use is `kv_b`.
fn parts(kv_b: KvB) -> CpuMlaParts {
    let unused = || -> Box<dyn LinearOp> { Box::new(DenseLinear::new(1, 1, MatrixData::Owned(vec![0.0]))) };
    MlaParts { q_a: None, q_b: unused(), kv_a: unused(), kv_a_norm: vec![1.0], kv_b, o: unused() }
}

fn layer(w: &CpuMlaParts) -> MlaAttention<'_> {
    MlaAttention::new(DIMS, 1e-6, 1.0 / ((DIMS.nope + DIMS.rope) as f32).sqrt(), w)
}

fn bench(c: &mut Criterion) {
    let threads = std::env::var("KRASIS_BENCH_THREADS").ok().and_then(|v| v.parse().ok());
    let pool = Arc::new(WorkerPool::new(PoolPlan::from_system(&probe(), threads)).expect("worker pool"));
    krasis_cpu::par::with_pool(&pool, || bench_on(c, &pool));
}

/// The benches, with the dense ops on `pool`.
fn bench_on(c: &mut Criterion, pool: &Arc<WorkerPool>) {
    let d = DIMS;
    let kv_b_rows = d.heads * (d.nope + d.v_dim);
    let kv_b = |packed: bool| -> KvB {
        let w = data(kv_b_rows * d.latent, 3);
        if !packed {
            return KvB::F32(w);
        }
        let dense = DenseLinear::new(kv_b_rows, d.latent, MatrixData::Owned(w));
        let l = kv_b_layouts(&d, 128).expect("V2-Lite's kv_b packs");
        let (uk, uv) = (pack_kv_b(&dense, &d, true, &l.uk), pack_kv_b(&dense, &d, false, &l.uv));
        KvB::Packed(Box::new(PackedKvB::new(PackedBytes::Owned(uk), PackedBytes::Owned(uv), l, d, pool.clone())))
    };
    let mut g = c.benchmark_group(format!("mla_attention_v2lite_{}threads", pool.threads()));
    g.sample_size(10);
    for t in [512usize, 2048] {
        let q = data(t * d.heads * (d.nope + d.rope), 1);
        let kva = data(t * (d.latent + d.rope), 2);
        g.throughput(Throughput::Elements(t as u64));
        for (kv_b_name, packed) in [("packed", true), ("f32", false)] {
            for mode in [MlaPrefillMode::Absorbed, MlaPrefillMode::Decompressed] {
                if t > 512 && mode == MlaPrefillMode::Absorbed && !packed {
                    continue; // minutes per sample on two cores; the packed row shows the trend
                }
                let w = parts(kv_b(packed));
                let mut layer = layer(&w);
                layer.prefill = mode;
                let form = if mode == MlaPrefillMode::Absorbed { "absorbed" } else { "decompressed" };
                let name = format!("t{t}_{kv_b_name}_{form}");
                g.bench_function(name, |b| {
                    b.iter(|| {
                        let mut kv = layer.new_cache();
                        layer.attend(&q, &kva, &mut [SeqKv { rows: t, kv: &mut kv }])
                    })
                });
            }
        }
    }
    g.finish();

    // Where the threshold constants come from: short calls, fresh or after a cached prefix.
    let mut g = c.benchmark_group(format!("mla_threshold_v2lite_{}threads", pool.threads()));
    g.sample_size(10);
    for (t, prefix) in [(16usize, 0usize), (32, 0), (32, 480), (32, 992)] {
        let q = data(t * d.heads * (d.nope + d.rope), 1);
        let row = d.latent + d.rope;
        let kva = data((prefix + t) * row, 2);
        for mode in [MlaPrefillMode::Absorbed, MlaPrefillMode::Decompressed] {
            let w = parts(kv_b(true));
            let mut layer = layer(&w);
            layer.prefill = mode;
            let form = if mode == MlaPrefillMode::Absorbed { "absorbed" } else { "decompressed" };
            g.bench_function(format!("t{t}_after{prefix}_packed_{form}"), |b| {
                b.iter_batched_ref(
                    || {
                        let mut kv = layer.new_cache();
                        kv.append(&kva[..prefix * row], None);
                        kv
                    },
                    |kv| layer.attend(&q, &kva[prefix * row..], &mut [SeqKv { rows: t, kv }]),
                    criterion::BatchSize::LargeInput,
                )
            });
        }
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
