//! Symmetric per-group INT4/INT8 weight quantisation along K (the scalar reference).
//!
//! A weight matrix `w[rows, k]` is cut along K into groups of `gs` consecutive elements. Each
//! (row, group) gets one scale `s` and integers `q = round(w / s)` in `[-qmax, qmax]`
//! (`qmax` = 7 for INT4, 127 for INT8; both ranges are symmetric, so -8 / -128 never occur), and
//! `w ≈ q · s`.
//!
//! **Scales are f16.** `s = amax / qmax` rounded *up* to the next representable f16, so that
//! `|w| / s ≤ qmax` holds exactly and nothing clips. f16 has an 11-bit significand (bf16: 8), so
//! rounding the scale up moves it by at most 2⁻¹⁰ relative — the reconstruction grid is stretched
//! by < 0.1%, far below the quantisation step itself (1/7 or 1/127 of the group's range); with
//! bf16 the stretch would be up to 0.8%, a visible fraction of an INT8 step. f16's range
//! (6e-8 … 65504 per scale, i.e. weights up to ~4.6e5 at INT4) is ample for model weights; a
//! scale beyond it saturates at `f16::MAX` (and then values clip), one below the subnormal range
//! rounds up to the smallest subnormal. An all-zero group has scale 0 and q 0.

use half::f16;

/// Group size used when the caller has no preference.
pub const DEFAULT_GROUP_SIZE: usize = 128;
/// Smallest group size [`group_size_for`] falls back to (and the granularity every group size
/// must have: the CPU layout and kernels process K in steps of 32).
pub const MIN_GROUP_SIZE: usize = 32;
/// Largest supported group size: keeps every per-group integer dot product below 2²⁴ in
/// magnitude (127 · 127 · 1024 < 2²⁴), so converting it to f32 is exact.
pub const MAX_GROUP_SIZE: usize = 1024;

/// Integer width of the quantised weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Bits {
    Int4,
    Int8,
}

impl Bits {
    /// Largest magnitude of a quantised value (7 or 127).
    pub fn qmax(self) -> i32 {
        match self {
            Bits::Int4 => 7,
            Bits::Int8 => 127,
        }
    }

    /// 4 or 8.
    pub fn bits(self) -> u32 {
        match self {
            Bits::Int4 => 4,
            Bits::Int8 => 8,
        }
    }

