//! The FP4 (MXFP4 / NVFP4) kernels: every ISA this CPU runs against the scalar twin, bit for
//! bit, on random ragged shapes; the scalar twin against the exact dequantised weights.

use super::tests::{expert_rows_agree, isas_match_the_twin, normal, run, twin_within_term_ulps};
use super::*;
use krasis_quant::fp4::{self, test_matrix, Fp4Kind, Fp4Matrix};
use proptest::prelude::*;

fn kind_of(nv: bool) -> Fp4Kind {
    if nv {
        Fp4Kind::Nvfp4
    } else {
        Fp4Kind::Mxfp4
    }
}

fn acts_for(x: &[f32], m: usize, k: usize, gs: usize) -> QuantizedActs {
    let mut a = QuantizedActs::new();
    quantize_acts(x, m, k, gs, &mut a);
    a
}

/// `acts · Wᵀ` in f64 from the exact weights and the dequantised activations (what the kernels
/// compute before their f32 rounding), and each output's magnitude `Σ_c |w x|`: the kernels sum
/// per-group terms in f32, so their rounding is relative to that, not to the (possibly
/// cancelled) result.
fn reference(m: &Fp4Matrix, acts: &QuantizedActs) -> (Vec<f64>, Vec<f64>) {
    let w = m.dequantize_f64();
    let x = acts.dequantize();
    let (mut y, mut mag) = (vec![0f64; acts.m * m.rows], vec![0f64; acts.m * m.rows]);
    for i in 0..acts.m {
        for r in 0..m.rows {
            let terms = (0..m.k).map(|c| w[r * m.k + c] * x[i * m.k + c] as f64);
            y[i * m.rows + r] = terms.clone().sum();
            mag[i * m.rows + r] = terms.map(f64::abs).sum();
        }
    }
    (y, mag)
}

/// A hand-made NVFP4 row: codes 1..=7 and their negatives, scale 240 (0x77), global 0.25: the
/// kernel's sum is the plain dot product (activations exact in INT8: integers up to 127).
#[test]
fn tiny_exact_case() {
    let k = 32;
    let mut weight = vec![0u8; k / 2];
    for (j, b) in weight.iter_mut().enumerate() {
        *b = ((j % 8) as u8) | ((8 + (j % 8) as u8) << 4);
    }
    let m = Fp4Matrix::from_modelopt_nvfp4(&weight, &[0x77, 0x38], 0.25, 1, k).unwrap();
    // Integers in [-127, 127] with 127 in every group of 16: INT8 holds them exactly.
    let x: Vec<f32> = (0..k).map(|c| if c % 16 == 0 { 127.0 } else { ((c * 37) % 255) as f32 - 127.0 }).collect();
    let want: f64 = m.dequantize_f64().iter().zip(&x).map(|(w, &v)| w * v as f64).sum();
    let a = acts_for(&x, 1, k, 16);
    assert_eq!(a.dequantize().iter().zip(&x).filter(|(a, b)| (**a - **b).abs() > 1e-5).count(), 0);
    let (p, l) = (fp4::pack(&m), fp4::layout_of(&m));
    for isa in Isa::available() {
        let y = run(isa, &p, &l, &a, 0..1);
        assert!((y[0] as f64 - want).abs() <= want.abs() * 1e-6, "{isa:?}: {} vs {want}", y[0]);
        assert!(y[1..].iter().all(|&v| v == 0.0), "{isa:?}: padding rows give 0");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    /// Every ISA equals the scalar twin bit for bit (ragged rows, K of any multiple of 32, M of
    /// 1 to 11 activation rows, any sub-range of row blocks), and the scalar twin is within
    /// f32 rounding of the exact product (relative to the terms' magnitude, `reference`).
    #[test]
    fn every_isa_matches_the_scalar_twin(
        rows in 1usize..70,
        k32 in 1usize..9,
        m in 1usize..12,
        nv in any::<bool>(),
        seed in any::<u64>(),
        cut in 0usize..100,
    ) {
        let (kind, k) = (kind_of(nv), 32 * k32);
        let w = test_matrix(kind, rows, k, seed);
        let (p, l) = (fp4::pack(&w), fp4::layout_of(&w));
        let x = normal(m * k, seed ^ 3);
        let a = acts_for(&x, m, k, l.gs);
        let nb = l.row_blocks();
        let want = run(Isa::Scalar, &p, &l, &a, 0..nb);
        let (exact, mag) = reference(&w, &a);
        // Per group a few roundings (the scales' products, the value and residual rows' sums)
        // and the running sum over at most 16 groups: a few f32 ulps of the terms' magnitude.
        twin_within_term_ulps(&want, &exact, &mag, (m, rows, nb), 8.0)?;
        isas_match_the_twin(&p, &l, &a, nb, cut, &want)?;
    }

    /// A whole expert (fused FP4 w13, FP4 w2) on every ISA gives the scalar twin's bits.
    #[test]
    fn expert_forward_matches_across_isas(
        blocks in 1usize..4,
        h32 in 1usize..5,
        m in 1usize..6,
        nv in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let (kind, h, inter) = (kind_of(nv), 32 * h32, 32 * blocks);
        let gate = test_matrix(kind, inter, h, seed);
        let up = test_matrix(kind, inter, h, seed ^ 1);
        let down = test_matrix(kind, h, inter, seed ^ 2);
        let l13 = fp4::w13_layout(&gate, &up).unwrap();
        let mut w13 = vec![0u8; l13.bytes()];
        fp4::pack_w13_into(&gate, &up, &mut w13).unwrap();
        let (w2, l2) = (fp4::pack(&down), fp4::layout_of(&down));
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
