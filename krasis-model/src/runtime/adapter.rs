//! [`DecoderEngine`]: any [`Decoder`] (the CPU `Model`, the `GpuModel`) behind the object-safe
//! [`Engine`], its sessions boxed as [`EngineSession`]s and downcast back on each step.

use std::any::Any;

use super::{DevicePath, Engine, EngineSession, EngineStats, SavedPrefix, SequenceStep, StepOutput};
use crate::error::{ModelError, Result};
use crate::spec::ModelSpec;
use crate::text::generate::{Decoder, DecoderStep};

/// What a [`Decoder`] tells the Engine API beyond running tokens. Everything but the device and
/// the description is optional.
pub trait EngineDecoder: Decoder + Send + Sync + 'static {
    /// Which device path this decoder is.
    fn device(&self) -> DevicePath;
    /// One line: what runs where.
    fn describe(&self) -> String;
    /// Tokens of KV cache each session holds, where fixed at load.
    fn kv_capacity(&self) -> Option<usize> {
        None
    }
    /// [`Engine::prompt_chunk_floor`].
    fn prompt_chunk_floor(&self) -> usize {
        1
    }
    /// [`Engine::prefill_min_tokens`].
    fn prefill_min_tokens(&self) -> usize {
        1
    }
    /// [`Engine::stats`], with `session` already one of this decoder's. The adapter fills
    /// [`EngineStats::expert_bytes`] where the decoder leaves it `None` and it was given one.
    fn stats(&self, _session: Option<&Self::Session>) -> EngineStats {
        EngineStats::default()
    }
    /// [`Engine::reset_stats`], with `session` already one of this decoder's.
    fn reset_stats(&self, _session: Option<&mut Self::Session>) {}
    /// [`Engine::diagnose`].
    fn diagnose(&self) -> Option<String> {
        None
    }
    /// [`Engine::expert_counts`].
    fn expert_counts(&self) -> Result<Option<Vec<u64>>> {
        Ok(None)
    }
    /// [`Engine::snapshot`] with the session already one of this decoder's.
    fn snapshot(&self, _session: &mut Self::Session) -> Result<()> {
        Ok(())
    }
    /// [`Engine::save_prefix`] with the session already one of this decoder's.
    fn save_prefix(&self, _session: Self::Session) -> Result<Option<Box<dyn SavedPrefix>>> {
        Ok(None)
    }
    /// [`Engine::resume_prefix`]; `None` when `saved` is not of this decoder's kind.
    fn resume_prefix(&self, _saved: &dyn SavedPrefix, _len: usize) -> Result<Option<Self::Session>> {
        Ok(None)
    }
}

/// A [`Decoder`] as an [`Engine`].
pub struct DecoderEngine<D> {
    decoder: D,
    /// Bytes of one routed expert as executed (for bytes-per-token arithmetic).
    expert_bytes: Option<u64>,
    /// Most tokens one session may hold, for decoders whose sessions grow (the CPU engine):
    /// reported as [`Engine::kv_capacity`] and checked on every step.
    kv_limit: Option<usize>,
}

impl<D> DecoderEngine<D> {
    pub fn new(decoder: D) -> Self {
        DecoderEngine { decoder, expert_bytes: None, kv_limit: None }
    }

    /// Records the bytes of one routed expert as executed ([`EngineStats::expert_bytes`]).
    pub fn with_expert_bytes(mut self, bytes: u64) -> Self {
        self.expert_bytes = Some(bytes);
        self
    }

    /// Limits every session to `tokens` (prompt plus generated), for a decoder whose sessions
    /// grow as needed: [`Engine::kv_capacity`] reports it and a step past it fails. A decoder
    /// with a capacity of its own keeps that one.
    pub fn with_kv_limit(mut self, tokens: Option<usize>) -> Self {
        self.kv_limit = tokens;
        self
    }

    /// The wrapped decoder.
    pub fn decoder(&self) -> &D {
        &self.decoder
    }

    pub fn into_inner(self) -> D {
        self.decoder
    }
}

fn foreign_session() -> ModelError {
    ModelError::Invalid("a session from another kind of engine was passed to this engine's step".into())
}

