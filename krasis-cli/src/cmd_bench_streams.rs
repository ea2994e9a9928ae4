//! `krasis bench --model DIR --streams 1,2,4,8`: aggregate decode tok/s of N concurrent streams
//! through the server's own scheduler (no HTTP), so the figure is what `krasis serve` gets from
//! batching: every stream advanced by one engine step per token.

use std::path::Path;
use std::sync::Arc;

use anyhow::{bail, Context};
use krasis_model::runtime::{Engine, EngineConfig};
use krasis_model::source::files::ModelFiles;
use krasis_model::text::sampling::SamplingParams;
use serde_json::{json, Value};
use tokio::sync::mpsc::unbounded_channel;

use crate::cmd_bench::{open_for_bench, random_prompt};
use crate::serve::Metrics;
use krasis_model::runtime::scheduler::{Config, Event, Job, PrefillChunk, Scheduler};

/// Decode steps of the warm-up stream before the timed runs (first touches, pool spin-up).
const WARMUP_TOKENS: usize = 4;

/// Runs `n` streams of `decode_tokens` each after a `prompt_tokens` prompt: (decode tokens, decode
/// seconds) of the steps that only decoded, all streams together.
fn run_streams(
    engine: &Arc<dyn Engine>,
    codec: &Arc<krasis_model::text::tokenizer::TextCodec>,
    n: usize,
    prompt_tokens: usize,
    decode_tokens: usize,
    serial: bool,
) -> anyhow::Result<(u64, f64)> {
    let metrics = Arc::new(Metrics::default());
    let (scheduler, worker) = Scheduler::start(
        engine.clone(),
        codec.clone(),
        Config { max_batch: n, max_queue: n, serial, prefill_chunk: PrefillChunk::Measured, prefix_cache_bytes: 0 },
        metrics.clone(),
    )?;
    let vocab = engine.spec().vocab_size;
    let mut receivers = Vec::with_capacity(n);
    for i in 0..n {
        let (tx, rx) = unbounded_channel();
        let mut prompt = random_prompt(vocab, prompt_tokens + i);
        prompt.drain(..i); // distinct prompts of equal length
        let job = Job {
            prompt,
            max_tokens: decode_tokens,
            sampling: SamplingParams::default(),
            stop: Vec::new(),
            ignore_eos: true,
            events: tx,
            label: None,
            keep_special: false,
        };
        if scheduler.submit(job).is_err() {
            bail!("the scheduler refused bench stream {i}");
        }
        receivers.push(rx);
    }
    for (i, mut rx) in receivers.into_iter().enumerate() {
        loop {
            match rx.blocking_recv() {
                Some(Event::Text(_)) => {}
                Some(Event::Done(f)) => {
                    if f.completion_tokens != decode_tokens {
                        bail!("stream {i} generated {} tokens, not {decode_tokens}", f.completion_tokens);
                    }
                    break;
                }
                Some(Event::Failed(e)) => bail!("stream {i}: {e}"),
                None => bail!("stream {i} ended without finishing"),
            }
        }
    }
    scheduler.shutdown();
    let _ = worker.join();
    Ok(metrics.decode_totals())
}

/// What the hybrid hand-offs of one run's batched steps did, per step.
#[derive(Clone, Copy)]
struct BatchedHandoffs {
    steps: f64,
    /// Distinct routed experts the CPU read per MoE layer.
    distinct_experts: f64,
    experts_ms: f64,
    expert_gb_s: f64,
    gpu_wait_ms: f64,
}

