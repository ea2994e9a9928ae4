//! The GPU KV cache: per layer one (MLA: the latent ‖ rope-key row) or two (GQA: K and V) planes
//! of `row` elements per token, stored as BF16, as f32 (as written: the precise GPU mode's
//! cache, whose attention reads it in the prefill form only) or as FP8 E4M3 with one f32 scale per
//! `scale_group` consecutive elements of a row. All of it is one budget-charged allocation (two
//! for FP8: codes and scales), sized at creation.
//!
//! How many tokens are valid is the engine's session bookkeeping, not the cache's: the cache only
//! refuses writes and reads past its capacity.
//!
//! FP8 quantisation of a group `x`: `scale = amax(|x|) / 448` (f32), each element stored as the
//! E4M3 code nearest to `x / scale` (round to nearest even, saturating at ±448; NaN stays NaN);
//! a group whose scale is 0 (all zero, or amax so small that amax / 448 underflows) stores zero
//! codes. A stored element decodes as
//! `e4m3(code) · scale`, the code decoded exactly as [`krasis_core::dtype::fp8_e4m3_to_f32`].

use std::fmt;
use std::str::FromStr;

use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use crate::device::kernel_args;
use crate::kernels::{KernelSource, HEADERS};
use crate::{DeviceBuffer, GpuDevice, GpuError, VramBudget};

pub const KV_CACHE: KernelSource = KernelSource {
    name: "kv_cache",
    src: include_str!("../kernels/kv_cache.cu"),
    headers: HEADERS,
    options: &[],
    functions: &[
        "kv_write_bf16",
        "kv_write_f32",
        "kv_write_fp8",
        "kv_read_bf16_f32",
        "kv_read_bf16_bf16",
        "kv_read_f32_f32",
        "kv_read_f32_bf16",
        "kv_read_fp8_f32",
        "kv_read_fp8_bf16",
    ],
};

/// Threads per block of the write/read kernels (one block per row; rows are ≤ a few thousand
/// elements, so 256 threads cover one in a few strides).
const ROW_THREADS: u32 = 256;

/// Largest finite E4M3 value (a group's amax maps onto it), and the host twin of the kernels'
/// f32 → E4M3 conversion: both live beside the E4M3 decoder in `krasis_core::dtype`.
pub use krasis_core::dtype::{f32_to_fp8_e4m3, FP8_E4M3_MAX};

/// Storage type of the KV cache (`--kv-dtype bf16|fp8|f32`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvDtype {
    Bf16,
    /// The rows as written (the precise GPU mode's cache: the decode attention kernels read BF16
    /// and FP8 only, so attention over it runs in the prefill form).
    F32,
    /// FP8 E4M3 with one f32 scale per group of elements.
    Fp8,
}

impl KvDtype {
    /// Bytes per stored element.
    pub fn elem_bytes(self) -> usize {
        match self {
            KvDtype::Bf16 => 2,
            KvDtype::F32 => 4,
            KvDtype::Fp8 => 1,
        }
    }
}

impl fmt::Display for KvDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            KvDtype::Bf16 => "bf16",
            KvDtype::F32 => "f32",
            KvDtype::Fp8 => "fp8",
        })
    }
}

impl FromStr for KvDtype {
    type Err = GpuError;

    fn from_str(s: &str) -> Result<Self, GpuError> {
        match s.trim().to_ascii_lowercase().as_str() {
            "bf16" => Ok(KvDtype::Bf16),
            "fp8" => Ok(KvDtype::Fp8),
            "f32" => Ok(KvDtype::F32),
            _ => Err(GpuError::shape("kv dtype", format!("{s:?} is not a KV cache dtype (expected bf16, fp8 or f32)"))),
        }
    }
}

/// How many tokens the cache holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvCapacity {
    /// Exactly this many.
    Tokens(usize),
    /// The most that fit in the budget's remaining bytes minus `reserve_bytes` (kept for
    /// activations and workspaces), capped at `max_tokens` (the model's context length).
    FromBudget { reserve_bytes: u64, max_tokens: usize },
}

