//! MLA absorbed decode attention for one query token over a BF16 cache, on CUDA cores
//! (`kernels/mla_decode.cu`): the decode step of DeepSeek-style models. The general kernel of
//! [`crate::attn_decode`] stages 32-row tiles for 16-query tensor-core MMAs; with one token that
//! machinery is latency-bound (measured on an H100 under Nsight Compute: ~25 µs at 64 cached rows,
//! 18 µs at 512, for well under a microsecond of arithmetic and memory). Here each warp keeps two
//! heads' queries in registers and walks its split's rows four at a time with no shared memory
//! and no block barriers; splits are merged by the general path's combine kernel.
//!
//! [`crate::GpuDevice::mla_decode_attention`] takes this path by itself for `t = 1`, a BF16 cache
//! and the row shapes instantiated in the kernel (latent 512 + rope 64, and the oracle fixtures'
//! 64 + 16); `KRASIS_MLA_DECODE=general` or [`DecodeWorkspace::force_general`] turn it off.

use cudarc::driver::{DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig};

use crate::attn_decode::{shape, DecodeWorkspace};
use crate::device::kernel_args;
use crate::kernels::{to_i32, KernelSource, HEADERS};
use crate::{GpuDevice, GpuError};

pub const MLA_DECODE: KernelSource = KernelSource {
    name: "mla_decode",
    src: include_str!("../kernels/mla_decode.cu"),
    headers: HEADERS,
    options: &[],
    functions: &["mla_decode_t1_j9_v8", "mla_decode_t1_j2_v1"],
};

const THREADS: u32 = 256;
/// Heads per block: 8 warps × 2 heads (`MLA1_WARPS` × 2 in the kernel).
const HEADS_PER_BLOCK: usize = 16;
/// Rows per split at least. Measured on an H100 (V2-Lite shape, 27 layers back to back, µs per
/// call): 64 cached rows, 16 splits 7.9, 8 splits 8.8, 4 splits 11.9.
pub const T1_MIN_SPLIT_ROWS: usize = 4;
/// Splits at most: the combine reads every split's 16 × 512 partial outputs, so past this the
/// splits cost more than they save (512 rows: 64 splits 10.6, 128 splits 15.7; 1024 rows: 64
/// splits 14.5, 128 splits 17.0).
pub const T1_MAX_SPLITS: usize = 64;
/// Longest context this kernel takes; longer ones go to the general kernel, whose per-split
/// partials are amortised over more rows. Same measurement, best split count here against the
/// general kernel's rule: 1024 rows 14.5 / 17.4, 2048 rows 20.8 / 18.9, 4096 rows 28.3 / 21.1.
pub const T1_MAX_ROWS: usize = 1536;

/// Splits for `visible` rows: [`T1_MIN_SPLIT_ROWS`] rows each, at most [`T1_MAX_SPLITS`], at
/// least 1.
pub fn t1_split_count(visible: usize) -> usize {
    visible.div_ceil(T1_MIN_SPLIT_ROWS).clamp(1, T1_MAX_SPLITS)
}

/// The kernel for `visible` cache rows of `row` elements whose first `latent` are the values, if
/// the context is short enough and one is instantiated (pairs of elements per lane: ceil(row / 64) key chunks, ceil(latent / 64) value
/// chunks).
pub(crate) fn t1_kernel(row: usize, latent: usize, visible: usize) -> Option<&'static str> {
    if !row.is_multiple_of(2) || !latent.is_multiple_of(2) || latent >= row || visible > T1_MAX_ROWS {
        return None;
    }
    match ((row / 2).div_ceil(32), (latent / 2).div_ceil(32)) {
        (9, 8) => Some("mla_decode_t1_j9_v8"),
        (2, 1) => Some("mla_decode_t1_j2_v1"),
        _ => None,
    }
}

/// `KRASIS_MLA_DECODE=general`: every MLA decode call takes the general kernel.
pub(crate) fn disabled_by_env() -> bool {
    krasis_core::knobs::knobs().mla_decode_general
}

/// `MlaT1Args` of the kernel (same field order and types).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct MlaT1Args {
    kv: u64,
    q: u64,
    out: u64,
    ws_o: u64,
    ws_ml: u64,
    heads: i32,
    half_row: i32,
    half_lat: i32,
    visible: i32,
    n_splits: i32,
    split_rows: i32,
    qscale: f32,
}

