//! Dense linear `y = x · Wᵀ` with f32 activations and f32/bf16/f16 weights (the reference path:
//! weights are used exactly as stored, converted to f32 a block of rows at a time).

use half::f16;

use crate::isa::{self, Isa};

/// Weight rows `[n, k]`, row-major, in their stored type.
#[derive(Clone, Copy, Debug)]
pub enum WeightRows<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
    F16(&'a [u16]),
}

impl WeightRows<'_> {
    pub fn len(&self) -> usize {
        match self {
            WeightRows::F32(s) => s.len(),
            WeightRows::Bf16(s) | WeightRows::F16(s) => s.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Row `r` (of width `k`) as f32 into `out`.
    pub fn row_into(&self, r: usize, k: usize, out: &mut [f32]) {
        match self {
            WeightRows::F32(s) => out.copy_from_slice(&s[r * k..(r + 1) * k]),
            WeightRows::Bf16(s) => {
                for (o, &b) in out.iter_mut().zip(&s[r * k..(r + 1) * k]) {
                    *o = f32::from_bits((b as u32) << 16);
                }
            }
            WeightRows::F16(s) => {
                for (o, &b) in out.iter_mut().zip(&s[r * k..(r + 1) * k]) {
                    *o = f16::from_bits(b).to_f32();
                }
            }
        }
    }
}

/// Weight rows converted per task: 8 rows × K floats stays in L2 while every x row passes by.
const ROWS_PER_TASK: usize = 8;

struct OutPtr(*mut f32);
// SAFETY: tasks write disjoint columns of `y`; see `linear`.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// # Safety
    /// `at` must be in bounds and no other thread may write it.
    unsafe fn write(&self, at: usize, v: f32) {
        *self.0.add(at) = v;
    }
}

/// `y[m, n] = x[m, k] · w[n, k]ᵀ`, parallel over blocks of weight rows.
pub fn linear(x: &[f32], m: usize, k: usize, w: WeightRows<'_>, n: usize, y: &mut [f32]) {
    assert_eq!(x.len(), m * k, "linear: x is {} floats, expected {m}×{k}", x.len());
    assert_eq!(w.len(), n * k, "linear: w is {} elements, expected {n}×{k}", w.len());
    assert_eq!(y.len(), m * n, "linear: y is {} floats, expected {m}×{n}", y.len());
    let isa = isa::active();
    let out = OutPtr(y.as_mut_ptr());
    // A narrow matrix (a router: 64 rows = 8 blocks) over many tokens also splits the tokens, so
    // every thread gets work; for one token its row blocks shrink to one per thread (a router in
    // decode: 8 tasks of 8 rows left half of 16 workers idle). Each output is the same dot either
    // way.
    let threads = crate::par::threads();
    let rows_per_task = if m == 1 { ROWS_PER_TASK.min(n.div_ceil(threads)).max(1) } else { ROWS_PER_TASK };
    let blocks = n.div_ceil(rows_per_task);
    let parts = if blocks < threads && m > 1 { (2 * threads).div_ceil(blocks).min(m) } else { 1 };
    let per = m.div_ceil(parts);
    crate::par::for_each(blocks * parts, &|t| {
        let (t, part) = (t / parts, t % parts);
        ROW_BUF.with_borrow_mut(|buf| {
            if buf.len() < ROWS_PER_TASK * k {
                buf.resize(ROWS_PER_TASK * k, 0.0);
            }
            let r0 = t * rows_per_task;
            let r1 = (r0 + rows_per_task).min(n);
            for r in r0..r1 {
                w.row_into(r, k, &mut buf[(r - r0) * k..(r - r0 + 1) * k]);
            }
            let rows = &buf[..(r1 - r0) * k];
            let (i0, i1) = ((part * per).min(m), ((part + 1) * per).min(m));
            dots_into(isa, &x[i0 * k..i1 * k], rows, k, |i, r, d| {
                // SAFETY: (i0 + i, r0 + r) is in bounds (asserted above) and belongs to this task
                // alone (its column block and token part).
                unsafe { out.write((i0 + i) * n + r0 + r, d) };
            });
        })
    });
}

