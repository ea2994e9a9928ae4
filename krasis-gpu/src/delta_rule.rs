//! Gated-DeltaNet layers on the GPU (Qwen3-Next, Qwen3.5), the ops between a layer's input
//! projections and its `out_proj`: the causal depthwise convolution with SiLU (and its state),
//! the per-token preparation (q and k L2-normalised, β and g), the gated delta rule token by token,
//! and the gated RMSNorm of the output; plus the output gate of gated attention. The kernels'
//! layouts are in `kernels/delta_rule.cu`; their twins are `krasis_cpu::delta_rule` and the CPU
//! DeltaNet op of krasis-model.
//!
//! **States.** A call covers `n_seqs` sequences of `rows_per_seq` rows each ([`DeltaSeqs`]: one
//! prompt of `t` rows, or a batched decode step of one row per sequence). Each sequence's state
//! lives in its own device block; the call gets a device table of the blocks' addresses
//! (`u64`, one per sequence, in row order) and the layer's offset into them ([`DeltaStates`]).
//! A layer's part of a block is its conv state `[conv_kernel − 1, channels]` then its rule state
//! `[value_heads, dk, dv]` ([`DeltaDims::state_len`]), all f32.
//!
//! **Decode.** [`GpuDevice::delta_decode_step`] runs a whole layer's step for one row per
//! sequence (the convolution and its state, the preparation, the rule and the gated norm) in two
//! launches for one sequence and one for a batch, where the ops above take five: the same f32
//! operations in the same order (up to the compiler's choice of fused multiply-adds). The batch's
//! kernel and the first of the two own a key head (the conv state's shift needs that); the second
//! owns a value head, which spreads one sequence's rule state over twice the SMs.
//!
//! **Two forms of the rule.** [`GpuDevice::delta_rule`] runs the recurrence token by token
//! (prompts shorter than a chunk; the decode step kernel repeats its steps); [`GpuDevice::delta_rule_chunked`] runs the chunked (WY) form,
//! [`CHUNK`] tokens at a time as small matrix products, for prompts: one kernel computes every
//! chunk's intra-chunk matrices in parallel into a scratch buffer, a second carries the state
//! through the chunks in order, a block per 32 value columns of each value head. Both continue
//! from the state in the block and leave it there, so either may follow the other.

use cudarc::driver::sys::{CUdevice_attribute_enum, CUfunction_attribute_enum};
use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use crate::device::kernel_args;
use crate::kernels::{check, launch_err, to_i32, KernelSource, DEFAULT_SMEM_LIMIT, HEADERS};
use crate::{DeviceBuffer, GpuDevice, GpuError};

pub const DELTA_RULE: KernelSource = KernelSource {
    name: "delta_rule",
    src: include_str!("../kernels/delta_rule.cu"),
    headers: HEADERS,
    options: &[],
    functions: &[
        "delta_conv_silu",
        "delta_conv_state",
        "delta_prep",
        "delta_rule_dk64",
        "delta_rule_dk128",
        "delta_rule_dk256",
        "delta_chunk_prep",
        "delta_chunk_rule_dk64",
        "delta_chunk_rule_dk128",
        "delta_chunk_rule_dk256",
        "delta_decode_prep_dk64",
        "delta_decode_prep_dk128",
        "delta_decode_prep_dk256",
        "delta_decode_rule_dk64",
        "delta_decode_rule_dk128",
        "delta_decode_rule_dk256",
        "delta_decode_dk64",
        "delta_decode_dk128",
        "delta_decode_dk256",
        "delta_gated_norm",
        "output_gate_rows_f32",
    ],
};

/// Largest convolution kernel the conv kernels take (`CONV_MAX_K` there).
pub const MAX_CONV_KERNEL: usize = 8;
/// Largest key head dim the rule kernel takes.
pub const MAX_KEY_DIM: usize = 256;
/// The eps of q and k's L2 normalisation (transformers' `l2norm`), as the kernel has it.
pub const L2_EPS: f32 = 1e-6;

const CONV_THREADS: u32 = 128;
const CONV_ROWS: usize = 16;
/// Columns of S per block of the rule kernel, and its threads (4 per column).
const RULE_COLS: usize = 32;
const RULE_THREADS: u32 = 128;
/// Tokens per chunk of [`GpuDevice::delta_rule_chunked`] (`CHUNK` in the kernels): the chunk
/// transformers' `torch_chunk_gated_delta_rule` and the CPU's chunked form use.
pub const CHUNK: usize = 64;
/// Threads of the chunked kernels, and value columns per block of the second one.
const CHUNK_THREADS: u32 = 256;
const CHUNK_COLS: usize = 32;
/// Floats of the chunked rule kernel's staging area (`CB_STAGE`: two `[64][36]` slices).
const CHUNK_STAGE: usize = 2 * CHUNK * 36;
/// Threads of the decode step's first kernel (`DEC_THREADS`).
const DEC_THREADS: u32 = 256;
/// Most value columns a block of the decode step's rule kernel computes at a time
/// (`DEC_RULE_COLS`: 256 threads, whose registers hold two such passes' state: a 128-wide head's
/// whole state in one load; 512 threads capped the registers at 128 and spilled).
const DEC_RULE_COLS: usize = 64;
/// Grid y and z limit.
const GRID_YZ_MAX: usize = 65_535;

