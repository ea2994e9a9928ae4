//! Borrowed, typed views of tensor bytes (usually straight out of an mmap).

use crate::dtype::{extend_f32_from_bytes, DType};

/// A view of one stored tensor: element type, shape, raw little-endian bytes.
#[derive(Clone, Copy, Debug)]
pub struct TensorView<'a> {
    pub dtype: DType,
    pub shape: &'a [usize],
    pub bytes: &'a [u8],
}

impl<'a> TensorView<'a> {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// All elements as f32 (exact for F32/BF16/F16/FP8). `None` for integer dtypes.
    pub fn to_f32_vec(&self) -> Option<Vec<f32>> {
        let mut out = Vec::with_capacity(self.numel());
        extend_f32_from_bytes(self.dtype, self.bytes, &mut out).then_some(out)
    }
}