thread_local! {
    /// Per-thread buffer of converted weight rows (grows once to `ROWS_PER_TASK × K`).
    static ROW_BUF: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Scalar twin of [`linear`]: the definition, one output at a time.
pub fn linear_scalar(x: &[f32], m: usize, k: usize, w: WeightRows<'_>, n: usize, y: &mut [f32]) {
    let mut row = vec![0f32; k];
    for r in 0..n {
        w.row_into(r, k, &mut row);
        for i in 0..m {
            y[i * n + r] = dot_scalar(&x[i * k..(i + 1) * k], &row);
        }
    }
}

/// Tokens and weight rows per block of [`dots_into`]'s AVX-512 kernel: 2 × 4 dots of two
/// accumulators each fill 16 of the 32 registers, and each k step's 12 loads feed 16 FMAs, where
/// one dot at a time waits on its two accumulators' FMA latency (~8 of 32 FLOP per cycle).
const DOT_BLOCK_TOKENS: usize = 2;
const DOT_BLOCK_ROWS: usize = 4;

/// `put(i, r, dot(x_i, w_r))` for every row `i` of `x` and `w` (rows of `k` floats), each value
/// bit for bit what [`dot`] gives: on AVX-512 in blocks of [`DOT_BLOCK_TOKENS`] ×
/// [`DOT_BLOCK_ROWS`] dots that run [`dot`]'s own sequence of operations side by side.
pub(crate) fn dots_into(isa: Isa, x: &[f32], w: &[f32], k: usize, mut put: impl FnMut(usize, usize, f32)) {
    let (m, n) = (x.len() / k.max(1), w.len() / k.max(1));
    let row = |s: &[f32], i: usize| s[i * k..(i + 1) * k].as_ptr();
    let (mut mb, mut nb) = (0, 0);
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 && k > 0 {
        (mb, nb) = (m - m % DOT_BLOCK_TOKENS, n - n % DOT_BLOCK_ROWS);
        for i in (0..mb).step_by(DOT_BLOCK_TOKENS) {
            for r in (0..nb).step_by(DOT_BLOCK_ROWS) {
                let xs = std::array::from_fn(|t| row(x, i + t));
                let ws = std::array::from_fn(|j| row(w, r + j));
                // SAFETY: AVX-512 is the active ISA (at most what the CPU has); every pointer
                // starts a row of k floats inside x or w.
                let d = unsafe { dots_avx512::<DOT_BLOCK_TOKENS, DOT_BLOCK_ROWS>(xs, ws, k) };
                for (t, dt) in d.iter().enumerate() {
                    for (j, &v) in dt.iter().enumerate() {
                        put(i + t, r + j, v);
                    }
                }
            }
        }
    }
    // What the blocks leave: the last tokens against every row, the last rows against the
    // blocked tokens.
    for i in 0..m {
        let from = if i < mb { nb } else { 0 };
        for r in from..n {
            put(i, r, dot(isa, &x[i * k..(i + 1) * k], &w[r * k..(r + 1) * k]));
        }
    }
}

/// `T × R` dots of rows of `k` floats at once: per dot [`dot_avx512`]'s two accumulators over
/// the same k steps, masked tail and reduction, so each result has its bits.
///
/// # Safety
/// The CPU has AVX-512 F; every pointer is valid for `k` floats.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn dots_avx512<const T: usize, const R: usize>(
    xs: [*const f32; T],
    ws: [*const f32; R],
    k: usize,
) -> [[f32; R]; T] {
    use std::arch::x86_64::*;
    let mut acc0 = [[_mm512_setzero_ps(); R]; T];
    let mut acc1 = [[_mm512_setzero_ps(); R]; T];
    let mut i = 0;
    while i + 32 <= k {
        for j in 0..R {
            let (w0, w1) = (_mm512_loadu_ps(ws[j].add(i)), _mm512_loadu_ps(ws[j].add(i + 16)));
            for t in 0..T {
                acc0[t][j] = _mm512_fmadd_ps(_mm512_loadu_ps(xs[t].add(i)), w0, acc0[t][j]);
                acc1[t][j] = _mm512_fmadd_ps(_mm512_loadu_ps(xs[t].add(i + 16)), w1, acc1[t][j]);
            }
        }
        i += 32;
    }
    if i < k {
        let rem = k - i;
        let m0: __mmask16 = if rem >= 16 { 0xffff } else { ((1u32 << rem) - 1) as u16 };
        let m1: __mmask16 = if rem > 16 { ((1u32 << (rem - 16)) - 1) as u16 } else { 0 };
        for j in 0..R {
            for t in 0..T {
                acc0[t][j] = _mm512_fmadd_ps(
                    _mm512_maskz_loadu_ps(m0, xs[t].add(i)),
                    _mm512_maskz_loadu_ps(m0, ws[j].add(i)),
                    acc0[t][j],
                );
                if rem > 16 {
                    acc1[t][j] = _mm512_fmadd_ps(
                        _mm512_maskz_loadu_ps(m1, xs[t].add(i + 16)),
                        _mm512_maskz_loadu_ps(m1, ws[j].add(i + 16)),
                        acc1[t][j],
                    );
                }
            }
        }
    }
    std::array::from_fn(|t| std::array::from_fn(|j| _mm512_reduce_add_ps(_mm512_add_ps(acc0[t][j], acc1[t][j]))))
}

