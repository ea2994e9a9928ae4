//! Small f32 matrix products for blocked attention: `C[m, n] (+)= A[m, k] · B[k, n]`, all three
//! row-major with their own leading dimensions (so a head's rows inside an interleaved buffer are
//! operands as they lie). AVX-512 runs a register-blocked micro-kernel (6 rows × 64 columns of
//! accumulators, A broadcast, B loaded by rows, masked column tails); the scalar twin does the
//! same products in the same order per output element, with separate multiply and add (AVX2 hosts
//! compile the twin with AVX2 enabled, so it vectorises).
//!
//! Every output element is `c (+ a[i,0]·b[0,j]) + a[i,1]·b[1,j] + …` in `k` order whatever the
//! shapes around it, so one row's result does not depend on which rows share its call.

use crate::isa::Isa;

/// Rows of one micro-tile: 6 × 4 zmm accumulators, 4 B vectors and a broadcast take 29 of the
/// 32 zmm registers, and 6 broadcasts per 24 FMAs (8 per 16 with the former 8 × 32 tile) leave
/// the FMA pipe the bottleneck (measured on Zen 4: see docs/ARCHITECTURE.md, MLA prefill).
const MR: usize = 6;
/// zmm vectors of 16 floats per micro-tile row.
const NV: usize = 4;
/// Columns of one micro-tile: 64 = `BLOCK_K` of the attention, a quarter of a V2-Lite head's
/// expanded row and half its `v_dim`, so the attention's shapes have no column tails.
const NR: usize = 16 * NV;
/// `k` steps per pass over C: a 64 × 64 slab of B (16 KiB) stays in L1 (32 KiB on Zen 4) while
/// every row group reads it; C is stored and reloaded between slabs, in f32 as the registers hold
/// it, so the result does not change.
const KC: usize = 64;

/// `c[i·ldc + j] = (accumulate ? c[i·ldc + j] : 0) + Σ_p a[i·lda + p] · b[p·ldb + j]` for
/// `i < m`, `j < n`, `p < k`.
///
/// # Panics
/// When a leading dimension is smaller than its row or a slice is too short for the shape (the
/// callers are this crate's kernels, which size them).
#[allow(clippy::too_many_arguments)]
pub fn gemm(
    isa: Isa,
    (m, n, k): (usize, usize, usize),
    a: &[f32],
    lda: usize,
    b: &[f32],
    ldb: usize,
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(lda >= k && ldb >= n && ldc >= n, "gemm: leading dimensions {lda}/{ldb}/{ldc} for {m}×{n}×{k}");
    assert!(c.len() >= (m - 1) * ldc + n, "gemm: c holds {} floats for {m}×{n} at ldc {ldc}", c.len());
    if k > 0 {
        assert!(a.len() >= (m - 1) * lda + k, "gemm: a holds {} floats for {m}×{k} at lda {lda}", a.len());
        assert!(b.len() >= (k - 1) * ldb + n, "gemm: b holds {} floats for {k}×{n} at ldb {ldb}", b.len());
    }
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the active ISA is at most what the CPU has; the bounds are asserted above.
        Isa::Avx512 => unsafe {
            gemm_avx512((m, n, k), a.as_ptr(), lda, b.as_ptr(), ldb, c.as_mut_ptr(), ldc, accumulate)
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the active ISA is at most what the CPU has.
        Isa::Avx2 => unsafe { gemm_avx2((m, n, k), a, lda, b, ldb, c, ldc, accumulate) },
        _ => gemm_scalar((m, n, k), a, lda, b, ldb, c, ldc, accumulate),
    }
}

