//! The GPU paths' side of the prefix cache ([`crate::runtime::prefix_cache`]): a finished
//! session's KV rows copied into a compact device buffer (a session's own cache is sized for a
//! whole context), and its DeltaNet states at the snapshot points; a new session resumes from a
//! copy of them. Everything stays on the device and is charged to the VRAM budget as
//! "prefix cache".

use krasis_gpu::kv_cache::KvPrefix;
use krasis_gpu::DeviceBuffer;

use super::{GpuModel, GpuSession};
use crate::error::{ModelError, Result};
use crate::runtime::{keep_snapshot, SavedPrefix};

/// A GPU session's state kept by the prefix cache.
pub struct GpuPrefix {
    kv: KvPrefix,
    /// DeltaNet states by position (ascending; the last at `len`); empty without DeltaNet layers.
    points: Vec<(usize, DeviceBuffer<f32>)>,
    len: usize,
    /// With the row-invariant prefill: the leading positions its prompt calls computed (decode
    /// steps' rows come from other kernels, so resuming past them would not be exact).
    exact: Option<usize>,
}

impl SavedPrefix for GpuPrefix {
    fn len(&self) -> usize {
        self.len
    }

    fn bytes(&self) -> usize {
        (self.kv.charged_bytes() + self.points.iter().map(|(_, b)| b.charged_bytes()).sum::<u64>()) as usize
    }

    fn resumable(&self, upto: usize) -> usize {
        crate::runtime::resumable_at(self.len, &self.points, upto.min(self.exact.unwrap_or(usize::MAX)))
    }
}

impl GpuModel {
    /// Keeps `s`'s DeltaNet states at its position (nothing without DeltaNet layers).
    pub fn snapshot(&self, s: &mut GpuSession) -> Result<()> {
        let Some(delta) = s.delta.as_ref() else { return Ok(()) };
        keep_snapshot(&mut s.snapshots, s.position, || delta.copy_state(&self.dev))
    }

    /// `s`'s state as a saved prefix (its KV rows copied out, its snapshots moved).
    pub fn save_prefix(&self, mut s: GpuSession) -> Result<GpuPrefix> {
        self.snapshot(&mut s)?;
        let kv = s.kv.save_prefix(&self.dev, s.position)?;
        let exact = self.invariant_prefill().then_some(s.invariant_len);
        Ok(GpuPrefix { kv, points: std::mem::take(&mut s.snapshots), len: s.position, exact })
    }

    /// A new session holding the first `n` tokens of `saved` (`n` must be resumable).
    pub fn resume_prefix(&self, saved: &GpuPrefix, n: usize) -> Result<GpuSession> {
        if n > saved.len || saved.resumable(n) != n {
            return Err(ModelError::Invalid(format!(
                "a saved prefix of {} tokens holds no state at {n} tokens",
                saved.len
            )));
        }
        self.check_room(n, 1)?;
        let mut s = self.new_session()?;
        // All saved rows go in; those past `n` are never read (the position says where the
        // cache ends) and the next step overwrites them.
        s.kv.load_prefix(&self.dev, &saved.kv)?;
        if let Some(delta) = s.delta.as_mut() {
            let (_, state) =
                saved.points.iter().find(|(p, _)| *p == n).ok_or_else(|| {
                    ModelError::Invalid(format!("a saved prefix holds no DeltaNet state at {n} tokens"))
                })?;
            delta.load_state(&self.dev, state)?;
            s.snapshots.push((n, delta.copy_state(&self.dev)?));
        }
        s.position = n;
        s.invariant_len = n;
        Ok(s)
    }
}
