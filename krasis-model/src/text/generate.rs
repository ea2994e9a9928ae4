//! The generation loop: one prefill pass over the prompt, then token-by-token decode reusing the
//! KV cache, sampling each step and streaming ids to a callback. It drives any [`Engine`]; the
//! [`Decoder`] trait is what the concrete engines implement underneath the Engine API.

use std::ops::ControlFlow;
use std::time::{Duration, Instant};

use crate::cpu::{BatchSeq, Logits, Model};
use crate::error::{ModelError, Result};
use crate::runtime::{check_context, context_limit, CancelToken, Engine};
use crate::text::sampling::{Sampler, SamplingParams};

#[derive(Clone, Debug)]
pub struct GenerateRequest {
    pub prompt_ids: Vec<u32>,
    pub max_new_tokens: usize,
    pub sampling: SamplingParams,
    pub ignore_eos: bool,
    /// Keep logits for `--dump-logits`: every prompt position and every step.
    pub record_logits: bool,
}

#[derive(Clone, Debug, Default)]
pub struct GenerateOutput {
    pub generated: Vec<u32>,
    /// `[prompt_len, vocab]` when recorded.
    pub prefill_logits: Vec<f32>,
    /// `[generated, vocab]` when recorded: the logits each generated token was chosen from.
    pub step_logits: Vec<f32>,
    pub prefill_time: Duration,
    pub decode_time: Duration,
    pub stopped_at_eos: bool,
    /// Host synchronisations per decode step (GPU engines, when logits were not recorded).
    pub host_syncs_per_token: Option<f64>,
    /// Why generation ended.
    pub stop: StopReason,
}

/// Why a generation ended (none of these is an error).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum StopReason {
    /// `max_new_tokens` reached.
    #[default]
    MaxTokens,
    /// The model produced an end-of-sequence token.
    Eos,
    /// The token callback returned [`ControlFlow::Break`].
    StopRequested,
    /// The [`CancelToken`] was cancelled.
    Cancelled,
}

impl StopReason {
    /// How an OpenAI-style response names it (`finish_reason`): `length` or `stop`, `None`
    /// for a cancelled generation.
    pub fn finish_reason(self) -> Option<&'static str> {
        match self {
            StopReason::MaxTokens => Some("length"),
            StopReason::Eos | StopReason::StopRequested => Some("stop"),
            StopReason::Cancelled => None,
        }
    }
}

impl GenerateOutput {
    pub fn prefill_tok_s(&self, prompt_len: usize) -> f64 {
        prompt_len as f64 / self.prefill_time.as_secs_f64().max(1e-9)
    }

    /// Decode rate over the steps after the first token (which comes from the prefill).
    pub fn decode_tok_s(&self) -> f64 {
        let steps = self.generated.len().saturating_sub(1);
        if steps == 0 {
            return 0.0;
        }
        steps as f64 / self.decode_time.as_secs_f64().max(1e-9)
    }
}

/// What the generation loop needs from an engine (the CPU [`Model`] or the GPU model): run
/// tokens after a session's cache and choose the next token.
pub trait Decoder {
    type Session;
    fn spec(&self) -> &crate::ModelSpec;
    fn check_tokens(&self, tokens: &[u32]) -> Result<()>;
    fn new_session(&self) -> Result<Self::Session>;
    /// Runs `tokens` after what `session` holds and picks the next token from the last position
    /// with `sampler`. With `record`, also returns the logits of every position of this call
    /// (`[tokens, vocab]`).
    fn step(
        &self,
        session: &mut Self::Session,
        tokens: &[u32],
        sampler: &mut Sampler,
        record: bool,
    ) -> Result<(u32, Option<Vec<f32>>)>;
    /// [`Decoder::step`] for several sequences, one output per sequence in order. The default
    /// runs them one after another; an engine that can batch (the CPU [`Model`]: one pass over
    /// every sequence's rows) overrides it.
    fn step_batch(&self, seqs: &mut [DecoderStep<'_, Self::Session>]) -> Result<Vec<(u32, Option<Vec<f32>>)>> {
        seqs.iter_mut().map(|s| self.step(s.session, s.tokens, s.sampler, s.record)).collect()
    }
}

/// One sequence of [`Decoder::step_batch`].
pub struct DecoderStep<'a, S> {
    pub session: &'a mut S,
    pub tokens: &'a [u32],
    pub sampler: &'a mut Sampler,
    /// Also return the logits of every position of `tokens`.
    pub record: bool,
}

impl Decoder for Model {
    type Session = crate::cpu::Session;

    fn spec(&self) -> &crate::ModelSpec {
        &self.spec
    }

    fn check_tokens(&self, tokens: &[u32]) -> Result<()> {
        Model::check_tokens(self, tokens)
    }

