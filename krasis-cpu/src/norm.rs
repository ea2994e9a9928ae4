//! RMSNorm, and the residual add beside it.

/// Rows per task of the parallel forms (below this many rows they run on the caller: a pool
/// dispatch costs a few µs, one 2048-wide row well under one).
pub const PAR_ROWS: usize = 16;

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

/// [`rms_norm_rows`] over the pool ([`crate::par`]) in tasks of [`PAR_ROWS`] rows: the same
/// numbers (each row alone, as there). Call it from the thread that drives the pool, not from
/// inside a pool task.
pub fn rms_norm_rows_par(x: &mut [f32], weight: &[f32], eps: f32) {
    let dim = weight.len();
    if x.len() < 2 * PAR_ROWS * dim.max(1) {
        return rms_norm_rows(x, weight, eps);
    }
    crate::par::for_each_chunk_mut(x, PAR_ROWS * dim, &|_, rows| rms_norm_rows(rows, weight, eps));
}

/// `dst = src` then [`rms_norm_rows_par`] on it, the copy done inside the same tasks.
pub fn rms_norm_rows_into_par(src: &[f32], dst: &mut [f32], weight: &[f32], eps: f32) {
    assert_eq!(src.len(), dst.len(), "rms_norm_rows_into_par: lengths differ");
    let dim = weight.len();
    if dst.len() < 2 * PAR_ROWS * dim.max(1) {
        dst.copy_from_slice(src);
        return rms_norm_rows(dst, weight, eps);
    }
    let chunk = PAR_ROWS * dim;
    crate::par::for_each_chunk_mut(dst, chunk, &|i, rows| {
        rows.copy_from_slice(&src[i * chunk..i * chunk + rows.len()]);
        rms_norm_rows(rows, weight, eps);
    });
}

/// `x += y` elementwise over the pool for long vectors (as [`rms_norm_rows_par`]).
pub fn add_assign_par(x: &mut [f32], y: &[f32]) {
    assert_eq!(x.len(), y.len(), "add_assign_par: lengths differ");
    const CHUNK: usize = 64 << 10;
    if x.len() < 2 * CHUNK {
        x.iter_mut().zip(y).for_each(|(a, b)| *a += b);
        return;
    }
    crate::par::for_each_chunk_mut(x, CHUNK, &|i, xs| {
        xs.iter_mut().zip(&y[i * CHUNK..]).for_each(|(a, b)| *a += b);
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parallel_forms_equal_the_serial_ones() {
        let dim = 96;
        let x: Vec<f32> = (0..dim * 77).map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0).collect();
        let w: Vec<f32> = (0..dim).map(|i| 0.5 + i as f32 / dim as f32).collect();
        let (mut a, mut b) = (x.clone(), x.clone());
        rms_norm_rows(&mut a, &w, 1e-6);
        rms_norm_rows_par(&mut b, &w, 1e-6);
        assert_eq!(a, b);
        let mut c = vec![0f32; x.len()];
        rms_norm_rows_into_par(&x, &mut c, &w, 1e-6);
        assert_eq!(a, c);
        let y: Vec<f32> = (0..300_000).map(|i| (i % 13) as f32).collect();
        let (mut a, mut b) = (vec![1.5f32; y.len()], vec![1.5f32; y.len()]);
        a.iter_mut().zip(&y).for_each(|(p, q)| *p += q);
        add_assign_par(&mut b, &y);
        assert_eq!(a, b);
    }
}