/// One gated-DeltaNet layer's geometry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeltaDims {
    pub key_heads: usize,
    pub value_heads: usize,
    /// Key (and query) head dim.
    pub dk: usize,
    /// Value head dim.
    pub dv: usize,
    pub conv_kernel: usize,
}

impl DeltaDims {
    /// Channels of the convolution: `[q | k | v]`.
    pub fn channels(&self) -> usize {
        2 * self.key_heads * self.dk + self.value_heads * self.dv
    }

    /// Floats of the conv state `[conv_kernel − 1, channels]`.
    pub fn conv_state_len(&self) -> usize {
        self.conv_kernel.saturating_sub(1) * self.channels()
    }

    /// Floats of the rule state `[value_heads, dk, dv]`.
    pub fn rule_state_len(&self) -> usize {
        self.value_heads * self.dk * self.dv
    }

    /// Floats of one layer's state of one sequence: the conv state, then the rule state.
    pub fn state_len(&self) -> usize {
        self.conv_state_len() + self.rule_state_len()
    }

    /// Floats of the scratch [`GpuDevice::delta_rule_chunked`] needs for `seqs`: per sequence,
    /// chunk and value head two `[CHUNK, CHUNK]` matrices.
    pub fn chunk_scratch_len(&self, seqs: DeltaSeqs) -> usize {
        seqs.n_seqs * seqs.rows_per_seq.div_ceil(CHUNK) * self.value_heads * 2 * CHUNK * CHUNK
    }

    /// The key dim the kernels are compiled for that holds `dk` (64, 128 or 256), and the
    /// chunked rule's and the decode step's kernels of that size: the two of one sequence's step,
    /// then the one of a batch's.
    fn dk_kernels(&self) -> (usize, &'static str, [&'static str; 3]) {
        match self.dk {
            0..=64 => {
                (64, "delta_chunk_rule_dk64", ["delta_decode_prep_dk64", "delta_decode_rule_dk64", "delta_decode_dk64"])
            }
            65..=128 => (
                128,
                "delta_chunk_rule_dk128",
                ["delta_decode_prep_dk128", "delta_decode_rule_dk128", "delta_decode_dk128"],
            ),
            _ => (
                256,
                "delta_chunk_rule_dk256",
                ["delta_decode_prep_dk256", "delta_decode_rule_dk256", "delta_decode_dk256"],
            ),
        }
    }

    /// Dynamic shared memory of the chunked rule kernel, in bytes: the state tile `[DKM, 32]`,
    /// the staging area, `R` `[CHUNK, 32]` and three `[CHUNK]` decay vectors.
    fn chunk_rule_smem(&self) -> usize {
        let (dkm, ..) = self.dk_kernels();
        4 * (dkm * CHUNK_COLS + CHUNK_STAGE + CHUNK * CHUNK_COLS + 3 * CHUNK)
    }

    /// Dynamic shared memory of the decode step's rule kernel (one sequence), in bytes: q and k
    /// (padded to the kernel's key dim), then one head's output.
    fn decode_rule_smem(&self) -> usize {
        let (dkm, ..) = self.dk_kernels();
        4 * (2 * dkm + self.dv)
    }

    /// Dynamic shared memory of the batched decode step's kernel, in bytes: q and k (padded),
    /// the key head's values, one head's output, β and e^g per value head.
    fn decode_smem(&self) -> usize {
        let (dkm, ..) = self.dk_kernels();
        let per = self.value_heads / self.key_heads.max(1);
        4 * (2 * dkm + (per + 1) * self.dv + 2 * per)
    }

    /// Columns a block of the decode step's rule kernel computes at a time: the value dim
    /// rounded up to whole warps of 4 threads per column, at most `DEC_RULE_COLS`.
    fn decode_rule_cols(&self) -> usize {
        self.dv.next_multiple_of(8).min(DEC_RULE_COLS)
    }

    /// Whether [`GpuDevice::delta_decode_step`] takes this geometry: the batched kernel's shared
    /// memory (which grows with a key head's value channels; the single sequence's needs less)
    /// within the default 48 KiB.
    pub fn decode_step_fits(&self) -> bool {
        self.decode_smem() <= DEFAULT_SMEM_LIMIT
    }

    fn check(&self, op: &'static str) -> Result<(), GpuError> {
        let d = self;
        check(op, d.key_heads > 0 && d.value_heads > 0 && d.dk > 0 && d.dv > 0, || format!("{d:?}: empty heads"))?;
        check(op, d.value_heads.is_multiple_of(d.key_heads), || format!("{d:?}: value heads per key head"))?;
        check(op, (1..=MAX_CONV_KERNEL).contains(&d.conv_kernel), || {
            format!("{d:?}: conv kernel outside 1..={MAX_CONV_KERNEL}")
        })?;
        check(op, d.dk <= MAX_KEY_DIM, || format!("{d:?}: key dim above {MAX_KEY_DIM}"))?;
        check(op, d.value_heads <= GRID_YZ_MAX, || format!("{d:?}: too many value heads"))?;
        to_i32(op, "channels", d.channels())?;
        Ok(())
    }
}

