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
//! bf16 the stretch would be up to 0.8%, a visible fraction of an INT8 step. An all-zero group has
//! scale 0 and q 0.
//!
//! **Range.** f16 scales run from [`MIN_SCALE`] (2⁻²⁴ ≈ 5.96e-8, the smallest subnormal) to
//! 65504. A scale beyond the top saturates at `f16::MAX` (values then clip). Below 2⁻¹⁴ the scale
//! is an f16 subnormal, stored and read exactly (the half crate and the kernels' F16C/AVX-512
//! conversions keep subnormals); its spacing is 2⁻²⁴, so rounding up costs at most 2⁻²⁵ ≈ 3e-8
//! of extra error per weight and keeps at least half of the `qmax` levels. A group whose ideal
//! scale (`amax / qmax`) is below 2⁻²⁴ cannot be held: its scale is raised to 2⁻²⁴, the group
//! keeps only `round(amax / 2⁻²⁴)` of its `qmax` levels, and weights below 2⁻²⁵ become 0 (all of
//! them when `amax` < 2⁻²⁵, about 3e-8). [`Underflow::of`] finds such groups in a quantised
//! matrix, so the caller can say so (the model's cache builds warn, naming the tensor): the
//! loss is never silent.

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
    #[error("GPU FP4 packing: {0}")]
    Fp4Pack(String),
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

/// The smallest positive f16 scale, 2⁻²⁴ (a subnormal): the floor a nonzero group's scale is
/// raised to when its ideal scale is smaller (see the module notes on range).
pub const MIN_SCALE: f16 = f16::from_bits(1);

/// Groups of a quantised matrix whose weights are too small for an f16 scale: their ideal scale
/// (`amax / qmax`) is below [`MIN_SCALE`], so the stored scale was raised to it and the group
/// keeps fewer than `qmax` levels. Counted by [`Underflow::of`], summed with [`Underflow::add`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Underflow {
    /// Groups looked at (all groups of the matrices counted).
    pub groups: u64,
    /// Groups whose scale is [`MIN_SCALE`] and whose largest `|q|` is below `qmax`: precision
    /// lost to the f16 range (the zeroed ones included).
    pub clamped: u64,
    /// Of those, groups with a nonzero weight that quantised to all zeros: the group is lost.
    pub zeroed: u64,
    /// The first clamped group (row-major order): its row, group index, and largest `|q|` (the
    /// levels it kept; 0 when zeroed).
    pub first: Option<UnderflowAt>,
}

/// Where a clamped group is, in [`Underflow::first`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UnderflowAt {
    pub row: usize,
    pub group: usize,
    /// Largest `|q|` in the group: the levels it kept of `qmax`.
    pub levels: u32,
}

impl Underflow {
    /// The clamped groups of `m`. A group is clamped exactly when its stored scale is
    /// [`MIN_SCALE`] and its largest `|q|` is below `qmax` (a group whose ideal scale is at least
    /// `MIN_SCALE` reaches `qmax`, and an all-zero group has scale 0); it is zeroed when every
    /// `q` is then 0. Needs only the quantised matrix, so packed caches can be checked too.
    pub fn of(m: &QuantizedMatrix) -> Underflow {
        let (ng, qmax) = (m.groups(), m.bits.qmax() as u32);
        let mut u = Underflow { groups: (m.rows * ng) as u64, ..Underflow::default() };
        for (i, s) in m.scales.iter().enumerate() {
            if *s != MIN_SCALE {
                continue;
            }
            let (row, group) = (i / ng, i % ng);
            let start = row * m.k + group * m.gs;
            let levels = m.q[start..start + m.gs].iter().map(|&v| v.unsigned_abs() as u32).max().unwrap_or(0);
            if levels >= qmax {
                continue;
            }
            u.clamped += 1;
            u.zeroed += (levels == 0) as u64;
            u.first.get_or_insert(UnderflowAt { row, group, levels });
        }
        u
    }

    /// Adds `other`'s counts; `first` stays the earlier one (this one's when both have one).
    pub fn add(&mut self, other: &Underflow) {
        self.groups += other.groups;
        self.clamped += other.clamped;
        self.zeroed += other.zeroed;
        if self.first.is_none() {
            self.first = other.first;
        }
    }
}

