//! Gated-DeltaNet layers on the GPU engine (Qwen3-Next, Qwen3.5), mirroring the CPU op
//! ([`crate::cpu::deltanet`]) step for step: the input projections, the causal convolution with
//! SiLU, q and k L2-normalised (q scaled by `dk^-1/2`), β and g, the gated delta rule, the gated
//! RMSNorm and `out_proj` (kernels: [`krasis_gpu::delta_rule`]). Also the output gate of gated
//! attention, which the GQA op calls.
//!
//! **States.** Each session keeps one f32 block on the device with every DeltaNet layer's state
//! (conv state `[conv_kernel − 1, channels]`, then the rule's `[value_heads, dk, dv]`, layer after
//! layer): a constant per sequence, allocated with the session's KV cache and zero for a fresh
//! sequence. A forward call hands the kernels a device table of its sequences' block addresses:
//! the session's own one-entry table for a prompt or a decode step, the batch's table (rebuilt
//! each step, one entry per sequence) for a batched decode step.
//!
//! **Decode.** A call of one row per sequence (a decode step, alone or batched) runs the layer's
//! convolution, preparation, rule and gated norm in two kernels ([`GpuDevice::delta_decode_step`]).
//!
//! **Rule forms.** Otherwise, a call whose sequences have at least [`CHUNKED_MIN_ROWS`] rows each (a
//! prompt) runs the chunked rule ([`GpuDevice::delta_rule_chunked`]), its scratch in the slot of
//! the input projection's output, dead after the convolution (for the Qwen3-Next and Qwen3.5
//! shapes, `channels ≥ 2 · value_heads · 128`, it already holds the scratch of any call of 64 rows
//! or more); shorter ones run the recurrence, as does every call of the row-invariant prefill
//! ([`super::GpuOptions::invariant_prefill`]).
//!
//! **KV cache.** The KV cache holds the attention layers only ([`kv_layers`]); an attention
//! layer's cache layer is its index among them ([`kv_layer`]).

use krasis_gpu::cudarc::driver::DevicePtr;
use krasis_gpu::delta_rule::{DeltaDims, DeltaLayerWeights, DeltaStates, CHUNK};
use krasis_gpu::linear::GpuLinear;
use krasis_gpu::{DeviceBuffer, GpuDevice, RowsView};

use super::layers::Ctx;
use super::session::{grow, Slot, StepIo};
use crate::error::{ModelError, Result};
use crate::model::build::DeltaNetParts;
use crate::spec::{DeltaNetSpec, ModelSpec};

/// The kernels' geometry of a DeltaNet spec.
pub(crate) fn dims(d: &DeltaNetSpec) -> DeltaDims {
    DeltaDims {
        key_heads: d.key_heads,
        value_heads: d.value_heads,
        dk: d.key_dim,
        dv: d.value_dim,
        conv_kernel: d.conv_kernel,
    }
}

/// Rows per sequence from which a layer runs the chunked rule: measured on the H200 at Qwen3.6's
/// layer shape (`delta_rule` test `chunked_rule_matches_the_recurrence_at_qwen36_shapes_and_timings`,
/// 2026-11-29), the recurrence takes 42 µs for 64 tokens where the chunked form takes 70, and 161
/// µs for 256 where it takes 113: the two cross near 140 tokens (two chunks).
pub(crate) const CHUNKED_MIN_ROWS: usize = 2 * CHUNK;

/// Layers before `l` that are DeltaNet layers.
fn delta_layers_before(spec: &ModelSpec, l: usize) -> usize {
    (0..l).filter(|&i| spec.is_delta_net(i)).count()
}

/// The KV cache layer of attention layer `l`: its index among the attention layers.
pub(crate) fn kv_layer(spec: &ModelSpec, l: usize) -> usize {
    l - delta_layers_before(spec, l)
}

/// Layers of the KV cache: the model's attention layers (at least one, so that a cache exists).
pub(crate) fn kv_layers(spec: &ModelSpec) -> usize {
    kv_layer(spec, spec.num_layers).max(1)
}

/// Floats of one sequence's state block: every DeltaNet layer's state.
fn state_floats(spec: &ModelSpec) -> usize {
    spec.delta_net.map_or(0, |d| dims(&d).state_len() * delta_layers_before(spec, spec.num_layers))
}

/// Device bytes of one sequence's DeltaNet states (0 without DeltaNet layers): what each session
/// adds to the KV cache, whatever its context.
pub fn session_state_bytes(spec: &ModelSpec) -> u64 {
    4 * state_floats(spec) as u64
}

