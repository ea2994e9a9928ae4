//! Typed weight loading on top of a [`WeightSource`]: shape and dtype validation against the
//! tensor inventory, FP8 block dequantisation, zero-copy handles where the bytes allow it.

use krasis_core::DType;

use crate::error::{ModelError, Result};
use crate::model::linear::{DenseLinear, MatrixData};
use crate::model::tensors::TensorSpec;
use crate::source::{StoredTensor, WeightSource};
use crate::spec::SourceQuant;

const FLOATS: &[DType] = &[DType::F32, DType::BF16, DType::F16];
const MATRIX_DTYPES: &[DType] = &[DType::F32, DType::BF16, DType::F16, DType::F8E4M3];

pub struct WeightLoader<'a> {
    pub source: &'a dyn WeightSource,
    pub quant: &'a SourceQuant,
}

impl<'a> WeightLoader<'a> {
    pub fn new(source: &'a dyn WeightSource, quant: &'a SourceQuant) -> Self {
        WeightLoader { source, quant }
    }

    /// The tensor, after checking its dtype is one of `dtypes` and its shape is `shape`.
    fn checked(&self, name: &str, shape: &[usize], dtypes: &[DType]) -> Result<StoredTensor> {
        let t = self.source.tensor(name)?;
        if !dtypes.contains(&t.dtype) {
            let allowed: Vec<String> = dtypes.iter().map(|d| d.to_string()).collect();
            return Err(Self::dtype_err(&t, name, &format!("expected one of {}", allowed.join(", "))));
        }
        if t.shape != shape {
            return Err(ModelError::Shape {
                name: name.into(),
                path: t.file.clone(),
                expected: shape.to_vec(),
                found: t.shape.clone(),
            });
        }
        Ok(t)
    }

    fn dtype_err(t: &StoredTensor, name: &str, msg: &str) -> ModelError {
        ModelError::DType { name: name.into(), path: t.file.clone(), found: t.dtype.to_string(), msg: msg.into() }
    }

    /// A tensor of the inventory as a reference linear op (its shape is `[rows, cols]`).
    pub fn matrix_of(&self, t: &TensorSpec) -> Result<DenseLinear> {
        self.matrix(&t.name, t.shape[0], t.shape[1])
    }

    /// A 1-D tensor of the inventory as f32.
    pub fn vector_of(&self, t: &TensorSpec) -> Result<Vec<f32>> {
        self.vector(&t.name, t.shape[0])
    }

    /// A 1-D or small tensor as f32 (norm weights, biases).
    pub fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        let t = self.checked(name, &[len], FLOATS)?;
        Ok(t.view().to_f32_vec().expect("float dtype converts"))
    }

    /// A `[rows, cols]` matrix as a reference linear op.
    pub fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<DenseLinear> {
        let t = self.checked(name, &[rows, cols], MATRIX_DTYPES)?;
        let data = match t.dtype {
            DType::F32 | DType::BF16 | DType::F16 => {
                let align = t.dtype.size_bytes();
                if (t.bytes.as_slice().as_ptr() as usize).is_multiple_of(align) {
                    MatrixData::Mapped { bytes: t.bytes.clone(), dtype: t.dtype }
                } else {
                    MatrixData::Owned(t.view().to_f32_vec().expect("float dtype converts"))
                }
            }
            DType::F8E4M3 => MatrixData::Owned(self.fp8_matrix(&t, name, rows, cols)?),
            _ => return Err(Self::dtype_err(&t, name, "expected a floating-point weight")),
        };
        Ok(DenseLinear::new(rows, cols, data))
    }

    fn fp8_matrix(&self, t: &StoredTensor, name: &str, rows: usize, cols: usize) -> Result<Vec<f32>> {
        let SourceQuant::Fp8Block { block_rows, block_cols } = *self.quant else {
            return Err(Self::dtype_err(
                t,
                name,
                "FP8 weights need quantization_config.quant_method = \"fp8\" in config.json",
            ));
        };
        let scale_name = format!("{}_scale_inv", name);
        let (gr, gc) = krasis_quant::fp8_block::scale_grid(rows, cols, block_rows, block_cols);
        let st = self.checked(&scale_name, &[gr, gc], FLOATS)?;
        let scales = st.view().to_f32_vec().expect("float dtype converts");
        krasis_quant::fp8_block::dequantize(t.bytes.as_slice(), &scales, rows, cols, block_rows, block_cols)
            .map_err(|e| ModelError::Invalid(format!("tensor `{name}` in {}: {e}", t.file.display())))
    }
}