impl<D> Engine for DecoderEngine<D>
where
    D: EngineDecoder,
    D::Session: EngineSession,
{
    fn spec(&self) -> &ModelSpec {
        self.decoder.spec()
    }

    fn device(&self) -> DevicePath {
        self.decoder.device()
    }

    fn describe(&self) -> String {
        self.decoder.describe()
    }

    fn check_tokens(&self, tokens: &[u32]) -> Result<()> {
        self.decoder.check_tokens(tokens)
    }

    fn new_session(&self) -> Result<Box<dyn EngineSession>> {
        Ok(Box::new(self.decoder.new_session()?))
    }

    fn step(&self, batch: &mut [SequenceStep<'_>]) -> Result<Vec<StepOutput>> {
        for (i, seq) in batch.iter_mut().enumerate() {
            if seq.tokens.is_empty() {
                return Err(ModelError::Invalid(format!("sequence {i} of the batch has no tokens to run")));
            }
            self.decoder.check_tokens(seq.tokens)?;
            if let Some(limit) = self.kv_limit.filter(|_| self.decoder.kv_capacity().is_none()) {
                let pos = seq.session.position();
                if pos + seq.tokens.len() > limit {
                    return Err(ModelError::Invalid(format!(
                        "context full: sequence {i} holds {pos} tokens and {} more exceed the session's limit of {limit} tokens",
                        seq.tokens.len()
                    )));
                }
            }
            let any: &mut dyn Any = &mut *seq.session;
            if !any.is::<D::Session>() {
                return Err(foreign_session());
            }
        }
        // Every session is of this engine's kind (checked above); the decoder batches what it can.
        let mut steps = Vec::with_capacity(batch.len());
        for seq in batch.iter_mut() {
            let any: &mut dyn Any = &mut *seq.session;
            let session = any.downcast_mut::<D::Session>().ok_or_else(foreign_session)?;
            steps.push(DecoderStep {
                session,
                tokens: seq.tokens,
                sampler: &mut *seq.sampler,
                record: seq.want_logits,
            });
        }
        let out = self.decoder.step_batch(&mut steps)?;
        Ok(out.into_iter().map(|(token, logits)| StepOutput { token, logits }).collect())
    }

    fn kv_capacity(&self) -> Option<usize> {
        self.decoder.kv_capacity().or(self.kv_limit)
    }

    fn prompt_chunk_floor(&self) -> usize {
        self.decoder.prompt_chunk_floor()
    }

    fn prefill_min_tokens(&self) -> usize {
        self.decoder.prefill_min_tokens()
    }

    fn expert_counts(&self) -> Result<Option<Vec<u64>>> {
        self.decoder.expert_counts()
    }

    fn diagnose(&self) -> Option<String> {
        self.decoder.diagnose()
    }

    fn snapshot(&self, session: &mut dyn EngineSession) -> Result<()> {
        let any: &mut dyn Any = session;
        self.decoder.snapshot(any.downcast_mut::<D::Session>().ok_or_else(foreign_session)?)
    }

    fn save_prefix(&self, session: Box<dyn EngineSession>) -> Result<Option<Box<dyn SavedPrefix>>> {
        let any: Box<dyn Any> = session;
        match any.downcast::<D::Session>() {
            Ok(own) => self.decoder.save_prefix(*own),
            Err(_) => Err(foreign_session()),
        }
    }

    fn resume_prefix(&self, saved: &dyn SavedPrefix, len: usize) -> Result<Box<dyn EngineSession>> {
        if len > saved.resumable(len) || len > saved.len() {
            return Err(ModelError::Invalid(format!(
                "a saved prefix of {} tokens cannot resume at {len} tokens (latest point: {})",
                saved.len(),
                saved.resumable(len)
            )));
        }
        match self.decoder.resume_prefix(saved, len)? {
            Some(s) => Ok(Box::new(s)),
            None => {
                Err(ModelError::Invalid("a saved prefix of another kind of engine was passed to this engine".into()))
            }
        }
    }

    /// A session of another kind of engine counts as none: the per-session fields stay `None`.
    fn stats(&self, session: Option<&dyn EngineSession>) -> EngineStats {
        let own = session.and_then(|s| {
            let any: &dyn Any = s;
            any.downcast_ref::<D::Session>()
        });
        let mut stats = self.decoder.stats(own);
        stats.expert_bytes = stats.expert_bytes.or(self.expert_bytes);
        stats
    }

    /// A session of another kind of engine counts as none.
    fn reset_stats(&self, session: Option<&mut dyn EngineSession>) {
        let own = session.and_then(|s| {
            let any: &mut dyn Any = s;
            any.downcast_mut::<D::Session>()
        });
        self.decoder.reset_stats(own);
    }
}