/// Dot product on the given ISA.
#[inline]
pub fn dot(isa: Isa, a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { dot_avx512(a, b) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { dot_avx2(a, b) },
        _ => dot_scalar(a, b),
    }
}

/// `y += a · x` on the given ISA.
#[inline]
pub fn axpy(isa: Isa, a: f32, x: &[f32], y: &mut [f32]) {
    debug_assert_eq!(x.len(), y.len());
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { axpy_avx512(a, x, y) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { axpy_avx2(a, x, y) },
        _ => axpy_scalar(a, x, y),
    }
}

/// Scalar twin of [`axpy`] (one fused multiply-add per element, as the SIMD versions do).
pub fn axpy_scalar(a: f32, x: &[f32], y: &mut [f32]) {
    for (o, &v) in y.iter_mut().zip(x) {
        *o = a.mul_add(v, *o);
    }
}

/// A projection's bias after its product: `y[r, j] += bias[j]` for every row `r` of
/// `y [rows, bias.len()]` (one f32 add per element).
pub fn add_bias_rows(y: &mut [f32], bias: &[f32]) {
    assert!(
        !bias.is_empty() && y.len().is_multiple_of(bias.len()),
        "add_bias_rows: {} outputs are not whole rows of the {}-element bias",
        y.len(),
        bias.len()
    );
    for row in y.chunks_exact_mut(bias.len()) {
        for (o, &b) in row.iter_mut().zip(bias) {
            *o += b;
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn axpy_avx2(a: f32, x: &[f32], y: &mut [f32]) {
    use std::arch::x86_64::*;
    let n = x.len().min(y.len());
    let (px, py) = (x.as_ptr(), y.as_mut_ptr());
    let va = _mm256_set1_ps(a);
    let mut i = 0;
    while i + 8 <= n {
        _mm256_storeu_ps(py.add(i), _mm256_fmadd_ps(va, _mm256_loadu_ps(px.add(i)), _mm256_loadu_ps(py.add(i))));
        i += 8;
    }
    while i < n {
        *py.add(i) = a.mul_add(*px.add(i), *py.add(i));
        i += 1;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn axpy_avx512(a: f32, x: &[f32], y: &mut [f32]) {
    use std::arch::x86_64::*;
    let n = x.len().min(y.len());
    let (px, py) = (x.as_ptr(), y.as_mut_ptr());
    let va = _mm512_set1_ps(a);
    let mut i = 0;
    while i + 16 <= n {
        _mm512_storeu_ps(py.add(i), _mm512_fmadd_ps(va, _mm512_loadu_ps(px.add(i)), _mm512_loadu_ps(py.add(i))));
        i += 16;
    }
    while i < n {
        *py.add(i) = a.mul_add(*px.add(i), *py.add(i));
        i += 1;
    }
}

/// Scalar dot with eight interleaved partial sums (so the rounding resembles the SIMD ones).
pub fn dot_scalar(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        for l in 0..8 {
            acc[l] += a[c * 8 + l] * b[c * 8 + l];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for i in chunks * 8..a.len() {
        s += a[i] * b[i];
    }
    s
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let n = a.len().min(b.len());
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    while i + 32 <= n {
        for (j, a_j) in acc.iter_mut().enumerate() {
            let off = i + 8 * j;
            *a_j = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(off)), _mm256_loadu_ps(pb.add(off)), *a_j);
        }
        i += 32;
    }
    while i + 8 <= n {
        acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), acc[0]);
        i += 8;
    }
    let s = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    let mut lanes = [0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), s);
    let mut total: f32 = lanes.iter().sum();
    while i < n {
        total += *pa.add(i) * *pb.add(i);
        i += 1;
    }
    total
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn dot_avx512(a: &[f32], b: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let n = a.len().min(b.len());
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let mut acc0 = _mm512_setzero_ps();
    let mut acc1 = _mm512_setzero_ps();
    let mut i = 0;
    while i + 32 <= n {
        acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(pa.add(i)), _mm512_loadu_ps(pb.add(i)), acc0);
        acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(pa.add(i + 16)), _mm512_loadu_ps(pb.add(i + 16)), acc1);
        i += 32;
    }
    if i < n {
        // Masked tail: up to two partial 16-lane loads.
        let rem = n - i;
        let m0: __mmask16 = if rem >= 16 { 0xffff } else { ((1u32 << rem) - 1) as u16 };
        acc0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m0, pa.add(i)), _mm512_maskz_loadu_ps(m0, pb.add(i)), acc0);
        if rem > 16 {
            let m1: __mmask16 = ((1u32 << (rem - 16)) - 1) as u16;
            acc1 = _mm512_fmadd_ps(
                _mm512_maskz_loadu_ps(m1, pa.add(i + 16)),
                _mm512_maskz_loadu_ps(m1, pb.add(i + 16)),
                acc1,
            );
        }
    }
    _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn data(n: usize, seed: u64) -> Vec<f32> {
        krasis_quant::group::test_data(n, seed, 1.0)
    }

    fn close(a: f32, b: f32, scale: f32) -> bool {
        (a - b).abs() <= 1e-5 * scale.max(1.0)
    }

    proptest! {
        #[test]
        fn dot_every_isa_matches_scalar(n in 0usize..300, seed in any::<u64>()) {
            let a = data(n, seed);
            let b = data(n, seed ^ 0x9e37);
            let want = dot_scalar(&a, &b);
            let mag: f32 = a.iter().zip(&b).map(|(x, y)| (x * y).abs()).sum();
            for isa in Isa::available() {
                let got = dot(isa, &a, &b);
                prop_assert!(close(got, want, mag), "{isa:?} n={n}: {got} vs {want}");
            }
        }

        /// Every ISA's axpy is the scalar twin bit for bit (one fused multiply-add per element),
        /// on ragged lengths.
        #[test]
        fn axpy_every_isa_matches_scalar(n in 0usize..300, a in -2.0f32..2.0, seed in any::<u64>()) {
            let x = data(n, seed);
            let y0 = data(n, seed ^ 0x51);
            let mut want = y0.clone();
            axpy_scalar(a, &x, &mut want);
            for isa in Isa::available() {
                let mut got = y0.clone();
                axpy(isa, a, &x, &mut got);
                prop_assert_eq!(&got, &want, "{:?} n={}", isa, n);
            }
        }

        /// The blocked dots give [`dot`]'s bits on every ISA, over ragged token, row and K
        /// counts (masked tails, leftover tokens and rows).
        #[test]
        fn dots_into_equals_dot_bit_for_bit(m in 1usize..6, n in 1usize..11, k in 1usize..100, seed in any::<u64>()) {
            let x = data(m * k, seed);
            let w = data(n * k, seed ^ 7);
            for isa in Isa::available() {
                let mut got = vec![f32::NAN; m * n];
                dots_into(isa, &x, &w, k, |i, r, d| got[i * n + r] = d);
                for i in 0..m {
                    for r in 0..n {
                        let want = dot(isa, &x[i * k..(i + 1) * k], &w[r * k..(r + 1) * k]);
                        prop_assert_eq!(got[i * n + r].to_bits(), want.to_bits(), "{:?} ({}, {}) k {}", isa, i, r, k);
                    }
                }
            }
        }

        #[test]
        fn linear_matches_scalar_twin(m in 1usize..6, k in 1usize..90, n in 1usize..40, seed in any::<u64>()) {
            let x = data(m * k, seed);
            let wf = data(n * k, seed ^ 1);
            let wb: Vec<u16> = wf.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect();
            let wh: Vec<u16> = wf.iter().map(|&v| half::f16::from_f32(v).to_bits()).collect();
            for w in [WeightRows::F32(&wf), WeightRows::Bf16(&wb), WeightRows::F16(&wh)] {
                let mut y = vec![0f32; m * n];
                let mut y0 = vec![0f32; m * n];
                linear(&x, m, k, w, n, &mut y);
                linear_scalar(&x, m, k, w, n, &mut y0);
                for (a, b) in y.iter().zip(&y0) {
                    prop_assert!(close(*a, *b, k as f32), "{a} vs {b}");
                }
            }
        }

        #[test]
        fn add_bias_rows_adds_the_bias_to_every_row(rows in 1usize..7, n in 1usize..70, seed in any::<u64>()) {
            let y0 = data(rows * n, seed);
            let bias = data(n, seed ^ 7);
            let mut y = y0.clone();
            add_bias_rows(&mut y, &bias);
            for r in 0..rows {
                for j in 0..n {
                    prop_assert_eq!(y[r * n + j].to_bits(), (y0[r * n + j] + bias[j]).to_bits());
                }
            }
        }
    }

    #[test]
    #[should_panic(expected = "not whole rows")]
    fn add_bias_rows_refuses_a_partial_row() {
        add_bias_rows(&mut [0.0; 5], &[1.0, 2.0]);
    }
}
