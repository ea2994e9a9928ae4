//! Element types found in weight files, and exact conversions to f32.

use half::{bf16, f16};

/// Element type of a stored tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F16,
    BF16,
    /// FP8 E4M3 ("fn" variant: no infinities, 0x7f/0xff are NaN), as DeepSeek-V3 ships.
    F8E4M3,
    I64,
    I32,
    U8,
}

impl DType {
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::F8E4M3 | DType::U8 => 1,
            DType::I64 => 8,
        }
    }

    /// The name safetensors uses.
    pub fn safetensors_name(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::F8E4M3 => "F8_E4M3",
            DType::I64 => "I64",
            DType::I32 => "I32",
            DType::U8 => "U8",
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.safetensors_name())
    }
}

#[inline]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

#[inline]
pub fn f16_to_f32(bits: u16) -> f32 {
    f16::from_bits(bits).to_f32()
}

/// Round-to-nearest-even f32 → bf16 (NaN stays NaN).
#[inline]
pub fn f32_to_bf16(x: f32) -> u16 {
    bf16::from_f32(x).to_bits()
}

/// Exact FP8 E4M3 (fn) → f32: 1 sign, 4 exponent (bias 7), 3 mantissa bits; subnormals at
/// exponent 0; 0x7f and 0xff are NaN (there are no infinities).
#[inline]
pub fn fp8_e4m3_to_f32(bits: u8) -> f32 {
    let sign = if bits & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let exp = ((bits >> 3) & 0x0f) as i32;
    let man = (bits & 0x07) as f32;
    if exp == 0x0f && (bits & 0x07) == 0x07 {
        return f32::NAN;
    }
    if exp == 0 {
        sign * man * (1.0 / 8.0) * 2f32.powi(-6)
    } else {
        sign * (1.0 + man / 8.0) * 2f32.powi(exp - 7)
    }
}

/// Largest finite FP8 E4M3 value.
pub const FP8_E4M3_MAX: f32 = 448.0;

/// f32 → FP8 E4M3 code, round to nearest even, saturating to ±448 (infinities included); NaN →
/// 0x7f. The GPU KV cache's kernels convert with the same steps (so the same bits).
pub fn f32_to_fp8_e4m3(x: f32) -> u8 {
    let bits = x.to_bits();
    let sign = ((bits >> 24) & 0x80) as u8;
    let abits = bits & 0x7fff_ffff;
    if abits > 0x7f80_0000 {
        return 0x7f;
    }
    let a = f32::from_bits(abits);
    if a >= FP8_E4M3_MAX {
        return sign | 0x7e;
    }
    if a < 0.015625 {
        // Subnormal grid m · 2^-9 (m = 8 is the smallest normal, 2^-6: the same code).
        return sign | (a * 512.0).round_ties_even() as u8;
    }
    let mut e = (abits >> 23) as i32 - 127;
    let mut q = (abits >> 20) & 7;
    let rem = abits & 0xf_ffff;
    if rem > 0x8_0000 || (rem == 0x8_0000 && q & 1 == 1) {
        q += 1;
    }
    if q == 8 {
        q = 0;
        e += 1;
    }
    sign | (((e + 7) as u8) << 3) | q as u8
}

/// Lookup table for all 256 FP8 E4M3 codes (built once; conversion is a table read).
pub fn fp8_e4m3_table() -> &'static [f32; 256] {
    use std::sync::OnceLock;
    static TABLE: OnceLock<[f32; 256]> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut t = [0f32; 256];
        for (i, v) in t.iter_mut().enumerate() {
            *v = fp8_e4m3_to_f32(i as u8);
        }
        t
    })
}

/// Convert a little-endian byte buffer of `dtype` elements to f32, appending to `out`.
/// Integer dtypes are not weights and are refused by returning `false`.
pub fn extend_f32_from_bytes(dtype: DType, bytes: &[u8], out: &mut Vec<f32>) -> bool {
    match dtype {
        DType::F32 => out.extend(bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))),
        DType::BF16 => out.extend(bytes.chunks_exact(2).map(|c| bf16_to_f32(u16::from_le_bytes([c[0], c[1]])))),
        DType::F16 => out.extend(bytes.chunks_exact(2).map(|c| f16_to_f32(u16::from_le_bytes([c[0], c[1]])))),
        DType::F8E4M3 => {
            let t = fp8_e4m3_table();
            out.extend(bytes.iter().map(|&b| t[b as usize]))
        }
        DType::I64 | DType::I32 | DType::U8 => return false,
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp8_matches_reference_values() {
        assert_eq!(fp8_e4m3_to_f32(0x00), 0.0);
        assert_eq!(fp8_e4m3_to_f32(0x38), 1.0); // exp 7, man 0
        assert_eq!(fp8_e4m3_to_f32(0x7e), 448.0); // max finite
        assert_eq!(fp8_e4m3_to_f32(0xfe), -448.0);
        assert_eq!(fp8_e4m3_to_f32(0x01), 2f32.powi(-9)); // smallest subnormal
        assert!(fp8_e4m3_to_f32(0x7f).is_nan());
        assert!(fp8_e4m3_to_f32(0xff).is_nan());
        assert_eq!(fp8_e4m3_to_f32(0x3c), 1.5);
    }

    #[test]
    fn fp8_is_monotonic_over_positive_codes() {
        let mut prev = -1.0f32;
        for code in 0u8..0x7f {
            let v = fp8_e4m3_to_f32(code);
            assert!(v > prev, "code {code:#x}");
            prev = v;
        }
    }

    #[test]
    fn bf16_round_trip_is_exact_for_bf16_values() {
        for bits in (0u16..=0x7f7f).step_by(97) {
            let f = bf16_to_f32(bits);
            assert_eq!(f32_to_bf16(f), bits);
        }
    }
}