/// The f16 scale for a group whose largest magnitude is `amax`: the smallest f16 ≥ amax / qmax
/// (at least [`MIN_SCALE`] for a nonzero group).
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

    /// A group of tiny weights (largest |w| 2e-7, below the 7.6e-6 an INT8 group needs to keep
    /// its 127 levels with an f16 scale; 2e-8 at INT4 is below the 3e-8 where weights become 0):
    /// the quantiser keeps what f16 can (a subnormal scale, read back exactly) and
    /// [`Underflow::of`] reports the loss, which used to go unseen.
    #[test]
    fn tiny_groups_are_reported_not_silent() {
        let k = 64;
        // Row 0: group 0 ordinary, group 1 tiny. Row 1: group 0 tiny, group 1 all zeros.
        let mut w = data(2 * k, 9, 0.5);
        w[32..64].copy_from_slice(&data(32, 10, 2e-7));
        w[64..96].copy_from_slice(&data(32, 11, 2e-7));
        w[96..128].iter_mut().for_each(|v| *v = 0.0);
        let m = quantize(&w, 2, k, Bits::Int8, 32);
        assert_eq!(m.scales[1], MIN_SCALE, "the scale is raised to the smallest subnormal");
        let d = dequantize(&m);
        // What f16 can hold is kept: the tiny group is not zeros, and within half a step of 2^-24.
        assert!(d[32..64].iter().any(|&v| v != 0.0));
        for (a, b) in w[32..64].iter().zip(&d[32..64]) {
            assert!((a - b).abs() <= MIN_SCALE.to_f32() * 0.5 * (1.0 + 1e-6), "{a} vs {b}");
        }
        let u = Underflow::of(&m);
        assert_eq!((u.groups, u.clamped, u.zeroed), (4, 2, 0), "{u:?}");
        let first = u.first.expect("a clamped group");
        assert_eq!((first.row, first.group), (0, 1));
        // 2e-7 / 2^-24 ≈ 3.4: about 3 of 127 levels kept.
        assert!((1..=4).contains(&first.levels), "{first:?}");

        // Below 2^-25 the whole group is zeros: counted as zeroed.
        let mut w = data(k, 12, 0.5);
        w[32..64].copy_from_slice(&data(32, 13, 2e-8));
        let m = quantize(&w, 1, k, Bits::Int4, 32);
        assert!(m.q[32..64].iter().all(|&v| v == 0));
        let u = Underflow::of(&m);
        assert_eq!((u.groups, u.clamped, u.zeroed), (2, 1, 1), "{u:?}");
        assert_eq!(u.first, Some(UnderflowAt { row: 0, group: 1, levels: 0 }));

        // An ordinary matrix, and a group whose ideal scale is just 2^-24, report nothing.
        assert_eq!(Underflow::of(&quantize(&data(4 * k, 14, 1e-3), 4, k, Bits::Int8, 32)).clamped, 0);
        let mut w = vec![0f32; 32];
        w[3] = 127.0 * MIN_SCALE.to_f32();
        let m = quantize(&w, 1, 32, Bits::Int8, 32);
        assert_eq!((m.scales[0], m.q[3]), (MIN_SCALE, 127));
        assert_eq!(Underflow::of(&m).clamped, 0);

        let mut sum = Underflow::default();
        sum.add(&Underflow::of(&m));
        sum.add(&u);
        assert_eq!((sum.groups, sum.clamped, sum.zeroed, sum.first), (3, 1, 1, u.first));
    }

    /// Subnormal scales (ideal scale between 2^-24 and 2^-14) keep at least half the levels and
    /// add at most 2^-25 to the error bound of an ideal scale.
    #[test]
    fn subnormal_scales_lose_at_most_one_bit() {
        for bits in [Bits::Int4, Bits::Int8] {
            for e in [-24.0f32, -23.7, -22.0, -19.5, -16.0, -14.2] {
                let t = 2f32.powf(e);
                let mut w = data(32, e.to_bits() as u64, t * bits.qmax() as f32);
                w[5] = t * bits.qmax() as f32;
                let m = quantize(&w, 1, 32, bits, 32);
                let s = m.scales[0].to_f32();
                assert!(s >= t && s <= t + MIN_SCALE.to_f32(), "{bits:?} 2^{e}: scale {s}");
                assert_eq!(Underflow::of(&m).clamped, 0, "{bits:?} 2^{e}");
                let kept = m.q.iter().map(|v| v.unsigned_abs() as i32).max().unwrap();
                assert!(2 * kept >= bits.qmax(), "{bits:?} 2^{e}: {kept} levels");
            }
        }
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