/// The geometry of a cache: everything its size follows from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvLayout {
    pub dtype: KvDtype,
    pub layers: usize,
    pub planes: usize,
    pub row: usize,
    pub scale_group: usize,
}

impl KvLayout {
    /// Checks the geometry (all positive, `row % scale_group == 0` for FP8, sizes that fit).
    pub fn new(dtype: KvDtype, layers: usize, planes: usize, row: usize, scale_group: usize) -> Result<Self, GpuError> {
        const OP: &str = "GpuKvCache::new";
        if layers == 0 || planes == 0 || row == 0 {
            return Err(GpuError::shape(
                OP,
                format!("layers {layers}, planes {planes} and row {row} must be positive"),
            ));
        }
        if !(1..=2).contains(&planes) {
            return Err(GpuError::shape(OP, format!("planes = {planes}: 1 (MLA) or 2 (GQA K and V)")));
        }
        if row > i32::MAX as usize / 2 {
            return Err(GpuError::shape(OP, format!("row = {row} elements is too large")));
        }
        if dtype == KvDtype::Fp8 && (scale_group == 0 || !row.is_multiple_of(scale_group)) {
            return Err(GpuError::shape(
                OP,
                format!("FP8 scale_group = {scale_group} must be positive and divide row = {row}"),
            ));
        }
        let scale_group = if dtype == KvDtype::Fp8 { scale_group } else { row };
        Ok(KvLayout { dtype, layers, planes, row, scale_group })
    }

    /// Scales per row (FP8; 0 for BF16).
    pub fn groups_per_row(&self) -> usize {
        match self.dtype {
            KvDtype::Bf16 | KvDtype::F32 => 0,
            KvDtype::Fp8 => self.row / self.scale_group,
        }
    }

    /// Device bytes one token takes over all layers and planes (codes plus scales).
    pub fn bytes_per_token(&self) -> usize {
        self.layers * self.planes * (self.row * self.dtype.elem_bytes() + self.groups_per_row() * 4)
    }

    /// Number of separate allocations (each is rounded up to the budget's charge granule).
    fn allocations(&self) -> u64 {
        match self.dtype {
            KvDtype::Bf16 | KvDtype::F32 => 1,
            KvDtype::Fp8 => 2,
        }
    }

    /// The token count for `capacity` when `remaining` bytes of budget are left; 0 when none fits.
    pub fn tokens_for(&self, capacity: KvCapacity, remaining: u64) -> usize {
        match capacity {
            KvCapacity::Tokens(n) => n,
            KvCapacity::FromBudget { reserve_bytes, max_tokens } => {
                // Each allocation may be charged up to one granule more than its bytes.
                let slack = self.allocations() * crate::budget::CHARGE_GRANULE;
                let avail = remaining.saturating_sub(reserve_bytes).saturating_sub(slack);
                let fit = avail / self.bytes_per_token() as u64;
                fit.min(max_tokens as u64) as usize
            }
        }
    }
}

/// The KV cache of every layer, on the GPU. See the module docs for the storage and FP8 rule.
#[derive(Debug)]
pub struct GpuKvCache {
    layout: KvLayout,
    capacity: usize,
    /// All planes: `[layers, planes, capacity, row]` elements of `dtype`, as bytes.
    data: DeviceBuffer<u8>,
    /// FP8 only: `[layers, planes, capacity, row / scale_group]`.
    scales: Option<DeviceBuffer<f32>>,
}

/// Positions `0..tokens` of a [`GpuKvCache`], compact on the device ([`GpuKvCache::save_prefix`]).
pub struct KvPrefix {
    layout: KvLayout,
    tokens: usize,
    data: DeviceBuffer<u8>,
    scales: Option<DeviceBuffer<f32>>,
}

impl KvPrefix {
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// Device bytes charged for it.
    pub fn charged_bytes(&self) -> u64 {
        self.data.charged_bytes() + self.scales.as_ref().map_or(0, |s| s.charged_bytes())
    }
}