/// The benchmark over each count in `streams`; prints a table with `text`.
pub(crate) fn streams(
    dir: &Path,
    config: &EngineConfig,
    streams: &[usize],
    prompt_tokens: usize,
    decode_tokens: usize,
    text: bool,
) -> anyhow::Result<Value> {
    if streams.contains(&0) {
        bail!("--streams: every count must be at least 1");
    }
    if decode_tokens < 2 {
        bail!("--decode-tokens must be at least 2 with --streams (the first token comes from the prefill)");
    }
    let codec = ModelFiles::open(dir)?.text_codec().context("--streams detokenises like the server")?;
    let (opened, _) = open_for_bench(dir, config, text)?;
    let engine: Arc<dyn Engine> = Arc::from(opened.engine);
    if text {
        println!("{}", engine.describe());
    }
    run_streams(&engine, &codec, 1, prompt_tokens, WARMUP_TOKENS, false)?;
    let mut rows = Vec::new();
    let mut one = None;
    let moe_layers = engine.spec().moe_layers().count() as u64;
    for &n in streams {
        let before = engine.stats(None).batch_handoffs;
        let (tokens, secs) = run_streams(&engine, &codec, n, prompt_tokens, decode_tokens, false)?;
        let tok_s = tokens as f64 / secs.max(1e-9);
        // Hybrid: what the CPU did per batched step (the routed experts of all the streams).
        let after = engine.stats(None);
        let handoffs = match (before, after.batch_handoffs) {
            (Some(b), Some(a)) if a.calls > b.calls && moe_layers > 0 => {
                let steps = (a.calls - b.calls) as f64 / moe_layers as f64;
                let reads = (a.experts_read - b.experts_read) as f64;
                let experts_s = (a.experts - b.experts).as_secs_f64();
                Some(BatchedHandoffs {
                    steps,
                    distinct_experts: reads / (steps * moe_layers as f64),
                    experts_ms: 1e3 * experts_s / steps,
                    expert_gb_s: reads * after.expert_bytes.unwrap_or(0) as f64 / experts_s.max(1e-9) / 1e9,
                    gpu_wait_ms: 1e3 * (a.wait - b.wait).as_secs_f64() / steps,
                })
            }
            _ => None,
        };
        // The same streams with one engine step per sequence: what batching gains, in one run.
        let serial_tok_s = if n > 1 {
            let (t, s) = run_streams(&engine, &codec, n, prompt_tokens, decode_tokens, true)?;
            Some(t as f64 / s.max(1e-9))
        } else {
            None
        };
        let base = *one.get_or_insert(if n == 1 { tok_s } else { f64::NAN });
        if text {
            let vs = if base.is_nan() { String::new() } else { format!(", {:.2}× one stream", tok_s / base) };
            let serial = serial_tok_s.map_or(String::new(), |s| format!("; one step per stream: {s:.2} tok/s"));
            println!(
                "streams {n:>2}: aggregate decode {tok_s:8.2} tok/s ({:.2} tok/s per stream{vs}; {tokens} tokens in {secs:.2} s{serial})",
                tok_s / n as f64
            );
            if let Some(h) = &handoffs {
                println!(
                    "            batched steps: {:.1} distinct routed experts per MoE layer, CPU experts {:.2} ms per step ({:.1} GB/s), waiting for the GPU {:.2} ms",
                    h.distinct_experts, h.experts_ms, h.expert_gb_s, h.gpu_wait_ms
                );
            }
        }
        rows.push(json!({"streams": n, "decode_tokens": tokens, "decode_s": secs, "aggregate_tok_s": tok_s,
                         "per_stream_tok_s": tok_s / n as f64, "serial_aggregate_tok_s": serial_tok_s,
                         "hybrid_batched_handoffs": handoffs.map(|h| json!({
                             "batched_steps": h.steps, "distinct_experts_per_moe_layer": h.distinct_experts,
                             "cpu_experts_ms_per_step": h.experts_ms, "cpu_expert_gb_s": h.expert_gb_s,
                             "gpu_wait_ms_per_step": h.gpu_wait_ms}))}));
    }
    Ok(json!({"device": engine.device().name(), "prompt_tokens": prompt_tokens,
               "decode_tokens_per_stream": decode_tokens, "runs": rows}))
}
