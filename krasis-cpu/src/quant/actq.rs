//! The activation group quantiser ([`quantize_group`]) and its value + residual form
//! ([`quantize_group_split`]), compiled three times from one body: baseline (SSE2, the scalar
//! twin), AVX2 and AVX-512, picked once per process by what the CPU has. Every step is exact or
//! a single IEEE operation (max over bit patterns, one multiply, clamp, the round-by-addition of
//! [`super::round_clamp_127`], an integer sum; Rust never contracts `a·b + c` into an fma), so the
//! three give the same bits; wider vectors only cut the time (one core quantised a 2048-wide
//! token, value + residual, in ≈ 4.5 µs with the SSE2 build, the start of every expert dispatch).

use super::round_clamp_127;

/// Quantise one group `xg` into `qg` (same length); returns (scale, Σq). An all-zero group gets
/// scale 0; a non-finite one scale NaN, so the outputs say so rather than hide it.
#[inline(always)]
fn group_body(xg: &[f32], qg: &mut [i8]) -> (f32, i32) {
    // |x| ordered by its bit pattern (non-negative floats order like their bits): vectorises.
    let amax = f32::from_bits(xg.iter().fold(0u32, |a, v| a.max(v.to_bits() & 0x7fff_ffff)));
    if amax == 0.0 || !amax.is_finite() {
        qg.fill(0);
        return (if amax == 0.0 { 0.0 } else { f32::NAN }, 0);
    }
    let inv = 127.0 / amax;
    let mut sum = 0i32;
    for (o, &v) in qg.iter_mut().zip(xg) {
        let r = round_clamp_127(v * inv);
        *o = r as i8;
        sum += r;
    }
    (amax / 127.0, sum)
}

/// `xg` into `hi` (value) and `lo` (its residual `x − q·s`, quantised), with `resid` (the
/// group's length) as scratch; returns (scale, Σq) of each.
#[inline(always)]
fn split_body(xg: &[f32], hi: &mut [i8], lo: &mut [i8], resid: &mut [f32]) -> [(f32, i32); 2] {
    let (s, sum) = group_body(xg, hi);
    for ((r, &v), &q) in resid.iter_mut().zip(xg).zip(hi.iter()) {
        *r = v - q as f32 * s;
    }
    [(s, sum), group_body(resid, lo)]
}

/// Which build of the quantiser runs (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Build {
    Baseline,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

