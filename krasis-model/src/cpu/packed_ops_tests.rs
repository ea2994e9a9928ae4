use proptest::prelude::*;

use super::*;
use crate::cpu::ffn::Mlp;
use crate::cpu::quantized::QuantLinear;
use crate::model::linear::MatrixData;
use krasis_cpu::pool::PoolPlan;
use krasis_quant::group::dequantize;

/// Deterministic values in [-1, 1] (a sine of the index, phase-shifted by `seed`).
fn data(n: usize, seed: u64) -> Vec<f32> {
    (0..n).map(|i| ((i as f32 * 0.618_034 + seed as f32 * 1.7).sin() * 1.3).clamp(-1.0, 1.0)).collect()
}

fn dense(rows: usize, cols: usize, seed: u64) -> DenseLinear {
    DenseLinear::new(rows, cols, MatrixData::Owned(data(rows * cols, seed)))
}

/// ‖a − b‖ / ‖b‖.
fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let diff = a.iter().zip(b).fold(0f64, |acc, (x, y)| acc + ((x - y) as f64) * ((x - y) as f64));
    (diff / b.iter().fold(0f64, |acc, y| acc + (*y as f64) * (*y as f64))).sqrt()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    /// A gated MLP as one pooled expert gives the three quantised linears' numbers bit for bit.
    #[test]
    fn pooled_mlp_equals_three_linears(hidden32 in 1usize..4, inter32 in 1usize..4, t in 1usize..4, workers in 1usize..4, int8 in any::<bool>()) {
        let (hidden, inter) = (32 * hidden32, 32 * inter32);
        let bits = if int8 { Bits::Int8 } else { Bits::Int4 };
        let pool = Arc::new(WorkerPool::new(PoolPlan::simulated(1, workers)).unwrap());
        let (gate, up, down) = (dense(inter, hidden, 1), dense(inter, hidden, 2), dense(hidden, inter, 3));
        let q = |m: &DenseLinear| -> Box<dyn LinearOp> { Box::new(QuantLinear::from_dense(m, bits, 128, pool.clone(), "m").unwrap()) };
        let separate = Mlp::Separate { gate: q(&gate), up: q(&up), down: q(&down) };
        let l13 = w13_layout(inter, hidden, bits, 128, "w13").unwrap();
        let w13 = PackedBytes::Owned(pack_w13_dense(&gate, &up, &l13));
        let pooled = Mlp::Pooled(Box::new(PooledMlp::new(w13, l13, q(&down), pool.clone()).unwrap()));
        let x = data(t * hidden, 4);
        let (mut a, mut b) = (data(t * hidden, 5), data(t * hidden, 5));
        separate.forward_add(&x, t, hidden, &mut a);
        pooled.forward_add(&x, t, hidden, &mut b);
        prop_assert_eq!(a, b);
        prop_assert_eq!(separate.weight_bytes(), pooled.weight_bytes());
    }

    /// A fused w13 split back into two linears (multi-node pools, `KRASIS_MLP=linears`) gives
    /// gate's and up's own packs.
    #[test]
    fn split_w13_gives_back_gate_and_up(hidden32 in 1usize..4, inter32 in 1usize..4, int8 in any::<bool>()) {
        let (hidden, inter) = (32 * hidden32, 32 * inter32);
        let bits = if int8 { Bits::Int8 } else { Bits::Int4 };
        let pool = Arc::new(WorkerPool::new(PoolPlan::simulated(1, 1)).unwrap());
        let (gate, up) = (dense(inter, hidden, 1), dense(inter, hidden, 2));
        let l13 = w13_layout(inter, hidden, bits, 128, "w13").unwrap();
        let (g, u) = crate::cpu::split_w13(&pack_w13_dense(&gate, &up, &l13), &l13, &pool);
        let one = crate::cpu::quantized::dense_layout(inter, hidden, bits, 128, "one").unwrap();
        let (want_g, want_u) = (crate::cpu::quantized::pack_dense(&gate, &one), crate::cpu::quantized::pack_dense(&up, &one));
        prop_assert_eq!(g.packed().unwrap().bytes, want_g.as_slice());
        prop_assert_eq!(u.packed().unwrap().bytes, want_u.as_slice());
    }

    /// `kv_b` per head in INT8 matches the f32 products on its dequantised weights, nope padded to
    /// a group or not.
    #[test]
    fn packed_kv_b_matches_f32_per_head(heads in 1usize..4, nope in prop::sample::select(vec![16usize, 32, 40, 64]), t in 1usize..3) {
        let dims = MlaDims { heads, nope, rope: 8, v_dim: 32, latent: 64 };
        let kv_b = dense(heads * (nope + dims.v_dim), dims.latent, 9);
        let l = kv_b_layouts(&dims, 128).unwrap();
        prop_assert_eq!(l.uk.k, nope.next_multiple_of(32));
        let pool = Arc::new(WorkerPool::new(PoolPlan::simulated(1, 2)).unwrap());
        let (uk, uv) = (pack_kv_b(&kv_b, &dims, true, &l.uk), pack_kv_b(&kv_b, &dims, false, &l.uv));
        let deq = |w: &[u8], one: &PackedLayout, h: usize| {
            let b = one.bytes();
            dequantize(&krasis_quant::cpu_layout::unpack(&w[h * b..(h + 1) * b], one).unwrap())
        };
        let k = PackedKvB::new(PackedBytes::Owned(uk.clone()), PackedBytes::Owned(uv.clone()), l, dims, pool);
        let qk = nope + dims.rope;
        let row = dims.latent + dims.rope;
        let q = data(t * heads * qk, 11);
        let mut q_abs = vec![0f32; t * heads * row];
        k.absorb(&q, qk, t, &mut q_abs, row);
        let o_lat = data(t * heads * dims.latent, 12);
        let mut o = vec![0f32; t * heads * dims.v_dim];
        k.apply_uv(&o_lat, t, &mut o);
        for h in 0..heads {
            let (wk, wv) = (deq(&uk, &l.uk, h), deq(&uv, &l.uv, h));
            for i in 0..t {
                let qn = &q[(i * heads + h) * qk..][..nope];
                let want: Vec<f32> = wk.chunks_exact(l.uk.k).map(|r| r.iter().zip(qn).map(|(a, b)| a * b).sum()).collect();
                let got = &q_abs[(i * heads + h) * row..][..dims.latent];
                prop_assert!(rel_l2(got, &want) < 1e-3, "absorb head {} token {}: {:.2e}", h, i, rel_l2(got, &want));
                let ol = &o_lat[(i * heads + h) * dims.latent..][..dims.latent];
                let want: Vec<f32> = wv.chunks_exact(dims.latent).map(|r| r.iter().zip(ol).map(|(a, b)| a * b).sum()).collect();
                let got = &o[(i * heads + h) * dims.v_dim..][..dims.v_dim];
                prop_assert!(rel_l2(got, &want) < 1e-3, "W_UV head {} token {}: {:.2e}", h, i, rel_l2(got, &want));
                // And W_UKᵀ is kv_b's W_UK rows, transposed, to INT8 precision.
                let exact: Vec<f32> = (0..dims.latent)
                    .map(|j| (0..nope).map(|n| { let mut r = vec![0f32; dims.latent]; kv_b.row_into(h * (nope + dims.v_dim) + n, &mut r); r[j] * qn[n] }).sum())
                    .collect();
                prop_assert!(rel_l2(got_abs(&q_abs, i, h, heads, row, dims.latent), &exact) < 2e-2);
            }
        }
    }
}

fn got_abs(q_abs: &[f32], i: usize, h: usize, heads: usize, row: usize, lat: usize) -> &[f32] {
    &q_abs[(i * heads + h) * row..][..lat]
}
