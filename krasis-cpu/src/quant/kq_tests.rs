//! The Q4_K / Q6_K kernels: every ISA this CPU runs against the scalar twin, bit for bit, on
//! random ragged shapes; the scalar twin against the exact product of ggml's dequantised weights
//! and the quantised activations.

use super::tests::{expert_rows_agree, isas_match_the_twin, normal, run, twin_within_term_ulps};
use super::*;
use krasis_quant::ggml::GgmlType;
use krasis_quant::kquant::{self, KQuant, KQuantMatrix};
use proptest::prelude::*;

fn acts_for(x: &[f32], m: usize, k: usize, kind: KQuant) -> QuantizedActs {
    let mut a = QuantizedActs::new();
    quantize_acts(x, m, k, kind.group(), &mut a);
    a
}

/// Random blocks of `kind` for a `[rows, 256 · sbs]` matrix (`kquant::test_matrix`: any codes,
/// scales and minimums, finite f16 `d` / `dmin`).
fn blocks(kind: KQuant, rows: usize, sbs: usize, seed: u64) -> KQuantMatrix {
    kquant::test_matrix(kind, rows, 256 * sbs, seed)
}

/// `acts · Wᵀ` in f64 from ggml's dequantised weights and the exact activations, and per output
/// the sum of the terms' magnitudes (the scale of the kernels' f32 rounding).
fn reference(m: &KQuantMatrix, acts: &QuantizedActs) -> (Vec<f64>, Vec<f64>) {
    let w = m.dequantize();
    let (k, ng, gs) = (m.k, acts.groups(), acts.gs);
    let x: Vec<f64> =
        (0..acts.m * k).map(|e| acts.q[e] as f64 * acts.scales[(e / k) * ng + (e % k) / gs] as f64).collect();
    let mut y = vec![0f64; acts.m * m.rows];
    let mut mag = vec![0f64; acts.m * m.rows];
    for i in 0..acts.m {
        for r in 0..m.rows {
            y[i * m.rows + r] = (0..k).map(|c| w[r * k + c] as f64 * x[i * k + c]).sum();
            mag[i * m.rows + r] = (0..ng)
                .map(|g| {
                    let part: f64 = (g * gs..(g + 1) * gs).map(|c| w[r * k + c] as f64 * x[i * k + c]).sum();
                    let abs: f64 = (g * gs..(g + 1) * gs).map(|c| (w[r * k + c] as f64 * x[i * k + c]).abs()).sum();
                    part.abs() + abs * f32::EPSILON as f64
                })
                .sum();
        }
    }
    (y, mag)
}

/// A hand-made Q4_K row and Q6_K row against integer activations INT8 holds exactly: the
/// kernels' sum is the plain dot product of ggml's values.
#[test]
fn tiny_exact_case() {
    for kind in [KQuant::Q4K, KQuant::Q6K] {
        let m = blocks(kind, 3, 2, 7);
        let w = m.dequantize();
        let k = m.k;
        let x: Vec<f32> = (0..k).map(|c| if c % 16 == 0 { 127.0 } else { ((c * 37) % 255) as f32 - 127.0 }).collect();
        let a = acts_for(&x, 1, k, kind);
        let (p, l) = (kquant::pack(&m), kquant::layout_of(&m));
        for isa in Isa::available() {
            let y = run(isa, &p, &l, &a, 0..1);
            for r in 0..3 {
                let want: f64 = (0..k).map(|c| w[r * k + c] as f64 * x[c] as f64).sum();
                let scale: f64 = (0..k).map(|c| (w[r * k + c] as f64 * x[c] as f64).abs()).sum();
                assert!((y[r] as f64 - want).abs() <= scale * 1e-6, "{kind} {isa:?} row {r}: {} vs {want}", y[r]);
            }
            assert!(y[3..].iter().all(|&v| v == 0.0), "{isa:?}: padding rows give 0");
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Every ISA equals the scalar twin bit for bit (ragged rows, 1–3 super-blocks, M of 1 to
    /// 11 activation rows, any sub-range of row blocks, split group ranges), and the scalar twin
    /// is within f32 rounding of the exact product of ggml's values.
    #[test]
    fn every_isa_matches_the_scalar_twin(
        q6 in any::<bool>(),
        rows in 1usize..50,
        sbs in 1usize..4,
        m in 1usize..12,
        amp in prop::sample::select(vec![1e-3f32, 1.0, 40.0]),
        seed in any::<u64>(),
        cut in 0usize..100,
    ) {
        let kind = if q6 { KQuant::Q6K } else { KQuant::Q4K };
        let w = blocks(kind, rows, sbs, seed);
        let k = w.k;
        let (p, l) = (kquant::pack(&w), kquant::layout_of(&w));
        let x: Vec<f32> = normal(m * k, seed ^ 3).iter().map(|v| v * amp).collect();
        let a = acts_for(&x, m, k, kind);
        let nb = l.row_blocks();
        let want = run(Isa::Scalar, &p, &l, &a, 0..nb);
        let (exact, mag) = reference(&w, &a);
        twin_within_term_ulps(&want, &exact, &mag, (m, rows, nb), 8.0)?;
        isas_match_the_twin(&p, &l, &a, nb, cut, &want)?;
    }

    /// A whole expert (fused Q4_K w13, Q6_K w2) on every ISA gives the scalar twin's numbers
    /// (silu aside, see `silu_mul_w13`).
    #[test]
    fn expert_forward_matches_across_isas(
        blocks16 in 1usize..3,
        m in prop::sample::select(vec![1usize, 2, 5, 40]),
        seed in any::<u64>(),
    ) {
        let (h, inter) = (256, 256 * blocks16);
        let gate = blocks(KQuant::Q4K, inter, 1, seed);
        let up = blocks(KQuant::Q4K, inter, 1, seed ^ 1);
        let down = blocks(KQuant::Q6K, h, blocks16, seed ^ 2);
        let (w13, l13) = kquant::pack_w13(&gate, &up).unwrap();
        let (w2, l2) = (kquant::pack(&down), kquant::layout_of(&down));
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

/// The types `ggml_int8_g32` reads run on the plain INT8 kernels: their product is ggml's values
/// times the activations.
#[test]
fn q5_0_as_int8_g32_runs_on_the_int8_kernels() {
    let (rows, k) = (20, 64);
    let mut bytes: Vec<u8> = (0..rows * 2 * 22).map(|i| (i * 97 % 251) as u8).collect();
    for b in bytes.chunks_exact_mut(22) {
        b[0] = 0x00;
        b[1] = 0x2c; // d = 2^-4
    }
    let m = kquant::ggml_int8_g32(GgmlType::Q5_0, &bytes, rows, k).unwrap();
    let w = krasis_quant::ggml::dequantize_vec(GgmlType::Q5_0, &bytes, rows * k).unwrap();
    let (p, l) = (krasis_quant::cpu_layout::pack(&m), PackedLayout::of(&m));
    let x = normal(k, 5);
    let mut a = QuantizedActs::new();
    quantize_acts(&x, 1, k, 32, &mut a);
    let xd = a.dequantize();
    for isa in Isa::available() {
        let y = run(isa, &p, &l, &a, 0..l.row_blocks());
        for r in 0..rows {
            let want: f64 = (0..k).map(|c| w[r * k + c] as f64 * xd[c] as f64).sum();
            assert!((y[r] as f64 - want).abs() <= 1e-4 * want.abs().max(1.0), "{isa:?} row {r}: {} vs {want}", y[r]);
        }
    }
}
