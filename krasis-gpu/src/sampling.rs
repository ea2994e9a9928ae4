//! Token sampling on the GPU: the token krasis-model's CPU `Sampler` returns for the same logits
//! and the same uniform draw, without a sort of the vocabulary.
//!
//! **Split of work.** The host draws the uniform `u ∈ [0, 1)` (the CPU sampler's one
//! `rng.random::<f64>()` per non-greedy token) and passes it in; the GPU does the rest and writes
//! the token id to device memory, so decode can feed it to the next embedding without a sync.
//!
//! **Design** (`kernels/sampling.cu`): both kernels are cooperative launches of up to one block
//! per SM, each block owning a contiguous slice of the row, meeting at grid barriers; every
//! cross-block total is an integer sum or a max, so the result does not depend on timing.
//! * greedy (`temperature <= 0` or `top_k == 1`, as the CPU decides): `sample_argmax`, per-block
//!   maxima of (value desc, index asc) packed into a u64 and combined by `atomicMax`, NaNs
//!   skipped as the CPU's `argmax` skips them.
//! * otherwise `sample_topk_topp`: each logit becomes an order key of `l / T` and a fixed-point
//!   mass `round(exp(l/T - max) · 2^S)` with `S = 63 - ceil(log2 vocab)` (so any sum fits in
//!   64 bits and integer sums are exact and deterministic). The CPU's three cut points in its
//!   sorted order (value desc, index asc) — the end of the top-k, the end of the top-p nucleus,
//!   the sampled position — are each found by a 4-pass radix select (8-bit digits, histograms of
//!   count and mass; the first digit's histogram is built once with the masses), plus integer
//!   arithmetic inside a run of equal values and one ordered scan for the final index.
//!   Scratch: a key (u32) and a mass (u64) per vocabulary entry, and a small state buffer
//!   (barrier, histograms, per-block partials).
//! * Where the result may differ from the CPU's: only when `u` (or `top_p`) lies within about
//!   `vocab · 2^-S` (≤ 2.3e-9 for a 160K vocabulary; typically orders of magnitude less) of a
//!   cumulative-probability boundary, since the CPU's boundaries are f64 running sums of
//!   normalised probabilities. Ties are resolved exactly as the CPU does (by index). NaN logits
//!   rank lowest here (the CPU's order with NaN is unspecified).
//!
//! **What krasis-model's `Sampler` must expose** so both paths consume the RNG identically:
//! `is_greedy()` (`temperature <= 0 || top_k == 1`), `next_uniform(&mut self) -> Option<f64>`
//! (`None` when greedy, else `Some(self.rng.random::<f64>())`), and a pure
//! `sample_with(params, logits, u: f64)`; `sample()` becomes `sample_with(.., next_uniform())`.
//! Drawing `u` before (instead of after) building the candidates does not change the sequence.

use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use crate::kernels::{KernelSource, HEADERS};
use crate::{DeviceBuffer, GpuDevice, GpuError};

pub const SAMPLING: KernelSource = KernelSource {
    name: "sampling",
    src: include_str!("../kernels/sampling.cu"),
    headers: HEADERS,
    options: &[],
    functions: &["sample_argmax", "sample_topk_topp"],
};

/// Largest vocabulary: the fixed-point masses keep `S = 63 - ceil(log2 vocab)` ≥ 39 fraction
/// bits (a mass resolution of 2e-12 of the largest probability).
pub const SAMPLER_MAX_VOCAB: usize = 1 << 24;
/// Threads per block; the kernel maps one thread to each of its 256 histogram bins
/// (`SM_THREADS` in sampling.cu).
const SAMPLE_THREADS: u32 = 256;
/// Fewest row elements per block: below this a grid barrier costs more than the block saves.
const SAMPLE_MIN_PER_BLOCK: usize = 1024;
/// Most blocks (`SM_MAX_BLOCKS` in sampling.cu: per-block slots in the state buffer).
const SAMPLE_MAX_BLOCKS: usize = 1024;
/// u64 words of the state buffer: 8 control words, 4 histograms of 512 words, two per-block
/// arrays (`SM_ST_*` in sampling.cu).
const SAMPLE_STATE_WORDS: usize = 8 + 8 * 256 + 2 * SAMPLE_MAX_BLOCKS;

/// krasis-model's `SamplingParams` without the seed (the caller owns the RNG).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GpuSamplingParams {
    /// `<= 0`: greedy.
    pub temperature: f32,
    /// 0 = off; 1 = greedy; `>= vocab` = off.
    pub top_k: usize,
    /// `>= 1` = off.
    pub top_p: f32,
}

