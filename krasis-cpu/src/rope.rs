//! Rotary position embedding applied with precomputed per-position cos/sin tables.

use krasis_core::spec::RopePairing;

/// Rotate one head vector `x` (length `2·cos.len()`) by the angles whose cos/sin are given.
pub fn rotate(x: &mut [f32], cos: &[f32], sin: &[f32], pairing: RopePairing) {
    let half = cos.len();
    debug_assert_eq!(x.len(), 2 * half);
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
}
