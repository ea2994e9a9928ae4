//! The batching scheduler (what `krasis serve` and `krasis bench --streams` run, and any embedding
//! front end can): one thread that owns the engine's sessions and advances every admitted request
//! together, one batched [`Engine::step`] per token. Requests wait in a FIFO queue until a batch
//! slot frees and are admitted at the start of any step.
//!
//! **Continuous batching with chunked prefill.** A prompt runs in chunks inside the same steps
//! that decode the running streams: each step gives the prompts still prefilling at most
//! [`PrefillChunk`] tokens in all (first come, first served), so no stream waits for another's
//! whole prompt, only for one chunk. A sequence samples its first token in the step that runs
//! its prompt's last chunk. The chunk is measured by default, from the prompt steps' cost as the
//! server has seen it, a fixed part per step plus a part per token ([`StepCost`]): with no stream
//! decoding a step aims at [`IDLE_STEP_SECONDS`]; while streams decode, at [`DECODE_STEP_MULTIPLE`]
//! times their recent decode step (their inter-token latency stays within that factor of its
//! usual while prompts arrive), but with at least as much time for prompt tokens as the step's
//! fixed part, so that a chunk never costs mostly overhead (a streaming hybrid prefill's expert
//! copy), and never shorter than the engine's full-rate length ([`Engine::prompt_chunk_floor`]).
//!
//! **Prefix reuse.** A finished request's state is kept in the [`PrefixCache`] (up to
//! [`Config::prefix_cache_bytes`]); a new request whose prompt starts with a kept sequence resumes
//! a copy of its state and prefills only the rest. Models with recurrent (gated-DeltaNet) layers
//! resume at the snapshots taken at the prompt's end and the [`SNAPSHOT_BLOCK`] boundaries just
//! before it ([`Engine::snapshot`]).
//!
//! Each request gets its text back through its own channel; a closed channel (the client went
//! away) cancels the request before the next step and frees its slot. At shutdown every request
//! still running or waiting ends with `finish_reason` [`SHUTDOWN`].

use std::collections::VecDeque;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Instant;

use super::prefix_cache::PrefixCache;
use super::stall::Phase;
use super::{Engine, EngineSession, SequenceStep, DELTA_SNAPSHOTS};
use crate::text::sampling::{Sampler, SamplingParams};
use crate::text::tokenizer::{TextCodec, TextStream};
use tokio::sync::mpsc::UnboundedSender;

use super::metrics::Metrics;
use super::step_cost::StepCost;
use super::stop::StopMatcher;

/// The wall time a step with prompt chunks aims at while streams decode, before their decode step
/// is measured: long enough that a chunk uses the hardware well (a prefill of a few hundred
/// tokens runs at full rate), short enough that their inter-token latency stays below what a
/// reader notices.
pub const TARGET_STEP_SECONDS: f64 = 0.25;

/// With no stream decoding, a step with prompt chunks aims at this: it delays only requests that
/// arrive meanwhile, and a streaming hybrid prefill pays its copy of every expert once per call
/// (measured on the H200, V2-Lite hybrid: an 8K-token prompt alone took 9.4 s in quarter-second
/// chunks, 1.4 s in one 2 s step).
pub const IDLE_STEP_SECONDS: f64 = 2.0;

/// While streams decode, a step with prompt chunks aims at this many times their recent
/// decode-only step: a token gap during a long prompt is at most a few of the usual ones, and the
/// prompt still gets most of each such step. When the prompt's fixed cost per step is larger than
/// that leaves room for, the step gives the prompt twice that fixed cost instead (half of it
/// useful): smaller chunks would pay the fixed cost for little (session 32: 8K-token prompts beside
/// 28 decoding streams at the 64-token floor waited 19–76 s for their first token).
pub const DECODE_STEP_MULTIPLE: f64 = 2.5;

/// Weight of the newest decode-only step in the recent decode step time (an exponential
/// average: follows batch-size changes within a few dozen steps).
const DECODE_STEP_EMA: f64 = 0.1;

/// Prompt tokens per step before any prefill has been measured.
const FIRST_CHUNK_TOKENS: usize = 512;

/// Bounds of a measured chunk: below 64 tokens a prefill step is mostly fixed cost; above 8192
/// one chunk's activations grow large on every path.
const CHUNK_BOUNDS: (usize, usize) = (64, 8192);

