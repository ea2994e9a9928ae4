//! Routed experts in BF16 on the GPU through a simple grouped path with no host synchronisation:
//! the expert ids stay on the device, and the kernels in `kernels/moe.cu` group the
//! (token, slot) pairs by expert (count / offsets / scatter), then run one block per
//! (expert tile of `MOE_TM` pairs, `MOE_BN` or `MOE_BN_DOWN` output columns), so each selected
//! expert's weights are read once per tile: once in total at decode (t = 1), once per 64 routed
//! tokens in prefill.
//! The tiles multiply on the tensor cores (`mma.sync`, BF16 operands, f32 accumulators); each f32
//! activation enters as two BF16 halves (within 2^-17 of it, two products each), so the products
//! keep about f32's accuracy; the SwiGLU intermediate is stored as its two halves too (f32 on the
//! decode path below). The result is deterministic (see the kernel file): per pair, each output
//! is one thread's accumulator in a fixed order, and the combine sums the top-k slots in
//! ascending order.
//!
//! Decode and tiny batches (at most [`DECODE_MAX_PAIRS`] pairs in a pass) take a GEMV-style path
//! instead: no grouping, each pair streams its expert's gate/up rows and then its down rows with
//! 16-byte coalesced loads, one warp per output element (several rows per warp in flight), then
//! the same combine. At t = 1 each selected expert's weights are still read once, now at close
//! to streaming bandwidth rather than through shared-memory tiles.
//!
//! INT4 / INT8 experts (the GPU tile layout of [`krasis_quant::gpu_layout`]) compute what the
//! CPU's expert kernels compute: the activations are quantised per weight group into a value and
//! a residual INT8 row with the CPU quantiser's steps (`moe_quant_rows`, or inside the decode
//! kernels), each group's products are exact integer sums on the tensor cores (`mma.sync`
//! m16n8k32 s8) and the sums are scaled per group in f32. So an expert's output is the same on
//! either device up to f32 summation order, and a strategy that runs some experts on the CPU
//! gives `persistent`'s logits (≤ 8.6e-4 relative L2 on the oracle fixtures, docs/BENCHMARKS.md).
//!
//! Ids outside `[0, n_experts)` never index the weights: such a pair is left out of the grouping
//! and its token's output row is NaN (as the embedding gather does for bad token ids).

use std::sync::atomic::{AtomicBool, Ordering};

use cudarc::driver::sys::CUfunction_attribute_enum as FnAttr;
use cudarc::driver::{DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg};
use krasis_core::spec::ExpertActivation;

use krasis_quant::fp4::{Fp4Kind, Fp4Matrix};
use krasis_quant::gpu_layout::{self, GpuLayout};
use krasis_quant::{Bits, QuantizedMatrix};

use crate::device::kernel_args;
use crate::kernels::{KernelSource, DEFAULT_SMEM_LIMIT, HEADERS};
use crate::linear::{align_up, check, launch_err, to_i32, Carve, GemmContext};
use crate::{DeviceBuffer, GpuDevice, GpuError};

pub const MOE: KernelSource = KernelSource {
    name: "moe",
    src: include_str!("../kernels/moe.cu"),
    headers: HEADERS,
    options: &[],
    functions: &[
        "moe_route",
        "moe_split_rows",
        "moe_quant_rows",
        "moe_gate_up",
        "moe_down",
        "moe_combine",
        "moe_dec_gate_up",
        "moe_dec_down",
    ],
};

/// The INT4 tiles: a program of their own (the same file), as are the INT8 tiles and the
/// quantised decode kernels, so the four compile in parallel (as one program, 7.8–10.4 s of a
/// fresh H200 machine's cold start, the longest of all).
pub const MOE_Q4_TILES: KernelSource = KernelSource {
    name: "moe_q4_tiles",
    src: include_str!("../kernels/moe.cu"),
    headers: HEADERS,
    options: &["-DMOE_QTILES=4"],
    functions: &[
        "moe_q4_gate_up_v0",
        "moe_q4_down_v0",
        "moe_q4_gate_up_v1",
        "moe_q4_down_v1",
        "moe_q4_gate_up_v2",
        "moe_q4_down_v2",
    ],
};

/// The INT8 tiles (see [`MOE_Q4_TILES`]).
pub const MOE_Q8_TILES: KernelSource = KernelSource {
    name: "moe_q8_tiles",
    src: include_str!("../kernels/moe.cu"),
    headers: HEADERS,
    options: &["-DMOE_QTILES=8"],
    functions: &[
        "moe_q8_gate_up_v0",
        "moe_q8_down_v0",
        "moe_q8_gate_up_v1",
        "moe_q8_down_v1",
        "moe_q8_gate_up_v2",
        "moe_q8_down_v2",
    ],
};

/// The quantised decode kernels, both widths (see [`MOE_Q4_TILES`]).
pub const MOE_QDEC: KernelSource = KernelSource {
    name: "moe_qdec",
    src: include_str!("../kernels/moe.cu"),
    headers: HEADERS,
    options: &["-DMOE_QDEC"],
    functions: &["moe_q4_dec_gate_up", "moe_q4_dec_down", "moe_q8_dec_gate_up", "moe_q8_dec_down"],
};

/// The FP4 tiles, MXFP4 and NVFP4 (the default tile shape only; see [`MOE_Q4_TILES`]).
pub const MOE_FP4_TILES: KernelSource = KernelSource {
    name: "moe_fp4_tiles",
    src: include_str!("../kernels/moe.cu"),
    headers: HEADERS,
    options: &["-DMOE_QTILES=5"],
    functions: &["moe_qmx_gate_up_v1", "moe_qmx_down_v1", "moe_qnv_gate_up_v1", "moe_qnv_down_v1"],
};

/// The FP4 decode kernels (see [`MOE_Q4_TILES`]).
pub const MOE_QDEC_FP4: KernelSource = KernelSource {
    name: "moe_qdec_fp4",
    src: include_str!("../kernels/moe.cu"),
    headers: HEADERS,
    options: &["-DMOE_QDEC_FP4"],
    functions: &["moe_qmx_dec_gate_up", "moe_qmx_dec_down", "moe_qnv_dec_gate_up", "moe_qnv_dec_down"],
};

/// Whether program `k` runs FP4 experts only (a loader whose experts are not FP4 need not compile
/// it ahead of use).
pub fn is_fp4_program(k: &KernelSource) -> bool {
    k.name == MOE_FP4_TILES.name || k.name == MOE_QDEC_FP4.name
}

/// The kernels' weight format code (`BITS` / `bits` in moe.cu: 4, 8, `MOE_FMT_MXFP4`,
/// `MOE_FMT_NVFP4`).
fn format_code(l: &GpuLayout) -> i32 {
    match (l.fp4, l.bits) {
        (Some(Fp4Kind::Mxfp4), _) => 5,
        (Some(Fp4Kind::Nvfp4), _) => 6,
        (None, Bits::Int4) => 4,
        (None, Bits::Int8) => 8,
    }
}

/// A layout's format for allocation names: `Int4`, `Int8`, `mxfp4`, `nvfp4`.
fn format_name(l: &GpuLayout) -> String {
    l.fp4.map_or(format!("{:?}", l.bits), |k| k.to_string())
}

/// The quantised kernels of a layout's format: (tiles program, tile entry points, decode
/// program, decode entry points); FP4 has the default tile shape only ([`FP4_QTILE_VARIANT`]).
fn quant_kernels(
    l: &GpuLayout,
    v: &QTileVariant,
) -> (&'static KernelSource, [&'static str; 2], &'static KernelSource, [&'static str; 2]) {
    match (l.fp4, l.bits) {
        (Some(Fp4Kind::Mxfp4), _) => (
            &MOE_FP4_TILES,
            ["moe_qmx_gate_up_v1", "moe_qmx_down_v1"],
            &MOE_QDEC_FP4,
            ["moe_qmx_dec_gate_up", "moe_qmx_dec_down"],
        ),
        (Some(Fp4Kind::Nvfp4), _) => (
            &MOE_FP4_TILES,
            ["moe_qnv_gate_up_v1", "moe_qnv_down_v1"],
            &MOE_QDEC_FP4,
            ["moe_qnv_dec_gate_up", "moe_qnv_dec_down"],
        ),
        (None, Bits::Int4) => (&MOE_Q4_TILES, v.int4, &MOE_QDEC, ["moe_q4_dec_gate_up", "moe_q4_dec_down"]),
        (None, Bits::Int8) => (&MOE_Q8_TILES, v.int8, &MOE_QDEC, ["moe_q8_dec_gate_up", "moe_q8_dec_down"]),
    }
}

/// Pairs per tile (`MOE_TM` in moe.cu): 64 pairs (one 16-row MMA slice per warp) share each
/// weight chunk in shared memory.
const MOE_TM: usize = 64;
/// Activation groups per `moe_quant_rows` block (`MOE_QUANT_WARPS` in moe.cu): one warp each.
const MOE_QUANT_WARPS: usize = 4;
/// Output columns per gate/up block (`MOE_BN` in moe.cu).
const MOE_BN: usize = 64;
/// Output columns per down block (`MOE_BN_DOWN` in moe.cu).
const MOE_BN_DOWN: usize = 128;
/// Weight rows are padded to a multiple of this (`MOE_PAD` in moe.cu): the tiles' k chunks and
/// output column blocks divide it, so they never read past a row.
const MOE_PAD: usize = 64;
/// Threads of a GEMM block (`MOE_THREADS` in moe.cu): 4 warps.
const MOE_THREADS: u32 = 128;
/// BF16 row stride of a staged chunk (`MOE_SK` in moe.cu: the k chunk of 64 plus 8).
const MOE_SK: usize = 72;

/// Shared-memory buffers of the tiles' k loop (`MOE_STAGES` in moe.cu).
const MOE_STAGES: usize = 2;

/// Dynamic shared memory of a tile block: per buffer the weight rows (gate and up rows for the
/// gate/up step) and the pairs' two halves of A.
fn tile_smem(gated: bool) -> usize {
    let weight_rows = if gated { 2 * MOE_BN } else { MOE_BN_DOWN };
    MOE_STAGES * (weight_rows + 2 * MOE_TM) * MOE_SK * 2
}

/// Dynamic shared memory of a quantised tile block (`moe_qtile`) for weights of layout `l`: per
/// buffer the variant's (panel, chunk) weight blocks of 64 × 64 elements, their scales (per k32
/// step 64 of each of its groups: one, or NVFP4's two; f16, or f32 for FP4), the pairs' activation
/// scales (an f32 pair per step and group) and INT8 A rows (value and residual).
fn qtile_smem(l: &GpuLayout, v: QTileVariant) -> usize {
    let block = gpu_layout::PANEL_ROWS * gpu_layout::CHUNK_K * l.bits.bits() as usize / 8;
    let steps = v.chunks_per_stage * gpu_layout::CHUNK_K / 32;
    let gps = if l.gs == 16 { 2 } else { 1 };
    let scales = v.panels * steps * gpu_layout::PANEL_ROWS * l.scale_bytes() * gps + v.pairs * steps * 8 * gps;
    // A staged activation row: the stage's k plus 16 bytes (QSK in moe.cu).
    let a_row = v.chunks_per_stage * gpu_layout::CHUNK_K + 16;
    let stage = v.panels * v.chunks_per_stage * block + scales + 2 * v.pairs * a_row;
    // Results in shared memory: 32 f32 a thread (2·panels·pairs threads).
    let results = if v.results_shared { 2 * v.panels * v.pairs * 32 * 4 } else { 0 };
    v.stages * stage + results
}

