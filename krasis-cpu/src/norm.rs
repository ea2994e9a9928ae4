//! RMSNorm.

/// Normalise each `dim`-wide row of `x` in place: `x · w / sqrt(mean(x²) + eps)`.
pub fn rms_norm_rows(x: &mut [f32], weight: &[f32], eps: f32) {
    let dim = weight.len();
    assert_eq!(x.len() % dim, 0, "rms_norm: length {} not a multiple of {dim}", x.len());
    for row in x.chunks_exact_mut(dim) {
        let ss: f64 = row.iter().map(|&v| (v as f64) * (v as f64)).sum();
        let inv = (1.0 / ((ss / dim as f64) + eps as f64).sqrt()) as f32;
        for (v, &w) in row.iter_mut().zip(weight) {
            *v = *v * inv * w;
        }
    }
}