    fn new_session(&self) -> Result<Self::Session> {
        Ok(Model::new_session(self))
    }

    fn step(
        &self,
        session: &mut Self::Session,
        tokens: &[u32],
        sampler: &mut Sampler,
        record: bool,
    ) -> Result<(u32, Option<Vec<f32>>)> {
        let mut one = [DecoderStep { session, tokens, sampler, record }];
        let mut out = self.step_batch(&mut one)?;
        Ok(out.pop().expect("one sequence in, one out"))
    }

    fn step_batch(&self, seqs: &mut [DecoderStep<'_, Self::Session>]) -> Result<Vec<(u32, Option<Vec<f32>>)>> {
        let mut batch: Vec<BatchSeq<'_>> = seqs
            .iter_mut()
            .map(|s| BatchSeq {
                session: &mut *s.session,
                tokens: s.tokens,
                which: if s.record { Logits::All } else { Logits::Last },
            })
            .collect();
        let logits = self.forward_batch(&mut batch)?;
        let v = self.spec.vocab_size;
        Ok(seqs
            .iter_mut()
            .zip(logits)
            .map(|(s, l)| {
                let id = s.sampler.sample(&l[l.len() - v..]);
                (id, s.record.then_some(l))
            })
            .collect())
    }
}

/// Runs `req` on `engine` (prefill once, then decode), passing each generated id to `on_token`.
/// Stops at end-of-sequence (unless `ignore_eos`) or after `max_new_tokens`; an error from
/// `on_token` ends generation with that error.
pub fn generate(
    engine: &dyn Engine,
    req: &GenerateRequest,
    mut on_token: impl FnMut(u32) -> Result<()>,
) -> Result<GenerateOutput> {
    generate_with(engine, req, &CancelToken::new(), |id| on_token(id).map(|()| ControlFlow::Continue(())))
}

/// [`generate`] with a way to stop early without an error: `on_token` returning
/// [`ControlFlow::Break`] stops after that token ([`StopReason::StopRequested`]), and `cancel`
/// is checked before every forward step ([`StopReason::Cancelled`]). The output's `stop` says
/// why generation ended. A request whose prompt plus `max_new_tokens` exceeds the engine's
/// context ([`context_limit`]) is refused before anything runs.
pub fn generate_with(
    engine: &dyn Engine,
    req: &GenerateRequest,
    cancel: &CancelToken,
    mut on_token: impl FnMut(u32) -> Result<ControlFlow<()>>,
) -> Result<GenerateOutput> {
    if req.prompt_ids.is_empty() {
        return Err(ModelError::Invalid("the prompt is empty: nothing to run".into()));
    }
    engine.check_tokens(&req.prompt_ids)?;
    check_context(context_limit(engine), req.prompt_ids.len(), Some(req.max_new_tokens))
        .map_err(|e| ModelError::Invalid(e.to_string()))?;
    let v = engine.spec().vocab_size;
    let mut out = GenerateOutput::default();
    if cancel.is_cancelled() {
        out.stop = StopReason::Cancelled;
        return Ok(out);
    }
    let mut session = engine.new_session()?;
    let mut sampler = Sampler::new(req.sampling);

    let t0 = Instant::now();
    let first = engine.step_one(session.as_mut(), &req.prompt_ids, &mut sampler, req.record_logits)?;
    out.prefill_time = t0.elapsed();
    if let Some(l) = first.logits {
        out.step_logits.extend_from_slice(&l[l.len() - v..]);
        out.prefill_logits = l;
    }
    if req.max_new_tokens == 0 {
        out.step_logits.clear();
        return Ok(out);
    }
    let t1 = Instant::now();
    let syncs0 = engine.stats(None).host_syncs;
    let mut id = first.token;
    loop {
        out.generated.push(id);
        if on_token(id)?.is_break() {
            out.stop = StopReason::StopRequested;
            break;
        }
        if !req.ignore_eos && engine.spec().eos_token_ids.contains(&id) {
            out.stopped_at_eos = true;
            out.stop = StopReason::Eos;
            break;
        }
        if out.generated.len() >= req.max_new_tokens {
            break;
        }
        if cancel.is_cancelled() {
            out.stop = StopReason::Cancelled;
            break;
        }
        let next = engine.step_one(session.as_mut(), &[id], &mut sampler, req.record_logits)?;
        if let Some(l) = next.logits {
            out.step_logits.extend_from_slice(&l);
        }
        id = next.token;
    }
    out.decode_time = t1.elapsed();
    let steps = out.generated.len().saturating_sub(1);
    if let (Some(a), Some(b)) = (syncs0, engine.stats(None).host_syncs) {
        if steps > 0 && !req.record_logits {
            out.host_syncs_per_token = Some((b - a) as f64 / steps as f64);
        }
    }
    Ok(out)
}