/// Recurrent models' snapshot spacing: a prompt's prefill stops at the last multiples of this
/// below its end to keep the state there ([`Engine::snapshot`]), so that a later prompt
/// that departs from this one less than a block before its end still resumes most of it.
pub const SNAPSHOT_BLOCK: usize = 256;

/// How many prompt tokens one step runs in all.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefillChunk {
    /// Sized from the prompt steps' measured cost (see the module's documentation; 512 tokens
    /// until a prompt step has run).
    Measured,
    /// This many tokens (at least 1).
    Fixed(usize),
}

/// One request for the scheduler.
pub struct Job {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    /// Where the text goes; dropping the receiver cancels the job.
    pub events: UnboundedSender<Event>,
    /// Names the request in the log lines (`None`: no per-request log lines, as in benchmarks).
    pub label: Option<String>,
    /// Decode special tokens into the text too (a tool-call parser reads markers that are
    /// special tokens); the end-of-sequence token that ends the reply is never text.
    pub keep_special: bool,
}

/// The `finish_reason` of a request that the server's shutdown ended: not one of OpenAI's
/// values (`stop`, `length`, …), so that a client can tell a cut reply from a whole one.
pub const SHUTDOWN: &str = "shutdown";

/// What a job's receiver gets: text deltas, then exactly one `Done` or `Failed`.
#[derive(Debug)]
pub enum Event {
    Text(String),
    Done(Finish),
    Failed(String),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Finish {
    /// The `finish_reason`: OpenAI's `stop` (end-of-sequence or a stop string) or `length`, or
    /// [`SHUTDOWN`] (the server stopped first; `completion_tokens` 0: it never started).
    pub reason: &'static str,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// The stop string that ended the job (`reason` `stop`): its index in [`Job::stop`].
    pub stop_sequence: Option<usize>,
}

enum Msg {
    Job(Box<Job>),
    Shutdown,
}

/// The handle the routes hold.
#[derive(Clone)]
pub struct Scheduler {
    tx: mpsc::Sender<Msg>,
    metrics: Arc<Metrics>,
    max_batch: usize,
    max_queue: usize,
}

/// Why a job was not taken.
pub enum Refused {
    /// Every slot and queue place is taken.
    Busy(usize),
    /// The scheduler has stopped (shutdown).
    Stopped,
}

pub struct Config {
    /// Sequences advanced together (batch slots).
    pub max_batch: usize,
    /// Requests that may wait while every slot is busy; more get 429.
    pub max_queue: usize,
    /// Run the admitted sequences one `Engine::step` each instead of one step for all (what
    /// `step` did before it batched; `krasis bench --streams` measures both).
    pub serial: bool,
    /// Prompt tokens per step (continuous batching; module docs).
    pub prefill_chunk: PrefillChunk,
    /// Bytes of finished requests' state kept for prefix reuse (module docs); 0 keeps none.
    pub prefix_cache_bytes: usize,
}

impl Scheduler {
    /// Starts the scheduler thread over `engine`.
    pub fn start(
        engine: Arc<dyn Engine>,
        codec: Arc<TextCodec>,
        config: Config,
        metrics: Arc<Metrics>,
    ) -> std::io::Result<(Scheduler, std::thread::JoinHandle<()>)> {
        let (tx, rx) = mpsc::channel();
        let (max_batch, max_queue) = (config.max_batch.max(1), config.max_queue);
        let watch = super::stall::StepWatch::start(&engine);
        let worker = Worker {
            watch,
            engine,
            codec,
            max_batch,
            serial: config.serial,
            chunk: config.prefill_chunk,
            prefix: PrefixCache::new(config.prefix_cache_bytes),
            prefix_failed: false,
            decode_step: 0.0,
            cost: StepCost::default(),
            metrics: metrics.clone(),
            waiting: VecDeque::new(),
            active: Vec::new(),
        };
        let handle = std::thread::Builder::new().name("krasis-scheduler".into()).spawn(move || worker.run(rx))?;
        Ok((Scheduler { tx, metrics, max_batch, max_queue }, handle))
    }