impl GpuSamplingParams {
    /// The CPU sampler's greedy rule: no RNG draw is consumed for such a token.
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0 || self.top_k == 1
    }

    /// Refuses NaN temperature/top_p (the CPU would sample from NaN probabilities) and a draw
    /// outside `[0, 1)`.
    pub fn validate(&self, u: f64) -> Result<(), GpuError> {
        if self.temperature.is_nan() || self.top_p.is_nan() {
            return Err(GpuError::shape("sample", format!("NaN in sampling parameters {self:?}")));
        }
        if !self.is_greedy() && !(0.0..1.0).contains(&u) {
            return Err(GpuError::shape("sample", format!("uniform draw u = {u} is not in [0, 1)")));
        }
        Ok(())
    }
}

/// `S` for a vocabulary: fraction bits of the fixed-point masses, so that `vocab · 2^S ≤ 2^63`.
pub fn mass_scale_bits(vocab: usize) -> u32 {
    let ceil_log2 = usize::BITS - vocab.saturating_sub(1).leading_zeros();
    (63 - ceil_log2).min(62)
}

/// Sampling scratch for one vocabulary size (keys and masses, budget-charged).
#[derive(Debug)]
pub struct GpuSampler {
    vocab: usize,
    keys: DeviceBuffer<u32>,
    mass: DeviceBuffer<u64>,
    /// Barrier words, histograms and per-block partials; zeroed here, kept consistent by the
    /// kernels (each leaves the barrier and argmax words at rest and zeroes its histograms).
    state: DeviceBuffer<u64>,
    /// Blocks per launch: all resident at once (cooperative launch), at most one per SM.
    blocks: u32,
}

fn check_vocab(vocab: usize) -> Result<(), GpuError> {
    if vocab == 0 || vocab > SAMPLER_MAX_VOCAB {
        return Err(GpuError::shape("sample", format!("vocab = {vocab}; must be 1..={SAMPLER_MAX_VOCAB}")));
    }
    Ok(())
}