/// Bytes of `rows` activation rows of `k_pad` quantised by `moe_quant_rows` in groups of `gs`:
/// two INT8 rows each, then the (value, residual) f32 scales per group.
fn quant_rows_bytes(rows: usize, k_pad: usize, gs: usize) -> [usize; 2] {
    [rows * 2 * k_pad, rows * (k_pad / gs) * 8]
}

/// A shape of the quantised tiles (`moe_qtile<.., TM, PB, S, CPS, YS>`): pairs per tile, 64-row
/// panels per block (2·PB·TM/32 warps), shared-memory buffers, chunks of 64 k a buffer and whether
/// the f32 results live in shared memory, with its entry points.
#[derive(Clone, Copy, Debug)]
struct QTileVariant {
    pairs: usize,
    panels: usize,
    stages: usize,
    chunks_per_stage: usize,
    results_shared: bool,
    int4: [&'static str; 2],
    int8: [&'static str; 2],
}

/// The variants compiled (`MOE_Q_ENTRIES` in moe.cu). Measured on an H200 (V2-Lite layer, INT4,
/// t = 2048, one run): results in registers (v0) 1586 µs, in shared memory (v1, no spills) 1498,
/// two chunks a buffer (v2) 1536; 64-pair tiles of 16 warps, one block an SM, 1782 (not kept).
const QTILE_VARIANTS: [QTileVariant; 3] = [
    QTileVariant {
        pairs: 32,
        panels: 4,
        stages: 3,
        chunks_per_stage: 1,
        results_shared: false,
        int4: ["moe_q4_gate_up_v0", "moe_q4_down_v0"],
        int8: ["moe_q8_gate_up_v0", "moe_q8_down_v0"],
    },
    QTileVariant {
        pairs: 32,
        panels: 4,
        stages: 3,
        chunks_per_stage: 1,
        results_shared: true,
        int4: ["moe_q4_gate_up_v1", "moe_q4_down_v1"],
        int8: ["moe_q8_gate_up_v1", "moe_q8_down_v1"],
    },
    QTileVariant {
        pairs: 32,
        panels: 4,
        stages: 2,
        chunks_per_stage: 2,
        results_shared: true,
        int4: ["moe_q4_gate_up_v2", "moe_q4_down_v2"],
        int8: ["moe_q8_gate_up_v2", "moe_q8_down_v2"],
    },
];

/// The variant the quantised tiles use unless a test or tuning run picks another.
const DEFAULT_QTILE_VARIANT: usize = 1;
/// The one variant the FP4 tiles have (`MOE_QTILES == 5` in moe.cu).
const FP4_QTILE_VARIANT: usize = 1;

/// Dynamic shared memory of a quantised decode-path block (`moe_qdec`) of `threads` threads: the
/// activation row quantised (two INT8 rows over `chunks` chunks of 64, and the scale pairs of up
/// to four groups a chunk: NVFP4's groups of 16), and every warp's partial sums of a panel.
fn qdec_smem(chunks: usize, threads: u32) -> usize {
    let k_pad = chunks * gpu_layout::CHUNK_K;
    2 * k_pad + k_pad / 16 * 8 + (threads as usize / 32) * gpu_layout::PANEL_ROWS * 4
}

/// Threads of a quantised decode-path gate/up block (`MOE_QDEC_GU_THREADS` in moe.cu): 16 warps
/// splitting K, so a V2-Lite layer's 6 pairs × 22 panels give every SM 16 warps of loads.
const MOE_QDEC_GU_THREADS: u32 = 512;
/// The down block's (`MOE_QDEC_DN_THREADS`): 8 warps, so its 6 × 32 blocks run in one wave.
const MOE_QDEC_DN_THREADS: u32 = 256;

/// A quantised matrix's leading kernel arguments (`moe_qtile` / `moe_qdec`): its device weights
/// and scales, bytes and scales per expert, chunks, groups, group size and panels.
struct QMatrixArgs {
    w: u64,
    s: u64,
    expert_bytes: i64,
    expert_scales: i64,
    chunks: i32,
    groups: i32,
    gs: i32,
    panels: i32,
}

impl QMatrixArgs {
    /// The codes at `w` and scales at `s` of expert 0, expert after expert (the arrays layout).
    fn new(op: &'static str, l: &GpuLayout, w: u64, s: u64) -> Result<Self, GpuError> {
        Self::strided(op, l, w, s, l.weight_bytes(), l.scale_count())
    }

    /// The same with the experts `expert_bytes` bytes / `expert_scales` scales apart (records).
    fn strided(
        op: &'static str,
        l: &GpuLayout,
        w: u64,
        s: u64,
        expert_bytes: usize,
        expert_scales: usize,
    ) -> Result<Self, GpuError> {
        let n = |v: usize, what| to_i32(op, what, v);
        Ok(QMatrixArgs {
            w,
            s,
            expert_bytes: expert_bytes as i64,
            expert_scales: expert_scales as i64,
            chunks: n(l.chunks(), "chunks")?,
            groups: n(l.groups(), "groups")?,
            gs: l.gs as i32,
            panels: n(l.panels(), "panels")?,
        })
    }

    /// The arguments in the kernels' order, as [`GpuDevice::launch_dependent`] takes them
    /// (pointers to the values).
    fn params(&self) -> [*mut std::ffi::c_void; 8] {
        kernel_args![
            &self.w,
            &self.s,
            &self.expert_bytes,
            &self.expert_scales,
            &self.chunks,
            &self.groups,
            &self.gs,
            &self.panels
        ]
    }
}

/// Copies `host` into element range `e · len..(e + 1) · len` of `dst` (expert `e`'s slot).
fn copy_in<T: cudarc::driver::DeviceRepr>(
    dev: &GpuDevice,
    dst: &mut DeviceBuffer<T>,
    e: usize,
    host: &[T],
) -> Result<(), GpuError> {
    let n = host.len();
    let mut d = dst.slice_mut().slice_mut(e * n..(e + 1) * n);
    dev.stream().memcpy_htod(host, &mut d).map_err(|err| GpuError::driver("cuMemcpyHtoDAsync", err))
}

/// Most experts `moe_route` can count in shared memory (`MOE_MAX_EXPERTS` in moe.cu).
pub const MOE_MAX_EXPERTS: usize = 4096;
/// Threads of the single routing block.
const ROUTE_THREADS: u32 = 1024;
/// Scratch (f32 intermediates of the pairs, quantised rows) per pass: long prompts are processed
/// in passes of as many tokens as fit, so the scratch stays bounded. A pass takes the largest of
/// these that leaves [`MOE_PASS_HEADROOM_BYTES`] of the VRAM budget, else the last: bigger passes
/// fill more of every expert's tiles and pay the per-pass launches less often. Measured on an H200
/// (V2-Lite, INT4 experts resident, whole-model prefill): 128 MiB (1152 tokens a pass) 37.7K /
/// 36.3K tok/s at 2K / 8K tokens, 512 MiB 40.1K / 39.9K, 1 GiB 39.9K / 40.5K.
const MOE_PASS_SCRATCH_STEPS: [usize; 4] = [1 << 30, 512 << 20, 256 << 20, 128 << 20];
/// VRAM a bigger pass scratch must leave in the budget for the step's other allocations (a
/// 10K-token MLA prefill of V2-Lite takes ≈ 1.3 GB).
const MOE_PASS_HEADROOM_BYTES: usize = 2 << 30;
/// Default largest pass (in (token, slot) pairs) that takes the decode path: there every pair
/// reads its expert's rows on its own, which wins while few pairs share an expert (decode, small
/// batches); beyond, the grouped tiles share each weight chunk between pairs. Measured on H200
/// (128 experts, hidden 2048, inter 768, top-8): decode 3.7× faster at 8 pairs, still 1.8× at
/// 128; 64 keeps a margin for shapes where pairs repeat experts more.
pub const DECODE_MAX_PAIRS: usize = 64;
/// Threads of a decode-path block (`MOE_DEC_THREADS` in moe.cu).
const MOE_DEC_THREADS: u32 = 128;
/// Intermediate columns per decode-path gate/up block: 4 warps × `MOE_DEC_GU_COLS` (2) in moe.cu.
const MOE_DEC_GU_BLOCK_COLS: usize = 8;
/// Hidden rows per decode-path down block: 4 warps × `MOE_DEC_DN_ROWS` (4) in moe.cu.
const MOE_DEC_DN_BLOCK_ROWS: usize = 16;
/// Threads per block of the combine (a block per token and chunk of this many columns).
const COMBINE_THREADS: u32 = 256;
/// Threads per block of `moe_split_rows` (a block per token and chunk of this many columns).
const SPLIT_THREADS: u32 = 256;

/// Where a layer's expert weights live on the device, in which format.
enum ExpertWeights {
    Bf16 {
        /// `[E, 2·inter, hidden_pad]`: gate rows then up rows of each expert, zero padded.
        w13: DeviceBuffer<u16>,
        /// `[E, hidden, inter_pad]`, zero padded.
        w2: DeviceBuffer<u16>,
    },
    Quant(Box<QuantExperts>),
    Records(Box<RecordExperts>),
}

/// INT4/INT8 experts as GPU expert cache records, verbatim, one buffer: expert `e`'s record at
/// `e · stride` holds w13's tile codes then their f16 scales, and from `w2_offset` w2's codes then
/// scales. The kernels take per-expert strides, so they read the records in place, and a run of
/// experts (contiguous in the cache) streams in one copy.
struct RecordExperts {
    l13: GpuLayout,
    l2: GpuLayout,
    buf: DeviceBuffer<u8>,
    stride: usize,
    w2_offset: usize,
}

/// INT4/INT8 experts in the GPU tile layout ([`krasis_quant::gpu_layout`]), expert after expert.
struct QuantExperts {
    /// `[2·inter_pad, hidden]`: gate rows, zero rows up to `inter_pad`, up rows, zero rows.
    l13: GpuLayout,
    /// `[hidden, inter]`.
    l2: GpuLayout,
    w13: DeviceBuffer<u8>,
    s13: DeviceBuffer<u16>,
    w2: DeviceBuffer<u8>,
    s2: DeviceBuffer<u16>,
}

/// The gate/up kernels' activation argument (`MoeAct` in moe.cu; same field order and types).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct MoeActArgs {
    b13: u64,
    inter: i32,
    clamped: i32,
    alpha: f32,
    limit: f32,
}

// SAFETY: plain-old-data with the C layout of the kernel's struct.
unsafe impl DeviceRepr for MoeActArgs {}

impl MoeActArgs {
    /// `silu(g) · u` without biases, for experts of `inter` intermediate columns.
    pub(crate) fn silu(inter: usize) -> MoeActArgs {
        MoeActArgs { inter: inter as i32, ..MoeActArgs::default() }
    }
}

/// The routed experts of one MoE layer (BF16, INT8 or INT4), resident on the GPU.
pub struct GpuExperts {
    name: String,
    n_experts: usize,
    /// Experts `[0, stored)` have storage (all of them but for [`GpuExperts::new_records_first`]).
    stored: usize,
    hidden: usize,
    inter: usize,
    weights: ExpertWeights,
    hidden_pad: usize,
    inter_pad: usize,
    /// Tokens per pass (bounds the scratch); see [`GpuExperts::set_max_tokens_per_pass`].
    max_pass_tokens: usize,
    /// Passes of at most this many pairs take the decode path; see [`DECODE_MAX_PAIRS`].
    decode_max_pairs: usize,
    /// Whether the tile kernels' dynamic shared-memory limit has been raised.
    tile_smem_set: AtomicBool,
    /// Shape of the quantised tiles.
    qvariant: QTileVariant,
    /// The activation of the gate and up sums ([`GpuExperts::set_activation`]).
    activation: ExpertActivation,
    /// Per expert the gate biases then the up biases, f32 `[n_experts, 2·inter]`, and the down
    /// biases `[n_experts, hidden]` ([`GpuExperts::set_biases`]).
    biases: Option<(DeviceBuffer<f32>, DeviceBuffer<f32>)>,
}

impl std::fmt::Debug for GpuExperts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuExperts")
            .field("name", &self.name)
            .field("n_experts", &self.n_experts)
            .field("hidden", &self.hidden)
            .field("inter", &self.inter)
            .finish()
    }
}