/// The sequences of a call: `n_seqs` of `rows_per_seq` rows each, sequence `b`'s rows at
/// `b · rows_per_seq ..` of every row-major tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeltaSeqs {
    pub n_seqs: usize,
    pub rows_per_seq: usize,
}

impl DeltaSeqs {
    /// Rows of the call.
    pub fn rows(&self) -> usize {
        self.n_seqs * self.rows_per_seq
    }

    fn check(&self, op: &'static str) -> Result<(), GpuError> {
        check(op, self.n_seqs <= GRID_YZ_MAX, || format!("{} sequences exceed the grid's limit", self.n_seqs))?;
        to_i32(op, "rows per sequence", self.rows_per_seq)?;
        to_i32(op, "rows", self.rows())?;
        Ok(())
    }
}

/// A layer's weights as [`GpuDevice::delta_decode_step`] reads them (all BF16): the conv taps
/// `[channels, conv_kernel]`, `A_log` and `dt_bias` `[value_heads]`, the gated norm's weight
/// `[dv]`.
#[derive(Clone, Copy)]
pub struct DeltaLayerWeights<'a> {
    pub taps: &'a DeviceBuffer<u16>,
    pub a_log: &'a DeviceBuffer<u16>,
    pub dt_bias: &'a DeviceBuffer<u16>,
    pub norm: &'a DeviceBuffer<u16>,
}

/// Where the sequences' states are: the device address of a table of `n_seqs` block addresses
/// (`u64`) and the layer's offset, in floats, into every block.
#[derive(Clone, Copy, Debug)]
pub struct DeltaStates {
    pub table: u64,
    /// Entries of the table (at least the call's sequences).
    pub entries: usize,
    pub offset: usize,
}

impl DeltaStates {
    /// The table `table` (its first entries the call's sequences in order) at `offset`.
    pub fn new(dev: &GpuDevice, table: &impl DevicePtr<u64>, offset: usize) -> Self {
        let (p, _g) = table.device_ptr(dev.stream());
        DeltaStates { table: p, entries: table.len(), offset }
    }
}

fn need(op: &'static str, what: &str, have: usize, want: usize) -> Result<(), GpuError> {
    check(op, have >= want, || format!("{what} has {have} elements, needs {want}"))
}