fn best() -> Build {
    static B: std::sync::OnceLock<Build> = std::sync::OnceLock::new();
    *B.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") {
                return Build::Avx512;
            }
            if is_x86_feature_detected!("avx2") {
                return Build::Avx2;
            }
        }
        Build::Baseline
    })
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn group_avx2(xg: &[f32], qg: &mut [i8]) -> (f32, i32) {
    group_body(xg, qg)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn group_avx512(xg: &[f32], qg: &mut [i8]) -> (f32, i32) {
    group_body(xg, qg)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn split_avx2(xg: &[f32], hi: &mut [i8], lo: &mut [i8], resid: &mut [f32]) -> [(f32, i32); 2] {
    split_body(xg, hi, lo, resid)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn split_avx512(xg: &[f32], hi: &mut [i8], lo: &mut [i8], resid: &mut [f32]) -> [(f32, i32); 2] {
    split_body(xg, hi, lo, resid)
}

fn group_with(b: Build, xg: &[f32], qg: &mut [i8]) -> (f32, i32) {
    match b {
        Build::Baseline => group_body(xg, qg),
        // SAFETY: `best` (or the test that asks) checked that the CPU has the features.
        #[cfg(target_arch = "x86_64")]
        Build::Avx2 => unsafe { group_avx2(xg, qg) },
        #[cfg(target_arch = "x86_64")]
        Build::Avx512 => unsafe { group_avx512(xg, qg) },
    }
}

fn split_with(b: Build, xg: &[f32], hi: &mut [i8], lo: &mut [i8], resid: &mut [f32]) -> [(f32, i32); 2] {
    match b {
        Build::Baseline => split_body(xg, hi, lo, resid),
        // SAFETY: as in `group_with`.
        #[cfg(target_arch = "x86_64")]
        Build::Avx2 => unsafe { split_avx2(xg, hi, lo, resid) },
        #[cfg(target_arch = "x86_64")]
        Build::Avx512 => unsafe { split_avx512(xg, hi, lo, resid) },
    }
}

/// Quantise one group `xg` into `qg` (same length); returns (scale, Σq). An all-zero group gets
/// scale 0; a non-finite one scale NaN, so the outputs say so rather than hide it.
pub(crate) fn quantize_group(xg: &[f32], qg: &mut [i8]) -> (f32, i32) {
    assert_eq!(xg.len(), qg.len(), "quantize_group: {} values into {} bytes", xg.len(), qg.len());
    group_with(best(), xg, qg)
}

/// One group as value + residual rows (see `moe::quantize_acts_split`): `xg` into `hi` and
/// `lo`, with `resid` (the group's length) as scratch; returns (scale, Σq) of each.
pub(crate) fn quantize_group_split(xg: &[f32], hi: &mut [i8], lo: &mut [i8], resid: &mut [f32]) -> [(f32, i32); 2] {
    let n = xg.len();
    assert!(
        hi.len() == n && lo.len() == n && resid.len() == n,
        "quantize_group_split: lengths {n}, {}, {}, {} differ",
        hi.len(),
        lo.len(),
        resid.len()
    );
    split_with(best(), xg, hi, lo, resid)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The builds this CPU runs, the baseline (the scalar twin) first.
    fn builds() -> Vec<Build> {
        let mut v = vec![Build::Baseline];
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2") {
                v.push(Build::Avx2);
            }
            if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") {
                v.push(Build::Avx512);
            }
        }
        v
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

        /// Every build equals the baseline bit for bit, on groups of ragged lengths (vector
        /// tails) with exact halves (rounding ties), zeros, huge and tiny values, and now and
        /// then an infinity or NaN.
        #[test]
        fn every_build_matches_the_baseline(
            vals in prop::collection::vec(
                prop_oneof![
                    4 => -3.0f32..3.0,
                    1 => (-254i32..=254).prop_map(|h| h as f32 * 0.5),
                    1 => Just(0.0f32),
                    1 => prop_oneof![Just(1e30f32), Just(-1e-30f32), Just(f32::MIN_POSITIVE)],
                ],
                1..300,
            ),
            special in prop::option::weighted(0.1, (0usize..300, prop_oneof![Just(f32::INFINITY), Just(f32::NAN)])),
        ) {
            let mut x = vals;
            if let Some((at, v)) = special {
                let n = x.len();
                x[at % n] = v;
            }
            let n = x.len();
            let (mut q0, mut h0, mut l0, mut r0) = (vec![0i8; n], vec![0i8; n], vec![0i8; n], vec![0f32; n]);
            let g0 = group_with(Build::Baseline, &x, &mut q0);
            let s0 = split_with(Build::Baseline, &x, &mut h0, &mut l0, &mut r0);
            for b in builds() {
                let (mut q, mut h, mut l, mut r) = (vec![7i8; n], vec![7i8; n], vec![7i8; n], vec![f32::NAN; n]);
                let g = group_with(b, &x, &mut q);
                prop_assert!(g.0.to_bits() == g0.0.to_bits() && g.1 == g0.1, "{b:?}: {g:?} vs {g0:?}");
                prop_assert_eq!(&q, &q0);
                let s = split_with(b, &x, &mut h, &mut l, &mut r);
                for (a, c) in s.iter().zip(&s0) {
                    prop_assert!(a.0.to_bits() == c.0.to_bits() && a.1 == c.1, "{b:?}: {s:?} vs {s0:?}");
                }
                prop_assert_eq!(&h, &h0);
                prop_assert_eq!(&l, &l0);
            }
        }
    }

    /// The baseline against plain rounding: q = round_half_even(x · 127 / amax), Σq, scale.
    #[test]
    fn baseline_is_plain_rounding() {
        let x: Vec<f32> = (0..200).map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0).collect();
        let mut q = vec![0i8; x.len()];
        let (s, sum) = group_with(Build::Baseline, &x, &mut q);
        let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
        assert_eq!(s, amax / 127.0);
        let want: Vec<i8> = x.iter().map(|v| (v * (127.0 / amax)).round_ties_even() as i8).collect();
        assert_eq!(q, want);
        assert_eq!(sum, want.iter().map(|&v| v as i32).sum::<i32>());
    }
}
