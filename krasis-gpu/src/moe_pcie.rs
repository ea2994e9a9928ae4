//! A decode step's share of the routed experts, read by the GPU straight from the CPU expert
//! records in page-locked host memory (`kernels/moe_pcie.cu`): the SMs load each record over
//! PCIe as they compute, so nothing is copied into VRAM and the host does nothing. The hybrid
//! engine gives the GPU the last few routes of each decode token this way while the CPU reads the
//! others' experts from RAM; the two reads overlap, so a token's experts take less time than on
//! the CPU alone (measured on the H200 box: the CPU read 90–110 GB/s alone, ~68 GB/s beside the
//! copy engine's 54 GB/s, and 97–107 GB/s beside these kernels' ~40 GB/s; docs/BENCHMARKS.md,
//! `pcie-share`).
//!
//! Symmetric INT4 and INT8 records (`cpu-rb16-v1`) and asymmetric INT4 g32 (`4a`, the default
//! for float checkpoints), with SiLU experts (no biases). The GPU
//! computes in f32 on the exact codes and scales with unrounded activations;
//! [`PcieExperts::reference`] is its scalar twin.

use cudarc::driver::{CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg};
use krasis_quant::cpu_layout::{pack, pack_w13, unpack, unpack_w13, PackedLayout};
use krasis_quant::group::dequantize;
use krasis_quant::int4_asym::{self, AsymMatrix};
use krasis_quant::{Bits, QuantizedMatrix};

use crate::kernels::{check, launch_err, KernelSource, DEFAULT_SMEM_LIMIT, HEADERS};
use crate::relayout::CpuRecordGeometry;
use crate::{GpuDevice, GpuError};

pub const MOE_PCIE: KernelSource = KernelSource {
    name: "moe_pcie",
    src: include_str!("../kernels/moe_pcie.cu"),
    headers: HEADERS,
    options: &[],
    functions: &["pcie_w13", "pcie_w2"],
};

const OP: &str = "moe_pcie";

/// Threads per block (`PCIE_THREADS` in the kernel).
const THREADS: u32 = 256;
/// Warps per block (`PCIE_WARPS`): the reduction's shared floats are 16 per warp.
const WARPS: usize = THREADS as usize / 32;

/// `PciePart` of the kernels (same field order and types).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct PciePart {
    rows: i32,
    k: i32,
    gs: i32,
    bits: i32,
    block_bytes: i32,
    header_bytes: i32,
    group_bytes: i32,
    asym: i32,
}

// SAFETY: plain-old-data with the C layout of the kernel's struct.
unsafe impl DeviceRepr for PciePart {}

fn part(p: &PackedLayout, rows: usize) -> Result<PciePart, GpuError> {
    let i = |what: &str, v: usize| crate::kernels::to_i32(OP, what, v);
    Ok(PciePart {
        rows: i("rows", rows)?,
        k: i("k", p.k)?,
        gs: i("group size", p.gs)?,
        bits: p.bits.bits() as i32,
        block_bytes: i("block bytes", p.block_bytes())?,
        header_bytes: i("header bytes", p.header_bytes())?,
        group_bytes: i("group bytes", p.group_weight_bytes())?,
        asym: p.asym as i32,
    })
}

/// One MoE layer's expert records as the CPU expert cache lays them out, read over PCIe.
#[derive(Clone, Copy, Debug)]
pub struct PcieExperts {
    geometry: CpuRecordGeometry,
    inter: usize,
    hidden: usize,
}

