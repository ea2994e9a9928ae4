//! Continuous batching: prompts run in chunks inside the steps that decode the running streams,
//! with the same tokens as whole prompts, and the latencies reach `/metrics`.

use std::sync::{Arc, Mutex};

use tokio::sync::mpsc::unbounded_channel;

use super::*;
use crate::runtime::{open_engine, DevicePath, DevicePolicy, EngineConfig, EngineStats, SavedPrefix, StepOutput};
use crate::source::files::ModelFiles;
use crate::spec::{ModelSpec, WeightBits};
use crate::synth::{synthesize, Preset, SynthOptions};

/// An engine that records, per step, each sequence's token count, and runs the real one. While
/// `held`, a step waits: [`run`] holds the steps until every job is submitted, so the jobs
/// overlap however the scheduler's thread is timed.
struct Recording {
    inner: Box<dyn Engine>,
    steps: Mutex<Vec<Vec<usize>>>,
    held: Mutex<bool>,
    released: std::sync::Condvar,
    /// What it says for [`Engine::prefill_min_tokens`] (the engine's own: 1).
    min_prefill: std::sync::atomic::AtomicUsize,
}

impl Recording {
    fn hold(&self, held: bool) {
        *self.held.lock().unwrap() = held;
        self.released.notify_all();
    }
}

