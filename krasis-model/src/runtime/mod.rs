//! The Engine API: one object-safe [`Engine`] that the CLI, the benchmarks and the server drive,
//! whatever runs underneath (the CPU engine, the whole model on the GPU, later the hybrid).
//!
//! - [`open_engine`] takes the opened [`ModelFiles`](crate::source::files::ModelFiles) and an
//!   [`EngineConfig`] (device policy, precisions, budgets) and returns the engine with a log and
//!   one line saying which device path was chosen and why.
//! - An engine makes [`EngineSession`]s (a conversation's KV cache and position) and advances
//!   several of them in one batch-shaped [`Engine::step`], each with its own tokens and sampler.
//! - [`crate::text::generate::generate_with`] runs prefill + decode over one session with a
//!   [`CancelToken`] and a token callback that may stop generation without an error.
//! - [`context_limit`] and [`check_context`]: how many tokens one request may hold, and the
//!   check every front end makes before running one.

mod adapter;
mod cancel;
mod config;
mod context;
pub mod expert_caches;
pub mod metrics;
mod open;
pub mod prefix_cache;
pub mod scheduler;
mod sessions;
mod stall;
mod stats;
pub mod step_cost;
pub mod stop;

use std::any::Any;

pub use self::adapter::{DecoderEngine, EngineDecoder};
pub use self::cancel::CancelToken;
pub use self::config::{DevicePath, DevicePolicy, EngineConfig, DEFAULT_CONTEXT_TOKENS};
pub use self::context::{check_context, context_limit, spec_context_limit, ContextExceeded};
pub use self::open::{
    cpu_memory_estimate, default_heatmap_path, device_choice, open_cpu, open_engine, open_gpu, Opened,
};
pub use self::stats::{EngineStats, ExpertPoolSize, ForwardBreakdown, HandoffStats, PinnedExperts, StreamSlots};

use crate::error::{ModelError, Result};
use crate::spec::ModelSpec;
use crate::text::sampling::Sampler;

/// One conversation's state inside an engine: its KV cache and how many positions it holds.
/// A session belongs to the engine that made it; engines downcast it (through [`Any`]) in
/// [`Engine::step`].
pub trait EngineSession: Any + Send {
    /// Tokens processed so far (the next token's position).
    fn position(&self) -> usize;
    /// Most tokens the session's KV cache can hold (`None`: it grows as needed).
    fn kv_capacity(&self) -> Option<usize>;
    /// Bytes the session's KV cache holds now.
    fn kv_bytes(&self) -> usize;
}

/// Recurrent-state snapshots one session keeps (each a few MiB per DeltaNet layer): the latest
/// block boundaries before a prompt's end, where the next turn of a conversation most likely
/// departs from this one's tokens.
pub const DELTA_SNAPSHOTS: usize = 3;

/// [`SavedPrefix::resumable`] for a saved prefix of `len` tokens whose recurrent states were
/// kept at `points` (ascending positions; none for an attention-only model, whose KV cache cuts
/// anywhere): `upto` itself, or the latest snapshot at or below it (0: none).
pub(crate) fn resumable_at<T>(len: usize, points: &[(usize, T)], upto: usize) -> usize {
    if points.is_empty() {
        return upto.min(len);
    }
    points.iter().map(|(p, _)| *p).filter(|&p| p <= upto).max().unwrap_or(0)
}

/// Keeps a snapshot `take()` of a session's recurrent state at `pos` in `snapshots` (once per
/// position; the oldest goes past [`DELTA_SNAPSHOTS`]).
pub(crate) fn keep_snapshot<T>(
    snapshots: &mut Vec<(usize, T)>,
    pos: usize,
    take: impl FnOnce() -> Result<T>,
) -> Result<()> {
    if snapshots.last().is_some_and(|(p, _)| *p == pos) {
        return Ok(());
    }
    let state = take()?;
    if snapshots.len() == DELTA_SNAPSHOTS {
        snapshots.remove(0);
    }
    snapshots.push((pos, state));
    Ok(())
}

/// The state of a session's first [`SavedPrefix::len`] tokens, kept by the prefix cache
/// ([`scheduler`]) for later requests that start with the same tokens. Made by
/// [`Engine::save_prefix`], read (never changed) by [`Engine::resume_prefix`]: any number of
/// requests resume from one saved prefix.
pub trait SavedPrefix: Any + Send {
    /// Tokens whose state it holds.
    fn len(&self) -> usize;
    /// Whether it holds no tokens.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Memory it holds (host or device, whichever the engine keeps it in).
    fn bytes(&self) -> usize;
    /// The longest prefix of at most `upto` tokens a session can resume from: `upto` itself
    /// for attention-only models (a KV cache cuts anywhere), else the latest recurrent-state
    /// snapshot at or below it (0: none).
    fn resumable(&self, upto: usize) -> usize;
}

/// One sequence of a batch [`Engine::step`]: run `tokens` after what `session` holds and sample
/// the next token from the last position with `sampler`.
pub struct SequenceStep<'a> {
    pub session: &'a mut dyn EngineSession,
    /// The prompt (prefill) or the last sampled token (decode); never empty.
    pub tokens: &'a [u32],
    /// The sequence's own sampler (its parameters and random state carry across steps).
    pub sampler: &'a mut Sampler,
    /// Also return the logits of every position of `tokens` (`[tokens, vocab]`).
    pub want_logits: bool,
}