/// One session's DeltaNet states on the device: the block and a one-entry table of its address.
pub(crate) struct SessionDelta {
    state: DeviceBuffer<f32>,
    pub table: DeviceBuffer<u64>,
}

impl SessionDelta {
    /// The zero states of a fresh sequence, or `None` for a model without DeltaNet layers.
    pub fn new(dev: &GpuDevice, spec: &ModelSpec) -> Result<Option<SessionDelta>> {
        let n = state_floats(spec);
        if n == 0 {
            return Ok(None);
        }
        let state = dev.alloc_zeros::<f32>(n, "DeltaNet state")?;
        let addr = {
            let (addr, _g) = state.device_ptr(dev.stream());
            addr
        };
        let table = dev.upload(&[addr], "DeltaNet state table")?;
        Ok(Some(SessionDelta { state, table }))
    }

    /// The device address of the block (an entry of a batch's table).
    pub fn address(&self, dev: &GpuDevice) -> u64 {
        let (addr, _g) = self.state.device_ptr(dev.stream());
        addr
    }

    pub fn bytes(&self) -> u64 {
        4 * self.state.len() as u64
    }

    /// A device copy of the states (a prefix-cache snapshot).
    pub fn copy_state(&self, dev: &GpuDevice) -> Result<DeviceBuffer<f32>> {
        // SAFETY: every element is written by the copy below before any read.
        let mut out = unsafe { dev.alloc_uninit::<f32>(self.state.len(), "DeltaNet state snapshot")? };
        dev.copy_device(&self.state, &mut out)?;
        Ok(out)
    }

    /// Sets the states from a [`SessionDelta::copy_state`] of a session of the same model.
    pub fn load_state(&mut self, dev: &GpuDevice, from: &DeviceBuffer<f32>) -> Result<()> {
        if from.len() != self.state.len() {
            return Err(crate::error::ModelError::Invalid(format!(
                "a DeltaNet state snapshot of {} floats for a session of {}",
                from.len(),
                self.state.len()
            )));
        }
        dev.copy_device(from, &mut self.state)?;
        Ok(())
    }
}

/// One gated-DeltaNet layer on the GPU.
pub(crate) struct GpuDeltaNet<'w> {
    pub spec: DeltaNetSpec,
    pub eps: f32,
    pub w: &'w DeltaNetParts<GpuLinear, DeviceBuffer<u16>>,
}