impl Engine for Recording {
    fn spec(&self) -> &ModelSpec {
        self.inner.spec()
    }
    fn device(&self) -> DevicePath {
        self.inner.device()
    }
    fn describe(&self) -> String {
        self.inner.describe()
    }
    fn check_tokens(&self, tokens: &[u32]) -> crate::error::Result<()> {
        self.inner.check_tokens(tokens)
    }
    fn new_session(&self) -> crate::error::Result<Box<dyn EngineSession>> {
        self.inner.new_session()
    }
    fn step(&self, batch: &mut [SequenceStep<'_>]) -> crate::error::Result<Vec<StepOutput>> {
        drop(self.released.wait_while(self.held.lock().unwrap(), |held| *held).unwrap());
        self.steps.lock().unwrap().push(batch.iter().map(|s| s.tokens.len()).collect());
        self.inner.step(batch)
    }
    fn stats(&self, session: Option<&dyn EngineSession>) -> EngineStats {
        self.inner.stats(session)
    }
    fn prefill_min_tokens(&self) -> usize {
        self.min_prefill.load(std::sync::atomic::Ordering::Relaxed)
    }
    fn reset_stats(&self, session: Option<&mut dyn EngineSession>) {
        self.inner.reset_stats(session)
    }
    fn snapshot(&self, session: &mut dyn EngineSession) -> crate::error::Result<()> {
        self.inner.snapshot(session)
    }
    fn save_prefix(&self, s: Box<dyn EngineSession>) -> crate::error::Result<Option<Box<dyn SavedPrefix>>> {
        self.inner.save_prefix(s)
    }
    fn resume_prefix(&self, saved: &dyn SavedPrefix, len: usize) -> crate::error::Result<Box<dyn EngineSession>> {
        self.inner.resume_prefix(saved, len)
    }
}

fn engine(dir: &std::path::Path) -> (Arc<Recording>, Arc<TextCodec>) {
    let out = dir.join("tiny");
    synthesize(&SynthOptions { layers: Some(2), seed: 7, ..SynthOptions::new(Preset::Tiny, &out) }).unwrap();
    let files = ModelFiles::open(&out).unwrap();
    let mut c = EngineConfig { device: DevicePolicy::Cpu, ..EngineConfig::default() };
    (c.cpu.expert_bits, c.cpu.dense_bits) = (WeightBits::Bf16, WeightBits::Bf16);
    let inner = open_engine(&files, &c).unwrap().engine;
    let recording = Recording {
        inner,
        steps: Mutex::new(Vec::new()),
        held: Mutex::new(false),
        released: Default::default(),
        min_prefill: 1.into(),
    };
    (Arc::new(recording), files.text_codec().unwrap())
}

fn job(prompt: Vec<u32>, max_tokens: usize) -> (Job, tokio::sync::mpsc::UnboundedReceiver<Event>) {
    let (tx, rx) = unbounded_channel();
    let job = Job {
        prompt,
        max_tokens,
        sampling: SamplingParams::default(),
        stop: vec![],
        ignore_eos: true,
        events: tx,
        label: None,
        keep_special: false,
    };
    (job, rx)
}

/// Each job's text and finish, in submission order, after a run of `jobs` with `chunk`; and the
/// steps the engine saw.
/// A run's replies (text and finish per job), the steps the engine saw and the metrics.
type RunResult = (Vec<(String, Finish)>, Vec<Vec<usize>>, Arc<Metrics>);

fn run(chunk: PrefillChunk, jobs: &[(Vec<u32>, usize)]) -> RunResult {
    run_with(chunk, jobs, 1)
}

/// [`run`] on an engine whose prompt steps take at least `min_prefill` tokens.
fn run_with(chunk: PrefillChunk, jobs: &[(Vec<u32>, usize)], min_prefill: usize) -> RunResult {
    let tmp = tempfile::tempdir().unwrap();
    let (engine, codec) = engine(tmp.path());
    engine.min_prefill.store(min_prefill, std::sync::atomic::Ordering::Relaxed);
    let metrics = Arc::new(Metrics::default());
    let config = Config { max_batch: 4, max_queue: 4, serial: false, prefill_chunk: chunk, prefix_cache_bytes: 0 };
    engine.hold(true);
    let (sched, handle) = Scheduler::start(engine.clone(), codec, config, metrics.clone()).unwrap();
    let mut rxs = Vec::new();
    for (prompt, max) in jobs {
        let (j, rx) = job(prompt.clone(), *max);
        assert!(sched.submit(j).is_ok());
        rxs.push(rx);
    }
    engine.hold(false);
    let out = rxs.into_iter().map(reply).collect();
    sched.shutdown();
    handle.join().unwrap();
    let steps = engine.steps.lock().unwrap().clone();
    (out, steps, metrics)
}

/// A job's text and finish.
fn reply(mut rx: tokio::sync::mpsc::UnboundedReceiver<Event>) -> (String, Finish) {
    let mut text = String::new();
    loop {
        match rx.blocking_recv().expect("the job ends with Done") {
            Event::Text(t) => text.push_str(&t),
            Event::Done(f) => return (text, f),
            Event::Failed(e) => panic!("job failed: {e}"),
        }
    }
}

/// Runs `turns` one after another (each submitted when the one before has finished) with a
/// prefix cache of `cache_bytes`: the replies, the engine's steps and the metrics.
fn conversation(turns: &[Vec<u32>], cache_bytes: usize) -> RunResult {
    let tmp = tempfile::tempdir().unwrap();
    let (engine, codec) = engine(tmp.path());
    let metrics = Arc::new(Metrics::default());
    let config = Config {
        max_batch: 2,
        max_queue: 2,
        serial: false,
        prefill_chunk: PrefillChunk::Fixed(64),
        prefix_cache_bytes: cache_bytes,
    };
    let (sched, handle) = Scheduler::start(engine.clone(), codec, config, metrics.clone()).unwrap();
    let mut out = Vec::new();
    for prompt in turns {
        let (j, rx) = job(prompt.clone(), 6);
        assert!(sched.submit(j).is_ok());
        out.push(reply(rx));
    }
    sched.shutdown();
    handle.join().unwrap();
    let steps = engine.steps.lock().unwrap().clone();
    (out, steps, metrics)
}

/// Three turns, each prompt the one before plus its reply's tokens and 40 new ones, and a fourth
/// that shares only the first 100 tokens: with the prefix cache every turn after the first runs
/// only the tokens the cache does not hold, and every reply is the uncached run's.
#[test]
fn later_turns_prefill_only_their_new_tokens_with_the_same_replies() {
    let base: Vec<u32> = (0..150).map(|i| 3 + (i * 11) % 500).collect();
    let new_part = |k: u32| -> Vec<u32> { (0..40).map(|i| 5 + (i * 13 + k * 7) % 400).collect() };
    // The replies are not known in advance: turn k + 1 extends turn k's prompt by made-up tokens
    // standing for its reply (the cache keys by tokens, so it holds prompt + reply − 1 of them).
    let mut turns = vec![base.clone()];
    for k in 1..3 {
        let mut t = turns[k - 1].clone();
        t.extend(new_part(k as u32));
        turns.push(t);
    }
    let mut other = base[..100].to_vec();
    other.extend(new_part(9));
    turns.push(other);
    let (cached, steps, metrics) = conversation(&turns, 64 << 20);
    let (plain, plain_steps, _) = conversation(&turns, 0);
    assert_eq!(cached, plain, "the prefix cache changes no token");
    let prompt_tokens = |steps: &[Vec<usize>]| steps.iter().filter(|s| s[0] > 1).map(|s| s[0]).sum::<usize>();
    assert_eq!(prompt_tokens(&plain_steps), 150 + 190 + 230 + 140);
    // Turn 2 resumes turn 1's 150 prompt tokens (its reply's tokens differ from the made-up ones),
    // turn 3 turn 2's 190, turn 4 the first 100.
    assert_eq!(prompt_tokens(&steps), 150 + 40 + 40 + 40, "{steps:?}");
    let text = metrics.render();
    assert!(text.contains("krasis_prefix_hits_total 3"), "{text}");
    assert!(text.contains("krasis_prefix_lookups_total 4"), "{text}");
    assert!(text.contains(&format!("krasis_prefix_reused_tokens_total {}", 150 + 190 + 100)), "{text}");
    assert!(text.contains("krasis_prompt_tokens_total 270"), "{text}");
}

/// A 200-token prompt submitted with a 4-token one: with 16-token chunks the long prompt takes
/// 13 steps, in every one of which the short request decodes; the replies are the whole-prompt
/// run's, token for token.
#[test]
fn a_long_prompt_runs_in_chunks_inside_the_decoding_steps() {
    let long: Vec<u32> = (0..200).map(|i| 3 + (i * 7) % 500).collect();
    let jobs = [(vec![5, 9, 200, 3], 20), (long, 3)];
    let (chunked, steps, metrics) = run(PrefillChunk::Fixed(16), &jobs);
    let (whole, whole_steps, _) = run(PrefillChunk::Fixed(100_000), &jobs);
    assert_eq!(chunked, whole, "chunked prefill changes no token");
    // The scheduler may admit the first job before the second reaches it (both are submitted to
    // a running scheduler; its steps wait until both are in), so each check holds for either
    // arrival.
    // Whole prompts: the long one in a single step.
    assert!(whole_steps.iter().any(|s| s.len() == 2 && s[1] == 200), "{whole_steps:?}");
    // Chunked: the long prompt in chunks of at most 16 from the step it joins, beside the short
    // request in every one; admitted together, the short prompt's 4 tokens leave 12 to the first.
    let first = steps.iter().position(|s| s.len() == 2).expect("the long prompt ran beside the short request");
    if first == 0 {
        assert_eq!(steps[0], [4, 12]);
    }
    let long_chunks: Vec<usize> = steps.iter().filter(|s| s.len() == 2).map(|s| s[1]).collect();
    assert_eq!(long_chunks.iter().sum::<usize>(), 200 + 2, "the prompt, then two decode tokens");
    let mut prefilled = 0;
    for (i, s) in steps.iter().enumerate().skip(first) {
        if prefilled >= 200 {
            break;
        }
        assert_eq!(s.len(), 2, "the short request runs in every step of the long prefill: {steps:?}");
        assert!(s[1] <= 16, "{steps:?}");
        if i > 0 {
            assert_eq!(s[0], 1, "the short request decodes in every step of the long prefill: {steps:?}");
        }
        prefilled += s[1];
    }
    assert!(long_chunks.len() >= 200usize.div_ceil(16), "{steps:?}");
    for s in &steps {
        assert!(s.iter().sum::<usize>() <= 16 + 4, "a step over the chunk budget: {steps:?}");
    }
    let text = metrics.render();
    assert!(text.contains("krasis_time_to_first_token_seconds_count 2"), "{text}");
    assert!(text.contains("krasis_inter_token_latency_seconds{quantile=\"0.9\"}"), "{text}");
    assert!(text.contains(&format!("krasis_inter_token_latency_seconds_count {}", 20 - 1 + 3 - 1)), "{text}");
}

/// An engine whose prompt steps take two tokens at least (the GPU's row-invariant prefill): a
/// 33-token prompt in 16-token chunks ends in a 17-token chunk, not a 1-token one; with one token
/// allowed the chunks are 16, 16 and 1. Both give the same reply.
#[test]
fn a_prompt_never_ends_in_a_chunk_shorter_than_the_engines_prompt_step() {
    let prompt: Vec<u32> = (0..33).map(|i| 3 + (i * 7) % 500).collect();
    let jobs = [(prompt, 3)];
    let (two, two_steps, _) = run_with(PrefillChunk::Fixed(16), &jobs, 2);
    let (one, one_steps, _) = run(PrefillChunk::Fixed(16), &jobs);
    assert_eq!(two, one);
    let firsts = |steps: &[Vec<usize>]| steps.iter().map(|s| s[0]).collect::<Vec<_>>();
    assert_eq!(firsts(&two_steps), [16, 17, 1, 1], "{two_steps:?}");
    assert_eq!(firsts(&one_steps), [16, 16, 1, 1, 1], "{one_steps:?}");
}

/// The measured chunk starts at FIRST_CHUNK_TOKENS, then follows the prompt steps' cost: their
/// rate while it cannot tell a fixed part per step, then their fixed part and rate.
#[test]
fn the_measured_chunk_follows_the_prompt_steps_cost() {
    let tmp = tempfile::tempdir().unwrap();
    let (engine, codec) = engine(tmp.path());
    let mut w = Worker {
        watch: Default::default(),
        engine,
        codec,
        max_batch: 1,
        serial: false,
        chunk: PrefillChunk::Measured,
        prefix: PrefixCache::new(0),
        prefix_failed: false,
        decode_step: 0.0,
        cost: StepCost::default(),
        metrics: Arc::new(Metrics::default()),
        waiting: VecDeque::new(),
        active: Vec::new(),
    };
    assert_eq!(w.chunk_tokens(false), FIRST_CHUNK_TOKENS);
    // 1,000 prompt tokens in one second: with no stream decoding, a two-second step runs 2,000.
    w.cost.observe(1_000, 1.0);
    assert_eq!(w.chunk_tokens(false), 2000);
    assert_eq!(w.chunk_tokens(true), 250, "streams decoding, none measured yet: the quarter-second step");
    // Streams decoding in 40 ms steps: the prompt gets 1.5 x 40 ms of a 2.5 x 40 ms step.
    w.decode_step = 0.04;
    assert_eq!(w.chunk_tokens(true), 64, "60 tokens, at the floor");
    // Prompt steps of 0.14 s plus 50 us a token (a hybrid's expert copy, then 20,000 tok/s).
    let mut cost = StepCost::default();
    for n in [512usize, 4096, 1024, 8192] {
        cost.observe(n, 0.14 + n as f64 * 5e-5);
    }
    w.cost = cost;
    assert_eq!(w.chunk_tokens(false), CHUNK_BOUNDS.1, "the idle step: (2 - 0.14) / 50 us, at the bound");
    // (The fit is a least-squares solution: a token either way of the exact figure.)
    let near = |got: usize, want: usize| got.abs_diff(want) <= 1;
    // 1.5 x 40 ms is less than the fixed part: the prompt gets twice the fixed part (0.28 s).
    assert!(near(w.chunk_tokens(true), 2800), "{}", w.chunk_tokens(true));
    // 140 ms decode steps (28 streams): 1.5 x 0.14 = 0.21 s, still under 0.28 s.
    w.decode_step = 0.14;
    assert!(near(w.chunk_tokens(true), 2800), "{}", w.chunk_tokens(true));
    // 0.2 s decode steps: 0.3 s for the prompt, 0.16 s of it for tokens.
    w.decode_step = 0.2;
    assert!(near(w.chunk_tokens(true), 3200), "{}", w.chunk_tokens(true));
    w.chunk = PrefillChunk::Fixed(100);
    assert_eq!(w.chunk_tokens(true), 100);
}

/// Prompts that arrive while a batch decodes (the mix that stalled the hybrid engine at 32
/// streams on the GPU box, 2026-11-29) join with chunks beside the decoding streams, and every
/// request finishes with all its tokens.
#[test]
fn prompts_arriving_while_a_batch_decodes_all_finish() {
    let tmp = tempfile::tempdir().unwrap();
    let (engine, codec) = engine(tmp.path());
    let metrics = Arc::new(Metrics::default());
    let config = Config {
        max_batch: 12,
        max_queue: 4,
        serial: false,
        prefill_chunk: PrefillChunk::Fixed(48),
        prefix_cache_bytes: 64 << 20,
    };
    let (sched, handle) = Scheduler::start(engine.clone(), codec, config, metrics.clone()).unwrap();
    let prompt = |k: u32, n: u32| -> Vec<u32> { (0..n).map(|i| 3 + (i * 7 + k * 31) % 500).collect() };
    let mut decoders = Vec::new();
    for k in 0..8 {
        let (j, rx) = job(prompt(k, 16), 30);
        assert!(sched.submit(j).is_ok());
        decoders.push(rx);
    }
    // Wait until the first stream has text, then send long prompts while the batch decodes.
    let first = decoders[0].blocking_recv().expect("a first event");
    assert!(matches!(first, Event::Text(_)), "{first:?}");
    let mut late = Vec::new();
    for k in 0..4 {
        let (j, rx) = job(prompt(100 + k, 130), 5);
        assert!(sched.submit(j).is_ok());
        late.push(rx);
    }
    for rx in late {
        let (_, f) = reply(rx);
        assert_eq!((f.prompt_tokens, f.completion_tokens), (130, 5));
    }
    for rx in decoders.into_iter().skip(1) {
        assert_eq!(reply(rx).1.completion_tokens, 30);
    }
    sched.shutdown();
    handle.join().unwrap();
    let steps = engine.steps.lock().unwrap().clone();
    assert!(
        steps.iter().any(|s| s.contains(&1) && s.iter().any(|&n| n > 1)),
        "some step mixed decode tokens and a prompt chunk: {steps:?}"
    );
}
