//! The ggml dequantisers against golden vectors from the `gguf` Python package's reference
//! dequantisers (`scripts/ggml-golden.py` writes `tests/data/ggml/*.bin`): bit-identical output.

use krasis_quant::ggml::{dequantize, GgmlType};

fn golden(ty: GgmlType) -> (Vec<u8>, Vec<f32>) {
    let path = format!("{}/tests/data/ggml/{}.bin", env!("CARGO_MANIFEST_DIR"), ty.name());
    let data = std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let word = |i: usize| u32::from_le_bytes(data[4 * i..4 * i + 4].try_into().unwrap()) as usize;
    let (blocks, elements) = (word(0), word(1));
    let raw_len = blocks * ty.block_bytes();
    assert_eq!(elements, blocks * ty.block_elems(), "{path}");
    let raw = data[8..8 + raw_len].to_vec();
    let values: Vec<f32> =
        data[8 + raw_len..].chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    assert_eq!(values.len(), elements, "{path}");
    (raw, values)
}

#[test]
fn every_type_matches_the_gguf_reference_bit_for_bit() {
    for ty in GgmlType::ALL {
        let (raw, expect) = golden(ty);
        let mut out = vec![f32::NAN; expect.len()];
        dequantize(ty, &raw, &mut out).unwrap();
        let mismatches: Vec<(usize, f32, f32)> = out
            .iter()
            .zip(&expect)
            .enumerate()
            .filter(|(_, (a, b))| a.to_bits() != b.to_bits())
            .map(|(i, (a, b))| (i, *a, *b))
            .collect();
        assert!(
            mismatches.is_empty(),
            "{ty}: {} of {} differ, first {:?}",
            mismatches.len(),
            out.len(),
            &mismatches[..mismatches.len().min(4)]
        );
    }
}

#[test]
fn a_corrupted_block_changes_the_output() {
    // The golden comparison is not vacuous: flipping one code bit of each quantised type moves
    // some output value.
    for ty in GgmlType::ALL.into_iter().filter(|t| t.block_elems() > 1) {
        let (mut raw, expect) = golden(ty);
        let last = raw.len() - ty.block_bytes() / 2;
        raw[last] ^= 0x11;
        let mut out = vec![0f32; expect.len()];
        dequantize(ty, &raw, &mut out).unwrap();
        assert!(out.iter().zip(&expect).any(|(a, b)| a.to_bits() != b.to_bits()), "{ty}");
    }
}