    /// Parse 4 or 8.
    pub fn from_bits(b: u32) -> Option<Bits> {
        match b {
            4 => Some(Bits::Int4),
            8 => Some(Bits::Int8),
            _ => None,
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum QuantError {
    #[error("K = {k} cannot be quantised in groups: it must be a positive multiple of 32")]
    KNotMultipleOf32 { k: usize },
    #[error("preferred group size {gs} is not a power of two between 32 and 1024")]
    BadPreferredGroupSize { gs: usize },
    #[error("group size {gs} does not suit K = {k}: it must be a multiple of 32, at most 1024, and divide K")]
    BadGroupSize { k: usize, gs: usize },
    #[error("fused w13: gate is {gate_rows}×{gate_k} ({gate_bits:?}, g{gate_gs}) but up is {up_rows}×{up_k} ({up_bits:?}, g{up_gs}); they must match")]
    W13Mismatch {
        gate_rows: usize,
        gate_k: usize,
        gate_bits: Bits,
        gate_gs: usize,
        up_rows: usize,
        up_k: usize,
        up_bits: Bits,
        up_gs: usize,
    },
    #[error("fused w13: gate/up have {rows} rows, which is not a multiple of 16")]
    W13Rows { rows: usize },
    #[error("packed buffer is {found} bytes, the layout needs {expected}")]
    BufferLen { found: usize, expected: usize },
}

/// The group size for a K dimension: `preferred` (a power of two in 32..=1024, usually
/// [`DEFAULT_GROUP_SIZE`]), halved while it does not divide `k`, down to 32. Errors (naming `k`)
/// when `k` is not a positive multiple of 32.
pub fn group_size_for(k: usize, preferred: usize) -> Result<usize, QuantError> {
    if !preferred.is_power_of_two() || !(MIN_GROUP_SIZE..=MAX_GROUP_SIZE).contains(&preferred) {
        return Err(QuantError::BadPreferredGroupSize { gs: preferred });
    }
    if k == 0 || !k.is_multiple_of(MIN_GROUP_SIZE) {
        return Err(QuantError::KNotMultipleOf32 { k });
    }
    let mut gs = preferred;
    while !k.is_multiple_of(gs) {
        gs /= 2;
    }
    Ok(gs)
}

/// Whether `gs` is a usable group size for `k` (what the layout and kernels accept).
pub fn check_group_size(k: usize, gs: usize) -> Result<(), QuantError> {
    if gs == 0 || !gs.is_multiple_of(MIN_GROUP_SIZE) || gs > MAX_GROUP_SIZE || k == 0 || !k.is_multiple_of(gs) {
        return Err(QuantError::BadGroupSize { k, gs });
    }
    Ok(())
}

/// A quantised matrix in plain row-major form (the interchange form; the kernels read the packed
/// CPU layout of [`crate::cpu_layout`]).
#[derive(Clone, Debug, PartialEq)]
pub struct QuantizedMatrix {
    pub rows: usize,
    pub k: usize,
    pub gs: usize,
    pub bits: Bits,
    /// `[rows, k]`, each in `[-qmax, qmax]`.
    pub q: Vec<i8>,
    /// `[rows, k / gs]`.
    pub scales: Vec<f16>,
}

impl QuantizedMatrix {
    /// Number of groups per row.
    pub fn groups(&self) -> usize {
        self.k / self.gs
    }

    /// Scale of (row, group) as f32.
    pub fn scale(&self, row: usize, group: usize) -> f32 {
        self.scales[row * self.groups() + group].to_f32()
    }
}

/// The f16 scale for a group whose largest magnitude is `amax`: the smallest f16 ≥ amax / qmax.
pub fn scale_for(amax: f32, bits: Bits) -> f16 {
    if amax.is_nan() || amax <= 0.0 {
        return f16::ZERO;
    }
    // amax (24-bit significand) / qmax in f64 is within 2⁻⁵² of the true quotient; an f16 equal
    // to that f64 is then the true quotient itself (two distinct ≤24-bit products cannot be
    // that close), so the comparison below is exact.
    let t = amax as f64 / bits.qmax() as f64;
    let mut h = f16::from_f64(t);
    if h.is_infinite() || h.to_f64() > f16::MAX.to_f64() {
        return f16::MAX;
    }
    if h.to_f64() < t {
        h = f16::from_bits(h.to_bits() + 1);
        if h.is_infinite() {
            return f16::MAX;
        }
    }
    h
}

/// Quantise `w[rows, k]` (row-major) in groups of `gs` along K.
///
/// # Panics
/// If `w.len() != rows * k` or `gs` does not suit `k` (see [`check_group_size`]; use
/// [`group_size_for`] to choose it).
pub fn quantize(w: &[f32], rows: usize, k: usize, bits: Bits, gs: usize) -> QuantizedMatrix {
    assert_eq!(w.len(), rows * k, "quantize: w has {} elements, expected {rows}×{k}", w.len());
    if let Err(e) = check_group_size(k, gs) {
        panic!("quantize: {e}");
    }
    let ng = k / gs;
    let qmax = bits.qmax() as f64;
    let mut q = vec![0i8; rows * k];
    let mut scales = vec![f16::ZERO; rows * ng];
    for (r, (wrow, qrow)) in w.chunks_exact(k).zip(q.chunks_exact_mut(k)).enumerate() {
        for (g, (wg, qg)) in wrow.chunks_exact(gs).zip(qrow.chunks_exact_mut(gs)).enumerate() {
            let amax = wg.iter().fold(0f32, |m, &v| m.max(v.abs()));
            let s = scale_for(amax, bits);
            scales[r * ng + g] = s;
            let s = s.to_f64();
            if s == 0.0 {
                continue; // q stays 0
            }
            let inv = 1.0 / s;
            for (o, &v) in qg.iter_mut().zip(wg) {
                *o = (v as f64 * inv).round().clamp(-qmax, qmax) as i8;
            }
        }
    }
    QuantizedMatrix { rows, k, gs, bits, q, scales }
}

/// `q · scale` as f32, row-major `[rows, k]`.
pub fn dequantize(m: &QuantizedMatrix) -> Vec<f32> {
    let ng = m.groups();
    let mut out = Vec::with_capacity(m.rows * m.k);
    for r in 0..m.rows {
        for g in 0..ng {
            let s = m.scales[r * ng + g].to_f32();
            let qg = &m.q[r * m.k + g * m.gs..r * m.k + (g + 1) * m.gs];
            out.extend(qg.iter().map(|&v| v as f32 * s));
        }
    }
    out
}

/// Deterministic values in `[-amp, amp)` (xorshift), for tests here and in the crates that
/// quantise with this one.
pub fn test_data(n: usize, seed: u64, amp: f32) -> Vec<f32> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0) * amp
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::test_data as data;
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn group_choice_rule() {
        assert_eq!(group_size_for(2048, 128), Ok(128));
        assert_eq!(group_size_for(1408, 128), Ok(128));
        assert_eq!(group_size_for(1376, 128), Ok(32)); // 1376 = 43 · 32
        assert_eq!(group_size_for(96, 128), Ok(32));
        assert_eq!(group_size_for(192, 128), Ok(64));
        assert_eq!(group_size_for(160, 128), Ok(32));
        assert_eq!(group_size_for(4096, 256), Ok(256));
        assert_eq!(group_size_for(64, 1024), Ok(64));
        assert_eq!(group_size_for(100, 128), Err(QuantError::KNotMultipleOf32 { k: 100 }));
        assert_eq!(group_size_for(0, 128), Err(QuantError::KNotMultipleOf32 { k: 0 }));
        assert_eq!(group_size_for(128, 96), Err(QuantError::BadPreferredGroupSize { gs: 96 }));
        assert_eq!(group_size_for(128, 16), Err(QuantError::BadPreferredGroupSize { gs: 16 }));
        let msg = group_size_for(1000, 128).unwrap_err().to_string();
        assert!(msg.contains("1000"), "{msg}");
    }

    #[test]
    fn scale_rounds_up_exactly() {
        for bits in [Bits::Int4, Bits::Int8] {
            for &amax in &[1.0f32, 0.1, 3.3e-3, 7.0, 127.0, 1e-7, 6e4, 1e9, f32::MIN_POSITIVE] {
                let s = scale_for(amax, bits);
                let want = amax as f64 / bits.qmax() as f64;
                if want <= f16::MAX.to_f64() {
                    assert!(s.to_f64() >= want, "{amax} {bits:?}: {s} < {want}");
                    // Smallest such f16: the one below is too small.
                    if s.to_bits() > 0 {
                        assert!(f16::from_bits(s.to_bits() - 1).to_f64() < want);
                    }
                } else {
                    assert_eq!(s, f16::MAX);
                }
            }
            assert_eq!(scale_for(0.0, bits), f16::ZERO);
        }
        // Exactly representable quotient stays put.
        assert_eq!(scale_for(7.0, Bits::Int4).to_f32(), 1.0);
        assert_eq!(scale_for(127.0 * 0.5, Bits::Int8).to_f32(), 0.5);
    }

    #[test]
    fn zero_group_has_zero_scale() {
        let mut w = data(2 * 64, 3, 1.0);
        w[..32].iter_mut().for_each(|v| *v = 0.0);
        let m = quantize(&w, 2, 64, Bits::Int8, 32);
        assert_eq!(m.scales[0], f16::ZERO);
        assert!(m.q[..32].iter().all(|&v| v == 0));
        assert!(m.scales[1].to_f32() > 0.0);
    }

    proptest! {
        #[test]
        fn error_within_half_step_and_no_clipping(
            rows in 1usize..20,
            kk in prop::sample::select(vec![32usize, 64, 96, 160, 256, 2048]),
            int8 in any::<bool>(),
            gpref in prop::sample::select(vec![32usize, 64, 128, 256]),
            amp_exp in -12i32..8,
            seed in any::<u64>(),
        ) {
            let bits = if int8 { Bits::Int8 } else { Bits::Int4 };
            let gs = group_size_for(kk, gpref).unwrap();
            prop_assert!(kk % gs == 0 && gs <= gpref && gs >= 32);
            let mut w = data(rows * kk, seed, 2f32.powi(amp_exp));
            // An outlier per row to make groups differ in scale.
            w[(seed as usize) % (rows * kk)] *= 9.0;
            let m = quantize(&w, rows, kk, bits, gs);
            let d = dequantize(&m);
            let qmax = bits.qmax();
            for r in 0..rows {
                for c in 0..kk {
                    let s = m.scale(r, c / gs);
                    let q = m.q[r * kk + c] as i32;
                    prop_assert!(q.abs() <= qmax);
                    let v = w[r * kk + c];
                    // No clipping: the scale covers the group's largest magnitude.
                    prop_assert!((v.abs() as f64) <= s as f64 * qmax as f64);
                    let err = (v as f64 - d[r * kk + c] as f64).abs();
                    prop_assert!(err <= s as f64 * 0.5 * (1.0 + 1e-6), "r{r} c{c}: w {v} deq {} s {s}", d[r * kk + c]);
                }
            }
        }
    }
}
