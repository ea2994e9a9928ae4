//! One conversation on the GPU: its KV cache, the decode workspace and the activation buffers,
//! which grow to the largest call seen and are then reused (decode steps allocate nothing).

use krasis_gpu::attn_decode::DecodeWorkspace;
use krasis_gpu::cudarc::driver::DeviceRepr;
use krasis_gpu::kv_cache::GpuKvCache;
use krasis_gpu::{DeviceBuffer, GpuDevice, GpuError};

use super::layers::Ctx;
use super::profile::StepProfile;
use crate::error::{ModelError, Result};

/// A buffer that grows on demand.
pub(crate) type Slot<T> = Option<DeviceBuffer<T>>;

/// `slot` with room for at least `n` elements (reallocated, contents lost, when smaller).
pub(crate) fn grow<'a, T: DeviceRepr>(
    dev: &GpuDevice,
    slot: &'a mut Slot<T>,
    n: usize,
    what: &str,
) -> std::result::Result<&'a mut DeviceBuffer<T>, GpuError> {
    if slot.as_ref().is_none_or(|b| b.len() < n) {
        *slot = None; // release first so the budget sees the old charge go
                      // SAFETY: scratch: every user writes the elements it reads in the same call.
        *slot = Some(unsafe { dev.alloc_uninit::<T>(n.max(1), what)? });
    }
    Ok(slot.as_mut().expect("just allocated"))
}

/// Activation buffers of one session.
#[derive(Default)]
pub(crate) struct Scratch {
    pub tokens: usize,
    pub ids: DeviceBufferOr<i32>,
    pub positions: DeviceBufferOr<i32>,
    pub next_id: DeviceBufferOr<i32>,
    pub x: DeviceBufferOr<f32>,
    pub xn: DeviceBufferOr<f32>,
    pub y: DeviceBufferOr<f32>,
    pub logits: DeviceBufferOr<f32>,
    /// Per-layer temporaries (f32). A slot's role depends on the layer part using it (each part
    /// destructures the array into named slots in `layers.rs`); parts run one after another, so
    /// they share the memory. The budget names a slot by its first use.
    pub f: [Slot<f32>; 8],
    /// Per-layer BF16 temporaries (inputs of the flash kernel), shared the same way.
    pub b: [Slot<u16>; 4],
    /// Router output.
    pub route_ids: Slot<i32>,
    pub route_w: Slot<f32>,
    /// Chunked streaming: the routes renumbered for one chunk, and a chunk's part of the output.
    pub chunk_ids: Slot<i32>,
    pub chunk_out: Slot<f32>,
    /// Decode's PCIe share: the intermediate of the GPU's routes.
    pub pcie_h: Slot<f32>,
}

/// A device buffer that exists after the first [`Scratch::ensure`]. Deref panics before that,
/// which would be a bug in this module, not an input error.
pub(crate) struct DeviceBufferOr<T>(Slot<T>);

impl<T> Default for DeviceBufferOr<T> {
    fn default() -> Self {
        DeviceBufferOr(None)
    }
}

impl<T> std::ops::Deref for DeviceBufferOr<T> {
    type Target = DeviceBuffer<T>;
    fn deref(&self) -> &DeviceBuffer<T> {
        self.0.as_ref().expect("scratch used before Scratch::ensure")
    }
}

impl<T> std::ops::DerefMut for DeviceBufferOr<T> {
    fn deref_mut(&mut self) -> &mut DeviceBuffer<T> {
        self.0.as_mut().expect("scratch used before Scratch::ensure")
    }
}

impl Scratch {
    /// Room for a call of `t` tokens of `hidden`.
    pub fn ensure(&mut self, dev: &GpuDevice, t: usize, hidden: usize) -> Result<()> {
        grow(dev, &mut self.next_id.0, 1, "sampled token id")?;
        if t > self.tokens || self.x.0.is_none() {
            grow(dev, &mut self.ids.0, t, "token ids")?;
            grow(dev, &mut self.positions.0, t, "positions")?;
            grow(dev, &mut self.x.0, t * hidden, "residual stream")?;
            grow(dev, &mut self.xn.0, t * hidden, "normed activations")?;
            grow(dev, &mut self.y.0, t * hidden, "layer output")?;
            self.tokens = t;
        }
        Ok(())
    }

    /// Room for `n` sampled ids (one per sequence of a batched step).
    pub fn ensure_next_ids(&mut self, dev: &GpuDevice, n: usize) -> Result<()> {
        grow(dev, &mut self.next_id.0, n, "sampled token ids")?;
        Ok(())
    }

    pub fn ensure_logits(&mut self, dev: &GpuDevice, n: usize) -> Result<()> {
        grow(dev, &mut self.logits.0, n, "logits")?;
        Ok(())
    }

    /// ids[0] = next_id[0], on the device (no host round trip).
    pub fn copy_next_id_to_ids(&mut self, dev: &GpuDevice) -> Result<()> {
        let src = self.next_id.slice().slice(..1);
        let mut dst = self.ids.slice_mut().slice_mut(..1);
        dev.copy_device(&src, &mut dst)?;
        Ok(())
    }
}