/// What [`Engine::step`] gives back for one sequence.
#[derive(Clone, Debug, PartialEq)]
pub struct StepOutput {
    /// The sampled next token.
    pub token: u32,
    /// `[tokens, vocab]` when the step asked for logits.
    pub logits: Option<Vec<f32>>,
}

/// A loaded model that runs sessions. Object-safe: the CLI, the benchmarks and the server hold a
/// `Box<dyn Engine>` and never know which device path is underneath.
pub trait Engine: Send + Sync {
    /// The architecture.
    fn spec(&self) -> &ModelSpec;
    /// Which device path this engine is.
    fn device(&self) -> DevicePath;
    /// One line: what runs where (e.g. the routed experts' executor, the GPU).
    fn describe(&self) -> String;
    /// Checks token ids against the vocabulary (the error names the id and its position).
    fn check_tokens(&self, tokens: &[u32]) -> Result<()>;
    /// A fresh session with an empty KV cache.
    fn new_session(&self) -> Result<Box<dyn EngineSession>>;
    /// Advances every sequence of `batch` by its tokens and samples its next token; one output
    /// per sequence, in order. Every sequence is checked (tokens, session) before any runs, so
    /// bad input fails the call without advancing any sequence.
    fn step(&self, batch: &mut [SequenceStep<'_>]) -> Result<Vec<StepOutput>>;

    /// [`Engine::step`] for one sequence.
    fn step_one(
        &self,
        session: &mut dyn EngineSession,
        tokens: &[u32],
        sampler: &mut Sampler,
        want_logits: bool,
    ) -> Result<StepOutput> {
        let mut batch = [SequenceStep { session, tokens, sampler, want_logits }];
        self.step(&mut batch)?
            .pop()
            .ok_or_else(|| ModelError::Invalid("the engine returned no output for a one-sequence step".into()))
    }

    /// Most tokens each session holds, where fixed at load: the GPU paths' KV cache, or the
    /// CPU engine's limit when opened with one ([`crate::gpu::GpuOptions::kv_tokens`]). A step
    /// past it fails. `None`: the session's cache grows as needed.
    fn kv_capacity(&self) -> Option<usize> {
        None
    }
    /// The fewest prompt tokens a step runs at the engine's full prefill rate: below it a call
    /// takes a slower path (the hybrid runs a short call's experts partly on the CPU). A
    /// scheduler that sizes its prompt chunks from measured step costs keeps them at least this
    /// long, so that it measures the path long prompts take. 1: no such threshold.
    fn prompt_chunk_floor(&self) -> usize {
        1
    }
    /// The fewest tokens a prompt step must run for its rows to be computed as a prompt's: a
    /// one-token step of a GPU engine with the row-invariant prefill
    /// ([`crate::gpu::GpuOptions::invariant_prefill`]) runs the decode form, whose rows are other
    /// bits. A scheduler resumes a saved prefix leaving at least this many prompt tokens to run,
    /// and never ends a prompt with a shorter chunk. 1: any step will do.
    fn prefill_min_tokens(&self) -> usize {
        1
    }
    /// What the engine reports about itself ([`EngineStats`]): its counters and sizes and, with
    /// `session` (one of this engine's), that session's own counters. Cheap: no device
    /// synchronisation. A field is `None` where this path has no such notion.
    fn stats(&self, session: Option<&dyn EngineSession>) -> EngineStats;
    /// Starts over the figures that run since a reset: the engine's forward-time split
    /// ([`EngineStats::forward`]) and, with `session`, that session's device-time profile
    /// ([`EngineStats::profile`]). The cumulative counters (host synchronisations, hand-offs)
    /// run on: take the difference of two readings.
    fn reset_stats(&self, session: Option<&mut dyn EngineSession>);
    /// How many (token, slot) routes each routed expert got so far, `[layers × experts]`
    /// (`crate::placement::heatmap`), when the engine was opened with [`EngineConfig::record_heatmap`];
    /// `None` otherwise. GPU engines read the counts back from the device (a synchronisation).
    fn expert_counts(&self) -> Result<Option<Vec<u64>>> {
        Ok(None)
    }
    /// What the engine is doing right now, in words, for the scheduler's report of a step that
    /// runs far past its usual time (which call, which phase, what its streams and threads wait
    /// for). Called from another thread while a step may be running: it must not wait for the
    /// step. `None`: the engine has nothing to say.
    fn diagnose(&self) -> Option<String> {
        None
    }
    /// Keeps `session`'s recurrent (gated-DeltaNet) state at its current position, so that the
    /// prefix cache can later resume there ([`SavedPrefix::resumable`]). A session keeps the
    /// latest [`DELTA_SNAPSHOTS`]. Nothing to do for a model without recurrent layers, whose KV
    /// cache can be cut anywhere.
    fn snapshot(&self, _session: &mut dyn EngineSession) -> Result<()> {
        Ok(())
    }
    /// Takes a finished `session`'s state for the prefix cache (moved where the engine can, copied
    /// into compact storage where the session's own buffers are sized for a whole context).
    /// `None`: this engine keeps no prefixes.
    fn save_prefix(&self, _session: Box<dyn EngineSession>) -> Result<Option<Box<dyn SavedPrefix>>> {
        Ok(None)
    }
    /// A new session holding the first `len` tokens of `saved` (`len` must be
    /// [`SavedPrefix::resumable`]); its next step runs the tokens after them.
    fn resume_prefix(&self, _saved: &dyn SavedPrefix, _len: usize) -> Result<Box<dyn EngineSession>> {
        Err(ModelError::Invalid("this engine keeps no prompt prefixes".into()))
    }
}

#[cfg(test)]
mod tests;