const OP_UPLOAD_Q: &str = "GpuExperts::upload_quantized_expert";

/// One expert's weights in the GPU tile layout, ready to copy in.
pub struct PackedExpert {
    w13: Vec<u8>,
    s13: Vec<u16>,
    w2: Vec<u8>,
    s2: Vec<u16>,
}

impl PackedExpert {
    /// The expert as a GPU expert cache record: gate+up codes, their f16 scales (little-endian
    /// bits), then down codes and their scales; the two parts are
    /// [`QuantExpertLayout::record_parts`] long.
    pub fn to_record(&self) -> Vec<u8> {
        let mut r = Vec::with_capacity(self.w13.len() + self.w2.len() + 2 * (self.s13.len() + self.s2.len()));
        for (w, s) in [(&self.w13, &self.s13), (&self.w2, &self.s2)] {
            r.extend_from_slice(w);
            r.extend(s.iter().flat_map(|v| v.to_le_bytes()));
        }
        r
    }
}

/// The f16 scale bits of a record part, read little-endian (any alignment).
fn scale_bits(bytes: &[u8]) -> Vec<u16> {
    bytes.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect()
}

/// Bytes of an expert's two record parts for these layouts: each part its codes, then its
/// scales' bytes.
fn record_parts(l13: &GpuLayout, l2: &GpuLayout) -> (usize, usize) {
    (l13.weight_bytes() + scale_buffer_bytes(l13), l2.weight_bytes() + scale_buffer_bytes(l2))
}

/// Bytes of a layout's scales (f16, or f32 for FP4).
fn scale_buffer_bytes(l: &GpuLayout) -> usize {
    l.scale_bytes() * l.scale_count()
}

/// A layout's scales as the u16 elements the device buffers hold (an f32 is two, low half first).
fn scale_u16s(l: &GpuLayout) -> usize {
    scale_buffer_bytes(l) / 2
}

/// The quantised arrays of `weights`, for the uploads only they take: records-layout experts are
/// filled in runs of whole records ([`GpuExperts::copy_record_run_async`]); BF16 experts get
/// `bf16_hint`.
fn quant_arrays<'w>(
    weights: &'w mut ExpertWeights,
    op: &'static str,
    name: &str,
    bf16_hint: &str,
) -> Result<&'w mut QuantExperts, GpuError> {
    match weights {
        ExpertWeights::Quant(qw) => Ok(qw),
        ExpertWeights::Records(_) => Err(GpuError::shape(
            op,
            format!("{name}: the experts are cache records in place; copy runs of whole records in"),
        )),
        ExpertWeights::Bf16 { .. } => Err(GpuError::shape(op, format!("{name}: the experts are BF16; {bf16_hint}"))),
    }
}

/// Refuses record parts of other sizes than the layouts' ([`record_parts`]), naming `what()`.
fn check_record_parts(
    op: &'static str,
    what: impl FnOnce() -> String,
    got: (usize, usize),
    want: (usize, usize),
) -> Result<(), GpuError> {
    check(op, got == want, || {
        format!("{}: record parts of {} + {} bytes, this layout needs {} + {}", what(), got.0, got.1, want.0, want.1)
    })
}

/// The layout of a layer's quantised experts: packs experts on any thread.
#[derive(Clone, Debug)]
pub struct QuantExpertLayout {
    name: String,
    hidden: usize,
    inter: usize,
    /// `[2·inter_pad, hidden]`: gate rows, zero rows up to `inter_pad`, up rows, zero rows.
    l13: GpuLayout,
    l2: GpuLayout,
}

impl QuantExpertLayout {
    /// The layout of a layer's experts quantised to `bits`, groups of `gs13` along `hidden` (gate,
    /// up) and `gs2` along `inter` (down). Needs no device: `krasis convert` packs the GPU expert
    /// cache on machines without one.
    pub fn new(name: &str, hidden: usize, inter: usize, bits: Bits, gs13: usize, gs2: usize) -> Result<Self, GpuError> {
        const OP: &str = "QuantExpertLayout::new";
        check(OP, hidden > 0 && inter > 0, || format!("{name}: empty shape (hidden {hidden}, inter {inter})"))?;
        let layout =
            |rows, k, gs| GpuLayout::new(rows, k, gs, bits).map_err(|e| GpuError::shape(OP, format!("{name}: {e}")));
        Ok(QuantExpertLayout {
            name: name.to_string(),
            hidden,
            inter,
            l13: layout(2 * align_up(inter, MOE_PAD), hidden, gs13)?,
            l2: layout(hidden, inter, gs2)?,
        })
    }

    /// The layout of a layer's experts kept in a 4-bit float format (MXFP4 groups of 32, NVFP4
    /// groups of 16 along both K), in the GPU FP4 tile layout ([`krasis_quant::gpu_layout`]).
    pub fn new_fp4(name: &str, hidden: usize, inter: usize, kind: Fp4Kind) -> Result<Self, GpuError> {
        const OP: &str = "QuantExpertLayout::new_fp4";
        check(OP, hidden > 0 && inter > 0, || format!("{name}: empty shape (hidden {hidden}, inter {inter})"))?;
        let layout = |rows, k| {
            GpuLayout::new_fp4(rows, k, kind).map_err(|e| GpuError::shape(OP, format!("{name}: {kind}: {e}")))
        };
        Ok(QuantExpertLayout {
            name: name.to_string(),
            hidden,
            inter,
            l13: layout(2 * align_up(inter, MOE_PAD), hidden)?,
            l2: layout(hidden, inter)?,
        })
    }

    /// The 4-bit float format of these experts, if they are in one.
    pub fn fp4(&self) -> Option<Fp4Kind> {
        self.l2.fp4
    }

    /// The same layout under another name (the one allocations and errors carry).
    pub fn named(&self, name: &str) -> Self {
        QuantExpertLayout { name: name.to_string(), ..self.clone() }
    }

    /// Bytes of one expert's record in the GPU expert cache: (gate+up part, down part), each the
    /// packed codes followed by their scales' bytes ([`PackedExpert::to_record`]).
    pub fn record_parts(&self) -> (usize, usize) {
        record_parts(&self.l13, &self.l2)
    }

    /// Expert `e`'s FP4 `gate`, `up` `[inter, hidden]` and `down` `[hidden, inter]`, as stored,
    /// in the GPU FP4 tile layout ([`QuantExpertLayout::new_fp4`] experts only).
    pub fn pack_fp4(
        &self,
        e: usize,
        gate: &Fp4Matrix,
        up: &Fp4Matrix,
        down: &Fp4Matrix,
    ) -> Result<PackedExpert, GpuError> {
        let (h, i, name, l13, l2) = (self.hidden, self.inter, &self.name, &self.l13, &self.l2);
        let Some(kind) = l2.fp4 else {
            return Err(GpuError::shape(OP_UPLOAD_Q, format!("{name}: these experts are integer, not FP4")));
        };
        for (what, m, rows, k) in [("gate", gate, i, h), ("up", up, i, h), ("down", down, h, i)] {
            check(OP_UPLOAD_Q, (m.kind, m.rows, m.k) == (kind, rows, k), || {
                format!("{name} expert {e}: {what} is {}x{} {}, not {rows}x{k} {kind}", m.rows, m.k, m.kind)
            })?;
        }
        let pack = |parts: &[(&Fp4Matrix, usize)], l: &GpuLayout| {
            let (mut w, mut s) = (vec![0u8; l.weight_bytes()], vec![0u32; l.scale_count()]);
            gpu_layout::pack_fp4_rows_into(parts, l, &mut w, &mut s)
                .map_err(|err| GpuError::shape(OP_UPLOAD_Q, format!("{name} expert {e}: {err}")))?;
            Ok::<_, GpuError>((w, s.iter().flat_map(|v| [*v as u16, (*v >> 16) as u16]).collect::<Vec<u16>>()))
        };
        // Gate rows, then up rows from inter_pad (padding rows code 0, scale 0).
        let (w13, s13) = pack(&[(gate, 0), (up, l13.rows / 2)], l13)?;
        let (w2, s2) = pack(&[(down, 0)], l2)?;
        Ok(PackedExpert { w13, s13, w2, s2 })
    }

    /// The inverse of [`QuantExpertLayout::pack`] then [`PackedExpert::to_record`]: the gate, up
    /// and down a record's two parts hold.
    pub fn unpack_record(&self, w13: &[u8], w2: &[u8]) -> Result<[QuantizedMatrix; 3], GpuError> {
        const OP: &str = "QuantExpertLayout::unpack_record";
        let (l13, l2, name) = (&self.l13, &self.l2, &self.name);
        check(OP, l2.fp4.is_none(), || format!("{name}: FP4 records hold codes, not integer matrices"))?;
        check_record_parts(OP, || name.clone(), (w13.len(), w2.len()), self.record_parts())?;
        let unpack = |bytes: &[u8], l: &GpuLayout| {
            let b = l.weight_bytes();
            gpu_layout::unpack(&bytes[..b], &scale_bits(&bytes[b..]), l)
                .map_err(|e| GpuError::shape(OP, format!("{name}: {e}")))
        };
        let stacked = unpack(w13, l13)?;
        let (h, i, ip, ng) = (self.hidden, self.inter, l13.rows / 2, self.hidden / l13.gs);
        let rows = |row0: usize| QuantizedMatrix {
            rows: i,
            k: h,
            gs: l13.gs,
            bits: l13.bits,
            q: stacked.q[row0 * h..(row0 + i) * h].to_vec(),
            scales: stacked.scales[row0 * ng..(row0 + i) * ng].to_vec(),
        };
        Ok([rows(0), rows(ip), unpack(w2, l2)?])
    }

    /// Expert `e`'s `gate`, `up` `[inter, hidden]` and `down` `[hidden, inter]` in the GPU tile
    /// layout; their widths and group sizes must be the layer's.
    pub fn pack(
        &self,
        e: usize,
        gate: &QuantizedMatrix,
        up: &QuantizedMatrix,
        down: &QuantizedMatrix,
    ) -> Result<PackedExpert, GpuError> {
        let (h, i, name, l13, l2) = (self.hidden, self.inter, &self.name, &self.l13, &self.l2);
        for (what, m, rows, k, gs) in
            [("gate", gate, i, h, l13.gs), ("up", up, i, h, l13.gs), ("down", down, h, i, l2.gs)]
        {
            check(OP_UPLOAD_Q, (m.rows, m.k, m.gs, m.bits) == (rows, k, gs, l2.bits), || {
                format!(
                    "{name} expert {e}: {what} is {}x{} {:?} g{}, not {rows}x{k} {:?} g{gs}",
                    m.rows, m.k, m.bits, m.gs, l2.bits
                )
            })?;
        }
        // Gate and up stacked, each padded to inter_pad rows (q 0, scale 0).
        let (ip, ng) = (l13.rows / 2, h / l13.gs);
        let mut stacked = QuantizedMatrix {
            rows: l13.rows,
            k: h,
            gs: l13.gs,
            bits: l13.bits,
            q: vec![0; l13.rows * h],
            scales: vec![half::f16::ZERO; l13.rows * ng],
        };
        for (m, row0) in [(gate, 0), (up, ip)] {
            stacked.q[row0 * h..(row0 + i) * h].copy_from_slice(&m.q);
            stacked.scales[row0 * ng..(row0 + i) * ng].copy_from_slice(&m.scales);
        }
        let (w13, s13) = gpu_layout::pack(&stacked);
        let (w2, s2) = gpu_layout::pack(down);
        Ok(PackedExpert { w13, s13, w2, s2 })
    }
}