impl GpuSampler {
    pub fn new(dev: &GpuDevice, vocab: usize) -> Result<Self, GpuError> {
        check_vocab(vocab)?;
        // SAFETY: sample_topk_topp writes all `vocab` keys and masses before reading any.
        let keys = unsafe { dev.alloc_uninit::<u32>(vocab, "sampler keys")? };
        // SAFETY: as above.
        let mass = unsafe { dev.alloc_uninit::<u64>(vocab, "sampler masses")? };
        let state = dev.alloc_zeros::<u64>(SAMPLE_STATE_WORDS, "sampler state")?;
        let attr = |a| dev.context().attribute(a).map_err(|e| GpuError::driver("cuDeviceGetAttribute", e));
        use cudarc::driver::sys::CUdevice_attribute as A;
        if attr(A::CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH)? == 0 {
            return Err(GpuError::shape("sample", "the device does not support cooperative launches"));
        }
        let sms = attr(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?.max(1) as usize;
        // Every block of a cooperative launch must be resident: check that one per SM fits.
        for name in SAMPLING.functions {
            let f = dev.function(&SAMPLING, name)?;
            let per_sm = f
                .occupancy_max_active_blocks_per_multiprocessor(SAMPLE_THREADS, 0, None)
                .map_err(|e| GpuError::driver("cuOccupancyMaxActiveBlocksPerMultiprocessor", e))?;
            if per_sm == 0 {
                return Err(GpuError::shape(
                    "sample",
                    format!("{name}: no block of {SAMPLE_THREADS} threads fits an SM"),
                ));
            }
        }
        let blocks = vocab.div_ceil(SAMPLE_MIN_PER_BLOCK).min(sms).clamp(1, SAMPLE_MAX_BLOCKS) as u32;
        Ok(GpuSampler { vocab, keys, mass, state, blocks })
    }

    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// Samples from row `row` of `logits [rows, vocab]` (f32) with the uniform draw `u ∈ [0, 1)`
    /// (ignored when [`GpuSamplingParams::is_greedy`]); writes the token id to `out[0]`.
    /// Launches on the compute stream (which also orders the reuse of the scratch: one sampler
    /// must not be used on two streams at once); no sync.
    pub fn sample(
        &self,
        dev: &GpuDevice,
        logits: &impl DevicePtr<f32>,
        row: usize,
        params: GpuSamplingParams,
        u: f64,
        out: &mut impl DevicePtrMut<i32>,
    ) -> Result<(), GpuError> {
        const OP: &str = "sample";
        let v = self.vocab;
        if logits.len() % v != 0 || row >= logits.len() / v {
            return Err(GpuError::shape(OP, format!("row {row} of logits with {} elements, vocab {v}", logits.len())));
        }
        if out.is_empty() {
            return Err(GpuError::shape(OP, "out has no element"));
        }
        params.validate(u)?;
        let s = dev.stream();
        let (l_p, _g0) = logits.device_ptr(s);
        let l_p = l_p + (row * v * std::mem::size_of::<f32>()) as u64;
        let (o_p, _g1) = out.device_ptr_mut(s);
        let v_i = v as i32;
        let lc = LaunchConfig { grid_dim: (self.blocks, 1, 1), block_dim: (SAMPLE_THREADS, 1, 1), shared_mem_bytes: 0 };
        let (st_p, _g4) = self.state.device_ptr(s);
        let launch_err = |e: cudarc::driver::DriverError| GpuError::Driver { op: OP, detail: e.to_string() };
        if params.is_greedy() {
            let f = dev.function(&SAMPLING, "sample_argmax")?;
            let mut b = s.launch_builder(&f);
            b.arg(&l_p).arg(&v_i).arg(&st_p).arg(&o_p);
            // SAFETY: argument list matches the kernel; the row has `vocab` elements; out ≥ 1;
            // the state buffer is only used on this stream; `blocks` fit the device at once.
            unsafe { b.launch_cooperative(lc) }.map_err(launch_err)?;
            return Ok(());
        }
        let top_k: i32 = if params.top_k >= v { 0 } else { params.top_k as i32 };
        let scale = mass_scale_bits(v) as i32;
        let (k_p, _g2) = self.keys.device_ptr(s);
        let (m_p, _g3) = self.mass.device_ptr(s);
        let f = dev.function(&SAMPLING, "sample_topk_topp")?;
        let mut b = s.launch_builder(&f);
        b.arg(&l_p).arg(&v_i).arg(&params.temperature).arg(&top_k).arg(&params.top_p).arg(&u).arg(&scale);
        b.arg(&k_p).arg(&m_p).arg(&st_p).arg(&o_p);
        // SAFETY: argument list matches the kernel; keys/mass hold `vocab` elements each and,
        // with the state buffer, are only used on this stream; `blocks` fit the device at once.
        unsafe { b.launch_cooperative(lc) }.map_err(launch_err)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scale_bits_keep_the_total_in_64_bits() {
        for v in [1usize, 2, 3, 1000, 151_936, 160_000, 1 << 17, (1 << 17) + 1, SAMPLER_MAX_VOCAB] {
            let s = mass_scale_bits(v);
            assert!((39..=62).contains(&s), "vocab {v}: S = {s}");
            assert!((v as u128) << s <= 1u128 << 63, "vocab {v}: S = {s} overflows");
            // And it is the largest such S (one more bit would overflow), unless capped at 62.
            assert!(s == 62 || (v as u128) << (s + 1) > 1u128 << 63, "vocab {v}: S = {s} wastes a bit");
        }
        assert!(check_vocab(0).is_err() && check_vocab(SAMPLER_MAX_VOCAB + 1).is_err());
    }

    #[test]
    fn params_validation() {
        let p = |temperature, top_k, top_p| GpuSamplingParams { temperature, top_k, top_p };
        assert!(p(0.0, 0, 1.0).is_greedy() && p(-1.0, 5, 0.5).is_greedy() && p(0.7, 1, 0.9).is_greedy());
        assert!(!p(0.7, 0, 1.0).is_greedy() && !p(0.7, 2, 0.9).is_greedy());
        assert!(p(0.7, 0, 0.9).validate(0.0).is_ok() && p(0.7, 0, 0.9).validate(0.999).is_ok());
        assert!(p(0.7, 0, 0.9).validate(1.0).is_err() && p(0.7, 0, 0.9).validate(-0.1).is_err());
        assert!(p(0.7, 0, 0.9).validate(f64::NAN).is_err());
        assert!(p(0.0, 0, 1.0).validate(7.0).is_ok(), "greedy ignores u");
        assert!(p(f32::NAN, 0, 1.0).validate(0.5).is_err() && p(0.7, 0, f32::NAN).validate(0.5).is_err());
    }
}