    /// Queues a job (the job's receiver then gets its events), unless every slot is busy and
    /// `max_queue` jobs already wait.
    pub fn submit(&self, job: Job) -> Result<(), Refused> {
        let queued = self.metrics.queued.load(Relaxed) as usize;
        let active = self.metrics.active.load(Relaxed) as usize;
        if queued + active >= self.max_queue + self.max_batch {
            return Err(Refused::Busy(queued));
        }
        self.metrics.queued.fetch_add(1, Relaxed);
        self.tx.send(Msg::Job(Box::new(job))).map_err(|_| {
            self.metrics.queued.fetch_sub(1, Relaxed);
            Refused::Stopped
        })
    }

    /// Ends every job with `finish_reason` [`SHUTDOWN`] and stops the thread.
    pub fn shutdown(&self) {
        let _ = self.tx.send(Msg::Shutdown);
    }
}

/// One admitted job.
struct Running {
    job: Box<Job>,
    session: Box<dyn EngineSession>,
    sampler: Sampler,
    /// What the next step runs: the prompt (from `prefilled` on, a chunk at a time), then the
    /// last sampled token.
    next: Vec<u32>,
    /// Prompt tokens already run (`next` holds the prompt while this is below its length).
    prefilled: usize,
    /// Positions where the prefill stops to snapshot the recurrent state (ascending; empty for
    /// attention-only models).
    snapshots: VecDeque<usize>,
    generated: usize,
    /// The sampled tokens (the prefix cache keys a finished session by prompt + these).
    reply: Vec<u32>,
    text: TextStream,
    stop: StopMatcher,
    /// When the job was submitted (time to first token counts from here).
    started: Instant,
    /// When the last token was sampled (inter-token latency).
    last_token: Option<Instant>,
    /// `KRASIS_TEST_SCRIPT`: the tokens the reply is made of instead of the sampled ones.
    script: Option<VecDeque<u32>>,
}

/// The scripted reply of `KRASIS_TEST_SCRIPT` (test only): the file's text encoded with no BOS
/// (special-token names become their ids). Read per request, so that a test may change it between requests.
fn test_script(codec: &TextCodec) -> Option<VecDeque<u32>> {
    let path = krasis_core::knobs::knobs().test_script.as_ref()?;
    match std::fs::read_to_string(path)
        .map_err(|e| e.to_string())
        .and_then(|t| codec.encode_plain(&t).map_err(|e| e.to_string()))
    {
        Ok(ids) => Some(ids.into()),
        Err(e) => {
            tracing::warn!("KRASIS_TEST_SCRIPT {}: {e}; sampling instead", path.display());
            None
        }
    }
}

struct Worker {
    /// The step in flight, for the stall report.
    watch: Arc<super::stall::StepWatch>,
    engine: Arc<dyn Engine>,
    codec: Arc<TextCodec>,
    max_batch: usize,
    serial: bool,
    chunk: PrefillChunk,
    prefix: PrefixCache,
    /// A save already failed (warned once, then logged at debug level).
    prefix_failed: bool,
    /// Recent decode-only step time, seconds (0 before any).
    decode_step: f64,
    /// The prompt steps' cost, their decode rows' share taken out (what sizes a measured chunk).
    cost: StepCost,
    metrics: Arc<Metrics>,
    waiting: VecDeque<(Box<Job>, Instant)>,
    active: Vec<Running>,
}

impl Worker {
    fn run(mut self, rx: mpsc::Receiver<Msg>) {
        loop {
            if self.active.is_empty() && self.waiting.is_empty() {
                match rx.recv() {
                    Ok(Msg::Job(j)) => self.waiting.push_back((j, Instant::now())),
                    Ok(Msg::Shutdown) | Err(_) => break,
                }
            }
            let mut stop = false;
            while let Ok(m) = rx.try_recv() {
                match m {
                    Msg::Job(j) => self.waiting.push_back((j, Instant::now())),
                    Msg::Shutdown => stop = true,
                }
            }
            if stop {
                break;
            }
            self.drop_abandoned();
            self.watch.begin(Phase::Admitting { waiting: self.waiting.len(), running: self.active.len() });
            self.admit();
            self.watch.end();
            if !self.active.is_empty() {
                self.step();
            }
        }
        self.end_all();
    }