/// A layer's expert count and sizes are usable: none empty, at most [`MOE_MAX_EXPERTS`] experts.
fn check_layer_shape(
    op: &'static str,
    name: &str,
    n_experts: usize,
    hidden: usize,
    inter: usize,
) -> Result<(), GpuError> {
    check(op, n_experts > 0 && hidden > 0 && inter > 0, || {
        format!("{name}: empty shape (experts {n_experts}, hidden {hidden}, inter {inter})")
    })?;
    check(op, n_experts <= MOE_MAX_EXPERTS, || {
        format!("{name}: {n_experts} experts, at most {MOE_MAX_EXPERTS} supported")
    })
}

impl GpuExperts {
    /// Allocates (zeroed, budget-charged as `name`) room for `n_experts` experts.
    pub fn new(dev: &GpuDevice, name: &str, n_experts: usize, hidden: usize, inter: usize) -> Result<Self, GpuError> {
        const OP: &str = "GpuExperts::new";
        check_layer_shape(OP, name, n_experts, hidden, inter)?;
        let (hidden_pad, inter_pad) = (align_up(hidden, MOE_PAD), align_up(inter, MOE_PAD));
        to_i32(OP, "2·inter·hidden_pad", 2 * inter * hidden_pad)?;
        to_i32(OP, "hidden·inter_pad", hidden * inter_pad)?;
        let n13 = n_experts.checked_mul(2 * inter * hidden_pad);
        let n2 = n_experts.checked_mul(hidden * inter_pad);
        let (Some(n13), Some(n2)) = (n13, n2) else {
            return Err(GpuError::shape(OP, format!("{name}: expert weights overflow usize")));
        };
        let w13 = dev.alloc_zeros::<u16>(n13, &format!("{name} w13"))?;
        let w2 = dev.alloc_zeros::<u16>(n2, &format!("{name} w2"))?;
        Ok(Self::with_weights(name, n_experts, hidden, inter, ExpertWeights::Bf16 { w13, w2 }))
    }

    /// Allocates room for `n_experts` experts quantised to `bits` in groups of `gs13` along the
    /// hidden size (gate and up) and `gs2` along the intermediate size (down), in the GPU tile
    /// layout; fill it with [`GpuExperts::upload_quantized_expert`].
    #[allow(clippy::too_many_arguments)]
    pub fn new_quantized(
        dev: &GpuDevice,
        name: &str,
        n_experts: usize,
        hidden: usize,
        inter: usize,
        bits: Bits,
        gs13: usize,
        gs2: usize,
    ) -> Result<Self, GpuError> {
        let layout = QuantExpertLayout::new(name, hidden, inter, bits, gs13, gs2)?;
        Self::new_with_layout(dev, &layout, n_experts)
    }

    /// Allocates room for `n_experts` experts of a layer kept in the 4-bit float format `kind`
    /// ([`QuantExpertLayout::new_fp4`]); fill it with [`GpuExperts::upload_packed_expert`] of
    /// [`QuantExpertLayout::pack_fp4`] or with cache records.
    pub fn new_fp4(
        dev: &GpuDevice,
        name: &str,
        n_experts: usize,
        hidden: usize,
        inter: usize,
        kind: Fp4Kind,
    ) -> Result<Self, GpuError> {
        Self::new_with_layout(dev, &QuantExpertLayout::new_fp4(name, hidden, inter, kind)?, n_experts)
    }

    /// Allocates room for `n_experts` experts of `layout` (zeroed, budget-charged).
    pub fn new_with_layout(dev: &GpuDevice, layout: &QuantExpertLayout, n_experts: usize) -> Result<Self, GpuError> {
        const OP: &str = "GpuExperts::new_quantized";
        let QuantExpertLayout { name, hidden, inter, l13, l2 } = layout.clone();
        let (name, bits) = (name.as_str(), format_name(&l2));
        check_layer_shape(OP, name, n_experts, hidden, inter)?;
        let total = |per: usize| {
            n_experts
                .checked_mul(per)
                .ok_or_else(|| GpuError::shape(OP, format!("{name}: expert weights overflow usize")))
        };
        let w13 = dev.alloc_zeros::<u8>(total(l13.weight_bytes())?, &format!("{name} w13 ({bits})"))?;
        let s13 = dev.alloc_zeros::<u16>(total(scale_u16s(&l13))?, &format!("{name} w13 scales"))?;
        let w2 = dev.alloc_zeros::<u8>(total(l2.weight_bytes())?, &format!("{name} w2 ({bits})"))?;
        let s2 = dev.alloc_zeros::<u16>(total(scale_u16s(&l2))?, &format!("{name} w2 scales"))?;
        let q = QuantExperts { l13, l2, w13, s13, w2, s2 };
        Ok(Self::with_weights(name, n_experts, hidden, inter, ExpertWeights::Quant(Box::new(q))))
    }

    /// `n_experts` quantised experts kept as GPU expert cache records in place (one buffer, a
    /// record every `stride` bytes, w2's part `w2_offset` bytes into it), for experts streamed
    /// in runs ([`GpuExperts::copy_record_run_async`]): the same bytes as the cache, so a run of
    /// experts is one copy. Both offsets must be multiples of 16 and leave room for the parts.
    #[allow(clippy::too_many_arguments)]
    pub fn new_records(
        dev: &GpuDevice,
        name: &str,
        n_experts: usize,
        hidden: usize,
        inter: usize,
        bits: Bits,
        gs: (usize, usize),
        geometry: (usize, usize),
    ) -> Result<Self, GpuError> {
        Self::new_records_first(dev, name, n_experts, n_experts, hidden, inter, bits, gs, geometry)
    }

    /// [`GpuExperts::new_records`] with storage for the first `stored` of the `n_experts` only:
    /// a layer's pinned experts, renumbered to come first (`forward_part` with `present ≤
    /// stored` never reads the others; routes to them count as another device's).
    #[allow(clippy::too_many_arguments)]
    pub fn new_records_first(
        dev: &GpuDevice,
        name: &str,
        n_experts: usize,
        stored: usize,
        hidden: usize,
        inter: usize,
        bits: Bits,
        (gs13, gs2): (usize, usize),
        (stride, w2_offset): (usize, usize),
    ) -> Result<Self, GpuError> {
        let layout = QuantExpertLayout::new(name, hidden, inter, bits, gs13, gs2)?;
        Self::new_records_with_layout(dev, &layout, n_experts, stored, (stride, w2_offset))
    }

    /// [`GpuExperts::new_records_first`] for experts of `layout` (integer or FP4).
    pub fn new_records_with_layout(
        dev: &GpuDevice,
        layout: &QuantExpertLayout,
        n_experts: usize,
        stored: usize,
        (stride, w2_offset): (usize, usize),
    ) -> Result<Self, GpuError> {
        const OP: &str = "GpuExperts::new_records";
        let QuantExpertLayout { name, hidden, inter, l13, l2 } = layout.clone();
        let (name, bits) = (name.as_str(), format_name(&l2));
        check_layer_shape(OP, name, n_experts, hidden, inter)?;
        check(OP, (1..=n_experts).contains(&stored), || {
            format!("{name}: storage for {stored} of {n_experts} experts")
        })?;
        let (p13, p2) = record_parts(&l13, &l2);
        let aligned = [stride, w2_offset, l13.weight_bytes(), l2.weight_bytes()].iter().all(|v| v % 16 == 0);
        check(OP, aligned && p13 <= w2_offset && w2_offset + p2 <= stride, || {
            format!(
                "{name}: records of stride {stride} with w2 at {w2_offset} cannot hold parts of {p13} + {p2} bytes \
                 16-byte aligned"
            )
        })?;
        let bytes = stored
            .checked_mul(stride)
            .ok_or_else(|| GpuError::shape(OP, format!("{name}: expert records overflow usize")))?;
        let buf = dev.alloc_zeros::<u8>(bytes, &format!("{name} records ({bits})"))?;
        let r = RecordExperts { l13, l2, buf, stride, w2_offset };
        let mut e = Self::with_weights(name, n_experts, hidden, inter, ExpertWeights::Records(Box::new(r)));
        e.stored = stored;
        Ok(e)
    }

    /// The records-layout experts' bytes, read back (tests); `None` for other layouts.
    #[doc(hidden)]
    pub fn download_records(&self, dev: &GpuDevice) -> Result<Option<Vec<u8>>, GpuError> {
        match &self.weights {
            ExpertWeights::Records(r) => dev.download(&r.buf).map(Some),
            _ => Ok(None),
        }
    }

    /// Enqueues on `stream` the conversion of experts `experts` from CPU expert cache records at
    /// device address `src` (expert `experts.start`'s record; the others `cpu.stride` apart) into
    /// these records-layout experts ([`crate::relayout`]; asymmetric INT4 g32 records into INT8 g32
    /// ones, the GPU's form of them). Returns the CPU bytes read.
    ///
    /// # Safety
    /// `src` must hold those records on the device until the conversion is done (an event
    /// recorded on `stream` after this call), and nothing may read or write these experts on
    /// another stream before that event.
    pub unsafe fn convert_cpu_records_async(
        &mut self,
        dev: &GpuDevice,
        stream: &cudarc::driver::CudaStream,
        experts: std::ops::Range<usize>,
        src: u64,
        cpu: &crate::relayout::CpuRecordGeometry,
    ) -> Result<usize, GpuError> {
        const OP: &str = "GpuExperts::convert_cpu_records_async";
        let (name, n, h, i) = (&self.name, self.stored, self.hidden, self.inter);
        let ExpertWeights::Records(r) = &mut self.weights else {
            return Err(GpuError::shape(OP, format!("{name}: not records-layout experts")));
        };
        check(OP, experts.start <= experts.end && experts.end <= n, || format!("{name}: experts {experts:?} of {n}"))?;
        check(OP, r.l2.fp4.is_none(), || format!("{name}: FP4 experts do not convert from CPU records"))?;
        // A CPU part's codes become the GPU part's at its width, or (asymmetric INT4) INT8.
        let width = crate::relayout::converted_bits;
        let fits = (cpu.w13.rows, cpu.w13.k, cpu.w13.gs, width(&cpu.w13)) == (2 * i, h, r.l13.gs, r.l13.bits)
            && (cpu.w2.rows, cpu.w2.k, cpu.w2.gs, width(&cpu.w2)) == (h, i, r.l2.gs, r.l2.bits)
            && cpu.w13.bytes() <= cpu.w2_offset
            && cpu.w2_offset + cpu.w2.bytes() <= cpu.stride;
        check(OP, fits, || format!("{name}: CPU records {cpu:?} do not hold these experts ({h} x {i}, {:?})", r.l2))?;
        let (base, _g) = r.buf.slice_mut().device_ptr_mut(stream);
        let dst = base + (experts.start * r.stride) as u64;
        let (b13, b2) = (r.l13.weight_bytes() as u64, r.l2.weight_bytes() as u64);
        let w2 = r.w2_offset as u64;
        for job in [
            crate::relayout::PartJob { cpu: cpu.w13, fused: true, gpu: r.l13, src, codes: dst, scales: dst + b13 },
            crate::relayout::PartJob {
                cpu: cpu.w2,
                fused: false,
                gpu: r.l2,
                src: src + cpu.w2_offset as u64,
                codes: dst + w2,
                scales: dst + w2 + b2,
            },
        ] {
            // SAFETY: the destination records lie inside the buffer (range checked); the caller
            // keeps the source records on the device.
            unsafe { crate::relayout::convert_part(dev, stream, &job, experts.len(), cpu.stride, r.stride)? };
        }
        Ok(experts.len() * cpu.stride)
    }