// SAFETY: plain-old-data with the C layout of the kernel's struct.
unsafe impl DeviceRepr for MlaT1Args {}

impl GpuDevice {
    /// One query token, `visible` cached rows of `row` BF16 elements at `kv` (the layer's plane;
    /// shapes already checked by the caller, `fname` from [`t1_kernel`]).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn mla_decode_t1(
        &self,
        fname: &'static str,
        kv: u64,
        q: &impl DevicePtr<f32>,
        heads: usize,
        row: usize,
        latent: usize,
        visible: usize,
        scale: f32,
        out: &mut impl DevicePtrMut<f32>,
        ws: &mut DecodeWorkspace,
    ) -> Result<(), GpuError> {
        const OP: &str = "MLA decode attention (one token)";
        shape(OP, kv.is_multiple_of(4), || "the cache plane is not 4-byte aligned".into())?;
        let (n_splits, split_rows) = ws.plan_splits(visible, t1_split_count(visible), 1);
        if n_splits > 1 {
            // Room for the general kernel's most too: a context that outgrows this kernel then
            // finds the workspace big enough.
            let sms = usize::try_from(self.info().multiprocessors).unwrap_or(1);
            let most = ws
                .force_splits
                .map_or(T1_MAX_SPLITS.max(crate::attn_decode::most_splits(1, heads, 1, sms)), |_| n_splits);
            ws.ensure(self, most.max(n_splits), heads, latent)?;
        }
        let s = self.stream();
        let (q_p, _gq) = q.device_ptr(s);
        let (out_p, _go) = out.device_ptr_mut(s);
        let (ws_o, ws_ml) = if n_splits > 1 { ws.ptrs(self) } else { (0, 0) };
        let args = MlaT1Args {
            kv,
            q: q_p,
            out: out_p,
            ws_o,
            ws_ml,
            heads: to_i32(OP, "heads", heads)?,
            half_row: to_i32(OP, "row", row / 2)?,
            half_lat: to_i32(OP, "latent", latent / 2)?,
            visible: to_i32(OP, "visible rows", visible)?,
            n_splits: n_splits as i32,
            split_rows: to_i32(OP, "split rows", split_rows)?,
            qscale: scale * std::f32::consts::LOG2_E,
        };
        let f = self.function(&MLA_DECODE, fname)?;
        let cfg = LaunchConfig {
            grid_dim: (n_splits as u32, heads.div_ceil(HEADS_PER_BLOCK) as u32, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut params = kernel_args![&args];
        // SAFETY: `args` matches the kernel's struct; the caller checked q [heads, row], out
        // [heads, latent] and that `visible` rows of the plane exist; the workspace holds
        // n_splits x heads x (latent + 2) floats when n_splits > 1; the kernel waits first.
        unsafe { self.launch_dependent(OP, &f, cfg, &mut params, true) }?;
        if n_splits > 1 {
            self.combine_splits(ws_o, ws_ml, out_p, heads, latent, n_splits, (0, heads))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn instantiated_shapes() {
        assert_eq!(t1_kernel(576, 512, 100), Some("mla_decode_t1_j9_v8"));
        assert_eq!(t1_kernel(576, 512, T1_MAX_ROWS), Some("mla_decode_t1_j9_v8"));
        assert_eq!(t1_kernel(576, 512, T1_MAX_ROWS + 1), None);
        assert_eq!(t1_kernel(80, 64, 1), Some("mla_decode_t1_j2_v1"));
        assert_eq!(t1_kernel(577, 512, 1), None);
        assert_eq!(t1_kernel(576, 511, 1), None);
        assert_eq!(t1_kernel(320, 256, 1), None);
        assert_eq!(t1_kernel(64, 64, 1), None);
    }

    #[test]
    fn split_rule() {
        assert_eq!(t1_split_count(0), 1);
        assert_eq!(t1_split_count(1), 1);
        assert_eq!(t1_split_count(4), 1);
        assert_eq!(t1_split_count(5), 2);
        assert_eq!(t1_split_count(64), 16);
        assert_eq!(t1_split_count(512), 64);
        assert_eq!(t1_split_count(T1_MAX_ROWS), T1_MAX_SPLITS);
        const { assert!(T1_MAX_SPLITS <= crate::attn_decode::MAX_SPLITS) };
    }
}
