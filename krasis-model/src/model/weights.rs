//! Typed weight loading on top of a [`WeightSource`]: shape and dtype validation against the
//! tensor inventory, FP8 block dequantisation, compressed-tensors INT4 (read exactly: as f32
//! values, or as the stored codes and scales, see [`WeightLoader::stored_int4`]), zero-copy
//! handles where the bytes allow it.

use half::f16;
use krasis_core::DType;
use krasis_quant::{Bits, QuantizedMatrix};

use crate::error::{ModelError, Result};
use crate::model::linear::{DenseLinear, MatrixData};
use crate::model::tensors::{TensorRole, TensorSpec};
use crate::source::{StoredTensor, WeightSource};
use crate::spec::SourceQuant;

mod fp4;

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

    /// A small tensor of the inventory as f32, flattened (norm weights, biases, DeltaNet's
    /// convolution taps). A zero-centred norm ([`TensorRole::CentredNorm`]) comes back as the
    /// `1 + w` it scales by.
    pub fn vector_of(&self, t: &TensorSpec) -> Result<Vec<f32>> {
        let stored = self.checked(&t.name, &t.shape, FLOATS)?;
        let mut v = stored.view().to_f32_vec().expect("float dtype converts");
        if t.role == TensorRole::CentredNorm {
            v.iter_mut().for_each(|x| *x += 1.0);
        }
        Ok(v)
    }

    /// A 1-D or small tensor as f32 (norm weights, biases).
    pub fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        let t = self.checked(name, &[len], FLOATS)?;
        Ok(t.view().to_f32_vec().expect("float dtype converts"))
    }

    /// A `[rows, cols]` matrix as a reference linear op. A compressed-tensors INT4 linear (its
    /// `weight_packed` stored in place of `name`) is dequantised exactly to f32.
    pub fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<DenseLinear> {
        if let Some(m) = self.stored_fp4(name, rows, cols)? {
            // NVFP4: exact up to one f32 rounding of the product with the global scale.
            return Ok(DenseLinear::new(rows, cols, MatrixData::Owned(m.dequantize())));
        }
        if let Some(base) = self.packed_base(name) {
            let values = self.int4_dequantized(base, rows, cols)?;
            return Ok(DenseLinear::new(rows, cols, MatrixData::Owned(values)));
        }
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

    /// The module prefix `P` of `name` = `P.weight` when the source is compressed-tensors INT4
    /// and stores `P.weight_packed` instead of `name` (`None`: a plain tensor, or no such source).
    fn packed_base<'n>(&self, name: &'n str) -> Option<&'n str> {
        self.quant.stored_int4_group()?;
        let base = name.strip_suffix(".weight")?;
        (!self.source.contains(name) && self.source.contains(&format!("{base}.weight_packed"))).then_some(base)
    }

    /// Whether `name` (a `P.weight`) is stored as compressed-tensors INT4 (`P.weight_packed`).
    pub fn is_stored_int4(&self, name: &str) -> bool {
        self.packed_base(name).is_some()
    }

    /// The codes `q` in `[-8, 7]` (`[rows, cols]`, row-major) and the scales as stored (`[rows,
    /// cols / group]`, with their tensor) of the compressed-tensors linear `base`, after checking
    /// `weight_packed`, `weight_scale` and `weight_shape` against `[rows, cols]`.
    fn int4_parts(&self, base: &str, rows: usize, cols: usize) -> Result<(Vec<i8>, StoredTensor, usize)> {
        let gs = self.quant.stored_int4_group().expect("called on a compressed-tensors source");
        let packed_name = format!("{base}.weight_packed");
        let shape_name = format!("{base}.weight_shape");
        let st = self.checked(&shape_name, &[2], &[DType::I64, DType::I32])?;
        let stored_shape: Vec<i64> = match st.dtype {
            DType::I64 => {
                st.bytes.as_slice().chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect()
            }
            _ => {
                st.bytes.as_slice().chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().unwrap()) as i64).collect()
            }
        };
        if stored_shape != [rows as i64, cols as i64] {
            return Err(ModelError::Invalid(format!(
                "tensor `{shape_name}` in {} says {stored_shape:?}, the model needs [{rows}, {cols}]",
                st.file.display()
            )));
        }
        if !cols.is_multiple_of(gs) || !cols.is_multiple_of(8) {
            return Err(ModelError::Invalid(format!(
                "tensor `{packed_name}` in {}: {cols} inputs are not a whole number of groups of {gs} \
                 (quantization_config.config_groups.*.weights.group_size)",
                st.file.display()
            )));
        }
        let pt = self.checked(&packed_name, &[rows, cols / 8], &[DType::I32])?;
        let scale_name = format!("{base}.weight_scale");
        let sc = self.checked(&scale_name, &[rows, cols / gs], FLOATS)?;
        let mut q = Vec::with_capacity(rows * cols);
        for word in pt.bytes.as_slice().chunks_exact(4) {
            let w = u32::from_le_bytes(word.try_into().unwrap());
            q.extend((0..8).map(|n| ((w >> (4 * n)) & 0xf) as i8 - 8));
        }
        Ok((q, sc, gs))
    }

    /// `[rows, cols]` f32 values `q · scale` of the compressed-tensors linear `base`: exact for
    /// BF16 and F16 scales (a 4-bit integer times an 8- or 11-bit significand), one f32 rounding
    /// for F32 scales.
    fn int4_dequantized(&self, base: &str, rows: usize, cols: usize) -> Result<Vec<f32>> {
        let (q, sc, gs) = self.int4_parts(base, rows, cols)?;
        let scales = sc.view().to_f32_vec().expect("float dtype converts");
        let ng = cols / gs;
        Ok(q.iter().enumerate().map(|(e, &v)| v as f32 * scales[(e / cols) * ng + (e % cols) / gs]).collect())
    }

    /// The compressed-tensors INT4 linear stored for `name` (a `P.weight`) as Krasis' own INT4
    /// groups, exactly: the stored codes (`q` in `[-8, 7]`; -8 occurs, compressed-tensors'
    /// minmax observer uses it) and the stored scales converted to f16, the scale type of
    /// Krasis' packed layouts. `None` when `name` is not stored that way.
    ///
    /// A BF16 scale converts to f16 exactly when it lies in f16's range with its 8 significant
    /// bits (about 7.6e-6 to 65504, or 0). A scale outside that is an error naming the tensor and
    /// the value, never a rounding; such weights still run from their exact f32 values with the
    /// `bf16` expert width (the reference experts), or requantised with `8`.
    pub fn stored_int4(&self, name: &str, rows: usize, cols: usize) -> Result<Option<QuantizedMatrix>> {
        let Some(base) = self.packed_base(name) else { return Ok(None) };
        let (q, sc, gs) = self.int4_parts(base, rows, cols)?;
        let values = sc.view().to_f32_vec().expect("float dtype converts");
        let mut scales = Vec::with_capacity(values.len());
        for (i, &v) in values.iter().enumerate() {
            let h = f16::from_f32(v);
            if h.to_f32() != v || v.is_nan() {
                return Err(ModelError::Invalid(format!(
                    "tensor `{base}.weight_scale` in {}: scale {v:e} at [{}, {}] is not exactly representable as \
                     f16, the scale type of Krasis' INT4 groups; keeping the stored INT4 would round it. Run these \
                     experts from their exact values (expert width bf16) or requantised (expert width 8)",
                    sc.file.display(),
                    i / (cols / gs),
                    i % (cols / gs),
                )));
            }
            scales.push(h);
        }
        Ok(Some(QuantizedMatrix { rows, k: cols, gs, bits: Bits::Int4, q, scales }))
    }
}
