//! The CPU and GPU engines' decoders and sessions as seen by the Engine API.

use super::{DevicePath, EngineDecoder, EngineSession};
use crate::engine::{ForwardStats, Model, Session};
use crate::error::Result;
use crate::gpu::{GpuModel, GpuSession, HandoffStats};

impl EngineSession for Session {
    fn position(&self) -> usize {
        Session::position(self)
    }

    fn kv_capacity(&self) -> Option<usize> {
        None
    }

    fn kv_bytes(&self) -> usize {
        Session::kv_bytes(self)
    }
}

impl EngineDecoder for Model {
    fn device(&self) -> DevicePath {
        DevicePath::Cpu
    }

    /// The routed experts' executor (everything runs on the CPU; the experts are what differ).
    fn describe(&self) -> String {
        self.experts_description()
    }

    fn forward_stats(&self) -> Option<&ForwardStats> {
        Some(Model::forward_stats(self))
    }

    fn dense_bytes_per_token(&self) -> Option<u64> {
        Some(Model::dense_bytes_per_token(self))
    }

    fn expert_counts(&self) -> Result<Option<Vec<u64>>> {
        Ok(self.heatmap())
    }
}

impl EngineSession for GpuSession {
    fn position(&self) -> usize {
        GpuSession::position(self)
    }

    fn kv_capacity(&self) -> Option<usize> {
        Some(self.kv.capacity())
    }

    fn kv_bytes(&self) -> usize {
        GpuSession::kv_bytes(self)
    }

    fn handoff_stats(&self) -> Option<HandoffStats> {
        Some(GpuSession::handoff_stats(self))
    }
}

impl EngineDecoder for GpuModel {
    fn expert_counts(&self) -> Result<Option<Vec<u64>>> {
        GpuModel::expert_counts(self)
    }

    fn device(&self) -> DevicePath {
        if self.experts_on_host() {
            DevicePath::Hybrid
        } else {
            DevicePath::Gpu
        }
    }

    fn describe(&self) -> String {
        let what =
            if self.experts_on_host() { "all but the routed experts (those on the CPU)" } else { "the whole model" };
        format!(
            "gpu {}: {what}, {} tokens of KV cache per session",
            GpuModel::device(self).info(),
            GpuModel::kv_capacity(self)
        )
    }

    fn kv_capacity(&self) -> Option<usize> {
        Some(GpuModel::kv_capacity(self))
    }

    fn batch_handoff_stats(&self) -> Option<HandoffStats> {
        self.experts_on_host().then(|| GpuModel::batch_handoff_stats(self))
    }

    fn profile_summary(&self, session: &GpuSession) -> Option<String> {
        GpuModel::profile_summary(self, session)
    }

    fn reset_profile(&self, session: &mut GpuSession) {
        GpuModel::reset_profile(self, session)
    }
}