impl GpuDeltaNet<'_> {
    /// Layer `l` over the call's `xn` into `y`, each sequence advancing its state. Scratch:
    /// f32 slots 0 to 5.
    pub fn forward(&self, c: &Ctx, l: usize, s: &mut StepIo) -> Result<()> {
        let (dev, t) = (c.dev, c.t);
        let d = dims(&self.spec);
        let (ch, vw, nv) = (d.channels(), d.value_heads * d.dv, d.value_heads);
        let hidden = self.w.out.rows();
        let seqs = s.delta.seqs;
        let table = match s.delta.table {
            Some(table) if seqs.rows() == t => table,
            _ => {
                return Err(ModelError::Invalid(format!(
                    "layer {l}: a DeltaNet layer without its sequences' states ({} rows in {seqs:?})",
                    t
                )))
            }
        };
        let off = delta_layers_before(c.spec, l) * d.state_len();
        let sc = &mut *s.scratch;
        let [mixed_slot, conv_slot, z_slot, b_slot, a_slot, o_slot, ..] = &mut sc.f;
        let xn = sc.xn.slice().slice(..t * hidden);
        let mixed = grow(dev, mixed_slot, t * ch, "deltanet q/k/v")?;
        let z = grow(dev, z_slot, t * vw, "deltanet z")?;
        let b = grow(dev, b_slot, t * nv, "deltanet b")?;
        let a = grow(dev, a_slot, t * nv, "deltanet a")?;
        // One GEMV launch for the four projections in decode.
        GpuLinear::forward_group(
            dev,
            c.gemm,
            &xn,
            t,
            &mut [
                (&self.w.qkv, &mut mixed.slice_mut().slice_mut(..t * ch)),
                (&self.w.z, &mut z.slice_mut().slice_mut(..t * vw)),
                (&self.w.b, &mut b.slice_mut().slice_mut(..t * nv)),
                (&self.w.a, &mut a.slice_mut().slice_mut(..t * nv)),
            ],
        )?;
        let q_scale = (self.spec.key_dim as f32).powf(-0.5);
        if seqs.rows_per_seq == 1 && d.decode_step_fits() {
            let o = grow(dev, o_slot, t * vw, "deltanet output")?;
            let w = DeltaLayerWeights {
                taps: &self.w.conv,
                a_log: &self.w.a_log,
                dt_bias: &self.w.dt_bias,
                norm: &self.w.norm,
            };
            // SAFETY: the table's entries are the call's sessions' state blocks (borrowed for the
            // call), each holding every DeltaNet layer's state; `off` is this layer's.
            unsafe {
                dev.delta_decode_step(
                    &mut mixed.slice_mut().slice_mut(..t * ch),
                    &z.slice().slice(..t * vw),
                    &mut b.slice_mut().slice_mut(..t * nv),
                    &mut a.slice_mut().slice_mut(..t * nv),
                    w,
                    &mut o.slice_mut().slice_mut(..t * vw),
                    &d,
                    DeltaStates::new(dev, table, off),
                    seqs,
                    q_scale,
                    self.eps,
                )
            }?;
            self.w.out.forward(
                dev,
                c.gemm,
                &o.slice().slice(..t * vw),
                t,
                &mut sc.y.slice_mut().slice_mut(..t * hidden),
            )?;
            return Ok(());
        }
        let conv = grow(dev, conv_slot, t * ch, "deltanet conv output")?;
        // SAFETY: the table's entries are the call's sessions' state blocks (borrowed for the
        // call), each holding every DeltaNet layer's state; `off` is this layer's.
        unsafe {
            dev.delta_conv_silu(
                &mixed.slice().slice(..t * ch),
                &mut conv.slice_mut().slice_mut(..t * ch),
                &self.w.conv,
                &d,
                DeltaStates::new(dev, table, off),
                seqs,
            )
        }?;
        dev.delta_prep(
            &mut conv.slice_mut().slice_mut(..t * ch),
            &mut b.slice_mut().slice_mut(..t * nv),
            &mut a.slice_mut().slice_mut(..t * nv),
            &self.w.a_log,
            &self.w.dt_bias,
            &d,
            t,
            q_scale,
        )?;
        let o = grow(dev, o_slot, t * vw, "deltanet output")?;
        let rule_states = DeltaStates::new(dev, table, off + d.conv_state_len());
        // A row-invariant call runs the recurrence at every length: the chunked form's sums follow
        // the call's chunk boundaries, the recurrence's only the token order.
        if !c.invariant && seqs.rows_per_seq >= CHUNKED_MIN_ROWS && dev.delta_rule_chunked_fits(&d)? {
            // The projection's output was last read by the convolution, queued before.
            let n = d.chunk_scratch_len(seqs);
            let scratch = grow(dev, mixed_slot, n, "deltanet q/k/v")?;
            // SAFETY: as above; the rule state follows the layer's conv state.
            unsafe {
                dev.delta_rule_chunked(
                    &conv.slice().slice(..t * ch),
                    &b.slice().slice(..t * nv),
                    &a.slice().slice(..t * nv),
                    &mut scratch.slice_mut().slice_mut(..n),
                    &mut o.slice_mut().slice_mut(..t * vw),
                    &d,
                    rule_states,
                    seqs,
                )
            }?;
        } else {
            // SAFETY: as above.
            unsafe {
                dev.delta_rule(
                    &conv.slice().slice(..t * ch),
                    &b.slice().slice(..t * nv),
                    &a.slice().slice(..t * nv),
                    &mut o.slice_mut().slice_mut(..t * vw),
                    &d,
                    rule_states,
                    seqs,
                )
            }?;
        }
        dev.delta_gated_norm(
            &mut o.slice_mut().slice_mut(..t * vw),
            &z.slice().slice(..t * vw),
            &self.w.norm,
            &d,
            t,
            self.eps,
        )?;
        self.w.out.forward(
            dev,
            c.gemm,
            &o.slice().slice(..t * vw),
            t,
            &mut sc.y.slice_mut().slice_mut(..t * hidden),
        )?;
        Ok(())
    }
}

/// Rows per copy of [`split_gated_query`] (the copy kernel's grid limit).
const COPY_MAX_ROWS: usize = 65_535;

/// Gated attention's queries: `full` `[t, heads, 2·hd]` (the query projection's output: per head
/// the query, then its gate) has its queries copied into `q` `[t, heads·hd]`.
pub(crate) fn split_gated_query(
    c: &Ctx,
    full: &DeviceBuffer<f32>,
    heads: usize,
    hd: usize,
    q: &mut DeviceBuffer<f32>,
) -> Result<()> {
    let (dev, t) = (c.dev, c.t);
    let rows = t * heads;
    let mut r0 = 0;
    while r0 < rows {
        let n = (rows - r0).min(COPY_MAX_ROWS);
        dev.copy_rows_f32(
            full,
            RowsView { rows: n, cols: hd, stride: 2 * hd, offset: r0 * 2 * hd },
            q,
            RowsView { rows: n, cols: hd, stride: hd, offset: r0 * hd },
        )?;
        r0 += n;
    }
    Ok(())
}

