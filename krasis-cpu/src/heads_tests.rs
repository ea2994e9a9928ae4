use proptest::prelude::*;

use super::*;
use crate::moe::tests::data;
use crate::moe::PoolMatmul;
use crate::pool::PoolPlan;
use krasis_quant::cpu_layout::pack;
use krasis_quant::group::{dequantize, quantize};
use krasis_quant::Bits;

/// `heads` random matrices `[rows, k]` packed back to back, their layout and dequantised twins.
fn matrices(
    heads: usize,
    rows: usize,
    k: usize,
    gs: usize,
    bits: Bits,
    seed: u64,
) -> (Vec<u8>, PackedLayout, Vec<Vec<f32>>) {
    let mut w = Vec::new();
    let mut f = Vec::new();
    let mut layout = None;
    for h in 0..heads {
        let q = quantize(&data(rows * k, seed + h as u64), rows, k, bits, gs);
        w.extend_from_slice(&pack(&q));
        layout = Some(PackedLayout::of(&q));
        f.push(dequantize(&q));
    }
    (w, layout.expect("at least one head"), f)
}

/// Calls of more than `KEEP_SCRATCH_MAX_ROWS` tokens leave no buffers behind; shorter ones keep
/// theirs for the next call.
#[test]
fn calls_longer_than_the_keep_limit_leave_no_scratch() {
    let (heads, rows, k) = (3, 20, 64);
    let (w, layout, _) = matrices(heads, rows, k, 32, Bits::Int8, 7);
    let pool = WorkerPool::new(PoolPlan::simulated(1, 2)).unwrap();
    let hm = HeadMatmul::new(&pool);
    let keep = KEEP_SCRATCH_MAX_ROWS;
    for (m, kept) in [(1, true), (keep, true), (keep + 1, false), (3, true)] {
        let (xs, ys) = (HeadStrides { token: heads * k, head: k }, HeadStrides { token: heads * rows, head: rows });
        let mut y = vec![0f32; m * ys.token];
        hm.run(&pool, Isa::Scalar, &w, &layout, heads, &data(m * xs.token, 3), xs, m, &mut y, ys);
        assert_eq!(hm.scratch_bytes() > 0, kept, "after {m} tokens: {} bytes", hm.scratch_bytes());
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    /// Every head's rows equal `PoolMatmul` on that head's matrix and gathered rows, bit for bit,
    /// for ragged row counts, padded strides, 1–5 workers, INT4 and INT8, the scalar kernels and
    /// the active ISA's (which agree bit for bit), and match f32 on the dequantised weights.
    #[test]
    fn each_head_equals_its_own_matmul(
        heads in 1usize..5,
        rows in 1usize..50,
        k32 in 1usize..5,
        gs_log in 0u32..2,
        m in 1usize..4,
        workers in 1usize..6,
        int8 in any::<bool>(),
        pad_x in 0usize..7,
        pad_y in 0usize..7,
        big in any::<bool>(),
    ) {
        let k = 32 * k32;
        let gs = if k.is_multiple_of(32 << gs_log) { 32 << gs_log } else { 32 };
        let bits = if int8 { Bits::Int8 } else { Bits::Int4 };
        // `big`: a prefill's many tokens.
        let m = if big { m * 37 } else { m };
        let (w, layout, f) = matrices(heads, rows, k, gs, bits, 7);
        let xs = HeadStrides { token: heads * (k + pad_x), head: k + pad_x };
        let ys = HeadStrides { token: heads * (rows + pad_y), head: rows + pad_y };
        let x = data(m * xs.token, 3);
        let pool = WorkerPool::new(PoolPlan::simulated(1, workers)).unwrap();
        let run = |isa| {
            let mut y = vec![f32::NAN; m * ys.token];
            HeadMatmul::new(&pool).run(&pool, isa, &w, &layout, heads, &x, xs, m, &mut y, ys);
            y
        };
        let y = run(crate::isa::active());
        prop_assert_eq!(
            y.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            run(Isa::Scalar).iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
        let hb = layout.bytes();
        for h in 0..heads {
            let xh: Vec<f32> = (0..m).flat_map(|i| x[i * xs.token + h * xs.head..][..k].to_vec()).collect();
            let mut want = vec![0f32; m * rows];
            // The scalar ISA: the INT8 kernels (the active ISA may take the BF16 prefill tiles at
            // many tokens, which this INT8 per-head runner does not).
            PoolMatmul::new(&pool).run(&pool, Isa::Scalar, &w[h * hb..(h + 1) * hb], &layout, &xh, m, &mut want);
            for i in 0..m {
                let got = &y[i * ys.token + h * ys.head..][..rows];
                prop_assert_eq!(got, &want[i * rows..(i + 1) * rows]);
                // Against f32 on the dequantised weights: the split activations' rounding only,
                // a small fraction of Σ|w·x| per output.
                for (r, wr) in f[h].chunks_exact(k).enumerate() {
                    let xr = &xh[i * k..(i + 1) * k];
                    let exact: f64 = wr.iter().zip(xr).map(|(a, b)| *a as f64 * *b as f64).sum();
                    let scale: f64 = wr.iter().zip(xr).map(|(a, b)| (*a as f64 * *b as f64).abs()).sum();
                    prop_assert!((got[r] as f64 - exact).abs() <= 2e-4 * scale + 1e-6, "head {} token {} row {}", h, i, r);
                }
            }
        }
        // Padding between rows is left alone.
        if pad_y > 0 {
            prop_assert!(y[rows].is_nan());
        }
    }
}
