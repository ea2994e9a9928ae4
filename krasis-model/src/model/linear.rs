//! The seam between model code and weight formats: layer math calls [`LinearOp`] and never
//! names a dtype, block format or instruction set.

use krasis_core::DType;
use krasis_cpu::isa::Isa;
use krasis_cpu::linear::{linear, WeightRows};
use krasis_cpu::moe::PoolMatmul;
use krasis_cpu::pool::WorkerPool;
use krasis_quant::cpu_layout::PackedLayout;

use crate::source::SharedBytes;

/// `y[m, out] = x[m, in] · Wᵀ`.
pub trait LinearOp: Send + Sync {
    fn in_dim(&self) -> usize;
    fn out_dim(&self) -> usize;
    fn forward(&self, x: &[f32], m: usize, y: &mut [f32]);
    /// Bytes of weight this op reads per call.
    fn weight_bytes(&self) -> usize;
    /// A quantised op's packed weights and how it runs them, for fused dispatches that read
    /// them directly (`None`: not packed).
    fn packed(&self) -> Option<PackedRef<'_>> {
        None
    }
}

/// A packed linear's weights, layout, pool and runner ([`LinearOp::packed`]).
pub struct PackedRef<'a> {
    pub bytes: &'a [u8],
    pub layout: &'a PackedLayout,
    pub pool: &'a WorkerPool,
    pub matmul: &'a PoolMatmul,
    pub isa: Isa,
}

/// `ys[j] = ops[j](x)` for linears of one input: one pool dispatch with the activations quantised
/// once when all are packed alike on one pool (same K and group size), else one call each.
pub fn forward_shared_input(ops: &[&dyn LinearOp], x: &[f32], m: usize, ys: &mut [&mut [f32]]) {
    let packed: Option<Vec<PackedRef<'_>>> = ops.iter().map(|o| o.packed()).collect();
    if let Some(p) = packed.filter(|p| {
        p.iter().all(|r| {
            std::ptr::eq(r.pool, p[0].pool)
                && r.isa == p[0].isa
                && r.layout.k == p[0].layout.k
                && r.layout.gs == p[0].layout.gs
        })
    }) {
        let mats: Vec<(&[u8], &PackedLayout)> = p.iter().map(|r| (r.bytes, r.layout)).collect();
        return p[0].matmul.run_many(p[0].pool, p[0].isa, &mats, x, m, ys);
    }
    for (op, y) in ops.iter().zip(ys.iter_mut()) {
        op.forward(x, m, y);
    }
}

/// Weights as stored (zero-copy from the mapping, or copied as stored:
/// [`DenseLinear::resident`]) or dequantised into f32.
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

    /// Row `r` as f32.
    pub fn row_into(&self, r: usize, out: &mut [f32]) {
        self.weights().row_into(r, self.cols, out);
    }

    /// Row `r` as f32, as [`DenseLinear::row_into`], for reads of a few rows at a time (the
    /// embedding's, a row per token): mapped weights are read from their file
    /// ([`SharedBytes::read_at`]), not through the mapping, so the rows read leave no pages
    /// resident. `scratch` holds the row's stored bytes between calls.
    pub fn gather_row(&self, r: usize, out: &mut [f32], scratch: &mut Vec<f32>) {
        let MatrixData::Mapped { bytes, dtype } = &self.data else {
            return self.row_into(r, out);
        };
        if !bytes.is_mapped() {
            return self.row_into(r, out);
        }
        let row_bytes = self.cols * dtype.size_bytes();
        scratch.resize(row_bytes.div_ceil(4), 0.0);
        let raw = &mut bytemuck::cast_slice_mut::<f32, u8>(scratch)[..row_bytes];
        bytes.read_at(r * row_bytes, raw);
        let row = match dtype {
            DType::F32 => WeightRows::F32(bytemuck::cast_slice(raw)),
            DType::BF16 => WeightRows::Bf16(bytemuck::cast_slice(raw)),
            DType::F16 => WeightRows::F16(bytemuck::cast_slice(raw)),
            other => unreachable!("DenseLinear over {other}: the loader converts these"),
        };
        row.row_into(0, self.cols, out);
    }

    /// The same matrix with its weights in memory of their own rather than in the file mapping
    /// ([`SharedBytes::copied`]): for small matrices read whole at every token (routers), so that
    /// reading them brings no page-cache folio of the file into the resident set.
    pub fn resident(self) -> DenseLinear {
        let data = match self.data {
            MatrixData::Mapped { bytes, dtype } => MatrixData::Mapped { bytes: bytes.copied(), dtype },
            owned => owned,
        };
        DenseLinear { data, ..self }
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