impl PcieExperts {
    /// The reader of records of `geometry`, or why it cannot read them: symmetric INT4 or INT8,
    /// or asymmetric INT4 g32 (both parts alike), a fused w13 of whole row blocks whose halves are
    /// w2's K, and shared memory within the default 48 KiB.
    pub fn new(geometry: CpuRecordGeometry) -> Result<PcieExperts, GpuError> {
        let (w13, w2) = (&geometry.w13, &geometry.w2);
        let why = |d: String| Err(GpuError::shape(OP, d));
        let readable = |p: &PackedLayout| p.is_symmetric_int() || (p.asym && p.bits == Bits::Int4);
        if !readable(w13) || !readable(w2) || w13.asym != w2.asym {
            return why("the records are not INT4/INT8 or `4a` alike in both parts (FP4 or K-quants)".into());
        }
        let inter = w2.k;
        if w13.rows != 2 * inter || !inter.is_multiple_of(16) || w13.k != w2.rows {
            return why(format!(
                "w13 [{}, {}] and w2 [{}, {}] are not one expert's parts",
                w13.rows, w13.k, w2.rows, w2.k
            ));
        }
        let e = PcieExperts { geometry, inter, hidden: w2.rows };
        let need = e.w13_shared_bytes().max(e.w2_shared_bytes());
        if need > DEFAULT_SMEM_LIMIT {
            return why(format!("{need} bytes of shared memory a block (at most {DEFAULT_SMEM_LIMIT})"));
        }
        Ok(e)
    }

    fn w13_shared_bytes(&self) -> usize {
        let p = &self.geometry.w13;
        4 * (p.k + (1 + p.asym as usize) * p.groups() * 16 + WARPS * 16 + 32)
    }

    fn w2_shared_bytes(&self) -> usize {
        let p = &self.geometry.w2;
        4 * (p.k + (1 + p.asym as usize) * p.groups() * 16 + WARPS * 16 + 16)
    }

    /// Scratch floats of the intermediate for `t` tokens and `g` routes each.
    pub fn scratch_len(&self, t: usize, g: usize) -> usize {
        t * g * self.inter
    }

    /// Bytes of one record read per route (w13 and w2).
    pub fn bytes_per_route(&self) -> usize {
        self.geometry.w13.bytes() + self.geometry.w2.bytes()
    }

