use proptest::prelude::*;

use super::*;
use crate::attention::decode_shared_kv_planned;
use crate::heads::{HeadMatmul, HeadStrides};
use crate::moe::tests::data;
use crate::moe::PoolMatmul;
use crate::pool::PoolPlan;
use krasis_quant::cpu_layout::pack;
use krasis_quant::group::quantize;
use krasis_quant::Bits;

/// `heads` random matrices `[rows, k]` packed back to back, and their layout.
fn packed(heads: usize, rows: usize, k: usize, gs: usize, bits: Bits, seed: u64) -> (Vec<u8>, PackedLayout) {
    let mut w = Vec::new();
    for h in 0..heads {
        w.extend_from_slice(&pack(&quantize(&data(rows * k, seed + h as u64), rows, k, bits, gs)));
    }
    (w, PackedLayout::new(rows, k, gs, bits).unwrap())
}

/// The same token through the separate dispatches: HeadMatmul absorb, the position-split
/// attention with the same plan, HeadMatmul W_UV.
#[allow(clippy::too_many_arguments)]
fn separate(
    pool: &WorkerPool,
    isa: Isa,
    d: &MlaDims,
    q: &[f32],
    kv: &KvCacheView<'_>,
    scale: f32,
    w: &AbsorbedKvB<'_>,
) -> Vec<f32> {
    let MlaDims { heads: h, nope, rope: rd, latent: lat, v_dim: vd } = *d;
    let (qk, row, k) = (nope + rd, lat + rd, w.uk_layout.k);
    let mut padded = vec![0f32; h * k];
    for (p, qh) in padded.chunks_exact_mut(k).zip(q.chunks_exact(qk)) {
        p[..nope].copy_from_slice(&qh[..nope]);
    }
    let mut q_abs = vec![0f32; h * row];
    let (xs, ys) = (HeadStrides { token: h * k, head: k }, HeadStrides { token: h * row, head: row });
    HeadMatmul::new(pool).run(pool, isa, w.uk, &w.uk_layout, h, &padded, xs, 1, &mut q_abs, ys);
    for (qa, qh) in q_abs.chunks_exact_mut(row).zip(q.chunks_exact(qk)) {
        qa[lat..].copy_from_slice(&qh[nope..]);
    }
    let mut o_lat = vec![0f32; h * lat];
    let plan = shared_kv_plan(kv.len, h, 1, pool.threads());
    decode_shared_kv_planned(isa, &q_abs, h, kv.len - 1, kv, scale, &mut o_lat, plan);
    let mut out = vec![0f32; h * vd];
    let (xs, ys) = (HeadStrides { token: h * lat, head: lat }, HeadStrides { token: h * vd, head: vd });
    HeadMatmul::new(pool).run(pool, isa, w.uv, &w.uv_layout, h, &o_lat, xs, 1, &mut out, ys);
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 40, ..ProptestConfig::default() })]

    /// One dispatch gives the separate dispatches' bits: ragged head counts (whole groups and
    /// sub-groups of 8), nope padded to the layout's K or not, contexts from one row to several
    /// chunks, 1–5 workers, INT8 and INT4, the active ISA and the scalar one; with the output
    /// projection inside (ragged rows), PoolMatmul's bits for it.
    #[test]
    fn one_dispatch_equals_the_separate_ones(
        heads in 1usize..20,
        nope in 1usize..70,
        rope in 1usize..9,
        lat32 in 1usize..5,
        v_dim in 1usize..40,
        with_proj in any::<bool>(),
        proj_rows in 1usize..70,
        visible in 1usize..300,
        workers in 1usize..6,
        int8 in any::<bool>(),
        scalar in any::<bool>(),
        seed in 0u64..1000,
    ) {
        // The output projection's K (heads · v_dim) must be whole groups of 32; its groups span
        // several heads (v_dim 8, 16) or a head spans several (64), or neither (48, 40 · 4).
        let (heads, v_dim) = if with_proj { (heads.next_multiple_of(4), 8 * (1 + v_dim % 8)) } else { (heads, v_dim) };
        let d = MlaDims { heads, nope, rope, latent: 32 * lat32, v_dim };
        let bits = if int8 { Bits::Int8 } else { Bits::Int4 };
        let (lat, row) = (d.latent, d.latent + rope);
        let (uk, uk_layout) = packed(heads, lat, nope.next_multiple_of(32), 32, bits, seed);
        let (uv, uv_layout) = packed(heads, v_dim, lat, 32, bits, seed + 100);
        let w = AbsorbedKvB { uk: &uk, uk_layout, uv: &uv, uv_layout };
        let cache = data(visible * row, seed + 7);
        let kv = KvCacheView { k: &cache, k_stride: row, v: &cache, v_stride: row, kv_heads: 1, k_dim: row,
                               v_dim: lat, len: visible };
        let q = data(heads * (nope + rope), seed + 3);
        let pool = WorkerPool::new(PoolPlan::simulated(1, workers)).unwrap();
        let isa = if scalar { Isa::Scalar } else { crate::isa::active() };
        let want = separate(&pool, isa, &d, &q, &kv, 0.3, &w);
        let mut got = vec![f32::NAN; heads * v_dim];
        let k_proj = if with_proj { heads * v_dim } else { 32 };
        let (pw, pl) = packed(1, proj_rows, k_proj, 32, bits, seed + 200);
        let mut y = vec![f32::NAN; proj_rows];
        let proj = with_proj.then(|| OutputProj { w: &pw, layout: pl, y: &mut y });
        MlaDecode::new(&pool).run(&pool, isa, &d, &q, &kv, 0.3, &w, &mut got, proj);
        prop_assert!(got.iter().all(|v| v.is_finite()));
        let bits_of = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        prop_assert_eq!(bits_of(&got), bits_of(&want));
        if with_proj {
            let mut y_want = vec![0f32; proj_rows];
            PoolMatmul::new(&pool).run(&pool, isa, &pw, &pl, &want, 1, &mut y_want);
            prop_assert_eq!(bits_of(&y), bits_of(&y_want));
        }
    }
}

/// A long context takes the whole-group split (from 2048 positions) and still matches.
#[test]
fn long_context_equals_the_separate_dispatches() {
    let d = MlaDims { heads: 16, nope: 32, rope: 8, latent: 64, v_dim: 32 };
    let (lat, row, visible) = (d.latent, d.latent + d.rope, 2100);
    let (uk, uk_layout) = packed(d.heads, lat, 32, 32, Bits::Int8, 1);
    let (uv, uv_layout) = packed(d.heads, d.v_dim, lat, 32, Bits::Int8, 2);
    let w = AbsorbedKvB { uk: &uk, uk_layout, uv: &uv, uv_layout };
    let cache = data(visible * row, 5);
    let kv = KvCacheView {
        k: &cache,
        k_stride: row,
        v: &cache,
        v_stride: row,
        kv_heads: 1,
        k_dim: row,
        v_dim: lat,
        len: visible,
    };
    let q = data(d.heads * (d.nope + d.rope), 9);
    let pool = WorkerPool::new(PoolPlan::simulated(1, 4)).unwrap();
    let isa = crate::isa::active();
    let want = separate(&pool, isa, &d, &q, &kv, 0.1, &w);
    let mut got = vec![f32::NAN; d.heads * d.v_dim];
    MlaDecode::new(&pool).run(&pool, isa, &d, &q, &kv, 0.1, &w, &mut got, None);
    assert_eq!(got, want);
}