    /// Enqueues on `stream` one copy of the records of experts `experts` (`src`: those records
    /// back to back, `stride` apart, as the cache stores a layer) into records-layout experts.
    /// Returns the bytes enqueued.
    ///
    /// # Safety
    /// `src` must lie in page-locked host memory that stays alive and unchanged until the copy is
    /// done (an event recorded on `stream` after this call), and nothing may read or write these
    /// experts on another stream before that event.
    pub unsafe fn copy_record_run_async(
        &mut self,
        stream: &cudarc::driver::CudaStream,
        experts: std::ops::Range<usize>,
        src: &[u8],
    ) -> Result<usize, GpuError> {
        const OP: &str = "GpuExperts::copy_record_run_async";
        let name = &self.name;
        let ExpertWeights::Records(r) = &mut self.weights else {
            return Err(GpuError::shape(OP, format!("{name}: not records-layout experts")));
        };
        check(OP, experts.start <= experts.end && experts.end <= self.stored, || {
            format!("{name}: experts {experts:?} of {} stored", self.stored)
        })?;
        let want = experts.len() * r.stride;
        check(OP, src.len() == want, || {
            format!("{name}: {} bytes for {} records of {}", src.len(), experts.len(), r.stride)
        })?;
        if want == 0 {
            return Ok(0);
        }
        let (base, _g) = r.buf.slice_mut().device_ptr_mut(stream);
        let dst = base + (experts.start * r.stride) as u64;
        // SAFETY: dst..dst+want lies inside the buffer (checked); the caller keeps src page-locked
        // and alive until the copy is done.
        let res =
            unsafe { cudarc::driver::sys::cuMemcpyHtoDAsync_v2(dst, src.as_ptr().cast(), want, stream.cu_stream()) };
        res.result().map_err(|err| GpuError::driver("cuMemcpyHtoDAsync", err))?;
        Ok(want)
    }

    fn with_weights(name: &str, n_experts: usize, hidden: usize, inter: usize, weights: ExpertWeights) -> Self {
        let (hidden_pad, inter_pad) = (align_up(hidden, MOE_PAD), align_up(inter, MOE_PAD));
        let max_pass_tokens = usize::MAX;
        GpuExperts {
            name: name.to_string(),
            n_experts,
            stored: n_experts,
            hidden,
            inter,
            weights,
            hidden_pad,
            inter_pad,
            max_pass_tokens,
            decode_max_pairs: DECODE_MAX_PAIRS,
            tile_smem_set: AtomicBool::new(false),
            // KRASIS_MOE_QTILE=0|1 overrides the default shape (for A/B runs of whole models).
            qvariant: QTILE_VARIANTS[krasis_core::knobs::knobs()
                .moe_qtile
                .filter(|&v| v < QTILE_VARIANTS.len())
                .unwrap_or(DEFAULT_QTILE_VARIANT)],
            activation: ExpertActivation::Silu,
            biases: None,
        }
    }

    /// Sets the activation of the gate and up sums (the default is SiLU; gpt-oss's clamped
    /// SwiGLU: see [`ExpertActivation`]). Every weight format and path takes it.
    pub fn set_activation(&mut self, act: ExpertActivation) {
        self.activation = act;
    }

    /// The activation of the gate and up sums.
    pub fn activation(&self) -> ExpertActivation {
        self.activation
    }

    /// Uploads the experts' biases (gpt-oss): `gate_up` f32 `[n_experts, 2·inter]`, per expert
    /// its gate biases then its up biases, added to the gate and up sums before the activation;
    /// `down` f32 `[n_experts, hidden]`, added to each routed expert's output before the routing
    /// weight scales it. Every weight format and path takes them; they index experts by the
    /// routed ids, so experts renumbered on the way in (a hybrid pool or streamed chunk) must not
    /// carry them.
    pub fn set_biases(&mut self, dev: &GpuDevice, gate_up: &[f32], down: &[f32]) -> Result<(), GpuError> {
        const OP: &str = "GpuExperts::set_biases";
        let (e, h, i, name) = (self.n_experts, self.hidden, self.inter, &self.name);
        check(OP, gate_up.len() == e * 2 * i, || {
            format!("{name}: gate/up biases have {} elements, not [{e}, 2·{i}]", gate_up.len())
        })?;
        check(OP, down.len() == e * h, || format!("{name}: down biases have {} elements, not [{e}, {h}]", down.len()))?;
        self.biases = None;
        let b13 = dev.upload(gate_up, &format!("{name} gate/up biases"))?;
        let b2 = dev.upload(down, &format!("{name} down biases"))?;
        self.biases = Some((b13, b2));
        Ok(())
    }

    /// Whether the experts carry biases ([`GpuExperts::set_biases`]).
    pub fn has_biases(&self) -> bool {
        self.biases.is_some()
    }

    /// Picks the quantised tiles' shape (0: 4 panels per block, 3 shared-memory buffers; 1: 2 and
    /// 2); for tests and tuning, every variant gives the same result.
    #[doc(hidden)]
    pub fn set_tile_variant(&mut self, v: usize) {
        self.qvariant = QTILE_VARIANTS[v % QTILE_VARIANTS.len()];
        self.tile_smem_set.store(false, Ordering::Relaxed);
    }

    /// Number of quantised tile variants ([`GpuExperts::set_tile_variant`]).
    #[doc(hidden)]
    pub const TILE_VARIANTS: usize = QTILE_VARIANTS.len();

    /// The experts' weight format: `None` for BF16, else the integer width.
    pub fn quant_bits(&self) -> Option<Bits> {
        match &self.weights {
            ExpertWeights::Bf16 { .. } => None,
            ExpertWeights::Quant(q) => Some(q.l2.bits),
            ExpertWeights::Records(r) => Some(r.l2.bits),
        }
    }

    /// The experts' 4-bit float format, when they keep one (`quant_bits` is then `Int4`).
    pub fn fp4(&self) -> Option<Fp4Kind> {
        self.quant_layouts().and_then(|(_, l2)| l2.fp4)
    }

    /// The quantised layouts (w13, w2); `None` for BF16 experts.
    fn quant_layouts(&self) -> Option<(&GpuLayout, &GpuLayout)> {
        match &self.weights {
            ExpertWeights::Bf16 { .. } => None,
            ExpertWeights::Quant(q) => Some((&q.l13, &q.l2)),
            ExpertWeights::Records(r) => Some((&r.l13, &r.l2)),
        }
    }

    pub fn n_experts(&self) -> usize {
        self.n_experts
    }

    pub fn hidden(&self) -> usize {
        self.hidden
    }

    pub fn inter(&self) -> usize {
        self.inter
    }

    /// Copies expert `e`'s BF16 weights in: `gate` and `up` `[inter, hidden]`, `down`
    /// `[hidden, inter]` (HF `out × in`). Padding stays zero.
    pub fn upload_expert(
        &mut self,
        dev: &GpuDevice,
        e: usize,
        gate: &[u16],
        up: &[u16],
        down: &[u16],
    ) -> Result<(), GpuError> {
        const OP: &str = "GpuExperts::upload_expert";
        let (h, i, name) = (self.hidden, self.inter, &self.name);
        check(OP, e < self.n_experts, || format!("{name}: expert {e} of {}", self.n_experts))?;
        for (what, v, want) in [("gate", gate, i * h), ("up", up, i * h), ("down", down, h * i)] {
            check(OP, v.len() == want, || format!("{name} expert {e}: {what} has {} elements, not {want}", v.len()))?;
        }
        let (hp, ip) = (self.hidden_pad, self.inter_pad);
        let mut w13 = vec![0u16; 2 * i * hp];
        for (r, src) in gate.chunks_exact(h).chain(up.chunks_exact(h)).enumerate() {
            w13[r * hp..r * hp + h].copy_from_slice(src);
        }
        let mut w2 = vec![0u16; h * ip];
        for (r, src) in down.chunks_exact(i).enumerate() {
            w2[r * ip..r * ip + i].copy_from_slice(src);
        }
        let ExpertWeights::Bf16 { w13: d13, w2: d2 } = &mut self.weights else {
            return Err(GpuError::shape(OP, format!("{name}: the experts are quantised; upload quantised weights")));
        };
        copy_in(dev, d13, e, &w13)?;
        copy_in(dev, d2, e, &w2)
    }

    /// The quantised experts' layout, for packing experts off the device's thread
    /// ([`QuantExpertLayout::pack`]); `None` for BF16 experts.
    pub fn quant_layout(&self) -> Option<QuantExpertLayout> {
        self.quant_layouts().map(|(l13, l2)| QuantExpertLayout {
            name: self.name.clone(),
            hidden: self.hidden,
            inter: self.inter,
            l13: *l13,
            l2: *l2,
        })
    }

    /// Copies expert `e`'s quantised weights in: `gate` and `up` `[inter, hidden]`, `down`
    /// `[hidden, inter]`, at the width and group sizes the experts were created with.
    pub fn upload_quantized_expert(
        &mut self,
        dev: &GpuDevice,
        e: usize,
        gate: &QuantizedMatrix,
        up: &QuantizedMatrix,
        down: &QuantizedMatrix,
    ) -> Result<(), GpuError> {
        let layout = self.quant_layout().ok_or_else(|| {
            GpuError::shape(OP_UPLOAD_Q, format!("{}: the experts are BF16; upload BF16 weights", self.name))
        })?;
        let packed = layout.pack(e, gate, up, down)?;
        self.upload_packed_expert(dev, e, &packed)
    }

    /// Copies expert `e`'s packed weights (from [`QuantExpertLayout::pack`] of these experts) in.
    pub fn upload_packed_expert(&mut self, dev: &GpuDevice, e: usize, p: &PackedExpert) -> Result<(), GpuError> {
        let name = &self.name;
        check(OP_UPLOAD_Q, e < self.n_experts, || format!("{name}: expert {e} of {}", self.n_experts))?;
        let qw = quant_arrays(&mut self.weights, OP_UPLOAD_Q, name, "upload BF16 weights")?;
        let sizes = (p.w13.len(), p.s13.len(), p.w2.len(), p.s2.len());
        let want = (qw.l13.weight_bytes(), scale_u16s(&qw.l13), qw.l2.weight_bytes(), scale_u16s(&qw.l2));
        check(OP_UPLOAD_Q, sizes == want, || format!("{name} expert {e}: packed for another layout"))?;
        copy_in(dev, &mut qw.w13, e, &p.w13)?;
        copy_in(dev, &mut qw.s13, e, &p.s13)?;
        copy_in(dev, &mut qw.w2, e, &p.w2)?;
        copy_in(dev, &mut qw.s2, e, &p.s2)
    }