/// What the layers of one forward call read and write: the activations, the decode attention
/// workspace, the profile, and the KV caches the call's tokens belong to.
pub(crate) struct StepIo<'a> {
    pub scratch: &'a mut Scratch,
    pub ws: &'a mut DecodeWorkspace,
    pub profile: Option<&'a mut StepProfile>,
    pub kv: KvRows<'a>,
    /// The DeltaNet states of the call's sequences (gated-DeltaNet models).
    pub delta: DeltaRows<'a>,
}

/// Where the sequences of a forward call keep their gated-DeltaNet states
/// ([`super::deltanet`]): a device table of their state blocks' addresses, in row order, and
/// how the call's rows split into sequences (one sequence of `t` rows, or one row each). No table
/// for a model without DeltaNet layers.
pub(crate) struct DeltaRows<'a> {
    pub table: Option<&'a DeviceBuffer<u64>>,
    pub seqs: krasis_gpu::delta_rule::DeltaSeqs,
}

impl StepIo<'_> {
    /// Marks the end of `part` in the profile, when one runs.
    pub fn mark(&mut self, dev: &GpuDevice, part: super::profile::Part) -> Result<()> {
        match self.profile.as_deref_mut() {
            Some(p) => p.mark(dev, part),
            None => Ok(()),
        }
    }
}

/// Where the tokens of a forward call keep their keys and values.
pub(crate) enum KvRows<'a> {
    /// One sequence: the call's `t` tokens are consecutive, from [`Ctx::pos`].
    Seq(&'a GpuKvCache),
    /// Batched decode: one token per sequence, row `i` at position `rows[i].1` of cache `rows[i].0`.
    PerRow(&'a [(&'a GpuKvCache, usize)]),
}

impl KvRows<'_> {
    /// Calls `f(cache, first position, first row, rows)` for each run of the call's rows that
    /// belongs to one sequence, in row order.
    pub fn for_each_seq(
        &self,
        c: &Ctx,
        mut f: impl FnMut(&GpuKvCache, usize, usize, usize) -> Result<()>,
    ) -> Result<()> {
        match self {
            KvRows::Seq(kv) => f(kv, c.pos, 0, c.t),
            KvRows::PerRow(rows) => {
                debug_assert_eq!(rows.len(), c.t, "one row per sequence");
                rows.iter().enumerate().try_for_each(|(i, &(kv, pos))| f(kv, pos, i, 1))
            }
        }
    }

    /// The one sequence's cache (prefill's expanded attention reads it whole).
    pub fn seq(&self, what: &str) -> Result<&GpuKvCache> {
        match self {
            KvRows::Seq(kv) => Ok(kv),
            KvRows::PerRow(_) => Err(ModelError::Invalid(format!("{what}: batched calls are decode steps only"))),
        }
    }
}

pub struct GpuSession {
    pub(crate) kv: GpuKvCache,
    /// The gated-DeltaNet layers' states (constant size), for models that have them.
    pub(crate) delta: Option<super::deltanet::SessionDelta>,
    pub(crate) ws: DecodeWorkspace,
    pub(crate) scratch: Scratch,
    /// Pinned hand-off buffers of the hybrid engine (empty when the experts are on the GPU).
    pub(crate) host: super::host_experts::HostStaging,
    pub(crate) position: usize,
    /// The token the last step sampled (its id is still on the device).
    pub(crate) last_sampled: Option<u32>,
    /// `KRASIS_GPU_PROFILE=1`: device time per part of each forward call.
    pub(crate) profile: Option<StepProfile>,
    /// DeltaNet states kept at earlier positions for the prefix cache (oldest first, at most
    /// [`crate::runtime::DELTA_SNAPSHOTS`]; [`super::prefix`]).
    pub(crate) snapshots: Vec<(usize, DeviceBuffer<f32>)>,
    /// Leading positions every one of whose rows a row-invariant prefill call computed
    /// ([`super::GpuOptions::invariant_prefill`]): the prefix a saved state can resume exactly.
    pub(crate) invariant_len: usize,
}

impl GpuSession {
    pub(crate) fn new(kv: GpuKvCache, delta: Option<super::deltanet::SessionDelta>, ws: DecodeWorkspace) -> Self {
        GpuSession {
            kv,
            delta,
            ws,
            scratch: Scratch::default(),
            host: Default::default(),
            position: 0,
            last_sampled: None,
            profile: super::profile::StepProfile::from_env(),
            snapshots: Vec::new(),
            invariant_len: 0,
        }
    }

    pub fn position(&self) -> usize {
        self.position
    }

    /// Where the hybrid hand-off time went so far (zero when the experts are on the GPU).
    pub fn handoff_stats(&self) -> crate::runtime::HandoffStats {
        self.host.stats
    }

    pub fn kv_bytes(&self) -> usize {
        self.kv.capacity() * self.kv.bytes_per_token()
    }

    /// Device bytes of the session's gated-DeltaNet states (0 without DeltaNet layers), beside
    /// its KV cache.
    pub fn delta_state_bytes(&self) -> u64 {
        self.delta.as_ref().map_or(0, |d| d.bytes())
    }
}