    /// Enqueues on the current stream, for `t` tokens of `x` ([t, hidden]) and routes
    /// `first..first + g` of each token's `top_k` in `ids` / `weights` ([t, top_k]; an id outside
    /// `0..n_experts` is skipped): `y = (accumulate ? y : 0) + Σ weight · expert(x)`, with the
    /// intermediate in `h` ([`PcieExperts::scratch_len`]).
    ///
    /// # Safety
    /// `records` is the device address of the layer's expert 0 record, with `n_experts` records
    /// `stride` apart readable by the device (page-locked, mapped) until the work has run; `ids`
    /// and `weights` are device addresses of `t · top_k` values written before this work in
    /// stream order.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn run(
        &self,
        dev: &GpuDevice,
        records: u64,
        n_experts: usize,
        x: &CudaView<'_, f32>,
        t: usize,
        (ids, weights): (u64, u64),
        (top_k, first, g): (usize, usize, usize),
        h: &mut CudaViewMut<'_, f32>,
        y: &mut CudaViewMut<'_, f32>,
        accumulate: bool,
    ) -> Result<(), GpuError> {
        check(OP, first + g <= top_k && g > 0, || format!("routes {first}..{} of {top_k}", first + g))?;
        check(OP, x.len() >= t * self.hidden && y.len() >= t * self.hidden, || {
            format!("x {} / y {} for {t} tokens of {}", x.len(), y.len(), self.hidden)
        })?;
        check(OP, h.len() >= self.scratch_len(t, g), || format!("scratch {} < {}", h.len(), self.scratch_len(t, g)))?;
        if t == 0 {
            return Ok(());
        }
        let i = |what: &str, v: usize| crate::kernels::to_i32(OP, what, v);
        let (top_k, first, g, ne) = (i("top_k", top_k)?, i("first", first)?, i("g", g)?, i("experts", n_experts)?);
        let (stride, w2_offset) = (self.geometry.stride as i64, self.geometry.w2_offset as i64);
        let act = crate::moe::MoeActArgs::silu(self.inter);
        let (p13, p2) = (part(&self.geometry.w13, self.inter)?, part(&self.geometry.w2, self.hidden)?);
        let s = dev.stream();
        let routes = u32::try_from(t * g as usize).map_err(|_| GpuError::shape(OP, format!("{t} tokens")))?;
        let (xp, _gx) = x.device_ptr(s);
        let (hp, _gh) = h.device_ptr_mut(s);
        let (yp, _gy) = y.device_ptr_mut(s);
        let f = dev.function(&MOE_PCIE, "pcie_w13")?;
        let mut b = s.launch_builder(&f);
        b.arg(&records).arg(&stride).arg(&p13).arg(&act).arg(&xp).arg(&ids).arg(&top_k).arg(&first).arg(&g);
        b.arg(&ne).arg(&hp);
        let cfg = LaunchConfig {
            grid_dim: ((self.inter / 16) as u32, routes, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: self.w13_shared_bytes() as u32,
        };
        // SAFETY: the caller's contract for the addresses; x, h sized above.
        unsafe { b.launch(cfg) }.map_err(launch_err(OP))?;
        let acc = accumulate as i32;
        let f = dev.function(&MOE_PCIE, "pcie_w2")?;
        let mut b = s.launch_builder(&f);
        b.arg(&records).arg(&stride).arg(&w2_offset).arg(&p2).arg(&hp).arg(&ids).arg(&weights).arg(&top_k);
        b.arg(&first).arg(&g).arg(&ne).arg(&yp).arg(&acc);
        let cfg = LaunchConfig {
            grid_dim: (self.geometry.w2.row_blocks() as u32, t as u32, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: self.w2_shared_bytes() as u32,
        };
        // SAFETY: as above; y sized above.
        unsafe { b.launch(cfg) }.map_err(launch_err(OP))?;
        Ok(())
    }

    /// The scalar twin of [`PcieExperts::run`] on host bytes: `records` holds `n_experts`
    /// records `stride` apart, laid out as on the device; the other arguments as `run`'s. The
    /// weights come through krasis-quant's own unpackers, dequantised.
    #[allow(clippy::too_many_arguments)]
    pub fn reference(
        &self,
        records: &[u8],
        n_experts: usize,
        x: &[f32],
        t: usize,
        ids: &[i32],
        weights: &[f32],
        (top_k, first, g): (usize, usize, usize),
        y: &mut [f32],
        accumulate: bool,
    ) -> Result<(), GpuError> {
        let (hidden, inter) = (self.hidden, self.inter);
        let dot = |w: &[f32], row: usize, v: &[f32]| -> f32 {
            w[row * v.len()..][..v.len()].iter().zip(v).map(|(a, b)| a * b).sum()
        };
        for tok in 0..t {
            let yt = &mut y[tok * hidden..(tok + 1) * hidden];
            if !accumulate {
                yt.fill(0.0);
            }
            let xt = &x[tok * hidden..(tok + 1) * hidden];
            for slot in 0..g {
                let r = tok * top_k + first + slot;
                let Some(e) = usize::try_from(ids[r]).ok().filter(|&e| e < n_experts) else { continue };
                let [gate, up, down] = self.dense_expert(&records[e * self.geometry.stride..])?;
                let h: Vec<f32> = (0..inter)
                    .map(|o| {
                        let (a, b) = (dot(&gate, o, xt), dot(&up, o, xt));
                        weights[r] * (a / (1.0 + (-a).exp()) * b)
                    })
                    .collect();
                for (row, yo) in yt.iter_mut().enumerate() {
                    *yo += dot(&down, row, &h);
                }
            }
        }
        Ok(())
    }

    /// The gate, up (`[inter, hidden]`) and down (`[hidden, inter]`) weights of the record at
    /// `rec`, unpacked and dequantised.
    fn dense_expert(&self, rec: &[u8]) -> Result<[Vec<f32>; 3], GpuError> {
        let geo = &self.geometry;
        let bad = |e: krasis_quant::QuantError| GpuError::shape(OP, e.to_string());
        let (w13, w2) = (&rec[..geo.w13.bytes()], &rec[geo.w2_offset..][..geo.w2.bytes()]);
        Ok(if geo.w13.asym {
            let (gate, up) = int4_asym::unpack_w13(w13, &geo.w13).map_err(bad)?;
            let down = int4_asym::unpack(w2, &geo.w2).map_err(bad)?;
            [gate.dequantize(), up.dequantize(), down.dequantize()]
        } else {
            let (gate, up) = unpack_w13(w13, &geo.w13).map_err(bad)?;
            let down = unpack(w2, &geo.w2).map_err(bad)?;
            [dequantize(&gate), dequantize(&up), dequantize(&down)]
        })
    }
}

/// Experts `[gate, up, down]` laid out as the CPU expert cache lays out one layer's records
/// (w13 fused at 0, w2 at the next 64-byte boundary, records on 4 KiB boundaries), with their
/// geometry: test and tool input for [`PcieExperts`].
pub fn records_of(experts: &[[QuantizedMatrix; 3]]) -> Result<(Vec<u8>, CpuRecordGeometry), GpuError> {
    lay_out(experts.iter().map(|[gate, up, down]| {
        let (w13, l13) = pack_w13(gate, up)?;
        Ok((w13, l13, pack(down), PackedLayout::of(down)))
    }))
}

/// [`records_of`] for asymmetric INT4 g32 (`4a`) experts.
pub fn records_of_asym(experts: &[[AsymMatrix; 3]]) -> Result<(Vec<u8>, CpuRecordGeometry), GpuError> {
    lay_out(experts.iter().map(|[gate, up, down]| {
        let (w13, l13) = int4_asym::pack_w13(gate, up)?;
        Ok((w13, l13, int4_asym::pack(down), int4_asym::layout_of(down)))
    }))
}

type PackedExpert = (Vec<u8>, PackedLayout, Vec<u8>, PackedLayout);

fn lay_out(
    experts: impl Iterator<Item = Result<PackedExpert, krasis_quant::QuantError>>,
) -> Result<(Vec<u8>, CpuRecordGeometry), GpuError> {
    let mut records = Vec::new();
    let mut geometry = None;
    for e in experts {
        let (w13, l13, w2, l2) = e.map_err(|e| GpuError::shape(OP, e.to_string()))?;
        let w2_offset = w13.len().next_multiple_of(64);
        let stride = (w2_offset + w2.len()).next_multiple_of(4096);
        let start = records.len();
        records.resize(start + stride, 0);
        records[start..start + w13.len()].copy_from_slice(&w13);
        records[start + w2_offset..start + w2_offset + w2.len()].copy_from_slice(&w2);
        let g = CpuRecordGeometry { w13: l13, w2: l2, w2_offset, stride };
        if geometry.is_some_and(|first| first != g) {
            return Err(GpuError::shape(OP, "experts of different shapes in one layer"));
        }
        geometry = Some(g);
    }
    Ok((records, geometry.ok_or_else(|| GpuError::shape(OP, "no experts"))?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use krasis_quant::group::{group_size_for, quantize, test_data};

    /// The twin on `records` (with `dense`, each expert's dequantised gate, up and down) against
    /// an f64 forward of the dense weights: two tokens, routes 2..4 of 4, one route skipped, added
    /// to y.
    fn check_twin(what: &str, (records, geometry): (Vec<u8>, CpuRecordGeometry), dense: &[[Vec<f32>; 3]]) {
        let pe = PcieExperts::new(geometry).unwrap();
        let (n, hidden, inter) = (dense.len(), pe.hidden, pe.inter);
        let (t, top_k, first, g) = (2, 4, 2, 2);
        let x = test_data(t * hidden, 99, 1.0);
        let ids = [0, 1, 2, 0, 1, -1, 2, 1];
        let weights = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8];
        let mut y = test_data(t * hidden, 5, 1.0);
        let y0 = y.clone();
        pe.reference(&records, n, &x, t, &ids, &weights, (top_k, first, g), &mut y, true).unwrap();
        let dot = |w: &[f32], row: usize, v: &[f64]| -> f64 {
            (0..v.len()).map(|i| w[row * v.len() + i] as f64 * v[i]).sum()
        };
        for tok in 0..t {
            let xd: Vec<f64> = x[tok * hidden..(tok + 1) * hidden].iter().map(|&v| v as f64).collect();
            let mut want: Vec<f64> = y0[tok * hidden..(tok + 1) * hidden].iter().map(|&v| v as f64).collect();
            for slot in 0..g {
                let r = tok * top_k + first + slot;
                let Ok(e) = usize::try_from(ids[r]) else { continue };
                let [gw, uw, dw] = &dense[e];
                let hd: Vec<f64> = (0..inter)
                    .map(|o| {
                        let (a, b) = (dot(gw, o, &xd), dot(uw, o, &xd));
                        a / (1.0 + (-a).exp()) * b
                    })
                    .collect();
                for (row, w) in want.iter_mut().enumerate() {
                    *w += weights[r] as f64 * dot(dw, row, &hd);
                }
            }
            let got = &y[tok * hidden..(tok + 1) * hidden];
            let rms = (want.iter().map(|v| v * v).sum::<f64>() / hidden as f64).sqrt();
            let worst = got.iter().zip(&want).map(|(&a, &b)| (a as f64 - b).abs()).fold(0.0, f64::max);
            assert!(worst <= 1e-5 * rms, "{what} token {tok}: worst {worst:e} of rms {rms:e}");
        }
    }

    /// The twin reads the packed records as the quantised matrices say, on both widths and several
    /// group sizes (w2's from its own K, as the cache picks it).
    #[test]
    fn the_twin_reads_the_records_it_is_given() {
        for (bits, gs, hidden, inter) in
            [(Bits::Int4, 128, 256, 96), (Bits::Int8, 32, 96, 32), (Bits::Int4, 32, 224, 64), (Bits::Int8, 64, 128, 64)]
        {
            let gs2 = group_size_for(inter, gs).unwrap();
            let experts: Vec<[QuantizedMatrix; 3]> = (0..3u64)
                .map(|e| {
                    let seed = 7 + e * 3;
                    [
                        quantize(&test_data(inter * hidden, seed, 0.5), inter, hidden, bits, gs),
                        quantize(&test_data(inter * hidden, seed + 1, 0.5), inter, hidden, bits, gs),
                        quantize(&test_data(hidden * inter, seed + 2, 0.5), hidden, inter, bits, gs2),
                    ]
                })
                .collect();
            let dense: Vec<[Vec<f32>; 3]> = experts.iter().map(|m| m.each_ref().map(dequantize)).collect();
            check_twin(&format!("{bits:?} g{gs}"), records_of(&experts).unwrap(), &dense);
        }
    }

    /// The same for asymmetric INT4 g32 (`4a`): the minimums join each group's sum.
    #[test]
    fn the_twin_reads_int4a_records() {
        for (hidden, inter) in [(256, 96), (96, 32)] {
            let experts: Vec<[AsymMatrix; 3]> = (0..3u64)
                .map(|e| {
                    let q = |n: usize, seed: u64, rows: usize, k: usize| {
                        int4_asym::quantize(&test_data(n, seed, 0.5), rows, k).unwrap()
                    };
                    let seed = 11 + e * 3;
                    [
                        q(inter * hidden, seed, inter, hidden),
                        q(inter * hidden, seed + 1, inter, hidden),
                        q(hidden * inter, seed + 2, hidden, inter),
                    ]
                })
                .collect();
            let dense: Vec<[Vec<f32>; 3]> = experts.iter().map(|m| m.each_ref().map(|a| a.dequantize())).collect();
            check_twin(&format!("4a {hidden}x{inter}"), records_of_asym(&experts).unwrap(), &dense);
        }
    }

    #[test]
    fn records_it_cannot_read_are_refused() {
        let gate = quantize(&test_data(32 * 64, 1, 0.5), 32, 64, Bits::Int4, 32);
        let down = quantize(&test_data(64 * 64, 2, 0.5), 64, 64, Bits::Int4, 32);
        let (_, l13) = pack_w13(&gate, &gate).unwrap();
        let geometry = CpuRecordGeometry { w13: l13, w2: PackedLayout::of(&down), w2_offset: 0, stride: 0 };
        let e = PcieExperts::new(geometry).unwrap_err().to_string();
        assert!(e.contains("not one expert's parts"), "{e}");
        let asym = PackedLayout::new_int4_asym(64, 32).unwrap();
        let e = PcieExperts::new(CpuRecordGeometry { w13: l13, w2: asym, w2_offset: 0, stride: 0 }).unwrap_err();
        assert!(e.to_string().contains("not INT4/INT8 or `4a` alike"), "{e}");
    }
}
