//! One query token's attention terms for a group of heads that share their key and value rows
//! (absorbed MLA: 16 heads over one latent row; GQA: the heads of one kv head), over a run of
//! cached positions: the raw scores `q_h · k_j`, and the weighted sum `Σ_j p_hj · v_j` of the
//! value rows.
//!
//! The generic path ([`crate::linear::dot`] per head and position, [`crate::linear::axpy`] per head
//! and position) reads each row once per head from L1 but pays a horizontal sum per dot and a
//! load and store of the head's output per value row: measured 480 µs for V2-Lite's 576-position
//! decode attention on two cores, about 3.5 multiply-adds per cycle. The AVX-512 kernels here
//! keep [`HEADS_PER_PASS`] heads' accumulators in registers: a key chunk is loaded once and
//! multiplied with each head's query chunk, a value chunk once and added into each head's
//! output chunk, so the loop runs at the FMA ports' rate.

#[cfg(target_arch = "x86_64")]
use crate::isa::lane_mask16;
use crate::isa::Isa;

/// Heads whose accumulators a pass keeps in registers: 8 independent FMA chains cover the FMA
/// latency (4 cycles × 2 ports), and 8 query or output chunks plus the row chunk fit in 32 zmm.
pub const HEADS_PER_PASS: usize = 8;

/// Cached rows: row `j` is `data[start + j · stride ..][..width]`.
#[derive(Clone, Copy, Debug)]
pub struct Rows<'a> {
    pub data: &'a [f32],
    pub start: usize,
    pub stride: usize,
    pub width: usize,
}

impl Rows<'_> {
    fn row(&self, j: usize) -> &[f32] {
        &self.data[self.start + j * self.stride..][..self.width]
    }

    fn check(&self, n: usize) {
        if n > 0 {
            assert!(self.start + (n - 1) * self.stride + self.width <= self.data.len(), "rows past the cache");
        }
    }
}

/// `scores[h · n + j] = q_h · k_j` for heads `h < group` (`q` is `[group, k.width]`) and rows
/// `j < n`.
pub fn group_scores(isa: Isa, q: &[f32], group: usize, k: Rows<'_>, n: usize, scores: &mut [f32]) {
    assert_eq!(q.len(), group * k.width, "group_scores: q must be [group, width]");
    assert!(scores.len() >= group * n, "group_scores: scores too short");
    k.check(n);
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the active ISA is at most what the CPU has; extents checked above.
        Isa::Avx512 => unsafe { group_scores_avx512(q, group, k, n, scores) },
        _ => group_scores_scalar(q, group, k, n, scores),
    }
}

/// Scalar twin of [`group_scores`] (each dot summed in k order).
pub fn group_scores_scalar(q: &[f32], group: usize, k: Rows<'_>, n: usize, scores: &mut [f32]) {
    for j in 0..n {
        let kr = k.row(j);
        for h in 0..group {
            let qh = &q[h * k.width..(h + 1) * k.width];
            scores[h * n + j] = qh.iter().zip(kr).fold(0f32, |s, (&a, &b)| a.mul_add(b, s));
        }
    }
}

/// `o[h · v.width + d] = Σ_j p[h · n + j] · v_j[d]` for heads `h < group` and rows `j < n` (`o`
/// overwritten).
pub fn group_values(isa: Isa, p: &[f32], group: usize, n: usize, v: Rows<'_>, o: &mut [f32]) {
    assert!(p.len() >= group * n, "group_values: p too short");
    assert_eq!(o.len(), group * v.width, "group_values: o must be [group, width]");
    v.check(n);
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as in group_scores.
        Isa::Avx512 => unsafe { group_values_avx512(p, group, n, v, o) },
        _ => group_values_scalar(p, group, n, v, o),
    }
}