    /// At shutdown: each running job ends with `finish_reason` [`SHUTDOWN`] after the text it
    /// has (the held-back tail included), each waiting one the same with no tokens.
    fn end_all(&mut self) {
        let (running, waiting) = (self.active.len(), self.waiting.len());
        for mut r in self.active.drain(..) {
            end_with(&mut r, SHUTDOWN, &self.codec);
        }
        for (job, _) in self.waiting.drain(..) {
            let finish =
                Finish { reason: SHUTDOWN, prompt_tokens: job.prompt.len(), completion_tokens: 0, stop_sequence: None };
            let _ = job.events.send(Event::Done(finish));
        }
        self.metrics.queued.fetch_sub(waiting as u64, Relaxed);
        self.metrics.active.store(0, Relaxed);
        if running + waiting > 0 {
            tracing::info!(
                "scheduler stopped: {running} running and {waiting} waiting request(s) end with \
                 finish_reason {SHUTDOWN}"
            );
        }
    }

    /// Jobs whose client went away: cancelled before they cost another step.
    fn drop_abandoned(&mut self) {
        let before = self.waiting.len();
        self.waiting.retain(|(j, _)| !j.events.is_closed());
        let gone_waiting = before - self.waiting.len();
        self.metrics.queued.fetch_sub(gone_waiting as u64, Relaxed);
        let before = self.active.len();
        self.active.retain(|r| {
            let gone = r.job.events.is_closed();
            if gone {
                log_cancelled(r);
            }
            !gone
        });
        let gone = gone_waiting + before - self.active.len();
        self.metrics.cancelled.fetch_add(gone as u64, Relaxed);
        self.metrics.active.store(self.active.len() as u64, Relaxed);
    }

    /// Moves waiting jobs into free slots (FIFO); their prompts run a chunk per step.
    fn admit(&mut self) {
        while self.active.len() < self.max_batch {
            let Some((job, queued_at)) = self.waiting.pop_front() else { break };
            self.metrics.queued.fetch_sub(1, Relaxed);
            match self.open_session(&job) {
                Ok((session, reused)) => {
                    let text = if job.keep_special { TextStream::keeping_special() } else { TextStream::new() };
                    let snapshots = if self.engine.spec().delta_net.is_some() {
                        snapshot_points(job.prompt.len()).into_iter().filter(|&p| p > reused).collect()
                    } else {
                        VecDeque::new()
                    };
                    self.active.push(Running {
                        script: test_script(&self.codec),
                        sampler: Sampler::new(job.sampling),
                        next: job.prompt.clone(),
                        stop: StopMatcher::new(job.stop.clone()),
                        job,
                        session,
                        prefilled: reused,
                        snapshots,
                        generated: 0,
                        reply: Vec::new(),
                        text,
                        started: queued_at,
                        last_token: None,
                    });
                }
                Err(e) => {
                    tracing::warn!("{}: no session: {e}", job.label.as_deref().unwrap_or("a request"));
                    let _ = job.events.send(Event::Failed(format!("no session for the request: {e}")));
                }
            }
        }
        self.metrics.active.store(self.active.len() as u64, Relaxed);
    }

