//! `exp` for softmax: an AVX-512 polynomial (16 lanes) and its scalar twin, and the online-softmax
//! step of one score row built on them (scale, causal mask, running max, `exp`, sum in one call).
//!
//! Both compute `2^n · P(r)` with `n = round(x · log2 e)`, `r = x − n · ln 2` (ln 2 split in a
//! high part exact for every `n` in range and a low part), `P` the degree-7 Taylor polynomial of
//! `e^r` on `|r| ≤ ln 2 / 2` (truncation below 0.05 ulp), Horner with fused multiply-adds
//! (AVX-512) or separate multiply and add (scalar: no FMA instruction assumed). Within 2 ulp of
//! `exp` for every input whose result is a normal float, below that within two subnormal steps,
//! 0 for inputs under [`EXP_MIN`] and −∞, NaN for NaN (tests).

use crate::isa::Isa;

/// Inputs below this give 0: `e^-104` is under half the smallest subnormal float (`2^-149`),
/// and the clamp keeps `x · log2 e` finite (−∞ would make `r` NaN).
pub const EXP_MIN: f32 = -104.0;
const LOG2E: f32 = std::f32::consts::LOG2_E;
/// `ln 2` high part: 9 significant bits, so `n · LN2_HI` is exact for `|n| < 2^15`.
const LN2_HI: f32 = 0.693_359_4;
/// `ln 2 − LN2_HI`.
const LN2_LO: f32 = -2.121_944_4e-4;
/// `1/k!` for k = 7 down to 0 (Horner order).
const TAYLOR: [f32; 8] = [1.0 / 5040.0, 1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0];

/// `2^n` for `-126 ≤ n ≤ 127` (a normal float built from its exponent bits).
fn pow2i(n: i32) -> f32 {
    f32::from_bits(((n + 127) as u32) << 23)
}

/// Scalar twin of the AVX-512 `exp` (same reduction and polynomial; see the module docs).
pub fn exp_scalar(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    let x = x.max(EXP_MIN);
    let n = (x * LOG2E).round();
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let mut p = TAYLOR[0];
    for &c in &TAYLOR[1..] {
        p = p * r + c;
    }
    let n = n as i32;
    if n > 127 {
        // Two steps as well: `2^n` itself is not a float; the product may still be finite.
        p * pow2i(127) * pow2i((n - 127).min(127))
    } else if n < -126 {
        // Two steps so the intermediate stays normal; the last multiply rounds into subnormals.
        p * pow2i(n + 126) * pow2i(-126)
    } else {
        p * pow2i(n)
    }
}

/// `exp` of 16 lanes (see the module docs); `vscalefps` applies `2^n`, subnormal results included.
///
/// # Safety
/// The CPU has AVX-512 F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
pub unsafe fn exp_avx512(x: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    // max(EXP_MIN, x): `vmaxps` returns its second operand when one is NaN, so NaN stays NaN.
    let x = _mm512_max_ps(_mm512_set1_ps(EXP_MIN), x);
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(
        x,
        _mm512_set1_ps(LOG2E),
    ));
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
    let mut p = _mm512_set1_ps(TAYLOR[0]);
    for &c in &TAYLOR[1..] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    }
    _mm512_scalef_ps(p, n)
}

/// One online-softmax step of a score row: `x_j ← scale · x_j` for `j < valid` and −∞ past it,
/// `m = max(m_old, max_j x_j)`, `x_j ← e^(x_j − m)`. Returns `(m, Σ_j x_j)`. With `valid = 0`
/// and `m_old = −∞` every `x_j` is NaN (the caller never asks: each row sees a key).
pub fn softmax_step(isa: Isa, row: &mut [f32], valid: usize, scale: f32, m_old: f32) -> (f32, f32) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the active ISA is at most what the CPU has.
        Isa::Avx512 => unsafe { softmax_step_avx512(row, valid, scale, m_old) },
        _ => softmax_step_scalar(row, valid, scale, m_old),
    }
}

/// Scalar twin of [`softmax_step`] (sum in row order).
pub fn softmax_step_scalar(row: &mut [f32], valid: usize, scale: f32, m_old: f32) -> (f32, f32) {
    let mut m = m_old;
    for (j, x) in row.iter_mut().enumerate() {
        *x = if j < valid { *x * scale } else { f32::NEG_INFINITY };
        m = m.max(*x);
    }
    let mut sum = 0.0;
    for x in row.iter_mut() {
        *x = exp_scalar(*x - m);
        sum += *x;
    }
    (m, sum)
}

