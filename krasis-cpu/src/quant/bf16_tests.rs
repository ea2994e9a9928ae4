//! The BF16 operands: the SIMD twins equal the scalar ones bit for bit, and the panel holds
//! exactly the dequantised weights rounded to BF16.

use krasis_quant::cpu_layout::{pack, PackedLayout, ROW_BLOCK};
use krasis_quant::group::{dequantize, quantize};
use krasis_quant::Bits;
use proptest::prelude::*;

use super::*;
use crate::moe::tests::data;

#[test]
fn rounding_is_nearest_even_with_denormals_as_zero() {
    assert_eq!(bf16_bits(1.0), 0x3f80);
    // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1.0).
    assert_eq!(bf16_bits(1.0 + 1.0 / 256.0), 0x3f80);
    assert_eq!(bf16_bits(1.0 + 3.0 / 256.0), 0x3f82);
    assert_eq!(bf16_bits(-2.5), 0xc020);
    assert_eq!(bf16_bits(f32::from_bits(1)), 0);
    assert_eq!(bf16_bits(-f32::from_bits(1)), 0x8000);
    assert_eq!(bf16_bits(f32::INFINITY), 0x7f80);
    assert!(bf16_value(bf16_bits(f32::NAN)).is_nan());
    assert_eq!(bf16_value(bf16_bits(f32::MAX)), f32::INFINITY);
}

/// Every row block's panel of `w` (layout `l`, `rows` real rows), SIMD and scalar, is the same;
/// each element of a real row passes `element(row, k, bf16 bits)`; padding rows are zero.
fn panels_hold_with(
    w: &[u8],
    l: &PackedLayout,
    rows: usize,
    element: impl Fn(usize, usize, u16) -> Result<(), TestCaseError>,
) -> Result<(), TestCaseError> {
    let k = l.k;
    let mut simd = vec![0u16; panel_len(l)];
    let mut scalar = vec![0u16; panel_len(l)];
    for b in 0..l.row_blocks() {
        block_panel(w, l, b, &mut simd);
        block_panel_scalar(&w[l.block_range(b)], l, &mut scalar);
        prop_assert_eq!(&simd, &scalar, "block {}", b);
        for n in 0..ROW_BLOCK {
            let r = b * ROW_BLOCK + n;
            for kk in 0..k {
                let got = scalar[(kk / 2) * 32 + 2 * n + kk % 2];
                if r < rows {
                    element(r, kk, got)?;
                } else {
                    prop_assert_eq!(got, 0, "padding row {} k {}", r, kk);
                }
            }
        }
    }
    Ok(())
}

