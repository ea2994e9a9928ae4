//! Continuous batching: prompts run in chunks inside the steps that decode the running streams,
//! with the same tokens as whole prompts, and the latencies reach `/metrics`.

use std::sync::{Arc, Mutex};

use tokio::sync::mpsc::unbounded_channel;

use super::*;
use crate::runtime::{open_engine, DevicePath, DevicePolicy, EngineConfig, EngineStats, StepOutput};
use crate::source::files::ModelFiles;
use crate::spec::{ModelSpec, WeightBits};
use crate::synth::{synthesize, Preset, SynthOptions};

/// An engine that records, per step, each sequence's token count, and runs the real one.
struct Recording {
    inner: Box<dyn Engine>,
    steps: Mutex<Vec<Vec<usize>>>,
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
        self.steps.lock().unwrap().push(batch.iter().map(|s| s.tokens.len()).collect());
        self.inner.step(batch)
    }
    fn stats(&self, session: Option<&dyn EngineSession>) -> EngineStats {
        self.inner.stats(session)
    }
    fn reset_stats(&self, session: Option<&mut dyn EngineSession>) {
        self.inner.reset_stats(session)
    }
}

fn engine(dir: &std::path::Path) -> (Arc<Recording>, Arc<TextCodec>) {
    let out = dir.join("tiny");
    synthesize(&SynthOptions { layers: Some(2), seed: 7, ..SynthOptions::new(Preset::Tiny, &out) }).unwrap();
    let files = ModelFiles::open(&out).unwrap();
    let mut c = EngineConfig { device: DevicePolicy::Cpu, ..EngineConfig::default() };
    (c.cpu.expert_bits, c.cpu.dense_bits) = (WeightBits::Bf16, WeightBits::Bf16);
    let inner = open_engine(&files, &c).unwrap().engine;
    (Arc::new(Recording { inner, steps: Mutex::new(Vec::new()) }), files.text_codec().unwrap())
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
    let tmp = tempfile::tempdir().unwrap();
    let (engine, codec) = engine(tmp.path());
    let metrics = Arc::new(Metrics::default());
    let config = Config { max_batch: 4, max_queue: 4, serial: false, prefill_chunk: chunk };
    let (sched, handle) = Scheduler::start(engine.clone(), codec, config, metrics.clone()).unwrap();
    let mut rxs = Vec::new();
    for (prompt, max) in jobs {
        let (j, rx) = job(prompt.clone(), *max);
        assert!(sched.submit(j).is_ok());
        rxs.push(rx);
    }
    let mut out = Vec::new();
    for mut rx in rxs {
        let mut text = String::new();
        loop {
            match rx.blocking_recv().expect("the job ends with Done") {
                Event::Text(t) => text.push_str(&t),
                Event::Done(f) => {
                    out.push((text, f));
                    break;
                }
                Event::Failed(e) => panic!("job failed: {e}"),
            }
        }
    }
    sched.shutdown();
    handle.join().unwrap();
    let steps = engine.steps.lock().unwrap().clone();
    (out, steps, metrics)
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
    // Whole prompts: both prompts in the first step.
    assert_eq!(whole_steps[0], [4, 200]);
    // Chunked: the short prompt and 12 tokens of the long one, then 16 at a time beside the short
    // request's decode token.
    assert_eq!(steps[0], [4, 12]);
    let long_chunks: Vec<usize> = steps.iter().filter(|s| s.len() == 2).map(|s| s[1]).collect();
    assert_eq!(long_chunks.iter().sum::<usize>(), 200 + 2, "the prompt, then two decode tokens");
    for s in &steps[1..13] {
        assert_eq!(s[0], 1, "the short request decodes in every step of the long prefill: {steps:?}");
        assert!(s[1] <= 16, "{steps:?}");
    }
    for s in &steps {
        assert!(s.iter().sum::<usize>() <= 16 + 4, "a step over the chunk budget: {steps:?}");
    }
    let text = metrics.render();
    assert!(text.contains("krasis_time_to_first_token_seconds_count 2"), "{text}");
    assert!(text.contains("krasis_inter_token_latency_seconds{quantile=\"0.9\"}"), "{text}");
    assert!(text.contains(&format!("krasis_inter_token_latency_seconds_count {}", 20 - 1 + 3 - 1)), "{text}");
}

/// The measured chunk starts at FIRST_CHUNK_TOKENS and then follows the prefill rate.
#[test]
fn the_measured_chunk_follows_the_prefill_rate() {
    let tmp = tempfile::tempdir().unwrap();
    let (engine, codec) = engine(tmp.path());
    let metrics = Arc::new(Metrics::default());
    let w = Worker {
        engine,
        codec,
        max_batch: 1,
        serial: false,
        chunk: PrefillChunk::Measured,
        metrics: metrics.clone(),
        waiting: VecDeque::new(),
        active: Vec::new(),
    };
    assert_eq!(w.chunk_tokens(), FIRST_CHUNK_TOKENS);
    // 10,000 prompt tokens in one second: a quarter-second step runs 2,500.
    metrics.record_step(1, 10_000, 0, std::time::Duration::from_secs(1));
    assert_eq!(w.chunk_tokens(), 2500);
    metrics.record_step(1, 1_000_000, 0, std::time::Duration::from_secs(1));
    assert_eq!(w.chunk_tokens(), CHUNK_BOUNDS.1);
}
