//! The CPU and GPU engines' decoders and sessions as seen by the Engine API.

use super::{DevicePath, EngineDecoder, EngineSession};
use crate::engine::{ForwardStats, Model, Session};
use crate::gpu::{GpuModel, GpuSession};

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
        self.expert_executor().describe()
    }

    fn forward_stats(&self) -> Option<&ForwardStats> {
        Some(self.stats())
    }

    fn dense_bytes_per_token(&self) -> Option<u64> {
        Some(Model::dense_bytes_per_token(self))
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
}

impl EngineDecoder for GpuModel {
    fn device(&self) -> DevicePath {
        DevicePath::Gpu
    }

    fn describe(&self) -> String {
        format!(
            "gpu {}: the whole model, {} tokens of KV cache per session",
            GpuModel::device(self).info(),
            GpuModel::kv_capacity(self)
        )
    }

    fn kv_capacity(&self) -> Option<usize> {
        Some(GpuModel::kv_capacity(self))
    }

    fn profile_summary(&self, session: &GpuSession) -> Option<String> {
        GpuModel::profile_summary(self, session)
    }

    fn reset_profile(&self, session: &mut GpuSession) {
        GpuModel::reset_profile(self, session)
    }
}