/// The attention output `o` `[t, heads·hd]` divided by `1 + e^−gate`, the gates those
/// query projection left in `full` beside the queries ([`split_gated_query`]).
pub(crate) fn apply_output_gate(
    c: &Ctx,
    o: &mut DeviceBuffer<f32>,
    full: &Slot<f32>,
    heads: usize,
    hd: usize,
) -> Result<()> {
    let t = c.t;
    let full = full.as_ref().ok_or_else(|| ModelError::Invalid("gated attention: no gates computed".into()))?;
    c.dev.output_gate_rows_f32(
        &mut o.slice_mut().slice_mut(..t * heads * hd),
        t * heads,
        hd,
        &full.slice().slice(..t * heads * 2 * hd),
        2 * hd,
        hd,
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qwen3_next() -> ModelSpec {
        let config = crate::synth::preset_config(crate::synth::Preset::Qwen3Next80b, None).to_string();
        crate::arch::parse_config(&config, std::path::Path::new("config.json")).unwrap()
    }

    /// Qwen3-Next-80B: 48 layers, every fourth one attention. The KV cache has the 12 attention
    /// layers; the DeltaNet states of one sequence are 36 layers × (3 × 8192 conv floats +
    /// 32 × 128 × 128 rule floats), whatever the context.
    #[test]
    fn the_kv_cache_holds_the_attention_layers_and_the_states_are_per_sequence() {
        let spec = qwen3_next();
        assert_eq!(kv_layers(&spec), 12);
        assert_eq!((kv_layer(&spec, 3), kv_layer(&spec, 7), kv_layer(&spec, 47)), (0, 1, 11));
        let d = dims(&spec.delta_net.unwrap());
        assert_eq!((d.channels(), d.conv_state_len(), d.rule_state_len()), (8192, 3 * 8192, 32 * 128 * 128));
        assert_eq!(session_state_bytes(&spec), 36 * 4 * (3 * 8192 + 32 * 128 * 128) as u64);
        // Layer 4's state follows layers 0 to 2's (layer 3 is attention).
        assert_eq!(delta_layers_before(&spec, 4) * d.state_len(), 3 * d.state_len());
        // A model without DeltaNet layers: every layer in the cache, no states.
        let v2 = crate::synth::preset_config(crate::synth::Preset::V2Lite, None).to_string();
        let v2 = crate::arch::parse_config(&v2, std::path::Path::new("config.json")).unwrap();
        assert_eq!((kv_layers(&v2), kv_layer(&v2, 5), session_state_bytes(&v2)), (v2.num_layers, 5, 0));
    }

    /// For the published Qwen3-Next and Qwen3.6 shapes the chunked rule's scratch fits in the
    /// input projection's slot (`t · channels` floats) for every call that takes the chunked
    /// form (at least [`CHUNKED_MIN_ROWS`] rows per sequence), so prompts allocate nothing more;
    /// and the decode step kernel takes both geometries.
    #[test]
    fn the_chunked_scratch_fits_in_the_projection_slot_and_decode_fuses() {
        for preset in [crate::synth::Preset::Qwen3Next80b, crate::synth::Preset::Qwen36_35b] {
            let config = crate::synth::preset_config(preset, None).to_string();
            let spec = crate::arch::parse_config(&config, std::path::Path::new("config.json")).unwrap();
            let d = dims(&spec.delta_net.unwrap());
            assert!(d.decode_step_fits(), "{preset:?}: {d:?}");
            for n_seqs in 1..=3 {
                for rows_per_seq in CHUNKED_MIN_ROWS..=4 * CHUNK + 1 {
                    let seqs = krasis_gpu::delta_rule::DeltaSeqs { n_seqs, rows_per_seq };
                    let (need, slot) = (d.chunk_scratch_len(seqs), seqs.rows() * d.channels());
                    assert!(need <= slot, "{preset:?} {seqs:?}: scratch {need} > projection slot {slot}");
                }
            }
        }
    }

    /// The VRAM plan's per-token scratch covers a DeltaNet layer's buffers (q/k/v twice, z, the
    /// output: 2 × 8192 + 2 × 4096 f32 per token here) and gated attention's whole q projection.
    #[test]
    fn the_scratch_estimate_covers_deltanet_and_gated_attention() {
        let spec = qwen3_next();
        let c = super::super::vram_plan::ScratchCost::of(&spec, false);
        assert!(c.per_token >= 4 * (3 * 2048 + 2 * 8192 + 2 * 4096), "{c:?}");
    }
}
