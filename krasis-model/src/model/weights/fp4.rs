//! ModelOpt NVFP4 linears (`SourceQuant::ModelOptNvfp4`), OpenAI MXFP4 linears
//! (`SourceQuant::Mxfp4`: `P.weight_blocks` / `P.weight_scales` in place of `P.weight`, which
//! the stored-layout adapter serves per expert from gpt-oss's fused tensors) and a GGUF's MXFP4
//! tensors (ggml type 39, per expert from the stacked tensors): read as stored
//! ([`WeightLoader::stored_fp4`], for the expert caches that keep them) or dequantised exactly
//! (through [`WeightLoader::matrix`]: every FP4 linear, experts or not).

use krasis_core::DType;
use krasis_quant::fp4::Fp4Matrix;
use krasis_quant::ggml::GgmlType;

use super::WeightLoader;
use crate::error::{ModelError, Result};
use crate::spec::SourceQuant;

impl WeightLoader<'_> {
    /// The NVFP4 linear stored for `name` (a `P.weight` of `[rows, cols]`) as its blocks, the
    /// bytes as stored: `P.weight` uint8 `[rows, cols/2]`, `P.weight_scale` float8_e4m3fn
    /// `[rows, cols/16]`, `P.weight_scale_2` f32 (a scalar; `P.input_scale` is not read). `None`
    /// when the source is not NVFP4 or `name` is stored as plain floats (the linears ModelOpt
    /// left out). A scale tensor whose shape disagrees with the weight's, or a NaN scale, is an
    /// error naming the tensor.
    pub fn stored_fp4(&self, name: &str, rows: usize, cols: usize) -> Result<Option<Fp4Matrix>> {
        // A GGUF's MXFP4 tensor (type 39; gpt-oss's experts, as llama.cpp's converter copies them).
        if let Some((ty, bytes)) = self.source.ggml_blocks(name)? {
            if ty != GgmlType::Mxfp4 {
                return Ok(None);
            }
            return Fp4Matrix::from_ggml_mxfp4(bytes.as_slice(), rows, cols).map(Some).map_err(|e| {
                ModelError::Invalid(format!("MXFP4 tensor `{name}` in {}: {e}", self.source.location().display()))
            });
        }
        if *self.quant == SourceQuant::Mxfp4 {
            return self.stored_mxfp4(name, rows, cols);
        }
        if *self.quant != SourceQuant::ModelOptNvfp4 || !self.source.contains(name) {
            return Ok(None);
        }
        let t = self.source.tensor(name)?;
        if t.dtype != DType::U8 {
            return Ok(None);
        }
        let base = name.strip_suffix(".weight").ok_or_else(|| {
            ModelError::Invalid(format!(
                "tensor `{name}` in {}: a uint8 (NVFP4) tensor that is not a `.weight`",
                t.file.display()
            ))
        })?;
        if !cols.is_multiple_of(32) {
            return Err(ModelError::Invalid(format!(
                "tensor `{name}` in {}: NVFP4 with {cols} inputs; Krasis' FP4 layout needs a multiple of 32",
                t.file.display()
            )));
        }
        let w = self.checked(name, &[rows, cols / 2], &[DType::U8])?;
        let s = self.checked(&format!("{base}.weight_scale"), &[rows, cols / 16], &[DType::F8E4M3])?;
        let g_name = format!("{base}.weight_scale_2");
        let g = self.source.tensor(&g_name)?;
        if g.dtype != DType::F32 || g.shape.iter().product::<usize>() != 1 || g.shape.len() > 1 {
            return Err(ModelError::Invalid(format!(
                "tensor `{g_name}` in {}: expected one float32 (a scalar), found {} {:?}",
                g.file.display(),
                g.dtype,
                g.shape
            )));
        }
        let global = f32::from_le_bytes(g.bytes.as_slice()[..4].try_into().expect("4 bytes"));
        Fp4Matrix::from_modelopt_nvfp4(w.bytes.as_slice(), s.bytes.as_slice(), global, rows, cols)
            .map(Some)
            .map_err(|e| ModelError::Invalid(format!("NVFP4 linear `{base}` in {}: {e}", w.file.display())))
    }

    /// The MXFP4 linear stored for `name` (a `P.weight` of `[rows, cols]`) as `P.weight_blocks`
    /// uint8 `[rows, cols/32, 16]` and `P.weight_scales` uint8 E8M0 `[rows, cols/32]`, the bytes
    /// as stored; `None` when `name` is stored as plain floats. A shape that disagrees, or a NaN
    /// scale, is an error naming the tensor.
    fn stored_mxfp4(&self, name: &str, rows: usize, cols: usize) -> Result<Option<Fp4Matrix>> {
        let Some(base) = name.strip_suffix(".weight") else { return Ok(None) };
        let blocks_name = format!("{base}.weight_blocks");
        if self.source.contains(name) || !self.source.contains(&blocks_name) {
            return Ok(None);
        }
        if !cols.is_multiple_of(32) {
            return Err(ModelError::Invalid(format!(
                "tensor `{blocks_name}`: MXFP4 with {cols} inputs, which must be a multiple of 32"
            )));
        }
        let b = self.checked(&blocks_name, &[rows, cols / 32, 16], &[DType::U8])?;
        let s = self.checked(&format!("{base}.weight_scales"), &[rows, cols / 32], &[DType::U8])?;
        Fp4Matrix::from_openai_mxfp4(b.bytes.as_slice(), s.bytes.as_slice(), rows, cols)
            .map(Some)
            .map_err(|e| ModelError::Invalid(format!("MXFP4 linear `{base}` in {}: {e}", b.file.display())))
    }
}
