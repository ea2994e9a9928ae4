//! FP8 E4M3 weights with one f32 scale per `block_rows × block_cols` block
//! (`weight_scale_inv`, as DeepSeek-V3 ships): `w[r][c] = fp8(q[r][c]) · scale[r / br][c / bc]`.

use krasis_core::dtype::fp8_e4m3_table;

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum Fp8BlockError {
    #[error("weight has {found} bytes, expected {rows}×{cols} = {expected}")]
    WeightLen { found: usize, rows: usize, cols: usize, expected: usize },
    #[error("scale grid has {found} entries, expected {grid_rows}×{grid_cols} for {rows}×{cols} with {block_rows}×{block_cols} blocks")]
    ScaleLen {
        found: usize,
        grid_rows: usize,
        grid_cols: usize,
        rows: usize,
        cols: usize,
        block_rows: usize,
        block_cols: usize,
    },
}

/// Shape of the scale grid for a `rows × cols` weight.
pub fn scale_grid(rows: usize, cols: usize, block_rows: usize, block_cols: usize) -> (usize, usize) {
    (rows.div_ceil(block_rows), cols.div_ceil(block_cols))
}

/// Dequantise into f32, row-major `[rows, cols]`.
pub fn dequantize(
    q: &[u8],
    scales: &[f32],
    rows: usize,
    cols: usize,
    block_rows: usize,
    block_cols: usize,
) -> Result<Vec<f32>, Fp8BlockError> {
    if q.len() != rows * cols {
        return Err(Fp8BlockError::WeightLen { found: q.len(), rows, cols, expected: rows * cols });
    }
    let (gr, gc) = scale_grid(rows, cols, block_rows, block_cols);
    if scales.len() != gr * gc {
        return Err(Fp8BlockError::ScaleLen {
            found: scales.len(),
            grid_rows: gr,
            grid_cols: gc,
            rows,
            cols,
            block_rows,
            block_cols,
        });
    }
    let table = fp8_e4m3_table();
    let mut out = Vec::with_capacity(rows * cols);
    for r in 0..rows {
        let srow = &scales[(r / block_rows) * gc..(r / block_rows + 1) * gc];
        let qrow = &q[r * cols..(r + 1) * cols];
        out.extend(qrow.iter().enumerate().map(|(c, &b)| table[b as usize] * srow[c / block_cols]));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use krasis_core::dtype::fp8_e4m3_to_f32;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn matches_elementwise_definition(rows in 1usize..40, cols in 1usize..40, br in 1usize..9, bc in 1usize..9, seed in any::<u64>()) {
            let mut s = seed;
            let mut next = || { s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407); (s >> 33) as u32 };
            let q: Vec<u8> = (0..rows * cols).map(|_| (next() & 0x7e) as u8 | if next() & 1 == 1 { 0x80 } else { 0 }).collect();
            let (gr, gc) = scale_grid(rows, cols, br, bc);
            let scales: Vec<f32> = (0..gr * gc).map(|_| (next() % 1000) as f32 / 997.0 + 0.01).collect();
            let w = dequantize(&q, &scales, rows, cols, br, bc).unwrap();
            for r in 0..rows {
                for c in 0..cols {
                    let expect = fp8_e4m3_to_f32(q[r * cols + c]) * scales[(r / br) * gc + c / bc];
                    prop_assert_eq!(w[r * cols + c], expect);
                }
            }
        }
    }

    #[test]
    fn ragged_scale_grid_is_rounded_up() {
        assert_eq!(scale_grid(192, 128, 128, 128), (2, 1));
        assert_eq!(scale_grid(80, 192, 128, 128), (1, 2));
    }

    #[test]
    fn wrong_scale_count_is_refused() {
        let e = dequantize(&[0u8; 6], &[1.0], 2, 3, 1, 3).unwrap_err();
        assert!(matches!(e, Fp8BlockError::ScaleLen { found: 1, .. }));
    }
}
