//! Rotary position embedding applied with precomputed per-position cos/sin tables.

use krasis_core::spec::RopePairing;

/// Rotate the first `2·cos.len()` elements of one head vector `x` by the angles whose cos/sin
/// are given; the pairs lie within that part (halves: `(i, i + cos.len())`). A longer head
/// keeps the rest as it is (partial rotary: GLM-4.5's `partial_rotary_factor`).
pub fn rotate(x: &mut [f32], cos: &[f32], sin: &[f32], pairing: RopePairing) {
    let half = cos.len();
    assert!(x.len() >= 2 * half, "rope: a head of {} elements cannot hold {} rotated dims", x.len(), 2 * half);
    assert_eq!(sin.len(), half, "rope: cos and sin differ in length");
    let x = &mut x[..2 * half];
    match pairing {
        RopePairing::Interleaved => {
            for i in 0..half {
                let (a, b) = (x[2 * i], x[2 * i + 1]);
                x[2 * i] = a * cos[i] - b * sin[i];
                x[2 * i + 1] = b * cos[i] + a * sin[i];
            }
        }
        RopePairing::Halves => {
            for i in 0..half {
                let (a, b) = (x[i], x[i + half]);
                x[i] = a * cos[i] - b * sin[i];
                x[i + half] = b * cos[i] + a * sin[i];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotation_preserves_norm_and_pairings_agree_up_to_permutation() {
        let cos = [0.6f32, 0.0, 1.0];
        let sin = [0.8f32, 1.0, 0.0];
        let x = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
        let mut a = x;
        rotate(&mut a, &cos, &sin, RopePairing::Interleaved);
        let n0: f32 = x.iter().map(|v| v * v).sum();
        let n1: f32 = a.iter().map(|v| v * v).sum();
        assert!((n0 - n1).abs() < 1e-4);
        // Halves on the de-interleaved vector gives the de-interleaved result.
        let mut h = [x[0], x[2], x[4], x[1], x[3], x[5]];
        rotate(&mut h, &cos, &sin, RopePairing::Halves);
        let expect = [a[0], a[2], a[4], a[1], a[3], a[5]];
        for (p, q) in h.iter().zip(expect) {
            assert!((p - q).abs() < 1e-6);
        }
        assert!((a[0] - (1.0 * 0.6 - 2.0 * 0.8)).abs() < 1e-6);
    }

    /// Partial rotary over random shapes: the first `2·half` elements rotate exactly as a head of
    /// that width would (pairs `(i, i + half)` for halves, not `(i, i + head/2)`), the rest stay
    /// bit for bit.
    #[test]
    fn partial_rotation_rotates_the_prefix_and_keeps_the_tail() {
        use proptest::prelude::*;
        let cfg = ProptestConfig { cases: 200, ..ProptestConfig::default() };
        proptest!(cfg, |(half in 1usize..24, tail in 0usize..40, seed in any::<u64>(), inter in any::<bool>())| {
            let pairing = if inter { RopePairing::Interleaved } else { RopePairing::Halves };
            let mut s = seed | 1;
            let mut next = || {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
            };
            let x: Vec<f32> = (0..2 * half + tail).map(|_| next()).collect();
            let ang: Vec<f32> = (0..half).map(|_| next() * 3.0).collect();
            let (cos, sin): (Vec<f32>, Vec<f32>) = ang.iter().map(|a| (a.cos(), a.sin())).unzip();
            let mut got = x.clone();
            rotate(&mut got, &cos, &sin, pairing);
            // The scalar definition, written out for the prefix alone.
            let mut want = x.clone();
            for i in 0..half {
                let (ia, ib) = if inter { (2 * i, 2 * i + 1) } else { (i, i + half) };
                want[ia] = x[ia] * cos[i] - x[ib] * sin[i];
                want[ib] = x[ib] * cos[i] + x[ia] * sin[i];
            }
            prop_assert_eq!(&got[..], &want[..]);
            prop_assert_eq!(&got[2 * half..], &x[2 * half..]);
        });
    }

    #[test]
    #[should_panic(expected = "cannot hold")]
    fn a_head_shorter_than_the_rotated_dims_is_refused() {
        rotate(&mut [0.0; 4], &[1.0; 3], &[0.0; 3], RopePairing::Halves);
    }
}