/// [`softmax_step`] 16 lanes at a time (masked tail; the sum is per lane, then reduced).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn softmax_step_avx512(row: &mut [f32], valid: usize, scale: f32, m_old: f32) -> (f32, f32) {
    use std::arch::x86_64::*;
    let len = row.len();
    let p = row.as_mut_ptr();
    let lanes = crate::isa::lane_mask16;
    let (sv, ninf) = (_mm512_set1_ps(scale), _mm512_set1_ps(f32::NEG_INFINITY));
    let mut mx = ninf;
    let mut j = 0;
    while j < len {
        let (inside, keep) = (lanes(j, len), lanes(j, valid));
        let x = _mm512_mask_mul_ps(ninf, keep, _mm512_maskz_loadu_ps(keep, p.add(j)), sv);
        _mm512_mask_storeu_ps(p.add(j), inside, x);
        mx = _mm512_max_ps(mx, x);
        j += 16;
    }
    let m = _mm512_reduce_max_ps(mx).max(m_old);
    let mv = _mm512_set1_ps(m);
    let mut sum = _mm512_setzero_ps();
    let mut j = 0;
    while j < len {
        let inside = lanes(j, len);
        let e = exp_avx512(_mm512_sub_ps(_mm512_maskz_loadu_ps(inside, p.add(j)), mv));
        _mm512_mask_storeu_ps(p.add(j), inside, e);
        sum = _mm512_mask_add_ps(sum, inside, sum, e);
        j += 16;
    }
    (m, _mm512_reduce_add_ps(sum))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Distance in units in the last place between `got` and the f64 `exp` rounded to f32.
    fn ulps(got: f32, x: f32) -> u32 {
        let want = (x as f64).exp() as f32;
        (got.to_bits() as i64 - want.to_bits() as i64).unsigned_abs() as u32
    }

    /// `exp` of one input on every ISA of this host (16 equal lanes on AVX-512).
    fn exps(x: f32) -> Vec<(Isa, f32)> {
        Isa::available()
            .into_iter()
            .map(|isa| {
                let v = match isa {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: `available` lists only what the CPU has.
                    Isa::Avx512 => unsafe {
                        use std::arch::x86_64::*;
                        let mut out = [0f32; 16];
                        _mm512_storeu_ps(out.as_mut_ptr(), exp_avx512(_mm512_set1_ps(x)));
                        assert!(out.iter().all(|o| o.to_bits() == out[0].to_bits()));
                        out[0]
                    },
                    _ => exp_scalar(x),
                };
                (isa, v)
            })
            .collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 20000, ..ProptestConfig::default() })]

        /// Softmax inputs (`s − max ≤ 0`) whose `exp` is a normal float, and the positive side.
        #[test]
        fn within_two_ulp(x in -87.33f32..88.7) {
            for (isa, got) in exps(x) {
                prop_assert!(ulps(got, x) <= 2, "{:?} exp({}) = {} vs {}", isa, x, got, (x as f64).exp());
            }
        }

        /// Subnormal results: within two steps of 2^-149.
        #[test]
        fn subnormal_results(x in -104f32..-87.33) {
            for (isa, got) in exps(x) {
                let err = (got as f64 - (x as f64).exp()).abs();
                prop_assert!(err <= 2.0 * 2f64.powi(-149), "{:?} exp({}) = {}", isa, x, got);
            }
        }
    }

    #[test]
    fn edges() {
        for (x, want) in [(0.0, 1.0), (-0.0, 1.0), (f32::NEG_INFINITY, 0.0), (-105.0, 0.0), (-1e30, 0.0)] {
            for (isa, got) in exps(x) {
                assert_eq!(got, want, "{isa:?} exp({x})");
            }
        }
        for (isa, got) in exps(f32::NAN) {
            assert!(got.is_nan(), "{isa:?}");
        }
        for (isa, got) in exps(89.0) {
            assert_eq!(got, f32::INFINITY, "{isa:?}");
        }
        // Every exponent step on the softmax side, exactly at the reduction's ties.
        for k in -125..=0 {
            let x = k as f32 * std::f32::consts::LN_2;
            for (isa, got) in exps(x) {
                assert!(ulps(got, x) <= 2, "{isa:?} exp({x})");
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

        /// The row step on every ISA against f64: scale, mask, running max, `exp`, sum.
        #[test]
        fn softmax_step_matches_f64(len in 1usize..80, valid in 1usize..80, scale in 0.01f32..2.0,
                                    m_old in prop::option::of(-20f32..20.0), seed in any::<u64>()) {
            let valid = valid.min(len);
            let m_old = m_old.unwrap_or(f32::NEG_INFINITY);
            let row0: Vec<f32> =
                (0..len).map(|j| (((j as u64 * 2654435761) ^ seed) % 4001) as f32 / 100.0 - 20.0).collect();
            let m_want = row0[..valid].iter().map(|x| x * scale).fold(m_old, f32::max);
            let e: Vec<f64> =
                (0..len).map(|j| if j < valid { ((row0[j] * scale - m_want) as f64).exp() } else { 0.0 }).collect();
            let s_want: f64 = e.iter().sum();
            for isa in Isa::available() {
                let mut row = row0.clone();
                let (m, s) = softmax_step(isa, &mut row, valid, scale, m_old);
                prop_assert_eq!(m, m_want);
                prop_assert!(((s as f64 - s_want) / s_want).abs() < 1e-5, "{:?} sum {} vs {}", isa, s, s_want);
                for j in 0..len {
                    prop_assert!((row[j] as f64 - e[j]).abs() <= 1e-6 * e[j].max(1e-30) + 1e-37, "{:?} {}", isa, j);
                }
            }
        }
    }
}
