//! One V2-Lite layer's MLA prefill attention in the decompressed form (16 heads, nope 128,
//! rope 64, values 128, latent 512; INT8 `kv_b` packed per head as the dense-weight cache holds
//! it) over a whole prompt of 128 and 512 tokens, on the pool the engine installs: the latent
//! rows expanded into keys and values, then causal flash attention. `KRASIS_MLA_EXPAND=f32` /
//! `KRASIS_MLA_ATTEND=f32` put either half on the f32 kernels for A/B runs; the split between
//! the two halves is printed after the runs.

use std::sync::Arc;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use krasis_core::hw::probe;
use krasis_core::spec::MlaDims;
use krasis_cpu::mla_prefill::{mla_prefill_attention, phase_ns, KvBWeights, MlaPrefillInputs};
use krasis_cpu::pool::{PoolPlan, WorkerPool};
use krasis_quant::cpu_layout::{pack, PackedLayout};
use krasis_quant::group::quantize;
use krasis_quant::Bits;

mod support;
use support::rand_f32;

/// Per head `W_UKᵀ` `[latent, nope]` and `W_UV` `[v_dim, latent]`, INT8 groups of 128 (nope
/// groups of 32), packed back to back.
fn packed_kv_b(d: &MlaDims) -> (Vec<u8>, PackedLayout, Vec<u8>, PackedLayout) {
    let (mut uk, mut uv, mut layouts) = (Vec::new(), Vec::new(), None);
    for h in 0..d.heads {
        let wk = rand_f32(d.latent * d.nope, 10 + h as u64);
        let wv = rand_f32(d.v_dim * d.latent, 100 + h as u64);
        let scale = |w: Vec<f32>| w.into_iter().map(|x| x * 0.05).collect::<Vec<_>>();
        let (qk, qv) = (
            quantize(&scale(wk), d.latent, d.nope, Bits::Int8, 32),
            quantize(&scale(wv), d.v_dim, d.latent, Bits::Int8, 128),
        );
        layouts = Some((PackedLayout::of(&qk), PackedLayout::of(&qv)));
        uk.extend(pack(&qk));
        uv.extend(pack(&qv));
    }
    let (lu, lv) = layouts.expect("one head at least");
    (uk, lu, uv, lv)
}

fn bench_mla_prefill(c: &mut Criterion) {
    let pool = Arc::new(WorkerPool::new(PoolPlan::from_system(&probe(), None)).expect("worker pool"));
    krasis_cpu::par::install(pool.clone());
    let d = MlaDims { heads: 16, nope: 128, rope: 64, v_dim: 128, latent: 512 };
    let (uk, lu, uv, lv) = packed_kv_b(&d);
    let stride = d.latent + d.rope;
    let mut g = c.benchmark_group(format!("mla_prefill_{}t", pool.threads()));
    for &t in &[128usize, 512] {
        let cache = rand_f32(t * stride, 1);
        let q = rand_f32(t * d.heads * (d.nope + d.rope), 2);
        let inputs = MlaPrefillInputs {
            dims: d,
            q: &q,
            t,
            q_start: 0,
            cache: &cache,
            stride,
            kv_b: KvBWeights::Packed { uk: &uk, uk_layout: lu, uv: &uv, uv_layout: lv },
            scale: 1.0 / ((d.nope + d.rope) as f32).sqrt(),
        };
        let mut out = vec![0f32; t * d.heads * d.v_dim];
        g.throughput(Throughput::Elements(t as u64));
        let before = phase_ns();
        let mut calls = 0u64;
        g.bench_function(format!("v2lite_{t}_tokens"), |b| {
            b.iter(|| {
                calls += 1;
                mla_prefill_attention(&inputs, &mut out).expect("shapes match")
            })
        });
        let after = phase_ns();
        if calls > 0 {
            let per = |i: usize| (after[i] - before[i]) as f64 / calls as f64 / 1e3;
            println!("  {t} tokens, per call: expand {:.0} us + attend {:.0} us", per(0), per(1));
        }
    }
    g.finish();
}

criterion_group!(benches, bench_mla_prefill);
criterion_main!(benches);