impl GpuDevice {
    /// The causal depthwise convolution of the rows `x` `[rows, channels]` with SiLU into `out`
    /// (same shape), each sequence continuing from its conv state, which then keeps the last
    /// `conv_kernel − 1` inputs of `[state; x]`. `taps` BF16 `[channels, conv_kernel]`.
    ///
    /// # Safety
    /// Every one of the first `seqs.n_seqs` addresses of `states.table` must point to device
    /// memory of at least `states.offset + d.conv_state_len()` f32 that nothing else touches
    /// until this stream work is done, and the table itself must stay as it is until then.
    pub unsafe fn delta_conv_silu(
        &self,
        x: &impl DevicePtr<f32>,
        out: &mut impl DevicePtrMut<f32>,
        taps: &impl DevicePtr<u16>,
        d: &DeltaDims,
        states: DeltaStates,
        seqs: DeltaSeqs,
    ) -> Result<(), GpuError> {
        const OP: &str = "delta_conv_silu";
        d.check(OP)?;
        seqs.check(OP)?;
        let ch = d.channels();
        let rows = seqs.rows();
        need(OP, "x", x.len(), rows * ch)?;
        need(OP, "out", out.len(), rows * ch)?;
        check(OP, taps.len() == ch * d.conv_kernel, || {
            format!("taps have {} elements, not {ch} x {}", taps.len(), d.conv_kernel)
        })?;
        check(OP, states.entries >= seqs.n_seqs, || {
            format!("a state table of {} entries for {} sequences", states.entries, seqs.n_seqs)
        })?;
        if rows == 0 {
            return Ok(());
        }
        let (ch_i, k_i, r_i) =
            (to_i32(OP, "channels", ch)?, to_i32(OP, "kernel", d.conv_kernel)?, seqs.rows_per_seq as i32);
        let off = states.offset as i64;
        let s = self.stream();
        let (xp, _g1) = x.device_ptr(s);
        let (op, _g2) = out.device_ptr_mut(s);
        let (tp, _g3) = taps.device_ptr(s);
        let gx = ch.div_ceil(CONV_THREADS as usize) as u32;
        let gy = seqs.rows_per_seq.div_ceil(CONV_ROWS);
        check(OP, gy <= GRID_YZ_MAX, || format!("{} rows per sequence exceed the grid's limit", seqs.rows_per_seq))?;
        let f = self.function(&DELTA_RULE, "delta_conv_silu")?;
        let mut b = s.launch_builder(&f);
        b.arg(&xp).arg(&op).arg(&tp).arg(&states.table).arg(&off).arg(&ch_i).arg(&k_i).arg(&r_i);
        let cfg = LaunchConfig {
            grid_dim: (gx, gy as u32, seqs.n_seqs as u32),
            block_dim: (CONV_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: matches the kernel's signature; x, out and taps checked; the states are the
        // caller's promise.
        unsafe { b.launch(cfg) }.map_err(launch_err(OP))?;
        if d.conv_kernel > 1 {
            let f = self.function(&DELTA_RULE, "delta_conv_state")?;
            let mut b = s.launch_builder(&f);
            b.arg(&xp).arg(&states.table).arg(&off).arg(&ch_i).arg(&k_i).arg(&r_i);
            let cfg = LaunchConfig {
                grid_dim: (gx, seqs.n_seqs as u32, 1),
                block_dim: (CONV_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: as above; ordered after the convolution that read the old state.
            unsafe { b.launch(cfg) }.map_err(launch_err("delta_conv_state"))?;
        }
        Ok(())
    }

    /// In place over `rows` rows: q and k of every key head of `qkv` `[rows, channels]`
    /// L2-normalised (eps [`L2_EPS`]), q then scaled by `q_scale`; `b_beta` `[rows,
    /// value_heads]` becomes σ(b) and `a_g` (same shape) `−exp(a_log) · softplus(a + dt_bias)`
    /// (`a_log`, `dt_bias` BF16 `[value_heads]`).
    #[allow(clippy::too_many_arguments)]
    pub fn delta_prep(
        &self,
        qkv: &mut impl DevicePtrMut<f32>,
        b_beta: &mut impl DevicePtrMut<f32>,
        a_g: &mut impl DevicePtrMut<f32>,
        a_log: &impl DevicePtr<u16>,
        dt_bias: &impl DevicePtr<u16>,
        d: &DeltaDims,
        rows: usize,
        q_scale: f32,
    ) -> Result<(), GpuError> {
        const OP: &str = "delta_prep";
        d.check(OP)?;
        let (ch, nv) = (d.channels(), d.value_heads);
        need(OP, "qkv", qkv.len(), rows * ch)?;
        need(OP, "b", b_beta.len(), rows * nv)?;
        need(OP, "a", a_g.len(), rows * nv)?;
        check(OP, a_log.len() == nv && dt_bias.len() == nv, || {
            format!("A_log has {}, dt_bias {} elements, not {nv}", a_log.len(), dt_bias.len())
        })?;
        if rows == 0 {
            return Ok(());
        }
        let r_i = to_i32(OP, "rows", rows)?;
        let (ch_i, nk_i, dk_i, nv_i) = (ch as i32, d.key_heads as i32, d.dk as i32, nv as i32);
        let s = self.stream();
        let (qp, _g1) = qkv.device_ptr_mut(s);
        let (bp, _g2) = b_beta.device_ptr_mut(s);
        let (ap, _g3) = a_g.device_ptr_mut(s);
        let (lp, _g4) = a_log.device_ptr(s);
        let (dp, _g5) = dt_bias.device_ptr(s);
        let f = self.function(&DELTA_RULE, "delta_prep")?;
        let mut b = s.launch_builder(&f);
        b.arg(&qp)
            .arg(&bp)
            .arg(&ap)
            .arg(&lp)
            .arg(&dp)
            .arg(&r_i)
            .arg(&ch_i)
            .arg(&nk_i)
            .arg(&dk_i)
            .arg(&nv_i)
            .arg(&q_scale);
        let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: matches the kernel's signature; every extent checked.
        unsafe { b.launch(cfg) }.map_err(launch_err(OP))?;
        Ok(())
    }

    /// The gated delta rule over the rows of `seqs`, each sequence continuing from its rule
    /// state (updated): `qkv` `[rows, channels]` as [`GpuDevice::delta_prep`] left it, `beta`
    /// and `g` `[rows, value_heads]`, the output `out` `[rows, value_heads · dv]`.
    ///
    /// # Safety
    /// As [`GpuDevice::delta_conv_silu`], each block holding at least `states.offset +
    /// d.rule_state_len()` f32 (here `states.offset` is the rule state's own offset).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn delta_rule(
        &self,
        qkv: &impl DevicePtr<f32>,
        beta: &impl DevicePtr<f32>,
        g: &impl DevicePtr<f32>,
        out: &mut impl DevicePtrMut<f32>,
        d: &DeltaDims,
        states: DeltaStates,
        seqs: DeltaSeqs,
    ) -> Result<(), GpuError> {
        const OP: &str = "delta_rule";
        d.check(OP)?;
        seqs.check(OP)?;
        let (ch, nv) = (d.channels(), d.value_heads);
        let rows = seqs.rows();
        need(OP, "qkv", qkv.len(), rows * ch)?;
        need(OP, "beta", beta.len(), rows * nv)?;
        need(OP, "g", g.len(), rows * nv)?;
        need(OP, "out", out.len(), rows * nv * d.dv)?;
        check(OP, states.entries >= seqs.n_seqs, || {
            format!("a state table of {} entries for {} sequences", states.entries, seqs.n_seqs)
        })?;
        if rows == 0 {
            return Ok(());
        }
        let name = match d.dk {
            0..=64 => "delta_rule_dk64",
            65..=128 => "delta_rule_dk128",
            _ => "delta_rule_dk256",
        };
        let off = states.offset as i64;
        let (ch_i, nk_i, nv_i, dk_i, dv_i) = (ch as i32, d.key_heads as i32, nv as i32, d.dk as i32, d.dv as i32);
        let r_i = seqs.rows_per_seq as i32;
        let s = self.stream();
        let (qp, _g1) = qkv.device_ptr(s);
        let (bp, _g2) = beta.device_ptr(s);
        let (gp, _g3) = g.device_ptr(s);
        let (op, _g4) = out.device_ptr_mut(s);
        let f = self.function(&DELTA_RULE, name)?;
        let mut b = s.launch_builder(&f);
        b.arg(&qp)
            .arg(&bp)
            .arg(&gp)
            .arg(&op)
            .arg(&states.table)
            .arg(&off)
            .arg(&ch_i)
            .arg(&nk_i)
            .arg(&nv_i)
            .arg(&dk_i)
            .arg(&dv_i)
            .arg(&r_i);
        let cfg = LaunchConfig {
            grid_dim: (d.dv.div_ceil(RULE_COLS) as u32, nv as u32, seqs.n_seqs as u32),
            block_dim: (RULE_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: matches the kernel's signature (128 threads: the kernel's RULE_COLS x
        // RULE_SPLIT); extents checked; the states are the caller's promise.
        unsafe { b.launch(cfg) }.map_err(launch_err(OP))?;
        Ok(())
    }

    /// Whether this device can run [`GpuDevice::delta_rule_chunked`] for `d`: the chunked rule
    /// kernel's shared memory (up to 59 KiB, for key dims above 128) within the block limit.
    pub fn delta_rule_chunked_fits(&self, d: &DeltaDims) -> Result<bool, GpuError> {
        let optin = self
            .context()
            .attribute(CUdevice_attribute_enum::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .map_err(|e| GpuError::driver("cuDeviceGetAttribute", e))?;
        let optin = usize::try_from(optin).unwrap_or(0).max(DEFAULT_SMEM_LIMIT);
        Ok(d.chunk_rule_smem() <= optin)
    }

    /// The gated delta rule in its chunked form: what [`GpuDevice::delta_rule`] computes (the
    /// same arguments; the sums in another order), [`CHUNK`] tokens of each sequence at a time.
    /// A sequence's rows need not be a multiple of the chunk. `scratch` holds at least
    /// [`DeltaDims::chunk_scratch_len`] f32; its contents are overwritten.
    ///
    /// # Safety
    /// As [`GpuDevice::delta_rule`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn delta_rule_chunked(
        &self,
        qkv: &impl DevicePtr<f32>,
        beta: &impl DevicePtr<f32>,
        g: &impl DevicePtr<f32>,
        scratch: &mut impl DevicePtrMut<f32>,
        out: &mut impl DevicePtrMut<f32>,
        d: &DeltaDims,
        states: DeltaStates,
        seqs: DeltaSeqs,
    ) -> Result<(), GpuError> {
        const OP: &str = "delta_rule_chunked";
        d.check(OP)?;
        seqs.check(OP)?;
        let (ch, nv) = (d.channels(), d.value_heads);
        let rows = seqs.rows();
        need(OP, "qkv", qkv.len(), rows * ch)?;
        need(OP, "beta", beta.len(), rows * nv)?;
        need(OP, "g", g.len(), rows * nv)?;
        need(OP, "out", out.len(), rows * nv * d.dv)?;
        need(OP, "scratch", scratch.len(), d.chunk_scratch_len(seqs))?;
        check(OP, states.entries >= seqs.n_seqs, || {
            format!("a state table of {} entries for {} sequences", states.entries, seqs.n_seqs)
        })?;
        check(OP, d.key_heads <= GRID_YZ_MAX, || format!("{d:?}: too many key heads"))?;
        if rows == 0 {
            return Ok(());
        }
        let chunks = seqs.rows_per_seq.div_ceil(CHUNK);
        to_i32(OP, "chunks", chunks)?;
        let (dkm, name, _) = d.dk_kernels();
        let smem = d.chunk_rule_smem();
        check(OP, self.delta_rule_chunked_fits(d)?, || {
            format!("{d:?}: the chunked rule needs {smem} bytes of shared memory per block (key dims up to {dkm})")
        })?;
        let off = states.offset as i64;
        let (ch_i, nk_i, nv_i, dk_i, dv_i) = (ch as i32, d.key_heads as i32, nv as i32, d.dk as i32, d.dv as i32);
        let r_i = seqs.rows_per_seq as i32;
        let s = self.stream();
        let (qp, _g1) = qkv.device_ptr(s);
        let (bp, _g2) = beta.device_ptr(s);
        let (gp, _g3) = g.device_ptr(s);
        let (sp, _g4) = scratch.device_ptr_mut(s);
        let (op, _g5) = out.device_ptr_mut(s);
        check(OP, sp.is_multiple_of(16), || format!("scratch at {sp:#x} is not 16-byte aligned"))?;
        let f = self.function(&DELTA_RULE, "delta_chunk_prep")?;
        let mut b = s.launch_builder(&f);
        b.arg(&qp).arg(&bp).arg(&gp).arg(&sp).arg(&ch_i).arg(&nk_i).arg(&nv_i).arg(&dk_i).arg(&r_i);
        let cfg = LaunchConfig {
            grid_dim: (chunks as u32, d.key_heads as u32, seqs.n_seqs as u32),
            block_dim: (CHUNK_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: matches the kernel's signature (256 threads); qkv, beta and g checked; the
        // scratch holds n_seqs x chunks x nv x 2 x 64 x 64 floats, 16-byte aligned.
        unsafe { b.launch(cfg) }.map_err(launch_err("delta_chunk_prep"))?;
        let f = self.function(&DELTA_RULE, name)?;
        if smem > DEFAULT_SMEM_LIMIT {
            f.set_attribute(CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32)
                .map_err(|e| GpuError::driver("cuFuncSetAttribute", e))?;
        }
        let mut b = s.launch_builder(&f);
        b.arg(&qp)
            .arg(&gp)
            .arg(&sp)
            .arg(&op)
            .arg(&states.table)
            .arg(&off)
            .arg(&ch_i)
            .arg(&nk_i)
            .arg(&nv_i)
            .arg(&dk_i)
            .arg(&dv_i)
            .arg(&r_i);
        let cfg = LaunchConfig {
            grid_dim: (d.dv.div_ceil(CHUNK_COLS) as u32, nv as u32, seqs.n_seqs as u32),
            block_dim: (CHUNK_THREADS, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        // SAFETY: matches the kernel's signature (256 threads, `smem` bytes of dynamic shared
        // memory as the kernel carves it for DKM >= dk); extents checked; ordered after the prep
        // kernel on the stream; the states are the caller's promise.
        unsafe { b.launch(cfg) }.map_err(launch_err(OP))?;
        Ok(())
    }

    /// One decode step of a layer for `seqs` (one row per sequence): from the input projections'
    /// rows (`x` `[rows, channels]`, `z` `[rows, value_heads · dv]`, `b` and `a` `[rows,
    /// value_heads]`, as they come out of the projections) to the gated norm's output `out`
    /// `[rows, value_heads · dv]`, each sequence's conv state (at `states.offset`) and rule state
    /// (after it) advanced: what [`GpuDevice::delta_conv_silu`], [`GpuDevice::delta_prep`],
    /// [`GpuDevice::delta_rule`] and [`GpuDevice::delta_gated_norm`] do in turn: for one sequence
    /// in two launches (the second a dependent launch), for a batch in one. `x`, `b` and `a` are
    /// scratch: one sequence's step leaves them holding the prepared q/k/v, β and the decay `e^g`.
    ///
    /// # Safety
    /// As [`GpuDevice::delta_conv_silu`], each block holding at least `states.offset +
    /// d.state_len()` f32.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn delta_decode_step(
        &self,
        x: &mut impl DevicePtrMut<f32>,
        z: &impl DevicePtr<f32>,
        b: &mut impl DevicePtrMut<f32>,
        a: &mut impl DevicePtrMut<f32>,
        w: DeltaLayerWeights<'_>,
        out: &mut impl DevicePtrMut<f32>,
        d: &DeltaDims,
        states: DeltaStates,
        seqs: DeltaSeqs,
        q_scale: f32,
        eps: f32,
    ) -> Result<(), GpuError> {
        const OP: &str = "delta_decode_step";
        d.check(OP)?;
        seqs.check(OP)?;
        check(OP, seqs.rows_per_seq == 1, || {
            format!("{} rows per sequence: a decode step has one", seqs.rows_per_seq)
        })?;
        check(OP, d.decode_step_fits(), || {
            format!("{d:?}: the decode step needs {} bytes of shared memory", d.decode_smem())
        })?;
        check(OP, d.key_heads <= GRID_YZ_MAX, || format!("{d:?}: too many key heads"))?;
        let (ch, nv, vw) = (d.channels(), d.value_heads, d.value_heads * d.dv);
        let rows = seqs.rows();
        need(OP, "x", x.len(), rows * ch)?;
        need(OP, "z", z.len(), rows * vw)?;
        need(OP, "b", b.len(), rows * nv)?;
        need(OP, "a", a.len(), rows * nv)?;
        need(OP, "out", out.len(), rows * vw)?;
        check(OP, w.taps.len() == ch * d.conv_kernel, || {
            format!("taps have {} elements, not {ch} x {}", w.taps.len(), d.conv_kernel)
        })?;
        check(OP, w.a_log.len() == nv && w.dt_bias.len() == nv, || {
            format!("A_log has {}, dt_bias {} elements, not {nv}", w.a_log.len(), w.dt_bias.len())
        })?;
        check(OP, w.norm.len() == d.dv, || format!("norm weight has {} elements, not {}", w.norm.len(), d.dv))?;
        check(OP, states.entries >= seqs.n_seqs, || {
            format!("a state table of {} entries for {} sequences", states.entries, seqs.n_seqs)
        })?;
        if rows == 0 {
            return Ok(());
        }
        let (dkm, _, [prep_name, rule_name, batch_name]) = d.dk_kernels();
        let (conv_off, rule_off) = (states.offset as i64, (states.offset + d.conv_state_len()) as i64);
        let (nk_i, nv_i, dk_i, dv_i, k_i) =
            (d.key_heads as i32, nv as i32, d.dk as i32, d.dv as i32, d.conv_kernel as i32);
        let s = self.stream();
        let (xp, _g1) = x.device_ptr_mut(s);
        let (zp, _g2) = z.device_ptr(s);
        let (bp, _g3) = b.device_ptr_mut(s);
        let (ap, _g4) = a.device_ptr_mut(s);
        let (tp, _g5) = w.taps.device_ptr(s);
        let (lp, _g6) = w.a_log.device_ptr(s);
        let (dp, _g7) = w.dt_bias.device_ptr(s);
        let (np, _g8) = w.norm.device_ptr(s);
        let (op, _g9) = out.device_ptr_mut(s);
        let table = states.table;
        if seqs.n_seqs > 1 {
            // A batch: one launch, a block per key head and sequence (16 sequences of Qwen3.6:
            // 32.0 µs on the H200, against 41.0 for the two launches, whose rule kernel has a
            // block per value head and sequence at 255 registers).
            let f = self.function(&DELTA_RULE, batch_name)?;
            let cfg = LaunchConfig {
                grid_dim: (d.key_heads as u32, seqs.n_seqs as u32, 1),
                block_dim: (DEC_THREADS, 1, 1),
                shared_mem_bytes: d.decode_smem() as u32,
            };
            let mut args = kernel_args![
                &xp, &zp, &bp, &ap, &tp, &lp, &dp, &np, &op, &table, &conv_off, &rule_off, &nk_i, &nv_i, &dk_i, &dv_i,
                &k_i, &q_scale, &eps
            ];
            // SAFETY: matches the kernel's signature (DEC_THREADS threads; the dynamic shared
            // memory as the kernel carves it); every extent checked; the states are the caller's
            // promise; an ordinary launch (the kernel does not wait).
            return unsafe { self.launch_dependent(OP, &f, cfg, &mut args, false) };
        }
        // One sequence: two launches (10.1 µs per Qwen3.6 layer on the H200, against 13.1 for the
        // batch's one launch).
        let prep = self.function(&DELTA_RULE, prep_name)?;
        let cfg = LaunchConfig {
            grid_dim: (d.key_heads as u32, seqs.n_seqs as u32, 1),
            block_dim: (DEC_THREADS, 1, 1),
            shared_mem_bytes: (4 * 2 * dkm) as u32,
        };
        let mut args =
            kernel_args![&xp, &bp, &ap, &tp, &lp, &dp, &table, &conv_off, &nk_i, &nv_i, &dk_i, &dv_i, &k_i, &q_scale];
        // SAFETY: matches the kernel's signature (DEC_THREADS threads; q and k in the dynamic
        // shared memory); every extent checked; the states are the caller's promise; the kernel
        // touches stream memory only after its wait.
        unsafe { self.launch_dependent(OP, &prep, cfg, &mut args, true) }?;
        let rule = self.function(&DELTA_RULE, rule_name)?;
        let cfg = LaunchConfig {
            grid_dim: (nv as u32, seqs.n_seqs as u32, 1),
            block_dim: ((4 * d.decode_rule_cols()) as u32, 1, 1),
            shared_mem_bytes: d.decode_rule_smem() as u32,
        };
        let mut args = kernel_args![&xp, &zp, &bp, &ap, &np, &op, &table, &rule_off, &nk_i, &nv_i, &dk_i, &dv_i, &eps];
        // SAFETY: matches the kernel's signature (4 threads per column, a multiple of 32, at most
        // 256; q, k and one head's output in the dynamic shared memory); before its wait the
        // kernel reads only the rule states, which no launch since the previous step writes: the
        // first kernel releases it only after its own wait, when every earlier launch is done.
        unsafe { self.launch_dependent(OP, &rule, cfg, &mut args, true) }
    }

    /// In place over the `rows` rows of `o` `[rows, value_heads · dv]`: each value head's
    /// `rmsnorm(o) · w · silu(z)`, `z` the same shape, `w` BF16 `[dv]`.
    pub fn delta_gated_norm(
        &self,
        o: &mut impl DevicePtrMut<f32>,
        z: &impl DevicePtr<f32>,
        w: &impl DevicePtr<u16>,
        d: &DeltaDims,
        rows: usize,
        eps: f32,
    ) -> Result<(), GpuError> {
        const OP: &str = "delta_gated_norm";
        d.check(OP)?;
        let n_vec = rows * d.value_heads;
        need(OP, "o", o.len(), n_vec * d.dv)?;
        need(OP, "z", z.len(), n_vec * d.dv)?;
        check(OP, w.len() == d.dv, || format!("norm weight has {} elements, not {}", w.len(), d.dv))?;
        if n_vec == 0 {
            return Ok(());
        }
        let blocks = n_vec.div_ceil(4);
        to_i32(OP, "blocks", blocks)?;
        let (n_i, dv_i) = (n_vec as i64, to_i32(OP, "dv", d.dv)?);
        let s = self.stream();
        let (op, _g1) = o.device_ptr_mut(s);
        let (zp, _g2) = z.device_ptr(s);
        let (wp, _g3) = w.device_ptr(s);
        let f = self.function(&DELTA_RULE, "delta_gated_norm")?;
        let mut b = s.launch_builder(&f);
        b.arg(&op).arg(&zp).arg(&wp).arg(&n_i).arg(&dv_i).arg(&eps);
        let cfg = LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: matches the kernel's signature (4 warps per block); extents checked.
        unsafe { b.launch(cfg) }.map_err(launch_err(OP))?;
        Ok(())
    }

    /// Gated attention's output gate, in place: `y[r, c] /= 1 + exp(−gate[r · g_stride + g_offset
    /// + c])` for `y` `[rows, cols]` contiguous (as the CPU op divides by `1 + e^−g`).
    #[allow(clippy::too_many_arguments)]
    pub fn output_gate_rows_f32(
        &self,
        y: &mut impl DevicePtrMut<f32>,
        rows: usize,
        cols: usize,
        gate: &impl DevicePtr<f32>,
        g_stride: usize,
        g_offset: usize,
    ) -> Result<(), GpuError> {
        const OP: &str = "output_gate_rows";
        let n = rows * cols;
        need(OP, "y", y.len(), n)?;
        if n == 0 {
            return Ok(());
        }
        need(OP, "gate", gate.len(), g_offset + (rows - 1) * g_stride + cols)?;
        let c_i = to_i32(OP, "cols", cols)?;
        let blocks = n.div_ceil(256);
        to_i32(OP, "blocks", blocks)?;
        let (st, r_i) = (g_stride as i64, rows as i64);
        let s = self.stream();
        let (yp, _g1) = y.device_ptr_mut(s);
        let (gp, _g2) = gate.device_ptr(s);
        let gp = gp + (g_offset * 4) as u64;
        let f = self.function(&DELTA_RULE, "output_gate_rows_f32")?;
        let mut b = s.launch_builder(&f);
        b.arg(&yp).arg(&gp).arg(&st).arg(&r_i).arg(&c_i);
        let cfg = LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: matches the kernel's signature; the last gate element read is inside `gate`.
        unsafe { b.launch(cfg) }.map_err(launch_err(OP))?;
        Ok(())
    }
}
