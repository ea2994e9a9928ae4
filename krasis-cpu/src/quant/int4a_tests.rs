//! The asymmetric INT4 g32 kernels: every ISA this CPU runs against the scalar twin, bit for
//! bit, on random ragged shapes; the scalar twin against the exact product of the dequantised
//! weights and activations.

use super::tests::{expert_rows_agree, isas_match_the_twin, normal, run, twin_within_term_ulps};
use super::*;
use krasis_quant::int4_asym::{self, AsymMatrix};
use proptest::prelude::*;

fn acts_for(x: &[f32], m: usize, k: usize) -> QuantizedActs {
    let mut a = QuantizedActs::new();
    quantize_acts(x, m, k, 32, &mut a);
    a
}

/// Weights with a per-row offset (so the minimums matter), of amplitude `amp`.
fn weights(rows: usize, k: usize, amp: f32, seed: u64) -> AsymMatrix {
    let mut w = normal(rows * k, seed);
    for (i, v) in w.iter_mut().enumerate() {
        *v = amp * (*v + 0.3 * ((i / k) % 5) as f32 - 0.6);
    }
    int4_asym::quantize(&w, rows, k).unwrap()
}

/// `acts · Wᵀ` in f64 from the exact weights and the dequantised activations (what the kernels
/// compute before their f32 rounding), and per output the sum of the epilogue terms'
/// magnitudes, `Σ_g |d · s_x · Σ q·x_q| + |m · s_x · Σ x_q|` (the scale of their rounding).
fn reference(m: &AsymMatrix, acts: &QuantizedActs) -> (Vec<f64>, Vec<f64>) {
    let w = m.dequantize_f64();
    let (k, ng) = (m.k, m.groups());
    // The activations exactly (q · s_x in f64; `QuantizedActs::dequantize` rounds them to f32).
    let x: Vec<f64> =
        (0..acts.m * k).map(|e| acts.q[e] as f64 * acts.scales[(e / k) * ng + (e % k) / 32] as f64).collect();
    let mut y = vec![0f64; acts.m * m.rows];
    let mut mag = vec![0f64; acts.m * m.rows];
    for i in 0..acts.m {
        for r in 0..m.rows {
            y[i * m.rows + r] = (0..k).map(|c| w[r * k + c] * x[i * k + c]).sum();
            mag[i * m.rows + r] = (0..ng)
                .map(|g| {
                    let b = m.block(r, g);
                    let sx = acts.scales[i * ng + g] as f64;
                    let dot: i64 = (0..32).map(|c| b.code(c) as i64 * acts.q[i * k + g * 32 + c] as i64).sum();
                    (b.scale().to_f64() * sx * dot as f64).abs()
                        + (b.min().to_f64() * sx * acts.sums[i * ng + g] as f64).abs()
                })
                .sum();
        }
    }
    (y, mag)
}

/// A hand-made row: codes 0..=15, scale 0.5, minimum −4 (weights −4 … 3.5), against integer
/// activations INT8 holds exactly: the kernels' sum is the plain dot product.
#[test]
fn tiny_exact_case() {
    let k = 64;
    let w: Vec<f32> = (0..k).map(|c| (c % 16) as f32 * 0.5 - 4.0).collect();
    let m = int4_asym::quantize(&w, 1, k).unwrap();
    assert_eq!(m.dequantize(), w, "the weights are on the grid");
    let x: Vec<f32> = (0..k).map(|c| if c % 32 == 0 { 127.0 } else { ((c * 37) % 255) as f32 - 127.0 }).collect();
    let want: f64 = w.iter().zip(&x).map(|(&a, &b)| a as f64 * b as f64).sum();
    let a = acts_for(&x, 1, k);
    let (p, l) = (int4_asym::pack(&m), int4_asym::layout_of(&m));
    for isa in Isa::available() {
        let y = run(isa, &p, &l, &a, 0..1);
        assert!((y[0] as f64 - want).abs() <= want.abs() * 1e-6, "{isa:?}: {} vs {want}", y[0]);
        assert!(y[1..].iter().all(|&v| v == 0.0), "{isa:?}: padding rows give 0");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    /// Every ISA equals the scalar twin bit for bit (ragged rows, K of any multiple of 32, M of
    /// 1 to 11 activation rows, any sub-range of row blocks, split group ranges), and the scalar
    /// twin is within f32 rounding of the exact product.
    #[test]
    fn every_isa_matches_the_scalar_twin(
        rows in 1usize..70,
        k32 in 1usize..9,
        m in 1usize..12,
        amp in prop::sample::select(vec![1e-3f32, 0.05, 1.0, 40.0]),
        seed in any::<u64>(),
        cut in 0usize..100,
    ) {
        let k = 32 * k32;
        let w = weights(rows, k, amp, seed);
        let (p, l) = (int4_asym::pack(&w), int4_asym::layout_of(&w));
        let x = normal(m * k, seed ^ 3);
        let a = acts_for(&x, m, k);
        let nb = l.row_blocks();
        let want = run(Isa::Scalar, &p, &l, &a, 0..nb);
        let (exact, mag) = reference(&w, &a);
        // Two roundings per term and the running sum: a few f32 ulps of the terms.
        twin_within_term_ulps(&want, &exact, &mag, (m, rows, nb), 4.0)?;
        isas_match_the_twin(&p, &l, &a, nb, cut, &want)?;
    }

    /// A whole expert (fused asymmetric w13 and w2) on every ISA gives the scalar twin's
    /// numbers (silu aside, see `silu_mul_w13`), many rows included (the AMX threshold).
    #[test]
    fn expert_forward_matches_across_isas(
        blocks in 1usize..4,
        h32 in 1usize..5,
        m in prop::sample::select(vec![1usize, 2, 5, 40]),
        seed in any::<u64>(),
    ) {
        let (h, inter) = (32 * h32, 32 * blocks);
        let gate = weights(inter, h, 0.1, seed);
        let up = weights(inter, h, 0.1, seed ^ 1);
        let down = weights(h, inter, 0.1, seed ^ 2);
        let (w13, l13) = int4_asym::pack_w13(&gate, &up).unwrap();
        let (w2, l2) = (int4_asym::pack(&down), int4_asym::layout_of(&down));
        let x = normal(m * h, seed ^ 9);
        let mut want = vec![0f32; m * h];
        let mut scratch = ExpertScratch::default();
        expert_forward(Isa::Scalar, &w13, &l13, &w2, &l2, &x, m, 0.5, &mut want, &mut scratch);
        prop_assert!(want.iter().all(|v| v.is_finite()));
        for isa in Isa::available() {
            let mut got = vec![0f32; m * h];
            expert_forward(isa, &w13, &l13, &w2, &l2, &x, m, 0.5, &mut got, &mut scratch);
            expert_rows_agree(isa, &got, &want, h)?;
        }
    }
}