/// Scalar twin of [`group_values`] (rows summed in order with fused multiply-adds, as the AVX-512
/// kernel does per lane: the two give the same bits).
pub fn group_values_scalar(p: &[f32], group: usize, n: usize, v: Rows<'_>, o: &mut [f32]) {
    o.fill(0.0);
    for j in 0..n {
        let vr = v.row(j);
        for h in 0..group {
            let w = p[h * n + j];
            for (od, &x) in o[h * v.width..(h + 1) * v.width].iter_mut().zip(vr) {
                *od = w.mul_add(x, *od);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn group_scores_avx512(q: &[f32], group: usize, k: Rows<'_>, n: usize, scores: &mut [f32]) {
    let mut h = 0;
    while h < group {
        let hp = (group - h).min(HEADS_PER_PASS);
        match hp {
            8 => scores_pass::<8>(q, h, k, n, scores),
            4..=7 => scores_pass::<4>(q, h, k, n, scores),
            _ => scores_pass::<1>(q, h, k, n, scores),
        }
        h += match hp {
            8 => 8,
            4..=7 => 4,
            _ => 1,
        };
    }
}

/// Heads `h0..h0 + H` of [`group_scores_avx512`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn scores_pass<const H: usize>(q: &[f32], h0: usize, k: Rows<'_>, n: usize, scores: &mut [f32]) {
    use std::arch::x86_64::*;
    let w = k.width;
    let qp = q.as_ptr().add(h0 * w);
    for j in 0..n {
        let kp = k.data.as_ptr().add(k.start + j * k.stride);
        let mut acc = [_mm512_setzero_ps(); H];
        let mut c = 0;
        while c + 16 <= w {
            let kv = _mm512_loadu_ps(kp.add(c));
            for (hh, a) in acc.iter_mut().enumerate() {
                *a = _mm512_fmadd_ps(_mm512_loadu_ps(qp.add(hh * w + c)), kv, *a);
            }
            c += 16;
        }
        if c < w {
            let m = lane_mask16(c, w);
            let kv = _mm512_maskz_loadu_ps(m, kp.add(c));
            for (hh, a) in acc.iter_mut().enumerate() {
                *a = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, qp.add(hh * w + c)), kv, *a);
            }
        }
        for (hh, a) in acc.iter().enumerate() {
            scores[(h0 + hh) * n + j] = _mm512_reduce_add_ps(*a);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn group_values_avx512(p: &[f32], group: usize, n: usize, v: Rows<'_>, o: &mut [f32]) {
    let mut h = 0;
    while h < group {
        let hp = (group - h).min(HEADS_PER_PASS);
        let step = match hp {
            8 => 8,
            4..=7 => 4,
            _ => 1,
        };
        match step {
            8 => values_pass::<8>(p, h, n, v, o),
            4 => values_pass::<4>(p, h, n, v, o),
            _ => values_pass::<1>(p, h, n, v, o),
        }
        h += step;
    }
}

/// Heads `h0..h0 + H` of [`group_values_avx512`]: per 16-lane chunk of the value width, the
/// heads' output chunks stay in registers over all `n` rows.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn values_pass<const H: usize>(p: &[f32], h0: usize, n: usize, v: Rows<'_>, o: &mut [f32]) {
    use std::arch::x86_64::*;
    let w = v.width;
    let (vp, pp, op) = (v.data.as_ptr().add(v.start), p.as_ptr(), o.as_mut_ptr());
    // Whole chunks with plain loads and stores (masked stores are slow on some cores: measured
    // on the dev VM's EPYC, they were most of this kernel's time), the tail masked.
    let mut c = 0;
    while c < w {
        let m = lane_mask16(c, w);
        let mut acc = [_mm512_setzero_ps(); H];
        for j in 0..n {
            let x = if m == 0xffff {
                _mm512_loadu_ps(vp.add(j * v.stride + c))
            } else {
                _mm512_maskz_loadu_ps(m, vp.add(j * v.stride + c))
            };
            for (hh, a) in acc.iter_mut().enumerate() {
                *a = _mm512_fmadd_ps(_mm512_set1_ps(*pp.add((h0 + hh) * n + j)), x, *a);
            }
        }
        for (hh, a) in acc.iter().enumerate() {
            if m == 0xffff {
                _mm512_storeu_ps(op.add((h0 + hh) * w + c), *a);
            } else {
                _mm512_mask_storeu_ps(op.add((h0 + hh) * w + c), m, *a);
            }
        }
        c += 16;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::isa::Isa;
    use proptest::prelude::*;

    fn data(n: usize, seed: u64) -> Vec<f32> {
        crate::moe::tests::data(n, seed)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Every ISA this CPU has against the scalar twins: scores within a few ulp of the dot's
        /// magnitude (the kernel sums lanes in another order), values bit for bit (the same
        /// fused multiply-adds per element, rows in order). Ragged widths, groups and counts.
        #[test]
        fn isas_agree_with_scalar(
            group in 1usize..18,
            width in 1usize..80,
            n in 0usize..40,
            pad in 0usize..20,
            start in 0usize..9,
            seed in any::<u64>(),
        ) {
            let stride = width + pad;
            let cache = data(start + n * stride + width, seed);
            let rows = Rows { data: &cache, start, stride, width };
            let q = data(group * width, seed ^ 1);
            let p = data(group * n, seed ^ 2);
            let mut want_s = vec![0f32; group * n];
            group_scores_scalar(&q, group, rows, n, &mut want_s);
            let mut want_o = vec![0f32; group * width];
            group_values_scalar(&p, group, n, rows, &mut want_o);
            for isa in Isa::available() {
                let mut s = vec![f32::NAN; group * n];
                group_scores(isa, &q, group, rows, n, &mut s);
                for (h, (a, b)) in s.iter().zip(&want_s).enumerate() {
                    let (qh, kr) = (&q[h / n.max(1) * width..][..width], rows.row(h % n.max(1)));
                    let mag: f32 = qh.iter().zip(kr).map(|(x, y)| (x * y).abs()).sum();
                    prop_assert!((a - b).abs() <= 2e-5 * mag.max(1e-30), "{isa:?} score {h}: {a} vs {b}");
                }
                let mut o = vec![f32::NAN; group * width];
                group_values(isa, &p, group, n, rows, &mut o);
                prop_assert!(o.iter().zip(&want_o).all(|(a, b)| a.to_bits() == b.to_bits()), "{isa:?} values differ");
            }
        }
    }
}
