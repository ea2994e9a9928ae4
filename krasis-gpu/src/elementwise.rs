//! Glue ops between the large kernels: positions, residual adds, a projection's bias added to its
//! rows, strided row copies (with a cast to BF16 for the tensor-core kernels), an in-place
//! RMSNorm over a prefix of strided rows and rows scaled by a sigmoid gate of their input.

use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use crate::kernels::{cfg_rows, check, launch_err, to_i32, KernelSource, HEADERS};
use crate::{GpuDevice, GpuError};

pub const ELEMENTWISE: KernelSource = KernelSource {
    name: "elementwise",
    src: include_str!("../kernels/elementwise.cu"),
    headers: HEADERS,
    options: &[],
    functions: &[
        "iota_i32",
        "remap_ids_i32",
        "add_inplace_f32",
        "add_bias_rows_f32",
        "copy_rows_f32",
        "copy_rows_f32_bf16",
        "rmsnorm_strided_inplace",
        "sigmoid_gate_rows_f32",
    ],
};

/// Threads per block of the 1-D kernels.
const BLOCK_1D: u32 = 256;

fn cfg_1d(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(BLOCK_1D as usize) as u32, 1, 1),
        block_dim: (BLOCK_1D, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Rows of a strided f32 matrix: `rows` rows of `cols` elements, row `r` starting at
/// `offset + r * stride` (elements).
#[derive(Clone, Copy, Debug)]
pub struct RowsView {
    pub rows: usize,
    pub cols: usize,
    pub stride: usize,
    pub offset: usize,
}

impl RowsView {
    pub fn contiguous(rows: usize, cols: usize) -> Self {
        RowsView { rows, cols, stride: cols, offset: 0 }
    }

    fn extent(&self) -> usize {
        if self.rows == 0 || self.cols == 0 {
            0
        } else {
            self.offset + (self.rows - 1) * self.stride + self.cols
        }
    }
}

impl GpuDevice {
    /// Device-to-device copy of `src` into the start of `dst`, on the compute stream (no host wait).
    pub fn copy_device<T: cudarc::driver::DeviceRepr>(
        &self,
        src: &impl DevicePtr<T>,
        dst: &mut impl DevicePtrMut<T>,
    ) -> Result<(), GpuError> {
        check("copy_device", src.len() <= dst.len(), || format!("{} elements into {}", src.len(), dst.len()))?;
        if src.len() == 0 {
            return Ok(());
        }
        let bytes = src.len() * std::mem::size_of::<T>();
        let s = self.stream();
        let (sp, _g1) = src.device_ptr(s);
        let (dp, _g2) = dst.device_ptr_mut(s);
        // SAFETY: both ranges lie inside their buffers (checked), on the same stream.
        unsafe { cudarc::driver::result::memcpy_dtod_async(dp, sp, bytes, s.cu_stream()) }
            .map_err(|e| GpuError::Driver { op: "cuMemcpyDtoDAsync", detail: e.to_string() })?;
        Ok(())
    }

    /// The first `n` elements of mapped host memory `src` into the start of `dst`, on the compute
    /// stream (ordered after the kernels that wrote `src` there; no host wait).
    pub fn copy_from_mapped<T: cudarc::driver::DeviceRepr>(
        &self,
        src: &crate::MappedHost<T>,
        n: usize,
        dst: &mut impl DevicePtrMut<T>,
    ) -> Result<(), GpuError> {
        check("copy_from_mapped", n <= src.len() && n <= dst.len(), || {
            format!("{n} elements from {} into {}", src.len(), dst.len())
        })?;
        if n == 0 {
            return Ok(());
        }
        let s = self.stream();
        let (dp, _g) = dst.device_ptr_mut(s);
        // SAFETY: both ranges lie inside their allocations (checked); the mapped memory has a
        // device address in this context.
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(dp, src.device_ptr(), n * std::mem::size_of::<T>(), s.cu_stream())
        }
        .map_err(|e| GpuError::Driver { op: "cuMemcpyDtoDAsync", detail: e.to_string() })?;
        Ok(())
    }

    /// `out[i] = start + i` (positions for RoPE without a host→device copy).
    pub fn iota_i32(&self, out: &mut impl DevicePtrMut<i32>, start: usize, n: usize) -> Result<(), GpuError> {
        const OP: &str = "iota";
        check(OP, n <= out.len(), || format!("{n} values into {} elements", out.len()))?;
        if n == 0 {
            return Ok(());
        }
        let (st, n_i) = (to_i32(OP, "start", start + n)?, to_i32(OP, "n", n)?);
        let st = st - n_i;
        let s = self.stream();
        let (o, _g) = out.device_ptr_mut(s);
        let f = self.function(&ELEMENTWISE, "iota_i32")?;
        let mut b = s.launch_builder(&f);
        b.arg(&o).arg(&st).arg(&n_i);
        // SAFETY: matches the kernel's signature; length checked.
        unsafe { b.launch(cfg_1d(n)) }.map_err(launch_err(OP))?;
        Ok(())
    }

    /// In place over the first `n` ids: `ids[i] = map[ids[i]]` where `ids[i]` is in
    /// `[0, map.len())`; other values stay as they are.
    pub fn remap_ids_i32(
        &self,
        ids: &mut impl DevicePtrMut<i32>,
        map: &impl DevicePtr<i32>,
        n: usize,
    ) -> Result<(), GpuError> {
        const OP: &str = "remap_ids";
        check(OP, n <= ids.len(), || format!("{n} ids; the buffer has {}", ids.len()))?;
        if n == 0 {
            return Ok(());
        }
        let (n_i, m_i) = (to_i32(OP, "ids", n)?, to_i32(OP, "map entries", map.len())?);
        let s = self.stream();
        let (ip, _g1) = ids.device_ptr_mut(s);
        let (mp, _g2) = map.device_ptr(s);
        let f = self.function(&ELEMENTWISE, "remap_ids_i32")?;
        let mut b = s.launch_builder(&f);
        b.arg(&ip).arg(&mp).arg(&m_i).arg(&n_i);
        // SAFETY: matches the kernel's signature; lengths checked.
        unsafe { b.launch(cfg_1d(n)) }.map_err(launch_err(OP))?;
        Ok(())
    }

    /// `y += x` over the first `n` elements.
    pub fn add_inplace_f32(
        &self,
        y: &mut impl DevicePtrMut<f32>,
        x: &impl DevicePtr<f32>,
        n: usize,
    ) -> Result<(), GpuError> {
        const OP: &str = "add_inplace";
        check(OP, n <= y.len() && n <= x.len(), || format!("{n} elements; y has {}, x {}", y.len(), x.len()))?;
        if n == 0 {
            return Ok(());
        }
        let n_i = n as i64;
        let s = self.stream();
        let (yp, _g1) = y.device_ptr_mut(s);
        let (xp, _g2) = x.device_ptr(s);
        let f = self.function(&ELEMENTWISE, "add_inplace_f32")?;
        let mut b = s.launch_builder(&f);
        b.arg(&yp).arg(&xp).arg(&n_i);
        // SAFETY: matches the kernel's signature; lengths checked.
        unsafe { b.launch(cfg_1d(n)) }.map_err(launch_err(OP))?;
        Ok(())
    }

    /// A projection's bias after its product: `y[r, j] += bias[j]` for the first `rows` rows of
    /// `y` (`[rows, bias.len()]` f32, contiguous) and a BF16 `bias`; each sum is one f32 add, as
    /// `krasis_cpu::linear::add_bias_rows` does.
    pub fn add_bias_rows_f32(
        &self,
        y: &mut impl DevicePtrMut<f32>,
        rows: usize,
        bias: &impl DevicePtr<u16>,
    ) -> Result<(), GpuError> {
        const OP: &str = "add_bias_rows";
        let cols = bias.len();
        let n = rows * cols;
        check(OP, n <= y.len(), || format!("{rows} rows of {cols} into {} elements", y.len()))?;
        if n == 0 {
            return Ok(());
        }
        let (r_i, c_i) = (n as i64 / cols as i64, to_i32(OP, "cols", cols)?);
        let s = self.stream();
        let (yp, _g1) = y.device_ptr_mut(s);
        let (bp, _g2) = bias.device_ptr(s);
        let f = self.function(&ELEMENTWISE, "add_bias_rows_f32")?;
        let mut b = s.launch_builder(&f);
        b.arg(&yp).arg(&bp).arg(&r_i).arg(&c_i);
        // SAFETY: matches the kernel's signature; `rows · cols` lies inside `y`, `cols` is the
        // bias's length.
        unsafe { b.launch(cfg_1d(n)) }.map_err(launch_err(OP))?;
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn copy_rows_launch(
        &self,
        fname: &'static str,
        elem: usize,
        src: &impl DevicePtr<f32>,
        from: RowsView,
        dst_p: u64,
        dst_len: usize,
        to: RowsView,
    ) -> Result<(), GpuError> {
        const OP: &str = "copy_rows";
        check(OP, from.rows == to.rows && from.cols == to.cols, || format!("{from:?} into {to:?}"))?;
        check(OP, from.extent() <= src.len(), || format!("{from:?} past the source's {} elements", src.len()))?;
        check(OP, to.extent() <= dst_len, || format!("{to:?} past the destination's {dst_len} elements"))?;
        if from.rows == 0 || from.cols == 0 {
            return Ok(());
        }
        let (r_i, c_i) = (to_i32(OP, "rows", from.rows)?, to_i32(OP, "cols", from.cols)?);
        check(OP, from.rows <= 65_535, || format!("{} rows exceed the grid's y limit", from.rows))?;
        let (ss, ds) = (from.stride as i64, to.stride as i64);
        let s = self.stream();
        let (sp, _g) = src.device_ptr(s);
        let sp = sp + (from.offset * 4) as u64;
        let dp = dst_p + (to.offset * elem) as u64;
        let f = self.function(&ELEMENTWISE, fname)?;
        let mut b = s.launch_builder(&f);
        b.arg(&sp).arg(&ss).arg(&dp).arg(&ds).arg(&r_i).arg(&c_i);
        let gx = from.cols.div_ceil(BLOCK_1D as usize).min(64) as u32;
        let cfg =
            LaunchConfig { grid_dim: (gx, from.rows as u32, 1), block_dim: (BLOCK_1D, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: matches the kernel's signature; extents checked.
        unsafe { b.launch(cfg) }.map_err(launch_err(OP))?;
        Ok(())
    }

    /// Copies the rows `from` of `src` into the rows `to` of `dst` (same rows × cols).
    pub fn copy_rows_f32(
        &self,
        src: &impl DevicePtr<f32>,
        from: RowsView,
        dst: &mut impl DevicePtrMut<f32>,
        to: RowsView,
    ) -> Result<(), GpuError> {
        let len = dst.len();
        let (dp, _g) = dst.device_ptr_mut(self.stream());
        self.copy_rows_launch("copy_rows_f32", 4, src, from, dp, len, to)
    }

    /// [`GpuDevice::copy_rows_f32`] rounding to BF16 (nearest even).
    pub fn copy_rows_to_bf16(
        &self,
        src: &impl DevicePtr<f32>,
        from: RowsView,
        dst: &mut impl DevicePtrMut<u16>,
        to: RowsView,
    ) -> Result<(), GpuError> {
        let len = dst.len();
        let (dp, _g) = dst.device_ptr_mut(self.stream());
        self.copy_rows_launch("copy_rows_f32_bf16", 2, src, from, dp, len, to)
    }

    /// In place, for each row of `rows`: `x = x / sqrt(mean(x²) + eps) · w` (`w` BF16, `cols` long).
    pub fn rmsnorm_rows_inplace(
        &self,
        x: &mut impl DevicePtrMut<f32>,
        rows: RowsView,
        w: &impl DevicePtr<u16>,
        eps: f32,
    ) -> Result<(), GpuError> {
        const OP: &str = "rmsnorm_strided";
        check(OP, rows.extent() <= x.len(), || format!("{rows:?} past the buffer's {} elements", x.len()))?;
        check(OP, w.len() == rows.cols, || format!("weight has {} elements, rows {}", w.len(), rows.cols))?;
        if rows.rows == 0 || rows.cols == 0 {
            return Ok(());
        }
        let (r_i, n_i) = (to_i32(OP, "rows", rows.rows)?, to_i32(OP, "cols", rows.cols)?);
        let st = rows.stride as i64;
        let s = self.stream();
        let (xp, _g1) = x.device_ptr_mut(s);
        let xp = xp + (rows.offset * 4) as u64;
        let (wp, _g2) = w.device_ptr(s);
        let f = self.function(&ELEMENTWISE, "rmsnorm_strided_inplace")?;
        let mut b = s.launch_builder(&f);
        b.arg(&xp).arg(&st).arg(&wp).arg(&r_i).arg(&n_i).arg(&eps);
        // SAFETY: matches the kernel's signature; extents checked.
        unsafe { b.launch(cfg_rows(rows.rows)) }.map_err(launch_err(OP))?;
        Ok(())
    }

    /// A one-logit sigmoid gate per row, in place: `y[r, ..] *= σ(x[r, ..] · w)` for the first
    /// `rows` rows of `y` (`[rows, y_cols]` f32, contiguous) and of `x` (`[rows, w.len()]` f32,
    /// contiguous) and a BF16 gate `w`, the dot product in f32: a shared expert's
    /// `shared_expert_gate` (Qwen2-MoE, Qwen3-Next).
    pub fn sigmoid_gate_rows_f32(
        &self,
        y: &mut impl DevicePtrMut<f32>,
        y_cols: usize,
        x: &impl DevicePtr<f32>,
        w: &impl DevicePtr<u16>,
        rows: usize,
    ) -> Result<(), GpuError> {
        const OP: &str = "sigmoid_gate_rows";
        let n_in = w.len();
        check(OP, rows * y_cols <= y.len(), || format!("{rows} rows of {y_cols} into {} elements", y.len()))?;
        check(OP, rows * n_in <= x.len(), || format!("{rows} input rows of {n_in} from {} elements", x.len()))?;
        if rows == 0 || y_cols == 0 {
            return Ok(());
        }
        let (r_i, i_i, o_i) = (to_i32(OP, "rows", rows)?, to_i32(OP, "input cols", n_in)?, to_i32(OP, "cols", y_cols)?);
        let s = self.stream();
        let (yp, _g1) = y.device_ptr_mut(s);
        let (xp, _g2) = x.device_ptr(s);
        let (wp, _g3) = w.device_ptr(s);
        let f = self.function(&ELEMENTWISE, "sigmoid_gate_rows_f32")?;
        let mut b = s.launch_builder(&f);
        b.arg(&yp).arg(&xp).arg(&wp).arg(&r_i).arg(&i_i).arg(&o_i);
        // SAFETY: matches the kernel's signature; `rows` rows of each lie inside `y` and `x`
        // (checked), `n_in` is the gate's length.
        unsafe { b.launch(cfg_rows(rows)) }.map_err(launch_err(OP))?;
        Ok(())
    }
}