impl GpuKvCache {
    /// A zeroed cache: `planes` per layer (1 for MLA, 2 for GQA), `row` elements per token per
    /// plane, FP8 scales per `scale_group` elements (ignored for BF16). Charged to the budget as
    /// "KV cache".
    pub fn new(
        dev: &GpuDevice,
        dtype: KvDtype,
        layers: usize,
        planes: usize,
        row: usize,
        scale_group: usize,
        capacity: KvCapacity,
    ) -> Result<Self, GpuError> {
        let layout = KvLayout::new(dtype, layers, planes, row, scale_group)?;
        Self::with_layout(dev, layout, capacity)
    }

    pub fn with_layout(dev: &GpuDevice, layout: KvLayout, capacity: KvCapacity) -> Result<Self, GpuError> {
        let budget: &VramBudget = dev.budget();
        let cap = layout.tokens_for(capacity, budget.remaining());
        if cap == 0 {
            return Err(GpuError::VramBudget {
                requested: layout.bytes_per_token() as u64,
                used: budget.used(),
                budget: budget.budget(),
                what: format!("the KV cache ({capacity:?} leaves room for 0 tokens)"),
            });
        }
        let elems = (layout.layers * layout.planes)
            .checked_mul(cap)
            .and_then(|n| n.checked_mul(layout.row))
            .ok_or_else(|| GpuError::shape("GpuKvCache::new", format!("{cap} tokens overflow the cache size")))?;
        let data = dev.alloc_zeros::<u8>(elems * layout.dtype.elem_bytes(), "KV cache")?;
        let scales = match layout.dtype {
            KvDtype::Bf16 | KvDtype::F32 => None,
            KvDtype::Fp8 => {
                let n = layout.layers * layout.planes * cap * layout.groups_per_row();
                Some(dev.alloc_zeros::<f32>(n, "KV cache FP8 scales")?)
            }
        };
        Ok(GpuKvCache { layout, capacity: cap, data, scales })
    }

