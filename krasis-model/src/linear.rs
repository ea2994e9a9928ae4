//! The seam between model code and weight formats: layer math calls [`LinearOp`] and never
//! names a dtype, block format or instruction set.

use krasis_core::DType;
use krasis_cpu::linear::{linear, WeightRows};

use crate::source::SharedBytes;

/// `y[m, out] = x[m, in] · Wᵀ`.
pub trait LinearOp: Send + Sync {
    fn in_dim(&self) -> usize;
    fn out_dim(&self) -> usize;
    fn forward(&self, x: &[f32], m: usize, y: &mut [f32]);
    /// Bytes of weight this op reads per call.
    fn weight_bytes(&self) -> usize;
}

/// Weights as stored (zero-copy from the mapping) or dequantised into f32.
pub enum MatrixData {
    Mapped { bytes: SharedBytes, dtype: DType },
    Owned(Vec<f32>),
}

/// The reference linear: f32 math on unquantised weights.
pub struct DenseLinear {
    rows: usize,
    cols: usize,
    data: MatrixData,
}

impl DenseLinear {
    /// `data` must hold `rows × cols` elements; mapped data must be F32/BF16/F16 and aligned
    /// (the loader guarantees both).
    pub fn new(rows: usize, cols: usize, data: MatrixData) -> Self {
        let d = DenseLinear { rows, cols, data };
        assert_eq!(d.weights().len(), rows * cols, "DenseLinear: element count");
        d
    }

    pub fn weights(&self) -> WeightRows<'_> {
        match &self.data {
            MatrixData::Owned(v) => WeightRows::F32(v),
            MatrixData::Mapped { bytes, dtype } => {
                let b = bytes.as_slice();
                match dtype {
                    DType::F32 => WeightRows::F32(bytemuck::cast_slice(b)),
                    DType::BF16 => WeightRows::Bf16(bytemuck::cast_slice(b)),
                    DType::F16 => WeightRows::F16(bytemuck::cast_slice(b)),
                    other => unreachable!("DenseLinear over {other}: the loader converts these"),
                }
            }
        }
    }

    /// Row `r` as f32 (embedding gather).
    pub fn row_into(&self, r: usize, out: &mut [f32]) {
        self.weights().row_into(r, self.cols, out);
    }
}

impl LinearOp for DenseLinear {
    fn in_dim(&self) -> usize {
        self.cols
    }

    fn out_dim(&self) -> usize {
        self.rows
    }

    fn forward(&self, x: &[f32], m: usize, y: &mut [f32]) {
        linear(x, m, self.cols, self.weights(), self.rows, y);
    }

    fn weight_bytes(&self) -> usize {
        match &self.data {
            MatrixData::Owned(v) => v.len() * 4,
            MatrixData::Mapped { bytes, .. } => bytes.as_slice().len(),
        }
    }
}