    /// A session for `job`: a copy of the prefix cache's longest match to its prompt, else a
    /// fresh one; with the number of prompt tokens it already holds. A fresh session that does
    /// not fit (the GPU's VRAM budget) evicts cached prefixes until it does.
    fn open_session(&mut self, job: &Job) -> crate::error::Result<(Box<dyn EngineSession>, usize)> {
        let label = job.label.as_deref().unwrap_or("a request");
        if self.prefix.enabled() {
            self.metrics.prefix_lookups.fetch_add(1, Relaxed);
            if let Some(hit) = self.prefix.lookup(&job.prompt, self.engine.prefill_min_tokens()) {
                let n = hit.tokens;
                match self.engine.resume_prefix(hit.saved, n) {
                    Ok(session) => {
                        self.metrics.prefix_hits.fetch_add(1, Relaxed);
                        self.metrics.prefix_reused_tokens.fetch_add(n as u64, Relaxed);
                        if job.label.is_some() {
                            tracing::info!(
                                "{label}: {n} of {} prompt tokens reused from the prefix cache; prefilling {}",
                                job.prompt.len(),
                                job.prompt.len() - n
                            );
                        }
                        return Ok((session, n));
                    }
                    Err(e) => tracing::warn!(
                        "{label}: the prefix cache's state could not be resumed ({e}); prefilling it all"
                    ),
                }
            }
        }
        loop {
            match self.engine.new_session() {
                Ok(s) => return Ok((s, 0)),
                Err(e) if self.prefix.evict_one() => {
                    tracing::debug!("{label}: no session ({e}); dropped a cached prefix to make room")
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Keeps a finished job's state in the prefix cache, keyed by the tokens it ran.
    fn keep_prefix(&mut self, r: Running) {
        if !self.prefix.enabled() || r.reply.is_empty() {
            return;
        }
        let mut tokens = r.job.prompt;
        tokens.extend_from_slice(&r.reply[..r.reply.len() - 1]); // the last one never ran
        if r.session.position() != tokens.len() {
            return;
        }
        match self.engine.save_prefix(r.session) {
            Ok(Some(saved)) => self.prefix.insert(tokens, saved),
            Ok(None) => {}
            Err(e) if !self.prefix_failed => {
                self.prefix_failed = true;
                tracing::warn!("prefix cache: a finished request's state was not kept: {e} (said once)");
            }
            Err(e) => tracing::debug!("prefix cache: a finished request's state was not kept: {e}"),
        }
        self.metrics.prefix_cached_bytes.store(self.prefix.bytes() as u64, Relaxed);
    }

    /// The prompt tokens this step may run in all.
    fn chunk_tokens(&self, decoding: bool) -> usize {
        match self.chunk {
            PrefillChunk::Fixed(n) => n.max(1),
            PrefillChunk::Measured => self.measured_chunk(decoding),
        }
    }

    /// [`PrefillChunk::Measured`]: the prompt tokens the step's prompt time has room for at the
    /// prompt steps' cost (see the module's documentation).
    fn measured_chunk(&self, decoding: bool) -> usize {
        // Seconds of the step for its prompt tokens (the decode rows take `decode_step`).
        let fixed = self.cost.fixed_seconds();
        let prompt_seconds = match (decoding, self.decode_step) {
            (true, d) if d > 0.0 => ((DECODE_STEP_MULTIPLE - 1.0) * d).max(2.0 * fixed),
            (true, _) => TARGET_STEP_SECONDS.max(2.0 * fixed),
            (false, _) => IDLE_STEP_SECONDS,
        };
        // Never below the engine's full-rate length: shorter chunks would both run slower and
        // teach the cost model the slower path's rate (the hybrid's CPU share), which kept the
        // chunks short.
        let floor = self.engine.prompt_chunk_floor().clamp(CHUNK_BOUNDS.0, CHUNK_BOUNDS.1);
        match self.cost.tokens_for(prompt_seconds) {
            Some(n) => (n as usize).clamp(floor, CHUNK_BOUNDS.1),
            None => FIRST_CHUNK_TOKENS.max(floor),
        }
    }

    /// One engine step over the running jobs: every decoding job's token, and prompt chunks up to
    /// the step's budget (first come first); then each job's token.
    fn step(&mut self) {
        // Which tokens each job runs: `None` for a prefilling job that gets no share this step.
        let mut budget = self.chunk_tokens(self.active.iter().any(|r| r.generated > 0));
        let min_prompt_step = self.engine.prefill_min_tokens();
        let mut runs: Vec<Option<std::ops::Range<usize>>> = Vec::with_capacity(self.active.len());
        for r in &self.active {
            if r.generated > 0 {
                runs.push(Some(0..r.next.len()));
            } else if budget > 0 {
                let rest = r.next.len() - r.prefilled;
                let mut n = rest.min(budget);
                if let Some(&p) = r.snapshots.front().filter(|&&p| p < r.prefilled + n) {
                    n = p - r.prefilled; // stop at the snapshot point
                }
                // A prompt never ends in a chunk shorter than a prompt step: this one takes it.
                if n < rest && rest - n < min_prompt_step {
                    n = rest;
                }
                budget = budget.saturating_sub(n);
                runs.push(Some(r.prefilled..r.prefilled + n));
            } else {
                runs.push(None);
            }
        }
        // The prompt chunks this step runs, in job order.
        let chunks: Vec<usize> = self
            .active
            .iter()
            .zip(&runs)
            .filter(|(r, _)| r.generated == 0)
            .filter_map(|(_, run)| run.as_ref().map(|x| x.len()))
            .collect();
        let prompt_tokens: usize = chunks.iter().sum();
        let decoding = self.active.iter().filter(|r| r.generated > 0).count();
        let sequences = runs.iter().flatten().count();
        // A chunk that does not end its prompt samples nothing: a throwaway greedy sampler takes
        // the token (the job's own sampler and its random state are left alone). One per such
        // chunk, made only in steps that have one.
        let mid_prompt = |r: &Running, run: &Option<std::ops::Range<usize>>| {
            run.as_ref().is_some_and(|run| r.generated == 0 && run.end < r.next.len())
        };
        let spares = self.active.iter().zip(&runs).filter(|(r, run)| mid_prompt(r, run)).count();
        let mut throwaway: Vec<Sampler> = (0..spares).map(|_| Sampler::new(SamplingParams::default())).collect();
        let mut spare = throwaway.iter_mut();
        self.watch.begin(Phase::Step { decoding, chunks });
        let t0 = Instant::now();
        let result = {
            let mut batch: Vec<SequenceStep<'_>> = self
                .active
                .iter_mut()
                .zip(&runs)
                .filter_map(|(r, run)| {
                    let ends_prompt = !mid_prompt(r, run);
                    let run = run.clone()?;
                    let sampler = if ends_prompt { &mut r.sampler } else { spare.next().expect("one spare per chunk") };
                    Some(SequenceStep {
                        session: r.session.as_mut(),
                        tokens: &r.next[run],
                        sampler,
                        want_logits: false,
                    })
                })
                .collect();
            if self.serial {
                let mut outs = Vec::with_capacity(batch.len());
                batch.chunks_mut(1).try_for_each(|one| self.engine.step(one).map(|o| outs.extend(o))).map(|()| outs)
            } else {
                self.engine.step(&mut batch)
            }
        };
        let took = t0.elapsed();
        self.watch.begin(Phase::AfterStep { sequences });
        let outputs = match result {
            Ok(o) => o,
            Err(e) => {
                tracing::error!("engine step failed for {sequences} sequence(s): {e}");
                for r in self.active.drain(..) {
                    let _ = r.job.events.send(Event::Failed(format!("the engine failed: {e}")));
                }
                self.metrics.active.store(0, Relaxed);
                self.watch.end();
                return;
            }
        };
        let now = Instant::now();
        self.metrics.record_step(sequences, prompt_tokens, decoding, took);
        let t = took.as_secs_f64();
        if prompt_tokens == 0 {
            self.decode_step =
                if self.decode_step > 0.0 { self.decode_step + DECODE_STEP_EMA * (t - self.decode_step) } else { t };
        } else {
            // The decode rows' share, as a decode-only step of this batch takes (none before one
            // was measured: the prompt is charged the whole step, which only makes chunks smaller).
            let rows = if decoding > 0 { self.decode_step } else { 0.0 };
            self.cost.observe(prompt_tokens, (t - rows).max(0.05 * t));
        }
        self.metrics.prompt_tokens.fetch_add(prompt_tokens as u64, Relaxed);
        let eos = &self.engine.spec().eos_token_ids;
        let codec = &self.codec;
        let mut outcomes = Vec::with_capacity(self.active.len());
        let mut outputs = outputs.into_iter();
        let mut sampled = 0;
        for (r, run) in self.active.iter_mut().zip(runs) {
            let Some(run) = run else {
                outcomes.push(Outcome::Running);
                continue;
            };
            let out = outputs.next().expect("one output per sequence that ran");
            if r.generated == 0 {
                r.prefilled = run.end;
                if r.snapshots.front() == Some(&run.end) {
                    r.snapshots.pop_front();
                    if let Err(e) = self.engine.snapshot(r.session.as_mut()) {
                        tracing::debug!("prefix cache: no snapshot at {}: {e}", run.end);
                    }
                }
                if run.end < r.next.len() {
                    outcomes.push(Outcome::Running); // more of the prompt to go
                    continue;
                }
                self.metrics.record_first_token(now.duration_since(r.started));
            } else if let Some(last) = r.last_token {
                self.metrics.record_inter_token(now.duration_since(last));
            }
            r.last_token = Some(now);
            sampled += 1;
            let o = advance(r, out.token, codec, eos);
            if o == Outcome::Gone {
                log_cancelled(r);
                self.metrics.cancelled.fetch_add(1, Relaxed);
            }
            outcomes.push(o);
        }
        self.metrics.generated_tokens.fetch_add(sampled as u64, Relaxed);
        let mut kept = Vec::with_capacity(self.active.len());
        for (r, o) in std::mem::take(&mut self.active).into_iter().zip(outcomes) {
            match o {
                Outcome::Running => kept.push(r),
                Outcome::Finished => self.keep_prefix(r),
                Outcome::Gone => {}
            }
        }
        self.active = kept;
        self.metrics.active.store(self.active.len() as u64, Relaxed);
        self.watch.end();
    }
}

/// Where a recurrent model's prefill of a `len`-token prompt snapshots its state: the last
/// [`DELTA_SNAPSHOTS`] − 1 multiples of [`SNAPSHOT_BLOCK`] below the end, and the end.
fn snapshot_points(len: usize) -> Vec<usize> {
    let last_block = (len.saturating_sub(1) / SNAPSHOT_BLOCK) * SNAPSHOT_BLOCK;
    let mut points: Vec<usize> = (0..DELTA_SNAPSHOTS.saturating_sub(1))
        .filter_map(|i| last_block.checked_sub(i * SNAPSHOT_BLOCK))
        .filter(|&p| p > 0)
        .collect();
    points.reverse();
    points.push(len);
    points
}

fn log_cancelled(r: &Running) {
    if let Some(label) = &r.job.label {
        tracing::info!("{label}: cancelled (client went away) after {} tokens", r.generated);
    }
}

/// What became of a job after its token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Outcome {
    Running,
    /// Done, stopped or failed; its receiver has the last event.
    Finished,
    /// The receiver is gone (the client went away).
    Gone,
}

/// Takes one sampled token for `r`: text out through the stop matcher, then the end checks.
fn advance(r: &mut Running, token: u32, codec: &TextCodec, eos: &[u32]) -> Outcome {
    // A scripted reply replaces the sampled token (then ends with the end-of-sequence token).
    let token = match &mut r.script {
        Some(script) => script.pop_front().or(eos.first().copied()).unwrap_or(token),
        None => token,
    };
    r.generated += 1;
    r.reply.push(token);
    r.next.clear();
    r.next.push(token);
    let is_eos = !r.job.ignore_eos && eos.contains(&token);
    let pushed = if r.job.keep_special && is_eos { Ok(String::new()) } else { r.text.push(codec, token) };
    let delta = match pushed {
        Ok(d) => d,
        Err(e) => {
            let _ = r.job.events.send(Event::Failed(format!("detokenisation failed: {e}")));
            return Outcome::Finished;
        }
    };
    let m = r.stop.push(&delta);
    if !m.emit.is_empty() && r.job.events.send(Event::Text(m.emit)).is_err() {
        return Outcome::Gone;
    }
    let reason = if m.stopped || is_eos {
        Some("stop")
    } else if r.generated >= r.job.max_tokens {
        Some("length")
    } else {
        None
    };
    match reason {
        None => Outcome::Running,
        Some(_) if m.stopped => done(r, "stop"),
        Some(reason) => end_with(r, reason, codec),
    }
}

/// Ends `r` for `reason` after the text it holds back: an incomplete character's bytes, then
/// text that might have begun a stop string (`stop` if it ends one).
fn end_with(r: &mut Running, mut reason: &'static str, codec: &TextCodec) -> Outcome {
    let tail = r.text.finish(codec).unwrap_or_default();
    let m = r.stop.push(&tail);
    let mut rest = m.emit;
    if m.stopped {
        reason = "stop";
    } else {
        rest.push_str(&r.stop.flush());
    }
    if !rest.is_empty() {
        let _ = r.job.events.send(Event::Text(rest));
    }
    done(r, reason)
}

/// Sends `r`'s `Done` and logs it.
fn done(r: &Running, reason: &'static str) -> Outcome {
    let prompt_tokens = r.job.prompt.len();
    let stop_sequence = if reason == "stop" { r.stop.hit() } else { None };
    let finish = Finish { reason, prompt_tokens, completion_tokens: r.generated, stop_sequence };
    if let Some(label) = &r.job.label {
        tracing::info!(
            "{label}: {} prompt + {} generated tokens in {:.2} s, finish_reason {reason}",
            prompt_tokens,
            r.generated,
            r.started.elapsed().as_secs_f64()
        );
    }
    match r.job.events.send(Event::Done(finish)) {
        Ok(()) => Outcome::Finished,
        Err(_) => Outcome::Gone,
    }
}

#[cfg(test)]
#[path = "scheduler_tests.rs"]
mod tests;