    /// Tokens the cache holds.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn bytes_per_token(&self) -> usize {
        self.layout.bytes_per_token()
    }

    pub fn dtype(&self) -> KvDtype {
        self.layout.dtype
    }

    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    /// A compact device copy of positions `0..n` of every layer and plane (codes and scales),
    /// for a prefix cache: [`GpuKvCache::load_prefix`] puts it into another cache of this layout.
    pub fn save_prefix(&self, dev: &GpuDevice, n: usize) -> Result<KvPrefix, GpuError> {
        self.check_range("GpuKvCache::save_prefix", 0, n)?;
        let planes = self.layout.layers * self.layout.planes;
        let row_bytes = self.layout.row * self.layout.dtype.elem_bytes();
        // SAFETY: every element is written by the copies below (n rows of every plane).
        let mut data = unsafe { dev.alloc_uninit::<u8>((planes * n * row_bytes).max(1), "prefix cache (KV)")? };
        let mut scales = match &self.scales {
            // SAFETY: as above.
            Some(_) => Some(unsafe {
                dev.alloc_uninit::<f32>((planes * n * self.layout.groups_per_row()).max(1), "prefix cache (KV scales)")?
            }),
            None => None,
        };
        for p in 0..planes {
            let (from, to) = (p * self.capacity * row_bytes, p * n * row_bytes);
            let src = self.data.slice().slice(from..from + n * row_bytes);
            dev.copy_device(&src, &mut data.slice_mut().slice_mut(to..to + n * row_bytes))?;
            if let (Some(sc), Some(out)) = (&self.scales, scales.as_mut()) {
                let g = self.layout.groups_per_row();
                let (from, to) = (p * self.capacity * g, p * n * g);
                let src = sc.slice().slice(from..from + n * g);
                dev.copy_device(&src, &mut out.slice_mut().slice_mut(to..to + n * g))?;
            }
        }
        Ok(KvPrefix { layout: self.layout, tokens: n, data, scales })
    }

    /// Writes a [`GpuKvCache::save_prefix`] copy into positions `0..prefix.tokens()`.
    pub fn load_prefix(&mut self, dev: &GpuDevice, prefix: &KvPrefix) -> Result<(), GpuError> {
        const OP: &str = "GpuKvCache::load_prefix";
        if prefix.layout != self.layout {
            return Err(GpuError::shape(
                OP,
                format!("a prefix of layout {:?} into a cache of {:?}", prefix.layout, self.layout),
            ));
        }
        let n = prefix.tokens;
        self.check_range(OP, 0, n)?;
        let planes = self.layout.layers * self.layout.planes;
        let row_bytes = self.layout.row * self.layout.dtype.elem_bytes();
        let cap = self.capacity;
        for p in 0..planes {
            let (from, to) = (p * n * row_bytes, p * cap * row_bytes);
            let src = prefix.data.slice().slice(from..from + n * row_bytes);
            dev.copy_device(&src, &mut self.data.slice_mut().slice_mut(to..to + n * row_bytes))?;
            if let (Some(out), Some(sc)) = (self.scales.as_mut(), &prefix.scales) {
                let g = self.layout.groups_per_row();
                let (from, to) = (p * n * g, p * cap * g);
                let src = sc.slice().slice(from..from + n * g);
                dev.copy_device(&src, &mut out.slice_mut().slice_mut(to..to + n * g))?;
            }
        }
        Ok(())
    }

    /// Device bytes charged for the whole cache.
    pub fn charged_bytes(&self) -> u64 {
        self.data.charged_bytes() + self.scales.as_ref().map_or(0, |s| s.charged_bytes())
    }

    fn plane_index(&self, op: &'static str, layer: usize, plane: usize) -> Result<usize, GpuError> {
        if layer >= self.layout.layers || plane >= self.layout.planes {
            return Err(GpuError::shape(
                op,
                format!(
                    "layer {layer} / plane {plane} outside the cache's {} layers x {} planes",
                    self.layout.layers, self.layout.planes
                ),
            ));
        }
        Ok(layer * self.layout.planes + plane)
    }

    fn check_range(&self, op: &'static str, start: usize, len: usize) -> Result<(), GpuError> {
        match start.checked_add(len) {
            Some(end) if end <= self.capacity => Ok(()),
            _ => Err(GpuError::shape(
                op,
                format!("positions {start}..{start}+{len} exceed the KV cache capacity {}", self.capacity),
            )),
        }
    }

    /// Device address of row `pos` of (layer, plane) for a BF16 cache with rows `pos..pos+n` in
    /// range (`None` for FP8, whose rows carry scales): for kernels that write finished rows
    /// straight into the cache.
    pub(crate) fn bf16_rows(
        &self,
        op: &'static str,
        dev: &GpuDevice,
        layer: usize,
        plane: usize,
        pos: usize,
        n: usize,
    ) -> Result<Option<u64>, GpuError> {
        if self.layout.dtype != KvDtype::Bf16 {
            return Ok(None);
        }
        let (data, _) = self.plane(op, dev, layer, plane)?;
        self.check_range(op, pos, n)?;
        Ok(Some(data + (pos * self.layout.row * self.layout.dtype.elem_bytes()) as u64))
    }

    /// Device addresses of the codes (element 0 of row 0) and the scales of one plane. The caller
    /// must use them on the device's stream while `self` lives.
    pub(crate) fn plane_ptrs(&self, dev: &GpuDevice, idx: usize) -> (u64, u64) {
        let s = dev.stream();
        let plane_elems = (self.capacity * self.layout.row) as u64;
        let (d, _g) = self.data.device_ptr(s);
        let data = d + idx as u64 * plane_elems * self.layout.dtype.elem_bytes() as u64;
        let scales = match &self.scales {
            Some(sc) => {
                let (p, _g) = sc.device_ptr(s);
                p + (idx * self.capacity * self.layout.groups_per_row() * 4) as u64
            }
            None => 0,
        };
        (data, scales)
    }

    pub(crate) fn plane(
        &self,
        op: &'static str,
        dev: &GpuDevice,
        layer: usize,
        plane: usize,
    ) -> Result<(u64, u64), GpuError> {
        let idx = self.plane_index(op, layer, plane)?;
        Ok(self.plane_ptrs(dev, idx))
    }

    /// Stores rows for positions `pos..pos+t` of (`layer`, `plane`) from f32 `src [t, row]`: f32
    /// stores them as given; BF16 rounds to nearest even; FP8 quantises each group as the module
    /// docs say. Nothing is written if `pos + t > capacity` (an error).
    pub fn write(
        &self,
        dev: &GpuDevice,
        layer: usize,
        plane: usize,
        pos: usize,
        t: usize,
        src: &impl DevicePtr<f32>,
    ) -> Result<(), GpuError> {
        const OP: &str = "GpuKvCache::write";
        let row = self.layout.row;
        if src.len() != t * row {
            return Err(GpuError::shape(OP, format!("src has {} elements, not {t}x{row}", src.len())));
        }
        self.check_range(OP, pos, t)?;
        let (data, scales) = self.plane(OP, dev, layer, plane)?;
        if t == 0 {
            return Ok(());
        }
        let s = dev.stream();
        let (src_p, _g) = src.device_ptr(s);
        let t_i = i32::try_from(t).map_err(|_| GpuError::shape(OP, format!("t = {t} does not fit in i32")))?;
        let (row_i, pos_l) = (row as i32, pos as i64);
        let cfg = LaunchConfig { grid_dim: (t as u32, 1, 1), block_dim: (ROW_THREADS, 1, 1), shared_mem_bytes: 0 };
        match self.layout.dtype {
            KvDtype::Bf16 | KvDtype::F32 => {
                let name = if self.layout.dtype == KvDtype::F32 { "kv_write_f32" } else { "kv_write_bf16" };
                let f = dev.function(&KV_CACHE, name)?;
                let mut args = kernel_args![&src_p, &data, &t_i, &row_i, &pos_l];
                // SAFETY: arguments match the kernel; rows pos..pos+t lie inside the plane; the
                // kernel waits for the previous one first.
                unsafe { dev.launch_dependent(OP, &f, cfg, &mut args, true) }?;
            }
            KvDtype::Fp8 => {
                let group = self.layout.scale_group as i32;
                let f = dev.function(&KV_CACHE, "kv_write_fp8")?;
                let mut b = s.launch_builder(&f);
                b.arg(&src_p).arg(&data).arg(&scales).arg(&t_i).arg(&row_i).arg(&group).arg(&pos_l);
                // SAFETY: as above; the scales of those rows lie inside the scale plane.
                unsafe { b.launch(cfg) }.map_err(|e| GpuError::driver(OP, e))?;
            }
        }
        Ok(())
    }

    /// Dequantised copy of positions `start..start+len` of (`layer`, `plane`) into `dst [len, row]`
    /// as BF16 bits (FP8: the f32 value `code · scale` rounded to nearest even; f32: rounded
    /// likewise).
    pub fn read_bf16(
        &self,
        dev: &GpuDevice,
        layer: usize,
        plane: usize,
        start: usize,
        len: usize,
        dst: &mut impl DevicePtrMut<u16>,
    ) -> Result<(), GpuError> {
        let n = dst.len();
        let (p, _g) = dst.device_ptr_mut(dev.stream());
        self.read_launch(dev, layer, plane, start, len, p, n, false)
    }

    /// [`GpuKvCache::read_bf16`] into f32 (exact for every dtype).
    pub fn read_f32(
        &self,
        dev: &GpuDevice,
        layer: usize,
        plane: usize,
        start: usize,
        len: usize,
        dst: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), GpuError> {
        let n = dst.len();
        let (p, _g) = dst.device_ptr_mut(dev.stream());
        self.read_launch(dev, layer, plane, start, len, p, n, true)
    }

    #[allow(clippy::too_many_arguments)]
    fn read_launch(
        &self,
        dev: &GpuDevice,
        layer: usize,
        plane: usize,
        start: usize,
        len: usize,
        dst: u64,
        dst_len: usize,
        to_f32: bool,
    ) -> Result<(), GpuError> {
        const OP: &str = "GpuKvCache::read";
        let row = self.layout.row;
        if dst_len != len * row {
            return Err(GpuError::shape(OP, format!("dst has {dst_len} elements, not {len}x{row}")));
        }
        self.check_range(OP, start, len)?;
        let (data, scales) = self.plane(OP, dev, layer, plane)?;
        if len == 0 {
            return Ok(());
        }
        let s = dev.stream();
        let len_i = i32::try_from(len).map_err(|_| GpuError::shape(OP, format!("len = {len} does not fit in i32")))?;
        let (row_i, start_l) = (row as i32, start as i64);
        let cfg = LaunchConfig { grid_dim: (len as u32, 1, 1), block_dim: (ROW_THREADS, 1, 1), shared_mem_bytes: 0 };
        match self.layout.dtype {
            KvDtype::Bf16 | KvDtype::F32 => {
                let name = match (self.layout.dtype, to_f32) {
                    (KvDtype::F32, true) => "kv_read_f32_f32",
                    (KvDtype::F32, false) => "kv_read_f32_bf16",
                    (_, true) => "kv_read_bf16_f32",
                    (_, false) => "kv_read_bf16_bf16",
                };
                let f = dev.function(&KV_CACHE, name)?;
                let mut b = s.launch_builder(&f);
                b.arg(&data).arg(&dst).arg(&len_i).arg(&row_i).arg(&start_l);
                // SAFETY: arguments match the kernel; range and dst size checked above.
                unsafe { b.launch(cfg) }.map_err(|e| GpuError::driver(OP, e))?;
            }
            KvDtype::Fp8 => {
                let name = if to_f32 { "kv_read_fp8_f32" } else { "kv_read_fp8_bf16" };
                let group = self.layout.scale_group as i32;
                let f = dev.function(&KV_CACHE, name)?;
                let mut b = s.launch_builder(&f);
                b.arg(&data).arg(&scales).arg(&dst).arg(&len_i).arg(&row_i).arg(&group).arg(&start_l);
                // SAFETY: as above.
                unsafe { b.launch(cfg) }.map_err(|e| GpuError::driver(OP, e))?;
            }
        }
        Ok(())
    }
}

