//! The CPU and GPU engines' decoders and sessions as seen by the Engine API.

use std::any::Any;

use super::{DevicePath, EngineDecoder, EngineSession, EngineStats, SavedPrefix};
use crate::cpu::{CpuPrefix, Model, Session};
use crate::error::Result;
use crate::gpu::prefix::GpuPrefix;
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
        self.experts_description()
    }

    /// The forward-time split and the dense bytes per token (nothing per session).
    fn stats(&self, _session: Option<&Session>) -> EngineStats {
        EngineStats {
            forward: Some(Model::forward_stats(self).breakdown()),
            dense_bytes_per_token: Some(Model::dense_bytes_per_token(self)),
            ..EngineStats::default()
        }
    }

    fn reset_stats(&self, _session: Option<&mut Session>) {
        Model::forward_stats(self).reset();
    }

    fn expert_counts(&self) -> Result<Option<Vec<u64>>> {
        Ok(self.heatmap())
    }

    fn snapshot(&self, session: &mut Session) -> Result<()> {
        session.snapshot();
        Ok(())
    }

    fn save_prefix(&self, session: Session) -> Result<Option<Box<dyn SavedPrefix>>> {
        Ok(Some(Box::new(session.into_prefix())))
    }

    fn resume_prefix(&self, saved: &dyn SavedPrefix, len: usize) -> Result<Option<Session>> {
        let any: &dyn Any = saved;
        any.downcast_ref::<CpuPrefix>().map(|p| Session::from_prefix(p, len)).transpose()
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
    fn expert_counts(&self) -> Result<Option<Vec<u64>>> {
        GpuModel::expert_counts(self)
    }

    fn snapshot(&self, session: &mut GpuSession) -> Result<()> {
        GpuModel::snapshot(self, session)
    }

    fn save_prefix(&self, session: GpuSession) -> Result<Option<Box<dyn SavedPrefix>>> {
        Ok(Some(Box::new(GpuModel::save_prefix(self, session)?)))
    }

    fn resume_prefix(&self, saved: &dyn SavedPrefix, len: usize) -> Result<Option<GpuSession>> {
        let any: &dyn Any = saved;
        any.downcast_ref::<GpuPrefix>().map(|p| GpuModel::resume_prefix(self, p, len)).transpose()
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

    fn prefill_min_tokens(&self) -> usize {
        GpuModel::prefill_min_tokens(self)
    }

    fn prompt_chunk_floor(&self) -> usize {
        GpuModel::prompt_chunk_floor(self)
    }

    fn stats(&self, session: Option<&GpuSession>) -> EngineStats {
        GpuModel::stats(self, session)
    }

    fn reset_stats(&self, session: Option<&mut GpuSession>) {
        GpuModel::reset_stats(self, session)
    }

    fn diagnose(&self) -> Option<String> {
        Some(GpuModel::diagnose(self))
    }
}