/// Scalar twin of [`gemm`] (same per-element order, multiply and add rounded separately).
#[allow(clippy::too_many_arguments)]
pub fn gemm_scalar(
    (m, n, k): (usize, usize, usize),
    a: &[f32],
    lda: usize,
    b: &[f32],
    ldb: usize,
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
) {
    for i in 0..m {
        let crow = &mut c[i * ldc..i * ldc + n];
        if !accumulate {
            crow.fill(0.0);
        }
        for p in 0..k {
            let av = a[i * lda + p];
            for (o, &bv) in crow.iter_mut().zip(&b[p * ldb..p * ldb + n]) {
                *o += av * bv;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_avx2(
    shape: (usize, usize, usize),
    a: &[f32],
    lda: usize,
    b: &[f32],
    ldb: usize,
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
) {
    gemm_scalar(shape, a, lda, b, ldb, c, ldc, accumulate)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_avx512(
    (m, n, k): (usize, usize, usize),
    a: *const f32,
    lda: usize,
    b: *const f32,
    ldb: usize,
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
) {
    // k slabs outer (at least one pass, so k = 0 still clears C when not accumulating).
    let mut p0 = 0;
    loop {
        let kc = (k - p0).min(KC);
        let acc = accumulate || p0 > 0;
        // Column panels outer: one panel of B (`kc × 64`) is reused by every row group while it
        // is in L1, where rows outer would alternate between panels.
        let mut j = 0;
        while j < n {
            let cols = (n - j).min(NR);
            let mut i = 0;
            while i < m {
                let rows = (m - i).min(MR);
                let (at, bt, ct) = (a.add(i * lda + p0), b.add(p0 * ldb + j), c.add(i * ldc + j));
                let args = (kc, at, lda, bt, ldb, ct, ldc, cols, acc);
                macro_rules! by_rows {
                    ($v:literal) => {
                        match rows {
                            6 => tile::<6, $v>(args),
                            5 => tile::<5, $v>(args),
                            4 => tile::<4, $v>(args),
                            3 => tile::<3, $v>(args),
                            2 => tile::<2, $v>(args),
                            _ => tile::<1, $v>(args),
                        }
                    };
                }
                match cols.div_ceil(16) {
                    4 => by_rows!(4),
                    3 => by_rows!(3),
                    2 => by_rows!(2),
                    _ => by_rows!(1),
                }
                i += MR;
            }
            j += NR;
        }
        p0 += kc;
        if p0 >= k {
            break;
        }
    }
}

/// One micro-tile's operands: k, A, lda, B, ldb, C, ldc, columns (≤ `16·V`), accumulate.
type TileArgs = (usize, *const f32, usize, *const f32, usize, *mut f32, usize, usize, bool);

/// `R` rows × up to `16·V` columns of C, every `k` step one row of B (`V` vectors, the last
/// masked) times `R` broadcast elements of A.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn tile<const R: usize, const V: usize>((k, a, lda, b, ldb, c, ldc, cols, accumulate): TileArgs) {
    use std::arch::x86_64::*;
    let mut mask = [0xffffu16; V];
    let tail = cols - 16 * (V - 1);
    if tail < 16 {
        mask[V - 1] = (1u16 << tail) - 1;
    }
    let mut acc = [[_mm512_setzero_ps(); V]; R];
    if accumulate {
        for (r, row) in acc.iter_mut().enumerate() {
            for (v, x) in row.iter_mut().enumerate() {
                *x = _mm512_maskz_loadu_ps(mask[v], c.add(r * ldc + 16 * v));
            }
        }
    }
    for p in 0..k {
        let mut bv = [_mm512_setzero_ps(); V];
        for (v, x) in bv.iter_mut().enumerate() {
            *x = _mm512_maskz_loadu_ps(mask[v], b.add(p * ldb + 16 * v));
        }
        for (r, row) in acc.iter_mut().enumerate() {
            let av = _mm512_set1_ps(*a.add(r * lda + p));
            for (x, &bb) in row.iter_mut().zip(&bv) {
                *x = _mm512_fmadd_ps(av, bb, *x);
            }
        }
    }
    for (r, row) in acc.iter().enumerate() {
        for (v, &x) in row.iter().enumerate() {
            _mm512_mask_storeu_ps(c.add(r * ldc + 16 * v), mask[v], x);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn data(n: usize, seed: u32) -> Vec<f32> {
        (0..n).map(|i| (((i as u32).wrapping_mul(2654435761) ^ seed) % 1000) as f32 / 500.0 - 1.0).collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

        /// Every ISA against an f64 product, ragged shapes, padded leading dimensions, both modes.
        #[test]
        fn gemm_matches_f64(m in 1usize..20, n in 1usize..140, k in 0usize..150, pad in 0usize..3,
                            accumulate in any::<bool>(), seed in any::<u32>()) {
            let (lda, ldb, ldc) = (k + pad, n + 2 * pad, n + pad);
            let a = data(m * lda, seed);
            let b = data(k.max(1) * ldb, seed ^ 5);
            let c0 = data(m * ldc, seed ^ 9);
            for isa in Isa::available() {
                let mut c = c0.clone();
                gemm(isa, (m, n, k), &a, lda, &b, ldb, &mut c, ldc, accumulate);
                for i in 0..m {
                    for j in 0..ldc {
                        let got = c[i * ldc + j];
                        if j >= n {
                            prop_assert_eq!(got.to_bits(), c0[i * ldc + j].to_bits(), "padding written");
                            continue;
                        }
                        let mut want = if accumulate { c0[i * ldc + j] as f64 } else { 0.0 };
                        for p in 0..k {
                            want += a[i * lda + p] as f64 * b[p * ldb + j] as f64;
                        }
                        prop_assert!((got as f64 - want).abs() < 1e-4, "{:?} ({},{}): {} vs {}", isa, i, j, got, want);
                    }
                }
            }
        }
    }
}