/// The FP8 scale of one group: `amax / 448` (NaNs ignored, as `fmaxf` does on the device).
pub fn fp8_group_scale(group: &[f32]) -> f32 {
    let amax = group.iter().fold(0.0f32, |m, &x| m.max(x.abs()));
    amax / FP8_E4M3_MAX
}

#[cfg(test)]
mod tests {
    use super::*;
    use krasis_core::dtype::fp8_e4m3_to_f32;

    #[test]
    fn fp8_encode_round_trips_every_code() {
        for c in 0u8..=255 {
            if c & 0x7f == 0x7f {
                assert!(fp8_e4m3_to_f32(c).is_nan());
                continue;
            }
            assert_eq!(f32_to_fp8_e4m3(fp8_e4m3_to_f32(c)), c, "code {c:#04x}");
        }
        assert_eq!(f32_to_fp8_e4m3(f32::NAN), 0x7f);
        assert_eq!(f32_to_fp8_e4m3(1e6), 0x7e);
        assert_eq!(f32_to_fp8_e4m3(-1e6), 0xfe);
        assert_eq!(f32_to_fp8_e4m3(f32::INFINITY), 0x7e);
        assert_eq!(f32_to_fp8_e4m3(470.0), 0x7e);
        assert_eq!(f32_to_fp8_e4m3(1e-30), 0x00);
    }