/// [`panels_hold_with`]: each element is the dequantised matrix `deq` rounded to BF16.
fn panels_hold(w: &[u8], l: &PackedLayout, rows: usize, deq: &[f32]) -> Result<(), TestCaseError> {
    panels_hold_with(w, l, rows, |r, kk, got| {
        prop_assert_eq!(got, bf16_bits(deq[r * l.k + kk]), "row {} k {}", r, kk);
        Ok(())
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Every row block's panel, SIMD and scalar, against the dequantised matrix: ragged rows
    /// (padding rows are zero), every group size, both widths.
    #[test]
    fn panel_is_the_dequantised_weights_in_bf16(
        rows in 1usize..50,
        kg in 1usize..5,
        gsi in 0usize..3,
        int4 in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let gs = [32, 64, 128][gsi];
        let k = kg * gs;
        let bits = if int4 { Bits::Int4 } else { Bits::Int8 };
        let q = quantize(&data(rows * k, seed), rows, k, bits, gs);
        let (w, l) = (pack(&q), PackedLayout::of(&q));
        let deq = dequantize(&q);
        panels_hold(&w, &l, rows, &deq)?;
    }

    /// The same for asymmetric INT4 g32 (`d · q + m`, rounded once to f32, then to BF16).
    #[test]
    fn asym_panel_is_the_dequantised_weights_in_bf16(rows in 1usize..50, kg in 1usize..9, seed in any::<u64>()) {
        let k = 32 * kg;
        let q = krasis_quant::int4_asym::quantize(&data(rows * k, seed), rows, k).unwrap();
        let (w, l) = (krasis_quant::int4_asym::pack(&q), krasis_quant::int4_asym::layout_of(&q));
        let deq = q.dequantize();
        panels_hold(&w, &l, rows, &deq)?;
    }

    /// FP4 (MXFP4, NVFP4): SIMD equals scalar bit for bit; MXFP4's panel is its exact values in
    /// BF16 (a small integer times a power of two), NVFP4's within one BF16 rounding of them (its
    /// scale times the row factor rounds to f32 first); padding rows are zero. Ragged rows, K of
    /// one group of 32 up to eight; every code and scale byte the test matrices draw.
    #[test]
    fn fp4_panel_is_the_dequantised_weights_in_bf16(rows in 1usize..50, kg in 1usize..9, nv in any::<bool>(),
                                                    seed in any::<u64>()) {
        use krasis_quant::fp4::{self, Fp4Kind};
        let kind = if nv { Fp4Kind::Nvfp4 } else { Fp4Kind::Mxfp4 };
        let k = 32 * kg;
        let m = fp4::test_matrix(kind, rows, k, seed);
        let (w, l) = (fp4::pack(&m), fp4::layout_of(&m));
        let exact = m.dequantize_f64();
        panels_hold_with(&w, &l, rows, |r, kk, got| {
            let e = exact[r * k + kk];
            if kind == Fp4Kind::Mxfp4 {
                prop_assert_eq!(got, bf16_bits(e as f32), "{:?} row {} k {}: exact {}", kind, r, kk, e);
            } else {
                let err = (bf16_value(got) as f64 - e).abs();
                prop_assert!(err <= e.abs() * 2f64.powi(-8), "{:?} row {} k {}: {} against {}", kind, r, kk,
                             bf16_value(got), e);
            }
            Ok(())
        })?;
    }

    #[test]
    fn simd_conversion_equals_scalar(n in 0usize..200, seed in any::<u64>(), scale_exp in -130i32..130) {
        let mut x: Vec<f32> = data(n, seed).iter().map(|v| v * 2f32.powi(scale_exp)).collect();
        if n > 3 {
            x[0] = f32::from_bits(0x0000_8001); // denormal
            x[1] = f32::NAN;
            x[2] = f32::NEG_INFINITY;
            x[3] = 1.0 + 1.0 / 256.0; // a tie
        }
        let (mut a, mut b) = (vec![0u16; n], vec![0u16; n]);
        to_bf16(&x, &mut a);
        to_bf16_scalar(&x, &mut b);
        prop_assert_eq!(a, b);
    }

    #[test]
    fn simd_runs_equal_scalar(runs in 0usize..6, run16 in any::<bool>(), gap in 0usize..40, seed in any::<u64>()) {
        let run = if run16 { 32 } else { 7 };
        let stride = run + gap;
        let mut x = data(runs * run, seed);
        if runs > 0 {
            x[0] = f32::from_bits(0x0000_8001);
            x[run - 1] = 1.0 + 1.0 / 256.0;
        }
        let len = if runs == 0 { 0 } else { (runs - 1) * stride + run };
        let (mut a, mut b) = (vec![7u16; len + 3], vec![7u16; len + 3]);
        to_bf16_runs(&x, run, &mut a, stride);
        to_bf16_runs_scalar(&x, run, &mut b, stride);
        prop_assert_eq!(&a, &b);
        for (r, chunk) in x.chunks_exact(run).enumerate() {
            for (i, &v) in chunk.iter().enumerate() {
                prop_assert_eq!(b[r * stride + i], bf16_bits(v));
            }
        }
        // Between runs and past the last one nothing is written.
        prop_assert!(b.iter().enumerate().all(|(j, &v)| (j < len && j % stride < run) || v == 7));
    }

    #[test]
    fn simd_pair_row_equals_scalar(seed in any::<u64>(), scale_exp in -130i32..130) {
        let mut x: Vec<f32> = data(32, seed).iter().map(|v| v * 2f32.powi(scale_exp)).collect();
        x[0] = f32::from_bits(0x0000_8001);
        x[17] = f32::NAN;
        x[5] = 1.0 + 1.0 / 256.0;
        let (mut a, mut b) = (vec![0u16; 32], vec![0u16; 32]);
        pair_row(&x[..16], &x[16..], &mut a);
        pair_row_scalar(&x[..16], &x[16..], &mut b);
        prop_assert_eq!(&a, &b);
        for n in 0..16 {
            prop_assert_eq!(b[2 * n], bf16_bits(x[n]));
            prop_assert_eq!(b[2 * n + 1], bf16_bits(x[16 + n]));
        }
    }
}