    /// Copies expert `e` in from its GPU expert cache record: `w13` and `w2` are the record's two
    /// parts ([`PackedExpert::to_record`] of these experts' layout).
    pub fn upload_expert_record(&mut self, dev: &GpuDevice, e: usize, w13: &[u8], w2: &[u8]) -> Result<(), GpuError> {
        let name = &self.name;
        check(OP_UPLOAD_Q, e < self.n_experts, || format!("{name}: expert {e} of {}", self.n_experts))?;
        let qw = quant_arrays(&mut self.weights, OP_UPLOAD_Q, name, "upload BF16 weights")?;
        let (b13, b2) = (qw.l13.weight_bytes(), qw.l2.weight_bytes());
        let want = record_parts(&qw.l13, &qw.l2);
        check_record_parts(OP_UPLOAD_Q, || format!("{name} expert {e}"), (w13.len(), w2.len()), want)?;
        copy_in(dev, &mut qw.w13, e, &w13[..b13])?;
        copy_in(dev, &mut qw.s13, e, &scale_bits(&w13[b13..]))?;
        copy_in(dev, &mut qw.w2, e, &w2[..b2])?;
        copy_in(dev, &mut qw.s2, e, &scale_bits(&w2[b2..]))
    }

    /// Enqueues on `stream` the copies of the GPU expert cache records of experts `experts` into
    /// these experts (a whole layer or its first experts, for experts streamed from host memory):
    /// `records(e)` gives expert `e`'s two parts ([`PackedExpert::to_record`]; the scales' little-endian bytes are the
    /// device's u16 values). Returns the bytes enqueued.
    ///
    /// # Safety
    /// Every record must lie in page-locked host memory (pinned or registered) that stays alive
    /// and unchanged until the copies are done (an event recorded on `stream` after this call),
    /// and nothing may read or write these experts on another stream before that event.
    pub unsafe fn copy_records_async<'r>(
        &mut self,
        stream: &cudarc::driver::CudaStream,
        experts: std::ops::Range<usize>,
        records: &dyn Fn(usize) -> (&'r [u8], &'r [u8]),
    ) -> Result<usize, GpuError> {
        const OP: &str = "GpuExperts::copy_records_async";
        let name = &self.name;
        check(OP, experts.end <= self.n_experts, || format!("{name}: experts {experts:?} of {}", self.n_experts))?;
        let qw = quant_arrays(&mut self.weights, OP, name, "only quantised experts stream")?;
        let (b13, b2) = (qw.l13.weight_bytes(), qw.l2.weight_bytes());
        let want = record_parts(&qw.l13, &qw.l2);
        let (c13, c2) = (want.0 - b13, want.1 - b2);
        let (w13, _g1) = qw.w13.slice_mut().device_ptr_mut(stream);
        let (s13, _g2) = qw.s13.slice_mut().device_ptr_mut(stream);
        let (w2, _g3) = qw.w2.slice_mut().device_ptr_mut(stream);
        let (s2, _g4) = qw.s2.slice_mut().device_ptr_mut(stream);
        let mut bytes = 0;
        for e in experts {
            let (p13, p2) = records(e);
            check_record_parts(OP, || format!("{name} expert {e}"), (p13.len(), p2.len()), want)?;
            let e = e as u64;
            for (dst, src) in [
                (w13 + e * b13 as u64, &p13[..b13]),
                (s13 + e * c13 as u64, &p13[b13..]),
                (w2 + e * b2 as u64, &p2[..b2]),
                (s2 + e * c2 as u64, &p2[b2..]),
            ] {
                // SAFETY: dst..dst+len lies inside the allocation (offsets of expert e < n_experts,
                // lengths checked above); the caller keeps src page-locked and alive.
                let r = unsafe {
                    cudarc::driver::sys::cuMemcpyHtoDAsync_v2(dst, src.as_ptr().cast(), src.len(), stream.cu_stream())
                };
                r.result().map_err(|err| GpuError::driver("cuMemcpyHtoDAsync", err))?;
                bytes += src.len();
            }
        }
        Ok(bytes)
    }

    /// Device bytes of all expert weights (padding and scales included).
    pub fn weight_bytes(&self) -> usize {
        match &self.weights {
            ExpertWeights::Bf16 { w13, w2 } => (w13.len() + w2.len()) * 2,
            ExpertWeights::Quant(q) => q.w13.len() + q.w2.len() + 2 * (q.s13.len() + q.s2.len()),
            ExpertWeights::Records(r) => r.buf.len(),
        }
    }

    /// Caps the tokens one pass of [`GpuExperts::forward`] handles (at least 1), on top of the
    /// built-in scratch bound per pass (128 MiB to 1 GiB, as the VRAM budget allows): a smaller
    /// cap means less scratch, a larger one fuller expert tiles.
    pub fn set_max_tokens_per_pass(&mut self, tokens: usize) {
        self.max_pass_tokens = tokens.max(1);
    }

    /// Sets the largest pass (in pairs, `tokens · top_k`) that takes the decode path instead of
    /// the grouped one (default [`DECODE_MAX_PAIRS`]): 0 forces the grouped path, `usize::MAX`
    /// the decode path. For tests and tuning; both paths give the same result up to rounding
    /// (f32 sums; the grouped path's activations split into two BF16 halves, within 2^-17).
    #[doc(hidden)]
    pub fn set_decode_path_max_pairs(&mut self, pairs: usize) {
        self.decode_max_pairs = pairs;
    }

    /// Whether a pass of `tokens` tokens at `top_k` takes the decode path (for tests).
    #[doc(hidden)]
    pub fn uses_decode_path(&self, tokens: usize, top_k: usize) -> bool {
        // Quantised experts whose activation rows need more shared memory than a launch gets
        // without opting in take the tiles at decode too.
        let fits = match self.quant_layouts() {
            None => true,
            Some((l13, l2)) => {
                qdec_smem(l13.chunks(), MOE_QDEC_GU_THREADS).max(qdec_smem(l2.chunks(), MOE_QDEC_DN_THREADS))
                    <= DEFAULT_SMEM_LIMIT
            }
        };
        fits && tokens.saturating_mul(top_k) <= self.decode_max_pairs
    }

    /// Tokens per pass at `top_k`: the scratch of [`MOE_PASS_SCRATCH_STEPS`] that the VRAM budget
    /// allows (counting the GEMM scratch already held), bounded by the caller's cap.
    fn tokens_per_pass(&self, dev: &GpuDevice, ctx: &GemmContext, top_k: usize) -> usize {
        let room = (dev.budget().remaining() as usize).saturating_add(ctx.scratch_bytes());
        let floor = MOE_PASS_SCRATCH_STEPS[MOE_PASS_SCRATCH_STEPS.len() - 1];
        let bytes = MOE_PASS_SCRATCH_STEPS
            .into_iter()
            .find(|&b| b.saturating_add(MOE_PASS_HEADROOM_BYTES) <= room)
            .unwrap_or(floor);
        (bytes / self.scratch_per_token(top_k)).clamp(1, self.max_pass_tokens)
    }

    /// Scratch bytes per token of a pass: per pair its sorted index, intermediate (f32, or two
    /// BF16 halves, padded), its quantised copy (quantised experts: two INT8 rows and their
    /// scales, under 3 bytes an element) and output row; per token its activations (two BF16
    /// halves, or two INT8 rows and their scales).
    fn scratch_per_token(&self, top_k: usize) -> usize {
        let quant = if self.quant_layouts().is_some() { 3 * self.inter_pad } else { 0 };
        top_k * ((1 + self.inter_pad + self.hidden) * 4 + quant) + self.hidden_pad * 4
    }

    /// `out[t, :] = Σ_j weights[t, j] · down_e(silu(gate_e x_t) · up_e x_t)` with `e = ids[t, j]`,
    /// `j` ascending; `x`, `out` `[t, hidden]` f32, `ids`, `weights` `[t, top_k]` on the device.
    /// `out` is overwritten; a token with an id outside `[0, n_experts)` gets a NaN row. Never
    /// synchronises.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        dev: &GpuDevice,
        ctx: &GemmContext,
        x: &impl DevicePtr<f32>,
        t: usize,
        ids: &impl DevicePtr<i32>,
        weights: &impl DevicePtr<f32>,
        top_k: usize,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), GpuError> {
        self.forward_part(dev, ctx, x, t, ids, weights, top_k, self.n_experts, out)
    }

    /// [`GpuExperts::forward`] over experts `[0, present)` only: pairs routed to experts
    /// `[present, n_experts)` are left out of the sum (another device computes them: the CPU's
    /// share of a split hybrid layer), and those experts' weights are never read, so they need
    /// not be loaded. Ids outside `[0, n_experts)` still give a NaN row.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_part(
        &self,
        dev: &GpuDevice,
        ctx: &GemmContext,
        x: &impl DevicePtr<f32>,
        t: usize,
        ids: &impl DevicePtr<i32>,
        weights: &impl DevicePtr<f32>,
        top_k: usize,
        present: usize,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<(), GpuError> {
        const OP: &str = "GpuExperts::forward";
        let (h, i, name) = (self.hidden, self.inter, &self.name);
        check(OP, top_k > 0, || format!("{name}: top_k = 0"))?;
        check(OP, present <= self.stored, || {
            format!("{name}: {present} present experts of {} ({} stored)", self.n_experts, self.stored)
        })?;
        check(OP, x.len() == t * h, || format!("{name}: x has {} elements, not [{t}, {h}]", x.len()))?;
        check(OP, out.len() == t * h, || format!("{name}: out has {} elements, not [{t}, {h}]", out.len()))?;
        check(OP, ids.len() == t * top_k, || format!("{name}: ids has {} elements, not [{t}, {top_k}]", ids.len()))?;
        check(OP, weights.len() == t * top_k, || {
            format!("{name}: weights has {} elements, not [{t}, {top_k}]", weights.len())
        })?;
        if t == 0 {
            return Ok(());
        }
        to_i32(OP, "tokens·top_k", t * top_k)?;
        let e = self.n_experts;
        // Passes of equal size (10240 tokens at 9216 a pass: two of 5120, not 9216 + 1024), so no
        // pass is left with mostly partial tiles.
        let pass = t.div_ceil(t.div_ceil(self.tokens_per_pass(dev, ctx, top_k).min(t)));
        let max_pairs = pass * top_k;
        let (hp, ip) = (self.hidden_pad, self.inter_pad);
        // `act`: the f32 intermediate [pairs, inter] (decode path) or [pairs, inter_pad]
        // (quantised tiles), or the BF16 tiles' two halves [pairs, inter_pad] each; `xs`: the two
        // BF16 halves of x [pass, hidden_pad] each, or x quantised (two INT8 rows, scales);
        // `actq`: the quantised tiles' intermediate quantised (the same form). gs13, gs2: the
        // quantised experts' group sizes along x and the intermediate (0: BF16 experts).
        let (gs13, gs2) = self.quant_layouts().map_or((0, 0), |(l13, l2)| (l13.gs, l2.gs));
        let sizes = |pairs: usize| {
            let [xs, actq] = if gs13 > 0 {
                [quant_rows_bytes(pass, hp, gs13).iter().sum(), quant_rows_bytes(pairs, ip, gs2).iter().sum()]
            } else {
                [pass * hp * 4, 0]
            };
            [(e + 1) * 4, (e + 1) * 4, pairs * 4, pairs * ip * 4, pairs * h * 4, xs, actq]
        };
        let g = ctx.lock(dev, OP, Carve::total(&sizes(max_pairs)))?;
        let mut carve = Carve::new(g.scratch_ptr());
        let [offsets, tile_offsets, sorted, act, ypair, xs, actq] = sizes(max_pairs).map(|b| carve.take(b));
        let (act_hi, act_lo) = (act, act + (max_pairs * ip * 2) as u64);
        let (xs_hi, xs_lo) = (xs, xs + (pass * hp * 2) as u64);
        // Quantised rows, then their scales (quant_rows_bytes).
        let (xq, xq_scales) = (xs, xs + (pass * 2 * hp) as u64);
        let (aq, aq_scales) = (actq, actq + (max_pairs * 2 * ip) as u64);

        let s = dev.stream();
        let (x_p, _g1) = x.device_ptr(s);
        let (ids_p, _g2) = ids.device_ptr(s);
        let (w_p, _g3) = weights.device_ptr(s);
        let (out_p, _g4) = out.device_ptr_mut(s);
        // BF16: (w13, w2, 0, 0); quantised: (w13, w2, s13, s2) pointers.
        let (w13_p, w2_p, s13_p, s2_p, _guards) = match &self.weights {
            ExpertWeights::Bf16 { w13, w2 } => {
                let (a, g1) = w13.device_ptr(s);
                let (b, g2) = w2.device_ptr(s);
                (a, b, 0, 0, vec![g1, g2])
            }
            ExpertWeights::Quant(q) => {
                let (a, g1) = q.w13.device_ptr(s);
                let (b, g2) = q.w2.device_ptr(s);
                let (c, g3) = q.s13.device_ptr(s);
                let (d, g4) = q.s2.device_ptr(s);
                (a, b, c, d, vec![g1, g2, g3, g4])
            }
            ExpertWeights::Records(r) => {
                let (base, g1) = r.buf.device_ptr(s);
                let (w2, b13, b2) =
                    (base + r.w2_offset as u64, r.l13.weight_bytes() as u64, r.l2.weight_bytes() as u64);
                (base, w2, base + b13, w2 + b2, vec![g1])
            }
        };
        let (route, gate_up, down, combine) = (
            dev.function(&MOE, "moe_route")?,
            dev.function(&MOE, "moe_gate_up")?,
            dev.function(&MOE, "moe_down")?,
            dev.function(&MOE, "moe_combine")?,
        );
        let (dec_gate_up, dec_down) = (dev.function(&MOE, "moe_dec_gate_up")?, dev.function(&MOE, "moe_dec_down")?);
        let split = dev.function(&MOE, "moe_split_rows")?;
        let quant_rows = dev.function(&MOE, "moe_quant_rows")?;
        // The activation and the biases: the gate/up kernels' argument, the combine's down biases.
        let (b13_p, b2_p) = match &self.biases {
            Some((b13, b2)) => (b13.device_ptr(s).0, b2.device_ptr(s).0),
            None => (0, 0),
        };
        let (clamped, alpha, limit) = match self.activation {
            ExpertActivation::Silu => (0, 0.0, 0.0),
            ExpertActivation::ClampedSwiglu { alpha, limit } => (1, alpha, limit),
        };
        let act_args = MoeActArgs { b13: b13_p, inter: to_i32(OP, "inter", i)?, clamped, alpha, limit };
        // Quantised experts: the layouts' kernel arguments and the tile and decode kernels, once
        // per call.
        let quant = match self.quant_layouts() {
            None => None,
            Some((l13, l2)) => {
                let v = if l2.fp4.is_some() { QTILE_VARIANTS[FP4_QTILE_VARIANT] } else { self.qvariant };
                let (tiles, [gu, dn], dec, [dec_gu, dec_dn]) = quant_kernels(l2, &v);
                let (a13, a2) = match &self.weights {
                    // Records: both parts one record stride apart (in scales: stride / scale bytes).
                    ExpertWeights::Records(r) => (
                        QMatrixArgs::strided(OP, l13, w13_p, s13_p, r.stride, r.stride / l13.scale_bytes())?,
                        QMatrixArgs::strided(OP, l2, w2_p, s2_p, r.stride, r.stride / l2.scale_bytes())?,
                    ),
                    _ => (QMatrixArgs::new(OP, l13, w13_p, s13_p)?, QMatrixArgs::new(OP, l2, w2_p, s2_p)?),
                };
                Some((
                    (l13, l2),
                    a13,
                    a2,
                    [dev.function(tiles, gu)?, dev.function(tiles, dn)?],
                    [dev.function(dec, dec_gu)?, dev.function(dec, dec_dn)?],
                    v,
                ))
            }
        };
        // The tiles' dynamic shared memory (72 KiB for the BF16 gate/up, above the 48 KiB
        // default), once per kernel choice.
        if !self.tile_smem_set.load(Ordering::Relaxed) {
            let sizes = match &quant {
                None => vec![(&gate_up, tile_smem(true)), (&down, tile_smem(false))],
                Some(((_, l2), _, _, [gu, dn], _, v)) => {
                    let bytes = qtile_smem(l2, *v);
                    vec![(gu, bytes), (dn, bytes)]
                }
            };
            for (f, bytes) in sizes {
                f.set_attribute(FnAttr::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes as i32)
                    .map_err(|e| GpuError::driver("cuFuncSetAttribute", e))?;
            }
            self.tile_smem_set.store(true, Ordering::Relaxed);
        }
        // The grouping and expert kernels see only the present experts (the others' pairs are left
        // out as if their ids were out of range); the combine tells the two apart.
        let (e_i, h_i, i_i, k_i) = (present as i32, h as i32, i as i32, top_k as i32);
        let all_i = e as i32;
        let (ldw13, ldw2) = (hp as i32, ip as i32);

        let launch_combine = |ypair: &u64, ids_t: &u64, w_t: &u64, out_t: &u64, nt_i: i32| {
            let mut args = kernel_args![ypair, ids_t, w_t, out_t, &nt_i, &k_i, &h_i, &all_i, &e_i, &b2_p];
            // Tokens on x, column chunks of COMBINE_THREADS on y (capped; the kernel strides).
            let chunks = h.div_ceil(COMBINE_THREADS as usize).min(65535) as u32;
            let cfg = LaunchConfig {
                grid_dim: (nt_i as u32, chunks, 1),
                block_dim: (COMBINE_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: ypair [pairs, hidden] (rows of bad pairs are read but discarded), out [nt, hidden];
            // the kernel waits for the previous kernel before touching memory.
            unsafe { dev.launch_dependent(OP, &combine, cfg, &mut args, true) }
        };
        // The weights' format: it orders the quantised activation rows (moe_qk) and sizes their
        // scales (an INT4 weight byte holds 16·q).
        let bits_i: i32 = quant.as_ref().map_or(8, |q| format_code(q.0 .1));
        // Quantised experts: `rows` f32 rows (x, the intermediate) into two INT8 rows each and
        // their scales (`moe_quant_rows`, the CPU's activation quantiser), in the weights' groups.
        let launch_quant_rows =
            |src: &u64, rows: usize, k: usize, ldx: usize, ld: usize, gs: usize, q: &u64, sc: &u64| {
                let ng = ld / gs;
                // A warp a group, or (NVFP4's groups of 16) a window of two.
                let warps = if gs == 16 { ng / 2 } else { ng };
                let (k_i, ldx_i, ld_i, gs_i, ng_i) = (k as i32, ldx as i32, ld as i32, gs as i32, ng as i32);
                let mut b = s.launch_builder(&quant_rows);
                b.arg(src).arg(&k_i).arg(&ldx_i).arg(&gs_i).arg(&ng_i).arg(q).arg(&ld_i).arg(sc).arg(&bits_i);
                let cfg = LaunchConfig {
                    grid_dim: (rows as u32, warps.div_ceil(MOE_QUANT_WARPS) as u32, 1),
                    block_dim: (32 * MOE_QUANT_WARPS as u32, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: src [rows, ldx] f32 (read below k only), q [rows, 2, ld] bytes and sc
                // [rows, ld / gs] float pairs in the scratch (quant_rows_bytes); gs divides ld.
                unsafe { b.launch(cfg) }.map_err(launch_err(OP))
            };
        let mut t0 = 0;
        while t0 < t {
            let nt = pass.min(t - t0);
            let pairs = nt * top_k;
            let (nt_i, pairs_i) = (nt as i32, pairs as i32);
            let ids_t = ids_p + (t0 * top_k * 4) as u64;
            let w_t = w_p + (t0 * top_k * 4) as u64;
            let x_t = x_p + (t0 * h * 4) as u64;
            let out_t = out_p + (t0 * h * 4) as u64;

            // Fixed rows (the row-invariant prefill): the grouped path at every size, whose
            // outputs per pair do not depend on the pass's other pairs.
            let decode = self.uses_decode_path(nt, top_k) && ctx.fixed_rows().is_none();
            if let (true, Some((q, a13, a2, _, [dec_gu, dec_dn], _))) = (decode, &quant) {
                let grid = |panels: usize, chunks: usize, threads: u32| LaunchConfig {
                    grid_dim: (pairs as u32, panels as u32, 1),
                    block_dim: (threads, 1, 1),
                    shared_mem_bytes: qdec_smem(chunks, threads) as u32,
                };
                let rest = kernel_args![&i_i, &x_t, &h_i, &k_i, &act, &ldw2, &ids_t, &e_i, &act_args];
                let mut args: Vec<_> = a13.params().into_iter().chain(rest).collect();
                // SAFETY: w13/s13 [E, l13], ids checked in [0, E) on the device; x [nt, hidden];
                // act [pairs, ldw2] f32, every column written (grid.y = p13 / 2 = ldw2 / 64); the
                // kernel waits for the previous kernel before touching memory.
                let cfg = grid(q.0.panels() / 2, q.0.chunks(), MOE_QDEC_GU_THREADS);
                unsafe { dev.launch_dependent(OP, dec_gu, cfg, &mut args, true) }?;
                let rest = kernel_args![&h_i, &act, &i_i, &ldw2, &ypair, &ids_t, &e_i];
                let mut args: Vec<_> = a2.params().into_iter().chain(rest).collect();
                // SAFETY: w2/s2 [E, l2]; act [pairs, ldw2]; ypair [pairs, hidden], columns
                // below hidden only; waits as above.
                let cfg = grid(q.1.panels(), q.1.chunks(), MOE_QDEC_DN_THREADS);
                unsafe { dev.launch_dependent(OP, dec_dn, cfg, &mut args, true) }?;
                launch_combine(&ypair, &ids_t, &w_t, &out_t, nt_i)?;
                t0 += nt;
                continue;
            }
            if decode {
                let grid = |n_out: usize, per_block: usize| LaunchConfig {
                    grid_dim: (pairs as u32, n_out.div_ceil(per_block) as u32, 1),
                    block_dim: (MOE_DEC_THREADS, 1, 1),
                    shared_mem_bytes: 0,
                };
                let mut b = s.launch_builder(&dec_gate_up);
                b.arg(&w13_p).arg(&ldw13).arg(&i_i).arg(&h_i).arg(&x_t).arg(&k_i).arg(&act).arg(&ids_t).arg(&e_i);
                b.arg(&act_args);
                // SAFETY: w13 [E, 2·inter, ldw13] indexed only by ids checked in [0, E) on the
                // device, x [nt, hidden], act [pairs, inter], ids [pairs] = grid.x.
                unsafe { b.launch(grid(i, MOE_DEC_GU_BLOCK_COLS)) }.map_err(launch_err(OP))?;
                let mut b = s.launch_builder(&dec_down);
                b.arg(&w2_p).arg(&ldw2).arg(&i_i).arg(&h_i).arg(&act).arg(&ypair).arg(&ids_t).arg(&e_i);
                // SAFETY: w2 [E, hidden, ldw2] (ids checked as above), act [pairs, inter],
                // ypair [pairs, hidden].
                unsafe { b.launch(grid(h, MOE_DEC_DN_BLOCK_ROWS)) }.map_err(launch_err(OP))?;
                launch_combine(&ypair, &ids_t, &w_t, &out_t, nt_i)?;
                t0 += nt;
                continue;
            }

            if quant.is_some() {
                launch_quant_rows(&x_t, nt, h, h, hp, gs13, &xq, &xq_scales)?;
            } else {
                // A of the BF16 tiles: x as two BF16 halves.
                let mut b = s.launch_builder(&split);
                b.arg(&x_t).arg(&h_i).arg(&xs_hi).arg(&xs_lo).arg(&ldw13);
                let cfg = LaunchConfig {
                    grid_dim: (nt as u32, hp.div_ceil(SPLIT_THREADS as usize) as u32, 1),
                    block_dim: (SPLIT_THREADS, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: x [nt, hidden]; xs_hi and xs_lo [nt, hidden_pad] each in the scratch.
                unsafe { b.launch(cfg) }.map_err(launch_err(OP))?;
            }

            // Pairs per tile: the quantised variant's, else MOE_TM.
            let tm = quant.as_ref().map_or(MOE_TM, |q| q.5.pairs);
            let tm_i = tm as i32;
            let mut b = s.launch_builder(&route);
            b.arg(&ids_t).arg(&pairs_i).arg(&e_i).arg(&tm_i).arg(&offsets).arg(&tile_offsets).arg(&sorted);
            let one = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (ROUTE_THREADS, 1, 1), shared_mem_bytes: 0 };
            // SAFETY: ids [pairs]; offsets/tile_offsets [E+1] and sorted [pairs] in the scratch.
            unsafe { b.launch(one) }.map_err(launch_err(OP))?;

            // Upper bound on the tiles: each non-empty expert adds at most one partial tile, and
            // no tile is empty. Blocks past the device-side count exit at once.
            let max_tiles = pairs.min(pairs.div_ceil(tm) + e.min(pairs)) as u32;
            let grid = |n_out: usize, gated: bool| LaunchConfig {
                grid_dim: (max_tiles, n_out.div_ceil(if gated { MOE_BN } else { MOE_BN_DOWN }) as u32, 1),
                block_dim: (MOE_THREADS, 1, 1),
                shared_mem_bytes: tile_smem(gated) as u32,
            };
            if let Some((q, a13, a2, [q_gate_up, q_down], _, v)) = &quant {
                let v = *v;
                let qgrid = |n_out: usize, cols: usize| LaunchConfig {
                    grid_dim: (max_tiles, n_out.div_ceil(cols) as u32, 1),
                    block_dim: (2 * (v.pairs * v.panels) as u32, 1, 1),
                    shared_mem_bytes: qtile_smem(q.1, v) as u32,
                };
                let (ng13, ng2) = ((hp / gs13) as i32, (ip / gs2) as i32);
                let rest = kernel_args![
                    &i_i,
                    &xq,
                    &xq_scales,
                    &ng13,
                    &ldw13,
                    &k_i,
                    &act,
                    &ldw2,
                    &sorted,
                    &offsets,
                    &tile_offsets,
                    &e_i,
                    &act_args
                ];
                let mut args: Vec<_> = a13.params().into_iter().chain(rest).collect();
                // SAFETY: w13/s13 [E, l13]; blocks read gate panels below p13 / 2 and the matching
                // up panels (others zero-filled) and chunks < c13; xq [nt, 2, ldw13 = 64·c13] and
                // its scales [nt, ng13]; act [pairs, ldw2] f32, every column below ldw2 written,
                // none past it; ids checked on the device as above. An ordinary launch (the tiles
                // do not wait).
                let cfg = qgrid(ip, v.panels / 2 * gpu_layout::PANEL_ROWS);
                unsafe { dev.launch_dependent(OP, q_gate_up, cfg, &mut args, false) }?;
                launch_quant_rows(&act, pairs, i, ip, ip, gs2, &aq, &aq_scales)?;
                let rest =
                    kernel_args![&h_i, &aq, &aq_scales, &ng2, &ldw2, &ypair, &sorted, &offsets, &tile_offsets, &e_i];
                let mut args: Vec<_> = a2.params().into_iter().chain(rest).collect();
                // SAFETY: w2/s2 [E, l2] (panels past p2 zero-filled, never read); aq [pairs, 2,
                // ldw2 = 64·c2] and its scales [pairs, ng2]; ypair [pairs, hidden], columns below
                // hidden only.
                let cfg = qgrid(h, v.panels * gpu_layout::PANEL_ROWS);
                unsafe { dev.launch_dependent(OP, q_down, cfg, &mut args, false) }?;
                launch_combine(&ypair, &ids_t, &w_t, &out_t, nt_i)?;
                t0 += nt;
                continue;
            }

            let mut b = s.launch_builder(&gate_up);
            b.arg(&w13_p).arg(&ldw13).arg(&i_i).arg(&h_i).arg(&xs_hi).arg(&xs_lo).arg(&k_i);
            b.arg(&act_hi).arg(&act_lo).arg(&ldw2).arg(&sorted).arg(&offsets).arg(&tile_offsets).arg(&e_i);
            b.arg(&act_args);
            // SAFETY: w13 [E, 2·inter, ldw13]; xs halves [nt, ldw13]; act halves [pairs, ldw2],
            // every column of a pair's row written (the last column block ends at ldw2); rows of
            // A are pair / top_k < nt, and pairs with bad ids are never in `sorted`.
            unsafe { b.launch(grid(i, true)) }.map_err(launch_err(OP))?;

            let mut b = s.launch_builder(&down);
            b.arg(&w2_p).arg(&ldw2).arg(&i_i).arg(&h_i).arg(&act_hi).arg(&act_lo).arg(&ypair);
            b.arg(&sorted).arg(&offsets).arg(&tile_offsets).arg(&e_i);
            // SAFETY: w2 [E, hidden, ldw2], act halves [pairs, ldw2], ypair [pairs, hidden].
            unsafe { b.launch(grid(h, false)) }.map_err(launch_err(OP))?;

            launch_combine(&ypair, &ids_t, &w_t, &out_t, nt_i)?;
            t0 += nt;
        }
        drop(g);
        Ok(())
    }
}

#[cfg(test)]
mod record_tests {
    use super::*;
    use krasis_quant::group::{quantize, test_data};

    fn values(n: usize, seed: u64) -> Vec<f32> {
        test_data(n, seed, 1.0)
    }

    /// A record's parts unpack to the quantised gate, up and down that were packed (no device:
    /// this is what the GPU expert cache stores and `upload_expert_record` splits).
    #[test]
    fn records_unpack_to_the_packed_matrices() {
        for (bits, hidden, inter, gs13, gs2) in
            [(Bits::Int4, 128, 96, 64, 32), (Bits::Int8, 192, 160, 64, 32), (Bits::Int4, 256, 64, 128, 64)]
        {
            let layout = QuantExpertLayout::new("t", hidden, inter, bits, gs13, gs2).unwrap();
            let gate = quantize(&values(inter * hidden, 1), inter, hidden, bits, gs13);
            let up = quantize(&values(inter * hidden, 2), inter, hidden, bits, gs13);
            let down = quantize(&values(hidden * inter, 3), hidden, inter, bits, gs2);
            let rec = layout.pack(0, &gate, &up, &down).unwrap().to_record();
            let (p13, p2) = layout.record_parts();
            assert_eq!(rec.len(), p13 + p2);
            let (r13, r2) = rec.split_at(p13);
            assert_eq!(layout.unpack_record(r13, r2).unwrap(), [gate, up, down]);
            assert!(layout.unpack_record(&r13[1..], r2).is_err(), "a short part is refused");
        }
    }

    /// An FP4 record holds the stored codes and the CPU's `s · f` scales of gate (rows from 0), up
    /// (from `inter_pad`) and down, in the GPU FP4 layout; wrong formats and shapes are refused
    /// naming the expert and the projection.
    #[test]
    fn fp4_records_hold_the_stored_codes() {
        use krasis_quant::fp4::test_matrix;
        for kind in [Fp4Kind::Mxfp4, Fp4Kind::Nvfp4] {
            let (hidden, inter) = (160, 96);
            let layout = QuantExpertLayout::new_fp4("t", hidden, inter, kind).unwrap();
            assert_eq!(layout.fp4(), Some(kind));
            let (gate, up, down) = (
                test_matrix(kind, inter, hidden, 1),
                test_matrix(kind, inter, hidden, 2),
                test_matrix(kind, hidden, inter, 3),
            );
            let rec = layout.pack_fp4(3, &gate, &up, &down).unwrap().to_record();
            let (p13, p2) = layout.record_parts();
            assert_eq!(rec.len(), p13 + p2);
            let words =
                |b: &[u8]| b.chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().unwrap())).collect::<Vec<u32>>();
            let (l13, l2) = (&layout.l13, &layout.l2);
            let (c13, s13) =
                gpu_layout::unpack_fp4(&rec[..l13.weight_bytes()], &words(&rec[l13.weight_bytes()..p13]), l13).unwrap();
            let (c2, s2) =
                gpu_layout::unpack_fp4(&rec[p13..p13 + l2.weight_bytes()], &words(&rec[p13 + l2.weight_bytes()..]), l2)
                    .unwrap();
            let ip = l13.rows / 2;
            for (m, codes, scales, row0) in [(&gate, &c13, &s13, 0), (&up, &c13, &s13, ip), (&down, &c2, &s2, 0)] {
                let ng = m.groups();
                for r in 0..m.rows {
                    for c in 0..m.k {
                        assert_eq!(codes[(row0 + r) * m.k + c], m.code(r, c), "{kind} row {r} col {c}");
                    }
                    for g in 0..ng {
                        let want = krasis_quant::fp4::kernel_scale(kind, m.scale_byte(r, g)) * m.row_factor();
                        assert_eq!(scales[(row0 + r) * ng + g].to_bits(), want.to_bits());
                    }
                }
            }
            let err = |r: Result<PackedExpert, GpuError>| r.err().expect("refused").to_string();
            let e = err(layout.pack_fp4(3, &down, &up, &down));
            assert!(e.contains("expert 3") && e.contains("gate is 160x96"), "{e}");
            let other = if kind == Fp4Kind::Mxfp4 { Fp4Kind::Nvfp4 } else { Fp4Kind::Mxfp4 };
            let e = err(layout.pack_fp4(0, &test_matrix(other, inter, hidden, 4), &up, &down));
            assert!(e.contains("gate"), "{e}");
            let e = layout.unpack_record(&rec[..p13], &rec[p13..]).unwrap_err().to_string();
            assert!(e.contains("FP4"), "{e}");
            let int = QuantExpertLayout::new("t", hidden, inter, Bits::Int4, 32, 32).unwrap();
            assert!(err(int.pack_fp4(0, &gate, &up, &down)).contains("not FP4"));
        }
    }

    #[test]
    fn layouts_refuse_empty_shapes() {
        assert!(QuantExpertLayout::new("t", 0, 64, Bits::Int4, 32, 32).is_err());
        assert!(QuantExpertLayout::new("t", 64, 0, Bits::Int4, 32, 32).is_err());
    }
}