    /// Every value rounds to the nearest code, ties to the even code: checked against a search
    /// over all finite codes on random values and on all midpoints.
    #[test]
    fn fp8_encode_rounds_to_nearest_even() {
        let codes: Vec<(u8, f32)> = (0u8..0x7f).map(|c| (c, fp8_e4m3_to_f32(c))).collect();
        let nearest = |a: f32| -> u8 {
            let mut best = (0u8, f32::INFINITY);
            for &(c, v) in &codes {
                let d = (v - a).abs();
                if d < best.1 || (d == best.1 && c & 1 == 0) {
                    best = (c, d);
                }
            }
            best.0
        };
        let mut x = 0x1234_5678u32;
        for i in 0..200_000 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            let a = (x as f32 / u32::MAX as f32) * 460.0 * if i % 3 == 0 { 1e-3 } else { 1.0 };
            assert_eq!(f32_to_fp8_e4m3(a), nearest(a), "{a}");
            assert_eq!(f32_to_fp8_e4m3(-a), nearest(a) | 0x80, "-{a}");
        }
        for w in codes.windows(2) {
            let mid = (w[0].1 + w[1].1) / 2.0;
            let want = if w[0].0 & 1 == 0 { w[0].0 } else { w[1].0 };
            assert_eq!(f32_to_fp8_e4m3(mid), want, "midpoint {mid}");
        }
    }

    #[test]
    fn dtype_parses_and_displays() {
        assert_eq!("bf16".parse::<KvDtype>().unwrap(), KvDtype::Bf16);
        assert_eq!("FP8".parse::<KvDtype>().unwrap(), KvDtype::Fp8);
        assert!("int4".parse::<KvDtype>().is_err());
        assert_eq!(KvDtype::Fp8.to_string(), "fp8");
        assert_eq!(KvDtype::Bf16.to_string(), "bf16");
    }

    #[test]
    fn layout_checks_and_bytes_per_token() {
        // V2-Lite MLA: 27 layers, 1 plane of 576, FP8 groups of 64 → 576 + 9·4 bytes per layer.
        let l = KvLayout::new(KvDtype::Fp8, 27, 1, 576, 64).unwrap();
        assert_eq!(l.bytes_per_token(), 27 * (576 + 36));
        let l = KvLayout::new(KvDtype::Bf16, 27, 1, 576, 0).unwrap();
        assert_eq!(l.bytes_per_token(), 27 * 1152);
        // Qwen3 GQA: 48 layers, K and V of 4·128.
        let l = KvLayout::new(KvDtype::Fp8, 48, 2, 512, 128).unwrap();
        assert_eq!(l.bytes_per_token(), 48 * 2 * (512 + 16));
        assert!(KvLayout::new(KvDtype::Fp8, 1, 1, 576, 100).is_err());
        assert!(KvLayout::new(KvDtype::Fp8, 1, 1, 576, 0).is_err());
        assert!(KvLayout::new(KvDtype::Bf16, 0, 1, 576, 0).is_err());
        assert!(KvLayout::new(KvDtype::Bf16, 1, 3, 576, 0).is_err());
    }

    #[test]
    fn capacity_from_budget() {
        let l = KvLayout::new(KvDtype::Bf16, 2, 1, 64, 0).unwrap(); // 256 bytes per token
        assert_eq!(l.bytes_per_token(), 256);
        let g = crate::budget::CHARGE_GRANULE;
        let cap =
            |reserve, max, rem| l.tokens_for(KvCapacity::FromBudget { reserve_bytes: reserve, max_tokens: max }, rem);
        // 1 MiB left, 64 KiB reserved, one allocation's granule of slack.
        assert_eq!(cap(65536, usize::MAX, 1 << 20), ((1u64 << 20) - 65536 - g) as usize / 256);
        assert_eq!(cap(65536, 100, 1 << 20), 100);
        assert_eq!(cap(1 << 21, 100, 1 << 20), 0);
        assert_eq!(cap(0, 100, 0), 0);
        assert_eq!(l.tokens_for(KvCapacity::Tokens(7), 0), 7);
        // The chosen count really fits: charged bytes (rounded per allocation) ≤ budget − reserve.
        for rem in [1000u64, 4096, 123_457, 9_999_999] {
            for reserve in [0u64, 511, 4000] {
                let n = cap(reserve, usize::MAX, rem) as u64;
                let charged = crate::budget::charged_bytes(n * 256);
                assert!(n == 0 || charged + reserve <= rem, "rem {rem} reserve {reserve}: {n} tokens");
                // and one more token would not fit under the same rule (tight within a granule).
                let more = crate::budget::charged_bytes((n + 1) * 256) + reserve;
                assert!(more + g > rem, "rem {rem} reserve {reserve}: {n} is not the largest");
            }
        }
        let f = KvLayout::new(KvDtype::Fp8, 1, 2, 64, 32).unwrap(); // (64 + 2·4)·2 = 144 bytes
        assert_eq!(f.bytes_per_token(), 144);
        let n = f.tokens_for(KvCapacity::FromBudget { reserve_bytes: 0, max_tokens: usize::MAX }, 100_000) as u64;
        assert_eq!(n, (100_000 - 2 * g) / 144);
    }
}
